// The device training backward (CudaModel::forward_backward) against the CPU fp32 reference and transformers'
// autograd, on every golden: the loss and the gradient of every trainable tensor under its hub name.
//
// How close is close enough: the CPU reference runs with the weights the GPU holds in bf16 rounded the same way
// (test::bf16_weights_reference), so what remains is the device's bf16 rounding of activations at GEMM inputs and
// its summation orders. The goldens are small random models whose gradients react strongly to noise of that size:
// on the CPU in fp32, scaling each bf16-stored weight by 1 ± 2⁻⁸ at random (one bf16 step) moves most tensors'
// gradients by more than 5e-2 (up to 1.3 for mHC's scale, whose gradient is a sum with cancellation, and wherever a
// routing or indexer choice flips). So each tensor is held to max(5e-2, kNoiseRatio × that spread), the spread
// measured in the same test; the GPU's errors measured on the H200 were 0.3–0.5× it (median), 3.5× at worst. Each
// kernel is checked one by one at 1e-4 against the CPU in the CudaBackward* suites.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <array>
#include <filesystem>
#include <functional>
#include <map>
#include <iterator>
#include <memory>
#include <tuple>
#include <utility>
#include <random>

#include "core/error.h"
#include "cuda/device_model.h"
#include "cuda/grouped_gemm.h"
#include "io/safetensors.h"
#include "model/init.h"
#include "model/lora.h"
#include "model/optim.h"
#include "model/train.h"
#include "model/trainer.h"
#include "test_util.h"

namespace nextlm {
namespace {

using test::csv_losses;
using test::write_byte_jsonl;

constexpr double kGradTol = 5e-2;
constexpr double kNoiseRatio = 5.0;
constexpr double kLossTol = 1e-2;

PackedBatch golden_batch(const std::string& dir) {
  PackedBatch b;
  for (const auto& s : test::golden_sequences(dir)) b.add(s);
  return b;
}

// The LoRA CLI tests' data: three short sentences, four times each, as byte tokens.
void write_lora_data(const std::string& path) {
  std::vector<std::string> texts;
  for (int rep = 0; rep < 4; ++rep)
    for (const char* l : {"the cat sat on the mat.", "the dog sat on the log.", "a cat and a dog sat."})
      texts.push_back(l);
  write_byte_jsonl(path, texts);
}

// The model's bf16-stored weights (those test::bf16_weights_reference rounds) each scaled by 1 ± 2⁻⁸ at random.
Model perturbed(const Model& m) {
  ModelWeights w = m.weights();
  std::mt19937 gen(3);
  auto scale = [&](Tensor& t) {
    for (float& v : t.data) v *= (gen() & 1) ? 1.0f + 1.0f / 256 : 1.0f - 1.0f / 256;
  };
  auto mlp = [&](MlpWeights& x) {
    scale(x.gate);
    scale(x.up);
    scale(x.down);
  };
  scale(w.embed);
  scale(w.lm_head);
  for (LayerWeights& l : w.layers) {
    if (l.kda)
      for (Tensor* t : {&l.kda->q_proj, &l.kda->k_proj, &l.kda->v_proj, &l.kda->f_a, &l.kda->f_b, &l.kda->b_proj,
                        &l.kda->g_a, &l.kda->g_b, &l.kda->o_proj})
        scale(*t);
    if (l.dsa)
      for (Tensor* t : {&l.dsa->q_a, &l.dsa->q_b, &l.dsa->kv_a, &l.dsa->kv_b, &l.dsa->o_proj}) scale(*t);
    if (l.mlp) mlp(*l.mlp);
    if (l.moe) {
      scale(l.moe->router);
      for (MlpWeights& e : l.moe->experts) mlp(e);
      if (l.moe->shared) mlp(*l.moe->shared);
    }
  }
  return Model(m.config(), std::move(w));
}

// ‖a − b‖/‖b‖ per hub gradient (same names, same shapes), and over all of them at once ("*").
std::map<std::string, double> errors(const std::vector<GradTensor>& a, const std::vector<GradTensor>& b) {
  std::map<std::string, double> e;
  EXPECT_EQ(a.size(), b.size());
  double diff = 0, ref = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    EXPECT_EQ(a[i].name, b[i].name);
    EXPECT_EQ(a[i].shape, b[i].shape) << a[i].name;
    const size_t n = Tensor::count(b[i].shape);
    double d = 0, r = 0;
    for (size_t j = 0; j < n; ++j) {
      EXPECT_TRUE(std::isfinite(a[i].data[j])) << a[i].name;
      d += (static_cast<double>(a[i].data[j]) - b[i].data[j]) * (static_cast<double>(a[i].data[j]) - b[i].data[j]);
      r += static_cast<double>(b[i].data[j]) * b[i].data[j];
    }
    diff += d, ref += r;
    e[a[i].name] = r > 0 ? std::sqrt(d / r) : std::sqrt(d);  // a zero reference: the absolute norm
  }
  e["*"] = std::sqrt(diff / ref);
  return e;
}

// The device's gradients against the CPU's on the same weights, each tensor within max(5e-2, kNoiseRatio × the
// spread of the CPU's under one bf16 step of weight noise). Prints the figures.
void expect_within_noise(const std::string& what, const ModelConfig& c, const ModelWeights& gpu,
                         const ModelWeights& cpu, const ModelWeights& cpu_noisy) {
  const auto err = errors(hub_gradients(c, gpu, ""), hub_gradients(c, cpu, ""));
  const auto spread = errors(hub_gradients(c, cpu_noisy, ""), hub_gradients(c, cpu, ""));
  double worst_ratio = 0;
  std::string worst;
  int over_tol = 0;
  for (const auto& [name, e] : err) {
    const double s = spread.at(name);
    EXPECT_LE(e, std::max(kGradTol, kNoiseRatio * s)) << what << ": " << name << " (bf16-noise spread " << s << ")";
    over_tol += e > kGradTol;
    if (e / std::max(s, 1e-12) > worst_ratio) worst_ratio = e / std::max(s, 1e-12), worst = name;
  }
  std::printf("[cuda grad] %s: all tensors ‖g − ref‖/‖ref‖ %.3g (bf16-noise spread %.3g); %d of %zu tensors over "
              "%.0e; worst ratio to the spread %.2f (%s)\n",
              what.c_str(), err.at("*"), spread.at("*"), over_tol, err.size() - 1, kGradTol, worst_ratio,
              worst.c_str());
}

class CudaTrainGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaTrainGolden, GradientsMatchCpuReference) {
  const std::string dir = test::golden_dir(GetParam());
  const Model cpu = test::bf16_weights_reference(dir);
  const PackedBatch batch = golden_batch(dir);
  ModelWeights ref = zeros_like(cpu.weights()), noisy = zeros_like(cpu.weights());
  const double ref_loss = model_forward_backward(cpu, batch, ref);
  model_forward_backward(perturbed(cpu), batch, noisy);

  // The KDA core in fp32 (as the CPU computes it); the tensor-core forward core is checked below.
  CudaModel gpu(cpu);
  gpu.set_kda_tensor_cores(false);
  const double loss = gpu.forward_backward(batch);
  EXPECT_LE(std::fabs(loss - ref_loss) / std::fabs(ref_loss), kLossTol) << loss << " vs " << ref_loss;
  std::printf("[cuda grad] %s: loss %.8g vs CPU %.8g\n", GetParam().c_str(), loss, ref_loss);
  expect_within_noise(GetParam(), cpu.config(), gpu.gradients(), ref, noisy);
}

// With the KDA forward core on tensor cores (the default where the config has them: bf16 q, k, v, as inference
// runs it), the training loss is the forward's own: −Σ of next_token_logprobs on the same model within 1e-5
// relative (the same kernels but the head's reduction order). The bf16 core moves activations, and with them now and
// then a routing choice, more than one bf16 step of weight noise does, so single tensors can leave the per-tensor
// bound above; over all tensors the gradients stay within that noise's spread.
TEST_P(CudaTrainGolden, TensorCoreKdaTrainsOnTheForwardsArithmetic) {
  const std::string dir = test::golden_dir(GetParam());
  const Model cpu = test::bf16_weights_reference(dir);
  const PackedBatch batch = golden_batch(dir);
  ModelWeights ref = zeros_like(cpu.weights()), noisy = zeros_like(cpu.weights());
  model_forward_backward(cpu, batch, ref);
  model_forward_backward(perturbed(cpu), batch, noisy);
  CudaModel gpu(cpu);
  const double loss = gpu.forward_backward(batch);
  double scored = 0;
  for (const auto& seq : gpu.next_token_logprobs(batch))
    for (double lp : seq) scored -= lp;
  const auto err = errors(hub_gradients(cpu.config(), gpu.gradients(), ""), hub_gradients(cpu.config(), ref, ""));
  const auto spread = errors(hub_gradients(cpu.config(), noisy, ""), hub_gradients(cpu.config(), ref, ""));
  std::printf("[cuda grad tc] %s: KDA on tensor cores %s; loss %.8g, scored %.8g; all tensors %.3g (spread %.3g)\n",
              GetParam().c_str(), gpu.kda_on_tensor_cores() ? "yes" : "no", loss, scored, err.at("*"),
              spread.at("*"));
  EXPECT_LE(std::fabs(loss - scored), 1e-5 * std::fabs(scored));
  EXPECT_LE(err.at("*"), spread.at("*"));
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaTrainGolden, ::testing::ValuesIn(test::golden_cases()),
                         [](const auto& info) { return test::param_name(info.param); });

// Against transformers' autograd directly, on the golden whose checkpoint is bf16 (the GPU holds its weights
// exactly): each golden sequence alone, as the golden was made, the loss and gradients summed; the same noise bound,
// the spread measured on the CPU against the same golden.
TEST(CudaTrain, GradientsMatchTransformersGolden) {
  const std::string dir = test::golden_dir("bf16_sharded");
  const Model m = Model::load(dir);
  CudaModel gpu(m);
  gpu.set_kda_tensor_cores(false);  // the KDA core in fp32, as transformers' (CudaTrainGolden has the other)
  ModelWeights noisy = zeros_like(m.weights());
  const Model p = perturbed(m);
  double loss = 0.0;
  for (const auto& s : test::golden_sequences(dir)) {
    PackedBatch b;
    b.add(s);
    loss += gpu.forward_backward(b);
    model_forward_backward(p, b, noisy);
  }
  SafetensorsFile ref(dir + "/golden_grads.safetensors");
  const TensorView* l = ref.buffer().find("loss");
  ASSERT_TRUE(l);
  double ref_loss;
  std::memcpy(&ref_loss, l->data, 8);
  EXPECT_LE(std::fabs(loss - ref_loss) / std::fabs(ref_loss), kLossTol);
  // The golden's tensors as a ModelWeights of the same layout: read back into a zeros_like through hub_gradients.
  ModelWeights golden = zeros_like(m.weights());
  const std::string prefix = text_prefix(Checkpoint(dir));
  int filled = 0;
  for (const GradTensor& t : hub_gradients(m.config(), golden, prefix)) {
    const TensorView* r = ref.buffer().find(t.name);
    ASSERT_TRUE(r) << t.name << " has no golden";
    ASSERT_EQ(r->shape, t.shape) << t.name;
    const std::vector<float> v = to_f32(*r);
    std::memcpy(const_cast<float*>(t.data), v.data(), v.size() * sizeof(float));
    ++filled;
  }
  EXPECT_EQ(filled + 1, static_cast<int>(ref.buffer().tensors().size())) << "every golden tensor compared";
  std::printf("[cuda grad vs transformers] loss %.8g vs %.8g\n", loss, ref_loss);
  expect_within_noise("bf16_sharded vs transformers", m.config(), gpu.gradients(), golden, noisy);
}

