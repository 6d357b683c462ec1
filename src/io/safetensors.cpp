// safetensors reading (validated parse of the header, mmap of files, sharded hub checkpoints), dtype conversion
// and atomic writing. The parser is fuzzed: every input either parses or throws a one-line nextlm::Error.
#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/error.h"
#include "io/atomic_file.h"

namespace nextlm {

namespace {

using json = nlohmann::json;

constexpr uint64_t kMaxHeader = 100u * 1000u * 1000u;

// Names and labels come from untrusted files; control bytes are escaped so every message stays one line.
std::string printable(const std::string& s) {
  static const char* hex = "0123456789abcdef";
  std::string out;
  out.reserve(s.size());
  for (unsigned char c : s) {
    if (c < 0x20 || c == 0x7f) {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

bool parse_dtype(const std::string& s, DType& dt) {
  static const std::pair<const char*, DType> table[] = {{"F32", DType::F32},   {"F64", DType::F64},
                                                        {"BF16", DType::BF16}, {"F16", DType::F16},
                                                        {"I32", DType::I32},   {"I64", DType::I64}};
  for (const auto& [name, d] : table)
    if (s == name) {
      dt = d;
      return true;
    }
  return false;
}

// A JSON integer >= 0 that fits in `max`.
bool as_uint(const json& v, uint64_t max, uint64_t& out) {
  if (v.is_number_unsigned()) {
    out = v.get<uint64_t>();
  } else if (v.is_number_integer()) {
    int64_t i = v.get<int64_t>();
    if (i < 0) return false;
    out = static_cast<uint64_t>(i);
  } else {
    return false;
  }
  return out <= max;
}

// numel * dtype_size with overflow reported as false.
bool byte_count(const std::vector<int64_t>& shape, DType dt, size_t& bytes) {
  size_t n = dtype_size(dt);
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, static_cast<size_t>(d), &n)) return false;
  }
  bytes = n;
  return true;
}

// Shard names come from index.json: they must stay inside the checkpoint directory.
bool plain_file_name(const std::string& s) {
  return !s.empty() && s.find('/') == std::string::npos && s.find('\\') == std::string::npos &&
         s.find("..") == std::string::npos && s != "." && s.find('\0') == std::string::npos;
}

uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

size_t dtype_size(DType dt) {
  switch (dt) {
    case DType::F32: return 4;
    case DType::F64: return 8;
    case DType::BF16: return 2;
    case DType::F16: return 2;
    case DType::I32: return 4;
    case DType::I64: return 8;
  }
  fail("invalid dtype ", static_cast<int>(dt));
}

const char* dtype_name(DType dt) {
  switch (dt) {
    case DType::F32: return "F32";
    case DType::F64: return "F64";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
  }
  return "?";
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, d, &n))
      fail("tensor ", printable(name), " in ", printable(file), ": invalid shape ", shape_str(shape));
  }
  return n;
}

float bf16_to_f32(uint16_t bits) { return bits_f32(static_cast<uint32_t>(bits) << 16); }

float f16_to_f32(uint16_t bits) {
  uint32_t sign = static_cast<uint32_t>(bits & 0x8000) << 16;
  uint32_t exp = (bits >> 10) & 0x1f;
  uint32_t mant = bits & 0x3ff;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24 is exact in fp32.
    float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return bits_f32(sign | 0x7f800000u | (mant << 13));  // inf, or NaN keeping its payload
  return bits_f32(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  // Truncating a NaN whose payload sits in the low bits would give inf; force a quiet-NaN bit instead.
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040);
  uint32_t rounding = 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

std::vector<float> to_f32(const TensorView& t) {
  size_t n = static_cast<size_t>(t.numel());
  size_t need;
  if (!byte_count(t.shape, t.dtype, need) || need != t.nbytes)
    fail("tensor ", printable(t.name), " in ", printable(t.file), ": holds ", t.nbytes,
         " bytes, which does not match shape ", shape_str(t.shape), " of ", dtype_name(t.dtype));
  std::vector<float> out(n);
  const std::byte* p = t.data;
  switch (t.dtype) {
    case DType::F32:
      if (n) std::memcpy(out.data(), p, n * 4);
      break;
    case DType::F64:
      for (size_t i = 0; i < n; ++i) {
        double d;
        std::memcpy(&d, p + i * 8, 8);
        out[i] = static_cast<float>(d);
      }
      break;
    case DType::BF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, p + i * 2, 2);
        out[i] = bf16_to_f32(b);
      }
      break;
    case DType::F16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, p + i * 2, 2);
        out[i] = f16_to_f32(b);
      }
      break;
    case DType::I32:
    case DType::I64:
      fail("tensor ", printable(t.name), " in ", printable(t.file), " has integer dtype ", dtype_name(t.dtype),
           ", expected a floating dtype");
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------------

