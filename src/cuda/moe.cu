// MoE on the GPU: sigmoid routing with the correction bias and grouped top-k (ties to the lower expert, as the CPU
// path), row gather for the permuted tokens, the clamped SwiGLU, and a fixed-order weighted combine.
#include <climits>

#include "cuda/kernels.h"

#include <cub/device/device_radix_sort.cuh>

namespace nextlm::cuda {

namespace {

// One warp per token (the routing is a serial scan per token; a thread per token left decoding steps, with a few
// tokens, waiting on one thread's 288-expert top-8 loop). Lane l holds experts l, l+32, …; every choice is the
// largest value with ties to the lowest index, as the CPU path's scans, and the weights are summed in choice order.
constexpr int kRouteMaxPerLane = 16;  // E ≤ 512 (scores a lane holds; PL below, the fewest that cover E)

// The larger of two (value, index) pairs, ties to the lower index, across the warp.
__device__ __forceinline__ void warp_argmax(float& v, int& idx) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
    if (ov > v || (ov == v && oi < idx)) v = ov, idx = oi;
  }
}

// Token t's routing by the calling warp (all its lanes).
template <int PL>
__device__ __forceinline__ void route_token(const float* logits, const float* bias, int32_t* experts, float* weights,
                                            int64_t t, int64_t E, int64_t G, int64_t TG, int64_t k, bool norm,
                                            float scale) {
  const int lane = threadIdx.x & 31;
  const float* lg = logits + t * E;
  // Expert and group indices in 32 bits (E ≤ 512, G ≤ 64): 64-bit divisions are long software sequences.
  const int E32 = static_cast<int>(E), G32 = static_cast<int>(G), EG = E32 / G32;
  // The sigmoid scores sg (the chosen ones become the weights; they stay in the registers of the lane that holds
  // them and reach lane 0 through a shuffle, not a global load per choice) and the biased scores c that choose.
  float sg[PL], c[PL];
  int grp[PL];
#pragma unroll
  for (int j = 0; j < PL; ++j) {
    const int e = lane + 32 * j;
    sg[j] = e < E32 ? 1.0f / (1.0f + expf(-lg[e])) : 0.0f;
    c[j] = e < E32 ? sg[j] + bias[e] : -INFINITY;
    grp[j] = e < E32 ? e / EG : -1;
  }
  // Group scores (sum of the group's top two) and the kept groups (a bitmask over ≤ 64 groups); one group keeps all.
  if (G32 > 1) {
    uint64_t kept = 0;
    for (int64_t r = 0; r < TG; ++r) {
      int best = -1;
      float bs = -INFINITY;
      for (int g = 0; g < G32; ++g) {
        float b1 = -INFINITY, b2 = -INFINITY;
#pragma unroll
        for (int j = 0; j < PL; ++j) {
          if (grp[j] == g) {
            if (c[j] > b1) {
              b2 = b1;
              b1 = c[j];
            } else if (c[j] > b2) {
              b2 = c[j];
            }
          }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {  // merge the lanes' top-two pairs (the pair of values, whatever the order)
          const float o1 = __shfl_xor_sync(0xffffffffu, b1, o), o2 = __shfl_xor_sync(0xffffffffu, b2, o);
          const float n1 = fmaxf(b1, o1), n2 = fmaxf(fminf(b1, o1), fmaxf(b2, o2));
          b1 = n1, b2 = n2;
        }
        if (!(kept >> g & 1) && b1 + b2 > bs) bs = b1 + b2, best = g;
      }
      if (best >= 0) kept |= 1ull << best;  // none: non-finite scores, every expert masked (then expert 0 below)
    }
#pragma unroll
    for (int j = 0; j < PL; ++j)
      if (grp[j] < 0 || !(kept >> grp[j] & 1)) c[j] = -INFINITY;
  }
  // Choice i stays with lane i mod 32 (the second register for i ≥ 32) until the end, when the lanes write their
  // choices at once; every lane adds the chosen weights in choice order for the norm.
  float sum = 0.0f, w0 = 0.0f, w1 = 0.0f;
  int e0 = 0, e1 = 0;
  for (int i = 0; i < static_cast<int>(k); ++i) {
    float v = -INFINITY;
    int idx = INT_MAX;
#pragma unroll
    for (int j = 0; j < PL; ++j)
      if (c[j] > v) v = c[j], idx = lane + 32 * j;
    warp_argmax(v, idx);
    // No candidate left (non-finite scores, from non-finite activations): expert 0, so that the permutation and the
    // expert GEMMs stay in bounds and the non-finite values show in the output instead of an illegal address.
    if (idx == INT_MAX) idx = 0;
    float chosen = 0.0f;
#pragma unroll
    for (int j = 0; j < PL; ++j)
      if (lane + 32 * j == idx) c[j] = -INFINITY, chosen = sg[j];
    chosen = __shfl_sync(0xffffffffu, chosen, idx & 31);
    sum += chosen;
    if (lane == (i & 31)) {
      if (i < 32) {
        w0 = chosen, e0 = idx;
      } else {
        w1 = chosen, e1 = idx;
      }
    }
  }
  auto put = [&](int i, float w, int e) {
    if (norm) w /= sum + 1e-20f;
    experts[t * k + i] = e;
    weights[t * k + i] = w * scale;
  };
  if (lane < k) put(lane, w0, e0);
  if (lane + 32 < k) put(lane + 32, w1, e1);
}

template <int PL>
__global__ void route_kernel(const float* logits, const float* bias, int32_t* experts, float* weights, int64_t T,
                             int64_t E, int64_t G, int64_t TG, int64_t k, bool norm, float scale) {
  const int64_t t = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5;
  if (t >= T) return;  // whole warps
  route_token<PL>(logits, bias, experts, weights, t, E, G, TG, k, norm, scale);
}

// Grid (rows, column blocks): a decoding step's few rows still spread over many blocks. VEC: 16-byte copies (D a
// multiple of 8, both bases 16-byte aligned). STREAM: the copies stored as streaming (evict-first) in L2, so that a
// copy larger than L2 does not evict x, which every row is read from k times.
template <bool VEC, bool STREAM = false>
__global__ void gather_kernel(const bf16* x, const int32_t* token_of_slot, bf16* xp, int64_t D) {
  const int64_t r = blockIdx.x;
  const bf16* src = x + static_cast<int64_t>(token_of_slot[r]) * D;
  const int64_t i = blockIdx.y * int64_t(blockDim.x) + threadIdx.x;
  if constexpr (VEC) {
    if (8 * i < D) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(src) + i);
      if constexpr (STREAM) __stcs(reinterpret_cast<uint4*>(xp + r * D) + i, v);
      else reinterpret_cast<uint4*>(xp + r * D)[i] = v;
    }
  } else {
    if (i < D) xp[r * D + i] = src[i];
  }
}

