// The CPU fp32 forward against transformers 5.17.0 logits (tests/golden, made by make_goldens.py): every sequence
// run alone, and all of a case's sequences in one packed batch. Tolerance max|Δlogit| ≤ 1e-4·max|logit|: both sides
// compute in fp32 (different summation orders, OpenBLAS vs MKL/ATen), which leaves ~1e-6 relative per layer.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "io/safetensors.h"
#include "model/model.h"
#include "test_util.h"

namespace nextlm {
namespace {

constexpr double kTol = 1e-4;

struct Golden {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::vector<float>> logits;
};

Golden read_golden(const std::string& dir) {
  SafetensorsFile f(dir + "/golden.safetensors");
  Golden g;
  for (int i = 0;; ++i) {
    const TensorView* t = f.buffer().find("tokens." + std::to_string(i));
    if (!t) break;
    const TensorView* l = f.buffer().find("logits." + std::to_string(i));
    EXPECT_TRUE(l != nullptr);
    std::vector<int32_t> ids(t->numel());
    for (int64_t j = 0; j < t->numel(); ++j) {
      int64_t v;
      std::memcpy(&v, t->data + j * 8, 8);
      ids[j] = static_cast<int32_t>(v);
    }
    g.tokens.push_back(ids);
    g.logits.push_back(to_f32(*l));
  }
  return g;
}

class GoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenTest, EachSequenceAloneMatchesTransformers) {
  const std::string dir = test::golden_dir(GetParam());
  const Model model = Model::load(dir);
  const Golden g = read_golden(dir);
  ASSERT_GE(g.tokens.size(), 5u);
  double worst = 0.0;
  for (size_t i = 0; i < g.tokens.size(); ++i) {
    PackedBatch b;
    b.add(g.tokens[i]);
    const Tensor lg = model.forward(b);
    ASSERT_EQ(lg.data.size(), g.logits[i].size());
    const double err = test::max_rel_error(lg.ptr(), g.logits[i].data(), lg.data.size());
    worst = std::max(worst, err);
    EXPECT_LE(err, kTol) << GetParam() << " sequence " << i << " (T=" << g.tokens[i].size() << ")";
  }
  std::printf("[golden] %s: worst max|dlogit|/max|logit| = %.3g\n", GetParam().c_str(), worst);
}

TEST_P(GoldenTest, PackedBatchMatchesTransformers) {
  const std::string dir = test::golden_dir(GetParam());
  const Model model = Model::load(dir);
  const Golden g = read_golden(dir);
  PackedBatch b;
  for (size_t i = g.tokens.size(); i-- > 0;) b.add(g.tokens[i]);  // reversed order: offsets must not matter
  const Tensor lg = model.forward(b);
  const int64_t V = model.config().vocab_size;
  for (size_t k = 0; k < g.tokens.size(); ++k) {
    const size_t i = g.tokens.size() - 1 - k;
    const float* mine = lg.ptr() + b.cu_seqlens[k] * V;
    EXPECT_LE(test::max_rel_error(mine, g.logits[i].data(), g.logits[i].size()), kTol) << "sequence " << i;
  }
}

TEST_P(GoldenTest, RecurrentKdaMatchesTransformers) {
  const std::string dir = test::golden_dir(GetParam());
  const Model model = Model::load(dir);
  const Golden g = read_golden(dir);
  PackedBatch b;
  b.add(g.tokens.back());
  const Tensor lg = model.forward(b, ForwardOptions{KdaForm::Recurrent});
  EXPECT_LE(test::max_rel_error(lg.ptr(), g.logits.back().data(), lg.data.size()), kTol);
}

INSTANTIATE_TEST_SUITE_P(Cases, GoldenTest, ::testing::ValuesIn(test::golden_cases()),
                         [](const auto& info) { return test::param_name(info.param); });

TEST(Golden, AllCasesPresent) {
  // The cases the golden script makes; a missing directory must fail rather than shrink the suite.
  const auto cases = test::golden_cases();
  for (const char* name : {"bf16_sharded", "fp32_flat_softplus", "fp32_tail_off", "tiny-glm5-next"})
    EXPECT_NE(std::find(cases.begin(), cases.end(), name), cases.end()) << name;
}

}  // namespace
}  // namespace nextlm