SafetensorsBuffer::SafetensorsBuffer(const std::byte* data, size_t size, std::string label) {
  const std::string where = "safetensors " + printable(label) + ": ";
  check(size >= 8, where, "file is ", size, " bytes, too short for the 8-byte header length");
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; --i) hlen = (hlen << 8) | static_cast<uint8_t>(data[i]);
  check(hlen <= kMaxHeader, where, "header length ", hlen, " exceeds the 100 MB limit");
  check(hlen <= size - 8, where, "header length ", hlen, " exceeds the ", size - 8,
        " bytes that follow it; the file is truncated or not safetensors");

  const char* hbegin = reinterpret_cast<const char*>(data + 8);
  const char* hend = hbegin + hlen;
  const std::byte* block = data + 8 + hlen;
  const uint64_t block_size = size - 8 - hlen;

  // nlohmann keeps the last of duplicate keys; the callback sees every top-level key so duplicates are caught.
  std::set<std::string> seen;
  std::string duplicate;
  auto on_event = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1 && duplicate.empty()) {
      const std::string& k = parsed.get_ref<const std::string&>();
      if (!seen.insert(k).second) duplicate = k;
    }
    return true;
  };
  json header;
  try {
    header = json::parse(hbegin, hend, on_event);
  } catch (const json::exception& e) {
    fail(where, "header is not valid JSON (", printable(e.what()), ")");
  }
  check(header.is_object(), where, "header is not a JSON object");
  check(duplicate.empty(), where, "tensor ", printable(duplicate), " appears twice in the header");

  struct Range {
    uint64_t begin, end;
    size_t tensor;
  };
  std::vector<Range> ranges;
  try {
    for (const auto& [name, entry] : header.items()) {
      if (name == "__metadata__") {
        check(entry.is_object(), where, "__metadata__ is not an object");
        for (const auto& [k, v] : entry.items()) {
          check(v.is_string(), where, "__metadata__ value of ", printable(k), " is not a string");
          metadata_[k] = v.get<std::string>();
        }
        continue;
      }
      const std::string tw = where + "tensor " + printable(name) + ": ";
      check(entry.is_object(), tw, "entry is not an object");
      auto dt_it = entry.find("dtype");
      auto shape_it = entry.find("shape");
      auto off_it = entry.find("data_offsets");
      check(dt_it != entry.end(), tw, "missing \"dtype\"");
      check(shape_it != entry.end(), tw, "missing \"shape\"");
      check(off_it != entry.end(), tw, "missing \"data_offsets\"");

      TensorView t;
      t.name = name;
      t.file = label;
      check(dt_it->is_string(), tw, "dtype is not a string");
      const std::string& dts = dt_it->get_ref<const std::string&>();
      check(parse_dtype(dts, t.dtype), tw, "unknown dtype \"", printable(dts),
            "\" (supported: F32, F64, BF16, F16, I32, I64)");

      check(shape_it->is_array(), tw, "shape is not an array");
      for (const json& d : *shape_it) {
        uint64_t v;
        if (!as_uint(d, static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), v))
          fail(tw, "shape entries must be non-negative integers, got ", printable(shape_it->dump()));
        t.shape.push_back(static_cast<int64_t>(v));
      }

      uint64_t begin = 0, end = 0;
      const json& off = *off_it;
      if (!(off.is_array() && off.size() == 2 && as_uint(off[0], UINT64_MAX, begin) &&
            as_uint(off[1], UINT64_MAX, end) && begin <= end))
        fail(tw, "data_offsets must be two non-negative integers [begin, end] with begin <= end, got ",
             printable(off.dump()));

      size_t need;
      if (!byte_count(t.shape, t.dtype, need))
        fail(tw, "shape ", shape_str(t.shape), " of ", dts, " is too large (byte count overflows)");
      if (end - begin != need)
        fail(tw, "data_offsets [", begin, ", ", end, "] hold ", end - begin, " bytes but shape ",
             shape_str(t.shape), " of ", dts, " needs ", need);
      check(end <= block_size, tw, "data_offsets [", begin, ", ", end, "] extend past the data block of ",
            block_size, " bytes; the file is truncated");

      t.data = block + begin;
      t.nbytes = need;
      ranges.push_back({begin, end, tensors_.size()});
      index_[name] = tensors_.size();
      tensors_.push_back(std::move(t));
    }
  } catch (const json::exception& e) {
    // Defensive: the checks above should leave nothing for nlohmann to throw on.
    fail(where, "malformed header (", printable(e.what()), ")");
  }

  // Empty tensors occupy no bytes, so they cannot overlap anything.
  std::erase_if(ranges, [](const Range& r) { return r.begin == r.end; });
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  for (size_t i = 1; i < ranges.size(); ++i) {
    const Range& a = ranges[i - 1];
    const Range& b = ranges[i];
    check(a.end <= b.begin, where, "tensors ", printable(tensors_[a.tensor].name), " and ",
          printable(tensors_[b.tensor].name), " overlap (data_offsets [", a.begin, ", ", a.end, "] and [",
          b.begin, ", ", b.end, "])");
  }
}

