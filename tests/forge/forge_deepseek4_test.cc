// `expert-forge --arch deepseek4`: the file carries every key and tensor llama.cpp's deepseek4
// loader requires (names, GGUF types, shapes as its load_arch_hparams / load_arch_tensors ask for
// them), its bytes are the content function's, the hash-routing tables are valid routes, the slice
// map builds and ForgeVerifier checks its expert slices as it does a qwen3moe forge's.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "engine/cpu_engine.h"
#include "engine/model.h"
#include "forge/content.h"
#include "forge/plan.h"
#include "forge/verifier.h"
#include "storage/gguf.h"
#include "storage/slice_map.h"
#include "storage/slot_layout.h"
#include "testing/temp_dir.h"
#include "tests/engine/file_expert_source.h"
#include "tests/forge/dequant.h"
#include "tests/forge/forge_files.h"

namespace expertd {
namespace {

// The small model the file tests forge: every attention kind (0 sliding, 4 CSA, 128 HCA), two
// hash layers and one MTP block.
struct Shape {
  uint64_t layers = 5, nextn = 1, experts = 16, top_k = 4, embd = 256, ff = 256, heads = 4;
  uint64_t head_dim = 128, q_lora = 64, o_groups = 2, o_lora = 64, index_heads = 4;
  uint64_t index_dim = 64, rope = 32, index_topk = 8, window = 16, hash = 2, hc = 4, vocab = 300;
  std::vector<int32_t> ratios = {0, 4, 128, 4, 128, 0};
};

std::string forge_args(const Shape& s, const std::string& out, const std::string& extra = "") {
  std::string ratios;
  for (const int32_t r : s.ratios) ratios += fmt::format("{}{}", ratios.empty() ? "" : ",", r);
  return fmt::format(
      "--arch deepseek4 --layers {} --nextn {} --experts {} --top-k {} --embd {} --ff {} "
      "--heads {} --head-dim {} --q-lora-rank {} --o-groups {} --o-lora-rank {} --index-heads {} "
      "--index-head-dim {} --rope-dim {} --index-topk {} --window {} --hash-layers {} "
      "--compress-ratios {} --vocab {} --seed 99 {} -o {}",
      s.layers, s.nextn, s.experts, s.top_k, s.embd, s.ff, s.heads, s.head_dim, s.q_lora,
      s.o_groups, s.o_lora, s.index_heads, s.index_dim, s.rope, s.index_topk, s.window, s.hash,
      ratios, s.vocab, extra, out);
}

using Want = test::WantTensor;

// What llama.cpp's deepseek4 load_arch_tensors creates (the file's shape for attn_output_a: it
// reshapes that one on load), written out from the loader, not from the forge's plan.
std::vector<Want> llama_cpp_tensors(const Shape& s, GgmlType dense, GgmlType experts) {
  constexpr GgmlType f32 = GgmlType::F32;
  const uint64_t hc_dim = s.hc * s.embd, hc_mix = (2 + s.hc) * s.hc, q = s.heads * s.head_dim;
  std::vector<Want> w = {
      {"token_embd.weight", dense, {s.embd, s.vocab}}, {"output_norm.weight", f32, {s.embd}},
      {"output.weight", dense, {s.embd, s.vocab}},     {"output_hc_fn.weight", f32, {hc_dim, s.hc}},
      {"output_hc_base.weight", f32, {s.hc}},          {"output_hc_scale.weight", f32, {1}}};
  for (uint64_t i = 0; i < s.layers + s.nextn; ++i) {
    auto n = [i](const char* t, const char* suffix = "weight") {
      return fmt::format("blk.{}.{}.{}", i, t, suffix);
    };
    const std::vector<Want> layer = {
        {n("attn_norm"), f32, {s.embd}},
        {n("attn_sinks"), f32, {s.heads}},
        {n("attn_q_a"), dense, {s.embd, s.q_lora}},
        {n("attn_q_a_norm"), f32, {s.q_lora}},
        {n("attn_q_b"), dense, {s.q_lora, q}},
        {n("attn_kv"), dense, {s.embd, s.head_dim}},
        {n("attn_kv_a_norm"), f32, {s.head_dim}},
        {n("attn_output_a"), dense, {q / s.o_groups, s.o_lora * s.o_groups}},
        {n("attn_output_b"), dense, {s.o_groups * s.o_lora, s.embd}},
        {n("hc_attn_fn"), f32, {hc_dim, hc_mix}},
        {n("hc_attn_base"), f32, {hc_mix}},
        {n("hc_attn_scale"), f32, {3}},
        {n("hc_ffn_fn"), f32, {hc_dim, hc_mix}},
        {n("hc_ffn_base"), f32, {hc_mix}},
        {n("hc_ffn_scale"), f32, {3}},
        {n("ffn_norm"), f32, {s.embd}},
        {n("ffn_gate_inp"), f32, {s.embd, s.experts}},
        {n("ffn_gate_exps"), experts, {s.embd, s.ff, s.experts}},
        {n("ffn_down_exps"), experts, {s.ff, s.embd, s.experts}},
        {n("ffn_up_exps"), experts, {s.embd, s.ff, s.experts}},
        {n("ffn_gate_shexp"), dense, {s.embd, s.ff}},
        {n("ffn_down_shexp"), dense, {s.ff, s.embd}},
        {n("ffn_up_shexp"), dense, {s.embd, s.ff}},
    };
    w.insert(w.end(), layer.begin(), layer.end());
    const uint64_t ratio = static_cast<uint64_t>(s.ratios[i]);
    if (ratio != 0) {
      const uint64_t coff = ratio == 4 ? 2 : 1;
      w.push_back({n("attn_compressor_kv"), dense, {s.embd, coff * s.head_dim}});
      w.push_back({n("attn_compressor_gate"), dense, {s.embd, coff * s.head_dim}});
      w.push_back({n("attn_compressor_ape"), f32, {coff * s.head_dim, ratio}});
      w.push_back({n("attn_compressor_norm"), f32, {s.head_dim}});
    }
    if (ratio == 4) {
      w.push_back({n("indexer.proj"), dense, {s.embd, s.index_heads}});
      w.push_back({n("indexer.attn_q_b"), dense, {s.q_lora, s.index_heads * s.index_dim}});
      w.push_back({n("indexer_compressor_kv"), dense, {s.embd, 2 * s.index_dim}});
      w.push_back({n("indexer_compressor_gate"), dense, {s.embd, 2 * s.index_dim}});
      w.push_back({n("indexer_compressor_ape"), f32, {2 * s.index_dim, ratio}});
      w.push_back({n("indexer_compressor_norm"), f32, {s.index_dim}});
    }
    if (i < s.hash) {
      w.push_back({n("ffn_gate_tid2eid"), GgmlType::I32, {s.top_k, s.vocab}});
    } else {
      w.push_back({n("exp_probs_b", "bias"), f32, {s.experts}});
    }
    if (i >= s.layers) {
      w.push_back({n("nextn.eh_proj"), dense, {2 * s.embd, s.embd}});
      w.push_back({n("nextn.enorm"), f32, {s.embd}});
      w.push_back({n("nextn.hnorm"), f32, {s.embd}});
      w.push_back({n("nextn.shared_head_norm"), f32, {s.embd}});
    }
  }
  return w;
}

class ForgeDeepseek4 : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_FALSE(dir_.path().empty()) << "mkdtemp failed"; }
  std::string path(const std::string& name) const { return dir_.file(name); }
  test::TempDir dir_{"expertd-forge-ds4"};
};