// Gradients accumulate over calls, zero_grads() clears them, and the same batch gives the same loss each time.
TEST(CudaTrain, GradientsAccumulateAndZero) {
  const std::string dir = test::golden_dir("fp32_tail_off");
  const Model m = Model::load(dir);
  CudaModel gpu(m);
  const PackedBatch batch = golden_batch(dir);
  const double l1 = gpu.forward_backward(batch);
  const ModelWeights once = gpu.gradients();
  const double l2 = gpu.forward_backward(batch);
  EXPECT_EQ(l1, l2);
  const ModelWeights twice = gpu.gradients();
  const auto a = hub_gradients(m.config(), once, ""), b = hub_gradients(m.config(), twice, "");
  for (size_t i = 0; i < a.size(); ++i) {
    const size_t n = Tensor::count(a[i].shape);
    std::vector<float> doubled(a[i].data, a[i].data + n);
    for (float& x : doubled) x *= 2.0f;
    // Equal but for the atomics of the embedding and of the MLA key gradients, whose order of additions changes
    // the rounding, which these models amplify on the way back (3e-4 measured); overwriting would give 0.5.
    EXPECT_LE(test::norm_rel_error(b[i].data, doubled.data(), n), 1e-2) << a[i].name;
  }
  gpu.zero_grads();
  EXPECT_EQ(gpu.forward_backward(batch), l1);
  const ModelWeights again = gpu.gradients();
  const auto c = hub_gradients(m.config(), again, "");
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_LE(test::norm_rel_error(c[i].data, a[i].data, Tensor::count(a[i].shape)), 1e-2) << a[i].name;
}

// Keeping activations instead of recomputing them (set_recompute) changes when the sub-layers' forwards run, not
// what they compute: the loss is bitwise the default policy's, and the gradients equal its up to the order of the
// atomic additions (embedding, MLA key gradients) that also separates two runs of one policy (the test above).
// A bug feeding a backward another site's activations moves them by far more than that.
TEST(CudaTrain, RecomputePoliciesGiveTheSameGradients) {
  for (const std::string name : {"tiny-glm5-next", "bf16_stable"}) {
    const std::string dir = test::golden_dir(name);
    const Model m = Model::load(dir);
    const PackedBatch batch = golden_batch(dir);
    CudaModel gpu(m);
    const double ref_loss = gpu.forward_backward(batch);
    const ModelWeights ref = gpu.gradients();
    // (kda,mla,moe,mhc, the default, kda,mla,moe,mlp,mhc and moe keep the routed experts' gate|up inside a
    // recomputed MoE.)
    for (const char* policy :
         {"none", "kda,mla", "moe,mlp,mhc", "kda,mla,moe,mlp", "kda,mla,moe,mhc", "kda,mla,moe,mlp,mhc", "moe"}) {
      gpu.zero_grads();
      gpu.set_recompute(parse_recompute(policy));
      EXPECT_EQ(gpu.forward_backward(batch), ref_loss) << name << " " << policy;
      const auto e = errors(hub_gradients(m.config(), gpu.gradients(), ""), hub_gradients(m.config(), ref, ""));
      for (const auto& [tensor, v] : e) EXPECT_LE(v, 1e-2) << name << " --recompute " << policy << ": " << tensor;
      std::printf("[cuda recompute] %s --recompute %s: all tensors %.3g from recompute all\n", name.c_str(), policy,
                  e.at("*"));
    }
  }
}

// A golden's base model on the device, frozen, with random adapters (one per routed expert) set on it, and the
// golden's batch.
struct LoraOnGpu {
  Model base;
  PackedBatch batch;
  LoraAdapter lora;
  CudaModel gpu;
  explicit LoraOnGpu(const std::string& name, LoraExperts experts = LoraExperts::PerExpert, int64_t rank = 4)
      : base(Model::load(test::golden_dir(name))),
        batch(golden_batch(test::golden_dir(name))),
        lora(test::random_lora(base.config(), experts, rank)),
        gpu(base) {
    gpu.set_train_linears(false);
    gpu.set_train_small(false);  // as `nextlm train --lora` runs it: the adapters' gradients alone
    gpu.set_lora(lora);
  }
};

// The same with LoRA adapters on every projection: each adapter's forward product is read by its backward at its own
// site, whether that site was recomputed or kept, and where a recomputed MoE reuses its kept experts' gate|up, the
// experts' adapters make their factors alone: one adapter per routed expert at rank 4 (the grouped LoRA kernels
// after the GEMMs) and 16 (folded into the grouped GEMMs), and one shared by a layer's experts.
TEST(CudaTrain, LoraGradientsUnderEveryRecomputePolicy) {
  struct Case {
    LoraExperts experts;
    int64_t rank;
  };
  for (const Case& c :
       {Case{LoraExperts::PerExpert, 4}, Case{LoraExperts::PerExpert, 16}, Case{LoraExperts::Shared, 4}}) {
    LoraOnGpu t("bf16_stable", c.experts, c.rank);
    const PackedBatch& batch = t.batch;
    const LoraAdapter& lora = t.lora;
    CudaModel& gpu = t.gpu;
    const std::string at = std::string(c.experts == LoraExperts::Shared ? "shared" : "per-expert") + " rank " +
                           std::to_string(c.rank) + " --recompute ";
    LoraAdapter ref = test::without_gradients(lora);
    const double ref_loss = gpu.forward_backward(batch);
    gpu.lora_gradients(ref);
    for (const char* policy : {"none", "moe,mhc", "kda,mla,moe,mhc"}) {
      gpu.zero_grads();
      gpu.set_recompute(parse_recompute(policy));
      LoraAdapter got = test::without_gradients(lora);
      EXPECT_EQ(gpu.forward_backward(batch), ref_loss) << at << policy;
      gpu.lora_gradients(got);
      double diff = 0, norm = 0;
      for (size_t i = 0; i < ref.modules().size(); ++i) {
        const LoraModule &r = ref.modules()[i], &g = got.modules()[i];
        for (const auto& [rt, gt] : {std::tie(r.dA, g.dA), std::tie(r.dB, g.dB)})
          for (size_t j = 0; j < rt.data.size(); ++j) {
            ASSERT_TRUE(std::isfinite(gt.data[j])) << at << policy;
            diff += std::pow(static_cast<double>(gt.data[j]) - rt.data[j], 2);
            norm += std::pow(static_cast<double>(rt.data[j]), 2);
          }
      }
      ASSERT_GT(norm, 0.0);
      EXPECT_LE(std::sqrt(diff / norm), 1e-2) << at << policy;
      std::printf("[cuda recompute lora] %s%s: adapters' gradients %.3g from recompute all\n", at.c_str(), policy,
                  std::sqrt(diff / norm));
    }
  }
}

// The grouped per-expert adapters' gradients are not cleared by zero_grads but overwritten by the next backward
// (LoraState::overwritten); the others are cleared and added to. Both kinds then behave as cleared gradients: a second
// backward adds (twice the first, up to the order of the atomic additions upstream), zero_grads and a backward give the
// first again (up to the same), and gradients read after zero_grads with no backward are zeros. Per-expert adapters at
// rank 4 (the grouped kernels after the GEMMs) and 16 (folded), and shared ones.
TEST(CudaTrain, LoraGradientsAccumulateAndZero) {
  for (const auto& [experts, rank] : {std::pair{LoraExperts::PerExpert, int64_t{4}},
                                      std::pair{LoraExperts::PerExpert, int64_t{16}},
                                      std::pair{LoraExperts::Shared, int64_t{4}}}) {
    SCOPED_TRACE(std::string(experts == LoraExperts::Shared ? "shared" : "per-expert") + " rank " +
                 std::to_string(rank));
    LoraOnGpu t("bf16_stable", experts, rank);
    CudaModel& gpu = t.gpu;
    auto grads = [&] {
      LoraAdapter a = test::without_gradients(t.lora);
      gpu.lora_gradients(a);
      std::vector<float> v;
      for (const LoraModule& mod : a.modules())
        for (const Tensor* g : {&mod.dA, &mod.dB}) v.insert(v.end(), g->data.begin(), g->data.end());
      return v;
    };
    gpu.zero_grads();
    const std::vector<float> none = grads();
    ASSERT_FALSE(none.empty());
    EXPECT_TRUE(std::all_of(none.begin(), none.end(), [](float x) { return x == 0.0f; }));
    const double l1 = gpu.forward_backward(t.batch);
    const std::vector<float> once = grads();
    EXPECT_EQ(gpu.forward_backward(t.batch), l1);
    std::vector<float> doubled = once;
    for (float& x : doubled) x *= 2.0f;
    const std::vector<float> twice = grads();
    EXPECT_LE(test::norm_rel_error(twice.data(), doubled.data(), doubled.size()), 1e-2);
    gpu.zero_grads();
    EXPECT_EQ(gpu.forward_backward(t.batch), l1);
    const std::vector<float> again = grads();
    EXPECT_LE(test::norm_rel_error(again.data(), once.data(), once.size()), 1e-2);
    gpu.zero_grads();  // and once more with nothing run in between: still zeros
    gpu.zero_grads();
    const std::vector<float> zeros = grads();
    EXPECT_TRUE(std::all_of(zeros.begin(), zeros.end(), [](float x) { return x == 0.0f; }));
  }
}

