// The CUDA kernels (kernels/*.cuh) against the CPU reference: engine/cpu_ops (rms_norm, rope_neox,
// softmax, dot), engine/dequant, and the loops of engine/cpu_engine.cc (attention, routing,
// SwiGLU, the weighted combine) written out again here. Random inputs of several shapes, odd ones
// included; every comparison reports the normalised error max|gpu - cpu| / max|cpu|.
//
// Tolerances (normalised error):
//   dequantize, moe_combine, add                    0 (bit-identical: same float operations)
//   gather/scatter_rows, moe_combine_rows           0 (moves, and moe_combine's operations)
//   rope_{neox,norm}_rows                           0 against rope_{neox,norm} at each row's
//   position causal_softmax                                  1e-6 (double exp and sum on both
//   sides) swiglu, rope_neox/norm, router probs and weights 1e-6 (double math on both sides)
//   rms_norm                                         1e-5 (float sum of squares vs double)
//   decode_attention                                 2e-5 (float online softmax vs double)
//   matvec, every type                               1e-5 (against dequantise + dot in double)
//   router experts                                   identical lists, ties to the lower index
//
// Every test skips, saying why, when there is no CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "base/fd.h"
#include "base/half.h"
#include "engine/cpu_ops.h"
#include "engine/dequant.h"
#include "engine/gpu_experts.h"
#include "kernels/attention.cuh"
#include "kernels/combine.cuh"
#include "kernels/cuda_raii.h"
#include "kernels/dequant.cuh"
#include "kernels/ds3.cuh"
#include "kernels/ds4.cuh"
#include "kernels/matvec.cuh"
#include "kernels/norm.cuh"
#include "kernels/prefill.cuh"
#include "kernels/rope.cuh"
#include "kernels/routing.cuh"
#include "kernels/swiglu.cuh"
#include "storage/ggml_types.h"

namespace expertd::kernels {
namespace {

// Empty when a CUDA device is usable, else what cudaGetDeviceCount said.
std::string missing_device() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    return std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")";
  }
  if (count == 0) return "cudaGetDeviceCount found 0 devices";
  return {};
}

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call << ": " << cudaGetErrorString(call)

// Every test runs on its own stream, as the engine's kernels do.
class GpuKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string why = missing_device();
    if (!why.empty()) GTEST_SKIP() << "no CUDA device: " << why;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) {
      EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
      EXPECT_EQ(cudaStreamDestroy(stream_), cudaSuccess);
    }
  }
  cudaError_t sync() { return cudaStreamSynchronize(stream_); }

  cudaStream_t stream_ = nullptr;
};

// A device allocation of n values of T.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    EXPECT_EQ(cudaMalloc(&p_, std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess);
  }
  explicit DeviceBuffer(const std::vector<T>& v) : DeviceBuffer(v.size()) { upload(v); }
  ~DeviceBuffer() {
    if (p_ != nullptr) cudaFree(p_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return static_cast<T*>(p_); }
  void upload(const std::vector<T>& v) {
    EXPECT_EQ(cudaMemcpy(p_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    // From pageable memory cudaMemcpy may return before the DMA lands, and the tests launch on a
    // non-blocking stream that does not wait for the legacy stream: wait here.
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  std::vector<T> download() const {
    std::vector<T> v(n_);
    EXPECT_EQ(cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }

 private:
  void* p_ = nullptr;
  size_t n_;
};

// max|got - want| / max|want| (max|got - want| when want is all zero); infinity when got has a
// NaN or infinity that want does not.
// The largest normalised error each test measured, printed when the run ends (the per-op
// figures of docs/KERNELS.md).
std::map<std::string, double>& worst_errors() {
  static std::map<std::string, double> worst;
  return worst;
}

class ErrorReport : public ::testing::Environment {
 public:
  void TearDown() override {
    for (const auto& [test, err] : worst_errors()) {
      std::printf("[ per-op ] %-48s max normalised error %.3e\n", test.c_str(), err);
    }
  }
};
const ::testing::Environment* const kErrorReport =
    ::testing::AddGlobalTestEnvironment(new ErrorReport);

double normalised_error_of(const std::vector<float>& got, const std::vector<float>& want);

double normalised_error(const std::vector<float>& got, const std::vector<float>& want) {
  const double err = normalised_error_of(got, want);
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  if (info != nullptr) {
    double& w = worst_errors()[info->name()];
    w = std::max(w, err);
  }
  return err;
}

double normalised_error_of(const std::vector<float>& got, const std::vector<float>& want) {
  EXPECT_EQ(got.size(), want.size());
  double diff = 0.0;
  double ref = 0.0;
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    if (!std::isfinite(got[i]) && std::isfinite(want[i])) {
      return std::numeric_limits<double>::infinity();
    }
    diff = std::max(diff, std::fabs(static_cast<double>(got[i]) - want[i]));
    ref = std::max(ref, std::fabs(static_cast<double>(want[i])));
  }
  return ref > 0.0 ? diff / ref : diff;
}

size_t bit_mismatches(const std::vector<float>& got, const std::vector<float>& want) {
  size_t n = 0;
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    if (std::bit_cast<uint32_t>(got[i]) != std::bit_cast<uint32_t>(want[i])) ++n;
  }
  return n + (got.size() > want.size() ? got.size() - want.size() : want.size() - got.size());
}

std::vector<float> uniform(size_t n, std::mt19937_64& rng, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& f : v) f = d(rng);
  return v;
}

// An activation vector with the features the digit-plane split must handle: whole 32-element
// groups of zeros, single outliers a thousand times the rest, tiny values next to large ones.
std::vector<float> activations(size_t n, std::mt19937_64& rng) {
  std::vector<float> x = uniform(n, rng);
  std::uniform_int_distribution<size_t> pick(0, n - 1);
  for (int i = 0; i < 3 && n >= 64; ++i) {
    const size_t g = pick(rng) / 32 * 32;
    std::fill(x.begin() + static_cast<int64_t>(g),
              x.begin() + static_cast<int64_t>(std::min(n, g + 32)), 0.0f);
  }
  for (int i = 0; i < 4; ++i) x[pick(rng)] *= 1000.0f;
  for (int i = 0; i < 4; ++i) x[pick(rng)] *= 1e-6f;
  return x;
}

void put_u16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }

// An f16 scale of magnitude around `base`, either sign when `sign`.
uint16_t f16_scale(std::mt19937_64& rng, float base, bool sign) {
  std::uniform_real_distribution<float> d(0.5f, 1.5f);
  const float v = base * d(rng) * (sign && (rng() & 1) ? -1.0f : 1.0f);
  return float_to_f16(v);
}

// Valid random rows of `type`: random quants and packed scales (every bit pattern is valid), f16
// scales set to sane finite values; the bytes between a row's data and row_bytes are random too
// (the kernels must ignore them).
std::vector<uint8_t> random_weights(GgmlType type, uint64_t rows, uint64_t cols, uint64_t row_bytes,
                                    std::mt19937_64& rng) {
  std::vector<uint8_t> w(rows * row_bytes);
  for (uint8_t& b : w) b = static_cast<uint8_t>(rng());
  const GgmlTypeTraits& t = ggml_traits(type);
  const uint64_t blocks = cols / t.block_elems;
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  for (uint64_t r = 0; r < rows; ++r) {
    uint8_t* row = w.data() + r * row_bytes;
    for (uint64_t b = 0; b < blocks; ++b) {
      uint8_t* blk = row + b * t.block_bytes;
      switch (type) {
        case GgmlType::F32: {
          const float v = unit(rng);
          std::memcpy(blk, &v, 4);
          break;
        }
        case GgmlType::F16:
          put_u16(blk, float_to_f16(unit(rng)));
          break;
        case GgmlType::BF16:
          put_u16(blk, float_to_bf16(unit(rng)));
          break;
        case GgmlType::Q8_0:
          put_u16(blk, f16_scale(rng, 1.0f / 127.0f, true));
          break;
        case GgmlType::Q4_K:
          put_u16(blk, f16_scale(rng, 1.0f / 600.0f, false));
          put_u16(blk + 2, f16_scale(rng, 1.0f / 600.0f, false));
          break;
        case GgmlType::Q6_K:
          put_u16(blk + 208, f16_scale(rng, 1.0f / 2000.0f, true));
          break;
        case GgmlType::MXFP4:  // e8m0 scales 2^-8 .. 2^-1: values up to 6 in magnitude
          blk[0] = static_cast<uint8_t>(120 + rng() % 8);
          break;
        default:
          ADD_FAILURE() << "no generator for " << ggml_type_name(type);
      }
    }
  }
  return w;
}

uint64_t data_bytes(GgmlType type, uint64_t cols) { return *ggml_row_bytes(type, cols); }

// y = W x by the CPU reference (dequantise each row, dot in double).
std::vector<float> cpu_matvec(GgmlType type, const uint8_t* w, uint64_t rows, uint64_t cols,
                              uint64_t row_bytes, const std::vector<float>& x) {
  std::vector<float> y(rows);
  std::vector<float> row(cols);
  engine::matvec(engine::WeightView{type, w, rows, cols, row_bytes}, x.data(), y.data(),
                 row.data());
  return y;
}

constexpr double kMatvecTolerance = 1e-5;

// ---------------------------------------------------------------------------------------------

TEST_F(GpuKernels, RmsNormMatchesCpu) {
  std::mt19937_64 rng(1);
  struct Shape {
    uint32_t rows;
    uint32_t n;
  };
  for (const Shape s : {Shape{1, 4096}, Shape{1, 2048}, Shape{32, 128}, Shape{8, 64},
                        Shape{3, 1000}, Shape{5, 33}, Shape{1, 7}, Shape{2, 14336}}) {
    SCOPED_TRACE(testing::Message() << "rows " << s.rows << " n " << s.n);
    const std::vector<float> x = uniform(size_t{s.rows} * s.n, rng, -3.0f, 3.0f);
    const std::vector<float> w = uniform(s.n, rng, 0.5f, 1.5f);
    std::vector<float> want(x.size());
    for (uint32_t r = 0; r < s.rows; ++r) {
      engine::rms_norm(x.data() + size_t{r} * s.n, w.data(), want.data() + size_t{r} * s.n, s.n,
                       1e-6f);
    }
    DeviceBuffer<float> dx(x);
    DeviceBuffer<float> dw(w);
    DeviceBuffer<float> dy(x.size());
    CUDA_OK(rms_norm(dx.get(), dw.get(), dy.get(), s.rows, s.n, 1e-6f, stream_));
    CUDA_OK(sync());
    const double err = normalised_error(dy.download(), want);
    EXPECT_LE(err, 1e-5);
    // In place, as the engine normalises q and k.
    CUDA_OK(rms_norm(dx.get(), dw.get(), dx.get(), s.rows, s.n, 1e-6f, stream_));
    CUDA_OK(sync());
    EXPECT_LE(normalised_error(dx.download(), want), 1e-5);
    RecordProperty("rms_norm_error_" + std::to_string(s.rows) + "x" + std::to_string(s.n),
                   std::to_string(err));
  }
}

// Both rope types, NEOX (qwen3moe) and NORM (llama/Mixtral), against the CPU's.
struct RopeKind {
  const char* name;
  void (*cpu)(float*, uint32_t, uint32_t, double);
  cudaError_t (*gpu)(float*, uint32_t, uint32_t, uint32_t, uint32_t, float, cudaStream_t);
  cudaError_t (*gpu_rows)(float*, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, float,
                          cudaStream_t);
};
constexpr RopeKind kRopeKinds[] = {
    {"neox", engine::rope_neox, rope_neox, rope_neox_rows},
    {"norm", engine::rope_norm, rope_norm, rope_norm_rows},
};

