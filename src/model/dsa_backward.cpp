// DSA layer backward in fp32: o_proj, softmax attention over each query's selected keys, kv_b, kv_a_layernorm,
// kv_a_proj_with_mqa, q_b, q_a_layernorm, q_a_proj. The indexer's selection is a constant (it runs under no_grad in
// transformers), so the indexer gets no gradient and no gradient flows through it. Gradients of
// Glm5NextTextAttention with eager attention (transformers 5.17.0).
#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "cpu/linear.h"
#include "cpu/linear_backward.h"
#include "model/backward.h"
#include "model/norm.h"

namespace nextlm {

namespace {

// The keys query t (offset t within its sequence of length L) attends to; an empty selection means every key of
// the sequence with equal weight (see dsa.h).
std::vector<int32_t> keys_of(const Selection& sel, int64_t t0, int64_t t, int64_t L, bool& uniform) {
  std::vector<int32_t> keys = sel[t0 + t];
  uniform = keys.empty();
  if (uniform) {
    keys.resize(L);
    std::iota(keys.begin(), keys.end(), 0);
  }
  return keys;
}

// The projections of dsa_layer_forward_train: the q and kv latents, q and kv.
void dsa_project_train(const DsaWeights& w, const ModelConfig& c, const float* a, int64_t T, DsaActs& x) {
  const int64_t D = c.hidden_size, NH = c.num_attention_heads, dqk = c.qk_nope_head_dim, dv = c.v_head_dim;
  const int64_t QL = c.q_lora_rank, KL = c.kv_lora_rank, dkv = dqk + dv;
  const float eps = static_cast<float>(c.rms_norm_eps);
  x.qr_raw.assign(T * QL, 0.0f);
  x.qr.assign(T * QL, 0.0f);
  x.q.assign(T * NH * dqk, 0.0f);
  x.lat_raw.assign(T * KL, 0.0f);
  x.lat.assign(T * KL, 0.0f);
  x.kv.assign(T * NH * dkv, 0.0f);
  x.o.assign(T * NH * dv, 0.0f);
  cpu::linear(a, T, D, w.q_a, x.qr_raw.data());
  rmsnorm_forward(x.qr_raw.data(), w.q_a_norm.ptr(), x.qr.data(), T, QL, eps);
  cpu::linear(x.qr.data(), T, QL, w.q_b, x.q.data());
  cpu::linear(a, T, D, w.kv_a, x.lat_raw.data());
  rmsnorm_forward(x.lat_raw.data(), w.kv_a_norm.ptr(), x.lat.data(), T, KL, eps);
  cpu::linear(x.lat.data(), T, KL, w.kv_b, x.kv.data());
}

// The attention of dsa_layer_forward_train over the selection, from the projections in x; fills x.o, writes y.
void dsa_attend_train(const DsaWeights& w, const ModelConfig& c, int64_t T, const std::vector<int64_t>& cu,
                      const Selection& sel, DsaActs& x, float* y) {
  const int64_t NH = c.num_attention_heads, dqk = c.qk_nope_head_dim, dv = c.v_head_dim, dkv = dqk + dv;
  check(static_cast<int64_t>(sel.size()) == T, "DSA layer: selection has ", sel.size(), " rows for ", T, " tokens");
  const float scale = 1.0f / std::sqrt(static_cast<float>(dqk));
  for (size_t n = 0; n + 1 < cu.size(); ++n) {
    const int64_t t0 = cu[n], L = cu[n + 1] - cu[n];
#pragma omp parallel for schedule(dynamic, 4)
    for (int64_t t = 0; t < L; ++t) {
      bool uniform = false;
      const std::vector<int32_t> keys = keys_of(sel, t0, t, L, uniform);
      std::vector<float> p;
      for (int64_t h = 0; h < NH; ++h) {
        attention_weights(x.q.data() + ((t0 + t) * NH + h) * dqk, x.kv.data(), NH, h, dqk, dkv, t0, keys, uniform,
                          scale, p);
        float* oh = x.o.data() + ((t0 + t) * NH + h) * dv;
        for (size_t i = 0; i < keys.size(); ++i) {
          const float* vh = x.kv.data() + ((t0 + keys[i]) * NH + h) * dkv + dqk;
          for (int64_t d = 0; d < dv; ++d) oh[d] += p[i] * vh[d];
        }
      }
    }
  }
  cpu::linear(x.o.data(), T, NH * dv, w.o_proj, y);
}

}  // namespace

void dsa_layer_forward_train(const DsaWeights& w, const ModelConfig& c, const float* a, int64_t T,
                             const std::vector<int64_t>& cu, const Selection& sel, DsaActs& x, float* y) {
  dsa_project_train(w, c, a, T, x);
  dsa_attend_train(w, c, T, cu, sel, x, y);
}

void dsa_layer_forward_train_select(const DsaWeights& w, const ModelConfig& c, const float* a, int64_t T,
                                    const std::vector<int64_t>& cu, Selection& sel, DsaActs& x, float* y) {
  dsa_project_train(w, c, a, T, x);
  if (w.indexer) sel = indexer_forward(*w.indexer, c, a, x.qr.data(), T, cu);
  dsa_attend_train(w, c, T, cu, sel, x, y);
}

void dsa_layer_backward(const DsaWeights& w, const ModelConfig& c, const float* a, int64_t T,
                        const std::vector<int64_t>& cu, const Selection& sel, const DsaActs& x, const float* dy,
                        float* da, DsaWeights& dw) {
  const int64_t D = c.hidden_size, NH = c.num_attention_heads, dqk = c.qk_nope_head_dim, dv = c.v_head_dim;
  const int64_t QL = c.q_lora_rank, KL = c.kv_lora_rank, dkv = dqk + dv;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const float scale = 1.0f / std::sqrt(static_cast<float>(dqk));

  // y = o_proj(o)
  std::vector<float> dO(T * NH * dv, 0.0f);
  cpu::linear_backward(x.o.data(), T, NH * dv, w.o_proj, dy, dO.data(), &dw.o_proj);

  // o[t, h] = Σ_i p_i v_i, p = softmax(scale·q·k_i): dv_i += p_i·do; ds_i = p_i(dp_i − Σ p dp); dq, dk from ds.
  // Heads are independent, so threads own heads (their dq and dk/dv slices are disjoint).
  std::vector<float> dQ(T * NH * dqk, 0.0f), dKV(T * NH * dkv, 0.0f);
#pragma omp parallel for schedule(dynamic)
  for (int64_t h = 0; h < NH; ++h) {
    std::vector<float> p, dp;
    for (size_t n = 0; n + 1 < cu.size(); ++n) {
      const int64_t t0 = cu[n], L = cu[n + 1] - cu[n];
      for (int64_t t = 0; t < L; ++t) {
        bool uniform = false;
        const std::vector<int32_t> keys = keys_of(sel, t0, t, L, uniform);
        const float* qh = x.q.data() + ((t0 + t) * NH + h) * dqk;
        const float* doh = dO.data() + ((t0 + t) * NH + h) * dv;
        attention_weights(qh, x.kv.data(), NH, h, dqk, dkv, t0, keys, uniform, scale, p);
        dp.assign(keys.size(), 0.0f);
        float pdp = 0.0f;
        for (size_t i = 0; i < keys.size(); ++i) {
          const float* vh = x.kv.data() + ((t0 + keys[i]) * NH + h) * dkv + dqk;
          float* dvh = dKV.data() + ((t0 + keys[i]) * NH + h) * dkv + dqk;
          for (int64_t d = 0; d < dv; ++d) {
            dp[i] += doh[d] * vh[d];
            dvh[d] += p[i] * doh[d];
          }
          pdp += p[i] * dp[i];
        }
        float* dqh = dQ.data() + ((t0 + t) * NH + h) * dqk;
        for (size_t i = 0; i < keys.size(); ++i) {
          const float ds = p[i] * (dp[i] - pdp) * scale;
          const float* kh = x.kv.data() + ((t0 + keys[i]) * NH + h) * dkv;
          float* dkh = dKV.data() + ((t0 + keys[i]) * NH + h) * dkv;
          for (int64_t d = 0; d < dqk; ++d) {
            dqh[d] += ds * kh[d];
            dkh[d] += ds * qh[d];
          }
        }
      }
    }
  }

  // kv = kv_b(RMSNorm(kv_a(a)))
  std::vector<float> dlat(T * KL, 0.0f), dlat_raw(T * KL, 0.0f);
  cpu::linear_backward(x.lat.data(), T, KL, w.kv_b, dKV.data(), dlat.data(), &dw.kv_b);
  rmsnorm_backward(x.lat_raw.data(), w.kv_a_norm.ptr(), dlat.data(), T, KL, eps, dlat_raw.data(), dw.kv_a_norm.ptr());
  cpu::linear_backward(a, T, D, w.kv_a, dlat_raw.data(), da, &dw.kv_a);
  // q = q_b(RMSNorm(q_a(a))); the indexer also reads the normed q latent, under no_grad.
  std::vector<float> dqr(T * QL, 0.0f), dqr_raw(T * QL, 0.0f);
  cpu::linear_backward(x.qr.data(), T, QL, w.q_b, dQ.data(), dqr.data(), &dw.q_b);
  rmsnorm_backward(x.qr_raw.data(), w.q_a_norm.ptr(), dqr.data(), T, QL, eps, dqr_raw.data(), dw.q_a_norm.ptr());
  cpu::linear_backward(a, T, D, w.q_a, dqr_raw.data(), da, &dw.q_a);
}

}  // namespace nextlm
