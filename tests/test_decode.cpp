// Decoding against the full forward: after prefill and after every decode step, the logits equal the last row of
// Model::forward on the same prefix, on every golden model, for prompts that end inside and at the edges of a k-pool
// (4) and a KDA chunk (64), decoding to 150 tokens (past every index_topk). Also: prefill in pieces, what the caches
// hold, the tail-off exception (decode.h), and generate() (greedy = argmax of the forward, stop tokens, seeds,
// log-probabilities equal to scoring).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>

#include "core/error.h"
#include "cpu/linear.h"
#include "io/safetensors.h"
#include "model/decode.h"
#include "test_util.h"

namespace nextlm {
namespace {

// Tolerance on max|Δlogit| / max|logit| of a row. Decode and forward compute the same function in a different
// order: recurrent against chunked KDA, absorbed against expanded MLA, one-row against T-row GEMMs; each step
// differs by ~1e-7 relative. These random-weight models amplify that up to ~100x: a KDA head's output has rms
// ~1e-2 (down to 2e-4) before its RMSNorm, which rescales it, rounding noise included, to rms 1. The forward's
// own two KDA forms (both the definition) differ by up to 1.6e-5 on the same rows. Measured worst decode error:
// 2.4e-5 on tiny-glm5-next, 8.6e-6 on bf16_sharded, 3.5e-6 on the others; a wrong cache gives 1e-2 or more.
constexpr double kTol = 5e-5;
// log p = logit − logsumexp(logits), so its error is at most 2·max|Δlogit| (≤ 2·kTol·max|logit| ≈ 5e-4 here);
// measured ≤ 3e-5.
constexpr double kLogprobTol = 1e-4;
constexpr int kLength = 150;  // golden sequence 4

// The golden models, plus fp32_tail_off with the tail switched on. fp32_tail_off itself has queries that select
// nothing, where no causal decoder can reproduce the transformers forward (decode.h): there decode is compared with
// the forward under EmptySelection::SeenKeys, and the copy with the tail on with the unmodified forward.
const char* const kTailOnSuffix = "+tail";

std::vector<std::string> cases() {
  std::vector<std::string> c = test::golden_cases();
  c.push_back(std::string("fp32_tail_off") + kTailOnSuffix);
  return c;
}

Model load_case(const std::string& name) {
  const size_t plus = name.find('+');
  if (plus == std::string::npos) return Model::load(test::golden_dir(name));
  const Model m = Model::load(test::golden_dir(name.substr(0, plus)));
  ModelConfig c = m.config();
  c.index_kpool_always_select_tail = true;
  return Model(c, m.weights());
}

std::vector<int32_t> golden_tokens(const std::string& name) {
  SafetensorsFile f(test::golden_dir(name.substr(0, name.find('+'))) + "/golden.safetensors");
  const TensorView* t = f.buffer().find("tokens.4");
  EXPECT_TRUE(t != nullptr);
  std::vector<int32_t> ids(t->numel());
  for (int64_t j = 0; j < t->numel(); ++j) {
    int64_t v;
    std::memcpy(&v, t->data + j * 8, 8);
    ids[j] = static_cast<int32_t>(v);
  }
  EXPECT_EQ(static_cast<int>(ids.size()), kLength);
  return ids;
}

// Decoding's semantics for queries that select nothing (decode.h): equal to transformers' forward unless the model
// has such queries (tail off, kpool > 1).
ForwardOptions decode_semantics(const ModelConfig& c) {
  ForwardOptions o;
  if (!c.index_kpool_always_select_tail && c.index_kpool > 1) o.empty_selection = EmptySelection::SeenKeys;
  return o;
}

// ref[n] = last row of forward(seq[0, n)), for n = 1 … seq.size().
std::vector<std::vector<float>> prefix_logits(const Model& m, const std::vector<int32_t>& seq,
                                              const ForwardOptions& o) {
  const int64_t V = m.config().vocab_size;
  std::vector<std::vector<float>> ref(seq.size() + 1);
  for (size_t n = 1; n <= seq.size(); ++n) {
    PackedBatch b;
    b.add(std::vector<int32_t>(seq.begin(), seq.begin() + n));
    const Tensor lg = m.forward(b, o);
    ref[n].assign(lg.ptr() + (n - 1) * V, lg.ptr() + n * V);
  }
  return ref;
}

class DecodeTest : public ::testing::TestWithParam<std::string> {
 protected:
  // One thread: a tiny model's step is far too small for threads to help, and ctest runs two suites at once.
  static void SetUpTestSuite() { cpu::set_num_threads(1); }

