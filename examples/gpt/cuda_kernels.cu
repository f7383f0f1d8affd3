// The GPT example's CUDA kernels (gpt::MakeCudaKernels): every Kernels method
// as CUDA kernels queued on the device's compute stream, with cuBLAS for the
// matmuls (fp32 sgemm, default math mode: no TF32 unless the user forces it
// with NVIDIA_TF32_OVERRIDE). The CPU kernels (cpu_kernels.cc) are the
// reference; tests/cuda/cuda_kernels_test.cc holds these to them.
//
// How each kernel is laid out (correctness and clarity first):
//   - elementwise ops: grid-stride loops;
//   - layernorm: one warp per row (forward, and the dinp half of backward);
//     dweight/dbias and a matmul's dbias are column sums done by a block of
//     32 columns x 16 row-strides with a fixed reduction order;
//   - attention forward: one block per (b, head, query row t): scores in
//     shared memory, causal softmax, then out = att @ v;
//   - attention backward: one block per (b, head, row t) for datt, the
//     softmax backward into `scratch` (dpreatt) and dq; then one block per
//     (b, head, key row t2) summing dk and dv over the rows t >= t2;
//   - encoder backward: atomicAdd into dwte (tokens repeat), a plain sum
//     over the batch into dwpe.
// Nothing here uses atomics except the encoder's dwte, so every kernel but
// that one gives the same bits run to run. Supported shapes: head size up to
// 1024 and T up to 8192 (shared memory rows of T floats); larger shapes are
// rejected when the method is called.
//
// Thread safety: one object per rank, used by that rank's thread (as
// kernels.h says). Each method makes the stream's device current first.
//
// Failure contract: MakeCudaKernels returns Unavailable for a device that is
// not a CUDA device or a GPU this build has no code for (it is built for the
// architectures in CMAKE_CUDA_ARCHITECTURES), and the CUDA or cuBLAS error
// otherwise. The Kernels methods return nothing (the interface is shared with
// the CPU kernels, which cannot fail): a launch that the runtime rejects
// synchronously (bad configuration: a programmer error, given the shape
// checks) aborts with the kernel's name, the shape and the CUDA error; an
// error during execution is sticky and is reported as a Status by the
// device's next Synchronize / Record / event wait.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>

#include "client/ztier.h"
#include "common/status.h"
#include "examples/gpt/kernels.h"

namespace ztier::gpt {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxT = kCudaMaxContext;
constexpr int kMaxHeadSize = kCudaMaxHeadSize;
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)

// ------------------------------------------------------------ error checks --

// Launch errors the runtime reports at once are programmer errors here
// (shapes are checked before launching, the GPU was probed at creation):
// abort with the context. Errors while the kernel runs are sticky; the
// device reports them as a Status at its next synchronization.
void CheckLaunch(const char* kernel, const char* file, int line, const std::string& shape) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return;
  const bool launch_error =
      err == cudaErrorInvalidConfiguration || err == cudaErrorInvalidValue ||
      err == cudaErrorLaunchOutOfResources || err == cudaErrorInvalidDeviceFunction ||
      err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidResourceHandle;
  ZT_CHECK_MSG(!launch_error, "launching ", kernel, " (", shape, ") at ", ShortSourcePath(file),
               ":", line, ": ", cudaGetErrorString(err), " (", cudaGetErrorName(err), ")");
}

#define ZT_CHECK_LAUNCH(kernel, ...) CheckLaunch(kernel, __FILE__, __LINE__, StrCat(__VA_ARGS__))

void CheckCublas(cublasStatus_t st, const char* call, const char* file, int line,
                 const std::string& shape) {
  // Every cuBLAS error at enqueue time (bad dimensions, a bad handle, no
  // kernel for this GPU) is a programmer or build error: abort with context.
  ZT_CHECK_MSG(st == CUBLAS_STATUS_SUCCESS, call, " (", shape, ") at ", ShortSourcePath(file), ":",
               line, ": ", cublasGetStatusString(st));
}

#define ZT_CHECK_CUBLAS(call, ...) \
  CheckCublas((call), #call, __FILE__, __LINE__, StrCat(__VA_ARGS__))

unsigned GridFor(size_t n, int threads = kThreads) {
  const size_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 65536 ? (blocks == 0 ? 1 : blocks) : 65536);
}

// ------------------------------------------------------------ reductions --

