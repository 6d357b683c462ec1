// Tensor/expert-parallel loss and gradients on the CPU (see parallel_train.h): model/train.cpp's forward_backward
// skeleton run with this rank's sharded sub-layers, head and embedding.
#include "dist/parallel_train.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "cpu/linear.h"
#include "cpu/linear_backward.h"
#include "model/moe.h"
#include "model/norm.h"

namespace nextlm::dist {
namespace {

void add_into(float* dst, const float* src, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] += src[i];
}

// Backward of the MoE sub-layer: da [T, D] += …, with the collectives of parallel_train.h. Every rank holds all T
// tokens: each EP rank runs the backward of its own experts on the tokens routed to them (their input gradients and
// routing-weight gradients then all-reduced over EP), and takes the replicated router's backward itself.
void moe_parallel_backward(const MoeWeights& w, const ShardedModel& m, const Mesh& mesh, const float* x, int64_t T,
                           const Routing& r, const float* dy, float* da, MoeWeights& dw) {
  const ModelConfig& c = m.config;
  const int64_t D = c.hidden_size, E = c.n_routed_experts, k = c.num_experts_per_tok;
  const float L = static_cast<float>(c.swiglu_limit);
  std::vector<float> s, weights;
  routed_weights(w, c, x, T, r, s, weights);
  // Shared expert: tensor-parallel, its input gradient partial over TP.
  std::vector<float> dx_shared(T * D, 0.0f);
  if (w.shared) {
    mlp_backward(*w.shared, L, x, T, D, dy, dx_shared.data(), *dw.shared);
    mesh.tp->all_reduce_sum(dx_shared.data(), dx_shared.size());
  }
  // Routed experts: partial over EP.
  std::vector<float> dx_experts(T * D, 0.0f), dweights(T * k, 0.0f);
  const auto assigned = expert_assignments(r, T, E, k);
  for (int64_t e = m.experts.begin; e < m.experts.end; ++e)
    expert_backward(w.experts[e - m.experts.begin], L, x, assigned[e], D, k, weights, dy, dx_experts.data(),
                    dweights.data(), dw.experts[e - m.experts.begin]);
  mesh.ep->all_reduce_sum(dx_experts.data(), dx_experts.size());
  mesh.ep->all_reduce_sum(dweights.data(), dweights.size());
  add_into(da, dx_shared.data(), dx_shared.size());
  add_into(da, dx_experts.data(), dx_experts.size());
  router_backward(w, c, x, T, r, s, dweights.data(), da, dw);
}

// The vocab-parallel head: mean over streams, final RMSNorm, lm_head slice, cross-entropy with the log-sum-exp
// reduced over TP. Returns the loss (the same on every rank); dh [T, S, D] += …; dw.final_norm, dw.lm_head += ….
double head_parallel_backward(const ShardedModel& m, const Mesh& mesh, const float* h, const PackedBatch& batch,
                              float* dh, ModelWeights& dw) {
  const ModelConfig& c = m.config;
  const ModelWeights& w = m.weights;
  const int64_t T = batch.num_tokens(), S = c.hc_mult, D = c.hidden_size, V = c.vocab_size;
  const int64_t Vl = m.vocab.size(), v0 = m.vocab.begin;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const float* tw = batch.target_weight.empty() ? nullptr : batch.target_weight.data();
  Comm& tp = *mesh.tp;
  std::vector<float> hm(T * D), hn(T * D);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < D; ++d) {
      float acc = 0.0f;
      for (int64_t s = 0; s < S; ++s) acc += h[(t * S + s) * D + d];
      hm[t * D + d] = acc / static_cast<float>(S);
    }
  rmsnorm_forward(hm.data(), w.final_norm.ptr(), hn.data(), T, D, eps);
  std::vector<int64_t> target(T, -1);
  for (int64_t n = 0; n < batch.num_seqs(); ++n)
    for (int64_t t = batch.cu_seqlens[n]; t + 1 < batch.cu_seqlens[n + 1]; ++t) target[t] = batch.tokens[t + 1];

