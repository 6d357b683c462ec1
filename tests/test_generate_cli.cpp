// End-to-end tests of `nextlm generate`: greedy tokens are the argmax of the full forward step by step, the
// reported log-probabilities are what `nextlm score` gives for prompt + generated tokens (the train–inference
// agreement check), seeds, stop tokens, text and JSON output, byte-level prompts, and bad arguments (one-line
// "error:", exit 2 for usage and 1 for input or model errors).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cpu/linear.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "test_util.h"

namespace nextlm::test {
namespace {

using nlohmann::json;

// See test_decode.cpp: log p = logit − logsumexp, so decode's logit tolerance (5e-5 of max|logit| ≈ 5) bounds the
// difference to scoring by ~5e-4; measured ≤ 3e-5.
constexpr double kLogprobTol = 1e-4;




std::string describe(const CliResult& r) {
  return "rc=" + std::to_string(r.rc) + "\nstdout:\n" + r.out + "\nstderr:\n" + r.err;
}

void expect_error(const CliResult& r, int rc, const std::vector<std::string>& mentions) {
  EXPECT_EQ(r.rc, rc) << describe(r);
  ASSERT_FALSE(r.err.empty()) << describe(r);
  EXPECT_EQ(r.err.rfind("error:", 0), 0u) << describe(r);
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "stderr is not one line\n" << describe(r);
  for (const std::string& m : mentions)
    EXPECT_NE(r.err.find(m), std::string::npos) << "no \"" << m << "\" in\n" << describe(r);
  EXPECT_TRUE(r.out.empty()) << describe(r);
}

std::string ids(const std::vector<int32_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(v[i]);
  }
  return s;
}

std::vector<int32_t> bytes(const std::string& s) {
  std::vector<int32_t> v;
  for (unsigned char c : s) v.push_back(c);
  return v;
}

struct Generated {
  std::vector<int32_t> tokens;
  std::vector<double> logprobs;
};

// Runs generate with --format json and parses its one line.
Generated generate_json(const std::string& model, const std::string& args) {
  const CliResult r = run_nextlm("generate --model " + shell_quote(model) + " --format json --threads 1 " + args);
  EXPECT_EQ(r.rc, 0) << describe(r);
  Generated g;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
  const json j = json::parse(r.out);
  EXPECT_EQ(j.size(), 2u) << r.out;
  g.tokens = j.at("tokens").get<std::vector<int32_t>>();
  g.logprobs = j.at("logprobs").get<std::vector<double>>();
  EXPECT_EQ(g.tokens.size(), g.logprobs.size());
  return g;
}

// `nextlm score` of one sequence.
std::vector<double> score(const std::string& model, const std::vector<int32_t>& seq) {
  TempDir tmp;
  std::ofstream(tmp.str("in.jsonl")) << json{{"tokens", seq}}.dump() << "\n";
  const CliResult r = run_nextlm("score --model " + shell_quote(model) + " --threads 1 --input " + shell_quote(tmp.str("in.jsonl")));
  EXPECT_EQ(r.rc, 0) << describe(r);
  return json::parse(r.out).at("logprobs").get<std::vector<double>>();
}

// Generated log-probabilities against scoring prompt + generated tokens.
void expect_logprobs_match_score(const std::string& model, const std::vector<int32_t>& prompt, const Generated& g) {
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), g.tokens.begin(), g.tokens.end());
  const std::vector<double> s = score(model, all);
  ASSERT_EQ(s.size(), all.size() - 1);
  for (size_t i = 0; i < g.tokens.size(); ++i)
    EXPECT_NEAR(g.logprobs[i], s[prompt.size() - 1 + i], kLogprobTol) << model << " new token " << i;
}

std::string tiny() { return golden_dir("tiny-glm5-next"); }

