// Tests of the safetensors reader/writer, the bf16/f16 conversions, sharded checkpoints and AtomicFile:
// exact round trips, known bit patterns, and one test per malformed input asserting what the error names.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"

namespace fs = std::filesystem;
using namespace nextlm;

namespace {

// A fresh directory under the system temp dir, removed with everything in it at the end of the test.
struct TempDir {
  fs::path path;
  TempDir() {
    static std::atomic<int> counter{0};
    path = fs::temp_directory_path() /
           ("nextlm_test_safetensors_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
  std::vector<std::string> entries() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(path)) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }
};

// A safetensors byte image from a raw header string and a data block.
std::vector<std::byte> image(const std::string& header, const std::vector<uint8_t>& data = {}) {
  std::vector<std::byte> out(8);
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<std::byte>(n >> (8 * i));
  for (char c : header) out.push_back(static_cast<std::byte>(c));
  for (uint8_t b : data) out.push_back(static_cast<std::byte>(b));
  return out;
}

void write_bytes(const std::string& path, const std::vector<std::byte>& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good());
}

std::vector<std::byte> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::vector<char> v((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(v.size());
  std::memcpy(out.data(), v.data(), v.size());
  return out;
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
  ASSERT_TRUE(f.good());
}

// Runs fn, which must throw nextlm::Error with a one-line message containing every one of `parts`.
void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> parts) {
  try {
    fn();
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "multi-line message: " << msg;
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
    return;
  }
  ADD_FAILURE() << "no nextlm::Error thrown";
}

void expect_buffer_error(const std::string& header, const std::vector<uint8_t>& data,
                         std::initializer_list<std::string> parts) {
  auto bytes = image(header, data);
  expect_error([&] { SafetensorsBuffer b(bytes.data(), bytes.size(), "mem.safetensors"); }, parts);
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <class T>
std::vector<uint8_t> as_bytes(const std::vector<T>& v) {
  std::vector<uint8_t> out(v.size() * sizeof(T));
  if (!v.empty()) std::memcpy(out.data(), v.data(), out.size());
  return out;
}

// Writes one tensor per entry of `names` (F32, 2 elements each, values derived from the index) to `path`.
void write_shard(const std::string& path, const std::vector<std::string>& names, std::vector<float>& storage) {
  storage.clear();
  for (size_t i = 0; i < names.size(); ++i) {
    storage.push_back(static_cast<float>(i) + 0.5f);
    storage.push_back(static_cast<float>(names[i].size()));
  }
  std::vector<TensorToWrite> ts;
  for (size_t i = 0; i < names.size(); ++i) ts.push_back({names[i], DType::F32, {2}, storage.data() + 2 * i});
  write_safetensors(path, ts);
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------

TEST(Safetensors, RoundTripEveryDtypeExactBytes) {
  TempDir dir;
  std::vector<float> f32 = {1.0f, -2.5f, 3.25e-20f, std::numeric_limits<float>::infinity(), -0.0f, 7.0f};
  std::vector<double> f64 = {1e300, -1e-300, 0.1};
  std::vector<uint16_t> bf16 = {0x3f80, 0xc020, 0x0001, 0x7f80};
  std::vector<uint16_t> f16 = {0x3c00, 0xc100, 0x0001, 0x7c00, 0x7bff, 0x8000};
  std::vector<int32_t> i32 = {0, -1, 2147483647, -2147483647 - 1};
  std::vector<int64_t> i64 = {int64_t{1} << 62, -5};
  float scalar = 42.0f;
  std::vector<TensorToWrite> ts = {
      {"w.f32", DType::F32, {2, 3}, f32.data()},   {"w.f64", DType::F64, {3}, f64.data()},
      {"w.bf16", DType::BF16, {2, 2}, bf16.data()}, {"w.f16", DType::F16, {6}, f16.data()},
      {"w.i32", DType::I32, {4, 1}, i32.data()},   {"w.i64", DType::I64, {2}, i64.data()},
      {"scalar", DType::F32, {}, &scalar},          {"empty", DType::BF16, {0, 3}, nullptr},
  };
  std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "hi"}};
  const std::string path = dir / "model.safetensors";
  write_safetensors(path, ts, meta);
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"model.safetensors"});  // no temporary left behind

  // The data block starts 8-byte aligned, like the reference writer.
  auto raw = read_bytes(path);
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; --i) hlen = (hlen << 8) | static_cast<uint8_t>(raw[i]);
  EXPECT_EQ((8 + hlen) % 8, 0u);

  SafetensorsFile file(path);
  const auto& buf = file.buffer();
  EXPECT_EQ(buf.tensors().size(), ts.size());
  EXPECT_EQ(buf.metadata(), meta);
  const std::vector<std::vector<uint8_t>> expected = {as_bytes(f32),  as_bytes(f64), as_bytes(bf16),
                                                      as_bytes(f16),  as_bytes(i32), as_bytes(i64),
                                                      as_bytes(std::vector<float>{scalar}), {}};
  for (size_t i = 0; i < ts.size(); ++i) {
    const TensorView* t = buf.find(ts[i].name);
    ASSERT_NE(t, nullptr) << ts[i].name;
    EXPECT_EQ(t->dtype, ts[i].dtype) << ts[i].name;
    EXPECT_EQ(t->shape, ts[i].shape) << ts[i].name;
    EXPECT_EQ(t->file, path);
    ASSERT_EQ(t->nbytes, expected[i].size()) << ts[i].name;
    if (t->nbytes) {
      EXPECT_EQ(std::memcmp(t->data, expected[i].data(), t->nbytes), 0) << ts[i].name;
    }
  }
  EXPECT_EQ(buf.find("scalar")->numel(), 1);
  EXPECT_EQ(buf.find("empty")->numel(), 0);
  EXPECT_EQ(buf.find("missing"), nullptr);

  // A single-file checkpoint directory.
  Checkpoint ck(dir.path.string());
  EXPECT_EQ(ck.num_files(), 1u);
  EXPECT_EQ(ck.names(),
            (std::vector<std::string>{"empty", "scalar", "w.bf16", "w.f16", "w.f32", "w.f64", "w.i32", "w.i64"}));
  ASSERT_NE(ck.find("w.i64"), nullptr);
  EXPECT_EQ(std::memcmp(ck.find("w.i64")->data, i64.data(), 16), 0);
}

