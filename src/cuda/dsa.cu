// DSA on the GPU: k-pool compression, pool scoring with deterministic top-k selection (ties to the lower pool, as
// the CPU path), and softmax attention over the selected keys. Matches src/model/dsa.cpp.
#include <algorithm>

#include "cuda/kernels.h"

namespace nextlm::cuda {

namespace {

// One block per complete pool: per channel a softmax over the pool's tokens of gate score + position bias weighs
// the LayerNormed keys. pool_token[j] is the pool's first token.
__global__ void pool_keys_kernel(IndexerParams p, const int32_t* pool_token, float* pk) {
  const int64_t j = blockIdx.x, t0 = pool_token[j];
  for (int64_t c = threadIdx.x; c < p.ID; c += blockDim.x) {
    float mx = -INFINITY;
    for (int64_t i = 0; i < p.P; ++i) mx = fmaxf(mx, p.gs[(t0 + i) * p.ID + c] + p.ape[i * p.ID + c]);
    float den = 0.0f, num = 0.0f;
    for (int64_t i = 0; i < p.P; ++i) {
      const float e = expf(p.gs[(t0 + i) * p.ID + c] + p.ape[i * p.ID + c] - mx);
      den += e;
      num += e * p.ki[(t0 + i) * p.ID + c];
    }
    pk[j * p.ID + c] = num / den;
  }
}

// Floats ordered as unsigned integers (larger float ⇔ larger key).
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// ---- Pool scores ----
//
// score(t, j) = Σ_h (w_h(t)·IH^-1/2)·ReLU(ID^-1/2·q_h(t)·pk_j) in fp32, summed in the order of a warp that holds
// channels lane, lane+32, … of each dot product and adds its lanes by a butterfly (decode.cu's
// indexer_scores_kernel, the previous forward kernel): lane l accumulates its channels in order with fma, the 32
// lane sums meet in the butterfly's fixed binary tree, and the heads add in order. So a score depends only on
// (q(t), pk_j, w(t)): not on the batch, the tile or the chunk, and decoding sees the same bits.
//
// A block scores kScoreBQ consecutive tokens against kScoreBJ pools of their sequence: the pool-key tile stays in
// shared memory for all IH heads; the heads' query tiles stream through a double buffer (cp.async); each thread holds
// a 4 × 4 register tile of (token, pool) pairs. Channels are stored lane-major (smem column l·KC + k holds channel
// l + 32k, KC = ⌈ID/32⌉ rounded to 1, 2 or 4, zero padded), so one vector load gives a lane's channels.
constexpr int kScoreBQ = 32, kScoreBJ = 64, kScoreThreads = 128, kScoreRT = 4, kScoreRJ = 4;
static_assert(kScoreBQ == 8 * kScoreRT && kScoreBJ == 16 * kScoreRJ && kScoreThreads == 8 * 16, "score tiling");
// Score workspace ceiling: longer prompts are scored and selected in chunks of tokens.
constexpr int64_t kScoreFloats = int64_t{1} << 25;

template <int KC>
constexpr int score_stride() {
  return 33 * KC;  // one padding vector per row: the 16 pool rows a warp reads hit distinct banks
}

template <int KC>
size_t score_smem(int64_t IH) {
  return (static_cast<size_t>(kScoreBJ + 2 * kScoreBQ) * score_stride<KC>() + kScoreBQ * IH) * sizeof(float);
}

__host__ __device__ constexpr int bit_reverse5(int r) {
  return ((r & 1) << 4) | ((r & 2) << 2) | (r & 4) | ((r & 8) >> 2) | ((r & 16) >> 4);
}

template <int KC>
__device__ __forceinline__ void load_lane(const float* s, float (&v)[KC]) {
  if constexpr (KC == 4) {
    const float4 x = *reinterpret_cast<const float4*>(s);
    v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
  } else if constexpr (KC == 2) {
    const float2 x = *reinterpret_cast<const float2*>(s);
    v[0] = x.x, v[1] = x.y;
  } else {
    v[0] = s[0];
  }
}

// The butterfly's tree over lanes: leaves in bit-reversed lane order make it a plain pairwise tree (its first level
// adds lanes l and l+16, its last the even and the odd half). `out` gets the subtree of leaves R0 … R0 + 2^LEVEL − 1.
// q: the thread's first token row; k: its first pool row. Rows of a thread are 8 (tokens) and 16 (pools) apart.
template <int KC, int R0, int LEVEL>
struct DotTree {
  static __device__ __forceinline__ void run(const float* q, const float* k, float (&out)[kScoreRT][kScoreRJ]) {
    constexpr int S = score_stride<KC>();
    if constexpr (LEVEL == 0) {
      constexpr int l = bit_reverse5(R0);
      float qv[kScoreRT][KC], kv[kScoreRJ][KC];
#pragma unroll
      for (int a = 0; a < kScoreRT; ++a) load_lane<KC>(q + a * 8 * S + l * KC, qv[a]);
#pragma unroll
      for (int b = 0; b < kScoreRJ; ++b) load_lane<KC>(k + b * 16 * S + l * KC, kv[b]);
#pragma unroll
      for (int a = 0; a < kScoreRT; ++a)
#pragma unroll
        for (int b = 0; b < kScoreRJ; ++b) {
          float d = 0.0f;
#pragma unroll
          for (int c = 0; c < KC; ++c) d = fmaf(qv[a][c], kv[b][c], d);
          out[a][b] = d;
        }
    } else {
      float lo[kScoreRT][kScoreRJ], hi[kScoreRT][kScoreRJ];
      DotTree<KC, R0, LEVEL - 1>::run(q, k, lo);
      DotTree<KC, R0 + (1 << (LEVEL - 1)), LEVEL - 1>::run(q, k, hi);
#pragma unroll
      for (int a = 0; a < kScoreRT; ++a)
#pragma unroll
        for (int b = 0; b < kScoreRJ; ++b) out[a][b] = lo[a][b] + hi[a][b];
    }
  }
};

__device__ __forceinline__ void cp_async4(float* dst, const float* src, bool valid) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 4 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Scores of the tile's tokens first … last−1 (one sequence starting at s0, tile rows from t0) against its pools
// j0 … j0+jn−1, into scores [·, max_pools] rows t − tb. Called by the whole block.
template <int KC>
__device__ void score_tile(const IndexerParams& p, const float* pkb, float* scores, float* sm, int64_t tb, int64_t t0,
                           int64_t first, int64_t last, int64_t s0, int64_t j0, int64_t jn) {
  constexpr int S = score_stride<KC>(), W = 32 * KC;
  float* ks = sm;                     // [kScoreBJ, S] pool keys
  float* qs = ks + kScoreBJ * S;      // [2, kScoreBQ, S] queries of one head
  float* ws = qs + 2 * kScoreBQ * S;  // [kScoreBQ, IH] head weights times IH^-1/2
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int IH = static_cast<int>(p.IH), ID = static_cast<int>(p.ID);
  const float sscale = rsqrtf(static_cast<float>(ID)), wscale = rsqrtf(static_cast<float>(IH));
  for (int i = tid; i < kScoreBJ * W; i += kScoreThreads) {
    const int jj = i / W, c = i % W;
    ks[jj * S + (c % 32) * KC + c / 32] = jj < jn && c < ID ? pkb[(j0 + jj) * ID + c] : 0.0f;
  }
  for (int i = tid; i < kScoreBQ * IH; i += kScoreThreads) {
    const int64_t t = t0 + i / IH;
    ws[i] = t >= first && t < last ? p.wts[t * IH + i % IH] * wscale : 0.0f;
  }
  auto stage = [&](int64_t h, float* dst) {
    for (int i = tid; i < kScoreBQ * W; i += kScoreThreads) {
      const int r = i / W, c = i % W;
      const int64_t t = t0 + r;
      const bool valid = t >= first && t < last && c < ID;
      cp_async4(dst + r * S + (c % 32) * KC + c / 32, valid ? p.qi + (t * IH + h) * ID + c : p.qi, valid);
    }
    cp_async_commit();
  };
  stage(0, qs);
  float acc[kScoreRT][kScoreRJ] = {};
  for (int64_t h = 0; h < IH; ++h) {
    if (h + 1 < IH) {
      stage(h + 1, qs + ((h + 1) & 1) * kScoreBQ * S);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    float dot[kScoreRT][kScoreRJ];
    DotTree<KC, 0, 5>::run(qs + (h & 1) * kScoreBQ * S + ty * S, ks + tx * S, dot);
#pragma unroll
    for (int a = 0; a < kScoreRT; ++a) {
      const float w = ws[(ty + 8 * a) * IH + h];
#pragma unroll
      for (int b = 0; b < kScoreRJ; ++b) acc[a][b] = fmaf(w, fmaxf(dot[a][b] * sscale, 0.0f), acc[a][b]);
    }
    __syncthreads();  // the buffer is restaged two heads on, the tiles by the next segment
  }
#pragma unroll
  for (int a = 0; a < kScoreRT; ++a) {
    const int64_t t = t0 + ty + 8 * a;
    if (t < first || t >= last) continue;
    const int64_t selectable = (t - s0 + 1) / p.P;
#pragma unroll
    for (int b = 0; b < kScoreRJ; ++b) {
      const int64_t j = j0 + tx + 16 * b;
      if (j < selectable) scores[(t - tb) * p.max_pools + j] = acc[a][b];
    }
  }
}

// Grid (pool tiles, token tiles of tokens tb … te−1). A tile spanning sequence starts is done a sequence at a time;
// only tokens that choose (more selectable pools than the budget) and their selectable pools are scored.
template <int KC>
__global__ void __launch_bounds__(kScoreThreads, 3)
    score_kernel(IndexerParams p, const int32_t* pool_base, const float* pk, float* scores, int64_t tb, int64_t te) {
  extern __shared__ float sm[];
  const int64_t t0 = tb + static_cast<int64_t>(blockIdx.y) * kScoreBQ, tend = min(t0 + kScoreBQ, te);
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kScoreBJ;
  for (int64_t seg = t0; seg < tend;) {
    const int64_t s0 = p.seq_start[seg], len = p.seq_len[seg], last = min(tend, s0 + len);
    const int64_t budget = min(p.topk / p.P, len / p.P);
    const int64_t most = (last - s0) / p.P;  // selectable pools of the segment's last token, the most it has
    if (most > budget && j0 < most) {
      const int64_t first = max(seg, s0 + (budget + 1) * p.P - 1);  // the first token that chooses
      const float* pkb = pk + static_cast<int64_t>(pool_base[seg]) * p.ID;
      score_tile<KC>(p, pkb, scores, sm, tb, t0, first, last, s0, j0, min(static_cast<int64_t>(kScoreBJ), most - j0));
    }
    seg = last;
  }
}

// ---- Selection ----

constexpr int kSelectThreads = 256;
static_assert(kSelectThreads == 256, "one radix bin per thread");

// Exclusive count of `flag` over the threads before this one, and the block's total. Called by the whole block;
// `part` holds one int per warp.
__device__ __forceinline__ int block_count(bool flag, int* part, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t ballot = __ballot_sync(0xffffffffu, flag);
  if (lane == 0) part[warp] = __popc(ballot);
  __syncthreads();
  int before = __popc(ballot & ((1u << lane) - 1u)), sum = 0;
  for (int w = 0; w < kSelectThreads / 32; ++w) {
    before += w < warp ? part[w] : 0;
    sum += part[w];
  }
  __syncthreads();
  total = sum;
  return before;
}

// Inclusive sum over threads 0 … this one. Called by the whole block; `part` holds one int per warp.
__device__ __forceinline__ int block_inclusive_sum(int v, int* part) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 1; o < 32; o <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += u;
  }
  if (lane == 31) part[warp] = v;
  __syncthreads();
  for (int w = 0; w < warp; ++w) v += part[w];
  __syncthreads();
  return v;
}

// One block per token of tb … te−1. Every selectable pool when they fit the budget; else the budget-th largest
// score κ by a radix select on 8-bit digits (shared-memory histograms), and the pools above κ with the lowest-indexed
// ones equal to κ (ties to the lower pool, as the CPU's sort), written in ascending order through block-wide counts.
// Then the tail.
__global__ void __launch_bounds__(kSelectThreads)
    select_kernel(IndexerParams p, const float* scores, int64_t tb, int32_t* sel, int32_t* count, int64_t max_sel) {
  __shared__ int hist[256], part[kSelectThreads / 32];
  __shared__ int found_digit, found_above;
  const int tid = threadIdx.x, lane = tid & 31;
  const int64_t t = tb + blockIdx.x;
  const int64_t rel = t - p.seq_start[t], len = p.seq_len[t];
  const int64_t selectable = (rel + 1) / p.P, budget = min(p.topk / p.P, len / p.P);
  const int64_t tail = p.tail ? rel + 1 - selectable * p.P : 0;
  int32_t* out = sel + t * max_sel;
  if (selectable <= budget) {  // everything: positions 0 … n−1
    const int64_t n = selectable * p.P + tail;
    for (int64_t i = tid; i < n; i += kSelectThreads) out[i] = static_cast<int32_t>(i);
    if (tid == 0) count[t] = static_cast<int32_t>(n);
    return;
  }
  const float* sc = scores + (t - tb) * p.max_pools;
  // κ = the largest key with #(key ≥ κ) ≥ budget, a digit at a time from the top; `need` counts the keys equal to
  // the prefix so far still to be taken.
  uint32_t prefix = 0, mask = 0;
  int64_t need = budget;
  if (budget > 0) {
    for (int shift = 24; shift >= 0; shift -= 8) {
      hist[tid] = 0;
      __syncthreads();
      for (int64_t j0 = 0; j0 < selectable; j0 += kSelectThreads) {
        const int64_t j = j0 + tid;
        const uint32_t key = j < selectable ? order_key(__ldg(sc + j)) : 0u;
        const bool match = j < selectable && (key & mask) == prefix;
        const uint32_t digit = match ? (key >> shift) & 255u : 256u;
        const uint32_t peers = __match_any_sync(0xffffffffu, digit);
        if (match && lane == __ffs(peers) - 1) atomicAdd(&hist[digit], __popc(peers));
      }
      __syncthreads();
      // Thread i holds digit 255 − i: `at_least` counts the matching keys with a digit ≥ it.
      const int here = hist[255 - tid];
      const int at_least = block_inclusive_sum(here, part);
      if (at_least >= need && at_least - here < need) found_digit = 255 - tid, found_above = at_least - here;
      __syncthreads();
      prefix |= static_cast<uint32_t>(found_digit) << shift;
      mask |= 255u << shift;
      need -= found_above;
      __syncthreads();  // found_* and hist are rewritten by the next digit
    }
  } else {
    prefix = 0xffffffffu, need = 0;  // nothing is above the largest key, and no equal one is taken
  }
  int64_t taken = 0, equal = 0;  // before this round of pools
  for (int64_t j0 = 0; j0 < selectable; j0 += kSelectThreads) {
    const int64_t j = j0 + tid;
    const uint32_t key = j < selectable ? order_key(__ldg(sc + j)) : 0u;
    const bool above = j < selectable && key > prefix, eq = j < selectable && key == prefix;
    int n_eq, n_take;
    const int eq_before = block_count(eq, part, n_eq);
    const bool take = above || (eq && equal + eq_before < need);
    const int at = block_count(take, part, n_take);
    if (take)
      for (int64_t i = 0; i < p.P; ++i) out[(taken + at) * p.P + i] = static_cast<int32_t>(j * p.P + i);
    taken += n_take, equal += n_eq;
  }
  for (int64_t i = tid; i < tail; i += kSelectThreads)
    out[budget * p.P + i] = static_cast<int32_t>(selectable * p.P + i);
  if (tid == 0) count[t] = static_cast<int32_t>(budget * p.P + tail);
}

// One block per (token, head): scores over the selected keys in shared memory, softmax, weighted sum of values.
__global__ void attention_kernel(const float* q, const float* kv, const int32_t* sel, const int32_t* count,
                                 const int32_t* seq_start, const int32_t* seq_len, bf16* o, int64_t NH, int64_t dqk,
                                 int64_t dv, int64_t max_sel) {
  extern __shared__ float sm[];  // q [dqk], p [n]
  __shared__ float scratch[32];
  const int64_t t = blockIdx.x, h = blockIdx.y, s0 = seq_start[t];
  const int64_t dkv = dqk + dv;
  const int64_t n = count[t];
  if (n == 0) {  // an all-masked row: equal weights on every key of the sequence (transformers' eager softmax)
    const int64_t len = seq_len[t];
    for (int64_t d = threadIdx.x; d < dv; d += blockDim.x) {
      float acc = 0.0f;
      for (int64_t i = 0; i < len; ++i) acc += kv[((s0 + i) * NH + h) * dkv + dqk + d];
      o[(t * NH + h) * dv + d] = __float2bfloat16(acc / static_cast<float>(len));
    }
    return;
  }
  float* qs = sm;
  float* pr = sm + dqk;
  for (int64_t d = threadIdx.x; d < dqk; d += blockDim.x) qs[d] = q[(t * NH + h) * dqk + d];
  __syncthreads();
  const float scale = rsqrtf(static_cast<float>(dqk));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int64_t i = warp; i < n; i += nw) {
    const int64_t key = s0 + sel[t * max_sel + i];
    float dot = 0.0f;
    for (int64_t d = lane; d < dqk; d += 32) dot += qs[d] * kv[(key * NH + h) * dkv + d];
    dot = warp_sum(dot);
    if (lane == 0) pr[i] = dot * scale;
  }
  __syncthreads();
  float mx = -INFINITY;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) mx = fmaxf(mx, pr[i]);
  mx = warp_max(mx);
  __shared__ float wm[32];
  if (lane == 0) wm[warp] = mx;
  __syncthreads();
  mx = -INFINITY;
  for (int i = 0; i < nw; ++i) mx = fmaxf(mx, wm[i]);
  float s = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += (pr[i] = expf(pr[i] - mx));
  const float den = block_sum(s, scratch);
  __syncthreads();
  for (int64_t d = threadIdx.x; d < dv; d += blockDim.x) {
    float acc = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t key = s0 + sel[t * max_sel + i];
      acc += pr[i] * kv[(key * NH + h) * dkv + dqk + d];
    }
    o[(t * NH + h) * dv + d] = __float2bfloat16(acc / den);
  }
}

}  // namespace

