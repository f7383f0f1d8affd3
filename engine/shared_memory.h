// ztier engine: memory shared between ztierd and its clients through memfds
// (engine/protocol.h moves their fds): making a sealed memfd, checking one
// that arrived from the other side, and mapping it.
//
// The rule that keeps a peer from crashing this process: a memfd is mapped
// only when it is sealed against shrinking (F_SEAL_SHRINK), since a peer
// that truncates a memfd under a mapping turns the next access into
// SIGBUS. A payload a peer sends to be read is checked for F_SEAL_WRITE
// (or F_SEAL_FUTURE_WRITE) as well, so the peer cannot change it while it
// is read. (ztierd's read-only regions go out as read-only opens of memfds
// of mode 0444 instead: DramPool::SealRegion.)
//
// Thread safety: a Mapping has one owner; the functions are thread-safe.
// Failure: InvalidArgument naming what the memfd lacks, PosixError naming
// the call and errno.
#ifndef ZTIER_ENGINE_SHARED_MEMORY_H_
#define ZTIER_ENGINE_SHARED_MEMORY_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "common/status.h"
#include "common/unique_fd.h"
#include "engine/wire_types.h"

namespace ztier::engine {

// An mmap of a memfd, unmapped on destruction. Move-only.
class Mapping {
 public:
  Mapping() = default;
  // Maps `bytes` of `fd` from offset 0, shared; writable or read-only.
  // Errors: PosixError (mmap: a read-only sealed memfd refuses a writable
  // mapping with EPERM).
  static Result<Mapping> Map(int fd, uint64_t bytes, bool writable, std::string_view what);
  Mapping(Mapping&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  Mapping& operator=(Mapping&& other) noexcept;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { Reset(); }

  void* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }
  void Reset();

 private:
  void* data_ = nullptr;
  uint64_t bytes_ = 0;
};

// A new memfd of `bytes` zeroed bytes, sealed against shrinking and growing
// (the peer may map it safely), writable by whoever holds it. Errors:
// PosixError.
Result<UniqueFd> MakeSealedMemfd(std::string_view name, uint64_t bytes);
// The same, its pages written up front (charged to this process's
// memory): bulk data to or from ztierd, which refuses a staging memfd whose
// pages it would have to fault in (CheckAllocated).
Result<UniqueFd> MakeStagingMemfd(std::string_view name, uint64_t bytes);
// Checks that a peer's memfd has written pages for its first `bytes`, no
// hole (fallocated pages not yet written count as holes; a sparse one
// would put the memory ztierd touches in ztierd's own memory, beyond the
// peer's limits). A peer that punches them after the check still can:
// the check keeps the honest and careless out, not a determined sender.
// Errors: InvalidArgument naming `what`.
Status CheckAllocated(int fd, uint64_t bytes, std::string_view what);
// A memfd holding `bytes`, sealed against every change (F_SEAL_WRITE too):
// a message payload too large for a datagram.
Result<UniqueFd> MemfdWithPayload(std::string_view name, std::string_view bytes);
// Checks a memfd that came from the peer: a regular file of at least
// `min_bytes` (at most `max_bytes`), sealed against shrinking; for
// kReadOnly also against writes through new mappings. Returns its size.
// Errors: InvalidArgument naming `what` and the missing property.
Result<uint64_t> CheckPeerMemfd(int fd, uint64_t min_bytes, uint64_t max_bytes, RegionAccess access,
                                std::string_view what);
// Reads a payload memfd (checked as above, at most `max_bytes`) whole.
Result<std::string> ReadPayloadMemfd(int fd, uint64_t max_bytes);

}  // namespace ztier::engine

#endif  // ZTIER_ENGINE_SHARED_MEMORY_H_
