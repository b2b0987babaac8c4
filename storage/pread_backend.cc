// The preadv2 thread-pool backend, used where io_uring is unavailable, and make_backend().
//
// The owner pushes ops into `pending_`; a worker pops one, reads, pushes it into `done_` and, when
// `done_` was empty, writes the completion eventfd. wait() poll()s that eventfd and the watched
// fds, reads the eventfd (before draining `done_`, so a completion pushed after the drain rings it
// again) and drains. Both queues hold at most queue_depth ops: submit() says no beyond.
#include <fmt/format.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "base/check.h"
#include "base/clock.h"
#include "storage/file_probe.h"
#include "storage/reader.h"

namespace expertd {
namespace {

// A ring of pointers with a capacity fixed at construction: free-running u32 head/tail.
class PtrQueue {
 public:
  explicit PtrQueue(uint32_t capacity) : slots_(capacity) {}
  bool empty() const { return head_ == tail_; }
  uint32_t size() const { return tail_ - head_; }
  void push(ReadOp* op) {
    EXPERTD_CHECK_LT(size(), slots_.size());  // queue bounded by queue_depth
    slots_[tail_++ % slots_.size()] = op;
  }
  ReadOp* pop() {
    EXPERTD_CHECK(!empty());
    return slots_[head_++ % slots_.size()];
  }
  // Removes `op` if queued (keeping the order of the others); returns whether it was.
  bool remove(const ReadOp* op) {
    for (uint32_t i = head_; i != tail_; ++i) {
      if (slots_[i % slots_.size()] != op) continue;
      for (uint32_t j = i; j + 1 != tail_; ++j) {
        slots_[j % slots_.size()] = slots_[(j + 1) % slots_.size()];
      }
      --tail_;
      return true;
    }
    return false;
  }

 private:
  std::vector<ReadOp*> slots_;
  uint32_t head_ = 0;
  uint32_t tail_ = 0;
};

struct WatchedFd {
  int fd = -1;
  uint64_t tag = 0;
};

class PreadBackend final : public ReadBackend {
 public:
  PreadBackend(const BackendOptions& options, std::string note)
      : queue_depth_(options.queue_depth),
        max_watches_(options.max_watches),
        thread_count_(options.pread_threads),
        note_(std::move(note)),
        pending_(options.queue_depth),
        done_(options.queue_depth),
        cancelled_(options.queue_depth) {
    watches_.reserve(max_watches_);
    pollfds_.reserve(1 + max_watches_);
  }
  ~PreadBackend() override;

  // Returns 0 or -errno.
  int start() {
    event_fd_ = UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!event_fd_.valid()) return -errno;
    pollfds_.push_back({event_fd_.get(), POLLIN, 0});
    for (uint32_t i = 0; i < thread_count_; ++i) workers_.emplace_back([this] { work(); });
    return 0;
  }

  std::string_view name() const override { return "pread"; }
  std::string describe() const override {
    return fmt::format("pread: {} threads, queue depth {}, buffers not registered{}", thread_count_,
                       queue_depth_, note_.empty() ? "" : " (" + note_ + ")");
  }
  Status open_files(std::span<const std::string> paths) override;
  const FileInfo& file(uint32_t index) const override {
    EXPERTD_CHECK_LT(index, files_.size());
    return files_[index].info;
  }
  Status register_buffers(std::span<const iovec>) override { return Ok{}; }
  bool submit(ReadOp* op) override;
  int flush() override { return 0; }  // submit() hands ops to the workers directly
  void cancel(ReadOp* op) override;
  Status watch(int fd, uint64_t tag) override;
  Status unwatch(int fd) override;
  int wait(std::span<IoEvent> out, int timeout_ms) override;
  uint32_t queue_depth() const override { return queue_depth_; }
  BackendStats stats() const override {
    BackendStats s = stats_;
    s.in_flight = in_flight_;
    return s;
  }

 private:
  void work();
  int32_t read_one(const ReadOp& op) const;
  size_t drain(std::span<IoEvent> out);
  void account(const ReadOp& op);
  size_t report_fds(std::span<IoEvent> out);

  const uint32_t queue_depth_;
  const uint32_t max_watches_;
  const uint32_t thread_count_;
  const std::string note_;
  std::vector<OpenedFile> files_;  // fixed before the first submit(): workers only read it

  std::mutex mu_;
  std::condition_variable work_cv_;
  PtrQueue pending_;       // guarded by mu_
  PtrQueue done_;          // guarded by mu_
  bool stopping_ = false;  // guarded by mu_

