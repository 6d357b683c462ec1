// The tensor- and expert-parallel device model (CudaShard, src/dist/cuda_parallel.h) against the same model on one
// GPU: per-token log-probabilities of the golden checkpoints at TP2, EP2 and TP2·EP2, each rank reading its slices
// from the checkpoint. On a single GPU the two ranks are threads sharing GPU 0 and their collectives go through the
// host (StagedComm below: the sharded math, not NCCL); with two GPUs the ranks get one GPU each and NCCL, as
// `score --device cuda --tp 2` runs. Part of test_cuda (label gpu), built with NCCL.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <optional>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "cuda/device_model.h"
#include "dist/cuda_parallel.h"
#include "dist/parallel_model.h"
#include "dist/parallel_train.h"
#include "dist/thread_comm.h"
#include "io/safetensors.h"
#include "model/lora.h"
#include "model/model.h"
#include "model/recompute.h"
#include "model/train.h"
#include "model/trainer.h"
#include "test_util.h"

namespace nextlm {
namespace {

using test::csv_losses;

// Device-buffer collectives through a host communicator: waits for the model's stream, copies to the host, reduces
// there, copies back. Only the reductions a sharded CudaModel uses.
class StagedComm final : public dist::Comm {
 public:
  StagedComm(dist::Comm& host, cudaStream_t st) : host_(host), st_(st) {}
  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }
  const char* backend() const override { return "staged"; }
  void all_reduce_sum(float* x, size_t n) override { reduce(x, n, false); }
  void all_reduce_max(float* x, size_t n) override { reduce(x, n, true); }
  void all_gather(const void*, size_t, void*) override { fail("StagedComm: all_gather"); }
  void all_gatherv(const void*, void*, const std::vector<size_t>&) override { fail("StagedComm: all_gatherv"); }
  void all_to_allv(const void*, const std::vector<size_t>&, void*, const std::vector<size_t>&) override {
    fail("StagedComm: all_to_allv");
  }
  void broadcast(void*, size_t, int) override { fail("StagedComm: broadcast"); }
  void barrier() override { host_.barrier(); }
  std::unique_ptr<dist::Comm> split(int, int) override { fail("StagedComm: split"); }

