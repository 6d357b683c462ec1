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

// The slice of a kind's weight this rank holds, as load_sharded cuts it (tp_slices).
KindCut kind_cut(const ModelConfig& c, LoraKind k, const Mesh& mesh) {
  const TpSlices s = tp_slices(c, mesh.opt.tp, mesh.tp->rank());
  switch (k) {
    case LoraKind::KdaQ: case LoraKind::KdaK: case LoraKind::KdaV: case LoraKind::KdaFB: case LoraKind::KdaGB:
      return {Cut::Rows, s.kda_channels};
    case LoraKind::KdaB: return {Cut::Rows, s.kda_heads};
    case LoraKind::KdaO: return {Cut::Cols, s.kda_channels};
    case LoraKind::MlaQB: return {Cut::Rows, s.mla_q};
    case LoraKind::MlaKVB: return {Cut::Rows, s.mla_kv};
    case LoraKind::MlaO: return {Cut::Cols, s.mla_o};
    case LoraKind::MlpGate: case LoraKind::MlpUp: return {Cut::Rows, s.mlp};
    case LoraKind::MlpDown: return {Cut::Cols, s.mlp};
    case LoraKind::SharedGate: case LoraKind::SharedUp: return {Cut::Rows, s.shared};
    case LoraKind::SharedDown: return {Cut::Cols, s.shared};
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
    lora_merge_block(m, b.r0, b.rows, b.c0, b.cols, b.base.ptr(), w->ptr());
  }
}

void ShardLora::gradients(LoraAdapter& adapter, const ModelWeights& grads) const {
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
    lora_block_backward(m, b.r0, b.rows, b.c0, b.cols, g->ptr());
  }
}

}  // namespace nextlm::dist
