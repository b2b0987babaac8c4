// expert-run: generates tokens with a Qwen3-MoE or DeepSeek-V4 model whose routed experts come from
// a running expertd. The dense weights are read from the model's GGUF: through the read-only fds
// the daemon passes for the model's name, or from --gguf (the same file, checked); every expert
// byte arrives through libexpertd-client. The CUDA engine runs when this build has it and a device
// is present (else, or with --cpu, the CPU reference engine, and the output says which and why).
//
// Benchmark mode (--routing-trace): a recorded trace's expert choices replace the computed router,
// for realistic expert locality with generated weights; the output says so on every report.
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "base/clock.h"
#include "engine/cpu_engine.h"
#include "engine/daemon_expert_source.h"
#include "engine/model.h"
#include "engine/setup.h"
#include "expertd/client.h"
#include "storage/slice_map.h"
#include "text/chat_template.h"
#include "text/generation.h"
#include "text/reasoning.h"
#include "text/sampler.h"
#include "text/stop.h"
#include "text/tokenizer.h"
#include "text/vocab.h"
#include "tools/common/engine_flags.h"
#include "tools/expert-run/batch.h"
#include "trace/trace.h"
#ifdef EXPERTD_HAVE_CUDA
#include "engine/gpu_engine.h"
#endif

namespace {

using expertd::Error;
using expertd::Result;
using expertd::Status;
using namespace expertd::engine;
using namespace expertd::text;

struct Options : expertd::tools::EngineFlags {
  std::string prompt_tokens;
  std::string prompt_text;    // --prompt
  std::string prompt_file;    // --prompt-file
  bool chat = false;          // the prompt text is one user message, through the chat template
  std::string system;         // --system: a system message before it
  std::string chat_template;  // --chat-template: a family name or a .jinja file
  std::string chat_template_kwargs;  // --chat-template-kwargs: the template's thinking switches
  std::string reasoning_effort;      // --reasoning-effort
  uint32_t max_tokens = 16;
  std::string tiers = "independent";
  std::string vram_policy;
  float temperature = 0.0f;
  float top_p = 1.0f;
  uint64_t seed = 0;
  int32_t top_k = 0;
  float min_p = 0.0f;
  float repeat_penalty = 1.0f;
  int32_t repeat_last_n = 64;
  std::vector<std::string> stop;
  bool ignore_eos = false;
  std::string record_trace;
  std::string routing_trace;
  std::string hints;  // router | trace; default: trace with --routing-trace, else router
  bool json = false;
  bool no_hash_hints = false;
  std::string feed_tokens;    // --feed-tokens SPEC
  std::string batch_prompts;  // --batch-prompts FILE
  bool batch_every = false;   // --batch-every-step
  bool max_tokens_given = false;
};

// --feed-tokens: the ids decoded in order, and what they are ("random:16:1", "file ids.txt").
struct FeedTokens {
  std::vector<uint32_t> ids;
  std::string source;
};

constexpr uint32_t kMaxFeedTokens = 1u << 20;

// SPEC is random:N[:SEED] (glibc's rand() % n_vocab after srand(SEED), SEED 1 by default: the
// sequence llama-bench's tg draws, whose rand() is never seeded) or a file of ids separated by
// commas or white space. Errors name the spec, or the file, the id's place in it and its value.
Result<FeedTokens> parse_feed(const std::string& spec, uint32_t n_vocab) {
  FeedTokens f;
  if (spec.starts_with("random:")) {
    const std::string rest = spec.substr(7);
    const size_t colon = rest.find(':');
    const std::string n_text = rest.substr(0, colon);
    const std::string seed_text = colon == std::string::npos ? "1" : rest.substr(colon + 1);
    uint32_t n = 0;
    uint32_t seed = 0;
    auto whole = [](const std::string& t, uint32_t& v) {
      const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
      return !t.empty() && ec == std::errc() && end == t.data() + t.size();
    };
    if (!whole(n_text, n) || n == 0 || n > kMaxFeedTokens || !whole(seed_text, seed)) {
      return expertd::make_error(
          EINVAL, fmt::format("--feed-tokens '{}': random:N[:SEED] needs N in 1..{} and SEED a "
                              "whole number (e.g. random:16 or random:64:7)",
                              spec, kMaxFeedTokens));
    }
    std::srand(seed);
    for (uint32_t i = 0; i < n; ++i) f.ids.push_back(static_cast<uint32_t>(std::rand()) % n_vocab);
    f.source = fmt::format("random:{}:{}", n, seed);
    return f;
  }
  std::ifstream in(spec, std::ios::binary);
  if (!in) {
    return expertd::make_error(
        errno ? errno : ENOENT,
        fmt::format("--feed-tokens {}: {} (give random:N[:SEED] or a file of token ids)", spec,
                    std::strerror(errno ? errno : ENOENT)));
  }
  std::string item;
  uint32_t line = 1;
  uint32_t item_line = 1;
  auto flush = [&]() -> expertd::Status {
    if (item.empty()) return expertd::Ok{};
    uint32_t v = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    if (ec != std::errc() || end != item.data() + item.size()) {
      return expertd::make_error(
          EINVAL, fmt::format("--feed-tokens {}: id {} (line {}) is '{}', not a token id", spec,
                              f.ids.size() + 1, item_line, item.substr(0, 32)));
    }
    if (v >= n_vocab) {
      return expertd::make_error(
          EINVAL, fmt::format("--feed-tokens {}: id {} (line {}) is {}, outside the model's "
                              "vocabulary of {}",
                              spec, f.ids.size() + 1, item_line, v, n_vocab));
    }
    if (f.ids.size() == kMaxFeedTokens) {
      return expertd::make_error(
          EINVAL, fmt::format("--feed-tokens {}: more than {} ids", spec, kMaxFeedTokens));
    }
    f.ids.push_back(v);
    item.clear();
    return expertd::Ok{};
  };
  char c = 0;
  while (in.get(c)) {
    if (c == ',' || c == ' ' || c == '\t' || c == '\r' || c == '\n') {
      EXPERTD_TRY(flush());
      if (c == '\n') ++line;
      continue;
    }
    if (item.empty()) item_line = line;
    if (item.size() < 64) item.push_back(c);
  }
  EXPERTD_TRY(flush());
  if (f.ids.empty()) {
    return expertd::make_error(EINVAL, fmt::format("--feed-tokens {}: no token ids in it", spec));
  }
  f.source = "file " + spec;
  return f;
}

Result<std::vector<uint32_t>> parse_tokens(const std::string& text) {
  std::vector<uint32_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    uint32_t v = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    if (item.empty() || ec != std::errc() || end != item.data() + item.size()) {
      return expertd::make_error(EINVAL,
                                 fmt::format("--prompt-tokens: '{}' is not a token id", item));
    }
    out.push_back(v);
  }
  if (out.empty()) return expertd::make_error(EINVAL, "--prompt-tokens: no tokens");
  return out;
}