  std::vector<float> dhn(T * D, 0.0f), lg;
  double loss = 0.0;
  const int64_t block = std::max<int64_t>(1, (int64_t{1} << 24) / V);
  for (int64_t b0 = 0; b0 < T; b0 += block) {
    const int64_t b1 = std::min(T, b0 + block), rows = b1 - b0;
    lg.assign(static_cast<size_t>(rows * Vl), 0.0f);
    cpu::linear(hn.data() + b0 * D, rows, D, w.lm_head, lg.data());
    std::vector<float> mx(rows, -INFINITY);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t v = 0; v < Vl; ++v) mx[i] = std::max(mx[i], lg[i * Vl + v]);
    tp.all_reduce_max(mx.data(), mx.size());
    std::vector<double> red(2 * rows, 0.0);  // [Σexp | target logit]
    for (int64_t i = 0; i < rows; ++i) {
      double sum = 0.0;
      for (int64_t v = 0; v < Vl; ++v) sum += std::exp(static_cast<double>(lg[i * Vl + v]) - mx[i]);
      red[i] = sum;
      const int64_t tgt = target[b0 + i];
      if (tgt >= v0 && tgt < v0 + Vl) red[rows + i] = lg[i * Vl + (tgt - v0)];
    }
    tp.all_reduce_sum(red.data(), red.size());
    for (int64_t i = 0; i < rows; ++i) {
      float* row = lg.data() + i * Vl;
      const int64_t tgt = target[b0 + i];
      const float wt = tw && tgt >= 0 ? tw[b0 + i + 1] : 1.0f;  // row t predicts t + 1
      if (tgt < 0 || wt == 0.0f) {
        std::fill(row, row + Vl, 0.0f);
        continue;
      }
      const double lse = mx[i] + std::log(red[i]);
      const float tlogit = static_cast<float>(red[rows + i]);
      loss += tw ? wt * (lse - tlogit) : lse - tlogit;
      for (int64_t v = 0; v < Vl; ++v) row[v] = static_cast<float>(std::exp(static_cast<double>(row[v]) - lse));
      if (tgt >= v0 && tgt < v0 + Vl) row[tgt - v0] -= 1.0f;
      if (tw)
        for (int64_t v = 0; v < Vl; ++v) row[v] *= wt;
    }
    cpu::linear_backward(hn.data() + b0 * D, rows, D, w.lm_head, lg.data(), dhn.data() + b0 * D, &dw.lm_head);
  }
  tp.all_reduce_sum(dhn.data(), dhn.size());
  std::vector<float> dhm(T * D, 0.0f);
  rmsnorm_backward(hm.data(), w.final_norm.ptr(), dhn.data(), T, D, eps, dhm.data(), dw.final_norm.ptr());
  const float inv = 1.0f / static_cast<float>(S);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t d = 0; d < D; ++d) dh[(t * S + s) * D + d] += dhm[t * D + d] * inv;
  return loss;
}

}  // namespace

