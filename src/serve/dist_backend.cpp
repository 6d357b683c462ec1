// `serve --tp/--ep` under mpirun: rank 0's backend sends each scheduler call to the other ranks, which run it too.
#include "serve/dist_backend.h"

#include <signal.h>

#include <cstdio>

#include "core/error.h"
#include "cpu/linear.h"

namespace nextlm::serve {

namespace {

// A call as rank 0 broadcasts it: a header {op, slots, prompt lengths, tokens} (counts), then those three arrays.
enum class Op : int64_t { Stop = 0, Prefill = 1, Step = 2, Clear = 3 };

struct Call {
  Op op = Op::Stop;
  std::vector<int64_t> slots, lens;  // lens: each prompt's length (prefill)
  std::vector<int32_t> tokens;       // the prompts back to back (prefill) or one token a slot (step)
};

template <class T>
void broadcast_vector(dist::Comm& world, std::vector<T>& v) {
  if (!v.empty()) world.broadcast(v.data(), v.size() * sizeof(T), 0);
}

// Rank 0 sends c; the others receive it into c.
void exchange(dist::Comm& world, Call& c) {
  int64_t head[4] = {static_cast<int64_t>(c.op), static_cast<int64_t>(c.slots.size()),
                     static_cast<int64_t>(c.lens.size()), static_cast<int64_t>(c.tokens.size())};
  world.broadcast(head, sizeof head, 0);
  if (world.rank() != 0) {
    check(head[0] >= 0 && head[0] <= 3 && head[1] >= 0 && head[2] >= 0 && head[3] >= 0,
          "serve: rank ", world.rank(), " received a malformed call from rank 0");
    c.op = static_cast<Op>(head[0]);
    c.slots.resize(static_cast<size_t>(head[1]));
    c.lens.resize(static_cast<size_t>(head[2]));
    c.tokens.resize(static_cast<size_t>(head[3]));
  }
  broadcast_vector(world, c.slots);
  broadcast_vector(world, c.lens);
  broadcast_vector(world, c.tokens);
}

std::vector<std::vector<int32_t>> prompts_of(const Call& c) {
  std::vector<std::vector<int32_t>> prompts;
  size_t at = 0;
  for (int64_t n : c.lens) {
    check(n >= 0 && at + static_cast<size_t>(n) <= c.tokens.size(), "serve: a prefill call's lengths exceed its tokens");
    prompts.emplace_back(c.tokens.begin() + static_cast<std::ptrdiff_t>(at),
                         c.tokens.begin() + static_cast<std::ptrdiff_t>(at + static_cast<size_t>(n)));
    at += static_cast<size_t>(n);
  }
  return prompts;
}

}  // namespace

DistSlots::DistSlots(const dist::ShardedModel& model, const dist::Mesh& mesh, int64_t slots)
    : model_(model), mesh_(mesh), states_(static_cast<size_t>(slots)) {
  check(slots >= 1, "the decoder needs at least one slot, got ", slots);
}

void DistSlots::check_slot(int64_t slot) const {
  check(slot >= 0 && slot < slots(), "decoder slot ", slot, " is outside [0, ", slots(), ")");
}

void DistSlots::check_prefill(const std::vector<int64_t>& slots,
                              const std::vector<std::vector<int32_t>>& prompts) const {
  check(slots.size() == prompts.size(), "prefill: ", slots.size(), " slots for ", prompts.size(), " prompts");
  for (size_t i = 0; i < slots.size(); ++i) {
    check_slot(slots[i]);
    check(!states_[static_cast<size_t>(slots[i])].has_value(), "prefill: decoder slot ", slots[i], " is not empty");
    check(!prompts[i].empty(), "prefill: prompt ", i, " is empty");
    for (size_t j = 0; j < i; ++j) check(slots[j] != slots[i], "prefill: decoder slot ", slots[i], " given twice");
    for (int32_t t : prompts[i])
      check(t >= 0 && t < model_.config.vocab_size, "prefill: token id ", t, " is outside the vocabulary [0, ",
            model_.config.vocab_size, ")");
  }
}

void DistSlots::check_step(const std::vector<int64_t>& slots, const std::vector<int32_t>& tokens) const {
  check(slots.size() == tokens.size(), "step: ", slots.size(), " slots for ", tokens.size(), " tokens");
  for (size_t i = 0; i < slots.size(); ++i) {
    check_slot(slots[i]);
    check(states_[static_cast<size_t>(slots[i])].has_value(), "decoder slot ", slots[i], " is empty");
    for (size_t j = 0; j < i; ++j) check(slots[j] != slots[i], "step: decoder slot ", slots[i], " given twice");
    check(tokens[i] >= 0 && tokens[i] < model_.config.vocab_size, "step: token id ", tokens[i],
          " is outside the vocabulary [0, ", model_.config.vocab_size, ")");
  }
}

std::vector<std::vector<float>> DistSlots::prefill(const std::vector<int64_t>& slots,
                                                   const std::vector<std::vector<int32_t>>& prompts) {
  check_prefill(slots, prompts);  // every check before the first collective
  std::vector<std::vector<float>> logits;
  for (size_t i = 0; i < slots.size(); ++i) {
    std::optional<dist::ParallelDecodeState>& s = states_[static_cast<size_t>(slots[i])];
    s.emplace(model_, mesh_);
    logits.push_back(dist::parallel_prefill(*s, prompts[i]));
  }
  return logits;
}

std::vector<std::vector<float>> DistSlots::step(const std::vector<int64_t>& slots,
                                                const std::vector<int32_t>& tokens) {
  check_step(slots, tokens);
  std::vector<std::vector<float>> logits;
  for (size_t i = 0; i < slots.size(); ++i)
    logits.push_back(dist::parallel_decode_step(*states_[static_cast<size_t>(slots[i])], tokens[i]));
  return logits;
}

void DistSlots::clear(int64_t slot) {
  check_slot(slot);
  states_[static_cast<size_t>(slot)].reset();
}

DistBackend::DistBackend(const dist::ShardedModel& model, const dist::Mesh& mesh, int64_t slots, int threads)
    : world_(*mesh.world), threads_(threads), vocab_size_(model.config.vocab_size), slots_(model, mesh, slots) {
  check(world_.rank() == 0, "DistBackend runs on rank 0 (the others run follow_server)");
}

DistBackend::~DistBackend() {
  try {
    Call stop;
    exchange(world_, stop);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "serve: could not stop the other ranks: %s\n", e.what());
  }
}

