// Text ↔ token ids for a GGUF's tokenizer (tokenizer.ggml.*), encoding as Hugging Face
// `tokenizers` does for the model's tokenizer.json.
//
// Supported: tokenizer.ggml.model "gpt2" (byte-level BPE: tokens + merges, merge ranks = order of
// tokenizer.ggml.merges), with the pre-tokenizer named by tokenizer.ggml.pre: "default" and
// "gpt-2" (GPT-2's regex), "qwen2" (Qwen2's regex, NFC normalisation as its tokenizer.json
// has it), "llama-bpe"/"llama3" (Llama 3's regex; a pre-token that is itself a token is not
// merged: its tokenizer.json sets ignore_merges), "deepseek-v3" (DeepSeek-V3's three splits; also
// what llama.cpp's converter writes for DeepSeek-V4). Also "llama" (SentencePiece BPE with byte
// fallback, Mistral/Mixtral: tokens + scores, in HF's form as transformers converts them). Any
// other model or pre-tokenizer is refused by name.
//
// Tokens of type CONTROL, USER_DEFINED and UNKNOWN (tokenizer.ggml.token_type; HF's added tokens)
// are found in the text first, leftmost and then longest, and become their own id; the text between
// them is normalised, pre-tokenized and merged. encode(text, add_special) puts BOS in front when
// add_special and tokenizer.ggml.add_bos_token say so.
//
// The pre-tokenizer regexes run on PCRE2 (UTF + Unicode properties), compiled once in
// from_gguf; the Tokenizer owns them. Immutable after from_gguf; encode/decode are const and may
// run on several threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "expertd/result.h"
#include "storage/gguf.h"

namespace expertd::text {

// llama.cpp's token types (gguf-py TokenType).
enum class TokenType : int32_t {
  kUndefined = 0,
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6,
};

class Tokenizer {
 public:
  // Reads tokenizer.ggml.{model,pre,tokens,token_type,merges,bos_token_id,eos_token_id,
  // add_bos_token}. Errors name the key (or the unsupported model / pre-tokenizer).
  static Result<Tokenizer> from_gguf(const GgufFile& file);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // The ids of `text`; add_special puts BOS first when the GGUF's add_bos_token is true. Text that
  // is not valid UTF-8 is an error (HF takes only Unicode strings), as is a piece on which PCRE2
  // reaches its match limit.
  Result<std::vector<uint32_t>> encode(std::string_view text, bool add_special) const;
  // The bytes of the tokens: byte-level pieces back to their bytes, CONTROL, USER_DEFINED and
  // UNKNOWN tokens as their text; SentencePiece pieces with ▁ as a space and <0xXX> as the byte,
  // and the sequence without the one leading space the encoder added (HF's Strip decoder; the
  // single-token form keeps it). An id outside the vocabulary is "".
  std::string decode(uint32_t token) const;
  std::string decode(const std::vector<uint32_t>& tokens) const;

  uint32_t size() const { return static_cast<uint32_t>(tokens_.size()); }
  TokenType type(uint32_t token) const;
  const std::string& pre() const { return pre_; }
  std::optional<uint32_t> bos() const { return bos_; }
  std::optional<uint32_t> eos() const { return eos_; }
  bool add_bos() const { return add_bos_; }

 private:
  struct Regexes;  // the compiled PCRE2 patterns (tokenizer.cc)
  Tokenizer();
  static Result<Tokenizer> from_gguf_spm(const GgufFile& file);
  Status load_tokens(const GgufFile& file);
  Status load_bos_eos(const GgufFile& file);

  Status encode_segment(std::string_view text, std::vector<uint32_t>& out) const;
  void encode_piece(std::string_view piece, std::vector<uint32_t>& out) const;

  std::string pre_;
  std::vector<std::string> tokens_;  // as stored (byte-level alphabet, or text for added tokens)
  std::vector<TokenType> types_;
  std::unordered_map<std::string, uint32_t> ids_;  // byte-level piece → id (model vocabulary)
  // (left id << 32 | right id) → (rank, merged id)
  std::unordered_map<uint64_t, std::pair<uint32_t, uint32_t>> merges_;
  std::vector<uint32_t> byte_ids_;  // byte → its single-byte token
  // CONTROL and USER_DEFINED tokens by first byte, longest first.
  std::vector<std::vector<uint32_t>> specials_by_byte_;
  std::unique_ptr<Regexes> regexes_;  // empty for SentencePiece
  bool spm_ = false;                  // tokenizer.ggml.model "llama" (SentencePiece BPE)
  bool add_space_prefix_ = true;      // SentencePiece: "▁" in front of each stretch of text
  bool nfc_ = false;
  bool ignore_merges_ = false;
  std::optional<uint32_t> bos_;
  std::optional<uint32_t> eos_;
  bool add_bos_ = false;
};

}  // namespace expertd::text
