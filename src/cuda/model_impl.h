// The device model's internals, shared by the forward (device_model.cu) and the training backward (train.cu):
// the arena, the weight layout on the device, the plan of a packed batch, and CudaModel::Impl with its forward.
// Internal to src/cuda; host code sees device_model.h only.
#pragma once
#include <algorithm>
#include <array>
#include <cmath>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "core/env.h"
#include "cuda/backward_kernels.h"
#include "cuda/decode_kernels.h"
#include "cuda/decode_linear.h"
#include "cuda/device_model.h"
#include "cuda/gemm.h"
#include "cuda/grouped_gemm.h"
#include "cuda/grouped_lora.h"
#include "cuda/kernels.h"
#include "cuda/optim.h"
#include "cuda/random_init.h"
#include "dist/comm.h"
#include "model/init.h"
#include "model/lora.h"

namespace nextlm {

// Counts one stacked group of LoRA adapters (lora_stacked_groups in device_model.h); the training step calls it.
void note_lora_stacked_group();
void note_lora_joined_projection();
void note_lora_joined_input_gradient();  // counts in lora_joined_projections() too
void note_narrow_joined_gradient();
void note_mhc_fused_post();  // mhc_fused_posts in device_model.h

namespace cuda {

// A bump allocator over device chunks. reset() rewinds; a forward of the same or a smaller shape reuses the chunks
// of the first one, so cudaMalloc runs only when a larger batch arrives.
class Arena {
 public:
  ~Arena() {
    for (auto& c : chunks_) cudaFree(c.first);
  }
  void reset() { chunk_ = 0, offset_ = 0, used_ = 0; }
  // Frees every chunk (the device must be done with them): after an out-of-memory, the step run again starts empty.
  void release() {
    for (auto& c : chunks_) cudaFree(c.first);
    chunks_.clear();
    reset();
  }
  // A position to come back to: what was allocated after mark() is given back by rewind(mark) (the training
  // backward frees one site's activations this way).
  struct Mark {
    size_t chunk, offset, used;
  };
  Mark mark() const { return {chunk_, offset_, used_}; }
  void rewind(Mark m) { chunk_ = m.chunk, offset_ = m.offset, used_ = m.used; }
  // A cap on the bytes allocated at once (0: none, the device's memory alone), as if the device had no more: the
  // tests of the adaptive recompute policy run out of it. peak(): the most allocated at once since reset_peak().
  void set_limit(size_t bytes) { limit_ = bytes; }
  size_t peak() const { return peak_; }
  void reset_peak() { peak_ = 0; }
  template <class T>
  T* alloc(int64_t n) {
    const size_t bytes = (static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T) + 255) & ~size_t{255};
    if (limit_ && used_ + bytes > limit_)
      throw OutOfMemory("out of device memory: the activations' limit of " + std::to_string(limit_ >> 20) +
                        " MiB reached (" + std::to_string((used_ + bytes) >> 20) + " MiB wanted)");
    used_ += bytes;
    peak_ = std::max(peak_, used_);
    while (chunk_ < chunks_.size() && offset_ + bytes > chunks_[chunk_].second) ++chunk_, offset_ = 0;
    if (chunk_ == chunks_.size()) {
      const size_t size = std::max(bytes, size_t{256} << 20);
      void* p = nullptr;
      const cudaError_t err = cudaMalloc(&p, size);
      if (err == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();  // not a sticky error: cleared, the device stays usable
        size_t held = 0;
        for (const auto& c : chunks_) held += c.second;
        used_ -= bytes;
        throw OutOfMemory("out of device memory: " + std::to_string(size >> 20) + " MiB more of activations wanted, " +
                          std::to_string(held >> 20) + " MiB held already; fewer tokens at once need less, and so " +
                          "does training with --recompute all");
      }
      NEXTLM_CUDA_CHECK(err);
      chunks_.emplace_back(static_cast<char*>(p), size);
      offset_ = 0;
    }
    T* p = reinterpret_cast<T*>(chunks_[chunk_].first + offset_);
    offset_ += bytes;
    return p;
  }

 private:
  std::vector<std::pair<char*, size_t>> chunks_;
  size_t chunk_ = 0, offset_ = 0, used_ = 0, peak_ = 0, limit_ = 0;
};

// Device memory of the weights (one allocation per tensor), freed with the model.
class Store {
 public:
  ~Store() {
    for (void* p : ptrs_) cudaFree(p);
  }
  template <class T>
  T* alloc(int64_t n) {
    T* p = nullptr;
    NEXTLM_CUDA_CHECK(cudaMalloc(&p, static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T)));
    ptrs_.push_back(p);
    return p;
  }

 private:
  std::vector<void*> ptrs_;
};

struct DLinear {
  bf16* w = nullptr;
  int64_t out = 0, in = 0;
};

struct DHc {
  float *fn, *base, *scale;
};
struct DKda {
  DLinear qkv, f_a, f_b, b, g_a, g_b, o;
  float *conv, *dt_bias, *A_log, *o_norm;
};
struct DIndexer {
  DLinear wq_b, wk, weights, gate;
  float *k_norm_w, *k_norm_b, *ape;
};
struct DDsa {
  DLinear q_a, q_b, kv_a, kv_b, o;
  float *q_a_norm, *kv_a_norm;
  bool has_indexer = false;
  DIndexer idx;
};
struct DMlp {
  DLinear gate_up, down;
  int64_t I = 0;
};
struct DMoe {
  DLinear router;
  float* bias;
  std::vector<DMlp> experts;
  const bf16** gate_up_ptrs = nullptr;  // [E] device arrays of the experts' weight pointers (grouped GEMM)
  const bf16** down_ptrs = nullptr;
  bf16 *gate_up_all = nullptr, *down_all = nullptr;  // the same weights as one tensor each, [E, 2I, D] and [E, D, I]
  // How those two lie in memory (CudaModel::set_expert_layout): the TMA grouped GEMM reads any layout.
  GroupedWeightLayout layout = GroupedWeightLayout::kRows;
  bool has_shared = false;
  DMlp shared;
  // The per-expert (cuBLASLt) GEMMs read the experts' weights row-major only.
  void require_rows() const {
    check(layout == GroupedWeightLayout::kRows,
          "the per-expert GEMMs (set_moe_expert_gemm(-1)) need the experts' weights row-major, not in blocks "
          "(set_expert_layout)");
  }
};
struct DLayer {
  DHc hc_attn, hc_ffn;
  float *in_norm, *post_norm;
  bool kda_layer = false, moe_layer = false;
  DKda kda;
  DDsa dsa;
  DMlp mlp;
  DMoe moe;
};

inline int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Where the weights come from. The model asks for every tensor by its checkpoint name (text-model prefix included,
// `lm_head.weight` at the top) with the shape it expects and the distribution a random init would draw it from; a
// source writes it into device memory as bf16 or fp32.
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // "model.language_model." or "model." (text-only checkpoints).
  virtual std::string prefix() const = 0;
  virtual bool has(const std::string& name) const = 0;
  // Whether the weights are drawn at random (the embedding's padding row is then zeroed, as padding_idx does).
  virtual bool random() const { return false; }
  virtual void bf16_into(const std::string& name, const std::vector<int64_t>& shape, const DistSpec& init,
                         bf16* dst) = 0;
  virtual void f32_into(const std::string& name, const std::vector<int64_t>& shape, const DistSpec& init,
                        float* dst) = 0;
  // A part of the tensor `name` of full shape `shape`, for a sharded model: its first dimension's rows [begin,
  // begin + count) (axis 0), or its last dimension's columns [begin, begin + count) (axis 1), written densely.
  struct Slice {
    int axis = -1;  // −1: the whole tensor
    int64_t begin = 0, count = 0;
  };
  // By default the whole tensor goes to a device temporary and the slice is cut from it; a checkpoint reads only
  // the slice's bytes.
  virtual void bf16_slice_into(const std::string& name, const std::vector<int64_t>& shape, const DistSpec& init,
                               const Slice& s, bf16* dst) {
    if (s.axis < 0) return bf16_into(name, shape, init, dst);
    slice_via_device(shape, s, dst, [&](bf16* full) { bf16_into(name, shape, init, full); });
  }
  virtual void f32_slice_into(const std::string& name, const std::vector<int64_t>& shape, const DistSpec& init,
                              const Slice& s, float* dst) {
    if (s.axis < 0) return f32_into(name, shape, init, dst);
    slice_via_device(shape, s, dst, [&](float* full) { f32_into(name, shape, init, full); });
  }

 protected:
  // The slice's rows and row length in elements, with the offset and pitch of the source rows (the slice's rows
  // are contiguous in the destination).
  struct Cut {
    int64_t rows, width, src_offset, src_pitch;
  };
  static Cut cut_of(const std::vector<int64_t>& shape, const Slice& s) {
    const int64_t n = numel_of(shape), first = shape.at(0), last = shape.back();
    check(s.begin >= 0 && s.count >= 0 && s.begin + s.count <= (s.axis == 0 ? first : last), "slice [", s.begin,
          ", ", s.begin + s.count, ") out of range");
    if (s.axis == 0) return Cut{1, s.count * (n / first), s.begin * (n / first), 0};
    return Cut{n / last, s.count, s.begin, last};
  }
  // Copies the slice of a full tensor at `full` (host or device memory, as `kind` says) to dst on the device.
  static void copy_slice(const void* full, const std::vector<int64_t>& shape, const Slice& s, void* dst, size_t elem,
                         cudaMemcpyKind kind) {
    const Cut c = cut_of(shape, s);
    const char* src = static_cast<const char*>(full) + c.src_offset * elem;
    if (c.rows == 1) {
      NEXTLM_CUDA_CHECK(cudaMemcpy(dst, src, c.width * elem, kind));
    } else if (c.width) {
      NEXTLM_CUDA_CHECK(cudaMemcpy2D(dst, c.width * elem, src, c.src_pitch * elem, c.width * elem, c.rows, kind));
    }
  }

 private:
  // fill(full) writes the whole tensor into a device temporary (perhaps on another stream), which is then cut.
  template <class T, class Fill>
  static void slice_via_device(const std::vector<int64_t>& shape, const Slice& s, T* dst, const Fill& fill) {
    T* full = nullptr;
    NEXTLM_CUDA_CHECK(cudaMalloc(&full, numel_of(shape) * sizeof(T)));
    fill(full);
    NEXTLM_CUDA_CHECK(cudaDeviceSynchronize());
    copy_slice(full, shape, s, dst, sizeof(T), cudaMemcpyDeviceToDevice);
    NEXTLM_CUDA_CHECK(cudaFree(full));
  }
};

// [begin, begin + count) of part p when n items are split into `parts` nearly equal contiguous ranges (the first
// n % parts ranges get one more), as dist::split_range.
inline WeightSource::Slice part_of(int64_t n, int64_t parts, int64_t p, int axis) {
  const int64_t q = n / parts, r = n % parts;
  return WeightSource::Slice{axis, p * q + std::min(p, r), q + (p < r ? 1 : 0)};
}


