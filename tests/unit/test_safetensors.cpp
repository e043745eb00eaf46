#include "models/io/safetensors.h"

#include <gtest/gtest.h>

#include "models/io/model_spec.h"
#include "tests/support/test_loader_util.h"

namespace kestrel {
namespace {

namespace fs = std::filesystem;
using test::error_of;
using test::json;
using test::raw_safetensors;
using test::TempDir;
using ::testing::HasSubstr;

uint64_t header_len_of(const std::vector<uint8_t>& b) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | b[i];
  return n;
}

TEST(Safetensors, RoundTripAllDtypes) {
  TempDir tmp;
  const std::vector<uint16_t> f16 = {float_to_half(1.5f), float_to_half(-2.25f), float_to_half(0.0f),
                                     float_to_half(65504.0f), float_to_half(0.125f), float_to_half(3.0f)};
  const std::vector<uint16_t> bf16 = {float_to_bf16(1.5f), float_to_bf16(-256.0f), float_to_bf16(1e30f)};
  const std::vector<float> f32 = {1.0f, -0.5f, 3.25f, 1e-20f, -7.0f};
  const std::vector<int32_t> i32 = {0, -1, 2147483647, -2147483647 - 1};

  SafetensorsWriter w;
  w.add_data("a.f16", DType::F16, {2, 3}, f16.data());
  w.add_data("b.bf16", DType::BF16, {3}, bf16.data());
  w.add_data("c.f32", DType::F32, {5}, f32.data());
  w.add_data("d.i32", DType::I32, {2, 2}, i32.data());
  w.set_metadata("format", "pt");
  w.set_metadata("note", "tiny");
  EXPECT_EQ(w.total_bytes(), 12u + 6u + 20u + 16u);
  const std::string path = tmp.file("x.safetensors");
  w.write(path);

  // Raw layout: 8-byte length, a space-padded header ending the 8-aligned prefix, the data.
  const std::vector<uint8_t> raw = test::read_bytes(path);
  const uint64_t hlen = header_len_of(raw);
  EXPECT_EQ(hlen % 8, 0u);
  EXPECT_EQ(raw.size(), 8 + hlen + 54);
  const std::string header(raw.begin() + 8, raw.begin() + 8 + hlen);
  EXPECT_EQ(header.front(), '{');
  EXPECT_EQ(header.find_last_not_of(' '), header.rfind('}'));
  EXPECT_EQ(json::parse(header)["c.f32"]["data_offsets"], json({18, 38}));

  SafetensorsFile f(path);
  EXPECT_EQ(f.tensors().size(), 4u);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.metadata().at("note"), "tiny");
  EXPECT_EQ(f.find("missing"), nullptr);

  const TensorInfo* a = f.find("a.f16");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype, DType::F16);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a->numel(), 6);
  EXPECT_EQ(a->nbytes, 12u);
  EXPECT_EQ(a->shape_str(), "[2, 3]");
  EXPECT_EQ(a->file, path);
  EXPECT_EQ(a->copy_as<uint16_t>(), f16);
  EXPECT_EQ(to_float(*a), (std::vector<float>{1.5f, -2.25f, 0.0f, 65504.0f, 0.125f, 3.0f}));

  const TensorInfo* b = f.find("b.bf16");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->dtype, DType::BF16);
  EXPECT_EQ(b->copy_as<uint16_t>(), bf16);
  const std::vector<float> bf = to_float(*b);
  EXPECT_EQ(bf[0], 1.5f);
  EXPECT_EQ(bf[1], -256.0f);

  const TensorInfo* c = f.find("c.f32");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->dtype, DType::F32);
  EXPECT_EQ(c->copy_as<float>(), f32);  // offset 18: the data is not 4-aligned
  EXPECT_EQ(to_float(*c), f32);

  const TensorInfo* d = f.find("d.i32");
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(d->dtype, DType::I32);
  EXPECT_EQ(d->copy_as<int32_t>(), i32);
  EXPECT_THAT(error_of([&] { to_float(*d); }), HasSubstr("d.i32"));
  EXPECT_THAT(error_of([&] { d->copy_as<uint16_t>(); }), HasSubstr("I32"));
}

