// Structured output (text/json_constraint.h): the schema compiler's refusals name the keyword's
// path; the recognizer takes exactly the JSON of its schema, byte by byte or in pieces; and a
// Generation sampling from random logits over real tokenizers' vocabularies (the committed
// fixtures) only ever writes JSON that parses and conforms, ending when the value closes.
#include "text/json_constraint.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "tests/engine/fixture.h"
#include "text/generation.h"
#include "text/stop.h"
#include "text/tokenizer.h"

namespace expertd::text {
namespace {

using json = nlohmann::json;

std::shared_ptr<const JsonSchema> compiled(const std::string& schema) {
  auto s = JsonSchema::compile(schema);
  EXPECT_TRUE(s.ok()) << (s.ok() ? "" : s.error().message);
  return s.ok() ? *s : JsonSchema::any_object();
}

std::string refusal(const std::string& schema) {
  auto s = JsonSchema::compile(schema);
  return s.ok() ? "(compiled)" : s.error().message;
}

// Whether `text` is accepted whole, fed in pieces of `piece` bytes, and complete at its end.
bool takes(const std::shared_ptr<const JsonSchema>& s, const std::string& text, size_t piece = 1) {
  JsonConstraint c(s);
  for (size_t i = 0; i < text.size(); i += piece) {
    if (!c.accept(text.substr(i, piece))) return false;
  }
  return c.complete();
}

const char* kPerson = R"({
  "type": "object",
  "properties": {
    "name": {"type": "string"},
    "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["a", "bb", "c"]}, "maxItems": 3},
    "ok": {"type": "boolean"},
    "score": {"type": ["number", "null"]},
    "pet": {"anyOf": [{"type": "object", "properties": {"kind": {"const": "cat"}},
                        "required": ["kind"]}, {"type": "null"}]}
  },
  "required": ["name", "age"],
  "additionalProperties": false
})";

TEST(JsonSchemaCompile, RefusesWhatItCannotEnforceNamingThePath) {
  EXPECT_EQ(
      refusal(R"({"type": "object", "properties": {"a": {"type": "string", "pattern": "x"}}})"),
      "/properties/a/pattern: not supported by constrained decoding (refused rather than "
      "not enforced)");
  EXPECT_EQ(refusal(R"({"type": "strnig"})"), "/type: unknown type 'strnig'");
  EXPECT_EQ(refusal(R"({"type": "object", "properties": {"a": {}}, "required": ["b"]})"),
            "/required: \"b\" is not one of the properties");
  EXPECT_NE(refusal(R"({"anyOf": [{"type": "string"}, {"enum": ["x"]}]})").find("begin with '\"'"),
            std::string::npos);
  EXPECT_EQ(refusal(R"({"type": "object", "properties": {"a": {}}, "additionalProperties": true})"),
            "/additionalProperties: only false (the properties listed, no others)");
  EXPECT_NE(refusal("{not json").find("the schema is not JSON"), std::string::npos);
  EXPECT_EQ(refusal(R"({"$ref": "#/$defs/nope"})"), "/$ref: #/$defs/nope is not in the schema");
  EXPECT_EQ(refusal(R"({"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"})"),
            "/$defs/n: nested deeper than 32 (a recursive $ref?)");
  std::string values;
  for (int i = 0; i < 65; ++i) values += (i ? "," : "") + std::to_string(i);
  EXPECT_EQ(refusal(R"({"enum": [)" + values + "]}"), "/enum: more than 64 values");
  EXPECT_EQ(refusal(R"({"type": "array", "minItems": 3, "maxItems": 2})"),
            "/minItems: is above maxItems");
}

TEST(JsonConstraint, TakesTheSchemasJsonInAnyPiecesAndNothingElse) {
  const auto s = compiled(kPerson);
  const std::string good[] = {
      R"({"name": "Ann", "age": 31})",
      R"({"age":-7,"name":"\u00e9t\u00E9 \"q\" caf)"
      "\xc3\xa9"
      R"(","tags":["bb","a"],"ok":false})",
      "{\n  \"score\": 1.5e-3,\n  \"name\": \"x\",\n  \"age\": 0,\n  \"pet\": {\"kind\": "
      "\"cat\"}\n}",
      R"({"name": "", "age": 12, "score": null, "pet": null, "tags": []})",
  };
  for (const auto& g : good) {
    for (const size_t piece : {size_t{1}, size_t{3}, g.size()}) {
      EXPECT_TRUE(takes(s, g, piece)) << g << " in pieces of " << piece;
    }
  }
  const std::string bad[] = {
      R"({"name": "Ann"})",                          // age is required
      R"({"name": "Ann", "age": 31, "x": 1})",       // no other properties
      R"({"name": "Ann", "age": 3.5})",              // an integer
      R"({"name": "Ann", "age": 01})",               // no leading zero
      R"({"name": "Ann", "age": 1,})",               // no trailing comma
      R"({"name": "Ann", "name": "Bo", "age": 1})",  // a key once
      R"({"name": "A)"
      "\n"
      R"(", "age": 1})",                              // a raw control character in a string
      R"({"name": "Ann", "age": 1, "tags": ["d"]})",  // not in the enum
      R"({"name": "Ann", "age": 1, "tags": ["a","a","a","a"]})",  // maxItems
      R"({"name": "Ann", "age": 1, "ok": tru})",
      R"({"name": "Ann", "age": 1, "pet": {"kind": "dog"}})",
      R"({"name": "Ann", "age": 1} )",                    // nothing after the value
      R"({"name": "\x", "age": 1})",                      // a bad escape
      R"({"name": "Ann",                    "age": 1})",  // a whitespace run over 16
      R"(["name"])",
      "{\"name\": \"\xe0\x80\x80\", \"age\": 1}",  // an overlong UTF-8 form
      "{\"name\": \"\xed\xa0\x80\", \"age\": 1}",  // a UTF-8 surrogate
      R"({"name": "\ud83d", "age": 1})",           // a surrogate escape
  };
  for (const auto& b : bad) EXPECT_FALSE(takes(s, b)) << b;
  // A prefix is allowed but not complete; an end may come only after the value.
  JsonConstraint c(s);
  EXPECT_TRUE(c.accept(R"({"name": "Ann", "age": 3)"));
  EXPECT_FALSE(c.complete());
  EXPECT_TRUE(c.allows("1}"));
  EXPECT_FALSE(c.allows("1]"));
  EXPECT_TRUE(c.accept("}"));
  EXPECT_TRUE(c.complete() && c.closed());
  EXPECT_FALSE(c.allows(" "));
  // json_object: any object, any keys and values.
  EXPECT_TRUE(takes(JsonSchema::any_object(), R"({"a": [1, {"b": null}, "c", -0.5e+2, true]})"));
  EXPECT_FALSE(takes(JsonSchema::any_object(), "[1]"));
  // A number at the root is complete without a closing byte.
  EXPECT_TRUE(takes(compiled(R"({"type": "number"})"), "-12.5"));
  EXPECT_FALSE(takes(compiled(R"({"type": "number"})"), "-"));
}

