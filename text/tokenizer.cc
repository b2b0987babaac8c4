#include "text/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <fmt/format.h>
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <queue>
#include <span>

#include "base/check.h"
#include "text/vocab.h"

namespace expertd::text {
namespace {

// byte_ids_ of a byte the vocabulary has no piece for.
constexpr uint32_t kNoToken = UINT32_MAX;

// The pre-tokenizer patterns of each family's tokenizer.json, as written there: PCRE2 with UTF and
// UCP reads them as HF's Oniguruma does (\s, \p{L}, \p{N}, \p{P}, \p{S}, \p{M}, (?i:) and the
// lookahead); the corpus test (tests/engine/tokenizer_test.cc) covers NEL, NBSP, U+3000 and the
// other Unicode spaces.
constexpr const char* kGpt2[] = {
    R"re('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)re"};
constexpr const char* kQwen2[] = {
    R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*)re"
    R"re(|\s*[\r\n]+|\s+(?!\S)|\s+)re"};
constexpr const char* kLlama3[] = {
    R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+)re"
    R"re([\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re"};
// gpt-oss's o200k (llama.cpp's "gpt-4o"): case runs with the contraction suffix, digits in threes,
// a slash kept with punctuation.
constexpr const char* kGpt4o[] = {
    R"re([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+)re"
    R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)?)re"
    R"re(|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*)re"
    R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)?)re"
    R"re(|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)re"};
// Kimi-K2's tiktoken split (tokenization_kimi.py): Han runs alone, then o200k-like words that
// exclude Han. The original writes the exclusion as class intersection ([...&&[^\p{Han}]]), which
// PCRE2 lacks: each such class is a negative lookahead before the class here. `sc:` because
// PCRE2's bare \p{Han} is the script extension (it takes 「」 and 々-like marks shared with kana,
// 22 of the corpus strings differed), while tiktoken's and Oniguruma's is the script.
constexpr const char* kKimiK2[] = {
    R"re(\p{sc:Han}+)re"
    R"re(|[^\r\n\p{L}\p{N}]?(?:(?!\p{sc:Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])*)re"
    R"re((?:(?!\p{sc:Han})[\p{Ll}\p{Lm}\p{Lo}\p{M}])+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)re"
    R"re(|[^\r\n\p{L}\p{N}]?(?:(?!\p{sc:Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])+)re"
    R"re((?:(?!\p{sc:Han})[\p{Ll}\p{Lm}\p{Lo}\p{M}])*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)re"
    R"re(|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re"};
// Three Splits in sequence, each on the pieces the one before left.
constexpr const char* kDeepseekV3[] = {
    R"re(\p{N}{1,3})re", R"re([\x{4e00}-\x{9fa5}\x{3040}-\x{309f}\x{30a0}-\x{30ff}]+)re",
    R"re([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+)re"
    R"re(| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re"};

struct PreTokenizer {
  std::string_view name;
  std::span<const char* const> patterns;
  bool nfc;            // the tokenizer.json has an NFC normalizer
  bool ignore_merges;  // the BPE model has ignore_merges
};

constexpr PreTokenizer kPreTokenizers[] = {
    {"default", kGpt2, false, false},
    {"gpt-2", kGpt2, false, false},
    {"qwen2", kQwen2, true, false},
    {"llama-bpe", kLlama3, false, true},
    {"llama3", kLlama3, false, true},
    {"deepseek-v3", kDeepseekV3, false, false},
    // GLM-4.5's tokenizer.json splits as Llama 3's does, with ignore_merges (llama.cpp: glm4).
    {"glm4", kLlama3, false, true},
    {"gpt-4o", kGpt4o, false, false},
    // tiktoken takes a pre-token that is itself a token whole: ignore_merges.
    {"kimi-k2", kKimiK2, false, true},
};

// Length of the UTF-8 sequence starting at s[i], 0 if malformed (overlong, surrogate, > U+10FFFF).
size_t utf8_len(std::string_view s, size_t i) {
  const auto b = static_cast<uint8_t>(s[i]);
  size_t len = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 0;
  if (len == 0 || i + len > s.size()) return 0;
  uint32_t c = len == 1 ? b : b & (0x7f >> len);
  for (size_t j = 1; j < len; ++j) {
    const auto cb = static_cast<uint8_t>(s[i + j]);
    if ((cb & 0xc0) != 0x80) return 0;
    c = (c << 6) | (cb & 0x3f);
  }
  static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
  if (c < kMin[len] || c > 0x10ffff || (c >= 0xd800 && c <= 0xdfff)) return 0;
  return len;
}