 private:
  void reduce(float* x, size_t n, bool max) {
    // Both copies on the model's stream (non-blocking: a plain cudaMemcpy to the device may return before its DMA
    // lands, and that stream would not wait for it), each waited for before h is read or freed.
    std::vector<float> h(n);
    ASSERT_EQ(cudaMemcpyAsync(h.data(), x, n * sizeof(float), cudaMemcpyDeviceToHost, st_), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(st_), cudaSuccess);
    if (max) {
      host_.all_reduce_max(h.data(), n);
    } else {
      host_.all_reduce_sum(h.data(), n);
    }
    ASSERT_EQ(cudaMemcpyAsync(x, h.data(), n * sizeof(float), cudaMemcpyHostToDevice, st_), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(st_), cudaSuccess);
  }
  dist::Comm& host_;
  cudaStream_t st_;
};

PackedBatch test_batch(int64_t vocab) {
  PackedBatch b;
  for (int64_t L : {1, 5, 63, 65, 150, 300}) {
    std::vector<int32_t> s(L);
    for (int64_t i = 0; i < L; ++i) s[i] = static_cast<int32_t>((i * 37 + L * 11 + i * i) % vocab);
    b.add(s);
  }
  return b;
}

// The "logprobs" arrays of score's JSONL output, one per line.
std::vector<std::vector<double>> read_score_jsonl(const std::string& path) {
  std::vector<std::vector<double>> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(nlohmann::json::parse(line).at("logprobs").get<std::vector<double>>());
  return out;
}

struct Layout {
  int tp, ep;
  int replicas = 1;  // data-parallel replicas of lcm(tp, ep) ranks (LoRA training)
};
std::string layout_name(const Layout& l) {
  return (l.replicas > 1 ? "dp" + std::to_string(l.replicas) + "_" : "") + "tp" + std::to_string(l.tp) + "_ep" +
         std::to_string(l.ep);
}

// Runs fn(world, model) on every rank of a layout (threads) with the rank's slices of the checkpoint in DIR loaded:
// `nccl`: one GPU per rank and NCCL (one replica), else every rank on GPU 0 with StagedComm.
void run_layout(const std::string& dir, Layout l, bool nccl,
                const std::function<void(dist::Comm& world, CudaModel& model)>& fn) {
  const int ranks = std::lcm(l.tp, l.ep) * l.replicas;
  if (nccl) {
    ASSERT_EQ(l.replicas, 1) << "run_gpu_ranks runs one replica";
    dist::run_gpu_ranks(l.tp, l.ep, [&](dist::Comm& world, int device) {
      dist::CudaRank r = dist::make_cuda_rank(world, l.tp, l.ep, device, [&](const CudaShard& s, int dev) {
        return CudaModel::load(dir, dev, s);
      });
      fn(world, *r.model);
    });
    return;
  }
  dist::run_ranks(ranks, [&](dist::Comm& world) {
    const int w = world.rank();
    const CudaShard shard = dist::cuda_shard(w, ranks, l.tp, l.ep, /*replicas=*/true);
    std::unique_ptr<CudaModel> m = CudaModel::load(dir, 0, shard);
    auto st = static_cast<cudaStream_t>(m->stream());
    std::unique_ptr<dist::Comm> tp_host = world.split(w / l.tp, w), ep_host = world.split(w / l.ep, w);
    StagedComm tp(*tp_host, st), ep(*ep_host, st);
    m->set_collectives(l.tp > 1 ? &tp : nullptr, l.ep > 1 ? (l.ep == l.tp ? &tp : &ep) : nullptr);
    fn(world, *m);
  });
}

// Every rank's log-probs of a layout.
std::vector<std::vector<std::vector<double>>> parallel_logprobs(const std::string& dir, Layout l, bool nccl,
                                                                const PackedBatch& batch) {
  std::vector<std::vector<std::vector<double>>> out(std::lcm(l.tp, l.ep));
  run_layout(dir, l, nccl, [&](dist::Comm& world, CudaModel& m) { out[world.rank()] = m.next_token_logprobs(batch); });
  return out;
}

struct Diff {
  double mean = 0, max = 0;
};
Diff compare(const std::vector<std::vector<double>>& got, const std::vector<std::vector<double>>& want) {
  Diff d;
  size_t n = 0;
  EXPECT_EQ(got.size(), want.size());
  for (size_t s = 0; s < got.size() && s < want.size(); ++s) {
    EXPECT_EQ(got[s].size(), want[s].size());
    for (size_t t = 0; t < got[s].size() && t < want[s].size(); ++t) {
      EXPECT_TRUE(std::isfinite(got[s][t]));
      const double e = std::fabs(got[s][t] - want[s][t]);
      d.mean += e, d.max = std::max(d.max, e), ++n;
    }
  }
  d.mean /= std::max<size_t>(n, 1);
  return d;
}

const std::vector<Layout> kLayouts = {{2, 1}, {1, 2}, {2, 2}};

// The split changes only summation orders (each rank's partial o_proj / down_proj sums in fp32, then their sum; the
// experts' outputs added per rank), which moves bf16 roundings of the activations downstream, and with them, now
// and then, a routing or indexer choice: the split model's log-probs differ from one GPU's by bf16 noise of the
// same kind as one GPU's own from the fp32 CPU reference. The bound: the split model is as close to the fp32
// reference as one GPU is (mean |Δlogprob| within 1.25×, worst token within 2×, plus 1e-4). Every rank must report
// the same values bit for bit (they reduce the same sums).
void check_layouts(bool nccl) {
  for (const std::string& name : test::golden_cases()) {
    const std::string dir = test::golden_dir(name);
    const Model cpu = test::bf16_weights_reference(dir);
    const PackedBatch batch = test_batch(cpu.config().vocab_size);
    const auto ref = cpu.next_token_logprobs(cpu.forward_hidden(batch), batch);
    const std::unique_ptr<CudaModel> one = CudaModel::load(dir);
    const auto single = one->next_token_logprobs(batch);
    const Diff d1 = compare(single, ref);
    for (const Layout& l : kLayouts) {
      const auto got = parallel_logprobs(dir, l, nccl, batch);
      for (size_t r = 1; r < got.size(); ++r) EXPECT_EQ(got[r], got[0]) << name << " " << layout_name(l);
      const Diff d = compare(got[0], ref), between = compare(got[0], single);
      std::printf("[cuda parallel%s] %s %s: vs fp32 CPU mean |dlogprob| %.3g max %.3g (one GPU: %.3g, %.3g); vs one "
                  "GPU mean %.3g max %.3g\n",
                  nccl ? " nccl" : "", name.c_str(), layout_name(l).c_str(), d.mean, d.max, d1.mean, d1.max,
                  between.mean, between.max);
      EXPECT_LE(d.mean, 1.25 * d1.mean + 1e-4) << name << " " << layout_name(l);
      EXPECT_LE(d.max, 2.0 * d1.max + 1e-4) << name << " " << layout_name(l);
    }
  }
}

// ‖a − b‖/‖b‖ over all the trainable tensors at once.
double grad_error(const ModelConfig& c, const ModelWeights& a, const ModelWeights& b) {
  const auto x = hub_gradients(c, a, ""), y = hub_gradients(c, b, "");
  EXPECT_EQ(x.size(), y.size());
  double d = 0, r = 0;
  for (size_t i = 0; i < std::min(x.size(), y.size()); ++i) {
    EXPECT_EQ(x[i].name, y[i].name);
    EXPECT_EQ(x[i].shape, y[i].shape) << x[i].name;
    for (size_t j = 0; j < Tensor::count(y[i].shape); ++j) {
      EXPECT_TRUE(std::isfinite(x[i].data[j])) << x[i].name;
      d += (static_cast<double>(x[i].data[j]) - y[i].data[j]) * (static_cast<double>(x[i].data[j]) - y[i].data[j]);
      r += static_cast<double>(y[i].data[j]) * y[i].data[j];
    }
  }
  return std::sqrt(d / r);
}

// Training on a split model: each rank's slices' gradients, gathered into the checkpoint's full tensors
// (dist::gather_gradients, as the CPU's parallel grad does), are as close to the fp32 CPU gradients as one GPU's
// (all tensors at once within 1.25×, plus 1e-3), and so is the loss (within 1.25×, plus 1e-4 relative).
void check_gradients(bool nccl) {
  for (const std::string& name : {std::string("bf16_sharded"), std::string("tiny-glm5-next")}) {
    const std::string dir = test::golden_dir(name);
    const Model cpu = test::bf16_weights_reference(dir);
    PackedBatch batch;
    for (const auto& s : test::golden_sequences(dir)) batch.add(s);
    ModelWeights ref = zeros_like(cpu.weights());
    const double loss_cpu = model_forward_backward(cpu, batch, ref);
    const std::unique_ptr<CudaModel> one = CudaModel::load(dir);
    const double loss1 = one->forward_backward(batch);
    const double e1 = grad_error(cpu.config(), one->gradients(), ref);
    for (const Layout& l : kLayouts) {
      ModelWeights full;
      double loss = 0;
      run_layout(dir, l, nccl, [&](dist::Comm& world, CudaModel& m) {
        const double lo = m.forward_backward(batch);
        const ModelWeights mine = m.gradients();
        dist::Mesh mesh(world, dist::ParallelOptions{l.tp, l.ep});
        dist::ShardedModel sm;
        sm.config = m.config();
        ModelWeights g = dist::gather_gradients(sm, mesh, mine);
        if (world.rank() == 0) full = std::move(g), loss = lo;
      });
      const double e = grad_error(cpu.config(), full, ref), between = grad_error(cpu.config(), full, one->gradients());
      std::printf("[cuda parallel%s grad] %s %s: loss %.6f (one GPU %.6f, fp32 CPU %.6f); all tensors vs fp32 CPU "
                  "%.3g (one GPU %.3g), vs one GPU %.3g\n",
                  nccl ? " nccl" : "", name.c_str(), layout_name(l).c_str(), loss, loss1, loss_cpu, e, e1, between);
      EXPECT_LE(std::fabs(loss - loss_cpu), 1.25 * std::fabs(loss1 - loss_cpu) + 1e-4 * std::fabs(loss_cpu))
          << name << " " << layout_name(l);
      EXPECT_LE(e, 1.25 * e1 + 1e-3) << name << " " << layout_name(l);
    }
  }
}

TEST(CudaParallel, ShardedModelMatchesOneGpuThroughHostCollectives) { check_layouts(false); }

TEST(CudaParallel, ShardedModelMatchesOneGpuOverNccl) {
  if (dist::cuda_device_count() < 2) GTEST_SKIP() << "needs 2 GPUs (the host-collective test covers the math)";
  check_layouts(true);
}

// ‖a − b‖/‖b‖ over every module's dA and dB.
double lora_error(const LoraAdapter& a, const LoraAdapter& b) {
  double d = 0, r = 0;
  for (size_t i = 0; i < b.modules().size(); ++i) {
    const LoraModule &p = a.modules()[i], &q = b.modules()[i];
    for (const auto& [x, y] : {std::tie(p.dA, q.dA), std::tie(p.dB, q.dB)})
      for (size_t j = 0; j < y.data.size(); ++j) {
        EXPECT_TRUE(std::isfinite(x.data[j]));
        d += (static_cast<double>(x.data[j]) - y.data[j]) * (static_cast<double>(x.data[j]) - y.data[j]);
        r += static_cast<double>(y.data[j]) * y.data[j];
      }
  }
  return std::sqrt(d / r);
}

// LoRA on a split model (rank 4 on every projection, one adapter per expert or one for all; and rank 16 per
// expert, whose routed experts' adapters ride in the grouped GEMMs): each rank keeps its part of every module; the
// ranks' shares of the adapters' gradients, summed over the world, are as close to the fp32 CPU's (from the merged
// model's weight gradients) as one GPU's are (within 1.25×, plus 1e-3).
void check_lora(bool nccl) {
  const std::string dir = test::golden_dir("bf16_sharded");
  const Model base = test::bf16_weights_reference(dir);
  PackedBatch batch;
  for (const auto& s : test::golden_sequences(dir)) batch.add(s);
  for (const auto& [experts, rank] : {std::pair{LoraExperts::PerExpert, 4}, std::pair{LoraExperts::PerExpert, 16},
                                     std::pair{LoraExperts::Shared, 4}}) {
    LoraAdapter ref = test::random_lora(base.config(), experts, rank);
    const LoraAdapter start = test::without_gradients(ref);
    test::cpu_lora_gradients(base, ref, batch);
    const std::unique_ptr<CudaModel> one = CudaModel::load(dir);
    one->set_train_linears(false);
    one->set_lora(start);
    one->forward_backward(batch);
    LoraAdapter single = start;
    one->lora_gradients(single);
    const double e1 = lora_error(single, ref);
    for (const Layout& l : kLayouts) {
      LoraAdapter got = start;
      run_layout(dir, l, nccl, [&](dist::Comm& world, CudaModel& m) {
        m.set_train_linears(false);
        m.set_lora(start);
        m.forward_backward(batch);
        LoraAdapter mine = start;
        m.lora_gradients(mine);
        for (LoraModule& x : mine.modules())
          for (Tensor* t : {&x.dA, &x.dB}) world.all_reduce_sum(t->ptr(), t->data.size());
        if (world.rank() == 0) got = std::move(mine);
      });
      const double e = lora_error(got, ref), between = lora_error(got, single);
      std::printf("[cuda parallel%s lora] %s rank %d %s: adapters' gradients vs fp32 CPU %.3g (one GPU %.3g), vs "
                  "one GPU %.3g\n",
                  nccl ? " nccl" : "", experts == LoraExperts::Shared ? "shared experts" : "per expert", rank,
                  layout_name(l).c_str(), e, e1, between);
      EXPECT_LE(e, 1.25 * e1 + 1e-3) << layout_name(l);
    }
  }
}

TEST(CudaParallel, ShardedLoraThroughHostCollectives) { check_lora(false); }

TEST(CudaParallel, ShardedLoraOverNccl) {
  if (dist::cuda_device_count() < 2) GTEST_SKIP() << "needs 2 GPUs (the host-collective test covers the math)";
  check_lora(true);
}

// `train --device cuda --tp/--ep --lora-rank` on one GPU: every rank of a layout (threads sharing GPU 0, host
// collectives) runs its own trainer on the same data, as every process does under mpirun, with its micro-batches'
// gradients from a LoraGpuRanks over its shard (the CLI's threads run the same micro_batch on a RankPool). Three AdamW
// steps of two micro-batches, per-expert adapters and shared ones, at TP2, EP2, TP2·EP2 and with two data-parallel
// replicas (alone and of TP2): the ranks end with bit-identical adapters (each trainer's AdamW gets the same summed
// gradients), and the losses and adapters are as close to the fp32 CPU trainer's as those of the same trainer whose
// gradients one GPU computes (within 1.25×, plus 1e-3).
TEST(CudaParallel, ShardedLoraTrainerMatchesOneGpu) {
  const std::string dir = test::golden_dir("bf16_sharded");
  const ModelConfig cfg = load_config(dir + "/config.json");
  const std::vector<TrainExample> data = test::synthetic_examples({20, 57, 94, 131, 168, 205}, cfg.vocab_size);
  for (const LoraExperts experts : {LoraExperts::PerExpert, LoraExperts::Shared}) {
    const std::string what = experts == LoraExperts::Shared ? "shared experts" : "per expert";
    TrainOptions opt;
    opt.steps = 3;
    opt.warmup = 1;
    opt.batch_tokens = 256;
    opt.grad_accum = 2;
    opt.adamw.lr = 1e-2;
    opt.recompute = default_recompute();
    LoraOptions lo;
    lo.rank = 4;
    lo.alpha = 8;
    lo.experts = experts;
    opt.lora = lo;
    opt.base_model = dir;
    auto train = [&](Trainer& tr, std::vector<double>& losses) {
      for (int s = 0; s < opt.steps; ++s) losses.push_back(tr.step().loss);
    };
    // How the CLI's GPUs run a LoRA step (src/cli/train.cpp).
    auto prepare = [&](CudaModel& m) {
      m.set_train_linears(false);
      m.set_train_small(false);
      m.set_recompute(opt.recompute);
    };

    Trainer cpu(test::bf16_weights_reference(dir), data, opt);
    std::vector<double> cpu_losses;
    train(cpu, cpu_losses);
    const std::vector<float> ref = test::adapter_values(*cpu.lora());

    Trainer one(cfg, read_tensor_shapes(dir), data, opt);
    const std::unique_ptr<CudaModel> gpu = CudaModel::load(dir);
    prepare(*gpu);
    std::optional<int64_t> uploaded;
    one.set_gradient_fn([&](const Model&, LoraAdapter* lora, int64_t version, const PackedBatch& b, ModelWeights&) {
      if (uploaded != version) gpu->set_lora(*lora);
      uploaded = version;
      gpu->zero_grads();
      const double loss = gpu->forward_backward(b);
      gpu->lora_gradients(*lora);
      return loss;
    });
    std::vector<double> one_losses;
    train(one, one_losses);
    const std::vector<float> one_values = test::adapter_values(*one.lora());
    ASSERT_EQ(one_values.size(), ref.size());
    const double e1 = test::norm_rel_error(one_values.data(), ref.data(), ref.size());

    for (const Layout& l : {Layout{2, 1}, Layout{1, 2}, Layout{2, 2}, Layout{1, 1, 2}, Layout{2, 1, 2}}) {
      const int ranks = std::lcm(l.tp, l.ep) * l.replicas;
      std::vector<std::vector<double>> losses(ranks);
      std::vector<std::vector<float>> values(ranks);
      run_layout(dir, l, false, [&](dist::Comm& world, CudaModel& m) {
        prepare(m);
        Trainer tr(cfg, read_tensor_shapes(dir), data, opt);
        dist::LoraGpuRanks lora_ranks(world, m);
        tr.set_gradient_fn([&](const Model&, LoraAdapter* lora, int64_t version, const PackedBatch& b,
                               ModelWeights&) { return lora_ranks.micro_batch(*lora, version, b); });
        train(tr, losses[world.rank()]);
        values[world.rank()] = test::adapter_values(*tr.lora());
      });
      ASSERT_EQ(values[0].size(), ref.size());
      const double e = test::norm_rel_error(values[0].data(), ref.data(), ref.size());
      std::printf("[cuda parallel lora trainer] %s %s: adapters after %d steps vs fp32 CPU %.3g (one GPU %.3g); "
                  "losses",
                  what.c_str(), layout_name(l).c_str(), static_cast<int>(opt.steps), e, e1);
      for (int s = 0; s < opt.steps; ++s)
        std::printf(" %.6f (one GPU %.6f, CPU %.6f)", losses[0][s], one_losses[s], cpu_losses[s]);
      std::printf("\n");
      EXPECT_LE(e, 1.25 * e1 + 1e-3) << what << " " << layout_name(l);
      for (int r = 1; r < ranks; ++r) {
        EXPECT_EQ(values[r], values[0]) << what << " " << layout_name(l) << ": rank " << r << " holds other adapters";
        EXPECT_EQ(losses[r], losses[0]) << what << " " << layout_name(l) << ": rank " << r;
      }
      for (int s = 0; s < opt.steps; ++s)
        EXPECT_LE(std::fabs(losses[0][s] - cpu_losses[s]),
                  1.25 * std::fabs(one_losses[s] - cpu_losses[s]) + 1e-3 * cpu_losses[s])
            << what << " " << layout_name(l) << " step " << s + 1;
    }
  }
}

TEST(CudaParallel, ShardedGradientsThroughHostCollectives) { check_gradients(false); }

TEST(CudaParallel, ShardedGradientsOverNccl) {
  if (dist::cuda_device_count() < 2) GTEST_SKIP() << "needs 2 GPUs (the host-collective test covers the math)";
  check_gradients(true);
}

// A layout the model does not divide is an error naming the flag, and a sharded model needs its groups.
TEST(CudaParallel, LayoutErrorsNameTheFlag) {
  const std::string dir = test::golden_dir("bf16_sharded");
  try {
    CudaModel::load(dir, 0, CudaShard{0, 3, 0, 1});
    FAIL() << "tp 3 over 2 KDA heads loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--tp 3 does not divide the 2 KDA heads"), std::string::npos) << e.what();
  }
  try {
    CudaModel::load(dir, 0, CudaShard{0, 1, 0, 3});
    FAIL() << "ep 3 over 8 experts loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--ep 3 does not divide the 8 routed experts"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(dist::cuda_shard(0, 4, 2, 1), Error);  // 4 ranks for a replica of 2
  // LoRA training's replicas: runs of lcm(tp, ep) ranks; a world of another multiple does not split into them.
  const CudaShard third = dist::cuda_shard(3, 8, 2, 4, /*replicas=*/true);
  EXPECT_EQ(third.tp_rank, 1);
  EXPECT_EQ(third.ep_rank, 3);
  EXPECT_THROW(dist::cuda_shard(0, 6, 2, 4, /*replicas=*/true), Error);
  // A sharded model without its groups does not run.
  const std::unique_ptr<CudaModel> m = CudaModel::load(dir, 0, CudaShard{0, 2, 0, 1});
  EXPECT_THROW(m->next_token_logprobs(test_batch(256)), Error);
  EXPECT_THROW(m->set_collectives(nullptr, nullptr), Error);
}

