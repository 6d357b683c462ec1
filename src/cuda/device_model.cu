// Orchestrates the bf16 forward on one GPU: uploads weights (from a host model, a checkpoint or a device-side
// random init), plans a packed batch (sequence offsets, KDA chunks, indexer pools), and runs the layers on one
// stream out of a reusable arena (no cudaMalloc once warmed up).
#include "cuda/device_model.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <tuple>
#include <optional>
#include <string>
#include <utility>

#include "core/env.h"
#include "cuda/decode_kernels.h"
#include "cuda/distribution_compare.h"
#include "cuda/gemm.h"
#include "cuda/grouped_gemm.h"
#include "cuda/kernels.h"
#include "cuda/model_impl.h"
#include "cuda/random_init.h"
#include "io/safetensors.h"
#include "model/init.h"

namespace nextlm {

namespace {
// How the MoE experts run (set_moe_expert_gemm): a GroupedGemmKernel, or −1 for one cuBLASLt GEMM per expert.
int g_moe_expert_gemm = 5;  // kWgmmaTma128x256: the fastest on the H200 (bench/results/h200.json)
}  // namespace

void set_moe_expert_gemm(int mode) {
  check(mode >= -1 && mode < cuda::kGroupedGemmKernels, "MoE expert GEMM: mode must be -1 (cuBLASLt per expert) or a "
        "grouped GEMM kernel 0..", cuda::kGroupedGemmKernels - 1, ", got ", mode);
  g_moe_expert_gemm = mode;
}
int moe_expert_gemm() { return g_moe_expert_gemm; }

namespace {
int g_moe_expert_gemm_dx = -2;  // the forward's variant, the TMA kernel's in clusters of four (moe_expert_gemm_dx)
}  // namespace

void set_moe_expert_gemm_dx(int mode) {
  check(mode >= -2 && mode != -1 && mode < cuda::kGroupedGemmKernels, "MoE input-gradient GEMM: mode must be -2 "
        "(follow the forward's) or a grouped GEMM kernel 0..", cuda::kGroupedGemmKernels - 1, ", got ", mode);
  g_moe_expert_gemm_dx = mode;
}
int moe_expert_gemm_dx(bool tiles) {
  if (g_moe_expert_gemm_dx >= 0) return g_moe_expert_gemm_dx;
  const int fwd = g_moe_expert_gemm;
  return fwd == static_cast<int>(cuda::GroupedGemmKernel::kWgmmaTma128x256) && !tiles
             ? static_cast<int>(cuda::GroupedGemmKernel::kWgmmaTma128x256c4)
             : fwd;
}

int frozen_expert_layout(const ModelConfig& c) {
  const auto tma = [](int k) {
    return k == static_cast<int>(cuda::GroupedGemmKernel::kWgmmaTma128x256) ||
           k == static_cast<int>(cuda::GroupedGemmKernel::kWgmmaTma128x256c4);
  };
  const bool widths = c.hidden_size % 128 == 0 && c.moe_intermediate_size % 128 == 0;
  return widths && tma(moe_expert_gemm()) && tma(moe_expert_gemm_dx(true))
             ? static_cast<int>(cuda::GroupedWeightLayout::kTiles)
             : static_cast<int>(cuda::GroupedWeightLayout::kRows);
}

namespace {
int g_expert_lora_fold = 2;
}  // namespace

void set_expert_lora_fold(int mode) {
  check(mode >= 0 && mode <= 2, "expert LoRA fold: mode must be 0 (after the GEMMs), 1 (forward GEMMs) or 2 (forward "
        "and input-gradient GEMMs), got ", mode);
  g_expert_lora_fold = mode;
}
int expert_lora_fold() { return g_expert_lora_fold; }

namespace {
EnvSwitch g_mhc_mix_fold{"NEXTLM_MHC_MIX_FOLD"};
}  // namespace

void set_mhc_mix_fold(bool on) { g_mhc_mix_fold.set(on); }
bool mhc_mix_fold() { return g_mhc_mix_fold.on(); }

namespace {
EnvSwitch g_mhc_post_fusion{"NEXTLM_MHC_POST_FUSION"};
std::atomic<int64_t> g_mhc_fused_posts{0};
}  // namespace

void set_mhc_post_fusion(bool on) { g_mhc_post_fusion.set(on); }
bool mhc_post_fusion() { return g_mhc_post_fusion.on(); }
int64_t mhc_fused_posts() { return g_mhc_fused_posts; }
void note_mhc_fused_post() { ++g_mhc_fused_posts; }

namespace {
std::atomic<bool> g_lora_stacking{true};
std::atomic<int64_t> g_lora_stacked_groups{0};
}  // namespace

namespace {
std::atomic<bool> g_lora_joining{true};
std::atomic<int64_t> g_lora_joined{0}, g_lora_joined_dx{0};
}  // namespace

void set_lora_joining(bool on) { g_lora_joining = on; }
bool lora_joining() { return g_lora_joining; }
int64_t lora_joined_projections() { return g_lora_joined; }
void note_lora_joined_projection() { ++g_lora_joined; }
int64_t lora_joined_input_gradients() { return g_lora_joined_dx; }
void note_lora_joined_input_gradient() {
  ++g_lora_joined;
  ++g_lora_joined_dx;
}

namespace {
std::atomic<bool> g_narrow_joining{true};
std::atomic<int64_t> g_narrow_joined{0};
}  // namespace

void set_narrow_joining(bool on) { g_narrow_joining = on; }
bool narrow_joining() { return g_narrow_joining; }
int64_t narrow_joined_gradients() { return g_narrow_joined; }
void note_narrow_joined_gradient() { ++g_narrow_joined; }

namespace {
std::atomic<size_t> g_head_block_bytes{size_t{2} << 30};
}  // namespace

void set_head_block_bytes(size_t bytes) { g_head_block_bytes = bytes; }
size_t head_block_bytes() { return g_head_block_bytes; }

void set_lora_stacking(bool on) { g_lora_stacking = on; }
bool lora_stacking() { return g_lora_stacking; }
int64_t lora_stacked_groups() { return g_lora_stacked_groups; }
void note_lora_stacked_group() { ++g_lora_stacked_groups; }

std::string cuda_device_name(int device) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n <= device) return "";
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) return "";
  return prop.name;
}

