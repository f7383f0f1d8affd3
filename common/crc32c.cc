// ztier common: CRC-32C implementations (see crc32c.h).
#include "common/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace ztier {
namespace {

constexpr uint32_t kPoly = 0x82f63b78u;  // reflected Castagnoli polynomial

struct Tables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  constexpr Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1u) ? kPoly : 0u);
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
    }
  }
};
constexpr Tables kTables;

uint32_t PortableRaw(const uint8_t* p, size_t n, uint32_t c) {
  const auto& t = kTables.t;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= c;
    c = t[7][w & 0xff] ^ t[6][(w >> 8) & 0xff] ^ t[5][(w >> 16) & 0xff] ^ t[4][(w >> 24) & 0xff] ^
        t[3][(w >> 32) & 0xff] ^ t[2][(w >> 40) & 0xff] ^ t[1][(w >> 48) & 0xff] ^ t[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xff];
  return c;
}

#if defined(__x86_64__)
// Shifting a CRC state over `len` zero bytes is linear in the state: a 32x32
// matrix over GF(2), applied here through four 256-entry tables per length.
// Used to combine three streams computed in parallel (the crc32 instruction
// has a latency of 3 cycles and a throughput of 1, so one stream would leave
// two thirds of the unit idle).
struct ShiftTable {
  std::array<std::array<uint32_t, 256>, 4> t{};
};

uint32_t ShiftZeros(uint32_t c, size_t len) {
  // Bitwise reference for building the tables (runs once per length).
  for (size_t i = 0; i < len; ++i) {
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1u) ? kPoly : 0u);
  }
  return c;
}

ShiftTable MakeShiftTable(size_t len) {
  ShiftTable s;
  // Columns: the image of each single-bit state, then tables per byte lane.
  uint32_t col[32];
  for (int b = 0; b < 32; ++b) col[b] = ShiftZeros(1u << b, len);
  for (int lane = 0; lane < 4; ++lane) {
    for (uint32_t v = 0; v < 256; ++v) {
      uint32_t r = 0;
      for (int b = 0; b < 8; ++b) {
        if (v & (1u << b)) r ^= col[lane * 8 + b];
      }
      s.t[lane][v] = r;
    }
  }
  return s;
}

inline uint32_t Apply(const ShiftTable& s, uint32_t c) {
  return s.t[0][c & 0xff] ^ s.t[1][(c >> 8) & 0xff] ^ s.t[2][(c >> 16) & 0xff] ^ s.t[3][c >> 24];
}

constexpr size_t kBlock = 4096;  // bytes per stream per round

const ShiftTable& Shift1() {
  static const ShiftTable t = MakeShiftTable(kBlock);
  return t;
}
const ShiftTable& Shift2() {
  static const ShiftTable t = MakeShiftTable(2 * kBlock);
  return t;
}

__attribute__((target("sse4.2"))) uint32_t HardwareRaw(const uint8_t* p, size_t n, uint32_t c) {
  const ShiftTable& s1 = Shift1();
  const ShiftTable& s2 = Shift2();
  while (n >= 3 * kBlock) {
    uint64_t c0 = c, c1 = 0, c2 = 0;
    const uint8_t* a = p;
    const uint8_t* b = p + kBlock;
    const uint8_t* d = p + 2 * kBlock;
    for (size_t i = 0; i < kBlock; i += 8) {
      uint64_t wa, wb, wd;
      std::memcpy(&wa, a + i, 8);
      std::memcpy(&wb, b + i, 8);
      std::memcpy(&wd, d + i, 8);
      c0 = _mm_crc32_u64(c0, wa);
      c1 = _mm_crc32_u64(c1, wb);
      c2 = _mm_crc32_u64(c2, wd);
    }
    // crc(A|B|D) = shift(crc(A), 2 blocks) ^ shift(crc(B), 1 block) ^ crc(D)
    // for raw (uninverted) states started at 0 for B and D.
    c = Apply(s2, static_cast<uint32_t>(c0)) ^ Apply(s1, static_cast<uint32_t>(c1)) ^
        static_cast<uint32_t>(c2);
    p += 3 * kBlock;
    n -= 3 * kBlock;
  }
  uint64_t c64 = c;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c64 = _mm_crc32_u64(c64, w);
    p += 8;
    n -= 8;
  }
  c = static_cast<uint32_t>(c64);
  while (n-- > 0) c = _mm_crc32_u8(c, *p++);
  return c;
}

bool HaveSse42() {
  static const bool have = __builtin_cpu_supports("sse4.2");
  return have;
}
#endif

}  // namespace

uint32_t Crc32cPortable(const void* data, size_t n, uint32_t crc) {
  return ~PortableRaw(static_cast<const uint8_t*>(data), n, ~crc);
}

uint32_t Crc32c(const void* data, size_t n, uint32_t crc) {
#if defined(__x86_64__)
  if (HaveSse42()) return ~HardwareRaw(static_cast<const uint8_t*>(data), n, ~crc);
#endif
  return Crc32cPortable(data, n, crc);
}

}  // namespace ztier
