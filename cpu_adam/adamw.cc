// ztier cpu_adam: Step() and SquaredNorm(): validation, per-step constants,
// tiling over the Executor and the deterministic reduction of tile partials.
// See adamw.h for the contract.
#include "cpu_adam/adamw.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_adam/kernels.h"
#include "hwy/targets.h"

namespace ztier::cpu_adam {
namespace {

size_t TileCount(size_t count) { return (count + kTileElements - 1) / kTileElements; }

// Runs fn(tile_index, begin, end) for every tile of [0, count) on the executor.
template <class Fn>
void ForEachTile(Executor& executor, size_t count, const Fn& fn) {
  executor.ParallelFor(TileCount(count), [&](size_t first, size_t last) {
    for (size_t t = first; t < last; ++t) {
      const size_t begin = t * kTileElements;
      fn(t, begin, std::min(count, begin + kTileElements));
    }
  });
}

// Sums tile partials in tile order: the same bits for any thread count.
double SumInOrder(const std::vector<double>& partials) {
  double total = 0.0;
  for (double p : partials) total += p;
  return total;
}

bool Overlap(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a);
  const auto y = reinterpret_cast<uintptr_t>(b);
  return x < y + b_bytes && y < x + a_bytes;
}

size_t GradBytes(GradType t) { return t == GradType::kBFloat16 ? 2 : 4; }

Status ValidateGradType(GradType t) {
  if (t == GradType::kBFloat16 || t == GradType::kFloat32) return Status::Ok();
  return Status::InvalidArgument(StrCat("AdamW grad type ", static_cast<int>(t), " is unknown"));
}

struct Buf {
  const char* name;
  const void* ptr;
  size_t bytes;
  size_t align;  // its elements' size
};

// Every buffer must be aligned to its elements (a float at an odd address
// is no float), and every written buffer (the first `written`) disjoint
// from every other buffer.
Status CheckDisjoint(const Buf* bufs, size_t count, size_t written) {
  for (size_t i = 0; i < count; ++i) {
    if (reinterpret_cast<uintptr_t>(bufs[i].ptr) % bufs[i].align != 0) {
      return Status::InvalidArgument(StrCat("AdamW buffer ", bufs[i].name, " at ", bufs[i].ptr,
                                            " is not aligned to its ", bufs[i].align,
                                            "-byte elements"));
    }
  }
  for (size_t i = 0; i < written; ++i) {
    if (bufs[i].ptr == nullptr) continue;
    for (size_t j = i + 1; j < count; ++j) {
      if (bufs[j].ptr != nullptr &&
          Overlap(bufs[i].ptr, bufs[i].bytes, bufs[j].ptr, bufs[j].bytes)) {
        return Status::InvalidArgument(
            StrCat("AdamW buffers overlap: ", bufs[i].name, " and ", bufs[j].name));
      }
    }
  }
  return Status::Ok();
}

Status ValidateShard(const Shard& s) {
  if (s.count == 0) return Status::Ok();
  if (s.grads == nullptr || s.params == nullptr || s.exp_avg == nullptr ||
      s.exp_avg_sq == nullptr) {
    return Status::InvalidArgument(StrCat("AdamW shard of ", s.count,
                                          " elements has a null grads/params/exp_avg/exp_avg_sq "
                                          "buffer"));
  }
  ZT_RETURN_IF_ERROR(ValidateGradType(s.grad_type));
  const size_t fbytes = s.count * sizeof(float);
  const Buf bufs[] = {{"params", s.params, fbytes, 4},
                      {"exp_avg", s.exp_avg, fbytes, 4},
                      {"exp_avg_sq", s.exp_avg_sq, fbytes, 4},
                      {"params_out", s.params_out, s.count * sizeof(bf16), 2},
                      {"grads", s.grads, s.count * GradBytes(s.grad_type), GradBytes(s.grad_type)}};
  return CheckDisjoint(bufs, 5, 4);
}

// InvalidArgument unless `cuts` are as QuantCuts makes them for `count`
// elements (the absmax arrays are sized, and the groups walked, by them).
Status CheckCuts(size_t count, std::span<const size_t> cuts) {
  for (size_t i = 0; i < cuts.size(); ++i) {
    const size_t cut = cuts[i];
    if (cut == 0 || cut >= count || cut % kQuantBlock == 0 || (i > 0 && cut <= cuts[i - 1])) {
      return Status::InvalidArgument(StrCat(
          "cut ", i, " at ", cut, " of ", count, " elements is not as QuantCuts makes ",
          "them (sorted, unique, in (0, count), off the ", kQuantBlock, "-element block grid)"));
    }
  }
  return Status::Ok();
}

Status ValidateInt8Shard(const Int8Shard& s) {
  if (s.count == 0) return Status::Ok();
  const Int8Moments& q = s.moments;
  if (s.grads == nullptr || s.params == nullptr || q.m == nullptr || q.v == nullptr ||
      q.m_absmax == nullptr || q.v_absmax == nullptr) {
    return Status::InvalidArgument(StrCat("8-bit AdamW shard of ", s.count,
                                          " elements has a null grads/params/m/v/absmax buffer"));
  }
  ZT_RETURN_IF_ERROR(ValidateGradType(s.grad_type));
  ZT_RETURN_IF_ERROR(CheckCuts(s.count, q.cuts).Annotate("8-bit AdamW shard"));
  const size_t scales = QuantGroups(s.count, q.cuts) * sizeof(float);
  const Buf bufs[] = {{"params", s.params, s.count * sizeof(float), 4},
                      {"m", q.m, s.count, 1},
                      {"v", q.v, s.count, 1},
                      {"m_absmax", q.m_absmax, scales, 4},
                      {"v_absmax", q.v_absmax, scales, 4},
                      {"params_out", s.params_out, s.count * sizeof(bf16), 2},
                      {"grads", s.grads, s.count * GradBytes(s.grad_type), GradBytes(s.grad_type)}};
  return CheckDisjoint(bufs, 7, 6);
}

bool FiniteNonNegative(double x) { return std::isfinite(x) && x >= 0.0; }

// Per-step constants, computed in double as PyTorch does in Python.
internal::KernelConsts Consts(const Hyper& hyper, const StepOptions& options) {
  const double b1 = hyper.beta1, b2 = hyper.beta2;
  const bool bias = hyper.bias_correction == BiasCorrection::kOn;
  const double bc1 = bias ? 1.0 - std::pow(b1, static_cast<double>(options.step)) : 1.0;
  const double bc2 = bias ? 1.0 - std::pow(b2, static_cast<double>(options.step)) : 1.0;
  internal::KernelConsts c{};
  c.grad_scale = options.grad_scale;
  c.beta1 = static_cast<float>(b1);
  c.one_minus_beta1 = static_cast<float>(1.0 - b1);
  c.beta2 = static_cast<float>(b2);
  c.one_minus_beta2 = static_cast<float>(1.0 - b2);
  c.step_size = static_cast<float>(hyper.lr / bc1);
  c.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  c.eps = hyper.eps;
  c.decay = static_cast<float>(1.0 - static_cast<double>(hyper.lr) * hyper.weight_decay);
  c.l2 = hyper.weight_decay;
  return c;
}

Status ValidateOptions(const Hyper& hyper, const StepOptions& options) {
  ZT_RETURN_IF_ERROR(ValidateHyper(hyper));
  if (options.step < 1) {
    return Status::InvalidArgument(StrCat("AdamW step number must be >= 1, got ", options.step));
  }
  if (!std::isfinite(options.grad_scale) || options.grad_scale <= 0.0f) {
    return Status::InvalidArgument(
        StrCat("AdamW grad_scale must be finite and > 0, got ", options.grad_scale));
  }
  if (options.grad_check != GradCheck::kScanFirst && options.grad_check != GradCheck::kPrechecked) {
    return Status::InvalidArgument(
        StrCat("AdamW grad_check ", static_cast<int>(options.grad_check), " is unknown"));
  }
  if (options.output_store != OutputStore::kStreaming &&
      options.output_store != OutputStore::kRegular) {
    return Status::InvalidArgument(
        StrCat("AdamW output_store ", static_cast<int>(options.output_store), " is unknown"));
  }
  return Status::Ok();
}

// kScanFirst: the grads' sum of squares, tile by tile; `result` says
// whether the step is skipped.
void ScanGrads(const void* grads, GradType type, size_t count, float grad_scale, Executor& executor,
               std::vector<double>& partials, StepResult& result) {
  ForEachTile(executor, count, [&](size_t t, size_t begin, size_t end) {
    partials[t] = internal::SquareSumRange(grads, type, begin, end);
  });
  result.grad_sq_sum = SumInOrder(partials);
  result.skipped = GradsOverflow(result.grad_sq_sum, grad_scale);
}

Status NonFiniteError(const std::vector<uint8_t>& non_finite, size_t count) {
  for (size_t t = 0; t < non_finite.size(); ++t) {
    if (non_finite[t] != 0) {
      return Status::FailedPrecondition(
          StrCat("AdamW grads passed as prechecked contain inf/NaN (first in elements [",
                 t * kTileElements, ", ", std::min(count, (t + 1) * kTileElements),
                 ")); the shard's params/m/v are now partly updated and must be restored"));
    }
  }
  return Status::Ok();
}

}  // namespace

