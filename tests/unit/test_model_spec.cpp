#include "models/io/model_spec.h"

#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <set>

#include <fmt/format.h>

#include "models/io/finite.h"
#include "tests/support/test_loader_util.h"

namespace kestrel {
namespace {

using test::as_bytes;
namespace fs = std::filesystem;
using test::error_of;
using test::json;
using test::TempDir;
using test::TinyModel;
using ::testing::HasSubstr;

const char* kQ = "model.layers.1.self_attn.q_proj";

TEST(ModelSpec, DenseModel) {
  TempDir tmp;
  TinyModel m;
  m.write(tmp.str());
  ModelSpec s = load_model_spec(tmp.str());
  EXPECT_EQ(s.config.hidden, 64);
  ASSERT_EQ(s.layers.size(), 2u);
  EXPECT_EQ(s.embed->name, "model.embed_tokens.weight");
  EXPECT_EQ(s.lm_head->name, "lm_head.weight");
  EXPECT_EQ(s.final_norm->shape, std::vector<int64_t>{64});
  const LayerSpec& L = s.layers[1];
  EXPECT_EQ(L.input_norm->name, "model.layers.1.input_layernorm.weight");
  EXPECT_EQ(L.post_norm->name, "model.layers.1.post_attention_layernorm.weight");
  EXPECT_FALSE(L.q.quantized);
  EXPECT_EQ(L.q.name, kQ);
  EXPECT_EQ(L.q.N, 64);
  EXPECT_EQ(L.k.N, 32);  // 2 kv heads of 16
  EXPECT_EQ(L.k.K, 64);
  EXPECT_EQ(L.o.N, 64);
  EXPECT_EQ(L.down.K, 128);
  EXPECT_EQ(L.down.weight->name, "model.layers.1.mlp.down_proj.weight");
  EXPECT_EQ(L.gate.bias, nullptr);
  EXPECT_TRUE(s.warnings.empty());
  // The tensors stay readable after the spec is moved around.
  const ModelSpec moved = std::move(s);
  const std::vector<float> norm = to_float(*moved.final_norm);
  EXPECT_FLOAT_EQ(norm[1], half_to_float(float_to_half(0.01f - 0.4f)));
}

TEST(ModelSpec, TiedEmbeddings) {
  TempDir tmp;
  TinyModel m(0, 32, /*tie=*/true);
  m.write(tmp.str());
  const ModelSpec s = load_model_spec(tmp.str());
  EXPECT_EQ(s.lm_head, s.embed);
}

TEST(ModelSpec, MissingLmHeadWhenNotTied) {
  TempDir tmp;
  TinyModel m;
  m.tensors.erase("lm_head.weight");
  m.write(tmp.str());
  const std::string msg = error_of([&] { load_model_spec(tmp.str()); });
  EXPECT_THAT(msg, HasSubstr("missing tensor lm_head.weight"));
  EXPECT_THAT(msg, HasSubstr("tie_word_embeddings is false"));
}

TEST(ModelSpec, MissingTensor) {
  TempDir tmp;
  TinyModel m;
  m.tensors.erase("model.layers.1.post_attention_layernorm.weight");
  m.write(tmp.str());
  EXPECT_THAT(error_of([&] { load_model_spec(tmp.str()); }),
              HasSubstr(tmp.str() + ": missing tensor model.layers.1.post_attention_layernorm.weight"));

  TinyModel m2;
  m2.tensors.erase("model.layers.0.mlp.up_proj.weight");
  m2.write(tmp.str());
  EXPECT_THAT(error_of([&] { load_model_spec(tmp.str()); }),
              HasSubstr("missing tensor model.layers.0.mlp.up_proj.weight"));
}

TEST(ModelSpec, WrongDtype) {
  TempDir tmp;
  TinyModel m;
  m.tensors["model.norm.weight"] = {DType::I32, {64}, as_bytes(std::vector<int32_t>(64, 1))};
  m.write(tmp.str());
  const std::string msg = error_of([&] { load_model_spec(tmp.str()); });
  EXPECT_THAT(msg, HasSubstr("model.norm.weight in " + tmp.str() + "/model.safetensors"));
  EXPECT_THAT(msg, HasSubstr("expected [64] F16/BF16/F32, found [64] I32"));
}

TEST(ModelSpec, WrongShape) {
  TempDir tmp;
  TinyModel m;
  m.add_f16("model.layers.0.self_attn.k_proj.weight", {64, 64});  // kv_dim is 32
  m.write(tmp.str());
  EXPECT_THAT(error_of([&] { load_model_spec(tmp.str()); }),
              HasSubstr("model.layers.0.self_attn.k_proj.weight in " + tmp.str() +
                        "/model.safetensors: expected [32, 64] F16/BF16/F32, found [64, 64] F16"));
}

TEST(ModelSpec, BiasRequiredWhenConfigAsksAndIgnoredOtherwise) {
  TempDir tmp;
  TinyModel m;
  m.config["attention_bias"] = true;
  m.write(tmp.str());
  EXPECT_THAT(error_of([&] { load_model_spec(tmp.str()); }),
              HasSubstr("missing tensor model.layers.0.self_attn.q_proj.bias"));

  TinyModel m2;
  m2.add_f16("model.layers.0.mlp.up_proj.bias", {128});
  m2.write(tmp.str());
  const ModelSpec s = load_model_spec(tmp.str());
  EXPECT_EQ(s.layers[0].up.bias, nullptr);
  ASSERT_EQ(s.warnings.size(), 1u);
  EXPECT_THAT(s.warnings[0], HasSubstr("model.layers.0.mlp.up_proj.bias is ignored"));
}

TEST(ModelSpec, BiasLoaded) {
  TempDir tmp;
  TinyModel m;
  m.config["attention_bias"] = true;
  for (int i = 0; i < 2; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".self_attn.";
    m.add_f16(p + "q_proj.bias", {64});
    m.add_f16(p + "k_proj.bias", {32});
    m.add_f16(p + "v_proj.bias", {32});
    m.add_f16(p + "o_proj.bias", {64});
  }
  m.write(tmp.str());
  const ModelSpec s = load_model_spec(tmp.str());
  ASSERT_NE(s.layers[1].v.bias, nullptr);
  EXPECT_EQ(s.layers[1].v.bias->shape, std::vector<int64_t>{32});
}

// A checkpoint saved from the bare decoder (no "model." prefix, as facebook's original OPT
// files) loads as the prefixed one does.
TEST(ModelSpec, NamesWithoutTheModelPrefix) {
  TempDir tmp;
  TinyModel m;
  m.write(tmp.str());
  fs::remove(tmp.file("model.safetensors"));
  SafetensorsWriter w;
  for (const auto& [name, t] : m.tensors) {
    const std::string bare = name.starts_with("model.") ? name.substr(6) : name;
    w.add_data(bare, t.dtype, t.shape, t.bytes.data());
  }
  w.write_model(tmp.str());
  const ModelSpec s = load_model_spec(tmp.str());
  EXPECT_EQ(s.embed->name, "embed_tokens.weight");
  EXPECT_EQ(s.layers[1].down.weight->name, "layers.1.mlp.down_proj.weight");
  EXPECT_EQ(s.layers.size(), 2u);
}

TEST(ModelSpec, ShardedModel) {
  TempDir tmp;
  TinyModel m;
  m.write(tmp.str());
  fs::remove(tmp.file("model.safetensors"));
  SafetensorsWriter w;
  for (const auto& [name, t] : m.tensors) w.add_data(name, t.dtype, t.shape, t.bytes.data());
  w.write_model(tmp.str(), 40000);
  std::ifstream in(tmp.file("model.safetensors.index.json"));
  const json index = json::parse(in);
  std::set<std::string> shards;
  for (const auto& [name, file] : index["weight_map"].items()) shards.insert(file);
  EXPECT_GE(shards.size(), 4u);
  const ModelSpec s = load_model_spec(tmp.str());
  const auto& want = m.tensors.at("model.layers.1.mlp.down_proj.weight").bytes;
  EXPECT_EQ(std::vector<uint8_t>(s.layers[1].down.weight->data,
                                 s.layers[1].down.weight->data + s.layers[1].down.weight->nbytes),
            want);
}

// ---- GPTQ ----------------------------------------------------------------------------------

TEST(ModelSpecGptq, FourBitModel) {
  TempDir tmp;
  TinyModel m(4, 32);
  m.write(tmp.str());
  const ModelSpec s = load_model_spec(tmp.str());
  ASSERT_TRUE(s.config.quant.has_value());
  const LinearSpec& q = s.layers[1].q;
  EXPECT_TRUE(q.quantized);
  EXPECT_EQ(q.weight, nullptr);
  EXPECT_EQ(q.bits, 4);
  EXPECT_EQ(q.group_size, 32);
  EXPECT_EQ(q.zero_offset, 1);
  EXPECT_FALSE(q.act_order);
  EXPECT_EQ(q.qweight->shape, (std::vector<int64_t>{8, 64}));
  EXPECT_EQ(q.qzeros->shape, (std::vector<int64_t>{2, 8}));
  EXPECT_EQ(q.scales->shape, (std::vector<int64_t>{2, 64}));
  ASSERT_NE(q.g_idx, nullptr);
  const LinearSpec& down = s.layers[0].down;  // K = 128: 4 groups
  EXPECT_EQ(down.qweight->shape, (std::vector<int64_t>{16, 64}));
  EXPECT_EQ(down.scales->shape, (std::vector<int64_t>{4, 64}));
  EXPECT_TRUE(s.warnings.empty());
  EXPECT_EQ(s.lm_head->dtype, DType::F16);
}

TEST(ModelSpecGptq, ThreeAndEightBitAndPerChannel) {
  for (int bits : {2, 3, 8}) {
    TempDir tmp;
    TinyModel m(bits, -1);
    m.write(tmp.str());
    const ModelSpec s = load_model_spec(tmp.str());
    const LinearSpec& k = s.layers[0].k;
    EXPECT_EQ(k.bits, bits);
    EXPECT_EQ(k.group_size, -1);
    EXPECT_EQ(k.qweight->shape, (std::vector<int64_t>{64 * bits / 32, 32})) << bits;
    EXPECT_EQ(k.qzeros->shape, (std::vector<int64_t>{1, 32 * bits / 32})) << bits;
    EXPECT_EQ(k.zero_offset, 1) << bits;
    EXPECT_TRUE(s.warnings.empty()) << bits;
  }
}

TEST(ModelSpecGptq, MissingG_idxIsAllowed) {
  TempDir tmp;
  TinyModel m(4, 32);
  m.tensors.erase(std::string(kQ) + ".g_idx");
  m.write(tmp.str());
  const ModelSpec s = load_model_spec(tmp.str());
  EXPECT_EQ(s.layers[1].q.g_idx, nullptr);
  EXPECT_FALSE(s.layers[1].q.act_order);
  EXPECT_NE(s.layers[0].q.g_idx, nullptr);
}

TEST(ModelSpecGptq, ActOrderDetectedFromG_idx) {
  TempDir tmp;
  TinyModel m(4, 32);
  std::vector<int32_t> g_idx(64);
  for (int k = 0; k < 64; ++k) g_idx[k] = k % 2;  // groups interleaved, as act-order leaves them
  m.tensors[std::string(kQ) + ".g_idx"] = {DType::I32, {64}, as_bytes(g_idx)};
  m.write(tmp.str());
  const ModelSpec s = load_model_spec(tmp.str());
  EXPECT_TRUE(s.layers[1].q.act_order);
  EXPECT_FALSE(s.layers[1].k.act_order);
}

TEST(ModelSpecGptq, G_idxOutOfRange) {
  TempDir tmp;
  TinyModel m(4, 32);
  std::vector<int32_t> g_idx(64, 0);
  g_idx[37] = 2;  // G = 2
  g_idx[50] = -1;
  m.tensors[std::string(kQ) + ".g_idx"] = {DType::I32, {64}, as_bytes(g_idx)};
  m.write(tmp.str());
  const std::string msg = error_of([&] { load_model_spec(tmp.str()); });
  EXPECT_THAT(msg, HasSubstr(std::string(kQ) + ".g_idx in "));
  EXPECT_THAT(msg, HasSubstr("g_idx[37] = 2 is outside [0, 2)"));
}

TEST(ModelSpecGptq, WrongQweightShapeAndDtype) {
  TempDir tmp;
  TinyModel m(4, 32);
  m.tensors[std::string(kQ) + ".qweight"] = {DType::I32, {8, 63}, as_bytes(std::vector<int32_t>(8 * 63))};
  m.write(tmp.str());
  EXPECT_THAT(error_of([&] { load_model_spec(tmp.str()); }),
              HasSubstr(std::string(kQ) + ".qweight in " + tmp.str() +
                        "/model.safetensors: expected [8, 64] I32, found [8, 63] I32"));

  TinyModel m2(4, 32);
  m2.add_f16(std::string(kQ) + ".scales", {2, 64});
  m2.tensors[std::string(kQ) + ".scales"].dtype = DType::BF16;
  m2.write(tmp.str());
  EXPECT_THAT(error_of([&] { load_model_spec(tmp.str()); }),
              HasSubstr(".scales in " + tmp.str() + "/model.safetensors: expected [2, 64] F16, found [2, 64] BF16"));
}

TEST(ModelSpecGptq, MissingQzeros) {
  TempDir tmp;
  TinyModel m(4, 32);
  m.tensors.erase(std::string(kQ) + ".qzeros");
  m.write(tmp.str());
  EXPECT_THAT(error_of([&] { load_model_spec(tmp.str()); }),
              HasSubstr("missing tensor " + std::string(kQ) + ".qzeros"));
}

TEST(ModelSpecGptq, GptqTensorsWithoutQuantConfig) {
  TempDir tmp;
  TinyModel m(4, 32);
  m.config.erase("quantization_config");
  m.write(tmp.str());
  const std::string msg = error_of([&] { load_model_spec(tmp.str()); });
  EXPECT_THAT(msg, HasSubstr("model.layers.0.self_attn.q_proj.qweight"));
  EXPECT_THAT(msg, HasSubstr("no quantization config"));
}

TEST(ModelSpecGptq, ThreeBitNeedsMultiplesOf32) {
  TempDir tmp;
  TinyModel m(4, 32);  // the tensors are never reached: the packing check comes first
  m.config["hidden_size"] = 48;
  m.config["quantization_config"]["bits"] = 3;
  m.tensors["model.embed_tokens.weight"].shape = {96, 48};
  m.tensors["model.embed_tokens.weight"].bytes.resize(96 * 48 * 2);
  m.tensors["model.norm.weight"].shape = {48};
  m.tensors["model.norm.weight"].bytes.resize(96);
  m.tensors["lm_head.weight"].shape = {96, 48};
  m.tensors["lm_head.weight"].bytes.resize(96 * 48 * 2);
  for (int i = 0; i < 2; ++i)
    for (const char* n : {"input_layernorm.weight", "post_attention_layernorm.weight"}) {
      auto& t = m.tensors["model.layers." + std::to_string(i) + "." + n];
      t.shape = {48};
      t.bytes.resize(96);
    }
  m.write(tmp.str());
  const std::string msg = error_of([&] { load_model_spec(tmp.str()); });
  EXPECT_THAT(msg, HasSubstr("model.layers.0.self_attn.q_proj: K = 48"));
  EXPECT_THAT(msg, HasSubstr("3 bits"));
}

TEST(ModelSpecGptq, DenseLinearInsideGptqModel) {
  TempDir tmp;
  TinyModel m(4, 32);
  for (const char* t : {".qweight", ".qzeros", ".scales", ".g_idx"}) m.tensors.erase(std::string(kQ) + t);
  m.add_f16(std::string(kQ) + ".weight", {64, 64});
  m.write(tmp.str());
  const ModelSpec s = load_model_spec(tmp.str());
  EXPECT_FALSE(s.layers[1].q.quantized);
  EXPECT_TRUE(s.layers[1].k.quantized);
}

// GPTQModel's dynamic rules: layer 1 at 8 bits g64, every down_proj left FP16, the rest at the
// base 4-bit g32. Each linear's tensors are written in its own format.
TinyModel dynamic_model() {
  TinyModel m(4, 32);
  for (int i = 0; i < m.layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    for (const char* t : {".qweight", ".qzeros", ".scales", ".g_idx"}) m.tensors.erase(p + "mlp.down_proj" + t);
    m.add_f16(p + "mlp.down_proj.weight", {m.hidden, m.inter});
  }
  for (const char* l : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                        "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj"}) {
    const std::string p = std::string("model.layers.1.") + l;
    const int64_t N = m.tensors[p + ".scales"].shape[1];
    const int64_t K = m.tensors[p + ".g_idx"].shape[0];
    m.add_gptq(p, N, K, 8, 64);
  }
  m.config["quantization_config"]["dynamic"] = {
      {"-:.*down_proj", json::object()},
      {"model\\.layers\\.1\\.", {{"bits", 8}, {"group_size", 64}}}};
  return m;
}

TEST(ModelSpecDynamic, EachLinearTakesItsResolvedFormat) {
  TempDir tmp;
  dynamic_model().write(tmp.str());
  const ModelSpec s = load_model_spec(tmp.str());
  EXPECT_EQ(s.layers[0].q.bits, 4);
  EXPECT_EQ(s.layers[0].q.group_size, 32);
  EXPECT_EQ(s.layers[1].q.bits, 8);
  EXPECT_EQ(s.layers[1].q.group_size, 64);
  EXPECT_EQ(s.layers[1].q.qweight->shape, (std::vector<int64_t>{64 * 8 / 32, 64}));
  EXPECT_EQ(s.layers[1].up.scales->shape, (std::vector<int64_t>{1, 128}));
  for (const LayerSpec& L : s.layers) {
    EXPECT_FALSE(L.down.quantized);
    EXPECT_NE(L.down.weight, nullptr);
  }
  EXPECT_TRUE(s.warnings.empty());
  EXPECT_THAT(mixed_formats(s), HasSubstr("model.layers.0.self_attn.q_proj is 4-bit group 32, "
                                          "model.layers.1.self_attn.q_proj is 8-bit group 64"));
}

TEST(ModelSpecDynamic, FormatsDecideTheExpectedShapes) {
  TempDir tmp;
  TinyModel m = dynamic_model();
  m.add_gptq("model.layers.1.self_attn.k_proj", 32, 64, 4, 32);  // the base format, not the rule's
  m.write(tmp.str());
  EXPECT_THAT(error_of([&] { load_model_spec(tmp.str()); }),
              HasSubstr("model.layers.1.self_attn.k_proj.qweight in "));
  EXPECT_THAT(error_of([&] { load_model_spec(tmp.str()); }), HasSubstr("expected [16, 32] I32, found [8, 32] I32"));
}

TEST(ModelSpecDynamic, SkippedModuleHoldingGptqTensorsRefused) {
  TempDir tmp;
  TinyModel m = dynamic_model();
  m.tensors.erase("model.layers.0.mlp.down_proj.weight");
  m.add_gptq("model.layers.0.mlp.down_proj", 64, 128, 4, 32);
  m.write(tmp.str());
  EXPECT_THAT(error_of([&] { load_model_spec(tmp.str()); }),
              HasSubstr("holds model.layers.0.mlp.down_proj.qweight, but the dynamic rule "
                        "\"-:.*down_proj\" leaves model.layers.0.mlp.down_proj unquantized"));
}

TEST(ModelSpecDynamic, RuleMatchingNoModuleRefused) {
  TempDir tmp;
  TinyModel m(4, 32);
  m.config["quantization_config"]["dynamic"] = {{"-:model\\.layers\\.2\\..*", json::object()}};
  m.write(tmp.str());
  EXPECT_THAT(error_of([&] { load_model_spec(tmp.str()); }),
              HasSubstr(": dynamic rule \"-:model\\.layers\\.2\\..*\" matches no module of this model"));
  // lm_head is a module a "-:" rule may name (it is FP16 anyway).
  m.config["quantization_config"]["dynamic"] = {{"-:lm_head", json::object()}};
  m.write(tmp.str());
  EXPECT_TRUE(mixed_formats(load_model_spec(tmp.str())).empty());
}

TEST(ModelSpecDynamic, Fp16ModulesDoNotMakeFormatsMixed) {
  TempDir tmp;
  TinyModel m = dynamic_model();
  m.config["quantization_config"]["dynamic"] = {{"-:.*down_proj", json::object()}};
  for (const char* l : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                        "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj"}) {
    const std::string p = std::string("model.layers.1.") + l;
    const int64_t N = m.tensors[p + ".scales"].shape[1];
    const int64_t K = m.tensors[p + ".g_idx"].shape[0];
    m.add_gptq(p, N, K, 4, 32);
  }
  m.write(tmp.str());
  const ModelSpec s = load_model_spec(tmp.str());
  EXPECT_FALSE(s.layers[1].down.quantized);
  EXPECT_EQ(mixed_formats(s), "");
}

