#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace tpmoe::io {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string join_shape(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

int64_t product(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Stored data need not be aligned (offsets are arbitrary), so every element read goes through memcpy.
template <typename T>
T load(const std::byte* p, size_t i) {
  T v;
  std::memcpy(&v, p + i * sizeof(T), sizeof(T));
  return v;
}

template <typename T>
void store(std::byte* p, size_t i, T v) {
  std::memcpy(p + i * sizeof(T), &v, sizeof(T));
}

// Round to nearest even; overflow goes to inf, NaN stays NaN.
uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  const uint32_t mag = x & 0x7fffffffu;
  if (mag > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (mag >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds past the largest half (65504)
  if (mag < 0x38800000u) {                        // below 2^-14: a half subnormal, in units of 2^-24
    return sign | uint16_t(std::nearbyint(std::fabs(f) * 16777216.0f));
  }
  uint32_t r = mag - 0x38000000u;  // rebias the exponent from 127 to 15
  r += 0xfffu + ((r >> 13) & 1u);  // a carry into the exponent is the correct rounding
  return sign | uint16_t(r >> 13);
}

// Reads a JSON value that must be a non-negative integer (nlohmann stores those as unsigned).
bool as_u64(const json& v, uint64_t* out) {
  if (!v.is_number_unsigned()) return false;
  *out = v.get<uint64_t>();
  return true;
}

HeaderEntry parse_entry(const std::string& origin, const std::string& name, const json& info, uint64_t data_size) {
  TPMOE_CHECK(info.is_object(), "{}: tensor '{}': header entry is a JSON {}, not an object", origin, name,
              info.type_name());
  HeaderEntry e;
  e.name = name;

  auto dt = info.find("dtype");
  TPMOE_CHECK(dt != info.end() && dt->is_string(), "{}: tensor '{}': missing or non-string \"dtype\"", origin, name);
  auto dtype = parse_dtype(dt->get_ref<const std::string&>());
  TPMOE_CHECK(dtype.has_value(), "{}: tensor '{}': unknown dtype \"{}\"", origin, name,
              dt->get_ref<const std::string&>());
  e.dtype = *dtype;

  auto sh = info.find("shape");
  TPMOE_CHECK(sh != info.end() && sh->is_array(), "{}: tensor '{}': missing or non-array \"shape\"", origin, name);
  // The product of the non-zero dimensions times the element size must fit in int64: then no
  // sub-product taken later (numel, row strides, nbytes) can overflow, even for empty tensors.
  uint64_t nonzero_bytes = dtype_size(e.dtype);
  bool empty = false;
  for (const json& d : *sh) {
    uint64_t v = 0;
    TPMOE_CHECK(as_u64(d, &v) && v <= uint64_t(std::numeric_limits<int64_t>::max()),
                "{}: tensor '{}': shape entries must be non-negative integers", origin, name);
    e.shape.push_back(int64_t(v));
    if (v == 0) {
      empty = true;
      continue;
    }
    TPMOE_CHECK(!__builtin_mul_overflow(nonzero_bytes, v, &nonzero_bytes) &&
                    nonzero_bytes <= uint64_t(std::numeric_limits<int64_t>::max()),
                "{}: tensor '{}': shape {} overflows (its byte size does not fit in 64 bits)", origin, name,
                join_shape(e.shape));
  }
  const uint64_t nbytes = empty ? 0 : nonzero_bytes;

  auto off = info.find("data_offsets");
  TPMOE_CHECK(off != info.end() && off->is_array() && off->size() == 2 && as_u64((*off)[0], &e.begin) &&
                  as_u64((*off)[1], &e.end),
              "{}: tensor '{}': \"data_offsets\" must be [begin, end] of non-negative integers", origin, name);
  TPMOE_CHECK(e.begin <= e.end && e.end <= data_size,
              "{}: tensor '{}': data_offsets [{}, {}] lie outside the data area ({} bytes)", origin, name, e.begin,
              e.end, data_size);
  TPMOE_CHECK(e.end - e.begin == nbytes, "{}: tensor '{}': data_offsets [{}, {}] hold {} bytes but {} {} needs {}",
              origin, name, e.begin, e.end, e.end - e.begin, dtype_name(e.dtype), join_shape(e.shape), nbytes);
  return e;
}

std::string errno_text() { return std::strerror(errno); }

}  // namespace

// ---- TensorView ----------------------------------------------------------------------------------

int64_t TensorView::numel() const { return product(shape); }

TensorView TensorView::index(int64_t i) const {
  TPMOE_CHECK(!shape.empty(), "{}: tensor '{}' is a scalar and cannot be indexed", file, name);
  TPMOE_CHECK(i >= 0 && i < shape[0], "{}: tensor '{}': index {} out of range for shape {}", file, name, i,
              shape_str());
  TensorView v = *this;
  v.name = fmt::format("{}[{}]", name, i);
  v.shape.erase(v.shape.begin());
  v.data = data + size_t(i) * v.nbytes();
  if (scale) v.scale = scale + size_t(i) * size_t(v.numel() / v.shape.back()) * size_t(v.scale_row_bytes());
  return v;
}

TensorView TensorView::rows(int64_t start, int64_t count) const {
  TPMOE_CHECK(!shape.empty(), "{}: tensor '{}' is a scalar and has no rows", file, name);
  TPMOE_CHECK(start >= 0 && count >= 0 && start <= shape[0] && count <= shape[0] - start,
              "{}: tensor '{}': rows [{}, {}+{}) out of range for shape {}", file, name, start, start, count,
              shape_str());
  TensorView v = *this;
  v.name = fmt::format("{}[{}:{}]", name, start, start + count);
  v.shape[0] = 1;
  const size_t row_bytes = v.nbytes();
  const int64_t row_numel = v.numel();
  v.shape[0] = count;
  v.data = data + size_t(start) * row_bytes;
  if (scale) v.scale = scale + size_t(start) * size_t(row_numel / v.shape.back()) * size_t(v.scale_row_bytes());
  return v;
}

std::string TensorView::shape_str() const { return join_shape(shape); }

// ---- header parsing ------------------------------------------------------------------------------

ParsedHeader parse_safetensors_header(std::span<const std::byte> bytes, const std::string& origin) {
  const uint64_t file_size = bytes.size();
  TPMOE_CHECK(file_size >= 8, "{}: file is {} bytes, too short for a safetensors header length (8 bytes)", origin,
              file_size);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | std::to_integer<uint64_t>(bytes[size_t(i)]);
  TPMOE_CHECK(n <= file_size - 8, "{}: header length {} runs past the end of the file ({} bytes)", origin, n,
              file_size);

  ParsedHeader out;
  out.data_start = 8 + n;
  const uint64_t data_size = file_size - out.data_start;

  // nlohmann keeps the last of duplicate keys silently; a tensor named twice is ambiguous (another
  // reader may take the first), so reject it while parsing.
  std::set<std::string> seen;
  auto reject_duplicates = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1) {
      const auto& key = parsed.get_ref<const std::string&>();
      TPMOE_CHECK(seen.insert(key).second, "{}: tensor '{}' appears twice in the header", origin, key);
    }
    return true;
  };
  json header;
  try {
    const char* text = reinterpret_cast<const char*>(bytes.data() + 8);
    header = json::parse(text, text + n, reject_duplicates);
  } catch (const json::exception& e) {
    TPMOE_FAIL("{}: header is not valid JSON: {}", origin, e.what());
  }
  TPMOE_CHECK(header.is_object(), "{}: header is a JSON {}, not an object", origin, header.type_name());

  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") {
      TPMOE_CHECK(info.is_object(), "{}: __metadata__ is a JSON {}, not an object", origin, info.type_name());
      for (const auto& [key, value] : info.items()) {
        TPMOE_CHECK(value.is_string(), "{}: __metadata__ entry '{}' is a JSON {}, not a string", origin, key,
                    value.type_name());
        out.metadata[key] = value.get<std::string>();
      }
      continue;
    }
    out.entries.push_back(parse_entry(origin, name, info, data_size));
  }

  // Overlap check: sort non-empty tensors by begin; each must start at or after the furthest end seen.
  std::vector<const HeaderEntry*> by_begin;
  for (const auto& e : out.entries)
    if (e.end > e.begin) by_begin.push_back(&e);
  std::sort(by_begin.begin(), by_begin.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
  const HeaderEntry* furthest = nullptr;
  for (const HeaderEntry* e : by_begin) {
    TPMOE_CHECK(!furthest || e->begin >= furthest->end,
                "{}: tensor '{}' (bytes [{}, {})) overlaps tensor '{}' (bytes [{}, {}))", origin, e->name, e->begin,
                e->end, furthest->name, furthest->begin, furthest->end);
    if (!furthest || e->end > furthest->end) furthest = e;
  }
  return out;
}