// --recompute auto on the device: a step that does not fit keeping everything (an activation limit between what the
// policies need) runs again under the next rung, the micro-batches since zero_grads too, so that the loss and the
// accumulated adapters' gradients are those of that rung from the start; past all, out of memory is an error.
TEST(CudaTrain, AutoRecomputeFallsBackWhenActivationsDoNotFit) {
  LoraOnGpu t("bf16_stable");
  CudaModel& gpu = t.gpu;
  const PackedBatch& big = t.batch;
  PackedBatch small;
  small.add(std::vector<int32_t>(big.tokens.begin(), big.tokens.begin() + big.cu_seqlens[1]));
  ASSERT_LT(small.num_tokens(), big.num_tokens());
  auto peak = [&](const char* policy, const PackedBatch& b) {
    gpu.zero_grads();
    gpu.set_recompute(parse_recompute(policy));
    gpu.forward_backward(b);
    return gpu.activation_peak();
  };
  const size_t none_small = peak("none", small), none_big = peak("none", big);
  const size_t mid_big = peak("kda,mla,moe,mhc", big), all_big = peak("all", big);
  ASSERT_LT(std::max(none_small, mid_big), none_big);
  ASSERT_LT(all_big, mid_big);
  // The reference: both micro-batches under the middle rung.
  gpu.zero_grads();
  gpu.set_recompute(default_recompute());
  const double ref_small = gpu.forward_backward(small), ref_big = gpu.forward_backward(big);
  LoraAdapter ref = test::without_gradients(t.lora);
  gpu.lora_gradients(ref);
  auto grad_error = [&](const LoraAdapter& got) {
    double diff = 0, norm = 0;
    for (size_t i = 0; i < ref.modules().size(); ++i) {
      const LoraModule &r = ref.modules()[i], &g = got.modules()[i];
      for (const auto& [rt, gt] : {std::tie(r.dA, g.dA), std::tie(r.dB, g.dB)})
        for (size_t j = 0; j < rt.data.size(); ++j) {
          diff += std::pow(static_cast<double>(gt.data[j]) - rt.data[j], 2);
          norm += std::pow(static_cast<double>(rt.data[j]), 2);
        }
    }
    return norm > 0 ? std::sqrt(diff / norm) : 1.0;
  };

  gpu.set_activation_limit((std::max(none_small, mid_big) + none_big) / 2);
  gpu.set_recompute(parse_recompute("auto"));
  gpu.zero_grads();
  EXPECT_EQ(gpu.forward_backward(small), ref_small);
  EXPECT_EQ(gpu.recompute(), auto_recompute()) << "the small batch fits keeping everything";
  EXPECT_EQ(gpu.forward_backward(big), ref_big);
  RecomputePolicy mid = default_recompute();
  mid.adaptive = true;
  EXPECT_EQ(gpu.recompute(), mid) << "the big one did not: the middle rung from then on";
  LoraAdapter got = test::without_gradients(t.lora);
  gpu.lora_gradients(got);
  // The same sums up to the MLA keys' atomics (the test above's two runs of one policy).
  EXPECT_LE(grad_error(got), 1e-4);

  // Room for recomputing everything only: down to all; below that, the error.
  gpu.set_activation_limit((all_big + mid_big) / 2);
  gpu.zero_grads();
  EXPECT_EQ(gpu.forward_backward(big), ref_big);
  RecomputePolicy all;
  all.adaptive = true;
  EXPECT_EQ(gpu.recompute(), all);
  gpu.set_activation_limit(all_big / 2);
  gpu.zero_grads();
  EXPECT_THROW(gpu.forward_backward(big), OutOfMemory);
  // A fixed policy does not fall back.
  gpu.set_activation_limit((std::max(none_small, mid_big) + none_big) / 2);
  gpu.set_recompute(parse_recompute("none"));
  gpu.zero_grads();
  EXPECT_THROW(gpu.forward_backward(big), OutOfMemory);
  // Nor does an adaptive one whose gradients hold batches it cannot run again (added before an optimizer step).
  gpu.set_activation_limit(0);
  gpu.set_recompute(parse_recompute("auto"));
  gpu.zero_grads();
  EXPECT_EQ(gpu.forward_backward(big), ref_big);
  EXPECT_EQ(gpu.recompute(), auto_recompute());
  gpu.set_lora(t.lora);  // the same values: a weight change as far as the replay knows
  gpu.set_activation_limit((std::max(none_small, mid_big) + none_big) / 2);
  EXPECT_THROW(gpu.forward_backward(big), OutOfMemory);
  gpu.set_activation_limit(0);
}

// set_train_small: off (LoraOnGpu), the small weights' gradients are not formed (zeros in gradients()); on, they
// are, and the loss and the adapters' gradients are those of the run without them (up to the MLA keys' atomics).
TEST(CudaTrain, SmallWeightGradientsOnlyWhenAsked) {
  LoraOnGpu t("bf16_stable");
  LoraAdapter off = test::without_gradients(t.lora), on = off;
  const double loss_off = t.gpu.forward_backward(t.batch);
  t.gpu.lora_gradients(off);
  const ModelWeights g_off = t.gpu.gradients();
  t.gpu.set_train_small(true);
  t.gpu.zero_grads();
  EXPECT_EQ(t.gpu.forward_backward(t.batch), loss_off);
  t.gpu.lora_gradients(on);
  const ModelWeights g_on = t.gpu.gradients();
  auto sum_sq = [](const ModelWeights& g) {
    std::array<double, 4> s{};  // mHC fn, input norms, final norm, KDA dt_bias
    for (const LayerWeights& l : g.layers) {
      for (float x : l.hc_attn.fn.data) s[0] += double(x) * x;
      for (float x : l.input_norm.data) s[1] += double(x) * x;
      if (l.kda)
        for (float x : l.kda->dt_bias.data) s[3] += double(x) * x;
    }
    for (float x : g.final_norm.data) s[2] += double(x) * x;
    return s;
  };
  const std::array<double, 4> s_off = sum_sq(g_off), s_on = sum_sq(g_on);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(s_off[i], 0.0) << "small gradient " << i << " formed while off";
    EXPECT_GT(s_on[i], 0.0) << "small gradient " << i << " missing while on";
  }
  double diff = 0, norm = 0;
  for (size_t i = 0; i < off.modules().size(); ++i)
    for (const auto& [a, b] : {std::tie(off.modules()[i].dA, on.modules()[i].dA),
                               std::tie(off.modules()[i].dB, on.modules()[i].dB)})
      for (size_t j = 0; j < a.data.size(); ++j) {
        diff += std::pow(double(a.data[j]) - b.data[j], 2);
        norm += std::pow(double(a.data[j]), 2);
      }
  ASSERT_GT(norm, 0.0);
  EXPECT_LE(std::sqrt(diff / norm), 1e-2);
}

// Each LoRA kind's adapter gradients (dA and dB together) of `got` within `tol` of `ref`'s, norm-relative; every kind
// has some gradient in ref and every element of got is finite. `at` names the case in the messages.
// Every module's dA and dB the same bits in both (and some gradients at all).
void expect_lora_gradients_equal(const LoraAdapter& ref, const LoraAdapter& got, const std::string& at) {
  ASSERT_EQ(got.modules().size(), ref.modules().size()) << at;
  size_t n = 0;
  for (size_t i = 0; i < ref.modules().size(); ++i) {
    const LoraModule &a = ref.modules()[i], &b = got.modules()[i];
    EXPECT_EQ(b.dA.data, a.dA.data) << at << ": module " << i;
    EXPECT_EQ(b.dB.data, a.dB.data) << at << ": module " << i;
    n += a.dA.data.size();
  }
  EXPECT_GT(n, 0u) << at;
}

void expect_lora_gradients_near(const LoraAdapter& ref, const LoraAdapter& got, double tol, const std::string& at) {
  std::map<std::string, std::array<double, 2>> by_kind;  // diff², ref²
  for (size_t i = 0; i < ref.modules().size(); ++i) {
    const LoraModule &r = ref.modules()[i], &g = got.modules()[i];
    auto& acc = by_kind[lora_kind_info(r.kind).group + std::string(".") + lora_kind_info(r.kind).leaf];
    for (const auto& [rt, gt] : {std::tie(r.dA, g.dA), std::tie(r.dB, g.dB)})
      for (size_t j = 0; j < rt.data.size(); ++j) {
        EXPECT_TRUE(std::isfinite(gt.data[j])) << at;
        acc[0] += std::pow(static_cast<double>(gt.data[j]) - rt.data[j], 2);
        acc[1] += std::pow(static_cast<double>(rt.data[j]), 2);
      }
  }
  for (const auto& [kind, acc] : by_kind) {
    EXPECT_GT(acc[1], 0.0) << kind << " " << at;
    EXPECT_LE(std::sqrt(acc[0] / acc[1]), tol) << kind << " " << at;
  }
}

// A LoRA step on the golden's base with random per-expert adapters at `rank` under `policy`, run with a
// process-wide switch off and then on (set(false), set(true)): the losses within loss_tol relative, and each kind's
// adapter gradients (dA and dB together) within 1e-2 of the first run's; `count` (a process-wide counter) grows in a
// run exactly when grows(on). Returns the two losses.
std::pair<double, double> lora_switch_runs(const Model& base, const PackedBatch& batch, int rank, const char* policy,
                                           const std::function<void(bool)>& set, const std::function<int64_t()>& count,
                                           const std::function<bool(bool)>& grows, double loss_tol) {
  const LoraAdapter lora = test::random_lora(base.config(), LoraExperts::PerExpert, rank);
  CudaModel gpu(base);
  gpu.set_train_linears(false);
  gpu.set_recompute(parse_recompute(policy));
  gpu.set_lora(lora);
  const std::string at = "rank " + std::to_string(rank) + " --recompute " + policy;
  auto run = [&](bool on, LoraAdapter& out) {
    set(on);
    gpu.zero_grads();
    const int64_t before = count();
    const double loss = gpu.forward_backward(batch);
    EXPECT_EQ(count() > before, grows(on)) << at << (on ? " on" : " off");
    gpu.lora_gradients(out);
    return loss;
  };
  LoraAdapter off = test::without_gradients(lora), on = test::without_gradients(lora);
  const double loss_off = run(false, off), loss_on = run(true, on);
  EXPECT_LE(std::fabs(loss_on - loss_off) / std::fabs(loss_off), loss_tol) << at;
  expect_lora_gradients_near(off, on, 1e-2, at);
  return {loss_off, loss_on};
}

// The dense adapters that read one input, stacked (one GEMM for their u, one for their dA, one for their dx: the
// default) against one at a time: the same loss and gradients up to the GEMMs' summation order, at rank 4 and 16,
// with every sub-layer kept and recomputed; and the groups were stacked (KDA or MLA attention in every layer, the
// dense MLP and the shared experts). Without joined projections the loss agrees to 1e-5; with them (the default)
// the two runs join different layouts (single adapters, then stacked groups) into the same kept joined weights, so
// the loss is held to the joined path's 1e-4 (at rank 4 both layouts are 8 columns wide: a kept copy with the first
// layout's B left in place moved the gradients by 3-14 %).
TEST(CudaTrain, StackedLoraAdaptersMatchOneAtATime) {
  const std::string dir = test::golden_dir("bf16_stable");
  const Model base = test::bf16_weights_reference(dir);
  const PackedBatch batch = golden_batch(dir);
  struct Restore {
    ~Restore() {
      set_lora_stacking(true);
      set_lora_joining(true);
    }
  } restore;
  for (const bool joining : {false, true}) {
    set_lora_joining(joining);
    for (const int rank : {4, 16})
      for (const char* policy : {"all", "none"})
        lora_switch_runs(base, batch, rank, policy, set_lora_stacking, lora_stacked_groups,
                         [](bool on) { return on; }, joining ? 1e-4 : 1e-5);
  }
}

