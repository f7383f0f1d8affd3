// Test helper: converts floats to bf16 on a CUDA device with the device's own
// round-to-nearest-even intrinsic, so tests can hold the CPU rounding rule
// (common/bf16.h) and the GPU's to the same bits.
#ifndef ZTIER_TESTS_CUDA_BF16_DEVICE_H_
#define ZTIER_TESTS_CUDA_BF16_DEVICE_H_

#include <cstddef>
#include <cstdint>

#include "common/status.h"

namespace ztier::testing {

// Unavailable (with the CUDA error text) when no device or driver is present;
// IoError naming the failing call otherwise.
Status RoundToBf16OnDevice(const float* in, uint16_t* out, size_t n);

}  // namespace ztier::testing

#endif  // ZTIER_TESTS_CUDA_BF16_DEVICE_H_