TEST(ModelSpecGptq, V2ZerosLabelledV1AreDetected) {
  TempDir tmp;
  TinyModel m(4, 32);
  for (int i = 0; i < 2; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    // 0x88888888 words: every 4-bit field 8, where symmetric gptq (v1) stores 7 (0x77777777).
    m.tensors[p + "self_attn.q_proj.qzeros"] = {DType::I32, {2, 8},
                                                as_bytes(std::vector<uint32_t>(16, 0x88888888u))};
  }
  m.write(tmp.str());
  const ModelSpec s = load_model_spec(tmp.str());
  EXPECT_EQ(s.layers[0].q.zero_offset, 0);
  EXPECT_EQ(s.layers[1].q.zero_offset, 0);
  EXPECT_EQ(s.layers[1].k.zero_offset, 1);
  ASSERT_EQ(s.warnings.size(), 1u);
  EXPECT_THAT(s.warnings[0], HasSubstr("2 of 14 quantized linears"));
  EXPECT_THAT(s.warnings[0], HasSubstr("model.layers.0.self_attn.q_proj"));
  EXPECT_THAT(s.warnings[0], HasSubstr("gptq_v2"));
}

TEST(ModelSpecGptq, V2ZerosDetectedAtThreeBits) {
  TempDir tmp;
  TinyModel m(3, 32);
  m.set_zeros(kQ, 64, 2, 3, 4);  // every 3-bit field 4: v2 symmetric zeros
  m.write(tmp.str());
  const ModelSpec s = load_model_spec(tmp.str());
  EXPECT_EQ(s.layers[1].q.zero_offset, 0);
  EXPECT_EQ(s.layers[1].v.zero_offset, 1);
  EXPECT_EQ(s.warnings.size(), 1u);
}

