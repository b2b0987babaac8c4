// The model families the engines run: one registry row per GGUF architecture (issue 24). Every
// list of families -- the loader's "runs ..." errors, which engine class serves a family, what it
// can do, expert-forge's --arch -- comes from this table, so a family is added here once, beside
// its family file (engine/families/, docs/ENGINE.md). ModelParams::family is set from it by
// read_params(). A family's names are spelled here and in its family file only
// (tests/docs/check_family_names.py); other code asks this table. Its own library
// (expertd_family, no dependencies) so that expert-forge uses it without the engine.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace expertd::engine {

enum class Family : uint8_t { Qwen3Moe, Mixtral, GptOss, Glm4Moe, DeepSeek3, DeepSeek4 };

// Which engine class runs a family (create_cpu_engine / create_gpu_engine dispatch on it).
enum class EngineClass : uint8_t {
  Generic,    // CpuEngine / GpuEngine
  DeepSeek3,  // Ds3CpuEngine / Ds3GpuEngine
  DeepSeek4,  // Ds4CpuEngine / Ds4GpuEngine
};

// What a family's engines can do. Each flag is checked against the engines' behaviour by
// tests/engine/family_test.cc (the CPU ones here, the CUDA ones on a GPU).
struct FamilyCapabilities {
  bool cpu_batched_prefill = false;   // the CPU engine prefills in chunks grouped by expert
  bool cuda = false;                  // a CUDA engine runs it
  bool cuda_batched_prefill = false;  // the CUDA engine prefills in chunks (else token by token)
  bool prefix_truncate = false;       // truncate(n) for any n <= position(): prefix reuse (CPU)
  bool cuda_prefix_truncate = false;  // the same on the CUDA engine
  bool hash_hints = false;            // hash-routed layers hinted exactly from the token
  bool mtp_blocks = false;            // the loader skips next-n (MTP) blocks when the file has them
  bool cpu_batched_decode = false;    // the CPU engine holds several sequences (decode_batch)
  bool cuda_batched_decode = false;   // the same on the CUDA engine
};

struct FamilyInfo {
  Family family;
  std::string_view arch;    // general.architecture as llama.cpp's converter writes it
  std::string_view name;    // what people call it
  std::string_view alias;   // a short lower-case name where the arch is not one (expert-forge's
                            // --arch, expert-tune's --shape); "" when the arch serves
  std::string_view file;    // its family file: engine/families/<file>.cc
  std::string_view models;  // examples of real models of the family
  std::string_view note;    // a condition on the GGUF beyond the architecture ("" when none)
  EngineClass engine;
  FamilyCapabilities caps;
};

// Every family, in the order the documents list them.
std::span<const FamilyInfo> families();

// The row of a GGUF architecture, or null when no engine runs it.
const FamilyInfo* find_family(std::string_view arch);

// The row of a family (every Family has one).
const FamilyInfo& family_info(Family family);

// The row whose arch or alias is `name`, or null.
const FamilyInfo* find_family_by_name(std::string_view name);

// The short lower-case name of a family: its alias, else its arch.
std::string_view short_name(const FamilyInfo& f);

// "qwen3moe (Qwen3-MoE), llama (Mixtral: with routed experts), ..." for errors and --help; with a
// predicate, only the families it accepts.
std::string family_list();
std::string family_list(bool (*accept)(const FamilyInfo&));

}  // namespace expertd::engine
