#include "base/check.h"

#include <cstdio>
#include <cstdlib>

namespace expertd::detail {

void check_failed(const char* file, int line, const char* expr, const std::string& values) {
  // stderr is unbuffered; one fprintf keeps the line whole when threads fail together.
  if (values.empty()) {
    std::fprintf(stderr, "%s:%d: check failed: %s\n", file, line, expr);
  } else {
    std::fprintf(stderr, "%s:%d: check failed: %s (%s)\n", file, line, expr, values.c_str());
  }
  std::abort();
}

}  // namespace expertd::detail
