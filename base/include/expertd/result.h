// Result<T>: the value of an operation that can fail for reasons outside the program's control
// (a hostile file, a syscall). A bug is a check; a bad input or a failed syscall is an Error.
//
// Error owns a one-line human message (it already names the file, field and offset where there is
// one) and an errno-like code so callers can branch without parsing text. Results are
// [[nodiscard]]: dropping one is a compile error under -Werror.
#pragma once

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <variant>

namespace expertd {

namespace detail {
// Reading the value of a failed Result (or the error of a good one) is a bug: checked in every
// build. Self-contained so that this public header needs nothing but the standard library.
[[noreturn]] inline void result_misuse(const char* what) {
  std::fprintf(stderr, "expertd: check failed: %s\n", what);
  std::abort();
}
}  // namespace detail

struct Error {
  int code = EINVAL;  // positive errno value
  std::string message;
};

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}      // NOLINT: implicit by design
  Result(Error error) : v_(std::move(error)) {}  // NOLINT: implicit by design

  bool ok() const { return v_.index() == 0; }
  explicit operator bool() const { return ok(); }

  T& value() & {
    if (!ok()) detail::result_misuse("Result::value() of an error");
    return std::get<0>(v_);
  }
  const T& value() const& {
    if (!ok()) detail::result_misuse("Result::value() of an error");
    return std::get<0>(v_);
  }
  T&& value() && {
    if (!ok()) detail::result_misuse("Result::value() of an error");
    return std::get<0>(std::move(v_));
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

  const Error& error() const {
    if (ok()) detail::result_misuse("Result::error() of a value");
    return std::get<1>(v_);
  }
  Error&& take_error() {
    if (ok()) detail::result_misuse("Result::error() of a value");
    return std::get<1>(std::move(v_));
  }

 private:
  std::variant<T, Error> v_;
};

// Result<void>: success carries nothing.
struct Ok {};
using Status = Result<Ok>;

inline Error make_error(int code, std::string message) { return Error{code, std::move(message)}; }

}  // namespace expertd

#define EXPERTD_CONCAT_INNER(a, b) a##b
#define EXPERTD_CONCAT(a, b) EXPERTD_CONCAT_INNER(a, b)

// Evaluates a Result-returning expression; on error returns the error from the enclosing
// function (whose return type must be constructible from Error), else assigns the value to lhs.
#define EXPERTD_TRY_ASSIGN(lhs, expr)                          \
  auto EXPERTD_CONCAT(try_result_, __LINE__) = (expr);         \
  if (!EXPERTD_CONCAT(try_result_, __LINE__)) {                \
    return EXPERTD_CONCAT(try_result_, __LINE__).take_error(); \
  }                                                            \
  lhs = std::move(EXPERTD_CONCAT(try_result_, __LINE__)).value()

// Evaluates a Result-returning expression and returns its error, if any.
#define EXPERTD_TRY(expr)                              \
  do {                                                 \
    auto try_status_ = (expr);                         \
    if (!try_status_) return try_status_.take_error(); \
  } while (0)
