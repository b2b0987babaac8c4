// expert-gpu-bench: the GPU half of the expert path on one device, measured in one run so the
// ratios compare like with like.
//
//  1. copy: host-to-device of an expert-sized buffer (default: 3 x the gate matrix, one Mixtral
//     Q4_K expert, ~99 MB) from (a) cudaMallocHost memory (the baseline) and (b) a sealed memfd
//     mapped PROT_READ and registered cudaHostRegisterReadOnly | cudaHostRegisterMapped, which is
//     how the engine registers the daemon's arena, copied on its own stream. Rounds alternate (a)
//     and (b); the copy is checked byte for byte afterwards. Goal: (b) / (a) >= 0.9.
//  2. expert FFN at batch 1 for --experts experts of --type: the HBM yardsticks (a device-to-device
//     copy of the weight bytes, counting read + write, and a read-only kernel over them), then the
//     engine's fused path (kernels::matvec_batched over gate + up, swiglu, matvec_batched over
//     down, moe_combine) against dequantise-to-f32 + cublasSgemv for the same matrices; GB/s counts
//     the quantised weight bytes. Goal: fused / read-only >= 0.7. Then the fused path reading the
//     weights in place from a registered memfd (over PCIe). The outputs of the three paths are
//     compared off the clock.
//  3. with --variants, each matvec kernel variant (kernels::MatvecVariant) over the same experts:
//     the FFN as four launches, with SwiGLU fused into the down projection (three launches), both
//     again replayed as one CUDA graph (a layer's k experts are already one batched launch per
//     projection, so the graph leaves only the kernels' own time), and each projection alone; all
//     as fractions of the read-only bandwidth, outputs compared with kBase's.
//
// Timing: cudaEvents around each iteration, --warmup iterations first, the median of --iters.
// Exit status: 0, 1 on a CUDA/cuBLAS/system error (printed), 2 when there is no CUDA device.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "base/fd.h"
#include "base/half.h"
#include "bench/bench_util.h"
#include "expertd/result.h"
#include "kernels/check.h"
#include "kernels/combine.cuh"
#include "kernels/cuda_raii.h"
#include "kernels/dequant.cuh"
#include "kernels/matvec.cuh"
#include "kernels/membench.cuh"
#include "kernels/swiglu.cuh"
#include "storage/ggml_types.h"

