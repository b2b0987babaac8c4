// The always-on checks: they hold in this build whatever NDEBUG says, and a failed one names the
// file, the expression and both values before it aborts.
#include "base/check.h"

#include <gtest/gtest.h>

#include <cstdint>

namespace expertd {
namespace {

enum class State : uint8_t { Free, Loading, Ready };

TEST(CheckDeathTest, AFailedComparisonPrintsTheExpressionAndBothValues) {
  const uint32_t refs = 3;
  EXPECT_DEATH(EXPERTD_CHECK_EQ(refs, 0),
               R"(check_test\.cc:[0-9]+: check failed: refs == 0 \(3 vs 0\))");
  const State s = State::Loading;
  EXPECT_DEATH(EXPERTD_CHECK_EQ(s, State::Ready), R"(check failed: s == State::Ready \(1 vs 2\))");
  const int* p = nullptr;
  EXPECT_DEATH(EXPERTD_CHECK_NE(p, nullptr), R"(check failed: p != nullptr \(0x0 vs nullptr\))");
}

TEST(CheckDeathTest, APlainCheckPrintsItsExpression) {
  const bool pinned = true;
  EXPECT_DEATH(EXPERTD_CHECK(!pinned), R"(check failed: !pinned)");
  EXPECT_DEATH(EXPERTD_UNREACHABLE("a type the caller checked"),
               R"(check failed: unreachable: a type the caller checked)");
}

TEST(Check, IntegersOfMixedSignednessCompareByValue) {
  // -1 < 1u is false with the built-in operator; the check means what it says.
  const int minus_one = -1;
  const unsigned one = 1;
  EXPERTD_CHECK_LT(minus_one, one);
  EXPECT_DEATH(EXPERTD_CHECK_GE(minus_one, one), R"(\(-1 vs 1\))");
}

TEST(Check, EachOperandIsEvaluatedOnce) {
  int calls = 0;
  auto next = [&] { return ++calls; };
  EXPERTD_CHECK_EQ(next(), 1);
  EXPECT_EQ(calls, 1);
}

#ifdef NDEBUG
TEST(Check, ChecksStayOnUnderNdebugAndDchecksGo) {
  EXPECT_DEATH(EXPERTD_CHECK(1 + 1 == 3), "check failed");
  EXPERTD_DCHECK(1 + 1 == 3);  // compiled out in this build
}
#endif

}  // namespace
}  // namespace expertd
