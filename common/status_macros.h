#pragma once

// RETURN_IF_ERROR / ASSIGN_OR_RETURN for absl::Status and absl::StatusOr (Abseil 20220623 has
// neither).

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define REBOUND_CONCAT_INNER_(a, b) a##b
#define REBOUND_CONCAT_(a, b) REBOUND_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status); returns it from the enclosing function if not OK.
#define RETURN_IF_ERROR(expr)                  \
  do {                                         \
    ::absl::Status rebound_status_ = (expr);   \
    if (!rebound_status_.ok()) {               \
      return rebound_status_;                  \
    }                                          \
  } while (false)

// ASSIGN_OR_RETURN(lhs, expr): evaluates `expr` (an absl::StatusOr<T>); on error returns its
// status, else moves the value into `lhs` (which may be a declaration such as `auto x`).
#define ASSIGN_OR_RETURN(lhs, expr) \
  REBOUND_ASSIGN_OR_RETURN_IMPL_(REBOUND_CONCAT_(rebound_statusor_, __LINE__), lhs, expr)

#define REBOUND_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                   \
  if (!statusor.ok()) {                                     \
    return std::move(statusor).status();                    \
  }                                                         \
  lhs = std::move(statusor).value()
