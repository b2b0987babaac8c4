// Dequantisation of the ggml tensor types the engine computes with, as plain C++: one function
// per type, each the reference dequantize_row_* of ggml-quants.c (same block layout, same float
// operations in the same order, so the results are bit-identical to ggml's and to the `gguf`
// Python package's; tests/engine/dequant_test.cc checks the latter on committed vectors).
//
// The per-type functions take `n` elements, a whole number of the type's blocks; they read `src`
// byte-wise (no alignment needed) and never fail. Callers validate type and shape once, when a
// tensor or an expert layout is loaded (dequant_check), so the per-row calls on the hot path
// carry no error handling.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "expertd/result.h"
#include "storage/ggml_types.h"

namespace expertd::engine {

void dequantize_f32(const uint8_t* src, float* dst, size_t n);
void dequantize_f16(const uint8_t* src, float* dst, size_t n);
void dequantize_bf16(const uint8_t* src, float* dst, size_t n);
void dequantize_q8_0(const uint8_t* src, float* dst, size_t n);  // 32 per block of 34 bytes
void dequantize_q4_k(const uint8_t* src, float* dst, size_t n);  // 256 per block of 144 bytes
void dequantize_q6_k(const uint8_t* src, float* dst, size_t n);  // 256 per block of 210 bytes
// 32 per block of 17 bytes: an e8m0 exponent e, then 16 bytes whose low nibbles are elements
// 0..15 and high nibbles 16..31, each an e2m1 value; element = kvalue * 2^(e - 128), where the
// kvalues are the e2m1 values doubled (ggml's kvalues_mxfp4 and GGML_E8M0_TO_FP32_HALF).
void dequantize_mxfp4(const uint8_t* src, float* dst, size_t n);
// These are kExpertTypes (storage/ggml_types.h), the list dequant_check checks.

// An error unless `type` is supported and a row of `ne0` elements is a whole number of blocks:
// "q5_k: the engine cannot dequantise this type (supported: f32, f16, bf16, q8_0, q4_k, q6_k,
// mxfp4)".
Status dequant_check(GgmlType type, uint64_t ne0);

// Dispatches to the function of `type`. Requires dequant_check(type, n) to have passed.
void dequantize_row(GgmlType type, const uint8_t* src, float* dst, size_t n);

// The checked form for one-off conversions: `src` must hold exactly dst.size() elements.
Status dequantize(GgmlType type, std::span<const uint8_t> src, std::span<float> dst);

}  // namespace expertd::engine
