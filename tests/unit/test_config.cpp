#include "models/io/config.h"

#include <gtest/gtest.h>

#include "models/io/generation_config.h"
#include "tests/support/fifo.h"
#include "tests/support/test_loader_util.h"

namespace kestrel {
namespace {

namespace fs = std::filesystem;
using test::error_of;
using test::json;
using test::TempDir;
using ::testing::HasSubstr;

json llama_config() {
  return {{"architectures", {"LlamaForCausalLM"}},
          {"hidden_size", 256},
          {"intermediate_size", 688},
          {"num_hidden_layers", 3},
          {"num_attention_heads", 8},
          {"num_key_value_heads", 2},
          {"rms_norm_eps", 1e-5},
          {"rope_theta", 500000.0},
          {"rope_scaling", nullptr},
          {"max_position_embeddings", 2048},
          {"vocab_size", 32000},
          {"tie_word_embeddings", false},
          {"bos_token_id", 1},
          {"eos_token_id", 2},
          {"torch_dtype", "float16"},
          {"head_dim", nullptr},
          {"sliding_window", nullptr}};
}

// Writes config.json (and quantize_config.json when given) and loads the directory.
struct Dir {
  TempDir tmp;
  ModelConfig load(const json& config, const json& quantize_config = nullptr) {
    test::write_text(tmp.file("config.json"), config.dump());
    if (!quantize_config.is_null()) test::write_text(tmp.file("quantize_config.json"), quantize_config.dump());
    return load_model_config(tmp.str());
  }
  std::string error(const json& config, const json& quantize_config = nullptr) {
    return error_of([&] { load(config, quantize_config); });
  }
};

TEST(Config, LlamaFields) {
  Dir d;
  const ModelConfig c = d.load(llama_config());
  EXPECT_EQ(c.architecture, "LlamaForCausalLM");
  EXPECT_EQ(c.hidden, 256);
  EXPECT_EQ(c.intermediate, 688);
  EXPECT_EQ(c.n_layers, 3);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 32);  // null head_dim: hidden / heads
  EXPECT_EQ(c.q_dim(), 256);
  EXPECT_EQ(c.kv_dim(), 64);
  EXPECT_FLOAT_EQ(c.rms_eps, 1e-5f);
  EXPECT_FLOAT_EQ(c.rope_theta, 500000.0f);
  EXPECT_FLOAT_EQ(c.rope_linear_factor, 1.0f);
  EXPECT_EQ(c.max_pos, 2048);
  EXPECT_EQ(c.vocab, 32000);
  EXPECT_FALSE(c.tie_embeddings);
  EXPECT_EQ(c.dtype, DType::F16);
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias);
  EXPECT_EQ(c.family, "llama");
  EXPECT_EQ(c.norm, NormKind::RMS);
  EXPECT_EQ(c.mlp, MlpKind::GatedSiLU);
  EXPECT_EQ(c.positions, PositionKind::Rope);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_FALSE(c.quant.has_value());
}

TEST(Config, MistralWithSlidingWindowAndBf16) {
  Dir d;
  json j = llama_config();
  j["architectures"] = {"MistralForCausalLM"};
  j["sliding_window"] = 4096;
  j["torch_dtype"] = "bfloat16";
  j["tie_word_embeddings"] = true;
  j["attention_bias"] = true;
  const ModelConfig c = d.load(j);
  EXPECT_EQ(c.sliding_window, 4096);
  EXPECT_EQ(c.dtype, DType::BF16);
  EXPECT_TRUE(c.tie_embeddings);
  // Mistral's layers have no biases (transformers' MistralConfig has no attention_bias).
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias);
  EXPECT_EQ(c.family, "mistral");
}

// transformers' Llama ignores a sliding_window in its config: attention stays full.
TEST(Config, LlamaIgnoresSlidingWindow) {
  Dir d;
  json j = llama_config();
  j["sliding_window"] = 16;
  j["attention_bias"] = true;
  const ModelConfig c = d.load(j);
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_TRUE(c.qkv_bias && c.o_bias);
}

TEST(Config, DefaultsWhenOptionalFieldsAbsent) {
  Dir d;
  json j = llama_config();
  for (const char* k : {"num_key_value_heads", "rope_theta", "rope_scaling", "head_dim",
                        "sliding_window", "torch_dtype", "tie_word_embeddings"})
    j.erase(k);
  const ModelConfig c = d.load(j);
  EXPECT_EQ(c.n_kv_heads, 8);  // MHA
  EXPECT_EQ(c.head_dim, 32);
  EXPECT_FLOAT_EQ(c.rope_theta, 10000.0f);
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_EQ(c.dtype, DType::F16);
  EXPECT_FALSE(c.tie_embeddings);
}

