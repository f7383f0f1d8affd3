// ztier common: Status and Result<T>, the error values every component returns.
//
// A Status is a code, an optional OS/CUDA/NCCL error number and a message a user
// can act on (which file, which path, which limit). A Result<T> holds either a
// value or a non-OK Status; it is shaped like C++23 std::expected so that it can
// be swapped for it later. No exceptions cross a component boundary.
//
// errno is turned into a Status in exactly one place: PosixError().
//
// Thread safety: Status and Result are values; distinct objects may be used from
// any thread, one object needs external synchronisation like any value type.
//
// Macros:
//   ZT_RETURN_IF_ERROR(expr)        return the Status of expr if it is not OK.
//   ZT_ASSIGN_OR_RETURN(lhs, expr)  evaluate a Result, return its Status on
//                                   error, else move the value into lhs.
//   ZT_CHECK(cond) / ZT_CHECK_MSG(cond, ...)
//                                   always-on invariant check (programmer
//                                   errors): prints file:line and aborts. Never
//                                   used for runtime errors (syscalls, input).
#ifndef ZTIER_COMMON_STATUS_H_
#define ZTIER_COMMON_STATUS_H_

#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>

namespace ztier {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument,     // the caller passed something wrong (bad config, bad size)
  kNotFound,            // a named object, file or job does not exist
  kAlreadyExists,       // a name is taken
  kOutOfRange,          // an offset or index past the end
  kResourceExhausted,   // a budget, quota, DRAM pool or swap space is full
  kFailedPrecondition,  // the object is not in a state where the call is allowed
  kCorruption,          // stored bytes do not match their checksum or format
  kIoError,             // the OS or a device reported an I/O error
  kUnavailable,         // a peer (daemon, device) is not reachable right now
  kAborted,             // the operation was cancelled or its owner died
  kUnimplemented,       // a feature this build or machine lacks
  kInternal,            // an invariant of ztier itself broke
  kPermissionDenied,    // the caller may not do this (an operator's call, a file's mode)
  kLast = kPermissionDenied,
};

// Stable, lowercase name of a code ("invalid_argument"), for logs and the C ABI.
std::string_view StatusCodeName(StatusCode code);

// Concatenates any streamable values into a string: StrCat("path ", p, ": ", n).
template <typename... Args>
std::string StrCat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

class [[nodiscard]] Status {
 public:
  // OK.
  Status() = default;
  Status(StatusCode code, std::string message, int sys_errno = 0);

  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string msg) {
    return {StatusCode::kInvalidArgument, std::move(msg)};
  }
  static Status NotFound(std::string msg) { return {StatusCode::kNotFound, std::move(msg)}; }
  static Status AlreadyExists(std::string msg) {
    return {StatusCode::kAlreadyExists, std::move(msg)};
  }
  static Status OutOfRange(std::string msg) { return {StatusCode::kOutOfRange, std::move(msg)}; }
  static Status ResourceExhausted(std::string msg) {
    return {StatusCode::kResourceExhausted, std::move(msg)};
  }
  static Status FailedPrecondition(std::string msg) {
    return {StatusCode::kFailedPrecondition, std::move(msg)};
  }
  static Status Corruption(std::string msg) { return {StatusCode::kCorruption, std::move(msg)}; }
  static Status IoError(std::string msg, int sys_errno = 0) {
    return {StatusCode::kIoError, std::move(msg), sys_errno};
  }
  static Status Unavailable(std::string msg) { return {StatusCode::kUnavailable, std::move(msg)}; }
  static Status Aborted(std::string msg) { return {StatusCode::kAborted, std::move(msg)}; }
  static Status Unimplemented(std::string msg) {
    return {StatusCode::kUnimplemented, std::move(msg)};
  }
  static Status Internal(std::string msg) { return {StatusCode::kInternal, std::move(msg)}; }
  static Status PermissionDenied(std::string msg) {
    return {StatusCode::kPermissionDenied, std::move(msg)};
  }

  bool ok() const { return rep_ == nullptr; }
  StatusCode code() const { return rep_ ? rep_->code : StatusCode::kOk; }
  // The OS (errno), CUDA or NCCL error number behind this status, 0 if none.
  int sys_errno() const { return rep_ ? rep_->sys_errno : 0; }
  std::string_view message() const {
    return rep_ ? std::string_view(rep_->message) : std::string_view();
  }

  // "invalid_argument: <message>" or "ok".
  std::string ToString() const;

  // Returns a copy whose message is "<context>: <message>"; OK stays OK. Used on
  // the way up so the user sees every layer that was involved.
  Status Annotate(std::string_view context) const;

  friend bool operator==(const Status& a, const Status& b) {
    return a.code() == b.code() && a.sys_errno() == b.sys_errno() && a.message() == b.message();
  }

 private:
  struct Rep {
    StatusCode code;
    int sys_errno;
    std::string message;
  };
  // Copy-on-annotate; OK is a null pointer so the success path costs nothing.
  std::shared_ptr<const Rep> rep_;
};

