// `expertctl tokenize`, offline, as bench/peer/peer.sh runs it: the ids of text against Hugging
// Face's recorded encodings of the Mixtral-style SentencePiece fixture
// (tests/fixtures/tokenizers/mixtral.{gguf,json}: "ids" without special tokens, "ids_special" with
// BOS), files joined as one text, --max, --json, and the errors a user would see.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "storage/gguf_writer.h"
#include "testing/expertd_fixture.h"
#include "testing/paths.h"

namespace expertd {
namespace {

using json = nlohmann::json;

test::RunResult tokenize(std::vector<std::string> args) {
  args.insert(args.begin(), {test::bin_path("expertctl"), "tokenize"});
  return test::run_command(args);
}

std::string tokenizer() { return test::data_path("tokenizers/mixtral.gguf"); }

json read_json(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in);
}

std::string joined(const std::vector<uint32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s + "\n";
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

class ExpertctlTokenize : public ::testing::Test {
 protected:
  void SetUp() override {
    corpus_ = read_json(test::data_path("tokenizers/corpus.json"));
    ref_ = read_json(test::data_path("tokenizers/mixtral.json"));
    ASSERT_EQ(ref_["ids"].size(), corpus_.size());
    // Strings of several tokens among those HF also encoded with BOS (the first ids_special).
    for (size_t i = 0; i < ref_["ids_special"].size() && picked_.size() < 12; ++i) {
      if (ref_["ids"][i].size() >= 3) picked_.push_back(i);
    }
    ASSERT_GE(picked_.size(), 4u);
  }
  std::string text(size_t i) const { return corpus_[i].get<std::string>(); }
  std::vector<uint32_t> ids(size_t i) const { return ref_["ids"][i].get<std::vector<uint32_t>>(); }

  json corpus_;
  json ref_;
  std::vector<size_t> picked_;
};

TEST_F(ExpertctlTokenize, TextEncodesAsHfRecorded) {
  for (const size_t i : picked_) {
    const test::RunResult r = tokenize({tokenizer(), "--text", text(i)});
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_EQ(r.out, joined(ids(i))) << "corpus string " << i << ": " << json(text(i)).dump();
  }
}

TEST_F(ExpertctlTokenize, AddBosMatchesHfWithSpecialTokens) {
  for (const size_t i : picked_) {
    const test::RunResult r = tokenize({tokenizer(), "--add-bos", "--text", text(i)});
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_EQ(r.out, joined(ref_["ids_special"][i].get<std::vector<uint32_t>>()))
        << "corpus string " << i;
  }
}

TEST_F(ExpertctlTokenize, FilesAreOneTextAndMaxKeepsTheFirstIds) {
  test::TempDir dir;
  const std::string a = text(picked_[0]);
  const std::string b = "\n" + text(picked_[1]);
  write_file(dir.file("a.txt"), a);
  write_file(dir.file("b.txt"), b);
  const test::RunResult whole = tokenize({tokenizer(), "--text", a + b});
  ASSERT_EQ(whole.status, 0) << whole.err;
  const test::RunResult files =
      tokenize({tokenizer(), "--file", dir.file("a.txt"), "--file", dir.file("b.txt")});
  ASSERT_EQ(files.status, 0) << files.err;
  EXPECT_EQ(files.out, whole.out);

  const test::RunResult j = tokenize({tokenizer(), "--file", dir.file("a.txt"), "--file",
                                      dir.file("b.txt"), "--max", "2", "--add-bos", "--json"});
  ASSERT_EQ(j.status, 0) << j.err;
  const json o = json::parse(j.out);
  EXPECT_EQ(o["model"], "llama");
  EXPECT_EQ(o["pre"], "default");
  EXPECT_EQ(o["vocab"], 1459);
  EXPECT_EQ(o["text_bytes"], a.size() + b.size());
  EXPECT_EQ(o["bos"], true);
  // The BOS, then the text's first id; "encoded" counts every id of the text.
  const std::vector<uint32_t> first = ids(picked_[0]);
  EXPECT_EQ(o["ids"], json::array({1, first[0]}));
  EXPECT_EQ(o["encoded"].get<size_t>() + 1,
            std::count(whole.out.begin(), whole.out.end(), ',') + 2);
}

TEST(ExpertctlTokenizeErrors, NamesTheFileTheKeyOrTheFlag) {
  test::TempDir dir;
  write_file(dir.file("notes.txt"), "not a model\n");
  test::RunResult r = tokenize({dir.file("notes.txt"), "--text", "hi"});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find(dir.file("notes.txt")), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("not a GGUF file"), std::string::npos) << r.err;

  // A GGUF with no tokenizer.ggml.* keys.
  GgufWriter w;
  w.set_string("general.architecture", "llama");
  ASSERT_TRUE(w.begin(dir.file("bare.gguf"), GgufWriterOptions{.sync = false}));
  ASSERT_TRUE(w.finish());
  ASSERT_TRUE(w.commit());
  r = tokenize({dir.file("bare.gguf"), "--text", "hi"});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find(dir.file("bare.gguf") + ": no tokenizer.ggml.model"), std::string::npos)
      << r.err;

  r = tokenize({tokenizer(), "--text", ""});
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.err, "expertctl tokenize: --text: the text is empty\n");
  write_file(dir.file("empty.txt"), "");
  r = tokenize({tokenizer(), "--file", dir.file("empty.txt")});
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.err, "expertctl tokenize: --file: the files are empty\n");
  r = tokenize({tokenizer(), "--file", dir.file("missing.txt")});
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.err, "expertctl tokenize: --file " + dir.file("missing.txt") +
                       ": No such file or directory\n");
  r = tokenize({tokenizer()});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("no text: give --text TEXT or --file FILE"), std::string::npos) << r.err;
  r = tokenize({tokenizer(), "--text", "a", "--file", dir.file("empty.txt")});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("give --text or --file, not both"), std::string::npos) << r.err;
  // The GGUF after --text is the positional, not a second text.
  r = tokenize({"--text", "hi", tokenizer()});
  EXPECT_EQ(r.status, 0) << r.err;
}

}  // namespace
}  // namespace expertd
