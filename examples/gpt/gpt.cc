// The GPT example model (see gpt.h): unit specs, GPT-2 initialisation, and
// the forward and backward passes over a WeightSource.
//
// One core runs the model on fp32 weights and fp32 grads. It reaches units
// through a UnitIo: the training path (TrainMicroStep, Loss) adapts a
// WeightSource, converting each acquired bf16 unit to fp32 into a scratch
// buffer and rounding each unit's fp32 grads to bf16 once into the source's
// grad buffer; the check path (LossAndGrads) copies fp32 host weights in
// and fp32 grads out. Both paths run the same kernels in the same order.
//
// Acquire order of a training micro-step (U = L + 2 units, H = U - 1 the
// head): 0, 1 .. L, H (and 0 again beside H when the head is tied), then
// the backward in reverse: the head stays held from its forward into its
// backward, then L .. 1, then 0. Every acquire is released on every path,
// errors included (a Held guard releases what it holds when it goes out of
// scope). Grads of a unit are pushed once, when its backward ends; a tied
// head's wte grads wait in an fp32 scratch for the embedding's backward and
// are summed with it in fp32 before the single rounding to bf16.
//
// Activations (fp32, on the device, one allocation of MemoryPurpose kOther):
// the residual stream entering each block and leaving the last one, always;
// every block's intermediate activations (llm.c's ln1 .. fcproj) without
// checkpointing, or one block's worth, recomputed in the backward from the
// block's saved input, with it. Both give the same bits on one backend.
//
// Thread safety: a Gpt is used by one thread. Failure: see gpt.h; the
// kernels themselves do not fail (CUDA errors surface at the next
// synchronisation as the device's error).
#include "examples/gpt/gpt.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <numbers>
#include <utility>

namespace ztier::gpt {
namespace {

using client::Device;
using client::MemoryPurpose;
using client::Stream;

// Tensor indices within each unit, in UnitSpecs order.
enum EmbedTensor : int { kWte = 0, kWpe };
enum BlockTensor : int {
  kLn1Weight = 0,
  kLn1Bias,
  kQkvWeight,
  kQkvBias,
  kAttnProjWeight,
  kAttnProjBias,
  kLn2Weight,
  kLn2Bias,
  kFcWeight,
  kFcBias,
  kMlpProjWeight,
  kMlpProjBias,
};
enum HeadTensor : int { kLnfWeight = 0, kLnfBias, kLmHead };

constexpr double kInitStd = 0.02;

uint64_t Elements(const engine::TensorSpec& tensor) {
  uint64_t n = 1;
  for (int64_t d : tensor.shape) n *= static_cast<uint64_t>(d);
  return n;
}

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// splitmix64 (Steele, Lea, Flood 2014): a 64-bit state advanced by the
// golden-ratio increment and finalised by two xor-shift-multiplies.
uint64_t SplitMix64(uint64_t* state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Standard normal samples from splitmix64 by the Box-Muller transform, in
// double precision, both outputs of each pair used. Spelled out (rather than
// std::normal_distribution, whose algorithm is the library's choice) so the
// same (seed, unit) gives the same weights with any standard library.
class NormalStream {
 public:
  explicit NormalStream(uint64_t state) : state_(state) {}
  double Next() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    constexpr double kTwoPow53 = 9007199254740992.0;
    // u1 in (0, 1] (log(u1) finite), u2 in [0, 1).
    const double u1 = static_cast<double>((SplitMix64(&state_) >> 11) + 1) / kTwoPow53;
    const double u2 = static_cast<double>(SplitMix64(&state_) >> 11) / kTwoPow53;
    const double r = std::sqrt(-2.0 * std::log(u1));
    const double angle = 2.0 * std::numbers::pi * u2;
    spare_ = r * std::sin(angle);
    has_spare_ = true;
    return r * std::cos(angle);
  }

 private:
  uint64_t state_;
  double spare_ = 0.0;
  bool has_spare_ = false;
};

// Device memory owned by one object; freed on destruction.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  DeviceMemory(Device* device, void* ptr) : device_(device), ptr_(ptr) {}
  DeviceMemory(DeviceMemory&& other) noexcept
      : device_(other.device_), ptr_(std::exchange(other.ptr_, nullptr)) {}
  DeviceMemory& operator=(DeviceMemory&& other) noexcept {
    if (this != &other) {
      Reset();
      device_ = other.device_;
      ptr_ = std::exchange(other.ptr_, nullptr);
    }
    return *this;
  }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory() { Reset(); }

  void* get() const { return ptr_; }

 private:
  void Reset() {
    if (ptr_ != nullptr) device_->Free(ptr_);
    ptr_ = nullptr;
  }
  Device* device_ = nullptr;
  void* ptr_ = nullptr;
};

// Carves one allocation into named fp32 arrays, each 256 B aligned.
class Planner {
 public:
  void Add(float** slot, size_t floats) {
    slots_.push_back({slot, offset_});
    offset_ += (floats + kAlignFloats - 1) / kAlignFloats * kAlignFloats;
  }
  size_t bytes() const { return offset_ * sizeof(float); }
  void Assign(void* base) const {
    for (const auto& [slot, offset] : slots_) *slot = static_cast<float*>(base) + offset;
  }

