// ztier-bench: per-target same-pattern memory kernels (see memory_pattern.h).
#include "benchmarks/memory_pattern.h"

#include <algorithm>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "benchmarks/memory_pattern.cc"
#include "hwy/cache_control.h"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace ztier::bench {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if HWY_TARGET != HWY_SCALAR && HWY_MAX_BYTES >= 32
constexpr bool kCanStream = true;
#else
constexpr bool kCanStream = false;
#endif

template <class D>
HWY_INLINE auto LoadGrad(D d, const float* p) {
  return hn::LoadU(d, p);
}
template <class D>
HWY_INLINE auto LoadGrad(D d, const uint16_t* p) {
  const hn::Rebind<uint16_t, D> d16;
  const hn::RebindToUnsigned<D> du;
  return hn::BitCast(d, hn::ShiftLeft<16>(hn::PromoteTo(du, hn::LoadU(d16, p))));
}

// One element of the pattern in plain C++ (heads and tails).
template <class G>
HWY_INLINE void ScalarStep(const AdamPatternArgs& a, const G* g, size_t i) {
  float x;
  if constexpr (sizeof(G) == 2) {
    const uint32_t bits = static_cast<uint32_t>(g[i]) << 16;
    __builtin_memcpy(&x, &bits, 4);
  } else {
    x = g[i];
  }
  a.params[i] += x;
  a.exp_avg[i] += x;
  a.exp_avg_sq[i] += x * x;  // stays >= 0: the AdamW runs after it read a valid v
  if (a.out != nullptr) {
    uint32_t bits;
    __builtin_memcpy(&bits, &a.params[i], 4);
    a.out[i] = static_cast<uint16_t>(bits >> 16);
  }
}

constexpr size_t kPrefetchElements = 1024;

template <bool kStream, bool kOut, class G>
void RangeT(const AdamPatternArgs& a, const G* HWY_RESTRICT g, size_t begin, size_t end) {
  const hn::ScalableTag<float> d;
  const hn::Rebind<uint16_t, decltype(d)> d16;
  const hn::RebindToUnsigned<decltype(d)> du;
  const hn::RebindToSigned<decltype(d)> di;
  const size_t lanes = hn::Lanes(d);
  float* HWY_RESTRICT p = a.params;
  float* HWY_RESTRICT m = a.exp_avg;
  float* HWY_RESTRICT v = a.exp_avg_sq;
  uint16_t* HWY_RESTRICT out = a.out;
  size_t i = begin;
  if constexpr (kStream) {
    while (i < end && reinterpret_cast<uintptr_t>(out + i) % (lanes * 2) != 0)
      ScalarStep(a, g, i++);
  }
  for (; i + lanes <= end; i += lanes) {
    // The same software prefetch as the AdamW kernel, so that the limit is
    // the best this pattern achieves, not a handicapped copy.
    hwy::Prefetch(g + i + kPrefetchElements);
    hwy::Prefetch(p + i + kPrefetchElements);
    hwy::Prefetch(m + i + kPrefetchElements);
    hwy::Prefetch(v + i + kPrefetchElements);
    const auto x = LoadGrad(d, g + i);
    const auto np = hn::Add(hn::LoadU(d, p + i), x);
    hn::StoreU(hn::Add(hn::LoadU(d, m + i), x), d, m + i);
    hn::StoreU(hn::MulAdd(x, x, hn::LoadU(d, v + i)), d, v + i);
    hn::StoreU(np, d, p + i);
    if constexpr (kOut) {
      // Truncating bf16: the same store traffic as the real conversion.
      const auto bits = hn::DemoteTo(d16, hn::BitCast(di, hn::ShiftRight<16>(hn::BitCast(du, np))));
      if constexpr (kStream) {
        hn::Stream(bits, d16, out + i);
      } else {
        hn::StoreU(bits, d16, out + i);
      }
    }
  }
  for (; i < end; ++i) ScalarStep(a, g, i);
  if constexpr (kStream) hwy::FlushStream();
}

