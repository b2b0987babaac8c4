// The matvec of the quantised ggml formats. docs/KERNELS.md explains the shape of the matvec
// kernels; in short:
//
// Quantised types (Q8_0, Q4_K, Q6_K, MXFP4): a group of L lanes (4..32) per R rows (1, or 4 for
// Q4_K and MXFP4). The group copies its rows in tiles of whole blocks from global memory to shared
// memory with the widest loads the alignment allows (Q8_0 and Q6_K blocks are only 2-byte aligned,
// MXFP4's 17-byte blocks 1-byte aligned, so the data cannot be read in place with wide loads), the
// next tile in flight (in registers, or by cp.async for Q4_K and MXFP4) while it computes the
// current one. Each lane then handles "units" of 64 weights: the
// integer quants are multiplied with x by __dp4a, x having been split once per block into three
// int8 digit planes,
//     x = s * (a + b / 254 + c / 254^2),   s = max|x| / 127 over 16 or 32 elements,
// which represents x to about 2^-24 of its group's largest magnitude, as good as a float. That
// keeps the per-weight work at about one integer instruction: float conversions of every quant
// (the I2F pipe runs at 1/8 of the FMA rate) would make a 4-bit matvec compute bound on an H200.
#include "kernels/matvec_quant.cuh"
// The own header first (STYLE.md), then the internal ones of kernels/.
#include <cooperative_groups.h>

#include <atomic>
#include <cstdio>
#include <type_traits>

#include "kernels/blocks.cuh"
#include "kernels/matvec_common.cuh"

namespace expertd::kernels {
namespace {

namespace cg = cooperative_groups;
using detail::half_bits_to_float;
using detail::kFull;
using detail::kThreads;
using detail::kWarps;
using detail::LaunchCache;
using detail::LaunchShape;
using detail::plan_launch;
using detail::pointer_bits;
using detail::swiglu_value;
using detail::vec_bytes;
using detail::VecOf;

// Quantised matvec: x as digit planes.
//
// The row is cut into units of 64 weights (a lane's work); unit u of every row uses the same 64
// elements of x, whose digits live in shared memory slot u:
//   bytes   0..63   digit a of the unit's 64 positions, 64..127 digit b, 128..191 digit c;
//   bytes 192..207  four floats: the scale s of positions 16i..16i+15;
//   bytes 208..223  four floats: the plain sum of x over positions 16i..16i+15;
//   bytes 224..239  padding: a 60-word stride makes the slots a warp reads conflict-free.
// Position p of unit u is element F::element(u, p) of x (the order in which the format's quants
// of that unit come in 4-byte words).

constexpr uint32_t kSlotBytes = 240;
constexpr uint32_t kSlotScales = 192;
constexpr uint32_t kSlotSums = 208;
constexpr uint32_t kMinRowsPerCta = 32;     // amortises the digit planes each CTA builds
constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds |v| < 2^22 to an integer
constexpr float kDigitBase = 254.0f;        // b and c stay within [-127, 127]
constexpr float kTinyGroup = 0x1p-100f;     // groups below this count as zero

// Splits v (|v| <= 127) into three digits a, b, c in [-127, 127], v ~ a + b/254 + c/254^2 to
// within 0.5/254^2, each returned in the low byte of a word (the integer the magic addition
// leaves in the low mantissa bits, two's complement). v - a and r - b are exact.
__device__ __forceinline__ void split_digits(float v, uint32_t* a, uint32_t* b, uint32_t* c) {
  float t = __fadd_rn(v, kRoundMagic);
  *a = __float_as_uint(t);
  float r = __fmul_rn(__fsub_rn(v, __fsub_rn(t, kRoundMagic)), kDigitBase);
  t = __fadd_rn(r, kRoundMagic);
  *b = __float_as_uint(t);
  r = __fmul_rn(__fsub_rn(r, __fsub_rn(t, kRoundMagic)), kDigitBase);
  *c = __float_as_uint(__fadd_rn(r, kRoundMagic));
}

// The low bytes of four words, packed.
__device__ __forceinline__ uint32_t pack_low_bytes(uint32_t v0, uint32_t v1, uint32_t v2,
                                                   uint32_t v3) {
  return __byte_perm(__byte_perm(v0, v1, 0x0040), __byte_perm(v2, v3, 0x0040), 0x5410);
}

// One pass of prepare_x for quad qd (x values v, zero past the end): its digits, and with its
// scale group's other quads the group's scale and sums. Every lane must call it (it shuffles).
template <class F>
__device__ __forceinline__ void prepare_quad(const float* v, uint32_t qd, uint32_t quads,
                                             uint8_t* xs) {
  const uint32_t u = qd / 16;
  const uint32_t k = qd % 16;
  float mx = 0.0f;
  uint32_t bad = 0;
#pragma unroll
  for (uint32_t i = 0; i < 4; ++i) {
    mx = fmaxf(mx, fabsf(v[i]));
    bad |= isfinite(v[i]) ? 0u : 1u;
  }
  float sum = (v[0] + v[1]) + (v[2] + v[3]);
#pragma unroll
  for (uint32_t o = 1; o < F::kScaleGroup / 4; o <<= 1) {
    mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, o));
    bad |= __shfl_xor_sync(kFull, bad, o);
  }
#pragma unroll
  for (uint32_t o = 1; o < 4; o <<= 1) sum += __shfl_xor_sync(kFull, sum, o);
  // x * (127 / mx) is at most 127 * (1 + 2^-23) in magnitude, so its digits fit in int8. Groups
  // below 2^-100 count as zero (they cannot move a float sum); a NaN or infinity makes the
  // group's scale NaN, so the row's result is NaN as on the CPU.
  float mul = 0.0f;
  float s = 0.0f;
  if (bad != 0) {
    s = __uint_as_float(0x7fc00000u);
  } else if (mx >= kTinyGroup) {
    mul = 127.0f / mx;
    s = mx / 127.0f;
  }
  if (qd < quads) {
    uint32_t a[4];
    uint32_t b[4];
    uint32_t c[4];
#pragma unroll
    for (uint32_t i = 0; i < 4; ++i) split_digits(__fmul_rn(v[i], mul), &a[i], &b[i], &c[i]);
    uint8_t* slot = xs + u * kSlotBytes;
    reinterpret_cast<uint32_t*>(slot)[k] = pack_low_bytes(a[0], a[1], a[2], a[3]);
    reinterpret_cast<uint32_t*>(slot + 64)[k] = pack_low_bytes(b[0], b[1], b[2], b[3]);
    reinterpret_cast<uint32_t*>(slot + 128)[k] = pack_low_bytes(c[0], c[1], c[2], c[3]);
    if (k % 4 == 0) {
      reinterpret_cast<float*>(slot + kSlotScales)[k / 4] = s;
      reinterpret_cast<float*>(slot + kSlotSums)[k / 4] = sum;
    }
  }
}

