#include "engine/engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>

#include "engine/cpu_ops.h"
#include "engine/routing.h"

namespace expertd::engine {

Status RoutingScript::set(uint32_t pos, uint32_t layer, ScriptedRoute route, const ModelParams& p) {
  if (pos >= tokens_ || layer >= layers_) {
    return make_error(EINVAL, fmt::format("routing script: position {} layer {} is outside {} "
                                          "tokens x {} layers",
                                          pos, layer, tokens_, layers_));
  }
  if (route.experts.size() != p.n_expert_used) {
    return make_error(EINVAL, fmt::format("routing script: token {} layer {} routes to {} experts, "
                                          "the model uses {}",
                                          pos, layer, route.experts.size(), p.n_expert_used));
  }
  for (const uint32_t e : route.experts) {
    if (e >= p.n_expert) {
      return make_error(EINVAL, fmt::format("routing script: token {} layer {}: expert {} is "
                                            "outside the model's {}",
                                            pos, layer, e, p.n_expert));
    }
  }
  if (route.weights.empty()) {
    route.weights.assign(route.experts.size(), 1.0f / static_cast<float>(route.experts.size()));
  } else if (route.weights.size() != route.experts.size()) {
    return make_error(EINVAL, fmt::format("routing script: token {} layer {}: {} weights for {} "
                                          "experts",
                                          pos, layer, route.weights.size(), route.experts.size()));
  }
  for (const auto& [depth, ids] : route.predicted) {
    for (const uint32_t e : ids) {
      if (e >= p.n_expert) {
        return make_error(EINVAL, fmt::format("routing script: token {} layer {}: predicted "
                                              "expert {} (depth {}) is outside the model's {}",
                                              pos, layer, e, depth, p.n_expert));
      }
    }
  }
  if (!route.predicted.empty()) has_predictions_ = true;
  const uint64_t i = uint64_t{pos} * layers_ + layer;
  routes_[i] = std::move(route);
  present_[i] = 1;
  return Ok{};
}

HintPlanner::HintPlanner(const ModelParams& p, const EngineOptions& o)
    : n_layer_(p.n_layer),
      n_expert_(p.n_expert),
      depth_(o.prefetch_depth),
      width_(o.prefetch_width == 0 ? p.n_expert_used : std::min(o.prefetch_width, p.n_expert)),
      hinted_(uint64_t{p.n_layer} * p.n_expert),
      predicted_(uint64_t{o.prefetch_depth} * p.n_layer * p.n_expert),
      predicted_counts_(o.prefetch_depth),
      pending_at_(uint64_t{p.n_layer} * p.n_expert),
      order_(p.n_expert) {
  pending_.reserve(uint64_t{depth_} * std::max(width_, p.n_expert_used) + p.n_expert);
}

void HintPlanner::begin_token() {
  std::fill(hinted_.begin(), hinted_.end(), 0);
  std::fill(predicted_.begin(), predicted_.end(), 0);
  pending_.clear();
  current_ = 0;
}

void HintPlanner::add(uint32_t next, uint32_t expert, float score) {
  if (next >= n_layer_ || expert >= n_expert_ || next <= current_) return;
  const uint32_t depth = next - current_;
  if (depth <= depth_) {
    uint8_t& p = predicted_[(uint64_t{depth - 1} * n_layer_ + next) * n_expert_ + expert];
    if (p == 0) {
      p = 1;
      ++predicted_counts_[depth - 1];
    }
  }
  const uint64_t key = uint64_t{next} * n_expert_ + expert;
  uint8_t& mark = hinted_[key];
  if (mark != 0) {
    // Wanted again by another row of the same step or chunk while its hint is still pending: the
    // chance that at least one of them routes to it, so an expert several rows want comes first.
    const uint32_t at = pending_at_[key];
    if (at != 0 && at <= pending_.size()) {
      ExpertHint& h = pending_[at - 1];
      if (h.layer == next && h.expert == expert) h.score = 1.0f - (1.0f - h.score) * (1.0f - score);
    }
    return;
  }
  mark = static_cast<uint8_t>(std::min<uint32_t>(next - current_, 255));
  pending_.push_back(ExpertHint{next, expert, score});
  pending_at_[key] = static_cast<uint32_t>(pending_.size());
}

bool take_scripted_route(const EngineOptions& o, uint32_t pos, uint32_t layer,
                         std::span<uint32_t> selected, std::span<float> weights,
                         EngineStats& stats) {
  const ScriptedRoute* r = o.script != nullptr ? o.script->find(pos, layer) : nullptr;
  if (r == nullptr) return false;
  std::copy(r->experts.begin(), r->experts.end(), selected.begin());
  std::copy(r->weights.begin(), r->weights.end(), weights.begin());
  ++stats.scripted_routes;
  return true;
}

void finish_prefill_chunk(std::vector<RoutingRecord>* log, size_t first, uint32_t n,
                          EngineStats& stats) {
  if (log != nullptr) {
    std::stable_sort(
        log->begin() + static_cast<int64_t>(first), log->end(),
        [](const RoutingRecord& a, const RoutingRecord& b) { return a.token < b.token; });
  }
  stats.tokens += n;
  stats.prefill_tokens += n;
  ++stats.prefill_chunks;
}

void start_prefill_cursor(ExpertSource& source, uint32_t last, uint32_t n_layer,
                          EngineStats& stats) {
  if (last > 0 && !source.set_cursor(last - 1, n_layer - 1)) ++stats.hint_errors;
}

Status end_prefill_chunk(Status done, std::vector<RoutingRecord>* log, size_t first, uint32_t n,
                         uint32_t pos0, uint32_t& pos, EngineStats& stats) {
  if (!done) {
    if (log != nullptr) log->resize(first);
    pos = pos0;
    return done;
  }
  pos = pos0 + n;
  finish_prefill_chunk(log, first, n, stats);
  return Ok{};
}

RoutingRecord* log_route(std::vector<RoutingRecord>* log, uint32_t pos, uint32_t layer,
                         std::span<const uint32_t> experts, std::span<const float> weights) {
  if (log == nullptr) return nullptr;
  log->push_back(RoutingRecord{pos,
                               layer,
                               std::vector<uint32_t>(experts.begin(), experts.end()),
                               std::vector<float>(weights.begin(), weights.end()),
                               {}});
  return &log->back();
}

void routed_chunk(HintPlanner& planner, uint32_t layer, std::span<const uint32_t> experts,
                  EngineStats& stats, std::vector<RoutingRecord>* log, size_t first) {
  const bool logged = log != nullptr && first < log->size();
  planner.routed(layer, experts, stats, logged ? &(*log)[first] : nullptr);
  if (!logged) return;
  for (size_t i = first + 1; i < log->size(); ++i) (*log)[i].predicted = (*log)[first].predicted;
}

void HintPlanner::add_ranked(uint32_t next, std::span<const double> probs) {
  top_indices(probs, order_, width_);
  for (uint32_t i = 0; i < width_; ++i) {
    add(next, order_[i], static_cast<float>(probs[order_[i]]));
  }
}

void HintPlanner::add_ranked(uint32_t next, std::span<const float> probs) {
  top_indices(probs, order_, width_);
  for (uint32_t i = 0; i < width_; ++i) add(next, order_[i], probs[order_[i]]);
}

void HintPlanner::add_listed(uint32_t next, std::span<const uint32_t> experts, float score) {
  for (const uint32_t e : experts) add(next, e, score);
}

std::span<const ExpertHint> HintPlanner::take(EngineStats& stats) {
  stats.hints_sent += pending_.size();
  std::span<const ExpertHint> out(pending_.data(), pending_.size());
  return out;
}

void HintPlanner::routed(uint32_t layer, std::span<const uint32_t> experts, EngineStats& stats,
                         RoutingRecord* rec) {
  pending_.clear();
  if (depth_ == 0 || layer == 0 || layer >= n_layer_) return;
  stats.routed_hintable += experts.size();
  if (stats.by_depth.size() < depth_) stats.by_depth.resize(depth_);
  for (uint32_t d = 1; d <= depth_; ++d) {
    DepthStats& ds = stats.by_depth[d - 1];
    ds.predicted += predicted_counts_[d - 1];  // predictions made for this layer, counted once
    predicted_counts_[d - 1] = 0;
    if (layer < d) continue;
    ds.routed += experts.size();
    for (const uint32_t e : experts) {
      ds.correct += predicted_[(uint64_t{d - 1} * n_layer_ + layer) * n_expert_ + e];
    }
  }
  for (const uint32_t e : experts)
    stats.hinted_routed += hinted_[uint64_t{layer} * n_expert_ + e] != 0;
  if (rec == nullptr) return;
  for (uint32_t e = 0; e < n_expert_; ++e) {
    const uint8_t d = hinted_[uint64_t{layer} * n_expert_ + e];
    if (d != 0) rec->predicted[d].push_back(e);
  }
}

void add_scripted_hints(const RoutingScript& script, uint32_t pos, uint32_t from, uint32_t next,
                        HintPlanner& planner) {
  const ScriptedRoute* r = script.find(pos, next);
  if (r == nullptr) return;
  if (!script.has_predictions()) {
    for (size_t i = 0; i < r->experts.size(); ++i) {
      planner.add_listed(next, std::span<const uint32_t>(&r->experts[i], 1), r->weights[i]);
    }
    return;
  }
  const auto it = r->predicted.find(next - from);
  if (it != r->predicted.end()) planner.add_listed(next, it->second, 1.0f);
}

void hint_needed(ExpertSource& source, uint32_t layer, std::span<const uint32_t> needed,
                 std::span<ExpertHint> scratch, EngineStats& stats) {
  for (size_t i = 0; i < needed.size(); ++i) scratch[i] = ExpertHint{layer, needed[i], 1.0f, true};
  stats.prefill_hints += needed.size();
  if (!source.prefetch(scratch.first(needed.size()))) ++stats.hint_errors;
}

void hint_hash_layer(ExpertSource& source, const Ds4Weights& w, uint32_t layer, uint32_t k,
                     std::span<const uint32_t> tokens, std::vector<uint8_t>& mark,
                     std::vector<ExpertHint>& out, EngineStats& stats) {
  out.clear();
  std::fill(mark.begin(), mark.end(), 0);
  const uint32_t* tid2eid = w.layers[layer].tid2eid.data();
  for (const uint32_t token : tokens) {
    for (uint32_t i = 0; i < k; ++i) {
      const uint32_t e = tid2eid[uint64_t{token} * k + i];
      if (e >= mark.size() || mark[e] != 0) continue;
      mark[e] = 1;
      out.push_back(ExpertHint{layer, e, 1.0f, true});
    }
  }
  stats.hash_hints += out.size();
  if (!out.empty() && !source.prefetch(out)) ++stats.hint_errors;
}

Status check_cpu_model(const DenseModel& model) {
  if (!model.deferred()) return Ok{};
  return make_error(EINVAL, fmt::format("{}: the CPU engine needs the dense weights in memory; "
                                        "this model was loaded with DenseLoad::Deferred",
                                        model.path()));
}

Status check_engine_options(const ModelParams& p, const EngineOptions& o, uint32_t max_sequences) {
  if (o.max_context == 0) return make_error(EINVAL, "max_context must be at least 1");
  if (o.sequences == 0) return make_error(EINVAL, "sequences must be at least 1");
  if (o.sequences > max_sequences) {
    return make_error(EINVAL, fmt::format("{} sequences at once: this engine for {} holds {}",
                                          o.sequences, p.architecture, max_sequences));
  }
  if (o.prefetch_width > p.n_expert) {
    return make_error(EINVAL, fmt::format("prefetch width {} exceeds the {} experts per layer",
                                          o.prefetch_width, p.n_expert));
  }
  return Ok{};
}

Status check_decode(const ModelParams& p, const EngineOptions& o, uint32_t pos, uint32_t token,
                    size_t logits) {
  if (token >= p.n_vocab) {
    return make_error(EINVAL,
                      fmt::format("token {} is outside the vocabulary of {}", token, p.n_vocab));
  }
  if (pos >= o.max_context) {
    return make_error(ENOSPC, fmt::format("the KV cache is full ({} positions)", o.max_context));
  }
  if (logits < p.n_vocab) {
    return make_error(EINVAL,
                      fmt::format("room for {} logits, the vocabulary has {}", logits, p.n_vocab));
  }
  return Ok{};
}

Status check_prefill(const ModelParams& p, const EngineOptions& o, uint32_t pos,
                     std::span<const uint32_t> tokens, size_t logits) {
  if (tokens.empty()) return make_error(EINVAL, "an empty prompt: prefill needs a token at least");
  if (o.prefill_chunk == 0) return make_error(EINVAL, "the prefill chunk must be at least 1");
  if (uint64_t{pos} + tokens.size() > o.max_context) {
    return make_error(ENOSPC, fmt::format("{} prompt tokens after position {} do not fit the KV "
                                          "cache of {} positions",
                                          tokens.size(), pos, o.max_context));
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] >= p.n_vocab) {
      return make_error(EINVAL, fmt::format("prompt token {} (at {}) is outside the vocabulary of "
                                            "{}",
                                            tokens[i], i, p.n_vocab));
    }
  }
  if (logits < p.n_vocab) {
    return make_error(EINVAL,
                      fmt::format("room for {} logits, the vocabulary has {}", logits, p.n_vocab));
  }
  return Ok{};
}

