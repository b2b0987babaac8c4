#include "text/json_constraint.h"

#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>

namespace expertd::text {
namespace {

using json = nlohmann::json;
using Schema = std::shared_ptr<const JsonSchema>;

constexpr uint32_t kMaxDepth = 64;       // nesting of values
constexpr uint32_t kMaxWhitespace = 16;  // a run of whitespace between tokens
constexpr uint32_t kMaxNumber = 40;      // characters of one number
constexpr size_t kMaxProperties = 64;    // of one object schema (a bit mask tracks them)

Error schema_error(const std::string& path, const std::string& what) {
  return Error{EINVAL, fmt::format("{}: {}", path.empty() ? "/" : path, what)};
}

bool is_digit(unsigned char c) { return c >= '0' && c <= '9'; }

// Whether a value of `s` may begin with byte `c` (a union picks its alternative by it).
bool begins(const JsonSchema& s, unsigned char c) {
  switch (s.kind) {
    case JsonSchema::Kind::Any:
      return c == '{' || c == '[' || c == '"' || c == '-' || is_digit(c) || c == 't' || c == 'f' ||
             c == 'n';
    case JsonSchema::Kind::Object:
      return c == '{';
    case JsonSchema::Kind::Array:
      return c == '[';
    case JsonSchema::Kind::String:
      return c == '"';
    case JsonSchema::Kind::Number:
    case JsonSchema::Kind::Integer:
      return c == '-' || is_digit(c);
    case JsonSchema::Kind::Boolean:
      return c == 't' || c == 'f';
    case JsonSchema::Kind::Null:
      return c == 'n';
    case JsonSchema::Kind::Literal:
      return std::any_of(s.literals.begin(), s.literals.end(),
                         [&](const std::string& l) { return !l.empty() && l[0] == c; });
    case JsonSchema::Kind::Union:
      return std::any_of(s.alternatives.begin(), s.alternatives.end(),
                         [&](const auto& a) { return begins(*a, c); });
  }
  return false;
}

class Compiler {
 public:
  explicit Compiler(const json& root) : root_(root) {}

