// The serve scheduler on the GPU (runs on a GPU machine, CTest label "gpu"): a Scheduler over a CudaBackend, as
// `nextlm serve --device cuda` runs it, against cuda_generate (what `nextlm generate --device cuda` prints). Each
// request's tokens, logprobs and alternatives must be cuda_generate's bit for bit, however the requests share the
// decoder's prefill and step calls; cancelling a request frees its slot, cleared, for a queued one; a request longer
// than the decoder's max_len fails before it reaches the GPU. And end to end: `nextlm serve --device cuda` answers
// concurrent requests with what `nextlm generate --device cuda` prints, and refuses one beyond --max-len with a 400.
// With a LoRA adapter (--adapter) generate, score and serve on the GPU give what its f32 merge gives there.
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "cuda/device_model.h"
#include "model/decode.h"
#include "serve/backend.h"
#include "serve/scheduler.h"
#include "test_util.h"

namespace nextlm {
namespace {

using serve::Job;
using serve::JobRequest;

JobRequest request_of(const std::vector<int32_t>& prompt, const GenerateOptions& opt) {
  JobRequest r;
  r.prompt = prompt;
  r.max_tokens = opt.max_new_tokens;
  r.sampling = opt.sampling;
  r.stop_tokens = opt.stop_tokens;
  r.eos_tokens = opt.eos_tokens;
  return r;
}

// Waits (at most 120 s) until the job is finished.
Job::Snapshot wait_finished(const Job& job) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  Job::Snapshot s = job.snapshot();
  while (!s.finished && std::chrono::steady_clock::now() < deadline) {
    job.wait(s.samples.size(), 100);
    s = job.snapshot();
  }
  EXPECT_TRUE(s.finished) << "the job did not finish within 120 s";
  return s;
}

// Waits (at most 120 s) until the job has at least n tokens or is finished.
void wait_tokens(const Job& job, size_t n) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  Job::Snapshot s = job.snapshot();
  while (s.samples.size() < n && !s.finished && std::chrono::steady_clock::now() < deadline) {
    job.wait(s.samples.size(), 100);
    s = job.snapshot();
  }
  ASSERT_TRUE(s.samples.size() >= n || s.finished) << "no token within 120 s";
}

// The job's tokens, logprobs, alternatives and finish reason are the generation's, bit for bit.
void expect_same_generation(const Job::Snapshot& s, const Generation& g, const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(s.finish_reason, g.stopped ? "stop" : "length") << s.error;
  ASSERT_EQ(s.samples.size(), g.tokens.size());
  int64_t tokens_differ = 0, logprobs_differ = 0;
  for (size_t i = 0; i < g.tokens.size(); ++i) {
    tokens_differ += s.samples[i].token != g.tokens[i];
    logprobs_differ += s.samples[i].logprob != g.logprobs[i];
    ASSERT_EQ(s.samples[i].top.size(), g.top[i].size()) << "token " << i;
    for (size_t k = 0; k < g.top[i].size(); ++k) {
      EXPECT_EQ(s.samples[i].top[k].token, g.top[i][k].token) << "token " << i << " alternative " << k;
      EXPECT_EQ(s.samples[i].top[k].logprob, g.top[i][k].logprob) << "token " << i << " alternative " << k;
    }
  }
  EXPECT_EQ(tokens_differ, 0) << "of " << g.tokens.size() << " tokens";
  EXPECT_EQ(logprobs_differ, 0) << "of " << g.tokens.size() << " logprobs";
}

// Requests with prompts across KDA chunks of 64 and indexer pools (1 to 130 tokens), greedy and sampled (top-k,
// top-p), some with alternatives, one with stop tokens.
struct Request {
  std::vector<int32_t> prompt;
  GenerateOptions opt;
};

std::vector<Request> requests(int64_t V) {
  const std::vector<int64_t> lengths = {1, 5, 17, 64, 66, 3, 130, 9};
  std::vector<Request> out;
  for (size_t i = 0; i < lengths.size(); ++i) {
    Request r;
    for (int64_t t = 0; t < lengths[i]; ++t)
      r.prompt.push_back(static_cast<int32_t>((t * 37 + static_cast<int64_t>(i) * 101 + (t * t) % 13) % V));
    r.opt.max_new_tokens = 6 + 7 * static_cast<int64_t>(i);
    r.opt.sampling.temperature = i % 3 == 0 ? 0.0 : 0.9;
    r.opt.sampling.top_k = i % 2 ? 20 : 0;
    r.opt.sampling.top_p = i % 3 == 2 ? 0.9 : 1.0;
    r.opt.sampling.seed = 1000 + i;
    r.opt.sampling.top_logprobs = i % 4 == 1 ? 3 : 0;
    if (i == 4) r.opt.stop_tokens = {static_cast<int32_t>(7 % V), static_cast<int32_t>(100 % V)};
    out.push_back(r);
  }
  return out;
}

