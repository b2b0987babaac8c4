// Runs the real expert-forge binary and checks what it wrote through the GGUF reader: every
// tensor byte equals forge_expected_bytes, the qwen3moe metadata is there, split models open
// whole, and bad flags or existing outputs are refused with a message naming the flag or file.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "base/half.h"
#include "forge/content.h"
#include "storage/gguf.h"
#include "testing/paths.h"
#include "testing/process.h"
#include "testing/temp_dir.h"
#include "tests/forge/dequant.h"
#include "tests/forge/forge_files.h"

namespace expertd {
namespace {

namespace fs = std::filesystem;
using test::read_all;
using test::run_forge;

class ForgeTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_FALSE(dir_.path().empty()) << "mkdtemp failed"; }
  std::string path(const std::string& name) const { return dir_.file(name); }

  static uint64_t ValidateModel(const GgufModel& model) {
    return test::validate_forged_model(model);
  }

  test::TempDir dir_{"expertd-forge"};
};

constexpr const char* kSmall =
    "--layers 2 --experts 4 --top-k 2 --embd 256 --ff 256 --heads 4 --kv-heads 2 --head-dim 64 "
    "--vocab 300";

struct TypeCase {
  const char* expert;
  const char* dense;
  int alignment;
};

void PrintTo(const TypeCase& c, std::ostream* os) {
  *os << "experts " << c.expert << ", dense " << c.dense << ", alignment " << c.alignment;
}

class ForgeTypes : public ForgeTest, public ::testing::WithParamInterface<TypeCase> {};

TEST_P(ForgeTypes, EveryTensorHoldsTheExpectedBytes) {
  const TypeCase c = GetParam();
  const std::string out = path(std::string("m_") + c.expert + ".gguf");
  const auto r =
      run_forge(fmt::format("{} --expert-type {} --dense-type {} --alignment {} "
                            "--seed 1234 -o {}",
                            kSmall, c.expert, c.dense, c.alignment, out));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("expert-forge: wrote " + out), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("GB/s"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(out + ".tmp"));

  auto model = GgufModel::open(out);
  ASSERT_TRUE(model) << model.error().message;
  EXPECT_EQ(model->architecture(), "qwen3moe");
  EXPECT_EQ(model->tensor_count(), 3u + 2 * 12);
  EXPECT_EQ(model->meta().alignment(), static_cast<uint64_t>(c.alignment));
  auto info = forge_info(*model);
  ASSERT_TRUE(info) << info.error().message;
  EXPECT_EQ(info->seed, 1234u);
  EXPECT_EQ(ValidateModel(*model), 27u);

  const auto expert_type = ggml_type_from_name(c.expert);
  const auto dense_type = ggml_type_from_name(c.dense);
  const GgufTensorInfo* up = model->find_tensor("blk.1.ffn_up_exps.weight")->info;
  EXPECT_EQ(up->type, *expert_type);
  EXPECT_EQ(up->n_dims, 3u);
  EXPECT_EQ(up->ne[0], 256u);
  EXPECT_EQ(up->ne[1], 256u);
  EXPECT_EQ(up->ne[2], 4u);
  const GgufTensorInfo* down = model->find_tensor("blk.0.ffn_down_exps.weight")->info;
  EXPECT_EQ(down->ne[0], 256u);  // ff
  EXPECT_EQ(down->ne[1], 256u);  // embd
  EXPECT_EQ(model->find_tensor("blk.0.attn_q.weight")->info->type, *dense_type);
  EXPECT_EQ(model->find_tensor("blk.0.ffn_gate_inp.weight")->info->type, GgmlType::F32);
  EXPECT_EQ(model->find_tensor("blk.0.attn_k_norm.weight")->info->type, GgmlType::F32);
  EXPECT_EQ(model->find_tensor("blk.0.attn_k_norm.weight")->info->ne[0], 64u);

  // Dequantised, an expert is zero-mean noise of about the fan-in amplitude.
  std::vector<uint8_t> bytes(up->bytes);
  ASSERT_TRUE(forge_expected_bytes(info->seed, *up, 0, bytes));
  std::vector<float> v;
  ASSERT_TRUE(test::dequantize(up->type, bytes, v));
  const double a = std::sqrt(3.0 / 256);
  const auto s = test::stats(v);
  EXPECT_LT(std::fabs(s.mean), 0.05 * a);
  EXPECT_LE(s.max_abs, 1.3 * a);
  EXPECT_GT(s.stddev, 0.4 * a / std::sqrt(3.0));
}

