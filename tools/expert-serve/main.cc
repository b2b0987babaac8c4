// expert-serve: an OpenAI-compatible HTTP server (completions, chat completions, streaming as
// server-sent events) for a model whose routed experts come from a running expertd. The engine
// is set up as expert-run sets it up (the dense weights from the files the daemon passes, or
// --gguf; the CUDA engine when there is a device, else the CPU one); one thread owns it and runs
// up to --parallel sequences batched by expert (generator.h), and requests wait in a bounded
// queue. HTTP is http_server.h's (every client bounded); a Front routes, checks the API key and
// answers /health, and a Backend per connection to expertd holds the engine and the Service.
//
// Bound to loopback by default; --api-key requires a key on every endpoint but /health.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <malloc.h>
#include <signal.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstring>
#include <ctime>
#include <fstream>
#include <iterator>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "api.h"
#include "client/prometheus.h"
#include "engine/cpu_engine.h"
#include "engine/daemon_expert_source.h"
#include "engine/model.h"
#include "engine/setup.h"
#include "expertd/client.h"
#include "generator.h"
#include "http_server.h"
#include "text/chat_template.h"
#include "text/reasoning.h"
#include "text/stop.h"
#include "text/tokenizer.h"
#include "tools/common/engine_flags.h"
#ifdef EXPERTD_HAVE_CUDA
#include "engine/gpu_engine.h"
#endif

namespace {

using expertd::Error;
using expertd::Result;
using expertd::serve::ApiError;
using expertd::serve::dump;
using expertd::serve::Generator;
using expertd::serve::Job;
using json = nlohmann::json;
namespace http = expertd::serve::http;
using namespace expertd::engine;
using namespace expertd::text;

struct Options : expertd::tools::EngineFlags {
  std::string host = "127.0.0.1";
  int port = 8080;
  uint32_t ctx = 4096;
  uint32_t queue = 8;
  uint32_t parallel = 4;
  std::string chat_template;
  std::string reasoning_format = "auto";
  std::string chat_template_kwargs;  // --chat-template-kwargs: JSON, the defaults of every request
  std::string reasoning_effort;      // --reasoning-effort
  ChatOptions chat_defaults;         // the two read (main)
  std::string log_level = "info";
  std::vector<std::string> models;  // --model, once or more (EngineFlags::model: each Backend's)
  uint32_t max_tokens = 2048;  // a chat request's max_tokens when it gives none (and room allows)
  std::string api_key;
  std::string api_key_file;
  std::string cors_origin;
  size_t max_connections = 128;
  double header_timeout = 10;
  double body_timeout = 60;
  double idle_timeout = 30;
  double write_timeout = 30;
  double reconnect_timeout = 60;
};

void setup_logging(const std::string& level) {
  auto logger = spdlog::stderr_color_mt("expert-serve");
  spdlog::set_default_logger(logger);
  // Under systemd (JOURNAL_STREAM set) the journal adds the time: log without it.
  if (std::getenv("JOURNAL_STREAM") != nullptr) {
    spdlog::set_pattern("<%^%l%$> %v");
  } else {
    spdlog::set_pattern("%Y-%m-%d %H:%M:%S.%e %^%l%$ %v");
  }
  spdlog::set_level(spdlog::level::from_str(level));
}

std::string random_id(const char* prefix) {
  static thread_local std::mt19937_64 rng(std::random_device{}());
  return fmt::format("{}{:016x}", prefix, rng());
}

http::Response json_response(const json& j, int status = 200) {
  http::Response r;
  r.status = status;
  r.body = dump(j);
  return r;
}

http::Response error_response(const ApiError& e) {
  return json_response(expertd::serve::error_body(e), e.status);
}

ApiError api_error(int status, std::string message, std::string param = "") {
  ApiError e;
  e.status = status;
  e.message = std::move(message);
  e.param = std::move(param);
  if (status >= 500) e.type = "server_error";
  return e;
}

// Prometheus text (format 0.0.4): each metric's HELP and TYPE once, then its samples from every
// model.
class MetricSet {
 public:
  void add(std::string_view name, std::string_view type, std::string_view help,
           const std::string& samples) {
    for (auto& f : families_) {
      if (f.name == name) {
        f.samples += samples;
        return;
      }
    }
    families_.push_back({std::string(name), std::string(type), std::string(help), samples});
  }
  std::string text() const {
    std::string out;
    for (const auto& f : families_) {
      out +=
          fmt::format("# HELP {} {}\n# TYPE {} {}\n{}", f.name, f.help, f.name, f.type, f.samples);
    }
    return out;
  }

 private:
  struct Family {
    std::string name, type, help, samples;
  };
  std::vector<Family> families_;
};

// Every answer, by endpoint and status, for /metrics (kept across reconnections to expertd).
class ResponseCounts {
 public:
  void count(const std::string& path, int status) {
    static constexpr std::string_view kPaths[] = {"/v1/completions", "/v1/chat/completions",
                                                  "/v1/models",      "/tokenize",
                                                  "/detokenize",     "/props",
                                                  "/health",         "/metrics"};
    std::string_view endpoint = "other";
    for (const std::string_view p : kPaths) {
      if (path == p || (p == "/v1/models" && path.starts_with("/v1/models/"))) endpoint = p;
    }
    std::lock_guard lock(mu_);
    ++counts_[{std::string(endpoint), status}];
  }
  std::string samples() const {
    std::string out;
    std::lock_guard lock(mu_);
    for (const auto& [key, n] : counts_) {
      out += fmt::format("expert_serve_responses_total{{endpoint=\"{}\",status=\"{}\"}} {}\n",
                         key.first, key.second, n);
    }
    return out;
  }

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> counts_;  // by (endpoint, status)
};

// The body as a JSON object, or the 400 that says why not.
std::optional<ApiError> parse_body(const http::Request& req, json& body) {
  try {
    body = json::parse(req.body);
  } catch (const json::exception& e) {
    // parse_error, and out_of_range for a number beyond double's range ("x": 1e400): nlohmann's
    // message after its "[json.exception.parse_error.101] " tag.
    std::string what = e.what();
    if (const size_t at = what.find("] "); at != std::string::npos) what = what.substr(at + 2);
    return api_error(400, "the body is not valid JSON: " + what);
  }
  if (!body.is_object()) return api_error(400, "the request body must be a JSON object");
  return std::nullopt;
}

// The bytes of the vocabulary's longest token.
size_t longest_token(const Tokenizer& tok) {
  size_t longest = 1;
  for (uint32_t id = 0; id < tok.size(); ++id) longest = std::max(longest, tok.decode(id).size());
  return longest;
}

// The engine side of the HTTP API, for one connection to expertd: tokenizes, hands jobs to the
// Generator and writes the answers.
class Service {
 public:
  // `chat` is the chat template, or why there is none (chat requests then get a 400 saying so).
  Service(const Options& o, const Tokenizer& tok, Result<ChatTemplate> chat, Generator& gen,
          std::string engine_note)
      : o_(o),
        tok_(tok),
        max_token_bytes_(longest_token(tok)),
        chat_(std::move(chat)),
        gen_(gen),
        engine_note_(std::move(engine_note)) {}

  // A worker: the endpoints that tokenize or generate, with the request's body (a JSON object).
  void handle(http::Exchange& ex, const json& body) {
    const std::string& path = ex.request().path;
    if (path == "/v1/completions") return generate(ex, body, /*chat=*/false);
    if (path == "/v1/chat/completions") return generate(ex, body, /*chat=*/true);
    if (path == "/tokenize") return tokenize(ex, body);
    if (path == "/detokenize") return detokenize(ex, body);
  }

  const std::string& model() const { return o_.model; }

  // /health's fields from the engine side.
  json health_fields() const {
    return {{"model", o_.model},         {"engine", engine_note_},      {"context", o_.ctx},
            {"running", gen_.running()}, {"parallel", gen_.parallel()}, {"queued", gen_.queued()},
            {"queue_limit", o_.queue},   {"served", gen_.served()}};
  }

  // The largest body a request that fits the context can need: its prompt at the longest
  // token's bytes per position, each byte escaped in JSON (at most 6: \u00XX), and 4 MiB for
  // the other fields (a logit_bias over a whole vocabulary); at most 64 MiB.
  size_t body_limit() const {
    return std::min<size_t>(size_t{64} << 20,
                            size_t{6} * o_.ctx * max_token_bytes_ + (size_t{4} << 20));
  }

 public:
  json model_object() const {
    return {{"id", o_.model}, {"object", "model"}, {"created", started_}, {"owned_by", "expertd"}};
  }

 private:
  static json usage(const Job& job) {
    const uint32_t prompt = static_cast<uint32_t>(job.prompt.size());
    return {{"prompt_tokens", prompt},
            {"completion_tokens", job.completion_tokens},
            {"total_tokens", prompt + job.completion_tokens},
            {"prompt_tokens_details", {{"cached_tokens", job.cached_tokens}}}};
  }

