// cpu_adam against PyTorch's own AdamW and Adam (torch.optim, CPU, fp32,
// fused and not), where a Python with torch is available: $ZTIER_TORCH_PYTHON,
// the project's .venv (scripts/python_env.sh), or python3. Skips, with the
// reason, when none of them can import torch, unless ZTIER_REQUIRE_TORCH=1
// (CI sets it): then that is a failure.
//
// Tolerance: both sides compute in fp32 with different operation order
// (PyTorch: lerp for m, divide by sqrt(bc2), a separate decay multiply), so
// they agree to a few ulps of the terms involved per step. Three steps are
// compared, each on the state both sides reached (no reset), and we allow
// 1e-5 of the largest terms the element has seen up to that step (a moment
// can cancel to a small value while carrying the error of larger earlier
// ones): a formula difference (bias correction, decay placement, L2 vs
// decoupled) shows up as > 1e-3.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/bf16.h"
#include "cpu_adam/adamw.h"

namespace ztier::cpu_adam {
namespace {

namespace fs = std::filesystem;

std::string Quote(const std::string& s) { return "'" + s + "'"; }

// A Python that can import torch and numpy, or empty.
std::string FindTorchPython() {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("ZTIER_TORCH_PYTHON")) candidates.push_back(env);
  candidates.push_back(std::string(ZTIER_SOURCE_DIR) + "/.venv/bin/python");
  candidates.push_back("python3");
  for (const std::string& py : candidates) {
    // A first import of torch can take a while on a cold disk; none takes 2 minutes.
    const std::string cmd =
        "timeout -k 10 120 " + Quote(py) + " -c 'import torch, numpy' >/dev/null 2>&1";
    if (std::system(cmd.c_str()) == 0) return py;
  }
  return {};
}

template <class T>
void Put(std::ofstream& out, const T& v) {
  out.write(reinterpret_cast<const char*>(&v), sizeof(v));
}

void PutArray(std::ofstream& out, const std::vector<float>& v) {
  out.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * 4));
}

struct TorchCase {
  Mode mode;
  const char* impl;  // "fused" or "plain"
};

void PrintTo(const TorchCase& c, std::ostream* os) {
  *os << (c.mode == Mode::kAdamW ? "AdamW " : "Adam ") << c.impl;
}

class TorchReferenceTest : public ::testing::TestWithParam<TorchCase> {};