INSTANTIATE_TEST_SUITE_P(Types, ForgeTypes,
                         ::testing::Values(TypeCase{"f32", "f16", 32}, TypeCase{"f16", "bf16", 64},
                                           TypeCase{"bf16", "q8_0", 32},
                                           TypeCase{"q8_0", "f16", 32},
                                           TypeCase{"q4_k", "q6_k", 4096},
                                           TypeCase{"q6_k", "q4_k", 32}, TypeCase{"q4_0", "f32", 1},
                                           TypeCase{"mxfp4", "q8_0", 32}),
                         [](const auto& p) { return std::string(p.param.expert); });

TEST_F(ForgeTest, WritesQwen3MoeMetadata) {
  const std::string out = path("meta.gguf");
  const auto r = run_forge(fmt::format("{} --name tiny --context 2048 -o {}", kSmall, out));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto model = GgufModel::open(out);
  ASSERT_TRUE(model) << model.error().message;
  const GgufFile& m = model->meta();
  auto u = [&](const char* key) { return m.find(key) ? m.find(key)->as_u64() : std::nullopt; };
  auto str = [&](const char* key) {
    return m.find(key) && m.find(key)->as_string() ? *m.find(key)->as_string() : "";
  };
  EXPECT_EQ(str("general.architecture"), "qwen3moe");
  EXPECT_EQ(str("general.name"), "tiny");
  EXPECT_EQ(m.find("general.alignment"), nullptr);  // the default 32 is not written
  EXPECT_EQ(u("qwen3moe.block_count"), 2u);
  EXPECT_EQ(u("qwen3moe.context_length"), 2048u);
  EXPECT_EQ(u("qwen3moe.embedding_length"), 256u);
  EXPECT_EQ(u("qwen3moe.expert_feed_forward_length"), 256u);
  EXPECT_EQ(u("qwen3moe.feed_forward_length"), 256u);
  EXPECT_EQ(u("qwen3moe.attention.head_count"), 4u);
  EXPECT_EQ(u("qwen3moe.attention.head_count_kv"), 2u);
  EXPECT_EQ(u("qwen3moe.attention.key_length"), 64u);
  EXPECT_EQ(u("qwen3moe.attention.value_length"), 64u);
  EXPECT_EQ(u("qwen3moe.expert_count"), 4u);
  EXPECT_EQ(u("qwen3moe.expert_used_count"), 2u);
  EXPECT_FLOAT_EQ(*m.find("qwen3moe.attention.layer_norm_rms_epsilon")->as_f64(), 1e-6f);
  EXPECT_EQ(m.find("qwen3moe.attention.layer_norm_rms_epsilon")->type, GgufValueType::FLOAT32);
  EXPECT_EQ(*m.find("qwen3moe.rope.freq_base")->as_f64(), 1e6);
  EXPECT_EQ(str("tokenizer.ggml.model"), "gpt2");
  EXPECT_EQ(str("tokenizer.ggml.pre"), "qwen2");
  const GgufArray* tokens = m.find("tokenizer.ggml.tokens")->as_array();
  ASSERT_NE(tokens, nullptr);
  EXPECT_EQ(tokens->count, 300u);
  EXPECT_EQ(tokens->string_at(0), "!");
  const GgufArray* types = m.find("tokenizer.ggml.token_type")->as_array();
  ASSERT_NE(types, nullptr);
  EXPECT_EQ(types->elem_type, GgufValueType::INT32);
  EXPECT_EQ(types->count, 300u);
  EXPECT_EQ(m.find("tokenizer.ggml.merges")->as_array()->count, 300u - 258);
  const auto bos = u("tokenizer.ggml.bos_token_id");
  const auto eos = u("tokenizer.ggml.eos_token_id");
  ASSERT_TRUE(bos && eos);
  EXPECT_EQ(tokens->string_at(*bos), "<|endoftext|>");
  EXPECT_EQ(tokens->string_at(*eos), "<|im_end|>");
  EXPECT_EQ(types->int_at(*eos), 3);
  EXPECT_EQ(m.find(kForgeSeedKey)->type, GgufValueType::UINT64);
  EXPECT_EQ(m.find(kForgeVersionKey)->type, GgufValueType::UINT32);
  // Tensor order: token_embd first, output last.
  EXPECT_EQ(m.tensors().front().name, "token_embd.weight");
  EXPECT_EQ(m.tensors().back().name, "output.weight");
}

