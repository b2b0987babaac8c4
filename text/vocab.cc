#include "text/vocab.h"

#include <array>

namespace expertd::text {
namespace {

bool printable(uint32_t b) {
  return (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
}

// The inverse of GPT-2's bytes_to_unicode: the bytes it leaves out of the printable ranges are
// spelled U+0100 + n, n counting them in byte order.
constexpr uint32_t kShifted = 68;  // 256 - the 188 printable bytes
std::array<uint8_t, kShifted> shifted_bytes() {
  std::array<uint8_t, kShifted> out{};
  uint32_t n = 0;
  for (uint32_t b = 0; b < 256; ++b) {
    if (!printable(b)) out[n++] = static_cast<uint8_t>(b);
  }
  return out;
}

void append_utf8(std::string& s, uint32_t c) {
  if (c < 0x80) {
    s += static_cast<char>(c);
  } else if (c < 0x800) {
    s += static_cast<char>(0xc0 | (c >> 6));
    s += static_cast<char>(0x80 | (c & 0x3f));
  } else if (c < 0x10000) {
    s += static_cast<char>(0xe0 | (c >> 12));
    s += static_cast<char>(0x80 | ((c >> 6) & 0x3f));
    s += static_cast<char>(0x80 | (c & 0x3f));
  } else {
    s += static_cast<char>(0xf0 | (c >> 18));
    s += static_cast<char>(0x80 | ((c >> 12) & 0x3f));
    s += static_cast<char>(0x80 | ((c >> 6) & 0x3f));
    s += static_cast<char>(0x80 | (c & 0x3f));
  }
}

}  // namespace

std::string decode_byte_level(const std::string& piece) {
  static const std::array<uint8_t, kShifted> shifted = shifted_bytes();
  std::string out;
  size_t i = 0;
  while (i < piece.size()) {
    const auto b0 = static_cast<uint8_t>(piece[i]);
    // One UTF-8 sequence; a malformed one is passed through byte by byte.
    uint32_t len = b0 < 0x80         ? 1
                   : (b0 >> 5) == 6  ? 2
                   : (b0 >> 4) == 14 ? 3
                   : (b0 >> 3) == 30 ? 4
                                     : 0;
    if (len == 0 || i + len > piece.size()) {
      out += piece[i++];
      continue;
    }
    uint32_t c = len == 1 ? b0 : b0 & (0x7f >> len);
    for (uint32_t j = 1; j < len; ++j) c = (c << 6) | (static_cast<uint8_t>(piece[i + j]) & 0x3f);
    if (c < 256 && printable(c)) {
      out += static_cast<char>(c);
    } else if (c >= 256 && c < 256 + kShifted) {
      out += static_cast<char>(shifted[c - 256]);
    } else {
      append_utf8(out, c);
    }
    i += len;
  }
  return out;
}

std::string byte_level_piece(uint8_t byte) {
  static const std::array<uint8_t, kShifted> shifted = shifted_bytes();
  std::string out;
  if (printable(byte)) {
    append_utf8(out, byte);
    return out;
  }
  uint32_t n = 0;
  while (shifted[n] != byte) ++n;
  append_utf8(out, 256 + n);
  return out;
}

std::optional<Vocab> Vocab::from_gguf(const GgufModel& model) {
  const GgufValue* tokens = model.meta().find("tokenizer.ggml.tokens");
  const GgufArray* arr = tokens != nullptr ? tokens->as_array() : nullptr;
  if (arr == nullptr || arr->elem_type != GgufValueType::STRING) return std::nullopt;
  std::vector<std::string> pieces;
  pieces.reserve(arr->count);
  for (uint64_t i = 0; i < arr->count; ++i) pieces.emplace_back(arr->string_at(i));
  const GgufValue* kind = model.meta().find("tokenizer.ggml.model");
  const bool byte_level =
      kind != nullptr && kind->as_string() != nullptr && *kind->as_string() == "gpt2";
  return from_pieces(std::move(pieces), byte_level);
}

Vocab Vocab::from_pieces(std::vector<std::string> pieces, bool byte_level) {
  Vocab v;
  v.pieces_ = std::move(pieces);
  v.byte_level_ = byte_level;
  return v;
}

std::string Vocab::decode(uint32_t token) const {
  if (token >= pieces_.size()) return {};
  return byte_level_ ? decode_byte_level(pieces_[token]) : pieces_[token];
}

std::string Vocab::decode(const std::vector<uint32_t>& tokens) const {
  std::string out;
  for (const uint32_t t : tokens) out += decode(t);
  return out;
}

}  // namespace expertd::text
