// The GPT example's CUDA kernels (examples/gpt/cuda_kernels.cu) against the
// CPU kernels (the reference, examples/gpt/cpu_kernels.cc) on random inputs:
// every Kernels method, forward outputs and accumulated grads, several
// shapes including T = 1024 and head size 128. Backward grads start from
// random values on both sides, so the += contract is checked too.
//
// Tolerance: |gpu - cpu| <= atol + rtol * |cpu| per element, with
//   exact bits        ToFloat, ToBf16 (finite and infinite inputs; NaN stays NaN),
//                     Zero, Accumulate, Residual, Encoder;
//   atol 1e-5 rtol 1e-5   elementwise math with transcendental functions (GELU);
//   atol 1e-4 rtol 1e-4   reductions over a row or a column (layernorm,
//                     softmax, cross-entropy, attention, encoder backward);
//   atol 1e-3 rtol 1e-4   matmuls (sums of up to 1024 products of inputs in
//                     [-1, 1), summed in a different order by cuBLAS);
//   atol 1e-12 rtol 1e-4  cross-entropy's dlogits, (softmax - onehot) * dloss:
//                     most are far below 1e-4 at large V, so an absolute
//                     tolerance would let a kernel that writes 0 pass; each
//                     element is held to its own magnitude instead.
// Skips without a CUDA device.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "client/ztier.h"
#include "common/bf16.h"
#include "examples/gpt/kernels.h"

namespace ztier::gpt {
namespace {

struct Tolerance {
  float atol, rtol;
};
constexpr Tolerance kExact{0.0f, 0.0f};
constexpr Tolerance kElementwise{1e-5f, 1e-5f};
constexpr Tolerance kReduction{1e-4f, 1e-4f};
constexpr Tolerance kMatmul{1e-3f, 1e-4f};
// bf16 matmuls: the same rounded operands on both sides (exact products),
// but tensor cores need not round each fp32 addition to nearest: 10x.
constexpr Tolerance kMatmulBf16{1e-2f, 1e-3f};
constexpr Tolerance kProbability{1e-12f, 1e-4f};

class CudaKernelsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<std::unique_ptr<client::Device>> d = client::MakeCudaDevice(0);
    if (!d.ok() && d.status().code() == StatusCode::kUnavailable) {
      GTEST_SKIP() << d.status().message();
    }
    ASSERT_TRUE(d.ok()) << d.status();
    device_ = std::move(*d);
    Result<std::unique_ptr<Kernels>> k = MakeCudaKernels(*device_);
    if (!k.ok() && k.status().code() == StatusCode::kUnavailable) {
      GTEST_SKIP() << k.status().message();
    }
    ASSERT_TRUE(k.ok()) << k.status();
    gpu_ = std::move(*k);
    cpu_ = MakeCpuKernels();
    ASSERT_NE(cpu_, nullptr);
  }

  void TearDown() override {
    if (device_ == nullptr) return;
    Status s = device_->Synchronize(client::Stream::kCompute);
    EXPECT_TRUE(s.ok()) << s;
    for (void* p : allocations_) device_->Free(p);
  }

  std::vector<float> Random(size_t n, float lo = -1.0f, float hi = 1.0f) {
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(n);
    for (float& x : v) x = dist(rng_);
    return v;
  }
  std::vector<int32_t> RandomInts(size_t n, int32_t below) {
    std::uniform_int_distribution<int32_t> dist(0, below - 1);
    std::vector<int32_t> v(n);
    for (int32_t& x : v) x = dist(rng_);
    return v;
  }

  // A device copy of `host` (any trivially copyable element type).
  template <typename T>
  T* Up(const std::vector<T>& host) {
    const size_t bytes = host.size() * sizeof(T);
    Result<void*> p = device_->Allocate(bytes, client::MemoryPurpose::kOther);
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return nullptr;
    allocations_.push_back(*p);
    Status s = device_->CopyToDevice(*p, host.data(), bytes, client::Stream::kCompute);
    EXPECT_TRUE(s.ok()) << s;
    // The host vector may go away before the copy ran.
    s = device_->Synchronize(client::Stream::kCompute);
    EXPECT_TRUE(s.ok()) << s;
    return static_cast<T*>(*p);
  }