TEST(GenerateCli, GreedyIsTheForwardArgmaxAndMatchesScore) {
  const std::vector<int32_t> prompt = bytes("The quick brown fox");
  const Generated g = generate_json(tiny(), "--prompt-tokens " + ids(prompt) + " --max-new-tokens 40 --temperature 0");
  ASSERT_EQ(g.tokens.size(), 40u);
  cpu::set_num_threads(1);  // tiny forwards: threads only contend with the other suite ctest runs
  const Model m = Model::load(tiny());
  const int64_t V = m.config().vocab_size;
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), g.tokens.begin(), g.tokens.end());
  for (size_t i = 0; i < g.tokens.size(); ++i) {
    PackedBatch b;  // the forward of exactly the prefix the step saw
    b.add(std::vector<int32_t>(all.begin(), all.begin() + prompt.size() + i));
    const Tensor lg = m.forward(b);
    const float* row = lg.ptr() + (b.num_tokens() - 1) * V;
    std::vector<float> sorted(row, row + V);
    std::sort(sorted.rbegin(), sorted.rend());
    ASSERT_GT(sorted[0] - sorted[1], 1e-3) << "near-tie at step " << i << ": the check would depend on rounding";
    EXPECT_EQ(g.tokens[i], std::max_element(row, row + V) - row) << "step " << i;
  }
  expect_logprobs_match_score(tiny(), prompt, g);
}

TEST(GenerateCli, SampledLogprobsMatchScoreAndSeedsRepeat) {
  const std::vector<int32_t> prompt = bytes("Once upon a time");
  const std::string args = "--prompt-tokens " + ids(prompt) +
                           " --max-new-tokens 60 --temperature 0.9 --top-k 50 --top-p 0.95 --min-p 0.01";
  for (const std::string& model : {tiny(), golden_dir("bf16_sharded")}) {
    const Generated g = generate_json(model, args + " --seed 7");
    ASSERT_EQ(g.tokens.size(), 60u);
    expect_logprobs_match_score(model, prompt, g);
    const Generated again = generate_json(model, args + " --seed 7");
    EXPECT_EQ(again.tokens, g.tokens);
    EXPECT_EQ(again.logprobs, g.logprobs);
    EXPECT_NE(generate_json(model, args + " --seed 8").tokens, g.tokens);
  }
}

TEST(GenerateCli, PromptTextIsItsUtf8BytesAndTextOutputIsBytes) {
  const std::string text = "h\xC3\xA9llo, world";  // "héllo, world"
  const std::string common = " --max-new-tokens 25 --temperature 0.7 --seed 3";
  const Generated from_text = generate_json(tiny(), "--prompt " + shell_quote(text) + common);
  const Generated from_ids = generate_json(tiny(), "--prompt-tokens " + ids(bytes(text)) + common);
  EXPECT_EQ(from_text.tokens, from_ids.tokens);
  EXPECT_EQ(from_text.logprobs, from_ids.logprobs);
  // Text format prints the new tokens as raw bytes, then a newline.
  const CliResult r = run_nextlm("generate --model " + shell_quote(tiny()) + " --threads 1 --prompt " + shell_quote(text) + common);
  ASSERT_EQ(r.rc, 0) << describe(r);
  std::string expected;
  for (int32_t t : from_text.tokens) expected += static_cast<char>(t);
  EXPECT_EQ(r.out, expected + "\n");
}

TEST(GenerateCli, StopTokensAndLimits) {
  const std::string base = "--prompt-tokens 72,105 --temperature 0 --max-new-tokens ";
  const Generated all = generate_json(tiny(), base + "30");
  ASSERT_EQ(all.tokens.size(), 30u);
  const int32_t stop = all.tokens[5];
  const size_t first = std::find(all.tokens.begin(), all.tokens.end(), stop) - all.tokens.begin();
  int32_t unused = 0;  // a stop token never produced changes nothing
  while (std::find(all.tokens.begin(), all.tokens.end(), unused) != all.tokens.end()) ++unused;
  const Generated stopped =
      generate_json(tiny(), base + "30 --stop-tokens " + std::to_string(unused) + "," + std::to_string(stop));
  EXPECT_EQ(stopped.tokens, std::vector<int32_t>(all.tokens.begin(), all.tokens.begin() + first + 1));
  EXPECT_EQ(stopped.logprobs, std::vector<double>(all.logprobs.begin(), all.logprobs.begin() + first + 1));
  const Generated one = generate_json(tiny(), base + "1");
  EXPECT_EQ(one.tokens, std::vector<int32_t>{all.tokens[0]});
  const CliResult zero = run_nextlm("generate --model " + shell_quote(tiny()) + " --format json " + base + "0");
  EXPECT_EQ(zero.rc, 0) << describe(zero);
  EXPECT_EQ(zero.out, "{\"tokens\": [], \"logprobs\": []}\n");
}

