// libexpertd-client against the real expertd binary: connect and its errors, sessions acquiring
// every expert from several threads with every byte checked against expert-forge's content
// function, the sealed arena, hostile ring entries, a client killed while holding slots, the
// daemon killed under a client, and a refused peer.
#include "expertd/client.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "storage/gguf.h"
#include "tests/client/expertd_fixture.h"
#include "tools/forge/content.h"

namespace expertd::client {
namespace {

using test::Daemon;
using test::TempDir;

constexpr const char* kSmallModel = "--layers 4 --experts 8 --embd 256 --ff 512 --seed 7";

// Recomputes the bytes a SlotView must show from the forged model file.
class Expected {
 public:
  explicit Expected(const std::string& path) {
    auto m = GgufModel::open(path);
    EXPECT_TRUE(m) << m.error().message;
    model_ = std::move(*m);
    auto info = forge_info(model_);
    EXPECT_TRUE(info) << info.error().message;
    seed_ = info->seed;
  }

  ::testing::AssertionResult check(const SlotView& v) const {
    if (v.slice_count == 0) return ::testing::AssertionFailure() << "no slices";
    for (uint32_t i = 0; i < v.slice_count; ++i) {
      const SliceView& s = v.slices[i];
      const std::string name = fmt::format("blk.{}.ffn_{}_exps.weight", v.layer, s.info->kind);
      const auto ref = model_.find_tensor(name);
      if (!ref) return ::testing::AssertionFailure() << "no tensor " << name;
      const uint64_t in_tensor = s.info->offset - ref->info->offset + v.expert * s.info->stride;
      std::vector<uint8_t> want(s.bytes);
      const auto st = forge_expected_bytes(seed_, *ref->info, in_tensor, want);
      if (!st) return ::testing::AssertionFailure() << st.error().message;
      if (std::memcmp(want.data(), s.data, s.bytes) != 0) {
        return ::testing::AssertionFailure()
               << "layer " << v.layer << " expert " << v.expert << " slice " << s.info->kind
               << ": bytes differ from the forged content";
      }
    }
    return ::testing::AssertionSuccess();
  }

 private:
  GgufModel model_;
  uint64_t seed_ = 0;
};

std::vector<uint32_t> iota(uint32_t n) {
  std::vector<uint32_t> v(n);
  std::iota(v.begin(), v.end(), 0u);
  return v;
}

// One daemon serving one small forged model ("m") on a temporary socket.
class ClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = test::forge(dir_.path(), "m", kSmallModel);
    daemon_ = std::make_unique<Daemon>(dir_.path(), daemon_args());
    ASSERT_TRUE(daemon_->start());
  }
  void TearDown() override {
    if (daemon_->pid() > 0) {
      const std::string log = daemon_->log();
      EXPECT_EQ(daemon_->stop(), 0) << log;
    }
  }
  virtual std::vector<std::string> daemon_args() {
    return {"--model",   "m=" + model_, "--socket", dir_.path() + "/run/expertd.sock",
            "--cache",   "64MiB",       "--verify", "--no-mlock"};
  }
  std::unique_ptr<Client> connect() {
    auto c = Client::connect(daemon_->socket());
    EXPECT_TRUE(c) << c.error().message;
    return c ? std::move(*c) : nullptr;
  }

  TempDir dir_;
  std::string model_;
  std::unique_ptr<Daemon> daemon_;
};

TEST(ClientConnect, NoDaemonSaysSo) {
  TempDir dir;
  auto c = Client::connect(dir.path() + "/nothing.sock");
  ASSERT_FALSE(c);
  EXPECT_EQ(c.error().message, "cannot connect to expertd at " + dir.path() +
                                   "/nothing.sock: No such file or directory (is expertd "
                                   "running?)");
}

TEST_F(ClientTest, InfoAndModels) {
  auto c = connect();
  ASSERT_TRUE(c);
  auto info = c->info();
  ASSERT_TRUE(info) << info.error().message;
  EXPECT_EQ(info->protocol_version, abi::kProtocolVersion);
  EXPECT_EQ(info->models, std::vector<std::string>{"m"});
  EXPECT_FALSE(info->backend.empty());
  EXPECT_FALSE(info->version.empty());

  auto layout = c->open_model("m");
  ASSERT_TRUE(layout) << layout.error().message;
  EXPECT_EQ(layout->block_count, 4u);
  EXPECT_EQ(layout->expert_count, 8u);
  EXPECT_EQ(layout->slices.size(), 4u * 3u);

  auto missing = c->open_model("nope");
  ASSERT_FALSE(missing);
  EXPECT_EQ(missing.error().message, "model 'nope' is not served by this daemon (models: m)");
  auto attach_missing = c->attach("nope", "test");
  ASSERT_FALSE(attach_missing);
  EXPECT_EQ(attach_missing.error().message,
            "model 'nope' is not served by this daemon (models: m)");
  EXPECT_TRUE(c->ping());
}

TEST_F(ClientTest, AcquireEveryExpertVerified) {
  auto c = connect();
  ASSERT_TRUE(c);
  auto s = c->attach("m", "verify");
  ASSERT_TRUE(s) << s.error().message;
  Expected expected(model_);
  const auto experts = iota(8);
  for (int round = 0; round < 2; ++round) {  // misses, then hits
    for (uint32_t layer = 0; layer < 4; ++layer) {
      auto views = (*s)->acquire(layer, experts);
      ASSERT_TRUE(views) << views.error().message;
      ASSERT_EQ(views->size(), 8u);
      for (uint32_t i = 0; i < 8; ++i) {
        EXPECT_EQ((*views)[i].layer, layer);
        EXPECT_EQ((*views)[i].expert, i);
        EXPECT_TRUE(expected.check((*views)[i]));
      }
      EXPECT_EQ((*s)->holds(), 8u);
      ASSERT_TRUE((*s)->release(*views));
      EXPECT_EQ((*s)->holds(), 0u);
    }
  }
  auto st = (*s)->stats();
  ASSERT_TRUE(st) << st.error().message;
  EXPECT_EQ(st->acquires, 64u);
  EXPECT_EQ(st->client, "verify");
  EXPECT_EQ(st->pid, ::getpid());
}

}  // namespace
}  // namespace expertd::client
