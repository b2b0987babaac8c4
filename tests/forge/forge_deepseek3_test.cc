// `expert-forge --arch deepseek3`: a llama.cpp `deepseek2` file with every key and tensor its
// loader requires for DeepSeek-V3 (names, types, shapes as load_arch_tensors asks for them), bytes
// the content function's, routed experts in the slice map and the dense first layers and shared
// experts out of it, and a model the engine loads and runs. DeepSeek-V3's own widths are the
// defaults.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "engine/cpu_engine.h"
#include "engine/model.h"
#include "forge/content.h"
#include "forge/plan.h"
#include "storage/gguf.h"
#include "storage/slice_map.h"
#include "testing/temp_dir.h"
#include "tests/engine/file_expert_source.h"
#include "tests/forge/forge_files.h"

namespace expertd {
namespace {

struct Shape {
  uint64_t layers = 4, dense = 1, experts = 16, top_k = 4, embd = 256, ff = 256, heads = 4;
  uint64_t head_dim = 96, rope = 32, q_lora = 64, kv_lora = 64, v_head = 64, dense_ff = 512;
  uint64_t groups = 4, used = 2, vocab = 300;
};

std::string forge_args(const Shape& s, const std::string& out, const std::string& extra = "") {
  return fmt::format(
      "--arch deepseek3 --layers {} --dense-layers {} --experts {} --top-k {} --embd {} --ff {} "
      "--heads {} --head-dim {} --rope-dim {} --q-lora-rank {} --kv-lora-rank {} --v-head-dim {} "
      "--dense-ff {} --expert-groups {} --groups-used {} --vocab {} --seed 7 {} -o {}",
      s.layers, s.dense, s.experts, s.top_k, s.embd, s.ff, s.heads, s.head_dim, s.rope, s.q_lora,
      s.kv_lora, s.v_head, s.dense_ff, s.groups, s.used, s.vocab, extra, out);
}

using Want = test::WantTensor;

// What llama.cpp's deepseek2 load_arch_tensors creates for an MLA model with a q LoRA, written
// out from the loader, not from the forge's plan.
std::vector<Want> llama_cpp_tensors(const Shape& s, GgmlType dense, GgmlType experts) {
  constexpr GgmlType f32 = GgmlType::F32;
  const uint64_t nope = s.head_dim - s.rope;
  std::vector<Want> w = {{"token_embd.weight", dense, {s.embd, s.vocab}},
                         {"output_norm.weight", f32, {s.embd}},
                         {"output.weight", dense, {s.embd, s.vocab}}};
  for (uint64_t i = 0; i < s.layers; ++i) {
    auto n = [i](const char* t, const char* suffix = "weight") {
      return fmt::format("blk.{}.{}.{}", i, t, suffix);
    };
    const std::vector<Want> attn = {
        {n("attn_norm"), f32, {s.embd}},
        {n("attn_q_a_norm"), f32, {s.q_lora}},
        {n("attn_kv_a_norm"), f32, {s.kv_lora}},
        {n("attn_q_a"), dense, {s.embd, s.q_lora}},
        {n("attn_q_b"), dense, {s.q_lora, s.heads * s.head_dim}},
        {n("attn_kv_a_mqa"), dense, {s.embd, s.kv_lora + s.rope}},
        {n("attn_k_b"), dense, {nope, s.kv_lora, s.heads}},
        {n("attn_v_b"), dense, {s.kv_lora, s.v_head, s.heads}},
        {n("attn_output"), dense, {s.heads * s.v_head, s.embd}},
        {n("ffn_norm"), f32, {s.embd}},
    };
    w.insert(w.end(), attn.begin(), attn.end());
    if (i < s.dense) {
      w.push_back({n("ffn_gate"), dense, {s.embd, s.dense_ff}});
      w.push_back({n("ffn_down"), dense, {s.dense_ff, s.embd}});
      w.push_back({n("ffn_up"), dense, {s.embd, s.dense_ff}});
      continue;
    }
    const std::vector<Want> moe = {
        {n("ffn_gate_inp"), f32, {s.embd, s.experts}},
        {n("exp_probs_b", "bias"), f32, {s.experts}},
        {n("ffn_down_exps"), experts, {s.ff, s.embd, s.experts}},
        {n("ffn_gate_exps"), experts, {s.embd, s.ff, s.experts}},
        {n("ffn_up_exps"), experts, {s.embd, s.ff, s.experts}},
        {n("ffn_gate_shexp"), dense, {s.embd, s.ff}},
        {n("ffn_down_shexp"), dense, {s.ff, s.embd}},
        {n("ffn_up_shexp"), dense, {s.embd, s.ff}},
    };
    w.insert(w.end(), moe.begin(), moe.end());
  }
  return w;
}

class ForgeDeepseek3 : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_FALSE(dir_.path().empty()) << "mkdtemp failed"; }
  std::string path(const std::string& name) const { return dir_.file(name); }
  test::TempDir dir_{"expertd-forge-ds3"};
};