  // The device buffer's contents once the compute stream is done.
  template <typename T>
  std::vector<T> Down(const T* device_ptr, size_t n) {
    std::vector<T> host(n);
    Status s =
        device_->CopyToHost(host.data(), device_ptr, n * sizeof(T), client::Stream::kCompute);
    EXPECT_TRUE(s.ok()) << s;
    s = device_->Synchronize(client::Stream::kCompute);
    EXPECT_TRUE(s.ok()) << s;
    return host;
  }

  void CheckMatmul(MatmulMath math);

  static void ExpectNear(const std::vector<float>& gpu, const std::vector<float>& cpu,
                         Tolerance tol, const std::string& what) {
    ASSERT_EQ(gpu.size(), cpu.size()) << what;
    size_t bad = 0;
    double worst = 0;
    for (size_t i = 0; i < gpu.size(); ++i) {
      const float want = cpu[i], got = gpu[i];
      if (std::isnan(want) && std::isnan(got)) continue;
      const double err = std::fabs(static_cast<double>(got) - want);
      const double allowed = tol.atol + tol.rtol * std::fabs(want);
      if (!(err <= allowed)) {
        if (bad < 5) {
          ADD_FAILURE() << what << "[" << i << "]: gpu " << got << ", cpu " << want << ", |diff| "
                        << err << " > " << allowed;
        }
        ++bad;
      }
      if (std::isfinite(err)) worst = std::max(worst, err);
    }
    EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << gpu.size()
                       << " elements past tolerance (atol " << tol.atol << ", rtol " << tol.rtol
                       << "); largest |diff| " << worst;
  }

  std::mt19937 rng_{20240601};
  std::unique_ptr<client::Device> device_;
  std::unique_ptr<Kernels> gpu_, cpu_;
  std::vector<void*> allocations_;
};

TEST_F(CudaKernelsTest, ToFloatAndToBf16) {
  std::vector<float> in = Random(100003, -1e4f, 1e4f);
  for (uint32_t bits :
       {0x3f808000u, 0x3f818000u, 0x3fffffffu, 0x7f7fffffu, 0x00008000u, 0x00018000u, 0x807fffffu,
        0x7f800000u, 0xff800000u, 0x80000000u, 0x7fc00001u, 0xffa00000u}) {
    in.push_back(std::bit_cast<float>(bits));
  }
  std::mt19937 bits_rng(5);
  for (int i = 0; i < 50000; ++i)
    in.push_back(std::bit_cast<float>(static_cast<uint32_t>(bits_rng())));
  const size_t n = in.size();

  std::vector<bf16> cpu_b(n);
  cpu_->ToBf16(cpu_b.data(), in.data(), n);
  float* d_in = Up(in);
  bf16* d_b = Up(std::vector<bf16>(n, bf16{0}));
  gpu_->ToBf16(d_b, d_in, n);
  std::vector<bf16> gpu_b = Down(d_b, n);
  size_t bad = 0;
  for (size_t i = 0; i < n; ++i) {
    const bool nan_in = std::isnan(in[i]);
    // Both backends follow common/bf16.h bit for bit (NaN: any quiet NaN).
    const bool same = nan_in ? std::isnan(Bf16ToFloat(gpu_b[i]))
                             : gpu_b[i] == cpu_b[i] && gpu_b[i] == FloatToBf16(in[i]);
    if (!same && bad++ < 5) {
      ADD_FAILURE() << "ToBf16 of bits 0x" << std::hex << std::bit_cast<uint32_t>(in[i])
                    << ": gpu 0x" << gpu_b[i].bits << ", cpu 0x" << cpu_b[i].bits
                    << ", common/bf16.h 0x" << FloatToBf16(in[i]).bits;
    }
  }
  EXPECT_EQ(bad, 0u);

  std::vector<float> cpu_f(n);
  cpu_->ToFloat(cpu_f.data(), cpu_b.data(), n);
  float* d_f = Up(std::vector<float>(n, 7.0f));
  gpu_->ToFloat(d_f, Up(cpu_b), n);
  std::vector<float> gpu_f = Down(d_f, n);
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(std::bit_cast<uint32_t>(gpu_f[i]), std::bit_cast<uint32_t>(cpu_f[i])) << i;
  }
}