// Forwards to another backend and records each call; its steps can be held, so that several requests arrive while
// the scheduler waits in one (and are then prefilled together).
class Recording final : public serve::DecodeBackend {
 public:
  explicit Recording(std::unique_ptr<serve::DecodeBackend> inner) : inner_(std::move(inner)) {}

  int64_t slots() const override { return inner_->slots(); }
  int64_t vocab_size() const override { return inner_->vocab_size(); }
  int64_t max_len() const override { return inner_->max_len(); }
  void start() override { inner_->start(); }
  std::vector<std::vector<float>> prefill(const std::vector<int64_t>& slots,
                                          const std::vector<std::vector<int32_t>>& prompts) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      prefill_sizes_.push_back(slots.size());
    }
    return inner_->prefill(slots, prompts);
  }
  std::vector<std::vector<float>> step(const std::vector<int64_t>& slots, const std::vector<int32_t>& tokens) override {
    {
      std::unique_lock<std::mutex> lk(mu_);
      waiting_ = hold_;
      cv_.notify_all();
      cv_.wait(lk, [&] { return !hold_; });
      waiting_ = false;
      max_step_ = std::max(max_step_, slots.size());
    }
    return inner_->step(slots, tokens);
  }
  void clear(int64_t slot) override { inner_->clear(slot); }

  void hold() {
    std::lock_guard<std::mutex> lk(mu_);
    hold_ = true;
  }
  void wait_held() {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return waiting_; });
  }
  void release() {
    std::lock_guard<std::mutex> lk(mu_);
    hold_ = false;
    cv_.notify_all();
  }
  std::vector<size_t> prefill_sizes() const {
    std::lock_guard<std::mutex> lk(mu_);
    return prefill_sizes_;
  }
  size_t max_step() const {
    std::lock_guard<std::mutex> lk(mu_);
    return max_step_;
  }

 private:
  std::unique_ptr<serve::DecodeBackend> inner_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool hold_ = false, waiting_ = false;
  std::vector<size_t> prefill_sizes_;
  size_t max_step_ = 0;
};

class CudaServeGolden : public ::testing::TestWithParam<std::string> {};

// (a) With batch-invariant GEMMs (serve --device cuda --batch-invariant): 8 requests on 3 slots. The first runs
// alone until the others have queued, then 2 newcomers are prefilled in one packed call and the queued ones take
// the slots that finished requests free; every request equals cuda_generate on the same model.
TEST_P(CudaServeGolden, ConcurrentRequestsEqualCudaGenerate) {
  const std::unique_ptr<CudaModel> gpu = CudaModel::load(test::golden_dir(GetParam()));
  gpu->set_batch_invariant(true);
  const std::vector<Request> reqs = requests(gpu->config().vocab_size);
  // The references first: cuda_generate runs on the model's stream and arena, which the scheduler's decoder uses.
  std::vector<Generation> want;
  for (const Request& r : reqs) want.push_back(cuda_generate(*gpu, r.prompt, r.opt));
  std::vector<std::shared_ptr<Job>> jobs;
  std::vector<size_t> prefills;
  size_t widest_step = 0;
  {
    auto rec = std::make_unique<Recording>(std::make_unique<serve::CudaBackend>(*gpu, 3, 256));
    Recording& recording = *rec;
    serve::Scheduler sched(std::move(rec));
    for (const Request& r : reqs) jobs.push_back(std::make_shared<Job>(request_of(r.prompt, r.opt)));
    recording.hold();
    sched.submit(jobs[0]);
    recording.wait_held();
    for (size_t i = 1; i < jobs.size(); ++i) sched.submit(jobs[i]);
    recording.release();
    for (const auto& j : jobs) wait_finished(*j);
    prefills = recording.prefill_sizes();
    widest_step = recording.max_step();
  }
  for (size_t i = 0; i < reqs.size(); ++i)
    expect_same_generation(jobs[i]->snapshot(), want[i], GetParam() + " request " + std::to_string(i));
  ASSERT_GE(prefills.size(), 2u);
  EXPECT_EQ(prefills[0], 1u);
  EXPECT_EQ(prefills[1], 2u);  // the two free slots' newcomers, packed
  EXPECT_EQ(widest_step, 3u);
}