TEST(Config, HeadDimPresentOverridesHiddenOverHeads) {
  Dir d;
  json j = llama_config();
  j["head_dim"] = 64;  // q_dim 512 != hidden 256, as in some Mistral variants
  const ModelConfig c = d.load(j);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.q_dim(), 512);
  EXPECT_EQ(c.kv_dim(), 128);
}

TEST(Config, HeadDimPresentAllowsHiddenNotMultipleOfHeads) {
  Dir d;
  json j = llama_config();
  j["hidden_size"] = 250;
  j["head_dim"] = 32;
  EXPECT_EQ(d.load(j).head_dim, 32);
  j.erase("head_dim");
  const std::string msg = d.error(j);
  EXPECT_THAT(msg, HasSubstr("hidden_size 250 is not a multiple of num_attention_heads 8"));
}

TEST(Config, OddHeadDimRejected) {
  Dir d;
  json j = llama_config();
  j["head_dim"] = 33;
  EXPECT_THAT(d.error(j), HasSubstr("head_dim 33 must be even"));
}

TEST(Config, HeadsNotMultipleOfKvHeads) {
  Dir d;
  json j = llama_config();
  j["num_key_value_heads"] = 3;
  EXPECT_THAT(d.error(j), HasSubstr("num_attention_heads 8 is not a multiple of num_key_value_heads 3"));
}

TEST(Config, MissingAndNonPositiveFields) {
  Dir d;
  json j = llama_config();
  j.erase("hidden_size");
  EXPECT_THAT(d.error(j), HasSubstr("config.json: missing hidden_size"));
  j = llama_config();
  j["num_hidden_layers"] = 0;
  EXPECT_THAT(d.error(j), HasSubstr("num_hidden_layers = 0 must be positive"));
  j = llama_config();
  j["vocab_size"] = "many";
  EXPECT_THAT(d.error(j), HasSubstr("vocab_size must be an integer, found \"many\""));
}

TEST(Config, UnsupportedArchitectureNamed) {
  Dir d;
  json j = llama_config();
  j["architectures"] = {"GemmaForCausalLM"};
  EXPECT_THAT(d.error(j), HasSubstr("unsupported architectures [\"GemmaForCausalLM\"] (supported: "
                                    "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
                                    "Qwen3ForCausalLM, OPTForCausalLM)"));
  j.erase("architectures");
  EXPECT_THAT(d.error(j), HasSubstr("missing architectures"));
}

// Two classes would leave it to chance which layout the weights follow (the first supported
// one was taken before).
TEST(Config, TwoArchitecturesRefused) {
  Dir d;
  json j = llama_config();
  j["architectures"] = {"LlamaForCausalLM", "MistralForCausalLM"};
  EXPECT_EQ(d.error(j), d.tmp.file("config.json") +
                            ": architectures lists 2 classes ([\"LlamaForCausalLM\",\"MistralForCausalLM\"]); "
                            "a checkpoint must name one");
  j["architectures"] = {"GemmaForCausalLM", "LlamaForCausalLM"};
  EXPECT_THAT(d.error(j), HasSubstr("architectures lists 2 classes"));
}

TEST(Config, HiddenActOtherThanSiluRefused) {
  Dir d;
  for (const char* family : {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                             "Qwen3ForCausalLM"}) {
    json j = llama_config();
    j["architectures"] = {family};
    j["hidden_act"] = "gelu";
    EXPECT_EQ(d.error(j), d.tmp.file("config.json") +
                              ": hidden_act gelu is not supported (this family's MLP uses silu)")
        << family;
    j["hidden_act"] = 3;
    EXPECT_THAT(d.error(j), HasSubstr("hidden_act must be a string, found 3")) << family;
    for (const char* same : {"silu", "swish"}) {
      j["hidden_act"] = same;
      EXPECT_EQ(d.load(j).mlp, MlpKind::GatedSiLU) << family << " " << same;
    }
  }
}

TEST(Config, UnsupportedDtypeNamed) {
  Dir d;
  json j = llama_config();
  j["torch_dtype"] = "float8_e4m3fn";
  EXPECT_THAT(d.error(j), HasSubstr("unsupported torch_dtype float8_e4m3fn"));
}

TEST(Config, Transformers5DtypeSpelling) {
  Dir d;
  json j = llama_config();
  j.erase("torch_dtype");
  j["dtype"] = "bfloat16";
  EXPECT_EQ(d.load(j).dtype, DType::BF16);
}

TEST(Config, RopeScalingLinear) {
  Dir d;
  json j = llama_config();
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 4.0}};
  EXPECT_FLOAT_EQ(d.load(j).rope_linear_factor, 4.0f);
  j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 2.5}};
  const ModelConfig c = d.load(j);
  EXPECT_FLOAT_EQ(c.rope_linear_factor, 2.5f);
  EXPECT_FLOAT_EQ(c.rope_theta, 500000.0f);
}

