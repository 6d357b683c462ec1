// The NCCL communicator: one process per GPU, every buffer a device pointer. The NCCL unique id goes from rank 0 to
// the others over a host communicator (MPI), which also makes the sub-groups of split(). Built only in CUDA builds
// with MPI and NCCL (target nextlm_nccl); CI compiles it, a multi-GPU machine runs it.
#pragma once
#include <memory>

#include <cuda_runtime.h>
#include <nccl.h>

#include "dist/comm.h"

namespace nextlm::dist {

class NcclComm final : public Comm {
 public:
  // Collective over `host`: binds this process to `device` and joins the NCCL clique of host's ranks. Operations are
  // queued on `stream` (nullptr: a new non-blocking stream owned here) and waited for before they return, so the
  // host-side contract of Comm holds; callers that overlap work can use stream() and the ncclComm_t directly.
  NcclComm(std::unique_ptr<Comm> host, int device, cudaStream_t stream = nullptr);
  ~NcclComm() override;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend() const override { return "nccl"; }
  ncclComm_t handle() const { return comm_; }
  cudaStream_t stream() const { return stream_; }
  // Off: operations return once queued on stream(), and the work queued there after them sees their results (for
  // a caller that runs on the same stream, such as a sharded CudaModel); on (the default): they return completed.
  void set_blocking(bool on) { blocking_ = on; }

  // NCCL reduces in its own ring/tree order, not rank order: deterministic for a fixed topology, size and NCCL
  // version (NCCL_ALGO/NCCL_PROTO pinned), and the same on every rank, but not bit-equal to the host backends.
  void all_reduce_sum(float* x, size_t n) override;
  void all_reduce_sum(double* x, size_t n) override;
  void all_reduce_max(float* x, size_t n) override;
  void all_gather(const void* send, size_t bytes, void* recv) override;
  // NCCL has no all-gather-v: one broadcast per root into its place, in one group.
  void all_gatherv(const void* send, void* recv, const std::vector<size_t>& counts) override;
  // Grouped point-to-point sends and receives.
  void all_to_allv(const void* send, const std::vector<size_t>& send_counts, void* recv,
                   const std::vector<size_t>& recv_counts) override;
  void reduce_scatter_sum(const float* x, size_t n, float* out) override;
  void broadcast(void* buf, size_t bytes, int root) override;
  void barrier() override;
  // A new clique for the ranks of each color (its id broadcast over the split host communicator).
  std::unique_ptr<Comm> split(int color, int key) override;

 private:
  void wait();
  std::unique_ptr<Comm> host_;
  int device_ = 0, rank_ = 0, size_ = 1;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  bool own_stream_ = false;
  bool blocking_ = true;
  float* scratch_ = nullptr;  // one float for barrier()
};

}  // namespace nextlm::dist