void pool_keys(const IndexerParams& p, const int32_t* pool_token, int64_t num_pools, float* pk, cudaStream_t st) {
  if (num_pools) pool_keys_kernel<<<num_pools, 128, 0, st>>>(p, pool_token, pk);
}

int64_t indexer_score_rows(const IndexerParams& p) {
  const int64_t fit = kScoreFloats / std::max<int64_t>(p.max_pools, 1) / kScoreBQ * kScoreBQ;
  const int64_t rows = std::clamp<int64_t>(fit, kScoreBQ, int64_t{65535} * kScoreBQ);  // grid.y holds the tiles
  return std::max<int64_t>(std::min(rows, p.T), 1);
}

namespace {

template <int KC>
void launch_scores(const IndexerParams& p, const int32_t* pool_base, const float* pk, float* scores, int64_t tb,
                   int64_t te, cudaStream_t st) {
  const size_t smem = score_smem<KC>(p.IH);
  NEXTLM_CUDA_CHECK(
      cudaFuncSetAttribute(score_kernel<KC>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const dim3 grid(static_cast<unsigned>(ceil_div(p.max_pools, kScoreBJ)),
                  static_cast<unsigned>(ceil_div(te - tb, kScoreBQ)));
  score_kernel<KC><<<grid, kScoreThreads, smem, st>>>(p, pool_base, pk, scores, tb, te);
}

}  // namespace

void indexer_select(const IndexerParams& p, const int32_t* pool_base, const float* pk, float* scores, int64_t rows,
                    int32_t* sel, int32_t* count, int64_t max_sel, cudaStream_t st) {
  if (!p.T) return;
  check(p.ID >= 1 && p.ID <= 128, "CUDA indexer: index_head_dim must be at most 128, got ", p.ID);
  check(p.P >= 1 && rows >= 1 && rows <= int64_t{65535} * kScoreBQ, "CUDA indexer: bad pool size or score rows");
  check(max_sel >= std::min(p.topk / p.P, p.max_pools) * p.P + p.P - 1, "CUDA indexer: max_sel ", max_sel,
        " is too small");
  // No sequence has more pools than the budget: every token takes all its pools and nothing is scored.
  const bool any_choose = p.max_pools > p.topk / p.P;
  for (int64_t tb = 0; tb < p.T; tb += rows) {
    const int64_t te = std::min(tb + rows, p.T);
    if (any_choose) {
      const int64_t kc = (p.ID + 31) / 32;
      if (kc == 1)
        launch_scores<1>(p, pool_base, pk, scores, tb, te, st);
      else if (kc == 2)
        launch_scores<2>(p, pool_base, pk, scores, tb, te, st);
      else
        launch_scores<4>(p, pool_base, pk, scores, tb, te, st);
    }
    select_kernel<<<static_cast<unsigned>(te - tb), kSelectThreads, 0, st>>>(p, scores, tb, sel, count, max_sel);
  }
}

void mla_sparse_attention(const float* q, const float* kv, const int32_t* sel, const int32_t* count,
                          const int32_t* seq_start, const int32_t* seq_len, bf16* o, int64_t T, int64_t NH,
                          int64_t dqk, int64_t dv, int64_t max_sel, cudaStream_t st) {
  if (!T) return;
  const size_t smem = (dqk + max_sel) * sizeof(float);
  NEXTLM_CUDA_CHECK(cudaFuncSetAttribute(attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem)));
  attention_kernel<<<dim3(static_cast<unsigned>(T), static_cast<unsigned>(NH)), 128, smem, st>>>(
      q, kv, sel, count, seq_start, seq_len, o, NH, dqk, dv, max_sel);
}

}  // namespace nextlm::cuda
