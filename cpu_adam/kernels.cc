// ztier cpu_adam: per-target AdamW and sum-of-squares kernels (Highway).
//
// This file is compiled once per SIMD target through hwy/foreach_target.h;
// HWY_EXPORT builds the dispatch tables and the functions at the bottom call
// the best target the CPU supports (or the one a test forces).
//
// Each kernel walks a range in full vectors; the elements before the first
// aligned bf16 output slot (streaming stores need alignment) and after the
// last full vector go through the same code on a one-lane vector, so every
// element sees the same sequence of IEEE operations and the result does not
// depend on where a range starts.
#include <cmath>
#include <cstdint>

#include "cpu_adam/kernels.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu_adam/kernels.cc"
#include "hwy/cache_control.h"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace ztier::cpu_adam::internal {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

template <class D>
HWY_INLINE auto LoadGrad(D d, const float* HWY_RESTRICT g) {
  return hn::LoadU(d, g);
}

// bf16 -> fp32 is exact: the bf16 bits become the upper half of the fp32.
template <class D>
HWY_INLINE auto LoadGrad(D d, const uint16_t* HWY_RESTRICT g) {
  const hn::Rebind<uint16_t, D> d16;
  const hn::RebindToUnsigned<D> du;
  return hn::BitCast(d, hn::ShiftLeft<16>(hn::PromoteTo(du, hn::LoadU(d16, g))));
}

// fp32 -> bf16, round to nearest even, NaN stays a quiet NaN with its sign.
// Same rule as FloatToBf16() in common/bf16.h (and PyTorch). Highway's own
// DemoteTo(bf16) truncates, so it is not used.
template <class D, class V>
HWY_INLINE auto ToBf16Bits(D /*d*/, V x) {
  const hn::RebindToUnsigned<D> du;
  const hn::RebindToSigned<D> di;
  const hn::Rebind<uint16_t, D> d16;
  const auto u = hn::BitCast(du, x);
  const auto lsb = hn::And(hn::ShiftRight<16>(u), hn::Set(du, 1u));
  const auto rounded = hn::ShiftRight<16>(hn::Add(u, hn::Add(lsb, hn::Set(du, 0x7fffu))));
  const auto quiet_nan = hn::Or(hn::ShiftRight<16>(u), hn::Set(du, 0x0040u));
  const auto bits = hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(x)), quiet_nan, rounded);
  // Every lane is <= 0xffff, so the saturating i32 -> u16 demotion is exact.
  return hn::DemoteTo(d16, hn::BitCast(di, bits));
}

// Accumulates x*x in fp64. A full vector is promoted in two halves into two
// fp64 accumulators (lo, hi); one-lane vectors (and the scalar target) add
// into a plain double. Free functions, not a struct with vector members: the
// implicit constructor of such a struct would not carry the target attributes.
#if HWY_TARGET == HWY_SCALAR
template <class D>
using SqVec = double;
template <class D>
HWY_INLINE SqVec<D> SqZero(D /*d*/) {
  return 0.0;
}
template <class D, class V>
HWY_INLINE void SqAdd(D /*d*/, V x, SqVec<D>& lo, SqVec<D>& /*hi*/) {
  const double v = static_cast<double>(hn::GetLane(x));
  lo += v * v;
}
template <class D>
HWY_INLINE double SqTotal(D /*d*/, SqVec<D> lo, SqVec<D> hi) {
  return lo + hi;
}
#else
template <class D>
using SqVec = decltype(hn::Zero(hn::Repartition<double, D>()));
template <class D>
HWY_INLINE SqVec<D> SqZero(D /*d*/) {
  return hn::Zero(hn::Repartition<double, D>());
}
template <class D, class V>
HWY_INLINE void SqAdd(D /*d*/, V x, SqVec<D>& lo, SqVec<D>& hi) {
  const hn::Repartition<double, D> dd;
  const hn::Half<D> dh;
  const auto xl = hn::PromoteTo(dd, hn::LowerHalf(dh, x));
  const auto xh = hn::PromoteTo(dd, hn::UpperHalf(dh, x));
  lo = hn::MulAdd(xl, xl, lo);
  hi = hn::MulAdd(xh, xh, hi);
}
template <class D>
HWY_INLINE double SqTotal(D /*d*/, SqVec<D> lo, SqVec<D> hi) {
  const hn::Repartition<double, D> dd;
  return hn::GetLane(hn::SumOfLanes(dd, hn::Add(lo, hi)));
}
#endif

template <class V>
HWY_INLINE void SqAddOneLane(V x, double& sum) {
  const double v = static_cast<double>(hn::GetLane(x));
  sum += v * v;
}

