// Whole-model loss and gradients on the CPU in fp32 (the gradient transformers' autograd gives for
// Glm5NextForConditionalGeneration's text path, 5.17.0), and the hub-layout names of the gradients.
#include "model/train.h"

#include <algorithm>
#include <iterator>

#include "core/error.h"
#include "model/norm.h"

namespace nextlm {

namespace {

Tensor zeros(const Tensor& t) { return Tensor(t.shape, 0.0f); }

}  // namespace

HcWeights zeros_like(const HcWeights& w) { return HcWeights{zeros(w.fn), zeros(w.base), zeros(w.scale)}; }

KdaWeights zeros_like(const KdaWeights& w) {
  return KdaWeights{zeros(w.q_proj), zeros(w.k_proj), zeros(w.v_proj), zeros(w.q_conv), zeros(w.k_conv),
                    zeros(w.v_conv), zeros(w.f_a),    zeros(w.f_b),    zeros(w.dt_bias), zeros(w.A_log),
                    zeros(w.b_proj), zeros(w.g_a),    zeros(w.g_b),    zeros(w.o_norm), zeros(w.o_proj)};
}

DsaWeights zeros_like(const DsaWeights& w) {
  DsaWeights g{zeros(w.q_a), zeros(w.q_a_norm), zeros(w.q_b), zeros(w.kv_a), zeros(w.kv_a_norm), zeros(w.kv_b),
               zeros(w.o_proj), std::nullopt};  // the indexer is frozen
  return g;
}

MlpWeights zeros_like(const MlpWeights& w) { return MlpWeights{zeros(w.gate), zeros(w.up), zeros(w.down)}; }

MoeWeights zeros_like(const MoeWeights& w) {
  MoeWeights g;
  g.router = zeros(w.router);  // correction_bias stays empty: a buffer, not trained
  for (const MlpWeights& e : w.experts) g.experts.push_back(zeros_like(e));
  if (w.shared) g.shared = zeros_like(*w.shared);
  return g;
}

ModelWeights zeros_like(const ModelWeights& w) {
  ModelWeights g;
  g.embed = zeros(w.embed);
  g.final_norm = zeros(w.final_norm);
  g.lm_head = zeros(w.lm_head);
  for (const LayerWeights& l : w.layers) {
    LayerWeights gl;
    gl.hc_attn = zeros_like(l.hc_attn);
    gl.hc_ffn = zeros_like(l.hc_ffn);
    gl.input_norm = zeros(l.input_norm);
    gl.post_attention_norm = zeros(l.post_attention_norm);
    if (l.kda) gl.kda = zeros_like(*l.kda);
    if (l.dsa) gl.dsa = zeros_like(*l.dsa);
    if (l.mlp) gl.mlp = zeros_like(*l.mlp);
    if (l.moe) gl.moe = zeros_like(*l.moe);
    g.layers.push_back(std::move(gl));
  }
  return g;
}

namespace {

constexpr const char* kComponents[] = {"kda", "mla", "moe", "experts", "mlp", "mhc", "states"};

// "none": every component kept (the chunk states too).
RecomputePolicy nothing_recomputed() { return RecomputePolicy{false, false, false, false, false, false, false}; }

// The flag of kComponents[i].
bool& component(RecomputePolicy& p, size_t i) {
  bool* f[] = {&p.kda, &p.mla, &p.moe, &p.experts, &p.mlp, &p.mhc, &p.states};
  return *f[i];
}

// What the forward keeps of one mHC site for its backward.
struct SiteSaved {
  std::vector<float> h;              // [T, S, D] the streams entering the site (always)
  HcMix mix;                         // mhc kept
  std::vector<float> a_raw, a;       // [T, D] the sub-layer input before and after its RMSNorm (mhc kept)
  std::vector<float> y;              // [T, D] the sub-layer's output (the sub-layer kept)
};

struct LayerSaved {
  SiteSaved attn, ffn;
  Selection sel;    // DSA layers: the selection attended over (a constant of the backward)
  Routing route;    // MoE layers: the experts chosen (a constant of the backward)
  KdaActs kda;      // kda kept
  DsaActs dsa;      // mla kept
};

}  // namespace

RecomputePolicy default_recompute() {
  RecomputePolicy p;
  p.experts = false;
  p.mlp = false;
  return p;
}

RecomputePolicy auto_recompute() {
  RecomputePolicy p = nothing_recomputed();
  p.adaptive = true;
  return p;
}

RecomputePolicy fixed_recompute(const RecomputePolicy& p) { return p.adaptive ? default_recompute() : p; }

std::optional<RecomputePolicy> recompute_fallback(const RecomputePolicy& p) {
  if (!p.adaptive) return std::nullopt;
  RecomputePolicy rung = p;
  rung.adaptive = false;
  const RecomputePolicy none = nothing_recomputed();
  RecomputePolicy states = none;
  states.states = true;
  RecomputePolicy next;
  if (rung == none)
    next = states;
  else if (rung == states)
    next = default_recompute();
  else if (rung == default_recompute())
    next = RecomputePolicy{};
  else
    return std::nullopt;
  next.adaptive = true;
  return next;
}

std::string recompute_to_string(const RecomputePolicy& p) {
  if (p.adaptive) return "auto";
  if (p == RecomputePolicy{}) return "all";
  std::string out;
  RecomputePolicy q = p;
  q.experts = p.recomputes_experts();
  q.states = !p.kda && p.states;
  for (size_t i = 0; i < std::size(kComponents); ++i) {
    if (!component(q, i)) continue;
    if (!out.empty()) out += ',';
    out += kComponents[i];
  }
  return out.empty() ? "none" : out;
}

RecomputePolicy parse_recompute(const std::string& s) {
  const std::string expected =
      " (expected auto, all, none or a comma-separated list of kda, mla, moe, experts, mlp, mhc, states)";
  if (s == "auto") return auto_recompute();
  if (s == "all") return RecomputePolicy{};
  RecomputePolicy p = nothing_recomputed();
  if (s == "none") return p;
  check(!s.empty(), "empty recompute policy", expected);
  size_t b = 0;
  while (true) {
    const size_t e = std::min(s.find(',', b), s.size());
    const std::string name = s.substr(b, e - b);
    size_t i = 0;
    while (i < std::size(kComponents) && name != kComponents[i]) ++i;
    check(i < std::size(kComponents), "unknown component \"", name, "\" in \"", s, "\"", expected);
    check(!component(p, i), "component \"", name, "\" given twice in \"", s, "\"");
    component(p, i) = true;
    if (e == s.size()) break;
    b = e + 1;
  }
  check(!p.experts || p.moe, "experts without moe in \"", s, "\": the routed experts run again only inside a "
        "recomputed MoE");
  check(!p.states || !p.kda, "states with kda in \"", s, "\": a recomputed KDA layer keeps no chunk states");
  if (p.kda) p.states = true;
  return p;
}

double forward_backward(const ModelConfig& c, const ModelWeights& w, const PackedBatch& batch, ModelWeights& grads,
                        const TrainParts& parts, const RecomputePolicy& given) {
  const RecomputePolicy policy = fixed_recompute(given);  // the host's memory: nothing to fall back from
  check(grads.layers.size() == w.layers.size(), "gradients have ", grads.layers.size(), " layers, the model ",
        w.layers.size());
  const int64_t T = batch.num_tokens(), S = c.hc_mult, D = c.hidden_size, Lyr = c.num_hidden_layers;
  const size_t TD = static_cast<size_t>(T * D), TSD = static_cast<size_t>(T * S * D);
  const float eps = static_cast<float>(c.rms_norm_eps);
  const float limit = static_cast<float>(c.swiglu_limit);
  const ModelConfig& ac = parts.attention_config ? *parts.attention_config : c;
  const auto& cu = batch.cu_seqlens;
  auto tp_sum = [&](float* x) {
    if (parts.tp_sum) parts.tp_sum(x, TD);
  };

  // The sub-layers. Their forwards are the functions the backward recomputes with, so that a sub-layer kept from
  // the forward and one recomputed give the same bits; kda/dsa fill the layer's acts when kept, else the scratch
  // ones (those of the layer being walked back).
  std::vector<LayerSaved> saved(Lyr);
  KdaActs kda_scratch;
  DsaActs dsa_scratch;
  auto kda_acts = [&](int64_t i) -> KdaActs& { return policy.kda ? kda_scratch : saved[i].kda; };
  auto dsa_acts = [&](int64_t i) -> DsaActs& { return policy.mla ? dsa_scratch : saved[i].dsa; };
  // sel: the selection in flight in the forward (a full-indexer layer writes it, the layer after reads it).
  auto attention_forward = [&](int64_t i, const float* a, float* y, Selection* sel) {
    const LayerWeights& lw = w.layers[i];
    if (lw.kda) {
      kda_layer_forward_train(*lw.kda, ac, a, T, cu, kda_acts(i), y, KdaForm::Chunked);
    } else if (sel) {
      dsa_layer_forward_train_select(*lw.dsa, ac, a, T, cu, *sel, dsa_acts(i), y);
    } else {
      dsa_layer_forward_train(*lw.dsa, ac, a, T, cu, saved[i].sel, dsa_acts(i), y);
    }
    tp_sum(y);
  };
  auto attention_backward = [&](int64_t i, const float* a, const float* dy, float* da) {
    const LayerWeights& lw = w.layers[i];
    if (lw.kda) {
      kda_layer_backward(*lw.kda, ac, a, T, cu, kda_acts(i), dy, da, *grads.layers[i].kda);
    } else {
      dsa_layer_backward(*lw.dsa, ac, a, T, cu, saved[i].sel, dsa_acts(i), dy, da, *grads.layers[i].dsa);
    }
    tp_sum(da);
  };
  auto ffn_forward = [&](int64_t i, const float* a, float* y) {
    const LayerWeights& lw = w.layers[i];
    if (lw.mlp) {
      mlp_forward(*lw.mlp, limit, a, T, D, y);
      tp_sum(y);
    } else {
      parts.moe_forward(i, a, saved[i].route, y);
    }
  };
  auto ffn_backward = [&](int64_t i, const float* a, const float* dy, float* da) {
    const LayerWeights& lw = w.layers[i];
    if (lw.mlp) {
      mlp_backward(*lw.mlp, limit, a, T, D, dy, da, *grads.layers[i].mlp);
      tp_sum(da);
    } else {
      parts.moe_backward(i, a, saved[i].route, dy, da);
    }
  };
  auto recompute_attention = [&](int64_t i) { return w.layers[i].kda ? policy.kda : policy.mla; };
  auto recompute_ffn = [&](int64_t i) { return w.layers[i].mlp ? policy.mlp : policy.moe; };

  // Forward, keeping the streams entering each site, the selections, the expert choices and what the policy keeps.
  std::vector<float> h(TSD), h_next(TSD), a_raw(TD), a(TD), y(TD);
  HcMix mix;
  // One site: h → the sub-layer's input → sub(i, a, y) → h.
  auto site_forward = [&](SiteSaved& site, const HcWeights& hc, const Tensor& norm, bool keep_sub, auto&& sub) {
    HcMix& m = policy.mhc ? mix : site.mix;
    mhc_pre_forward(hc, c, h.data(), T, m, a_raw.data());
    rmsnorm_forward(a_raw.data(), norm.ptr(), a.data(), T, D, eps);
    if (!policy.mhc) {
      site.a_raw = a_raw;
      site.a = a;
    }
    sub(a.data(), y.data());
    if (keep_sub) site.y = y;
    mhc_post_forward(m, h.data(), y.data(), T, S, D, h_next.data());
    site.h.swap(h);  // the streams entering the site are kept; h_next becomes the current streams
    h.swap(h_next);
    h_next.resize(TSD);
  };
  parts.embed(batch.tokens, y.data());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t s = 0; s < S; ++s) std::copy_n(y.data() + t * D, D, h.data() + (t * S + s) * D);
  Selection sel;
  for (int64_t i = 0; i < Lyr; ++i) {
    const LayerWeights& lw = w.layers[i];
    site_forward(saved[i].attn, lw.hc_attn, lw.input_norm, !recompute_attention(i), [&](const float* x, float* out) {
      attention_forward(i, x, out, lw.dsa ? &sel : nullptr);
    });
    if (lw.dsa) saved[i].sel = sel;
    site_forward(saved[i].ffn, lw.hc_ffn, lw.post_attention_norm, !recompute_ffn(i), [&](const float* x, float* out) {
      if (lw.moe) saved[i].route = route_forward(*lw.moe, c, x, T);
      ffn_forward(i, x, out);
    });
    if (!(lw.dsa && lw.dsa->indexer)) sel.clear();  // a selection goes only to the layer directly after
  }

