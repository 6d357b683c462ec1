// JSONL token-sequence reader with line-precise errors.
#include "io/jsonl.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace nextlm {

namespace {

// What a non-integer token is, for messages: numbers are shown (short), anything else only by its kind, so that a
// huge string or a deeply nested array never ends up in (or overflows the stack while building) the message.
std::string describe_value(const nlohmann::json& v) {
  if (v.is_number()) return v.dump();
  if (v.is_string()) return "a string";
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  if (v.is_boolean()) return v.get<bool>() ? "true" : "false";
  if (v.is_null()) return "null";
  return "not a number";
}

}  // namespace

std::vector<std::vector<int32_t>> read_token_jsonl(const std::string& path, int64_t vocab_size) {
  std::error_code ec;
  check(!std::filesystem::is_directory(path, ec), "input ", path, " is a directory, not a JSONL file");
  std::ifstream in(path);
  if (!in.good()) fail("cannot read input file ", path, ": ", std::strerror(errno));
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
      const nlohmann::json& v = toks[i];
      check(v.is_number_integer(), path, ":", lineno, ": token ", i, " is not an integer: ", describe_value(v));
      // Unsigned values above INT64_MAX would wrap to negative ids in get<int64_t>(); show them as written.
      if (v.is_number_unsigned() && v.get<uint64_t>() >= static_cast<uint64_t>(vocab_size))
        fail(path, ":", lineno, ": token id ", v.get<uint64_t>(), " at position ", i, " is outside the vocabulary [0, ",
             vocab_size, ")");
      const int64_t id = v.get<int64_t>();
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
