// ztier common: UniqueFd, the owner of one file descriptor (RAII,
// move-only). Close() reports close(2)'s error; the destructor is the
// fallback and ignores it. Not thread-safe (one owner).
#ifndef ZTIER_COMMON_UNIQUE_FD_H_
#define ZTIER_COMMON_UNIQUE_FD_H_

#include <unistd.h>

#include <cerrno>
#include <utility>

namespace ztier {

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) reset(std::exchange(other.fd_, -1));
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // Gives up ownership: the caller closes the fd.
  int release() { return std::exchange(fd_, -1); }
  // Closes the fd held (ignoring errors) and takes `fd`.
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }
  // close(2): 0, or its errno. The fd is gone either way.
  int Close() {
    const int fd = std::exchange(fd_, -1);
    if (fd < 0) return 0;
    return ::close(fd) == 0 ? 0 : errno;
  }

 private:
  int fd_ = -1;
};

}  // namespace ztier

#endif  // ZTIER_COMMON_UNIQUE_FD_H_
