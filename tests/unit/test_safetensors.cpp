#include "models/io/safetensors.h"

#include <gtest/gtest.h>

#include "models/io/model_spec.h"
#include "tests/support/fifo.h"
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
  const std::vector<uint8_t> b = raw_safetensors("{}", 6, 1000);  // 16 bytes in all
  const std::string msg = open_error(tmp, b);
  EXPECT_EQ(msg, tmp.file("bad.safetensors") + ": the safetensors header runs past the end of the "
                                               "file (16 bytes); the file is truncated");
}

// Found by fuzz_safetensors: a number beyond any double made the JSON library's overflow
// exception escape with its own text.
TEST(SafetensorsCorrupt, NumberTooLargeInHeader) {
  TempDir tmp;
  const std::string header =
      R"({"a": {"dtype": "F16", "shape": [33333333333e3333], "data_offsets": [0, 2]}})";
  EXPECT_EQ(open_error(tmp, raw_safetensors(header, 2)),
            tmp.file("bad.safetensors") +
                ": the safetensors header is not valid JSON (a number too large to represent)");
}

TEST(SafetensorsCorrupt, HeaderLengthNearUint64MaxDoesNotWrap) {
  TempDir tmp;
  EXPECT_THAT(open_error(tmp, raw_safetensors("{}", 6, ~uint64_t(0) - 4)),
              HasSubstr("is not a safetensors file (its header length field is implausible)"));
  // Above the format's 100 MB cap, even in a file large enough to hold it.
  EXPECT_THAT(open_error(tmp, raw_safetensors("{}", 6, 100'000'001)),
              HasSubstr("is not a safetensors file (its header length field is implausible)"));
}

// A file that is not a safetensors file at all (a shard name pointing at /etc/passwd, say):
// the message says so in words and never quotes its bytes, as a header length or otherwise.
TEST(SafetensorsCorrupt, OtherFilesAreNotQuoted) {
  TempDir tmp;
  const std::string text = "root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1::/usr/sbin:/bin/sh\n";
  uint64_t first8 = 0;
  for (int i = 7; i >= 0; --i) first8 = first8 << 8 | (uint8_t)text[i];
  const std::string msg = open_error(tmp, std::vector<uint8_t>(text.begin(), text.end()));
  EXPECT_EQ(msg, tmp.file("bad.safetensors") +
                     " is not a safetensors file (its header length field is implausible)");
  // The numbers are searched for past the path, which holds the test's pid and may hold them.
  const std::string said = msg.substr(std::min(msg.size(), tmp.file("bad.safetensors").size()));
  EXPECT_THAT(said, ::testing::Not(HasSubstr(std::to_string(first8))));
  EXPECT_THAT(said, ::testing::Not(HasSubstr(std::to_string(text.size()))));
  EXPECT_THAT(said, ::testing::Not(HasSubstr("root")));

  // A plausible length but no JSON object after it.
  std::vector<uint8_t> b = raw_safetensors("[1, 2, 3]", 0);
  EXPECT_THAT(open_error(tmp, b), HasSubstr("is not a safetensors file"));
}

TEST(SafetensorsCorrupt, OverlappingTensorsRefused) {
  TempDir tmp;
  const std::string msg = open_error(tmp, raw_safetensors(R"({
      "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
      "e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}})", 16));
  EXPECT_THAT(msg, HasSubstr("bad.safetensors: tensors a and b overlap (data_offsets [0, 16] and "
                             "[8, 16])"));
  // Back to back, and an empty tensor anywhere, are fine.
  const std::string path = tmp.file("ok.safetensors");
  test::write_bytes(path, raw_safetensors(R"({
      "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
      "e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}})", 16));
  EXPECT_EQ(SafetensorsFile(path).tensors().size(), 3u);
}

TEST(SafetensorsCorrupt, NotARegularFile) {
  TempDir tmp;
  fs::create_directories(tmp.file("dir.safetensors"));
  EXPECT_EQ(error_of([&] { SafetensorsFile f(tmp.file("dir.safetensors")); }),
            tmp.file("dir.safetensors") + " is a directory");
  const std::string fifo = tmp.file("fifo.safetensors");
  test::make_fifo(fifo);
  EXPECT_EQ(test::error_without_blocking(fifo, [&] { SafetensorsFile f(fifo); }),
            fifo + " is not a regular file (a FIFO)");
}

TEST(SafetensorsCorrupt, BadJson) {
  TempDir tmp;
  EXPECT_THAT(open_error(tmp, raw_safetensors("{\"a\": [1, 2", 0)), HasSubstr("not valid JSON"));
}