TEST(Safetensors, ScalarAndEmptyTensors) {
  TempDir tmp;
  const float one = 1.0f;
  SafetensorsWriter w;
  w.add_data("scalar", DType::F32, {}, &one);
  w.add_data("empty", DType::F16, {0, 4}, nullptr);
  w.write(tmp.file("s.safetensors"));
  SafetensorsFile f(tmp.file("s.safetensors"));
  EXPECT_EQ(f.find("scalar")->numel(), 1);
  EXPECT_EQ(f.find("scalar")->shape_str(), "[]");
  EXPECT_EQ(f.find("scalar")->copy_as<float>(), std::vector<float>{1.0f});
  EXPECT_EQ(f.find("empty")->numel(), 0);
  EXPECT_EQ(f.find("empty")->nbytes, 0u);
}

TEST(Safetensors, FillIsCalledOncePerTensorInOrderWithExactSize) {
  TempDir tmp;
  std::vector<std::pair<std::string, size_t>> calls;
  SafetensorsWriter w;
  for (const char* name : {"z", "a", "m"}) {
    w.add(name, DType::I32, {3, 5}, [&calls, name](uint8_t* dst, size_t n) {
      calls.emplace_back(name, n);
      for (size_t i = 0; i < n / 4; ++i) {
        const int32_t v = (int32_t)(i * 10) + name[0];
        std::memcpy(dst + 4 * i, &v, 4);
      }
    });
  }
  w.write(tmp.file("f.safetensors"));
  ASSERT_EQ(calls.size(), 3u);
  EXPECT_EQ(calls[0], std::make_pair(std::string("z"), size_t(60)));
  EXPECT_EQ(calls[1].first, "a");
  EXPECT_EQ(calls[2].first, "m");
  SafetensorsFile f(tmp.file("f.safetensors"));
  const std::vector<int32_t> a = f.find("a")->copy_as<int32_t>();
  EXPECT_EQ(a[0], 'a');
  EXPECT_EQ(a[14], 140 + 'a');
  EXPECT_EQ(f.find("m")->copy_as<int32_t>()[3], 30 + 'm');
}

TEST(Safetensors, WriterRejectsDuplicateNames) {
  SafetensorsWriter w;
  const float x = 0;
  w.add_data("t", DType::F32, {1}, &x);
  EXPECT_THAT(error_of([&] { w.add_data("t", DType::F32, {1}, &x); }), HasSubstr("t added twice"));
}

TEST(Safetensors, WriteToMissingDirectoryFails) {
  TempDir tmp;
  SafetensorsWriter w;
  const float x = 0;
  w.add_data("t", DType::F32, {1}, &x);
  const std::string path = tmp.file("no/such/dir/x.safetensors");
  EXPECT_THAT(error_of([&] { w.write(path); }), HasSubstr(path));
}

TEST(Safetensors, WriteModelUnsharded) {
  TempDir tmp;
  std::vector<float> v(10, 2.0f);
  SafetensorsWriter w;
  w.add_data("w", DType::F32, {10}, v.data());
  w.write_model(tmp.str());
  EXPECT_TRUE(fs::exists(tmp.file("model.safetensors")));
  EXPECT_FALSE(fs::exists(tmp.file("model.safetensors.index.json")));
  SafetensorsFile f(tmp.file("model.safetensors"));
  EXPECT_EQ(f.metadata().at("format"), "pt");
  ModelFiles mf = ModelFiles::open(tmp.str());
  EXPECT_EQ(mf.get("w").copy_as<float>(), v);
  EXPECT_EQ(mf.total_bytes(), 40u);
}

TEST(Safetensors, WriteModelShardedWithIndex) {
  TempDir tmp;
  // Five tensors of 40, 40, 40, 100, 8 bytes, limit 90: shards {t0,t1} {t2} {t3} {t4}.
  std::vector<std::vector<float>> data;
  const std::vector<int64_t> sizes = {10, 10, 10, 25, 2};
  const std::vector<std::string> names = {"t0", "t1", "t2", "t3", "t4"};
  SafetensorsWriter w;
  for (size_t i = 0; i < sizes.size(); ++i) {
    data.emplace_back(sizes[i]);
    for (int64_t j = 0; j < sizes[i]; ++j) data[i][j] = (float)(100 * i + j);
  }
  for (size_t i = 0; i < sizes.size(); ++i)
    w.add_data(names[i], DType::F32, {sizes[i]}, data[i].data());
  w.write_model(tmp.str(), 90);

  EXPECT_FALSE(fs::exists(tmp.file("model.safetensors")));
  for (const char* name : {"model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
                           "model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors"})
    EXPECT_TRUE(fs::exists(tmp.file(name))) << name;
  std::ifstream in(tmp.file("model.safetensors.index.json"));
  const json index = json::parse(in);
  EXPECT_EQ(index["metadata"]["total_size"], 228);
  EXPECT_EQ(index["weight_map"]["t0"], "model-00001-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"]["t1"], "model-00001-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"]["t2"], "model-00002-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"]["t3"], "model-00003-of-00004.safetensors");
  EXPECT_EQ(index["weight_map"]["t4"], "model-00004-of-00004.safetensors");
  EXPECT_EQ(SafetensorsFile(tmp.file("model-00001-of-00004.safetensors")).tensors().size(), 2u);

  ModelFiles mf = ModelFiles::open(tmp.str());
  EXPECT_EQ(mf.names(), names);
  EXPECT_EQ(mf.total_bytes(), 228u);
  for (size_t i = 0; i < sizes.size(); ++i)
    EXPECT_EQ(mf.get(names[i]).copy_as<float>(), data[i]);
  EXPECT_EQ(mf.get("t3").file, tmp.file("model-00003-of-00004.safetensors"));
  EXPECT_THAT(error_of([&] { mf.get("t9"); }), HasSubstr("missing tensor t9"));
}