  Result<Schema> compile(const json& s, const std::string& path, uint32_t depth) {
    if (depth > 32) return schema_error(path, "nested deeper than 32 (a recursive $ref?)");
    if (s.is_boolean()) {
      if (!s.get<bool>()) return schema_error(path, "the schema false accepts nothing");
      return Schema(std::make_shared<JsonSchema>());  // true: anything
    }
    if (!s.is_object()) return schema_error(path, "a schema must be an object");
    static const char* kIgnored[] = {"title",   "description", "default", "examples",
                                     "$schema", "$id",         "format",  "strict",
                                     "$defs",   "definitions", "$comment"};
    static const char* kKnown[] = {"type",  "properties", "required", "additionalProperties",
                                   "items", "minItems",   "maxItems", "enum",
                                   "const", "anyOf",      "oneOf",    "$ref"};
    for (const auto& [key, _] : s.items()) {
      const bool known = std::any_of(std::begin(kKnown), std::end(kKnown),
                                     [&](const char* k) { return key == k; }) ||
                         std::any_of(std::begin(kIgnored), std::end(kIgnored),
                                     [&](const char* k) { return key == k; });
      if (!known) {
        return schema_error(path + "/" + key,
                            "not supported by constrained decoding (refused rather than not "
                            "enforced)");
      }
    }
    if (s.contains("$ref")) {
      if (!s["$ref"].is_string()) return schema_error(path + "/$ref", "must be a string");
      const std::string ref = s["$ref"].get<std::string>();
      if (!ref.starts_with("#/")) {
        return schema_error(path + "/$ref", "only references inside the schema (#/...)");
      }
      const json* target = &root_;
      try {
        target = &root_.at(json::json_pointer(ref.substr(1)));
      } catch (const json::exception&) {
        return schema_error(path + "/$ref", fmt::format("{} is not in the schema", ref));
      }
      return compile(*target, ref.substr(1), depth + 1);
    }
    auto out = std::make_shared<JsonSchema>();
    if (s.contains("const") || s.contains("enum")) {
      out->kind = JsonSchema::Kind::Literal;
      if (s.contains("const")) out->literals.push_back(s["const"].dump());
      if (s.contains("enum")) {
        if (!s["enum"].is_array() || s["enum"].empty()) {
          return schema_error(path + "/enum", "must be a non-empty array");
        }
        for (const auto& v : s["enum"]) out->literals.push_back(v.dump());
      }
      if (out->literals.size() > 64) {
        return schema_error(path + "/enum", "more than 64 values");
      }
      return Schema(out);
    }
    for (const char* key : {"anyOf", "oneOf"}) {
      if (!s.contains(key)) continue;
      if (!s[key].is_array() || s[key].empty()) {
        return schema_error(path + "/" + key, "must be a non-empty array");
      }
      out->kind = JsonSchema::Kind::Union;
      for (size_t i = 0; i < s[key].size(); ++i) {
        EXPERTD_TRY_ASSIGN(Schema alt,
                           compile(s[key][i], fmt::format("{}/{}/{}", path, key, i), depth + 1));
        out->alternatives.push_back(std::move(alt));
      }
      if (auto st = check_union(*out, path + "/" + key); !st) return st.take_error();
      return Schema(out);
    }
    if (!s.contains("type")) {
      if (s.contains("properties")) return object(s, path, depth, out);
      return Schema(out);  // any value
    }
    const json& type = s["type"];
    if (type.is_array()) {
      // A list of types: a union of this schema with each type.
      out->kind = JsonSchema::Kind::Union;
      for (size_t i = 0; i < type.size(); ++i) {
        json one = s;
        one["type"] = type[i];
        EXPERTD_TRY_ASSIGN(Schema alt, compile(one, fmt::format("{}/type/{}", path, i), depth + 1));
        out->alternatives.push_back(std::move(alt));
      }
      if (out->alternatives.empty()) return schema_error(path + "/type", "an empty list");
      if (auto st = check_union(*out, path + "/type"); !st) return st.take_error();
      return Schema(out);
    }
    if (!type.is_string()) return schema_error(path + "/type", "must be a string or a list");
    const std::string t = type.get<std::string>();
    if (t == "object") return object(s, path, depth, out);
    if (t == "array") {
      out->kind = JsonSchema::Kind::Array;
      if (s.contains("items")) {
        EXPERTD_TRY_ASSIGN(out->items, compile(s["items"], path + "/items", depth + 1));
      }
      for (auto [key, field] :
           {std::pair{"minItems", &out->min_items}, std::pair{"maxItems", &out->max_items}}) {
        if (!s.contains(key)) continue;
        if (!s[key].is_number_unsigned() || s[key].get<uint64_t>() > UINT32_MAX) {
          return schema_error(path + "/" + key, "must be a non-negative integer");
        }
        *field = s[key].get<uint32_t>();
      }
      if (out->min_items > out->max_items) {
        return schema_error(path + "/minItems", "is above maxItems");
      }
      return Schema(out);
    }
    static const std::pair<const char*, JsonSchema::Kind> kScalars[] = {
        {"string", JsonSchema::Kind::String},
        {"number", JsonSchema::Kind::Number},
        {"integer", JsonSchema::Kind::Integer},
        {"boolean", JsonSchema::Kind::Boolean},
        {"null", JsonSchema::Kind::Null}};
    for (const auto& [name, kind] : kScalars) {
      if (t == name) {
        out->kind = kind;
        return Schema(out);
      }
    }
    return schema_error(path + "/type", fmt::format("unknown type '{}'", t));
  }