const TensorView* SafetensorsBuffer::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

// ---------------------------------------------------------------------------------------------------------------

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("cannot open safetensors file ", printable(path), ": ", std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    fail("cannot stat safetensors file ", printable(path), ": ", std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("safetensors file ", printable(path), " is not a regular file");
  }
  if (st.st_size == 0) {
    ::close(fd);
    fail("safetensors file ", printable(path), " is empty");
  }
  size_ = static_cast<size_t>(st.st_size);
  void* m = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  int err = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (m == MAP_FAILED) fail("cannot mmap safetensors file ", printable(path), ": ", std::strerror(err));
  map_ = m;
  try {
    buffer_ = std::make_unique<SafetensorsBuffer>(static_cast<const std::byte*>(map_), size_, path);
  } catch (...) {
    ::munmap(map_, size_);
    map_ = nullptr;
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  buffer_.reset();
  if (map_) ::munmap(map_, size_);
}

// ---------------------------------------------------------------------------------------------------------------

Checkpoint::Checkpoint(const std::string& dir) : dir_(dir) {
  namespace fs = std::filesystem;
  const fs::path root(dir);
  const fs::path index_path = root / "model.safetensors.index.json";
  const fs::path single_path = root / "model.safetensors";
  std::error_code ec;

  if (fs::exists(index_path, ec)) {
    const std::string ip = index_path.string();
    std::ifstream in(index_path, std::ios::binary);
    if (!in) fail("cannot read ", printable(ip), ": ", std::strerror(errno));
    std::ostringstream ss;
    ss << in.rdbuf();
    json index = json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
    check(!index.is_discarded(), printable(ip), ": not valid JSON");
    check(index.is_object(), printable(ip), ": not a JSON object");
    auto wm = index.find("weight_map");
    check(wm != index.end() && wm->is_object(), printable(ip), ": missing object \"weight_map\"");
    check(!wm->empty(), printable(ip), ": \"weight_map\" is empty");

    // tensor -> shard as listed, and each distinct shard opened once.
    std::map<std::string, std::string> listed;
    std::map<std::string, size_t> shard_index;
    for (const auto& [name, shard] : wm->items()) {
      check(shard.is_string(), printable(ip), ": shard of tensor ", printable(name), " is not a string");
      const std::string& s = shard.get_ref<const std::string&>();
      check(plain_file_name(s), printable(ip), ": shard \"", printable(s), "\" of tensor ", printable(name),
            " is not a plain file name");
      listed[name] = s;
      if (!shard_index.count(s)) {
        const fs::path sp = root / s;
        check(fs::exists(sp, ec), printable(ip), ": shard ", printable(s), " of tensor ", printable(name),
              " does not exist in ", printable(dir));
        shard_index[s] = files_.size();
        files_.push_back(std::make_unique<SafetensorsFile>(sp.string()));
      }
    }
    // Every tensor of every shard is reachable, listed or not, but only from one shard.
    for (const auto& f : files_) {
      for (const TensorView& t : f->buffer().tensors()) {
        auto [it, inserted] = by_name_.emplace(t.name, &t);
        check(inserted, "checkpoint ", printable(dir), ": tensor ", printable(t.name), " is in two shards, ",
              printable(it->second->file), " and ", printable(t.file));
      }
    }
    for (const auto& [name, shard] : listed) {
      const SafetensorsFile& f = *files_[shard_index[shard]];
      check(f.buffer().find(name) != nullptr, printable(ip), ": tensor ", printable(name),
            " is listed in shard ", printable(shard), " but that shard does not hold it");
    }
  } else if (fs::exists(single_path, ec)) {
    files_.push_back(std::make_unique<SafetensorsFile>(single_path.string()));
    for (const TensorView& t : files_.back()->buffer().tensors()) by_name_.emplace(t.name, &t);
  } else {
    fail("no model.safetensors or model.safetensors.index.json in ", printable(dir));
  }
}

const TensorView* Checkpoint::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(by_name_.size());
  for (const auto& kv : by_name_) out.push_back(kv.first);
  return out;
}