  PtrQueue cancelled_;  // owner only: ended by cancel() before a worker took them
  UniqueFd event_fd_;
  std::vector<WatchedFd> watches_;
  std::vector<pollfd> pollfds_;  // [0] is event_fd_, then one per watch, in the same order
  std::vector<std::thread> workers_;
  uint32_t in_flight_ = 0;
  BackendStats stats_;
};

PreadBackend::~PreadBackend() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();  // a read in progress finishes first
}

Status PreadBackend::open_files(std::span<const std::string> paths) {
  EXPERTD_CHECK(files_.empty());
  EXPERTD_CHECK_EQ(in_flight_, 0);  // open_files is called once
  files_.reserve(paths.size());
  for (const std::string& path : paths) {
    EXPERTD_TRY_ASSIGN(OpenedFile f, open_data_file(path));
    files_.push_back(std::move(f));
  }
  return Ok{};
}

int32_t PreadBackend::read_one(const ReadOp& op) const {
  const OpenedFile& f = files_[op.file];
  iovec iov{op.dst, op.len};
  for (;;) {
    const ssize_t n = ::preadv2(op.direct ? f.direct.get() : f.buffered.get(), &iov, 1,
                                static_cast<off_t>(op.offset), 0);
    if (n >= 0) return static_cast<int32_t>(n);
    if (errno != EINTR) return -errno;
  }
}

void PreadBackend::work() {
  for (;;) {
    ReadOp* op;
    {
      std::unique_lock lock(mu_);
      work_cv_.wait(lock, [this] { return stopping_ || !pending_.empty(); });
      if (stopping_) return;
      op = pending_.pop();
    }
    // The op is this worker's until pushed into done_; the mutex orders these writes before the
    // owner's reads in drain().
    op->result = read_one(*op);
    bool was_empty;
    {
      std::lock_guard lock(mu_);
      was_empty = done_.empty();
      done_.push(op);
    }
    if (was_empty) {
      const uint64_t one = 1;
      [[maybe_unused]] ssize_t n = ::write(event_fd_.get(), &one, sizeof(one));
      EXPERTD_CHECK(n == sizeof(one) || errno == EAGAIN);  // EAGAIN: the counter is at its maximum
    }
  }
}

bool PreadBackend::submit(ReadOp* op) {
  EXPERTD_CHECK_LT(op->file, files_.size());
  EXPERTD_CHECK_GT(op->len, 0);
  EXPERTD_CHECK_LE(op->len, INT32_MAX);
  EXPERTD_CHECK_NE(op->result, kReadPending);  // op submitted twice
  [[maybe_unused]] const uint32_t align = files_[op->file].info.dio_alignment;
  if (op->direct) {  // O_DIRECT: offset, length and buffer aligned
    EXPERTD_CHECK_EQ(op->offset % align, 0);
    EXPERTD_CHECK_EQ(op->len % align, 0);
    EXPERTD_CHECK_EQ(reinterpret_cast<uintptr_t>(op->dst) % align, 0);
  }
  if (in_flight_ >= queue_depth_) return false;
  op->result = kReadPending;
  {
    std::lock_guard lock(mu_);
    pending_.push(op);
  }
  work_cv_.notify_one();
  ++in_flight_;
  ++stats_.reads_submitted;
  return true;
}

void PreadBackend::cancel(ReadOp* op) {
  if (op->result != kReadPending) return;
  std::lock_guard lock(mu_);
  if (!pending_.remove(op)) return;  // a worker has it (or it is done): it ends normally
  op->result = -ECANCELED;
  cancelled_.push(op);
}

Status PreadBackend::watch(int fd, uint64_t tag) {
  for (const WatchedFd& w : watches_) {
    if (w.fd == fd) return make_error(EEXIST, fmt::format("watch: fd {} is watched already", fd));
  }
  if (watches_.size() >= max_watches_) {
    return make_error(ENOSPC, fmt::format("watch: fd {}: all {} watches in use", fd, max_watches_));
  }
  watches_.push_back({fd, tag});
  pollfds_.push_back({fd, POLLIN, 0});
  return Ok{};
}

Status PreadBackend::unwatch(int fd) {
  for (size_t i = 0; i < watches_.size(); ++i) {
    if (watches_[i].fd != fd) continue;
    watches_.erase(watches_.begin() + static_cast<ptrdiff_t>(i));
    pollfds_.erase(pollfds_.begin() + static_cast<ptrdiff_t>(i) + 1);
    return Ok{};
  }
  return make_error(ENOENT, fmt::format("unwatch: fd {} is not watched", fd));
}