namespace cuda {
namespace {

std::vector<uint16_t> to_bf16_bits(const float* x, int64_t n) {
  std::vector<uint16_t> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = f32_to_bf16(x[i]);
  return v;
}

// The fp32 weights of a loaded host model, under their hub names (hub_tensors), converted to bf16 on the way.
class HostSource : public WeightSource {
 public:
  explicit HostSource(const Model& m) {
    for (const TensorToWrite& t : hub_tensors(m.config(), m.weights()))
      tensors_[t.name] = {static_cast<const float*>(t.data), numel_of(t.shape)};
    // Always the model's own lm_head (hub_tensors leaves it out when tied; it is then a copy of the embedding).
    tensors_["lm_head.weight"] = {m.weights().lm_head.ptr(), m.weights().lm_head.numel()};
  }
  std::string prefix() const override { return "model.language_model."; }
  bool has(const std::string& name) const override { return tensors_.count(name) != 0; }
  void bf16_into(const std::string& name, const std::vector<int64_t>& shape, const DistSpec&, bf16* dst) override {
    const auto& t = get(name, shape);
    const std::vector<uint16_t> v = to_bf16_bits(t.first, t.second);
    NEXTLM_CUDA_CHECK(cudaMemcpy(dst, v.data(), v.size() * sizeof(uint16_t), cudaMemcpyHostToDevice));
  }
  void f32_into(const std::string& name, const std::vector<int64_t>& shape, const DistSpec&, float* dst) override {
    const auto& t = get(name, shape);
    NEXTLM_CUDA_CHECK(cudaMemcpy(dst, t.first, t.second * sizeof(float), cudaMemcpyHostToDevice));
  }

 private:
  // The host model was checked when it was loaded; its conv weights are [C, W] where the hub has [C, 1, W], so
  // only the element count is compared here.
  const std::pair<const float*, int64_t>& get(const std::string& name, const std::vector<int64_t>& shape) const {
    auto it = tensors_.find(name);
    check(it != tensors_.end(), "host model has no tensor ", name);
    check(it->second.second == numel_of(shape), "host tensor ", name, " has ", it->second.second,
          " elements, expected ", numel_of(shape));
    return it->second;
  }
  std::map<std::string, std::pair<const float*, int64_t>> tensors_;
};

// A checkpoint directory, read tensor by tensor from the mapped files: bf16 stays bf16 (copied byte for byte), other
// float types are converted exactly as Model::load converts them (to fp32, then to bf16 where the device wants it).
class CheckpointSource : public WeightSource {
 public:
  explicit CheckpointSource(const std::string& dir) : ckpt_(dir) {
    prefix_ = "model.language_model.";
    if (!ckpt_.find(prefix_ + "embed_tokens.weight") && ckpt_.find("model.embed_tokens.weight")) prefix_ = "model.";
  }
  std::string prefix() const override { return prefix_; }
  bool has(const std::string& name) const override { return ckpt_.find(name) != nullptr; }
  void bf16_into(const std::string& name, const std::vector<int64_t>& shape, const DistSpec&, bf16* dst) override {
    const TensorView& t = get(name, shape);
    if (t.dtype == DType::BF16) {
      NEXTLM_CUDA_CHECK(cudaMemcpy(dst, t.data, t.nbytes, cudaMemcpyHostToDevice));
    } else {
      const std::vector<float> f = to_f32(t);
      const std::vector<uint16_t> v = to_bf16_bits(f.data(), static_cast<int64_t>(f.size()));
      NEXTLM_CUDA_CHECK(cudaMemcpy(dst, v.data(), v.size() * sizeof(uint16_t), cudaMemcpyHostToDevice));
    }
  }
  void f32_into(const std::string& name, const std::vector<int64_t>& shape, const DistSpec&, float* dst) override {
    const TensorView& t = get(name, shape);
    if (t.dtype == DType::F32) {
      NEXTLM_CUDA_CHECK(cudaMemcpy(dst, t.data, t.nbytes, cudaMemcpyHostToDevice));
    } else {
      const std::vector<float> f = to_f32(t);
      NEXTLM_CUDA_CHECK(cudaMemcpy(dst, f.data(), f.size() * sizeof(float), cudaMemcpyHostToDevice));
    }
  }
  // Slices read only their own bytes of the mapped file when the tensor is stored as the device keeps it (bf16
  // linears, fp32 keep-tensors); another type is converted whole on the host, then cut.
  void bf16_slice_into(const std::string& name, const std::vector<int64_t>& shape, const DistSpec& init,
                       const Slice& s, bf16* dst) override {
    if (s.axis < 0) return bf16_into(name, shape, init, dst);
    const TensorView& t = get(name, shape);
    if (t.dtype == DType::BF16) return copy_slice(t.data, shape, s, dst, sizeof(bf16), cudaMemcpyHostToDevice);
    const std::vector<float> f = to_f32(t);
    const std::vector<uint16_t> v = to_bf16_bits(f.data(), static_cast<int64_t>(f.size()));
    copy_slice(v.data(), shape, s, dst, sizeof(bf16), cudaMemcpyHostToDevice);
  }
  void f32_slice_into(const std::string& name, const std::vector<int64_t>& shape, const DistSpec& init,
                      const Slice& s, float* dst) override {
    if (s.axis < 0) return f32_into(name, shape, init, dst);
    const TensorView& t = get(name, shape);
    if (t.dtype == DType::F32) return copy_slice(t.data, shape, s, dst, sizeof(float), cudaMemcpyHostToDevice);
    const std::vector<float> f = to_f32(t);
    copy_slice(f.data(), shape, s, dst, sizeof(float), cudaMemcpyHostToDevice);
  }

