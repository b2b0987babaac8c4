// The I/O backend interface of the storage engine, and its implementations:
//  - io_uring (liburing): O_DIRECT, registered files and buffers, doorbell fds polled in the ring;
//  - a preadv2 thread pool with the same contract, used when io_uring is unavailable (EPERM,
//    ENOSYS, ENOMEM on memlock) or chosen by configuration;
//  - a seeded fault-injecting wrapper for tests (EIO, short reads with unaligned remainders,
//    EAGAIN, delays, out-of-order completion).
//
// Contract. The owner (one thread: the storage reactor) submits ReadOps it owns; an op's address is
// its identity (the io_uring user_data), so nothing is allocated per I/O. A submitted op belongs
// to the backend until it comes back from wait(); the owner must not touch or free it before.
// Every submitted op comes back exactly once, with `result` set to the bytes read (possibly fewer
// than asked: short reads are the caller's to requeue, as the Scheduler does) or -errno
// (-ECANCELED after cancel()). Ops on the direct fd must have offset, len and dst aligned to
// the file's dio_alignment(); ops on the buffered fd need no alignment. While the backend owns an
// op its `result` reads kReadPending; submitting an op that is still pending is a bug (asserted).
// Nothing is allocated per I/O: queues are sized from BackendOptions when the backend is made.
//
// Backends are single-threaded objects: every method is called from the owner thread. Destroying
// a backend with ops in flight waits for the kernel/threads to stop writing into their buffers;
// those ops never come back (their `result` is then unspecified).
#pragma once

#include <sys/uio.h>

#include <climits>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "expertd/result.h"

namespace expertd {

// ReadOp::result while the op belongs to the backend.
inline constexpr int32_t kReadPending = INT32_MIN;

struct ReadOp {
  // Set by the owner before submit().
  uint32_t file = 0;       // index into the files given to open_files()
  bool direct = true;      // the O_DIRECT fd (aligned) or the buffered fd (any alignment)
  uint64_t offset = 0;     // file offset
  uint32_t len = 0;        // bytes to read, > 0
  uint8_t* dst = nullptr;  // destination, inside a registered buffer when one covers it
  uint64_t cookie = 0;     // the owner's, untouched by the backend
  // Set by the backend when the op comes back from wait().
  int32_t result = 0;  // bytes read (0 = end of file) or -errno
};

// One thing wait() reports: a finished read, or a watched fd that became readable.
struct IoEvent {
  enum class Kind : uint8_t { Read, Fd } kind = Kind::Read;
  ReadOp* op = nullptr;  // Kind::Read
  uint64_t tag = 0;      // Kind::Fd: the tag given to watch()
};

struct FileInfo {
  std::string path;
  uint64_t size_bytes = 0;
  uint32_t dio_alignment = 4096;  // offset/length/memory alignment for the direct fd
  std::string alignment_source;   // "statx", "logical block size" or "default"
  bool direct_io = true;  // false: the file system refused O_DIRECT; the direct fd is buffered
};

struct BackendStats {
  uint64_t reads_submitted = 0;
  uint64_t bytes_read = 0;
  uint64_t errors = 0;       // ops back with -errno (-ECANCELED too), watches that failed
  uint64_t fixed_reads = 0;  // reads issued into a registered buffer (io_uring READ_FIXED)
  uint32_t in_flight = 0;
};

class ReadBackend {
 public:
  virtual ~ReadBackend() = default;

  // "io_uring", "pread", or a wrapper's name ("faulty(io_uring)").
  virtual std::string_view name() const = 0;
  // One line for logs and status: e.g. "io_uring: registered buffers, registered files,
  // SQPOLL off" or "pread: 8 threads (io_uring unavailable: EPERM ...)".
  virtual std::string describe() const = 0;

  // Opens every file twice, O_DIRECT and buffered (read-only), registers them where the backend
  // can, and probes each file's direct-I/O alignment. Called once, before any submit().
  virtual Status open_files(std::span<const std::string> paths) = 0;
  virtual const FileInfo& file(uint32_t index) const = 0;

  // Registers memory the ops will read into (the arena). Optional: a backend that cannot register
  // (or the kernel refuses) still reads into unregistered memory and says so in describe().
  virtual Status register_buffers(std::span<const iovec> buffers) = 0;

  // Queues an op; false when the submission queue is full (call wait() and retry).
  virtual bool submit(ReadOp* op) = 0;
  // Passes queued ops to the kernel/threads without waiting. Returns -errno on failure.
  virtual int flush() = 0;
  // Asks for an op in flight to end early; it still comes back from wait() exactly once, with
  // -ECANCELED or with its normal result if it finished first. No-op for an unknown op. Only ops
  // not yet started are cancelled in practice: io_uring file reads are issued at submission
  // (O_DIRECT bios, async buffered reads), so there cancel() rarely ends one; the pread backend
  // ends the ops no worker has taken yet.
  virtual void cancel(ReadOp* op) = 0;

