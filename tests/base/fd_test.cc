// UniqueFd and Mapping: the one cleanup happens once, on destruction or reset, never after a move
// or a release; errno survives the cleanup.
#include "base/fd.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

namespace expertd {
namespace {

bool fd_open(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

TEST(UniqueFd, ClosesOnceWhenItGoesAndNotAfterAMoveOrRelease) {
  int raw = -1;
  {
    UniqueFd a(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    ASSERT_TRUE(a.valid());
    raw = a.get();
    UniqueFd b(std::move(a));
    EXPECT_FALSE(a.valid());  // NOLINT(bugprone-use-after-move): the moved-from state is the test
    EXPECT_EQ(b.get(), raw);
    EXPECT_TRUE(fd_open(raw));
  }
  EXPECT_FALSE(fd_open(raw));

  UniqueFd c(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  const int kept = c.release();
  EXPECT_FALSE(c.valid());
  EXPECT_TRUE(fd_open(kept));
  ::close(kept);
}

TEST(UniqueFd, MoveAssignmentClosesWhatItHeldAndKeepsErrno) {
  UniqueFd a(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  UniqueFd b(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  const int old_a = a.get();
  errno = ENOSPC;  // an error being reported while the cleanup runs
  a = std::move(b);
  EXPECT_EQ(errno, ENOSPC);
  EXPECT_FALSE(fd_open(old_a));
  EXPECT_TRUE(a.valid());
  EXPECT_TRUE(dup_fd(a.get()).valid());
  EXPECT_FALSE(dup_fd(-1).valid());
}

TEST(Mapping, UnmapsWhenItGoesAndReportsAFailedMap) {
  const long page = ::sysconf(_SC_PAGESIZE);
  void* where = nullptr;
  {
    Mapping m = Mapping::map(page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_TRUE(m.valid());
    m.data()[0] = 7;
    where = m.get();
    Mapping n(std::move(m));
    EXPECT_FALSE(m.valid());  // NOLINT(bugprone-use-after-move)
    EXPECT_EQ(n.size(), static_cast<size_t>(page));
  }
  // Unmapped: mincore on the range fails with ENOMEM.
  unsigned char vec = 0;
  EXPECT_EQ(::mincore(where, page, &vec), -1);
  EXPECT_EQ(errno, ENOMEM);

  Mapping bad = Mapping::map(page, PROT_READ, MAP_SHARED, -1, 0);  // no fd: EBADF
  EXPECT_FALSE(bad.valid());
  EXPECT_EQ(errno, EBADF);
}

}  // namespace
}  // namespace expertd
