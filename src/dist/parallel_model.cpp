// Tensor- and expert-parallel CPU forward (see parallel_model.h): sliced loading, the decoder stack with the
// collectives between the model's own component functions, the expert-parallel MoE and the vocab-parallel head.
#include "dist/parallel_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <numeric>

#include "core/error.h"
#include "cpu/linear.h"
#include "model/block.h"
#include "model/dsa.h"
#include "model/kda.h"
#include "model/moe.h"
#include "model/norm.h"

namespace nextlm::dist {

// ---------------------------------------------------------------------------------------------------------------
// Layout

void validate_layout(const ParallelOptions& o, int N, const ModelConfig& c) {
  check(o.tp >= 1, "--tp must be at least 1, got ", o.tp);
  check(o.ep >= 1, "--ep must be at least 1, got ", o.ep);
  check(N % o.tp == 0, "--tp ", o.tp, " does not divide the ", N, " processes (mpirun -np)");
  check(N % o.ep == 0, "--ep ", o.ep, " does not divide the ", N, " processes (mpirun -np)");
  if (c.num_kda_layers() > 0)
    check(c.linear_num_heads % o.tp == 0, "--tp ", o.tp, " does not divide the ", c.linear_num_heads,
          " KDA heads (linear_num_heads) of this model");
  if (c.num_dsa_layers() > 0)
    check(c.num_attention_heads % o.tp == 0, "--tp ", o.tp, " does not divide the ", c.num_attention_heads,
          " attention heads (num_attention_heads) of this model");
  const bool has_moe = std::find(c.mlp_layer_types.begin(), c.mlp_layer_types.end(), MlpType::Sparse) !=
                       c.mlp_layer_types.end();
  if (has_moe)
    check(c.n_routed_experts % o.ep == 0, "--ep ", o.ep, " does not divide the ", c.n_routed_experts,
          " routed experts (n_routed_experts) of this model");
}

Mesh::Mesh(Comm& w, ParallelOptions o) : world(&w), opt(o) {
  check(o.tp >= 1 && w.size() % o.tp == 0, "--tp ", o.tp, " does not divide the ", w.size(),
        " processes (mpirun -np)");
  check(o.ep >= 1 && w.size() % o.ep == 0, "--ep ", o.ep, " does not divide the ", w.size(),
        " processes (mpirun -np)");
  tp = w.split(w.rank() / o.tp, w.rank());
  ep = w.split(w.rank() / o.ep, w.rank());
  replica_size = std::lcm(o.tp, o.ep);
  replica = w.split(w.rank() / replica_size, w.rank());
  dp = w.split(w.rank() % replica_size, w.rank());
}

// ---------------------------------------------------------------------------------------------------------------
// Sliced loading

namespace {

// n values of t starting at element `offset`, widened to fp32 (the dtypes to_f32 takes).
void convert(const TensorView& t, int64_t offset, int64_t n, float* out) {
  const std::byte* p = t.data + static_cast<size_t>(offset) * dtype_size(t.dtype);
  switch (t.dtype) {
    case DType::F32:
      std::memcpy(out, p, static_cast<size_t>(n) * 4);
      break;
    case DType::F64:
      for (int64_t i = 0; i < n; ++i) {
        double v;
        std::memcpy(&v, p + i * 8, 8);
        out[i] = static_cast<float>(v);
      }
      break;
    case DType::BF16:
    case DType::F16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, p + i * 2, 2);
        out[i] = t.dtype == DType::BF16 ? bf16_to_f32(b) : f16_to_f32(b);
      }
      break;
    default:
      fail("tensor ", t.name, " in ", t.file, " has integer dtype ", dtype_name(t.dtype), ", expected a float");
  }
}

// Which part of a tensor a rank reads: all of it, a range of its first dimension (trailing dimensions whole), or a
// range of the second dimension of a 2-D tensor.
struct Slice {
  enum Kind { Whole, Rows, Cols } kind = Whole;
  Range r;
  static Slice whole() { return {}; }
  static Slice rows(Range r) { return {Rows, r}; }
  static Slice cols(Range r) { return {Cols, r}; }
};

