// The GPT example's CUDA kernels in a build without CUDA.
#include "examples/gpt/kernels.h"

namespace ztier::gpt {

Result<std::unique_ptr<Kernels>> MakeCudaKernels(client::Device& device) {
  return Status::Unavailable(StrCat("no CUDA kernels for device '", device.name(),
                                    "': this build of ztier has no CUDA support"));
}

}  // namespace ztier::gpt
