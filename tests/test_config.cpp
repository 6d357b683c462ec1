// Tests of the glm5_next config parser against transformers 5.17.0 Glm5NextConfig / Glm5NextTextConfig: library
// defaults, the derived layer lists, linear_attn_config, nested vs flat, validation errors (each naming the field)
// and the three committed golden configs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/env.h"
#include "core/error.h"
#include "model/config.h"
#include "test_util.h"

using namespace nextlm;
using json = nlohmann::json;

namespace {

constexpr LayerType K = LayerType::LinearAttention;
constexpr LayerType D = LayerType::SparseAttention;
constexpr MlpType Dn = MlpType::Dense;
constexpr MlpType Sp = MlpType::Sparse;
constexpr IndexerType F = IndexerType::Full;
constexpr IndexerType S = IndexerType::Shared;

std::string golden_config(const std::string& name) {
  return std::string(NEXTLM_TEST_DATA) + "/golden/" + name + "/config.json";
}

// Parses j and returns the nextlm::Error message; fails the test if nothing (or another exception type) is thrown.
std::string parse_error(const json& j) {
  try {
    (void)parse_config(j);
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a non-nextlm::Error: " << e.what();
    return "";
  }
  ADD_FAILURE() << "parse_config accepted " << j.dump();
  return "";
}

// Asserts that parsing j throws nextlm::Error whose message contains every one of `parts`.
void expect_error(const json& j, const std::vector<std::string>& parts) {
  SCOPED_TRACE(j.dump());
  const std::string msg = parse_error(j);
  for (const std::string& p : parts)
    EXPECT_NE(msg.find(p), std::string::npos) << "message \"" << msg << "\" lacks \"" << p << "\"";
}

// Compares every parsed field except `nested`.
void expect_same_model(const ModelConfig& a, const ModelConfig& b) {
#define NEXTLM_SAME(f) EXPECT_EQ(a.f, b.f) << #f
  NEXTLM_SAME(vocab_size);
  NEXTLM_SAME(hidden_size);
  NEXTLM_SAME(intermediate_size);
  NEXTLM_SAME(moe_intermediate_size);
  NEXTLM_SAME(num_hidden_layers);
  NEXTLM_SAME(num_attention_heads);
  NEXTLM_SAME(num_key_value_heads);
  NEXTLM_SAME(q_lora_rank);
  NEXTLM_SAME(kv_lora_rank);
  NEXTLM_SAME(qk_nope_head_dim);
  NEXTLM_SAME(v_head_dim);
  NEXTLM_SAME(qk_rope_head_dim);
  NEXTLM_SAME(n_routed_experts);
  NEXTLM_SAME(num_experts_per_tok);
  NEXTLM_SAME(n_shared_experts);
  NEXTLM_SAME(n_group);
  NEXTLM_SAME(topk_group);
  NEXTLM_SAME(norm_topk_prob);
  NEXTLM_SAME(routed_scaling_factor);
  NEXTLM_SAME(swiglu_limit);
  NEXTLM_SAME(rms_norm_eps);
  NEXTLM_SAME(linear_num_heads);
  NEXTLM_SAME(linear_head_dim);
  NEXTLM_SAME(linear_conv_kernel_dim);
  NEXTLM_SAME(linear_lower_bound);
  NEXTLM_SAME(hc_mult);
  NEXTLM_SAME(hc_eps);
  NEXTLM_SAME(hc_sinkhorn_iters);
  NEXTLM_SAME(index_n_heads);
  NEXTLM_SAME(index_head_dim);
  NEXTLM_SAME(index_topk);
  NEXTLM_SAME(index_kpool);
  NEXTLM_SAME(index_kpool_always_select_tail);
  NEXTLM_SAME(tie_word_embeddings);
  NEXTLM_SAME(pad_token_id);
  NEXTLM_SAME(eos_token_ids);
  NEXTLM_SAME(hidden_act);
  NEXTLM_SAME(layer_types);
  NEXTLM_SAME(mlp_layer_types);
  NEXTLM_SAME(indexer_types);
#undef NEXTLM_SAME
}

// transformers' default indexer schedule, written out independently of config.cpp.
std::vector<IndexerType> reference_indexer_types(int64_t L, int64_t freq, int64_t offset) {
  freq = std::max<int64_t>(freq, 1);
  std::vector<IndexerType> out;
  for (int64_t i = 0; i < L; ++i) {
    int64_t x = i - offset + 1;
    if (x < 0) x = 0;
    out.push_back(x % freq == 0 ? F : S);
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------- defaults

TEST(ConfigDefaults, BareModelTypeGivesLibraryDefaults) {
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next"})"));
  EXPECT_EQ(c.vocab_size, 154880);
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.intermediate_size, 12288);
  EXPECT_EQ(c.moe_intermediate_size, 2048);
  EXPECT_EQ(c.num_hidden_layers, 45);
  EXPECT_EQ(c.num_attention_heads, 64);
  EXPECT_EQ(c.num_key_value_heads, 64);
  EXPECT_EQ(c.q_lora_rank, 1536);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.qk_nope_head_dim, 256);
  EXPECT_EQ(c.v_head_dim, 256);
  EXPECT_EQ(c.qk_rope_head_dim, 0);
  EXPECT_EQ(c.n_routed_experts, 288);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.n_group, 1);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_DOUBLE_EQ(c.swiglu_limit, 10.0);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.linear_num_heads, 64);
  EXPECT_EQ(c.linear_head_dim, 128);
  EXPECT_EQ(c.linear_conv_kernel_dim, 4);
  ASSERT_TRUE(c.linear_lower_bound.has_value());
  EXPECT_DOUBLE_EQ(*c.linear_lower_bound, -5.0);
  EXPECT_EQ(c.hc_mult, 4);
  EXPECT_DOUBLE_EQ(c.hc_eps, 1e-6);
  EXPECT_EQ(c.hc_sinkhorn_iters, 20);
  EXPECT_EQ(c.index_n_heads, 32);
  EXPECT_EQ(c.index_head_dim, 128);
  EXPECT_EQ(c.index_topk, 2048);
  EXPECT_EQ(c.index_kpool, 16);  // the library default; the real checkpoint sets 4
  EXPECT_TRUE(c.index_kpool_always_select_tail);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.hidden_act, "silu");
  EXPECT_TRUE(c.eos_token_ids.empty());
  EXPECT_FALSE(c.nested);
  EXPECT_EQ(c.layer_types.size(), 45u);
  EXPECT_EQ(c.mlp_layer_types.size(), 45u);
  EXPECT_EQ(c.indexer_types.size(), 45u);
}

