// ztier common: durable file writes and bounded reads, shared by the
// swap-space manifest, checkpoints, exports and configs; and the fault hook
// that lets tests fail any of their system calls.
//
// WriteFileAtomically writes to a temp file of its own beside `path`
// ("<path>.<pid>-<n>.tmp"), fsyncs it, renames it over `path` and fsyncs the
// directory, so after a crash `path` holds either the old or the new
// content, never a mix, and of two writers at once each success is its own
// file. A failure removes the temp file; those of writers that were killed
// are removed by the next write of `path`. An empty path is refused.
// Only a regular file (or nothing) is replaced: a symbolic link is followed
// to the regular file it names (the link stays), and a device, a pipe, a
// socket, a directory or a link to one of them is refused (a rename over
// /dev/full replaced the device with a file).
// ReadFileToString reads regular files only (a directory, a device such as
// /dev/zero or a FIFO is an error, not an endless read) up to a bound.
//
// Fault hook (tests): SetFileFaultHook installs a process-wide function that
// is asked before each system call these helpers make; a non-zero errno it
// returns fails that call as if the OS had returned it. A hook may also
// _exit() to model a crash between two calls.
//
// Errors: PosixError naming the file (NotFound, ResourceExhausted for
// ENOSPC/EDQUOT, IoError, ...). Thread-safe for distinct paths; the hook
// may be set while other threads run these helpers.
#ifndef ZTIER_COMMON_FILE_UTIL_H_
#define ZTIER_COMMON_FILE_UTIL_H_

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "common/status.h"

namespace ztier {

enum class FileOp : uint8_t {
  kOpen,      // open / create a file (for reading or writing)
  kWrite,     // write(2) of file data
  kRead,      // read(2) of file data
  kFsync,     // fsync of a file
  kRename,    // rename(2) of a temp file over its target
  kFsyncDir,  // fsync of a directory (makes names durable)
  kRemove,    // unlink(2)
};
std::string_view FileOpName(FileOp op);

// Returns 0 to let the call go on, or a positive errno to fail it with.
using FileFaultHook = std::function<int(FileOp op, const std::string& path)>;
// Installs `hook` for the whole process (an empty function: none).
void SetFileFaultHook(FileFaultHook hook);

// fsync of a file (or, with `directory`, of a directory's entries).
Status FsyncPath(const std::string& path, bool directory);

// Removes the temp files of `path` that writers which are gone (killed
// mid-write, or between the write and its rename) left:
// "<path>.<pid>-<n>.tmp" of a pid no process has. Best effort: errors are
// ignored. WriteFileAtomically does it first (unless told not to).
void RemoveStaleTemps(const std::string& path);

struct AtomicWriteOptions {
  // Remove the temp files killed writers of `path` left (a scan of the
  // directory). A caller writing many files of fresh names in one
  // directory, which no earlier writer can have used, leaves it out and
  // tidies the directory once: N scans of a growing directory made a
  // checkpoint of 8,000 shard files take minutes.
  bool remove_stale_temps = true;
  // fsync the directory after the rename, making the name durable. A caller
  // writing many files fsyncs the directory once after the last of them.
  bool fsync_directory = true;
};
Status WriteFileAtomically(const std::string& path, std::string_view data,
                           const AtomicWriteOptions& options = {});
// The most bytes WriteFileAtomically's temp name adds to `path`
// (".<pid>-<n>.tmp"): a caller checking its paths against PATH_MAX adds it.
inline constexpr size_t kAtomicTempSuffixBytes = 1 + 10 + 1 + 20 + 4;
// The file WriteFileAtomically(path) would replace: `path`, or the regular
// file a symbolic link names. Errors: InvalidArgument (not a regular file,
// naming what it is), PosixError (a dangling link, a failed stat).
Result<std::string> ReplaceableTarget(const std::string& path);

// unlink(2); a missing file is not an error.
Status RemoveFile(const std::string& path);

// The whole content of a regular file of at most `max_bytes` bytes.
// Errors: NotFound, InvalidArgument (a directory, a device, a FIFO),
// ResourceExhausted (larger than max_bytes, naming both), IoError.
Result<std::string> ReadFileToString(const std::string& path, uint64_t max_bytes = UINT64_MAX);

// "tmpfs" or "ramfs" when `path` lies on one (memory, not a drive: a swap
// file or a drive benchmark there measures and holds RAM), else "" (also
// when it cannot be asked).
std::string_view MemoryFilesystemOf(const std::string& path);

// For a program's main, first thing: standard input, output or error that
// the caller closed (`2>&-`) is opened on /dev/null, so the next file the
// program opens (a lock file, a swap file) does not get its number and
// receive the progress lines meant for stderr.
void OpenClosedStandardFds();

}  // namespace ztier

#endif  // ZTIER_COMMON_FILE_UTIL_H_