  // The prompt's tokens into `job`, with how its answer is cut and split; or the error to answer
  // with.
  // `tools`: the tool definitions as the template writes them (none: tool_choice none or no
  // tools); with a forced tool choice the call's opening is written after the generation prompt.
  std::optional<ApiError> prompt_tokens(const expertd::serve::Request& r, Job& job,
                                        std::span<const std::string> tools) const {
    std::vector<uint32_t>& out = job.prompt;
    if (r.chat) {
      if (!chat_) return api_error(400, "chat completions are off: " + chat_.error().message);
      std::vector<ChatMessage> messages;
      for (const auto& m : r.messages) {
        messages.push_back({m.role, m.content, m.tool_calls, m.tool_call_id});
      }
      chat_->fit_call_ids(messages);
      // A switch the template does not read is ignored, as vLLM's (jinja) rendering ignores it.
      if (const auto ignored = chat_->ignored(r.chat_options); !ignored.empty()) {
        spdlog::info("chat request: {} ignored: the {} template does not read it",
                     fmt::join(ignored, ", "), chat_->family());
      }
      const ChatOptions options = o_.chat_defaults.overridden_by(r.chat_options);
      auto text = chat_->render(messages, /*add_generation_prompt=*/true, options, tools);
      if (!text) return api_error(400, "messages: " + text.error().message, "messages");
      const bool forced = job.tools == Job::Tools::kForced;
      if (forced) {
        // The call is the answer: a prompt that opened a think block (DeepSeek-V3.1's, thinking
        // on) closes it first, as the template writes an answer without reasoning.
        if (prompt_opens_think(*text)) *text += "</think>";
        *text += job.forced_opening;
      }
      spdlog::debug("chat prompt: {}", dump(*text));
      // The template writes the BOS itself where the model wants one.
      auto ids = tok_.encode(*text, /*add_special=*/false);
      if (!ids) return api_error(400, "messages: " + ids.error().message, "messages");
      out = std::move(*ids);
      // The turn's end marker stops the answer where it is text rather than an end token.
      job.gen.end_strings = chat_->stop_strings();
      const std::string& format =
          r.reasoning_format.empty() ? o_.reasoning_format : r.reasoning_format;
      if (format != "none" && !forced) {  // a forced call's answer is the call's JSON
        // A prompt that closed the think block (a switch turned thinking off): all content.
        job.gen.reasoning = answer_reasoning_syntax(chat_->kind(), *text);
        job.gen.starts_in_reasoning = prompt_opens_think(*text);
      }
      // Structured output constrains the raw text: an answer that must open with reasoning
      // (gpt-oss's channels, a prompt that opened a <think> block) cannot be JSON from its first
      // byte. A forced call on gpt-oss is not one: its opening wrote the message's header.
      if ((r.json_schema && chat_->kind() == ChatTemplate::Kind::kGptOss) ||
          ((r.json_schema || forced) && prompt_opens_think(*text))) {
        return api_error(400,
                         fmt::format("response_format: the {} template makes the answer begin "
                                     "with its reasoning, which constrained JSON cannot follow; "
                                     "turn thinking off (chat_template_kwargs "
                                     "{{\"enable_thinking\": false}}) or ask without it",
                                     chat_->family()),
                         "response_format");
      }
      return std::nullopt;
    }
    if (r.prompt_ids_given) {
      out = r.prompt_ids;
      return std::nullopt;
    }
    auto ids = tok_.encode(r.prompt_text, /*add_special=*/true);
    if (!ids) return api_error(400, "prompt: " + ids.error().message, "prompt");
    out = std::move(*ids);
    return std::nullopt;
  }

  static void send_error(http::Exchange& ex, const ApiError& e) { ex.reply(error_response(e)); }
  static void set_content(http::Exchange& ex, std::string body, const char* type) {
    ex.reply({200, type, {}, std::move(body)});
  }

  // POST /tokenize {"content", "add_special" (false), "with_pieces" (false)}: llama.cpp server's
  // endpoint. {"tokens": [ids]}, or [{"id", "piece"}] with pieces.
  void tokenize(http::Exchange& ex, const json& body) {
    if (!body.contains("content") || !body["content"].is_string()) {
      return send_error(ex, api_error(400, "content must be a string", "content"));
    }
    bool add_special = false;
    bool with_pieces = false;
    for (auto [name, flag] :
         {std::pair{"add_special", &add_special}, std::pair{"with_pieces", &with_pieces}}) {
      if (!body.contains(name) || body[name].is_null()) continue;
      if (!body[name].is_boolean()) {
        return send_error(ex, api_error(400, fmt::format("{} must be a boolean", name), name));
      }
      *flag = body[name].get<bool>();
    }
    auto ids = tok_.encode(body["content"].get<std::string>(), add_special);
    if (!ids) return send_error(ex, api_error(400, "content: " + ids.error().message, "content"));
    json tokens = json::array();
    for (const uint32_t id : *ids) {
      if (with_pieces) {
        tokens.push_back({{"id", id}, {"piece", tok_.decode(id)}});
      } else {
        tokens.push_back(id);
      }
    }
    set_content(ex, dump({{"tokens", tokens}}), "application/json");
  }

  // POST /detokenize {"tokens": [ids]}: {"content": text}.
  void detokenize(http::Exchange& ex, const json& body) {
    if (!body.contains("tokens") || !body["tokens"].is_array()) {
      return send_error(ex, api_error(400, "tokens must be an array of token ids", "tokens"));
    }
    std::vector<uint32_t> ids;
    for (size_t i = 0; i < body["tokens"].size(); ++i) {
      const json& t = body["tokens"][i];
      if (!t.is_number_unsigned() || t.get<uint64_t>() >= tok_.size()) {
        return send_error(ex, api_error(400,
                                        fmt::format("tokens[{}] = {} is not a token id below "
                                                    "the vocabulary's {}",
                                                    i, t.dump(), tok_.size()),
                                        "tokens"));
      }
      ids.push_back(t.get<uint32_t>());
    }
    set_content(ex, dump({{"content", tok_.decode(ids)}}), "application/json");
  }

 public:
  // This model's counters and gauges into `m`, each sample with `label` ("" or
  // {model="NAME"} when the server has several models).
  void metrics(MetricSet& m, const std::string& label) const {
    auto one = [&](std::string_view name, double v) {
      return fmt::format("{}{} {}\n", name, label, v);
    };
    const expertd::serve::GeneratorCounters& c = gen_.counters();
    auto load = [](const std::atomic<uint64_t>& a) {
      return static_cast<double>(a.load(std::memory_order_relaxed));
    };
    m.add("expert_serve_requests_total", "counter",
          "generation requests ended (answered, failed or cancelled)",
          one("expert_serve_requests_total", load(c.requests)));
    m.add("expert_serve_prompt_tokens_total", "counter", "prompt tokens of those requests",
          one("expert_serve_prompt_tokens_total", load(c.prompt_tokens)));
    m.add("expert_serve_cached_prompt_tokens_total", "counter",
          "of those, reused from a sequence's KV cache (prefix reuse)",
          one("expert_serve_cached_prompt_tokens_total", load(c.cached_tokens)));
    m.add("expert_serve_generated_tokens_total", "counter", "tokens sampled",
          one("expert_serve_generated_tokens_total", load(c.generated_tokens)));
    m.add("expert_serve_time_to_first_token_seconds", "summary",
          "from a request's queueing to its first token",
          one("expert_serve_time_to_first_token_seconds_sum", load(c.first_token_ns) / 1e9) +
              one("expert_serve_time_to_first_token_seconds_count", load(c.first_tokens)));
    m.add("expert_serve_decode_steps_total", "counter",
          "decode steps (one token for each generating sequence)",
          one("expert_serve_decode_steps_total", load(c.steps)));
    m.add("expert_serve_decode_rows_total", "counter",
          "sequences fed by those steps (rows / steps: the batch occupancy)",
          one("expert_serve_decode_rows_total", load(c.rows)));
    m.add("expert_serve_requests_running", "gauge", "requests on a sequence now",
          one("expert_serve_requests_running", static_cast<double>(gen_.running())));
    m.add("expert_serve_requests_queued", "gauge", "requests waiting for a sequence",
          one("expert_serve_requests_queued", static_cast<double>(gen_.queued())));
    m.add("expert_serve_sequences", "gauge", "sequences the engine holds (--parallel)",
          one("expert_serve_sequences", static_cast<double>(gen_.parallel())));
  }

  // GET /props: what this server runs and can do.
  json props() const {
    const ModelParams& p = gen_.engine().params();
    const FamilyInfo& f = family_info(p.family);
    return {
        {"model", o_.model},
        {"architecture", p.architecture},
        {"family", f.name},
        {"engine", engine_note_},
        {"context", o_.ctx},
        {"parallel", gen_.parallel()},
        {"queue_limit", o_.queue},
        {"vocab_size", p.n_vocab},
        {"chat_template", chat_ ? json(chat_->family()) : json(nullptr)},
        {"endpoints",
         {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize",
          "/props", "/health", "/metrics"}},
        {"capabilities",
         {{"chat", static_cast<bool>(chat_)},
          {"streaming", true},
          {"reasoning_content", chat_ && reasoning_syntax(chat_->kind()) != ReasoningSyntax::kNone},
          {"batched_sequences", gen_.parallel() > 1},
          {"prefix_reuse", true}}}};
  }

