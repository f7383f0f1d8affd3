// The CUDA device backend in a build without CUDA (ZTIER_CUDA=OFF or no
// nvcc): it reports that no device can be opened, so callers fall back to
// the host backend or skip with the reason.
#include "client/ztier.h"

namespace ztier::client {

Result<std::unique_ptr<Device>> MakeCudaDevice(int ordinal) {
  return Status::Unavailable(
      StrCat("no CUDA device: this build of ztier has no CUDA support "
             "(configure with ZTIER_CUDA=ON), asked for device ",
             ordinal));
}

int CudaDeviceCount() { return 0; }

}  // namespace ztier::client