 private:
  static constexpr size_t kAlignFloats = 64;
  std::vector<std::pair<float**, size_t>> slots_;
  size_t offset_ = 0;
};

// How the core reaches units: fp32 weights in, fp32 grads out.
class UnitIo {
 public:
  virtual ~UnitIo() = default;
  // Holds `unit` until Release; when `dst` is not null, also writes the
  // unit's fp32 weights (numel floats, device memory) to it.
  virtual Status Acquire(int unit, float* dst) = 0;
  virtual Status Release(int unit) = 0;
  // Hands over the unit's fp32 grads (numel floats, device memory).
  virtual Status PushGrads(int unit, const float* grads) = 0;
};

// A held unit, released when the guard goes out of scope unless released
// explicitly (which reports the release's error).
class Held {
 public:
  Held(UnitIo& io, int unit) : io_(io), unit_(unit) {}
  Held(const Held&) = delete;
  Held& operator=(const Held&) = delete;
  ~Held() {
    if (held_) static_cast<void>(io_.Release(unit_));
  }
  Status Acquire(float* dst) {
    ZT_CHECK(!held_);
    ZT_RETURN_IF_ERROR(io_.Acquire(unit_, dst));
    held_ = true;
    return Status::Ok();
  }
  Status Release() {
    if (!held_) return Status::Ok();
    held_ = false;
    return io_.Release(unit_);
  }

 private:
  UnitIo& io_;
  int unit_;
  bool held_ = false;
};

std::string UnitContext(const std::vector<engine::UnitSpec>& specs, int unit) {
  return StrCat("unit ", unit, " '", specs[unit].name, "'");
}

// The training path: bf16 units of a WeightSource.
class SourceIo final : public UnitIo {
 public:
  SourceIo(WeightSource& source, Kernels& kernels, const std::vector<engine::UnitSpec>& specs,
           const std::vector<engine::UnitLayout>& layouts)
      : source_(source), kernels_(kernels), specs_(specs), layouts_(layouts) {}

  Status Acquire(int unit, float* dst) override {
    Result<const bf16*> params = source_.Acquire(unit);
    if (!params.ok()) return params.status().Annotate(StrCat("acquiring ", Context(unit)));
    if (dst != nullptr) kernels_.ToFloat(dst, *params, layouts_[unit].numel);
    return Status::Ok();
  }
  Status Release(int unit) override {
    return source_.Release(unit).Annotate(StrCat("releasing ", Context(unit)));
  }
  Status PushGrads(int unit, const float* grads) override {
    Result<bf16*> buffer = source_.GradBuffer(unit);
    if (!buffer.ok()) {
      return buffer.status().Annotate(StrCat("grad buffer of ", Context(unit)));
    }
    kernels_.ToBf16(*buffer, grads, layouts_[unit].numel);
    return source_.PushGrads(unit).Annotate(StrCat("pushing grads of ", Context(unit)));
  }

 private:
  std::string Context(int unit) const { return UnitContext(specs_, unit); }
  WeightSource& source_;
  Kernels& kernels_;
  const std::vector<engine::UnitSpec>& specs_;
  const std::vector<engine::UnitLayout>& layouts_;
};

// The check path: fp32 weights and grads in host vectors.
class HostFp32Io final : public UnitIo {
 public:
  HostFp32Io(Device& device, const std::vector<std::vector<float>>& weights,
             std::vector<std::vector<float>>* grads, const std::vector<engine::UnitLayout>& layouts)
      : device_(device), weights_(weights), grads_(grads), layouts_(layouts) {}

  Status Acquire(int unit, float* dst) override {
    if (dst == nullptr) return Status::Ok();
    return device_.CopyToDevice(dst, weights_[unit].data(), Bytes(unit), Stream::kCompute);
  }
  Status Release(int) override { return Status::Ok(); }
  Status PushGrads(int unit, const float* grads) override {
    (*grads_)[unit].assign(layouts_[unit].numel, 0.0f);
    return device_.CopyToHost((*grads_)[unit].data(), grads, Bytes(unit), Stream::kCompute);
  }

