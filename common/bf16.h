// ztier common: the bfloat16 storage type and its scalar conversions.
//
// bf16 is the upper half of an IEEE fp32. Converting fp32 -> bf16 rounds to
// nearest, ties to even, and keeps a NaN a (quiet) NaN with its sign: the same
// rule as PyTorch's c10::BFloat16 (round_to_nearest_even). Subnormals are kept
// (no flush to zero); values that round past the largest finite bf16 become
// +/-Inf, as IEEE rounding requires.
//
// These scalar helpers are the reference that the SIMD kernels in cpu_adam/
// must match bit for bit. Header-only, pure functions: thread-safe.
#ifndef ZTIER_COMMON_BF16_H_
#define ZTIER_COMMON_BF16_H_

#include <bit>
#include <cstdint>

namespace ztier {

// Storage-only bfloat16: 16 raw bits, trivially copyable, same layout as
// PyTorch's torch.bfloat16 and CUDA's __nv_bfloat16.
struct bf16 {
  uint16_t bits;
  friend constexpr bool operator==(bf16 a, bf16 b) { return a.bits == b.bits; }
};
static_assert(sizeof(bf16) == 2 && alignof(bf16) == 2);

constexpr float Bf16ToFloat(bf16 h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h.bits) << 16);
}

constexpr bf16 FloatToBf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep sign and top payload, force quiet.
    return bf16{static_cast<uint16_t>((u >> 16) | 0x0040u)};
  }
  const uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>((u + rounding_bias) >> 16)};
}

// Whether `f` is finite in bf16 too: NaN, the infinities and the fp32
// values past 3.3961775e38 (which round to +/-Inf) are not. A weight that
// is not would be published to the forward pass as Inf or NaN.
constexpr bool FiniteInBf16(float f) {
  return (std::bit_cast<uint32_t>(Bf16ToFloat(FloatToBf16(f))) & 0x7f800000u) != 0x7f800000u;
}

}  // namespace ztier

#endif  // ZTIER_COMMON_BF16_H_