  // Head and loss. With tied embeddings the lm_head is the embedding: this call's lm_head gradient is collected
  // apart and added to the embedding's.
  std::vector<float> dh(TSD, 0.0f), dh_prev(TSD), da(TD), da_raw(TD), dy(TD);
  double loss = 0.0;
  if (c.tie_word_embeddings) {
    Tensor dlm = zeros(grads.lm_head);
    std::swap(grads.lm_head, dlm);
    loss = parts.head(h.data(), dh.data());
    std::swap(grads.lm_head, dlm);
    for (int64_t i = 0; i < grads.embed.numel(); ++i) grads.embed.data[i] += dlm.data[i];
  } else {
    loss = parts.head(h.data(), dh.data());
  }

  // Backward, one layer at a time from the last: recompute what the site did not keep, then walk back through it.
  std::vector<float> dpost(T * S), dcomb(T * S * S);
  auto site_backward = [&](SiteSaved& site, const HcWeights& hc, HcWeights& dhc, const Tensor& norm, Tensor& dnorm,
                           auto&& forward, auto&& backward) {
    const HcMix* m = &site.mix;
    const float* x_raw = site.a_raw.data();
    const float* x = site.a.data();
    if (policy.mhc) {
      mhc_pre_forward(hc, c, site.h.data(), T, mix, a_raw.data());
      rmsnorm_forward(a_raw.data(), norm.ptr(), a.data(), T, D, eps);
      m = &mix;
      x_raw = a_raw.data();
      x = a.data();
    }
    const float* out = site.y.data();
    if (site.y.empty()) {
      forward(x, y.data());
      out = y.data();
    }
    std::fill(dh_prev.begin(), dh_prev.end(), 0.0f);
    std::fill(dy.begin(), dy.end(), 0.0f);
    std::fill(dpost.begin(), dpost.end(), 0.0f);
    std::fill(dcomb.begin(), dcomb.end(), 0.0f);
    mhc_post_backward(*m, site.h.data(), out, T, S, D, dh.data(), dh_prev.data(), dy.data(), dpost.data(),
                      dcomb.data());
    std::fill(da.begin(), da.end(), 0.0f);
    backward(x, dy.data(), da.data());
    std::fill(da_raw.begin(), da_raw.end(), 0.0f);
    rmsnorm_backward(x_raw, norm.ptr(), da.data(), T, D, eps, da_raw.data(), dnorm.ptr());
    mhc_pre_backward(hc, c, site.h.data(), T, dpost.data(), dcomb.data(), da_raw.data(), dh_prev.data(), dhc);
    dh.swap(dh_prev);
    site = SiteSaved{};  // walked back: its memory goes
  };
  for (int64_t i = Lyr - 1; i >= 0; --i) {
    const LayerWeights& lw = w.layers[i];
    LayerWeights& gl = grads.layers[i];
    site_backward(
        saved[i].ffn, lw.hc_ffn, gl.hc_ffn, lw.post_attention_norm, gl.post_attention_norm,
        [&](const float* x, float* out) { ffn_forward(i, x, out); },
        [&](const float* x, const float* g, float* dx) { ffn_backward(i, x, g, dx); });
    site_backward(
        saved[i].attn, lw.hc_attn, gl.hc_attn, lw.input_norm, gl.input_norm,
        [&](const float* x, float* out) { attention_forward(i, x, out, nullptr); },
        [&](const float* x, const float* g, float* dx) { attention_backward(i, x, g, dx); });
    saved[i] = LayerSaved{};
  }
  parts.embed_backward(batch.tokens, dh.data());
  return loss;
}

