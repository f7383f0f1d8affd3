// ztier common: durable file writes, shared by the swap-space manifest,
// checkpoints and exports.
//
// WriteFileAtomically writes to "<path>.tmp", fsyncs it, renames it over
// `path` and fsyncs the directory, so after a crash `path` holds either the
// old or the new content, never a mix. Errors: IoError / ResourceExhausted
// naming the file (PosixError). Thread-safe for distinct paths.
#ifndef ZTIER_COMMON_FILE_UTIL_H_
#define ZTIER_COMMON_FILE_UTIL_H_

#include <string>
#include <string_view>

#include "common/status.h"

namespace ztier {

// fsync of a file (or, with `directory`, of a directory's entries).
Status FsyncPath(const std::string& path, bool directory);

Status WriteFileAtomically(const std::string& path, std::string_view data);

// The whole content of a file. Errors: NotFound, IoError.
Result<std::string> ReadFileToString(const std::string& path);

}  // namespace ztier

#endif  // ZTIER_COMMON_FILE_UTIL_H_
