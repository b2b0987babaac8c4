// The read backends against real files in /tmp and the real kernel: every byte that comes back is
// compared with the byte the file holds (byte i of file f = content_byte(f, i)).
#include "storage/reader.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "testing/temp_dir.h"

namespace expertd {
namespace {

constexpr uint64_t kFile0Bytes = (8u << 20) + 100;  // not a multiple of any DIO alignment
constexpr uint64_t kFile1Bytes = (3u << 20) + 4096;

uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint8_t content_byte(uint32_t file, uint64_t i) {
  return static_cast<uint8_t>(mix((uint64_t{file} << 48) ^ (i / 8)) >> (8 * (i % 8)));
}

// Anonymous, page-aligned memory: the destination of O_DIRECT reads.
class Buffer {
 public:
  explicit Buffer(size_t bytes) : bytes_(bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) std::abort();
    data_ = static_cast<uint8_t*>(p);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { munmap(data_, bytes_); }
  uint8_t* data() const { return data_; }
  size_t size() const { return bytes_; }
  iovec iov() const { return {data_, bytes_}; }

 private:
  uint8_t* data_ = nullptr;
  size_t bytes_ = 0;
};

// Sets an environment variable for the scope (each test runs in its own process under ctest).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) { setenv(name, value, 1); }
  ~ScopedEnv() { unsetenv(name_); }

 private:
  const char* name_;
};

class DataFiles {
 public:
  DataFiles() {
    if (dir_.path().empty()) std::abort();
    write(0, kFile0Bytes);
    write(1, kFile1Bytes);
  }
  const std::vector<std::string>& paths() const { return paths_; }

 private:
  void write(uint32_t file, uint64_t bytes) {
    std::vector<uint8_t> data(bytes);
    for (uint64_t i = 0; i < bytes; ++i) data[i] = content_byte(file, i);
    paths_.push_back(dir_.file("shard" + std::to_string(file) + ".bin"));
    const int fd = open(paths_.back().c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::write(fd, data.data(), data.size()), static_cast<ssize_t>(data.size()));
    close(fd);
  }

  test::TempDir dir_{"expertd-reader"};
  std::vector<std::string> paths_;
};

// Empty when the bytes match, else where the first difference is.
std::string CompareBytes(const ReadOp& op, uint32_t bytes) {
  for (uint32_t i = 0; i < bytes; ++i) {
    if (op.dst[i] != content_byte(op.file, op.offset + i)) {
      return "file " + std::to_string(op.file) + " byte " + std::to_string(op.offset + i) +
             " differs";
    }
  }
  return "";
}

uint64_t file_bytes(uint32_t file) { return file == 0 ? kFile0Bytes : kFile1Bytes; }

// The bytes a complete read of `op` returns: up to the end of the file.
int32_t ExpectedResult(const ReadOp& op) {
  const uint64_t size = file_bytes(op.file);
  return static_cast<int32_t>(op.offset >= size ? 0 : std::min<uint64_t>(op.len, size - op.offset));
}

// Waits until `count` reads came back (5 s at most); each op is counted by its cookie.
std::vector<ReadOp*> WaitForReads(ReadBackend& backend, size_t count) {
  std::vector<ReadOp*> done;
  std::array<IoEvent, 16> events;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (done.size() < count && std::chrono::steady_clock::now() < deadline) {
    const int n = backend.wait(events, 100);
    EXPECT_GE(n, 0) << std::strerror(-n);
    for (int i = 0; i < n; ++i) {
      EXPECT_EQ(events[i].kind, IoEvent::Kind::Read);
      if (events[i].kind == IoEvent::Kind::Read) done.push_back(events[i].op);
    }
  }
  EXPECT_EQ(done.size(), count) << "reads lost";
  return done;
}

void SubmitAll(ReadBackend& backend, std::vector<ReadOp>& ops) {
  for (ReadOp& op : ops) ASSERT_TRUE(backend.submit(&op)) << "queue full at " << op.cookie;
}

void ExpectComplete(const std::vector<ReadOp*>& done) {
  for (const ReadOp* op : done) {
    ASSERT_EQ(op->result, ExpectedResult(*op)) << "offset " << op->offset << " len " << op->len;
    EXPECT_EQ(CompareBytes(*op, static_cast<uint32_t>(op->result)), "");
  }
}

enum class Variant { Uring, Pread, Fallback };

std::string VariantName(const testing::TestParamInfo<Variant>& info) {
  switch (info.param) {
    case Variant::Uring:
      return "Uring";
    case Variant::Pread:
      return "Pread";
    case Variant::Fallback:
      return "UringForcedFailureFallsBackToPread";
  }
  return "?";
}

std::unique_ptr<ReadBackend> MakeVariant(Variant variant, const BackendOptions& options) {
  std::string reason;
  Result<std::unique_ptr<ReadBackend>> backend = make_error(EINVAL, "unset");
  if (variant == Variant::Fallback) {
    ScopedEnv env("EXPERTD_FORCE_URING_FAILURE", "EPERM");
    backend = make_backend(BackendKind::Uring, options, &reason);
    EXPECT_NE(reason, "");
  } else {
    const BackendKind kind = variant == Variant::Uring ? BackendKind::Uring : BackendKind::Pread;
    backend = make_backend(kind, options, &reason);
    EXPECT_EQ(reason, "") << "io_uring should work on this machine";
  }
  if (!backend.ok()) {
    ADD_FAILURE() << backend.error().message;
    return nullptr;
  }
  return std::move(backend).value();
}

class ReaderTest : public testing::TestWithParam<Variant> {
 protected:
  void Open(BackendOptions options = {}) {
    backend_ = MakeVariant(GetParam(), options);
    ASSERT_NE(backend_, nullptr);
    const Status s = backend_->open_files(files_.paths());
    ASSERT_TRUE(s.ok()) << s.error().message;
    align_ = backend_->file(0).dio_alignment;
  }
  bool is_uring() const { return backend_->name() == "io_uring"; }

