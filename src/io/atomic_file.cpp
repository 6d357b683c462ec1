// Atomic output files: everything goes to `path.tmp.<pid>`, which is fsynced and renamed over `path` only on
// commit(), so a crash or an error never leaves a half-written output behind.
#include "io/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace nextlm {

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)) {
  tmp_ = path_ + ".tmp." + std::to_string(::getpid());
  f_ = std::fopen(tmp_.c_str(), "wb");
  if (!f_) fail("cannot create ", tmp_, " (for ", path_, "): ", std::strerror(errno));
}

AtomicFile::~AtomicFile() {
  if (f_) std::fclose(f_);
  if (!committed_) std::remove(tmp_.c_str());
}

void AtomicFile::write(const void* data, size_t n) {
  check(f_ != nullptr, "cannot write ", path_, ": file already committed or failed");
  if (n == 0) return;
  if (std::fwrite(data, 1, n, f_) != n) fail("cannot write ", path_, ": ", std::strerror(errno));
}

void AtomicFile::commit() {
  check(f_ != nullptr, "cannot commit ", path_, ": file already committed or failed");
  if (std::fflush(f_) != 0) fail("cannot write ", path_, ": ", std::strerror(errno));
  if (::fsync(::fileno(f_)) != 0) fail("cannot sync ", path_, ": ", std::strerror(errno));
  std::FILE* f = f_;
  f_ = nullptr;
  if (std::fclose(f) != 0) fail("cannot close ", path_, ": ", std::strerror(errno));
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0)
    fail("cannot rename ", tmp_, " to ", path_, ": ", std::strerror(errno));
  committed_ = true;
  // The rename itself is durable only once the directory entry is synced; failing that is not worth an error.
  std::string dir = std::filesystem::path(path_).parent_path().string();
  int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

}  // namespace nextlm