TEST_F(GpuKernels, RopeMatchesCpu) {
  std::mt19937_64 rng(2);
  struct Shape {
    uint32_t heads;
    uint32_t head_dim;
    uint32_t n_rot;
    uint32_t pos;
    float base;
  };
  for (const Shape s :
       {Shape{32, 128, 128, 0, 1e6f}, Shape{32, 128, 128, 5, 1e6f}, Shape{8, 128, 64, 31000, 1e6f},
        Shape{4, 64, 64, 1, 10000.0f}, Shape{3, 80, 32, 12345, 10000.0f},
        Shape{1, 256, 256, 32767, 5e5f}, Shape{40, 128, 2, 77, 1e6f}}) {
    for (const RopeKind& k : kRopeKinds) {
      SCOPED_TRACE(testing::Message() << k.name << " heads " << s.heads << " head_dim "
                                      << s.head_dim << " n_rot " << s.n_rot << " pos " << s.pos);
      const std::vector<float> x = uniform(size_t{s.heads} * s.head_dim, rng);
      std::vector<float> want = x;
      for (uint32_t h = 0; h < s.heads; ++h) {
        k.cpu(want.data() + size_t{h} * s.head_dim, s.n_rot, s.pos, static_cast<double>(s.base));
      }
      DeviceBuffer<float> dx(x);
      CUDA_OK(k.gpu(dx.get(), s.heads, s.head_dim, s.n_rot, s.pos, s.base, stream_));
      CUDA_OK(sync());
      const std::vector<float> got = dx.download();
      EXPECT_LE(normalised_error(got, want), 1e-6);
      // Dimensions from n_rot on are untouched.
      for (uint32_t h = 0; h < s.heads; ++h) {
        for (uint32_t i = s.n_rot; i < s.head_dim; ++i) {
          ASSERT_EQ(got[size_t{h} * s.head_dim + i], x[size_t{h} * s.head_dim + i]);
        }
      }
    }
  }
}

// The CPU engine's attention loop for one token over positions first..n_pos-1, with gpt-oss's
// per-head sink logit in the softmax's denominator when `sinks` is not empty.
std::vector<float> cpu_attention(const std::vector<float>& q, const std::vector<float>& k,
                                 const std::vector<float>& v, uint32_t n_head, uint32_t n_head_kv,
                                 uint32_t hd, uint32_t n_pos, uint32_t first = 0,
                                 const std::vector<float>& sinks = {}) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  const uint32_t group = n_head / n_head_kv;
  const uint64_t kv_dim = uint64_t{n_head_kv} * hd;
  std::vector<float> out(size_t{n_head} * hd);
  std::vector<double> scores(n_pos + 1);
  std::vector<double> acc(hd);
  for (uint32_t h = 0; h < n_head; ++h) {
    const float* qh = q.data() + uint64_t{h} * hd;
    const uint64_t off = uint64_t{h / group} * hd;
    for (uint32_t t = first; t < n_pos; ++t) {
      scores[t] = engine::dot(qh, k.data() + t * kv_dim + off, hd) * scale;
    }
    if (sinks.empty()) {
      engine::softmax(scores.data() + first, n_pos - first);
    } else {
      scores[n_pos] = sinks[h];
      engine::softmax(scores.data() + first, n_pos + 1 - first);
    }
    std::fill(acc.begin(), acc.end(), 0.0);
    for (uint32_t t = first; t < n_pos; ++t) {
      for (uint32_t i = 0; i < hd; ++i) acc[i] += scores[t] * v[t * kv_dim + off + i];
    }
    for (uint32_t i = 0; i < hd; ++i) out[uint64_t{h} * hd + i] = static_cast<float>(acc[i]);
  }
  return out;
}

TEST_F(GpuKernels, DecodeAttentionMatchesCpu) {
  std::mt19937_64 rng(3);
  struct Shape {
    uint32_t n_head;
    uint32_t n_head_kv;
    uint32_t head_dim;
    uint32_t n_pos;
  };
  for (const Shape s :
       {Shape{32, 4, 128, 1}, Shape{32, 4, 128, 1500}, Shape{16, 16, 64, 7}, Shape{8, 1, 128, 33},
        Shape{4, 1, 64, 5000}, Shape{2, 2, 96, 100}, Shape{6, 3, 80, 1025}, Shape{4, 4, 32, 3},
        Shape{2, 1, 256, 300}, Shape{2, 1, 128, 32768}, Shape{8, 8, 16, 9}}) {
    SCOPED_TRACE(testing::Message() << "heads " << s.n_head << "/" << s.n_head_kv << " head_dim "
                                    << s.head_dim << " n_pos " << s.n_pos);
    const uint64_t kv_dim = uint64_t{s.n_head_kv} * s.head_dim;
    // The cache is longer than n_pos; the positions past it hold NaN and must not be read.
    const uint64_t cache_pos = s.n_pos + 5;
    // q and k of unit rms with a spread that makes the softmax neither flat nor one-hot.
    const std::vector<float> q = uniform(size_t{s.n_head} * s.head_dim, rng, -2.0f, 2.0f);
    std::vector<float> k = uniform(cache_pos * kv_dim, rng, -2.0f, 2.0f);
    std::vector<float> v = uniform(cache_pos * kv_dim, rng);
    std::fill(k.begin() + static_cast<int64_t>(s.n_pos * kv_dim), k.end(), std::nanf(""));
    std::fill(v.begin() + static_cast<int64_t>(s.n_pos * kv_dim), v.end(), std::nanf(""));
    const std::vector<float> want =
        cpu_attention(q, k, v, s.n_head, s.n_head_kv, s.head_dim, s.n_pos);
    DeviceBuffer<float> dq(q);
    DeviceBuffer<float> dk(k);
    DeviceBuffer<float> dv(v);
    // One spare head of output, a sentinel the kernel must not write.
    std::vector<float> out_init(size_t{s.n_head + 1} * s.head_dim, 1234.5f);
    DeviceBuffer<float> dout(out_init);
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.head_dim)));
    CUDA_OK(decode_attention(dq.get(), dk.get(), dv.get(), dout.get(), s.n_head, s.n_head_kv,
                             s.head_dim, s.n_pos, scale, stream_));
    CUDA_OK(sync());
    std::vector<float> got = dout.download();
    for (size_t i = size_t{s.n_head} * s.head_dim; i < got.size(); ++i) {
      ASSERT_EQ(got[i], 1234.5f) << "wrote past the output at " << i;
    }
    got.resize(want.size());
    EXPECT_LE(normalised_error(got, want), 2e-5);
  }
}

// gpt-oss's attention: a window (positions before `first` hold NaN and must not be read) and a sink
// logit per head, against the CPU engine's loop.
TEST_F(GpuKernels, DecodeAttentionWindowAndSinksMatchCpu) {
  std::mt19937_64 rng(13);
  struct Shape {
    uint32_t n_head;
    uint32_t n_head_kv;
    uint32_t head_dim;
    uint32_t n_pos;
    uint32_t first;
    bool sinks;
  };
  for (const Shape s : {Shape{4, 2, 16, 9, 1, true}, Shape{4, 2, 16, 49, 41, true},
                        Shape{8, 1, 64, 300, 172, false}, Shape{64, 8, 64, 5000, 4872, true},
                        Shape{4, 4, 32, 3, 0, true}, Shape{2, 1, 128, 200, 199, true}}) {
    SCOPED_TRACE(testing::Message()
                 << "heads " << s.n_head << "/" << s.n_head_kv << " head_dim " << s.head_dim
                 << " n_pos " << s.n_pos << " first " << s.first << " sinks " << s.sinks);
    const uint64_t kv_dim = uint64_t{s.n_head_kv} * s.head_dim;
    const std::vector<float> q = uniform(size_t{s.n_head} * s.head_dim, rng, -2.0f, 2.0f);
    std::vector<float> k = uniform(s.n_pos * kv_dim, rng, -2.0f, 2.0f);
    std::vector<float> v = uniform(s.n_pos * kv_dim, rng);
    // Sinks that matter: around the scores' own range, some above every score.
    const std::vector<float> sinks =
        s.sinks ? uniform(s.n_head, rng, -1.0f, 6.0f) : std::vector<float>{};
    const std::vector<float> want =
        cpu_attention(q, k, v, s.n_head, s.n_head_kv, s.head_dim, s.n_pos, s.first, sinks);
    std::fill(k.begin(), k.begin() + static_cast<int64_t>(s.first * kv_dim), std::nanf(""));
    std::fill(v.begin(), v.begin() + static_cast<int64_t>(s.first * kv_dim), std::nanf(""));
    DeviceBuffer<float> dq(q);
    DeviceBuffer<float> dk(k);
    DeviceBuffer<float> dv(v);
    DeviceBuffer<float> dsinks(s.sinks ? sinks : std::vector<float>{0.0f});
    DeviceBuffer<float> dout(std::vector<float>(size_t{s.n_head} * s.head_dim, 0.0f));
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.head_dim)));
    CUDA_OK(decode_attention(dq.get(), dk.get(), dv.get(), dout.get(), s.n_head, s.n_head_kv,
                             s.head_dim, s.n_pos, scale, stream_, s.first,
                             s.sinks ? dsinks.get() : nullptr));
    CUDA_OK(sync());
    EXPECT_LE(normalised_error(dout.download(), want), 2e-5);
  }
  EXPECT_EQ(
      decode_attention(nullptr, nullptr, nullptr, nullptr, 4, 4, 64, 5, 1.0f, stream_, 5, nullptr),
      cudaErrorInvalidValue);
}

// gpt-oss's clamped SwiGLU on biased inputs against CpuEngine's operations, with inputs on both
// sides of the clamps.
TEST_F(GpuKernels, OaiSwigluMatchesCpu) {
  std::mt19937_64 rng(14);
  const uint64_t n = 3000;
  const std::vector<float> g = uniform(n, rng, -12.0f, 12.0f);
  const std::vector<float> u = uniform(n, rng, -12.0f, 12.0f);
  const std::vector<float> bg = uniform(n, rng, -1.0f, 1.0f);
  const std::vector<float> bu = uniform(n, rng, -1.0f, 1.0f);
  std::vector<float> want(n);
  for (uint64_t j = 0; j < n; ++j) {
    const double gg = std::min(g[j] + bg[j], engine::kGptOssLimit);
    const double uu = std::clamp(u[j] + bu[j], -engine::kGptOssLimit, engine::kGptOssLimit);
    want[j] = static_cast<float>((uu + 1.0) * gg / (1.0 + std::exp(-engine::kGptOssAlpha * gg)));
  }
  DeviceBuffer<float> dg(g);
  DeviceBuffer<float> du(u);
  DeviceBuffer<float> dbg(bg);
  DeviceBuffer<float> dbu(bu);
  CUDA_OK(oai_swiglu(dg.get(), du.get(), dbg.get(), dbu.get(), dg.get(), n, engine::kGptOssAlpha,
                     engine::kGptOssLimit, stream_));
  CUDA_OK(sync());
  EXPECT_LE(normalised_error(dg.download(), want), 1e-6);
}

// oai_swiglu_rows (gpt-oss's prefill, an expert's rows at once) is oai_swiglu on each row with
// the same biases, to the bit; add_rows is add of the bias to each row, to the bit.
TEST_F(GpuKernels, OaiSwigluRowsAndAddRowsAreTheOneRowKernelsOnEachRow) {
  std::mt19937_64 rng(15);
  for (const auto& [rows, n] : {std::pair{1u, 3000u}, std::pair{7u, 777u}, std::pair{33u, 2880u}}) {
    SCOPED_TRACE(testing::Message() << rows << " rows of " << n);
    const uint64_t total = uint64_t{rows} * n;
    const std::vector<float> g = uniform(total, rng, -12.0f, 12.0f);
    const std::vector<float> u = uniform(total, rng, -12.0f, 12.0f);
    const std::vector<float> bg = uniform(n, rng, -1.0f, 1.0f);
    const std::vector<float> bu = uniform(n, rng, -1.0f, 1.0f);
    DeviceBuffer<float> dg(g);
    DeviceBuffer<float> du(u);
    DeviceBuffer<float> dbg(bg);
    DeviceBuffer<float> dbu(bu);
    DeviceBuffer<float> rows_out(total);
    DeviceBuffer<float> one_out(total);
    CUDA_OK(oai_swiglu_rows(dg.get(), du.get(), dbg.get(), dbu.get(), rows_out.get(), rows, n,
                            engine::kGptOssAlpha, engine::kGptOssLimit, stream_));
    for (uint32_t r = 0; r < rows; ++r) {
      const uint64_t at = uint64_t{r} * n;
      CUDA_OK(oai_swiglu(dg.get() + at, du.get() + at, dbg.get(), dbu.get(), one_out.get() + at, n,
                         engine::kGptOssAlpha, engine::kGptOssLimit, stream_));
    }
    CUDA_OK(sync());
    EXPECT_EQ(bit_mismatches(rows_out.download(), one_out.download()), 0u);

    std::vector<float> want = g;
    for (uint64_t i = 0; i < total; ++i) want[i] += bg[i % n];
    CUDA_OK(add_rows(dg.get(), dbg.get(), rows, n, stream_));
    CUDA_OK(sync());
    EXPECT_EQ(bit_mismatches(dg.download(), want), 0u);
  }
  EXPECT_EQ(oai_swiglu_rows(nullptr, nullptr, nullptr, nullptr, nullptr, 0, 0, 1.0f, 1.0f, stream_),
            cudaErrorInvalidValue);
  EXPECT_EQ(add_rows(nullptr, nullptr, 1, 1, stream_), cudaErrorInvalidValue);
}

