// The GPU's fp32 -> bf16 rounding (__float2bfloat16_rn) and ztier's CPU rule
// (common/bf16.h, used by cpu_adam) must give the same bits: params published
// by the CPU optimizer and params rounded on the GPU have to agree. Skips when
// no CUDA device is present.
#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "common/bf16.h"
#include "tests/cuda/bf16_device.h"

namespace ztier {
namespace {

TEST(CudaBf16Test, DeviceRoundingMatchesCpuRule) {
  std::vector<float> in;
  for (uint32_t bits : {0x3f808000u, 0x3f818000u, 0x3fffffffu, 0x7f7fffffu, 0x00008000u,
                        0x00018000u, 0x807fffffu, 0x7f800000u, 0xff800000u, 0x80000000u}) {
    in.push_back(std::bit_cast<float>(bits));
  }
  std::mt19937 rng(12345);
  for (int i = 0; i < 1 << 16; ++i)
    in.push_back(std::bit_cast<float>(static_cast<uint32_t>(rng())));
  std::vector<uint16_t> out(in.size());
  Status s = testing::RoundToBf16OnDevice(in.data(), out.data(), in.size());
  if (s.code() == StatusCode::kUnavailable) GTEST_SKIP() << s.message();
  ASSERT_TRUE(s.ok()) << s;
  for (size_t i = 0; i < in.size(); ++i) {
    if (std::isnan(in[i])) {
      EXPECT_TRUE(std::isnan(Bf16ToFloat(bf16{out[i]}))) << i;
    } else {
      ASSERT_EQ(out[i], FloatToBf16(in[i]).bits)
          << "input bits 0x" << std::hex << std::bit_cast<uint32_t>(in[i]);
    }
  }
}

}  // namespace
}  // namespace ztier
