// Status and StatusOr<T>: errors as values inside the C++ core.
//
// The codes are the canonical ones and are chosen by what the caller should do:
//   kInvalidArgument     the user's input is wrong; say which field, which value, what is allowed.
//   kFailedPrecondition  the system is not in a state where this can work; do not retry.
//   kUnavailable         a transient failure; retrying the call may succeed.
//   kAborted             the operation was cut short; retry at a higher level (a new attempt).
//   kDeadlineExceeded    a timeout expired.
//   kNotFound, kAlreadyExists, kPermissionDenied, kUnauthenticated, kDataLoss, kInternal: as named.
// Only the Python binding layer turns a Status into an exception.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace jaxtrain {

enum class StatusCode {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
  kUnauthenticated = 16,
};

std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status OkStatus() { return Status(); }
Status CancelledError(std::string message);
Status InvalidArgumentError(std::string message);
Status FailedPreconditionError(std::string message);
Status UnavailableError(std::string message);
Status AbortedError(std::string message);
Status DeadlineExceededError(std::string message);
Status NotFoundError(std::string message);
Status PermissionDeniedError(std::string message);
Status UnauthenticatedError(std::string message);
Status DataLossError(std::string message);
Status InternalError(std::string message);
Status ResourceExhaustedError(std::string message);
// The canonical code for errno `err`, chosen by what the caller should do (the one errno mapper
// of the project): kPermissionDenied (EACCES, EPERM, EROFS); kFailedPrecondition (ENOTDIR,
// EISDIR, EEXIST: something in the way); kNotFound (ENOENT); kResourceExhausted (ENOSPC, EDQUOT:
// the disk or quota is full, space may be freed); kUnavailable (EIO: may pass, as a storage server
// that restarts); kInternal for anything else.
StatusCode ErrnoCode(int err);
// "<what> failed: <errno's text>", with ErrnoCode(err).
Status ErrnoError(std::string_view what, int err);

template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(Status status) : value_(std::move(status)) {}  // NOLINT: implicit by design
  StatusOr(T value) : value_(std::move(value)) {}         // NOLINT: implicit by design

  bool ok() const { return std::holds_alternative<T>(value_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(value_);
  }
  T& value() & { return std::get<T>(value_); }
  const T& value() const& { return std::get<T>(value_); }
  T&& value() && { return std::get<T>(std::move(value_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<Status, T> value_;
};

}  // namespace jaxtrain

#define JT_CONCAT_INNER(a, b) a##b
#define JT_CONCAT(a, b) JT_CONCAT_INNER(a, b)

#define JT_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::jaxtrain::Status jt_status_ = (expr);  \
    if (!jt_status_.ok()) return jt_status_; \
  } while (0)

#define JT_ASSIGN_OR_RETURN(lhs, expr) \
  JT_ASSIGN_OR_RETURN_IMPL(JT_CONCAT(jt_statusor_, __LINE__), lhs, expr)
#define JT_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                             \
  if (!tmp.ok()) return tmp.status();            \
  lhs = std::move(tmp).value()
