// Host-side entry points to single CUDA kernels, for the kernel tests and the benchmarks (host vectors in and out,
// or device-resident random inputs timed with CUDA events).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace nextlm::cuda_testing {

// The chunked KDA kernel on packed sequences: q, k, v, g [T, H, K] (q normalised and scaled, k normalised),
// beta [T, H]. The output buffer is poisoned with NaN first, so an unwritten element shows.
std::vector<float> kda_chunked(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                               const std::vector<float>& g, const std::vector<float>& beta,
                               const std::vector<int64_t>& cu_seqlens, int64_t H, int64_t K);

// The tensor-core KDA kernels (safe gate in the kernel) on packed sequences: q, k, v [T, H, K] (rounded to bf16 on
// the way in), graw [T, H·K] the f_b output before dt_bias, beta [T, H], A_log [H], dt_bias [H·K], states
// [N, H, K, K] (s_in empty for zeros). Returns o [T, H, K] (bf16 widened); s_out gets the final states, or with
// boundary the states after each sequence's last complete chunk (NaN for a sequence without one).
std::vector<float> kda_chunked_tc(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                                  const std::vector<float>& graw, const std::vector<float>& beta,
                                  const std::vector<float>& A_log, const std::vector<float>& dt_bias, float bound,
                                  const std::vector<int64_t>& cu_seqlens, int64_t H, int64_t K,
                                  const std::vector<float>& s_in, std::vector<float>* s_out, bool boundary = false);

// Median milliseconds of the tensor-core KDA forward on bf16 device inputs (q, k, v, the raw gate; fp32 beta), the
// safe gate computed in the kernel, as fla's chunk_kda is timed with use_gate_in_kernel; and of its two kernels
// (timed in separate runs).
struct KdaTiming {
  double total_ms, prepare_ms, state_ms;
};
KdaTiming time_kda_forward_tc(const std::vector<int64_t>& seqlens, int64_t H, int64_t K, int iters);

// Median milliseconds of the KDA forward as the model runs it: the safe gate from raw f_b outputs (A_log,
// dt_bias), then the chunked delta rule, on random device inputs of the given sequence lengths.
double time_kda_forward(const std::vector<int64_t>& seqlens, int64_t H, int64_t K, int iters);

}  // namespace nextlm::cuda_testing

namespace nextlm::cuda_testing {

// cuda::to_bf16, round_to_bf16 and bf16_to_f32 on x placed `offset` elements into their device buffers (offset 0:
// four elements at a time, then the tail one at a time; an offset that is not a multiple of 4: one at a time).
// to_bf16: its bf16 bits; rounded, rounded_bits: round_to_bf16's x and bf16 bits; widened: bf16_to_f32 of to_bf16.
struct Conversions {
  std::vector<uint16_t> to_bf16, rounded_bits;
  std::vector<float> rounded, widened;
};
Conversions conversions(const std::vector<float>& x, int64_t offset);

// The training forward's KDA input steps both ways on raw [T, 3·H·K], conv [3·H·K, W] and packed sequences cu:
// kda_conv_norm then round_to_bf16 of q, k, v (separate: fp32 then bf16 bits, q | k | v), and kda_conv_norm_rounded
// (fused); the gate of f [T, H·K] in place (a copy of f) and out of place (gate_*; has_bound with bound −5).
struct KdaPrep {
  std::vector<float> separate, fused, gate_in_place, gate_out_of_place;
  std::vector<uint16_t> separate_bits, fused_bits;
};
KdaPrep kda_prep_both(const std::vector<float>& raw, const std::vector<float>& conv, const std::vector<int64_t>& cu,
                      const std::vector<float>& f, const std::vector<float>& dt_bias, const std::vector<float>& A_log,
                      int64_t H, int64_t K, int64_t W, bool has_bound);

// MLA attention over selections on packed sequences, both kernels on the same bf16-rounded q [T, NH, dqk] and
// kv [T, NH, dqk+dv]: the tensor-core one (mla_tc.cu) and the CUDA-core one (dsa.cu, checked against the CPU).
// sel[t]: sorted sequence-relative keys of token t (empty: uniform over the sequence). Returns both outputs.
void mla_attention_both(const std::vector<float>& q, const std::vector<float>& kv,
                        const std::vector<std::vector<int32_t>>& sel, const std::vector<int64_t>& cu_seqlens,
                        int64_t NH, int64_t dqk, int64_t dv, std::vector<float>& tc, std::vector<float>& ref);

}  // namespace nextlm::cuda_testing