// ---- SafetensorsFile ------------------------------------------------------------------------------

std::unique_ptr<SafetensorsFile> SafetensorsFile::open(const fs::path& path) {
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path.string();
  const int fd = ::open(f->path_.c_str(), O_RDONLY | O_CLOEXEC);
  TPMOE_CHECK(fd >= 0, "{}: cannot open safetensors file: {}", f->path_, errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const std::string why = errno_text();
    ::close(fd);
    TPMOE_FAIL("{}: cannot stat safetensors file: {}", f->path_, why);
  }
  if (!S_ISREG(st.st_mode) || st.st_size == 0) {
    ::close(fd);
    TPMOE_FAIL("{}: {}", f->path_, S_ISREG(st.st_mode) ? "safetensors file is empty" : "not a regular file");
  }
  void* map = ::mmap(nullptr, size_t(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
  const std::string why = errno_text();
  ::close(fd);  // the mapping keeps the file alive
  TPMOE_CHECK(map != MAP_FAILED, "{}: cannot mmap safetensors file: {}", f->path_, why);
  f->map_ = map;
  f->map_size_ = size_t(st.st_size);

  const auto* base = static_cast<const std::byte*>(map);
  ParsedHeader h = parse_safetensors_header({base, f->map_size_}, f->path_);
  f->metadata_ = std::move(h.metadata);
  f->tensors_.reserve(h.entries.size());
  for (auto& e : h.entries) {
    f->by_name_[e.name] = f->tensors_.size();
    f->tensors_.push_back(
        TensorView{std::move(e.name), f->path_, e.dtype, std::move(e.shape), base + h.data_start + e.begin});
  }
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, map_size_);
}

const TensorView* SafetensorsFile::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

// ---- SafetensorsSet -------------------------------------------------------------------------------

namespace {

// Adds every tensor of `file` to `by_name`; a name already present (from another shard) is an error.
void add_tensors(const SafetensorsFile& file, std::map<std::string, const TensorView*>& by_name) {
  for (const auto& t : file.tensors()) {
    auto [it, inserted] = by_name.emplace(t.name, &t);
    TPMOE_CHECK(inserted, "tensor '{}' appears in two shards: {} and {}", t.name, it->second->file, file.path());
  }
}

json read_json_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  TPMOE_CHECK(in, "{}: cannot open: {}", path.string(), errno_text());
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    return json::parse(ss.str());
  } catch (const json::exception& e) {
    TPMOE_FAIL("{}: not valid JSON: {}", path.string(), e.what());
  }
}

}  // namespace

