#include "trace/trace.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>

namespace expertd {

std::vector<ExpertKey> Trace::accesses() const {
  std::vector<ExpertKey> out;
  for (const auto& r : records) {
    for (const uint32_t e : r.experts) out.push_back(ExpertKey{r.layer, e});
  }
  return out;
}

namespace {

constexpr uint32_t kMaxListed = 255;  // experts per record, depths, ids per depth (u8 counts)
constexpr size_t kBinaryHeaderBytes = 16;
constexpr size_t kBinaryMinRecordBytes = 4 + 2 + 1 + 1 + 2 + 4;  // one expert, no predictions

// The rules every record obeys, whatever form it came from; `prev` is the record before it.
Status check_record(const TraceRecord& r, const TraceRecord* prev, const std::string& where) {
  if (r.experts.empty() || r.experts.size() > kMaxListed) {
    return make_error(EINVAL, fmt::format("{}: \"experts\" must list 1 to {} experts, found {}",
                                          where, kMaxListed, r.experts.size()));
  }
  if (!r.weights.empty() && r.weights.size() != r.experts.size()) {
    return make_error(EINVAL, fmt::format("{}: \"weights\" has {} entries for {} experts", where,
                                          r.weights.size(), r.experts.size()));
  }
  for (const float w : r.weights) {
    if (!std::isfinite(w)) {
      return make_error(EINVAL, fmt::format("{}: weight {} is not finite", where, w));
    }
  }
  for (const auto& [depth, ids] : r.predicted) {
    if (depth < 1 || depth > kMaxListed || ids.size() > kMaxListed) {
      return make_error(EINVAL,
                        fmt::format("{}: \"predicted\" depth {} with {} ids (depths 1..{}, at "
                                    "most {} ids)",
                                    where, depth, ids.size(), kMaxListed, kMaxListed));
    }
  }
  if (prev != nullptr) {
    if (r.token < prev->token) {
      return make_error(EINVAL, fmt::format("{}: token {} after token {}: records must be in time "
                                            "order",
                                            where, r.token, prev->token));
    }
    if (r.token == prev->token && r.layer <= prev->layer) {
      return make_error(EINVAL, fmt::format("{}: token {} layer {} after layer {}: layers of a "
                                            "token must ascend",
                                            where, r.token, r.layer, prev->layer));
    }
  }
  return Ok{};
}

// Fills the trace's shape from its records; an empty trace is an error.
Status finish(Trace& t, const std::string& path) {
  if (t.records.empty()) return make_error(EINVAL, fmt::format("{}: no trace records", path));
  t.layers = t.experts = t.tokens = 0;
  for (size_t i = 0; i < t.records.size(); ++i) {
    const auto& r = t.records[i];
    t.layers = std::max(t.layers, r.layer + 1);
    for (const uint32_t e : r.experts) t.experts = std::max(t.experts, e + 1);
    // Records are in time order, so a token's records are adjacent.
    if (i == 0 || r.token != t.records[i - 1].token) ++t.tokens;
  }
  return Ok{};
}

Status check_trace(const Trace& t, const std::string& path) {
  if (t.records.empty()) return make_error(EINVAL, fmt::format("{}: no trace records", path));
  for (size_t i = 0; i < t.records.size(); ++i) {
    const Status st = check_record(t.records[i], i ? &t.records[i - 1] : nullptr,
                                   fmt::format("{}: record {}", path, i));
    if (!st) return st;
  }
  return Ok{};
}

Result<uint32_t> get_u32(const nlohmann::json& j, const char* key, const std::string& where) {
  const auto it = j.find(key);
  if (it == j.end()) return make_error(EINVAL, fmt::format("{}: missing \"{}\"", where, key));
  if (!it->is_number_unsigned() || it->get<uint64_t>() > 0xffffffffu) {
    return make_error(EINVAL, fmt::format("{}: \"{}\" must be a non-negative integer, found {}",
                                          where, key, it->dump()));
  }
  return static_cast<uint32_t>(it->get<uint64_t>());
}

// A JSON array of expert ids.
Result<std::vector<uint32_t>> get_ids(const nlohmann::json& a, const char* key,
                                      const std::string& where) {
  if (!a.is_array()) {
    return make_error(EINVAL, fmt::format("{}: \"{}\" must be an array", where, key));
  }
  std::vector<uint32_t> out;
  for (const auto& e : a) {
    if (!e.is_number_unsigned() || e.get<uint64_t>() > 0xffffffffu) {
      return make_error(
          EINVAL, fmt::format("{}: expert id {} is not a non-negative integer", where, e.dump()));
    }
    out.push_back(static_cast<uint32_t>(e.get<uint64_t>()));
  }
  return out;
}

Result<std::vector<double>> get_numbers(const nlohmann::json& a, const char* key,
                                        const std::string& where) {
  if (!a.is_array()) {
    return make_error(EINVAL, fmt::format("{}: \"{}\" must be an array", where, key));
  }
  std::vector<double> out;
  for (const auto& x : a) {
    if (!x.is_number()) {
      return make_error(EINVAL, fmt::format("{}: weight {} is not a number", where, x.dump()));
    }
    out.push_back(x.get<double>());
  }
  return out;
}

Result<nlohmann::json> parse_object(const std::string& line, const std::string& where) {
  auto j = nlohmann::json::parse(line, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return make_error(EINVAL, fmt::format("{}: not a JSON object", where));
  }
  return j;
}

Result<TraceRecord> parse_record(const std::string& line, const std::string& where) {
  nlohmann::json j;
  EXPERTD_TRY_ASSIGN(j, parse_object(line, where));
  TraceRecord r;
  EXPERTD_TRY_ASSIGN(r.token, get_u32(j, "token", where));
  EXPERTD_TRY_ASSIGN(r.layer, get_u32(j, "layer", where));
  const auto ex = j.find("experts");
  if (ex == j.end()) return make_error(EINVAL, fmt::format("{}: missing \"experts\"", where));
  EXPERTD_TRY_ASSIGN(r.experts, get_ids(*ex, "experts", where));
  if (const auto w = j.find("weights"); w != j.end()) {
    std::vector<double> ws;
    EXPERTD_TRY_ASSIGN(ws, get_numbers(*w, "weights", where));
    r.weights.assign(ws.begin(), ws.end());
  }
  if (const auto p = j.find("predicted"); p != j.end()) {
    if (!p->is_object()) {
      return make_error(EINVAL, fmt::format("{}: \"predicted\" must be an object", where));
    }
    for (const auto& [k, v] : p->items()) {
      const bool digits =
          !k.empty() && k.size() <= 3 &&
          std::all_of(k.begin(), k.end(), [](char c) { return c >= '0' && c <= '9'; });
      if (!digits) {
        return make_error(EINVAL, fmt::format("{}: \"predicted\" key \"{}\" is not a depth 1..{}",
                                              where, k, kMaxListed));
      }
      EXPERTD_TRY_ASSIGN(r.predicted[static_cast<uint32_t>(std::stoul(k))],
                         get_ids(v, "predicted", where));
    }
  }
  return r;
}

// Little-endian cursor over a whole binary trace; every read checks the bytes left.
class ByteReader {
 public:
  explicit ByteReader(const std::string& bytes) : bytes_(bytes) {}
  size_t offset() const { return pos_; }
  size_t left() const { return bytes_.size() - pos_; }
  template <typename T>
  bool read(T* out) {
    if (left() < sizeof(T)) return false;
    std::memcpy(out, bytes_.data() + pos_, sizeof(T));  // the format and the host are LE
    pos_ += sizeof(T);
    return true;
  }