template <class G>
void RangeG(const AdamPatternArgs& a, const G* g, size_t begin, size_t end) {
  if (a.out == nullptr) return RangeT<false, false>(a, g, begin, end);
  if (a.stream_out && kCanStream) return RangeT<kCanStream, true>(a, g, begin, end);
  return RangeT<false, true>(a, g, begin, end);
}

void AdamPatternRangeImpl(const AdamPatternArgs& a, size_t begin, size_t end) {
  if (a.grads_bf16) {
    RangeG(a, static_cast<const uint16_t*>(a.grads), begin, end);
  } else {
    RangeG(a, static_cast<const float*>(a.grads), begin, end);
  }
}

// Block by block, as the 8-bit kernel goes: the float streams, then the
// block's codes in byte vectors, then its two absmax.
template <class G>
void Int8RangeT(const Int8PatternArgs& a, const G* HWY_RESTRICT g, size_t begin, size_t end) {
  const hn::ScalableTag<float> d;
  const hn::CappedTag<float, 1> d1;
  const hn::ScalableTag<uint8_t> d8;
  const hn::CappedTag<uint8_t, 1> d8_1;
  const hn::RebindToUnsigned<decltype(d)> du;
  const hn::RebindToSigned<decltype(d)> di;
  const hn::RebindToUnsigned<decltype(d1)> du1;
  const hn::RebindToSigned<decltype(d1)> di1;
  const hn::Rebind<uint16_t, decltype(d)> d16;
  const hn::Rebind<uint16_t, decltype(d1)> d16_1;
  float* HWY_RESTRICT p = a.params;
  uint16_t* HWY_RESTRICT out = a.out;
  const auto floats = [&](auto dd, auto ddu, auto ddi, auto dd16, size_t i) HWY_ATTR {
    const auto np = hn::Add(hn::LoadU(dd, p + i), LoadGrad(dd, g + i));
    hn::StoreU(np, dd, p + i);
    if (out != nullptr) {
      hn::StoreU(hn::DemoteTo(dd16, hn::BitCast(ddi, hn::ShiftRight<16>(hn::BitCast(ddu, np)))),
                 dd16, out + i);
    }
  };
  const auto codes = [&](auto dd8, uint8_t* HWY_RESTRICT c, size_t i) HWY_ATTR {
    hn::StoreU(hn::Add(hn::LoadU(dd8, c + i), hn::Set(dd8, uint8_t{1})), dd8, c + i);
  };
  for (size_t s = begin; s < end; s += 256) {
    const size_t e = std::min(end, s + 256);
    size_t i = s;
    for (; i + hn::Lanes(d) <= e; i += hn::Lanes(d)) floats(d, du, di, d16, i);
    for (; i < e; ++i) floats(d1, du1, di1, d16_1, i);
    for (uint8_t* c : {a.m, a.v}) {
      i = s;
      for (; i + hn::Lanes(d8) <= e; i += hn::Lanes(d8)) codes(d8, c, i);
      for (; i < e; ++i) codes(d8_1, c, i);
    }
    a.m_absmax[s / 256] += 1.0f;
    a.v_absmax[s / 256] += 1.0f;
  }
}

void Int8PatternRangeImpl(const Int8PatternArgs& a, size_t begin, size_t end) {
  if (a.grads_bf16) {
    Int8RangeT(a, static_cast<const uint16_t*>(a.grads), begin, end);
  } else {
    Int8RangeT(a, static_cast<const float*>(a.grads), begin, end);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace ztier::bench
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ztier::bench {
HWY_EXPORT(AdamPatternRangeImpl);
void AdamPatternRange(const AdamPatternArgs& args, size_t begin, size_t end) {
  HWY_DYNAMIC_DISPATCH(AdamPatternRangeImpl)(args, begin, end);
}
HWY_EXPORT(Int8PatternRangeImpl);
void Int8PatternRange(const Int8PatternArgs& args, size_t begin, size_t end) {
  HWY_DYNAMIC_DISPATCH(Int8PatternRangeImpl)(args, begin, end);
}
}  // namespace ztier::bench
#endif