// Fills the x slots of units u0 .. u0 + units - 1 (slot 0 is unit u0). Thread t of a pass takes
// positions 4k..4k+3 of one unit (k = t % 16), so the kScaleGroup/4 threads of a scale group are
// adjacent lanes of one warp. Position 4k + i is element F::element(u, 4k) + F::quad_offset(i) of
// x. Elements past `cols` (the second half of a Q8_0 or MXFP4 row's last unit) get zero digits,
// scale and sum. With `up` the vector is silu(x) * up (MatvecBatch::up).
template <class F>
__device__ void prepare_x(const float* x, const float* up, uint32_t cols, uint32_t u0,
                          uint32_t units, uint8_t* xs) {
  const uint32_t quads = units * 16;
  // The loads of kPrepBatch passes are issued together: one pass at a time would wait for a round
  // trip to L2 per pass, about 5 us for a 14336-element x, with little else in flight.
  constexpr uint32_t kPrepBatch = 4;
  for (uint32_t batch = 0; batch < quads; batch += kPrepBatch * kThreads) {
    float vb[kPrepBatch][4];
#pragma unroll
    for (uint32_t j = 0; j < kPrepBatch; ++j) {
      const uint32_t qd = batch + j * kThreads + threadIdx.x;
#pragma unroll
      for (uint32_t i = 0; i < 4; ++i) vb[j][i] = 0.0f;
      if (qd < quads) {
        const uint32_t e = F::element(u0 + qd / 16, 4 * (qd % 16));
        if (e < cols) {
          if (up == nullptr) {
#pragma unroll
            for (uint32_t i = 0; i < 4; ++i) vb[j][i] = x[e + F::quad_offset(i)];
          } else {
#pragma unroll
            for (uint32_t i = 0; i < 4; ++i) {
              vb[j][i] = swiglu_value(x[e + F::quad_offset(i)], up[e + F::quad_offset(i)]);
            }
          }
        }
      }
    }
#pragma unroll
    for (uint32_t j = 0; j < kPrepBatch; ++j) {
      prepare_quad<F>(vb[j], batch + j * kThreads + threadIdx.x, quads, xs);
    }
  }
}

// The 16 words of each digit plane of a slot.
struct Planes {
  uint32_t a[16];
  uint32_t b[16];
  uint32_t c[16];
};

__device__ __forceinline__ void load_planes(const uint8_t* slot, Planes* p) {
  const uint4* s = reinterpret_cast<const uint4*>(slot);
#pragma unroll
  for (uint32_t i = 0; i < 4; ++i) {
    const uint4 va = s[i];
    const uint4 vb = s[4 + i];
    const uint4 vc = s[8 + i];
    p->a[4 * i] = va.x;
    p->a[4 * i + 1] = va.y;
    p->a[4 * i + 2] = va.z;
    p->a[4 * i + 3] = va.w;
    p->b[4 * i] = vb.x;
    p->b[4 * i + 1] = vb.y;
    p->b[4 * i + 2] = vb.z;
    p->b[4 * i + 3] = vb.w;
    p->c[4 * i] = vc.x;
    p->c[4 * i + 1] = vc.y;
    p->c[4 * i + 2] = vc.z;
    p->c[4 * i + 3] = vc.w;
  }
}

// Integer dot products of four quants (bytes of q) with the digits of plane word i.
struct DigitSums {
  int a = 0;
  int b = 0;
  int c = 0;
  __device__ __forceinline__ void add(uint32_t q, const Planes& p, uint32_t i) {
    a = __dp4a(static_cast<int>(q), static_cast<int>(p.a[i]), a);
    b = __dp4a(static_cast<int>(q), static_cast<int>(p.b[i]), b);
    c = __dp4a(static_cast<int>(q), static_cast<int>(p.c[i]), c);
  }
  // sum q * x / s over the positions added.
  __device__ __forceinline__ float total() const {
    return static_cast<float>(a) + static_cast<float>(b) * (1.0f / kDigitBase) +
           static_cast<float>(c) * (1.0f / (kDigitBase * kDigitBase));
  }
};

// block_q4_K: a unit is one 32-byte chunk c of qs, i.e. elements 64c..64c+63 of the block (low
// nibbles: positions 0..31, scale 2c; high nibbles: positions 32..63, scale 2c + 1). Four units
// per block; blocks (144 bytes) stay 16-byte aligned in the tile.
struct Q4K {
  static constexpr uint32_t kBlockElems = 256;
  static constexpr uint32_t kBlockBytes = 144;
  static constexpr uint32_t kScaleGroup = 32;
  static constexpr uint32_t kUnitsPerLane = 1;
  static constexpr uint32_t kRows = 4;
  static constexpr uint32_t kStages = 2;
  static constexpr uint32_t kMinCtasPerSm = 2;
  static constexpr uint32_t tile_blocks(uint32_t lanes) { return kUnitsPerLane * lanes / 4; }
  static constexpr uint32_t units(uint32_t blocks) { return blocks * 4; }
  static __device__ __forceinline__ uint32_t element(uint32_t u, uint32_t p) { return 64 * u + p; }
  static constexpr __device__ uint32_t quad_offset(uint32_t i) { return i; }