// Projections joined with their adapters into one GEMM ([x | u]·[W | B]ᵀ: set_lora_joining, the default) against the
// adapters' products added by the projection's GEMM: the same loss and gradients up to the GEMMs' summation order
// (and the MLA's q and kv rounded to bf16 from the joined sums instead of from the fp32 output: where the sums differ
// in their last bit, an element can round to the next bf16 value; the loss moved by 2.1e-5 relative on the H200).
// Single adapters join (f_b, g_b, q_b, kv_b, the shared expert's down), and so do stacked groups on one projection
// (q|k|v, the MLPs' gate|up, q_a and kv_a alone), at rank 16 and at rank 4 (u's columns padded to 8).
// JoiningCase: the golden's base and batch for these tests, which switch joining (on again when they end).
struct JoiningCase {
  const std::string dir = test::golden_dir("bf16_stable");
  const Model base = test::bf16_weights_reference(dir);
  const PackedBatch batch = golden_batch(dir);
  ~JoiningCase() { set_lora_joining(true); }
};
TEST(CudaTrain, JoinedLoraProjectionsMatchTheAdditivePath) {
  const JoiningCase c;
  for (const int rank : {16, 4})
    for (const char* policy : {"all", "none"})
      lora_switch_runs(c.base, c.batch, rank, policy, set_lora_joining, lora_joined_projections,
                       [](bool on) { return on; }, 1e-4);
}

// With a frozen base the joined weights are kept from step to step (W copied once); the adapters' B in them must
// follow the optimizer's updates. Two AdamW steps (lr 1e-2: every adapter element moves) with and without joining:
// the second forward's loss agrees within 5 % of what the first update moved it (a stale B would leave about half
// of that move out).
TEST(CudaTrain, JoinedLoraWeightsFollowTheAdapterUpdates) {
  const JoiningCase c;
  const LoraAdapter lora = test::random_lora(c.base.config(), LoraExperts::PerExpert, 16);
  auto two_steps = [&](bool on) {
    set_lora_joining(on);
    CudaModel gpu(c.base);
    gpu.set_train_linears(false);
    gpu.set_lora(lora);
    gpu.start_lora_optimizer(lora);
    std::array<double, 2> loss{};
    for (int s = 0; s < 2; ++s) {
      gpu.zero_grads();
      loss[s] = gpu.forward_backward(c.batch);
      gpu.lora_adamw_step(AdamWOptions{}, 1e-2, s + 1, 1.0, 1e9);
    }
    return loss;
  };
  const int64_t before = lora_joined_projections();
  const std::array<double, 2> off = two_steps(false), on = two_steps(true);
  EXPECT_GT(lora_joined_projections(), before);
  const double moved = std::fabs(off[1] - off[0]);
  ASSERT_GT(moved, 1e-3 * std::fabs(off[0])) << "the update should move the loss";
  EXPECT_LE(std::fabs(on[0] - off[0]), 1e-4 * std::fabs(off[0]));
  EXPECT_LE(std::fabs(on[1] - off[1]), 0.05 * moved) << off[0] << " -> " << off[1] << ", joined " << on[1];
}

// The joined input gradients keep [W ; A] from step to step (W's rows copied once); the adapters' A in it must follow
// the optimizer's updates. A step (lr 1e-2: every adapter element moves), then the next forward + backward against a
// fresh model's (nothing kept) on the updated adapters: the same loss and adapter gradients (a stale A would leave
// the layers below each joined projection with the old adapter's input gradient).
TEST(CudaTrain, JoinedLoraInputGradientsFollowTheAdapterUpdates) {
  const JoiningCase c;
  const LoraAdapter lora = test::random_lora(c.base.config(), LoraExperts::PerExpert, 16);
  CudaModel gpu(c.base);
  gpu.set_train_linears(false);
  gpu.set_lora(lora);
  gpu.start_lora_optimizer(lora);
  gpu.zero_grads();
  const int64_t before = lora_joined_input_gradients();
  gpu.forward_backward(c.batch);
  EXPECT_GE(lora_joined_input_gradients() - before, 3) << "the KDA's and MLA's o and the dense MLP's down";
  gpu.lora_adamw_step(AdamWOptions{}, 1e-2, 1, 1.0, 1e9);
  LoraAdapter moved = test::without_gradients(lora);
  gpu.download_lora(moved, nullptr);
  gpu.zero_grads();
  const double loss = gpu.forward_backward(c.batch);
  LoraAdapter kept = test::without_gradients(lora);
  gpu.lora_gradients(kept);
  CudaModel fresh(c.base);
  fresh.set_train_linears(false);
  fresh.set_lora(moved);
  fresh.zero_grads();
  const double ref_loss = fresh.forward_backward(c.batch);
  LoraAdapter ref = test::without_gradients(lora);
  fresh.lora_gradients(ref);
  EXPECT_LE(std::fabs(loss - ref_loss), 1e-6 * std::fabs(ref_loss));
  expect_lora_gradients_near(ref, kept, 1e-5, "after a step");
}

// The narrow projections' input gradients in one GEMM (set_narrow_joining, the default: the KDA's g_a, b and f_a
// with their stacked LoRA group, the MLA's kv_a and q_a with theirs) against one GEMM each: the same loss and
// gradients up to the GEMMs' summation order, for a full-parameter step (every tensor, the narrow projections' weight
// gradients from their columns of the joined buffer among them; b is 2 wide in the golden, so its columns are
// padded) and for LoRA steps at rank 16 and 4 with every sub-layer kept and recomputed; with the adapters not
// stacked, nothing joins.
TEST(CudaTrain, NarrowInputGradientsMatchOneGemmEach) {
  struct Restore {
    ~Restore() { set_narrow_joining(true); }
  } restore;
  const std::string dir = test::golden_dir("bf16_stable");
  const Model m = Model::load(dir);
  const PackedBatch batch = golden_batch(dir);
  CudaModel gpu(m);
  std::array<double, 2> loss{};
  std::array<ModelWeights, 2> grads;
  for (const bool on : {false, true}) {
    set_narrow_joining(on);
    gpu.zero_grads();
    const int64_t before = narrow_joined_gradients();
    loss[on] = gpu.forward_backward(batch);
    EXPECT_EQ(narrow_joined_gradients() - before, on ? 4 : 0) << "three KDA layers and one MLA layer";
    grads[on] = gpu.gradients();
  }
  EXPECT_LE(std::fabs(loss[1] - loss[0]), 1e-6 * std::fabs(loss[0]));
  const auto e = errors(hub_gradients(m.config(), grads[1], ""), hub_gradients(m.config(), grads[0], ""));
  for (const auto& [tensor, v] : e) EXPECT_LE(v, 1e-2) << tensor;
  std::printf("[cuda narrow] full step: all tensors %.3g from one GEMM each\n", e.at("*"));
  const Model base = test::bf16_weights_reference(dir);
  for (const int rank : {16, 4})
    for (const char* policy : {"all", "none"})
      lora_switch_runs(base, batch, rank, policy, set_narrow_joining, narrow_joined_gradients,
                       [](bool on) { return on; }, 1e-5);
  // Adapters outside stacked groups add their own input gradients as their backward runs, before the GEMM that
  // writes da: the pieces then stay apart (no joined GEMM) and the gradients are the same.
  set_lora_stacking(false);
  struct RestoreStacking {
    ~RestoreStacking() { set_lora_stacking(true); }
  } restore_stacking;
  lora_switch_runs(base, batch, 4, "none", set_narrow_joining, narrow_joined_gradients,
                   [](bool) { return false; }, 1e-5);
}

// The lm_head's row blocks (set_head_block_bytes: one block on the goldens by default) cut to three rows each, the
// last one shorter: the same loss and gradients up to the head GEMMs' summation order, for a full-parameter step
// (the lm_head's weight gradient summed over the blocks among them).
TEST(CudaTrain, HeadRowBlocksGiveTheSameGradients) {
  struct Restore {
    const size_t before = head_block_bytes();
    ~Restore() { set_head_block_bytes(before); }
  } restore;
  const std::string dir = test::golden_dir("bf16_stable");
  const Model m = Model::load(dir);
  const PackedBatch batch = golden_batch(dir);
  ASSERT_GT(batch.num_tokens(), 6);
  ASSERT_NE(batch.num_tokens() % 3, 0) << "the last block should be short";
  CudaModel gpu(m);
  std::array<double, 2> loss{};
  std::array<ModelWeights, 2> grads;
  for (const bool small : {false, true}) {
    set_head_block_bytes(small ? static_cast<size_t>(3 * m.config().vocab_size * 4 + 5) : restore.before);
    gpu.zero_grads();
    loss[small] = gpu.forward_backward(batch);
    grads[small] = gpu.gradients();
  }
  EXPECT_LE(std::fabs(loss[1] - loss[0]), 1e-6 * std::fabs(loss[0]));
  const auto e = errors(hub_gradients(m.config(), grads[1], ""), hub_gradients(m.config(), grads[0], ""));
  for (const auto& [tensor, v] : e) EXPECT_LE(v, 1e-2) << tensor;
  EXPECT_LE(e.at("*"), 1e-6);  // 5.5e-8 on the H200 (2026-12-05)
  std::printf("[cuda head blocks] blocks of 3 rows: all tensors %.3g from one block\n", e.at("*"));
}