// gpu::dense_rows (a prefill's dense projections as GEMMs over a chunk's rows) against the CPU's
// matvec of each row, for f32 and quantised matrices, padded input and output rows, a tile that
// takes the matrix in many pieces (the last one short) and one that takes it whole; and its
// errors for a stride below the matrix and a tile that holds no row.
TEST_F(GpuKernels, DenseRowsIsEachRowsMatvecWhateverTheTile) {
  std::mt19937_64 rng(16);
  auto blas = cuda::CublasHandle::create(stream_);
  ASSERT_TRUE(blas) << blas.error().message;
  ASSERT_EQ(cublasSetMathMode(blas->get(), CUBLAS_PEDANTIC_MATH), CUBLAS_STATUS_SUCCESS);
  const uint32_t cols = 512;
  const uint32_t out_rows = 300;
  const uint32_t rows = 9;
  const uint64_t in_stride = cols + 64;
  const uint64_t out_stride = out_rows + 20;
  for (const GgmlType type : {GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_K}) {
    const uint64_t row_bytes = data_bytes(type, cols);
    const std::vector<uint8_t> w = random_weights(type, out_rows, cols, row_bytes, rng);
    std::vector<float> in(rows * in_stride, 0.0f);
    std::vector<float> want(rows * out_stride, 0.0f);
    for (uint32_t r = 0; r < rows; ++r) {
      const std::vector<float> x = uniform(cols, rng);
      std::copy(x.begin(), x.end(), in.begin() + r * in_stride);
      const std::vector<float> y = cpu_matvec(type, w.data(), out_rows, cols, row_bytes, x);
      std::copy(y.begin(), y.end(), want.begin() + r * out_stride);
    }
    DeviceBuffer<uint8_t> dw(w);
    DeviceBuffer<float> din(in);
    const engine::gpu::DevMat m{type, dw.get(), out_rows, cols, row_bytes};
    for (const uint64_t tile_rows : {uint64_t{7}, uint64_t{out_rows}}) {
      SCOPED_TRACE(testing::Message() << ggml_type_name(type) << " tile rows " << tile_rows);
      const uint64_t tile_floats = engine::gpu::dense_rows_tile(m, tile_rows * cols);
      EXPECT_EQ(tile_floats, type == GgmlType::F32 ? 0u : tile_rows * cols);
      DeviceBuffer<float> tile(std::max<uint64_t>(tile_floats, 1));
      DeviceBuffer<float> dout(std::vector<float>(rows * out_stride, 0.0f));
      auto st = engine::gpu::dense_rows(blas->get(), m, din.get(), in_stride, rows, dout.get(),
                                        out_stride, tile.get(), tile_floats, stream_);
      ASSERT_TRUE(st) << st.error().message;
      CUDA_OK(sync());
      const double err = normalised_error(dout.download(), want);
      EXPECT_LE(err, 1e-5);
      worst_errors()["dense_rows"] = std::max(worst_errors()["dense_rows"], err);
    }
  }
  const std::vector<uint8_t> w =
      random_weights(GgmlType::Q8_0, 4, cols, data_bytes(GgmlType::Q8_0, cols), rng);
  DeviceBuffer<uint8_t> dw(w);
  DeviceBuffer<float> buf(8 * cols);
  const engine::gpu::DevMat m{GgmlType::Q8_0, dw.get(), 4, cols, data_bytes(GgmlType::Q8_0, cols)};
  auto narrow = engine::gpu::dense_rows(blas->get(), m, buf.get(), cols - 1, 1, buf.get(), 4,
                                        buf.get(), cols, stream_);
  ASSERT_FALSE(narrow);
  EXPECT_NE(narrow.error().message.find("below the matrix"), std::string::npos)
      << narrow.error().message;
  auto small = engine::gpu::dense_rows(blas->get(), m, buf.get(), cols, 1, buf.get(), 4, buf.get(),
                                       cols - 1, stream_);
  ASSERT_FALSE(small);
  EXPECT_NE(small.error().message.find("holds no row"), std::string::npos) << small.error().message;
}

// YaRN's NEOX rope (gpt-oss) against CpuEngine's rope_neox_freqs with the same frequencies.
TEST_F(GpuKernels, RopeNeoxFreqsMatchesCpu) {
  std::mt19937_64 rng(15);
  engine::Yarn yarn;
  yarn.factor = 32.0;
  yarn.orig_ctx = 4096;
  const uint32_t heads = 6;
  const uint32_t head_dim = 64;
  const uint32_t n_rot = 64;
  const std::vector<double> freqs = engine::rope_inv_freq(n_rot, 150000.0, yarn, false);
  const double mscale = engine::yarn_mscale(yarn.factor);
  DeviceBuffer<double> dfreqs(freqs);
  for (const uint32_t pos : {0u, 1u, 40u, 31000u}) {
    SCOPED_TRACE(pos);
    const std::vector<float> x = uniform(size_t{heads} * head_dim, rng, -2.0f, 2.0f);
    std::vector<float> want = x;
    for (uint32_t h = 0; h < heads; ++h) {
      engine::rope_neox_freqs(want.data() + size_t{h} * head_dim, n_rot, pos, freqs.data(), mscale);
    }
    DeviceBuffer<float> dx(x);
    CUDA_OK(rope_neox_freqs(dx.get(), heads, head_dim, n_rot, pos, dfreqs.get(), mscale, stream_));
    CUDA_OK(sync());
    EXPECT_LE(normalised_error(dx.download(), want), 1e-6);
  }
}

// The CPU engine's routing: softmax in double, the top k (ties to the lower index), weights
// normalised over the chosen when norm_topk.
void cpu_route(const float* logits, uint32_t n, uint32_t k, bool norm, uint32_t* experts,
               float* weights, float* probs) {
  std::vector<double> p(logits, logits + n);
  engine::softmax(p.data(), n);
  std::vector<uint32_t> order(n);
  std::iota(order.begin(), order.end(), 0u);
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](uint32_t a, uint32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
  double sum = 0.0;
  for (uint32_t i = 0; i < k; ++i) sum += p[order[i]];
  for (uint32_t i = 0; i < k; ++i) {
    experts[i] = order[i];
    weights[i] = static_cast<float>(norm ? p[order[i]] / sum : p[order[i]]);
  }
  for (uint32_t e = 0; e < n; ++e) probs[e] = static_cast<float>(p[e]);
}

struct RouteResult {
  std::vector<uint32_t> experts;
  std::vector<float> weights;
  std::vector<float> probs;
};

