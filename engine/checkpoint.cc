// ztier engine: checkpoints (see Engine::SaveCheckpoint / LoadCheckpoint).
//
// Shard file (little endian): "ZTCKPT01", u32 version, u32 unit, u32 rank,
// u32 reserved, u64 elements, then elements x fp32 master, exp_avg and
// exp_avg_sq. The manifest lists every file with its size and CRC-32C and
// carries a checksum of its own canonical JSON.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "common/crc32c.h"
#include "common/file_util.h"
#include "engine/engine_internal.h"
#include "engine/safetensors.h"

namespace ztier::engine {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr char kMagic[8] = {'Z', 'T', 'C', 'K', 'P', 'T', '0', '1'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeader = 32;
constexpr const char* kFormat = "ztier-checkpoint";

uint32_t ManifestChecksum(Json manifest) {
  manifest.erase("checksum");
  const std::string canonical = manifest.dump();
  return Crc32c(canonical.data(), canonical.size());
}

Json OptimizerJson(const OptimizerConfig& o) {
  return Json{{"lr", o.hyper.lr},
              {"beta1", o.hyper.beta1},
              {"beta2", o.hyper.beta2},
              {"eps", o.hyper.eps},
              {"weight_decay", o.hyper.weight_decay},
              {"mode", o.hyper.mode == cpu_adam::Mode::kAdamW ? "adamw" : "adam"},
              {"bias_correction", o.hyper.bias_correction == cpu_adam::BiasCorrection::kOn},
              {"clip_norm", o.clip_norm},
              {"grad_accumulation", o.grad_accumulation},
              {"step_mode", o.mode == StepMode::kExact ? "exact" : "eager"}};
}

}  // namespace

Status SaveCheckpointImpl(Job& job, const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::IoError(StrCat("create checkpoint directory ", dir, ": ", ec.message()));
  const int64_t step = job.step;
  Json units = Json::array();
  std::set<std::string> keep = {"manifest.json"};
  ZT_RETURN_IF_ERROR(ForEachUnitState(
      job, ForwardOrder(job), Access::kRead, [&](size_t k, const StateView& state) -> Status {
        const Unit& u = job.units[k];
        const UnitSpec& us = job.spec.units[k];
        Json tensors = Json::array();
        for (const TensorSpec& t : us.tensors)
          tensors.push_back({{"name", t.name}, {"shape", t.shape}});
        Json shards = Json::array();
        for (int r = 0; r < job.spec.ranks; ++r) {
          const uint64_t n = u.layout.shard;
          const uint64_t off = static_cast<uint64_t>(r) * n;
          std::string data(kHeader + 3 * n * sizeof(float), '\0');
          std::memcpy(data.data(), kMagic, 8);
          const uint32_t fields[4] = {kVersion, static_cast<uint32_t>(k), static_cast<uint32_t>(r),
                                      0};
          std::memcpy(data.data() + 8, fields, 16);
          std::memcpy(data.data() + 24, &n, 8);
          char* body = data.data() + kHeader;
          std::memcpy(body, state.master + off, n * 4);
          std::memcpy(body + n * 4, state.exp_avg + off, n * 4);
          std::memcpy(body + 2 * n * 4, state.exp_avg_sq + off, n * 4);
          const std::string name = StrCat("unit-", k, "-rank-", r, "-step-", step, ".bin");
          ZT_RETURN_IF_ERROR(WriteFileAtomically((fs::path(dir) / name).string(), data));
          keep.insert(name);
          shards.push_back({{"file", name},
                            {"rank", r},
                            {"elements", n},
                            {"bytes", data.size()},
                            {"crc32c", Crc32c(data.data(), data.size())}});
        }
        units.push_back({{"name", us.name},
                         {"numel", u.layout.numel},
                         {"padded", u.layout.padded},
                         {"tensors", tensors},
                         {"shards", shards}});
        return Status::Ok();
      }));
  Json manifest = {{"format", kFormat},
                   {"version", kVersion},
                   {"job", job.spec.name},
                   {"step", step},
                   {"adam_step", job.adam_step},
                   {"ranks", job.spec.ranks},
                   {"optimizer", OptimizerJson(job.spec.optimizer)},
                   {"units", units}};
  manifest["checksum"] = ManifestChecksum(manifest);
  ZT_RETURN_IF_ERROR(FsyncPath(dir, true));  // the shard files' names
  ZT_RETURN_IF_ERROR(
      WriteFileAtomically((fs::path(dir) / "manifest.json").string(), manifest.dump(1)));
  ZT_RETURN_IF_ERROR(FsyncPath(dir, true));
  // The new checkpoint is committed: drop files of older ones.
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("unit-") && keep.count(name) == 0) fs::remove(entry.path(), ec);
  }
  return Status::Ok();
}