__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
  for (int offset = 16; offset > 0; offset >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Sum / max over the block (blockDim.x a multiple of 32, at most 1024); every
// thread gets the result. `scratch` holds 32 floats of shared memory.
__device__ float BlockSum(float v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = WarpSum(v);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.0f;
  return WarpSum(v);
}

__device__ float BlockMax(float v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = WarpMax(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : -INFINITY;
  return WarpMax(v);
}

// -------------------------------------------------------- elementwise ops --

// fp32 -> bf16 bits, nearest even, NaN kept quiet with its sign: the same
// rule as common/bf16.h, bit for bit.
__device__ __forceinline__ uint16_t FloatToBf16Bits(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

__global__ void ToFloatKernel(float* out, const uint16_t* in, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    out[i] = __uint_as_float(static_cast<uint32_t>(in[i]) << 16);
  }
}

__global__ void ToBf16Kernel(uint16_t* out, const float* in, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    out[i] = FloatToBf16Bits(in[i]);
  }
}

__global__ void AccumulateKernel(float* dst, const float* src, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    dst[i] += src[i];
  }
}

__global__ void ResidualKernel(float* out, const float* a, const float* b, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    out[i] = a[i] + b[i];
  }
}

__global__ void GeluKernel(float* out, const float* inp, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float x = inp[i];
    const float cube = 0.044715f * x * x * x;
    out[i] = 0.5f * x * (1.0f + tanhf(kGeluScale * (x + cube)));
  }
}

__global__ void GeluBackwardKernel(float* dinp, const float* inp, const float* dout, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float x = inp[i];
    const float cube = 0.044715f * x * x * x;
    const float tanh_arg = kGeluScale * (x + cube);
    const float tanh_out = tanhf(tanh_arg);
    const float sech2 = 1.0f - tanh_out * tanh_out;  // as the CPU kernel; no cosh overflow
    const float local_grad = 0.5f * (1.0f + tanh_out) +
                             0.5f * x * sech2 * kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
    dinp[i] += local_grad * dout[i];
  }
}

// ---------------------------------------------------------------- encoder --

__global__ void EncoderKernel(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                              int B, int T, int C) {
  const size_t n = static_cast<size_t>(B) * T * C;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t bt = i / C, c = i % C;
    const size_t t = bt % T;
    out[i] = wte[static_cast<size_t>(tokens[bt]) * C + c] + wpe[t * C + c];
  }
}

__global__ void EncoderBackwardWteKernel(float* dwte, const float* dout, const int32_t* tokens,
                                         int B, int T, int C) {
  const size_t n = static_cast<size_t>(B) * T * C;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t bt = i / C, c = i % C;
    atomicAdd(&dwte[static_cast<size_t>(tokens[bt]) * C + c], dout[i]);
  }
}

// dwpe[t, c] += sum over b of dout[b, t, c], in batch order.
__global__ void EncoderBackwardWpeKernel(float* dwpe, const float* dout, int B, int T, int C) {
  const size_t n = static_cast<size_t>(T) * C;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float sum = 0.0f;
    for (int b = 0; b < B; ++b) sum += dout[static_cast<size_t>(b) * n + i];
    dwpe[i] += sum;
  }
}

// -------------------------------------------------------------- layernorm --

constexpr int kRowsPerBlock = 8;  // warps per block for one-warp-per-row kernels

__global__ void LayerNormKernel(float* out, float* mean, float* rstd, const float* inp,
                                const float* weight, const float* bias, int N, int C) {
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;
  const float* x = inp + static_cast<size_t>(row) * C;
  float sum = 0.0f;
  for (int c = lane; c < C; c += 32) sum += x[c];
  const float m = WarpSum(sum) / C;
  float var = 0.0f;
  for (int c = lane; c < C; c += 32) {
    const float d = x[c] - m;
    var += d * d;
  }
  const float s = 1.0f / sqrtf(WarpSum(var) / C + 1e-5f);
  float* o = out + static_cast<size_t>(row) * C;
  for (int c = lane; c < C; c += 32) o[c] = (x[c] - m) * s * weight[c] + bias[c];
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = s;
  }
}

__global__ void LayerNormBackwardInputKernel(float* dinp, const float* dout, const float* inp,
                                             const float* weight, const float* mean,
                                             const float* rstd, int N, int C) {
  const int row = blockIdx.x * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;
  const size_t base = static_cast<size_t>(row) * C;
  const float m = mean[row], s = rstd[row];
  float dnorm_sum = 0.0f, dnorm_norm_sum = 0.0f;
  for (int c = lane; c < C; c += 32) {
    const float norm = (inp[base + c] - m) * s;
    const float dnorm = weight[c] * dout[base + c];
    dnorm_sum += dnorm;
    dnorm_norm_sum += dnorm * norm;
  }
  const float dnorm_mean = WarpSum(dnorm_sum) / C;
  const float dnorm_norm_mean = WarpSum(dnorm_norm_sum) / C;
  for (int c = lane; c < C; c += 32) {
    const float norm = (inp[base + c] - m) * s;
    const float dnorm = weight[c] * dout[base + c];
    dinp[base + c] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
  }
}

// Column sums over N rows of a row-major [N, C] matrix, 32 columns per block
// and 16 row strides, reduced in a fixed order. With `inp` (layernorm
// dweight): dweight[c] += sum dout * norm, dbias[c] += sum dout. Without
// (matmul dbias): dbias[c] += sum dout. Either output may be null.
constexpr int kColRows = 16;