 private:
  const TensorView& get(const std::string& name, const std::vector<int64_t>& shape) const {
    const TensorView* t = ckpt_.find(name);
    check(t != nullptr, "checkpoint ", ckpt_.dir(), " is missing tensor ", name);
    check(t->shape == shape, "tensor ", name, " in ", t->file, " has shape ", shape_str(t->shape), ", expected ",
          shape_str(shape));
    return *t;
  }
  Checkpoint ckpt_;
  std::string prefix_;
};

// Random weights drawn on the device: every tensor from its own stream (seed, name).
class RandomSource : public WeightSource {
 public:
  RandomSource(const ModelConfig& c, uint64_t seed, cudaStream_t st) : c_(c), seed_(seed), stream_(st) {}
  std::string prefix() const override { return "model.language_model."; }
  bool has(const std::string& name) const override { return !(name == "lm_head.weight" && c_.tie_word_embeddings); }
  bool random() const override { return true; }
  void bf16_into(const std::string& name, const std::vector<int64_t>& shape, const DistSpec& init,
                 bf16* dst) override {
    fill_random(dst, true, numel_of(shape), init, tensor_key(seed_, name), stream_);
  }
  void f32_into(const std::string& name, const std::vector<int64_t>& shape, const DistSpec& init,
                float* dst) override {
    fill_random(dst, false, numel_of(shape), init, tensor_key(seed_, name), stream_);
  }

 private:
  const ModelConfig& c_;
  uint64_t seed_;
  cudaStream_t stream_;
};

}  // namespace
}  // namespace cuda


CudaModel::CudaModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

CudaModel::CudaModel(const Model& model, int device) : impl_(std::make_unique<Impl>(model.config(), device)) {
  cuda::HostSource src(model);
  impl_->build(src);
}

std::unique_ptr<CudaModel> CudaModel::load(const std::string& dir, int device, const CudaShard& shard) {
  const ModelConfig c = load_config((std::filesystem::path(dir) / "config.json").string());
  auto impl = std::make_unique<Impl>(c, device, shard);
  cuda::CheckpointSource src(dir);
  impl->build(src);
  return std::unique_ptr<CudaModel>(new CudaModel(std::move(impl)));
}

std::unique_ptr<CudaModel> CudaModel::random(const ModelConfig& config, uint64_t seed, int device,
                                             const CudaShard& shard) {
  validate(config);
  auto impl = std::make_unique<Impl>(config, device, shard);
  cuda::RandomSource src(impl->full, seed, impl->stream);
  impl->build(src);
  return std::unique_ptr<CudaModel>(new CudaModel(std::move(impl)));
}

CudaModel::~CudaModel() = default;

void CudaModel::set_weights(const Model& model) {
  impl_->weights_changed();
  Impl& m = *impl_;
  const ModelConfig& c = model.config();
  check(c.num_hidden_layers == m.cfg.num_hidden_layers && c.hidden_size == m.cfg.hidden_size &&
            c.vocab_size == m.cfg.vocab_size && c.layer_types == m.cfg.layer_types,
        "set_weights: the host model's config differs from the device model's");
  m.join_lora_update();
  NEXTLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  // The fills write the experts' weights row-major: they go back into their layout after.
  auto layout = cuda::GroupedWeightLayout::kRows;
  for (cuda::DLayer& L : m.layers)
    if (L.moe_layer) layout = std::exchange(L.moe.layout, cuda::GroupedWeightLayout::kRows);
  cuda::HostSource src(model);
  for (const Impl::Fill& f : m.fills) {
    // The host source names the text model model.language_model.*; a text-only checkpoint had model.*.
    std::string name = f.name;
    const std::string full = "model.language_model.", text = "model.";
    if (name.rfind(full, 0) != 0 && name.rfind(text, 0) == 0) name = full + name.substr(text.size());
    if (f.bf16) {
      src.bf16_slice_into(name, f.shape, f.init, f.slice, static_cast<cuda::bf16*>(f.dst));
    } else {
      src.f32_slice_into(name, f.shape, f.init, f.slice, static_cast<float*>(f.dst));
    }
  }
  // A cudaMemcpy from pageable memory may return before its last DMA lands, and the model's stream does not wait
  // for the legacy stream's copies: wait for them here.
  NEXTLM_CUDA_CHECK(cudaDeviceSynchronize());
  if (m.lora) m.lora->clear_joined();  // copies of the old projections
  set_expert_layout(static_cast<int>(layout));
}

double CudaModel::last_forward_ms() const { return impl_->last_ms; }

const ModelConfig& CudaModel::config() const { return impl_->full; }
const CudaShard& CudaModel::shard() const { return impl_->shard; }
void* CudaModel::stream() const { return impl_->stream; }

void CudaModel::set_collectives(dist::Comm* tp, dist::Comm* ep) {
  Impl& m = *impl_;
  check(!tp || tp->size() == m.shard.tp, "set_collectives: a TP group of ", tp ? tp->size() : 0, " ranks for tp ",
        m.shard.tp);
  check(!ep || ep->size() == m.shard.ep, "set_collectives: an EP group of ", ep ? ep->size() : 0, " ranks for ep ",
        m.shard.ep);
  check((m.shard.tp == 1 || tp) && (m.shard.ep == 1 || ep), "set_collectives: a sharded model needs its groups");
  check(m.shard.tp != m.shard.ep || m.shard.tp == 1 || tp == ep,
        "set_collectives: with tp == ep the TP and EP groups are one communicator");
  m.tp_comm = m.shard.tp > 1 ? tp : nullptr;
  m.ep_comm = m.shard.ep > 1 ? ep : nullptr;
}

void CudaModel::set_profiling(bool on) { impl_->profiling = on; }
std::vector<std::pair<std::string, double>> CudaModel::profile() const { return impl_->prof; }

void CudaModel::forward_hidden_only(const PackedBatch& batch) {
  Impl& m = *impl_;
  m.start(batch);
  const cuda::Plan p = m.plan(batch);
  m.hidden(p);
  m.end_timing();
  NEXTLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  m.finish_profile();
}

Tensor CudaModel::forward(const PackedBatch& batch) {
  Impl& m = *impl_;
  check(m.shard.tp == 1, "CudaModel::forward: full logits of a vocabulary-parallel model are not gathered (use "
        "next_token_logprobs)");
  m.start(batch);
  const cuda::Plan p = m.plan(batch);
  const cuda::bf16* hn = m.hidden(p);
  const int64_t V = m.cfg.vocab_size, D = m.cfg.hidden_size;
  Tensor out({p.T, V});
  const int64_t block = std::max<int64_t>(1, std::min<int64_t>(p.T, (int64_t{1} << 28) / (V * 4)));
  float* lg = m.arena.alloc<float>(block * V);
  for (int64_t r0 = 0; r0 < p.T; r0 += block) {
    const int64_t rows = std::min(block, p.T - r0);
    m.gemm->run(hn + r0 * D, D, m.lm_head, V, D, lg, V, rows);
    NEXTLM_CUDA_CHECK(cudaMemcpyAsync(out.ptr() + r0 * V, lg, rows * V * sizeof(float), cudaMemcpyDeviceToHost, m.stream));
    NEXTLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  }
  m.end_timing();
  m.finish_profile();
  return out;
}