 private:
  Result<Schema> object(const json& s, const std::string& path, uint32_t depth,
                        std::shared_ptr<JsonSchema> out) {
    out->kind = JsonSchema::Kind::Object;
    if (!s.contains("properties")) {
      out->free_object = true;
      return Schema(out);
    }
    const json& props = s["properties"];
    if (!props.is_object()) return schema_error(path + "/properties", "must be an object");
    if (props.size() > kMaxProperties) {
      return schema_error(path + "/properties", fmt::format("more than {}", kMaxProperties));
    }
    if (s.contains("additionalProperties") && s["additionalProperties"] != false) {
      return schema_error(path + "/additionalProperties",
                          "only false (the properties listed, no others)");
    }
    for (const auto& [name, sub] : props.items()) {
      for (const char c : name) {
        if (c == '"' || c == '\\' || static_cast<unsigned char>(c) < 0x20) {
          return schema_error(path + "/properties/" + name,
                              "a property name needing escapes in JSON");
        }
      }
      EXPERTD_TRY_ASSIGN(Schema ps, compile(sub, path + "/properties/" + name, depth + 1));
      out->properties.push_back({name, std::move(ps), false});
    }
    if (s.contains("required")) {
      if (!s["required"].is_array()) return schema_error(path + "/required", "must be an array");
      for (const auto& r : s["required"]) {
        auto it = std::find_if(out->properties.begin(), out->properties.end(),
                               [&](const auto& p) { return r.is_string() && p.name == r; });
        if (it == out->properties.end()) {
          return schema_error(path + "/required",
                              fmt::format("{} is not one of the properties", r.dump()));
        }
        it->required = true;
      }
    }
    return Schema(out);
  }

  // The recognizer picks a union's alternative by its first byte: they must begin differently.
  static Status check_union(const JsonSchema& u, const std::string& path) {
    for (unsigned c = 0; c < 256; ++c) {
      const auto starting = std::count_if(u.alternatives.begin(), u.alternatives.end(),
                                          [&](const auto& a) { return begins(*a, c); });
      if (starting > 1) {
        return schema_error(path, fmt::format("two alternatives may both begin with '{}': "
                                              "constrained decoding picks one by the first byte",
                                              static_cast<char>(c)));
      }
    }
    return Ok{};
  }

  const json& root_;
};

bool is_ws(unsigned char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }
bool is_hex(unsigned char c) {
  return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

const std::vector<std::string>& booleans() {
  static const std::vector<std::string> v = {"true", "false"};
  return v;
}
const std::vector<std::string>& null_literal() {
  static const std::vector<std::string> v = {"null"};
  return v;
}
const std::vector<std::string>& any_literals() {
  static const std::vector<std::string> v = {"true", "false", "null"};
  return v;
}

}  // namespace

Result<std::shared_ptr<const JsonSchema>> JsonSchema::compile(std::string_view schema_json) {
  json root;
  try {
    root = json::parse(schema_json);
  } catch (const json::exception& e) {
    return Error{EINVAL, fmt::format("the schema is not JSON: {}", e.what())};
  }
  Compiler c(root);
  return c.compile(root, "", 0);
}

std::shared_ptr<const JsonSchema> JsonSchema::any_object() {
  auto s = std::make_shared<JsonSchema>();
  s->kind = Kind::Object;
  s->free_object = true;
  return s;
}

// --- the recognizer ---
struct JsonConstraint::Frame {
  enum class Kind : uint8_t { Value, String, Number, Literal, Object, Array };
  // Object and Array states.
  enum : uint8_t { kOpen, kKey, kColon, kValue, kNext, kComma };
  Kind kind = Kind::Value;
  uint8_t state = kOpen;
  uint8_t ws = 0;        // the current whitespace run
  bool key = false;      // String: an object's key
  bool integer = false;  // Number: no fraction or exponent
  uint8_t esc = 0;       // String: 1 after a backslash, 2..5 hex digits of \uXXXX to come
  uint8_t utf8 = 0;      // String: continuation bytes to come
  uint8_t lo = 0x80;     // String: the next continuation byte's range (strict UTF-8)
  uint8_t hi = 0xBF;
  bool surrogate = false;  // String: a \u escape began with D (D800-DFFF are refused)
  uint8_t num = 0;         // Number: its state (below)
  uint32_t count = 0;      // Array: items; Number: characters; Literal: bytes matched
  uint32_t prop = 0;       // Object: the property whose value is read
  uint64_t seen = 0;       // Object: properties given
  const JsonSchema* schema = nullptr;
  const std::vector<std::string>* literals = nullptr;  // Literal
  uint64_t alive = 0;  // Literal: the candidates still matching (bit i: literals[i]; <= 64)
  std::string text;    // String (a key of a schema'd object): the bytes so far
};

namespace {

using Frame = JsonConstraint::Frame;
using FK = Frame::Kind;

// Number states.
enum : uint8_t { kSign, kZero, kInt, kDot, kFrac, kE, kESign, kExp, kStart };

bool number_final(uint8_t s) { return s == kZero || s == kInt || s == kFrac || s == kExp; }

bool literal_final(const Frame& f) {
  for (size_t i = 0; i < f.literals->size(); ++i) {
    if ((f.alive >> i & 1) && (*f.literals)[i].size() == f.count) return true;
  }
  return false;
}

// Whether a Number or Literal frame may end here (the next byte then belongs to its parent).
bool finishable(const Frame& f) {
  if (f.kind == FK::Number) return number_final(f.num);
  if (f.kind == FK::Literal) return literal_final(f);
  return false;
}

class Machine {
 public:
  Machine(std::vector<Frame>& st, bool& done) : st_(st), done_(done) {}

