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

namespace {

// The indexer's projections of T tokens: qi [T, IH·ID], LayerNormed keys ki [T, ID], gate scores gs [T, ID] and head
// weights wt [T, IH] (times IH^-1/2).
struct IndexerProjections {
  std::vector<float> qi, ki, gs, wt;
};
IndexerProjections indexer_project(const IndexerWeights& w, const ModelConfig& c, const float* a, const float* qr,
                                   int64_t T) {
  const int64_t D = c.hidden_size, IH = c.index_n_heads, ID = c.index_head_dim;
  IndexerProjections p{std::vector<float>(T * IH * ID), std::vector<float>(T * ID), std::vector<float>(T * ID),
                       std::vector<float>(T * IH)};
  cpu::linear(qr, T, c.q_lora_rank, w.wq_b, p.qi.data());
  cpu::linear(a, T, D, w.wk, p.ki.data());
  layernorm_forward(p.ki.data(), w.k_norm_w.ptr(), w.k_norm_b.ptr(), p.ki.data(), T, ID, 1e-6f);
  cpu::linear(a, T, D, w.gate, p.gs.data());
  cpu::linear(a, T, D, w.weights_proj, p.wt.data());
  const float wscale = 1.0f / std::sqrt(static_cast<float>(IH));
  for (float& x : p.wt) x *= wscale;
  return p;
}

// The compressed key of one complete pool: per channel, a softmax over the pool's tokens of gate score + position
// bias weights their keys. keys, gates [P, ID]; out [ID].
void pool_key_forward(const IndexerWeights& w, int64_t P, int64_t ID, const float* keys, const float* gates,
                      float* out) {
  for (int64_t ch = 0; ch < ID; ++ch) {
    float mx = -INFINITY;
    for (int64_t i = 0; i < P; ++i) mx = std::max(mx, gates[i * ID + ch] + w.ape.data[i * ID + ch]);
    float den = 0.0f, num = 0.0f;
    for (int64_t i = 0; i < P; ++i) {
      const float e = std::exp(gates[i * ID + ch] + w.ape.data[i * ID + ch] - mx);
      den += e;
      num += e * keys[i * ID + ch];
    }
    out[ch] = num / den;
  }
}

// The keys a query at sequence position t selects: its selectable pools (last token ≤ t), the best index_topk/P of
// them by Σ_h w_h·ReLU(ID^-1/2·q_h·pk_j) when there are more (ties to the lower pool), expanded to tokens, then with
// always_select_tail its incomplete pool. q [IH, ID]; wt [IH]; pk [≥ selectable, ID].
std::vector<int32_t> select_keys(const ModelConfig& c, const float* q, const float* wt, const float* pk, int64_t t) {
  const int64_t IH = c.index_n_heads, ID = c.index_head_dim, P = c.index_kpool, budget = c.index_topk / P;
  const float sscale = 1.0f / std::sqrt(static_cast<float>(ID));
  const int64_t selectable = (t + 1) / P;
  std::vector<int64_t> pools(selectable);
  std::iota(pools.begin(), pools.end(), 0);
  if (selectable > budget) {
    std::vector<float> score(selectable, 0.0f);
    for (int64_t j = 0; j < selectable; ++j) {
      float acc = 0.0f;
      for (int64_t h = 0; h < IH; ++h) {
        float dot = 0.0f;
        for (int64_t ch = 0; ch < ID; ++ch) dot += q[h * ID + ch] * pk[j * ID + ch];
        acc += wt[h] * std::max(dot * sscale, 0.0f);
      }
      score[j] = acc;
    }
    std::partial_sort(pools.begin(), pools.begin() + budget, pools.end(),
                      [&](int64_t x, int64_t y) { return score[x] > score[y] || (score[x] == score[y] && x < y); });
    pools.resize(budget);
    std::sort(pools.begin(), pools.end());
  }
  std::vector<int32_t> out;
  for (int64_t j : pools)
    for (int64_t i = 0; i < P; ++i) out.push_back(static_cast<int32_t>(j * P + i));
  if (c.index_kpool_always_select_tail)
    for (int64_t i = selectable * P; i <= t; ++i) out.push_back(static_cast<int32_t>(i));
  return out;
}

}  // namespace

