// The bf16 CUDA forward of the glm5_next text model on one GPU (host-facing API: no CUDA headers here).
// Weights live on the device in bf16, except the tensors the spec keeps in fp32 (conv, dt_bias, A_log, the
// correction bias) and the small norm / mHC tensors; activations between GEMMs are bf16, everything else fp32.
// The weights come from a loaded host Model, straight from a checkpoint directory (tensor by tensor from the mapped
// files, no fp32 host copy), or from a random initialisation done on the device.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/decode.h"
#include "model/dsa.h"
#include "model/lora.h"
#include "model/model.h"
#include "model/recompute.h"

namespace nextlm {

namespace dist {
class Comm;
}

// Whether a CUDA device is usable, and its name ("" when not).
std::string cuda_device_name(int device = 0);

// How the MoE experts run, process-wide (for benchmarks): a cuda::GroupedGemmKernel variant of the grouped GEMM
// (src/cuda/grouped_gemm.h: no host sync, SwiGLU fused; the default is 5, the TMA kernel in clusters of two, the
// fastest on the H200), or −1 for one cuBLASLt GEMM per expert after a host sync of the expert boundaries.
void set_moe_expert_gemm(int mode);
int moe_expert_gemm();
// The variant of training's input-gradient GEMMs (the weights read as [K, N]) when the forward's is a grouped GEMM:
// set apart (0 … kGroupedGemmKernels − 1), or by default (−2) the forward's, except that the TMA kernel in clusters of
// two (5) runs there in clusters of four (6) on row-major weights. On the H200 the clusters of four made the
// input-gradient pair (moe_grouped_gemm_dx_skewed) faster, 5.04/5.03 → 4.87/4.82 ms, and the forward pair slower,
// 4.88/4.87 → 5.08 ms. On weights in tiles (`tiles`; CudaModel::set_expert_layout) clusters of two are faster:
// 4.46 against 4.83 ms on that pair, and in the LoRA step's kernel traces the six input-gradient launches
// 14.6 against 15.8 ms.
void set_moe_expert_gemm_dx(int mode);
int moe_expert_gemm_dx(bool tiles = false);

// The layout of the routed experts' weights for a model of config c whose experts stay frozen (a LoRA or frozen-base
// training step; CudaModel::set_expert_layout): 2, the tiles, when its widths take them (hidden_size and
// moe_intermediate_size multiples of 128) and this process's expert GEMMs are the TMA variants (set_moe_expert_gemm,
// _dx); else 0, the rows.
int frozen_expert_layout(const ModelConfig& c);

// Where the routed experts' per-expert LoRA adapters run in training, process-wide (for benchmarks and tests), when
// the grouped GEMM is a wgmma kernel and the ranks fit (cuda::GroupedGemm::low_rank): 0 after each GEMM (the grouped
// LoRA kernels' read-modify-write of the output), 1 inside the forward GEMMs, 2 inside the forward GEMMs and the
// input-gradient GEMMs. The default is 2: on the H200, the LoRA step of bench/slice4 at 4096 tokens took 141.9,
// 140.0 and 137.4 ms with 0, 1 and 2 (two runs each, one call).
void set_expert_lora_fold(int mode);
int expert_lora_fold();

// Whether training's backward of a frozen mHC site (a LoRA step) forms the post-mix's dh term inside the pre-mix's
// dh kernel (cuda::mhc_pre_backward's dout and comb) instead of the post-mix's backward writing it and the pre-mix's
// reading it back: the same bits, 2·T·S·D floats less traffic a site. On by default; NEXTLM_MHC_MIX_FOLD=0 in the
// environment turns it off by default. Process-wide, for tests and benchmarks.
void set_mhc_mix_fold(bool on);
bool mhc_mix_fold();

// Whether the forward (training's and the prefill's) runs a site's mHC post-mix and the next site's projection as
// one kernel (cuda::mhc_post_project, where its shapes allow: more than 16 tokens, S <= 4, D a multiple of 1024),
// which does not read the new streams back (T·S·D floats a site), in place of the post-mix kernel and the
// projection's. The same bits either way. On by default; NEXTLM_MHC_POST_FUSION=0 in the environment turns it off
// by default. Process-wide, for tests and benchmarks; mhc_fused_posts() counts the fused kernels run so far in this
// process.
void set_mhc_post_fusion(bool on);
bool mhc_post_fusion();
int64_t mhc_fused_posts();

// Whether training stacks the dense LoRA adapters that read one input (a KDA layer's q, k, v, f_a, g_a and b; an
// MLA layer's q_a and kv_a; an MLP's gate and up): one GEMM for all their u, and in the backward one for all their
// dA and one for all their dx, in place of one each (on one GPU; the default). Process-wide, for tests and
// benchmarks; lora_stacked_groups() counts the groups stacked so far in this process.
void set_lora_stacking(bool on);
bool lora_stacking();
int64_t lora_stacked_groups();

// Whether training joins a dense projection and its adapters into one GEMM, [x | u]·[W | B]ᵀ, where that saves
// memory traffic (train.cu's joined_forward, 2·out > in: a KDA layer's q|k|v, f_b and g_b, an MLA layer's q_b and
// kv_b, the MLPs' gate|up, the shared expert's down; with a trained base only inputs up to 2048 wide; the default), in
// place of the adapters' products written first and the projection's GEMM adding onto them; and the input gradient
// of a frozen output projection and its adapter, [dy | s·dy·B]·[W ; A] (joined_backward: the KDA's and MLA's o, the
// dense MLP's down), in place of the adapter's product added onto the projection's. Process-wide, for tests and
// benchmarks; lora_joined_projections() counts the joined GEMMs run so far in this process,
// lora_joined_input_gradients() those of the second kind among them.
void set_lora_joining(bool on);
bool lora_joining();
int64_t lora_joined_projections();
int64_t lora_joined_input_gradients();

// Whether training forms the input gradient of a sub-layer's narrow projections of one input (the KDA's g_a, b and
// f_a; the MLA's kv_a and q_a) in one GEMM over their stacked weights, with their stacked LoRA group's, in place of
// one GEMM each adding onto the fp32 gradient (train.cu's Narrow; the default). Process-wide, for tests and
// benchmarks; narrow_joined_gradients() counts those GEMMs run so far in this process.
void set_narrow_joining(bool on);
bool narrow_joining();
int64_t narrow_joined_gradients();

// The most bytes of fp32 logits one row block of the lm_head holds in a training step (default 2 GiB; at least one
// row a block). Process-wide, for tests: a row's loss and gradients do not depend on its block but through the
// head GEMMs' summation order (cuBLASLt may pick other kernels for other block sizes).
void set_head_block_bytes(size_t bytes);
size_t head_block_bytes();

// One token's next-token distribution against a reference one (see CudaModel::compare_with_reference).
struct TokenComparison {
  double kl = 0;            // KL(ref ‖ ours) over the vocabulary
  int32_t argmax = 0;       // ours
  int32_t ref_argmax = 0;   // the reference's
  double logprob = 0;       // ours, log p(x[t+1] | x[..t]); 0 for a sequence's last token
};

// This rank's share of a tensor- and expert-parallel device model (the layout of src/dist/parallel_model.h): the
// KDA and MLA heads, the dense MLP's and the shared expert's width and the vocabulary split over `tp` ranks, the
// routed experts over `ep` ranks, everything else (mHC, norms, f_a, g_a, q_a, kv_a, the indexer, the router)
// replicated. Each rank reads only its slices of the checkpoint's tensors.
struct CudaShard {
  int tp_rank = 0, tp = 1;
  int ep_rank = 0, ep = 1;
};

class CudaModel {
 public:
  // Uploads the weights of a loaded (fp32 host) model.
  explicit CudaModel(const Model& model, int device = 0);
  // Reads DIR/config.json and the safetensors checkpoint in DIR (hub layout, sharded or not) and uploads every
  // text-model tensor as stored: bf16 tensors byte for byte, fp32 keep-tensors as fp32 (a tensor stored in another
  // float type is converted as Model::load would). Names and shapes are checked as Model::load checks them.
  static std::unique_ptr<CudaModel> load(const std::string& dir, int device = 0, const CudaShard& shard = {});
  // Random weights drawn on the device with the distributions of init_weights (src/model/init.h): normal(0,
  // initializer_range) linears, embedding and experts, norms 1, the KDA gate init, conv U(±1/√W), mHC fn
  // normal(0, 0.02) / base 0 / scale 1, correction bias 0, indexer ape 0 and gate 1. The same seed gives the same
  // weights; the values differ from init_weights' (another generator).
  // With a shard, each rank holds its slices of the same full random tensors (drawn whole on the device, then cut).
  static std::unique_ptr<CudaModel> random(const ModelConfig& config, uint64_t seed, int device = 0,
                                           const CudaShard& shard = {});
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  // The model's config (the full model's, also on a shard).
  const ModelConfig& config() const;
  const CudaShard& shard() const;
  // The CUDA stream every call of this model runs on (a cudaStream_t).
  void* stream() const;
  // The collectives of a sharded model: over its TP group and its EP group (either may be null when its size is 1;
  // they are the same object when tp == ep, which makes the groups equal). They get device pointers whose values
  // the work queued on stream() produces, and must order themselves after it (dist::NcclComm built on stream()),
  // or synchronise it. Must be set before a sharded model's first forward.
  void set_collectives(dist::Comm* tp, dist::Comm* ep);
  // Replaces every weight with a host model's (same config; bf16 on the way as at construction), in place: for a
  // trainer whose fp32 master weights live on the host.
  void set_weights(const Model& model);

