// `kda_bwd_T4096_H64` and `mla_bwd_T4096_NH64`: the chunked KDA backward against the step-serial recurrent kernel
// and the tensor-core MLA attention backward against the fp32 tiled kernel, in the same run, checked against them.
// A .cu (not .cpp) because cuda/backward_kernels.h includes common.cuh, whose device helpers only nvcc compiles.
#include "backward.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "cuda/backward_kernels.h"
#include "cuda/kernels.h"
#include "cuda/testing_buffers.h"

namespace nextlm::bench {

namespace {

using cuda_testing::detail::Buf;
using cuda_testing::detail::DevKdaChunks;
using cuda_testing::detail::download;
using cuda_testing::detail::to_bf16;
using cuda_testing::detail::upload;
using cuda_testing::detail::widen;

constexpr double kBytesPerMs = 4.14e12 / 1e3;  // ../shared/docs/performance.md
constexpr double kFlopsPerMs = 729e12 / 1e3;

// n draws of Normal(0, 1) from a counter hash (splitmix64, then Box–Muller, two draws a hash): the 10^8 inputs of a
// case in about a second on one core, the same for a seed on every machine.
std::vector<float> randn(size_t n, uint64_t seed) {
  std::vector<float> x(n);
  for (size_t i = 0; i < n; i += 2) {
    uint64_t z = (seed + 1) * 0xD1B54A32D192ED03ull + 0x9E3779B97F4A7C15ull * (i / 2 + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u1 = (static_cast<float>(static_cast<uint32_t>(z >> 40)) + 1.0f) * (1.0f / 16777217.0f);  // (0, 1)
    const float u2 = static_cast<float>(static_cast<uint32_t>(z) & 0xFFFFFFu) * (1.0f / 16777216.0f);     // [0, 1)
    const float r = std::sqrt(-2.0f * std::log(u1)), a = 6.28318531f * u2;
    x[i] = r * std::cos(a);
    if (i + 1 < n) x[i + 1] = r * std::sin(a);
  }
  return x;
}

// Median milliseconds of run() over `iters` calls timed with CUDA events on st, after `warm` untimed calls. reset()
// is enqueued before each call, outside the timed span (the kernels add into their outputs).
template <class Reset, class Run>
double median_ms(const Reset& reset, const Run& run, cudaStream_t st, int warm, int iters) {
  cudaEvent_t a, b;
  NEXTLM_CUDA_CHECK(cudaEventCreate(&a));
  NEXTLM_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int i = 0; i < warm + iters; ++i) {
    reset();
    NEXTLM_CUDA_CHECK(cudaEventRecord(a, st));
    run();
    NEXTLM_CUDA_CHECK(cudaEventRecord(b, st));
    NEXTLM_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    NEXTLM_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    if (i >= warm) ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// ‖a − b‖ / ‖b‖ over columns [lo, hi) of rows of `width` elements (the whole arrays by default); a non-finite
// element gives +inf.
double rel_err(const std::vector<float>& a, const std::vector<float>& b, size_t width = 1, size_t lo = 0,
               size_t hi = 1) {
  double num = 0, den = 0;
  for (size_t r = 0; r + width <= b.size(); r += width)
    for (size_t i = r + lo; i < r + hi; ++i) {
      if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;
      const double d = static_cast<double>(a[i]) - b[i];
      num += d * d;
      den += static_cast<double>(b[i]) * b[i];
    }
  return std::sqrt(num / std::max(den, 1e-30));
}

void memset_zero(Buf& b, cudaStream_t st) { NEXTLM_CUDA_CHECK(cudaMemsetAsync(b.p, 0, b.bytes, st)); }

void emit(const std::string& name, double ours_ms, const char* peer, double peer_ms, double floor_ms,
          const char* note) {
  std::printf(
      "{\"case\": \"%s\", \"ours_ms\": %.4f, \"peer\": \"%s\", \"peer_ms\": %.4f, \"floor_ms\": %.4f, "
      "\"note\": \"%s\"}\n",
      name.c_str(), ours_ms, peer, peer_ms, floor_ms, note);
  std::fflush(stdout);
}

// ---- KDA ----

// Device inputs of the KDA backward for T tokens, as the layer produces them (tests/test_cuda_kda_backward.cpp):
// unit-norm k, q scaled by K^-1/2, decays g = −0.5·sigmoid(x) (the trained gates' scale), sigmoid betas; v and
// do ~ N(0, 1). q, k, v, g, do [T, H, K], beta [T, H].
struct KdaInputs {
  int64_t T, H, K;
  Buf q, k, v, g, beta, dout;
  // x with each row of n elements scaled to norm extra^-1/2.
  static Buf unit_rows(std::vector<float> x, int64_t rows, int64_t n, double extra) {
    for (int64_t r = 0; r < rows; ++r) {
      double ss = 0;
      for (int64_t d = 0; d < n; ++d) ss += static_cast<double>(x[r * n + d]) * x[r * n + d];
      const float s = static_cast<float>(1.0 / std::sqrt(ss * extra));
      for (int64_t d = 0; d < n; ++d) x[r * n + d] *= s;
    }
    return upload(x);
  }
  static Buf mapped(std::vector<float> x, float (*f)(float)) {
    for (float& e : x) e = f(e);
    return upload(x);
  }
  KdaInputs(int64_t T_, int64_t H_, int64_t K_)
      : T(T_),
        H(H_),
        K(K_),
        q(unit_rows(randn(T * H * K, 1), T * H, K, static_cast<double>(K))),
        k(unit_rows(randn(T * H * K, 2), T * H, K, 1.0)),
        v(upload(randn(T * H * K, 3))),
        g(mapped(randn(T * H * K, 4), [](float x) { return -0.5f / (1.0f + std::exp(-x)); })),
        beta(mapped(randn(T * H, 5), [](float x) { return 1.0f / (1.0f + std::exp(-x)); })),
        dout(upload(randn(T * H * K, 6))) {}
};

// Both kernels' medians on one packed layout of the inputs' T tokens, and their largest norm-relative disagreement
// over dq, dk, dv, dg and dbeta (one run each from zeroed gradients).
struct KdaBackwardRun {
  double chunked_ms, recurrent_ms, max_rel;
};

KdaBackwardRun run_kda_backward(const KdaInputs& in, const std::vector<int64_t>& lens,
                                cuda::KdaBackwardProducts products, cudaStream_t st) {
  const int64_t T = in.T, H = in.H, K = in.K, N = static_cast<int64_t>(lens.size());
  std::vector<int64_t> cu{0};
  for (int64_t L : lens) cu.push_back(cu.back() + L);
  check(cu.back() == T, "kda_backward bench: lengths do not add up to T");
  const Buf bcu = upload(std::vector<int32_t>(cu.begin(), cu.end()));
  const DevKdaChunks ch(cu);
  Buf cwork(cuda::kda_chunked_backward_workspace_bytes(ch.num_chunks(), T, H, K));
  Buf rwork(cuda::kda_recurrent_backward_workspace_bytes(T, N, H, K));
  // Each kernel's dq, dk, dv, dg [T, H, K] and dbeta [T, H], zeroed before each run.
  struct Grads {
    Buf dq, dk, dv, dg, dbeta;
    void zero(cudaStream_t s) {
      for (Buf* b : {&dq, &dk, &dv, &dg, &dbeta}) memset_zero(*b, s);
    }
  };
  const size_t nx = static_cast<size_t>(T * H * K) * sizeof(float), nb = static_cast<size_t>(T * H) * sizeof(float);
  Grads cg{Buf(nx), Buf(nx), Buf(nx), Buf(nx), Buf(nb)}, rg{Buf(nx), Buf(nx), Buf(nx), Buf(nx), Buf(nb)};
  auto chunked = [&] {
    cuda::kda_chunked_backward(in.q.as<float>(), in.k.as<float>(), in.v.as<float>(), in.g.as<float>(),
                               in.beta.as<float>(), in.dout.as<float>(), ch.view, T, H, K, cg.dq.as<float>(),
                               cg.dk.as<float>(), cg.dv.as<float>(), cg.dg.as<float>(), cg.dbeta.as<float>(), cwork.p,
                               st, true, products);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  };
  auto recurrent = [&] {
    cuda::kda_recurrent_backward(in.q.as<float>(), in.k.as<float>(), in.v.as<float>(), in.g.as<float>(),
                                 in.beta.as<float>(), in.dout.as<float>(), bcu.as<int32_t>(), N, T, H, K,
                                 rg.dq.as<float>(), rg.dk.as<float>(), rg.dv.as<float>(), rg.dg.as<float>(),
                                 rg.dbeta.as<float>(), rwork.p, st);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  };
  cg.zero(st);
  chunked();
  rg.zero(st);
  recurrent();
  NEXTLM_CUDA_CHECK(cudaStreamSynchronize(st));
  KdaBackwardRun r{};
  for (auto [c, g] :
       {std::pair{&cg.dq, &rg.dq}, {&cg.dk, &rg.dk}, {&cg.dv, &rg.dv}, {&cg.dg, &rg.dg}, {&cg.dbeta, &rg.dbeta}})
    r.max_rel = std::max(r.max_rel, rel_err(download<float>(*c), download<float>(*g)));
  r.chunked_ms = median_ms([&] { cg.zero(st); }, chunked, st, 2, 10);
  r.recurrent_ms = median_ms([&] { rg.zero(st); }, recurrent, st, 2, 10);
  return r;
}

}  // namespace

void kda_backward_case(const std::string& name) {
  const int64_t T = 4096, H = 64, K = 128;
  // The chunked kernel's products run on tensor cores in split bf16 (~1e-5 relative from the fp32 recurrent kernel,
  // tests/test_cuda_kda_backward.cpp), or with _bf16 in bf16 (these inputs are not bf16 values: ~3e-3); a wrong term
  // moves a gradient by O(1).
  const bool bf16 = name.size() > 5 && name.compare(name.size() - 5, 5, "_bf16") == 0;
  const auto products = bf16 ? cuda::KdaBackwardProducts::Bf16 : cuda::KdaBackwardProducts::SplitBf16;
  const double tol = bf16 ? 2e-2 : 1e-4;
  cudaStream_t st;
  NEXTLM_CUDA_CHECK(cudaStreamCreate(&st));
  const KdaInputs in(T, H, K);
  const KdaBackwardRun one = run_kda_backward(in, {T}, products, st);
  const KdaBackwardRun four = run_kda_backward(in, {1024, 1024, 1024, 1024}, products, st);
  NEXTLM_CUDA_CHECK(cudaStreamDestroy(st));

  // Bytes: q, k, v, g, do read and dq, dk, dv, dg written, fp32 (beta's T·H are negligible). FLOPs: 3x the forward's
  // chunked count of performance.md (0.1 TFLOP at T = 8192, H = 64, K = 128, scaled by T·H·K²): each of its products
  // is recomputed and then differentiated with respect to both operands.
  const double bytes = 9.0 * T * H * K * 4;
  const double flops = 3 * 0.1e12 * (static_cast<double>(T) * H * K * K) / (8192.0 * 64 * 128 * 128);
  const double floor_ms = std::max(bytes / kBytesPerMs, flops / kFlopsPerMs);
  const bool ok = one.max_rel <= tol && four.max_rel <= tol;
  char note[700];
  std::snprintf(note, sizeof note,
                "%s: chunked (WY) form, %s tensor cores%s, T=4096 in 1 sequence; 4 sequences of 1024: chunked "
                "%.3f ms, recurrent %.3f ms; chunked/recurrent speed-up %.1fx (1 seq), %.1fx (4 seqs); floor = "
                "max(bytes %.2f GB -> %.3f ms, FLOPs %.2f TFLOP (3x the forward's chunked count) -> %.3f ms); chunked "
                "vs recurrent max norm-rel err over dq,dk,dv,dg,dbeta: %.2g (1 seq), %.2g (4 seqs), bound %.0e",
                ok ? "ok" : "CHECK FAILED", bf16 ? "bf16" : "split-bf16",
                bf16 ? (cuda::kda_backward_compact_prep() ? " (compact prep)" : " (full prep)") : "", four.chunked_ms,
                four.recurrent_ms, one.recurrent_ms / one.chunked_ms, four.recurrent_ms / four.chunked_ms,
                bytes / 1e9, bytes / kBytesPerMs, flops / 1e12, flops / kFlopsPerMs, one.max_rel, four.max_rel, tol);
  emit(name, one.chunked_ms, "step-serial recurrent kernel (cuda::kda_recurrent_backward), same run", one.recurrent_ms,
       floor_ms, note);
}

void kda_backward_train_case(const std::string& name) {
  const int64_t T = 4096, H = 64, K = 128, n = T * H * K;
  cudaStream_t st;
  NEXTLM_CUDA_CHECK(cudaStreamCreate(&st));
  const KdaInputs in(T, H, K);
  const Buf q16 = upload(to_bf16(download<float>(in.q))), k16 = upload(to_bf16(download<float>(in.k))),
            v16 = upload(to_bf16(download<float>(in.v)));
  // The safe gate with bound −0.5, A_log 0 and dt_bias 0: g = −0.5·sigmoid(f), the other cases' decays.
  const float bound = -0.5f;
  const Buf f = upload(randn(n, 4)), bias = upload(std::vector<float>(H * K, 0.0f)),
            alog = upload(std::vector<float>(H, 0.0f));
  const cuda::KdaGateInputs gate{f.as<float>(), bias.as<float>(), alog.as<float>(), true, bound};
  const std::vector<cuda::bf16> do_r = to_bf16(download<float>(in.dout));
  const Buf do16 = upload(do_r), do32 = upload(widen(do_r));  // dO's bf16 values, in bf16 and in fp32
  const std::vector<int64_t> cu{0, 1024, 2048, 3072, 4096};  // the slice's packing
  const DevKdaChunks ch(cu);
  const int64_t nc = ch.num_chunks();
  // The tensor-core forward, keeping the chunk states with v_new in fp32 and again in bf16 (the same states).
  Buf fwork(cuda::kda_tc_workspace_bytes(nc, H, K)), o(static_cast<size_t>(n) * 2);
  Buf kh(static_cast<size_t>(nc * H * K * K) * 4), ku(static_cast<size_t>(nc * H * 64 * K) * 4),
      ku16(static_cast<size_t>(nc * H * 64 * K) * 2);
  for (const bool b16 : {false, true}) {
    cuda::KdaTcStates keep;
    keep.chunk_h = kh.as<float>();
    if (b16) keep.chunk_u16 = ku16.as<cuda::bf16>();
    else keep.chunk_u = ku.as<float>();
    cuda::kda_chunked_tc(q16.as<cuda::bf16>(), k16.as<cuda::bf16>(), v16.as<cuda::bf16>(), f.as<float>(),
                         in.beta.as<float>(), bias.as<float>(), alog.as<float>(), bound, o.as<cuda::bf16>(), ch.view,
                         cuda::kda_tc_workspace(fwork.p, nc, H, K), H, K, keep, st);
  }
  Buf work(cuda::kda_chunked_backward_workspace_bytes(nc, T, H, K));
  const size_t nx = static_cast<size_t>(n) * 4, nb = static_cast<size_t>(T * H) * 4;
  Buf grads[2][5] = {{Buf(nx), Buf(nx), Buf(nx), Buf(nx), Buf(nb)}, {Buf(nx), Buf(nx), Buf(nx), Buf(nx), Buf(nb)}};
  // b16: dO and v_new in bf16 (KdaBf16Operands, the training step's form since 7ebfad7); else the same values in
  // fp32. Gradients written (no zeroing), as the step runs it.
  auto backward = [&](bool b16) {
    Buf* g = grads[b16];
    cuda::kda_chunked_backward(q16.as<cuda::bf16>(), k16.as<cuda::bf16>(), v16.as<cuda::bf16>(), nullptr,
                               in.beta.as<float>(), b16 ? nullptr : do32.as<float>(), ch.view, T, H, K,
                               g[0].as<float>(), g[1].as<float>(), g[2].as<float>(), g[3].as<float>(),
                               g[4].as<float>(), work.p, st, false, cuda::KdaBackwardProducts::Bf16, kh.as<float>(),
                               b16 ? nullptr : ku.as<float>(), gate,
                               b16 ? cuda::KdaBf16Operands{do16.as<cuda::bf16>(), ku16.as<cuda::bf16>()}
                                   : cuda::KdaBf16Operands{});
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  };
  backward(false);
  backward(true);
  NEXTLM_CUDA_CHECK(cudaStreamSynchronize(st));
  bool same = true, finite = true;
  for (int i = 0; i < 5; ++i) {
    const std::vector<float> a = download<float>(grads[0][i]), b = download<float>(grads[1][i]);
    same = same && std::equal(a.begin(), a.end(), b.begin(), [](float x, float y) {
             return std::memcmp(&x, &y, sizeof x) == 0;
           });
    finite = finite && std::all_of(b.begin(), b.end(), [](float x) { return std::isfinite(x); });
  }
  const double ours = median_ms([] {}, [&] { backward(true); }, st, 2, 10);
  const double peer = median_ms([] {}, [&] { backward(false); }, st, 2, 10);
  NEXTLM_CUDA_CHECK(cudaStreamDestroy(st));
  // Bytes: q, k, v and dO in bf16, f fp32, the kept states (fp32) and v_new (bf16) read; dq, dk, dv, dg written.
  const double bytes = static_cast<double>(n) * (4 * 2 + 4 + 4 * 4) + nc * H * (K * K * 4.0 + 64 * K * 2.0);
  char note[400];
  std::snprintf(note, sizeof note,
                "%s: the chunked form as a training step runs it (bf16 products, %s prep, bf16 q/k/v, the gate from "
                "f, the tensor-core forward's kept states, gradients written), 4 sequences of 1024; ours reads dO and "
                "v_new in bf16, the peer the same values in fp32: same bits %s, finite %s; floor = bytes %.2f GB",
                same && finite ? "ok" : "CHECK FAILED", cuda::kda_backward_compact_prep() ? "compact" : "full",
                same ? "yes" : "NO", finite ? "yes" : "NO", bytes / 1e9);
  emit(name, ours, "the same with fp32 dO and v_new (the form until 7ebfad7), same run", peer, bytes / kBytesPerMs,
       note);
}

void mla_backward_case(const std::string& name) {
  const int64_t T = 4096, NH = 64, dqk = 256, dv = 256, W = dqk + dv, topk = 2048;
  // The tensor-core kernel rounds do, the softmax weights and their gradients to bf16 (a few 1e-3 of norm-relative
  // error against the fp32 function, tests/test_cuda_dsa_backward.cpp); a wrong term gives O(1e-1).
  const double tol = 1e-2;
  // Causal selections of min(t + 1, topk) distinct random keys, sorted; token 0 has none (uniform over its
  // sequence, an empty row). One sequence, so keys are token indices.
  std::mt19937 gen(7);
  std::vector<int32_t> sel(T * topk, 0), count(T, 0), start(T, 0), len(T, static_cast<int32_t>(T)), pool(T);
  double pairs = 0;
  for (int64_t t = 1; t < T; ++t) {
    const int64_t n = std::min<int64_t>(t + 1, topk);
    std::iota(pool.begin(), pool.begin() + t + 1, 0);
    for (int64_t i = 0; i < n; ++i) std::swap(pool[i], pool[i + gen() % (t + 1 - i)]);  // n distinct causal keys
    std::sort(pool.begin(), pool.begin() + n);
    std::copy(pool.begin(), pool.begin() + n, sel.begin() + t * topk);
    count[t] = static_cast<int32_t>(n);
    pairs += static_cast<double>(n);
  }
  const size_t nq = static_cast<size_t>(T * NH * dqk), nkv = static_cast<size_t>(T * NH * W);
  // q and kv in bf16 for the tensor-core kernel; the fp32 kernels get the same (bf16-rounded) values.
  const std::vector<cuda::bf16> q16 = cuda_testing::detail::to_bf16(randn(nq, 11)),
                                kv16 = cuda_testing::detail::to_bf16(randn(nkv, 12));
  const Buf bq16 = upload(q16), bkv16 = upload(kv16), bq = upload(cuda_testing::detail::widen(q16)),
            bkv = upload(cuda_testing::detail::widen(kv16)), bdo = upload(randn(static_cast<size_t>(T * NH * dv), 13));
  const Buf bsel = upload(sel), bcount = upload(count), bstart = upload(start), blen = upload(len);
  Buf tc_work(cuda::mla_sparse_attention_backward_tc_workspace_bytes(T, NH, T, dqk, dv));
  Buf work(cuda::mla_sparse_attention_backward_workspace_bytes(T, NH, T));
  Buf tc_dq(nq * sizeof(float)), tc_dkv(nkv * sizeof(float)), dq(nq * sizeof(float)), dkv(nkv * sizeof(float));
  cudaStream_t st;
  NEXTLM_CUDA_CHECK(cudaStreamCreate(&st));
  auto tc_zero = [&] {
    memset_zero(tc_dq, st);
    memset_zero(tc_dkv, st);
  };
  auto zero = [&] {
    memset_zero(dq, st);
    memset_zero(dkv, st);
  };
  auto tc = [&] {
    cuda::mla_sparse_attention_backward_tc(bq16.as<cuda::bf16>(), bkv16.as<cuda::bf16>(), bsel.as<int32_t>(),
                                           bcount.as<int32_t>(), bstart.as<int32_t>(), blen.as<int32_t>(),
                                           bdo.as<float>(), tc_dq.as<float>(), tc_dkv.as<float>(), T, NH, dqk, dv, topk,
                                           T, tc_work.p, st);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  };
  auto tiled = [&] {
    cuda::mla_sparse_attention_backward(bq.as<float>(), bkv.as<float>(), bsel.as<int32_t>(), bcount.as<int32_t>(),
                                        bstart.as<int32_t>(), blen.as<int32_t>(), bdo.as<float>(), dq.as<float>(),
                                        dkv.as<float>(), T, NH, dqk, dv, topk, T, work.p, st);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  };
  auto scatter = [&] {
    cuda::mla_sparse_attention_backward_scatter(
        bq.as<float>(), bkv.as<float>(), bsel.as<int32_t>(), bcount.as<int32_t>(), bstart.as<int32_t>(),
        blen.as<int32_t>(), bdo.as<float>(), dq.as<float>(), dkv.as<float>(), T, NH, dqk, dv, topk, st);
    NEXTLM_CUDA_CHECK(cudaGetLastError());
  };
  // The check, from zeroed gradients: dq, and the k and v columns of dkv [T, NH, dqk | dv] apart.
  tc_zero();
  tc();
  zero();
  tiled();
  NEXTLM_CUDA_CHECK(cudaStreamSynchronize(st));
  const double e_q = rel_err(download<float>(tc_dq), download<float>(dq));
  const std::vector<float> a = download<float>(tc_dkv), b = download<float>(dkv);
  const double e_k = rel_err(a, b, W, 0, dqk), e_v = rel_err(a, b, W, dqk, W);
  const bool ok = e_q <= tol && e_k <= tol && e_v <= tol;

  const double tc_ms = median_ms(tc_zero, tc, st, 3, 10);
  const double tiled_ms = median_ms(zero, tiled, st, 1, 5);
  const double scatter_ms = median_ms(zero, scatter, st, 1, 5);
  NEXTLM_CUDA_CHECK(cudaStreamDestroy(st));

  // FLOPs: five products of 2·pairs·d per head (the flash-attention backward count, 2.5x the forward's two):
  // S = q·kᵀ recomputed and dQ = dS·k, dK = dSᵀ·q over dqk; dP = dO·vᵀ and dV = Pᵀ·dO over dv. The kernel's
  // statistics pass (recomputing the row log-sum-exp) is its own cost, not the function's. Bytes: q, kv read in
  // bf16, do read and dq, dkv written in fp32.
  const double flops = static_cast<double>(NH) * pairs * 2.0 * (3 * dqk + 2 * dv);
  const double bytes = static_cast<double>(T) * NH * (2.0 * (dqk + W) + 4.0 * (dv + dqk + W));
  const double causal = static_cast<double>(T) * (T + 1) / 2;
  char note[900];
  std::snprintf(note, sizeof note,
                "%s: tensor cores (bf16 products, fp32 sums) vs fp32 tiled (peer) %.2fx; fp32 scatter (atomics) "
                "%.3f ms; %.2fM selected (query, key) pairs per head of %.2fM causal (token 0: empty, uniform); "
                "floor = max(FLOPs %.2f TFLOP (5 products of 2*pairs*d per head) -> %.3f ms, bytes %.2f GB -> %.3f "
                "ms); tc vs tiled norm-rel err: dq %.2e, dk %.2e, dv %.2e, bound %.0e",
                ok ? "ok" : "CHECK FAILED", tiled_ms / tc_ms, scatter_ms, pairs / 1e6, causal / 1e6, flops / 1e12,
                flops / kFlopsPerMs, bytes / 1e9, bytes / kBytesPerMs, e_q, e_k, e_v, tol);
  emit(name, tc_ms, "fp32 tiled kernel (cuda::mla_sparse_attention_backward), same run", tiled_ms,
       std::max(flops / kFlopsPerMs, bytes / kBytesPerMs), note);
}

}  // namespace nextlm::bench
