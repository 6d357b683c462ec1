// How the CUDA model gets its weights: straight from a checkpoint (CudaModel::load) it must hold exactly what the
// upload of the loaded host model holds, and a device-side random init must be deterministic, seed-dependent and
// at init_weights' scales. Runs on a GPU machine (part of test_cuda, CTest label "gpu").
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "cuda/device_model.h"
#include "model/init.h"
#include "model/model.h"
#include "test_util.h"

namespace nextlm {
namespace {

PackedBatch golden_batch(int64_t vocab) {
  PackedBatch b;
  for (int64_t L : {1, 3, 63, 65, 150}) {
    std::vector<int32_t> s(L);
    for (int64_t i = 0; i < L; ++i) s[i] = static_cast<int32_t>((i * 37 + L) % vocab);
    b.add(s);
  }
  return b;
}

class CudaModelLoad : public ::testing::TestWithParam<std::string> {};

// Both paths round every bf16-stored weight the same way (a bf16 checkpoint is copied as is; an fp32 one is rounded
// to nearest even on the host in both), so the device weights, and with them the logits, are identical.
TEST_P(CudaModelLoad, CheckpointLoadEqualsHostModelUpload) {
  const std::string dir = test::golden_dir(GetParam());
  const Model host = Model::load(dir);
  CudaModel from_host(host);
  const std::unique_ptr<CudaModel> direct = CudaModel::load(dir);
  EXPECT_EQ(direct->config().num_hidden_layers, host.config().num_hidden_layers);
  const PackedBatch b = golden_batch(host.config().vocab_size);
  const Tensor want = from_host.forward(b);
  const Tensor got = direct->forward(b);
  ASSERT_EQ(got.data.size(), want.data.size());
  for (float x : got.data) ASSERT_TRUE(std::isfinite(x));
  const double err = test::max_rel_error(got.ptr(), want.ptr(), want.data.size());
  std::printf("[cuda] %s: load vs host upload max|dlogit|/max|logit| = %.3g\n", GetParam().c_str(), err);
  // Same weights and the same kernels: bit-identical unless a kernel's summation order varies between runs.
  EXPECT_LE(err, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaModelLoad, ::testing::ValuesIn(test::golden_cases()),
                         [](const auto& info) { return test::param_name(info.param); });

// The config's shapes drive what the loader expects: a wrong size is an error naming a tensor and both shapes.
TEST(CudaModelLoadErrors, ShapeMismatchAndMissingCheckpointAreErrors) {
  test::TempDir tmp;
  const std::string dir = tmp.str("model");
  test::copy_dir(test::golden_dir("bf16_sharded"), dir);
  nlohmann::json cfg = nlohmann::json::parse(std::ifstream(dir + "/config.json"));
  nlohmann::json& text = cfg.contains("text_config") ? cfg["text_config"] : cfg;
  text["intermediate_size"] = text["intermediate_size"].get<int64_t>() + 1;
  std::ofstream(dir + "/config.json") << cfg.dump(2);
  try {
    CudaModel::load(dir);
    FAIL() << "a wrong intermediate_size loaded";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("mlp.gate_proj.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("expected"), std::string::npos) << msg;
  }
  EXPECT_THROW(CudaModel::load(tmp.str("absent")), Error);
}

double logit_std(const Tensor& t) {
  double s = 0, ss = 0;
  for (float x : t.data) s += x, ss += static_cast<double>(x) * x;
  const double n = static_cast<double>(t.data.size());
  return std::sqrt(ss / n - (s / n) * (s / n));
}

// Random device weights: the same seed gives the same model, another seed another, and the logits have the spread
// of a model from init_weights (which draws from the same distributions on the host with another generator): the
// logit scale is set by the lm_head's std over the normed hidden state, ~0.02·√D, so the two agree to a few %.
TEST(CudaModelRandom, DeterministicSeedDependentAndAtInitScale) {
  const ModelConfig c = Model::load(test::golden_dir("bf16_sharded")).config();
  const PackedBatch b = golden_batch(c.vocab_size);
  const Tensor a1 = CudaModel::random(c, 5)->forward(b);
  const Tensor a2 = CudaModel::random(c, 5)->forward(b);
  const Tensor other = CudaModel::random(c, 6)->forward(b);
  for (float x : a1.data) ASSERT_TRUE(std::isfinite(x));
  EXPECT_LE(test::max_rel_error(a1.ptr(), a2.ptr(), a1.data.size()), 1e-6);  // as in the load test above
  EXPECT_GT(test::norm_rel_error(other.ptr(), a1.ptr(), a1.data.size()), 0.5);
  const Model cpu(c, init_weights(c, 5));
  const double ratio = logit_std(a1) / logit_std(cpu.forward(b));
  std::printf("[cuda] random init: logit std device / host init = %.3f\n", ratio);
  EXPECT_GT(ratio, 0.8);
  EXPECT_LT(ratio, 1.25);
}

// Issue: a sequence's log-probs must not depend on the sequences that share its batch. With batch-invariant GEMMs
// the logits of one sequence scored alone and packed between two longer ones (other row counts, so cuBLASLt
// chooses other algorithms: on the H200 397308 of its 397312 logits differ) are bitwise equal; the cuBLASLt
// default is reported, not asserted.
TEST(CudaModelBatchInvariance, SequenceLogitsDoNotDependOnTheBatch) {
  // The golden's layout at larger widths, with a long reduction in the dense MLP's down projection (12288), where a
  // GEMM library is most tempted to split K for a short batch (at the golden's own widths, and at 1024/2048,
  // cuBLASLt picked the same kernels for 97 and 2031 rows on the H200).
  ModelConfig c = Model::load(test::golden_dir("bf16_stable")).config();
  c.hidden_size = 1024, c.intermediate_size = 12288, c.moe_intermediate_size = 512, c.vocab_size = 4096;
  const std::unique_ptr<CudaModel> m = CudaModel::random(c, 7);
  const int64_t V = m->config().vocab_size;
  auto seq = [&](int64_t L, int64_t salt) {
    std::vector<int32_t> s(L);
    for (int64_t i = 0; i < L; ++i) s[i] = static_cast<int32_t>((i * 131 + salt * 17 + i * i) % V);
    return s;
  };
  const std::vector<int32_t> target = seq(97, 1);
  PackedBatch alone, mixed;
  alone.add(target);
  const int64_t before = 700;
  mixed.add(seq(before, 2));
  mixed.add(target);
  mixed.add(seq(1234, 3));
  std::vector<Tensor> alone_logits;
  for (bool inv : {false, true}) {
    m->set_batch_invariant(inv);
    const Tensor a = m->forward(alone), b = m->forward(mixed);
    for (float x : a.data) ASSERT_TRUE(std::isfinite(x));
    int64_t differ = 0;
    for (int64_t i = 0; i < 97 * V; ++i) differ += a.data[i] != b.data[before * V + i];
    std::printf("[cuda] batch-invariant GEMMs %s: %lld of %lld logits differ between alone and batched\n",
                inv ? "on" : "off", static_cast<long long>(differ), static_cast<long long>(97 * V));
    if (inv) {
      EXPECT_EQ(differ, 0);
    }
    alone_logits.push_back(a);
  }
  // Reported only: the two modes round differently (cuBLASLt splits the long reduction for a short batch), and in
  // this random model that moves some tokens' routing; CudaGemm.BatchInvariantModeMatchesHostAndIgnoresTheBatch
  // holds each mode's GEMM to a host reference.
  std::printf("[cuda] batch-invariant vs cuBLASLt logits: ||d||/||logits|| = %.2e\n",
              test::norm_rel_error(alone_logits[1].ptr(), alone_logits[0].ptr(), alone_logits[0].data.size()));
}

}  // namespace
}  // namespace nextlm