__global__ void swiglu_kernel(const float* gu, bf16* act, int64_t n, int64_t I, float L) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n * I; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / I, c = i % I;
    const float g = fminf(gu[r * 2 * I + c], L);
    const float u = fminf(fmaxf(gu[r * 2 * I + I + c], -L), L);
    act[i] = __float2bfloat16(g / (1.0f + expf(-g)) * u);
  }
}

// Grid (tokens, column blocks), a thread per column (VEC: 4 columns, D a multiple of 4 and the bases 16-byte
// aligned); each column's sum runs in choice order either way.
template <bool VEC>
__global__ void combine_kernel(float* y, const float* out, const int32_t* slot_of, const float* w, int64_t k, int64_t D,
                               const int32_t* rows_held) {
  const int64_t t = blockIdx.x;
  const int32_t held = rows_held ? *rows_held : INT_MAX;
  const int64_t d = (blockIdx.y * int64_t(blockDim.x) + threadIdx.x) * (VEC ? 4 : 1);
  if (d >= D) return;
  if constexpr (VEC) {
    float4 acc = *reinterpret_cast<const float4*>(y + t * D + d);
    for (int64_t i = 0; i < k; ++i) {
      const int32_t row = slot_of[t * k + i];
      if (row < held) {
        const float wi = w[t * k + i];
        const float4 o = __ldg(reinterpret_cast<const float4*>(out + static_cast<int64_t>(row) * D + d));
        acc.x += wi * o.x, acc.y += wi * o.y, acc.z += wi * o.z, acc.w += wi * o.w;
      }
    }
    *reinterpret_cast<float4*>(y + t * D + d) = acc;
  } else {
    float acc = y[t * D + d];
    for (int64_t i = 0; i < k; ++i) {
      const int32_t row = slot_of[t * k + i];
      if (row < held) acc += w[t * k + i] * out[static_cast<int64_t>(row) * D + d];
    }
    y[t * D + d] = acc;
  }
}