TEST_F(ForgeTest, SameSeedSameFileOtherSeedOtherBytes) {
  const std::string a = path("a.gguf"), b = path("b.gguf"), c = path("c.gguf");
  ASSERT_EQ(run_forge(fmt::format("{} --seed 5 -o {}", kSmall, a)).exit_code, 0);
  ASSERT_EQ(run_forge(fmt::format("{} --seed 5 --threads 1 -o {}", kSmall, b)).exit_code, 0);
  ASSERT_EQ(run_forge(fmt::format("{} --seed 6 -o {}", kSmall, c)).exit_code, 0);
  const auto ba = read_all(a);
  EXPECT_EQ(ba, read_all(b));
  const auto bc = read_all(c);
  ASSERT_EQ(ba.size(), bc.size());
  EXPECT_NE(ba, bc);
}

TEST_F(ForgeTest, SplitModelOpensWithAllTensors) {
  const std::string base = path("split.gguf");
  const auto r =
      run_forge(fmt::format("{} --layers 5 --split 3 --expert-type q4_k -o {}", kSmall, base));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_FALSE(fs::exists(base));
  const std::string first = path("split-00001-of-00003.gguf");
  ASSERT_TRUE(fs::exists(first));
  ASSERT_TRUE(fs::exists(path("split-00002-of-00003.gguf")));
  ASSERT_TRUE(fs::exists(path("split-00003-of-00003.gguf")));

  auto model = GgufModel::open(first);
  ASSERT_TRUE(model) << model.error().message;
  ASSERT_EQ(model->shards().size(), 3u);
  EXPECT_EQ(model->tensor_count(), 3u + 5 * 12);
  for (uint32_t i = 0; i < 3; ++i) {
    const GgufFile& s = model->shards()[i];
    EXPECT_EQ(s.find("split.no")->as_u64(), i);
    EXPECT_EQ(s.find("split.no")->type, GgufValueType::UINT16);
    EXPECT_EQ(s.find("split.count")->as_u64(), 3u);
    EXPECT_EQ(s.find("split.count")->type, GgufValueType::UINT16);
    EXPECT_EQ(s.find("split.tensors.count")->as_u64(), 63u);
    EXPECT_EQ(s.find("split.tensors.count")->type, GgufValueType::INT32);
    EXPECT_FALSE(s.tensors().empty());
  }
  EXPECT_EQ(model->find_tensor("token_embd.weight")->shard, 0u);
  EXPECT_EQ(model->find_tensor("blk.0.ffn_up_exps.weight")->shard, 0u);
  EXPECT_EQ(model->find_tensor("blk.4.ffn_up_exps.weight")->shard, 2u);
  EXPECT_EQ(model->find_tensor("output.weight")->shard, 2u);
  EXPECT_EQ(model->shards()[1].find("general.architecture"), nullptr);  // metadata: shard 1
  EXPECT_EQ(ValidateModel(*model), 63u);
}

