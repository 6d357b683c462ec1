// Errors: every failure the user can cause (bad checkpoint, bad config, bad input) is an nextlm::Error whose
// message is one line naming the problem; the CLI prints it and exits non-zero.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace nextlm {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The device ran out of memory for a step's activations (CUDA's arena): an adaptive recompute policy runs the step
// again keeping less (model/recompute.h).
struct OutOfMemory : Error {
  using Error::Error;
};

// fail("tensor ", name, " has shape ", s): concatenates its arguments with operator<< and throws Error.
template <class... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  throw Error(os.str());
}

// check(cond, parts...): throws Error(parts...) when cond is false.
template <class... Args>
void check(bool cond, const Args&... args) {
  if (!cond) fail(args...);
}

// "[2, 3, 4]" for messages.
template <class Vec>
std::string shape_str(const Vec& shape) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
}

}  // namespace nextlm
