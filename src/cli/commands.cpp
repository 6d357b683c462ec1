// CLI commands: `score` (per-token log-probabilities of JSONL token sequences), `info` (model summary), `grad`
// (loss and parameter gradients), `generate` (prompt continuation with the decode state), `train` (src/cli/train.cpp)
// and `serve` (src/serve/).
#include "cli/commands.h"
#include "cli/lora.h"
#include "cli/train.h"

#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <numeric>
#include <optional>
#include <sstream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "cpu/linear.h"
#include "io/atomic_file.h"
#include "io/chat_template.h"
#include "io/jsonl.h"
#include "io/safetensors.h"
#include "io/tokenizer.h"
#include "model/decode.h"
#include "model/lora.h"
#include "model/model.h"
#include "model/train.h"
#include "dist/parallel_decode.h"
#include "dist/parallel_model.h"
#include "dist/parallel_train.h"
#include "serve/dist_backend.h"
#include "serve/server.h"
#ifdef NEXTLM_HAVE_CUDA
#include "cuda/device_model.h"
#endif
#ifdef NEXTLM_HAVE_NCCL
#include "dist/cuda_parallel.h"
#endif

namespace nextlm {
namespace {

namespace fs = std::filesystem;

struct ScoreArgs {
  std::string model, input, output, logits_out, device = "cpu", format = "jsonl", adapter;
  int threads = 0;
  int tp = 1, ep = 1;  // tensor- and expert-parallel ranks (src/dist; under mpirun)
  bool batch_invariant = false;  // --device cuda: GEMMs whose results do not depend on the batch (cuda/gemm.h)
};

// A bad combination of command-line arguments found after parsing: exit code 2, like CLI11's parse errors.
struct UsageError : Error {
  using Error::Error;
};

constexpr int kMaxThreads = 1024;  // far more makes OpenMP / OpenBLAS fail to start threads (and crash)

// The message on one line: line breaks and other control characters (from paths, JSON excerpts, CLI11's multi-line
// messages or library errors) become spaces, runs of them collapse, and trailing blanks go.
std::string one_line(const std::string& msg) {
  std::string s;
  s.reserve(msg.size());
  for (char ch : msg) {
    const unsigned char c = static_cast<unsigned char>(ch);
    if (c < 0x20 || c == 0x7f) {
      if (!s.empty() && s.back() != ' ') s += ' ';
    } else {
      s += ch;
    }
  }
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

// Under mpirun only rank 0 prints (every rank meets the same flag, input and model errors).
void print_error(const std::string& msg) {
  if (dist::launcher_rank() == 0) std::cerr << "error: " << one_line(msg) << "\n" << std::flush;
}

// CLI11 validators: they return an error message or "" and make the value a parse error (exit code 2).
CLI::Validator non_empty() {
  return CLI::Validator([](std::string& v) { return v.empty() ? std::string("must not be empty") : std::string(); },
                        "", "NONEMPTY");
}

CLI::Validator thread_count() {
  return CLI::Validator(
      [](std::string& v) {
        int n = 0;
        const char* end = v.data() + v.size();
        const auto [p, ec] = std::from_chars(v.data(), end, n);
        if (v.empty() || ec != std::errc() || p != end || n < 1 || n > kMaxThreads)
          return "must be an integer from 1 to " + std::to_string(kMaxThreads) + ", got \"" + v + "\"";
        return std::string();
      },
      "", "1.." + std::to_string(kMaxThreads));
}

// --tp / --ep: a positive rank count.
CLI::Validator rank_count() {
  return CLI::Validator(
      [](std::string& v) {
        int n = 0;
        const char* end = v.data() + v.size();
        const auto [p, ec] = std::from_chars(v.data(), end, n);
        if (v.empty() || ec != std::errc() || p != end || n < 1)
          return "must be a positive integer, got \"" + v + "\"";
        return std::string();
      },
      "", "N>=1");
}

// The devices this build can run on.
std::vector<std::string> available_devices() {
#ifdef NEXTLM_HAVE_CUDA
  return {"cpu", "cuda"};
#else
  return {"cpu"};
#endif
}

// A uint64 in decimal (CLI11 itself would wrap "-5" around).
CLI::Validator unsigned_integer() {
  return CLI::Validator(
      [](std::string& v) {
        uint64_t n = 0;
        const char* end = v.data() + v.size();
        const auto [p, ec] = std::from_chars(v.data(), end, n);
        if (v.empty() || ec != std::errc() || p != end) return "must be an integer from 0 to 2^64-1, got \"" + v + "\"";
        return std::string();
      },
      "", "UINT64");
}

CLI::Validator one_of(std::vector<std::string> allowed, std::string what) {
  std::string list;
  for (const std::string& a : allowed) list += (list.empty() ? "" : " or ") + a;
  return CLI::Validator(
      [allowed, list, what](std::string& v) {
        for (const std::string& a : allowed)
          if (v == a) return std::string();
        return "\"" + v + "\" is not " + what + " (use " + list + ")";
      },
      "", list);
}

// Checks the model directory before loading, with error codes (std::filesystem's throwing calls would otherwise
// escape as filesystem_error for a path that is too long or unreadable).
void check_model_dir(const std::string& dir) {
  std::error_code ec;
  const fs::file_status st = fs::status(dir, ec);
  check(st.type() != fs::file_type::not_found, "model directory ", dir, " does not exist");
  if (ec) fail("cannot access model directory ", dir, ": ", ec.message());
  check(fs::is_directory(st), "model path ", dir, " is not a directory");
  const fs::path cfg = fs::path(dir) / "config.json";
  const fs::file_status cs = fs::status(cfg, ec);
  check(cs.type() != fs::file_type::not_found, "no config.json in ", dir);
  if (ec) fail("cannot access ", cfg.string(), ": ", ec.message());
  check(!fs::is_directory(cs), cfg.string(), " is a directory, not a file");
}

// True when a and b name the same file (whether or not it exists yet).
bool same_file(const std::string& a, const std::string& b) {
  std::error_code ea, eb;
  if (fs::exists(a, ea) && fs::exists(b, eb)) {
    std::error_code ec;
    const bool eq = fs::equivalent(a, b, ec);
    if (!ec) return eq;
  }
  const fs::path aa = fs::absolute(a, ea).lexically_normal(), ab = fs::absolute(b, eb).lexically_normal();
  if (ea || eb) return a == b;
  // weakly_canonical resolves symlinks in the existing part; it needs absolute paths to compare "x" with "./x".
  const fs::path ca = fs::weakly_canonical(aa, ea), cb = fs::weakly_canonical(ab, eb);
  if (!ea && !eb) return ca == cb;
  return aa == ab;
}

// An output path must not be a directory, and its directory must exist; checked before any work is done.
void check_output_path(const std::string& flag, const std::string& path) {
  std::error_code ec;
  check(!fs::is_directory(path, ec), "cannot write ", flag, " ", path, ": it is a directory");
  fs::path parent = fs::path(path).parent_path();
  if (parent.empty()) parent = ".";
  const fs::file_status st = fs::status(parent, ec);
  check(fs::is_directory(st), "cannot write ", flag, " ", path, ": directory ", parent.string(),
        st.type() == fs::file_type::not_found ? " does not exist" : " is not accessible");
}

// Removes a file when it goes out of scope unless released.
class RemoveOnExit {
 public:
  explicit RemoveOnExit(std::string path) : path_(std::move(path)) {}
  ~RemoveOnExit() {
    if (!path_.empty()) std::remove(path_.c_str());
  }
  RemoveOnExit(const RemoveOnExit&) = delete;
  RemoveOnExit& operator=(const RemoveOnExit&) = delete;
  void release() { path_.clear(); }

 private:
  std::string path_;
};

// JSON numbers with enough digits to round-trip a double.
std::string number(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", x);
  return buf;
}

int write_score_outputs(const ScoreArgs& a, const std::vector<std::vector<int32_t>>& seqs, const PackedBatch& batch,
                        const std::vector<std::vector<double>>& lps, const std::vector<Tensor>& logits,
                        std::optional<AtomicFile>& out_file, std::chrono::steady_clock::time_point t0);

// Whether this run is a tensor/expert-parallel one: under mpirun, or with --tp/--ep.
bool parallel_run(int tp, int ep) { return tp > 1 || ep > 1 || dist::launched_by_mpi(); }

// The mesh and this rank's slices of the model in DIR, with the flag errors (no MPI, a layout that does not divide
// the world or the model's heads and experts) found before any work and reported as usage errors.
void load_parallel(const std::string& dir, int tp, int ep, std::optional<dist::Mesh>& mesh,
                   std::optional<dist::ShardedModel>& model) {
  if (!dist::mpi_available() && (tp > 1 || ep > 1))
    throw UsageError("--tp/--ep need a build with MPI (NEXTLM_MPI) started by mpirun");
  const ModelConfig cfg = load_config((fs::path(dir) / "config.json").string());
  try {
    dist::validate_layout({tp, ep}, dist::world().size(), cfg);
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
  mesh.emplace(dist::world(), dist::ParallelOptions{tp, ep});
  model = dist::load_sharded(dir, *mesh);
}

#ifdef NEXTLM_HAVE_NCCL
// The config of a `--device cuda --tp/--ep` job's model, after the flag errors (a layout that does not fit the
// world or the model) were reported as usage errors, before any work.
ModelConfig gpu_layout_config(const std::string& dir, int tp, int ep) {
  const ModelConfig cfg = load_config((fs::path(dir) / "config.json").string());
  const int world = dist::launched_by_mpi() ? dist::world().size() : std::lcm(tp, ep);
  try {
    dist::validate_layout({tp, ep}, world, cfg);
    dist::cuda_shard(0, world, tp, ep);
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
  return cfg;
}

// Runs fn(world, model) on every rank of a `--device cuda --tp/--ep` job, the rank's slices of the checkpoint in
// DIR loaded on its GPU: under mpirun this process's rank (GPU = world rank modulo the GPUs it sees), else
// lcm(tp, ep) threads of this process, one per GPU. Returns whether this process holds rank 0 (which writes).
bool on_gpu_ranks(const std::string& dir, int tp, int ep,
                  const std::function<void(dist::Comm& world, CudaModel& model)>& fn) {
  auto run = [&](dist::Comm& world, int device) {
    dist::CudaRank rank = dist::make_cuda_rank(world, tp, ep, device, [&](const CudaShard& shard, int dev) {
      return CudaModel::load(dir, dev, shard);
    });
    fn(world, *rank.model);
  };
  if (dist::launched_by_mpi()) {
    const int gpus = dist::cuda_device_count();
    if (gpus == 0) throw Error("--device cuda: no CUDA device is available");
    run(dist::world(), dist::world().rank() % gpus);
    return dist::world().rank() == 0;
  }
  dist::run_gpu_ranks(tp, ep, run);
  return true;
}
#endif

#ifdef NEXTLM_HAVE_CUDA
// The rows [T, V] of a packed batch's logits, one tensor per sequence.
std::vector<Tensor> split_sequences(const Tensor& all, const PackedBatch& batch) {
  const int64_t V = all.shape.back();
  std::vector<Tensor> out;
  for (int64_t n = 0; n < batch.num_seqs(); ++n) {
    Tensor t({batch.cu_seqlens[n + 1] - batch.cu_seqlens[n], V});
    std::copy(all.ptr() + batch.cu_seqlens[n] * V, all.ptr() + batch.cu_seqlens[n + 1] * V, t.ptr());
    out.push_back(std::move(t));
  }
  return out;
}
#endif

int cmd_score(const ScoreArgs& a) {
  // Argument combinations first (usage errors), then the outputs' places, all before any real work.
  if (!a.output.empty() && !a.logits_out.empty() && same_file(a.output, a.logits_out))
    throw UsageError("--output and --logits-out name the same file " + a.output);
  if (!a.output.empty() && same_file(a.output, a.input))
    throw UsageError("--output " + a.output + " is the --input file");
  if (!a.logits_out.empty() && same_file(a.logits_out, a.input))
    throw UsageError("--logits-out " + a.logits_out + " is the --input file");
  if (!a.output.empty()) check_output_path("--output", a.output);
  if (!a.logits_out.empty()) check_output_path("--logits-out", a.logits_out);
  // The JSONL goes to a temporary beside --output, renamed over it only once everything has succeeded.
  std::optional<AtomicFile> out_file;
  if (!a.output.empty() && dist::launcher_rank() == 0) out_file.emplace(a.output);

  if (a.batch_invariant && a.device != "cuda")
    throw UsageError("--batch-invariant applies to --device cuda only");
  cpu::set_num_threads(a.threads);
  const auto t0 = std::chrono::steady_clock::now();
  check_model_dir(a.model);
  // On several GPUs: each holds its slices, NCCL between them; rank 0 (or the process) writes.
  if (parallel_run(a.tp, a.ep) && a.device == "cuda") {
#ifdef NEXTLM_HAVE_NCCL
    if (!a.adapter.empty()) throw UsageError("--adapter is not supported with --tp/--ep (merge it first)");
    if (!a.logits_out.empty()) throw UsageError("--logits-out is not supported with --device cuda --tp/--ep");
    if (a.batch_invariant) throw UsageError("--batch-invariant runs on one GPU (not with --tp/--ep)");
    const ModelConfig cfg = gpu_layout_config(a.model, a.tp, a.ep);
    const auto seqs = read_token_jsonl(a.input, cfg.vocab_size);
    PackedBatch batch;
    for (const auto& s : seqs) batch.add(s);
    std::vector<std::vector<double>> lps;
    const bool writer = on_gpu_ranks(a.model, a.tp, a.ep, [&](dist::Comm& world, CudaModel& m) {
      auto mine = m.next_token_logprobs(batch);  // every rank's are the same
      if (world.rank() == 0) lps = std::move(mine);
    });
    if (!writer) return 0;
    return write_score_outputs(a, seqs, batch, lps, {}, out_file, t0);
#else
    throw UsageError("--device cuda with --tp/--ep needs a build with NCCL");
#endif
  }
  // Under mpirun, or with --tp/--ep, every rank loads its slices and runs the parallel forward; rank 0 writes.
  if (parallel_run(a.tp, a.ep)) {
    if (a.device != "cpu") throw UsageError("--tp/--ep and mpirun run on --device cpu only");
    if (!a.adapter.empty()) throw UsageError("--adapter is not supported with --tp/--ep or mpirun (merge it first)");
    std::optional<dist::Mesh> mesh_slot;
    std::optional<dist::ShardedModel> model_slot;
    load_parallel(a.model, a.tp, a.ep, mesh_slot, model_slot);
    const dist::Mesh& mesh = *mesh_slot;
    const dist::ShardedModel& model = *model_slot;
    const auto seqs = read_token_jsonl(a.input, model.config.vocab_size);
    PackedBatch batch;
    for (const auto& s : seqs) batch.add(s);
    const Tensor hidden = dist::parallel_forward_hidden(model, mesh, batch);
    const std::vector<std::vector<double>> lps = dist::parallel_next_token_logprobs(model, mesh, hidden, batch);
    std::vector<Tensor> logits;
    if (!a.logits_out.empty())
      for (int64_t n = 0; n < batch.num_seqs(); ++n)
        logits.push_back(dist::parallel_logits(model, mesh, hidden, batch.cu_seqlens[n], batch.cu_seqlens[n + 1]));
    if (dist::world().rank() != 0) return 0;
    return write_score_outputs(a, seqs, batch, lps, logits, out_file, t0);
  }
#ifdef NEXTLM_HAVE_CUDA
  // On the GPU without an adapter the bf16 weights go straight from the checkpoint to the device: no fp32 host copy.
  if (a.device == "cuda" && a.adapter.empty()) {
    const std::unique_ptr<CudaModel> gpu = CudaModel::load(a.model);
    gpu->set_batch_invariant(a.batch_invariant);
    const int64_t V = gpu->config().vocab_size;
    const auto seqs = read_token_jsonl(a.input, V);
    PackedBatch batch;
    for (const auto& s : seqs) batch.add(s);
    const std::vector<std::vector<double>> lps = gpu->next_token_logprobs(batch);
    std::vector<Tensor> logits;
    if (!a.logits_out.empty()) logits = split_sequences(gpu->forward(batch), batch);
    return write_score_outputs(a, seqs, batch, lps, logits, out_file, t0);
  }
#endif
  const Model model = load_model_with_adapter(a.model, a.adapter);  // no --adapter: the model as it is
  const auto seqs = read_token_jsonl(a.input, model.config().vocab_size);
  PackedBatch batch;
  for (const auto& s : seqs) batch.add(s);
  // Per-sequence log-probabilities, and the logits when --logits-out asks for them, on the chosen device (the GPU
  // here only with an adapter, merged into the fp32 host weights first).
  std::vector<std::vector<double>> lps;
  std::vector<Tensor> logits;
  if (a.device == "cpu") {
    const Tensor hidden = model.forward_hidden(batch);
    lps = model.next_token_logprobs(hidden, batch);
    if (!a.logits_out.empty())
      for (int64_t n = 0; n < batch.num_seqs(); ++n)
        logits.push_back(model.logits(hidden, batch.cu_seqlens[n], batch.cu_seqlens[n + 1]));
  } else {
#ifdef NEXTLM_HAVE_CUDA
    CudaModel gpu(model);
    gpu.set_batch_invariant(a.batch_invariant);
    lps = gpu.next_token_logprobs(batch);
    if (!a.logits_out.empty()) logits = split_sequences(gpu.forward(batch), batch);
#endif
  }

  return write_score_outputs(a, seqs, batch, lps, logits, out_file, t0);
}

// The outputs of `score`: JSONL or the text table, and the --logits-out file, written so that neither appears
// unless both can.
int write_score_outputs(const ScoreArgs& a, const std::vector<std::vector<int32_t>>& seqs, const PackedBatch& batch,
                        const std::vector<std::vector<double>>& lps, const std::vector<Tensor>& logits,
                        std::optional<AtomicFile>& out_file, std::chrono::steady_clock::time_point t0) {
  std::ostringstream os;
  if (a.format == "text") {
    for (size_t n = 0; n < seqs.size(); ++n) {
      double sum = 0.0;
      os << "sequence " << n << " (" << seqs[n].size() << " tokens)\n";
      for (size_t t = 0; t < lps[n].size(); ++t) {
        sum += lps[n][t];
        os << "  " << t + 1 << "\ttoken " << seqs[n][t + 1] << "\tlogprob " << number(lps[n][t]) << "\n";
      }
      const size_t m = lps[n].size();
      os << "  sum " << number(sum);
      if (m) os << "  mean " << number(sum / m) << "  perplexity " << number(std::exp(-sum / m));
      os << "\n";
    }
  } else {
    for (size_t n = 0; n < seqs.size(); ++n) {
      double sum = 0.0;
      os << "{\"logprobs\": [";
      for (size_t t = 0; t < lps[n].size(); ++t) {
        sum += lps[n][t];
        os << (t ? ", " : "") << number(lps[n][t]);
      }
      os << "], \"sum\": " << number(sum) << "}\n";
    }
  }

  // Neither output may appear unless both can: the logits go to a complete temporary file first, then the JSONL
  // is committed (or printed), and only then is the logits file renamed into place.
  const std::string logits_tmp = a.logits_out.empty() ? "" : a.logits_out + ".partial." + std::to_string(::getpid());
  RemoveOnExit remove_logits_tmp(logits_tmp);
  if (!a.logits_out.empty()) {
    std::vector<TensorToWrite> out;
    for (int64_t n = 0; n < batch.num_seqs(); ++n)
      out.push_back({"logits." + std::to_string(n), DType::F32, logits[n].shape, logits[n].ptr()});
    try {
      write_safetensors(logits_tmp, out, {{"producer", "nextlm score"}});
    } catch (const Error& e) {
      fail("cannot write --logits-out ", a.logits_out, ": ", e.what());
    }
  }
  if (out_file) {
    out_file->write(os.str());
    out_file->commit();
  } else {
    std::cout << os.str() << std::flush;
    check(std::cout.good(), "cannot write to standard output");
  }
  if (!a.logits_out.empty()) {
    if (std::rename(logits_tmp.c_str(), a.logits_out.c_str()) != 0)
      fail("cannot rename ", logits_tmp, " to ", a.logits_out, ": ", std::strerror(errno));
    remove_logits_tmp.release();
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::cerr << "scored " << seqs.size() << " sequences, " << batch.num_tokens() << " tokens in " << number(secs)
            << " s\n";
  return 0;
}

struct GradArgs {
  std::string model, input, out, device = "cpu";
  std::string recompute = "auto";  // model/recompute.h's syntax
  int threads = 0;
  int tp = 1, ep = 1;  // tensor- and expert-parallel ranks (src/dist; under mpirun)
};

// `grad`: L = Σ_seq Σ_t −log p(x[t+1] | x[..t]) of the input sequences and its gradient wrt every trainable tensor,
// written as f32 under the checkpoint's own names (plus `loss`, F64 [1]) in one atomic safetensors file.
int cmd_grad(const GradArgs& a) {
  if (same_file(a.out, a.input)) throw UsageError("--out " + a.out + " is the --input file");
  RecomputePolicy policy;
  try {
    policy = parse_recompute(a.recompute);
  } catch (const Error& e) {
    throw UsageError(std::string("--recompute: ") + e.what());
  }
  check_output_path("--out", a.out);
  cpu::set_num_threads(a.threads);
  const auto t0 = std::chrono::steady_clock::now();
  check_model_dir(a.model);
  // Under mpirun, or with --tp/--ep: sharded backward, gradients gathered into full tensors, rank 0 writes them.
  std::optional<Model> model;
  std::optional<dist::ShardedModel> sharded;
  std::optional<dist::Mesh> mesh;
  ModelWeights grads;
  double loss = 0.0;
  std::vector<std::vector<int32_t>> seqs;
  PackedBatch batch;
  std::optional<ModelConfig> device_config;
  if (a.device == "cuda" && parallel_run(a.tp, a.ep)) {
#ifdef NEXTLM_HAVE_NCCL
    // Each GPU's slices' gradients, gathered into the checkpoint's full tensors (dist::gather_gradients).
    device_config = gpu_layout_config(a.model, a.tp, a.ep);
    seqs = read_token_jsonl(a.input, device_config->vocab_size);
    for (const auto& s : seqs) batch.add(s);
    const bool writer = on_gpu_ranks(a.model, a.tp, a.ep, [&](dist::Comm& world, CudaModel& m) {
      m.set_recompute(fixed_recompute(policy));  // ranks cannot fall back to more recompute one at a time
      const double l = m.forward_backward(batch);
      const ModelWeights mine = m.gradients();
      dist::Mesh mesh_of_ranks(world, dist::ParallelOptions{a.tp, a.ep});
      dist::ShardedModel shape;  // gather_gradients reads the full config only
      shape.config = *device_config;
      ModelWeights full = dist::gather_gradients(shape, mesh_of_ranks, mine);
      if (world.rank() == 0) grads = std::move(full), loss = l;
    });
    if (!writer) return 0;
#else
    throw UsageError("--device cuda with --tp/--ep needs a build with NCCL");
#endif
  } else if (a.device == "cuda") {
#ifdef NEXTLM_HAVE_CUDA
    // Straight from the checkpoint in bf16 (CudaModel::forward_backward): all sequences in one packed batch.
    const std::unique_ptr<CudaModel> gpu = CudaModel::load(a.model);
    device_config = gpu->config();
    seqs = read_token_jsonl(a.input, device_config->vocab_size);
    for (const auto& s : seqs) batch.add(s);
    gpu->set_recompute(policy);
    loss = gpu->forward_backward(batch);
    grads = gpu->gradients();
#endif
  } else if (parallel_run(a.tp, a.ep)) {
    load_parallel(a.model, a.tp, a.ep, mesh, sharded);
    seqs = read_token_jsonl(a.input, sharded->config.vocab_size);
    for (const auto& s : seqs) batch.add(s);
    ModelWeights local = zeros_like(sharded->weights);
    loss = dist::parallel_forward_backward(*sharded, *mesh, batch, local, policy);
    grads = dist::gather_gradients(*sharded, *mesh, local);
    if (dist::world().rank() != 0) return 0;
  } else {
    model.emplace(Model::load(a.model));
    seqs = read_token_jsonl(a.input, model->config().vocab_size);
    for (const auto& s : seqs) batch.add(s);
    grads = zeros_like(model->weights());
    loss = model_forward_backward(*model, batch, grads, policy);
  }
  const ModelConfig& config = device_config ? *device_config : model ? model->config() : sharded->config;
  std::vector<TensorToWrite> out;
  for (const GradTensor& g : hub_gradients(config, grads, text_prefix(Checkpoint(a.model))))
    out.push_back({g.name, DType::F32, g.shape, g.data});
  out.push_back({"loss", DType::F64, {1}, &loss});
  try {
    write_safetensors(a.out, out, {{"producer", "nextlm grad"}, {"loss", number(loss)}});
  } catch (const Error& e) {
    fail("cannot write --out ", a.out, ": ", e.what());
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::cerr << "gradients of " << seqs.size() << " sequences, " << batch.num_tokens() << " tokens, loss "
            << number(loss) << " in " << number(secs) << " s\n";
  return 0;
}

struct GenerateArgs {
  std::string model, prompt_tokens, prompt, stop_tokens, device = "cpu", format = "text", adapter;
  int64_t max_new_tokens = 0;
  double temperature = 1.0, top_p = 1.0, min_p = 0.0;
  int64_t top_k = 0;
  uint64_t seed = 0;
  int threads = 0;
  bool chat = false;  // --chat: --prompt is one user message in GLM's chat format
  bool ignore_eos = false;  // --ignore-eos: the model's eos_token_id does not end generation
  bool batch_invariant = false;  // --device cuda: GEMMs whose results do not depend on the batch (cuda/gemm.h)
  int tp = 1, ep = 1;  // tensor- and expert-parallel ranks (src/dist; under mpirun)
};

// "1,2,3" → token ids. Anything but non-negative integers separated by commas is a usage error naming the flag;
// whether the ids are in the vocabulary is checked once the model is loaded.
std::vector<int32_t> parse_token_list(const std::string& flag, const std::string& text) {
  std::vector<int32_t> ids;
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    std::string item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    while (!item.empty() && item.front() == ' ') item.erase(item.begin());
    while (!item.empty() && item.back() == ' ') item.pop_back();
    int32_t id = -1;
    const char* end = item.data() + item.size();
    const auto [p, ec] = std::from_chars(item.data(), end, id);
    if (item.empty() || ec != std::errc() || p != end || id < 0)
      throw UsageError(flag + ": \"" + item + "\" is not a token id (a non-negative integer; ids are comma-separated)");
    ids.push_back(id);
    if (comma == std::string::npos) return ids;
    start = comma + 1;
  }
}

// `generate`: prefill the prompt, then sample up to --max-new-tokens tokens with the decode state.
int cmd_generate(const GenerateArgs& a, bool has_prompt_tokens, bool has_prompt) {
  if (has_prompt_tokens && has_prompt) throw UsageError("give either --prompt-tokens or --prompt, not both");
  if (!has_prompt_tokens && !has_prompt) throw UsageError("no prompt: give --prompt-tokens or --prompt");
  if (a.chat && !has_prompt) throw UsageError("--chat needs --prompt (the user message)");
  if (a.batch_invariant && a.device != "cuda") throw UsageError("--batch-invariant applies to --device cuda only");
  GenerateOptions opt;
  if (has_prompt_tokens) parse_token_list("--prompt-tokens", a.prompt_tokens);  // usage errors before loading
  if (!a.stop_tokens.empty()) opt.stop_tokens = parse_token_list("--stop-tokens", a.stop_tokens);
  if (a.max_new_tokens < 0) throw UsageError("--max-new-tokens must be >= 0, got " + std::to_string(a.max_new_tokens));
  opt.max_new_tokens = a.max_new_tokens;
  opt.sampling.temperature = a.temperature;
  opt.sampling.top_k = a.top_k;
  opt.sampling.top_p = a.top_p;
  opt.sampling.min_p = a.min_p;
  opt.sampling.seed = a.seed;
  try {
    validate(opt.sampling);
  } catch (const Error& e) {
    throw UsageError(std::string("--") + e.what());  // its messages start with the option's name
  }

  cpu::set_num_threads(a.threads);
  const auto t0 = std::chrono::steady_clock::now();
  check_model_dir(a.model);
  // Under mpirun, or with --tp/--ep, every rank decodes with its slices; rank 0 prints.
  std::optional<Model> model;
  std::optional<dist::Mesh> mesh;
  std::optional<dist::ShardedModel> sharded;
#ifdef NEXTLM_HAVE_CUDA
  std::unique_ptr<CudaModel> gpu;
#endif
  if (parallel_run(a.tp, a.ep)) {
    if (a.device != "cpu") throw UsageError("--tp/--ep and mpirun run on --device cpu only");
    if (!a.adapter.empty()) throw UsageError("--adapter is not supported with --tp/--ep or mpirun (merge it first)");
    load_parallel(a.model, a.tp, a.ep, mesh, sharded);
  } else if (a.device == "cuda") {
#ifdef NEXTLM_HAVE_CUDA
    // Straight from the checkpoint in bf16, as `score --device cuda` loads it, so that the log-probs reported here
    // agree with its scores; with an adapter, as score loads it too: merged into the fp32 host weights first.
    gpu = a.adapter.empty() ? CudaModel::load(a.model)
                            : std::make_unique<CudaModel>(load_model_with_adapter(a.model, a.adapter));
    gpu->set_batch_invariant(a.batch_invariant);
#endif
  } else {
    model.emplace(load_model_with_adapter(a.model, a.adapter));  // no --adapter: the model as it is
  }
  const ModelConfig* config = model ? &model->config() : sharded ? &sharded->config : nullptr;
#ifdef NEXTLM_HAVE_CUDA
  if (gpu) config = &gpu->config();
#endif
  const int64_t V = config->vocab_size;
  // The eos ids go into the options that every decoder's loop (generate_with) reads, so CPU, CUDA and parallel runs
  // stop alike.
  if (!a.ignore_eos) opt.eos_tokens = load_eos_token_ids(a.model, *config);
  // A model directory with tokenizer.json reads and writes text with it; without one, byte-level models (a 256-token
  // vocabulary) use UTF-8 bytes, and others take token ids only.
  std::optional<Tokenizer> tokenizer;
  if (const fs::path tj = fs::path(a.model) / "tokenizer.json"; fs::exists(tj)) {
    tokenizer = Tokenizer::load(tj.string());
    check(tokenizer->vocab_size() <= V, tj.string(), " has ids up to ", tokenizer->vocab_size() - 1,
          ", outside the model's vocabulary [0, ", V, ")");
  }
  const bool byte_level = !tokenizer && V == 256;
  std::vector<int32_t> prompt;
  if (has_prompt) {
    if (a.chat) {
      check(tokenizer.has_value(), "--chat needs the model's tokenizer.json (GLM's chat format uses its special ",
            "tokens), and ", a.model, " has none");
      prompt = tokenizer->encode(render_glm_chat({{"user", a.prompt}}));
    } else if (tokenizer) {
      prompt = tokenizer->encode(a.prompt);
    } else {
      check(byte_level, "--prompt needs a tokenizer, which is not available for this model (", a.model,
            " has no tokenizer.json and vocab_size ", V, "); give --prompt-tokens instead");
      for (unsigned char ch : a.prompt) prompt.push_back(ch);
    }
    check(!prompt.empty(), "--prompt encodes to no tokens");
  } else {
    prompt = parse_token_list("--prompt-tokens", a.prompt_tokens);
  }
  for (int32_t id : prompt)
    check(id < V, "--prompt-tokens: token id ", id, " is outside the vocabulary [0, ", V, ")");
  for (int32_t id : opt.stop_tokens)
    check(id < V, "--stop-tokens: token id ", id, " is outside the vocabulary [0, ", V, ")");

  Generation g;
  if (model) {
    g = generate(*model, prompt, opt);
  } else if (sharded) {
    g = dist::parallel_generate(*sharded, *mesh, prompt, opt);
  } else {
#ifdef NEXTLM_HAVE_CUDA
    g = cuda_generate(*gpu, prompt, opt);  // CudaDecoder: prefill, then one-token steps on the device
#endif
  }
  if (dist::world().rank() != 0) return 0;
  // The text leaves out a final eos token (it is in "tokens" and "logprobs": it was sampled); models without text
  // print every id.
  const std::vector<int32_t> text_tokens(g.tokens.begin(), g.tokens.end() - (g.eos ? 1 : 0));
  std::ostringstream os;
  if (a.format == "json") {
    os << "{\"tokens\": [";
    for (size_t i = 0; i < g.tokens.size(); ++i) os << (i ? ", " : "") << g.tokens[i];
    os << "], \"logprobs\": [";
    for (size_t i = 0; i < g.logprobs.size(); ++i) os << (i ? ", " : "") << number(g.logprobs[i]);
    os << "]";
    if (tokenizer) os << ", \"text\": " << nlohmann::json(tokenizer->decode(text_tokens)).dump();
    os << "}\n";
  } else if (tokenizer) {
    os << tokenizer->decode(text_tokens) << "\n";
  } else if (byte_level) {
    for (int32_t t : text_tokens) os << static_cast<char>(t);
    os << "\n";
  } else {
    for (size_t i = 0; i < g.tokens.size(); ++i) os << (i ? " " : "") << g.tokens[i];
    os << "\n";
  }
  std::cout << os.str() << std::flush;
  check(std::cout.good(), "cannot write to standard output");
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::cerr << "generated " << g.tokens.size() << " tokens after a " << prompt.size() << "-token prompt ("
            << (g.eos ? "eos token" : g.stopped ? "stop token" : "max-new-tokens") << ") in " << number(secs) << " s\n";
  return 0;
}

// `serve`: the flag combinations are checked here (usage errors, before the model loads), then run_server.
int cmd_serve(const serve::ServeOptions& opt, bool has_max_len) {
  if (opt.device != "cuda") {
    if (opt.batch_invariant) throw UsageError("--batch-invariant applies to --device cuda only");
    if (has_max_len) throw UsageError("--max-len applies to --device cuda only (the CPU decoder has no fixed length)");
  }
  // Under mpirun, or with --tp/--ep: every rank loads its slices; rank 0 serves, the others follow its calls.
  if (parallel_run(opt.tp, opt.ep)) {
    if (opt.device != "cpu")
      throw UsageError("--tp/--ep and mpirun serve on --device cpu only (the GPU decoder runs on one GPU)");
    if (!opt.adapter.empty()) throw UsageError("--adapter is not supported with --tp/--ep or mpirun (merge it first)");
    check(dist::mpi_calls_from_any_thread(), "serve under mpirun needs an MPI that allows calls from any thread, "
          "one at a time (MPI_THREAD_SERIALIZED)");
    std::optional<dist::Mesh> mesh;
    std::optional<dist::ShardedModel> model;
    load_parallel(opt.model_dir, opt.tp, opt.ep, mesh, model);
    if (dist::world().rank() != 0) {
      serve::follow_server(*model, *mesh, opt.max_batch, opt.threads);
      return 0;
    }
    return serve::run_server(opt, std::make_unique<serve::DistBackend>(*model, *mesh, opt.max_batch, opt.threads),
                             model->config);
  }
  return serve::run_server(opt);
}

std::string layer_pattern(const ModelConfig& c) {
  std::string s;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    if (c.layer_types[i] == LayerType::LinearAttention) {
      s += 'K';
    } else {
      s += c.indexer_types[i] == IndexerType::Full ? 'D' : 'd';
    }
  }
  return s;
}

int cmd_info(const std::string& dir) {
  check_model_dir(dir);
  LoadReport rep;
  const Model model = Model::load(dir, &rep);
  const ModelConfig& c = model.config();
  auto& o = std::cout;
  o << "model         " << dir << "\n";
  o << "config        glm5_next (" << (c.nested ? "nested text_config" : "flat") << ")\n";
  o << "vocab/hidden  " << c.vocab_size << " / " << c.hidden_size << "\n";
  o << "layers        " << c.num_hidden_layers << ": " << c.num_kda_layers() << " KDA, " << c.num_dsa_layers()
    << " DSA\n";
  o << "pattern       " << layer_pattern(c) << "   (K = KDA, D = DSA with its own indexer, d = shared indexer)\n";
  std::string mlp;
  for (MlpType t : c.mlp_layer_types) mlp += t == MlpType::Dense ? 'M' : 'E';
  o << "mlp           " << mlp << "   (M = dense MLP, E = MoE)\n";
  o << "KDA           " << c.linear_num_heads << " heads x " << c.linear_head_dim << ", conv " << c.linear_conv_kernel_dim
    << ", gate " << (c.linear_lower_bound ? "safe, lower bound " + number(*c.linear_lower_bound) : std::string("softplus"))
    << "\n";
  o << "MLA           " << c.num_attention_heads << " heads, q_lora " << c.q_lora_rank << ", kv_lora " << c.kv_lora_rank
    << ", qk " << c.qk_nope_head_dim << ", v " << c.v_head_dim << " (NoPE)\n";
  o << "indexer       " << c.index_n_heads << " heads x " << c.index_head_dim << ", top-k " << c.index_topk
    << ", kpool " << c.index_kpool << ", tail " << (c.index_kpool_always_select_tail ? "on" : "off") << "\n";
  o << "MoE           " << c.n_routed_experts << " experts, top " << c.num_experts_per_tok << ", " << c.n_shared_experts
    << " shared, groups " << c.n_group << "/" << c.topk_group << ", width " << c.moe_intermediate_size
    << ", scale " << number(c.routed_scaling_factor) << ", swiglu limit " << number(c.swiglu_limit) << "\n";
  o << "mHC           " << c.hc_mult << " streams, " << c.hc_sinkhorn_iters << " Sinkhorn iterations\n";
  o << "parameters    " << model.num_parameters() << " total, " << model.num_active_parameters()
    << " active per token\n";
  o << "tensors       " << rep.loaded_tensors << " loaded; skipped " << rep.vision_tensors << " vision, "
    << rep.mtp_tensors << " MTP-layer, " << rep.shared_head_tensors << " shared_head\n";
  for (const std::string& n : rep.unexpected) std::cerr << "warning: unexpected tensor " << n << " (ignored)\n";
  return 0;
}

int run_cli_impl(int argc, char** argv) {
  CLI::App app{"nextlm: runs, scores and trains GLM-5.3-Flash (glm5_next) models"};
  // At most one command; none at all is reported below in our own words.
  app.require_subcommand(0, 1);
  app.set_version_flag("--version", "nextlm 0.1.0");

  ScoreArgs score;
  CLI::App* sc = app.add_subcommand("score", "log-probabilities of token sequences (JSONL {\"tokens\": [...]})");
  sc->add_option("--model", score.model, "model directory (config.json + safetensors)")->required()->check(non_empty());
  sc->add_option("--input", score.input, "JSONL file, one {\"tokens\": [ids...]} per line")->required()->check(non_empty());
  sc->add_option("--output", score.output, "write JSONL here instead of stdout")->check(non_empty());
  sc->add_option("--logits-out", score.logits_out, "write logits.{i} [T_i, V] f32 to this safetensors file")
      ->check(non_empty());
  sc->add_option("--device", score.device, "compute device (cpu, or cuda in a CUDA build)")
      ->check(one_of(available_devices(), "a device available in this build"))
      ->capture_default_str();
  sc->add_option("--format", score.format, "jsonl or text")
      ->check(one_of({"jsonl", "text"}, "an output format"))
      ->capture_default_str();
  sc->add_option("--threads", score.threads, "CPU threads (default: all)")->check(thread_count());
  sc->add_option("--adapter", score.adapter, "LoRA adapter directory (PEFT) to apply, merged in fp32")->check(non_empty());
  sc->add_flag("--batch-invariant", score.batch_invariant,
               "--device cuda: each sequence's results bitwise independent of the others in the file (slower GEMMs)");
  sc->add_option("--tp", score.tp,
                 "tensor-parallel ranks (CPU: under mpirun, divides -np and the head counts; --device cuda: one GPU "
                 "per rank, threads of this process or mpirun's processes)")
      ->check(rank_count())->capture_default_str();
  sc->add_option("--ep", score.ep,
                 "expert-parallel ranks (CPU: under mpirun, divides -np and n_routed_experts; --device cuda: one "
                 "GPU per rank)")
      ->check(rank_count())->capture_default_str();

  std::string info_dir;
  CLI::App* in = app.add_subcommand("info", "config summary, layer pattern, parameter counts, skipped tensors");
  in->add_option("--model", info_dir, "model directory")->required()->check(non_empty());

  GradArgs grad;
  CLI::App* gr = app.add_subcommand("grad", "loss and gradients of every trainable tensor (safetensors, hub names)");
  gr->add_option("--model", grad.model, "model directory (config.json + safetensors)")->required()->check(non_empty());
  gr->add_option("--input", grad.input, "JSONL file, one {\"tokens\": [ids...]} per line")->required()->check(non_empty());
  gr->add_option("--out", grad.out, "safetensors file for the gradients and `loss`")->required()->check(non_empty());
  gr->add_option("--device", grad.device, "compute device (cpu, or cuda in a CUDA build: bf16 weights and GEMMs)")
      ->check(one_of(available_devices(), "a device available in this build"))
      ->capture_default_str();
  gr->add_option("--threads", grad.threads, "CPU threads (default: all)")->check(thread_count());
  gr->add_option("--recompute", grad.recompute,
                 "sub-layers the backward runs forward again (the others keep their activations from the forward: "
                 "more memory, less time, the same gradients bit for bit but for the kept KDA chunk states' bf16 "
                 "rounding): auto, all, none, or a comma-separated list of kda, mla, moe, experts, mlp, mhc, states "
                 "(experts: the routed experts' gate|up inside a recomputed MoE; states: a kept KDA layer's chunk "
                 "states; both on the GPU). auto: on one GPU everything kept, falling back to states, kda,mla,moe,mhc "
                 "and then all when out of device memory; elsewhere kda,mla,moe,mhc")
      ->type_name("POLICY")
      ->capture_default_str();
  gr->add_option("--tp", grad.tp,
                 "tensor-parallel ranks (CPU: under mpirun, divides -np and the head counts; --device cuda: one GPU "
                 "per rank, threads of this process or mpirun's processes)")
      ->check(rank_count())->capture_default_str();
  gr->add_option("--ep", grad.ep,
                 "expert-parallel ranks (CPU: under mpirun, divides -np and n_routed_experts; --device cuda: one "
                 "GPU per rank)")
      ->check(rank_count())->capture_default_str();

  GenerateArgs gen;
  CLI::App* ge = app.add_subcommand("generate", "continue a prompt (greedy or sampled), with log-probabilities");
  ge->add_option("--model", gen.model, "model directory (config.json + safetensors)")->required()->check(non_empty());
  ge->add_option("--adapter", gen.adapter, "LoRA adapter directory (PEFT) to apply, merged in fp32")
      ->check(non_empty());
  CLI::Option* gen_prompt_tokens =
      ge->add_option("--prompt-tokens", gen.prompt_tokens, "prompt token ids, comma-separated")->check(non_empty());
  CLI::Option* gen_prompt =
      ge->add_option("--prompt", gen.prompt, "prompt text (encoded with the model's tokenizer.json; byte-level models "
                     "without one: its UTF-8 bytes)")->check(non_empty());
  ge->add_flag("--chat", gen.chat,
               "--prompt is one user message, rendered in GLM's chat format (needs tokenizer.json)");
  ge->add_option("--max-new-tokens", gen.max_new_tokens, "tokens to generate at most")->required();
  ge->add_option("--temperature", gen.temperature, "divides the logits; 0 = greedy")->capture_default_str();
  ge->add_option("--top-k", gen.top_k, "keep the k most likely tokens (0 = all)")->capture_default_str();
  ge->add_option("--top-p", gen.top_p, "keep the fewest most likely tokens whose mass is >= p")->capture_default_str();
  ge->add_option("--min-p", gen.min_p, "keep tokens with p >= min-p x the largest p")->capture_default_str();
  ge->add_option("--seed", gen.seed, "random seed (same seed, same tokens)")
      ->check(unsigned_integer())
      ->capture_default_str();
  ge->add_option("--stop-tokens", gen.stop_tokens, "comma-separated ids that end generation (and are output)")
      ->check(non_empty());
  ge->add_flag("--ignore-eos", gen.ignore_eos,
               "do not end generation on the model's eos_token_id (generation_config.json, else config.json), which "
               "otherwise ends it and is left out of the text");
  ge->add_option("--device", gen.device, "compute device (cpu, or cuda in a CUDA build)")
      ->check(one_of(available_devices(), "a device available in this build"))
      ->capture_default_str();
  ge->add_flag("--batch-invariant", gen.batch_invariant,
               "--device cuda: nextlm's own batch-invariant GEMM instead of cuBLASLt (slower); the tokens are those "
               "`serve --device cuda --batch-invariant` gives for the same request");
  ge->add_option("--format", gen.format,
                 "text (decoded with tokenizer.json, bytes of a byte-level model, else ids) or json (+ \"text\" "
                 "with a tokenizer)")
      ->check(one_of({"text", "json"}, "an output format"))
      ->capture_default_str();
  ge->add_option("--threads", gen.threads, "CPU threads (default: all)")->check(thread_count());
  ge->add_option("--tp", gen.tp, "tensor-parallel ranks (under mpirun; divides -np and the head counts)")
      ->check(rank_count())->capture_default_str();
  ge->add_option("--ep", gen.ep, "expert-parallel ranks (under mpirun; divides -np and n_routed_experts)")
      ->check(rank_count())->capture_default_str();

  serve::ServeOptions srv;
  CLI::App* sv = app.add_subcommand("serve", "OpenAI-compatible HTTP server (completions, chat, streaming)");
  sv->add_option("--model", srv.model_dir, "model directory (config.json + safetensors)")->required()->check(non_empty());
  sv->add_option("--adapter", srv.adapter, "LoRA adapter directory (PEFT) to apply, merged in fp32")
      ->check(non_empty());
  sv->add_option("--port", srv.port, "TCP port (0: any free port, printed on stdout)")
      ->required()
      ->check(CLI::Range(0, 65535));
  sv->add_option("--host", srv.host, "address to listen on")->capture_default_str()->check(non_empty());
  sv->add_option("--max-batch", srv.max_batch, "requests decoded together (more wait in a queue)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  sv->add_option("--max-tokens", srv.max_tokens, "prompt + max_tokens of a request, at most")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{2}, int64_t{1} << 40));
  sv->add_option("--threads", srv.threads, "CPU threads (default: all)")->check(thread_count());
  sv->add_option("--device", srv.device, "compute device (cpu, or cuda in a CUDA build)")
      ->check(one_of(available_devices(), "a device available in this build"))
      ->capture_default_str();
  CLI::Option* serve_max_len =
      sv->add_option("--max-len", srv.max_len,
                     "--device cuda: tokens per decoder slot, which bounds prompt + max_tokens (default: the smaller "
                     "of --max-tokens, max_position_embeddings and " + std::to_string(serve::kDefaultMaxLen) + ")")
          ->check(CLI::Range(int64_t{2}, int64_t{1} << 40));
  sv->add_flag("--batch-invariant", srv.batch_invariant,
               "--device cuda: nextlm's own batch-invariant GEMM instead of cuBLASLt (slower), so that a request's "
               "tokens do not depend on the requests prefilled with it: they are `generate --batch-invariant`'s");
  sv->add_option("--tp", srv.tp, "tensor-parallel ranks (under mpirun, --device cpu; divides -np and the head counts)")
      ->check(rank_count())->capture_default_str();
  sv->add_option("--ep", srv.ep, "expert-parallel ranks (under mpirun, --device cpu; divides -np and n_routed_experts)")
      ->check(rank_count())->capture_default_str();

  TrainArgs train;
  CLI::App* tr = add_train_command(app, train);
  MergeArgs merge;
  CLI::App* mg = add_merge_command(app, merge);

  // An unknown command would otherwise be reported as an unexpected argument.
  bool known_command = false;
  if (argc >= 2)
    for (CLI::App* cmd : app.get_subcommands([](CLI::App*) { return true; })) known_command |= cmd->check_name(argv[1]);
  if (argc >= 2 && argv[1][0] != '-' && !known_command) {
    print_error(std::string("unknown command \"") + argv[1] +
                "\" (commands: score, info, grad, generate, train, merge, serve; run nextlm --help)");
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    std::cout << app.help();
    return 0;
  } catch (const CLI::CallForAllHelp& e) {
    std::cout << app.help();
    return 0;
  } catch (const CLI::CallForVersion& e) {
    std::cout << e.what() << "\n";
    return 0;
  } catch (const CLI::ParseError& e) {
    print_error(std::string(e.what()) + " (run nextlm --help)");
    return 2;
  }
  try {
    if (*sc) return cmd_score(score);
    if (*in) return cmd_info(info_dir);
    if (*ge) return cmd_generate(gen, gen_prompt_tokens->count() > 0, gen_prompt->count() > 0);
    if (*gr) return cmd_grad(grad);
    if (*tr) return cmd_train(train, *tr);
    if (*mg) return cmd_merge(merge);
    if (*sv) return cmd_serve(srv, serve_max_len->count() > 0);
  } catch (const TrainUsageError& e) {
    print_error(std::string(e.what()) + " (run nextlm train --help)");
    return 2;
  } catch (const UsageError& e) {
    print_error(std::string(e.what()) + " (run nextlm --help)");
    return 2;
  } catch (const Error& e) {
    print_error(e.what());
    return 1;
  }
  print_error("no command given (commands: score, info, grad, generate, train, merge, serve; run nextlm --help)");
  return 2;
}

}  // namespace

int run_cli(int argc, char** argv) {
  // Errors from the standard library or nlohmann (filesystem_error, json exceptions, bad_alloc) are reported like
  // our own, on one line, instead of terminating the process.
  try {
    return run_cli_impl(argc, argv);
  } catch (const std::bad_alloc&) {
    print_error("out of memory");
  } catch (const std::exception& e) {
    print_error(e.what());
  } catch (...) {
    print_error("unexpected failure");
  }
  return 1;
}

}  // namespace nextlm