// The daemon's counters for one model (zeros when the model is not listed).
expertd::client::ModelStats model_stats(expertd::client::Client& client, const std::string& model) {
  auto stats = client.stats();
  if (stats) {
    for (const auto& m : stats->models) {
      if (m.name == model) return m;
    }
  }
  return {};
}

expertd::client::SchedulerStats model_counters(expertd::client::Client& client,
                                               const std::string& model) {
  return model_stats(client, model).scheduler;
}

// The disk's queue over a window, from two of the daemon's readDepthNs lists: the fraction of
// the window's wall time with reads in flight, the mean number in flight while there were any,
// and the most at once.
struct QueueWindow {
  double busy_fraction = 0;
  double mean_in_flight = 0;
  uint32_t max_in_flight = 0;
};

QueueWindow queue_window(const std::vector<uint64_t>& before, const std::vector<uint64_t>& after,
                         uint64_t wall_ns) {
  QueueWindow w;
  uint64_t busy_ns = 0;
  double weighted = 0;
  for (size_t i = 1; i < after.size(); ++i) {
    const uint64_t d = after[i] - (i < before.size() ? std::min(before[i], after[i]) : 0);
    if (d == 0) continue;
    busy_ns += d;
    weighted += static_cast<double>(i) * static_cast<double>(d);
    w.max_in_flight = static_cast<uint32_t>(i);
  }
  if (busy_ns > 0) w.mean_in_flight = weighted / static_cast<double>(busy_ns);
  if (wall_ns > 0) {
    w.busy_fraction = std::min(1.0, static_cast<double>(busy_ns) / static_cast<double>(wall_ns));
  }
  return w;
}

// The daemon's prefetch state for one model after the run: the depth auto chose, the disk-busy
// fraction it measured and the precision it asks of a depth (a benchmark reports what auto did).
nlohmann::json daemon_prefetch_state(expertd::client::Client& client, const std::string& model) {
  auto stats = client.stats();
  if (stats) {
    for (const auto& m : stats->models) {
      if (m.name == model) {
        return {{"prefetch_depth_now", m.prefetch_depth_now},
                {"disk_busy", m.disk_busy},
                {"prefetch_auto_need", m.prefetch_auto_need}};
      }
    }
  }
  return nlohmann::json::object();
}

double seconds(uint64_t ns) { return static_cast<double>(ns) / 1e9; }

