// Memory-bandwidth yardsticks for expert-gpu-bench: the fastest a kernel can stream bytes it only
// reads, to compare the matvec kernels' weight bandwidth against.
//
// read_bytes: reads the n bytes at p (device or mapped host memory; p 16-byte aligned, n a
// multiple of 16) with 16-byte loads spread over the whole GPU and folds them into *sink (device
// memory, written only when the fold hits an unlikely value, so the loads cannot be elided and
// nothing else is written).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace expertd::kernels {

cudaError_t read_bytes(const void* p, uint64_t n, uint32_t* sink, cudaStream_t stream);

}  // namespace expertd::kernels
