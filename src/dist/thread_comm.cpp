// The in-process communicator (thread_comm.h): every collective posts its buffers in shared slots, meets the others
// at a barrier, copies what it needs straight from their buffers, and meets them again before anyone reuses one.
#include "dist/thread_comm.h"

#include <algorithm>
#include <barrier>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "core/error.h"

namespace nextlm::dist {
namespace {

struct Shared {
  explicit Shared(int n) : n(n), bar(n), ptr(n), counts(n), color_key(n), child(n) {}
  int n;
  std::barrier<> bar;
  std::vector<const void*> ptr;                      // each rank's posted buffer
  std::vector<const std::vector<size_t>*> counts;    // each rank's posted counts
  std::vector<std::pair<int, int>> color_key;        // split arguments
  std::vector<std::shared_ptr<Shared>> child;        // the group a split leader made
};

class ThreadComm final : public Comm {
 public:
  ThreadComm(std::shared_ptr<Shared> s, int rank) : s_(std::move(s)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return s_->n; }
  const char* backend() const override { return "thread"; }

  void all_gather(const void* send, size_t bytes, void* recv) override {
    s_->ptr[rank_] = send;
    sync();
    for (int r = 0; r < s_->n; ++r)
      if (bytes) std::memcpy(static_cast<char*>(recv) + r * bytes, s_->ptr[r], bytes);
    sync();
  }
  void all_gatherv(const void* send, void* recv, const std::vector<size_t>& counts) override {
    check(static_cast<int>(counts.size()) == s_->n, "all_gatherv: one count per rank");
    s_->ptr[rank_] = send;
    sync();
    size_t off = 0;
    for (int r = 0; r < s_->n; ++r) {
      if (counts[r]) std::memcpy(static_cast<char*>(recv) + off, s_->ptr[r], counts[r]);
      off += counts[r];
    }
    sync();
  }
  void all_to_allv(const void* send, const std::vector<size_t>& sc, void* recv,
                   const std::vector<size_t>& rc) override {
    check(static_cast<int>(sc.size()) == s_->n && static_cast<int>(rc.size()) == s_->n,
          "all_to_allv: one count per rank");
    s_->ptr[rank_] = send;
    s_->counts[rank_] = &sc;
    sync();
    size_t off = 0;
    for (int q = 0; q < s_->n; ++q) {
      const std::vector<size_t>& theirs = *s_->counts[q];
      check(theirs[rank_] == rc[q], "all_to_allv: rank ", q, " sends ", theirs[rank_], " bytes, rank ", rank_,
            " expects ", rc[q]);
      size_t src = 0;
      for (int j = 0; j < rank_; ++j) src += theirs[j];
      if (rc[q]) std::memcpy(static_cast<char*>(recv) + off, static_cast<const char*>(s_->ptr[q]) + src, rc[q]);
      off += rc[q];
    }
    sync();
  }
  void broadcast(void* buf, size_t bytes, int root) override {
    s_->ptr[rank_] = buf;
    sync();
    if (rank_ != root && bytes) std::memcpy(buf, s_->ptr[root], bytes);
    sync();
  }
  void barrier() override { sync(); }
  std::unique_ptr<Comm> split(int color, int key) override {
    s_->color_key[rank_] = {color, key};
    sync();
    std::vector<int> members;
    for (int r = 0; r < s_->n; ++r)
      if (s_->color_key[r].first == color) members.push_back(r);
    std::stable_sort(members.begin(), members.end(),
                     [&](int a, int b) { return s_->color_key[a].second < s_->color_key[b].second; });
    const int leader = members.front();
    if (rank_ == leader) s_->child[leader] = std::make_shared<Shared>(static_cast<int>(members.size()));
    sync();
    const int my = static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
    auto out = std::make_unique<ThreadComm>(s_->child[leader], my);
    sync();
    if (rank_ == leader) s_->child[leader].reset();
    return out;
  }

 private:
  void sync() { s_->bar.arrive_and_wait(); }
  std::shared_ptr<Shared> s_;
  int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Comm>> make_thread_comms(int n) {
  check(n >= 1, "thread communicator needs at least one rank");
  auto s = std::make_shared<Shared>(n);
  std::vector<std::unique_ptr<Comm>> out;
  for (int r = 0; r < n; ++r) out.push_back(std::make_unique<ThreadComm>(s, r));
  return out;
}

void run_ranks(int n, const std::function<void(Comm&)>& fn) {
  auto comms = make_thread_comms(n);
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(*comms[r]);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (std::thread& t : threads) t.join();
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace nextlm::dist