RouteResult gpu_route(const std::vector<float>& logits, uint32_t rows, uint32_t n, uint32_t k,
                      bool norm, cudaStream_t stream) {
  DeviceBuffer<float> dl(logits);
  DeviceBuffer<uint32_t> de(size_t{rows} * k);
  DeviceBuffer<float> dw(size_t{rows} * k);
  DeviceBuffer<float> dp(size_t{rows} * n);
  EXPECT_EQ(router_topk(dl.get(), rows, n, k, norm, de.get(), dw.get(), dp.get(), stream),
            cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  return RouteResult{de.download(), dw.download(), dp.download()};
}

TEST_F(GpuKernels, RouterTopkMatchesCpu) {
  std::mt19937_64 rng(4);
  struct Shape {
    uint32_t rows;
    uint32_t n_expert;
    uint32_t k;
  };
  for (const Shape s :
       {Shape{1, 8, 2}, Shape{3, 128, 8}, Shape{2, 60, 4}, Shape{1, 512, 8}, Shape{4, 1000, 64},
        Shape{1, 1024, 1}, Shape{2, 256, 64}, Shape{1, 5, 5}, Shape{1, 1, 1}, Shape{2, 300, 10}}) {
    for (const bool norm : {true, false}) {
      SCOPED_TRACE(testing::Message() << "rows " << s.rows << " n_expert " << s.n_expert << " k "
                                      << s.k << " norm " << norm);
      const std::vector<float> logits = uniform(size_t{s.rows} * s.n_expert, rng, -4.0f, 4.0f);
      const RouteResult got = gpu_route(logits, s.rows, s.n_expert, s.k, norm, stream_);
      RouteResult want{std::vector<uint32_t>(size_t{s.rows} * s.k),
                       std::vector<float>(size_t{s.rows} * s.k),
                       std::vector<float>(size_t{s.rows} * s.n_expert)};
      for (uint32_t r = 0; r < s.rows; ++r) {
        cpu_route(logits.data() + size_t{r} * s.n_expert, s.n_expert, s.k, norm,
                  want.experts.data() + size_t{r} * s.k, want.weights.data() + size_t{r} * s.k,
                  want.probs.data() + size_t{r} * s.n_expert);
      }
      EXPECT_EQ(got.experts, want.experts);
      EXPECT_LE(normalised_error(got.weights, want.weights), 1e-6);
      EXPECT_LE(normalised_error(got.probs, want.probs), 1e-6);
    }
  }
}

TEST_F(GpuKernels, RouterTiesGoToTheLowerIndex) {
  // Equal logits give equal probabilities: the lower index comes first, as in the CPU engine.
  const std::vector<float> logits = {1.0f, 3.0f, 3.0f, 2.0f, 3.0f, 2.0f, 0.5f, 3.0f,  // row 0
                                     0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  const RouteResult got = gpu_route(logits, 2, 8, 6, true, stream_);
  EXPECT_EQ(got.experts, (std::vector<uint32_t>{1, 2, 4, 7, 3, 5, 0, 1, 2, 3, 4, 5}));
  for (uint32_t j = 6; j < 12; ++j) EXPECT_FLOAT_EQ(got.weights[j], 1.0f / 6.0f);
}

TEST_F(GpuKernels, SwigluMatchesCpu) {
  std::mt19937_64 rng(5);
  for (const uint64_t n :
       {uint64_t{1}, uint64_t{1000}, uint64_t{2} * 14336, uint64_t{8} * 768, uint64_t{1} << 21}) {
    SCOPED_TRACE(n);
    std::vector<float> gate = uniform(n, rng, -12.0f, 12.0f);
    gate[0] = -100.0f;  // exp overflow side
    const std::vector<float> up = uniform(n, rng, -2.0f, 2.0f);
    std::vector<float> want(n);
    for (uint64_t i = 0; i < n; ++i) {
      const float silu =
          static_cast<float>(gate[i] / (1.0 + std::exp(-static_cast<double>(gate[i]))));
      want[i] = silu * up[i];
    }
    DeviceBuffer<float> dg(gate);
    DeviceBuffer<float> du(up);
    DeviceBuffer<float> dout(n);
    CUDA_OK(swiglu(dg.get(), du.get(), dout.get(), n, stream_));
    CUDA_OK(sync());
    EXPECT_LE(normalised_error(dout.download(), want), 1e-6);
    // In place over gate, as the engine may run it.
    CUDA_OK(swiglu(dg.get(), du.get(), dg.get(), n, stream_));
    CUDA_OK(sync());
    EXPECT_LE(normalised_error(dg.download(), want), 1e-6);
  }
}

TEST_F(GpuKernels, CombineAndAddAreBitIdenticalToCpu) {
  std::mt19937_64 rng(6);
  for (const uint32_t k : {1u, 2u, 8u}) {
    for (const uint32_t n : {1u, 777u, 4096u, 7168u}) {
      SCOPED_TRACE(testing::Message() << "k " << k << " n " << n);
      const std::vector<float> eo = uniform(size_t{k} * n, rng, -5.0f, 5.0f);
      const std::vector<float> w = uniform(k, rng, 0.0f, 1.0f);
      const std::vector<float> x = uniform(n, rng);
      std::vector<float> want = x;
      std::vector<double> acc(n, 0.0);
      for (uint32_t j = 0; j < k; ++j) {
        for (uint32_t i = 0; i < n; ++i) {
          acc[i] += static_cast<double>(w[j]) * static_cast<double>(eo[size_t{j} * n + i]);
        }
      }
      for (uint32_t i = 0; i < n; ++i) want[i] += static_cast<float>(acc[i]);
      DeviceBuffer<float> deo(eo);
      DeviceBuffer<float> dw(w);
      DeviceBuffer<float> dx(x);
      CUDA_OK(moe_combine(deo.get(), dw.get(), dx.get(), k, n, stream_));
      CUDA_OK(sync());
      EXPECT_EQ(bit_mismatches(dx.download(), want), 0u);

      const std::vector<float> y = uniform(n, rng);
      for (uint32_t i = 0; i < n; ++i) want[i] += y[i];
      DeviceBuffer<float> dy(y);
      CUDA_OK(add(dx.get(), dy.get(), n, stream_));
      CUDA_OK(sync());
      EXPECT_EQ(bit_mismatches(dx.download(), want), 0u);
    }
  }
}

// --- prefill's row-batched kernels ---------------------------------------------------------------

// Each row of rope_{neox,norm}_rows is rope_{neox,norm} at its own position, bit for bit, and
// within 1e-6 of the CPU's rope.
TEST_F(GpuKernels, RopeRowsIsRopeAtEachRowsPosition) {
  std::mt19937_64 rng(21);
  struct Shape {
    uint32_t rows;
    uint32_t heads;
    uint32_t head_dim;
    uint32_t n_rot;
    uint32_t pos0;
  };
  for (const Shape s : {Shape{1, 4, 16, 16, 0}, Shape{5, 4, 16, 16, 7}, Shape{17, 2, 64, 32, 0},
                        Shape{64, 8, 128, 128, 30000}, Shape{3, 1, 80, 2, 12}}) {
    for (const RopeKind& k : kRopeKinds) {
      SCOPED_TRACE(testing::Message()
                   << k.name << " rows " << s.rows << " heads " << s.heads << " head_dim "
                   << s.head_dim << " n_rot " << s.n_rot << " pos0 " << s.pos0);
      const size_t row = size_t{s.heads} * s.head_dim;
      const std::vector<float> x = uniform(row * s.rows, rng);
      std::vector<float> want_cpu = x;
      std::vector<float> want_gpu(x.size());
      for (uint32_t r = 0; r < s.rows; ++r) {
        for (uint32_t h = 0; h < s.heads; ++h) {
          k.cpu(want_cpu.data() + r * row + size_t{h} * s.head_dim, s.n_rot, s.pos0 + r, 1e6);
        }
        DeviceBuffer<float> one(
            std::vector<float>(x.begin() + static_cast<int64_t>(r * row),
                               x.begin() + static_cast<int64_t>((r + 1) * row)));
        CUDA_OK(k.gpu(one.get(), s.heads, s.head_dim, s.n_rot, s.pos0 + r, 1e6f, stream_));
        CUDA_OK(sync());
        const std::vector<float> got_one = one.download();
        std::copy(got_one.begin(), got_one.end(), want_gpu.begin() + static_cast<int64_t>(r * row));
      }
      DeviceBuffer<float> dx(x);
      CUDA_OK(k.gpu_rows(dx.get(), s.rows, s.heads, s.head_dim, s.n_rot, s.pos0, 1e6f, stream_));
      CUDA_OK(sync());
      const std::vector<float> got = dx.download();
      EXPECT_EQ(bit_mismatches(got, want_gpu), 0u);
      EXPECT_LE(normalised_error(got, want_cpu), 1e-6);
    }
  }
}

// Row r keeps columns 0..pos0+r as a softmax (the CPU's, in double) and zeroes the rest.
TEST_F(GpuKernels, CausalSoftmaxMatchesCpuAndZeroesTheFuture) {
  std::mt19937_64 rng(22);
  struct Shape {
    uint32_t rows;
    uint32_t n_ctx;
    uint32_t pos0;
  };
  for (const Shape s : {Shape{1, 1, 0}, Shape{5, 5, 0}, Shape{5, 12, 7}, Shape{33, 300, 267},
                        Shape{512, 512, 0}, Shape{64, 1100, 1000}}) {
    SCOPED_TRACE(testing::Message()
                 << "rows " << s.rows << " n_ctx " << s.n_ctx << " pos0 " << s.pos0);
    const std::vector<float> x = uniform(size_t{s.rows} * s.n_ctx, rng, -8.0f, 8.0f);
    std::vector<float> want(x.size(), 0.0f);
    std::vector<double> p(s.n_ctx);
    for (uint32_t r = 0; r < s.rows; ++r) {
      const uint32_t valid = s.pos0 + r + 1;
      for (uint32_t t = 0; t < valid; ++t) p[t] = x[size_t{r} * s.n_ctx + t];
      engine::softmax(p.data(), valid);
      for (uint32_t t = 0; t < valid; ++t) {
        want[size_t{r} * s.n_ctx + t] = static_cast<float>(p[t]);
      }
    }
    DeviceBuffer<float> dx(x);
    CUDA_OK(causal_softmax(dx.get(), s.rows, s.n_ctx, s.pos0, stream_));
    CUDA_OK(sync());
    const std::vector<float> got = dx.download();
    EXPECT_LE(normalised_error(got, want), 1e-6);
    for (uint32_t r = 0; r < s.rows; ++r) {
      double sum = 0.0;
      for (uint32_t t = 0; t < s.n_ctx; ++t) {
        const float v = got[size_t{r} * s.n_ctx + t];
        if (t > s.pos0 + r) {
          ASSERT_EQ(v, 0.0f) << "row " << r << " column " << t;
        } else {
          ASSERT_GT(v, 0.0f) << "row " << r << " column " << t;
        }
        sum += v;
      }
      EXPECT_NEAR(sum, 1.0, 1e-5) << "row " << r;
    }
  }
  // A chunk that ends past the scores' row is refused without a launch.
  DeviceBuffer<float> d(16);
  EXPECT_EQ(causal_softmax(d.get(), 4, 4, 1, stream_), cudaErrorInvalidValue);
}

// gather_rows then scatter_rows through a permutation with repeats on the gather side: rows move
// bit for bit; rows the scatter does not name stay as they were.
TEST_F(GpuKernels, GatherAndScatterRowsMoveRowsExactly) {
  std::mt19937_64 rng(23);
  for (const uint32_t n : {1u, 64u, 777u, 4096u}) {
    SCOPED_TRACE(testing::Message() << "n " << n);
    const uint32_t src_rows = 9;
    const std::vector<float> src = uniform(size_t{src_rows} * n, rng);
    const std::vector<uint32_t> gidx = {8, 0, 3, 3, 5, 1};
    DeviceBuffer<float> dsrc(src);
    DeviceBuffer<uint32_t> dg(gidx);
    DeviceBuffer<float> mid(gidx.size() * n);
    CUDA_OK(gather_rows(dsrc.get(), dg.get(), static_cast<uint32_t>(gidx.size()), n, mid.get(),
                        stream_));
    CUDA_OK(sync());
    std::vector<float> want_mid(gidx.size() * n);
    for (size_t i = 0; i < gidx.size(); ++i) {
      std::copy_n(src.begin() + static_cast<int64_t>(gidx[i] * n), n,
                  want_mid.begin() + static_cast<int64_t>(i * n));
    }
    EXPECT_EQ(bit_mismatches(mid.download(), want_mid), 0u);
    // The same rows read from a buffer whose rows are padded to stride n + 13 (prefill's cxn).
    const uint64_t stride = uint64_t{n} + 13;
    std::vector<float> padded(src_rows * stride, -1.0f);
    for (uint32_t r = 0; r < src_rows; ++r) {
      std::copy_n(src.begin() + static_cast<int64_t>(uint64_t{r} * n), n,
                  padded.begin() + static_cast<int64_t>(r * stride));
    }
    DeviceBuffer<float> dpadded(padded);
    DeviceBuffer<float> mid2(gidx.size() * n);
    CUDA_OK(gather_rows_strided(dpadded.get(), stride, dg.get(), static_cast<uint32_t>(gidx.size()),
                                n, mid2.get(), stream_));
    CUDA_OK(sync());
    EXPECT_EQ(bit_mismatches(mid2.download(), want_mid), 0u);
    EXPECT_EQ(gather_rows_strided(dpadded.get(), n - 1, dg.get(), 1, n, mid2.get(), stream_),
              cudaErrorInvalidValue)
        << "a stride shorter than a row";

    const std::vector<uint32_t> sidx = {2, 7, 0, 4, 6, 9};
    const std::vector<float> base = uniform(size_t{10} * n, rng);
    DeviceBuffer<float> dst(base);
    DeviceBuffer<uint32_t> ds(sidx);
    CUDA_OK(scatter_rows(mid.get(), ds.get(), static_cast<uint32_t>(sidx.size()), n, dst.get(),
                         stream_));
    CUDA_OK(sync());
    std::vector<float> want = base;
    for (size_t i = 0; i < sidx.size(); ++i) {
      std::copy_n(want_mid.begin() + static_cast<int64_t>(i * n), n,
                  want.begin() + static_cast<int64_t>(sidx[i] * n));
    }
    EXPECT_EQ(bit_mismatches(dst.download(), want), 0u);
  }
}

// moe_combine_rows is moe_combine of each row: the same double sum in slot order, bit for bit.
TEST_F(GpuKernels, MoeCombineRowsIsBitIdenticalToCpuPerRow) {
  std::mt19937_64 rng(24);
  for (const uint32_t rows : {1u, 5u, 64u}) {
    for (const uint32_t k : {1u, 2u, 8u}) {
      for (const uint32_t n : {1u, 777u, 4096u}) {
        SCOPED_TRACE(testing::Message() << "rows " << rows << " k " << k << " n " << n);
        const std::vector<float> eo = uniform(size_t{rows} * k * n, rng, -5.0f, 5.0f);
        const std::vector<float> w = uniform(size_t{rows} * k, rng, 0.0f, 1.0f);
        const std::vector<float> x = uniform(size_t{rows} * n, rng);
        std::vector<float> want = x;
        for (uint32_t r = 0; r < rows; ++r) {
          for (uint32_t i = 0; i < n; ++i) {
            double acc = 0.0;
            for (uint32_t j = 0; j < k; ++j) {
              const size_t slot = size_t{r} * k + j;
              acc += static_cast<double>(w[slot]) * static_cast<double>(eo[slot * n + i]);
            }
            want[size_t{r} * n + i] += static_cast<float>(acc);
          }
        }
        DeviceBuffer<float> deo(eo);
        DeviceBuffer<float> dw(w);
        DeviceBuffer<float> dx(x);
        CUDA_OK(moe_combine_rows(deo.get(), dw.get(), dx.get(), rows, k, n, stream_));
        CUDA_OK(sync());
        EXPECT_EQ(bit_mismatches(dx.download(), want), 0u);
      }
    }
  }
}

constexpr GgmlType kAllTypes[] = {GgmlType::F32,  GgmlType::F16,  GgmlType::BF16, GgmlType::Q8_0,
                                  GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::MXFP4};

// The quantised types, each with its own matvec kernel.
constexpr GgmlType kQuantTypes[] = {GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q8_0,
                                    GgmlType::MXFP4};

TEST_F(GpuKernels, DequantizeIsBitIdenticalToCpu) {
  std::mt19937_64 rng(7);
  for (const GgmlType type : kAllTypes) {
    const uint32_t block = ggml_traits(type).block_elems;
    for (const uint64_t n : {uint64_t{block}, uint64_t{block} * 37, uint64_t{256} * 1024 + 512}) {
      if (n % block != 0) continue;
      // Unaligned on purpose: the source is read bytewise.
      for (const uint64_t offset : {uint64_t{0}, uint64_t{1}}) {
        SCOPED_TRACE(testing::Message()
                     << ggml_type_name(type) << " n " << n << " offset " << offset);
        const uint64_t bytes = data_bytes(type, n);
        std::vector<uint8_t> w = random_weights(type, 1, n, bytes, rng);
        if (type == GgmlType::MXFP4) {
          // Every e8m0 exponent, the subnormal scales (0, 1) and the overflowing ones (254, 255,
          // whose large quants are infinite) included.
          for (uint64_t b = 0; b < n / 32; ++b) w[b * 17] = static_cast<uint8_t>(b * 37 + 11);
        }
        std::vector<float> want(n);
        engine::dequantize_row(type, w.data(), want.data(), n);
        std::vector<uint8_t> padded(offset, 0);
        padded.insert(padded.end(), w.begin(), w.end());
        DeviceBuffer<uint8_t> dsrc(padded);
        DeviceBuffer<float> dst(n);
        CUDA_OK(dequantize(type, dsrc.get() + offset, dst.get(), n, stream_));
        CUDA_OK(sync());
        EXPECT_EQ(bit_mismatches(dst.download(), want), 0u);
      }
    }
  }
}

// bf16 by round to nearest even, as __float2bfloat16_rn rounds (NaN aside: compared as NaN).
uint16_t bf16_bits(float f) {
  uint32_t u = 0;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

bool bf16_is_nan(uint16_t b) { return (b & 0x7f80u) == 0x7f80u && (b & 0x7fu) != 0; }

// dequantize_bf16 (prefill's bf16 GEMMs, GpuOptions::PrefillGemm::Bf16) writes dequantize's f32
// values rounded to bf16, every type; to_bf16 rounds floats the same way.
TEST_F(GpuKernels, DequantizeBf16IsTheF32ValuesRounded) {
  std::mt19937_64 rng(11);
  for (const GgmlType type : kAllTypes) {
    const uint64_t n = uint64_t{ggml_traits(type).block_elems} * 1031;
    SCOPED_TRACE(ggml_type_name(type));
    std::vector<uint8_t> w = random_weights(type, 1, n, data_bytes(type, n), rng);
    std::vector<float> want(n);
    engine::dequantize_row(type, w.data(), want.data(), n);
    DeviceBuffer<uint8_t> dsrc(w);
    DeviceBuffer<uint16_t> dst(n);
    CUDA_OK(
        dequantize_bf16(type, dsrc.get(), reinterpret_cast<__nv_bfloat16*>(dst.get()), n, stream_));
    CUDA_OK(sync());
    const std::vector<uint16_t> got = dst.download();
    uint64_t bad = 0;
    for (uint64_t i = 0; i < n; ++i) {
      const uint16_t expect = bf16_bits(want[i]);
      if (got[i] != expect && !(bf16_is_nan(got[i]) && bf16_is_nan(expect))) ++bad;
    }
    EXPECT_EQ(bad, 0u);
  }
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> x(100003);
  for (float& v : x) v = normal(rng);
  x[0] = 0.0f;
  x[1] = -0.0f;
  x[2] = 1e-40f;  // subnormal
  x[3] = 3.0e38f;
  DeviceBuffer<float> dx(x);
  DeviceBuffer<uint16_t> dy(x.size());
  CUDA_OK(to_bf16(dx.get(), reinterpret_cast<__nv_bfloat16*>(dy.get()), x.size(), stream_));
  CUDA_OK(sync());
  const std::vector<uint16_t> y = dy.download();
  uint64_t bad = 0;
  for (size_t i = 0; i < x.size(); ++i) bad += y[i] != bf16_bits(x[i]);
  EXPECT_EQ(bad, 0u);
  EXPECT_EQ(to_bf16(nullptr, reinterpret_cast<__nv_bfloat16*>(dy.get()), 1, stream_),
            cudaErrorInvalidValue);
  EXPECT_EQ(dequantize_bf16(GgmlType::Q4_K, dx.get(), nullptr, 256, stream_),
            cudaErrorInvalidValue);
}

struct MatvecShape {
  uint32_t rows;
  uint32_t cols;
};

// Shapes per type: one row, odd row counts, rows of one to many tiles, the Qwen3-30B-A3B expert
// shapes (768 x 2048, 2048 x 768) and the Mixtral ones (in MixtralExpertShapes).
std::vector<MatvecShape> matvec_shapes(GgmlType type) {
  switch (type) {
    case GgmlType::Q4_K:
    case GgmlType::Q6_K:
      return {{1, 256},    {37, 512},  {300, 768},  {129, 2048}, {1000, 4096},
              {64, 14336}, {33, 1280}, {2049, 256}, {768, 2048}, {2048, 768}};
    case GgmlType::Q8_0:
      return {{1, 32},     {37, 96},    {100, 800},  {300, 2048}, {1000, 4096},
              {64, 14336}, {129, 1056}, {2048, 768}, {5, 4064},   {2049, 64}};
    case GgmlType::MXFP4:  // odd block counts (odd row bytes: byte loads) and gpt-oss's 2880
      return {{1, 32},     {37, 96},    {100, 800}, {300, 2048}, {1000, 4096}, {64, 14336},
              {129, 1056}, {2048, 768}, {5, 4064},  {2049, 64},  {768, 2880},  {2880, 2880}};
    default:
      return {{1, 1},      {37, 33},    {300, 1000}, {129, 2048},
              {500, 4097}, {64, 14336}, {1000, 64},  {3, 7}};
  }
}

class MatvecCase {
 public:
  MatvecCase(GgmlType type, MatvecShape s, uint64_t row_pad, std::mt19937_64& rng)
      : type_(type), s_(s), row_bytes_(data_bytes(type, s.cols) + row_pad) {
    w_ = random_weights(type, s.rows, s.cols, row_bytes_, rng);
    x_ = activations(s.cols, rng);
    want_ = cpu_matvec(type, w_.data(), s.rows, s.cols, row_bytes_, x_);
  }
  uint64_t row_bytes() const { return row_bytes_; }
  const std::vector<uint8_t>& w() const { return w_; }
  const std::vector<float>& x() const { return x_; }
  const std::vector<float>& want() const { return want_; }

 private:
  GgmlType type_;
  MatvecShape s_;
  uint64_t row_bytes_;
  std::vector<uint8_t> w_;
  std::vector<float> x_;
  std::vector<float> want_;
};

// Runs matvec with the weights at byte `offset` of a device allocation and checks y (and that
// the element after y is untouched).
void check_matvec(GgmlType type, MatvecShape s, uint64_t row_pad, uint64_t offset,
                  std::mt19937_64& rng, cudaStream_t stream) {
  SCOPED_TRACE(testing::Message() << ggml_type_name(type) << " " << s.rows << " x " << s.cols
                                  << " row pad " << row_pad << " offset " << offset);
  const MatvecCase c(type, s, row_pad, rng);
  std::vector<uint8_t> placed(offset, 0);
  placed.insert(placed.end(), c.w().begin(), c.w().end());
  DeviceBuffer<uint8_t> dw(placed);
  DeviceBuffer<float> dx(c.x());
  DeviceBuffer<float> dy(std::vector<float>(s.rows + 1, -7.0f));
  ASSERT_EQ(
      matvec(type, dw.get() + offset, c.row_bytes(), s.rows, s.cols, dx.get(), dy.get(), stream),
      cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  std::vector<float> got = dy.download();
  EXPECT_EQ(got[s.rows], -7.0f) << "wrote past y";
  got.resize(s.rows);
  const double err = normalised_error(got, c.want());
  EXPECT_LE(err, kMatvecTolerance);
}

TEST_F(GpuKernels, MatvecMatchesCpuForEveryTypeAndShape) {
  std::mt19937_64 rng(8);
  for (const GgmlType type : kAllTypes) {
    for (const MatvecShape s : matvec_shapes(type)) check_matvec(type, s, 0, 0, rng, stream_);
  }
}

TEST_F(GpuKernels, MatvecHandlesNarrowAlignmentAndRowPadding) {
  // 16-byte loads need 16-byte aligned rows; these take the 4- and 2-byte paths.
  std::mt19937_64 rng(9);
  for (const GgmlType type : kQuantTypes) {
    for (const MatvecShape s : {MatvecShape{70, 512}, MatvecShape{33, 4096}}) {
      check_matvec(type, s, 0, 4, rng, stream_);   // 4-byte aligned base
      check_matvec(type, s, 0, 2, rng, stream_);   // 2-byte aligned base
      check_matvec(type, s, 16, 0, rng, stream_);  // padded rows, still 16-byte aligned
      check_matvec(type, s, 6, 0, rng, stream_);   // padded rows, 2-byte aligned
    }
  }
  // MXFP4 rows may start anywhere: odd bases and odd row lengths take byte loads.
  for (const MatvecShape s : {MatvecShape{70, 512}, MatvecShape{33, 4096}, MatvecShape{9, 800}}) {
    check_matvec(GgmlType::MXFP4, s, 0, 1, rng, stream_);
    check_matvec(GgmlType::MXFP4, s, 0, 3, rng, stream_);
    check_matvec(GgmlType::MXFP4, s, 1, 0, rng, stream_);
    check_matvec(GgmlType::MXFP4, s, 3, 2, rng, stream_);
  }
  for (const GgmlType type : {GgmlType::F16, GgmlType::BF16}) {
    check_matvec(type, MatvecShape{41, 1024}, 0, 2, rng, stream_);
    check_matvec(type, MatvecShape{41, 1024}, 0, 4, rng, stream_);
    check_matvec(type, MatvecShape{41, 1023}, 2, 0, rng, stream_);
  }
  check_matvec(GgmlType::F32, MatvecShape{41, 1024}, 0, 4, rng, stream_);
  check_matvec(GgmlType::F32, MatvecShape{41, 1023}, 4, 0, rng, stream_);
}

TEST_F(GpuKernels, MatvecMixtralExpertShapes) {
  // One Mixtral-8x7B expert's gate (14336 x 4096) and down (4096 x 14336) in each quantised type.
  std::mt19937_64 rng(10);
  for (const GgmlType type : kQuantTypes) {
    check_matvec(type, MatvecShape{14336, 4096}, 0, 0, rng, stream_);
    check_matvec(type, MatvecShape{4096, 14336}, 0, 0, rng, stream_);
  }
}

TEST_F(GpuKernels, MatvecNanInXGivesNan) {
  std::mt19937_64 rng(11);
  for (const GgmlType type : kAllTypes) {
    SCOPED_TRACE(ggml_type_name(type));
    const MatvecShape s{8, 512};
    const MatvecCase c(type, s, 0, rng);
    std::vector<float> x = c.x();
    x[100] = std::nanf("");
    DeviceBuffer<uint8_t> dw(c.w());
    DeviceBuffer<float> dx(x);
    DeviceBuffer<float> dy(s.rows);
    CUDA_OK(matvec(type, dw.get(), c.row_bytes(), s.rows, s.cols, dx.get(), dy.get(), stream_));
    CUDA_OK(sync());
    for (const float v : dy.download()) EXPECT_TRUE(std::isnan(v));
  }
}

TEST_F(GpuKernels, MatvecBatchedMatchesCpuPerJob) {
  std::mt19937_64 rng(12);
  for (const GgmlType type : kAllTypes) {
    for (const uint32_t count : {1u, 3u, 16u, kMaxBatch}) {
      const MatvecShape s = type == GgmlType::Q8_0 || ggml_traits(type).block_elems == 1
                                ? MatvecShape{97, 2048}
                                : MatvecShape{200, 1024};
      SCOPED_TRACE(testing::Message() << ggml_type_name(type) << " jobs " << count);
      std::vector<MatvecCase> cases;
      std::vector<std::unique_ptr<DeviceBuffer<uint8_t>>> dw;
      std::vector<std::unique_ptr<DeviceBuffer<float>>> dx;
      DeviceBuffer<float> dy(size_t{count} * s.rows);
      MatvecBatch b;
      b.count = count;
      for (uint32_t j = 0; j < count; ++j) {
        cases.emplace_back(type, s, 0, rng);
        dw.push_back(std::make_unique<DeviceBuffer<uint8_t>>(cases.back().w()));
        dx.push_back(std::make_unique<DeviceBuffer<float>>(cases.back().x()));
        b.w[j] = dw.back()->get();
        b.x[j] = dx.back()->get();
        b.y[j] = dy.get() + size_t{j} * s.rows;
      }
      CUDA_OK(matvec_batched(type, b, cases[0].row_bytes(), s.rows, s.cols, stream_));
      CUDA_OK(sync());
      const std::vector<float> got = dy.download();
      for (uint32_t j = 0; j < count; ++j) {
        const std::vector<float> gj(got.begin() + static_cast<int64_t>(size_t{j} * s.rows),
                                    got.begin() + static_cast<int64_t>(size_t{j + 1} * s.rows));
        EXPECT_LE(normalised_error(gj, cases[j].want()), kMatvecTolerance) << "job " << j;
      }
    }
  }
}

// Every kernel variant (MatvecVariant) against the CPU reference, batched: the Mixtral down
// projection (the split-K target: 14,336 columns, 7 tiles of 32 units in Q4_K), its gate, the
// Qwen3-30B-A3B shapes, rows of 3 and 5 tiles (slices of unequal tiles), row counts that leave
// partial row blocks and clusters, and a single row.
struct VariantShape {
  uint32_t rows;
  uint32_t cols;
  uint32_t jobs;
};

TEST_F(GpuKernels, MatvecVariantsMatchCpuPerJob) {
  std::mt19937_64 rng(14);
  for (const GgmlType type : kQuantTypes) {
    const uint32_t b = ggml_traits(type).block_elems;
    for (const VariantShape s :
         {VariantShape{4096, 14336, 2}, VariantShape{1000, 4096, 3}, VariantShape{768, 2048, 4},
          VariantShape{2048, 768, 2}, VariantShape{37, 6144, 2}, VariantShape{130, 10240, 1},
          VariantShape{1, 14336, 1}, VariantShape{70, 5 * 256 + b, 2}}) {
      SCOPED_TRACE(testing::Message() << ggml_type_name(type) << " " << s.rows << " x " << s.cols
                                      << " jobs " << s.jobs);
      std::vector<MatvecCase> cases;
      std::vector<std::unique_ptr<DeviceBuffer<uint8_t>>> dw;
      std::vector<std::unique_ptr<DeviceBuffer<float>>> dx;
      MatvecBatch batch;
      batch.count = s.jobs;
      for (uint32_t j = 0; j < s.jobs; ++j) {
        cases.emplace_back(type, MatvecShape{s.rows, s.cols}, 0, rng);
        dw.push_back(std::make_unique<DeviceBuffer<uint8_t>>(cases.back().w()));
        dx.push_back(std::make_unique<DeviceBuffer<float>>(cases.back().x()));
        batch.w[j] = dw.back()->get();
        batch.x[j] = dx.back()->get();
      }
      for (const MatvecVariant v : kAllMatvecVariants) {
        SCOPED_TRACE(matvec_variant_name(v));
        DeviceBuffer<float> dy(std::vector<float>(size_t{s.jobs} * s.rows + 1, -7.0f));
        for (uint32_t j = 0; j < s.jobs; ++j) batch.y[j] = dy.get() + size_t{j} * s.rows;
        CUDA_OK(matvec_batched(type, batch, cases[0].row_bytes(), s.rows, s.cols, stream_, v));
        CUDA_OK(sync());
        const std::vector<float> got = dy.download();
        EXPECT_EQ(got.back(), -7.0f) << "wrote past y";
        for (uint32_t j = 0; j < s.jobs; ++j) {
          const std::vector<float> gj(got.begin() + static_cast<int64_t>(size_t{j} * s.rows),
                                      got.begin() + static_cast<int64_t>(size_t{j + 1} * s.rows));
          // One row normalises by one sum, which cancellation can make small: the H200 gave
          // 1.9e-5 for splitk+q6r2 on 1 x 14336 (a different summation order), 7e-7 elsewhere.
          const double tol = s.rows == 1 ? 1e-4 : kMatvecTolerance;
          EXPECT_LE(normalised_error(gj, cases[j].want()), tol) << "job " << j;
        }
      }
    }
  }
}

TEST_F(GpuKernels, MatvecVariantNamesRoundTrip) {
  for (const MatvecVariant v : kAllMatvecVariants) {
    EXPECT_EQ(matvec_variant_from_name(matvec_variant_name(v)), v);
  }
  EXPECT_EQ(matvec_variant_from_name("default"), MatvecVariant::kDefault);
  EXPECT_FALSE(matvec_variant_from_name("splitk3").has_value());
}

// MatvecBatch::up: the down projection reading the gate and up outputs gives exactly what swiglu
// then matvec gives (the same vector reaches the kernel), for every type and variant, and matches
// the CPU's SwiGLU + matvec.
TEST_F(GpuKernels, MatvecFusedSwigluIsSwigluThenMatvec) {
  std::mt19937_64 rng(15);
  for (const GgmlType type : kAllTypes) {
    const bool quant = ggml_traits(type).block_elems > 1;
    for (const MatvecShape s : {MatvecShape{2048, 768}, MatvecShape{512, 14336}}) {
      SCOPED_TRACE(testing::Message() << ggml_type_name(type) << " " << s.rows << " x " << s.cols);
      constexpr uint32_t kJobs = 2;
      std::vector<std::vector<uint8_t>> w;
      std::vector<std::vector<float>> gate;
      std::vector<std::vector<float>> up;
      std::vector<std::vector<float>> want;
      const uint64_t row_bytes = data_bytes(type, s.cols);
      for (uint32_t j = 0; j < kJobs; ++j) {
        w.push_back(random_weights(type, s.rows, s.cols, row_bytes, rng));
        gate.push_back(uniform(s.cols, rng, -8.0f, 8.0f));
        up.push_back(uniform(s.cols, rng, -2.0f, 2.0f));
        std::vector<float> h(s.cols);
        for (uint32_t i = 0; i < s.cols; ++i) {
          const double g = gate[j][i];
          h[i] = static_cast<float>(g / (1.0 + std::exp(-g))) * up[j][i];
        }
        want.push_back(cpu_matvec(type, w[j].data(), s.rows, s.cols, row_bytes, h));
      }
      std::vector<std::unique_ptr<DeviceBuffer<uint8_t>>> dw;
      std::vector<std::unique_ptr<DeviceBuffer<float>>> dg;
      std::vector<std::unique_ptr<DeviceBuffer<float>>> du;
      DeviceBuffer<float> dh(size_t{kJobs} * s.cols);
      for (uint32_t j = 0; j < kJobs; ++j) {
        dw.push_back(std::make_unique<DeviceBuffer<uint8_t>>(w[j]));
        dg.push_back(std::make_unique<DeviceBuffer<float>>(gate[j]));
        du.push_back(std::make_unique<DeviceBuffer<float>>(up[j]));
        CUDA_OK(swiglu(dg[j]->get(), du[j]->get(), dh.get() + size_t{j} * s.cols, s.cols, stream_));
      }
      for (const MatvecVariant v : kAllMatvecVariants) {
        if (!quant && v != MatvecVariant::kBase) continue;  // the plain family has one kernel
        SCOPED_TRACE(matvec_variant_name(v));
        DeviceBuffer<float> separate(size_t{kJobs} * s.rows);
        DeviceBuffer<float> fused(size_t{kJobs} * s.rows);
        MatvecBatch a;
        MatvecBatch b;
        a.count = b.count = kJobs;
        for (uint32_t j = 0; j < kJobs; ++j) {
          a.w[j] = b.w[j] = dw[j]->get();
          a.x[j] = dh.get() + size_t{j} * s.cols;
          a.y[j] = separate.get() + size_t{j} * s.rows;
          b.x[j] = dg[j]->get();
          b.up[j] = du[j]->get();
          b.y[j] = fused.get() + size_t{j} * s.rows;
        }
        CUDA_OK(matvec_batched(type, a, row_bytes, s.rows, s.cols, stream_, v));
        CUDA_OK(matvec_batched(type, b, row_bytes, s.rows, s.cols, stream_, v));
        CUDA_OK(sync());
        const std::vector<float> got_a = separate.download();
        const std::vector<float> got_b = fused.download();
        EXPECT_EQ(bit_mismatches(got_b, got_a), 0u);
        for (uint32_t j = 0; j < kJobs; ++j) {
          const std::vector<float> gj(got_b.begin() + static_cast<int64_t>(size_t{j} * s.rows),
                                      got_b.begin() + static_cast<int64_t>(size_t{j + 1} * s.rows));
          EXPECT_LE(normalised_error(gj, want[j]), kMatvecTolerance) << "job " << j;
        }
      }
    }
  }
}

// A page-aligned anonymous mapping, made read-only and registered with the device as the in-place
// mode registers the daemon's arena; unregistered and unmapped on destruction.
class MappedHost {
 public:
  MappedHost(const std::vector<uint8_t>& bytes, bool read_only) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    size_ = (bytes.size() + page - 1) / page * page;
    void* p = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      ADD_FAILURE() << "mmap: " << std::strerror(errno);
      return;
    }
    host_ = static_cast<uint8_t*>(p);
    std::memcpy(host_, bytes.data(), bytes.size());
    const unsigned flags = cudaHostRegisterMapped | (read_only ? cudaHostRegisterReadOnly : 0u);
    if (read_only) {
      EXPECT_EQ(mprotect(host_, size_, PROT_READ), 0) << std::strerror(errno);
    }
    const cudaError_t e = cudaHostRegister(host_, size_, flags);
    EXPECT_EQ(e, cudaSuccess) << "cudaHostRegister: " << cudaGetErrorString(e);
    registered_ = e == cudaSuccess;
    if (registered_) {
      void* d = nullptr;
      EXPECT_EQ(cudaHostGetDevicePointer(&d, host_, 0), cudaSuccess);
      device_ = static_cast<const uint8_t*>(d);
    }
  }
  ~MappedHost() {
    if (registered_) cudaHostUnregister(host_);
    if (host_ != nullptr) munmap(host_, size_);
  }
  MappedHost(const MappedHost&) = delete;
  MappedHost& operator=(const MappedHost&) = delete;

  const uint8_t* device() const { return device_; }

 private:
  uint8_t* host_ = nullptr;
  size_t size_ = 0;
  bool registered_ = false;
  const uint8_t* device_ = nullptr;
};

bool host_register_read_only_supported() {
  int dev = 0;
  int supported = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&supported, cudaDevAttrHostRegisterReadOnlySupported, dev) !=
      cudaSuccess) {
    return false;
  }
  return supported != 0;
}