 private:
  size_t Bytes(int unit) const { return layouts_[unit].numel * sizeof(float); }
  Device& device_;
  const std::vector<std::vector<float>>& weights_;
  std::vector<std::vector<float>>* grads_;
  const std::vector<engine::UnitLayout>& layouts_;
};

// One block's intermediate activations (llm.c's names). The block's input
// and output are the residual stream buffers around it.
struct BlockActs {
  float* ln1 = nullptr;        // [N, C]
  float* ln1_mean = nullptr;   // [N]
  float* ln1_rstd = nullptr;   // [N]
  float* qkv = nullptr;        // [N, 3C]
  float* att = nullptr;        // [B, NH, T, T]
  float* atty = nullptr;       // [N, C]
  float* attproj = nullptr;    // [N, C]
  float* residual2 = nullptr;  // [N, C]
  float* ln2 = nullptr;        // [N, C]
  float* ln2_mean = nullptr;   // [N]
  float* ln2_rstd = nullptr;   // [N]
  float* fch = nullptr;        // [N, 4C]
  float* fch_gelu = nullptr;   // [N, 4C]
  float* fcproj = nullptr;     // [N, C]
};

enum class Pass : uint8_t { kLoss, kTrain };

Status CheckLayouts(const std::vector<engine::UnitSpec>& specs,
                    const std::vector<engine::UnitLayout>& layouts) {
  if (layouts.size() != specs.size()) {
    return Status::InvalidArgument(StrCat("got ", layouts.size(), " unit layouts for a model of ",
                                          specs.size(), " units (embed, ", specs.size() - 2,
                                          " blocks, head); pass the engine's layouts of "
                                          "UnitSpecs(config), in order"));
  }
  for (size_t u = 0; u < specs.size(); ++u) {
    const engine::UnitLayout& layout = layouts[u];
    const std::vector<engine::TensorSpec>& tensors = specs[u].tensors;
    if (layout.offsets.size() != tensors.size()) {
      return Status::InvalidArgument(StrCat("layout of unit ", u, " '", specs[u].name, "' has ",
                                            layout.offsets.size(), " tensor offsets, the unit has ",
                                            tensors.size(), " tensors"));
    }
    uint64_t offset = 0;
    for (size_t k = 0; k < tensors.size(); ++k) {
      if (layout.offsets[k] != offset) {
        return Status::InvalidArgument(StrCat("layout of unit ", u, " '", specs[u].name,
                                              "': tensor '", tensors[k].name, "' at offset ",
                                              layout.offsets[k], ", expected ", offset));
      }
      offset += Elements(tensors[k]);
    }
    if (layout.numel != offset || layout.padded < layout.numel) {
      return Status::InvalidArgument(StrCat("layout of unit ", u, " '", specs[u].name, "': numel ",
                                            layout.numel, " padded ", layout.padded,
                                            ", the unit has ", offset, " elements"));
    }
  }
  return Status::Ok();
}

}  // namespace

// ------------------------------------------------------------------ specs --

Status ValidateConfig(const Config& config) {
  if (config.vocab <= 0) {
    return Status::InvalidArgument(StrCat("config.vocab must be > 0, got ", config.vocab));
  }
  if (config.context <= 0) {
    return Status::InvalidArgument(StrCat("config.context must be > 0, got ", config.context));
  }
  if (config.channels <= 0) {
    return Status::InvalidArgument(StrCat("config.channels must be > 0, got ", config.channels));
  }
  if (config.layers < 1) {
    return Status::InvalidArgument(StrCat("config.layers must be >= 1, got ", config.layers));
  }
  if (config.heads < 1) {
    return Status::InvalidArgument(StrCat("config.heads must be >= 1, got ", config.heads));
  }
  if (config.channels % config.heads != 0) {
    return Status::InvalidArgument(StrCat("config.heads (", config.heads,
                                          ") must divide config.channels (", config.channels, ")"));
  }
  // Sizes stay far inside 64-bit arithmetic (and the kernels' int indexing
  // of [4C] and [V] rows) whatever the memory of the machine.
  constexpr int kMaxDim = 1 << 16, kMaxLayers = 1 << 16, kMaxVocab = 1 << 24;
  if (config.channels > kMaxDim || config.context > kMaxDim) {
    return Status::InvalidArgument(StrCat("config.channels (", config.channels,
                                          ") and config.context (", config.context,
                                          ") must be at most ", kMaxDim));
  }
  if (config.layers > kMaxLayers) {
    return Status::InvalidArgument(
        StrCat("config.layers ", config.layers, " is more than ", kMaxLayers));
  }
  if (config.vocab > kMaxVocab) {
    return Status::InvalidArgument(
        StrCat("config.vocab ", config.vocab, " is more than ", kMaxVocab));
  }
  return Status::Ok();
}

std::vector<engine::UnitSpec> UnitSpecs(const Config& config) {
  const int64_t V = config.vocab;
  const int64_t T = config.context;
  const int64_t C = config.channels;
  std::vector<engine::UnitSpec> units;
  units.push_back({"embed", {{"wte", {V, C}}, {"wpe", {T, C}}}});
  for (int l = 0; l < config.layers; ++l) {
    const std::string p = StrCat("h.", l, ".");
    units.push_back({StrCat("h.", l),
                     {
                         {p + "ln_1.weight", {C}},
                         {p + "ln_1.bias", {C}},
                         {p + "attn.qkv.weight", {3 * C, C}},
                         {p + "attn.qkv.bias", {3 * C}},
                         {p + "attn.proj.weight", {C, C}},
                         {p + "attn.proj.bias", {C}},
                         {p + "ln_2.weight", {C}},
                         {p + "ln_2.bias", {C}},
                         {p + "mlp.fc.weight", {4 * C, C}},
                         {p + "mlp.fc.bias", {4 * C}},
                         {p + "mlp.proj.weight", {C, 4 * C}},
                         {p + "mlp.proj.bias", {C}},
                     }});
  }
  engine::UnitSpec head{"head", {{"ln_f.weight", {C}}, {"ln_f.bias", {C}}}};
  if (!config.tied_head) head.tensors.push_back({"lm_head.weight", {V, C}});
  units.push_back(std::move(head));
  return units;
}