// The model's eos_token_id (here a list) ends generation by default: the eos token is in "tokens" and "logprobs" (it
// was sampled) but not in the text; --ignore-eos turns it off; generation_config.json's eos_token_id wins over
// config.json's, and one outside the vocabulary is an error.
TEST(GenerateCli, EosStopsUnlessIgnored) {
  const std::string base = "--prompt-tokens 72,105 --temperature 0 --max-new-tokens 30";
  const Generated all = generate_json(tiny(), base);
  ASSERT_EQ(all.tokens.size(), 30u);
  auto first = [&](int32_t t) { return std::find(all.tokens.begin(), all.tokens.end(), t) - all.tokens.begin(); };
  const int32_t eos = all.tokens[5];
  int32_t unused = 0;
  while (std::find(all.tokens.begin(), all.tokens.end(), unused) != all.tokens.end()) ++unused;
  TempDir tmp;
  copy_dir(tiny(), tmp.str());
  json cfg;
  std::ifstream(tmp.str("config.json")) >> cfg;
  cfg["text_config"]["eos_token_id"] = {unused, eos};
  std::ofstream(tmp.str("config.json")) << cfg.dump(2);
  const std::string model = shell_quote(tmp.str());

  const Generated stopped = generate_json(tmp.str(), base);
  const size_t n = first(eos) + 1;
  EXPECT_EQ(stopped.tokens, std::vector<int32_t>(all.tokens.begin(), all.tokens.begin() + n));
  EXPECT_EQ(stopped.logprobs, std::vector<double>(all.logprobs.begin(), all.logprobs.begin() + n));
  const CliResult text = run_nextlm("generate --model " + model + " --threads 1 " + base);
  ASSERT_EQ(text.rc, 0) << describe(text);
  std::string expected;
  for (size_t i = 0; i + 1 < n; ++i) expected += static_cast<char>(all.tokens[i]);
  EXPECT_EQ(text.out, expected + "\n");
  EXPECT_NE(text.err.find("(eos token)"), std::string::npos) << text.err;
  EXPECT_EQ(generate_json(tmp.str(), base + " --ignore-eos").tokens, all.tokens);

  std::ofstream(tmp.str("generation_config.json")) << json{{"eos_token_id", all.tokens[2]}}.dump();
  EXPECT_EQ(generate_json(tmp.str(), base).tokens,
            std::vector<int32_t>(all.tokens.begin(), all.tokens.begin() + first(all.tokens[2]) + 1));
  std::ofstream(tmp.str("generation_config.json")) << R"({"eos_token_id": [1, 256]})";
  expect_error(run_nextlm("generate --model " + model + " " + base), 1,
               {"generation_config.json", "eos_token_id 256", "outside the vocabulary"});
  EXPECT_EQ(generate_json(tmp.str(), base + " --ignore-eos").tokens, all.tokens);
}

TEST(GenerateCli, ModelsWithoutByteVocabularyTakeTokenIds) {
  TempDir tmp;
  write_wide_vocab_model(tmp.str());
  expect_error(run_nextlm("generate --model " + shell_quote(tmp.str()) + " --prompt hi --max-new-tokens 2"), 1,
               {"--prompt", "tokenizer", "not available", "300"});
  const std::string args = "--prompt-tokens 299,3,150 --max-new-tokens 6 --temperature 0";
  const Generated g = generate_json(tmp.str(), args);
  ASSERT_EQ(g.tokens.size(), 6u);
  // Text format prints the ids, space-separated.
  const CliResult r = run_nextlm("generate --model " + shell_quote(tmp.str()) + " --threads 1 " + args);
  ASSERT_EQ(r.rc, 0) << describe(r);
  std::string expected;
  for (size_t i = 0; i < g.tokens.size(); ++i) {
    if (i) expected += ' ';
    expected += std::to_string(g.tokens[i]);
  }
  EXPECT_EQ(r.out, expected + "\n");
  expect_logprobs_match_score(tmp.str(), {299, 3, 150}, g);
}