TEST(ModelSpecGptq, ThreeBitV1ZerosMatchTheDocumentedWords) {
  // The words the format doc lists for symmetric 3-bit gptq: no warning, offset 1.
  TempDir tmp;
  TinyModel m(3, 32);
  std::vector<uint32_t> words;
  for (int i = 0; i < 2 * 2; ++i) words.insert(words.end(), {0xDB6DB6DBu, 0xB6DB6DB6u, 0x6DB6DB6Du});
  m.tensors[std::string(kQ) + ".qzeros"] = {DType::I32, {2, 6}, as_bytes(words)};
  m.write(tmp.str());
  const ModelSpec s = load_model_spec(tmp.str());
  EXPECT_EQ(s.layers[1].q.zero_offset, 1);
  EXPECT_TRUE(s.warnings.empty());
}

TEST(ModelSpecGptq, MixedZerosAreNotReinterpreted) {
  TempDir tmp;
  TinyModel m(4, 32);
  std::vector<uint32_t> words(16, 0x88888888u);
  words[5] = 0x88888878u;  // one field is not a v2 zero: leave the file's label alone
  m.tensors[std::string(kQ) + ".qzeros"] = {DType::I32, {2, 8}, as_bytes(words)};
  m.write(tmp.str());
  const ModelSpec s = load_model_spec(tmp.str());
  EXPECT_EQ(s.layers[1].q.zero_offset, 1);
  EXPECT_TRUE(s.warnings.empty());
}

