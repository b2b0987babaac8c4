// `expertctl tokenize GGUF`: text to token ids with the GGUF's own tokenizer (engine/tokenizer.h,
// the one expert-run encodes prompts with), offline. bench/peer/peer.sh makes its `text` token
// stream with it, so expertd and llama.cpp are fed the ids of real text (issue 23).
#include <fmt/format.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "storage/gguf.h"
#include "text/tokenizer.h"
#include "tools/expertctl/commands.h"

namespace expertctl {
namespace {

struct TokenizeOptions {
  std::string gguf;
  std::vector<std::string> texts;
  std::vector<std::string> files;
  bool add_bos = false;
  int64_t max = -1;  // -1: every id
  bool json = false;
};

int fail(const std::string& message) {
  std::fprintf(stderr, "expertctl tokenize: %s\n", message.c_str());
  return 1;
}

// The text to encode: the --text values or the --file contents, each joined as given (nothing
// added between them, so two files read as one text).
bool gather_text(const TokenizeOptions& o, std::string* text, std::string* error) {
  if (!o.texts.empty() && !o.files.empty()) {
    *error = "give --text or --file, not both";
    return false;
  }
  if (o.texts.empty() && o.files.empty()) {
    *error = "no text: give --text TEXT or --file FILE";
    return false;
  }
  for (const std::string& t : o.texts) text->append(t);
  for (const std::string& path : o.files) {
    std::ifstream in(path, std::ios::binary);
    if (!in) {
      *error = fmt::format("--file {}: {}", path, std::strerror(errno));
      return false;
    }
    text->append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    if (in.bad()) {
      *error = fmt::format("--file {}: read error", path);
      return false;
    }
  }
  if (text->empty()) {
    *error = o.files.empty() ? "--text: the text is empty" : "--file: the files are empty";
    return false;
  }
  return true;
}

int run_tokenize(const TokenizeOptions& o) {
  std::string text;
  std::string error;
  if (!gather_text(o, &text, &error)) return fail(error);
  auto file = expertd::GgufFile::open(o.gguf);
  if (!file) return fail(file.error().message);  // names the file, the field and the offset
  auto tok = expertd::text::Tokenizer::from_gguf(*file);
  if (!tok) return fail(tok.error().message);  // names the file and the missing key
  auto ids = tok->encode(text, /*add_special=*/false);
  if (!ids) return fail(ids.error().message);
  if (ids->empty()) return fail("the text encodes to no tokens");
  const size_t encoded = ids->size();
  if (o.add_bos) {
    if (!tok->bos()) return fail(o.gguf + ": --add-bos: the tokenizer has no BOS token");
    ids->insert(ids->begin(), *tok->bos());
  }
  if (o.max >= 0 && ids->size() > static_cast<uint64_t>(o.max)) ids->resize(o.max);
  if (o.json) {
    const expertd::GgufValue* model = file->find("tokenizer.ggml.model");
    const std::string* model_name = model != nullptr ? model->as_string() : nullptr;
    nlohmann::ordered_json j;
    j["tokenizer"] = o.gguf;
    j["model"] = model_name != nullptr ? *model_name : "";
    j["pre"] = tok->pre();
    j["vocab"] = tok->size();
    j["text_bytes"] = text.size();
    j["encoded"] = encoded;  // every id of the text, before --add-bos and --max
    j["bos"] = o.add_bos;
    j["ids"] = *ids;
    std::puts(j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  } else {
    std::string line;
    for (size_t i = 0; i < ids->size(); ++i) line += fmt::format("{}{}", i ? "," : "", (*ids)[i]);
    std::puts(line.c_str());
  }
  return std::fflush(stdout) == 0 ? 0 : 1;
}

}  // namespace

void add_tokenize_command(CLI::App& app, std::function<int()>* run) {
  auto opts = std::make_shared<TokenizeOptions>();
  CLI::App* cmd = app.add_subcommand(
      "tokenize",
      "Encode text with a GGUF's tokenizer (offline, no daemon): the ids on one line, "
      "comma-separated");
  cmd->add_option("gguf", opts->gguf, "a GGUF with tokenizer.ggml.* keys (a model or vocab only)")
      ->required();
  // One value per occurrence, so `--text hi MODEL.gguf` leaves the GGUF to the positional.
  cmd->add_option("--text", opts->texts, "the text (repeatable: joined as given)")
      ->allow_extra_args(false);
  cmd->add_option("--file", opts->files,
                  "read the text from FILE (repeatable: the files joined in order, as one text)")
      ->allow_extra_args(false);
  cmd->add_flag("--add-bos", opts->add_bos, "put the tokenizer's BOS token first");
  cmd->add_option("--max", opts->max, "keep the first N ids (after the BOS)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--json", opts->json,
                "one JSON object: tokenizer, model, pre, vocab, text_bytes, encoded (ids of the "
                "whole text), bos, ids");
  cmd->callback([run, opts] { *run = [opts] { return run_tokenize(*opts); }; });
}

}  // namespace expertctl
