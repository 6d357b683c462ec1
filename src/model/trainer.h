// CPU fp32 training of a glm5_next model: JSONL data with optional loss masks, packed batches, gradient
// accumulation, AdamW (optim.h) and checkpoints that resume bit for bit.
#pragma once
#include <csignal>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "model/lora.h"
#include "model/model.h"
#include "model/optim.h"
#include "model/train.h"

namespace nextlm {

// One training sequence: its tokens and, optionally, a 0/1 (or any non-negative) weight per token saying whether
// the token is predicted (PackedBatch::target_weight; prompt tokens 0). Empty mask: every token counts.
struct TrainExample {
  std::vector<int32_t> tokens;
  std::vector<float> mask;
};

// Reads JSONL lines {"tokens": [...], "loss_mask": [...]} ("loss_mask" optional, same length, values 0 or 1). A
// sequence longer than max_len is cut into pieces of at most max_len tokens (a packed batch holds at most
// --batch-tokens tokens); a 1-token piece predicts nothing and is dropped. Errors name the file and line.
std::vector<TrainExample> read_train_jsonl(const std::string& path, int64_t vocab_size, int64_t max_len);

struct TrainOptions {
  int64_t steps = 100;          // optimizer steps in total (the schedule's length)
  int64_t warmup = 10;          // linear warmup steps
  int64_t batch_tokens = 2048;  // tokens per packed micro-batch, at most
  int64_t grad_accum = 1;       // micro-batches per optimizer step
  double clip = 1.0;            // global grad-norm bound (0: none)
  double min_lr_ratio = 0.1;    // the cosine's floor, as a fraction of the peak lr
  uint64_t seed = 0;            // init (with --config), LoRA init and data order
  AdamWOptions adamw;
  // Which sub-layers the backward recomputes and which keep their activations from the forward (train.h): memory
  // against time, the same results under every policy.
  RecomputePolicy recompute;
  // LoRA fine-tuning (model/lora.h): only the adapters train, the model given is the frozen base. base_model is
  // its directory, recorded in the checkpoint so that a resume can load it again.
  std::optional<LoraOptions> lora;
  std::string base_model;
};

// Where the data stream stands: epoch e visits the sequences in a permutation drawn from (seed, e); cursor is the
// next index into it. This, with the step count, is all a resume needs (no other random state is used).
struct DataPosition {
  int64_t epoch = 0;
  int64_t cursor = 0;
};

struct StepStats {
  int64_t step = 0;         // 1-based number of the step just taken
  double loss = 0.0;        // mean loss per predicted token over the step's micro-batches (nats)
  double lr = 0.0;
  double grad_norm = 0.0;   // before clipping, of the per-token-mean gradient
  int64_t tokens = 0;       // tokens in the step's batches
  double seconds = 0.0;     // wall time of the step
};

// The shapes of a checkpoint's tensors by name (hub names, e.g. model.language_model.layers.0.self_attn.q_proj.weight).
using TensorShapes = std::map<std::string, std::vector<int64_t>>;
// Those of the checkpoint in DIR (model.safetensors or the shards of its index), from the safetensors headers alone:
// no tensor's data is read.
TensorShapes read_tensor_shapes(const std::string& dir);

// Where a LoRA trainer's frozen base lives.
enum class LoraBase {
  // In the trainer's Model, in fp32, with W + s·B·A merged into it after every step (the CPU path).
  Host,
  // In its checkpoint (TrainOptions::base_model) only: the trainer holds the config, the adapters and their
  // optimizer state, and the gradient function reads the base itself (`train --device cuda --lora-rank`, where the
  // GPU holds it in bf16). A 313B base would take 1.25 TB of host memory in fp32; this takes none.
  Disk,
};

class Trainer {
 public:
  // Starts from `model` with fresh optimizer state (with opt.lora: fresh adapters on `model`, which stays frozen).
  // data must not be empty.
  Trainer(Model model, std::vector<TrainExample> data, TrainOptions opt);
  // A LoRA trainer with its base on disk (LoraBase::Disk; opt.lora required): the model's config and the base's
  // tensor shapes (read_tensor_shapes(opt.base_model)) are all it reads of the base. The adapters are those the
  // constructor above makes for the same config, options and seed, bit for bit; each adapted projection must be in
  // base_shapes with the adapter's [out, in] shape (Error otherwise, naming it). Neither the base's weights, nor a
  // merged model, nor full-model gradients are ever allocated: step() needs set_gradient_fn, and model() is an
  // Error.
  Trainer(ModelConfig config, const TensorShapes& base_shapes, std::vector<TrainExample> data, TrainOptions opt);
  // The same, reading opt.base_model/config.json and the checkpoint's headers.
  static Trainer with_base_on_disk(std::vector<TrainExample> data, TrainOptions opt);
  // params_ points into model_ and grads_: a move keeps those buffers (std::vector moves its storage), a copy would
  // not.
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;
  Trainer(Trainer&&) = default;