TEST(ConfigDefaults, TextModelTypeIsAcceptedFlat) {
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next_text","vocab_size":1000})"));
  EXPECT_EQ(c.vocab_size, 1000);
  EXPECT_FALSE(c.nested);
}

TEST(ConfigDefaults, ExplicitValuesOverrideDefaults) {
  const ModelConfig c = parse_config(json::parse(R"({
    "model_type":"glm5_next", "vocab_size":256, "hidden_size":48, "intermediate_size":80,
    "moe_intermediate_size":24, "num_hidden_layers":4, "num_attention_heads":4, "num_key_value_heads":4,
    "q_lora_rank":40, "kv_lora_rank":32, "qk_nope_head_dim":16, "v_head_dim":24, "n_routed_experts":8,
    "num_experts_per_tok":2, "n_shared_experts":2, "n_group":2, "topk_group":1, "norm_topk_prob":false,
    "routed_scaling_factor":1.5, "swiglu_limit":7, "rms_norm_eps":1e-6, "linear_num_heads":2, "linear_head_dim":16,
    "linear_conv_kernel_dim":3, "linear_lower_bound":-2.5, "hc_mult":3, "hc_eps":1e-4, "hc_sinkhorn_iters":7,
    "index_n_heads":16, "index_head_dim":16, "index_topk":32, "index_kpool":4,
    "index_kpool_always_select_tail":false, "tie_word_embeddings":true, "pad_token_id":0, "eos_token_id":[3, 5]})"));
  EXPECT_EQ(c.vocab_size, 256);
  EXPECT_EQ(c.hidden_size, 48);
  EXPECT_EQ(c.intermediate_size, 80);
  EXPECT_EQ(c.moe_intermediate_size, 24);
  EXPECT_EQ(c.num_hidden_layers, 4);
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.q_lora_rank, 40);
  EXPECT_EQ(c.kv_lora_rank, 32);
  EXPECT_EQ(c.qk_nope_head_dim, 16);
  EXPECT_EQ(c.v_head_dim, 24);
  EXPECT_EQ(c.n_routed_experts, 8);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.n_shared_experts, 2);
  EXPECT_EQ(c.n_group, 2);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 1.5);
  EXPECT_DOUBLE_EQ(c.swiglu_limit, 7.0);  // an integer JSON value is fine for a float field
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.linear_num_heads, 2);
  EXPECT_EQ(c.linear_head_dim, 16);
  EXPECT_EQ(c.linear_conv_kernel_dim, 3);
  EXPECT_EQ(c.linear_lower_bound, std::optional<double>(-2.5));
  EXPECT_EQ(c.hc_mult, 3);
  EXPECT_DOUBLE_EQ(c.hc_eps, 1e-4);
  EXPECT_EQ(c.hc_sinkhorn_iters, 7);
  EXPECT_EQ(c.index_n_heads, 16);
  EXPECT_EQ(c.index_head_dim, 16);
  EXPECT_EQ(c.index_topk, 32);
  EXPECT_EQ(c.index_kpool, 4);
  EXPECT_FALSE(c.index_kpool_always_select_tail);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.pad_token_id, std::optional<int64_t>(0));
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{3, 5}));
}

TEST(ConfigDefaults, ScalarEosTokenIdBecomesOneEntry) {
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next","eos_token_id":154820})"));
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{154820}));
}

// The default stop ids of generate/serve: generation_config.json's eos_token_id (an int or a list) wins over
// config.json's when it sets one, as transformers' GenerationConfig does; ids must be in the vocabulary.
TEST(ConfigEos, GenerationConfigWinsOverConfigJson) {
  nextlm::test::TempDir tmp;
  const ModelConfig c =
      parse_config(json::parse(R"({"model_type":"glm5_next","vocab_size":300,"eos_token_id":[3, 5]})"));
  EXPECT_EQ(load_eos_token_ids(tmp.str(), c), (std::vector<int32_t>{3, 5}));  // no generation_config.json
  std::ofstream(tmp.str("generation_config.json")) << R"({"pad_token_id": 0})";
  EXPECT_EQ(load_eos_token_ids(tmp.str(), c), (std::vector<int32_t>{3, 5}));  // one that does not set it
  std::ofstream(tmp.str("generation_config.json")) << R"({"eos_token_id": null})";
  EXPECT_EQ(load_eos_token_ids(tmp.str(), c), (std::vector<int32_t>{3, 5}));
  std::ofstream(tmp.str("generation_config.json")) << R"({"eos_token_id": 7})";
  EXPECT_EQ(load_eos_token_ids(tmp.str(), c), (std::vector<int32_t>{7}));
  std::ofstream(tmp.str("generation_config.json")) << R"({"eos_token_id": [299, 0, 7]})";
  EXPECT_EQ(load_eos_token_ids(tmp.str(), c), (std::vector<int32_t>{299, 0, 7}));
  const ModelConfig none = parse_config(json::parse(R"({"model_type":"glm5_next","vocab_size":300})"));
  EXPECT_EQ(load_eos_token_ids(tmp.str(), none), (std::vector<int32_t>{299, 0, 7}));
  for (const char* bad : {R"({"eos_token_id": 300})", R"({"eos_token_id": [1, -1]})", R"({"eos_token_id": "x"})",
                          R"({"eos_token_id": [1.5]})", "[1]", "{oops"}) {
    std::ofstream(tmp.str("generation_config.json")) << bad;
    try {
      load_eos_token_ids(tmp.str(), c);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("generation_config.json"), std::string::npos) << e.what();
    }
  }
  std::filesystem::remove(tmp.str("generation_config.json"));
  const ModelConfig outside =
      parse_config(json::parse(R"({"model_type":"glm5_next","vocab_size":300,"eos_token_id":300})"));
  EXPECT_THROW(load_eos_token_ids(tmp.str(), outside), Error);
}

