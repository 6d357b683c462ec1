// LoRA on the CPU reference path (model/lora.h): targets, PEFT init, the adapters' gradients against finite
// differences, B = 0 leaving the model exactly as it is, merged checkpoints equal to the adapter forward, PEFT names,
// shapes and config, training steps that lower the loss and resume bit for bit, the trainer with its base on disk
// (the same adapters, steps and checkpoint files from the config and tensor shapes alone, no base weight held), and
// the CLI (train, score --adapter, merge) with its errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <optional>
#include <random>
#include <regex>
#include <map>
#include <set>
#include <sstream>

#include <sys/resource.h>
#include <unistd.h>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "cpu/linear.h"
#include "io/safetensors.h"
#include "model/init.h"
#include "model/lora.h"
#include "model/model.h"
#include "model/train.h"
#include "model/trainer.h"
#include "test_util.h"

namespace nextlm::test {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// One thread: the models are tiny, and on the shared 2-core development machine OpenMP's spinning threads make
// these tests several times slower.
const bool kOneThread = (cpu::set_num_threads(1), true);

std::string tiny_dir() { return std::string(NEXTLM_SOURCE_DIR) + "/examples/tiny-glm5-next"; }
std::string sharded_dir() { return golden_dir("bf16_sharded"); }

PackedBatch text_batch() {
  PackedBatch b;
  for (const std::string& s : {std::string("The cat sat on the mat."), std::string("A dog, a log.")}) {
    std::vector<int32_t> t;
    for (unsigned char ch : s) t.push_back(ch);
    b.add(t);
  }
  return b;
}

double loss_of(const Model& m, const PackedBatch& b) {
  double l = 0;
  for (const auto& seq : m.next_token_logprobs(b))
    for (double x : seq) l -= x;
  return l;
}

// Every module's B random (normal, sd `sd`), so that A gets gradient and the adapters change the model.
void randomise_b(LoraAdapter& ad, float sd, unsigned seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> n(0.0f, sd);
  for (LoraModule& m : ad.modules())
    for (float& x : m.B.data) x = n(g);
}

LoraOptions options(int64_t rank, double alpha, const std::string& targets, LoraExperts ex, bool div = false) {
  LoraOptions o;
  o.rank = rank;
  o.alpha = alpha;
  o.targets = targets;
  o.experts = ex;
  o.rank_div_topk = div;
  return o;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.shape == b.shape && std::memcmp(a.ptr(), b.ptr(), a.numel() * sizeof(float)) == 0;
}

TEST(LoraTargets, ParseGroupsLeavesAndQualifiedNames) {
  EXPECT_EQ(parse_lora_targets("all").size(), 23u);
  EXPECT_EQ(parse_lora_targets("kda").size(), 9u);
  EXPECT_EQ(parse_lora_targets("mla").size(), 5u);
  EXPECT_EQ(parse_lora_targets("o_proj"), (std::vector<LoraKind>{LoraKind::KdaO, LoraKind::MlaO}));
  EXPECT_EQ(parse_lora_targets("kda.o_proj"), (std::vector<LoraKind>{LoraKind::KdaO}));
  EXPECT_EQ(parse_lora_targets("gate_proj"),
            (std::vector<LoraKind>{LoraKind::MlpGate, LoraKind::SharedGate, LoraKind::ExpertGate}));
  EXPECT_EQ(parse_lora_targets("experts.down_proj, mla,kda.o_proj").size(), 7u);
  for (const std::string bad : {"foo", "kda.kv_b_proj", "", "kda,", "experts.gate"}) {
    try {
      parse_lora_targets(bad);
      ADD_FAILURE() << "accepted \"" << bad << "\"";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("LoRA target"), std::string::npos) << e.what();
    }
  }
}

TEST(LoraInit, PeftDistributionsRanksAndSeeds) {
  const Model model = Model::load(tiny_dir());
  const ModelConfig& c = model.config();
  // tiny: KKKD KKKD, layer 0 dense, 8 experts top-2 with a shared expert.
  const LoraAdapter per(c, options(4, 8.0, "all", LoraExperts::PerExpert, true), 3);
  EXPECT_EQ(per.modules().size(), 6u * 9 + 2 * 5 + 3 + 7 * 3 + 7 * 3 * 8);
  const LoraAdapter shared(c, options(4, 8.0, "all", LoraExperts::Shared), 3);
  EXPECT_EQ(shared.modules().size(), 6u * 9 + 2 * 5 + 3 + 7 * 3 + 7 * 3);
  double s2 = 0, n = 0;
  for (const LoraModule& m : per.modules()) {
    const bool ex = lora_kind_is_expert(m.kind);
    EXPECT_EQ(m.rank, ex ? 2 : 4);  // 4 / top-2
    EXPECT_EQ(m.scale, 8.0 / m.rank);
    const float bound = 1.0f / std::sqrt(static_cast<float>(m.A.dim(1)));
    for (float x : m.A.data) {
      ASSERT_LE(std::fabs(x), bound);
      s2 += double(x / bound) * (x / bound), ++n;
    }
    for (float x : m.B.data) ASSERT_EQ(x, 0.0f);
  }
  EXPECT_NEAR(std::sqrt(s2 / n), 1.0 / std::sqrt(3.0), 0.01);  // U(−b, b) has sd b/√3
  // The shapes are the model's (capture checks them), and the seed decides A.
  EXPECT_EQ(per.capture(model.weights()).size(), per.modules().size());
  EXPECT_EQ(shared.capture(model.weights()).size(), per.modules().size());
  const LoraAdapter again(c, options(4, 8.0, "all", LoraExperts::PerExpert, true), 3);
  const LoraAdapter other(c, options(4, 8.0, "all", LoraExperts::PerExpert, true), 4);
  EXPECT_TRUE(same_bits(per.modules()[5].A, again.modules()[5].A));
  EXPECT_FALSE(same_bits(per.modules()[5].A, other.modules()[5].A));
  // Targets that select nothing here: an error.
  ModelConfig dense = c;
  for (MlpType& t : dense.mlp_layer_types) t = MlpType::Dense;
  EXPECT_THROW(LoraAdapter(dense, options(4, 4, "experts", LoraExperts::PerExpert), 0), Error);
  EXPECT_EQ(lora_max_rank(dense, options(4, 4, "experts", LoraExperts::PerExpert)), 0);
  // A rank is refused (before anything is allocated) only above every selected projection's own full rank.
  int64_t most = 0;
  for (const LoraModule& m : shared.modules()) most = std::max(most, std::min(m.B.dim(0), m.A.dim(1)));
  EXPECT_EQ(lora_max_rank(c, options(4, 8.0, "all", LoraExperts::Shared)), most);
  EXPECT_NO_THROW(LoraAdapter(c, options(most, 8.0, "all", LoraExperts::Shared), 3));
  EXPECT_THROW(LoraAdapter(c, options(most + 1, 8.0, "all", LoraExperts::Shared), 3), Error);
  const auto [out, in] = lora_kind_shape(c, LoraKind::KdaB);
  EXPECT_LT(lora_max_rank(c, options(4, 8.0, "kda.b_proj", LoraExperts::Shared)), most);
  EXPECT_EQ(lora_max_rank(c, options(4, 8.0, "kda.b_proj", LoraExperts::Shared)), std::min(out, in));
}