TEST(Config, RopeScalingOtherTypesRejectedByName) {
  Dir d;
  json j = llama_config();
  j["rope_scaling"] = {{"type", "dynamic"}, {"factor", 2.0}};
  EXPECT_THAT(d.error(j), HasSubstr("unsupported type dynamic"));
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  EXPECT_THAT(d.error(j), HasSubstr("unsupported rope_type yarn (supported: default, linear, llama3)"));
  j["rope_scaling"] = {{"type", "linear"}};
  EXPECT_THAT(d.error(j), HasSubstr("without factor"));
}

TEST(Config, RopeParameters) {
  Dir d;
  json j = llama_config();
  j.erase("rope_theta");
  j.erase("rope_scaling");
  j["rope_parameters"] = {{"rope_theta", 1000000.0}, {"rope_type", "default"}};
  ModelConfig c = d.load(j);
  EXPECT_FLOAT_EQ(c.rope_theta, 1000000.0f);
  EXPECT_FLOAT_EQ(c.rope_linear_factor, 1.0f);

  j["rope_parameters"] = {{"rope_theta", 20000.0}, {"rope_type", "linear"}, {"factor", 8.0}};
  c = d.load(j);
  EXPECT_FLOAT_EQ(c.rope_theta, 20000.0f);
  EXPECT_FLOAT_EQ(c.rope_linear_factor, 8.0f);

  j["rope_parameters"] = {{"rope_theta", 500000.0}, {"rope_type", "yarn"}};
  EXPECT_THAT(d.error(j), HasSubstr("rope_parameters: unsupported rope_type yarn"));
}

// Llama 3.1's rope_scaling, as its config.json writes it.
TEST(Config, RopeScalingLlama3) {
  Dir d;
  json j = llama_config();
  j["rope_scaling"] = {{"factor", 8.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 8192}, {"rope_type", "llama3"}};
  ModelConfig c = d.load(j);
  EXPECT_FLOAT_EQ(c.rope_llama3.factor, 8.0f);
  EXPECT_FLOAT_EQ(c.rope_llama3.low_freq_factor, 1.0f);
  EXPECT_FLOAT_EQ(c.rope_llama3.high_freq_factor, 4.0f);
  EXPECT_EQ(c.rope_llama3.original_max_pos, 8192);
  EXPECT_FLOAT_EQ(c.rope_linear_factor, 1.0f);
  j["rope_scaling"]["high_freq_factor"] = 0.5;
  EXPECT_THAT(d.error(j), HasSubstr("low_freq_factor < high_freq_factor"));
  j.erase("rope_scaling");
  j["rope_parameters"] = {{"rope_theta", 500000.0}, {"rope_type", "llama3"}, {"factor", 32.0},
                          {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                          {"original_max_position_embeddings", 8192}};
  c = d.load(j);
  EXPECT_FLOAT_EQ(c.rope_llama3.factor, 32.0f);
  EXPECT_FLOAT_EQ(c.rope_theta, 500000.0f);
}

// Qwen2.5-7B-Instruct's config.json, shortened: biases on q, k, v only; the window it carries
// is off (use_sliding_window false) and a window that is on is refused.
TEST(Config, Qwen2) {
  Dir d;
  json j = llama_config();
  j["architectures"] = {"Qwen2ForCausalLM"};
  j["rope_theta"] = 1000000.0;
  j["sliding_window"] = 131072;
  j["use_sliding_window"] = false;
  j["max_window_layers"] = 28;
  j["tie_word_embeddings"] = true;
  ModelConfig c = d.load(j);
  EXPECT_EQ(c.family, "qwen2");
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias);
  EXPECT_FALSE(c.mlp_bias);
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_TRUE(c.tie_embeddings);
  EXPECT_FLOAT_EQ(c.rope_theta, 1e6f);
  j["use_sliding_window"] = true;
  EXPECT_THAT(d.error(j), HasSubstr("use_sliding_window true"));
  j["use_sliding_window"] = false;
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32768}};
  EXPECT_THAT(d.error(j), HasSubstr("unsupported type yarn"));
}

TEST(Config, Qwen3) {
  Dir d;
  json j = llama_config();
  j["architectures"] = {"Qwen3ForCausalLM"};
  j["head_dim"] = 128;  // independent of hidden / heads (256 / 8 = 32)
  j["attention_bias"] = false;
  const ModelConfig c = d.load(j);
  EXPECT_EQ(c.family, "qwen3");
  EXPECT_TRUE(c.qk_norm);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.q_dim(), 1024);
  EXPECT_FALSE(c.qkv_bias);
}