// -------------------------------------------------------------------------------------------- mlp_layer_types

TEST(ConfigMlpLayerTypes, DefaultTwoLayersAreBothDense) {
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":2})"));
  EXPECT_EQ(c.mlp_layer_types, (std::vector<MlpType>{Dn, Dn}));
}

TEST(ConfigMlpLayerTypes, DefaultFortyFiveLayersAreThreeDenseThenSparse) {
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next"})"));
  ASSERT_EQ(c.mlp_layer_types.size(), 45u);
  for (size_t i = 0; i < 45; ++i) EXPECT_EQ(c.mlp_layer_types[i], i < 3 ? Dn : Sp) << "layer " << i;
}

TEST(ConfigMlpLayerTypes, ExplicitListIsUsed) {
  const ModelConfig c = parse_config(json::parse(
      R"({"model_type":"glm5_next","num_hidden_layers":4,"mlp_layer_types":["sparse","dense","sparse","dense"]})"));
  EXPECT_EQ(c.mlp_layer_types, (std::vector<MlpType>{Sp, Dn, Sp, Dn}));
}

// A huge layer count is refused before the per-layer lists are built (the config fuzzer found one allocating 2 GB).
TEST(ConfigErrors, AbsurdLayerCountIsRefusedBeforeAllocating) {
  expect_error(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":536870912})"),
               {"num_hidden_layers", "between 1 and 65536", "536870912"});
  expect_error(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":0})"), {"num_hidden_layers"});
  EXPECT_EQ(parse_config(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":65536})")).num_hidden_layers,
            65536);
}

TEST(ConfigMlpLayerTypes, UnknownValueIsNamed) {
  expect_error(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":2,"mlp_layer_types":["dense","moe"]})"),
               {"\"moe\""});
}

// ------------------------------------------------------------------------------------------------ layer_types

TEST(ConfigLayerTypes, DefaultIsThreeKdaThenOneDsa) {
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next"})"));
  ASSERT_EQ(c.layer_types.size(), 45u);
  for (size_t i = 0; i < 45; ++i) EXPECT_EQ(c.layer_types[i], i % 4 != 3 ? K : D) << "layer " << i;
  EXPECT_EQ(c.num_kda_layers(), 34);
  EXPECT_EQ(c.num_dsa_layers(), 11);
}

TEST(ConfigLayerTypes, DefaultForFiveLayers) {
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":5})"));
  EXPECT_EQ(c.layer_types, (std::vector<LayerType>{K, K, K, D, K}));
  EXPECT_EQ(c.num_kda_layers(), 4);
  EXPECT_EQ(c.num_dsa_layers(), 1);
}

TEST(ConfigLayerTypes, FullAttentionMapsToSparseAttention) {
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":3,
      "layer_types":["full_attention","linear_attention","deepseek_sparse_attention"]})"));
  EXPECT_EQ(c.layer_types, (std::vector<LayerType>{D, K, D}));
}

TEST(ConfigLayerTypes, UnknownValueIsNamed) {
  expect_error(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":2,
      "layer_types":["linear_attention","sliding_attention"]})"),
               {"sliding_attention"});
}

TEST(ConfigLayerTypes, NonStringEntryIsAnError) {
  expect_error(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":2,"layer_types":["linear_attention",3]})"),
               {"layer_types"});
}

TEST(ConfigLayerTypes, NonListIsAnError) {
  expect_error(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":2,"layer_types":"linear_attention"})"),
               {"layer_types"});
}

TEST(ConfigLayerTypes, ToStringNamesMatchTransformers) {
  EXPECT_STREQ(to_string(K), "linear_attention");
  EXPECT_STREQ(to_string(D), "deepseek_sparse_attention");
  EXPECT_STREQ(to_string(Dn), "dense");
  EXPECT_STREQ(to_string(Sp), "sparse");
  EXPECT_STREQ(to_string(F), "full");
  EXPECT_STREQ(to_string(S), "shared");
}

// ---------------------------------------------------------------------------------------------- indexer_types

TEST(ConfigIndexerTypes, ExplicitListIsUsed) {
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":4,
      "indexer_types":["shared","full","shared","full"]})"));
  EXPECT_EQ(c.indexer_types, (std::vector<IndexerType>{S, F, S, F}));
}

TEST(ConfigIndexerTypes, ExplicitListWinsOverPatternAndFreq) {
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":4,
      "indexer_types":["shared","full","shared","full"],"index_topk_pattern":"FFFF","index_topk_freq":3})"));
  EXPECT_EQ(c.indexer_types, (std::vector<IndexerType>{S, F, S, F}));
}

TEST(ConfigIndexerTypes, PatternStringOfFAndS) {
  // Default layer types for 4 layers are K K K D; "shared" on a KDA layer is harmless.
  const ModelConfig c =
      parse_config(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":4,"index_topk_pattern":"SFSF"})"));
  EXPECT_EQ(c.indexer_types, (std::vector<IndexerType>{S, F, S, F}));
}

TEST(ConfigIndexerTypes, PatternList) {
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":4,
      "index_topk_pattern":["full","shared","shared","full"]})"));
  EXPECT_EQ(c.indexer_types, (std::vector<IndexerType>{F, S, S, F}));
}

TEST(ConfigIndexerTypes, PatternWinsOverFreqAndOffset) {
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":4,
      "index_topk_pattern":"FSSF","index_topk_freq":1,"index_skip_topk_offset":0})"));
  EXPECT_EQ(c.indexer_types, (std::vector<IndexerType>{F, S, S, F}));
}

TEST(ConfigIndexerTypes, PatternBadCharacterIsAnError) {
  expect_error(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":4,"index_topk_pattern":"FSXF"})"),
               {"index_topk_pattern", "'X'"});
  // transformers' lookup is case sensitive.
  expect_error(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":4,"index_topk_pattern":"FfFF"})"),
               {"index_topk_pattern", "'f'"});
}