TEST_F(ForgeDeepseek3, EveryTensorLlamaCppLoadsWithItsShapeAndBytes) {
  const Shape s;
  const std::string out = path("ds3.gguf");
  const auto r = test::run_forge(forge_args(s, out, "--expert-type q4_k"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("expert-forge: deepseek3 4 layers x 16 experts (top 4)"),
            std::string::npos)
      << r.output;
  auto model = GgufModel::open(out);
  ASSERT_TRUE(model) << model.error().message;
  EXPECT_EQ(model->architecture(), "deepseek2");
  const auto want = llama_cpp_tensors(s, GgmlType::Q8_0, GgmlType::Q4_K);
  test::expect_tensors(*model, want);
  EXPECT_EQ(test::validate_forged_model(*model), want.size());

  // Routed experts are streamed; the dense layer and the shared experts are not.
  auto map = SliceMap::build(*model);
  ASSERT_TRUE(map) << map.error().message;
  EXPECT_EQ(map->block_count(), s.layers);
  EXPECT_EQ(map->find_layer(0), nullptr);
  ASSERT_EQ(map->layers().size(), s.layers - s.dense);
  for (const MoeLayer& l : map->layers()) {
    EXPECT_GE(l.layer, s.dense);
    EXPECT_EQ(l.slice_count, 3u);
    // An expert is its gate, up and down slices (q4_k), nothing of the shared expert.
    EXPECT_EQ(map->expert_bytes(l.layer), 3 * s.ff * s.embd / 256 * 144);
  }
}

TEST_F(ForgeDeepseek3, WritesTheKeysLlamaCppReads) {
  const Shape s;
  const std::string out = path("meta.gguf");
  ASSERT_EQ(test::run_forge(forge_args(s, out)).exit_code, 0);
  auto model = GgufModel::open(out);
  ASSERT_TRUE(model) << model.error().message;
  const GgufFile& m = model->meta();
  using T = GgufValueType;
  // Key, GGUF type and value, as llama.cpp's converter writes them for DeepSeek-V3.
  const std::map<std::string, std::pair<T, double>> scalars = {
      {"block_count", {T::UINT32, 4}},
      {"embedding_length", {T::UINT32, 256}},
      {"feed_forward_length", {T::UINT32, 512}},
      {"attention.head_count", {T::UINT32, 4}},
      {"attention.head_count_kv", {T::UINT32, 1}},
      {"attention.key_length", {T::UINT32, 96}},  // kv_lora + rope
      {"attention.value_length", {T::UINT32, 64}},
      {"attention.key_length_mla", {T::UINT32, 96}},
      {"attention.value_length_mla", {T::UINT32, 64}},
      {"attention.q_lora_rank", {T::UINT32, 64}},
      {"attention.kv_lora_rank", {T::UINT32, 64}},
      {"rope.dimension_count", {T::UINT32, 32}},
      {"rope.scaling.factor", {T::FLOAT32, 40}},
      {"rope.scaling.original_context_length", {T::UINT32, 4096}},
      {"rope.scaling.yarn_log_multiplier", {T::FLOAT32, 0.1f}},
      {"leading_dense_block_count", {T::UINT32, 1}},
      {"expert_count", {T::UINT32, 16}},
      {"expert_used_count", {T::UINT32, 4}},
      {"expert_group_count", {T::UINT32, 4}},
      {"expert_group_used_count", {T::UINT32, 2}},
      {"expert_gating_func", {T::UINT32, 2}},
      {"expert_feed_forward_length", {T::UINT32, 256}},
      {"expert_shared_count", {T::UINT32, 1}},
      {"expert_weights_scale", {T::FLOAT32, 2.5}},
  };
  for (const auto& [suffix, tv] : scalars) {
    SCOPED_TRACE(suffix);
    const GgufValue* v = m.find("deepseek2." + suffix);
    ASSERT_NE(v, nullptr) << "missing";
    EXPECT_EQ(v->type, tv.first);
    EXPECT_DOUBLE_EQ(*v->as_f64(), tv.second);
  }
  EXPECT_EQ(*m.find("deepseek2.rope.scaling.type")->as_string(), "yarn");
  EXPECT_EQ(*m.find("deepseek2.expert_weights_norm")->as_bool(), true);
}

// The engine's deepseek2 loader takes the forge, and the CPU forward stays numerically sane:
// finite logits of moderate size that change with the token, and a group-limited router that
// still spreads tokens over the experts.
TEST_F(ForgeDeepseek3, TheEngineLoadsItAndTheForwardStaysSane) {
  const Shape s;
  const std::string out = path("engine.gguf");
  ASSERT_EQ(test::run_forge(forge_args(s, out)).exit_code, 0);
  auto model = engine::DenseModel::load(out);
  ASSERT_TRUE(model) << model.error().message;
  ASSERT_TRUE(model->params().is_ds3());
  EXPECT_EQ(model->params().ds3.dense_lead, s.dense);
  auto source = engine::test::FileExpertSource::open(*model);
  ASSERT_TRUE(source) << source.error().message;
  auto eng = engine::create_cpu_engine(*model, **source, engine::EngineOptions{64, 0, 0});
  ASSERT_TRUE(eng) << eng.error().message;
  std::vector<engine::RoutingRecord> routing;
  (*eng)->set_routing_log(&routing);
  std::vector<float> logits(s.vocab), previous;
  for (uint32_t t = 0; t < 24; ++t) {
    const uint32_t token = (t * 37 + 11) % static_cast<uint32_t>(s.vocab);
    ASSERT_TRUE((*eng)->decode(token, logits)) << "position " << t;
    double sq = 0;
    for (const float x : logits) {
      ASSERT_TRUE(std::isfinite(x)) << "position " << t;
      sq += double{x} * x;
    }
    const double rms = std::sqrt(sq / static_cast<double>(logits.size()));
    EXPECT_GT(rms, 1e-3) << "position " << t;
    EXPECT_LT(rms, 100.0) << "position " << t;
    EXPECT_NE(logits, previous) << "position " << t;
    previous = logits;
  }
  std::set<uint32_t> used;
  for (const auto& r : routing) {
    used.insert(r.experts.begin(), r.experts.end());
    // Group-limited: the top-k lies in at most groups-used groups.
    std::set<uint32_t> groups;
    for (const uint32_t e : r.experts) groups.insert(e / (s.experts / s.groups));
    EXPECT_LE(groups.size(), s.used);
  }
  EXPECT_EQ(routing.size(), 24u * (s.layers - s.dense));
  EXPECT_GE(used.size(), s.experts / 2);
}

// The defaults are DeepSeek-V3's widths; the plan of a 5-layer model has its shapes and sizes.
TEST(ForgeDeepseek3Plan, DefaultsAreDeepseekV3) {
  ForgeConfig c = forge_defaults(ForgeArch::Deepseek3);
  EXPECT_EQ(c.experts, 256u);
  EXPECT_EQ(c.top_k, 8u);
  EXPECT_EQ(c.embd, 7168u);
  EXPECT_EQ(c.ff, 2048u);
  EXPECT_EQ(c.heads, 128u);
  EXPECT_EQ(c.head_dim, 192u);
  EXPECT_EQ(c.q_lora_rank, 1536u);
  EXPECT_EQ(c.kv_lora_rank, 512u);
  EXPECT_EQ(c.expert_groups, 8u);
  EXPECT_EQ(c.groups_used, 4u);
  EXPECT_EQ(c.dense_layers, 3u);
  c.layers = 5;
  c.vocab = 1024;
  c.output = "/nonexistent/ds3.gguf";
  ASSERT_TRUE(validate_forge_config(c));
  auto shards = plan_forge_model(c);
  ASSERT_TRUE(shards) << shards.error().message;
  std::map<std::string, const GgufTensorInfo*> by_name;
  for (const auto& t : (*shards)[0].writer.tensors()) by_name[t.name] = &t;
  auto ne = [&](const std::string& name) {
    const auto it = by_name.find(name);
    return it == by_name.end() ? std::vector<uint64_t>{}
                               : std::vector<uint64_t>(it->second->ne.begin(),
                                                       it->second->ne.begin() + it->second->n_dims);
  };
  using V = std::vector<uint64_t>;
  EXPECT_EQ(ne("blk.0.attn_q_b.weight"), (V{1536, 24576}));
  EXPECT_EQ(ne("blk.0.attn_kv_a_mqa.weight"), (V{7168, 576}));
  EXPECT_EQ(ne("blk.0.attn_k_b.weight"), (V{128, 512, 128}));
  EXPECT_EQ(ne("blk.0.attn_v_b.weight"), (V{512, 128, 128}));
  EXPECT_EQ(ne("blk.2.ffn_down.weight"), (V{18432, 7168}));
  EXPECT_EQ(ne("blk.2.ffn_gate_exps.weight"), V{});  // dense
  EXPECT_EQ(ne("blk.3.ffn_gate_exps.weight"), (V{7168, 2048, 256}));
  EXPECT_EQ(ne("blk.3.ffn_gate_shexp.weight"), (V{7168, 2048}));
  // Routed experts, q8_0: 256 x 3 x 7168 x 2048 x 34/32 bytes per layer.
  EXPECT_EQ(by_name["blk.4.ffn_up_exps.weight"]->bytes * 3, 256ull * 3 * 7168 * 2048 / 32 * 34);
}

TEST(ForgeDeepseek3Flags, BadFlagsAreRefusedNamingTheFlag) {
  test::TempDir dir("expertd-forge-ds3-flags");
  const std::string o = " -o " + dir.file("bad.gguf");
  const std::string small =
      "--arch deepseek3 --layers 3 --experts 16 --top-k 4 --embd 256 --ff 256 --heads 4 "
      "--head-dim 96 --q-lora-rank 64 --kv-lora-rank 64 --v-head-dim 64 --dense-ff 256 "
      "--expert-groups 4 --groups-used 2";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {small + " --kv-heads 2" + o, "--kv-heads 2: must be 1 for deepseek3"},
      {small + " --expert-groups 3" + o, "--expert-groups 3: must divide --experts (16)"},
      {small + " --top-k 5 --groups-used 1" + o,
       "--groups-used 1: must be between 1 and --expert-groups (4) and hold --top-k (5)"},
      {small + " --dense-layers 3" + o, "--dense-layers 3: must be below --layers (3)"},
      {small + " --rope-dim 96" + o, "--rope-dim 96: must be even"},
      {small + " --kv-lora-rank 48" + o, "--kv-lora-rank 48: must be a multiple of 32"},
  };
  for (const auto& [args, message] : cases) {
    const auto r = test::run_forge(args);
    EXPECT_NE(r.exit_code, 0) << args;
    EXPECT_NE(r.output.find(message), std::string::npos)
        << args << "\n  printed: " << r.output << "  expected: " << message;
  }
}

}  // namespace
}  // namespace expertd
