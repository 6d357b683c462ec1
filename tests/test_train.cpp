// Training pieces on the CPU: random init (distributions of transformers' _init_weights, determinism), saving in hub
// layout and reading back bit for bit, the parameter count from a config, the loss mask, data loading, and checkpoint
// resume reproducing the next step exactly.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <optional>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/init.h"
#include "model/model.h"
#include "model/train.h"
#include "model/trainer.h"
#include "test_util.h"

namespace nextlm::test {
namespace {

ModelConfig fortunes_config() {
  return load_config(std::string(NEXTLM_SOURCE_DIR) + "/examples/fortunes/config.json");
}

// Byte sequences of English text, cut in pieces of varied length.
std::vector<TrainExample> text_examples() {
  const std::string text =
      "The quick brown fox jumps over the lazy dog. A stitch in time saves nine. Where there is a will there is a "
      "way. All that glitters is not gold. Fortune favours the bold.";
  std::vector<TrainExample> out;
  for (size_t b = 0, len = 20; b + 2 < text.size(); b += len, len = 20 + (len * 7) % 23) {
    TrainExample ex;
    for (size_t i = b; i < std::min(text.size(), b + len); ++i) ex.tokens.push_back(static_cast<unsigned char>(text[i]));
    out.push_back(ex);
  }
  return out;
}

bool same_weights(const ModelConfig& c, const ModelWeights& a, const ModelWeights& b) {
  const auto ta = hub_tensors(c, a), tb = hub_tensors(c, b);
  if (ta.size() != tb.size()) return false;
  for (size_t i = 0; i < ta.size(); ++i) {
    if (ta[i].name != tb[i].name || ta[i].shape != tb[i].shape) return false;
    if (std::memcmp(ta[i].data, tb[i].data, Tensor::count(ta[i].shape) * sizeof(float)) != 0) return false;
  }
  return true;
}

// Gradients hold only the trainable tensors (hub_gradients' list); bitwise equality.
bool same_grads(const ModelConfig& c, const ModelWeights& a, const ModelWeights& b) {
  const auto ta = hub_gradients(c, a, ""), tb = hub_gradients(c, b, "");
  if (ta.size() != tb.size()) return false;
  for (size_t i = 0; i < ta.size(); ++i)
    if (std::memcmp(ta[i].data, tb[i].data, Tensor::count(ta[i].shape) * sizeof(float)) != 0) return false;
  return true;
}

TEST(Init, DistributionsFollowTransformersInitWeights) {
  ModelConfig c = fortunes_config();
  const ModelWeights w = init_weights(c, 7);
  auto stats = [](const Tensor& t, double& mean, double& sd) {
    double s = 0, s2 = 0;
    for (float x : t.data) s += x, s2 += double(x) * x;
    mean = s / t.numel();
    sd = std::sqrt(s2 / t.numel() - mean * mean);
  };
  double mean, sd;
  stats(w.embed, mean, sd);  // 256·64 samples of normal(0, 0.02): sd within a few %
  EXPECT_NEAR(sd, 0.02, 0.001);
  EXPECT_NEAR(mean, 0.0, 0.001);
  stats(w.layers[1].hc_attn.fn, mean, sd);
  EXPECT_NEAR(sd, 0.02, 0.002);
  for (float x : w.final_norm.data) EXPECT_EQ(x, 1.0f);
  const LayerWeights& l0 = w.layers[0];
  for (float x : l0.hc_ffn.base.data) EXPECT_EQ(x, 0.0f);
  for (float x : l0.hc_ffn.scale.data) EXPECT_EQ(x, 1.0f);
  const KdaWeights& k = *l0.kda;
  for (float x : k.A_log.data) EXPECT_EQ(x, 0.0f);  // safe gate
  for (float x : k.o_norm.data) EXPECT_EQ(x, 1.0f);
  for (float x : k.dt_bias.data) {  // softplus(dt_bias) = dt ∈ [1e-3, 1e-1]
    const double dt = std::log1p(std::exp(double(x)));
    EXPECT_GE(dt, 1e-3 * (1 - 1e-5));
    EXPECT_LE(dt, 1e-1 * (1 + 1e-5));
  }
  const float bound = 1.0f / std::sqrt(float(c.linear_conv_kernel_dim));
  for (float x : k.q_conv.data) EXPECT_LE(std::abs(x), bound);
  stats(k.q_conv, mean, sd);
  EXPECT_NEAR(sd, bound / std::sqrt(3.0f), 0.1 * bound);  // U(−b, b) has sd b/√3
  const MoeWeights& moe = *w.layers[1].moe;
  for (float x : moe.correction_bias.data) EXPECT_EQ(x, 0.0f);
  const IndexerWeights& ix = *w.layers[3].dsa->indexer;
  for (float x : ix.ape.data) EXPECT_EQ(x, 0.0f);
  for (float x : ix.gate.data) EXPECT_EQ(x, 1.0f);
  for (float x : ix.k_norm_w.data) EXPECT_EQ(x, 1.0f);
  for (float x : ix.k_norm_b.data) EXPECT_EQ(x, 0.0f);

  // The softplus gate: A_log = log U(1, 16).
  c.linear_lower_bound.reset();
  const ModelWeights ws = init_weights(c, 7);
  for (float x : ws.layers[0].kda->A_log.data) {
    EXPECT_GE(x, 0.0f);
    EXPECT_LE(x, std::log(16.0f));
  }
  // The pad row of the embedding is zero.
  c.pad_token_id = 3;
  const ModelWeights wp = init_weights(c, 7);
  for (int64_t d = 0; d < c.hidden_size; ++d) EXPECT_EQ(wp.embed.data[3 * c.hidden_size + d], 0.0f);
}

TEST(Init, SameSeedSameModelOtherSeedOther) {
  const ModelConfig c = fortunes_config();
  EXPECT_TRUE(same_weights(c, init_weights(c, 1), init_weights(c, 1)));
  EXPECT_FALSE(same_weights(c, init_weights(c, 1), init_weights(c, 2)));
}

TEST(Init, SavedModelLoadsBackBitForBit) {
  for (bool tie : {false, true}) {
    ModelConfig c = fortunes_config();
    c.tie_word_embeddings = tie;
    const ModelWeights w = init_weights(c, 3);
    TempDir dir;
    save_model(dir.str(), c, w);
    const Model m = Model::load(dir.str());
    EXPECT_EQ(m.config().layer_types, c.layer_types);
    EXPECT_EQ(m.config().mlp_layer_types, c.mlp_layer_types);
    EXPECT_EQ(m.config().indexer_types, c.indexer_types);
    EXPECT_EQ(m.config().hidden_size, c.hidden_size);
    EXPECT_EQ(m.config().tie_word_embeddings, tie);
    EXPECT_EQ(m.config().initializer_range, c.initializer_range);
    EXPECT_EQ(m.config().linear_lower_bound, c.linear_lower_bound);
    EXPECT_TRUE(same_weights(c, m.weights(), w)) << "tie " << tie;
    EXPECT_EQ(std::memcmp(m.weights().lm_head.ptr(), w.lm_head.ptr(), w.lm_head.numel() * 4), 0);
    // And the config.json written is what parse_config reads to the same config again.
    EXPECT_EQ(config_to_json(m.config()), config_to_json(c));
  }
}

TEST(LossMask, WeightsSelectWhichPredictionsCount) {
  const ModelConfig c = fortunes_config();
  const Model model(c, init_weights(c, 5));
  PackedBatch b;
  b.add({72, 101, 108, 108, 111, 32, 119});
  b.add({116, 104, 101, 114, 101});
  ModelWeights g0 = zeros_like(model.weights()), g1 = zeros_like(model.weights()), g2 = zeros_like(model.weights());
  const double plain = model_forward_backward(model, b, g0);
  // All ones: the same loss and gradients bit for bit (the `grad` path is unchanged).
  PackedBatch ones = b;
  ones.target_weight.assign(b.tokens.size(), 1.0f);
  EXPECT_EQ(model_forward_backward(model, ones, g1), plain);
  EXPECT_TRUE(same_grads(c, g0, g1));
  // A prompt mask: only tokens 4.. of sequence 0 and all of sequence 1 count.
  PackedBatch masked = b;
  masked.target_weight = {0, 0, 0, 0, 1, 1, 1, /*seq 1*/ 0, 1, 1, 1, 1};
  const double loss = model_forward_backward(model, masked, g2);
  const auto lps = model.next_token_logprobs(b);  // lps[n][t] predicts token t + 1
  double expect = 0;
  for (int t = 3; t < 6; ++t) expect -= lps[0][t];
  for (double lp : lps[1]) expect -= lp;
  EXPECT_NEAR(loss, expect, 1e-4 * std::abs(expect));
  EXPECT_LT(loss, plain);
}

TEST(Data, ReadsMasksCutsLongSequencesAndNamesBadLines) {
  TempDir dir;
  const std::string p = dir.str("d.jsonl");
  std::ofstream(p) << "{\"tokens\": [1, 2, 3, 4, 5, 6, 7]}\n{\"tokens\": [9, 8], \"loss_mask\": [0, 1]}\n";
  const auto ex = read_train_jsonl(p, 256, 3);
  ASSERT_EQ(ex.size(), 3u);  // [1 2 3] [4 5 6] ([7] alone predicts nothing) [9 8]
  EXPECT_EQ(ex[1].tokens, (std::vector<int32_t>{4, 5, 6}));
  EXPECT_EQ(ex[2].mask, (std::vector<float>{0, 1}));
  for (const std::string& bad : {std::string("{\"tokens\": [1, 2], \"loss_mask\": [1]}"),
                                 std::string("{\"tokens\": [1, 2], \"loss_mask\": [1, 2]}"),
                                 std::string("{\"tokens\": [1, 300]}"), std::string("{\"tokens\": [1, 2], \"x\": 1}")}) {
    std::ofstream(p) << "{\"tokens\": [1, 2]}\n" << bad << "\n";
    try {
      read_train_jsonl(p, 256, 16);
      ADD_FAILURE() << "accepted " << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(p + ":2:"), std::string::npos) << e.what();
    }
  }
  // The epoch order is a permutation, fixed by (seed, epoch).
  const auto o = epoch_order(10, 4, 2);
  EXPECT_EQ(o, epoch_order(10, 4, 2));
  EXPECT_NE(o, epoch_order(10, 4, 3));
  std::vector<int64_t> sorted = o;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 10; ++i) EXPECT_EQ(sorted[i], i);
}