  // prefix_logits of the case's golden sequence under decoding's semantics, computed once per case.
  static const std::vector<std::vector<float>>& reference(const Model& m, const std::string& name) {
    static std::map<std::string, std::vector<std::vector<float>>> cache;
    auto it = cache.find(name);
    if (it == cache.end())
      it = cache.emplace(name, prefix_logits(m, golden_tokens(name), decode_semantics(m.config()))).first;
    return it->second;
  }
};

// Feeds seq through prefill pieces ending at `ends` (the last end is the prompt), then one decode step per
// remaining token; every returned row is checked against ref. Returns the worst error.
double check_decode(const Model& m, const std::vector<int32_t>& seq, const std::vector<std::vector<float>>& ref,
                    const std::vector<int64_t>& ends, const std::string& what) {
  const int64_t V = m.config().vocab_size;
  DecodeState st(m);
  double worst = 0.0;
  auto compare = [&](const std::vector<float>& logits, int64_t n) {
    EXPECT_EQ(st.length, n);
    EXPECT_EQ(static_cast<int64_t>(logits.size()), V);
    const double err = test::max_rel_error(logits.data(), ref[n].data(), V);
    worst = std::max(worst, err);
    EXPECT_LE(err, kTol) << what << ": logits after " << n << " tokens";
  };
  int64_t done = 0;
  for (int64_t e : ends) {
    compare(prefill(st, std::vector<int32_t>(seq.begin() + done, seq.begin() + e)), e);
    done = e;
  }
  for (int64_t n = done; n < static_cast<int64_t>(seq.size()); ++n) compare(decode_step(st, seq[n]), n + 1);
  return worst;
}

TEST_P(DecodeTest, EveryStepEqualsTheForwardOfItsPrefix) {
  const Model m = load_case(GetParam());
  const std::vector<int32_t> seq = golden_tokens(GetParam());
  const auto& ref = reference(m, GetParam());
  double worst = 0.0;
  // Prompts: one token, shorter than a pool, a pool and one more, a chunk ± 1.
  for (int64_t prompt : {1, 3, 4, 5, 63, 64, 65})
    worst = std::max(worst, check_decode(m, seq, ref, {prompt}, "prompt " + std::to_string(prompt)));
  std::printf("[decode] %s: worst max|dlogit|/max|logit| over all steps = %.3g\n", GetParam().c_str(), worst);
}

TEST_P(DecodeTest, PrefillInPiecesContinuesTheSequence) {
  const Model m = load_case(GetParam());
  const std::vector<int32_t> seq = golden_tokens(GetParam());
  const auto& ref = reference(m, GetParam());
  // Pieces that end inside pools and chunks and cross both; then decode.
  check_decode(m, seq, ref, {2, 30, 67, 130}, "pieces");
  // Prefill with threads, where the cached layers run their parallel loops (decode steps run none).
  cpu::set_num_threads(2);
  check_decode(m, seq, ref, {100, kLength}, "pieces, 2 threads");
  cpu::set_num_threads(1);
}

TEST_P(DecodeTest, CachesHoldWhatTheNextTokenNeeds) {
  const Model m = load_case(GetParam());
  const ModelConfig& c = m.config();
  const std::vector<int32_t> seq = golden_tokens(GetParam());
  DecodeState st(m);
  prefill(st, std::vector<int32_t>(seq.begin(), seq.begin() + 65));
  decode_step(st, seq[65]);
  decode_step(st, seq[66]);
  const int64_t n = 67, P = c.index_kpool, ID = c.index_head_dim, HK = c.linear_num_heads * c.linear_head_dim;
  EXPECT_EQ(st.length, n);
  for (size_t i = 0; i < m.weights().layers.size(); ++i) {
    const LayerWeights& lw = m.weights().layers[i];
    ASSERT_EQ(st.kda[i].has_value(), lw.kda.has_value()) << "layer " << i;
    ASSERT_EQ(st.dsa[i].has_value(), lw.dsa.has_value()) << "layer " << i;
    if (lw.kda) {
      // The last W−1 pre-conv q, k, v rows, and a K×K state per head.
      EXPECT_EQ(static_cast<int64_t>(st.kda[i]->conv.size()), 3 * (c.linear_conv_kernel_dim - 1) * HK);
      EXPECT_EQ(static_cast<int64_t>(st.kda[i]->state.size()), HK * c.linear_head_dim);
      EXPECT_TRUE(std::any_of(st.kda[i]->state.begin(), st.kda[i]->state.end(), [](float x) { return x != 0; }));
    } else {
      const DsaCache& d = *st.dsa[i];
      EXPECT_EQ(d.length, n);
      EXPECT_EQ(static_cast<int64_t>(d.latent.size()), n * c.kv_lora_rank);  // latents only, never k or v
      // Full indexers keep one key per complete pool plus the raw keys of the incomplete one; shared ones nothing.
      const bool full = lw.dsa->indexer.has_value();
      EXPECT_EQ(static_cast<int64_t>(d.pool_key.size()), full ? n / P * ID : 0);
      EXPECT_EQ(static_cast<int64_t>(d.pending_key.size()), full ? n % P * ID : 0);
      EXPECT_EQ(static_cast<int64_t>(d.pending_gate.size()), full ? n % P * ID : 0);
    }
  }
}

TEST_P(DecodeTest, BadTokenIsAnErrorAndLeavesTheStateAlone) {
  const Model m = load_case(GetParam());
  const std::vector<int32_t> seq = golden_tokens(GetParam());
  const auto ref = prefix_logits(m, std::vector<int32_t>(seq.begin(), seq.begin() + 12), decode_semantics(m.config()));
  DecodeState st(m);
  EXPECT_THROW(prefill(st, {}), Error);
  prefill(st, std::vector<int32_t>(seq.begin(), seq.begin() + 10));
  EXPECT_THROW(prefill(st, {seq[10], static_cast<int32_t>(m.config().vocab_size)}), Error);
  EXPECT_THROW(decode_step(st, -1), Error);
  EXPECT_EQ(st.length, 10);
  const auto l11 = decode_step(st, seq[10]);
  EXPECT_LE(test::max_rel_error(l11.data(), ref[11].data(), l11.size()), kTol);
}

// The cases whose every query selects at least one key (the tail is on, or pools are single tokens).
std::vector<std::string> cases_without_empty_selections() {
  std::vector<std::string> out;
  for (const std::string& name : cases()) {
    const ModelConfig c = load_case(name).config();
    if (c.index_kpool_always_select_tail || c.index_kpool == 1) out.push_back(name);
  }
  return out;
}

class SelectingCases : public ::testing::TestWithParam<std::string> {};

TEST_P(SelectingCases, SeenKeysChangeNothingWhenEveryQuerySelectsSomething) {
  const Model m = load_case(GetParam());
  PackedBatch b;
  b.add(golden_tokens(GetParam()));
  ForwardOptions seen;
  seen.empty_selection = EmptySelection::SeenKeys;
  EXPECT_EQ(m.forward(b).data, m.forward(b, seen).data);
}

INSTANTIATE_TEST_SUITE_P(Cases, DecodeTest, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return test::param_name(info.param); });
INSTANTIATE_TEST_SUITE_P(Cases, SelectingCases, ::testing::ValuesIn(cases_without_empty_selections()),
                         [](const auto& info) { return test::param_name(info.param); });

// The documented exception (decode.h): with the tail off and kpool 4, queries 0 … 2 select nothing. transformers'
// batch forward spreads them over all keys of the sequence, future ones included, so the forward of a prefix
// changes the earlier positions' outputs as the prefix grows; decode attends to the keys seen so far.
TEST(DecodeTailOff, EmptySelectionsAttendToThePastOnly) {
  cpu::set_num_threads(1);
  const Model m = load_case("fp32_tail_off");
  ASSERT_FALSE(m.config().index_kpool_always_select_tail);
  ASSERT_EQ(m.config().index_kpool, 4);
  const std::vector<int32_t> seq = golden_tokens("fp32_tail_off");
  const std::vector<int32_t> head(seq.begin(), seq.begin() + 8);
  const auto transformers = prefix_logits(m, head, ForwardOptions{});
  const int64_t V = m.config().vocab_size;
  DecodeState st(m);
  // One token: the only key is the token itself under both semantics, so they must agree.
  const auto first = prefill(st, {seq[0]});
  EXPECT_LE(test::max_rel_error(first.data(), transformers[1].data(), V), kTol);
  // From two tokens on they differ (position 0 sees position 1 in the batch forward, not in decode) …
  for (int64_t n = 2; n <= 8; ++n) {
    const auto lg = decode_step(st, seq[n - 1]);
    EXPECT_GT(test::max_rel_error(lg.data(), transformers[n].data(), V), 1e-3) << n << " tokens";
  }
  // … and decode is the causal forward (EveryStepEqualsTheForwardOfItsPrefix checks it step by step).
}

// ---- generate()

Model tiny() { return Model::load(test::golden_dir("tiny-glm5-next")); }

std::vector<int32_t> bytes(const std::string& s) { return std::vector<int32_t>(s.begin(), s.end()); }

TEST(Generate, GreedyIsTheArgmaxOfTheForwardAtEveryStep) {
  cpu::set_num_threads(1);
  const Model m = tiny();
  const int64_t V = m.config().vocab_size;
  const std::vector<int32_t> prompt = bytes("The quick brown fox");
  GenerateOptions o;
  o.max_new_tokens = 60;
  o.sampling.temperature = 0.0;
  o.sampling.top_logprobs = 2;
  const Generation g = generate(m, prompt, o);
  ASSERT_EQ(g.tokens.size(), 60u);
  ASSERT_EQ(g.logprobs.size(), 60u);
  ASSERT_EQ(g.top.size(), 60u);
  EXPECT_FALSE(g.stopped);
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), g.tokens.begin(), g.tokens.end());
  PackedBatch b;
  b.add(all);
  const Tensor lg = m.forward(b);  // causal: row t is the forward of the prefix ending at t
  for (size_t i = 0; i < g.tokens.size(); ++i) {
    const float* row = lg.ptr() + (prompt.size() - 1 + i) * V;
    std::vector<float> sorted(row, row + V);
    std::sort(sorted.rbegin(), sorted.rend());
    ASSERT_GT(sorted[0] - sorted[1], 1e-3) << "near-tie at step " << i << ": the check would depend on rounding";
    EXPECT_EQ(g.tokens[i], std::max_element(row, row + V) - row) << "step " << i;
    EXPECT_EQ(g.top[i][0].token, g.tokens[i]);
    EXPECT_DOUBLE_EQ(g.top[i][0].logprob, g.logprobs[i]);
  }
  // The reported logprobs are what scoring the whole text gives.
  const auto scored = m.next_token_logprobs(b)[0];
  for (size_t i = 0; i < g.tokens.size(); ++i)
    EXPECT_NEAR(g.logprobs[i], scored[prompt.size() - 1 + i], kLogprobTol) << "step " << i;
}