class ShardLoader {
 public:
  ShardLoader(const TensorSource& src, std::string prefix) : src_(src), prefix_(std::move(prefix)) {}

  // Checks that `name` has the full model's shape, then reads only the slice.
  Tensor get(const std::string& name, const std::vector<int64_t>& shape, Slice s = {}, bool absolute = false) {
    const std::string full = absolute ? name : prefix_ + name;
    const TensorView* t = src_.find(full);
    check(t != nullptr, src_.where, " is missing tensor ", full);
    check(t->shape == shape, "tensor ", full, " in ", t->file, " has shape ", shape_str(t->shape), ", expected ",
          shape_str(shape));
    Tensor out;
    out.shape = shape;
    const int64_t R = shape.empty() ? 1 : shape[0];
    const int64_t C = R ? t->numel() / std::max<int64_t>(R, 1) : 0;
    if (s.kind == Slice::Whole) {
      out.data.resize(static_cast<size_t>(t->numel()));
      convert(*t, 0, t->numel(), out.ptr());
    } else if (s.kind == Slice::Rows) {
      check(s.r.begin >= 0 && s.r.end <= R, "slice of ", full, " out of range");
      out.shape[0] = s.r.size();
      out.data.resize(static_cast<size_t>(s.r.size() * C));
      convert(*t, s.r.begin * C, s.r.size() * C, out.ptr());
    } else {
      check(shape.size() == 2 && s.r.begin >= 0 && s.r.end <= shape[1], "column slice of ", full, " out of range");
      out.shape[1] = s.r.size();
      out.data.resize(static_cast<size_t>(R * s.r.size()));
      for (int64_t i = 0; i < R; ++i) convert(*t, i * shape[1] + s.r.begin, s.r.size(), out.ptr() + i * s.r.size());
    }
    return out;
  }
  // Conv weights are stored [C, 1, W]; the forward wants [C, W].
  Tensor get_conv(const std::string& name, int64_t C, int64_t W, Range rows) {
    Tensor t = get(name, {C, 1, W}, Slice::rows(rows));
    t.shape = {rows.size(), W};
    return t;
  }

 private:
  const TensorSource& src_;
  std::string prefix_;
};

// A clamped SwiGLU MLP of width I, its width split over the TP group: gate/up rows, down columns.
MlpWeights load_mlp_tp(ShardLoader& ld, const std::string& p, int64_t D, int64_t I, Range w) {
  return MlpWeights{ld.get(p + "gate_proj.weight", {I, D}, Slice::rows(w)),
                    ld.get(p + "up_proj.weight", {I, D}, Slice::rows(w)),
                    ld.get(p + "down_proj.weight", {D, I}, Slice::cols(w))};
}

HcWeights load_hc(ShardLoader& ld, const std::string& p, const ModelConfig& c) {
  const int64_t S = c.hc_mult, D = c.hidden_size, M = (2 + S) * S;
  return HcWeights{ld.get(p + "_fn", {M, S * D}), ld.get(p + "_base", {M}), ld.get(p + "_scale", {3})};
}

KdaWeights load_kda(ShardLoader& ld, const std::string& p, const ModelConfig& c, const TpSlices& s) {
  const int64_t D = c.hidden_size, H = c.linear_num_heads, K = c.linear_head_dim, W = c.linear_conv_kernel_dim;
  const Range heads = s.kda_heads, ch = s.kda_channels;
  KdaWeights w;
  w.q_proj = ld.get(p + "q_proj.weight", {H * K, D}, Slice::rows(ch));
  w.k_proj = ld.get(p + "k_proj.weight", {H * K, D}, Slice::rows(ch));
  w.v_proj = ld.get(p + "v_proj.weight", {H * K, D}, Slice::rows(ch));
  w.q_conv = ld.get_conv(p + "q_conv1d.weight", H * K, W, ch);
  w.k_conv = ld.get_conv(p + "k_conv1d.weight", H * K, W, ch);
  w.v_conv = ld.get_conv(p + "v_conv1d.weight", H * K, W, ch);
  w.f_a = ld.get(p + "f_a_proj.weight", {K, D});
  w.f_b = ld.get(p + "f_b_proj.weight", {H * K, K}, Slice::rows(ch));
  w.dt_bias = ld.get(p + "dt_bias", {H * K}, Slice::rows(ch));
  w.A_log = ld.get(p + "A_log", {H}, Slice::rows(heads));
  w.b_proj = ld.get(p + "b_proj.weight", {H, D}, Slice::rows(heads));
  w.g_a = ld.get(p + "g_a_proj.weight", {K, D});
  w.g_b = ld.get(p + "g_b_proj.weight", {H * K, K}, Slice::rows(ch));
  w.o_norm = ld.get(p + "o_norm.weight", {K});
  w.o_proj = ld.get(p + "o_proj.weight", {D, H * K}, Slice::cols(ch));
  return w;
}

