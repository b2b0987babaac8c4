// Waiting for a condition without guessing how long it takes: poll it until a deadline.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>

namespace expertd::test {

// Milliseconds on the monotonic clock.
uint64_t now_ms();

// Calls `done` until it returns true (then true) or `timeout` has passed (then false, after one
// last call). Between calls it waits 1 ms, doubling up to 20 ms: the poll interval, not a guess
// at how long the condition takes.
bool wait_until(const std::function<bool()>& done, std::chrono::milliseconds timeout);

}  // namespace expertd::test