TEST(ModelSpecGptq, V2LabelledModelUsesOffsetZero) {
  TempDir tmp;
  TinyModel m(4, 32);
  m.config["quantization_config"]["checkpoint_format"] = "gptq_v2";
  m.write(tmp.str());
  const ModelSpec s = load_model_spec(tmp.str());
  EXPECT_EQ(s.layers[0].q.zero_offset, 0);
  EXPECT_TRUE(s.warnings.empty());
}

TEST(ModelSpecGptq, ModelFileBaseNameLookup) {
  TempDir tmp;
  TinyModel m(4, 32);
  m.config.erase("quantization_config");
  m.quantize_config = {{"bits", 4}, {"group_size", 32}, {"desc_act", false}, {"sym", true},
                       {"model_file_base_name", "gptq_model-4bit-32g"}};
  m.write(tmp.str(), "gptq_model-4bit-32g");
  ASSERT_FALSE(fs::exists(tmp.file("model.safetensors")));
  const ModelSpec s = load_model_spec(tmp.str());
  EXPECT_EQ(s.layers[0].q.qweight->file, tmp.file("gptq_model-4bit-32g.safetensors"));

  fs::remove(tmp.file("gptq_model-4bit-32g.safetensors"));
  const std::string msg = error_of([&] { load_model_spec(tmp.str()); });
  EXPECT_THAT(msg, HasSubstr("no gptq_model-4bit-32g.safetensors, gptq_model-4bit-32g.safetensors.index.json"));

  // Re-saved by transformers: the base name stays in quantize_config.json, the weights move.
  m.write(tmp.str(), "model");
  EXPECT_EQ(load_model_spec(tmp.str()).layers[0].q.qweight->file, tmp.file("model.safetensors"));
}

