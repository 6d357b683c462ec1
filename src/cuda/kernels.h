// Launchers of the CUDA kernels of the bf16 forward (declared without CUDA types so that host code can see them
// through device_model.cu only). Shapes use the project's letters; all pointers are device pointers.
#pragma once
#include <cstdint>

#include "cuda/common.cuh"

namespace nextlm::cuda {

// h[t, s, :] = embed[tok[t]] for every stream s. embed bf16 [V, D]; h fp32 [T, S, D].
void embed_streams(const int32_t* tok, const bf16* embed, float* h, int64_t T, int64_t S, int64_t D, cudaStream_t st);
// A vocabulary-parallel embedding's share: x[t] = embed[tok[t] − begin] (fp32 [T, D]) when the token is one of the
// rows [begin, begin + rows) that embed [rows, D] holds, else zero; summed over the ranks it is the embedding.
void embed_rows_range(const int32_t* tok, const bf16* embed, int64_t begin, int64_t rows, float* x, int64_t T,
                      int64_t D, cudaStream_t st);
// h[t, s, :] = x[t] for every stream s.
void expand_streams(const float* x, float* h, int64_t T, int64_t S, int64_t D, cudaStream_t st);

// mHC pre for one site: from h [T, S, D] the mix (post [T, S], comb [T, S, S]) and the normed sub-layer input
// a = RMSNorm(Σ_s pre_s·h_s; norm_w) in bf16 [T, D]. fn fp32 [(2+S)S, S·D], base [(2+S)S], scale [3].
struct MhcParams {
  const float* fn;
  const float* base;
  const float* scale;
  const float* norm_w;
  int64_t T, S, D;
  float rms_eps, hc_eps;
  int iters;
};
// work: mhc_pre_workspace_floats(T, S, D) floats (the projection's partials: per chunk, or for T <= 16 per chunk and
// warp chain). Every reduction runs in an order fixed by S and D, so a token's outputs are bitwise the same whatever
// else is in the batch.
int64_t mhc_pre_workspace_floats(int64_t T, int64_t S, int64_t D);
// mix (optional) [T, (2+S)S + 1]: the mix the coefficients came from, fn·h[t] and Σh², for mhc_pre_backward.
void mhc_pre(const MhcParams& p, const float* h, float* post, float* comb, bf16* a, float* work, cudaStream_t st,
             float* mix = nullptr);
// mhc_pre without the projection: from the partials an mhc_pre call on the same p and h left in work (training's
// recomputation keeps them from the forward), the same post, comb, a (and mix) bit for bit.
void mhc_pre_apply(const MhcParams& p, const float* h, float* post, float* comb, bf16* a, const float* work,
                   cudaStream_t st, float* mix = nullptr);
// h[t, s] ← post[t, s]·y[t] + Σ_r comb[t, r, s]·h[t, r], in place. y fp32 [T, D].
void mhc_post(float* h, const float* y, const float* post, const float* comb, int64_t T, int64_t S, int64_t D,
              cudaStream_t st);
// The same into out [T, S, D] (h left as it is; out == h is the in-place form).
void mhc_post(const float* h, float* out, const float* y, const float* post, const float* comb, int64_t T, int64_t S,
              int64_t D, cudaStream_t st);
// mhc_post into out (which may be h), then the first half of mhc_pre for the next site on out: the projection's
// partials in work, from which mhc_pre_apply(next, out, …, work) makes the next site's mix and input. next.T, S, D
// are the shapes of both. fuse: one kernel where mhc_post_project_fuses(T, S, D) and h, out, y and next.fn are
// 16-byte aligned, which does not read the new streams back; the same bits as the two passes either way. Returns
// whether it fused.
bool mhc_post_project(const float* h, float* out, const float* y, const float* post, const float* comb,
                      const MhcParams& next, float* work, cudaStream_t st, bool fuse = true);
bool mhc_post_project_fuses(int64_t T, int64_t S, int64_t D);
// out[t] = mean_s h[t, s], then RMSNorm with w, bf16 [T, D]; the fp32 mean into mean [T, D] too when non-null (for
// stream_mean_norm_backward).
void stream_mean_norm(const float* h, const float* w, bf16* out, int64_t T, int64_t S, int64_t D, float eps,
                      cudaStream_t st, float* mean = nullptr);

// y[r] = RMSNorm(x[r]; w) for rows of width n (x row stride ldx); writes bf16 (and fp32 if y32 is non-null).
void rmsnorm_rows(const float* x, int64_t ldx, const float* w, bf16* y, float* y32, int64_t rows, int64_t n, float eps,
                  cudaStream_t st);
// Conversions of n values: y = bf16(x); round_to_bf16 also sets x to float(y); bf16_to_f32: y = float(x).
void to_bf16(const float* x, bf16* y, int64_t n, cudaStream_t st);
void round_to_bf16(float* x, bf16* y, int64_t n, cudaStream_t st);
void bf16_to_f32(const bf16* x, float* y, int64_t n, cudaStream_t st);

// ---- KDA ----
// raw [T, 3·HK] (q | k | v projections) → q, k, v fp32 [T, H, K]: causal depthwise conv (per sequence; seq_start[t]
// is the first token of t's sequence), SiLU, and for q, k the L2 norm (q also times K^-1/2). conv fp32 [3·HK, W].
void kda_conv_norm(const float* raw, const float* conv, const int32_t* seq_start, float* q, float* k, float* v,
                   int64_t T, int64_t H, int64_t K, int64_t W, cudaStream_t st);
void kda_conv_norm(const float* raw, const float* conv, const int32_t* seq_start, bf16* q, bf16* k, bf16* v,
                   int64_t T, int64_t H, int64_t K, int64_t W, cudaStream_t st);
// The fp32 form followed by round_to_bf16 of q, k and v into q16, k16, v16, in one pass for W = 4.
void kda_conv_norm_rounded(const float* raw, const float* conv, const int32_t* seq_start, float* q, float* k,
                           float* v, bf16* q16, bf16* k16, bf16* v16, int64_t T, int64_t H, int64_t K, int64_t W,
                           cudaStream_t st);
// g [T, HK] in place: from f_b output to the log decay (safe gate when has_bound, else softplus form); or g = that
// of f (out of place).
void kda_gate(float* g, const float* dt_bias, const float* A_log, int64_t T, int64_t H, int64_t K, bool has_bound,
              float bound, cudaStream_t st);
void kda_gate(const float* f, float* g, const float* dt_bias, const float* A_log, int64_t T, int64_t H, int64_t K,
              bool has_bound, float bound, cudaStream_t st);
void sigmoid_inplace(float* x, int64_t n, cudaStream_t st);
// The chunked delta rule over packed sequences. chunk_* describe every chunk of 64 (sequence-relative): start token,
// length; seq_* every sequence: first chunk index, chunk count. work: kda_workspace_floats(T, H, K) floats.
struct KdaChunks {
  const int32_t* chunk_start;
  const int32_t* chunk_len;
  const int32_t* seq_first_chunk;
  const int32_t* seq_num_chunks;
  int64_t num_chunks, num_seqs;
};
int64_t kda_workspace_floats(int64_t num_chunks, int64_t H, int64_t K);
void kda_chunked(const float* q, const float* k, const float* v, const float* g, const float* beta, float* o,
                 const KdaChunks& ch, float* work, int64_t T, int64_t H, int64_t K, cudaStream_t st);
// o [T, H, K] ← RMSNorm_K(o; w)·sigmoid(gate), written as bf16 [T, HK].
void kda_out_norm(const float* o, const float* gate, const float* w, bf16* out, int64_t T, int64_t H, int64_t K,
                  float eps, cudaStream_t st);
void kda_out_norm(const bf16* o, const float* gate, const float* w, bf16* out, int64_t T, int64_t H, int64_t K,
                  float eps, cudaStream_t st);

// The chunked delta rule on tensor cores (src/cuda/kda_tc.cu) for the safe gate: q, k, v bf16 [T, H, K] as
// kda_conv_norm leaves them, graw [T, HK] the f_b output before dt_bias (fp32 or bf16), beta [T, H] after the
// sigmoid; o bf16 [T, H, K] (null: not written). The workspace holds per (chunk, head) factors:
// kda_tc_workspace_bytes bytes, carved by kda_tc_workspace. A chunk's outputs for its rows 0 … r depend on those rows
// only (and the state it starts from): a chunk cut short after row r gives them bit for bit (kda_tc.cu: the
// references), which decoding relies on.
struct KdaTcWork {
  bf16 *w, *u, *qg, *kd, *aqk;
  float* gl;
};
// The fp32 states [rows, H, K, K] a sequence starts from (in) and leaves (out); each may be null (zero start, nothing
// left); in may equal out. Sequence n uses row row[n] (row null: row n). With boundary, out gets the state after the
// sequence's last complete (64-token) chunk, and is left as it is for a sequence without one.
// chunk_h, chunk_u (training: a forward whose activations the backward keeps): every chunk's start state S0 fp32
// [num_chunks, H, K, K] and v_new = U − W·S0 fp32 [num_chunks, H, 64, K] (rows past the chunk's length untouched),
// in kda_chunked_backward's per (chunk, head) order, which then takes them instead of recomputing them. chunk_u16:
// v_new in bf16 instead (as the kernel's own product reads it: the bf16 rounding of chunk_u's values), for a
// backward with bf16 products (KdaBf16Operands::kept_u); at most one of chunk_u and chunk_u16.
struct KdaTcStates {
  const float* in = nullptr;
  float* out = nullptr;
  const int32_t* row = nullptr;
  bool boundary = false;
  float* chunk_h = nullptr;
  float* chunk_u = nullptr;
  bf16* chunk_u16 = nullptr;
};
// What decoding keeps of a slot's partial chunk besides its inputs (decode_kernels.h, kda_tc_step), per (slot, head):
// t [64, 64] the rows of T = (I + β·strict(Akk))⁻¹ (fp32, the blocks on and left of the diagonal), xs [64, 48] the
// products Xs that the inverse's off-diagonal blocks take for each row (fp32), vn [64, K] v_new = U − W·S (bf16),
// and sb [K·K] the chunk's start state in bf16, laid out as the steps' MMA fragments (kda_tc_state_frags). Given to
// kda_chunked_tc, the kernels write t, xs and vn for the chunks of the call (chunk_start = 64·slot: the chunk
// buffers' layout), after which kda_tc_step extends them one row at a time.
constexpr int kKdaTcXsCols = 48;
struct KdaTcRowCache {
  float* t = nullptr;
  float* xs = nullptr;
  bf16* vn = nullptr;
  bf16* sb = nullptr;
};
bool kda_tc_supported(int64_t K, bool has_bound, float bound);
size_t kda_tc_workspace_bytes(int64_t num_chunks, int64_t H, int64_t K);
KdaTcWork kda_tc_workspace(void* base, int64_t num_chunks, int64_t H, int64_t K);
void kda_chunked_tc(const bf16* q, const bf16* k, const bf16* v, const float* graw, const float* beta,
                    const float* dt_bias, const float* A_log, float bound, bf16* o, const KdaChunks& ch,
                    const KdaTcWork& w, int64_t H, int64_t K, const KdaTcStates& states, cudaStream_t st,
                    const KdaTcRowCache& rows = {});
// Its two kernels, for timing them apart.
void kda_tc_prepare(const bf16* q, const bf16* k, const bf16* v, const float* graw, const float* beta,
                    const float* dt_bias, const float* A_log, float bound, const KdaChunks& ch, const KdaTcWork& w,
                    int64_t H, int64_t K, cudaStream_t st, const KdaTcRowCache& rows = {});
void kda_tc_prepare(const bf16* q, const bf16* k, const bf16* v, const bf16* graw, const float* beta,
                    const float* dt_bias, const float* A_log, float bound, const KdaChunks& ch, const KdaTcWork& w,
                    int64_t H, int64_t K, cudaStream_t st, const KdaTcRowCache& rows = {});
void kda_tc_state(const KdaChunks& ch, const KdaTcWork& w, bf16* o, int64_t H, int64_t K, const KdaTcStates& states,
                  cudaStream_t st, const KdaTcRowCache& rows = {});
void kda_chunked_tc(const bf16* q, const bf16* k, const bf16* v, const bf16* graw, const float* beta,
                    const float* dt_bias, const float* A_log, float bound, bf16* o, const KdaChunks& ch,
                    const KdaTcWork& w, int64_t H, int64_t K, const KdaTcStates& states, cudaStream_t st,
                    const KdaTcRowCache& rows = {});

// ---- DSA ----
void layernorm_rows(float* x, const float* w, const float* b, int64_t rows, int64_t n, float eps, cudaStream_t st);
// Selection per token: sel [T, max_sel] sequence-relative key positions ascending, count [T].
struct IndexerParams {
  const float* qi;     // [T, IH, ID]
  const float* ki;     // [T, ID] LayerNormed
  const float* gs;     // [T, ID] gate scores
  const float* wts;    // [T, IH] head weights (weights_proj·a; the kernel applies IH^-1/2)
  const float* ape;    // [P, ID]
  const int32_t* seq_start;
  const int32_t* seq_len;  // per token: length of its sequence
  int64_t T, IH, ID, P, topk, max_pools;
  bool tail;
};
// pool_base per token: index in pk of its sequence's pool 0. max_pools bounds the pools of any sequence.
// scores: workspace [rows, max_pools] (rows ≥ 1, at most T); the tokens are scored and selected rows at a time.
// index_head_dim at most 128. max_sel ≥ min(topk/P, max_pools)·P + P − 1.
void indexer_select(const IndexerParams& p, const int32_t* pool_base, const float* pk, float* scores, int64_t rows,
                    int32_t* sel, int32_t* count, int64_t max_sel, cudaStream_t st);
// The score rows indexer_select should get: all T tokens up to a 128 MiB workspace, else chunks of tokens.
int64_t indexer_score_rows(const IndexerParams& p);
// pool_token [num_pools]: first token of every complete pool of every sequence; pk [num_pools, ID].
void pool_keys(const IndexerParams& p, const int32_t* pool_token, int64_t num_pools, float* pk, cudaStream_t st);
// o [T, NH, dv] (bf16) = softmax over selected keys of q·k·dqk^-1/2, times v. q [T, NH, dqk]; kv [T, NH, dqk+dv].
void mla_sparse_attention(const float* q, const float* kv, const int32_t* sel, const int32_t* count,
                          const int32_t* seq_start, const int32_t* seq_len, bf16* o, int64_t T, int64_t NH,
                          int64_t dqk, int64_t dv, int64_t max_sel, cudaStream_t st);

// The same on tensor cores (src/cuda/mla_tc.cu) for the head dims mla_tc_supported accepts: q bf16 [T, NH, dqk],
// kv bf16 [T, NH, dqk+dv]; mask: T·words uint32 of workspace, words = mla_mask_words(longest sequence). The
// selections must be causal (sel(t) ⊆ [0, t], as the indexer makes them): a block visits a query's keys only up to
// the query itself, so a selected later key would count only when another row of the block reaches it. lse2, when
// given: fp32 [T, NH], each row's log-sum-exp of its scaled scores in the log2 domain, which the tensor-core
// backward (backward_kernels.h) then reads instead of recomputing it.
bool mla_tc_supported(int64_t dqk, int64_t dv);
int64_t mla_mask_words(int64_t max_len);
void mla_sparse_attention_tc(const bf16* q, const bf16* kv, const int32_t* sel, const int32_t* count,
                             const int32_t* seq_start, const int32_t* seq_len, bf16* o, uint32_t* mask,
                             int64_t words, int64_t T, int64_t NH, int64_t dqk, int64_t dv, int64_t max_sel,
                             cudaStream_t st, float* lse2 = nullptr);

// ---- MoE ----
// logits [T, E] → experts [T, k], weights [T, k].
void moe_route(const float* logits, const float* bias, int32_t* experts, float* weights, int64_t T, int64_t E,
               int64_t G, int64_t topk_group, int64_t k, bool norm, float scale, cudaStream_t st);
// rows of x (bf16 [T, D]) gathered in `order` (token of each permuted slot) into xp [n, D].
void gather_rows(const bf16* x, const int32_t* token_of_slot, bf16* xp, int64_t n, int64_t D, cudaStream_t st);
// gu [n, 2I] (gate | up) → act bf16 [n, I] = silu(min(gate, L))·clamp(up, −L, L).
void swiglu(const float* gu, bf16* act, int64_t n, int64_t I, float limit, cudaStream_t st);
// Sorts the T·k routing slots by expert (stable, so tokens stay in order within an expert): token_of_slot [T·k] is
// the token of each permuted row, slot_of [T·k] the permuted row of each (token, i), offsets [E+1] the expert
// boundaries. temp: moe_permute_temp_bytes(T·k) bytes.
size_t moe_permute_temp_bytes(int64_t n);
void moe_permute(const int32_t* experts, int64_t T, int64_t k, int64_t E, int32_t* keys_sorted, int32_t* slots_in,
                 int32_t* slots_sorted, int32_t* token_of_slot, int32_t* slot_of, int32_t* offsets, void* temp,
                 size_t temp_bytes, cudaStream_t st);
// moe_route, moe_permute (over E buckets) and gather_rows of a decoding step's few tokens (T ≤ 32, T·k ≤ 1024) in
// one launch, the same results; returns false, doing nothing, for larger T (then call the three).
bool moe_route_permute_small(const float* logits, const float* bias, int32_t* experts, float* weights, int64_t T,
                             int64_t E, int64_t G, int64_t topk_group, int64_t k, bool norm, float scale,
                             int32_t* keys_sorted, int32_t* slots_sorted, int32_t* token_of_slot, int32_t* slot_of,
                             int32_t* offsets, const bf16* x, bf16* xp, int64_t D, cudaStream_t st);
// y[t] (already the shared expert's output, or zero) += Σ_i w[t, i]·out[slot_of[t, i]] in i order. With
// rows_held (a device int, expert parallelism) only the rows out[0 … *rows_held − 1] exist: the choices of experts
// held elsewhere (moe_localize put them after those rows) add nothing.
void moe_combine(float* y, const float* out, const int32_t* slot_of, const float* weights, int64_t T, int64_t k,
                 int64_t D, cudaStream_t st, const int32_t* rows_held = nullptr);
// Expert parallelism: the chosen experts [n] of the whole model mapped to this rank's, experts[i] − begin when it
// is one of the `count` experts from `begin`, else `count` (a last bucket that moe_permute sorts after them).
void moe_localize(int32_t* experts, int64_t n, int64_t begin, int64_t count, cudaStream_t st);

// ---- lm_head ----
// For rows of logits [n, V]: logprob[r] = logits[r, target[r]] − logsumexp(logits[r]); target < 0 gives 0.
void row_logprob(const float* logits, const int32_t* target, double* out, int64_t n, int64_t V, cudaStream_t st);
// The same over a vocabulary split between ranks, in three steps around two collectives. For rows of a slice
// logits [n, V] holding vocabulary entries begin … begin + V − 1: the slice's max mx[r], Σ exp(x − mx) sum[r] and the
// target's logit tl[r] (0 when another slice holds it) (row_lse_partial); with the max over the ranks gmx (an
// all-reduce max of mx), sum ← sum·exp(mx − gmx) (lse_rescale); after an all-reduce sum of sum and tl,
// out[r] = tl − gmx − log(sum), 0 for target < 0 (lse_finish).
void row_lse_partial(const float* logits, const int32_t* target, int64_t begin, int64_t n, int64_t V, float* mx,
                     float* sum, float* tl, cudaStream_t st);
void lse_rescale(float* sum, const float* mx, const float* gmx, int64_t n, cudaStream_t st);
void lse_finish(const float* tl, const float* gmx, const float* sum, const int32_t* target, double* out, int64_t n,
                cudaStream_t st);

}  // namespace nextlm::cuda