DsaWeights load_dsa(ShardLoader& ld, const std::string& p, const ModelConfig& c, bool full_indexer,
                    const TpSlices& s) {
  const int64_t D = c.hidden_size, NH = c.num_attention_heads, dqk = c.qk_nope_head_dim, dv = c.v_head_dim;
  const int64_t QL = c.q_lora_rank, KL = c.kv_lora_rank;
  DsaWeights w;
  w.q_a = ld.get(p + "q_a_proj.weight", {QL, D});
  w.q_a_norm = ld.get(p + "q_a_layernorm.weight", {QL});
  w.q_b = ld.get(p + "q_b_proj.weight", {NH * dqk, QL}, Slice::rows(s.mla_q));
  w.kv_a = ld.get(p + "kv_a_proj_with_mqa.weight", {KL, D});
  w.kv_a_norm = ld.get(p + "kv_a_layernorm.weight", {KL});
  w.kv_b = ld.get(p + "kv_b_proj.weight", {NH * (dqk + dv), KL}, Slice::rows(s.mla_kv));
  w.o_proj = ld.get(p + "o_proj.weight", {D, NH * dv}, Slice::cols(s.mla_o));
  if (full_indexer) w.indexer = load_indexer(ld, p + "indexer.", c);  // replicated: every rank selects the same
  return w;
}

MoeWeights load_moe(ShardLoader& ld, const std::string& p, const ModelConfig& c, Range experts, Range shared,
                    bool frozen) {
  const int64_t D = c.hidden_size, E = c.n_routed_experts, I = c.moe_intermediate_size;
  MoeWeights w;
  w.router = ld.get(p + "gate.weight", {E, D});
  if (frozen) w.correction_bias = ld.get(p + "gate.e_score_correction_bias", {E});
  for (int64_t e = experts.begin; e < experts.end; ++e) {
    const Range whole{0, I};
    w.experts.push_back(load_mlp_tp(ld, p + "experts." + std::to_string(e) + ".", D, I, whole));
  }
  if (c.n_shared_experts > 0) w.shared = load_mlp_tp(ld, p + "shared_experts.", D, I * c.n_shared_experts, shared);
  return w;
}

}  // namespace

TpSlices tp_slices(const ModelConfig& c, int tp, int tp_rank) {
  auto times = [](Range r, int64_t n) { return Range{r.begin * n, r.end * n}; };
  TpSlices s;
  s.vocab = split_range(c.vocab_size, tp, tp_rank);
  s.kda_heads = split_range(c.linear_num_heads, tp, tp_rank);
  s.kda_channels = times(s.kda_heads, c.linear_head_dim);
  s.mla_heads = split_range(c.num_attention_heads, tp, tp_rank);
  s.mla_q = times(s.mla_heads, c.qk_nope_head_dim);
  s.mla_kv = times(s.mla_heads, c.qk_nope_head_dim + c.v_head_dim);
  s.mla_o = times(s.mla_heads, c.v_head_dim);
  s.mlp = split_range(c.intermediate_size, tp, tp_rank);
  s.shared = split_range(c.moe_intermediate_size * c.n_shared_experts, tp, tp_rank);
  return s;
}

