// libFuzzer target for the tokenizer.json reader: any input must either give a tokenizer or throw nextlm::Error, and
// a tokenizer must encode and decode without crashing (invalid UTF-8 input to encode is an Error too).
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const nextlm::Tokenizer tok = nextlm::Tokenizer::parse(text, "fuzz input");
    const std::vector<int32_t> ids =
        tok.encode("Hello, world! It's 2026\r\n\n  indented\tcode() 你好 émoji 👩‍💻 <|user|>[gMASK] 12345");
    (void)tok.decode(ids);
    (void)tok.decode(ids, /*skip_special_tokens=*/true);
    std::vector<int32_t> some;
    for (size_t i = 0; i < size && i < 64; ++i) some.push_back(static_cast<int32_t>(data[i]) * 7 - 3);
    (void)tok.decode(some);
    (void)tok.encode(text.substr(0, 256));
  } catch (const nextlm::Error&) {
  }
  return 0;
}