// Offset of the first malformed byte, or npos.
size_t invalid_utf8_at(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t len = utf8_len(s, i);
    if (len == 0) return i;
    i += len;
  }
  return std::string_view::npos;
}

struct CodeDeleter {
  void operator()(pcre2_code* c) const { pcre2_code_free(c); }
};
struct MatchDataDeleter {
  void operator()(pcre2_match_data* m) const { pcre2_match_data_free(m); }
};
using Code = std::unique_ptr<pcre2_code, CodeDeleter>;
using MatchData = std::unique_ptr<pcre2_match_data, MatchDataDeleter>;

// A JIT stack of up to 256 MiB (reserved, committed as used) and the match context that hands it
// to pcre2_match; one per encode call that needs it, so concurrent encodes never share one.
struct JitStack {
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 << 10, 256 << 20, nullptr);
  pcre2_match_context* context = nullptr;
  JitStack() {
    if (stack == nullptr) return;
    context = pcre2_match_context_create(nullptr);
    if (context != nullptr) pcre2_jit_stack_assign(context, nullptr, stack);
  }
  ~JitStack() {
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(stack);
  }
  JitStack(const JitStack&) = delete;
  JitStack& operator=(const JitStack&) = delete;
};

struct Span {
  size_t begin;
  size_t end;
};

}  // namespace

struct Tokenizer::Regexes {
  std::vector<Code> codes;
};

Tokenizer::Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

namespace {

Result<Code> compile(const char* pattern) {
  int code = 0;
  PCRE2_SIZE offset = 0;
  Code re(pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern), PCRE2_ZERO_TERMINATED,
                        PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &code, &offset, nullptr));
  if (!re) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(code, msg, sizeof msg);
    return make_error(EINVAL, fmt::format("tokenizer: pre-tokenizer pattern does not compile at "
                                          "offset {}: {}",
                                          offset, reinterpret_cast<const char*>(msg)));
  }
  // JIT is only speed; without it (no JIT on this CPU) the interpreter gives the same matches.
  (void)pcre2_jit_compile(re.get(), PCRE2_JIT_COMPLETE);
  return re;
}

const GgufArray* array_of(const GgufFile& f, std::string_view key, GgufValueType elem) {
  const GgufValue* v = f.find(key);
  const GgufArray* a = v != nullptr ? v->as_array() : nullptr;
  return a != nullptr && a->elem_type == elem ? a : nullptr;
}

std::optional<uint32_t> id_of(const GgufFile& f, std::string_view key, size_t vocab) {
  const GgufValue* v = f.find(key);
  if (v == nullptr) return std::nullopt;
  const std::optional<int64_t> id = v->as_i64();
  if (!id || *id < 0 || static_cast<uint64_t>(*id) >= vocab) return std::nullopt;
  return static_cast<uint32_t>(*id);
}

}  // namespace

Status Tokenizer::load_tokens(const GgufFile& f) {
  const GgufArray* tokens = array_of(f, "tokenizer.ggml.tokens", GgufValueType::STRING);
  if (tokens == nullptr || tokens->count == 0) {
    return make_error(EINVAL, fmt::format("{}: no tokenizer.ggml.tokens", f.path()));
  }
  if (tokens->count > UINT32_MAX) {
    return make_error(EINVAL, fmt::format("{}: {} tokens", f.path(), tokens->count));
  }
  const GgufArray* types = array_of(f, "tokenizer.ggml.token_type", GgufValueType::INT32);
  if (types != nullptr && types->count != tokens->count) {
    return make_error(EINVAL, fmt::format("{}: tokenizer.ggml.token_type has {} entries for {} "
                                          "tokens",
                                          f.path(), types->count, tokens->count));
  }
  const auto n = static_cast<uint32_t>(tokens->count);
  tokens_.reserve(n);
  types_.reserve(n);
  specials_by_byte_.resize(256);
  for (uint32_t i = 0; i < n; ++i) {
    tokens_.emplace_back(tokens->string_at(i));
    const int64_t ty = types != nullptr ? types->int_at(i).value_or(1) : 1;
    const TokenType type = ty >= 0 && ty <= 6 ? static_cast<TokenType>(ty) : TokenType::kNormal;
    types_.push_back(type);
    if ((type == TokenType::kControl || type == TokenType::kUserDefined ||
         type == TokenType::kUnknown) &&
        !tokens_.back().empty()) {
      specials_by_byte_[static_cast<uint8_t>(tokens_.back()[0])].push_back(i);
    }
    // The first id wins for a piece stored twice, as a JSON vocabulary's map would keep one.
    ids_.emplace(tokens_.back(), i);
  }
  for (auto& list : specials_by_byte_) {
    std::stable_sort(list.begin(), list.end(), [this](uint32_t a, uint32_t b) {
      return tokens_[a].size() > tokens_[b].size();
    });
  }
  return Ok{};
}

