// Models by name only: the real expertd passes a model's GGUF files as read-only fds over its
// socket (Client::model_files), the engine loads the dense weights through them
// (DenseModel::load_from_daemon), and expert-run needs no --gguf. Served: the committed qwen3moe
// and deepseek4 fixtures and a forged model split into more shards than one reply carries fds.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <nlohmann/json.hpp>

#include "engine/cpu_engine.h"
#include "engine/daemon_expert_source.h"
#include "expertd/client.h"
#include "testing/expertd_fixture.h"
#include "tests/engine/fixture.h"

namespace expertd::engine {
namespace {

using expertd::test::Daemon;
using expertd::test::TempDir;

constexpr uint32_t kSplitShards = 10;  // more than the 8 fds one reply carries

std::string qwen_gguf() { return test::fixture_path("qwen3moe-tiny/model-f32.gguf"); }
std::string ds4_gguf() { return test::fixture_path("deepseek4-tiny/model-q8_0.gguf"); }

std::string joined(const std::vector<uint32_t>& v) {
  std::string s;
  for (const uint32_t x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
  return s;
}

uint64_t file_bytes(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return static_cast<uint64_t>(st.st_size);
}

class ModelFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    split_prefix_ = dir_.path() + "/split";
    expertd::test::forge(dir_.path(), "split",
                         "--layers 10 --experts 4 --top-k 2 --embd 128 --ff 128 --heads 2 "
                         "--kv-heads 1 --head-dim 64 --vocab 300 --expert-type q8_0 "
                         "--dense-type q8_0 --seed 9 --split " +
                             std::to_string(kSplitShards));
    socket_ = dir_.path() + "/expertd.sock";
    daemon_ = std::make_unique<Daemon>(
        dir_.path(),
        std::vector<std::string>{"--model", "qwen=" + qwen_gguf(), "--model", "v4=" + ds4_gguf(),
                                 "--model", "split=" + split_path(1), "--socket", socket_,
                                 "--cache", "16MiB", "--no-mlock"});
    ASSERT_TRUE(daemon_->start());
  }
  void TearDown() override {
    const std::string log = daemon_->log();
    EXPECT_EQ(daemon_->stop(), 0) << log;
  }

  std::string split_path(uint32_t no) const {
    return fmt::format("{}-{:05d}-of-{:05d}.gguf", split_prefix_, no, kSplitShards);
  }

  std::unique_ptr<client::Client> connect() {
    auto c = client::Client::connect(socket_);
    EXPECT_TRUE(c) << c.error().message;
    return c ? std::move(*c) : nullptr;
  }

  // The logits of `tokens` with the dense weights of `model` and the experts from expertd.
  std::vector<std::vector<float>> logits(const DenseModel& model, const std::string& name,
                                         const std::vector<uint32_t>& tokens) {
    auto source = DaemonExpertSource::connect(socket_, name, model, "model_files_test");
    EXPECT_TRUE(source) << source.error().message;
    if (!source) return {};
    auto engine = create_cpu_engine(model, **source,
                                    EngineOptions{static_cast<uint32_t>(tokens.size()), 1, 0});
    EXPECT_TRUE(engine) << engine.error().message;
    if (!engine) return {};
    std::vector<std::vector<float>> out;
    for (const uint32_t t : tokens) {
      out.emplace_back(model.params().n_vocab);
      const Status st = (*engine)->decode(t, out.back());
      EXPECT_TRUE(st) << st.error().message;
    }
    return out;
  }

