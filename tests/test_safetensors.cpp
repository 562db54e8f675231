#include "io/safetensors.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>

#include "core/error.h"
#include "test_util.h"

namespace tpmoe::io {
namespace {

namespace fs = std::filesystem;

// A safetensors image built by hand: u64 LE header length, the header text, `data_bytes` zero bytes.
std::string image(const std::string& header, size_t data_bytes) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = char(uint64_t(header.size()) >> (8 * i));
  return out + header + std::string(data_bytes, '\0');
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
}

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// Runs `fn`, expects a tpmoe::Error, and checks its message contains every one of `needles`.
void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> needles) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
    return;
  }
  ADD_FAILURE() << "no tpmoe::Error thrown";
}

// Parses a hand-built image under the name "bad.safetensors" and expects an error naming it and `tensor`.
void expect_parse_error(const std::string& bytes, std::initializer_list<std::string> needles) {
  expect_error(
      [&] {
        parse_safetensors_header({reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()}, "bad.safetensors");
      },
      needles);
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = test::make_temp_dir("safetensors"); }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(SafetensorsTest, RoundTripValues) {
  const std::vector<float> f = {1.0f, -2.5f, 3.140625f, 0.0f, 1e-3f, 65504.0f};
  const std::vector<int64_t> ids = {0, -1, int64_t(1) << 40, 7};
  std::map<std::string, OwnedTensor> tensors;
  tensors["b.bf16"] = OwnedTensor::from_f32({2, 3}, f, DType::kBF16);
  tensors["a.f32"] = OwnedTensor::from_f32({3, 2}, f, DType::kF32);
  tensors["c.ids"] = OwnedTensor::from_i64({4}, ids);
  tensors["d.f16"] = OwnedTensor::from_f32({6}, f, DType::kF16);
  tensors["e.empty"] = OwnedTensor::from_f32({0, 5}, {}, DType::kF32);
  const fs::path path = dir_ / "rt.safetensors";
  write_safetensors(path, tensors, {{"format", "pt"}, {"note", "x"}});
  EXPECT_FALSE(fs::exists(path.string() + ".tmp"));

  // Header padded so the data area starts 8-byte aligned.
  const std::string raw = read_bytes(path);
  uint64_t n = 0;
  std::memcpy(&n, raw.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(raw[8 + n - 1] == ' ' || raw[8 + n - 1] == '}', true);

  auto file = SafetensorsFile::open(path);
  EXPECT_EQ(file->metadata().at("note"), "x");
  ASSERT_EQ(file->tensors().size(), 5u);

  const TensorView* a = file->find("a.f32");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype, DType::kF32);
  EXPECT_EQ(a->shape_str(), "[3,2]");
  EXPECT_EQ(to_f32(*a), f);

  const TensorView* b = file->find("b.bf16");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->dtype, DType::kBF16);
  const auto bv = to_f32(*b);
  for (size_t i = 0; i < f.size(); ++i) EXPECT_EQ(bv[i], bf16_to_f32(f32_to_bf16(f[i])));
  EXPECT_EQ(bv[1], -2.5f);

  const auto dv = to_f32(*file->find("d.f16"));
  for (size_t i = 0; i < f.size(); ++i) EXPECT_NEAR(dv[i], f[i], std::fabs(f[i]) * 1e-3f);
  EXPECT_EQ(dv[5], 65504.0f);  // the largest half is exact

  const TensorView* c = file->find("c.ids");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(to_i64(*c), ids);
  expect_error([&] { to_f32(*c); }, {path.string(), "c.ids"});
  expect_error([&] { to_i64(*a); }, {path.string(), "a.f32"});

  EXPECT_EQ(file->find("e.empty")->numel(), 0);
  EXPECT_EQ(file->find("missing"), nullptr);

  // Views: index and rows, bounds-checked.
  EXPECT_EQ(to_f32(a->index(1)), (std::vector<float>{3.140625f, 0.0f}));
  EXPECT_EQ(to_f32(a->rows(1, 2)), (std::vector<float>{3.140625f, 0.0f, 1e-3f, 65504.0f}));
  expect_error([&] { a->index(3); }, {path.string(), "a.f32"});
  expect_error([&] { a->rows(2, 2); }, {path.string(), "a.f32"});
  expect_error([&] { a->index(0).index(0).index(0); }, {"a.f32"});

  // copy_of survives the file being closed.
  OwnedTensor copy = OwnedTensor::copy_of(*b);
  file.reset();
  EXPECT_EQ(copy.to_f32(), bv);
}

TEST_F(SafetensorsTest, ReadsFixture) {
  const fs::path path = test::fixtures_dir() / "m3-tiny" / "model.safetensors";
  if (!fs::exists(path)) GTEST_SKIP() << "fixture missing: " << path;
  auto set = SafetensorsSet::open_dir(path.parent_path());
  const TensorView* t = set.find("model.layers.1.mlp.experts.gate_up_proj");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dtype, DType::kBF16);
  EXPECT_EQ(t->shape_str(), "[8,128,128]");
  EXPECT_EQ(t->index(7).shape_str(), "[128,128]");
  const auto values = to_f32(*t);
  double sum_sq = 0;
  for (float v : values) sum_sq += double(v) * v;
  EXPECT_GT(sum_sq, 0.0);
  EXPECT_TRUE(std::isfinite(sum_sq));
  const auto names = set.names();
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  EXPECT_GT(names.size(), 10u);
}

