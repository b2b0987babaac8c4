// The rotation of one RoPE pair on the device, shared by the decode (rope.cu) and prefill
// (prefill.cu) kernels so that a prefill row is bit-identical to decode at its position. Pair i of
// a head: elements (i, i + n_rot/2) for NEOX, (2i, 2i + 1) for NORM; theta = pos *
// base^(-2i/n_rot), computed in double as the CPU reference does (at positions in the tens of
// thousands a float theta is off by whole milliradians).
//
// Internal to kernels/ (included by .cu files only).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace expertd::kernels::detail {

template <bool kNeox>
__device__ inline void rope_pair(float* head, uint32_t i, uint32_t n_rot, double pos, double base) {
  const double theta = pos * pow(base, -2.0 * static_cast<double>(i) / n_rot);
  double s = 0.0;
  double c = 0.0;
  sincos(theta, &s, &c);
  float* a = head + (kNeox ? i : 2 * i);
  const uint32_t other = kNeox ? n_rot / 2 : 1;
  const double x0 = a[0];
  const double x1 = a[other];
  a[0] = static_cast<float>(x0 * c - x1 * s);
  a[other] = static_cast<float>(x0 * s + x1 * c);
}

}  // namespace expertd::kernels::detail
