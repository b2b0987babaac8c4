// The io_uring backend (liburing).
//
// user_data of every SQE says what its CQE is for, by the low 3 bits (ReadOps and Watches are
// 8-byte aligned):
//   0  a ReadOp*: the read;
//   1  a Watch* | 1: a poll on a watched fd (the Watch lives in a fixed table, never moved);
//   kInternalUserData: a cancel or poll-remove request; its CQE only decrements a counter.
//
// Bounds: at most queue_depth reads in flight (submit() says no beyond), at most max_watches polls
// and queue_depth + max_watches internal requests, so the CQ (sized for all of them) does not
// overflow; should it anyway (multishot polls post one CQE per wake-up), the kernel keeps the
// overflow (IORING_FEAT_NODROP) and ends the multishot poll, which is then re-armed.
#include <fcntl.h>
#include <fmt/format.h>
#include <liburing.h>
#include <poll.h>
#include <sys/resource.h>
#include <time.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "base/check.h"
#include "base/clock.h"
#include "storage/file_probe.h"
#include "storage/owned_ring.h"
#include "storage/reader.h"

namespace expertd {
namespace {

constexpr uint64_t kTagMask = 7;
constexpr uint64_t kTagWatch = 1;
constexpr uint64_t kInternalUserData = 2;
constexpr size_t kMaxBufferPieceBytes = size_t{1} << 30;  // the kernel's limit per iovec
constexpr size_t kMaxRegisteredBuffers = 16384;           // IORING_MAX_REG_BUFFERS

struct alignas(8) Watch {
  enum class State : uint8_t { Free, Armed, NeedsArm, Removing, Failed };
  State state = State::Free;
  int fd = -1;
  uint64_t tag = 0;
};

struct Features {
  bool read_fixed = false;
  bool async_cancel = false;
  bool multishot_poll = false;
};

struct FixedBuffer {
  uintptr_t begin = 0;
  uintptr_t end = 0;
  uint16_t index = 0;
};

std::string errno_name(int err) {
  switch (err) {
    case EPERM:
      return "EPERM";
    case ENOSYS:
      return "ENOSYS";
    case ENOMEM:
      return "ENOMEM";
    default:
      return std::strerror(err);
  }
}

std::string read_io_uring_disabled() {
  FILE* f = std::fopen("/proc/sys/kernel/io_uring_disabled", "re");
  if (f == nullptr) return "absent";
  int value = -1;
  const bool ok = std::fscanf(f, "%d", &value) == 1;
  std::fclose(f);
  return ok ? std::to_string(value) : "unreadable";
}

std::string memlock_limit() {
  rlimit lim{};
  if (getrlimit(RLIMIT_MEMLOCK, &lim) != 0) return "unknown";
  if (lim.rlim_cur == RLIM_INFINITY) return "unlimited";
  return fmt::format("{} KiB", lim.rlim_cur / 1024);
}

// The message for a failed io_uring_queue_init, naming the likely cause.
Error setup_error(int err, uint32_t entries, bool forced) {
  std::string cause;
  if (err == EPERM) {
    cause = fmt::format(
        "io_uring is refused to this process (kernel.io_uring_disabled={}; 2 disables it, 1 allows "
        "only the io_uring_group; else a seccomp filter, e.g. a container runtime's default)",
        read_io_uring_disabled());
  } else if (err == ENOSYS) {
    cause = "the kernel has no io_uring (older than 5.1, or built without CONFIG_IO_URING)";
  } else if (err == ENOMEM) {
    cause = fmt::format(
        "the rings could not be locked in memory (RLIMIT_MEMLOCK is {}; raise "
        "`ulimit -l` or LimitMEMLOCK=)",
        memlock_limit());
  } else {
    cause = "unexpected";
  }
  return make_error(err, fmt::format("io_uring_queue_init({}): {} ({}): {}{}", entries,
                                     std::strerror(err), errno_name(err), cause,
                                     forced ? " [forced by EXPERTD_FORCE_URING_FAILURE]" : ""));
}

// EXPERTD_FORCE_URING_FAILURE=EPERM|ENOSYS|ENOMEM: the errno to fail with, else 0.
int forced_failure() {
  const char* value = std::getenv("EXPERTD_FORCE_URING_FAILURE");
  if (value == nullptr) return 0;
  const std::string v = value;
  if (v == "EPERM") return EPERM;
  if (v == "ENOSYS") return ENOSYS;
  if (v == "ENOMEM") return ENOMEM;
  return 0;
}

class UringBackend final : public ReadBackend {
 public:
  UringBackend(const BackendOptions& options, const Features& features)
      : queue_depth_(options.queue_depth),
        max_internal_(options.queue_depth + options.max_watches),
        max_watches_(options.max_watches),
        features_(features),
        watches_(std::make_unique<Watch[]>(options.max_watches)) {}

