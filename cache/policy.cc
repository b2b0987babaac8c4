#include "cache/policy.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <queue>
#include <unordered_map>

#include "base/check.h"

namespace expertd {
namespace {

constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();

// Resident slots in a doubly-linked list (head = oldest). LRU moves a slot to the tail on every
// access; FIFO only on insert. victim() walks from the head to the first evictable slot, so its
// cost is the number of held slots in front of it.
class ListPolicy final : public ReplacementPolicy {
 public:
  ListPolicy(uint32_t capacity, bool move_on_access)
      : move_on_access_(move_on_access),
        prev_(capacity, kNone),
        next_(capacity, kNone),
        linked_(capacity, false),
        evictable_(capacity, false) {}

  std::string_view name() const override { return move_on_access_ ? "lru" : "fifo"; }

  void on_access(ExpertKey, int32_t slot) override {
    if (slot >= 0 && move_on_access_) {
      unlink(static_cast<uint32_t>(slot));
      push_back(static_cast<uint32_t>(slot));
    }
  }
  void on_insert(uint32_t slot, ExpertKey) override {
    unlink(slot);
    push_back(slot);
  }
  void on_remove(uint32_t slot) override {
    unlink(slot);
    evictable_[slot] = false;
  }
  void on_evictable(uint32_t slot, bool evictable) override { evictable_[slot] = evictable; }

  std::optional<uint32_t> victim(ExpertKey, bool) override {
    for (uint32_t s = head_; s != kNone; s = next_[s]) {
      if (evictable_[s]) return s;
    }
    return std::nullopt;
  }

 private:
  void push_back(uint32_t s) {
    prev_[s] = tail_;
    next_[s] = kNone;
    if (tail_ != kNone) next_[tail_] = s;
    tail_ = s;
    if (head_ == kNone) head_ = s;
    linked_[s] = true;
  }
  void unlink(uint32_t s) {
    if (!linked_[s]) return;
    if (prev_[s] != kNone) next_[prev_[s]] = next_[s];
    if (next_[s] != kNone) prev_[next_[s]] = prev_[s];
    if (head_ == s) head_ = next_[s];
    if (tail_ == s) tail_ = prev_[s];
    prev_[s] = next_[s] = kNone;
    linked_[s] = false;
  }

  bool move_on_access_;
  std::vector<uint32_t> prev_;
  std::vector<uint32_t> next_;
  std::vector<bool> linked_;
  std::vector<bool> evictable_;
  uint32_t head_ = kNone;
  uint32_t tail_ = kNone;
};

// See policy.h. Value of keeping expert x = p(x) / d(x):
//   p(x) = kRecencyWeight * 2^-(tokens since x was last used) + (1 - kRecencyWeight) * share(x)
//   share(x) = uses of x / uses of x's layer          d(x) = layers until the cursor reaches x
// The weights were chosen on the shared Mixtral traces (docs/CACHE.md has the table).
class CyclicPolicy final : public ReplacementPolicy {
 public:
  explicit CyclicPolicy(const PolicyShape& shape)
      : shape_(shape),
        uses_(static_cast<size_t>(shape.layers) * shape.experts, 0),
        last_token_(static_cast<size_t>(shape.layers) * shape.experts, kNever),
        layer_uses_(shape.layers, 0),
        slot_key_(shape.capacity),
        pos_(shape.capacity, kNone) {
    evictable_.reserve(shape.capacity);
  }

  std::string_view name() const override { return "cyclic"; }

  void on_access(ExpertKey key, int32_t) override {
    EXPERTD_CHECK_LT(key.layer, shape_.layers);
    EXPERTD_CHECK_LT(key.expert, shape_.experts);
    // The cursor moving back to an earlier layer starts a new token.
    if (key.layer < cur_layer_) ++token_;
    cur_layer_ = key.layer;
    ++uses_[index(key)];
    ++layer_uses_[key.layer];
    last_token_[index(key)] = token_;
  }
  void on_insert(uint32_t slot, ExpertKey key) override { slot_key_[slot] = key; }
  void on_remove(uint32_t slot) override { on_evictable(slot, false); }
  void on_evictable(uint32_t slot, bool evictable) override {
    if (evictable && pos_[slot] == kNone) {
      pos_[slot] = static_cast<uint32_t>(evictable_.size());
      evictable_.push_back(slot);
    } else if (!evictable && pos_[slot] != kNone) {
      const uint32_t last = evictable_.back();
      evictable_[pos_[slot]] = last;
      pos_[last] = pos_[slot];
      evictable_.pop_back();
      pos_[slot] = kNone;
    }
  }

  std::optional<uint32_t> victim(ExpertKey incoming, bool force) override {
    uint32_t best = kNone;
    double best_value = std::numeric_limits<double>::infinity();
    for (const uint32_t s : evictable_) {
      const double v = value(slot_key_[s]);
      if (v < best_value) {
        best_value = v;
        best = s;
      }
    }
    if (best == kNone) return std::nullopt;
    if (!force && best_value >= value(incoming)) return std::nullopt;  // not worth a slot
    return best;
  }

 private:
  static constexpr int64_t kNever = std::numeric_limits<int64_t>::min() / 2;
  static constexpr double kRecencyWeight = 0.5;

  size_t index(ExpertKey k) const {
    return static_cast<size_t>(k.layer) * shape_.experts + k.expert;
  }

  double value(ExpertKey k) const {
    const size_t i = index(k);
    const int64_t age = token_ - last_token_[i];
    const double recency = age > 60 ? 0.0 : std::ldexp(1.0, -static_cast<int>(age));
    const double share = layer_uses_[k.layer] ? static_cast<double>(uses_[i]) /
                                                    static_cast<double>(layer_uses_[k.layer])
                                              : 0.0;
    const double p = kRecencyWeight * recency + (1.0 - kRecencyWeight) * share;
    uint32_t d = (k.layer + shape_.layers - cur_layer_) % shape_.layers;
    if (d == 0) d = shape_.layers;  // the current layer is next wanted a whole cycle from now
    return p / d;
  }