void DistBackend::start() { cpu::set_num_threads(threads_); }

std::vector<std::vector<float>> DistBackend::prefill(const std::vector<int64_t>& slots,
                                                     const std::vector<std::vector<int32_t>>& prompts) {
  slots_.check_prefill(slots, prompts);  // a call the others receive passes their checks too
  Call c;
  c.op = Op::Prefill;
  c.slots = slots;
  for (const std::vector<int32_t>& p : prompts) {
    c.lens.push_back(static_cast<int64_t>(p.size()));
    c.tokens.insert(c.tokens.end(), p.begin(), p.end());
  }
  exchange(world_, c);
  return slots_.prefill(slots, prompts);
}

std::vector<std::vector<float>> DistBackend::step(const std::vector<int64_t>& slots,
                                                  const std::vector<int32_t>& tokens) {
  slots_.check_step(slots, tokens);
  Call c;
  c.op = Op::Step;
  c.slots = slots;
  c.tokens = tokens;
  exchange(world_, c);
  return slots_.step(slots, tokens);
}

void DistBackend::clear(int64_t slot) {
  slots_.check_slot(slot);
  Call c;
  c.op = Op::Clear;
  c.slots = {slot};
  exchange(world_, c);
  slots_.clear(slot);
}

void follow_server(const dist::ShardedModel& model, const dist::Mesh& mesh, int64_t slots, int threads) {
  dist::Comm& world = *mesh.world;
  check(world.rank() != 0, "follow_server runs on the ranks other than 0");
  ::signal(SIGINT, SIG_IGN);
  ::signal(SIGTERM, SIG_IGN);
  cpu::set_num_threads(threads);
  DistSlots mine(model, mesh, slots);
  for (;;) {
    Call c;
    exchange(world, c);
    switch (c.op) {
      case Op::Stop: return;
      case Op::Prefill: mine.prefill(c.slots, prompts_of(c)); break;
      case Op::Step: mine.step(c.slots, c.tokens); break;
      case Op::Clear:
        check(c.slots.size() == 1, "serve: a clear call names ", c.slots.size(), " slots");
        mine.clear(c.slots[0]);
        break;
    }
  }
}

}  // namespace nextlm::serve