__global__ void localize_kernel(int32_t* experts, int64_t n, int64_t begin, int64_t count) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < n) {
    const int64_t e = static_cast<int64_t>(experts[i]) - begin;
    experts[i] = static_cast<int32_t>(e >= 0 && e < count ? e : count);
  }
}

__global__ void iota_kernel(int32_t* x, int64_t n) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < n) x[i] = static_cast<int32_t>(i);
}

// After the sort: inverse permutation, token of each row, and expert boundaries (row p starts expert e when its key
// differs from the previous row's; experts with no rows get the next boundary).
__global__ void permute_finish_kernel(const int32_t* keys, const int32_t* slots, int64_t n, int64_t k, int64_t E,
                                      int32_t* token_of_slot, int32_t* slot_of, int32_t* offsets) {
  const int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (p > n) return;
  if (p < n) {
    token_of_slot[p] = slots[p] / static_cast<int32_t>(k);
    slot_of[slots[p]] = static_cast<int32_t>(p);
  }
  const int32_t prev = p == 0 ? -1 : keys[p - 1];
  const int32_t cur = p == n ? static_cast<int32_t>(E) : keys[p];
  for (int32_t e = prev + 1; e <= cur; ++e) offsets[e] = static_cast<int32_t>(p);
}

// Up to this many routing slots (a decoding step's B·k), moe_permute runs as one block instead of iota, a radix
// sort and permute_finish.
constexpr int64_t kSmallPermute = 1024;
// moe_route_permute_small: at most this many tokens (a warp each of one block's 32), and rows copied in the same
// block up to this many bytes.
constexpr int64_t kRouteSmallTokens = 32, kRouteSmallGatherBytes = 128 * 1024;

// The shapes route_token handles (a lane's scores in registers, group and choice masks in 64 bits).
void check_routing(int64_t E, int64_t G, int64_t k) {
  check(G <= 64 && k <= 64 && E <= 32 * kRouteMaxPerLane,
        "CUDA MoE: at most 64 groups, 64 experts per token and 512 experts");
}

// The stable sort by rank of n ≤ kSmallPermute slots by the whole block (1024 threads; key: shared scratch of
// kSmallPermute). Row p of slot i is #{j : key_j < key_i} + #{j < i : key_j = key_i}, exactly where the stable radix
// sort puts it, and offsets[e] = #{j : key_j < e}.
__device__ __forceinline__ void small_permute_block(const int32_t* experts, int64_t n, int64_t k, int64_t E,
                                                    int32_t* keys_sorted, int32_t* slots_sorted,
                                                    int32_t* token_of_slot, int32_t* slot_of, int32_t* offsets,
                                                    int32_t* key) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) key[i] = experts[i];
  __syncthreads();
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int32_t ki = key[i];
    int32_t p = 0;
    for (int64_t j = 0; j < n; ++j) p += key[j] < ki || (key[j] == ki && j < i);
    keys_sorted[p] = ki;
    slots_sorted[p] = static_cast<int32_t>(i);
    token_of_slot[p] = static_cast<int32_t>(i / k);
    slot_of[i] = p;
  }
  for (int64_t e = threadIdx.x; e <= E; e += blockDim.x) {
    int32_t below = 0;
    for (int64_t j = 0; j < n; ++j) below += key[j] < e;
    offsets[e] = below;
  }
}