// (b) Without batch-invariant GEMMs (the default): each request arrives once the previous one has its first token, so
// every prompt is prefilled alone, and the requests then step together in changing company; the steps are bitwise
// independent of the other slots, so every request equals cuda_generate.
TEST_P(CudaServeGolden, StaggeredRequestsEqualCudaGenerateWithoutBatchInvariance) {
  const std::unique_ptr<CudaModel> gpu = CudaModel::load(test::golden_dir(GetParam()));
  std::vector<Request> reqs = requests(gpu->config().vocab_size);
  reqs.resize(5);
  for (size_t i = 0; i < reqs.size(); ++i) reqs[i].opt.max_new_tokens = 90 - 15 * static_cast<int64_t>(i);
  std::vector<Generation> want;
  for (const Request& r : reqs) want.push_back(cuda_generate(*gpu, r.prompt, r.opt));
  std::vector<std::shared_ptr<Job>> jobs;
  {
    serve::Scheduler sched(std::make_unique<serve::CudaBackend>(*gpu, 4, 256));
    for (const Request& r : reqs) {
      jobs.push_back(std::make_shared<Job>(request_of(r.prompt, r.opt)));
      sched.submit(jobs.back());
      wait_tokens(*jobs.back(), 1);
    }
    for (const auto& j : jobs) wait_finished(*j);
  }
  for (size_t i = 0; i < reqs.size(); ++i)
    expect_same_generation(jobs[i]->snapshot(), want[i], GetParam() + " request " + std::to_string(i));
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaServeGolden, ::testing::ValuesIn(test::golden_cases()),
                         [](const auto& info) { return test::param_name(info.param); });

// (c) One slot: a long request runs, another waits; cancelling the first finishes it as "cancelled" and the queued
// one gets the slot, cleared, and equals cuda_generate (a cache left over from the first would change it).
TEST(CudaServe, CancellingFreesTheSlotForAQueuedRequest) {
  const std::unique_ptr<CudaModel> gpu = CudaModel::load(test::golden_dir("tiny-glm5-next"));
  const int64_t V = gpu->config().vocab_size;
  GenerateOptions long_opt;
  long_opt.max_new_tokens = 2000;
  long_opt.sampling.temperature = 0;
  std::vector<int32_t> long_prompt;
  for (int64_t t = 0; t < 70; ++t) long_prompt.push_back(static_cast<int32_t>((t * 11 + 3) % V));
  const Request queued_req = requests(V)[3];  // 64 tokens
  const Generation want = cuda_generate(*gpu, queued_req.prompt, queued_req.opt);
  auto running = std::make_shared<Job>(request_of(long_prompt, long_opt));
  auto queued = std::make_shared<Job>(request_of(queued_req.prompt, queued_req.opt));
  serve::Scheduler sched(std::make_unique<serve::CudaBackend>(*gpu, 1, 2100));
  sched.submit(running);
  wait_tokens(*running, 3);
  sched.submit(queued);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(sched.queued(), 1);
  EXPECT_TRUE(queued->snapshot().samples.empty());
  running->cancel();
  const Job::Snapshot c = wait_finished(*running);
  EXPECT_EQ(c.finish_reason, "cancelled");
  EXPECT_LT(c.samples.size(), 2000u);
  expect_same_generation(wait_finished(*queued), want, "the queued request");
}

// (d) prompt + max_tokens beyond the decoder's max_len fails at once (the HTTP layer answers 400 first); exactly
// max_len runs.
TEST(CudaServe, RequestsLongerThanMaxLenFail) {
  const std::unique_ptr<CudaModel> gpu = CudaModel::load(test::golden_dir("tiny-glm5-next"));
  GenerateOptions opt;
  opt.max_new_tokens = 3;
  opt.sampling.temperature = 0;
  const std::vector<int32_t> prompt(30, 5);
  const Generation want = cuda_generate(*gpu, prompt, opt);
  serve::Scheduler sched(std::make_unique<serve::CudaBackend>(*gpu, 2, 33));
  auto too_long = std::make_shared<Job>(request_of(std::vector<int32_t>(31, 5), opt));
  auto fits = std::make_shared<Job>(request_of(prompt, opt));
  sched.submit(too_long);
  sched.submit(fits);
  const Job::Snapshot t = wait_finished(*too_long);
  EXPECT_EQ(t.finish_reason, "error");
  EXPECT_NE(t.error.find("33 tokens per sequence"), std::string::npos) << t.error;
  expect_same_generation(wait_finished(*fits), want, "the request that fits");
}