namespace expertd::bench {
namespace {

using Json = nlohmann::ordered_json;

constexpr uint64_t kAlign = 256;  // matrices inside one allocation start on this boundary

struct Flags {
  uint32_t rows = 14336;  // gate/up rows = down cols (n_ff)
  uint32_t cols = 4096;   // gate/up cols = down rows (n_embd)
  std::string type = "q4_k";
  uint32_t experts = 2;
  uint32_t iters = 20;
  uint32_t warmup = 3;
  std::string copy_bytes;  // empty: 3 x the gate matrix
  bool inplace = true;
  bool json = false;
  int device = 0;
  uint64_t seed = 1;
  std::string variants;  // comma-separated kernels::matvec_variant_name()s, or "all"
};

// The CUDA owners are kernels/cuda_raii.h's; the memfd's fd and mappings are base/fd.h's.
using cuda::CublasHandle;
using cuda::CudaEvent;
using cuda::CudaGraphExec;
using cuda::CudaStream;
using cuda::DeviceBytes;
using cuda::HostRegistration;
using cuda::PinnedBytes;

Error sys_error(const std::string& what) {
  const int e = errno;
  return make_error(e, fmt::format("{}: {}", what, std::strerror(e)));
}

// The daemon's arena as the engine sees it: a memfd sealed against growing, shrinking and writes
// through new mappings (the writable "daemon" mapping stays, as the daemon's does), mapped
// PROT_READ MAP_SHARED and registered ReadOnly | Mapped.
class SealedMemfd {
 public:
  template <typename Fill>
  static Result<SealedMemfd> create(uint64_t bytes, Fill fill) {
    SealedMemfd m;
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    const uint64_t size = (bytes + page - 1) / page * page;
    m.fd_ = UniqueFd(memfd_create("expert-gpu-bench", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    if (!m.fd_.valid()) return sys_error("memfd_create");
    if (ftruncate(m.fd_.get(), static_cast<off_t>(size)) != 0) return sys_error("ftruncate");
    if (fcntl(m.fd_.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
      return sys_error("F_ADD_SEALS(shrink|grow)");
    }
    m.writable_ =
        Mapping::map(size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, m.fd_.get(), 0);
    if (!m.writable_.valid()) return sys_error("mmap(PROT_WRITE)");
    fill(m.writable_.data());
    if (fcntl(m.fd_.get(), F_ADD_SEALS, F_SEAL_FUTURE_WRITE | F_SEAL_SEAL) != 0) {
      return sys_error("F_ADD_SEALS(future_write|seal)");
    }
    m.readable_ = Mapping::map(size, PROT_READ, MAP_SHARED | MAP_POPULATE, m.fd_.get(), 0);
    if (!m.readable_.valid()) return sys_error("mmap(PROT_READ)");
    EXPERTD_TRY_ASSIGN(m.registration_,
                       HostRegistration::create(m.readable_.data(), size,
                                                cudaHostRegisterReadOnly | cudaHostRegisterMapped));
    void* d = nullptr;
    EXPERTD_CUDA_TRY(cudaHostGetDevicePointer(&d, m.readable_.data(), 0));
    m.device_ = static_cast<const uint8_t*>(d);
    return m;
  }
  SealedMemfd() = default;
  SealedMemfd(SealedMemfd&&) = default;
  // Member-wise assignment would unmap the old mapping before its registration went.
  SealedMemfd& operator=(SealedMemfd&&) = delete;

  const uint8_t* host() const { return readable_.data(); }
  const uint8_t* device() const { return device_; }

 private:
  // Destroyed last to first: the registration goes before the mapping it pins, the mappings
  // before the fd.
  UniqueFd fd_;
  Mapping writable_;  // the "daemon's" mapping, which filled the memfd
  Mapping readable_;  // the engine's PROT_READ mapping, registered
  HostRegistration registration_;
  const uint8_t* device_ = nullptr;  // readable_ as the device addresses it
};

// ---- Timing -----------------------------------------------------------------------------

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Milliseconds of one run of `op` (which enqueues its work on `stream`), between two events.
template <typename Op>
Result<double> time_once(cudaStream_t stream, const CudaEvent& start, const CudaEvent& stop,
                         Op& op) {
  EXPERTD_CUDA_TRY(cudaEventRecord(start.get(), stream));
  EXPERTD_TRY(op());
  EXPERTD_CUDA_TRY(cudaEventRecord(stop.get(), stream));
  EXPERTD_CUDA_TRY(cudaEventSynchronize(stop.get()));
  float ms = 0.0f;
  EXPERTD_CUDA_TRY(cudaEventElapsedTime(&ms, start.get(), stop.get()));
  return static_cast<double>(ms);
}

// The median milliseconds of `iters` runs after `warmup` untimed ones.
template <typename Op>
Result<double> time_median(cudaStream_t stream, uint32_t warmup, uint32_t iters, Op op) {
  EXPERTD_TRY_ASSIGN(CudaEvent start, CudaEvent::create());
  EXPERTD_TRY_ASSIGN(CudaEvent stop, CudaEvent::create());
  for (uint32_t i = 0; i < warmup; ++i) EXPERTD_TRY(op());
  EXPERTD_CUDA_TRY(cudaStreamSynchronize(stream));
  std::vector<double> ms;
  for (uint32_t i = 0; i < iters; ++i) {
    EXPERTD_TRY_ASSIGN(const double t, time_once(stream, start, stop, op));
    ms.push_back(t);
  }
  return median(std::move(ms));
}

double gbps(uint64_t bytes, double ms) { return ms > 0.0 ? bytes / (ms * 1e-3) / 1e9 : 0.0; }

// ---- Weights ----------------------------------------------------------------------------

uint64_t xorshift(uint64_t& s) {
  s ^= s << 13;
  s ^= s >> 7;
  s ^= s << 17;
  return s;
}

float unit_float(uint64_t& s) {
  return static_cast<float>(static_cast<double>(xorshift(s) >> 11) * 0x1p-53 * 2.0 - 1.0);
}

// Valid random rows of `type`: random quants and packed scales, f16 block scales set to finite
// values of the size a real model has.
void fill_matrix(GgmlType type, uint8_t* dst, uint64_t rows, uint64_t cols, uint64_t row_bytes,
                 uint64_t seed) {
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  const GgmlTypeTraits& t = ggml_traits(type);
  const uint64_t blocks = cols / t.block_elems;
  for (uint64_t r = 0; r < rows; ++r) {
    uint8_t* row = dst + r * row_bytes;
    for (uint64_t i = 0; i + 8 <= row_bytes; i += 8) {
      const uint64_t v = xorshift(s);
      std::memcpy(row + i, &v, 8);
    }
    for (uint64_t b = 0; b < blocks; ++b) {
      uint8_t* blk = row + b * t.block_bytes;
      const float scale = 0.5f + 0.5f * std::fabs(unit_float(s));
      uint16_t h = 0;
      switch (type) {
        case GgmlType::F32: {
          const float v = unit_float(s);
          std::memcpy(blk, &v, 4);
          break;
        }
        case GgmlType::F16:
          h = float_to_f16(unit_float(s));
          std::memcpy(blk, &h, 2);
          break;
        case GgmlType::BF16:
          h = float_to_bf16(unit_float(s));
          std::memcpy(blk, &h, 2);
          break;
        case GgmlType::Q8_0:
          h = float_to_f16(scale / 127.0f);
          std::memcpy(blk, &h, 2);
          break;
        case GgmlType::Q4_K:
          h = float_to_f16(scale / 600.0f);
          std::memcpy(blk, &h, 2);
          std::memcpy(blk + 2, &h, 2);
          break;
        case GgmlType::Q6_K:
          h = float_to_f16(scale / 2000.0f);
          std::memcpy(blk + 208, &h, 2);
          break;
        case GgmlType::MXFP4:  // e8m0 exponent: scales 2^-8 .. 2^-5, values up to 12 * 2^-5
          blk[0] = static_cast<uint8_t>(120 + (xorshift(s) & 3));
          break;
        default:
          break;
      }
    }
  }
}

// E experts' gate, up (rows x cols) and down (cols x rows) matrices, each at a kAlign boundary of
// one buffer.
struct ExpertLayout {
  GgmlType type = GgmlType::Q4_K;
  uint32_t n_ff = 0;
  uint32_t n_embd = 0;
  uint32_t experts = 0;
  uint64_t gu_row_bytes = 0;
  uint64_t down_row_bytes = 0;
  uint64_t gate_bytes = 0;  // also up's
  uint64_t down_bytes = 0;
  uint64_t expert_stride = 0;

  uint64_t gate(uint32_t e) const { return e * expert_stride; }
  uint64_t up(uint32_t e) const { return gate(e) + round(gate_bytes); }
  uint64_t down(uint32_t e) const { return up(e) + round(gate_bytes); }
  uint64_t total() const { return experts * expert_stride; }
  uint64_t weight_bytes() const { return uint64_t{experts} * (2 * gate_bytes + down_bytes); }
  static uint64_t round(uint64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
};

Result<ExpertLayout> make_layout(GgmlType type, uint32_t n_ff, uint32_t n_embd, uint32_t experts) {
  ExpertLayout l;
  l.type = type;
  l.n_ff = n_ff;
  l.n_embd = n_embd;
  l.experts = experts;
  const auto gu = ggml_row_bytes(type, n_embd);
  const auto down = ggml_row_bytes(type, n_ff);
  if (!gu || !down) {
    return make_error(
        EINVAL, fmt::format("{}: --rows {} and --cols {} must be multiples of {}",
                            ggml_type_name(type), n_ff, n_embd, ggml_traits(type).block_elems));
  }
  l.gu_row_bytes = *gu;
  l.down_row_bytes = *down;
  l.gate_bytes = l.gu_row_bytes * n_ff;
  l.down_bytes = l.down_row_bytes * n_embd;
  l.expert_stride = 2 * ExpertLayout::round(l.gate_bytes) + ExpertLayout::round(l.down_bytes);
  return l;
}

void fill_experts(const ExpertLayout& l, uint8_t* base, uint64_t seed) {
  for (uint32_t e = 0; e < l.experts; ++e) {
    fill_matrix(l.type, base + l.gate(e), l.n_ff, l.n_embd, l.gu_row_bytes, seed + 3 * e);
    fill_matrix(l.type, base + l.up(e), l.n_ff, l.n_embd, l.gu_row_bytes, seed + 3 * e + 1);
    fill_matrix(l.type, base + l.down(e), l.n_embd, l.n_ff, l.down_row_bytes, seed + 3 * e + 2);
  }
}

// ---- The measurements ---------------------------------------------------------------------

struct CopyResult {
  uint64_t bytes = 0;
  double pinned_ms = 0;
  double memfd_ms = 0;
  bool verified = false;
};

Result<CopyResult> measure_copy(const Flags& f, uint64_t bytes) {
  CopyResult r;
  r.bytes = bytes;
  auto pattern = [](uint8_t* p, uint64_t n) {
    uint64_t s = 0x1234567;
    for (uint64_t i = 0; i + 8 <= n; i += 8) {
      const uint64_t v = xorshift(s);
      std::memcpy(p + i, &v, 8);
    }
  };
  EXPERTD_TRY_ASSIGN(PinnedBytes pinned, PinnedBytes::alloc(bytes));
  pattern(pinned.get(), bytes);
  EXPERTD_TRY_ASSIGN(SealedMemfd memfd,
                     SealedMemfd::create(bytes, [&](uint8_t* p) { pattern(p, bytes); }));
  EXPERTD_TRY_ASSIGN(DeviceBytes dst, DeviceBytes::alloc(bytes));
  EXPERTD_TRY_ASSIGN(CudaStream pinned_stream, CudaStream::create());
  EXPERTD_TRY_ASSIGN(CudaStream memfd_stream, CudaStream::create());
  EXPERTD_TRY_ASSIGN(CudaEvent start, CudaEvent::create());
  EXPERTD_TRY_ASSIGN(CudaEvent stop, CudaEvent::create());
  auto copy_pinned = [&]() -> Status {
    EXPERTD_CUDA_TRY(cudaMemcpyAsync(dst.get(), pinned.get(), bytes, cudaMemcpyHostToDevice,
                                     pinned_stream.get()));
    return Ok{};
  };
  auto copy_memfd = [&]() -> Status {
    EXPERTD_CUDA_TRY(cudaMemcpyAsync(dst.get(), memfd.host(), bytes, cudaMemcpyHostToDevice,
                                     memfd_stream.get()));
    return Ok{};
  };
  for (uint32_t i = 0; i < f.warmup; ++i) {
    EXPERTD_TRY(copy_pinned());
    EXPERTD_TRY(copy_memfd());
  }
  EXPERTD_CUDA_TRY(cudaDeviceSynchronize());
  // Alternate rounds, so drift in the link or the host affects both alike.
  std::vector<double> a;
  std::vector<double> b;
  for (uint32_t i = 0; i < f.iters; ++i) {
    EXPERTD_TRY_ASSIGN(const double ta, time_once(pinned_stream.get(), start, stop, copy_pinned));
    a.push_back(ta);
    EXPERTD_TRY_ASSIGN(const double tb, time_once(memfd_stream.get(), start, stop, copy_memfd));
    b.push_back(tb);
  }
  r.pinned_ms = median(std::move(a));
  r.memfd_ms = median(std::move(b));
  // Off the clock: the last copy (from the memfd) delivered its bytes.
  std::vector<uint8_t> back(bytes);
  EXPERTD_CUDA_TRY(cudaMemcpy(back.data(), dst.get(), bytes, cudaMemcpyDeviceToHost));
  r.verified = std::memcmp(back.data(), memfd.host(), bytes) == 0;
  return r;
}

struct FfnBuffers {
  DeviceBytes x;        // n_embd
  DeviceBytes gu;       // gate outputs of every expert, then up outputs
  DeviceBytes h;        // swiglu outputs
  DeviceBytes eo;       // down outputs
  DeviceBytes weights;  // router weights
  DeviceBytes residual;
};

Result<FfnBuffers> make_ffn_buffers(const ExpertLayout& l, cudaStream_t stream) {
  FfnBuffers b;
  const uint64_t e = l.experts;
  EXPERTD_TRY_ASSIGN(b.x, DeviceBytes::alloc(uint64_t{l.n_embd} * 4));
  EXPERTD_TRY_ASSIGN(b.gu, DeviceBytes::alloc(2 * e * l.n_ff * 4));
  EXPERTD_TRY_ASSIGN(b.h, DeviceBytes::alloc(e * l.n_ff * 4));
  EXPERTD_TRY_ASSIGN(b.eo, DeviceBytes::alloc(e * l.n_embd * 4));
  EXPERTD_TRY_ASSIGN(b.weights, DeviceBytes::alloc(e * 4));
  EXPERTD_TRY_ASSIGN(b.residual, DeviceBytes::alloc(uint64_t{l.n_embd} * 4));
  uint64_t s = 99;
  std::vector<float> x(l.n_embd);
  for (float& v : x) v = unit_float(s);
  std::vector<float> w(e, 1.0f / static_cast<float>(e));
  EXPERTD_CUDA_TRY(
      cudaMemcpyAsync(b.x.get(), x.data(), x.size() * 4, cudaMemcpyHostToDevice, stream));
  EXPERTD_CUDA_TRY(
      cudaMemcpyAsync(b.weights.get(), w.data(), w.size() * 4, cudaMemcpyHostToDevice, stream));
  EXPERTD_CUDA_TRY(cudaMemsetAsync(b.residual.get(), 0, uint64_t{l.n_embd} * 4, stream));
  EXPERTD_CUDA_TRY(cudaStreamSynchronize(stream));
  return b;
}

// Which launches of the fused FFN to time: all of them, or one projection's matvec alone.
enum class FfnPart { kAll, kGateUp, kDown };

// The engine's expert FFN with the fused kernels, the weights at `base` (device memory or the
// device pointer of registered host memory). With `fuse_swiglu` the down projection reads the gate
// and up outputs (MatvecBatch::up) and no swiglu launch runs.
Status fused_ffn(const ExpertLayout& l, const uint8_t* base, const FfnBuffers& b,
                 cudaStream_t stream, FfnPart part = FfnPart::kAll,
                 kernels::MatvecVariant variant = kernels::MatvecVariant::kDefault,
                 bool fuse_swiglu = false) {
  const uint32_t e = l.experts;
  float* gu = b.gu.get<float>();
  kernels::MatvecBatch gate_up;
  gate_up.count = 2 * e;
  for (uint32_t i = 0; i < e; ++i) {
    gate_up.w[i] = base + l.gate(i);
    gate_up.w[e + i] = base + l.up(i);
    gate_up.x[i] = gate_up.x[e + i] = b.x.get<float>();
    gate_up.y[i] = gu + uint64_t{i} * l.n_ff;
    gate_up.y[e + i] = gu + uint64_t{e + i} * l.n_ff;
  }
  if (part != FfnPart::kDown) {
    EXPERTD_CUDA_TRY(kernels::matvec_batched(l.type, gate_up, l.gu_row_bytes, l.n_ff, l.n_embd,
                                             stream, variant));
  }
  if (part == FfnPart::kGateUp) return Ok{};
  if (part == FfnPart::kAll && !fuse_swiglu) {
    EXPERTD_CUDA_TRY(kernels::swiglu(gu, gu + uint64_t{e} * l.n_ff, b.h.get<float>(),
                                     uint64_t{e} * l.n_ff, stream));
  }
  kernels::MatvecBatch down;
  down.count = e;
  for (uint32_t i = 0; i < e; ++i) {
    down.w[i] = base + l.down(i);
    if (fuse_swiglu) {
      down.x[i] = gu + uint64_t{i} * l.n_ff;
      down.up[i] = gu + uint64_t{e + i} * l.n_ff;
    } else {
      down.x[i] = b.h.get<float>() + uint64_t{i} * l.n_ff;
    }
    down.y[i] = b.eo.get<float>() + uint64_t{i} * l.n_embd;
  }
  EXPERTD_CUDA_TRY(
      kernels::matvec_batched(l.type, down, l.down_row_bytes, l.n_embd, l.n_ff, stream, variant));
  if (part == FfnPart::kDown) return Ok{};
  EXPERTD_CUDA_TRY(kernels::moe_combine(b.eo.get<float>(), b.weights.get<float>(),
                                        b.residual.get<float>(), e, l.n_embd, stream));
  return Ok{};
}

// y = W x for a row-major rows x cols f32 matrix: cuBLAS sees it as the column-major cols x rows
// matrix W^T, so the product is op(A) = A^T.
Status sgemv(cublasHandle_t h, const float* w, uint32_t rows, uint32_t cols, const float* x,
             float* y) {
  const float one = 1.0f;
  const float zero = 0.0f;
  EXPERTD_CUBLAS_TRY(cublasSgemv(h, CUBLAS_OP_T, static_cast<int>(cols), static_cast<int>(rows),
                                 &one, w, static_cast<int>(cols), x, 1, &zero, y, 1));
  return Ok{};
}

// The same FFN as dequantise-to-f32 + cublasSgemv, one matrix at a time through `scratch`. With
// `dequant` false only the GEMVs run (on whatever f32 scratch holds): their share of the time.
Status cublas_ffn(const ExpertLayout& l, const uint8_t* base, const FfnBuffers& b,
                  const DeviceBytes& scratch, cublasHandle_t h, cudaStream_t stream, bool dequant,
                  bool gemv) {
  const uint32_t e = l.experts;
  float* gu = b.gu.get<float>();
  float* f32 = scratch.get<float>();
  const uint64_t gu_elems = uint64_t{l.n_ff} * l.n_embd;
  for (uint32_t i = 0; i < e; ++i) {
    for (const uint32_t j : {i, e + i}) {
      const uint8_t* w = base + (j < e ? l.gate(i) : l.up(i));
      if (dequant) EXPERTD_CUDA_TRY(kernels::dequantize(l.type, w, f32, gu_elems, stream));
      if (gemv) EXPERTD_TRY(sgemv(h, f32, l.n_ff, l.n_embd, b.x.get<float>(), gu + j * l.n_ff));
    }
  }
  EXPERTD_CUDA_TRY(kernels::swiglu(gu, gu + uint64_t{e} * l.n_ff, b.h.get<float>(),
                                   uint64_t{e} * l.n_ff, stream));
  for (uint32_t i = 0; i < e; ++i) {
    if (dequant) {
      EXPERTD_CUDA_TRY(kernels::dequantize(l.type, base + l.down(i), f32, gu_elems, stream));
    }
    if (gemv) {
      EXPERTD_TRY(sgemv(h, f32, l.n_embd, l.n_ff, b.h.get<float>() + uint64_t{i} * l.n_ff,
                        b.eo.get<float>() + uint64_t{i} * l.n_embd));
    }
  }
  EXPERTD_CUDA_TRY(kernels::moe_combine(b.eo.get<float>(), b.weights.get<float>(),
                                        b.residual.get<float>(), e, l.n_embd, stream));
  return Ok{};
}

Result<std::vector<float>> download(const DeviceBytes& m, uint64_t count) {
  std::vector<float> v(count);
  EXPERTD_CUDA_TRY(cudaMemcpy(v.data(), m.get(), count * 4, cudaMemcpyDeviceToHost));
  return v;
}

double normalised_diff(const std::vector<float>& a, const std::vector<float>& ref) {
  double diff = 0.0;
  double mag = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(static_cast<double>(a[i]) - ref[i]);
    if (std::isnan(d)) return d;
    diff = std::max(diff, d);
    mag = std::max(mag, std::fabs(static_cast<double>(ref[i])));
  }
  return mag > 0.0 ? diff / mag : diff;
}

// One kernel variant's figures (milliseconds for all --experts experts).
struct VariantResult {
  kernels::MatvecVariant variant = kernels::MatvecVariant::kBase;
  double ffn_ms = 0;           // gate+up, swiglu, down, combine: four launches
  double ffn_swiglu_ms = 0;    // gate+up, down with SwiGLU fused, combine: three launches
  double graph_ms = 0;         // the four launches as one CUDA graph
  double graph_swiglu_ms = 0;  // the three launches as one CUDA graph
  double gate_up_ms = 0;
  double down_ms = 0;
  double down_swiglu_ms = 0;  // the down projection reading the gate and up outputs
  double diff = 0;            // normalised max difference of the expert outputs from kBase's
  double diff_swiglu = 0;     // the same with SwiGLU fused
  std::string error;          // set when a launch failed; the figures are then 0
  std::string graph_error;    // set when capturing or replaying a graph failed (graph_* stay 0)
};

// The fastest of a variant's whole-FFN timings that ran.
double fastest(const VariantResult& v) {
  double best = 0.0;
  for (const double ms : {v.ffn_ms, v.ffn_swiglu_ms, v.graph_ms, v.graph_swiglu_ms}) {
    if (ms > 0.0 && (best == 0.0 || ms < best)) best = ms;
  }
  return best;
}

struct FfnResult {
  double d2d_ms = 0;
  double read_ms = 0;
  double fused_ms = 0;
  double gate_up_ms = 0;  // the fused gate + up matvec_batched alone
  double down_ms = 0;     // the fused down matvec_batched alone
  double cublas_ms = 0;
  double dequant_ms = 0;
  double sgemv_ms = 0;
  double inplace_ms = 0;
  double cublas_vs_fused = 0;   // normalised max difference of the expert outputs
  double inplace_vs_fused = 0;  // the same kernels on the same bytes: 0
  std::vector<VariantResult> variants;
};

Result<std::vector<float>> download(const DeviceBytes& m, uint64_t count);
double normalised_diff(const std::vector<float>& a, const std::vector<float>& ref);

Result<std::vector<kernels::MatvecVariant>> parse_variants(const std::string& list) {
  std::vector<kernels::MatvecVariant> out;
  if (list.empty()) return out;
  if (list == "all") {
    for (const kernels::MatvecVariant v : kernels::kAllMatvecVariants) out.push_back(v);
    return out;
  }
  size_t pos = 0;
  while (pos <= list.size()) {
    const size_t comma = std::min(list.find(',', pos), list.size());
    const std::string name = list.substr(pos, comma - pos);
    const auto v = kernels::matvec_variant_from_name(name);
    if (!v || *v == kernels::MatvecVariant::kDefault) {
      return make_error(EINVAL, fmt::format("--variants: \"{}\" is not one of base, splitk2, "
                                            "splitk4, splitk8, splitk, base+pdl, splitk+pdl, q6r2, "
                                            "splitk+q6r2, all",
                                            name));
    }
    out.push_back(*v);
    pos = comma + 1;
  }
  return out;
}

// The median milliseconds of the work `enqueue` puts on `s`, captured once as a CUDA graph and
// replayed.
template <typename Enqueue>
Result<double> time_graph(const Flags& f, cudaStream_t s, Enqueue enqueue) {
  EXPERTD_TRY_ASSIGN(CudaGraphExec g, CudaGraphExec::capture(s, enqueue));
  EXPERTD_TRY_ASSIGN(const double ms, time_median(s, f.warmup, f.iters, [&]() -> Status {
                       EXPERTD_CUDA_TRY(cudaGraphLaunch(g.get(), s));
                       return Ok{};
                     }));
  EXPERTD_CUDA_TRY(cudaStreamSynchronize(s));  // before the graph goes
  return ms;
}

// The timings of one variant into *out (out->variant set by the caller).
Status measure_variant(const Flags& f, const ExpertLayout& l, const uint8_t* weights,
                       const FfnBuffers& b, cudaStream_t s, const std::vector<float>& base_out,
                       VariantResult* out) {
  VariantResult& r = *out;
  const kernels::MatvecVariant v = r.variant;
  const uint64_t out_count = uint64_t{l.experts} * l.n_embd;
  auto ffn = [&](FfnPart part, bool fuse) {
    return [&, part, fuse]() -> Status { return fused_ffn(l, weights, b, s, part, v, fuse); };
  };
  EXPERTD_TRY_ASSIGN(r.ffn_ms, time_median(s, f.warmup, f.iters, ffn(FfnPart::kAll, false)));
  EXPERTD_CUDA_TRY(cudaStreamSynchronize(s));
  EXPERTD_TRY_ASSIGN(const std::vector<float> plain_out, download(b.eo, out_count));
  r.diff = normalised_diff(plain_out, base_out);
  EXPERTD_TRY_ASSIGN(r.ffn_swiglu_ms, time_median(s, f.warmup, f.iters, ffn(FfnPart::kAll, true)));
  EXPERTD_CUDA_TRY(cudaStreamSynchronize(s));
  EXPERTD_TRY_ASSIGN(const std::vector<float> swiglu_out, download(b.eo, out_count));
  r.diff_swiglu = normalised_diff(swiglu_out, base_out);
  EXPERTD_TRY_ASSIGN(r.gate_up_ms, time_median(s, f.warmup, f.iters, ffn(FfnPart::kGateUp, false)));
  EXPERTD_TRY_ASSIGN(r.down_ms, time_median(s, f.warmup, f.iters, ffn(FfnPart::kDown, false)));
  EXPERTD_TRY_ASSIGN(r.down_swiglu_ms,
                     time_median(s, f.warmup, f.iters, ffn(FfnPart::kDown, true)));
  // The graphs last: a driver that cannot capture these launches (clusters, programmatic
  // dependencies) loses only the graph columns, said in the variant's row.
  for (const bool fuse : {false, true}) {
    const Result<double> ms = time_graph(f, s, ffn(FfnPart::kAll, fuse));
    if (!ms) {
      (void)cudaStreamSynchronize(s);
      (void)cudaGetLastError();
      r.graph_error = ms.error().message;
      break;
    }
    (fuse ? r.graph_swiglu_ms : r.graph_ms) = *ms;
  }
  return Ok{};
}

// Every variant of --variants on the experts at `weights`, outputs against kBase's. One variant's
// failure (a launch the device refuses) is reported in its row and the others still run; a sticky
// error fails them all, as it should.
Result<std::vector<VariantResult>> measure_variants(const Flags& f, const ExpertLayout& l,
                                                    const uint8_t* weights, const FfnBuffers& b,
                                                    cudaStream_t s) {
  using kernels::MatvecVariant;
  EXPERTD_TRY_ASSIGN(const std::vector<MatvecVariant> list, parse_variants(f.variants));
  std::vector<VariantResult> out;
  if (list.empty()) return out;
  const uint64_t out_count = uint64_t{l.experts} * l.n_embd;
  EXPERTD_TRY(fused_ffn(l, weights, b, s, FfnPart::kAll, MatvecVariant::kBase));
  EXPERTD_CUDA_TRY(cudaStreamSynchronize(s));
  EXPERTD_TRY_ASSIGN(const std::vector<float> base_out, download(b.eo, out_count));
  for (const MatvecVariant v : list) {
    VariantResult r;
    r.variant = v;
    const Status st = measure_variant(f, l, weights, b, s, base_out, &r);
    if (!st) {
      (void)cudaStreamSynchronize(s);
      (void)cudaGetLastError();
      r = VariantResult{};
      r.variant = v;
      r.error = st.error().message;
    }
    out.push_back(r);
  }
  return out;
}

Result<FfnResult> measure_ffn(const Flags& f, const ExpertLayout& l) {
  FfnResult r;
  EXPERTD_TRY_ASSIGN(CudaStream stream, CudaStream::create());
  const cudaStream_t s = stream.get();
  std::vector<uint8_t> host(l.total());
  fill_experts(l, host.data(), f.seed);
  EXPERTD_TRY_ASSIGN(DeviceBytes weights, DeviceBytes::alloc(l.total()));
  EXPERTD_CUDA_TRY(cudaMemcpy(weights.get(), host.data(), l.total(), cudaMemcpyHostToDevice));
  EXPERTD_TRY_ASSIGN(FfnBuffers b, make_ffn_buffers(l, s));

  // HBM yardsticks over the same bytes.
  {
    EXPERTD_TRY_ASSIGN(DeviceBytes copy, DeviceBytes::alloc(l.total()));
    EXPERTD_TRY_ASSIGN(r.d2d_ms, time_median(s, f.warmup, f.iters, [&]() -> Status {
                         EXPERTD_CUDA_TRY(cudaMemcpyAsync(copy.get(), weights.get(), l.total(),
                                                          cudaMemcpyDeviceToDevice, s));
                         return Ok{};
                       }));
  }
  EXPERTD_TRY_ASSIGN(DeviceBytes sink, DeviceBytes::alloc(16));
  EXPERTD_TRY_ASSIGN(
      r.read_ms, time_median(s, f.warmup, f.iters, [&]() -> Status {
        EXPERTD_CUDA_TRY(kernels::read_bytes(weights.get(), l.total(), sink.get<uint32_t>(), s));
        return Ok{};
      }));

  // Fused.
  EXPERTD_TRY_ASSIGN(r.fused_ms, time_median(s, f.warmup, f.iters, [&]() -> Status {
                       return fused_ffn(l, weights.get(), b, s);
                     }));
  EXPERTD_TRY_ASSIGN(r.gate_up_ms, time_median(s, f.warmup, f.iters, [&]() -> Status {
                       return fused_ffn(l, weights.get(), b, s, FfnPart::kGateUp);
                     }));
  EXPERTD_TRY_ASSIGN(r.down_ms, time_median(s, f.warmup, f.iters, [&]() -> Status {
                       return fused_ffn(l, weights.get(), b, s, FfnPart::kDown);
                     }));
  EXPERTD_CUDA_TRY(cudaStreamSynchronize(s));
  const uint64_t out_count = uint64_t{l.experts} * l.n_embd;
  EXPERTD_TRY_ASSIGN(const std::vector<float> fused_out, download(b.eo, out_count));

  // Dequantise + cuBLAS, and its two halves.
  {
    EXPERTD_TRY_ASSIGN(DeviceBytes scratch,
                       DeviceBytes::alloc(uint64_t{l.n_ff} * l.n_embd * sizeof(float)));
    EXPERTD_TRY_ASSIGN(CublasHandle cublas, CublasHandle::create(s));
    EXPERTD_TRY_ASSIGN(r.cublas_ms, time_median(s, f.warmup, f.iters, [&]() -> Status {
                         return cublas_ffn(l, weights.get(), b, scratch, cublas.get(), s, true,
                                           true);
                       }));
    EXPERTD_CUDA_TRY(cudaStreamSynchronize(s));
    EXPERTD_TRY_ASSIGN(const std::vector<float> cublas_out, download(b.eo, out_count));
    r.cublas_vs_fused = normalised_diff(fused_out, cublas_out);
    EXPERTD_TRY_ASSIGN(r.dequant_ms, time_median(s, f.warmup, f.iters, [&]() -> Status {
                         return cublas_ffn(l, weights.get(), b, scratch, cublas.get(), s, true,
                                           false);
                       }));
    EXPERTD_TRY_ASSIGN(r.sgemv_ms, time_median(s, f.warmup, f.iters, [&]() -> Status {
                         return cublas_ffn(l, weights.get(), b, scratch, cublas.get(), s, false,
                                           true);
                       }));
  }

  // Fused, reading the weights in place from registered host memory.
  if (f.inplace) {
    EXPERTD_TRY_ASSIGN(SealedMemfd memfd, SealedMemfd::create(l.total(), [&](uint8_t* p) {
                         std::memcpy(p, host.data(), l.total());
                       }));
    EXPERTD_TRY_ASSIGN(r.inplace_ms, time_median(s, f.warmup, f.iters, [&]() -> Status {
                         return fused_ffn(l, memfd.device(), b, s);
                       }));
    EXPERTD_CUDA_TRY(cudaStreamSynchronize(s));
    EXPERTD_TRY_ASSIGN(const std::vector<float> inplace_out, download(b.eo, out_count));
    r.inplace_vs_fused = normalised_diff(inplace_out, fused_out);
  }
  EXPERTD_TRY_ASSIGN(r.variants, measure_variants(f, l, weights.get(), b, s));
  return r;
}

// ---- Report -------------------------------------------------------------------------------

struct DeviceInfo {
  std::string name;
  int sms = 0;
  uint64_t memory_bytes = 0;
  double peak_gbps = 0;  // from the memory clock and bus width the driver reports
  int pci_bus = 0;
};

Result<DeviceInfo> describe_device(int dev) {
  DeviceInfo d;
  cudaDeviceProp p{};
  EXPERTD_CUDA_TRY(cudaGetDeviceProperties(&p, dev));
  d.name = p.name;
  d.sms = p.multiProcessorCount;
  d.memory_bytes = p.totalGlobalMem;
  d.pci_bus = p.pciBusID;
  int clock_khz = 0;
  EXPERTD_CUDA_TRY(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, dev));
  d.peak_gbps = 2.0 * clock_khz * 1e3 * (p.memoryBusWidth / 8.0) / 1e9;
  return d;
}

Status run(const Flags& f) {
  const auto type = ggml_type_from_name(f.type);
  if (!type || !expert_type_supported(*type)) {
    return make_error(
        EINVAL,
        fmt::format("--type {}: not one of f32, f16, bf16, q8_0, q4_k, q6_k, mxfp4", f.type));
  }
  if (f.experts == 0 || 2 * f.experts > kernels::kMaxBatch) {
    return make_error(EINVAL, fmt::format("--experts must be 1..{}", kernels::kMaxBatch / 2));
  }
  EXPERTD_CUDA_TRY(cudaSetDevice(f.device));
  EXPERTD_TRY_ASSIGN(const DeviceInfo dev, describe_device(f.device));
  EXPERTD_TRY_ASSIGN(const ExpertLayout layout, make_layout(*type, f.rows, f.cols, f.experts));
  uint64_t copy_bytes = 3 * layout.gate_bytes;
  if (!f.copy_bytes.empty()) {
    const auto b = parse_bytes(f.copy_bytes);
    if (!b || *b == 0) return make_error(EINVAL, "--copy-bytes: not a size: " + f.copy_bytes);
    copy_bytes = *b;
  }
  const MachineInfo machine = describe_machine("/tmp");
  FILE* table = f.json ? stderr : stdout;
  fmt::print(table, "expert-gpu-bench: {} ({} SMs, {}, HBM spec {:.0f} GB/s) on {}\n", dev.name,
             dev.sms, format_bytes(dev.memory_bytes), dev.peak_gbps, machine.host);
  std::fflush(table);

  EXPERTD_TRY_ASSIGN(const CopyResult copy, measure_copy(f, copy_bytes));
  const double pinned_gbps = gbps(copy.bytes, copy.pinned_ms);
  const double memfd_gbps = gbps(copy.bytes, copy.memfd_ms);
  const double copy_ratio = pinned_gbps > 0 ? memfd_gbps / pinned_gbps : 0;
  fmt::print(table, "\nhost -> device copy of {} ({} rounds each, alternating)\n",
             format_bytes(copy.bytes), f.iters);
  fmt::print(table, "  {:<52} {:>9.2f} GB/s\n", "cudaMallocHost + cudaMemcpyAsync", pinned_gbps);
  fmt::print(table, "  {:<52} {:>9.2f} GB/s\n", "sealed memfd, registered ReadOnly|Mapped",
             memfd_gbps);
  fmt::print(table, "  ratio memfd / pinned: {:.3f} (goal >= 0.9); bytes verified: {}\n",
             copy_ratio, copy.verified ? "yes" : "NO");

  EXPERTD_TRY_ASSIGN(const FfnResult ffn, measure_ffn(f, layout));
  const uint64_t wb = layout.weight_bytes();
  const double read_gbps = gbps(layout.total(), ffn.read_ms);
  const double fused_gbps = gbps(wb, ffn.fused_ms);
  const double fused_vs_read = read_gbps > 0 ? fused_gbps / read_gbps : 0;
  auto per_expert_us = [&](double ms) { return ms * 1e3 / f.experts; };
  fmt::print(table, "\nexpert FFN, batch 1: {} expert(s) of {} x {} {} ({} of weights)\n",
             f.experts, f.rows, f.cols, f.type, format_bytes(wb));
  fmt::print(table, "  {:<52} {:>9.2f} GB/s (read + write)\n", "HBM: device-to-device copy",
             gbps(2 * layout.total(), ffn.d2d_ms));
  fmt::print(table, "  {:<52} {:>9.2f} GB/s\n", "HBM: read-only kernel", read_gbps);
  fmt::print(table, "  {:<52} {:>9.2f} us/expert {:>9.2f} GB/s\n",
             "fused matvec_batched + swiglu + down + combine", per_expert_us(ffn.fused_ms),
             fused_gbps);
  const uint64_t gu_bytes = uint64_t{f.experts} * 2 * layout.gate_bytes;
  const uint64_t down_bytes = uint64_t{f.experts} * layout.down_bytes;
  fmt::print(table, "  {:<52} {:>9.2f} us/expert {:>9.2f} GB/s ({:.3f} of read-only)\n",
             "  fused gate + up matvec_batched alone", per_expert_us(ffn.gate_up_ms),
             gbps(gu_bytes, ffn.gate_up_ms),
             read_gbps > 0 ? gbps(gu_bytes, ffn.gate_up_ms) / read_gbps : 0.0);
  fmt::print(table, "  {:<52} {:>9.2f} us/expert {:>9.2f} GB/s ({:.3f} of read-only)\n",
             "  fused down matvec_batched alone", per_expert_us(ffn.down_ms),
             gbps(down_bytes, ffn.down_ms),
             read_gbps > 0 ? gbps(down_bytes, ffn.down_ms) / read_gbps : 0.0);
  fmt::print(table, "  {:<52} {:>9.2f} us/expert {:>9.2f} GB/s\n",
             "dequantise to f32 + cublasSgemv", per_expert_us(ffn.cublas_ms),
             gbps(wb, ffn.cublas_ms));
  fmt::print(table, "  {:<52} {:>9.2f} us/expert\n", "  of which dequantise",
             per_expert_us(ffn.dequant_ms));
  fmt::print(table, "  {:<52} {:>9.2f} us/expert\n", "  of which cublasSgemv on f32",
             per_expert_us(ffn.sgemv_ms));
  fmt::print(table,
             "  fused / read-only bandwidth: {:.3f} (goal >= 0.7); cuBLAS path / fused "
             "time: {:.2f}x\n",
             fused_vs_read, ffn.fused_ms > 0 ? ffn.cublas_ms / ffn.fused_ms : 0.0);
  fmt::print(table, "  outputs: fused vs cuBLAS max normalised difference {:.2e}\n",
             ffn.cublas_vs_fused);
  if (f.inplace) {
    fmt::print(table, "  {:<52} {:>9.2f} us/expert {:>9.2f} GB/s\n",
               "fused, weights in place in registered memfd (PCIe)", per_expert_us(ffn.inplace_ms),
               gbps(wb, ffn.inplace_ms));
    fmt::print(table,
               "  in place vs device memory: {:.3f} of the pinned copy rate; outputs "
               "differ by {:.2e}\n",
               pinned_gbps > 0 ? gbps(wb, ffn.inplace_ms) / pinned_gbps : 0.0,
               ffn.inplace_vs_fused);
  }

  if (!ffn.variants.empty()) {
    auto frac = [&](uint64_t bytes, double ms) {
      return read_gbps > 0 ? gbps(bytes, ms) / read_gbps : 0.0;
    };
    fmt::print(table,
               "\nmatvec variants ({} expert(s) per launch, fraction of read-only {:.0f} GB/s; "
               "+sw: SwiGLU fused into down; graph: one CUDA graph per layer)\n",
               f.experts, read_gbps);
    fmt::print(table, "  {:<12} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>10} {:>9} {:>8}\n",
               "variant", "ffn", "ffn+sw", "graph", "graph+sw", "gate+up", "down", "down+sw",
               "us/layer", "diff", "diff+sw");
    for (const VariantResult& v : ffn.variants) {
      if (!v.error.empty()) {
        fmt::print(table, "  {:<12} failed: {}\n", kernels::matvec_variant_name(v.variant),
                   v.error);
        continue;
      }
      fmt::print(table,
                 "  {:<12} {:>8.3f} {:>8.3f} {:>8.3f} {:>8.3f} {:>8.3f} {:>8.3f} {:>8.3f} "
                 "{:>10.2f} {:>9.2e} {:>8.2e}\n",
                 kernels::matvec_variant_name(v.variant), frac(wb, v.ffn_ms),
                 frac(wb, v.ffn_swiglu_ms), frac(wb, v.graph_ms), frac(wb, v.graph_swiglu_ms),
                 frac(gu_bytes, v.gate_up_ms), frac(down_bytes, v.down_ms),
                 frac(down_bytes, v.down_swiglu_ms), 1e3 * fastest(v), v.diff, v.diff_swiglu);
      if (!v.graph_error.empty()) {
        fmt::print(table, "  {:<12} graph failed: {}\n", "", v.graph_error);
      }
    }
  }

  if (f.json) {
    Json j;
    j["benchmark"] = "gpu";
    j["device"] = {{"name", dev.name},
                   {"sms", dev.sms},
                   {"memory_bytes", dev.memory_bytes},
                   {"hbm_spec_gbps", dev.peak_gbps},
                   {"pci_bus", dev.pci_bus}};
    j["machine"] = {{"host", machine.host},
                    {"date", machine.date},
                    {"cpus", machine.cpus},
                    {"ram_bytes", machine.ram_bytes},
                    {"kernel", machine.kernel}};
    j["iters"] = f.iters;
    j["warmup"] = f.warmup;
    j["copy"] = {{"bytes", copy.bytes}, {"pinned_gbps", pinned_gbps}, {"memfd_gbps", memfd_gbps},
                 {"ratio", copy_ratio}, {"goal_ratio", 0.9},          {"verified", copy.verified}};
    j["ffn"] = {{"type", f.type},
                {"rows", f.rows},
                {"cols", f.cols},
                {"experts", f.experts},
                {"weight_bytes", wb},
                {"hbm_d2d_gbps", gbps(2 * layout.total(), ffn.d2d_ms)},
                {"hbm_read_gbps", read_gbps},
                {"fused_us_per_expert", per_expert_us(ffn.fused_ms)},
                {"fused_gbps", fused_gbps},
                {"fused_vs_read", fused_vs_read},
                {"fused_gate_up_us_per_expert", per_expert_us(ffn.gate_up_ms)},
                {"fused_down_us_per_expert", per_expert_us(ffn.down_ms)},
                {"goal_fused_vs_read", 0.7},
                {"cublas_us_per_expert", per_expert_us(ffn.cublas_ms)},
                {"cublas_gbps", gbps(wb, ffn.cublas_ms)},
                {"dequant_us_per_expert", per_expert_us(ffn.dequant_ms)},
                {"sgemv_us_per_expert", per_expert_us(ffn.sgemv_ms)},
                {"cublas_vs_fused_time", ffn.fused_ms > 0 ? ffn.cublas_ms / ffn.fused_ms : 0.0},
                {"cublas_vs_fused_max_rel_diff", ffn.cublas_vs_fused}};
    if (!ffn.variants.empty()) {
      Json vs = Json::array();
      for (const VariantResult& v : ffn.variants) {
        auto entry = [&](uint64_t bytes, double ms) {
          return Json{{"us", ms * 1e3},
                      {"gbps", gbps(bytes, ms)},
                      {"vs_read", read_gbps > 0 ? gbps(bytes, ms) / read_gbps : 0.0}};
        };
        vs.push_back({{"variant", kernels::matvec_variant_name(v.variant)},
                      {"ffn", entry(wb, v.ffn_ms)},
                      {"ffn_swiglu", entry(wb, v.ffn_swiglu_ms)},
                      {"graph", entry(wb, v.graph_ms)},
                      {"graph_swiglu", entry(wb, v.graph_swiglu_ms)},
                      {"gate_up", entry(gu_bytes, v.gate_up_ms)},
                      {"down", entry(down_bytes, v.down_ms)},
                      {"down_swiglu", entry(down_bytes, v.down_swiglu_ms)},
                      {"max_rel_diff_vs_base", v.diff},
                      {"max_rel_diff_swiglu_vs_base", v.diff_swiglu},
                      {"error", v.error},
                      {"graph_error", v.graph_error}});
      }
      j["variants"] = vs;
    }
    if (f.inplace) {
      j["inplace"] = {
          {"fused_us_per_expert", per_expert_us(ffn.inplace_ms)},
          {"gbps", gbps(wb, ffn.inplace_ms)},
          {"vs_pinned_copy", pinned_gbps > 0 ? gbps(wb, ffn.inplace_ms) / pinned_gbps : 0.0},
          {"max_rel_diff_vs_device", ffn.inplace_vs_fused}};
    }
    std::puts(j.dump().c_str());
  }
  return Ok{};
}

}  // namespace
}  // namespace expertd::bench

int main(int argc, char** argv) {
  using expertd::bench::Flags;
  Flags f;
  CLI::App app{
      "expert-gpu-bench: host-to-device copy from pinned memory vs a registered sealed memfd, and "
      "the batch-1 expert FFN (fused dequant+matvec kernels vs dequantise + cuBLAS, and in place "
      "over PCIe) against the device's HBM bandwidth"};
  app.set_version_flag("--version", std::string("expert-gpu-bench ") + EXPERTD_VERSION);
  app.add_option("--rows", f.rows, "expert hidden size n_ff: gate/up rows, down columns")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1u << 20));
  app.add_option("--cols", f.cols, "model width n_embd: gate/up columns, down rows")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1u << 20));
  app.add_option("--type", f.type, "weight type: f32, f16, bf16, q8_0, q4_k, q6_k, mxfp4")
      ->capture_default_str();
  app.add_option("--experts", f.experts, "experts per token (the batched matvec's jobs / 2)")
      ->capture_default_str();
  app.add_option("--iters", f.iters, "timed iterations per measurement (the median is reported)")
      ->capture_default_str()
      ->check(CLI::Range(1u, 100000u));
  app.add_option("--warmup", f.warmup, "untimed iterations before each measurement")
      ->capture_default_str();
  app.add_option("--copy-bytes", f.copy_bytes,
                 "bytes per host-to-device copy, e.g. 99MB or 1GiB (default: 3 x the gate matrix)");
  app.add_flag("!--no-inplace", f.inplace, "skip the in-place (registered memfd) FFN run");
  app.add_option("--device", f.device, "CUDA device index")->capture_default_str();
  app.add_option("--seed", f.seed, "seed of the random weights")->capture_default_str();
  app.add_option("--variants", f.variants,
                 "matvec kernel variants to measure side by side: a comma-separated list of base, "
                 "splitk2, splitk4, splitk8, splitk, base+pdl, splitk+pdl, q6r2, splitk+q6r2, "
                 "or all");
  app.add_flag("--json", f.json, "print one JSON object on stdout (the table goes to stderr)");
  CLI11_PARSE(app, argc, argv);

  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    std::fprintf(stderr, "expert-gpu-bench: no CUDA device (%s)\n",
                 e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount found 0 devices");
    return 2;
  }
  const expertd::Status st = expertd::bench::run(f);
  if (!st) {
    std::fprintf(stderr, "expert-gpu-bench: %s\n", st.error().message.c_str());
    return 1;
  }
  return 0;
}