// `score --device cuda --tp 2 --ep 2` on two GPUs (threads of one process) writes what one GPU writes, within the
// bounds above.
TEST(CudaParallel, ScoreCliOnTwoGpus) {
  if (dist::cuda_device_count() < 2) GTEST_SKIP() << "needs 2 GPUs";
  test::TempDir tmp;
  const std::string model = test::golden_dir("tiny-glm5-next");
  const std::string in = test::shell_quote(model + "/input.jsonl"), q = test::shell_quote(model);
  const auto one = test::run_nextlm("score --device cuda --model " + q + " --input " + in + " --output " +
                                    test::shell_quote(tmp.str("one.jsonl")));
  ASSERT_EQ(one.rc, 0) << one.err;
  const auto two = test::run_nextlm("score --device cuda --tp 2 --ep 2 --model " + q + " --input " + in +
                                    " --output " + test::shell_quote(tmp.str("two.jsonl")));
  ASSERT_EQ(two.rc, 0) << two.err;
  const auto a = read_score_jsonl(tmp.str("one.jsonl")), b = read_score_jsonl(tmp.str("two.jsonl"));
  ASSERT_FALSE(a.empty());
  const Diff d = compare(b, a);
  std::printf("[cuda parallel cli] tiny-glm5-next tp2 ep2: mean |dlogprob| %.3g, max %.3g\n", d.mean, d.max);
  EXPECT_LE(d.mean, 1e-3);
  EXPECT_LE(d.max, 2e-2);
  // Flag errors are usage errors (status 2) naming the problem.
  const auto bad = test::run_nextlm("score --device cuda --tp 3 --model " + q + " --input " + in);
  EXPECT_EQ(bad.rc, 2);
  EXPECT_NE(bad.err.find("--tp 3"), std::string::npos) << bad.err;
}