Status Tokenizer::load_bos_eos(const GgufFile& f) {
  const auto n = static_cast<uint32_t>(tokens_.size());
  bos_ = id_of(f, "tokenizer.ggml.bos_token_id", n);
  eos_ = id_of(f, "tokenizer.ggml.eos_token_id", n);
  const GgufValue* add_bos = f.find("tokenizer.ggml.add_bos_token");
  add_bos_ = add_bos != nullptr && add_bos->as_bool().value_or(false);
  if (add_bos_ && !bos_) {
    return make_error(EINVAL, fmt::format("{}: tokenizer.ggml.add_bos_token is set but there is "
                                          "no valid tokenizer.ggml.bos_token_id",
                                          f.path()));
  }
  return Ok{};
}

// SentencePiece BPE (Mistral, Mixtral) as transformers converts it for HF: the merges are every
// split of a piece into two pieces, ranked by the piece's score (higher first; ties by piece id,
// then the left and right ids), which is tokenizers' SentencePieceExtractor.
Result<Tokenizer> Tokenizer::from_gguf_spm(const GgufFile& f) {
  Tokenizer t;
  t.spm_ = true;
  t.pre_ = "default";
  if (Status st = t.load_tokens(f); !st) return st.take_error();
  const GgufArray* scores = array_of(f, "tokenizer.ggml.scores", GgufValueType::FLOAT32);
  if (scores == nullptr || scores->count != t.tokens_.size()) {
    return make_error(EINVAL, fmt::format("{}: tokenizer.ggml.scores is missing or not one float "
                                          "per token",
                                          f.path()));
  }
  t.byte_ids_.resize(256);
  for (uint32_t b = 0; b < 256; ++b) {
    const auto it = t.ids_.find(fmt::format("<0x{:02X}>", b));
    if (it == t.ids_.end() || t.types_[it->second] != TokenType::kByte) {
      return make_error(EINVAL, fmt::format("{}: no byte token <0x{:02X}> (byte fallback needs all "
                                            "256)",
                                            f.path(), b));
    }
    t.byte_ids_[b] = it->second;
  }
  struct Merge {
    float score;
    uint32_t piece;
    uint32_t left;
    uint32_t right;
  };
  std::vector<Merge> merges;
  for (uint32_t i = 0; i < t.tokens_.size(); ++i) {
    const std::string& piece = t.tokens_[i];
    if (t.ids_.at(piece) != i) continue;  // a duplicate piece: the vocabulary keeps the first
    const float score = static_cast<float>(scores->float_at(i).value_or(0.0));
    for (size_t k = utf8_len(piece, 0); k > 0 && k < piece.size();) {
      const auto l = t.ids_.find(piece.substr(0, k));
      const auto r = t.ids_.find(piece.substr(k));
      if (l != t.ids_.end() && r != t.ids_.end())
        merges.push_back({score, i, l->second, r->second});
      const size_t step = utf8_len(piece, k);
      if (step == 0) break;  // not UTF-8: no further split points
      k += step;
    }
  }
  std::stable_sort(merges.begin(), merges.end(), [](const Merge& a, const Merge& b) {
    if (a.score != b.score) return a.score > b.score;
    if (a.piece != b.piece) return a.piece < b.piece;
    return a.left != b.left ? a.left < b.left : a.right < b.right;
  });
  t.merges_.reserve(merges.size());
  for (uint32_t rank = 0; rank < merges.size(); ++rank) {
    const Merge& m = merges[rank];
    t.merges_.emplace((static_cast<uint64_t>(m.left) << 32) | m.right,
                      std::make_pair(rank, m.piece));
  }
  const GgufValue* prefix = f.find("tokenizer.ggml.add_space_prefix");
  t.add_space_prefix_ = prefix == nullptr || prefix->as_bool().value_or(true);
  if (Status st = t.load_bos_eos(f); !st) return st.take_error();
  return t;
}