std::vector<std::vector<double>> CudaModel::next_token_logprobs(const PackedBatch& batch) {
  Impl& m = *impl_;
  m.start(batch);
  const cuda::Plan p = m.plan(batch);
  const cuda::bf16* hn = m.hidden(p);
  // This rank's vocabulary rows (all of them unless vocabulary-parallel).
  const int64_t V = m.vocab_rows, D = m.cfg.hidden_size;
  // The lm_head in row blocks of at most 1 GiB of fp32 logits (1733 rows at V = 154880, tall enough for the GEMM
  // to run near its peak), each reduced to log-probabilities at once.
  const int64_t block = std::max<int64_t>(1, std::min<int64_t>(p.T, (int64_t{1} << 28) / V));
  float* lg = m.arena.alloc<float>(block * V);
  double* lp = m.arena.alloc<double>(p.T);
  m.mark_begin("lm_head");
  if (!m.tp_comm) {
    for (int64_t r0 = 0; r0 < p.T; r0 += block) {
      const int64_t rows = std::min(block, p.T - r0);
      m.gemm->run(hn + r0 * D, D, m.lm_head, V, D, lg, V, rows);
      cuda::row_logprob(lg, p.targets + r0, lp + r0, rows, V, m.stream);
    }
  } else {
    // A parallel log-softmax: each rank's max, Σ exp and target logit over its rows, combined over TP; [T, V] is
    // never gathered.
    float *mx = m.arena.alloc<float>(p.T), *gmx = m.arena.alloc<float>(p.T), *sum = m.arena.alloc<float>(2 * p.T);
    float* tl = sum + p.T;  // sum and tl side by side: one all-reduce
    for (int64_t r0 = 0; r0 < p.T; r0 += block) {
      const int64_t rows = std::min(block, p.T - r0);
      m.gemm->run(hn + r0 * D, D, m.lm_head, V, D, lg, V, rows);
      cuda::row_lse_partial(lg, p.targets + r0, m.vocab_begin, rows, V, mx + r0, sum + r0, tl + r0, m.stream);
    }
    NEXTLM_CUDA_CHECK(cudaMemcpyAsync(gmx, mx, p.T * sizeof(float), cudaMemcpyDeviceToDevice, m.stream));
    m.tp_comm->all_reduce_max(gmx, static_cast<size_t>(p.T));
    cuda::lse_rescale(sum, mx, gmx, p.T, m.stream);
    m.all_reduce(m.tp_comm, sum, 2 * p.T);
    cuda::lse_finish(tl, gmx, sum, p.targets, lp, p.T, m.stream);
  }
  m.mark_end("lm_head");
  m.end_timing();
  std::vector<double> all(p.T);
  NEXTLM_CUDA_CHECK(cudaMemcpyAsync(all.data(), lp, p.T * sizeof(double), cudaMemcpyDeviceToHost, m.stream));
  NEXTLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  std::vector<std::vector<double>> out(batch.num_seqs());
  for (int64_t n = 0; n < batch.num_seqs(); ++n)
    for (int64_t t = batch.cu_seqlens[n]; t + 1 < batch.cu_seqlens[n + 1]; ++t) out[n].push_back(all[t]);
  m.finish_profile();
  return out;
}

std::vector<TokenComparison> CudaModel::compare_with_reference(const PackedBatch& batch,
                                                               const std::vector<const float*>& ref_logp) {
  Impl& m = *impl_;
  check(static_cast<int64_t>(ref_logp.size()) == batch.num_seqs(), "compare_with_reference: ", ref_logp.size(),
        " reference sequences for a batch of ", batch.num_seqs());
  check(m.shard.tp == 1, "compare_with_reference: not on a vocabulary-parallel model");
  m.start(batch);
  const cuda::Plan p = m.plan(batch);
  const cuda::bf16* hn = m.hidden(p);
  const int64_t V = m.cfg.vocab_size, D = m.cfg.hidden_size;
  // Row blocks as next_token_logprobs, plus the reference rows of the block uploaded beside them.
  const int64_t block = std::max<int64_t>(1, std::min<int64_t>(p.T, (int64_t{1} << 26) / V));
  float* lg = m.arena.alloc<float>(block * V);
  float* ref = m.arena.alloc<float>(block * V);
  double* kl = m.arena.alloc<double>(p.T);
  double* lp = m.arena.alloc<double>(p.T);
  int32_t* am = m.arena.alloc<int32_t>(p.T);
  int32_t* ram = m.arena.alloc<int32_t>(p.T);
  std::vector<int32_t> seq_of(p.T);
  for (int64_t n = 0; n < batch.num_seqs(); ++n)
    for (int64_t t = batch.cu_seqlens[n]; t < batch.cu_seqlens[n + 1]; ++t) seq_of[t] = static_cast<int32_t>(n);
  for (int64_t r0 = 0; r0 < p.T; r0 += block) {
    const int64_t rows = std::min(block, p.T - r0);
    m.gemm->run(hn + r0 * D, D, m.lm_head, V, D, lg, V, rows);
    // The block's reference rows, a contiguous run per sequence it touches (the copies read host memory that
    // outlives the call, and the stream orders them before the kernel and before the next block overwrites them).
    for (int64_t r = r0; r < r0 + rows;) {
      const int64_t n = seq_of[r], end = std::min<int64_t>(r0 + rows, batch.cu_seqlens[n + 1]);
      const float* src = ref_logp[n] + (r - batch.cu_seqlens[n]) * V;
      NEXTLM_CUDA_CHECK(cudaMemcpyAsync(ref + (r - r0) * V, src, (end - r) * V * sizeof(float),
                                        cudaMemcpyHostToDevice, m.stream));
      r = end;
    }
    cuda::compare_rows(lg, ref, p.targets + r0, rows, V, kl + r0, am + r0, ram + r0, lp + r0, m.stream);
  }
  m.end_timing();
  std::vector<double> kl_h(p.T), lp_h(p.T);
  std::vector<int32_t> am_h(p.T), ram_h(p.T);
  NEXTLM_CUDA_CHECK(cudaMemcpyAsync(kl_h.data(), kl, p.T * sizeof(double), cudaMemcpyDeviceToHost, m.stream));
  NEXTLM_CUDA_CHECK(cudaMemcpyAsync(lp_h.data(), lp, p.T * sizeof(double), cudaMemcpyDeviceToHost, m.stream));
  NEXTLM_CUDA_CHECK(cudaMemcpyAsync(am_h.data(), am, p.T * sizeof(int32_t), cudaMemcpyDeviceToHost, m.stream));
  NEXTLM_CUDA_CHECK(cudaMemcpyAsync(ram_h.data(), ram, p.T * sizeof(int32_t), cudaMemcpyDeviceToHost, m.stream));
  NEXTLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  m.finish_profile();
  std::vector<TokenComparison> out(p.T);
  for (int64_t t = 0; t < p.T; ++t) out[t] = TokenComparison{kl_h[t], am_h[t], ram_h[t], lp_h[t]};
  return out;
}

