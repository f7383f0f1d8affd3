// ztier cpu_adam: the fused CPU AdamW kernel (public header of the component).
//
// One Step() call updates a contiguous shard in one pass over memory: it reads
// the grads (bf16 or fp32) and the fp32 master params, exp_avg (m) and
// exp_avg_sq (v), writes params/m/v in place and, optionally, the bf16 copy of
// the new params that clients fetch ("publish" buffer), rounded to nearest even
// exactly like PyTorch. Vector code is chosen at run time by Highway dynamic
// dispatch (AVX3_DL, AVX3 = AVX-512, AVX2, SSE4, SSSE3, scalar): one binary runs the best
// target of the machine it lands on. oneTBB runs fixed-size tiles inside an
// Executor whose thread count the caller sets.
//
// Formulas (PyTorch torch.optim.AdamW / Adam, per element, fp32 arithmetic):
//   g  = grad * grad_scale                (+ weight_decay * p   in Mode::kAdam)
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * g * g
//   bc1 = 1 - beta1^step, bc2 = 1 - beta2^step    (1 when bias correction is off)
//   p  = p * (1 - lr * weight_decay)                (Mode::kAdamW only)
//   p  = p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
//
// Non-finite grads: with GradCheck::kScanFirst (the default) the grads are
// scanned before anything is written; if any is inf/NaN, or they are so
// large that v could overflow fp32 (GradsOverflow: finite bf16 grads reach
// 3e38, whose square does not fit), Step() returns StepResult{.skipped =
// true} and params, m, v and the output are untouched (mixed-precision step
// skipping). GradCheck::kPrechecked is for callers that
// already scanned these grads (the engine computes SquaredNorm() as grads
// arrive): one pass over memory, and a non-finite grad found anyway is a
// FailedPrecondition error that says the shard is now partly updated.
//
// Determinism: the shard is cut in fixed tiles of kTileElements; results,
// including the fp64 sum of squares (per-tile fp64 partials summed in tile
// order), are bit-identical whatever the thread count. Different SIMD targets
// may differ in the last bit (fused vs unfused multiply-add).
//
// 8-bit states (StepInt8): m and v are stored as 8-bit codes of block-wise
// dynamic quantization (Dettmers et al., "8-bit Optimizers via Block-wise
// Quantization"): each group of elements keeps one fp32 absmax,
// and a code indexes a non-linear map of [-1, 1] (m: sign bit and 7 bits of
// magnitude) or [0, 1] (v: 8 bits), dense near 1 and reaching down to 1e-6
// (m) and 1e-7 (v) of the absmax. A code's bits are a run of e zeros (the
// value's decade, 10^-e), a one, then a linear fraction of the decade; the
// largest code is exactly 1. A step dequantizes a group, updates it in fp32
// (the params use the new fp32 m and v), takes the new absmax and quantizes
// to the nearest code (ties to the smaller; a positive v to code 1 at least:
// m's map reaches lower than v's, and an element whose v became 0 beside a
// kept m stepped by lr * m / eps), in one pass over memory. The
// fp32 master is kept. Per parameter: 4 + 1 + 1 bytes and 8 per group.
// Groups are the blocks of kQuantBlock elements from the shard's start, cut
// again at the moments' `cuts` (where the shard's tensors start): a group
// never holds parts of two tensors, whose moments may differ by orders of
// magnitude (a small one sharing a larger one's absmax would lose its v to
// zero, and its steps would grow by as much), and a frozen tensor's groups
// are never written.
//
// Thread safety: Step() and SquaredNorm() may be called concurrently on
// disjoint shards, also on one Executor. Buffers must not be modified by
// others during a call. Failure: only InvalidArgument (bad hyper-parameters
// or options, an unknown enum value, null, misaligned or overlapping
// buffers), FailedPrecondition (see kPrechecked); no
// allocation-dependent failures.
#ifndef ZTIER_CPU_ADAM_ADAMW_H_
#define ZTIER_CPU_ADAM_ADAMW_H_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "common/status.h"
#include "cpu_adam/hyper.h"

