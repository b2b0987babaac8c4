// expert-serve: an OpenAI-compatible HTTP server (completions, chat completions, streaming as
// server-sent events) for a model whose routed experts come from a running expertd. The engine
// is set up as expert-run sets it up (the dense weights from the files the daemon passes, or
// --gguf; the CUDA engine when there is a device, else the CPU one); one thread owns it and runs
// one sequence at a time (generator.h), and requests wait in a bounded queue.
//
// Bound to loopback by default: the API has no authentication.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <httplib.h>
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

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(dump(expertd::serve::error_body(e)), "application/json");
}

// What httplib's own refusals mean (it writes no body for them).
const char* status_text(int status) {
  switch (status) {
    case 400:
      return "malformed HTTP request";
    case 413:
      return "the body is too large";
    case 414:
      return "the URI is too long";
    case 416:
      return "range not satisfiable";
    default:
      return "refused";
  }
}

ApiError api_error(int status, std::string message, std::string param = "") {
  ApiError e;
  e.status = status;
  e.message = std::move(message);
  e.param = std::move(param);
  if (status >= 500) e.type = "server_error";
  return e;
}

// The HTTP side: reads requests, hands jobs to the Generator and writes the answers.
class Service {
 public:
  // `chat` is the chat template, or why there is none (chat requests then get a 400 saying so).
  Service(const Options& o, const Tokenizer& tok, Result<ChatTemplate> chat, Generator& gen,
          std::string engine_note)
      : o_(o), tok_(tok), chat_(std::move(chat)), gen_(gen), engine_note_(std::move(engine_note)) {}

  // Every answer, by endpoint and status (the logger calls it).
  void count_response(const std::string& path, int status) {
    static constexpr std::string_view kPaths[] = {"/v1/completions", "/v1/chat/completions",
                                                  "/v1/models",      "/tokenize",
                                                  "/detokenize",     "/props",
                                                  "/health",         "/metrics"};
    std::string_view endpoint = "other";
    for (const std::string_view p : kPaths) {
      if (path == p || (p == "/v1/models" && path.starts_with("/v1/models/"))) endpoint = p;
    }
    std::lock_guard lock(responses_mu_);
    ++responses_[{std::string(endpoint), status}];
  }