// ---- tensors the model does not use ------------------------------------------------------------

TEST(ModelSpec, UnusedTensorsRefused) {
  TempDir tmp;
  TinyModel m;
  m.add_f16("model.layers.0.mlp.extra_proj.weight", {8});
  m.write(tmp.str());
  EXPECT_EQ(error_of([&] { load_model_spec(tmp.str()); }),
            tmp.str() + ": the checkpoint holds 1 tensor that LlamaForCausalLM as config.json "
                        "describes it does not use: model.layers.0.mlp.extra_proj.weight");

  // A third layer where config.json says two: the first three named, the count of the rest.
  TinyModel m2;
  for (const char* t : {"input_layernorm", "post_attention_layernorm"})
    m2.add_f16(std::string("model.layers.2.") + t + ".weight", {64});
  for (const char* t : {"q_proj", "o_proj"}) m2.add_f16(std::string("model.layers.2.self_attn.") + t + ".weight", {64, 64});
  m2.write(tmp.str());
  EXPECT_THAT(error_of([&] { load_model_spec(tmp.str()); }),
              HasSubstr("holds 4 tensors that LlamaForCausalLM as config.json describes it does not "
                        "use: model.layers.2.input_layernorm.weight, "
                        "model.layers.2.post_attention_layernorm.weight, "
                        "model.layers.2.self_attn.o_proj.weight and 1 more"));
}

