#include "tools/expert-serve/generator.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>

#include "base/clock.h"

namespace expertd::serve {

using namespace expertd::engine;
using namespace expertd::text;

Generator::Generator(std::unique_ptr<Engine> engine, const Tokenizer& tokenizer,
                     EndTokens end_tokens, size_t queue_limit,
                     std::function<void(const std::string&)> on_daemon_gone)
    : engine_(std::move(engine)),
      tokenizer_(tokenizer),
      end_tokens_(end_tokens),
      queue_limit_(queue_limit),
      on_daemon_gone_(std::move(on_daemon_gone)),
      slots_(engine_->sequences()),
      logits_(uint64_t{engine_->sequences()} * engine_->params().n_vocab),
      width_(engine_->sequences()) {
  thread_ = std::thread([this] { loop(); });
}

Generator::~Generator() { stop(); }

void Generator::publish(Job& job, const Generation& g, bool done) {
  if (!done && g.reasoning_delta().empty() && g.content_delta().empty() && !g.last_logprob()) {
    return;
  }
  std::lock_guard lock(job.mu);
  if (g.last_logprob()) job.logprobs_out.push_back(*g.last_logprob());
  job.reasoning_text.append(g.reasoning_delta());
  job.text.append(g.content_delta());
  job.completion_tokens = g.generated();
  if (done) job.finish_reason = g.finish_reason();
  job.cv.notify_all();
}

void Generator::drop_cancelled_locked() {
  std::erase_if(queue_, [](const std::shared_ptr<Job>& job) {
    if (!job->cancelled) return false;
    spdlog::info("request {}: the client left while it waited; dropped from the queue", job->id);
    std::lock_guard lock(job->mu);
    job->done = true;
    job->cv.notify_all();
    return true;
  });
}

bool Generator::submit(std::shared_ptr<Job> job) {
  std::lock_guard lock(mu_);
  drop_cancelled_locked();
  if (stopping_ || queue_.size() >= queue_limit_) return false;
  job->submitted_ns = monotonic_ns();
  queue_.push_back(std::move(job));
  cv_.notify_all();
  return true;
}

bool Generator::submit_all(const std::vector<std::shared_ptr<Job>>& jobs) {
  std::lock_guard lock(mu_);
  drop_cancelled_locked();
  // The sequences free now take the first ones at once; the rest wait in the queue.
  const size_t free_now = slots_.size() - std::min(slots_.size(), running_.size());
  if (stopping_ || queue_.size() + jobs.size() > queue_limit_ + free_now) return false;
  const uint64_t now = monotonic_ns();
  for (const auto& job : jobs) {
    job->submitted_ns = now;
    queue_.push_back(job);
  }
  cv_.notify_all();
  return true;
}

void Generator::close(const std::string& why) {
  std::deque<std::shared_ptr<Job>> left;
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    left.swap(queue_);
    for (const auto& job : running_) job->cancelled = true;
    cv_.notify_all();
  }
  for (auto& job : left) {
    std::lock_guard lock(job->mu);
    job->error = why;
    job->error_status = 503;
    job->done = true;
    job->cv.notify_all();
  }
}

void Generator::stop() {
  close("the server is shutting down");
  if (thread_.joinable()) thread_.join();
}

size_t Generator::queued() {
  std::lock_guard lock(mu_);
  drop_cancelled_locked();
  return queue_.size();
}

bool Generator::busy() const { return running() > 0; }

size_t Generator::running() const {
  std::lock_guard lock(mu_);
  return running_.size();
}

uint64_t Generator::served() const {
  std::lock_guard lock(mu_);
  return served_;
}

size_t Generator::pick_slot(const std::vector<uint32_t>& prompt) const {
  size_t best = slots_.size();
  size_t best_common = 0;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    if (s.job) continue;
    const size_t common =
        std::mismatch(s.fed.begin(), s.fed.end(), prompt.begin(), prompt.end()).first -
        s.fed.begin();
    if (best == slots_.size() || common > best_common) {
      best = i;
      best_common = common;
    }
  }
  return best;
}

bool Generator::admit() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return stopping_ || !running_.empty() || !queue_.empty(); });
  if (stopping_ && running_.empty()) return false;
  while (!stopping_ && !queue_.empty() && running_.size() < slots_.size()) {
    std::shared_ptr<Job> job = std::move(queue_.front());
    queue_.pop_front();
    const size_t i = pick_slot(job->prompt);
    Slot& s = slots_[i];
    s.job = job;
    s.gen.reset();
    s.started = false;
    running_.push_back(std::move(job));
  }
  return true;
}

