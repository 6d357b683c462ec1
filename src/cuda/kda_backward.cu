// Backward of the KDA delta rule (the recurrent form) on the GPU, fp32: a backward through time with the states
// recomputed from checkpoints. Matches kda_recurrent_backward in src/model/kda_backward.cpp.
//
// Each value column j of the state S [K, K] evolves independently given (k, g, β), so the work is split over value
// columns: a block owns kCols columns of one (sequence, head), each of its warps owns kWarpCols of them, and a lane
// owns the key rows lane + 32m (m < R) of those columns, state in registers. Reductions over the key dim (u, du) are
// warp shuffles, with no block barrier on the carried chain. The sums over value columns (dq, dk, dg, dbeta) are
// summed over the block's warps in shared memory, then over the blocks of a thread-block cluster (one cluster = all
// columns of a (sequence, head)) through distributed shared memory, in a fixed order, and added to the outputs.
//
// Memory: a first kernel (the forward sweep) writes the state entering every kChunk-th step to the workspace. The
// second walks back chunk by chunk: the chunk is recomputed once to keep the states entering every kSub-th step in
// shared memory; each sub-chunk is then recomputed into registers (its kSub decayed states) and stepped backward,
// carrying dS in registers. Cost: three forward passes and one backward pass over the sequence.
//
// Speed (H200, H = 64, K = 128, T = 4096): about 37 ms for one sequence, 30 ms for four of 1024 (the forward sweep
// about 4.5 ms of it). Every pass is bound by the latency of its per-step chain (shuffle reductions, shared-memory
// loads) at 16 warps per SM (registers and shared memory), and the walk back runs in about three waves of clusters.
#include <cooperative_groups.h>

#include "cuda/backward_kernels.h"