// Software prefetch distance. The update does enough arithmetic per element
// that the out-of-order window alone keeps too few cache misses in flight;
// prefetching each stream this far ahead lets it run at the memory limit.
constexpr size_t kPrefetchElements = 1024;

// The AdamW / Adam update of Lanes(d) elements at index i. Returns the raw
// (unscaled) grads for the caller's norm and finiteness bookkeeping.
template <Mode kMode, OutKind kOut, class D, class G>
HWY_INLINE auto UpdateLanes(D d, const KernelConsts& c, const G* HWY_RESTRICT g,
                            float* HWY_RESTRICT p, float* HWY_RESTRICT m, float* HWY_RESTRICT v,
                            uint16_t* HWY_RESTRICT out, size_t i) {
  const auto g_raw = LoadGrad(d, g + i);
  auto grad = hn::Mul(g_raw, hn::Set(d, c.grad_scale));
  auto param = hn::LoadU(d, p + i);
  if constexpr (kMode == Mode::kAdam) {
    grad = hn::MulAdd(hn::Set(d, c.l2), param, grad);
  }
  const auto exp_avg = hn::MulAdd(hn::Set(d, c.beta1), hn::LoadU(d, m + i),
                                  hn::Mul(hn::Set(d, c.one_minus_beta1), grad));
  const auto exp_avg_sq = hn::MulAdd(hn::Set(d, c.beta2), hn::LoadU(d, v + i),
                                     hn::Mul(hn::Mul(hn::Set(d, c.one_minus_beta2), grad), grad));
  const auto denom =
      hn::MulAdd(hn::Sqrt(exp_avg_sq), hn::Set(d, c.inv_sqrt_bc2), hn::Set(d, c.eps));
  if constexpr (kMode == Mode::kAdamW) {
    param = hn::Mul(param, hn::Set(d, c.decay));
  }
  param = hn::NegMulAdd(hn::Set(d, c.step_size), hn::Div(exp_avg, denom), param);
  hn::StoreU(exp_avg, d, m + i);
  hn::StoreU(exp_avg_sq, d, v + i);
  hn::StoreU(param, d, p + i);
  if constexpr (kOut != OutKind::kNone) {
    const hn::Rebind<uint16_t, D> d16;
    const auto bits = ToBf16Bits(d, param);
    if constexpr (kOut == OutKind::kStreaming) {
      if (hn::Lanes(d) > 1) {
        hn::Stream(bits, d16, out + i);  // aligned: see the head loop in UpdateRangeT
      } else {
        hn::StoreU(bits, d16, out + i);
      }
    } else {
      hn::StoreU(bits, d16, out + i);
    }
  }
  return g_raw;
}

template <Mode kMode, OutKind kOut, bool kSumSq, class G>
RangeResult UpdateRangeT(const UpdateArgs& a, size_t begin, size_t end) {
  const hn::ScalableTag<float> d;
  const hn::CappedTag<float, 1> d1;
  const size_t lanes = hn::Lanes(d);
  const G* HWY_RESTRICT g = static_cast<const G*>(a.grads);
  float* HWY_RESTRICT p = a.params;
  float* HWY_RESTRICT m = a.exp_avg;
  float* HWY_RESTRICT v = a.exp_avg_sq;
  uint16_t* HWY_RESTRICT out = a.out;

  auto sq_lo = SqZero(d);
  auto sq_hi = SqZero(d);
  double sq1 = 0.0;
  auto nf = hn::Zero(d);  // x - x: 0 for finite x, NaN for inf/NaN
  float nf1 = 0.0f;

  const auto one_lane = [&](size_t i) HWY_ATTR {
    const auto g_raw = UpdateLanes<kMode, kOut>(d1, a.c, g, p, m, v, out, i);
    if constexpr (kSumSq) {
      SqAddOneLane(g_raw, sq1);
    } else {
      nf1 += hn::GetLane(hn::Sub(g_raw, g_raw));
    }
  };

  size_t i = begin;
  if constexpr (kOut == OutKind::kStreaming) {
    const size_t align = lanes * sizeof(uint16_t);
    while (i < end && reinterpret_cast<uintptr_t>(out + i) % align != 0) one_lane(i++);
  }
  for (; i + lanes <= end; i += lanes) {
    hwy::Prefetch(g + i + kPrefetchElements);
    hwy::Prefetch(p + i + kPrefetchElements);
    hwy::Prefetch(m + i + kPrefetchElements);
    hwy::Prefetch(v + i + kPrefetchElements);
    const auto g_raw = UpdateLanes<kMode, kOut>(d, a.c, g, p, m, v, out, i);
    if constexpr (kSumSq) {
      SqAdd(d, g_raw, sq_lo, sq_hi);
    } else {
      nf = hn::Add(nf, hn::Sub(g_raw, g_raw));
    }
  }
  for (; i < end; ++i) one_lane(i);
  if constexpr (kOut == OutKind::kStreaming) {
    // Order this thread's non-temporal stores before the range is reported
    // done (the caller publishes the buffer after joining the workers).
    hwy::FlushStream();
  }

  RangeResult r{0.0, false};
  if constexpr (kSumSq) {
    r.sq_sum = SqTotal(d, sq_lo, sq_hi) + sq1;
    r.non_finite = !std::isfinite(r.sq_sum);
  } else {
    const float s = hn::GetLane(hn::SumOfLanes(d, nf)) + nf1;
    r.non_finite = std::isnan(s);
  }
  return r;
}