TEST_F(ForgeTest, RefusesToOverwriteWithoutForce) {
  const std::string out = path("keep.gguf");
  ASSERT_EQ(run_forge(fmt::format("{} --seed 1 -o {}", kSmall, out)).exit_code, 0);
  const auto before = read_all(out);
  auto r = run_forge(fmt::format("{} --seed 2 -o {}", kSmall, out));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find(out + " exists; pass --force to overwrite it"), std::string::npos)
      << r.output;
  EXPECT_EQ(read_all(out), before);
  EXPECT_FALSE(fs::exists(out + ".tmp"));

  r = run_forge(fmt::format("{} --seed 2 --force -o {}", kSmall, out));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(read_all(out), before);

  // Any existing shard stops a split model, named; nothing else is written.
  const std::string second = path("s-00002-of-00002.gguf");
  { std::ofstream(second) << "not a model"; }
  r = run_forge(fmt::format("{} --split 2 -o {}", kSmall, path("s.gguf")));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find(second + " exists"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(path("s-00001-of-00002.gguf")));
  r = run_forge(fmt::format("{} --split 2 --force -o {}", kSmall, path("s.gguf")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(GgufModel::open(path("s-00001-of-00002.gguf")));
}

TEST_F(ForgeTest, BadFlagsAreRefusedNamingTheFlag) {
  struct Case {
    std::string args;
    std::string message;
  };
  const std::string o = " -o " + path("bad.gguf");
  const std::vector<Case> cases = {
      {"--top-k 9 --experts 8" + o, "--top-k 9: must be between 1 and --experts (8)"},
      {"--top-k 0" + o, "--top-k 0"},
      {"--heads 6 --kv-heads 4" + o, "--heads 6: must be a multiple of --kv-heads (4)"},
      {"--embd 100" + o, "--embd 100: must be a multiple of 32, the q8_0 block size"},
      {"--ff 300 --expert-type q4_k" + o, "--ff 300: must be a multiple of 256, the q4_k block"},
      {"--embd 288 --dense-type q6_k" + o, "--embd 288: must be a multiple of 256"},
      {"--heads 4 --head-dim 36 --kv-heads 2 --dense-type q8_0" + o,
       "--heads 4 x --head-dim 36 = 144"},
      {"--alignment 48" + o, "--alignment 48: must be a power of two"},
      {"--alignment 0" + o, "--alignment 0"},
      {"--expert-type q5_k" + o, "--expert-type q5_k: must be one of"},
      {"--dense-type fp8" + o, "--dense-type fp8: must be one of"},
      {"--split 5 --layers 4" + o, "--split 5: must be between 1 and --layers (4)"},
      {"--vocab 100" + o, "--vocab 100: must be between 258"},
      {"--head-dim 31" + o, "--head-dim 31: must be even"},
      {"--layers 0" + o, "--layers 0: must be between 1 and 4096"},
      {"--experts 0" + o, "--experts 0"},
      {"--threads 0" + o, "--threads 0"},
      {"--layers abc" + o, "--layers"},
      {"--bogus 1" + o, "--bogus"},
      {"--layers 2", "--output"},  // -o is required
  };
  for (const Case& c : cases) {
    const auto r = run_forge(c.args);
    EXPECT_NE(r.exit_code, 0) << c.args;
    EXPECT_NE(r.output.find(c.message), std::string::npos)
        << c.args << "\n  printed: " << r.output << "  expected: " << c.message;
  }
  EXPECT_FALSE(fs::exists(path("bad.gguf")));
  EXPECT_FALSE(fs::exists(path("bad.gguf.tmp")));
}

TEST_F(ForgeTest, HelpListsTheFlags) {
  const auto r = run_forge("--help");
  EXPECT_EQ(r.exit_code, 0);
  for (const char* flag : {"--layers",
                           "--experts",
                           "--top-k",
                           "--embd",
                           "--ff",
                           "--heads",
                           "--kv-heads",
                           "--head-dim",
                           "--vocab",
                           "--expert-type",
                           "--dense-type",
                           "--alignment",
                           "--split",
                           "--seed",
                           "--force",
                           "--name",
                           "-o",
                           "--arch",
                           "--compress-ratios",
                           "--nextn",
                           "--hash-layers",
                           "--hc-mult",
                           "--q-lora-rank",
                           "--o-groups",
                           "--o-lora-rank",
                           "--index-heads",
                           "--index-head-dim",
                           "--index-topk",
                           "--window",
                           "--rope-dim",
                           "--shared-experts"}) {
    EXPECT_NE(r.output.find(flag), std::string::npos) << flag;
  }
}

}  // namespace
}  // namespace expertd
