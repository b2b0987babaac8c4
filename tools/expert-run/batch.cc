#include "tools/expert-run/batch.h"

#include <fmt/format.h>

#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "base/clock.h"
#include "engine/batch_width.h"
#include "engine/daemon_expert_source.h"
#include "engine/setup.h"
#include "expertd/client.h"
#include "text/generation.h"
#include "text/stop.h"

namespace expertd::tools {
namespace {

using namespace expertd::engine;
using namespace expertd::text;

constexpr uint32_t kMaxPrompts = 256;  // CpuEngine::kMaxSequences

int fail(const std::string& message) {
  std::fprintf(stderr, "expert-run: %s\n", message.c_str());
  return 1;
}

bool whole(std::string_view t, uint32_t& v) {
  const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  return !t.empty() && ec == std::errc() && end == t.data() + t.size();
}

// One line of the file: ids, or random:N[:SEED].
Result<std::vector<uint32_t>> parse_line(const std::string& file, uint32_t line_no,
                                         const std::string& line, uint32_t n_vocab) {
  auto bad = [&](const std::string& why) {
    return make_error(EINVAL, fmt::format("--batch-prompts {} line {}: {}", file, line_no, why));
  };
  std::vector<uint32_t> ids;
  if (line.starts_with("random:")) {
    const std::string rest = line.substr(7);
    const size_t colon = rest.find(':');
    uint32_t n = 0;
    uint32_t seed = 1;
    if (!whole(rest.substr(0, colon), n) || n == 0 || n > (1u << 20) ||
        (colon != std::string::npos && !whole(rest.substr(colon + 1), seed))) {
      return bad(
          fmt::format("'{}': random:N[:SEED] needs N in 1..{} and a whole SEED", line, 1u << 20));
    }
    std::srand(seed);
    for (uint32_t i = 0; i < n; ++i) ids.push_back(static_cast<uint32_t>(std::rand()) % n_vocab);
    return ids;
  }
  std::string item;
  auto flush = [&]() -> Status {
    if (item.empty()) return Ok{};
    uint32_t v = 0;
    if (!whole(item, v)) return bad(fmt::format("'{}' is not a token id", item.substr(0, 32)));
    if (v >= n_vocab) {
      return bad(fmt::format("token {} is outside the vocabulary of {}", v, n_vocab));
    }
    ids.push_back(v);
    item.clear();
    return Ok{};
  };
  for (const char c : line) {
    if (c == ',' || c == ' ' || c == '\t' || c == '\r') {
      EXPERTD_TRY(flush());
    } else {
      item.push_back(c);
    }
  }
  EXPERTD_TRY(flush());
  if (ids.empty()) return bad("no token ids");
  return ids;
}

struct BatchLine {
  std::vector<uint32_t> prompt;
  std::optional<std::vector<uint32_t>> feed;  // "PROMPT | FEED"
};

Result<std::vector<BatchLine>> read_prompts(const std::string& file, uint32_t n_vocab) {
  std::ifstream in(file, std::ios::binary);
  if (!in) {
    return make_error(ENOENT, fmt::format("--batch-prompts {}: cannot open it", file));
  }
  std::vector<BatchLine> lines;
  std::string line;
  uint32_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    const size_t first = line.find_first_not_of(" \t\r");
    if (first == std::string::npos || line[first] == '#') continue;
    const std::string body = line.substr(first);
    const size_t bar = body.find('|');
    BatchLine b;
    auto trim = [](std::string t) {
      const size_t a = t.find_first_not_of(" \t\r");
      const size_t z = t.find_last_not_of(" \t\r");
      return a == std::string::npos ? std::string() : t.substr(a, z - a + 1);
    };
    EXPERTD_TRY_ASSIGN(b.prompt, parse_line(file, line_no, trim(body.substr(0, bar)), n_vocab));
    if (bar != std::string::npos) {
      EXPERTD_TRY_ASSIGN(auto feed, parse_line(file, line_no, trim(body.substr(bar + 1)), n_vocab));
      b.feed = std::move(feed);
    }
    if (!lines.empty() && lines.front().feed.has_value() != b.feed.has_value()) {
      return make_error(EINVAL, fmt::format("--batch-prompts {} line {}: every line feeds ids "
                                            "(PROMPT | FEED) or none does",
                                            file, line_no));
    }
    lines.push_back(std::move(b));
    if (lines.size() > kMaxPrompts) {
      return make_error(EINVAL,
                        fmt::format("--batch-prompts {}: more than {} prompts", file, kMaxPrompts));
    }
  }
  if (lines.empty()) {
    return make_error(EINVAL, fmt::format("--batch-prompts {}: no prompts in it", file));
  }
  return lines;
}

client::SchedulerStats counters(client::Client& c, const std::string& model) {
  if (auto st = c.stats()) {
    for (const auto& m : st->models) {
      if (m.name == model) return m.scheduler;
    }
  }
  return {};
}

}  // namespace