// parameter_count reads the shapes from the config alone (for a LoRA base that is never loaded): it must count what
// Model::num_parameters counts of the loaded tensors, on every layer kind, tied or not, with or without a shared
// expert and with full and shared indexers.
TEST(Model, ParameterCountFromTheConfigIsTheLoadedModels) {
  int checked = 0;
  for (const std::string& name : golden_cases()) {
    const Model m = Model::load(golden_dir(name));
    EXPECT_EQ(parameter_count(m.config()), m.num_parameters()) << name;
    ++checked;
  }
  const Model tiny = Model::load(std::string(NEXTLM_SOURCE_DIR) + "/examples/tiny-glm5-next");
  EXPECT_EQ(parameter_count(tiny.config()), tiny.num_parameters());
  ModelConfig c = fortunes_config();
  c.tie_word_embeddings = true;
  c.n_shared_experts = 0;
  c.layer_types[6] = LayerType::SparseAttention;  // a shared-indexer DSA layer follows a full one
  c.indexer_types[6] = IndexerType::Full;
  c.indexer_types[7] = IndexerType::Shared;
  validate(c);
  const Model m(c, init_weights(c, 1));
  EXPECT_EQ(parameter_count(c), m.num_parameters());
  // Every shape enters: one more head changes both counts the same way.
  c.linear_num_heads = 3;
  EXPECT_EQ(parameter_count(c), Model(c, init_weights(c, 1)).num_parameters());
  EXPECT_NE(parameter_count(c), m.num_parameters());
  EXPECT_GE(checked, 4);
}