TEST_F(GpuKernels, MatvecReadsMappedPinnedHostMemoryInPlace) {
  if (!host_register_read_only_supported()) {
    GTEST_SKIP() << "the device lacks cudaDevAttrHostRegisterReadOnlySupported (the in-place "
                    "mode's registration)";
  }
  std::mt19937_64 rng(13);
  for (const GgmlType type : kAllTypes) {
    const MatvecShape s =
        ggml_traits(type).block_elems == 1 ? MatvecShape{300, 1000} : MatvecShape{500, 2048};
    SCOPED_TRACE(ggml_type_name(type));
    const MatvecCase c(type, s, 0, rng);
    const MappedHost mapped(c.w(), true);
    ASSERT_NE(mapped.device(), nullptr);
    DeviceBuffer<float> dx(c.x());
    DeviceBuffer<float> dy(s.rows);
    CUDA_OK(
        matvec(type, mapped.device(), c.row_bytes(), s.rows, s.cols, dx.get(), dy.get(), stream_));
    CUDA_OK(sync());
    EXPECT_LE(normalised_error(dy.download(), c.want()), kMatvecTolerance);
  }
}

TEST_F(GpuKernels, MatvecBatchedMixesDeviceAndMappedHostWeights) {
  if (!host_register_read_only_supported()) {
    GTEST_SKIP() << "the device lacks cudaDevAttrHostRegisterReadOnlySupported";
  }
  // The engine's gate+up batch: some experts resident in VRAM, others read from the arena in
  // place; all jobs share x.
  std::mt19937_64 rng(14);
  for (const GgmlType type :
       {GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q8_0, GgmlType::MXFP4, GgmlType::F16}) {
    SCOPED_TRACE(ggml_type_name(type));
    const MatvecShape s{768, 2048};
    const uint32_t count = 8;
    const std::vector<float> x = activations(s.cols, rng);
    DeviceBuffer<float> dx(x);
    DeviceBuffer<float> dy(size_t{count} * s.rows);
    const uint64_t row_bytes = data_bytes(type, s.cols);
    std::vector<std::vector<uint8_t>> w;
    std::vector<std::unique_ptr<DeviceBuffer<uint8_t>>> dev;
    std::vector<std::unique_ptr<MappedHost>> host;
    MatvecBatch b;
    b.count = count;
    for (uint32_t j = 0; j < count; ++j) {
      w.push_back(random_weights(type, s.rows, s.cols, row_bytes, rng));
      if (j % 2 == 0) {
        dev.push_back(std::make_unique<DeviceBuffer<uint8_t>>(w.back()));
        b.w[j] = dev.back()->get();
      } else {
        host.push_back(std::make_unique<MappedHost>(w.back(), true));
        ASSERT_NE(host.back()->device(), nullptr);
        b.w[j] = host.back()->device();
      }
      b.x[j] = dx.get();
      b.y[j] = dy.get() + size_t{j} * s.rows;
    }
    CUDA_OK(matvec_batched(type, b, row_bytes, s.rows, s.cols, stream_));
    CUDA_OK(sync());
    const std::vector<float> got = dy.download();
    for (uint32_t j = 0; j < count; ++j) {
      const std::vector<float> want = cpu_matvec(type, w[j].data(), s.rows, s.cols, row_bytes, x);
      const std::vector<float> gj(got.begin() + static_cast<int64_t>(size_t{j} * s.rows),
                                  got.begin() + static_cast<int64_t>(size_t{j + 1} * s.rows));
      EXPECT_LE(normalised_error(gj, want), kMatvecTolerance) << "job " << j;
    }
  }
}