TEST(Lora, ZeroBGivesTheBaseLogitsExactly) {
  Model model = Model::load(tiny_dir());
  const PackedBatch b = text_batch();
  const Tensor base = model.forward(b);
  for (LoraExperts ex : {LoraExperts::PerExpert, LoraExperts::Shared}) {
    LoraAdapter ad(model.config(), options(4, 16, "all", ex), 1);
    const std::vector<Tensor> w0 = ad.capture(model.weights());
    ad.apply(w0, model.mutable_weights());
    const Tensor same = model.forward(b);
    ASSERT_EQ(same.numel(), base.numel());
    for (int64_t i = 0; i < base.numel(); ++i) ASSERT_EQ(same.data[i], base.data[i]) << i;
    // And a nonzero B does change them (the test above could fail).
    randomise_b(ad, 0.05f, 2);
    ad.apply(w0, model.mutable_weights());
    EXPECT_GT(max_rel_error(model.forward(b).ptr(), base.ptr(), base.numel()), 1e-3);
    ad.apply(w0, model.mutable_weights());
    randomise_b(ad, 0.0f, 2);
    ad.apply(w0, model.mutable_weights());
  }
}

// The adapters' gradients against central differences of the loss along a direction in one module's A or B (one
// module per kind, 23 kinds, A and B): v = (g/‖g‖ + r/‖r‖)/‖…‖ with r random, so a gradient wrong in size or in
// direction shows. The loss is the fp32 model's Σ −log p over 36 tokens (~200 nats). The step h = 3e-3 along the
// unit v balances the 4-point difference's truncation (h = 1e-2 measures up to 1.7e-2: B = 0.05 makes the model
// clearly nonlinear in the adapters) against fp32 rounding of the loss over h (h = 3e-4 measures 1e-2); at 3e-3
// the worst of the 92 directions is 1.1e-3, and the bound is 1e-2.
class LoraGrad : public ::testing::TestWithParam<LoraExperts> {};

TEST_P(LoraGrad, MatchesFiniteDifferences) {
  // Every expert chosen (top-k = E) and sequences shorter than index_topk (dense selection): no routing or
  // indexer choice can flip under a step, so the loss is smooth where the differences are taken.
  const Model tiny = Model::load(tiny_dir());
  ModelConfig c = tiny.config();
  c.num_experts_per_tok = c.n_routed_experts;
  Model model(c, tiny.weights());
  LoraAdapter ad(c, options(4, 4, "all", GetParam()), 5);
  randomise_b(ad, 0.05f, 6);
  const std::vector<Tensor> base = ad.capture(model.weights());
  ad.apply(base, model.mutable_weights());
  const PackedBatch b = text_batch();
  ModelWeights g = zeros_like(model.weights());
  const double loss = model_forward_backward(model, b, g);
  EXPECT_NEAR(loss, loss_of(model, b), 1e-5 * loss);
  ad.backward(g);

  // Per kind, the module whose gradient is largest (an expert that gets tokens).
  std::map<int, size_t> pick;
  for (size_t i = 0; i < ad.modules().size(); ++i) {
    const LoraModule& m = ad.modules()[i];
    auto norm = [](const LoraModule& x) {
      double s = 0;
      for (float v : x.dB.data) s += double(v) * v;
      return s;
    };
    const int k = static_cast<int>(m.kind);
    if (!pick.count(k) || norm(m) > norm(ad.modules()[pick[k]])) pick[k] = i;
  }
  EXPECT_EQ(pick.size(), 23u);
  std::mt19937 rng(9);
  std::normal_distribution<double> nd;
  double worst = 0;
  for (const auto& [k, i] : pick) {
    for (bool is_b : {false, true}) {
      LoraModule& m = ad.modules()[i];
      Tensor& x = is_b ? m.B : m.A;
      const Tensor& gx = is_b ? m.dB : m.dA;
      std::vector<double> r(x.numel());
      double gn = 0, rn = 0;
      for (size_t j = 0; j < r.size(); ++j) r[j] = nd(rng), rn += r[j] * r[j], gn += double(gx.data[j]) * gx.data[j];
      gn = std::sqrt(gn), rn = std::sqrt(rn);
      ASSERT_GT(gn, 0) << lora_kind_info(m.kind).path << (is_b ? " B" : " A");
      std::vector<double> v(r.size());
      double vn = 0;
      for (size_t j = 0; j < r.size(); ++j) v[j] = gx.data[j] / gn + r[j] / rn, vn += v[j] * v[j];
      double analytic = 0;
      for (size_t j = 0; j < r.size(); ++j) v[j] /= std::sqrt(vn), analytic += v[j] * gx.data[j];
      const Tensor x0 = x;
      auto at = [&](double t) {
        for (size_t j = 0; j < r.size(); ++j) x.data[j] = static_cast<float>(x0.data[j] + t * v[j]);
        ad.apply(base, model.mutable_weights());
        return loss_of(model, b);
      };
      const double h = 3e-3;
      const double fd = (8.0 * (at(h) - at(-h)) - (at(2 * h) - at(-2 * h))) / (12.0 * h);
      x = x0;
      const double err = std::fabs(fd - analytic) / std::fabs(fd);
      worst = std::max(worst, err);
      EXPECT_LE(err, 1e-2) << ad.module_path(m, 0, "") << (is_b ? " B" : " A") << ": fd " << fd << " analytic "
                           << analytic;
    }
  }
  ad.apply(base, model.mutable_weights());
  std::cout << "worst relative error of a directional derivative: " << worst << "\n";
}

INSTANTIATE_TEST_SUITE_P(Experts, LoraGrad, ::testing::Values(LoraExperts::PerExpert, LoraExperts::Shared),
                         [](const auto& i) { return i.param == LoraExperts::Shared ? "shared" : "per_expert"; });

// Every 2-D weight name of a checkpoint without ".weight": the modules PEFT could target.
std::vector<std::string> linear_modules(const std::string& dir) {
  const Checkpoint ck(dir);
  std::vector<std::string> out;
  for (const std::string& n : ck.names())
    if (n.size() > 7 && n.compare(n.size() - 7, 7, ".weight") == 0 && ck.find(n)->shape.size() == 2)
      out.push_back(n.substr(0, n.size() - 7));
  return out;
}