ShardedModel load_sharded(const TensorSource& src, const ModelConfig& c, const Mesh& mesh, bool frozen) {
  validate_layout(mesh.opt, mesh.world->size(), c);
  const int tp = mesh.opt.tp, tr = mesh.tp->rank(), ep = mesh.opt.ep, er = mesh.ep->rank();
  ShardedModel m;
  m.config = c;
  m.local = c;
  m.local.linear_num_heads = c.linear_num_heads / tp;
  m.local.num_attention_heads = c.num_attention_heads / tp;
  m.local.num_key_value_heads = c.num_key_value_heads / tp;
  const TpSlices s = tp_slices(c, tp, tr);
  m.vocab = s.vocab;
  m.experts = split_range(c.n_routed_experts, ep, er);

  std::string prefix = "model.language_model.";
  if (!src.find(prefix + "embed_tokens.weight") && src.find("model.embed_tokens.weight")) prefix = "model.";
  ShardLoader ld(src, prefix);
  const int64_t V = c.vocab_size, D = c.hidden_size;
  ModelWeights& w = m.weights;
  w.embed = ld.get("embed_tokens.weight", {V, D}, Slice::rows(m.vocab));
  w.final_norm = ld.get("norm.weight", {D});
  if (c.tie_word_embeddings && !src.find("lm_head.weight")) {
    w.lm_head = w.embed;
  } else {
    w.lm_head = ld.get("lm_head.weight", {V, D}, Slice::rows(m.vocab), /*absolute=*/true);
  }
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    LayerWeights lw;
    lw.hc_attn = load_hc(ld, p + "hc_attn", c);
    lw.hc_ffn = load_hc(ld, p + "hc_ffn", c);
    lw.input_norm = ld.get(p + "input_layernorm.weight", {D});
    lw.post_attention_norm = ld.get(p + "post_attention_layernorm.weight", {D});
    if (c.layer_types[i] == LayerType::LinearAttention) {
      lw.kda = load_kda(ld, p + "self_attn.", c, s);
    } else {
      lw.dsa = load_dsa(ld, p + "self_attn.", c, frozen && c.indexer_types[i] == IndexerType::Full, s);
    }
    if (c.mlp_layer_types[i] == MlpType::Dense) {
      lw.mlp = load_mlp_tp(ld, p + "mlp.", D, c.intermediate_size, s.mlp);
    } else {
      lw.moe = load_moe(ld, p + "mlp.", c, m.experts, s.shared, frozen);
    }
    w.layers.push_back(std::move(lw));
  }
  return m;
}

ShardedModel load_sharded(const std::string& dir, const Mesh& mesh) {
  const std::filesystem::path cfg = std::filesystem::path(dir) / "config.json";
  check(std::filesystem::is_directory(dir), "model directory ", dir, " does not exist");
  check(std::filesystem::exists(cfg), "no config.json in ", dir);
  const ModelConfig c = load_config(cfg.string());
  validate_layout(mesh.opt, mesh.world->size(), c);  // before opening the checkpoint: flag errors come first
  const Checkpoint ckpt(dir);
  return load_sharded(ckpt, c, mesh);
}

ShardedModel load_sharded(const Checkpoint& ckpt, const ModelConfig& c, const Mesh& mesh) {
  const TensorSource src{[&](const std::string& name) { return ckpt.find(name); }, "checkpoint " + ckpt.dir()};
  return load_sharded(src, c, mesh, /*frozen=*/true);
}

// ---------------------------------------------------------------------------------------------------------------
// Forward