  DataFiles files_;
  std::unique_ptr<ReadBackend> backend_;
  uint32_t align_ = 4096;
};

TEST_P(ReaderTest, ReportsFilesAndTheirDioAlignment) {
  Open();
  EXPECT_EQ(backend_->name(), GetParam() == Variant::Uring ? "io_uring" : "pread");
  for (uint32_t f = 0; f < 2; ++f) {
    const FileInfo& info = backend_->file(f);
    EXPECT_EQ(info.path, files_.paths()[f]);
    EXPECT_EQ(info.size_bytes, file_bytes(f));
    EXPECT_TRUE(info.direct_io);
    EXPECT_TRUE(info.dio_alignment >= 1 && (info.dio_alignment & (info.dio_alignment - 1)) == 0);
    EXPECT_TRUE(info.alignment_source == "statx" || info.alignment_source == "logical block size" ||
                info.alignment_source == "default")
        << info.alignment_source;
    std::cout << "[ info ] " << info.path << ": DIO alignment " << info.dio_alignment << " bytes ("
              << info.alignment_source << ")\n";
  }
  std::cout << "[ info ] " << backend_->describe() << "\n";
}

TEST_P(ReaderTest, AlignedDirectReadsLandByteExact) {
  Open();
  const uint64_t a = align_;
  const std::vector<std::pair<uint64_t, uint32_t>> cases = {
      {0, static_cast<uint32_t>(a)},
      {a, 4096},
      {7 * a, static_cast<uint32_t>(3 * a)},
      {1u << 20, 64u << 10},
      {(1u << 20) - a, 1u << 20},
      {5u << 20, (1u << 20) + 2 * 4096},
      {kFile0Bytes / a * a - 4096 * 4, 4096 * 4}};
  Buffer buf(cases.size() << 21);
  std::vector<ReadOp> ops;
  for (size_t i = 0; i < cases.size(); ++i) {
    ops.push_back({.direct = true,
                   .offset = cases[i].first,
                   .len = cases[i].second,
                   .dst = buf.data() + (i << 21),
                   .cookie = i});
  }
  SubmitAll(*backend_, ops);
  ExpectComplete(WaitForReads(*backend_, ops.size()));
  const BackendStats stats = backend_->stats();
  EXPECT_EQ(stats.reads_submitted, ops.size());
  EXPECT_EQ(stats.in_flight, 0u);
  EXPECT_EQ(stats.errors, 0u);
}

TEST_P(ReaderTest, DirectReadOfTheLastBlockReturnsTheTailToEof) {
  Open();
  const uint64_t last_block = kFile0Bytes / align_ * align_;
  ASSERT_NE(last_block, kFile0Bytes);
  Buffer buf(1 << 20);
  std::vector<ReadOp> ops = {
      {.offset = last_block, .len = align_, .dst = buf.data()},
      {.offset = last_block - align_, .len = 4 * align_, .dst = buf.data() + (256 << 10)},
      {.offset = last_block + align_, .len = align_, .dst = buf.data() + (512 << 10)}};
  SubmitAll(*backend_, ops);
  ExpectComplete(WaitForReads(*backend_, ops.size()));
  EXPECT_EQ(ops[0].result, static_cast<int32_t>(kFile0Bytes - last_block));
  EXPECT_EQ(ops[1].result, static_cast<int32_t>(kFile0Bytes - last_block + align_));
  EXPECT_EQ(ops[2].result, 0);  // past the end of the file
}

TEST_P(ReaderTest, BufferedReadsAtUnalignedOffsetsLandByteExact) {
  Open();
  Buffer buf(64 << 20);
  std::vector<ReadOp> ops;
  for (uint32_t i = 0; i < 40; ++i) {
    ops.push_back({.file = i % 2,
                   .direct = false,
                   .offset = 32u * (i * 977 + 1) + (i % 3),
                   .len = 1 + i * 4099,
                   .dst = buf.data() + (i << 20) + 3,
                   .cookie = i});
  }
  SubmitAll(*backend_, ops);
  ExpectComplete(WaitForReads(*backend_, ops.size()));
}

TEST_P(ReaderTest, ReadsIntoRegisteredBuffersAreCorrect) {
  Open();
  Buffer arena(8 << 20);
  const iovec iov = arena.iov();
  ASSERT_TRUE(backend_->register_buffers({&iov, 1}).ok());
  std::cout << "[ info ] " << backend_->describe() << "\n";
  if (is_uring()) {
    EXPECT_NE(backend_->describe().find("registered buffers (8 MiB in 1 piece)"),
              std::string::npos);
  }
  Buffer outside(1 << 20);
  std::vector<ReadOp> ops;
  for (uint32_t i = 0; i < 8; ++i) {
    ops.push_back({.file = i % 2,
                   .direct = i % 4 != 3,
                   .offset = uint64_t{i} * (256u << 10),
                   .len = 512u << 10,
                   .dst = arena.data() + (i << 20),
                   .cookie = i});
  }
  ops.push_back({.offset = 4096, .len = 64u << 10, .dst = outside.data(), .cookie = 8});
  SubmitAll(*backend_, ops);
  ExpectComplete(WaitForReads(*backend_, ops.size()));
  EXPECT_EQ(backend_->stats().fixed_reads, is_uring() ? 8u : 0u);
}

// Buffers over 1 GiB are registered in <= 1 GiB pieces; a read across two pieces is a plain read.
TEST_P(ReaderTest, BuffersLargerThanOneGibAreSplit) {
  Open();
  Buffer arena((1u << 30) + (2u << 20));
  const iovec iov = arena.iov();
  ASSERT_TRUE(backend_->register_buffers({&iov, 1}).ok());
  if (is_uring()) {
    EXPECT_NE(backend_->describe().find("registered buffers (1026 MiB in 2 pieces)"),
              std::string::npos);
  }
  std::vector<ReadOp> ops = {
      {.offset = 0, .len = 1u << 20, .dst = arena.data() + (1u << 30) + (1u << 20)},
      {.offset = 1u << 20, .len = 1u << 20, .dst = arena.data() + (1u << 30) - (512u << 10)},
      {.offset = 2u << 20, .len = 1u << 20, .dst = arena.data()}};
  SubmitAll(*backend_, ops);
  ExpectComplete(WaitForReads(*backend_, ops.size()));
  EXPECT_EQ(backend_->stats().fixed_reads, is_uring() ? 2u : 0u);
}

TEST_P(ReaderTest, FullQueueRefusesThenAcceptsAfterWait) {
  Open({.queue_depth = 8, .pread_threads = 2});
  EXPECT_EQ(backend_->queue_depth(), 8u);
  Buffer buf(20u << 20);
  std::vector<ReadOp> ops(20);
  for (uint32_t i = 0; i < ops.size(); ++i) {
    ops[i] = {.offset = uint64_t{i} * (256u << 10),
              .len = 1u << 20,
              .dst = buf.data() + (i << 20),
              .cookie = i};
  }
  size_t next = 0;
  while (next < 8) ASSERT_TRUE(backend_->submit(&ops[next++]));
  EXPECT_FALSE(backend_->submit(&ops[next]));
  EXPECT_EQ(backend_->stats().in_flight, 8u);
  std::vector<ReadOp*> done;
  std::array<IoEvent, 4> events;
  while (done.size() < ops.size()) {
    const int n = backend_->wait(events, 1000);
    ASSERT_GT(n, 0);
    for (int i = 0; i < n; ++i) done.push_back(events[i].op);
    while (next < ops.size() && backend_->submit(&ops[next])) ++next;
  }
  ExpectComplete(done);
}

TEST_P(ReaderTest, ThousandRandomReadsAtDepth32ComeBackExactlyOnce) {
  Open({.queue_depth = 32, .pread_threads = 4});
  constexpr uint32_t kSlotBytes = 256u << 10;
  Buffer buf(32 * kSlotBytes);
  std::vector<ReadOp> slots(32);
  std::mt19937_64 rng(7);
  std::vector<int> returned(1000, 0);
  uint32_t submitted = 0, finished = 0;
  auto refill = [&](ReadOp& op, uint32_t slot) {
    const uint32_t file = rng() % 2;
    const bool direct = rng() % 4 != 0;
    const uint64_t unit = direct ? align_ : 1;
    const uint32_t len = static_cast<uint32_t>((1 + rng() % (kSlotBytes / unit)) * unit);
    const uint64_t offset = rng() % ((file_bytes(file) + unit) / unit) * unit;
    op = {.file = file,
          .direct = direct,
          .offset = offset,
          .len = len,
          .dst = buf.data() + uint64_t{slot} * kSlotBytes,
          .cookie = submitted++};
    ASSERT_TRUE(backend_->submit(&op));
  };
  for (uint32_t s = 0; s < 32; ++s) refill(slots[s], s);
  std::array<IoEvent, 32> events;
  while (finished < 1000) {
    const int n = backend_->wait(events, 1000);
    ASSERT_GT(n, 0) << "timed out with " << backend_->stats().in_flight << " in flight";
    for (int i = 0; i < n; ++i) {
      ReadOp* op = events[i].op;
      ASSERT_EQ(++returned[op->cookie], 1) << "op " << op->cookie << " came back twice";
      ASSERT_EQ(op->result, ExpectedResult(*op)) << "offset " << op->offset << " len " << op->len;
      ASSERT_EQ(CompareBytes(*op, static_cast<uint32_t>(op->result)), "");
      ++finished;
      if (submitted < 1000) refill(*op, static_cast<uint32_t>(op - slots.data()));
    }
  }
  EXPECT_EQ(std::count(returned.begin(), returned.end(), 1), 1000);
  EXPECT_EQ(backend_->stats().in_flight, 0u);
}

TEST_P(ReaderTest, CancelledOpsComeBackOnceCancelledOrComplete) {
  Open({.queue_depth = 32, .pread_threads = 1});
  Buffer buf(32u << 20);
  std::vector<ReadOp> ops(32);
  for (uint32_t i = 0; i < ops.size(); ++i) {
    ops[i] = {.file = i % 2,
              .direct = i % 2 == 0,
              .offset = uint64_t{i} * (64u << 10),
              .len = 1u << 20,
              .dst = buf.data() + (i << 20),
              .cookie = i};
  }
  SubmitAll(*backend_, ops);
  ASSERT_EQ(backend_->flush(), 0);
  for (ReadOp& op : ops) backend_->cancel(&op);
  ReadOp never_submitted{.len = 4096, .dst = buf.data()};
  backend_->cancel(&never_submitted);  // not the backend's: nothing happens
  const std::vector<ReadOp*> done = WaitForReads(*backend_, ops.size());
  std::map<uint64_t, int> seen;
  int cancelled = 0;
  for (const ReadOp* op : done) {
    EXPECT_EQ(++seen[op->cookie], 1);
    if (op->result == -ECANCELED) {
      ++cancelled;
      continue;
    }
    ASSERT_EQ(op->result, ExpectedResult(*op));
    EXPECT_EQ(CompareBytes(*op, static_cast<uint32_t>(op->result)), "");
  }
  std::array<IoEvent, 4> events;
  EXPECT_EQ(backend_->wait(events, 50), 0) << "an op came back twice";
  std::cout << "[ info ] " << backend_->name() << ": " << cancelled << " of 32 cancelled\n";
  // One worker cannot have started all 32: the queued ones end with -ECANCELED.
  if (!is_uring()) {
    EXPECT_GT(cancelled, 0);
  }
}

TEST_P(ReaderTest, WatchReportsAnEventfdEachTimeItIsWritten) {
  Open();
  const int efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  ASSERT_GE(efd, 0);
  ASSERT_TRUE(backend_->watch(efd, 77).ok());
  EXPECT_EQ(backend_->watch(efd, 78).error().code, EEXIST);
  std::array<IoEvent, 4> events;
  EXPECT_EQ(backend_->wait(events, 0), 0);
  for (int round = 0; round < 3; ++round) {
    const uint64_t one = 1;
    ASSERT_EQ(write(efd, &one, sizeof(one)), 8);
    ASSERT_EQ(backend_->wait(events, 1000), 1) << "round " << round;
    EXPECT_EQ(events[0].kind, IoEvent::Kind::Fd);
    EXPECT_EQ(events[0].tag, 77u);
    uint64_t count = 0;
    ASSERT_EQ(read(efd, &count, sizeof(count)), 8);  // the owner clears the doorbell
    EXPECT_EQ(count, 1u);
    EXPECT_EQ(backend_->wait(events, 50), 0) << "round " << round;
  }
  ASSERT_TRUE(backend_->unwatch(efd).ok());
  EXPECT_EQ(backend_->unwatch(efd).error().code, ENOENT);
  const uint64_t one = 1;
  ASSERT_EQ(write(efd, &one, sizeof(one)), 8);
  EXPECT_EQ(backend_->wait(events, 100), 0);
  ASSERT_TRUE(backend_->watch(efd, 79).ok());  // watched again: reported with the new tag
  ASSERT_EQ(backend_->wait(events, 1000), 1);
  EXPECT_EQ(events[0].tag, 79u);
  ASSERT_TRUE(backend_->unwatch(efd).ok());
  EXPECT_EQ(backend_->wait(events, 20), 0);
  close(efd);
}

TEST_P(ReaderTest, WaitTimesOutWithNothingToReport) {
  Open();
  std::array<IoEvent, 4> events;
  auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(backend_->wait(events, 0), 0);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(250));
  start = std::chrono::steady_clock::now();
  EXPECT_EQ(backend_->wait(events, 100), 0);
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_GE(elapsed, std::chrono::milliseconds(95));
  EXPECT_LT(elapsed, std::chrono::milliseconds(1000));
}