uint64_t ParameterCount(const Config& config) {
  const uint64_t V = static_cast<uint64_t>(config.vocab);
  const uint64_t T = static_cast<uint64_t>(config.context);
  const uint64_t C = static_cast<uint64_t>(config.channels);
  const uint64_t block = 12 * C * C + 13 * C;  // the tensors of UnitSpecs' "h.l"
  return V * C + T * C + static_cast<uint64_t>(config.layers) * block + 2 * C +
         (config.tied_head ? 0 : V * C);
}

namespace {

// The largest matmul operand (inp, weight or dout) of a micro-batch, in
// elements: max(4C, V) x max(B T, C).
double MatmulOperandMax(const Config& config, int batch) {
  const double n = static_cast<double>(batch) * config.context;
  return std::max(4.0 * config.channels, static_cast<double>(config.vocab)) *
         std::max(n, static_cast<double>(config.channels));
}

}  // namespace

uint64_t ActivationBytes(const Config& config, int batch) {
  // Gpt::Impl::Allocate's plan, in floats (before its 256-byte alignment).
  const double B = batch, T = config.context, C = config.channels, V = config.vocab,
               L = config.layers, NH = config.heads;
  const double n = B * T, nc = n * C, scores = B * NH * T * T;
  const double per_block = 17 * nc + 4 * n + scores;
  const double acts = (config.checkpoint_activations ? 1 : L) * per_block;
  const double head = nc + 2 * n + 2 * n * V + n + 13 * nc + scores;
  const double unit = std::max(12 * C * C + 13 * C, V * C + T * C);
  const double floats = (L + 1) * nc + acts + head + 4 * unit + 2 * n;
  // bf16 matmuls: the kernels' three rounded operands.
  const double operands =
      config.matmul == MatmulMath::kBf16 ? 3 * 2 * MatmulOperandMax(config, batch) : 0;
  const double bytes = floats * 4 + operands;
  return bytes >= 1.8e19 ? UINT64_MAX : static_cast<uint64_t>(bytes);
}

// Each (seed, unit) seeds its own splitmix64 stream, and the unit's tensors
// draw from it in layout order: wte, wpe, lm_head and every weight matrix
// N(0, 0.02) (wpe too: nanoGPT's choice), the residual projections
// (attn.proj, mlp.proj) N(0, 0.02 / sqrt(2 L)), biases 0, layernorm weights 1.
void InitUnit(const Config& config, int unit, uint64_t seed, const engine::UnitLayout& layout,
              std::span<float> flat) {
  const std::vector<engine::UnitSpec> specs = UnitSpecs(config);
  ZT_CHECK_MSG(unit >= 0 && unit < static_cast<int>(specs.size()), "unit ", unit);
  const std::vector<engine::TensorSpec>& tensors = specs[unit].tensors;
  ZT_CHECK_MSG(layout.offsets.size() == tensors.size() && flat.size() >= layout.numel,
               "layout of unit ", unit, " does not match the config");
  uint64_t state = seed ^ (0xd1b54a32d192ed03ull * (static_cast<uint64_t>(unit) + 1));
  NormalStream normal(SplitMix64(&state));
  const double proj_std = kInitStd / std::sqrt(2.0 * config.layers);
  for (size_t k = 0; k < tensors.size(); ++k) {
    const std::string& name = tensors[k].name;
    const uint64_t n = Elements(tensors[k]);
    ZT_CHECK(layout.offsets[k] + n <= layout.numel);
    float* out = flat.data() + layout.offsets[k];
    if (EndsWith(name, ".bias")) {
      std::fill(out, out + n, 0.0f);
    } else if (tensors[k].shape.size() == 1) {  // ln_1, ln_2, ln_f weights
      std::fill(out, out + n, 1.0f);
    } else {
      const bool residual_proj =
          EndsWith(name, "attn.proj.weight") || EndsWith(name, "mlp.proj.weight");
      const double std_dev = residual_proj ? proj_std : kInitStd;
      for (uint64_t i = 0; i < n; ++i) out[i] = static_cast<float>(std_dev * normal.Next());
    }
  }
}

// ------------------------------------------------------------------ model --

struct Gpt::Impl {
  Config config;
  int batch = 0;
  Device* device = nullptr;
  std::vector<engine::UnitSpec> specs;
  std::vector<engine::UnitLayout> layouts;
  std::unique_ptr<Kernels> kernels;

  int B = 0, T = 0, C = 0, V = 0, L = 0, NH = 0, N = 0;

  DeviceMemory floats_memory;
  DeviceMemory tokens_memory;
  int32_t* inputs = nullptr;         // [N]
  int32_t* targets = nullptr;        // [N]
  std::vector<int32_t> host_tokens;  // inputs then targets, staged for the copy
  std::vector<float> host_losses;

