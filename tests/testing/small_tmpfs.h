// Test support: a small tmpfs mounted for one test (a disk that fills on
// demand), unmounted (detached) when the object goes or at Unmount().
// Mounting needs CAP_SYS_ADMIN: where it is refused, mounted() is false and
// error() says why, and the test skips with it.
// Not thread-safe; one owner.
#ifndef ZTIER_TESTS_TESTING_SMALL_TMPFS_H_
#define ZTIER_TESTS_TESTING_SMALL_TMPFS_H_

#include <sys/mount.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>

namespace ztier::testing {

class SmallTmpfs {
 public:
  // Makes `dir` and mounts a tmpfs of `size` (mount's size= option:
  // "8k", "4m") there.
  SmallTmpfs(const std::string& dir, const std::string& size) : dir_(dir) {
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    const std::string options = "size=" + size;
    mounted_ = ::mount("tmpfs", dir_.c_str(), "tmpfs", 0, options.c_str()) == 0;
    if (!mounted_) error_ = std::strerror(errno);
  }
  ~SmallTmpfs() { Unmount(); }
  SmallTmpfs(const SmallTmpfs&) = delete;
  SmallTmpfs& operator=(const SmallTmpfs&) = delete;

  bool mounted() const { return mounted_; }
  const std::string& error() const { return error_; }
  // Unmounts now (after the test read what it wanted there).
  void Unmount() {
    if (mounted_) ::umount2(dir_.c_str(), MNT_DETACH);
    mounted_ = false;
  }

 private:
  std::string dir_;
  bool mounted_ = false;
  std::string error_;
};

}  // namespace ztier::testing

#endif  // ZTIER_TESTS_TESTING_SMALL_TMPFS_H_