TEST_F(GpuKernels, InvalidArgumentsAreRejectedWithoutALaunch) {
  DeviceBuffer<float> f(4096);
  float* p = f.get();
  const uint8_t* w = reinterpret_cast<const uint8_t*>(p);
  uint32_t* e = reinterpret_cast<uint32_t*>(p);
  const cudaStream_t s = stream_;
  const cudaError_t bad = cudaErrorInvalidValue;
  EXPECT_EQ(rms_norm(p, p, p, 0, 16, 1e-6f, s), bad);
  EXPECT_EQ(rms_norm(p, p, p, 1, 0, 1e-6f, s), bad);
  EXPECT_EQ(rms_norm(nullptr, p, p, 1, 16, 1e-6f, s), bad);
  EXPECT_EQ(rope_neox(p, 0, 128, 128, 0, 1e4f, s), bad);
  EXPECT_EQ(rope_neox(p, 1, 128, 127, 0, 1e4f, s), bad);
  EXPECT_EQ(rope_neox(p, 1, 64, 128, 0, 1e4f, s), bad);
  EXPECT_EQ(decode_attention(p, p, p, p, 6, 4, 64, 1, 1.0f, s), bad);  // 6 % 4 != 0
  EXPECT_EQ(decode_attention(p, p, p, p, 4, 4, 64, 0, 1.0f, s), bad);
  EXPECT_EQ(decode_attention(p, p, p, p, 4, 4, 1024, 1, 1.0f, s), bad);
  EXPECT_EQ(router_topk(p, 1, 8, 9, true, e, p, p, s), bad);  // k > n_expert
  EXPECT_EQ(router_topk(p, 1, 2048, 8, true, e, p, p, s), bad);
  EXPECT_EQ(router_topk(p, 1, 128, 65, true, e, p, p, s), bad);
  EXPECT_EQ(router_topk(p, 0, 128, 8, true, e, p, p, s), bad);
  EXPECT_EQ(swiglu(p, p, p, 0, s), bad);
  EXPECT_EQ(moe_combine(p, p, p, 0, 16, s), bad);
  EXPECT_EQ(moe_combine(p, p, p, 2, 0, s), bad);
  EXPECT_EQ(add(p, p, 0, s), bad);
  EXPECT_EQ(rope_neox_rows(p, 0, 4, 16, 16, 0, 1e4f, s), bad);
  EXPECT_EQ(rope_neox_rows(p, 2, 4, 16, 15, 0, 1e4f, s), bad);
  EXPECT_EQ(causal_softmax(p, 0, 16, 0, s), bad);
  EXPECT_EQ(causal_softmax(p, 8, 16, 9, s), bad);  // the chunk ends past the row
  EXPECT_EQ(gather_rows(p, e, 0, 16, p, s), bad);
  EXPECT_EQ(gather_rows(p, nullptr, 1, 16, p, s), bad);
  EXPECT_EQ(scatter_rows(p, e, 1, 0, p, s), bad);
  EXPECT_EQ(moe_combine_rows(p, p, p, 1, 0, 16, s), bad);
  EXPECT_EQ(dequantize(GgmlType::Q4_K, w, p, 100, s), bad);
  EXPECT_EQ(dequantize(GgmlType::Q5_K, w, p, 256, s), bad);
  EXPECT_EQ(dequantize(GgmlType::F32, w, p, 0, s), bad);
  EXPECT_EQ(matvec(GgmlType::Q4_K, w, 144, 0, 256, p, p, s), bad);
  EXPECT_EQ(matvec(GgmlType::Q4_K, w, 144, 1, 0, p, p, s), bad);
  EXPECT_EQ(matvec(GgmlType::Q4_K, w, 144, 1, 100, p, p, s), bad);
  EXPECT_EQ(matvec(GgmlType::Q4_K, w, 100, 1, 256, p, p, s), bad);  // row_bytes < one block
  EXPECT_EQ(matvec(GgmlType::Q5_K, w, 176, 1, 256, p, p, s), bad);
  EXPECT_EQ(matvec(GgmlType::Q4_K, nullptr, 144, 1, 256, p, p, s), bad);
  EXPECT_EQ(matvec(GgmlType::Q4_K, w + 1, 144, 1, 256, p, p, s), bad);  // odd address
  EXPECT_EQ(dequantize(GgmlType::MXFP4, w, p, 48, s), bad);             // 1.5 blocks
  EXPECT_EQ(matvec(GgmlType::MXFP4, w, 16, 1, 32, p, p, s), bad);       // row_bytes < 17
  EXPECT_EQ(matvec(GgmlType::MXFP4, w, 17, 1, 48, p, p, s), bad);
  EXPECT_EQ(matvec(GgmlType::F32, w + 2, 4096, 1, 1024, p, p, s), bad);      // f32 not 4-aligned
  EXPECT_EQ(matvec(GgmlType::F32, w, 4u << 20, 1, 1u << 20, p, p, s), bad);  // x > shared mem
  MatvecBatch none;
  EXPECT_EQ(matvec_batched(GgmlType::Q4_K, none, 144, 1, 256, s), bad);
  MatvecBatch too_many;
  too_many.count = kMaxBatch + 1;
  EXPECT_EQ(matvec_batched(GgmlType::Q4_K, too_many, 144, 1, 256, s), bad);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "a rejected call left an error behind";
  EXPECT_TRUE(expert_type_supported(GgmlType::Q6_K));
  EXPECT_TRUE(expert_type_supported(GgmlType::MXFP4));
  EXPECT_FALSE(expert_type_supported(GgmlType::IQ2_XXS));
}

