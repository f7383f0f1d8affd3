// ztier engine: checkpoints and safetensors files over a StateAccess (see
// state_files.h).
#include "engine/state_files.h"

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <string_view>
#include <utility>

#include <nlohmann/json.hpp>

#include "common/bf16.h"
#include "common/crc32c.h"
#include "common/file_util.h"
#include "common/log.h"
#include "cpu_adam/adamw.h"  // kMaxGradSqSum only (a constant)
#include "engine/checkpoint_manifest.h"
#include "engine/safetensors.h"

namespace ztier::engine {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr char kMagic[8] = {'Z', 'T', 'C', 'K', 'P', 'T', '0', '1'};

// For people reading the manifest; a load never compares it. Param groups
// (group_weight_decay) appear only when the job has them, and which group a
// tensor is in, or whether it is frozen, is not part of the layout: a
// checkpoint loads into a job with other groups.
std::string OptimizerJson(const OptimizerConfig& o) {
  Json j{{"lr", o.hyper.lr},
         {"beta1", o.hyper.beta1},
         {"beta2", o.hyper.beta2},
         {"eps", o.hyper.eps},
         {"weight_decay", o.hyper.weight_decay},
         {"mode", o.hyper.mode == cpu_adam::Mode::kAdamW ? "adamw" : "adam"},
         {"bias_correction", o.hyper.bias_correction == cpu_adam::BiasCorrection::kOn},
         {"clip_norm", o.clip_norm},
         {"grad_accumulation", o.grad_accumulation},
         {"step_mode", o.mode == StepMode::kExact ? "exact" : "eager"}};
  if (!o.group_weight_decay.empty()) j["group_weight_decay"] = o.group_weight_decay;
  return j.dump();
}

// A setting's value as a person wrote it: the fp32 settings in the fewest
// digits that read back as the same float (0.1, not 0.10000000149011612).
std::string SettingText(const Json& v) {
  if (v.is_number_float()) {
    const float f = static_cast<float>(v.get<double>());
    char buf[32];
    for (int digits = 1; digits <= 9; ++digits) {
      std::snprintf(buf, sizeof(buf), "%.*g", digits, f);
      if (std::strtof(buf, nullptr) == f) break;
    }
    std::string text = buf;
    if (text.find_first_of(".eni") == std::string::npos) text += ".0";  // a float, as written
    return text;
  }
  if (v.is_array()) {
    std::string out = "[";
    for (size_t i = 0; i < v.size(); ++i) out += StrCat(i ? ", " : "", SettingText(v[i]));
    return out + "]";
  }
  return v.dump();
}

// The moments a checkpoint holds were made with its optimizer's settings;
// the job's apply from here on. Where they differ (the learning rate aside,
// which schedules change every step) a person resuming is told so.
void WarnOfOtherOptimizer(const JobDescription& job, const CheckpointManifest& m,
                          const std::string& dir) {
  const Json saved = Json::parse(m.optimizer_json, nullptr, /*allow_exceptions=*/false);
  const Json now = Json::parse(OptimizerJson(job.optimizer));
  if (!saved.is_object()) return;
  std::string differs;
  for (const auto& [key, value] : now.items()) {
    if (key == "lr" || !saved.contains(key) || saved[key] == value) continue;
    differs += StrCat(differs.empty() ? "" : ", ", key, " ", SettingText(saved[key]), " -> ",
                      SettingText(value));
  }
  if (!differs.empty()) {
    ZT_LOG(kWarn, "checkpoint") << dir << " was saved with other optimizer settings; this "
                                << "job's apply from here on: " << differs;
  }
}

// The files the manifest in `dir` names; NotFound without one, the read's or
// the decode's error when it cannot be read.
Result<std::set<std::string>> NamedFiles(const std::string& dir) {
  const std::string manifest = (fs::path(dir) / kCheckpointManifestName).string();
  ZT_ASSIGN_OR_RETURN(const std::string text, ReadFileToString(manifest, kMaxManifestBytes));
  ZT_ASSIGN_OR_RETURN(const CheckpointManifest m, DecodeCheckpointManifest(text, manifest));
  std::set<std::string> named;
  for (const CheckpointUnit& u : m.units) {
    for (const CheckpointShard& s : u.shards) named.insert(s.file);
  }
  return named;
}

// Removes the files of a failed save that the manifest now on disk does not
// name (the manifest may have been renamed into place before the failure).
void RemoveUncommitted(const std::string& dir, const std::vector<std::string>& written) {
  Result<std::set<std::string>> named = NamedFiles(dir);
  if (!named.ok() && named.status().code() != StatusCode::kNotFound) {
    // The manifest there cannot be read: it may be this save's, renamed
    // into place before the failure, and name these files. They stay.
    ZT_LOG(kWarn, "engine") << "a failed checkpoint save leaves its files in " << dir
                            << " (the manifest there cannot be read to tell which are unused: "
                            << named.status() << ")";
    return;
  }
  for (const std::string& name : written) {
    if (named.ok() && named->count(name) != 0) continue;
    Status s = RemoveFile((fs::path(dir) / name).string());
    if (!s.ok()) {
      ZT_LOG(kWarn, "engine") << "removing a file of a failed checkpoint save: " << s;
    }
  }
}

// Whether `name` is a shard file a save writes (unit-K-rank-R-step-S-TAG.bin,
// or without the tag, as older saves named them) or the temp file of one
// ("<name>.<pid>-<n>.tmp"): only those are a checkpoint's to remove (a
// user's unit-test-results.txt beside them went too).
bool IsShardFileName(const std::string& name) {
  std::string_view rest = name;
  const auto literal = [&](std::string_view text) {
    if (!rest.starts_with(text)) return false;
    rest.remove_prefix(text.size());
    return true;
  };
  const auto run = [&](auto in_class, size_t min, size_t max) {
    size_t n = 0;
    while (n < rest.size() && n < max && in_class(rest[n])) ++n;
    if (n < min) return false;
    rest.remove_prefix(n);
    return true;
  };
  const auto digit = [](char c) { return c >= '0' && c <= '9'; };
  const auto hex = [&](char c) { return digit(c) || (c >= 'a' && c <= 'f'); };
  const auto digits = [&] { return run(digit, 1, SIZE_MAX); };
  if (!(literal("unit-") && digits() && literal("-rank-") && digits() && literal("-step-") &&
        digits())) {
    return false;
  }
  if (literal("-") && !(run(hex, 8, 8) && rest.starts_with(".bin"))) return false;
  if (!literal(".bin")) return false;
  if (rest.empty()) return true;
  return literal(".") && digits() && literal("-") && digits() && literal(".tmp") && rest.empty();
}

// Removes the shard files in `dir` not in `keep` (an older checkpoint's);
// the first failure is returned, after trying every file.
Status RemoveUnnamed(const std::string& dir, const std::set<std::string>& keep) {
  Status first;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (!IsShardFileName(name) || keep.count(name) != 0) continue;
    Status removed = RemoveFile(entry.path().string());
    if (!removed.ok()) {
      ZT_LOG(kWarn, "engine") << "removing a file of an older checkpoint: " << removed;
      if (first.ok()) first = removed;
    }
  }
  return first;
}

