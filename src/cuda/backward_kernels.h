// Launchers of the CUDA kernels of the training backward (the device counterparts of src/model/backward.h). Shapes
// use the project's letters; all pointers are device pointers. Conventions, as on the CPU:
//  * input gradients (dx, dh, dq, …) are ADDED into caller-zeroed buffers, unless a comment says "written";
//  * parameter gradients (dw, dfn, ddt_bias, …) are ADDED (fp32), so they accumulate over micro-batches;
//  * everything is fp32 unless a pointer is bf16; a reduction over tokens into a parameter gradient runs in an order
//    fixed by the shapes (per-block partials, then a second pass), so gradients are reproducible run to run, except
//    where a comment says atomics are used.
// The GEMMs of the backward (dx = dy·W, dW += dyᵀ·x) go through cuda::Gemm (gemm.h).
#pragma once
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace nextlm::cuda {

// ---- Norms and mHC (src/cuda/mhc_backward.cu) ----

// Backward of y = w ⊙ x·rsqrt(mean(x²) + eps) over rows of width n (w null: unweighted). x [rows, n] (row stride
// ldx) is the forward's input, dy [rows, n] (contiguous). dx [rows, n] += …; dw [n] += … (ignored when w is null).
// work: rmsnorm_backward_workspace_floats(rows, n) floats.
int64_t rmsnorm_backward_workspace_floats(int64_t rows, int64_t n);
void rmsnorm_backward(const float* x, int64_t ldx, const float* w, const float* dy, float* dx, float* dw, int64_t rows,
                      int64_t n, float eps, float* work, cudaStream_t st);

// Backward of mhc_pre (kernels.h: the mix and the normed collapse a = RMSNorm(Σ_s pre_s·h_s; norm_w)) from the
// streams h [T, S, D] entering the site; everything else is recomputed. dpost [T, S], dcomb [T, S, S] and da [T, D]
// are the gradients of its outputs (da: of a, whose forward value was rounded to bf16; the backward uses the fp32
// value). dh [T, S, D] += …; dfn [(2+S)S, S·D], dbase [(2+S)S], dscale [3], dnorm_w [D] += …, or all four null
// (the parameters frozen: dh alone, the same bits). work: mhc_pre_backward_workspace_floats(T, S, D) floats.
// mix (optional): the forward's mix of h (mhc_pre's), which the backward then takes instead of projecting h again
// (the forward's coefficients bit for bit, and a streaming statistics pass without the projection's FMAs, 96 of 110
// a column at S = 4), where D is a multiple of 4 and h, da and norm_w are 16-byte aligned (else it projects again).
// dout and comb (optional, both or neither): the site's post-mix output gradient [T, S, D] and matrices [T, S, S]
// (mhc_post_backward's dout and comb), where that call was given no dh: dh is then written (not added to) as the
// post-mix's term Σ_s comb[t, r, s]·dout[t, s] plus this site's, the same bits as the two calls with dh, without
// writing and reading that term back. Only where mhc_pre_backward_forms_mix(S, parameter gradients wanted) holds.
// Matches mhc_pre_backward + rmsnorm_backward of the CPU.
int64_t mhc_pre_backward_workspace_floats(int64_t T, int64_t S, int64_t D);
void mhc_pre_backward(const MhcParams& p, const float* h, const float* dpost, const float* dcomb, const float* da,
                      float* dh, float* dfn, float* dbase, float* dscale, float* dnorm_w, float* work, cudaStream_t st,
                      const float* mix = nullptr, const float* dout = nullptr, const float* comb = nullptr);
// Whether mhc_pre_backward takes dout and comb at S streams, with or without the parameter gradients: without them, at
// S ≤ 4 (the all-streams dh kernel).
bool mhc_pre_backward_forms_mix(int64_t S, bool params);

// Backward of mhc_post (h_out[t, s] = post[t, s]·y[t] + Σ_r comb[t, r, s]·h[t, r]) given dout [T, S, D]; h [T, S, D]
// are the streams before the post-mix, y [T, D] the sub-layer output. dh [T, S, D], dy [T, D], dpost [T, S],
// dcomb [T, S, S] all += …, or without accumulate all = … (no need to zero them first). dy16 (optional): dy rounded to
// bf16 as well (as to_bf16 rounds it), the form the sub-layer's GEMMs take; dy may then be null, unless accumulating.
// dh, dpost and dcomb may be null (not formed); without accumulate, dpost and dcomb both null, h and y are not read.
void mhc_post_backward(const float* h, const float* y, const float* post, const float* comb, const float* dout,
                       float* dh, float* dy, float* dpost, float* dcomb, int64_t T, int64_t S, int64_t D,
                       cudaStream_t st, bool accumulate = true, bf16* dy16 = nullptr);

// Backward of stream_mean_norm (out[t] = RMSNorm(mean_s h[t, s]; w)) given dout [T, D]: dh [T, S, D] += … (without
// accumulate: = …, no need to zero it first), dw [D] += …. work: rmsnorm_backward_workspace_floats(T, D) floats, + T·D
// without mean. mean: the forward's fp32 mean (stream_mean_norm's), read instead of formed again from h (the same
// arithmetic: the same bits).
void stream_mean_norm_backward(const float* h, const float* w, const float* dout, float* dh, float* dw, int64_t T,
                               int64_t S, int64_t D, float eps, float* work, cudaStream_t st, bool accumulate = true,
                               const float* mean = nullptr);

// ---- Head, embedding, MoE pieces (src/cuda/moe_backward.cu) ----

// For rows of logits [n, V] (fp32) with targets target [n] (< 0: no term) and optional weights wt [n] (null: 1):
// loss[r] = −wt[r]·log softmax(logits[r])[target[r]] (written; 0 without a term), and dlogits [n, V] (bf16, written)
// = wt[r]·(softmax(logits[r]) − onehot(target[r])), zero rows without a term.
// Rows of 16384 to 163840 logits (V a multiple of 4, aligned rows) are read once, each cut over a cluster of CTAs
// that stream them in (softmax_xent_stream_kernel); others are read twice by a block a row.
void softmax_xent_backward(const float* logits, const int32_t* target, const float* wt, double* loss, bf16* dlogits,
                           int64_t n, int64_t V, cudaStream_t st);
// Whether softmax_xent_backward may take the streaming kernel (on by default; NEXTLM_XENT_STREAM=0 or
// set_xent_stream(false), process-wide, for the tests and the benchmarks to compare the two).
void set_xent_stream(bool on);
bool xent_stream();

// dembed [V, D] += Σ_s dh[t, s] at row tok[t] for every t, except tok[t] == pad_id (pad_id < 0: none). Atomics (the
// order of additions into a repeated token's row is not fixed).
void embedding_backward(const int32_t* tok, const float* dh, float* dembed, int64_t T, int64_t S, int64_t D,
                        int64_t pad_id, cudaStream_t st);

// Backward of swiglu (kernels.h) from gu [n, 2I] (gate | up) and dact [n, I], each fp32 or bf16 (widened: the same
// arithmetic): dgu [n, 2I] written in bf16 (the input of the two GEMMs that follow). Zero gradient where a clamp is
// active (gate > L; up outside [−L, L]), passing at exactly ±L, as torch.clamp. rows_held (device, optional): rows
// from *rows_held on belong to other ranks' experts (expert parallelism; gu and dact are not read there) and get a
// zero gradient.
// G and A: float or bf16 (instantiated for the four pairs).
template <class G, class A>
void swiglu_backward(const G* gu, const A* dact, bf16* dgu, int64_t n, int64_t I, float limit, cudaStream_t st,
                     const int32_t* rows_held = nullptr);

// Backward of moe_combine (y[t] += Σ_i w[t, i]·out[slot_of[t, i]]) for the experts' outputs: dout [T·k, D] written
// in bf16 (row slot_of[t, i] = w[t, i]·dy[t]). The weights' gradient dy[t]·out[slot_of[t, i]] is
// moe_weights_backward's, which needs no outputs.
void moe_combine_backward(const float* dy, const int32_t* slot_of, const float* weights, bf16* dout, int64_t T,
                          int64_t k, int64_t D, cudaStream_t st);
// The routing weights' gradient without the experts' outputs: with out[p] = down(act[p]) linear in act[p] and
// dact[p] = dout[p]·∂out/∂act = w·(dy[t]·∂out/∂act), dy[t]·out[p] = act[p]·dact[p] / w (out has no bias). dweights
// [T, k] written from act [T·k, I] (bf16, the down projection's input) and dact [T·k, I]; zero where w is zero (a
// zero weight is a sigmoid that underflowed, whose logit gets no gradient either way) and, under expert parallelism,
// for rows from *rows_held on (other ranks' experts).
// A: float or bf16.
template <class A>
void moe_weights_backward(const bf16* act, const A* dact, const int32_t* slot_of, const float* weights,
                          float* dweights, int64_t T, int64_t k, int64_t I, cudaStream_t st,
                          const int32_t* rows_held = nullptr);

// Backward of gather_rows for the MoE: dx[t] += Σ_i dxp[slot_of[t, i]] in i order. dxp [T·k, D], P float or bf16.
template <class P>
void moe_gather_backward(const P* dxp, const int32_t* slot_of, float* dx, int64_t T, int64_t k, int64_t D,
                         cudaStream_t st);

// Backward of the routing weights (moe_route; the chosen experts are constants): from the router logits [T, E] and
// the chosen experts [T, k], given dweights [T, k]: dlogits [T, E] written (zero at experts not chosen), through
// weights = scale·s_i (/ Σ_j s_j when norm), s = sigmoid(logit). The correction bias only chose the experts.
void moe_route_backward(const float* logits, const int32_t* experts, const float* dweights, float* dlogits,
                        int64_t T, int64_t E, int64_t k, bool norm, float scale, cudaStream_t st);

// How kda_chunked_backward forms its matrix products (see there).
enum class KdaBackwardProducts { SplitBf16, Bf16 };

// ---- KDA (src/cuda/kda_backward.cu, kda_chunked_backward.cu: the recurrence; kda_layer_backward.cu: the rest) ----

// Backward of the delta rule (the recurrent form, the definition of kda_chunked) over packed sequences from zero
// states: q, k, v, g [T, H, K] (q normalised and scaled, k normalised, g the log decay), beta [T, H], do [T, H, K].
// cu [N+1] device sequence offsets. dq, dk, dv, dg [T, H, K] and dbeta [T, H] += …. States are recomputed from
// checkpoints. work: kda_recurrent_backward_workspace_bytes(T, N, H, K) bytes. K ≤ 128.
size_t kda_recurrent_backward_workspace_bytes(int64_t T, int64_t N, int64_t H, int64_t K);
void kda_recurrent_backward(const float* q, const float* k, const float* v, const float* g, const float* beta,
                            const float* do_, const int32_t* cu, int64_t N, int64_t T, int64_t H, int64_t K,
                            float* dq, float* dk, float* dv, float* dg, float* dbeta, void* work, cudaStream_t st);

// The same gradients from the chunked (WY) form (src/cuda/kda_chunked_backward.cu): per chunk of 64 tokens as ch
// describes them (the forward's plan), parallel over chunks except two passes over each sequence's chunks that carry
// the state and its gradient; the matrix products on tensor cores in split bf16 (hi + lo, three MMAs, fp32 sums:
// about fp32's accuracy), reproducible (no atomics). Inputs and outputs as
// kda_recurrent_backward; every sequence starts from a zero state. K ∈ {32, 64, 128}. work:
// kda_chunked_backward_workspace_bytes(ch.num_chunks, T, H, K) bytes (385 KiB per chunk and head at K = 128, so
// 1.5 GiB at T = 4096, H = 64). With accumulate false the gradients are written instead of added to, at every token
// of ch's chunks (the same bits as adding into zeros; no zeroing pass needed).
// products: SplitBf16 as above; Bf16 forms each product from the operands' bf16 roundings alone (one MMA in place
// of three, as the tensor-core forward kda_tc.cu does: ~1e-3 relative in the gradients).
// kept_h, kept_u: the states entering every chunk and v_new as the tensor-core forward left them
// (KdaTcStates::chunk_h, chunk_u, for the same ch), taken instead of recomputed (the first state pass does not run:
// the gradient of the forward's own values); both or neither.
size_t kda_chunked_backward_workspace_bytes(int64_t num_chunks, int64_t T, int64_t H, int64_t K);
// The decay gate's inputs, for kda_chunked_backward to form g itself (in its first kernel, as kda_gate forms it: the
// same bits) instead of reading a kept g: f [T, H, K] the f_b output without dt_bias, dt_bias [H·K], A_log [H].
struct KdaGateInputs {
  const float *f = nullptr, *dt_bias = nullptr, *A_log = nullptr;
  bool has_bound = false;
  float bound = 0.0f;
};
// Operands that a step with bf16 products (KdaBackwardProducts::Bf16, which read only their bf16 roundings) passes in
// bf16 instead of fp32: do_ [T, H, K] (then kda_chunked_backward's do_ is null) and kept_u (KdaTcStates::chunk_u16,
// then its kept_u is null; kept_h is still given). Half the bytes, the same bits as fp32 copies of the same values.
struct KdaBf16Operands {
  const bf16* do_ = nullptr;
  const bf16* kept_u = nullptr;
};
// The head dims the chunked form takes (else kda_recurrent_backward).
inline bool kda_chunked_backward_supported(int64_t K) { return K == 32 || K == 64 || K == 128; }
// Bf16 products run the first kernel (prep) in a compact form, two blocks an SM, with the same bits as the full form
// (on by default; NEXTLM_KDA_PREP_COMPACT=0 or set_kda_backward_compact_prep(false), process-wide, for the tests and
// the benches' comparisons).
void set_kda_backward_compact_prep(bool on);
bool kda_backward_compact_prep();
// In: q, k and v in fp32, or in bf16 (the tensor-core forward's inputs, which a training step keeps instead of fp32
// copies): widened as they are read, so the same gradients, bit for bit, as from fp32 copies of them; half the bytes
// (instantiated for float and bf16). With gate.f, g is null and formed from gate's inputs. b16: see KdaBf16Operands.
template <class In>
void kda_chunked_backward(const In* q, const In* k, const In* v, const float* g, const float* beta, const float* do_,
                          const KdaChunks& ch, int64_t T, int64_t H, int64_t K, float* dq, float* dk, float* dv,
                          float* dg, float* dbeta, void* work, cudaStream_t st, bool accumulate = true,
                          KdaBackwardProducts products = KdaBackwardProducts::SplitBf16,
                          const float* kept_h = nullptr, const float* kept_u = nullptr,
                          const KdaGateInputs& gate = {}, const KdaBf16Operands& b16 = {});

// Backward of kda_conv_norm (fp32 form): raw [T, 3·HK] the projections, conv [3·HK, W]; dq, dk, dv [T, H, K] the
// gradients of its outputs. draw [T, 3·HK] += …, or (draw null) draw16 [T, 3·HK] = bf16(…), the same gradient
// rounded as the projection's backward reads it; dconv [3·HK, W] += … (null: not formed). seq_start [T] as the
// forward. work: kda_conv_norm_backward_workspace_floats(T, H, K, W, two_pass) floats. At 4 taps one kernel forms
// dpre in registers and the gradients from it; two_pass (for the tests) runs the dpre pass and the per-channel pass
// apart through the workspace, as other tap counts do: the same bits.
int64_t kda_conv_norm_backward_workspace_floats(int64_t T, int64_t H, int64_t K, int64_t W, bool two_pass = false);
void kda_conv_norm_backward(const float* raw, const float* conv, const int32_t* seq_start, const float* dq,
                            const float* dk, const float* dv, float* draw, float* dconv, int64_t T, int64_t H,
                            int64_t K, int64_t W, float* work, cudaStream_t st, bf16* draw16 = nullptr,
                            bool two_pass = false);

// Backward of the gate: f [T, HK] the f_b output (before dt_bias), g = kda_gate(f): dg [T, HK] → df [T, HK] written
// (the gradient of the f_b output; with df16, written there in bf16 instead, df unused), ddt_bias [HK] += …,
// dA_log [H] += … (either null: not formed; both from the fp32 values). work: kda_gate_backward_workspace_floats(T, H,
// K) floats.
int64_t kda_gate_backward_workspace_floats(int64_t T, int64_t H, int64_t K);
void kda_gate_backward(const float* f, const float* dt_bias, const float* A_log, const float* dg, float* df,
                       float* ddt_bias, float* dA_log, int64_t T, int64_t H, int64_t K, bool has_bound, float bound,
                       float* work, cudaStream_t st, bf16* df16 = nullptr);

// d ← d·y·(1 − y) in place (the backward of y = sigmoid(x), for β and the output gate).
void sigmoid_backward_inplace(const float* y, float* d, int64_t n, cudaStream_t st);

// Backward of kda_out_norm (on = RMSNorm_K(o; w)·sigmoid(gate)): o [T, H, K] fp32 (or bf16, as the tensor-core
// recurrence writes it: the same sums as its fp32 widening), gate [T, HK] (before the sigmoid), don [T, HK] fp32.
// do_ [T, H, K] += … (written without accumulate; with do16, written there in bf16 instead, do_ null and accumulate
// false), dgate [T, HK] written (with dgate16, in bf16 there instead, dgate unused), dw [K] += … (null: not formed).
// work: kda_out_norm_backward_workspace_floats(T, H, K) floats.
int64_t kda_out_norm_backward_workspace_floats(int64_t T, int64_t H, int64_t K);
void kda_out_norm_backward(const float* o, const float* gate, const float* w, const float* don, float* do_,
                           float* dgate, float* dw, int64_t T, int64_t H, int64_t K, float eps, float* work,
                           cudaStream_t st, bool accumulate = true, bf16* dgate16 = nullptr, bf16* do16 = nullptr);
void kda_out_norm_backward(const bf16* o, const float* gate, const float* w, const float* don, float* do_,
                           float* dgate, float* dw, int64_t T, int64_t H, int64_t K, float eps, float* work,
                           cudaStream_t st, bool accumulate = true, bf16* dgate16 = nullptr, bf16* do16 = nullptr);

// ---- DSA (src/cuda/dsa_backward.cu) ----

// Backward of mla_sparse_attention (the expanded form): q [T, NH, dqk], kv [T, NH, dqk+dv] (k | v per head) fp32,
// the selection (sel, count, max_sel) and seq_start / seq_len as the forward got them (an empty selection has
// uniform weights over keys seq_start … seq_start + seq_len − 1), do [T, NH, dv]. dq [T, NH, dqk] += …,
// dkv [T, NH, dqk+dv] += …, both reproducibly (no atomics). max_len ≥ the longest packed sequence (bounds the
// selected positions); a selection holds no key twice. Head dims: dqk ≤ 256, dqk + dv ≤ 512 (rounded up to 4s).
// work: mla_sparse_attention_backward_workspace_bytes(T, NH, max_len) bytes.
size_t mla_sparse_attention_backward_workspace_bytes(int64_t T, int64_t NH, int64_t max_len);
void mla_sparse_attention_backward(const float* q, const float* kv, const int32_t* sel, const int32_t* count,
                                   const int32_t* seq_start, const int32_t* seq_len, const float* do_, float* dq,
                                   float* dkv, int64_t T, int64_t NH, int64_t dqk, int64_t dv, int64_t max_sel,
                                   int64_t max_len, void* work, cudaStream_t st);

// The same function on tensor cores (src/cuda/mla_tc_backward.cu) for the head dims mla_backward_tc_supported
// accepts (those of mla_tc_supported): q bf16 [T, NH, dqk], kv bf16 [T, NH, dqk+dv] (16-byte aligned), do_ fp32
// [T, NH, dv]; dq, dkv fp32 += …, reproducibly (no atomics). The products run in bf16 (do, the softmax weights and
// their gradients are rounded to bf16), the sums in fp32: a few 1e-3 of norm-relative error against the fp32
// function (tests bound it by 1e-2). The row log-sum-exp and D = Σ p·dp are recomputed inside (a stats pass), or,
// given the forward's (mla_sparse_attention_tc) lse2 [T, NH] and output o bf16 [T, NH, dv] (16-byte aligned), taken
// from them: lse2 as it is and D = Σ do·o, the same quantity (Σ_j p_j·(do·v_j) = do·o) without a pass over the keys.
// Its cost follows the (64-query, 64-key) tile pairs holding any selected pair; at most 2^21 tokens.
// work: mla_sparse_attention_backward_tc_workspace_bytes(T, NH, max_len, dqk, dv) bytes, 16-byte aligned.
// With dq16 and dkv16 (bf16, 16-byte aligned; head dims where mla_backward_tc_bf16_outputs holds) the gradients
// are written there in bf16, each element its fp32 sum rounded once, instead of being added to dq and dkv (then not
// read): what the projections' backward takes, without fp32 arrays to zero, add into and convert.
bool mla_backward_tc_supported(int64_t dqk, int64_t dv);
bool mla_backward_tc_bf16_outputs(int64_t dqk, int64_t dv);
size_t mla_sparse_attention_backward_tc_workspace_bytes(int64_t T, int64_t NH, int64_t max_len, int64_t dqk,
                                                         int64_t dv);
void mla_sparse_attention_backward_tc(const bf16* q, const bf16* kv, const int32_t* sel, const int32_t* count,
                                      const int32_t* seq_start, const int32_t* seq_len, const float* do_, float* dq,
                                      float* dkv, int64_t T, int64_t NH, int64_t dqk, int64_t dv, int64_t max_sel,
                                      int64_t max_len, void* work, cudaStream_t st, const float* lse2 = nullptr,
                                      const bf16* o = nullptr, bf16* dq16 = nullptr, bf16* dkv16 = nullptr);

// The same function query-major (src/cuda/dsa_backward_scatter.cu): one block per (token, head), dk and dv added
// with atomics (their order of additions, so their rounding, changes from run to run). Its work is proportional to
// the selected pairs, the tiled kernel's to the causal triangle's tiles that hold any: it is the faster one when the
// selection is sparse in the triangle (long sequences; mla_backward_use_scatter decides).
void mla_sparse_attention_backward_scatter(const float* q, const float* kv, const int32_t* sel,
                                           const int32_t* count, const int32_t* seq_start, const int32_t* seq_len,
                                           const float* do_, float* dq, float* dkv, int64_t T, int64_t NH, int64_t dqk,
                                           int64_t dv, int64_t max_sel, cudaStream_t st);
// Whether the scatter kernel is the faster for a batch whose selections hold at most `selected` (query, key) pairs
// in all, out of `causal` pairs of the sequences' causal triangles: measured on the H200 at NH 64, dqk = dv = 256,
// the tiled kernel costs ~18 ns per causal pair, the scatter ~41 ns per selected pair.
inline bool mla_backward_use_scatter(double selected, double causal) { return selected * 41.0 < causal * 18.0; }

}  // namespace nextlm::cuda
