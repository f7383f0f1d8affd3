// ztier nvme internal: the swap manifest's format, its encoder and its
// defensive decoder (SwapSpace::SaveManifest / Open use them; the libFuzzer
// target tests/fuzz/swap_manifest_fuzz.cc feeds the decoder arbitrary bytes).
//
// Format (little endian), version 2:
//   header, 64 bytes: "ZTSWAPMF", u32 version, u32 0, u64 payload size,
//     u32 payload crc32c, zeros, u32 crc32c of the first 60 bytes;
//   payload: u64 stripe_bytes, u64 file_bytes (size of every swap file),
//     u64 cap_bytes (0: none), u8 checksums, str file_name, u32 path count,
//     str path x count, u64 next_id, u32 next_start_path, u64 object count,
//     then per object: u64 id, str name, u64 size, u32 start_path, and per
//     stripe unit (ceil(size / stripe_bytes) of them): u64 file offset,
//     u32 crc32c, u8 state (0 unwritten, 1 valid, 2 failed).
//   str = u32 length + bytes.
//
// The decoder accepts only a manifest a swap space could have written: the
// checksums match, every count fits in the bytes that hold it, every unit
// lies inside its file on the path striping gives it, no two units share an
// extent, ids are unique and below next_id, names are unique and non-empty,
// the file name is a plain name. Anything else is Corruption naming what is
// wrong; it never allocates more than the input's size justifies.
//
// Pure functions; thread-safe.
#ifndef ZTIER_NVME_SWAP_MANIFEST_H_
#define ZTIER_NVME_SWAP_MANIFEST_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace ztier::nvme {

inline constexpr uint32_t kSwapManifestVersion = 2;

struct ManifestUnit {
  uint64_t file_offset = 0;
  uint32_t crc = 0;
  uint8_t state = 0;  // 0 unwritten, 1 valid, 2 failed
};

struct ManifestObject {
  uint64_t id = 0;
  std::string name;
  uint64_t size = 0;
  uint32_t start_path = 0;
  std::vector<ManifestUnit> units;
};

struct SwapManifest {
  uint64_t stripe_bytes = 0;
  uint64_t file_bytes = 0;  // every swap file's size
  uint64_t cap_bytes = 0;   // the growth cap per file; 0: none
  bool checksums = true;
  std::string file_name;
  std::vector<std::string> paths;
  uint64_t next_id = 1;
  uint32_t next_start_path = 0;
  std::vector<ManifestObject> objects;
};

std::string EncodeSwapManifest(const SwapManifest& m);

// `origin` names the source in messages. Errors: Corruption.
Result<SwapManifest> DecodeSwapManifest(std::string_view bytes, std::string_view origin);

}  // namespace ztier::nvme

#endif  // ZTIER_NVME_SWAP_MANIFEST_H_
