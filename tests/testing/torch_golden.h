// Test support: the golden vectors recorded from PyTorch's optimizers
// (tests/cpu_adam/testdata/torch_golden.bin, written by
// tests/cpu_adam/make_torch_golden.py), the input generator both sides share,
// and the tolerance every check against them uses. Header-only; the reader
// is strict (any short or inconsistent file is a test failure with a
// message, never a silent pass).
#ifndef ZTIER_TESTS_TESTING_TORCH_GOLDEN_H_
#define ZTIER_TESTS_TESTING_TORCH_GOLDEN_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "common/bf16.h"
#include "common/status.h"

namespace ztier::testing {

// splitmix64; uniform values in [-scale, scale) from the top 24 bits, each
// computed in double and rounded once to float (as the Python side does).
class GoldenGenerator {
 public:
  GoldenGenerator(uint64_t seed, uint64_t stream) : state_(seed ^ (stream * 0xD1B54A32D192ED03u)) {}
  uint64_t Next() {
    state_ += 0x9E3779B97F4A7C15u;
    uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9u;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBu;
    return z ^ (z >> 31);
  }
  std::vector<float> Values(size_t n, double scale) {
    std::vector<float> out(n);
    for (float& x : out) {
      x = static_cast<float>((static_cast<double>(Next() >> 40) * 0x1p-24 * 2.0 - 1.0) * scale);
    }
    return out;
  }

 private:
  uint64_t state_;
};

struct GoldenStep {
  std::vector<float> params, exp_avg, exp_avg_sq;  // all tensors, concatenated
};

struct GoldenCase {
  std::string name;
  std::vector<uint64_t> sizes;  // numel of each tensor
  bool adamw = true;            // false: Adam (L2 decay)
  bool bf16_grads = false;
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0, clip_norm = 0;
  uint64_t seed = 0;
  std::vector<double> magnitudes;  // of each step's grads
  std::vector<GoldenStep> steps;

