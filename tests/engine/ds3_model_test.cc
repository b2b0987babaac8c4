// The deepseek2 loader on malformed copies of the deepseek3-tiny fixture: each fails with one line
// naming the file and the key or tensor, and what DeepSeek-V3 needs of it.
#include <gtest/gtest.h>

#include <string>

#include "storage/gguf_writer.h"
#include "testing/temp_dir.h"
#include "tests/engine/fixture.h"
#include "tests/engine/gguf_edit.h"

namespace expertd::engine {
namespace {

using test::Edit;
using test::load_error;
using test::rewrite;

std::string fixture() { return test::fixture_path("deepseek3-tiny/model-q8_0.gguf"); }

// Rewrites the fixture with `edit` and returns the loader's error.
std::string error_of(const Edit& edit) {
  expertd::test::TempDir dir;
  return load_error(rewrite(fixture(), dir.path() + "/m.gguf", edit));
}

Edit set_u32(const std::string& key, uint32_t value) {
  Edit e;
  e.key = key;
  e.set_key = [key, value](GgufWriter& w) { w.set_u32(key, value); };
  return e;
}

TEST(Ds3Malformed, TheUnchangedCopyLoads) { EXPECT_EQ(error_of(Edit{}), "(loaded)"); }

TEST(Ds3Malformed, AMissingGroupCountNamesTheKey) {
  Edit e;
  e.key = "deepseek2.expert_group_count";
  e.set_key = [](GgufWriter&) {};  // dropped
  const std::string msg = error_of(e);
  EXPECT_NE(msg.find("m.gguf: deepseek2.expert_group_count is missing; DeepSeek-V3 routing needs "
                     "it"),
            std::string::npos)
      << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

TEST(Ds3Malformed, AGroupCountThatDoesNotDivideTheExpertsNamesBoth) {
  const std::string msg = error_of(set_u32("deepseek2.expert_group_count", 3));
  EXPECT_NE(msg.find("deepseek2.expert_group_count = 3 does not divide expert_count 16"),
            std::string::npos)
      << msg;
}

TEST(Ds3Malformed, GroupsTooFewForTheTopKNameTheKey) {
  // 16 experts in 8 groups of 2: one group cannot hold the top-4.
  expertd::test::TempDir dir;
  const std::string groups =
      rewrite(fixture(), dir.path() + "/g.gguf", set_u32("deepseek2.expert_group_count", 8));
  const std::string msg = load_error(
      rewrite(groups, dir.path() + "/u.gguf", set_u32("deepseek2.expert_group_used_count", 1)));
  EXPECT_NE(msg.find("deepseek2.expert_group_used_count = 1: 1 groups of 2 experts cannot hold "
                     "the top-4"),
            std::string::npos)
      << msg;
}

// The GGUF parser catches it at the first expert tensor, before any weight is read.
TEST(Ds3Malformed, AnExpertCountThatDisagreesWithTheTensorsNamesBoth) {
  const std::string msg = error_of(set_u32("deepseek2.expert_count", 8));
  EXPECT_NE(msg.find("tensor_info 'blk.1.ffn_down_exps.weight'.ne[2]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("expert dimension 16 disagrees with deepseek2.expert_count = 8"),
            std::string::npos)
      << msg;
}

TEST(Ds3Malformed, AMissingAbsorbedKeyProjectionNamesTheTensor) {
  Edit e;
  e.drop_tensor = "blk.2.attn_k_b.weight";
  const std::string msg = error_of(e);
  EXPECT_NE(msg.find("tensor blk.2.attn_k_b.weight is missing"), std::string::npos) << msg;
  Edit r;
  r.reshape_tensor = "blk.0.attn_v_b.weight";
  r.new_ne = {32, 16, 2};
  const std::string msg2 = error_of(r);
  EXPECT_NE(msg2.find("tensor blk.0.attn_v_b.weight: shape [32, 16, 2, 1], expected [32, 16, 4]"),
            std::string::npos)
      << msg2;
}

// Files converted before llama.cpp split kv_b for MLA hold attn_kv_b instead: say so.
TEST(Ds3Malformed, AnOldJointKvBSaysToConvertAgain) {
  Edit e;
  e.reshape_tensor = "blk.0.attn_k_b.weight";
  e.new_ne = {16, 32, 4};  // unchanged
  e.rename_to = "blk.0.attn_kv_b.weight";
  const std::string msg = error_of(e);
  EXPECT_NE(msg.find("m.gguf: tensor blk.0.attn_k_b.weight is missing: the file has "
                     "blk.0.attn_kv_b.weight (converted before llama.cpp split it for MLA); "
                     "convert the model again"),
            std::string::npos)
      << msg;
}

TEST(Ds3Malformed, SeveralKvHeadsAreRefused) {
  const std::string msg = error_of(set_u32("deepseek2.attention.head_count_kv", 2));
  EXPECT_NE(msg.find("deepseek2.attention.head_count_kv = 2: deepseek2 files hold MLA as one "
                     "latent KV head (1)"),
            std::string::npos)
      << msg;
}

}  // namespace
}  // namespace expertd::engine
