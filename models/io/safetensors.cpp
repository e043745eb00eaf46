#include "models/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "base/error.h"
#include "base/files.h"
#include "models/io/json_fields.h"

namespace kestrel {

namespace fs = std::filesystem;
using json = nlohmann::json;

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorInfo::shape_str() const { return fmt::format("[{}]", fmt::join(shape, ", ")); }

namespace {

bool parse_dtype(const std::string& s, DType* out) {
  static const std::pair<const char*, DType> kTypes[] = {
      {"F16", DType::F16}, {"BF16", DType::BF16}, {"F32", DType::F32}, {"I32", DType::I32}};
  for (const auto& [name, t] : kTypes) {
    if (s == name) {
      *out = t;
      return true;
    }
  }
  return false;
}

// Parses one header entry and checks it against the data area of `data_size` bytes.
TensorInfo parse_entry(const std::string& path, const std::string& name, const json& e,
                       const uint8_t* data, size_t data_size) {
  const std::string where = fmt::format("{}: tensor {}", path, name);
  KESTREL_CHECK(e.is_object(), where + ": header entry is not an object");
  KESTREL_CHECK(e.contains("dtype") && e["dtype"].is_string(), where + ": missing dtype");
  KESTREL_CHECK(e.contains("shape") && e["shape"].is_array(), where + ": missing shape");
  KESTREL_CHECK(e.contains("data_offsets") && e["data_offsets"].is_array() &&
                    e["data_offsets"].size() == 2,
                where + ": missing data_offsets [begin, end]");

  TensorInfo t;
  t.name = name;
  t.file = path;
  const std::string dtype = e["dtype"].get<std::string>();
  KESTREL_CHECK(parse_dtype(dtype, &t.dtype),
                fmt::format("{} has unsupported dtype {} (supported: F16, BF16, F32, I32)", where,
                            dtype));

  uint64_t numel = 1;
  for (const json& d : e["shape"]) {
    KESTREL_CHECK(d.is_number_unsigned(),
                  fmt::format("{}: shape {} holds a non-integer or negative dimension", where,
                              e["shape"].dump()));
    t.shape.push_back((int64_t)d.get<uint64_t>());
    KESTREL_CHECK(!__builtin_mul_overflow(numel, d.get<uint64_t>(), &numel),
                  fmt::format("{}: shape {} overflows", where, e["shape"].dump()));
  }
  uint64_t need = 0;
  KESTREL_CHECK(!__builtin_mul_overflow(numel, (uint64_t)dtype_size(t.dtype), &need),
                fmt::format("{}: shape {} overflows", where, e["shape"].dump()));

  const json& off = e["data_offsets"];
  KESTREL_CHECK(off[0].is_number_unsigned() && off[1].is_number_unsigned(),
                fmt::format("{}: data_offsets {} are not non-negative integers", where, off.dump()));
  const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
  KESTREL_CHECK(begin <= end,
                fmt::format("{}: data_offsets [{}, {}] begin after end", where, begin, end));
  KESTREL_CHECK(end <= data_size,
                fmt::format("{}: data_offsets [{}, {}] run past the end of the data area ({} bytes)",
                            where, begin, end, data_size));
  KESTREL_CHECK(end - begin == need,
                fmt::format("{}: shape {} {} needs {} bytes but data_offsets [{}, {}] span {}",
                            where, t.shape_str(), dtype, need, begin, end, end - begin));
  t.data = data + begin;
  t.nbytes = need;
  return t;
}

// Each byte of the data area belongs to one tensor at most: two tensors whose data_offsets
// overlap would alias each other's weights.
void check_no_overlap(const std::string& path, const std::map<std::string, TensorInfo>& tensors,
                      const uint8_t* data) {
  std::vector<const TensorInfo*> byoffset;
  for (const auto& [name, t] : tensors)
    if (t.nbytes) byoffset.push_back(&t);  // an empty tensor occupies no bytes
  std::sort(byoffset.begin(), byoffset.end(),
            [](const TensorInfo* a, const TensorInfo* b) { return a->data < b->data; });
  for (size_t i = 1; i < byoffset.size(); ++i) {
    const TensorInfo& a = *byoffset[i - 1];
    const TensorInfo& b = *byoffset[i];
    if (b.data < a.data + a.nbytes) {
      const size_t ab = (size_t)(a.data - data), bb = (size_t)(b.data - data);
      throw Error(fmt::format("{}: tensors {} and {} overlap (data_offsets [{}, {}] and [{}, {}])",
                              path, a.name, b.name, ab, ab + a.nbytes, bb, bb + b.nbytes));
    }
  }
}

}  // namespace

// The safetensors format caps its JSON header at 100 MB (the reference library refuses more).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  size_t size = 0;
  const int fd = open_regular_file(path, &size);
  // Messages about a file that may not be a safetensors file at all (a shard name pointing
  // at some other file) never quote its bytes: they say what is wrong in words.
  if (size < 8) {
    ::close(fd);
    throw Error(fmt::format("{} is not a safetensors file (it is {} bytes, too short for the "
                            "8-byte header length)", path, size));
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);  // the mapping stays valid without the descriptor
  KESTREL_CHECK(map != MAP_FAILED, fmt::format("{}: cannot map into memory ({})", path,
                                               std::strerror(map_err)));
  map_ = map;
  map_size_ = size;

