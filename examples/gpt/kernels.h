// The GPT example's kernels, one interface with two backends: CPU (plain C++
// parallelised with oneTBB; the reference) and CUDA (cuBLAS for the matmuls).
// Shapes follow llm.c: N = B*T rows, C channels, OC output channels, NH heads,
// V vocabulary. Activations, grads and weights are fp32 in device memory (the
// model converts a unit's bf16 params to fp32 once per acquire). Every
// pointer is a device pointer of the backend's Device; kernels are queued on
// that device's compute stream.
//
// Contract shared by both backends:
//   - forward kernels overwrite their outputs;
//   - backward kernels ACCUMULATE (+=) into every gradient output (dinp,
//     dweight, dbias, ...), so the caller zeroes them first;
//   - the CPU kernels are deterministic: the same inputs give the same bits
//     whatever the thread count or scheduling (work is split over outputs,
//     never reduced across threads in a varying order).
//
// Thread safety: a Kernels object is used by one thread (its rank's loop).
#ifndef ZTIER_EXAMPLES_GPT_KERNELS_H_
#define ZTIER_EXAMPLES_GPT_KERNELS_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "client/ztier.h"
#include "common/bf16.h"
#include "common/status.h"

namespace ztier::gpt {

// How the matmuls multiply (Config::matmul). kFp32: in fp32 throughout.
// kBf16: both operands rounded to bf16 (nearest even), their products summed
// in fp32: on CUDA bf16 tensor cores (cuBLAS, fp32 accumulation), on the
// CPU the same rounding ahead of its fp32 loops, so that the two backends
// still agree to fp32 summation order. Bias sums stay in fp32.
enum class MatmulMath : uint8_t { kFp32, kBf16 };

class Kernels {
 public:
  virtual ~Kernels() = default;

  // Sets how Matmul and MatmulBackward multiply (kFp32 until called); with
  // kBf16, reserves room for the rounded operands, each of at most
  // `max_operand` elements (a larger one aborts). Errors: the device's
  // ResourceExhausted.
  virtual Status SetMatmul(MatmulMath math, size_t max_operand) = 0;

  // out[i] = float(in[i]); out[i] = bf16(in[i]) rounding to nearest even.
  virtual void ToFloat(float* out, const bf16* in, size_t n) = 0;
  virtual void ToBf16(bf16* out, const float* in, size_t n) = 0;
  virtual void Zero(float* out, size_t n) = 0;
  // dst[i] += src[i]
  virtual void Accumulate(float* dst, const float* src, size_t n) = 0;
  // out[i] = a[i] + b[i]
  virtual void Residual(float* out, const float* a, const float* b, size_t n) = 0;

  // out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]
  virtual void Encoder(float* out, const int32_t* tokens, const float* wte, const float* wpe, int B,
                       int T, int C) = 0;
  // dwte[tokens[b,t],:] += dout[b,t,:]; dwpe[t,:] += dout[b,t,:]
  virtual void EncoderBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                               int B, int T, int C) = 0;

  // Per row: mean, rstd = 1/sqrt(var + 1e-5) (biased variance),
  // out = (inp - mean) * rstd * weight + bias. mean, rstd: N floats.
  virtual void LayerNorm(float* out, float* mean, float* rstd, const float* inp,
                         const float* weight, const float* bias, int N, int C) = 0;
  virtual void LayerNormBackward(float* dinp, float* dweight, float* dbias, const float* dout,
                                 const float* inp, const float* weight, const float* mean,
                                 const float* rstd, int N, int C) = 0;

  // out[N,OC] = inp[N,C] @ weight[OC,C]^T + bias[OC] (bias may be null).
  virtual void Matmul(float* out, const float* inp, const float* weight, const float* bias, int N,
                      int C, int OC) = 0;
  // dinp[N,C] += dout @ weight; dweight[OC,C] += dout^T @ inp; dbias[OC] +=
  // column sums of dout (dbias may be null).
  virtual void MatmulBackward(float* dinp, float* dweight, float* dbias, const float* dout,
                              const float* inp, const float* weight, int N, int C, int OC) = 0;

  // Causal self-attention. qkv: [B,T,3C] (q, k, v each C = NH heads of C/NH);
  // att: [B,NH,T,T] softmax probabilities (row t uses keys 0..t, the rest 0),
  // scaled by 1/sqrt(C/NH); out: [B,T,C].
  virtual void Attention(float* out, float* att, const float* qkv, int B, int T, int C, int NH) = 0;
  // dqkv += ...; `scratch` holds B*NH*T*T floats of workspace.
  virtual void AttentionBackward(float* dqkv, float* scratch, const float* dout, const float* qkv,
                                 const float* att, int B, int T, int C, int NH) = 0;

  // tanh-approximated GELU, as GPT-2.
  virtual void Gelu(float* out, const float* inp, size_t n) = 0;
  virtual void GeluBackward(float* dinp, const float* inp, const float* dout, size_t n) = 0;

  // Per row of logits [N,V]: losses[i] = -log softmax(logits[i])[targets[i]];
  // dlogits[i,:] = (softmax(logits[i]) - onehot(targets[i])) * dloss
  // (overwritten, not accumulated; dlogits may be null for forward only).
  virtual void CrossEntropy(float* losses, float* dlogits, const float* logits,
                            const int32_t* targets, int N, int V, float dloss) = 0;
};

// CPU kernels (oneTBB). For the host device.
std::unique_ptr<Kernels> MakeCpuKernels();
// The largest context and head size (channels / heads) the CUDA kernels
// take: attention keeps a row of T scores and a head's vector in a block's
// shared memory. Gpt::Create refuses larger shapes on CUDA
// (ValidateConfigFor); the kernels stop the process on them.
inline constexpr int kCudaMaxContext = 8192;
inline constexpr int kCudaMaxHeadSize = 1024;
// CUDA kernels (cuBLAS) on `device`'s compute stream. Errors: Unavailable
// when the build has no CUDA; the cuBLAS error otherwise.
Result<std::unique_ptr<Kernels>> MakeCudaKernels(client::Device& device);

}  // namespace ztier::gpt

#endif  // ZTIER_EXAMPLES_GPT_KERNELS_H_