 private:
  // Tools for a chat request whose tool_choice is not none: their texts as the template writes
  // them (from the body again, parsed keeping key order), the job's tool mode, and for a forced
  // choice (required, or a named function; required with one tool names it) the schema of the
  // call's JSON: {"name": one of the names, "arguments": the function's parameters}, or the
  // parameters alone where the template's opening names the function (arguments any object where
  // the parameters use keywords constrained decoding does not enforce, or several functions may be
  // called).
  std::optional<ApiError> tools_for(const http::Request& req, const expertd::serve::Request& r,
                                    Job& job, std::vector<std::string>& texts,
                                    std::shared_ptr<const JsonSchema>& forced) const {
    using expertd::serve::ToolChoice;
    if (!chat_ || !chat_->supports_tools()) {
      return api_error(
          400,
          fmt::format("tools: the {} chat template has no tool syntax here yet (Qwen3, "
                      "GLM-4.5, the harmony format, DeepSeek-V3.1/V4, Mistral-Nemo/Small-3.2); "
                      "send tool_choice "
                      "\"none\" to ignore them",
                      chat_ ? chat_->family() : std::string("model's")),
          "tools");
    }
    const nlohmann::ordered_json ordered = nlohmann::ordered_json::parse(req.body);
    for (const auto& t : ordered["tools"]) {
      auto text = template_json(t.dump());
      if (!text) return api_error(400, "tools: " + text.error().message, "tools");
      texts.push_back(std::move(*text));
    }
    job.parallel_tool_calls = r.parallel_tool_calls;
    if (r.tool_choice == ToolChoice::kAuto) {
      job.tools = Job::Tools::kParse;
      return std::nullopt;
    }
    if (r.json_schema) {
      return api_error(400, "response_format and a forced tool_choice both constrain the answer",
                       "tool_choice");
    }
    const std::string named = r.tool_choice == ToolChoice::kNamed ? r.tool_choice_name
                              : r.tools.size() == 1               ? r.tools[0].name
                                                                  : std::string();
    const auto call = chat_->forced_call(named);
    if (!call) {
      return api_error(400,
                       named.empty() && chat_->forced_call("any")
                           ? fmt::format("tool_choice: the {} template writes a call's function "
                                         "name outside its JSON, so \"required\" with several "
                                         "tools cannot be constrained; name one function, or use "
                                         "\"auto\"",
                                         chat_->family())
                           : fmt::format("tool_choice: a forced call is constrained as JSON, and "
                                         "the {} template's calls are not JSON; use \"auto\"",
                                         chat_->family()),
                       "tool_choice");
    }
    job.tools = Job::Tools::kForced;
    job.forced_opening = call->opening;
    if (call->arguments_only) job.forced_function = named;
    json names = json::array();
    std::string parameters;
    for (const auto& t : r.tools) {
      if (!named.empty() && t.name != named) continue;
      names.push_back(t.name);
      parameters = t.parameters;
    }
    auto schema_with = [&](const json& arguments) {
      return JsonSchema::compile(json{
          {"type", "object"},
          {"properties", {{"name", {{"enum", names}}}, {"arguments", arguments}}},
          {"required", {"name", "arguments"}},
          {"additionalProperties",
           false}}.dump());
    };
    const json any_object = {{"type", "object"}};
    const json arguments =
        names.size() == 1 && !parameters.empty() ? json::parse(parameters) : any_object;
    auto schema =
        call->arguments_only ? JsonSchema::compile(arguments.dump()) : schema_with(arguments);
    if (!schema) {
      spdlog::info("tool_choice: the arguments of {} are not constrained to its parameters ({})",
                   names.dump(), schema.error().message);
      schema =
          call->arguments_only ? JsonSchema::compile(any_object.dump()) : schema_with(any_object);
    }
    if (!schema) return api_error(500, "tool_choice: " + schema.error().message);
    forced = std::move(*schema);
    return std::nullopt;
  }

  // The tool calls of a finished chat answer ({"id", "type", "function": {"name", "arguments"}}
  // each), and its content without them; nullopt: the answer is text.
  std::optional<json> tool_calls_of(const Job& job, std::string_view text,
                                    std::string& content) const {
    std::vector<expertd::text::ChatToolCall> calls;
    if (job.tools == Job::Tools::kForced) {
      try {
        const nlohmann::ordered_json call = nlohmann::ordered_json::parse(text);
        if (!job.forced_function.empty()) {
          calls.push_back({job.forced_function, call.dump()});
        } else {
          calls.push_back({call.at("name").get<std::string>(), call.at("arguments").dump()});
        }
      } catch (const nlohmann::ordered_json::exception&) {
        return std::nullopt;  // cut short at max_tokens
      }
      content.clear();
    } else if (job.tools == Job::Tools::kParse) {
      auto parsed = chat_->parse_tool_calls(text);
      if (!parsed) return std::nullopt;
      calls = std::move(parsed->calls);
      content = std::move(parsed->content);
      if (!job.parallel_tool_calls) calls.resize(1);
    } else {
      return std::nullopt;
    }
    json out = json::array();
    for (const auto& c : calls) {
      out.push_back({{"id", random_id("call_")},
                     {"type", "function"},
                     {"function", {{"name", c.name}, {"arguments", c.arguments}}}});
    }
    return out;
  }

  void generate(http::Exchange& ex, const json& body, bool chat) {
    expertd::serve::Request r;
    if (auto e = expertd::serve::read_request(body, chat, o_.model, tok_.size(), r)) {
      return send_error(ex, *e);
    }
    // A prompt longer than the context could hold even at the longest token's bytes per
    // position is refused before it is tokenized (or rendered).
    uint64_t prompt_bytes = r.prompt_text.size();
    for (const auto& m : r.messages) prompt_bytes += m.content.size();
    if (prompt_bytes > uint64_t{o_.ctx} * max_token_bytes_) {
      return send_error(ex, api_error(400,
                                      fmt::format("the prompt has {} bytes: more than the {} "
                                                  "tokens of the context (--ctx) can hold, at "
                                                  "most {} bytes a token",
                                                  prompt_bytes, o_.ctx, max_token_bytes_),
                                      chat ? "messages" : "prompt"));
    }
    auto job = std::make_shared<Job>();
    job->gen.stops = r.stops;
    std::vector<std::string> tool_texts;
    std::shared_ptr<const JsonSchema> forced_schema;
    if (chat && r.tool_choice != expertd::serve::ToolChoice::kNone) {
      if (auto e = tools_for(ex.request(), r, *job, tool_texts, forced_schema)) {
        return send_error(ex, *e);
      }
    }
    if (auto e = prompt_tokens(r, *job, tool_texts)) return send_error(ex, *e);
    const char* prompt_param = chat ? "messages" : "prompt";
    const uint64_t n = job->prompt.size();
    if (n == 0) return send_error(ex, api_error(400, "the prompt encodes to no tokens"));
    if (n >= o_.ctx) {
      return send_error(ex, api_error(400,
                                      fmt::format("the prompt has {} tokens; the context holds "
                                                  "{} (--ctx), and at least one must be left to "
                                                  "generate",
                                                  n, o_.ctx),
                                      prompt_param));
    }
    const uint32_t room = o_.ctx - static_cast<uint32_t>(n);
    if (r.max_tokens) {
      const char* param =
          chat && body.contains("max_completion_tokens") && !body["max_completion_tokens"].is_null()
              ? "max_completion_tokens"
              : "max_tokens";
      if (*r.max_tokens > room) {
        return send_error(ex, api_error(400,
                                        fmt::format("{} is {}: the context holds {} tokens and "
                                                    "the prompt has {}, leaving {}",
                                                    param, *r.max_tokens, o_.ctx, n, room),
                                        param));
      }
    }
    if (r.n > o_.queue + gen_.parallel()) {
      return send_error(
          ex, api_error(400,
                        fmt::format("n is {}: the server holds at most {} "
                                    "requests (--parallel {} running, --queue {} "
                                    "waiting), one per choice",
                                    r.n, o_.queue + gen_.parallel(), gen_.parallel(), o_.queue),
                        "n"));
    }
    job->id = next_id_.fetch_add(1) + 1;
    job->kind = chat ? "chat" : "completion";
    job->gen.sampling = r.sampling;
    job->gen.max_tokens = r.max_tokens ? static_cast<uint32_t>(*r.max_tokens)
                          : chat       ? std::min(o_.max_tokens, room)
                                       : std::min<uint32_t>(16, room);
    job->gen.stop_at_end_token = !r.ignore_eos;
    job->gen.json_schema = r.json_schema;
    if (forced_schema) job->gen.json_schema = forced_schema;
    job->gen.logprobs = r.logprobs;
    // n choices: n jobs on the same prompt (each on its own sequence, decoded together), each
    // sampling from its own seed (seed + i), so they differ unless sampling is greedy.
    Jobs jobs{job};
    for (uint32_t i = 1; i < r.n; ++i) {
      auto more = std::make_shared<Job>();
      more->id = next_id_.fetch_add(1) + 1;
      more->kind = job->kind;
      more->prompt = job->prompt;
      more->gen = job->gen;
      more->gen.sampling.seed += i;
      jobs.push_back(std::move(more));
    }
    if (!gen_.submit_all(jobs)) {
      spdlog::warn("request {}: refused, {} requests already wait (--queue)", job->id, o_.queue);
      ApiError e = api_error(503, fmt::format("the server is busy: {} requests already wait for "
                                              "the model; retry later",
                                              o_.queue));
      e.code = "queue_full";
      http::Response busy = error_response(e);
      busy.headers.emplace_back("Retry-After", "1");
      return ex.reply(std::move(busy));
    }
    const std::string id = random_id(chat ? "chatcmpl-" : "cmpl-");
    const int64_t created = std::time(nullptr);
    if (!r.stream) return answer(ex, jobs, id, created, chat);
    stream(ex, jobs, id, created, chat, r.include_usage);
  }

