// The flags expert-run and expert-serve share to reach a model and set up its engine
// (engine/setup.h does the setup): one definition, one help text. Header-only (CLI11 is).
#pragma once

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>

#include "expertd/client.h"

namespace expertd::tools {

struct EngineFlags {
  std::string socket = expertd::client::default_socket();
  std::string model;
  std::string gguf;
  bool cpu = false;
  std::string vram_experts = "auto";
  // The engine's router lookahead: layers ahead it predicts and hints. Not expertd's own
  // --prefetch-depth (the daemon's prefetch window), whose name it had until issue 25.
  uint32_t lookahead = 1;
  uint32_t prefetch_width = 0;
  uint32_t prefill_chunk = 512;
  std::string prefill_gemm = "f32";
  bool no_vram_preload = false;
};

// `model_help`: what --model names for this tool.
inline void add_engine_flags(CLI::App& app, EngineFlags& f, const std::string& model_help) {
  app.add_option("--socket", f.socket, "expertd's control socket");
  app.add_option("--model", f.model, model_help)->required();
  app.add_option("--gguf", f.gguf,
                 "The model's GGUF file to read the dense weights from (default: the files "
                 "expertd passes for --model)");
  app.add_flag("--cpu", f.cpu, "Run the CPU reference engine even when a GPU is present");
  app.add_option("--vram-experts", f.vram_experts,
                 "VRAM expert tier: a number of experts, a size (8G, 512M), 0 for the in-place "
                 "mode (kernels read the daemon's pinned arena), or auto (half the free VRAM)");
  app.add_option("--lookahead,--prefetch-depth", f.lookahead,
                 "Layers ahead the engine's routers predict experts for and hint to expertd (1; "
                 "0 = no hints). --prefetch-depth is its old name; expertd's --prefetch-depth is "
                 "the daemon's own prefetch window");
  app.add_option("--prefetch-width", f.prefetch_width,
                 "Candidates hinted per predicted layer (0 = the model's top-k)");
  app.add_option("--prefill-chunk", f.prefill_chunk,
                 "Prompt positions processed together, each routed expert acquired once per "
                 "chunk (512)")
      ->check(CLI::Range(1u, 1u << 20));
  app.add_option("--prefill-gemm", f.prefill_gemm,
                 "CUDA prefill's expert GEMMs: f32 (the experts dequantised to f32, the numbers "
                 "decode computes) or bf16 (dequantised to bf16, tensor cores, f32 accumulation; "
                 "the softmax-routed families)")
      ->check(CLI::IsMember({"f32", "bf16"}));
  app.add_flag("--no-vram-preload", f.no_vram_preload,
               "Start the CUDA engine with an empty VRAM tier. By default the tier is filled at "
               "start with the experts of the last layers (as llama.cpp loads the experts of its "
               "GPU layers), read through expertd before the first prompt");
}

// The progress of filling the VRAM tier at start (EngineSetup::preload_progress): one line on
// stderr, redrawn per layer, when stderr is a terminal and `quiet` is false; nothing otherwise.
inline std::function<void(uint32_t, uint32_t, uint64_t)> preload_progress(const char* tool,
                                                                          bool quiet) {
  if (quiet || isatty(STDERR_FILENO) != 1) return {};
  return [tool](uint32_t experts, uint32_t of, uint64_t bytes) {
    std::fprintf(stderr, "\r%s: filling the VRAM tier: %u/%u experts, %.2f GiB", tool, experts, of,
                 static_cast<double>(bytes) / (1ull << 30));
    if (experts == of) std::fputc('\n', stderr);
  };
}

}  // namespace expertd::tools
