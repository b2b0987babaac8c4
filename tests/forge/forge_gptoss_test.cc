// `expert-forge --arch gpt-oss`: a llama.cpp `gpt-oss` file as the converter writes it (MXFP4 or
// any other expert type, biases on projections, router and experts, attention sinks, the sliding
// window and YaRN keys), which the slice map, expertctl and the engine take, at any size; the
// defaults are gpt-oss-120b's. A file whose MXFP4 expert rows are not whole blocks is refused.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>
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

std::string small_gptoss(const std::string& out, const std::string& extra = "") {
  return fmt::format(
      "--arch gpt-oss --layers 4 --experts 8 --top-k 2 --embd 128 --ff 64 --heads 4 --kv-heads 2 "
      "--head-dim 32 --window 8 --vocab {} --seed 5 --expert-type mxfp4 {} -o {}",
      kVocab, extra, out);
}

TEST(ForgeGptOss, WritesTheKeysAndTensorsOfTheConvertersGptOss) {
  test::TempDir dir{"expertd-forge-gptoss"};
  const std::string out = dir.file("g.gguf");
  const auto r = test::run_forge(small_gptoss(out));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto model = GgufModel::open(out);
  ASSERT_TRUE(model) << model.error().message;
  EXPECT_EQ(model->architecture(), "gpt-oss");
  for (const char* name :
       {"blk.3.attn_sinks.weight", "blk.3.post_attention_norm.weight", "blk.3.ffn_gate_inp.bias",
        "blk.3.ffn_down_exps.bias", "blk.0.attn_q.bias"}) {
    EXPECT_TRUE(model->find_tensor(name)) << name;
  }
  const auto gate = model->find_tensor("blk.2.ffn_gate_exps.weight");
  ASSERT_TRUE(gate);
  EXPECT_EQ(gate->info->type, GgmlType::MXFP4);

  // The experts' weights are the slices; their biases are dense (they are not streamed).
  auto map = SliceMap::build(*model);
  ASSERT_TRUE(map) << map.error().message;
  EXPECT_EQ(map->expert_count(), 8u);
  EXPECT_EQ(map->top_k(), 2u);
  EXPECT_EQ(map->layers().size(), 4u);
  EXPECT_EQ(map->layers()[0].slice_count, 3u);

  const auto inspect = test::run_command({test::bin_path("expertctl"), "inspect", out});
  ASSERT_EQ(inspect.status, 0) << inspect.err;
  EXPECT_NE(inspect.out.find("architecture   gpt-oss"), std::string::npos) << inspect.out;
  EXPECT_NE(inspect.out.find("gate mxfp4 [128x64]"), std::string::npos) << inspect.out;
}

// The engine's loader takes the forge as gpt-oss and the CPU forward stays sane: finite logits of
// moderate size that change with the token, the router spreading tokens over the experts.
TEST(ForgeGptOss, TheEngineRunsIt) {
  test::TempDir dir{"expertd-forge-gptoss"};
  const std::string out = dir.file("g.gguf");
  ASSERT_EQ(test::run_forge(small_gptoss(out)).exit_code, 0);
  auto model = engine::DenseModel::load(out);
  ASSERT_TRUE(model) << model.error().message;
  EXPECT_EQ(model->params().family, engine::Family::GptOss);
  EXPECT_EQ(model->params().swa_window, 8u);
  EXPECT_DOUBLE_EQ(model->params().yarn.factor, 32.0);
  auto source = engine::test::FileExpertSource::open(*model);
  ASSERT_TRUE(source) << source.error().message;
  auto eng = engine::create_cpu_engine(*model, **source, engine::EngineOptions{32, 0, 0});
  ASSERT_TRUE(eng) << eng.error().message;
  const auto routing = test::expect_sane_forward(**eng, kVocab, 16);
  EXPECT_EQ(routing.size(), 16u * 4);
  EXPECT_GE(test::experts_used(routing).size(), 6u);
}

TEST(ForgeGptOss, DefaultsAreGptOss120b) {
  ForgeConfig c = forge_defaults(ForgeArch::GptOss);
  EXPECT_EQ(c.experts, 128u);
  EXPECT_EQ(c.top_k, 4u);
  EXPECT_EQ(c.embd, 2880u);
  EXPECT_EQ(c.ff, 2880u);
  EXPECT_EQ(c.heads, 64u);
  EXPECT_EQ(c.kv_heads, 8u);
  EXPECT_EQ(c.head_dim, 64u);
  c.layers = 36;
  c.vocab = 32000;  // gpt-oss has 201088; the experts do not depend on it
  c.expert_type = GgmlType::MXFP4;
  c.output = "/nonexistent/gpt-oss.gguf";
  ASSERT_TRUE(validate_forge_config(c));
  auto shards = plan_forge_model(c);
  ASSERT_TRUE(shards) << shards.error().message;
  uint64_t expert_bytes = 0;
  for (const auto& t : (*shards)[0].writer.tensors()) {
    if (t.name.ends_with("_exps.weight")) expert_bytes += t.bytes;
  }
  EXPECT_EQ(expert_bytes, 36ull * 128 * 3 * 2880 * 2880 / 32 * 17);  // 60.9 GB of MXFP4 experts
  EXPECT_EQ(parse_forge_arch("gpt-oss").value(), ForgeArch::GptOss);
  EXPECT_EQ(forge_gguf_arch(ForgeArch::GptOss), "gpt-oss");
}

TEST(ForgeGptOss, AnEmbdThatIsNotWholeMxfp4BlocksIsRefused) {
  const auto r = test::run_forge(small_gptoss("/nonexistent/g.gguf", "--embd 144"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--embd 144: must be a multiple of 32, the mxfp4 block size"),
            std::string::npos)
      << r.output;
}

// A file whose MXFP4 expert rows are not whole 32-element blocks (ne0 patched from 128 to 112):
// refused at open, naming the tensor.
TEST(ForgeGptOss, AFileWithAPartialMxfp4BlockIsRefusedNamingTheTensor) {
  test::TempDir dir{"expertd-forge-gptoss"};
  const std::string out = dir.file("g.gguf");
  ASSERT_EQ(test::run_forge(small_gptoss(out)).exit_code, 0);
  std::vector<char> bytes;
  {
    std::ifstream in(out, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  // The tensor info: name, n_dims (u32), ne[0] (u64).
  const std::string name = "blk.1.ffn_up_exps.weight";
  const auto it = std::search(bytes.begin(), bytes.end(), name.begin(), name.end());
  ASSERT_NE(it, bytes.end());
  const size_t ne0_at = static_cast<size_t>(it - bytes.begin()) + name.size() + 4;
  uint64_t ne0 = 0;
  std::memcpy(&ne0, bytes.data() + ne0_at, sizeof ne0);
  ASSERT_EQ(ne0, 128u);
  ne0 = 112;
  std::memcpy(bytes.data() + ne0_at, &ne0, sizeof ne0);
  const std::string bad = dir.file("bad.gguf");
  {
    std::ofstream o(bad, std::ios::binary);
    o.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  auto model = GgufModel::open(bad);
  ASSERT_FALSE(model);
  EXPECT_NE(model.error().message.find(name), std::string::npos) << model.error().message;
  EXPECT_NE(model.error().message.find("112"), std::string::npos) << model.error().message;
  EXPECT_EQ(model.error().message.find('\n'), std::string::npos) << model.error().message;
}

}  // namespace
}  // namespace expertd