TEST(Generate, SampledLogprobsEqualScoring) {
  cpu::set_num_threads(1);
  for (const char* name : {"tiny-glm5-next", "bf16_sharded", "fp32_flat_softplus"}) {
    const Model m = Model::load(test::golden_dir(name));
    GenerateOptions o;
    o.max_new_tokens = 80;
    o.sampling.temperature = 0.8;
    o.sampling.top_p = 0.95;
    o.sampling.seed = 11;
    const std::vector<int32_t> prompt = bytes("Once upon a time");
    const Generation g = generate(m, prompt, o);
    ASSERT_EQ(g.tokens.size(), 80u);
    std::vector<int32_t> all = prompt;
    all.insert(all.end(), g.tokens.begin(), g.tokens.end());
    PackedBatch b;
    b.add(all);
    const auto scored = m.next_token_logprobs(b)[0];
    double worst = 0.0;
    for (size_t i = 0; i < g.tokens.size(); ++i) {
      worst = std::max(worst, std::fabs(g.logprobs[i] - scored[prompt.size() - 1 + i]));
      EXPECT_NEAR(g.logprobs[i], scored[prompt.size() - 1 + i], kLogprobTol) << name << " step " << i;
    }
    std::printf("[generate] %s: worst |logprob - score| = %.3g\n", name, worst);
  }
}

