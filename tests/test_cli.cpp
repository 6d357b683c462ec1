// End-to-end tests of the `nextlm` executable: `score` (JSONL, text, --output, --logits-out), `info`, --help,
// --version, and every kind of bad input (one-line "error:" on stderr, exit 2 for usage errors and 1 for input or
// model errors, and no output file left behind or clobbered).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "test_util.h"

namespace nextlm::test {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr int64_t kVocab = 256;




std::string model_dir() { return golden_dir("fp32_tail_off"); }

void write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
  ASSERT_TRUE(f.good()) << path;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> lines;
  std::string line;
  std::istringstream is(s);
  while (std::getline(is, line)) lines.push_back(line);
  return lines;
}

std::string describe(const CliResult& r) { return "rc=" + std::to_string(r.rc) + "\nstdout:\n" + r.out + "\nstderr:\n" + r.err; }

// Exactly one line on stderr, starting with "error:", naming every string of `mentions`, and the exit code `rc`.
void expect_error(const CliResult& r, int rc, const std::vector<std::string>& mentions) {
  EXPECT_EQ(r.rc, rc) << describe(r);
  ASSERT_FALSE(r.err.empty()) << describe(r);
  EXPECT_EQ(r.err.rfind("error:", 0), 0u) << describe(r);
  EXPECT_EQ(r.err.back(), '\n') << describe(r);
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "stderr is not one line\n" << describe(r);
  EXPECT_EQ(r.err.find('\r'), std::string::npos) << describe(r);
  for (const std::string& m : mentions) EXPECT_NE(r.err.find(m), std::string::npos) << "no \"" << m << "\" in\n" << describe(r);
  EXPECT_TRUE(r.out.empty()) << "stdout should be empty on an error\n" << describe(r);
}

