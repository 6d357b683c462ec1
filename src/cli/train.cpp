// `nextlm train`: the command-line driver of the training loop (model/trainer.h, or dist/parallel_trainer.h under
// mpirun; with --device cuda the GPU computes the gradients, and with --tp/--ep LoRA trains on GPU shards,
// dist/cuda_parallel.h): argument checks before any output exists, a progress line per step, a CSV log with an SVG
// loss curve, periodic checkpoints, and a checkpoint on ctrl-C. Under mpirun every rank trains and world rank 0
// alone prints and writes.
#include "cli/train.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <new>
#include <numeric>
#include <optional>
#include <sstream>

#include "cpu/linear.h"
#ifdef NEXTLM_HAVE_CUDA
#include "cuda/device_model.h"
#endif
#ifdef NEXTLM_HAVE_NCCL
#include "dist/cuda_parallel.h"
#endif
#include "dist/parallel_trainer.h"
#include "io/atomic_file.h"
#include "model/init.h"
#include "model/train.h"
#include "model/trainer.h"

namespace nextlm {
namespace {

namespace fs = std::filesystem;

volatile std::sig_atomic_t g_interrupted = 0;
void on_sigint(int) { g_interrupted = 1; }

// Catches SIGINT while alive: the loop finishes its step, saves and exits. SA_RESETHAND makes a second ctrl-C kill
// the process at once, for when a step takes too long.
class SigintGuard {
 public:
  SigintGuard() {
    g_interrupted = 0;
    struct sigaction sa {};
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESETHAND;
    sigaction(SIGINT, &sa, &old_);
  }
  ~SigintGuard() { sigaction(SIGINT, &old_, nullptr); }

 private:
  struct sigaction old_ {};
};

// The checkpoint directory a --resume DIR names: DIR itself, DIR/checkpoint (an --out directory), or the copy
// moved aside while a save was swapping it in.
std::string find_checkpoint(const std::string& dir) {
  for (const fs::path& p : {fs::path(dir), fs::path(dir) / "checkpoint", fs::path(dir) / "checkpoint.old"})
    if (fs::exists(p / "trainer_state.json")) return p.string();
  fail("--resume ", dir, ": no training checkpoint there (expected trainer_state.json in it or in its checkpoint/)");
}

std::string fmt(const char* f, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}

std::string duration(double s) {
  const int64_t t = static_cast<int64_t>(s + 0.5);
  std::ostringstream o;
  if (t >= 3600) o << t / 3600 << "h";
  if (t >= 60) o << (t / 60) % 60 << "m";
  o << t % 60 << "s";
  return o.str();
}

// The policy as the header and the summary print it: an adaptive one with the rung it is at (on the GPU) or the
// fixed policy it stands for (the CPU), e.g. "auto (none)".
std::string describe_recompute(const RecomputePolicy& p, bool gpu) {
  if (!p.adaptive) return recompute_to_string(p);
  RecomputePolicy rung = gpu ? p : fixed_recompute(p);
  rung.adaptive = false;
  return "auto (" + recompute_to_string(rung) + ")";
}

// Peak resident memory of the process so far (getrusage's ru_maxrss, KiB on Linux), in MiB.
double peak_rss_mib() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / 1024.0;
}

std::string csv_row(const LogRow& r) {
  std::ostringstream o;
  o << r.step << "," << fmt("%.9g", r.loss) << "," << fmt("%.9g", r.lr) << "," << fmt("%.9g", r.grad_norm) << ","
    << r.tokens << "," << fmt("%.6g", r.seconds) << "\n";
  return o.str();
}

// The rows of an earlier log up to step `upto` (a resumed run continues its log).
std::vector<LogRow> read_log(const std::string& path, int64_t upto) {
  std::vector<LogRow> rows;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    LogRow r{};
    if (std::sscanf(line.c_str(), "%ld,%lf,%lf,%lf,%ld,%lf", &r.step, &r.loss, &r.lr, &r.grad_norm, &r.tokens,
                    &r.seconds) == 6 &&
        r.step <= upto)
      rows.push_back(r);
  }
  return rows;
}