// The routed experts' weights in column blocks or tiles (set_expert_layout) are read by the TMA grouped GEMM through
// other tensor maps into the same tiles: the forward's logits and the training loss the same bits, the LoRA
// gradients the same up to the MLA keys' atomics; from one layout to the other and back to the rows, the same bits
// again, and set_weights keeps the layout. The per-expert GEMMs refuse blocked weights. At the golden's layer
// pattern with widths the tiles take (multiples of 128).
TEST(CudaTrain, ExpertWeightLayoutsGiveTheSameBits) {
  struct Restore {
    int fwd = moe_expert_gemm();
    ~Restore() { set_moe_expert_gemm(fwd), set_moe_expert_gemm_dx(-2); }
  } restore;
  set_moe_expert_gemm(5);
  ModelConfig c = Model::load(test::golden_dir("bf16_stable")).config();
  c.hidden_size = 128, c.moe_intermediate_size = 128, c.intermediate_size = 192, c.vocab_size = 512;
  const std::unique_ptr<CudaModel> gpu = CudaModel::random(c, 11);
  PackedBatch batch;
  for (const int64_t L : {150, 67}) {
    std::vector<int32_t> s(L);
    for (int64_t i = 0; i < L; ++i) s[i] = static_cast<int32_t>((i * 131 + L * 17 + i * i) % c.vocab_size);
    batch.add(s);
  }
  const LoraAdapter lora = test::random_lora(c, LoraExperts::PerExpert, 16);
  gpu->set_train_linears(false);
  gpu->set_lora(lora);
  struct Run {
    Tensor logits;
    double loss = 0;
    LoraAdapter grads;
  };
  auto run = [&] {
    Run r{gpu->forward(batch), 0.0, test::without_gradients(lora)};
    gpu->zero_grads();
    r.loss = gpu->forward_backward(batch);
    gpu->lora_gradients(r.grads);
    return r;
  };
  const Run rows = run();
  gpu->set_expert_layout(1);
  const Run blocks = run();
  gpu->set_expert_layout(2);
  const Run tiles = run();
  gpu->set_expert_layout(0);
  const Run back = run();
  for (const Run* r : {&blocks, &tiles, &back}) {
    const char* at = r == &blocks ? "column blocks" : r == &tiles ? "tiles" : "back to rows";
    ASSERT_EQ(r->logits.numel(), rows.logits.numel()) << at;
    EXPECT_EQ(std::memcmp(r->logits.ptr(), rows.logits.ptr(), rows.logits.numel() * sizeof(float)), 0) << at;
    EXPECT_EQ(r->loss, rows.loss) << at;
    expect_lora_gradients_near(rows.grads, r->grads, 1e-5, at);
  }
  // set_weights writes row-major weights; the blocked layout is restored after it.
  const Model host(c, init_weights(c, 11));
  gpu->set_weights(host);
  const Tensor rows_logits = gpu->forward(batch);
  gpu->set_expert_layout(2);
  gpu->set_weights(host);
  const Tensor blocked_logits = gpu->forward(batch);
  ASSERT_EQ(blocked_logits.numel(), rows_logits.numel());
  EXPECT_EQ(std::memcmp(blocked_logits.ptr(), rows_logits.ptr(), rows_logits.numel() * sizeof(float)), 0);
  set_moe_expert_gemm(-1);
  EXPECT_THROW(gpu->forward(batch), Error);
  EXPECT_THROW(gpu->set_expert_layout(3), Error);
}

// The device LoRA optimizer (start_lora_optimizer, lora_adamw_step, download_lora) takes the step the host's
// clip_grad_norm + AdamW::step take on the same gradients: two steps, the first clipped, the second not; the norms
// agree to 1e-9 relative and the adapters and moments to 1e-6 of each tensor's norm (fp32 ulps: the norm's double
// sums differ in order, which can move the clipping coefficient by one ulp).
TEST(CudaTrain, DeviceLoraOptimizerMatchesHost) {
  LoraOnGpu t("bf16_stable");
  const PackedBatch& batch = t.batch;
  const LoraAdapter& lora = t.lora;
  CudaModel& gpu = t.gpu;
  LoraAdapter host = test::without_gradients(lora);
  std::vector<ParamRef> params = host.params("");
  const AdamWOptions o;
  AdamW adam(params, o);
  gpu.start_lora_optimizer(lora, &adam);
  const float scale = 1.0f / 64;
  for (int step = 1; step <= 2; ++step) {
    const double max_norm = step == 1 ? 1e-4 : 1e9, lr = 1e-3 * step;
    gpu.zero_grads();
    gpu.forward_backward(batch);
    for (ParamRef& p : params) std::fill_n(p.g, p.n, 0.0f);
    gpu.lora_gradients(host);
    for (ParamRef& p : params)
      for (int64_t i = 0; i < p.n; ++i) p.g[i] *= scale;
    const double host_norm = clip_grad_norm(params, max_norm);
    adam.step(params, lr);
    const double dev_norm = gpu.lora_adamw_step(o, lr, step, scale, max_norm);
    EXPECT_NEAR(dev_norm, host_norm, 1e-9 * host_norm) << "step " << step;
    if (step == 1) {
      EXPECT_GT(host_norm, max_norm) << "the first step is to be clipped";
    }
    std::printf("[cuda lora optimizer] step %d: gradient norm %.10g (host %.10g)\n", step, dev_norm, host_norm);
  }
  LoraAdapter got = test::without_gradients(lora);
  std::vector<ParamRef> got_params = got.params("");
  AdamW state(got_params, o);
  gpu.download_lora(got, &state);
  double worst = 0;
  for (size_t k = 0; k < params.size(); ++k) {
    for (const auto& [a, b] : {std::pair<const float*, const float*>{got_params[k].w, params[k].w},
                               {state.m()[k].data(), adam.m()[k].data()},
                               {state.v()[k].data(), adam.v()[k].data()}}) {
      const double e = test::norm_rel_error(a, b, static_cast<size_t>(params[k].n));
      EXPECT_LE(e, 1e-6) << params[k].name;
      worst = std::max(worst, e);
    }
  }
  // The update moved the adapters (a test that would pass on a no-op would be no test).
  double moved = 0;
  for (size_t k = 0; k < params.size(); ++k)
    moved = std::max(moved, test::norm_rel_error(got_params[k].w,
                                                 k % 2 ? lora.modules()[k / 2].B.data.data()
                                                       : lora.modules()[k / 2].A.data.data(),
                                                 static_cast<size_t>(params[k].n)));
  EXPECT_GT(moved, 1e-4);
  std::printf("[cuda lora optimizer] %zu tensors: worst relative difference to the host %.3g; moved by %.3g\n",
              params.size(), worst, moved);
}

// With lora_update_beside the device LoRA optimizer's update runs on a stream of its own, a layer's adapters after
// another's, beside the next step's forward (which waits for each layer's update before the layer), and zero_grads
// clears the gradients it reads behind it. Three steps (lr 1e-2, so that every adapter element moves; the first
// clipped), with it and in line, from the same adapters: each step's loss agrees within 1e-6 relative (the two runs
// differ by the atomics of the MLA keys' gradients alone, while one update moves the loss by over 1e-3: a layer that
// ran on stale adapters would show), and so do the adapters and moments after them (1e-4 of each tensor's norm).
// Reading the adapters between steps (download_lora) waits for the update too.
TEST(CudaTrain, LoraUpdateBesideTheForwardGivesTheSameSteps) {
  LoraOnGpu t("bf16_stable", LoraExperts::PerExpert, 16);
  CudaModel& gpu = t.gpu;
  struct Run {
    std::array<double, 3> loss{};
    LoraAdapter lora;
    std::vector<std::vector<float>> m, v;
  };
  auto run = [&](bool beside) {
    gpu.set_lora_update_beside(beside);
    gpu.set_lora(t.lora);
    gpu.start_lora_optimizer(t.lora);
    Run r{{}, test::without_gradients(t.lora), {}, {}};
    for (int s = 0; s < 3; ++s) {
      gpu.zero_grads();
      r.loss[s] = gpu.forward_backward(t.batch);
      gpu.lora_adamw_step(AdamWOptions{}, 1e-2, s + 1, 1.0 / 64, s == 0 ? 1e-4 : 1e9);
    }
    std::vector<ParamRef> params = r.lora.params("");
    AdamW state(params, AdamWOptions{});
    gpu.download_lora(r.lora, &state);
    r.m = state.m(), r.v = state.v();
    return r;
  };
  const bool was = gpu.lora_update_beside();
  Run line = run(false), beside = run(true);
  gpu.set_lora_update_beside(was);
  ASSERT_GT(std::fabs(line.loss[1] - line.loss[0]), 1e-3 * std::fabs(line.loss[0]))
      << "the update should move the loss";
  for (int s = 0; s < 3; ++s)
    EXPECT_LE(std::fabs(beside.loss[s] - line.loss[s]), 1e-6 * std::fabs(line.loss[s])) << "step " << s;
  std::vector<ParamRef> a = line.lora.params(""), b = beside.lora.params("");
  ASSERT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t k = 0; k < a.size(); ++k) {
    const size_t n = static_cast<size_t>(a[k].n);
    for (const auto& [x, y] : {std::pair<const float*, const float*>{b[k].w, a[k].w},
                               {beside.m[k].data(), line.m[k].data()},
                               {beside.v[k].data(), line.v[k].data()}}) {
      const double e = test::norm_rel_error(x, y, n);
      EXPECT_LE(e, 1e-4) << a[k].name;
      worst = std::max(worst, e);
    }
  }
  std::printf("[cuda lora update beside] losses %.9g %.9g %.9g (in line %.9g %.9g %.9g); adapters and moments %.3g "
              "from in line\n",
              beside.loss[0], beside.loss[1], beside.loss[2], line.loss[0], line.loss[1], line.loss[2], worst);
}

// Loss masks: target weights scale each prediction's term, as on the CPU (0 drops a prompt token's prediction).
TEST(CudaTrain, TargetWeightsMatchCpu) {
  const std::string dir = test::golden_dir("bf16_stable");
  const Model cpu = test::bf16_weights_reference(dir);
  PackedBatch batch = golden_batch(dir);
  batch.target_weight.assign(batch.tokens.size(), 1.0f);
  for (size_t t = 0; t < batch.tokens.size(); ++t) {
    if (t % 3 == 0) batch.target_weight[t] = 0.0f;
    if (t % 3 == 1) batch.target_weight[t] = 0.5f;
  }
  ModelWeights ref = zeros_like(cpu.weights()), noisy = zeros_like(cpu.weights());
  const double ref_loss = model_forward_backward(cpu, batch, ref);
  model_forward_backward(perturbed(cpu), batch, noisy);
  CudaModel gpu(cpu);
  const double loss = gpu.forward_backward(batch);
  EXPECT_LE(std::fabs(loss - ref_loss) / std::fabs(ref_loss), kLossTol) << loss << " vs " << ref_loss;
  expect_within_noise("bf16_stable, target weights", cpu.config(), gpu.gradients(), ref, noisy);
}

// `nextlm grad --device cuda`: the golden sequences in one packed batch; the file holds exactly the golden's
// tensors with its shapes and dtypes, and the values of CudaModel::forward_backward on the same batch (up to the
// atomics' order, see GradientsAccumulateAndZero).
TEST(CudaTrain, GradCliWritesTheGoldenTensors) {
  const std::string dir = test::golden_dir("bf16_sharded");
  test::TempDir tmp;
  {
    std::ofstream in(tmp.str("in.jsonl"));
    for (const auto& s : test::golden_sequences(dir)) {
      in << "{\"tokens\": [";
      for (size_t i = 0; i < s.size(); ++i) in << (i ? ", " : "") << s[i];
      in << "]}\n";
    }
  }
  const test::CliResult r = test::run_nextlm("grad --device cuda --model " + test::shell_quote(dir) + " --input " +
                                             test::shell_quote(tmp.str("in.jsonl")) + " --out " +
                                             test::shell_quote(tmp.str("g.safetensors")));
  ASSERT_EQ(r.rc, 0) << r.err;
  const std::unique_ptr<CudaModel> gpu = CudaModel::load(dir);
  const double loss = gpu->forward_backward(golden_batch(dir));
  const ModelWeights g = gpu->gradients();
  std::map<std::string, const GradTensor*> mine_by_name;
  const auto named = hub_gradients(gpu->config(), g, text_prefix(Checkpoint(dir)));
  for (const GradTensor& t : named) mine_by_name[t.name] = &t;
  SafetensorsFile file(tmp.str("g.safetensors")), ref(dir + "/golden_grads.safetensors");
  ASSERT_EQ(file.buffer().tensors().size(), ref.buffer().tensors().size());
  for (const TensorView& t : ref.buffer().tensors()) {
    const TensorView* m = file.buffer().find(t.name);
    ASSERT_TRUE(m) << t.name;
    EXPECT_EQ(m->dtype, t.dtype) << t.name;
    EXPECT_EQ(m->shape, t.shape) << t.name;
    if (t.name == "loss") {
      double a;
      std::memcpy(&a, m->data, 8);
      EXPECT_EQ(a, loss);
      continue;
    }
    const std::vector<float> x = to_f32(*m);
    EXPECT_LE(test::norm_rel_error(x.data(), mine_by_name.at(t.name)->data, x.size()), 1e-2) << t.name;
  }
}