// ---- Decoding kernels (src/cuda/decode_kernels.h) ----
namespace nextlm::cuda_testing {

// decode_linear on x [M, in] and W [out, in] (both rounded to bf16 on the way in): y [M, out].
std::vector<float> decode_linear(const std::vector<float>& x, const std::vector<float>& W, int64_t M, int64_t out,
                                 int64_t in);

// KDA decoding steps: step s feeds one token to each slot in slots[s] (distinct), with its pre-conv projections
// raw[s] [B_s, 3·H·K], f_b output graw[s] [B_s, H·K] and beta[s] [B_s, H]. The caches conv_hist
// [num_slots, 3, W−1, H·K] and state [num_slots, H, K, K] are uploaded, run through every step and returned.
// Returns o[s] [B_s, H, K]; output buffers are poisoned with NaN first.
struct KdaDecodeSteps {
  int64_t H = 0, K = 0, W = 0, num_slots = 0;
  std::vector<float> conv, dt_bias, A_log;  // [3·HK, W], [HK], [H]
  bool has_bound = true;
  float bound = -5.0f;
  std::vector<std::vector<int32_t>> slots;
  std::vector<std::vector<float>> raw, graw, beta;
};
std::vector<std::vector<float>> kda_decode_steps(const KdaDecodeSteps& in, std::vector<float>& conv_hist,
                                                 std::vector<float>& state);

// The tensor-core KDA decoded as CudaDecoder does it, on the inputs kda_chunked_tc takes (sequence n of cu_seqlens
// in slot n, starting from state s_in[n]): the first prompt[n] tokens prefilled (kda_chunked_tc leaving the boundary
// state, kda_store_chunk_rows, the row cache filled from the chunk buffers), then one token per step for every
// sequence with tokens left (written into the chunk buffers as the step's append leaves them, then kda_tc_step). The
// caches start poisoned with NaN. Returns o [T, H, K] (bf16 widened; the prompts' rows from the prefill's forward);
// s_out gets the slots' final states (at their last chunk boundary).
std::vector<float> kda_tc_decode(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                                 const std::vector<float>& graw, const std::vector<float>& beta,
                                 const std::vector<float>& A_log, const std::vector<float>& dt_bias, float bound,
                                 const std::vector<int64_t>& cu_seqlens, const std::vector<int64_t>& prompt, int64_t H,
                                 int64_t K, const std::vector<float>& s_in, std::vector<float>* s_out);

// Indexer decoding steps from empty slots: step s adds one token to each slot in slots[s], with its projections
// qi[s] [B_s, IH·ID], LayerNormed keys ki[s] [B_s, ID], gate scores gs[s] [B_s, ID] and head weights wts[s]
// [B_s, IH] (before IH^-1/2). Returns the selection of every row of every step.
struct IndexerDecodeSteps {
  int64_t IH = 0, ID = 0, P = 1, topk = 0, num_slots = 0, max_pools = 0;
  bool tail = true;
  std::vector<float> ape;  // [P, ID]
  std::vector<std::vector<int32_t>> slots;
  std::vector<std::vector<float>> qi, ki, gs, wts;
};
std::vector<std::vector<std::vector<int32_t>>> indexer_decode_steps(const IndexerDecodeSteps& in);

// Absorbed MLA decoding for rows b: appends new_latent[b] [KL] at (slots[b], pos[b]) of the latent cache
// [num_slots, max_len, KL] (rounded to bf16 with the new rows), then attends with q [B, NH, dqk] over sel[b]
// (empty: uniform over 0 … pos[b]). kv_b [NH·(dqk+dv), KL] is rounded to bf16. Returns o [B, NH, dv] (bf16 widened).
// Whether mla_decode runs the tensor-core split kernel for these shapes (cuda::mla_decode_tc).
bool mla_decode_on_tensor_cores(int64_t NH, int64_t KL);
std::vector<float> mla_decode(const std::vector<float>& q, const std::vector<float>& kv_b,
                              const std::vector<float>& latent, const std::vector<float>& new_latent,
                              const std::vector<int32_t>& slots, const std::vector<int32_t>& pos,
                              const std::vector<std::vector<int32_t>>& sel, int64_t NH, int64_t dqk, int64_t dv,
                              int64_t KL, int64_t max_len, int64_t max_sel);

// The prefill cache kernels on packed sequences (sequence n into slot slots[n]): kda_store_conv_hist from the
// pre-conv projections raw [T, 3·H·K], kda_final_state from q, k, v [T, H, K], log decays g [T, H·K] and beta
// [T, H]. conv_hist [num_slots, 3, W−1, H·K] and state [num_slots, H, K, K] are uploaded (slots not listed keep
// their values) and returned.
void kda_prefill_caches(const std::vector<float>& raw, const std::vector<float>& q, const std::vector<float>& k,
                        const std::vector<float>& v, const std::vector<float>& g, const std::vector<float>& beta,
                        const std::vector<int64_t>& cu_seqlens, const std::vector<int32_t>& slots, int64_t H,
                        int64_t K, int64_t W, std::vector<float>& conv_hist, std::vector<float>& state);

}  // namespace nextlm::cuda_testing