Status Engine::prefill(std::span<const uint32_t> tokens, std::span<float> logits) {
  EXPERTD_TRY(check_prefill(params(), options(), position(), tokens, logits.size()));
  const uint64_t t0 = monotonic_ns();
  const size_t chunk = prefill_chunk_size();
  Status st = Ok{};
  for (size_t at = 0; at < tokens.size() && st; at += chunk) {
    const size_t n = std::min(chunk, tokens.size() - at);
    const bool last = at + n == tokens.size();
    st = prefill_chunk(tokens.subspan(at, n), last ? logits : std::span<float>());
  }
  mutable_stats().prefill_ns += monotonic_ns() - t0;
  return st;
}

Status Engine::prefill_chunk(std::span<const uint32_t> tokens, std::span<float> logits) {
  // The default chunk is the whole prompt, so the logits are always there to decode into.
  for (const uint32_t t : tokens) EXPERTD_TRY(decode(t, logits));
  // decode() counted the positions, experts and time; the prefill counters say what part was the
  // prompt.
  EngineStats& s = mutable_stats();
  s.prefill_tokens += tokens.size();
  s.prefill_chunks += 1;
  return Ok{};
}

Status Engine::select_sequence(uint32_t sequence) {
  if (sequence >= sequences()) {
    return make_error(EINVAL,
                      fmt::format("sequence {}: the engine holds {}", sequence, sequences()));
  }
  return Ok{};
}