__global__ void ColumnSumsKernel(float* dweight, float* dbias, const float* dout, const float* inp,
                                 const float* mean, const float* rstd, int N, int C) {
  __shared__ float sw[kColRows][33];
  __shared__ float sb[kColRows][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  float w = 0.0f, b = 0.0f;
  if (c < C) {
    for (int n = threadIdx.y; n < N; n += kColRows) {
      const size_t i = static_cast<size_t>(n) * C + c;
      const float d = dout[i];
      b += d;
      if (inp != nullptr) w += d * (inp[i] - mean[n]) * rstd[n];
    }
  }
  sw[threadIdx.y][threadIdx.x] = w;
  sb[threadIdx.y][threadIdx.x] = b;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    for (int r = 1; r < kColRows; ++r) {
      w += sw[r][threadIdx.x];
      b += sb[r][threadIdx.x];
    }
    if (dweight != nullptr) dweight[c] += w;
    if (dbias != nullptr) dbias[c] += b;
  }
}

// ------------------------------------------------------------------ matmul --

__global__ void AddBiasKernel(float* out, const float* bias, size_t N, int OC) {
  const size_t n = N * OC;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    out[i] += bias[i % OC];
  }
}

// --------------------------------------------------------------- attention --

// The row an attention block owns: blocks run over B * NH * T rows, and block
// (b * NH + h) * T + t is row t of head h in sequence b.
struct HeadRow {
  int b;
  int h;
  int t;
};
__device__ __forceinline__ HeadRow BlockHeadRow(int T, int NH) {
  return {static_cast<int>(blockIdx.x / (T * NH)), static_cast<int>((blockIdx.x / T) % NH),
          static_cast<int>(blockIdx.x % T)};
}

// One block per (b, h, t). Shared memory: scores[T] (then probabilities)
// and q[hs]. Writes the whole att row (zeros past t) and out[b, t, h, :].
__global__ void AttentionKernel(float* out, float* att, const float* qkv, int T, int C, int NH) {
  extern __shared__ float smem[];
  __shared__ float red[32];
  const int hs = C / NH;
  const auto [b, h, t] = BlockHeadRow(T, NH);
  float* scores = smem;
  float* q = smem + T;
  const size_t C3 = 3 * static_cast<size_t>(C);
  const float* qkv_b = qkv + static_cast<size_t>(b) * T * C3;
  const float scale = 1.0f / sqrtf(static_cast<float>(hs));

  for (int i = threadIdx.x; i < hs; i += blockDim.x) q[i] = qkv_b[t * C3 + h * hs + i];
  __syncthreads();
  float local_max = -INFINITY;
  for (int t2 = threadIdx.x; t2 <= t; t2 += blockDim.x) {
    const float* k = qkv_b + t2 * C3 + C + h * hs;
    float dot = 0.0f;
    for (int i = 0; i < hs; ++i) dot += q[i] * k[i];
    dot *= scale;
    scores[t2] = dot;
    local_max = fmaxf(local_max, dot);
  }
  const float max_score = BlockMax(local_max, red);
  float local_sum = 0.0f;
  for (int t2 = threadIdx.x; t2 <= t; t2 += blockDim.x) {
    const float e = expf(scores[t2] - max_score);
    scores[t2] = e;
    local_sum += e;
  }
  const float inv_sum = 1.0f / BlockSum(local_sum, red);
  float* att_row = att + (static_cast<size_t>(b) * NH + h) * T * T + static_cast<size_t>(t) * T;
  for (int t2 = threadIdx.x; t2 < T; t2 += blockDim.x) {
    const float p = t2 <= t ? scores[t2] * inv_sum : 0.0f;
    if (t2 <= t) scores[t2] = p;
    att_row[t2] = p;
  }
  __syncthreads();
  float* o = out + (static_cast<size_t>(b) * T + t) * C + h * hs;
  for (int i = threadIdx.x; i < hs; i += blockDim.x) {
    float acc = 0.0f;
    for (int t2 = 0; t2 <= t; ++t2) acc += scores[t2] * qkv_b[t2 * C3 + 2 * C + h * hs + i];
    o[i] = acc;
  }
}