  // The logprobs of `items` as OpenAI gives them (null when not asked for): chat's
  // {"content": [{token, logprob, bytes, top_logprobs}]}, completions' {"tokens",
  // "token_logprobs", "top_logprobs", "text_offset"} with offsets from `offset` (the text already
  // sent).
  json logprobs_json(int32_t asked, const std::vector<expertd::text::TokenLogprob>& items,
                     bool chat, size_t offset) const {
    if (asked < 0) return nullptr;
    auto bytes = [](const std::string& t) {
      json b = json::array();
      for (const unsigned char c : t) b.push_back(static_cast<int>(c));
      return b;
    };
    if (chat) {
      json content = json::array();
      for (const auto& it : items) {
        const std::string t = tok_.decode(it.token);
        json top = json::array();
        for (const auto& [id, lp] : it.top) {
          const std::string tt = tok_.decode(id);
          top.push_back({{"token", tt}, {"logprob", lp}, {"bytes", bytes(tt)}});
        }
        content.push_back(
            {{"token", t}, {"logprob", it.logprob}, {"bytes", bytes(t)}, {"top_logprobs", top}});
      }
      return {{"content", content}};
    }
    json tokens = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
    for (const auto& it : items) {
      const std::string t = tok_.decode(it.token);
      tokens.push_back(t);
      lps.push_back(it.logprob);
      json top = json::object();
      // Two tokens whose texts read the same once invalid UTF-8 is replaced (bytes of a
      // character: U+FFFD each) share a key: the likelier one stays.
      for (const auto& [id, lp] : it.top) {
        const std::string tt =
            json::parse(json(tok_.decode(id)).dump(-1, ' ', false, json::error_handler_t::replace))
                .get<std::string>();
        if (!top.contains(tt)) top[tt] = lp;
      }
      tops.push_back(top);
      offsets.push_back(offset);
      offset += t.size();
    }
    return {{"tokens", tokens},
            {"token_logprobs", lps},
            {"top_logprobs", tops},
            {"text_offset", offsets}};
  }

  using Jobs = std::vector<std::shared_ptr<Job>>;

  // usage over a request's choices: the prompt once, every choice's tokens.
  static json usage_of(const Jobs& jobs) {
    json u = usage(*jobs[0]);
    uint32_t completion = 0;
    for (const auto& j : jobs) completion += j->completion_tokens;
    u["completion_tokens"] = completion;
    u["total_tokens"] = u["prompt_tokens"].get<uint32_t>() + completion;
    return u;
  }

  // Waits for every choice's whole answer.
  // A client that leaves meanwhile (its connection closed) cancels them all at once: the engine
  // stops them after the token in progress.
  void answer(http::Exchange& ex, const Jobs& jobs, const std::string& id, int64_t created,
              bool chat) {
    ex.on_gone([jobs] {
      for (const auto& j : jobs) {
        j->cancelled = true;
        std::lock_guard lock(j->mu);
        j->cv.notify_all();
      }
    });
    json choices = json::array();
    for (size_t i = 0; i < jobs.size(); ++i) {
      Job& job = *jobs[i];
      std::unique_lock lock(job.mu);
      job.cv.wait(lock, [&] { return job.done || ex.gone(); });
      if (!job.done) return;  // nobody to answer
      if (!job.error.empty()) {
        // Answered after the lock is let go: a write waits for the network thread, which may be
        // running this request's on_gone (it takes job.mu).
        const ApiError e = api_error(job.error_status, job.error);
        lock.unlock();
        for (const auto& other : jobs) other->cancelled = true;
        return send_error(ex, e);
      }
      json choice = {{"index", i},
                     {"logprobs", logprobs_json(job.gen.logprobs, job.logprobs_out, chat, 0)},
                     {"finish_reason", job.finish_reason}};
      if (chat) {
        choice["message"] = {{"role", "assistant"}, {"content", job.text}};
        std::string content;
        if (auto calls = tool_calls_of(job, job.text, content)) {
          choice["message"]["content"] = content.empty() ? json(nullptr) : json(content);
          choice["message"]["tool_calls"] = std::move(*calls);
          choice["finish_reason"] = "tool_calls";
        }
        // As DeepSeek's API and vLLM give it; absent when the model did not reason (or
        // reasoning_format is none).
        if (!job.reasoning_text.empty())
          choice["message"]["reasoning_content"] = job.reasoning_text;
      } else {
        choice["text"] = job.text;
      }
      choices.push_back(std::move(choice));
    }
    const json out = {
        {"id", id},           {"object", chat ? "chat.completion" : "text_completion"},
        {"created", created}, {"model", o_.model},
        {"choices", choices}, {"usage", usage_of(jobs)}};
    set_content(ex, dump(out), "application/json");
  }

  // Server-sent events: for each choice a chunk per piece of text as it is generated, then its
  // finish reason; once every choice is complete the usage when asked for, and [DONE]. A write
  // that fails (the client left) cancels every choice.
  void stream(http::Exchange& ex, const Jobs& jobs, const std::string& id, int64_t created,
              bool chat, bool include_usage) {
    struct Choice {
      bool role_sent = false;
      bool finished = false;  // its finish chunk went out
      size_t sent_bytes = 0;  // content bytes sent (completions: logprobs text_offset)
      std::string held;       // with tools: content held back (a call, or what may open one)
      bool in_calls = false;  // the content reached the template's tool call opening
    };
    struct State {
      std::vector<Choice> choices;
      std::chrono::steady_clock::time_point last_write = std::chrono::steady_clock::now();
    };
    auto state = std::make_shared<State>();
    state->choices.resize(jobs.size());
    auto chunk = [this, id, created, chat, include_usage](json choice) {
      json c = {{"id", id},
                {"object", chat ? "chat.completion.chunk" : "text_completion"},
                {"created", created},
                {"model", o_.model},
                {"choices", json::array({std::move(choice)})}};
      if (include_usage) c["usage"] = nullptr;
      return c;
    };
    // `field`: the delta's, "content" or "reasoning_content" (chat).
    auto piece_choice = [chat](size_t index, const std::string& text, json finish,
                               const char* field = "content") {
      json choice = {{"index", index}, {"logprobs", nullptr}, {"finish_reason", std::move(finish)}};
      if (chat) {
        choice["delta"] = text.empty() ? json::object() : json{{field, text}};
      } else {
        choice["text"] = text;
      }
      return choice;
    };
    auto cancel = [jobs] {
      for (const auto& j : jobs) {
        j->cancelled = true;
        std::lock_guard lock(j->mu);
        j->cv.notify_all();
      }
    };
    if (!ex.stream_begin(200, "text/event-stream",
                         {{"Cache-Control", "no-cache"}, {"X-Accel-Buffering", "no"}})) {
      return cancel();
    }
    ex.on_gone(cancel);
    bool ended = false;
    // One turn: what the choices have to say now. False: the client is gone (or all is sent).
    auto step = [&]() -> bool {
      auto send = [&](const std::string& data) {
        if (!ex.stream_write(data)) return false;
        state->last_write = std::chrono::steady_clock::now();
        return true;
      };
      auto event = [&](const json& j) { return send("data: " + dump(j) + "\n\n"); };
      auto leave = [&] {
        for (const auto& j : jobs) j->cancelled = true;
        return false;
      };
      using expertd::serve::utf8_ready;
      // Wait (a while) for the first choice still running to have something to say.
      for (size_t i = 0; i < jobs.size(); ++i) {
        if (state->choices[i].finished) continue;
        Job& job = *jobs[i];
        std::unique_lock lock(job.mu);
        job.cv.wait_for(lock, std::chrono::milliseconds(200), [&] {
          return job.done || utf8_ready(job.text) > 0 || utf8_ready(job.reasoning_text) > 0 ||
                 !job.logprobs_out.empty();
        });
        break;
      }
      bool all_done = true;
      for (size_t i = 0; i < jobs.size(); ++i) {
        Choice& c = state->choices[i];
        if (c.finished) continue;
        Job& job = *jobs[i];
        std::string piece;
        std::string thought;  // reasoning, sent before the content that came with it
        std::vector<expertd::text::TokenLogprob> lps;  // with logprobs: the tokens since
        bool done = false;
        std::string error;
        int error_status = 500;
        std::string finish_reason;
        {
          std::unique_lock lock(job.mu);
          done = job.done;
          // Each part holds its own incomplete character back.
          auto take = [done](std::string& from, std::string& to) {
            const size_t ready = done ? from.size() : utf8_ready(from);
            to = from.substr(0, ready);
            from.erase(0, ready);
          };
          take(job.text, piece);
          take(job.reasoning_text, thought);
          lps.swap(job.logprobs_out);
          error = job.error;
          error_status = job.error_status;
          finish_reason = job.finish_reason;
        }
        // With tools, content is held back from where a tool call opens (or may be opening): the
        // calls go out whole, as one delta, once the answer is complete.
        if (job.tools == Job::Tools::kForced) {
          c.held += piece;
          piece.clear();
        } else if (job.tools == Job::Tools::kParse && !c.in_calls) {
          c.held += piece;
          const auto hold = chat_->hold_for_calls(c.held, done);
          piece = c.held.substr(0, hold.ready);
          c.held.erase(0, hold.ready);
          c.in_calls = hold.call;
        } else if (job.tools == Job::Tools::kParse) {
          c.held += piece;
          piece.clear();
        }
        if (chat && !c.role_sent) {
          json choice = {{"index", i},
                         {"delta", {{"role", "assistant"}, {"content", ""}}},
                         {"logprobs", nullptr},
                         {"finish_reason", nullptr}};
          if (!event(chunk(std::move(choice)))) return leave();
          c.role_sent = true;
        }
        // The tokens' logprobs ride on the content chunk (else the reasoning's, else one of
        // their own), each token once.
        auto with_logprobs = [&](json choice) {
          if (job.gen.logprobs >= 0 && !lps.empty()) {
            choice["logprobs"] = logprobs_json(job.gen.logprobs, lps, chat, c.sent_bytes);
            lps.clear();
          }
          return choice;
        };
        if (!thought.empty() &&
            !event(chunk(piece.empty()
                             ? with_logprobs(piece_choice(i, thought, nullptr, "reasoning_content"))
                             : piece_choice(i, thought, nullptr, "reasoning_content")))) {
          return leave();
        }
        if (!piece.empty() && !event(chunk(with_logprobs(piece_choice(i, piece, nullptr))))) {
          return leave();
        }
        if (job.gen.logprobs >= 0 && !lps.empty() &&
            !event(chunk(with_logprobs(piece_choice(i, "", nullptr))))) {
          return leave();
        }
        c.sent_bytes += piece.size();
        if (!done) {
          all_done = false;
          continue;
        }
        if (!error.empty()) {
          event(expertd::serve::error_body(api_error(error_status, error)));
          leave();
          send("data: [DONE]\n\n");
          ended = true;
          return false;
        }
        if (job.tools != Job::Tools::kNone && !c.held.empty()) {
          std::string content;
          if (auto calls = tool_calls_of(job, c.held, content)) {
            for (size_t k = 0; k < calls->size(); ++k) (*calls)[k]["index"] = k;
            if (!content.empty() && !event(chunk(piece_choice(i, content, nullptr)))) {
              return leave();
            }
            json choice = {{"index", i},
                           {"delta", {{"tool_calls", std::move(*calls)}}},
                           {"logprobs", nullptr},
                           {"finish_reason", nullptr}};
            if (!event(chunk(std::move(choice)))) return leave();
            finish_reason = "tool_calls";
          } else if (!event(chunk(piece_choice(i, c.held, nullptr)))) {
            return leave();
          }
          c.held.clear();
        }
        if (!event(chunk(piece_choice(i, "", finish_reason)))) return leave();
        c.finished = true;
      }
      if (all_done) {
        if (include_usage) {
          json tail = {{"id", id},
                       {"object", chat ? "chat.completion.chunk" : "text_completion"},
                       {"created", created},
                       {"model", o_.model},
                       {"choices", json::array()}};
          {
            std::vector<std::unique_lock<std::mutex>> locks;
            for (const auto& j : jobs) locks.emplace_back(j->mu);
            tail["usage"] = usage_of(jobs);
          }
          if (!event(tail)) return leave();
        }
        if (!send("data: [DONE]\n\n")) return leave();
        ended = true;
        return false;
      }
      // Nothing to say for a while (queued, or text held for a stop string): an SSE comment,
      // so a client that has gone is noticed and its sequences freed.
      if (std::chrono::steady_clock::now() - state->last_write > std::chrono::seconds(1) &&
          !send(": waiting\n\n")) {
        return leave();
      }
      return true;
    };
    while (step()) {
    }
    if (ended) {
      ex.stream_end();
    } else {
      cancel();
    }
  }