  // residual[0] is the embedding's output, residual[l + 1] block l's.
  std::vector<float*> residual;
  // One per block, or a single one reused when checkpointing.
  std::vector<BlockActs> acts;
  float* lnf = nullptr;       // [N, C]
  float* lnf_mean = nullptr;  // [N]
  float* lnf_rstd = nullptr;  // [N]
  float* logits = nullptr;    // [N, V]
  float* losses = nullptr;    // [N]

  // Backward work buffers.
  float* dlogits = nullptr;    // [N, V]
  float* dresidual = nullptr;  // [N, C]: d loss / d residual stream
  float* dln = nullptr;        // [N, C]
  float* datty = nullptr;      // [N, C]
  float* dqkv = nullptr;       // [N, 3C]
  float* dfch = nullptr;       // [N, 4C]
  float* dfch_gelu = nullptr;  // [N, 4C]
  float* dscores = nullptr;    // [B, NH, T, T]

  // fp32 weights and grads of the unit being computed, and of the embed
  // unit when the head is tied (its wte is used beside the head's weights,
  // and its grads collect the head's contribution until its own backward).
  float* unit_weights = nullptr;
  float* unit_grads = nullptr;
  float* embed_weights = nullptr;
  float* embed_grads = nullptr;

  int head_unit() const { return L + 1; }
  static int BlockUnit(int layer) { return layer + 1; }
  size_t Numel(int unit) const { return layouts[unit].numel; }
  uint64_t Off(int unit, int tensor) const { return layouts[unit].offsets[tensor]; }
  float* WeightsOf(int unit) const {
    return unit == 0 && config.tied_head ? embed_weights : unit_weights;
  }
  float* GradsOf(int unit) const {
    return unit == 0 && config.tied_head ? embed_grads : unit_grads;
  }
  const BlockActs& ActsOf(int layer) const {
    return acts[config.checkpoint_activations ? 0 : layer];
  }

  Status Allocate();
  Status LoadTokens(const int32_t* tokens);
  Result<float> ReadLoss();
  void BlockForward(int layer, const float* w, const BlockActs& a);
  void BlockBackward(int layer, const float* w, float* dw, const BlockActs& a);
  Result<float> Run(UnitIo& io, const int32_t* tokens, Pass pass, float grad_scale);
};

Status Gpt::Impl::Allocate() {
  const size_t n = static_cast<size_t>(N);
  const size_t nc = n * C;
  const size_t scores = static_cast<size_t>(B) * NH * T * T;
  Planner plan;
  residual.assign(L + 1, nullptr);
  for (float*& r : residual) plan.Add(&r, nc);
  acts.assign(config.checkpoint_activations ? 1 : L, BlockActs{});
  for (BlockActs& a : acts) {
    plan.Add(&a.ln1, nc);
    plan.Add(&a.ln1_mean, n);
    plan.Add(&a.ln1_rstd, n);
    plan.Add(&a.qkv, 3 * nc);
    plan.Add(&a.att, scores);
    plan.Add(&a.atty, nc);
    plan.Add(&a.attproj, nc);
    plan.Add(&a.residual2, nc);
    plan.Add(&a.ln2, nc);
    plan.Add(&a.ln2_mean, n);
    plan.Add(&a.ln2_rstd, n);
    plan.Add(&a.fch, 4 * nc);
    plan.Add(&a.fch_gelu, 4 * nc);
    plan.Add(&a.fcproj, nc);
  }
  plan.Add(&lnf, nc);
  plan.Add(&lnf_mean, n);
  plan.Add(&lnf_rstd, n);
  plan.Add(&logits, n * V);
  plan.Add(&losses, n);
  plan.Add(&dlogits, n * V);
  plan.Add(&dresidual, nc);
  plan.Add(&dln, nc);
  plan.Add(&datty, nc);
  plan.Add(&dqkv, 3 * nc);
  plan.Add(&dfch, 4 * nc);
  plan.Add(&dfch_gelu, 4 * nc);
  plan.Add(&dscores, scores);
  size_t unit_max = 0;
  for (int u = 0; u < static_cast<int>(layouts.size()); ++u) {
    if (u == 0 && config.tied_head) continue;
    unit_max = std::max(unit_max, Numel(u));
  }
  plan.Add(&unit_weights, unit_max);
  plan.Add(&unit_grads, unit_max);
  if (config.tied_head) {
    plan.Add(&embed_weights, Numel(0));
    plan.Add(&embed_grads, Numel(0));
  }

  Result<void*> floats = device->Allocate(plan.bytes(), MemoryPurpose::kOther);
  if (!floats.ok()) {
    return floats.status().Annotate(
        StrCat("GPT activations and scratch (", plan.bytes(), " bytes for batch ", B, ")"));
  }
  floats_memory = DeviceMemory(device, *floats);
  plan.Assign(*floats);

  Result<void*> tokens = device->Allocate(2 * n * sizeof(int32_t), MemoryPurpose::kOther);
  if (!tokens.ok()) return tokens.status().Annotate("GPT token buffers");
  tokens_memory = DeviceMemory(device, *tokens);
  inputs = static_cast<int32_t*>(*tokens);
  targets = inputs + n;
  host_tokens.resize(2 * n);
  host_losses.resize(n);
  return Status::Ok();
}