// facebook/opt-125m's config.json.
json opt_config() {
  return {{"architectures", {"OPTForCausalLM"}}, {"activation_function", "relu"},
          {"do_layer_norm_before", true}, {"enable_bias", true}, {"ffn_dim", 3072},
          {"hidden_size", 768}, {"layer_norm_elementwise_affine", true},
          {"max_position_embeddings", 2048}, {"num_attention_heads", 12},
          {"num_hidden_layers", 12}, {"torch_dtype", "float16"}, {"vocab_size", 50272},
          {"word_embed_proj_dim", 768}, {"bos_token_id", 2}, {"eos_token_id", 2}};
}

// Learned positions end at max_position_embeddings: a longer context is refused.
TEST(Config, LearnedPositionsBoundTheContext) {
  Dir d;
  const ModelConfig opt = d.load(opt_config());
  EXPECT_NO_THROW(opt.check_context(2048));
  EXPECT_THAT(error_of([&] { opt.check_context(2049); }),
              HasSubstr("a context of 2049 positions is past the 2048"));
  EXPECT_NO_THROW(d.load(llama_config()).check_context(1 << 20));  // RoPE extrapolates
}

TEST(Config, Opt) {
  Dir d;
  json j = opt_config();
  const ModelConfig c = d.load(j);
  EXPECT_EQ(c.family, "opt");
  EXPECT_EQ(c.hidden, 768);
  EXPECT_EQ(c.intermediate, 3072);
  EXPECT_EQ(c.n_kv_heads, 12);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.norm, NormKind::Layer);
  EXPECT_FLOAT_EQ(c.rms_eps, 1e-5f);
  EXPECT_EQ(c.mlp, MlpKind::ReLU);
  EXPECT_EQ(c.positions, PositionKind::Learned);
  EXPECT_EQ(c.position_offset, 2);
  EXPECT_TRUE(c.qkv_bias && c.o_bias && c.mlp_bias);
  EXPECT_TRUE(c.tie_embeddings);
}

TEST(Config, OptVariantsRefused) {
  Dir d;
  json j = opt_config();
  j["enable_bias"] = false;
  EXPECT_THAT(d.error(j), HasSubstr("enable_bias false"));
  j = opt_config();
  j["do_layer_norm_before"] = false;  // OPT-350m
  EXPECT_THAT(d.error(j), HasSubstr("do_layer_norm_before false"));
  j = opt_config();
  j["word_embed_proj_dim"] = 512;
  EXPECT_THAT(d.error(j), HasSubstr("word_embed_proj_dim 512 differs from hidden_size 768"));
  j = opt_config();
  j["activation_function"] = "gelu";
  EXPECT_THAT(d.error(j), HasSubstr("activation_function gelu is not supported"));
  j = opt_config();
  j.erase("ffn_dim");
  EXPECT_THAT(d.error(j), HasSubstr("missing ffn_dim"));
}

TEST(Config, MissingConfigJson) {
  TempDir tmp;
  EXPECT_THAT(error_of([&] { load_model_config(tmp.str()); }), HasSubstr("no config.json"));
  EXPECT_THAT(error_of([&] { load_model_config(tmp.file("absent")); }), HasSubstr("no such directory"));
}

TEST(Config, ConfigJsonNotARegularFile) {
  TempDir tmp;
  fs::create_directories(tmp.file("config.json"));
  EXPECT_EQ(error_of([&] { load_model_config(tmp.str()); }), tmp.file("config.json") + " is a directory");
  fs::remove(tmp.file("config.json"));
  test::make_fifo(tmp.file("config.json"));
  EXPECT_EQ(test::error_without_blocking(tmp.file("config.json"),
                                         [&] { load_model_config(tmp.str()); }),
            tmp.file("config.json") + " is not a regular file (a FIFO)");
}

TEST(Config, QuantizeConfigNotARegularFile) {
  Dir d;
  test::write_text(d.tmp.file("config.json"), llama_config().dump());
  test::make_fifo(d.tmp.file("quantize_config.json"));
  EXPECT_EQ(test::error_without_blocking(d.tmp.file("quantize_config.json"),
                                         [&] { load_model_config(d.tmp.str()); }),
            d.tmp.file("quantize_config.json") + " is not a regular file (a FIFO)");
  fs::remove(d.tmp.file("quantize_config.json"));
  fs::create_directories(d.tmp.file("quantize_config.json"));
  EXPECT_EQ(error_of([&] { load_model_config(d.tmp.str()); }),
            d.tmp.file("quantize_config.json") + " is a directory");
}

TEST(Config, InvalidJson) {
  TempDir tmp;
  test::write_text(tmp.file("config.json"), "{\"hidden_size\": ");
  EXPECT_THAT(error_of([&] { load_model_config(tmp.str()); }), HasSubstr("config.json: not valid JSON"));
}

// ---- quantization config -------------------------------------------------------------------

json gptq_qc() {
  return {{"quant_method", "gptq"}, {"bits", 4},     {"group_size", 128},
          {"desc_act", true},       {"sym", true},   {"checkpoint_format", "gptq"},
          {"damp_percent", 0.1},    {"static_groups", true}};
}