Status ValidateHyper(const Hyper& h) {
  if (h.mode != Mode::kAdamW && h.mode != Mode::kAdam) {
    return Status::InvalidArgument(StrCat("AdamW mode ", static_cast<int>(h.mode), " is unknown"));
  }
  if (h.bias_correction != BiasCorrection::kOn && h.bias_correction != BiasCorrection::kOff) {
    return Status::InvalidArgument(
        StrCat("AdamW bias_correction ", static_cast<int>(h.bias_correction), " is unknown"));
  }
  if (!FiniteNonNegative(h.lr))
    return Status::InvalidArgument(StrCat("AdamW lr must be finite and >= 0, got ", h.lr));
  if (!FiniteNonNegative(h.beta1) || h.beta1 >= 1.0) {
    return Status::InvalidArgument(StrCat("AdamW beta1 must be in [0, 1), got ", h.beta1));
  }
  if (!FiniteNonNegative(h.beta2) || h.beta2 >= 1.0) {
    return Status::InvalidArgument(StrCat("AdamW beta2 must be in [0, 1), got ", h.beta2));
  }
  if (!std::isfinite(h.eps) || h.eps <= 0.0f) {
    return Status::InvalidArgument(StrCat("AdamW eps must be finite and > 0, got ", h.eps));
  }
  if (!FiniteNonNegative(h.weight_decay)) {
    return Status::InvalidArgument(
        StrCat("AdamW weight_decay must be finite and >= 0, got ", h.weight_decay));
  }
  return Status::Ok();
}

