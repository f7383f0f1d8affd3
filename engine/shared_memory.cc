// ztier engine: memfds shared with the other side of the daemon socket (see
// shared_memory.h).
#include "engine/shared_memory.h"

#include <fcntl.h>
#include <linux/memfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

namespace ztier::engine {

Result<Mapping> Mapping::Map(int fd, uint64_t bytes, bool writable, std::string_view what) {
  if (bytes == 0) return Status::InvalidArgument(StrCat(what, ": an empty mapping"));
  void* p =
      ::mmap(nullptr, bytes, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    return PosixError(
        StrCat("mmap ", writable ? "read-write " : "read-only ", bytes, " bytes of ", what), errno);
  }
  Mapping m;
  m.data_ = p;
  m.bytes_ = bytes;
  return m;
}

Mapping& Mapping::operator=(Mapping&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void Mapping::Reset() {
  if (data_ != nullptr) ::munmap(data_, bytes_);
  data_ = nullptr;
  bytes_ = 0;
}

namespace {

Result<UniqueFd> NewMemfd(std::string_view name, uint64_t bytes) {
  UniqueFd fd(::memfd_create(std::string(name).c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) return PosixError(StrCat("memfd_create ", name), errno);
  if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
    return PosixError(StrCat("ftruncate memfd ", name, " to ", bytes, " bytes"), errno);
  }
  return fd;
}

}  // namespace

Result<UniqueFd> MakeSealedMemfd(std::string_view name, uint64_t bytes) {
  ZT_ASSIGN_OR_RETURN(UniqueFd fd, NewMemfd(name, bytes));
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return PosixError(StrCat("seal memfd ", name), errno);
  }
  return fd;
}

Result<UniqueFd> MakeStagingMemfd(std::string_view name, uint64_t bytes) {
  ZT_ASSIGN_OR_RETURN(UniqueFd fd, MakeSealedMemfd(name, bytes));
  // Written, not fallocated: the kernel reports fallocated shmem pages as
  // holes (SEEK_HOLE) until they are written, and CheckAllocated looks for
  // holes.
  static const std::vector<char> zeros(size_t{1} << 20, 0);
  for (uint64_t done = 0; done < bytes;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(zeros.size(), bytes - done));
    const ssize_t w = ::pwrite(fd.get(), zeros.data(), n, static_cast<off_t>(done));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0)
      return PosixError(StrCat("write the ", bytes, " bytes of memfd ", name),
                        w < 0 ? errno : ENOSPC);
    done += static_cast<uint64_t>(w);
  }
  return fd;
}

Status CheckAllocated(int fd, uint64_t bytes, std::string_view what) {
  // The first hole (the file's end if none) at or past `bytes`: every page
  // of the range is there (pages elsewhere in the file do not count).
  const off_t hole = ::lseek(fd, 0, SEEK_HOLE);
  if (hole < 0) return PosixError(StrCat("lseek(SEEK_HOLE) of ", what), errno);
  if (static_cast<uint64_t>(hole) < bytes) {
    return Status::InvalidArgument(StrCat(
        what, ": only its first ", hole, " of the ", bytes,
        " bytes it carries have pages; ztierd takes only memory its sender allocated (written)"));
  }
  return Status::Ok();
}

Result<UniqueFd> MemfdWithPayload(std::string_view name, std::string_view bytes) {
  ZT_ASSIGN_OR_RETURN(UniqueFd fd, NewMemfd(name, bytes.size()));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n =
        ::pwrite(fd.get(), bytes.data() + done, bytes.size() - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return PosixError(StrCat("write memfd ", name), n < 0 ? errno : EIO);
    done += static_cast<size_t>(n);
  }
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) !=
      0) {
    return PosixError(StrCat("seal memfd ", name), errno);
  }
  return fd;
}

Result<uint64_t> CheckPeerMemfd(int fd, uint64_t min_bytes, uint64_t max_bytes, RegionAccess access,
                                std::string_view what) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return PosixError(StrCat("fstat ", what), errno);
  if (!S_ISREG(st.st_mode)) {
    return Status::InvalidArgument(StrCat(what, ": the fd is not a memfd (not a regular file)"));
  }
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0) {
    return Status::InvalidArgument(
        StrCat(what, ": the fd is not a memfd that takes seals (", std::strerror(errno), ")"));
  }
  if ((seals & F_SEAL_SHRINK) == 0) {
    return Status::InvalidArgument(
        StrCat(what, ": the memfd is not sealed against shrinking (F_SEAL_SHRINK)"));
  }
  if (access == RegionAccess::kReadOnly && (seals & (F_SEAL_FUTURE_WRITE | F_SEAL_WRITE)) == 0) {
    return Status::InvalidArgument(
        StrCat(what, ": a read-only memfd is not sealed against writes (F_SEAL_FUTURE_WRITE)"));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < min_bytes || size > max_bytes) {
    return Status::InvalidArgument(
        StrCat(what, ": the memfd holds ", size, " bytes, expected ",
               min_bytes == max_bytes ? "" : "between ", min_bytes,
               min_bytes == max_bytes ? "" : StrCat(" and ", max_bytes)));
  }
  return size;
}

Result<std::string> ReadPayloadMemfd(int fd, uint64_t max_bytes) {
  ZT_ASSIGN_OR_RETURN(uint64_t size,
                      CheckPeerMemfd(fd, 1, max_bytes, RegionAccess::kReadOnly, "payload memfd"));
  std::string out(size, '\0');
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::pread(fd, out.data() + done, size - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return PosixError("read payload memfd", n < 0 ? errno : EIO);
    done += static_cast<size_t>(n);
  }
  return out;
}

}  // namespace ztier::engine
