// The serve scheduler's decoders: the CPU decode path slot by slot, and (CUDA builds) a CudaDecoder.
#include "serve/backend.h"

#include "core/error.h"
#include "cpu/linear.h"

namespace nextlm::serve {

CpuBackend::CpuBackend(const Model& model, int64_t slots, int threads)
    : model_(model), threads_(threads), states_(static_cast<size_t>(slots)) {
  check(slots >= 1, "the decoder needs at least one slot, got ", slots);
}

void CpuBackend::start() { cpu::set_num_threads(threads_); }

DecodeState& CpuBackend::state(int64_t slot) {
  check(slot >= 0 && slot < slots(), "decoder slot ", slot, " is outside [0, ", slots(), ")");
  check(states_[slot].has_value(), "decoder slot ", slot, " is empty");
  return *states_[slot];
}

std::vector<std::vector<float>> CpuBackend::prefill(const std::vector<int64_t>& slots,
                                                    const std::vector<std::vector<int32_t>>& prompts) {
  check(slots.size() == prompts.size(), "prefill: ", slots.size(), " slots for ", prompts.size(), " prompts");
  std::vector<std::vector<float>> logits;
  for (size_t i = 0; i < slots.size(); ++i) {
    check(slots[i] >= 0 && slots[i] < this->slots(), "decoder slot ", slots[i], " is outside [0, ", this->slots(), ")");
    check(!states_[slots[i]].has_value(), "prefill: decoder slot ", slots[i], " is not empty");
    states_[slots[i]].emplace(model_);
    logits.push_back(nextlm::prefill(*states_[slots[i]], prompts[i]));
  }
  return logits;
}

std::vector<std::vector<float>> CpuBackend::step(const std::vector<int64_t>& slots,
                                                 const std::vector<int32_t>& tokens) {
  check(slots.size() == tokens.size(), "step: ", slots.size(), " slots for ", tokens.size(), " tokens");
  std::vector<std::vector<float>> logits;
  for (size_t i = 0; i < slots.size(); ++i) logits.push_back(decode_step(state(slots[i]), tokens[i]));
  return logits;
}

void CpuBackend::clear(int64_t slot) {
  check(slot >= 0 && slot < slots(), "decoder slot ", slot, " is outside [0, ", slots(), ")");
  states_[slot].reset();
}

#ifdef NEXTLM_HAVE_CUDA
CudaBackend::CudaBackend(CudaModel& model, int64_t slots, int64_t max_len)
    : vocab_size_(model.config().vocab_size), decoder_(model, slots, max_len) {}

std::vector<std::vector<float>> CudaBackend::prefill(const std::vector<int64_t>& slots,
                                                     const std::vector<std::vector<int32_t>>& prompts) {
  return decoder_.prefill(slots, prompts);
}

std::vector<std::vector<float>> CudaBackend::step(const std::vector<int64_t>& slots,
                                                  const std::vector<int32_t>& tokens) {
  return decoder_.step(slots, tokens);
}

void CudaBackend::clear(int64_t slot) { decoder_.clear(slot); }
#endif

}  // namespace nextlm::serve