TEST(SafetensorsCorrupt, HeaderNotAnObject) {
  TempDir tmp;
  EXPECT_THAT(open_error(tmp, raw_safetensors("[1, 2, 3]", 0)),
              HasSubstr("bad.safetensors is not a safetensors file (its header is not a JSON "
                        "object)"));
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

// ---- shard names stay inside the model directory ----------------------------------------------

// A safetensors file with one F32 tensor `name`.
void write_one(const std::string& path, const std::string& name) {
  const float x = 1.0f;
  SafetensorsWriter w;
  w.add_data(name, DType::F32, {1}, &x);
  w.write(path);
}

std::string index_error(const std::string& dir, const std::string& shard) {
  test::write_text(dir + "/model.safetensors.index.json",
                   json({{"weight_map", {{"a", shard}}}}).dump());
  return error_of([&] { ModelFiles::open(dir); });
}

TEST(ModelFiles, IndexEntryWithAbsolutePathRefused) {
  TempDir tmp;
  const std::string msg = index_error(tmp.str(), "/etc/passwd");
  EXPECT_EQ(msg, tmp.file("model.safetensors.index.json") +
                     ": weight_map entry a: /etc/passwd leads outside the model directory (an "
                     "absolute path)");
  // Even when it names a real safetensors file.
  write_one(tmp.file("elsewhere.safetensors"), "a");
  EXPECT_THAT(index_error(tmp.str(), tmp.file("elsewhere.safetensors")),
              HasSubstr("leads outside the model directory (an absolute path)"));
}

TEST(ModelFiles, IndexEntryWithDotDotRefused) {
  TempDir tmp;
  fs::create_directories(tmp.file("model"));
  write_one(tmp.file("other.safetensors"), "a");  // a real file, one level up
  for (const char* shard : {"../other.safetensors", "sub/../../other.safetensors",
                            "sub/../model-1.safetensors"}) {
    EXPECT_THAT(index_error(tmp.file("model"), shard),
                HasSubstr(std::string("weight_map entry a: ") + shard +
                          " leads outside the model directory (a .. component)"));
  }
}

TEST(ModelFiles, IndexEntryThroughSymlinkOutsideRefused) {
  TempDir tmp;
  fs::create_directories(tmp.file("model/sub"));
  write_one(tmp.file("other.safetensors"), "a");
  fs::create_symlink(tmp.file("other.safetensors"), tmp.file("model/shard.safetensors"));
  EXPECT_THAT(index_error(tmp.file("model"), "shard.safetensors"),
              HasSubstr("weight_map entry a: shard.safetensors leads outside the model directory "
                        "(a symlink to " + tmp.file("other.safetensors") + ")"));
  // A symlinked folder on the way counts the same.
  fs::create_symlink(tmp.str(), tmp.file("model/up"));
  EXPECT_THAT(index_error(tmp.file("model"), "up/other.safetensors"),
              HasSubstr("leads outside the model directory (a symlink to"));
  // Symlinks that stay inside are followed.
  write_one(tmp.file("model/sub/real.safetensors"), "a");
  fs::create_symlink("sub/real.safetensors", tmp.file("model/inside.safetensors"));
  test::write_text(tmp.file("model/model.safetensors.index.json"),
                   R"({"weight_map": {"a": "inside.safetensors"}})");
  EXPECT_EQ(ModelFiles::open(tmp.file("model")).get("a").copy_as<float>()[0], 1.0f);
}

// A Hugging Face cache snapshot: every file a symlink into the repository's blobs/ folder.
TEST(ModelFiles, HuggingFaceCacheSnapshotLoads) {
  TempDir tmp;
  const std::string repo = tmp.file("models--org--name");
  fs::create_directories(repo + "/blobs");
  fs::create_directories(repo + "/snapshots/0123abcd");
  write_one(repo + "/blobs/9f86d081", "a");
  test::write_text(repo + "/blobs/e3b0c442", R"({"weight_map": {"a": "model-00001-of-00001.safetensors"}})");
  const std::string snap = repo + "/snapshots/0123abcd";
  fs::create_symlink("../../blobs/9f86d081", snap + "/model-00001-of-00001.safetensors");
  fs::create_symlink("../../blobs/e3b0c442", snap + "/model.safetensors.index.json");
  EXPECT_EQ(ModelFiles::open(snap).get("a").copy_as<float>()[0], 1.0f);
  // but not a blob of another repository
  fs::create_directories(tmp.file("models--other--x/blobs"));
  write_one(tmp.file("models--other--x/blobs/aa"), "a");
  fs::create_symlink(tmp.file("models--other--x/blobs/aa"), snap + "/model-2.safetensors");
  EXPECT_THAT(index_error(snap, "model-2.safetensors"), HasSubstr("a symlink to"));
}

TEST(ModelFiles, IndexOrShardNotARegularFile) {
  TempDir tmp;
  fs::create_directories(tmp.file("model.safetensors.index.json"));
  EXPECT_EQ(error_of([&] { ModelFiles::open(tmp.str()); }),
            tmp.file("model.safetensors.index.json") + " is a directory");
  fs::remove(tmp.file("model.safetensors.index.json"));
  test::make_fifo(tmp.file("model.safetensors.index.json"));
  EXPECT_EQ(test::error_without_blocking(tmp.file("model.safetensors.index.json"),
                                         [&] { ModelFiles::open(tmp.str()); }),
            tmp.file("model.safetensors.index.json") + " is not a regular file (a FIFO)");
  fs::remove(tmp.file("model.safetensors.index.json"));

  test::write_text(tmp.file("model.safetensors.index.json"),
                   R"({"weight_map": {"a": "model-00001-of-00001.safetensors"}})");
  test::make_fifo(tmp.file("model-00001-of-00001.safetensors"));
  EXPECT_EQ(test::error_without_blocking(tmp.file("model-00001-of-00001.safetensors"),
                                         [&] { ModelFiles::open(tmp.str()); }),
            tmp.file("model-00001-of-00001.safetensors") + " is not a regular file (a FIFO)");
  fs::remove(tmp.file("model.safetensors.index.json"));

  // The single file too, and has_weights sees it (so the error is said, not "no weights").
  EXPECT_FALSE(ModelFiles::has_weights(tmp.str()));
  fs::create_directories(tmp.file("model.safetensors"));
  EXPECT_TRUE(ModelFiles::has_weights(tmp.str()));
  EXPECT_EQ(error_of([&] { ModelFiles::open(tmp.str()); }),
            tmp.file("model.safetensors") + " is a directory");
}

}  // namespace
}  // namespace kestrel