  static __device__ __forceinline__ float unit_dot(const uint8_t* tile, uint32_t uu,
                                                   const Planes& p, const uint8_t* slot,
                                                   uint32_t /*ur*/, uint32_t /*blocks*/) {
    const uint8_t* blk = tile + (uu / 4) * kBlockBytes;
    const uint32_t c = uu % 4;
    const uint32_t dm = *reinterpret_cast<const uint32_t*>(blk);
    const float d = half_bits_to_float(dm);
    const float dmin = half_bits_to_float(dm >> 16);
    // The 6-bit scales and mins of sub-blocks 2c and 2c + 1, one per byte (ggml's unpacking of
    // get_scale_min_k4 for a pair): sc16[i] holds scale bytes 2i and 2i + 1.
    const uint16_t* sc16 = reinterpret_cast<const uint16_t*>(blk + 4);
    const uint32_t s_a = sc16[c];
    const uint32_t s_b = sc16[c + 2];
    const uint32_t s_c = sc16[c & 1];  // sc16[c - 2] when c >= 2
    const bool low = c < 2;
    const uint32_t scales = low ? (s_a & 0x3f3fu) : ((s_b & 0x0f0fu) | ((s_c & 0xc0c0u) >> 2));
    const uint32_t mins = low ? (s_b & 0x3f3fu) : (((s_b >> 4) & 0x0f0fu) | ((s_a & 0xc0c0u) >> 2));
    const uint4* qp = reinterpret_cast<const uint4*>(blk + 16 + 32 * c);
    const uint4 q0 = qp[0];
    const uint4 q1 = qp[1];
    const uint32_t qw[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
    DigitSums lo;
    DigitSums hi;
#pragma unroll
    for (uint32_t k = 0; k < 8; ++k) {
      lo.add(qw[k] & 0x0f0f0f0fu, p, k);
      hi.add((qw[k] >> 4) & 0x0f0f0f0fu, p, 8 + k);
    }
    const float4 s = *reinterpret_cast<const float4*>(slot + kSlotScales);
    const float4 sum = *reinterpret_cast<const float4*>(slot + kSlotSums);
    const float r_lo = d * static_cast<float>(scales & 0xffu) * (s.x * lo.total()) -
                       dmin * static_cast<float>(mins & 0xffu) * (sum.x + sum.y);
    const float r_hi = d * static_cast<float>(scales >> 8) * (s.z * hi.total()) -
                       dmin * static_cast<float>(mins >> 8) * (sum.z + sum.w);
    return r_lo + r_hi;
  }
};

// block_q8_0: a unit is two blocks (68 bytes, 4-byte aligned in the tile): positions 0..31 the
// first block's quants, 32..63 the second's. The last unit of a row with an odd block count has
// only the first.
struct Q80 {
  static constexpr uint32_t kBlockElems = 32;
  static constexpr uint32_t kBlockBytes = 34;
  static constexpr uint32_t kScaleGroup = 32;
  static constexpr uint32_t kUnitsPerLane = 1;
  static constexpr uint32_t kRows = 1;
  static constexpr uint32_t kStages = 0;
  static constexpr uint32_t kMinCtasPerSm = 3;
  static constexpr uint32_t tile_blocks(uint32_t lanes) { return 2 * kUnitsPerLane * lanes; }
  static constexpr uint32_t units(uint32_t blocks) { return (blocks + 1) / 2; }
  static __device__ __forceinline__ uint32_t element(uint32_t u, uint32_t p) { return 64 * u + p; }
  static constexpr __device__ uint32_t quad_offset(uint32_t i) { return i; }

  static __device__ __forceinline__ float unit_dot(const uint8_t* tile, uint32_t uu,
                                                   const Planes& p, const uint8_t* slot,
                                                   uint32_t ur, uint32_t blocks) {
    const uint32_t* wp = reinterpret_cast<const uint32_t*>(tile + uu * 2 * kBlockBytes);
    uint32_t w[17];
#pragma unroll
    for (uint32_t i = 0; i < 17; ++i) w[i] = wp[i];
    // Bytes 0-1: d of the first block, 2..33 its quants, 34-35 the second d, 36..67 its quants.
    const float d0 = half_bits_to_float(w[0]);
    const float d1 = half_bits_to_float(w[8] >> 16);
    DigitSums first;
    DigitSums second;
#pragma unroll
    for (uint32_t k = 0; k < 8; ++k) {
      first.add(__funnelshift_r(w[k], w[k + 1], 16), p, k);
      second.add(w[9 + k], p, 8 + k);
    }
    const float4 s = *reinterpret_cast<const float4*>(slot + kSlotScales);
    float r = d0 * (s.x * first.total());
    if (2 * ur + 1 < blocks) r += d1 * (s.z * second.total());
    return r;
  }
};

// block_q6_K: a unit is (half h, l-half lh) of a block: l = 16lh..16lh+15 of all four quarters of
// half h, i.e. positions 16q + i are element 128h + 32q + 16lh + i. Its bytes: ql[64h + 16lh..],
// ql[64h + 32 + 16lh..], qh[32h + 16lh..] (16 each), scales[8h + lh + 2q] and d. Blocks are 210
// bytes, so a block in the tile is 4-byte aligned or 2 off; words are read aligned and funnel
// shifted.
struct Q6K {
  static constexpr uint32_t kBlockElems = 256;
  static constexpr uint32_t kBlockBytes = 210;
  static constexpr uint32_t kScaleGroup = 16;
  static constexpr uint32_t kUnitsPerLane = 2;
  static constexpr uint32_t kRows = 1;
  static constexpr uint32_t kStages = 0;
  static constexpr uint32_t kMinCtasPerSm = 2;  // three would spill
  static constexpr uint32_t tile_blocks(uint32_t lanes) { return kUnitsPerLane * lanes / 4; }
  static constexpr uint32_t units(uint32_t blocks) { return blocks * 4; }
  static __device__ __forceinline__ uint32_t element(uint32_t u, uint32_t p) {
    return 256 * (u / 4) + 128 * ((u >> 1) & 1u) + 32 * (p / 16) + 16 * (u & 1u) + p % 16;
  }
  static constexpr __device__ uint32_t quad_offset(uint32_t i) { return i; }

  // Four words at byte offset 4 * wi of a block whose first byte is `shift` / 8 bytes past the
  // aligned word `base`.
  static __device__ __forceinline__ void read4(const uint32_t* base, uint32_t wi, uint32_t shift,
                                               uint32_t* out) {
    uint32_t t[5];
#pragma unroll
    for (uint32_t i = 0; i < 5; ++i) t[i] = base[wi + i];
#pragma unroll
    for (uint32_t i = 0; i < 4; ++i) out[i] = __funnelshift_r(t[i], t[i + 1], shift);
  }

  static __device__ __forceinline__ float unit_dot(const uint8_t* tile, uint32_t uu,
                                                   const Planes& p, const uint8_t* slot,
                                                   uint32_t /*ur*/, uint32_t /*blocks*/) {
    const uint32_t off = (uu / 4) * kBlockBytes;
    const uint32_t h = (uu >> 1) & 1u;
    const uint32_t lh = uu & 1u;
    const uint8_t* blk = tile + off;
    const uint32_t* base = reinterpret_cast<const uint32_t*>(tile + (off & ~3u));
    const uint32_t shift = (off & 2u) * 8;
    uint32_t l0[4];
    uint32_t l1[4];
    uint32_t qh[4];
    read4(base, 16 * h + 4 * lh, shift, l0);      // ql[64h + 16lh ..]
    read4(base, 16 * h + 8 + 4 * lh, shift, l1);  // ql[64h + 32 + 16lh ..]
    read4(base, 32 + 8 * h + 4 * lh, shift, qh);  // qh[32h + 16lh ..]
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192 + 8 * h + lh);
    const float d = half_bits_to_float(*reinterpret_cast<const uint16_t*>(blk + 208));
    DigitSums quarter[4];
#pragma unroll
    for (uint32_t k = 0; k < 4; ++k) {
      quarter[0].add((l0[k] & 0x0f0f0f0fu) | ((qh[k] << 4) & 0x30303030u), p, k);
      quarter[1].add((l1[k] & 0x0f0f0f0fu) | ((qh[k] << 2) & 0x30303030u), p, 4 + k);
      quarter[2].add(((l0[k] >> 4) & 0x0f0f0f0fu) | (qh[k] & 0x30303030u), p, 8 + k);
      quarter[3].add(((l1[k] >> 4) & 0x0f0f0f0fu) | ((qh[k] >> 2) & 0x30303030u), p, 12 + k);
    }
    const float4 s4 = *reinterpret_cast<const float4*>(slot + kSlotScales);
    const float4 sum4 = *reinterpret_cast<const float4*>(slot + kSlotSums);
    const float s[4] = {s4.x, s4.y, s4.z, s4.w};
    const float sum[4] = {sum4.x, sum4.y, sum4.z, sum4.w};
    float r = 0.0f;
#pragma unroll
    for (uint32_t q = 0; q < 4; ++q) {
      // The quants are stored +32: sum (q6 - 32) x = s * sum q6 x/s - 32 * sum x.
      r += d * static_cast<float>(sc[2 * q]) * (s[q] * quarter[q].total() - 32.0f * sum[q]);
    }
    return r;
  }
};

