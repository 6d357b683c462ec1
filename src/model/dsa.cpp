// DSA layer forward in fp32: MLA projections, the k-pool indexer and softmax attention over the selected keys;
// matches Glm5NextTextAttention / Glm5NextTextIndexer of transformers 5.17.0 with eager attention.
#include "model/dsa.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "cpu/linear.h"
#include "model/norm.h"

namespace nextlm {

Selection indexer_forward(const IndexerWeights& w, const ModelConfig& c, const float* a, const float* qr, int64_t T,
                          const std::vector<int64_t>& cu) {
  const int64_t D = c.hidden_size, IH = c.index_n_heads, ID = c.index_head_dim, P = c.index_kpool;
  const int64_t QL = c.q_lora_rank;
  std::vector<float> qi(T * IH * ID), ki(T * ID), gs(T * ID), wt(T * IH);
  cpu::linear(qr, T, QL, w.wq_b, qi.data());
  cpu::linear(a, T, D, w.wk, ki.data());
  layernorm_forward(ki.data(), w.k_norm_w.ptr(), w.k_norm_b.ptr(), ki.data(), T, ID, 1e-6f);
  cpu::linear(a, T, D, w.gate, gs.data());
  cpu::linear(a, T, D, w.weights_proj, wt.data());
  const float wscale = 1.0f / std::sqrt(static_cast<float>(IH));
  const float sscale = 1.0f / std::sqrt(static_cast<float>(ID));

  Selection sel(T);
  for (size_t n = 0; n + 1 < cu.size(); ++n) {
    const int64_t t0 = cu[n], L = cu[n + 1] - cu[n], npool = L / P;
    // Pool keys: per channel, a softmax over the pool's tokens of gate score + position bias weights the keys.
    std::vector<float> pk(npool * ID);
    for (int64_t j = 0; j < npool; ++j)
      for (int64_t ch = 0; ch < ID; ++ch) {
        float mx = -INFINITY;
        for (int64_t i = 0; i < P; ++i) mx = std::max(mx, gs[(t0 + j * P + i) * ID + ch] + w.ape.data[i * ID + ch]);
        float den = 0.0f, num = 0.0f;
        for (int64_t i = 0; i < P; ++i) {
          const float e = std::exp(gs[(t0 + j * P + i) * ID + ch] + w.ape.data[i * ID + ch] - mx);
          den += e;
          num += e * ki[(t0 + j * P + i) * ID + ch];
        }
        pk[j * ID + ch] = num / den;
      }
    const int64_t budget = std::min(c.index_topk / P, npool);
#pragma omp parallel for schedule(dynamic, 8)
    for (int64_t t = 0; t < L; ++t) {
      const int64_t selectable = (t + 1) / P;  // pools whose last token is ≤ t
      std::vector<int64_t> pools(selectable);
      std::iota(pools.begin(), pools.end(), 0);
      if (selectable > budget) {
        std::vector<float> score(selectable, 0.0f);
        const float* q = qi.data() + (t0 + t) * IH * ID;
        for (int64_t j = 0; j < selectable; ++j) {
          float acc = 0.0f;
          for (int64_t h = 0; h < IH; ++h) {
            float dot = 0.0f;
            for (int64_t ch = 0; ch < ID; ++ch) dot += q[h * ID + ch] * pk[j * ID + ch];
            acc += wt[(t0 + t) * IH + h] * wscale * std::max(dot * sscale, 0.0f);
          }
          score[j] = acc;
        }
        std::partial_sort(pools.begin(), pools.begin() + budget, pools.end(),
                          [&](int64_t x, int64_t y) { return score[x] > score[y] || (score[x] == score[y] && x < y); });
        pools.resize(budget);
        std::sort(pools.begin(), pools.end());
      }
      std::vector<int32_t>& out = sel[t0 + t];
      for (int64_t j : pools)
        for (int64_t i = 0; i < P; ++i) out.push_back(static_cast<int32_t>(j * P + i));
      if (c.index_kpool_always_select_tail)
        for (int64_t i = selectable * P; i <= t; ++i) out.push_back(static_cast<int32_t>(i));
    }
  }
  return sel;
}

void dsa_layer_forward(const DsaWeights& w, const ModelConfig& c, const float* a, int64_t T,
                       const std::vector<int64_t>& cu, Selection& sel, float* y) {
  const int64_t D = c.hidden_size, NH = c.num_attention_heads, dqk = c.qk_nope_head_dim, dv = c.v_head_dim;
  const int64_t QL = c.q_lora_rank, KL = c.kv_lora_rank, dkv = dqk + dv;
  const float eps = static_cast<float>(c.rms_norm_eps);
  std::vector<float> qr(T * QL), q(T * NH * dqk), lat(T * KL), kv(T * NH * dkv);
  cpu::linear(a, T, D, w.q_a, qr.data());
  rmsnorm_forward(qr.data(), w.q_a_norm.ptr(), qr.data(), T, QL, eps);
  cpu::linear(qr.data(), T, QL, w.q_b, q.data());
  cpu::linear(a, T, D, w.kv_a, lat.data());
  rmsnorm_forward(lat.data(), w.kv_a_norm.ptr(), lat.data(), T, KL, eps);
  cpu::linear(lat.data(), T, KL, w.kv_b, kv.data());

  if (w.indexer) {
    sel = indexer_forward(*w.indexer, c, a, qr.data(), T, cu);
  } else {
    check(static_cast<int64_t>(sel.size()) == T, "shared-indexer DSA layer has no selection from the layer before");
  }

  const float scale = 1.0f / std::sqrt(static_cast<float>(dqk));
  std::vector<float> o(T * NH * dv, 0.0f);
  for (size_t n = 0; n + 1 < cu.size(); ++n) {
    const int64_t t0 = cu[n], L = cu[n + 1] - cu[n];
#pragma omp parallel for schedule(dynamic, 4)
    for (int64_t t = 0; t < L; ++t) {
      std::vector<int32_t> keys = sel[t0 + t];
      // An all-masked row gets equal weights on every key of the sequence (see the header).
      const bool uniform = keys.empty();
      if (uniform) {
        keys.resize(L);
        std::iota(keys.begin(), keys.end(), 0);
      }
      std::vector<float> p(keys.size());
      for (int64_t h = 0; h < NH; ++h) {
        const float* qh = q.data() + ((t0 + t) * NH + h) * dqk;
        float mx = -INFINITY;
        for (size_t i = 0; i < keys.size(); ++i) {
          const float* kh = kv.data() + ((t0 + keys[i]) * NH + h) * dkv;
          float dot = 0.0f;
          for (int64_t d = 0; d < dqk; ++d) dot += qh[d] * kh[d];
          p[i] = uniform ? 0.0f : dot * scale;
          mx = std::max(mx, p[i]);
        }
        float den = 0.0f;
        for (float& x : p) den += (x = std::exp(x - mx));
        float* oh = o.data() + ((t0 + t) * NH + h) * dv;
        for (size_t i = 0; i < keys.size(); ++i) {
          const float* vh = kv.data() + ((t0 + keys[i]) * NH + h) * dkv + dqk;
          const float pi = p[i] / den;
          for (int64_t d = 0; d < dv; ++d) oh[d] += pi * vh[d];
        }
      }
    }
  }
  cpu::linear(o.data(), T, NH * dv, w.o_proj, y);
}

}  // namespace nextlm