std::string svg_path(const std::string& csv) {
  fs::path p(csv);
  return p.replace_extension(".svg").string();
}

void write_text(const std::string& path, const std::string& text) {
  AtomicFile f(path);
  f.write(text);
  f.commit();
}

}  // namespace

CLI::App* add_train_command(CLI::App& app, TrainArgs& a) {
  CLI::App* tr = app.add_subcommand("train", "train on JSONL token sequences (AdamW; CPU fp32 or CUDA bf16)");
  tr->add_option("--config", a.config, "config.json of a new model (random init from --seed)");
  tr->add_option("--model", a.model, "model directory to start from (fresh optimizer)");
  tr->add_option("--data", a.data, "JSONL, one {\"tokens\": [...], \"loss_mask\": [0/1...]} per line")->required();
  tr->add_option("--out", a.out, "output directory (checkpoint/, train_log.csv, train_log.svg)")->required();
  tr->add_option("--steps", a.steps, "optimizer steps in total")->capture_default_str();
  tr->add_option("--lr", a.lr, "peak learning rate")->capture_default_str();
  tr->add_option("--warmup", a.warmup, "linear warmup steps (then cosine decay to lr/10)")->capture_default_str();
  tr->add_option("--batch-tokens", a.batch_tokens, "tokens per packed micro-batch, at most")->capture_default_str();
  tr->add_option("--grad-accum", a.grad_accum, "micro-batches per step")->capture_default_str();
  tr->add_option("--weight-decay", a.weight_decay, "AdamW decoupled weight decay")->capture_default_str();
  tr->add_option("--adam-eps", a.adam_eps, "AdamW epsilon (added to sqrt(v); torch's eps)")->capture_default_str();
  tr->add_option("--clip", a.clip, "global gradient-norm bound (0 = none)")->capture_default_str();
  tr->add_option("--seed", a.seed, "seed of the init and the data order")->capture_default_str();
  tr->add_option("--save-every", a.save_every, "checkpoint every N steps (0 = only at the end)")->capture_default_str();
  tr->add_option("--resume", a.resume, "continue from this checkpoint (or --out directory)");
  tr->add_option("--threads", a.threads, "CPU threads (default: all)");
  tr->add_option("--tp", a.tp,
                 "tensor-parallel ranks (divides the head counts; under mpirun -np N, divides N, and the N / lcm(tp, "
                 "ep) replicas split each step's sequences; --device cuda with --lora-rank: one GPU a rank, without "
                 "mpirun lcm(tp, ep) GPUs as threads of this process)")
      ->capture_default_str();
  tr->add_option("--ep", a.ep,
                 "expert-parallel ranks (divides n_routed_experts; otherwise as --tp)")
      ->capture_default_str();
  tr->add_option("--recompute", a.recompute,
                 "sub-layers the backward runs forward again (the others keep their activations from the forward: "
                 "more memory, less time, the same results but for the kept KDA chunk states' bf16 rounding): auto, "
                 "all, none, or a comma-separated list of kda, mla, moe, experts, mlp, mhc, states (experts: the "
                 "routed experts' gate|up inside a recomputed MoE; states: a kept KDA layer's chunk states; both on "
                 "the GPU). auto: on one GPU everything kept, falling back to states, kda,mla,moe,mhc and then all "
                 "when a step runs out of device memory; on the CPU and on GPU shards (--tp/--ep) kda,mla,moe,mhc")
      ->type_name("POLICY")
      ->capture_default_str();
  tr->add_option("--device", a.device,
                 "where the gradients are computed: cpu, or cuda in a CUDA build (bf16 weights and GEMMs on the GPU; "
                 "the fp32 master weights, the optimizer and the checkpoints stay on the host; with --lora-rank the "
                 "whole step runs on the GPU, which reads the frozen base from its checkpoint, and the host holds "
                 "only the adapters; with --tp/--ep too, each GPU reads its slices of the base and the host runs the "
                 "adapters' AdamW)")
      ->capture_default_str();
  tr->add_option("--log", a.log, "CSV log (default OUT/train_log.csv); the SVG curve goes beside it");
  tr->add_option("--lora-rank", a.lora_rank, "train LoRA adapters of this rank on the --model (frozen) instead");
  tr->add_option("--lora-alpha", a.lora_alpha, "LoRA alpha: W + (alpha/rank)·B·A (default: the rank)");
  tr->add_option("--lora-targets", a.lora_targets,
                 "projections to adapt: all, kda, mla, mlp, shared_experts, experts, a projection (o_proj) or "
                 "GROUP.PROJECTION (kda.o_proj), comma-separated")
      ->capture_default_str();
  tr->add_option("--lora-experts", a.lora_experts, "routed experts: per-expert adapters or one shared per layer")
      ->capture_default_str();
  tr->add_flag("--lora-rank-div-topk", a.lora_rank_div_topk, "routed-expert adapters get rank / num_experts_per_tok");
  return tr;
}

