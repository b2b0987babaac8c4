#include "testing/wait.h"

#include <algorithm>
#include <thread>

#include "base/clock.h"

namespace expertd::test {

uint64_t now_ms() { return monotonic_ms(); }

bool wait_until(const std::function<bool()>& done, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto interval = std::chrono::milliseconds(1);
  while (std::chrono::steady_clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(interval);  // the poll interval
    interval = std::min(interval * 2, std::chrono::milliseconds(20));
  }
  return done();
}

}  // namespace expertd::test