// One block per (b, h, t): datt[t2] = dout[b,t,h,:] . v[t2]; the softmax
// backward dpreatt[t2] = att[t2] * (datt[t2] - sum att * datt) * scale,
// stored in dpreatt (the [B, NH, T, T] scratch; zeros past t); and
// dq[b,t,h,:] += sum over t2 of dpreatt[t2] * k[t2]. Shared memory: d[T]
// and dout row[hs].
__global__ void AttentionBackwardRowKernel(float* dqkv, float* dpreatt, const float* dout,
                                           const float* qkv, const float* att, int T, int C,
                                           int NH) {
  extern __shared__ float smem[];
  __shared__ float red[32];
  const int hs = C / NH;
  const auto [b, h, t] = BlockHeadRow(T, NH);
  float* d = smem;
  float* dout_row = smem + T;
  const size_t C3 = 3 * static_cast<size_t>(C);
  const float* qkv_b = qkv + static_cast<size_t>(b) * T * C3;
  const float scale = 1.0f / sqrtf(static_cast<float>(hs));
  const size_t row = (static_cast<size_t>(b) * NH + h) * T * T + static_cast<size_t>(t) * T;
  const float* att_row = att + row;

  for (int i = threadIdx.x; i < hs; i += blockDim.x)
    dout_row[i] = dout[(static_cast<size_t>(b) * T + t) * C + h * hs + i];
  __syncthreads();
  float local = 0.0f;
  for (int t2 = threadIdx.x; t2 <= t; t2 += blockDim.x) {
    const float* v = qkv_b + t2 * C3 + 2 * C + h * hs;
    float dot = 0.0f;
    for (int i = 0; i < hs; ++i) dot += dout_row[i] * v[i];
    d[t2] = dot;
    local += att_row[t2] * dot;
  }
  const float att_datt = BlockSum(local, red);
  for (int t2 = threadIdx.x; t2 < T; t2 += blockDim.x) {
    const float dp = t2 <= t ? att_row[t2] * (d[t2] - att_datt) * scale : 0.0f;
    if (t2 <= t) d[t2] = dp;
    dpreatt[row + t2] = dp;
  }
  __syncthreads();
  float* dq = dqkv + static_cast<size_t>(b) * T * C3 + t * C3 + h * hs;
  for (int i = threadIdx.x; i < hs; i += blockDim.x) {
    float acc = 0.0f;
    for (int t2 = 0; t2 <= t; ++t2) acc += d[t2] * qkv_b[t2 * C3 + C + h * hs + i];
    dq[i] += acc;
  }
}

// One block per (b, h, key row t2): dk[t2] += sum over t >= t2 of
// dpreatt[t, t2] * q[t]; dv[t2] += sum over t >= t2 of att[t, t2] * dout[t].
__global__ void AttentionBackwardKeyKernel(float* dqkv, const float* dpreatt, const float* dout,
                                           const float* qkv, const float* att, int T, int C,
                                           int NH) {
  const int hs = C / NH;
  const auto [b, h, t2] = BlockHeadRow(T, NH);
  const size_t C3 = 3 * static_cast<size_t>(C);
  const float* qkv_b = qkv + static_cast<size_t>(b) * T * C3;
  const float* dout_b = dout + static_cast<size_t>(b) * T * C;
  const size_t bh = (static_cast<size_t>(b) * NH + h) * T * T;
  float* dqkv_b = dqkv + static_cast<size_t>(b) * T * C3;
  for (int i = threadIdx.x; i < hs; i += blockDim.x) {
    float dk = 0.0f, dv = 0.0f;
    for (int t = t2; t < T; ++t) {
      const size_t at = bh + static_cast<size_t>(t) * T + t2;
      dk += dpreatt[at] * qkv_b[t * C3 + h * hs + i];
      dv += att[at] * dout_b[static_cast<size_t>(t) * C + h * hs + i];
    }
    dqkv_b[t2 * C3 + C + h * hs + i] += dk;
    dqkv_b[t2 * C3 + 2 * C + h * hs + i] += dv;
  }
}

// ----------------------------------------------------------- cross entropy --

// One block per row of logits: losses[row], and dlogits[row, :] when asked.
__global__ void CrossEntropyKernel(float* losses, float* dlogits, const float* logits,
                                   const int32_t* targets, int V, float dloss) {
  __shared__ float red[32];
  const size_t row = blockIdx.x;
  const float* l = logits + row * V;
  float local_max = -INFINITY;
  for (int i = threadIdx.x; i < V; i += blockDim.x) local_max = fmaxf(local_max, l[i]);
  const float m = BlockMax(local_max, red);
  float local_sum = 0.0f;
  for (int i = threadIdx.x; i < V; i += blockDim.x) local_sum += expf(l[i] - m);
  const float sum = BlockSum(local_sum, red);
  const int target = targets[row];
  const bool valid = target >= 0 && target < V;
  if (threadIdx.x == 0) {
    losses[row] = valid ? -(l[target] - m - logf(sum)) : NAN;
  }
  if (dlogits != nullptr) {
    const float inv_sum = 1.0f / sum;
    float* dl = dlogits + row * V;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
      const float p = expf(l[i] - m) * inv_sum;
      dl[i] = (p - (i == target ? 1.0f : 0.0f)) * dloss;
    }
  }
}

// ------------------------------------------------------------ the backend --

