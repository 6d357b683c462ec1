// Explicit backward passes of the CPU fp32 reference, one per component, next to the forwards they invert
// (llm.c style forward/backward pairs). They give the gradients transformers' autograd gives for
// modeling_glm5_next.py (5.17.0); tests/test_backward.cpp checks each against finite differences and
// tests/test_grad_golden.cpp the whole model against transformers.
//
// Gradient convention (the one used everywhere):
//  * Every backward ACCUMULATES. Parameter gradients are added (+=) into a struct of the same type as the weights
//    (HcWeights, KdaWeights, DsaWeights, MlpWeights, MoeWeights, ModelWeights), made by zeros_like(), so a gradient
//    has its parameter's shape. Input gradients (dx, dh, da, dy, ...) are added into caller-owned buffers of the
//    input's shape, which the caller zeroes; a value used twice (a residual stream) simply receives both parts.
//  * A null input-gradient pointer means "not wanted" and is skipped.
//  * Frozen tensors have no gradient and are left empty by zeros_like(): the DSA indexer (it runs under no_grad in
//    transformers, so its selection is a constant of the backward), the MoE e_score_correction_bias (a buffer), and
//    the router's choice of experts (a constant; gradients flow only through the chosen experts' weights).
//  * The loss is L = Σ_seq Σ_t −log p(x[t+1] | x[..t]): a sum over every predicted token, not a mean.
//
// Saved activations: each layer's backward takes the struct its *_forward_train filled (or, for the cheap ones,
// the forward's input, from which it recomputes what it needs). The model-level backward (train.h) saves the
// residual streams between sites and, by its RecomputePolicy, either recomputes a layer's sub-layers right before
// their backward or keeps their activations from the forward.
#pragma once
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "model/config.h"
#include "model/dsa.h"
#include "model/kda.h"
#include "model/mhc.h"
#include "model/moe.h"
#include "model/weights.h"