TEST_F(ForgeDeepseek4, EveryTensorLlamaCppLoadsWithItsShapeAndBytes) {
  const Shape s;
  const std::string out = path("ds4.gguf");
  const auto r = test::run_forge(forge_args(s, out, "--expert-type q4_k"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("expert-forge: deepseek4 5 layers x 16 experts (top 4)"),
            std::string::npos)
      << r.output;
  auto model = GgufModel::open(out);
  ASSERT_TRUE(model) << model.error().message;
  EXPECT_EQ(model->architecture(), "deepseek4");

  const auto want = llama_cpp_tensors(s, GgmlType::Q8_0, GgmlType::Q4_K);
  test::expect_tensors(*model, want);
  // ffn_exp_probs_b exactly where tid2eid is not: a loader checks both.
  EXPECT_FALSE(model->find_tensor("blk.0.exp_probs_b.bias"));
  EXPECT_FALSE(model->find_tensor("blk.2.ffn_gate_tid2eid.weight"));
  EXPECT_FALSE(model->find_tensor("blk.0.attn_compressor_kv.weight"));  // sliding
  EXPECT_FALSE(model->find_tensor("blk.2.indexer.proj.weight"));        // HCA: no indexer
  EXPECT_FALSE(model->find_tensor("blk.4.nextn.eh_proj.weight"));       // not an MTP block

  // Every byte is the content function's (tid2eid included, with the model's expert count).
  auto info = forge_info(*model);
  ASSERT_TRUE(info) << info.error().message;
  EXPECT_EQ(info->seed, 99u);
  EXPECT_EQ(info->expert_count, 16u);
  EXPECT_EQ(test::validate_forged_model(*model), want.size());
}

TEST_F(ForgeDeepseek4, WritesTheKeysLlamaCppReads) {
  const Shape s;
  const std::string out = path("meta.gguf");
  ASSERT_EQ(test::run_forge(forge_args(s, out)).exit_code, 0);
  auto model = GgufModel::open(out);
  ASSERT_TRUE(model) << model.error().message;
  const GgufFile& m = model->meta();
  using T = GgufValueType;
  // Key, GGUF type and value, as llama.cpp's converter writes them (the layout of its dump).
  const std::map<std::string, std::pair<T, double>> scalars = {
      {"block_count", {T::UINT32, 6}},
      {"context_length", {T::UINT32, 4096}},
      {"embedding_length", {T::UINT32, 256}},
      {"attention.head_count", {T::UINT32, 4}},
      {"attention.head_count_kv", {T::UINT32, 1}},
      {"rope.scaling.factor", {T::FLOAT32, 16}},
      {"rope.scaling.original_context_length", {T::UINT32, 65536}},
      {"rope.scaling.yarn_beta_fast", {T::FLOAT32, 32}},
      {"rope.scaling.yarn_beta_slow", {T::FLOAT32, 1}},
      {"rope.freq_base", {T::FLOAT32, 10000}},
      {"attention.layer_norm_rms_epsilon", {T::FLOAT32, 1e-6f}},
      {"expert_count", {T::UINT32, 16}},
      {"expert_used_count", {T::UINT32, 4}},
      {"expert_gating_func", {T::UINT32, 4}},
      {"attention.key_length", {T::UINT32, 128}},
      {"attention.value_length", {T::UINT32, 128}},
      {"rope.dimension_count", {T::UINT32, 32}},
      {"attention.q_lora_rank", {T::UINT32, 64}},
      {"attention.sliding_window", {T::UINT32, 16}},
      {"expert_feed_forward_length", {T::UINT32, 256}},
      {"expert_shared_count", {T::UINT32, 1}},
      {"expert_weights_scale", {T::FLOAT32, 1.5}},
      {"attention.indexer.head_count", {T::UINT32, 4}},
      {"attention.indexer.key_length", {T::UINT32, 64}},
      {"attention.indexer.top_k", {T::UINT32, 8}},
      {"attention.output_group_count", {T::UINT32, 2}},
      {"attention.output_lora_rank", {T::UINT32, 64}},
      {"attention.compress_rope_freq_base", {T::FLOAT32, 160000}},
      {"hyper_connection.count", {T::UINT32, 4}},
      {"hyper_connection.sinkhorn_iterations", {T::UINT32, 20}},
      {"hyper_connection.epsilon", {T::FLOAT32, 1e-6f}},
      {"hash_layer_count", {T::UINT32, 2}},
      {"embedding_length_out", {T::UINT32, 1024}},
      {"nextn_predict_layers", {T::UINT32, 1}},
  };
  for (const auto& [suffix, tv] : scalars) {
    SCOPED_TRACE(suffix);
    const GgufValue* v = m.find("deepseek4." + suffix);
    ASSERT_NE(v, nullptr) << "missing";
    EXPECT_EQ(v->type, tv.first);
    EXPECT_DOUBLE_EQ(*v->as_f64(), tv.second);
  }
  EXPECT_EQ(*m.find("deepseek4.rope.scaling.type")->as_string(), "yarn");
  EXPECT_EQ(m.find("deepseek4.expert_weights_norm")->type, T::BOOL);
  EXPECT_EQ(*m.find("general.architecture")->as_string(), "deepseek4");
  EXPECT_EQ(*m.find("general.file_type")->as_u64(), 7u);  // q8_0 experts (the default)
  const GgufArray* ratios = m.find("deepseek4.attention.compress_ratios")->as_array();
  ASSERT_NE(ratios, nullptr);
  EXPECT_EQ(ratios->elem_type, T::INT32);
  ASSERT_EQ(ratios->count, s.ratios.size());
  for (uint64_t i = 0; i < ratios->count; ++i) EXPECT_EQ(*ratios->int_at(i), s.ratios[i]);
  for (const char* clamp : {"deepseek4.swiglu_clamp_exp", "deepseek4.swiglu_clamp_shexp"}) {
    const GgufArray* a = m.find(clamp)->as_array();
    ASSERT_NE(a, nullptr) << clamp;
    EXPECT_EQ(a->elem_type, T::FLOAT32);
    ASSERT_EQ(a->count, 6u);  // one per block, MTP included
    EXPECT_EQ(*a->float_at(5), 10.0);
  }
  EXPECT_EQ(*m.find("tokenizer.ggml.model")->as_string(), "gpt2");
  EXPECT_EQ(m.find("tokenizer.ggml.tokens")->as_array()->count, s.vocab);
}

TEST_F(ForgeDeepseek4, HashTablesRouteEveryTokenToDistinctExperts) {
  const Shape s;
  const std::string out = path("hash.gguf");
  ASSERT_EQ(test::run_forge(forge_args(s, out)).exit_code, 0);
  auto model = GgufModel::open(out);
  ASSERT_TRUE(model) << model.error().message;
  std::vector<std::vector<int32_t>> tables;
  for (uint64_t l = 0; l < s.hash; ++l) {
    SCOPED_TRACE(l);
    const auto ref = model->find_tensor(fmt::format("blk.{}.ffn_gate_tid2eid.weight", l));
    ASSERT_TRUE(ref);
    ASSERT_EQ(ref->info->bytes, s.top_k * s.vocab * 4);
    const auto bytes = test::pread_bytes(out, ref->info->offset, ref->info->bytes);
    std::vector<int32_t> t(s.top_k * s.vocab);
    std::memcpy(t.data(), bytes.data(), bytes.size());
    std::vector<uint64_t> uses(s.experts);
    for (uint64_t tok = 0; tok < s.vocab; ++tok) {
      std::set<int32_t> row;
      for (uint64_t j = 0; j < s.top_k; ++j) {
        const int32_t e = t[tok * s.top_k + j];
        ASSERT_GE(e, 0) << "token " << tok;
        ASSERT_LT(e, static_cast<int32_t>(s.experts)) << "token " << tok;
        row.insert(e);
        ++uses[static_cast<size_t>(e)];
      }
      EXPECT_EQ(row.size(), s.top_k) << "token " << tok << ": an expert repeats";
    }
    // Spread over all experts: 1200 picks of 16, each expert near 75.
    for (uint64_t e = 0; e < s.experts; ++e) {
      EXPECT_GT(uses[e], 40u) << "expert " << e;
      EXPECT_LT(uses[e], 120u) << "expert " << e;
    }
    tables.push_back(std::move(t));
  }
  EXPECT_NE(tables[0], tables[1]);  // each hash layer has its own table

  // The content function refuses a table without the expert count, or too small a count.
  const GgufTensorInfo& t0 = *model->find_tensor("blk.0.ffn_gate_tid2eid.weight")->info;
  std::vector<uint8_t> buf(64);
  auto st = forge_expected_bytes(99, t0, 0, buf);
  ASSERT_FALSE(st);
  EXPECT_NE(st.error().message.find("needs the model's expert count"), std::string::npos);
  EXPECT_FALSE(forge_expected_bytes(99, t0, 0, buf, 3));  // 3 experts cannot give 4 distinct
}

TEST_F(ForgeDeepseek4, VerifierChecksExpertSlicesAndCatchesACorruptByte) {
  const Shape s;
  const std::string out = path("verify.gguf");
  ASSERT_EQ(test::run_forge(forge_args(s, out, "--expert-type q4_k --alignment 4096")).exit_code,
            0);
  auto model = GgufModel::open(out);
  ASSERT_TRUE(model) << model.error().message;
  auto map = SliceMap::build(*model);
  ASSERT_TRUE(map) << map.error().message;
  EXPECT_EQ(map->block_count(), 6u);
  EXPECT_EQ(map->layers().size(), 6u);  // the MTP block has routed experts too
  EXPECT_EQ(map->expert_count(), 16u);
  EXPECT_EQ(map->top_k(), 4u);
  const SlotLayouts layouts(*map, 4096, 4096);
  auto verifier = ForgeVerifier::create(*model, *map, layouts);
  ASSERT_TRUE(verifier) << verifier.error().message;

  // Fill a slot as the daemon would (each slice where place() puts it) and hand it over.
  std::vector<uint8_t> slot(layouts.slot_bytes());
  auto fill = [&](uint32_t layer, uint32_t expert) {
    std::array<ExpertSlice, 3> slices{};
    std::array<SlicePlacement, 3> place{};
    const uint32_t n = layouts.place(layer, expert, slices, place);
    EXPECT_EQ(n, 3u);
    for (uint32_t i = 0; i < n; ++i) {
      const auto bytes = test::pread_bytes(out, slices[i].offset, slices[i].bytes);
      std::memcpy(slot.data() + place[i].data_slot_offset, bytes.data(), bytes.size());
    }
    return place;
  };
  uint64_t loads = 0;
  for (uint32_t layer = 0; layer < 6; ++layer) {
    for (const uint32_t expert : {0u, 7u, 15u}) {
      fill(layer, expert);
      (*verifier)->loaded(ExpertKey{layer, expert}, 0, slot.data(), 1000);
      ++loads;
    }
  }
  EXPECT_EQ((*verifier)->verified(), loads);
  EXPECT_EQ((*verifier)->failures(), 0u)
      << ((*verifier)->messages().empty() ? "" : (*verifier)->messages().front());

  // One flipped byte in layer 3 expert 9's down slice is caught and named.
  const auto place = fill(3, 9);
  slot[place[2].data_slot_offset + 100] ^= 0x40;
  (*verifier)->loaded(ExpertKey{3, 9}, 5, slot.data(), 1000);
  EXPECT_EQ((*verifier)->failures(), 1u);
  ASSERT_EQ((*verifier)->messages().size(), 1u);
  EXPECT_NE((*verifier)->messages()[0].find("layer 3 expert 9 down (slot 5): first wrong byte at "
                                            "slice offset 100"),
            std::string::npos)
      << (*verifier)->messages()[0];
}

// The engine's deepseek4 loader takes the forge (its checks: every key, tensor, shape and tid2eid
// entry), and the CPU forward stays numerically sane over a sequence longer than the window and
// several compression blocks: finite logits of moderate size that change with the token, and a
// router that spreads tokens over the experts.
TEST_F(ForgeDeepseek4, TheEngineLoadsItAndTheForwardStaysSane) {
  const Shape s;
  const std::string out = path("engine.gguf");
  ASSERT_EQ(test::run_forge(forge_args(s, out, "--expert-type q4_k")).exit_code, 0);
  auto model = engine::DenseModel::load(out);
  ASSERT_TRUE(model) << model.error().message;
  ASSERT_TRUE(model->params().is_ds4());
  EXPECT_EQ(model->params().n_expert, s.experts);
  auto source = engine::test::FileExpertSource::open(*model);
  ASSERT_TRUE(source) << source.error().message;
  auto eng = engine::create_cpu_engine(*model, **source, engine::EngineOptions{64, 0, 0});
  ASSERT_TRUE(eng) << eng.error().message;
  // > window 16, > 8 CSA blocks of 4
  const auto routing = test::expect_sane_forward(**eng, static_cast<uint32_t>(s.vocab), 40);
  EXPECT_EQ(routing.size(), 40u * (s.layers));
  const std::set<uint32_t> used = test::experts_used(routing);
  EXPECT_GE(used.size(), s.experts * 3 / 4);
}

// The defaults are DeepseekV4Config's, and the layer schedule is transformers' default.
TEST(ForgeDeepseek4Plan, DefaultsAreDeepseekV4Config) {
  ForgeConfig c = forge_defaults(ForgeArch::Deepseek4);
  EXPECT_EQ(c.experts, 256u);
  EXPECT_EQ(c.top_k, 6u);
  EXPECT_EQ(c.embd, 4096u);
  EXPECT_EQ(c.ff, 2048u);
  EXPECT_EQ(c.heads, 64u);
  EXPECT_EQ(c.kv_heads, 1u);
  EXPECT_EQ(c.head_dim, 512u);
  EXPECT_EQ(c.hash_layers, 3u);
  EXPECT_EQ(c.dense_type, GgmlType::Q8_0);
  // transformers: ["HCA"] * 2 + ["CSA" if i % 2 else "HCA" for i in range(n - 2)].
  const std::vector<int32_t> r = deepseek4_default_compress_ratios(43, 1);
  ASSERT_EQ(r.size(), 44u);
  EXPECT_EQ(r[0], 128);
  EXPECT_EQ(r[1], 128);
  for (uint32_t i = 2; i < 43; ++i) EXPECT_EQ(r[i], (i - 2) % 2 == 1 ? 4 : 128) << i;
  EXPECT_EQ(r[43], 0);  // the MTP block: sliding window only

  c.layers = 4;
  c.vocab = 1024;
  c.expert_type = GgmlType::Q4_K;
  c.output = "/nonexistent/ds4.gguf";
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
  EXPECT_EQ(ne("blk.0.attn_q_b.weight"), (V{1024, 32768}));
  EXPECT_EQ(ne("blk.0.attn_output_a.weight"), (V{4096, 8192}));
  EXPECT_EQ(ne("blk.0.attn_output_b.weight"), (V{8192, 4096}));
  EXPECT_EQ(ne("blk.0.attn_compressor_kv.weight"), (V{4096, 512}));  // HCA
  EXPECT_EQ(ne("blk.0.attn_compressor_ape.weight"), (V{512, 128}));
  EXPECT_EQ(ne("blk.3.attn_compressor_kv.weight"), (V{4096, 1024}));  // CSA
  EXPECT_EQ(ne("blk.3.attn_compressor_ape.weight"), (V{1024, 4}));
  EXPECT_EQ(ne("blk.3.indexer.attn_q_b.weight"), (V{1024, 8192}));
  EXPECT_EQ(ne("blk.3.indexer.proj.weight"), (V{4096, 64}));
  EXPECT_EQ(ne("blk.0.hc_attn_fn.weight"), (V{16384, 24}));
  EXPECT_EQ(ne("blk.2.ffn_gate_tid2eid.weight"), (V{6, 1024}));
  EXPECT_EQ(ne("blk.3.exp_probs_b.bias"), (V{256}));
  EXPECT_EQ(ne("output_hc_fn.weight"), (V{16384, 4}));
  // Routed experts, q4_k: 256 x 3 x 4096 x 2048 x 144/256 bytes per layer.
  const uint64_t per_layer = 256ull * 3 * 4096 * 2048 / 256 * 144;
  EXPECT_EQ(per_layer, 3623878656u);
  EXPECT_EQ(by_name["blk.1.ffn_up_exps.weight"]->bytes * 3, per_layer);
}

// As transformers' config does, a model of fewer than 3 layers hash-routes all of them, unless
// --hash-layers says otherwise; the default schedule is used without --compress-ratios.
TEST(ForgeDeepseek4Flags, HashLayersDefaultToAtMostTheLayers) {
  test::TempDir dir("expertd-forge-ds4-hash");
  const std::string small =
      "--arch deepseek4 --experts 8 --embd 256 --ff 256 --heads 4 --head-dim 128 --q-lora-rank 64 "
      "--o-lora-rank 64 --index-heads 4 --index-head-dim 64 --rope-dim 32 --vocab 300";
  for (const auto& [args, hash] : std::vector<std::pair<std::string, uint64_t>>{
           {"--layers 2", 2}, {"--layers 5", 3}, {"--layers 5 --hash-layers 0", 0}}) {
    SCOPED_TRACE(args);
    const std::string out = dir.file("h.gguf");
    const auto r = test::run_forge(small + " " + args + " --force -o " + out);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    auto model = GgufModel::open(out);
    ASSERT_TRUE(model) << model.error().message;
    EXPECT_EQ(model->meta().find("deepseek4.hash_layer_count")->as_u64(), hash);
    EXPECT_EQ(model->find_tensor(fmt::format("blk.{}.ffn_gate_tid2eid.weight", hash)),
              std::nullopt);
    if (hash > 0) {
      EXPECT_TRUE(model->find_tensor(fmt::format("blk.{}.ffn_gate_tid2eid.weight", hash - 1)));
    }
    const GgufArray* ratios = model->meta().find("deepseek4.attention.compress_ratios")->as_array();
    ASSERT_NE(ratios, nullptr);
    EXPECT_EQ(*ratios->int_at(0), 128);
    EXPECT_EQ(*ratios->int_at(1), 128);
  }
}

TEST(ForgeDeepseek4Flags, BadFlagsAreRefusedNamingTheFlag) {
  test::TempDir dir("expertd-forge-ds4-flags");
  const std::string o = " -o " + dir.file("bad.gguf");
  const std::string small = "--arch deepseek4 --layers 3 --experts 8 --embd 256 --ff 256";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--arch llama3" + o,
       "--arch llama3: must be qwen3moe, deepseek4, mixtral, deepseek3, gpt-oss or glm4moe"},
      {small + " --kv-heads 2" + o, "--kv-heads 2: must be 1 for deepseek4"},
      {small + " --compress-ratios 0,4" + o, "--compress-ratios: 2 values for 3 blocks"},
      {small + " --compress-ratios 0,4,64" + o, "'64' is not 0, 4 or 128"},
      {small + " --hash-layers 4" + o, "--hash-layers 4: must be between 0 and 3"},
      {small + " --o-groups 3" + o, "--o-groups 3: must divide --heads x --head-dim"},
      {small + " --rope-dim 33" + o, "--rope-dim 33: must be even"},
      {small + " --q-lora-rank 48" + o, "--q-lora-rank 48: must be a multiple of 32"},
      {"--compress-ratios 0" + o, "--compress-ratios: only with --arch deepseek4"},
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
