// ztier nvme: swap manifest codec (see swap_manifest.h).
#include "nvme/swap_manifest.h"

#include <cstring>
#include <set>
#include <unordered_set>

#include "common/crc32c.h"
#include "common/extent_allocator.h"

namespace ztier::nvme {
namespace {

constexpr char kMagic[8] = {'Z', 'T', 'S', 'W', 'A', 'P', 'M', 'F'};
constexpr size_t kHeaderBytes = 64;
constexpr size_t kUnitBytes = 8 + 4 + 1;
constexpr uint64_t kBlock = 4096;
constexpr uint32_t kMaxPaths = 4096;
constexpr uint32_t kMaxString = 4096;
constexpr uint32_t kMaxName = 1 << 16;

class Writer {
 public:
  template <class T>
  void Put(T v) {
    buf_.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  void PutString(std::string_view s) {
    Put<uint32_t>(static_cast<uint32_t>(s.size()));
    buf_.append(s);
  }
  std::string& str() { return buf_; }

 private:
  std::string buf_;
};

class Reader {
 public:
  explicit Reader(std::string_view b) : p_(b.data()), n_(b.size()) {}
  template <class T>
  bool Get(T* v) {
    if (n_ < sizeof(T)) return false;
    std::memcpy(v, p_, sizeof(T));
    p_ += sizeof(T);
    n_ -= sizeof(T);
    return true;
  }
  bool GetString(std::string* s, size_t max) {
    uint32_t len;
    if (!Get(&len) || len > max || len > n_) return false;
    s->assign(p_, len);
    p_ += len;
    n_ -= len;
    return true;
  }
  size_t left() const { return n_; }