  const Options& o_;
  const Tokenizer& tok_;
  const size_t max_token_bytes_;  // the vocabulary's longest token, in bytes
  const Result<ChatTemplate> chat_;
  Generator& gen_;
  const std::string engine_note_;
  const int64_t started_ = std::time(nullptr);
  std::atomic<uint64_t> next_id_{0};
};

int fail(const std::string& message) {
  spdlog::error("{}", message);
  return 1;
}

// What one connection to expertd gives: the model's dense weights, its tokenizer, the engine on
// the daemon's experts, the generator that runs it and the API over them. Built at start, and
// again when expertd comes back after going away. Members in order of need: the service uses
// the generator, which uses the tokenizer and the engine (on the source and the model).
struct Backend {
  Options o;  // the server's, with this model's name
  std::optional<DenseModel> model;
  std::optional<Tokenizer> tok;
  std::unique_ptr<DaemonExpertSource> source;
  std::unique_ptr<Generator> gen;
  std::unique_ptr<Service> service;
};

// `on_gone` runs (on the engine thread) when a request failed because expertd went away.
Result<std::shared_ptr<Backend>> build_backend(const Options& server, const std::string& name,
                                               std::function<void(const std::string&)> on_gone) {
  auto b = std::make_shared<Backend>();
  b->o = server;
  b->o.model = name;
  const Options& o = b->o;
  auto daemon = expertd::client::Client::connect(o.socket);
  if (!daemon) return daemon.take_error();
  // The CUDA engines read each dense matrix from the file as they upload it, so the host never
  // holds them all: under a memory cap that memory is expertd's cache.
  const DeviceChoice device = choose_device(o.cpu);
  auto model = load_dense(daemon->get(), o.model, o.gguf, device);
  if (!model) return model.take_error();
  b->model.emplace(std::move(*model));
  const ModelParams& p = b->model->params();
  const auto& meta = b->model->gguf().meta();
  auto tok = Tokenizer::from_gguf(meta);
  if (!tok) return tok.take_error();
  b->tok.emplace(std::move(*tok));
  const EndTokens end_tokens = EndTokens::from_gguf(meta);
  auto chat = ChatTemplate::from_flag(o.chat_template, meta, *b->tok);
  if (!chat) {
    // The user asked for that template: no point serving without it.
    if (!o.chat_template.empty()) return chat.take_error();
    spdlog::error("chat completions are off: {}", chat.error().message);
  } else {
    const ReasoningSyntax syntax = reasoning_syntax(chat->kind());
    spdlog::info("chat template: {} (reasoning: {}{})", chat->family(),
                 reasoning_syntax_name(syntax),
                 syntax != ReasoningSyntax::kNone && o.reasoning_format == "none"
                     ? ", returned raw: --reasoning-format none"
                     : "");
    if (!o.chat_defaults.empty()) {
      const auto ignored = chat->ignored(o.chat_defaults);
      if (!ignored.empty()) {
        spdlog::warn(
            "--chat-template-kwargs/--reasoning-effort: {} ignored: the {} template does "
            "not read it",
            fmt::join(ignored, ", "), chat->family());
      }
    }
  }

  auto source = DaemonExpertSource::attach(std::move(*daemon), o.model, *b->model, "expert-serve");
  if (!source) return source.take_error();
  b->source = std::move(*source);
  EngineOptions eo;
  eo.max_context = o.ctx;
  eo.prefetch_depth = o.lookahead;
  eo.prefetch_width = o.prefetch_width;
  eo.prefill_chunk = o.prefill_chunk;
  // --parallel sequences where the engine batches them (the registry says which), else one.
  eo.sequences = o.parallel;
  auto created =
      create_engine(*b->model, *b->source,
                    EngineSetup{eo, o.vram_experts, false, "", o.prefill_gemm, !o.no_vram_preload,
                                expertd::tools::preload_progress("expert-serve", false)},
                    device);
  if (!created) return created.take_error();
  if (!created->sequences_note.empty()) {
    spdlog::info("--parallel {}: {}", o.parallel, created->sequences_note);
  }
  std::unique_ptr<Engine> engine = std::move(created->engine);
  spdlog::info("model {}: {}, {} layers, {} experts (top-{}), dense weights {:.1f} MiB from {}{}",
               o.model, p.architecture, p.n_layer, p.n_expert, p.n_expert_used,
               static_cast<double>(b->model->dense_bytes()) / (1 << 20), b->model->path(),
               b->model->deferred() ? " (read straight into VRAM)" : "");
  spdlog::info("engine: {}; context {} tokens per sequence, {} sequence{} at once", created->note,
               o.ctx, engine->sequences(), engine->sequences() == 1 ? "" : "s");
  if (p.n_ctx_train > 0 && o.ctx > p.n_ctx_train) {
    spdlog::warn("--ctx {} is more than the model was trained for ({})", o.ctx, p.n_ctx_train);
  }
  b->gen = std::make_unique<Generator>(std::move(engine), *b->tok, end_tokens, o.queue,
                                       std::move(on_gone));
  b->service = std::make_unique<Service>(o, *b->tok, std::move(chat), *b->gen, created->note);
  return b;
}

// Whether expertd answers: a ping every 500 ms on a connection of its own, made when the
// backend was (so that a daemon restarted between two pings is noticed too: that connection is
// gone). /health reads the last answer; a failure calls `on_lost` once per connection.
class DaemonWatch {
 public:
  explicit DaemonWatch(std::function<void(const std::string&)> on_lost)
      : on_lost_(std::move(on_lost)), thread_([this] { loop(); }) {}
  ~DaemonWatch() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  // Watches `client` from now on.
  void watch(std::unique_ptr<expertd::client::Client> client) {
    std::lock_guard lock(mu_);
    client_ = std::move(client);
    last_ok_ = std::chrono::steady_clock::now();
    why_.clear();
    cv_.notify_all();
  }