// The plan of a packed batch, shared by every layer.
struct Plan {
  int64_t T = 0, num_seqs = 0, max_len = 0, max_pools = 0, num_pools = 0;
  int32_t *tokens, *targets, *seq_start, *seq_len, *pool_base, *pool_token;
  int32_t* seen_len;  // per token: its position in its sequence + 1 (the keys an empty selection sees if SeenKeys)
  int32_t* pos;       // per token: its position in its sequence
  int32_t* cu;        // [num_seqs + 1] sequence offsets
  std::vector<int64_t> lens;  // on the host: each sequence's length
  KdaChunks chunks{};
};

// One layer's decoding caches for every slot of a CudaDecoder (device memory the decoder owns).
struct LayerCache {
  float* conv_hist = nullptr;     // KDA: [slots, 3, W−1, HK] pre-conv projections of the last W−1 tokens
  float* state = nullptr;         // KDA: [slots, H, K, K] fp32 state: after the last token (fp32 kernels), or after
                                  // the last complete chunk (tensor-core kernels, which recompute the partial one)
  bf16 *chunk_q = nullptr, *chunk_k = nullptr, *chunk_v = nullptr;  // tensor-core KDA: [slots, 64, HK] the partial
  float *chunk_g = nullptr, *chunk_beta = nullptr;                  // chunk's inputs ([slots, 64, H] for β)
  KdaTcRowCache chunk_rows;       // tensor-core KDA: what the partial chunk's later rows reuse (kda_tc_step)
  bf16* latent = nullptr;         // DSA: [slots, max_len, KL] normed kv latents (bf16, as the forward feeds kv_b)
  float* pending_key = nullptr;   // full indexer: [slots, P, ID] keys of the incomplete pool
  float* pending_gate = nullptr;  // full indexer: [slots, P, ID] their gate scores
  float* pool_key = nullptr;      // full indexer: [slots, max_pools, ID] compressed keys of complete pools
};

// While a prefill runs, what its forward fills besides its own work, and where.
struct Capture {
  const LayerCache* layers;  // [num layers]
  PrefillSeqs seqs;          // the prompts (packed order) and their slots
  const int32_t* pool_base;  // [N] each prompt's pool 0 among the forward's pool keys
  const int32_t* tok_slot;   // [T] slot of every packed token
  const int32_t* tok_pos;    // [T] its position in its sequence
  int64_t max_len, max_pools;
  // Tensor-core KDA: the prompts' partial chunks in the chunk buffers (start 64·slot), and their slots.
  KdaChunks kda_tails{};
  const int32_t* kda_tail_slot = nullptr;
};

// The fp32 gradients of the trainable weights on the device (src/cuda/train.cu), laid out as the weights (merged
// q | k | v, gate | up and conv rows included); one allocation, so zeroing them is one memset. The indexer and
// the correction bias are frozen and have none.
struct GHc {
  float *fn = nullptr, *base = nullptr, *scale = nullptr;
};
struct GKda {
  float *qkv = nullptr, *f_a = nullptr, *f_b = nullptr, *b = nullptr, *g_a = nullptr, *g_b = nullptr, *o = nullptr;
  float *conv = nullptr, *dt_bias = nullptr, *A_log = nullptr, *o_norm = nullptr;
};
struct GDsa {
  float *q_a = nullptr, *q_b = nullptr, *kv_a = nullptr, *kv_b = nullptr, *o = nullptr;
  float *q_a_norm = nullptr, *kv_a_norm = nullptr;
};
struct GMlp {
  float *gate_up = nullptr, *down = nullptr;
};
struct GMoe {
  float* router = nullptr;
  std::vector<GMlp> experts;
  GMlp shared;
};
struct GLayer {
  GHc hc_attn, hc_ffn;
  float *in_norm = nullptr, *post_norm = nullptr;
  GKda kda;
  GDsa dsa;
  GMlp mlp;
  GMoe moe;
};
// A LoRA adapter on one device projection (CudaModel::set_lora): y[:, col0 : col0 + out] += s·(x·Aᵀ)·Bᵀ, where
// col0 places it on its rows of a merged weight (q | k | v, gate | up). bf16 copies of the host's A and B; fp32
// gradients.
struct DAdapter {
  int64_t out = 0, in = 0, r = 0, col0 = 0;
  float scale = 1.0f;
  bf16 *A = nullptr, *B = nullptr;     // [r, in], [out, r]
  float *dA = nullptr, *dB = nullptr;  // same shapes
};
// The adapters of one layer by LoraKind: one, or for the routed experts one per expert (or one for all).
struct LayerLora {
  std::array<std::vector<DAdapter>, kNumLoraKinds> kinds;
  bool shared_experts = false;  // the experts' kinds hold one adapter for every expert
  // Per-expert kinds whose adapters run grouped (cuda/grouped_lora.h): device arrays of the experts' A, B, dA, dB
  // (null A: one expert at a time).
  struct Grouped {
    const bf16* const* A = nullptr;
    const bf16* const* B = nullptr;
    float* const* dA = nullptr;
    float* const* dB = nullptr;
  };
  std::array<Grouped, kNumLoraKinds> grouped;
  // Whether the adapters of `kinds` run grouped: per expert, and every kind of them that has adapters grouped (the
  // training step's choice, and so which gradients its backward overwrites: LoraState::overwritten).
  bool runs_grouped(std::initializer_list<LoraKind> ks) const {
    if (shared_experts) return false;
    for (LoraKind k : ks)
      if (!kinds[static_cast<int>(k)].empty() && !grouped[static_cast<int>(k)].A) return false;
    return true;
  }
};
struct LoraState {
  void* base = nullptr;  // one allocation for every adapter's buffers
  size_t bytes = 0;
  std::vector<LayerLora> layers;
  std::vector<DAdapter*> order;  // in the host adapter's module order
  std::vector<std::tuple<int, int64_t, int64_t, int64_t>> keys;  // (kind, layer, expert, rank) of each, that order
  size_t grads_at = 0, grads_bytes = 0;  // every gradient buffer lies in base's bytes [grads_at, + grads_bytes)
  // The gradients of the per-expert adapters that run grouped (their backward can overwrite instead of add), as
  // sorted, merged byte ranges of base, and the other gradients' ranges: zero_grads clears only those and marks the
  // grouped ones unwritten; the next backward overwrites them, or a reader of the gradients clears them first.
  std::vector<std::pair<size_t, size_t>> overwritten, cleared;
  bool unwritten = false;
  // The device optimizer (CudaModel::start_lora_optimizer), when started: per tensor of the host adapter's params()
  // order (each module's A, then B) its fp32 value, moments and descriptor (cuda/optim.h), in one allocation.
  struct Optimizer {
    void* base = nullptr;
    std::vector<DeviceParam> host;  // the descriptors (device pointers)
    DeviceParam* params = nullptr;  // the same on the device
    int64_t chunks = 0;
    void* workspace = nullptr;
    double* sq = nullptr;  // the squared gradient norm of the last step
    // The update layer by layer (CudaModel::Impl::update_stream): each run of tensors of one layer in the order
    // above, its first tensor, count and chunks; one run of every tensor (layer −1) where the order is not by layer.
    struct Run {
      int64_t layer;
      int first, count;
      int64_t chunks;
    };
    std::vector<Run> runs;
    void* update_workspace = nullptr;  // the runs' work lists (apart from workspace, which the norm uses)
    ~Optimizer() { cudaFree(base); }
  };
  std::unique_ptr<Optimizer> opt;
  void* grouped_ptrs = nullptr;  // the LayerLora::Grouped arrays
  // Joined weights [W | B…] of the frozen projections that run joined with their adapters (train.cu's
  // joined_forward), by the projection's W: W's columns copied once, the adapters' B refreshed on every use; and
  // [W ; A] of those whose input gradient runs joined (joined_backward; K there: W's rows + A's, padded), A's rows
  // refreshed on every use. Both within kJoinCacheBytes together. set_weights clears them.
  struct Joined {
    bf16* w = nullptr;
    int64_t K = 0;  // row stride: W's input width + the joined u's width (padded to a multiple of 8)
    // The adapters' layout the u columns were last zeroed for ((col0, out, first column, r) of each), so that a
    // call with the same layout only copies the B blocks over their old values; empty: not zeroed yet.
    std::vector<int64_t> layout;
  };
  std::map<const bf16*, Joined> joined, joined_dx;
  size_t joined_bytes = 0;
  void clear_joined() {
    for (auto* m : {&joined, &joined_dx}) {
      for (auto& [key, j] : *m) cudaFree(j.w);
      m->clear();
    }
    joined_bytes = 0;
  }
  ~LoraState() {
    clear_joined();
    cudaFree(base);
    cudaFree(grouped_ptrs);
  }
};

struct Grads {
  float* base = nullptr;  // the one allocation
  int64_t floats = 0;
  bool linears = true;    // whether the linear weights have gradients (CudaModel::set_train_linears)
  bool small = true;      // whether the other (small) weights have them (CudaModel::set_train_small)
  // lm_head has its own buffer even when tied (gradients() adds it into the embedding's).
  float *embed = nullptr, *lm_head = nullptr, *final_norm = nullptr;
  std::vector<GLayer> layers;
  ~Grads() { cudaFree(base); }
};

}  // namespace cuda

// This rank's config: the KDA and MLA head counts divided by tp, the dense MLP's width its share; the vocabulary,
// the experts and everything else as the full model's (the rank's vocabulary rows and experts are Impl's).
inline ModelConfig shard_config(const ModelConfig& c, const CudaShard& s) {
  check(s.tp >= 1 && s.ep >= 1 && s.tp_rank >= 0 && s.tp_rank < s.tp && s.ep_rank >= 0 && s.ep_rank < s.ep,
        "bad shard: tp rank ", s.tp_rank, " of ", s.tp, ", ep rank ", s.ep_rank, " of ", s.ep);
  check(c.linear_num_heads % s.tp == 0, "--tp ", s.tp, " does not divide the ", c.linear_num_heads, " KDA heads");
  check(c.num_attention_heads % s.tp == 0, "--tp ", s.tp, " does not divide the ", c.num_attention_heads,
        " attention heads");
  check(c.n_routed_experts % s.ep == 0 || !c.n_routed_experts, "--ep ", s.ep, " does not divide the ",
        c.n_routed_experts, " routed experts");
  ModelConfig l = c;
  l.linear_num_heads /= s.tp;
  l.num_attention_heads /= s.tp;
  l.intermediate_size = cuda::part_of(c.intermediate_size, s.tp, s.tp_rank, 0).count;
  return l;
}

struct CudaModel::Impl {
  const ModelConfig full;  // the model's config
  const ModelConfig cfg;   // this rank's (shard_config); the full one when not sharded
  const CudaShard shard;
  dist::Comm *tp_comm = nullptr, *ep_comm = nullptr;  // set_collectives
  int64_t vocab_begin = 0, vocab_rows = 0;            // rows of embed / lm_head held here
  int64_t expert_begin = 0, local_experts = 0;        // routed experts held here
  int device;
  cudaStream_t stream = nullptr;
  // Decoding runs independent chains of small, latency-bound kernels (the memory mostly idle meanwhile) side by side:
  // fork() makes `side` wait for the work issued so far on `stream`, on_side(f) issues f's work there, side_done(i)
  // marks the side's work so far as join point i and join(i) makes `stream` wait for it. Captured into a step's
  // graph these become parallel branches. Decoding does so outside batch-invariant mode only (overlap()); the
  // training step with train_overlap (CudaModel::set_train_overlap). No result changes either way: each kernel
  // computes what it computed in line.
  cudaStream_t side = nullptr;
  cudaEvent_t fork_ev = nullptr, join_ev[2] = {nullptr, nullptr};
  cuda::Store store;
  cuda::Arena arena;
  std::unique_ptr<cuda::Gemm> gemm, side_gemm;
  cuda::bf16 *embed = nullptr, *lm_head = nullptr;
  float* final_norm = nullptr;
  std::vector<cuda::DLayer> layers;
  bool profiling = false;
  std::vector<std::pair<std::string, double>> prof;
  std::map<std::string, std::pair<cudaEvent_t, cudaEvent_t>> events;