  bool feed(unsigned char c) {
    for (;;) {
      if (st_.empty()) return false;  // the value is closed: nothing may follow
      Frame& f = st_.back();
      switch (f.kind) {
        case FK::Value:
          if (is_ws(c)) return space(f);
          return start(c);
        case FK::String:
          return string(f, c);
        case FK::Number: {
          const int r = number(f, c);
          if (r >= 0) return r == 1;
          st_.pop_back();  // the number ended before c
          value_done();
          continue;
        }
        case FK::Literal: {
          const int r = literal(f, c);
          if (r >= 0) return r == 1;
          st_.pop_back();
          value_done();
          continue;
        }
        case FK::Object:
          return object(f, c);
        case FK::Array: {
          const int r = array(f, c);
          if (r >= 0) return r == 1;
          continue;  // a value was pushed: c starts it
        }
      }
      return false;
    }
  }

 private:
  static bool space(Frame& f) {
    if (f.ws >= kMaxWhitespace) return false;
    ++f.ws;
    return true;
  }

  // The top Value frame becomes the value that c begins.
  bool start(unsigned char c) {
    const JsonSchema* s = st_.back().schema;
    if (st_.size() > kMaxDepth) return false;
    JsonSchema::Kind kind = s == nullptr ? JsonSchema::Kind::Any : s->kind;
    if (kind == JsonSchema::Kind::Union) {
      for (const auto& a : s->alternatives) {
        if (begins(*a, c)) {
          s = a.get();
          kind = s->kind;
          break;
        }
      }
      if (kind == JsonSchema::Kind::Union) return false;
    }
    Frame v;
    v.schema = s;
    switch (kind) {
      case JsonSchema::Kind::Any:
        if (c == '{' || c == '[') {
          v.kind = c == '{' ? FK::Object : FK::Array;
          v.schema = nullptr;
          break;
        }
        if (c == '"') {
          v.kind = FK::String;
          break;
        }
        if (c == '-' || is_digit(c)) return number_start(v, c, false);
        return literal_start(v, &any_literals(), c);
      case JsonSchema::Kind::Object:
        if (c != '{') return false;
        v.kind = FK::Object;
        break;
      case JsonSchema::Kind::Array:
        if (c != '[') return false;
        v.kind = FK::Array;
        break;
      case JsonSchema::Kind::String:
        if (c != '"') return false;
        v.kind = FK::String;
        break;
      case JsonSchema::Kind::Number:
      case JsonSchema::Kind::Integer:
        return number_start(v, c, kind == JsonSchema::Kind::Integer);
      case JsonSchema::Kind::Boolean:
        return literal_start(v, &booleans(), c);
      case JsonSchema::Kind::Null:
        return literal_start(v, &null_literal(), c);
      case JsonSchema::Kind::Literal:
        return literal_start(v, &s->literals, c);
      case JsonSchema::Kind::Union:
        return false;
    }
    st_.back() = std::move(v);
    return true;
  }