Result<Tokenizer> Tokenizer::from_gguf(const GgufFile& f) {
  const GgufValue* model = f.find("tokenizer.ggml.model");
  const std::string* model_name = model != nullptr ? model->as_string() : nullptr;
  if (model_name == nullptr) {
    return make_error(EINVAL, fmt::format("{}: no tokenizer.ggml.model", f.path()));
  }
  if (*model_name == "llama") return from_gguf_spm(f);
  if (*model_name != "gpt2") {
    return make_error(ENOTSUP, fmt::format("{}: tokenizer.ggml.model \"{}\" is not supported "
                                           "(supported: gpt2, llama)",
                                           f.path(), *model_name));
  }
  const GgufValue* pre = f.find("tokenizer.ggml.pre");
  const std::string pre_name =
      pre != nullptr && pre->as_string() != nullptr ? *pre->as_string() : "default";
  const PreTokenizer* spec = nullptr;
  for (const PreTokenizer& p : kPreTokenizers) {
    if (p.name == pre_name) spec = &p;
  }
  if (spec == nullptr) {
    std::string names;  // the table's own names, so the message cannot fall behind it
    for (const PreTokenizer& p : kPreTokenizers)
      names += (names.empty() ? "" : ", ") + std::string(p.name);
    return make_error(ENOTSUP, fmt::format("{}: tokenizer.ggml.pre \"{}\" is not supported "
                                           "(supported: {})",
                                           f.path(), pre_name, names));
  }

  Tokenizer t;
  t.pre_ = pre_name;
  t.nfc_ = spec->nfc;
  t.ignore_merges_ = spec->ignore_merges;
  t.regexes_ = std::make_unique<Regexes>();
  for (const char* pattern : spec->patterns) {
    Result<Code> re = compile(pattern);
    if (!re) return re.take_error();
    t.regexes_->codes.push_back(std::move(*re));
  }

  if (Status st = t.load_tokens(f); !st) return st.take_error();
  t.byte_ids_.resize(256);
  for (uint32_t b = 0; b < 256; ++b) {
    // A vocabulary may lack a byte's piece (a converter that stored a special token's text in
    // its place): text with that byte is refused by encode(), naming the byte.
    const auto it = t.ids_.find(byte_level_piece(static_cast<uint8_t>(b)));
    t.byte_ids_[b] = it == t.ids_.end() ? kNoToken : it->second;
  }

  // No merges key: a vocabulary of single pieces (HF allows an empty merge list; llama.cpp's
  // converter omits the key then). A key of another type is an error.
  const GgufArray* merges = array_of(f, "tokenizer.ggml.merges", GgufValueType::STRING);
  if (merges == nullptr && f.find("tokenizer.ggml.merges") != nullptr) {
    return make_error(
        EINVAL, fmt::format("{}: tokenizer.ggml.merges is not an array of strings", f.path()));
  }
  const uint64_t n_merges = merges != nullptr ? merges->count : 0;
  t.merges_.reserve(n_merges);
  for (uint64_t r = 0; r < n_merges; ++r) {
    const std::string_view m = merges->string_at(r);
    const size_t space = m.find(' ');
    if (space == std::string_view::npos || m.find(' ', space + 1) != std::string_view::npos) {
      return make_error(EINVAL, fmt::format("{}: tokenizer.ggml.merges[{}] \"{}\" is not two "
                                            "pieces",
                                            f.path(), r, m));
    }
    const std::string left(m.substr(0, space));
    const std::string right(m.substr(space + 1));
    const auto l = t.ids_.find(left);
    const auto rt = t.ids_.find(right);
    const auto merged = t.ids_.find(left + right);
    // A merge naming a piece the vocabulary lacks can never apply (llama.cpp loads such files;
    // a placeholder merge is how byte-only vocabularies satisfy its loader): skipped.
    if (l == t.ids_.end() || rt == t.ids_.end() || merged == t.ids_.end()) continue;
    const uint64_t key = (static_cast<uint64_t>(l->second) << 32) | rt->second;
    // A repeated pair keeps its first (best) rank, as HF's merge map does.
    t.merges_.emplace(key, std::make_pair(static_cast<uint32_t>(r), merged->second));
  }

  if (Status st = t.load_bos_eos(f); !st) return st.take_error();
  return t;
}

TokenType Tokenizer::type(uint32_t token) const {
  return token < types_.size() ? types_[token] : TokenType::kUndefined;
}