 private:
  const std::string& bytes_;
  size_t pos_ = 0;
};

template <typename T>
void put(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}

Status write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) {
    const int e = errno;  // before the format below
    return make_error(e ? e : EIO, fmt::format("{}: cannot create", path));
  }
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) return make_error(EIO, fmt::format("{}: write failed", path));
  return Ok{};
}

Result<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return make_error(ENOENT, fmt::format("{}: cannot open trace", path));
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return make_error(EIO, fmt::format("{}: read failed", path));
  return s;
}

}  // namespace

Result<Trace> load_trace_jsonl(const std::string& path) {
  std::ifstream in(path);
  if (!in) return make_error(ENOENT, fmt::format("{}: cannot open trace", path));
  Trace t;
  std::string line;
  uint64_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = fmt::format("{}:{}", path, line_no);
    TraceRecord r;
    EXPERTD_TRY_ASSIGN(r, parse_record(line, where));
    const Status st = check_record(r, t.records.empty() ? nullptr : &t.records.back(), where);
    if (!st) return st.error();
    t.records.push_back(std::move(r));
  }
  if (in.bad()) return make_error(EIO, fmt::format("{}: read failed", path));
  const Status st = finish(t, path);
  if (!st) return st.error();
  return t;
}

Result<Trace> load_trace_binary(const std::string& path) {
  std::string bytes;
  EXPERTD_TRY_ASSIGN(bytes, read_file(path));
  ByteReader in(bytes);
  char magic[4];
  uint32_t version = 0;
  uint64_t count = 0;
  if (!in.read(&magic) || !in.read(&version) || !in.read(&count)) {
    return make_error(EINVAL, fmt::format("{}: truncated header ({} bytes, {} needed)", path,
                                          bytes.size(), kBinaryHeaderBytes));
  }
  if (std::memcmp(magic, kTraceBinaryMagic, 4) != 0) {
    return make_error(EINVAL, fmt::format("{}: not a binary trace (no \"EXTR\" magic)", path));
  }
  if (version != kTraceBinaryVersion) {
    return make_error(EINVAL, fmt::format("{}: binary trace version {}, this build reads {}", path,
                                          version, kTraceBinaryVersion));
  }
  if (count > in.left() / kBinaryMinRecordBytes) {
    return make_error(EINVAL, fmt::format("{}: record count {} does not fit in the {} bytes that "
                                          "follow the header",
                                          path, count, in.left()));
  }
  Trace t;
  t.records.reserve(count);
  for (uint64_t i = 0; i < count; ++i) {
    const size_t start = in.offset();
    auto truncated = [&] {
      return make_error(EINVAL, fmt::format("{}: record {} at byte {}: truncated at byte {}", path,
                                            i, start, in.offset()));
    };
    TraceRecord r;
    uint16_t layer = 0;
    uint8_t n_experts = 0, n_depths = 0;
    if (!in.read(&r.token) || !in.read(&layer) || !in.read(&n_experts) || !in.read(&n_depths)) {
      return truncated();
    }
    r.layer = layer;
    for (uint8_t k = 0; k < n_experts; ++k) {
      uint16_t e = 0;
      if (!in.read(&e)) return truncated();
      r.experts.push_back(e);
    }
    bool any_weight = false;
    for (uint8_t k = 0; k < n_experts; ++k) {
      float w = 0;
      if (!in.read(&w)) return truncated();
      any_weight = any_weight || !std::isnan(w);
      r.weights.push_back(w);
    }
    if (!any_weight) r.weights.clear();
    uint8_t prev_depth = 0;
    for (uint8_t d = 0; d < n_depths; ++d) {
      uint8_t depth = 0, n_ids = 0;
      if (!in.read(&depth) || !in.read(&n_ids)) return truncated();
      if (depth <= prev_depth) {
        return make_error(EINVAL, fmt::format("{}: record {} at byte {}: predicted depth {} after "
                                              "{} (depths ascend from 1)",
                                              path, i, start, depth, prev_depth));
      }
      prev_depth = depth;
      auto& ids = r.predicted[depth];
      for (uint8_t k = 0; k < n_ids; ++k) {
        uint16_t e = 0;
        if (!in.read(&e)) return truncated();
        ids.push_back(e);
      }
    }
    const Status st = check_record(r, t.records.empty() ? nullptr : &t.records.back(),
                                   fmt::format("{}: record {} at byte {}", path, i, start));
    if (!st) return st.error();
    t.records.push_back(std::move(r));
  }
  if (in.left() != 0) {
    return make_error(EINVAL, fmt::format("{}: {} stray bytes after the last record at byte {}",
                                          path, in.left(), in.offset()));
  }
  const Status st = finish(t, path);
  if (!st) return st.error();
  return t;
}

