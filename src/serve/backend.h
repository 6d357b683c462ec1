// The decoders that the serve scheduler (serve/scheduler.h) drives: a fixed number of slots, each holding one
// sequence, a prefill of several prompts and a one-token step of several slots, each giving next-token logits per slot.
// CpuBackend runs the CPU decode path (model/decode.h) one sequence after the other; CudaBackend (CUDA builds) is one
// CudaDecoder (cuda/device_model.h), every call one batched launch.
#pragma once
#include <cstdint>
#include <optional>
#include <vector>

#include "model/decode.h"
#include "model/model.h"
#ifdef NEXTLM_HAVE_CUDA
#include "cuda/device_model.h"
#endif

namespace nextlm::serve {

// Every call comes from the scheduler's one thread. A slot's results must not depend on the other slots of the same
// call or on what the slot held before it was cleared: that is what makes a request's tokens those of `generate`.
class DecodeBackend {
 public:
  virtual ~DecodeBackend() = default;

  virtual int64_t slots() const = 0;       // sequences held at once (serve's --max-batch)
  virtual int64_t vocab_size() const = 0;  // V of the logits
  // Tokens one slot holds at most, prompt and generated tokens together; 0 for no limit.
  virtual int64_t max_len() const = 0;
  // Called once on the scheduler's thread before any other call (OpenMP's thread count is per thread).
  virtual void start() {}

  // Fills empty slots (distinct) with prompts (non-empty); returns the logits [V] after each prompt.
  virtual std::vector<std::vector<float>> prefill(const std::vector<int64_t>& slots,
                                                  const std::vector<std::vector<int32_t>>& prompts) = 0;
  // Appends one token to each of the slots (distinct, prefilled); returns the logits [V] after each.
  virtual std::vector<std::vector<float>> step(const std::vector<int64_t>& slots,
                                               const std::vector<int32_t>& tokens) = 0;
  // Empties a slot, whatever state a finished, cancelled or failed job left it in.
  virtual void clear(int64_t slot) = 0;
};

// The CPU decode path: one DecodeState per slot, prefill() and decode_step() per sequence in the order given.
class CpuBackend final : public DecodeBackend {
 public:
  // threads: CPU threads for the model (0: all), set on the scheduler's thread. The model must outlive this.
  CpuBackend(const Model& model, int64_t slots, int threads);

  int64_t slots() const override { return static_cast<int64_t>(states_.size()); }
  int64_t vocab_size() const override { return model_.config().vocab_size; }
  int64_t max_len() const override { return 0; }
  void start() override;
  std::vector<std::vector<float>> prefill(const std::vector<int64_t>& slots,
                                          const std::vector<std::vector<int32_t>>& prompts) override;
  std::vector<std::vector<float>> step(const std::vector<int64_t>& slots, const std::vector<int32_t>& tokens) override;
  void clear(int64_t slot) override;

 private:
  DecodeState& state(int64_t slot);  // a prefilled slot's state

  const Model& model_;
  const int threads_;
  std::vector<std::optional<DecodeState>> states_;  // [slots]: empty until prefilled
};

#ifdef NEXTLM_HAVE_CUDA
// One CudaDecoder with `slots` slots of max_len tokens: a prefill call runs its prompts as one packed batch, a step
// call all its slots in one batched decoding step. Steps are bitwise independent of the other slots; a packed
// prefill is too when the model is batch-invariant (CudaModel::set_batch_invariant), and otherwise may differ in the
// last bits from the prompt prefilled alone (cuBLASLt picks its algorithm by the number of rows).
class CudaBackend final : public DecodeBackend {
 public:
  // The model (device 0, the one the scheduler's thread uses) must outlive this.
  CudaBackend(CudaModel& model, int64_t slots, int64_t max_len);

  int64_t slots() const override { return decoder_.max_seqs(); }
  int64_t vocab_size() const override { return vocab_size_; }
  int64_t max_len() const override { return decoder_.max_len(); }
  std::vector<std::vector<float>> prefill(const std::vector<int64_t>& slots,
                                          const std::vector<std::vector<int32_t>>& prompts) override;
  std::vector<std::vector<float>> step(const std::vector<int64_t>& slots, const std::vector<int32_t>& tokens) override;
  void clear(int64_t slot) override;

 private:
  const int64_t vocab_size_;
  CudaDecoder decoder_;
};
#endif

}  // namespace nextlm::serve