namespace ztier::cpu_adam {

enum class GradType : uint8_t { kFloat32, kBFloat16 };
enum class GradCheck : uint8_t { kScanFirst, kPrechecked };
// How the bf16 publish copy is stored: kStreaming uses non-temporal stores
// (the CPU never reads the copy again), kRegular ordinary stores.
enum class OutputStore : uint8_t { kStreaming, kRegular };

// InvalidArgument naming the field unless 0 <= lr, 0 <= beta1, beta2 < 1,
// eps > 0 and weight_decay >= 0, all finite.
Status ValidateHyper(const Hyper& h);

// The largest sum of squared grads (after grad_scale) a step takes: every
// grad's square is then at most FLT_MAX / 4, so g * g and v stay finite.
inline constexpr double kMaxGradSqSum = 3.4028234663852886e38 / 4;
// Whether a step whose grads' fp64 sum of squares (before grad_scale) is
// `sq_sum` must be skipped: inf/NaN grads, or grads past kMaxGradSqSum.
inline bool GradsOverflow(double sq_sum, float grad_scale) {
  const double scale = grad_scale;
  return !(sq_sum * scale * scale <= kMaxGradSqSum);
}

// Global-norm clipping's grad_scale for grads of global norm `norm`, as
// torch.nn.utils.clip_grad_norm_ takes it: clip / (norm + 1e-6) wherever that
// is below 1 (a norm a hair under `clip` included), else 1. Also 1 when
// clipping is off (`clip` 0) or the norm is not finite (the step is skipped).
// At least the smallest float: a scale that rounds to 0 in fp32 (a clip of
// 1e-40) takes the grads to nothing, as torch's does, where a grad_scale of
// 0 would be refused and the step fail.
inline float ClipScale(double norm, float clip) {
  if (!(clip > 0.0f) || !std::isfinite(norm)) return 1.0f;
  const double coef = clip / (norm + 1e-6);
  if (!(coef < 1.0)) return 1.0f;
  return std::max(static_cast<float>(coef), std::numeric_limits<float>::denorm_min());
}

struct StepOptions {
  int64_t step = 1;         // 1-based optimizer step number (bias correction)
  float grad_scale = 1.0f;  // grads are multiplied by this (clipping, loss-scale); finite, > 0
  GradCheck grad_check = GradCheck::kScanFirst;
  bool want_grad_sq_sum = false;  // fill StepResult::grad_sq_sum
  OutputStore output_store = OutputStore::kStreaming;
};

// One contiguous shard. All arrays have `count` elements; params, exp_avg,
// exp_avg_sq and params_out must not overlap. Each array must be aligned to
// its elements (4 bytes for fp32, 2 for bf16; InvalidArgument otherwise);
// no wider alignment is needed.
struct Shard {
  size_t count = 0;
  const void* grads = nullptr;  // count elements of grad_type
  GradType grad_type = GradType::kBFloat16;
  float* params = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  bf16* params_out = nullptr;  // optional: receives bf16(params) after the update
};

struct StepResult {
  bool skipped = false;      // a grad was inf/NaN or too large (GradsOverflow); nothing written
  double grad_sq_sum = 0.0;  // sum of squares of the grads before grad_scale, if asked
};

// Elements per tile: the unit of parallel work and of the deterministic
// fp64 partial sums. 16 KiB elements * 16 B/element of traffic = 256 KiB,
// small enough to stay in a core's L2.
inline constexpr size_t kTileElements = size_t{1} << 14;

// 8-bit states: elements per quantization block (one fp32 absmax for m and
// one for v). Tiles are whole blocks, so results do not depend on the
// thread count.
inline constexpr size_t kQuantBlock = 256;
static_assert(kTileElements % kQuantBlock == 0);
inline constexpr size_t QuantBlocks(size_t count) {
  return (count + kQuantBlock - 1) / kQuantBlock;
}

// Where a shard's quantization groups start besides the block grid: of
// `starts` (a shard's tensor offsets, say; any order, repeats allowed), those
// in (0, count) that are not multiples of kQuantBlock, sorted and unique.
std::vector<size_t> QuantCuts(std::span<const size_t> starts, size_t count);
// The groups of a shard of `count` elements cut at `cuts` (as QuantCuts
// makes them): its blocks, one more for each cut.
inline size_t QuantGroups(size_t count, std::span<const size_t> cuts) {
  return QuantBlocks(count) + cuts.size();
}

// The two maps: kSigned (m: code = sign << 7 | magnitude, 128 magnitudes)
// and kUnsigned (v: 256 values in [0, 1]).
enum class QuantMap : uint8_t { kSigned, kUnsigned };
// The 256 values of a map's codes, ascending for kUnsigned; for kSigned,
// codes 0..127 are the magnitudes ascending and code 128 + k is -value[k].
const float* QuantMapValues(QuantMap map);

// Group-wise quantization of x[0, count) (blocks of kQuantBlock from x[0],
// cut at `cuts`, which must be as QuantCuts makes them; absmax gets
// QuantGroups(count, cuts) scales) and its inverse. A group whose absmax is
// below the smallest normal float holds zeros (absmax 0). Single-threaded on
// the caller's thread; any alignment. x must be finite. Cuts that are not
// as QuantCuts makes them are a programmer error (the process aborts).
void Quantize(QuantMap map, const float* x, size_t count, uint8_t* codes, float* absmax,
              std::span<const size_t> cuts = {});
void Dequantize(QuantMap map, const uint8_t* codes, const float* absmax, size_t count, float* x,
                std::span<const size_t> cuts = {});

// A shard's 8-bit m and v (see the file comment): `count` codes each and
// QuantGroups(count, cuts) absmax values each. `cuts` (as QuantCuts makes
// them; empty: the block grid alone) is viewed, not owned.
struct Int8Moments {
  uint8_t* m = nullptr;
  uint8_t* v = nullptr;
  float* m_absmax = nullptr;
  float* v_absmax = nullptr;
  std::span<const size_t> cuts;
};

struct Int8Shard {
  size_t count = 0;
  const void* grads = nullptr;  // count elements of grad_type
  GradType grad_type = GradType::kBFloat16;
  float* params = nullptr;
  Int8Moments moments;
  bf16* params_out = nullptr;  // optional: receives bf16(params) after the update
};

// Elements [begin, end) of a shard with their own learning rate and weight
// decay (optimizer param groups), or frozen: a frozen element's param, m
// and v stay (its bf16 copy is still written). Segments are sorted, do not
// overlap and cover the shard. A segment whose bounds are cuts, on the
// block grid or the shard's end has groups of its own (a frozen one's are
// never written); otherwise a group that mixes segments is quantized once,
// after all of its elements.
struct Segment {
  size_t begin = 0, end = 0;
  float lr = 0.0f;
  float weight_decay = 0.0f;
  bool frozen = false;
};

// Machine topology as hwloc reports it.
struct Topology {
  int numa_nodes = 1;
  int cores = 1;                    // physical cores
  std::vector<int> cores_per_node;  // by NUMA node index
};
Result<Topology> DetectTopology();

// A bounded set of worker threads for the optimizer: a oneTBB task arena with
// a fixed concurrency, kept on the cores of one NUMA node when the machine has
// more than one. Jobs share one Executor so they do not oversubscribe cores.
// Move-only; destroying it waits for nothing (no call may be in flight).
class Executor {
 public:
  struct Options {
    int threads = 0;     // 0: all physical cores of the chosen node
    int numa_node = -1;  // -1: the node of the calling thread (if >1 node)
  };

