#include "api.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

namespace expertd::serve {

using json = nlohmann::json;

namespace {

ApiError bad(std::string param, std::string message) {
  ApiError e;
  e.param = std::move(param);
  e.message = std::move(message);
  return e;
}

// How a JSON value is spelled in messages about a wrong type.
std::string kind(const json& v) {
  switch (v.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::string:
      return "a string";
    case json::value_t::array:
      return "an array";
    case json::value_t::object:
      return "an object";
    case json::value_t::number_float: {
      // A whole number beyond 64 bits is read as a float.
      const double d = v.get<double>();
      return std::isfinite(d) && d == std::floor(d) ? "an integer out of range"
                                                    : "a number with a fraction";
    }
    default:
      return "an integer";
  }
}

ApiError wrong_type(const std::string& param, const std::string& want, const json& v) {
  return bad(param, fmt::format("{} must be {}, got {} ({})", param, want, kind(v),
                                v.dump(-1, ' ', false, json::error_handler_t::replace)));
}

// The field's value, or nullptr when absent or null (the default then applies).
const json* field(const json& body, const char* key) {
  const auto it = body.find(key);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

std::optional<ApiError> get_number(const json& body, const char* key, float& out) {
  const json* v = field(body, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) return wrong_type(key, "a number", *v);
  out = v->get<float>();
  return std::nullopt;
}

// An integer in [lo, hi]; out-of-range values are refused with the range.
std::optional<ApiError> get_int(const json& body, const char* key, int64_t lo, int64_t hi,
                                std::optional<int64_t>& out) {
  const json* v = field(body, key);
  if (!v) return std::nullopt;
  if (!v->is_number_integer()) return wrong_type(key, "an integer", *v);
  const int64_t x = v->is_number_unsigned()
                        ? static_cast<int64_t>(std::min<uint64_t>(
                              v->get<uint64_t>(), std::numeric_limits<int64_t>::max()))
                        : v->get<int64_t>();
  if (x < lo || x > hi) {
    return bad(key, hi == std::numeric_limits<int64_t>::max()
                        ? fmt::format("{} must be at least {}, got {}", key, lo, x)
                        : fmt::format("{} must be in [{}, {}], got {}", key, lo, hi, x));
  }
  out = x;
  return std::nullopt;
}

std::optional<ApiError> get_bool(const json& body, const char* key, bool& out) {
  const json* v = field(body, key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) return wrong_type(key, "a boolean", *v);
  out = v->get<bool>();
  return std::nullopt;
}

// Fields expert-serve knows but cannot honour: refused unless they ask for the default.
std::optional<ApiError> unsupported(const json& body) {
  std::optional<int64_t> n;
  if (auto e = get_int(body, "best_of", 1, 1, n)) return e;
  bool flag = false;
  if (auto e = get_bool(body, "echo", flag)) return e;
  if (flag) return bad("echo", "echo is not supported");
  if (const json* v = field(body, "suffix"); v && !(v->is_string() && v->empty())) {
    return bad("suffix", "suffix is not supported");
  }
  return std::nullopt;
}

// tools [{"type": "function", "function": {"name", "description", "parameters"}}], tool_choice
// and parallel_tool_calls (chat only), as OpenAI's API takes them.
std::optional<ApiError> read_tools(const json& body, bool chat, Request& out) {
  const json* tools = field(body, "tools");
  const json* choice = field(body, "tool_choice");
  if (!chat) {
    if (tools && !(tools->is_array() && tools->empty())) {
      return bad("tools", "tools are for chat completions");
    }
    return std::nullopt;
  }
  if (tools) {
    if (!tools->is_array()) return wrong_type("tools", "an array of tools", *tools);
    for (size_t i = 0; i < tools->size(); ++i) {
      const json& t = (*tools)[i];
      const std::string w = fmt::format("tools[{}]", i);
      if (!t.is_object() || t.value("type", json()) != "function" || !t.contains("function") ||
          !t["function"].is_object()) {
        return bad(w, w + " must be {\"type\": \"function\", \"function\": {...}}");
      }
      const json& f = t["function"];
      if (!f.contains("name") || !f["name"].is_string() || f["name"].get<std::string>().empty()) {
        return bad(w + ".function.name", w + ".function.name must be a non-empty string");
      }
      Tool tool{f["name"].get<std::string>(), ""};
      if (f.contains("parameters") && !f["parameters"].is_null()) {
        if (!f["parameters"].is_object()) {
          return wrong_type(w + ".function.parameters", "a JSON Schema object", f["parameters"]);
        }
        tool.parameters = f["parameters"].dump();
      }
      for (const Tool& other : out.tools) {
        if (other.name == tool.name) {
          return bad(w + ".function.name", fmt::format("two tools are named '{}'", tool.name));
        }
      }
      out.tools.push_back(std::move(tool));
    }
  }
  out.tool_choice = out.tools.empty() ? ToolChoice::kNone : ToolChoice::kAuto;
  if (choice) {
    if (out.tools.empty()) return bad("tool_choice", "tool_choice needs tools");
    if (choice->is_string()) {
      const std::string c = choice->get<std::string>();
      if (c == "none") {
        out.tool_choice = ToolChoice::kNone;
      } else if (c == "auto") {
        out.tool_choice = ToolChoice::kAuto;
      } else if (c == "required") {
        out.tool_choice = ToolChoice::kRequired;
      } else {
        return bad("tool_choice", fmt::format("tool_choice '{}' is not none, auto, required or "
                                              "{{\"type\": \"function\", ...}}",
                                              c));
      }
    } else if (choice->is_object() && choice->contains("function") &&
               (*choice)["function"].is_object() && (*choice)["function"].contains("name") &&
               (*choice)["function"]["name"].is_string()) {
      out.tool_choice = ToolChoice::kNamed;
      out.tool_choice_name = (*choice)["function"]["name"].get<std::string>();
      if (std::none_of(out.tools.begin(), out.tools.end(),
                       [&](const Tool& t) { return t.name == out.tool_choice_name; })) {
        return bad("tool_choice", fmt::format("tool_choice names '{}', which is not in tools",
                                              out.tool_choice_name));
      }
    } else {
      return wrong_type("tool_choice",
                        "none, auto, required or {\"type\": \"function\", \"function\": "
                        "{\"name\"}}",
                        *choice);
    }
  }
  if (auto e = get_bool(body, "parallel_tool_calls", out.parallel_tool_calls)) return e;
  return std::nullopt;
}

// response_format: {"type": "text"}, {"type": "json_object"}, or {"type": "json_schema",
// "json_schema": {"name", "schema", "strict", "description"}} (OpenAI's shapes).
std::optional<ApiError> read_response_format(const json& body,
                                             std::shared_ptr<const text::JsonSchema>& out) {
  const json* v = field(body, "response_format");
  if (v == nullptr) return std::nullopt;
  if (!v->is_object() || !v->contains("type") || !(*v)["type"].is_string()) {
    return bad("response_format", "response_format must be an object with a \"type\"");
  }
  const std::string type = (*v)["type"].get<std::string>();
  if (type == "text") return std::nullopt;
  if (type == "json_object") {
    out = text::JsonSchema::any_object();
    return std::nullopt;
  }
  if (type != "json_schema") {
    return bad("response_format.type",
               fmt::format("'{}' is not one of text, json_object, json_schema", type));
  }
  const json* js = v->contains("json_schema") ? &(*v)["json_schema"] : nullptr;
  if (js == nullptr || !js->is_object() || !js->contains("schema")) {
    return bad("response_format.json_schema",
               "json_schema must be an object with the \"schema\" to follow");
  }
  auto compiled = text::JsonSchema::compile((*js)["schema"].dump());
  if (!compiled) {
    return bad("response_format.json_schema.schema",
               "the schema cannot be enforced: " + compiled.error().message);
  }
  out = std::move(*compiled);
  return std::nullopt;
}

std::optional<ApiError> read_sampling(const json& body, text::SamplerOptions& so) {
  if (auto e = get_number(body, "temperature", so.temperature)) return e;
  if (auto e = get_number(body, "top_p", so.top_p)) return e;
  if (auto e = get_number(body, "min_p", so.min_p)) return e;
  if (auto e = get_number(body, "repetition_penalty", so.repeat_penalty)) return e;
  std::optional<int64_t> i;
  // -1 is how vLLM spells "off".
  if (auto e = get_int(body, "top_k", -1, std::numeric_limits<int32_t>::max(), i)) return e;
  if (i) so.top_k = *i < 0 ? 0 : static_cast<int32_t>(*i);
  i.reset();
  if (auto e = get_int(body, "repeat_last_n", 0, text::kMaxRepeatLastN, i)) return e;
  if (i) so.repeat_last_n = static_cast<int32_t>(*i);
  i.reset();
  if (auto e = get_int(body, "seed", std::numeric_limits<int64_t>::min(),
                       std::numeric_limits<int64_t>::max(), i)) {
    return e;
  }
  if (i) so.seed = static_cast<uint64_t>(*i);
  if (auto e = get_number(body, "presence_penalty", so.presence_penalty)) return e;
  if (auto e = get_number(body, "frequency_penalty", so.frequency_penalty)) return e;
  if (auto st = text::validate(so); !st) {
    // validate() names the SamplerOptions field; the request spells two of them differently.
    std::string m = st.error().message;
    std::string param = m.substr(0, m.find(' '));
    if (param == "repeat_penalty") {
      param = "repetition_penalty";
      m = "repetition_penalty" + m.substr(std::strlen("repeat_penalty"));
    }
    return bad(param, m);
  }
  return std::nullopt;
}

// logit_bias: {"token id": bias in [-100, 100]} (OpenAI's: the ids as strings).
std::optional<ApiError> read_logit_bias(const json& body, uint32_t n_vocab,
                                        std::vector<std::pair<uint32_t, float>>& out) {
  const json* v = field(body, "logit_bias");
  if (!v) return std::nullopt;
  if (!v->is_object()) return wrong_type("logit_bias", "an object of token id: bias", *v);
  for (const auto& [key, bias] : v->items()) {
    uint32_t id = 0;
    const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
    if (key.empty() || ec != std::errc() || end != key.data() + key.size() || id >= n_vocab) {
      return bad("logit_bias", fmt::format("logit_bias key '{}' is not a token id below the "
                                           "vocabulary's {}",
                                           key.substr(0, 32), n_vocab));
    }
    if (!bias.is_number() || !(bias.get<double>() >= -100.0 && bias.get<double>() <= 100.0)) {
      return bad("logit_bias",
                 fmt::format("logit_bias of token {} must be a number in [-100, 100], got {}", id,
                             bias.dump().substr(0, 32)));
    }
    out.emplace_back(id, bias.get<float>());
  }
  return std::nullopt;
}

std::optional<ApiError> read_stop(const json& body, std::vector<std::string>& out) {
  const json* v = field(body, "stop");
  if (!v) return std::nullopt;
  if (v->is_string()) {
    out.push_back(v->get<std::string>());
  } else if (v->is_array()) {
    for (const json& s : *v) {
      if (!s.is_string()) return wrong_type("stop", "a string or an array of strings", *v);
      out.push_back(s.get<std::string>());
    }
  } else {
    return wrong_type("stop", "a string or an array of strings", *v);
  }
  for (const std::string& s : out) {
    if (s.empty()) return bad("stop", "stop strings must not be empty");
  }
  return std::nullopt;
}

std::optional<ApiError> read_prompt(const json& body, uint32_t n_vocab, Request& out) {
  const json* v = field(body, "prompt");
  if (!v) return bad("prompt", "prompt is required");
  const json* p = v;
  // A batch of one prompt is that prompt.
  if (v->is_array() && v->size() == 1 && ((*v)[0].is_string() || (*v)[0].is_array())) {
    p = &(*v)[0];
  }
  if (p->is_string()) {
    out.prompt_text = p->get<std::string>();
    return std::nullopt;
  }
  if (!p->is_array()) {
    return wrong_type("prompt", "a string, an array of token ids or an array of one string", *v);
  }
  if (p->empty()) return bad("prompt", "prompt is empty");
  for (const json& t : *p) {
    if (t.is_string() || t.is_array()) {
      return bad("prompt", "expert-serve answers one prompt per request");
    }
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= n_vocab) {
      return bad("prompt", fmt::format("prompt token ids must be integers in [0, {}), got {}",
                                       n_vocab, t.dump()));
    }
    out.prompt_ids.push_back(t.get<uint32_t>());
  }
  out.prompt_ids_given = true;
  return std::nullopt;
}

std::optional<ApiError> read_messages(const json& body, std::vector<Message>& out) {
  const json* v = field(body, "messages");
  if (!v) return bad("messages", "messages is required");
  if (!v->is_array()) return wrong_type("messages", "an array of messages", *v);
  if (v->empty()) return bad("messages", "messages is empty");
  for (size_t i = 0; i < v->size(); ++i) {
    const json& m = (*v)[i];
    const std::string where = fmt::format("messages[{}]", i);
    if (!m.is_object()) return wrong_type(where, "an object", m);
    const json* role = field(m, "role");
    if (!role || !role->is_string()) {
      return bad(where + ".role", where + ".role must be a string");
    }
    Message msg{role->get<std::string>(), "", {}};
    if (msg.role == "developer") msg.role = "system";  // OpenAI's newer name for it
    if (msg.role != "system" && msg.role != "user" && msg.role != "assistant" &&
        msg.role != "tool") {
      return bad(where + ".role",
                 fmt::format("{}.role '{}' is not system, developer, user, assistant or tool",
                             where, msg.role));
    }
    if (const json* calls = field(m, "tool_calls")) {
      if (msg.role != "assistant" || !calls->is_array()) {
        return bad(where + ".tool_calls", where +
                                              ".tool_calls must be an array, on an assistant "
                                              "message");
      }
      for (size_t k = 0; k < calls->size(); ++k) {
        const json& tc = (*calls)[k];
        const std::string w = fmt::format("{}.tool_calls[{}]", where, k);
        if (!tc.is_object() || !tc.contains("function") || !tc["function"].is_object() ||
            !tc["function"].contains("name") || !tc["function"]["name"].is_string()) {
          return bad(w, w + " must be {\"type\": \"function\", \"function\": {\"name\", "
                            "\"arguments\"}}");
        }
        const json args = tc["function"].value("arguments", json("{}"));
        if (!args.is_string() && !args.is_object()) {
          return wrong_type(w + ".function.arguments", "a JSON string or an object", args);
        }
        const json* id = field(tc, "id");
        if (id && !id->is_string()) return wrong_type(w + ".id", "a string", *id);
        msg.tool_calls.push_back({tc["function"]["name"].get<std::string>(),
                                  args.is_string() ? args.get<std::string>() : args.dump(),
                                  id ? id->get<std::string>() : std::string()});
      }
    }
    if (const json* id = field(m, "tool_call_id"); id && msg.role == "tool") {
      if (!id->is_string()) return wrong_type(where + ".tool_call_id", "a string", *id);
      msg.tool_call_id = id->get<std::string>();
    }
    const json* content = field(m, "content");
    if (!content) {
      if (msg.role != "assistant") return bad(where + ".content", where + ".content is required");
    } else if (content->is_string()) {
      msg.content = content->get<std::string>();
    } else if (content->is_array()) {
      for (const json& part : *content) {
        if (!part.is_object() || part.value("type", json()) != "text" || !part.contains("text") ||
            !part["text"].is_string()) {
          return bad(where + ".content",
                     where + ".content: only text parts ({\"type\": \"text\", \"text\": ...})");
        }
        msg.content += part["text"].get<std::string>();
      }
    } else {
      return wrong_type(where + ".content", "a string or an array of text parts", *content);
    }
    out.push_back(std::move(msg));
  }
  return std::nullopt;
}

// chat_template_kwargs and the top-level reasoning_effort; both effort spellings given must agree.
// logprobs: chat's logprobs (bool) and top_logprobs (0..kMaxTopLogprobs, only with logprobs),
// completions' logprobs (the alternatives, 0..kMaxTopLogprobs).
std::optional<ApiError> read_logprobs(const json& body, bool chat, int32_t& out) {
  std::optional<int64_t> top;
  if (chat) {
    bool on = false;
    if (auto e = get_bool(body, "logprobs", on)) return e;
    if (auto e = get_int(body, "top_logprobs", 0, kMaxTopLogprobs, top)) return e;
    if (top && !on) return bad("top_logprobs", "top_logprobs needs logprobs: true");
    out = on ? static_cast<int32_t>(top.value_or(0)) : -1;
    return std::nullopt;
  }
  if (auto e = get_int(body, "logprobs", 0, kMaxTopLogprobs, top)) return e;
  out = top ? static_cast<int32_t>(*top) : -1;
  return std::nullopt;
}

std::optional<ApiError> read_chat_options(const json& body, text::ChatOptions& out) {
  if (const json* v = field(body, "chat_template_kwargs")) {
    if (!v->is_object()) return wrong_type("chat_template_kwargs", "an object", *v);
    std::string param;
    const Status read =
        text::read_chat_template_kwargs(dump(*v), "chat_template_kwargs", out, &param);
    if (!read) return bad(param, read.error().message);
  }
  if (const json* v = field(body, "reasoning_effort")) {
    if (!v->is_string()) return wrong_type("reasoning_effort", "a string", *v);
    const std::string effort = v->get<std::string>();
    if (!text::valid_reasoning_effort(effort)) {
      return bad("reasoning_effort", fmt::format("reasoning_effort must be one of {}, got '{}'",
                                                 text::kReasoningEfforts, effort));
    }
    if (!out.reasoning_effort.empty() && out.reasoning_effort != effort) {
      return bad("reasoning_effort",
                 fmt::format("reasoning_effort '{}' and chat_template_kwargs.reasoning_effort "
                             "'{}' differ",
                             effort, out.reasoning_effort));
    }
    out.reasoning_effort = effort;
  }
  return std::nullopt;
}

}  // namespace

json error_body(const ApiError& e) {
  return {{"error",
           {{"message", e.message},
            {"type", e.type},
            {"param", e.param.empty() ? json() : json(e.param)},
            {"code", e.code.empty() ? json() : json(e.code)}}}};
}

std::optional<ApiError> read_request(const json& body, bool chat, const std::string& model,
                                     uint32_t n_vocab, Request& out) {
  if (!body.is_object()) return bad("", "the request body must be a JSON object");
  out.chat = chat;
  if (const json* m = field(body, "model")) {
    if (!m->is_string()) return wrong_type("model", "a string", *m);
    if (m->get<std::string>() != model) {
      ApiError e = bad("model", fmt::format("The model '{}' does not exist (this server serves "
                                            "'{}')",
                                            m->get<std::string>(), model));
      e.status = 404;
      e.code = "model_not_found";
      return e;
    }
  }
  if (auto e = chat ? read_messages(body, out.messages) : read_prompt(body, n_vocab, out)) {
    return e;
  }
  if (auto e = get_bool(body, "stream", out.stream)) return e;
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) return wrong_type("stream_options", "an object", *so);
    if (auto e = get_bool(*so, "include_usage", out.include_usage)) {
      e->param = "stream_options.include_usage";
      return e;
    }
  }
  std::optional<int64_t> max;
  const int64_t huge = std::numeric_limits<int64_t>::max();
  if (auto e = get_int(body, "max_tokens", 1, huge, max)) return e;
  if (chat) {
    if (auto e = get_int(body, "max_completion_tokens", 1, huge, max)) return e;
  }
  if (max) out.max_tokens = static_cast<uint64_t>(*max);
  if (auto e = get_bool(body, "ignore_eos", out.ignore_eos)) return e;
  if (const json* v = field(body, "reasoning_format"); v && chat) {
    if (!v->is_string()) return wrong_type("reasoning_format", "a string", *v);
    out.reasoning_format = v->get<std::string>();
    if (out.reasoning_format != "auto" && out.reasoning_format != "deepseek" &&
        out.reasoning_format != "none") {
      return bad("reasoning_format", fmt::format("reasoning_format must be one of {}, got '{}'",
                                                 kReasoningFormats, out.reasoning_format));
    }
  }
  if (chat) {
    if (auto e = read_chat_options(body, out.chat_options)) return e;
  }
  if (auto e = read_sampling(body, out.sampling)) return e;
  if (auto e = read_logit_bias(body, n_vocab, out.sampling.logit_bias)) return e;
  if (auto e = read_stop(body, out.stops)) return e;
  if (auto e = unsupported(body)) return e;
  if (auto e = read_response_format(body, out.json_schema)) return e;
  if (auto e = read_tools(body, chat, out)) return e;
  if (auto e = read_logprobs(body, chat, out.logprobs)) return e;
  std::optional<int64_t> n;
  if (auto e = get_int(body, "n", 1, kMaxChoices, n)) return e;
  out.n = static_cast<uint32_t>(n.value_or(1));
  if (const json* u = field(body, "user"); u && !u->is_string()) {
    return wrong_type("user", "a string", *u);
  }
  return std::nullopt;
}

size_t utf8_ready(std::string_view s) {
  const size_t n = s.size();
  for (size_t k = 1; k <= 3 && k <= n; ++k) {
    const auto c = static_cast<unsigned char>(s[n - k]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: its lead is further back
    const size_t need = c >= 0xC2 && c <= 0xDF   ? 2
                        : c >= 0xE0 && c <= 0xEF ? 3
                        : c >= 0xF0 && c <= 0xF4 ? 4
                                                 : 0;
    if (need <= k) return n;  // complete, or not a lead byte at all
    if (k >= 2) {
      // The second byte's range depends on the lead (no overlong forms, surrogates or > U+10FFFF).
      const auto c1 = static_cast<unsigned char>(s[n - k + 1]);
      const unsigned char lo = c == 0xE0 ? 0xA0 : c == 0xF0 ? 0x90 : 0x80;
      const unsigned char hi = c == 0xED ? 0x9F : c == 0xF4 ? 0x8F : 0xBF;
      if (c1 < lo || c1 > hi) return n;
    }
    return n - k;
  }
  return n;
}

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

}  // namespace expertd::serve