// Q6_K as the q6r2 variants take it: two rows per group share each unit's digit planes (Q6K's one
// row reads 192 bytes of planes per 52.5 bytes of weights, 3.7 bytes of shared-memory traffic per
// weight byte before the tile's own store and load), one unit per lane, and tiles reach shared
// memory by a cp.async ring of three (two in flight), so the second row costs no registers. The
// ring is 80 KB per CTA, as Q4_K's, leaving two CTAs per SM beside the planes of 4,096 columns or
// of a split's slice. Only for groups of 16 or 32 lanes and 16-byte aligned rows (dispatch_wide).
struct Q6KR2 : Q6K {
  static constexpr uint32_t kUnitsPerLane = 1;
  static constexpr uint32_t kRows = 2;
  static constexpr uint32_t kStages = 3;
  static constexpr uint32_t kMinCtasPerSm = 2;
  static constexpr uint32_t tile_blocks(uint32_t lanes) { return kUnitsPerLane * lanes / 4; }
};

// prmt.b32 in its default mode: byte n of the result is byte (sel >> 4n) & 7 of {hi, lo}, or, when
// bit 3 of that selector nibble is set, that byte's sign bit repeated over the byte.
__device__ __forceinline__ uint32_t permute_bytes(uint32_t lo, uint32_t hi, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(lo), "r"(hi), "r"(sel));
  return r;
}

// The int8 kvalues of the four MXFP4 nibbles in selector bits 0..15 of `sel`; `flipped` is sel
// with every sign bit (bit 3 of each nibble) inverted. The magnitude table has no byte with its top
// bit set, so a permute with a nibble's sign bit set yields 0 there: `pos` holds the magnitudes of
// the positive nibbles, `neg` those of the negative ones, and 0x80 - m, xor 0x80, is -m in each
// byte without a borrow between bytes (m <= 12).
__device__ __forceinline__ uint32_t e2m1_quads(uint32_t sel, uint32_t flipped) {
  const uint32_t pos = permute_bytes(detail::kE2m1Lo, detail::kE2m1Hi, sel);
  const uint32_t neg = permute_bytes(detail::kE2m1Lo, detail::kE2m1Hi, flipped);
  return ((0x80808080u - neg) ^ 0x80808080u) | pos;
}

// block_mxfp4 { u8 e; u8 qs[16]; }: element j < 16 of a block is the low nibble of qs[j], j + 16
// the high nibble, value kvalue * 2^(e - 128). A unit is two blocks (34 bytes, 2-byte aligned in
// the tile, as Q8_0's 68). The nibbles of a qs word k, in selector order (low and high nibble of
// byte 0, then byte 1, ...), are elements 4k, 4k+16, 4k+1, 4k+17, 4k+2, 4k+18, 4k+3, 4k+19, and
// one permute turns four of them into int8 quants: so position 8k + 4h + i of a block's 32 is
// element 4k + 2h + {0, 16, 1, 17}[i], and x's digit planes are built in that order. The last unit
// of a row with an odd block count has only the first block. Four rows per group share each unit's
// planes, as for Q4_K (the same shared-memory traffic per weight byte).
struct Mxfp4 {
  static constexpr uint32_t kBlockElems = 32;
  static constexpr uint32_t kBlockBytes = 17;
  static constexpr uint32_t kScaleGroup = 32;
  static constexpr uint32_t kUnitsPerLane = 1;
  static constexpr uint32_t kRows = 4;
  static constexpr uint32_t kStages = 2;
  static constexpr uint32_t kMinCtasPerSm = 2;
  static constexpr uint32_t tile_blocks(uint32_t lanes) { return 2 * kUnitsPerLane * lanes; }
  static constexpr uint32_t units(uint32_t blocks) { return (blocks + 1) / 2; }
  static __device__ __forceinline__ uint32_t element(uint32_t u, uint32_t p) {
    return 64 * u + 32 * (p / 32) + (p % 32) / 2;
  }
  static constexpr __device__ uint32_t quad_offset(uint32_t i) { return (i & 1u) * 16 + i / 2; }

  static __device__ __forceinline__ float unit_dot(const uint8_t* tile, uint32_t uu,
                                                   const Planes& p, const uint8_t* slot,
                                                   uint32_t ur, uint32_t blocks) {
    const uint32_t off = uu * 2 * kBlockBytes;
    const uint32_t* base = reinterpret_cast<const uint32_t*>(tile + (off & ~3u));
    // Byte b of the unit is byte b + lag of the aligned words t (lag 0 or 2). t[8] ends at the
    // unit's end or 2 bytes past it, inside the tile's 16-byte padding.
    const uint32_t lag = off & 2u;
    uint32_t t[9];
#pragma unroll
    for (uint32_t i = 0; i < 9; ++i) t[i] = base[i];
    const float d0 = detail::e8m0_to_float_half((t[0] >> (8 * lag)) & 0xffu);      // byte 0
    const float d1 = detail::e8m0_to_float_half((t[4] >> (8 * lag + 8)) & 0xffu);  // byte 17
    DigitSums first;
    DigitSums second;
#pragma unroll
    for (uint32_t k = 0; k < 4; ++k) {
      // qs word k of each block: unit bytes 1 + 4k.. and 18 + 4k.. (a shift of 32 is t[5 + k]).
      const uint32_t w0 = __funnelshift_r(t[k], t[k + 1], 8 * lag + 8);
      const uint32_t w1 = __funnelshift_rc(t[4 + k], t[5 + k], 8 * lag + 16);
      const uint32_t f0 = w0 ^ 0x88888888u;
      const uint32_t f1 = w1 ^ 0x88888888u;
      first.add(e2m1_quads(w0, f0), p, 2 * k);
      first.add(e2m1_quads(w0 >> 16, f0 >> 16), p, 2 * k + 1);
      second.add(e2m1_quads(w1, f1), p, 8 + 2 * k);
      second.add(e2m1_quads(w1 >> 16, f1 >> 16), p, 9 + 2 * k);
    }
    const float4 s = *reinterpret_cast<const float4*>(slot + kSlotScales);
    float r = d0 * (s.x * first.total());
    if (2 * ur + 1 < blocks) r += d1 * (s.z * second.total());
    return r;
  }
};

