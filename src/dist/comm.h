// Communicators for tensor and expert parallelism: one interface, a single-process backend, Open MPI for the CPU
// path (one process per rank, `mpirun -np N`) and NCCL for device buffers (src/dist/nccl_comm.h, CUDA builds).
// Sums are taken in a fixed order (rank 0 first, then 1, …) so that every rank gets the same bits, run after run.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace nextlm::dist {

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* backend() const = 0;  // "local", "mpi", "nccl"

  // x[n] ← Σ_r x_r[n], summed in rank order (x_0 + x_1 + … left to right) on every rank.
  virtual void all_reduce_sum(float* x, size_t n);
  virtual void all_reduce_sum(double* x, size_t n);
  // x[n] ← max_r x_r[n].
  virtual void all_reduce_max(float* x, size_t n);
  // recv[size · bytes] ← the `bytes` bytes of every rank, in rank order.
  virtual void all_gather(const void* send, size_t bytes, void* recv) = 0;
  // recv ← the counts[r] bytes of rank r, back to back in rank order; send holds counts[rank()] bytes.
  virtual void all_gatherv(const void* send, void* recv, const std::vector<size_t>& counts) = 0;
  // Rank r sends send_counts[q] bytes (back to back in q order in `send`) to rank q and receives recv_counts[q]
  // bytes from rank q (back to back in q order in `recv`). Each pair's counts must agree.
  virtual void all_to_allv(const void* send, const std::vector<size_t>& send_counts, void* recv,
                           const std::vector<size_t>& recv_counts) = 0;
  // out[n / size] ← rank()'s block of the rank-ordered sum of x[n] (n divisible by size()).
  virtual void reduce_scatter_sum(const float* x, size_t n, float* out);
  virtual void broadcast(void* buf, size_t bytes, int root) = 0;
  virtual void barrier() = 0;
  // The ranks that pass the same color form a new communicator, ordered by key (then by rank).
  virtual std::unique_ptr<Comm> split(int color, int key) = 0;

  // Typed helpers.
  template <class T>
  std::vector<T> all_gather_value(const T& v) {
    std::vector<T> out(static_cast<size_t>(size()));
    all_gather(&v, sizeof(T), out.data());
    return out;
  }
};

// One process: every collective is a copy.
class LocalComm final : public Comm {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const char* backend() const override { return "local"; }
  void all_gather(const void* send, size_t bytes, void* recv) override;
  void all_gatherv(const void* send, void* recv, const std::vector<size_t>& counts) override;
  void all_to_allv(const void* send, const std::vector<size_t>& send_counts, void* recv,
                   const std::vector<size_t>& recv_counts) override;
  void broadcast(void*, size_t, int) override {}
  void barrier() override {}
  std::unique_ptr<Comm> split(int color, int key) override;
};

// True when this build has the MPI backend.
bool mpi_available();
// Whether world()'s collectives may be called from a thread other than the one that started MPI (one thread at a
// time: MPI_THREAD_SERIALIZED, which MPI is asked for); true when MPI is not in use. Starts MPI under a launcher.
bool mpi_calls_from_any_thread();
// True when this process was started by an MPI launcher (mpirun / mpiexec set OMPI_COMM_WORLD_SIZE, PMI_SIZE or
// PMIX_RANK).
bool launched_by_mpi();
// This process's rank as the launcher set it (OMPI_COMM_WORLD_RANK, PMI_RANK, PMIX_RANK), without starting MPI;
// 0 when not launched by MPI. For deciding which rank prints.
int launcher_rank();

// The communicator of all processes: MPI_COMM_WORLD when this build has MPI and an MPI launcher started the process
// (MPI is then initialised on the first call and finalised at exit), else a LocalComm. Created once.
Comm& world();

// [begin, end) of part p when n items are split into `parts` nearly equal contiguous ranges (the first n % parts
// ranges get one more).
struct Range {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
Range split_range(int64_t n, int64_t parts, int64_t p);

}  // namespace nextlm::dist
