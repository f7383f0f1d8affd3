// A small decoder-only transformer (GPT-2 shape) trained through ztier's
// stage-3 runner: token + position embedding, N blocks of layernorm /
// causal self-attention / MLP, a final layernorm and a tied or untied head,
// cross-entropy loss over a byte-level vocabulary.
//
// Units, in forward order: "embed" (wte [V,C], wpe [T,C]), "h.0" ..
// "h.{L-1}" (ln_1, attn.qkv, attn.proj, ln_2, mlp.fc, mlp.proj, each a
// weight and a bias), "head" (ln_f, and lm_head [V,C] when untied; a tied
// head reuses wte from the embed unit, whose grads then sum both uses).
// A training micro-step acquires 0, 1 .. L, head (and 0 again beside a tied
// head), keeps the head held into its backward, then L .. 1, 0.
// Every unit's weights come from a WeightSource (Acquire), and its grads go
// back through it (GradBuffer + PushGrads) as soon as the unit's backward
// ends. The same model code trains against the stage-3 runner and against
// plain in-memory weights, which is how the runner is tested.
//
// Thread safety: a Gpt belongs to one rank's thread. Errors: Status values
// from the source or the device, with the unit named.
#ifndef ZTIER_EXAMPLES_GPT_GPT_H_
#define ZTIER_EXAMPLES_GPT_GPT_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "client/ztier.h"
#include "common/bf16.h"
#include "common/status.h"
#include "engine/engine.h"
#include "examples/gpt/kernels.h"

namespace ztier::gpt {

struct Config {
  int vocab = 256;    // byte-level
  int context = 64;   // T
  int channels = 64;  // C
  int layers = 2;     // L
  int heads = 4;      // NH; divides C
  bool tied_head = true;
  // Keep only each block's input in the forward pass and recompute the
  // block's activations in its backward.
  bool checkpoint_activations = false;
  // How the matmuls multiply (kernels.h): fp32, or bf16 operands with fp32
  // sums (tensor cores on CUDA).
  MatmulMath matmul = MatmulMath::kFp32;
};

// Errors: InvalidArgument naming the bad field (sizes are bounded: channels
// and context 2^16, layers 2^16, vocab 2^24).
Status ValidateConfig(const Config& config);
// InvalidArgument naming the field where a valid config's shape is past
// what `device`'s kernels take (CUDA: kCudaMaxContext and
// kCudaMaxHeadSize, kernels.h; the CPU
// kernels take every valid shape), so a run refuses it before it trains
// rather than stopping at the first attention.
Status ValidateConfigFor(const Config& config, client::DeviceKind device);
// The units to register with the engine (names and tensor shapes).
std::vector<engine::UnitSpec> UnitSpecs(const Config& config);
// Parameters of a valid config, computed without building its units.
uint64_t ParameterCount(const Config& config);
// Bytes one rank's activations, scratch and unit buffers take on its device
// for micro-batch `batch` (what Gpt::Create and a step allocate), for a
// valid config; saturates at UINT64_MAX.
uint64_t ActivationBytes(const Config& config, int batch);
// GPT-2 initialisation of one unit, flat in `layout` order (layout.numel
// floats): N(0, 0.02) weights, residual projections scaled by 1/sqrt(2L),
// zero biases, unit layernorm weights. Deterministic in (seed, unit).
void InitUnit(const Config& config, int unit, uint64_t seed, const engine::UnitLayout& layout,
              std::span<float> flat);

// Where the model's unit weights come from and where its grads go. The
// runner (client::Stage3Runner) and an in-memory store both implement it.
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // The unit's bf16 params (padded, in layout order) on the device.
  virtual Result<const bf16*> Acquire(int unit) = 0;
  virtual Status Release(int unit) = 0;
  // A zeroed bf16 device buffer of the unit's padded size.
  virtual Result<bf16*> GradBuffer(int unit) = 0;
  virtual Status PushGrads(int unit) = 0;
};

// Adapts anything with the four methods above (the Stage3Runner).
template <typename T>
class SourceOf final : public WeightSource {
 public:
  explicit SourceOf(T& target) : t_(target) {}
  Result<const bf16*> Acquire(int unit) override { return t_.Acquire(unit); }
  Status Release(int unit) override { return t_.Release(unit); }
  Result<bf16*> GradBuffer(int unit) override { return t_.GradBuffer(unit); }
  Status PushGrads(int unit) override { return t_.PushGrads(unit); }

 private:
  T& t_;
};

class Gpt {
 public:
  // `layouts` are the engine's layouts of UnitSpecs(config), in order;
  // `batch` is the micro-batch of this rank (sequences of context tokens).
  // Activations live on `device` (fp32). Errors: InvalidArgument, the
  // device's (ResourceExhausted), Unavailable (no CUDA kernels in the build).
  static Result<std::unique_ptr<Gpt>> Create(const Config& config, int batch,
                                             client::Device& device,
                                             std::vector<engine::UnitLayout> layouts);
  ~Gpt();
  Gpt(const Gpt&) = delete;
  Gpt& operator=(const Gpt&) = delete;

  // One micro-step, forward and backward: `tokens` (host) holds batch rows of
  // context + 1 byte tokens; inputs are a row's first context tokens, targets
  // its last. Units are acquired in forward order, then in reverse order for
  // the backward (the head stays held from one into the other); each unit's
  // grads are pushed when its backward ends. Grads are d(mean loss)/dw * grad_scale (1 / (ranks x
  // accumulation) makes a step's grads the mean over all its tokens). Returns the mean loss.
  Result<float> TrainMicroStep(WeightSource& source, const int32_t* tokens, float grad_scale);
  // Forward only: the mean loss.
  Result<float> Loss(WeightSource& source, const int32_t* tokens);

  // For the finite-difference check: loss and fp32 grads with fp32 weights
  // given per unit (layout.numel floats each, host memory); no bf16 anywhere.
  Result<float> LossAndGrads(const std::vector<std::vector<float>>& weights, const int32_t* tokens,
                             std::vector<std::vector<float>>* grads);

  const Config& config() const;
  int batch() const;

  struct Impl;

 private:
  explicit Gpt(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ztier::gpt

#endif  // ZTIER_EXAMPLES_GPT_GPT_H_