namespace nextlm::cuda {

namespace {

namespace cg = cooperative_groups;

constexpr int kChunk = 64;                    // steps between workspace checkpoints
constexpr int kSub = 8;                       // steps between shared-memory checkpoints
constexpr int kSubs = kChunk / kSub;          // sub-chunks per chunk
constexpr int kWarps = 8;                     // warps per block
constexpr int kThreads = kWarps * 32;
constexpr int kWarpCols = 2;                  // value columns per warp
constexpr int kCols = kWarps * kWarpCols;     // value columns per block
constexpr int kMaxCluster = 8;                // K ≤ 128 → at most 8 blocks per (sequence, head)

// Workspace checkpoint slots: sequence n starts at slot (cu[n] + (kChunk−1)·n) / kChunk, which leaves room for its
// ceil(L_n / kChunk) chunks (⌊a + b⌋ ≥ ⌊a⌋ + ⌊b⌋), so no prefix sum over the sequences is needed.
__host__ __device__ inline int64_t ckpt_slot_base(int64_t cu_n, int64_t n) {
  return (cu_n + (kChunk - 1) * n) / kChunk;
}

// Shared-memory layout (floats), for K rows.
struct Smem {
  int K;
  __host__ __device__ int pw() const { return 3 * K + 1; }  // dq | dk | dg rows, then dbeta
  __host__ __device__ int sk(int) const { return 0; }                                     // [kSub][K]
  __host__ __device__ int sg(int E) const { return sk(E) + kSub * K; }                    // [kSub][K] exp(g)
  __host__ __device__ int sq(int E) const { return sg(E) + kSub * K; }                    // [kSub][K]
  __host__ __device__ int sv(int E) const { return sq(E) + kSub * K; }                    // [kSub][kCols]
  __host__ __device__ int sd(int E) const { return sv(E) + kSub * kCols; }                // [kSub][kCols]
  __host__ __device__ int sb(int E) const { return sd(E) + kSub * kCols; }                // [kSub]
  __host__ __device__ int svm(int E) const { return sb(E) + kSub; }                       // [kSub][kCols]
  __host__ __device__ int staged(int E) const { return svm(E) + kSub * kCols; }  // the forward sweep's end
  __host__ __device__ int sub(int E) const { return staged(E); }  // [kSubs − 1][E][kThreads] sub-chunk checkpoints
  __host__ __device__ int part(int E) const { return sub(E) + (kSubs - 1) * E * kThreads; }  // [2][kWarps][pw]
  __host__ __device__ int red(int E) const { return part(E) + 2 * kWarps * pw(); }        // [kSub][pw]
  __host__ __device__ int total(int E) const { return red(E) + kSub * pw(); }
};

// What one thread loads for a stage of kSub steps (K ≤ 128 keys, kCols ≤ kThreads / kSub value columns).
constexpr int kStageIters = kSub * 128 / kThreads;
static_assert(kSub * kCols <= kThreads, "one staged v / do value per thread at most");
struct StageRegs {
  float k[kStageIters], g[kStageIters], q[kStageIters], v, d, b;
};

struct Args {
  const float *q, *k, *v, *g, *beta, *do_;
  const int32_t* cu;
  int64_t H, K;
  int CS;  // blocks per (sequence, head): ceil(K / kCols)
  float *dq, *dk, *dv, *dg, *dbeta;
  float* ckpt;  // [slots, H, K, K]
};

// One block per (sequence, head, group of kCols value columns); blockIdx.x = (n·H + h)·CS + rank. R = ceil(K / 32)
// key rows per lane. Sweep: the forward sweep that writes the workspace checkpoints (no cluster, little shared
// memory, so more blocks per SM); otherwise the walk back, launched in clusters of CS blocks.
template <int R, bool Sweep>
__global__ void __launch_bounds__(kThreads, Sweep ? 4 : 2) kda_bwd_kernel(Args a) {
  constexpr int E = R * kWarpCols;
  extern __shared__ float sm[];
  const int CS = a.CS, rank = static_cast<int>(blockIdx.x % CS);
  const int64_t H = a.H, HK = H * a.K;
  const int K = static_cast<int>(a.K);
  const int64_t nh = blockIdx.x / CS, n = nh / H, h = nh % H;
  const int64_t s0 = a.cu[n], L = a.cu[n + 1] - s0;
  if (L <= 0) return;  // the whole cluster leaves together
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const Smem lay{K};
  const int PW = lay.pw();
  float* sub = sm + lay.sub(E);
  float* sk = sm + lay.sk(E);
  float* sg = sm + lay.sg(E);
  float* sq = sm + lay.sq(E);
  float* sv = sm + lay.sv(E);
  float* sd = sm + lay.sd(E);
  float* sb = sm + lay.sb(E);
  float* svm = sm + lay.svm(E);
  float* part = sm + lay.part(E);
  float* red = sm + lay.red(E);
  const int c_lo = w * kWarpCols;  // first of this warp's columns within the block's kCols
  const int col0 = rank * kCols + c_lo;
  const int64_t KK = int64_t(K) * K;
  float* ckpt_base = a.ckpt + ckpt_slot_base(s0, n) * H * KK + h * KK;
  auto ckpt_at = [&](int64_t c) { return ckpt_base + c * H * KK; };  // checkpoint of chunk c of this sequence
  const int64_t base = s0 * HK + h * K;  // element (t, i) of this sequence and head: base + t·HK + i

  // Staging of steps t0 … t0+cnt−1 (relative to the sequence) of k, exp(g), (q, do), v and beta in shared memory,
  // in two halves: fetch issues all the global loads into registers (so their latencies overlap, and overlap the
  // work before commit), commit waits for the readers of the previous stage and stores.
  auto fetch = [&](StageRegs& r, int64_t t0, int cnt, bool back) {
#pragma unroll
    for (int it = 0; it < kStageIters; ++it) {
      const int idx = tid + it * kThreads;
      if (idx < cnt * K) {
        const int j = idx / K, i = idx - j * K;
        const int64_t src = base + (t0 + j) * HK + i;
        r.k[it] = __ldg(a.k + src);
        r.g[it] = __ldg(a.g + src);
        if (back) r.q[it] = __ldg(a.q + src);
      }
    }
    if (tid < cnt * kCols) {
      const int j = tid / kCols, col = rank * kCols + tid % kCols;
      const int64_t src = base + (t0 + j) * HK + col;
      r.v = col < K ? __ldg(a.v + src) : 0.0f;
      if (back) r.d = col < K ? __ldg(a.do_ + src) : 0.0f;
    }
    if (tid < cnt) r.b = __ldg(a.beta + (s0 + t0 + tid) * H + h);
  };
  auto commit = [&](const StageRegs& r, int cnt, bool back) {
    __syncthreads();  // the previous stage is no longer read
#pragma unroll
    for (int it = 0; it < kStageIters; ++it) {
      const int idx = tid + it * kThreads;
      if (idx < cnt * K) {
        sk[idx] = r.k[it];
        sg[idx] = expf(r.g[it]);  // the decay, computed once per block and step
        if (back) sq[idx] = r.q[it];
      }
    }
    if (tid < cnt * kCols) {
      sv[tid] = r.v;
      if (back) sd[tid] = r.d;
    }
    if (tid < cnt) sb[tid] = r.b;
    __syncthreads();
  };
  // Staging in one go (the walk back keeps its registers for the state history).
  auto stage = [&](int64_t t0, int cnt, bool back) {
    __syncthreads();  // the previous stage is no longer read
    for (int idx = tid; idx < cnt * K; idx += kThreads) {
      const int j = idx / K, i = idx - j * K;
      const int64_t src = base + (t0 + j) * HK + i;
      sk[idx] = a.k[src];
      sg[idx] = expf(a.g[src]);
      if (back) sq[idx] = a.q[src];
    }
    if (tid < cnt * kCols) {
      const int j = tid / kCols, col = rank * kCols + tid % kCols;
      const int64_t src = base + (t0 + j) * HK + col;
      sv[tid] = col < K ? a.v[src] : 0.0f;
      if (back) sd[tid] = col < K ? a.do_[src] : 0.0f;
    }
    if (tid < cnt) sb[tid] = a.beta[(s0 + t0 + tid) * H + h];
    __syncthreads();
  };

  // One forward step from the staged step j: S ← diag(exp g)·S; u = β(v − Sᵀk); S ← S + k uᵀ. With keep, the
  // decayed state goes to St and v − Sᵀk to svm (lane 0; read after a __syncwarp).
  auto fwd_step = [&](float (&S)[R][kWarpCols], int j, float (&St)[R][kWarpCols], bool keep) {
    float kk[R];
    float acc[kWarpCols] = {};
#pragma unroll
    for (int m = 0; m < R; ++m) {
      const int i = lane + 32 * m;
      const bool ok = i < K;
      kk[m] = ok ? sk[j * K + i] : 0.0f;
      const float e = ok ? sg[j * K + i] : 0.0f;
#pragma unroll
      for (int c = 0; c < kWarpCols; ++c) {
        S[m][c] *= e;
        acc[c] += S[m][c] * kk[m];
      }
    }
    const float b = sb[j];
#pragma unroll
    for (int c = 0; c < kWarpCols; ++c) {
      const float vm = sv[j * kCols + c_lo + c] - warp_sum(acc[c]);
      if (keep && lane == 0) svm[j * kCols + c_lo + c] = vm;
      const float u = b * vm;
#pragma unroll
      for (int m = 0; m < R; ++m) {
        if (keep) St[m][c] = S[m][c];
        S[m][c] += kk[m] * u;
      }
    }
  };

  auto store_state = [&](const float (&S)[R][kWarpCols], float* dst) {
#pragma unroll
    for (int m = 0; m < R; ++m) {
      const int i = lane + 32 * m;
#pragma unroll
      for (int c = 0; c < kWarpCols; ++c)
        if (i < K && col0 + c < K) dst[i * K + col0 + c] = S[m][c];
    }
  };
  auto load_state = [&](float (&S)[R][kWarpCols], const float* src) {
#pragma unroll
    for (int m = 0; m < R; ++m) {
      const int i = lane + 32 * m;
#pragma unroll
      for (int c = 0; c < kWarpCols; ++c) S[m][c] = (i < K && col0 + c < K) ? src[i * K + col0 + c] : 0.0f;
    }
  };

  const int64_t nchunks = (L + kChunk - 1) / kChunk;
  float S[R][kWarpCols];
#pragma unroll
  for (int m = 0; m < R; ++m)
#pragma unroll
    for (int c = 0; c < kWarpCols; ++c) S[m][c] = 0.0f;

  if constexpr (Sweep) {
    // The state entering every chunk goes to the workspace (the walk back's lane reads back what this lane wrote;
    // the kernel boundary orders them).
    StageRegs r;
    fetch(r, 0, static_cast<int>(min(int64_t(kSub), L)), false);
    for (int64_t t0 = 0; t0 < L; t0 += kSub) {
      const int cnt = static_cast<int>(min(int64_t(kSub), L - t0));
      commit(r, cnt, false);
      if (t0 + kSub < L) fetch(r, t0 + kSub, static_cast<int>(min(int64_t(kSub), L - t0 - kSub)), false);
      if (t0 % kChunk == 0) store_state(S, ckpt_at(t0 / kChunk));
      if (cnt == kSub) {
#pragma unroll
        for (int j = 0; j < kSub; ++j) fwd_step(S, j, S, false);
      } else {
        for (int j = 0; j < cnt; ++j) fwd_step(S, j, S, false);
      }
    }
    return;
  }
  cg::cluster_group cluster = cg::this_cluster();
  bool red_pending = false;  // a cluster barrier arrival that is not yet waited for
  float dS[R][kWarpCols];
#pragma unroll
  for (int m = 0; m < R; ++m)
#pragma unroll
    for (int c = 0; c < kWarpCols; ++c) dS[m][c] = 0.0f;

  for (int64_t ch = nchunks - 1; ch >= 0; --ch) {
    const int64_t ct0 = ch * kChunk;
    const int nsub = static_cast<int>((min(int64_t(kChunk), L - ct0) + kSub - 1) / kSub);
    // The states entering sub-chunks 1 … nsub−1 (sub-chunk 0 starts from the workspace checkpoint).
    load_state(S, ckpt_at(ch));
    for (int s = 0; s + 1 < nsub; ++s) {
      stage(ct0 + s * kSub, kSub, false);
#pragma unroll
      for (int j = 0; j < kSub; ++j) fwd_step(S, j, S, false);
#pragma unroll
      for (int m = 0; m < R; ++m)
#pragma unroll
        for (int c = 0; c < kWarpCols; ++c) sub[(s * E + m * kWarpCols + c) * kThreads + tid] = S[m][c];
    }
    for (int s = nsub - 1; s >= 0; --s) {
      const int64_t st0 = ct0 + s * kSub;
      const int cnt = static_cast<int>(min(int64_t(kSub), L - st0));
      if (s == 0) {
        load_state(S, ckpt_at(ch));
      } else {
#pragma unroll
        for (int m = 0; m < R; ++m)
#pragma unroll
          for (int c = 0; c < kWarpCols; ++c) S[m][c] = sub[((s - 1) * E + m * kWarpCols + c) * kThreads + tid];
      }
      stage(st0, cnt, true);
      // The decayed states St of the sub-chunk's steps, in registers (static indices: the loops are unrolled).
      float hist[kSub][R][kWarpCols];
#pragma unroll
      for (int j = 0; j < kSub; ++j)
        if (j < cnt) fwd_step(S, j, hist[j], true);
      __syncwarp();
      // The other ranks have finished reading red (the previous sub-chunk's sums).
      if (red_pending) __cluster_barrier_wait();
      red_pending = false;
#pragma unroll
      for (int j = kSub - 1; j >= 0; --j) {
        if (j >= cnt) continue;
        float kk[R], qq[R], ee[R], dq_r[R], dk_r[R], dg_r[R], dov[kWarpCols], vm[kWarpCols], u[kWarpCols];
        const float b = sb[j];
#pragma unroll
        for (int c = 0; c < kWarpCols; ++c) {
          dov[c] = sd[j * kCols + c_lo + c];
          vm[c] = svm[j * kCols + c_lo + c];
          u[c] = b * vm[c];
        }
        float acc[kWarpCols] = {};
#pragma unroll
        for (int m = 0; m < R; ++m) {
          const int i = lane + 32 * m;
          const bool ok = i < K;
          kk[m] = ok ? sk[j * K + i] : 0.0f;
          qq[m] = ok ? sq[j * K + i] : 0.0f;
          ee[m] = ok ? sg[j * K + i] : 0.0f;
          // o = Snewᵀq with Snew = St + k uᵀ
          float aq = 0.0f, ak = 0.0f;
#pragma unroll
          for (int c = 0; c < kWarpCols; ++c) {
            aq += (hist[j][m][c] + kk[m] * u[c]) * dov[c];
            dS[m][c] += qq[m] * dov[c];
            acc[c] += dS[m][c] * kk[m];
            ak += dS[m][c] * u[c];
          }
          dq_r[m] = aq;
          dk_r[m] = ak;
        }
        // u = β(v − Stᵀk)
        float db = 0.0f, dmem[kWarpCols];
#pragma unroll
        for (int c = 0; c < kWarpCols; ++c) {
          const float du = warp_sum(acc[c]);
          db += du * vm[c];
          if (lane == c && col0 + c < K) a.dv[base + (st0 + j) * HK + col0 + c] += b * du;
          dmem[c] = -b * du;
        }
        // mem = Stᵀk, St = diag(exp g)·Sprev
#pragma unroll
        for (int m = 0; m < R; ++m) {
          float ak = 0.0f, ag = 0.0f;
#pragma unroll
          for (int c = 0; c < kWarpCols; ++c) {
            dS[m][c] += kk[m] * dmem[c];
            ak += hist[j][m][c] * dmem[c];
            ag += dS[m][c] * hist[j][m][c];
            dS[m][c] *= ee[m];
          }
          dk_r[m] += ak;
          dg_r[m] = ag;
        }
        // Sums over the block's columns: this warp's part, then over the warps in order.
        float* pp = part + ((j & 1) * kWarps + w) * PW;
#pragma unroll
        for (int m = 0; m < R; ++m) {
          const int i = lane + 32 * m;
          if (i < K) {
            pp[i] = dq_r[m];
            pp[K + i] = dk_r[m];
            pp[2 * K + i] = dg_r[m];
          }
        }
        if (lane == 0) pp[3 * K] = db;
        __syncthreads();
        const float* pr = part + (j & 1) * kWarps * PW;
        for (int idx = tid; idx < PW; idx += kThreads) {
          float s = 0.0f;
#pragma unroll
          for (int ww = 0; ww < kWarps; ++ww) s += pr[ww * PW + idx];
          red[j * PW + idx] = s;
        }
      }
      // Sums over the cluster's blocks, in rank order, into the outputs; each rank adds a share of the elements.
      cluster.sync();
      for (int e = rank * kThreads + tid; e < cnt * PW; e += CS * kThreads) {
        float s = 0.0f;
        for (int r = 0; r < CS; ++r) s += cluster.map_shared_rank(red, r)[e];
        const int j = e / PW, idx = e - j * PW;
        const int64_t row = base + (st0 + j) * HK;
        if (idx < K) {
          a.dq[row + idx] += s;
        } else if (idx < 2 * K) {
          a.dk[row + idx - K] += s;
        } else if (idx < 3 * K) {
          a.dg[row + idx - 2 * K] += s;
        } else {
          a.dbeta[(s0 + st0 + j) * H + h] += s;
        }
      }
      // red is read by the other ranks until they arrive here; the wait is deferred to the next write of red.
      __cluster_barrier_arrive();
      red_pending = true;
    }
  }
  if (red_pending) __cluster_barrier_wait();  // no rank leaves while another still reads its shared memory
}

template <int R>
void launch(const Args& a, int64_t N, cudaStream_t st) {
  const int cs = a.CS;
  const dim3 grid(static_cast<unsigned>(N * a.H * cs));
  const Smem lay{static_cast<int>(a.K)};
  const size_t sweep_smem = static_cast<size_t>(lay.staged(R * kWarpCols)) * sizeof(float);
  kda_bwd_kernel<R, true><<<grid, kThreads, sweep_smem, st>>>(a);
  NEXTLM_CUDA_CHECK(cudaGetLastError());
  const size_t smem = static_cast<size_t>(lay.total(R * kWarpCols)) * sizeof(float);
  NEXTLM_CUDA_CHECK(cudaFuncSetAttribute(kda_bwd_kernel<R, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem)));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cs;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  NEXTLM_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kda_bwd_kernel<R, false>, a));
  NEXTLM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

