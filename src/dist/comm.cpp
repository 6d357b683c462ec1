// The communicator backends for host memory: the fixed-order reductions every backend shares, the single-process
// one, and Open MPI (built when NEXTLM_HAVE_MPI is defined).
#include "dist/comm.h"

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <numeric>

#include "core/error.h"

#ifdef NEXTLM_HAVE_MPI
#include <mpi.h>
#endif

namespace nextlm::dist {

namespace {
// Gathers every rank's x[n] and sums them in rank order: the same bits on every rank and in every run, whatever
// algorithm the transport would pick for its own reduction.
template <class T>
void sum_in_rank_order(Comm& c, T* x, size_t n) {
  const size_t P = static_cast<size_t>(c.size());
  if (P == 1 || n == 0) return;
  std::vector<T> all(P * n);
  c.all_gather(x, n * sizeof(T), all.data());
  for (size_t i = 0; i < n; ++i) {
    T acc = all[i];
    for (size_t r = 1; r < P; ++r) acc += all[r * n + i];
    x[i] = acc;
  }
}
}  // namespace

void Comm::all_reduce_sum(float* x, size_t n) { sum_in_rank_order(*this, x, n); }
void Comm::all_reduce_sum(double* x, size_t n) { sum_in_rank_order(*this, x, n); }

void Comm::all_reduce_max(float* x, size_t n) {
  const size_t P = static_cast<size_t>(size());
  if (P == 1 || n == 0) return;
  std::vector<float> all(P * n);
  all_gather(x, n * sizeof(float), all.data());
  for (size_t i = 0; i < n; ++i)
    for (size_t r = 0; r < P; ++r) x[i] = std::max(x[i], all[r * n + i]);
}

void Comm::reduce_scatter_sum(const float* x, size_t n, float* out) {
  const size_t P = static_cast<size_t>(size());
  check(n % P == 0, "reduce_scatter_sum: ", n, " values do not split over ", P, " ranks");
  std::vector<float> full(x, x + n);
  all_reduce_sum(full.data(), n);
  const size_t m = n / P;
  std::copy_n(full.data() + static_cast<size_t>(rank()) * m, m, out);
}

void LocalComm::all_gather(const void* send, size_t bytes, void* recv) {
  if (bytes) std::memmove(recv, send, bytes);
}
void LocalComm::all_gatherv(const void* send, void* recv, const std::vector<size_t>& counts) {
  check(counts.size() == 1, "all_gatherv: one count per rank");
  if (counts[0]) std::memmove(recv, send, counts[0]);
}
void LocalComm::all_to_allv(const void* send, const std::vector<size_t>& sc, void* recv,
                            const std::vector<size_t>& rc) {
  check(sc.size() == 1 && rc.size() == 1 && sc[0] == rc[0], "all_to_allv: counts do not match");
  if (sc[0]) std::memmove(recv, send, sc[0]);
}
std::unique_ptr<Comm> LocalComm::split(int, int) { return std::make_unique<LocalComm>(); }

Range split_range(int64_t n, int64_t parts, int64_t p) {
  const int64_t base = n / parts, extra = n % parts;
  const int64_t begin = p * base + std::min(p, extra);
  return Range{begin, begin + base + (p < extra ? 1 : 0)};
}

bool launched_by_mpi() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") || std::getenv("PMIX_RANK");
}

int launcher_rank() {
  for (const char* v : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"})
    if (const char* s = std::getenv(v)) return std::atoi(s);
  return 0;
}

#ifdef NEXTLM_HAVE_MPI
namespace {

void mpi_check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  fail("MPI ", what, " failed: ", std::string(msg, static_cast<size_t>(len)));
}

int as_count(size_t bytes) {
  check(bytes <= static_cast<size_t>(INT_MAX), "MPI message of ", bytes, " bytes is over the 2 GiB limit");
  return static_cast<int>(bytes);
}

// Byte counts and displacements for the v-collectives.
void counts_displs(const std::vector<size_t>& counts, std::vector<int>& c, std::vector<int>& d) {
  c.resize(counts.size());
  d.resize(counts.size());
  size_t off = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    c[i] = as_count(counts[i]);
    d[i] = as_count(off);
    off += counts[i];
  }
}

class MpiComm final : public Comm {
 public:
  MpiComm(MPI_Comm comm, bool owned) : comm_(comm), owned_(owned) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiComm() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owned_ && !finalized) MPI_Comm_free(&comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend() const override { return "mpi"; }

  void all_gather(const void* send, size_t bytes, void* recv) override {
    mpi_check(MPI_Allgather(send, as_count(bytes), MPI_BYTE, recv, as_count(bytes), MPI_BYTE, comm_), "allgather");
  }
  void all_gatherv(const void* send, void* recv, const std::vector<size_t>& counts) override {
    check(static_cast<int>(counts.size()) == size_, "all_gatherv: one count per rank");
    std::vector<int> c, d;
    counts_displs(counts, c, d);
    mpi_check(MPI_Allgatherv(send, c[rank_], MPI_BYTE, recv, c.data(), d.data(), MPI_BYTE, comm_), "allgatherv");
  }
  void all_to_allv(const void* send, const std::vector<size_t>& sc, void* recv,
                   const std::vector<size_t>& rc) override {
    check(static_cast<int>(sc.size()) == size_ && static_cast<int>(rc.size()) == size_,
          "all_to_allv: one count per rank");
    std::vector<int> s, sd, r, rd;
    counts_displs(sc, s, sd);
    counts_displs(rc, r, rd);
    mpi_check(MPI_Alltoallv(send, s.data(), sd.data(), MPI_BYTE, recv, r.data(), rd.data(), MPI_BYTE, comm_),
              "alltoallv");
  }
  void broadcast(void* buf, size_t bytes, int root) override {
    mpi_check(MPI_Bcast(buf, as_count(bytes), MPI_BYTE, root, comm_), "bcast");
  }
  void barrier() override { mpi_check(MPI_Barrier(comm_), "barrier"); }
  std::unique_ptr<Comm> split(int color, int key) override {
    MPI_Comm sub;
    mpi_check(MPI_Comm_split(comm_, color, key, &sub), "comm_split");
    return std::make_unique<MpiComm>(sub, true);
  }

 private:
  MPI_Comm comm_;
  bool owned_;
  int rank_ = 0, size_ = 1;
};

// Initialises MPI on first use and finalises it when the process exits normally (static destruction).
struct MpiSession {
  MpiSession() {
    // Serialized: `serve` makes its calls from the scheduler's thread, one thread at a time.
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    // Errors come back as codes and become nextlm::Error instead of aborting the job with MPI's own report.
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    comm = std::make_unique<MpiComm>(MPI_COMM_WORLD, false);
  }
  ~MpiSession() {
    comm.reset();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }
  std::unique_ptr<MpiComm> comm;
  int provided = 0;
};

MpiSession& mpi_session() {
  static MpiSession session;
  return session;
}

}  // namespace

bool mpi_available() { return true; }

bool mpi_calls_from_any_thread() { return !launched_by_mpi() || mpi_session().provided >= MPI_THREAD_SERIALIZED; }

Comm& world() {
  if (launched_by_mpi()) return *mpi_session().comm;
  static LocalComm local;
  return local;
}

#else

bool mpi_available() { return false; }

bool mpi_calls_from_any_thread() { return true; }

Comm& world() {
  static LocalComm local;
  return local;
}

#endif

}  // namespace nextlm::dist