  ~UringBackend() override;

  // Called once by make_uring_backend; returns 0 or -errno.
  int init_ring() {
    io_uring_params params{};
    // No COOP_TASKRUN: completions would then wait for our next syscall, and wait(0) only peeks.
    params.flags = IORING_SETUP_CQSIZE | IORING_SETUP_SUBMIT_ALL;
    params.cq_entries = 2 * (queue_depth_ + max_internal_);
    int rc = ring_.init(queue_depth_, params);
    if (rc == -EINVAL) {  // a kernel older than 5.18: no SUBMIT_ALL
      params = io_uring_params{};
      params.flags = IORING_SETUP_CQSIZE;
      params.cq_entries = 2 * (queue_depth_ + max_internal_);
      rc = ring_.init(queue_depth_, params);
    }
    if (rc < 0) return rc;
    // The opcode probe cannot see flags; multishot poll came with 5.13, as did RSRC_TAGS. A kernel
    // that still refuses it answers -EINVAL, and the watches fall back to single-shot polls.
    features_.multishot_poll = (ring_.get()->features & IORING_FEAT_RSRC_TAGS) != 0;
    return 0;
  }

  std::string_view name() const override { return "io_uring"; }
  std::string describe() const override;
  Status open_files(std::span<const std::string> paths) override;
  const FileInfo& file(uint32_t index) const override {
    EXPERTD_CHECK_LT(index, files_.size());
    return files_[index].info;
  }
  Status register_buffers(std::span<const iovec> buffers) override;
  bool submit(ReadOp* op) override;
  int flush() override;
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
  io_uring_sqe* internal_sqe();
  void prep_read(io_uring_sqe* sqe, ReadOp* op);
  const FixedBuffer* find_buffer(const uint8_t* dst, uint32_t len) const;
  void arm(Watch& w);
  void arm_pending_watches();
  int reap(std::span<IoEvent> out);
  bool handle_cqe(const io_uring_cqe& cqe, IoEvent* event);
  bool handle_watch_cqe(Watch& w, const io_uring_cqe& cqe, IoEvent* event);
  int enter(uint64_t deadline_ns, int timeout_ms);
  void drain_for_exit();