Result<StepResult> Step(const Hyper& hyper, const StepOptions& options, const Shard& shard,
                        Executor& executor) {
  ZT_RETURN_IF_ERROR(ValidateOptions(hyper, options));
  ZT_RETURN_IF_ERROR(ValidateShard(shard));
  StepResult result;
  if (shard.count == 0) return result;

  const size_t tiles = TileCount(shard.count);
  std::vector<double> partials(tiles, 0.0);
  bool have_sum = false;
  if (options.grad_check == GradCheck::kScanFirst) {
    ScanGrads(shard.grads, shard.grad_type, shard.count, options.grad_scale, executor, partials,
              result);
    have_sum = true;
    if (result.skipped) return result;
  }

  internal::UpdateArgs args{};
  args.c = Consts(hyper, options);
  args.mode = hyper.mode;
  args.grads = shard.grads;
  args.grad_type = shard.grad_type;
  args.params = shard.params;
  args.exp_avg = shard.exp_avg;
  args.exp_avg_sq = shard.exp_avg_sq;
  args.out = reinterpret_cast<uint16_t*>(shard.params_out);
  // Non-temporal stores need bf16 slots aligned to 2 bytes at least to reach
  // vector alignment; a misaligned bf16* (not a valid pointer anyway) falls back.
  const bool can_stream = reinterpret_cast<uintptr_t>(shard.params_out) % alignof(bf16) == 0;
  args.out_kind = shard.params_out == nullptr ? internal::OutKind::kNone
                  : options.output_store == OutputStore::kStreaming && can_stream
                      ? internal::OutKind::kStreaming
                      : internal::OutKind::kRegular;
  args.sum_sq = options.want_grad_sq_sum && !have_sum;

  std::vector<uint8_t> non_finite(tiles, 0);
  ForEachTile(executor, shard.count, [&](size_t t, size_t begin, size_t end) {
    const internal::RangeResult r = internal::UpdateRange(args, begin, end);
    if (args.sum_sq) partials[t] = r.sq_sum;
    non_finite[t] = r.non_finite ? 1 : 0;
  });
  if (args.sum_sq) result.grad_sq_sum = SumInOrder(partials);
  ZT_RETURN_IF_ERROR(NonFiniteError(non_finite, shard.count));
  return result;
}