TEST_P(TorchReferenceTest, MatchesTorchOptim) {
  static const std::string python = FindTorchPython();
  if (python.empty()) {
    const char* require = std::getenv("ZTIER_REQUIRE_TORCH");
    if (require != nullptr && std::string(require) == "1") {
      FAIL() << "ZTIER_REQUIRE_TORCH=1 but no Python can import torch: run "
                "scripts/python_env.sh or set ZTIER_TORCH_PYTHON";
    }
    GTEST_SKIP() << "no Python with torch: run scripts/python_env.sh or set ZTIER_TORCH_PYTHON";
  }
  const TorchCase tc = GetParam();
  const size_t n = 3 * kTileElements + 1234;
  const int steps = 3;
  const Hyper h{.lr = 1e-2f,
                .beta1 = 0.9f,
                .beta2 = 0.99f,
                .eps = 1e-8f,
                .weight_decay = 0.05f,
                .mode = tc.mode};
  std::mt19937_64 rng(std::random_device{}());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> p(n), m(n), v(n);
  std::vector<std::vector<float>> grads32(steps, std::vector<float>(n));
  std::vector<std::vector<bf16>> grads16(steps, std::vector<bf16>(n));
  for (size_t i = 0; i < n; ++i) {
    p[i] = normal(rng);
    m[i] = 0.1f * normal(rng);
    v[i] = 0.01f * std::fabs(normal(rng));
  }
  for (int s = 0; s < steps; ++s) {
    for (size_t i = 0; i < n; ++i) {
      grads16[s][i] = FloatToBf16(normal(rng));
      grads32[s][i] = Bf16ToFloat(grads16[s][i]);  // torch gets the same values in fp32
    }
  }

  const fs::path dir = fs::temp_directory_path() / ("ztier_torch_ref_" + std::to_string(getpid()));
  fs::create_directories(dir);
  const fs::path in_path = dir / "in.bin", out_path = dir / "out.bin";
  {
    std::ofstream out(in_path, std::ios::binary);
    Put(out, static_cast<int64_t>(n));
    Put(out, static_cast<int64_t>(steps));
    Put(out, static_cast<int64_t>(tc.mode == Mode::kAdamW ? 1 : 0));
    for (double d :
         {double{h.lr}, double{h.beta1}, double{h.beta2}, double{h.eps}, double{h.weight_decay}}) {
      Put(out, d);
    }
    PutArray(out, p);
    PutArray(out, m);
    PutArray(out, v);
    for (const auto& g : grads32) PutArray(out, g);
  }
  const std::string cmd = "timeout -k 10 240 " + Quote(python) + " " +
                          Quote(std::string(ZTIER_SOURCE_DIR) + "/tests/cpu_adam/torch_adamw.py") +
                          " " + Quote(in_path) + " " + Quote(out_path) + " " + tc.impl;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(out_path, std::ios::binary);
  std::vector<float> tp(n), tm(n), tv(n);

  Result<Executor> exec = Executor::Create({.threads = 2});
  ASSERT_TRUE(exec.ok());
  std::vector<double> m_scale(n, 0.0), v_scale(n, 0.0), p_scale(n, 0.0);
  for (int s = 0; s < steps; ++s) {
    const std::vector<float> p0 = p, m0 = m, v0 = v;
    Result<StepResult> r = Step(h, {.step = s + 1},
                                Shard{.count = n,
                                      .grads = grads16[s].data(),
                                      .grad_type = GradType::kBFloat16,
                                      .params = p.data(),
                                      .exp_avg = m.data(),
                                      .exp_avg_sq = v.data()},
                                *exec);
    ASSERT_TRUE(r.ok()) << r.status();
    for (auto* t : {&tp, &tm, &tv}) {
      in.read(reinterpret_cast<char*>(t->data()), static_cast<std::streamsize>(n * 4));
    }
    ASSERT_TRUE(in.good()) << "short output from " << cmd;
    for (size_t i = 0; i < n; ++i) {
      const double g = std::fabs(grads32[s][i]) +
                       (tc.mode == Mode::kAdam ? h.weight_decay * std::fabs(p0[i]) : 0.0);
      // The sides drift apart by ulps of the largest terms an element has
      // seen so far, not of this step's (m can cancel to a small value).
      m_scale[i] = std::max(m_scale[i], std::fabs(m0[i]) + g);
      v_scale[i] = std::max(v_scale[i], v0[i] + g * g);
      p_scale[i] = std::max(
          p_scale[i], std::fabs(p0[i]) + h.lr * (1.0 + std::fabs(m[i]) / (std::sqrt(v[i]) + 1e-8)));
      const double m_tol = 1e-5 * m_scale[i] + 1e-12;
      const double v_tol = 1e-5 * v_scale[i] + 1e-12;
      const double p_tol = 1e-5 * p_scale[i] + 1e-12;
      ASSERT_NEAR(m[i], tm[i], m_tol) << "exp_avg, step " << s + 1 << ", element " << i;
      ASSERT_NEAR(v[i], tv[i], v_tol) << "exp_avg_sq, step " << s + 1 << ", element " << i;
      ASSERT_NEAR(p[i], tp[i], p_tol) << "param, step " << s + 1 << ", element " << i;
    }
  }
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Torch, TorchReferenceTest,
                         ::testing::Values(TorchCase{Mode::kAdamW, "fused"},
                                           TorchCase{Mode::kAdamW, "plain"},
                                           TorchCase{Mode::kAdam, "fused"},
                                           TorchCase{Mode::kAdam, "plain"}),
                         [](const ::testing::TestParamInfo<TorchCase>& param_info) {
                           const TorchCase& c = param_info.param;
                           return std::string(c.mode == Mode::kAdamW ? "AdamW_" : "Adam_") + c.impl;
                         });

}  // namespace
}  // namespace ztier::cpu_adam