Selection indexer_forward(const IndexerWeights& w, const ModelConfig& c, const float* a, const float* qr, int64_t T,
                          const std::vector<int64_t>& cu) {
  const int64_t IH = c.index_n_heads, ID = c.index_head_dim, P = c.index_kpool;
  const IndexerProjections p = indexer_project(w, c, a, qr, T);
  Selection sel(T);
  for (size_t n = 0; n + 1 < cu.size(); ++n) {
    const int64_t t0 = cu[n], L = cu[n + 1] - cu[n], npool = L / P;
    std::vector<float> pk(npool * ID);
    for (int64_t j = 0; j < npool; ++j)
      pool_key_forward(w, P, ID, p.ki.data() + (t0 + j * P) * ID, p.gs.data() + (t0 + j * P) * ID, pk.data() + j * ID);
#pragma omp parallel for schedule(dynamic, 8)
    for (int64_t t = 0; t < L; ++t)
      sel[t0 + t] = select_keys(c, p.qi.data() + (t0 + t) * IH * ID, p.wt.data() + (t0 + t) * IH, pk.data(), t);
  }
  return sel;
}

void attention_weights(const float* qh, const float* kv, int64_t NH, int64_t h, int64_t dqk, int64_t dkv, int64_t t0,
                       const std::vector<int32_t>& keys, bool uniform, float scale, std::vector<float>& p) {
  p.resize(keys.size());
  float mx = -INFINITY;
  for (size_t i = 0; i < keys.size(); ++i) {
    const float* kh = kv + ((t0 + keys[i]) * NH + h) * dkv;
    float dot = 0.0f;
    for (int64_t d = 0; d < dqk; ++d) dot += qh[d] * kh[d];
    p[i] = uniform ? 0.0f : dot * scale;
    mx = std::max(mx, p[i]);
  }
  float den = 0.0f;
  for (float& x : p) den += (x = std::exp(x - mx));
  for (float& x : p) x /= den;
}

void dsa_layer_forward(const DsaWeights& w, const ModelConfig& c, const float* a, int64_t T,
                       const std::vector<int64_t>& cu, Selection& sel, float* y) {
  dsa_layer_forward(w, c, a, T, cu, sel, y, EmptySelection::AllKeys);
}

void dsa_layer_forward(const DsaWeights& w, const ModelConfig& c, const float* a, int64_t T,
                       const std::vector<int64_t>& cu, Selection& sel, float* y, EmptySelection empty) {
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
      // An all-masked row gets equal weights on every key of the sequence, or on keys 0 … t (see the header).
      const bool uniform = keys.empty();
      if (uniform) {
        keys.resize(empty == EmptySelection::AllKeys ? L : t + 1);
        std::iota(keys.begin(), keys.end(), 0);
      }
      std::vector<float> p;
      for (int64_t h = 0; h < NH; ++h) {
        attention_weights(q.data() + ((t0 + t) * NH + h) * dqk, kv.data(), NH, h, dqk, dkv, t0, keys, uniform, scale,
                          p);
        float* oh = o.data() + ((t0 + t) * NH + h) * dv;
        for (size_t i = 0; i < keys.size(); ++i) {
          const float* vh = kv.data() + ((t0 + keys[i]) * NH + h) * dkv + dqk;
          for (int64_t d = 0; d < dv; ++d) oh[d] += p[i] * vh[d];
        }
      }
    }
  }
  cpu::linear(o.data(), T, NH * dv, w.o_proj, y);
}


Selection indexer_forward_cached(const IndexerWeights& w, const ModelConfig& c, const float* a, const float* qr,
                                 int64_t T, DsaCache& cache) {
  const int64_t IH = c.index_n_heads, ID = c.index_head_dim, P = c.index_kpool, t0 = cache.length;
  const IndexerProjections p = indexer_project(w, c, a, qr, T);
  const std::vector<float>& ki = p.ki;
  const std::vector<float>& gs = p.gs;

  // Pools that the new tokens complete get their compressed key now, once; the incomplete pool's keys wait.
  check(static_cast<int64_t>(cache.pool_key.size()) == t0 / P * ID &&
            static_cast<int64_t>(cache.pending_key.size()) == t0 % P * ID,
        "DSA indexer cache does not match its length");
  for (int64_t i = 0; i < T; ++i) {
    cache.pending_key.insert(cache.pending_key.end(), ki.begin() + i * ID, ki.begin() + (i + 1) * ID);
    cache.pending_gate.insert(cache.pending_gate.end(), gs.begin() + i * ID, gs.begin() + (i + 1) * ID);
    if (static_cast<int64_t>(cache.pending_key.size()) == P * ID) {
      cache.pool_key.resize(cache.pool_key.size() + ID);
      float* out = cache.pool_key.data() + cache.pool_key.size() - ID;
      pool_key_forward(w, P, ID, cache.pending_key.data(), cache.pending_gate.data(), out);
      cache.pending_key.clear();
      cache.pending_gate.clear();
    }
  }

  const float* pk = cache.pool_key.data();
  Selection sel(T);
#pragma omp parallel for schedule(dynamic, 8) if (T > 1)
  for (int64_t i = 0; i < T; ++i) sel[i] = select_keys(c, p.qi.data() + i * IH * ID, p.wt.data() + i * IH, pk, t0 + i);
  return sel;
}

