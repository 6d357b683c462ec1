// Load generator for `nextlm serve`: N concurrent clients each send M POST /v1/completions requests on loopback and
// it reports failed requests, p50/p99 latency and generated tokens per second.
//
//   nextlm_load_test --port P [--host 127.0.0.1] [--clients 8] [--requests 8] [--max-tokens 32] [--prompt TEXT]
//                    [--prompt-tokens 1,2,3]
// Exit status 0 when every request succeeded.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <httplib.h>
#include <nlohmann/json.hpp>

int main(int argc, char** argv) {
  std::string host = "127.0.0.1", prompt = "The quick brown fox", prompt_tokens;
  int port = 0, clients = 8, requests = 8, max_tokens = 32;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--host") host = v;
    else if (k == "--port") port = std::atoi(v.c_str());
    else if (k == "--clients") clients = std::atoi(v.c_str());
    else if (k == "--requests") requests = std::atoi(v.c_str());
    else if (k == "--max-tokens") max_tokens = std::atoi(v.c_str());
    else if (k == "--prompt") prompt = v;
    else if (k == "--prompt-tokens") prompt_tokens = v;
    else {
      std::fprintf(stderr, "error: unknown option %s\n", k.c_str());
      return 2;
    }
  }
  if (port <= 0 || clients < 1 || requests < 1 || max_tokens < 1) {
    std::fprintf(stderr, "usage: nextlm_load_test --port P [--clients N] [--requests M] [--max-tokens K]\n");
    return 2;
  }
  nlohmann::json prompt_json = prompt;
  if (!prompt_tokens.empty()) {
    prompt_json = nlohmann::json::array();
    for (size_t s = 0; s <= prompt_tokens.size();) {
      const size_t e = std::min(prompt_tokens.find(',', s), prompt_tokens.size());
      prompt_json.push_back(std::atoi(prompt_tokens.substr(s, e - s).c_str()));
      s = e + 1;
    }
  }

  std::mutex mu;
  std::vector<double> latencies;  // seconds, successful requests
  std::atomic<int64_t> failed{0}, tokens{0};
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      httplib::Client cli(host, port);
      cli.set_connection_timeout(5);
      cli.set_read_timeout(300);
      cli.set_write_timeout(30);
      for (int r = 0; r < requests; ++r) {
        const nlohmann::json body = {{"prompt", prompt_json}, {"max_tokens", max_tokens}, {"temperature", 0.8},
                                     {"seed", c * requests + r}};
        const auto start = std::chrono::steady_clock::now();
        auto res = cli.Post("/v1/completions", body.dump(), "application/json");
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (!res || res->status != 200) {
          ++failed;
          std::fprintf(stderr, "request failed: %s\n",
                       res ? (std::to_string(res->status) + " " + res->body).c_str() : httplib::to_string(res.error()).c_str());
          continue;
        }
        tokens += nlohmann::json::parse(res->body)["usage"]["completion_tokens"].get<int64_t>();
        std::lock_guard<std::mutex> lk(mu);
        latencies.push_back(secs);
      }
    });
  }
  for (auto& t : threads) t.join();
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  std::sort(latencies.begin(), latencies.end());
  auto pct = [&](double q) {
    if (latencies.empty()) return 0.0;
    const size_t i = std::min(latencies.size() - 1, static_cast<size_t>(q * (latencies.size() - 1) + 0.5));
    return latencies[i];
  };
  std::printf("clients %d x requests %d, max_tokens %d: %zu ok, %lld failed\n", clients, requests, max_tokens,
              latencies.size(), static_cast<long long>(failed.load()));
  std::printf("latency p50 %.3f s, p99 %.3f s, max %.3f s\n", pct(0.50), pct(0.99), pct(1.0));
  std::printf("%lld tokens generated in %.2f s: %.1f tokens/s, %.2f requests/s\n",
              static_cast<long long>(tokens.load()), wall, tokens.load() / wall, latencies.size() / wall);
  return failed.load() == 0 ? 0 : 1;
}
