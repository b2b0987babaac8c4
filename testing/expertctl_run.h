// Runs the expertctl binary against a test daemon, as a user would: the arguments, then
// --socket; with --json, the one JSON document it prints.
#pragma once

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "testing/expertd_fixture.h"

namespace expertd::test {

inline RunResult expertctl(const std::string& socket, std::vector<std::string> args) {
  args.insert(args.begin(), bin_path("expertctl"));
  args.push_back("--socket");
  args.push_back(socket);
  return run_command(args);
}

inline nlohmann::json expertctl_json(const std::string& socket, std::vector<std::string> args) {
  args.push_back("--json");
  const RunResult r = expertctl(socket, std::move(args));
  EXPECT_EQ(r.status, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << r.out;
  return j;
}

}  // namespace expertd::test