TEST(ModelSpec, KnownHarmlessTensorsSkipped) {
  TempDir tmp;
  TinyModel m(0, 32, /*tie=*/true);
  for (int i = 0; i < 2; ++i)
    m.add_f16("model.layers." + std::to_string(i) + ".self_attn.rotary_emb.inv_freq", {8});
  m.add_f16("lm_head.weight", {96, 64});  // a saved copy of the tied embedding
  m.write(tmp.str());
  const ModelSpec s = load_model_spec(tmp.str());
  EXPECT_EQ(s.lm_head, s.embed);
  EXPECT_TRUE(s.warnings.empty());
}

TEST(ModelSpecGptq, QuantizedLmHeadTensorsRefused) {
  TempDir tmp;
  TinyModel m(4, 32);
  m.add_gptq("lm_head", 96, 64, 4, 32);  // beside the dense lm_head.weight
  m.write(tmp.str());
  EXPECT_THAT(error_of([&] { load_model_spec(tmp.str()); }),
              HasSubstr("holds 4 tensors that LlamaForCausalLM as config.json describes it does not "
                        "use: lm_head.g_idx, lm_head.qweight, lm_head.qzeros and 1 more"));
}

TEST(ModelSpecGptq, DescActWithoutG_idxRefused) {
  TempDir tmp;
  TinyModel m(4, 32);
  m.config["quantization_config"]["desc_act"] = true;
  m.tensors.erase(std::string(kQ) + ".g_idx");
  m.write(tmp.str());
  EXPECT_EQ(error_of([&] { load_model_spec(tmp.str()); }),
            tmp.str() + ": missing tensor " + kQ + ".g_idx (desc_act is true: act-order needs "
                        "each column's group)");
}