TEST(Generate, SeedsStopTokensAndLimits) {
  cpu::set_num_threads(1);
  const Model m = tiny();
  const std::vector<int32_t> prompt = bytes("Hello");
  GenerateOptions o;
  o.max_new_tokens = 30;
  o.sampling.temperature = 1.0;
  o.sampling.seed = 5;
  const Generation a = generate(m, prompt, o);
  EXPECT_EQ(a.tokens.size(), 30u);
  EXPECT_EQ(generate(m, prompt, o).tokens, a.tokens);  // same seed, same tokens
  o.sampling.seed = 6;
  EXPECT_NE(generate(m, prompt, o).tokens, a.tokens);

  // A stop token ends generation right after it is produced, and is part of the result; one never produced
  // changes nothing.
  int32_t unused = 0;
  while (std::find(a.tokens.begin(), a.tokens.end(), unused) != a.tokens.end()) ++unused;
  o.sampling.seed = 5;
  o.stop_tokens = {unused, a.tokens[7]};
  const Generation s = generate(m, prompt, o);
  const size_t first = std::find(a.tokens.begin(), a.tokens.end(), a.tokens[7]) - a.tokens.begin();
  EXPECT_TRUE(s.stopped);
  EXPECT_EQ(s.tokens, std::vector<int32_t>(a.tokens.begin(), a.tokens.begin() + first + 1));
  EXPECT_EQ(s.logprobs, std::vector<double>(a.logprobs.begin(), a.logprobs.begin() + first + 1));
  EXPECT_FALSE(s.eos);

  // An eos token ends generation the same way, and is flagged so that callers leave it out of the text.
  o.stop_tokens.clear();
  o.eos_tokens = {unused, a.tokens[7]};
  const Generation e = generate(m, prompt, o);
  EXPECT_TRUE(e.stopped);
  EXPECT_TRUE(e.eos);
  EXPECT_EQ(e.tokens, s.tokens);
  EXPECT_EQ(e.logprobs, s.logprobs);
  o.eos_tokens = {256};
  EXPECT_THROW(generate(m, prompt, o), Error);
  o.eos_tokens.clear();
  EXPECT_FALSE(generate(m, prompt, o).eos);

  o.stop_tokens.clear();
  o.max_new_tokens = 0;
  EXPECT_TRUE(generate(m, prompt, o).tokens.empty());
  o.max_new_tokens = 1;
  EXPECT_EQ(generate(m, prompt, o).tokens.size(), 1u);

  o.max_new_tokens = -1;
  EXPECT_THROW(generate(m, prompt, o), Error);
  o.max_new_tokens = 3;
  EXPECT_THROW(generate(m, {}, o), Error);
  EXPECT_THROW(generate(m, {1, 256}, o), Error);
  o.stop_tokens = {256};
  EXPECT_THROW(generate(m, prompt, o), Error);
  o.stop_tokens.clear();
  o.sampling.top_p = 0.0;
  EXPECT_THROW(generate(m, prompt, o), Error);
}

}  // namespace
}  // namespace nextlm