Status Gpt::Impl::LoadTokens(const int32_t* tokens) {
  if (tokens == nullptr) return Status::InvalidArgument("tokens is null");
  for (int b = 0; b < B; ++b) {
    const int32_t* row = tokens + static_cast<size_t>(b) * (T + 1);
    for (int t = 0; t <= T; ++t) {
      if (row[t] < 0 || row[t] >= V) {
        return Status::InvalidArgument(StrCat("token ", row[t], " at row ", b, ", position ", t,
                                              " is outside the vocabulary [0, ", V, ")"));
      }
    }
    for (int t = 0; t < T; ++t) {
      host_tokens[static_cast<size_t>(b) * T + t] = row[t];
      host_tokens[static_cast<size_t>(N) + static_cast<size_t>(b) * T + t] = row[t + 1];
    }
  }
  return device->CopyToDevice(inputs, host_tokens.data(), host_tokens.size() * sizeof(int32_t),
                              Stream::kCompute);
}

Result<float> Gpt::Impl::ReadLoss() {
  ZT_RETURN_IF_ERROR(device->CopyToHost(host_losses.data(), losses,
                                        host_losses.size() * sizeof(float), Stream::kCompute));
  ZT_RETURN_IF_ERROR(device->Synchronize(Stream::kCompute));
  double sum = 0.0;
  for (float l : host_losses) sum += l;
  return static_cast<float>(sum / N);
}

void Gpt::Impl::BlockForward(int layer, const float* w, const BlockActs& a) {
  const int u = BlockUnit(layer);
  const float* in = residual[layer];
  float* out = residual[layer + 1];
  const size_t nc = static_cast<size_t>(N) * C;
  Kernels& k = *kernels;
  k.LayerNorm(a.ln1, a.ln1_mean, a.ln1_rstd, in, w + Off(u, kLn1Weight), w + Off(u, kLn1Bias), N,
              C);
  k.Matmul(a.qkv, a.ln1, w + Off(u, kQkvWeight), w + Off(u, kQkvBias), N, C, 3 * C);
  k.Attention(a.atty, a.att, a.qkv, B, T, C, NH);
  k.Matmul(a.attproj, a.atty, w + Off(u, kAttnProjWeight), w + Off(u, kAttnProjBias), N, C, C);
  k.Residual(a.residual2, in, a.attproj, nc);
  k.LayerNorm(a.ln2, a.ln2_mean, a.ln2_rstd, a.residual2, w + Off(u, kLn2Weight),
              w + Off(u, kLn2Bias), N, C);
  k.Matmul(a.fch, a.ln2, w + Off(u, kFcWeight), w + Off(u, kFcBias), N, C, 4 * C);
  k.Gelu(a.fch_gelu, a.fch, 4 * nc);
  k.Matmul(a.fcproj, a.fch_gelu, w + Off(u, kMlpProjWeight), w + Off(u, kMlpProjBias), N, 4 * C, C);
  k.Residual(out, a.residual2, a.fcproj, nc);
}

// On entry `dresidual` holds d loss / d (block output); on exit d loss /
// d (block input). `dw` (the unit's grads) is accumulated into.
void Gpt::Impl::BlockBackward(int layer, const float* w, float* dw, const BlockActs& a) {
  const int u = BlockUnit(layer);
  const float* in = residual[layer];
  const size_t nc = static_cast<size_t>(N) * C;
  Kernels& k = *kernels;
  // out = residual2 + mlp.proj(gelu(fc(ln_2(residual2)))): dresidual is
  // also d fcproj.
  k.Zero(dfch_gelu, 4 * nc);
  k.MatmulBackward(dfch_gelu, dw + Off(u, kMlpProjWeight), dw + Off(u, kMlpProjBias), dresidual,
                   a.fch_gelu, w + Off(u, kMlpProjWeight), N, 4 * C, C);
  k.Zero(dfch, 4 * nc);
  k.GeluBackward(dfch, a.fch, dfch_gelu, 4 * nc);
  k.Zero(dln, nc);
  k.MatmulBackward(dln, dw + Off(u, kFcWeight), dw + Off(u, kFcBias), dfch, a.ln2,
                   w + Off(u, kFcWeight), N, C, 4 * C);
  // dresidual becomes d residual2 (the skip path plus the layernorm's).
  k.LayerNormBackward(dresidual, dw + Off(u, kLn2Weight), dw + Off(u, kLn2Bias), dln, a.residual2,
                      w + Off(u, kLn2Weight), a.ln2_mean, a.ln2_rstd, N, C);
  // residual2 = in + attn.proj(attention(qkv(ln_1(in)))): dresidual is also
  // d attproj.
  k.Zero(datty, nc);
  k.MatmulBackward(datty, dw + Off(u, kAttnProjWeight), dw + Off(u, kAttnProjBias), dresidual,
                   a.atty, w + Off(u, kAttnProjWeight), N, C, C);
  k.Zero(dqkv, 3 * nc);
  k.AttentionBackward(dqkv, dscores, datty, a.qkv, a.att, B, T, C, NH);
  k.Zero(dln, nc);
  k.MatmulBackward(dln, dw + Off(u, kQkvWeight), dw + Off(u, kQkvBias), dqkv, a.ln1,
                   w + Off(u, kQkvWeight), N, C, 3 * C);
  k.LayerNormBackward(dresidual, dw + Off(u, kLn1Weight), dw + Off(u, kLn1Bias), dln, in,
                      w + Off(u, kLn1Weight), a.ln1_mean, a.ln1_rstd, N, C);
}

