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
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

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

// The AdamW / Adam update of one vector: from the raw grads, the param and
// the old m and v to the new param, m and v.
template <Mode kMode, class D, class V>
HWY_INLINE void AdamLanes(D d, const KernelConsts& c, V g_raw, V& param, V& m, V& v) {
  auto grad = hn::Mul(g_raw, hn::Set(d, c.grad_scale));
  if constexpr (kMode == Mode::kAdam) {
    grad = hn::MulAdd(hn::Set(d, c.l2), param, grad);
  }
  m = hn::MulAdd(hn::Set(d, c.beta1), m, hn::Mul(hn::Set(d, c.one_minus_beta1), grad));
  v = hn::MulAdd(hn::Set(d, c.beta2), v,
                 hn::Mul(hn::Mul(hn::Set(d, c.one_minus_beta2), grad), grad));
  const auto denom = hn::MulAdd(hn::Sqrt(v), hn::Set(d, c.inv_sqrt_bc2), hn::Set(d, c.eps));
  if constexpr (kMode == Mode::kAdamW) {
    param = hn::Mul(param, hn::Set(d, c.decay));
  }
  param = hn::NegMulAdd(hn::Set(d, c.step_size), hn::Div(m, denom), param);
}

// The AdamW / Adam update of Lanes(d) elements at index i. Returns the raw
// (unscaled) grads for the caller's norm and finiteness bookkeeping.
template <Mode kMode, OutKind kOut, class D, class G>
HWY_INLINE auto UpdateLanes(D d, const KernelConsts& c, const G* HWY_RESTRICT g,
                            float* HWY_RESTRICT p, float* HWY_RESTRICT m, float* HWY_RESTRICT v,
                            uint16_t* HWY_RESTRICT out, size_t i) {
  const auto g_raw = LoadGrad(d, g + i);
  auto param = hn::LoadU(d, p + i);
  auto exp_avg = hn::LoadU(d, m + i);
  auto exp_avg_sq = hn::LoadU(d, v + i);
  AdamLanes<kMode>(d, c, g_raw, param, exp_avg, exp_avg_sq);
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

// ---- 8-bit states ----

// Codes [0, Lanes(d)) to their values times the block's absmax.
template <class D>
HWY_INLINE auto DequantLanes(D d, const float* HWY_RESTRICT table,
                             const uint8_t* HWY_RESTRICT codes, float absmax) {
  const hn::RebindToSigned<D> di;
  const hn::Rebind<uint8_t, D> d8;
  const auto idx = hn::PromoteTo(di, hn::LoadU(d8, codes));
  return hn::Mul(hn::GatherIndex(d, table, idx), hn::Set(d, absmax));
}

// Full vectors of codes to values by arithmetic, and the per-decade values
// of quantization, by in-register table lookups (QuantTables) on targets
// with FMA and at least 8 lanes; elsewhere, and for the tails, by gathers
// from the same tables. Both give the tables' values bit for bit.
#if HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
constexpr bool kArithmeticCodes = true;
#else
constexpr bool kArithmeticCodes = false;
#endif

// A per-decade table (16 floats) as the lookups read it: with kPermute, in
// a register (idx < 16, and < 8 on 8-lane vectors) read by in-register
// table lookups; otherwise from memory by gathers. Loaded once per block.
template <bool kPermute, class D>
HWY_INLINE auto DecadeTable(D d, const float* HWY_RESTRICT table) {
  if constexpr (kPermute) {
    return hn::LoadU(d, table);
  } else {
    return table;
  }
}
template <class D, class VI>
HWY_INLINE auto Lookup(D d, const float* HWY_RESTRICT table, VI idx) {
  return hn::GatherIndex(d, table, idx);
}
template <class D, class V, class VI>
HWY_INLINE auto Lookup(D d, V table, VI idx) {
  return hn::TableLookupLanes(table, hn::IndicesFromVec(d, idx));
}

// Whole floats in [0, 2^23) to int32 (and the low byte to a code): adding
// 2^23 puts the value in the low mantissa bits. Cheaper than ConvertTo,
// which handles the overflow this range cannot have.
constexpr float kTwoTo23 = 8388608.0f;
template <class D, class V>
HWY_INLINE auto SmallWholeToInt(D d, V x) {
  const hn::RebindToSigned<D> di;
  return hn::Sub(hn::BitCast(di, hn::Add(x, hn::Set(d, kTwoTo23))),
                 hn::BitCast(di, hn::Set(d, kTwoTo23)));
}

// Quantization in two steps (QuantTables), each a short dependency chain,
// so that a block goes through each in its own pass and many vectors' steps
// overlap. kVector: a full vector (the tails use one-lane vectors).
//
// Step 1: the normalized magnitudes a of x (inv = 1 / the block's absmax)
// and their decades: an estimate (pos or pos - 1, never above the last),
// then one comparison.
template <class D, class V, class T>
HWY_INLINE auto DecadeLanes(D d, const QuantTables& t, T top, V x, V inv, V& a) {
  const hn::RebindToSigned<D> di;
  a = hn::Min(hn::Mul(hn::Abs(x), inv), hn::Set(d, 1.0f));
  const auto est = hn::Max(hn::Ceil(hn::MulAdd(hn::ConvertTo(d, hn::BitCast(di, a)),
                                               hn::Set(d, t.log_scale), hn::Set(d, t.log_offset))),
                           hn::Zero(d));
  const auto pos = SmallWholeToInt(d, est);
  const auto above = hn::RebindMask(di, hn::Gt(a, Lookup(d, top, pos)));
  return hn::IfThenElse(above, hn::Add(pos, hn::Set(di, 1)), pos);
}

// Step 1 on 16-lane targets: the estimate is the decade of a's octave
// (octave_decade, two registers).
constexpr bool kOctaveDecades = kArithmeticCodes && hn::MaxLanes(hn::ScalableTag<float>()) == 16;
template <class D, class V, class T, class VI>
HWY_INLINE auto OctaveDecadeLanes(D d, T top, VI octaves_lo, VI octaves_hi, V x, V inv, V& a) {
  const hn::RebindToSigned<D> di;
  a = hn::Min(hn::Mul(hn::Abs(x), inv), hn::Set(d, 1.0f));
  const auto floor = hn::Set(di, kOctaveFloor);
  const auto octave = hn::Sub(hn::Max(hn::ShiftRight<23>(hn::BitCast(di, a)), floor), floor);
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  const decltype(octave) pos{_mm512_permutex2var_epi32(octaves_lo.raw, octave.raw, octaves_hi.raw)};
#else
  // Only the AVX3 targets read decades from octaves; a target added to
  // kOctaveDecades needs its two-table lookup here first.
  static_assert(!kOctaveDecades, "OctaveDecadeLanes has no lookup for this target");
  const auto pos = octave;  // never used: kOctaveDecades is false here
  (void)octaves_lo;
  (void)octaves_hi;
#endif
  const auto above = hn::RebindMask(di, hn::Gt(a, Lookup(d, top, pos)));
  return hn::IfThenElse(above, hn::Add(pos, hn::Set(di, 1)), pos);
}

// Codes held as 2^23 + code in floats (the code in the low mantissa bits)
// to bytes.
template <class D, class V>
HWY_INLINE void StoreCodes(D /*d*/, V biased_code, uint8_t* HWY_RESTRICT codes) {
  const hn::RebindToSigned<D> di;
  const hn::Rebind<uint8_t, D> d8;
  const auto bits = hn::BitCast(di, biased_code);
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  if constexpr (hn::MaxLanes(D()) == 16) {
    hn::StoreU(hn::Vec128<uint8_t>{_mm512_cvtepi32_epi8(bits.raw)}, d8, codes);
    return;
  }
#endif
  const hn::RebindToUnsigned<D> du;
  hn::StoreU(hn::U8FromU32(hn::BitCast(du, hn::And(bits, hn::Set(di, 0xff)))), d8, codes);
}

// Step 2: from x, a and the decade to the nearest codes: the rounded place
// in the decade, or near a midpoint the comparison with it; m's codes add
// the sign bit. Codes are carried as 2^23 + code (below_code's bias).
// `lifted`: v's values above it take code 1 at least (0, or +inf in a
// block held as zeros).
template <bool kSigned, class D, class V, class VI, class T>
HWY_INLINE void CodeLanes(D d, const QuantTables& t, T below_codes, T inv_steps, T place_offsets,
                          V x, V a, VI pos, V lifted, uint8_t* HWY_RESTRICT codes) {
  const hn::RebindToSigned<D> di;
  const auto below_code = Lookup(d, below_codes, pos);
  const auto place = hn::MulAdd(a, Lookup(d, inv_steps, pos), Lookup(d, place_offsets, pos));
  const auto nearest = hn::Round(place);
  auto code = hn::Add(below_code, nearest);
  const auto unsure = hn::Gt(hn::Abs(hn::Sub(place, nearest)), hn::Set(d, 0.5f - kMidpointSlack));
  if (HWY_UNLIKELY(!hn::AllFalse(d, unsure))) {
    const auto c = hn::Add(below_code, hn::Trunc(place));
    const auto index = hn::Sub(hn::BitCast(di, c), hn::BitCast(di, hn::Set(d, kTwoTo23)));
    const auto mid = hn::GatherIndex(d, t.upper, index);
    code = hn::IfThenElse(hn::And(unsure, hn::Gt(a, mid)), hn::Add(c, hn::Set(d, 1.0f)),
                          hn::IfThenElse(unsure, c, code));
  }
  if constexpr (kSigned) {
    const auto neg = hn::And(hn::Lt(x, hn::Zero(d)), hn::Gt(code, hn::Set(d, kTwoTo23)));
    code = hn::IfThenElse(neg, hn::Add(code, hn::Set(d, 128.0f)), code);
  } else {
    // v: a positive value takes code 1 at least, never 0. m's map reaches
    // 1e-6 of its absmax, v's 1e-7 of its own, and v goes with g^2: an
    // element whose grads were 1e-4 of its group's largest kept its m and
    // lost its v to 0, and its next update was lr * m / eps (1e5 for lr
    // 1e-3). Held at v's smallest code (above its true v), it steps less
    // than in fp32 instead.
    const auto zero = hn::Set(d, kTwoTo23);
    code = hn::IfThenElse(hn::And(hn::Gt(x, lifted), hn::Eq(code, zero)),
                          hn::Add(zero, hn::Set(d, 1.0f)), code);
  }
  StoreCodes(d, code, codes);
}

// Largest |x| (kSigned) or x of [0, n).
template <bool kSigned>
float BlockAbsMax(const float* HWY_RESTRICT x, size_t n) {
  const hn::ScalableTag<float> d;
  const hn::CappedTag<float, 1> d1;
  const size_t lanes = hn::Lanes(d);
  auto mx = hn::Zero(d);
  auto mx1 = hn::Zero(d1);
  size_t j = 0;
  for (; j + lanes <= n; j += lanes) {
    const auto v = hn::LoadU(d, x + j);
    mx = hn::Max(mx, kSigned ? hn::Abs(v) : v);
  }
  for (; j < n; ++j) {
    const auto v = hn::LoadU(d1, x + j);
    mx1 = hn::Max(mx1, kSigned ? hn::Abs(v) : v);
  }
  return std::max(hn::GetLane(hn::MaxOfLanes(d, mx)), hn::GetLane(mx1));
}

// Quantizes x[0, n) (one block, n <= kQuantBlock, whose largest |x| is
// `largest`) into codes; returns its absmax.
template <bool kSigned>
float QuantBlock(const QuantTables& t, const float* HWY_RESTRICT x, size_t n, float largest,
                 uint8_t* HWY_RESTRICT codes) {
  const hn::ScalableTag<float> d;
  const hn::RebindToSigned<decltype(d)> di;
  const hn::CappedTag<float, 1> d1;
  const size_t lanes = hn::Lanes(d);
  // A block below the smallest normal float (whose inverse would overflow)
  // is held as zeros.
  const float absmax = largest >= std::numeric_limits<float>::min() ? largest : 0.0f;
  const float inv = absmax > 0.0f ? 1.0f / absmax : 0.0f;
  const float lifted = absmax > 0.0f ? 0.0f : std::numeric_limits<float>::infinity();
  HWY_ALIGN float a[kQuantBlock];
  HWY_ALIGN int32_t pos[kQuantBlock];
  size_t j = 0;
  {
    const auto top = DecadeTable<kArithmeticCodes>(d, t.top);
    const auto below_code = DecadeTable<kArithmeticCodes>(d, t.below_code);
    const auto inv_step = DecadeTable<kArithmeticCodes>(d, t.inv_step);
    const auto place_offset = DecadeTable<kArithmeticCodes>(d, t.place_offset);
    if constexpr (kOctaveDecades) {
      const auto octaves_lo = hn::LoadU(di, t.octave_decade);
      const auto octaves_hi = hn::LoadU(di, t.octave_decade + hn::MaxLanes(di));
      for (; j + lanes <= n; j += lanes) {
        auto aj = hn::Zero(d);
        hn::Store(OctaveDecadeLanes(d, top, octaves_lo, octaves_hi, hn::LoadU(d, x + j),
                                    hn::Set(d, inv), aj),
                  di, pos + j);
        hn::Store(aj, d, a + j);
      }
    }
    for (; j + lanes <= n; j += lanes) {
      auto aj = hn::Zero(d);
      hn::Store(DecadeLanes(d, t, top, hn::LoadU(d, x + j), hn::Set(d, inv), aj), di, pos + j);
      hn::Store(aj, d, a + j);
    }
    const size_t full = j;
    for (j = 0; j < full; j += lanes) {
      CodeLanes<kSigned>(d, t, below_code, inv_step, place_offset, hn::LoadU(d, x + j),
                         hn::Load(d, a + j), hn::Load(di, pos + j), hn::Set(d, lifted), codes + j);
    }
  }
  for (; j < n; ++j) {
    auto aj = hn::Zero(d1);
    const auto pj = DecadeLanes(d1, t, t.top, hn::LoadU(d1, x + j), hn::Set(d1, inv), aj);
    CodeLanes<kSigned>(d1, t, t.below_code, t.inv_step, t.place_offset, hn::LoadU(d1, x + j), aj,
                       pj, hn::Set(d1, lifted), codes + j);
  }
  return absmax;
}

template <bool kSigned, class D, class V>
HWY_INLINE auto DequantArith(D d, V bases, V steps, const uint8_t* HWY_RESTRICT codes,
                             float absmax) {
  const hn::RebindToSigned<D> di;
  const hn::Rebind<uint8_t, D> d8;
  auto mag = hn::PromoteTo(di, hn::LoadU(d8, codes));
  const auto neg = hn::Ne(hn::And(mag, hn::Set(di, 0x80)), hn::Zero(di));
  if constexpr (kSigned) mag = hn::And(mag, hn::Set(di, 0x7f));
  const auto fm = hn::ConvertTo(d, mag);  // exact
  const auto bits = hn::BitCast(di, fm);
  const auto pos = hn::Max(hn::Sub(hn::ShiftRight<23>(bits), hn::Set(di, 127)), hn::Zero(di));
  const auto pow2 = hn::BitCast(d, hn::And(bits, hn::Set(di, 0x7f800000)));
  const auto f1 = hn::Add(hn::Sub(fm, pow2), hn::Set(d, 1.0f));
  const auto base = Lookup(d, bases, pos);
  const auto step = Lookup(d, steps, pos);
  auto value =
      hn::IfThenZeroElse(hn::RebindMask(d, hn::Eq(mag, hn::Zero(di))), hn::MulAdd(step, f1, base));
  if constexpr (kSigned) value = hn::IfThenElse(hn::RebindMask(d, neg), hn::Neg(value), value);
  return hn::Mul(value, hn::Set(d, absmax));
}

template <bool kSigned>
void DequantBlock(const QuantTables& t, const uint8_t* HWY_RESTRICT codes, float absmax, size_t n,
                  float* HWY_RESTRICT x) {
  const hn::ScalableTag<float> d;
  const hn::CappedTag<float, 1> d1;
  const size_t lanes = hn::Lanes(d);
  size_t j = 0;
  if constexpr (kArithmeticCodes) {
    const auto bases = hn::LoadU(d, t.base);
    const auto steps = hn::LoadU(d, t.step);
    for (; j + lanes <= n; j += lanes) {
      hn::StoreU(DequantArith<kSigned>(d, bases, steps, codes + j, absmax), d, x + j);
    }
  }
  for (; j + lanes <= n; j += lanes) {
    hn::StoreU(DequantLanes(d, t.value, codes + j, absmax), d, x + j);
  }
  for (; j < n; ++j) hn::StoreU(DequantLanes(d1, t.value, codes + j, absmax), d1, x + j);
}

template <Mode kMode, class G>
RangeResult UpdateInt8RangeT(const Int8Args& a, size_t begin, size_t end) {
  const hn::ScalableTag<float> d;
  const hn::CappedTag<float, 1> d1;
  const hn::Rebind<uint16_t, decltype(d)> d16;
  const hn::Rebind<uint16_t, decltype(d1)> d16_1;
  const size_t lanes = hn::Lanes(d);
  const QuantTables& tm = Tables(QuantMap::kSigned);
  const QuantTables& tv = Tables(QuantMap::kUnsigned);
  const G* HWY_RESTRICT g = static_cast<const G*>(a.grads);
  float* HWY_RESTRICT p = a.params;
  uint16_t* HWY_RESTRICT out = a.out;
  const Int8Moments& q = a.moments;
  HWY_ALIGN float m_block[kQuantBlock];
  HWY_ALIGN float v_block[kQuantBlock];

  auto nf = hn::Zero(d);  // x - x: 0 for finite x, NaN for inf/NaN
  float nf1 = 0.0f;
  size_t seg = 0;
  while (seg < a.segment_count && a.segments[seg].end <= begin) ++seg;
  // One group at a time: [s, e), its absmax at b.
  for (GroupCursor group(q.cuts, begin, end); !group.done(); group.Next()) {
    const size_t s = group.begin(), e = group.end(), b = group.index();
    while (seg < a.segment_count && a.segments[seg].end <= s) ++seg;
    bool updates = false;
    for (size_t k = seg; k < a.segment_count && a.segments[k].begin < e; ++k) {
      updates = updates || !a.segments[k].frozen;
    }
    if (updates) {
      DequantBlock<true>(tm, q.m + s, q.m_absmax[b], e - s, m_block);
      DequantBlock<false>(tv, q.v + s, q.v_absmax[b], e - s, v_block);
    }
    // The group's new largest |m| and v, gathered as the update goes.
    auto m_max = hn::Zero(d);
    auto v_max = hn::Zero(d);
    float m_max1 = 0.0f;
    float v_max1 = 0.0f;
    for (size_t k = seg; k < a.segment_count && a.segments[k].begin < e; ++k) {
      const SegmentConsts& sc = a.segments[k];
      size_t i = std::max(sc.begin, s);
      const size_t hi = std::min(sc.end, e);
      if (sc.frozen) {  // only the bf16 copy of the master
        if (updates) {  // its m and v are quantized again with the rest
          m_max1 = std::max(m_max1, BlockAbsMax<true>(m_block + (i - s), hi - i));
          v_max1 = std::max(v_max1, BlockAbsMax<false>(v_block + (i - s), hi - i));
        }
        if (out == nullptr) continue;
        for (; i + lanes <= hi; i += lanes) {
          hn::StoreU(ToBf16Bits(d, hn::LoadU(d, p + i)), d16, out + i);
        }
        for (; i < hi; ++i) hn::StoreU(ToBf16Bits(d1, hn::LoadU(d1, p + i)), d16_1, out + i);
        continue;
      }
      const auto lanes_at = [&](auto dd, auto d16x, size_t at, auto& mm, auto& vm) HWY_ATTR {
        const auto g_raw = LoadGrad(dd, g + at);
        auto param = hn::LoadU(dd, p + at);
        auto m = hn::LoadU(dd, m_block + (at - s));
        auto v = hn::LoadU(dd, v_block + (at - s));
        AdamLanes<kMode>(dd, sc.c, g_raw, param, m, v);
        hn::StoreU(m, dd, m_block + (at - s));
        hn::StoreU(v, dd, v_block + (at - s));
        hn::StoreU(param, dd, p + at);
        if (out != nullptr) hn::StoreU(ToBf16Bits(dd, param), d16x, out + at);
        mm = hn::Max(mm, hn::Abs(m));
        vm = hn::Max(vm, v);
        return hn::Sub(g_raw, g_raw);
      };
      for (; i + lanes <= hi; i += lanes) nf = hn::Add(nf, lanes_at(d, d16, i, m_max, v_max));
      for (; i < hi; ++i) {
        auto mm = hn::Zero(d1);
        auto vm = hn::Zero(d1);
        nf1 += hn::GetLane(lanes_at(d1, d16_1, i, mm, vm));
        m_max1 = std::max(m_max1, hn::GetLane(mm));
        v_max1 = std::max(v_max1, hn::GetLane(vm));
      }
    }
    if (updates) {
      const float m_largest = std::max(hn::GetLane(hn::MaxOfLanes(d, m_max)), m_max1);
      const float v_largest = std::max(hn::GetLane(hn::MaxOfLanes(d, v_max)), v_max1);
      q.m_absmax[b] = QuantBlock<true>(tm, m_block, e - s, m_largest, q.m + s);
      q.v_absmax[b] = QuantBlock<false>(tv, v_block, e - s, v_largest, q.v + s);
    }
  }
  const float sum = hn::GetLane(hn::SumOfLanes(d, nf)) + nf1;
  return {0.0, std::isnan(sum)};
}

RangeResult UpdateInt8RangeImpl(const Int8Args& a, size_t begin, size_t end) {
  const bool bf = a.grad_type == GradType::kBFloat16;
  if (a.mode == Mode::kAdam) {
    return bf ? UpdateInt8RangeT<Mode::kAdam, uint16_t>(a, begin, end)
              : UpdateInt8RangeT<Mode::kAdam, float>(a, begin, end);
  }
  return bf ? UpdateInt8RangeT<Mode::kAdamW, uint16_t>(a, begin, end)
            : UpdateInt8RangeT<Mode::kAdamW, float>(a, begin, end);
}

void QuantizeRangeImpl(QuantMap map, const float* x, size_t begin, size_t end, uint8_t* codes,
                       float* absmax, std::span<const size_t> cuts) {
  const QuantTables& t = Tables(map);
  for (GroupCursor group(cuts, begin, end); !group.done(); group.Next()) {
    const size_t s = group.begin(), n = group.end() - s;
    absmax[group.index()] =
        map == QuantMap::kSigned
            ? QuantBlock<true>(t, x + s, n, BlockAbsMax<true>(x + s, n), codes + s)
            : QuantBlock<false>(t, x + s, n, BlockAbsMax<false>(x + s, n), codes + s);
  }
}

void DequantizeRangeImpl(QuantMap map, const uint8_t* codes, const float* absmax, size_t begin,
                         size_t end, float* x, std::span<const size_t> cuts) {
  const QuantTables& t = Tables(map);
  for (GroupCursor group(cuts, begin, end); !group.done(); group.Next()) {
    const size_t s = group.begin(), n = group.end() - s;
    if (map == QuantMap::kSigned) {
      DequantBlock<true>(t, codes + s, absmax[group.index()], n, x + s);
    } else {
      DequantBlock<false>(t, codes + s, absmax[group.index()], n, x + s);
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace ztier::cpu_adam::internal
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ztier::cpu_adam::internal {

HWY_EXPORT(UpdateRangeImpl);
HWY_EXPORT(SquareSumRangeImpl);
HWY_EXPORT(UpdateInt8RangeImpl);
HWY_EXPORT(QuantizeRangeImpl);
HWY_EXPORT(DequantizeRangeImpl);

RangeResult UpdateRange(const UpdateArgs& args, size_t begin, size_t end) {
  return HWY_DYNAMIC_DISPATCH(UpdateRangeImpl)(args, begin, end);
}

double SquareSumRange(const void* grads, GradType type, size_t begin, size_t end) {
  return HWY_DYNAMIC_DISPATCH(SquareSumRangeImpl)(grads, type, begin, end);
}

RangeResult UpdateInt8Range(const Int8Args& args, size_t begin, size_t end) {
  return HWY_DYNAMIC_DISPATCH(UpdateInt8RangeImpl)(args, begin, end);
}

void QuantizeRange(QuantMap map, const float* x, size_t begin, size_t end, uint8_t* codes,
                   float* absmax, std::span<const size_t> cuts) {
  HWY_DYNAMIC_DISPATCH(QuantizeRangeImpl)(map, x, begin, end, codes, absmax, cuts);
}

void DequantizeRange(QuantMap map, const uint8_t* codes, const float* absmax, size_t begin,
                     size_t end, float* x, std::span<const size_t> cuts) {
  HWY_DYNAMIC_DISPATCH(DequantizeRangeImpl)(map, codes, absmax, begin, end, x, cuts);
}

}  // namespace ztier::cpu_adam::internal
#endif  // HWY_ONCE
