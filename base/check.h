// Always-on assertions: invariants (slot state transitions, ring indices, pool bounds) are checked
// in every build, Release included, because `assert()` vanishes under NDEBUG and the default
// build (RelWithDebInfo) defines it. A failed check prints the file, the line, the expression and
// the values of both operands to stderr, then aborts: a broken invariant is a bug, and the
// process must not go on with corrupt state.
//
//   EXPERTD_CHECK(cond)              cond must hold
//   EXPERTD_CHECK_EQ(a, b)           also _NE, _LT, _LE, _GT, _GE: prints a and b when it fails
//   EXPERTD_DCHECK..(…)              debug builds only: for a check whose cost was measured on a
//                                    hot path (say why where it is used)
//
// Bad input is not a bug: it is an Error (expertd/result.h), never a check.
#pragma once

#include <fmt/format.h>

#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>

namespace expertd::detail {

[[noreturn]] void check_failed(const char* file, int line, const char* expr,
                               const std::string& values);

template <typename T>
std::string check_value(const T& v) {
  if constexpr (std::is_enum_v<T>) {
    return fmt::format("{}", static_cast<std::underlying_type_t<T>>(v));
  } else if constexpr (std::is_pointer_v<T>) {
    return fmt::format("{}", static_cast<const void*>(v));
  } else if constexpr (std::is_same_v<T, std::nullptr_t>) {
    return "nullptr";
  } else if constexpr (fmt::is_formattable<T>::value) {
    return fmt::format("{}", v);
  } else {
    return "(value not printable)";
  }
}

// Integers of mixed signedness compare by value (std::cmp_*), so `EXPERTD_CHECK_EQ(refs, 0)` means
// what it says and does not warn.
template <typename A, typename B>
constexpr bool kIntCompare = std::is_integral_v<A>&& std::is_integral_v<B> &&
                             !std::is_same_v<A, bool> && !std::is_same_v<B, bool>;
#define EXPERTD_CHECK_CMP_FN(name, op, std_fn)  \
  template <typename A, typename B>             \
  constexpr bool name(const A& a, const B& b) { \
    if constexpr (kIntCompare<A, B>) {          \
      return std_fn(a, b);                      \
    } else {                                    \
      return a op b;                            \
    }                                           \
  }
EXPERTD_CHECK_CMP_FN(check_eq, ==, std::cmp_equal)
EXPERTD_CHECK_CMP_FN(check_ne, !=, std::cmp_not_equal)
EXPERTD_CHECK_CMP_FN(check_lt, <, std::cmp_less)
EXPERTD_CHECK_CMP_FN(check_le, <=, std::cmp_less_equal)
EXPERTD_CHECK_CMP_FN(check_gt, >, std::cmp_greater)
EXPERTD_CHECK_CMP_FN(check_ge, >=, std::cmp_greater_equal)
#undef EXPERTD_CHECK_CMP_FN

template <typename A, typename B>
[[noreturn]] __attribute__((noinline, cold)) void check_op_failed(const char* file, int line,
                                                                  const char* expr, const A& a,
                                                                  const B& b) {
  check_failed(file, line, expr, check_value(a) + " vs " + check_value(b));
}

}  // namespace expertd::detail

#define EXPERTD_CHECK(cond)                                                      \
  do {                                                                           \
    if (__builtin_expect(!(cond), 0)) {                                          \
      ::expertd::detail::check_failed(__FILE__, __LINE__, #cond, std::string()); \
    }                                                                            \
  } while (0)

#define EXPERTD_CHECK_OP(a, cmp, op, b)                                                           \
  do {                                                                                            \
    const auto& expertd_check_a_ = (a);                                                           \
    const auto& expertd_check_b_ = (b);                                                           \
    if (__builtin_expect(!::expertd::detail::cmp(expertd_check_a_, expertd_check_b_), 0)) {       \
      ::expertd::detail::check_op_failed(__FILE__, __LINE__, #a " " #op " " #b, expertd_check_a_, \
                                         expertd_check_b_);                                       \
    }                                                                                             \
  } while (0)

#define EXPERTD_CHECK_EQ(a, b) EXPERTD_CHECK_OP(a, check_eq, ==, b)
#define EXPERTD_CHECK_NE(a, b) EXPERTD_CHECK_OP(a, check_ne, !=, b)
#define EXPERTD_CHECK_LT(a, b) EXPERTD_CHECK_OP(a, check_lt, <, b)
#define EXPERTD_CHECK_LE(a, b) EXPERTD_CHECK_OP(a, check_le, <=, b)
#define EXPERTD_CHECK_GT(a, b) EXPERTD_CHECK_OP(a, check_gt, >, b)
#define EXPERTD_CHECK_GE(a, b) EXPERTD_CHECK_OP(a, check_ge, >=, b)

#ifdef NDEBUG
#define EXPERTD_DCHECK(cond) \
  do {                       \
  } while (0 && (cond))
#define EXPERTD_DCHECK_OP(a, cmp, op, b) \
  do {                                   \
  } while (0 && ::expertd::detail::cmp((a), (b)))
#else
#define EXPERTD_DCHECK(cond) EXPERTD_CHECK(cond)
#define EXPERTD_DCHECK_OP(a, cmp, op, b) EXPERTD_CHECK_OP(a, cmp, op, b)
#endif
#define EXPERTD_DCHECK_EQ(a, b) EXPERTD_DCHECK_OP(a, check_eq, ==, b)
#define EXPERTD_DCHECK_LT(a, b) EXPERTD_DCHECK_OP(a, check_lt, <, b)
#define EXPERTD_DCHECK_LE(a, b) EXPERTD_DCHECK_OP(a, check_le, <=, b)

// A branch that cannot be taken (a switch the caller has already checked, say).
#define EXPERTD_UNREACHABLE(what) \
  ::expertd::detail::check_failed(__FILE__, __LINE__, "unreachable: " what, std::string())