TEST(Safetensors, WriterOmitsEmptyMetadataAndOverwrites) {
  TempDir dir;
  const std::string path = dir / "x.safetensors";
  float a = 1.0f, b = 2.0f;
  write_safetensors(path, {{"a", DType::F32, {1}, &a}}, {{"k", "v"}});
  write_safetensors(path, {{"b", DType::F32, {1}, &b}});
  SafetensorsFile file(path);
  EXPECT_TRUE(file.buffer().metadata().empty());
  EXPECT_EQ(file.buffer().find("a"), nullptr);
  ASSERT_NE(file.buffer().find("b"), nullptr);
  EXPECT_EQ(to_f32(*file.buffer().find("b")), std::vector<float>{2.0f});
  auto raw = read_bytes(path);
  std::string text(reinterpret_cast<const char*>(raw.data()) + 8, raw.size() - 8 - 4);
  EXPECT_EQ(text.find("__metadata__"), std::string::npos);
}

TEST(Safetensors, ToF32ConvertsFloatingDtypesAndRejectsIntegers) {
  std::vector<double> f64 = {0.5, -3.0, 1e-3};
  std::vector<uint16_t> bf16 = {0x3f80, 0xc020};
  std::vector<uint16_t> f16 = {0x3c00, 0xc100, 0x0001};
  std::vector<uint8_t> data;
  for (auto v : {as_bytes(f64), as_bytes(bf16), as_bytes(f16)}) data.insert(data.end(), v.begin(), v.end());
  auto bytes = image(R"({"d":{"dtype":"F64","shape":[3],"data_offsets":[0,24]},)"
                     R"("b":{"dtype":"BF16","shape":[2],"data_offsets":[24,28]},)"
                     R"("h":{"dtype":"F16","shape":[3],"data_offsets":[28,34]},)"
                     R"("i":{"dtype":"I32","shape":[0],"data_offsets":[34,34]}})",
                     data);
  SafetensorsBuffer buf(bytes.data(), bytes.size(), "mem");
  EXPECT_EQ(to_f32(*buf.find("d")), (std::vector<float>{0.5f, -3.0f, static_cast<float>(1e-3)}));
  EXPECT_EQ(to_f32(*buf.find("b")), (std::vector<float>{1.0f, -2.5f}));
  EXPECT_EQ(to_f32(*buf.find("h")), (std::vector<float>{1.0f, -2.5f, std::ldexp(1.0f, -24)}));
  expect_error([&] { to_f32(*buf.find("i")); }, {"tensor i", "I32"});
}