TEST(LoraPeft, NamesShapesConfigAndTargetRegex) {
  const Model model = Model::load(tiny_dir());
  const ModelConfig& c = model.config();
  for (LoraExperts ex : {LoraExperts::PerExpert, LoraExperts::Shared}) {
    LoraAdapter ad(c, options(4, 8, "kda.q_proj,kda.o_proj,mla,mlp.down_proj,shared_experts.up_proj,experts", ex, true),
                   2);
    randomise_b(ad, 0.1f, 3);
    TempDir dir;
    ad.save_peft(dir.str(), "some/base", "model.language_model.");
    const SafetensorsFile f(dir.str("adapter_model.safetensors"));
    const std::string p = "base_model.model.model.language_model.layers.";
    auto shape = [&](const std::string& n) {
      const TensorView* t = f.buffer().find(n);
      EXPECT_TRUE(t != nullptr) << n;
      return t ? t->shape : std::vector<int64_t>{};
    };
    EXPECT_EQ(shape(p + "0.self_attn.q_proj.lora_A.weight"), (std::vector<int64_t>{4, 48}));
    EXPECT_EQ(shape(p + "0.self_attn.q_proj.lora_B.weight"), (std::vector<int64_t>{32, 4}));
    EXPECT_EQ(shape(p + "3.self_attn.kv_b_proj.lora_B.weight"), (std::vector<int64_t>{4 * (16 + 24), 4}));
    EXPECT_EQ(shape(p + "3.self_attn.o_proj.lora_A.weight"), (std::vector<int64_t>{4, 4 * 24}));
    EXPECT_EQ(shape(p + "0.mlp.down_proj.lora_A.weight"), (std::vector<int64_t>{4, 80}));
    EXPECT_EQ(shape(p + "1.mlp.shared_experts.up_proj.lora_B.weight"), (std::vector<int64_t>{24, 4}));
    EXPECT_EQ(shape(p + "7.mlp.experts.7.down_proj.lora_A.weight"), (std::vector<int64_t>{2, 24}));  // rank 4/2
    EXPECT_EQ(f.buffer().find(p + "0.self_attn.k_proj.lora_A.weight"), nullptr);
    EXPECT_EQ(f.buffer().tensors().size(), 2u * (6 * 2 + 2 * 5 + 1 + 7 + 7 * 3 * 8));
    // Shared mode: every expert of a layer carries the same A and B.
    const auto a0 = to_f32(*f.buffer().find(p + "2.mlp.experts.0.gate_proj.lora_B.weight"));
    const auto a5 = to_f32(*f.buffer().find(p + "2.mlp.experts.5.gate_proj.lora_B.weight"));
    EXPECT_EQ(a0 == a5, ex == LoraExperts::Shared);

    std::ifstream in(dir.str("adapter_config.json"));
    const json cfg = json::parse(in);
    EXPECT_EQ(cfg.at("peft_type"), "LORA");
    EXPECT_EQ(cfg.at("task_type"), "CAUSAL_LM");
    EXPECT_EQ(cfg.at("r"), 4);
    EXPECT_EQ(cfg.at("lora_alpha"), 8.0);
    EXPECT_EQ(cfg.at("base_model_name_or_path"), "some/base");
    EXPECT_EQ(cfg.at("bias"), "none");
    EXPECT_EQ(cfg.at("rank_pattern").size(), 3u);
    EXPECT_EQ(cfg.at("rank_pattern").at("mlp\\.experts\\.\\d+\\.up_proj"), 2);
    // target_modules full-matches exactly the adapted modules among every linear module of the checkpoint (and
    // not the MLA o_proj, though the KDA one is adapted, nor the router mlp.gate).
    const std::regex re(cfg.at("target_modules").get<std::string>());
    std::set<std::string> adapted;
    for (const TensorView& t : f.buffer().tensors())
      if (t.name.find(".lora_A.") != std::string::npos)
        adapted.insert(t.name.substr(17, t.name.size() - 17 - std::strlen(".lora_A.weight")));
    std::set<std::string> matched;
    for (const std::string& m : linear_modules(tiny_dir()))
      if (std::regex_match(m, re)) matched.insert(m);
    EXPECT_EQ(matched, adapted);
    EXPECT_TRUE(matched.count("model.language_model.layers.3.self_attn.o_proj"));
    EXPECT_FALSE(matched.count("model.language_model.layers.1.mlp.gate"));

    // Read back as a PEFT directory: the same model once applied (a shared adapter comes back as E copies).
    const LoraAdapter back = LoraAdapter::load_peft(dir.str(), c);
    EXPECT_EQ(back.modules().size(), f.buffer().tensors().size() / 2);
    ModelWeights w1 = model.weights(), w2 = model.weights();
    ad.apply(ad.capture(w1), w1);
    back.apply(back.capture(w2), w2);
    const auto t1 = hub_tensors(c, w1), t2 = hub_tensors(c, w2);
    for (size_t i = 0; i < t1.size(); ++i)
      ASSERT_EQ(std::memcmp(t1[i].data, t2[i].data, Tensor::count(t1[i].shape) * 4), 0) << t1[i].name;
    // And load_values gives a fresh adapter of the same options the saved values.
    LoraAdapter fresh(c, options(4, 8, "kda.q_proj,kda.o_proj,mla,mlp.down_proj,shared_experts.up_proj,experts", ex, true),
                      77);
    fresh.load_values(dir.str(), "model.language_model.");
    for (size_t i = 0; i < ad.modules().size(); ++i) {
      ASSERT_TRUE(same_bits(fresh.modules()[i].A, ad.modules()[i].A));
      ASSERT_TRUE(same_bits(fresh.modules()[i].B, ad.modules()[i].B));
    }
  }
}

TEST(LoraPeft, BadAdapterDirectoriesAreNamedErrors) {
  const ModelConfig c = Model::load(tiny_dir()).config();
  TempDir dir;
  EXPECT_THROW(LoraAdapter::load_peft(dir.str("missing"), c), Error);
  EXPECT_THROW(LoraAdapter::load_peft(dir.str(), c), Error);  // no adapter_config.json
  std::ofstream(dir.str("adapter_config.json")) << "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4}";
  const std::vector<float> a(3 * 48, 0.1f), bb(32 * 2, 0.1f);  // A up to rank 3 (the mismatched case below)
  auto write = [&](const std::string& module, std::vector<int64_t> ash) {
    write_safetensors(dir.str("adapter_model.safetensors"),
                      {{"base_model.model." + module + ".lora_A.weight", DType::F32, ash, a.data()},
                       {"base_model.model." + module + ".lora_B.weight", DType::F32, {32, 2}, bb.data()}});
  };
  write("model.language_model.layers.0.self_attn.q_proj", {2, 48});
  const LoraAdapter ok = LoraAdapter::load_peft(dir.str(), c);
  ASSERT_EQ(ok.modules().size(), 1u);
  EXPECT_EQ(ok.modules()[0].scale, 2.0);
  for (const auto& [module, why] : std::vector<std::pair<std::string, std::string>>{
           {"model.language_model.layers.3.self_attn.q_proj", "q_proj of an MLA layer"},
           {"model.language_model.layers.0.mlp.gate", "the router"},
           {"model.language_model.layers.1.mlp.experts.8.up_proj", "expert 8 of 8"},
           {"model.language_model.layers.9.self_attn.q_proj", "layer 9 of 8"},
           {"lm_head", "lm_head"}}) {
    write(module, {2, 48});
    try {
      LoraAdapter::load_peft(dir.str(), c);
      ADD_FAILURE() << "accepted " << why;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(module), std::string::npos) << e.what();
    }
  }
  write("model.language_model.layers.0.self_attn.q_proj", {3, 48});  // rank 3 A with rank 2 B
  EXPECT_THROW(LoraAdapter::load_peft(dir.str(), c), Error);
  write("model.language_model.layers.0.self_attn.k_proj", {2, 48});
  // The in width is checked against the model when applied.
  Model m = Model::load(tiny_dir());
  write("model.language_model.layers.0.self_attn.o_proj", {2, 48});  // o_proj's in is 32
  const LoraAdapter wrong = LoraAdapter::load_peft(dir.str(), c);
  EXPECT_THROW(wrong.capture(m.weights()), Error);
}