size_t kda_recurrent_backward_workspace_bytes(int64_t T, int64_t N, int64_t H, int64_t K) {
  if (T <= 0 || N <= 0) return 0;
  const int64_t slots = ckpt_slot_base(T, N);  // the slot base of a sequence that would follow the last one
  return static_cast<size_t>(slots * H * K * K) * sizeof(float);
}

void kda_recurrent_backward(const float* q, const float* k, const float* v, const float* g, const float* beta,
                            const float* do_, const int32_t* cu, int64_t N, int64_t T, int64_t H, int64_t K,
                            float* dq, float* dk, float* dv, float* dg, float* dbeta, void* work, cudaStream_t st) {
  if (T <= 0 || N <= 0 || H <= 0 || K <= 0) return;
  if (K > kMaxCluster * kCols) fail("kda_recurrent_backward: K = ", K, " > ", kMaxCluster * kCols);
  if (N * H * ceil_div(K, kCols) > 0x7fffffff) fail("kda_recurrent_backward: grid too large");
  const Args a{q,  k,  v,  g,  beta,  do_, cu, H, K, static_cast<int>(ceil_div(K, kCols)),
               dq, dk, dv, dg, dbeta, static_cast<float*>(work)};
  switch (ceil_div(K, 32)) {
    case 1: launch<1>(a, N, st); break;
    case 2: launch<2>(a, N, st); break;
    case 3: launch<3>(a, N, st); break;
    default: launch<4>(a, N, st); break;
  }
}

}  // namespace nextlm::cuda
