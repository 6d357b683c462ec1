// `nextlm serve --tp T --ep E` under mpirun, on the CPU: every rank holds its slices of the model (dist/), rank 0
// serves HTTP and its scheduler drives a DistBackend, which sends each call (a prefill, a step, a clear) to every rank
// before it runs its own part; the other ranks run follow_server, which receives the same calls in the same order and
// runs them on their slices (dist::parallel_prefill, parallel_decode_step), so that the collectives inside meet.
// Rank 0's logits are the full [V] rows every rank forms. When rank 0's server stops, DistBackend's destructor sends
// the stop that ends follow_server.
//
// A call that fails on one rank only (out of memory, say) leaves the others waiting in a collective: such a failure
// ends the job (the rank exits non-zero and the launcher takes the others down), where one process would fail that
// request alone. The checks a call makes first (slots, lengths) see the same data on every rank and fail alike.
#pragma once
#include <cstdint>
#include <optional>
#include <vector>

#include "dist/parallel_decode.h"
#include "dist/parallel_model.h"
#include "serve/backend.h"

namespace nextlm::serve {

// The slots of one rank: each a ParallelDecodeState once prefilled. Runs a call's part on this rank.
class DistSlots {
 public:
  DistSlots(const dist::ShardedModel& model, const dist::Mesh& mesh, int64_t slots);

  int64_t slots() const { return static_cast<int64_t>(states_.size()); }
  void check_slot(int64_t slot) const;  // Error when slot is outside [0, slots())
  // The checks of a call (Error when it does not fit the slots), made before any collective; rank 0 makes them
  // before it sends the call, so that a call the others receive passes them there too.
  void check_prefill(const std::vector<int64_t>& slots, const std::vector<std::vector<int32_t>>& prompts) const;
  void check_step(const std::vector<int64_t>& slots, const std::vector<int32_t>& tokens) const;
  std::vector<std::vector<float>> prefill(const std::vector<int64_t>& slots,
                                          const std::vector<std::vector<int32_t>>& prompts);
  std::vector<std::vector<float>> step(const std::vector<int64_t>& slots, const std::vector<int32_t>& tokens);
  void clear(int64_t slot);

 private:
  const dist::ShardedModel& model_;
  const dist::Mesh& mesh_;
  std::vector<std::optional<dist::ParallelDecodeState>> states_;  // [slots]: empty until prefilled
};

// Rank 0's backend. The model and mesh must outlive it; its calls (and its destructor's stop) are the only use of the
// world communicator while it lives.
class DistBackend final : public DecodeBackend {
 public:
  // threads: CPU threads for the model (0: all), set on the scheduler's thread.
  DistBackend(const dist::ShardedModel& model, const dist::Mesh& mesh, int64_t slots, int threads);
  ~DistBackend() override;  // sends the stop

  int64_t slots() const override { return slots_.slots(); }
  int64_t vocab_size() const override { return vocab_size_; }
  int64_t max_len() const override { return 0; }
  void start() override;
  std::vector<std::vector<float>> prefill(const std::vector<int64_t>& slots,
                                          const std::vector<std::vector<int32_t>>& prompts) override;
  std::vector<std::vector<float>> step(const std::vector<int64_t>& slots, const std::vector<int32_t>& tokens) override;
  void clear(int64_t slot) override;

 private:
  dist::Comm& world_;
  const int threads_;
  const int64_t vocab_size_;
  DistSlots slots_;
};

// The other ranks: runs rank 0's calls as they come until its stop. SIGINT and SIGTERM are ignored meanwhile (the
// launcher passes them to every rank; rank 0 finishes the requests in flight, then stops the others).
void follow_server(const dist::ShardedModel& model, const dist::Mesh& mesh, int64_t slots, int threads);

}  // namespace nextlm::serve