// `nextlm train --device cuda`: the fortunes example's config trained from scratch, gradients on the GPU: the loss
// falls as on the CPU, the first step's loss (same init, same batch) is the CPU's within the bf16 bound, and the
// checkpoint is a model directory `score` reads.
TEST(CudaTrain, TrainCliLearnsOnTheGpu) {
  const char* src = std::getenv("NEXTLM_SOURCE_DIR");
  const std::string config = std::string(src ? src : NEXTLM_SOURCE_DIR) + "/examples/fortunes/config.json";
  test::TempDir tmp;
  write_byte_jsonl(tmp.str("data.jsonl"),
                   {"the cat sat on the mat and the dog sat on the log.", "the cat and the dog sat on the mat.",
                    "a cat sat on a mat; a dog sat on a log.", "the dog and the cat sat on the log and the mat."});
  const std::string common = "train --config " + test::shell_quote(config) + " --data " +
                             test::shell_quote(tmp.str("data.jsonl")) +
                             " --warmup 2 --lr 1e-2 --batch-tokens 256 --seed 1 --steps 12";
  const test::CliResult gpu = test::run_nextlm(common + " --device cuda --out " + test::shell_quote(tmp.str("gpu")));
  ASSERT_EQ(gpu.rc, 0) << gpu.err;
  const test::CliResult cpu = test::run_nextlm(common + " --out " + test::shell_quote(tmp.str("cpu")));
  ASSERT_EQ(cpu.rc, 0) << cpu.err;
  const std::vector<double> g = csv_losses(tmp.str("gpu/train_log.csv")), c = csv_losses(tmp.str("cpu/train_log.csv"));
  ASSERT_EQ(g.size(), 12u);
  ASSERT_EQ(c.size(), 12u);
  EXPECT_LE(std::fabs(g[0] - c[0]) / c[0], kLossTol) << g[0] << " vs " << c[0];
  EXPECT_LT(g.back(), g.front() - 1.0) << "loss did not fall on the GPU";
  std::printf("[cuda train] loss %.4f -> %.4f on the GPU, %.4f -> %.4f on the CPU\n", g.front(), g.back(), c.front(),
              c.back());
  const test::CliResult sc = test::run_nextlm("score --model " + test::shell_quote(tmp.str("gpu/checkpoint")) +
                                              " --input " + test::shell_quote(tmp.str("data.jsonl")));
  EXPECT_EQ(sc.rc, 0) << sc.err;
}


// The input-gradient expert GEMMs' variant: by default the forward's, the TMA kernel's clusters of two as clusters of
// four on row-major weights (of two on tiles); set apart, it stays so whatever the forward's; a mode that is no
// grouped GEMM kernel is refused. The frozen experts' layout: tiles where the widths and the variants take them.
TEST(CudaTrain, MoeInputGradientGemmVariant) {
  struct Restore {
    int fwd = moe_expert_gemm();
    ~Restore() { set_moe_expert_gemm(fwd), set_moe_expert_gemm_dx(-2); }
  } restore;
  ModelConfig wide = Model::load(test::golden_dir("bf16_stable")).config(), narrow = wide;
  wide.hidden_size = 256, wide.moe_intermediate_size = 128;
  set_moe_expert_gemm(5);
  EXPECT_EQ(moe_expert_gemm_dx(), 6);
  EXPECT_EQ(moe_expert_gemm_dx(true), 5);
  EXPECT_EQ(frozen_expert_layout(wide), 2);
  EXPECT_EQ(frozen_expert_layout(narrow), 0) << "hidden 48, experts 24 wide";
  set_moe_expert_gemm(4);
  EXPECT_EQ(frozen_expert_layout(wide), 0) << "not a TMA variant";
  set_moe_expert_gemm(5);
  set_moe_expert_gemm(3);
  EXPECT_EQ(moe_expert_gemm_dx(), 3);
  set_moe_expert_gemm_dx(5);
  EXPECT_EQ(moe_expert_gemm_dx(), 5);
  set_moe_expert_gemm(6);
  EXPECT_EQ(moe_expert_gemm_dx(), 5);
  for (const int bad : {-3, -1, cuda::kGroupedGemmKernels}) EXPECT_THROW(set_moe_expert_gemm_dx(bad), Error) << bad;
  EXPECT_EQ(moe_expert_gemm_dx(), 5);
}

// LoRA on the device: the adapters' gradients from each projection's input and output gradient (the base frozen)
// against the CPU's, which come from the full weight gradient of the merged model (LoraAdapter::backward), per-expert
// and shared expert adapters, every kind the model has. B is random (a fresh B = 0 would make every dA zero). The
// bound is the bf16-noise one of the whole-model test, over the gradients of each kind's modules together.
TEST(CudaTrain, LoraGradientsMatchCpu) {
  const std::string dir = test::golden_dir("bf16_stable");
  const Model base = test::bf16_weights_reference(dir);
  const PackedBatch batch = golden_batch(dir);
  // Rank 16 per expert: the routed experts' adapters ride in their grouped GEMMs (GroupedGemm::low_rank), in the
  // forward's (fold 1) or in the input gradients' as well (fold 2); rank 4 runs them through the grouped LoRA
  // kernels after the GEMMs.
  struct Case {
    LoraExperts experts;
    int rank, fold;
  };
  struct RestoreFold {
    ~RestoreFold() { set_expert_lora_fold(2); }
  } restore;
  for (const Case& c : {Case{LoraExperts::PerExpert, 4, 1}, Case{LoraExperts::PerExpert, 16, 1},
                        Case{LoraExperts::PerExpert, 16, 2}, Case{LoraExperts::Shared, 4, 1}}) {
    const LoraExperts experts = c.experts;
    const int rank = c.rank;
    set_expert_lora_fold(c.fold);
    LoraAdapter cpu_lora = test::random_lora(base.config(), experts, rank);
    // The CPU: the merged model's full weight gradient, then the adapters' (and the same under weight noise).
    LoraAdapter noisy_lora = cpu_lora;
    const double ref_loss = test::cpu_lora_gradients(base, cpu_lora, batch);
    test::cpu_lora_gradients(perturbed(base), noisy_lora, batch);

    CudaModel gpu(base);
    gpu.set_train_linears(false);
    gpu.set_train_small(c.fold == 2);  // both ways: the small weights' gradients change nothing here
    gpu.set_lora(cpu_lora);
    LoraAdapter gpu_lora = test::without_gradients(cpu_lora);
    const double loss = gpu.forward_backward(batch);
    gpu.lora_gradients(gpu_lora);
    EXPECT_LE(std::fabs(loss - ref_loss) / std::fabs(ref_loss), kLossTol) << loss << " vs " << ref_loss;
    // Per kind: ‖Δ‖/‖ref‖ over its modules' dA and dB.
    std::map<std::string, std::array<double, 3>> by_kind;  // diff², ref², noise diff²
    for (size_t i = 0; i < cpu_lora.modules().size(); ++i) {
      const LoraModule &r = cpu_lora.modules()[i], &g = gpu_lora.modules()[i], &n = noisy_lora.modules()[i];
      auto& acc = by_kind[lora_kind_info(r.kind).group + std::string(".") + lora_kind_info(r.kind).leaf];
      for (const auto& [rt, gt, nt] : {std::tie(r.dA, g.dA, n.dA), std::tie(r.dB, g.dB, n.dB)})
        for (size_t j = 0; j < rt.data.size(); ++j) {
          ASSERT_TRUE(std::isfinite(gt.data[j]));
          acc[0] += std::pow(static_cast<double>(gt.data[j]) - rt.data[j], 2);
          acc[1] += std::pow(static_cast<double>(rt.data[j]), 2);
          acc[2] += std::pow(static_cast<double>(nt.data[j]) - rt.data[j], 2);
        }
    }
    for (const auto& [kind, acc] : by_kind) {
      ASSERT_GT(acc[1], 0.0) << kind << " has no gradient on the CPU";
      const double e = std::sqrt(acc[0] / acc[1]), spread = std::sqrt(acc[2] / acc[1]);
      EXPECT_LE(e, std::max(kGradTol, kNoiseRatio * spread)) << kind << " (bf16-noise spread " << spread << ")";
      std::printf("[cuda lora grad] %s rank %d fold %d %s: %.3g (spread %.3g)\n",
                  experts == LoraExperts::Shared ? "shared" : "per-expert", rank, c.fold, kind.c_str(), e, spread);
    }
  }
}

// `nextlm train --device cuda --lora-rank`: adapters on the bundled example model, their gradients on the GPU: the
// first step's loss is the CPU's within the bf16 bound, the loss falls, and the adapter directory is written.
TEST(CudaTrain, LoraTrainCliLearnsOnTheGpu) {
  const std::string model = test::golden_dir("tiny-glm5-next");
  test::TempDir tmp;
  write_lora_data(tmp.str("data.jsonl"));
  const std::string common = "train --model " + test::shell_quote(model) + " --data " +
                             test::shell_quote(tmp.str("data.jsonl")) +
                             " --lora-rank 8 --warmup 2 --lr 1e-2 --batch-tokens 256 --seed 1 --steps 10";
  const test::CliResult gpu = test::run_nextlm(common + " --device cuda --out " + test::shell_quote(tmp.str("gpu")));
  ASSERT_EQ(gpu.rc, 0) << gpu.err;
  const test::CliResult cpu = test::run_nextlm(common + " --out " + test::shell_quote(tmp.str("cpu")));
  ASSERT_EQ(cpu.rc, 0) << cpu.err;
  const std::vector<double> g = csv_losses(tmp.str("gpu/train_log.csv")), c = csv_losses(tmp.str("cpu/train_log.csv"));
  ASSERT_EQ(g.size(), 10u);
  ASSERT_EQ(c.size(), 10u);
  EXPECT_LE(std::fabs(g[0] - c[0]) / c[0], kLossTol) << g[0] << " vs " << c[0];
  EXPECT_LT(g.back(), g.front() - 0.1) << "loss did not fall on the GPU";
  std::printf("[cuda lora train] loss %.4f -> %.4f on the GPU, %.4f -> %.4f on the CPU\n", g.front(), g.back(),
              c.front(), c.back());
  EXPECT_TRUE(std::filesystem::exists(tmp.str("gpu/checkpoint/adapter_model.safetensors")));
}