// ---- End to end: the nextlm binary ----

// The binary: $NEXTLM_BINARY (binaries run away from their build tree), else the one built with this test.
std::string nextlm_binary() {
  const char* e = std::getenv("NEXTLM_BINARY");
  return e ? e : NEXTLM_BINARY;
}

// `nextlm serve --port 0 ARGS` as a child process (its stderr is this test's; CUDA start-up and the weights' upload
// may take a while).
class ServerProcess : public test::ServeProcess {
 public:
  explicit ServerProcess(std::vector<std::string> args)
      : test::ServeProcess(nextlm_binary(), std::move(args), 180, false) {}
  int stop() { return test::ServeProcess::stop(SIGTERM, 60); }
};

nlohmann::json post(int port, const nlohmann::json& body, int* status) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(120);
  auto res = c.Post("/v1/completions", body.dump(), "application/json");
  *status = res ? res->status : 0;
  return res ? nlohmann::json::parse(res->body, nullptr, false) : nlohmann::json();
}

// 4 concurrent seeded and greedy completions on 2 slots with --batch-invariant: each request's tokens are those of
// `nextlm generate --device cuda --batch-invariant` with the same options, and its logprobs too (to the 9 significant
// digits generate prints). A request beyond --max-len is a 400 naming it; SIGTERM exits 0.
TEST(CudaServe, HttpCompletionsEqualGenerate) {
  if (!std::filesystem::exists(nextlm_binary())) GTEST_SKIP() << "no nextlm binary at " << nextlm_binary();
  const std::string model = test::golden_dir("tiny-glm5-next");
  ServerProcess server({"--model", model, "--device", "cuda", "--batch-invariant", "--max-batch", "2", "--max-len",
                        "64", "--threads", "1"});
  struct Req {
    std::vector<int32_t> prompt;
    int64_t max_tokens;
    double temperature;
    uint64_t seed;
  };
  const std::vector<Req> reqs = {{{72, 101, 108, 108, 111}, 20, 0.0, 1},
                                 {{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13}, 30, 0.8, 2},
                                 {{200}, 40, 1.0, 3},
                                 {{9, 8, 7}, 25, 0.7, 4}};
  std::vector<nlohmann::json> got(reqs.size());
  std::vector<int> status(reqs.size());
  std::vector<std::thread> clients;
  for (size_t i = 0; i < reqs.size(); ++i)
    clients.emplace_back([&, i] {
      got[i] = post(server.port(),
                    {{"prompt", reqs[i].prompt}, {"max_tokens", reqs[i].max_tokens},
                     {"temperature", reqs[i].temperature}, {"seed", reqs[i].seed}, {"logprobs", 0},
                     {"ignore_eos", true}},
                    &status[i]);
    });
  for (auto& t : clients) t.join();
  for (size_t i = 0; i < reqs.size(); ++i) {
    SCOPED_TRACE("request " + std::to_string(i));
    ASSERT_EQ(status[i], 200) << got[i].dump();
    std::string ids;
    for (int32_t t : reqs[i].prompt) ids += (ids.empty() ? "" : ",") + std::to_string(t);
    std::string out, err;
    const int rc = test::run_command(
        test::shell_quote(nextlm_binary()) + " generate --device cuda --batch-invariant --ignore-eos --format json " +
            "--model " + test::shell_quote(model) + " --prompt-tokens " + ids + " --max-new-tokens " +
            std::to_string(reqs[i].max_tokens) + " --temperature " + std::to_string(reqs[i].temperature) +
            " --seed " + std::to_string(reqs[i].seed),
        &out, &err);
    ASSERT_EQ(rc, 0) << err;
    const nlohmann::json want = nlohmann::json::parse(out);
    const nlohmann::json& choice = got[i]["choices"][0];
    EXPECT_EQ(choice["tokens"], want["tokens"]);
    const std::vector<double> lp = choice["logprobs"]["token_logprobs"].get<std::vector<double>>(),
                              want_lp = want["logprobs"].get<std::vector<double>>();
    ASSERT_EQ(lp.size(), want_lp.size());
    for (size_t k = 0; k < lp.size(); ++k) EXPECT_NEAR(lp[k], want_lp[k], 1e-8 + 1e-8 * std::fabs(want_lp[k])) << k;
  }
  int code = 0;
  const nlohmann::json refused = post(server.port(), {{"prompt", {1, 2, 3, 4, 5}}, {"max_tokens", 60}}, &code);
  EXPECT_EQ(code, 400) << refused.dump();
  EXPECT_EQ(refused["error"]["code"], "context_length_exceeded") << refused.dump();
  EXPECT_NE(refused["error"]["message"].get<std::string>().find("limit of 64 tokens (--max-len)"), std::string::npos)
      << refused.dump();
  EXPECT_EQ(server.stop(), 0);
}