TEST(Safetensors, UnalignedDataIsReadByteWise) {
  // Offsets 1 and 5 put the elements off their natural alignment inside the mapping.
  std::vector<uint8_t> data(1);
  auto f = as_bytes(std::vector<float>{1.5f, -4.0f});
  data.insert(data.end(), f.begin(), f.end());
  auto bytes = image(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[1,9]}})", data);
  SafetensorsBuffer buf(bytes.data(), bytes.size(), "mem");
  EXPECT_EQ(to_f32(*buf.find("t")), (std::vector<float>{1.5f, -4.0f}));
}

// ---------------------------------------------------------------------------------------------------------------

TEST(Conversions, Bf16KnownBits) {
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  EXPECT_EQ(bf16_to_f32(0xc020), -2.5f);
  EXPECT_EQ(bits(bf16_to_f32(0x0001)), 0x00010000u);  // smallest subnormal
  EXPECT_EQ(bits(bf16_to_f32(0x8000)), 0x80000000u);  // -0
  EXPECT_EQ(bf16_to_f32(0x7f80), std::numeric_limits<float>::infinity());
  EXPECT_EQ(bf16_to_f32(0xff80), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(bf16_to_f32(0x7fc0)));
  EXPECT_TRUE(std::isnan(bf16_to_f32(0x7f81)));

  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(-2.5f), 0xc020);
  EXPECT_EQ(f32_to_bf16(from_bits(0x00010000)), 0x0001);
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(f32_to_bf16(-std::numeric_limits<float>::infinity()), 0xff80);
  // Ties go to the even neighbour; anything past the tie rounds away.
  EXPECT_EQ(f32_to_bf16(from_bits(0x3f808000)), 0x3f80);
  EXPECT_EQ(f32_to_bf16(from_bits(0x3f818000)), 0x3f82);
  EXPECT_EQ(f32_to_bf16(from_bits(0x3f808001)), 0x3f81);
  EXPECT_EQ(f32_to_bf16(from_bits(0x3f807fff)), 0x3f80);
  EXPECT_EQ(f32_to_bf16(from_bits(0xbf818000)), 0xbf82);
  EXPECT_EQ(f32_to_bf16(from_bits(0x7f7fffff)), 0x7f80);  // FLT_MAX rounds up to inf
  // NaN stays NaN even when only the low payload bits are set (plain truncation would give inf).
  for (uint32_t nan : {0x7fc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu}) {
    uint16_t b = f32_to_bf16(from_bits(nan));
    EXPECT_TRUE(std::isnan(bf16_to_f32(b))) << std::hex << nan;
    EXPECT_EQ(b & 0x8000, (nan >> 16) & 0x8000) << std::hex << nan;
  }
  // Every non-NaN bf16 survives bf16 -> f32 -> bf16.
  for (uint32_t b = 0; b < 0x10000; ++b) {
    if ((b & 0x7fff) > 0x7f80) continue;
    ASSERT_EQ(f32_to_bf16(bf16_to_f32(static_cast<uint16_t>(b))), b) << std::hex << b;
  }
}