// ---------------------------------------------------------------------------------------------------------------

void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  // Lay the data out in name order, so offsets grow with the (sorted) header keys.
  std::vector<const TensorToWrite*> order;
  for (const auto& t : tensors) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->name < b->name; });

  json header = json::object();
  std::vector<size_t> sizes;
  uint64_t offset = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    const TensorToWrite& t = *order[i];
    const std::string tw = "cannot write " + printable(path) + ": tensor " + printable(t.name) + ": ";
    check(!t.name.empty(), "cannot write ", printable(path), ": a tensor has an empty name");
    check(t.name != "__metadata__", tw, "the name is reserved");
    check(i == 0 || order[i - 1]->name != t.name, tw, "the name appears twice");
    size_t n;
    if (!byte_count(t.shape, t.dtype, n))
      fail(tw, "shape ", shape_str(t.shape), " of ", dtype_name(t.dtype), " is negative or too large");
    check(n == 0 || t.data != nullptr, tw, "no data");
    check(!__builtin_add_overflow(offset, n, &offset), tw, "total size overflows");
    header[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset - n, offset}}};
    sizes.push_back(n);
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;

  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception&) {
    fail("cannot write ", printable(path), ": a tensor name or metadata string is not valid UTF-8");
  }
  // Pad with spaces (valid JSON whitespace) so the data block starts 8-byte aligned, as the reference writer does.
  text.append((8 - text.size() % 8) % 8, ' ');
  uint64_t hlen = text.size();
  unsigned char len_bytes[8];
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<unsigned char>(hlen >> (8 * i));

  AtomicFile out(path);
  out.write(len_bytes, 8);
  out.write(text);
  for (size_t i = 0; i < order.size(); ++i) out.write(order[i]->data, sizes[i]);
  out.commit();
}

}  // namespace nextlm