void PreadBackend::account(const ReadOp& op) {
  EXPERTD_CHECK_GT(in_flight_, 0);
  --in_flight_;
  if (op.result >= 0) {
    EXPERTD_CHECK_LE(static_cast<uint32_t>(op.result), op.len);
    stats_.bytes_read += static_cast<uint64_t>(op.result);
  } else {
    ++stats_.errors;
  }
}

size_t PreadBackend::drain(std::span<IoEvent> out) {
  size_t n = 0;
  while (n < out.size() && !cancelled_.empty()) {
    ReadOp* op = cancelled_.pop();
    account(*op);
    out[n++] = IoEvent{IoEvent::Kind::Read, op, 0};
  }
  std::lock_guard lock(mu_);
  while (n < out.size() && !done_.empty()) {
    ReadOp* op = done_.pop();
    EXPERTD_CHECK_NE(op->result, kReadPending);  // op completed without a result
    account(*op);
    out[n++] = IoEvent{IoEvent::Kind::Read, op, 0};
  }
  return n;
}

size_t PreadBackend::report_fds(std::span<IoEvent> out) {
  size_t n = 0;
  for (size_t i = 0; i < watches_.size() && n < out.size(); ++i) {
    pollfd& p = pollfds_[i + 1];
    if ((p.revents & POLLNVAL) != 0) {
      p.fd = -1;  // closed under us: poll() would report it forever
      ++stats_.errors;
    } else if ((p.revents & (POLLIN | POLLERR | POLLHUP)) != 0) {
      out[n++] = IoEvent{IoEvent::Kind::Fd, nullptr, watches_[i].tag};
    }
  }
  return n;
}

int PreadBackend::wait(std::span<IoEvent> out, int timeout_ms) {
  EXPERTD_CHECK(!out.empty());
  const int64_t deadline_ms =
      timeout_ms < 0 ? 0 : static_cast<int64_t>(monotonic_ms()) + timeout_ms;
  for (;;) {
    if (const size_t n = drain(out); n > 0) return static_cast<int>(n);
    int left_ms = -1;
    if (timeout_ms >= 0)
      left_ms = static_cast<int>(
          std::max<int64_t>(0, deadline_ms - static_cast<int64_t>(monotonic_ms())));
    const int rc = ::poll(pollfds_.data(), pollfds_.size(), left_ms);
    if (rc < 0 && errno != EINTR) return -errno;
    if (rc > 0) {
      if ((pollfds_[0].revents & POLLIN) != 0) {
        uint64_t count;
        (void)::read(event_fd_.get(), &count, sizeof(count));  // clears it; before drain()
      }
      size_t n = report_fds(out);
      n += drain(out.subspan(n));
      if (n > 0) return static_cast<int>(n);
    }
    if (timeout_ms >= 0 && static_cast<int64_t>(monotonic_ms()) >= deadline_ms) return 0;
  }
}

Result<std::unique_ptr<ReadBackend>> make_pread(const BackendOptions& options, std::string note) {
  EXPERTD_CHECK_GT(options.queue_depth, 0);
  EXPERTD_CHECK_GT(options.pread_threads, 0);
  auto backend = std::make_unique<PreadBackend>(options, std::move(note));
  if (const int rc = backend->start(); rc < 0) {
    return make_error(-rc, fmt::format("pread backend: eventfd: {}", std::strerror(-rc)));
  }
  return std::unique_ptr<ReadBackend>(std::move(backend));
}

}  // namespace

Result<std::unique_ptr<ReadBackend>> make_pread_backend(const BackendOptions& options) {
  return make_pread(options, "");
}

Result<std::unique_ptr<ReadBackend>> make_backend(BackendKind kind, const BackendOptions& options,
                                                  std::string* fallback_reason) {
  if (fallback_reason != nullptr) fallback_reason->clear();
  if (kind == BackendKind::Pread) return make_pread_backend(options);
  auto uring = make_uring_backend(options);
  if (uring.ok()) return uring;
  const std::string reason =
      fmt::format("io_uring unavailable: {}; using the pread thread pool", uring.error().message);
  if (fallback_reason != nullptr) *fallback_reason = reason;
  return make_pread(options, reason);
}

}  // namespace expertd