// The MoE sub-layer over the EP group. x [T, D] (the same on every rank), y [T, D].
// The shared expert runs tensor-parallel on all T tokens. For the routed experts, EP rank p takes the tokens of
// split_range(T, ep, p): it routes them, sends each (token, choice) row to the rank owning the expert (all-to-all,
// in token order, so an expert sees its tokens in the same order as moe_forward), receives the expert outputs back
// (all-to-all) and adds them to the shared output in expert order, as moe_forward does. An all-gather over the EP
// group then gives every rank every token's row.
void moe_parallel_forward(const MoeWeights& w, const ShardedModel& m, const Mesh& mesh, const float* x, int64_t T,
                          float* y) {
  const ModelConfig& c = m.config;
  const int64_t D = c.hidden_size, k = c.num_experts_per_tok;
  const float L = static_cast<float>(c.swiglu_limit);
  Comm& ep = *mesh.ep;
  const int P = ep.size(), me = ep.rank();
  const int64_t per_rank = c.n_routed_experts / P;

  if (w.shared) {
    mlp_forward(*w.shared, L, x, T, D, y);
    mesh.tp->all_reduce_sum(y, static_cast<size_t>(T * D));
  } else {
    std::fill(y, y + T * D, 0.0f);
  }

  // Route this rank's tokens and build the dispatch: per destination, the expert ids and token rows. The router runs
  // on all T tokens (every rank holds them) and keeps this rank's share: its GEMM then has moe_forward's shape, so the
  // routing weights are moe_forward's bits whatever BLAS kernel runs it (OpenBLAS's generic kernels sum a row in an
  // order that depends on the row count; routing only T/P rows changed the EP=4 logits in the last bits).
  const Range mine = split_range(T, P, me);
  const int64_t n = mine.size();
  Routing r;
  {
    const Routing all = route_forward(w, c, x, T);
    r.experts.assign(all.experts.begin() + mine.begin * k, all.experts.begin() + mine.end * k);
    r.weights.assign(all.weights.begin() + mine.begin * k, all.weights.begin() + mine.end * k);
  }
  std::vector<std::vector<int32_t>> ids(P);
  std::vector<std::vector<float>> rows(P);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < k; ++i) {
      const int32_t e = r.experts[t * k + i];
      const int q = static_cast<int>(e / per_rank);
      ids[q].push_back(e);
      rows[q].insert(rows[q].end(), x + (mine.begin + t) * D, x + (mine.begin + t + 1) * D);
    }
  std::vector<size_t> send_n(P), recv_n(P);
  for (int q = 0; q < P; ++q) send_n[q] = ids[q].size();
  ep.all_to_allv(send_n.data(), std::vector<size_t>(P, sizeof(size_t)), recv_n.data(),
                 std::vector<size_t>(P, sizeof(size_t)));
  auto bytes = [](const std::vector<size_t>& cnt, size_t unit) {
    std::vector<size_t> b(cnt.size());
    for (size_t i = 0; i < cnt.size(); ++i) b[i] = cnt[i] * unit;
    return b;
  };
  std::vector<int32_t> send_ids, recv_ids;
  std::vector<float> send_rows, recv_rows;
  for (int q = 0; q < P; ++q) {
    send_ids.insert(send_ids.end(), ids[q].begin(), ids[q].end());
    send_rows.insert(send_rows.end(), rows[q].begin(), rows[q].end());
  }
  size_t total = 0;
  for (size_t v : recv_n) total += v;
  recv_ids.resize(total);
  recv_rows.resize(total * D);
  ep.all_to_allv(send_ids.data(), bytes(send_n, sizeof(int32_t)), recv_ids.data(), bytes(recv_n, sizeof(int32_t)));
  ep.all_to_allv(send_rows.data(), bytes(send_n, D * sizeof(float)), recv_rows.data(),
                 bytes(recv_n, D * sizeof(float)));

  // Run the held experts on their rows (received in source-rank then token order: global token order).
  std::vector<float> out(total * D);
  for (int64_t e = m.experts.begin; e < m.experts.end; ++e) {
    std::vector<size_t> list;
    for (size_t j = 0; j < total; ++j)
      if (recv_ids[j] == e) list.push_back(j);
    if (list.empty()) continue;
    const int64_t cnt = static_cast<int64_t>(list.size());
    std::vector<float> xin(cnt * D), yout(cnt * D);
    for (int64_t i = 0; i < cnt; ++i) std::copy_n(recv_rows.data() + list[i] * D, D, xin.data() + i * D);
    mlp_forward(w.experts[e - m.experts.begin], L, xin.data(), cnt, D, yout.data());
    for (int64_t i = 0; i < cnt; ++i) std::copy_n(yout.data() + i * D, D, out.data() + list[i] * D);
  }

  // Combine: the outputs go back to their tokens' ranks in the order they came.
  std::vector<float> back(send_rows.size());
  ep.all_to_allv(out.data(), bytes(recv_n, D * sizeof(float)), back.data(), bytes(send_n, D * sizeof(float)));
  // Where each (token, choice) landed in `back`: destinations in rank order, each in token order.
  std::vector<size_t> offset(P, 0);
  for (int q = 1; q < P; ++q) offset[q] = offset[q - 1] + send_n[q - 1];
  std::vector<size_t> slot(static_cast<size_t>(n * k));
  {
    std::vector<size_t> next = offset;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t i = 0; i < k; ++i) slot[t * k + i] = next[r.experts[t * k + i] / per_rank]++;
  }
  for (int64_t t = 0; t < n; ++t) {
    std::vector<int64_t> order(k);
    for (int64_t i = 0; i < k; ++i) order[i] = i;
    std::sort(order.begin(), order.end(),
              [&](int64_t a, int64_t b) { return r.experts[t * k + a] < r.experts[t * k + b]; });
    float* yt = y + (mine.begin + t) * D;
    for (int64_t i : order) {
      const float wt = r.weights[t * k + i];
      const float* o = back.data() + slot[t * k + i] * D;
      for (int64_t d = 0; d < D; ++d) yt[d] += wt * o[d];
    }
  }

  // Every rank gets every token's row.
  if (P > 1) {
    std::vector<size_t> counts(P);
    for (int q = 0; q < P; ++q) counts[q] = static_cast<size_t>(split_range(T, P, q).size() * D) * sizeof(float);
    std::vector<float> all(T * D);
    ep.all_gatherv(y + mine.begin * D, all.data(), counts);
    std::copy(all.begin(), all.end(), y);
  }
}