  TempDir dir_;
  std::string split_prefix_;
  std::string socket_;
  std::unique_ptr<Daemon> daemon_;
};

TEST_F(ModelFilesTest, TheDaemonPassesReadOnlyFdsOfTheFileItServes) {
  auto c = connect();
  ASSERT_TRUE(c);
  auto files = c->model_files("qwen");
  ASSERT_TRUE(files) << files.error().message;
  ASSERT_EQ(files->size(), 1u);
  const client::ModelFile& f = files->front();
  EXPECT_EQ(f.shard, 0u);
  EXPECT_EQ(f.name, "model-f32.gguf");
  EXPECT_EQ(f.path, qwen_gguf());
  EXPECT_EQ(f.bytes, file_bytes(qwen_gguf()));
  ASSERT_TRUE(f.fd.valid());

  const int flags = ::fcntl(f.fd.get(), F_GETFL);
  ASSERT_GE(flags, 0);
  EXPECT_EQ(flags & O_ACCMODE, O_RDONLY);
  EXPECT_EQ(flags & O_DIRECT, 0) << "the engine preads dense weights at any offset";
  EXPECT_NE(::fcntl(f.fd.get(), F_GETFD) & FD_CLOEXEC, 0);
  errno = 0;
  EXPECT_EQ(::write(f.fd.get(), "x", 1), -1);
  EXPECT_EQ(errno, EBADF);
  EXPECT_EQ(::pwrite(f.fd.get(), "x", 1, 0), -1);
  EXPECT_EQ(errno, EBADF);

  // The very file: same device and inode, same first bytes.
  struct stat by_fd {};
  struct stat by_path {};
  ASSERT_EQ(::fstat(f.fd.get(), &by_fd), 0);
  ASSERT_EQ(::stat(qwen_gguf().c_str(), &by_path), 0);
  EXPECT_EQ(by_fd.st_dev, by_path.st_dev);
  EXPECT_EQ(by_fd.st_ino, by_path.st_ino);
  char magic[4] = {};
  ASSERT_EQ(::pread(f.fd.get(), magic, sizeof(magic), 0), 4);
  EXPECT_EQ(std::string(magic, 4), "GGUF");
}

TEST_F(ModelFilesTest, ALoadThroughTheFdsGivesTheLogitsOfALoadByPath) {
  const nlohmann::json ds4 = test::read_json(test::fixture_path("deepseek4-tiny/fixture.json"));
  const std::vector<uint32_t> ds4_tokens = ds4.at("tokens").get<std::vector<uint32_t>>();
  const std::vector<uint32_t> qwen_tokens = test::TinyFixture::load().tokens;
  for (const auto& [name, path, tokens] :
       {std::tuple{std::string("qwen"), qwen_gguf(), qwen_tokens},
        std::tuple{std::string("v4"), ds4_gguf(), ds4_tokens}}) {
    SCOPED_TRACE(name);
    auto c = connect();
    ASSERT_TRUE(c);
    auto by_name = DenseModel::load_from_daemon(*c, name);
    ASSERT_TRUE(by_name) << by_name.error().message;
    auto by_path = DenseModel::load(path);
    ASSERT_TRUE(by_path) << by_path.error().message;
    const std::string file = path.substr(path.find_last_of('/') + 1);
    EXPECT_EQ(by_name->path(), "expertd:" + name + "/" + file);
    EXPECT_EQ(by_name->params().architecture, by_path->params().architecture);
    EXPECT_EQ(by_name->dense_bytes(), by_path->dense_bytes());
    EXPECT_EQ(by_name->gguf().sources().size(), 1u);
    const auto a = logits(*by_name, name, tokens);
    const auto b = logits(*by_path, name, tokens);
    ASSERT_EQ(a.size(), tokens.size());
    ASSERT_EQ(b.size(), tokens.size());
    for (size_t t = 0; t < tokens.size(); ++t) EXPECT_EQ(a[t], b[t]) << "position " << t;
  }
}

TEST_F(ModelFilesTest, ASplitModelArrivesAsEveryShardInOrder) {
  auto c = connect();
  ASSERT_TRUE(c);
  auto files = c->model_files("split");
  ASSERT_TRUE(files) << files.error().message;
  ASSERT_EQ(files->size(), kSplitShards);
  for (uint32_t i = 0; i < kSplitShards; ++i) {
    const client::ModelFile& f = (*files)[i];
    const std::string path = split_path(i + 1);
    EXPECT_EQ(f.shard, i);
    EXPECT_EQ(f.path, path);
    EXPECT_EQ(f.name, path.substr(path.find_last_of('/') + 1));
    EXPECT_EQ(f.bytes, file_bytes(path));
    struct stat by_fd {};
    struct stat by_path {};
    ASSERT_EQ(::fstat(f.fd.get(), &by_fd), 0);
    ASSERT_EQ(::stat(path.c_str(), &by_path), 0);
    EXPECT_EQ(by_fd.st_ino, by_path.st_ino) << "shard " << i;
    EXPECT_EQ(::fcntl(f.fd.get(), F_GETFL) & O_ACCMODE, O_RDONLY);
  }

  auto by_name = DenseModel::load_from_daemon(*c, "split");
  ASSERT_TRUE(by_name) << by_name.error().message;
  ASSERT_EQ(by_name->gguf().shards().size(), kSplitShards);
  auto by_path = DenseModel::load(split_path(1));
  ASSERT_TRUE(by_path) << by_path.error().message;
  const std::vector<uint32_t> tokens{1, 17, 255, 299};
  EXPECT_EQ(logits(*by_name, "split", tokens), logits(*by_path, "split", tokens));
}

TEST_F(ModelFilesTest, AnUnknownModelIsAClearError) {
  const std::string expected =
      "model 'nope' is not served by this daemon (models: qwen, v4, split)";
  auto c = connect();
  ASSERT_TRUE(c);
  auto files = c->model_files("nope");
  ASSERT_FALSE(files);
  EXPECT_EQ(files.error().message, expected);
  auto model = DenseModel::load_from_daemon(*c, "nope");
  ASSERT_FALSE(model);
  EXPECT_EQ(model.error().message, expected);
  // The connection still serves.
  EXPECT_TRUE(c->model_files("qwen"));

  const auto r =
      expertd::test::run_command({expertd::test::bin_path("expert-run"), "--socket", socket_,
                                  "--model", "nope", "--prompt-tokens", "1", "--cpu"});
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.err, "expert-run: " + expected + "\n");
}

