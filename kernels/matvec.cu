// The matvec entry points: the argument checks, then the family's launcher.
#include <cstdio>
#include <cstdlib>

#include "kernels/matvec.cuh"
#include "kernels/matvec_float.cuh"
#include "kernels/matvec_quant.cuh"

namespace expertd::kernels {

namespace {

// The engine's variant until a device run picks another (docs/KERNELS.md).
// Measured on the H200 (docs/KERNELS.md, 2026-12-01): the split raises the Mixtral-shaped q4_k
// expert FFN from 0.644 to 0.683 of read-only HBM (mxfp4 0.493 to 0.503); Q6_K is not split.
constexpr MatvecVariant kBuiltinDefault = MatvecVariant::kSplitKAuto;
constexpr bool kBuiltinFuseSwiglu = false;

MatvecVariant resolve_default() {
  const char* env = std::getenv("EXPERTD_MATVEC_VARIANT");
  if (env == nullptr || *env == '\0') return kBuiltinDefault;
  const auto v = matvec_variant_from_name(env);
  if (!v || *v == MatvecVariant::kDefault) {
    std::fprintf(stderr,
                 "EXPERTD_MATVEC_VARIANT=%s: not a variant (base, splitk2, splitk4, "
                 "splitk8, splitk, base+pdl, splitk+pdl, q6r2, splitk+q6r2); using %s\n",
                 env, matvec_variant_name(kBuiltinDefault));
    return kBuiltinDefault;
  }
  return *v;
}

}  // namespace

const char* matvec_variant_name(MatvecVariant v) {
  switch (v) {
    case MatvecVariant::kDefault:
      return "default";
    case MatvecVariant::kBase:
      return "base";
    case MatvecVariant::kSplitK2:
      return "splitk2";
    case MatvecVariant::kSplitK4:
      return "splitk4";
    case MatvecVariant::kSplitK8:
      return "splitk8";
    case MatvecVariant::kSplitKAuto:
      return "splitk";
    case MatvecVariant::kBasePdl:
      return "base+pdl";
    case MatvecVariant::kSplitKAutoPdl:
      return "splitk+pdl";
    case MatvecVariant::kQ6R2:
      return "q6r2";
    case MatvecVariant::kSplitKQ6R2:
      return "splitk+q6r2";
  }
  return "?";
}

std::optional<MatvecVariant> matvec_variant_from_name(std::string_view name) {
  if (name == matvec_variant_name(MatvecVariant::kDefault)) return MatvecVariant::kDefault;
  for (const MatvecVariant v : kAllMatvecVariants) {
    if (name == matvec_variant_name(v)) return v;
  }
  return std::nullopt;
}

MatvecVariant matvec_default_variant() {
  static const MatvecVariant v = resolve_default();  // once: the hot path reads no environment
  return v;
}

bool matvec_fuse_swiglu() {
  static const bool fuse = [] {
    const char* env = std::getenv("EXPERTD_FUSE_SWIGLU");
    if (env == nullptr || *env == '\0') return kBuiltinFuseSwiglu;
    return env[0] == '1';
  }();
  return fuse;
}

cudaError_t matvec(GgmlType type, const void* w, uint64_t row_bytes, uint32_t rows, uint32_t cols,
                   const float* x, float* y, cudaStream_t stream) {
  MatvecBatch batch;
  batch.count = 1;
  batch.w[0] = w;
  batch.x[0] = x;
  batch.y[0] = y;
  return matvec_batched(type, batch, row_bytes, rows, cols, stream);
}

cudaError_t matvec_batched(GgmlType type, const MatvecBatch& batch, uint64_t row_bytes,
                           uint32_t rows, uint32_t cols, cudaStream_t stream,
                           MatvecVariant variant) {
  if (!expert_type_supported(type) || batch.count == 0 || batch.count > kMaxBatch || rows == 0 ||
      cols == 0) {
    return cudaErrorInvalidValue;
  }
  const GgmlTypeTraits& traits = ggml_traits(type);
  if (cols % traits.block_elems != 0 ||
      uint64_t{cols} / traits.block_elems * traits.block_bytes > row_bytes) {
    return cudaErrorInvalidValue;
  }
  for (uint32_t j = 0; j < batch.count; ++j) {
    if (batch.w[j] == nullptr || batch.x[j] == nullptr || batch.y[j] == nullptr) {
      return cudaErrorInvalidValue;
    }
  }
  switch (type) {
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16:
      return matvec_float(type, batch, row_bytes, rows, cols, stream);
    default:
      return matvec_quant(type, batch, row_bytes, rows, cols, stream,
                          variant == MatvecVariant::kDefault ? matvec_default_variant() : variant);
  }
}

}  // namespace expertd::kernels