// A LoRA adapter on the GPU (`generate`/`score`/`serve --device cuda --adapter`): merged into the fp32 host weights
// at load and rounded onto the device, as `merge --dtype f32` writes them and the GPU then loads them. An adapter
// trained for three steps on the CPU; generate's greedy tokens and log-probs and score's log-probs with --adapter are
// exactly those of the f32 merge on the GPU, generate's tokens differ from the base's (so the adapter was applied),
// and the server's greedy completion with --adapter equals generate's.
TEST(CudaServe, AdapterOnTheGpuEqualsItsF32Merge) {
  if (!std::filesystem::exists(nextlm_binary())) GTEST_SKIP() << "no nextlm binary at " << nextlm_binary();
  const std::string model = test::golden_dir("tiny-glm5-next"), bin = test::shell_quote(nextlm_binary());
  test::TempDir dir;
  const std::string data = dir.str("data.jsonl");
  test::write_byte_jsonl(data, {"the cat sat on the mat.", "the dog sat on the log.", "a cat and a dog."});
  auto run = [&](const std::string& args) {
    std::string out, err;
    const int rc = test::run_command(bin + " " + args, &out, &err);
    EXPECT_EQ(rc, 0) << args << "\n" << err;
    return out;
  };
  const std::string q = test::shell_quote(model), ck = dir.str("run") + "/checkpoint";
  run("train --model " + q + " --data " + test::shell_quote(data) + " --out " + test::shell_quote(dir.str("run")) +
      " --lora-rank 4 --lora-alpha 8 --steps 3 --lr 2e-2 --warmup 1 --batch-tokens 64 --threads 1");
  ASSERT_TRUE(std::filesystem::exists(ck + "/adapter_model.safetensors"));
  run("merge --model " + q + " --adapter " + test::shell_quote(ck) + " --out " + test::shell_quote(dir.str("m32")) +
      " --dtype f32");
  const std::string gen = "generate --device cuda --batch-invariant --prompt-tokens 84,104,101,32,99 "
                          "--max-new-tokens 12 --temperature 0 --ignore-eos --format json --model ";
  const std::string g_with = run(gen + q + " --adapter " + test::shell_quote(ck));
  const std::string g_m32 = run(gen + test::shell_quote(dir.str("m32")));
  const std::string g_plain = run(gen + q);
  ASSERT_FALSE(g_with.empty());
  EXPECT_EQ(g_with, g_m32);
  const nlohmann::json with = nlohmann::json::parse(g_with);
  EXPECT_NE(with.at("tokens"), nlohmann::json::parse(g_plain).at("tokens"));
  const std::string score = "score --device cuda --input " + test::shell_quote(data) + " --model ";
  const std::string s_with = run(score + q + " --adapter " + test::shell_quote(ck));
  EXPECT_FALSE(s_with.empty());
  EXPECT_EQ(s_with, run(score + test::shell_quote(dir.str("m32"))));
  EXPECT_NE(s_with, run(score + q));
  ServerProcess server({"--model", model, "--device", "cuda", "--batch-invariant", "--adapter", ck, "--max-batch",
                        "2", "--max-len", "64", "--threads", "1"});
  int status = 0;
  const nlohmann::json got = post(server.port(),
                                  {{"prompt", {84, 104, 101, 32, 99}}, {"max_tokens", 12}, {"temperature", 0},
                                   {"ignore_eos", true}},
                                  &status);
  ASSERT_EQ(status, 200) << got.dump();
  EXPECT_EQ(got["choices"][0]["tokens"], with.at("tokens")) << got.dump();
  EXPECT_EQ(server.stop(), 0);
}

}  // namespace
}  // namespace nextlm