// The owner may tear down with reads in flight (shutdown after an error): the destructor returns
// promptly, and io_uring's reads are over (the kernel no longer writes into the buffers).
TEST_P(ReaderTest, DestroyingWithReadsInFlightWaitsForThem) {
  Open({.queue_depth = 32, .pread_threads = 2});
  const bool uring = is_uring();
  Buffer buf(32u << 20);
  std::vector<ReadOp> ops(32);
  for (uint32_t i = 0; i < ops.size(); ++i) {
    ops[i] = {.direct = i % 3 != 0,
              .offset = uint64_t{i} << 18,
              .len = 1u << 20,
              .dst = buf.data() + (uint64_t{i} << 20),
              .cookie = i};
  }
  SubmitAll(*backend_, ops);
  ASSERT_EQ(backend_->flush(), 0);
  const auto start = std::chrono::steady_clock::now();
  backend_.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  if (uring) {
    for (const ReadOp& op : ops) EXPECT_NE(op.result, kReadPending) << "op " << op.cookie;
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, ReaderTest,
                         testing::Values(Variant::Uring, Variant::Pread, Variant::Fallback),
                         VariantName);

TEST(ReaderFallbackTest, ForcedUringFailuresNameTheLikelyCause) {
  const std::vector<std::pair<const char*, std::string>> cases = {
      {"EPERM", "kernel.io_uring_disabled="},
      {"ENOSYS", "CONFIG_IO_URING"},
      {"ENOMEM", "RLIMIT_MEMLOCK is "}};
  for (const auto& [err, cause] : cases) {
    ScopedEnv env("EXPERTD_FORCE_URING_FAILURE", err);
    auto uring = make_uring_backend({});
    ASSERT_FALSE(uring.ok());
    const std::string& message = uring.error().message;
    std::cout << "[ info ] " << message << "\n";
    EXPECT_NE(message.find(std::string("io_uring_queue_init(64): ")), std::string::npos);
    EXPECT_NE(message.find(std::string("(") + err + ")"), std::string::npos) << message;
    EXPECT_NE(message.find(cause), std::string::npos) << message;
    EXPECT_NE(message.find("[forced by EXPERTD_FORCE_URING_FAILURE]"), std::string::npos);

    std::string reason;
    auto backend = make_backend(BackendKind::Uring, {.pread_threads = 3}, &reason);
    ASSERT_TRUE(backend.ok());
    EXPECT_EQ((*backend)->name(), "pread");
    EXPECT_EQ(reason, "io_uring unavailable: " + message + "; using the pread thread pool");
    EXPECT_EQ(reason.find('\n'), std::string::npos);
    EXPECT_NE((*backend)->describe().find("pread: 3 threads"), std::string::npos);
    EXPECT_NE((*backend)->describe().find(reason), std::string::npos);
  }
  const ScopedEnv env("EXPERTD_FORCE_URING_FAILURE", "EPERM");
  EXPECT_NE(make_uring_backend({}).error().message.find("seccomp"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// The fault-injecting wrapper, over both real backends.

enum class Inner { Uring, Pread };

class FaultyReaderTest : public testing::TestWithParam<Inner> {
 protected:
  std::unique_ptr<FaultyBackend> Make(const FaultOptions& faults) {
    BackendOptions options{.queue_depth = 32, .pread_threads = 4};
    auto inner =
        GetParam() == Inner::Uring ? make_uring_backend(options) : make_pread_backend(options);
    EXPECT_TRUE(inner.ok());
    auto backend = make_faulty_backend(std::move(inner).value(), faults);
    const Status s = backend->open_files(files_.paths());
    EXPECT_TRUE(s.ok());
    align_ = backend->file(0).dio_alignment;
    return backend;
  }

  struct Outcome {
    std::vector<int32_t> results;  // by cookie
    std::vector<int> returned;     // times each cookie came back
  };

  // n reads of 64 KiB at QD 32 (40 blocks of file 0, then of file 1, ...; direct, except every
  // 5th), verified as they come back: complete
  // reads and the prefix of short ones byte-exact.
  Outcome Run(ReadBackend& backend, uint32_t n) {
    constexpr uint32_t kSlotBytes = 64u << 10;
    Buffer buf(32 * kSlotBytes);
    std::vector<ReadOp> slots(32);
    Outcome outcome{std::vector<int32_t>(n, 0), std::vector<int>(n, 0)};
    uint32_t submitted = 0, finished = 0;
    auto refill = [&](uint32_t slot) {
      const uint32_t i = submitted++;
      slots[slot] = {.file = (i / 40) % 2,
                     .direct = i % 5 != 0,
                     .offset = uint64_t{i % 40} * kSlotBytes,
                     .len = kSlotBytes,
                     .dst = buf.data() + uint64_t{slot} * kSlotBytes,
                     .cookie = i};
      EXPECT_TRUE(backend.submit(&slots[slot]));
    };
    for (uint32_t s = 0; s < 32 && submitted < n; ++s) refill(s);
    std::array<IoEvent, 8> events;  // smaller than the depth: ready events wait their turn
    while (finished < n) {
      const int got = backend.wait(events, 2000);
      if (got <= 0) {
        ADD_FAILURE() << "wait returned " << got << " with " << n - finished << " outstanding";
        break;
      }
      for (int e = 0; e < got; ++e) {
        ReadOp* op = events[e].op;
        ++outcome.returned[op->cookie];
        outcome.results[op->cookie] = op->result;
        if (op->result > 0) {
          EXPECT_EQ(CompareBytes(*op, static_cast<uint32_t>(op->result)), "");
        }
        ++finished;
        if (submitted < n) refill(static_cast<uint32_t>(op - slots.data()));
      }
    }
    return outcome;
  }

  DataFiles files_;
  uint32_t align_ = 4096;
};

TEST_P(FaultyReaderTest, NameWrapsTheInnerBackend) {
  auto backend = Make({});
  EXPECT_EQ(backend->name(), GetParam() == Inner::Uring ? "faulty(io_uring)" : "faulty(pread)");
}

TEST_P(FaultyReaderTest, EioOnARangeFailsOnlyTheReadsOverlappingIt) {
  const uint64_t eio_offset = 3 * (64u << 10) + 100, eio_bytes = 64u << 10;  // overlaps 3 and 4
  auto backend =
      Make({.eio_rate = 1.0, .eio_file = 1, .eio_offset = eio_offset, .eio_bytes = eio_bytes});
  const Outcome outcome = Run(*backend, 400);
  int failed = 0;
  for (uint32_t i = 0; i < 400; ++i) {
    ASSERT_EQ(outcome.returned[i], 1) << "op " << i;
    const uint32_t file = (i / 40) % 2, block = i % 40;
    const bool overlaps = file == 1 && (block == 3 || block == 4);
    EXPECT_EQ(outcome.results[i], overlaps ? -EIO : int32_t{64 << 10}) << "op " << i;
    failed += outcome.results[i] == -EIO;
  }
  EXPECT_EQ(failed, 10);  // blocks 3 and 4 of file 1, read 5 times each
  EXPECT_EQ(backend->fault_stats().eio, 10u);
  EXPECT_EQ(backend->stats().errors, 10u);
}

TEST_P(FaultyReaderTest, EveryFaultOccursAndEveryOpComesBackOnce) {
  auto backend = Make({.seed = 11,
                       .eio_rate = 0.05,
                       .short_rate = 0.15,
                       .eagain_rate = 0.1,
                       .delay_rate = 0.2,
                       .max_delay_waits = 4,
                       .reorder = true});
  const Outcome outcome = Run(*backend, 2000);
  uint64_t eio = 0, eagain = 0, short_reads = 0, unaligned_short = 0;
  for (uint32_t i = 0; i < 2000; ++i) {
    ASSERT_EQ(outcome.returned[i], 1) << "op " << i;
    const int32_t r = outcome.results[i];
    eio += r == -EIO;
    eagain += r == -EAGAIN;
    if (r >= 0 && r < int32_t{64 << 10}) {
      EXPECT_GE(r, 1);
      ++short_reads;
      unaligned_short += r % align_ != 0;
    }
    EXPECT_TRUE(r == -EIO || r == -EAGAIN || r >= 1) << "op " << i << ": " << r;
  }
  const FaultStats faults = backend->fault_stats();
  std::cout << "[ info ] eio " << eio << ", eagain " << eagain << ", short " << short_reads << " ("
            << unaligned_short << " unaligned), delayed " << faults.delayed
            << ", reordered batches " << faults.reordered_batches << "\n";
  EXPECT_EQ(faults.eio, eio);
  EXPECT_EQ(faults.eagain, eagain);
  EXPECT_EQ(faults.short_reads, short_reads);
  EXPECT_GT(eio, 0u);
  EXPECT_GT(eagain, 0u);
  EXPECT_GT(unaligned_short, 0u);
  EXPECT_GT(short_reads - unaligned_short, 0u);
  EXPECT_GT(faults.delayed, 0u);
  EXPECT_GT(faults.reordered_batches, 0u);
  EXPECT_EQ(backend->stats().in_flight, 0u);
  EXPECT_EQ(backend->stats().reads_submitted, 2000u);
}

TEST_P(FaultyReaderTest, SameSeedGivesTheSameFaults) {
  const FaultOptions faults{.seed = 5,
                            .eio_rate = 0.05,
                            .short_rate = 0.2,
                            .eagain_rate = 0.1,
                            .delay_rate = 0.2,
                            .reorder = true};
  auto first = Make(faults);
  const Outcome a = Run(*first, 600);
  auto second = Make(faults);
  const Outcome b = Run(*second, 600);
  EXPECT_EQ(a.results, b.results);
  EXPECT_EQ(first->fault_stats().delayed, second->fault_stats().delayed);
  auto other = Make({.seed = 6,
                     .eio_rate = 0.05,
                     .short_rate = 0.2,
                     .eagain_rate = 0.1,
                     .delay_rate = 0.2,
                     .reorder = true});
  EXPECT_NE(Run(*other, 600).results, a.results);
}

INSTANTIATE_TEST_SUITE_P(Backends, FaultyReaderTest, testing::Values(Inner::Uring, Inner::Pread),
                         [](const testing::TestParamInfo<Inner>& param) {
                           return param.param == Inner::Uring ? "Uring" : "Pread";
                         });

}  // namespace
}  // namespace expertd