namespace {
template <class T>
T* to_device(cuda::Arena& arena, const std::vector<T>& v, cudaStream_t st) {
  T* d = arena.alloc<T>(static_cast<int64_t>(v.size()));
  NEXTLM_CUDA_CHECK(cudaMemcpyAsync(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice, st));
  return d;
}
template <class T>
std::vector<T> to_host(const T* d, int64_t n, cudaStream_t st) {
  std::vector<T> v(n);
  NEXTLM_CUDA_CHECK(cudaMemcpyAsync(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost, st));
  NEXTLM_CUDA_CHECK(cudaStreamSynchronize(st));
  return v;
}
}  // namespace

std::vector<float> CudaModel::sublayer(int64_t layer, bool ffn, const std::vector<float>& a,
                                       const PackedBatch& batch) {
  Impl& m = *impl_;
  m.start(batch);
  const cuda::Plan p = m.plan(batch);
  const int64_t T = p.T, D = m.cfg.hidden_size;
  check(static_cast<int64_t>(a.size()) == T * D, "sublayer: input size");
  const cuda::DLayer& L = m.layers.at(layer);
  float* a32 = to_device(m.arena, a, m.stream);
  cuda::bf16* a16 = m.arena.alloc<cuda::bf16>(T * D);
  cuda::to_bf16(a32, a16, T * D, m.stream);
  float* y = m.arena.alloc<float>(T * D);
  if (ffn) {
    if (L.moe_layer) {
      m.moe(L.moe, a16, T, y);
    } else {
      m.mlp(L.mlp, a16, T, y);
      m.all_reduce(m.tp_comm, y, T * D);
    }
  } else if (L.kda_layer) {
    m.kda(L.kda, p, a16, y);
    m.all_reduce(m.tp_comm, y, T * D);
  } else {
    check(L.dsa.has_indexer, "sublayer: a shared-indexer DSA layer needs the previous layer's selection");
    const int64_t max_sel = m.cfg.index_topk + m.cfg.index_kpool - 1;
    int32_t* sel = m.arena.alloc<int32_t>(T * max_sel);
    int32_t* count = m.arena.alloc<int32_t>(T);
    m.dsa(L.dsa, p, a16, sel, count, max_sel, y);
    m.all_reduce(m.tp_comm, y, T * D);
  }
  return to_host(y, T * D, m.stream);
}

void CudaModel::mhc_pre(int64_t layer, bool ffn, const std::vector<float>& h, std::vector<float>& post,
                        std::vector<float>& comb, std::vector<float>& a) {
  Impl& m = *impl_;
  m.arena.reset();
  const int64_t S = m.cfg.hc_mult, D = m.cfg.hidden_size, T = static_cast<int64_t>(h.size()) / (S * D);
  const cuda::DLayer& L = m.layers.at(layer);
  float* hd = to_device(m.arena, h, m.stream);
  float* pd = m.arena.alloc<float>(T * S);
  float* cd = m.arena.alloc<float>(T * S * S);
  cuda::bf16* ad = m.arena.alloc<cuda::bf16>(T * D);
  float* wd = m.arena.alloc<float>(cuda::mhc_pre_workspace_floats(T, S, D));
  cuda::mhc_pre(m.mhc_params(L, ffn, T), hd, pd, cd, ad, wd, m.stream);
  post = to_host(pd, T * S, m.stream);
  comb = to_host(cd, T * S * S, m.stream);
  std::vector<cuda::bf16> a16 = to_host(ad, T * D, m.stream);
  a.resize(T * D);
  for (int64_t i = 0; i < T * D; ++i) a[i] = __bfloat162float(a16[i]);
}

// In place, an expert at a time through a scratch copy of its weights (each expert's layout fills its own range).
void CudaModel::set_expert_layout(int layout) {
  Impl& m = *impl_;
  check(layout >= 0 && layout <= 2, "set_expert_layout: layout ", layout, " is not 0 (rows), 1 (column blocks) or 2 "
        "(tiles)");
  const auto to = static_cast<cuda::GroupedWeightLayout>(layout);
  const int64_t D = m.cfg.hidden_size, I = m.cfg.moe_intermediate_size;
  cuda::bf16* scratch = nullptr;
  for (cuda::DLayer& L : m.layers) {
    if (!L.moe_layer || L.moe.layout == to) continue;
    if (!scratch) NEXTLM_CUDA_CHECK(cudaMalloc(&scratch, 2 * I * D * sizeof(cuda::bf16)));
    for (int64_t e = 0; e < static_cast<int64_t>(L.moe.experts.size()); ++e) {
      for (const auto& [w, rows, cols] : {std::tuple{L.moe.gate_up_all + e * 2 * I * D, 2 * I, D},
                                          std::tuple{L.moe.down_all + e * D * I, D, I}}) {
        NEXTLM_CUDA_CHECK(cudaMemcpyAsync(scratch, w, rows * cols * sizeof(cuda::bf16), cudaMemcpyDeviceToDevice,
                                          m.stream));
        // Back to rows from the old layout, then (through the scratch again) into the new one.
        if (L.moe.layout != cuda::GroupedWeightLayout::kRows) {
          cuda::block_expert_weights(scratch, w, 1, rows, cols, L.moe.layout, m.stream, false);
          if (to == cuda::GroupedWeightLayout::kRows) continue;
          NEXTLM_CUDA_CHECK(cudaMemcpyAsync(scratch, w, rows * cols * sizeof(cuda::bf16),
                                            cudaMemcpyDeviceToDevice, m.stream));
        }
        cuda::block_expert_weights(scratch, w, 1, rows, cols, to, m.stream);
      }
    }
    L.moe.layout = to;
  }
  if (scratch) {
    NEXTLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
    NEXTLM_CUDA_CHECK(cudaFree(scratch));
  }
}