TEST(QuantConfig, FromConfigJson) {
  Dir d;
  json j = llama_config();
  j["quantization_config"] = gptq_qc();
  const ModelConfig c = d.load(j);
  ASSERT_TRUE(c.quant.has_value());
  EXPECT_EQ(c.quant->bits, 4);
  EXPECT_EQ(c.quant->group_size, 128);
  EXPECT_TRUE(c.quant->desc_act);
  EXPECT_TRUE(c.quant->sym);
  EXPECT_EQ(c.quant->format, GptqFormat::V1);
  EXPECT_EQ(c.quant->zero_offset(), 1);
  EXPECT_FLOAT_EQ(c.quant->damp_percent, 0.1f);
  EXPECT_TRUE(c.quant->static_groups);
}

TEST(QuantConfig, FromQuantizeConfigJsonWithBaseName) {
  Dir d;
  const json qc = {{"bits", 3}, {"group_size", 64}, {"desc_act", false}, {"sym", false},
                   {"format", "gptq_v2"}, {"model_file_base_name", "gptq_model-3bit-64g"}};
  const ModelConfig c = d.load(llama_config(), qc);
  ASSERT_TRUE(c.quant.has_value());
  EXPECT_EQ(c.quant->bits, 3);
  EXPECT_EQ(c.quant->group_size, 64);
  EXPECT_FALSE(c.quant->sym);
  EXPECT_EQ(c.quant->format, GptqFormat::V2);
  EXPECT_EQ(c.quant->zero_offset(), 0);
  EXPECT_EQ(c.quant->model_file_base_name, "gptq_model-3bit-64g");
}

TEST(QuantConfig, GroupSizeDefaultsDifferBySource) {
  const QuantConfig a = parse_quant_config(R"({"bits": 4})", "/m/quantize_config.json");
  EXPECT_EQ(a.group_size, -1);
  const QuantConfig b =
      parse_quant_config(R"({"bits": 4, "quant_method": "gptq"})", "/m/config.json quantization_config");
  EXPECT_EQ(b.group_size, 128);
  EXPECT_EQ(parse_quant_config(R"({"bits": 8})", "x", QuantConfigSource::QuantizeConfigJson).group_size, -1);
  const QuantConfig e = parse_quant_config("{}", "x", QuantConfigSource::QuantizeConfigJson);
  EXPECT_EQ(e.bits, 4);
  EXPECT_TRUE(e.sym);
  EXPECT_FALSE(e.desc_act);
  EXPECT_EQ(e.format, GptqFormat::V1);
}

TEST(QuantConfig, MethodAliasAndRequirement) {
  EXPECT_EQ(parse_quant_config(R"({"method": "gptq", "bits": 2})", "x", QuantConfigSource::ConfigJson).bits, 2);
  EXPECT_THAT(error_of([] { parse_quant_config(R"({"bits": 4})", "cfg", QuantConfigSource::ConfigJson); }),
              HasSubstr("cfg: missing quant_method"));
}

std::string quant_error(const std::string& text) {
  return error_of([&] { parse_quant_config(text, "/m/config.json quantization_config"); });
}

TEST(QuantConfig, UnsupportedMethodsAndFormatsNamed) {
  EXPECT_THAT(quant_error(R"({"quant_method": "awq", "bits": 4})"), HasSubstr("unsupported quant_method awq"));
  EXPECT_THAT(quant_error(R"({"quant_method": "gptq", "checkpoint_format": "marlin"})"),
              HasSubstr("unsupported checkpoint_format marlin"));
  EXPECT_THAT(quant_error(R"({"quant_method": "gptq", "format": "bitblas"})"),
              HasSubstr("unsupported format bitblas"));
  EXPECT_THAT(quant_error(R"({"quant_method": "gptq", "checkpoint_format": "gptq_p"})"),
              HasSubstr("unsupported checkpoint_format gptq_p"));
  EXPECT_THAT(quant_error(R"({"quant_method": "gptq", "bits": 5})"), HasSubstr("unsupported bits 5"));
  EXPECT_THAT(quant_error(R"({"quant_method": "gptq", "group_size": 0})"), HasSubstr("group_size 0"));
}

TEST(QuantConfig, LmHeadRejectedAndEmptyDynamicAccepted) {
  EXPECT_THAT(quant_error(R"({"quant_method": "gptq", "lm_head": true})"), HasSubstr("lm_head"));
  // Empty or null overrides and lm_head false are what most writers emit.
  const QuantConfig q = parse_quant_config(
      R"({"quant_method": "gptq", "dynamic": {}, "lm_head": false, "bits": 8})", "x");
  EXPECT_EQ(q.bits, 8);
  EXPECT_TRUE(q.dynamic.empty());
  EXPECT_EQ(parse_quant_config(R"({"quant_method": "gptq", "dynamic": null})", "x").bits, 4);
}