  cudaEvent_t fwd_begin = nullptr, fwd_end = nullptr;
  double last_ms = 0.0;

  // Page-locked host memory for a step's small transfers, so that the host waits on the stream only where it needs a
  // result: the batch plan's uploads (plan_staging, reused once the copies that read it have run: staged_ev), the
  // training loss's rows and the LoRA optimizer's gradient norm (read back as soon as it exists: norm_ev, while the
  // update runs on).
  class Pinned {
   public:
    Pinned() = default;
    Pinned(const Pinned&) = delete;
    Pinned& operator=(const Pinned&) = delete;
    ~Pinned() {
      if (p_) cudaFreeHost(p_);
    }
    // At least `bytes` (grown as needed: the contents are not kept).
    void* get(size_t bytes) {
      if (bytes > bytes_) {
        if (p_) NEXTLM_CUDA_CHECK(cudaFreeHost(p_));
        p_ = nullptr, bytes_ = 0;
        NEXTLM_CUDA_CHECK(cudaMallocHost(&p_, bytes));
        bytes_ = bytes;
      }
      return p_;
    }

   private:
    void* p_ = nullptr;
    size_t bytes_ = 0;
  };
  Pinned plan_staging, loss_host, norm_host;
  cudaEvent_t staged_ev = nullptr, norm_ev = nullptr;

  bool empty_seen = false;       // empty selections attend to keys 0 … t (EmptySelection::SeenKeys), not all keys
  bool kda_tensor_cores = true;  // the tensor-core KDA where it supports the config (else the fp32 kernels)
  bool mla_absorbed = false;     // the forward's MLA attention on the absorbed decoding kernels
  // CudaModel::set_kda_backward_bf16 (the chunked KDA backward's products in bf16, else split bf16); on by default,
  // NEXTLM_KDA_BWD_BF16=0 in the environment makes the default off.
  bool kda_backward_bf16 = env_switch_on("NEXTLM_KDA_BWD_BF16");
  // CudaModel::set_kda_keep_states (a kept KDA site's forward keeps every chunk's start state and v_new for the
  // chunked backward); on by default, NEXTLM_KDA_KEEP_STATES=0 in the environment makes the default off.
  bool kda_keep_states = env_switch_on("NEXTLM_KDA_KEEP_STATES");
  const cuda::Capture* capture = nullptr;  // set by CudaDecoder::prefill
  size_t cur_layer = 0;                    // the layer hidden() is running (to find its caches)
  std::unique_ptr<cuda::Grads> grads;      // the training gradients (train.cu), made by the first backward
  bool train_linears = true;               // whether the backward computes the linear weights' gradients
  bool train_small = true;                 // and the small weights' (norms, mHC, conv, gates)
  RecomputePolicy recompute;               // what the training backward recomputes (CudaModel::set_recompute)
  // Under an adaptive policy, the batches forward_backward added into the gradients since they were last zero: a
  // step that runs out of memory runs them again under the next rung.
  std::vector<PackedBatch> since_zero;
  // The gradients hold more than since_zero tells (added under a fixed policy, or by batches the weights have changed
  // since): such a step cannot be run again.
  bool untracked = false;
  // Weights change (set_weights, set_lora, an optimizer step): the batches since zero_grads cannot be run again.
  void weights_changed() {
    if (!since_zero.empty()) untracked = true;
    since_zero.clear();
  }
  std::unique_ptr<cuda::LoraState> lora;   // LoRA adapters on the projections (train.cu), when set
  // With lora_update_beside, the device LoRA optimizer's update (lora_adamw_step) runs on a stream of its own, a
  // layer's adapters after another's, so that the next training step's forward runs beside it: that forward waits
  // for layer i's update before layer i (wait_lora_update), and `stream` waits for the whole update after the forward
  // and before anything else reads or writes the adapters, their gradients or the optimizer's state
  // (join_lora_update; start() does it unless told the caller waits layer by layer).
  cudaStream_t update_stream = nullptr;
  std::vector<cudaEvent_t> update_ev;  // per layer: its adapters' update, recorded this update (update_has)
  std::vector<bool> update_has;
  cudaEvent_t update_start = nullptr, update_done = nullptr;
  mutable bool update_pending = false;  // an update on update_stream that `stream` has not waited for
  void wait_lora_update(size_t layer) const {
    if (update_pending && layer < update_has.size() && update_has[layer])
      NEXTLM_CUDA_CHECK(cudaStreamWaitEvent(stream, update_ev[layer], 0));
  }
  void join_lora_update() const {
    if (!update_pending) return;
    NEXTLM_CUDA_CHECK(cudaStreamWaitEvent(stream, update_done, 0));
    update_pending = false;
  }

  Impl(const ModelConfig& c, int dev, const CudaShard& sh = {})
      : full(c), cfg(shard_config(c, sh)), shard(sh), device(dev) {
    const cuda::WeightSource::Slice v = cuda::part_of(c.vocab_size, sh.tp, sh.tp_rank, 0),
                                     e = cuda::part_of(c.n_routed_experts, sh.ep, sh.ep_rank, 0);
    vocab_begin = v.begin, vocab_rows = v.count, expert_begin = e.begin, local_experts = e.count;
    check(!cuda_device_name(dev).empty(), "no CUDA device ", dev, " is available");
    NEXTLM_CUDA_CHECK(cudaSetDevice(dev));
    NEXTLM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    NEXTLM_CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    NEXTLM_CUDA_CHECK(cudaEventCreateWithFlags(&fork_ev, cudaEventDisableTiming));
    for (cudaEvent_t& e : join_ev) NEXTLM_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    NEXTLM_CUDA_CHECK(cudaEventCreate(&fwd_begin));
    NEXTLM_CUDA_CHECK(cudaEventCreate(&fwd_end));
    NEXTLM_CUDA_CHECK(cudaEventCreateWithFlags(&staged_ev, cudaEventDisableTiming));
    NEXTLM_CUDA_CHECK(cudaEventCreateWithFlags(&norm_ev, cudaEventDisableTiming));
    gemm = std::make_unique<cuda::Gemm>(stream);
  }
  ~Impl() {
    if (update_stream) cudaStreamSynchronize(update_stream);  // the adapters' buffers go with lora, after this
    for (cudaEvent_t e : update_ev) cudaEventDestroy(e);
    if (update_start) cudaEventDestroy(update_start);
    if (update_done) cudaEventDestroy(update_done);
    if (update_stream) cudaStreamDestroy(update_stream);
    for (auto& e : events) cudaEventDestroy(e.second.first), cudaEventDestroy(e.second.second);
    if (fwd_begin) cudaEventDestroy(fwd_begin);
    if (fwd_end) cudaEventDestroy(fwd_end);
    if (staged_ev) cudaEventDestroy(staged_ev);
    if (norm_ev) cudaEventDestroy(norm_ev);
    if (fork_ev) cudaEventDestroy(fork_ev);
    for (cudaEvent_t e : join_ev)
      if (e) cudaEventDestroy(e);
    if (side) cudaStreamDestroy(side);
    if (stream) cudaStreamDestroy(stream);
  }

  // CudaModel::set_decode_overlap; NEXTLM_DECODE_OVERLAP=0 in the environment turns it off by default.
  bool decode_overlap = env_switch_on("NEXTLM_DECODE_OVERLAP");
  bool overlap() const { return decode_overlap && !gemm->batch_invariant(); }
  // CudaModel::set_train_overlap; NEXTLM_TRAIN_OVERLAP=0 in the environment turns it off by default.
  bool train_overlap = env_switch_on("NEXTLM_TRAIN_OVERLAP");
  // CudaModel::set_lora_update_beside; off by default (no gain measured on an H100), NEXTLM_LORA_UPDATE_BESIDE=1 in
  // the environment turns it on by default.
  bool lora_update_beside = env_switch_on("NEXTLM_LORA_UPDATE_BESIDE", false);
  void fork() {
    NEXTLM_CUDA_CHECK(cudaEventRecord(fork_ev, stream));
    NEXTLM_CUDA_CHECK(cudaStreamWaitEvent(side, fork_ev, 0));
  }
  // Marks what has been issued on `side` so far as join point i (0 or 1); join(i) waits for it on `stream`.
  void side_done(int i) { NEXTLM_CUDA_CHECK(cudaEventRecord(join_ev[i], side)); }
  void join(int i) { NEXTLM_CUDA_CHECK(cudaStreamWaitEvent(stream, join_ev[i], 0)); }
  // fork(), on_side(f) and side_done(i) in one: f's work on `side` from here on, join(i) waits for it.
  template <class F>
  void run_beside(int i, F&& f) {
    fork();
    on_side(std::forward<F>(f));
    side_done(i);
  }
  // on_side swaps `gemm` for side_gemm too where there is one (cuBLASLt's workspace is per stream): the training
  // step's overlap makes it (use_side_gemm); decoding's side work runs no cuBLASLt GEMM.
  void use_side_gemm() {
    if (!side_gemm) side_gemm = std::make_unique<cuda::Gemm>(side);
    side_gemm->set_batch_invariant(gemm->batch_invariant());
  }
  template <class F>
  void on_side(F&& f) {
    const auto swap = [&] {
      std::swap(stream, side);
      if (side_gemm) std::swap(gemm, side_gemm);
    };
    swap();
    try {
      f();
    } catch (...) {
      swap();
      throw;
    }
    swap();
  }

  // Every tensor build() filled, in order: set_weights() fills the same places again from another source.
  struct Fill {
    std::string name;
    std::vector<int64_t> shape;
    cuda::DistSpec init;
    cuda::WeightSource::Slice slice;
    void* dst;
    bool bf16;
  };
  bool sharded() const { return shard.tp > 1 || shard.ep > 1; }
  std::vector<Fill> fills;

