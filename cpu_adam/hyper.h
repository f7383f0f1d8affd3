// ztier cpu_adam: the optimizer's hyper-parameters, part of the public
// header cpu_adam/adamw.h, kept in a file of their own without dependencies
// so the engine's wire types (engine/wire_types.h) can carry them to a
// client that does not link the kernels. Plain values; no functions.
#ifndef ZTIER_CPU_ADAM_HYPER_H_
#define ZTIER_CPU_ADAM_HYPER_H_

#include <cstdint>

namespace ztier::cpu_adam {

enum class Mode : uint8_t {
  kAdamW,  // decoupled weight decay (p *= 1 - lr * wd)
  kAdam,   // L2: weight_decay * p added to the grad
};
enum class BiasCorrection : uint8_t { kOn, kOff };

// The betas are double, as PyTorch's are (Python floats): 1 - beta and
// beta^step are taken from them, and a float beta2 of 0.99999 would make
// 1 - beta2 0.14% off. The kernels still apply each constant in float.
struct Hyper {
  float lr = 1e-3f;
  double beta1 = 0.9;
  double beta2 = 0.999;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  Mode mode = Mode::kAdamW;
  BiasCorrection bias_correction = BiasCorrection::kOn;
};

}  // namespace ztier::cpu_adam

#endif  // ZTIER_CPU_ADAM_HYPER_H_