void Generator::release(size_t i) {
  Slot& s = slots_[i];
  counters_.requests.fetch_add(1, std::memory_order_relaxed);
  counters_.prompt_tokens.fetch_add(s.job->prompt.size(), std::memory_order_relaxed);
  counters_.cached_tokens.fetch_add(s.started ? s.cached : 0, std::memory_order_relaxed);
  if (s.gen) counters_.generated_tokens.fetch_add(s.gen->generated(), std::memory_order_relaxed);
  // The sequence is free before the job says it is done: a client that sends its next request
  // as soon as it has this answer finds room for it (submit_all counts the free sequences).
  {
    std::lock_guard lock(mu_);
    std::erase(running_, s.job);
    ++served_;
  }
  {
    std::lock_guard lock(s.job->mu);
    s.job->done = true;
    s.job->cv.notify_all();
  }
  s.job.reset();
  s.gen.reset();
}

std::optional<Error> Generator::fail(size_t i, const Error& e) {
  Slot& s = slots_[i];
  spdlog::error("request {}: {}", s.job->id, e.message);
  {
    std::lock_guard lock(s.job->mu);
    s.job->error = e.message;
  }
  // The sequence's cache may hold half a step: forget it.
  if (engine_->select_sequence(static_cast<uint32_t>(i))) engine_->reset();
  s.fed.clear();
  release(i);
  return e;
}

void Generator::end_job(size_t i, bool cancelled) {
  Slot& s = slots_[i];
  Job& job = *s.job;
  Generation& g = *s.gen;
  g.finish();
  publish(job, g, /*done=*/true);
  const uint64_t t2 = monotonic_ns();
  if (cancelled) {
    bool stopping = false;
    {
      std::lock_guard lock(mu_);
      stopping = stopping_;
    }
    if (stopping) {
      std::lock_guard lock(job.mu);
      job.error = "the server is shutting down";
      job.error_status = 503;
    }
    spdlog::info("request {}: {}; stopped after {} of {} tokens", job.id,
                 stopping ? "shutting down" : "the client left", g.generated(), job.gen.max_tokens);
  }
  const double gen_s = static_cast<double>(t2 - s.t_prompt) / 1e9;
  const uint64_t steps = s.steps;
  spdlog::info(
      "request {}: {} tokens in {:.3f} s ({:.1f} tokens/s), finish {}, {:.2f} sequences per "
      "step",
      job.id, g.generated(), gen_s, gen_s > 0 ? g.generated() / gen_s : 0.0,
      cancelled ? "cancelled" : g.finish_reason(),
      steps ? static_cast<double>(s.rows_seen) / static_cast<double>(steps) : 1.0);
  release(i);
}

std::optional<Error> Generator::prefill_step(size_t i) {
  Slot& s = slots_[i];
  Job& job = *s.job;
  if (s.started && job.cancelled) {
    end_job(i, /*cancelled=*/true);
    return std::nullopt;
  }
  const auto seq = static_cast<uint32_t>(i);
  if (auto st = engine_->select_sequence(seq); !st) return fail(i, st.error());
  const uint32_t n_vocab = engine_->params().n_vocab;
  const std::span<float> logits(logits_.data(), n_vocab);
  if (!s.started) {
    // The text stages first: they were checked when the request was read.
    auto gen = Generation::create(
        job.gen, n_vocab, [this](uint32_t t) { return tokenizer_.decode(t); }, end_tokens_,
        job.prompt);
    if (!gen) return fail(i, gen.error());
    s.gen = std::move(*gen);
    // At least one prompt token is fed again: its logits are the first token's.
    const size_t common =
        std::mismatch(s.fed.begin(), s.fed.end(), job.prompt.begin(), job.prompt.end()).first -
        s.fed.begin();
    uint32_t keep = static_cast<uint32_t>(std::min(common, job.prompt.size() - 1));
    if (keep > engine_->position()) keep = engine_->position();
    if (!engine_->truncate(keep)) {
      engine_->reset();
      keep = 0;
    }
    s.fed.resize(keep);
    s.cached = keep;
    s.t0 = monotonic_ns();
    s.chunks = 0;
    s.steps = 0;
    s.rows_seen = 0;
    s.started = true;
    std::lock_guard lock(job.mu);
    job.cached_tokens = keep;
  }
  // One chunk per call, so that the other sequences' decode steps run between a long prompt's
  // chunks.
  const size_t at = s.fed.size();
  const size_t n = std::min<size_t>(job.prompt.size() - at, engine_->options().prefill_chunk);
  const std::span<const uint32_t> piece(job.prompt.data() + at, n);
  if (auto st = engine_->prefill(piece, logits); !st) {
    const Error e = st.error();
    fail(i, e);
    return e;
  }
  s.fed.insert(s.fed.end(), piece.begin(), piece.end());
  ++s.chunks;
  if (s.fed.size() < job.prompt.size()) return std::nullopt;
  s.t_prompt = monotonic_ns();
  spdlog::info(
      "request {} ({}): {} prompt tokens, {} cached, prefilled {} in {} chunk{} in {:.1f} ms",
      job.id, job.kind, job.prompt.size(), s.cached, job.prompt.size() - s.cached, s.chunks,
      s.chunks == 1 ? "" : "s", static_cast<double>(s.t_prompt - s.t0) / 1e6);
  if (job.cancelled) {
    end_job(i, /*cancelled=*/true);
    return std::nullopt;
  }
  s.pending = s.gen->advance(logits);
  if (s.gen->generated() > 0) {
    counters_.first_tokens.fetch_add(1, std::memory_order_relaxed);
    counters_.first_token_ns.fetch_add(monotonic_ns() - job.submitted_ns,
                                       std::memory_order_relaxed);
  }
  publish(job, *s.gen, /*done=*/false);
  if (!s.pending) end_job(i, /*cancelled=*/false);
  return std::nullopt;
}

