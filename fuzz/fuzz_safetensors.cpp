// libFuzzer target for the safetensors parser: any byte string must either parse or throw nextlm::Error, and
// every parsed floating tensor must convert to fp32 without reading outside the input.
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    nextlm::SafetensorsBuffer buf(reinterpret_cast<const std::byte*>(data), size, "fuzz");
    for (const auto& t : buf.tensors()) {
      try {
        auto v = nextlm::to_f32(t);
        if (v.size() != static_cast<size_t>(t.numel())) __builtin_trap();
      } catch (const nextlm::Error&) {
        // integer dtypes
      }
    }
  } catch (const nextlm::Error&) {
  }
  return 0;
}
