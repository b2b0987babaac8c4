// ExpertKey: one routed expert of a model, (MoE layer, expert index). The slice map places its
// bytes; the cache, the traces and the engines all name experts this way.
#pragma once

#include <cstdint>

namespace expertd {

struct ExpertKey {
  uint32_t layer = 0;
  uint32_t expert = 0;
  friend bool operator==(const ExpertKey&, const ExpertKey&) = default;
};

}  // namespace expertd