TEST(Conversions, F16KnownBits) {
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_f32(0xc100), -2.5f);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(f16_to_f32(0x8001), -std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_f32(0x03ff), std::ldexp(1023.0f, -24));  // largest subnormal
  EXPECT_EQ(f16_to_f32(0x0400), std::ldexp(1.0f, -14));     // smallest normal
  EXPECT_EQ(f16_to_f32(0x7bff), 65504.0f);
  EXPECT_EQ(bits(f16_to_f32(0x8000)), 0x80000000u);
  EXPECT_EQ(f16_to_f32(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(f16_to_f32(0xfc00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7e00)));
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7c01)));
  EXPECT_TRUE(std::signbit(f16_to_f32(0xfe00)));
  // Every finite half against the textbook formula.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    if (exp == 31) continue;
    double v = exp == 0 ? std::ldexp(double(mant), -24) : std::ldexp(double(1024 + mant), int(exp) - 25);
    if (h & 0x8000) v = -v;
    ASSERT_EQ(f16_to_f32(static_cast<uint16_t>(h)), static_cast<float>(v)) << std::hex << h;
    ASSERT_EQ(std::signbit(f16_to_f32(static_cast<uint16_t>(h))), (h & 0x8000) != 0) << std::hex << h;
  }
}

// ---------------------------------------------------------------------------------------------------------------

TEST(Checkpoint, ShardedWithIndex) {
  TempDir dir;
  std::vector<float> s1, s2;
  write_shard(dir / "model-00001-of-00002.safetensors", {"a", "bb"}, s1);
  write_shard(dir / "model-00002-of-00002.safetensors", {"ccc", "extra"}, s2);
  write_text(dir / "model.safetensors.index.json",
             R"({"metadata":{"total_size":32},"weight_map":{"a":"model-00001-of-00002.safetensors",)"
             R"("bb":"model-00001-of-00002.safetensors","ccc":"model-00002-of-00002.safetensors"}})");
  Checkpoint ck(dir.path.string());
  EXPECT_EQ(ck.num_files(), 2u);
  EXPECT_EQ(ck.dir(), dir.path.string());
  EXPECT_EQ(ck.names(), (std::vector<std::string>{"a", "bb", "ccc", "extra"}));  // unlisted "extra" included
  const TensorView* c = ck.find("ccc");
  ASSERT_NE(c, nullptr);
  EXPECT_NE(c->file.find("model-00002-of-00002.safetensors"), std::string::npos);
  EXPECT_EQ(to_f32(*c), (std::vector<float>{0.5f, 3.0f}));
  EXPECT_EQ(to_f32(*ck.find("bb")), (std::vector<float>{1.5f, 2.0f}));
  EXPECT_EQ(to_f32(*ck.find("extra")), (std::vector<float>{1.5f, 5.0f}));
  EXPECT_EQ(ck.find("zz"), nullptr);
}

TEST(Checkpoint, IndexNamesMissingTensor) {
  TempDir dir;
  std::vector<float> s;
  write_shard(dir / "shard1.safetensors", {"a"}, s);
  write_text(dir / "model.safetensors.index.json",
             R"({"weight_map":{"a":"shard1.safetensors","ghost":"shard1.safetensors"}})");
  expect_error([&] { Checkpoint ck(dir.path.string()); }, {"ghost", "shard1.safetensors"});
}

TEST(Checkpoint, IndexNamesMissingShard) {
  TempDir dir;
  std::vector<float> s;
  write_shard(dir / "shard1.safetensors", {"a"}, s);
  write_text(dir / "model.safetensors.index.json",
             R"({"weight_map":{"a":"shard1.safetensors","b":"shard9.safetensors"}})");
  expect_error([&] { Checkpoint ck(dir.path.string()); }, {"shard9.safetensors", "b"});
}

TEST(Checkpoint, TensorDuplicatedAcrossShards) {
  TempDir dir;
  std::vector<float> s1, s2;
  write_shard(dir / "shard1.safetensors", {"a", "dup"}, s1);
  write_shard(dir / "shard2.safetensors", {"b", "dup"}, s2);
  write_text(dir / "model.safetensors.index.json",
             R"({"weight_map":{"a":"shard1.safetensors","b":"shard2.safetensors","dup":"shard2.safetensors"}})");
  expect_error([&] { Checkpoint ck(dir.path.string()); }, {"dup", "shard1.safetensors", "shard2.safetensors"});
}