// ---- NaN and Inf ---------------------------------------------------------------------------------

// Sets element i of a tensor of m to the raw 16-bit value `bits`.
void poke16(TinyModel& m, const std::string& name, size_t i, uint16_t bits) {
  std::memcpy(m.tensors.at(name).bytes.data() + 2 * i, &bits, 2);
}

TEST(ModelSpec, NonFiniteWeightsRefusedNamingTheElement) {
  TempDir tmp;
  {
    TinyModel m;
    poke16(m, "model.layers.1.mlp.up_proj.weight", 64 * 3 + 17, 0x7E00);  // NaN at [3, 17]
    poke16(m, "model.layers.1.mlp.down_proj.weight", 5, 0x7C00);          // later in model order
    m.write(tmp.str());
    EXPECT_EQ(error_of([&] { load_model_spec(tmp.str()); }),
              "model.layers.1.mlp.up_proj.weight in " + tmp.str() +
                  "/model.safetensors: element 209 ([3, 17]) is NaN; a checkpoint's weights must "
                  "be finite");
  }
  {
    TinyModel m;
    poke16(m, "model.norm.weight", 63, 0xFC00);  // -Inf in a norm
    m.write(tmp.str());
    EXPECT_THAT(error_of([&] { load_model_spec(tmp.str()); }),
                HasSubstr("model.norm.weight in " + tmp.str() + "/model.safetensors: element 63 is -Inf"));
  }
  {
    TinyModel m;
    poke16(m, "model.embed_tokens.weight", 95 * 64 + 63, 0x7C00);  // the very last element
    m.write(tmp.str());
    EXPECT_THAT(error_of([&] { load_model_spec(tmp.str()); }),
                HasSubstr("model.embed_tokens.weight in " + tmp.str() +
                          "/model.safetensors: element 6143 ([95, 63]) is Inf"));
  }
  {  // BF16 and F32 weights
    TinyModel m;
    std::vector<uint16_t> bf(64, float_to_bf16(1.0f));
    bf[9] = 0x7F81;  // a NaN
    m.tensors["model.layers.0.input_layernorm.weight"] = {DType::BF16, {64}, as_bytes(bf)};
    std::vector<float> f(64 * 64, 0.5f);
    f[100] = std::numeric_limits<float>::infinity();
    m.tensors["model.layers.0.self_attn.o_proj.weight"] = {DType::F32, {64, 64}, as_bytes(f)};
    m.write(tmp.str());
    EXPECT_THAT(error_of([&] { load_model_spec(tmp.str()); }),
                HasSubstr("model.layers.0.input_layernorm.weight in " + tmp.str() +
                          "/model.safetensors: element 9 is NaN"));
    m.tensors["model.layers.0.input_layernorm.weight"] = {DType::BF16, {64}, as_bytes(std::vector<uint16_t>(64, float_to_bf16(1.0f)))};
    m.write(tmp.str());
    EXPECT_THAT(error_of([&] { load_model_spec(tmp.str()); }),
                HasSubstr("model.layers.0.self_attn.o_proj.weight in " + tmp.str() +
                          "/model.safetensors: element 100 ([1, 36]) is Inf"));
  }
  {  // a bias
    TinyModel m;
    m.config["attention_bias"] = true;
    for (int i = 0; i < 2; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".self_attn.";
      m.add_f16(p + "q_proj.bias", {64});
      m.add_f16(p + "k_proj.bias", {32});
      m.add_f16(p + "v_proj.bias", {32});
      m.add_f16(p + "o_proj.bias", {64});
    }
    poke16(m, "model.layers.1.self_attn.v_proj.bias", 31, 0x7D00);
    m.write(tmp.str());
    EXPECT_THAT(error_of([&] { load_model_spec(tmp.str()); }),
                HasSubstr("model.layers.1.self_attn.v_proj.bias in " + tmp.str() +
                          "/model.safetensors: element 31 is NaN"));
  }
}