  OwnedRing ring_;  // first: it goes last, after drain_for_exit() reaped what used the rest
  const uint32_t queue_depth_;
  const uint32_t max_internal_;
  const uint32_t max_watches_;
  Features features_;
  std::vector<OpenedFile> files_;
  bool files_registered_ = false;
  std::string files_note_;
  std::vector<FixedBuffer> buffers_;  // sorted by begin; fixed after register_buffers()
  size_t buffer_bytes_ = 0;
  std::string buffers_note_ = "no registered buffers";
  std::unique_ptr<Watch[]> watches_;  // addresses are user_data: never reallocated
  uint32_t in_flight_ = 0;
  uint32_t internal_in_flight_ = 0;
  uint32_t polls_in_flight_ = 0;
  BackendStats stats_;
};

UringBackend::~UringBackend() {
  if (ring_.valid()) drain_for_exit();  // then ring_ exits the ring
}

// The kernel ends requests of a closed ring asynchronously, so reads still in flight could write
// into the owner's memory after we return: cancel everything and reap until they are done.
void UringBackend::drain_for_exit() {
  if (in_flight_ + polls_in_flight_ + internal_in_flight_ == 0) return;
  if (io_uring_sqe* sqe = internal_sqe()) {
    io_uring_prep_cancel64(sqe, 0, IORING_ASYNC_CANCEL_ANY);
    io_uring_sqe_set_data64(sqe, kInternalUserData);
    ++internal_in_flight_;
  }
  for (uint32_t i = 0; i < max_watches_; ++i) {
    const Watch::State st = watches_[i].state;
    if (st != Watch::State::Free && st != Watch::State::Removing) (void)unwatch(watches_[i].fd);
  }
  const uint64_t deadline_ns = monotonic_ns() + 10'000'000'000u;
  std::array<IoEvent, 64> sink;
  while (in_flight_ + polls_in_flight_ + internal_in_flight_ > 0 && monotonic_ns() < deadline_ns) {
    if (wait(sink, 100) < 0) break;
  }
}

std::string UringBackend::describe() const {
  return fmt::format("io_uring: queue depth {}, {}, {}, {} poll, SQPOLL off", queue_depth_,
                     files_note_.empty() ? "no files" : files_note_, buffers_note_,
                     features_.multishot_poll ? "multishot" : "single-shot");
}

Status UringBackend::open_files(std::span<const std::string> paths) {
  EXPERTD_CHECK(files_.empty());  // open_files is called once
  files_.reserve(paths.size());
  std::vector<int> fds;
  fds.reserve(2 * paths.size());
  for (const std::string& path : paths) {
    EXPERTD_TRY_ASSIGN(OpenedFile f, open_data_file(path));
    fds.push_back(f.direct.get());
    fds.push_back(f.buffered.get());
    files_.push_back(std::move(f));
  }
  const int rc =
      io_uring_register_files(ring_.get(), fds.data(), static_cast<unsigned>(fds.size()));
  files_registered_ = rc == 0;
  files_note_ =
      rc == 0 ? "registered files"
              : fmt::format("unregistered files (io_uring_register_files: {})", std::strerror(-rc));
  return Ok{};
}

Status UringBackend::register_buffers(std::span<const iovec> buffers) {
  EXPERTD_CHECK_EQ(in_flight_, 0);  // no fixed reads may be in flight while buffers change
  if (!buffers_.empty()) (void)io_uring_unregister_buffers(ring_.get());
  buffers_.clear();
  buffer_bytes_ = 0;
  if (!features_.read_fixed) {
    buffers_note_ = "unregistered buffers (no IORING_OP_READ_FIXED)";
    return Ok{};
  }
  std::vector<iovec> pieces;
  for (const iovec& b : buffers) {
    for (size_t done = 0; done < b.iov_len; done += kMaxBufferPieceBytes) {
      pieces.push_back({static_cast<uint8_t*>(b.iov_base) + done,
                        std::min(kMaxBufferPieceBytes, b.iov_len - done)});
    }
  }
  if (pieces.size() > kMaxRegisteredBuffers) {
    return make_error(EINVAL, fmt::format("register_buffers: {} pieces of <= 1 GiB, at most {}",
                                          pieces.size(), kMaxRegisteredBuffers));
  }
  const int rc =
      io_uring_register_buffers(ring_.get(), pieces.data(), static_cast<unsigned>(pieces.size()));
  if (rc < 0) {
    buffers_note_ = fmt::format(
        "unregistered buffers (io_uring_register_buffers: {}; "
        "RLIMIT_MEMLOCK {})",
        std::strerror(-rc), memlock_limit());
    return Ok{};
  }
  for (size_t i = 0; i < pieces.size(); ++i) {
    const auto begin = reinterpret_cast<uintptr_t>(pieces[i].iov_base);
    buffers_.push_back({begin, begin + pieces[i].iov_len, static_cast<uint16_t>(i)});
    buffer_bytes_ += pieces[i].iov_len;
  }
  std::sort(buffers_.begin(), buffers_.end(),
            [](const FixedBuffer& a, const FixedBuffer& b) { return a.begin < b.begin; });
  buffers_note_ = fmt::format("registered buffers ({} MiB in {} piece{})", buffer_bytes_ >> 20,
                              buffers_.size(), buffers_.size() == 1 ? "" : "s");
  return Ok{};
}

const FixedBuffer* UringBackend::find_buffer(const uint8_t* dst, uint32_t len) const {
  const auto begin = reinterpret_cast<uintptr_t>(dst);
  auto it = std::upper_bound(buffers_.begin(), buffers_.end(), begin,
                             [](uintptr_t v, const FixedBuffer& b) { return v < b.begin; });
  if (it == buffers_.begin()) return nullptr;
  --it;
  return begin + len <= it->end ? &*it : nullptr;
}

void UringBackend::prep_read(io_uring_sqe* sqe, ReadOp* op) {
  const OpenedFile& f = files_[op->file];
  const int fd = files_registered_ ? static_cast<int>(2 * op->file + (op->direct ? 0 : 1))
                                   : (op->direct ? f.direct.get() : f.buffered.get());
  if (const FixedBuffer* b = find_buffer(op->dst, op->len)) {
    io_uring_prep_read_fixed(sqe, fd, op->dst, op->len, op->offset, b->index);
    ++stats_.fixed_reads;
  } else {
    io_uring_prep_read(sqe, fd, op->dst, op->len, op->offset);
  }
  if (files_registered_) sqe->flags |= IOSQE_FIXED_FILE;
  io_uring_sqe_set_data(sqe, op);
}

bool UringBackend::submit(ReadOp* op) {
  EXPERTD_CHECK_LT(op->file, files_.size());
  EXPERTD_CHECK_GT(op->len, 0);
  EXPERTD_CHECK_LE(op->len, INT32_MAX);
  EXPERTD_CHECK_NE(op->result, kReadPending);  // op submitted twice
  EXPERTD_CHECK_EQ((reinterpret_cast<uintptr_t>(op) & kTagMask), 0);
  [[maybe_unused]] const uint32_t align = files_[op->file].info.dio_alignment;
  if (op->direct) {  // O_DIRECT: offset, length and buffer aligned
    EXPERTD_CHECK_EQ(op->offset % align, 0);
    EXPERTD_CHECK_EQ(op->len % align, 0);
    EXPERTD_CHECK_EQ(reinterpret_cast<uintptr_t>(op->dst) % align, 0);
  }
  if (in_flight_ >= queue_depth_) return false;
  io_uring_sqe* sqe = io_uring_get_sqe(ring_.get());
  if (sqe == nullptr) return false;
  prep_read(sqe, op);
  op->result = kReadPending;
  ++in_flight_;
  ++stats_.reads_submitted;
  return true;
}

int UringBackend::flush() {
  const int rc = io_uring_submit(ring_.get());
  return rc < 0 ? rc : 0;
}

// An SQE for a request of our own; makes room by submitting when the SQ is full.
io_uring_sqe* UringBackend::internal_sqe() {
  io_uring_sqe* sqe = io_uring_get_sqe(ring_.get());
  if (sqe == nullptr && io_uring_submit(ring_.get()) >= 0) sqe = io_uring_get_sqe(ring_.get());
  return sqe;
}

void UringBackend::cancel(ReadOp* op) {
  // An op that is not pending is not ours (or came back already): nothing to cancel.
  if (op->result != kReadPending || !features_.async_cancel) return;
  if (internal_in_flight_ >= max_internal_) return;  // cancel is advisory
  io_uring_sqe* sqe = internal_sqe();
  if (sqe == nullptr) return;
  io_uring_prep_cancel64(sqe, reinterpret_cast<uint64_t>(op), 0);
  io_uring_sqe_set_data64(sqe, kInternalUserData);
  ++internal_in_flight_;
}

void UringBackend::arm(Watch& w) {
  io_uring_sqe* sqe = internal_sqe();
  if (sqe == nullptr) {
    w.state = Watch::State::NeedsArm;  // retried at the next wait()
    return;
  }
  if (features_.multishot_poll) {
    io_uring_prep_poll_multishot(sqe, w.fd, POLLIN);
  } else {
    io_uring_prep_poll_add(sqe, w.fd, POLLIN);
  }
  io_uring_sqe_set_data64(sqe, reinterpret_cast<uint64_t>(&w) | kTagWatch);
  w.state = Watch::State::Armed;
  ++polls_in_flight_;
}

void UringBackend::arm_pending_watches() {
  for (uint32_t i = 0; i < max_watches_; ++i) {
    if (watches_[i].state == Watch::State::NeedsArm) arm(watches_[i]);
  }
}

Status UringBackend::watch(int fd, uint64_t tag) {
  Watch* free_slot = nullptr;
  for (uint32_t i = 0; i < max_watches_; ++i) {
    Watch& w = watches_[i];
    if (w.state == Watch::State::Free) {
      if (free_slot == nullptr) free_slot = &w;
    } else if (w.fd == fd && w.state != Watch::State::Removing) {
      return make_error(EEXIST, fmt::format("watch: fd {} is watched already", fd));
    }
  }
  if (free_slot == nullptr) {
    return make_error(ENOSPC, fmt::format("watch: fd {}: all {} watches in use", fd, max_watches_));
  }
  free_slot->fd = fd;
  free_slot->tag = tag;
  arm(*free_slot);
  return Ok{};
}

Status UringBackend::unwatch(int fd) {
  for (uint32_t i = 0; i < max_watches_; ++i) {
    Watch& w = watches_[i];
    if (w.fd != fd || w.state == Watch::State::Free || w.state == Watch::State::Removing) continue;
    if (w.state != Watch::State::Armed) {
      w.state = Watch::State::Free;  // no poll in the kernel
      return Ok{};
    }
    io_uring_sqe* sqe = internal_sqe();
    if (sqe == nullptr) return make_error(EBUSY, fmt::format("unwatch: fd {}: no SQE", fd));
    io_uring_prep_poll_remove(sqe, reinterpret_cast<uint64_t>(&w) | kTagWatch);
    io_uring_sqe_set_data64(sqe, kInternalUserData);
    ++internal_in_flight_;
    w.state = Watch::State::Removing;  // Free once the poll's last CQE arrives
    return Ok{};
  }
  return make_error(ENOENT, fmt::format("unwatch: fd {} is not watched", fd));
}

// Returns whether it wrote *event.
bool UringBackend::handle_watch_cqe(Watch& w, const io_uring_cqe& cqe, IoEvent* event) {
  const bool more = (cqe.flags & IORING_CQE_F_MORE) != 0;
  if (!more) --polls_in_flight_;
  if (w.state == Watch::State::Removing) {
    if (!more) w.state = Watch::State::Free;
    return false;
  }
  EXPERTD_CHECK_EQ(w.state, Watch::State::Armed);
  if (cqe.res == -EINVAL && features_.multishot_poll && !more) {
    features_.multishot_poll = false;  // a kernel without multishot poll (< 5.13)
    w.state = Watch::State::NeedsArm;
    return false;
  }
  if (cqe.res < 0 && cqe.res != -ECANCELED) {
    w.state = Watch::State::Failed;  // e.g. -EBADF: re-arming would fail forever
    ++stats_.errors;
    return false;
  }
  // A single-shot poll (or a multishot one the kernel ended, e.g. on CQ overflow) is re-armed
  // at the next wait(), after the owner has cleared the fd.
  if (!more) w.state = Watch::State::NeedsArm;
  if (cqe.res < 0) return false;
  *event = IoEvent{IoEvent::Kind::Fd, nullptr, w.tag};
  return true;
}

bool UringBackend::handle_cqe(const io_uring_cqe& cqe, IoEvent* event) {
  if (cqe.user_data == kInternalUserData) {
    EXPERTD_CHECK_GT(internal_in_flight_, 0);
    --internal_in_flight_;
    return false;
  }
  if ((cqe.user_data & kTagMask) == kTagWatch) {
    return handle_watch_cqe(*reinterpret_cast<Watch*>(cqe.user_data & ~kTagMask), cqe, event);
  }
  auto* op = reinterpret_cast<ReadOp*>(cqe.user_data);
  EXPERTD_CHECK_EQ(op->result, kReadPending);  // op completed twice
  EXPERTD_CHECK_GT(in_flight_, 0);
  op->result = cqe.res;
  --in_flight_;
  if (cqe.res >= 0) {
    EXPERTD_CHECK_LE(static_cast<uint32_t>(cqe.res), op->len);
    stats_.bytes_read += static_cast<uint64_t>(cqe.res);
  } else {
    ++stats_.errors;
  }
  *event = IoEvent{IoEvent::Kind::Read, op, 0};
  return true;
}

// Moves available CQEs into `out`. io_uring_for_each_cqe load-acquires the CQ tail, so the CQE
// contents the kernel wrote before publishing the tail are visible; io_uring_cq_advance
// store-releases the head, handing the entries back only after we have read them.
int UringBackend::reap(std::span<IoEvent> out) {
  size_t n = 0;
  unsigned seen = 0;
  unsigned head;
  io_uring_cqe* cqe;
  io_uring_for_each_cqe(ring_.get(), head, cqe) {
    if (n == out.size()) break;
    ++seen;
    if (handle_cqe(*cqe, &out[n])) ++n;
  }
  io_uring_cq_advance(ring_.get(), seen);
  return static_cast<int>(n);
}

// Submits and sleeps until a CQE, the deadline or a signal. Returns 0 or -errno (-ETIME and
// -EINTR are not failures: the caller re-checks its deadline).
int UringBackend::enter(uint64_t deadline_ns, int timeout_ms) {
  io_uring_cqe* cqe = nullptr;
  int rc;
  if (timeout_ms < 0) {
    rc = io_uring_submit_and_wait(ring_.get(), 1);
  } else {
    const uint64_t now = monotonic_ns();
    const uint64_t left_ns = deadline_ns > now ? deadline_ns - now : 0;
    __kernel_timespec ts{static_cast<long long>(left_ns / 1'000'000'000u),
                         static_cast<long long>(left_ns % 1'000'000'000u)};
    rc = io_uring_submit_and_wait_timeout(ring_.get(), &cqe, 1, &ts, nullptr);
  }
  if (rc >= 0 || rc == -ETIME || rc == -EINTR || rc == -EBUSY || rc == -EAGAIN) return 0;
  return rc;
}

int UringBackend::wait(std::span<IoEvent> out, int timeout_ms) {
  EXPERTD_CHECK(!out.empty());
  arm_pending_watches();
  const uint64_t deadline_ns =
      timeout_ms < 0 ? 0 : monotonic_ns() + static_cast<uint64_t>(timeout_ms) * 1'000'000u;
  if (int rc = flush(); rc < 0 && rc != -EBUSY && rc != -EAGAIN && rc != -EINTR) return rc;
  for (;;) {
    const int n = reap(out);
    if (n > 0) return n;
    if (timeout_ms == 0 || (timeout_ms > 0 && monotonic_ns() >= deadline_ns)) return 0;
    if (int rc = enter(deadline_ns, timeout_ms); rc < 0) return rc;
  }
}

Result<Features> probe_features() {
  io_uring_probe* probe = io_uring_get_probe();
  if (probe == nullptr) {
    return make_error(EOPNOTSUPP, "io_uring: the kernel cannot be probed for opcodes (< 5.6)");
  }
  Features f;
  const bool read = io_uring_opcode_supported(probe, IORING_OP_READ);
  const bool poll = io_uring_opcode_supported(probe, IORING_OP_POLL_ADD);
  f.read_fixed = io_uring_opcode_supported(probe, IORING_OP_READ_FIXED);
  f.async_cancel = io_uring_opcode_supported(probe, IORING_OP_ASYNC_CANCEL);
  io_uring_free_probe(probe);
  if (!read || !poll) {
    return make_error(EOPNOTSUPP, fmt::format("io_uring: the kernel lacks IORING_OP_{}",
                                              read ? "POLL_ADD" : "READ"));
  }
  return f;
}

}  // namespace

Result<std::unique_ptr<ReadBackend>> make_uring_backend(const BackendOptions& options) {
  EXPERTD_CHECK_GT(options.queue_depth, 0);
  EXPERTD_CHECK_GT(options.max_watches, 0);
  if (const int err = forced_failure(); err != 0)
    return setup_error(err, options.queue_depth, true);
  EXPERTD_TRY_ASSIGN(Features features, probe_features());
  auto backend = std::make_unique<UringBackend>(options, features);
  if (const int rc = backend->init_ring(); rc < 0) {
    return setup_error(-rc, options.queue_depth, false);
  }
  return std::unique_ptr<ReadBackend>(std::move(backend));
}

}  // namespace expertd