double parallel_forward_backward(const ShardedModel& m, const Mesh& mesh, const PackedBatch& batch,
                                 ModelWeights& grads, const RecomputePolicy& policy) {
  const ModelConfig& c = m.config;
  const ModelWeights& w = m.weights;
  validate_batch(batch, c.vocab_size);
  check(batch.target_weight.empty() || batch.target_weight.size() == batch.tokens.size(), "batch: target_weight has ",
        batch.target_weight.size(), " entries for ", batch.tokens.size(), " tokens");
  const int64_t T = batch.num_tokens(), S = c.hc_mult, D = c.hidden_size;
  const size_t TD = static_cast<size_t>(T * D);
  Comm& tp = *mesh.tp;

  // model_forward_backward's skeleton (model/train.cpp) with this rank's sharded sub-layers: attention heads and
  // the dense MLP / shared expert split over TP (their outputs and input gradients all-reduced), experts over EP,
  // the vocabulary over TP.
  TrainParts parts;
  parts.attention_config = &m.local;
  parts.tp_sum = [&](float* x, size_t n) { tp.all_reduce_sum(x, n); };
  parts.embed = [&](const std::vector<int32_t>& tokens, float* e) {
    std::fill(e, e + TD, 0.0f);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t v = tokens[t];
      if (v >= m.vocab.begin && v < m.vocab.end) std::copy_n(w.embed.ptr() + (v - m.vocab.begin) * D, D, e + t * D);
    }
    tp.all_reduce_sum(e, TD);
  };
  // moe_parallel_forward routes each rank's share of the tokens itself, to the same choice as `route`.
  parts.moe_forward = [&](int64_t i, const float* a, const Routing&, float* y) {
    moe_parallel_forward(*w.layers[i].moe, m, mesh, a, T, y);
  };
  parts.moe_backward = [&](int64_t i, const float* a, const Routing& route, const float* dy, float* da) {
    moe_parallel_backward(*w.layers[i].moe, m, mesh, a, T, route, dy, da, *grads.layers[i].moe);
  };
  parts.head = [&](const float* h, float* dh) { return head_parallel_backward(m, mesh, h, batch, dh, grads); };
  parts.embed_backward = [&](const std::vector<int32_t>& tokens, const float* dh) {
    // Vocab-parallel embedding: this rank's rows.
    for (int64_t t = 0; t < T; ++t) {
      const int64_t v = tokens[t];
      if (c.pad_token_id && v == *c.pad_token_id) continue;
      if (v < m.vocab.begin || v >= m.vocab.end) continue;
      float* row = grads.embed.ptr() + (v - m.vocab.begin) * D;
      for (int64_t s = 0; s < S; ++s)
        for (int64_t d = 0; d < D; ++d) row[d] += dh[(t * S + s) * D + d];
    }
  };
  return forward_backward(c, w, batch, grads, parts, policy);
}