  bool number_start(Frame& v, unsigned char c, bool integer) {
    v.kind = FK::Number;
    v.integer = integer;
    v.num = kStart;
    st_.back() = std::move(v);
    return number(st_.back(), c) == 1;
  }

  bool literal_start(Frame& v, const std::vector<std::string>* literals, unsigned char c) {
    v.kind = FK::Literal;
    v.literals = literals;
    v.alive = literals->size() >= 64 ? ~uint64_t{0} : (uint64_t{1} << literals->size()) - 1;
    st_.back() = std::move(v);
    return literal(st_.back(), c) == 1;
  }

  // 1: c taken; 0: refused; -1: the number ended before c.
  static int number(Frame& f, unsigned char c) {
    if (f.count >= kMaxNumber) return number_final(f.num) ? -1 : 0;
    uint8_t next = 255;
    switch (f.num) {
      case kStart:
        next = c == '-' ? kSign : c == '0' ? kZero : is_digit(c) ? kInt : 255;
        break;
      case kSign:
        next = c == '0' ? kZero : is_digit(c) ? kInt : 255;
        break;
      case kZero:
        next = (c == '.' && !f.integer) ? kDot : ((c == 'e' || c == 'E') && !f.integer) ? kE : 255;
        break;
      case kInt:
        next = is_digit(c)                              ? kInt
               : (c == '.' && !f.integer)               ? kDot
               : ((c == 'e' || c == 'E') && !f.integer) ? kE
                                                        : 255;
        break;
      case kDot:
        next = is_digit(c) ? kFrac : 255;
        break;
      case kFrac:
        next = is_digit(c) ? kFrac : (c == 'e' || c == 'E') ? kE : 255;
        break;
      case kE:
        next = (c == '+' || c == '-') ? kESign : is_digit(c) ? kExp : 255;
        break;
      case kESign:
      case kExp:
        next = is_digit(c) ? kExp : 255;
        break;
    }
    if (next == 255) return number_final(f.num) ? -1 : 0;
    f.num = next;
    ++f.count;
    return 1;
  }

  // 1: c taken; 0: refused; -1: the literal ended before c.
  static int literal(Frame& f, unsigned char c) {
    uint64_t alive = 0;
    for (size_t i = 0; i < f.literals->size() && i < 64; ++i) {
      const std::string& l = (*f.literals)[i];
      if ((f.alive >> i & 1) && f.count < l.size() && static_cast<unsigned char>(l[f.count]) == c) {
        alive |= uint64_t{1} << i;
      }
    }
    if (alive == 0) return literal_final(f) ? -1 : 0;
    f.alive = alive;
    ++f.count;
    return 1;
  }