void CudaModel::set_empty_selection(EmptySelection e) { impl_->empty_seen = e == EmptySelection::SeenKeys; }
void CudaModel::set_kda_tensor_cores(bool on) { impl_->kda_tensor_cores = on; }
void CudaModel::set_kda_backward_bf16(bool on) { impl_->kda_backward_bf16 = on; }
bool CudaModel::kda_backward_bf16() const { return impl_->kda_backward_bf16; }
void CudaModel::set_kda_keep_states(bool on) { impl_->kda_keep_states = on; }
bool CudaModel::kda_keep_states() const { return impl_->kda_keep_states; }
bool CudaModel::kda_on_tensor_cores() const { return impl_->kda_tc_path(); }
void CudaModel::set_mla_absorbed(bool on) { impl_->mla_absorbed = on; }
void CudaModel::set_decode_overlap(bool on) { impl_->decode_overlap = on; }
void CudaModel::set_train_overlap(bool on) { impl_->train_overlap = on; }
bool CudaModel::train_overlap() const { return impl_->train_overlap; }
void CudaModel::set_lora_update_beside(bool on) { impl_->lora_update_beside = on; }
bool CudaModel::lora_update_beside() const { return impl_->lora_update_beside; }
void CudaModel::set_batch_invariant(bool on) { impl_->gemm->set_batch_invariant(on); }

// ---- CudaDecoder ----

struct CudaDecoder::State {
  CudaModel::Impl* m;
  int64_t slots, max_len, max_pools;
  bool tc = false;  // the KDA caches are the tensor-core path's (boundary states and partial chunks)
  // Decoding steps replayed from CUDA graphs, one per (rows, batch-invariant mode, MoE expert kernel): the first
  // step of a kind runs plainly (it sizes the arena), the second is captured, the rest replay it.
  bool graphs = true;
  struct StepGraph {
    cudaGraphExec_t exec = nullptr;
    const float* logits = nullptr;
  };
  std::map<std::tuple<int64_t, bool, int>, StepGraph> step_graphs;
  std::vector<int64_t> length;           // [slots]
  std::vector<cuda::LayerCache> caches;  // [layers]
  std::vector<std::pair<void*, size_t>> buffers;  // every cache allocation, [slot-major] with its bytes per slot
  cudaEvent_t begin = nullptr, end = nullptr;
  double ms = 0.0;

  template <class T>
  T* alloc(int64_t per_slot) {
    const size_t bytes = static_cast<size_t>(per_slot) * sizeof(T);
    void* p = nullptr;
    NEXTLM_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes * slots, 1)));
    NEXTLM_CUDA_CHECK(cudaMemset(p, 0, bytes * slots));
    buffers.emplace_back(p, bytes);
    return static_cast<T*>(p);
  }
  ~State() {
    for (auto& g : step_graphs)
      if (g.second.exec) cudaGraphExecDestroy(g.second.exec);
    for (auto& b : buffers) cudaFree(b.first);
    if (begin) cudaEventDestroy(begin);
    if (end) cudaEventDestroy(end);
  }
  void check_slot(int64_t s) const {
    check(s >= 0 && s < slots, "decoder slot ", s, " is outside [0, ", slots, ")");
  }
  void check_kernels() const {
    check(m->kda_tc_path() == tc, "CudaDecoder: the model's KDA kernels (set_kda_tensor_cores) changed after the "
          "decoder was made");
  }
};

CudaDecoder::CudaDecoder(CudaModel& model, int64_t max_seqs, int64_t max_len) : st_(std::make_unique<State>()) {
  State& s = *st_;
  s.m = model.impl_.get();
  check(!s.m->sharded(), "CudaDecoder: decoding runs on one GPU (a tensor- or expert-parallel model cannot decode)");
  const ModelConfig& c = s.m->cfg;
  check(max_seqs >= 1 && max_len >= 1, "CudaDecoder needs at least one slot of at least one token, got ", max_seqs,
        " × ", max_len);
  s.slots = max_seqs, s.max_len = max_len, s.max_pools = std::max<int64_t>(max_len / c.index_kpool, 1);
  s.tc = s.m->kda_tc_path();
  s.length.assign(max_seqs, 0);
  NEXTLM_CUDA_CHECK(cudaSetDevice(s.m->device));
  const int64_t H = c.linear_num_heads, K = c.linear_head_dim, W1 = c.linear_conv_kernel_dim - 1;
  s.caches.resize(s.m->layers.size());
  for (size_t i = 0; i < s.m->layers.size(); ++i) {
    cuda::LayerCache& lc = s.caches[i];
    const cuda::DLayer& L = s.m->layers[i];
    if (L.kda_layer) {
      lc.conv_hist = s.alloc<float>(3 * W1 * H * K);
      lc.state = s.alloc<float>(H * K * K);
      if (s.tc) {
        lc.chunk_q = s.alloc<cuda::bf16>(64 * H * K);
        lc.chunk_k = s.alloc<cuda::bf16>(64 * H * K);
        lc.chunk_v = s.alloc<cuda::bf16>(64 * H * K);
        lc.chunk_g = s.alloc<float>(64 * H * K);
        lc.chunk_beta = s.alloc<float>(64 * H);
        lc.chunk_rows = cuda::KdaTcRowCache{s.alloc<float>(H * 64 * 64), s.alloc<float>(H * 64 * cuda::kKdaTcXsCols),
                                            s.alloc<cuda::bf16>(H * 64 * K), s.alloc<cuda::bf16>(H * K * K)};
      }
    } else {
      lc.latent = s.alloc<cuda::bf16>(max_len * c.kv_lora_rank);
      if (L.dsa.has_indexer) {
        lc.pending_key = s.alloc<float>(c.index_kpool * c.index_head_dim);
        lc.pending_gate = s.alloc<float>(c.index_kpool * c.index_head_dim);
        lc.pool_key = s.alloc<float>(s.max_pools * c.index_head_dim);
      }
    }
  }
  NEXTLM_CUDA_CHECK(cudaEventCreate(&s.begin));
  NEXTLM_CUDA_CHECK(cudaEventCreate(&s.end));
  NEXTLM_CUDA_CHECK(cudaDeviceSynchronize());  // the zeroing ran outside the (non-blocking) model stream
}