TEST_F(ModelFilesTest, ExpertRunWithoutGgufGeneratesWhatItDoesWithIt) {
  for (const auto& [name, path] :
       {std::pair{std::string("qwen"), qwen_gguf()}, std::pair{std::string("v4"), ds4_gguf()},
        std::pair{std::string("split"), split_path(1)}}) {
    SCOPED_TRACE(name);
    std::vector<std::string> args{expertd::test::bin_path("expert-run"),
                                  "--socket",
                                  socket_,
                                  "--model",
                                  name,
                                  "--prompt-tokens",
                                  joined({1, 2, 3}),
                                  "--max-tokens",
                                  "6",
                                  "--ignore-eos",
                                  "--json",
                                  "--cpu"};
    const auto by_name = expertd::test::run_command(args);
    ASSERT_EQ(by_name.status, 0) << by_name.out << by_name.err;
    args.insert(args.end(), {"--gguf", path});
    const auto by_path = expertd::test::run_command(args);
    ASSERT_EQ(by_path.status, 0) << by_path.out << by_path.err;
    const auto a = nlohmann::json::parse(by_name.out);
    const auto b = nlohmann::json::parse(by_path.out);
    EXPECT_EQ(a.at("generated").get<std::vector<uint32_t>>().size(), 6u);
    EXPECT_EQ(a.at("generated"), b.at("generated"));
  }
  // The text report names where the dense weights came from.
  const auto r = expertd::test::run_command({expertd::test::bin_path("expert-run"), "--socket",
                                             socket_, "--model", "qwen", "--prompt-tokens", "1",
                                             "--max-tokens", "1", "--cpu"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("from expertd:qwen/model-f32.gguf"), std::string::npos) << r.out;
}

// The GPU engine's host memory under a cap: once its dense weights are in VRAM, expert-run and
// expert-serve drop the host copies; the model keeps every shape and the summary's byte count.
TEST(DenseModelFiles, DroppingTheHostMatricesKeepsShapesAndTheCount) {
  const test::TinyFixture fx = test::TinyFixture::load();
  auto model = DenseModel::load(fx.gguf("f32"));
  ASSERT_TRUE(model) << model.error().message;
  const uint64_t before = model->dense_bytes();
  const uint64_t rows = model->token_embd().rows;
  ASSERT_FALSE(model->layer(0).wq.bytes.empty());
  model->drop_host_matrices();
  EXPECT_EQ(model->dense_bytes(), before);
  EXPECT_TRUE(model->token_embd().bytes.empty());
  EXPECT_TRUE(model->output().bytes.empty());
  EXPECT_TRUE(model->layer(0).wq.bytes.empty());
  EXPECT_TRUE(model->layer(model->params().n_layer - 1).gate_inp.bytes.empty());
  EXPECT_EQ(model->token_embd().rows, rows);
  EXPECT_EQ(model->layer(0).wq.cols, model->params().n_embd);
  EXPECT_FALSE(model->layer(0).attn_norm.empty()) << "norm vectors stay";
}

}  // namespace
}  // namespace expertd::engine