struct QuantArgs {
  MatvecBatch batch;
  uint64_t row_bytes;
  uint32_t rows;
  uint32_t cols;
  uint32_t blocks_per_row;
  uint32_t units_per_row;
  uint32_t tiles_per_row;
  uint32_t rows_per_cta;
  // Split-K (kSplit kernels; 1 and tiles_per_row otherwise): CTAs per cluster, the tiles of each
  // (the last may have fewer), and the x slots each CTA holds.
  uint32_t slices;
  uint32_t tiles_per_slice;
  uint32_t slot_units;
  uint32_t pdl;  // launched as a programmatic dependent (the ...Pdl variants)
};

// Bytes of shared memory after the ring in which a split-K CTA keeps its partial rows: caps
// rows_per_cta of a split launch (larger plans take the kBase kernel).
constexpr uint32_t kPartialBytes = 4096;

// A group computes R rows at once and loads each unit's digit planes from shared memory once for
// all R: the plane reads (6 bytes per weight and row) otherwise bound a 4-bit kernel by shared
// memory bandwidth. Tiles reach shared memory in one of two ways (F::kStages):
//   0: a register double buffer: the next tile is loaded into registers while the current one is
//      computed, then stored (Q8_0, Q6_K: one row of 2-byte-aligned blocks per group);
//   S >= 2: a ring of S tiles per group filled by cp.async, S - 1 in flight while one is computed
//      (Q4_K and MXFP4, whose R = 4 rows would not fit in registers).
template <class F, int L, int R>
struct QuantShape {
  static constexpr uint32_t kGroupsPerWarp = 32 / L;
  static constexpr uint32_t kGroups = kWarps * kGroupsPerWarp;
  static constexpr uint32_t kTileUnits = F::kUnitsPerLane * L;
  static constexpr uint32_t kTileBytes = F::tile_blocks(L) * F::kBlockBytes;  // of one row
  static constexpr uint32_t kTileStride = (kTileBytes + 15) / 16 * 16;
  static constexpr uint32_t kStageBytes = R * kTileStride;  // a group's R row tiles
  static constexpr uint32_t kSlots = F::kStages > 0 ? F::kStages : 1;
  static constexpr uint32_t kGroupBytes = kSlots * kStageBytes;
};

// Copies V bytes from global to shared memory: asynchronously (cp.async, completed by
// async_wait) for 16 and 4, synchronously for 2 and 1 (cp.async has no such form).
template <int V>
__device__ __forceinline__ void stage_copy(uint8_t* dst, const uint8_t* src) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  if constexpr (V == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
  } else if constexpr (V == 4) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src) : "memory");
  } else if constexpr (V == 2) {
    *reinterpret_cast<uint16_t*>(dst) = *reinterpret_cast<const uint16_t*>(src);
  } else {
    *dst = *src;
  }
}