TEST_F(CudaKernelsTest, ZeroAccumulateResidual) {
  const size_t n = (size_t{1} << 20) + 17;
  std::vector<float> a = Random(n), b = Random(n);

  float* d = Up(a);
  gpu_->Zero(d, n);
  ExpectNear(Down(d, n), std::vector<float>(n, 0.0f), kExact, "Zero");

  std::vector<float> acc = a;
  cpu_->Accumulate(acc.data(), b.data(), n);
  float* d_acc = Up(a);
  gpu_->Accumulate(d_acc, Up(b), n);
  ExpectNear(Down(d_acc, n), acc, kExact, "Accumulate");

  std::vector<float> res(n);
  cpu_->Residual(res.data(), a.data(), b.data(), n);
  float* d_res = Up(std::vector<float>(n, 3.0f));
  gpu_->Residual(d_res, Up(a), Up(b), n);
  ExpectNear(Down(d_res, n), res, kExact, "Residual");
}

TEST_F(CudaKernelsTest, EncoderForwardBackward) {
  const int B = 3, T = 64, C = 96, V = 50;
  std::vector<int32_t> tokens = RandomInts(static_cast<size_t>(B) * T, V);
  std::vector<float> wte = Random(static_cast<size_t>(V) * C),
                     wpe = Random(static_cast<size_t>(T) * C);
  const size_t n = static_cast<size_t>(B) * T * C;

  std::vector<float> out(n);
  cpu_->Encoder(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
  float* d_out = Up(std::vector<float>(n, 1.0f));
  int32_t* d_tokens = Up(tokens);
  gpu_->Encoder(d_out, d_tokens, Up(wte), Up(wpe), B, T, C);
  ExpectNear(Down(d_out, n), out, kExact, "Encoder out");

  std::vector<float> dout = Random(n);
  std::vector<float> dwte = Random(wte.size()), dwpe = Random(wpe.size());
  float* d_dwte = Up(dwte);
  float* d_dwpe = Up(dwpe);
  cpu_->EncoderBackward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C);
  gpu_->EncoderBackward(d_dwte, d_dwpe, Up(dout), d_tokens, B, T, C);
  ExpectNear(Down(d_dwte, dwte.size()), dwte, kReduction, "EncoderBackward dwte");
  ExpectNear(Down(d_dwpe, dwpe.size()), dwpe, kReduction, "EncoderBackward dwpe");
}

TEST_F(CudaKernelsTest, LayerNormForwardBackward) {
  for (auto [N, C] :
       {std::pair{1, 1}, std::pair{37, 64}, std::pair{256, 768}, std::pair{5, 1000}}) {
    const std::string shape = "N=" + std::to_string(N) + " C=" + std::to_string(C);
    const size_t nc = static_cast<size_t>(N) * C;
    std::vector<float> inp = Random(nc, -3.0f, 3.0f), w = Random(C), b = Random(C);
    std::vector<float> out(nc), mean(N), rstd(N);
    cpu_->LayerNorm(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), N, C);
    float* d_out = Up(std::vector<float>(nc));
    float* d_mean = Up(std::vector<float>(N));
    float* d_rstd = Up(std::vector<float>(N));
    float* d_inp = Up(inp);
    float* d_w = Up(w);
    gpu_->LayerNorm(d_out, d_mean, d_rstd, d_inp, d_w, Up(b), N, C);
    ExpectNear(Down(d_out, nc), out, kReduction, "LayerNorm out " + shape);
    ExpectNear(Down(d_mean, N), mean, kReduction, "LayerNorm mean " + shape);
    ExpectNear(Down(d_rstd, N), rstd, kReduction, "LayerNorm rstd " + shape);

    std::vector<float> dout = Random(nc);
    std::vector<float> dinp = Random(nc), dw = Random(C), db = Random(C);
    float* d_dinp = Up(dinp);
    float* d_dw = Up(dw);
    float* d_db = Up(db);
    cpu_->LayerNormBackward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(),
                            mean.data(), rstd.data(), N, C);
    // The GPU uses its own mean and rstd, as the model does.
    gpu_->LayerNormBackward(d_dinp, d_dw, d_db, Up(dout), d_inp, d_w, d_mean, d_rstd, N, C);
    ExpectNear(Down(d_dinp, nc), dinp, kReduction, "LayerNormBackward dinp " + shape);
    ExpectNear(Down(d_dw, C), dw, kReduction, "LayerNormBackward dweight " + shape);
    ExpectNear(Down(d_db, C), db, kReduction, "LayerNormBackward dbias " + shape);
  }
}