  // InvalidArgument if threads < 0 or numa_node is not a node of this machine.
  static Result<Executor> Create(const Options& options);

  Executor(Executor&&) noexcept;
  Executor& operator=(Executor&&) noexcept;
  ~Executor();

  int threads() const;
  int numa_node() const;  // -1 when not constrained (single node)

  // Runs body(begin, end) over disjoint ranges covering [0, n) on the arena's
  // threads (static partition, contiguous chunks per thread); blocks until all
  // are done. body must not throw.
  void ParallelFor(size_t n, const std::function<void(size_t begin, size_t end)>& body);

 private:
  struct Impl;
  explicit Executor(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The AdamW / Adam update of one shard; see the file comment.
// Errors: InvalidArgument (hyper-parameters, step < 1, grad_scale, null or
// overlapping buffers), FailedPrecondition (kPrechecked with non-finite grads).
Result<StepResult> Step(const Hyper& hyper, const StepOptions& options, const Shard& shard,
                        Executor& executor);

// The AdamW / Adam update of a shard with 8-bit m and v (see the file
// comment), in one pass: per group, dequantize, update params, m and v in
// fp32, publish bf16, quantize. `segments` empty: one segment with the
// hyper-parameters' lr and weight decay. Grad checks, the grad norm and
// skipping work as in Step(). A group entirely frozen is not written.
// Errors: as Step(), and InvalidArgument for segments that are unsorted,
// overlap, leave elements out or have bad rates, and for cuts that are not
// as QuantCuts makes them.
Result<StepResult> StepInt8(const Hyper& hyper, const StepOptions& options, const Int8Shard& shard,
                            const std::vector<Segment>& segments, Executor& executor);

// Sum of squares of `count` grads in fp64 (deterministic, like Step()).
// Inf/NaN in the data makes the result inf/NaN: a non-finite result means the
// step must be skipped. Errors: InvalidArgument (null data with count > 0).
Result<double> SquaredNorm(const void* data, GradType type, size_t count, Executor& executor);

// Name of the Highway target dynamic dispatch picks now ("AVX3_DL", "AVX2"...).
std::string ActiveTarget();

}  // namespace ztier::cpu_adam

#endif  // ZTIER_CPU_ADAM_ADAMW_H_
