#include "engine/setup.h"

#include <fmt/format.h>

#include "engine/cpu_engine.h"
#include "engine/family.h"
#include "expertd/client.h"
#ifdef EXPERTD_HAVE_CUDA
#include "engine/gpu_engine.h"
#endif

namespace expertd::engine {

DeviceChoice choose_device(bool cpu) {
  DeviceChoice d;
  d.why_cpu = "--cpu";
#ifdef EXPERTD_HAVE_CUDA
  d.gpu = !cpu && cuda_device_available(&d.why_cpu);
#else
  if (!cpu) d.why_cpu = "this build has no CUDA engine";
#endif
  return d;
}

Result<DenseModel> load_dense(client::Client* daemon, const std::string& model,
                              const std::string& gguf, const DeviceChoice& device) {
  const DenseLoad how = device.gpu ? DenseLoad::Deferred : DenseLoad::Eager;
  if (gguf.empty()) {
    if (daemon == nullptr) return make_error(EINVAL, "no daemon connection and no --gguf file");
    return DenseModel::load_from_daemon(*daemon, model, how);
  }
  return DenseModel::load(gguf, how);
}

Result<CreatedEngine> create_engine(const DenseModel& model, ExpertSource& source,
                                    EngineSetup setup, const DeviceChoice& device) {
  CreatedEngine out;
  const ModelParams& p = model.params();
  const FamilyCapabilities& caps = family_info(p.family).caps;
  const bool batched = device.gpu ? caps.cuda_batched_decode : caps.cpu_batched_decode;
  if (setup.options.sequences > 1 && !batched) {
    out.sequences_note =
        fmt::format("{} sequences asked: the {} engine for {} runs one at a time",
                    setup.options.sequences, device.gpu ? "CUDA" : "CPU", p.architecture);
    setup.options.sequences = 1;
  }
#ifdef EXPERTD_HAVE_CUDA
  if (device.gpu) {
    EXPERTD_TRY_ASSIGN(GpuOptions gpu, parse_vram_experts(setup.vram_experts));
    gpu.coordinate = setup.coordinate;
    gpu.policy = setup.vram_policy;
    EXPERTD_TRY_ASSIGN(gpu.prefill_gemm, parse_prefill_gemm(setup.prefill_gemm));
    gpu.preload = setup.vram_preload;
    gpu.preload_progress = setup.preload_progress;
    EXPERTD_TRY_ASSIGN(out.engine, create_gpu_engine(model, source, setup.options, gpu));
    out.note = out.engine->description();
    return out;
  }
#endif
  EXPERTD_TRY_ASSIGN(out.engine, create_cpu_engine(model, source, setup.options));
  out.note = fmt::format("{} ({})", out.engine->description(), device.why_cpu);
  return out;
}

}  // namespace expertd::engine