  // The destructor does not run when the constructor throws: unmap here.
  try {
    const auto* bytes = static_cast<const uint8_t*>(map_);
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; --i) header_len = header_len << 8 | bytes[i];
    // The header is a JSON object: it starts with '{'. Past the end of the file, a length
    // followed by '{' is a safetensors file cut short; anything else is some other file.
    const bool json_follows = size > 8 && bytes[8] == '{';
    if (header_len == 0 || header_len > kMaxHeaderBytes ||
        (header_len > size - 8 && !json_follows)) {
      throw Error(fmt::format("{} is not a safetensors file (its header length field is "
                              "implausible)", path));
    }
    KESTREL_CHECK(header_len <= size - 8,
                  fmt::format("{}: the safetensors header runs past the end of the file ({} "
                              "bytes); the file is truncated", path, size));
    KESTREL_CHECK(json_follows, fmt::format("{} is not a safetensors file (its header is not a "
                                            "JSON object)", path));
    json header;
    try {
      header = json::parse(bytes + 8, bytes + 8 + header_len);
    } catch (const json::parse_error& e) {
      throw Error(fmt::format("{}: the safetensors header is not valid JSON{}", path,
                              e.byte <= header_len
                                  ? fmt::format(" (error at byte {} of the header)", e.byte)
                                  : std::string(" (it ends early)")));
    } catch (const json::out_of_range&) {  // a number past any representable value
      throw Error(fmt::format("{}: the safetensors header is not valid JSON (a number too large "
                              "to represent)", path));
    }
    KESTREL_CHECK(header.is_object(),
                  fmt::format("{}: the safetensors header is a JSON {}, not an object", path,
                              header.type_name()));

    const uint8_t* data = bytes + 8 + header_len;
    const size_t data_size = size - 8 - header_len;
    for (const auto& [name, entry] : header.items()) {
      if (name == "__metadata__") {
        KESTREL_CHECK(entry.is_object(), path + ": __metadata__ is not an object");
        for (const auto& [k, v] : entry.items()) {
          KESTREL_CHECK(v.is_string(),
                        fmt::format("{}: __metadata__ value of {} is not a string", path, k));
          metadata_[k] = v.get<std::string>();
        }
        continue;
      }
      tensors_.emplace(name, parse_entry(path, name, entry, data, data_size));
    }
    check_no_overlap(path, tensors_, data);
  } catch (...) {
    ::munmap(map_, map_size_);
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, map_size_);
}

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

// ---------------------------------------------------------------------------------------------

namespace {

std::string base_or_model(const std::string& base) { return base.empty() ? "model" : base; }

}  // namespace

bool ModelFiles::has_weights(const std::string& dir, const std::string& base_name) {
  const std::string base = base_or_model(base_name);
  return path_exists((fs::path(dir) / (base + ".safetensors.index.json")).string()) ||
         path_exists((fs::path(dir) / (base + ".safetensors")).string());
}

namespace {

// Why a weight_map file name leads outside the model directory `root` (canonical), or "".
// Files of a Hugging Face cache snapshot (<repo>/snapshots/<revision>/) are symlinks into the
// repository's blobs/ folder, and may lead there.
std::string escapes(const fs::path& root, const std::string& fname) {
  const fs::path name(fname);
  if (name.is_absolute()) return "an absolute path";
  for (const fs::path& part : name)
    if (part == "..") return "a .. component";
  std::error_code ec;
  const fs::path target = fs::weakly_canonical(root / name, ec);
  if (ec) return "";  // nothing there: the caller says so
  auto inside = [&](const fs::path& folder) {
    const auto [f, t] = std::mismatch(folder.begin(), folder.end(), target.begin(), target.end());
    return f == folder.end();
  };
  if (inside(root)) return "";
  if (root.parent_path().filename() == "snapshots" &&
      inside(root.parent_path().parent_path() / "blobs"))
    return "";
  return "a symlink to " + target.string();
}

}  // namespace