// The device LoRA step exactly as src/cli/train.cpp plugs it into a Trainer, on a trainer that holds the base on
// the host (what `train --device cuda --lora-rank` ran before the base stayed on disk): `steps` steps from fresh
// adapters with the options `opt`, saving into each of `saves` (step → checkpoint directory). Returns the losses.
std::vector<double> host_base_device_lora(const std::string& model, const std::string& data, const TrainOptions& opt,
                                          int64_t steps, const std::map<int64_t, std::string>& saves) {
  const ModelConfig cfg = load_config(model + "/config.json");
  Trainer tr(Model::load(model), read_train_jsonl(data, cfg.vocab_size, opt.batch_tokens), opt);
  EXPECT_EQ(tr.lora_base(), LoraBase::Host);
  std::unique_ptr<CudaModel> gpu;
  int64_t gpu_version = -1;
  tr.set_gradient_fn([&](const Model&, LoraAdapter* lora, int64_t version, const PackedBatch& b, ModelWeights&) {
    if (!gpu) {
      gpu = CudaModel::load(opt.base_model);
      gpu->set_train_linears(false);
      gpu->set_recompute(opt.recompute);
      gpu->set_lora(*lora);
      gpu->start_lora_optimizer(*lora, &tr.optimizer());
    }
    if (version != gpu_version) gpu->zero_grads();
    gpu_version = version;
    return gpu->forward_backward(b);
  });
  tr.set_device_optimizer(Trainer::DeviceOptimizer{
      [&](double lr, int64_t t, double scale, double max_norm) {
        return gpu->lora_adamw_step(tr.options().adamw, lr, t, scale, max_norm);
      },
      [&](LoraAdapter& adapter, AdamW& state) {
        if (gpu) gpu->download_lora(adapter, &state);
      }});
  std::vector<double> losses;
  while (tr.steps_done() < steps) {
    losses.push_back(tr.step().loss);
    if (saves.count(tr.steps_done())) tr.save(saves.at(tr.steps_done()));
  }
  return losses;
}