TEST(ConfigIndexerTypes, PatternListUnknownValueIsNamed) {
  expect_error(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":2,"index_topk_pattern":["full","half"]})"),
               {"\"half\""});
}

TEST(ConfigIndexerTypes, PatternShorterThanLayersIsAnError) {
  expect_error(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":4,"index_topk_pattern":"FFF"})"),
               {"index_topk_pattern", "3", "4"});
}

TEST(ConfigIndexerTypes, PatternLongerThanLayersIsTruncated) {
  const ModelConfig c =
      parse_config(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":4,"index_topk_pattern":"FSFFSS"})"));
  EXPECT_EQ(c.indexer_types, (std::vector<IndexerType>{F, S, F, F}));
}

TEST(ConfigIndexerTypes, DefaultFreqAndOffsetMakeEveryLayerFull) {
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next"})"));
  EXPECT_EQ(c.indexer_types, std::vector<IndexerType>(45, F));
}

TEST(ConfigIndexerTypes, FreqTwoOffsetTwoKnownSchedule) {
  // max(i - 1, 0) % 2 == 0: i = 0, 1, 3, 5 are full.
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":6,
      "layer_types":["linear_attention","linear_attention","linear_attention","linear_attention","linear_attention",
                     "linear_attention"],
      "index_topk_freq":2})"));
  EXPECT_EQ(c.indexer_types, (std::vector<IndexerType>{F, F, S, F, S, F}));
}

TEST(ConfigIndexerTypes, FreqAndOffsetMatchTransformersFormula) {
  const int64_t L = 13;
  // All KDA so that the shared-after-full rule does not reject any schedule.
  json base = json::parse(R"({"model_type":"glm5_next","num_hidden_layers":13})");
  base["layer_types"] = std::vector<std::string>(L, "linear_attention");
  const std::vector<std::pair<int64_t, int64_t>> cases = {{1, 2}, {2, 2}, {3, 2}, {2, 0}, {3, 1}, {4, 5},
                                                          {5, 20}, {2, -3}, {0, 2}, {0, 0}, {-2, 3}, {3, 0}};
  bool saw_mixed = false;
  for (auto [freq, offset] : cases) {
    SCOPED_TRACE("freq " + std::to_string(freq) + " offset " + std::to_string(offset));
    json j = base;
    j["index_topk_freq"] = freq;
    j["index_skip_topk_offset"] = offset;
    const ModelConfig c = parse_config(j);
    const std::vector<IndexerType> want = reference_indexer_types(L, freq, offset);
    EXPECT_EQ(c.indexer_types, want);
    saw_mixed |= std::count(want.begin(), want.end(), S) > 0;
  }
  EXPECT_TRUE(saw_mixed);  // the comparison exercised "shared" entries, not only all-full schedules
}

TEST(ConfigIndexerTypes, FreqZeroIsTreatedAsOne) {
  const ModelConfig zero = parse_config(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":8,
      "index_topk_freq":0,"index_skip_topk_offset":1})"));
  const ModelConfig one = parse_config(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":8,
      "index_topk_freq":1,"index_skip_topk_offset":1})"));
  EXPECT_EQ(zero.indexer_types, std::vector<IndexerType>(8, F));
  EXPECT_EQ(zero.indexer_types, one.indexer_types);
}

TEST(ConfigIndexerTypes, FreqWrongTypeIsNamed) {
  expect_error(json::parse(R"({"model_type":"glm5_next","index_topk_freq":"2"})"), {"index_topk_freq"});
  expect_error(json::parse(R"({"model_type":"glm5_next","index_skip_topk_offset":1.5})"), {"index_skip_topk_offset"});
}

TEST(ConfigIndexerTypes, UnknownValueIsNamed) {
  expect_error(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":2,"indexer_types":["full","partial"]})"),
               {"\"partial\""});
}

// ------------------------------------------------------------------------------------------ linear_attn_config

TEST(ConfigLinearAttn, DictOverridesTopLevelFields) {
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next",
      "linear_head_dim":64, "linear_num_heads":32, "linear_conv_kernel_dim":4, "linear_lower_bound":-5.0,
      "linear_attn_config":{"head_dim":32,"num_heads":8,"short_conv_kernel_size":3,"gate_lower_bound":-3.5}})"));
  EXPECT_EQ(c.linear_head_dim, 32);
  EXPECT_EQ(c.linear_num_heads, 8);
  EXPECT_EQ(c.linear_conv_kernel_dim, 3);
  EXPECT_EQ(c.linear_lower_bound, std::optional<double>(-3.5));
}

TEST(ConfigLinearAttn, MissingDictKeysKeepTopLevelValues) {
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next",
      "linear_head_dim":64, "linear_num_heads":32, "linear_conv_kernel_dim":2, "linear_lower_bound":-2.0,
      "linear_attn_config":{}})"));
  EXPECT_EQ(c.linear_head_dim, 64);
  EXPECT_EQ(c.linear_num_heads, 32);
  EXPECT_EQ(c.linear_conv_kernel_dim, 2);
  EXPECT_EQ(c.linear_lower_bound, std::optional<double>(-2.0));
}

TEST(ConfigLinearAttn, SafeGateDefaultTurnsNullBoundIntoMinusFive) {
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next",
      "linear_lower_bound":null, "linear_attn_config":{"gate_lower_bound":null}})"));
  EXPECT_EQ(c.linear_lower_bound, std::optional<double>(-5.0));
}

TEST(ConfigLinearAttn, SafeGateTrueTurnsInheritedNullBoundIntoMinusFive) {
  // No gate_lower_bound in the dict: the top-level null is kept by .get(), then safe_gate makes it -5.
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next",
      "linear_lower_bound":null, "linear_attn_config":{"safe_gate":true}})"));
  EXPECT_EQ(c.linear_lower_bound, std::optional<double>(-5.0));
}

TEST(ConfigLinearAttn, SafeGateKeepsAnExplicitBound) {
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next",
      "linear_attn_config":{"safe_gate":true,"gate_lower_bound":-1.25}})"));
  EXPECT_EQ(c.linear_lower_bound, std::optional<double>(-1.25));
}