// A value of `s`'s JSON against the schema (as the test states it, independently of the
// recognizer): the checks the recognizer must have enforced.
void conforms(const json& v, const json& s, const std::string& path) {
  if (s.contains("anyOf")) {
    int matched = 0;
    for (const auto& alt : s["anyOf"]) {
      if ((alt.value("type", "") == "null") == v.is_null()) {
        conforms(v, alt, path);
        ++matched;
      }
    }
    ASSERT_EQ(matched, 1) << path;
    return;
  }
  if (s.contains("const")) {
    ASSERT_EQ(v, s["const"]) << path;
    return;
  }
  if (s.contains("enum")) {
    ASSERT_NE(std::find(s["enum"].begin(), s["enum"].end(), v), s["enum"].end()) << path;
    return;
  }
  const json type = s.value("type", json());
  if (type.is_array()) {
    bool ok = false;
    for (const auto& t : type) {
      ok = ok || (t == "null" && v.is_null()) || (t == "number" && v.is_number());
    }
    ASSERT_TRUE(ok) << path << ": " << v.dump();
    return;
  }
  if (type == "object") {
    ASSERT_TRUE(v.is_object()) << path;
    if (!s.contains("properties")) return;
    for (const auto& [k, sub] : v.items()) {
      ASSERT_TRUE(s["properties"].contains(k)) << path << ": extra " << k;
      conforms(sub, s["properties"][k], path + "/" + k);
    }
    for (const auto& r : s.value("required", json::array())) {
      ASSERT_TRUE(v.contains(r.get<std::string>())) << path << ": missing " << r;
    }
  } else if (type == "array") {
    ASSERT_TRUE(v.is_array()) << path;
    ASSERT_LE(v.size(), s.value("maxItems", 1000u)) << path;
    for (const auto& item : v) conforms(item, s["items"], path + "/[]");
  } else if (type == "string") {
    ASSERT_TRUE(v.is_string()) << path;
  } else if (type == "integer") {
    ASSERT_TRUE(v.is_number_integer()) << path;
  } else if (type == "boolean") {
    ASSERT_TRUE(v.is_boolean()) << path;
  }
}

TEST(JsonConstraint, RandomLogitsOverRealVocabulariesWriteOnlyConformingJson) {
  const json schema = json::parse(kPerson);
  const auto s = compiled(kPerson);
  int complete = 0, runs = 0;
  for (const char* name : {"qwen2", "llama3", "gpt-oss", "mixtral"}) {
    auto f =
        GgufFile::open(engine::test::fixture_path(std::string("tokenizers/") + name + ".gguf"));
    ASSERT_TRUE(f.ok()) << name;
    auto tok = Tokenizer::from_gguf(*f);
    ASSERT_TRUE(tok.ok()) << name << ": " << tok.error().message;
    const uint32_t n = static_cast<uint32_t>(tok->size());
    for (uint32_t seed = 1; seed <= 6; ++seed) {
      GenerationOptions o;
      o.sampling.temperature = 1.0;
      o.sampling.seed = seed;
      o.max_tokens = 3000;
      o.json_schema = seed % 2 ? s : JsonSchema::any_object();
      o.end_strings = {"<|im_end|>"};
      auto g = Generation::create(o, n, [&](uint32_t id) { return tok->decode(id); },
                                  EndTokens::from_gguf(*f), {});
      ASSERT_TRUE(g.ok()) << g.error().message;
      std::mt19937 rng(seed * 7919 + n);
      std::normal_distribution<float> dist(0.0f, 2.0f);
      std::vector<float> logits(n);
      std::string text;
      for (;;) {
        for (auto& x : logits) x = dist(rng);
        const auto next = (*g)->advance(logits);
        text += (*g)->raw_delta();
        if (!next) break;
      }
      (*g)->finish();
      text += (*g)->raw_delta();
      ++runs;
      if (std::string_view((*g)->stop_reason()) == "max_tokens") continue;
      ++complete;
      json v;
      ASSERT_NO_THROW(v = json::parse(text)) << name << " seed " << seed << ": " << text;
      if (seed % 2) {
        conforms(v, schema, std::string(name) + "/" + std::to_string(seed));
      } else {
        ASSERT_TRUE(v.is_object()) << text;
      }
    }
  }
  // Random logits mostly close the value within the limit: the test cannot pass on none.
  EXPECT_GE(complete, runs * 2 / 3) << complete << " of " << runs;
}

}  // namespace
}  // namespace expertd::text