TEST(LoraMerge, MergedCheckpointEqualsTheAdapterForward) {
  // bf16_sharded: bf16 weights with fp32 keep-tensors, 3 shards.
  const std::string base = sharded_dir();
  Model model = Model::load(base);
  const ModelConfig& c = model.config();
  LoraAdapter ad(c, options(4, 8, "all", LoraExperts::PerExpert), 1);
  randomise_b(ad, 0.05f, 2);
  TempDir dir;
  fs::create_directories(dir.str("adapter"));
  ad.save_peft(dir.str("adapter"), base, "model.language_model.");
  const Model adapted = load_model_with_adapter(base, dir.str("adapter"));
  int64_t covered = 0;
  for (const LoraModule& m : ad.modules()) covered += lora_kind_is_expert(m.kind) && m.expert < 0 ? c.n_routed_experts : 1;

  // f32 output: the very weights the adapter forward uses, so the same logits bit for bit.
  EXPECT_EQ(merge_adapter_checkpoint(base, dir.str("adapter"), dir.str("m32"), true), covered);
  const Model m32 = Model::load(dir.str("m32"));
  const auto ta = hub_tensors(c, adapted.weights()), tm = hub_tensors(c, m32.weights());
  ASSERT_EQ(ta.size(), tm.size());
  for (size_t i = 0; i < ta.size(); ++i)
    ASSERT_EQ(std::memcmp(ta[i].data, tm[i].data, Tensor::count(ta[i].shape) * 4), 0) << ta[i].name;
  const PackedBatch b = text_batch();
  const Tensor la = adapted.forward(b), lm = m32.forward(b);
  for (int64_t i = 0; i < la.numel(); ++i) ASSERT_EQ(la.data[i], lm.data[i]);

  // The base's dtypes: the same shards, names, order and dtypes; untouched tensors byte for byte; merged bf16
  // weights the round-to-nearest-even of the adapter's fp32 ones.
  EXPECT_EQ(merge_adapter_checkpoint(base, dir.str("adapter"), dir.str("m"), false), covered);
  const std::string prefix = "model.language_model.";
  std::map<std::string, const float*> adapted_by_name;
  for (const TensorToWrite& t : ta) adapted_by_name[t.name] = static_cast<const float*>(t.data);
  std::set<std::string> targets;
  for (const LoraModule& m : ad.modules())
    for (int64_t e : lora_kind_is_expert(m.kind) && m.expert < 0 ? std::vector<int64_t>{0} : std::vector<int64_t>{m.expert})
      targets.insert(ad.module_path(m, e, prefix) + ".weight");
  int64_t merged_bf16 = 0;
  for (const auto& e : fs::directory_iterator(base)) {
    const std::string name = e.path().filename().string();
    ASSERT_TRUE(fs::exists(dir.str("m/" + name))) << name;
    if (e.path().extension() != ".safetensors" || name == "golden.safetensors" || name == "golden_grads.safetensors") {
      if (e.path().extension() == ".json" && name != "model.safetensors.index.json") {
        std::ifstream x(e.path()), y(dir.str("m/" + name));
        EXPECT_EQ(std::string(std::istreambuf_iterator<char>(x), {}), std::string(std::istreambuf_iterator<char>(y), {}))
            << name;
      }
      continue;
    }
    const SafetensorsFile fb(e.path().string()), fm(dir.str("m/" + name));
    ASSERT_EQ(fb.buffer().tensors().size(), fm.buffer().tensors().size());
    for (size_t i = 0; i < fb.buffer().tensors().size(); ++i) {
      const TensorView &tb = fb.buffer().tensors()[i], &tmv = fm.buffer().tensors()[i];
      ASSERT_EQ(tb.name, tmv.name);
      ASSERT_EQ(tb.dtype, tmv.dtype) << tb.name;
      ASSERT_EQ(tb.shape, tmv.shape) << tb.name;
      if (targets.count(tb.name)) {
        ASSERT_EQ(tb.dtype, DType::BF16);
        const float* want = adapted_by_name.at(tb.name);
        const uint16_t* got = reinterpret_cast<const uint16_t*>(tmv.data);
        for (int64_t j = 0; j < tb.numel(); ++j) ASSERT_EQ(got[j], f32_to_bf16(want[j])) << tb.name << " " << j;
        EXPECT_NE(std::memcmp(tb.data, tmv.data, tb.nbytes), 0) << tb.name << " unchanged";
        ++merged_bf16;
      } else {
        ASSERT_EQ(std::memcmp(tb.data, tmv.data, tb.nbytes), 0) << tb.name;
      }
    }
  }
  EXPECT_EQ(merged_bf16, covered);
  // How much the bf16 rounding of the merged weights moves the scores (what check_lora_merge.py's bf16 bound is for).
  const Model mb = Model::load(dir.str("m"));
  const auto lpa = adapted.next_token_logprobs(b), lpb = mb.next_token_logprobs(b);
  double worst = 0;
  for (size_t s = 0; s < lpa.size(); ++s)
    for (size_t t = 0; t < lpa[s].size(); ++t) worst = std::max(worst, std::fabs(lpa[s][t] - lpb[s][t]));
  std::cout << "max |Δlogprob| from the bf16 rounding of the merged weights: " << worst << "\n";

  // Errors: an existing --out is left alone; an adapter for another model is refused and leaves nothing.
  EXPECT_THROW(merge_adapter_checkpoint(base, dir.str("adapter"), dir.str("m"), false), Error);
  fs::create_directories(dir.str("tiny_adapter"));
  LoraAdapter tiny(Model::load(tiny_dir()).config(), options(2, 2, "kda.q_proj", LoraExperts::PerExpert), 0);
  tiny.save_peft(dir.str("tiny_adapter"), tiny_dir(), "model.language_model.");
  try {
    merge_adapter_checkpoint(base, dir.str("tiny_adapter"), dir.str("bad"), false);
    ADD_FAILURE() << "merged an adapter of another model";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("q_proj"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(dir.str("bad")));
  for (const auto& e : fs::directory_iterator(dir.str()))
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
}

std::vector<TrainExample> text_examples() {
  const std::string text =
      "The quick brown fox jumps over the lazy dog. A stitch in time saves nine. Where there is a will there is a "
      "way. All that glitters is not gold.";
  std::vector<TrainExample> out;
  for (size_t b = 0; b + 2 < text.size(); b += 24) {
    TrainExample ex;
    for (size_t i = b; i < std::min(text.size(), b + 24); ++i) ex.tokens.push_back(static_cast<unsigned char>(text[i]));
    out.push_back(ex);
  }
  return out;
}

// The LoRA trainers' options of these tests: rank 4 on every projection of the tiny model, 8 steps of two 64-token
// micro-batches.
TrainOptions lora_train_options(LoraExperts ex) {
  TrainOptions opt;
  opt.steps = 8;
  opt.warmup = 1;
  opt.batch_tokens = 64;
  opt.grad_accum = 2;
  opt.adamw.lr = 2e-2;
  opt.seed = 4;
  opt.lora = options(4, 8, "all", ex, ex == LoraExperts::Shared);
  opt.base_model = tiny_dir();
  return opt;
}

TEST(LoraTrain, StepsLowerTheLossKeepTheBaseAndResumeBitForBit) {
  for (LoraExperts ex : {LoraExperts::PerExpert, LoraExperts::Shared}) {
    const TrainOptions opt = lora_train_options(ex);
    const Model base = Model::load(tiny_dir());
    Trainer a(Model::load(tiny_dir()), text_examples(), opt);
    ASSERT_NE(a.lora(), nullptr);
    EXPECT_EQ(a.num_trainable(), a.lora()->num_parameters());
    std::vector<double> losses;
    for (int i = 0; i < 3; ++i) losses.push_back(a.step().loss);
    TempDir dir;
    a.save(dir.str("ckpt"));
    for (const char* f : {"adapter_model.safetensors", "adapter_config.json", "optimizer.safetensors", "trainer_state.json"})
      EXPECT_TRUE(fs::exists(dir.str(std::string("ckpt/") + f))) << f;
    EXPECT_FALSE(fs::exists(dir.str("ckpt/model.safetensors")));
    const StepStats next = a.step();
    Trainer b = Trainer::resume(dir.str("ckpt"), text_examples(), Trainer::stored_options(dir.str("ckpt")));
    EXPECT_EQ(b.steps_done(), 3);
    ASSERT_TRUE(b.options().lora.has_value());
    EXPECT_EQ(b.options().lora->experts, ex);
    const StepStats again = b.step();
    EXPECT_EQ(again.loss, next.loss);
    EXPECT_EQ(again.grad_norm, next.grad_norm);
    for (size_t i = 0; i < a.lora()->modules().size(); ++i) {
      ASSERT_TRUE(same_bits(a.lora()->modules()[i].A, b.lora()->modules()[i].A));
      ASSERT_TRUE(same_bits(a.lora()->modules()[i].B, b.lora()->modules()[i].B));
    }
    // Only the adapters moved: untargeted tensors are the base's, targeted ones base + s·B·A.
    const ModelWeights& w = a.model().weights();
    EXPECT_TRUE(same_bits(w.embed, base.weights().embed));
    EXPECT_TRUE(same_bits(w.layers[2].hc_attn.fn, base.weights().layers[2].hc_attn.fn));
    EXPECT_TRUE(same_bits(w.layers[2].moe->router, base.weights().layers[2].moe->router));
    EXPECT_FALSE(same_bits(w.layers[2].kda->q_proj, base.weights().layers[2].kda->q_proj));
    for (int i = 0; i < 3; ++i) losses.push_back(a.step().loss);
    EXPECT_LT(losses.back(), losses.front() - 0.1) << "LoRA training did not lower the loss";
  }
}

// ---- LoRA with the base on disk (LoraBase::Disk) ---------------------------------------------------------------

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

void expect_same_adapters(const LoraAdapter& a, const LoraAdapter& b) {
  ASSERT_EQ(a.modules().size(), b.modules().size());
  for (size_t i = 0; i < a.modules().size(); ++i) {
    const LoraModule &x = a.modules()[i], &y = b.modules()[i];
    const std::string where = a.module_path(x, 0, "");
    EXPECT_EQ(x.kind, y.kind) << where;
    EXPECT_EQ(x.layer, y.layer) << where;
    EXPECT_EQ(x.expert, y.expert) << where;
    EXPECT_EQ(x.rank, y.rank) << where;
    EXPECT_EQ(x.scale, y.scale) << where;
    EXPECT_TRUE(same_bits(x.A, y.A)) << where;
    EXPECT_TRUE(same_bits(x.B, y.B)) << where;
  }
}

bool same_file(const std::string& a, const std::string& b) {
  std::ifstream fa(a, std::ios::binary), fb(b, std::ios::binary);
  const std::string sa((std::istreambuf_iterator<char>(fa)), {}), sb((std::istreambuf_iterator<char>(fb)), {});
  return !sa.empty() && sa == sb;
}

// The adapters' gradients as `train --device cuda` computes them for a trainer whose base is on disk, done on the
// CPU: a base of its own (the trainer holds none), merged with the adapter's current A and B whenever the version
// changes, the merged model's full weight gradient summed over the step's micro-batches, and dA, dB recomputed from
// that sum at each call. The arithmetic is the host-base trainer's default path, so both give the same bits.
struct CpuGradients {
  Model merged = Model::load(tiny_dir());
  std::vector<Tensor> base;
  ModelWeights dW;
  int64_t version = -1;
  RecomputePolicy recompute;

  // Adds the batch's gradient into dW and sets ad's dA, dB to the adapter gradient of the step so far (ad's A and B
  // merged in).
  double run(LoraAdapter& ad, int64_t v, const PackedBatch& b) {
    if (base.empty()) base = ad.capture(merged.weights());
    if (v != version) {
      ad.apply(base, merged.mutable_weights());
      dW = zeros_like(merged.weights());
      version = v;
    }
    const double loss = model_forward_backward(merged, b, dW, recompute);
    for (LoraModule& m : ad.modules()) {
      std::fill(m.dA.data.begin(), m.dA.data.end(), 0.0f);
      std::fill(m.dB.data.begin(), m.dB.data.end(), 0.0f);
    }
    ad.backward(dW);
    return loss;
  }
  Trainer::GradientFn fn() {
    return [this](const Model& m, LoraAdapter* lora, int64_t v, const PackedBatch& b, ModelWeights& grads) {
      EXPECT_TRUE(m.weights().layers.empty() && m.weights().embed.data.empty()) << "the trainer holds base weights";
      EXPECT_TRUE(grads.layers.empty() && grads.embed.data.empty()) << "the trainer holds full-model gradients";
      return run(*lora, v, b);
    };
  }
};

// The device optimizer of `train --device cuda --lora-rank`, emulated on the host with the host's arithmetic: its
// own copy of the adapter (values, gradients) and AdamW state, taken from the trainer when the first gradient is
// asked for (as CudaModel::start_lora_optimizer), updated by `update` and copied back by `fetch`.
struct HostDevice {
  CpuGradients grads;
  std::optional<LoraAdapter> dev;
  std::vector<ParamRef> params;
  std::optional<AdamW> adam;
  const Trainer* trainer = nullptr;

  void attach(Trainer& t) {
    trainer = &t;
    t.set_gradient_fn([this](const Model&, LoraAdapter* lora, int64_t v, const PackedBatch& b, ModelWeights&) {
      if (!dev) {
        dev.emplace(*lora);
        params = dev->params("model.language_model.");
        adam.emplace(params, trainer->options().adamw);
        if (!trainer->optimizer().m().empty()) {
          adam->m() = trainer->optimizer().m();
          adam->v() = trainer->optimizer().v();
        }
      }
      return grads.run(*dev, v, b);
    });
    t.set_device_optimizer(Trainer::DeviceOptimizer{
        [this](double lr, int64_t step, double scale, double max_norm) {
          const float s = static_cast<float>(scale);
          for (ParamRef& p : params)
            for (int64_t i = 0; i < p.n; ++i) p.g[i] *= s;
          const double norm = clip_grad_norm(params, max_norm);
          adam->set_steps(step - 1);
          adam->step(params, lr);
          return norm;
        },
        [this](LoraAdapter& adapter, AdamW& state) {
          if (!dev) return;
          for (size_t i = 0; i < adapter.modules().size(); ++i) {
            LoraModule& m = adapter.modules()[i];
            std::copy(dev->modules()[i].A.data.begin(), dev->modules()[i].A.data.end(), m.A.data.begin());
            std::copy(dev->modules()[i].B.data.begin(), dev->modules()[i].B.data.end(), m.B.data.begin());
          }
          state.m() = adam->m();
          state.v() = adam->v();
        }});
  }
};

// The base-on-disk trainer makes the host trainer's adapters bit for bit from the config and the checkpoint's
// headers, holds no model, and names what does not fit.
TEST(LoraTrain, BaseOnDiskMakesTheSameAdaptersFromShapesOnly) {
  for (LoraExperts ex : {LoraExperts::PerExpert, LoraExperts::Shared}) {
    const TrainOptions opt = lora_train_options(ex);
    Trainer host(Model::load(tiny_dir()), text_examples(), opt);
    Trainer disk = Trainer::with_base_on_disk(text_examples(), opt);
    EXPECT_EQ(host.lora_base(), LoraBase::Host);
    EXPECT_EQ(disk.lora_base(), LoraBase::Disk);
    ASSERT_NE(disk.lora(), nullptr);
    expect_same_adapters(*host.lora(), *disk.lora());
    EXPECT_EQ(disk.num_trainable(), host.num_trainable());
    EXPECT_EQ(disk.optimizer().m().size(), host.optimizer().m().size());
    EXPECT_NE(error_of([&] { disk.model(); }).find("holds no model"), std::string::npos);
    EXPECT_NE(error_of([&] { disk.step(); }).find("set_gradient_fn"), std::string::npos);
    EXPECT_EQ(disk.steps_done(), 0);
    // Another seed, other adapters: the comparison above can fail.
    TrainOptions other = opt;
    other.seed = 5;
    EXPECT_FALSE(same_bits(Trainer::with_base_on_disk(text_examples(), other).lora()->modules()[0].A,
                           disk.lora()->modules()[0].A));
  }
  const TensorShapes shapes = read_tensor_shapes(tiny_dir());
  const std::string p = "model.language_model.";
  EXPECT_EQ(shapes.at(p + "layers.0.self_attn.q_proj.weight"), (std::vector<int64_t>{32, 48}));
  EXPECT_EQ(shapes.at(p + "layers.2.mlp.experts.5.up_proj.weight"), (std::vector<int64_t>{24, 48}));
  const TrainOptions opt = lora_train_options(LoraExperts::Shared);
  const ModelConfig c = load_config(tiny_dir() + "/config.json");
  auto make = [&](const ModelConfig& cfg, const TensorShapes& s, const TrainOptions& o) {
    return error_of([&] { const Trainer t(cfg, s, text_examples(), o); });
  };
  EXPECT_EQ(make(c, shapes, opt), "(no error)");
  TensorShapes missing = shapes;
  missing.erase(p + "layers.3.self_attn.kv_b_proj.weight");
  EXPECT_NE(make(c, missing, opt).find("layers.3.self_attn.kv_b_proj"), std::string::npos) << make(c, missing, opt);
  TensorShapes bad = shapes;
  bad[p + "layers.2.mlp.experts.5.up_proj.weight"] = {25, 48};  // a shared module checks every expert it covers
  EXPECT_NE(make(c, bad, opt).find("experts.5.up_proj"), std::string::npos) << make(c, bad, opt);
  ModelConfig other = c;
  other.vocab_size = 300;
  EXPECT_NE(make(other, shapes, opt).find("embed_tokens"), std::string::npos) << make(other, shapes, opt);
  TrainOptions plain = opt;
  plain.lora.reset();
  EXPECT_NE(make(c, shapes, plain).find("LoRA"), std::string::npos);
  // A text-only checkpoint (model.*) works as Model::load reads it.
  TensorShapes text_only;
  for (const auto& [name, shape] : shapes)
    text_only[name.rfind(p, 0) == 0 ? "model." + name.substr(p.size()) : name] = shape;
  EXPECT_EQ(make(c, text_only, opt), "(no error)");
}

// Stepping with the base on disk (the adapters' gradients from a gradient function, with the host optimizer or a
// device one) gives the host-base trainer's losses, adapters and checkpoint files bit for bit; the checkpoint of
// either resumes in either, with the next step the same.
TEST(LoraTrain, BaseOnDiskStepsSavesAndResumesAsTheHostBase) {
  const std::vector<std::string> files = {"adapter_model.safetensors", "adapter_config.json", "optimizer.safetensors",
                                          "trainer_state.json"};
  for (const bool device : {false, true}) {
    SCOPED_TRACE(device ? "device optimizer" : "host optimizer");
    const TrainOptions opt = lora_train_options(LoraExperts::PerExpert);
    Trainer host(Model::load(tiny_dir()), text_examples(), opt);
    Trainer disk = Trainer::with_base_on_disk(text_examples(), opt);
    CpuGradients cpu;
    HostDevice emu;
    if (device) {
      emu.attach(disk);
    } else {
      disk.set_gradient_fn(cpu.fn());
    }
    for (int i = 0; i < 3; ++i) {
      const StepStats h = host.step(), d = disk.step();
      EXPECT_EQ(d.loss, h.loss) << "step " << i + 1;
      EXPECT_EQ(d.grad_norm, h.grad_norm) << "step " << i + 1;
      EXPECT_EQ(d.lr, h.lr);
    }
    TempDir dir;
    host.save(dir.str("host"));
    disk.save(dir.str("disk"));
    expect_same_adapters(*host.lora(), *disk.lora());
    for (const std::string& f : files)
      EXPECT_TRUE(same_file(dir.str("host/" + f), dir.str("disk/" + f))) << f << " differs between the two bases";
    EXPECT_FALSE(fs::exists(dir.str("disk/model.safetensors")));
    const StepStats next = host.step();
    // The disk checkpoint resumes with either base, and the host one with the base on disk.
    for (const auto& [from, base] : {std::pair{"disk", LoraBase::Disk}, std::pair{"disk", LoraBase::Host},
                                     std::pair{"host", LoraBase::Disk}}) {
      SCOPED_TRACE(std::string(from) + (base == LoraBase::Disk ? " -> disk" : " -> host"));
      const std::string ck = dir.str(from);
      Trainer r = Trainer::resume(ck, text_examples(), Trainer::stored_options(ck), base);
      EXPECT_EQ(r.lora_base(), base);
      EXPECT_EQ(r.steps_done(), 3);
      CpuGradients g;
      HostDevice e;
      if (base == LoraBase::Disk) {
        EXPECT_NE(error_of([&] { r.model(); }).find("holds no model"), std::string::npos);
        if (device) {
          e.attach(r);
        } else {
          r.set_gradient_fn(g.fn());
        }
      }
      const StepStats again = r.step();
      EXPECT_EQ(again.loss, next.loss);
      EXPECT_EQ(again.grad_norm, next.grad_norm);
      r.save(dir.str("again"));
      host.save(dir.str("host4"));
      for (const std::string& f : files)
        EXPECT_TRUE(same_file(dir.str("host4/" + f), dir.str("again/" + f))) << f << " differs after the resume";
    }
  }
}

// The real GLM-5.3-Flash (the config's defaults: 313B parameters, 1.25 TB in fp32) gets its adapters, saves them
// and is ready to train with the base on disk while the process may map only 1 GiB more than it has: a trainer that
// allocated a base weight (the embedding alone is 2.5 GB) would fail with bad_alloc here instead of filling the
// machine. The adapters (rank 2, no routed experts) with their gradients and moments take about 80 MB.
TEST(LoraTrain, BaseOnDiskHoldsNoWeightOfTheRealModel) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "the address-space limit does not combine with AddressSanitizer's shadow memory";
#else
  const ModelConfig c = parse_config(json{{"model_type", "glm5_next_text"}});
  EXPECT_GT(parameter_count(c), int64_t{300'000'000'000});
  EXPECT_EQ(c.hidden_size, 4096);
  TrainOptions opt;
  opt.lora = options(2, 4, "kda,mla,mlp,shared_experts", LoraExperts::PerExpert);
  opt.base_model = "/models/GLM-5.3-Flash";
  opt.seed = 3;
  // The checkpoint's shapes: the embedding's and each adapted projection's (the hub names of the real model).
  TensorShapes shapes;
  shapes["model.language_model.embed_tokens.weight"] = {c.vocab_size, c.hidden_size};
  {
    const LoraAdapter ad(c, *opt.lora, opt.seed);
    for (const LoraModule& m : ad.modules())
      shapes[ad.module_path(m, 0, "model.language_model.") + ".weight"] = {m.B.dim(0), m.A.dim(1)};
  }
  std::vector<TrainExample> data(1);
  data[0].tokens = {1, 2, 3, 4};
  std::ifstream statm("/proc/self/statm");
  size_t pages = 0;
  statm >> pages;
  ASSERT_GT(pages, 0u);
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_AS, &old), 0);
  rlimit lim = old;
  lim.rlim_cur = pages * static_cast<size_t>(sysconf(_SC_PAGESIZE)) + (size_t{1} << 30);
  if (old.rlim_cur != RLIM_INFINITY) lim.rlim_cur = std::min<rlim_t>(lim.rlim_cur, old.rlim_cur);
  ASSERT_EQ(setrlimit(RLIMIT_AS, &lim), 0);
  std::string error;
  std::optional<Trainer> tr;
  try {
    tr.emplace(c, shapes, data, opt);
  } catch (const std::exception& e) {
    error = e.what();
  }
  setrlimit(RLIMIT_AS, &old);
  ASSERT_TRUE(tr.has_value()) << error;
  EXPECT_EQ(tr->lora_base(), LoraBase::Disk);
  EXPECT_GT(tr->num_trainable(), 0);
  EXPECT_LT(tr->num_trainable(), int64_t{100'000'000});
  std::printf("[lora base on disk] a %lld-parameter base, %lld adapter parameters held\n",
              static_cast<long long>(parameter_count(c)), static_cast<long long>(tr->num_trainable()));
  EXPECT_NE(error_of([&] { tr->model(); }).find("holds no model"), std::string::npos);
  TempDir dir;
  tr->save(dir.str("ckpt"));
  const SafetensorsFile f(dir.str("ckpt/adapter_model.safetensors"));
  const TensorView* a =
      f.buffer().find("base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 4096}));
#endif
}

// ---- CLI --------------------------------------------------------------------------------------------------------

std::string write_data(const TempDir& dir) {
  const std::string path = dir.str("data.jsonl");
  write_byte_jsonl(path, {"the cat sat on the mat.", "the dog sat on the log.", "a cat and a dog."});
  return path;
}

std::vector<double> logprobs_of(const std::string& jsonl) {
  std::vector<double> out;
  std::istringstream in(jsonl);
  std::string line;
  while (std::getline(in, line)) {
    const json j = json::parse(line);  // kept alive: a range-for over a temporary's member would dangle
    for (double x : j.at("logprobs")) out.push_back(x);
  }
  return out;
}

TEST(LoraCli, TrainScoreMergeAndResume) {
  TempDir dir;
  const std::string data = write_data(dir), out = dir.str("run"), q = shell_quote(tiny_dir());
  const CliResult r = run_nextlm("train --model " + q + " --data " + shell_quote(data) + " --out " + shell_quote(out) +
                                 " --lora-rank 4 --lora-alpha 8 --lora-experts shared --lora-rank-div-topk"
                                 " --steps 3 --lr 2e-2 --warmup 1 --batch-tokens 64 --threads 1");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("LoRA:"), std::string::npos) << r.err;
  // The base's size comes from its config (parameter_count), which is what the loaded model counts.
  EXPECT_NE(r.err.find("(" + std::to_string(Model::load(tiny_dir()).num_parameters()) + " parameters)"),
            std::string::npos)
      << r.err;
  const std::string ck = out + "/checkpoint";
  for (const char* f : {"adapter_model.safetensors", "adapter_config.json", "trainer_state.json"})
    EXPECT_TRUE(fs::exists(ck + "/" + f)) << f;
  const CliResult plain = run_nextlm("score --threads 1 --model " + q + " --input " + shell_quote(data));
  const CliResult with =
      run_nextlm("score --threads 1 --model " + q + " --adapter " + shell_quote(ck) + " --input " + shell_quote(data));
  ASSERT_EQ(plain.rc, 0) << plain.err;
  ASSERT_EQ(with.rc, 0) << with.err;
  EXPECT_NE(plain.out, with.out);
  // merge --dtype f32 scores exactly as --adapter; the bf16 merge within rounding.
  ASSERT_EQ(run_nextlm("merge --model " + q + " --adapter " + shell_quote(ck) + " --out " + shell_quote(dir.str("m32")) +
                       " --dtype f32").rc,
            0);
  const CliResult s32 = run_nextlm("score --threads 1 --model " + shell_quote(dir.str("m32")) + " --input " + shell_quote(data));
  EXPECT_EQ(s32.out, with.out);
  // generate and serve decode with the adapter merged as score merges it: the f32 merge's tokens and log-probs.
  const std::string gen = "generate --threads 1 --prompt-tokens 84,104,101,32,99 --max-new-tokens 8 --temperature 0 "
                          "--ignore-eos --format json --model ";
  const CliResult g_with = run_nextlm(gen + q + " --adapter " + shell_quote(ck));
  const CliResult g_m32 = run_nextlm(gen + shell_quote(dir.str("m32")));
  const CliResult g_plain = run_nextlm(gen + q);
  ASSERT_EQ(g_with.rc, 0) << g_with.err;
  ASSERT_EQ(g_m32.rc, 0) << g_m32.err;
  ASSERT_EQ(g_plain.rc, 0) << g_plain.err;
  EXPECT_EQ(g_with.out, g_m32.out);
  // The adapter changes the greedy tokens here, so that the server's tokens below tell whether it applied it.
  EXPECT_NE(json::parse(g_with.out).at("tokens"), json::parse(g_plain.out).at("tokens"));
  {
    ServeProcess server(NEXTLM_BINARY, {"--model", tiny_dir(), "--threads", "1", "--adapter", ck});
    httplib::Client client("127.0.0.1", server.port());
    client.set_read_timeout(30);
    const json req = {{"prompt", {84, 104, 101, 32, 99}}, {"max_tokens", 8}, {"temperature", 0}, {"ignore_eos", true}};
    const auto res = client.Post("/v1/completions", req.dump(), "application/json");
    ASSERT_TRUE(res) << httplib::to_string(res.error());
    ASSERT_EQ(res->status, 200) << res->body;
    EXPECT_EQ(json::parse(res->body)["choices"][0]["tokens"], json::parse(g_with.out).at("tokens")) << res->body;
  }
  const CliResult mg = run_nextlm("merge --model " + q + " --adapter " + shell_quote(ck) + " --out " + shell_quote(dir.str("m")));
  ASSERT_EQ(mg.rc, 0) << mg.err;
  const CliResult sb = run_nextlm("score --threads 1 --model " + shell_quote(dir.str("m")) + " --input " + shell_quote(data));
  ASSERT_EQ(sb.rc, 0) << sb.err;
  const auto la = logprobs_of(with.out), lb = logprobs_of(sb.out);
  ASSERT_EQ(la.size(), lb.size());
  std::vector<double> diff(la.size());
  for (size_t i = 0; i < la.size(); ++i) diff[i] = std::fabs(la[i] - lb[i]);
  std::sort(diff.begin(), diff.end());
  const double median = diff[diff.size() / 2], worst = diff.back();
  // Rounding W + s·B·A to bf16 moves each weight by up to 2^-9 relative; through the tiny model that is ~1e-2 in a
  // log-prob, except where it flips an MoE routing or indexer choice, which moves that token by O(1) (here up to 1.4
  // on a few tokens). So the bound is on the median; that each merged weight is the bf16 rounding of the fp32 merge
  // is checked exactly above, and transformers' agreement by tests/golden/check_lora_merge.py.
  EXPECT_LT(median, 0.02) << "bf16 rounding of the merged weights moved the median log-prob by " << median
                          << " (max " << worst << ")";
  // Resume continues the adapter run from its stored options and base.
  const CliResult res = run_nextlm("train --resume " + shell_quote(out) + " --out " + shell_quote(out) + " --data " +
                                   shell_quote(data) + " --steps 4 --threads 1");
  ASSERT_EQ(res.rc, 0) << res.err;
  EXPECT_NE(res.err.find("step 4/4"), std::string::npos) << res.err;
}

