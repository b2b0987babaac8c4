// Where the engine gets routed experts from. The product implementation is DaemonExpertSource
// (libexpertd-client: the bytes are the daemon's arena slots); the engine never reads expert data
// from the GGUF itself. Tests of the math may plug in a source of their own.
//
// Contract: get() returns the experts asked for, in order, held until release() is called with
// the same views; a failed get() holds nothing. prefetch() and set_cursor() are hints: a source
// may ignore them, and their failure does not affect correctness.
#pragma once

#include <cstdint>
#include <span>

#include "engine/model.h"
#include "expertd/result.h"

namespace expertd::engine {

// One held expert: its three projections. gate and up are [n_ff rows, n_embd cols], down is
// [n_embd rows, n_ff cols]. The views stay valid until the expert is released.
struct ExpertView {
  uint32_t layer = 0;
  uint32_t expert = 0;
  WeightView gate;
  WeightView up;
  WeightView down;
  uint64_t handle = 0;  // the source's own identity of the hold (the daemon's slot)
};

struct ExpertHint {
  uint32_t layer = 0;
  uint32_t expert = 0;
  float score = 0.0f;  // router probability in [0, 1]
  // Known, not predicted: the engine will get() it at the token the cursor names, before the
  // cursor passes the layer (a prefill chunk's routing, a hash layer's table). The daemon reads
  // such hints at any prefetch depth; a predicted hint (the router's lookahead) leaves it false.
  bool exact = false;
};

class ExpertSource {
 public:
  virtual ~ExpertSource() = default;
  // Acquires `experts` of `layer` into out[0, experts.size()) (out.size() >= experts.size()),
  // waiting for them as needed.
  virtual Status get(uint32_t layer, std::span<const uint32_t> experts,
                     std::span<ExpertView> out) = 0;
  // Gives back experts returned by get().
  virtual Status release(std::span<const ExpertView> views) = 0;
  // The same for experts the engine copied into memory of its own (its VRAM tier): the source may
  // drop its copies first, so the two tiers hold different experts. The default is release().
  virtual Status release_kept(std::span<const ExpertView> views) { return release(views); }
  // The engine no longer keeps (layer, expert) (its VRAM tier evicted it): a copy the source
  // still has from release_kept() is worth keeping again. Without this, every expert that ever
  // passed through a churning tier stays the source's first victim. The default does nothing.
  virtual Status unkeep(uint32_t /*layer*/, uint32_t /*expert*/) { return Ok{}; }
  // Experts wanted soon, with the router's confidence.
  virtual Status prefetch(std::span<const ExpertHint> hints) = 0;
  // The engine is at (token, layer): hints for layers it has passed are stale.
  virtual Status set_cursor(uint32_t token, uint32_t layer) = 0;
  // The host memory every view get() returns lies in (the daemon's arena mapping), for the GPU
  // engine to register with CUDA once; empty when views may point anywhere.
  virtual std::span<const uint8_t> host_memory() const { return {}; }
  // Whether each of `experts` of `layer` is ready in host memory now, so get() would not wait
  // (out[i] = 1). A hint for moving experts closer ahead of time; the default knows nothing.
  virtual void host_ready(uint32_t layer, std::span<const uint32_t> experts,
                          std::span<uint8_t> out) const {
    (void)layer;
    (void)experts;
    for (uint8_t& o : out) o = 0;
  }
  // Marks out[layer * n_expert + expert] = 1 for every expert ready in host memory now (`out` is
  // zeroed first) and returns how many experts host memory can hold (0: the source does not say).
  // For measuring the tiers, not for the per-layer path.
  virtual uint32_t host_resident(uint32_t n_expert, std::span<uint8_t> out) const {
    (void)n_expert;
    for (uint8_t& o : out) o = 0;
    return 0;
  }
};

// An ExpertSource that passes every call on to `inner`: a wrapper overrides only what it changes
// (TierHintFilter its hints; a test its counting).
class ForwardingSource : public ExpertSource {
 public:
  explicit ForwardingSource(ExpertSource& inner) : inner_(inner) {}
  Status get(uint32_t layer, std::span<const uint32_t> experts,
             std::span<ExpertView> out) override {
    return inner_.get(layer, experts, out);
  }
  Status release(std::span<const ExpertView> views) override { return inner_.release(views); }
  Status release_kept(std::span<const ExpertView> views) override {
    return inner_.release_kept(views);
  }
  Status unkeep(uint32_t layer, uint32_t expert) override { return inner_.unkeep(layer, expert); }
  Status prefetch(std::span<const ExpertHint> hints) override { return inner_.prefetch(hints); }
  Status set_cursor(uint32_t token, uint32_t layer) override {
    return inner_.set_cursor(token, layer);
  }
  std::span<const uint8_t> host_memory() const override { return inner_.host_memory(); }
  void host_ready(uint32_t layer, std::span<const uint32_t> experts,
                  std::span<uint8_t> out) const override {
    inner_.host_ready(layer, experts, out);
  }
  uint32_t host_resident(uint32_t n_expert, std::span<uint8_t> out) const override {
    return inner_.host_resident(n_expert, out);
  }

 protected:
  ExpertSource& inner_;
};

}  // namespace expertd::engine
