// End-to-end tests of `nextlm train`: a tiny model trained from its config on a small text lowers its loss and
// leaves a loadable model, a CSV log and an SVG curve; bad input leaves no output; ctrl-C (SIGINT) saves a
// checkpoint that --resume continues.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "test_util.h"

namespace nextlm::test {
namespace {

namespace fs = std::filesystem;



std::string config() { return std::string(NEXTLM_SOURCE_DIR) + "/examples/fortunes/config.json"; }

// A small text as byte-level JSONL, one sentence per line.
std::string write_text_data(const TempDir& dir) {
  const std::vector<std::string> lines = {
      "the cat sat on the mat and the dog sat on the log.", "the cat and the dog sat on the mat.",
      "a cat sat on a mat; a dog sat on a log.", "the dog and the cat sat on the log and the mat."};
  const std::string path = dir.str("data.jsonl");
  std::ofstream f(path);
  for (const std::string& l : lines) {
    f << "{\"tokens\": [";
    for (size_t i = 0; i < l.size(); ++i) f << (i ? ", " : "") << int(static_cast<unsigned char>(l[i]));
    f << "]}\n";
  }
  return path;
}

TEST(TrainCli, TinyModelLearnsAndLeavesAModelLogAndCurve) {
  TempDir dir;
  const std::string data = write_text_data(dir), out = dir.str("run");
  const CliResult r = run_nextlm("train --config '" + config() + "' --data '" + data + "' --out '" + out +
                          "' --steps 12 --warmup 2 --lr 1e-2 --batch-tokens 256 --threads 2 --seed 1");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("step 12/12"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("tok/s"), std::string::npos);
  EXPECT_NE(r.err.find("eta"), std::string::npos);
  for (const char* f : {"checkpoint/config.json", "checkpoint/model.safetensors", "checkpoint/optimizer.safetensors",
                        "checkpoint/trainer_state.json", "train_log.csv", "train_log.svg"})
    EXPECT_TRUE(fs::exists(fs::path(out) / f)) << f;
  const std::vector<double> losses = csv_losses(out + "/train_log.csv");
  ASSERT_EQ(losses.size(), 12u);
  EXPECT_NEAR(losses.front(), std::log(256.0), 0.3);  // a fresh model is close to uniform over bytes
  EXPECT_LT(losses.back(), losses.front() - 1.0) << "loss did not fall";
  std::ifstream svg(out + "/train_log.svg");
  const std::string s((std::istreambuf_iterator<char>(svg)), {});
  EXPECT_EQ(s.rfind("<svg", 0), 0u);
  EXPECT_NE(s.find("<polyline"), std::string::npos);
  // The trained model is a model directory the other commands read.
  const CliResult sc = run_nextlm("score --model '" + out + "/checkpoint' --input '" + data + "'");
  EXPECT_EQ(sc.rc, 0) << sc.err;
  // Starting again into the same --out without --resume would overwrite the run: refused.
  const CliResult again = run_nextlm("train --config '" + config() + "' --data '" + data + "' --out '" + out + "' --steps 1");
  EXPECT_EQ(again.rc, 1);
  EXPECT_NE(again.err.find("--resume"), std::string::npos) << again.err;
}

TEST(TrainCli, BadInputGivesOneLineErrorAndNoOutput) {
  TempDir dir;
  const std::string data = write_text_data(dir), out = dir.str("run");
  std::ofstream(dir.str("bad.jsonl")) << "{\"tokens\": [1, 2, 3]}\n{\"tokens\": [1, 2], \"loss_mask\": [1]}\n";
  struct Case {
    std::string args;
    int rc;
    std::string mention;
  };
  const std::vector<Case> cases = {
      {"--config '" + config() + "' --data '" + dir.str("bad.jsonl") + "'", 1, "bad.jsonl:2"},
      {"--config '" + config() + "' --data '" + dir.str("missing.jsonl") + "'", 1, "missing.jsonl"},
      {"--config '" + dir.str("nope.json") + "' --data '" + data + "'", 1, "nope.json"},
      {"--config '" + config() + "' --model x --data '" + data + "'", 2, "exactly one of"},
      {"--config '" + config() + "' --data '" + data + "' --lr -1", 2, "--lr"},
      {"--config '" + config() + "' --data '" + data + "' --lr inf", 2, "--lr"},
      {"--config '" + config() + "' --data '" + data + "' --weight-decay inf", 2, "--weight-decay"},
      {"--config '" + config() + "' --data '" + data + "' --batch-tokens 99999999999999", 2, "--batch-tokens"},
      {"--config '" + config() + "' --data '" + data + "' --grad-accum 0", 2, "--grad-accum"},
      {"--resume '" + dir.str("nothing") + "' --data '" + data + "'", 1, "--resume"},
      {"--config '" + config() + "' --data '" + data + "' --recompute kda,attention", 2, "--recompute: unknown"},
      {"--config '" + config() + "' --data '" + data + "' --recompute ''", 2, "--recompute"},
      {"--config '" + config() + "' --data '" + data + "' --recompute moe,moe", 2, "twice"},
      {"--config '" + config() + "' --data '" + data + "' --device tpu", 2, "--device"},
  };
  for (const Case& c : cases) {
    const CliResult r = run_nextlm("train " + c.args + " --out '" + out + "' --steps 2");
    EXPECT_EQ(r.rc, c.rc) << c.args << "\n" << r.err;
    EXPECT_EQ(r.err.rfind("error:", 0), 0u) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(r.err.find(c.mention), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(out)) << c.args;
  }
}

// `--device cuda` where it cannot run (a build without CUDA, or no GPU: the CPU suite's machines) stops before any
// output exists, whether the host holds the model (full-parameter) or only its config and shapes (LoRA): the device
// model is loaded before the output directory and the log are made.
TEST(TrainCli, DeviceCudaThatCannotRunLeavesNoOutput) {
  TempDir dir;
  const std::string data = write_text_data(dir), out = dir.str("run");
  const std::string tiny = std::string(NEXTLM_SOURCE_DIR) + "/examples/tiny-glm5-next";
  for (const std::string& args : {"--config '" + config() + "'", "--model '" + tiny + "' --lora-rank 2"}) {
    const CliResult r = run_nextlm("train " + args + " --data '" + data + "' --out '" + out +
                                   "' --steps 1 --batch-tokens 64 --device cuda");
    if (r.rc == 0) GTEST_SKIP() << "a CUDA device is present here: the GPU suite covers `train --device cuda`";
    EXPECT_TRUE(r.rc == 1 || r.rc == 2) << r.err;
    EXPECT_EQ(r.err.rfind("error:", 0), 0u) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(r.err.find("CUDA"), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(out)) << args << "\n" << r.err;
  }
}

// The columns of a log but the seconds.
std::vector<std::string> csv_rows_without_time(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  std::string line;
  while (std::getline(in, line)) out.push_back(line.substr(0, line.rfind(',')));
  return out;
}

// --recompute changes memory and time only: the same log bit for bit; the policy and the peak memory are reported
// at the end, and a resumed run keeps the stored policy unless --recompute is given again.
TEST(TrainCli, RecomputePolicyIsReportedStoredAndChangesNoResult) {
  TempDir dir;
  const std::string data = write_text_data(dir);
  const std::string common = "train --config '" + config() + "' --data '" + data +
                             "' --steps 3 --warmup 1 --lr 1e-2 --batch-tokens 128 --threads 2 --seed 4";
  const CliResult all = run_nextlm(common + " --out '" + dir.str("all") + "'");
  ASSERT_EQ(all.rc, 0) << all.err;
  // The default, auto, is on the CPU everything recomputed but the routed experts' gate|up and the dense MLP
  // (model/recompute.h).
  EXPECT_NE(all.err.find("recompute auto (kda,mla,moe,mhc)"), std::string::npos) << all.err;
  const CliResult none = run_nextlm(common + " --out '" + dir.str("none") + "' --recompute none");
  ASSERT_EQ(none.rc, 0) << none.err;
  const std::string done = none.err.substr(none.err.find("done:"));
  EXPECT_NE(done.find("tokens/s"), std::string::npos) << done;
  EXPECT_NE(done.find("peak memory"), std::string::npos) << done;
  EXPECT_NE(done.find("with recompute none"), std::string::npos) << done;
  const auto rows = csv_rows_without_time(dir.str("all") + "/train_log.csv");
  EXPECT_EQ(rows.size(), 4u);
  EXPECT_EQ(csv_rows_without_time(dir.str("none") + "/train_log.csv"), rows);
  const std::string resume = "train --resume '" + dir.str("none") + "' --out '" + dir.str("none") + "' --data '" + data;
  const CliResult resumed = run_nextlm(resume + "' --steps 4");
  ASSERT_EQ(resumed.rc, 0) << resumed.err;
  EXPECT_NE(resumed.err.find("with recompute none"), std::string::npos) << resumed.err;
  const CliResult changed = run_nextlm(resume + "' --steps 5 --recompute kda,mhc");
  ASSERT_EQ(changed.rc, 0) << changed.err;
  EXPECT_NE(changed.err.find("with recompute kda,mhc"), std::string::npos) << changed.err;
}

TEST(TrainCli, SigintSavesACheckpointThatResumes) {
  TempDir dir;
  const std::string data = write_text_data(dir), out = dir.str("run");
  // Start a long run as a child process, wait for its second logged step, then send it ctrl-C's signal.
  const std::vector<std::string> args = {NEXTLM_BINARY, "train", "--config", config(), "--data", data, "--out", out,
                                         "--steps", "100000", "--batch-tokens", "64", "--threads", "1"};
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const int fd = open(dir.str("err").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 2);
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (std::chrono::steady_clock::now() < deadline) {
    std::ifstream log(out + "/train_log.csv");
    std::string all((std::istreambuf_iterator<char>(log)), {});
    if (std::count(all.begin(), all.end(), '\n') >= 3) break;  // header + 2 steps
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  kill(pid, SIGINT);
  int status = 0;
  waitpid(pid, &status, 0);
  const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;

  std::ifstream errf(dir.str("err"));
  const std::string err((std::istreambuf_iterator<char>(errf)), {});
  EXPECT_EQ(rc, 130) << err;
  EXPECT_NE(err.find("interrupted after step"), std::string::npos) << err;
  std::ifstream st(out + "/checkpoint/trainer_state.json");
  ASSERT_TRUE(st.good());
  const nlohmann::json state = nlohmann::json::parse(st);
  const int64_t step = state.at("step").get<int64_t>();
  EXPECT_GE(step, 2);
  for (const auto& e : fs::directory_iterator(out))  // no temporary left behind
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
  // --resume continues from there to the new total.
  const CliResult r = run_nextlm("train --resume '" + out + "' --data '" + data + "' --out '" + out + "' --steps " +
                          std::to_string(step + 1) + " --threads 1");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("step " + std::to_string(step + 1) + "/"), std::string::npos) << r.err;
  EXPECT_EQ(csv_losses(out + "/train_log.csv").size(), static_cast<size_t>(step + 1));
}

}  // namespace
}  // namespace nextlm::test