Status Engine::decode_batch(std::span<const BatchRow> rows, std::span<float> logits) {
  const uint64_t v = params().n_vocab;
  EXPERTD_TRY(check_batch(*this, rows, logits.size()));
  const uint32_t was = selected_sequence();
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPERTD_TRY(select_sequence(rows[i].sequence));
    if (auto st = decode(rows[i].token, logits.subspan(i * v, v)); !st) {
      (void)select_sequence(was);
      return st;
    }
  }
  return select_sequence(was);
}

Status check_batch(const Engine& engine, std::span<const BatchRow> rows, size_t logits) {
  const ModelParams& p = engine.params();
  if (rows.empty()) return make_error(EINVAL, "an empty batch: decode_batch needs a row");
  if (logits < rows.size() * uint64_t{p.n_vocab}) {
    return make_error(EINVAL, fmt::format("room for {} logits, {} rows of {} need {}", logits,
                                          rows.size(), p.n_vocab, rows.size() * p.n_vocab));
  }
  std::vector<uint8_t> seen(engine.sequences(), 0);
  for (const BatchRow& r : rows) {
    if (r.sequence >= engine.sequences()) {
      return make_error(EINVAL, fmt::format("batch row for sequence {}: the engine holds {}",
                                            r.sequence, engine.sequences()));
    }
    if (seen[r.sequence] != 0) {
      return make_error(EINVAL, fmt::format("sequence {} has two rows in one batch", r.sequence));
    }
    seen[r.sequence] = 1;
    if (r.token >= p.n_vocab) {
      return make_error(
          EINVAL, fmt::format("token {} is outside the vocabulary of {}", r.token, p.n_vocab));
    }
  }
  return Ok{};
}