// ‖a − b‖/‖b‖ over every tensor of two `grad` output files (the same names), and each file's loss.
struct GradFiles {
  double error = 0, loss_a = 0, loss_b = 0;
};
GradFiles compare_grad_files(const std::string& a, const std::string& b) {
  const SafetensorsFile fa(a), fb(b);
  GradFiles out;
  double d = 0, r = 0;
  EXPECT_EQ(fa.buffer().tensors().size(), fb.buffer().tensors().size());
  for (const TensorView& y : fb.buffer().tensors()) {
    const TensorView* x = fa.buffer().find(y.name);
    EXPECT_NE(x, nullptr) << y.name;
    if (!x) continue;
    EXPECT_EQ(x->shape, y.shape) << y.name;
    if (y.name == "loss") {
      out.loss_a = *static_cast<const double*>(static_cast<const void*>(x->data));
      out.loss_b = *static_cast<const double*>(static_cast<const void*>(y.data));
      continue;
    }
    const std::vector<float> u = to_f32(*x), v = to_f32(y);
    for (size_t j = 0; j < v.size() && j < u.size(); ++j) {
      EXPECT_TRUE(std::isfinite(u[j])) << y.name;
      d += (static_cast<double>(u[j]) - v[j]) * (static_cast<double>(u[j]) - v[j]);
      r += static_cast<double>(v[j]) * v[j];
    }
  }
  out.error = std::sqrt(d / r);
  return out;
}