// Both backends with `math`; with kBf16 the CPU rounds the same operands
// (cpu_kernels.cc), so they still agree to summation order.
void CudaKernelsTest::CheckMatmul(MatmulMath math) {
  const Tolerance kTol = math == MatmulMath::kBf16 ? kMatmulBf16 : kMatmul;
  struct Shape {
    int N, C, OC;
    bool bias;
  };
  for (const Shape& s : {Shape{1, 1, 1, true}, Shape{64, 96, 288, true}, Shape{130, 256, 64, false},
                         Shape{512, 1024, 256, true}, Shape{33, 17, 1000, false}}) {
    const std::string shape = "N=" + std::to_string(s.N) + " C=" + std::to_string(s.C) +
                              " OC=" + std::to_string(s.OC) + (s.bias ? " bias" : " no bias") +
                              (math == MatmulMath::kBf16 ? " bf16" : " fp32");
    const size_t nc = static_cast<size_t>(s.N) * s.C, noc = static_cast<size_t>(s.N) * s.OC;
    const size_t occ = static_cast<size_t>(s.OC) * s.C;
    const size_t largest = std::max({nc, noc, occ});
    ASSERT_TRUE(cpu_->SetMatmul(math, largest).ok());
    const Status reserved = gpu_->SetMatmul(math, largest);
    ASSERT_TRUE(reserved.ok()) << reserved;
    std::vector<float> inp = Random(nc), w = Random(occ), bias = Random(s.OC);
    std::vector<float> out(noc);
    cpu_->Matmul(out.data(), inp.data(), w.data(), s.bias ? bias.data() : nullptr, s.N, s.C, s.OC);
    float* d_out = Up(std::vector<float>(noc, 9.0f));
    float* d_inp = Up(inp);
    float* d_w = Up(w);
    gpu_->Matmul(d_out, d_inp, d_w, s.bias ? Up(bias) : nullptr, s.N, s.C, s.OC);
    ExpectNear(Down(d_out, noc), out, kTol, "Matmul out " + shape);

    std::vector<float> dout = Random(noc);
    std::vector<float> dinp = Random(nc), dw = Random(occ), db = Random(s.OC);
    float* d_dinp = Up(dinp);
    float* d_dw = Up(dw);
    float* d_db = Up(db);
    cpu_->MatmulBackward(dinp.data(), dw.data(), s.bias ? db.data() : nullptr, dout.data(),
                         inp.data(), w.data(), s.N, s.C, s.OC);
    gpu_->MatmulBackward(d_dinp, d_dw, s.bias ? d_db : nullptr, Up(dout), d_inp, d_w, s.N, s.C,
                         s.OC);
    ExpectNear(Down(d_dinp, nc), dinp, kTol, "MatmulBackward dinp " + shape);
    ExpectNear(Down(d_dw, occ), dw, kTol, "MatmulBackward dweight " + shape);
    ExpectNear(Down(d_db, s.OC), db, kMatmul, "MatmulBackward dbias " + shape);
  }
}

TEST_F(CudaKernelsTest, MatmulForwardBackward) { CheckMatmul(MatmulMath::kFp32); }
TEST_F(CudaKernelsTest, Bf16MatmulForwardBackward) { CheckMatmul(MatmulMath::kBf16); }

TEST_F(CudaKernelsTest, AttentionForwardBackward) {
  struct Shape {
    int B, T, C, NH;
  };
  // Head sizes 16, 32, 64, 128; T from 1 to 1024.
  for (const Shape& s :
       {Shape{1, 1, 64, 4}, Shape{2, 64, 128, 4}, Shape{3, 100, 192, 3}, Shape{1, 1024, 256, 2}}) {
    const std::string shape = "B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) +
                              " C=" + std::to_string(s.C) + " NH=" + std::to_string(s.NH);
    const size_t btc = static_cast<size_t>(s.B) * s.T * s.C;
    const size_t att_n = static_cast<size_t>(s.B) * s.NH * s.T * s.T;
    std::vector<float> qkv = Random(3 * btc);
    std::vector<float> out(btc), att(att_n);
    cpu_->Attention(out.data(), att.data(), qkv.data(), s.B, s.T, s.C, s.NH);
    float* d_out = Up(std::vector<float>(btc, 5.0f));
    float* d_att = Up(std::vector<float>(att_n, 5.0f));
    float* d_qkv = Up(qkv);
    gpu_->Attention(d_out, d_att, d_qkv, s.B, s.T, s.C, s.NH);
    ExpectNear(Down(d_out, btc), out, kReduction, "Attention out " + shape);
    ExpectNear(Down(d_att, att_n), att, kReduction, "Attention att " + shape);

    std::vector<float> dout = Random(btc);
    std::vector<float> dqkv = Random(3 * btc);
    std::vector<float> scratch(att_n);
    float* d_dqkv = Up(dqkv);
    float* d_scratch = Up(std::vector<float>(att_n, 0.0f));
    cpu_->AttentionBackward(dqkv.data(), scratch.data(), dout.data(), qkv.data(), att.data(), s.B,
                            s.T, s.C, s.NH);
    gpu_->AttentionBackward(d_dqkv, d_scratch, Up(dout), d_qkv, d_att, s.B, s.T, s.C, s.NH);
    ExpectNear(Down(d_dqkv, 3 * btc), dqkv, kReduction, "AttentionBackward dqkv " + shape);
  }
}