  // Logits [T, V] in fp32 on the host.
  Tensor forward(const PackedBatch& batch);
  // log p(x[t+1] | x[..t]) per sequence; the lm_head runs in row blocks with a fused log-softmax.
  std::vector<std::vector<double>> next_token_logprobs(const PackedBatch& batch);
  // The forward up to the final norm, left on the device (for timing); returns after the stream synchronises.
  void forward_hidden_only(const PackedBatch& batch);

  // Test hooks: one sub-layer of layer `layer` (the attention one, or the feed-forward one when ffn) on an input
  // a [T, D] (rounded to bf16 on the way in, as the forward feeds it), returning y [T, D]. A shared-indexer DSA
  // layer is not supported here (it needs the previous layer's selection).
  std::vector<float> sublayer(int64_t layer, bool ffn, const std::vector<float>& a, const PackedBatch& batch);
  // mHC pre of one site on streams h [T, S, D]: post [T, S], comb [T, S, S] and the normed input a [T, D].
  void mhc_pre(int64_t layer, bool ffn, const std::vector<float>& h, std::vector<float>& post, std::vector<float>& comb,
               std::vector<float>& a);

  // For every token of the batch (packed order), our next-token distribution against a reference log-softmax:
  // ref_logp[n] points to sequence n's rows, fp32 [T_n, V] on the host. The lm_head runs in row blocks and only
  // the per-token results come back.
  std::vector<TokenComparison> compare_with_reference(const PackedBatch& batch,
                                                      const std::vector<const float*>& ref_logp);