double model_forward_backward(const Model& model, const PackedBatch& batch, ModelWeights& grads,
                              const RecomputePolicy& policy) {
  const ModelConfig& c = model.config();
  const ModelWeights& w = model.weights();
  validate_batch(batch, c.vocab_size);
  const int64_t T = batch.num_tokens(), S = c.hc_mult, D = c.hidden_size;
  const auto& cu = batch.cu_seqlens;
  check(batch.target_weight.empty() || batch.target_weight.size() == batch.tokens.size(), "batch: target_weight has ",
        batch.target_weight.size(), " entries for ", batch.tokens.size(), " tokens");
  const float* tw = batch.target_weight.empty() ? nullptr : batch.target_weight.data();

  TrainParts parts;
  parts.embed = [&](const std::vector<int32_t>& tokens, float* e) {
    for (int64_t t = 0; t < T; ++t) std::copy_n(w.embed.ptr() + static_cast<int64_t>(tokens[t]) * D, D, e + t * D);
  };
  parts.moe_forward = [&](int64_t i, const float* a, const Routing& route, float* y) {
    moe_forward_routed(*w.layers[i].moe, c, a, T, route, y);
  };
  parts.moe_backward = [&](int64_t i, const float* a, const Routing& route, const float* dy, float* da) {
    moe_backward(*w.layers[i].moe, c, a, T, route, dy, da, *grads.layers[i].moe);
  };
  parts.head = [&](const float* h, float* dh) {
    return head_loss_backward(w, c, h, batch.tokens, cu, dh, grads, tw);
  };
  parts.embed_backward = [&](const std::vector<int32_t>& tokens, const float* dh) {
    embedding_backward(tokens.data(), T, S, dh, c.pad_token_id, grads.embed);
  };
  return forward_backward(c, w, batch, grads, parts, policy);
}