Result<Trace> load_trace(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return make_error(ENOENT, fmt::format("{}: cannot open trace", path));
  char magic[4] = {};
  in.read(magic, 4);
  if (in.gcount() == 4 && std::memcmp(magic, kTraceBinaryMagic, 4) == 0) {
    return load_trace_binary(path);
  }
  return load_trace_jsonl(path);
}

Status write_trace_jsonl(const std::string& path, const Trace& trace) {
  if (Status st = check_trace(trace, path); !st) return st;
  std::string out;
  for (const auto& r : trace.records) {
    out += fmt::format("{{\"token\": {}, \"layer\": {}, \"experts\": [{}]", r.token, r.layer,
                       fmt::join(r.experts, ", "));
    if (!r.weights.empty()) out += fmt::format(", \"weights\": [{}]", fmt::join(r.weights, ", "));
    if (!r.predicted.empty()) {
      out += ", \"predicted\": {";
      bool first = true;
      for (const auto& [depth, ids] : r.predicted) {
        out += fmt::format("{}\"{}\": [{}]", first ? "" : ", ", depth, fmt::join(ids, ", "));
        first = false;
      }
      out += "}";
    }
    out += "}\n";
  }
  return write_file(path, out);
}

Status write_trace_binary(const std::string& path, const Trace& trace) {
  if (Status st = check_trace(trace, path); !st) return st;
  std::string out;
  out.append(kTraceBinaryMagic, 4);
  put<uint32_t>(out, kTraceBinaryVersion);
  put<uint64_t>(out, trace.records.size());
  for (size_t i = 0; i < trace.records.size(); ++i) {
    const auto& r = trace.records[i];
    uint32_t widest = r.layer;
    for (const uint32_t e : r.experts) widest = std::max(widest, e);
    for (const auto& [depth, ids] : r.predicted) {
      for (const uint32_t e : ids) widest = std::max(widest, e);
    }
    if (widest > 0xffffu) {
      return make_error(ERANGE, fmt::format("{}: record {}: layer or expert id {} does not fit the "
                                            "binary form's u16",
                                            path, i, widest));
    }
    put<uint32_t>(out, r.token);
    put<uint16_t>(out, static_cast<uint16_t>(r.layer));
    put<uint8_t>(out, static_cast<uint8_t>(r.experts.size()));
    put<uint8_t>(out, static_cast<uint8_t>(r.predicted.size()));
    for (const uint32_t e : r.experts) put<uint16_t>(out, static_cast<uint16_t>(e));
    for (size_t k = 0; k < r.experts.size(); ++k) {
      put<float>(out, r.weights.empty() ? std::numeric_limits<float>::quiet_NaN() : r.weights[k]);
    }
    for (const auto& [depth, ids] : r.predicted) {
      put<uint8_t>(out, static_cast<uint8_t>(depth));
      put<uint8_t>(out, static_cast<uint8_t>(ids.size()));
      for (const uint32_t e : ids) put<uint16_t>(out, static_cast<uint16_t>(e));
    }
  }
  return write_file(path, out);
}