std::ostream& operator<<(std::ostream& os, const Status& s);

// The one place an errno becomes a Status: "<context>: <strerror> (errno N)".
// ENOSPC/EDQUOT map to kResourceExhausted, ENOENT to kNotFound, EEXIST to
// kAlreadyExists, EINVAL to kInvalidArgument, EAGAIN/EBUSY to kUnavailable,
// everything else to kIoError. Accepts errno or a negative errno (io_uring).
Status PosixError(std::string_view context, int errnum);

// The last two components of a source path ("client/runner.cc" from
// __FILE__), for messages that name where a device or library call failed.
std::string_view ShortSourcePath(std::string_view file);

// A value or an error; an OK status is never stored.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    if (std::get<Status>(v_).ok()) {
      v_ = Status::Internal("Result constructed from an OK status without a value");
    }
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  bool has_value() const { return ok(); }
  explicit operator bool() const { return ok(); }

  // The status: OK when a value is held.
  Status status() const { return ok() ? Status() : std::get<Status>(v_); }

  // Accessing the value of an error Result is a programmer error and aborts.
  T& value() & {
    CheckHasValue();
    return std::get<T>(v_);
  }
  const T& value() const& {
    CheckHasValue();
    return std::get<T>(v_);
  }
  T&& value() && {
    CheckHasValue();
    return std::get<T>(std::move(v_));
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  void CheckHasValue() const;
  std::variant<T, Status> v_;
};

namespace detail {
[[noreturn]] void CheckFailed(const char* file, int line, const char* cond, const std::string& msg);
inline std::string CheckMessage() { return {}; }
template <typename... Args>
std::string CheckMessage(const Args&... args) {
  return StrCat(args...);
}
inline const Status& AsStatus(const Status& s) { return s; }
template <typename T>
Status AsStatus(const Result<T>& r) {
  return r.status();
}
}  // namespace detail

template <typename T>
void Result<T>::CheckHasValue() const {
  if (!ok()) {
    detail::CheckFailed(__FILE__, __LINE__, "Result::ok()",
                        "value() of an error Result: " + std::get<Status>(v_).ToString());
  }
}

}  // namespace ztier

#define ZT_CHECK(cond)                                                        \
  do {                                                                        \
    if (!(cond)) [[unlikely]] {                                               \
      ::ztier::detail::CheckFailed(__FILE__, __LINE__, #cond, std::string()); \
    }                                                                         \
  } while (0)

#define ZT_CHECK_MSG(cond, ...)                                                 \
  do {                                                                          \
    if (!(cond)) [[unlikely]] {                                                 \
      ::ztier::detail::CheckFailed(__FILE__, __LINE__, #cond,                   \
                                   ::ztier::detail::CheckMessage(__VA_ARGS__)); \
    }                                                                           \
  } while (0)

#define ZT_STATUS_CONCAT_INNER_(a, b) a##b
#define ZT_STATUS_CONCAT_(a, b) ZT_STATUS_CONCAT_INNER_(a, b)

// The temporary's name is unique per expansion, so the macro nests (a lambda
// in `expr` may use it too).
#define ZT_RETURN_IF_ERROR(expr) \
  ZT_RETURN_IF_ERROR_IMPL_(ZT_STATUS_CONCAT_(zt_status_, __COUNTER__), expr)
#define ZT_RETURN_IF_ERROR_IMPL_(tmp, expr)                  \
  do {                                                       \
    ::ztier::Status tmp = ::ztier::detail::AsStatus((expr)); \
    if (!tmp.ok()) [[unlikely]]                              \
      return tmp;                                            \
  } while (0)

#define ZT_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) [[unlikely]]                     \
    return tmp.status();                          \
  lhs = std::move(tmp).value()

#define ZT_ASSIGN_OR_RETURN(lhs, expr) \
  ZT_ASSIGN_OR_RETURN_IMPL_(ZT_STATUS_CONCAT_(zt_result_, __LINE__), lhs, expr)

#endif  // ZTIER_COMMON_STATUS_H_
