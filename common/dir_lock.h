// ztier common: an advisory lock on a directory, so that two users of the
// library never share a swap directory or a checkpoint directory.
//
// The lock is flock(2) on a lock file inside the directory, taken without
// waiting and held while the DirLock lives. The kernel releases it when the
// process dies (kill -9 included), so a lock left by a dead process never
// blocks anyone. flock locks belong to an open file, so two users in one
// process exclude each other too. The holder of an exclusive lock writes its
// pid into the file; a refused caller gets an error naming the directory
// and, where /proc/locks or the file tell it, the holder's pid.
//
// Exclusive holders remove the lock file when they release it; Acquire
// checks that the file it locked is still the one at the path, so that
// removal never lets two holders in.
//
// flock needs only a file one can open, not write: a lock file another user
// can read, they can hold, keeping its owner out of their own directory. So
// lock files are the owner's alone (0600; one an older version left
// readable is made so). A refusal names each holder's command and user;
// where only other users' processes hold our file (opened while it was
// readable), it says to remove the file. It is not replaced here: a
// process of ours could take the old file in that moment, and two would
// hold the lock. Another user's lock file is a refusal naming that user:
// one we cannot open, and, for a writer (exclusive), one they left writable
// to group or others, which the writer would take over and remove as it
// let go.
//
// Thread safety: a DirLock is a value owned by one thread at a time.
// Failure: every call returns a Status; the destructor releases silently.
#ifndef ZTIER_COMMON_DIR_LOCK_H_
#define ZTIER_COMMON_DIR_LOCK_H_

#include <sys/stat.h>

#include <string>
#include <string_view>

#include "common/status.h"

namespace ztier {

class DirLock {
 public:
  enum class Mode : uint8_t { kExclusive, kShared };

  // Locks `dir` through the file `dir/file_name` (created if missing).
  // `what` names the directory's use in messages ("swap directory").
  // Errors: Unavailable (held by someone else: names the directory, the
  // holder's pid where known and what to do), NotFound (no such directory),
  // FailedPrecondition (no permission), IoError (a read-only filesystem,
  // naming the errno). `advice`, where given, is what the Unavailable says
  // to do instead of "wait for the other one to finish, or choose another
  // directory".
  static Result<DirLock> Acquire(const std::string& dir, std::string_view file_name,
                                 std::string_view what, Mode mode, std::string_view advice = {});

  DirLock() = default;
  ~DirLock();
  DirLock(DirLock&& other) noexcept;
  DirLock& operator=(DirLock&& other) noexcept;
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;

  bool held() const { return fd_ >= 0; }
  Mode mode() const { return mode_; }
  // Whether the file this lock holds is the one `st` (a stat of a path)
  // describes; no system call (a caller under a mutex may ask).
  bool IsFile(const struct stat& st) const {
    return fd_ >= 0 && st.st_dev == dev_ && st.st_ino == ino_;
  }
  const std::string& dir() const { return dir_; }

  // Shared -> exclusive without waiting. flock converts by releasing and
  // re-taking, so when another process holds it shared the conversion fails
  // (Unavailable, naming the holder) and this lock is shared again (or, if
  // even that was lost in the gap, no longer held).
  Status MakeExclusive();

  // Whether the file this lock holds is still the one at its path: false
  // once it was removed (its directory with it) or the path names another
  // file, when the lock keeps no one out of the directory any more.
  bool AtItsPath() const;
  // Releases the lock now (an exclusive holder removes the lock file, when
  // it is still the one at the path).
  void Release();

  // Who holds the lock on `lock_file`, for a message: "process 1234
  // (ztierd, user ztier)", "this process (pid 1234)", or "another process"
  // (none found, or the file cannot be opened).
  static std::string DescribeHolders(const std::string& lock_file);
  // Whether a process holds a lock on `lock_file` (a regular file), as
  // /proc/locks tells: looked at without opening it (no lock taken, none
  // made, no wait on a FIFO).
  static bool IsHeld(const std::string& lock_file);

 private:
  std::string dir_, path_, what_;
  Mode mode_ = Mode::kExclusive;
  int fd_ = -1;
  dev_t dev_ = 0;  // the held file's, as it was locked
  ino_t ino_ = 0;
};

}  // namespace ztier

#endif  // ZTIER_COMMON_DIR_LOCK_H_