  // Whether expertd answered within the last second (or so: a ping every 500 ms), else why not.
  std::optional<std::string> down(const std::string& socket) const {
    std::lock_guard lock(mu_);
    if (!why_.empty()) return why_;
    const double age =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - last_ok_).count();
    if (!client_) return fmt::format("not connected to expertd at {}", socket);
    if (age > 1.5) {
      return fmt::format("expertd at {} has not answered a ping for {:.1f} s", socket, age);
    }
    return std::nullopt;
  }

 private:
  void loop() {
    std::unique_lock lock(mu_);
    while (!stop_) {
      cv_.wait_for(lock, std::chrono::milliseconds(500));
      if (stop_ || !client_) continue;
      expertd::client::Client* c = client_.get();
      lock.unlock();
      const expertd::Status st = c->ping();
      lock.lock();
      if (client_.get() != c) continue;  // replaced meanwhile
      if (st) {
        last_ok_ = std::chrono::steady_clock::now();
        why_.clear();
        continue;
      }
      why_ = st.error().message.starts_with("expertd went away")
                 ? st.error().message
                 : "expertd went away: " + st.error().message;
      client_.reset();
      const std::string why = why_;
      lock.unlock();
      on_lost_(why);
      lock.lock();
    }
  }

  const std::function<void(const std::string&)> on_lost_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::unique_ptr<expertd::client::Client> client_;
  std::chrono::steady_clock::time_point last_ok_ = std::chrono::steady_clock::now();
  std::string why_;
  bool stop_ = false;
  std::thread thread_;
};

using Backends = std::vector<std::shared_ptr<Backend>>;

// The HTTP front, for the whole process: paths and methods, the API key, CORS, /health, the
// model list, /metrics, and each request to its model's Service (a Backend per --model; none
// while starting or reconnecting: 503 with Retry-After).
class Front {
 public:
  enum class State { Starting, Serving, Reconnecting, Draining };

  Front(const Options& o, std::string api_key, ResponseCounts& counts, const DaemonWatch& watch)
      : o_(o), api_key_(std::move(api_key)), counts_(counts), watch_(watch) {}

  void set(Backends b, State s, std::string why = "") {
    std::lock_guard lock(mu_);
    backends_ = std::move(b);
    state_ = s;
    why_ = std::move(why);
  }

  // Network thread.
  std::optional<http::Response> fast(const http::Request& req) {
    const char* allow = method_of(req.path);
    if (allow == nullptr) {
      return decorate(req, error_response(api_error(
                               404, fmt::format("{} {}: no such endpoint", req.method, req.path))));
    }
    if (req.method == "OPTIONS" && cors(req)) {
      // A CORS preflight from the allowed origin.
      http::Response r{204, "", {}, ""};
      r.headers = {{"Access-Control-Allow-Methods", std::string(allow) + ", OPTIONS"},
                   {"Access-Control-Allow-Headers", "Authorization, Content-Type"},
                   {"Access-Control-Max-Age", "600"}};
      return decorate(req, std::move(r));
    }
    if (req.method != allow) {
      http::Response r = error_response(api_error(
          405, fmt::format("{} {}: method not allowed (use {})", req.method, req.path, allow)));
      r.headers.emplace_back("Allow", allow);
      return decorate(req, std::move(r));
    }
    if (req.path == "/health") return decorate(req, health(req));
    if (!authorized(req)) {
      ApiError e = api_error(401,
                             "Incorrect or missing API key: send it as 'Authorization: Bearer "
                             "KEY' (--api-key)");
      e.code = "invalid_api_key";
      http::Response r = error_response(e);
      r.headers.emplace_back("WWW-Authenticate", "Bearer");
      return decorate(req, std::move(r));
    }
    auto [backends, unavailable] = current();
    if (backends.empty()) return decorate(req, std::move(*unavailable));
    if (req.path == "/v1/models") {
      json data = json::array();
      for (const auto& b : backends) data.push_back(b->service->model_object());
      return decorate(req, json_response({{"object", "list"}, {"data", data}}));
    }
    if (req.path.starts_with("/v1/models/")) {
      const std::string name = req.path.substr(std::string_view("/v1/models/").size());
      if (const Backend* b = find(backends, name)) {
        return decorate(req, json_response(b->service->model_object()));
      }
      return decorate(req, error_response(not_found(backends, name)));
    }
    if (req.path == "/props") {
      // The first model's, or ?model=NAME's; "models" lists them all.
      const Backend* b = backends.front().get();
      if (const auto name = req.query_value("model"); name && !name->empty()) {
        b = find(backends, std::string(*name));
        if (b == nullptr) {
          return decorate(req, error_response(not_found(backends, std::string(*name))));
        }
      }
      json props = b->service->props();
      props["models"] = names(backends);
      return decorate(req, json_response(props));
    }
    return std::nullopt;
  }

  // A worker: /metrics, and the POST endpoints, each to the Service of its body's "model" (the
  // only one when the server has one and the body names none).
  void handle(http::Exchange& ex) {
    auto [backends, unavailable] = current();
    Decorated d(ex, cors(ex.request()) ? cors_headers(ex.request()) : http::Headers{});
    if (backends.empty()) return d.reply(std::move(*unavailable));
    const http::Request& req = ex.request();
    if (req.path == "/metrics") return d.reply(metrics(backends));
    {
      json body;
      if (auto e = parse_body(req, body)) return d.reply(error_response(*e));
      const Backend* b = backends.size() == 1 ? backends.front().get() : nullptr;
      if (body.contains("model") && body["model"].is_string()) {
        b = find(backends, body["model"].get<std::string>());
        if (b == nullptr) {
          return d.reply(error_response(not_found(backends, body["model"].get<std::string>())));
        }
      } else if (b == nullptr) {
        return d.reply(
            error_response(api_error(400,
                                     fmt::format("model is required: this server serves {}",
                                                 fmt::join(names(backends), ", ")),
                                     "model")));
      }
      b->service->handle(d, body);
    }
    // A large request's memory (its body, its JSON, its tokens) goes back to the system.
    if (req.body.size() > (size_t{1} << 20)) malloc_trim(0);
  }

  void log(const http::Request* req, int status, std::string_view body) {
    counts_.count(req != nullptr ? req->path : "", status);
    if (status >= 400) {
      spdlog::info("{} {}: {} {}", req != nullptr ? req->method : "-",
                   req != nullptr ? req->path : "(refused before a request was read)", status,
                   body.substr(0, 300));
    }
  }

 private:
  // Adds the CORS headers to a worker's answers.
  class Decorated final : public http::Exchange {
   public:
    Decorated(http::Exchange& ex, http::Headers extra) : ex_(ex), extra_(std::move(extra)) {}
    const http::Request& request() const override { return ex_.request(); }
    void reply(http::Response r) override {
      r.headers.insert(r.headers.end(), extra_.begin(), extra_.end());
      ex_.reply(std::move(r));
    }
    bool stream_begin(int status, std::string type, http::Headers headers) override {
      headers.insert(headers.end(), extra_.begin(), extra_.end());
      return ex_.stream_begin(status, std::move(type), std::move(headers));
    }
    bool stream_write(std::string_view data) override { return ex_.stream_write(data); }
    void stream_end() override { ex_.stream_end(); }
    bool gone() const override { return ex_.gone(); }
    void on_gone(std::function<void()> f) override { ex_.on_gone(std::move(f)); }

   private:
    http::Exchange& ex_;
    const http::Headers extra_;
  };

  static const char* method_of(const std::string& path) {
    for (const char* p : {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}) {
      if (path == p) return "POST";
    }
    for (const char* p : {"/health", "/v1/models", "/props", "/metrics"}) {
      if (path == p) return "GET";
    }
    if (path.starts_with("/v1/models/") && path.size() > std::string_view("/v1/models/").size()) {
      return "GET";
    }
    return nullptr;
  }

  // Whether the request comes from the origin --cors-origin allows.
  bool cors(const http::Request& req) const {
    if (o_.cors_origin.empty()) return false;
    const auto origin = req.header("origin");
    return origin && (o_.cors_origin == "*" || *origin == o_.cors_origin);
  }
  http::Headers cors_headers(const http::Request& req) const {
    return {{"Access-Control-Allow-Origin", std::string(*req.header("origin"))},
            {"Vary", "Origin"}};
  }
  http::Response decorate(const http::Request& req, http::Response r) const {
    if (cors(req)) {
      for (auto& h : cors_headers(req)) r.headers.push_back(std::move(h));
    }
    return r;
  }