__device__ __forceinline__ void async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// Waits until at most N of this thread's committed copy groups are pending.
template <int N>
__device__ __forceinline__ void async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Grid: (CTAs per job, jobs). CTA b of job j computes rows [b * rows_per_cta, ...) of job j, in
// blocks of R consecutive rows; group g (lanes g*L .. g*L+L-1 of a warp) takes row blocks g,
// g + kGroups, ... and walks their tiles. Work item n of a group is tile n % tiles_per_row of its
// row block n / tiles_per_row; later items' bytes are in flight while n is computed. The item
// count is the same for all groups of a warp (the warp's first group decides it), so the warp-wide
// syncs and the shuffles of the row reduction see every lane; rows past the end are computed on
// stale data and not written.
//
// kSplit: the grid's x is (row ranges) x (slices), a cluster of `slices` CTAs per row range. CTA
// rank k takes tiles [k * tiles_per_slice, ...) of each row and x's planes for those tiles only,
// keeps its rows' partial sums in shared memory, and rank 0 adds the ranks' partials in rank order
// and writes y once every rank is done (cluster barriers on both sides of the reads).
template <class F, int L, int V, int R, bool kSplit>
__global__ void __launch_bounds__(kThreads, F::kMinCtasPerSm)
    matvec_quant_kernel(const QuantArgs a) {
  using Vec = typename VecOf<V>::type;
  using Q = QuantShape<F, L, R>;
  constexpr uint32_t S = F::kStages;
  constexpr uint32_t kChunks = (Q::kTileBytes / V + L - 1) / L;  // per lane, row and tile

  extern __shared__ __align__(16) uint8_t smem[];
  const uint32_t job = blockIdx.y;
  const uint8_t* w = static_cast<const uint8_t*>(a.batch.w[job]);
  const float* x = a.batch.x[job];
  float* y = a.batch.y[job];

  const uint32_t warp = threadIdx.x / 32;
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t gi = warp * Q::kGroupsPerWarp + lane / L;
  const uint32_t gl = lane % L;
  uint8_t* xs = smem;
  uint8_t* ring = smem + a.slot_units * kSlotBytes + gi * Q::kGroupBytes;

  uint32_t cta = blockIdx.x;
  uint32_t slice = 0;
  if constexpr (kSplit) {
    slice = cg::this_cluster().block_rank();
    cta = blockIdx.x / a.slices;
  }
  // This CTA's tiles of each row: [t0, t0 + my_tiles); its x slots hold units u0 ..
  const uint32_t t0 = slice * a.tiles_per_slice;
  const uint32_t my_tiles = min(a.tiles_per_slice, a.tiles_per_row - t0);
  const uint32_t u0 = t0 * Q::kTileUnits;
  const uint32_t my_units = min(a.units_per_row - u0, my_tiles * Q::kTileUnits);
  float* partials =
      reinterpret_cast<float*>(smem + a.slot_units * kSlotBytes + Q::kGroups * Q::kGroupBytes);

  const uint32_t row0 = cta * a.rows_per_cta;
  const uint32_t row_end = min(a.rows, row0 + a.rows_per_cta);
  const uint32_t row_blocks = (row_end - row0 + R - 1) / R;
  const uint32_t warp_block0 = warp * Q::kGroupsPerWarp;
  const uint32_t iters =
      warp_block0 < row_blocks ? (row_blocks - warp_block0 + Q::kGroups - 1) / Q::kGroups : 0;
  const uint32_t items = iters * my_tiles;
  const uint64_t data_bytes = uint64_t{a.blocks_per_row} * F::kBlockBytes;

  // The register double buffer (unused, and optimised away, with cp.async).
  Vec buf[S == 0 ? R : 1][S == 0 ? kChunks : 1];
  uint32_t buf_chunks = 0;  // per row
  uint32_t buf_rows = 0;    // rows of the block that exist
  // Starts loading `item` (into ring slot `slot` with cp.async, committed as one group: an empty
  // one past the last item, so that every lane commits one group per item).
  auto fetch = [&](uint32_t item, uint32_t slot) {
    if (item < items) {
      const uint32_t i = item / my_tiles;
      const uint32_t t = t0 + item - i * my_tiles;
      const uint32_t first = row0 + (gi + Q::kGroups * i) * R;
      const uint32_t rows = first < row_end ? min(row_end - first, uint32_t{R}) : 0;
      const uint64_t off = uint64_t{t} * Q::kTileBytes;
      const uint64_t left = data_bytes - off;
      const uint32_t chunks =
          static_cast<uint32_t>((left < Q::kTileBytes ? left : Q::kTileBytes) / V);
#pragma unroll
      for (uint32_t r = 0; r < R; ++r) {
        if (r < rows) {
          const uint8_t* src = w + uint64_t{first + r} * a.row_bytes + off;
          uint8_t* dst = ring + slot * Q::kStageBytes + r * Q::kTileStride;
#pragma unroll
          for (uint32_t c = 0; c < kChunks; ++c) {
            const uint32_t idx = gl + L * c;
            if (idx < chunks) {
              if constexpr (S > 0) {
                stage_copy<V>(dst + idx * V, src + uint64_t{idx} * V);
              } else {
                buf[r][c] = *reinterpret_cast<const Vec*>(src + uint64_t{idx} * V);
              }
            }
          }
        }
      }
      buf_rows = rows;
      buf_chunks = chunks;
    }
    if constexpr (S > 0) async_commit();
  };

  // The next kernel may launch once every CTA of this one has run this far; it waits for this
  // one's completion itself before it reads what this one writes.
  if (a.pdl != 0) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  // In flight while x is prepared (and, launched as a dependent, while the previous kernel ends:
  // the weights are not written by kernels).
  if constexpr (S > 0) {
#pragma unroll
    for (uint32_t s = 0; s + 1 < S; ++s) fetch(s, s);
  } else {
    fetch(0, 0);
  }
  if (a.pdl != 0) asm volatile("griddepcontrol.wait;" ::: "memory");  // x is complete
  prepare_x<F>(x, a.batch.up[job], a.cols, u0, my_units, xs);
  __syncthreads();

  float acc[R];
#pragma unroll
  for (uint32_t r = 0; r < R; ++r) acc[r] = 0.0f;
  uint32_t slot = 0;  // item % kSlots
  for (uint32_t item = 0; item < items; ++item) {
    if constexpr (S > 0) {
      async_wait<S - 2>();  // this lane's copies of `item` have landed
      __syncwarp();         // every lane's have, and the group is done with item - 1's slot
      fetch(item + S - 1, slot == 0 ? S - 1 : slot - 1);
    } else {
      __syncwarp();  // the group is done reading its previous tiles
#pragma unroll
      for (uint32_t r = 0; r < R; ++r) {
        if (r < buf_rows) {
#pragma unroll
          for (uint32_t c = 0; c < kChunks; ++c) {
            const uint32_t idx = gl + L * c;
            if (idx < buf_chunks) {
              *reinterpret_cast<Vec*>(ring + r * Q::kTileStride + idx * V) = buf[r][c];
            }
          }
        }
      }
      __syncwarp();  // the tiles are complete
      if (item + 1 < items) fetch(item + 1, 0);
    }
    const uint32_t i = item / my_tiles;
    const uint32_t t = item - i * my_tiles;  // of this CTA's tiles
    const uint32_t first = row0 + (gi + Q::kGroups * i) * R;
    const uint8_t* stage = ring + slot * Q::kStageBytes;
    if (first < row_end) {
#pragma unroll
      for (uint32_t kk = 0; kk < F::kUnitsPerLane; ++kk) {
        const uint32_t uu = gl + L * kk;
        const uint32_t ur = (t0 + t) * Q::kTileUnits + uu;
        if (ur < a.units_per_row) {
          const uint8_t* xslot = xs + (ur - u0) * kSlotBytes;
          Planes p;
          load_planes(xslot, &p);
#pragma unroll
          for (uint32_t r = 0; r < R; ++r) {
            acc[r] += F::unit_dot(stage + r * Q::kTileStride, uu, p, xslot, ur, a.blocks_per_row);
          }
        }
      }
    }
    if (t + 1 == my_tiles) {
#pragma unroll
      for (uint32_t r = 0; r < R; ++r) {
#pragma unroll
        for (uint32_t o = L / 2; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(kFull, acc[r], o);
        if (gl == 0 && first + r < row_end) {
          if constexpr (kSplit) {
            partials[first + r - row0] = acc[r];
          } else {
            y[first + r] = acc[r];
          }
        }
        acc[r] = 0.0f;
      }
    }
    if constexpr (S > 0) slot = slot + 1 == S ? 0 : slot + 1;
  }
  if constexpr (S > 0) async_wait<0>();  // the trailing groups are empty; no copy outlives us
  if constexpr (kSplit) {
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // every rank's partials are written (and visible cluster-wide)
    if (slice == 0) {
      for (uint32_t i = threadIdx.x; i < row_end - row0; i += kThreads) {
        float sum = partials[i];
        for (uint32_t k = 1; k < a.slices; ++k) sum += cluster.map_shared_rank(partials, k)[i];
        y[row0 + i] = sum;
      }
    }
    cluster.sync();  // rank 0 has read the others' shared memory before it goes away
  }
}

// The clusters of `k` CTAs of `kernel` (with `smem` bytes each) that fit on the device at once,
// from cudaOccupancyMaxActiveClusters, which knows that a cluster's CTAs share one GPC (SMs left
// over in a GPC are not counted, as occupancy times SMs would); 0 when the query fails. Cached as
// LaunchCache is: bits 0-15 the clusters, 16-19 k, 24-47 smem, 48-55 the device, 63 valid.
template <typename Kernel>
cudaError_t resident_clusters(Kernel kernel, LaunchCache* cache, size_t smem, uint32_t k,
                              uint32_t* clusters) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const uint64_t key = detail::kCacheValid | (uint64_t(dev & 0xff) << 48) | (uint64_t(smem) << 24) |
                       (uint64_t(k & 0xf) << 16);
  const uint64_t cached = cache->packed.load(std::memory_order_relaxed);
  if ((cached & ~uint64_t{0xffff}) == key) {
    *clusters = static_cast<uint32_t>(cached & 0xffffu);
    return cudaSuccess;
  }
  int optin = 0;
  e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (e != cudaSuccess) return e;
  if (smem > static_cast<size_t>(optin)) return cudaErrorInvalidValue;
  if (smem > detail::kDefaultSmem) {
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin);
    if (e != cudaSuccess) return e;
  }
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = k;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(k, 1, 1);
  config.blockDim = dim3(kThreads, 1, 1);
  config.dynamicSmemBytes = smem;
  config.attrs = &attr;
  config.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, reinterpret_cast<const void*>(kernel), &config) !=
      cudaSuccess) {
    // A device or driver that cannot place these clusters: none resident, so the caller launches
    // kBase; the query's error must not be reported by that launch's cudaGetLastError(). Said
    // once per process, so that a split variant measuring as kBase is explained.
    const cudaError_t q = cudaGetLastError();
    static std::atomic<bool> said{false};
    if (!said.exchange(true)) {
      std::fprintf(stderr,
                   "expertd kernels: cudaOccupancyMaxActiveClusters: %s; split-K "
                   "variants run as base\n",
                   cudaGetErrorString(q));
    }
    n = 0;
  }
  const uint64_t count = static_cast<uint64_t>(n > 0 ? (n < 0xffff ? n : 0xffff) : 0);
  if (dev >= 0 && dev <= 0xff && smem < (size_t{1} << 24) && k < 16) {
    cache->packed.store(key | count, std::memory_order_relaxed);
  }
  *clusters = static_cast<uint32_t>(count);
  return cudaSuccess;
}

