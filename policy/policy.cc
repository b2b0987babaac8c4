#include "policy/policy.h"

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

// A policy that values each resident expert and evicts the least valuable one: the dense set of
// evictable slots and the victim scan (linear in them) are shared; subclasses give value(). An
// incoming expert worth no more than every candidate is refused (it streams through staging).
class ValuedPolicy : public ReplacementPolicy {
 public:
  explicit ValuedPolicy(uint32_t capacity) : slot_key_(capacity), pos_(capacity, kNone) {
    evictable_.reserve(capacity);
  }

  void on_insert(uint32_t slot, ExpertKey key) final { slot_key_[slot] = key; }
  void on_remove(uint32_t slot) final { on_evictable(slot, false); }
  void on_evictable(uint32_t slot, bool evictable) final {
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

  std::optional<uint32_t> victim(ExpertKey incoming, bool force) final {
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

 protected:
  virtual double value(ExpertKey k) const = 0;

 private:
  std::vector<ExpertKey> slot_key_;
  std::vector<uint32_t> pos_;        // slot -> index in evictable_, kNone when not evictable
  std::vector<uint32_t> evictable_;  // dense set of evictable slots
};

// See policy.h. Value of keeping expert x = p(x) / d(x):
//   p(x) = kRecencyWeight * 2^-(tokens since x was last used) + (1 - kRecencyWeight) * share(x)
//   share(x) = uses of x / uses of x's layer          d(x) = layers until the cursor reaches x
// The weights were chosen on the shared Mixtral traces (docs/CACHE.md has the table).
class CyclicPolicy final : public ValuedPolicy {
 public:
  explicit CyclicPolicy(const PolicyShape& shape)
      : ValuedPolicy(shape.capacity),
        shape_(shape),
        uses_(static_cast<size_t>(shape.layers) * shape.experts, 0),
        last_token_(static_cast<size_t>(shape.layers) * shape.experts, kNever),
        layer_uses_(shape.layers, 0) {}

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

 private:
  static constexpr int64_t kNever = std::numeric_limits<int64_t>::min() / 2;
  static constexpr double kRecencyWeight = 0.5;

  size_t index(ExpertKey k) const {
    return static_cast<size_t>(k.layer) * shape_.experts + k.expert;
  }

  double value(ExpertKey k) const override {
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
  int64_t token_ = 0;
  uint32_t cur_layer_ = 0;
};

// See policy.h ("cyclic-hint"). Value of keeping expert x = p(x) / d(x), like cyclic, with:
//  - the visit: a layer visit is the run of accesses to one layer; an expert of the current layer
//    not yet wanted in this visit, while fewer than the usual number (the running mean of accesses
//    per visit: top-k) were made, may still be wanted now (d = 1); one already wanted in it is next
//    wanted a cycle from now (d = L). cyclic does not tell them apart and evicts the second expert
//    of a layer to make room for the first.
//  - hints: a hint for x's next visit replaces p(x) by its probability; the experts of a hinted
//    visit that were not hinted share what the hints leave of the visit's top-k, so with sure
//    hints their next use is a cycle later: value max(p' / d, p / (d + L)).
class CyclicHintPolicy final : public ValuedPolicy {
 public:
  explicit CyclicHintPolicy(const PolicyShape& shape)
      : ValuedPolicy(shape.capacity),
        shape_(shape),
        uses_(size(), 0),
        last_token_(size(), kNever),
        last_visit_(size(), 0),
        hint_visit_(size(), 0),
        hint_prob_(size(), 0.0f),
        layer_uses_(shape.layers, 0),
        visits_(shape.layers, 0),
        mass_visit_(shape.layers, 0),
        mass_(shape.layers, 0.0) {}

  std::string_view name() const override { return "cyclic-hint"; }

  void on_access(ExpertKey key, int32_t) override {
    EXPERTD_CHECK_LT(key.layer, shape_.layers);
    EXPERTD_CHECK_LT(key.expert, shape_.experts);
    const size_t i = index(key);
    const uint32_t l = key.layer;
    // Visits are numbered from 1, so 0 means "never" in last_visit_, hint_visit_ and mass_visit_.
    // Another layer, or an expert wanted again in this visit, starts a new visit.
    if (total_visits_ == 0 || l != cur_layer_ || last_visit_[i] == visits_[l]) {
      if (total_visits_ > 0 && l <= cur_layer_) ++token_;
      cur_layer_ = l;
      ++visits_[l];
      ++total_visits_;
      visit_accesses_ = 0;
    }
    ++visit_accesses_;
    ++total_accesses_;
    ++uses_[i];
    ++layer_uses_[l];
    last_token_[i] = token_;
    last_visit_[i] = visits_[l];
  }

  void on_hint(ExpertKey key, uint32_t distance, double probability) override {
    if (key.layer >= shape_.layers || key.expert >= shape_.experts || distance == 0) return;
    const uint32_t l = key.layer;
    // The visit of layer l the hint is for: the next one, or a later one for distances past it.
    // A hint for the current layer from less than a cycle away came late, for the visit under way.
    const bool current = l == cur_layer_ && total_visits_ > 0;
    const uint32_t first = current ? shape_.layers : cycle_distance(l);
    const uint32_t later = distance > first ? (distance - first) / shape_.layers : 0;
    const uint32_t target = current && distance < first ? visits_[l] : visits_[l] + 1 + later;
    if (target == visits_[l] && last_visit_[index(key)] == visits_[l]) return;  // already wanted
    const float q = static_cast<float>(std::clamp(probability, 0.0, 1.0));
    const size_t i = index(key);
    // A hint for a nearer visit is kept over one for a farther visit; a newer one for the same
    // visit replaces it (it was made closer to the access).
    if (hint_visit_[i] <= visits_[l] || target <= hint_visit_[i]) {
      if (mass_visit_[l] <= visits_[l] || target < mass_visit_[l]) {
        mass_visit_[l] = target;
        mass_[l] = 0;
      }
      if (mass_visit_[l] == target) {
        if (hint_visit_[i] == target) mass_[l] -= hint_prob_[i];
        mass_[l] += q;
      }
      hint_visit_[i] = target;
      hint_prob_[i] = q;
    }
  }

 private:
  static constexpr int64_t kNever = std::numeric_limits<int64_t>::min() / 2;
  static constexpr double kRecencyWeight = 0.5;

  size_t size() const { return static_cast<size_t>(shape_.layers) * shape_.experts; }
  size_t index(ExpertKey k) const {
    return static_cast<size_t>(k.layer) * shape_.experts + k.expert;
  }
  uint32_t cycle_distance(uint32_t layer) const {
    return (layer + shape_.layers - cur_layer_) % shape_.layers;
  }
  double top_k() const {
    return total_visits_ ? static_cast<double>(total_accesses_) / total_visits_ : 1.0;
  }

  double value(ExpertKey k) const override {
    const size_t i = index(k);
    const uint32_t l = k.layer;
    const int64_t age = token_ - last_token_[i];
    const double recency = age > 60 ? 0.0 : std::ldexp(1.0, -static_cast<int>(age));
    const double share =
        layer_uses_[l] ? static_cast<double>(uses_[i]) / static_cast<double>(layer_uses_[l]) : 0.0;
    double p = kRecencyWeight * recency + (1.0 - kRecencyWeight) * share;
    const double cycle = shape_.layers;
    uint32_t d = cycle_distance(l);
    uint32_t target = visits_[l] + 1;
    if (d == 0) {
      const bool open = total_visits_ > 0 && last_visit_[i] != visits_[l] &&
                        static_cast<double>(visit_accesses_) + 0.5 < top_k();
      if (open) {
        d = 1;  // may still be wanted in this visit
        target = visits_[l];
      } else {
        d = shape_.layers;
      }
    }
    if (hint_visit_[i] == target) return hint_prob_[i] / d;
    double v = p / d;
    if (mass_visit_[l] == target) {
      const double per_visit = top_k();
      const double left = std::max(0.0, per_visit - mass_[l]) / per_visit;
      v = std::max(p * left / d, p / (d + cycle));
    }
    if (hint_visit_[i] > target) {  // a hint for a later visit, valued at its distance
      v = std::max(v, hint_prob_[i] / (d + cycle * (hint_visit_[i] - target)));
    }
    return v;
  }

  PolicyShape shape_;
  std::vector<uint64_t> uses_;
  std::vector<int64_t> last_token_;
  std::vector<uint32_t> last_visit_;
  std::vector<uint32_t> hint_visit_;  // the visit of the expert's layer its hint is for
  std::vector<float> hint_prob_;
  std::vector<uint64_t> layer_uses_;
  std::vector<uint32_t> visits_;      // visits of each layer so far
  std::vector<uint32_t> mass_visit_;  // the visit of each layer mass_ sums hints for
  std::vector<double> mass_;          // the hinted experts' probabilities, summed
  int64_t token_ = 0;
  uint32_t cur_layer_ = 0;
  uint32_t visit_accesses_ = 0;
  uint64_t total_accesses_ = 0;
  uint64_t total_visits_ = 0;
};

constexpr std::array<std::string_view, 4> kPolicyNames = {"cyclic-hint", "cyclic", "lru", "fifo"};

}  // namespace

std::span<const std::string_view> policy_names() { return kPolicyNames; }

Result<std::unique_ptr<ReplacementPolicy>> make_policy(std::string_view name,
                                                       const PolicyShape& shape) {
  std::unique_ptr<ReplacementPolicy> p;
  if (name == "default") name = kDefaultPolicy;
  if (name == "lru") {
    p = std::make_unique<ListPolicy>(shape.capacity, true);
  } else if (name == "fifo") {
    p = std::make_unique<ListPolicy>(shape.capacity, false);
  } else if (name == "cyclic" || name == "cyclic-hint") {
    if (shape.layers == 0 || shape.experts == 0) {
      return make_error(EINVAL,
                        fmt::format("policy '{}' needs the model's layer and expert counts", name));
    }
    if (name == "cyclic") {
      p = std::make_unique<CyclicPolicy>(shape);
    } else {
      p = std::make_unique<CyclicHintPolicy>(shape);
    }
  } else {
    return make_error(EINVAL, fmt::format("unknown cache policy '{}' (known: {})", name,
                                          fmt::join(kPolicyNames, ", ")));
  }
  return p;
}

namespace {

uint64_t mix64(uint64_t x) {  // splitmix64's finaliser: the noisy hints' deterministic coin
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

Result<SimHints> parse_sim_hints(std::string_view spec) {
  auto bad = [&] {
    return make_error(EINVAL, fmt::format("hints '{}': expected none, oracle:D or noisy:R:D (D "
                                          "layers ahead, 1..1024; R the recall, 0..1)",
                                          spec));
  };
  SimHints h;
  if (spec == "none") return h;
  std::string s(spec);
  const auto colon = s.find(':');
  if (colon == std::string::npos) return bad();
  const std::string kind = s.substr(0, colon);
  std::string rest = s.substr(colon + 1);
  try {
    size_t used = 0;
    if (kind == "noisy") {
      const auto c2 = rest.find(':');
      if (c2 == std::string::npos) return bad();
      h.recall = std::stod(rest.substr(0, c2), &used);
      if (used != c2 || !(h.recall >= 0 && h.recall <= 1)) return bad();
      rest = rest.substr(c2 + 1);
    } else if (kind != "oracle") {
      return bad();
    }
    const unsigned long d = std::stoul(rest, &used);
    if (used != rest.size() || d == 0 || d > 1024) return bad();
    h.depth = static_cast<uint32_t>(d);
  } catch (...) {
    return bad();
  }
  return h;
}

Result<SimResult> simulate_policy(std::string_view policy, const PolicyShape& shape,
                                  std::span<const ExpertKey> accesses, const SimHints& hints) {
  std::unique_ptr<ReplacementPolicy> p;
  EXPERTD_TRY_ASSIGN(p, make_policy(policy, shape));
  for (const ExpertKey& k : accesses) {
    if (k.layer >= shape.layers || k.expert >= shape.experts) {
      return make_error(EINVAL, fmt::format("access (layer {}, expert {}) is outside the model "
                                            "shape ({} layers, {} experts)",
                                            k.layer, k.expert, shape.layers, shape.experts));
    }
  }
  auto index = [&](ExpertKey k) { return static_cast<size_t>(k.layer) * shape.experts + k.expert; };
  // Layer visits: runs of accesses to one layer, each expert at most once.
  std::vector<size_t> visit_start;
  for (size_t a = 0; a < accesses.size(); ++a) {
    bool same = !visit_start.empty() && accesses[a].layer == accesses[visit_start.back()].layer;
    for (size_t b = same ? visit_start.back() : a; same && b < a; ++b)
      same = accesses[b] != accesses[a];
    if (!same) visit_start.push_back(a);
  }
  const size_t visits = visit_start.size();
  visit_start.push_back(accesses.size());
  // The hints each visit gets, drawn once: the recorded experts, or with noise each one replaced
  // by probability 1 - recall with another expert of the layer not routed there.
  std::vector<ExpertKey> predicted(accesses.begin(), accesses.end());
  if (hints.depth > 0 && hints.recall < 1) {
    for (size_t v = 0; v < visits; ++v) {
      for (size_t a = visit_start[v]; a < visit_start[v + 1]; ++a) {
        const uint64_t r = mix64(hints.seed ^ mix64(a));
        if (static_cast<double>(r >> 11) * 0x1.0p-53 < hints.recall) continue;
        const size_t n = visit_start[v + 1] - visit_start[v];
        if (n >= shape.experts) continue;  // no wrong expert to pick
        // The (r % (experts - n))-th expert not routed in this visit.
        uint32_t pick = static_cast<uint32_t>(mix64(r) % (shape.experts - n));
        for (uint32_t e = 0; e < shape.experts; ++e) {
          bool routed = false;
          for (size_t b = visit_start[v]; b < visit_start[v + 1]; ++b) {
            routed |= accesses[b].expert == e;
          }
          if (routed) continue;
          if (pick-- == 0) {
            predicted[a].expert = e;
            break;
          }
        }
      }
    }
  }
  std::vector<int32_t> slot_of(static_cast<size_t>(shape.layers) * shape.experts, -1);
  std::vector<ExpertKey> key_of(shape.capacity);
  std::vector<uint32_t> held;
  uint32_t used = 0;
  SimResult r;
  for (size_t v = 0; v < visits; ++v) {
    // The router's hints for the next `depth` visits, as the daemon would get them before this
    // visit's accesses; distance counts layers (a wrap to a new token counts the whole cycle).
    uint32_t distance = 0;
    for (size_t w = v + 1; w <= v + hints.depth && w < visits; ++w) {
      const uint32_t from = accesses[visit_start[w - 1]].layer;
      const uint32_t to = accesses[visit_start[w]].layer;
      const uint32_t step = (to + shape.layers - from) % shape.layers;
      distance += step == 0 ? shape.layers : step;
      for (size_t a = visit_start[w]; a < visit_start[w + 1]; ++a) {
        p->on_hint(predicted[a], distance, hints.recall);
      }
    }
    // The engine holds a layer's experts until the layer is computed: none of them is evictable
    // while the others are wanted.
    held.clear();
    for (size_t a = visit_start[v]; a < visit_start[v + 1]; ++a) {
      const ExpertKey k = accesses[a];
      const size_t i = index(k);
      ++r.accesses;
      p->on_access(k, slot_of[i]);
      if (slot_of[i] >= 0) {
        ++r.hits;
        p->on_evictable(static_cast<uint32_t>(slot_of[i]), false);
        held.push_back(static_cast<uint32_t>(slot_of[i]));
        continue;
      }
      uint32_t slot = 0;
      if (used < shape.capacity) {
        slot = used++;
      } else {
        const auto victim = p->victim(k, false);
        if (!victim) continue;  // admission refused (or nothing evictable): streamed, not cached
        slot = *victim;
        slot_of[index(key_of[slot])] = -1;
        p->on_remove(slot);
      }
      key_of[slot] = k;
      slot_of[i] = static_cast<int32_t>(slot);
      p->on_insert(slot, k);
      held.push_back(slot);
    }
    for (const uint32_t s : held) p->on_evictable(s, true);
  }
  return r;
}

std::vector<StaticBound> static_hindsight(std::span<const uint32_t> capacities,
                                          std::span<const ExpertKey> accesses) {
  std::unordered_map<uint64_t, uint64_t> uses;
  for (const ExpertKey& k : accesses) ++uses[(static_cast<uint64_t>(k.layer) << 32) | k.expert];
  std::vector<uint64_t> counts;
  for (const auto& [key, n] : uses) counts.push_back(n);
  std::sort(counts.begin(), counts.end(), std::greater<>());
  std::vector<StaticBound> out;
  for (const uint32_t cap : capacities) {
    StaticBound b;
    b.capacity = cap;
    b.result.accesses = accesses.size();
    // The first use of each is a miss, as for every policy here (all start cold).
    for (size_t i = 0; i < cap && i < counts.size(); ++i) b.result.hits += counts[i] - 1;
    out.push_back(b);
  }
  return out;
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