// A cuBLAS handle, destroyed with the object.
class CublasHandle {
 public:
  CublasHandle() = default;
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  ~CublasHandle() {
    if (handle_ != nullptr) cublasDestroy(handle_);
  }
  cublasStatus_t Create() { return cublasCreate(&handle_); }
  cublasHandle_t get() const { return handle_; }

 private:
  cublasHandle_t handle_ = nullptr;
};

int AttentionThreads(int T) { return T >= 256 ? 256 : (T >= 128 ? 128 : 64); }
int HeadThreads(int hs) {
  const int t = (hs + 31) / 32 * 32;
  return t < 1024 ? t : 1024;
}

class CudaKernels final : public Kernels {
 public:
  CudaKernels(client::Device& device, int ordinal, cudaStream_t stream)
      : device_(device), ordinal_(ordinal), stream_(stream) {}
  ~CudaKernels() override {
    for (uint16_t* p : operands_) {
      if (p != nullptr) device_.Free(p);
    }
  }
  CudaKernels(const CudaKernels&) = delete;
  CudaKernels& operator=(const CudaKernels&) = delete;

  Status SetMatmul(MatmulMath math, size_t max_operand) override {
    if (math == MatmulMath::kBf16 && max_operand > max_operand_) {
      for (uint16_t*& p : operands_) {
        if (p != nullptr) device_.Free(p);
        p = nullptr;
      }
      max_operand_ = 0;
      for (uint16_t*& p : operands_) {
        ZT_ASSIGN_OR_RETURN(void* room, device_.Allocate(max_operand * sizeof(uint16_t),
                                                         client::MemoryPurpose::kOther));
        p = static_cast<uint16_t*>(room);
      }
      max_operand_ = max_operand;
    }
    math_ = math;
    return Status::Ok();
  }