  bool authorized(const http::Request& req) const {
    if (api_key_.empty()) return true;
    const auto auth = req.header("authorization");
    if (!auth || auth->size() < 7 ||
        !std::equal(auth->begin(), auth->begin() + 7, "Bearer ",
                    [](char a, char b) { return std::tolower(a) == std::tolower(b); })) {
      return false;
    }
    std::string_view key = auth->substr(7);
    while (!key.empty() && key.front() == ' ') key.remove_prefix(1);
    // In constant time for keys of the same length.
    if (key.size() != api_key_.size()) return false;
    unsigned char diff = 0;
    for (size_t i = 0; i < key.size(); ++i) {
      diff |= static_cast<unsigned char>(key[i] ^ api_key_[i]);
    }
    return diff == 0;
  }

  static const char* state_name(State s) {
    switch (s) {
      case State::Starting:
        return "starting";
      case State::Serving:
        return "ok";
      case State::Reconnecting:
        return "reconnecting";
      case State::Draining:
        return "draining";
    }
    return "?";
  }

  static const Backend* find(const Backends& backends, const std::string& name) {
    for (const auto& b : backends) {
      if (b->o.model == name) return b.get();
    }
    return nullptr;
  }
  static json names(const Backends& backends) {
    json out = json::array();
    for (const auto& b : backends) out.push_back(b->o.model);
    return out;
  }
  static ApiError not_found(const Backends& backends, const std::string& name) {
    ApiError e = api_error(404,
                           fmt::format("The model '{}' does not exist (this server serves {})",
                                       name, names(backends).dump()),
                           "model");
    e.code = "model_not_found";
    return e;
  }
  // GET /metrics: Prometheus text (format 0.0.4): the answers by endpoint and status, each
  // model's counters and gauges (labelled model="NAME" when there are several), then expertd's
  // (client/prometheus.h, as `expertctl metrics` prints them) through a connection of its own;
  // expert_serve_daemon_up says whether that answered.
  http::Response metrics(const Backends& backends) const {
    MetricSet m;
    m.add("expert_serve_responses_total", "counter", "HTTP answers by endpoint and status",
          counts_.samples());
    for (const auto& b : backends) {
      b->service->metrics(m,
                          backends.size() == 1 ? "" : fmt::format("{{model=\"{}\"}}", b->o.model));
    }
    std::string daemon;
    if (auto client = expertd::client::Client::connect(o_.socket)) {
      if (auto st = (*client)->stats()) {
        if (auto text = expertd::client::prometheus_text(*st)) daemon = std::move(*text);
      }
    }
    m.add("expert_serve_daemon_up", "gauge", "whether expertd answered this scrape's stats call",
          fmt::format("expert_serve_daemon_up {}\n", daemon.empty() ? 0 : 1));
    return {200, "text/plain; version=0.0.4; charset=utf-8", {}, m.text() + daemon};
  }

  // The backends, or the 503 to answer without them.
  std::pair<Backends, std::optional<http::Response>> current() const {
    std::lock_guard lock(mu_);
    if (!backends_.empty() && state_ == State::Serving) return {backends_, std::nullopt};
    ApiError e = api_error(503, fmt::format("the server is {}{}{}; retry later",
                                            state_ == State::Starting ? "starting (loading the "
                                                                        "model)"
                                                                      : state_name(state_),
                                            why_.empty() ? "" : ": ", why_));
    e.code = "unavailable";
    http::Response r = error_response(e);
    r.headers.emplace_back("Retry-After", "1");
    return {Backends{}, std::move(r)};
  }

  // GET /health: 200 {"status": "ok", ...} while serving with expertd answering; 503 with the
  // reason when expertd is gone or (for /health?ready) the server is starting or draining.
  // Without ?ready, starting and draining are 200: the process is alive, not yet (or no longer)
  // ready.
  http::Response health(const http::Request& req) const {
    Backends backends;
    State s;
    std::string why;
    {
      std::lock_guard lock(mu_);
      backends = backends_;
      s = state_;
      why = why_;
    }
    const bool ready_asked = req.has_query_key("ready");
    std::optional<std::string> down;
    if (s == State::Serving) down = watch_.down(o_.socket);
    if (s == State::Reconnecting && why.empty()) why = "expertd went away";
    json j = {{"status", down ? "unavailable" : state_name(s)}};
    if (down) why = *down;
    if (!why.empty()) j["reason"] = why;
    if (!backends.empty() && s == State::Serving) {
      // The first model's fields; with several, each one's under "models".
      j.update(backends.front()->service->health_fields());
      if (backends.size() > 1) {
        json models = json::object();
        for (const auto& b : backends) models[b->o.model] = b->service->health_fields();
        j["models"] = models;
      }
    }
    const bool ok = s == State::Serving && !down;
    const bool alive = ok || ((s == State::Starting || s == State::Draining) && !ready_asked);
    http::Response r = json_response(j, alive ? 200 : 503);
    if (!alive) r.headers.emplace_back("Retry-After", "1");
    return r;
  }

  const Options& o_;
  const std::string api_key_;
  ResponseCounts& counts_;
  const DaemonWatch& watch_;
  mutable std::mutex mu_;
  Backends backends_;
  State state_ = State::Starting;
  std::string why_;
};

// The API key: --api-key, or the first line of --api-key-file (a systemd credential).
Result<std::string> api_key(const Options& o) {
  if (!o.api_key.empty() && !o.api_key_file.empty()) {
    return Error{EINVAL, "give --api-key or --api-key-file, not both"};
  }
  if (!o.api_key_file.empty()) {
    std::ifstream in(o.api_key_file);
    std::string key;
    if (!in || !std::getline(in, key)) {
      return Error{EINVAL, fmt::format("--api-key-file {}: cannot read it ({})", o.api_key_file,
                                       std::strerror(errno))};
    }
    while (!key.empty() && (key.back() == '\r' || key.back() == ' ')) key.pop_back();
    if (key.empty()) {
      return Error{EINVAL,
                   fmt::format("--api-key-file {}: the first line is empty", o.api_key_file)};
    }
    return key;
  }
  return o.api_key;
}