  PolicyShape shape_;
  std::vector<uint64_t> uses_;
  std::vector<int64_t> last_token_;
  std::vector<uint64_t> layer_uses_;
  std::vector<ExpertKey> slot_key_;
  std::vector<uint32_t> pos_;        // slot -> index in evictable_, kNone when not evictable
  std::vector<uint32_t> evictable_;  // dense set of evictable slots
  int64_t token_ = 0;
  uint32_t cur_layer_ = 0;
};

constexpr std::array<std::string_view, 3> kPolicyNames = {"cyclic", "lru", "fifo"};

}  // namespace

std::span<const std::string_view> policy_names() { return kPolicyNames; }

Result<std::unique_ptr<ReplacementPolicy>> make_policy(std::string_view name,
                                                       const PolicyShape& shape) {
  std::unique_ptr<ReplacementPolicy> p;
  if (name == "lru") {
    p = std::make_unique<ListPolicy>(shape.capacity, true);
  } else if (name == "fifo") {
    p = std::make_unique<ListPolicy>(shape.capacity, false);
  } else if (name == "cyclic") {
    if (shape.layers == 0 || shape.experts == 0) {
      return make_error(EINVAL, "policy 'cyclic' needs the model's layer and expert counts");
    }
    p = std::make_unique<CyclicPolicy>(shape);
  } else {
    return make_error(EINVAL, fmt::format("unknown cache policy '{}' (known: {})", name,
                                          fmt::join(kPolicyNames, ", ")));
  }
  return p;
}

Result<SimResult> simulate_policy(std::string_view policy, const PolicyShape& shape,
                                  std::span<const ExpertKey> accesses) {
  std::unique_ptr<ReplacementPolicy> p;
  EXPERTD_TRY_ASSIGN(p, make_policy(policy, shape));
  for (const ExpertKey& k : accesses) {
    if (k.layer >= shape.layers || k.expert >= shape.experts) {
      return make_error(EINVAL, fmt::format("access (layer {}, expert {}) is outside the model "
                                            "shape ({} layers, {} experts)",
                                            k.layer, k.expert, shape.layers, shape.experts));
    }
  }
  std::vector<int32_t> slot_of(static_cast<size_t>(shape.layers) * shape.experts, -1);
  std::vector<ExpertKey> key_of(shape.capacity);
  uint32_t used = 0;
  SimResult r;
  for (const ExpertKey& k : accesses) {
    const size_t i = static_cast<size_t>(k.layer) * shape.experts + k.expert;
    ++r.accesses;
    p->on_access(k, slot_of[i]);
    if (slot_of[i] >= 0) {
      ++r.hits;
      continue;
    }
    uint32_t slot = 0;
    if (used < shape.capacity) {
      slot = used++;
    } else {
      const auto v = p->victim(k, false);
      if (!v) continue;  // admission refused (or capacity 0): streamed, not cached
      slot = *v;
      const ExpertKey old = key_of[slot];
      slot_of[static_cast<size_t>(old.layer) * shape.experts + old.expert] = -1;
      p->on_remove(slot);
    }
    key_of[slot] = k;
    slot_of[i] = static_cast<int32_t>(slot);
    p->on_insert(slot, k);
    p->on_evictable(slot, true);
  }
  return r;
}

namespace {

using BeladyHeap = std::priority_queue<std::pair<size_t, uint64_t>>;

// Evicts the resident expert whose next use is farthest, unless every resident expert is wanted
// before `incoming_next_use`: then caching the incoming one cannot help (MIN bypasses it) and
// nothing changes. Returns whether a slot was freed. The heap holds stale entries (lazy deletion).
bool evict_farthest(std::unordered_map<uint64_t, size_t>& resident, BeladyHeap& heap,
                    size_t incoming_next_use) {
  while (!heap.empty()) {
    const auto [next_use, victim] = heap.top();
    const auto v = resident.find(victim);
    if (v == resident.end() || v->second != next_use) {
      heap.pop();  // stale
      continue;
    }
    if (next_use < incoming_next_use) return false;
    heap.pop();
    resident.erase(v);
    return true;
  }
  return false;
}

}  // namespace

SimResult simulate_belady(uint32_t capacity, std::span<const ExpertKey> accesses) {
  const size_t n = accesses.size();
  auto key = [](ExpertKey k) { return (static_cast<uint64_t>(k.layer) << 32) | k.expert; };
  constexpr size_t kInf = std::numeric_limits<size_t>::max();
  std::vector<size_t> next_use(n, kInf);
  std::unordered_map<uint64_t, size_t> last;
  for (size_t i = n; i-- > 0;) {
    const auto it = last.find(key(accesses[i]));
    next_use[i] = it == last.end() ? kInf : it->second;
    last[key(accesses[i])] = i;
  }
  std::unordered_map<uint64_t, size_t> resident;  // expert -> its next use
  BeladyHeap heap;
  SimResult r;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t k = key(accesses[i]);
    ++r.accesses;
    auto it = resident.find(k);
    if (it != resident.end()) {
      ++r.hits;
      it->second = next_use[i];
      heap.push({next_use[i], k});
      continue;
    }
    if (capacity == 0) continue;
    if (resident.size() >= capacity && !evict_farthest(resident, heap, next_use[i])) continue;
    resident.emplace(k, next_use[i]);
    heap.push({next_use[i], k});
  }
  return r;
}

}  // namespace expertd
