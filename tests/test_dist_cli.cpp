// `mpirun -np N nextlm score --tp T --ep E` (the Open MPI backend, one process per rank) against the single-process
// `nextlm score` on every golden: logits (--logits-out) within 1e-5 relative (max|Δ|/max|ref|; see test_dist.cpp
// for why) and the same log-probabilities; and the one-line errors for --tp/--ep values that do not fit.
// Built only with NEXTLM_MPI (not in the sanitizer build: see CMakeLists.txt).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "test_util.h"

namespace nextlm::test {
namespace {

constexpr double kTol = 1e-5;

// mpiexec with the flags a CI container needs: root allowed, more ranks than cores, no core binding, and no
// cross-process memory attach for the shared-memory transport (containers often forbid the ptrace it needs).
CliResult run_mpi(int np, const std::string& args) {
  const std::string cmd = "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 " + shell_quote(NEXTLM_MPIEXEC) +
                          " --oversubscribe --bind-to none --mca btl_vader_single_copy_mechanism none -np " +
                          std::to_string(np) + " " +
                          shell_quote(NEXTLM_BINARY) + " " + args;
  CliResult r;
  r.rc = run_command(cmd, &r.out, &r.err);
  return r;
}

std::string describe(const CliResult& r) {
  return "rc=" + std::to_string(r.rc) + "\nstdout:\n" + r.out + "\nstderr:\n" + r.err;
}

std::string write_input(const TempDir& tmp) {
  const std::string path = tmp.str("in.jsonl");
  std::ofstream f(path);
  f << "{\"tokens\": [5, 17, 200, 3, 9, 44, 81, 2, 250, 13, 13, 7, 100, 64, 1, 0, 255, 31, 8, 90]}\n";
  f << "{\"tokens\": [42, 43]}\n";
  f << "{\"tokens\": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]}\n";
  return path;
}

std::vector<std::vector<float>> read_logits(const std::string& path) {
  SafetensorsFile f(path);
  std::vector<std::vector<float>> out;
  for (int i = 0;; ++i) {
    const TensorView* t = f.buffer().find("logits." + std::to_string(i));
    if (!t) break;
    out.push_back(to_f32(*t));
  }
  return out;
}

class DistCli : public ::testing::TestWithParam<std::string> {};

TEST_P(DistCli, MpiScoreEqualsSingleProcess) {
  const std::string dir = golden_dir(GetParam());
  TempDir tmp;
  const std::string in = write_input(tmp);
  const CliResult one = run_nextlm("score --model " + shell_quote(dir) + " --input " + shell_quote(in) +
                                   " --logits-out " + shell_quote(tmp.str("one.safetensors")));
  ASSERT_EQ(one.rc, 0) << describe(one);
  const auto ref = read_logits(tmp.str("one.safetensors"));
  ASSERT_EQ(ref.size(), 3u);
  struct Case {
    int np, tp, ep;
  };
  for (const Case& c : {Case{2, 2, 2}, Case{4, 2, 4}, Case{4, 1, 4}}) {
    const std::string what = "np " + std::to_string(c.np) + " --tp " + std::to_string(c.tp) + " --ep " +
                             std::to_string(c.ep);
    const std::string out = tmp.str("par.safetensors");
    const CliResult par = run_mpi(c.np, "score --threads 1 --model " + shell_quote(dir) + " --input " +
                                            shell_quote(in) + " --tp " + std::to_string(c.tp) + " --ep " +
                                            std::to_string(c.ep) + " --logits-out " + shell_quote(out));
    ASSERT_EQ(par.rc, 0) << what << "\n" << describe(par);
    // Rank 0 alone writes: one JSONL line per sequence.
    std::istringstream a(one.out), b(par.out);
    std::string la, lb;
    int lines = 0;
    while (std::getline(a, la)) {
      ASSERT_TRUE(std::getline(b, lb)) << what;
      const auto ja = nlohmann::json::parse(la), jb = nlohmann::json::parse(lb);
      ASSERT_EQ(ja["logprobs"].size(), jb["logprobs"].size()) << what;
      for (size_t t = 0; t < ja["logprobs"].size(); ++t) {
        const double x = ja["logprobs"][t], y = jb["logprobs"][t];
        EXPECT_NEAR(y, x, kTol * std::max(1.0, std::abs(x))) << what;
      }
      ++lines;
    }
    EXPECT_FALSE(std::getline(b, lb)) << what << ": more output lines than sequences";
    EXPECT_EQ(lines, 3);
    const auto got = read_logits(out);
    ASSERT_EQ(got.size(), ref.size()) << what;
    for (size_t i = 0; i < ref.size(); ++i) {
      ASSERT_EQ(got[i].size(), ref[i].size());
      EXPECT_LE(max_rel_error(got[i].data(), ref[i].data(), ref[i].size()), kTol) << what << " sequence " << i;
    }
  }
}

// `grad` under mpirun: every tensor of the single-process file, same names, shapes and dtypes, within the
// tolerances of test_dist.cpp's DistGrad (whole gradient 2e-5, each tensor 1e-4, loss 1e-5; reasons there).
TEST_P(DistCli, MpiGradEqualsSingleProcess) {
  const std::string dir = golden_dir(GetParam());
  TempDir tmp;
  const std::string in = write_input(tmp);
  const CliResult one = run_nextlm("grad --model " + shell_quote(dir) + " --input " + shell_quote(in) + " --out " +
                                   shell_quote(tmp.str("one.safetensors")));
  ASSERT_EQ(one.rc, 0) << describe(one);
  const CliResult par = run_mpi(4, "grad --threads 1 --tp 2 --ep 4 --model " + shell_quote(dir) + " --input " +
                                       shell_quote(in) + " --out " + shell_quote(tmp.str("par.safetensors")));
  ASSERT_EQ(par.rc, 0) << describe(par);
  SafetensorsFile a(tmp.str("one.safetensors")), b(tmp.str("par.safetensors"));
  ASSERT_EQ(a.buffer().tensors().size(), b.buffer().tensors().size());
  std::vector<float> all_a, all_b;
  for (const TensorView& ta : a.buffer().tensors()) {
    const TensorView* tb = b.buffer().find(ta.name);
    ASSERT_NE(tb, nullptr) << ta.name;
    ASSERT_EQ(ta.shape, tb->shape) << ta.name;
    ASSERT_EQ(ta.dtype, tb->dtype) << ta.name;
    const std::vector<float> va = to_f32(ta), vb = to_f32(*tb);
    if (ta.name == "loss") {
      EXPECT_NEAR(vb[0], va[0], 1e-5 * std::abs(va[0]));
      continue;
    }
    EXPECT_LE(norm_rel_error(vb.data(), va.data(), va.size()), 1e-4) << ta.name;
    all_a.insert(all_a.end(), va.begin(), va.end());
    all_b.insert(all_b.end(), vb.begin(), vb.end());
  }
  EXPECT_LE(norm_rel_error(all_b.data(), all_a.data(), all_a.size()), 2e-5);
}

// `generate` under mpirun: the same tokens and log-probabilities (1e-5) as one process, printed once.
TEST_P(DistCli, MpiGenerateEqualsSingleProcess) {
  const std::string dir = golden_dir(GetParam());
  const std::string args = "generate --model " + shell_quote(dir) +
                           " --prompt-tokens 5,17,200,3,9,44 --max-new-tokens 8 --temperature 0.7 --seed 3"
                           " --format json";
  const CliResult one = run_nextlm(args);
  ASSERT_EQ(one.rc, 0) << describe(one);
  const CliResult par = run_mpi(4, args + " --threads 1 --tp 2 --ep 4");
  ASSERT_EQ(par.rc, 0) << describe(par);
  const auto a = nlohmann::json::parse(one.out), b = nlohmann::json::parse(par.out);  // one line: rank 0 only
  EXPECT_EQ(a["tokens"], b["tokens"]);
  ASSERT_EQ(a["logprobs"].size(), b["logprobs"].size());
  for (size_t i = 0; i < a["logprobs"].size(); ++i) {
    const double x = a["logprobs"][i], y = b["logprobs"][i];
    EXPECT_NEAR(y, x, kTol * std::max(1.0, std::abs(x)));
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, DistCli, ::testing::ValuesIn(golden_cases()),
                         [](const auto& info) { return param_name(info.param); });

// The error line appears once (rank 0 prints it), whatever mpirun adds after it, and the job fails.
void expect_one_error(const CliResult& r, const std::string& line) {
  EXPECT_NE(r.rc, 0) << describe(r);
  size_t n = 0;
  for (size_t p = r.err.find("error:"); p != std::string::npos; p = r.err.find("error:", p + 1)) ++n;
  EXPECT_EQ(n, 1u) << describe(r);
  EXPECT_NE(r.err.find(line + "\n"), std::string::npos) << describe(r);
}

TEST(DistCliErrors, LayoutsThatDoNotFit) {
  const std::string dir = golden_dir("fp32_tail_off");
  TempDir tmp;
  const std::string base = "score --model " + shell_quote(dir) + " --input " + shell_quote(write_input(tmp));
  expect_one_error(run_mpi(4, base + " --tp 4"), "error: --tp 4 does not divide the 2 KDA heads (linear_num_heads) "
                                                 "of this model (run nextlm --help)");
  expect_one_error(run_mpi(2, base + " --ep 4"),
                   "error: --ep 4 does not divide the 2 processes (mpirun -np) (run nextlm --help)");
  // Without mpirun: one process.
  const CliResult r = run_nextlm(base + " --tp 2");
  EXPECT_EQ(r.rc, 2) << describe(r);
  EXPECT_EQ(r.err, "error: --tp 2 does not divide the 1 processes (mpirun -np) (run nextlm --help)\n");
  const CliResult z = run_nextlm(base + " --ep 0");
  EXPECT_EQ(z.rc, 2) << describe(z);
  EXPECT_EQ(z.err.rfind("error: --ep: must be a positive integer, got \"0\"", 0), 0u) << describe(z);
}

}  // namespace
}  // namespace nextlm::test
