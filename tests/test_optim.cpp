// AdamW against a hand-computed update (torch.optim.AdamW's formula evaluated in double), the warmup + cosine
// schedule at its landmarks, global-norm clipping, and which tensors get weight decay.
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <vector>

#include "model/init.h"
#include "model/model.h"
#include "model/optim.h"
#include "model/train.h"
#include "test_util.h"

namespace nextlm::test {
namespace {

// fp32 arithmetic against a double reference of a few operations: a few ulp.
constexpr double kTol = 1e-6;

ParamRef make_param(std::vector<float>& w, std::vector<float>& g, bool decay) {
  ParamRef p;
  p.name = "p";
  p.shape = {static_cast<int64_t>(w.size())};
  p.w = w.data();
  p.g = g.data();
  p.n = static_cast<int64_t>(w.size());
  p.decay = decay;
  return p;
}

TEST(AdamW, TwoStepsMatchHandComputedUpdate) {
  std::vector<float> w = {1.0f, -2.0f, 0.5f}, g(3), w2 = w, g2(3);
  std::vector<ParamRef> ps = {make_param(w, g, true), make_param(w2, g2, false)};
  AdamWOptions o;
  o.lr = 0.1;
  o.beta1 = 0.9;
  o.beta2 = 0.99;
  o.eps = 1e-3;  // large enough to matter in the hand computation
  o.weight_decay = 0.5;
  AdamW adam(ps, o);
  const std::vector<std::vector<double>> grads = {{0.5, -0.1, 0.0}, {-0.3, 0.2, 1.0}};
  const std::vector<double> lrs = {0.1, 0.05};
  std::vector<double> ref(w.begin(), w.end()), ref_nd(ref), m(3, 0.0), v(3, 0.0);
  for (size_t s = 0; s < 2; ++s) {
    for (int i = 0; i < 3; ++i) g[i] = g2[i] = static_cast<float>(grads[s][i]);
    adam.step(ps, lrs[s]);
    const double t = static_cast<double>(s + 1);
    for (int i = 0; i < 3; ++i) {
      m[i] = 0.9 * m[i] + 0.1 * grads[s][i];
      v[i] = 0.99 * v[i] + 0.01 * grads[s][i] * grads[s][i];
      const double mhat = m[i] / (1 - std::pow(0.9, t));
      const double denom = std::sqrt(v[i]) / std::sqrt(1 - std::pow(0.99, t)) + 1e-3;
      ref[i] = ref[i] * (1 - lrs[s] * 0.5) - lrs[s] * mhat / denom;
      ref_nd[i] = ref_nd[i] - lrs[s] * mhat / denom;  // decay off: no shrink
    }
    for (int i = 0; i < 3; ++i) {
      EXPECT_NEAR(w[i], ref[i], kTol) << "step " << s << " element " << i;
      EXPECT_NEAR(w2[i], ref_nd[i], kTol) << "step " << s << " element " << i;
    }
  }
  EXPECT_EQ(adam.steps(), 2);
  // A zero gradient with decay still shrinks the weight (decoupled decay), and moves it by Adam's momentum only.
  EXPECT_NE(w[2], 0.5f);
}

TEST(Schedule, WarmupThenCosineToTheFloor) {
  const double lr = 2.0;
  EXPECT_DOUBLE_EQ(lr_at(0, 21, 4, lr), 0.5);   // warmup: lr·(s+1)/warmup
  EXPECT_DOUBLE_EQ(lr_at(1, 21, 4, lr), 1.0);
  EXPECT_DOUBLE_EQ(lr_at(3, 21, 4, lr), 2.0);   // the last warmup step reaches the peak
  EXPECT_DOUBLE_EQ(lr_at(4, 21, 4, lr), 2.0);   // cosine starts at the peak
  EXPECT_NEAR(lr_at(4 + 8, 21, 4, lr), 0.2 + 0.5 * 1.8 * (1 + std::cos(M_PI * 0.5)), 1e-12);  // half way
  EXPECT_NEAR(lr_at(20, 21, 4, lr), 0.2, 1e-12);  // the last step is at the floor (min_ratio 0.1)
  EXPECT_NEAR(lr_at(25, 21, 4, lr), 0.2, 1e-12);  // past the end it stays there
  for (int64_t s = 4; s < 20; ++s) EXPECT_GT(lr_at(s, 21, 4, lr), lr_at(s + 1, 21, 4, lr));
  EXPECT_DOUBLE_EQ(lr_at(0, 1, 0, lr), lr);  // a one-step run without warmup uses the peak
}

TEST(Clip, GlobalNormOverAllTensors) {
  std::vector<float> w1(2), g1 = {3.0f, 0.0f}, w2(1), g2 = {4.0f};
  std::vector<ParamRef> ps = {make_param(w1, g1, true), make_param(w2, g2, true)};
  EXPECT_DOUBLE_EQ(clip_grad_norm(ps, 10.0), 5.0);  // under the bound: untouched
  EXPECT_EQ(g1[0], 3.0f);
  EXPECT_DOUBLE_EQ(clip_grad_norm(ps, 0.0), 5.0);   // 0 = no clipping
  EXPECT_EQ(g2[0], 4.0f);
  EXPECT_DOUBLE_EQ(clip_grad_norm(ps, 1.0), 5.0);   // returns the norm before clipping
  EXPECT_NEAR(g1[0], 3.0 / (5.0 + 1e-6), 1e-7);
  EXPECT_NEAR(g2[0], 4.0 / (5.0 + 1e-6), 1e-7);
  EXPECT_NEAR(clip_grad_norm(ps, 0.0), 1.0, 1e-6);
}

TEST(WeightDecay, ExcludesNormsBiasesGatesAndMhcOffsets) {
  const std::string p = "model.language_model.layers.3.";
  for (const std::string& n :
       {p + "input_layernorm.weight", p + "post_attention_layernorm.weight", p + "self_attn.o_norm.weight",
        p + "self_attn.q_a_layernorm.weight", p + "self_attn.kv_a_layernorm.weight", std::string("model.language_model.norm.weight"),
        p + "self_attn.indexer.k_norm.bias", p + "self_attn.dt_bias", p + "self_attn.A_log", p + "hc_attn_base",
        p + "hc_attn_scale", p + "hc_ffn_base", p + "hc_ffn_scale"})
    EXPECT_FALSE(decays(n)) << n;
  for (const std::string& n :
       {p + "self_attn.q_proj.weight", p + "self_attn.q_conv1d.weight", p + "hc_attn_fn", p + "mlp.gate.weight",
        p + "mlp.experts.3.down_proj.weight", std::string("model.language_model.embed_tokens.weight"),
        std::string("lm_head.weight")})
    EXPECT_TRUE(decays(n)) << n;
}

TEST(WeightDecay, TrainableParamsOfAModelSkipFrozenTensors) {
  const ModelConfig c = load_config(std::string(NEXTLM_SOURCE_DIR) + "/examples/fortunes/config.json");
  ModelWeights w = init_weights(c, 1), g = zeros_like(w);
  const std::vector<ParamRef> ps = trainable_params(c, w, g, "model.language_model.");
  std::set<std::string> names;
  int64_t no_decay = 0;
  for (const ParamRef& p : ps) {
    EXPECT_TRUE(names.insert(p.name).second) << "duplicate " << p.name;
    EXPECT_EQ(p.name.find("indexer"), std::string::npos) << p.name;
    EXPECT_EQ(p.name.find("e_score_correction_bias"), std::string::npos) << p.name;
    no_decay += !p.decay;
  }
  EXPECT_EQ(ps.size(), hub_gradients(c, g, "model.language_model.").size());
  // Per layer: 2 norms + 4 mHC offsets; KDA adds o_norm, dt_bias, A_log; DSA its two layernorms; + the final norm.
  EXPECT_EQ(no_decay, 8 * 6 + 6 * 3 + 2 * 2 + 1);
}

}  // namespace
}  // namespace nextlm::test