TEST(Checkpoint, IndexRejectsMalformedIndexAndPathShards) {
  TempDir dir;
  std::vector<float> s;
  write_shard(dir / "shard1.safetensors", {"a"}, s);
  const std::string index = dir / "model.safetensors.index.json";
  write_text(index, R"({"weight_map":{"a":"../shard1.safetensors"}})");
  expect_error([&] { Checkpoint ck(dir.path.string()); }, {"../shard1.safetensors", "a"});
  write_text(index, R"({"weight_map":{"a":"sub/shard1.safetensors"}})");
  expect_error([&] { Checkpoint ck(dir.path.string()); }, {"sub/shard1.safetensors"});
  write_text(index, R"({"weight_map":{"a":3}})");
  expect_error([&] { Checkpoint ck(dir.path.string()); }, {"model.safetensors.index.json", "a"});
  write_text(index, R"({"weights":{}})");
  expect_error([&] { Checkpoint ck(dir.path.string()); }, {"model.safetensors.index.json", "weight_map"});
  write_text(index, "{not json");
  expect_error([&] { Checkpoint ck(dir.path.string()); }, {"model.safetensors.index.json", "JSON"});
}

TEST(Checkpoint, NoModelFiles) {
  TempDir dir;
  expect_error([&] { Checkpoint ck(dir.path.string()); },
               {"no model.safetensors or model.safetensors.index.json in", dir.path.string()});
}

TEST(Checkpoint, BadShardFileNamesItsPath) {
  TempDir dir;
  write_text(dir / "model.safetensors", "xyz");
  expect_error([&] { Checkpoint ck(dir.path.string()); }, {dir / "model.safetensors"});
}

// ---------------------------------------------------------------------------------------------------------------

TEST(SafetensorsErrors, TruncatedDataBlock) {
  TempDir dir;
  const std::string path = dir / "t.safetensors";
  std::vector<float> v(16, 1.0f);
  write_safetensors(path, {{"layer.weight", DType::F32, {4, 4}, v.data()}});
  auto raw = read_bytes(path);
  ASSERT_GT(raw.size(), 4u);
  raw.erase(raw.end() - 4, raw.end());
  write_bytes(path, raw);
  expect_error([&] { SafetensorsFile f(path); }, {path, "layer.weight", "truncated"});
}

TEST(SafetensorsErrors, FileShorterThanEightBytes) {
  TempDir dir;
  const std::string path = dir / "short.safetensors";
  write_text(path, "12345");
  expect_error([&] { SafetensorsFile f(path); }, {path, "5 bytes"});
  expect_error([] { SafetensorsBuffer b(nullptr, 0, "nothing"); }, {"nothing"});
}

TEST(SafetensorsErrors, EmptyOrMissingFile) {
  TempDir dir;
  const std::string path = dir / "empty.safetensors";
  write_text(path, "");
  expect_error([&] { SafetensorsFile f(path); }, {path, "empty"});
  expect_error([&] { SafetensorsFile f(dir / "absent.safetensors"); }, {dir / "absent.safetensors"});
  expect_error([&] { SafetensorsFile f(dir.path.string()); }, {dir.path.string()});
}

TEST(SafetensorsErrors, OversizeHeaderLength) {
  // Longer than the file.
  auto bytes = image("{}", std::vector<uint8_t>(40));
  bytes[0] = std::byte{200};
  expect_error([&] { SafetensorsBuffer b(bytes.data(), bytes.size(), "big.safetensors"); },
               {"big.safetensors", "header length 200"});
  // Beyond the 100 MB limit (checked before the file size, so no huge buffer is needed).
  bytes[0] = std::byte{0};
  bytes[5] = std::byte{1};  // 2^40
  expect_error([&] { SafetensorsBuffer b(bytes.data(), bytes.size(), "big.safetensors"); },
               {"big.safetensors", "100 MB"});
  std::fill(bytes.begin(), bytes.begin() + 8, std::byte{0xff});
  expect_error([&] { SafetensorsBuffer b(bytes.data(), bytes.size(), "big.safetensors"); },
               {"big.safetensors", "100 MB"});
}