Result<std::vector<uint32_t>> Tokenizer::encode(std::string_view text, bool add_special) const {
  if (const size_t bad = invalid_utf8_at(text); bad != std::string_view::npos) {
    return make_error(EINVAL,
                      fmt::format("tokenizer: the text is not valid UTF-8 at byte {}", bad));
  }
  std::vector<uint32_t> out;
  if (add_special && add_bos_) out.push_back(*bos_);
  // Added tokens first, as HF does: the leftmost match, the longest of those starting there.
  size_t start = 0;
  size_t i = 0;
  while (i < text.size()) {
    uint32_t found = UINT32_MAX;
    for (const uint32_t id : specials_by_byte_[static_cast<uint8_t>(text[i])]) {
      if (text.substr(i).starts_with(tokens_[id])) {
        found = id;
        break;  // longest first
      }
    }
    if (found == UINT32_MAX) {
      ++i;
      continue;
    }
    if (Status st = encode_segment(text.substr(start, i - start), out); !st) return st.take_error();
    out.push_back(found);
    i += tokens_[found].size();
    start = i;
  }
  if (Status st = encode_segment(text.substr(start), out); !st) return st.take_error();
  if (std::find(out.begin(), out.end(), kNoToken) != out.end()) {
    for (const char c : text) {
      if (byte_ids_[static_cast<uint8_t>(c)] == kNoToken) {
        return make_error(EINVAL, fmt::format("tokenizer: the text has byte 0x{:02x}, which the "
                                              "vocabulary has no token for",
                                              static_cast<uint8_t>(c)));
      }
    }
  }
  return out;
}

Status Tokenizer::encode_segment(std::string_view text, std::vector<uint32_t>& out) const {
  if (text.empty()) return Ok{};
  if (spm_) {
    // HF's normalizer for these: Prepend("▁") then Replace(" ", "▁"), on each stretch of text
    // between special tokens; no pre-tokenizer, so the whole stretch is one word.
    std::string word = add_space_prefix_ ? "\u2581" : "";
    for (const char c : text) {
      if (c == ' ') {
        word += "\u2581";
      } else {
        word += c;
      }
    }
    encode_piece(word, out);
    return Ok{};
  }
  std::string normalized;
  if (nfc_) {
    utf8proc_uint8_t* mapped = nullptr;
    const utf8proc_ssize_t len =
        utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                     static_cast<utf8proc_ssize_t>(text.size()), &mapped,
                     static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
    // The text is valid UTF-8 (checked in encode), so the only failure is out of memory.
    EXPERTD_CHECK(len >= 0);
    normalized.assign(reinterpret_cast<const char*>(mapped), static_cast<size_t>(len));
    std::free(mapped);
    text = normalized;
  }
  // Each pattern splits every piece the one before it left into matches and the text between
  // them (HF's Split with behavior "isolated"); a pattern sees only its piece.
  std::vector<Span> pieces{{0, text.size()}};
  std::vector<Span> next;
  MatchData md(pcre2_match_data_create(1, nullptr));
  EXPERTD_CHECK(md != nullptr);
  std::optional<JitStack> big_stack;
  for (const Code& re : regexes_->codes) {
    next.clear();
    for (const Span p : pieces) {
      const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data() + p.begin);
      const size_t len = p.end - p.begin;
      size_t at = 0;
      size_t last = 0;
      while (at < len) {
        int rc = pcre2_match(re.get(), subject, len, at, PCRE2_NO_UTF_CHECK, md.get(),
                             big_stack ? big_stack->context : nullptr);
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT && !big_stack) {
          // A pattern with a lookahead inside a repeat (kimi-k2's) takes JIT stack per character:
          // a long run outgrows the default 32 KiB. Retried once with a stack for this encode.
          big_stack.emplace();
          if (big_stack->context == nullptr) {
            return make_error(ENOMEM, "tokenizer: no memory for the regex's JIT stack");
          }
          rc = pcre2_match(re.get(), subject, len, at, PCRE2_NO_UTF_CHECK, md.get(),
                           big_stack->context);
        }
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc <= 0) {  // PCRE2's match or depth limit: input, not a bug
          PCRE2_UCHAR msg[256];
          pcre2_get_error_message(rc, msg, sizeof msg);
          return make_error(EOVERFLOW, fmt::format("tokenizer: the pre-tokenizer regex failed on "
                                                   "a piece of {} bytes: {}",
                                                   len, reinterpret_cast<const char*>(msg)));
        }
        const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
        const size_t b = ov[0];
        const size_t e = ov[1];
        if (e == b) {
          if (b >= len) break;  // an empty match splits nothing; step over one character
          at = b + std::max<size_t>(1, utf8_len(text, p.begin + b));
          continue;
        }
        if (b > last) next.push_back({p.begin + last, p.begin + b});
        next.push_back({p.begin + b, p.begin + e});
        last = at = e;
      }
      if (last < len) next.push_back({p.begin + last, p.end});
    }
    pieces.swap(next);
  }
  for (const Span p : pieces) encode_piece(text.substr(p.begin, p.end - p.begin), out);
  return Ok{};
}