TEST(ModelSpecGptq, NonFiniteScalesRefused) {
  TempDir tmp;
  TinyModel m(4, 32);
  poke16(m, std::string(kQ) + ".scales", 64 + 5, 0x7C00);  // Inf at [1, 5]
  m.write(tmp.str());
  EXPECT_EQ(error_of([&] { load_model_spec(tmp.str()); }),
            std::string(kQ) + ".scales in " + tmp.str() +
                "/model.safetensors: element 69 ([1, 5]) is Inf; a checkpoint's weights must be "
                "finite");
}

// Largest finite values and subnormals are finite; every exponent-all-ones pattern is not.
TEST(Finite, EveryDtypeBitPattern) {
  auto info = [](DType d, const std::vector<uint8_t>& bytes) {
    TensorInfo t;
    t.name = "t";
    t.dtype = d;
    t.shape = {(int64_t)(bytes.size() / dtype_size(d))};
    t.data = bytes.data();
    t.nbytes = bytes.size();
    return t;
  };
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const std::vector<uint16_t> one = {0x3C00, (uint16_t)bits};
    const bool f16_bad = (bits & 0x7C00) == 0x7C00, bf16_bad = (bits & 0x7F80) == 0x7F80;
    const std::vector<uint8_t> b = as_bytes(one);
    ASSERT_EQ(first_non_finite(info(DType::F16, b)), f16_bad ? 1 : -1) << std::hex << bits;
    ASSERT_EQ(first_non_finite(info(DType::BF16, b)), bf16_bad ? 1 : -1) << std::hex << bits;
  }
  for (float v : {std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::denorm_min(), 0.0f, -0.0f}) {
    EXPECT_EQ(first_non_finite(info(DType::F32, as_bytes(std::vector<float>{1, v}))), -1) << v;
  }
  for (float v : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN()}) {
    EXPECT_EQ(first_non_finite(info(DType::F32, as_bytes(std::vector<float>{1, 2, v}))), 2) << v;
  }
  EXPECT_EQ(first_non_finite(info(DType::I32, as_bytes(std::vector<int32_t>{0x7F800000}))), -1);
}

// Over many chunks and threads, the answer is the first bad element in list order, wherever
// the threads happen to find one first.
TEST(Finite, FirstInListOrderAcrossChunks) {
  const size_t n = size_t(48) << 20;  // 96 MiB of F16 per tensor: 12 chunks each
  std::vector<uint16_t> a(n, 0x3C00), b(n, 0x3C00), c(n, 0x3C00);
  b[n - 1] = 0x7C00;
  c[3] = 0x7E00;
  auto info = [](const char* name, const std::vector<uint16_t>& v) {
    TensorInfo t;
    t.name = name;
    t.file = "f";
    t.dtype = DType::F16;
    t.shape = {(int64_t)v.size()};
    t.data = reinterpret_cast<const uint8_t*>(v.data());
    t.nbytes = v.size() * 2;
    return t;
  };
  const TensorInfo ta = info("a", a), tb = info("b", b), tc = info("c", c);
  EXPECT_NO_THROW(check_finite({&ta}));
  EXPECT_EQ(error_of([&] { check_finite({&ta, &tb, &tc}); }),
            fmt::format("b in f: element {} is Inf; a checkpoint's weights must be finite", n - 1));
  EXPECT_THAT(error_of([&] { check_finite({&ta, &tc, &tb}); }), HasSubstr("c in f: element 3 is NaN"));
}

}  // namespace
}  // namespace kestrel