template <Mode kMode, OutKind kOut, bool kSumSq>
RangeResult UpdateRangeG(const UpdateArgs& a, size_t begin, size_t end) {
  return a.grad_type == GradType::kBFloat16
             ? UpdateRangeT<kMode, kOut, kSumSq, uint16_t>(a, begin, end)
             : UpdateRangeT<kMode, kOut, kSumSq, float>(a, begin, end);
}

template <Mode kMode, OutKind kOut>
RangeResult UpdateRangeS(const UpdateArgs& a, size_t begin, size_t end) {
  return a.sum_sq ? UpdateRangeG<kMode, kOut, true>(a, begin, end)
                  : UpdateRangeG<kMode, kOut, false>(a, begin, end);
}

// The bf16 copy of one fp32 vector is half a vector. Streaming it is a full
// 128-bit or wider store only on AVX2 and up; on 128-bit targets a partial
// vector stream would write past the slot, so those use regular stores.
#if HWY_TARGET != HWY_SCALAR && HWY_MAX_BYTES >= 32
constexpr bool kCanStream = true;
#else
constexpr bool kCanStream = false;
#endif

template <Mode kMode>
RangeResult UpdateRangeO(const UpdateArgs& a, size_t begin, size_t end) {
  const OutKind kind =
      a.out_kind == OutKind::kStreaming && !kCanStream ? OutKind::kRegular : a.out_kind;
  switch (kind) {
    case OutKind::kNone:
      return UpdateRangeS<kMode, OutKind::kNone>(a, begin, end);
    case OutKind::kRegular:
      return UpdateRangeS<kMode, OutKind::kRegular>(a, begin, end);
    case OutKind::kStreaming:
      return UpdateRangeS<kMode, OutKind::kStreaming>(a, begin, end);
  }
  return {0.0, false};
}

RangeResult UpdateRangeImpl(const UpdateArgs& a, size_t begin, size_t end) {
  return a.mode == Mode::kAdam ? UpdateRangeO<Mode::kAdam>(a, begin, end)
                               : UpdateRangeO<Mode::kAdamW>(a, begin, end);
}

template <class G>
double SquareSumRangeT(const G* HWY_RESTRICT g, size_t begin, size_t end) {
  const hn::ScalableTag<float> d;
  const hn::CappedTag<float, 1> d1;
  const size_t lanes = hn::Lanes(d);
  auto sq_lo = SqZero(d);
  auto sq_hi = SqZero(d);
  double sq1 = 0.0;
  size_t i = begin;
  for (; i + lanes <= end; i += lanes) {
    hwy::Prefetch(g + i + kPrefetchElements);
    SqAdd(d, LoadGrad(d, g + i), sq_lo, sq_hi);
  }
  for (; i < end; ++i) SqAddOneLane(LoadGrad(d1, g + i), sq1);
  return SqTotal(d, sq_lo, sq_hi) + sq1;
}

double SquareSumRangeImpl(const void* grads, GradType type, size_t begin, size_t end) {
  return type == GradType::kBFloat16
             ? SquareSumRangeT(static_cast<const uint16_t*>(grads), begin, end)
             : SquareSumRangeT(static_cast<const float*>(grads), begin, end);
}

}  // namespace HWY_NAMESPACE
}  // namespace ztier::cpu_adam::internal
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ztier::cpu_adam::internal {

HWY_EXPORT(UpdateRangeImpl);
HWY_EXPORT(SquareSumRangeImpl);

RangeResult UpdateRange(const UpdateArgs& args, size_t begin, size_t end) {
  return HWY_DYNAMIC_DISPATCH(UpdateRangeImpl)(args, begin, end);
}

double SquareSumRange(const void* grads, GradType type, size_t begin, size_t end) {
  return HWY_DYNAMIC_DISPATCH(SquareSumRangeImpl)(grads, type, begin, end);
}

}  // namespace ztier::cpu_adam::internal
#endif  // HWY_ONCE