SafetensorsSet SafetensorsSet::open_file(const fs::path& file) {
  SafetensorsSet set;
  set.files_.push_back(SafetensorsFile::open(file));
  add_tensors(*set.files_.back(), set.by_name_);
  return set;
}

SafetensorsSet SafetensorsSet::open_dir(const fs::path& dir) {
  const fs::path index_path = dir / "model.safetensors.index.json";
  const std::string index = index_path.string();
  std::error_code ec;  // exists() overloads without ec throw filesystem_error, not tpmoe::Error
  if (!fs::exists(index_path, ec)) {
    const fs::path single = dir / "model.safetensors";
    TPMOE_CHECK(fs::exists(single, ec), "{}: no model.safetensors or model.safetensors.index.json in this directory",
                dir.string());
    return open_file(single);
  }

  const json doc = read_json_file(index_path);
  TPMOE_CHECK(doc.is_object() && doc.contains("weight_map") && doc["weight_map"].is_object(),
              "{}: missing \"weight_map\" object", index);
  std::map<std::string, std::vector<std::string>> by_shard;  // shard file -> tensors the index puts there
  for (const auto& [tensor, shard] : doc["weight_map"].items()) {
    TPMOE_CHECK(shard.is_string(), "{}: weight_map entry for tensor '{}' is not a string", index, tensor);
    by_shard[shard.get<std::string>()].push_back(tensor);
  }

  SafetensorsSet set;
  for (const auto& [shard, tensors] : by_shard) {
    // The index is untrusted too: shard names are plain file names inside `dir`.
    TPMOE_CHECK(!shard.empty() && shard.find('/') == std::string::npos && shard != "." && shard != "..",
                "{}: shard name '{}' (for tensor '{}') is not a plain file name", index, shard, tensors.front());
    const fs::path shard_path = dir / shard;
    TPMOE_CHECK(fs::exists(shard_path, ec), "{}: shard '{}' (for tensor '{}') does not exist: {}", index, shard,
                tensors.front(), shard_path.string());
    set.files_.push_back(SafetensorsFile::open(shard_path));
    const SafetensorsFile& file = *set.files_.back();
    for (const auto& t : tensors)
      TPMOE_CHECK(file.find(t), "{}: tensor '{}' is listed in shard '{}', but {} has no such tensor", index, t, shard,
                  file.path());
    add_tensors(file, set.by_name_);
  }
  return set;
}