  // Per-component milliseconds of the last forward when profiling is on (CUDA events around each part).
  void set_profiling(bool on);
  std::vector<std::pair<std::string, double>> profile() const;
  // Milliseconds of the last forward / next_token_logprobs / forward_hidden_only on the device's stream, from the
  // batch upload to the last kernel (CUDA events; host gaps inside the forward count).
  double last_forward_ms() const;

  // What a query whose selection is empty attends to in the forward (model/dsa.h): AllKeys (the default, as the
  // batch forward of transformers) or SeenKeys (as decoding; CudaDecoder's prefills always use it).
  void set_empty_selection(EmptySelection e);
  // Whether the KDA runs on the tensor-core kernels where they support the config (default) or on the fp32 ones.
  void set_kda_tensor_cores(bool on);
  // Whether training's chunked KDA backward forms its matrix products in bf16, one MMA each (as the tensor-core
  // forward does; ~1e-3 relative in the delta rule's gradients: the default), or in split bf16 (three MMAs, ~1e-5).
  // cuda::KdaBackwardProducts; the fp32 KDA core (set_kda_tensor_cores(false)) always takes the split products.
  // NEXTLM_KDA_BWD_BF16=0 in the environment makes split bf16 the default.
  void set_kda_backward_bf16(bool on);
  bool kda_backward_bf16() const;
  // Whether a training forward that keeps a KDA site's activations (the site is not recomputed) also keeps the
  // tensor-core recurrence's state entering every chunk and its v_new (fp32, H·K·(K + 64) floats a chunk: 384 MiB a
  // layer at 4096 tokens, H 64, K 128), so that the chunked backward takes them instead of running its first state
  // pass again (and differentiates the forward's own values). On by default; NEXTLM_KDA_KEEP_STATES=0 in the
  // environment makes the default off.
  void set_kda_keep_states(bool on);
  bool kda_keep_states() const;
  // Whether the forward's MLA attention runs the absorbed decoding kernels (over the normed latents) instead of
  // expanding every key and value through kv_b; batch-invariant mode always does. Off by default.
  void set_mla_absorbed(bool on);
  // Whether decoding steps outside batch-invariant mode run independent chains of kernels side by side on a second
  // stream (parallel branches of the step's graph): the MoE's shared expert beside the routing and the routed
  // experts, the DSA layer's appends and query absorption beside its projections and selection. The same kernels
  // on the same data either way, so the same bits. On by default; NEXTLM_DECODE_OVERLAP=0 makes the default off.
  void set_decode_overlap(bool on);
  // Whether the training step runs independent work of a sub-layer on a second stream: each MoE site's shared
  // expert beside the routing and the routed experts and each KDA layer's output gate beside its recurrence (forward
  // and backward), each DSA layer's indexer beside its projections (on one GPU, not on a shard). The same kernels on
  // the same data either way, so the same bits. On by default; NEXTLM_TRAIN_OVERLAP=0 in the environment makes the
  // default off.
  void set_train_overlap(bool on);
  bool train_overlap() const;
  // Whether the device LoRA optimizer's update (lora_adamw_step) runs on a stream of its own beside the next
  // forward_backward's forward, layer by layer, each layer waiting for its adapters' update (on one GPU, not on a
  // shard). The same kernels on the same tensors, so the same bits. Off by default: on an H100 the forward waited
  // for the update rather than ran beside it (no gain above the step's noise); NEXTLM_LORA_UPDATE_BESIDE=1 in the
  // environment makes the default on.
  void set_lora_update_beside(bool on);
  bool lora_update_beside() const;
  // How the routed experts' weights lie on the device (cuda::GroupedWeightLayout: 0 row-major, the default; 1 in
  // column blocks; 2 in 128 × 64 tiles), so that each TMA box of the grouped GEMM's weight tiles is fewer, longer runs
  // of memory. Converts them in place. Other layouts than the rows need the TMA variants of the grouped GEMM
  // (set_moe_expert_gemm, _dx): the per-expert GEMMs refuse them. set_weights keeps the layout.
  void set_expert_layout(int layout);
  // Whether the KDA runs on the tensor-core kernels now (set so, and the config's gate and head dim have them).
  bool kda_on_tensor_cores() const;
  // Batch-invariant mode (off by default): every dense projection on our own GEMM instead of cuBLASLt (cuda/gemm.h),
  // so a sequence's log-probs in a forward are bitwise the same whatever other sequences share its batch; and one
  // arithmetic for the forward and CudaDecoder: decoding steps use that GEMM too and the forward's MLA attention
  // runs the decoding kernels (the absorbed form; an empty selection then attends to the keys seen so far), so with
  // the tensor-core KDA a decoded token's logits equal the forward's for the same prefix bit for bit: the log-probs
  // of generation and of scoring agree exactly. Slower: the forward's attention reads the latents per head.
  void set_batch_invariant(bool on);

