// JSONL token-sequence reader with line-precise errors.
#include "io/jsonl.h"

#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace nextlm {

std::vector<std::vector<int32_t>> read_token_jsonl(const std::string& path, int64_t vocab_size) {
  std::ifstream in(path);
  check(in.good(), "cannot read input file ", path);
  std::vector<std::vector<int32_t>> out;
  std::string line;
  int64_t lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    check(line.find_first_not_of(" \t") != std::string::npos, path, ":", lineno, ": empty line");
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    check(!j.is_discarded(), path, ":", lineno, ": not valid JSON");
    check(j.is_object() && j.contains("tokens") && j.at("tokens").is_array(), path, ":", lineno,
          ": expected an object with a \"tokens\" list");
    const nlohmann::json& toks = j.at("tokens");
    check(!toks.empty(), path, ":", lineno, ": \"tokens\" is empty");
    std::vector<int32_t> seq;
    seq.reserve(toks.size());
    for (size_t i = 0; i < toks.size(); ++i) {
      check(toks[i].is_number_integer(), path, ":", lineno, ": token ", i, " is not an integer: ", toks[i].dump());
      const int64_t id = toks[i].get<int64_t>();
      check(id >= 0 && id < vocab_size, path, ":", lineno, ": token id ", id, " at position ", i,
            " is outside the vocabulary [0, ", vocab_size, ")");
      seq.push_back(static_cast<int32_t>(id));
    }
    out.push_back(std::move(seq));
  }
  check(!in.bad(), "error reading ", path);
  check(!out.empty(), path, ": no sequences");
  return out;
}

}  // namespace nextlm