int cmd_train(const TrainArgs& a, const CLI::App& cmd) {
  // Everything that can be checked is checked before the output directory is created.
  const int sources = !a.config.empty() + !a.model.empty() + !a.resume.empty();
  if (sources != 1) throw TrainUsageError("give exactly one of --config, --model and --resume");
  auto given = [&](const char* flag) { return cmd.get_option(flag)->count() > 0; };
  if (a.steps < 0) throw TrainUsageError("--steps must be >= 0");
  if (!(a.lr > 0 && std::isfinite(a.lr))) throw TrainUsageError("--lr must be a finite number > 0");
  if (a.warmup < 0) throw TrainUsageError("--warmup must be >= 0");
  // A packed batch indexes its tokens with 32-bit positions (and the data stream would cycle the epochs that long).
  if (a.batch_tokens < 2 || a.batch_tokens > std::numeric_limits<int32_t>::max())
    throw TrainUsageError("--batch-tokens must be from 2 to 2147483647");
  if (a.grad_accum < 1) throw TrainUsageError("--grad-accum must be >= 1");
  if (!(a.weight_decay >= 0 && std::isfinite(a.weight_decay)))
    throw TrainUsageError("--weight-decay must be a finite number >= 0");
  if (!(a.clip >= 0)) throw TrainUsageError("--clip must be >= 0");
  if (!(a.adam_eps > 0 && std::isfinite(a.adam_eps))) throw TrainUsageError("--adam-eps must be > 0");
  if (a.save_every < 0) throw TrainUsageError("--save-every must be >= 0");
  if (a.threads < 0 || a.threads > 1024) throw TrainUsageError("--threads must be from 1 to 1024");
  if (a.tp < 1) throw TrainUsageError("--tp must be >= 1");
  if (a.ep < 1) throw TrainUsageError("--ep must be >= 1");
  std::optional<RecomputePolicy> recompute;
  if (given("--recompute")) {
    try {
      recompute = parse_recompute(a.recompute);
    } catch (const Error& e) {
      throw TrainUsageError(std::string("--recompute: ") + e.what());
    }
  }
  // Under mpirun (or with --tp/--ep) every rank trains its slices on its replica's share of the data.
  const bool parallel = a.tp > 1 || a.ep > 1 || dist::launched_by_mpi();
  if (!dist::mpi_available() && (a.tp > 1 || a.ep > 1))
    throw TrainUsageError("--tp/--ep need a build with MPI (NEXTLM_MPI) started by mpirun");
  if (a.device != "cpu" && a.device != "cuda")
    throw TrainUsageError("--device must be cpu or cuda, got \"" + a.device + "\"");
#ifndef NEXTLM_HAVE_CUDA
  if (a.device == "cuda") throw TrainUsageError("--device cuda needs a CUDA build (NEXTLM_CUDA)");
#endif
  // --device cuda with --tp/--ep (or under mpirun): LoRA on GPU shards (dist::LoraGpuRanks), one trainer a process.
  const bool gpu_shards = a.device == "cuda" && parallel;
#ifndef NEXTLM_HAVE_NCCL
  if (gpu_shards) throw TrainUsageError("--device cuda with --tp/--ep or mpirun needs a build with NCCL");
#endif
  const bool lora_flags = given("--lora-alpha") || given("--lora-targets") || given("--lora-experts") ||
                          given("--lora-rank-div-topk");
  if (given("--lora-rank") || lora_flags) {
    if (!a.resume.empty()) throw TrainUsageError("the --lora-* options cannot change on --resume (they are stored)");
    if (!given("--lora-rank")) throw TrainUsageError("the --lora-* options need --lora-rank");
    if (a.lora_rank < 1) throw TrainUsageError("--lora-rank must be >= 1");
    if (a.model.empty()) throw TrainUsageError("LoRA trains adapters on a base model: give --model, not --config");
    if (given("--lora-alpha") && !(a.lora_alpha > 0 && std::isfinite(a.lora_alpha)))
      throw TrainUsageError("--lora-alpha must be > 0");
    if (a.lora_experts != "per-expert" && a.lora_experts != "shared")
      throw TrainUsageError("--lora-experts must be per-expert or shared, got \"" + a.lora_experts + "\"");
    try {
      parse_lora_targets(a.lora_targets);
    } catch (const Error& e) {
      throw TrainUsageError(std::string("--lora-targets: ") + e.what());
    }
  }
  std::error_code ec;
  check(!fs::exists(a.out, ec) || fs::is_directory(a.out, ec), "--out ", a.out, " exists and is not a directory");
  fs::path out_parent = fs::absolute(a.out, ec).parent_path();
  check(fs::is_directory(out_parent, ec), "--out ", a.out, ": directory ", out_parent.string(), " does not exist");
  const std::string ckpt_dir = (fs::path(a.out) / "checkpoint").string();
  std::string resume_dir;
  if (!a.resume.empty()) resume_dir = find_checkpoint(a.resume);
  if (fs::exists(ckpt_dir, ec) && (resume_dir.empty() || !fs::equivalent(fs::path(resume_dir).parent_path(), a.out, ec)))
    fail("--out ", a.out, " already holds a checkpoint; continue it with --resume ", a.out, " or choose another --out");
  const std::string log = a.log.empty() ? (fs::path(a.out) / "train_log.csv").string() : a.log;
  if (!a.log.empty()) {
    fs::path lp = fs::absolute(a.log, ec).parent_path();
    check(!fs::is_directory(a.log, ec), "--log ", a.log, " is a directory");
    check(fs::is_directory(lp, ec), "--log ", a.log, ": directory ", lp.string(), " does not exist");
  }

  cpu::set_num_threads(a.threads);
  TrainOptions opt;
  if (!resume_dir.empty()) opt = Trainer::stored_options(resume_dir);
  // On --resume the stored options stand unless a flag is given (same options, same run).
  if (resume_dir.empty() || given("--steps")) opt.steps = a.steps;
  if (resume_dir.empty() || given("--warmup")) opt.warmup = a.warmup;
  if (resume_dir.empty() || given("--batch-tokens")) opt.batch_tokens = a.batch_tokens;
  if (resume_dir.empty() || given("--grad-accum")) opt.grad_accum = a.grad_accum;
  if (resume_dir.empty() || given("--clip")) opt.clip = a.clip;
  if (resume_dir.empty() || given("--seed")) opt.seed = a.seed;
  if (resume_dir.empty() || given("--lr")) opt.adamw.lr = a.lr;
  if (resume_dir.empty() || given("--weight-decay")) opt.adamw.weight_decay = a.weight_decay;
  if (resume_dir.empty() || given("--adam-eps")) opt.adamw.eps = a.adam_eps;
  if (resume_dir.empty() || recompute) opt.recompute = recompute.value_or(auto_recompute());
  if (given("--lora-rank")) {
    LoraOptions lo;
    lo.rank = a.lora_rank;
    lo.alpha = given("--lora-alpha") ? a.lora_alpha : static_cast<double>(a.lora_rank);
    lo.targets = a.lora_targets;
    lo.experts = a.lora_experts == "shared" ? LoraExperts::Shared : LoraExperts::PerExpert;
    lo.rank_div_topk = a.lora_rank_div_topk;
    opt.lora = lo;
    opt.base_model = fs::absolute(a.model, ec).lexically_normal().string();
  }

  if (gpu_shards && !opt.lora)
    throw TrainUsageError("--device cuda with --tp/--ep or mpirun trains LoRA adapters (--lora-rank); full-parameter "
                          "training on the GPU runs on one GPU");

  std::optional<Model> model;
  ModelConfig cfg;
  if (!a.config.empty()) {
    cfg = load_config(a.config);
  } else {
    const std::string dir = !a.model.empty() ? a.model : opt.lora ? opt.base_model : resume_dir;
    check(fs::is_directory(dir, ec), "model directory ", dir, " does not exist");
    cfg = load_config((fs::path(dir) / "config.json").string());
  }
  // A rank above every adapted projection's own would only take memory (LoraAdapter refuses it too, as an Error).
  if (opt.lora && resume_dir.empty()) {
    const int64_t most = lora_max_rank(cfg, *opt.lora);
    if (most == 0) throw TrainUsageError("--lora-targets " + opt.lora->targets + " select no projection of this model");
    if (opt.lora->rank > most)
      throw TrainUsageError("--lora-rank " + std::to_string(opt.lora->rank) + " is more than the full rank of every "
                            "projection the targets select (" + std::to_string(most) + " at the most)");
  }
#ifdef NEXTLM_HAVE_NCCL
  if (gpu_shards) {
    const int world = dist::launched_by_mpi() ? dist::world().size() : std::lcm(a.tp, a.ep);
    try {
      dist::validate_layout({a.tp, a.ep}, world, cfg);
      dist::cuda_shard(0, world, a.tp, a.ep, /*replicas=*/true);
    } catch (const Error& e) {
      throw TrainUsageError(e.what());
    }
  }
#endif
  std::vector<TrainExample> data = read_train_jsonl(a.data, cfg.vocab_size, opt.batch_tokens);
  // LoRA on the GPU leaves the base in its checkpoint: the device reads it from there (each GPU its slices), and
  // the host holds only the config, the adapters and their optimizer state (a host copy of a 313B base would be
  // 1.25 TB of fp32).
  const bool base_on_disk = a.device == "cuda" && opt.lora;
  std::optional<Trainer> trainer;
  std::optional<dist::Mesh> mesh;
  std::optional<dist::ParallelTrainer> ptrainer;
  if (parallel && !gpu_shards) {
    try {
      dist::validate_layout({a.tp, a.ep}, dist::world().size(), cfg);
    } catch (const Error& e) {
      throw TrainUsageError(e.what());
    }
    mesh.emplace(dist::world(), dist::ParallelOptions{a.tp, a.ep});
    if (!resume_dir.empty()) {
      ptrainer.emplace(dist::ParallelTrainer::resume(resume_dir, *mesh, std::move(data), opt));
    } else {
      dist::ShardedModel m = a.config.empty() ? dist::load_sharded(a.model, *mesh)
                                              : dist::shard_weights(cfg, init_weights(cfg, opt.seed), *mesh);
      ptrainer.emplace(std::move(m), *mesh, std::move(data), opt);
    }
  } else if (!resume_dir.empty()) {
    trainer.emplace(Trainer::resume(resume_dir, std::move(data), opt, base_on_disk ? LoraBase::Disk : LoraBase::Host));
  } else if (base_on_disk) {
    trainer.emplace(cfg, read_tensor_shapes(opt.base_model), std::move(data), opt);
  } else {
    Model m = a.config.empty() ? Model::load(a.model) : Model(cfg, init_weights(cfg, opt.seed));
    trainer.emplace(std::move(m), std::move(data), opt);
  }
#ifdef NEXTLM_HAVE_CUDA
  // The GPU computes each micro-batch's gradients on bf16 copies of the host's fp32 values, refreshed after every
  // optimizer step; the trainer does the rest as on the CPU (so checkpoints and resumes are the same). With LoRA the
  // device holds the frozen base, read from its checkpoint (the trainer holds none of it: LoraBase::Disk, and `m`
  // has no weights), and the adapters, with their fp32 values, gradients and AdamW moments: the whole step runs
  // there, and the adapters come back to the host only to be saved.
  std::unique_ptr<CudaModel> gpu;
  int64_t gpu_version = -1;  // the version of the trained values the device holds; -1: those it was loaded with
#ifdef NEXTLM_HAVE_NCCL
  std::unique_ptr<dist::LoraGpuRanks> shards;
  if (gpu_shards) {
    // Each rank's slices loaded before any output exists; the adapters alone trained, as on one GPU below (the
    // routed experts stay in rows, the layout the sharded tests run). Ranks cannot fall back to more recompute one
    // at a time, so an adaptive policy stands for its fixed one (fixed_recompute). The trainer's AdamW runs on the
    // host.
    const RecomputePolicy fixed = fixed_recompute(opt.recompute);
    shards = std::make_unique<dist::LoraGpuRanks>(opt.base_model, a.tp, a.ep, [&](CudaModel& m) {
      m.set_train_linears(false);
      m.set_train_small(false);
      m.set_recompute(fixed);
    });
    trainer->set_gradient_fn([&](const Model&, LoraAdapter* lora, int64_t version, const PackedBatch& b,
                                 ModelWeights&) { return shards->micro_batch(*lora, version, b); });
  }
#endif
  if (a.device == "cuda" && !gpu_shards) {
    // Loaded before any output exists: a missing device or a bad checkpoint leaves nothing behind.
    const LoraAdapter* adapter = trainer->lora();
    gpu = adapter ? CudaModel::load(opt.base_model) : std::make_unique<CudaModel>(trainer->model());
    // Frozen experts are read in the layout their grouped GEMMs load fastest (set_weights, which a full step runs
    // after every update, would lay them out again each time).
    if (adapter) gpu->set_expert_layout(frozen_expert_layout(gpu->config()));
    gpu->set_train_linears(adapter == nullptr);
    gpu->set_train_small(adapter == nullptr);  // the adapters alone move
    gpu->set_recompute(opt.recompute);
    if (adapter) {
      gpu->set_lora(*adapter);
      gpu->start_lora_optimizer(*adapter, &trainer->optimizer());
    }
    trainer->set_gradient_fn([&](const Model& m, LoraAdapter* lora, int64_t version, const PackedBatch& b,
                                 ModelWeights& grads) {
      if (lora) {
        // The step's micro-batches add up their gradients on the device; the step's update starts them anew.
        if (version != gpu_version) gpu->zero_grads();
        gpu_version = version;
        return gpu->forward_backward(b);
      }
      if (gpu_version >= 0 && version != gpu_version) gpu->set_weights(m);
      gpu_version = version;
      gpu->zero_grads();
      const double loss = gpu->forward_backward(b);
      const ModelWeights g = gpu->gradients();
      const auto from = hub_gradients(m.config(), g, ""), into = hub_gradients(m.config(), grads, "");
      for (size_t i = 0; i < into.size(); ++i) {
        float* dst = const_cast<float*>(into[i].data);
        for (size_t j = 0, n = Tensor::count(into[i].shape); j < n; ++j) dst[j] += from[i].data[j];
      }
      return loss;
    });
    if (trainer->lora())
      trainer->set_device_optimizer(Trainer::DeviceOptimizer{
          [&](double lr, int64_t t, double scale, double max_norm) {
            return gpu->lora_adamw_step(trainer->options().adamw, lr, t, scale, max_norm);
          },
          [&](LoraAdapter& adapter, AdamW& state) {
            if (gpu) gpu->download_lora(adapter, &state);
          }});
  }
#endif
  auto steps_done = [&] { return trainer ? trainer->steps_done() : ptrainer->steps_done(); };
  // The processes of this run: the mesh's world, or under mpirun with GPU shards every process's (one trainer each).
  dist::Comm* world = mesh ? mesh->world : gpu_shards && dist::launched_by_mpi() ? &dist::world() : nullptr;
  const bool lead = !world || world->rank() == 0;  // prints and writes the log
  // Every rank stops after the same step: a ctrl-C seen by any rank stops all.
  auto interrupted = [&] {
    float flag = g_interrupted ? 1.0f : 0.0f;
    if (world) world->all_reduce_max(&flag, 1);
    return flag > 0.0f;
  };

  // Outputs from here on; from now on ctrl-C ends with a checkpoint.
  SigintGuard guard;
  // An error before the run's first step or checkpoint takes back what the run made (the directory, the log): no
  // partial output is left. Declared before the log's Closer, so that the log is closed first.
  struct UndoOutputs {
    std::string out, log;
    bool out_existed, log_existed, armed;
    const int unwinding = std::uncaught_exceptions();
    ~UndoOutputs() {
      if (!armed || std::uncaught_exceptions() == unwinding) return;
      std::error_code e;
      if (!log_existed) fs::remove(log, e);
      if (!out_existed) fs::remove_all(out, e);
    }
  } undo{a.out, log, fs::exists(a.out, ec), fs::exists(log, ec), lead};
  std::vector<LogRow> rows;
  std::FILE* logf = nullptr;
  if (lead) {
    fs::create_directories(a.out, ec);
    check(!ec, "cannot create --out ", a.out, ": ", ec.message());
    rows = read_log(log, steps_done());
    std::string csv = "step,loss,lr,grad_norm,tokens,seconds\n";
    for (const LogRow& r : rows) csv += csv_row(r);
    write_text(log, csv);
    logf = std::fopen(log.c_str(), "a");
    check(logf != nullptr, "cannot append to ", log);
  }
  struct Closer {
    std::FILE* f;
    ~Closer() {
      if (f) std::fclose(f);
    }
  } closer{logf};
  auto save = [&] {
    if (ptrainer) {
      ptrainer->save(ckpt_dir);  // collective: rank 0 writes
    } else if (!world) {
      trainer->save(ckpt_dir);
    } else {
      // Every process holds the same trainer: rank 0 writes, and every rank learns whether it could.
      std::string error;
      if (lead) {
        try {
          trainer->save(ckpt_dir);
        } catch (const Error& e) {
          error = e.what();
        }
      }
      int failed = error.empty() ? 0 : 1;
      world->broadcast(&failed, sizeof failed, 0);
      if (failed) fail(lead ? error : "rank 0 could not write the checkpoint " + ckpt_dir);
    }
    undo.armed = false;
    if (lead) write_text(svg_path(log), loss_curve_svg(rows));
  };

  const int64_t num_trainable = trainer ? trainer->num_trainable() : ptrainer->num_trainable();
  const LoraAdapter* adapter = trainer ? trainer->lora() : ptrainer->lora();
  if (lead && adapter)
    std::cerr << "LoRA: " << adapter->modules().size() << " adapters of rank " << opt.lora->rank
              << " on the frozen base " << opt.base_model << " (" << parameter_count(cfg) << " parameters"
              << (!trainer || trainer->lora_base() != LoraBase::Disk ? ""
                  : gpu_shards ? ", each GPU reading its slices from the checkpoint"
                               : ", read by the GPU from its checkpoint")
              << ")\n";
#ifdef NEXTLM_HAVE_NCCL
  if (lead && shards)
    std::cerr << "parallel: " << shards->world_size() << " GPU ranks ("
              << (dist::launched_by_mpi() ? "processes" : "threads of this process") << "), "
              << shards->world_size() / std::lcm(a.tp, a.ep) << " data-parallel replicas of " << std::lcm(a.tp, a.ep)
              << " (tp " << a.tp << ", ep " << a.ep << "); the adapters' AdamW on the host\n";
#endif
  if (lead && mesh)
    std::cerr << "parallel: " << mesh->world->size() << " ranks, " << mesh->dp->size()
              << " data-parallel replicas of " << mesh->replica_size << " (tp " << a.tp << ", ep " << a.ep << ")\n";
  if (lead)
    std::cerr << "training " << num_trainable << " parameters on " << a.device << ", steps " << steps_done()
              << " -> " << opt.steps << ", " << opt.batch_tokens << " tokens x " << opt.grad_accum
              << " per step, recompute "
              << describe_recompute(opt.recompute, a.device == "cuda" && !gpu_shards) << "\n";
  double elapsed = 0.0;
  int64_t done_here = 0, tokens_here = 0;
  bool stop = false;
  while (steps_done() < opt.steps && !(stop = interrupted())) {
    StepStats st;
    try {
      st = trainer ? trainer->step() : ptrainer->step();
    } catch (const std::bad_alloc&) {
      fail("out of host memory in step ", steps_done() + 1, " (micro-batches of up to ", opt.batch_tokens,
           " tokens): a smaller --batch-tokens, or a --recompute policy that recomputes more, needs less");
    }
    elapsed += st.seconds;
    tokens_here += st.tokens;
    ++done_here;
    undo.armed = false;  // a step's row is in the log: kept whatever follows
    if (lead) {
      const LogRow r{st.step, st.loss, st.lr, st.grad_norm, st.tokens, st.seconds};
      rows.push_back(r);
      const std::string line = csv_row(r);
      check(std::fwrite(line.data(), 1, line.size(), logf) == line.size() && std::fflush(logf) == 0,
            "cannot write ", log);
      const double eta = elapsed / done_here * static_cast<double>(opt.steps - st.step);
      std::cerr << "step " << st.step << "/" << opt.steps << "  loss " << fmt("%.4f", st.loss) << "  lr "
                << fmt("%.3g", st.lr) << "  grad_norm " << fmt("%.3g", st.grad_norm) << "  tok/s "
                << fmt("%.0f", st.tokens / st.seconds) << "  eta " << duration(eta) << "  peak_mem "
                << fmt("%.0f", peak_rss_mib()) << "MiB\n";
    }
    if (a.save_every > 0 && st.step % a.save_every == 0 && st.step < opt.steps) save();
  }
  save();
  if (!stop) stop = interrupted();
  if (stop) {
    if (lead)
      std::cerr << "interrupted after step " << steps_done() << "; checkpoint saved in " << ckpt_dir
                << " (continue with --resume " << a.out << ")\n";
    return 130;
  }
  RecomputePolicy in_use = opt.recompute;  // an adaptive policy's rung at the end
#ifdef NEXTLM_HAVE_CUDA
  if (gpu) in_use = gpu->recompute();
#endif
#ifdef NEXTLM_HAVE_NCCL
  if (shards) in_use = shards->model().recompute();
#endif
  if (lead)
    std::cerr << "done: " << steps_done() << " steps in " << duration(elapsed) << "; "
              << (adapter ? "adapter" : "model") << " and checkpoint in " << ckpt_dir << ", log "
              << log << "; " << fmt("%.0f", done_here > 0 ? tokens_here / elapsed : 0.0) << " tokens/s, peak memory "
              << fmt("%.0f", peak_rss_mib()) << " MiB with recompute "
              << describe_recompute(in_use, a.device == "cuda") << "\n";
  return 0;
}

}  // namespace nextlm
