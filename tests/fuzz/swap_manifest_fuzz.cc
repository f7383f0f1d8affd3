// libFuzzer target: the swap manifest decoder on arbitrary bytes. Inputs
// starting with '!' get valid header and payload checksums first, so the
// fuzzer reaches the object table checks behind them. Whatever decodes must
// be consistent: units inside their files, on their stripe's path, never
// shared. Built and run by scripts/fuzz.sh (clang,
// -fsanitize=fuzzer,address,undefined).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <set>
#include <string>
#include <utility>

#include "common/crc32c.h"
#include "nvme/swap_manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string bytes(reinterpret_cast<const char*>(data), size);
  if (!bytes.empty() && bytes[0] == '!' && bytes.size() >= 65) {
    bytes.erase(0, 1);
    const uint64_t payload = bytes.size() - 64;
    std::memcpy(bytes.data() + 16, &payload, 8);
    const uint32_t pcrc = ztier::Crc32c(bytes.data() + 64, payload);
    std::memcpy(bytes.data() + 24, &pcrc, 4);
    const uint32_t hcrc = ztier::Crc32c(bytes.data(), 60);
    std::memcpy(bytes.data() + 60, &hcrc, 4);
  }
  ztier::Result<ztier::nvme::SwapManifest> r = ztier::nvme::DecodeSwapManifest(bytes, "fuzz");
  if (!r.ok()) return 0;
  std::set<std::pair<uint64_t, uint64_t>> used;  // (path, offset)
  for (const ztier::nvme::ManifestObject& o : r->objects) {
    if (o.units.size() != (o.size + r->stripe_bytes - 1) / r->stripe_bytes) __builtin_trap();
    for (size_t u = 0; u < o.units.size(); ++u) {
      const uint64_t path = (o.start_path + u) % r->paths.size();
      const uint64_t off = o.units[u].file_offset;
      if (off % r->stripe_bytes != 0 || off + r->stripe_bytes > r->file_bytes) __builtin_trap();
      if (!used.insert({path, off}).second) __builtin_trap();
    }
  }
  // And it encodes back to the same bytes.
  if (ztier::nvme::EncodeSwapManifest(*r) != bytes) __builtin_trap();
  return 0;
}
