// Tensor/expert parallelism without MPI: the collectives of the in-process communicator (threads as ranks), the
// sliced loading, the parallel forward at 2 and 4 ranks against the single-process Model on every golden, and
// data-parallel training (alone and with TP/EP) against the single-process Trainer.
// Tolerance: max|Δ|/max|ref| ≤ 1e-5 on the logits. Row-parallel projections sum partial products per rank and then
// over ranks, a different fp32 summation order than one GEMM: ~1e-7 relative per layer; 1e-5 leaves room while a
// wrong slice, a missed all-reduce or a misrouted token is off by far more.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <numeric>
#include <thread>

#include "core/error.h"
#include "cpu/linear.h"
#include "dist/comm.h"
#include "dist/parallel_model.h"
#include "dist/parallel_decode.h"
#include "dist/parallel_train.h"
#include "dist/parallel_trainer.h"
#include "dist/rank_pool.h"
#include "dist/thread_comm.h"
#include "io/safetensors.h"
#include "model/decode.h"
#include "model/lora.h"
#include "model/model.h"
#include "model/optim.h"
#include "model/train.h"
#include "model/trainer.h"
#include "test_util.h"

namespace nextlm {
namespace {

constexpr double kTol = 1e-5;

TEST(DistSplitRange, CoversEverythingOnceAndBalances) {
  for (int64_t n : {0, 1, 5, 8, 154880})
    for (int64_t parts : {1, 2, 3, 4, 7}) {
      int64_t next = 0;
      for (int64_t p = 0; p < parts; ++p) {
        const dist::Range r = dist::split_range(n, parts, p);
        EXPECT_EQ(r.begin, next);
        EXPECT_GE(r.size(), n / parts);
        EXPECT_LE(r.size(), n / parts + 1);
        next = r.end;
      }
      EXPECT_EQ(next, n);
    }
}

TEST(DistComm, LocalIsIdentity) {
  dist::LocalComm c;
  std::vector<float> x{1.5f, -2.0f};
  c.all_reduce_sum(x.data(), x.size());
  EXPECT_EQ(x, (std::vector<float>{1.5f, -2.0f}));
  std::vector<float> g(2);
  c.all_gather(x.data(), 2 * sizeof(float), g.data());
  EXPECT_EQ(g, x);
  EXPECT_EQ(c.split(3, 0)->size(), 1);
}

TEST(DistComm, ThreadCollectivesAtThreeRanks) {
  const int n = 3;
  std::mutex mu;
  std::vector<std::vector<float>> sums(n);
  dist::run_ranks(n, [&](dist::Comm& c) {
    const int r = c.rank();
    // Sum in rank order: values whose fp32 sum depends on the order must give the order-0,1,2 bits everywhere.
    std::vector<float> x{r == 0 ? 1e8f : (r == 1 ? 1.0f : -1e8f), static_cast<float>(r)};
    c.all_reduce_sum(x.data(), x.size());
    const float expect0 = (1e8f + 1.0f) + -1e8f;
    EXPECT_EQ(x[0], expect0);
    EXPECT_EQ(x[1], 3.0f);
    std::vector<double> xd{0.5 * r};
    c.all_reduce_sum(xd.data(), 1);
    EXPECT_EQ(xd[0], 1.5);
    std::vector<float> m{static_cast<float>(-r)};
    c.all_reduce_max(m.data(), 1);
    EXPECT_EQ(m[0], 0.0f);

    // all_gatherv: rank q contributes q+1 ints of value q.
    std::vector<int> mine(r + 1, r), all(6);
    c.all_gatherv(mine.data(), all.data(), {4, 8, 12});
    EXPECT_EQ(all, (std::vector<int>{0, 1, 1, 2, 2, 2}));

    // all_to_allv: rank r sends q+r copies of 10r+q to rank q.
    std::vector<int> send;
    std::vector<size_t> sc(n), rc(n);
    for (int q = 0; q < n; ++q) {
      for (int i = 0; i < q + r; ++i) send.push_back(10 * r + q);
      sc[q] = (q + r) * sizeof(int);
      rc[q] = (r + q) * sizeof(int);
    }
    std::vector<int> recv(3 * r + 3);
    c.all_to_allv(send.data(), sc, recv.data(), rc);
    std::vector<int> expect;
    for (int q = 0; q < n; ++q)
      for (int i = 0; i < r + q; ++i) expect.push_back(10 * q + r);
    EXPECT_EQ(recv, expect);

    int b = r == 2 ? 42 : -1;
    c.broadcast(&b, sizeof b, 2);
    EXPECT_EQ(b, 42);

    std::vector<float> full{1, 2, 3, 4, 5, 6}, part(2);
    c.reduce_scatter_sum(full.data(), full.size(), part.data());
    EXPECT_EQ(part, (std::vector<float>{3.0f * (2 * r + 1), 3.0f * (2 * r + 2)}));

    // split: {0, 2} and {1}, ordered by key (reversed).
    auto sub = c.split(r % 2, -r);
    EXPECT_EQ(sub->size(), r % 2 ? 1 : 2);
    EXPECT_EQ(sub->rank(), r == 0 ? 1 : 0);
    std::vector<float> y{static_cast<float>(r)};
    sub->all_reduce_sum(y.data(), 1);
    std::lock_guard<std::mutex> lock(mu);
    sums[r] = y;
  });
  EXPECT_EQ(sums[0][0], 2.0f);
  EXPECT_EQ(sums[2][0], 2.0f);
  EXPECT_EQ(sums[1][0], 1.0f);
}

// all_reduce_gradients gives every rank the rank-order sum of each gradient, bit for bit the same whatever the
// chunk: staged runs of small tensors, a flush before a tensor that would overflow the stage, tensors larger than a
// chunk reduced in place a chunk at a time.
TEST(DistComm, GradientSumsDoNotDependOnTheChunk) {
  const int n = 3;
  const std::vector<int64_t> sizes{1, 5, 3000, 2, 70000, 7, 4096};
  // Rank r's value at element i: order-sensitive in fp32 ((1e8 + 1) − 1e8 = 0 in rank order, 1 otherwise).
  auto value = [](int r, size_t i) {
    const float big = (i % 3 == 0) ? 1e8f : 1.0f;
    return r == 0 ? big : r == 1 ? 1.0f + static_cast<float>(i % 7) : -big;
  };
  for (const size_t chunk : {size_t{1}, size_t{4}, size_t{6}, size_t{4096}, size_t{1} << 22}) {
    dist::run_ranks(n, [&](dist::Comm& c) {
      std::vector<std::vector<float>> g;
      std::vector<ParamRef> refs;
      for (const int64_t sz : sizes) {
        std::vector<float> x(static_cast<size_t>(sz));
        for (size_t i = 0; i < x.size(); ++i) x[i] = value(c.rank(), i);
        g.push_back(std::move(x));
      }
      for (std::vector<float>& x : g) {
        ParamRef r;
        r.g = x.data();
        r.n = static_cast<int64_t>(x.size());
        refs.push_back(r);
      }
      dist::all_reduce_gradients(c, refs, chunk);
      for (size_t t = 0; t < g.size(); ++t)
        for (size_t i = 0; i < g[t].size(); ++i) {
          const float expect = (value(0, i) + value(1, i)) + value(2, i);
          if (g[t][i] != expect) {
            ADD_FAILURE() << "chunk " << chunk << " tensor " << t << " element " << i << ": " << g[t][i] << " vs "
                          << expect;
            return;
          }
        }
    });
  }
}

// A rank pool's ranks keep their thread and state from the setup through every job, run each job on all ranks with
// working collectives, report a job's error (the first by rank) and stay usable after it, and run teardown on their
// own threads when the pool goes.
TEST(DistRankPool, RanksKeepTheirThreadsAndStateAcrossJobs) {
  const int n = 3;
  std::vector<std::thread::id> thread_of(n), torn_down_on(n);
  std::vector<int> state(n, -1);
  {
    dist::RankPool pool(
        n,
        [&](dist::Comm& w) {
          thread_of[w.rank()] = std::this_thread::get_id();
          state[w.rank()] = 10 * w.rank();
        },
        [&](dist::Comm& w) { torn_down_on[w.rank()] = std::this_thread::get_id(); });
    EXPECT_EQ(pool.size(), n);
    for (int r = 0; r < n; ++r) EXPECT_EQ(state[r], 10 * r);
    for (int job = 1; job <= 3; ++job) {
      std::vector<float> sums(n);
      pool.run([&](dist::Comm& w) {
        EXPECT_EQ(std::this_thread::get_id(), thread_of[w.rank()]);
        state[w.rank()] += job;
        float x = static_cast<float>(state[w.rank()]);
        w.all_reduce_sum(&x, 1);
        sums[w.rank()] = x;
      });
      const float expect = 30.0f + 3.0f * static_cast<float>(job * (job + 1) / 2);
      EXPECT_EQ(sums, std::vector<float>(n, expect)) << "job " << job;
    }
    // Ranks 1 and 2 fail alike (no collective waits on them): rank 1's error is the one reported.
    try {
      pool.run([&](dist::Comm& w) {
        if (w.rank() > 0) throw Error("rank " + std::to_string(w.rank()) + " failed");
      });
      ADD_FAILURE() << "a job's error was not rethrown";
    } catch (const Error& e) {
      EXPECT_STREQ(e.what(), "rank 1 failed");
    }
    int ran = 0;
    std::mutex mu;
    pool.run([&](dist::Comm& w) {
      w.barrier();
      std::lock_guard<std::mutex> lock(mu);
      ++ran;
    });
    EXPECT_EQ(ran, n);
  }
  for (int r = 0; r < n; ++r) EXPECT_EQ(torn_down_on[r], thread_of[r]) << "rank " << r;
}

// A setup's error comes out of the constructor, after every rank ran teardown.
TEST(DistRankPool, SetupErrorStopsThePool) {
  std::atomic<int> torn_down{0};
  try {
    dist::RankPool pool(
        2, [](dist::Comm& w) { check(w.rank() != 1, "no device for rank 1"); },
        [&](dist::Comm&) { ++torn_down; });
    ADD_FAILURE() << "the setup's error was not rethrown";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "no device for rank 1");
  }
  EXPECT_EQ(torn_down.load(), 2);
}

TEST(DistLayout, RejectsWhatDoesNotDivide) {
  // 2 KDA heads, 4 MLA heads, 8 experts.
  const ModelConfig c = load_config(test::golden_dir("fp32_tail_off") + "/config.json");
  EXPECT_NO_THROW(dist::validate_layout({2, 4}, 4, c));
  auto message = [&](dist::ParallelOptions o, int n) {
    try {
      dist::validate_layout(o, n, c);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message({4, 1}, 4), "--tp 4 does not divide the 2 KDA heads (linear_num_heads) of this model");
  EXPECT_EQ(message({3, 1}, 4), "--tp 3 does not divide the 4 processes (mpirun -np)");
  EXPECT_EQ(message({1, 3}, 3), "--ep 3 does not divide the 8 routed experts (n_routed_experts) of this model");
  EXPECT_EQ(message({0, 1}, 1), "--tp must be at least 1, got 0");
  EXPECT_EQ(message({1, 2}, 1), "--ep 2 does not divide the 1 processes (mpirun -np)");
}

TEST(DistLoad, SlicesConcatenateToTheWholeTensors) {
  const std::string dir = test::golden_dir("bf16_sharded");  // bf16, three shards
  const Model whole = Model::load(dir);
  const ModelConfig& c = whole.config();
  std::vector<dist::ShardedModel> parts(2);
  dist::run_ranks(2, [&](dist::Comm& w) {
    dist::Mesh mesh(w, {2, 2});
    parts[w.rank()] = dist::load_sharded(dir, mesh);
  });
  const int64_t D = c.hidden_size, K = c.linear_head_dim;
  for (size_t i = 0; i < whole.weights().layers.size(); ++i) {
    const LayerWeights& L = whole.weights().layers[i];
    if (!L.kda) continue;
    // Column-parallel q_proj: rank 0's rows then rank 1's. Row-parallel o_proj: columns side by side.
    std::vector<float> q = parts[0].weights.layers[i].kda->q_proj.data;
    const auto& q1 = parts[1].weights.layers[i].kda->q_proj.data;
    q.insert(q.end(), q1.begin(), q1.end());
    EXPECT_EQ(q, L.kda->q_proj.data);
    const int64_t half = c.linear_num_heads / 2 * K;
    for (int64_t d = 0; d < D; ++d)
      for (int r = 0; r < 2; ++r)
        for (int64_t j = 0; j < half; ++j)
          ASSERT_EQ(parts[r].weights.layers[i].kda->o_proj.data[d * half + j],
                    L.kda->o_proj.data[d * 2 * half + r * half + j]);
    EXPECT_EQ(parts[1].weights.layers[i].kda->A_log.data[0], L.kda->A_log.data[1]);
    EXPECT_EQ(parts[1].weights.layers[i].kda->q_conv.shape, (std::vector<int64_t>{half, c.linear_conv_kernel_dim}));
  }
  // Experts: 4 per rank, the second rank's first one is expert 4.
  for (size_t i = 0; i < whole.weights().layers.size(); ++i)
    if (whole.weights().layers[i].moe) {
      ASSERT_EQ(parts[1].weights.layers[i].moe->experts.size(), 4u);
      EXPECT_EQ(parts[1].weights.layers[i].moe->experts[0].down.data,
                whole.weights().layers[i].moe->experts[4].down.data);
    }
  EXPECT_EQ(parts[1].vocab.begin, c.vocab_size / 2);
  EXPECT_EQ(parts[1].weights.lm_head.shape, (std::vector<int64_t>{c.vocab_size / 2, D}));
}

struct Layout {
  int n, tp, ep;
};

std::string describe(const Layout& l) {
  return "np " + std::to_string(l.n) + " tp " + std::to_string(l.tp) + " ep " + std::to_string(l.ep);
}

class DistForward : public ::testing::TestWithParam<std::string> {};

// Every golden case at 2 and 4 ranks, with TP only, EP only and both; the heads (2 KDA, 4 MLA) and experts (8) of
// the goldens allow tp ≤ 2 and ep ≤ 4 (tp 4 is rejected, see DistLayout).
TEST_P(DistForward, EqualsSingleProcessLogits) {
  cpu::set_num_threads(1);  // the ranks are threads already
  const std::string dir = test::golden_dir(GetParam());
  const Model model = Model::load(dir);
  const int64_t V = model.config().vocab_size;
  // Two sequences of awkward lengths packed together, plus one token alone.
  PackedBatch batch;
  std::vector<int32_t> s1, s2;
  for (int i = 0; i < 37; ++i) s1.push_back((i * 37 + 11) % V);
  for (int i = 0; i < 5; ++i) s2.push_back((i * 101 + 3) % V);
  batch.add(s1);
  batch.add(s2);
  batch.add({7});
  const Tensor ref = model.forward(batch);
  const auto ref_lp = model.next_token_logprobs(batch);

  for (const Layout& l : {Layout{2, 2, 1}, Layout{2, 1, 2}, Layout{2, 2, 2}, Layout{4, 2, 4}, Layout{4, 2, 2},
                          Layout{4, 1, 4}}) {
    std::vector<Tensor> logits(l.n), hidden(l.n);
    std::vector<std::vector<std::vector<double>>> lps(l.n);
    dist::run_ranks(l.n, [&](dist::Comm& w) {
      dist::Mesh mesh(w, {l.tp, l.ep});
      const dist::ShardedModel m = dist::load_sharded(dir, mesh);
      hidden[w.rank()] = dist::parallel_forward_hidden(m, mesh, batch);
      lps[w.rank()] = dist::parallel_next_token_logprobs(m, mesh, hidden[w.rank()], batch);
      logits[w.rank()] = dist::parallel_logits(m, mesh, hidden[w.rank()], 0, batch.num_tokens());
    });
    const std::string what = describe(l);
    for (int r = 0; r < l.n; ++r) {
      ASSERT_EQ(logits[r].data.size(), ref.data.size());
      EXPECT_LE(test::max_rel_error(logits[r].ptr(), ref.ptr(), ref.data.size()), kTol) << what << " rank " << r;
      // Every rank holds the same bits (fixed-order reductions).
      EXPECT_EQ(std::memcmp(logits[r].ptr(), logits[0].ptr(), ref.data.size() * 4), 0) << what << " rank " << r;
      ASSERT_EQ(lps[r].size(), ref_lp.size());
      for (size_t s = 0; s < ref_lp.size(); ++s) {
        ASSERT_EQ(lps[r][s].size(), ref_lp[s].size());
        for (size_t t = 0; t < ref_lp[s].size(); ++t)
          EXPECT_NEAR(lps[r][s][t], ref_lp[s][t], kTol * std::max(1.0, std::abs(ref_lp[s][t]))) << what;
      }
    }
    // Expert parallelism alone keeps moe_forward's order of every sum: the same bits as one process.
    if (l.tp == 1) {
      EXPECT_EQ(std::memcmp(logits[0].ptr(), ref.ptr(), ref.data.size() * 4), 0) << what;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, DistForward, ::testing::ValuesIn(test::golden_cases()),
                         [](const auto& info) { return test::param_name(info.param); });

TEST(DistForward, RunsAreBitwiseRepeatable) {
  cpu::set_num_threads(1);
  const std::string dir = test::golden_dir("fp32_tail_off");
  PackedBatch batch;
  batch.add({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13});
  std::vector<Tensor> runs;
  for (int rep = 0; rep < 2; ++rep) {
    Tensor h0;
    dist::run_ranks(4, [&](dist::Comm& w) {
      dist::Mesh mesh(w, {2, 4});
      const dist::ShardedModel m = dist::load_sharded(dir, mesh);
      Tensor h = dist::parallel_forward_hidden(m, mesh, batch);
      if (w.rank() == 3) h0 = std::move(h);
    });
    runs.push_back(std::move(h0));
  }
  ASSERT_EQ(runs[0].data.size(), runs[1].data.size());
  EXPECT_EQ(std::memcmp(runs[0].ptr(), runs[1].ptr(), runs[0].data.size() * 4), 0);
}

}  // namespace
}  // namespace nextlm

namespace nextlm {
namespace {

// Gradients: the parallel backward at 2 and 4 ranks, gathered into full tensors, against model_forward_backward.
// Tolerances: the whole gradient (every tensor as one vector) ‖Δ‖/‖ref‖ ≤ 2e-5, and each tensor ≤ 2e-4.
// The sharded backward sums the same terms in another order (partial input gradients over ranks, experts apart from the
// shared expert). That is the rounding noise of the single-process backward itself: between this packed batch and
// its sequences run alone, model_forward_backward differs by 9.9e-6 (whole) and 5.4e-5 (worst tensor, an mHC scale)
// on tiny-glm5-next (8 layers), 2.5e-6 / 1.3e-5 on the 4–5-layer goldens; the sharded one measures 1.0e-5 / 6.3e-5
// and 3.4e-6 / 1.6e-5. So 1e-5 sits on the noise floor and 2e-5 leaves it room, while a missing all-reduce or a
// misplaced slice is off by O(1). The worst tensor is always an mHC scale: three scalars, each a sum over every token
// and stream with much cancellation, so their relative error swings with any rounding change. Taking KDA's
// activations from the chunked core (the forward's) instead of the recurrent one moved fp32_tail_off's
// layers.0.hc_attn_scale by 4.6e-5 in the single-process backward alone, and its sharded error at np 2 ep 2 from
// 1.3e-5 to 1.2e-4 (on four other batches the worst tensor stayed within 1.5e-6–6.7e-6 either way); hence 2e-4.
class DistGrad : public ::testing::TestWithParam<std::string> {};

TEST_P(DistGrad, EqualsSingleProcessGradients) {
  cpu::set_num_threads(1);
  const std::string dir = test::golden_dir(GetParam());
  const Model model = Model::load(dir);
  const int64_t V = model.config().vocab_size;
  PackedBatch batch;
  std::vector<int32_t> s1, s2;
  for (int i = 0; i < 23; ++i) s1.push_back((i * 53 + 7) % V);
  for (int i = 0; i < 6; ++i) s2.push_back((i * 19 + 1) % V);
  batch.add(s1);
  batch.add(s2);
  ModelWeights ref = zeros_like(model.weights());
  const double ref_loss = model_forward_backward(model, batch, ref);
  const auto ref_named = hub_gradients(model.config(), ref, "");

  for (const Layout& l : {Layout{2, 2, 2}, Layout{4, 2, 4}, Layout{2, 1, 2}}) {
    const std::string what = describe(l);
    std::vector<double> loss(l.n);
    std::vector<ModelWeights> full(l.n);
    dist::run_ranks(l.n, [&](dist::Comm& w) {
      dist::Mesh mesh(w, {l.tp, l.ep});
      const dist::ShardedModel m = dist::load_sharded(dir, mesh);
      ModelWeights g = zeros_like(m.weights);
      loss[w.rank()] = dist::parallel_forward_backward(m, mesh, batch, g);
      full[w.rank()] = dist::gather_gradients(m, mesh, g);
    });
    for (int r = 0; r < l.n; ++r) {
      EXPECT_NEAR(loss[r], ref_loss, 1e-5 * std::abs(ref_loss)) << what;
      const auto named = hub_gradients(model.config(), full[r], "");
      ASSERT_EQ(named.size(), ref_named.size()) << what;
      std::vector<float> all, all_ref;
      double worst = 0.0;
      std::string worst_name;
      for (size_t i = 0; i < named.size(); ++i) {
        ASSERT_EQ(named[i].name, ref_named[i].name);
        ASSERT_EQ(named[i].shape, ref_named[i].shape) << named[i].name;
        const size_t n = Tensor::count(named[i].shape);
        const double err = test::norm_rel_error(named[i].data, ref_named[i].data, n);
        EXPECT_LE(err, 2e-4) << what << " " << named[i].name;
        if (err > worst) worst = err, worst_name = named[i].name;
        all.insert(all.end(), named[i].data, named[i].data + n);
        all_ref.insert(all_ref.end(), ref_named[i].data, ref_named[i].data + n);
      }
      const double total = test::norm_rel_error(all.data(), all_ref.data(), all.size());
      EXPECT_LE(total, 2e-5) << what;
      if (r == 0)
        std::printf("[dist grad] %s %s: whole gradient %.3g, worst tensor %.3g (%s)\n", GetParam().c_str(),
                    what.c_str(), total, worst, worst_name.c_str());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, DistGrad, ::testing::ValuesIn(test::golden_cases()),
                         [](const auto& info) { return test::param_name(info.param); });

// The recompute policy changes when the sharded sub-layers run (and so how many collectives), not what they compute:
// every rank's loss and gradient slices are the same bits under each policy.
TEST(DistGrad, EveryRecomputePolicyGivesTheSameBits) {
  cpu::set_num_threads(1);
  const std::string dir = test::golden_dir("fp32_tail_off");
  PackedBatch batch;
  std::vector<int32_t> s1, s2;
  for (int i = 0; i < 19; ++i) s1.push_back((i * 53 + 7) % 256);
  for (int i = 0; i < 7; ++i) s2.push_back((i * 19 + 1) % 256);
  batch.add(s1);
  batch.add(s2);
  const Layout l{4, 2, 2};
  auto run = [&](const RecomputePolicy& p, std::vector<double>& loss) {
    std::vector<ModelWeights> g(l.n);
    dist::run_ranks(l.n, [&](dist::Comm& w) {
      dist::Mesh mesh(w, {l.tp, l.ep});
      const dist::ShardedModel m = dist::load_sharded(dir, mesh);
      g[w.rank()] = zeros_like(m.weights);
      loss[w.rank()] = dist::parallel_forward_backward(m, mesh, batch, g[w.rank()], p);
    });
    return g;
  };
  std::vector<double> ref_loss(l.n), loss(l.n);
  const std::vector<ModelWeights> ref = run(RecomputePolicy{}, ref_loss);
  const ModelConfig c = Model::load(dir).config();
  for (const char* policy : {"none", "kda,moe", "mla,mlp,mhc"}) {
    const std::vector<ModelWeights> g = run(parse_recompute(policy), loss);
    for (int r = 0; r < l.n; ++r) {
      EXPECT_EQ(loss[r], ref_loss[r]) << policy << " rank " << r;
      const auto a = hub_gradients(c, g[r], ""), b = hub_gradients(c, ref[r], "");
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i)
        EXPECT_EQ(std::memcmp(a[i].data, b[i].data, Tensor::count(a[i].shape) * sizeof(float)), 0)
            << policy << " rank " << r << " " << a[i].name;
    }
  }
}

}  // namespace
}  // namespace nextlm

namespace nextlm {
namespace {

// Decoding: parallel prefill and decode steps against the single-process ones (logits ≤ 1e-5 relative, as the
// forward), and generation: the same tokens, log-probabilities within 1e-5.
class DistDecode : public ::testing::TestWithParam<std::string> {};

TEST_P(DistDecode, EqualsSingleProcessDecoding) {
  cpu::set_num_threads(1);
  const std::string dir = test::golden_dir(GetParam());
  const Model model = Model::load(dir);
  const std::vector<int32_t> prompt{3, 141, 59, 26, 53, 58, 97, 93, 23, 84, 62};
  DecodeState st(model);
  std::vector<std::vector<float>> ref{prefill(st, prompt)};
  for (int32_t t : {7, 200, 1}) ref.push_back(decode_step(st, t));
  GenerateOptions opt;
  opt.max_new_tokens = 6;
  opt.sampling.temperature = 0.8;
  opt.sampling.seed = 11;
  const Generation ref_gen = generate(model, prompt, opt);
  // An eos token (GenerateOptions::eos_tokens, which the shared loop reads) ends both alike.
  GenerateOptions eos_opt = opt;
  eos_opt.eos_tokens = {ref_gen.tokens[2]};
  const Generation ref_eos = generate(model, prompt, eos_opt);
  ASSERT_TRUE(ref_eos.eos);
  ASSERT_LT(ref_eos.tokens.size(), ref_gen.tokens.size());

  for (const Layout& l : {Layout{2, 2, 2}, Layout{4, 2, 4}}) {
    const std::string what = describe(l);
    std::vector<std::vector<std::vector<float>>> got(l.n);
    std::vector<Generation> gen(l.n), gen_eos(l.n);
    dist::run_ranks(l.n, [&](dist::Comm& w) {
      dist::Mesh mesh(w, {l.tp, l.ep});
      const dist::ShardedModel m = dist::load_sharded(dir, mesh);
      dist::ParallelDecodeState ps(m, mesh);
      got[w.rank()].push_back(dist::parallel_prefill(ps, prompt));
      for (int32_t t : {7, 200, 1}) got[w.rank()].push_back(dist::parallel_decode_step(ps, t));
      gen[w.rank()] = dist::parallel_generate(m, mesh, prompt, opt);
      gen_eos[w.rank()] = dist::parallel_generate(m, mesh, prompt, eos_opt);
    });
    for (int r = 0; r < l.n; ++r) {
      ASSERT_EQ(got[r].size(), ref.size());
      for (size_t i = 0; i < ref.size(); ++i)
        EXPECT_LE(test::max_rel_error(got[r][i].data(), ref[i].data(), ref[i].size()), kTol) << what << " step " << i;
      EXPECT_EQ(gen[r].tokens, ref_gen.tokens) << what;
      EXPECT_EQ(gen_eos[r].tokens, ref_eos.tokens) << what;
      EXPECT_TRUE(gen_eos[r].eos) << what;
      ASSERT_EQ(gen[r].logprobs.size(), ref_gen.logprobs.size());
      for (size_t i = 0; i < ref_gen.logprobs.size(); ++i)
        EXPECT_NEAR(gen[r].logprobs[i], ref_gen.logprobs[i], kTol * std::max(1.0, std::abs(ref_gen.logprobs[i])));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, DistDecode, ::testing::ValuesIn(test::golden_cases()),
                         [](const auto& info) { return test::param_name(info.param); });

}  // namespace
}  // namespace nextlm

namespace nextlm {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// Data-parallel training (dist/parallel_trainer.h), ranks as threads: also runs in the sanitizer build.

TEST(DistTrain, ReplicaSharesAreContiguousDisjointAndCoverTheBatch) {
  const std::vector<std::vector<int64_t>> batches{{2}, {5, 2}, {30, 2, 2, 2}, {3, 3, 3, 3, 3, 3, 3}};
  for (const std::vector<int64_t>& lens : batches) {
    PackedBatch b;
    for (int64_t n : lens) b.add(std::vector<int32_t>(n, 1));
    for (int n = 1; n <= 5; ++n) {
      int64_t next = 0;
      for (int d = 0; d < n; ++d) {
        const dist::Range r = dist::replica_share(b, n, d);
        if (r.size() > 0) {
          EXPECT_EQ(r.begin, next) << "replica " << d << " of " << n;
          next = r.end;
        }
      }
      EXPECT_EQ(next, b.num_seqs()) << n << " replicas";
    }
  }
  // Balanced by tokens: 4 equal sequences over 2 replicas split 2 + 2; a long one takes a replica of its own.
  PackedBatch b;
  for (int64_t n : {4, 4, 4, 4}) b.add(std::vector<int32_t>(n, 1));
  EXPECT_EQ(dist::replica_share(b, 2, 0).size(), 2);
  PackedBatch c;
  for (int64_t n : {30, 2, 2, 2}) c.add(std::vector<int32_t>(n, 1));
  EXPECT_EQ(dist::replica_share(c, 2, 0).size(), 1);
  EXPECT_EQ(dist::replica_share(c, 2, 1).size(), 3);
  // The sub-batch keeps the tokens and the target weights of its sequences.
  c.target_weight.assign(static_cast<size_t>(c.num_tokens()), 1.0f);
  c.target_weight[31] = 0.0f;
  const PackedBatch s = dist::sub_batch(c, {1, 3});
  EXPECT_EQ(s.num_seqs(), 2);
  EXPECT_EQ(s.num_tokens(), 4);
  EXPECT_EQ(s.target_weight, (std::vector<float>{1.0f, 0.0f, 1.0f, 1.0f}));
}

// The clipping norm counts each tensor once over a replica by placement_of's name rule: it must name exactly the
// tensors that load_sharded slices over TP (smaller than the full tensor at tp = 2) and the routed experts (at
// ep = 1 here, so that the lists match one to one).
TEST(DistTrain, PlacementNamesWhatIsSliced) {
  const std::string dir = test::golden_dir("fp32_tail_off");
  Model model = Model::load(dir);
  ModelWeights g = zeros_like(model.weights());
  const std::vector<ParamRef> full = trainable_params(model.config(), model.mutable_weights(), g, "m.");
  dist::run_ranks(2, [&](dist::Comm& w) {
    dist::Mesh mesh(w, {2, 1});
    dist::ShardedModel m = dist::load_sharded(dir, mesh);
    ModelWeights lg = zeros_like(m.weights);
    const std::vector<ParamRef> local = trainable_params(m.config, m.weights, lg, "m.");
    ASSERT_EQ(local.size(), full.size());
    for (size_t k = 0; k < full.size(); ++k) {
      const dist::Placement p = dist::placement_of(local[k].name);
      const bool expert = local[k].name.find(".experts.") != std::string::npos &&
                          local[k].name.find("shared_experts") == std::string::npos;
      EXPECT_EQ(p == dist::Placement::Expert, expert) << local[k].name;
      if (!expert) {
        EXPECT_EQ(p == dist::Placement::TpSliced, local[k].n < full[k].n) << local[k].name;
      }
    }
  });
}

struct TrainLayout {
  int n, tp, ep;
};

// 7 sequences of 4..22 tokens, every third with a loss mask over its first half.
std::vector<TrainExample> train_examples() { return test::synthetic_examples({4, 11, 18, 6, 13, 20, 8}, 256); }

// ParallelTrainer at DP2, DP2×TP2 and DP2×EP2 against the single-process Trainer on the same data: per-step loss and
// grad-norm, and the gathered weights, within 1e-5 (sum order only; eps 1e-5 for the reason test_dist_cli.cpp's
// DataParallelEqualsSingleProcess gives). Every DP rank ends with bit-identical slices.
TEST(DistTrain, EqualsSingleProcessTrainer) {
  cpu::set_num_threads(1);
  const std::string dir = test::golden_dir("fp32_tail_off");
  const std::vector<TrainExample> data = train_examples();
  TrainOptions opt;
  opt.steps = 2;
  opt.warmup = 1;
  opt.batch_tokens = 40;
  opt.grad_accum = 2;
  opt.adamw.eps = 1e-5;
  Trainer ref(Model::load(dir), data, opt);
  std::vector<StepStats> ref_stats;
  for (int s = 0; s < opt.steps; ++s) ref_stats.push_back(ref.step());
  const auto ref_w = hub_gradients(ref.model().config(), ref.model().weights(), "");

  for (const TrainLayout& l : {TrainLayout{2, 1, 1}, TrainLayout{4, 2, 1}, TrainLayout{4, 1, 2}}) {
    const std::string what = "n " + std::to_string(l.n) + " tp " + std::to_string(l.tp) + " ep " + std::to_string(l.ep);
    std::vector<std::vector<StepStats>> stats(l.n);
    std::vector<ModelWeights> full(l.n);
    std::vector<std::vector<float>> slices(l.n);
    dist::run_ranks(l.n, [&](dist::Comm& w) {
      dist::Mesh mesh(w, {l.tp, l.ep});
      dist::ParallelTrainer tr(dist::load_sharded(dir, mesh), mesh, data, opt);
      for (int s = 0; s < opt.steps; ++s) stats[w.rank()].push_back(tr.step());
      tr.check_replicas_agree();
      full[w.rank()] = dist::gather_weights(tr.model(), mesh, tr.model().weights);
      for (const GradTensor& t : hub_gradients(tr.model().config, tr.model().weights, ""))
        slices[w.rank()].insert(slices[w.rank()].end(), t.data, t.data + Tensor::count(t.shape));
    });
    const int R = std::lcm(l.tp, l.ep);
    for (int r = 0; r < l.n; ++r) {
      for (int s = 0; s < opt.steps; ++s) {
        EXPECT_NEAR(stats[r][s].loss, ref_stats[s].loss, 1e-5 * ref_stats[s].loss) << what << " step " << s;
        EXPECT_NEAR(stats[r][s].grad_norm, ref_stats[s].grad_norm, 1e-5 * ref_stats[s].grad_norm) << what;
        EXPECT_EQ(stats[r][s].tokens, ref_stats[s].tokens) << what;
      }
      // The DP group of rank r: the ranks at its place in the other replicas.
      EXPECT_EQ(slices[r], slices[r % R]) << what << ": rank " << r << " differs from its replica peer";
      const auto got = hub_gradients(ref.model().config(), full[r], "");
      ASSERT_EQ(got.size(), ref_w.size());
      std::vector<float> a, b;
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_EQ(got[i].shape, ref_w[i].shape) << got[i].name;
        a.insert(a.end(), got[i].data, got[i].data + Tensor::count(got[i].shape));
        b.insert(b.end(), ref_w[i].data, ref_w[i].data + Tensor::count(ref_w[i].shape));
      }
      EXPECT_LE(test::norm_rel_error(a.data(), b.data(), a.size()), 1e-5) << what << " rank " << r;
    }
  }
}

// The adapter's A and B, module after module.
// LoRA under ParallelTrainer (the base sliced, the adapter whole on every rank) against the single-process Trainer
// on the same data: per-step loss, grad-norm and the adapters within 1e-5 (sum order only: 2.3e-6 at most on the
// adapters, measured), bit-identical on every rank; at DP2, TP2, EP2,
// TP2·EP2 (two ranks holding both splits) and DP2×TP2, with per-expert adapters and with shared ones of rank / top-k.
// A checkpoint written at TP2 resumes in one process and gives the uninterrupted run's next step.
TEST(DistTrain, LoraEqualsSingleProcessTrainer) {
  cpu::set_num_threads(1);
  const std::string dir = test::golden_dir("fp32_tail_off");
  const std::vector<TrainExample> data = train_examples();
  for (const bool shared : {false, true}) {
    TrainOptions opt;
    opt.steps = 3;
    opt.warmup = 1;
    opt.batch_tokens = 40;
    opt.grad_accum = 2;
    opt.adamw.eps = 1e-5;
    opt.adamw.lr = 1e-2;
    LoraOptions lo;
    lo.rank = 4;
    lo.alpha = 8;
    lo.experts = shared ? LoraExperts::Shared : LoraExperts::PerExpert;
    lo.rank_div_topk = shared;
    opt.lora = lo;
    opt.base_model = dir;
    Trainer ref(Model::load(dir), data, opt);
    std::vector<StepStats> ref_stats;
    for (int s = 0; s < opt.steps; ++s) ref_stats.push_back(ref.step());
    const std::vector<float> ref_values = test::adapter_values(*ref.lora());

    for (const TrainLayout& l : {TrainLayout{2, 1, 1}, TrainLayout{2, 2, 1}, TrainLayout{2, 1, 2},
                                 TrainLayout{2, 2, 2}, TrainLayout{4, 2, 1}}) {
      const std::string what = std::string(shared ? "shared" : "per-expert") + " n " + std::to_string(l.n) + " tp " +
                               std::to_string(l.tp) + " ep " + std::to_string(l.ep);
      std::vector<std::vector<StepStats>> stats(l.n);
      std::vector<std::vector<float>> values(l.n);
      dist::run_ranks(l.n, [&](dist::Comm& w) {
        dist::Mesh mesh(w, {l.tp, l.ep});
        dist::ParallelTrainer tr(dist::load_sharded(dir, mesh), mesh, data, opt);
        EXPECT_EQ(tr.num_trainable(), ref.num_trainable());
        for (int s = 0; s < opt.steps; ++s) stats[w.rank()].push_back(tr.step());
        tr.check_replicas_agree();
        values[w.rank()] = test::adapter_values(*tr.lora());
      });
      for (int r = 0; r < l.n; ++r) {
        for (int s = 0; s < opt.steps; ++s) {
          EXPECT_NEAR(stats[r][s].loss, ref_stats[s].loss, 1e-5 * ref_stats[s].loss) << what << " step " << s;
          EXPECT_NEAR(stats[r][s].grad_norm, ref_stats[s].grad_norm, 1e-5 * ref_stats[s].grad_norm) << what;
          EXPECT_EQ(stats[r][s].tokens, ref_stats[s].tokens) << what;
        }
        EXPECT_EQ(values[r], values[0]) << what << ": rank " << r << " holds another adapter";
        ASSERT_EQ(values[r].size(), ref_values.size());
        EXPECT_LE(test::norm_rel_error(values[r].data(), ref_values.data(), ref_values.size()), 1e-5) << what;
      }
    }

    // Two steps at TP2, saved; the third in one process from that checkpoint.
    test::TempDir tmp;
    const std::string ckpt = tmp.str("ckpt");
    dist::run_ranks(2, [&](dist::Comm& w) {
      dist::Mesh mesh(w, {2, 1});
      dist::ParallelTrainer tr(dist::load_sharded(dir, mesh), mesh, data, opt);
      for (int s = 0; s < 2; ++s) tr.step();
      tr.save(ckpt);
    });
    Trainer resumed = Trainer::resume(ckpt, data, Trainer::stored_options(ckpt));
    const StepStats third = resumed.step();
    EXPECT_NEAR(third.loss, ref_stats[2].loss, 1e-5 * ref_stats[2].loss) << shared;
    EXPECT_NEAR(third.grad_norm, ref_stats[2].grad_norm, 1e-5 * ref_stats[2].grad_norm) << shared;
    const std::vector<float> got = test::adapter_values(*resumed.lora());
    EXPECT_LE(test::norm_rel_error(got.data(), ref_values.data(), ref_values.size()), 1e-5) << shared;
    // And a TP2·EP2 run resumes the same checkpoint.
    std::vector<StepStats> par(2);
    dist::run_ranks(2, [&](dist::Comm& w) {
      dist::Mesh mesh(w, {2, 2});
      dist::ParallelTrainer tr = dist::ParallelTrainer::resume(ckpt, mesh, data, Trainer::stored_options(ckpt));
      par[w.rank()] = tr.step();
    });
    for (const StepStats& st : par) EXPECT_NEAR(st.loss, ref_stats[2].loss, 1e-5 * ref_stats[2].loss) << shared;
  }
}

// check_replicas_agree fails on every rank when one DP rank's copy has drifted.
TEST(DistTrain, DriftedReplicaIsReported) {
  cpu::set_num_threads(1);
  const std::string dir = test::golden_dir("fp32_tail_off");
  std::vector<TrainExample> data{TrainExample{{1, 2, 3, 4, 5}, {}}, TrainExample{{6, 7, 8}, {}}};
  TrainOptions opt;
  opt.steps = 1;
  std::vector<int> threw(2, 0);
  dist::run_ranks(2, [&](dist::Comm& w) {
    dist::Mesh mesh(w, {1, 1});
    dist::ParallelTrainer tr(dist::load_sharded(dir, mesh), mesh, data, opt);
    tr.step();
    tr.check_replicas_agree();
    if (w.rank() == 1) const_cast<float&>(tr.model().weights.final_norm.data[0]) += 1e-3f;
    try {
      tr.check_replicas_agree();
    } catch (const Error& e) {
      threw[w.rank()] = std::string(e.what()).find("disagree") != std::string::npos;
    }
  });
  EXPECT_EQ(threw, (std::vector<int>{1, 1}));
}

}  // namespace
}  // namespace nextlm