TEST_F(SafetensorsTest, TruncatedFixture) {
  const fs::path src = test::fixtures_dir() / "m3-tiny" / "model.safetensors";
  if (!fs::exists(src)) GTEST_SKIP() << "fixture missing: " << src;
  const std::string bytes = read_bytes(src);
  const fs::path cut = dir_ / "cut.safetensors";
  write_bytes(cut, bytes.substr(0, bytes.size() / 2));
  expect_error([&] { SafetensorsFile::open(cut); }, {cut.string(), "outside the data area"});
}

TEST_F(SafetensorsTest, ShardedDirectory) {
  const std::vector<float> v = {1, 2, 3, 4};
  write_safetensors(dir_ / "s1.safetensors", {{"x", OwnedTensor::from_f32({4}, v, DType::kF32)},
                                              {"y", OwnedTensor::from_f32({2, 2}, v, DType::kBF16)}});
  write_safetensors(dir_ / "s2.safetensors", {{"z", OwnedTensor::from_i64({1}, std::vector<int64_t>{9})}});
  const fs::path index = dir_ / "model.safetensors.index.json";
  write_bytes(index, R"({"metadata": {}, "weight_map": {"x": "s1.safetensors", "y": "s1.safetensors",
                         "z": "s2.safetensors"}})");
  auto set = SafetensorsSet::open_dir(dir_);
  EXPECT_EQ(set.names(), (std::vector<std::string>{"x", "y", "z"}));
  EXPECT_EQ(to_f32(*set.find("y")), v);
  EXPECT_EQ(to_i64(*set.find("z")), std::vector<int64_t>{9});
  EXPECT_EQ(set.find("w"), nullptr);

  // Index naming a shard that is not there.
  write_bytes(index, R"({"weight_map": {"x": "s1.safetensors", "z": "gone.safetensors"}})");
  expect_error([&] { SafetensorsSet::open_dir(dir_); }, {index.string(), "gone.safetensors"});

  // Index naming a tensor the shard lacks.
  write_bytes(index, R"({"weight_map": {"x": "s1.safetensors", "q": "s2.safetensors"}})");
  expect_error([&] { SafetensorsSet::open_dir(dir_); }, {"'q'", "s2.safetensors"});

  // The same tensor in two shards' headers.
  write_safetensors(dir_ / "s3.safetensors", {{"w", OwnedTensor::from_f32({4}, v, DType::kF32)},
                                              {"x", OwnedTensor::from_f32({4}, v, DType::kF32)}});
  write_bytes(index, R"({"weight_map": {"x": "s1.safetensors", "w": "s3.safetensors"}})");
  expect_error([&] { SafetensorsSet::open_dir(dir_); }, {"'x'", "s1.safetensors", "s3.safetensors"});

  // Index that is not JSON, or lacks a weight_map.
  write_bytes(index, "{nope");
  expect_error([&] { SafetensorsSet::open_dir(dir_); }, {index.string()});
  write_bytes(index, "{}");
  expect_error([&] { SafetensorsSet::open_dir(dir_); }, {index.string(), "weight_map"});
  write_bytes(index, R"({"weight_map": {"x": "../s1.safetensors"}})");
  expect_error([&] { SafetensorsSet::open_dir(dir_); }, {index.string(), "'x'"});
}

TEST_F(SafetensorsTest, MissingFilesAndDirs) {
  expect_error([&] { SafetensorsSet::open_dir(dir_); }, {dir_.string()});
  expect_error([&] { SafetensorsFile::open(dir_ / "none.safetensors"); }, {"none.safetensors"});
  write_bytes(dir_ / "empty.safetensors", "");
  expect_error([&] { SafetensorsFile::open(dir_ / "empty.safetensors"); }, {"empty.safetensors", "empty"});
  expect_error([&] { SafetensorsFile::open(dir_); }, {dir_.string(), "not a regular file"});
}

TEST_F(SafetensorsTest, TruncatedWrittenFile) {
  const std::vector<float> v(64, 1.5f);
  const fs::path path = dir_ / "w.safetensors";
  write_safetensors(path, {{"big", OwnedTensor::from_f32({8, 8}, v, DType::kF32)}});
  const std::string bytes = read_bytes(path);
  write_bytes(path, bytes.substr(0, bytes.size() - 100));
  expect_error([&] { SafetensorsFile::open(path); }, {path.string(), "'big'"});
}

