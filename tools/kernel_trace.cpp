// A GPU timeline for machines without Nsight Systems: a CUDA injection library (CUDA_INJECTION64_PATH) that records
// every kernel, memset and memcpy through CUPTI's activity API and writes them, one per line, to the CSV file named
// by NEXTLM_TRACE_OUT when the process exits:
//   kind,start_ns,end_ns,stream,bytes,name
// (kind: kernel, memset or memcpy; bytes: 0 for kernels). The idle time between consecutive GPU operations is what
// a per-kernel profile (ncu) cannot show: host syncs, launch latency, work the host submits too slowly.
//   CUDA_INJECTION64_PATH=libnextlm_trace.so NEXTLM_TRACE_OUT=trace.csv nextlm_bench slice4_train_step_T4096_keep
// Built with the CUDA backend when CUPTI is found (CMakeLists.txt); scripts/gpu_bundle.sh ships it with CUPTI.
#include <cupti.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr size_t kBufferBytes = 8u << 20;

std::mutex g_mutex;
std::FILE* g_out = nullptr;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;
}

// Commas in a kernel's signature would split its CSV field: the name goes in quotes, quotes doubled.
std::string quoted(const char* s) {
  std::string q = "\"";
  for (const char* p = s ? s : "?"; *p; ++p) q += *p == '"' ? std::string("\"\"") : std::string(1, *p);
  return q + "\"";
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::lock_guard<std::mutex> lock(g_mutex);
  CUpti_Activity* record = nullptr;
  while (g_out && cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    switch (record->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      case CUPTI_ACTIVITY_KIND_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
        std::fprintf(g_out, "kernel,%llu,%llu,%u,0,%s\n", static_cast<unsigned long long>(k->start),
                     static_cast<unsigned long long>(k->end), k->streamId, quoted(k->name).c_str());
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
        std::fprintf(g_out, "memset,%llu,%llu,%u,%llu,memset\n", static_cast<unsigned long long>(m->start),
                     static_cast<unsigned long long>(m->end), m->streamId, static_cast<unsigned long long>(m->bytes));
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
        std::fprintf(g_out, "memcpy,%llu,%llu,%u,%llu,memcpy kind %u\n", static_cast<unsigned long long>(m->start),
                     static_cast<unsigned long long>(m->end), m->streamId, static_cast<unsigned long long>(m->bytes),
                     static_cast<unsigned>(m->copyKind));
        break;
      }
      default:
        break;
    }
  }
  std::free(buffer);
}

void finish() {
  cuptiActivityFlushAll(1);
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_out) std::fclose(g_out);
  g_out = nullptr;
}

bool ok(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return true;
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  std::fprintf(stderr, "nextlm_trace: %s failed: %s\n", what, msg ? msg : "?");
  return false;
}

}  // namespace

extern "C" int InitializeInjection() {
  const char* path = std::getenv("NEXTLM_TRACE_OUT");
  if (!path || !*path) {
    std::fprintf(stderr, "nextlm_trace: set NEXTLM_TRACE_OUT to the CSV file to write\n");
    return 0;
  }
  g_out = std::fopen(path, "w");
  if (!g_out) {
    std::fprintf(stderr, "nextlm_trace: cannot write %s\n", path);
    return 0;
  }
  std::fprintf(g_out, "kind,start_ns,end_ns,stream,bytes,name\n");
  if (!ok(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks") ||
      !ok(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enabling kernel records") ||
      !ok(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "enabling memset records") ||
      !ok(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enabling memcpy records"))
    return 0;
  std::atexit(finish);
  return 1;
}
