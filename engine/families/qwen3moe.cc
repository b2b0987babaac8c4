// Qwen3-MoE (`qwen3moe`; Qwen3-30B-A3B, Qwen3-235B-A22B) as llama.cpp's converter writes it: the
// generic engines' base case, which the shared loader (engine/model.cc) reads whole. GQA with
// per-head q/k RMS norms, NEOX RoPE, the softmax top-k router with the top-k weights renormalised
// (engine/routing.h softmax_route) and SwiGLU experts. Nothing of its own to read.
#include "engine/families/families.h"

namespace expertd::engine {

const FamilyLoader kQwen3MoeLoader{};

}  // namespace expertd::engine