// kernels/cuda_raii.h: a failed creation is reported once, by its Result, and leaves nothing for
// the next launcher's cudaGetLastError(); an owner moves its resource and frees it once.
TEST_F(GpuKernels, CudaOwnersReportAFailedCreationOnceAndMove) {
  Result<cuda::DeviceBytes> huge = cuda::DeviceBytes::alloc(uint64_t{1} << 62);
  ASSERT_FALSE(huge);
  EXPECT_NE(huge.error().message.find("cudaMalloc"), std::string::npos) << huge.error().message;
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);

  Result<cuda::DeviceBytes> small = cuda::DeviceBytes::alloc(64);
  ASSERT_TRUE(small) << small.error().message;
  cuda::DeviceBytes a = std::move(*small);
  ASSERT_TRUE(a.valid());
  EXPECT_EQ(a.size(), 64u);
  cuda::DeviceBytes b = std::move(a);
  EXPECT_FALSE(a.valid());  // NOLINT(bugprone-use-after-move): moved-from holds nothing
  ASSERT_TRUE(b.valid());
  CUDA_OK(cudaMemsetAsync(b.get(), 0, b.size(), stream_));
  CUDA_OK(sync());
  b = cuda::DeviceBytes();
  EXPECT_FALSE(b.valid());

  // The same range registered twice: the second fails (already registered) and is cleared.
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const Mapping m =
      Mapping::map(4 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_TRUE(m.valid()) << std::strerror(errno);
  Result<cuda::HostRegistration> first =
      cuda::HostRegistration::create(m.data(), m.size(), cudaHostRegisterMapped);
  ASSERT_TRUE(first) << first.error().message;
  Result<cuda::HostRegistration> second =
      cuda::HostRegistration::create(m.data(), m.size(), cudaHostRegisterMapped);
  EXPECT_FALSE(second);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  {
    // Unregistered when it goes: the range can be registered again.
    const cuda::HostRegistration gone = std::move(*first);
  }
  Result<cuda::HostRegistration> again =
      cuda::HostRegistration::create(m.data(), m.size(), cudaHostRegisterMapped);
  EXPECT_TRUE(again) << again.error().message;

  Result<cuda::CudaStream> s = cuda::CudaStream::create();
  ASSERT_TRUE(s) << s.error().message;
  Result<cuda::CudaEvent> e = cuda::CudaEvent::create(cudaEventDisableTiming);
  ASSERT_TRUE(e) << e.error().message;
  CUDA_OK(cudaEventRecord(e->get(), s->get()));
  CUDA_OK(cudaEventSynchronize(e->get()));
  Result<cuda::PinnedBytes> pinned = cuda::PinnedBytes::alloc(page);
  ASSERT_TRUE(pinned) << pinned.error().message;
  EXPECT_NE(pinned->get(), nullptr);
}

// --- deepseek4 (kernels/ds4.cuh) ---------------------------------------------------------------

TEST_F(GpuKernels, Ds4RmsNormMatchesCpuWithAndWithoutWeight) {
  std::mt19937_64 rng(21);
  for (const uint32_t n : {16u, 64u, 1000u, 16384u}) {
    SCOPED_TRACE(n);
    const uint32_t rows = 3;
    const std::vector<float> x = activations(size_t{rows} * n, rng);
    const std::vector<float> w = uniform(n, rng, 0.5f, 1.5f);
    const std::vector<float> ones(n, 1.0f);
    for (const bool weighted : {false, true}) {
      std::vector<float> want(x.size());
      for (uint32_t r = 0; r < rows; ++r) {
        engine::rms_norm(x.data() + size_t{r} * n, weighted ? w.data() : ones.data(),
                         want.data() + size_t{r} * n, n, 1e-6f);
      }
      DeviceBuffer<float> dx(x);
      DeviceBuffer<float> dw(w);
      CUDA_OK(
          ds4_rms_norm(dx.get(), weighted ? dw.get() : nullptr, dx.get(), rows, n, 1e-6f, stream_));
      CUDA_OK(cudaStreamSynchronize(stream_));
      EXPECT_LE(normalised_error(dx.download(), want), 1e-6) << "weighted " << weighted;
    }
  }
}

// Interleaved pairs on the trailing n_rot dims: the leading (nope) dims are untouched, position 0
// is the identity, and the inverse rotation undoes the forward one.
TEST_F(GpuKernels, Ds4RopeRotatesTheTrailingPairsAndTheInverseUndoesIt) {
  std::mt19937_64 rng(22);
  const uint32_t heads = 5;
  const uint32_t dim = 64;
  const uint32_t n_rot = 16;
  std::vector<double> freq(n_rot / 2);
  for (uint32_t i = 0; i < n_rot / 2; ++i) freq[i] = std::pow(10000.0, -2.0 * i / n_rot);
  const std::vector<float> v = uniform(size_t{heads} * dim, rng);
  DeviceBuffer<double> df(freq);
  DeviceBuffer<float> dv(v);
  CUDA_OK(ds4_rope(dv.get(), heads, dim, n_rot, 0, df.get(), false, stream_));
  CUDA_OK(cudaStreamSynchronize(stream_));
  EXPECT_EQ(dv.download(), v);
  CUDA_OK(ds4_rope(dv.get(), heads, dim, n_rot, 37, df.get(), false, stream_));
  CUDA_OK(cudaStreamSynchronize(stream_));
  const std::vector<float> rotated = dv.download();
  for (uint32_t h = 0; h < heads; ++h) {
    for (uint32_t c = 0; c < dim - n_rot; ++c) {
      ASSERT_EQ(rotated[h * dim + c], v[h * dim + c]) << "head " << h << " dim " << c;
    }
    // Pair i of head h, by hand.
    for (uint32_t i = 0; i < n_rot / 2; ++i) {
      const size_t at = h * dim + dim - n_rot + 2 * i;
      const double a = 37.0 * freq[i];
      EXPECT_NEAR(rotated[at], v[at] * std::cos(a) - v[at + 1] * std::sin(a), 1e-6);
      EXPECT_NEAR(rotated[at + 1], v[at + 1] * std::cos(a) + v[at] * std::sin(a), 1e-6);
    }
  }
  CUDA_OK(ds4_rope(dv.get(), heads, dim, n_rot, 37, df.get(), true, stream_));
  CUDA_OK(cudaStreamSynchronize(stream_));
  EXPECT_LE(normalised_error(dv.download(), v), 1e-6);
}

