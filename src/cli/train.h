// `nextlm train`: CPU fp32 training of a glm5_next model from a config (random init) or a checkpoint.
#pragma once
#include <cstdint>
#include <string>

#include <CLI/CLI.hpp>

#include "core/error.h"
#include "model/recompute.h"

namespace nextlm {

struct TrainArgs {
  std::string config, model, data, out, resume, log;
  int64_t steps = 100, warmup = 10, batch_tokens = 2048, grad_accum = 1, save_every = 0;
  double lr = 1e-3, weight_decay = 0.1, clip = 1.0, adam_eps = 1e-8;
  uint64_t seed = 0;
  int threads = 0;
  int tp = 1, ep = 1;  // tensor- and expert-parallel ranks under mpirun; the data-parallel replicas are the rest
  // LoRA (model/lora.h): on when lora_rank > 0; needs --model (the frozen base).
  int64_t lora_rank = 0;
  double lora_alpha = 0.0;  // 0: the rank (scale 1)
  std::string lora_targets = "all", lora_experts = "per-expert";
  bool lora_rank_div_topk = false;
  std::string recompute = "auto";  // model/recompute.h's syntax
  std::string device = "cpu";     // cuda: gradients on the GPU (CudaModel::forward_backward), AdamW on the host
};

// A bad combination of train's flags (exit status 2, like CLI11's own parse errors).
struct TrainUsageError : Error {
  using Error::Error;
};

// Adds the `train` subcommand and its flags to app.
CLI::App* add_train_command(CLI::App& app, TrainArgs& a);

// Runs it. `cmd` is the parsed subcommand (to tell which flags were given: on --resume only those override the
// checkpoint's stored options). Returns the exit status: 0 when done, 130 when stopped by SIGINT (after saving).
int cmd_train(const TrainArgs& a, const CLI::App& cmd);

}  // namespace nextlm
