// CUDA side of bf16_device.h.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "tests/cuda/bf16_device.h"

namespace ztier::testing {
namespace {

__global__ void RoundKernel(const float* in, uint16_t* out, size_t n) {
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i < n) {
    const __nv_bfloat16 h = __float2bfloat16_rn(in[i]);
    out[i] = *reinterpret_cast<const uint16_t*>(&h);
  }
}

Status CudaError(const char* what, cudaError_t err) {
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) {
    return Status::Unavailable(StrCat("no CUDA device: ", what, ": ", cudaGetErrorString(err)));
  }
  return Status(StatusCode::kIoError, StrCat(what, ": ", cudaGetErrorString(err)),
                static_cast<int>(err));
}

// Device allocation, freed on scope exit.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  cudaError_t Allocate(size_t bytes) { return cudaMalloc(&ptr_, bytes); }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
};

}  // namespace

Status RoundToBf16OnDevice(const float* in, uint16_t* out, size_t n) {
  int devices = 0;
  cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess) return CudaError("cudaGetDeviceCount", err);
  if (devices == 0) return Status::Unavailable("no CUDA device");
  DeviceBuffer d_in, d_out;
  if ((err = d_in.Allocate(n * sizeof(float))) != cudaSuccess) return CudaError("cudaMalloc", err);
  if ((err = d_out.Allocate(n * sizeof(uint16_t))) != cudaSuccess)
    return CudaError("cudaMalloc", err);
  err = cudaMemcpy(d_in.as<float>(), in, n * sizeof(float), cudaMemcpyHostToDevice);
  if (err != cudaSuccess) return CudaError("cudaMemcpy host to device", err);
  const unsigned threads = 256;
  const unsigned blocks = static_cast<unsigned>((n + threads - 1) / threads);
  RoundKernel<<<blocks, threads>>>(d_in.as<float>(), d_out.as<uint16_t>(), n);
  if ((err = cudaGetLastError()) != cudaSuccess) return CudaError("kernel launch", err);
  err = cudaMemcpy(out, d_out.as<uint16_t>(), n * sizeof(uint16_t), cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) return CudaError("cudaMemcpy device to host", err);
  return Status::Ok();
}

}  // namespace ztier::testing