Result<Trace> import_raw_log(const std::string& path) {
  std::ifstream in(path);
  if (!in) return make_error(ENOENT, fmt::format("{}: cannot open raw log", path));
  struct Raw {
    uint32_t pos = 0;
    uint64_t line = 0;
    TraceRecord r;
  };
  std::vector<Raw> raw;
  std::string line;
  uint64_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = fmt::format("{}:{}", path, line_no);
    nlohmann::json j;
    EXPERTD_TRY_ASSIGN(j, parse_object(line, where));
    Raw x;
    x.line = line_no;
    EXPERTD_TRY_ASSIGN(x.r.layer, get_u32(j, "layer", where));
    const char* pos_key = j.contains("token_idx") ? "token_idx" : "token_pos";
    if (!j.contains(pos_key)) {
      return make_error(EINVAL, fmt::format("{}: missing \"token_idx\" or \"token_pos\"", where));
    }
    EXPERTD_TRY_ASSIGN(x.pos, get_u32(j, pos_key, where));
    const auto ex = j.find("experts");
    const auto gp = j.find("gating_probs");
    if (ex == j.end()) return make_error(EINVAL, fmt::format("{}: missing \"experts\"", where));
    if (gp == j.end()) {
      return make_error(EINVAL, fmt::format("{}: missing \"gating_probs\"", where));
    }
    EXPERTD_TRY_ASSIGN(x.r.experts, get_ids(*ex, "experts", where));
    std::vector<double> probs;
    EXPERTD_TRY_ASSIGN(probs, get_numbers(*gp, "gating_probs", where));
    for (const double p : probs) {
      x.r.weights.push_back(static_cast<float>(std::round(p * 1e6) / 1e6));
    }
    if (Status st = check_record(x.r, nullptr, where); !st) return st.error();
    raw.push_back(std::move(x));
  }
  if (in.bad()) return make_error(EIO, fmt::format("{}: read failed", path));
  // Prefill ends with the last record that carries a real position; the records after it are
  // decode steps, numbered from the prompt length.
  size_t prefill_end = 0;
  uint32_t prompt = 0;
  for (size_t i = 0; i < raw.size(); ++i) {
    if (raw[i].pos > 0) prefill_end = i + 1;
  }
  for (size_t i = 0; i < prefill_end; ++i) {
    raw[i].r.token = raw[i].pos;
    prompt = std::max(prompt, raw[i].pos + 1);
  }
  uint64_t token = prompt;
  for (size_t i = prefill_end; i < raw.size(); ++i) {
    if (i > prefill_end && raw[i].r.layer <= raw[i - 1].r.layer) ++token;
    if (token > 0xffffffffu) return make_error(ERANGE, fmt::format("{}: too many tokens", path));
    raw[i].r.token = static_cast<uint32_t>(token);
  }
  std::stable_sort(raw.begin(), raw.end(), [](const Raw& a, const Raw& b) {
    return a.r.token != b.r.token ? a.r.token < b.r.token : a.r.layer < b.r.layer;
  });
  Trace t;
  t.records.reserve(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) {
    if (i > 0 && raw[i].r.token == raw[i - 1].r.token && raw[i].r.layer == raw[i - 1].r.layer) {
      return make_error(EINVAL,
                        fmt::format("{}:{}: token {} layer {} already routed at line {}", path,
                                    raw[i].line, raw[i].r.token, raw[i].r.layer, raw[i - 1].line));
    }
    t.records.push_back(std::move(raw[i].r));
  }
  const Status st = finish(t, path);
  if (!st) return st.error();
  return t;
}

}  // namespace expertd