  // Reports fd readability as IoEvent::Kind::Fd with `tag`; re-armed automatically. Used for client
  // doorbell eventfds: the owner reads (clears) the fd after the event; the backend never consumes
  // its data. io_uring reports each wake-up once (multishot poll; single-shot polls are re-armed
  // at the next wait(), after the owner has cleared the fd); the pread backend poll()s, so it
  // reports an fd again at every wait() while it stays readable. At most max_watches fds.
  virtual Status watch(int fd, uint64_t tag) = 0;
  virtual Status unwatch(int fd) = 0;

  // Flushes, then waits up to timeout_ms (0 = poll, -1 = forever) for at least one event and
  // returns how many it wrote to `out` (0 on timeout), or -errno.
  virtual int wait(std::span<IoEvent> out, int timeout_ms) = 0;

  virtual uint32_t queue_depth() const = 0;  // submissions the backend accepts at once
  virtual BackendStats stats() const = 0;
};

enum class BackendKind { Uring, Pread };

struct BackendOptions {
  uint32_t queue_depth = 64;  // reads in flight at once (submit() returns false beyond)
  uint32_t pread_threads = 8;
  uint32_t max_watches = 64;  // watched fds at once
};

// io_uring; on EPERM/ENOSYS/ENOMEM (or a missing feature: READ, POLL_ADD) returns the error, whose
// message says the likely cause (io_uring_disabled sysctl, seccomp, RLIMIT_MEMLOCK).
//
// Testing the fallback: with the environment variable EXPERTD_FORCE_URING_FAILURE set to EPERM,
// ENOSYS or ENOMEM, make_uring_backend fails as if io_uring_queue_init had returned that error
// (the message ends with "[forced by EXPERTD_FORCE_URING_FAILURE]"), so make_backend falls back.
Result<std::unique_ptr<ReadBackend>> make_uring_backend(const BackendOptions& options);
Result<std::unique_ptr<ReadBackend>> make_pread_backend(const BackendOptions& options);

// The backend the configuration asks for; Uring falls back to Pread when make_uring_backend fails
// (for any reason), and `*fallback_reason` (if non-null) receives the one-line reason (empty when
// no fallback); the pread backend's describe() repeats it.
Result<std::unique_ptr<ReadBackend>> make_backend(BackendKind kind, const BackendOptions& options,
                                                  std::string* fallback_reason);

struct FaultOptions {
  uint64_t seed = 1;
  double eio_rate = 0.0;     // op completes with -EIO (nothing read)
  double short_rate = 0.0;   // op completes with fewer bytes than asked (maybe unaligned)
  double eagain_rate = 0.0;  // op completes with -EAGAIN (nothing read)
  double delay_rate = 0.0;   // op's completion is held back for 1..max_delay_waits wait()s
  uint32_t max_delay_waits = 4;
  bool reorder = false;  // completions of one wait() are shuffled
  // Restricts EIO to reads overlapping [eio_offset, eio_offset + eio_bytes) of eio_file (all
  // reads when eio_bytes == 0), so a test can fail exactly one expert.
  uint32_t eio_file = 0;
  uint64_t eio_offset = 0;
  uint64_t eio_bytes = 0;
  // Reads overlapping [hang_offset, hang_offset + hang_bytes) of hang_file never complete: a
  // stalled device. They are held here, never passed to inner, and come back (-ECANCELED) only
  // when cancel()ed, or, with hang_ignores_cancel (a bio the kernel cannot take back), never.
  uint32_t hang_file = 0;
  uint64_t hang_offset = 0;
  uint64_t hang_bytes = 0;
  bool hang_ignores_cancel = false;
};

// What the fault injector did so far (ops it faulted, batches it shuffled).
struct FaultStats {
  uint64_t eio = 0;
  uint64_t eagain = 0;
  uint64_t short_reads = 0;
  uint64_t delayed = 0;
  uint64_t reordered_batches = 0;  // wait() results whose order the shuffle changed
  uint64_t hung = 0;               // reads held as never completing
};

class FaultyBackend : public ReadBackend {
 public:
  virtual FaultStats fault_stats() const = 0;
};

// Wraps `inner`; injected faults are decided by a seeded generator, per op in submission order,
// so a failing test replays: the n-th accepted submit() gets the same fault for the same seed.
// EIO and EAGAIN ops are not passed to `inner`; short reads are real reads whose result is cut
// to [1, result - 1] bytes (about half of the cuts land on the DIO alignment). A wait() that would
// otherwise return nothing releases the delayed ops, so a delay never blocks the owner.
std::unique_ptr<FaultyBackend> make_faulty_backend(std::unique_ptr<ReadBackend> inner,
                                                   const FaultOptions& options);

}  // namespace expertd