TEST(Trainer, ResumeReproducesTheNextStepBitForBit) {
  const ModelConfig c = fortunes_config();
  TrainOptions opt;
  opt.steps = 6;
  opt.warmup = 2;
  opt.batch_tokens = 48;  // several batches per epoch: the data position matters
  opt.grad_accum = 2;
  opt.adamw.lr = 1e-2;
  opt.seed = 11;
  Trainer a(Model(c, init_weights(c, opt.seed)), text_examples(), opt);
  std::vector<double> losses;
  for (int i = 0; i < 3; ++i) losses.push_back(a.step().loss);
  TempDir dir;
  a.save(dir.str("ckpt"));
  const StepStats next = a.step();
  Trainer b = Trainer::resume(dir.str("ckpt"), text_examples(), Trainer::stored_options(dir.str("ckpt")));
  EXPECT_EQ(b.steps_done(), 3);
  const StepStats again = b.step();
  EXPECT_EQ(again.loss, next.loss);
  EXPECT_EQ(again.lr, next.lr);
  EXPECT_EQ(again.grad_norm, next.grad_norm);
  EXPECT_TRUE(same_weights(c, a.model().weights(), b.model().weights()));
  // Training does something: the loss of the same data goes down.
  EXPECT_LT(a.step().loss, losses[0]);
  // Saving again over the same directory replaces it whole.
  b.save(dir.str("ckpt"));
  EXPECT_EQ(Trainer::resume(dir.str("ckpt"), text_examples(), opt).steps_done(), 4);
  EXPECT_FALSE(std::filesystem::exists(dir.str("ckpt.old")));
}

}  // namespace
}  // namespace nextlm::test

