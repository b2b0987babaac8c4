// Mixtral (`llama` with routed experts; Mixtral-8x7B, Mixtral-8x22B) as llama.cpp's converter
// writes it: the generic engines' forward without per-head q/k norms and with NORM RoPE (the
// converter permutes q/k rows so that NORM on the file computes what rotate_half did on the
// original). The experts are as wide as its FFN: `llama` files may have only feed_forward_length.
#include <fmt/format.h>

#include "engine/families/families.h"

namespace expertd::engine {
namespace {

Status check_mixtral(const GgufModel& g) {
  if (g.find_arch("expert_count") == nullptr) {
    return make_error(ENOTSUP, fmt::format("{}: {} is missing: the engine runs {} models with "
                                           "routed experts ({}) only",
                                           g.meta().path(), g.arch_key("expert_count"),
                                           g.architecture(), family_info(Family::Mixtral).name));
  }
  return Ok{};
}

Status read_mixtral_params(const GgufModel& g, ModelParams& p) {
  p.rope = RopeType::Norm;
  p.qk_norm = false;
  if (const GgufValue* v = g.find_arch("rope.scaling.type")) {
    const std::string* type = v->as_string();
    if (type == nullptr || *type != "none") {
      return make_error(ENOTSUP,
                        fmt::format("{}: {} = {}: the engine runs {} without RoPE "
                                    "scaling",
                                    g.meta().path(), g.arch_key("rope.scaling.type"),
                                    type != nullptr ? *type : "(not a string)", g.architecture()));
    }
  }
  return Ok{};
}

}  // namespace

const FamilyLoader kMixtralLoader{
    .check = check_mixtral,
    .ff_from_dense_key = true,
    .read_params = read_mixtral_params,
};

}  // namespace expertd::engine