// Whether `dir` holds no manifest, not even a link (dangling or not): no
// shard file there is committed.
bool NoManifest(const std::string& dir) {
  struct stat st {};
  return ::lstat((fs::path(dir) / kCheckpointManifestName).c_str(), &st) != 0 && errno == ENOENT;
}

// A tag that makes this save's file names its own.
std::string SaveTag() {
  std::random_device rd;
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%08x", rd());
  return buf;
}

// The first difference between the checkpoint's units and the job's, named
// down to the tensor and both shapes.
Status CheckLayout(const JobDescription& job, const CheckpointManifest& m, const std::string& dir) {
  auto mismatch = [&](std::string_view what) {
    return Status::InvalidArgument(
        StrCat("checkpoint ", dir, " does not fit job '", job.name, "': ", what));
  };
  if (m.units.size() != job.units.size()) {
    return mismatch(StrCat("it has ", m.units.size(), " units, the job ", job.units.size()));
  }
  for (size_t k = 0; k < job.units.size(); ++k) {
    const CheckpointUnit& cu = m.units[k];
    const UnitSpec& us = job.units[k];
    if (cu.name != us.name) {
      return mismatch(StrCat("unit ", k, " is '", cu.name, "' there and '", us.name, "' here"));
    }
    const size_t common = std::min(cu.tensors.size(), us.tensors.size());
    for (size_t t = 0; t < common; ++t) {
      const CheckpointTensor& ct = cu.tensors[t];
      const TensorSpec& ts = us.tensors[t];
      if (ct.name != ts.name) {
        return mismatch(StrCat("unit '", us.name, "' tensor ", t, " is '", ct.name, "' there and '",
                               ts.name, "' here"));
      }
      if (ct.shape != ts.shape) {
        return mismatch(StrCat("unit '", us.name, "' tensor '", ts.name, "' has shape ",
                               ShapeText(ct.shape), " in the checkpoint and ", ShapeText(ts.shape),
                               " in the job"));
      }
    }
    if (cu.tensors.size() != us.tensors.size()) {
      return mismatch(StrCat("unit '", us.name, "' has ", cu.tensors.size(), " tensors there and ",
                             us.tensors.size(), " here"));
    }
  }
  return Status::Ok();
}

