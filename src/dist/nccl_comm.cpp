// NCCL communicator (nccl_comm.h): host-synchronous wrappers of NCCL's collectives on device buffers.
#include "dist/nccl_comm.h"

#include <string>

#include "core/error.h"

namespace nextlm::dist {
namespace {

void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) fail("NCCL ", what, " failed: ", ncclGetErrorString(r));
}
void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail("CUDA ", what, " failed: ", cudaGetErrorString(e));
}

}  // namespace

NcclComm::NcclComm(std::unique_ptr<Comm> host, int device, cudaStream_t stream)
    : host_(std::move(host)), device_(device), rank_(host_->rank()), size_(host_->size()), stream_(stream) {
  cuda_check(cudaSetDevice(device_), "cudaSetDevice");
  if (!stream_) {
    cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    own_stream_ = true;
  }
  ncclUniqueId id;
  if (rank_ == 0) nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
  host_->broadcast(&id, sizeof id, 0);
  nccl_check(ncclCommInitRank(&comm_, size_, id, rank_), "ncclCommInitRank");
  cuda_check(cudaMalloc(&scratch_, sizeof(float)), "cudaMalloc");
}

NcclComm::~NcclComm() {
  if (scratch_) cudaFree(scratch_);
  if (comm_) ncclCommDestroy(comm_);
  if (own_stream_) cudaStreamDestroy(stream_);
}

void NcclComm::wait() {
  if (blocking_) cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

void NcclComm::all_reduce_sum(float* x, size_t n) {
  nccl_check(ncclAllReduce(x, x, n, ncclFloat32, ncclSum, comm_, stream_), "ncclAllReduce");
  wait();
}
void NcclComm::all_reduce_sum(double* x, size_t n) {
  nccl_check(ncclAllReduce(x, x, n, ncclFloat64, ncclSum, comm_, stream_), "ncclAllReduce");
  wait();
}
void NcclComm::all_reduce_max(float* x, size_t n) {
  nccl_check(ncclAllReduce(x, x, n, ncclFloat32, ncclMax, comm_, stream_), "ncclAllReduce");
  wait();
}

void NcclComm::all_gather(const void* send, size_t bytes, void* recv) {
  nccl_check(ncclAllGather(send, recv, bytes, ncclUint8, comm_, stream_), "ncclAllGather");
  wait();
}

void NcclComm::all_gatherv(const void* send, void* recv, const std::vector<size_t>& counts) {
  check(static_cast<int>(counts.size()) == size_, "all_gatherv: one count per rank");
  nccl_check(ncclGroupStart(), "ncclGroupStart");
  size_t off = 0;
  for (int r = 0; r < size_; ++r) {
    char* dst = static_cast<char*>(recv) + off;
    if (counts[r]) nccl_check(ncclBroadcast(r == rank_ ? send : dst, dst, counts[r], ncclUint8, r, comm_, stream_),
                              "ncclBroadcast");
    off += counts[r];
  }
  nccl_check(ncclGroupEnd(), "ncclGroupEnd");
  wait();
}

void NcclComm::all_to_allv(const void* send, const std::vector<size_t>& sc, void* recv,
                           const std::vector<size_t>& rc) {
  check(static_cast<int>(sc.size()) == size_ && static_cast<int>(rc.size()) == size_,
        "all_to_allv: one count per rank");
  nccl_check(ncclGroupStart(), "ncclGroupStart");
  size_t so = 0, ro = 0;
  for (int q = 0; q < size_; ++q) {
    if (sc[q])
      nccl_check(ncclSend(static_cast<const char*>(send) + so, sc[q], ncclUint8, q, comm_, stream_), "ncclSend");
    if (rc[q]) nccl_check(ncclRecv(static_cast<char*>(recv) + ro, rc[q], ncclUint8, q, comm_, stream_), "ncclRecv");
    so += sc[q];
    ro += rc[q];
  }
  nccl_check(ncclGroupEnd(), "ncclGroupEnd");
  wait();
}

void NcclComm::reduce_scatter_sum(const float* x, size_t n, float* out) {
  check(n % static_cast<size_t>(size_) == 0, "reduce_scatter_sum: ", n, " values do not split over ", size_,
        " ranks");
  nccl_check(ncclReduceScatter(x, out, n / size_, ncclFloat32, ncclSum, comm_, stream_), "ncclReduceScatter");
  wait();
}

void NcclComm::broadcast(void* buf, size_t bytes, int root) {
  nccl_check(ncclBroadcast(buf, buf, bytes, ncclUint8, root, comm_, stream_), "ncclBroadcast");
  wait();
}

void NcclComm::barrier() {
  nccl_check(ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, comm_, stream_), "ncclAllReduce");
  wait();
}

std::unique_ptr<Comm> NcclComm::split(int color, int key) {
  return std::make_unique<NcclComm>(host_->split(color, key), device_);
}

}  // namespace nextlm::dist