  Status Init() {
    ZT_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(ordinal_), "cudaSetDevice"));
    // A GPU this build has no code for fails here, with a status, instead
    // of at the first launch.
    cudaFuncAttributes attr = {};
    const cudaError_t probe = cudaFuncGetAttributes(&attr, AccumulateKernel);
    if (probe != cudaSuccess) {
      cudaGetLastError();
      cudaDeviceProp prop = {};
      const bool have_prop = cudaGetDeviceProperties(&prop, ordinal_) == cudaSuccess;
      return Status(StatusCode::kUnavailable,
                    StrCat("no CUDA kernels for cuda:", ordinal_,
                           have_prop ? StrCat(" (sm_", prop.major, prop.minor, ")") : "", ": ",
                           cudaGetErrorString(probe),
                           "; rebuild with its architecture in CMAKE_CUDA_ARCHITECTURES"),
                    static_cast<int>(probe));
    }
    ZT_RETURN_IF_ERROR(CublasStatus(cublas_.Create(), "cublasCreate"));
    ZT_RETURN_IF_ERROR(CublasStatus(cublasSetStream(cublas_.get(), stream_), "cublasSetStream"));
    ZT_RETURN_IF_ERROR(
        CublasStatus(cublasSetMathMode(cublas_.get(), CUBLAS_DEFAULT_MATH), "cublasSetMathMode"));
    return Status::Ok();
  }

  void ToFloat(float* out, const bf16* in, size_t n) override {
    LaunchElementwise("ToFloat", ToFloatKernel, n, out, reinterpret_cast<const uint16_t*>(in));
  }

  void ToBf16(bf16* out, const float* in, size_t n) override {
    LaunchElementwise("ToBf16", ToBf16Kernel, n, reinterpret_cast<uint16_t*>(out), in);
  }

  void Zero(float* out, size_t n) override {
    if (n == 0) return;
    if (!Enter()) return;
    const cudaError_t err = cudaMemsetAsync(out, 0, n * sizeof(float), stream_);
    ZT_CHECK_MSG(err != cudaErrorInvalidValue, "Zero(n=", n,
                 "): cudaMemsetAsync: ", cudaGetErrorString(err));
  }

  void Accumulate(float* dst, const float* src, size_t n) override {
    LaunchElementwise("Accumulate", AccumulateKernel, n, dst, src);
  }

  void Residual(float* out, const float* a, const float* b, size_t n) override {
    LaunchElementwise("Residual", ResidualKernel, n, out, a, b);
  }

  void Encoder(float* out, const int32_t* tokens, const float* wte, const float* wpe, int B, int T,
               int C) override {
    const size_t n = static_cast<size_t>(B) * T * C;
    if (n == 0) return;
    if (!Enter()) return;
    EncoderKernel<<<GridFor(n), kThreads, 0, stream_>>>(out, tokens, wte, wpe, B, T, C);
    ZT_CHECK_LAUNCH("Encoder", "B=", B, " T=", T, " C=", C);
  }

  void EncoderBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B,
                       int T, int C) override {
    const size_t n = static_cast<size_t>(B) * T * C;
    if (n == 0) return;
    if (!Enter()) return;
    if (dwte != nullptr) {
      EncoderBackwardWteKernel<<<GridFor(n), kThreads, 0, stream_>>>(dwte, dout, tokens, B, T, C);
      ZT_CHECK_LAUNCH("EncoderBackward (wte)", "B=", B, " T=", T, " C=", C);
    }
    if (dwpe != nullptr) {
      const size_t tc = static_cast<size_t>(T) * C;
      EncoderBackwardWpeKernel<<<GridFor(tc), kThreads, 0, stream_>>>(dwpe, dout, B, T, C);
      ZT_CHECK_LAUNCH("EncoderBackward (wpe)", "B=", B, " T=", T, " C=", C);
    }
  }

  void LayerNorm(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                 const float* bias, int N, int C) override {
    if (N <= 0 || C <= 0) return;
    if (!Enter()) return;
    const unsigned blocks = static_cast<unsigned>((N + kRowsPerBlock - 1) / kRowsPerBlock);
    LayerNormKernel<<<blocks, 32 * kRowsPerBlock, 0, stream_>>>(out, mean, rstd, inp, weight, bias,
                                                                N, C);
    ZT_CHECK_LAUNCH("LayerNorm", "N=", N, " C=", C);
  }

  void LayerNormBackward(float* dinp, float* dweight, float* dbias, const float* dout,
                         const float* inp, const float* weight, const float* mean,
                         const float* rstd, int N, int C) override {
    if (N <= 0 || C <= 0) return;
    if (!Enter()) return;
    if (dinp != nullptr) {
      const unsigned blocks = static_cast<unsigned>((N + kRowsPerBlock - 1) / kRowsPerBlock);
      LayerNormBackwardInputKernel<<<blocks, 32 * kRowsPerBlock, 0, stream_>>>(
          dinp, dout, inp, weight, mean, rstd, N, C);
      ZT_CHECK_LAUNCH("LayerNormBackward (dinp)", "N=", N, " C=", C);
    }
    if (dweight != nullptr || dbias != nullptr) {
      LaunchColumnSums(dweight, dbias, dout, inp, mean, rstd, N, C);
      ZT_CHECK_LAUNCH("LayerNormBackward (dweight, dbias)", "N=", N, " C=", C);
    }
  }

  void Matmul(float* out, const float* inp, const float* weight, const float* bias, int N, int C,
              int OC) override {
    if (N <= 0 || OC <= 0) return;
    if (!Enter()) return;
    // cuBLAS is column-major: a row-major [R, K] matrix is a column-major
    // K x R one. Row-major out[N,OC] = inp[N,C] @ weight[OC,C]^T is then
    // column-major out (OC x N) = weight^T (OC x C) * inp (C x N), weight
    // being the column-major C x OC matrix, transposed.
    const float one = 1.0f, zero = 0.0f;
    if (math_ == MatmulMath::kBf16) {
      const uint16_t* w = Operand(kWeight, weight, static_cast<size_t>(OC) * C);
      const uint16_t* x = Operand(kInput, inp, static_cast<size_t>(N) * C);
      ZT_CHECK_CUBLAS(Bf16Gemm(CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, w, C, x, C, 0.0f, out, OC),
                      "Matmul (bf16) N=", N, " C=", C, " OC=", OC);
    } else {
      ZT_CHECK_CUBLAS(cublasSgemm(cublas_.get(), CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, &one, weight,
                                  C, inp, C, &zero, out, OC),
                      "Matmul N=", N, " C=", C, " OC=", OC);
    }
    if (bias != nullptr) {
      const size_t n = static_cast<size_t>(N) * OC;
      AddBiasKernel<<<GridFor(n), kThreads, 0, stream_>>>(out, bias, static_cast<size_t>(N), OC);
      ZT_CHECK_LAUNCH("Matmul (bias)", "N=", N, " OC=", OC);
    }
  }

  void MatmulBackward(float* dinp, float* dweight, float* dbias, const float* dout,
                      const float* inp, const float* weight, int N, int C, int OC) override {
    if (N <= 0 || C <= 0 || OC <= 0) return;
    if (!Enter()) return;
    const float one = 1.0f;
    const bool bf16 = math_ == MatmulMath::kBf16;
    // The bf16 operands, rounded once for both products (dbias sums dout
    // as is).
    const uint16_t* dout16 = bf16 ? Operand(kOutput, dout, static_cast<size_t>(N) * OC) : nullptr;
    if (dinp != nullptr) {
      // dinp[N,C] += dout[N,OC] @ weight[OC,C]: column-major dinp^T (C x N)
      // += weight (C x OC) * dout^T (OC x N).
      if (bf16) {
        const uint16_t* w = Operand(kWeight, weight, static_cast<size_t>(OC) * C);
        ZT_CHECK_CUBLAS(Bf16Gemm(CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, w, C, dout16, OC, 1.0f, dinp,
                                 C),
                        "MatmulBackward (bf16) dinp N=", N, " C=", C, " OC=", OC);
      } else {
        ZT_CHECK_CUBLAS(cublasSgemm(cublas_.get(), CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, &one,
                                    weight, C, dout, OC, &one, dinp, C),
                        "MatmulBackward dinp N=", N, " C=", C, " OC=", OC);
      }
    }
    if (dweight != nullptr) {
      // dweight[OC,C] += dout^T @ inp: column-major dweight^T (C x OC) +=
      // inp^T (C x N) * dout (N x OC).
      if (bf16) {
        const uint16_t* x = Operand(kInput, inp, static_cast<size_t>(N) * C);
        ZT_CHECK_CUBLAS(Bf16Gemm(CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, x, C, dout16, OC, 1.0f,
                                 dweight, C),
                        "MatmulBackward (bf16) dweight N=", N, " C=", C, " OC=", OC);
      } else {
        ZT_CHECK_CUBLAS(cublasSgemm(cublas_.get(), CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, &one, inp,
                                    C, dout, OC, &one, dweight, C),
                        "MatmulBackward dweight N=", N, " C=", C, " OC=", OC);
      }
    }
    if (dbias != nullptr) {
      LaunchColumnSums(nullptr, dbias, dout, nullptr, nullptr, nullptr, N, OC);
      ZT_CHECK_LAUNCH("MatmulBackward (dbias)", "N=", N, " OC=", OC);
    }
  }

  void Attention(float* out, float* att, const float* qkv, int B, int T, int C, int NH) override {
    if (B <= 0 || T <= 0) return;
    CheckAttentionShape("Attention", T, C, NH);
    if (!Enter()) return;
    const int hs = C / NH;
    const size_t smem = (static_cast<size_t>(T) + hs) * sizeof(float);
    AttentionKernel<<<AttentionBlocks(B, T, NH), AttentionThreads(T), smem, stream_>>>(
        out, att, qkv, T, C, NH);
    ZT_CHECK_LAUNCH("Attention", "B=", B, " T=", T, " C=", C, " NH=", NH);
  }

  void AttentionBackward(float* dqkv, float* scratch, const float* dout, const float* qkv,
                         const float* att, int B, int T, int C, int NH) override {
    if (B <= 0 || T <= 0) return;
    CheckAttentionShape("AttentionBackward", T, C, NH);
    if (!Enter()) return;
    const int hs = C / NH;
    const size_t smem = (static_cast<size_t>(T) + hs) * sizeof(float);
    AttentionBackwardRowKernel<<<AttentionBlocks(B, T, NH), AttentionThreads(T), smem, stream_>>>(
        dqkv, scratch, dout, qkv, att, T, C, NH);
    ZT_CHECK_LAUNCH("AttentionBackward (rows)", "B=", B, " T=", T, " C=", C, " NH=", NH);
    AttentionBackwardKeyKernel<<<AttentionBlocks(B, T, NH), HeadThreads(hs), 0, stream_>>>(
        dqkv, scratch, dout, qkv, att, T, C, NH);
    ZT_CHECK_LAUNCH("AttentionBackward (keys)", "B=", B, " T=", T, " C=", C, " NH=", NH);
  }

  void Gelu(float* out, const float* inp, size_t n) override {
    LaunchElementwise("Gelu", GeluKernel, n, out, inp);
  }

  void GeluBackward(float* dinp, const float* inp, const float* dout, size_t n) override {
    LaunchElementwise("GeluBackward", GeluBackwardKernel, n, dinp, inp, dout);
  }

  void CrossEntropy(float* losses, float* dlogits, const float* logits, const int32_t* targets,
                    int N, int V, float dloss) override {
    if (N <= 0 || V <= 0) return;
    if (!Enter()) return;
    CrossEntropyKernel<<<static_cast<unsigned>(N), 256, 0, stream_>>>(losses, dlogits, logits,
                                                                      targets, V, dloss);
    ZT_CHECK_LAUNCH("CrossEntropy", "N=", N, " V=", V);
  }

 private:
  Status CudaStatus(cudaError_t err, const char* what) const {
    if (err == cudaSuccess) return Status::Ok();
    cudaGetLastError();
    return Status(err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver
                      ? StatusCode::kUnavailable
                      : StatusCode::kIoError,
                  StrCat("CUDA kernels on cuda:", ordinal_, ": ", what, ": ",
                         cudaGetErrorString(err), " (", cudaGetErrorName(err), ")"),
                  static_cast<int>(err));
  }
  Status CublasStatus(cublasStatus_t st, const char* what) const {
    if (st == CUBLAS_STATUS_SUCCESS) return Status::Ok();
    return Status(
        st == CUBLAS_STATUS_NOT_INITIALIZED || st == CUBLAS_STATUS_ALLOC_FAILED
            ? StatusCode::kResourceExhausted
            : StatusCode::kIoError,
        StrCat("CUDA kernels on cuda:", ordinal_, ": ", what, ": ", cublasGetStatusString(st)),
        static_cast<int>(st));
  }

  // The rank's thread may have another GPU current (several ranks in one
  // process): make the stream's device current before every launch. Clears
  // a stale non-sticky error left by an unrelated call, so the check after
  // the launch sees the launch's own. False when the device is unusable (a
  // sticky error of earlier work): the launch is skipped, and the device's
  // next Synchronize / Record reports the error as a Status.
  bool Enter() const {
    if (cudaSetDevice(ordinal_) != cudaSuccess) return false;
    cudaGetLastError();
    return true;
  }

  // Queues an elementwise kernel (a grid-stride loop whose last parameter is
  // the element count) over n elements: kernel(args..., n). Nothing for n == 0.
  template <typename... Params, typename... Args>
  void LaunchElementwise(const char* name, void (*kernel)(Params...), size_t n, Args... args) {
    if (n == 0) return;
    if (!Enter()) return;
    kernel<<<GridFor(n), kThreads, 0, stream_>>>(args..., n);
    ZT_CHECK_LAUNCH(name, "n=", n);
  }

  // Queues ColumnSumsKernel over the C columns of a row-major [N, C] matrix
  // (the caller checks the launch).
  void LaunchColumnSums(float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* mean, const float* rstd, int N, int C) {
    ColumnSumsKernel<<<static_cast<unsigned>((C + 31) / 32), dim3(32, kColRows), 0, stream_>>>(
        dweight, dbias, dout, inp, mean, rstd, N, C);
  }

  static void CheckAttentionShape(const char* what, int T, int C, int NH) {
    ZT_CHECK_MSG(NH > 0 && C % NH == 0, what, ": C=", C, " is not a multiple of NH=", NH);
    ZT_CHECK_MSG(T <= kMaxT && C / NH <= kMaxHeadSize, what, ": T=", T, ", head size ", C / NH,
                 " past what the CUDA kernels support (T <= ", kMaxT,
                 ", head size <= ", kMaxHeadSize, ")");
  }
  static unsigned AttentionBlocks(int B, int T, int NH) {
    const size_t blocks = static_cast<size_t>(B) * NH * T;
    ZT_CHECK_MSG(blocks < (size_t{1} << 31), "attention grid B*NH*T=", blocks, " too large");
    return static_cast<unsigned>(blocks);
  }

  // The rounded bf16 operands of kBf16 matmuls, one buffer per role.
  enum Role { kInput, kWeight, kOutput, kRoles };

  // x[0, n) rounded to bf16 (nearest even, as the CPU) into the role's
  // buffer, queued on the stream.
  const uint16_t* Operand(Role role, const float* x, size_t n) {
    ZT_CHECK_MSG(n <= max_operand_, "matmul operand of ", n, " elements; SetMatmul reserved ",
                 max_operand_);
    uint16_t* out = operands_[role];
    LaunchElementwise("ToBf16 (matmul operand)", ToBf16Kernel, n, out, x);
    return out;
  }

  // Column-major C = A * B (+ beta C) on bf16 tensor cores with fp32
  // accumulation; A and B bf16, C fp32.
  cublasStatus_t Bf16Gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                          const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta,
                          float* c, int ldc) {
    const float alpha = 1.0f;
    return cublasGemmEx(cublas_.get(), ta, tb, m, n, k, &alpha, a, CUDA_R_16BF, lda, b,
                        CUDA_R_16BF, ldb, &beta, c, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT);
  }

  client::Device& device_;
  const int ordinal_;
  const cudaStream_t stream_;
  CublasHandle cublas_;
  MatmulMath math_ = MatmulMath::kFp32;
  size_t max_operand_ = 0;
  uint16_t* operands_[kRoles] = {};
};

}  // namespace

Result<std::unique_ptr<Kernels>> MakeCudaKernels(client::Device& device) {
  if (device.kind() != client::DeviceKind::kCuda) {
    return Status::Unavailable(StrCat("CUDA kernels need a CUDA device; '", device.name(),
                                      "' is not one (use MakeCpuKernels for the host device)"));
  }
  auto stream = static_cast<cudaStream_t>(device.native_stream(client::Stream::kCompute));
  int ordinal = -1;
  if (const cudaError_t err = cudaStreamGetDevice(stream, &ordinal); err != cudaSuccess) {
    cudaGetLastError();
    return Status(StatusCode::kIoError,
                  StrCat("CUDA kernels for '", device.name(), "': cudaStreamGetDevice: ",
                         cudaGetErrorString(err), " (", cudaGetErrorName(err), ")"),
                  static_cast<int>(err));
  }
  auto kernels = std::make_unique<CudaKernels>(device, ordinal, stream);
  ZT_RETURN_IF_ERROR(kernels->Init());
  return std::unique_ptr<Kernels>(std::move(kernels));
}

}  // namespace ztier::gpt