int run(const Options& o) {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  // Every thread started from here on (the client's, the engine's, the HTTP threads) inherits the
  // mask; one thread takes the signals with sigwait.
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  if (o.ctx == 0) return fail("--ctx must be at least 1");
  if (o.queue == 0) return fail("--queue must be at least 1");
  if (o.parallel == 0) return fail("--parallel must be at least 1");
  auto key = api_key(o);
  if (!key) return fail(key.error().message);

  http::Limits limits;
  limits.header_timeout = std::chrono::milliseconds(static_cast<int64_t>(o.header_timeout * 1000));
  limits.body_timeout = std::chrono::milliseconds(static_cast<int64_t>(o.body_timeout * 1000));
  limits.idle_timeout = std::chrono::milliseconds(static_cast<int64_t>(o.idle_timeout * 1000));
  limits.write_timeout = std::chrono::milliseconds(static_cast<int64_t>(o.write_timeout * 1000));
  limits.max_connections = o.max_connections;
  // A request is a prompt: far less than this even for a long context (413 past it).
  limits.body_limit = size_t{64} << 20;
  // Each request waiting for the engine holds a worker (the rest get 503 at once), and a few
  // more answer tokenize, metrics and refusals meanwhile. Reading requests holds none.
  limits.workers = o.queue + o.parallel + 8;
  // The port first: a port in use is found before the model is loaded.
  auto server = http::Server::bind(o.host, o.port, limits);
  if (!server) return fail(server.error().message);

  // The supervisor's events: a signal, or expertd gone.
  std::mutex mu;
  std::condition_variable cv;
  bool stop_asked = false;
  std::string lost;
  auto on_lost = [&](const std::string& why) {
    std::lock_guard lock(mu);
    if (lost.empty()) lost = why;
    cv.notify_all();
  };
  ResponseCounts counts;
  DaemonWatch watch(on_lost);
  Front front(o, *key, counts, watch);
  (*server)->start([&](const http::Request& r) { return front.fast(r); },
                   [&](http::Exchange& ex) { front.handle(ex); },
                   [&](const http::Request* r, int status, std::string_view body) {
                     front.log(r, status, body);
                   });

  std::thread signal_thread([&] {
    int sig = 0;
    sigwait(&signals, &sig);
    std::lock_guard lock(mu);
    if (!stop_asked) spdlog::info("{}: shutting down", strsignal(sig));
    stop_asked = true;
    cv.notify_all();
  });
  auto end = [&](int rc) {
    {
      std::lock_guard lock(mu);
      stop_asked = true;
    }
    pthread_kill(signal_thread.native_handle(), SIGTERM);  // wakes it if no signal came
    signal_thread.join();
    (*server)->stop(std::chrono::seconds(5));
    return rc;
  };
  // A backend per model, and the connection that watches the daemon beside them.
  auto connect = [&]() -> Result<Backends> {
    {
      std::lock_guard lock(mu);
      lost.clear();
    }
    auto watcher = expertd::client::Client::connect(o.socket);
    if (!watcher) return watcher.take_error();
    Backends all;
    for (const std::string& name : o.models) {
      auto b = build_backend(o, name, on_lost);
      if (!b) {
        if (o.models.size() == 1) return b.take_error();
        return Error{b.error().code, fmt::format("model {}: {}", name, b.error().message)};
      }
      all.push_back(std::move(*b));
    }
    watch.watch(std::move(*watcher));
    return all;
  };

  auto first = connect();
  if (!first) return end(fail(first.error().message));
  Backends backends = std::move(*first);
  size_t body_limit = 0;
  for (const auto& b : backends) body_limit = std::max(body_limit, b->service->body_limit());
  (*server)->set_body_limit(body_limit);
  front.set(backends, Front::State::Serving);
  spdlog::info("listening on http://{}:{} (model{} {}, queue {}, at most {} connections{})", o.host,
               o.port, o.models.size() == 1 ? "" : "s", fmt::join(o.models, ", "), o.queue,
               o.max_connections, key->empty() ? "" : ", API key required");
  for (;;) {
    std::string why;
    {
      std::unique_lock lock(mu);
      cv.wait(lock, [&] { return stop_asked || !lost.empty(); });
      if (stop_asked) break;
      why = lost;
    }
    // expertd went away: this engine cannot serve again. Answer what waits (503), free it, and
    // build another when expertd is back (socket activation restarts it).
    spdlog::warn("{}: reconnecting (for at most {} s, --reconnect-timeout)", why,
                 o.reconnect_timeout);
    front.set({}, Front::State::Reconnecting, why);
    std::vector<std::weak_ptr<Backend>> old;
    for (const auto& b : backends) {
      b->gen->stop();
      old.push_back(b);
    }
    backends.clear();
    const auto t0 = std::chrono::steady_clock::now();
    auto waited = [&] {
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    auto in_use = [&] {
      return std::any_of(old.begin(), old.end(), [](const auto& w) { return !w.expired(); });
    };
    while (in_use() && waited() < 10) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));  // requests still answering
    }
    std::string last_error;
    while (backends.empty()) {
      {
        std::unique_lock lock(mu);
        if (cv.wait_for(lock, std::chrono::milliseconds(250), [&] { return stop_asked; })) break;
      }
      if (waited() > o.reconnect_timeout) {
        return end(
            fail(fmt::format("expertd did not come back within {} s (--reconnect-timeout; "
                             "last: {}); exiting so that expert-serve is restarted",
                             o.reconnect_timeout, last_error)));
      }
      auto b = connect();
      if (!b) {
        if (b.error().message != last_error) spdlog::info("reconnecting: {}", b.error().message);
        last_error = b.error().message;
        continue;
      }
      backends = std::move(*b);
      front.set(backends, Front::State::Serving);
      spdlog::info("expertd is back after {:.1f} s: serving again", waited());
    }
    if (backends.empty()) break;  // stop asked while reconnecting
  }
  // Draining: the generation in progress stops and the queued requests are answered first, so
  // the workers waiting for them can end.
  front.set(backends, Front::State::Draining);
  for (const auto& b : backends) b->gen->stop();
  const int rc = end(0);
  front.set({}, Front::State::Draining);
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "expert-serve: an OpenAI-compatible HTTP server for a MoE model whose experts stream from "
      "expertd"};
  app.set_version_flag("--version", std::string("expert-serve ") + EXPERTD_VERSION);
  Options o;
  add_engine_flags(app, o, "The model's name in expertd (and in the API)");
  // Several models behind one port: --model again for each (a request's "model" picks one).
  app.remove_option(app.get_option("--model"));
  app.add_option("--model", o.models,
                 "The model's name in expertd (and in the API); given more than once, each is "
                 "served, the request's \"model\" field choosing (each has its own engine, "
                 "--parallel sequences and queue)")
      ->required()
      ->take_all()
      ->allow_extra_args(false);
  app.add_option("--host", o.host, "Address to listen on (127.0.0.1: this machine only)");
  app.add_option("--port", o.port, "TCP port to listen on (8080)")->check(CLI::Range(1, 65535));
  app.add_option("--ctx", o.ctx, "Context length: KV cache positions, prompt and answer (4096)")
      ->check(CLI::Range(1u, 1u << 24));
  app.add_option("--parallel", o.parallel,
                 "Requests generated at once, each on its own sequence (KV cache of --ctx "
                 "positions), decoded together so that the experts they share are read once; "
                 "engines that run one sequence at a time use 1 (4)")
      ->check(CLI::Range(1u, 256u));
  app.add_option("--queue", o.queue,
                 "Requests that may wait while --parallel run; more get 503 with Retry-After (8)")
      ->check(CLI::Range(1u, 4096u));
  const std::string gptoss(expertd::engine::family_info(expertd::engine::Family::GptOss).name);
  app.add_option("--chat-template", o.chat_template,
                 "Chat template instead of the model's own: a template's name (" +
                     expertd::text::ChatTemplate::names() + ") or a .jinja file");
  app.add_option("--reasoning-format", o.reasoning_format,
                 "auto: a chat answer's reasoning (a <think> block; " + gptoss +
                     "'s analysis channel) is returned apart, as message.reasoning_content "
                     "(streamed: delta.reasoning_content), and content is the answer alone; none: "
                     "the raw text as content. A request's \"reasoning_format\" (auto, deepseek, "
                     "none) overrides it (auto)")
      ->check(CLI::IsMember({"auto", "none"}));
  app.add_option(
      "--chat-template-kwargs", o.chat_template_kwargs,
      "Chat template switches for every chat request, as a JSON object (llama.cpp's "
      "server's flag): enable_thinking (Qwen3, GLM-4.5, DeepSeek), thinking "
      "(DeepSeek), reasoning_effort (" +
          gptoss +
          "); e.g. '{\"enable_thinking\": false}'. "
          "A request's chat_template_kwargs and reasoning_effort override it key by key");
  app.add_option("--reasoning-effort", o.reasoning_effort,
                 gptoss +
                     "'s reasoning effort for every chat request (its template's default: "
                     "medium); a request's reasoning_effort overrides it")
      ->check(CLI::IsMember({"low", "medium", "high"}));
  app.add_option("--max-tokens", o.max_tokens,
                 "A chat request's max_tokens when it gives none (llama-server's --n-predict; "
                 "vLLM would give the whole rest of the context). Completions keep OpenAI's 16. "
                 "Never more than the context leaves (2048)")
      ->check(CLI::Range(1u, 1u << 24));
  app.add_option("--api-key", o.api_key,
                 "Require 'Authorization: Bearer KEY' on every endpoint but /health (401 "
                 "otherwise). Visible in ps: prefer --api-key-file");
  app.add_option("--api-key-file", o.api_key_file,
                 "The API key from the first line of FILE (under systemd: a credential, "
                 "${CREDENTIALS_DIRECTORY}/api-key)");
  app.add_option("--cors-origin", o.cors_origin,
                 "Allow browser pages from this origin (e.g. http://localhost:3000; * for any) "
                 "to call the API: CORS headers and preflight answers. Off by default");
  app.add_option("--max-connections", o.max_connections,
                 "Connections open at once; one more gets 503 and is closed (128)")
      ->check(CLI::Range(size_t{1}, size_t{65536}));
  app.add_option("--header-timeout", o.header_timeout,
                 "Seconds a request's head (request line and headers) may take from its first "
                 "byte; then 408 and the connection closes (10)")
      ->check(CLI::Range(0.01, 3600.0));
  app.add_option("--body-timeout", o.body_timeout,
                 "Seconds a request's body may take after its head; then 408 (60)")
      ->check(CLI::Range(0.01, 3600.0));
  app.add_option("--idle-timeout", o.idle_timeout,
                 "Seconds a keep-alive connection may wait for its next request (30)")
      ->check(CLI::Range(0.01, 86400.0));
  app.add_option("--write-timeout", o.write_timeout,
                 "Seconds one write of an answer may take (a client that stops reading); then "
                 "the connection closes and its generation stops (30)")
      ->check(CLI::Range(0.01, 3600.0));
  app.add_option("--reconnect-timeout", o.reconnect_timeout,
                 "When expertd goes away: seconds to wait for it to come back (answering 503 "
                 "meanwhile) before exiting non-zero, so that the service manager restarts "
                 "expert-serve (60)")
      ->check(CLI::Range(0.0, 86400.0));
  app.add_option("--log-level", o.log_level, "trace, debug, info, warn, error (info)")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "critical", "off"}));
  app.footer(
      "Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions "
      "(\"stream\": true for server-sent events). Completions are the raw text; chat answers of "
      "reasoning models carry the reasoning as reasoning_content (see --reasoning-format), and "
      "stop strings apply to the content. docs/SERVE.md lists the fields.");
  CLI11_PARSE(app, argc, argv);
  setup_logging(o.log_level);
  // Blocks of 1 MiB and more (request bodies, their JSON, prompts) are mapped and unmapped rather
  // than kept in the heap: glibc would otherwise raise this threshold after the first large free,
  // and the memory of large requests would stay with the process (tests/chaos/serve_chaos.py,
  // big_prompts).
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  for (size_t i = 0; i < o.models.size(); ++i) {
    if (std::find(o.models.begin(), o.models.begin() + i, o.models[i]) != o.models.begin() + i) {
      return fail(fmt::format("--model {} is given twice", o.models[i]));
    }
  }
  if (o.models.size() > 1 && !o.gguf.empty()) {
    return fail(
        "--gguf names one model's file: with several --model, each model's dense "
        "weights come from the files expertd passes");
  }
  o.model = o.models.front();
  if (const expertd::Status read =
          read_chat_flags(o.chat_template_kwargs, o.reasoning_effort, o.chat_defaults);
      !read) {
    return fail(read.error().message);
  }
  return run(o);
}