Status LoadCheckpointImpl(Job& job, const std::string& dir, const PublishFn& publish) {
  const fs::path manifest_path = fs::path(dir) / "manifest.json";
  ZT_ASSIGN_OR_RETURN(std::string text, ReadFileToString(manifest_path.string()));
  auto bad = [&](std::string_view why) {
    return Status::Corruption(StrCat("checkpoint manifest ", manifest_path.string(), ": ", why));
  };
  Json m = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (m.is_discarded() || !m.is_object()) return bad("not valid JSON (truncated?)");
  try {
    if (m.value("format", "") != kFormat) return bad("not a ztier checkpoint");
    if (m.value("version", 0u) != kVersion) {
      return bad(
          StrCat("version ", m.value("version", 0u), " is not the supported version ", kVersion));
    }
    if (!m.contains("checksum") || m["checksum"].get<uint32_t>() != ManifestChecksum(m)) {
      return bad("checksum mismatch (the manifest was altered or damaged)");
    }
    const int ranks = m.at("ranks").get<int>();
    const Json& units = m.at("units");
    if (ranks < 1 || !units.is_array() || units.size() != job.units.size()) {
      return Status::InvalidArgument(StrCat("checkpoint ", dir, " has ", units.size(),
                                            " units; job '", job.spec.name, "' has ",
                                            job.units.size()));
    }
    // Check the whole layout before touching the job.
    for (size_t k = 0; k < job.units.size(); ++k) {
      const Json& cu = units[k];
      const UnitSpec& us = job.spec.units[k];
      if (cu.at("name").get<std::string>() != us.name ||
          cu.at("numel").get<uint64_t>() != job.units[k].layout.numel ||
          cu.at("tensors").size() != us.tensors.size()) {
        return Status::InvalidArgument(StrCat("checkpoint unit ", k, " ('",
                                              cu.at("name").get<std::string>(),
                                              "') does not match the job's unit '", us.name, "'"));
      }
      for (size_t t = 0; t < us.tensors.size(); ++t) {
        if (cu["tensors"][t].at("shape").get<std::vector<int64_t>>() != us.tensors[t].shape) {
          return Status::InvalidArgument(StrCat("checkpoint unit '", us.name, "' tensor '",
                                                us.tensors[t].name, "' has another shape"));
        }
      }
      if (cu.at("shards").size() != static_cast<size_t>(ranks)) return bad("shard list size");
    }
    // Reads unit k's shards into a flat buffer of the checkpoint's layout,
    // verifying sizes, checksums and headers; with `apply`, lays the state
    // out for this job's rank count. Run once over every unit without
    // applying, so a damaged file leaves the job untouched, then to apply.
    auto load_unit = [&](size_t k, const StateView* apply) -> Status {
      Unit& u = job.units[k];
      const Json& cu = units[k];
      const uint64_t old_padded = cu.at("padded").get<uint64_t>();
      if (old_padded < u.layout.numel || old_padded % ranks != 0) return bad("unit padding");
      std::vector<float> flat[3];
      if (apply) {
        for (auto& f : flat) f.assign(old_padded, 0.0f);
      }
      const uint64_t shard = old_padded / ranks;
      for (int r = 0; r < ranks; ++r) {
        const Json& s = cu["shards"][r];
        const std::string file = s.at("file").get<std::string>();
        if (file.find('/') != std::string::npos) return bad(StrCat("file name '", file, "'"));
        ZT_ASSIGN_OR_RETURN(std::string data, ReadFileToString((fs::path(dir) / file).string()));
        const std::string where = (fs::path(dir) / file).string();
        if (data.size() != s.at("bytes").get<uint64_t>() ||
            data.size() != kHeader + 3 * shard * 4) {
          return Status::Corruption(StrCat("checkpoint file ", where, " is ", data.size(),
                                           " bytes, expected ", kHeader + 3 * shard * 4,
                                           " (truncated?)"));
        }
        if (Crc32c(data.data(), data.size()) != s.at("crc32c").get<uint32_t>()) {
          return Status::Corruption(StrCat("checkpoint file ", where, ": checksum mismatch"));
        }
        uint32_t fields[4];
        uint64_t elements;
        std::memcpy(fields, data.data() + 8, 16);
        std::memcpy(&elements, data.data() + 24, 8);
        if (std::memcmp(data.data(), kMagic, 8) != 0 || fields[0] != kVersion || fields[1] != k ||
            fields[2] != static_cast<uint32_t>(r) || elements != shard) {
          return Status::Corruption(StrCat("checkpoint file ", where,
                                           ": header does not match the manifest (unit ", k,
                                           ", rank ", r, ")"));
        }
        if (!apply) continue;
        for (int a = 0; a < 3; ++a) {
          std::memcpy(flat[a].data() + r * shard, data.data() + kHeader + a * shard * 4, shard * 4);
        }
      }
      if (!apply) return Status::Ok();
      // Into this job's layout: the first numel elements, zero padding.
      for (auto [a, out] :
           {std::pair{0, apply->master}, {1, apply->exp_avg}, {2, apply->exp_avg_sq}}) {
        std::memcpy(out, flat[a].data(), u.layout.numel * 4);
        std::memset(out + u.layout.numel, 0, (u.layout.padded - u.layout.numel) * 4);
      }
      for (uint64_t i = 0; i < u.layout.padded; ++i) {
        apply->publish[i] = FloatToBf16(apply->master[i]);
      }
      return Status::Ok();
    };
    for (size_t k = 0; k < job.units.size(); ++k) ZT_RETURN_IF_ERROR(load_unit(k, nullptr));
    // load_unit sets every element of master, m, v and the params: the
    // state on the drives need not be read first.
    Status st =
        ForEachUnitState(job, ForwardOrder(job), Access::kOverwrite,
                         [&](size_t k, const StateView& state) { return load_unit(k, &state); });
    if (!st.ok()) {  // the files changed between the two passes, or an I/O error
      return st.Annotate("the job's state is now partly loaded; load a checkpoint again");
    }
    job.step = m.at("step").get<int64_t>();
    job.adam_step = m.at("adam_step").get<int64_t>();
  } catch (const Json::exception& e) {  // a field of the wrong type or missing
    return bad(e.what());
  }
  for (Unit& u : job.units) publish(u, job.step);
  return Status::Ok();
}

}  // namespace ztier::engine

