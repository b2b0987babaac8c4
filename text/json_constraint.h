// Structured output (issue 25: response_format json_object and json_schema): a JSON Schema subset
// compiled to a tree, and a byte-level recognizer over it that says which bytes may come next.
// Generation masks every token whose bytes the recognizer refuses before it samples, so the answer
// is JSON of the schema by construction (constrained sampling), and ends once the value closes.
//
// Supported: "type" object (properties, required, additionalProperties false or absent),
// array (items, minItems, maxItems), string, number, integer, boolean, null, a list of types;
// enum and const (any JSON values); anyOf/oneOf whose alternatives begin differently (an object
// and a null, a string and a number); $ref to #/$defs or #/definitions (not recursive);
// descriptive keywords (title, description, default, examples, $schema, $id, format, strict) are
// ignored. Anything else (pattern, minLength, minimum, allOf, recursive $ref, ...) is refused with
// its path, rather than silently not enforced. Object keys may come in any order; each at most
// once; the object closes only once the required ones are there. With no "properties" an object
// takes any keys and values (json_object). Whitespace between tokens is limited to runs of 16.
//
// No library does this here: llama.cpp's GBNF grammars are its own code (and cannot be copied),
// xgrammar and llguidance are not Debian packages (Python/Rust builds). docs/SERVE.md says more.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "expertd/result.h"

namespace expertd::text {

struct JsonSchema {
  enum class Kind { Any, Object, Array, String, Number, Integer, Boolean, Null, Literal, Union };
  Kind kind = Kind::Any;
  struct Property {
    std::string name;
    std::shared_ptr<const JsonSchema> schema;
    bool required = false;
  };
  std::vector<Property> properties;         // Object
  bool free_object = false;                 // Object without "properties": any keys, any values
  std::shared_ptr<const JsonSchema> items;  // Array (null: any)
  uint32_t min_items = 0;
  uint32_t max_items = UINT32_MAX;
  std::vector<std::string> literals;  // Literal: the JSON texts allowed (enum, const)
  std::vector<std::shared_ptr<const JsonSchema>> alternatives;  // Union

  // A JSON Schema (as JSON text) compiled; the error names the keyword and its JSON pointer.
  static Result<std::shared_ptr<const JsonSchema>> compile(std::string_view schema_json);
  // response_format json_object: any object.
  static std::shared_ptr<const JsonSchema> any_object();
};

class JsonConstraint {
 public:
  explicit JsonConstraint(std::shared_ptr<const JsonSchema> root);
  ~JsonConstraint();
  JsonConstraint(const JsonConstraint&);
  JsonConstraint& operator=(const JsonConstraint&);

  // Whether `bytes` may follow what was accepted (the state is unchanged).
  bool allows(std::string_view bytes) const;
  // Accepts `bytes`; false (and the state unchanged) if they may not follow.
  bool accept(std::string_view bytes);
  // Whether the text so far is one whole value (an end token may follow).
  bool complete() const;
  // Whether the value is closed and nothing may follow (an object's or array's last bracket).
  bool closed() const { return done_; }

  struct Frame;  // the recognizer's stack (json_constraint.cc)

 private:
  std::shared_ptr<const JsonSchema> root_;
  std::vector<Frame> stack_;
  bool done_ = false;
};

}  // namespace expertd::text