TEST(GenerateCli, BadArguments) {
  const std::string m = " --model " + shell_quote(tiny());
  const std::string ok = m + " --prompt-tokens 1,2 --max-new-tokens 2";
  // Usage errors: exit 2.
  expect_error(run_nextlm("generate" + m + " --max-new-tokens 2"), 2, {"no prompt"});
  expect_error(run_nextlm("generate" + ok + " --prompt hi"), 2, {"--prompt-tokens", "--prompt", "not both"});
  expect_error(run_nextlm("generate" + m + " --prompt-tokens 1,2"), 2, {"--max-new-tokens"});
  expect_error(run_nextlm("generate" + m + " --prompt-tokens 1,2 --max-new-tokens -1"), 2, {"--max-new-tokens"});
  expect_error(run_nextlm("generate" + m + " --prompt-tokens 1,2 --max-new-tokens x"), 2, {"--max-new-tokens"});
  for (const char* list : {"1,,2", "a", "-1", "1.5", "1,", "99999999999"})
    expect_error(run_nextlm("generate" + m + " --max-new-tokens 2 --prompt-tokens " + shell_quote(list)), 2,
                 {"--prompt-tokens", "not a token id"});
  expect_error(run_nextlm("generate" + m + " --max-new-tokens 2 --prompt-tokens ''"), 2, {"--prompt-tokens"});
  expect_error(run_nextlm("generate" + m + " --max-new-tokens 2 --prompt ''"), 2, {"--prompt"});
  expect_error(run_nextlm("generate" + ok + " --stop-tokens 3,x"), 2, {"--stop-tokens", "\"x\""});
  expect_error(run_nextlm("generate" + ok + " --temperature -1"), 2, {"--temperature"});
  expect_error(run_nextlm("generate" + ok + " --temperature nan"), 2, {"--temperature"});
  expect_error(run_nextlm("generate" + ok + " --temperature abc"), 2, {"--temperature"});
  expect_error(run_nextlm("generate" + ok + " --top-k -1"), 2, {"--top-k"});
  expect_error(run_nextlm("generate" + ok + " --top-p 0"), 2, {"--top-p"});
  expect_error(run_nextlm("generate" + ok + " --top-p 1.5"), 2, {"--top-p"});
  expect_error(run_nextlm("generate" + ok + " --min-p -0.5"), 2, {"--min-p"});
  expect_error(run_nextlm("generate" + ok + " --min-p 2"), 2, {"--min-p"});
  expect_error(run_nextlm("generate" + ok + " --seed -5"), 2, {"--seed"});
  expect_error(run_nextlm("generate" + ok + " --format xml"), 2, {"--format", "xml"});
  expect_error(run_nextlm("generate" + ok + " --device tpu"), 2, {"--device", "tpu"});
  expect_error(run_nextlm("generate" + ok + " --batch-invariant"), 2, {"--batch-invariant", "--device cuda"});
  expect_error(run_nextlm("generate" + ok + " --device cpu --batch-invariant"), 2, {"--batch-invariant", "--device cuda"});
  expect_error(run_nextlm("generate" + ok + " --threads 0"), 2, {"--threads"});
  expect_error(run_nextlm("generate --prompt-tokens 1 --max-new-tokens 2"), 2, {"--model"});
  // Input and model errors: exit 1.
  expect_error(run_nextlm("generate" + m + " --prompt-tokens 1,256 --max-new-tokens 2"), 1,
               {"--prompt-tokens", "256", "outside the vocabulary"});
  expect_error(run_nextlm("generate" + ok + " --stop-tokens 300000"), 1, {"--stop-tokens", "300000", "outside"});
  expect_error(run_nextlm("generate --model /nonexistent/model --prompt-tokens 1 --max-new-tokens 2"), 1,
               {"/nonexistent/model"});
}

}  // namespace
}  // namespace nextlm::test