// `grad --device cuda --tp 2 --ep 2` on two GPUs writes the checkpoint's full tensors, as close to the fp32 CPU's
// `grad` as one GPU's are (within 1.25×, plus 1e-3).
TEST(CudaParallel, GradCliOnTwoGpus) {
  if (dist::cuda_device_count() < 2) GTEST_SKIP() << "needs 2 GPUs";
  test::TempDir tmp;
  const std::string model = test::shell_quote(test::golden_dir("bf16_sharded"));
  test::TempDir data;
  {
    std::ofstream in(data.str("in.jsonl"));
    for (const auto& s : test::golden_sequences(test::golden_dir("bf16_sharded"))) {
      in << "{\"tokens\": [";
      for (size_t i = 0; i < s.size(); ++i) in << (i ? ", " : "") << s[i];
      in << "]}\n";
    }
  }
  const std::string in = test::shell_quote(data.str("in.jsonl"));
  for (const auto& [flags, file] : std::vector<std::pair<std::string, std::string>>{
           {"--device cpu", "cpu"}, {"--device cuda", "one"}, {"--device cuda --tp 2 --ep 2", "two"}}) {
    const auto r = test::run_nextlm("grad " + flags + " --model " + model + " --input " + in + " --out " +
                                    test::shell_quote(tmp.str(file + ".safetensors")));
    ASSERT_EQ(r.rc, 0) << flags << ": " << r.err;
  }
  const GradFiles one = compare_grad_files(tmp.str("one.safetensors"), tmp.str("cpu.safetensors")),
                  two = compare_grad_files(tmp.str("two.safetensors"), tmp.str("cpu.safetensors"));
  std::printf("[cuda parallel cli] grad bf16_sharded tp2 ep2: vs fp32 CPU %.3g (one GPU %.3g); loss %.6f (one GPU "
              "%.6f, CPU %.6f)\n",
              two.error, one.error, two.loss_a, one.loss_a, two.loss_b);
  EXPECT_LE(two.error, 1.25 * one.error + 1e-3);
  EXPECT_LE(std::fabs(two.loss_a - two.loss_b), 1.25 * std::fabs(one.loss_a - one.loss_b) + 1e-4 * two.loss_b);
}