// ---- dynamic (GPTQModel's per-module overrides) ----------------------------------------------

// The linears of a Llama of `layers` layers, named as the quantizer saw them.
std::vector<std::string> llama_modules(int layers) {
  std::vector<std::string> m;
  for (int i = 0; i < layers; ++i)
    for (const char* l : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                          "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"})
      m.push_back("model.layers." + std::to_string(i) + "." + l);
  return m;
}

std::vector<std::optional<LinearQuant>> resolve(const std::string& qc_text, int layers) {
  const QuantConfig q = parse_quant_config(qc_text, "quantize_config.json");
  return resolve_modules(q.base(), q.dynamic, llama_modules(layers), "m");
}

TEST(Dynamic, TinyLlamaExampleOfTheIssue) {
  // ModelCloud's TinyLlama-1.1B-Chat-v1.0-GPTQ-4bits-dynamic-cfg: layers 2 and up stay FP16,
  // layer 1 is 8-bit g32, layer 0 has the base 4-bit g128 act-order format.
  const auto f = resolve(R"({"bits": 4, "group_size": 128, "desc_act": true, "sym": true,
      "dynamic": {"-:model\\.layers\\.([2-9]\\d*|[1-9]\\d+)\\..*": {},
                  ".*\\.1\\..*": {"bits": 8, "group_size": 32, "desc_act": false}}})", 12);
  ASSERT_EQ(f.size(), 12u * 7);
  for (int i = 0; i < 7; ++i) {
    ASSERT_TRUE(f[i]) << i;
    EXPECT_EQ(*f[i], (LinearQuant{4, 128, true, true})) << i;
    ASSERT_TRUE(f[7 + i]) << i;
    EXPECT_EQ(*f[7 + i], (LinearQuant{8, 32, false, true})) << i;
  }
  for (size_t i = 14; i < f.size(); ++i) EXPECT_FALSE(f[i]) << i;  // layers 2 .. 11, 10 and 11 too
}

TEST(Dynamic, FirstMatchDecidesInFileOrder) {
  // The file's order, not the keys' sorted order: "z" sorts after "+:", yet comes first here.
  const std::string qc = R"({"bits": 4, "group_size": 64, "dynamic": {
      "z?model\\.layers\\.0\\.mlp\\..*": {"bits": 2},
      "+:model\\.layers\\.0\\..*": {"bits": 8, "sym": false},
      "-:.*down_proj": {}}})";
  const auto f = resolve(qc, 2);
  EXPECT_EQ(f[4]->bits, 2);   // layer 0 gate: the first rule
  EXPECT_TRUE(f[4]->sym);
  EXPECT_EQ(f[6]->bits, 2);   // layer 0 down: the "-:" rule matches too, but comes later
  EXPECT_EQ(f[0]->bits, 8);   // layer 0 q: the second rule
  EXPECT_FALSE(f[0]->sym);
  EXPECT_EQ(f[0]->group_size, 64);  // what the rule leaves alone comes from the base
  EXPECT_EQ(f[7]->bits, 4);   // layer 1 q: no rule
  EXPECT_FALSE(f[13]);        // layer 1 down: the "-:" rule
}

TEST(Dynamic, MatchIsAnchoredAtTheStartOnly) {
  // re.match: "layers\\.0" does not match "model.layers.0..." (not at the start), while
  // "model\\.layers\\.1" matches "model.layers.1.self_attn..." (no end anchor), and so does
  // "model\\.layers\\.1" on layer 10: Python would match it too.
  const auto f = resolve(R"({"bits": 4, "dynamic": {"model\\.layers\\.1": {"bits": 8},
                                                     ".*layers\\.0\\.": {"bits": 2}}})", 11);
  EXPECT_EQ(f[0]->bits, 2);
  EXPECT_EQ(f[7]->bits, 8);
  EXPECT_EQ(f[70]->bits, 8);  // layer 10
  EXPECT_EQ(f[14]->bits, 4);
  EXPECT_THAT(error_of([&] { resolve(R"({"dynamic": {"layers\\.0": {"bits": 8}}})", 2); }),
              HasSubstr("m: dynamic rule \"layers\\.0\" matches no module of this model"));
}

