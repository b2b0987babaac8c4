// expert-serve's engine side: one thread owns the Engine and runs up to Engine::sequences()
// requests at once (--parallel), one per sequence; more wait in a bounded queue. Each turn of its
// loop admits waiting requests into free sequences, feeds one prefill chunk of one sequence still
// reading its prompt, then one decode step of every sequence that is generating
// (Engine::decode_batch: each routed expert read once for all of them). A long prompt therefore
// does not stop the others for its whole length. Each sequence's KV cache is kept after its
// request: a new request goes to the free sequence whose cached tokens share the longest prefix
// with its prompt, continues from their positions (Engine::truncate) and prefills the rest.
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

#include "engine/batch_width.h"
#include "engine/engine.h"
#include "text/generation.h"
#include "text/reasoning.h"
#include "text/sampler.h"
#include "text/stop.h"
#include "text/tokenizer.h"

namespace expertd::serve {

struct Job {
  // Fixed before submit().
  uint64_t id = 0;
  std::string kind;  // "completion" or "chat", for the log
  std::vector<uint32_t> prompt;
  // How the answer is generated (text/generation.h): sampling, the template's end strings and
  // the request's stops, the reasoning syntax, max_tokens, ignore_eos (stop_at_end_token false),
  // logprobs.
  text::GenerationOptions gen;

  // Chat with tools (not read by the generator): kParse looks for the template's tool calls in the
  // answer; kForced prefilled the call's opening and constrained the answer to its JSON.
  enum class Tools { kNone, kParse, kForced };
  Tools tools = Tools::kNone;
  bool parallel_tool_calls = true;
  // kForced: the text written after the generation prompt, and the function whose arguments the
  // constrained JSON is ("": the JSON is the call, {"name", "arguments"}).
  std::string forced_opening;
  std::string forced_function;

  std::atomic<bool> cancelled{false};
  uint64_t submitted_ns = 0;  // monotonic, set by submit(): the time to first token starts here

  // Output, guarded by mu.
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  // Text generated and not yet taken by the HTTP side (bytes: not necessarily valid UTF-8): the
  // content, and the reasoning apart from it.
  std::string text;
  std::string reasoning_text;
  std::vector<text::TokenLogprob> logprobs_out;  // with logprobs: each token's, not yet taken
  std::string finish_reason;                     // "stop" or "length" once done
  uint32_t completion_tokens = 0;
  uint32_t cached_tokens = 0;  // prompt positions reused from the previous sequence
  std::string error;           // the request failed: its answer is error_status with this
  int error_status = 500;      // 500: the engine failed; 503: the server is shutting down
};

// What the engine thread has done, for /metrics (read from any thread).
struct GeneratorCounters {
  std::atomic<uint64_t> requests{0};          // jobs ended (answered, failed or cancelled)
  std::atomic<uint64_t> prompt_tokens{0};     // their prompts' tokens
  std::atomic<uint64_t> cached_tokens{0};     // of those, reused from a sequence's cache
  std::atomic<uint64_t> generated_tokens{0};  // tokens sampled
  std::atomic<uint64_t> first_tokens{0};      // jobs that got a first token
  std::atomic<uint64_t> first_token_ns{0};    // their times from submit() to it, summed
  std::atomic<uint64_t> steps{0};             // decode steps (Engine::decode_batch calls)
  std::atomic<uint64_t> rows{0};              // sequences fed by them
};

class Generator {
 public:
  // `queue_limit`: jobs that may wait while one runs; submit() refuses more.
  // `on_daemon_gone` runs on the engine thread, once, after a request failed because expertd
  // went away (ECONNRESET from the client library): the engine cannot serve again.
  Generator(std::unique_ptr<engine::Engine> engine, const text::Tokenizer& tokenizer,
            text::EndTokens end_tokens, size_t queue_limit,
            std::function<void(const std::string&)> on_daemon_gone);
  ~Generator();  // stop()s
  Generator(const Generator&) = delete;
  Generator& operator=(const Generator&) = delete;

  // Queues `job`; false when the queue is full.
  bool submit(std::shared_ptr<Job> job);
  // Queues every job of `jobs` (a request's choices), or none when they do not all fit: the
  // queue's room plus the sequences free now.
  bool submit_all(const std::vector<std::shared_ptr<Job>>& jobs);
  // Ends the engine thread after the job in progress (which is cancelled); queued jobs end with
  // an error.
  void stop();

  // Jobs waiting; those whose client has left are dropped first and free their place.
  size_t queued();
  bool busy() const;
  size_t running() const;  // jobs on a sequence now
  size_t parallel() const { return slots_.size(); }
  uint64_t served() const;
  const engine::Engine& engine() const { return *engine_; }
  const GeneratorCounters& counters() const { return counters_; }

 private:
  using Generation = text::Generation;
  // A sequence of the engine and the job on it.
  struct Slot {
    std::shared_ptr<Job> job;         // null: free
    std::vector<uint32_t> fed;        // the tokens its KV cache holds, position by position
    std::unique_ptr<Generation> gen;  // once started
    bool started = false;             // the prompt's reuse was decided, its chunks began
    std::optional<uint32_t> pending;  // the token its next decode step feeds
    uint32_t cached = 0;              // prompt positions reused
    uint64_t t0 = 0, t_prompt = 0;    // start, end of the prompt (monotonic ns)
    uint64_t chunks = 0, steps = 0, rows_seen = 0;  // prefill chunks; decode steps, their rows
  };

  void loop();
  // Waits for work; moves waiting jobs into free sequences. False: stop.
  bool admit();
  // The free sequence whose cached tokens share the longest prefix with `prompt`.
  size_t pick_slot(const std::vector<uint32_t>& prompt) const;
  // Sequence i's next prompt chunk (the first call decides the prefix reuse); after the last
  // one, its first token. Returns the engine's error when it failed (the job is then failed).
  std::optional<Error> prefill_step(size_t i);
  // One decode step of every generating sequence.
  std::optional<Error> decode_step();
  // The job of sequence i is complete (or cancelled): its held-back text, the log line.
  void end_job(size_t i, bool cancelled);
  // Fails sequence i's job with `e` (its cache is reset); returns e.
  std::optional<Error> fail(size_t i, const Error& e);
  // Hands the text `g` made last to `job` (and, when done, its finish reason); wakes its reader.
  static void publish(Job& job, const Generation& g, bool done);
  // Frees sequence i: the job is done.
  void release(size_t i);
  void drop_cancelled_locked();  // mu_ held
  // Refuses new jobs, cancels the running ones and answers the queued ones 503 with `why`.
  void close(const std::string& why);

  std::unique_ptr<engine::Engine> engine_;
  const text::Tokenizer& tokenizer_;
  const text::EndTokens end_tokens_;
  const size_t queue_limit_;
  const std::function<void(const std::string&)> on_daemon_gone_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::vector<std::shared_ptr<Job>> running_;  // the jobs on a sequence
  bool stopping_ = false;
  uint64_t served_ = 0;
  GeneratorCounters counters_;

  // Engine thread only.
  std::vector<Slot> slots_;    // one per engine sequence
  std::vector<float> logits_;  // [sequences][n_vocab]
  std::vector<engine::BatchRow> rows_;
  std::vector<size_t> slot_of_;  // rows_[r]'s slot
  engine::BatchWidth width_;     // the rows a step takes (engine/batch_width.h)
  std::thread thread_;
};

}  // namespace expertd::serve