CudaDecoder::~CudaDecoder() = default;

int64_t CudaDecoder::max_seqs() const { return st_->slots; }
int64_t CudaDecoder::max_len() const { return st_->max_len; }
int64_t CudaDecoder::length(int64_t slot) const {
  st_->check_slot(slot);
  return st_->length[slot];
}
double CudaDecoder::last_ms() const { return st_->ms; }
void CudaDecoder::set_graphs(bool on) { st_->graphs = on; }

void CudaDecoder::clear(int64_t slot) {
  State& s = *st_;
  s.check_slot(slot);
  for (auto& b : s.buffers)
    NEXTLM_CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(b.first) + b.second * slot, 0, b.second, s.m->stream));
  NEXTLM_CUDA_CHECK(cudaStreamSynchronize(s.m->stream));
  s.length[slot] = 0;
}

namespace {

void check_distinct(const std::vector<int64_t>& slots, const char* what) {
  std::vector<int64_t> v = slots;
  std::sort(v.begin(), v.end());
  check(std::adjacent_find(v.begin(), v.end()) == v.end(), what, ": a slot appears twice");
}

// Host rows of fp32 logits [n, V] from the device.
std::vector<std::vector<float>> logits_to_host(const float* d, int64_t n, int64_t V, cudaStream_t st) {
  std::vector<float> all(n * V);
  NEXTLM_CUDA_CHECK(cudaMemcpyAsync(all.data(), d, all.size() * sizeof(float), cudaMemcpyDeviceToHost, st));
  NEXTLM_CUDA_CHECK(cudaStreamSynchronize(st));
  std::vector<std::vector<float>> out(n);
  for (int64_t i = 0; i < n; ++i) out[i].assign(all.begin() + i * V, all.begin() + (i + 1) * V);
  return out;
}

}  // namespace

std::vector<std::vector<float>> CudaDecoder::prefill(const std::vector<int64_t>& slots,
                                                     const std::vector<std::vector<int32_t>>& prompts) {
  State& s = *st_;
  CudaModel::Impl& m = *s.m;
  const ModelConfig& c = m.cfg;
  check(slots.size() == prompts.size() && !slots.empty(), "prefill: ", slots.size(), " slots for ", prompts.size(),
        " prompts");
  check_distinct(slots, "prefill");
  s.check_kernels();
  PackedBatch b;
  for (size_t n = 0; n < slots.size(); ++n) {
    s.check_slot(slots[n]);
    check(s.length[slots[n]] == 0, "prefill: slot ", slots[n], " already holds ", s.length[slots[n]], " tokens");
    check(!prompts[n].empty(), "prefill: prompt ", n, " is empty");
    check(static_cast<int64_t>(prompts[n].size()) <= s.max_len, "prefill: prompt ", n, " has ", prompts[n].size(),
          " tokens, more than the decoder's ", s.max_len);
    b.add(prompts[n]);
  }
  const int64_t N = b.num_seqs(), T = b.num_tokens(), D = c.hidden_size, V = c.vocab_size, P = c.index_kpool;
  m.start(b);
  NEXTLM_CUDA_CHECK(cudaEventRecord(s.begin, m.stream));
  const cuda::Plan p = m.plan(b);
  std::vector<int32_t> start(N), len(N), slot(N), pool_base(N), tok_slot(T), tok_pos(T);
  int32_t pools = 0;
  for (int64_t n = 0; n < N; ++n) {
    start[n] = static_cast<int32_t>(b.cu_seqlens[n]);
    len[n] = static_cast<int32_t>(b.cu_seqlens[n + 1] - b.cu_seqlens[n]);
    slot[n] = static_cast<int32_t>(slots[n]);
    pool_base[n] = pools;
    pools += static_cast<int32_t>(len[n] / P);
    for (int64_t t = b.cu_seqlens[n]; t < b.cu_seqlens[n + 1]; ++t) {
      tok_slot[t] = slot[n];
      tok_pos[t] = static_cast<int32_t>(t - b.cu_seqlens[n]);
    }
  }
  auto up = [&](const std::vector<int32_t>& v) {
    int32_t* d = m.arena.alloc<int32_t>(static_cast<int64_t>(v.size()));
    NEXTLM_CUDA_CHECK(cudaMemcpyAsync(d, v.data(), v.size() * sizeof(int32_t), cudaMemcpyHostToDevice, m.stream));
    return d;
  };
  const int32_t* d_slot = up(slot);
  cuda::Capture cap{s.caches.data(), cuda::PrefillSeqs{up(start), up(len), d_slot, N}, up(pool_base),
                    up(tok_slot), up(tok_pos), s.max_len, s.max_pools};
  if (s.tc) {
    // Each prompt's partial chunk (if any) as the chunk buffers hold it.
    const cuda::KdaTailLists t(len, slot);
    if (t.size()) {
      cap.kda_tails = cuda::KdaChunks{up(t.start), up(t.len), up(t.first), up(t.count), t.size(), t.size()};
      cap.kda_tail_slot = up(t.slot);
    }
  }
  // The forward fills the caches; empty selections see the keys so far, as decoding steps do.
  m.capture = &cap;
  const bool seen = m.empty_seen;
  m.empty_seen = true;
  const cuda::bf16* hn = nullptr;
  try {
    hn = m.hidden(p);
  } catch (...) {
    m.capture = nullptr, m.empty_seen = seen;
    throw;
  }
  m.capture = nullptr, m.empty_seen = seen;
  // The last token of each prompt through the lm_head.
  cuda::bf16* last = m.arena.alloc<cuda::bf16>(N * D);
  for (int64_t n = 0; n < N; ++n)
    NEXTLM_CUDA_CHECK(cudaMemcpyAsync(last + n * D, hn + (b.cu_seqlens[n + 1] - 1) * D, D * sizeof(cuda::bf16),
                                      cudaMemcpyDeviceToDevice, m.stream));
  float* logits = m.arena.alloc<float>(N * V);
  m.lin(last, D, m.lm_head, V, D, logits, V, N);
  NEXTLM_CUDA_CHECK(cudaEventRecord(s.end, m.stream));
  std::vector<std::vector<float>> out = logits_to_host(logits, N, V, m.stream);
  float ms = 0.0f;
  NEXTLM_CUDA_CHECK(cudaEventElapsedTime(&ms, s.begin, s.end));
  s.ms = ms;
  for (int64_t n = 0; n < N; ++n) s.length[slots[n]] = len[n];
  return out;
}

