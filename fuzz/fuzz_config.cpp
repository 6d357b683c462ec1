// libFuzzer target for the model config parser: any JSON value must either give a config or throw nextlm::Error.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nlohmann::json j = nlohmann::json::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  try {
    (void)nextlm::parse_config(j);
  } catch (const nextlm::Error&) {
  }
  return 0;
}