void dsa_layer_forward_cached(const DsaWeights& w, const ModelConfig& c, const float* a, int64_t T, DsaCache& cache,
                              Selection& sel, float* y) {
  const int64_t D = c.hidden_size, NH = c.num_attention_heads, dqk = c.qk_nope_head_dim, dv = c.v_head_dim;
  const int64_t QL = c.q_lora_rank, KL = c.kv_lora_rank, dkv = dqk + dv;
  const float eps = static_cast<float>(c.rms_norm_eps);
  std::vector<float> qr(T * QL), q(T * NH * dqk), lat(T * KL);
  cpu::linear(a, T, D, w.q_a, qr.data());
  rmsnorm_forward(qr.data(), w.q_a_norm.ptr(), qr.data(), T, QL, eps);
  cpu::linear(qr.data(), T, QL, w.q_b, q.data());
  cpu::linear(a, T, D, w.kv_a, lat.data());
  rmsnorm_forward(lat.data(), w.kv_a_norm.ptr(), lat.data(), T, KL, eps);

  if (w.indexer) {
    sel = indexer_forward_cached(*w.indexer, c, a, qr.data(), T, cache);
  } else {
    check(static_cast<int64_t>(sel.size()) == T, "shared-indexer DSA layer has no selection from the layer before");
  }
  check(static_cast<int64_t>(cache.latent.size()) == cache.length * KL, "DSA cache does not match its length");
  const int64_t t0 = cache.length;
  cache.latent.insert(cache.latent.end(), lat.begin(), lat.end());
  cache.length += T;
  for (int64_t i = 0; i < T; ++i)
    if (!sel[i].empty() && sel[i].back() > t0 + i)
      fail("DSA selection of position ", t0 + i, " holds the later position ", sel[i].back());

  const float scale = 1.0f / std::sqrt(static_cast<float>(dqk));
  const float* kv_b = w.kv_b.ptr();  // head h: rows h·dkv … h·dkv+dqk−1 map c to k, the next dv rows map c to v
  std::vector<float> o(T * NH * dv);
#pragma omp parallel for collapse(2) schedule(dynamic) if (T > 1)
  for (int64_t i = 0; i < T; ++i)
    for (int64_t h = 0; h < NH; ++h) {
      const int64_t t = t0 + i;
      std::vector<int32_t> keys = sel[i];
      // An empty selection attends uniformly to the keys seen so far (EmptySelection::SeenKeys).
      const bool uniform = keys.empty();
      if (uniform) {
        keys.resize(t + 1);
        std::iota(keys.begin(), keys.end(), 0);
      }
      // Absorbed query qa = W_kᵀ q [KL].
      const float* qh = q.data() + (i * NH + h) * dqk;
      std::vector<float> qa(KL, 0.0f), cs(KL, 0.0f), p(keys.size());
      for (int64_t d = 0; d < dqk; ++d) {
        const float* row = kv_b + (h * dkv + d) * KL;
        for (int64_t l = 0; l < KL; ++l) qa[l] += qh[d] * row[l];
      }
      float mx = -INFINITY;
      for (size_t j = 0; j < keys.size(); ++j) {
        const float* cj = cache.latent.data() + static_cast<int64_t>(keys[j]) * KL;
        float dot = 0.0f;
        for (int64_t l = 0; l < KL; ++l) dot += qa[l] * cj[l];
        p[j] = uniform ? 0.0f : dot * scale;
        mx = std::max(mx, p[j]);
      }
      float den = 0.0f;
      for (float& x : p) den += (x = std::exp(x - mx));
      // Weighted latent sum, then the value part of kv_b.
      for (size_t j = 0; j < keys.size(); ++j) {
        const float* cj = cache.latent.data() + static_cast<int64_t>(keys[j]) * KL;
        const float pj = p[j] / den;
        for (int64_t l = 0; l < KL; ++l) cs[l] += pj * cj[l];
      }
      float* oh = o.data() + (i * NH + h) * dv;
      for (int64_t e = 0; e < dv; ++e) {
        const float* row = kv_b + (h * dkv + dqk + e) * KL;
        float acc = 0.0f;
        for (int64_t l = 0; l < KL; ++l) acc += row[l] * cs[l];
        oh[e] = acc;
      }
    }
  cpu::linear(o.data(), T, NH * dv, w.o_proj, y);
}

}  // namespace nextlm