const TensorView* SafetensorsSet::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

std::vector<std::string> SafetensorsSet::names() const {
  std::vector<std::string> out;
  out.reserve(by_name_.size());
  for (const auto& [name, view] : by_name_) out.push_back(name);
  return out;
}

// ---- OwnedTensor and conversions --------------------------------------------------------------------

int64_t OwnedTensor::numel() const { return product(shape); }

OwnedTensor OwnedTensor::from_f32(std::vector<int64_t> shape, std::span<const float> values, DType dtype) {
  OwnedTensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  TPMOE_CHECK(size_t(t.numel()) == values.size(), "OwnedTensor::from_f32: shape {} needs {} values, got {}",
              join_shape(t.shape), t.numel(), values.size());
  t.bytes.resize(values.size() * dtype_size(dtype));
  std::byte* p = t.bytes.data();
  for (size_t i = 0; i < values.size(); ++i) {
    switch (dtype) {
      case DType::kBF16: store(p, i, f32_to_bf16(values[i])); break;
      case DType::kF16: store(p, i, f32_to_f16(values[i])); break;
      case DType::kF32: store(p, i, values[i]); break;
      case DType::kF64: store(p, i, double(values[i])); break;
      default: TPMOE_FAIL("OwnedTensor::from_f32: cannot store floats as {}", dtype_name(dtype));
    }
  }
  return t;
}

OwnedTensor OwnedTensor::from_i64(std::vector<int64_t> shape, std::span<const int64_t> values) {
  OwnedTensor t;
  t.dtype = DType::kI64;
  t.shape = std::move(shape);
  TPMOE_CHECK(size_t(t.numel()) == values.size(), "OwnedTensor::from_i64: shape {} needs {} values, got {}",
              join_shape(t.shape), t.numel(), values.size());
  t.bytes.resize(values.size() * sizeof(int64_t));
  if (!values.empty()) std::memcpy(t.bytes.data(), values.data(), t.bytes.size());
  return t;
}

OwnedTensor OwnedTensor::copy_of(const TensorView& view) {
  OwnedTensor t;
  t.dtype = view.dtype;
  t.shape = view.shape;
  t.bytes.assign(view.data, view.data + view.nbytes());
  return t;
}