Result<StepResult> StepInt8(const Hyper& hyper, const StepOptions& options, const Int8Shard& shard,
                            const std::vector<Segment>& segments, Executor& executor) {
  ZT_RETURN_IF_ERROR(ValidateOptions(hyper, options));
  ZT_RETURN_IF_ERROR(ValidateInt8Shard(shard));
  std::vector<internal::SegmentConsts> consts;
  if (segments.empty()) {
    consts.push_back({0, shard.count, Consts(hyper, options), false});
  } else {
    size_t at = 0;
    for (const Segment& seg : segments) {
      if (seg.begin != at || seg.end < seg.begin) {
        return Status::InvalidArgument(StrCat("8-bit AdamW segment [", seg.begin, ", ", seg.end,
                                              ") does not start where the previous ended (", at,
                                              ")"));
      }
      if (!FiniteNonNegative(seg.lr) || !FiniteNonNegative(seg.weight_decay)) {
        return Status::InvalidArgument(StrCat("8-bit AdamW segment [", seg.begin, ", ", seg.end,
                                              ") has lr ", seg.lr, " and weight decay ",
                                              seg.weight_decay, "; both must be finite and >= 0"));
      }
      Hyper h = hyper;
      h.lr = seg.lr;
      h.weight_decay = seg.weight_decay;
      if (seg.end > seg.begin)
        consts.push_back({seg.begin, seg.end, Consts(h, options), seg.frozen});
      at = seg.end;
    }
    if (at != shard.count) {
      return Status::InvalidArgument(StrCat("8-bit AdamW segments cover [0, ", at,
                                            ") of a shard of ", shard.count, " elements"));
    }
  }
  StepResult result;
  if (shard.count == 0) return result;
  const size_t tiles = TileCount(shard.count);
  std::vector<double> partials(tiles, 0.0);
  if (options.grad_check == GradCheck::kScanFirst) {
    ScanGrads(shard.grads, shard.grad_type, shard.count, options.grad_scale, executor, partials,
              result);
    if (result.skipped) return result;
  } else if (options.want_grad_sq_sum) {
    ZT_ASSIGN_OR_RETURN(result.grad_sq_sum,
                        SquaredNorm(shard.grads, shard.grad_type, shard.count, executor));
  }
  const internal::Int8Args args{.mode = hyper.mode,
                                .grads = shard.grads,
                                .grad_type = shard.grad_type,
                                .params = shard.params,
                                .moments = shard.moments,
                                .out = reinterpret_cast<uint16_t*>(shard.params_out),
                                .segments = consts.data(),
                                .segment_count = consts.size()};
  std::vector<uint8_t> non_finite(tiles, 0);
  ForEachTile(executor, shard.count, [&](size_t t, size_t begin, size_t end) {
    non_finite[t] = internal::UpdateInt8Range(args, begin, end).non_finite ? 1 : 0;
  });
  ZT_RETURN_IF_ERROR(NonFiniteError(non_finite, shard.count));
  return result;
}

std::vector<size_t> QuantCuts(std::span<const size_t> starts, size_t count) {
  std::vector<size_t> cuts;
  for (size_t at : starts) {
    if (at > 0 && at < count && at % kQuantBlock != 0) cuts.push_back(at);
  }
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  return cuts;
}

void Quantize(QuantMap map, const float* x, size_t count, uint8_t* codes, float* absmax,
              std::span<const size_t> cuts) {
  const Status checked = CheckCuts(count, cuts);
  ZT_CHECK_MSG(checked.ok(), checked.ToString());
  internal::QuantizeRange(map, x, 0, count, codes, absmax, cuts);
}

void Dequantize(QuantMap map, const uint8_t* codes, const float* absmax, size_t count, float* x,
                std::span<const size_t> cuts) {
  const Status checked = CheckCuts(count, cuts);
  ZT_CHECK_MSG(checked.ok(), checked.ToString());
  internal::DequantizeRange(map, codes, absmax, 0, count, x, cuts);
}

Result<double> SquaredNorm(const void* data, GradType type, size_t count, Executor& executor) {
  if (count == 0) return 0.0;
  if (data == nullptr) {
    return Status::InvalidArgument(StrCat("SquaredNorm of ", count, " elements with null data"));
  }
  ZT_RETURN_IF_ERROR(ValidateGradType(type));
  if (reinterpret_cast<uintptr_t>(data) % GradBytes(type) != 0) {
    return Status::InvalidArgument(StrCat("SquaredNorm of data at ", data, ", not aligned to its ",
                                          GradBytes(type), "-byte elements"));
  }
  std::vector<double> partials(TileCount(count), 0.0);
  ForEachTile(executor, count, [&](size_t t, size_t begin, size_t end) {
    partials[t] = internal::SquareSumRange(data, type, begin, end);
  });
  return SumInOrder(partials);
}

std::string ActiveTarget() {
  // Dynamic dispatch picks the best (lowest bit) target that is both compiled
  // and supported; SupportedTargets() honours a test's forced target.
  const int64_t usable = hwy::SupportedTargets() & HWY_TARGETS;
  return usable == 0 ? std::string("none") : hwy::TargetName(usable & -usable);
}

}  // namespace ztier::cpu_adam