// ---- mHC (src/cuda/mhc.cu) ----
namespace nextlm::cuda_testing {

// mhc_pre on streams h [T, S, D] with fn [(2+S)S, S·D], base [(2+S)S], scale [3] and the sub-layer norm weight
// norm_w [D]: post [T, S], comb [T, S, S] and the normed collapse a [T, D] (bf16 widened). Outputs are poisoned with
// NaN first. apply_again: then poisoned again and written by mhc_pre_apply from the partials mhc_pre left (as
// training's recomputation runs it); those are returned.
struct MhcPreOut {
  std::vector<float> post, comb, a;
};
MhcPreOut mhc_pre(const std::vector<float>& h, const std::vector<float>& fn, const std::vector<float>& base,
                  const std::vector<float>& scale, const std::vector<float>& norm_w, int64_t T, int64_t S, int64_t D,
                  float rms_eps, float hc_eps, int iters, bool apply_again = false);

// A site's post-mix of h [T, S, D] (y [T, D], post [T, S], comb [T, S, S]) into out, then the next site's mhc_pre on
// out (fn, base, scale, norm_w as mhc_pre's): fused, by mhc_post_project then mhc_pre_apply; else by mhc_post then
// mhc_pre. in_place: out is h's buffer. Outputs poisoned with NaN first; fused says whether one kernel ran.
struct MhcPostPreOut {
  std::vector<float> out, post, comb, a;
  bool fused = false;
};
MhcPostPreOut mhc_post_pre(const std::vector<float>& h, const std::vector<float>& y, const std::vector<float>& post,
                           const std::vector<float>& comb, const std::vector<float>& fn,
                           const std::vector<float>& base, const std::vector<float>& scale,
                           const std::vector<float>& norm_w, int64_t T, int64_t S, int64_t D, float rms_eps,
                           float hc_eps, int iters, bool fuse, bool in_place);

}  // namespace nextlm::cuda_testing

// ---- DSA indexer prefill (src/cuda/dsa.cu) ----
namespace nextlm::cuda_testing {

// The prefill indexer on packed sequences as the model runs it: pool_keys, then indexer_select with a score
// workspace of score_rows tokens (0: indexer_score_rows, as the model). qi [T, IH·ID], LayerNormed keys ki [T, ID],
// gate scores gs [T, ID], head weights wts [T, IH] (before IH^-1/2), ape [P, ID]. sel and count are poisoned first;
// returns each token's selection (sequence-relative positions).
struct IndexerPrefill {
  int64_t IH = 0, ID = 0, P = 1, topk = 0, score_rows = 0;
  bool tail = true;
  std::vector<int64_t> cu_seqlens;
  std::vector<float> qi, ki, gs, wts, ape;
};
std::vector<std::vector<int32_t>> indexer_prefill(const IndexerPrefill& in);

// cuda::Gemm (cuBLASLt, or its batch-invariant mode) on x [T, in] and W [out, in], both rounded to bf16: y [T, out]
// fp32; with y0 non-empty, y = y0 + x·Wᵀ.
std::vector<float> dense_gemm(const std::vector<float>& x, const std::vector<float>& W, const std::vector<float>& y0,
                              int64_t T, int64_t out, int64_t in, bool invariant);

}  // namespace nextlm::cuda_testing

namespace nextlm::cuda_testing {

// Allocates `bytes` from a fresh device arena (the model's activation allocator) and gives them back: throws the
// arena's error when the device cannot hold them.
void arena_alloc(size_t bytes);

}  // namespace nextlm::cuda_testing