std::vector<float> OwnedTensor::to_f32() const {
  TensorView v{"<owned>", "<memory>", dtype, shape, bytes.data()};
  TPMOE_CHECK(bytes.size() == v.nbytes(), "OwnedTensor::to_f32: {} bytes for {} {} (expected {})", bytes.size(),
              dtype_name(dtype), join_shape(shape), v.nbytes());
  return io::to_f32(v);
}

std::vector<float> to_f32(const TensorView& view) {
  const size_t n = size_t(view.numel());
  std::vector<float> out(n);
  const std::byte* p = view.data;
  switch (view.dtype) {
    case DType::kBF16:
      for (size_t i = 0; i < n; ++i) out[i] = bf16_to_f32(load<uint16_t>(p, i));
      break;
    case DType::kF16:
      for (size_t i = 0; i < n; ++i) out[i] = f16_to_f32(load<uint16_t>(p, i));
      break;
    case DType::kF32:
      for (size_t i = 0; i < n; ++i) out[i] = load<float>(p, i);
      break;
    case DType::kF64:
      for (size_t i = 0; i < n; ++i) out[i] = float(load<double>(p, i));
      break;
    default:
      TPMOE_FAIL("{}: tensor '{}' is {}, not a floating-point type", view.file, view.name, dtype_name(view.dtype));
  }
  return out;
}

std::vector<int64_t> to_i64(const TensorView& view) {
  const size_t n = size_t(view.numel());
  std::vector<int64_t> out(n);
  switch (view.dtype) {
    case DType::kI64:
      for (size_t i = 0; i < n; ++i) out[i] = load<int64_t>(view.data, i);
      break;
    case DType::kI32:
      for (size_t i = 0; i < n; ++i) out[i] = load<int32_t>(view.data, i);
      break;
    default: TPMOE_FAIL("{}: tensor '{}' is {}, not I64 or I32", view.file, view.name, dtype_name(view.dtype));
  }
  return out;
}

// ---- writer ------------------------------------------------------------------------------------------

void write_safetensors(const fs::path& path, const std::map<std::string, OwnedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  const std::string target = path.string();
  std::string header;
  try {
    json h = json::object();
    if (!metadata.empty()) h["__metadata__"] = metadata;
    uint64_t offset = 0;
    for (const auto& [name, t] : tensors) {  // std::map: name order, data contiguous in the same order
      TPMOE_CHECK(name != "__metadata__", "{}: '__metadata__' is reserved and cannot name a tensor", target);
      const uint64_t expected = uint64_t(t.numel()) * dtype_size(t.dtype);
      TPMOE_CHECK(t.bytes.size() == expected, "{}: tensor '{}' has {} bytes but {} {} needs {}", target, name,
                  t.bytes.size(), dtype_name(t.dtype), join_shape(t.shape), expected);
      h[name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + expected}}};
      offset += expected;
    }
    header = h.dump();
  } catch (const json::exception& e) {
    TPMOE_FAIL("{}: cannot encode the safetensors header: {}", target, e.what());
  }
  // The reference implementation pads with spaces so the data area starts 8-byte aligned.
  header.append((8 - header.size() % 8) % 8, ' ');

  const std::string tmp = target + ".tmp";
  FILE* out = std::fopen(tmp.c_str(), "wb");
  TPMOE_CHECK(out, "{}: cannot open for writing: {}", tmp, errno_text());
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = uint8_t(uint64_t(header.size()) >> (8 * i));
  bool ok = std::fwrite(len, 1, 8, out) == 8 && std::fwrite(header.data(), 1, header.size(), out) == header.size();
  for (auto it = tensors.begin(); ok && it != tensors.end(); ++it) {
    const auto& b = it->second.bytes;
    ok = b.empty() || std::fwrite(b.data(), 1, b.size(), out) == b.size();
  }
  const std::string why = errno_text();
  ok = (std::fclose(out) == 0) && ok;
  if (!ok) {
    std::remove(tmp.c_str());
    TPMOE_FAIL("{}: write failed: {}", tmp, why);
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    std::remove(tmp.c_str());
    TPMOE_FAIL("{}: cannot rename {} into place: {}", target, tmp, ec.message());
  }
}

}  // namespace tpmoe::io