  // ---- Training (src/cuda/train.cu) ----
  // L = Σ_seq Σ_t −log p(x[t+1] | x[..t]) over the batch (each term weighted by batch.target_weight[t+1] when
  // given), and dL/dθ ADDED into the model's fp32 gradients on the device (zero when the first call makes them;
  // zero_grads() zeroes them): the device counterpart of model_forward_backward (model/train.h). The forward keeps
  // the streams entering each mHC site, each sub-layer's output and the DSA selections; the backward recomputes each
  // site's sub-layer up to its output projection (the MoE up to its experts' act), keeping its activations, right
  // before walking back through it, unless set_recompute keeps that sub-layer's activations from the forward.
  // Weights and GEMM inputs
  // are bf16; the KDA (forward chunked, backward through time) runs in fp32, the MLA attention's backward too (its
  // forward on the tensor-core kernel where it applies); the experts' forward and input gradients on the grouped
  // GEMM (their weight gradients one cuBLASLt GEMM per expert). The indexer and the correction bias are frozen, as on the CPU.
  double forward_backward(const PackedBatch& batch);
  void zero_grads();
  // Which sub-layers forward_backward runs again before their backward (model/train.h's RecomputePolicy; default
  // all). A kept component's sites keep their activations from the forward: the sub-layer's, its input and output
  // and the mHC mix that made the input (so `mhc` matters only at sites whose sub-layer is recomputed: kept, the
  // mix is not computed again). Every policy gives the same loss bit for bit and the same gradients up to the order
  // of the atomic additions that also separates two runs of one policy (the embedding's and the MLA keys'); keeping
  // trades device memory (the kept sites' activations, all at once) for the recomputation's time.
  // An adaptive policy ("auto") starts keeping everything and, when a forward_backward runs out of device memory,
  // frees the activations, zeroes the gradients and runs the batches since the last zero_grads and the failed one
  // again under the next rung (model/recompute.h; a line on stderr says so), so that the gradients and losses are
  // those of that rung; on a shard it is the fixed default. Setting a policy forgets those batches.
  void set_recompute(const RecomputePolicy& policy);
  // The policy in use: an adaptive one's flags are its current rung.
  const RecomputePolicy& recompute() const;
  // A cap on the device memory of a step's activations, as if the device had no more (0, the default: none): the
  // tests run the adaptive policy out of it. activation_peak: the most the last forward_backward held at once.
  void set_activation_limit(size_t bytes);
  size_t activation_peak() const;
  // Whether the backward computes the gradients of the linear weights (projections, experts, embedding, lm_head; on
  // by default). Off, only the small fp32 tensors (norms, mHC, conv, gates) get theirs, while the input gradients
  // flow through everything: the cost of a LoRA step's frozen base. Changing it drops the gradients.
  void set_train_linears(bool on);
  // The same for the small fp32 tensors (norms, mHC, conv, dt_bias, A_log; on by default): a LoRA step whose
  // optimizer moves the adapters alone turns both off, and the backward forms neither (gradients() reads zeros for
  // them); the loss is the same either way, the adapters' gradients up to the atomics' order that also separates
  // two runs (the mHC pre backward's dh is the same bits).
  void set_train_small(bool on);