std::string text_prefix(const Checkpoint& ckpt) {
  const std::string prefix = "model.language_model.";
  if (!ckpt.find(prefix + "embed_tokens.weight") && ckpt.find("model.embed_tokens.weight")) return "model.";
  return prefix;
}

void zero_gradients(const ModelConfig& c, ModelWeights& grads) {
  for (const GradTensor& g : hub_gradients(c, grads, ""))
    std::fill_n(const_cast<float*>(g.data), Tensor::count(g.shape), 0.0f);
}

std::vector<GradTensor> hub_gradients(const ModelConfig& c, const ModelWeights& g, const std::string& prefix) {
  std::vector<GradTensor> out;
  auto add = [&](const std::string& name, const Tensor& t) { out.push_back({prefix + name, t.shape, t.ptr()}); };
  auto add_conv = [&](const std::string& name, const Tensor& t) {
    out.push_back({prefix + name, {t.dim(0), 1, t.dim(1)}, t.ptr()});
  };
  auto add_mlp = [&](const std::string& p, const MlpWeights& m) {
    add(p + "gate_proj.weight", m.gate);
    add(p + "up_proj.weight", m.up);
    add(p + "down_proj.weight", m.down);
  };
  auto add_hc = [&](const std::string& p, const HcWeights& h) {
    add(p + "_fn", h.fn);
    add(p + "_base", h.base);
    add(p + "_scale", h.scale);
  };
  add("embed_tokens.weight", g.embed);
  add("norm.weight", g.final_norm);
  if (!c.tie_word_embeddings) out.push_back({"lm_head.weight", g.lm_head.shape, g.lm_head.ptr()});
  for (size_t i = 0; i < g.layers.size(); ++i) {
    const LayerWeights& l = g.layers[i];
    const std::string p = "layers." + std::to_string(i) + ".";
    add_hc(p + "hc_attn", l.hc_attn);
    add_hc(p + "hc_ffn", l.hc_ffn);
    add(p + "input_layernorm.weight", l.input_norm);
    add(p + "post_attention_layernorm.weight", l.post_attention_norm);
    const std::string a = p + "self_attn.";
    if (l.kda) {
      const KdaWeights& k = *l.kda;
      add(a + "q_proj.weight", k.q_proj);
      add(a + "k_proj.weight", k.k_proj);
      add(a + "v_proj.weight", k.v_proj);
      add_conv(a + "q_conv1d.weight", k.q_conv);
      add_conv(a + "k_conv1d.weight", k.k_conv);
      add_conv(a + "v_conv1d.weight", k.v_conv);
      add(a + "f_a_proj.weight", k.f_a);
      add(a + "f_b_proj.weight", k.f_b);
      add(a + "dt_bias", k.dt_bias);
      add(a + "A_log", k.A_log);
      add(a + "b_proj.weight", k.b_proj);
      add(a + "g_a_proj.weight", k.g_a);
      add(a + "g_b_proj.weight", k.g_b);
      add(a + "o_norm.weight", k.o_norm);
      add(a + "o_proj.weight", k.o_proj);
    }
    if (l.dsa) {
      const DsaWeights& d = *l.dsa;
      add(a + "q_a_proj.weight", d.q_a);
      add(a + "q_a_layernorm.weight", d.q_a_norm);
      add(a + "q_b_proj.weight", d.q_b);
      add(a + "kv_a_proj_with_mqa.weight", d.kv_a);
      add(a + "kv_a_layernorm.weight", d.kv_a_norm);
      add(a + "kv_b_proj.weight", d.kv_b);
      add(a + "o_proj.weight", d.o_proj);
    }
    if (l.mlp) add_mlp(p + "mlp.", *l.mlp);
    if (l.moe) {
      add(p + "mlp.gate.weight", l.moe->router);
      for (size_t e = 0; e < l.moe->experts.size(); ++e)
        add_mlp(p + "mlp.experts." + std::to_string(e) + ".", l.moe->experts[e]);
      if (l.moe->shared) add_mlp(p + "mlp.shared_experts.", *l.moe->shared);
    }
  }
  return out;
}

}  // namespace nextlm