Result<float> Gpt::Impl::Run(UnitIo& io, const int32_t* tokens, Pass pass, float grad_scale) {
  Kernels& k = *kernels;
  const size_t nc = static_cast<size_t>(N) * C;
  ZT_RETURN_IF_ERROR(LoadTokens(tokens));

  // ---- forward
  {
    Held embed(io, 0);
    float* w = WeightsOf(0);
    ZT_RETURN_IF_ERROR(embed.Acquire(w));
    k.Encoder(residual[0], inputs, w + Off(0, kWte), w + Off(0, kWpe), B, T, C);
    ZT_RETURN_IF_ERROR(embed.Release());
  }
  for (int l = 0; l < L; ++l) {
    Held block(io, BlockUnit(l));
    ZT_RETURN_IF_ERROR(block.Acquire(unit_weights));
    BlockForward(l, unit_weights, ActsOf(l));
    ZT_RETURN_IF_ERROR(block.Release());
  }
  const int h = head_unit();
  Held head(io, h);
  ZT_RETURN_IF_ERROR(head.Acquire(unit_weights));
  Held tied_embed(io, 0);
  if (config.tied_head) ZT_RETURN_IF_ERROR(tied_embed.Acquire(embed_weights));
  const float* hw = unit_weights;
  const float* out_weight = config.tied_head ? embed_weights + Off(0, kWte) : hw + Off(h, kLmHead);
  k.LayerNorm(lnf, lnf_mean, lnf_rstd, residual[L], hw + Off(h, kLnfWeight), hw + Off(h, kLnfBias),
              N, C);
  k.Matmul(logits, lnf, out_weight, nullptr, N, C, V);
  // d mean loss / d loss of a row is 1 / N.
  k.CrossEntropy(losses, pass == Pass::kTrain ? dlogits : nullptr, logits, targets, N, V,
                 grad_scale / static_cast<float>(N));
  ZT_ASSIGN_OR_RETURN(const float loss, ReadLoss());
  if (pass == Pass::kLoss) {
    ZT_RETURN_IF_ERROR(tied_embed.Release());
    ZT_RETURN_IF_ERROR(head.Release());
    return loss;
  }

  // ---- backward: the head
  float* hg = unit_grads;
  k.Zero(hg, Numel(h));
  if (config.tied_head) k.Zero(embed_grads, Numel(0));
  float* dout_weight = config.tied_head ? embed_grads + Off(0, kWte) : hg + Off(h, kLmHead);
  k.Zero(dln, nc);
  k.MatmulBackward(dln, dout_weight, nullptr, dlogits, lnf, out_weight, N, C, V);
  k.Zero(dresidual, nc);
  k.LayerNormBackward(dresidual, hg + Off(h, kLnfWeight), hg + Off(h, kLnfBias), dln, residual[L],
                      hw + Off(h, kLnfWeight), lnf_mean, lnf_rstd, N, C);
  ZT_RETURN_IF_ERROR(tied_embed.Release());
  ZT_RETURN_IF_ERROR(io.PushGrads(h, hg));
  ZT_RETURN_IF_ERROR(head.Release());

  // ---- backward: the blocks, last first
  for (int l = L - 1; l >= 0; --l) {
    const int u = BlockUnit(l);
    Held block(io, u);
    ZT_RETURN_IF_ERROR(block.Acquire(unit_weights));
    // With checkpointing the shared activations still hold the last block's
    // from the forward pass; every other block recomputes from its input.
    if (config.checkpoint_activations && l != L - 1) BlockForward(l, unit_weights, acts[0]);
    k.Zero(unit_grads, Numel(u));
    BlockBackward(l, unit_weights, unit_grads, ActsOf(l));
    ZT_RETURN_IF_ERROR(io.PushGrads(u, unit_grads));
    ZT_RETURN_IF_ERROR(block.Release());
  }

  // ---- backward: the embedding. Its values are not needed, but it is held
  // like every other unit while its grads are computed.
  Held embed(io, 0);
  ZT_RETURN_IF_ERROR(embed.Acquire(nullptr));
  float* eg = GradsOf(0);
  if (!config.tied_head) k.Zero(eg, Numel(0));  // else it holds the head's wte grads
  k.EncoderBackward(eg + Off(0, kWte), eg + Off(0, kWpe), dresidual, inputs, B, T, C);
  ZT_RETURN_IF_ERROR(io.PushGrads(0, eg));
  ZT_RETURN_IF_ERROR(embed.Release());
  return loss;
}