// Launches `kernel` on (x, y) CTAs, as clusters of `cluster` CTAs along x when cluster > 1, as a
// programmatic dependent of the stream's previous kernel when `pdl`.
template <typename Kernel>
cudaError_t launch_ex(Kernel kernel, dim3 grid, size_t smem, cudaStream_t stream, uint32_t cluster,
                      bool pdl, const QuantArgs& a) {
  cudaLaunchAttribute attrs[2] = {};
  uint32_t n = 0;
  if (cluster > 1) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n].val.clusterDim.x = cluster;
    attrs[n].val.clusterDim.y = 1;
    attrs[n].val.clusterDim.z = 1;
    ++n;
  }
  if (pdl) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(kThreads, 1, 1);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attrs;
  config.numAttrs = n;
  return cudaLaunchKernelEx(&config, kernel, a);
}

// Launches the kBase kernel (kSplit false, `slices` ignored) or the split-K one with up to
// `slices` CTAs per cluster. A split takes whole tiles per CTA; the count is lowered until no CTA
// is left without a tile (7 tiles asked into 8 slices give 7 of one tile). A split that would give
// one slice, that does not fit (shared memory, no cluster resident), or whose plan needs more rows
// per CTA than kPartialBytes holds, launches kBase instead.
template <class F, int L, int V, bool kSplit>
cudaError_t launch_quant(const MatvecBatch& batch, uint64_t row_bytes, uint32_t rows, uint32_t cols,
                         cudaStream_t stream, uint32_t slices, bool pdl) {
  constexpr int R = F::kRows;
  using Q = QuantShape<F, L, R>;
  QuantArgs a{};
  a.batch = batch;
  a.row_bytes = row_bytes;
  a.rows = rows;
  a.cols = cols;
  a.blocks_per_row = cols / F::kBlockElems;
  a.units_per_row = F::units(a.blocks_per_row);
  a.tiles_per_row = (a.units_per_row + Q::kTileUnits - 1) / Q::kTileUnits;
  a.pdl = pdl ? 1 : 0;
  const auto kernel = matvec_quant_kernel<F, L, V, R, kSplit>;
  if constexpr (!kSplit) {
    static LaunchCache cache;
    a.slices = 1;
    a.tiles_per_slice = a.tiles_per_row;
    a.slot_units = a.units_per_row;
    const size_t smem = size_t{a.units_per_row} * kSlotBytes + size_t{Q::kGroups} * Q::kGroupBytes;
    LaunchShape shape;
    const cudaError_t e = plan_launch(kernel, &cache, smem, rows, batch.count, Q::kGroups * R,
                                      kMinRowsPerCta, &shape);
    if (e != cudaSuccess) return e;
    a.rows_per_cta = shape.rows_per_cta;
    if (pdl)
      return launch_ex(kernel, dim3(shape.ctas_per_job, batch.count), smem, stream, 1, true, a);
    kernel<<<dim3(shape.ctas_per_job, batch.count), kThreads, smem, stream>>>(a);
    return cudaGetLastError();
  } else {
    auto base = [&]() {
      return launch_quant<F, L, V, false>(batch, row_bytes, rows, cols, stream, 1, pdl);
    };
    const uint32_t want = slices < a.tiles_per_row ? slices : a.tiles_per_row;
    if (want < 2) return base();
    const uint32_t per = (a.tiles_per_row + want - 1) / want;
    const uint32_t k = (a.tiles_per_row + per - 1) / per;
    if (k < 2) return base();
    a.slices = k;
    a.tiles_per_slice = per;
    a.slot_units = a.units_per_row < per * Q::kTileUnits ? a.units_per_row : per * Q::kTileUnits;
    const size_t smem =
        size_t{a.slot_units} * kSlotBytes + size_t{Q::kGroups} * Q::kGroupBytes + kPartialBytes;
    static LaunchCache cache;
    uint32_t clusters = 0;
    const cudaError_t e = resident_clusters(kernel, &cache, smem, k, &clusters);
    if (e == cudaErrorInvalidValue) return base();  // too much shared memory for a split
    if (e != cudaSuccess) return e;
    if (clusters == 0) return base();
    // One wave of clusters over the jobs, as plan_launch plans one wave of CTAs.
    const uint64_t per_job = clusters / batch.count > 0 ? clusters / batch.count : 1;
    const uint64_t granule = uint64_t{Q::kGroups} * R;
    uint64_t rpc = (rows + per_job - 1) / per_job;
    if (rpc < kMinRowsPerCta) rpc = kMinRowsPerCta;
    rpc = (rpc + granule - 1) / granule * granule;
    if (rpc * sizeof(float) > kPartialBytes) return base();
    a.rows_per_cta = static_cast<uint32_t>(rpc);
    const uint32_t ranges = static_cast<uint32_t>((rows + rpc - 1) / rpc);
    return launch_ex(kernel, dim3(ranges * k, batch.count, 1), smem, stream, k, pdl, a);
  }
}

// A format with odd-sized blocks (MXFP4) can have rows at any address; the others need 2 bytes.
template <class F>
inline constexpr bool kByteAligned = F::kBlockBytes % 2 == 1;

// Split-K is built for 16-byte loads and groups of 32 or 16 lanes only (the long rows it is for);
// other shapes take kBase.
template <class F, int L>
cudaError_t launch_quant_vec(uint32_t vec, const MatvecBatch& batch, uint64_t row_bytes,
                             uint32_t rows, uint32_t cols, cudaStream_t stream, uint32_t slices,
                             bool pdl) {
  if (vec == 16) {
    if constexpr (L >= 16) {
      if (slices > 1) {
        return launch_quant<F, L, 16, true>(batch, row_bytes, rows, cols, stream, slices, pdl);
      }
    }
    return launch_quant<F, L, 16, false>(batch, row_bytes, rows, cols, stream, 1, pdl);
  }
  if (vec == 4) return launch_quant<F, L, 4, false>(batch, row_bytes, rows, cols, stream, 1, pdl);
  if constexpr (kByteAligned<F>) {
    if (vec == 1) {
      return launch_quant<F, L, 1, false>(batch, row_bytes, rows, cols, stream, 1, pdl);
    }
  }
  return launch_quant<F, L, 2, false>(batch, row_bytes, rows, cols, stream, 1, pdl);
}

