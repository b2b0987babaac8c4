// `expert-forge --arch mixtral`: a llama.cpp `llama` file with routed experts as the converter
// writes Mixtral (llama.* keys, feed_forward_length as the experts' width, no q/k norms, merged
// ffn_*_exps), which the slice map, expertctl and the engine take, at any size; the defaults are
// Mixtral-8x7B's.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <set>
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

constexpr uint32_t kVocab = 300;

std::string small_mixtral(const std::string& out, const std::string& extra = "") {
  return fmt::format(
      "--arch mixtral --layers 3 --experts 8 --top-k 2 --embd 256 --ff 256 --heads 4 --kv-heads 2 "
      "--head-dim 64 --vocab {} --seed 5 {} -o {}",
      kVocab, extra, out);
}

uint64_t key_u64(const GgufModel& m, const std::string& key) {
  const GgufValue* v = m.meta().find(key);
  EXPECT_NE(v, nullptr) << key;
  return v != nullptr ? v->as_u64().value_or(0) : 0;
}

TEST(ForgeMixtral, WritesTheKeysAndTensorsOfTheConvertersMixtral) {
  test::TempDir dir{"expertd-forge-mixtral"};
  const std::string out = dir.file("m.gguf");
  const auto r = test::run_forge(small_mixtral(out, "--expert-type q4_k"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("expert-forge: mixtral 3 layers x 8 experts (top 2)"), std::string::npos)
      << r.output;
  auto model = GgufModel::open(out);
  ASSERT_TRUE(model) << model.error().message;
  EXPECT_EQ(model->architecture(), "llama");
  EXPECT_EQ(key_u64(*model, "llama.expert_count"), 8u);
  EXPECT_EQ(key_u64(*model, "llama.expert_used_count"), 2u);
  EXPECT_EQ(key_u64(*model, "llama.feed_forward_length"), 256u);
  EXPECT_EQ(key_u64(*model, "llama.rope.dimension_count"), 64u);
  // 4 heads of 64 are the embedding: llama.cpp derives the head size, as the converter expects.
  EXPECT_EQ(model->meta().find("llama.attention.key_length"), nullptr);
  EXPECT_EQ(model->meta().find("llama.expert_feed_forward_length"), nullptr);
  EXPECT_FALSE(model->find_tensor("blk.0.attn_q_norm.weight"));
  const auto gate = model->find_tensor("blk.2.ffn_gate_exps.weight");
  ASSERT_TRUE(gate);
  EXPECT_EQ(gate->info->type, GgmlType::Q4_K);
  EXPECT_EQ(std::vector<uint64_t>(gate->info->ne.begin(), gate->info->ne.begin() + 3),
            (std::vector<uint64_t>{256, 256, 8}));

  auto map = SliceMap::build(*model);
  ASSERT_TRUE(map) << map.error().message;
  EXPECT_EQ(map->expert_count(), 8u);
  EXPECT_EQ(map->top_k(), 2u);
  EXPECT_EQ(map->layers().size(), 3u);
  EXPECT_EQ(map->layers()[0].slice_count, 3u);

  const auto inspect = test::run_command({test::bin_path("expertctl"), "inspect", out});
  ASSERT_EQ(inspect.status, 0) << inspect.err;
  EXPECT_NE(inspect.out.find("architecture   llama"), std::string::npos) << inspect.out;
  EXPECT_NE(inspect.out.find("experts        8 per layer, top-k 2"), std::string::npos)
      << inspect.out;

  // A head size other than embd / heads is written out, as llama.cpp then needs it.
  const std::string odd = dir.file("odd.gguf");
  ASSERT_EQ(test::run_forge(small_mixtral(odd, "--head-dim 32")).exit_code, 0);
  auto odd_model = GgufModel::open(odd);
  ASSERT_TRUE(odd_model) << odd_model.error().message;
  EXPECT_EQ(key_u64(*odd_model, "llama.attention.key_length"), 32u);
}

// The engine's loader takes the forge as Mixtral (NORM RoPE, no q/k norms) and the CPU forward
// stays sane: finite logits of moderate size that change with the token, the router spreading
// tokens over the experts.
TEST(ForgeMixtral, TheEngineRunsItAsMixtral) {
  test::TempDir dir{"expertd-forge-mixtral"};
  const std::string out = dir.file("m.gguf");
  ASSERT_EQ(test::run_forge(small_mixtral(out)).exit_code, 0);
  auto model = engine::DenseModel::load(out);
  ASSERT_TRUE(model) << model.error().message;
  EXPECT_EQ(model->params().rope, engine::RopeType::Norm);
  EXPECT_FALSE(model->params().qk_norm);
  EXPECT_EQ(model->params().n_ff_exp, 256u);
  auto source = engine::test::FileExpertSource::open(*model);
  ASSERT_TRUE(source) << source.error().message;
  auto eng = engine::create_cpu_engine(*model, **source, engine::EngineOptions{32, 0, 0});
  ASSERT_TRUE(eng) << eng.error().message;
  const auto routing = test::expect_sane_forward(**eng, kVocab, 16);
  EXPECT_EQ(routing.size(), 16u * 3);
  const std::set<uint32_t> used = test::experts_used(routing);
  EXPECT_GE(used.size(), 6u);
}

// The defaults are Mixtral-8x7B's: 32 layers of it at q4_k are its 25 GB of experts.
TEST(ForgeMixtral, DefaultsAreMixtral8x7B) {
  ForgeConfig c = forge_defaults(ForgeArch::Mixtral);
  EXPECT_EQ(c.experts, 8u);
  EXPECT_EQ(c.top_k, 2u);
  EXPECT_EQ(c.embd, 4096u);
  EXPECT_EQ(c.ff, 14336u);
  EXPECT_EQ(c.heads, 32u);
  EXPECT_EQ(c.kv_heads, 8u);
  EXPECT_EQ(c.head_dim, 128u);
  c.layers = 32;
  c.vocab = 32000;
  c.expert_type = GgmlType::Q4_K;
  c.output = "/nonexistent/mixtral.gguf";
  ASSERT_TRUE(validate_forge_config(c));
  auto shards = plan_forge_model(c);
  ASSERT_TRUE(shards) << shards.error().message;
  uint64_t expert_bytes = 0;
  for (const auto& t : (*shards)[0].writer.tensors()) {
    if (t.name.find("_exps.") != std::string::npos) expert_bytes += t.bytes;
  }
  EXPECT_EQ(expert_bytes, 32ull * 8 * 3 * 4096 * 14336 / 256 * 144);  // 25.4 GB
  EXPECT_EQ(parse_forge_arch("mixtral").value(), ForgeArch::Mixtral);
  EXPECT_EQ(forge_gguf_arch(ForgeArch::Mixtral), "llama");
}

TEST(ForgeMixtral, AnUnknownArchIsRefusedNamingTheChoices) {
  const auto r = test::run_forge("--arch mistral -o /nonexistent/x.gguf");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(
      r.output.find(
          "--arch mistral: must be qwen3moe, deepseek4, mixtral, deepseek3, gpt-oss or glm4moe"),
      std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace expertd
