// `expert-forge --arch glm4moe`: a llama.cpp `glm4moe` file as the converter writes GLM-4.5 (q/k/v
// biases, optional q/k norms, partial RoPE, a dense first layer, exp_probs_b, a shared expert, the
// MTP block after the main ones), which the slice map, expertctl and the engine take, at any
// size; the defaults are GLM-4.5-Air's.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "engine/cpu_engine.h"
#include "engine/model.h"
#include "forge/plan.h"
#include "storage/gguf.h"
#include "storage/slice_map.h"
#include "testing/temp_dir.h"
#include "tests/engine/file_expert_source.h"
#include "tests/forge/forge_files.h"

namespace expertd {
namespace {

struct Shape {
  uint64_t layers = 3, nextn = 1, experts = 16, top_k = 4, embd = 128, ff = 64, heads = 4;
  uint64_t kv_heads = 2, head_dim = 64, dense_ff = 192, vocab = 300;
};

std::string forge_args(const Shape& s, const std::string& out, const std::string& extra = "") {
  return fmt::format(
      "--arch glm4moe --layers {} --experts {} --top-k {} --embd {} --ff {} --heads {} "
      "--kv-heads {} --head-dim {} --dense-ff {} --vocab {} --seed 9 {} -o {}",
      s.layers, s.experts, s.top_k, s.embd, s.ff, s.heads, s.kv_heads, s.head_dim, s.dense_ff,
      s.vocab, extra, out);
}

using Want = test::WantTensor;

// What llama.cpp's glm4moe load_arch_tensors creates (one dense layer, one shared expert, q/k
// norms when asked, the MTP block's tensors), written out from the loader, not from the plan.
std::vector<Want> llama_cpp_tensors(const Shape& s, bool qk_norm, GgmlType dense,
                                    GgmlType experts) {
  constexpr GgmlType f32 = GgmlType::F32;
  const uint64_t q = s.heads * s.head_dim;
  const uint64_t kv = s.kv_heads * s.head_dim;
  std::vector<Want> w = {{"token_embd.weight", dense, {s.embd, s.vocab}},
                         {"output_norm.weight", f32, {s.embd}},
                         {"output.weight", dense, {s.embd, s.vocab}}};
  for (uint64_t i = 0; i < s.layers + s.nextn; ++i) {
    auto n = [i](const char* t, const char* suffix = "weight") {
      return fmt::format("blk.{}.{}.{}", i, t, suffix);
    };
    const std::vector<Want> attn = {
        {n("attn_norm"), f32, {s.embd}},           {n("attn_q"), dense, {s.embd, q}},
        {n("attn_q", "bias"), f32, {q}},           {n("attn_k"), dense, {s.embd, kv}},
        {n("attn_k", "bias"), f32, {kv}},          {n("attn_v"), dense, {s.embd, kv}},
        {n("attn_v", "bias"), f32, {kv}},          {n("attn_output"), dense, {q, s.embd}},
        {n("post_attention_norm"), f32, {s.embd}},
    };
    w.insert(w.end(), attn.begin(), attn.end());
    if (qk_norm) {
      w.push_back({n("attn_q_norm"), f32, {s.head_dim}});
      w.push_back({n("attn_k_norm"), f32, {s.head_dim}});
    }
    if (i == 0) {
      w.push_back({n("ffn_gate"), dense, {s.embd, s.dense_ff}});
      w.push_back({n("ffn_down"), dense, {s.dense_ff, s.embd}});
      w.push_back({n("ffn_up"), dense, {s.embd, s.dense_ff}});
      continue;
    }
    const std::vector<Want> moe = {
        {n("ffn_gate_inp"), f32, {s.embd, s.experts}},
        {n("exp_probs_b", "bias"), f32, {s.experts}},
        {n("ffn_gate_exps"), experts, {s.embd, s.ff, s.experts}},
        {n("ffn_down_exps"), experts, {s.ff, s.embd, s.experts}},
        {n("ffn_up_exps"), experts, {s.embd, s.ff, s.experts}},
        {n("ffn_gate_shexp"), dense, {s.embd, s.ff}},
        {n("ffn_down_shexp"), dense, {s.ff, s.embd}},
        {n("ffn_up_shexp"), dense, {s.embd, s.ff}},
    };
    w.insert(w.end(), moe.begin(), moe.end());
    if (i >= s.layers) {
      w.push_back({n("nextn.eh_proj"), dense, {2 * s.embd, s.embd}});
      w.push_back({n("nextn.enorm"), f32, {s.embd}});
      w.push_back({n("nextn.hnorm"), f32, {s.embd}});
      w.push_back({n("nextn.shared_head_norm"), f32, {s.embd}});
    }
  }
  return w;
}

TEST(ForgeGlm4Moe, WritesTheKeysAndTensorsOfTheConvertersGlm45) {
  const Shape s;
  test::TempDir dir{"expertd-forge-glm"};
  const std::string out = dir.file("g.gguf");
  const auto r = test::run_forge(forge_args(s, out, "--qk-norm"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto model = GgufModel::open(out);
  ASSERT_TRUE(model) << model.error().message;
  EXPECT_EQ(model->architecture(), "glm4moe");
  test::expect_tensors(*model, llama_cpp_tensors(s, true, GgmlType::F16, GgmlType::Q8_0));
  auto u = [&](const char* k) { return model->find_arch(k)->as_u64().value_or(0); };
  EXPECT_EQ(u("block_count"), 4u);  // 3 main layers + the MTP block
  EXPECT_EQ(u("nextn_predict_layers"), 1u);
  EXPECT_EQ(u("rope.dimension_count"), 32u);  // half the head, as partial_rotary_factor 0.5
  EXPECT_EQ(u("leading_dense_block_count"), 1u);
  EXPECT_EQ(u("feed_forward_length"), 192u);
  EXPECT_EQ(u("expert_feed_forward_length"), 64u);
  EXPECT_EQ(u("expert_shared_count"), 1u);
  EXPECT_EQ(u("expert_group_count"), 1u);
  EXPECT_EQ(u("expert_gating_func"), 2u);
  EXPECT_GT(test::validate_forged_model(*model), 0u);

  // The slice map takes every MoE block, the MTP block's too; the dense layer has none.
  auto map = SliceMap::build(*model);
  ASSERT_TRUE(map) << map.error().message;
  EXPECT_EQ(map->block_count(), 4u);
  EXPECT_EQ(map->layers().size(), 3u);
  EXPECT_EQ(map->find_layer(0), nullptr);
  EXPECT_NE(map->find_layer(3), nullptr);

  const auto inspect = test::run_command({test::bin_path("expertctl"), "inspect", out});
  ASSERT_EQ(inspect.status, 0) << inspect.err;
  for (const char* line :
       {"architecture   glm4moe",
        "attention    4 heads, 2 KV heads of 64, rope on 32 of them "
        "(NEOX), q/k norms yes",
        "dense layers 1: 0 (ff 192)",
        "routing      sigmoid, 16 experts in 1 groups, top-4 from 1 groups, scale 1, "
        "renormalised",
        "shared exp.  1 (ff 64, dense weights)", "MTP layers   1: 3 (skipped by the engine)"}) {
    EXPECT_NE(inspect.out.find(line), std::string::npos) << line << "\n" << inspect.out;
  }
}

// The engine's loader takes the forge as glm4moe (the MTP block skipped) and the CPU forward stays
// sane: finite logits of moderate size that change with the token, the router spreading tokens
// over the experts of the two MoE layers.
TEST(ForgeGlm4Moe, TheEngineRunsIt) {
  const Shape s;
  test::TempDir dir{"expertd-forge-glm"};
  const std::string out = dir.file("g.gguf");
  ASSERT_EQ(test::run_forge(forge_args(s, out)).exit_code, 0);
  auto model = engine::DenseModel::load(out);
  ASSERT_TRUE(model) << model.error().message;
  const engine::ModelParams& p = model->params();
  EXPECT_EQ(p.family, engine::Family::Glm4Moe);
  EXPECT_EQ(p.n_layer, 3u);
  EXPECT_EQ(p.nextn_layers, 1u);
  EXPECT_FALSE(p.qk_norm);
  EXPECT_EQ(p.n_rot, 32u);
  auto source = engine::test::FileExpertSource::open(*model);
  ASSERT_TRUE(source) << source.error().message;
  auto eng = engine::create_cpu_engine(*model, **source, engine::EngineOptions{32, 0, 0});
  ASSERT_TRUE(eng) << eng.error().message;
  const auto routing = test::expect_sane_forward(**eng, static_cast<uint32_t>(s.vocab), 16);
  EXPECT_EQ(routing.size(), 16u * 2);  // layers 1 and 2
  EXPECT_GE(test::experts_used(routing).size(), 8u);
}

TEST(ForgeGlm4Moe, DefaultsAreGlm45Air) {
  ForgeConfig c = forge_defaults(ForgeArch::Glm4Moe);
  EXPECT_EQ(c.experts, 128u);
  EXPECT_EQ(c.top_k, 8u);
  EXPECT_EQ(c.embd, 4096u);
  EXPECT_EQ(c.ff, 1408u);
  EXPECT_EQ(c.heads, 96u);
  EXPECT_EQ(c.kv_heads, 8u);
  EXPECT_EQ(c.head_dim, 128u);
  EXPECT_EQ(c.rope_dim, 64u);
  EXPECT_EQ(c.dense_layers, 1u);
  EXPECT_EQ(c.dense_ff, 10944u);
  EXPECT_EQ(c.shared_experts, 1u);
  EXPECT_EQ(c.expert_groups, 1u);
  EXPECT_EQ(c.nextn, 1u);
  EXPECT_FALSE(c.qk_norm);
  c.layers = 46;
  c.vocab = 32000;  // GLM-4.5 has 151552; the experts do not depend on it
  // Q8_0: 1408 is not a whole number of 256-element k-quant blocks.
  c.expert_type = GgmlType::Q8_0;
  c.output = "/nonexistent/glm-4.5-air.gguf";
  const Status valid = validate_forge_config(c);
  ASSERT_TRUE(valid) << valid.error().message;
  auto shards = plan_forge_model(c);
  ASSERT_TRUE(shards) << shards.error().message;
  uint64_t expert_bytes = 0;
  for (const auto& t : (*shards)[0].writer.tensors()) {
    if (t.name.ends_with("_exps.weight")) expert_bytes += t.bytes;
  }
  // 45 MoE layers + the MTP block, 128 experts of 3 x 4096 x 1408 at q8_0: 108.2 GB.
  EXPECT_EQ(expert_bytes, 46ull * 128 * 3 * 4096 * 1408 / 32 * 34);
  EXPECT_EQ(parse_forge_arch("glm4moe").value(), ForgeArch::Glm4Moe);
  EXPECT_EQ(forge_gguf_arch(ForgeArch::Glm4Moe), "glm4moe");
}

TEST(ForgeGlm4Moe, ARopeDimBeyondTheHeadIsRefused) {
  const auto r = test::run_forge(forge_args(Shape{}, "/nonexistent/g.gguf", "--rope-dim 96"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--rope-dim 96: must be even, at least 2 and at most --head-dim (64)"),
            std::string::npos)
      << r.output;
}

TEST(ForgeGlm4Moe, QkNormIsRefusedForOtherArchitectures) {
  const auto r = test::run_forge("--arch qwen3moe --qk-norm -o /nonexistent/q.gguf");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--qk-norm: only with --arch glm4moe"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace expertd