Tensor parallel_decoder_forward(const ShardedModel& m, const Mesh& mesh, const std::vector<int32_t>& tokens,
                                const AttentionFn& attention) {
  const ModelConfig& c = m.config;
  const ModelWeights& w = m.weights;
  const int64_t T = static_cast<int64_t>(tokens.size()), D = c.hidden_size;
  Comm& tp = *mesh.tp;

  // Vocab-parallel embedding: the rank holding a token's row contributes it, the others zeros.
  std::vector<float> e(T * D, 0.0f);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t v = tokens[t];
    if (v >= m.vocab.begin && v < m.vocab.end)
      std::copy_n(w.embed.ptr() + (v - m.vocab.begin) * D, D, e.data() + t * D);
  }
  tp.all_reduce_sum(e.data(), e.size());

  // The shared layer stack (model/block.cpp) with the sharded sub-layers: each ends in its collective.
  return decoder_forward(
      w, c, e.data(), T,
      [&](int64_t i, const float* a, float* y, Selection& sel) {
        attention(i, a, y, sel);
        tp.all_reduce_sum(y, T * D);  // row-parallel o_proj
      },
      [&](int64_t i, const float* a, float* y) {
        const LayerWeights& lw = w.layers[i];
        if (lw.mlp) {
          mlp_forward(*lw.mlp, static_cast<float>(c.swiglu_limit), a, T, D, y);
          tp.all_reduce_sum(y, T * D);  // row-parallel down_proj
        } else {
          moe_parallel_forward(*lw.moe, m, mesh, a, T, y);
        }
      });
}

Tensor parallel_forward_hidden(const ShardedModel& m, const Mesh& mesh, const PackedBatch& batch,
                               const ForwardOptions& opt) {
  validate_batch(batch, m.config.vocab_size);
  const int64_t T = batch.num_tokens();
  return parallel_decoder_forward(m, mesh, batch.tokens, [&](int64_t i, const float* a, float* y, Selection& sel) {
    const LayerWeights& lw = m.weights.layers[i];
    if (lw.kda) {
      kda_layer_forward(*lw.kda, m.local, a, T, batch.cu_seqlens, y, opt.kda_form);
    } else {
      dsa_layer_forward(*lw.dsa, m.local, a, T, batch.cu_seqlens, sel, y, opt.empty_selection);
    }
  });
}

