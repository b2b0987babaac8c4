// expert-serve's engine side: one thread owns the Engine and runs one sequence at a time; requests
// wait in a bounded queue. The KV cache of the previous sequence is kept: a request that starts
// with the same tokens continues from their positions (Engine::truncate) and prefills the rest.
//
// A Job is shared between the HTTP thread that answers the request and the engine thread: the
// request's fields are fixed before submit(); the output fields are guarded by Job::mu and
// announced on Job::cv. Setting `cancelled` (the client went away) stops the generation after the
// token in progress, or skips the job if it has not started.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "engine/reasoning.h"
#include "engine/sampler.h"
#include "engine/stop.h"
#include "engine/tokenizer.h"

namespace expertd::serve {

struct Job {
  // Fixed before submit().
  uint64_t id = 0;
  std::string kind;  // "completion" or "chat", for the log
  std::vector<uint32_t> prompt;
  engine::SamplerOptions sampling;
  // The raw text is cut at the chat template's turn-end strings (end_strings), then split into
  // reasoning and content (`reasoning`; kNone: all content); the request's stop strings cut the
  // content, the answer the user sees, so that a stop string the model writes while it reasons
  // does not end the answer before it is given.
  std::vector<std::string> end_strings;
  std::vector<std::string> stops;
  engine::ReasoningSyntax reasoning = engine::ReasoningSyntax::kNone;
  bool starts_in_reasoning = false;  // the prompt opened a <think> block
  uint32_t max_tokens = 16;
  bool ignore_eos = false;

  std::atomic<bool> cancelled{false};

  // Output, guarded by mu.
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  // Text generated and not yet taken by the HTTP side (bytes: not necessarily valid UTF-8): the
  // content, and the reasoning apart from it.
  std::string text;
  std::string reasoning_text;
  std::string finish_reason;  // "stop" or "length" once done
  uint32_t completion_tokens = 0;
  uint32_t cached_tokens = 0;  // prompt positions reused from the previous sequence
  std::string error;           // the request failed: its answer is error_status with this
  int error_status = 500;      // 500: the engine failed; 503: the server is shutting down
};

class Generator {
 public:
  // `queue_limit`: jobs that may wait while one runs; submit() refuses more.
  // `on_daemon_gone` runs on the engine thread, once, after a request failed because expertd
  // went away (ECONNRESET from the client library): the engine cannot serve again.
  Generator(std::unique_ptr<engine::Engine> engine, const engine::Tokenizer& tokenizer,
            engine::EndTokens end_tokens, size_t queue_limit,
            std::function<void(const std::string&)> on_daemon_gone);
  ~Generator();  // stop()s
  Generator(const Generator&) = delete;
  Generator& operator=(const Generator&) = delete;

  // Queues `job`; false when the queue is full.
  bool submit(std::shared_ptr<Job> job);
  // Ends the engine thread after the job in progress (which is cancelled); queued jobs end with
  // an error.
  void stop();

  // Jobs waiting; those whose client has left are dropped first and free their place.
  size_t queued();
  bool busy() const;
  uint64_t served() const;
  const engine::Engine& engine() const { return *engine_; }

 private:
  void loop();
  void drop_cancelled_locked();  // mu_ held
  // Refuses new jobs, cancels the one in progress and answers the queued ones 503 with `why`.
  void close(const std::string& why);
  // Runs `job`; returns the engine's error when it failed.
  std::optional<Error> run(Job& job);
  // Feeds the prompt, reusing the longest prefix the KV cache already holds; returns the reused
  // count, or an error (the cache is then reset).
  Result<uint32_t> feed_prompt(const std::vector<uint32_t>& prompt, std::span<float> logits);

  std::unique_ptr<engine::Engine> engine_;
  const engine::Tokenizer& tokenizer_;
  const engine::EndTokens end_tokens_;
  const size_t queue_limit_;
  const std::function<void(const std::string&)> on_daemon_gone_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::shared_ptr<Job> current_;
  bool stopping_ = false;
  uint64_t served_ = 0;

  // Engine thread only: the tokens the KV cache holds, position by position.
  std::vector<uint32_t> fed_;
  std::vector<float> logits_;
  std::thread thread_;
};

}  // namespace expertd::serve
