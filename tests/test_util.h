// Shared helpers for the tests: paths of the committed goldens, temporary directories, error norms.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/lora.h"
#include "model/trainer.h"

namespace nextlm {
class Model;
}

namespace nextlm::test {

// Golden case directories under tests/golden (each holds a checkpoint and golden.safetensors).
std::vector<std::string> golden_cases();
std::string golden_dir(const std::string& name);
// A case name usable as a GoogleTest parameter name (letters, digits, underscores).
std::string param_name(const std::string& name);

// The model in DIR with the weights the GPU stores in bf16 rounded to bf16 (the projections, experts, embedding and
// lm_head; norms, mHC, conv, gates and the correction bias stay fp32 on both): the CPU reference of the CUDA path.
// For a bf16 checkpoint this changes nothing; for an fp32 one it removes the weight rounding from the comparison.
Model bf16_weights_reference(const std::string& dir);
// The same for a model in memory.
Model bf16_weights_reference(const Model& m);

// The token sequences tokens.0, tokens.1, … of a golden case's golden.safetensors (the inputs its goldens were made
// from).
std::vector<std::vector<int32_t>> golden_sequences(const std::string& dir);

// An adapter of rank `rank` (alpha 8) on every projection of a model of config c, one per routed expert or one for all
// of a layer's experts, with B drawn normal(0, 0.05) (not LoRA's zero init) so that its A gradients are not zero.
LoraAdapter random_lora(const ModelConfig& c, LoraExperts experts, int64_t rank = 4);
// The CPU reference of an adapter's gradients on a batch: the merged model's full weight gradient, then the
// adapter's (added into ad's dA and dB). Returns the loss.
double cpu_lora_gradients(const Model& base, LoraAdapter& ad, const PackedBatch& batch);
// A copy of ad with its gradients zeroed.
LoraAdapter without_gradients(LoraAdapter ad);

// The values of every module's A and B, back to back.
std::vector<float> adapter_values(const LoraAdapter& a);
// Training examples of the given lengths, token t of example i (i·31 + t·17 + 3) mod vocab; examples 1, 4, 7, …
// train only their second half (a loss mask).
std::vector<TrainExample> synthetic_examples(const std::vector<int>& lengths, int64_t vocab);
// The loss column of a `train` log (train_log.csv; its header is checked).
std::vector<double> csv_losses(const std::string& path);

// A fresh empty directory under the system temp dir, removed when the object dies.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::filesystem::path& path() const { return path_; }
  std::string str(const std::string& child = "") const { return (path_ / child).string(); }

 private:
  std::filesystem::path path_;
};

// max|a − b| / max|b|; NaN anywhere gives +inf so that it never passes.
double max_rel_error(const float* a, const float* b, size_t n);
// ‖a − b‖ / ‖b‖ (NaN gives +inf).
double norm_rel_error(const float* a, const float* b, size_t n);

// Random normal values (deterministic for a seed).
std::vector<float> randn(size_t n, unsigned seed, float scale = 1.0f);

// Writes path as JSONL, one {"tokens": [...]} line per text: its bytes as token ids (the byte-level vocabulary of
// the bundled models).
void write_byte_jsonl(const std::string& path, const std::vector<std::string>& texts);

// Runs a command through the shell; returns the exit status and fills stdout/stderr text.
int run_command(const std::string& cmd, std::string* out, std::string* err);

// The built nextlm binary run with `args` (shell words, quoted as needed with shell_quote): exit status, stdout,
// stderr.
struct CliResult {
  int rc = -1;
  std::string out, err;
};
CliResult run_nextlm(const std::string& args);
// s as one single-quoted shell word.
std::string shell_quote(const std::string& s);

// `BINARY serve --port 0 ARGS` as a child process: its stdout is read for the "listening on http://127.0.0.1:PORT"
// line for up to start_seconds (CUDA start-up and a weights upload take a while); its stderr is this process's, or
// /dev/null when quiet. Throws std::runtime_error with what it printed when it did not start. Killed and reaped when
// this dies, unless stop() ran. With a launcher (`mpiexec … -np 2`), `LAUNCHER BINARY serve --port 0 ARGS` in a
// process group of its own, which is killed whole.
class ServeProcess {
 public:
  ServeProcess(const std::string& binary, std::vector<std::string> args, int start_seconds = 30, bool quiet = true,
               const std::vector<std::string>& launcher = {});
  ~ServeProcess();
  ServeProcess(const ServeProcess&) = delete;
  ServeProcess& operator=(const ServeProcess&) = delete;
  int port() const { return port_; }
  // Sends `sig` and waits up to timeout_seconds: the exit status, or −1 (then it is killed).
  int stop(int sig, int timeout_seconds = 15);

 private:
  int pid_ = -1;
  int out_ = -1;
  int port_ = 0;
  bool group_ = false;  // pid_ leads a process group (a launcher's)
};

// Copies a checkpoint directory.
void copy_dir(const std::string& from, const std::string& to);

// Writes config.json and model.safetensors in dir: the golden model fp32_flat_softplus (one with the k-pool tail, so
// that generating and scoring agree: see decode.h) with a vocabulary of `vocab` tokens, its extra embedding and
// lm_head rows random (seed 17, scale 0.02): a model that is not byte-level.
void write_wide_vocab_model(const std::string& dir, int64_t vocab = 300);

}  // namespace nextlm::test