std::vector<std::vector<float>> CudaDecoder::step(const std::vector<int64_t>& slots,
                                                  const std::vector<int32_t>& tokens) {
  const float* logits = run_step(slots, tokens);
  return logits_to_host(logits, static_cast<int64_t>(slots.size()), st_->m->cfg.vocab_size, st_->m->stream);
}

void CudaDecoder::step_no_copy(const std::vector<int64_t>& slots, const std::vector<int32_t>& tokens) {
  run_step(slots, tokens);
  NEXTLM_CUDA_CHECK(cudaStreamSynchronize(st_->m->stream));
}

const float* CudaDecoder::run_step(const std::vector<int64_t>& slots, const std::vector<int32_t>& tokens) {
  State& s = *st_;
  CudaModel::Impl& m = *s.m;
  const ModelConfig& c = m.cfg;
  check(slots.size() == tokens.size() && !slots.empty(), "step: ", slots.size(), " slots for ", tokens.size(),
        " tokens");
  check_distinct(slots, "step");
  s.check_kernels();
  const int64_t B = static_cast<int64_t>(slots.size());
  std::vector<int32_t> slot(B), pos(B);
  int64_t max_selectable = 0;
  for (int64_t i = 0; i < B; ++i) {
    s.check_slot(slots[i]);
    check(tokens[i] >= 0 && tokens[i] < c.vocab_size, "step: token id ", tokens[i], " is outside the vocabulary [0, ",
          c.vocab_size, ")");
    check(s.length[slots[i]] < s.max_len, "step: slot ", slots[i], " is full (", s.max_len, " tokens)");
    slot[i] = static_cast<int32_t>(slots[i]);
    pos[i] = static_cast<int32_t>(s.length[slots[i]]);
    max_selectable = std::max<int64_t>(max_selectable, (pos[i] + 1) / c.index_kpool);
  }
  m.arena.reset();
  m.accum.clear();
  NEXTLM_CUDA_CHECK(cudaEventRecord(s.begin, m.stream));
  auto up = [&](const std::vector<int32_t>& v) {
    int32_t* d = m.arena.alloc<int32_t>(static_cast<int64_t>(v.size()));
    NEXTLM_CUDA_CHECK(cudaMemcpyAsync(d, v.data(), v.size() * sizeof(int32_t), cudaMemcpyHostToDevice, m.stream));
    return d;
  };
  const int32_t* d_tok = up(tokens);
  // A graph keeps its kernels' launch shapes: the indexer's scoring grid then covers the slots' capacity (blocks
  // past a row's pools return at once) instead of this step's largest row.
  const bool graph = s.graphs && !m.profiling;
  const int64_t selectable = graph ? s.max_pools : max_selectable;
  const CudaModel::Impl::StepRows rows{B, up(slot), up(pos), s.max_len, s.max_pools, selectable};
  // Every allocation above and in decode_step comes from the arena in the same order for the same kind of step, so
  // a captured graph finds its buffers, and this step's uploads, where it left them.
  const float* logits = nullptr;
  if (!graph) {
    logits = m.decode_step(s.caches, d_tok, rows);
  } else {
    const auto key = std::make_tuple(B, m.gemm->batch_invariant(), g_moe_expert_gemm);
    auto it = s.step_graphs.find(key);
    if (it == s.step_graphs.end()) {
      logits = m.decode_step(s.caches, d_tok, rows);
      s.step_graphs.emplace(key, State::StepGraph{});
    } else if (it->second.exec) {
      NEXTLM_CUDA_CHECK(cudaGraphLaunch(it->second.exec, m.stream));
      logits = it->second.logits;
    } else {
      cudaGraph_t g = nullptr;
      NEXTLM_CUDA_CHECK(cudaStreamBeginCapture(m.stream, cudaStreamCaptureModeRelaxed));
      try {
        logits = m.decode_step(s.caches, d_tok, rows);
      } catch (...) {
        cudaStreamEndCapture(m.stream, &g);
        if (g) cudaGraphDestroy(g);
        throw;
      }
      NEXTLM_CUDA_CHECK(cudaStreamEndCapture(m.stream, &g));
      const cudaError_t e = cudaGraphInstantiate(&it->second.exec, g, 0);
      cudaGraphDestroy(g);
      NEXTLM_CUDA_CHECK(e);
      it->second.logits = logits;
      NEXTLM_CUDA_CHECK(cudaGraphLaunch(it->second.exec, m.stream));
    }
  }
  NEXTLM_CUDA_CHECK(cudaEventRecord(s.end, m.stream));
  // The uploads read host vectors that die here.
  NEXTLM_CUDA_CHECK(cudaEventSynchronize(s.end));
  float ms = 0.0f;
  NEXTLM_CUDA_CHECK(cudaEventElapsedTime(&ms, s.begin, s.end));
  s.ms = ms;
  m.prof.assign(m.accum.begin(), m.accum.end());
  for (int64_t i = 0; i < B; ++i) ++s.length[slots[i]];
  return logits;
}

Generation cuda_generate(CudaModel& model, const std::vector<int32_t>& prompt, const GenerateOptions& opt) {
  std::optional<CudaDecoder> dec;
  return generate_with(
      model.config().vocab_size, prompt, opt,
      [&](const std::vector<int32_t>& p) {
        dec.emplace(model, 1, static_cast<int64_t>(p.size()) + opt.max_new_tokens);
        return dec->prefill({0}, {p})[0];
      },
      [&](int32_t token) { return dec->step({0}, {token})[0]; });
}

}  // namespace nextlm