__global__ void __launch_bounds__(1024) small_permute_kernel(const int32_t* experts, int64_t n, int64_t k, int64_t E,
                                                             int32_t* keys_sorted, int32_t* slots_sorted,
                                                             int32_t* token_of_slot, int32_t* slot_of,
                                                             int32_t* offsets) {
  __shared__ int32_t key[kSmallPermute];
  small_permute_block(experts, n, k, E, keys_sorted, slots_sorted, token_of_slot, slot_of, offsets, key);
}

// A decoding step's few tokens in one block (1024 threads): each warp routes tokens (route_token), then the block
// sorts the slots (small_permute_block) and, with xp, gathers the permuted rows (16-byte copies); the same device
// code as route_kernel and small_permute_kernel and gather_kernel's 16-byte copies, so the same bits, in one launch
// instead of three.
template <int PL>
__global__ void __launch_bounds__(1024)
    route_permute_small_kernel(const float* logits, const float* bias, int32_t* experts, float* weights, int64_t T,
                               int64_t E, int64_t G, int64_t TG, int64_t k, bool norm, float scale,
                               int32_t* keys_sorted, int32_t* slots_sorted, int32_t* token_of_slot, int32_t* slot_of,
                               int32_t* offsets, const bf16* x, bf16* xp, int64_t D) {
  __shared__ int32_t key[kSmallPermute];
  for (int64_t t = threadIdx.x >> 5; t < T; t += blockDim.x >> 5)
    route_token<PL>(logits, bias, experts, weights, t, E, G, TG, k, norm, scale);
  __syncthreads();  // experts (global) written by the block's warps, now read by all of it
  small_permute_block(experts, T * k, k, E, keys_sorted, slots_sorted, token_of_slot, slot_of, offsets, key);
  if (!xp) return;
  __syncthreads();  // token_of_slot likewise
  const int64_t per_row = D / 8;
  for (int64_t i = threadIdx.x; i < T * k * per_row; i += blockDim.x) {
    const int64_t r = i / per_row, c = i % per_row;
    reinterpret_cast<uint4*>(xp + r * D)[c] =
        __ldg(reinterpret_cast<const uint4*>(x + static_cast<int64_t>(token_of_slot[r]) * D) + c);
  }
}

}  // namespace

size_t moe_permute_temp_bytes(int64_t n) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
                                  static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
                                  static_cast<int>(n));
  return bytes;
}

void moe_permute(const int32_t* experts, int64_t T, int64_t k, int64_t E, int32_t* keys_sorted, int32_t* slots_in,
                 int32_t* slots_sorted, int32_t* token_of_slot, int32_t* slot_of, int32_t* offsets, void* temp,
                 size_t temp_bytes, cudaStream_t st) {
  const int64_t n = T * k;
  if (!n) return;
  if (n <= kSmallPermute) {
    small_permute_kernel<<<1, 1024, 0, st>>>(experts, n, k, E, keys_sorted, slots_sorted, token_of_slot, slot_of,
                                             offsets);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
    return;
  }
  iota_kernel<<<ceil_div(n, 256), 256, 0, st>>>(slots_in, n);
  int end_bit = 1;
  while ((int64_t{1} << end_bit) <= E) ++end_bit;
  NEXTLM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, experts, keys_sorted, slots_in, slots_sorted,
                                                    static_cast<int>(n), 0, end_bit, st));
  permute_finish_kernel<<<ceil_div(n + 1, 256), 256, 0, st>>>(keys_sorted, slots_sorted, n, k, E, token_of_slot,
                                                              slot_of, offsets);
}

void moe_route(const float* logits, const float* bias, int32_t* experts, float* weights, int64_t T, int64_t E,
               int64_t G, int64_t topk_group, int64_t k, bool norm, float scale, cudaStream_t st) {
  check_routing(E, G, k);
  if (!T) return;
  const unsigned grid = static_cast<unsigned>(ceil_div(T * 32, 256));
  // A lane's scores in registers: as few as cover E (288 experts: 9), the same choices whatever the count.
  if (E <= 32 * 9) {
    route_kernel<9><<<grid, 256, 0, st>>>(logits, bias, experts, weights, T, E, G, topk_group, k, norm, scale);
  } else {
    route_kernel<kRouteMaxPerLane><<<grid, 256, 0, st>>>(logits, bias, experts, weights, T, E, G, topk_group, k, norm,
                                                         scale);
  }
}