namespace nextlm::test {
namespace {

// ---- Recompute policy -------------------------------------------------------------------------------------------

TEST(RecomputePolicy, ParsesAndPrints) {
  EXPECT_EQ(parse_recompute("all"), RecomputePolicy{});
  const RecomputePolicy none{false, false, false, false, false, false, false};
  EXPECT_EQ(parse_recompute("none"), none);
  const RecomputePolicy kda_moe{true, false, true, false, false, false, false};
  EXPECT_EQ(parse_recompute("kda,moe"), kda_moe);
  EXPECT_EQ(parse_recompute("moe,kda"), kda_moe);
  EXPECT_EQ(recompute_to_string(kda_moe), "kda,moe");
  EXPECT_EQ(recompute_to_string(RecomputePolicy{}), "all");
  EXPECT_EQ(recompute_to_string(none), "none");
  EXPECT_EQ(parse_recompute("kda,mla,moe,experts,mlp,mhc"), RecomputePolicy{});
  EXPECT_EQ(parse_recompute("experts,moe"), (RecomputePolicy{false, false, true, false, false, true, false}));
  // states: the KDA chunk states formed again with the KDA kept (the first rung of auto after none).
  EXPECT_EQ(parse_recompute("states"), (RecomputePolicy{false, false, false, false, false, false, true}));
  EXPECT_EQ(recompute_to_string(parse_recompute("mla,states")), "mla,states");
  EXPECT_FALSE(parse_recompute("states") == none);
  EXPECT_TRUE(parse_recompute("kda").recomputes_states()) << "a recomputed KDA keeps no states";
  // The default keeps the routed experts' gate|up and the dense MLP.
  EXPECT_EQ(recompute_to_string(default_recompute()), "kda,mla,moe,mhc");
  EXPECT_FALSE(default_recompute().recomputes_experts());
  EXPECT_FALSE(default_recompute() == RecomputePolicy{});
  // experts counts only inside a recomputed MoE: with the MoE kept, either value is the same policy.
  EXPECT_EQ((RecomputePolicy{true, true, false, true, true, true, true}),
            (RecomputePolicy{true, true, false, true, true, false, true}));
  // states counts only with the KDA kept: with it recomputed, either value is the same policy.
  EXPECT_EQ((RecomputePolicy{true, false, false, false, false, false, true}),
            (RecomputePolicy{true, false, false, false, false, false, false}));
  EXPECT_FALSE((RecomputePolicy{false, false, false, false, false, false, true}) ==
               (RecomputePolicy{false, false, false, false, false, false, false}));
  // Every one of the 128 flag settings reads back from its printed form.
  for (int bits = 0; bits < 128; ++bits) {
    const RecomputePolicy p{(bits & 1) != 0,  (bits & 2) != 0,  (bits & 4) != 0, (bits & 8) != 0,
                            (bits & 16) != 0, (bits & 32) != 0, (bits & 64) != 0};
    EXPECT_EQ(parse_recompute(recompute_to_string(p)), p) << recompute_to_string(p);
  }
  for (const char* bad : {"", "kda,", ",kda", "KDA", "kda,kda", "attention", "all,kda", "none,mhc", "kda moe",
                          "experts", "kda,experts", "moe,experts,experts", "auto,kda", "AUTO", "kda,states",
                          "states,kda", "states,states", "none,states", "State"})
    EXPECT_THROW(parse_recompute(bad), Error) << '"' << bad << '"';
}

// auto: adaptive, starting from everything kept, its rungs none → states → the default → all (the GPU falls back
// along them, test_cuda_train.cpp); where nothing can be run again it stands for the default.
TEST(RecomputePolicy, AutoFallsBackAlongItsRungs) {
  const RecomputePolicy none{false, false, false, false, false, false, false};
  const RecomputePolicy a = parse_recompute("auto");
  EXPECT_TRUE(a.adaptive);
  EXPECT_EQ(a, auto_recompute());
  EXPECT_EQ(recompute_to_string(a), "auto");
  EXPECT_FALSE(a == none) << "the flag counts";
  auto rung_of = [](RecomputePolicy p) {
    p.adaptive = false;
    return p;
  };
  EXPECT_EQ(rung_of(a), none);
  EXPECT_EQ(fixed_recompute(a), default_recompute());
  EXPECT_EQ(fixed_recompute(none), none);
  const std::optional<RecomputePolicy> r0 = recompute_fallback(a);
  ASSERT_TRUE(r0.has_value());
  EXPECT_TRUE(r0->adaptive);
  EXPECT_EQ(rung_of(*r0), parse_recompute("states"));
  const std::optional<RecomputePolicy> r1 = recompute_fallback(*r0);
  ASSERT_TRUE(r1.has_value());
  EXPECT_TRUE(r1->adaptive);
  EXPECT_EQ(rung_of(*r1), default_recompute());
  EXPECT_EQ(recompute_to_string(*r1), "auto");
  const std::optional<RecomputePolicy> r2 = recompute_fallback(*r1);
  ASSERT_TRUE(r2.has_value());
  EXPECT_TRUE(r2->adaptive);
  EXPECT_EQ(rung_of(*r2), RecomputePolicy{});
  EXPECT_FALSE(recompute_fallback(*r2).has_value()) << "nothing past all";
  for (const RecomputePolicy& fixed : {none, parse_recompute("states"), default_recompute(), RecomputePolicy{}})
    EXPECT_FALSE(recompute_fallback(fixed).has_value()) << "a fixed policy stays";
}

// The policies change only when each sub-layer's forward runs, not what runs on what, so the loss and every gradient
// are the same bits under all of them: on a packed batch of three sequences (one shorter than a k-pool) through a
// KDA layer, a full-indexer and a shared-indexer DSA layer, dense and MoE layers, with a loss mask, accumulating
// into gradients that already hold a batch.
TEST(RecomputePolicy, EveryPolicyGivesTheSameLossAndGradients) {
  ModelConfig c = fortunes_config();
  using LT = LayerType;
  c.num_hidden_layers = 4;
  c.layer_types = {LT::LinearAttention, LT::SparseAttention, LT::SparseAttention, LT::LinearAttention};
  c.mlp_layer_types = {MlpType::Dense, MlpType::Sparse, MlpType::Dense, MlpType::Sparse};
  c.indexer_types = {IndexerType::Full, IndexerType::Full, IndexerType::Shared, IndexerType::Full};
  validate(c);
  const Model model(c, init_weights(c, 3));
  PackedBatch b;
  std::vector<int32_t> s1, s2;
  for (int i = 0; i < 37; ++i) s1.push_back((i * 53 + 7) % 256);
  for (int i = 0; i < 21; ++i) s2.push_back((i * 19 + 1) % 256);
  b.add(s1);
  b.add({72, 105, 33});
  b.add(s2);
  b.target_weight.assign(b.tokens.size(), 1.0f);
  for (size_t t = 0; t < b.tokens.size(); t += 5) b.target_weight[t] = 0.0f;
  PackedBatch first;
  first.add({10, 20, 30, 40, 50, 60});

  auto run = [&](const RecomputePolicy& p, double& loss) {
    ModelWeights g = zeros_like(model.weights());
    model_forward_backward(model, first, g, p);
    loss = model_forward_backward(model, b, g, p);
    return g;
  };
  double ref_loss = 0.0;
  const ModelWeights ref = run(RecomputePolicy{}, ref_loss);
  // The gradients are not trivially equal: every trainable tensor got some.
  for (const GradTensor& g : hub_gradients(c, ref, "")) {
    double sum = 0.0;
    for (size_t i = 0; i < Tensor::count(g.shape); ++i) sum += std::fabs(g.data[i]);
    EXPECT_GT(sum, 0.0) << g.name;
  }
  for (const char* policy : {"none", "kda", "mla", "moe", "mlp", "mhc", "kda,moe", "mla,mlp,mhc", "auto"}) {
    double loss = 0.0;
    const ModelWeights g = run(parse_recompute(policy), loss);
    EXPECT_EQ(loss, ref_loss) << policy;
    EXPECT_TRUE(same_grads(c, g, ref)) << policy;
  }
}

// The trainer takes the policy from its options and stores it in the checkpoint (old checkpoints without it read
// as the default); a run under another policy takes the same steps.
TEST(RecomputePolicy, TrainerStoresItAndStepsTheSame) {
  const ModelConfig c = fortunes_config();
  TrainOptions opt;
  opt.steps = 2;
  opt.batch_tokens = 48;
  opt.seed = 2;
  Trainer a(Model(c, init_weights(c, opt.seed)), text_examples(), opt);
  opt.recompute = parse_recompute("moe,mhc");
  Trainer b(Model(c, init_weights(c, opt.seed)), text_examples(), opt);
  for (int i = 0; i < 2; ++i) {
    const StepStats sa = a.step(), sb = b.step();
    EXPECT_EQ(sa.loss, sb.loss);
    EXPECT_EQ(sa.grad_norm, sb.grad_norm);
  }
  EXPECT_TRUE(same_weights(c, a.model().weights(), b.model().weights()));
  TempDir dir;
  b.save(dir.str("ckpt"));
  EXPECT_EQ(Trainer::stored_options(dir.str("ckpt")).recompute, opt.recompute);
  // A checkpoint from before the policy existed: no "recompute" in its options.
  const std::string state = dir.str("ckpt") + "/trainer_state.json";
  std::ifstream in(state);
  nlohmann::json j = nlohmann::json::parse(in);
  in.close();
  ASSERT_EQ(j.at("options").at("recompute"), "moe,mhc");
  j["options"].erase("recompute");
  std::ofstream(state) << j.dump();
  EXPECT_EQ(Trainer::stored_options(dir.str("ckpt")).recompute, RecomputePolicy{});
}

}  // namespace
}  // namespace nextlm::test