  bool string(Frame& f, unsigned char c) {
    if (f.utf8 > 0) {
      if (c < f.lo || c > f.hi) return false;
      --f.utf8;
      f.lo = 0x80;
      f.hi = 0xBF;
      return key_byte(f, c);
    }
    if (f.esc == 1) {
      if (c == 'u') {
        f.esc = 2;
        return true;
      }
      if (std::string_view("\"\\/bfnrt").find(static_cast<char>(c)) == std::string_view::npos) {
        return false;
      }
      f.esc = 0;
      return true;
    }
    if (f.esc >= 2) {
      if (!is_hex(c)) return false;
      // A lone surrogate escape is not valid JSON text for strict parsers: refuse \uD800-\uDFFF
      // (a character beyond the BMP is written as its UTF-8 bytes instead).
      if (f.esc == 2) f.surrogate = c == 'd' || c == 'D';
      if (f.esc == 3 && f.surrogate && (c >= '8' || !is_digit(c))) return false;
      f.esc = f.esc == 5 ? 0 : f.esc + 1;
      return true;
    }
    if (c == '"') {
      if (f.key) return key_end(f);
      st_.pop_back();
      value_done();
      return true;
    }
    if (c == '\\') {
      if (f.key && schema_key(f)) return false;  // property names need no escapes
      f.esc = 1;
      return true;
    }
    if (c < 0x20) return false;
    if (c >= 0x80) {
      // Well-formed UTF-8 (Unicode's table 3-7): no overlong forms, surrogates or values past
      // U+10FFFF.
      f.lo = 0x80;
      f.hi = 0xBF;
      if (c >= 0xC2 && c <= 0xDF) {
        f.utf8 = 1;
      } else if (c >= 0xE0 && c <= 0xEF) {
        f.utf8 = 2;
        if (c == 0xE0) f.lo = 0xA0;
        if (c == 0xED) f.hi = 0x9F;
      } else if (c >= 0xF0 && c <= 0xF4) {
        f.utf8 = 3;
        if (c == 0xF0) f.lo = 0x90;
        if (c == 0xF4) f.hi = 0x8F;
      } else {
        return false;
      }
    }
    return key_byte(f, c);
  }

  // The object frame below a key's String frame, when its schema lists properties.
  const JsonSchema* schema_key(const Frame& f) const {
    if (!f.key || st_.size() < 2) return nullptr;
    const Frame& obj = st_[st_.size() - 2];
    return obj.schema != nullptr && !obj.schema->free_object ? obj.schema : nullptr;
  }

  bool key_byte(Frame& f, unsigned char c) {
    const JsonSchema* s = schema_key(f);
    if (s == nullptr) return true;
    f.text.push_back(static_cast<char>(c));
    const Frame& obj = st_[st_.size() - 2];
    for (size_t i = 0; i < s->properties.size(); ++i) {
      if (!(obj.seen >> i & 1) && s->properties[i].name.starts_with(f.text)) return true;
    }
    return false;
  }

  bool key_end(Frame& f) {
    const JsonSchema* s = schema_key(f);
    uint32_t prop = 0;
    if (s != nullptr) {
      const Frame& obj = st_[st_.size() - 2];
      bool found = false;
      for (size_t i = 0; i < s->properties.size(); ++i) {
        if (!(obj.seen >> i & 1) && s->properties[i].name == f.text) {
          prop = static_cast<uint32_t>(i);
          found = true;
          break;
        }
      }
      if (!found) return false;
    }
    st_.pop_back();
    Frame& obj = st_.back();
    obj.prop = prop;
    obj.state = Frame::kColon;
    obj.ws = 0;
    return true;
  }

  // An object's or array's value (or the root) is complete.
  void value_done() {
    if (st_.empty()) {
      done_ = true;
      return;
    }
    Frame& p = st_.back();
    if (p.kind == FK::Object) {
      if (p.schema != nullptr && !p.schema->free_object) p.seen |= uint64_t{1} << p.prop;
      p.state = Frame::kNext;
    } else if (p.kind == FK::Array) {
      ++p.count;
      p.state = Frame::kNext;
    }
    p.ws = 0;
  }

  bool properties_left(const Frame& f) const {
    if (f.schema == nullptr || f.schema->free_object) return true;
    for (size_t i = 0; i < f.schema->properties.size(); ++i) {
      if (!(f.seen >> i & 1)) return true;
    }
    return false;
  }
  bool required_given(const Frame& f) const {
    if (f.schema == nullptr || f.schema->free_object) return true;
    for (size_t i = 0; i < f.schema->properties.size(); ++i) {
      if (f.schema->properties[i].required && !(f.seen >> i & 1)) return false;
    }
    return true;
  }