// The manifest's text. Errors: NotFound naming what is missing, as
// ReadFileToString.
Result<std::string> ReadManifest(const std::string& dir) {
  const std::string path = (fs::path(dir) / kCheckpointManifestName).string();
  Result<std::string> text = ReadFileToString(path, kMaxManifestBytes);
  if (!text.ok() && text.status().code() == StatusCode::kNotFound) {
    std::error_code ec;
    return Status::NotFound(StrCat("checkpoint ", dir,
                                   fs::is_directory(dir, ec)
                                       ? " has no manifest.json (not a checkpoint, or none "
                                         "was ever committed there)"
                                       : " does not exist"));
  }
  return text;
}

}  // namespace

std::string ImpossibleStateValue(const UnitSpec& unit, const UnitLayout& layout, uint64_t first,
                                 uint64_t count, const float* master, const float* exp_avg,
                                 const float* exp_avg_sq) {
  static constexpr const char* kArrays[3] = {"fp32 master", "m (exp_avg)", "v (exp_avg_sq)"};
  static const float kMaxM = static_cast<float>(2 * std::sqrt(cpu_adam::kMaxGradSqSum));
  static constexpr float kMaxV = static_cast<float>(2 * cpu_adam::kMaxGradSqSum);
  const auto possible = [](int a, float x) {
    switch (a) {
      case 0:
        return FiniteInBf16(x);
      case 1:
        return std::fabs(x) <= kMaxM;  // false for NaN
      default:
        return x >= 0.0f && x <= kMaxV;
    }
  };
  const float* arrays[3] = {master, exp_avg, exp_avg_sq};
  for (int a = 0; a < 3; ++a) {
    const float* x = arrays[a];
    if (x == nullptr) continue;
    for (uint64_t i = 0; i < count; ++i) {
      if (possible(a, x[i])) continue;
      const uint64_t at = first + i;
      std::string what = "its padding";
      for (size_t t = layout.offsets.size(); t-- > 0;) {
        if (at < layout.numel && layout.offsets[t] <= at) {
          what = StrCat("tensor '", unit.tensors[t].name, "' element ", at - layout.offsets[t]);
          break;
        }
      }
      return StrCat(what, " has ", kArrays[a], " ", x[i]);
    }
  }
  return "";
}

