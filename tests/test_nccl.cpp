// The NCCL communicator's collectives on device buffers (label gpu): one rank on GPU 0; one rank per GPU as threads
// of this process (the NCCL id passed through the in-process communicator) when there are several GPUs; and under
// `mpirun -np N` on an N-GPU machine one process per GPU, the id over MPI. Every expected value is exact (small
// integers in fp32/fp64).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <numeric>
#include <vector>

#include "dist/comm.h"
#include "dist/nccl_comm.h"
#include "dist/thread_comm.h"

namespace nextlm {
namespace {

template <class T>
struct DeviceBuffer {
  explicit DeviceBuffer(const std::vector<T>& host) : n(host.size()) {
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess);
    if (n) {
      EXPECT_EQ(cudaMemcpy(p, host.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  explicit DeviceBuffer(size_t count) : DeviceBuffer(std::vector<T>(count, T(-7))) {}  // poisoned
  ~DeviceBuffer() { cudaFree(p); }
  std::vector<T> host() const {
    std::vector<T> h(n);
    if (n) {
      EXPECT_EQ(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return h;
  }
  T* p = nullptr;
  size_t n;
};

int device_count() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) return 0;
  return devices;
}

// Every collective of one rank of `host`'s group, on GPU `device`.
void check_collectives(std::unique_ptr<dist::Comm> host, int device) {
  const int P = host->size(), r = host->rank();
  dist::NcclComm c(std::move(host), device);
  EXPECT_EQ(c.size(), P);
  EXPECT_EQ(c.rank(), r);

  DeviceBuffer<float> x(std::vector<float>{1.0f + r, 2.0f * r});
  c.all_reduce_sum(x.p, 2);
  EXPECT_EQ(x.host(), (std::vector<float>{P + P * (P - 1) / 2.0f, static_cast<float>(P * (P - 1))}));
  DeviceBuffer<double> xd(std::vector<double>{0.5 * r});
  c.all_reduce_sum(xd.p, 1);
  EXPECT_EQ(xd.host()[0], 0.25 * P * (P - 1));
  DeviceBuffer<float> mx(std::vector<float>{static_cast<float>(-r)});
  c.all_reduce_max(mx.p, 1);
  EXPECT_EQ(mx.host()[0], 0.0f);

  // all_gather: rank q gives {q, q}.
  DeviceBuffer<int> mine(std::vector<int>{r, r}), all(2 * P);
  c.all_gather(mine.p, 2 * sizeof(int), all.p);
  std::vector<int> expect;
  for (int q = 0; q < P; ++q) expect.insert(expect.end(), {q, q});
  EXPECT_EQ(all.host(), expect);

  // all_gatherv: rank q gives q+1 copies of q.
  DeviceBuffer<int> v(std::vector<int>(r + 1, r)), allv(P * (P + 1) / 2);
  std::vector<size_t> counts(P);
  expect.clear();
  for (int q = 0; q < P; ++q) {
    counts[q] = (q + 1) * sizeof(int);
    expect.insert(expect.end(), q + 1, q);
  }
  c.all_gatherv(v.p, allv.p, counts);
  EXPECT_EQ(allv.host(), expect);

  // all_to_allv: rank r sends q+r+1 copies of 100r+q to rank q.
  std::vector<int> send;
  std::vector<size_t> sc(P), rc(P);
  size_t recv_n = 0;
  expect.clear();
  for (int q = 0; q < P; ++q) {
    send.insert(send.end(), q + r + 1, 100 * r + q);
    sc[q] = (q + r + 1) * sizeof(int);
    rc[q] = (r + q + 1) * sizeof(int);
    recv_n += r + q + 1;
    expect.insert(expect.end(), r + q + 1, 100 * q + r);
  }
  DeviceBuffer<int> sbuf(send), rbuf(recv_n);
  c.all_to_allv(sbuf.p, sc, rbuf.p, rc);
  EXPECT_EQ(rbuf.host(), expect);

  // reduce_scatter: everyone gives 0, 1, …, 2P−1; rank r gets its two values times P.
  std::vector<float> ramp(2 * P);
  std::iota(ramp.begin(), ramp.end(), 0.0f);
  DeviceBuffer<float> rs(ramp), part(2);
  c.reduce_scatter_sum(rs.p, ramp.size(), part.p);
  EXPECT_EQ(part.host(), (std::vector<float>{2.0f * r * P, (2.0f * r + 1) * P}));

  DeviceBuffer<int> b(std::vector<int>{r == P - 1 ? 42 : -1});
  c.broadcast(b.p, sizeof(int), P - 1);
  EXPECT_EQ(b.host()[0], 42);
  c.barrier();

  // split into even and odd ranks, each its own clique.
  auto sub = c.split(r % 2, r);
  EXPECT_EQ(sub->size(), (P - r % 2 + 1) / 2);
  DeviceBuffer<float> one(std::vector<float>{1.0f});
  sub->all_reduce_sum(one.p, 1);
  EXPECT_EQ(one.host()[0], static_cast<float>(sub->size()));
}

TEST(Nccl, OneRankOrMpiRanks) {
  const int devices = device_count();
  if (devices == 0) GTEST_SKIP() << "no GPU";
  dist::Comm& world = dist::world();
  check_collectives(world.split(0, world.rank()), world.rank() % devices);
}

TEST(Nccl, ThreadsAsRanksOneGpuEach) {
  const int devices = device_count();
  if (devices < 2 || dist::world().size() > 1) GTEST_SKIP() << "needs 2 or more GPUs and no mpirun";
  const int n = std::min(devices, 4);
  dist::run_ranks(n, [&](dist::Comm& comm) { check_collectives(comm.split(0, comm.rank()), comm.rank()); });
}

}  // namespace
}  // namespace nextlm
