// Next-token sampling (see sampling.h). Probabilities in double; the draw walks the kept tokens most likely first.
#include "model/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"

namespace nextlm {

void validate(const SamplingOptions& o) {
  check(std::isfinite(o.temperature) && o.temperature >= 0.0, "temperature must be a finite number >= 0, got ",
        o.temperature);
  check(o.top_k >= 0, "top-k must be >= 0 (0 = no limit), got ", o.top_k);
  check(o.top_p > 0.0 && o.top_p <= 1.0, "top-p must be in (0, 1], got ", o.top_p);
  check(o.min_p >= 0.0 && o.min_p <= 1.0, "min-p must be in [0, 1], got ", o.min_p);
  check(o.top_logprobs >= 0, "top-logprobs must be >= 0, got ", o.top_logprobs);
}

namespace {

void check_logits(const float* logits, int64_t V) {
  check(V > 0, "sampling needs at least one logit");
  bool any = false;
  for (int64_t v = 0; v < V; ++v) {
    check(!std::isnan(logits[v]) && logits[v] != INFINITY, "logit of token ", v, " is ", logits[v]);
    any |= logits[v] != -INFINITY;
  }
  check(any, "every logit is -inf");
}

// Most likely first; the lower id first on a tie.
auto more_likely(const float* logits) {
  return [logits](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
}

void renormalise(std::vector<Candidate>& c) {
  double sum = 0.0;
  for (const Candidate& x : c) sum += x.prob;
  for (Candidate& x : c) x.prob /= sum;
}

}  // namespace

std::vector<double> log_softmax(const float* logits, int64_t V) {
  check_logits(logits, V);
  const float mx = *std::max_element(logits, logits + V);
  double sum = 0.0;
  for (int64_t v = 0; v < V; ++v) sum += std::exp(static_cast<double>(logits[v]) - mx);
  const double log_sum = std::log(sum);
  std::vector<double> out(V);
  for (int64_t v = 0; v < V; ++v) out[v] = static_cast<double>(logits[v]) - mx - log_sum;
  return out;
}

std::vector<Candidate> sampling_candidates(const float* logits, int64_t V, const SamplingOptions& opt) {
  validate(opt);
  check(opt.temperature > 0.0, "sampling candidates need a temperature > 0");
  check_logits(logits, V);
  std::vector<int32_t> order;
  for (int64_t v = 0; v < V; ++v)
    if (logits[v] != -INFINITY) order.push_back(static_cast<int32_t>(v));
  // top-k (independent of the temperature, which keeps the order).
  if (opt.top_k > 0 && opt.top_k < static_cast<int64_t>(order.size())) {
    std::partial_sort(order.begin(), order.begin() + opt.top_k, order.end(), more_likely(logits));
    order.resize(opt.top_k);
  } else {
    std::sort(order.begin(), order.end(), more_likely(logits));
  }

  // Tempered probabilities over what top-k kept.
  const double mx = logits[order[0]];
  std::vector<Candidate> c(order.size());
  for (size_t i = 0; i < order.size(); ++i) c[i] = {order[i], std::exp((logits[order[i]] - mx) / opt.temperature)};
  renormalise(c);

  if (opt.top_p < 1.0) {
    double mass = 0.0;
    size_t n = 0;
    while (n < c.size() && mass < opt.top_p) mass += c[n++].prob;
    c.resize(n);
    renormalise(c);
  }
  if (opt.min_p > 0.0) {
    const double threshold = opt.min_p * c[0].prob;
    size_t n = 1;
    while (n < c.size() && c[n].prob >= threshold) ++n;
    c.resize(n);
    renormalise(c);
  }
  return c;
}

double uniform01(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

Sampler::Sampler(const SamplingOptions& opt) : opt_(opt), rng_(opt.seed) { validate(opt_); }

Sample Sampler::sample(const float* logits, int64_t V) {
  const std::vector<double> lp = log_softmax(logits, V);  // also rejects NaN / +inf logits
  Sample s;
  if (opt_.temperature == 0.0) {
    s.token = static_cast<int32_t>(std::max_element(logits, logits + V) - logits);  // the first maximum
  } else {
    const std::vector<Candidate> c = sampling_candidates(logits, V, opt_);
    // Inverse CDF: the first candidate whose cumulative probability exceeds u; rounding can leave u beyond the
    // last sum, which then takes the last candidate of non-zero probability.
    const double u = uniform01(rng_);
    double cum = 0.0;
    s.token = -1;
    for (const Candidate& x : c) {
      if (x.prob > 0.0) s.token = x.token;
      cum += x.prob;
      if (u < cum) break;
    }
  }
  s.logprob = lp[s.token];
  if (opt_.top_logprobs > 0) {
    std::vector<int32_t> ids(V);
    std::iota(ids.begin(), ids.end(), 0);
    const int64_t n = std::min<int64_t>(opt_.top_logprobs, V);
    std::partial_sort(ids.begin(), ids.begin() + n, ids.end(), more_likely(logits));
    for (int64_t i = 0; i < n; ++i) s.top.push_back({ids[i], lp[ids[i]]});
  }
  return s;
}

}  // namespace nextlm