Status check_batch_room(std::span<const BatchRow> rows, uint32_t max_context,
                        const std::function<uint32_t(uint32_t sequence)>& position) {
  for (const BatchRow& r : rows) {
    if (position(r.sequence) >= max_context) {
      return make_error(ENOSPC, fmt::format("sequence {}: the KV cache is full ({} positions)",
                                            r.sequence, max_context));
    }
  }
  return Ok{};
}

void count_batch_step(EngineStats& stats, uint32_t rows, uint64_t t0) {
  stats.tokens += rows;
  stats.batch_rows += rows;
  ++stats.batch_steps;
  stats.decode_ns += monotonic_ns() - t0;
}

bool Engine::truncate(uint32_t n) {
  if (n == position()) return true;
  if (n == 0) {
    reset();
    return true;
  }
  return false;
}

Status write_routing_jsonl(const std::string& path, const std::vector<RoutingRecord>& log) {
  std::ofstream f(path);
  if (!f) return make_error(EIO, fmt::format("{}: cannot write the trace", path));
  for (const RoutingRecord& r : log) {
    nlohmann::json j = {
        {"token", r.token}, {"layer", r.layer}, {"experts", r.experts}, {"weights", r.weights}};
    if (!r.predicted.empty()) {
      nlohmann::json pred = nlohmann::json::object();
      for (const auto& [depth, ids] : r.predicted) pred[std::to_string(depth)] = ids;
      j["predicted"] = pred;
    }
    f << j.dump() << '\n';
  }
  f.close();
  if (!f) return make_error(EIO, fmt::format("{}: write failed", path));
  return Ok{};
}

}  // namespace expertd::engine