  // One optimizer step: grad_accum packed micro-batches, gradients averaged over their predicted tokens, clipped,
  // one AdamW update at the schedule's learning rate.
  StepStats step();

  // What computes a micro-batch's loss L and its gradients for the current weights: model_forward_backward on the
  // CPU by default; `train --device cuda` plugs in the GPU's. Without LoRA it adds dL/dθ into grads (zeros_like
  // layout); with LoRA, `lora` is the adapter (A and B current) and it adds dL/dA, dL/dB into the modules' dA, dB
  // (grads is then unused). `version` changes exactly when the trained values have (the optimizer steps taken),
  // so an engine holding a copy of them knows when to refresh it. With the base on disk, `model` holds the config
  // and no weight, and grads is empty: the function reads the base from options().base_model itself.
  using GradientFn = std::function<double(const Model& model, LoraAdapter* lora, int64_t version,
                                          const PackedBatch& batch, ModelWeights& grads)>;
  void set_gradient_fn(GradientFn f) { grad_fn_ = std::move(f); }

  // A LoRA run's optimizer on the device that holds the adapters' gradients (`train --device cuda --lora-rank`):
  // `update` gets the step's learning rate, the step count after it, the gradients' scale (1 / the step's prediction
  // weight) and the clipping norm, clips and updates the adapters it holds and returns the gradient norm before
  // clipping; `fetch` copies its adapters and moments into the trainer's. The trainer's own adapters, moments and
  // merged model then lag behind until save() fetches them (nothing is merged on the host between saves).
  struct DeviceOptimizer {
    std::function<double(double lr, int64_t t, double scale, double max_norm)> update;
    std::function<void(LoraAdapter& adapter, AdamW& state)> fetch;
  };
  void set_device_optimizer(DeviceOptimizer d) { device_opt_ = std::move(d); }
  // The AdamW state (moments and step count) as of the last step, or with a device optimizer as of the last fetch.
  const AdamW& optimizer() const { return adam_; }

  // Writes DIR (created, or replaced as a whole): config.json + model.safetensors (a model dir Model::load reads),
  // optimizer.safetensors (moments, under the tensors' names) and trainer_state.json (step, data position,
  // options). The new checkpoint is built beside DIR and swapped in with one rename, so DIR is always a complete
  // checkpoint, old or new.
  // With LoRA the checkpoint holds the adapter instead of the model: adapter_model.safetensors +
  // adapter_config.json (a PEFT directory, for `score --adapter` and `merge`), with the same optimizer and state
  // files; resume() loads the base model from options().base_model. Both places of the base write the same files.
  void save(const std::string& dir);  // fetches a device optimizer's state first
  // A trainer in exactly the state save() recorded; `opt` replaces the stored options (pass stored_options(dir)
  // to keep them). A LoRA checkpoint resumes with its base where `base` says (LoraBase::Disk reads only the base's
  // config and tensor shapes, as with_base_on_disk); `base` is ignored without LoRA.
  static Trainer resume(const std::string& dir, std::vector<TrainExample> data, TrainOptions opt,
                        LoraBase base = LoraBase::Host);
  static TrainOptions stored_options(const std::string& dir);