Status ValidateConfigFor(const Config& config, client::DeviceKind device) {
  ZT_RETURN_IF_ERROR(ValidateConfig(config));
  if (device != client::DeviceKind::kCuda) return Status::Ok();
  if (config.context > kCudaMaxContext) {
    return Status::InvalidArgument(StrCat("config.context ", config.context,
                                          " is past the most the CUDA kernels take (",
                                          kCudaMaxContext, ")"));
  }
  if (config.channels / config.heads > kCudaMaxHeadSize) {
    return Status::InvalidArgument(
        StrCat("config.channels / config.heads (a head's size, ", config.channels / config.heads,
               ") is past the most the CUDA kernels take (", kCudaMaxHeadSize,
               "): raise config.heads or lower config.channels"));
  }
  return Status::Ok();
}

Result<std::unique_ptr<Gpt>> Gpt::Create(const Config& config, int batch, client::Device& device,
                                         std::vector<engine::UnitLayout> layouts) {
  ZT_RETURN_IF_ERROR(ValidateConfigFor(config, device.kind()));
  if (batch < 1) return Status::InvalidArgument(StrCat("batch must be >= 1, got ", batch));
  // The kernels count rows and attention scores (B x NH x T x T, the
  // largest of their task counts) in int. Counted in double: at the largest
  // dimensions the product passes 2^63.
  const int64_t rows = int64_t{batch} * config.context;
  if (static_cast<double>(rows) * config.heads * config.context > INT_MAX) {
    return Status::InvalidArgument(StrCat("batch ", batch, " x heads ", config.heads,
                                          " x context^2 ", config.context,
                                          "^2 attention scores exceed the kernels' int range; "
                                          "lower the batch or the context"));
  }
  std::vector<engine::UnitSpec> specs = UnitSpecs(config);
  ZT_RETURN_IF_ERROR(CheckLayouts(specs, layouts));

  auto impl = std::make_unique<Impl>();
  impl->config = config;
  impl->batch = batch;
  impl->device = &device;
  impl->specs = std::move(specs);
  impl->layouts = std::move(layouts);
  impl->B = batch;
  impl->T = config.context;
  impl->C = config.channels;
  impl->V = config.vocab;
  impl->L = config.layers;
  impl->NH = config.heads;
  impl->N = static_cast<int>(rows);
  switch (device.kind()) {
    case client::DeviceKind::kHost:
      impl->kernels = MakeCpuKernels();
      break;
    case client::DeviceKind::kCuda: {
      ZT_ASSIGN_OR_RETURN(impl->kernels, MakeCudaKernels(device));
      break;
    }
  }
  if (impl->kernels == nullptr) {
    return Status::InvalidArgument(StrCat("no GPT kernels for device '", device.name(), "'"));
  }
  ZT_RETURN_IF_ERROR(impl->kernels->SetMatmul(
      config.matmul, static_cast<size_t>(MatmulOperandMax(config, batch))));
  ZT_RETURN_IF_ERROR(impl->Allocate());
  return std::unique_ptr<Gpt>(new Gpt(std::move(impl)));
}

Gpt::Gpt(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

// Members are destroyed in reverse order: the device memory is freed before
// the kernels (which may own streams or handles of their own) go.
Gpt::~Gpt() = default;

Result<float> Gpt::TrainMicroStep(WeightSource& source, const int32_t* tokens, float grad_scale) {
  if (!std::isfinite(grad_scale)) {
    return Status::InvalidArgument(StrCat("grad_scale must be finite, got ", grad_scale));
  }
  SourceIo io(source, *impl_->kernels, impl_->specs, impl_->layouts);
  return impl_->Run(io, tokens, Pass::kTrain, grad_scale);
}

Result<float> Gpt::Loss(WeightSource& source, const int32_t* tokens) {
  SourceIo io(source, *impl_->kernels, impl_->specs, impl_->layouts);
  return impl_->Run(io, tokens, Pass::kLoss, 1.0f);
}

Result<float> Gpt::LossAndGrads(const std::vector<std::vector<float>>& weights,
                                const int32_t* tokens, std::vector<std::vector<float>>* grads) {
  if (grads == nullptr) return Status::InvalidArgument("grads is null");
  const std::vector<engine::UnitLayout>& layouts = impl_->layouts;
  if (weights.size() != layouts.size()) {
    return Status::InvalidArgument(
        StrCat("got weights for ", weights.size(), " units, the model has ", layouts.size()));
  }
  for (size_t u = 0; u < layouts.size(); ++u) {
    if (weights[u].size() != layouts[u].numel) {
      return Status::InvalidArgument(StrCat("weights of unit ", u, " '", impl_->specs[u].name,
                                            "' have ", weights[u].size(), " floats, expected ",
                                            layouts[u].numel));
    }
  }
  grads->assign(layouts.size(), {});
  HostFp32Io io(*impl_->device, weights, grads, layouts);
  ZT_ASSIGN_OR_RETURN(const float loss, impl_->Run(io, tokens, Pass::kTrain, 1.0f));
  ZT_RETURN_IF_ERROR(impl_->device->Synchronize(Stream::kCompute));
  return loss;
}

const Config& Gpt::config() const { return impl_->config; }
int Gpt::batch() const { return impl_->batch; }

}  // namespace ztier::gpt
