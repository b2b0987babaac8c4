// The daemon's stats as Prometheus text exposition (format 0.0.4): `expertctl metrics` (for
// node_exporter's textfile collector or a scrape wrapper) and expert-serve's /metrics.
//
// The exporter has no code per counter: it turns the client's Stats back into the schema's message
// (client/wire.h, the same conversion the daemon answers with) and walks it with Cap'n Proto's
// reflection, so a field added to client/expertd.capnp (and to wire.cc, which every field needs
// to reach a client at all) is exported without a line here. The rules, by the field's type:
//   UInt64                  a counter, NAME_total (but the sizes in kGauges);
//   other numbers and Bool  a gauge; a name ending in Ms is converted to NAME_seconds;
//   Text, and kInfoFields   labels of one NAME_info gauge (value 1) per struct;
//   a struct                its fields under the same prefix and labels;
//   a list of structs       each element under the prefix of kElements, labelled by its key;
//   a list of numbers       one sample per element, labelled by kIndexes (layer, shard, depth).
// HELP is the field's trailing comment in the schema (EXPERTD_ALL_FIELD_DOCS, generated).
//
// Hand-written rather than prometheus-cpp (Debian 12's 1.0.1): its serializer leaves newlines in
// HELP unescaped and orders samples by hash, and its -dev package pulls civetweb and libcurl's
// headers into the build for the ~60 lines below (escaping, grouping, HELP/TYPE).
#include "client/prometheus.h"

#include <capnp/dynamic.h>
#include <capnp/message.h>
#include <capnp/schema.h>
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "client/wire.h"

namespace expertd::client {
namespace {

using Labels = std::vector<std::pair<std::string, std::string>>;

// Sizes and settings that are UInt64 but go up and down.
constexpr std::string_view kGauges[] = {"slotBytes", "chunkBytes"};
// Numbers that say whose a record is rather than count anything: labels of the struct's _info.
constexpr std::string_view kInfoFields[] = {"pid", "uid"};

// A list of structs: its elements' name prefix, the field that identifies an element and the
// label that carries it (an unknown list: its own name, labelled by position as `index`).
struct Element {
  std::string_view list, prefix, key, label;
};
constexpr Element kElements[] = {
    {"models", "model_", "name", "model"},
    {"sessions", "session_", "session", "session"},
    {"prefetchDepths", "prefetch_depth_", "depth", "depth"},
};

// A list of numbers: the label of an element's position, and the value of position 0. Found by
// the list's name, else by its first word (layerHits: layer, shardReadRetries: shard), else the
// label is `index`.
struct Index {
  std::string_view list, label;
  uint32_t first;
};
constexpr Index kIndexes[] = {
    {"hintPrecision", "depth", 1},
    {"readDepthNs", "reads", 0},
    {"layer", "layer", 0},
    {"shard", "shard", 0},
};

const Index* find_index(std::string_view list) {
  for (const auto& e : kIndexes) {
    if (list == e.list) return &e;
  }
  for (const auto& e : kIndexes) {
    if (list.size() > e.list.size() && list.starts_with(e.list) && list[e.list.size()] >= 'A' &&
        list[e.list.size()] <= 'Z') {
      return &e;
    }
  }
  return nullptr;
}

template <typename T, size_t N>
const T* find_by_list(const T (&table)[N], std::string_view list) {
  for (const auto& e : table) {
    if (e.list == list) return &e;
  }
  return nullptr;
}

bool listed(std::span<const std::string_view> names, std::string_view name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

std::string snake(std::string_view camel) {
  std::string out;
  for (size_t i = 0; i < camel.size(); ++i) {
    const char c = camel[i];
    if (c >= 'A' && c <= 'Z') {
      if (i > 0) out += '_';
      out += static_cast<char>(c - 'A' + 'a');
    } else {
      out += c;
    }
  }
  return out;
}

// The text format's escapes: label values escape \ " and newline; HELP escapes \ and newline.
std::string escape(std::string_view s, bool quote) {
  std::string out;
  for (const char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '"' && quote) {
      out += "\\\"";
    } else {
      out += c;
    }
  }
  return out;
}

std::string label_text(const Labels& labels) {
  if (labels.empty()) return {};
  std::string out = "{";
  for (size_t i = 0; i < labels.size(); ++i) {
    out +=
        fmt::format("{}{}=\"{}\"", i ? "," : "", labels[i].first, escape(labels[i].second, true));
  }
  return out + "}";
}

std::string number_text(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return fmt::format("{}", v);
}

// The families in the order first seen, each with its samples together (the format requires it).
class Exposition {
 public:
  void add(const std::string& name, const char* type, const std::string& help, const Labels& labels,
           std::string value) {
    auto [it, fresh] = index_.try_emplace(name, families_.size());
    if (fresh) families_.push_back(Family{name, type, help, {}});
    Family& f = families_[it->second];
    if (f.type != type && clash_.empty()) {
      clash_ = fmt::format("two fields export {} (a {} and a {}): rename one in the schema", name,
                           f.type, type);
    }
    f.samples.push_back(fmt::format("{}{} {}", name, label_text(labels), value));
  }
  const std::string& clash() const { return clash_; }

  std::string text() const {
    std::string out;
    for (const auto& f : families_) {
      out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", f.name, escape(f.help, false), f.name,
                         f.type);
      for (const auto& s : f.samples) out += s + "\n";
    }
    return out;
  }