  uint64_t total() const {
    uint64_t n = 0;
    for (uint64_t s : sizes) n += s;
    return n;
  }
  std::vector<float> InitialParams() const { return GoldenGenerator(seed, 1).Values(total(), 1.0); }
  // The grads of step `step` (0-based) as PyTorch saw them: every 37th is 0,
  // and rounded through bf16 when the case has bf16 grads.
  std::vector<float> Grads(int step) const {
    std::vector<float> g = GoldenGenerator(seed, 2 + static_cast<uint64_t>(step))
                               .Values(total(), magnitudes[static_cast<size_t>(step)]);
    for (size_t i = 0; i < g.size(); ++i) {
      if (i % 37 == 0) g[i] = 0.0f;
      if (bf16_grads) g[i] = Bf16ToFloat(FloatToBf16(g[i]));
    }
    return g;
  }
};

namespace golden_internal {
class Reader {
 public:
  explicit Reader(std::string_view data) : data_(data) {}
  template <class T>
  bool Get(T* out) {
    if (data_.size() - pos_ < sizeof(T)) return false;
    std::memcpy(out, data_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  bool Floats(std::vector<float>* out, size_t n) {
    if ((data_.size() - pos_) / 4 < n) return false;
    out->resize(n);
    std::memcpy(out->data(), data_.data() + pos_, n * 4);
    pos_ += n * 4;
    return true;
  }
  bool Bytes(std::string* out, size_t n) {
    if (data_.size() - pos_ < n) return false;
    out->assign(data_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  bool done() const { return pos_ == data_.size(); }

 private:
  std::string_view data_;
  size_t pos_ = 0;
};
}  // namespace golden_internal

// Reads every case of the file. Errors: NotFound, Corruption naming what
// is wrong (including inputs this generator does not reproduce).
inline Result<std::vector<GoldenCase>> LoadTorchGolden(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound("cannot open " + path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string bytes = buffer.str();
  golden_internal::Reader r(bytes);
  auto bad = [&](const std::string& what) { return Status::Corruption(path + ": " + what); };
  std::string magic;
  uint32_t count = 0;
  if (!r.Bytes(&magic, 8) || magic != "ZTGOLD01" || !r.Get(&count) || count == 0 || count > 64) {
    return bad("not a golden-vector file (magic ZTGOLD01, 1-64 cases)");
  }
  std::vector<GoldenCase> cases(count);
  for (GoldenCase& c : cases) {
    std::string name;
    uint32_t tensors = 0;
    if (!r.Bytes(&name, 32) || !r.Get(&tensors) || tensors == 0 || tensors > 16) {
      return bad("a case header is short");
    }
    c.name = name.substr(0, name.find('\0'));
    c.sizes.resize(tensors);
    for (uint64_t& s : c.sizes) {
      if (!r.Get(&s) || s == 0 || s > (uint64_t{1} << 24)) return bad(c.name + ": tensor sizes");
    }
    int32_t mode = 0, bf16 = 0, steps = 0;
    if (!r.Get(&mode) || !r.Get(&bf16) || !r.Get(&steps) || steps < 1 || steps > 64) {
      return bad(c.name + ": mode and steps");
    }
    c.adamw = mode == 0;
    c.bf16_grads = bf16 != 0;
    for (double* d : {&c.lr, &c.beta1, &c.beta2, &c.eps, &c.weight_decay, &c.clip_norm}) {
      if (!r.Get(d)) return bad(c.name + ": hyper-parameters");
    }
    if (!r.Get(&c.seed)) return bad(c.name + ": seed");
    c.magnitudes.resize(static_cast<size_t>(steps));
    for (double& m : c.magnitudes) {
      if (!r.Get(&m)) return bad(c.name + ": grad magnitudes");
    }
    std::vector<float> first4;
    if (!r.Floats(&first4, 4)) return bad(c.name + ": initial params check");
    const std::vector<float> mine = c.InitialParams();
    if (std::memcmp(first4.data(), mine.data(), 4 * sizeof(float)) != 0) {
      return bad(c.name + ": the input generator disagrees with the one that wrote the file");
    }
    c.steps.resize(static_cast<size_t>(steps));
    for (GoldenStep& s : c.steps) {
      if (!r.Floats(&s.params, c.total()) || !r.Floats(&s.exp_avg, c.total()) ||
          !r.Floats(&s.exp_avg_sq, c.total())) {
        return bad(c.name + ": the recorded states are short");
      }
    }
  }
  if (!r.done()) return bad("bytes after the last case");
  return cases;
}

// Compares a state reached after `step` (0-based) with PyTorch's. Both sides
// compute in fp32 in a different operation order (PyTorch: lerp for m, a
// separate decay multiply, divide by sqrt(bc2)), so they differ by a few ulps
// of the terms per step. Tolerances: m and v, 1e-5 of the value plus 1e-5 of
// the array's RMS; params, 2e-3 of how far the param moved since step 0
// plus a few ulps of the param per step. A formula difference (a beta
// swapped, bias correction, eps placement, decay placement, the clipping
// coefficient) is orders of magnitude larger. Returns "" or the first
// mismatch of each array, named.
inline std::string CompareWithTorch(const GoldenCase& c, int step, const std::vector<float>& p0,
                                    const float* params, const float* exp_avg,
                                    const float* exp_avg_sq) {
  const GoldenStep& ref = c.steps[static_cast<size_t>(step)];
  const size_t n = c.total();
  auto rms = [n](const std::vector<float>& v) {
    double s = 0;
    for (float x : v) s += double{x} * x;
    return std::sqrt(s / static_cast<double>(n));
  };
  std::string out;
  auto check = [&](const char* what, const float* got, const std::vector<float>& want, auto tol) {
    for (size_t i = 0; i < n; ++i) {
      const double t = tol(i);
      if (!(std::fabs(double{got[i]} - want[i]) <= t)) {  // NaN fails too
        std::ostringstream msg;
        msg.precision(9);
        msg << c.name << " step " << step + 1 << ": " << what << "[" << i << "] = " << got[i]
            << ", torch " << want[i] << " (tolerance " << t << "); ";
        out += msg.str();
        return;
      }
    }
  };
  const double m_rms = rms(ref.exp_avg), v_rms = rms(ref.exp_avg_sq);
  check("exp_avg", exp_avg, ref.exp_avg,
        [&](size_t i) { return 1e-5 * (std::fabs(ref.exp_avg[i]) + m_rms); });
  check("exp_avg_sq", exp_avg_sq, ref.exp_avg_sq,
        [&](size_t i) { return 1e-5 * (std::fabs(ref.exp_avg_sq[i]) + v_rms); });
  check("param", params, ref.params, [&](size_t i) {
    const double moved = std::fabs(double{ref.params[i]} - p0[i]);
    return 2e-3 * moved + 2.5e-7 * std::fabs(ref.params[i]) * (step + 1);
  });
  return out;
}

}  // namespace ztier::testing

#endif  // ZTIER_TESTS_TESTING_TORCH_GOLDEN_H_