TEST(Dynamic, PythonSyntax) {
  // Named groups (?P<name>...) and (?P=name) are Python's; PCRE2 reads them alike.
  auto f = resolve(R"({"dynamic": {"model\\.layers\\.(?P<n>\\d)\\.mlp\\.(?P<p>up)_proj\\Z": {"bits": 3}}})", 2);
  EXPECT_EQ(f[5]->bits, 3);
  EXPECT_EQ(f[4]->bits, 4);
  // \Z is the end of the name (Python), not PCRE2's "before a final newline".
  f = resolve(R"({"dynamic": {".*q_proj\\Z": {"bits": 8}}})", 1);
  EXPECT_EQ(f[0]->bits, 8);
  EXPECT_EQ(python_regex_to_pcre2("a\\Zb[\\Z]"), "a\\zb[\\Z]");
  // {,n} is {0,n} in Python; PCRE2 10.42 would read it as text.
  EXPECT_EQ(python_regex_to_pcre2("x{,2}y{3}z{,}"), "x{0,2}y{3}z{,}");
  f = resolve(R"({"dynamic": {"model\\.layers\\.0\\.self_attn\\.[qk]{,1}_proj": {"bits": 2}}})", 1);
  EXPECT_EQ(f[0]->bits, 2);
  EXPECT_EQ(f[2]->bits, 4);  // v_proj
}

