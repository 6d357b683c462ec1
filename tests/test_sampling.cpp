// Sampling on hand-made logits: greedy, the exact sets top-k / top-p / min-p keep (and the order they apply in),
// temperature, draw frequencies against the probabilities, seeded determinism, reported log-probabilities, errors.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>
#include <vector>

#include "core/error.h"
#include "model/sampling.h"

namespace nextlm {
namespace {

// Logits whose softmax is exactly proportional to p (up to rounding).
std::vector<float> logits_of(const std::vector<double>& p) {
  std::vector<float> l;
  for (double x : p) l.push_back(x > 0 ? static_cast<float>(std::log(x)) : -INFINITY);
  return l;
}

std::set<int32_t> kept(const std::vector<float>& logits, const SamplingOptions& o) {
  std::set<int32_t> s;
  for (const Candidate& c : sampling_candidates(logits.data(), static_cast<int64_t>(logits.size()), o))
    s.insert(c.token);
  return s;
}

SamplingOptions with(double temperature, int64_t top_k = 0, double top_p = 1.0, double min_p = 0.0) {
  SamplingOptions o;
  o.temperature = temperature;
  o.top_k = top_k;
  o.top_p = top_p;
  o.min_p = min_p;
  return o;
}

// Probabilities 0.05, 0.5, 0.15, 0.3 (most likely order: 1, 3, 2, 0), so filters must sort, not take a prefix.
const std::vector<double> kProbs{0.05, 0.5, 0.15, 0.3};

TEST(Sampling, GreedyIsArgmaxWithLowestIdOnTies) {
  Sampler s(with(0.0));
  const std::vector<float> a{0.1f, 2.0f, -1.0f, 1.9f};
  EXPECT_EQ(s.sample(a.data(), 4).token, 1);
  const std::vector<float> tie{0.1f, 3.0f, 3.0f, -INFINITY};
  EXPECT_EQ(s.sample(tie.data(), 4).token, 1);
  // Other filters do not matter at temperature 0.
  SamplingOptions o = with(0.0, 3, 0.5, 0.9);
  o.seed = 99;
  Sampler s2(o);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(s2.sample(a.data(), 4).token, 1);
}

TEST(Sampling, TopKKeepsTheKMostLikely) {
  const auto l = logits_of(kProbs);
  EXPECT_EQ(kept(l, with(1.0, 1)), (std::set<int32_t>{1}));
  EXPECT_EQ(kept(l, with(1.0, 2)), (std::set<int32_t>{1, 3}));
  EXPECT_EQ(kept(l, with(1.0, 3)), (std::set<int32_t>{1, 3, 2}));
  EXPECT_EQ(kept(l, with(1.0, 4)), (std::set<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(kept(l, with(1.0, 100)), (std::set<int32_t>{0, 1, 2, 3}));
  // A tie at the boundary goes to the lower id.
  const std::vector<float> tie{1.0f, 2.0f, 1.0f, 0.0f};
  EXPECT_EQ(kept(tie, with(1.0, 2)), (std::set<int32_t>{0, 1}));
  // top-k at any temperature keeps the same set.
  EXPECT_EQ(kept(l, with(7.0, 2)), (std::set<int32_t>{1, 3}));
}

TEST(Sampling, TopPKeepsTheSmallestSetReachingP) {
  const auto l = logits_of(kProbs);  // cumulative, most likely first: 0.5, 0.8, 0.95, 1
  EXPECT_EQ(kept(l, with(1.0, 0, 0.4)), (std::set<int32_t>{1}));
  EXPECT_EQ(kept(l, with(1.0, 0, 0.7)), (std::set<int32_t>{1, 3}));
  EXPECT_EQ(kept(l, with(1.0, 0, 0.9)), (std::set<int32_t>{1, 3, 2}));
  EXPECT_EQ(kept(l, with(1.0, 0, 0.99)), (std::set<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(kept(l, with(1.0, 0, 1.0)), (std::set<int32_t>{0, 1, 2, 3}));
  // After top-k = 3 the mass is renormalised over the three: 0.526, 0.842, 1. So top-p 0.82 keeps two of them,
  // whereas without top-k it keeps three (0.8 < 0.82).
  EXPECT_EQ(kept(l, with(1.0, 0, 0.82)), (std::set<int32_t>{1, 3, 2}));
  EXPECT_EQ(kept(l, with(1.0, 3, 0.82)), (std::set<int32_t>{1, 3}));
}

TEST(Sampling, MinPKeepsTokensAboveAFractionOfTheBest) {
  const auto l = logits_of(kProbs);
  EXPECT_EQ(kept(l, with(1.0, 0, 1.0, 0.5)), (std::set<int32_t>{1, 3}));        // p >= 0.25
  EXPECT_EQ(kept(l, with(1.0, 0, 1.0, 0.2)), (std::set<int32_t>{1, 3, 2}));     // p >= 0.1
  EXPECT_EQ(kept(l, with(1.0, 0, 1.0, 0.05)), (std::set<int32_t>{0, 1, 2, 3}));  // p >= 0.025
  EXPECT_EQ(kept(l, with(1.0, 0, 1.0, 1.0)), (std::set<int32_t>{1}));
  // min-p acts on the tempered distribution: at temperature 0.5, p ∝ p0², i.e. 0.0025, 0.25, 0.0225, 0.09, so
  // min-p 0.2 (threshold 0.05 of 0.25) keeps only tokens 1 and 3.
  EXPECT_EQ(kept(l, with(0.5, 0, 1.0, 0.2)), (std::set<int32_t>{1, 3}));
}

TEST(Sampling, CandidatesCarryTemperedRenormalisedProbabilities) {
  const auto l = logits_of(kProbs);
  const auto c = sampling_candidates(l.data(), 4, with(2.0, 3));
  ASSERT_EQ(c.size(), 3u);
  // At temperature 2, p ∝ sqrt(p0), over the three kept tokens, most likely first.
  const double z = std::sqrt(0.5) + std::sqrt(0.3) + std::sqrt(0.15);
  EXPECT_EQ(c[0].token, 1);
  EXPECT_EQ(c[1].token, 3);
  EXPECT_EQ(c[2].token, 2);
  EXPECT_NEAR(c[0].prob, std::sqrt(0.5) / z, 1e-6);
  EXPECT_NEAR(c[1].prob, std::sqrt(0.3) / z, 1e-6);
  EXPECT_NEAR(c[2].prob, std::sqrt(0.15) / z, 1e-6);
  // −inf logits never become candidates.
  const std::vector<float> masked{0.0f, -INFINITY, 1.0f};
  EXPECT_EQ(kept(masked, with(1.0)), (std::set<int32_t>{0, 2}));
}

// Counts of n draws against the expected probabilities: each within 5 standard errors sqrt(n p (1 − p)), so a
// correct sampler fails with probability ~1e-6 per token; a token of probability 0 must never appear.
void expect_frequencies(const std::vector<float>& logits, const SamplingOptions& o, const std::map<int32_t, double>& p,
                        int n) {
  Sampler s(o);
  std::map<int32_t, int> count;
  for (int i = 0; i < n; ++i) ++count[s.sample(logits.data(), static_cast<int64_t>(logits.size())).token];
  for (const auto& [tok, c] : count) EXPECT_TRUE(p.count(tok)) << "token " << tok << " drawn " << c << " times";
  for (const auto& [tok, prob] : p) {
    const double se = std::sqrt(n * prob * (1 - prob));
    EXPECT_NEAR(count[tok], n * prob, 5 * se + 1) << "token " << tok;
  }
}

TEST(Sampling, DrawFrequenciesMatchProbabilities) {
  const auto l = logits_of(kProbs);
  SamplingOptions o = with(1.0);
  o.seed = 1;
  expect_frequencies(l, o, {{0, 0.05}, {1, 0.5}, {2, 0.15}, {3, 0.3}}, 200000);
  // Temperature 0.5 and top-k 3: p ∝ p0² over tokens 1, 3, 2.
  o = with(0.5, 3);
  o.seed = 2;
  const double z = 0.25 + 0.09 + 0.0225;
  expect_frequencies(l, o, {{1, 0.25 / z}, {3, 0.09 / z}, {2, 0.0225 / z}}, 200000);
  // top-p 0.7 keeps tokens 1 and 3 in the ratio 5 : 3.
  o = with(1.0, 0, 0.7);
  o.seed = 3;
  expect_frequencies(l, o, {{1, 0.625}, {3, 0.375}}, 100000);
}

TEST(Sampling, SameSeedSameTokensAndAPortableStream) {
  std::vector<float> l(50);  // exact values in eighths, with ties
  for (size_t i = 0; i < l.size(); ++i) l[i] = static_cast<float>((i * 37) % 23) / 8.0f;
  SamplingOptions o = with(1.0, 0, 0.95);
  auto draw = [&](uint64_t seed) {
    o.seed = seed;
    Sampler s(o);
    std::vector<int32_t> t;
    for (int i = 0; i < 24; ++i) t.push_back(s.sample(l.data(), 50).token);
    return t;
  };
  EXPECT_EQ(draw(42), draw(42));
  EXPECT_NE(draw(42), draw(43));
  // The stream is mt19937_64 (fixed by the standard) and our own inverse-CDF draw, so these tokens are the same on
  // every platform and standard library; a change here changes every seeded generation.
  EXPECT_EQ(draw(42), (std::vector<int32_t>{47, 34, 47, 13, 22, 41, 39, 26, 8, 26, 18, 16,  //
                                            29, 34, 37, 12, 47, 21, 18, 41, 47, 13, 49, 41}));
  std::mt19937_64 rng(0);
  const double u = uniform01(rng);
  EXPECT_GE(u, 0.0);
  EXPECT_LT(u, 1.0);
}

TEST(Sampling, LogprobIsOfTheUnmodifiedDistribution) {
  const std::vector<float> l{1.0f, 3.0f, 2.0f, -1.0f};
  double z = 0;
  for (float x : l) z += std::exp(static_cast<double>(x));
  const std::vector<double> lp = log_softmax(l.data(), 4);
  for (int v = 0; v < 4; ++v) EXPECT_NEAR(lp[v], l[v] - std::log(z), 1e-12);
  // Whatever temperature and filters chose the token, its logprob is log_softmax of the raw logits.
  for (const SamplingOptions& o : {with(0.0), with(0.3, 2), with(5.0, 0, 0.5), with(1.0, 0, 1.0, 0.9)}) {
    SamplingOptions oo = o;
    oo.top_logprobs = 3;
    Sampler s(oo);
    for (int i = 0; i < 20; ++i) {
      const Sample x = s.sample(l.data(), 4);
      EXPECT_DOUBLE_EQ(x.logprob, lp[x.token]);
      ASSERT_EQ(x.top.size(), 3u);
      EXPECT_EQ(x.top[0].token, 1);
      EXPECT_EQ(x.top[1].token, 2);
      EXPECT_EQ(x.top[2].token, 0);
      for (const TokenLogprob& t : x.top) EXPECT_DOUBLE_EQ(t.logprob, lp[t.token]);
    }
  }
  SamplingOptions many = with(1.0);
  many.top_logprobs = 10;  // more than the vocabulary: all of it
  Sampler s(many);
  EXPECT_EQ(s.sample(l.data(), 4).top.size(), 4u);
}

TEST(Sampling, BadOptionsAndLogitsAreErrors) {
  EXPECT_THROW(Sampler(with(-1.0)), Error);
  EXPECT_THROW(Sampler(with(NAN)), Error);
  EXPECT_THROW(Sampler(with(INFINITY)), Error);
  EXPECT_THROW(Sampler(with(1.0, -1)), Error);
  EXPECT_THROW(Sampler(with(1.0, 0, 0.0)), Error);
  EXPECT_THROW(Sampler(with(1.0, 0, 1.5)), Error);
  EXPECT_THROW(Sampler(with(1.0, 0, 1.0, -0.1)), Error);
  EXPECT_THROW(Sampler(with(1.0, 0, 1.0, 1.1)), Error);
  Sampler s(with(1.0));
  const std::vector<float> nan{0.0f, NAN}, inf{0.0f, INFINITY}, none{-INFINITY, -INFINITY};
  EXPECT_THROW(s.sample(nan.data(), 2), Error);
  EXPECT_THROW(s.sample(inf.data(), 2), Error);
  EXPECT_THROW(s.sample(none.data(), 2), Error);
  Sampler g(with(0.0));
  EXPECT_THROW(g.sample(nan.data(), 2), Error);
}

}  // namespace
}  // namespace nextlm
