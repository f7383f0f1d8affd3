// ztier engine internal: the checkpoint manifest's format, its encoder and
// its defensive decoder (Engine::SaveCheckpoint / LoadCheckpoint use them;
// the libFuzzer target tests/fuzz/checkpoint_manifest_fuzz.cc feeds the
// decoder arbitrary text).
//
// A checkpoint is a directory: manifest.json plus one shard file per (unit,
// rank). manifest.json (version 1):
//   {"format": "ztier-checkpoint", "version": 1, "job": name, "step": S,
//    "adam_step": A, "ranks": R, "optimizer": {...},
//    "state_dtype": "fp32" | "int8" (how the saving job kept m and v;
//    optional: absent where the saver did not know it),
//    "units": [{"name", "numel", "padded",
//               "tensors": [{"name", "shape": [..], "frozen": true (only where
//                            the saving job kept no moments of it)}],
//               "shards": [{"file", "rank", "elements", "bytes", "crc32c"}]}],
//    "checksum": crc32c of the canonical JSON without this field}
// The shard files hold fp32 m and v whatever the state dtype (8-bit states
// are dequantized into them), so a checkpoint loads into either dtype.
// Shard file (little endian): "ZTCKPT01", u32 version, u32 unit, u32 rank,
// u32 reserved, u64 elements, then elements x fp32 master, exp_avg and
// exp_avg_sq.
//
// The decoder trusts nothing: the checksum, every field's JSON type, counts
// and sizes with overflow-checked arithmetic against fixed limits (so a
// forged manifest cannot make the loader allocate absurd amounts), tensor
// shapes that add up to the unit's numel, padding that the rank count
// divides, shard entries that match their unit exactly, and file names that
// are plain names inside the directory (never "", ".", "..", or anything
// with a '/'), each used once. Anything else is Corruption naming the field.
//
// Pure functions; thread-safe.
#ifndef ZTIER_ENGINE_CHECKPOINT_MANIFEST_H_
#define ZTIER_ENGINE_CHECKPOINT_MANIFEST_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "engine/wire_types.h"

namespace ztier::engine {

inline constexpr char kCheckpointManifestName[] = "manifest.json";
inline constexpr uint32_t kCheckpointVersion = 1;
inline constexpr uint64_t kShardHeaderBytes = 32;
// Limits a manifest must stay within (far above any real model).
inline constexpr int64_t kMaxCheckpointRanks = 1024;
inline constexpr size_t kMaxCheckpointUnits = size_t{1} << 20;
inline constexpr uint64_t kMaxManifestBytes = uint64_t{256} << 20;

// A tensor's name and shape, as a job registers it.
using CheckpointTensor = TensorSpec;

struct CheckpointShard {
  std::string file;  // a plain name inside the checkpoint directory
  int rank = 0;
  uint64_t elements = 0;
  uint64_t bytes = 0;
  uint32_t crc32c = 0;
};

struct CheckpointUnit {
  std::string name;
  uint64_t numel = 0;
  uint64_t padded = 0;
  std::vector<CheckpointTensor> tensors;
  std::vector<CheckpointShard> shards;  // one per rank, in rank order
};

struct CheckpointManifest {
  std::string job;
  int64_t step = 0;
  int64_t adam_step = 0;
  int ranks = 1;
  std::string optimizer_json = "{}";  // the job's optimizer config, for people reading it
  std::string state_dtype;            // "fp32", "int8", or "" (not recorded)
  std::vector<CheckpointUnit> units;
};

// Bytes of a shard file holding `elements` elements of master, m and v.
inline uint64_t ShardFileBytes(uint64_t elements) { return kShardHeaderBytes + 12 * elements; }

// Whether `name` may name a file inside a checkpoint directory.
bool PlainFileName(std::string_view name);

// The manifest's JSON text, checksum included.
std::string EncodeCheckpointManifest(const CheckpointManifest& m);

// `origin` names the file in messages. Errors: Corruption.
Result<CheckpointManifest> DecodeCheckpointManifest(std::string_view text, std::string_view origin);

}  // namespace ztier::engine

#endif  // ZTIER_ENGINE_CHECKPOINT_MANIFEST_H_
