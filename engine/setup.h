// One engine setup for expert-run and expert-serve (issue 25): which engine runs (CUDA unless
// --cpu, no device or a build without CUDA, and why), the dense model (from expertd's fds or a
// --gguf file; left in the file for the CUDA engines, which upload each matrix as they read it),
// and the engine itself over an ExpertSource, with as many sequences as it can hold.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "engine/engine.h"
#include "engine/expert_source.h"
#include "engine/model.h"
#include "expertd/result.h"

namespace expertd::client {
class Client;
}  // namespace expertd::client

namespace expertd::engine {

struct DeviceChoice {
  bool gpu = false;
  std::string why_cpu;  // why the CPU engine runs: "--cpu", no device, no CUDA in this build
};
// `cpu`: the --cpu flag.
DeviceChoice choose_device(bool cpu);

// The dense weights of `model` as expertd serves it (`daemon`), or of `gguf` when it is not
// empty; deferred (left in the file) for the CUDA engines.
Result<DenseModel> load_dense(client::Client* daemon, const std::string& model,
                              const std::string& gguf, const DeviceChoice& device);

struct EngineSetup {
  EngineOptions options;
  std::string vram_experts = "auto";  // --vram-experts (CUDA)
  bool coordinate = false;            // --tiers coordinated (CUDA)
  std::string vram_policy;            // --vram-policy (CUDA; empty: the default)
  std::string prefill_gemm = "f32";   // --prefill-gemm (CUDA): f32 or bf16
  // Fill the VRAM tier at start, the last layers' experts (CUDA; GpuOptions::preload); off with
  // --no-vram-preload. `preload_progress` (optional) hears of each layer loaded.
  bool vram_preload = true;
  std::function<void(uint32_t experts, uint32_t of, uint64_t bytes)> preload_progress;
};

struct CreatedEngine {
  std::unique_ptr<Engine> engine;
  std::string note;  // the engine line of a run summary: description (and why the CPU one)
  // Set when fewer sequences than asked: the engine runs one at a time, and why.
  std::string sequences_note;
};
// The CUDA engine when `device.gpu`, else the CPU engine. options.sequences above 1 falls to 1
// where the registry says the engine runs one sequence at a time (sequences_note says so).
Result<CreatedEngine> create_engine(const DenseModel& model, ExpertSource& source,
                                    EngineSetup setup, const DeviceChoice& device);

}  // namespace expertd::engine
