// `nextlm serve`: an OpenAI-compatible HTTP server (POST /v1/completions, POST /v1/chat/completions,
// GET /v1/models, GET /health) on the CPU decode path or the GPU's, with continuous batching (serve/scheduler.h).
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "model/config.h"
#include "serve/backend.h"

namespace nextlm::serve {

struct ServeOptions {
  std::string model_dir;
  std::string adapter;  // a LoRA adapter directory (PEFT), merged into the fp32 weights at load; empty: none
  std::string host = "127.0.0.1";
  int port = 8000;             // 0 picks a free port; the one bound is printed ("listening on http://HOST:PORT")
  int64_t max_batch = 8;       // requests decoded together; more wait in a queue
  int64_t max_tokens = 4096;   // prompt + max_tokens of a request, at most
  int threads = 0;             // CPU threads for the model (0: all)
  std::string device = "cpu";  // cpu, or cuda (a CudaDecoder of max_batch slots; CUDA builds only)
  // cuda: tokens per decoder slot, which bounds prompt + max_tokens of a request as max_tokens does; 0: the smaller
  // of max_tokens, the model's max_position_embeddings and kDefaultMaxLen.
  int64_t max_len = 0;
  bool batch_invariant = false;  // cuda: CudaModel::set_batch_invariant (prefills independent of the other prompts)
  int tp = 1, ep = 1;  // tensor- and expert-parallel ranks under mpirun (cpu; the CLI makes the DistBackend)
};

constexpr int64_t kDefaultMaxLen = 8192;

// The --max-len a cuda server uses for these options and the model directory (config.json's
// max_position_embeddings, nested under text_config or not, when it has one).
int64_t decoder_max_len(const ServeOptions& opt);

// Loads the model, serves until SIGINT or SIGTERM, and returns the exit code (0 after a clean shutdown). On the
// signal it stops accepting connections and lets the requests already received (running or queued) finish, so
// every client gets a complete answer; each is bounded by --max-tokens. A client that disconnects mid-stream
// cancels its request. Throws Error when the model cannot be loaded, the options do not fit the device (max_len or
// batch_invariant without cuda, cuda in a build without it) or the address cannot be bound.
int run_server(const ServeOptions& opt);
// The same with a backend made by the caller over a model it holds (config): `serve --tp/--ep`'s DistBackend on
// rank 0 (serve/dist_backend.h).
int run_server(const ServeOptions& opt, std::unique_ptr<DecodeBackend> backend, const ModelConfig& config);

}  // namespace nextlm::serve