// ---------------------------------------------------------------------------
// safetensors export / import

namespace ztier::engine {
namespace {

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

Status ExportSafetensorsImpl(Job& job, const std::string& path, bool bf16_out) {
  std::vector<StEntry> entries;
  const uint64_t esize = bf16_out ? 2 : 4;
  for (size_t k = 0; k < job.units.size(); ++k) {
    const UnitSpec& us = job.spec.units[k];
    for (size_t t = 0; t < us.tensors.size(); ++t) {
      const uint64_t begin = job.units[k].layout.offsets[t];
      const uint64_t end = t + 1 < us.tensors.size() ? job.units[k].layout.offsets[t + 1]
                                                     : job.units[k].layout.numel;
      entries.push_back({us.tensors[t].name, bf16_out ? "BF16" : "F32", us.tensors[t].shape,
                         (end - begin) * esize});
    }
  }
  std::string data = MakeSafetensorsHeader(entries);
  ZT_RETURN_IF_ERROR(ForEachUnitState(
      job, ForwardOrder(job), Access::kRead, [&](size_t k, const StateView& state) {
        const Unit& u = job.units[k];
        const float* master = state.master;
        if (bf16_out) {
          const size_t at = data.size();
          data.resize(at + u.layout.numel * 2);
          for (uint64_t i = 0; i < u.layout.numel; ++i) {
            const uint16_t b = FloatToBf16(master[i]).bits;
            std::memcpy(data.data() + at + i * 2, &b, 2);
          }
        } else {
          data.append(reinterpret_cast<const char*>(master), u.layout.numel * 4);
        }
        return Status::Ok();
      }));
  return WriteFileAtomically(path, data);
}

Status ImportSafetensorsImpl(Job& job, const std::string& path, const PublishFn& publish) {
  ZT_ASSIGN_OR_RETURN(std::string file, ReadFileToString(path));
  Result<StHeader> parsed = ParseSafetensorsHeader(file, file.size());
  if (!parsed.ok()) return parsed.status().Annotate(path);
  const StHeader& h = *parsed;
  // Check every tensor before touching the job.
  for (size_t k = 0; k < job.units.size(); ++k) {
    for (const TensorSpec& ts : job.spec.units[k].tensors) {
      auto it = h.tensors.find(ts.name);
      if (it == h.tensors.end()) {
        return Status::NotFound(
            StrCat(path, ": no tensor '", ts.name, "' (unit '", job.spec.units[k].name, "')"));
      }
      if (it->second.shape != ts.shape) {
        return Status::InvalidArgument(
            StrCat(path, ": tensor '", ts.name, "' has another shape than the registered one"));
      }
      if (it->second.dtype == StDtype::kOther) {
        return Status::InvalidArgument(StrCat(path, ": tensor '", ts.name, "' is ",
                                              it->second.dtype_name,
                                              "; ztier imports F32, BF16 and F16"));
      }
    }
  }
  return ForEachUnitState(
      job, ForwardOrder(job), Access::kUpdate, [&](size_t k, const StateView& state) {
        Unit& u = job.units[k];
        float* master = state.master;
        const std::vector<TensorSpec>& tensors = job.spec.units[k].tensors;
        for (size_t t = 0; t < tensors.size(); ++t) {
          const StTensor& st = h.tensors.at(tensors[t].name);
          const char* src = file.data() + h.data_start + st.begin;
          float* dst = master + u.layout.offsets[t];
          const uint64_t n = (st.end - st.begin) / (st.dtype == StDtype::kF32 ? 4 : 2);
          for (uint64_t i = 0; i < n; ++i) {
            if (st.dtype == StDtype::kF32) {
              std::memcpy(dst + i, src + i * 4, 4);
            } else {
              uint16_t b;
              std::memcpy(&b, src + i * 2, 2);
              dst[i] = st.dtype == StDtype::kBF16 ? Bf16ToFloat(bf16{b}) : HalfToFloat(b);
            }
          }
        }
        std::memset(master + u.layout.numel, 0, (u.layout.padded - u.layout.numel) * 4);
        bf16* out = state.publish;
        for (uint64_t i = 0; i < u.layout.padded; ++i) out[i] = FloatToBf16(master[i]);
        publish(u, job.step);
        return Status::Ok();
      });
}

}  // namespace ztier::engine