  bool object(Frame& f, unsigned char c) {
    if (is_ws(c) && f.state != Frame::kKey && f.state != Frame::kValue) return space(f);
    switch (f.state) {
      case Frame::kOpen:
        if (c == '}' && required_given(f)) return close();
        [[fallthrough]];
      case Frame::kComma:
        if (c != '"' || !properties_left(f)) return false;
        f.state = Frame::kKey;
        {
          Frame k;
          k.kind = FK::String;
          k.key = true;
          st_.push_back(std::move(k));
        }
        return true;
      case Frame::kColon:
        if (c != ':') return false;
        f.state = Frame::kValue;
        f.ws = 0;
        {
          Frame v;
          v.kind = FK::Value;
          v.schema = f.schema == nullptr || f.schema->free_object
                         ? nullptr
                         : f.schema->properties[f.prop].schema.get();
          st_.push_back(std::move(v));
        }
        return true;
      case Frame::kNext:
        if (c == ',' && properties_left(f)) {
          f.state = Frame::kComma;
          f.ws = 0;
          return true;
        }
        if (c == '}' && required_given(f)) return close();
        return false;
      default:
        return false;
    }
  }

  // 1: c taken; 0: refused; -1: a value frame was pushed for c.
  int array(Frame& f, unsigned char c) {
    const uint32_t max = f.schema == nullptr ? UINT32_MAX : f.schema->max_items;
    const uint32_t min = f.schema == nullptr ? 0 : f.schema->min_items;
    if (is_ws(c)) return space(f) ? 1 : 0;
    switch (f.state) {
      case Frame::kOpen:
        if (c == ']') return min == 0 ? (close() ? 1 : 0) : 0;
        if (max == 0) return 0;
        [[fallthrough]];
      case Frame::kComma: {
        f.state = Frame::kValue;
        Frame v;
        v.kind = FK::Value;
        v.schema = f.schema == nullptr ? nullptr : f.schema->items.get();
        st_.push_back(std::move(v));
        return -1;
      }
      case Frame::kNext:
        if (c == ',' && f.count < max) {
          f.state = Frame::kComma;
          f.ws = 0;
          return 1;
        }
        if (c == ']' && f.count >= min) return close() ? 1 : 0;
        return 0;
      default:
        return 0;
    }
  }

  bool close() {
    st_.pop_back();
    value_done();
    return true;
  }

  std::vector<Frame>& st_;
  bool& done_;
};

}  // namespace

JsonConstraint::JsonConstraint(std::shared_ptr<const JsonSchema> root) : root_(std::move(root)) {
  Frame v;
  v.kind = FK::Value;
  v.schema = root_.get();
  stack_.push_back(std::move(v));
}
JsonConstraint::~JsonConstraint() = default;
JsonConstraint::JsonConstraint(const JsonConstraint&) = default;
JsonConstraint& JsonConstraint::operator=(const JsonConstraint&) = default;

bool JsonConstraint::allows(std::string_view bytes) const {
  std::vector<Frame> st = stack_;
  bool done = done_;
  Machine m(st, done);
  for (const char c : bytes) {
    if (!m.feed(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

bool JsonConstraint::accept(std::string_view bytes) {
  std::vector<Frame> st = stack_;
  bool done = done_;
  Machine m(st, done);
  for (const char c : bytes) {
    if (!m.feed(static_cast<unsigned char>(c))) return false;
  }
  stack_ = std::move(st);
  done_ = done;
  return true;
}

bool JsonConstraint::complete() const {
  if (done_) return true;
  // A number or literal at the root ends with the text.
  return stack_.size() == 1 && finishable(stack_.back());
}

}  // namespace expertd::text