namespace nextlm {

// Zero gradients shaped like the trainable tensors of w; frozen ones (indexer, correction bias) stay empty.
HcWeights zeros_like(const HcWeights& w);
KdaWeights zeros_like(const KdaWeights& w);
DsaWeights zeros_like(const DsaWeights& w);
MlpWeights zeros_like(const MlpWeights& w);
MoeWeights zeros_like(const MoeWeights& w);
ModelWeights zeros_like(const ModelWeights& w);

// ---- Embedding -------------------------------------------------------------------------------------------------

// h[t, s, :] = embed[tokens[t]] for each of the S streams. h [T, S, D].
void embedding_forward(const Tensor& embed, const int32_t* tokens, int64_t T, int64_t S, float* h);
// dembed[tokens[t]] += Σ_s dh[t, s]. The row of pad_id gets nothing (torch.nn.Embedding's padding_idx, which
// transformers sets from pad_token_id).
void embedding_backward(const int32_t* tokens, int64_t T, int64_t S, const float* dh, std::optional<int64_t> pad_id,
                        Tensor& dembed);

// ---- RMSNorm ---------------------------------------------------------------------------------------------------

// Backward of y = w ⊙ x·rsqrt(mean(x²) + eps) over rows of width D (w null: the unweighted mHC input norm).
// x [T, D] is the forward's input. dx [T, D] += …, dw [D] += … (dw null when w is).
void rmsnorm_backward(const float* x, const float* w, const float* dy, int64_t T, int64_t D, float eps, float* dx,
                      float* dw);

// ---- mHC -------------------------------------------------------------------------------------------------------

// Backward through sinkhorn_forward: C0 [S, S] its input (softmax rows + eps), dC [S, S] the gradient of its output;
// dC0 [S, S] += …. Recomputes and keeps every iteration's intermediate matrix.
void sinkhorn_backward(const float* C0, int64_t S, int64_t iters, float eps, const float* dC, float* dC0);

// Backward of mhc_pre_forward from its input streams h [T, S, D] (everything else is recomputed per token):
// dpost [T, S], dcomb [T, S, S] and da [T, D] are the gradients of its outputs (any may be null = zero).
// dh [T, S, D] += … (through the collapse and through the norm → fn → sigmoid/softmax/Sinkhorn path);
// dw.fn, dw.base, dw.scale += ….
void mhc_pre_backward(const HcWeights& w, const ModelConfig& c, const float* h, int64_t T, const float* dpost,
                      const float* dcomb, const float* da, float* dh, HcWeights& dw);

// Backward of mhc_post_forward (h_out[t, s] = post[t, s]·y[t] + Σ_r comb[t, r, s]·h[t, r]) given dout [T, S, D]:
// dh [T, S, D], dy [T, D], dpost [T, S], dcomb [T, S, S] all += ….
void mhc_post_backward(const HcMix& mix, const float* h, const float* y, int64_t T, int64_t S, int64_t D,
                       const float* dout, float* dh, float* dy, float* dpost, float* dcomb);

// ---- KDA -------------------------------------------------------------------------------------------------------

// Backward of kda_recurrent_forward from a zero initial state (the start of a sequence), one sequence and head,
// with the KdaSeq layout (q, k, v, g rows of width K at stride ld; beta at stride ldb). do_ has o's layout.
// dq, dk, dv, dg (layout of q) and dbeta (layout of beta) += …. A backward through time: the states are
// recomputed forward and checkpointed every `chunk` steps, and each chunk's per-step states are rebuilt from its
// checkpoint while walking back, so memory is (T/chunk + chunk)·K² per head.
void kda_recurrent_backward(const KdaSeq& s, const float* do_, float* dq, float* dk, float* dv, float* dg,
                            float* dbeta, int64_t chunk = 64);

// What kda_layer_backward reads, filled by kda_layer_forward_train. Shapes [T, H·K] unless noted.
struct KdaActs {
  std::vector<float> q_raw, k_raw, v_raw;  // q/k/v projections of a, the conv inputs
  std::vector<float> q_pre, k_pre, v_pre;  // causal conv outputs before SiLU
  std::vector<float> q_act, k_act;         // after SiLU, before the L2 norm
  std::vector<float> q, k, v;              // the recurrence inputs (q L2-normed and scaled by K^-1/2, k L2-normed)
  std::vector<float> fa;                   // [T, K] f_a(a)
  std::vector<float> f;                    // f_b(f_a(a)) + dt_bias, the gate's input
  std::vector<float> g;                    // log decay
  std::vector<float> beta;                 // [T, H]
  std::vector<float> o;                    // recurrence output
  std::vector<float> ga;                   // [T, K] g_a(a)
  std::vector<float> gate;                 // g_b(g_a(a)), before the sigmoid
  std::vector<float> on;                   // RMSNorm_K(o)·sigmoid(gate): the o_proj input
};

// The same function as kda_layer_forward, keeping the activations. a [T, D], y [T, D]. `form` chooses the core that
// makes acts.o (the training forward uses the chunked one, as kda_layer_forward, whose bits it then gives);
// kda_layer_backward walks back through the recurrent form either way (the two are equal up to rounding).
void kda_layer_forward_train(const KdaWeights& w, const ModelConfig& c, const float* a, int64_t T,
                             const std::vector<int64_t>& cu_seqlens, KdaActs& acts, float* y,
                             KdaForm form = KdaForm::Recurrent);
// da [T, D] += …, dw += … (every KDA parameter, conv weights [H·K, W], A_log and dt_bias included).
void kda_layer_backward(const KdaWeights& w, const ModelConfig& c, const float* a, int64_t T,
                        const std::vector<int64_t>& cu_seqlens, const KdaActs& acts, const float* dy, float* da,
                        KdaWeights& dw);

// ---- DSA (MLA over the indexer's selection) --------------------------------------------------------------------

// What dsa_layer_backward reads, filled by dsa_layer_forward_train.
struct DsaActs {
  std::vector<float> qr_raw, qr;    // [T, q_lora] q_a(a), then RMSNorm
  std::vector<float> q;             // [T, NH·dqk]
  std::vector<float> lat_raw, lat;  // [T, kv_lora] kv_a(a), then RMSNorm
  std::vector<float> kv;            // [T, NH·(dqk+dv)]
  std::vector<float> o;             // [T, NH·dv] attention output, the o_proj input
};

// The same function as dsa_layer_forward with the selection `sel` given (a constant: made by the indexer of this
// or the previous layer, which gets no gradient). a [T, D], y [T, D].
void dsa_layer_forward_train(const DsaWeights& w, const ModelConfig& c, const float* a, int64_t T,
                             const std::vector<int64_t>& cu_seqlens, const Selection& sel, DsaActs& acts, float* y);
// The same for the training forward: a full-indexer layer first makes its selection into sel from the normed q
// latent (as dsa_layer_forward does); a shared one reads the previous layer's from sel.
void dsa_layer_forward_train_select(const DsaWeights& w, const ModelConfig& c, const float* a, int64_t T,
                                    const std::vector<int64_t>& cu_seqlens, Selection& sel, DsaActs& acts, float* y);
// da [T, D] += …, dw += … (indexer excluded). A query whose selection is empty has uniform weights over its
// sequence in the forward; its backward is autograd's, as in transformers' eager attention (the all-masked row's
// scores are finite and equal after adding finfo.min, and softmax's backward uses the uniform output), so v gets
// p·do and q, k get the softmax Jacobian at uniform weights.
void dsa_layer_backward(const DsaWeights& w, const ModelConfig& c, const float* a, int64_t T,
                        const std::vector<int64_t>& cu_seqlens, const Selection& sel, const DsaActs& acts,
                        const float* dy, float* da, DsaWeights& dw);

// ---- MLP and MoE -----------------------------------------------------------------------------------------------

// Backward of mlp_forward (clamped SwiGLU) from its input x [T, D]: recomputes gate·x and up·x. Zero gradient
// where a clamp is active (gate·x > L; up·x outside [−L, L]); at exactly ±L it passes, as torch.clamp's does.
// dx [T, D] += …, dw += ….
void mlp_backward(const MlpWeights& w, float limit, const float* x, int64_t T, int64_t D, const float* dy, float* dx,
                  MlpWeights& dw);

// The MoE with the experts already chosen (routing.experts [T, k]; routing.weights is ignored and recomputed from
// the router), so that the choice is a constant of the function. Equal to moe_forward for the router's own choice.
void moe_forward_routed(const MoeWeights& w, const ModelConfig& c, const float* x, int64_t T, const Routing& routing,
                        float* y);
// Backward of moe_forward_routed: the router weight gets gradient through the chosen experts' weights (sigmoid,
// optional normalisation, scaling); each expert through its tokens; the shared expert through all. dx += ….
void moe_backward(const MoeWeights& w, const ModelConfig& c, const float* x, int64_t T, const Routing& routing,
                  const float* dy, float* dx, MoeWeights& dw);

// The pieces of moe_backward (also the expert-parallel backward's, src/dist):
// the router's sigmoid scores s [T, E] and the chosen experts' weights [T, k] (as route_forward);
void routed_weights(const MoeWeights& w, const ModelConfig& c, const float* x, int64_t T, const Routing& routing,
                    std::vector<float>& s, std::vector<float>& weights);
// for each expert, the (token, slot) pairs routed to it, in token order;
using ExpertTokens = std::vector<std::pair<int64_t, int64_t>>;
std::vector<ExpertTokens> expert_assignments(const Routing& routing, int64_t T, int64_t E, int64_t k);
// one routed expert on its tokens: dx [T, D] += its input gradient (when dx is non-null), dweights [T, k] gets
// dL/d(routing weight) of its slots, dew += its weights' gradients;
void expert_backward(const MlpWeights& ew, float L, const float* x, const ExpertTokens& tokens, int64_t D, int64_t k,
                     const std::vector<float>& weights, const float* dy, float* dx, float* dweights, MlpWeights& dew);
// the router from the routing-weight gradients dweights [T, k]: dx += …, dw.router += ….
void router_backward(const MoeWeights& w, const ModelConfig& c, const float* x, int64_t T, const Routing& routing,
                     const std::vector<float>& s, const float* dweights, float* dx, MoeWeights& dw);

// ---- Final collapse, norm, lm_head and loss --------------------------------------------------------------------

// L = Σ_seq Σ_t −log p(x[t+1] | x[..t]) from the last layer's streams h [T, S, D] (mean over streams, final RMSNorm,
// lm_head). Accumulated in double. target_weight [T] (optional, PackedBatch::target_weight) scales each prediction's
// term: L = Σ_t w[t+1]·(−log p(x[t+1] | x[..t])).
double head_loss_forward(const ModelWeights& w, const ModelConfig& c, const float* h, const std::vector<int32_t>& tokens,
                         const std::vector<int64_t>& cu_seqlens, const float* target_weight = nullptr);
// The same loss, and its gradients: dh [T, S, D] += …; dw.final_norm, dw.lm_head += …. Returns L.
double head_loss_backward(const ModelWeights& w, const ModelConfig& c, const float* h,
                          const std::vector<int32_t>& tokens, const std::vector<int64_t>& cu_seqlens, float* dh,
                          ModelWeights& dw, const float* target_weight = nullptr);

}  // namespace nextlm