// ---- corrupt files ---------------------------------------------------------------------------

std::string open_error(const TempDir& tmp, const std::vector<uint8_t>& bytes) {
  const std::string path = tmp.file("bad.safetensors");
  test::write_bytes(path, bytes);
  return error_of([&] { SafetensorsFile f(path); });
}

TEST(SafetensorsCorrupt, TruncatedFile) {
  TempDir tmp;
  const std::string msg = open_error(tmp, {1, 2, 3, 4, 5});
  EXPECT_THAT(msg, HasSubstr("bad.safetensors"));
  EXPECT_THAT(msg, HasSubstr("5 bytes"));
}

TEST(SafetensorsCorrupt, HeaderLengthPastEndOfFile) {
  TempDir tmp;
  const std::vector<uint8_t> b = raw_safetensors("{}", 6, 123456789);  // 16 bytes in all
  const std::string msg = open_error(tmp, b);
  EXPECT_THAT(msg, HasSubstr("bad.safetensors: header length 123456789 runs past the end of the "
                             "file (16 bytes)"));
}

TEST(SafetensorsCorrupt, HeaderLengthNearUint64MaxDoesNotWrap) {
  TempDir tmp;
  const std::string msg = open_error(tmp, raw_safetensors("{}", 6, ~uint64_t(0) - 4));
  EXPECT_THAT(msg, HasSubstr("runs past the end"));
}

TEST(SafetensorsCorrupt, BadJson) {
  TempDir tmp;
  EXPECT_THAT(open_error(tmp, raw_safetensors("{\"a\": [1, 2", 0)), HasSubstr("not valid JSON"));
}

TEST(SafetensorsCorrupt, HeaderNotAnObject) {
  TempDir tmp;
  EXPECT_THAT(open_error(tmp, raw_safetensors("[1, 2, 3]", 0)), HasSubstr("not an object"));
}

TEST(SafetensorsCorrupt, UnsupportedDtype) {
  TempDir tmp;
  const std::string msg = open_error(
      tmp, raw_safetensors(R"({"w.weight": {"dtype": "F64", "shape": [2], "data_offsets": [0, 16]}})", 16));
  EXPECT_THAT(msg, HasSubstr("w.weight"));
  EXPECT_THAT(msg, HasSubstr("unsupported dtype F64"));
}

TEST(SafetensorsCorrupt, ShapeDisagreesWithOffsets) {
  TempDir tmp;
  const std::string msg = open_error(
      tmp, raw_safetensors(R"({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}})", 24));
  EXPECT_THAT(msg, HasSubstr("tensor w"));
  EXPECT_THAT(msg, HasSubstr("[2, 3]"));
  EXPECT_THAT(msg, HasSubstr("needs 24 bytes"));
  EXPECT_THAT(msg, HasSubstr("span 20"));
}

TEST(SafetensorsCorrupt, OffsetsPastDataArea) {
  TempDir tmp;
  const std::string msg = open_error(
      tmp, raw_safetensors(R"({"w": {"dtype": "I32", "shape": [4], "data_offsets": [8, 24]}})", 20));
  EXPECT_THAT(msg, HasSubstr("tensor w"));
  EXPECT_THAT(msg, HasSubstr("[8, 24]"));
  EXPECT_THAT(msg, HasSubstr("(20 bytes)"));
}

