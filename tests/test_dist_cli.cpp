// `mpirun -np N nextlm score --tp T --ep E` (the Open MPI backend, one process per rank) against the single-process
// `nextlm score` on every golden: logits (--logits-out) within 1e-5 relative (max|Δ|/max|ref|; see test_dist.cpp
// for why) and the same log-probabilities; and the one-line errors for --tp/--ep values that do not fit.
// `mpirun -np N nextlm train` (data parallelism, alone and with TP/EP) against the single-process `nextlm train` on
// the same data: per-step loss and grad-norm, final weights and moments, and resuming across layouts.
// Built only with NEXTLM_MPI (not in the sanitizer build: see CMakeLists.txt).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include <signal.h>
#include <stdlib.h>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "test_util.h"

namespace nextlm::test {
namespace {

constexpr double kTol = 1e-5;

// mpiexec -np NP with the flags a CI container needs: more ranks than cores, no core binding, and no cross-process
// memory attach for the shared-memory transport (containers often forbid the ptrace it needs). Root is allowed by
// the environment (OMPI_ALLOW_RUN_AS_ROOT*), which run_mpi sets on its command and ServeProcess's callers in theirs.
std::vector<std::string> mpi_launcher(int np) {
  return {NEXTLM_MPIEXEC, "--oversubscribe", "--bind-to", "none", "--mca", "btl_vader_single_copy_mechanism", "none",
          "-np", std::to_string(np)};
}

CliResult run_mpi(int np, const std::string& args) {
  std::string cmd = "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1";
  for (const std::string& a : mpi_launcher(np)) cmd += " " + shell_quote(a);
  cmd += " " + shell_quote(NEXTLM_BINARY) + " " + args;
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

// `mpirun -np 2 nextlm serve --tp 2`, and `--ep 2`: rank 0 serves HTTP, rank 1 runs each of its scheduler's calls
// on its slices. Three greedy completions sent at once (so that the prefills and steps carry several slots) give
// the tokens of `mpirun -np 2 nextlm generate` with that layout, and their log-probabilities within 1e-6 (the same
// calls on the same slices); a SIGTERM to mpirun ends every rank.
TEST(DistCliServe, ServeUnderMpirunEqualsParallelGenerate) {
  const std::string dir = std::string(NEXTLM_SOURCE_DIR) + "/examples/tiny-glm5-next";
  ::setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  ::setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  const std::vector<std::string> mpi = mpi_launcher(2);
  const std::vector<std::string> prompts = {"Hello, world", "Once upon a time", "ab"};
  for (const std::string layout : {"--tp", "--ep"}) {
    ServeProcess server(NEXTLM_BINARY, {"--model", dir, "--threads", "1", "--max-batch", "3", layout, "2"}, 60, true,
                        mpi);
    std::vector<nlohmann::json> replies(prompts.size());
    std::vector<std::thread> clients;
    for (size_t i = 0; i < prompts.size(); ++i)
      clients.emplace_back([&, i] {
        httplib::Client c("127.0.0.1", server.port());
        c.set_read_timeout(60);
        const nlohmann::json req = {{"prompt", prompts[i]}, {"max_tokens", 10}, {"temperature", 0}, {"logprobs", 1}};
        const auto res = c.Post("/v1/completions", req.dump(), "application/json");
        if (res && res->status == 200) replies[i] = nlohmann::json::parse(res->body, nullptr, false);
      });
    for (std::thread& t : clients) t.join();
    for (size_t i = 0; i < prompts.size(); ++i) {
      const CliResult g = run_mpi(2, "generate --model " + shell_quote(dir) + " --prompt " + shell_quote(prompts[i]) +
                                         " --max-new-tokens 10 --temperature 0 --format json --threads 1 " + layout +
                                         " 2");
      ASSERT_EQ(g.rc, 0) << describe(g);
      const nlohmann::json want = nlohmann::json::parse(g.out);
      ASSERT_TRUE(replies[i].is_object()) << layout << ": no answer to prompt " << i;
      const nlohmann::json& c = replies[i]["choices"][0];
      EXPECT_EQ(c["tokens"], want["tokens"]) << layout << ": prompt " << i;
      ASSERT_EQ(c["logprobs"]["token_logprobs"].size(), want["logprobs"].size()) << layout << ": prompt " << i;
      for (size_t t = 0; t < want["logprobs"].size(); ++t)
        EXPECT_NEAR(c["logprobs"]["token_logprobs"][t].get<double>(), want["logprobs"][t].get<double>(), 1e-6)
            << layout << ": prompt " << i << ", token " << t;
    }
    EXPECT_NE(server.stop(SIGTERM, 30), -1) << layout << ": mpirun did not end within 30 s of SIGTERM";
  }
}

// serve's layout flags fail before anything loads, with one line naming the flag: an adapter or the GPU with them, a
// layout that does not divide the processes.
TEST(DistCliServe, LayoutErrorsAreUsageErrors) {
  const std::string dir = shell_quote(std::string(NEXTLM_SOURCE_DIR) + "/examples/tiny-glm5-next");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--tp 2 --adapter " + shell_quote(::testing::TempDir()), "--adapter"},
      {"--tp 3", "--tp 3"},
      {"--ep 2 --device cuda", "--device"},
  };
  for (const auto& [flags, mention] : cases) {
    const CliResult r = run_nextlm("serve --port 0 --model " + dir + " " + flags);
    EXPECT_EQ(r.rc, 2) << flags << "\n" << describe(r);
    EXPECT_EQ(r.err.rfind("error:", 0), 0u) << describe(r);
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << describe(r);
    EXPECT_NE(r.err.find(mention), std::string::npos) << flags << "\n" << describe(r);
  }
}

// The error line appears once (rank 0 prints it), whatever mpirun adds after it, and the job fails.
void expect_one_error(const CliResult& r, const std::string& line) {
  EXPECT_NE(r.rc, 0) << describe(r);
  size_t n = 0;
  for (size_t p = r.err.find("error:"); p != std::string::npos; p = r.err.find("error:", p + 1)) ++n;
  EXPECT_EQ(n, 1u) << describe(r);
  EXPECT_NE(r.err.find(line + "\n"), std::string::npos) << describe(r);
}

// ---------------------------------------------------------------------------------------------------------------
// train

// 12 sequences of 5..40 tokens from a fixed generator, every third with a loss mask over its first third: packed
// into micro-batches of at most 64 tokens, a step's 2 micro-batches hold 2..6 sequences, so the replicas get uneven
// shares and, at 4 replicas, sometimes none.
std::string write_train_data(const TempDir& tmp) {
  const std::string path = tmp.str("train.jsonl");
  std::ofstream f(path);
  uint64_t x = 12345;
  auto next = [&](uint64_t n) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    return (x >> 33) % n;
  };
  for (int i = 0; i < 12; ++i) {
    const int n = 5 + static_cast<int>(next(36));
    std::string toks, mask;
    for (int t = 0; t < n; ++t) {
      toks += (t ? ", " : "") + std::to_string(next(256));
      mask += (t ? ", " : "") + std::string(t < n / 3 ? "0" : "1");
    }
    f << "{\"tokens\": [" << toks << "]";
    if (i % 3 == 0) f << ", \"loss_mask\": [" << mask << "]";
    f << "}\n";
  }
  return path;
}

struct LogLine {
  double loss, lr, grad_norm;
  int64_t tokens;
};
std::vector<LogLine> read_train_log(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  std::vector<LogLine> out;
  while (std::getline(in, line)) {
    LogLine l{};
    int64_t step = 0;
    double secs = 0;
    EXPECT_EQ(std::sscanf(line.c_str(), "%ld,%lf,%lf,%lf,%ld,%lf", &step, &l.loss, &l.lr, &l.grad_norm, &l.tokens,
                          &secs),
              6)
        << line;
    out.push_back(l);
  }
  return out;
}

// Every tensor of file `a` is in `b` with its shape; the whole file's ‖Δ‖/‖a‖ is at most tol.
void expect_same_tensors(const std::string& a_path, const std::string& b_path, double tol, const std::string& what) {
  SafetensorsFile a(a_path), b(b_path);
  ASSERT_EQ(a.buffer().tensors().size(), b.buffer().tensors().size()) << what;
  std::vector<float> all_a, all_b;
  for (const TensorView& ta : a.buffer().tensors()) {
    const TensorView* tb = b.buffer().find(ta.name);
    ASSERT_NE(tb, nullptr) << what << ": " << ta.name;
    ASSERT_EQ(ta.shape, tb->shape) << what << ": " << ta.name;
    const std::vector<float> va = to_f32(ta), vb = to_f32(*tb);
    all_a.insert(all_a.end(), va.begin(), va.end());
    all_b.insert(all_b.end(), vb.begin(), vb.end());
  }
  EXPECT_LE(norm_rel_error(all_b.data(), all_a.data(), all_a.size()), tol) << what << ": " << b_path;
}

// Per-step loss and grad-norm within tol relative, the same lr and token counts.
void expect_same_log(const std::string& a_path, const std::string& b_path, double tol, const std::string& what) {
  const auto a = read_train_log(a_path), b = read_train_log(b_path);
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(b[i].loss, a[i].loss, tol * std::abs(a[i].loss)) << what << " step " << i + 1;
    EXPECT_NEAR(b[i].grad_norm, a[i].grad_norm, tol * std::abs(a[i].grad_norm)) << what << " step " << i + 1;
    EXPECT_EQ(b[i].lr, a[i].lr) << what << " step " << i + 1;
    EXPECT_EQ(b[i].tokens, a[i].tokens) << what << " step " << i + 1;
  }
}