std::optional<Error> Generator::decode_step() {
  rows_.clear();
  slot_of_.clear();
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& s = slots_[i];
    if (!s.job || !s.started || s.fed.size() < s.job->prompt.size() || !s.pending) continue;
    if (s.job->cancelled) {
      end_job(i, /*cancelled=*/true);
      continue;
    }
    rows_.push_back(BatchRow{static_cast<uint32_t>(i), *s.pending});
    slot_of_.push_back(i);
  }
  if (rows_.empty()) return std::nullopt;
  // More rows than the tiers' width (engine/batch_width.h): the oldest requests' rows step, the
  // others wait for a later step.
  if (rows_.size() > width_.width()) {
    std::vector<size_t> order(rows_.size());
    for (size_t r = 0; r < order.size(); ++r) order[r] = r;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return slots_[slot_of_[a]].job->submitted_ns < slots_[slot_of_[b]].job->submitted_ns;
    });
    order.resize(width_.width());
    std::sort(order.begin(), order.end());
    std::vector<BatchRow> kept;
    std::vector<size_t> kept_slots;
    for (const size_t r : order) {
      kept.push_back(rows_[r]);
      kept_slots.push_back(slot_of_[r]);
    }
    rows_.swap(kept);
    slot_of_.swap(kept_slots);
  }
  const uint32_t n_vocab = engine_->params().n_vocab;
  const uint64_t acquired = engine_->stats().batch_experts;
  const uint64_t t0 = monotonic_ns();
  if (auto st = engine_->decode_batch(rows_, logits_); !st) {
    const Error e = st.error();
    for (const size_t i : slot_of_) fail(i, e);
    return e;
  }
  width_.observe(static_cast<uint32_t>(rows_.size()), engine_->stats().batch_experts - acquired,
                 engine_->stats().tiers_capacity);
  width_.observe_time(static_cast<uint32_t>(rows_.size()), monotonic_ns() - t0);
  counters_.steps.fetch_add(1, std::memory_order_relaxed);
  counters_.rows.fetch_add(rows_.size(), std::memory_order_relaxed);
  for (size_t r = 0; r < rows_.size(); ++r) {
    const size_t i = slot_of_[r];
    Slot& s = slots_[i];
    s.fed.push_back(rows_[r].token);
    ++s.steps;
    s.rows_seen += rows_.size();
    const std::span<const float> logits(logits_.data() + r * n_vocab, n_vocab);
    s.pending = s.gen->advance(logits);
    publish(*s.job, *s.gen, /*done=*/false);
    if (!s.pending) end_job(i, /*cancelled=*/false);
  }
  return std::nullopt;
}

void Generator::loop() {
  size_t next_prefill = 0;  // round robin over the slots still prefilling
  while (admit()) {
    std::optional<Error> failed;
    // Jobs whose client left before their first token.
    for (size_t i = 0; i < slots_.size(); ++i) {
      Slot& s = slots_[i];
      if (s.job && !s.started && s.job->cancelled) {
        bool stopping = false;
        {
          std::lock_guard lock(mu_);
          stopping = stopping_;
        }
        if (stopping) {
          std::lock_guard lock(s.job->mu);
          s.job->error = "the server is shutting down";
          s.job->error_status = 503;
        } else {
          spdlog::info("request {}: the client left while it waited; skipped", s.job->id);
        }
        release(i);
      }
    }
    // One prefill chunk of one sequence, then one decode step of all the others.
    for (size_t k = 0; k < slots_.size() && !failed; ++k) {
      const size_t i = (next_prefill + k) % slots_.size();
      Slot& s = slots_[i];
      if (!s.job || (s.started && s.fed.size() >= s.job->prompt.size())) continue;
      failed = prefill_step(i);
      next_prefill = i + 1;
      break;
    }
    if (!failed) failed = decode_step();
    if (failed && failed->code == ECONNRESET) {
      // The waiting requests are answered before the HTTP side is told: its threads wait for them.
      for (size_t i = 0; i < slots_.size(); ++i) {
        if (slots_[i].job) fail(i, *failed);
      }
      close(failed->message);
      if (on_daemon_gone_) on_daemon_gone_(failed->message);
      return;
    }
  }
  // Stopping: the jobs still running end as cancelled.
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].job && slots_[i].gen) end_job(i, /*cancelled=*/true);
    if (slots_[i].job) release(i);
  }
}

}  // namespace expertd::serve
