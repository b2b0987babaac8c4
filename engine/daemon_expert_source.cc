#include "engine/daemon_expert_source.h"

#include <fmt/format.h>

#include <algorithm>

#include "engine/dequant.h"
#include "storage/slice_map.h"

namespace expertd::engine {
namespace {

// Matches one slice of the daemon's layout with the GGUF's own slice of the same kind.
Status check_slice(const std::string& model, const client::ModelLayout::Slice& s,
                   const MoeLayer& ours) {
  for (uint32_t i = 0; i < ours.slice_count; ++i) {
    const ExpertSlice& e = ours.expert0[i];
    if (slice_kind_name(e.kind) != s.kind) continue;
    if (e.shard != s.shard || e.offset != s.offset || ours.expert_stride[i] != s.stride ||
        e.bytes != s.bytes || ggml_type_name(e.type) != s.type || e.ne0 != s.ne0 ||
        e.ne1 != s.ne1) {
      return make_error(
          EINVAL, fmt::format("model '{}' layer {} {}: the daemon serves shard {} offset {} "
                              "stride {} {} [{}x{}], this GGUF has shard {} offset {} stride {} "
                              "{} [{}x{}] (a different file?)",
                              model, s.layer, s.kind, s.shard, s.offset, s.stride, s.type, s.ne0,
                              s.ne1, e.shard, e.offset, ours.expert_stride[i],
                              ggml_type_name(e.type), e.ne0, e.ne1));
    }
    return Ok{};
  }
  return make_error(EINVAL, fmt::format("model '{}' layer {}: the daemon has a {} slice this "
                                        "GGUF does not",
                                        model, s.layer, s.kind));
}

Result<WeightView> shape_of(const client::ModelLayout::Slice& s, uint64_t rows, uint64_t cols) {
  const auto type = ggml_type_from_name(s.type);
  if (!type)
    return make_error(EINVAL, fmt::format("layer {} {}: unknown type {}", s.layer, s.kind, s.type));
  EXPERTD_TRY(dequant_check(*type, s.ne0));
  if (s.ne0 != cols || s.ne1 != rows) {
    return make_error(EINVAL, fmt::format("layer {} {}: shape [{}x{}], the model needs [{}x{}]",
                                          s.layer, s.kind, s.ne0, s.ne1, cols, rows));
  }
  const uint64_t row_bytes = *ggml_row_bytes(*type, cols);
  if (row_bytes * rows != s.bytes) {
    return make_error(EINVAL, fmt::format("layer {} {}: {} bytes for [{}x{}] {}", s.layer, s.kind,
                                          s.bytes, cols, rows, s.type));
  }
  return WeightView{*type, nullptr, rows, cols, row_bytes};
}

}  // namespace

Result<std::unique_ptr<DaemonExpertSource>> DaemonExpertSource::create(client::Session& session,
                                                                       const DenseModel& model) {
  const client::ModelLayout& l = session.layout();
  const ModelParams& p = model.params();
  // Every block of the file counts, the MTP blocks too (deepseek4, glm4moe; the engines skip them).
  const uint32_t n_layer = p.n_layer + p.nextn_layers;
  if (l.block_count != n_layer || l.expert_count != p.n_expert || l.top_k != p.n_expert_used) {
    return make_error(EINVAL, fmt::format("model '{}': the daemon has {} layers, {} experts, top-k "
                                          "{}; {} has {}, {}, {}",
                                          l.name, l.block_count, l.expert_count, l.top_k,
                                          model.path(), n_layer, p.n_expert, p.n_expert_used));
  }
  EXPERTD_TRY_ASSIGN(const SliceMap map, SliceMap::build(model.gguf()));
  std::unique_ptr<DaemonExpertSource> src(new DaemonExpertSource(session));
  src->layers_.resize(n_layer);
  std::vector<uint32_t> seen(n_layer, 0);
  for (size_t i = 0; i < l.slices.size(); ++i) {
    const client::ModelLayout::Slice& s = l.slices[i];
    if (s.layer >= n_layer) {
      return make_error(EINVAL, fmt::format("model '{}': slice of layer {}", l.name, s.layer));
    }
    const MoeLayer* ours = map.find_layer(s.layer);
    if (ours == nullptr) {
      return make_error(EINVAL, fmt::format("model '{}' layer {}: the daemon has experts this "
                                            "GGUF does not",
                                            l.name, s.layer));
    }
    EXPERTD_TRY(check_slice(l.name, s, *ours));
    // Slices of a layer are listed in slot order: the index within the layer is the SlotView's.
    const uint32_t index = seen[s.layer]++;
    LayerParts& lp = src->layers_[s.layer];
    if (s.kind == "gate" || s.kind == "up") {
      EXPERTD_TRY_ASSIGN(const WeightView w, shape_of(s, p.n_ff_exp, p.n_embd));
      (s.kind == "gate" ? lp.gate : lp.up) = Part{index, 0, w};
    } else if (s.kind == "gate_up") {  // fused: the gate rows first, then the up rows
      EXPERTD_TRY_ASSIGN(WeightView w, shape_of(s, 2 * uint64_t{p.n_ff_exp}, p.n_embd));
      w.rows = p.n_ff_exp;
      lp.gate = Part{index, 0, w};
      lp.up = Part{index, p.n_ff_exp, w};
    } else if (s.kind == "down") {
      EXPERTD_TRY_ASSIGN(const WeightView w, shape_of(s, p.n_embd, p.n_ff_exp));
      lp.down = Part{index, 0, w};
    } else {
      return make_error(EINVAL, fmt::format("layer {}: unknown slice kind {}", s.layer, s.kind));
    }
  }
  for (uint32_t layer = 0; layer < n_layer; ++layer) {
    const LayerParts& lp = src->layers_[layer];
    // Dense layers (deepseek2's leading ones) have no experts in the file or the daemon.
    if (map.find_layer(layer) == nullptr && seen[layer] == 0) continue;
    if (lp.gate.shape.rows == 0 || lp.up.shape.rows == 0 || lp.down.shape.rows == 0) {
      return make_error(EINVAL, fmt::format("model '{}' layer {}: {} expert slices, expected gate, "
                                            "up and down (or gate_up and down)",
                                            l.name, layer, seen[layer]));
    }
  }
  src->slots_.resize(p.n_expert);
  src->hints_.resize(std::max<size_t>(256, p.n_expert));
  return src;
}

Result<std::unique_ptr<DaemonExpertSource>> DaemonExpertSource::connect(
    const std::string& socket, const std::string& model_name, const DenseModel& model,
    const std::string& client_name) {
  EXPERTD_TRY_ASSIGN(auto client, client::Client::connect(socket));
  return attach(std::move(client), model_name, model, client_name);
}

Result<std::unique_ptr<DaemonExpertSource>> DaemonExpertSource::attach(
    std::unique_ptr<client::Client> client, const std::string& model_name, const DenseModel& model,
    const std::string& client_name) {
  EXPERTD_TRY_ASSIGN(auto session, client->attach(model_name, client_name));
  EXPERTD_TRY_ASSIGN(auto source, create(*session, model));
  source->owned_client_ = std::move(client);
  source->owned_session_ = std::move(session);
  return source;
}

Status DaemonExpertSource::get(uint32_t layer, std::span<const uint32_t> experts,
                               std::span<ExpertView> out) {
  if (layer >= layers_.size() || experts.size() > slots_.size() || out.size() < experts.size()) {
    return make_error(EINVAL,
                      fmt::format("get: layer {} of {}, {} experts of {}, room for {}", layer,
                                  layers_.size(), experts.size(), slots_.size(), out.size()));
  }
  const std::span<client::SlotView> slots(slots_.data(), experts.size());
  EXPERTD_TRY(session_->acquire(layer, experts, slots));
  const LayerParts& lp = layers_[layer];
  auto view = [](const client::SlotView& s, const Part& part) {
    WeightView w = part.shape;
    w.data = s.slices[part.slice].data + part.row_offset * w.row_bytes;
    return w;
  };
  for (size_t i = 0; i < experts.size(); ++i) {
    const client::SlotView& s = slots[i];
    out[i] =
        ExpertView{s.layer, s.expert, view(s, lp.gate), view(s, lp.up), view(s, lp.down), s.slot};
  }
  return Ok{};
}

Status DaemonExpertSource::release(std::span<const ExpertView> views) {
  Status result = Ok{};
  for (const ExpertView& v : views) {
    auto st = session_->release(static_cast<uint32_t>(v.handle));
    if (!st && result) result = std::move(st);
  }
  return result;
}

Status DaemonExpertSource::release_kept(std::span<const ExpertView> views) {
  Status result = Ok{};
  for (const ExpertView& v : views) {
    auto st = session_->release(static_cast<uint32_t>(v.handle), abi::kReleaseClientCopy);
    if (!st && result) result = std::move(st);
  }
  return result;
}

Status DaemonExpertSource::unkeep(uint32_t layer, uint32_t expert) {
  return session_->unkeep(layer, expert);
}

Status DaemonExpertSource::prefetch(std::span<const ExpertHint> hints) {
  while (!hints.empty()) {
    const size_t n = std::min(hints.size(), hints_.size());
    for (size_t i = 0; i < n; ++i) {
      hints_[i] =
          client::PrefetchHint{hints[i].layer, hints[i].expert, hints[i].score, hints[i].exact};
    }
    EXPERTD_TRY(session_->prefetch(std::span<const client::PrefetchHint>(hints_.data(), n)));
    hints = hints.subspan(n);
  }
  return Ok{};
}

Status DaemonExpertSource::set_cursor(uint32_t token, uint32_t layer) {
  return session_->set_cursor(token, layer);
}

std::span<const uint8_t> DaemonExpertSource::host_memory() const {
  return {session_->arena(), session_->arena_bytes()};
}

void DaemonExpertSource::host_ready(uint32_t layer, std::span<const uint32_t> experts,
                                    std::span<uint8_t> out) const {
  for (uint8_t& o : out) o = 0;
  const abi::SlotTableHeader* h = session_->slot_table();
  const abi::SlotEntry* entries = session_->slot_entries();
  if (h == nullptr || entries == nullptr) return;
  for (uint32_t s = 0; s < h->slot_count; ++s) {
    const abi::SlotEntry& e = entries[s];
    if (e.state.load(std::memory_order_acquire) != abi::kSlotReady || e.layer != layer) continue;
    for (size_t i = 0; i < experts.size() && i < out.size(); ++i) {
      if (experts[i] == e.expert) out[i] = 1;
    }
  }
}

uint32_t DaemonExpertSource::host_resident(uint32_t n_expert, std::span<uint8_t> out) const {
  for (uint8_t& o : out) o = 0;
  const abi::SlotTableHeader* h = session_->slot_table();
  const abi::SlotEntry* entries = session_->slot_entries();
  if (h == nullptr || entries == nullptr) return 0;
  for (uint32_t s = 0; s < h->slot_count; ++s) {
    const abi::SlotEntry& e = entries[s];
    if (e.state.load(std::memory_order_acquire) != abi::kSlotReady || e.expert >= n_expert)
      continue;
    const uint64_t i = uint64_t{e.layer} * n_expert + e.expert;
    if (i < out.size()) out[i] = 1;
  }
  return h->slot_count;
}

}  // namespace expertd::engine
