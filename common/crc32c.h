// ztier common: CRC-32C (Castagnoli), the checksum of swap stripe units,
// manifests and checkpoint files.
//
// Uses the SSE4.2 crc32 instruction (three interleaved streams, combined with
// carry-less-multiply-free shift tables) when the CPU has it, and a
// slicing-by-8 table otherwise. Pure functions: thread-safe.
#ifndef ZTIER_COMMON_CRC32C_H_
#define ZTIER_COMMON_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace ztier {

// CRC-32C of data, continuing from `crc` (0 to start). Crc32c("123456789")
// is 0xe3069283.
uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0);

// The portable table implementation, exposed so tests can hold the hardware
// path to it.
uint32_t Crc32cPortable(const void* data, size_t n, uint32_t crc = 0);

}  // namespace ztier

#endif  // ZTIER_COMMON_CRC32C_H_
