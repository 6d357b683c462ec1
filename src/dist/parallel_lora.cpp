// LoRA on a tensor/expert-parallel CPU shard (see parallel_lora.h).
#include "dist/parallel_lora.h"

#include <algorithm>

#include "core/error.h"

namespace nextlm::dist {

namespace {

// Where a kind's weight is sliced: rows or columns over the TP group, or whole on every rank holding it.
enum class Cut { Rows, Cols, Whole };

struct KindCut {
  Cut cut;
  Range range;  // rows or columns of the full weight held here (Cut::Whole: unused)
};

// The slice of a kind's weight this rank holds, as load_sharded cuts it (parallel_model.cpp).
KindCut kind_cut(const ModelConfig& c, LoraKind k, const Mesh& mesh) {
  const int tp = mesh.opt.tp, tr = mesh.tp->rank();
  auto times = [](Range r, int64_t n) { return Range{r.begin * n, r.end * n}; };
  const Range kda_heads = split_range(c.linear_num_heads, tp, tr);
  const Range mla_heads = split_range(c.num_attention_heads, tp, tr);
  const Range ch = times(kda_heads, c.linear_head_dim);
  const Range mlp = split_range(c.intermediate_size, tp, tr);
  const Range shared = split_range(c.moe_intermediate_size * c.n_shared_experts, tp, tr);
  switch (k) {
    case LoraKind::KdaQ: case LoraKind::KdaK: case LoraKind::KdaV: case LoraKind::KdaFB: case LoraKind::KdaGB:
      return {Cut::Rows, ch};
    case LoraKind::KdaB: return {Cut::Rows, kda_heads};
    case LoraKind::KdaO: return {Cut::Cols, ch};
    case LoraKind::MlaQB: return {Cut::Rows, times(mla_heads, c.qk_nope_head_dim)};
    case LoraKind::MlaKVB: return {Cut::Rows, times(mla_heads, c.qk_nope_head_dim + c.v_head_dim)};
    case LoraKind::MlaO: return {Cut::Cols, times(mla_heads, c.v_head_dim)};
    case LoraKind::MlpGate: case LoraKind::MlpUp: return {Cut::Rows, mlp};
    case LoraKind::MlpDown: return {Cut::Cols, mlp};
    case LoraKind::SharedGate: case LoraKind::SharedUp: return {Cut::Rows, shared};
    case LoraKind::SharedDown: return {Cut::Cols, shared};
    case LoraKind::KdaFA: case LoraKind::KdaGA: case LoraKind::MlaQA: case LoraKind::MlaKVA:
    case LoraKind::ExpertGate: case LoraKind::ExpertUp: case LoraKind::ExpertDown:
      return {Cut::Whole, {}};
  }
  return {Cut::Whole, {}};
}

}  // namespace

ShardLora::ShardLora(const LoraAdapter& adapter, const ShardedModel& model, const Mesh& mesh) {
  const ModelConfig& c = model.config;
  const int me = mesh.replica->rank();
  const std::vector<LoraModule>& mods = adapter.modules();
  for (size_t i = 0; i < mods.size(); ++i) {
    const LoraModule& m = mods[i];
    const int64_t O = m.B.dim(0), I = m.A.dim(1);
    const KindCut kc = kind_cut(c, m.kind, mesh);
    std::vector<int64_t> locals{-1};
    if (lora_kind_is_expert(m.kind)) {
      locals.clear();
      for (int64_t e = model.experts.begin; e < model.experts.end; ++e)
        if (m.expert == LoraModule::kAllExperts || m.expert == e) locals.push_back(e - model.experts.begin);
    }
    for (int64_t local : locals) {
      Block b;
      b.module = i;
      b.local = local;
      b.rows = O, b.cols = I;
      if (kc.cut == Cut::Rows) b.r0 = kc.range.begin, b.rows = kc.range.size();
      if (kc.cut == Cut::Cols) b.c0 = kc.range.begin, b.cols = kc.range.size();
      // One copy of each block per replica: TP slices on the first TP group, experts on the first EP group, the
      // replicated projections on the replica's first rank.
      b.counted = lora_kind_is_expert(m.kind) ? me < mesh.opt.ep : kc.cut == Cut::Whole ? me == 0 : me < mesh.opt.tp;
      const Tensor* w = lora_base_weight(model.weights, m.kind, m.layer, local);
      check(w != nullptr && w->shape == std::vector<int64_t>{b.rows, b.cols}, "LoRA on a shard: ",
            adapter.module_path(m, local < 0 ? -1 : local + model.experts.begin, ""),
            " is not the slice this rank should hold");
      b.base = *w;
      blocks_.push_back(std::move(b));
    }
  }
}

void ShardLora::apply(const LoraAdapter& adapter, ModelWeights& weights) const {
  for (const Block& b : blocks_) {
    const LoraModule& m = adapter.modules()[b.module];
    Tensor* w = lora_base_weight(weights, m.kind, m.layer, b.local);
    check(w != nullptr && w->numel() == b.rows * b.cols, "LoRA on a shard: the weights do not match the adapter");
    const int64_t I = m.A.dim(1), r = m.rank;
    const float s = static_cast<float>(m.scale);
    const float* A = m.A.ptr();
    const float* B = m.B.ptr();
    const float* base = b.base.ptr();
    float* out = w->ptr();
    // lora_merge's arithmetic, element by element: the row of B·A accumulated over k in order, scaled, added.
#pragma omp parallel
    {
      std::vector<float> row(b.cols);
#pragma omp for schedule(static)
      for (int64_t o = 0; o < b.rows; ++o) {
        std::fill(row.begin(), row.end(), 0.0f);
        for (int64_t k = 0; k < r; ++k) {
          const float x = B[(b.r0 + o) * r + k];
          const float* a = A + k * I + b.c0;
          for (int64_t j = 0; j < b.cols; ++j) row[j] += x * a[j];
        }
        for (int64_t j = 0; j < b.cols; ++j) out[o * b.cols + j] = base[o * b.cols + j] + s * row[j];
      }
    }
  }
}

void ShardLora::gradients(LoraAdapter& adapter, const ModelWeights& grads, Comm& world) const {
  std::vector<LoraModule>& mods = adapter.modules();
  for (LoraModule& m : mods) {
    std::fill(m.dA.data.begin(), m.dA.data.end(), 0.0f);
    std::fill(m.dB.data.begin(), m.dB.data.end(), 0.0f);
  }
  for (const Block& b : blocks_) {
    if (!b.counted) continue;
    LoraModule& m = mods[b.module];
    const Tensor* g = lora_base_weight(grads, m.kind, m.layer, b.local);
    check(g != nullptr && g->numel() == b.rows * b.cols, "LoRA on a shard: no gradient for a block of ",
          adapter.module_path(m, -1, ""));
    const int64_t I = m.A.dim(1), r = m.rank, R = b.rows, C = b.cols;
    const float s = static_cast<float>(m.scale);
    const float* G = g->ptr();
    const float* A = m.A.ptr();
    const float* B = m.B.ptr();
    float* dA = m.dA.ptr();
    float* dB = m.dB.ptr();
    // dB[r0 + o, k] += s·Σ_j G[o, j]·A[k, c0 + j]
#pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < R; ++o)
      for (int64_t k = 0; k < r; ++k) {
        double acc = 0.0;
        for (int64_t j = 0; j < C; ++j) acc += static_cast<double>(G[o * C + j]) * A[k * I + b.c0 + j];
        dB[(b.r0 + o) * r + k] += s * static_cast<float>(acc);
      }
    // dA[k, c0 + j] += s·Σ_o B[r0 + o, k]·G[o, j]
#pragma omp parallel
    {
      std::vector<double> acc(C);
#pragma omp for schedule(static)
      for (int64_t k = 0; k < r; ++k) {
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t o = 0; o < R; ++o) {
          const double x = B[(b.r0 + o) * r + k];
          for (int64_t j = 0; j < C; ++j) acc[j] += x * G[o * C + j];
        }
        for (int64_t j = 0; j < C; ++j) dA[k * I + b.c0 + j] += s * static_cast<float>(acc[j]);
      }
    }
  }
  // One buffer over every module's dA and dB, summed over the world in chunks (an MPI message stays under 2 GiB).
  size_t total = 0;
  for (const LoraModule& m : mods) total += static_cast<size_t>(m.dA.numel() + m.dB.numel());
  std::vector<float> flat(total);
  size_t off = 0;
  for (const LoraModule& m : mods)
    for (const Tensor* t : {&m.dA, &m.dB}) {
      std::copy(t->data.begin(), t->data.end(), flat.begin() + static_cast<std::ptrdiff_t>(off));
      off += static_cast<size_t>(t->numel());
    }
  const size_t chunk = size_t{1} << 22;
  for (size_t i = 0; i < total; i += chunk) world.all_reduce_sum(flat.data() + i, std::min(chunk, total - i));
  off = 0;
  for (LoraModule& m : mods)
    for (Tensor* t : {&m.dA, &m.dB}) {
      std::copy_n(flat.begin() + static_cast<std::ptrdiff_t>(off), t->numel(), t->data.begin());
      off += static_cast<size_t>(t->numel());
    }
}

}  // namespace nextlm::dist