  // The model trained (with LoRA: the base with the adapters merged in, W + s·B·A; with a device optimizer, as of
  // the last save). An Error when the LoRA base is on disk: there is no host model then.
  const Model& model() const;
  // Host unless this is a LoRA trainer with its base on disk.
  LoraBase lora_base() const { return base_; }
  const LoraAdapter* lora() const { return lora_ ? &*lora_ : nullptr; }
  int64_t num_trainable() const;
  const TrainOptions& options() const { return opt_; }
  int64_t steps_done() const { return adam_.steps(); }
  DataPosition data_position() const { return pos_; }

 private:
  PackedBatch next_batch();
  void reset_params();
  void init_optimizer();  // the constructors' common end: parameters, fresh AdamW state, the first epoch's order

  Model model_;  // with the LoRA base on disk: the config and no weight
  std::vector<TrainExample> data_;
  TrainOptions opt_;
  ModelWeights grads_;
  std::vector<ParamRef> params_;
  AdamW adam_;
  DataPosition pos_;
  std::vector<int64_t> order_;  // the current epoch's permutation
  std::optional<LoraAdapter> lora_;
  std::vector<Tensor> lora_base_;  // the base weights under the adapters (LoraAdapter::capture); empty on disk
  LoraBase base_ = LoraBase::Host;
  GradientFn grad_fn_;             // empty: model_forward_backward
  DeviceOptimizer device_opt_;     // empty: clipping and AdamW on the host
  bool device_stale_ = false;      // the device optimizer has stepped since the last fetch
};

// The order in which epoch `epoch` visits n sequences (Fisher–Yates from a generator seeded by seed and epoch).
std::vector<int64_t> epoch_order(int64_t n, uint64_t seed, int64_t epoch);

// The next packed micro-batch of the data stream: whole sequences in epoch order (order holds epoch pos.epoch's
// permutation; both advance across epochs) until the next would pass opt.batch_tokens, with target_weight from the
// loss masks when any sequence has one. The Trainer's stream, shared with the data-parallel trainer (src/dist).
PackedBatch next_packed_batch(const std::vector<TrainExample>& data, const TrainOptions& opt, DataPosition& pos,
                              std::vector<int64_t>& order);

// The number of predictions of a batch, weighted: every token but each sequence's first, times its target_weight.
// The step's loss and gradient are divided by its sum over the micro-batches.
double prediction_weight(const PackedBatch& b);

// trainer_state.json without the options (stored_options reads those).
struct TrainerState {
  int64_t step = 0;
  DataPosition pos;
  size_t num_sequences = 0;
};
TrainerState read_trainer_state(const std::string& dir);

// Writes the checkpoint DIR as Trainer::save does, atomically: write_model(tmp) fills the new directory with the
// model (or adapter) files, then optimizer.safetensors (`moments`, named exp_avg.NAME / exp_avg_sq.NAME) and
// trainer_state.json, and the directory is swapped in with one rename.
void write_training_checkpoint(const std::string& dir, const std::function<void(const std::string& tmp)>& write_model,
                               const std::vector<TensorToWrite>& moments, const TrainerState& state,
                               const TrainOptions& opt);

// Reads the AdamW moments of `params` from the checkpoint DIR's optimizer.safetensors (exp_avg.NAME and
// exp_avg_sq.NAME, f32, each with its parameter's shape) into adam's m and v: what write_training_checkpoint wrote.
void read_moments(const std::string& dir, const std::vector<ParamRef>& params, AdamW& adam);
// The moments of `params` as write_training_checkpoint takes them (views into adam's m and v).
std::vector<TensorToWrite> moment_tensors(const std::vector<ParamRef>& params, const AdamW& adam);

// A training log row, and the loss curve of a log as a standalone SVG picture (plain text, no dependencies).
struct LogRow {
  int64_t step;
  double loss, lr, grad_norm;
  int64_t tokens;
  double seconds;
};
std::string loss_curve_svg(const std::vector<LogRow>& rows);

}  // namespace nextlm