TEST(SafetensorsCorrupt, OffsetsBeginAfterEnd) {
  TempDir tmp;
  const std::string msg = open_error(
      tmp, raw_safetensors(R"({"w": {"dtype": "I32", "shape": [0], "data_offsets": [12, 8]}})", 20));
  EXPECT_THAT(msg, HasSubstr("[12, 8] begin after end"));
}

TEST(SafetensorsCorrupt, NegativeDimension) {
  TempDir tmp;
  const std::string msg = open_error(
      tmp, raw_safetensors(R"({"w": {"dtype": "I32", "shape": [-1], "data_offsets": [0, 4]}})", 4));
  EXPECT_THAT(msg, HasSubstr("tensor w"));
  EXPECT_THAT(msg, HasSubstr("[-1]"));
}

TEST(SafetensorsCorrupt, MetadataValueNotString) {
  TempDir tmp;
  const std::string msg = open_error(tmp, raw_safetensors(R"({"__metadata__": {"n": 3}})", 0));
  EXPECT_THAT(msg, HasSubstr("__metadata__ value of n"));
}

// ---- model directories -----------------------------------------------------------------------

TEST(ModelFiles, MissingDirectory) {
  TempDir tmp;
  const std::string dir = tmp.file("nope");
  EXPECT_THAT(error_of([&] { ModelFiles::open(dir); }), HasSubstr(dir + ": no such directory"));
}

TEST(ModelFiles, NoWeightsListsWhatWasLookedFor) {
  TempDir tmp;
  EXPECT_THAT(error_of([&] { ModelFiles::open(tmp.str()); }),
              HasSubstr(tmp.str() + ": no model.safetensors or model.safetensors.index.json"));
  EXPECT_THAT(error_of([&] { ModelFiles::open(tmp.str(), "gptq_model-4bit-128g"); }),
              HasSubstr("no gptq_model-4bit-128g.safetensors or "
                        "gptq_model-4bit-128g.safetensors.index.json"));
  EXPECT_FALSE(ModelFiles::has_weights(tmp.str()));
}

TEST(ModelFiles, BaseNameSelectsFiles) {
  TempDir tmp;
  const float x = 4.0f, y = 5.0f;
  SafetensorsWriter a, b;
  a.add_data("x", DType::F32, {1}, &x);
  a.write(tmp.file("model.safetensors"));
  b.add_data("y", DType::F32, {1}, &y);
  b.write(tmp.file("gptq_model-4bit-128g.safetensors"));
  EXPECT_TRUE(ModelFiles::has_weights(tmp.str(), "gptq_model-4bit-128g"));
  EXPECT_EQ(ModelFiles::open(tmp.str()).names(), std::vector<std::string>{"x"});
  ModelFiles mf = ModelFiles::open(tmp.str(), "gptq_model-4bit-128g");
  EXPECT_EQ(mf.names(), std::vector<std::string>{"y"});
  EXPECT_EQ(mf.get("y").copy_as<float>()[0], 5.0f);
}

TEST(ModelFiles, IndexNamesTensorTheShardLacks) {
  TempDir tmp;
  const float x = 1.0f;
  SafetensorsWriter w;
  w.add_data("a", DType::F32, {1}, &x);
  w.write(tmp.file("model-00001-of-00001.safetensors"));
  test::write_text(tmp.file("model.safetensors.index.json"),
                   R"({"metadata": {"total_size": 8}, "weight_map": {
                        "a": "model-00001-of-00001.safetensors",
                        "b": "model-00001-of-00001.safetensors"}})");
  const std::string msg = error_of([&] { ModelFiles::open(tmp.str()); });
  EXPECT_THAT(msg, HasSubstr("model.safetensors.index.json"));
  EXPECT_THAT(msg, HasSubstr("puts b in model-00001-of-00001.safetensors"));
}

TEST(ModelFiles, IndexNamesMissingShard) {
  TempDir tmp;
  test::write_text(tmp.file("model.safetensors.index.json"),
                   R"({"weight_map": {"a": "model-00002-of-00002.safetensors"}})");
  EXPECT_THAT(error_of([&] { ModelFiles::open(tmp.str()); }),
              HasSubstr("shard model-00002-of-00002.safetensors (holding a) does not exist"));
}

TEST(ModelFiles, IndexWithoutWeightMap) {
  TempDir tmp;
  test::write_text(tmp.file("model.safetensors.index.json"), R"({"metadata": {}})");
  EXPECT_THAT(error_of([&] { ModelFiles::open(tmp.str()); }), HasSubstr("missing weight_map"));
}

}  // namespace
}  // namespace kestrel
