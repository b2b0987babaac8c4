#include "tools/expert-serve/generator.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>

#include "base/clock.h"

namespace expertd::serve {

using namespace expertd::engine;

Generator::Generator(std::unique_ptr<Engine> engine, const Tokenizer& tokenizer,
                     EndTokens end_tokens, size_t queue_limit,
                     std::function<void(const std::string&)> on_daemon_gone)
    : engine_(std::move(engine)),
      tokenizer_(tokenizer),
      end_tokens_(end_tokens),
      queue_limit_(queue_limit),
      on_daemon_gone_(std::move(on_daemon_gone)),
      logits_(engine_->params().n_vocab) {
  thread_ = std::thread([this] { loop(); });
}

Generator::~Generator() { stop(); }

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
  queue_.push_back(std::move(job));
  cv_.notify_all();
  return true;
}

void Generator::close(const std::string& why) {
  std::deque<std::shared_ptr<Job>> left;
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    left.swap(queue_);
    if (current_) current_->cancelled = true;
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

bool Generator::busy() const {
  std::lock_guard lock(mu_);
  return current_ != nullptr;
}

uint64_t Generator::served() const {
  std::lock_guard lock(mu_);
  return served_;
}

void Generator::loop() {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      job = std::move(queue_.front());
      queue_.pop_front();
      current_ = job;
    }
    std::optional<Error> failed;
    if (job->cancelled) {
      spdlog::info("request {}: the client left while it waited; skipped", job->id);
    } else {
      failed = run(*job);
    }
    {
      std::lock_guard lock(job->mu);
      job->done = true;
      job->cv.notify_all();
    }
    {
      std::lock_guard lock(mu_);
      current_.reset();
      ++served_;
    }
    if (failed && failed->code == ECONNRESET) {
      // The waiting requests are answered before the HTTP side is told: its threads wait for them.
      close(failed->message);
      if (on_daemon_gone_) on_daemon_gone_(failed->message);
      return;
    }
  }
}

Result<uint32_t> Generator::feed_prompt(const std::vector<uint32_t>& prompt,
                                        std::span<float> logits) {
  // At least one prompt token is fed again: its logits are the first token's.
  const size_t common =
      std::mismatch(fed_.begin(), fed_.end(), prompt.begin(), prompt.end()).first - fed_.begin();
  uint32_t keep = static_cast<uint32_t>(std::min(common, prompt.size() - 1));
  if (keep > engine_->position()) keep = engine_->position();
  if (!engine_->truncate(keep)) {
    engine_->reset();
    keep = 0;
  }
  fed_.resize(keep);
  const std::span<const uint32_t> rest(prompt.data() + keep, prompt.size() - keep);
  if (auto st = engine_->prefill(rest, logits); !st) {
    engine_->reset();
    fed_.clear();
    return st.error();
  }
  fed_.insert(fed_.end(), rest.begin(), rest.end());
  return keep;
}

std::optional<Error> Generator::run(Job& job) {
  auto fail = [&](const Error& e) -> std::optional<Error> {
    spdlog::error("request {}: {}", job.id, e.message);
    std::lock_guard lock(job.mu);
    job.error = e.message;
    return e;
  };
  // Checked when the request was read.
  auto ends = StopMatcher::create(job.end_strings);
  if (!ends) return fail(ends.error());
  auto stops = StopMatcher::create(job.stops);
  if (!stops) return fail(stops.error());
  ReasoningSplitter splitter(job.reasoning, job.starts_in_reasoning);

  const EngineStats before = engine_->stats();
  const uint64_t t0 = monotonic_ns();
  auto cached = feed_prompt(job.prompt, logits_);
  if (!cached) return fail(cached.error());
  const uint64_t t1 = monotonic_ns();
  const EngineStats at_prompt = engine_->stats();
  {
    std::lock_guard lock(job.mu);
    job.cached_tokens = *cached;
  }
  const size_t prefilled = job.prompt.size() - *cached;
  spdlog::info(
      "request {} ({}): {} prompt tokens, {} cached, prefilled {} in {} chunk{} in {:.1f} ms",
      job.id, job.kind, job.prompt.size(), *cached, prefilled,
      at_prompt.prefill_chunks - before.prefill_chunks,
      at_prompt.prefill_chunks - before.prefill_chunks == 1 ? "" : "s",
      static_cast<double>(t1 - t0) / 1e6);

  // One token's (or the end's) output on its way to the job: the splitter's reasoning as it is,
  // its content through the request's stop strings.
  std::string reasoning;
  std::string content;
  bool stopped = false;  // a request stop string completed: nothing more reaches the content
  auto through = [&](ReasoningSplitter::Step s) {
    if (stopped) return;
    reasoning.append(s.reasoning);
    if (s.content.empty()) return;
    const StopMatcher::Step st = stops->push(s.content);
    content.append(st.emit);
    stopped = st.stop;
  };
  uint32_t generated = 0;
  auto publish = [&] {
    std::lock_guard lock(job.mu);
    job.reasoning_text.append(reasoning);
    job.text.append(content);
    job.completion_tokens = generated;
    job.cv.notify_all();
  };

  Sampler sampler(job.sampling, engine_->params().n_vocab);
  for (const uint32_t t : job.prompt) sampler.accept(t);  // the penalty's window starts there
  std::string finish = "length";
  bool cancelled = false;
  while (generated < job.max_tokens) {
    if (job.cancelled) {
      cancelled = true;
      break;
    }
    const uint32_t next = sampler.sample(logits_);
    ++generated;
    if (!job.ignore_eos && end_tokens_.contains(next)) {
      finish = "stop";
      break;
    }
    reasoning.clear();
    content.clear();
    const StopMatcher::Step end = ends->push(tokenizer_.decode(next));
    through(splitter.push(end.emit));
    if (!reasoning.empty() || !content.empty()) publish();
    if (end.stop || stopped) {
      finish = "stop";
      break;
    }
    if (generated == job.max_tokens) break;
    if (auto st = engine_->decode(next, logits_); !st) {
      engine_->reset();
      fed_.clear();
      return fail(st.error());
    }
    fed_.push_back(next);
  }
  // What each stage held back: text no end string completed, the splitter's unfinished tag or
  // header, a prefix of a request stop string.
  reasoning.clear();
  content.clear();
  if (!ends->stopped()) through(splitter.push(ends->finish()));
  through(splitter.finish());
  if (!stopped) content.append(stops->finish());
  const uint64_t t2 = monotonic_ns();
  {
    std::lock_guard lock(job.mu);
    job.reasoning_text.append(reasoning);
    job.text.append(content);
    job.completion_tokens = generated;
    job.finish_reason = stopped ? "stop" : finish;
    job.cv.notify_all();
  }
  const EngineStats& s = engine_->stats();
  const uint64_t steps = s.tokens - at_prompt.tokens;
  const double gen_s = static_cast<double>(t2 - t1) / 1e9;
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
                 stopping ? "shutting down" : "the client left", generated, job.max_tokens);
  }
  spdlog::info(
      "request {}: {} tokens in {:.3f} s ({:.1f} tokens/s), finish {}, expert stall {:.3f} "
      "ms/token",
      job.id, generated, gen_s, gen_s > 0 ? generated / gen_s : 0.0,
      cancelled ? "cancelled" : finish,
      steps ? static_cast<double>(s.stall_ns - at_prompt.stall_ns) / 1e6 / steps : 0.0);
  return std::nullopt;
}

}  // namespace expertd::serve
