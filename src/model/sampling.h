// Next-token sampling from logits: greedy, temperature, top-k, top-p, min-p, with a seeded, portable random stream
// (std::mt19937_64 and our own uniform and categorical draws, so a seed gives the same tokens on every platform).
#pragma once
#include <cstdint>
#include <random>
#include <vector>

namespace nextlm {

// The filters run in the order of the fields (as transformers' logits processors): temperature, then top-k, top-p
// and min-p, each on the distribution renormalised over what the previous ones kept. The most likely token always
// survives. Ties in probability are ordered by token id (lower first).
struct SamplingOptions {
  double temperature = 1.0;  // divides the logits; 0 = greedy (argmax, lowest id on a tie; no random draw)
  int64_t top_k = 0;         // keep the k most likely tokens; 0 = no limit
  double top_p = 1.0;        // keep the smallest most-likely-first prefix whose probability mass is ≥ top_p; 1 = all
  double min_p = 0.0;        // keep tokens whose probability is ≥ min_p · the largest probability; 0 = all
  uint64_t seed = 0;         // seeds the random stream of a Sampler
  int64_t top_logprobs = 0;  // also report this many most likely tokens with their log-probabilities
};

// Throws Error naming the field: temperature must be finite and ≥ 0, top_k ≥ 0, top_p in (0, 1], min_p in [0, 1],
// top_logprobs ≥ 0.
void validate(const SamplingOptions& opt);

struct TokenLogprob {
  int32_t token = 0;
  double logprob = 0.0;
};

// A chosen token. `logprob` and `top` are log-probabilities of the model's own distribution, log_softmax of the raw
// logits, not of the tempered or filtered one that the token was drawn from: that is what `nextlm score` reports
// for the same text, so generation and scoring agree.
struct Sample {
  int32_t token = 0;
  double logprob = 0.0;
  std::vector<TokenLogprob> top;  // the top_logprobs most likely tokens, most likely first
};

// The tokens the filters keep, most likely first, with their probabilities renormalised over the kept set.
// Needs temperature > 0. logits [V]; NaN or +inf logits are an Error, −inf ones have probability 0.
struct Candidate {
  int32_t token = 0;
  double prob = 0.0;
};
std::vector<Candidate> sampling_candidates(const float* logits, int64_t V, const SamplingOptions& opt);

// log_softmax of one row of logits, in double (the same arithmetic as Model::next_token_logprobs).
std::vector<double> log_softmax(const float* logits, int64_t V);

// A uniform double in [0, 1) from the top 53 bits of one draw.
double uniform01(std::mt19937_64& rng);

class Sampler {
 public:
  explicit Sampler(const SamplingOptions& opt);  // validates opt

  // Chooses the next token from logits [V]; a sampled (non-greedy) choice uses one uniform draw.
  Sample sample(const float* logits, int64_t V);

 private:
  SamplingOptions opt_;
  std::mt19937_64 rng_;
};

}  // namespace nextlm
