// ztier common: Status implementation and the errno -> Status mapping.
#include "common/status.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ostream>

namespace ztier {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "ok";
    case StatusCode::kInvalidArgument:
      return "invalid_argument";
    case StatusCode::kNotFound:
      return "not_found";
    case StatusCode::kAlreadyExists:
      return "already_exists";
    case StatusCode::kOutOfRange:
      return "out_of_range";
    case StatusCode::kResourceExhausted:
      return "resource_exhausted";
    case StatusCode::kFailedPrecondition:
      return "failed_precondition";
    case StatusCode::kCorruption:
      return "corruption";
    case StatusCode::kIoError:
      return "io_error";
    case StatusCode::kUnavailable:
      return "unavailable";
    case StatusCode::kAborted:
      return "aborted";
    case StatusCode::kUnimplemented:
      return "unimplemented";
    case StatusCode::kInternal:
      return "internal";
    case StatusCode::kPermissionDenied:
      return "permission_denied";
  }
  return "unknown";
}

Status::Status(StatusCode code, std::string message, int sys_errno) {
  if (code != StatusCode::kOk) {
    rep_ = std::make_shared<const Rep>(Rep{code, sys_errno, std::move(message)});
  }
}

std::string Status::ToString() const {
  if (ok()) return "ok";
  return StrCat(StatusCodeName(code()), ": ", message());
}

Status Status::Annotate(std::string_view context) const {
  if (ok()) return *this;
  return Status(code(), StrCat(context, ": ", message()), sys_errno());
}

std::ostream& operator<<(std::ostream& os, const Status& s) { return os << s.ToString(); }

Status PosixError(std::string_view context, int errnum) {
  if (errnum < 0) errnum = -errnum;
  StatusCode code = StatusCode::kIoError;
  switch (errnum) {
    case ENOSPC:
    case EDQUOT:
    case ENOMEM:
      code = StatusCode::kResourceExhausted;
      break;
    case ENOENT:
      code = StatusCode::kNotFound;
      break;
    case EEXIST:
      code = StatusCode::kAlreadyExists;
      break;
    case EINVAL:
      code = StatusCode::kInvalidArgument;
      break;
    case EAGAIN:
    case EBUSY:
      code = StatusCode::kUnavailable;
      break;
    case EPERM:
    case EACCES:
      code = StatusCode::kFailedPrecondition;
      break;
    default:
      break;
  }
  char buf[128];
  // GNU strerror_r returns the message pointer (which may not be buf).
  const char* text = strerror_r(errnum, buf, sizeof(buf));
  return Status(code, StrCat(context, ": ", text, " (errno ", errnum, ")"), errnum);
}

namespace detail {
void CheckFailed(const char* file, int line, const char* cond, const std::string& msg) {
  std::fprintf(stderr, "ztier: check failed at %s:%d: %s%s%s\n", file, line, cond,
               msg.empty() ? "" : ": ", msg.c_str());
  std::fflush(stderr);
  std::abort();
}
}  // namespace detail

std::string_view ShortSourcePath(std::string_view file) {
  const size_t last = file.rfind('/');
  if (last == std::string_view::npos || last == 0) return file;
  const size_t before = file.rfind('/', last - 1);
  return before == std::string_view::npos ? file : file.substr(before + 1);
}

}  // namespace ztier