// `train --device cuda --tp 2 --ep 2 --lora-rank 4` on two GPUs (threads of one process, NCCL) logs the losses one
// GPU logs for the same run (the first within 1e-3, the whole run within 2e-2: bf16 sums in another order, carried
// through AdamW) and leaves a LoRA checkpoint that a one-GPU run resumes; the sharded run's error messages.
TEST(CudaParallel, LoraTrainCliOnTwoGpus) {
  if (dist::cuda_device_count() < 2) GTEST_SKIP() << "needs 2 GPUs";
  test::TempDir tmp;
  const std::string model = test::golden_dir("bf16_sharded");
  {
    std::ofstream out(tmp.str("data.jsonl"));
    for (int i = 0; i < 12; ++i) {
      out << "{\"tokens\": [";
      for (int t = 0; t < 40 + 9 * i; ++t) out << (t ? ", " : "") << (i * 31 + t * 17 + 3) % 256;
      out << "]}\n";
    }
  }
  const std::string common = "train --model " + test::shell_quote(model) + " --data " +
                             test::shell_quote(tmp.str("data.jsonl")) +
                             " --lora-rank 4 --warmup 2 --lr 1e-2 --batch-tokens 256 --grad-accum 2 --seed 1 --steps 6";
  const test::CliResult one = test::run_nextlm(common + " --device cuda --out " + test::shell_quote(tmp.str("one")));
  ASSERT_EQ(one.rc, 0) << one.err;
  const test::CliResult two =
      test::run_nextlm(common + " --device cuda --tp 2 --ep 2 --out " + test::shell_quote(tmp.str("two")));
  ASSERT_EQ(two.rc, 0) << two.err;
  EXPECT_NE(two.err.find("parallel: 2 GPU ranks (tp 2, ep 2"), std::string::npos) << two.err;
  const std::vector<double> a = csv_losses(tmp.str("one/train_log.csv")), b = csv_losses(tmp.str("two/train_log.csv"));
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 6u);
  std::printf("[cuda parallel cli] train --lora-rank 4 tp2 ep2: loss %.5f -> %.5f (one GPU %.5f -> %.5f)\n", b[0],
              b[5], a[0], a[5]);
  EXPECT_LE(std::fabs(b[0] - a[0]), 1e-3 * a[0]);
  for (size_t s = 0; s < a.size(); ++s) EXPECT_LE(std::fabs(b[s] - a[s]), 2e-2 * a[s]) << "step " << s + 1;
  EXPECT_TRUE(std::filesystem::exists(tmp.str("two/checkpoint/adapter_model.safetensors")));
  // One GPU continues the sharded run.
  const test::CliResult more = test::run_nextlm("train --resume " + test::shell_quote(tmp.str("two")) + " --data " +
                                                test::shell_quote(tmp.str("data.jsonl")) + " --steps 8 --device cuda");
  ASSERT_EQ(more.rc, 0) << more.err;
  EXPECT_EQ(csv_losses(tmp.str("two/train_log.csv")).size(), 8u);
  // A layout the model does not divide is a usage error before any output.
  const test::CliResult bad =
      test::run_nextlm(common + " --device cuda --tp 3 --out " + test::shell_quote(tmp.str("x")));
  EXPECT_EQ(bad.rc, 2) << bad.err;
  EXPECT_NE(bad.err.find("--tp 3"), std::string::npos) << bad.err;
  EXPECT_FALSE(std::filesystem::exists(tmp.str("x")));
}

}  // namespace
}  // namespace nextlm
