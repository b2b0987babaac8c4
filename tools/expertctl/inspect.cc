// `expertctl inspect MODEL`: a model's expert slice map, offline (no daemon); for a deepseek4
// (DeepSeek-V4) model also its structure: hash-routed layers, each layer's attention type and
// compress ratio, hyper-connections, the indexer, the LoRA ranks, shared experts and MTP layers;
// for a deepseek2 (DeepSeek-V3) model its MLA widths, dense layers and group-limited routing; for
// a glm4moe (GLM-4.5) model its attention (partial RoPE, q/k norms), the same MoE block and its MTP
// layers.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "engine/family.h"
#include "storage/gguf.h"
#include "storage/slice_map.h"
#include "tools/expertctl/commands.h"
#include "tools/expertctl/daemon_util.h"

namespace expertctl {
namespace {

using expertd::GgufModel;
using expertd::SliceMap;

struct InspectOptions {
  std::string model;
  bool json = false;
  bool tensors = false;
  bool metadata = false;
  bool types = false;
};

nlohmann::ordered_json scalar_json(const expertd::GgufValue& v) {
  if (const auto* u = std::get_if<uint64_t>(&v.v)) return *u;
  if (const auto* s = std::get_if<int64_t>(&v.v)) return *s;
  if (const auto* d = std::get_if<double>(&v.v)) return *d;
  if (const auto* b = std::get_if<bool>(&v.v)) return *b;
  if (const auto* str = v.as_string()) return *str;
  return nullptr;
}

nlohmann::ordered_json value_json(const expertd::GgufValue& v) {
  const expertd::GgufArray* a = v.as_array();
  if (a == nullptr) return scalar_json(v);
  auto out = nlohmann::ordered_json::array();
  for (uint64_t i = 0; i < a->count; ++i) {
    if (a->elem_type == expertd::GgufValueType::STRING) {
      out.push_back(std::string(a->string_at(i)));
    } else {
      const uint32_t w = expertd::gguf_scalar_bytes(a->elem_type);
      if (a->elem_type == expertd::GgufValueType::FLOAT32 ||
          a->elem_type == expertd::GgufValueType::FLOAT64) {
        out.push_back(a->float_at(i).value_or(0.0));
      } else if (a->elem_type == expertd::GgufValueType::BOOL) {
        out.push_back(a->raw[i] != 0);
      } else if (a->elem_type == expertd::GgufValueType::UINT64) {
        uint64_t u = 0;
        std::memcpy(&u, a->raw.data() + i * w, 8);
        out.push_back(u);
      } else {
        out.push_back(a->int_at(i).value_or(0));
      }
    }
  }
  return out;
}

std::string dump(const nlohmann::ordered_json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

void print_metadata_json(const GgufModel& m) {
  for (uint32_t s = 0; s < m.shards().size(); ++s) {
    for (const auto& kv : m.shards()[s].kvs()) {
      nlohmann::ordered_json j;
      j["shard"] = s;
      j["key"] = kv.key;
      j["type"] = std::string(expertd::gguf_value_type_name(kv.value.type));
      if (const auto* a = kv.value.as_array()) {
        j["elem_type"] = std::string(expertd::gguf_value_type_name(a->elem_type));
      }
      j["value"] = value_json(kv.value);
      std::puts(dump(j).c_str());
    }
  }
}

void print_tensors_json(const GgufModel& m) {
  for (uint32_t s = 0; s < m.shards().size(); ++s) {
    for (const auto& t : m.shards()[s].tensors()) {
      nlohmann::ordered_json j;
      j["shard"] = s;
      j["name"] = t.name;
      j["type"] = std::string(expertd::ggml_type_name(t.type));
      auto shape = nlohmann::ordered_json::array();
      for (uint32_t d = 0; d < t.n_dims; ++d) shape.push_back(t.ne[d]);
      j["shape"] = shape;
      j["offset"] = t.offset;
      j["bytes"] = t.bytes;
      std::puts(dump(j).c_str());
    }
  }
}

void print_slices_json(const SliceMap& map) {
  std::array<expertd::ExpertSlice, 3> slices{};
  for (const auto& layer : map.layers()) {
    for (uint32_t e = 0; e < map.expert_count(); ++e) {
      const uint32_t n = map.slices(layer.layer, e, slices);
      for (uint32_t i = 0; i < n; ++i) {
        const auto& s = slices[i];
        // Fixed key order, as documented: shard, layer, expert, kind, offset, bytes, type.
        std::printf(
            "{\"shard\":%u,\"layer\":%u,\"expert\":%u,\"kind\":\"%s\",\"offset\":%llu,"
            "\"bytes\":%llu,\"type\":\"%s\"}\n",
            s.shard, layer.layer, e, std::string(expertd::slice_kind_name(s.kind)).c_str(),
            static_cast<unsigned long long>(s.offset), static_cast<unsigned long long>(s.bytes),
            std::string(expertd::ggml_type_name(s.type)).c_str());
      }
    }
  }
}

std::string meta_string(const GgufModel& m, const std::string& key) {
  if (const auto* v = m.meta().find(key)) {
    if (const auto* s = v->as_string()) return *s;
  }
  return "-";
}

// DeepSeek-V4's structure as llama.cpp's deepseek4 loader reads it from the `deepseek4.*` keys.
// A key the file lacks stays empty (printed "-", null in JSON).
struct Ds4Structure {
  using U = std::optional<uint64_t>;
  uint32_t blocks = 0;  // block_count: main layers, then the MTP (nextn) layers
  U nextn, heads, kv_heads, head_dim, rope_dim, q_lora_rank, o_groups, o_lora_rank, window;
  U index_heads, index_head_dim, index_top_k, hc_mult, hc_sinkhorn_iterations, hash_layers;
  U shared_experts, expert_ff;
  std::optional<double> hc_epsilon;
  std::vector<int64_t> compress_ratios;  // one per block, as the file lists them
};

Ds4Structure read_deepseek4(const GgufModel& m) {
  Ds4Structure d;
  auto u = [&](std::string_view suffix) -> std::optional<uint64_t> {
    const auto* v = m.find_arch(suffix);
    return v != nullptr ? v->as_u64() : std::nullopt;
  };
  d.blocks = static_cast<uint32_t>(u("block_count").value_or(0));
  d.nextn = u("nextn_predict_layers");
  d.heads = u("attention.head_count");
  d.kv_heads = u("attention.head_count_kv");
  d.head_dim = u("attention.key_length");
  d.rope_dim = u("rope.dimension_count");
  d.q_lora_rank = u("attention.q_lora_rank");
  d.o_groups = u("attention.output_group_count");
  d.o_lora_rank = u("attention.output_lora_rank");
  d.window = u("attention.sliding_window");
  d.index_heads = u("attention.indexer.head_count");
  d.index_head_dim = u("attention.indexer.key_length");
  d.index_top_k = u("attention.indexer.top_k");
  d.hc_mult = u("hyper_connection.count");
  d.hc_sinkhorn_iterations = u("hyper_connection.sinkhorn_iterations");
  d.hash_layers = u("hash_layer_count");
  d.shared_experts = u("expert_shared_count");
  d.expert_ff = u("expert_feed_forward_length");
  if (const auto* v = m.find_arch("hyper_connection.epsilon")) d.hc_epsilon = v->as_f64();
  if (const auto* v = m.find_arch("attention.compress_ratios")) {
    if (const expertd::GgufArray* a = v->as_array()) {
      for (uint64_t i = 0; i < a->count; ++i)
        d.compress_ratios.push_back(a->int_at(i).value_or(-1));
    }
  }
  return d;
}

// The attention of a block with compress ratio r: the sliding window alone (0), compressed sparse
// attention with the indexer (4), heavily compressed attention (128).
std::string ds4_attention(int64_t ratio) {
  if (ratio == 0) return "sliding";
  if (ratio == 4) return "CSA";
  if (ratio == 128) return "HCA";
  return fmt::format("ratio {}", ratio);
}

uint64_t ds4_main_layers(const Ds4Structure& d) {
  const uint64_t nextn = d.nextn.value_or(0);
  return nextn <= d.blocks ? d.blocks - nextn : 0;
}

std::string opt(const std::optional<uint64_t>& v) { return v ? fmt::format("{}", *v) : "-"; }

// "0-2" / "5" / "none": a range of layers.
std::string layer_range(uint64_t first, uint64_t end) {
  if (end <= first) return "none";
  return end - first == 1 ? fmt::format("{}", first) : fmt::format("{}-{}", first, end - 1);
}

std::string ds4_arch() {
  return std::string(expertd::engine::family_info(expertd::engine::Family::DeepSeek4).arch);
}

void print_deepseek4(const GgufModel& m) {
  const Ds4Structure d = read_deepseek4(m);
  const uint64_t main_layers = ds4_main_layers(d);
  const uint64_t hash = std::min<uint64_t>(d.hash_layers.value_or(0), main_layers);
  fmt::print("{}\n", m.architecture());
  fmt::print(
      "  attention    {} heads x {} ({} KV head), rope {}, q LoRA {}, output {} groups x "
      "LoRA {}, window {}\n",
      opt(d.heads), opt(d.head_dim), opt(d.kv_heads), opt(d.rope_dim), opt(d.q_lora_rank),
      opt(d.o_groups), opt(d.o_lora_rank), opt(d.window));
  fmt::print("  indexer      {} heads x {}, top-k {} (CSA layers)\n", opt(d.index_heads),
             opt(d.index_head_dim), opt(d.index_top_k));
  fmt::print("  hyper-conn.  {} streams, {} Sinkhorn iterations, eps {}\n", opt(d.hc_mult),
             opt(d.hc_sinkhorn_iterations),
             d.hc_epsilon ? fmt::format("{:g}", *d.hc_epsilon) : "-");
  fmt::print("  shared exp.  {} (ff {})\n", opt(d.shared_experts), opt(d.expert_ff));
  fmt::print("  hash layers  {}: {}\n", hash, layer_range(0, hash));
  fmt::print("  MTP layers   {}: {}\n", d.blocks - main_layers, layer_range(main_layers, d.blocks));
  uint64_t sliding = 0, csa = 0, hca = 0;
  for (const int64_t r : d.compress_ratios) {
    sliding += r == 0;
    csa += r == 4;
    hca += r == 128;
  }
  fmt::print("  attn types   sliding {}, CSA (ratio 4) {}, HCA (ratio 128) {}\n", sliding, csa,
             hca);
  // Each block as LAYER:TYPE, wrapped; hash-routed blocks marked #, MTP blocks +.
  std::string line = "  layers      ";
  for (uint64_t i = 0; i < d.compress_ratios.size(); ++i) {
    const int64_t r = d.compress_ratios[i];
    const std::string item = fmt::format(" {}:{}{}{}", i, r == 0 ? "SWA" : ds4_attention(r),
                                         i < hash ? "#" : "", i >= main_layers ? "+" : "");
    if (line.size() + item.size() > 100) {
      fmt::print("{}\n", line);
      line = "              ";
    }
    line += item;
  }
  fmt::print("{}\n", line);
  fmt::print(
      "               (SWA sliding window only, CSA ratio 4, HCA ratio 128; # hash-routed, "
      "+ MTP)\n");
}

std::optional<uint64_t> arch_u64(const GgufModel& m, std::string_view suffix) {
  const auto* v = m.find_arch(suffix);
  return v != nullptr ? v->as_u64() : std::nullopt;
}

// DeepSeek-V3's MoE block (deepseek2, glm4moe): the dense first layers (not in the slice map),
// the group-limited routing and the shared experts (dense weights, never streamed).
void print_sigmoid_moe(const GgufModel& m) {
  auto u = [&](std::string_view suffix) { return arch_u64(m, suffix); };
  auto f = [&](std::string_view suffix) -> std::string {
    const auto* v = m.find_arch(suffix);
    const auto x = v != nullptr ? v->as_f64() : std::nullopt;
    return x ? fmt::format("{:g}", *x) : "-";
  };
  const uint64_t dense = u("leading_dense_block_count").value_or(0);
  const auto gating = u("expert_gating_func");
  bool norm = false;
  if (const auto* v = m.find_arch("expert_weights_norm")) norm = v->as_bool().value_or(false);
  fmt::print("  dense layers {}: {} (ff {})\n", dense, layer_range(0, dense),
             opt(u("feed_forward_length")));
  fmt::print("  routing      {}, {} experts in {} groups, top-{} from {} groups, scale {}{}\n",
             gating == 2u ? "sigmoid" : "softmax", opt(u("expert_count")),
             opt(u("expert_group_count")), opt(u("expert_used_count")),
             opt(u("expert_group_used_count")), f("expert_weights_scale"),
             norm ? ", renormalised" : "");
  fmt::print("  shared exp.  {} (ff {}, dense weights)\n", opt(u("expert_shared_count")),
             opt(u("expert_feed_forward_length")));
}

// DeepSeek-V3 / Kimi-K2 (`deepseek2`): MLA widths and the MoE block.
void print_deepseek2(const GgufModel& m) {
  auto u = [&](std::string_view suffix) { return arch_u64(m, suffix); };
  const auto kv = u("attention.kv_lora_rank");
  const auto rope = u("rope.dimension_count");
  const auto qk = u("attention.key_length_mla");
  fmt::print("{}\n", m.architecture());
  fmt::print(
      "  attention    {} heads, MLA: q LoRA {}, kv LoRA {} (+ rope {} cached per position), "
      "qk {} + rope {}, v {}\n",
      opt(u("attention.head_count")), opt(u("attention.q_lora_rank")), opt(kv), opt(rope),
      qk && rope && *qk >= *rope ? fmt::format("{}", *qk - *rope) : "-", opt(rope),
      opt(u("attention.value_length_mla")));
  print_sigmoid_moe(m);
}

// GLM-4.5 (`glm4moe`): GQA with q/k/v biases, partial RoPE and optional q/k norms; DeepSeek-V3's
// MoE block; the MTP blocks after the main ones (the engine skips them; their experts are in the
// slice map all the same).
void print_glm4moe(const GgufModel& m) {
  auto u = [&](std::string_view suffix) { return arch_u64(m, suffix); };
  const uint64_t blocks = u("block_count").value_or(0);
  const uint64_t nextn = std::min(u("nextn_predict_layers").value_or(0), blocks);
  fmt::print("{}\n", m.architecture());
  fmt::print(
      "  attention    {} heads, {} KV heads of {}, rope on {} of them (NEOX), q/k norms {}\n",
      opt(u("attention.head_count")), opt(u("attention.head_count_kv")),
      opt(u("attention.key_length")), opt(u("rope.dimension_count")),
      m.find_tensor("blk.0.attn_q_norm.weight") ? "yes" : "no");
  print_sigmoid_moe(m);
  fmt::print("  MTP layers   {}: {} (skipped by the engine)\n", nextn,
             layer_range(blocks - nextn, blocks));
}

nlohmann::ordered_json deepseek4_json(const GgufModel& m) {
  const Ds4Structure d = read_deepseek4(m);
  const uint64_t main_layers = ds4_main_layers(d);
  const uint64_t hash = std::min<uint64_t>(d.hash_layers.value_or(0), main_layers);
  auto u = [](const std::optional<uint64_t>& v) -> nlohmann::ordered_json {
    return v ? nlohmann::ordered_json(*v) : nlohmann::ordered_json(nullptr);
  };
  nlohmann::ordered_json j;
  j["blocks"] = d.blocks;
  j["main_layers"] = main_layers;
  j["heads"] = u(d.heads);
  j["kv_heads"] = u(d.kv_heads);
  j["head_dim"] = u(d.head_dim);
  j["rope_dim"] = u(d.rope_dim);
  j["q_lora_rank"] = u(d.q_lora_rank);
  j["o_groups"] = u(d.o_groups);
  j["o_lora_rank"] = u(d.o_lora_rank);
  j["sliding_window"] = u(d.window);
  j["indexer"] = {
      {"heads", u(d.index_heads)}, {"head_dim", u(d.index_head_dim)}, {"top_k", u(d.index_top_k)}};
  j["hc_mult"] = u(d.hc_mult);
  j["hc_sinkhorn_iterations"] = u(d.hc_sinkhorn_iterations);
  j["hc_epsilon"] = d.hc_epsilon ? nlohmann::ordered_json(*d.hc_epsilon) : nullptr;
  j["shared_experts"] = u(d.shared_experts);
  j["hash_layer_count"] = hash;
  auto hash_layers = nlohmann::ordered_json::array();
  for (uint64_t i = 0; i < hash; ++i) hash_layers.push_back(i);
  j["hash_layers"] = hash_layers;
  auto mtp = nlohmann::ordered_json::array();
  for (uint64_t i = main_layers; i < d.blocks; ++i) mtp.push_back(i);
  j["mtp_layers"] = mtp;
  auto layers = nlohmann::ordered_json::array();
  for (uint64_t i = 0; i < d.compress_ratios.size(); ++i) {
    const int64_t r = d.compress_ratios[i];
    std::string kind = ds4_attention(r);
    for (char& ch : kind) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    nlohmann::ordered_json l;
    l["layer"] = i;
    l["attention"] = r == 0 || r == 4 || r == 128 ? kind : "unknown";
    l["compress_ratio"] = r;
    l["routing"] = i < hash ? "hash" : "score";
    l["mtp"] = i >= main_layers;
    layers.push_back(l);
  }
  j["layers"] = layers;
  nlohmann::ordered_json out;
  out[m.architecture()] = j;
  return out;
}

void print_summary(const GgufModel& m, const SliceMap& map) {
  uint64_t file_bytes = 0;
  for (const auto& s : m.shards()) file_bytes += s.file_size();
  fmt::print("model          {}\n", m.meta().path());
  fmt::print("architecture   {}\n", m.architecture().empty() ? "-" : m.architecture());
  fmt::print("name           {}\n", meta_string(m, "general.name"));
  fmt::print("gguf           v{}, alignment {}, {} tensors, {}\n", m.meta().version(),
             m.meta().alignment(), m.tensor_count(), human_bytes(file_bytes));
  fmt::print("layers         {} ({} with routed experts)\n", map.block_count(),
             map.layers().size());
  if (map.layers().empty()) {
    fmt::print("experts        none: this model has no routed expert tensors\n");
  } else {
    fmt::print("experts        {} per layer, top-k {}\n", map.expert_count(), map.top_k());
    fmt::print("expert bytes   min {} ({}), max {} ({})\n", human_bytes(map.min_expert_bytes()),
               map.min_expert_bytes(), human_bytes(map.max_expert_bytes()), map.max_expert_bytes());
    const auto& l0 = map.layers().front();
    std::string parts;
    for (uint32_t i = 0; i < l0.slice_count; ++i) {
      const auto& s = l0.expert0[i];
      parts += fmt::format("{}{} {} [{}x{}] {}", i ? ", " : "", slice_kind_name(s.kind),
                           ggml_type_name(s.type), s.ne0, s.ne1, human_bytes(s.bytes));
    }
    fmt::print("expert slices  {} (layer {})\n", parts, l0.layer);
  }
  uint64_t tensor_bytes = 0;
  std::map<std::string, std::pair<uint64_t, uint64_t>> by_type;  // type -> (count, bytes)
  for (const auto& s : m.shards()) {
    for (const auto& t : s.tensors()) {
      tensor_bytes += t.bytes;
      auto& e = by_type[std::string(expertd::ggml_type_name(t.type))];
      ++e.first;
      e.second += t.bytes;
    }
  }
  const uint64_t expert_bytes = map.total_expert_bytes();
  fmt::print("expert total   {} ({:.1f}% of tensor data)\n", human_bytes(expert_bytes),
             tensor_bytes
                 ? 100.0 * static_cast<double>(expert_bytes) / static_cast<double>(tensor_bytes)
                 : 0.0);
  fmt::print("dense total    {}\n", human_bytes(tensor_bytes - expert_bytes));
  fmt::print("shards         {}\n", m.shards().size());
  for (uint32_t i = 0; i < m.shards().size(); ++i) {
    const auto& s = m.shards()[i];
    fmt::print("  [{}] {}  {}  {} tensors\n", i, s.path(), human_bytes(s.file_size()),
               s.tensors().size());
  }
  fmt::print("types\n");
  for (const auto& [name, e] : by_type) {
    fmt::print("  {:<8} {:>5} tensors  {}\n", name, e.first, human_bytes(e.second));
  }
  const expertd::engine::FamilyInfo* f = expertd::engine::find_family(m.architecture());
  if (f == nullptr) return;
  if (f->family == expertd::engine::Family::DeepSeek4) print_deepseek4(m);
  if (f->family == expertd::engine::Family::DeepSeek3) print_deepseek2(m);
  if (f->family == expertd::engine::Family::Glm4Moe) print_glm4moe(m);
}

void print_types_json() {
  for (uint32_t id = 0; id < expertd::ggml_type_id_limit(); ++id) {
    const auto t = expertd::ggml_type_traits(id);
    if (!t || t->removed) continue;
    std::printf("{\"id\":%u,\"name\":\"%s\",\"block_elems\":%u,\"block_bytes\":%u}\n", t->id,
                std::string(t->name).c_str(), t->block_elems, t->block_bytes);
  }
}

int run_inspect(const InspectOptions& opts) {
  if (opts.types) {
    print_types_json();
    return 0;
  }
  if (opts.model.empty()) {
    std::fprintf(stderr, "expertctl inspect: MODEL is required (a .gguf file or first shard)\n");
    return 2;
  }
  auto model = GgufModel::open(opts.model);
  if (!model) {
    std::fprintf(stderr, "expertctl inspect: %s\n", model.error().message.c_str());
    return 1;
  }
  auto map = SliceMap::build(*model);
  if (!map) {
    std::fprintf(stderr, "expertctl inspect: %s\n", map.error().message.c_str());
    return 1;
  }
  if (opts.metadata) {
    print_metadata_json(*model);
  } else if (opts.tensors) {
    print_tensors_json(*model);
  } else if (opts.json) {
    if (model->architecture() == ds4_arch()) std::puts(dump(deepseek4_json(*model)).c_str());
    print_slices_json(*map);
  } else {
    print_summary(*model, *map);
  }
  return std::fflush(stdout) == 0 ? 0 : 1;
}

}  // namespace

void add_inspect_command(CLI::App& app, std::function<int()>* run) {
  auto opts = std::make_shared<InspectOptions>();
  CLI::App* cmd = app.add_subcommand(
      "inspect", "Show a GGUF model's layout and expert slice map (offline, no daemon)");
  cmd->add_option("model", opts->model, "GGUF file, or the first shard NAME-00001-of-0000N.gguf");
  cmd->add_flag(
      "--json", opts->json,
      fmt::format("One JSON object per expert slice (JSON Lines): shard, layer, expert, kind, "
                  "offset, bytes, type; a {0} model's structure comes first, as "
                  "{{\"{0}\": {{...}}}}",
                  ds4_arch()));
  cmd->add_flag("--tensors", opts->tensors,
                "One JSON object per tensor: shard, name, type, shape, offset, bytes");
  cmd->add_flag("--metadata", opts->metadata,
                "One JSON object per metadata key: shard, key, type, value");
  cmd->add_flag("--types", opts->types,
                "List the ggml tensor types this build knows (id, name, block size and bytes)");
  cmd->callback([run, opts] { *run = [opts] { return run_inspect(*opts); }; });
}

}  // namespace expertctl