  // LoRA (model/lora.h) on the device: every module of the adapter sits on its projection, the forwards of
  // forward_backward add s·(x·Aᵀ)·Bᵀ to it (bf16 copies of A and B) and its backward adds dA and dB (fp32, on the
  // device) from each projection's input and output gradient, without the full weight gradient. Call again after
  // each optimizer step to upload the new A and B (the same adapter layout keeps the device gradients; another
  // layout replaces them, zeroed). Only forward_backward applies the adapters (score and decoding run the base).
  void set_lora(const LoraAdapter& adapter);
  // Adds the device's dA, dB into the adapter's modules' (the adapter set_lora got, or one of the same layout).
  // On a shard, set_lora takes the full model's adapter and keeps this rank's part of each module (B's rows of an
  // output-split projection, A's columns of an input-split one, the routed experts held here), and lora_gradients
  // adds this rank's share: the summed gradient of the part it holds at its place, weighted 1/(ranks holding the
  // same part), so that the sum over the world's ranks of what they add is the gradient (a collective over the
  // model's groups; the caller sums over the world).
  void lora_gradients(LoraAdapter& adapter) const;
  // AdamW for the adapters on the device (one GPU, not a shard), so that a LoRA step moves nothing to the host:
  // start_lora_optimizer copies the fp32 A and B of `adapter` (the layout set_lora placed) and the moments of
  // `state` (zeros when null or empty; parallel to adapter.params()) to the device. Each lora_adamw_step then takes
  // the device gradients (summed since zero_grads) times grad_scale, clips their global norm to max_norm (when > 0),
  // applies AdamW (model/optim.h's arithmetic; t the step count after this update) to the device's fp32 values and
  // refreshes the bf16 copies the forward reads; it returns the norm before clipping (one small transfer) as soon as
  // the norm is known, the update still running on the device (whatever reads the adapters next is queued after it;
  // with lora_update_beside the update runs beside the next forward_backward's forward, each layer's adapters updated
  // before that layer runs).
  // download_lora copies the values (and the moments into `state`) back, for checkpoints. set_lora drops the
  // device optimizer (the host's values are the ones to use then).
  void start_lora_optimizer(const LoraAdapter& adapter, const AdamW* state = nullptr);
  double lora_adamw_step(const AdamWOptions& opt, double lr, int64_t t, double grad_scale, double max_norm);
  void download_lora(LoraAdapter& adapter, AdamW* state) const;
  // The accumulated gradients on the host, shaped as zeros_like(weights) (model/backward.h): the indexer and the
  // correction bias empty; with tied embeddings the lm_head's gradient is added into the embedding's.
  // On a shard (forward_backward runs the TP/EP backward with its collectives; see src/cuda/train.cu): this rank's
  // slices in the layout of dist::ShardedModel's weights, the router's gradient summed over EP, those of the
  // replicated tensors that feed only this rank's heads (KDA f_a, g_a, o_norm; MLA q_a, kv_a and their norms)
  // partial sums, which dist::gather_gradients adds up when it assembles the full tensors (a collective).
  ModelWeights gradients() const;

