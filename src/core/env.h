// Switches a benchmark or test can set through the environment: on by default (or off, for those that say so), off
// where the environment sets the variable to 0, on where it sets it to anything else.
#pragma once
#include <atomic>
#include <cstdlib>
#include <cstring>

namespace nextlm {

// Whether `name` is set to anything but "0" in the environment; not set: `default_on`.
inline bool env_switch_on(const char* name, bool default_on = true) {
  const char* v = std::getenv(name);
  return v ? std::strcmp(v, "0") != 0 : default_on;
}

// A process-wide switch read from the environment (env_switch_on) at its first use, unless set before.
class EnvSwitch {
 public:
  explicit constexpr EnvSwitch(const char* name, bool default_on = true) : name_(name), default_on_(default_on) {}
  bool on() {
    int v = state_.load();
    if (v < 0) {
      v = env_switch_on(name_, default_on_) ? 1 : 0;
      state_.store(v);
    }
    return v == 1;
  }
  void set(bool on) { state_.store(on ? 1 : 0); }

 private:
  const char* name_;
  bool default_on_;
  std::atomic<int> state_{-1};  // −1: not yet read from the environment
};

}  // namespace nextlm