// The files in a directory (to catch temporaries left behind).
std::vector<std::string> listing(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

const std::vector<std::vector<int>> kSeqs = {
    {1, 2, 3, 4, 5}, {7}, {10, 20, 30}, {255, 0, 128, 64, 32, 16, 8, 4, 2, 1, 0, 255, 77, 78, 79, 80, 81}, {0, 0}};

std::string jsonl_of(const std::vector<std::vector<int>>& seqs) {
  std::string s;
  for (const auto& q : seqs) s += json{{"tokens", q}}.dump() + "\n";
  return s;
}

struct Scored {
  std::vector<double> logprobs;
  double sum = 0;
};

// Parses score's JSONL output; checks the shape of every line against the input sequences.
std::vector<Scored> parse_scores(const std::string& out, const std::vector<std::vector<int>>& seqs) {
  const auto lines = split_lines(out);
  EXPECT_EQ(lines.size(), seqs.size()) << out;
  EXPECT_TRUE(out.empty() || out.back() == '\n');
  std::vector<Scored> res;
  for (size_t n = 0; n < lines.size() && n < seqs.size(); ++n) {
    const json j = json::parse(lines[n], nullptr, false);
    EXPECT_FALSE(j.is_discarded()) << "line " << n << " is not JSON: " << lines[n];
    if (j.is_discarded()) return res;
    EXPECT_TRUE(j.is_object() && j.contains("logprobs") && j.contains("sum")) << lines[n];
    EXPECT_TRUE(j.at("logprobs").is_array()) << lines[n];
    EXPECT_TRUE(j.at("sum").is_number()) << lines[n];
    Scored s;
    for (const auto& v : j.at("logprobs")) {
      EXPECT_TRUE(v.is_number()) << lines[n];
      s.logprobs.push_back(v.get<double>());
    }
    s.sum = j.at("sum").get<double>();
    EXPECT_EQ(s.logprobs.size(), seqs[n].size() - 1) << "line " << n;
    res.push_back(s);
  }
  return res;
}

class Cli : public ::testing::Test {
 protected:
  TempDir tmp;
  std::string input(const std::string& text, const std::string& name = "in.jsonl") {
    const std::string p = tmp.str(name);
    write_file(p, text);
    return p;
  }
  std::string score_args(const std::string& in) { return "score --model " + shell_quote(model_dir()) + " --input " + shell_quote(in); }
};

// ---------------------------------------------------------------------------------------------------- score: success

TEST_F(Cli, ScoreJsonlToStdout) {
  const CliResult r = run_nextlm(score_args(input(jsonl_of(kSeqs))));
  ASSERT_EQ(r.rc, 0) << describe(r);
  const auto scores = parse_scores(r.out, kSeqs);
  ASSERT_EQ(scores.size(), kSeqs.size());
  for (size_t n = 0; n < scores.size(); ++n) {
    double sum = 0;
    for (double lp : scores[n].logprobs) {
      EXPECT_TRUE(std::isfinite(lp)) << "sequence " << n;
      EXPECT_LE(lp, 0.0) << "sequence " << n;
      // A model this small is nowhere near certain: every logprob is well below 0 and above log(1e-12).
      EXPECT_LT(lp, -1e-3) << "sequence " << n;
      EXPECT_GT(lp, -30.0) << "sequence " << n;
      sum += lp;
    }
    EXPECT_NEAR(scores[n].sum, sum, 1e-6 * std::max(1.0, std::fabs(sum))) << "sequence " << n;
  }
  // The 1-token sequence: no predictions.
  EXPECT_TRUE(scores[1].logprobs.empty());
  EXPECT_EQ(scores[1].sum, 0.0);
}

TEST_F(Cli, ScoreDoesNotDependOnBatchingOrThreads) {
  const CliResult all = run_nextlm(score_args(input(jsonl_of(kSeqs))));
  ASSERT_EQ(all.rc, 0) << describe(all);
  const auto batched = parse_scores(all.out, kSeqs);
  ASSERT_EQ(batched.size(), kSeqs.size());
  // Each sequence alone gives what it gave in the packed batch (sequences must not see each other).
  for (size_t n = 0; n < kSeqs.size(); ++n) {
    const CliResult one = run_nextlm(score_args(input(jsonl_of({kSeqs[n]}), "one.jsonl")) + " --threads 1");
    ASSERT_EQ(one.rc, 0) << describe(one);
    const auto alone = parse_scores(one.out, {kSeqs[n]});
    ASSERT_EQ(alone.size(), 1u);
    ASSERT_EQ(alone[0].logprobs.size(), batched[n].logprobs.size());
    for (size_t t = 0; t < alone[0].logprobs.size(); ++t)
      EXPECT_NEAR(alone[0].logprobs[t], batched[n].logprobs[t], 1e-5) << "sequence " << n << " position " << t;
  }
  // The same sequence twice scores the same.
  const CliResult twice = run_nextlm(score_args(input(jsonl_of({kSeqs[3], kSeqs[3]}), "twice.jsonl")) + " --threads 2");
  ASSERT_EQ(twice.rc, 0) << describe(twice);
  const auto tw = parse_scores(twice.out, {kSeqs[3], kSeqs[3]});
  ASSERT_EQ(tw.size(), 2u);
  for (size_t t = 0; t < tw[0].logprobs.size(); ++t) EXPECT_NEAR(tw[0].logprobs[t], tw[1].logprobs[t], 1e-5);
  // A different prefix changes the prediction (the model does look at the context).
  const CliResult ctx = run_nextlm(score_args(input(jsonl_of({{1, 2, 3}, {9, 2, 3}}), "ctx.jsonl")));
  ASSERT_EQ(ctx.rc, 0) << describe(ctx);
  const auto c = parse_scores(ctx.out, {{1, 2, 3}, {9, 2, 3}});
  ASSERT_EQ(c.size(), 2u);
  EXPECT_GT(std::fabs(c[0].logprobs[0] - c[1].logprobs[0]), 1e-6);
}

TEST_F(Cli, ScoreAcceptsCrlfAndMissingFinalNewline) {
  const CliResult a = run_nextlm(score_args(input("{\"tokens\": [1, 2, 3]}\r\n{\"tokens\":[4,5]}")));
  ASSERT_EQ(a.rc, 0) << describe(a);
  EXPECT_EQ(parse_scores(a.out, {{1, 2, 3}, {4, 5}}).size(), 2u);
}

TEST_F(Cli, OutputFileHasTheBytesOfStdout) {
  const std::string in = input(jsonl_of(kSeqs));
  const CliResult to_stdout = run_nextlm(score_args(in));
  ASSERT_EQ(to_stdout.rc, 0) << describe(to_stdout);
  const std::string out = tmp.str("scores.jsonl");
  write_file(out, "old content\n");  // an existing file is replaced
  const CliResult to_file = run_nextlm(score_args(in) + " --output " + shell_quote(out));
  ASSERT_EQ(to_file.rc, 0) << describe(to_file);
  EXPECT_TRUE(to_file.out.empty()) << "with --output nothing goes to stdout:\n" << to_file.out;
  EXPECT_EQ(read_file(out), to_stdout.out);
  EXPECT_FALSE(to_stdout.out.empty());
  // No temporaries left beside the output.
  EXPECT_EQ(listing(tmp.path()), (std::vector<std::string>{"in.jsonl", "scores.jsonl"}));
}

TEST_F(Cli, LogitsOutMatchesTheLogprobs) {
  const std::string in = input(jsonl_of(kSeqs));
  const std::string logits_path = tmp.str("logits.safetensors"), out = tmp.str("scores.jsonl");
  const CliResult r = run_nextlm(score_args(in) + " --logits-out " + shell_quote(logits_path) + " --output " + shell_quote(out));
  ASSERT_EQ(r.rc, 0) << describe(r);
  const auto scores = parse_scores(read_file(out), kSeqs);
  ASSERT_EQ(scores.size(), kSeqs.size());

  SafetensorsFile f(logits_path);
  ASSERT_EQ(f.buffer().tensors().size(), kSeqs.size());
  for (size_t n = 0; n < kSeqs.size(); ++n) {
    const TensorView* t = f.buffer().find("logits." + std::to_string(n));
    ASSERT_NE(t, nullptr) << "logits." << n;
    EXPECT_EQ(t->dtype, DType::F32);
    const int64_t T = static_cast<int64_t>(kSeqs[n].size());
    ASSERT_EQ(t->shape, (std::vector<int64_t>{T, kVocab})) << "logits." << n;
    const std::vector<float> v = to_f32(*t);
    ASSERT_EQ(static_cast<int64_t>(v.size()), T * kVocab);
    for (float x : v) ASSERT_TRUE(std::isfinite(x));
    for (int64_t i = 0; i + 1 < T; ++i) {
      const float* row = v.data() + i * kVocab;
      double mx = -std::numeric_limits<double>::infinity();
      for (int64_t k = 0; k < kVocab; ++k) mx = std::max(mx, static_cast<double>(row[k]));
      double se = 0;
      for (int64_t k = 0; k < kVocab; ++k) se += std::exp(row[k] - mx);
      const double lp = row[kSeqs[n][i + 1]] - mx - std::log(se);
      EXPECT_NEAR(lp, scores[n].logprobs[i], 1e-5) << "sequence " << n << " position " << i;
    }
  }
  // --logits-out alone (stdout JSONL) works too and gives the same file contents.
  const std::string logits2 = tmp.str("logits2.safetensors");
  const CliResult r2 = run_nextlm(score_args(in) + " --logits-out " + shell_quote(logits2));
  ASSERT_EQ(r2.rc, 0) << describe(r2);
  EXPECT_EQ(r2.out, read_file(out));
  SafetensorsFile f2(logits2);
  for (size_t n = 0; n < kSeqs.size(); ++n) {
    const TensorView* a = f.buffer().find("logits." + std::to_string(n));
    const TensorView* b = f2.buffer().find("logits." + std::to_string(n));
    ASSERT_NE(b, nullptr);
    EXPECT_EQ(max_rel_error(reinterpret_cast<const float*>(b->data), reinterpret_cast<const float*>(a->data),
                            a->nbytes / 4),
              0.0);
  }
}

TEST_F(Cli, TextFormatPrintsPerplexity) {
  const std::string in = input(jsonl_of(kSeqs));
  const CliResult js = run_nextlm(score_args(in));
  ASSERT_EQ(js.rc, 0) << describe(js);
  const auto scores = parse_scores(js.out, kSeqs);
  ASSERT_EQ(scores.size(), kSeqs.size());
  const CliResult tx = run_nextlm(score_args(in) + " --format text");
  ASSERT_EQ(tx.rc, 0) << describe(tx);
  std::vector<double> ppl;
  for (const std::string& line : split_lines(tx.out)) {
    const size_t p = line.find("perplexity");
    if (p != std::string::npos) ppl.push_back(std::stod(line.substr(p + std::string("perplexity").size())));
  }
  // One perplexity per sequence with at least one prediction, equal to exp(-mean logprob).
  std::vector<double> expected;
  for (size_t n = 0; n < kSeqs.size(); ++n)
    if (!scores[n].logprobs.empty()) expected.push_back(std::exp(-scores[n].sum / scores[n].logprobs.size()));
  ASSERT_EQ(ppl.size(), expected.size()) << tx.out;
  for (size_t i = 0; i < ppl.size(); ++i) EXPECT_NEAR(ppl[i], expected[i], 1e-6 * expected[i]) << tx.out;
  // Text and JSONL are different outputs; text is not JSON.
  EXPECT_NE(tx.out, js.out);
  const CliResult jx = run_nextlm(score_args(in) + " --format jsonl");
  ASSERT_EQ(jx.rc, 0) << describe(jx);
  EXPECT_EQ(jx.out, js.out);
}

// ---------------------------------------------------------------------------------------------- info, help, version

TEST_F(Cli, InfoPrintsPatternAndParameterCounts) {
  const CliResult r = run_nextlm("info --model " + shell_quote(model_dir()));
  ASSERT_EQ(r.rc, 0) << describe(r);
  // layer_types K, D, D, K with index_topk_pattern FFSF: layer 1 has its own indexer, layer 2 shares it.
  std::string pattern_line, param_line;
  for (const std::string& line : split_lines(r.out)) {
    if (line.rfind("pattern", 0) == 0) pattern_line = line;
    if (line.rfind("parameters", 0) == 0) param_line = line;
  }
  ASSERT_FALSE(pattern_line.empty()) << r.out;
  std::istringstream ps(pattern_line.substr(std::string("pattern").size()));
  std::string pattern;
  ps >> pattern;
  EXPECT_EQ(pattern, "KDdK") << pattern_line;

  // Parameter counts from the checkpoint itself: every text-model tensor; active drops 6 of 8 routed experts.
  SafetensorsFile f(model_dir() + "/model.safetensors");
  int64_t total = 0, experts = 0;
  for (const TensorView& t : f.buffer().tensors()) {
    if (t.name.rfind("model.visual.", 0) == 0) continue;
    total += t.numel();
    if (t.name.find(".mlp.experts.") != std::string::npos) experts += t.numel();
  }
  ASSERT_GT(experts, 0);
  const int64_t active = total - experts / 8 * (8 - 2);
  ASSERT_FALSE(param_line.empty()) << r.out;
  EXPECT_NE(param_line.find(std::to_string(total) + " total"), std::string::npos) << param_line << " vs " << total;
  EXPECT_NE(param_line.find(std::to_string(active) + " active"), std::string::npos) << param_line << " vs " << active;
  // Skipped tensors: the 25 vision tensors of the checkpoint.
  EXPECT_NE(r.out.find("skipped 25 vision"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("vocab/hidden  256 / 48"), std::string::npos) << r.out;
}

TEST_F(Cli, HelpAndVersion) {
  const CliResult h = run_nextlm("--help");
  EXPECT_EQ(h.rc, 0) << describe(h);
  EXPECT_NE(h.out.find("score"), std::string::npos) << h.out;
  EXPECT_NE(h.out.find("info"), std::string::npos) << h.out;
  const CliResult sh = run_nextlm("score --help");
  EXPECT_EQ(sh.rc, 0) << describe(sh);
  EXPECT_NE(sh.out.find("--logits-out"), std::string::npos) << sh.out;
  EXPECT_NE(sh.out.find("--threads"), std::string::npos) << sh.out;
  const CliResult v = run_nextlm("--version");
  EXPECT_EQ(v.rc, 0) << describe(v);
  EXPECT_EQ(v.out.rfind("nextlm ", 0), 0u) << v.out;
  EXPECT_EQ(std::count(v.out.begin(), v.out.end(), '\n'), 1) << v.out;
}

// ------------------------------------------------------------------------------------------ command-line errors (2)

TEST_F(Cli, UsageErrors) {
  const std::string in = input(jsonl_of(kSeqs));
  const std::string m = shell_quote(model_dir());
  const std::string ok = score_args(in);
  struct Case {
    std::string args;
    std::vector<std::string> mentions;
  };
  const std::vector<Case> cases = {
      {"", {"command"}},
      {"frob", {"frob"}},
      {"frob --model " + m, {"frob"}},
      {ok + " --bogus", {"--bogus"}},
      {ok + " --bogus 3", {"--bogus"}},
      {ok + " extra_positional", {"extra_positional"}},
      {"--bogus", {"--bogus"}},
      {"score --input " + shell_quote(in), {"--model"}},
      {"score --model " + m, {"--input"}},
      {"score --model", {"--model"}},
      {"score --model " + m + " --model " + m + " --input " + shell_quote(in), {"--model"}},
      {"info", {"--model"}},
      {"info --model " + m + " --input x", {"--input"}},
      {ok + " --threads 0", {"--threads", "0"}},
      {ok + " --threads abc", {"--threads", "abc"}},
      {ok + " --threads -1", {"--threads", "-1"}},
      {ok + " --threads 1.5", {"--threads", "1.5"}},
      {ok + " --threads 99999999999", {"--threads", "99999999999"}},
      {ok + " --threads 100000", {"--threads", "100000"}},
      {ok + " --threads ''", {"--threads"}},
      {ok + " --threads", {"--threads"}},
      {ok + " --format xml", {"--format", "xml"}},
      {ok + " --format JSONL", {"--format", "JSONL"}},
      {ok + " --device tpu", {"--device", "tpu"}},
      {ok + " --device ''", {"--device"}},
      {ok + " --output ''", {"--output"}},
      {ok + " --logits-out ''", {"--logits-out"}},
      {"score --model '' --input " + shell_quote(in), {"--model"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE("nextlm " + c.args);
    expect_error(run_nextlm(c.args), 2, c.mentions);
  }
}

// The GPU-only flags of serve (and score's --batch-invariant) without --device cuda, and bad --max-len values, are
// usage errors found before the model is read (a model directory that does not exist would be exit code 1; a server
// that started would never exit).
TEST(CliServe, UsageErrors) {
  const std::string serve = "serve --port 0 --model /nonexistent/model";
  expect_error(run_nextlm(serve + " --batch-invariant"), 2, {"--batch-invariant", "--device cuda"});
  expect_error(run_nextlm(serve + " --device cpu --batch-invariant"), 2, {"--batch-invariant", "--device cuda"});
  expect_error(run_nextlm(serve + " --max-len 64"), 2, {"--max-len", "--device cuda"});
  for (const char* bad : {"0", "1", "-5", "abc", "1.5", "''", "99999999999999999999"})
    expect_error(run_nextlm(serve + " --max-len " + bad), 2, {"--max-len"});
  expect_error(run_nextlm(serve + " --max-len"), 2, {"--max-len"});
  expect_error(run_nextlm(serve + " --device tpu"), 2, {"--device", "tpu"});
  expect_error(run_nextlm("score --model /nonexistent/model --input /nonexistent/in.jsonl --batch-invariant"), 2,
               {"--batch-invariant", "--device cuda"});
}

// ------------------------------------------------------------------------------------- input and model errors (1)

TEST_F(Cli, BadInputLines) {
  struct Case {
    std::string text;
    std::vector<std::string> mentions;
  };
  const std::string good = "{\"tokens\": [1, 2, 3]}\n";
  const std::vector<Case> cases = {
      {good + "\n" + good, {"in.jsonl:2", "empty"}},
      {good + "   \n", {"in.jsonl:2", "empty"}},
      {good + good + "{\"tokens\": [1, 2,\n", {"in.jsonl:3", "JSON"}},
      {"{\"tokens\": [1, 2]} {\"tokens\": [3]}\n", {"in.jsonl:1", "JSON"}},
      {"\xff\xfe{}\n", {"in.jsonl:1", "JSON"}},
      {good + "{\"tokens\": [1, 256]}\n", {"in.jsonl:2", "256", "vocabulary"}},
      {"{\"tokens\": [1, -1]}\n", {"in.jsonl:1", "-1"}},
      {"{\"tokens\": [1, 18446744073709551615]}\n", {"in.jsonl:1", "18446744073709551615"}},
      {"{\"tokens\": [1, 9223372036854775808]}\n", {"in.jsonl:1", "9223372036854775808"}},
      {"{\"tokens\": [1, 4294967297]}\n", {"in.jsonl:1", "4294967297"}},
      {"{\"tokens\": [1, 99999999999999999999999]}\n", {"in.jsonl:1", "integer"}},
      {"{\"tokens\": [1, 2.5]}\n", {"in.jsonl:1", "2.5"}},
      {"{\"tokens\": [1, \"2\"]}\n", {"in.jsonl:1", "integer"}},
      {"{\"tokens\": [1, [2]]}\n", {"in.jsonl:1", "integer"}},
      {"{\"tokens\": [1, true]}\n", {"in.jsonl:1", "integer"}},
      {"{\"tokens\": []}\n", {"in.jsonl:1", "empty"}},
      {"{\"tokens\": 5}\n", {"in.jsonl:1", "tokens"}},
      {"{\"ids\": [1, 2]}\n", {"in.jsonl:1", "tokens"}},
      {"[1, 2, 3]\n", {"in.jsonl:1", "tokens"}},
      {"\"tokens\"\n", {"in.jsonl:1", "tokens"}},
      {"null\n", {"in.jsonl:1", "tokens"}},
      {"", {"in.jsonl", "no sequences"}},
      {"{\"tokens\": [1, " + std::string(5000, '[') + "\n", {"in.jsonl:1", "JSON"}},
      {"{\"tokens\": [1, " + std::string(100000, '[') + std::string(100000, ']') + "]}\n", {"in.jsonl:1", "integer"}},
      {"{\"tokens\": [1, \"" + std::string(100000, 'z') + "\"]}\n", {"in.jsonl:1", "integer"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE("input: " + c.text.substr(0, 80));
    const std::string in = input(c.text);
    const std::string out = tmp.str("out.jsonl"), logits = tmp.str("logits.safetensors");
    expect_error(run_nextlm(score_args(in) + " --output " + shell_quote(out) + " --logits-out " + shell_quote(logits)), 1, c.mentions);
    EXPECT_FALSE(fs::exists(out));
    EXPECT_FALSE(fs::exists(logits));
    EXPECT_EQ(listing(tmp.path()), std::vector<std::string>{"in.jsonl"});
    // The same failure without --output: nothing on stdout.
    expect_error(run_nextlm(score_args(in)), 1, c.mentions);
  }
}

TEST_F(Cli, FailureLeavesExistingOutputsUntouched) {
  const std::string in = input("{\"tokens\": [1, 2]}\n{\"tokens\": [3, 999]}\n");
  const std::string out = tmp.str("out.jsonl"), logits = tmp.str("logits.safetensors");
  write_file(out, "precious output\n");
  write_file(logits, "precious logits\n");
  expect_error(run_nextlm(score_args(in) + " --output " + shell_quote(out) + " --logits-out " + shell_quote(logits)), 1,
               {"in.jsonl:2", "999"});
  EXPECT_EQ(read_file(out), "precious output\n");
  EXPECT_EQ(read_file(logits), "precious logits\n");
  EXPECT_EQ(listing(tmp.path()), (std::vector<std::string>{"in.jsonl", "logits.safetensors", "out.jsonl"}));
  // A usage error does not touch them either.
  expect_error(run_nextlm(score_args(in) + " --output " + shell_quote(out) + " --logits-out " + shell_quote(logits) + " --threads 0"),
               2, {"--threads"});
  EXPECT_EQ(read_file(out), "precious output\n");
  EXPECT_EQ(read_file(logits), "precious logits\n");
}

TEST_F(Cli, UnwritableOutputsFailWithoutLeavingTheOther) {
  const std::string in = input(jsonl_of(kSeqs));
  const std::string out = tmp.str("out.jsonl"), logits = tmp.str("logits.safetensors");
  const std::string missing_dir = tmp.str("no/such/dir/");
  fs::create_directory(tmp.str("adir"));
  const std::string a_dir = tmp.str("adir");
  // --output unwritable: the logits must not appear.
  expect_error(run_nextlm(score_args(in) + " --output " + shell_quote(missing_dir + "o.jsonl") + " --logits-out " + shell_quote(logits)),
               1, {"o.jsonl"});
  EXPECT_FALSE(fs::exists(logits));
  expect_error(run_nextlm(score_args(in) + " --output " + shell_quote(a_dir) + " --logits-out " + shell_quote(logits)), 1, {"adir"});
  EXPECT_FALSE(fs::exists(logits));
  EXPECT_TRUE(fs::is_directory(a_dir));
  // --logits-out unwritable: the JSONL must not appear.
  expect_error(run_nextlm(score_args(in) + " --output " + shell_quote(out) + " --logits-out " + shell_quote(missing_dir + "l.st")), 1,
               {"l.st"});
  EXPECT_FALSE(fs::exists(out));
  expect_error(run_nextlm(score_args(in) + " --output " + shell_quote(out) + " --logits-out " + shell_quote(a_dir)), 1, {"adir"});
  EXPECT_FALSE(fs::exists(out));
  // Both naming the same file, or an output naming the input: usage errors, and the input is not touched.
  expect_error(run_nextlm(score_args(in) + " --output " + shell_quote(out) + " --logits-out " + shell_quote(out)), 2, {"out.jsonl"});
  EXPECT_FALSE(fs::exists(out));
  expect_error(run_nextlm(score_args(in) + " --output " + shell_quote(out) + " --logits-out " + shell_quote(tmp.str("./out.jsonl"))), 2,
               {"out.jsonl"});
  EXPECT_FALSE(fs::exists(out));
  const CliResult rel = [&] {
    CliResult r;
    r.rc = run_command("cd " + shell_quote(tmp.str()) + " && " + shell_quote(NEXTLM_BINARY) + " " + score_args(in) +
                           " --output o.jsonl --logits-out ./o.jsonl",
                       &r.out, &r.err);
    return r;
  }();
  expect_error(rel, 2, {"o.jsonl"});
  EXPECT_FALSE(fs::exists(tmp.str("o.jsonl")));
  const std::string before = read_file(in);
  expect_error(run_nextlm(score_args(in) + " --output " + shell_quote(in)), 2, {"in.jsonl", "--input"});
  expect_error(run_nextlm(score_args(in) + " --logits-out " + shell_quote(in)), 2, {"in.jsonl", "--input"});
  EXPECT_EQ(read_file(in), before);
  EXPECT_EQ(listing(tmp.path()), (std::vector<std::string>{"adir", "in.jsonl"}));
  EXPECT_TRUE(listing(a_dir).empty());
}

TEST_F(Cli, BadInputFiles) {
  const std::string m = shell_quote(model_dir());
  expect_error(run_nextlm("score --model " + m + " --input " + shell_quote(tmp.str("missing.jsonl"))), 1, {"missing.jsonl"});
  fs::create_directory(tmp.str("indir"));
  expect_error(run_nextlm("score --model " + m + " --input " + shell_quote(tmp.str("indir"))), 1, {"indir"});
  expect_error(run_nextlm("score --model " + m + " --input /dev/null"), 1, {"/dev/null"});
  // A line break in a path does not break the one-line message.
  expect_error(run_nextlm("score --model " + m + " --input " + shell_quote(tmp.str("bad\nname.jsonl"))), 1, {"name.jsonl"});
  expect_error(run_nextlm("info --model " + shell_quote(tmp.str("bad\nmodel"))), 1, {"model"});
  const std::string long_name(5000, 'x');
  expect_error(run_nextlm("score --model " + m + " --input " + long_name), 1, {"xxxxxxxx"});
}

TEST_F(Cli, BadModelDirectories) {
  const std::string in = shell_quote(input(jsonl_of(kSeqs)));
  const std::string out = tmp.str("out.jsonl");
  auto score = [&](const std::string& dir) {
    return run_nextlm("score --model " + shell_quote(dir) + " --input " + in + " --output " + shell_quote(out));
  };
  auto info = [&](const std::string& dir) { return run_nextlm("info --model " + shell_quote(dir)); };

  const std::string missing = tmp.str("no_such_model");
  expect_error(score(missing), 1, {"no_such_model"});
  expect_error(info(missing), 1, {"no_such_model"});

  fs::create_directory(tmp.str("empty_model"));
  expect_error(score(tmp.str("empty_model")), 1, {"config.json"});
  expect_error(info(tmp.str("empty_model")), 1, {"config.json"});

  // A file where a directory is expected.
  expect_error(score(model_dir() + "/config.json"), 1, {"config.json"});
  expect_error(info(model_dir() + "/config.json"), 1, {"config.json"});

  // A path too long for the file system.
  const std::string long_dir = tmp.str(std::string(5000, 'y'));
  expect_error(score(long_dir), 1, {"yyyyyyyy"});
  expect_error(info(long_dir), 1, {"yyyyyyyy"});

  // config.json present, checkpoint missing.
  const std::string no_weights = tmp.str("no_weights");
  fs::create_directory(no_weights);
  fs::copy_file(model_dir() + "/config.json", no_weights + "/config.json");
  expect_error(score(no_weights), 1, {"model.safetensors"});
  expect_error(info(no_weights), 1, {"model.safetensors"});

  // Broken config.json.
  const std::string bad_config = tmp.str("bad_config");
  copy_dir(model_dir(), bad_config);
  write_file(bad_config + "/config.json", "{\"model_type\": \"glm5_next\", ");
  expect_error(score(bad_config), 1, {"config.json"});
  expect_error(info(bad_config), 1, {"config.json"});

  EXPECT_FALSE(fs::exists(out));
}

TEST_F(Cli, TruncatedSafetensorsIsAnError) {
  const std::string dir = tmp.str("truncated");
  copy_dir(model_dir(), dir);
  const std::string in = shell_quote(input(jsonl_of(kSeqs)));
  const std::string out = tmp.str("out.jsonl"), logits = tmp.str("logits.safetensors");
  const uintmax_t size = fs::file_size(dir + "/model.safetensors");
  for (uintmax_t new_size : {size - 1, size / 2, uintmax_t{100}, uintmax_t{5}, uintmax_t{0}}) {
    SCOPED_TRACE("truncated to " + std::to_string(new_size));
    fs::resize_file(dir + "/model.safetensors", new_size);
    expect_error(run_nextlm("score --model " + shell_quote(dir) + " --input " + in + " --output " + shell_quote(out) +
                        " --logits-out " + shell_quote(logits)),
                 1, {"model.safetensors"});
    EXPECT_FALSE(fs::exists(out));
    EXPECT_FALSE(fs::exists(logits));
    expect_error(run_nextlm("info --model " + shell_quote(dir)), 1, {"model.safetensors"});
  }
}

}  // namespace
}  // namespace nextlm::test