std::vector<std::vector<double>> parallel_next_token_logprobs(const ShardedModel& m, const Mesh& mesh,
                                                              const Tensor& h, const PackedBatch& batch) {
  const int64_t V = m.config.vocab_size, D = m.config.hidden_size, T = batch.num_tokens();
  const int64_t Vl = m.vocab.size(), v0 = m.vocab.begin;
  Comm& tp = *mesh.tp;
  std::vector<std::vector<double>> out(batch.num_seqs());
  std::vector<int64_t> seq_of(T);
  for (int64_t n = 0; n < batch.num_seqs(); ++n)
    for (int64_t t = batch.cu_seqlens[n]; t < batch.cu_seqlens[n + 1]; ++t) seq_of[t] = n;
  // The same row blocks on every rank (they depend on V only), so the collectives pair up.
  const int64_t block = std::max<int64_t>(1, (int64_t{1} << 24) / V);
  std::vector<float> lg;
  for (int64_t b0 = 0; b0 < T; b0 += block) {
    const int64_t b1 = std::min(T, b0 + block), rows = b1 - b0;
    lg.assign(static_cast<size_t>(rows * Vl), 0.0f);
    cpu::linear(h.ptr() + b0 * D, rows, D, m.weights.lm_head, lg.data());
    // Parallel log-softmax: global max, then Σ exp(x − max) and the target logit, each reduced over the TP group.
    std::vector<float> mx(rows, -INFINITY);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t v = 0; v < Vl; ++v) mx[i] = std::max(mx[i], lg[i * Vl + v]);
    tp.all_reduce_max(mx.data(), mx.size());
    std::vector<double> red(2 * rows, 0.0);  // [Σexp | target logit]
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t t = b0 + i;
      double sum = 0.0;
      for (int64_t v = 0; v < Vl; ++v) sum += std::exp(static_cast<double>(lg[i * Vl + v]) - mx[i]);
      red[i] = sum;
      if (t + 1 < batch.cu_seqlens[seq_of[t] + 1]) {
        const int64_t target = batch.tokens[t + 1];
        if (target >= v0 && target < v0 + Vl) red[rows + i] = lg[i * Vl + (target - v0)];
      }
    }
    tp.all_reduce_sum(red.data(), red.size());
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t t = b0 + i, n = seq_of[t];
      if (t + 1 >= batch.cu_seqlens[n + 1]) continue;
      out[n].push_back(red[rows + i] - mx[i] - std::log(red[i]));
    }
  }
  return out;
}

Tensor parallel_logits(const ShardedModel& m, const Mesh& mesh, const Tensor& h, int64_t begin, int64_t end) {
  const int64_t V = m.config.vocab_size, D = m.config.hidden_size, rows = end - begin;
  Comm& tp = *mesh.tp;
  const int P = tp.size();
  std::vector<float> mine(static_cast<size_t>(rows * m.vocab.size()));
  cpu::linear(h.ptr() + begin * D, rows, D, m.weights.lm_head, mine.data());
  std::vector<size_t> counts(P);
  for (int q = 0; q < P; ++q) counts[q] = static_cast<size_t>(rows * split_range(V, P, q).size()) * sizeof(float);
  std::vector<float> all(static_cast<size_t>(rows * V));
  tp.all_gatherv(mine.data(), all.data(), counts);
  Tensor out({rows, V});
  int64_t off = 0;
  for (int q = 0; q < P; ++q) {
    const Range vr = split_range(V, P, q);
    for (int64_t i = 0; i < rows; ++i)
      std::copy_n(all.data() + off + i * vr.size(), vr.size(), out.ptr() + i * V + vr.begin);
    off += rows * vr.size();
  }
  return out;
}

}  // namespace nextlm::dist