void Tokenizer::encode_piece(std::string_view piece, std::vector<uint32_t>& out) const {
  if (ignore_merges_) {
    std::string whole;
    for (const char c : piece) whole += byte_level_piece(static_cast<uint8_t>(c));
    if (const auto it = ids_.find(whole); it != ids_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  // BPE as HF's Word::merge_all: a queue of candidate pairs by (rank, position); a candidate
  // whose symbols changed since it was queued is dropped when it comes up.
  struct Symbol {
    uint32_t id;
    int32_t prev;
    int32_t next;
    bool alive;
  };
  std::vector<Symbol> syms;
  syms.reserve(piece.size());
  const auto add = [&](uint32_t id) {
    const auto n = static_cast<int32_t>(syms.size());
    if (n > 0) syms.back().next = n;
    syms.push_back({id, n - 1, -1, true});
  };
  if (spm_) {
    // Each character that is a piece starts as that piece; any other is its UTF-8 bytes as byte
    // tokens (byte fallback).
    for (size_t i = 0; i < piece.size();) {
      const size_t len = std::max<size_t>(1, utf8_len(piece, i));
      if (const auto it = ids_.find(std::string(piece.substr(i, len))); it != ids_.end()) {
        add(it->second);
      } else {
        for (size_t j = i; j < i + len; ++j) add(byte_ids_[static_cast<uint8_t>(piece[j])]);
      }
      i += len;
    }
  } else {
    for (const char c : piece) add(byte_ids_[static_cast<uint8_t>(c)]);
  }
  struct Candidate {
    uint32_t rank;
    int32_t pos;
    uint32_t merged;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  const auto push = [&](int32_t pos) {
    if (pos < 0 || syms[pos].next < 0) return;
    const uint64_t key = (static_cast<uint64_t>(syms[pos].id) << 32) | syms[syms[pos].next].id;
    if (const auto it = merges_.find(key); it != merges_.end()) {
      queue.push({it->second.first, pos, it->second.second});
    }
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(syms.size()); ++i) push(i);
  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    Symbol& s = syms[c.pos];
    if (!s.alive || s.next < 0) continue;
    const uint64_t key = (static_cast<uint64_t>(s.id) << 32) | syms[s.next].id;
    const auto it = merges_.find(key);
    if (it == merges_.end() || it->second.second != c.merged) continue;
    Symbol& right = syms[s.next];
    right.alive = false;
    s.id = c.merged;
    s.next = right.next;
    if (s.next >= 0) syms[s.next].prev = c.pos;
    push(s.prev);
    push(c.pos);
  }
  for (const Symbol& s : syms) {
    if (s.alive) out.push_back(s.id);
  }
}

std::string Tokenizer::decode(uint32_t token) const {
  if (token >= tokens_.size()) return {};
  const TokenType t = types_[token];
  if (spm_) {
    if (t == TokenType::kByte) {
      for (uint32_t b = 0; b < 256; ++b) {
        if (byte_ids_[b] == token) return std::string(1, static_cast<char>(b));
      }
    }
    // HF's decoder replaces ▁ in every token, special ones included.
    std::string out;
    const std::string& piece = tokens_[token];
    for (size_t i = 0; i < piece.size();) {
      if (piece.compare(i, 3, "\u2581") == 0) {
        out += ' ';
        i += 3;
      } else {
        out += piece[i++];
      }
    }
    return out;
  }
  if (t == TokenType::kControl || t == TokenType::kUserDefined || t == TokenType::kUnknown) {
    return tokens_[token];
  }
  return decode_byte_level(tokens_[token]);
}

std::string Tokenizer::decode(const std::vector<uint32_t>& tokens) const {
  std::string out;
  for (const uint32_t t : tokens) out += decode(t);
  // SentencePiece: HF's Strip(" ", 1, 0) takes the space the encoder put in front.
  if (spm_ && add_space_prefix_ && !out.empty() && out[0] == ' ') out.erase(0, 1);
  return out;
}

}  // namespace expertd::text