TEST_F(CudaKernelsTest, GeluForwardBackward) {
  const size_t n = (size_t{1} << 18) + 5;
  std::vector<float> inp = Random(n, -6.0f, 6.0f);
  for (float x : {0.0f, -0.0f, 10.0f, -10.0f, 30.0f, -30.0f}) inp.push_back(x);
  const size_t m = inp.size();
  std::vector<float> out(m);
  cpu_->Gelu(out.data(), inp.data(), m);
  float* d_out = Up(std::vector<float>(m));
  float* d_inp = Up(inp);
  gpu_->Gelu(d_out, d_inp, m);
  ExpectNear(Down(d_out, m), out, kElementwise, "Gelu");

  std::vector<float> dout = Random(m), dinp = Random(m);
  float* d_dinp = Up(dinp);
  cpu_->GeluBackward(dinp.data(), inp.data(), dout.data(), m);
  gpu_->GeluBackward(d_dinp, d_inp, Up(dout), m);
  ExpectNear(Down(d_dinp, m), dinp, kElementwise, "GeluBackward");
}

TEST_F(CudaKernelsTest, CrossEntropy) {
  for (auto [N, V] : {std::pair{1, 2}, std::pair{64, 256}, std::pair{7, 50257}}) {
    const std::string shape = "N=" + std::to_string(N) + " V=" + std::to_string(V);
    const size_t nv = static_cast<size_t>(N) * V;
    std::vector<float> logits = Random(nv, -8.0f, 8.0f);
    std::vector<int32_t> targets = RandomInts(N, V);
    const float dloss = 1.0f / N;
    std::vector<float> losses(N), dlogits(nv);
    cpu_->CrossEntropy(losses.data(), dlogits.data(), logits.data(), targets.data(), N, V, dloss);
    float* d_losses = Up(std::vector<float>(N, 4.0f));
    float* d_dlogits = Up(std::vector<float>(nv, 4.0f));
    float* d_logits = Up(logits);
    int32_t* d_targets = Up(targets);
    gpu_->CrossEntropy(d_losses, d_dlogits, d_logits, d_targets, N, V, dloss);
    ExpectNear(Down(d_losses, N), losses, kReduction, "CrossEntropy losses " + shape);
    const std::vector<float> got = Down(d_dlogits, nv);
    ExpectNear(got, dlogits, kProbability, "CrossEntropy dlogits " + shape);
    // Each row of (softmax - onehot) sums to 0.
    for (int n = 0; n < N; ++n) {
      double sum = 0, scale = 0;
      for (int v = 0; v < V; ++v) {
        sum += got[static_cast<size_t>(n) * V + v];
        scale += std::fabs(got[static_cast<size_t>(n) * V + v]);
      }
      EXPECT_LE(std::fabs(sum), 1e-5 * scale + 1e-12)
          << "CrossEntropy dlogits row " << n << " " << shape << " sums to " << sum;
    }

    // Forward only: dlogits may be null.
    float* d_losses2 = Up(std::vector<float>(N, 4.0f));
    gpu_->CrossEntropy(d_losses2, nullptr, d_logits, d_targets, N, V, dloss);
    ExpectNear(Down(d_losses2, N), losses, kReduction, "CrossEntropy forward only " + shape);
  }
}

}  // namespace
}  // namespace ztier::gpt