  // Allocates and fills every weight from `src`, layer by layer in checkpoint order. Each tensor names the
  // distribution a random init draws it from (init_weights' choices, src/model/init.h).
  void build(cuda::WeightSource& inner) {
    using namespace cuda;
    // Records each fill on its way to the source.
    struct Recording : WeightSource {
      WeightSource& in;
      std::vector<Fill>& out;
      Recording(WeightSource& i, std::vector<Fill>& o) : in(i), out(o) {}
      std::string prefix() const override { return in.prefix(); }
      bool has(const std::string& name) const override { return in.has(name); }
      bool random() const override { return in.random(); }
      void bf16_into(const std::string& name, const std::vector<int64_t>& shape, const DistSpec& init,
                     bf16* dst) override {
        bf16_slice_into(name, shape, init, Slice{}, dst);
      }
      void f32_into(const std::string& name, const std::vector<int64_t>& shape, const DistSpec& init,
                    float* dst) override {
        f32_slice_into(name, shape, init, Slice{}, dst);
      }
      void bf16_slice_into(const std::string& name, const std::vector<int64_t>& shape, const DistSpec& init,
                           const Slice& s, bf16* dst) override {
        out.push_back({name, shape, init, s, dst, true});
        in.bf16_slice_into(name, shape, init, s, dst);
      }
      void f32_slice_into(const std::string& name, const std::vector<int64_t>& shape, const DistSpec& init,
                          const Slice& s, float* dst) override {
        out.push_back({name, shape, init, s, dst, false});
        in.f32_slice_into(name, shape, init, s, dst);
      }
    } src(inner, fills);
    // Shapes are the full model's; a sharded rank cuts its part of each split tensor.
    const ModelConfig& c = full;
    using Slice = WeightSource::Slice;
    const std::string P = src.prefix();
    const int64_t V = c.vocab_size, D = c.hidden_size, S = c.hc_mult, M = (2 + S) * S;
    const int tp = shard.tp, tr = shard.tp_rank;
    const float std_lin = static_cast<float>(c.initializer_range);
    const DistSpec normal{Dist::Normal, std_lin}, ones{Dist::Const, 1.0f}, zeros{Dist::Const, 0.0f};
    // A linear [Σ rows, in] from parts stacked row-wise (q | k | v, gate | up), each given with its full rows. A
    // row slice (axis 0) cuts the same rows of every part; a column slice (axis 1) cuts the input features.
    // into: where the weight goes (else an allocation of its own).
    auto linear = [&](const std::vector<std::pair<std::string, int64_t>>& parts, int64_t in,
                      const DistSpec* init = nullptr, Slice cut = {}, bf16* into = nullptr) {
      const DistSpec d = init ? *init : normal;
      DLinear l;
      l.in = cut.axis == 1 ? cut.count : in;
      for (const auto& p : parts) l.out += cut.axis == 0 ? cut.count : p.second;
      l.w = into ? into : store.alloc<bf16>(l.out * l.in);
      int64_t row = 0;
      for (const auto& p : parts) {
        src.bf16_slice_into(p.first, {p.second, in}, d, cut, l.w + row * l.in);
        row += cut.axis == 0 ? cut.count : p.second;
      }
      return l;
    };
    auto vec = [&](const std::string& name, const std::vector<int64_t>& shape, const DistSpec& init,
                   Slice cut = {}) {
      const int64_t n = numel_of(shape), held = cut.axis == 0 ? n / shape[0] * cut.count : n;
      float* p = store.alloc<float>(held);
      src.f32_slice_into(name, shape, init, cut, p);
      return p;
    };
    // A dense MLP of full width I, or this rank's share of it (gate/up rows, down columns).
    auto mlp = [&](const std::string& p, int64_t I) {
      const Slice rows = tp > 1 ? part_of(I, tp, tr, 0) : Slice{}, cols{tp > 1 ? 1 : -1, rows.begin, rows.count};
      return DMlp{linear({{p + "gate_proj.weight", I}, {p + "up_proj.weight", I}}, D, nullptr, rows),
                  linear({{p + "down_proj.weight", D}}, I, nullptr, cols), tp > 1 ? rows.count : I};
    };
    const Slice vocab = tp > 1 ? Slice{0, vocab_begin, vocab_rows} : Slice{};

    DLinear emb = linear({{P + "embed_tokens.weight", V}}, D, nullptr, vocab);
    embed = emb.w;
    if (c.pad_token_id && *c.pad_token_id >= vocab_begin && *c.pad_token_id < vocab_begin + vocab_rows &&
        src.random())  // padding_idx
      NEXTLM_CUDA_CHECK(
          cudaMemsetAsync(embed + (*c.pad_token_id - vocab_begin) * D, 0, D * sizeof(bf16), stream));
    final_norm = vec(P + "norm.weight", {D}, ones);
    lm_head = c.tie_word_embeddings && !src.has("lm_head.weight")
                  ? embed
                  : linear({{"lm_head.weight", V}}, D, nullptr, vocab).w;
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      const std::string p = P + "layers." + std::to_string(i) + ".";
      DLayer L;
      auto hc = [&](const std::string& h) {
        return DHc{vec(p + h + "_fn", {M, S * D}, DistSpec{Dist::Normal, 0.02f}), vec(p + h + "_base", {M}, zeros),
                   vec(p + h + "_scale", {3}, ones)};
      };
      L.hc_attn = hc("hc_attn");
      L.hc_ffn = hc("hc_ffn");
      L.in_norm = vec(p + "input_layernorm.weight", {D}, ones);
      L.post_norm = vec(p + "post_attention_layernorm.weight", {D}, ones);
      const std::string a = p + "self_attn.";
      if (c.layer_types[i] == LayerType::LinearAttention) {
        const int64_t H = c.linear_num_heads, K = c.linear_head_dim, HK = H * K, W = c.linear_conv_kernel_dim;
        // This rank's heads [h0, h0 + Hl): rows of q, k, v, f_b, g_b, b, the convs, dt_bias and A_log, columns
        // of o_proj.
        const int64_t Hl = H / tp, h0 = tr * Hl;
        const Slice heads = tp > 1 ? Slice{0, h0 * K, Hl * K} : Slice{},
                    head_rows = tp > 1 ? Slice{0, h0, Hl} : Slice{},
                    head_cols = tp > 1 ? Slice{1, h0 * K, Hl * K} : Slice{};
        L.kda_layer = true;
        DKda& k = L.kda;
        k.qkv = linear({{a + "q_proj.weight", HK}, {a + "k_proj.weight", HK}, {a + "v_proj.weight", HK}}, D, nullptr,
                       heads);
        // Depthwise conv weights [3·HK, W] (q | k | v); the hub stores each [HK, 1, W]. nn.Conv1d's own init.
        const float bound = 1.0f / std::sqrt(static_cast<float>(W));
        k.conv = store.alloc<float>(3 * Hl * K * W);
        int64_t off = 0;
        for (const char* n : {"q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"}) {
          src.f32_slice_into(a + n, {HK, 1, W}, DistSpec{Dist::Uniform, -bound, bound}, heads, k.conv + off);
          off += Hl * K * W;
        }
        k.f_a = linear({{a + "f_a_proj.weight", K}}, D);
        k.f_b = linear({{a + "f_b_proj.weight", HK}}, K, nullptr, heads);
        k.dt_bias = vec(a + "dt_bias", {HK}, DistSpec{Dist::DtBias, 1e-3f, 1e-1f}, heads);
        k.A_log = vec(a + "A_log", {H}, c.linear_lower_bound ? zeros : DistSpec{Dist::LogUniform, 1.0f, 16.0f},
                      head_rows);
        k.b = linear({{a + "b_proj.weight", H}}, D, nullptr, head_rows);
        k.g_a = linear({{a + "g_a_proj.weight", K}}, D);
        k.g_b = linear({{a + "g_b_proj.weight", HK}}, K, nullptr, heads);
        k.o_norm = vec(a + "o_norm.weight", {K}, ones);
        k.o = linear({{a + "o_proj.weight", D}}, HK, nullptr, head_cols);
      } else {
        const int64_t NH = c.num_attention_heads, dqk = c.qk_nope_head_dim, dv = c.v_head_dim, QL = c.q_lora_rank,
                      KL = c.kv_lora_rank;
        // This rank's heads: rows of q_b and kv_b (each head's k | v rows are contiguous), columns of o_proj.
        const int64_t NHl = NH / tp, h0 = tr * NHl;
        const auto rows = [&](int64_t per_head) { return tp > 1 ? Slice{0, h0 * per_head, NHl * per_head} : Slice{}; };
        DDsa& d = L.dsa;
        d.q_a = linear({{a + "q_a_proj.weight", QL}}, D);
        d.q_a_norm = vec(a + "q_a_layernorm.weight", {QL}, ones);
        d.q_b = linear({{a + "q_b_proj.weight", NH * dqk}}, QL, nullptr, rows(dqk));
        d.kv_a = linear({{a + "kv_a_proj_with_mqa.weight", KL}}, D);
        d.kv_a_norm = vec(a + "kv_a_layernorm.weight", {KL}, ones);
        d.kv_b = linear({{a + "kv_b_proj.weight", NH * (dqk + dv)}}, KL, nullptr, rows(dqk + dv));
        d.o = linear({{a + "o_proj.weight", D}}, NH * dv, nullptr,
                     tp > 1 ? Slice{1, h0 * dv, NHl * dv} : Slice{});
        if (c.indexer_types[i] == IndexerType::Full) {
          const int64_t IH = c.index_n_heads, ID = c.index_head_dim;
          const std::string q = a + "indexer.";
          d.has_indexer = true;
          d.idx.wq_b = linear({{q + "wq_b.weight", IH * ID}}, QL);
          d.idx.wk = linear({{q + "wk.weight", ID}}, D);
          d.idx.k_norm_w = vec(q + "k_norm.weight", {ID}, ones);
          d.idx.k_norm_b = vec(q + "k_norm.bias", {ID}, zeros);
          d.idx.weights = linear({{q + "weights_proj.weight", IH}}, D);
          d.idx.ape = vec(q + "index_kpool_compress_ape", {c.index_kpool, ID}, zeros);
          d.idx.gate = linear({{q + "index_kpool_compress_gate", ID}}, D, &ones);
        }
      }
      const std::string m = p + "mlp.";
      if (c.mlp_layer_types[i] == MlpType::Sparse) {
        const int64_t E = c.n_routed_experts, I = c.moe_intermediate_size;
        L.moe_layer = true;
        L.moe.router = linear({{m + "gate.weight", E}}, D);
        L.moe.bias = vec(m + "gate.e_score_correction_bias", {E}, zeros);
        // The routed experts held here, whole (expert parallelism splits the experts, not their width), each
        // projection's experts back to back (the grouped GEMM's tensor maps read them as one tensor).
        const int64_t El = local_experts;
        L.moe.experts.reserve(El);
        L.moe.gate_up_all = store.alloc<bf16>(El * 2 * I * D);
        L.moe.down_all = store.alloc<bf16>(El * D * I);
        for (int64_t e = expert_begin; e < expert_begin + El; ++e) {
          const std::string x = m + "experts." + std::to_string(e) + ".";
          const int64_t j = e - expert_begin;
          L.moe.experts.push_back(
              DMlp{linear({{x + "gate_proj.weight", I}, {x + "up_proj.weight", I}}, D, nullptr, {},
                          L.moe.gate_up_all + j * 2 * I * D),
                   linear({{x + "down_proj.weight", D}}, I, nullptr, {}, L.moe.down_all + j * D * I), I});
        }
        std::vector<const bf16*> gu_ptrs, dn_ptrs;
        for (const DMlp& x : L.moe.experts) gu_ptrs.push_back(x.gate_up.w), dn_ptrs.push_back(x.down.w);
        L.moe.gate_up_ptrs = store.alloc<const bf16*>(El);
        L.moe.down_ptrs = store.alloc<const bf16*>(El);
        NEXTLM_CUDA_CHECK(cudaMemcpy(L.moe.gate_up_ptrs, gu_ptrs.data(), El * sizeof(bf16*), cudaMemcpyHostToDevice));
        NEXTLM_CUDA_CHECK(cudaMemcpy(L.moe.down_ptrs, dn_ptrs.data(), El * sizeof(bf16*), cudaMemcpyHostToDevice));
        if (c.n_shared_experts > 0) {
          L.moe.has_shared = true;
          L.moe.shared = mlp(m + "shared_experts.", I * c.n_shared_experts);
        }
      } else {
        L.mlp = mlp(m, c.intermediate_size);
      }
      layers.push_back(std::move(L));
    }
    NEXTLM_CUDA_CHECK(cudaDeviceSynchronize());  // random fills run on the stream; copies are synchronous
  }

  // Profiling: named CUDA-event pairs around each part of the forward.
  void mark_begin(const std::string& name) {
    if (!profiling) return;
    auto it = events.find(name);
    if (it == events.end()) {
      cudaEvent_t a, b;
      NEXTLM_CUDA_CHECK(cudaEventCreate(&a));
      NEXTLM_CUDA_CHECK(cudaEventCreate(&b));
      it = events.emplace(name, std::make_pair(a, b)).first;
    }
    NEXTLM_CUDA_CHECK(cudaEventRecord(it->second.first, stream));
  }
  std::map<std::string, float> accum;
  void mark_end(const std::string& name) {
    if (!profiling) return;
    auto& ev = events.at(name);
    NEXTLM_CUDA_CHECK(cudaEventRecord(ev.second, stream));
    NEXTLM_CUDA_CHECK(cudaEventSynchronize(ev.second));
    float ms = 0.0f;
    NEXTLM_CUDA_CHECK(cudaEventElapsedTime(&ms, ev.first, ev.second));
    accum[name] += ms;
  }

  cuda::Plan plan(const PackedBatch& b) {
    using namespace cuda;
    validate_batch(b, cfg.vocab_size);
    Plan p;
    p.T = b.num_tokens();
    p.num_seqs = b.num_seqs();
    const int64_t P = cfg.index_kpool;
    std::vector<int32_t> targets(p.T, -1), start(p.T), len(p.T), pool_base(p.T), pool_token;
    std::vector<int32_t> cs, cl, sf, sn;
    for (int64_t n = 0; n < p.num_seqs; ++n) {
      const int64_t s0 = b.cu_seqlens[n], L = b.cu_seqlens[n + 1] - s0;
      p.max_len = std::max(p.max_len, L);
      p.lens.push_back(L);
      p.max_pools = std::max(p.max_pools, L / P);
      const int32_t base = static_cast<int32_t>(pool_token.size());
      for (int64_t j = 0; j < L / P; ++j) pool_token.push_back(static_cast<int32_t>(s0 + j * P));
      for (int64_t t = s0; t < s0 + L; ++t) {
        start[t] = static_cast<int32_t>(s0);
        len[t] = static_cast<int32_t>(L);
        pool_base[t] = base;
        if (t + 1 < s0 + L) targets[t] = b.tokens[t + 1];
      }
      sf.push_back(static_cast<int32_t>(cs.size()));
      for (int64_t c = 0; c < L; c += 64) {
        cs.push_back(static_cast<int32_t>(s0 + c));
        cl.push_back(static_cast<int32_t>(std::min<int64_t>(64, L - c)));
      }
      sn.push_back(static_cast<int32_t>(cs.size()) - sf.back());
    }
    p.num_pools = static_cast<int64_t>(pool_token.size());
    std::vector<int32_t> seen(p.T), pos(p.T);
    for (int64_t t = 0; t < p.T; ++t) {
      seen[t] = static_cast<int32_t>(t - start[t] + 1);
      pos[t] = seen[t] - 1;
    }
    std::vector<int32_t> cu(b.cu_seqlens.begin(), b.cu_seqlens.end());
    // The vectors go up from one page-locked staging buffer, so that the host waits neither for the copies nor for
    // the stream's earlier work (a training step's optimizer update may still be running); the buffer is refilled
    // once the last plan's copies from it have run.
    size_t staged = 0;
    const std::vector<int32_t>* parts[] = {&b.tokens, &targets, &start, &len, &pool_base, &pool_token, &seen,
                                           &pos,      &cu,      &cs,    &cl,  &sf,        &sn};
    for (const std::vector<int32_t>* v : parts) staged += v->size();
    NEXTLM_CUDA_CHECK(cudaEventSynchronize(staged_ev));
    int32_t* stage = static_cast<int32_t*>(plan_staging.get(std::max<size_t>(staged, 1) * sizeof(int32_t)));
    auto up = [&](const std::vector<int32_t>& v) {
      int32_t* d = arena.alloc<int32_t>(static_cast<int64_t>(v.size()));
      std::copy(v.begin(), v.end(), stage);
      NEXTLM_CUDA_CHECK(cudaMemcpyAsync(d, stage, v.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream));
      stage += v.size();
      return d;
    };
    p.tokens = up(b.tokens);
    p.targets = up(targets);
    p.seq_start = up(start);
    p.seq_len = up(len);
    p.pool_base = up(pool_base);
    p.pool_token = up(pool_token);
    p.seen_len = up(seen);
    p.pos = up(pos);
    p.cu = up(cu);
    p.chunks = KdaChunks{up(cs), up(cl), up(sf), up(sn), static_cast<int64_t>(cs.size()), p.num_seqs};
    NEXTLM_CUDA_CHECK(cudaEventRecord(staged_ev, stream));
    return p;
  }

  // y = MLP(a) for a dense MLP or the shared expert; accumulate adds into y.
  void mlp(const cuda::DMlp& m, const cuda::bf16* a, int64_t T, float* y, bool accumulate = false) {
    using namespace cuda;
    float* gu = arena.alloc<float>(T * 2 * m.I);
    bf16* act = arena.alloc<bf16>(T * m.I);
    gemm->run(a, cfg.hidden_size, m.gate_up.w, 2 * m.I, cfg.hidden_size, gu, 2 * m.I, T);
    swiglu(gu, act, T, m.I, static_cast<float>(cfg.swiglu_limit), stream);
    gemm->run(act, m.I, m.down.w, cfg.hidden_size, m.I, y, cfg.hidden_size, T, accumulate);
  }

  void kda(const cuda::DKda& w, const cuda::Plan& p, const cuda::bf16* a, float* y) {
    using namespace cuda;
    const int64_t T = p.T, D = cfg.hidden_size, H = cfg.linear_num_heads, K = cfg.linear_head_dim, HK = H * K;
    const bool has_bound = cfg.linear_lower_bound.has_value();
    const float bound = static_cast<float>(cfg.linear_lower_bound.value_or(0.0));
    // The tensor-core path (bf16 q/k/v, gate in the kernel) for the safe gate; the fp32 kernels otherwise.
    const bool tc = kda_tensor_cores && kda_tc_supported(K, has_bound, bound);
    float* raw = arena.alloc<float>(T * 3 * HK);
    gemm->run(a, D, w.qkv.w, 3 * HK, D, raw, 3 * HK, T);
    // A prefill keeps each prompt's conv history and final state in its slot.
    const cuda::LayerCache* cache = capture ? &capture->layers[cur_layer] : nullptr;
    if (cache) kda_store_conv_hist(raw, capture->seqs, cache->conv_hist, HK, cfg.linear_conv_kernel_dim, stream);
    float* fa = arena.alloc<float>(T * K);
    bf16* fa16 = arena.alloc<bf16>(T * K);
    float* g = arena.alloc<float>(T * HK);
    gemm->run(a, D, w.f_a.w, K, D, fa, K, T);
    to_bf16(fa, fa16, T * K, stream);
    gemm->run(fa16, K, w.f_b.w, HK, K, g, HK, T);
    float* beta = arena.alloc<float>(T * H);
    gemm->run(a, D, w.b.w, H, D, beta, H, T);
    sigmoid_inplace(beta, T * H, stream);
    float* ga = arena.alloc<float>(T * K);
    bf16* ga16 = arena.alloc<bf16>(T * K);
    float* gate = arena.alloc<float>(T * HK);
    gemm->run(a, D, w.g_a.w, K, D, ga, K, T);
    to_bf16(ga, ga16, T * K, stream);
    gemm->run(ga16, K, w.g_b.w, HK, K, gate, HK, T);
    bf16* o16 = arena.alloc<bf16>(T * HK);
    if (tc) {
      bf16 *q = arena.alloc<bf16>(T * HK), *k = arena.alloc<bf16>(T * HK), *v = arena.alloc<bf16>(T * HK);
      kda_conv_norm(raw, w.conv, p.seq_start, q, k, v, T, H, K, cfg.linear_conv_kernel_dim, stream);
      bf16* o = arena.alloc<bf16>(T * HK);
      void* work = arena.alloc<unsigned char>(kda_tc_workspace_bytes(p.chunks.num_chunks, H, K));
      // A prefill leaves in each prompt's slot its state at its last chunk boundary and the inputs of its partial
      // chunk, which decoding recomputes (decode_kernels.h).
      const KdaTcStates states = cache ? KdaTcStates{nullptr, cache->state, capture->seqs.slot, true} : KdaTcStates{};
      mark_begin("kda core");
      kda_chunked_tc(q, k, v, g, beta, w.dt_bias, w.A_log, bound, o, p.chunks,
                     kda_tc_workspace(work, p.chunks.num_chunks, H, K), H, K, states, stream);
      if (cache) {
        kda_store_chunk_rows(q, k, v, g, beta, capture->seqs, cache->chunk_q, cache->chunk_k, cache->chunk_v,
                             cache->chunk_g, cache->chunk_beta, H, K, stream);
        // What decoding steps reuse: the boundary states' fragments, and the rows of the partial chunks (the same
        // kernels on the chunk buffers, from those states).
        kda_tc_state_frags(cache->state, capture->seqs.slot, capture->seqs.N, cache->chunk_rows.sb, H, K, stream);
        const KdaChunks& tails = capture->kda_tails;
        if (tails.num_chunks) {
          void* tw = arena.alloc<unsigned char>(kda_tc_workspace_bytes(tails.num_chunks, H, K));
          kda_chunked_tc(cache->chunk_q, cache->chunk_k, cache->chunk_v, cache->chunk_g, cache->chunk_beta, w.dt_bias,
                         w.A_log, bound, nullptr, tails, kda_tc_workspace(tw, tails.num_chunks, H, K), H, K,
                         KdaTcStates{cache->state, nullptr, capture->kda_tail_slot, false}, stream,
                         cache->chunk_rows);
        }
      }
      mark_end("kda core");
      kda_out_norm(o, gate, w.o_norm, o16, T, H, K, static_cast<float>(cfg.rms_norm_eps), stream);
    } else {
      float *q = arena.alloc<float>(T * HK), *k = arena.alloc<float>(T * HK), *v = arena.alloc<float>(T * HK);
      kda_conv_norm(raw, w.conv, p.seq_start, q, k, v, T, H, K, cfg.linear_conv_kernel_dim, stream);
      kda_gate(g, w.dt_bias, w.A_log, T, H, K, has_bound, bound, stream);
      float* o = arena.alloc<float>(T * HK);
      float* work = arena.alloc<float>(kda_workspace_floats(p.chunks.num_chunks, H, K));
      mark_begin("kda core");
      kda_chunked(q, k, v, g, beta, o, p.chunks, work, T, H, K, stream);
      if (cache) kda_final_state(q, k, v, g, beta, capture->seqs, cache->state, H, K, stream);
      mark_end("kda core");
      kda_out_norm(o, gate, w.o_norm, o16, T, H, K, static_cast<float>(cfg.rms_norm_eps), stream);
    }
    gemm->run(o16, HK, w.o.w, D, HK, y, D, T);
  }

  // The DSA indexer of a full-indexer layer: each token's selection (sel [T, max_sel], count [T]) from the layer
  // input a and the normed q latent qr. A prefill also keeps each prompt's indexer pools in its slot.
  void indexer(const cuda::DDsa& w, const cuda::Plan& p, const cuda::bf16* a, const cuda::bf16* qr, int32_t* sel,
               int32_t* count, int64_t max_sel) {
    using namespace cuda;
    const int64_t T = p.T, D = cfg.hidden_size, QL = cfg.q_lora_rank;
    const cuda::LayerCache* cache = capture ? &capture->layers[cur_layer] : nullptr;
    mark_begin("indexer");
    const int64_t IH = cfg.index_n_heads, ID = cfg.index_head_dim;
    float *qi = arena.alloc<float>(T * IH * ID), *ki = arena.alloc<float>(T * ID), *gs = arena.alloc<float>(T * ID),
          *wts = arena.alloc<float>(T * IH), *pk = arena.alloc<float>(p.num_pools * ID);
    gemm->run(qr, QL, w.idx.wq_b.w, IH * ID, QL, qi, IH * ID, T);
    gemm->run(a, D, w.idx.wk.w, ID, D, ki, ID, T);
    layernorm_rows(ki, w.idx.k_norm_w, w.idx.k_norm_b, T, ID, 1e-6f, stream);
    gemm->run(a, D, w.idx.gate.w, ID, D, gs, ID, T);
    gemm->run(a, D, w.idx.weights.w, IH, D, wts, IH, T);
    IndexerParams ip{qi, ki, gs, wts, w.idx.ape, p.seq_start, p.seq_len, T, IH, ID, cfg.index_kpool,
                     cfg.index_topk, p.max_pools, cfg.index_kpool_always_select_tail};
    pool_keys(ip, p.pool_token, p.num_pools, pk, stream);
    if (cache)
      indexer_store_prefill(ki, gs, pk, capture->pool_base, capture->seqs, cache->pending_key, cache->pending_gate,
                            cache->pool_key, cfg.index_kpool, ID, capture->max_pools, stream);
    const int64_t score_rows = indexer_score_rows(ip);
    float* scores = arena.alloc<float>(score_rows * p.max_pools);
    indexer_select(ip, p.pool_base, pk, scores, score_rows, sel, count, max_sel, stream);
    mark_end("indexer");
  }

  void dsa(const cuda::DDsa& w, const cuda::Plan& p, const cuda::bf16* a, int32_t* sel, int32_t* count,
           int64_t max_sel, float* y) {
    using namespace cuda;
    const int64_t T = p.T, D = cfg.hidden_size, NH = cfg.num_attention_heads, dqk = cfg.qk_nope_head_dim,
                  dv = cfg.v_head_dim, QL = cfg.q_lora_rank, KL = cfg.kv_lora_rank;
    const float eps = static_cast<float>(cfg.rms_norm_eps);
    float* qa = arena.alloc<float>(T * QL);
    bf16* qr = arena.alloc<bf16>(T * QL);
    float* q = arena.alloc<float>(T * NH * dqk);
    gemm->run(a, D, w.q_a.w, QL, D, qa, QL, T);
    rmsnorm_rows(qa, QL, w.q_a_norm, qr, nullptr, T, QL, eps, stream);
    gemm->run(qr, QL, w.q_b.w, NH * dqk, QL, q, NH * dqk, T);
    float* lat = arena.alloc<float>(T * KL);
    bf16* lat16 = arena.alloc<bf16>(T * KL);
    // The absorbed form works on the latents; the expanded one needs every key and value through kv_b.
    const bool absorbed = mla_absorbed || gemm->batch_invariant();
    float* kv = absorbed ? nullptr : arena.alloc<float>(T * NH * (dqk + dv));
    gemm->run(a, D, w.kv_a.w, KL, D, lat, KL, T);
    rmsnorm_rows(lat, KL, w.kv_a_norm, lat16, nullptr, T, KL, eps, stream);
    // A prefill keeps each prompt's latents and indexer pools in its slot.
    const cuda::LayerCache* cache = capture ? &capture->layers[cur_layer] : nullptr;
    if (cache)
      mla_decode_append(lat16, capture->tok_slot, capture->tok_pos, cache->latent, T, KL, capture->max_len, stream);
    if (!absorbed) gemm->run(lat16, KL, w.kv_b.w, NH * (dqk + dv), KL, kv, NH * (dqk + dv), T);
    if (w.has_indexer) indexer(w, p, a, qr, sel, count, max_sel);
    bf16* o = arena.alloc<bf16>(T * NH * dv);
    mark_begin("sparse attention");
    if (absorbed) {
      // The decoding kernels (the absorbed form over the normed latents), in row blocks: every token gets bit for bit
      // what a decoding step computes for it. Empty selections attend to the keys seen so far, as in decoding.
      const int64_t rows = std::min<int64_t>(T, 512);
      float* work = arena.alloc<float>(mla_decode_workspace_floats(rows, NH, KL));
      for (int64_t b0 = 0; b0 < T; b0 += rows) {
        MlaDecodeParams mp{q + b0 * NH * dqk, w.kv_b.w, lat16, nullptr, p.pos + b0, sel + b0 * max_sel, count + b0,
                           o + b0 * NH * dv, std::min(rows, T - b0), NH, dqk, dv, KL, 0, max_sel, work};
        mp.row_start = p.seq_start + b0;
        mla_decode_attention(mp, stream);
      }
    } else if (mla_tc_supported(dqk, dv)) {
      bf16 *q16 = arena.alloc<bf16>(T * NH * dqk), *kv16 = arena.alloc<bf16>(T * NH * (dqk + dv));
      to_bf16(q, q16, T * NH * dqk, stream);
      to_bf16(kv, kv16, T * NH * (dqk + dv), stream);
      const int64_t words = mla_mask_words(p.max_len);
      uint32_t* mask = arena.alloc<uint32_t>(T * words);
      mla_sparse_attention_tc(q16, kv16, sel, count, p.seq_start, empty_seen ? p.seen_len : p.seq_len, o, mask,
                              words, T, NH, dqk, dv, max_sel, stream);
    } else {
      mla_sparse_attention(q, kv, sel, count, p.seq_start, empty_seen ? p.seen_len : p.seq_len, o, T, NH, dqk, dv,
                           max_sel, stream);
    }
    mark_end("sparse attention");
    gemm->run(o, NH * dv, w.o.w, D, NH * dv, y, D, T);
  }

  // The MoE of a forward, or (step) of a decoding step: there the router and the shared expert run on the decoding
  // GEMV, and the experts always on the grouped GEMM, whose rows do not depend on the other rows of their tile (a
  // step reads each chosen expert's weights once for all the rows that chose it).
  void moe(const cuda::DMoe& w, const cuda::bf16* a, int64_t T, float* y, bool step = false) {
    using namespace cuda;
    const int64_t D = cfg.hidden_size, E = cfg.n_routed_experts, k = cfg.num_experts_per_tok,
                  I = cfg.moe_intermediate_size, n = T * k;
    float* logits = arena.alloc<float>(T * E);
    // Decoding in line: the shared expert's gate|up, projected with the router in one launch.
    float* shared_gu = nullptr;
    // Decoding outside batch-invariant mode: the shared expert runs beside the routing and the experts (joined before
    // the combine, which adds the experts into y).
    const bool shared_beside = step && w.has_shared && overlap();
    if (shared_beside) {
      lin(a, D, w.router.w, E, D, logits, E, T);
      run_beside(0, [&] { mlp_step(w.shared, a, T, y); });
    } else if (step && w.has_shared) {
      const int64_t Is = w.shared.I;
      shared_gu = arena.alloc<float>(T * 2 * Is);
      lin_multi({{a, D, w.router.w, E, D, logits, E}, {a, D, w.shared.gate_up.w, 2 * Is, D, shared_gu, 2 * Is}}, T);
    } else if (step) {
      lin(a, D, w.router.w, E, D, logits, E, T);
    } else {
      gemm->run(a, D, w.router.w, E, D, logits, E, T);
    }
    int32_t* experts = arena.alloc<int32_t>(n);
    float* weights = arena.alloc<float>(n);
    // Expert parallelism: this rank runs its El experts on the tokens that chose them; the other choices go to a
    // last bucket after their rows, which the combine skips (the other ranks add them).
    const int64_t El = local_experts, buckets = El == E ? E : El + 1;
    int32_t *keys = arena.alloc<int32_t>(n), *slots_in = arena.alloc<int32_t>(n), *slots = arena.alloc<int32_t>(n),
            *token_of = arena.alloc<int32_t>(n), *slot_of = arena.alloc<int32_t>(n),
            *offsets = arena.alloc<int32_t>(buckets + 1);
    const size_t temp_bytes = moe_permute_temp_bytes(n);
    void* temp = arena.alloc<char>(static_cast<int64_t>(temp_bytes));
    bf16* xp = arena.alloc<bf16>(n * D);
    // A decoding step's few tokens: routing, sorting and gathering in one launch (the same results).
    const float scale = static_cast<float>(cfg.routed_scaling_factor);
    if (!(step && El == E &&
          moe_route_permute_small(logits, w.bias, experts, weights, T, E, cfg.n_group, cfg.topk_group, k,
                                  cfg.norm_topk_prob, scale, keys, slots, token_of, slot_of, offsets, a, xp, D,
                                  stream))) {
      moe_route(logits, w.bias, experts, weights, T, E, cfg.n_group, cfg.topk_group, k, cfg.norm_topk_prob, scale,
                stream);
      if (El != E) moe_localize(experts, n, expert_begin, El, stream);
      moe_permute(experts, T, k, buckets, keys, slots_in, slots, token_of, slot_of, offsets, temp, temp_bytes,
                  stream);
      gather_rows(a, token_of, xp, n, D, stream);
    }
    bf16* act = arena.alloc<bf16>(n * I);
    float* out = arena.alloc<float>(n * D);
    mark_begin("experts");
    if (moe_expert_gemm() >= 0 || step) {
      // The grouped GEMM walks the experts' tiles on the device: no host sync, clamped SwiGLU fused into gate_up.
      int32_t* ws = arena.alloc<int32_t>(grouped_gemm_workspace_ints(static_cast<int>(El)));
      const auto kernel = static_cast<GroupedGemmKernel>(moe_expert_gemm() >= 0 ? moe_expert_gemm() : 4);
      GroupedGemm gu{xp, offsets, w.gate_up_ptrs, act, n, static_cast<int>(El), static_cast<int>(2 * I),
                     static_cast<int>(D), GroupedEpilogue::kSwiGLU, static_cast<float>(cfg.swiglu_limit), kernel};
      gu.W_all = w.gate_up_all;
      gu.w_layout = w.layout;
      grouped_gemm(gu, ws, stream);
      GroupedGemm dn{act, offsets, w.down_ptrs, out, n, static_cast<int>(El), static_cast<int>(D),
                     static_cast<int>(I), GroupedEpilogue::kF32, 0.0f, kernel};
      dn.W_all = w.down_all;
      dn.w_layout = w.layout;
      dn.schedule_ready = grouped_gemm_same_schedule(gu, dn);  // then the gate|up's schedule serves both
      grouped_gemm(dn, ws, stream);
    } else {
      // One cuBLASLt GEMM per expert, after a device-to-host copy of the expert boundaries.
      w.require_rows();
      std::vector<int32_t> off(El + 1);
      NEXTLM_CUDA_CHECK(
          cudaMemcpyAsync(off.data(), offsets, (El + 1) * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
      float* gu = arena.alloc<float>(n * 2 * I);
      NEXTLM_CUDA_CHECK(cudaStreamSynchronize(stream));
      for (int64_t e = 0; e < El; ++e) {
        const int64_t r0 = off[e], m = off[e + 1] - off[e];
        if (m) gemm->run(xp + r0 * D, D, w.experts[e].gate_up.w, 2 * I, D, gu + r0 * 2 * I, 2 * I, m);
      }
      swiglu(gu, act, off[El], I, static_cast<float>(cfg.swiglu_limit), stream);
      for (int64_t e = 0; e < El; ++e) {
        const int64_t r0 = off[e], m = off[e + 1] - off[e];
        if (m) gemm->run(act + r0 * I, I, w.experts[e].down.w, D, I, out + r0 * D, D, m);
      }
    }
    mark_end("experts");
    if (shared_beside) {
      join(0);
    } else if (w.has_shared && step) {
      mlp_step_down(w.shared, shared_gu, T, y);
    } else if (w.has_shared) {
      mlp(w.shared, a, T, y);
    } else {
      NEXTLM_CUDA_CHECK(cudaMemsetAsync(y, 0, T * D * sizeof(float), stream));
    }
    // y holds this rank's share of the shared expert (its TP slices). When the TP and EP groups differ, the shared
    // expert is summed over TP first and kept by one rank of the EP group only, so that the EP sum counts it once.
    if (tp_comm != ep_comm) {
      all_reduce(tp_comm, y, T * D);
      if (ep_comm && shard.ep_rank != 0) NEXTLM_CUDA_CHECK(cudaMemsetAsync(y, 0, T * D * sizeof(float), stream));
    }
    moe_combine(y, out, slot_of, weights, T, k, D, stream, El == E ? nullptr : offsets + El);
    all_reduce(ep_comm, y, T * D);
  }

  // x ← Σ over the group's ranks (nothing without a group).
  void all_reduce(dist::Comm* c, float* x, int64_t n) {
    if (c && c->size() > 1 && n) c->all_reduce_sum(x, static_cast<size_t>(n));
  }
  // The embedding of the tokens into the S streams h [T, S, D]; with a vocabulary split, each rank's rows summed
  // over TP (the rows of one rank, zeros elsewhere).
  void embed_into(const int32_t* tokens, float* h, int64_t T) {
    const int64_t S = cfg.hc_mult, D = cfg.hidden_size;
    if (vocab_rows == cfg.vocab_size) return cuda::embed_streams(tokens, embed, h, T, S, D, stream);
    float* x = arena.alloc<float>(T * D);
    cuda::embed_rows_range(tokens, embed, vocab_begin, vocab_rows, x, T, D, stream);
    all_reduce(tp_comm, x, T * D);
    cuda::expand_streams(x, h, T, S, D, stream);
  }

  // The mHC parameters of one site of layer L (the attention one, or the feed-forward one when ffn), with the
  // RMSNorm of the sub-layer that follows it.
  cuda::MhcParams mhc_params(const cuda::DLayer& L, bool ffn, int64_t T) const {
    const cuda::DHc& hc = ffn ? L.hc_ffn : L.hc_attn;
    return cuda::MhcParams{hc.fn, hc.base, hc.scale, ffn ? L.post_norm : L.in_norm, T, cfg.hc_mult, cfg.hidden_size,
                           static_cast<float>(cfg.rms_norm_eps), static_cast<float>(cfg.hc_eps),
                           static_cast<int>(cfg.hc_sinkhorn_iters)};
  }

  // Runs every layer; returns the final normed hidden states bf16 [T, D] (arena memory).
  cuda::bf16* hidden(const cuda::Plan& p) {
    using namespace cuda;
    const int64_t T = p.T, S = cfg.hc_mult, D = cfg.hidden_size;
    float* h = arena.alloc<float>(T * S * D);
    float* post = arena.alloc<float>(T * S);
    float* comb = arena.alloc<float>(T * S * S);
    float* mhc_work = arena.alloc<float>(mhc_pre_workspace_floats(T, S, D));
    bf16* a = arena.alloc<bf16>(T * D);
    float* y = arena.alloc<float>(T * D);
    const int64_t max_sel = cfg.index_topk + cfg.index_kpool - 1;
    int32_t* sel = arena.alloc<int32_t>(T * max_sel);
    int32_t* count = arena.alloc<int32_t>(T);
    embed_into(p.tokens, h, T);
    const float eps = static_cast<float>(cfg.rms_norm_eps);
    // A site's post-mix, with the next site's projection where there is one (mhc_post_fusion: one kernel), whose
    // partials the next site's pre-mix then takes from mhc_work.
    const bool fuse = mhc_post_fusion();
    bool projected = false;
    auto pre_mix = [&](const MhcParams& mp) {
      if (projected) {
        mhc_pre_apply(mp, h, post, comb, a, mhc_work, stream);
      } else {
        cuda::mhc_pre(mp, h, post, comb, a, mhc_work, stream);
      }
      projected = false;
    };
    auto post_mix = [&](const MhcParams* next) {
      if (next && fuse) {
        if (mhc_post_project(h, h, y, post, comb, *next, mhc_work, stream)) note_mhc_fused_post();
        projected = true;
      } else {
        mhc_post(h, y, post, comb, T, S, D, stream);
      }
    };
    for (size_t i = 0; i < layers.size(); ++i) {
      cur_layer = i;
      const DLayer& L = layers[i];
      mark_begin("mhc");
      pre_mix(mhc_params(L, false, T));
      mark_end("mhc");
      mark_begin(L.kda_layer ? "kda layer" : "dsa layer");
      if (L.kda_layer) {
        kda(L.kda, p, a, y);
      } else {
        dsa(L.dsa, p, a, sel, count, max_sel, y);
      }
      all_reduce(tp_comm, y, T * D);  // each rank's heads through its o_proj columns
      mark_end(L.kda_layer ? "kda layer" : "dsa layer");
      mark_begin("mhc");
      const MhcParams ffn_mix = mhc_params(L, true, T);
      post_mix(&ffn_mix);
      pre_mix(ffn_mix);
      mark_end("mhc");
      mark_begin(L.moe_layer ? "moe" : "dense mlp");
      if (L.moe_layer) {
        moe(L.moe, a, T, y);
      } else {
        mlp(L.mlp, a, T, y);
        all_reduce(tp_comm, y, T * D);
      }
      mark_end(L.moe_layer ? "moe" : "dense mlp");
      mark_begin("mhc");
      if (i + 1 < layers.size()) {
        const MhcParams next = mhc_params(layers[i + 1], false, T);
        post_mix(&next);
      } else {
        post_mix(nullptr);
      }
      mark_end("mhc");
    }
    bf16* hn = arena.alloc<bf16>(T * D);
    stream_mean_norm(h, final_norm, hn, T, S, D, eps, stream);
    return hn;
  }

  // ---- Decoding (CudaDecoder): one token for each of B slots through the decoding kernels, every reduction in an
  // order fixed by the shapes (src/cuda/decode_kernels.h). The GEMMs are decode_linear (or, batch-invariant, the
  // forward's own GEMM), not cuBLASLt, whose algorithm may change with B.

  // A decoding step's projection: the decoding GEMV, or in batch-invariant mode the forward's own GEMM, whose rows do
  // not depend on the batch either: a step then computes for its token bit for bit what a forward over the whole
  // sequence computes for it.
  void lin(const cuda::bf16* x, int64_t ldx, const cuda::bf16* W, int64_t out, int64_t in, float* y, int64_t ldy,
           int64_t B) {
    if (gemm->batch_invariant()) {
      gemm->run(x, ldx, W, out, in, y, ldy, B);
    } else {
      cuda::decode_linear(x, ldx, W, out, in, y, ldy, B, false, stream);
    }
  }

  // Several of a step's projections at once (decode_linear_multi: one launch, the same bits as one lin() each).
  void lin_multi(std::initializer_list<cuda::LinearSeg> segs, int64_t B) {
    if (gemm->batch_invariant()) {
      for (const cuda::LinearSeg& sg : segs) gemm->run(sg.x, sg.ldx, sg.W, sg.out, sg.in, sg.y, sg.ldy, B);
    } else {
      cuda::decode_linear_multi(segs, B, stream);
    }
  }

  void mlp_step(const cuda::DMlp& m, const cuda::bf16* a, int64_t B, float* y) {
    float* gu = arena.alloc<float>(B * 2 * m.I);
    lin(a, cfg.hidden_size, m.gate_up.w, 2 * m.I, cfg.hidden_size, gu, 2 * m.I, B);
    mlp_step_down(m, gu, B, y);
  }

  // The MLP's clamped SwiGLU and down projection from its gate|up projections gu [B, 2·I].
  void mlp_step_down(const cuda::DMlp& m, const float* gu, int64_t B, float* y) {
    const int64_t D = cfg.hidden_size;
    cuda::bf16* act = arena.alloc<cuda::bf16>(B * m.I);
    cuda::swiglu(gu, act, B, m.I, static_cast<float>(cfg.swiglu_limit), stream);
    lin(act, m.I, m.down.w, D, m.I, y, D, B);
  }

  // Every (token, choice) gets its own row through its expert's matrices; moe_combine then sums each token's rows in
  // choice order.
  void moe_step(size_t layer, const cuda::bf16* a, int64_t B, float* y) { moe(layers[layer].moe, a, B, y, true); }

  // Whether the KDA runs on the tensor-core kernels (which decide how CudaDecoder keeps its KDA caches).
  bool kda_tc_path() const {
    return kda_tensor_cores && cuda::kda_tc_supported(cfg.linear_head_dim, cfg.linear_lower_bound.has_value(),
                                                      static_cast<float>(cfg.linear_lower_bound.value_or(0.0)));
  }

  // Whether a kept KDA site's forward keeps its chunk states under the recompute policy p (set_kda_keep_states on,
  // the tensor-core path, a head dim the chunked backward takes, a KDA layer, and p keeping the states).
  bool kda_keeps_states(const RecomputePolicy& p) const {
    const bool kda = std::any_of(layers.begin(), layers.end(), [](const cuda::DLayer& L) { return L.kda_layer; });
    return kda_keep_states && !p.recomputes_states() && kda_tc_path() &&
           cuda::kda_chunked_backward_supported(cfg.linear_head_dim) && kda;
  }

  struct StepRows {
    int64_t B;
    const int32_t *slot, *pos;  // [B]
    int64_t max_len, max_pools, max_selectable;
  };

  void kda_step(const cuda::DKda& w, const cuda::LayerCache& c, const cuda::bf16* a, const StepRows& r, float* y) {
    using namespace cuda;
    const int64_t B = r.B, D = cfg.hidden_size, H = cfg.linear_num_heads, K = cfg.linear_head_dim, HK = H * K,
                  W = cfg.linear_conv_kernel_dim;
    const bool has_bound = cfg.linear_lower_bound.has_value();
    const float bound = static_cast<float>(cfg.linear_lower_bound.value_or(0.0));
    const float eps = static_cast<float>(cfg.rms_norm_eps);
    // The projections of a: q|k|v, f_a, b and g_a in one launch; f_a and g_a side by side, so that one conversion
    // rounds both to bf16 for f_b and g_b, the second launch.
    float* raw = arena.alloc<float>(B * 3 * HK);
    float* fga = arena.alloc<float>(2 * B * K);
    float *fa = fga, *ga = fga + B * K;
    float* beta = arena.alloc<float>(B * H);
    lin_multi({{a, D, w.qkv.w, 3 * HK, D, raw, 3 * HK},
               {a, D, w.f_a.w, K, D, fa, K},
               {a, D, w.b.w, H, D, beta, H},
               {a, D, w.g_a.w, K, D, ga, K}},
              B);
    bf16* fga16 = arena.alloc<bf16>(2 * B * K);
    to_bf16(fga, fga16, 2 * B * K, stream);
    float* g = arena.alloc<float>(B * HK);
    float* gate = arena.alloc<float>(B * HK);
    lin_multi({{fga16, K, w.f_b.w, HK, K, g, HK}, {fga16 + B * K, K, w.g_b.w, HK, K, gate, HK}}, B);
    bf16* o16 = arena.alloc<bf16>(B * HK);
    mark_begin("kda core");
    if (kda_tc_path()) {
      // The new token joins its slot's partial chunk, and its row is computed as the forward's kernels compute it
      // (a complete chunk moves the slot's state on), β's sigmoid and the gated norm included: the forward's output
      // for the token, bit for bit.
      kda_tc_step(KdaTcStepParams{raw, w.conv, g, beta, c.conv_hist, W, c.chunk_q, c.chunk_k, c.chunk_v, c.chunk_g,
                                  c.chunk_beta, w.dt_bias, w.A_log, bound, r.slot, r.pos, c.state, c.chunk_rows, o16,
                                  gate, w.o_norm, eps, B, H, K},
                  stream);
    } else {
      // The fp32 recurrence on the slot's state after its last token.
      sigmoid_inplace(beta, B * H, stream);
      float* o = arena.alloc<float>(B * HK);
      kda_decode_step(KdaDecodeParams{raw, w.conv, g, w.dt_bias, w.A_log, beta, r.slot, c.conv_hist, c.state, o, B,
                                      H, K, W, has_bound, bound},
                      stream);
      kda_out_norm(o, gate, w.o_norm, o16, B, H, K, eps, stream);
    }
    mark_end("kda core");
    lin(o16, HK, w.o.w, D, HK, y, D, B);
  }

  void dsa_step(const cuda::DDsa& w, const cuda::LayerCache& c, const cuda::bf16* a, const StepRows& r, int32_t* sel,
                int32_t* count, int64_t max_sel, float* y) {
    using namespace cuda;
    const int64_t B = r.B, D = cfg.hidden_size, NH = cfg.num_attention_heads, dqk = cfg.qk_nope_head_dim,
                  dv = cfg.v_head_dim, QL = cfg.q_lora_rank, KL = cfg.kv_lora_rank;
    const float eps = static_cast<float>(cfg.rms_norm_eps);
    const int64_t IH = cfg.index_n_heads, ID = cfg.index_head_dim;
    float* qa = arena.alloc<float>(B * QL);
    bf16* qr = arena.alloc<bf16>(B * QL);
    float* q = arena.alloc<float>(B * NH * dqk);
    float* lat = arena.alloc<float>(B * KL);
    bf16* lat16 = arena.alloc<bf16>(B * KL);
    float *qi = nullptr, *ki = nullptr, *gs = nullptr, *wts = nullptr;
    // The projections of a in one launch (the indexer's too), then those of qr in another.
    if (w.has_indexer) {
      qi = arena.alloc<float>(B * IH * ID);
      ki = arena.alloc<float>(B * ID);
      gs = arena.alloc<float>(B * ID);
      wts = arena.alloc<float>(B * IH);
      lin_multi({{a, D, w.q_a.w, QL, D, qa, QL},
                 {a, D, w.kv_a.w, KL, D, lat, KL},
                 {a, D, w.idx.wk.w, ID, D, ki, ID},
                 {a, D, w.idx.gate.w, ID, D, gs, ID},
                 {a, D, w.idx.weights.w, IH, D, wts, IH}},
                B);
    } else {
      lin_multi({{a, D, w.q_a.w, QL, D, qa, QL}, {a, D, w.kv_a.w, KL, D, lat, KL}}, B);
    }
    float* scores = w.has_indexer ? arena.alloc<float>(B * r.max_pools) : nullptr;
    const IndexerDecodeParams ip{qi, ki, gs, wts, w.idx.ape, r.slot, r.pos, c.pending_key, c.pending_gate, c.pool_key,
                                 scores, B, IH, ID, cfg.index_kpool, cfg.index_topk, r.max_pools, r.max_selectable,
                                 cfg.index_kpool_always_select_tail};
    bf16* o = arena.alloc<bf16>(B * NH * dv);
    const MlaDecodeParams mp{q, w.kv_b.w, c.latent, r.slot, r.pos, sel, count, o, B, NH, dqk, dv, KL, r.max_len,
                             max_sel, arena.alloc<float>(mla_decode_workspace_floats(B, NH, KL))};
    // The latent's and the indexer key's appends need only the first projections: with overlap() they run beside
    // q's norm and projection, and the queries' absorption into the latent space beside the indexer's selection.
    const bool beside = overlap();
    const auto appends = [&] {
      rmsnorm_rows(lat, KL, w.kv_a_norm, lat16, nullptr, B, KL, eps, stream);
      mla_decode_append(lat16, r.slot, r.pos, c.latent, B, KL, r.max_len, stream);
      if (w.has_indexer) {
        layernorm_rows(ki, w.idx.k_norm_w, w.idx.k_norm_b, B, ID, 1e-6f, stream);
        indexer_decode_append(ip, stream);
      }
    };
    if (beside) run_beside(0, appends);
    rmsnorm_rows(qa, QL, w.q_a_norm, qr, nullptr, B, QL, eps, stream);
    if (w.has_indexer) {
      lin_multi({{qr, QL, w.q_b.w, NH * dqk, QL, q, NH * dqk}, {qr, QL, w.idx.wq_b.w, IH * ID, QL, qi, IH * ID}}, B);
    } else {
      lin(qr, QL, w.q_b.w, NH * dqk, QL, q, NH * dqk, B);
    }
    if (beside) {
      run_beside(1, [&] { mla_decode_absorb(mp, stream); });
      join(0);
    } else {
      appends();
    }
    if (w.has_indexer) {
      mark_begin("indexer select");
      indexer_decode_select(ip, sel, count, max_sel, stream);
      mark_end("indexer select");
    }
    mark_begin("mla attention");
    if (beside) {
      join(1);
    } else {
      mla_decode_absorb(mp, stream);
    }
    mla_decode_attend(mp, stream);
    mark_end("mla attention");
    lin(o, NH * dv, w.o.w, D, NH * dv, y, D, B);
  }

  // One decoding step: tokens tok [B] appended to slots r.slot at positions r.pos; returns the logits fp32 [B, V]
  // (arena memory).
  float* decode_step(const std::vector<cuda::LayerCache>& caches, const int32_t* tok, const StepRows& r) {
    using namespace cuda;
    const int64_t B = r.B, S = cfg.hc_mult, D = cfg.hidden_size, V = cfg.vocab_size;
    float* h = arena.alloc<float>(B * S * D);
    float* post = arena.alloc<float>(B * S);
    float* comb = arena.alloc<float>(B * S * S);
    float* mhc_work = arena.alloc<float>(mhc_pre_workspace_floats(B, S, D));
    bf16* a = arena.alloc<bf16>(B * D);
    float* y = arena.alloc<float>(B * D);
    const int64_t max_sel = cfg.index_topk + cfg.index_kpool - 1;
    int32_t* sel = arena.alloc<int32_t>(B * max_sel);
    int32_t* count = arena.alloc<int32_t>(B);
    embed_streams(tok, embed, h, B, S, D, stream);
    for (size_t i = 0; i < layers.size(); ++i) {
      const DLayer& L = layers[i];
      mark_begin("mhc");
      cuda::mhc_pre(mhc_params(L, false, B), h, post, comb, a, mhc_work, stream);
      mark_end("mhc");
      mark_begin(L.kda_layer ? "kda layer" : "dsa layer");
      if (L.kda_layer) {
        kda_step(L.kda, caches[i], a, r, y);
      } else {
        dsa_step(L.dsa, caches[i], a, r, sel, count, max_sel, y);
      }
      mark_end(L.kda_layer ? "kda layer" : "dsa layer");
      mark_begin("mhc");
      mhc_post(h, y, post, comb, B, S, D, stream);
      cuda::mhc_pre(mhc_params(L, true, B), h, post, comb, a, mhc_work, stream);
      mark_end("mhc");
      mark_begin(L.moe_layer ? "moe" : "dense mlp");
      if (L.moe_layer) {
        moe_step(i, a, B, y);
      } else {
        mlp_step(L.mlp, a, B, y);
      }
      mark_end(L.moe_layer ? "moe" : "dense mlp");
      mark_begin("mhc");
      mhc_post(h, y, post, comb, B, S, D, stream);
      mark_end("mhc");
    }
    mark_begin("lm_head");
    bf16* hn = arena.alloc<bf16>(B * D);
    stream_mean_norm(h, final_norm, hn, B, S, D, static_cast<float>(cfg.rms_norm_eps), stream);
    float* logits = arena.alloc<float>(B * V);
    lin(hn, D, lm_head, V, D, logits, V, B);
    mark_end("lm_head");
    return logits;
  }

  // layered: the caller waits for a pending LoRA update layer by layer (the training step's forward).
  void start(const PackedBatch& b, bool layered = false) {
    if (!layered) join_lora_update();
    check(!sharded() || ((shard.tp == 1 || tp_comm) && (shard.ep == 1 || ep_comm)),
          "a tensor- or expert-parallel CudaModel needs its groups (set_collectives)");
    arena.reset();
    accum.clear();
    NEXTLM_CUDA_CHECK(cudaEventRecord(fwd_begin, stream));
  }
  // Marks the end of the device work of a forward (before its results are copied back).
  void end_timing() { NEXTLM_CUDA_CHECK(cudaEventRecord(fwd_end, stream)); }
  void finish_profile() {
    prof.assign(accum.begin(), accum.end());
    NEXTLM_CUDA_CHECK(cudaEventSynchronize(fwd_end));
    float ms = 0.0f;
    NEXTLM_CUDA_CHECK(cudaEventElapsedTime(&ms, fwd_begin, fwd_end));
    last_ms = ms;
  }
};

}  // namespace nextlm