ModelFiles ModelFiles::open(const std::string& dir, const std::string& base_name) {
  std::error_code ec;
  KESTREL_CHECK(fs::is_directory(dir, ec), fmt::format("{}: no such directory", dir));
  const std::string base = base_or_model(base_name);
  const fs::path index_path = fs::path(dir) / (base + ".safetensors.index.json");
  const fs::path single_path = fs::path(dir) / (base + ".safetensors");

  ModelFiles mf;
  mf.dir_ = dir;
  if (path_exists(index_path.string())) {
    const std::string ip = index_path.string();
    const json_fields::json index = json_fields::parse_json(read_regular_file(ip), ip);
    KESTREL_CHECK(index.is_object() && index.contains("weight_map") &&
                      index["weight_map"].is_object(),
                  fmt::format("{}: missing weight_map object", ip));
    const fs::path root = fs::canonical(dir, ec);
    KESTREL_CHECK(!ec, fmt::format("{}: cannot resolve the directory's path ({})", dir, ec.message()));
    std::map<std::string, std::shared_ptr<SafetensorsFile>> shards;  // each opened once
    for (const auto& [name, file] : index["weight_map"].items()) {
      KESTREL_CHECK(file.is_string(),
                    fmt::format("{}: weight_map entry of {} is not a file name", ip, name));
      const std::string fname = file.get<std::string>();
      auto& shard = shards[fname];
      if (!shard) {
        const std::string why = escapes(root, fname);
        KESTREL_CHECK(why.empty(),
                      fmt::format("{}: weight_map entry {}: {} leads outside the model directory "
                                  "({})", ip, name, fname, why));
        const fs::path sp = fs::path(dir) / fname;
        KESTREL_CHECK(path_exists(sp.string()),
                      fmt::format("{}: shard {} (holding {}) does not exist", ip, fname, name));
        shard = std::make_shared<SafetensorsFile>(sp.string());
        mf.files_.push_back(shard);
      }
      const TensorInfo* t = shard->find(name);
      KESTREL_CHECK(t, fmt::format("{}: weight_map puts {} in {}, which has no such tensor", ip,
                                   name, fname));
      mf.index_[name] = t;
    }
    return mf;
  }
  if (path_exists(single_path.string())) {
    auto f = std::make_shared<SafetensorsFile>(single_path.string());
    for (const auto& [name, t] : f->tensors()) mf.index_[name] = &t;
    mf.files_.push_back(std::move(f));
    return mf;
  }
  throw Error(fmt::format("{}: no {}.safetensors or {}.safetensors.index.json", dir, base, base));
}

const TensorInfo* ModelFiles::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : it->second;
}

const TensorInfo& ModelFiles::get(const std::string& name) const {
  const TensorInfo* t = find(name);
  KESTREL_CHECK(t, fmt::format("{}: missing tensor {}", dir_, name));
  return *t;
}

std::vector<std::string> ModelFiles::names() const {
  std::vector<std::string> out;
  out.reserve(index_.size());
  for (const auto& [name, t] : index_) out.push_back(name);
  return out;
}

size_t ModelFiles::total_bytes() const {
  size_t n = 0;
  for (const auto& [name, t] : index_) n += t->nbytes;
  return n;
}

// ---------------------------------------------------------------------------------------------

void SafetensorsWriter::add(const std::string& name, DType dtype, std::vector<int64_t> shape,
                            std::function<void(uint8_t* dst, size_t nbytes)> fill) {
  KESTREL_CHECK(name != "__metadata__", "safetensors writer: __metadata__ is not a tensor name");
  for (const Entry& e : entries_)
    KESTREL_CHECK(e.name != name, fmt::format("safetensors writer: tensor {} added twice", name));
  size_t n = dtype_size(dtype);
  for (int64_t d : shape)
    KESTREL_CHECK(d >= 0, fmt::format("safetensors writer: tensor {} has negative dimension {}",
                                      name, d));
  for (int64_t d : shape) n *= (size_t)d;
  entries_.push_back(Entry{name, dtype, std::move(shape), std::move(fill), n});
}