  void install(httplib::Server& svr) {
    svr.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(dump({{"status", "ok"},
                            {"model", o_.model},
                            {"engine", engine_note_},
                            {"context", o_.ctx},
                            {"running", gen_.running()},
                            {"parallel", gen_.parallel()},
                            {"queued", gen_.queued()},
                            {"queue_limit", o_.queue},
                            {"served", gen_.served()}}),
                      "application/json");
    });
    svr.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(dump({{"object", "list"}, {"data", json::array({model_object()})}}),
                      "application/json");
    });
    svr.Get(R"(/v1/models/(.+))", [this](const httplib::Request& req, httplib::Response& res) {
      if (req.matches[1] != o_.model) {
        ApiError e = api_error(404,
                               fmt::format("The model '{}' does not exist (this server "
                                           "serves '{}')",
                                           req.matches[1].str(), o_.model),
                               "model");
        e.code = "model_not_found";
        return send_error(res, e);
      }
      res.set_content(dump(model_object()), "application/json");
    });
    svr.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
      generate(req, res, /*chat=*/false);
    });
    svr.Post("/tokenize",
             [this](const httplib::Request& req, httplib::Response& res) { tokenize(req, res); });
    svr.Post("/detokenize",
             [this](const httplib::Request& req, httplib::Response& res) { detokenize(req, res); });
    svr.Get("/props", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(dump(props()), "application/json");
    });
    svr.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(metrics(), "text/plain; version=0.0.4; charset=utf-8");
    });
    svr.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
      generate(req, res, /*chat=*/true);
    });
    // A known path asked with another method: 405 naming the one it takes.
    auto not_allowed = [](const char* allow) {
      return [allow](const httplib::Request& req, httplib::Response& res) {
        res.set_header("Allow", allow);
        send_error(res, api_error(405, fmt::format("{} {}: method not allowed (use {})", req.method,
                                                   req.path, allow)));
      };
    };
    for (const char* path :
         {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}) {
      svr.Get(path, not_allowed("POST"));
      svr.Put(path, not_allowed("POST"));
      svr.Patch(path, not_allowed("POST"));
      svr.Delete(path, not_allowed("POST"));
      svr.Options(path, not_allowed("POST"));
    }
    for (const char* path : {"/health", "/v1/models", "/props", "/metrics"}) {
      svr.Post(path, not_allowed("GET"));
      svr.Put(path, not_allowed("GET"));
      svr.Patch(path, not_allowed("GET"));
      svr.Delete(path, not_allowed("GET"));
      svr.Options(path, not_allowed("GET"));
    }
    // Answers that no handler wrote a body for (unknown paths, malformed HTTP, a body too large)
    // get OpenAI's error body too.
    svr.set_error_handler(httplib::Server::HandlerWithResponse(
        [](const httplib::Request& req, httplib::Response& res) {
          if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
          const std::string what =
              res.status == 404
                  ? fmt::format("{} {}: no such endpoint", req.method, req.path)
                  : fmt::format("{} {}: {}", req.method, req.path, status_text(res.status));
          send_error(res, api_error(res.status, what));
          return httplib::Server::HandlerResponse::Handled;
        }));
    svr.set_exception_handler(
        [](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
          std::string what = "unknown exception";
          try {
            std::rethrow_exception(ep);
          } catch (const std::exception& e) {
            what = e.what();
          } catch (...) {
          }
          spdlog::error("{} {}: {}", req.method, req.path, what);
          send_error(res, api_error(500, "internal error: " + what));
        });
  }

 private:
  json model_object() const {
    return {{"id", o_.model}, {"object", "model"}, {"created", started_}, {"owned_by", "expertd"}};
  }

  static json usage(const Job& job) {
    const uint32_t prompt = static_cast<uint32_t>(job.prompt.size());
    return {{"prompt_tokens", prompt},
            {"completion_tokens", job.completion_tokens},
            {"total_tokens", prompt + job.completion_tokens},
            {"prompt_tokens_details", {{"cached_tokens", job.cached_tokens}}}};
  }

  // The prompt's tokens into `job`, with how its answer is cut and split; or the error to answer
  // with.
  std::optional<ApiError> prompt_tokens(const expertd::serve::Request& r, Job& job) const {
    std::vector<uint32_t>& out = job.prompt;
    if (r.chat) {
      if (!chat_) return api_error(400, "chat completions are off: " + chat_.error().message);
      std::vector<ChatMessage> messages;
      for (const auto& m : r.messages) messages.push_back({m.role, m.content});
      // A switch the template does not read is ignored, as vLLM's (jinja) rendering ignores it.
      if (const auto ignored = chat_->ignored(r.chat_options); !ignored.empty()) {
        spdlog::info("chat request: {} ignored: the {} template does not read it",
                     fmt::join(ignored, ", "), chat_->family());
      }
      const ChatOptions options = o_.chat_defaults.overridden_by(r.chat_options);
      auto text = chat_->render(messages, /*add_generation_prompt=*/true, options);
      if (!text) return api_error(400, "messages: " + text.error().message, "messages");
      spdlog::debug("chat prompt: {}", dump(*text));
      // The template writes the BOS itself where the model wants one.
      auto ids = tok_.encode(*text, /*add_special=*/false);
      if (!ids) return api_error(400, "messages: " + ids.error().message, "messages");
      out = std::move(*ids);
      // The turn's end marker stops the answer where it is text rather than an end token.
      job.gen.end_strings = chat_->stop_strings();
      const std::string& format =
          r.reasoning_format.empty() ? o_.reasoning_format : r.reasoning_format;
      if (format != "none") {
        // A prompt that closed the think block (a switch turned thinking off): all content.
        job.gen.reasoning = answer_reasoning_syntax(chat_->kind(), *text);
        job.gen.starts_in_reasoning = prompt_opens_think(*text);
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

  // The body as a JSON object, or the 400 that says why not.
  static std::optional<ApiError> parse_body(const httplib::Request& req, json& body) {
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

  // POST /tokenize {"content", "add_special" (false), "with_pieces" (false)}: llama.cpp server's
  // endpoint. {"tokens": [ids]}, or [{"id", "piece"}] with pieces.
  void tokenize(const httplib::Request& req, httplib::Response& res) {
    json body;
    if (auto e = parse_body(req, body)) return send_error(res, *e);
    if (!body.contains("content") || !body["content"].is_string()) {
      return send_error(res, api_error(400, "content must be a string", "content"));
    }
    bool add_special = false;
    bool with_pieces = false;
    for (auto [name, flag] :
         {std::pair{"add_special", &add_special}, std::pair{"with_pieces", &with_pieces}}) {
      if (!body.contains(name) || body[name].is_null()) continue;
      if (!body[name].is_boolean()) {
        return send_error(res, api_error(400, fmt::format("{} must be a boolean", name), name));
      }
      *flag = body[name].get<bool>();
    }
    auto ids = tok_.encode(body["content"].get<std::string>(), add_special);
    if (!ids) return send_error(res, api_error(400, "content: " + ids.error().message, "content"));
    json tokens = json::array();
    for (const uint32_t id : *ids) {
      if (with_pieces) {
        tokens.push_back({{"id", id}, {"piece", tok_.decode(id)}});
      } else {
        tokens.push_back(id);
      }
    }
    res.set_content(dump({{"tokens", tokens}}), "application/json");
  }

  // POST /detokenize {"tokens": [ids]}: {"content": text}.
  void detokenize(const httplib::Request& req, httplib::Response& res) {
    json body;
    if (auto e = parse_body(req, body)) return send_error(res, *e);
    if (!body.contains("tokens") || !body["tokens"].is_array()) {
      return send_error(res, api_error(400, "tokens must be an array of token ids", "tokens"));
    }
    std::vector<uint32_t> ids;
    for (size_t i = 0; i < body["tokens"].size(); ++i) {
      const json& t = body["tokens"][i];
      if (!t.is_number_unsigned() || t.get<uint64_t>() >= tok_.size()) {
        return send_error(res, api_error(400,
                                         fmt::format("tokens[{}] = {} is not a token id below "
                                                     "the vocabulary's {}",
                                                     i, t.dump(), tok_.size()),
                                         "tokens"));
      }
      ids.push_back(t.get<uint32_t>());
    }
    res.set_content(dump({{"content", tok_.decode(ids)}}), "application/json");
  }

  // GET /metrics: Prometheus text (format 0.0.4): the server's own counters and gauges, then
  // expertd's (client/prometheus.h, as `expertctl metrics` prints them) through a connection of
  // its own; expert_serve_daemon_up says whether that answered.
  std::string metrics() {
    std::string out;
    auto metric = [&](std::string_view name, std::string_view type, std::string_view help,
                      const std::string& samples) {
      out += fmt::format("# HELP {} {}\n# TYPE {} {}\n{}", name, help, name, type, samples);
    };
    auto one = [](std::string_view name, double v) { return fmt::format("{} {}\n", name, v); };
    {
      std::string samples;
      std::lock_guard lock(responses_mu_);
      for (const auto& [key, n] : responses_) {
        samples += fmt::format("expert_serve_responses_total{{endpoint=\"{}\",status=\"{}\"}} {}\n",
                               key.first, key.second, n);
      }
      metric("expert_serve_responses_total", "counter", "HTTP answers by endpoint and status",
             samples);
    }
    const expertd::serve::GeneratorCounters& c = gen_.counters();
    auto load = [](const std::atomic<uint64_t>& a) {
      return static_cast<double>(a.load(std::memory_order_relaxed));
    };
    metric("expert_serve_requests_total", "counter",
           "generation requests ended (answered, failed or cancelled)",
           one("expert_serve_requests_total", load(c.requests)));
    metric("expert_serve_prompt_tokens_total", "counter", "prompt tokens of those requests",
           one("expert_serve_prompt_tokens_total", load(c.prompt_tokens)));
    metric("expert_serve_cached_prompt_tokens_total", "counter",
           "of those, reused from a sequence's KV cache (prefix reuse)",
           one("expert_serve_cached_prompt_tokens_total", load(c.cached_tokens)));
    metric("expert_serve_generated_tokens_total", "counter", "tokens sampled",
           one("expert_serve_generated_tokens_total", load(c.generated_tokens)));
    metric("expert_serve_time_to_first_token_seconds", "summary",
           "from a request's queueing to its first token",
           fmt::format("expert_serve_time_to_first_token_seconds_sum {}\n"
                       "expert_serve_time_to_first_token_seconds_count {}\n",
                       load(c.first_token_ns) / 1e9, load(c.first_tokens)));
    metric("expert_serve_decode_steps_total", "counter",
           "decode steps (one token for each generating sequence)",
           one("expert_serve_decode_steps_total", load(c.steps)));
    metric("expert_serve_decode_rows_total", "counter",
           "sequences fed by those steps (rows / steps: the batch occupancy)",
           one("expert_serve_decode_rows_total", load(c.rows)));
    metric("expert_serve_requests_running", "gauge", "requests on a sequence now",
           one("expert_serve_requests_running", static_cast<double>(gen_.running())));
    metric("expert_serve_requests_queued", "gauge", "requests waiting for a sequence",
           one("expert_serve_requests_queued", static_cast<double>(gen_.queued())));
    metric("expert_serve_sequences", "gauge", "sequences the engine holds (--parallel)",
           one("expert_serve_sequences", static_cast<double>(gen_.parallel())));
    std::string daemon;
    if (auto client = expertd::client::Client::connect(o_.socket)) {
      if (auto st = (*client)->stats()) {
        if (auto text = expertd::client::prometheus_text(*st)) daemon = std::move(*text);
      }
    }
    metric("expert_serve_daemon_up", "gauge", "whether expertd answered this scrape's stats call",
           one("expert_serve_daemon_up", daemon.empty() ? 0.0 : 1.0));
    return out + daemon;
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

  void generate(const httplib::Request& req, httplib::Response& res, bool chat) {
    json body;
    if (auto e = parse_body(req, body)) return send_error(res, *e);
    expertd::serve::Request r;
    if (auto e = expertd::serve::read_request(body, chat, o_.model, tok_.size(), r)) {
      return send_error(res, *e);
    }
    auto job = std::make_shared<Job>();
    job->gen.stops = r.stops;
    if (auto e = prompt_tokens(r, *job)) return send_error(res, *e);
    const char* prompt_param = chat ? "messages" : "prompt";
    const uint64_t n = job->prompt.size();
    if (n == 0) return send_error(res, api_error(400, "the prompt encodes to no tokens"));
    if (n >= o_.ctx) {
      return send_error(res, api_error(400,
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
        return send_error(res, api_error(400,
                                         fmt::format("{} is {}: the context holds {} tokens and "
                                                     "the prompt has {}, leaving {}",
                                                     param, *r.max_tokens, o_.ctx, n, room),
                                         param));
      }
    }
    if (r.n > o_.queue + gen_.parallel()) {
      return send_error(
          res, api_error(400,
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
                          : chat       ? room
                                       : std::min<uint32_t>(16, room);
    job->gen.stop_at_end_token = !r.ignore_eos;
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
      res.set_header("Retry-After", "1");
      ApiError e = api_error(503, fmt::format("the server is busy: {} requests already wait for "
                                              "the model; retry later",
                                              o_.queue));
      e.code = "queue_full";
      return send_error(res, e);
    }
    const std::string id = random_id(chat ? "chatcmpl-" : "cmpl-");
    const int64_t created = std::time(nullptr);
    if (!r.stream) return answer(res, jobs, id, created, chat);
    stream(res, jobs, id, created, chat, r.include_usage);
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
  void answer(httplib::Response& res, const Jobs& jobs, const std::string& id, int64_t created,
              bool chat) {
    json choices = json::array();
    for (size_t i = 0; i < jobs.size(); ++i) {
      Job& job = *jobs[i];
      std::unique_lock lock(job.mu);
      job.cv.wait(lock, [&] { return job.done; });
      if (!job.error.empty()) {
        for (const auto& other : jobs) other->cancelled = true;
        return send_error(res, api_error(job.error_status, job.error));
      }
      json choice = {{"index", i},
                     {"logprobs", logprobs_json(job.gen.logprobs, job.logprobs_out, chat, 0)},
                     {"finish_reason", job.finish_reason}};
      if (chat) {
        choice["message"] = {{"role", "assistant"}, {"content", job.text}};
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
    res.set_content(dump(out), "application/json");
  }

  // Server-sent events: for each choice a chunk per piece of text as it is generated, then its
  // finish reason; once every choice is complete the usage when asked for, and [DONE]. A write
  // that fails (the client left) cancels every choice.
  void stream(httplib::Response& res, const Jobs& jobs, const std::string& id, int64_t created,
              bool chat, bool include_usage) {
    struct Choice {
      bool role_sent = false;
      bool finished = false;  // its finish chunk went out
      size_t sent_bytes = 0;  // content bytes sent (completions: logprobs text_offset)
    };
    struct State {
      std::vector<Choice> choices;
      std::chrono::steady_clock::time_point last_write = std::chrono::steady_clock::now();
    };
    auto state = std::make_shared<State>();
    state->choices.resize(jobs.size());
    res.set_header("Cache-Control", "no-cache");
    res.set_header("X-Accel-Buffering", "no");
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
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, jobs, state, chunk, piece_choice, id, created, chat, include_usage](
            size_t, httplib::DataSink& sink) {
          auto send = [&](const std::string& data) {
            if (!sink.write(data.data(), data.size())) return false;
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
                !event(chunk(
                    piece.empty()
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
              sink.done();
              return true;
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
            sink.done();
            return true;
          }
          // Nothing to say for a while (queued, or text held for a stop string): an SSE comment,
          // so a client that has gone is noticed and its sequences freed.
          if (std::chrono::steady_clock::now() - state->last_write > std::chrono::seconds(1) &&
              !send(": waiting\n\n")) {
            return leave();
          }
          return true;
        },
        [jobs](bool success) {
          if (!success) {
            for (const auto& j : jobs) j->cancelled = true;
          }
        });
  }

  const Options& o_;
  const Tokenizer& tok_;
  const Result<ChatTemplate> chat_;
  std::mutex responses_mu_;
  std::map<std::pair<std::string, int>, uint64_t> responses_;  // by (endpoint, status)
  Generator& gen_;
  const std::string engine_note_;
  const int64_t started_ = std::time(nullptr);
  std::atomic<uint64_t> next_id_{0};
};

int fail(const std::string& message) {
  spdlog::error("{}", message);
  return 1;
}

int run(const Options& o) {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  // Every thread started from here on (the client's, the engine's, the HTTP pool) inherits the
  // mask; one thread takes the signals with sigwait.
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  if (o.ctx == 0) return fail("--ctx must be at least 1");
  if (o.queue == 0) return fail("--queue must be at least 1");
  if (o.parallel == 0) return fail("--parallel must be at least 1");
  httplib::Server svr;
  // httplib's default also sets SO_REUSEPORT, which lets a second server share the port without a
  // word: only SO_REUSEADDR (a restart may bind while old connections sit in TIME_WAIT).
  svr.set_socket_options([](socket_t sock) {
    const int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  // The port first: a port in use is found before the model is loaded.
  errno = 0;
  if (!svr.bind_to_port(o.host, o.port)) {
    return fail(fmt::format("cannot listen on {}:{}: {}", o.host, o.port,
                            errno ? std::strerror(errno) : "the address is not usable"));
  }

  auto daemon = expertd::client::Client::connect(o.socket);
  if (!daemon) return fail(daemon.error().message);
  // The CUDA engines read each dense matrix from the file as they upload it, so the host never
  // holds them all: under a memory cap that memory is expertd's cache.
  const DeviceChoice device = choose_device(o.cpu);
  auto model = load_dense(daemon->get(), o.model, o.gguf, device);
  if (!model) return fail(model.error().message);
  const ModelParams& p = model->params();
  auto tok = Tokenizer::from_gguf(model->gguf().meta());
  if (!tok) return fail(tok.error().message);
  const EndTokens end_tokens = EndTokens::from_gguf(model->gguf().meta());
  auto chat = ChatTemplate::from_flag(o.chat_template, model->gguf().meta(), *tok);
  if (!chat) {
    // The user asked for that template: no point serving without it.
    if (!o.chat_template.empty()) return fail(chat.error().message);
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

  auto source = DaemonExpertSource::attach(std::move(*daemon), o.model, *model, "expert-serve");
  if (!source) return fail(source.error().message);
  EngineOptions eo;
  eo.max_context = o.ctx;
  eo.prefetch_depth = o.lookahead;
  eo.prefetch_width = o.prefetch_width;
  eo.prefill_chunk = o.prefill_chunk;
  // --parallel sequences where the engine batches them (the registry says which), else one.
  eo.sequences = o.parallel;
  auto created =
      create_engine(*model, **source, EngineSetup{eo, o.vram_experts, false, ""}, device);
  if (!created) return fail(created.error().message);
  if (!created->sequences_note.empty()) {
    spdlog::info("--parallel {}: {}", o.parallel, created->sequences_note);
  }
  std::unique_ptr<Engine> engine = std::move(created->engine);
  const std::string engine_note = created->note;
  spdlog::info("model {}: {}, {} layers, {} experts (top-{}), dense weights {:.1f} MiB from {}{}",
               o.model, p.architecture, p.n_layer, p.n_expert, p.n_expert_used,
               static_cast<double>(model->dense_bytes()) / (1 << 20), model->path(),
               model->deferred() ? " (read straight into VRAM)" : "");
  spdlog::info("engine: {}; context {} tokens per sequence, {} sequence{} at once", engine_note,
               o.ctx, engine->sequences(), engine->sequences() == 1 ? "" : "s");
  if (p.n_ctx_train > 0 && o.ctx > p.n_ctx_train) {
    spdlog::warn("--ctx {} is more than the model was trained for ({})", o.ctx, p.n_ctx_train);
  }

  // expertd went away: this engine cannot serve again, so exit non-zero and let the service
  // manager start expert-serve again (it reconnects when expertd is back).
  std::mutex gone_mu;
  std::string daemon_gone;
  Generator gen(std::move(engine), *tok, end_tokens, o.queue, [&](const std::string& why) {
    {
      std::lock_guard lock(gone_mu);
      daemon_gone = why;
    }
    svr.stop();
  });
  Service service(o, *tok, std::move(chat), gen, engine_note);
  service.install(svr);
  // Each waiting request holds a pool thread, and so does an idle keep-alive connection for a
  // few seconds: enough more answer /health and refusals meanwhile.
  const size_t threads = o.queue + 16;
  svr.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  // A request is a prompt: far less than this even for a long context (413 past it).
  svr.set_payload_max_length(size_t{64} << 20);
  svr.set_logger([&service](const httplib::Request& req, const httplib::Response& res) {
    service.count_response(req.path, res.status);
    if (res.status >= 400) {
      spdlog::info("{} {}: {} {}", req.method, req.path, res.status, res.body.substr(0, 300));
    }
  });

  std::atomic<bool> ended{false};
  std::thread signal_thread([&] {
    int sig = 0;
    sigwait(&signals, &sig);
    if (ended) return;
    spdlog::info("{}: shutting down", strsignal(sig));
    // The generation in progress stops and the queued requests are answered first, so the HTTP
    // threads waiting for them can end.
    gen.stop();
    svr.stop();
  });
  spdlog::info("listening on http://{}:{} (model {}, queue {})", o.host, o.port, o.model, o.queue);
  const bool ok = svr.listen_after_bind();
  ended = true;
  pthread_kill(signal_thread.native_handle(), SIGTERM);  // wakes it when listening ended by itself
  signal_thread.join();
  gen.stop();
  {
    std::lock_guard lock(gone_mu);
    if (!daemon_gone.empty())
      return fail(daemon_gone + "; exiting so that expert-serve is restarted");
  }
  if (!ok) return fail(fmt::format("listening on {}:{} failed", o.host, o.port));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "expert-serve: an OpenAI-compatible HTTP server for a MoE model whose experts stream from "
      "expertd"};
  app.set_version_flag("--version", std::string("expert-serve ") + EXPERTD_VERSION);
  Options o;
  add_engine_flags(app, o, "The model's name in expertd (and in the API)");
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
  app.add_option("--log-level", o.log_level, "trace, debug, info, warn, error (info)")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "critical", "off"}));
  app.footer(
      "Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions "
      "(\"stream\": true for server-sent events). Completions are the raw text; chat answers of "
      "reasoning models carry the reasoning as reasoning_content (see --reasoning-format), and "
      "stop strings apply to the content. docs/SERVE.md lists the fields.");
  CLI11_PARSE(app, argc, argv);
  setup_logging(o.log_level);
  if (!o.chat_template_kwargs.empty()) {
    const expertd::Status read = read_chat_template_kwargs(
        o.chat_template_kwargs, "--chat-template-kwargs", o.chat_defaults);
    if (!read) return fail(read.error().message);
  }
  if (!o.reasoning_effort.empty()) {
    if (!o.chat_defaults.reasoning_effort.empty() &&
        o.chat_defaults.reasoning_effort != o.reasoning_effort) {
      return fail(
          fmt::format("--reasoning-effort {} and --chat-template-kwargs' reasoning_effort "
                      "{} differ",
                      o.reasoning_effort, o.chat_defaults.reasoning_effort));
    }
    o.chat_defaults.reasoning_effort = o.reasoning_effort;
  }
  return run(o);
}