TEST_F(GpuKernels, Ds4HcWeightsAreBoundedAndCombIsDoublyStochastic) {
  std::mt19937_64 rng(23);
  const uint32_t hc = 4;
  const std::vector<float> mixes = uniform(size_t{2 + hc} * hc, rng, -3.0f, 3.0f);
  const std::vector<float> scale = {0.7f, 1.3f, 2.0f};
  const std::vector<float> base = uniform(size_t{2 + hc} * hc, rng);
  DeviceBuffer<float> dm(mixes);
  DeviceBuffer<float> ds(scale);
  DeviceBuffer<float> db(base);
  DeviceBuffer<double> pre(hc);
  DeviceBuffer<double> post(hc);
  DeviceBuffer<double> comb(hc * hc);
  CUDA_OK(ds4_hc_weights(dm.get(), ds.get(), db.get(), hc, 20, 1e-6f, pre.get(), post.get(),
                         comb.get(), stream_));
  CUDA_OK(cudaStreamSynchronize(stream_));
  const std::vector<double> pr = pre.download();
  const std::vector<double> po = post.download();
  const std::vector<double> c = comb.download();
  for (uint32_t i = 0; i < hc; ++i) {
    const double want_pre = 1.0 / (1.0 + std::exp(-(double{mixes[i]} * scale[0] + base[i])));
    EXPECT_NEAR(pr[i], want_pre + 1e-6, 1e-12);
    const double want_post =
        2.0 / (1.0 + std::exp(-(double{mixes[hc + i]} * scale[1] + base[hc + i])));
    EXPECT_NEAR(po[i], want_post, 1e-12);
  }
  // comb: transformers' algorithm in double on the host (a row softmax + eps, then columns, then
  // 19 rounds of rows and columns). Sinkhorn need not have converged after 20 rounds from logits
  // this spread, so the rows are not required to sum to 1; the columns (normalised last) are.
  std::vector<double> want(size_t{hc} * hc);
  for (uint32_t i = 0; i < hc; ++i) {
    double mx = -1e300;
    for (uint32_t j = 0; j < hc; ++j) {
      const uint32_t k = 2 * hc + i * hc + j;
      want[i * hc + j] = double{mixes[k]} * scale[2] + base[k];
      mx = std::max(mx, want[i * hc + j]);
    }
    double sum = 0.0;
    for (uint32_t j = 0; j < hc; ++j) sum += (want[i * hc + j] = std::exp(want[i * hc + j] - mx));
    for (uint32_t j = 0; j < hc; ++j) want[i * hc + j] = want[i * hc + j] / sum + 1e-6;
  }
  auto columns = [&] {
    for (uint32_t j = 0; j < hc; ++j) {
      double sum = 0.0;
      for (uint32_t i = 0; i < hc; ++i) sum += want[i * hc + j];
      for (uint32_t i = 0; i < hc; ++i) want[i * hc + j] /= sum + 1e-6;
    }
  };
  columns();
  for (int it = 1; it < 20; ++it) {
    for (uint32_t i = 0; i < hc; ++i) {
      double sum = 0.0;
      for (uint32_t j = 0; j < hc; ++j) sum += want[i * hc + j];
      for (uint32_t j = 0; j < hc; ++j) want[i * hc + j] /= sum + 1e-6;
    }
    columns();
  }
  for (uint32_t i = 0; i < hc; ++i) {
    double col = 0.0;
    for (uint32_t j = 0; j < hc; ++j) {
      EXPECT_NEAR(c[i * hc + j], want[i * hc + j], 1e-9) << i << "," << j;
      EXPECT_GT(c[i * hc + j], 0.0);
      col += c[j * hc + i];
    }
    EXPECT_NEAR(col, 1.0, 1e-5) << "column " << i;
  }
}

TEST_F(GpuKernels, Ds4TopEntriesRankByScoreThenLowerIndex) {
  const std::vector<double> scores = {1.0, 3.0, 3.0, 2.0, 3.0, 0.5, -1.0};
  DeviceBuffer<double> ds(scores);
  DeviceBuffer<uint32_t> chosen(scores.size());
  CUDA_OK(ds4_top_entries(ds.get(), 7, 4, chosen.get(), stream_));
  CUDA_OK(cudaStreamSynchronize(stream_));
  std::vector<uint32_t> got = chosen.download();
  got.resize(4);
  EXPECT_EQ(got, (std::vector<uint32_t>{1, 2, 4, 3}));
  CUDA_OK(ds4_top_entries(ds.get(), 7, 7, chosen.get(), stream_));
  CUDA_OK(cudaStreamSynchronize(stream_));
  EXPECT_EQ(chosen.download(), (std::vector<uint32_t>{1, 2, 4, 3, 0, 5, 6}));
}

// Attention over a ring window (wrapped) and chosen compressed entries, with a per-head sink,
// against the loop of Ds4CpuEngine::attention written out.
TEST_F(GpuKernels, Ds4AttentionWithSinkMatchesCpu) {
  std::mt19937_64 rng(24);
  const uint32_t n_head = 6;
  const uint32_t hd = 64;
  const uint32_t ring = 8;
  const uint32_t first = 13;  // positions 13..20 in a ring of 8: wrapped
  const uint32_t n_window = 8;
  const uint32_t n_stored = 9;
  const std::vector<uint32_t> pick = {7, 2, 5};
  const std::vector<float> q = uniform(size_t{n_head} * hd, rng, -2.0f, 2.0f);
  const std::vector<float> window = uniform(size_t{ring} * hd, rng, -2.0f, 2.0f);
  const std::vector<float> entries = uniform(size_t{n_stored} * hd, rng, -2.0f, 2.0f);
  const std::vector<float> sinks = uniform(n_head, rng, -1.0f, 3.0f);
  for (const bool chosen : {true, false}) {
    SCOPED_TRACE(chosen ? "chosen entries" : "every entry");
    const uint32_t n_entries = chosen ? static_cast<uint32_t>(pick.size()) : n_stored;
    std::vector<float> want(size_t{n_head} * hd);
    for (uint32_t h = 0; h < n_head; ++h) {
      auto key = [&](uint32_t i) -> const float* {
        if (i < n_window) return window.data() + size_t{(first + i) % ring} * hd;
        const uint32_t e = chosen ? pick[i - n_window] : i - n_window;
        return entries.data() + size_t{e} * hd;
      };
      const uint32_t n = n_window + n_entries;
      std::vector<double> sc(n);
      double mx = sinks[h];
      for (uint32_t i = 0; i < n; ++i) {
        sc[i] = engine::dot(q.data() + size_t{h} * hd, key(i), hd) / std::sqrt(double{hd});
        mx = std::max(mx, sc[i]);
      }
      double sum = std::exp(sinks[h] - mx);
      for (uint32_t i = 0; i < n; ++i) sum += sc[i] = std::exp(sc[i] - mx);
      for (uint32_t c = 0; c < hd; ++c) {
        double acc = 0.0;
        for (uint32_t i = 0; i < n; ++i) acc += sc[i] / sum * key(i)[c];
        want[size_t{h} * hd + c] = static_cast<float>(acc);
      }
    }
    DeviceBuffer<float> dq(q);
    DeviceBuffer<float> dwin(window);
    DeviceBuffer<float> dent(entries);
    DeviceBuffer<uint32_t> dpick(pick);
    DeviceBuffer<float> dsinks(sinks);
    const uint32_t stride = n_window + n_stored;
    DeviceBuffer<double> scratch(size_t{n_head} * stride);
    DeviceBuffer<float> out(size_t{n_head} * hd);
    CUDA_OK(ds4_attention(dq.get(), dwin.get(), ring, first, n_window, dent.get(),
                          chosen ? dpick.get() : nullptr, n_entries, dsinks.get(), n_head, hd,
                          scratch.get(), stride, out.get(), stream_));
    CUDA_OK(cudaStreamSynchronize(stream_));
    EXPECT_LE(normalised_error(out.download(), want), 1e-6);
  }
}

// DeepSeek-V3's absorbed MLA attention against the CPU engine's loops (Ds3CpuEngine::attention):
// positions past what one thread covers (300 > 256), query heads strided as [nope | rope].
TEST_F(GpuKernels, Ds3MlaAttentionMatchesCpu) {
  std::mt19937_64 rng(33);
  const uint32_t n_head = 5;
  const uint32_t lat = 48;
  const uint32_t n_rot = 8;
  const uint32_t hd = 24;  // 16 nope + 8 rope
  const uint32_t n = 300;
  const double scale = 1.3 / std::sqrt(double{hd});
  const std::vector<float> qabs = uniform(size_t{n_head} * lat, rng, -1.0f, 1.0f);
  const std::vector<float> q = uniform(size_t{n_head} * hd, rng, -1.0f, 1.0f);
  const std::vector<float> latent = uniform(size_t{n} * lat, rng, -1.0f, 1.0f);
  const std::vector<float> krope = uniform(size_t{n} * n_rot, rng, -1.0f, 1.0f);
  std::vector<float> want(size_t{n_head} * lat);
  for (uint32_t h = 0; h < n_head; ++h) {
    std::vector<double> sc(n);
    for (uint32_t t = 0; t < n; ++t) {
      sc[t] =
          (engine::dot(qabs.data() + size_t{h} * lat, latent.data() + size_t{t} * lat, lat) +
           engine::dot(q.data() + size_t{h} * hd + 16, krope.data() + size_t{t} * n_rot, n_rot)) *
          scale;
    }
    engine::softmax(sc.data(), n);
    for (uint32_t c = 0; c < lat; ++c) {
      double acc = 0.0;
      for (uint32_t t = 0; t < n; ++t) acc += sc[t] * latent[size_t{t} * lat + c];
      want[size_t{h} * lat + c] = static_cast<float>(acc);
    }
  }
  DeviceBuffer<float> dqabs(qabs);
  DeviceBuffer<float> dq(q);
  DeviceBuffer<float> dlat(latent);
  DeviceBuffer<float> dkr(krope);
  DeviceBuffer<double> scratch(size_t{n_head} * n);
  DeviceBuffer<float> out(size_t{n_head} * lat);
  CUDA_OK(ds3_mla_attention(dqabs.get(), dq.get() + 16, hd, dlat.get(), dkr.get(), n, n_head, lat,
                            n_rot, scale, scratch.get(), n, out.get(), stream_));
  CUDA_OK(cudaStreamSynchronize(stream_));
  EXPECT_LE(normalised_error(out.download(), want), 1e-6);
  EXPECT_EQ(ds3_mla_attention(dqabs.get(), dq.get(), hd, dlat.get(), dkr.get(), n, n_head, lat,
                              n_rot, scale, scratch.get(), n - 1, out.get(), stream_),
            cudaErrorInvalidValue);
}

TEST_F(GpuKernels, Ds4SwigluClampsGateAboveAndUpBothWays) {
  const std::vector<float> gate = {-3.0f, 0.5f, 5.0f, 1.0f};
  const std::vector<float> up = {4.0f, -5.0f, 1.0f, 0.25f};
  DeviceBuffer<float> dg(gate);
  DeviceBuffer<float> du(up);
  DeviceBuffer<float> out(4);
  CUDA_OK(ds4_swiglu(dg.get(), du.get(), out.get(), 4, 2.0f, stream_));
  CUDA_OK(cudaStreamSynchronize(stream_));
  auto silu = [](float x) { return static_cast<float>(x / (1.0 + std::exp(-double{x}))); };
  EXPECT_EQ(out.download(), (std::vector<float>{silu(-3.0f) * 2.0f, silu(0.5f) * -2.0f,
                                                silu(2.0f) * 1.0f, silu(1.0f) * 0.25f}));
  CUDA_OK(ds4_swiglu(dg.get(), du.get(), out.get(), 4, 0.0f, stream_));  // no clamp
  CUDA_OK(cudaStreamSynchronize(stream_));
  EXPECT_EQ(out.download()[2], silu(5.0f) * 1.0f);
}

}  // namespace
}  // namespace expertd::kernels
