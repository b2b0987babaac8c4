// The family files: what each family adds to the shared model loader (engine/model.cc). A family
// is a registry row (engine/family.h: names, engine class, capabilities) and a family file here,
// engine/families/<row's file>.cc, which holds its GGUF keys, its tensors and the checks on them,
// and defines its FamilyLoader. docs/ENGINE.md shows how to add one. The forward passes are the
// engine classes' (EngineClass): the generic CpuEngine/GpuEngine run Qwen3-MoE, Mixtral, gpt-oss
// and GLM-4.5 on the shared building blocks (engine/routing.h, engine/cpu_ops.h, kernels/), the
// DeepSeek families have their own pair each.
#pragma once

#include <cstdint>
#include <string>

#include "engine/family.h"
#include "engine/model.h"
#include "engine/model_read.h"
#include "expertd/result.h"
#include "storage/gguf.h"

namespace expertd::engine {

struct FamilyLoader {
  // Checked before the shared keys are read (Mixtral: the `llama` file has routed experts); null:
  // none.
  Status (*check)(const GgufModel& g) = nullptr;
  // The query/key head width comes from attention.key_length_mla and value_length_mla
  // (DeepSeek-V3's MLA), not key_length/value_length.
  bool mla_head = false;
  // The experts' width may come from feed_forward_length when expert_feed_forward_length is absent
  // (llama.cpp's `llama` has only that key).
  bool ff_from_dense_key = false;
  // The family's own keys and checks into `p`, after the shared ones; null: none.
  Status (*read_params)(const GgufModel& g, ModelParams& p) = nullptr;
  // The dense weights when the family's layers are its own (DeepSeek-V3, V4: DenseModel's ds3()
  // or ds4()); null: the shared layer loop (LayerWeights), with the two fields below.
  Status (*load_model)(DenseModel& m) = nullptr;
  // The shared loop's FFN norm tensor (blk.N.<ffn_norm>.weight).
  const char* ffn_norm = "ffn_norm";
  // The family's tensors of layer `layer` (prefix `blk`, "blk.N.") beyond the shared ones; null:
  // none.
  Status (*load_layer)(const GgufModel& g, const detail::Sources& src, const std::string& blk,
                       const ModelParams& p, uint32_t layer, LayerWeights& l) = nullptr;
};

// One per family file.
extern const FamilyLoader kQwen3MoeLoader;
extern const FamilyLoader kMixtralLoader;
extern const FamilyLoader kGptOssLoader;
extern const FamilyLoader kGlm4MoeLoader;
extern const FamilyLoader kDeepSeek3Loader;
extern const FamilyLoader kDeepSeek4Loader;

// The loader of a family.
const FamilyLoader& family_loader(Family family);

}  // namespace expertd::engine