TEST(ConfigLinearAttn, SafeGateFalseKeepsNullSoTheGateIsSoftplus) {
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next",
      "linear_attn_config":{"safe_gate":false,"gate_lower_bound":null}})"));
  EXPECT_FALSE(c.linear_lower_bound.has_value());
}

TEST(ConfigLinearAttn, SafeGateFalseKeepsAnInheritedBound) {
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next",
      "linear_lower_bound":-2.0, "linear_attn_config":{"safe_gate":false}})"));
  EXPECT_EQ(c.linear_lower_bound, std::optional<double>(-2.0));
}

TEST(ConfigLinearAttn, SafeGateNullIsFalsyLikeDictGet) {
  // dict.get("safe_gate", True) returns None for an explicit null, which is falsy: the bound stays null.
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next",
      "linear_attn_config":{"safe_gate":null,"gate_lower_bound":null}})"));
  EXPECT_FALSE(c.linear_lower_bound.has_value());
}

TEST(ConfigLinearAttn, TopLevelNullBoundWithoutDictIsSoftplus) {
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next","linear_lower_bound":null})"));
  EXPECT_FALSE(c.linear_lower_bound.has_value());
}

TEST(ConfigLinearAttn, NullDictIsIgnored) {
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next",
      "linear_lower_bound":null, "linear_attn_config":null})"));
  EXPECT_FALSE(c.linear_lower_bound.has_value());
  EXPECT_EQ(c.linear_head_dim, 128);
}

TEST(ConfigLinearAttn, NonObjectDictIsAnError) {
  expect_error(json::parse(R"({"model_type":"glm5_next","linear_attn_config":[16, 2]})"), {"linear_attn_config"});
}

TEST(ConfigLinearAttn, WrongTypesInsideDictAreNamed) {
  expect_error(json::parse(R"({"model_type":"glm5_next","linear_attn_config":{"head_dim":"16"}})"), {"head_dim"});
  expect_error(json::parse(R"({"model_type":"glm5_next","linear_attn_config":{"safe_gate":1}})"), {"safe_gate"});
  expect_error(json::parse(R"({"model_type":"glm5_next","linear_attn_config":{"gate_lower_bound":"low"}})"),
               {"gate_lower_bound"});
}

// ------------------------------------------------------------------------------------------ nested versus flat

namespace {
const char* kTextFields = R"({
  "vocab_size":256, "hidden_size":48, "intermediate_size":80, "moe_intermediate_size":24, "num_hidden_layers":5,
  "num_attention_heads":4, "num_key_value_heads":4, "q_lora_rank":40, "kv_lora_rank":32, "qk_nope_head_dim":16,
  "v_head_dim":24, "n_routed_experts":8, "num_experts_per_tok":2, "n_group":2, "topk_group":1,
  "norm_topk_prob":false, "routed_scaling_factor":1.5, "swiglu_limit":1.0, "linear_num_heads":2,
  "linear_head_dim":16, "hc_mult":3, "hc_sinkhorn_iters":7, "index_n_heads":16, "index_head_dim":16,
  "index_topk":32, "index_kpool":4, "index_kpool_always_select_tail":false, "pad_token_id":0, "eos_token_id":7,
  "layer_types":["linear_attention","deepseek_sparse_attention","deepseek_sparse_attention","linear_attention",
                 "full_attention"],
  "index_topk_pattern":"FFSFF", "mlp_layer_types":["dense","sparse","sparse","dense","sparse"],
  "linear_attn_config":{"safe_gate":false,"gate_lower_bound":null,"short_conv_kernel_size":3}
})";
}  // namespace

TEST(ConfigNesting, NestedAndFlatGiveTheSameModel) {
  const json text = json::parse(kTextFields);
  json flat = text;
  flat["model_type"] = "glm5_next";
  flat["tie_word_embeddings"] = true;
  json nested = json::parse(R"({"model_type":"glm5_next","tie_word_embeddings":true,"vision_config":{"depth":1}})");
  nested["text_config"] = text;
  nested["text_config"]["model_type"] = "glm5_next_text";
  const ModelConfig a = parse_config(flat);
  const ModelConfig b = parse_config(nested);
  EXPECT_FALSE(a.nested);
  EXPECT_TRUE(b.nested);
  expect_same_model(a, b);
  // And the values are the given ones, not defaults.
  EXPECT_EQ(b.vocab_size, 256);
  EXPECT_EQ(b.hc_mult, 3);
  EXPECT_TRUE(b.tie_word_embeddings);
  EXPECT_FALSE(b.linear_lower_bound.has_value());
  EXPECT_EQ(b.linear_conv_kernel_dim, 3);
  EXPECT_EQ(b.layer_types, (std::vector<LayerType>{K, D, D, K, D}));
  EXPECT_EQ(b.indexer_types, (std::vector<IndexerType>{F, F, S, F, F}));
  EXPECT_EQ(b.mlp_layer_types, (std::vector<MlpType>{Dn, Sp, Sp, Dn, Sp}));
  EXPECT_EQ(b.eos_token_ids, (std::vector<int64_t>{7}));
}

TEST(ConfigNesting, NestedIgnoresTopLevelTextFields) {
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next","vocab_size":999,"hidden_size":8,
      "text_config":{"vocab_size":256}})"));
  EXPECT_TRUE(c.nested);
  EXPECT_EQ(c.vocab_size, 256);
  EXPECT_EQ(c.hidden_size, 4096);
}

TEST(ConfigNesting, TieWordEmbeddingsComesFromTheOuterObjectWhenNested) {
  const ModelConfig outer_true = parse_config(json::parse(
      R"({"model_type":"glm5_next","tie_word_embeddings":true,"text_config":{"tie_word_embeddings":false}})"));
  EXPECT_TRUE(outer_true.tie_word_embeddings);
  const ModelConfig outer_false = parse_config(json::parse(
      R"({"model_type":"glm5_next","tie_word_embeddings":false,"text_config":{"tie_word_embeddings":true}})"));
  EXPECT_FALSE(outer_false.tie_word_embeddings);
  const ModelConfig outer_absent =
      parse_config(json::parse(R"({"model_type":"glm5_next","text_config":{"tie_word_embeddings":true}})"));
  EXPECT_FALSE(outer_absent.tie_word_embeddings);  // the outer dataclass default
}