TEST(SafetensorsErrors, HeaderNotJsonOrNotObject) {
  expect_buffer_error("{\"a\": ", {}, {"mem.safetensors", "not valid JSON"});
  expect_buffer_error("", {}, {"mem.safetensors", "not valid JSON"});
  expect_buffer_error("[1, 2]", {}, {"mem.safetensors", "not a JSON object"});
  expect_buffer_error("{\"a\": 1} trailing", {}, {"mem.safetensors", "not valid JSON"});
}

TEST(SafetensorsErrors, UnknownDtype) {
  expect_buffer_error(R"({"w8":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}})", {1, 2},
                      {"mem.safetensors", "w8", "F8_E4M3"});
  expect_buffer_error(R"({"w":{"dtype":5,"shape":[2],"data_offsets":[0,2]}})", {1, 2}, {"w", "dtype"});
}

TEST(SafetensorsErrors, MissingFieldsOrNotObject) {
  expect_buffer_error(R"({"w":{"shape":[1],"data_offsets":[0,4]}})", {}, {"mem.safetensors", "w", "dtype"});
  expect_buffer_error(R"({"w":{"dtype":"F32","data_offsets":[0,4]}})", {}, {"w", "shape"});
  expect_buffer_error(R"({"w":{"dtype":"F32","shape":[1]}})", {}, {"w", "data_offsets"});
  expect_buffer_error(R"({"w":[1,2]})", {}, {"w", "not an object"});
}

TEST(SafetensorsErrors, BadShapeEntries) {
  expect_buffer_error(R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,0]}})", {}, {"w", "shape"});
  expect_buffer_error(R"({"w":{"dtype":"F32","shape":[1.5],"data_offsets":[0,0]}})", {}, {"w", "shape"});
  expect_buffer_error(R"({"w":{"dtype":"F32","shape":["2"],"data_offsets":[0,0]}})", {}, {"w", "shape"});
  expect_buffer_error(R"({"w":{"dtype":"F32","shape":2,"data_offsets":[0,0]}})", {}, {"w", "shape"});
  expect_buffer_error(R"({"w":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,0]}})", {},
                      {"w", "shape"});
}

TEST(SafetensorsErrors, BadOffsets) {
  std::vector<uint8_t> d(8);
  expect_buffer_error(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", d, {"w", "data_offsets"});
  expect_buffer_error(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", d, {"w", "data_offsets"});
  expect_buffer_error(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})", d, {"w", "data_offsets"});
  expect_buffer_error(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}})", d, {"w", "data_offsets"});
  expect_buffer_error(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0.0,4]}})", d, {"w", "data_offsets"});
}

TEST(SafetensorsErrors, WrongByteCountForShape) {
  expect_buffer_error(R"({"proj":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})",
                      std::vector<uint8_t>(24), {"mem.safetensors", "proj", "24", "20"});
  expect_buffer_error(R"({"proj":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,24]}})",
                      std::vector<uint8_t>(24), {"proj", "12"});
}

TEST(SafetensorsErrors, ByteCountOverflow) {
  expect_buffer_error(R"({"huge":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,0]}})", {},
                      {"mem.safetensors", "huge", "overflow"});
  expect_buffer_error(R"({"huge":{"dtype":"I64","shape":[2305843009213693952],"data_offsets":[0,0]}})", {},
                      {"huge", "overflow"});
}

TEST(SafetensorsErrors, OverlappingOffsets) {
  expect_buffer_error(R"({"first":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                      R"("second":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                      std::vector<uint8_t>(12), {"mem.safetensors", "first", "second", "overlap"});
  expect_buffer_error(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},)"
                      R"("y":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                      std::vector<uint8_t>(8), {"x", "y", "overlap"});
  // Adjacent ranges, gaps and empty tensors are fine.
  auto ok = image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},)"
                  R"("b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                  R"("e":{"dtype":"F32","shape":[0],"data_offsets":[2,2]},)"
                  R"("c":{"dtype":"BF16","shape":[1],"data_offsets":[10,12]}})",
                  std::vector<uint8_t>(12));
  SafetensorsBuffer buf(ok.data(), ok.size(), "ok");
  EXPECT_EQ(buf.tensors().size(), 4u);
}