// The CTAs per cluster `variant` asks for, for rows of `tiles` tiles of `tile_units` units (1: no
// split). kSplitKAuto: slices of at most 64 units (4,096 columns of the 4-bit formats, the width
// at which gate + up reach 0.8 of HBM), at most 8 CTAs, the fewest idle tile slots, then the
// fewest CTAs.
uint32_t split_slices(MatvecVariant variant, uint32_t tiles, uint32_t tile_units) {
  switch (variant) {
    case MatvecVariant::kSplitK2:
      return 2;
    case MatvecVariant::kSplitK4:
      return 4;
    case MatvecVariant::kSplitK8:
      return 8;
    case MatvecVariant::kSplitKAuto:
    case MatvecVariant::kSplitKAutoPdl:
    case MatvecVariant::kSplitKQ6R2: {
      const uint32_t max_per = tile_units < 64 ? 64 / tile_units : 1;
      uint32_t k = (tiles + max_per - 1) / max_per;
      if (k > 8) k = 8;
      uint32_t best = 1;
      uint32_t best_idle = ~0u;
      for (; k <= 8 && k <= tiles; ++k) {
        const uint32_t per = (tiles + k - 1) / k;
        const uint32_t used = (tiles + per - 1) / per;
        const uint32_t idle = used * per - tiles;
        if (idle < best_idle) {
          best = used;
          best_idle = idle;
        }
      }
      return best;
    }
    default:
      return 1;
  }
}

template <class F>
cudaError_t dispatch_quant(const MatvecBatch& batch, uint64_t row_bytes, uint32_t rows,
                           uint32_t cols, cudaStream_t stream, MatvecVariant variant) {
  const uint32_t blocks = cols / F::kBlockElems;
  const uint32_t units = F::units(blocks);
  // The widest group that still gives each lane its units: short rows share a warp.
  uint32_t lanes = 4;
  for (const uint32_t l : {32u, 16u, 8u}) {
    if (F::kUnitsPerLane * l <= units) {
      lanes = l;
      break;
    }
  }
  const uint64_t tile_bytes = uint64_t{F::tile_blocks(lanes)} * F::kBlockBytes;
  uint32_t vec =
      vec_bytes(pointer_bits(batch) | row_bytes | tile_bytes | uint64_t{blocks} * F::kBlockBytes);
  if (vec == 0) {
    if constexpr (!kByteAligned<F>) return cudaErrorInvalidValue;  // an odd address
    vec = 1;
  }
  const uint32_t tile_units = F::kUnitsPerLane * lanes;
  // The automatic split skips Q6_K: on the H200 it took the Mixtral down projection from 0.51 to
  // 0.48 of HBM (q4_k: 0.51 to 0.55; docs/KERNELS.md). Fixed splits still apply, for measuring.
  const bool auto_split =
      variant == MatvecVariant::kSplitKAuto || variant == MatvecVariant::kSplitKAutoPdl;
  const uint32_t slices =
      auto_split && std::is_same_v<F, Q6K>
          ? 1
          : split_slices(variant, (units + tile_units - 1) / tile_units, tile_units);
  const bool pdl = variant == MatvecVariant::kBasePdl || variant == MatvecVariant::kSplitKAutoPdl;
  switch (lanes) {
    case 32:
      return launch_quant_vec<F, 32>(vec, batch, row_bytes, rows, cols, stream, slices, pdl);
    case 16:
      return launch_quant_vec<F, 16>(vec, batch, row_bytes, rows, cols, stream, slices, pdl);
    case 8:
      return launch_quant_vec<F, 8>(vec, batch, row_bytes, rows, cols, stream, slices, pdl);
    default:
      return launch_quant_vec<F, 4>(vec, batch, row_bytes, rows, cols, stream, slices, pdl);
  }
}

// The q6r2 variants' Q6_K (F = Q6KR2): sets *handled and launches when the rows take 16 or 32
// lanes and 16-byte loads; otherwise leaves *handled false (the caller takes Q6K).
template <class F>
cudaError_t dispatch_wide(const MatvecBatch& batch, uint64_t row_bytes, uint32_t rows,
                          uint32_t cols, cudaStream_t stream, MatvecVariant variant,
                          bool* handled) {
  const uint32_t blocks = cols / F::kBlockElems;
  const uint32_t units = F::units(blocks);
  const uint32_t lanes = F::kUnitsPerLane * 32 <= units   ? 32
                         : F::kUnitsPerLane * 16 <= units ? 16
                                                          : 0;
  if (lanes == 0) return cudaSuccess;
  const uint64_t tile_bytes = uint64_t{F::tile_blocks(lanes)} * F::kBlockBytes;
  if (vec_bytes(pointer_bits(batch) | row_bytes | tile_bytes | uint64_t{blocks} * F::kBlockBytes) !=
      16) {
    return cudaSuccess;
  }
  *handled = true;
  const uint32_t tile_units = F::kUnitsPerLane * lanes;
  const uint32_t slices = split_slices(variant, (units + tile_units - 1) / tile_units, tile_units);
  if (lanes == 32) {
    if (slices > 1) {
      return launch_quant<F, 32, 16, true>(batch, row_bytes, rows, cols, stream, slices, false);
    }
    return launch_quant<F, 32, 16, false>(batch, row_bytes, rows, cols, stream, 1, false);
  }
  if (slices > 1) {
    return launch_quant<F, 16, 16, true>(batch, row_bytes, rows, cols, stream, slices, false);
  }
  return launch_quant<F, 16, 16, false>(batch, row_bytes, rows, cols, stream, 1, false);
}

}  // namespace

cudaError_t matvec_quant(GgmlType type, const MatvecBatch& batch, uint64_t row_bytes, uint32_t rows,
                         uint32_t cols, cudaStream_t stream, MatvecVariant variant) {
  switch (type) {
    case GgmlType::Q8_0:
      return dispatch_quant<Q80>(batch, row_bytes, rows, cols, stream, variant);
    case GgmlType::Q4_K:
      return dispatch_quant<Q4K>(batch, row_bytes, rows, cols, stream, variant);
    case GgmlType::Q6_K:
      if (variant == MatvecVariant::kQ6R2 || variant == MatvecVariant::kSplitKQ6R2) {
        bool handled = false;
        const cudaError_t e =
            dispatch_wide<Q6KR2>(batch, row_bytes, rows, cols, stream, variant, &handled);
        if (handled) return e;
      }
      return dispatch_quant<Q6K>(batch, row_bytes, rows, cols, stream, variant);
    case GgmlType::MXFP4:
      return dispatch_quant<Mxfp4>(batch, row_bytes, rows, cols, stream, variant);
    default:
      return cudaErrorInvalidValue;  // another family's
  }
}

}  // namespace expertd::kernels
