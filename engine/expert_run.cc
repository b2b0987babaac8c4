// expert-run: generates tokens with a Qwen3-MoE model whose routed experts come from a running
// expertd. The dense weights are read from the model's GGUF (--gguf); every expert byte arrives
// through libexpertd-client. Until the CUDA engine exists the CPU reference engine runs, and the
// output says so.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "engine/cpu_engine.h"
#include "engine/daemon_expert_source.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "engine/vocab.h"
#include "expertd/client.h"

namespace {

using expertd::Error;
using expertd::Result;
using expertd::Status;
using namespace expertd::engine;

struct Options {
  std::string socket = expertd::client::default_socket();
  std::string model;
  std::string gguf;
  std::string prompt_tokens;
  uint32_t max_tokens = 16;
  bool cpu = false;
  uint32_t prefetch_depth = 1;
  uint32_t prefetch_width = 0;
  float temperature = 0.0f;
  float top_p = 1.0f;
  uint64_t seed = 0;
  bool ignore_eos = false;
  std::string record_trace;
  bool json = false;
};

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

// The daemon's scheduler counters for one model (zeros when the model is not listed).
expertd::client::SchedulerStats model_counters(expertd::client::Client& client,
                                               const std::string& model) {
  auto stats = client.stats();
  if (stats) {
    for (const auto& m : stats->models) {
      if (m.name == model) return m.scheduler;
    }
  }
  return {};
}

double seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

Status write_trace(const std::string& path, const std::vector<RoutingRecord>& log) {
  std::ofstream f(path);
  if (!f) return expertd::make_error(EIO, fmt::format("{}: cannot write the trace", path));
  for (const RoutingRecord& r : log) {
    nlohmann::json j = {
        {"token", r.token}, {"layer", r.layer}, {"experts", r.experts}, {"weights", r.weights}};
    f << j.dump() << '\n';
  }
  f.close();
  if (!f) return expertd::make_error(EIO, fmt::format("{}: write failed", path));
  return expertd::Ok{};
}

int fail(const Error& e) {
  std::fprintf(stderr, "expert-run: %s\n", e.message.c_str());
  return 1;
}

int run(const Options& o) {
  auto prompt = parse_tokens(o.prompt_tokens);
  if (!prompt) return fail(prompt.error());
  auto model = DenseModel::load(o.gguf);
  if (!model) return fail(model.error());
  const ModelParams& p = model->params();
  auto source = DaemonExpertSource::connect(o.socket, o.model, *model, "expert-run");
  if (!source) return fail(source.error());
  expertd::client::Client& client = *(*source)->client();
  EngineOptions eo;
  eo.max_context = static_cast<uint32_t>(prompt->size()) + o.max_tokens;
  eo.prefetch_depth = o.prefetch_depth;
  eo.prefetch_width = o.prefetch_width;
  auto engine = CpuEngine::create(*model, **source, eo);
  if (!engine) return fail(engine.error());
  std::vector<RoutingRecord> log;
  if (!o.record_trace.empty()) (*engine)->set_routing_log(&log);
  const std::optional<Vocab> vocab = Vocab::from_gguf(model->gguf());
  std::optional<uint64_t> eos;
  if (const auto* v = model->gguf().meta().find("tokenizer.ggml.eos_token_id")) eos = v->as_u64();

  const std::string engine_note =
      o.cpu ? "CPU reference engine (--cpu)" : "CPU reference engine (no CUDA engine built yet)";
  if (!o.json) {
    std::printf("expert-run: %s\n", engine_note.c_str());
    std::printf("model %s: %s, %u layers, %u experts (top-%u), dense weights %.1f MiB from %s\n",
                o.model.c_str(), p.architecture.c_str(), p.n_layer, p.n_expert, p.n_expert_used,
                static_cast<double>(model->dense_bytes()) / (1 << 20), o.gguf.c_str());
  }

  const auto before = model_counters(client, o.model);
  std::vector<float> logits(p.n_vocab);
  Sampler sampler(SamplerOptions{o.temperature, o.top_p, o.seed}, p.n_vocab);
  const auto t0 = std::chrono::steady_clock::now();
  for (const uint32_t t : *prompt) {
    if (auto st = (*engine)->decode(t, logits); !st) return fail(st.error());
  }
  const auto t1 = std::chrono::steady_clock::now();
  std::vector<uint32_t> generated;
  while (generated.size() < o.max_tokens) {
    const uint32_t next = sampler.sample(logits);
    generated.push_back(next);
    if (eos && next == *eos && !o.ignore_eos) break;
    if (generated.size() == o.max_tokens) break;
    if (auto st = (*engine)->decode(next, logits); !st) return fail(st.error());
  }
  const auto t2 = std::chrono::steady_clock::now();
  const auto after = model_counters(client, o.model);
  if (!o.record_trace.empty()) {
    if (auto st = write_trace(o.record_trace, log); !st) return fail(st.error());
  }

  const EngineStats& s = (*engine)->stats();
  const double decode_s = seconds(t2 - t1);
  // Generated tokens over the time after the prompt: the first comes from the prompt's logits.
  const double tokens_per_s = decode_s > 0 ? generated.size() / decode_s : 0.0;
  const double prompt_tokens_per_s = seconds(t1 - t0) > 0 ? prompt->size() / seconds(t1 - t0) : 0;
  const double stall_ms = s.tokens ? static_cast<double>(s.stall_ns) / 1e6 / s.tokens : 0.0;
  const uint64_t host = after.hits - before.hits;
  const uint64_t coalesced = after.coalesced - before.coalesced;
  const uint64_t disk = (after.misses - before.misses) + coalesced;
  const std::string text = vocab ? vocab->decode(generated) : std::string();

  if (o.json) {
    nlohmann::json j = {
        {"engine", "cpu"},
        {"engine_note", engine_note},
        {"model", o.model},
        {"prompt_tokens", *prompt},
        {"generated", generated},
        {"tokens_per_s", tokens_per_s},
        {"prompt_tokens_per_s", prompt_tokens_per_s},
        {"stall_ms_per_token", stall_ms},
        {"hits", {{"vram", 0}, {"host", host}, {"disk", disk}}},
        {"daemon",
         {{"hits", host},
          {"coalesced", coalesced},
          {"misses", after.misses - before.misses},
          {"prefetch_loads", after.prefetch_loads - before.prefetch_loads},
          {"prefetch_useful", after.prefetch_useful - before.prefetch_useful}}},
        {"prefetch_depth", o.prefetch_depth},
        {"prefetch_hints", s.hints_sent},
        {"prefetch_precision", s.prefetch_precision()},
        {"prefetch_recall", s.prefetch_recall()},
        {"experts_used", s.experts_used},
        {"decode_steps", s.tokens},
    };
    if (vocab) j["text"] = text;
    if (!o.record_trace.empty()) j["trace"] = o.record_trace;
    // Generated text need not be valid UTF-8: invalid bytes become U+FFFD in the JSON.
    std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    return 0;
  }
  std::string ids;
  for (const uint32_t t : generated) ids += (ids.empty() ? "" : " ") + std::to_string(t);
  std::printf("prompt: %zu tokens, %.1f tokens/s\n", prompt->size(), prompt_tokens_per_s);
  std::printf("generated: %s\n", ids.c_str());
  if (vocab) {
    const std::string quoted =
        nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    std::printf("text: %s\n", quoted.c_str());
  }
  std::printf("speed: %.2f tokens/s, stall %.3f ms/token waiting for experts\n", tokens_per_s,
              stall_ms);
  std::printf("hits: vram 0, host %llu, disk %llu (%llu joined a read in flight)\n",
              static_cast<unsigned long long>(host), static_cast<unsigned long long>(disk),
              static_cast<unsigned long long>(coalesced));
  std::printf("prefetch: depth %u, %llu hints, precision %.3f, recall %.3f\n", o.prefetch_depth,
              static_cast<unsigned long long>(s.hints_sent), s.prefetch_precision(),
              s.prefetch_recall());
  if (!o.record_trace.empty()) std::printf("trace: %s\n", o.record_trace.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"expert-run: generate tokens with a MoE model whose experts stream from expertd"};
  Options o;
  app.add_option("--socket", o.socket, "expertd's control socket");
  app.add_option("--model", o.model, "The model's name in expertd")->required();
  app.add_option("--gguf", o.gguf, "The model's GGUF file (dense weights are read from it)")
      ->required();
  app.add_option("--prompt-tokens", o.prompt_tokens, "Prompt token ids, comma-separated")
      ->required();
  app.add_option("--max-tokens", o.max_tokens, "Tokens to generate (16)");
  app.add_flag("--cpu", o.cpu, "Run the CPU reference engine (the only engine for now)");
  app.add_option("--prefetch-depth", o.prefetch_depth,
                 "Layers ahead to predict experts for with their routers (1; 0 = no hints)");
  app.add_option("--prefetch-width", o.prefetch_width,
                 "Candidates hinted per predicted layer (0 = the model's top-k)");
  app.add_option("--temperature", o.temperature, "Sampling temperature (0 = greedy)");
  app.add_option("--top-p", o.top_p, "Nucleus sampling mass (1)");
  app.add_option("--seed", o.seed, "Sampling seed (0)");
  app.add_flag("--ignore-eos", o.ignore_eos, "Keep generating past the end-of-sequence token");
  app.add_option("--record-trace", o.record_trace,
                 "Write the routing decisions as canonical JSONL to this file");
  app.add_flag("--json", o.json, "Print one JSON object");
  CLI11_PARSE(app, argc, argv);
  return run(o);
}