TEST(ConfigNesting, TieWordEmbeddingsFlat) {
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next","tie_word_embeddings":true})"));
  EXPECT_TRUE(c.tie_word_embeddings);
}

TEST(ConfigNesting, NullTextConfigMeansFlat) {
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next","text_config":null,"vocab_size":300})"));
  EXPECT_FALSE(c.nested);
  EXPECT_EQ(c.vocab_size, 300);
}

TEST(ConfigNesting, NonObjectTextConfigIsAnError) {
  expect_error(json::parse(R"({"model_type":"glm5_next","text_config":[1,2]})"), {"text_config"});
}

TEST(ConfigNesting, NullKeyValueHeadsEqualsAttentionHeads) {
  const ModelConfig c = parse_config(
      json::parse(R"({"model_type":"glm5_next","num_attention_heads":8,"num_key_value_heads":null})"));
  EXPECT_EQ(c.num_attention_heads, 8);
  EXPECT_EQ(c.num_key_value_heads, 8);
  const ModelConfig n = parse_config(json::parse(
      R"({"model_type":"glm5_next","text_config":{"num_attention_heads":16,"num_key_value_heads":null}})"));
  EXPECT_EQ(n.num_key_value_heads, 16);
}

TEST(ConfigNesting, AbsentKeyValueHeadsIsTheLibraryDefault) {
  // The dataclass default (64) applies when the key is absent; only an explicit null copies num_attention_heads,
  // so transformers rejects 8 heads with the default 64 key/value heads.
  expect_error(json::parse(R"({"model_type":"glm5_next","num_attention_heads":8})"),
               {"num_attention_heads", "num_key_value_heads", "64"});
  EXPECT_EQ(parse_config(json::parse(R"({"model_type":"glm5_next"})")).num_key_value_heads, 64);
}

// ------------------------------------------------------------------------------------------------- validation

TEST(ConfigValidation, HeadsDifferentFromKeyValueHeads) {
  expect_error(json::parse(R"({"model_type":"glm5_next","num_attention_heads":64,"num_key_value_heads":8})"),
               {"num_attention_heads", "num_key_value_heads"});
}

TEST(ConfigValidation, IndexKpoolZero) {
  expect_error(json::parse(R"({"model_type":"glm5_next","index_kpool":0})"), {"index_kpool"});
  expect_error(json::parse(R"({"model_type":"glm5_next","index_kpool":-4})"), {"index_kpool"});
}

TEST(ConfigValidation, IndexTopkNotDivisibleByKpool) {
  expect_error(json::parse(R"({"model_type":"glm5_next","index_topk":100,"index_kpool":16})"),
               {"index_topk", "index_kpool"});
  // Divisible is fine.
  EXPECT_EQ(parse_config(json::parse(R"({"model_type":"glm5_next","index_topk":96,"index_kpool":16})")).index_topk, 96);
}

TEST(ConfigValidation, QLoraRankNull) {
  expect_error(json::parse(R"({"model_type":"glm5_next","q_lora_rank":null})"), {"q_lora_rank"});
  expect_error(json::parse(R"({"model_type":"glm5_next","text_config":{"q_lora_rank":null}})"), {"q_lora_rank"});
}

TEST(ConfigValidation, RopeHeadDimMustBeZero) {
  expect_error(json::parse(R"({"model_type":"glm5_next","qk_rope_head_dim":64})"), {"qk_rope_head_dim"});
}

TEST(ConfigValidation, UnknownModelType) {
  expect_error(json::parse(R"({"model_type":"llama"})"), {"model_type", "llama"});
  expect_error(json::parse(R"({"model_type":"glm5_next_vision"})"), {"model_type", "glm5_next_vision"});
}

TEST(ConfigValidation, MissingModelType) {
  expect_error(json::parse(R"({"vocab_size":154880})"), {"model_type"});
  expect_error(json::parse(R"({"model_type":null})"), {"model_type"});
}

TEST(ConfigValidation, NotAnObject) {
  expect_error(json::parse(R"([{"model_type":"glm5_next"}])"), {"object"});
}

TEST(ConfigValidation, StringForAnInt) {
  expect_error(json::parse(R"({"model_type":"glm5_next","hidden_size":"4096"})"), {"hidden_size"});
}

TEST(ConfigValidation, BoolForAnInt) {
  expect_error(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":true})"), {"num_hidden_layers"});
}

TEST(ConfigValidation, FractionForAnInt) {
  expect_error(json::parse(R"({"model_type":"glm5_next","vocab_size":1000.5})"), {"vocab_size"});
}

TEST(ConfigValidation, IntegralFloatForAnIntIsAccepted) {
  EXPECT_EQ(parse_config(json::parse(R"({"model_type":"glm5_next","vocab_size":1000.0})")).vocab_size, 1000);
}

TEST(ConfigValidation, HugeFloatForAnInt) {
  expect_error(json::parse(R"({"model_type":"glm5_next","vocab_size":1e300})"), {"vocab_size"});
  expect_error(json::parse(R"({"model_type":"glm5_next","hidden_size":-1e300})"), {"hidden_size"});
}

TEST(ConfigValidation, HugeUnsignedForAnInt) {
  expect_error(json::parse(R"({"model_type":"glm5_next","vocab_size":18446744073709551615})"), {"vocab_size"});
  expect_error(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":9223372036854775808})"),
               {"num_hidden_layers"});
}

TEST(ConfigValidation, WrongTypeForFloatAndBool) {
  expect_error(json::parse(R"({"model_type":"glm5_next","rms_norm_eps":"1e-5"})"), {"rms_norm_eps"});
  expect_error(json::parse(R"({"model_type":"glm5_next","swiglu_limit":true})"), {"swiglu_limit"});
  expect_error(json::parse(R"({"model_type":"glm5_next","norm_topk_prob":1})"), {"norm_topk_prob"});
  expect_error(json::parse(R"({"model_type":"glm5_next","tie_word_embeddings":"false"})"), {"tie_word_embeddings"});
}

