// Atomic output files: write to a temporary beside the target, rename over it on commit(). An output is either
// complete or absent, never partly written.
#pragma once
#include <cstdio>
#include <string>
#include <string_view>

namespace nextlm {

class AtomicFile {
 public:
  explicit AtomicFile(std::string path);  // opens `path.tmp.<pid>`; throws Error if it cannot
  ~AtomicFile();                           // removes the temporary unless commit() succeeded
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t n);  // throws Error on a short write
  void write(std::string_view s) { write(s.data(), s.size()); }
  void commit();                           // flush, fsync, close, rename; throws Error on failure

 private:
  std::string path_, tmp_;
  std::FILE* f_ = nullptr;
  bool committed_ = false;
};

}  // namespace nextlm