TEST(LoraCli, BadValuesGiveOneLineErrors) {
  TempDir dir;
  const std::string data = write_data(dir), out = dir.str("run"), q = shell_quote(tiny_dir());
  const std::string cfg = shell_quote(std::string(NEXTLM_SOURCE_DIR) + "/examples/fortunes/config.json");
  const std::string base = "train --data " + shell_quote(data) + " --out " + shell_quote(out) + " --steps 1 ";
  struct Case {
    std::string args;
    int rc;
    std::string mention;
  };
  const std::vector<Case> cases = {
      {base + "--model " + q + " --lora-rank 0", 2, "--lora-rank"},
      {base + "--model " + q + " --lora-rank -3", 2, "--lora-rank"},
      {base + "--model " + q + " --lora-rank 100000", 2, "full rank"},
      {base + "--config " + cfg + " --lora-rank 4", 2, "--model"},
      {base + "--model " + q + " --lora-rank 4 --lora-alpha 0", 2, "--lora-alpha"},
      {base + "--model " + q + " --lora-rank 4 --lora-targets kda,bogus", 2, "bogus"},
      {base + "--model " + q + " --lora-rank 4 --lora-experts some", 2, "--lora-experts"},
      {base + "--model " + q + " --lora-alpha 4", 2, "--lora-rank"},
      {base + "--resume " + shell_quote(dir.str("nothing")) + " --lora-rank 4", 2, "--resume"},
      {"merge --model " + q + " --adapter " + shell_quote(dir.str("none")) + " --out " + shell_quote(out), 1, "none"},
      {"merge --model " + q + " --adapter " + shell_quote(dir.str()) + " --out " + shell_quote(out) + " --dtype bf16", 2,
       "--dtype"},
      {"merge --model " + q + " --out " + shell_quote(out), 2, "--adapter"},
      {"score --model " + q + " --adapter " + shell_quote(dir.str("none")) + " --input " + shell_quote(data), 1, "none"},
      {"generate --model " + q + " --adapter " + shell_quote(dir.str("none")) + " --prompt-tokens 1 --max-new-tokens 1",
       1, "none"},
      {"serve --port 0 --model " + q + " --adapter " + shell_quote(dir.str("none")), 1, "none"},
  };
  for (const Case& c : cases) {
    const CliResult r = run_nextlm(c.args);
    EXPECT_EQ(r.rc, c.rc) << c.args << "\n" << r.err;
    EXPECT_EQ(r.err.rfind("error:", 0), 0u) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(r.err.find(c.mention), std::string::npos) << c.args << "\n" << r.err;
    EXPECT_FALSE(fs::exists(out)) << c.args;
  }
  // merge never overwrites: an existing --out stays as it is.
  fs::create_directories(out);
  std::ofstream(out + "/keep") << "x";
  const CliResult r = run_nextlm("merge --model " + q + " --adapter " + shell_quote(dir.str()) + " --out " + shell_quote(out));
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("already exists"), std::string::npos) << r.err;
  EXPECT_TRUE(fs::exists(out + "/keep"));
}

}  // namespace
}  // namespace nextlm::test
