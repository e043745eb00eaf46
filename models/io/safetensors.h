// safetensors files: an 8-byte little-endian header length, a JSON header mapping each
// tensor name to {dtype, shape, data_offsets}, then the raw data. Files are mmapped; a
// TensorInfo points straight into the mapping (no copy). Every offset, shape and dtype is
// validated against the file size when the file is opened, so later reads cannot run past
// the mapping.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/error.h"

namespace kestrel {

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // into the mmapped file; not necessarily aligned
  size_t nbytes = 0;
  std::string file;               // path of the file holding it, for messages

  int64_t numel() const;
  std::string shape_str() const;  // "[512, 4096]"
  // Copies the data out as the given element type (no conversion: dtype must match).
  template <typename T>
  std::vector<T> copy_as() const;
};

// One .safetensors file, mmapped read-only.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);  // throws kestrel::Error
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const TensorInfo* find(const std::string& name) const;

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// All weight files of a model directory: `<base>.safetensors`, or shards listed in
// `<base>.safetensors.index.json` (base = "model", or AutoGPTQ's model_file_base_name).
class ModelFiles {
 public:
  static ModelFiles open(const std::string& dir, const std::string& base_name = "");
  // Whether `dir` holds `<base>.safetensors.index.json` or `<base>.safetensors`.
  static bool has_weights(const std::string& dir, const std::string& base_name = "");

  const TensorInfo* find(const std::string& name) const;
  // Throws kestrel::Error "<dir>: missing tensor <name>".
  const TensorInfo& get(const std::string& name) const;
  std::vector<std::string> names() const;
  const std::string& dir() const { return dir_; }
  // Total bytes of tensor data over all files.
  size_t total_bytes() const;

 private:
  std::string dir_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorInfo*> index_;
};

// Writes a safetensors file without holding all data in memory: declare every tensor first,
// then the writer lays out the header and calls `fill` once per tensor, in declaration
// order, with a buffer of exactly that tensor's bytes to fill.
class SafetensorsWriter {
 public:
  void add(const std::string& name, DType dtype, std::vector<int64_t> shape,
           std::function<void(uint8_t* dst, size_t nbytes)> fill);
  // Convenience: copies `nbytes` from `src` (which must stay alive until write()).
  void add_data(const std::string& name, DType dtype, std::vector<int64_t> shape, const void* src);
  void set_metadata(const std::string& key, const std::string& value);
  size_t total_bytes() const;
  // Writes one file. Throws kestrel::Error on I/O failure.
  void write(const std::string& path);
  // Writes `<dir>/model.safetensors`, or when the data exceeds max_shard_bytes, shards
  // `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`.
  void write_model(const std::string& dir, size_t max_shard_bytes = size_t(5) << 30);

 private:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    std::function<void(uint8_t*, size_t)> fill;
    size_t nbytes;
  };
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

template <typename T>
std::vector<T> TensorInfo::copy_as() const {
  if (sizeof(T) != dtype_size(dtype))
    throw Error(name + " in " + file + ": cannot read " + dtype_name(dtype) + " data as a " +
                std::to_string(sizeof(T)) + "-byte type");
  std::vector<T> out(nbytes / sizeof(T));
  if (nbytes) std::memcpy(out.data(), data, nbytes);  // memcpy: data may be unaligned
  return out;
}

}  // namespace kestrel