bool moe_route_permute_small(const float* logits, const float* bias, int32_t* experts, float* weights, int64_t T,
                             int64_t E, int64_t G, int64_t topk_group, int64_t k, bool norm, float scale,
                             int32_t* keys_sorted, int32_t* slots_sorted, int32_t* token_of_slot, int32_t* slot_of,
                             int32_t* offsets, const bf16* x, bf16* xp, int64_t D, cudaStream_t st) {
  check_routing(E, G, k);
  const int64_t n = T * k;
  if (!T || T > kRouteSmallTokens || n > kSmallPermute) return false;
  // The rows are copied by this one block only while they are few (a separate gather spreads them over many).
  const bool gather = n * D * int64_t(sizeof(bf16)) <= kRouteSmallGatherBytes && D % 8 == 0 && is_aligned16(x) &&
                      is_aligned16(xp);
  if (E <= 32 * 9) {
    route_permute_small_kernel<9><<<1, 1024, 0, st>>>(logits, bias, experts, weights, T, E, G, topk_group, k, norm,
                                                      scale, keys_sorted, slots_sorted, token_of_slot, slot_of,
                                                      offsets, x, gather ? xp : nullptr, D);
  } else {
    route_permute_small_kernel<kRouteMaxPerLane><<<1, 1024, 0, st>>>(
        logits, bias, experts, weights, T, E, G, topk_group, k, norm, scale, keys_sorted, slots_sorted, token_of_slot,
        slot_of, offsets, x, gather ? xp : nullptr, D);
  }
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  if (!gather) gather_rows(x, token_of_slot, xp, n, D, st);
  return true;
}

void gather_rows(const bf16* x, const int32_t* token_of_slot, bf16* xp, int64_t n, int64_t D, cudaStream_t st) {
  if (!n || !D) return;
  if (D % 8 == 0 && is_aligned16(x) && is_aligned16(xp)) {
    const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(ceil_div(D / 8, 256)));
    // Streaming stores once the copy outgrows a share of L2 (a prefill's or training step's, not a decoding step's:
    // there the next GEMM reads the copy from L2).
    constexpr int64_t kStreamBytes = int64_t{16} << 20;
    if (n * D * int64_t(sizeof(bf16)) > kStreamBytes)
      gather_kernel<true, true><<<grid, 256, 0, st>>>(x, token_of_slot, xp, D);
    else
      gather_kernel<true><<<grid, 256, 0, st>>>(x, token_of_slot, xp, D);
  } else {
    gather_kernel<false><<<dim3(static_cast<unsigned>(n), static_cast<unsigned>(ceil_div(D, 256))), 256, 0, st>>>(
        x, token_of_slot, xp, D);
  }
}

void swiglu(const float* gu, bf16* act, int64_t n, int64_t I, float limit, cudaStream_t st) {
  if (n * I > 0) swiglu_kernel<<<std::min<int64_t>(ceil_div(n * I, 256), 65535), 256, 0, st>>>(gu, act, n, I, limit);
}

void moe_combine(float* y, const float* out, const int32_t* slot_of, const float* weights, int64_t T, int64_t k,
                 int64_t D, cudaStream_t st, const int32_t* rows_held) {
  if (!T || !D) return;
  if (D % 4 == 0 && is_aligned16(y) && is_aligned16(out)) {
    combine_kernel<true><<<dim3(static_cast<unsigned>(T), static_cast<unsigned>(ceil_div(D / 4, 256))), 256, 0, st>>>(
        y, out, slot_of, weights, k, D, rows_held);
  } else {
    combine_kernel<false><<<dim3(static_cast<unsigned>(T), static_cast<unsigned>(ceil_div(D, 256))), 256, 0, st>>>(
        y, out, slot_of, weights, k, D, rows_held);
  }
}

void moe_localize(int32_t* experts, int64_t n, int64_t begin, int64_t count, cudaStream_t st) {
  if (n) localize_kernel<<<ceil_div(n, 256), 256, 0, st>>>(experts, n, begin, count);
}

}  // namespace nextlm::cuda