void SafetensorsWriter::add_data(const std::string& name, DType dtype, std::vector<int64_t> shape,
                                 const void* src) {
  add(name, dtype, std::move(shape), [src](uint8_t* dst, size_t nbytes) {
    if (nbytes) std::memcpy(dst, src, nbytes);
  });
}

void SafetensorsWriter::set_metadata(const std::string& key, const std::string& value) {
  metadata_[key] = value;
}

size_t SafetensorsWriter::total_bytes() const {
  size_t n = 0;
  for (const Entry& e : entries_) n += e.nbytes;
  return n;
}

namespace {

// Owns the FILE* of a file being written; an unfinished file is removed so that a failed
// write never leaves a truncated checkpoint behind.
class OutFile {
 public:
  explicit OutFile(std::string path) : path_(std::move(path)) {
    f_ = std::fopen(path_.c_str(), "wb");
    KESTREL_CHECK(f_, fmt::format("{}: cannot create: {}", path_, std::strerror(errno)));
  }
  ~OutFile() {
    if (f_) {
      std::fclose(f_);
      std::remove(path_.c_str());
    }
  }
  void write(const void* p, size_t n) {
    if (n && std::fwrite(p, 1, n, f_) != n)
      throw Error(fmt::format("{}: write failed: {}", path_, std::strerror(errno)));
  }
  void close() {
    FILE* f = f_;
    f_ = nullptr;
    if (std::fclose(f) != 0) {
      const int err = errno;
      std::remove(path_.c_str());
      throw Error(fmt::format("{}: write failed: {}", path_, std::strerror(err)));
    }
  }

 private:
  std::string path_;
  FILE* f_ = nullptr;
};

}  // namespace

void SafetensorsWriter::write(const std::string& path) {
  json header = json::object();
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  size_t offset = 0, largest = 0;
  // Tensors lie back to back in declaration order: readers such as the reference safetensors
  // library reject holes between them.
  for (const Entry& e : entries_) {
    header[e.name] = {{"dtype", dtype_name(e.dtype)},
                      {"shape", e.shape},
                      {"data_offsets", {offset, offset + e.nbytes}}};
    offset += e.nbytes;
    largest = std::max(largest, e.nbytes);
  }
  std::string text = header.dump();
  // Padding the header to 8 bytes puts the data area at an 8-aligned file offset.
  text.append((8 - text.size() % 8) % 8, ' ');
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = (uint8_t)((uint64_t)text.size() >> (8 * i));

  OutFile out(path);
  out.write(len, 8);
  out.write(text.data(), text.size());
  std::vector<uint8_t> buf;  // reused for every tensor: one tensor in memory at a time
  buf.reserve(largest);
  for (const Entry& e : entries_) {
    buf.assign(e.nbytes, 0);
    e.fill(buf.data(), e.nbytes);
    out.write(buf.data(), e.nbytes);
  }
  out.close();
}

void SafetensorsWriter::write_model(const std::string& dir, size_t max_shard_bytes) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  KESTREL_CHECK(fs::is_directory(dir), fmt::format("{}: cannot create directory: {}", dir,
                                                   ec ? ec.message() : "not a directory"));
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  const fs::path single_path = fs::path(dir) / "model.safetensors";

  // transformers refuses safetensors weights whose metadata lacks a framework format.
  std::map<std::string, std::string> metadata = metadata_;
  metadata.emplace("format", "pt");

  const size_t total = total_bytes();
  if (total <= max_shard_bytes) {
    SafetensorsWriter w = *this;
    w.metadata_ = metadata;
    w.write(single_path.string());
    // A stale index from an earlier sharded write would take precedence over the new file.
    fs::remove(index_path, ec);
    return;
  }

  // Greedy split in declaration order; a tensor larger than the limit gets a shard of its own.
  std::vector<std::vector<size_t>> shards;
  size_t current = 0;
  for (size_t i = 0; i < entries_.size(); ++i) {
    if (shards.empty() || (current > 0 && current + entries_[i].nbytes > max_shard_bytes)) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().push_back(i);
    current += entries_[i].nbytes;
  }

  json weight_map = json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string fname = fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards.size());
    SafetensorsWriter w;
    w.metadata_ = metadata;
    for (size_t i : shards[s]) {
      w.entries_.push_back(entries_[i]);
      weight_map[entries_[i].name] = fname;
    }
    w.write((fs::path(dir) / fname).string());
  }
  const json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  const std::string text = index.dump(2) + "\n";
  OutFile out(index_path.string());
  out.write(text.data(), text.size());
  out.close();
  fs::remove(single_path, ec);
}

}  // namespace kestrel