TEST_F(SafetensorsTest, WriterErrors) {
  OwnedTensor bad = OwnedTensor::from_f32({2}, std::vector<float>{1, 2}, DType::kF32);
  bad.bytes.pop_back();
  const fs::path path = dir_ / "bad.safetensors";
  expect_error([&] { write_safetensors(path, {{"t", bad}}); }, {path.string(), "'t'"});
  const fs::path nowhere = dir_ / "no" / "such" / "dir.safetensors";
  expect_error([&] { write_safetensors(nowhere, {}); }, {nowhere.string()});
}

TEST(SafetensorsHeader, ShortFile) {
  expect_parse_error("abc", {"bad.safetensors", "3 bytes"});
  expect_parse_error("", {"bad.safetensors"});
}

TEST(SafetensorsHeader, HeaderLengthPastEnd) {
  std::string bytes = image("{}", 10);
  bytes[0] = char(0x40);
  bytes[1] = char(0xe2);
  bytes[2] = char(0x01);  // 123456
  expect_parse_error(bytes, {"bad.safetensors: header length 123456 runs past the end of the file (20 bytes)"});
  std::string huge(8, char(0xff));
  expect_parse_error(huge, {"bad.safetensors", "runs past the end"});
}

TEST(SafetensorsHeader, InvalidJson) {
  expect_parse_error(image("{\"a\": ", 0), {"bad.safetensors", "not valid JSON"});
  expect_parse_error(image("[1, 2]", 0), {"bad.safetensors", "not an object"});
  expect_parse_error(image(R"({"t": 5})", 0), {"bad.safetensors", "'t'"});
  expect_parse_error(image(R"({"__metadata__": {"k": 1}})", 0), {"bad.safetensors", "'k'"});
}

TEST(SafetensorsHeader, UnknownDtype) {
  expect_parse_error(image(R"({"t": {"dtype": "F8_E9", "shape": [1], "data_offsets": [0, 1]}})", 1),
                     {"bad.safetensors", "'t'", "F8_E9"});
}

TEST(SafetensorsHeader, BadShape) {
  expect_parse_error(image(R"({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}})", 0),
                     {"bad.safetensors", "'t'", "non-negative"});
  expect_parse_error(image(R"({"t": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}})", 4),
                     {"bad.safetensors", "'t'"});
  expect_parse_error(image(R"({"t": {"dtype": "F32", "shape": 4, "data_offsets": [0, 16]}})", 16),
                     {"bad.safetensors", "'t'", "shape"});
}

TEST(SafetensorsHeader, ShapeOverflow) {
  // 2^32 x 2^32 wraps to 0 in 64 bits: a naive product would accept [0, 0].
  expect_parse_error(image(R"({"t": {"dtype": "U8", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})", 0),
                     {"bad.safetensors", "'t'", "overflow"});
  expect_parse_error(image(R"({"t": {"dtype": "F32", "shape": [4611686018427387904], "data_offsets": [0, 0]}})", 0),
                     {"bad.safetensors", "'t'", "overflow"});
}

TEST(SafetensorsHeader, OffsetsOutOfBounds) {
  expect_parse_error(image(R"({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 8),
                     {"bad.safetensors", "'t'", "outside the data area"});
  expect_parse_error(image(R"({"t": {"dtype": "F32", "shape": [0], "data_offsets": [9, 9]}})", 8),
                     {"bad.safetensors", "'t'", "outside"});
  expect_parse_error(image(R"({"t": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})", 8),
                     {"bad.safetensors", "'t'"});
  expect_parse_error(image(R"({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", 8),
                     {"bad.safetensors", "'t'", "data_offsets"});
}

TEST(SafetensorsHeader, ByteSizeMismatch) {
  expect_parse_error(image(R"({"t": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 8]}})", 16),
                     {"bad.safetensors", "'t'", "needs 12"});
}

TEST(SafetensorsHeader, Overlap) {
  expect_parse_error(image(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                              "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}})",
                           24),
                     {"bad.safetensors", "'a'", "'b'", "overlaps"});
  // Zero-size tensors never overlap anything.
  const std::string ok = image(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                                   "e": {"dtype": "F32", "shape": [0, 3], "data_offsets": [8, 8]}})",
                               16);
  auto h = parse_safetensors_header({reinterpret_cast<const std::byte*>(ok.data()), ok.size()}, "ok");
  EXPECT_EQ(h.entries.size(), 2u);
}

TEST(SafetensorsHeader, DuplicateTensorName) {
  expect_parse_error(image(R"({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                              "a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}})",
                           2),
                     {"bad.safetensors", "'a'", "twice"});
}

TEST(SafetensorsHeader, ValidHeader) {
  const std::string bytes = image(
      R"({"__metadata__": {"format": "pt"}, "w": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]}})", 8);
  auto h = parse_safetensors_header({reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()}, "ok");
  ASSERT_EQ(h.entries.size(), 1u);
  EXPECT_EQ(h.entries[0].name, "w");
  EXPECT_EQ(h.entries[0].shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(h.entries[0].end, 8u);
  EXPECT_EQ(h.metadata.at("format"), "pt");
  EXPECT_EQ(h.data_start, bytes.size() - 8);
}

}  // namespace
}  // namespace tpmoe::io
