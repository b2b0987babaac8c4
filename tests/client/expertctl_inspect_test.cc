// `expertctl inspect` on forged models, offline: a deepseek4 model shows its V4 structure (hash
// layers, each layer's attention and compress ratio, hyper-connections, the indexer, LoRA ranks,
// shared experts, MTP layers) in text and as the first --json line; qwen3moe output has none of it.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "testing/expertd_fixture.h"

namespace expertd {
namespace {

using json = nlohmann::json;

test::RunResult inspect(std::vector<std::string> args) {
  args.insert(args.begin(), {test::bin_path("expertctl"), "inspect"});
  return test::run_command(args);
}

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

bool has_line(const std::string& text, const std::string& line) {
  for (const auto& l : lines(text)) {
    if (l == line) return true;
  }
  return false;
}

// Five main layers (sliding, CSA, HCA, CSA, HCA), two of them hash-routed, and one MTP block.
constexpr const char* kDs4 =
    "--arch deepseek4 --layers 5 --nextn 1 --experts 8 --top-k 2 --embd 256 --ff 256 --heads 4 "
    "--head-dim 128 --q-lora-rank 64 --o-groups 2 --o-lora-rank 96 --index-heads 4 "
    "--index-head-dim 64 --rope-dim 32 --index-topk 16 --window 32 --hash-layers 2 --hc-mult 3 "
    "--compress-ratios 0,4,128,4,128,0 --vocab 300";

TEST(ExpertctlInspect, Deepseek4StructureInText) {
  test::TempDir dir;
  const std::string model = test::forge(dir.path(), "ds4", kDs4);
  const test::RunResult r = inspect({model});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(has_line(r.out, "architecture   deepseek4")) << r.out;
  EXPECT_TRUE(has_line(r.out, "layers         6 (6 with routed experts)")) << r.out;
  EXPECT_TRUE(has_line(r.out, "deepseek4")) << r.out;
  EXPECT_TRUE(has_line(r.out,
                       "  attention    4 heads x 128 (1 KV head), rope 32, q LoRA 64, output 2 "
                       "groups x LoRA 96, window 32"))
      << r.out;
  EXPECT_TRUE(has_line(r.out, "  indexer      4 heads x 64, top-k 16 (CSA layers)")) << r.out;
  EXPECT_TRUE(has_line(r.out, "  hyper-conn.  3 streams, 20 Sinkhorn iterations, eps 1e-06"))
      << r.out;
  EXPECT_TRUE(has_line(r.out, "  shared exp.  1 (ff 256)")) << r.out;
  EXPECT_TRUE(has_line(r.out, "  hash layers  2: 0-1")) << r.out;
  EXPECT_TRUE(has_line(r.out, "  MTP layers   1: 5")) << r.out;
  EXPECT_TRUE(has_line(r.out, "  attn types   sliding 2, CSA (ratio 4) 2, HCA (ratio 128) 2"))
      << r.out;
  EXPECT_TRUE(has_line(r.out, "  layers       0:SWA# 1:CSA# 2:HCA 3:CSA 4:HCA 5:SWA+")) << r.out;
}

// DeepSeek-V3: the dense first layer has no routed experts; the shared expert is not streamed.
TEST(ExpertctlInspect, Deepseek3StructureInText) {
  test::TempDir dir;
  const std::string model = test::forge(
      dir.path(), "ds3",
      "--arch deepseek3 --layers 3 --dense-layers 1 --experts 16 --top-k 4 --embd 256 --ff 256 "
      "--heads 4 --head-dim 96 --rope-dim 32 --q-lora-rank 64 --kv-lora-rank 64 --v-head-dim 64 "
      "--dense-ff 512 --expert-groups 4 --groups-used 2 --vocab 300");
  const test::RunResult r = inspect({model});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(has_line(r.out, "architecture   deepseek2")) << r.out;
  EXPECT_TRUE(has_line(r.out, "layers         3 (2 with routed experts)")) << r.out;
  EXPECT_TRUE(has_line(r.out, "experts        16 per layer, top-k 4")) << r.out;
  EXPECT_TRUE(has_line(r.out,
                       "  attention    4 heads, MLA: q LoRA 64, kv LoRA 64 (+ rope 32 cached per "
                       "position), qk 64 + rope 32, v 64"))
      << r.out;
  EXPECT_TRUE(has_line(r.out, "  dense layers 1: 0 (ff 512)")) << r.out;
  EXPECT_TRUE(has_line(r.out,
                       "  routing      sigmoid, 16 experts in 4 groups, top-4 from 2 groups, "
                       "scale 2.5, renormalised"))
      << r.out;
  EXPECT_TRUE(has_line(r.out, "  shared exp.  1 (ff 256, dense weights)")) << r.out;
}

TEST(ExpertctlInspect, Deepseek4StructureFirstInJson) {
  test::TempDir dir;
  const std::string model = test::forge(dir.path(), "ds4", kDs4);
  const test::RunResult r = inspect({"--json", model});
  ASSERT_EQ(r.status, 0) << r.err;
  const auto out = lines(r.out);
  ASSERT_EQ(out.size(), 1u + 6 * 8 * 3);  // the structure, then gate/up/down of every expert
  const json j = json::parse(out[0], nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out[0];
  ASSERT_TRUE(j.contains("deepseek4")) << out[0];
  const json& d = j["deepseek4"];
  EXPECT_EQ(d["blocks"], 6);
  EXPECT_EQ(d["main_layers"], 5);
  EXPECT_EQ(d["heads"], 4);
  EXPECT_EQ(d["kv_heads"], 1);
  EXPECT_EQ(d["head_dim"], 128);
  EXPECT_EQ(d["rope_dim"], 32);
  EXPECT_EQ(d["q_lora_rank"], 64);
  EXPECT_EQ(d["o_groups"], 2);
  EXPECT_EQ(d["o_lora_rank"], 96);
  EXPECT_EQ(d["sliding_window"], 32);
  EXPECT_EQ(d["indexer"], json::parse(R"({"heads":4,"head_dim":64,"top_k":16})"));
  EXPECT_EQ(d["hc_mult"], 3);
  EXPECT_EQ(d["hc_sinkhorn_iterations"], 20);
  EXPECT_NEAR(d["hc_epsilon"].get<double>(), 1e-6, 1e-12);
  EXPECT_EQ(d["shared_experts"], 1);
  EXPECT_EQ(d["hash_layer_count"], 2);
  EXPECT_EQ(d["hash_layers"], json::parse("[0, 1]"));
  EXPECT_EQ(d["mtp_layers"], json::parse("[5]"));
  ASSERT_EQ(d["layers"].size(), 6u);
  EXPECT_EQ(d["layers"][0], json::parse(R"({"layer":0,"attention":"sliding","compress_ratio":0,
                                            "routing":"hash","mtp":false})"));
  EXPECT_EQ(d["layers"][1], json::parse(R"({"layer":1,"attention":"csa","compress_ratio":4,
                                            "routing":"hash","mtp":false})"));
  EXPECT_EQ(d["layers"][2], json::parse(R"({"layer":2,"attention":"hca","compress_ratio":128,
                                            "routing":"score","mtp":false})"));
  EXPECT_EQ(d["layers"][5], json::parse(R"({"layer":5,"attention":"sliding","compress_ratio":0,
                                            "routing":"score","mtp":true})"));
  const json slice = json::parse(out[1], nullptr, false);
  EXPECT_EQ(slice["layer"], 0);
  EXPECT_EQ(slice["kind"], "gate");
}

TEST(ExpertctlInspect, Qwen3MoeOutputHasNoDeepseek4Section) {
  test::TempDir dir;
  const std::string model = test::forge(dir.path(), "q", "--layers 2 --experts 4 --vocab 300");
  const test::RunResult text = inspect({model});
  ASSERT_EQ(text.status, 0) << text.err;
  EXPECT_EQ(text.out.find("deepseek4"), std::string::npos) << text.out;
  EXPECT_EQ(text.out.find("hash layers"), std::string::npos) << text.out;
  const test::RunResult js = inspect({"--json", model});
  ASSERT_EQ(js.status, 0) << js.err;
  const auto out = lines(js.out);
  ASSERT_EQ(out.size(), 2u * 4 * 3);  // slices only
  EXPECT_EQ(json::parse(out[0])["layer"], 0);
}

}  // namespace
}  // namespace expertd
