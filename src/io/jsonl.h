// Token-sequence input files: JSON Lines, one object {"tokens": [ids...]} per line.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace nextlm {

// Reads every line of `path`. An empty line, malformed JSON, a missing or empty "tokens" list, a non-integer id or
// an id outside [0, vocab_size) is an Error naming the file and line.
std::vector<std::vector<int32_t>> read_token_jsonl(const std::string& path, int64_t vocab_size);

}  // namespace nextlm