TEST(Dynamic, RefusalsNameTheRuleAndTheField) {
  auto err = [](const std::string& dyn) {
    return quant_error(R"({"quant_method": "gptq", "dynamic": )" + dyn + "}");
  };
  EXPECT_THAT(err(R"({"+:.*(q_proj": {}})"),
              HasSubstr("dynamic rule \"+:.*(q_proj\": malformed regex: missing closing parenthesis "
                        "at offset 11"));
  EXPECT_THAT(err(R"({".*": {"bits": 5}})"), HasSubstr("dynamic rule \".*\": unsupported bits 5"));
  EXPECT_THAT(err(R"({".*": {"group_size": 0}})"),
              HasSubstr("dynamic rule \".*\": group_size 0 must be -1 or positive"));
  EXPECT_THAT(err(R"({".*": {"bits": "8"}})"), HasSubstr("bits must be an integer"));
  EXPECT_THAT(err(R"({".*": {"sym": 1}})"), HasSubstr("sym must be true or false"));
  EXPECT_THAT(err(R"({".*": {"act_order": true}})"),
              HasSubstr("dynamic rule \".*\": unknown override act_order"));
  EXPECT_THAT(err(R"({".*": {"mse": "2.4"}})"), HasSubstr("mse must be a number"));
  EXPECT_THAT(err(R"({".*": 8})"), HasSubstr("dynamic rule \".*\": overrides must be an object"));
  EXPECT_THAT(err(R"(["-:.*"])"), HasSubstr("dynamic must be an object"));
  // The quantizer's own settings are informative, as at the top level.
  const QuantConfig q = parse_quant_config(
      R"({"mse": 2.4, "dynamic": {".*": {"damp_percent": 0.05, "static_groups": true, "mse": 2.4}}})",
      "quantize_config.json");
  ASSERT_EQ(q.dynamic.size(), 1u);
  EXPECT_FALSE(q.dynamic[0].bits);
}

TEST(Dynamic, BothFilesMustAgreeOnTheRules) {
  Dir d;
  json j = llama_config();
  j["num_hidden_layers"] = 2;
  j["quantization_config"] = gptq_qc();
  j["quantization_config"]["dynamic"] = {{"-:.*down_proj", json::object()}};
  json qc = gptq_qc();
  qc["dynamic"] = {{"-:.*down_proj", json::object()}};
  EXPECT_EQ(d.load(j, qc).quant->dynamic.size(), 1u);
  qc["dynamic"] = {{"-:.*up_proj", json::object()}};
  EXPECT_THAT(d.error(j, qc),
              HasSubstr("disagree on dynamic rule 1: \"-:.*up_proj\" vs \"-:.*down_proj\""));
}

TEST(QuantConfig, AwqInConfigJsonRejectedOnLoad) {
  Dir d;
  json j = llama_config();
  j["quantization_config"] = {{"quant_method", "awq"}, {"bits", 4}, {"group_size", 128}};
  const std::string msg = d.error(j);
  EXPECT_THAT(msg, HasSubstr("config.json quantization_config: unsupported quant_method awq"));
}

TEST(QuantConfig, BothFilesMustAgree) {
  Dir d;
  json j = llama_config();
  j["quantization_config"] = gptq_qc();
  json qc = gptq_qc();
  qc.erase("quant_method");
  qc["model_file_base_name"] = "gptq_model-4bit-128g";
  const ModelConfig c = d.load(j, qc);
  ASSERT_TRUE(c.quant.has_value());
  EXPECT_EQ(c.quant->model_file_base_name, "gptq_model-4bit-128g");

  qc["bits"] = 8;
  EXPECT_THAT(d.error(j, qc),
              HasSubstr("quantize_config.json and config.json quantization_config disagree on bits: 8 vs 4"));
  qc = gptq_qc();
  qc["checkpoint_format"] = "gptq_v2";
  EXPECT_THAT(d.error(j, qc), HasSubstr("disagree on checkpoint_format: gptq_v2 vs gptq"));
  qc = gptq_qc();
  qc["desc_act"] = false;
  EXPECT_THAT(d.error(j, qc), HasSubstr("disagree on desc_act: false vs true"));
  qc = gptq_qc();
  qc.erase("group_size");  // AutoGPTQ's default -1 is not transformers' 128
  EXPECT_THAT(d.error(j, qc), HasSubstr("disagree on group_size: -1 vs 128"));
}

TEST(QuantConfig, BadQuantizeConfigFileNamed) {
  Dir d;
  EXPECT_THAT(d.error(llama_config(), json{{"bits", 6}}),
              HasSubstr("quantize_config.json: unsupported bits 6"));
}

// ---- generation_config.json -----------------------------------------------------------------

struct GenDir {
  TempDir tmp;
  GenerationDefaults load(const json& j) {
    test::write_text(tmp.file("generation_config.json"), j.dump());
    return load_generation_defaults(tmp.str());
  }
  std::string error(const json& j) { return error_of([&] { load(j); }); }
};

TEST(GenerationConfig, AbsentFileAndFields) {
  GenDir d;
  const GenerationDefaults none = load_generation_defaults(d.tmp.str());
  EXPECT_FALSE(none.temperature || none.top_k || none.top_p || none.min_p ||
               none.repetition_penalty || none.do_sample);
  const GenerationDefaults g = d.load({{"bos_token_id", 1}, {"temperature", nullptr}});
  EXPECT_FALSE(g.temperature.has_value());
}

TEST(GenerationConfig, Values) {
  GenDir d;
  const GenerationDefaults g = d.load({{"do_sample", true}, {"temperature", 0.6}, {"top_k", 20},
                                       {"top_p", 1}, {"min_p", 0}, {"repetition_penalty", 1.05}});
  EXPECT_EQ(g.do_sample, true);
  EXPECT_FLOAT_EQ(*g.temperature, 0.6f);
  EXPECT_EQ(*g.top_k, 20);
  EXPECT_FLOAT_EQ(*g.top_p, 1.0f);
  EXPECT_FLOAT_EQ(*g.min_p, 0.0f);
  EXPECT_FLOAT_EQ(*g.repetition_penalty, 1.05f);
  EXPECT_EQ(*d.load({{"temperature", 0}, {"top_k", 0}}).temperature, 0.0f);
}

// Each out-of-range value was taken as it was before (a negative temperature, top_p 0, ...).
TEST(GenerationConfig, OutOfRangeValuesRefused) {
  GenDir d;
  const std::string file = d.tmp.file("generation_config.json");
  EXPECT_EQ(d.error({{"temperature", -0.5}}),
            file + ": temperature = -0.5 is out of range (0 or more)");
  EXPECT_EQ(d.error({{"temperature", 1e39}}),
            file + ": temperature = 1e+39 is out of range (0 or more)");
  EXPECT_EQ(d.error({{"top_p", 0}}), file + ": top_p = 0 is out of range (above 0, at most 1)");
  EXPECT_EQ(d.error({{"top_p", 1.5}}), file + ": top_p = 1.5 is out of range (above 0, at most 1)");
  EXPECT_EQ(d.error({{"top_k", -1}}), file + ": top_k = -1 is out of range (0 or more)");
  EXPECT_EQ(d.error({{"top_k", 2.5}}), file + ": top_k must be an integer, found 2.5");
  EXPECT_EQ(d.error({{"min_p", 2}}), file + ": min_p = 2 is out of range (0 to 1)");
  EXPECT_EQ(d.error({{"repetition_penalty", 0}}),
            file + ": repetition_penalty = 0 is out of range (above 0)");
  EXPECT_EQ(d.error({{"repetition_penalty", -1.2}}),
            file + ": repetition_penalty = -1.2 is out of range (above 0)");
  EXPECT_EQ(d.error({{"temperature", "0.7"}}), file + ": temperature must be a number, found \"0.7\"");
  EXPECT_EQ(d.error({{"do_sample", "no"}}), file + ": do_sample must be true or false, found \"no\"");
  test::write_text(file, R"({"temperature": 1e999})");  // beyond a double: not a number JSON holds
  EXPECT_THAT(error_of([&] { load_generation_defaults(d.tmp.str()); }),
              HasSubstr(file + ": not valid JSON"));
  test::write_text(file, "[1]");
  EXPECT_EQ(error_of([&] { load_generation_defaults(d.tmp.str()); }),
            file + ": holds a JSON array, not an object");
}

TEST(GenerationConfig, NotARegularFile) {
  GenDir d;
  const std::string file = d.tmp.file("generation_config.json");
  test::make_fifo(file);
  EXPECT_EQ(test::error_without_blocking(file, [&] { load_generation_defaults(d.tmp.str()); }),
            file + " is not a regular file (a FIFO)");
}

}  // namespace
}  // namespace kestrel