TEST(ConfigValidation, NonPositiveSizes) {
  expect_error(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":0})"), {"num_hidden_layers"});
  expect_error(json::parse(R"({"model_type":"glm5_next","hidden_size":0})"), {"hidden_size"});
  expect_error(json::parse(R"({"model_type":"glm5_next","hc_mult":0})"), {"hc_mult"});
  expect_error(json::parse(R"({"model_type":"glm5_next","hc_sinkhorn_iters":-1})"), {"hc_sinkhorn_iters"});
}

TEST(ConfigValidation, ListShorterThanLayers) {
  expect_error(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":4,
      "layer_types":["linear_attention","linear_attention","linear_attention"]})"),
               {"layer_types", "3", "4"});
  expect_error(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":4,"mlp_layer_types":["dense"]})"),
               {"mlp_layer_types"});
  expect_error(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":4,"indexer_types":["full","full"]})"),
               {"indexer_types"});
}

TEST(ConfigValidation, ListsLongerThanLayersAreTruncated) {
  // e.g. an extra entry for the MTP layer: transformers indexes by layer and ignores it.
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":3,
      "layer_types":["linear_attention","deepseek_sparse_attention","linear_attention","deepseek_sparse_attention"],
      "mlp_layer_types":["sparse","dense","sparse","dense","dense"],
      "indexer_types":["shared","full","shared","shared"]})"));
  EXPECT_EQ(c.layer_types, (std::vector<LayerType>{K, D, K}));
  EXPECT_EQ(c.mlp_layer_types, (std::vector<MlpType>{Sp, Dn, Sp}));
  EXPECT_EQ(c.indexer_types, (std::vector<IndexerType>{S, F, S}));
}

TEST(ConfigValidation, SharedIndexerDsaLayerAfterKdaLayer) {
  expect_error(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":4,
      "layer_types":["linear_attention","deepseek_sparse_attention","linear_attention","deepseek_sparse_attention"],
      "indexer_types":["full","full","full","shared"]})"),
               {"indexer_types", "layer 3"});
}

TEST(ConfigValidation, SharedIndexerDsaLayerFirst) {
  expect_error(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":2,
      "layer_types":["deepseek_sparse_attention","linear_attention"],"indexer_types":["shared","full"]})"),
               {"indexer_types", "layer 0"});
}

TEST(ConfigValidation, SharedIndexerDsaLayerAfterSharedDsaLayer) {
  // transformers hands a selection on only from a full layer, so a chain of two shared layers fails.
  expect_error(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":3,
      "layer_types":["deepseek_sparse_attention","deepseek_sparse_attention","deepseek_sparse_attention"],
      "indexer_types":["full","shared","shared"]})"),
               {"indexer_types", "layer 2"});
}

TEST(ConfigValidation, SharedIndexerDsaLayerAfterFullDsaLayerIsValid) {
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":3,
      "layer_types":["deepseek_sparse_attention","deepseek_sparse_attention","linear_attention"],
      "indexer_types":["full","shared","shared"]})"));
  EXPECT_EQ(c.indexer_types, (std::vector<IndexerType>{F, S, S}));
}

TEST(ConfigValidation, DefaultLayersWithFreqThatSharesAfterKdaIsRejected) {
  // Default layer types (layer 3 is DSA after KDA layer 2) with freq 3, offset 0: layer 3 gets "shared".
  expect_error(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":4,"index_topk_freq":3,
      "index_skip_topk_offset":0})"),
               {"indexer_types", "layer 3"});
}

TEST(ConfigValidation, RoutedExpertsNotDivisibleByGroups) {
  expect_error(json::parse(R"({"model_type":"glm5_next","n_routed_experts":10,"n_group":4,"topk_group":1,
      "num_experts_per_tok":2})"),
               {"n_routed_experts", "n_group"});
}

TEST(ConfigValidation, TopkGroupAboveGroups) {
  expect_error(json::parse(R"({"model_type":"glm5_next","n_routed_experts":8,"n_group":2,"topk_group":3,
      "num_experts_per_tok":2})"),
               {"topk_group"});
}

TEST(ConfigValidation, TooManyExpertsPerToken) {
  expect_error(json::parse(R"({"model_type":"glm5_next","n_routed_experts":8,"n_group":4,"topk_group":1,
      "num_experts_per_tok":3})"),
               {"num_experts_per_tok"});
}

TEST(ConfigValidation, MoeRulesIgnoredWithoutSparseLayers) {
  // With every layer dense the router fields are unused.
  const ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":2,
      "n_routed_experts":10,"n_group":4})"));
  EXPECT_EQ(c.mlp_layer_types, (std::vector<MlpType>{Dn, Dn}));
}

TEST(ConfigValidation, HiddenActOtherThanSilu) {
  expect_error(json::parse(R"({"model_type":"glm5_next","hidden_act":"gelu"})"), {"hidden_act", "gelu"});
  expect_error(json::parse(R"({"model_type":"glm5_next","hidden_act":5})"), {"hidden_act"});
}

TEST(ConfigValidation, ValidateCatchesAHandEditedConfig) {
  ModelConfig c = parse_config(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":4})"));
  EXPECT_NO_THROW(validate(c));
  c.layer_types.pop_back();
  EXPECT_THROW(validate(c), Error);
  c = parse_config(json::parse(R"({"model_type":"glm5_next","num_hidden_layers":4})"));
  c.index_topk = 33;
  try {
    validate(c);
    ADD_FAILURE() << "validate accepted index_topk 33 with kpool 16";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("index_topk"), std::string::npos) << e.what();
  }
}

// ------------------------------------------------------------------------------------------------ load_config