  // The internals (src/cuda/model_impl.h), shared by the forward, the decoder and the training backward.
  struct Impl;

 private:
  friend class CudaDecoder;
  explicit CudaModel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Incremental decoding on the device (the GPU counterpart of src/model/decode.h): a fixed number of slots, each
// holding one sequence's caches for up to max_len tokens (KDA conv histories and fp32 recurrent states, the normed
// MLA latents in bf16, the indexer's pool keys and its incomplete pool's keys and gate scores). Prompts are
// prefilled through the packed forward, which fills the caches on its way; then any set of slots steps one token at
// a time through the decoding kernels (src/cuda/decode_kernels.h), whose reductions run in orders fixed by the
// shapes alone: a slot's logits are bitwise the same whatever other slots step with it. (A prefill goes through the
// cuBLASLt GEMMs of the forward, so its results may depend on the other prompts of the same prefill call, unless
// the model is in batch-invariant mode.) With the tensor-core KDA a slot keeps its state at the last 64-token chunk
// boundary and the inputs of the partial chunk since, and each step recomputes that chunk on the forward's kernels.
// Empty selections attend to the keys seen so far (EmptySelection::SeenKeys), as the CPU decoder does.
// Refers to its model, which must outlive it; the model must not run a forward while a step is in flight (they
// share the stream and the arena; every call here returns synchronised).
class CudaDecoder {
 public:
  CudaDecoder(CudaModel& model, int64_t max_seqs, int64_t max_len);
  ~CudaDecoder();
  CudaDecoder(const CudaDecoder&) = delete;
  CudaDecoder& operator=(const CudaDecoder&) = delete;

  int64_t max_seqs() const;
  int64_t max_len() const;
  int64_t length(int64_t slot) const;  // tokens in the slot; 0 when empty
  // Empties a slot (its caches are zeroed, so it may be prefilled or stepped from scratch).
  void clear(int64_t slot);

  // Prefills empty slots (distinct) with prompts (non-empty) as one packed batch; returns the logits [V] of each
  // prompt's last token.
  std::vector<std::vector<float>> prefill(const std::vector<int64_t>& slots,
                                          const std::vector<std::vector<int32_t>>& prompts);
  // Appends one token to each of the slots (distinct; an empty slot starts a sequence) and returns the next-token
  // logits [V] of each.
  std::vector<std::vector<float>> step(const std::vector<int64_t>& slots, const std::vector<int32_t>& tokens);
  // step without copying the logits back (for timing); returns after the stream synchronises.
  void step_no_copy(const std::vector<int64_t>& slots, const std::vector<int32_t>& tokens);
  // Milliseconds of the last prefill or step on the device's stream (CUDA events).
  double last_ms() const;
  // Steps replayed from CUDA graphs (on by default; off while the model profiles): the first step of a batch size
  // runs plainly, the second is captured, later ones replay it, with the same kernels on the same buffers, so the
  // results are bitwise those of plain steps.
  void set_graphs(bool on);

 private:
  // Runs a step; returns the logits fp32 [B, V] in the model's arena (valid until its next call).
  const float* run_step(const std::vector<int64_t>& slots, const std::vector<int32_t>& tokens);
  struct State;
  std::unique_ptr<State> st_;
};

// generate (src/model/decode.h) on the device: one slot of a CudaDecoder, the same sampler and stopping rules.
Generation cuda_generate(CudaModel& model, const std::vector<int32_t>& prompt, const GenerateOptions& opt);

}  // namespace nextlm