namespace {

// The full tensor from every TP rank's slice along `dim` (0: rows, 1: columns of a 2-D tensor), in rank order.
Tensor gather_dim(Comm& comm, const Tensor& local, int dim) {
  const int P = comm.size();
  const std::vector<int64_t> ext = comm.all_gather_value<int64_t>(local.shape.at(dim));
  std::vector<size_t> counts(P);
  int64_t total = 0, other_dim = 1;  // other_dim: the product of the other dimensions
  for (size_t i = 0; i < local.shape.size(); ++i)
    if (static_cast<int>(i) != dim) other_dim *= local.shape[i];
  for (int q = 0; q < P; ++q) {
    counts[q] = static_cast<size_t>(ext[q] * other_dim) * sizeof(float);
    total += ext[q];
  }
  std::vector<float> all(static_cast<size_t>(total * other_dim));
  comm.all_gatherv(local.ptr(), all.data(), counts);
  Tensor out;
  out.shape = local.shape;
  out.shape[dim] = total;
  if (dim == 0) {
    out.data = std::move(all);
    return out;
  }
  const int64_t R = local.shape[0];
  out.data.assign(static_cast<size_t>(R * total), 0.0f);
  int64_t off = 0, col = 0;
  for (int q = 0; q < P; ++q) {
    for (int64_t r = 0; r < R; ++r)
      std::copy_n(all.data() + off + r * ext[q], ext[q], out.ptr() + r * total + col);
    off += R * ext[q];
    col += ext[q];
  }
  return out;
}

MlpWeights gather_mlp(Comm& tp, const MlpWeights& g) {
  return MlpWeights{gather_dim(tp, g.gate, 0), gather_dim(tp, g.up, 0), gather_dim(tp, g.down, 1)};
}

// Sums the gradients of the replicated tensors that only this rank's heads used.
void reduce_partial(Comm& tp, Tensor& t) { tp.all_reduce_sum(t.ptr(), t.data.size()); }

// The full tensors from every rank's slices; sum_partial: the replicated attention tensors are partial sums over TP
// (gradients), else they are the same on every rank (weights, moments) and kept as they are.
ModelWeights gather_full(const ShardedModel& m, const Mesh& mesh, const ModelWeights& g, bool sum_partial) {
  Comm& tp = *mesh.tp;
  Comm& ep = *mesh.ep;
  auto partial = [&](Tensor& t) {
    if (sum_partial) reduce_partial(tp, t);
  };
  ModelWeights out;
  out.embed = gather_dim(tp, g.embed, 0);
  out.final_norm = g.final_norm;
  out.lm_head = g.lm_head.empty() ? g.lm_head : gather_dim(tp, g.lm_head, 0);
  for (const LayerWeights& l : g.layers) {
    LayerWeights o;
    o.hc_attn = l.hc_attn;
    o.hc_ffn = l.hc_ffn;
    o.input_norm = l.input_norm;
    o.post_attention_norm = l.post_attention_norm;
    if (l.kda) {
      KdaWeights k = *l.kda;
      for (Tensor* t : {&k.q_proj, &k.k_proj, &k.v_proj, &k.q_conv, &k.k_conv, &k.v_conv, &k.f_b, &k.dt_bias,
                        &k.A_log, &k.b_proj, &k.g_b})
        *t = gather_dim(tp, *t, 0);
      k.o_proj = gather_dim(tp, k.o_proj, 1);
      for (Tensor* t : {&k.f_a, &k.g_a, &k.o_norm}) partial(*t);
      o.kda = std::move(k);
    }
    if (l.dsa) {
      DsaWeights d = *l.dsa;
      d.q_b = gather_dim(tp, d.q_b, 0);
      d.kv_b = gather_dim(tp, d.kv_b, 0);
      d.o_proj = gather_dim(tp, d.o_proj, 1);
      for (Tensor* t : {&d.q_a, &d.q_a_norm, &d.kv_a, &d.kv_a_norm}) partial(*t);
      o.dsa = std::move(d);
    }
    if (l.mlp) o.mlp = gather_mlp(tp, *l.mlp);
    if (l.moe) {
      MoeWeights mo;
      mo.router = l.moe->router;
      mo.correction_bias = l.moe->correction_bias;
      if (l.moe->shared) mo.shared = gather_mlp(tp, *l.moe->shared);
      // Experts: each EP rank's block of whole experts, in rank order (= expert order).
      std::vector<float> mine;
      for (const MlpWeights& e : l.moe->experts)
        for (const Tensor* t : {&e.gate, &e.up, &e.down}) mine.insert(mine.end(), t->data.begin(), t->data.end());
      std::vector<float> all(mine.size() * static_cast<size_t>(ep.size()));
      ep.all_gather(mine.data(), mine.size() * sizeof(float), all.data());
      const MlpWeights& shape = l.moe->experts.front();
      size_t off = 0;
      for (int64_t e = 0; e < m.config.n_routed_experts; ++e) {
        MlpWeights x{Tensor(shape.gate.shape), Tensor(shape.up.shape), Tensor(shape.down.shape)};
        for (Tensor* t : {&x.gate, &x.up, &x.down}) {
          std::copy_n(all.data() + off, t->data.size(), t->ptr());
          off += t->data.size();
        }
        mo.experts.push_back(std::move(x));
      }
      o.moe = std::move(mo);
    }
    out.layers.push_back(std::move(o));
  }
  return out;
}

}  // namespace

ModelWeights gather_gradients(const ShardedModel& m, const Mesh& mesh, const ModelWeights& g) {
  return gather_full(m, mesh, g, /*sum_partial=*/true);
}

ModelWeights gather_weights(const ShardedModel& m, const Mesh& mesh, const ModelWeights& w) {
  return gather_full(m, mesh, w, /*sum_partial=*/false);
}

void reduce_partial_gradients(const Mesh& mesh, ModelWeights& g) {
  Comm& tp = *mesh.tp;
  for (LayerWeights& l : g.layers) {
    if (l.kda)
      for (Tensor* t : {&l.kda->f_a, &l.kda->g_a, &l.kda->o_norm}) reduce_partial(tp, *t);
    if (l.dsa)
      for (Tensor* t : {&l.dsa->q_a, &l.dsa->q_a_norm, &l.dsa->kv_a, &l.dsa->kv_a_norm}) reduce_partial(tp, *t);
  }
}

}  // namespace nextlm::dist
