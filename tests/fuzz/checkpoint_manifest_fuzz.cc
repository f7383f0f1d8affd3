// libFuzzer target: the checkpoint manifest decoder on arbitrary text.
// Checksums are the first gate; so that the fuzzer also reaches the field
// checks behind them, inputs starting with '!' get their checksum fixed
// before decoding. Built and run by scripts/fuzz.sh (clang,
// -fsanitize=fuzzer,address,undefined).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "common/crc32c.h"
#include "engine/checkpoint_manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  if (!text.empty() && text[0] == '!') {
    nlohmann::json m = nlohmann::json::parse(text.substr(1), nullptr, /*allow_exceptions=*/false);
    if (m.is_object()) {
      m.erase("checksum");
      const std::string canonical = m.dump();
      m["checksum"] = ztier::Crc32c(canonical.data(), canonical.size());
      text = m.dump();
    }
  }
  ztier::Result<ztier::engine::CheckpointManifest> r =
      ztier::engine::DecodeCheckpointManifest(text, "fuzz");
  if (r.ok()) {
    // What decodes must hold together: shards per rank, sizes that add up.
    for (const ztier::engine::CheckpointUnit& u : r->units) {
      if (u.shards.size() != static_cast<size_t>(r->ranks) || u.padded % r->ranks != 0 ||
          u.numel > u.padded) {
        __builtin_trap();
      }
      for (const ztier::engine::CheckpointShard& s : u.shards) {
        if (!ztier::engine::PlainFileName(s.file) ||
            s.bytes != ztier::engine::ShardFileBytes(u.padded / r->ranks)) {
          __builtin_trap();
        }
      }
    }
  }
  return 0;
}
