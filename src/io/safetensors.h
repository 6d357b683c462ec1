// safetensors reader (one file or a sharded hub checkpoint, memory-mapped) and atomic writer.
// Format: 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets}, "__metadata__"},
// then the data block; offsets are relative to the data block. Matches huggingface/safetensors.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace nextlm {

enum class DType { F32, F64, BF16, F16, I32, I64 };

size_t dtype_size(DType dt);
const char* dtype_name(DType dt);  // "F32", "BF16", ...

// One tensor inside a mapped file. `data` points into the mapping and lives as long as its file.
struct TensorView {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const std::byte* data = nullptr;
  size_t nbytes = 0;
  std::string file;  // path of the file holding it, for messages

  int64_t numel() const;
};

// Converts a floating tensor (F32, F64, BF16, F16) to fp32; integer dtypes are an Error naming the tensor.
std::vector<float> to_f32(const TensorView& t);
// Converts bf16 / f16 bit patterns to fp32 (exact) and fp32 to bf16 (round to nearest even).
float bf16_to_f32(uint16_t bits);
float f16_to_f32(uint16_t bits);
uint16_t f32_to_bf16(float f);

// A parsed safetensors byte buffer. Validates: the file holds at least 8 bytes; the header length fits in the file
// and is at most 100 MB; the header is a JSON object; every entry has a known dtype, a non-negative shape and
// data_offsets [begin, end] with end - begin == numel * dtype size, inside the data block, in order and not
// overlapping; "__metadata__" is an object of strings. Every error names the file (and the tensor).
class SafetensorsBuffer {
 public:
  // Parses `size` bytes at `data`, which must outlive this object. `label` names the source in errors.
  SafetensorsBuffer(const std::byte* data, size_t size, std::string label);

  const std::vector<TensorView>& tensors() const { return tensors_; }
  const TensorView* find(const std::string& name) const;  // nullptr when absent
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  std::vector<TensorView> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// A memory-mapped safetensors file.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);  // throws Error naming the path
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const SafetensorsBuffer& buffer() const { return *buffer_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t size_ = 0;
  std::unique_ptr<SafetensorsBuffer> buffer_;
};

// A hub checkpoint directory: `model.safetensors`, or shards listed by `model.safetensors.index.json`
// (its "weight_map" names the shard of every tensor; each listed tensor must be in its shard, and no shard may
// hold a tensor twice across the set).
class Checkpoint {
 public:
  explicit Checkpoint(const std::string& dir);  // throws Error

  const TensorView* find(const std::string& name) const;  // nullptr when absent
  std::vector<std::string> names() const;                 // sorted
  const std::string& dir() const { return dir_; }
  size_t num_files() const { return files_.size(); }

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*> by_name_;
};

// A tensor to write. `data` holds numel * dtype_size bytes in the given dtype.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
};

// Writes a safetensors file atomically: into `path.tmp.<pid>`, fsync, then rename over `path`. On any failure the
// temporary file is removed and `path` is left untouched. Tensor names must be unique.
void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace nextlm