// ‖a − b‖/‖b‖ over every tensor of two safetensors files together, which must hold the same names and shapes.
double file_error(const std::string& a, const std::string& b) {
  const SafetensorsFile fa(a), fb(b);
  EXPECT_EQ(fa.buffer().tensors().size(), fb.buffer().tensors().size()) << a;
  double diff = 0, ref = 0;
  for (const TensorView& t : fb.buffer().tensors()) {
    const TensorView* u = fa.buffer().find(t.name);
    if (!u || u->shape != t.shape) {
      ADD_FAILURE() << a << ": " << t.name << " missing or mis-shaped";
      return INFINITY;
    }
    const std::vector<float> x = to_f32(*u), y = to_f32(t);
    for (size_t i = 0; i < x.size(); ++i) {
      if (!std::isfinite(x[i])) return INFINITY;
      diff += (static_cast<double>(x[i]) - y[i]) * (static_cast<double>(x[i]) - y[i]);
      ref += static_cast<double>(y[i]) * y[i];
    }
  }
  return std::sqrt(diff / ref);
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

// `train --device cuda --lora-rank` keeps the base on disk (LoraBase::Disk: the host holds the adapters and their
// optimizer state, no base weight) and trains as the host-base trainer did with the same device step
// (host_base_device_lora, run here in-process): the first loss the same to the log's 9 digits (the same base and
// adapters, B = 0: the same forward), the later losses within 1e-3 and the final adapters and moments within 1e-2
// (two runs differ by the order of the backward's atomic additions, the MLA key gradients, which AdamW carries on),
// the same adapter_config.json and trainer_state.json. A checkpoint the host-base trainer wrote at step 5 resumes
// through the disk path (`train --resume` with --device cuda) to where the uninterrupted run ends, within the same
// bounds. A wrong adapter init, seed or optimizer state moves the adapters by O(1), not 1e-2.
TEST(CudaTrain, LoraTrainCliKeepsTheBaseOnDisk) {
  const std::string model = test::golden_dir("tiny-glm5-next");
  test::TempDir tmp;
  const std::string data = tmp.str("data.jsonl");
  write_lora_data(data);
  const test::CliResult disk = test::run_nextlm(
      "train --device cuda --model " + test::shell_quote(model) + " --data " + test::shell_quote(data) +
      " --lora-rank 8 --warmup 2 --lr 1e-2 --batch-tokens 64 --grad-accum 2 --seed 1 --steps 10 --out " +
      test::shell_quote(tmp.str("disk")));
  ASSERT_EQ(disk.rc, 0) << disk.err;
  EXPECT_NE(disk.err.find("read by the GPU from its checkpoint"), std::string::npos) << disk.err;
  // The CLI's own options (defaults included), as it stored them.
  const TrainOptions opt = Trainer::stored_options(tmp.str("disk/checkpoint"));
  ASSERT_TRUE(opt.lora.has_value());
  const std::vector<double> host = host_base_device_lora(
      model, data, opt, 10, {{5, tmp.str("part/checkpoint")}, {10, tmp.str("host/checkpoint")}});
  const std::vector<double> d = csv_losses(tmp.str("disk/train_log.csv"));
  ASSERT_EQ(d.size(), 10u);
  ASSERT_EQ(host.size(), 10u);
  char first[64];
  std::snprintf(first, sizeof first, "%.9g", host[0]);
  EXPECT_EQ(d[0], std::stod(first)) << "the first step's loss differs from the host-base trainer's";
  double worst = 0;
  for (size_t i = 0; i < 10; ++i) worst = std::max(worst, std::fabs(d[i] - host[i]) / host[i]);
  EXPECT_LE(worst, 1e-3);
  EXPECT_LT(d.back(), d.front() - 0.1) << "loss did not fall";
  const double adapter_err = file_error(tmp.str("disk/checkpoint/adapter_model.safetensors"),
                                        tmp.str("host/checkpoint/adapter_model.safetensors"));
  const double moment_err = file_error(tmp.str("disk/checkpoint/optimizer.safetensors"),
                                       tmp.str("host/checkpoint/optimizer.safetensors"));
  EXPECT_LE(adapter_err, 1e-2);
  EXPECT_LE(moment_err, 1e-2);
  for (const char* f : {"adapter_config.json", "trainer_state.json"})
    EXPECT_EQ(read_text(tmp.str("disk/checkpoint/") + f), read_text(tmp.str("host/checkpoint/") + f)) << f;
  std::printf("[cuda lora disk] losses %.4f -> %.4f (host base %.4f -> %.4f), worst relative loss difference %.3g; "
              "adapters %.3g, moments %.3g\n",
              d.front(), d.back(), host.front(), host.back(), worst, adapter_err, moment_err);

  // Resume the host-base trainer's step-5 checkpoint through the disk path.
  const test::CliResult res = test::run_nextlm("train --device cuda --resume " + test::shell_quote(tmp.str("part")) +
                                               " --out " + test::shell_quote(tmp.str("part")) + " --data " +
                                               test::shell_quote(data));
  ASSERT_EQ(res.rc, 0) << res.err;
  EXPECT_NE(res.err.find("read by the GPU from its checkpoint"), std::string::npos) << res.err;
  const std::vector<double> r = csv_losses(tmp.str("part/train_log.csv"));
  ASSERT_EQ(r.size(), 5u);
  double worst_resumed = 0;
  for (size_t i = 0; i < 5; ++i) worst_resumed = std::max(worst_resumed, std::fabs(r[i] - host[5 + i]) / host[5 + i]);
  EXPECT_LE(worst_resumed, 1e-3);
  const double resumed_err = file_error(tmp.str("part/checkpoint/adapter_model.safetensors"),
                                        tmp.str("host/checkpoint/adapter_model.safetensors"));
  EXPECT_LE(resumed_err, 1e-2);
  EXPECT_EQ(read_text(tmp.str("part/checkpoint/trainer_state.json")),
            read_text(tmp.str("host/checkpoint/trainer_state.json")));
  std::printf("[cuda lora disk] resumed at step 5: worst relative loss difference %.3g, adapters %.3g\n",
              worst_resumed, resumed_err);
}

// forward_backward from zeroed gradients with a mode of the model off, then on (set(false), set(true)): the loss
// and the gradients of each, indexed by the mode.
struct OffOn {
  std::array<double, 2> loss{};
  std::array<ModelWeights, 2> grads;
};
OffOn off_then_on(CudaModel& gpu, const PackedBatch& batch, const std::function<void(bool)>& set) {
  OffOn r;
  for (const bool on : {false, true}) {
    set(on);
    gpu.zero_grads();
    r.loss[on] = gpu.forward_backward(batch);
    r.grads[on] = gpu.gradients();
  }
  return r;
}

// Independent work on the side stream (set_train_overlap: the MoE's shared expert beside the routing and the routed
// experts, the KDA layer's output gate beside its recurrence, the DSA layer's indexer beside its projections) runs
// the same kernels on the same data: the loss is the same bits; the gradients are the same up to the atomics that
// separate two runs of one setting (embedding, MLA keys: GradientsAccumulateAndZero), and the last layer's MoE, which
// the backward reaches before any atomics, the same bits. Full-parameter with every sub-layer kept and recomputed,
// and a LoRA step (one adapter per routed expert, folded into the grouped GEMMs at rank 16). The golden's layers:
// three KDA, then a DSA layer with its own indexer; a dense MLP, then three MoE.
TEST(CudaTrain, TrainOverlapGivesTheSameResults) {
  const std::string dir = test::golden_dir("bf16_stable");
  const Model m = Model::load(dir);
  const ModelConfig& c = m.config();
  ASSERT_GT(c.n_shared_experts, 0);
  ASSERT_EQ(c.mlp_layer_types.back(), MlpType::Sparse) << "the last layer's MoE is compared bit for bit";
  const std::string last_moe = "layers." + std::to_string(c.num_hidden_layers - 1) + ".mlp.";
  const PackedBatch batch = golden_batch(dir);
  CudaModel gpu(m);
  for (const char* policy : {"none", "kda,mla,moe,mhc"}) {
    gpu.set_recompute(parse_recompute(policy));
    const OffOn r = off_then_on(gpu, batch, [&](bool on) { gpu.set_train_overlap(on); });
    EXPECT_EQ(r.loss[1], r.loss[0]) << policy;
    const auto e = errors(hub_gradients(c, r.grads[1], ""), hub_gradients(c, r.grads[0], ""));
    int last = 0;
    for (const auto& [tensor, v] : e) {
      EXPECT_LE(v, 1e-2) << policy << ": " << tensor;
      if (tensor.find(last_moe) == std::string::npos) continue;
      EXPECT_EQ(v, 0.0) << policy << ": " << tensor;
      ++last;
    }
    EXPECT_GT(last, 0) << "no tensor named " << last_moe;
    std::printf("[cuda train overlap] --recompute %s: all tensors %.3g from the step in line\n", policy,
                e.at("*"));
  }
  LoraOnGpu t("bf16_stable", LoraExperts::PerExpert, 16);
  std::array<double, 2> loss{};
  std::array<LoraAdapter, 2> grads{test::without_gradients(t.lora), test::without_gradients(t.lora)};
  for (const bool on : {false, true}) {
    t.gpu.set_train_overlap(on);
    t.gpu.zero_grads();
    loss[on] = t.gpu.forward_backward(t.batch);
    t.gpu.lora_gradients(grads[on]);
  }
  EXPECT_EQ(loss[1], loss[0]);
  expect_lora_gradients_near(grads[0], grads[1], 1e-4, "LoRA, overlapped");
}

// A kept KDA site's forward keeping the recurrence's chunk states and v_new for the chunked backward
// (set_kda_keep_states) against the backward forming them again. The goldens' KDA head dim (16) takes the recurrent
// backward, so this runs the golden's layer pattern at head dim 64 (the chunked backward's) with random weights and
// sequences of several chunks, partial ones too, full-parameter. The loss is the same bits (the forward computes the
// same values either way). The gradients move by the rounding that separates the two computations of the states (the
// forward's v_new from its bf16 U, the backward's from fp32 U; not zero, which shows the kept states were taken),
// each tensor within the CUDA golden bound, and the kept states' gradients are no further from the CPU's fp32 ones on
// the same (bf16-rounded) weights than the recomputed states' (both 4.5 % on an H100: the bf16 model's noise).
// Recomputed sites keep nothing: under the recomputing policy the two runs are the same computation. The policy's
// states component is the switch's off, and --recompute auto's rung after none.
TEST(CudaTrain, KdaKeptStatesGiveCloseGradients) {
  ModelConfig c = Model::load(test::golden_dir("bf16_stable")).config();
  c.hidden_size = 128, c.moe_intermediate_size = 128, c.intermediate_size = 192, c.vocab_size = 512;
  c.linear_head_dim = 64;
  const Model cpu = test::bf16_weights_reference(Model(c, init_weights(c, 13)));
  PackedBatch batch;
  for (const int64_t L : {150, 67, 128}) {
    std::vector<int32_t> s(L);
    for (int64_t i = 0; i < L; ++i) s[i] = static_cast<int32_t>((i * 131 + L * 17 + i * i) % c.vocab_size);
    batch.add(s);
  }
  ModelWeights ref = zeros_like(cpu.weights());
  model_forward_backward(cpu, batch, ref);
  CudaModel gpu(cpu);
  ASSERT_TRUE(gpu.kda_on_tensor_cores());
  ASSERT_TRUE(gpu.kda_keep_states()) << "on by default";
  ModelWeights without_states;  // the gradients under none with set_kda_keep_states(false)
  for (const char* policy : {"none", "kda,mla,moe,mhc"}) {
    gpu.set_recompute(parse_recompute(policy));
    const OffOn r = off_then_on(gpu, batch, [&](bool on) { gpu.set_kda_keep_states(on); });
    EXPECT_EQ(r.loss[1], r.loss[0]) << policy;
    const auto e = errors(hub_gradients(c, r.grads[1], ""), hub_gradients(c, r.grads[0], ""));
    const auto e_on = errors(hub_gradients(c, r.grads[1], ""), hub_gradients(c, ref, ""));
    const auto e_off = errors(hub_gradients(c, r.grads[0], ""), hub_gradients(c, ref, ""));
    for (const auto& [tensor, v] : e) EXPECT_LE(v, kGradTol) << policy << ": " << tensor;
    EXPECT_LE(e_on.at("*"), 1.25 * e_off.at("*") + 1e-4) << policy;
    std::string q0;  // the first KDA layer's q projection, whatever the checkpoint's prefix
    for (const auto& [tensor, v] : e)
      if (tensor.find("layers.0.self_attn.q_proj.weight") != std::string::npos) q0 = tensor;
    ASSERT_FALSE(q0.empty()) << "no tensor layers.0.self_attn.q_proj.weight";
    if (std::string(policy) == "none") EXPECT_GT(e.at(q0), 0.0) << "the kept states were not taken";
    else EXPECT_LE(e.at("*"), 1e-5) << "a recomputed site keeps nothing";
    std::printf("[cuda kda kept states] --recompute %s: all tensors %.3g (%s %.3g) from the step without; from the "
                "CPU %.3g with, %.3g without\n",
                policy, e.at("*"), q0.c_str(), e.at(q0), e_on.at("*"), e_off.at("*"));
    if (std::string(policy) == "none") without_states = r.grads[0];
  }
  gpu.set_kda_keep_states(true);

  // The policy's states (recomputed): the step without kept states, in less memory; --recompute auto falls back to
  // it from none when that memory is what does not fit (the rung before kda,mla,moe,mhc).
  auto run = [&](const RecomputePolicy& p) {
    gpu.set_recompute(p);
    gpu.zero_grads();
    const double loss = gpu.forward_backward(batch);
    return std::make_pair(loss, gpu.gradients());
  };
  const auto none = run(parse_recompute("none"));
  const size_t none_peak = gpu.activation_peak();
  const auto states = run(parse_recompute("states"));
  const size_t states_peak = gpu.activation_peak();
  ASSERT_LT(states_peak, none_peak) << "the states take memory";
  EXPECT_EQ(states.first, none.first);
  EXPECT_LE(errors(hub_gradients(c, states.second, ""), hub_gradients(c, without_states, "")).at("*"), 1e-5)
      << "states: the step without kept states";
  gpu.set_activation_limit((states_peak + none_peak) / 2);
  const auto fell = run(auto_recompute());
  RecomputePolicy rung = parse_recompute("states");
  rung.adaptive = true;
  EXPECT_EQ(gpu.recompute(), rung) << "auto's rung after none: states";
  EXPECT_EQ(fell.first, none.first);
  EXPECT_LE(errors(hub_gradients(c, fell.second, ""), hub_gradients(c, states.second, "")).at("*"), 1e-5);
  gpu.set_activation_limit(0);
  std::printf("[cuda kda kept states] activations: none %.1f MiB, states %.1f MiB\n", none_peak / 1048576.0,
              states_peak / 1048576.0);
}

// A LoRA step (the mHC frozen) with the post-mix's dh term formed inside the pre-mix's dh kernel, against the
// post-mix's backward writing it: the same loss and the same adapter gradients, bit for bit, kept or recomputed.
TEST(CudaTrain, MhcMixFoldGivesTheSameBits) {
  LoraOnGpu t("bf16_stable", LoraExperts::PerExpert, 16);
  ASSERT_LE(t.base.config().hc_mult, 4) << "the fold runs at hc_mult <= 4";
  const bool was = mhc_mix_fold();
  for (const char* policy : {"none", "kda,mla,moe,mhc"}) {
    t.gpu.set_recompute(parse_recompute(policy));
    std::array<double, 2> loss{};
    std::array<LoraAdapter, 2> grads{test::without_gradients(t.lora), test::without_gradients(t.lora)};
    for (const bool on : {false, true}) {
      set_mhc_mix_fold(on);
      t.gpu.zero_grads();
      loss[on] = t.gpu.forward_backward(t.batch);
      t.gpu.lora_gradients(grads[on]);
    }
    EXPECT_EQ(loss[1], loss[0]) << policy;
    expect_lora_gradients_equal(grads[0], grads[1], policy);
  }
  set_mhc_mix_fold(was);
}

// The forward's mHC post-mix fused with the next site's projection (mhc_post_fusion) gives the same bits: a LoRA
// step's loss and every adapter gradient, with every site kept and with the attention and MoE sites recomputed
// (their mix kept, so that the fused kernel still makes the next site's partials), and the prefill's logits. At
// D = 1024 (random weights of the golden's layout), the narrowest width the fused kernel takes; counters show
// that it ran at every site but the last.
TEST(CudaTrain, MhcPostFusionGivesTheSameBits) {
  struct Restore {
    bool on = mhc_post_fusion();
    ~Restore() { set_mhc_post_fusion(on); }
  } restore;
  ModelConfig c = Model::load(test::golden_dir("bf16_stable")).config();
  c.hidden_size = 1024, c.vocab_size = 1024;
  const std::unique_ptr<CudaModel> gpu = CudaModel::random(c, 11);
  const int64_t V = c.vocab_size, sites = 2 * c.num_hidden_layers;
  PackedBatch batch;
  for (const int64_t L : {150, 61}) {
    std::vector<int32_t> seq(L);
    for (int64_t i = 0; i < L; ++i) seq[i] = static_cast<int32_t>((i * 131 + L * 7 + i * i) % V);
    batch.add(seq);
  }
  const LoraAdapter lora = test::random_lora(c, LoraExperts::PerExpert, 16);
  gpu->set_train_linears(false);
  gpu->set_train_small(false);
  gpu->set_lora(lora);
  for (const char* policy : {"none", "kda,mla,moe"}) {
    const std::string at = std::string("--recompute ") + policy;
    gpu->set_recompute(parse_recompute(policy));
    std::array<double, 2> loss{};
    std::array<LoraAdapter, 2> grads{test::without_gradients(lora), test::without_gradients(lora)};
    std::array<int64_t, 2> fused{};
    for (const bool on : {false, true}) {
      set_mhc_post_fusion(on);
      const int64_t before = mhc_fused_posts();
      gpu->zero_grads();
      loss[on] = gpu->forward_backward(batch);
      gpu->lora_gradients(grads[on]);
      fused[on] = mhc_fused_posts() - before;
    }
    EXPECT_EQ(fused[0], 0) << at;
    EXPECT_EQ(fused[1], sites - 1) << at;
    EXPECT_TRUE(std::isfinite(loss[0])) << at;
    EXPECT_EQ(loss[1], loss[0]) << at;
    expect_lora_gradients_equal(grads[0], grads[1], at);
  }
  std::array<Tensor, 2> logits;
  for (const bool on : {false, true}) {
    set_mhc_post_fusion(on);
    const int64_t before = mhc_fused_posts();
    logits[on] = gpu->forward(batch);
    EXPECT_EQ(mhc_fused_posts() - before, on ? sites - 1 : 0) << "the prefill's post-mixes";
  }
  ASSERT_EQ(logits[1].numel(), logits[0].numel());
  EXPECT_EQ(std::memcmp(logits[1].ptr(), logits[0].ptr(), logits[0].numel() * sizeof(float)), 0);
}

}  // namespace
}  // namespace nextlm
