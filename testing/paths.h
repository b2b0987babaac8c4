// Where a test or benchmark finds what it runs and reads, with no path of the source tree or the
// build compiled in, so a build folder copied to another machine (at another path) still runs:
//   - binaries: every executable lands in the build's bin/, so they lie next to the running one;
//   - test data: copied into the build at build time (bin/../fixtures/), or $EXPERTD_TEST_DATA;
//   - the shared routing traces (outside the repository, optional): $EXPERTD_SHARED_TRACES, which
//     ctest sets; when unset, bin/../../../shared/traces (the build inside the checkout).
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace expertd::test {

// The directory of the running binary (/proc/self/exe), without a trailing slash.
std::string self_dir();

// The binary NAME built with this one: $EXPERTD_TEST_BIN_DIR/NAME when that is set, else NAME
// next to the running binary.
std::string bin_path(std::string_view name);

// The test data file or directory REL: $EXPERTD_TEST_DATA/REL when that is set, else
// <self_dir>/../fixtures/REL (tests/CMakeLists.txt copies the data there).
std::string data_path(std::string_view rel);

// The shared traces directory when it exists: $EXPERTD_SHARED_TRACES when that is set (empty:
// none), else <self_dir>/../../../shared/traces.
std::optional<std::string> shared_traces_dir();

// NAME looked up in $PATH, as a shell would; empty when absent.
std::string find_in_path(std::string_view name);

}  // namespace expertd::test