namespace {

// Reads unit k's shards (as `m` names them) into flat buffers of the
// checkpoint's layout, verifying sizes, checksums and headers; with
// `apply`, lays the state out in the job's layout there.
// A shard's master, m and v (`shard` elements each, back to back, from
// element `first` of unit k) hold what an optimizer could have left
// (ImpossibleStateValue): a checkpoint whose checksums were rewritten over
// other values (or saved by another program) trained on as NaN (every step
// skipped), or stepped its master to Inf. Corruption, naming the file, the
// tensor and the element.
Status CheckFinite(const JobDescription& job, size_t k, uint64_t first, const float* data,
                   uint64_t shard, const std::string& where) {
  const std::string bad = ImpossibleStateValue(job.units[k], job.layouts[k], first, shard, data,
                                               data + shard, data + 2 * shard);
  if (bad.empty()) return Status::Ok();
  return Status::Corruption(StrCat("checkpoint file ", where, ": unit '", job.units[k].name, "' ",
                                   bad, ", which no training leaves; nothing was loaded"));
}

// Int8 states of older versions could store a small positive v as 0 beside
// a nonzero m (the quantizer now keeps v's smallest code instead); such an
// element would step by lr * m / eps, thousands of times too far. Loaded,
// its v is taken as m^2, which bounds its step to about lr, as AdamW's own
// moments do (|m| <= sqrt(v) within a small factor for any grads). Float32
// training leaves v 0 beside m only when g^2 underflows, where m^2 does too
// (below FLT_MIN): nothing changes there. Returns the elements lifted.
uint64_t LiftVanishedSecondMoments(const float* exp_avg, float* exp_avg_sq, uint64_t n) {
  uint64_t lifted = 0;
  for (uint64_t i = 0; i < n; ++i) {
    // (Not where m^2 is below FLT_MIN: a block of v that small is kept as
    // zeros, and such an m, far below eps, moves nothing.)
    if (exp_avg_sq[i] == 0.0f && exp_avg[i] * exp_avg[i] >= FLT_MIN) {
      exp_avg_sq[i] = exp_avg[i] * exp_avg[i];
      ++lifted;
    }
  }
  return lifted;
}

Status LoadUnit(const JobDescription& job, const CheckpointManifest& m, const std::string& dir,
                size_t k, const UnitState* apply, std::atomic<uint64_t>* lifted = nullptr) {
  const UnitLayout& layout = job.layouts[k];
  const CheckpointUnit& cu = m.units[k];
  std::vector<float> flat[3];
  if (apply) {
    for (auto& f : flat) f.assign(cu.padded, 0.0f);
  }
  const uint64_t shard = cu.padded / m.ranks;
  for (int r = 0; r < m.ranks; ++r) {
    const CheckpointShard& s = cu.shards[r];
    const std::string where = (fs::path(dir) / s.file).string();
    Result<std::string> data = ReadFileToString(where, s.bytes);
    if (!data.ok()) {
      if (data.status().code() == StatusCode::kResourceExhausted) {  // larger than it should be
        return Status::Corruption(StrCat("checkpoint file ", where, " is larger than the ", s.bytes,
                                         " bytes the manifest says"));
      }
      return data.status().Annotate("checkpoint file");
    }
    if (data->size() != s.bytes) {
      return Status::Corruption(StrCat("checkpoint file ", where, " is ", data->size(),
                                       " bytes, expected ", s.bytes, " (truncated?)"));
    }
    if (Crc32c(data->data(), data->size()) != s.crc32c) {
      return Status::Corruption(StrCat("checkpoint file ", where, ": checksum mismatch"));
    }
    uint32_t fields[4];
    uint64_t elements;
    std::memcpy(fields, data->data() + 8, 16);
    std::memcpy(&elements, data->data() + 24, 8);
    if (std::memcmp(data->data(), kMagic, 8) != 0 || fields[0] != kCheckpointVersion ||
        fields[1] != k || fields[2] != static_cast<uint32_t>(r) || elements != shard) {
      return Status::Corruption(StrCat("checkpoint file ", where,
                                       ": header does not match the manifest (unit ", k, ", rank ",
                                       r, ")"));
    }
    if (!apply) {
      ZT_RETURN_IF_ERROR(CheckFinite(
          job, k, r * shard, reinterpret_cast<const float*>(data->data() + kShardHeaderBytes),
          shard, where));
      continue;
    }
    for (int a = 0; a < 3; ++a) {
      std::memcpy(flat[a].data() + r * shard, data->data() + kShardHeaderBytes + a * shard * 4,
                  shard * 4);
    }
  }
  if (!apply) return Status::Ok();
  if (m.state_dtype != "fp32" && lifted != nullptr) {
    *lifted += LiftVanishedSecondMoments(flat[1].data(), flat[2].data(), layout.numel);
  }
  // Into this job's layout: the first numel elements, zero padding.
  for (auto [a, out] : {std::pair{0, apply->master}, {1, apply->exp_avg}, {2, apply->exp_avg_sq}}) {
    std::memcpy(out, flat[a].data(), layout.numel * 4);
    std::memset(out + layout.numel, 0, (layout.padded - layout.numel) * 4);
  }
  return Status::Ok();
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf / NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;  // signed zero
  } else {        // subnormal: normalise
    exp = 113;
    while ((mant & 0x400) == 0) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace

std::string CheckpointDirKey(const std::string& dir) {
  std::error_code ec;
  const fs::path absolute = fs::absolute(dir, ec);
  // Without its "." and empty parts; its ".." kept, as the kernel walks
  // them: folded, "link/../ckpt" and "ckpt" were one key for two
  // directories (a save to the second took no lock).
  fs::path key;
  for (const fs::path& part : ec ? fs::path(dir) : absolute) {
    if (part.empty() || part == ".") continue;
    key /= part;
  }
  std::string text = key.empty() ? std::string(".") : key.string();
  while (text.size() > 1 && text.back() == '/') text.pop_back();
  return text;
}

namespace {
// Claims made in this process so far (Claim::made, LockFileNow).
std::atomic<uint64_t> claims_made{0};
}  // namespace

ClaimedCheckpointDirs::LockFileNow ClaimedCheckpointDirs::Look(const std::string& dir) {
  LockFileNow now;
  now.claims_before = claims_made.load();  // before the stat
  if (::stat((fs::path(dir) / kCheckpointLockFile).c_str(), &now.st) == 0) {
    now.known = now.exists = true;
  } else {
    now.known = errno == ENOENT;  // (another error says nothing of the file)
  }
  return now;
}

bool ClaimedCheckpointDirs::Holds(const std::string& key, const LockFileNow& now, bool touch,
                                  bool pin, std::vector<DirLock>* gone) {
  auto it = std::find_if(claims_.begin(), claims_.end(),
                         [&](const Claim& claim) { return claim.key == key; });
  if (it == claims_.end()) return false;
  if (now.known && it->made <= now.claims_before && (!now.exists || !it->lock.IsFile(now.st))) {
    gone->push_back(std::move(it->lock));
    claims_.erase(it);
    return false;
  }
  it->pinned = it->pinned || pin;
  if (touch) std::rotate(it, it + 1, claims_.end());
  return true;
}

void ClaimedCheckpointDirs::Add(std::string key, DirLock lock, bool pin,
                                std::vector<DirLock>* gone) {
  size_t unpinned = 0;
  for (const Claim& claim : claims_) unpinned += claim.pinned ? 0 : 1;
  for (auto it = claims_.begin();
       !pin && unpinned >= kMaxClaimedCheckpointDirs && it != claims_.end();) {
    if (it->pinned) {
      ++it;
      continue;
    }
    gone->push_back(std::move(it->lock));
    it = claims_.erase(it);
    --unpinned;
  }
  claims_.push_back(Claim{std::move(key), std::move(lock), pin, ++claims_made});
}

Status CreateCheckpointDir(const std::string& dir) {
  if (dir.empty()) return Status::InvalidArgument("an empty path names no checkpoint directory");
  std::error_code ec;
  // As given, its ".." left to the kernel as every open in it is: made
  // lexically normal, "link/../ckpt" was made beside the link, not where
  // the saves went.
  fs::path path(dir);
  if (!path.has_filename()) path = path.parent_path();  // "a/b/"
  // The levels made now: each one's name is made durable with its parent,
  // as a file's is by WriteFileAtomically.
  std::vector<fs::path> made;
  for (fs::path p = path; !p.empty() && !fs::exists(p, ec); p = p.parent_path()) {
    made.push_back(p);
    if (p == p.parent_path()) break;
  }
  fs::create_directories(path, ec);
  if (ec) return PosixError(StrCat("create checkpoint directory ", dir), ec.value());
  for (const fs::path& p : made) {
    const std::string parent = p.parent_path().empty() ? "." : p.parent_path().string();
    ZT_RETURN_IF_ERROR(FsyncPath(parent, /*directory=*/true));
  }
  return CheckManifestIsNoLink(path.string());
}

Status CheckManifestIsNoLink(const std::string& dir) {
  std::error_code ec;
  const fs::path manifest = fs::path(dir) / kCheckpointManifestName;
  if (!fs::is_symlink(fs::symlink_status(manifest, ec))) return Status::Ok();
  const fs::path to = fs::read_symlink(manifest, ec);
  return Status::FailedPrecondition(
      StrCat("checkpoint manifest ", manifest.string(), " is a symbolic link (to ", to.string(),
             "): a manifest names the shard files beside it, so a save never writes through "
             "a link; remove the link"));
}

Status SaveCheckpointFiles(const JobDescription& job, StateAccess& state, const std::string& dir) {
  // With no manifest, no shard file there is committed (a first save was
  // killed before its commit): they go before this save needs their room.
  // On a disk with room for one checkpoint, every later save failed on them.
  if (NoManifest(dir)) (void)RemoveUnnamed(dir, {});  // logged
  CheckpointManifest manifest;
  manifest.job = job.name;
  manifest.step = job.step;
  manifest.adam_step = job.adam_step;
  manifest.ranks = job.ranks;
  manifest.optimizer_json = OptimizerJson(job.optimizer);
  manifest.state_dtype = job.state_dtype;
  const std::string tag = SaveTag();
  std::vector<std::string> written;
  Status s = state.Read([&](size_t k, const UnitState& unit) -> Status {
    const UnitLayout& layout = job.layouts[k];
    const UnitSpec& us = job.units[k];
    CheckpointUnit& cu = manifest.units.emplace_back();
    cu.name = us.name;
    cu.numel = layout.numel;
    cu.padded = layout.padded;
    for (const TensorSpec& t : us.tensors) {
      cu.tensors.push_back({.name = t.name, .shape = t.shape, .frozen = t.frozen});
    }
    for (int r = 0; r < job.ranks; ++r) {
      const uint64_t n = layout.shard;
      const uint64_t off = static_cast<uint64_t>(r) * n;
      std::string data(ShardFileBytes(n), '\0');
      std::memcpy(data.data(), kMagic, 8);
      const uint32_t fields[4] = {kCheckpointVersion, static_cast<uint32_t>(k),
                                  static_cast<uint32_t>(r), 0};
      std::memcpy(data.data() + 8, fields, 16);
      std::memcpy(data.data() + 24, &n, 8);
      char* body = data.data() + kShardHeaderBytes;
      std::memcpy(body, unit.master + off, n * 4);
      std::memcpy(body + n * 4, unit.exp_avg + off, n * 4);
      std::memcpy(body + 2 * n * 4, unit.exp_avg_sq + off, n * 4);
      const std::string name =
          StrCat("unit-", k, "-rank-", r, "-step-", job.step, "-", tag, ".bin");
      // Listed before it is written: a write that fails after its rename
      // (the directory fsync) leaves the file in place, to be removed.
      written.push_back(name);
      // A fresh name (the save's tag): no writer left temps of it, and the
      // directory is fsynced once after the last shard file (below).
      ZT_RETURN_IF_ERROR(
          WriteFileAtomically((fs::path(dir) / name).string(), data,
                              {.remove_stale_temps = false, .fsync_directory = false}));
      cu.shards.push_back({.file = name,
                           .rank = r,
                           .elements = n,
                           .bytes = data.size(),
                           .crc32c = Crc32c(data.data(), data.size())});
    }
    return Status::Ok();
  });
  if (s.ok()) s = FsyncPath(dir, /*directory=*/true);  // the shard files' names
  if (s.ok()) {
    s = WriteFileAtomically((fs::path(dir) / kCheckpointManifestName).string(),
                            EncodeCheckpointManifest(manifest));
  }
  if (!s.ok()) {
    // When only the directory fsync after the manifest's rename failed, the
    // new checkpoint is in place but maybe not durable: the old files stay
    // (a crash could bring the old manifest back), RemoveUncommitted keeps
    // the new ones, and the next save that succeeds removes the leftovers.
    RemoveUncommitted(dir, written);
    return s;
  }
  // The new checkpoint is committed: drop the files of older ones.
  (void)RemoveUnnamed(dir, std::set<std::string>(written.begin(), written.end()));  // logged
  return Status::Ok();
}

Status RemoveCheckpointFiles(const std::string& dir) {
  ZT_RETURN_IF_ERROR(RemoveFile((fs::path(dir) / kCheckpointManifestName).string()));
  ZT_RETURN_IF_ERROR(FsyncPath(dir, /*directory=*/true));
  return RemoveUnnamed(dir, {});
}

Status RemoveUnnamedCheckpointFiles(const std::string& dir) {
  Result<std::set<std::string>> named = NamedFiles(dir);
  if (named.ok()) return RemoveUnnamed(dir, *named);
  // A manifest that cannot be read (a link to a filesystem not mounted) may
  // name them: nothing to tell the unused ones by.
  if (NoManifest(dir)) return RemoveUnnamed(dir, {});  // a missing dir: nothing to remove
  return Status::Ok();
}

// Loads take no lock: the manifest is replaced atomically and names files
// no later save reuses, so a load sees one committed checkpoint or, when a
// save commits and removes the files it is reading, a missing file; then it
// starts again from the new manifest (a few times at most).
Status LoadCheckpointFiles(const JobDescription& job, StateAccess& state, const std::string& dir) {
  constexpr int kAttempts = 4;
  Status st;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    ZT_ASSIGN_OR_RETURN(const std::string text, ReadManifest(dir));
    ZT_ASSIGN_OR_RETURN(
        const CheckpointManifest m,
        DecodeCheckpointManifest(text, (fs::path(dir) / kCheckpointManifestName).string()));
    ZT_RETURN_IF_ERROR(CheckLayout(job, m, dir));
    if (attempt == 0) WarnOfOtherOptimizer(job, m, dir);
    if (!m.state_dtype.empty() && !job.state_dtype.empty() && m.state_dtype != job.state_dtype) {
      ZT_LOG(kWarn, "checkpoint") << dir << ": m and v saved from " << m.state_dtype
                                  << " states load into " << job.state_dtype << " states ("
                                  << (job.state_dtype == "int8"
                                          ? "quantized"
                                          : "the saved 8-bit values, dequantized")
                                  << ")";
    }
    // Every file once without applying, so a damaged one leaves the job
    // untouched; then again to apply (the state on the drives need not be
    // read first: every element of master, m, v and the params is set).
    st = Status::Ok();
    for (size_t k = 0; k < job.units.size() && st.ok(); ++k) {
      st = LoadUnit(job, m, dir, k, nullptr);
    }
    if (st.ok()) {
      std::atomic<uint64_t> lifted = 0;
      st = state.Overwrite([&](size_t k, const UnitState& unit) {
        return LoadUnit(job, m, dir, k, &unit, &lifted);
      });
      if (st.ok()) st = state.Commit(m.step, m.adam_step);
      if (st.ok() && lifted > 0) {
        ZT_LOG(kWarn, "checkpoint")
            << dir << ": " << lifted.load()
            << " element(s) of v stored as 0 beside a nonzero m (as int8 states of older "
               "versions held them) were loaded as m^2, so that they step by about lr, not "
               "lr * m / eps";
      }
      if (st.ok()) return Status::Ok();
    }
    // A file gone because a save committed meanwhile: read the new manifest.
    Result<std::string> now = ReadManifest(dir);
    if (st.code() != StatusCode::kNotFound || !now.ok() || *now == text) break;
  }
  return PartlyWrittenNote(state, std::move(st), "loaded; load a checkpoint again");
}

Status PartlyWrittenNote(const StateAccess& state, Status st, std::string_view what) {
  if (st.ok() || state.units_written() == 0 ||
      st.message().find(kAnotherWriter) != std::string::npos) {
    return st;
  }
  return st.Annotate(StrCat("the job's state is now partly ", what));
}

namespace {

// A safetensors file holds each name once, and none named __metadata__: a
// job whose units repeat a tensor name, or use that one (legal for its
// checkpoints, which go by index), has no file.
Status UniqueTensorNames(const JobDescription& job, std::string_view what) {
  std::map<std::string_view, std::string_view> unit_of;
  for (const UnitSpec& us : job.units) {
    for (const TensorSpec& ts : us.tensors) {
      if (ts.name == kSafetensorsMetadataKey) {
        return Status::InvalidArgument(
            StrCat(what, ": unit '", us.name, "' has a tensor named '", ts.name,
                   "', the name a safetensors header keeps for its metadata (rename the tensor)"));
      }
      const auto [at, fresh] = unit_of.emplace(ts.name, us.name);
      if (!fresh) {
        const std::string where = at->second == us.name ? StrCat("is twice in unit '", us.name, "'")
                                                        : StrCat("is in unit '", at->second,
                                                                 "' and in unit '", us.name, "'");
        return Status::InvalidArgument(
            StrCat(what, ": tensor name '", ts.name, "' ", where,
                   "; a safetensors file names each tensor once (give the tensors unique names)"));
      }
    }
  }
  return Status::Ok();
}

}  // namespace

Status ExportSafetensorsFile(const JobDescription& job, StateAccess& state, const std::string& path,
                             ExportType type) {
  const bool bf16_out = type == ExportType::kBFloat16;
  std::vector<StEntry> entries;
  const uint64_t esize = bf16_out ? 2 : 4;
  ZT_RETURN_IF_ERROR(UniqueTensorNames(job, StrCat("export ", path)));
  for (size_t k = 0; k < job.units.size(); ++k) {
    const UnitSpec& us = job.units[k];
    for (size_t t = 0; t < us.tensors.size(); ++t) {
      const uint64_t begin = job.layouts[k].offsets[t];
      const uint64_t end =
          t + 1 < us.tensors.size() ? job.layouts[k].offsets[t + 1] : job.layouts[k].numel;
      entries.push_back({us.tensors[t].name, bf16_out ? "BF16" : "F32", us.tensors[t].shape,
                         (end - begin) * esize});
    }
  }
  std::string data = MakeSafetensorsHeader(entries);
  ZT_RETURN_IF_ERROR(state.Read([&](size_t k, const UnitState& unit) {
    const UnitLayout& layout = job.layouts[k];
    const float* master = unit.master;
    if (bf16_out) {
      const size_t at = data.size();
      data.resize(at + layout.numel * 2);
      for (uint64_t i = 0; i < layout.numel; ++i) {
        const uint16_t b = FloatToBf16(master[i]).bits;
        std::memcpy(data.data() + at + i * 2, &b, 2);
      }
    } else {
      data.append(reinterpret_cast<const char*>(master), layout.numel * 4);
    }
    return Status::Ok();
  }));
  return WriteFileAtomically(path, data);
}

Status ImportSafetensorsFile(const JobDescription& job, StateAccess& state,
                             const std::string& path) {
  ZT_RETURN_IF_ERROR(UniqueTensorNames(job, StrCat("import ", path)));
  ZT_ASSIGN_OR_RETURN(std::string file, ReadFileToString(path));
  Result<StHeader> parsed = ParseSafetensorsHeader(file, file.size());
  if (!parsed.ok()) return parsed.status().Annotate(path);
  const StHeader& h = *parsed;
  const auto element_count = [](const StTensor& st) {
    return (st.end - st.begin) / (st.dtype == StDtype::kF32 ? 4 : 2);
  };
  const auto element = [&](const StTensor& st, uint64_t i) {
    const char* src = file.data() + h.data_start + st.begin;
    if (st.dtype == StDtype::kF32) {
      float x;
      std::memcpy(&x, src + i * 4, 4);
      return x;
    }
    uint16_t b;
    std::memcpy(&b, src + i * 2, 2);
    return st.dtype == StDtype::kBF16 ? Bf16ToFloat(bf16{b}) : HalfToFloat(b);
  };
  // Check every tensor before touching the job.
  for (size_t k = 0; k < job.units.size(); ++k) {
    for (const TensorSpec& ts : job.units[k].tensors) {
      auto it = h.tensors.find(ts.name);
      if (it == h.tensors.end()) {
        return Status::NotFound(
            StrCat(path, ": no tensor '", ts.name, "' (unit '", job.units[k].name, "')"));
      }
      if (it->second.shape != ts.shape) {
        return Status::InvalidArgument(StrCat(path, ": tensor '", ts.name, "' has shape ",
                                              ShapeText(it->second.shape), " in the file and ",
                                              ShapeText(ts.shape), " in the job"));
      }
      if (it->second.dtype == StDtype::kOther) {
        return Status::InvalidArgument(StrCat(path, ": tensor '", ts.name, "' is ",
                                              it->second.dtype_name,
                                              "; ztier imports F32, BF16 and F16"));
      }
      // A NaN or an infinity would train as NaN, every step skipped; a
      // value past bf16's range is published as Inf (and its own export
      // was then refused).
      const StTensor& st = it->second;
      for (uint64_t i = 0; i < element_count(st); ++i) {
        const float x = element(st, i);
        if (!FiniteInBf16(x)) {
          return Status::InvalidArgument(StrCat(path, ": tensor '", ts.name, "' element ", i,
                                                " is ", x, "; ", kWeightsInBf16Range,
                                                " (nothing was imported)"));
        }
      }
    }
  }
  Status updated = state.UpdateMaster([&](size_t k, const UnitState& unit) {
    const UnitLayout& layout = job.layouts[k];
    float* master = unit.master;
    const std::vector<TensorSpec>& tensors = job.units[k].tensors;
    for (size_t t = 0; t < tensors.size(); ++t) {
      const StTensor& st = h.tensors.at(tensors[t].name);
      float* dst = master + layout.offsets[t];
      for (uint64_t i = 0; i < element_count(st); ++i) dst[i] = element(st, i);
    }
    std::memset(master + layout.numel, 0, (layout.padded - layout.numel) * 4);
    return Status::Ok();
  });
  ZT_RETURN_IF_ERROR(PartlyWrittenNote(state, std::move(updated), "imported; import it again"));
  // The steps the job is at when the state commits (through ztierd a step
  // may have completed since `job` was described).
  return state.Commit(kKeepSteps, kKeepSteps);
}

}  // namespace ztier::engine
