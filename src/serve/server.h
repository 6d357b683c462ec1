// `nextlm serve`: an OpenAI-compatible HTTP server (POST /v1/completions, POST /v1/chat/completions,
// GET /v1/models, GET /health) on the CPU decode path, with continuous batching (serve/scheduler.h).
#pragma once
#include <cstdint>
#include <string>

namespace nextlm::serve {

struct ServeOptions {
  std::string model_dir;
  std::string host = "127.0.0.1";
  int port = 8000;             // 0 picks a free port; the one bound is printed ("listening on http://HOST:PORT")
  int64_t max_batch = 8;       // requests decoded together; more wait in a queue
  int64_t max_tokens = 4096;   // prompt + max_tokens of a request, at most
  int threads = 0;             // CPU threads for the model (0: all)
};

// Loads the model, serves until SIGINT or SIGTERM, and returns the exit code (0 after a clean shutdown). On the
// signal it stops accepting connections and lets the requests already received (running or queued) finish, so
// every client gets a complete answer; each is bounded by --max-tokens. A client that disconnects mid-stream
// cancels its request. Throws Error when the model cannot be loaded or the address cannot be bound.
int run_server(const ServeOptions& opt);

}  // namespace nextlm::serve