TEST(ConfigLoad, NonexistentPathIsNamed) {
  const std::string path = std::string(NEXTLM_TEST_DATA) + "/golden/no_such_case/config.json";
  try {
    (void)load_config(path);
    ADD_FAILURE() << "load_config accepted a missing file";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
}

TEST(ConfigLoad, InvalidJsonIsNamed) {
  test::TempDir dir;
  const std::string path = dir.str("config.json");
  std::ofstream(path) << R"({"model_type": "glm5_next", "vocab_size": )";
  try {
    (void)load_config(path);
    ADD_FAILURE() << "load_config accepted truncated JSON";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("JSON"), std::string::npos) << e.what();
  }
}

TEST(ConfigLoad, ParseErrorsNameThePathAndTheField) {
  test::TempDir dir;
  const std::string path = dir.str("config.json");
  std::ofstream(path) << R"({"model_type": "glm5_next", "qk_rope_head_dim": 64})";
  try {
    (void)load_config(path);
    ADD_FAILURE() << "load_config accepted qk_rope_head_dim 64";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("qk_rope_head_dim"), std::string::npos) << e.what();
  }
}

TEST(ConfigLoad, ValidFileMatchesParseConfig) {
  test::TempDir dir;
  const std::string path = dir.str("config.json");
  const char* text = R"({"model_type":"glm5_next","text_config":{"num_hidden_layers":6,"vocab_size":512}})";
  std::ofstream(path) << text;
  const ModelConfig a = load_config(path);
  const ModelConfig b = parse_config(json::parse(text));
  expect_same_model(a, b);
  EXPECT_EQ(a.num_hidden_layers, 6);
  EXPECT_TRUE(a.nested);
}

// -------------------------------------------------------------------------------------------- golden configs

TEST(ConfigGolden, Bf16ShardedDerivesTheDefaultLists) {
  const ModelConfig c = load_config(golden_config("bf16_sharded"));
  EXPECT_TRUE(c.nested);
  EXPECT_EQ(c.num_hidden_layers, 4);
  EXPECT_EQ(c.vocab_size, 256);
  EXPECT_EQ(c.hidden_size, 48);
  EXPECT_EQ(c.layer_types, (std::vector<LayerType>{K, K, K, D}));
  EXPECT_EQ(c.mlp_layer_types, (std::vector<MlpType>{Dn, Dn, Dn, Sp}));
  EXPECT_EQ(c.indexer_types, (std::vector<IndexerType>{F, F, F, F}));
  EXPECT_EQ(c.linear_lower_bound, std::optional<double>(-5.0));
  EXPECT_EQ(c.n_group, 2);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_EQ(c.index_kpool, 4);
  EXPECT_EQ(c.index_topk, 32);
  EXPECT_TRUE(c.index_kpool_always_select_tail);
  EXPECT_DOUBLE_EQ(c.swiglu_limit, 1.0);
  EXPECT_EQ(c.hc_mult, 4);
  EXPECT_EQ(c.hc_sinkhorn_iters, 20);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.pad_token_id, std::optional<int64_t>(0));
}

TEST(ConfigGolden, Fp32FlatSoftplusUsesLinearAttnConfig) {
  const ModelConfig c = load_config(golden_config("fp32_flat_softplus"));
  EXPECT_FALSE(c.nested);
  EXPECT_EQ(c.num_hidden_layers, 5);
  EXPECT_FALSE(c.linear_lower_bound.has_value());  // safe_gate false with a null bound: softplus gate
  EXPECT_EQ(c.linear_head_dim, 16);
  EXPECT_EQ(c.linear_num_heads, 2);
  EXPECT_EQ(c.linear_conv_kernel_dim, 4);
  EXPECT_EQ(c.hc_mult, 3);
  EXPECT_EQ(c.hc_sinkhorn_iters, 7);
  EXPECT_EQ(c.index_kpool, 1);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ(c.layer_types, (std::vector<LayerType>{K, D, D, K, D}));
  EXPECT_EQ(c.indexer_types, (std::vector<IndexerType>{F, F, S, F, F}));
  EXPECT_EQ(c.mlp_layer_types, (std::vector<MlpType>{Dn, Sp, Sp, Sp, Sp}));
}

TEST(ConfigGolden, Fp32TailOffUsesIndexTopkPattern) {
  const ModelConfig c = load_config(golden_config("fp32_tail_off"));
  EXPECT_TRUE(c.nested);
  EXPECT_EQ(c.num_hidden_layers, 4);
  EXPECT_EQ(c.layer_types, (std::vector<LayerType>{K, D, D, K}));
  EXPECT_EQ(c.indexer_types, (std::vector<IndexerType>{F, F, S, F}));  // "FFSF"
  EXPECT_EQ(c.mlp_layer_types, (std::vector<MlpType>{Sp, Sp, Dn, Sp}));
  EXPECT_FALSE(c.index_kpool_always_select_tail);
  EXPECT_EQ(c.index_topk, 16);
  EXPECT_EQ(c.index_kpool, 4);
  EXPECT_EQ(c.n_group, 4);
  EXPECT_EQ(c.topk_group, 2);
  EXPECT_EQ(c.linear_lower_bound, std::optional<double>(-5.0));
}

// The environment's switches (core/env.h): unset, the switch's default; "0", off; anything else, on. An EnvSwitch
// reads the variable at its first use unless set before, and keeps what it read.
TEST(EnvSwitch, DefaultsAndTheEnvironment) {
  const char* name = "NEXTLM_TEST_SWITCH_53";
  unsetenv(name);
  EXPECT_TRUE(env_switch_on(name));
  EXPECT_FALSE(env_switch_on(name, false));
  setenv(name, "0", 1);
  EXPECT_FALSE(env_switch_on(name));
  EXPECT_FALSE(env_switch_on(name, false));
  setenv(name, "1", 1);
  EXPECT_TRUE(env_switch_on(name));
  EXPECT_TRUE(env_switch_on(name, false));
  EnvSwitch on_by_env{name, false};
  EXPECT_TRUE(on_by_env.on());
  unsetenv(name);
  EXPECT_TRUE(on_by_env.on()) << "read once";
  EnvSwitch off_by_default{name, false}, on_by_default{name};
  EXPECT_FALSE(off_by_default.on());
  EXPECT_TRUE(on_by_default.on());
  off_by_default.set(true);
  EXPECT_TRUE(off_by_default.on());
}