 private:
  struct Family {
    std::string name;
    std::string type;
    std::string help;
    std::vector<std::string> samples;
  };
  std::vector<Family> families_;
  std::map<std::string, size_t> index_;
  std::string clash_;
};

std::string help_of(std::string_view strukt, std::string_view field) {
  struct Doc {
    std::string_view strukt, field, text;
  };
#define EXPERTD_DOC(s, f, d) Doc{s, f, d},
  static constexpr Doc kDocs[] = {EXPERTD_ALL_FIELD_DOCS(EXPERTD_DOC)};
#undef EXPERTD_DOC
  for (const auto& d : kDocs) {
    if (d.strukt == strukt && d.field == field && !d.text.empty()) return std::string(d.text);
  }
  return fmt::format("{}.{} (client/expertd.capnp)", strukt, field);
}

bool is_number(capnp::schema::Type::Which w) {
  using W = capnp::schema::Type;
  switch (w) {
    case W::INT8:
    case W::INT16:
    case W::INT32:
    case W::INT64:
    case W::UINT8:
    case W::UINT16:
    case W::UINT32:
    case W::UINT64:
    case W::FLOAT32:
    case W::FLOAT64:
    case W::BOOL:
      return true;
    default:
      return false;
  }
}

std::string value_text(const capnp::DynamicValue::Reader& v) {
  switch (v.getType()) {
    case capnp::DynamicValue::BOOL:
      return v.as<bool>() ? "1" : "0";
    case capnp::DynamicValue::INT:
      return std::to_string(v.as<int64_t>());
    case capnp::DynamicValue::UINT:
      return std::to_string(v.as<uint64_t>());
    case capnp::DynamicValue::FLOAT:
      return number_text(v.as<double>());
    default:
      return "NaN";
  }
}

// One number: a counter or a gauge named PREFIX + the field's snake name.
void add_number(Exposition& out, const std::string& prefix, std::string_view field,
                capnp::schema::Type::Which type, const capnp::DynamicValue::Reader& v,
                const Labels& labels, const std::string& help) {
  std::string name = "expertd_" + prefix + snake(field);
  if (field.ends_with("Ms")) {
    const double ms =
        v.getType() == capnp::DynamicValue::UINT ? double(v.as<uint64_t>()) : v.as<double>();
    name = "expertd_" + prefix + snake(field.substr(0, field.size() - 2)) + "_seconds";
    out.add(name, "gauge", help, labels, number_text(ms / 1000.0));
    return;
  }
  const bool counter = type == capnp::schema::Type::UINT64 && !listed(kGauges, field);
  if (counter) name += "_total";
  out.add(name, counter ? "counter" : "gauge", help, labels, value_text(v));
}

void walk(capnp::DynamicStruct::Reader s, const std::string& prefix, const Labels& labels,
          std::string_view key, Exposition& out);

void walk_list(capnp::DynamicList::Reader list, std::string_view field, std::string_view strukt,
               const std::string& prefix, const Labels& labels, Exposition& out) {
  const auto element = list.getSchema().getElementType();
  const std::string help = help_of(strukt, field);
  if (element.isStruct()) {
    const Element* e = find_by_list(kElements, field);
    const std::string child = e ? std::string(e->prefix) : snake(field) + "_";
    for (uint32_t i = 0; i < list.size(); ++i) {
      auto item = list[i].as<capnp::DynamicStruct>();
      Labels l = labels;
      if (e && item.getSchema().findFieldByName(std::string(e->key)) != nullptr) {
        const auto k = item.get(std::string(e->key));
        l.emplace_back(std::string(e->label), k.getType() == capnp::DynamicValue::TEXT
                                                  ? std::string(k.as<capnp::Text>().cStr())
                                                  : value_text(k));
        walk(item, prefix + child, l, e->key, out);
      } else {
        l.emplace_back("index", std::to_string(i));
        walk(item, prefix + child, l, {}, out);
      }
    }
    return;
  }
  if (!is_number(element.which())) return;
  const Index* ix = find_index(field);
  for (uint32_t i = 0; i < list.size(); ++i) {
    Labels l = labels;
    l.emplace_back(ix ? std::string(ix->label) : "index", std::to_string(i + (ix ? ix->first : 0)));
    add_number(out, prefix, field, element.which(), list[i], l, help);
  }
}

void walk(capnp::DynamicStruct::Reader s, const std::string& prefix, const Labels& labels,
          std::string_view key, Exposition& out) {
  const auto schema = s.getSchema();
  const std::string strukt = schema.getShortDisplayName().cStr();
  Labels info = labels;
  for (const auto field : schema.getFields()) {
    const std::string_view name = field.getProto().getName().cStr();
    if (name == key || !s.has(field)) continue;
    const auto type = field.getType();
    const auto v = s.get(field);
    if (type.isText()) {
      info.emplace_back(snake(name), v.as<capnp::Text>().cStr());
    } else if (listed(kInfoFields, name) && is_number(type.which())) {
      info.emplace_back(snake(name), value_text(v));
    } else if (type.isStruct()) {
      walk(v.as<capnp::DynamicStruct>(), prefix, labels, {}, out);
    } else if (type.isList()) {
      walk_list(v.as<capnp::DynamicList>(), name, strukt, prefix, labels, out);
    } else if (is_number(type.which())) {
      add_number(out, prefix, name, type.which(), v, labels, help_of(strukt, name));
    }
  }
  if (info.size() > labels.size()) {
    out.add("expertd_" + prefix + "info", "gauge",
            fmt::format("{}'s text fields as labels (value 1)", strukt), info, "1");
  }
}

}  // namespace

expertd::Result<std::string> prometheus_text(const expertd::client::Stats& stats) {
  capnp::MallocMessageBuilder message;
  auto root = message.initRoot<expertd::rpc::Stats>();
  expertd::wire::fill(stats, root);
  Exposition out;
  walk(capnp::toDynamic(root.asReader()), "", {}, {}, out);
  if (!out.clash().empty()) return expertd::make_error(EINVAL, out.clash());
  return out.text();
}

}  // namespace expertd::client