 private:
  const char* p_;
  size_t n_;
};

bool PlainName(std::string_view s) {
  return !s.empty() && s != "." && s != ".." && s.find('/') == std::string_view::npos &&
         s.find('\0') == std::string_view::npos;
}

}  // namespace

std::string EncodeSwapManifest(const SwapManifest& m) {
  Writer payload;
  payload.Put<uint64_t>(m.stripe_bytes);
  payload.Put<uint64_t>(m.file_bytes);
  payload.Put<uint64_t>(m.cap_bytes);
  payload.Put<uint8_t>(m.checksums ? 1 : 0);
  payload.PutString(m.file_name);
  payload.Put<uint32_t>(static_cast<uint32_t>(m.paths.size()));
  for (const std::string& p : m.paths) payload.PutString(p);
  payload.Put<uint64_t>(m.next_id);
  payload.Put<uint32_t>(m.next_start_path);
  payload.Put<uint64_t>(m.objects.size());
  for (const ManifestObject& o : m.objects) {
    payload.Put<uint64_t>(o.id);
    payload.PutString(o.name);
    payload.Put<uint64_t>(o.size);
    payload.Put<uint32_t>(o.start_path);
    for (const ManifestUnit& u : o.units) {
      payload.Put<uint64_t>(u.file_offset);
      payload.Put<uint32_t>(u.crc);
      payload.Put<uint8_t>(u.state);
    }
  }
  std::string header(kHeaderBytes, '\0');
  std::memcpy(header.data(), kMagic, 8);
  const uint32_t version = kSwapManifestVersion;
  const uint64_t size = payload.str().size();
  const uint32_t payload_crc = Crc32c(payload.str().data(), size);
  std::memcpy(header.data() + 8, &version, 4);
  std::memcpy(header.data() + 16, &size, 8);
  std::memcpy(header.data() + 24, &payload_crc, 4);
  const uint32_t header_crc = Crc32c(header.data(), kHeaderBytes - 4);
  std::memcpy(header.data() + kHeaderBytes - 4, &header_crc, 4);
  return header + payload.str();
}

Result<SwapManifest> DecodeSwapManifest(std::string_view data, std::string_view origin) {
  auto bad = [&](std::string_view why) {
    return Status::Corruption(StrCat("swap manifest ", origin, ": ", why));
  };
  if (data.size() < kHeaderBytes) return bad(StrCat("truncated (", data.size(), " bytes)"));
  if (std::memcmp(data.data(), kMagic, 8) != 0) return bad("not a ztier swap manifest (bad magic)");
  uint32_t header_crc, version, payload_crc;
  uint64_t size;
  std::memcpy(&header_crc, data.data() + kHeaderBytes - 4, 4);
  if (Crc32c(data.data(), kHeaderBytes - 4) != header_crc) return bad("header checksum mismatch");
  std::memcpy(&version, data.data() + 8, 4);
  std::memcpy(&size, data.data() + 16, 8);
  std::memcpy(&payload_crc, data.data() + 24, 4);
  for (size_t i : {12, 13, 14, 15}) {
    if (data[i] != 0) return bad("reserved header bytes are not zero");
  }
  for (size_t i = 28; i < kHeaderBytes - 4; ++i) {
    if (data[i] != 0) return bad("reserved header bytes are not zero");
  }
  if (version != kSwapManifestVersion) {
    return bad(StrCat("version ", version, " is not the supported version ", kSwapManifestVersion));
  }
  if (data.size() - kHeaderBytes != size) {
    return bad(StrCat("payload is ", data.size() - kHeaderBytes, " bytes, header says ", size));
  }
  if (Crc32c(data.data() + kHeaderBytes, size) != payload_crc) {
    return bad("payload checksum mismatch");
  }

  Reader r(data.substr(kHeaderBytes));
  SwapManifest m;
  uint8_t checksums = 0;
  uint32_t npaths = 0;
  if (!r.Get(&m.stripe_bytes) || !r.Get(&m.file_bytes) || !r.Get(&m.cap_bytes) ||
      !r.Get(&checksums) || !r.GetString(&m.file_name, kMaxString) || !r.Get(&npaths)) {
    return bad("malformed options");
  }
  m.checksums = checksums != 0;
  if (checksums > 1) return bad("checksums flag is neither 0 nor 1");
  if (m.stripe_bytes < kBlock || m.stripe_bytes % kBlock != 0 || m.stripe_bytes > (1u << 30)) {
    return bad(StrCat("stripe size ", m.stripe_bytes, " is not a multiple of 4096 in 4K..1G"));
  }
  if (m.file_bytes % m.stripe_bytes != 0 || m.cap_bytes % m.stripe_bytes != 0) {
    return bad("file size or cap is not a multiple of the stripe size");
  }
  if (m.cap_bytes != 0 && m.file_bytes > m.cap_bytes) {
    return bad(StrCat("files of ", m.file_bytes, " bytes exceed the cap of ", m.cap_bytes));
  }
  if (!PlainName(m.file_name))
    return bad(StrCat("swap file name '", m.file_name, "' is not plain"));
  if (npaths == 0 || npaths > kMaxPaths) return bad(StrCat(npaths, " paths"));
  std::set<std::string> seen_paths;
  for (uint32_t i = 0; i < npaths; ++i) {
    std::string p;
    if (!r.GetString(&p, kMaxString) || p.empty() || p.find('\0') != std::string::npos) {
      return bad("malformed path list");
    }
    if (!seen_paths.insert(p).second) return bad(StrCat("path ", p, " is listed twice"));
    m.paths.push_back(std::move(p));
  }
  uint64_t nobjects = 0;
  if (!r.Get(&m.next_id) || !r.Get(&m.next_start_path) || !r.Get(&nobjects) ||
      m.next_start_path >= npaths || m.next_id == 0) {
    return bad("malformed object table");
  }
  // Every object takes at least 8 + 4 + 8 + 4 + one unit's bytes.
  if (nobjects > r.left() / (24 + kUnitBytes)) return bad("object count exceeds the manifest");
  const uint64_t file_units = m.file_bytes / m.stripe_bytes;
  std::vector<ExtentAllocator> used(npaths, ExtentAllocator(file_units));
  std::unordered_set<uint64_t> ids;
  std::unordered_set<std::string> names;
  m.objects.reserve(nobjects);
  for (uint64_t i = 0; i < nobjects; ++i) {
    ManifestObject obj;
    if (!r.Get(&obj.id) || !r.GetString(&obj.name, kMaxName) || !r.Get(&obj.size) ||
        !r.Get(&obj.start_path)) {
      return bad(StrCat("object entry ", i, " is truncated"));
    }
    if (obj.start_path >= npaths || obj.size == 0 || obj.id == 0 || obj.id >= m.next_id ||
        obj.name.empty()) {
      return bad(StrCat("object entry ", i, " ('", obj.name, "') has an invalid id, size or path"));
    }
    if (!ids.insert(obj.id).second || !names.insert(obj.name).second) {
      return bad(StrCat("object '", obj.name, "' (id ", obj.id, ") appears twice"));
    }
    const uint64_t units = obj.size / m.stripe_bytes + (obj.size % m.stripe_bytes != 0 ? 1 : 0);
    if (units > r.left() / kUnitBytes) {
      return bad(StrCat("object '", obj.name, "' claims more units than the manifest holds"));
    }
    obj.units.resize(units);
    for (uint64_t u = 0; u < units; ++u) {
      ManifestUnit& unit = obj.units[u];
      r.Get(&unit.file_offset);
      r.Get(&unit.crc);
      r.Get(&unit.state);
      const uint32_t path = static_cast<uint32_t>((obj.start_path + u) % npaths);
      if (unit.state > 2 || unit.file_offset % m.stripe_bytes != 0 ||
          unit.file_offset >= m.file_bytes) {
        return bad(StrCat("object '", obj.name, "' unit ", u, " lies outside its swap file"));
      }
      if (!used[path].Reserve(unit.file_offset / m.stripe_bytes, 1)) {
        return bad(StrCat("object '", obj.name, "' unit ", u, " overlaps another unit on path ",
                          m.paths[path]));
      }
    }
    m.objects.push_back(std::move(obj));
  }
  if (r.left() != 0) return bad("trailing bytes after the object table");
  return m;
}

}  // namespace ztier::nvme
