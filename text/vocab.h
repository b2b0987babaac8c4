// Token text for display: the vocabulary of a GGUF (tokenizer.ggml.tokens) decoded as GPT-2
// byte-level pieces (tokenizer.ggml.model "gpt2", Qwen's): each character of a piece stands for
// one byte (GPT-2's bytes_to_unicode), so "Ġthe" is " the" and "Ċ" is "\n". Pieces of other
// tokenizers, and characters outside that alphabet, are shown as stored. Decoding only: the
// engine takes token ids.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "storage/gguf.h"

namespace expertd::text {

class Vocab {
 public:
  // The model's vocabulary, or nullopt when the GGUF has no tokenizer.ggml.tokens.
  static std::optional<Vocab> from_gguf(const GgufModel& model);
  static Vocab from_pieces(std::vector<std::string> pieces, bool byte_level);

  uint32_t size() const { return static_cast<uint32_t>(pieces_.size()); }
  // The bytes of one token ("" for an id outside the vocabulary).
  std::string decode(uint32_t token) const;
  std::string decode(const std::vector<uint32_t>& tokens) const;

 private:
  std::vector<std::string> pieces_;
  bool byte_level_ = false;
};

// GPT-2's byte-level decoding of one piece: every character of bytes_to_unicode's alphabet back to
// its byte; other characters are kept as their UTF-8.
std::string decode_byte_level(const std::string& piece);
// The other way for one byte: the UTF-8 of bytes_to_unicode's character for `byte`.
std::string byte_level_piece(uint8_t byte);

}  // namespace expertd::text