// An mpirun layout of a training test: processes, --tp, --ep and the run's directory name.
struct MpiLayout {
  int np, tp, ep;
  const char* name;
};

// `train --resume FROM --out TO` in one process, with the rest of the flags in `more`.
CliResult resume_in_one_process(const std::string& from, const std::string& to, const std::string& more) {
  return run_nextlm("train --resume " + shell_quote(from) + " --out " + shell_quote(to) + more);
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// Data-parallel training, alone and with TP or EP, takes the same steps as one process: each replica computes the
// gradient of its share of a step's sequences, and the sum over the replicas divided by the step's prediction count
// is the single-process gradient up to the order of the fp32 sums (~1e-7 relative at step 1; 1e-5 tested). The
// runs use --adam-eps 1e-5: Adam moves an element by about ±lr whatever its gradient's size, so with the default
// eps an element whose exact gradient is 0 (layer 0's mHC sees 4 identical streams) moves by the sign of its
// rounding noise, which differs between the two sum orders; an eps far above that noise (~1e-10) keeps such
// elements still. The later steps start from weights that already differ by that rounding, and this tiny random
// model amplifies it: at the default lr (1e-3) the 3rd and 4th steps' gradients differ by ~4e-6, at 3e-3 by ~2e-5.
TEST(DistTrainCli, DataParallelEqualsSingleProcess) {
  namespace fs = std::filesystem;
  const std::string model = golden_dir("fp32_tail_off");
  TempDir tmp;
  const std::string data = write_train_data(tmp);
  const std::string args = "train --threads 1 --model " + shell_quote(model) + " --data " + shell_quote(data) +
                           " --steps 3 --batch-tokens 64 --grad-accum 2 --warmup 1 --adam-eps 1e-5";
  const std::string one = tmp.str("one");
  const CliResult r1 = run_nextlm(args + " --out " + shell_quote(one));
  ASSERT_EQ(r1.rc, 0) << describe(r1);
  const MpiLayout cases[] = {{2, 1, 1, "dp2"}, {4, 1, 1, "dp4"}, {4, 2, 1, "dp2_tp2"}, {4, 1, 2, "dp2_ep2"}};
  for (const MpiLayout& c : cases) {
    const std::string out = tmp.str(c.name);
    const CliResult r = run_mpi(c.np, args + " --tp " + std::to_string(c.tp) + " --ep " + std::to_string(c.ep) +
                                          " --out " + shell_quote(out));
    ASSERT_EQ(r.rc, 0) << c.name << "\n" << describe(r);
    // Rank 0 alone prints: one progress line per step.
    size_t lines = 0;
    for (size_t p = r.err.find("step "); p != std::string::npos; p = r.err.find("step ", p + 1)) ++lines;
    EXPECT_EQ(lines, 3u) << c.name << "\n" << r.err;
    expect_same_log(one + "/train_log.csv", out + "/train_log.csv", 1e-5, c.name);
    expect_same_tensors(one + "/checkpoint/model.safetensors", out + "/checkpoint/model.safetensors", 1e-5, c.name);
    expect_same_tensors(one + "/checkpoint/optimizer.safetensors", out + "/checkpoint/optimizer.safetensors", 1e-5,
                        c.name);
    EXPECT_EQ(read_json(one + "/checkpoint/trainer_state.json"), read_json(out + "/checkpoint/trainer_state.json"))
        << c.name;
    EXPECT_TRUE(fs::exists(out + "/train_log.svg")) << c.name;
  }

  // Resuming across layouts: one process continues the DP2×TP2 checkpoint, and DP2×EP2 continues the
  // single-process one (each rank reading its slices of the weights and moments); both take the step one process
  // takes from its own checkpoint.
  const std::string more = " --steps 4 --threads 1 --data " + shell_quote(data);
  const CliResult c1 = resume_in_one_process(one, tmp.str("one4"), more);
  ASSERT_EQ(c1.rc, 0) << describe(c1);
  const CliResult c2 = resume_in_one_process(tmp.str("dp2_tp2"), tmp.str("from_tp2"), more);
  ASSERT_EQ(c2.rc, 0) << describe(c2);
  const CliResult c3 = run_mpi(4, "train --ep 2 --resume " + shell_quote(one) + " --out " +
                                      shell_quote(tmp.str("to_ep2")) + more);
  ASSERT_EQ(c3.rc, 0) << describe(c3);
  for (const char* name : {"from_tp2", "to_ep2"}) {
    const std::string out = tmp.str(name);
    expect_same_log(tmp.str("one4/train_log.csv"), out + "/train_log.csv", 1e-5, name);
    expect_same_tensors(tmp.str("one4/checkpoint/model.safetensors"), out + "/checkpoint/model.safetensors", 1e-5,
                        name);
    expect_same_tensors(tmp.str("one4/checkpoint/optimizer.safetensors"), out + "/checkpoint/optimizer.safetensors",
                        1e-5, name);
  }
}

// LoRA under mpirun (the base sliced, the adapter whole on every rank) takes the steps one process takes, within
// 1e-5 as above; its checkpoint is the single-process one (PEFT adapter files, moments, state), which one process
// resumes from.
TEST(DistTrainCli, LoraEqualsSingleProcess) {
  const std::string model = golden_dir("fp32_tail_off");
  TempDir tmp;
  const std::string data = write_train_data(tmp);
  const std::string args = "train --threads 1 --model " + shell_quote(model) + " --data " + shell_quote(data) +
                           " --steps 3 --batch-tokens 64 --grad-accum 2 --warmup 1 --adam-eps 1e-5 --lr 1e-2" +
                           " --lora-rank 4 --lora-alpha 8";
  const std::string one = tmp.str("one");
  const CliResult r1 = run_nextlm(args + " --out " + shell_quote(one));
  ASSERT_EQ(r1.rc, 0) << describe(r1);
  for (const MpiLayout& c : {MpiLayout{2, 2, 2, "tp2_ep2"}, MpiLayout{4, 2, 1, "dp2_tp2"}}) {
    const std::string out = tmp.str(c.name);
    const CliResult r = run_mpi(c.np, args + " --tp " + std::to_string(c.tp) + " --ep " + std::to_string(c.ep) +
                                          " --out " + shell_quote(out));
    ASSERT_EQ(r.rc, 0) << c.name << "\n" << describe(r);
    EXPECT_NE(r.err.find("LoRA: "), std::string::npos) << r.err;
    expect_same_log(one + "/train_log.csv", out + "/train_log.csv", 1e-5, c.name);
    for (const char* f : {"adapter_model.safetensors", "optimizer.safetensors"})
      expect_same_tensors(one + "/checkpoint/" + f, out + "/checkpoint/" + f, 1e-5, c.name);
    EXPECT_EQ(read_json(one + "/checkpoint/trainer_state.json"), read_json(out + "/checkpoint/trainer_state.json"))
        << c.name;
    EXPECT_EQ(read_json(one + "/checkpoint/adapter_config.json"), read_json(out + "/checkpoint/adapter_config.json"))
        << c.name;
  }
  // One process continues the TP2·EP2 run, as it continues its own.
  const std::string more = " --steps 4 --threads 1 --data " + shell_quote(data);
  const CliResult c1 = resume_in_one_process(one, tmp.str("one4"), more);
  ASSERT_EQ(c1.rc, 0) << describe(c1);
  const CliResult c2 = resume_in_one_process(tmp.str("tp2_ep2"), tmp.str("from_tp2_ep2"), more);
  ASSERT_EQ(c2.rc, 0) << describe(c2);
  expect_same_log(tmp.str("one4/train_log.csv"), tmp.str("from_tp2_ep2/train_log.csv"), 1e-5, "from_tp2_ep2");
  expect_same_tensors(tmp.str("one4/checkpoint/adapter_model.safetensors"),
                      tmp.str("from_tp2_ep2/checkpoint/adapter_model.safetensors"), 1e-5, "from_tp2_ep2");
}

TEST(DistTrainCli, Errors) {
  const std::string model = golden_dir("fp32_tail_off");
  TempDir tmp;
  const std::string base = "train --model " + shell_quote(model) + " --data " + shell_quote(write_train_data(tmp)) +
                           " --steps 1 --out " + shell_quote(tmp.str("out"));
  // 3 processes do not split into replicas of 2.
  expect_one_error(run_mpi(3, base + " --tp 2"),
                   "error: --tp 2 does not divide the 3 processes (mpirun -np) (run nextlm train --help)");
  expect_one_error(run_mpi(2, base + " --ep 3"),
                   "error: --ep 3 does not divide the 2 processes (mpirun -np) (run nextlm train --help)");
  // Without mpirun: one process.
  const CliResult r = run_nextlm(base + " --tp 2");
  EXPECT_EQ(r.rc, 2) << describe(r);
  EXPECT_EQ(r.err, "error: --tp 2 does not divide the 1 processes (mpirun -np) (run nextlm train --help)\n");
  // On GPU shards only LoRA adapters train (a build without CUDA or NCCL says that it lacks them instead).
  const CliResult g = run_nextlm(base + " --device cuda --tp 2");
  EXPECT_EQ(g.rc, 2) << describe(g);
  EXPECT_EQ(g.err.rfind("error: ", 0), 0u) << describe(g);
  EXPECT_EQ(std::count(g.err.begin(), g.err.end(), '\n'), 1) << describe(g);
  EXPECT_TRUE(g.err.find("trains LoRA adapters (--lora-rank)") != std::string::npos ||
              g.err.find("CUDA build") != std::string::npos || g.err.find("NCCL") != std::string::npos)
      << describe(g);
  // Under mpirun every rank of a GPU-sharded LoRA run needs a GPU: where there is none (the CPU suite's machines) one
  // error, before any output.
  const CliResult m = run_mpi(2, base + " --device cuda --tp 2 --lora-rank 2");
  if (m.rc == 0) {
    EXPECT_TRUE(std::filesystem::exists(tmp.str("out/checkpoint/adapter_model.safetensors"))) << describe(m);
    std::filesystem::remove_all(tmp.str("out"));
  } else {
    size_t errors = 0;
    for (size_t p = m.err.find("error:"); p != std::string::npos; p = m.err.find("error:", p + 1)) ++errors;
    EXPECT_EQ(errors, 1u) << describe(m);
    EXPECT_TRUE(m.err.find("error: --device cuda: no CUDA device is available\n") != std::string::npos ||
                m.err.find("CUDA build") != std::string::npos || m.err.find("NCCL") != std::string::npos)
        << describe(m);
  }
  // Nothing was written.
  EXPECT_FALSE(std::filesystem::exists(tmp.str("out")));
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