TEST(SafetensorsErrors, OffsetsPastTheEnd) {
  expect_buffer_error(R"({"tail":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", {1, 2, 3, 4},
                      {"mem.safetensors", "tail", "past"});
  expect_buffer_error(R"({"tail":{"dtype":"F32","shape":[0],"data_offsets":[9,9]}})", {1, 2, 3, 4},
                      {"tail", "past"});
  expect_buffer_error(
      R"({"tail":{"dtype":"F32","shape":[1],"data_offsets":[18446744073709551611,18446744073709551615]}})", {},
      {"tail", "past"});
}

TEST(SafetensorsErrors, MetadataMustBeStrings) {
  expect_buffer_error(R"({"__metadata__":{"format":1}})", {}, {"mem.safetensors", "__metadata__", "format"});
  expect_buffer_error(R"({"__metadata__":["pt"]})", {}, {"mem.safetensors", "__metadata__"});
  auto ok = image(R"({"__metadata__":{"format":"pt"}})");
  SafetensorsBuffer buf(ok.data(), ok.size(), "ok");
  EXPECT_EQ(buf.metadata().at("format"), "pt");
  EXPECT_TRUE(buf.tensors().empty());
}

TEST(SafetensorsErrors, DuplicateTensorInHeader) {
  expect_buffer_error(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                      R"("w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                      std::vector<uint8_t>(8), {"mem.safetensors", "w", "twice"});
}

TEST(SafetensorsErrors, ControlCharactersStayOnOneLine) {
  expect_buffer_error("{\"bad\\nname\":{\"dtype\":\"Q4\",\"shape\":[1],\"data_offsets\":[0,4]}}", {0, 0, 0, 0},
                      {"bad\\x0aname", "Q4"});
}

TEST(SafetensorsErrors, WriterRejectsDuplicatesAndOverflow) {
  TempDir dir;
  const std::string path = dir / "w.safetensors";
  float a[2] = {1, 2};
  expect_error([&] { write_safetensors(path, {{"a", DType::F32, {1}, a}, {"a", DType::F32, {1}, a + 1}}); },
               {path, "a", "twice"});
  expect_error([&] { write_safetensors(path, {{"big", DType::F64, {int64_t{1} << 40, int64_t{1} << 40}, a}}); },
               {path, "big"});
  expect_error([&] { write_safetensors(path, {{"neg", DType::F32, {-1}, a}}); }, {path, "neg"});
  EXPECT_TRUE(dir.entries().empty());
}

// ---------------------------------------------------------------------------------------------------------------

TEST(AtomicFile, CommitWritesAndLeavesNoTemporary) {
  TempDir dir;
  const std::string path = dir / "out.txt";
  {
    AtomicFile f(path);
    f.write("hello ");
    f.write("world", 5);
    EXPECT_FALSE(fs::exists(path));  // nothing visible before commit
    f.commit();
  }
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"out.txt"});
  auto raw = read_bytes(path);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(raw.data()), raw.size()), "hello world");
}

TEST(AtomicFile, DestroyedWithoutCommitLeavesNothing) {
  TempDir dir;
  {
    AtomicFile f(dir / "out.txt");
    f.write("partial");
  }
  EXPECT_TRUE(dir.entries().empty());
}

TEST(AtomicFile, ExceptionMidWriteLeavesOldFileUntouched) {
  TempDir dir;
  const std::string path = dir / "out.txt";
  write_text(path, "old contents");
  try {
    AtomicFile f(path);
    f.write("new con");
    throw std::runtime_error("interrupted");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"out.txt"});
  auto raw = read_bytes(path);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(raw.data()), raw.size()), "old contents");
}

TEST(AtomicFile, FailedRenameRemovesTemporary) {
  TempDir dir;
  const std::string path = dir / "target";
  fs::create_directories(path + "/child");  // renaming a file over a non-empty directory fails
  {
    AtomicFile f(path);
    f.write("data");
    expect_error([&] { f.commit(); }, {path});
    expect_error([&] { f.write("more"); }, {path});
  }
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"target"});
  EXPECT_TRUE(fs::is_directory(path));
}

TEST(AtomicFile, UncreatableTemporaryNamesPath) {
  TempDir dir;
  const std::string path = dir / "no/such/dir/out.txt";
  expect_error([&] { AtomicFile f(path); }, {path});
}
