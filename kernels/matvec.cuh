// The fused matvec of ggml weights on the GPU, for the expert types (kExpertTypes: F32, F16, BF16,
// Q8_0, Q4_K, Q6_K and MXFP4), with the block layouts of ggml's reference dequantize_row_*. Two
// families do the work: matvec_float.cu (F32, F16, BF16) and matvec_quant.cu (Q8_0, Q4_K, Q6_K,
// MXFP4).
//
// matvec: y[r] = sum_c W[r][c] * x[c] for rows r < rows, where row r of W starts at
// w + r * row_bytes and holds `cols` elements of `type` (cols a whole number of blocks). The
// weight is dequantised in registers as it is read (fused); accumulation is in float.
// `w` may be device memory or mapped pinned host memory (cudaHostRegisterMapped), which is how
// the in-place mode reads the daemon's arena. `w` must be 2-byte aligned (4-byte for F32; any
// address for MXFP4, whose 17-byte blocks put rows anywhere); the widest loads (16 bytes) are used
// when every w and row_bytes are 16-byte aligned, narrower ones otherwise. x is staged in shared
// memory, which bounds cols (about 54k for Q8_0 and Q6_K, 42k for Q4_K and MXFP4, 58k for
// F32/F16/BF16 on an H200); a larger cols, a misaligned w, or row_bytes below the
// row's data is cudaErrorInvalidValue. The device's occupancy and SM count are queried on the host
// at a kernel's first call per device and shared-memory size, then cached.
//
// matvec_batched: up to kMaxBatch independent matvecs of the same type and shape in one launch
// (the gate and up projections of all routed experts, then their down projections); job j reads
// w[j] and x[j] and writes y[j]. When up[j] is set, job j's vector is silu(x[j]) * up[j] (SwiGLU,
// computed as kernels::swiglu computes it, bit for bit) instead of x[j]: the down projection reads
// the gate and up outputs directly, one launch and one round trip of h fewer.
//
// MatvecVariant: which kernel shape the quantised family uses (the plain family has one). They
// compute the same matvec within the same tolerance; expert-gpu-bench --variant measures them side
// by side and docs/KERNELS.md has the figures. kDefault is the engine's choice, which the
// environment variable EXPERTD_MATVEC_VARIANT (a name of matvec_variant_name) overrides, read once.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <string_view>

#include "storage/ggml_types.h"

namespace expertd::kernels {

inline constexpr uint32_t kMaxBatch = 32;

struct MatvecBatch {
  uint32_t count = 0;
  const void* w[kMaxBatch] = {};
  const float* x[kMaxBatch] = {};
  float* y[kMaxBatch] = {};
  const float* up[kMaxBatch] = {};  // null: the vector is x[j]; else silu(x[j]) * up[j]
};

// kBase: one CTA per contiguous row range, each CTA building the digit planes of the whole x.
// kSplitK<K>: a thread-block cluster of K CTAs per row range, CTA k taking the k-th of K column
// slices (whole tiles) and building only its slice's planes; CTA 0 sums the K partial rows from
// the others' shared memory in rank order (deterministic, no scratch). Long rows (a down
// projection's 14,336 columns) get K times less prologue per CTA and smaller shared memory, so
// more CTAs per SM. kSplitKAuto picks K per shape (tiles split evenly, slices of about 2,048 to
// 4,096 columns); rows of one tile stay kBase. Shapes a split cannot take (narrow loads, rows of
// fewer tiles than K) use kBase.
// ...Pdl: the same kernel launched with programmatic dependent launch (sm_90): it may start while
// the kernel before it on the stream finishes, copies its first weight tiles (weights are not
// written by kernels), and waits for that kernel's completion (griddepcontrol.wait) only before it
// reads x; it lets the next kernel launch as soon as all its CTAs run. A layer's down projection
// then streams its first tiles during the gate + up projection's tail.
// kQ6R2, kSplitKQ6R2: kBase and kSplitKAuto, except that Q6_K rows of 16-byte aligned tiles take
// two rows per group (halving the digit-plane reads per weight byte) with a cp.async tile ring.
enum class MatvecVariant : uint8_t {
  kDefault,
  kBase,
  kSplitK2,
  kSplitK4,
  kSplitK8,
  kSplitKAuto,
  kBasePdl,
  kSplitKAutoPdl,
  kQ6R2,
  kSplitKQ6R2,
};

inline constexpr MatvecVariant kAllMatvecVariants[] = {
    MatvecVariant::kBase,          MatvecVariant::kSplitK2,    MatvecVariant::kSplitK4,
    MatvecVariant::kSplitK8,       MatvecVariant::kSplitKAuto, MatvecVariant::kBasePdl,
    MatvecVariant::kSplitKAutoPdl, MatvecVariant::kQ6R2,       MatvecVariant::kSplitKQ6R2};

// "default", "base", "splitk2", "splitk4", "splitk8", "splitk", "base+pdl", "splitk+pdl",
// "q6r2", "splitk+q6r2".
const char* matvec_variant_name(MatvecVariant v);
std::optional<MatvecVariant> matvec_variant_from_name(std::string_view name);
// What kDefault means in this process (EXPERTD_MATVEC_VARIANT, else the built-in choice).
MatvecVariant matvec_default_variant();
// Whether the engine fuses SwiGLU into its down projections (MatvecBatch::up): the built-in
// choice, or EXPERTD_FUSE_SWIGLU=1/0, read once.
bool matvec_fuse_swiglu();

cudaError_t matvec(GgmlType type, const void* w, uint64_t row_bytes, uint32_t rows, uint32_t cols,
                   const float* x, float* y, cudaStream_t stream);

cudaError_t matvec_batched(GgmlType type, const MatvecBatch& batch, uint64_t row_bytes,
                           uint32_t rows, uint32_t cols, cudaStream_t stream,
                           MatvecVariant variant = MatvecVariant::kDefault);

}  // namespace expertd::kernels
