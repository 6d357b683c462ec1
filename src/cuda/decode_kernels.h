// Launchers of the decoding kernels (src/cuda/decode.cu): one new token for each of B sequences, each sequence in
// its own cache slot. The GPU counterpart of src/model/decode.cpp (kda_layer_forward_cached with the recurrent form,
// indexer_forward_cached, dsa_layer_forward_cached). Every output element is computed by one thread, warp or block
// with a reduction order fixed by the shapes alone, never by B or by the other rows, so a sequence's results are
// bitwise the same whatever else is in its batch (batch invariance). All pointers are device pointers.
#pragma once
#include <cstdint>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/decode_linear.h"  // decode_linear, the GEMV of the steps' projections
#include "cuda/kernels.h"        // KdaTcRowCache

namespace nextlm::cuda {

// ---- KDA ----
// One token per row b, in cache slot slot[b]: the causal conv over [the slot's last W−1 pre-conv projections; the
// new one] (and the history shifted by one), SiLU, L2 norm (q also × K^-1/2), the decay gate from the raw f_b output
// (as kda_gate), then the delta rule on the slot's fp32 state: S ← diag(e^g)·S; u = β(v − Sᵀk); S += k·uᵀ; o = Sᵀq.
struct KdaDecodeParams {
  const float* raw;      // [B, 3·HK] the new q | k | v projections (before the conv)
  const float* conv;     // [3·HK, W] depthwise conv weights
  const float* graw;     // [B, HK] f_b output, before dt_bias
  const float* dt_bias;  // [HK]
  const float* A_log;    // [H]
  const float* beta;     // [B, H] after the sigmoid
  const int32_t* slot;   // [B] cache slot of each row (distinct)
  float* conv_hist;      // [slots, 3, W−1, HK] pre-conv projections of each slot's last W−1 tokens, oldest first
  float* state;          // [slots, H, K, K] recurrent state (row = key dim)
  float* o;              // [B, H, K] output (before the gated output norm)
  int64_t B, H, K, W;
  bool has_bound;  // safe gate bound·sigmoid(e^A_log·f), else −e^A_log·softplus(f)
  float bound;
};
void kda_decode_step(const KdaDecodeParams& p, cudaStream_t st);

// The tensor-core path decodes as the forward computes: each slot keeps the state at its last chunk boundary (every
// 64 tokens from the sequence's start), the inputs of the tokens since (the chunk buffers) and what the forward's
// kernels derive from those rows that later rows reuse (KdaTcRowCache), and each step computes the new row r =
// pos[b] mod 64 of its partial chunk with the forward's operations (src/cuda/kda_tc_decode.cu). A chunk's rows do not
// depend on the rows after them (kernels.h), so a step's output is bit for bit what kda_chunked_tc gives the same
// token on rows 0 … r from the slot's state, put through kda_out_norm's gated norm. A step first appends its token:
// the conv step of kda_decode_step (rounded to bf16), its raw gate and β, as row r of the slot's buffers; it adds its
// rows to the cache, and when
// r = 63 completes the chunk, moves the slot's state on to the next boundary. The cache's rows before r must be
// there: from earlier steps, or from kda_chunked_tc with the cache on the rows a prefill leaves
// (kda_store_chunk_rows) and kda_tc_state_frags.
struct KdaTcStepParams {
  const float* raw;       // [B, 3·HK] the new q | k | v projections before the conv; null: row r of the chunk
                          // buffers already holds each token (the other new-token inputs are then unused)
  const float* conv;      // [3·HK, W]
  const float* graw;      // [B, HK] f_b output, before dt_bias
  const float* beta_new;  // [B, H] before the sigmoid (the b projection)
  float* conv_hist;       // [slots, 3, W−1, HK]
  int64_t W;
  bf16 *q, *k, *v;        // [slots, 64, HK] the chunk buffers: normed q, k, v
  float* g;               // [slots, 64, HK] raw gates
  float* beta;            // [slots, 64, H]
  const float* dt_bias;   // [HK]
  const float* A_log;     // [H]
  float bound;            // the safe gate's lower bound (kda_tc_supported)
  const int32_t* slot;    // [B] distinct
  const int32_t* pos;     // [B] the new token's position in its sequence
  float* state;           // [slots, H, K, K] fp32 state at each slot's last chunk boundary
  KdaTcRowCache rows;     // per slot: t [H, 64, 64], xs [H, 64, 48], vn [H, 64, K], sb [H, K·K]
  bf16* o;                // [B, H, K]: the output after the gated norm (kda_out_norm), or before it without gate
  const float* gate;      // [B, HK] the output gate (g_b output, before its sigmoid), or null
  const float* o_norm;    // [K] the norm's weight
  float eps;
  int64_t B, H, K;
};
void kda_tc_step(const KdaTcStepParams& p, cudaStream_t st);
// The fragments (KdaTcRowCache::sb [slots, H, K·K]) of the states [slots, H, K, K] of the n listed slots, after a
// prefill has left them (the steps keep them up to date from there).
void kda_tc_state_frags(const float* state, const int32_t* slots, int64_t n, bf16* sb, int64_t H, int64_t K,
                        cudaStream_t st);
// The chunk lists (KdaChunks' arrays, host side) of the prompts' partial chunks as the chunk buffers hold them after a
// prefill: prompt n of len[n] tokens in slot slot[n] has rows 64·slot … 64·slot + len mod 64 − 1 (none when len is a
// multiple of 64); `slot` lists each chunk's slot (KdaTcStates::row for the state it starts from).
struct KdaTailLists {
  std::vector<int32_t> start, len, first, count, slot;
  KdaTailLists(const std::vector<int32_t>& lens, const std::vector<int32_t>& slots) {
    for (size_t n = 0; n < lens.size(); ++n)
      if (lens[n] % 64) {
        first.push_back(static_cast<int32_t>(start.size()));
        start.push_back(slots[n] * 64);
        len.push_back(lens[n] % 64);
        count.push_back(1);
        slot.push_back(slots[n]);
      }
  }
  int64_t size() const { return static_cast<int64_t>(start.size()); }
};

// ---- DSA indexer ----
// The indexer's per-slot cache, for the next token of each row at sequence position pos[b] (= the tokens already in
// the slot): its LayerNormed key and gate score wait in the slot's pending rows until their pool completes; the token
// that completes pool j computes the pool's compressed key once (as pool_keys).
struct IndexerDecodeParams {
  const float* qi;      // [B, IH, ID]
  const float* ki;      // [B, ID] LayerNormed keys
  const float* gs;      // [B, ID] compress-gate scores
  const float* wts;     // [B, IH] weights_proj·a (the kernel applies IH^-1/2)
  const float* ape;     // [P, ID]
  const int32_t* slot;  // [B]
  const int32_t* pos;   // [B]
  float* pending_key;   // [slots, P, ID]
  float* pending_gate;  // [slots, P, ID]
  float* pool_key;      // [slots, max_pools, ID]
  float* scores;        // [B, max_pools] workspace
  int64_t B, IH, ID, P, topk, max_pools;
  int64_t max_selectable;  // max over rows of (pos + 1) / P (host-side; sizes the scoring grid)
  bool tail;
};
void indexer_decode_append(const IndexerDecodeParams& p, cudaStream_t st);
// The selection of each row as indexer_select makes it (sequence-relative positions ascending, ties to the lower
// pool; the scores bit for bit, so ID ≤ 128 as there): sel [B, max_sel], count [B]. Run after indexer_decode_append.
void indexer_decode_select(const IndexerDecodeParams& p, int32_t* sel, int32_t* count, int64_t max_sel,
                           cudaStream_t st);

// ---- MLA ----
// The cache keeps the normed kv latent of every token in bf16: exactly what the forward feeds kv_b (it rounds the
// latent to bf16 before that GEMM), so decoding sees the same keys and values as the forward, at half the memory of
// fp32 (KL·2 bytes a token and layer).
// cache[slot[b], pos[b]] = lat[b]: lat bf16 [B, KL]; cache bf16 [slots, max_len, KL].
void mla_decode_append(const bf16* lat, const int32_t* slot, const int32_t* pos, bf16* cache, int64_t B, int64_t KL,
                       int64_t max_len, cudaStream_t st);
// Absorbed MLA over the cached latents: per (row, head) qa = W_kᵀq, softmax over the selected keys of
// qa·c_j·dqk^-1/2, cs = Σ p_j c_j, o = W_v·cs. An empty selection attends uniformly to the keys 0 … pos
// (EmptySelection::SeenKeys).
struct MlaDecodeParams {
  const float* q;         // [B, NH, dqk]
  const bf16* kv_b;       // [NH·(dqk+dv), KL]: per head dqk rows of k, then dv rows of v
  const bf16* latent;     // [slots, max_len, KL] normed latents, the new token's already appended
  const int32_t* slot;    // [B]
  const int32_t* pos;     // [B] the query's position
  const int32_t* sel;     // [B, max_sel] sequence-relative key positions
  const int32_t* count;   // [B]
  bf16* o;                // [B, NH, dv]
  int64_t B, NH, dqk, dv, KL, max_len, max_sel;
  float* work;            // mla_decode_workspace_floats(B, NH, KL) floats
  // Packed rows instead of slots (a forward running these kernels): row b's sequence starts at row row_start[b] of
  // latent [T, KL], and slot and max_len are unused.
  const int32_t* row_start = nullptr;
};
int64_t mla_decode_workspace_floats(int64_t B, int64_t NH, int64_t KL);
void mla_decode_attention(const MlaDecodeParams& p, cudaStream_t st);
// Its two halves, for a caller that overlaps the first with other work: absorb reads q and kv_b only (the queries
// taken into the latent space, in work); attend then needs absorb's work, the latents and the selection.
void mla_decode_absorb(const MlaDecodeParams& p, cudaStream_t st);
void mla_decode_attend(const MlaDecodeParams& p, cudaStream_t st);
// Whether mla_decode_attention scores and sums the keys on tensor cores (16 heads of a row at once; qa and the
// softmax weights as bf16 pairs, fp32 accumulation): NH ≤ 64 and KL one of 32, 64, 128, 256, 512 (and 16-byte aligned
// latents). Otherwise on CUDA cores in fp32 (one block per row, head and split). Either way the choice and every
// reduction order depend on the shapes only.
bool mla_decode_tc(int64_t NH, int64_t KL);

// ---- Filling the caches from a prefill (the packed forward of N prompts, sequence n in slot slot[n]) ----
// seq_start [N] first packed token, seq_len [N] its length.
struct PrefillSeqs {
  const int32_t* seq_start;
  const int32_t* seq_len;
  const int32_t* slot;
  int64_t N;
};
// The conv histories: the last W−1 pre-conv projections of each sequence (zeros before its start) from raw
// [T, 3·HK] into conv_hist [slots, 3, W−1, HK].
void kda_store_conv_hist(const float* raw, const PrefillSeqs& s, float* conv_hist, int64_t HK, int64_t W,
                         cudaStream_t st);
// The final recurrent states, when the forward's kernel does not hand them over (the fp32 chunked path): the delta
// rule over each sequence from a zero state, in the arithmetic of kda_decode_step. q, k, v fp32 [T, H, K] normed as
// kda_conv_norm leaves them, g [T, HK] log decay, beta [T, H]; state [slots, H, K, K].
void kda_final_state(const float* q, const float* k, const float* v, const float* g, const float* beta,
                     const PrefillSeqs& s, float* state, int64_t H, int64_t K, cudaStream_t st);
// The tensor-core path's chunk buffers (KdaTcStepParams): the rows of each sequence's last, incomplete chunk
// from the forward's q, k, v bf16 [T, HK], raw gates g [T, HK] and beta [T, H]. (Its boundary state comes from
// kda_chunked_tc with KdaTcStates::boundary.)
void kda_store_chunk_rows(const bf16* q, const bf16* k, const bf16* v, const float* g, const float* beta,
                          const PrefillSeqs& s, bf16* chunk_q, bf16* chunk_k, bf16* chunk_v, float* chunk_g,
                          float* chunk_beta, int64_t H, int64_t K, cudaStream_t st);
// The indexer caches of each sequence: its complete pools' keys from pk [num_pools, ID] (sequence n's pool 0 at
// pool_base[n]) into pool_key [slots, max_pools, ID], its incomplete pool's keys and gate scores (ki, gs [T, ID])
// into pending_key / pending_gate [slots, P, ID].
void indexer_store_prefill(const float* ki, const float* gs, const float* pk, const int32_t* pool_base,
                           const PrefillSeqs& s, float* pending_key, float* pending_gate, float* pool_key, int64_t P,
                           int64_t ID, int64_t max_pools, cudaStream_t st);

}  // namespace nextlm::cuda