// A trace's routes by position: the trace's i-th distinct token is position i.
Result<RoutingScript> load_script(const std::string& path, const ModelParams& p) {
  EXPERTD_TRY_ASSIGN(const expertd::Trace trace, expertd::load_trace(path));
  if (trace.layers > p.n_layer || trace.experts > p.n_expert) {
    return expertd::make_error(
        EINVAL, fmt::format("{}: the trace has {} layers and {} experts; the model has {} and {}",
                            path, trace.layers, trace.experts, p.n_layer, p.n_expert));
  }
  RoutingScript script(trace.tokens, p.n_layer);
  uint32_t pos = 0;
  bool first = true;
  uint32_t last_token = 0;
  for (const expertd::TraceRecord& r : trace.records) {
    if (!first && r.token != last_token) ++pos;
    first = false;
    last_token = r.token;
    ScriptedRoute route{r.experts, r.weights, r.predicted};
    if (auto st = script.set(pos, r.layer, std::move(route), p); !st) {
      return expertd::make_error(EINVAL, fmt::format("{}: {}", path, st.error().message));
    }
  }
  return script;
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t i = static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

int fail(const Error& e) {
  std::fprintf(stderr, "expert-run: %s\n", e.message.c_str());
  return 1;
}

// The flag that sets each SamplerOptions field, for validate()'s errors.
std::string with_flag_names(std::string message) {
  static const std::pair<const char*, const char*> names[] = {
      {"temperature", "--temperature"},
      {"top_p", "--top-p"},
      {"top_k", "--top-k"},
      {"min_p", "--min-p"},
      {"repeat_penalty", "--repeat-penalty"},
      {"repeat_last_n", "--repeat-last-n"}};
  for (const auto& [field, flag] : names) {
    if (message.starts_with(field) && message.size() > std::strlen(field) &&
        message[std::strlen(field)] == ' ') {
      return std::string(flag) + message.substr(std::strlen(field));
    }
  }
  return message;
}

int run(Options o) {
  const SamplerOptions so{o.temperature, o.top_p,          o.seed,         o.top_k,
                          o.min_p,       o.repeat_penalty, o.repeat_last_n};
  if (auto st = validate(so); !st) return fail(Error{EINVAL, with_flag_names(st.error().message)});
  auto stops = StopMatcher::create(o.stop);
  if (!stops) return fail(Error{EINVAL, "--" + stops.error().message});
  const int prompt_flags =
      !o.prompt_tokens.empty() + !o.prompt_text.empty() + !o.prompt_file.empty();
  const bool feeding = !o.feed_tokens.empty();
  if (prompt_flags > 1 || (prompt_flags == 0 && !feeding)) {
    return fail(Error{EINVAL, feeding ? "give at most one of --prompt, --prompt-file and "
                                        "--prompt-tokens with --feed-tokens"
                                      : "give exactly one of --prompt, --prompt-file and "
                                        "--prompt-tokens (or --feed-tokens)"});
  }
  if (feeding && (o.max_tokens_given || !o.routing_trace.empty() || o.chat)) {
    return fail(Error{EINVAL,
                      "--feed-tokens decodes the given ids instead of generating: it "
                      "takes no --max-tokens, --routing-trace or --chat"});
  }
  if (!o.prompt_file.empty()) {
    std::ifstream f(o.prompt_file, std::ios::binary);
    if (!f) {
      return fail(
          Error{errno, fmt::format("--prompt-file {}: {}", o.prompt_file, std::strerror(errno))});
    }
    o.prompt_text.assign(std::istreambuf_iterator<char>(f), {});
    if (o.prompt_text.empty()) {
      return fail(Error{EINVAL, fmt::format("--prompt-file {} is empty", o.prompt_file)});
    }
  }
  if (o.chat && o.prompt_text.empty()) {
    return fail(Error{EINVAL, "--chat needs --prompt or --prompt-file"});
  }
  if (!o.chat && (!o.system.empty() || !o.chat_template.empty() ||
                  !o.chat_template_kwargs.empty() || !o.reasoning_effort.empty())) {
    return fail(Error{EINVAL,
                      "--system, --chat-template, --chat-template-kwargs and --reasoning-effort "
                      "need --chat"});
  }
  ChatOptions chat_options;
  if (auto read = read_chat_flags(o.chat_template_kwargs, o.reasoning_effort, chat_options);
      !read) {
    return fail(read.error());
  }
  // --chat: how the answer carries reasoning (set once the prompt is rendered).
  ReasoningSyntax reasoning = ReasoningSyntax::kNone;
  bool starts_in_reasoning = false;
  bool reasoning_model =
      false;  // the template's family has a reasoning syntax (thinking on or off)
  std::vector<std::string> end_strings;  // --chat: the template's turn-end texts
  // Text is tokenised once the model (its vocabulary) is loaded; ids are checked now.
  std::vector<uint32_t> prompt_ids;
  const std::vector<uint32_t>* prompt = &prompt_ids;
  if (!o.prompt_tokens.empty()) {
    auto ids = parse_tokens(o.prompt_tokens);
    if (!ids) return fail(ids.error());
    prompt_ids = std::move(*ids);
  }
  // Without --gguf the daemon passes the model's files, and the same connection attaches later.
  // With it, the model and the options are checked before expertd is asked for anything.
  Result<std::unique_ptr<expertd::client::Client>> daemon(nullptr);
  if (o.gguf.empty()) {
    daemon = expertd::client::Client::connect(o.socket);
    if (!daemon) return fail(daemon.error());
  }
  // The CUDA engines read each dense matrix from the file as they upload it, so the host never
  // holds them all: under a memory cap that memory is expertd's cache.
  const DeviceChoice device = choose_device(o.cpu);
  auto model = load_dense(daemon->get(), o.model, o.gguf, device);
  if (!model) return fail(model.error());
  const ModelParams& p = model->params();
  if (!o.prompt_text.empty()) {
    auto tok = Tokenizer::from_gguf(model->gguf().meta());
    if (!tok) return fail(tok.error());  // names the file
    std::string text = o.prompt_text;
    if (o.chat) {
      auto tmpl = ChatTemplate::from_flag(o.chat_template, model->gguf().meta(), *tok);
      if (!tmpl) return fail(tmpl.error());
      std::vector<ChatMessage> messages;
      if (!o.system.empty()) messages.push_back({"system", o.system});
      messages.push_back({"user", o.prompt_text});
      // A switch the template does not read is ignored, as the template itself would.
      for (const std::string& name : tmpl->ignored(chat_options)) {
        std::fprintf(stderr, "expert-run: %s ignored: the %s template does not read it\n",
                     name.c_str(), tmpl->family().c_str());
      }
      auto rendered = tmpl->render(messages, /*add_generation_prompt=*/true, chat_options);
      if (!rendered)
        return fail(Error{rendered.error().code, "--chat: " + rendered.error().message});
      text = std::move(*rendered);
      reasoning = answer_reasoning_syntax(tmpl->kind(), text);
      reasoning_model = reasoning_syntax(tmpl->kind()) != ReasoningSyntax::kNone;
      starts_in_reasoning = prompt_opens_think(text);
      // The turn's end marker ends the answer where it is text rather than an end token.
      end_strings = tmpl->stop_strings();
      if (!o.json) std::printf("expert-run: chat template %s\n", tmpl->family().c_str());
    }
    // The template writes the BOS itself where the model wants one (apply_chat_template's way).
    auto ids = tok->encode(text, /*add_special=*/!o.chat);
    if (!ids) return fail(Error{ids.error().code, "--prompt: " + ids.error().message});
    if (ids->empty()) return fail(Error{EINVAL, "--prompt: the text encodes to no tokens"});
    prompt_ids = std::move(*ids);
  }
  // A text prompt's answer streams to the terminal as it is generated.
  const bool stream = !o.json && !o.prompt_text.empty() && !feeding;
  FeedTokens feed;
  if (feeding) {
    auto f = parse_feed(o.feed_tokens, p.n_vocab);
    if (!f) return fail(f.error());
    feed = std::move(*f);
  }

  std::optional<RoutingScript> script;
  if (!o.routing_trace.empty()) {
    auto s = load_script(o.routing_trace, p);
    if (!s) return fail(s.error());
    script = std::move(*s);
    if (prompt->size() >= script->tokens()) {
      return fail(Error{EINVAL, fmt::format("--routing-trace {} has {} tokens; the prompt alone "
                                            "has {}",
                                            o.routing_trace, script->tokens(), prompt->size())});
    }
    o.max_tokens =
        std::min<uint32_t>(o.max_tokens, script->tokens() - static_cast<uint32_t>(prompt->size()));
  }
  if (o.hints.empty()) o.hints = script ? "trace" : "router";
  if (o.hints != "router" && o.hints != "trace") {
    return fail(Error{EINVAL, fmt::format("--hints: '{}' is not router or trace", o.hints)});
  }
  if (o.hints == "trace" && !script) {
    return fail(Error{EINVAL, "--hints trace needs --routing-trace"});
  }

  if (!o.gguf.empty()) {
    daemon = expertd::client::Client::connect(o.socket);
    if (!daemon) return fail(daemon.error());
  }
  auto source = DaemonExpertSource::attach(std::move(*daemon), o.model, *model, "expert-run");
  if (!source) return fail(source.error());
  expertd::client::Client& client = *(*source)->client();
  EngineOptions eo;
  // Fed ids start from an empty context (the prompt's KV cache is dropped first).
  eo.max_context = feeding ? std::max(static_cast<uint32_t>(prompt->size()),
                                      static_cast<uint32_t>(feed.ids.size()))
                           : static_cast<uint32_t>(prompt->size()) + o.max_tokens;
  eo.prefetch_depth = o.lookahead;
  eo.prefetch_width = o.prefetch_width;
  eo.script = script ? &*script : nullptr;
  eo.hints = o.hints == "trace" ? HintSource::Script : HintSource::Router;
  eo.hash_hints = !o.no_hash_hints;
  eo.prefill_chunk = o.prefill_chunk;

  auto created = create_engine(
      *model, **source,
      EngineSetup{eo, o.vram_experts, o.tiers == "coordinated", o.vram_policy, o.prefill_gemm,
                  !o.no_vram_preload, expertd::tools::preload_progress("expert-run", o.json)},
      device);
  if (!created) return fail(created.error());
  std::unique_ptr<Engine> engine = std::move(created->engine);
  const std::string engine_note = created->note;
  const std::string mode_note =
      script ? fmt::format(
                   "BENCHMARK MODE: routing replayed from {} (not the model's router); "
                   "hints from {}",
                   o.routing_trace,
                   o.hints == "router"
                       ? "the model's routers"
                       : (script->has_predictions() ? "the trace's predicted lists"
                                                    : "the trace's own future (oracle)"))
             : std::string();

  std::vector<RoutingRecord> log;
  if (!o.record_trace.empty()) engine->set_routing_log(&log);
  // Token text: the model's tokenizer, as expert-serve decodes it (SentencePiece byte tokens as
  // their bytes); the vocabulary's stored pieces only when the file's tokenizer cannot be built.
  std::optional<Tokenizer> tokenizer;
  if (auto t = Tokenizer::from_gguf(model->gguf().meta())) tokenizer.emplace(std::move(*t));
  const std::optional<Vocab> pieces = tokenizer ? std::nullopt : Vocab::from_gguf(model->gguf());
  const bool vocab = tokenizer.has_value() || pieces.has_value();
  auto token_text = [&](uint32_t t) {
    return tokenizer ? tokenizer->decode(t) : pieces->decode(t);
  };
  if (!o.stop.empty() && !vocab) {
    return fail(Error{EINVAL, fmt::format("--stop needs the model's vocabulary, and {} has no "
                                          "tokenizer.ggml.tokens",
                                          model->path())});
  }
  // A benchmark runs its full length; otherwise generation stops at an end token (EOS, EOT, EOM).
  const EndTokens end_tokens = EndTokens::from_gguf(model->gguf().meta());
  const bool stop_at_end = !script && !o.ignore_eos;

  if (!o.json) {
    std::printf("expert-run: %s\n", engine_note.c_str());
    if (!mode_note.empty()) std::printf("expert-run: %s\n", mode_note.c_str());
    std::printf("model %s: %s, %u layers, %u experts (top-%u), dense weights %.1f MiB from %s%s\n",
                o.model.c_str(), p.architecture.c_str(), p.n_layer, p.n_expert, p.n_expert_used,
                static_cast<double>(model->dense_bytes()) / (1 << 20), model->path().c_str(),
                model->deferred() ? " (read straight into VRAM)" : "");
    if (p.is_ds4()) {
      std::printf("%s: %u hash layers (%s), hc_mult %u\n", p.architecture.c_str(),
                  p.ds4.hash_layers,
                  o.no_hash_hints ? "their experts are not hinted"
                                  : "their experts are hinted exactly when the token is known",
                  p.ds4.hc);
    }
  }
  if (!o.json && p.nextn_layers > 0) {
    std::printf(
        "%s: the file's %u MTP (next-n) layer%s skipped: expert-run decodes one token per "
        "step\n",
        p.architecture.c_str(), p.nextn_layers, p.nextn_layers == 1 ? " is" : "s are");
  }

  std::fflush(stdout);  // the header before any progress line on stderr
  const auto before = model_counters(client, o.model);
  std::vector<float> logits(p.n_vocab);
  // The answer: expert-serve's generation (text/generation.h), the same stages in the same order.
  GenerationOptions go;
  go.sampling = so;
  go.end_strings = end_strings;
  go.stops = o.stop;
  go.reasoning = reasoning;
  go.starts_in_reasoning = starts_in_reasoning;
  go.max_tokens = o.max_tokens;
  go.stop_at_end_token = stop_at_end;
  std::function<std::string(uint32_t)> text_of;
  if (vocab) text_of = token_text;
  auto gen = Generation::create(go, p.n_vocab, text_of, end_tokens, *prompt);
  if (!gen) return fail(gen.error());
  std::vector<double> stall_ms_each;  // per generated token
  // A progress line for long benchmark runs, on a terminal only.
  const bool progress = !o.json && script && isatty(STDERR_FILENO) == 1;
  const auto t0 = expertd::monotonic_ns();
  {
    // One prefill() call per chunk, so a long prompt shows its progress on a terminal.
    const bool show = !o.json && isatty(STDERR_FILENO) == 1 && prompt->size() > o.prefill_chunk;
    const std::span<const uint32_t> all(*prompt);
    for (size_t done = 0; done < all.size();) {
      const size_t n = std::min<size_t>(o.prefill_chunk, all.size() - done);
      if (auto st = engine->prefill(all.subspan(done, n), logits); !st) return fail(st.error());
      done += n;
      if (show) {
        std::fprintf(stderr, "\rexpert-run: prompt %zu/%zu tokens, %.1f s", done, all.size(),
                     static_cast<double>(expertd::monotonic_ns() - t0) / 1e9);
      }
    }
    if (show) std::fprintf(stderr, "\r\033[K");
  }
  // Fed ids decode from an empty context, as llama-bench's tg runs after its pp test.
  if (feeding) engine->reset();
  const auto t1 = expertd::monotonic_ns();
  const EngineStats at_prompt = engine->stats();
  const auto mid_model = model_stats(client, o.model);
  const auto& mid = mid_model.scheduler;
  // The text shown: without a reasoning syntax the content (cut at --stop); with one the raw
  // text (cut at the template's turn end), and apart from it the reasoning and the content.
  std::string text;
  // --chat with a reasoning model: streamed, the reasoning goes to stderr and the answer to stdout.
  std::string reasoning_text, content_text;
  bool reasoning_line_ended = false;
  auto split = [&](const Generation& g) {
    const ReasoningSplitter::Step s{g.reasoning_delta(), g.content_delta()};
    text.append(reasoning == ReasoningSyntax::kNone ? g.content_delta() : g.raw_delta());
    reasoning_text.append(s.reasoning);
    content_text.append(s.content);
    if (!stream) return;
    if (!s.reasoning.empty()) {
      std::fwrite(s.reasoning.data(), 1, s.reasoning.size(), stderr);
      std::fflush(stderr);
    }
    if (!s.content.empty()) {
      // The reasoning's line ends where the answer starts (a terminal shows both streams).
      if (!reasoning_text.empty() && !reasoning_line_ended) {
        std::fputc('\n', stderr);
        reasoning_line_ended = true;
      }
      std::fwrite(s.content.data(), 1, s.content.size(), stdout);
      std::fflush(stdout);
    }
  };
  const char* stop_reason = feeding ? "fed" : "max_tokens";
  // --feed-tokens: every id through decode() in turn (router lookahead, hints, the VRAM tier),
  // its logits computed and left unread.
  for (size_t i = 0; i < feed.ids.size(); ++i) {
    const uint64_t stall0 = engine->stats().stall_ns;
    if (auto st = engine->decode(feed.ids[i], logits); !st) return fail(st.error());
    stall_ms_each.push_back(static_cast<double>(engine->stats().stall_ns - stall0) / 1e6);
    if (!o.json && isatty(STDERR_FILENO) == 1 && (i + 1) % 8 == 0) {
      std::fprintf(stderr, "\rexpert-run: fed %zu/%zu tokens", i + 1, feed.ids.size());
    }
  }
  if (feeding && !o.json && isatty(STDERR_FILENO) == 1) std::fprintf(stderr, "\r\033[K");
  while (!feeding) {
    const std::optional<uint32_t> next = (*gen)->advance(logits);
    split(**gen);
    if (!next) break;
    const uint64_t stall0 = engine->stats().stall_ns;
    if (auto st = engine->decode(*next, logits); !st) return fail(st.error());
    stall_ms_each.push_back(static_cast<double>(engine->stats().stall_ns - stall0) / 1e6);
    if (progress && (*gen)->generated() % 8 == 0) {
      std::fprintf(stderr, "\rexpert-run: token %u/%u", (*gen)->generated(), o.max_tokens);
    }
  }
  if (progress) std::fprintf(stderr, "\r\033[K");
  if (!feeding) {
    (*gen)->finish();  // what the stages held back
    split(**gen);
    if (*(*gen)->stop_reason() != '\0') stop_reason = (*gen)->stop_reason();
  }
  const std::vector<uint32_t>& generated = (*gen)->tokens();
  const auto t2 = expertd::monotonic_ns();
  const auto after_model = model_stats(client, o.model);
  const auto& after = after_model.scheduler;
  if (!o.record_trace.empty()) {
    if (auto st = write_routing_jsonl(o.record_trace, log); !st) return fail(st.error());
  }

  const EngineStats& s = engine->stats();
  const double decode_s = seconds(t2 - t1);
  // Generated tokens over the time after the prompt: the first comes from the prompt's logits.
  // Fed tokens: each is one decode step.
  const size_t decoded = feeding ? feed.ids.size() : generated.size();
  const double tokens_per_s = decode_s > 0 ? static_cast<double>(decoded) / decode_s : 0.0;
  const double prompt_tokens_per_s = seconds(t1 - t0) > 0 ? prompt->size() / seconds(t1 - t0) : 0;
  const double stall_ms = s.tokens ? static_cast<double>(s.stall_ns) / 1e6 / s.tokens : 0.0;
  const uint64_t gen_steps = s.tokens - at_prompt.tokens;
  const double gen_stall_ms =
      gen_steps ? static_cast<double>(s.stall_ns - at_prompt.stall_ns) / 1e6 / gen_steps : 0.0;
  const double gen_decode_ms =
      gen_steps ? static_cast<double>(s.decode_ns - at_prompt.decode_ns) / 1e6 / gen_steps : 0.0;
  const double gpu_wait_ms =
      gen_steps ? static_cast<double>(s.sync_ns - at_prompt.sync_ns) / 1e6 / gen_steps : 0.0;
  const double bytes_per_token =
      gen_steps ? static_cast<double>(after.bytes_read - mid.bytes_read) / gen_steps : 0.0;
  // The VRAM tier's prefetch acquires are daemon hits too; the tiers count routed experts only.
  const uint64_t daemon_hits = after.hits - before.hits;
  const uint64_t host = daemon_hits - std::min(daemon_hits, s.vram_prefetches);
  const uint64_t coalesced = after.coalesced - before.coalesced;
  const uint64_t disk = (after.misses - before.misses) + coalesced;
  const double copy_gbps =
      s.copy_ns ? static_cast<double>(s.demand_copy_bytes) / static_cast<double>(s.copy_ns) : 0.0;
  const double tiers_mean =
      s.tiers_samples ? static_cast<double>(s.tiers_distinct_sum) / s.tiers_samples : 0.0;
  // Per-token figures of the prompt (none with --feed-tokens alone).
  const double prompt_n = static_cast<double>(std::max<size_t>(prompt->size(), 1));
  // The prompt's reads against the experts its chunks acquired (each once per chunk): 1.0 when
  // every acquired expert was read once, above it when hinted experts were evicted before their
  // acquire and read again, below it when some were in a cache already. Priced at the mean
  // expert's bytes (every layer's experts are one size in the families run today).
  double expert_bytes = 0.0;
  if (const auto map = expertd::SliceMap::build(model->gguf());
      map && !map->layers().empty() && map->expert_count() > 0) {
    expert_bytes = static_cast<double>(map->total_expert_bytes()) /
                   (static_cast<double>(map->layers().size()) * map->expert_count());
  }
  const double acquired_bytes = expert_bytes * static_cast<double>(at_prompt.prefill_experts);
  // The feed's window alone: the routed experts found in each tier and the disk's queue.
  const uint64_t window_hits = after.hits - mid.hits;
  const uint64_t window_vram_prefetches = s.vram_prefetches - at_prompt.vram_prefetches;
  const uint64_t window_host = window_hits - std::min(window_hits, window_vram_prefetches);
  const uint64_t window_disk = (after.misses - mid.misses) + (after.coalesced - mid.coalesced);
  const QueueWindow queue =
      queue_window(mid_model.read_depth_ns, after_model.read_depth_ns, t2 - t1);

  nlohmann::json by_depth = nlohmann::json::array();
  for (size_t d = 0; d < s.by_depth.size(); ++d) {
    const DepthStats& ds = s.by_depth[d];
    by_depth.push_back({{"depth", d + 1},
                        {"predicted", ds.predicted},
                        {"correct", ds.correct},
                        {"routed", ds.routed},
                        {"precision", ds.precision()},
                        {"recall", ds.recall()}});
  }
  if (o.json) {
    nlohmann::json j = {
        {"engine", engine->name()},
        {"engine_note", engine_note},
        {"benchmark_mode", static_cast<bool>(script)},
        {"model", o.model},
        {"prompt_tokens", *prompt},
        {"generated", generated},
        {"stop_reason", stop_reason},
        {"tokens_per_s", tokens_per_s},
        {"prompt_tokens_per_s", prompt_tokens_per_s},
        {"prefill",
         {{"tokens", prompt->size()},
          {"chunk", o.prefill_chunk},
          {"chunks", at_prompt.prefill_chunks},
          {"tokens_per_s", prompt_tokens_per_s},
          {"time_to_first_token_ms", static_cast<double>(t1 - t0) / 1e6},
          {"experts_acquired", at_prompt.prefill_experts},
          {"hints", at_prompt.prefill_hints},
          {"lookahead_hints", at_prompt.prefill_lookahead_hints},
          {"hints_held", at_prompt.prefill_hints_held},
          {"bf16_gemms", at_prompt.prefill_bf16_gemms},
          {"expert_bytes", expert_bytes},
          {"read_over_acquired",
           acquired_bytes > 0
               ? static_cast<double>(mid.bytes_read - before.bytes_read) / acquired_bytes
               : 0.0},
          {"stall_ms", static_cast<double>(at_prompt.stall_ns) / 1e6},
          {"bytes_read", mid.bytes_read - before.bytes_read},
          {"bytes_read_per_token",
           static_cast<double>(mid.bytes_read - before.bytes_read) / prompt_n}}},
        {"stall_ms_per_token", stall_ms},
        {"generation",
         {{"steps", gen_steps},
          {"stall_ms_per_token", gen_stall_ms},
          {"stall_ms_p50", percentile(stall_ms_each, 0.5)},
          {"stall_ms_p99", percentile(stall_ms_each, 0.99)},
          {"decode_ms_per_token", gen_decode_ms},
          {"compute_ms_per_token", gen_decode_ms - gen_stall_ms},
          {"bytes_read_per_token", bytes_per_token}}},
        {"hits", {{"vram", s.vram_hits}, {"host", host}, {"disk", disk}}},
        {"daemon",
         {{"hits", daemon_hits},
          {"coalesced", coalesced},
          {"misses", after.misses - before.misses},
          {"bytes_read", after.bytes_read - before.bytes_read},
          {"prefetch_loads", after.prefetch_loads - before.prefetch_loads},
          {"prefetch_useful", after.prefetch_useful - before.prefetch_useful},
          {"prefetch", daemon_prefetch_state(client, o.model)}}},
        {"vram",
         {{"hits", s.vram_hits},
          {"misses", s.vram_misses},
          {"prefetches", s.vram_prefetches},
          {"prefetch_used", s.vram_prefetch_used},
          {"streamed", s.vram_streamed},
          {"streamed_bytes", s.streamed_bytes},
          {"preloaded", s.vram_preloaded},
          {"preload_bytes", s.vram_preload_bytes},
          {"preload_s", static_cast<double>(s.vram_preload_ns) / 1e9},
          {"sync_ms", static_cast<double>(s.sync_ns) / 1e6},
          {"copy_bytes", s.copy_bytes},
          {"demand_copy_bytes", s.demand_copy_bytes},
          {"demand_copy_gb_per_s", copy_gbps}}},
        {"tiers",
         {{"coordinated", o.tiers == "coordinated"},
          {"distinct", s.tiers_distinct},
          {"capacity", s.tiers_capacity},
          {"distinct_mean", tiers_mean}}},
        {"prefetch_by_depth", by_depth},
        {"prefetch_depth", o.lookahead},
        {"prefetch_hints", s.hints_sent},
        {"prefetch_precision", s.prefetch_precision()},
        {"prefetch_recall", s.prefetch_recall()},
        {"experts_used", s.experts_used},
        {"decode_steps", s.tokens},
    };
    if (p.is_ds4()) {
      auto cls = [](uint64_t experts, uint64_t ready, uint64_t stall_ns, uint64_t steps) {
        return nlohmann::json{
            {"experts", experts},
            {"ready", ready},
            {"hit_rate", experts ? static_cast<double>(ready) / experts : 0.0},
            {"stall_ms_per_token", steps ? static_cast<double>(stall_ns) / 1e6 / steps : 0.0}};
      };
      j[p.architecture] = {
          {"hash_layers", p.ds4.hash_layers},
          {"hash_hints", s.hash_hints},
          {"hash_hints_enabled", !o.no_hash_hints},
          {"mtp_layers_skipped", p.nextn_layers},
          {"hash", cls(s.hash_experts, s.hash_ready, s.hash_stall_ns, s.tokens)},
          {"learned", cls(s.learned_experts, s.learned_ready, s.learned_stall_ns, s.tokens)}};
    }
    if (script) {
      j["routing_trace"] = o.routing_trace;
      j["mode_note"] = mode_note;
      j["scripted_routes"] = s.scripted_routes;
    }
    if (feeding) {
      j["feed"] = {
          {"source", feed.source},
          {"ids", feed.ids},
          {"tokens", feed.ids.size()},
          {"tokens_per_s", tokens_per_s},
          {"ms_per_token", gen_decode_ms},
          {"stall_ms_per_token", gen_stall_ms},
          {"stall_ms_p50", percentile(stall_ms_each, 0.5)},
          {"stall_ms_p99", percentile(stall_ms_each, 0.99)},
          {"compute_ms_per_token", gen_decode_ms - gen_stall_ms},
          {"bytes_read", after.bytes_read - mid.bytes_read},
          {"bytes_read_per_token", bytes_per_token},
          {"hits",
           {{"vram", s.vram_hits - at_prompt.vram_hits},
            {"host", window_host},
            {"disk", window_disk}}},
          {"reads_in_flight_mean", queue.mean_in_flight},
          {"reads_in_flight_max", queue.max_in_flight},
          {"disk_busy_fraction", queue.busy_fraction},
          {"prefetch_loads", after.prefetch_loads - mid.prefetch_loads},
          {"prefetch_useful", after.prefetch_useful - mid.prefetch_useful},
          {"hints", s.hints_sent - at_prompt.hints_sent},
          {"vram_copy_bytes", s.copy_bytes - at_prompt.copy_bytes},
          {"vram_demand_copy_bytes", s.demand_copy_bytes - at_prompt.demand_copy_bytes},
          // The non-stall time split: the host waiting for the GPU (kernels, copies,
          // in-place PCIe reads) and the rest (launches, routing, hints, IPC).
          {"gpu_wait_ms_per_token", gpu_wait_ms},
          {"host_ms_per_token", gen_decode_ms - gen_stall_ms - gpu_wait_ms},
          {"vram_streamed", s.vram_streamed - at_prompt.vram_streamed},
          {"streamed_bytes_per_token",
           gen_steps ? static_cast<double>(s.streamed_bytes - at_prompt.streamed_bytes) / gen_steps
                     : 0.0}};
    }
    if (vocab && !feeding) j["text"] = text;
    // The raw text split as expert-serve's chat answers are (reasoning_content, content).
    if (vocab && reasoning_model) {
      j["reasoning"] = reasoning_text;
      j["content"] = content_text;
    }
    if (!o.record_trace.empty()) j["trace"] = o.record_trace;
    // Generated text need not be valid UTF-8: invalid bytes become U+FFFD in the JSON.
    std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    return 0;
  }
  std::string ids;
  for (const uint32_t t : generated) ids += (ids.empty() ? "" : " ") + std::to_string(t);
  if (stream) std::printf("\n\n");  // after the streamed answer
  if (!prompt->empty()) {
    std::printf(
        "prompt: %zu tokens in %.1f ms (%.1f tokens/s, %zu chunk%s), %.1f MB read per token\n",
        prompt->size(), static_cast<double>(t1 - t0) / 1e6, prompt_tokens_per_s,
        static_cast<size_t>(at_prompt.prefill_chunks), at_prompt.prefill_chunks == 1 ? "" : "s",
        static_cast<double>(mid.bytes_read - before.bytes_read) / 1e6 / prompt_n);
  }
  if (feeding) {
    // The CUDA engines split the rest of a token into waiting for the GPU and host work; the
    // CPU engine computes on the host.
    const std::string gpu_split =
        engine->name() == "gpu"
            ? fmt::format(": waiting for the GPU {:.1f}, host {:.1f}", gpu_wait_ms,
                          gen_decode_ms - gen_stall_ms - gpu_wait_ms)
            : std::string();
    std::printf(
        "fed: %zu tokens (%s) from an empty context: %.2f tokens/s, %.1f ms/token (stall %.1f, "
        "p50 %.1f, p99 %.1f; compute %.1f%s), %.1f MB read per token\n",
        feed.ids.size(), feed.source.c_str(), tokens_per_s, gen_decode_ms, gen_stall_ms,
        percentile(stall_ms_each, 0.5), percentile(stall_ms_each, 0.99),
        gen_decode_ms - gen_stall_ms, gpu_split.c_str(), bytes_per_token / 1e6);
    std::printf(
        "fed: experts from vram %llu, host %llu, disk %llu; disk busy %.0f%% of the time, "
        "%.1f reads in flight while busy (most %u)\n",
        static_cast<unsigned long long>(s.vram_hits - at_prompt.vram_hits),
        static_cast<unsigned long long>(window_host), static_cast<unsigned long long>(window_disk),
        100.0 * queue.busy_fraction, queue.mean_in_flight, queue.max_in_flight);
  } else {
    std::printf("generated: %s\n", ids.c_str());
    std::printf("stopped: %s\n", stop_reason);
  }
  if (vocab && !feeding) {
    const std::string quoted =
        nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    std::printf("text: %s\n", quoted.c_str());
    if (reasoning_model) {
      auto q = [](const std::string& t) {
        return nlohmann::json(t).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
      };
      std::printf("reasoning: %s\ncontent: %s\n", q(reasoning_text).c_str(),
                  q(content_text).c_str());
    }
  }
  std::printf(
      "speed: %.2f tokens/s, stall %.3f ms/token waiting for experts (p50 %.3f, p99 %.3f "
      "while generating), compute %.3f ms/token\n",
      tokens_per_s, stall_ms, percentile(stall_ms_each, 0.5), percentile(stall_ms_each, 0.99),
      gen_decode_ms - gen_stall_ms);
  std::printf(
      "hits: vram %llu, host %llu, disk %llu (%llu joined a read in flight); %.1f MiB read "
      "per generated token\n",
      static_cast<unsigned long long>(s.vram_hits), static_cast<unsigned long long>(host),
      static_cast<unsigned long long>(disk), static_cast<unsigned long long>(coalesced),
      bytes_per_token / (1 << 20));
  if (s.copy_bytes > 0) {
    std::printf(
        "vram: %llu copied in on demand at %.1f GB/s, %.1f GiB copied in all, %llu "
        "prefetched ahead (%llu used)\n",
        static_cast<unsigned long long>(s.vram_misses), copy_gbps,
        static_cast<double>(s.copy_bytes) / (1 << 30),
        static_cast<unsigned long long>(s.vram_prefetches),
        static_cast<unsigned long long>(s.vram_prefetch_used));
  }
  if (s.vram_streamed > 0) {
    std::printf("vram: %llu read in place, not admitted by the tier's policy\n",
                static_cast<unsigned long long>(s.vram_streamed));
  }
  if (s.tiers_capacity > 0) {
    std::printf(
        "tiers (%s): distinct %u of capacity %u (VRAM slots + host slots), mean %.1f over "
        "%llu tokens\n",
        o.tiers.c_str(), s.tiers_distinct, s.tiers_capacity, tiers_mean,
        static_cast<unsigned long long>(s.tiers_samples));
  }
  std::printf("prefetch: depth %u, %llu hints, precision %.3f, recall %.3f\n", o.lookahead,
              static_cast<unsigned long long>(s.hints_sent), s.prefetch_precision(),
              s.prefetch_recall());
  for (size_t d = 0; d < s.by_depth.size(); ++d) {
    std::printf("  predicted %zu layer%s ahead: precision %.3f, recall %.3f\n", d + 1,
                d == 0 ? "" : "s", s.by_depth[d].precision(), s.by_depth[d].recall());
  }
  if (p.is_ds4()) {
    auto rate = [](uint64_t ready, uint64_t n) {
      return n ? 100.0 * static_cast<double>(ready) / static_cast<double>(n) : 0.0;
    };
    const double steps = s.tokens ? static_cast<double>(s.tokens) : 1.0;
    std::printf(
        "%s: hash layers %.1f%% of experts ready in host memory when asked, stall %.3f "
        "ms/token (%llu exact hints); learned layers %.1f%% ready, stall %.3f ms/token\n",
        p.architecture.c_str(), rate(s.hash_ready, s.hash_experts),
        static_cast<double>(s.hash_stall_ns) / 1e6 / steps,
        static_cast<unsigned long long>(s.hash_hints), rate(s.learned_ready, s.learned_experts),
        static_cast<double>(s.learned_stall_ns) / 1e6 / steps);
  }
  if (script) std::printf("%s\n", mode_note.c_str());
  if (!o.record_trace.empty()) std::printf("trace: %s\n", o.record_trace.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"expert-run: generate tokens with a MoE model whose experts stream from expertd"};
  app.set_version_flag("--version", std::string("expert-run ") + EXPERTD_VERSION);
  Options o;
  add_engine_flags(app, o, "The model's name in expertd");
  app.add_option("--prompt", o.prompt_text,
                 "Prompt text, tokenised with the model's own vocabulary (BOS added when the model "
                 "asks for it); the answer streams to the terminal");
  app.add_option("--prompt-file", o.prompt_file, "Read the prompt text from this file");
  app.add_flag("--chat", o.chat,
               "The prompt text is one user message, rendered with the model's chat template "
               "(tokenizer.chat_template; docs/ENGINE.md, \"Chat templates\") with the assistant's "
               "turn opened; the template's end-of-turn texts join --stop");
  const std::string gptoss(family_info(Family::GptOss).name);
  app.add_option("--system", o.system, "With --chat: a system message before the prompt");
  app.add_option("--chat-template", o.chat_template,
                 "With --chat: a template's name (" + ChatTemplate::names() +
                     ") or a .jinja file, instead of the model's template");
  app.add_option(
      "--chat-template-kwargs", o.chat_template_kwargs,
      "With --chat: the template's switches as a JSON object (expert-serve's flag): "
      "enable_thinking (Qwen3, GLM-4.5, DeepSeek), thinking (DeepSeek), "
      "reasoning_effort (" +
          gptoss +
          "); e.g. '{\"enable_thinking\": false}'. With a "
          "reasoning model the answer's reasoning streams to stderr, the rest to stdout; "
          "--json adds \"reasoning\" and \"content\"");
  app.add_option("--reasoning-effort", o.reasoning_effort,
                 "With --chat: " + gptoss + "'s reasoning effort (its template's default: medium)")
      ->check(CLI::IsMember({"low", "medium", "high"}));
  app.add_option("--prompt-tokens", o.prompt_tokens, "Prompt token ids, comma-separated");
  app.add_option("--max-tokens", o.max_tokens, "Tokens to generate (16)")
      ->each([&o](const std::string&) { o.max_tokens_given = true; });
  app.add_option("--feed-tokens", o.feed_tokens,
                 "Decode these ids instead of generating, one position at a time through the "
                 "decode path (router lookahead, hints, the VRAM tier), from an empty context "
                 "after the prompt (if any), logits computed and left unread: random:N[:SEED] "
                 "(glibc rand() % n_vocab after srand(SEED), SEED 1 = llama-bench's tg ids) or a "
                 "file of ids separated by commas or white space. --json adds \"feed\": tokens/s, "
                 "MB read per token, hits per tier, stall, reads in flight, disk busy");
  app.add_option("--vram-policy", o.vram_policy,
                 "The VRAM tier's replacement policy (the daemon's names: default, cyclic-hint, "
                 "cyclic, lru, fifo; default: the daemon's default, cyclic-hint)");
  app.add_option("--tiers", o.tiers,
                 "independent (the default) or coordinated (experts copied into VRAM are the "
                 "daemon's first victims, so the host cache holds others; docs/ENGINE.md says "
                 "when that loses)")
      ->check(CLI::IsMember({"coordinated", "independent"}));
  app.add_option("--temperature", o.temperature, "Sampling temperature (0 = greedy)");
  app.add_option("--top-p", o.top_p, "Nucleus sampling mass (1)");
  app.add_option("--seed", o.seed, "Sampling seed (0)");
  app.add_option("--top-k", o.top_k, "Sample from the K most probable tokens only (0 = off)");
  app.add_option("--min-p", o.min_p,
                 "Drop tokens less probable than MIN_P times the most probable one (0 = off)");
  app.add_option("--repeat-penalty", o.repeat_penalty,
                 "Divide the positive logits (multiply the negative ones) of tokens seen in the "
                 "last --repeat-last-n tokens, prompt included, by this (1 = off)");
  app.add_option("--repeat-last-n", o.repeat_last_n,
                 "Tokens the repetition penalty looks back over (64; 0 = off)");
  app.add_option("--stop", o.stop,
                 "Stop when the text ends with this string, which is not printed (repeatable)")
      ->allow_extra_args(false);
  app.add_flag("--ignore-eos", o.ignore_eos, "Keep generating past the end-of-sequence token");
  app.add_option("--record-trace", o.record_trace,
                 "Write the routing decisions as canonical JSONL to this file");
  app.add_option("--routing-trace", o.routing_trace,
                 "BENCHMARK MODE: replay this trace's expert choices instead of the router "
                 "(canonical JSONL or .etrace); generation stops at the trace's end");
  app.add_option("--hints", o.hints,
                 "Where prefetch hints come from: router (the next layers' routers) or trace (the "
                 "trace's predicted lists, else its future: an oracle); default trace with "
                 "--routing-trace");
  app.add_flag("--no-hash-hints", o.no_hash_hints,
               std::string(family_info(Family::DeepSeek4).name) +
                   ": do not hint the hash layers' experts when the token is known (to measure "
                   "what the exact hints give)");
  app.add_flag("--json", o.json, "Print one JSON object");
  app.footer(
      "Sampling applies, in order: the repetition penalty, the temperature, top-k, top-p, "
      "min-p, then one seeded draw (docs/ENGINE.md, \"Sampling and stopping\"). Generation "
      "stops at an end token (EOS/EOT/EOM), a --stop string or --max-tokens; --json says which "
      "in stop_reason.");
  app.add_option("--batch-prompts", o.batch_prompts,
                 "Generate for several prompts together in one engine, as expert-serve --parallel "
                 "does (each routed expert a step needs read once for every sequence): a file "
                 "with one prompt per line, token ids (commas or spaces) or random:N[:SEED]; "
                 "prints each sequence's ids and the aggregate tokens/s and MB read per token "
                 "(with --max-tokens, the sampling flags, --ignore-eos, --json)");
  app.add_flag(
      "--batch-every-step", o.batch_every,
      "With --batch-prompts: every sequence in every step, even when a step's distinct "
      "experts outgrow what the VRAM tier and the daemon's cache hold (by default the "
      "step narrows to fit, the rest wait: docs/ENGINE.md \"Sequences decoded together\")");
  CLI11_PARSE(app, argc, argv);
  if (o.batch_every && o.batch_prompts.empty()) {
    std::fprintf(stderr, "expert-run: --batch-every-step needs --batch-prompts\n");
    return 2;
  }
  if (!o.batch_prompts.empty()) {
    if (!o.prompt_tokens.empty() || !o.prompt_text.empty() || !o.prompt_file.empty() ||
        !o.feed_tokens.empty() || !o.routing_trace.empty() || !o.stop.empty()) {
      std::fprintf(stderr,
                   "expert-run: --batch-prompts takes its prompts from the file: no --prompt, "
                   "--prompt-file, --prompt-tokens, --feed-tokens, --routing-trace or --stop\n");
      return 2;
    }
    expertd::tools::BatchRun b;
    b.flags = o;
    b.file = o.batch_prompts;
    b.max_tokens = o.max_tokens;
    b.sampling = SamplerOptions{o.temperature, o.top_p,          o.seed,         o.top_k,
                                o.min_p,       o.repeat_penalty, o.repeat_last_n};
    b.ignore_eos = o.ignore_eos;
    b.json = o.json;
    b.fixed_width = o.batch_every;
    return expertd::tools::run_batch(b);
  }
  return run(o);
}