int run_batch(const BatchRun& b) {
  if (auto st = validate(b.sampling); !st) return fail(st.error().message);
  auto daemon = client::Client::connect(b.flags.socket);
  if (!daemon) return fail(daemon.error().message);
  const DeviceChoice device = choose_device(b.flags.cpu);
  auto model = load_dense(daemon->get(), b.flags.model, b.flags.gguf, device);
  if (!model) return fail(model.error().message);
  const ModelParams& p = model->params();
  auto prompts = read_prompts(b.file, p.n_vocab);
  if (!prompts) return fail(prompts.error().message);
  const auto n = static_cast<uint32_t>(prompts->size());
  const bool feeding = prompts->front().feed.has_value();
  size_t longest = 0;
  for (const auto& pr : *prompts) {
    longest = std::max(longest, pr.prompt.size() + (feeding ? pr.feed->size() : b.max_tokens));
  }
  auto source = DaemonExpertSource::attach(std::move(*daemon), b.flags.model, *model, "expert-run");
  if (!source) return fail(source.error().message);
  client::Client& client = *(*source)->client();
  EngineOptions eo;
  eo.max_context = static_cast<uint32_t>(longest);
  eo.prefetch_depth = b.flags.lookahead;
  eo.prefetch_width = b.flags.prefetch_width;
  eo.prefill_chunk = b.flags.prefill_chunk;
  eo.sequences = n;
  auto created = create_engine(
      *model, **source,
      EngineSetup{eo, b.flags.vram_experts, false, "", b.flags.prefill_gemm,
                  !b.flags.no_vram_preload, expertd::tools::preload_progress("expert-run", b.json)},
      device);
  if (!created) return fail(created.error().message);
  Engine& engine = *created->engine;
  if (engine.sequences() < n) {
    return fail(fmt::format("--batch-prompts: {}; give one prompt or another engine",
                            created->sequences_note));
  }
  if (!b.json) {
    std::printf("expert-run: %s\nexpert-run: batch of %u sequences (%s)\n", created->note.c_str(),
                n, b.file.c_str());
    std::fflush(stdout);
  }

  GenerationOptions go;
  go.sampling = b.sampling;
  go.max_tokens = b.max_tokens;
  go.stop_at_end_token = !b.ignore_eos;
  const EndTokens end_tokens = EndTokens::from_gguf(model->gguf().meta());
  const uint64_t v = p.n_vocab;
  std::vector<float> logits(uint64_t{n} * v);
  std::vector<std::unique_ptr<Generation>> gens(n);
  std::vector<std::optional<uint32_t>> pending(n);
  std::vector<size_t> fed(n, 0);  // feeding: ids of the line's FEED fed so far
  // The token sequence s feeds next: its FEED's next id, or its generation's next sample.
  auto next_of = [&](uint32_t s, std::span<const float> step_logits) -> std::optional<uint32_t> {
    if (!feeding) return gens[s]->advance(step_logits);
    const std::vector<uint32_t>& f = *(*prompts)[s].feed;
    if (fed[s] == f.size()) return std::nullopt;
    return f[fed[s]++];
  };
  const client::SchedulerStats before = counters(client, b.flags.model);
  const uint64_t t0 = monotonic_ns();
  for (uint32_t s = 0; s < n; ++s) {
    auto g = Generation::create(go, p.n_vocab, nullptr, end_tokens, (*prompts)[s].prompt);
    if (!g) return fail(g.error().message);
    gens[s] = std::move(*g);
    if (auto st = engine.select_sequence(s); !st) return fail(st.error().message);
    const std::span<float> out(logits.data(), v);
    if (auto st = engine.prefill((*prompts)[s].prompt, out); !st) return fail(st.error().message);
    pending[s] = next_of(s, out);
  }
  const uint64_t t1 = monotonic_ns();
  const client::SchedulerStats mid = counters(client, b.flags.model);
  const EngineStats at_prompt = engine.stats();
  std::vector<BatchRow> rows;
  std::vector<uint32_t> seq_of;
  // The first sequences (in the file's order) with a token pending, as many as the width allows.
  BatchWidth width(n);
  uint32_t narrowest = n;
  std::vector<uint64_t> at_width(n + 1, 0);  // steps of each width
  // Counted here: an engine of one sequence decodes its step with decode(), outside batch_rows.
  uint64_t steps = 0;
  uint64_t rows_fed = 0;
  for (;;) {
    rows.clear();
    seq_of.clear();
    for (uint32_t s = 0; s < n && rows.size() < width.width(); ++s) {
      if (pending[s]) {
        rows.push_back(BatchRow{s, *pending[s]});
        seq_of.push_back(s);
      }
    }
    if (rows.empty()) break;
    const uint64_t acquired = engine.stats().batch_experts;
    const uint64_t step0 = monotonic_ns();
    if (auto st = engine.decode_batch(rows, logits); !st) return fail(st.error().message);
    ++steps;
    rows_fed += rows.size();
    ++at_width[rows.size()];
    if (!b.fixed_width) {
      width.observe(static_cast<uint32_t>(rows.size()), engine.stats().batch_experts - acquired,
                    engine.stats().tiers_capacity);
      width.observe_time(static_cast<uint32_t>(rows.size()), monotonic_ns() - step0);
      narrowest = std::min(narrowest, width.width());
    }
    for (size_t r = 0; r < rows.size(); ++r) {
      const uint32_t s = seq_of[r];
      pending[s] = next_of(s, std::span<const float>(logits.data() + r * v, v));
    }
  }
  const uint64_t t2 = monotonic_ns();
  const client::SchedulerStats after = counters(client, b.flags.model);
  const EngineStats& st = engine.stats();
  uint64_t generated = 0;
  for (uint32_t s = 0; s < n; ++s) generated += feeding ? fed[s] : gens[s]->generated();
  // The first token of each sequence comes from its prompt's logits; the steps fed the rest.
  const double decode_s = static_cast<double>(t2 - t1) / 1e9;
  const double bytes = static_cast<double>(after.bytes_read - mid.bytes_read);
  const double per_token = rows_fed ? bytes / static_cast<double>(rows_fed) : 0.0;
  const double tps = decode_s > 0 ? static_cast<double>(rows_fed) / decode_s : 0.0;
  const uint64_t experts = st.batch_experts - at_prompt.batch_experts;
  if (b.json) {
    nlohmann::json prompt_ids = nlohmann::json::array();
    nlohmann::json gen = nlohmann::json::array();
    for (uint32_t s = 0; s < n; ++s) {
      prompt_ids.push_back((*prompts)[s].prompt);
      gen.push_back(feeding ? *(*prompts)[s].feed : gens[s]->tokens());
    }
    const nlohmann::json j = {
        {"engine", engine.name()},
        {"engine_note", created->note},
        {"sequences", n},
        {"prompt_tokens", prompt_ids},
        {"fed", feeding},
        {"prefill_s", static_cast<double>(t1 - t0) / 1e9},
        {"prefill_bytes_read", mid.bytes_read - before.bytes_read},
        {"steps", steps},
        {"rows", rows_fed},
        {"rows_per_step", steps ? static_cast<double>(rows_fed) / steps : 0.0},
        {"decode_s", decode_s},
        {"tokens_per_s", tps},
        {"bytes_read", after.bytes_read - mid.bytes_read},
        {"bytes_read_per_token", per_token},
        {"experts_acquired", experts},
        {"experts_per_step", steps ? static_cast<double>(experts) / steps : 0.0},
        {"tiers_capacity", st.tiers_capacity},
        {"width_adaptive", !b.fixed_width},
        {"width_narrowest", narrowest},
        {"steps_by_width", std::vector<uint64_t>(at_width.begin() + 1, at_width.end())},
        {"stall_s", static_cast<double>(st.stall_ns - at_prompt.stall_ns) / 1e9},
        {"generated_tokens", generated},
        {"generated", gen},
    };
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  for (uint32_t s = 0; s < n; ++s) {
    if (feeding) {
      std::printf("sequence %u: %zu prompt tokens, fed %zu ids\n", s, (*prompts)[s].prompt.size(),
                  fed[s]);
      continue;
    }
    std::string ids;
    for (const uint32_t t : gens[s]->tokens()) ids += (ids.empty() ? "" : " ") + std::to_string(t);
    std::printf("sequence %u: %zu prompt tokens, stopped: %s, generated: %s\n", s,
                (*prompts)[s].prompt.size(), gens[s]->stop_reason(), ids.c_str());
  }
  std::printf(
      "batch: prefill %.1f ms; decode %llu steps of %.2f sequences: %.2f tokens/s together, "
      "%.1f MB read per token, %.1f experts acquired per step, stall %.1f ms\n",
      static_cast<double>(t1 - t0) / 1e6, static_cast<unsigned long long>(steps),
      steps ? static_cast<double>(rows_fed) / steps : 0.0, tps, per_token / 1e6,
      steps ? static_cast<double>(experts) / steps : 0.0,
      static_cast<double>(st.stall_ns - at_prompt.stall_ns) / 1e6);
  return 0;
}

}  // namespace expertd::tools
