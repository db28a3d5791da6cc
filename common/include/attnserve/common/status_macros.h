// Early-return helpers for absl::Status and absl::StatusOr, which Debian 12's
// Abseil (20220623) does not provide.
//
// clang-format off
//   ATTNSERVE_RETURN_IF_ERROR(ValidateShape(shape));
//   ATTNSERVE_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
//                              Engine::Create(options));
// clang-format on
#ifndef ATTNSERVE_COMMON_STATUS_MACROS_H_
#define ATTNSERVE_COMMON_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// Evaluates `expr` (an absl::Status) and returns it from the enclosing function
// if not OK.
#define ATTNSERVE_RETURN_IF_ERROR(expr)                    \
  do {                                                     \
    const ::absl::Status attnserve_status_ = (expr);       \
    if (!attnserve_status_.ok()) return attnserve_status_; \
  } while (false)

#define ATTNSERVE_STATUS_MACROS_CONCAT_INNER_(x, y) x##y
#define ATTNSERVE_STATUS_MACROS_CONCAT_(x, y) \
  ATTNSERVE_STATUS_MACROS_CONCAT_INNER_(x, y)

// Evaluates `rexpr` (an absl::StatusOr<T>); returns its status if not OK, else
// moves its value into `lhs`, which may be a declaration.
#define ATTNSERVE_ASSIGN_OR_RETURN(lhs, rexpr)                             \
  ATTNSERVE_ASSIGN_OR_RETURN_IMPL_(                                        \
      ATTNSERVE_STATUS_MACROS_CONCAT_(attnserve_statusor_, __LINE__), lhs, \
      rexpr)

#define ATTNSERVE_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                     \
  if (!statusor.ok()) return std::move(statusor).status();     \
  lhs = std::move(statusor).value()

#endif  // ATTNSERVE_COMMON_STATUS_MACROS_H_
