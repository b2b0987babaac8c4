#include "forge/content.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <vector>

#include "base/check.h"
#include "base/half.h"

// This file is compiled with -ffp-contract=off: the few float operations below are part of the
// content definition and must round the same way on every compiler and target.

namespace expertd {
namespace {

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;
constexpr uint64_t kWyP0 = 0xa0761d6478bd642full;
constexpr uint64_t kWyP1 = 0xe7037ed1a0b428dbull;
constexpr uint32_t kPlainBlockElems = 32;  // a plain type's generation block
using PlainBlock = std::array<float, kPlainBlockElems>;

// splitmix64's finaliser: a bijective 64-bit mix.
constexpr uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

constexpr uint64_t fnv1a64(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (const char c : s) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

// wyrand: a counter-based generator, one 64x64->128 multiply per 8 bytes. Seeded per block from
// the tensor key and the block index, so blocks are independent.
class BlockRng {
 public:
  BlockRng(uint64_t key, uint64_t block) : s_(mix64(key + block * kGolden)) {}
  uint64_t next() {
    s_ += kWyP0;
    const unsigned __int128 t = static_cast<unsigned __int128>(s_) * (s_ ^ kWyP1);
    return static_cast<uint64_t>(t >> 64) ^ static_cast<uint64_t>(t);
  }
  void fill(uint8_t* out, size_t words) {
    for (size_t i = 0; i < words; ++i) {
      const uint64_t w = next();
      std::memcpy(out + 8 * i, &w, 8);
    }
  }

 private:
  uint64_t s_;
};

void store_u16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }

// 0.75 .. 1.25 from 16 random bits: blocks of one tensor differ in magnitude as real ones do.
float scale_jitter(uint64_t w) {
  return 0.75f + static_cast<float>(w & 0xffffu) * (0.5f / 65536.0f);
}

// A positive f16 scale: `base * jitter`, at least the smallest f16 subnormal.
uint16_t f16_scale(float base, uint64_t w) {
  const uint16_t d = float_to_f16(base * scale_jitter(w));
  return d == 0 ? uint16_t{1} : d;
}

struct Gen {
  GgmlType type;
  uint64_t key;
  float center;
  float amplitude;
  float qamp;  // quantized types are symmetric: |center| + amplitude
};

// Plain types: a block is kPlainBlockElems elements; each random word gives 4 of them, 16 bits
// each.
template <typename Store>
void gen_plain(const Gen& g, uint64_t first, uint64_t count, uint8_t* out, size_t elem_bytes,
               Store store) {
  for (uint64_t b = 0; b < count; ++b) {
    BlockRng rng(g.key, first + b);
    std::array<uint16_t, kPlainBlockElems> u{};
    rng.fill(reinterpret_cast<uint8_t*>(u.data()), kPlainBlockElems / 4);
    std::array<float, kPlainBlockElems> v{};
    for (uint32_t i = 0; i < kPlainBlockElems; ++i) {
      const float r = static_cast<float>(2 * int32_t{u[i]} + 1 - 65536) * (1.0f / 65536.0f);
      v[i] = g.center + g.amplitude * r;
    }
    store(out + b * kPlainBlockElems * elem_bytes, v);
  }
}

// block_q8_0 { f16 d; int8 qs[32]; }: qs uniform in [-127, 127] (0x80 = -128 becomes -127, as
// ggml's quantiser never emits -128).
void gen_q8_0(const Gen& g, uint64_t first, uint64_t count, uint8_t* out) {
  constexpr uint64_t kLow7 = 0x7f7f7f7f7f7f7f7full;
  const float base = g.qamp / 127.0f;
  for (uint64_t b = 0; b < count; ++b) {
    uint8_t* blk = out + b * 34;
    BlockRng rng(g.key, first + b);
    store_u16(blk, f16_scale(base, rng.next()));
    for (int i = 0; i < 4; ++i) {
      uint64_t w = rng.next();
      // Bytes equal to 0x80: y has a zero byte there; `zero` gets its high bit set exactly there.
      const uint64_t y = w ^ 0x8080808080808080ull;
      const uint64_t zero = ~(((y & kLow7) + kLow7) | y | kLow7);
      w |= zero >> 7;
      std::memcpy(blk + 2 + 8 * i, &w, 8);
    }
  }
}

// block_q4_0 { f16 d; u8 qs[16]; }: values (q - 8) * d. A quant of 0 (-8) becomes 8 (0), so the
// values are symmetric around zero as a quantised zero-mean tensor's are.
void gen_q4_0(const Gen& g, uint64_t first, uint64_t count, uint8_t* out) {
  constexpr uint64_t kLow3 = 0x7777777777777777ull;
  const float base = g.qamp / 7.0f;
  for (uint64_t b = 0; b < count; ++b) {
    uint8_t* blk = out + b * 18;
    BlockRng rng(g.key, first + b);
    store_u16(blk, f16_scale(base, rng.next()));
    for (int i = 0; i < 2; ++i) {
      uint64_t w = rng.next();
      // `zero` has bit 3 set exactly in the nibbles of w that are 0.
      const uint64_t zero = ~(((w & kLow3) + kLow3) | w | kLow3);
      w |= zero;
      std::memcpy(blk + 2 + 8 * i, &w, 8);
    }
  }
}

// block_q4_K { f16 d; f16 dmin; u8 scales[12]; u8 qs[128]; }: 8 sub-blocks of 32 with 6-bit
// scale sc and min m; values d*sc*q - dmin*m, q in 0..15. sc in 32..63, dmin = 8d and
// m = round(15*sc/16) centre every sub-block on zero: d*sc*(q - 7.5) (+- d/2).
void gen_q4_k(const Gen& g, uint64_t first, uint64_t count, uint8_t* out) {
  const float base = g.qamp / 472.5f;  // 63 * 7.5: the largest |value| is ~qamp
  for (uint64_t b = 0; b < count; ++b) {
    uint8_t* blk = out + b * 144;
    BlockRng rng(g.key, first + b);
    const uint64_t w = rng.next();
    const uint16_t d = f16_scale(base, w);
    uint16_t dmin = float_to_f16(f16_to_float(d) * 8.0f);
    if (dmin == 0) dmin = 1;
    store_u16(blk, d);
    store_u16(blk + 2, dmin);
    std::array<uint8_t, 8> sc{};
    std::array<uint8_t, 8> m{};
    for (int j = 0; j < 8; ++j) {
      sc[j] = static_cast<uint8_t>(32 + ((w >> (16 + 5 * j)) & 31u));
      m[j] = static_cast<uint8_t>((sc[j] * 15 + 8) >> 4);
    }
    // The inverse of ggml's get_scale_min_k4.
    uint8_t* q = blk + 4;
    for (int j = 0; j < 4; ++j) {
      q[j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
      q[j + 4] = static_cast<uint8_t>(m[j] | ((m[j + 4] >> 4) << 6));
      q[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0xf) | ((m[j + 4] & 0xf) << 4));
    }
    rng.fill(blk + 16, 16);
  }
}

// block_q6_K { u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d; }: 16 sub-blocks of 16; values
// d*scale*(q - 32), q in 0..63. Scales in 64..127.
void gen_q6_k(const Gen& g, uint64_t first, uint64_t count, uint8_t* out) {
  const float base = g.qamp / (127.0f * 32.0f);
  for (uint64_t b = 0; b < count; ++b) {
    uint8_t* blk = out + b * 210;
    BlockRng rng(g.key, first + b);
    const uint16_t d = f16_scale(base, rng.next());
    rng.fill(blk, 24);  // ql and qh: every bit pattern is a valid 6-bit quant
    for (int i = 0; i < 2; ++i) {
      const uint64_t w = (rng.next() & 0x3f3f3f3f3f3f3f3full) | 0x4040404040404040ull;
      std::memcpy(blk + 192 + 8 * i, &w, 8);
    }
    store_u16(blk + 208, d);
  }
}

// block_mxfp4 { u8 e; u8 qs[16]; }: values kvalue * 2^(e - 128), kvalue in +-{0, 1, 2, 3, 4, 6,
// 8, 12} (ggml's kvalues_mxfp4 with its half e8m0 scale). e makes 2^(e - 128) the power of two at
// or below qamp * jitter / 12, so the largest |value| is at most 1.25 qamp and above 0.375 qamp;
// qs is random (every nibble is a valid e2m1 value, 8 being -0).
void gen_mxfp4(const Gen& g, uint64_t first, uint64_t count, uint8_t* out) {
  const float base = g.qamp / 12.0f;
  for (uint64_t b = 0; b < count; ++b) {
    uint8_t* blk = out + b * 17;
    BlockRng rng(g.key, first + b);
    const float v = base * scale_jitter(rng.next());
    uint32_t bits = 0;
    std::memcpy(&bits, &v, sizeof(bits));
    // floor(log2 v) + 128 for a normal v; kept within 2..254, ggml's normal, finite scales.
    blk[0] = static_cast<uint8_t>(std::clamp<uint32_t>(((bits >> 23) & 0xffu) + 1, 2, 254));
    rng.fill(blk + 1, 2);
  }
}

// Bytes of one generation block: a quantized block, or kPlainBlockElems plain elements.
uint64_t unit_bytes(GgmlType type) {
  const GgmlTypeTraits& t = ggml_traits(type);
  return t.block_elems == 1 ? uint64_t{kPlainBlockElems} * t.block_bytes : t.block_bytes;
}

void gen_units(const Gen& g, uint64_t first, uint64_t count, uint8_t* out) {
  switch (g.type) {
    case GgmlType::F32:
      gen_plain(g, first, count, out, 4,
                [](uint8_t* p, const PlainBlock& v) { std::memcpy(p, v.data(), sizeof(v)); });
      break;
    case GgmlType::F16:
      gen_plain(g, first, count, out, 2, [](uint8_t* p, const PlainBlock& v) {
        std::array<uint16_t, kPlainBlockElems> h;
        for (uint32_t i = 0; i < kPlainBlockElems; ++i) h[i] = float_to_f16(v[i]);
        std::memcpy(p, h.data(), sizeof(h));
      });
      break;
    case GgmlType::BF16:
      gen_plain(g, first, count, out, 2, [](uint8_t* p, const PlainBlock& v) {
        std::array<uint16_t, kPlainBlockElems> h;
        for (uint32_t i = 0; i < kPlainBlockElems; ++i) h[i] = float_to_bf16(v[i]);
        std::memcpy(p, h.data(), sizeof(h));
      });
      break;
    case GgmlType::Q8_0:
      gen_q8_0(g, first, count, out);
      break;
    case GgmlType::Q4_0:
      gen_q4_0(g, first, count, out);
      break;
    case GgmlType::Q4_K:
      gen_q4_k(g, first, count, out);
      break;
    case GgmlType::Q6_K:
      gen_q6_k(g, first, count, out);
      break;
    case GgmlType::MXFP4:
      gen_mxfp4(g, first, count, out);
      break;
    default:
      EXPERTD_UNREACHABLE("checked by forge_supports_type");
      break;
  }
}

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

uint64_t tensor_key(uint64_t seed, std::string_view name) {
  return mix64(mix64(seed + kGolden) ^ fnv1a64(name));
}

// A hash-routing table: row r (token r) is `per_row` distinct experts of `experts`, drawn from
// the block generator of index r: e = (high 32 bits of a word) * experts >> 32, redrawn while it
// repeats an earlier entry of the row. Stored as little-endian i32. Writes the bytes
// [byte_offset, byte_offset + out.size()) of the table.
void gen_hash_rows(uint64_t key, uint64_t per_row, uint32_t experts, uint64_t byte_offset,
                   std::span<uint8_t> out) {
  const uint64_t row_bytes = per_row * 4;
  std::vector<int32_t> row(per_row);
  uint64_t pos = byte_offset;
  uint64_t done = 0;
  while (done < out.size()) {
    const uint64_t r = pos / row_bytes;
    BlockRng rng(key, r);
    for (uint64_t j = 0; j < per_row; ++j) {
      int32_t e = 0;
      do {
        e = static_cast<int32_t>(((rng.next() >> 32) * experts) >> 32);
      } while (std::find(row.begin(), row.begin() + static_cast<ptrdiff_t>(j), e) !=
               row.begin() + static_cast<ptrdiff_t>(j));
      row[j] = e;
    }
    const uint64_t skip = pos % row_bytes;
    const uint64_t take = std::min(row_bytes - skip, out.size() - done);
    std::memcpy(out.data() + done, reinterpret_cast<const uint8_t*>(row.data()) + skip, take);
    pos += take;
    done += take;
  }
}

}  // namespace

bool forge_supports_type(GgmlType type) {
  switch (type) {
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16:
    case GgmlType::Q8_0:
    case GgmlType::Q4_0:
    case GgmlType::Q4_K:
    case GgmlType::Q6_K:
    case GgmlType::MXFP4:
      return true;
    default:
      return false;
  }
}

bool forge_is_hash_table(std::string_view name) {
  return name.starts_with("blk.") && ends_with(name, ".ffn_gate_tid2eid.weight");
}

ForgeValueRange forge_value_range(std::string_view name, uint64_t ne0) {
  if (ends_with(name, "norm.weight")) return {1.0f, 1.0f / 16.0f};
  // deepseek4 (names no qwen3moe forge writes, so version 1's qwen3moe bytes are unchanged): the
  // hyper-connection scales multiply the mixer logits, so they sit near 1; the mixers, their
  // bases, the compressors' position embeddings, the attention sinks and the routing biases are
  // additive terms that a sane forward keeps small.
  const bool hc = name.find("hc_") != std::string_view::npos;
  if (hc && ends_with(name, "scale.weight")) return {1.0f, 1.0f / 16.0f};
  if (hc || ends_with(name, "compressor_ape.weight") || ends_with(name, "attn_sinks.weight") ||
      ends_with(name, "exp_probs_b.bias")) {
    return {0.0f, 1.0f / 128.0f};
  }
  return {0.0f,
          static_cast<float>(std::sqrt(3.0 / static_cast<double>(std::max<uint64_t>(ne0, 1))))};
}

Status forge_expected_bytes(uint64_t seed, const GgufTensorInfo& t, uint64_t byte_offset,
                            std::span<uint8_t> out, uint32_t expert_count) {
  const bool hash_table = t.type == GgmlType::I32 && forge_is_hash_table(t.name);
  if (!forge_supports_type(t.type) && !hash_table) {
    return make_error(EINVAL, fmt::format("tensor '{}': the forge cannot generate type {}", t.name,
                                          ggml_type_name(t.type)));
  }
  const auto row = ggml_row_bytes(t.type, t.ne[0]);
  uint64_t bytes = row.value_or(0);
  bool overflow = !row;
  for (uint32_t d = 1; d < kGgufMaxDims; ++d) {
    overflow = overflow || __builtin_mul_overflow(bytes, t.ne[d], &bytes);
  }
  if (overflow || byte_offset > bytes || out.size() > bytes - byte_offset) {
    return make_error(EINVAL, fmt::format("tensor '{}': bytes [{}, +{}) are outside its {} bytes",
                                          t.name, byte_offset, out.size(), bytes));
  }
  const uint64_t key = tensor_key(seed, t.name);
  if (hash_table) {
    if (expert_count == 0 || t.ne[0] > expert_count) {
      return make_error(EINVAL, fmt::format("tensor '{}': a hash-routing table of {} experts per "
                                            "token needs the model's expert count (got {})",
                                            t.name, t.ne[0], expert_count));
    }
    gen_hash_rows(key, t.ne[0], expert_count, byte_offset, out);
    return Ok{};
  }
  const ForgeValueRange range = forge_value_range(t.name, t.ne[0]);
  const Gen g{t.type, key, range.center, range.amplitude,
              std::fabs(range.center) + range.amplitude};
  const uint64_t unit = unit_bytes(t.type);
  std::array<uint8_t, 256> tmp{};
  EXPERTD_CHECK_LE(unit, tmp.size());

  uint64_t pos = byte_offset;
  uint8_t* dst = out.data();
  uint64_t left = out.size();
  // A partial unit at the start (or a range inside one unit).
  if (left > 0 && pos % unit != 0) {
    gen_units(g, pos / unit, 1, tmp.data());
    const uint64_t skip = pos % unit;
    const uint64_t take = std::min(unit - skip, left);
    std::memcpy(dst, tmp.data() + skip, take);
    pos += take;
    dst += take;
    left -= take;
  }
  const uint64_t whole = left / unit;
  gen_units(g, pos / unit, whole, dst);
  pos += whole * unit;
  dst += whole * unit;
  left -= whole * unit;
  if (left > 0) {  // a partial unit at the end
    gen_units(g, pos / unit, 1, tmp.data());
    std::memcpy(dst, tmp.data(), left);
  }
  return Ok{};
}

Result<ForgeInfo> forge_info(const GgufFile& file) {
  const GgufValue* seed = file.find(kForgeSeedKey);
  const GgufValue* version = file.find(kForgeVersionKey);
  if (seed == nullptr || version == nullptr) {
    return make_error(EINVAL, fmt::format("{}: not a forged model: no {} key", file.path(),
                                          seed == nullptr ? kForgeSeedKey : kForgeVersionKey));
  }
  const auto s = seed->as_u64();
  const auto v = version->as_u64();
  if (!s || seed->type == GgufValueType::BOOL || !v || version->type == GgufValueType::BOOL) {
    return make_error(EINVAL, fmt::format("{}: not a forged model: {} and {} must be integers",
                                          file.path(), kForgeSeedKey, kForgeVersionKey));
  }
  if (*v != kForgeVersion) {
    return make_error(EINVAL, fmt::format("{}: forged with content version {}; this build "
                                          "recomputes version {} only",
                                          file.path(), *v, kForgeVersion));
  }
  ForgeInfo info{*s, static_cast<uint32_t>(*v), 0};
  if (const GgufValue* arch = file.find("general.architecture"); arch && arch->as_string()) {
    if (const GgufValue* n = file.find(*arch->as_string() + ".expert_count")) {
      info.expert_count = static_cast<uint32_t>(n->as_u64().value_or(0));
    }
  }
  return info;
}

Result<ForgeInfo> forge_info(const GgufModel& model) { return forge_info(model.meta()); }

}  // namespace expertd
