// engine/family.h's registry against the engines (issue 24): one row per family, each fixture's
// architecture maps to its row, and each capability the row claims is what the CPU engine does
// (batched prefill, prefix truncate, hash hints, MTP blocks skipped). The CUDA capabilities are
// checked in gpu_engine_test.cc on a device.
#include "engine/family.h"

#include <gtest/gtest.h>

#include <cctype>
#include <set>
#include <string>
#include <vector>

#include "engine/cpu_engine.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "testing/temp_dir.h"
#include "tests/engine/batch_check.h"
#include "tests/engine/file_expert_source.h"
#include "tests/engine/fixture.h"
#include "tests/engine/gguf_edit.h"

namespace expertd::engine {
namespace {

// One committed fixture of every family.
struct FamilyFixture {
  Family family;
  const char* dir;
};
const FamilyFixture kFixtures[] = {
    {Family::Qwen3Moe, "qwen3moe-tiny"},   {Family::Mixtral, "mixtral-tiny"},
    {Family::GptOss, "gptoss-tiny"},       {Family::Glm4Moe, "glm4moe-tiny"},
    {Family::DeepSeek3, "deepseek3-tiny"}, {Family::DeepSeek4, "deepseek4-tiny"},
};

std::string gguf_of(const FamilyFixture& f) {
  return test::fixture_path(std::string(f.dir) + "/model-f32.gguf");
}

TEST(Family, EveryFamilyHasOneRowAndEveryArchitectureOneFamily) {
  std::set<Family> seen_families;
  std::set<std::string> seen_arches;
  for (const FamilyInfo& f : families()) {
    EXPECT_TRUE(seen_families.insert(f.family).second) << f.arch;
    EXPECT_TRUE(seen_arches.insert(std::string(f.arch)).second) << f.arch;
    EXPECT_EQ(find_family(f.arch), &f);
    EXPECT_EQ(&family_info(f.family), &f);
    EXPECT_FALSE(f.name.empty()) << f.arch;
    EXPECT_FALSE(f.models.empty()) << f.arch;
    EXPECT_NE(family_list().find(std::string(f.arch)), std::string::npos) << f.arch;
  }
  EXPECT_EQ(seen_families.size(), std::size(kFixtures));  // a fixture per family, below
  EXPECT_EQ(find_family("bogus"), nullptr);
  EXPECT_EQ(family_list(),
            "qwen3moe (Qwen3-MoE), llama (Mixtral), gpt-oss, glm4moe (GLM-4.5), deepseek2 "
            "(DeepSeek-V3), deepseek4 (DeepSeek-V4)");
  EXPECT_EQ(family_list([](const FamilyInfo& f) { return f.caps.hash_hints; }),
            "deepseek4 (DeepSeek-V4)");
}

TEST(Family, AnArchitectureWithoutAFamilyIsRefusedListingTheFamilies) {
  expertd::test::TempDir dir;
  test::Edit e;
  e.arch_to = "falcon";  // general.architecture and every qwen3moe.* key
  const std::string path = dir.path() + "/m.gguf";
  EXPECT_EQ(test::load_error(test::rewrite(gguf_of(kFixtures[0]), path, e)),
            path + ": architecture 'falcon': the engine runs " + family_list());
}

class FamilyCaps : public ::testing::TestWithParam<FamilyFixture> {};

// Each fixture's architecture is its family's row, and the CPU engine does what the row says.
TEST_P(FamilyCaps, TheCpuEngineDoesWhatTheRowSays) {
  const FamilyFixture& fx = GetParam();
  auto model = DenseModel::load(gguf_of(fx));
  ASSERT_TRUE(model) << model.error().message;
  const ModelParams& p = model->params();
  ASSERT_EQ(p.family, fx.family) << p.architecture;
  const FamilyInfo& info = family_info(p.family);
  EXPECT_EQ(info.arch, p.architecture);
  auto source = test::FileExpertSource::open(*model);
  ASSERT_TRUE(source) << source.error().message;
  EngineOptions o{16, 1, 0};
  o.prefill_chunk = 4;
  auto engine = create_cpu_engine(*model, **source, o);
  ASSERT_TRUE(engine) << engine.error().message;
  Engine& eng = **engine;
  std::vector<float> logits(p.n_vocab);
  const std::vector<uint32_t> prompt = {1, 2, 3, 4};
  ASSERT_TRUE(eng.prefill(prompt, logits));
  // Batched prefill acquires each routed expert once per chunk and counts them; the default
  // decodes token by token and counts none.
  EXPECT_EQ(eng.stats().prefill_experts > 0, info.caps.cpu_batched_prefill)
      << info.arch << ": prefill_experts " << eng.stats().prefill_experts;
  // A prefix cut in the middle.
  ASSERT_EQ(eng.position(), 4u);
  EXPECT_EQ(eng.truncate(2), info.caps.prefix_truncate) << info.arch;
  // Hash hints: sent for a hash-routed family's hash layers as soon as a token is known.
  ASSERT_TRUE(eng.decode(5, logits));
  EXPECT_EQ(eng.stats().hash_hints > 0, info.caps.hash_hints)
      << info.arch << ": hash_hints " << eng.stats().hash_hints;
  // Several sequences in one engine: created exactly where the row says batched decode.
  EngineOptions two = o;
  two.sequences = 2;
  auto batched = create_cpu_engine(*model, **source, two);
  EXPECT_EQ(static_cast<bool>(batched), info.caps.cpu_batched_decode)
      << info.arch << ": " << (batched ? "created" : batched.error().message);
  if (!batched) {
    EXPECT_NE(batched.error().message.find("2 sequences at once"), std::string::npos)
        << batched.error().message;
  }
}

// decode_batch() on the CPU engine: four sequences with different prompts, decoded together,
// give each sequence's logits exactly as that sequence decoded alone, step after step (rows
// join and leave), and acquire fewer experts than the rows would one by one
// (tests/engine/batch_check.h; the CUDA engine's twin is in gpu_engine_test.cc).
TEST_P(FamilyCaps, ABatchedStepIsEachSequenceAloneToTheBit) {
  const FamilyFixture& fx = GetParam();
  if (!family_info(fx.family).caps.cpu_batched_decode) GTEST_SKIP() << "no batched decode";
  test::expect_batch_is_each_alone(
      gguf_of(fx), DenseLoad::Eager,
      [](const DenseModel& m, ExpertSource& s, const EngineOptions& o) {
        return create_cpu_engine(m, s, o);
      },
      true);
}

// A family with MTP blocks skips them: a file whose last block is declared a next-n block (the
// key, and its eh_proj tensor) loads with one main layer fewer. A family without them does not
// read the key, so the last block stays a main layer and its renamed tensor is missing.
TEST_P(FamilyCaps, MtpBlocksAreSkippedExactlyWhereTheRowSays) {
  const FamilyFixture& fx = GetParam();
  auto original = DenseModel::load(gguf_of(fx));
  ASSERT_TRUE(original) << original.error().message;
  const ModelParams& p0 = original->params();
  const FamilyInfo& info = family_info(p0.family);
  const uint32_t last = p0.n_layer - 1;
  auto file = GgufFile::open(gguf_of(fx));
  ASSERT_TRUE(file) << file.error().message;
  const std::string norm = "blk." + std::to_string(last) + ".attn_norm.weight";
  const GgufTensorInfo* t = nullptr;
  for (const GgufTensorInfo& ti : file->tensors()) {
    if (ti.name == norm) t = &ti;
  }
  ASSERT_NE(t, nullptr) << info.arch << ": no " << norm;
  expertd::test::TempDir dir;
  test::Edit e;
  // One next-n block more than the file has (GLM-4.5's and DeepSeek-V4's fixtures have one).
  const std::string key = std::string(info.arch) + ".nextn_predict_layers";
  const uint32_t nextn = p0.nextn_layers + 1;
  e.key = key;
  e.set_key = [key, nextn](GgufWriter& w) { w.set_u32(key, nextn); };
  e.reshape_tensor = norm;
  e.new_ne.assign(t->ne.begin(), t->ne.begin() + t->n_dims);
  e.rename_to = "blk." + std::to_string(last) + ".nextn.eh_proj.weight";
  const std::string path = test::rewrite(gguf_of(fx), dir.path() + "/m.gguf", e);
  auto model = DenseModel::load(path);
  if (info.caps.mtp_blocks) {
    ASSERT_TRUE(model) << info.arch << ": " << model.error().message;
    EXPECT_EQ(model->params().nextn_layers, nextn);
    EXPECT_EQ(model->params().n_layer, p0.n_layer - 1);
  } else {
    ASSERT_FALSE(model) << info.arch << ": loaded with " << model->params().n_layer << " layers";
    EXPECT_NE(model.error().message.find(norm), std::string::npos) << model.error().message;
  }
}

INSTANTIATE_TEST_SUITE_P(Registry, FamilyCaps, ::testing::ValuesIn(kFixtures),
                         [](const ::testing::TestParamInfo<FamilyFixture>& i) {
                           std::string name(family_info(i.param.family).name);
                           std::string out;
                           for (const char c : name) {
                             if (std::isalnum(static_cast<unsigned char>(c))) out += c;
                           }
                           return out;
                         });

}  // namespace
}  // namespace expertd::engine
