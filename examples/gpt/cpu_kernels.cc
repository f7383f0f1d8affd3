// The GPT example's CPU kernels: the reference backend of Kernels (see
// kernels.h for the shapes and the accumulate/overwrite contract), written
// after the math of llm.c's train_gpt2.c and parallelised with oneTBB.
//
// Determinism. Every output element is computed by exactly one task, and
// its floating-point operations run in an order fixed by the shapes alone
// (a sum over C runs c = 0, 1, ..., a sum over rows runs n = 0, 1, ...),
// whichever thread runs the task and however the range is split. Work is
// split over outputs: rows for the forward and for dinp, output channels for
// dweight and dbias, vocabulary rows for the embedding grads. No float is
// reduced across threads and no atomics are used. Vector code only ever
// runs independent outputs side by side (the inner loops run over
// contiguous outputs, never over a sum), and ISO C++ mode keeps the
// compiler from fusing multiply-adds, so the bits do not depend on the
// vector width either.
//
// Speed. The matmuls dominate. Their inner loops have compile-time trip
// counts over contiguous outputs (kLanes floats, with a runtime-count tail),
// so g++ -O2 vectorises them without -march flags; a task keeps a tile of
// rows x kLanes accumulators in L1 while it streams the shared operand.
//
// Thread safety: one object is used by one thread at a time (it keeps a
// transpose buffer); the kernels themselves fan out to oneTBB's arena.
// Failure: none at run time. Token ids are the caller's to check (the model
// does, before any kernel runs); a negative token or a target outside
// [0, V) found here is a programmer error and aborts.
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "common/tsan.h"
#include "examples/gpt/kernels.h"

namespace ztier::gpt {
namespace {

// Width of the contiguous output strip the matmul inner loops work on.
constexpr int kLanes = 64;
// Rows of the output one matmul task carries at once (the shared operand is
// loaded once per strip and used kRows times).
constexpr int kRows = 4;
// Elements per task of the element-wise kernels.
constexpr size_t kElementGrain = size_t{1} << 14;
constexpr float kLayerNormEps = 1e-5f;

// The two fan-outs state oneTBB's hand-off for TSan (common/tsan.h).
template <typename F>
void ParallelElements(size_t n, F f) {
  TsanEdge start, done;
  start.Release();
  tbb::parallel_for(tbb::blocked_range<size_t>(0, n, kElementGrain),
                    [&](const tbb::blocked_range<size_t>& r) {
                      start.Acquire();
                      f(r.begin(), r.end());
                      done.Release();
                    });
  done.Acquire();
}

template <typename F>
void ParallelIndices(int n, F f) {
  TsanEdge start, done;
  start.Release();
  tbb::parallel_for(tbb::blocked_range<int>(0, n), [&](const tbb::blocked_range<int>& r) {
    start.Acquire();
    for (int i = r.begin(); i != r.end(); ++i) f(i);
    done.Release();
  });
  done.Acquire();
}

// y[0..kLanes) += a * x[0..kLanes), and its runtime-length tail. The two
// perform the same operations per element.
inline void AxpyStrip(float* __restrict y, const float* __restrict x, float a) {
  for (int i = 0; i < kLanes; ++i) y[i] += a * x[i];
}
inline void AxpyTail(float* __restrict y, const float* __restrict x, float a, int n) {
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}
inline void Axpy(float* __restrict y, const float* __restrict x, float a, int n) {
  if (n == kLanes) {
    AxpyStrip(y, x, a);
  } else {
    AxpyTail(y, x, a, n);
  }
}

// A matmul task's block of outputs: rows x w of them (rows <= kRows,
// w <= kLanes), held in accumulators while the task streams the shared
// operand. The forward, dinp and dweight sums all run through Accumulate, so
// each of their output elements sees the same operations in the same order.
struct Tile {
  static_assert(kRows == 4, "Accumulate's full tile keeps one scalar per row");

  // The tile at the start of the rows_left x cols_left outputs still to cover.
  Tile(int rows_left, int cols_left)
      : rows(std::min(kRows, rows_left)), w(std::min(kLanes, cols_left)) {}

  // Row r of the tile from / to the w floats at src + r * stride.
  void Load(const float* src, size_t stride) {
    for (int r = 0; r < rows; ++r) std::memcpy(acc[r], src + r * stride, w * sizeof(float));
  }
  void Store(float* dst, size_t stride) const {
    for (int r = 0; r < rows; ++r) std::memcpy(dst + r * stride, acc[r], w * sizeof(float));
  }

  // acc[r][0..w) += sum over k = 0, 1, ..., K - 1 (in that order) of
  // a[r * a_row + k * a_k] * b[k * b_k + 0..w): one scalar of `a` per row and
  // step, one contiguous strip of `b` per step, shared by the rows. Neither
  // operand overlaps the accumulators; __restrict tells the compiler so, and
  // the strip loop vectorises without runtime alias checks.
  void Accumulate(int K, const float* __restrict a, size_t a_row, size_t a_k,
                  const float* __restrict b, size_t b_k) {
    if (rows == kRows && w == kLanes) {
      for (int k = 0; k < K; ++k) {
        const float* ak = a + k * a_k;
        const float* bk = b + k * b_k;
        const float a0 = ak[0];
        const float a1 = ak[a_row];
        const float a2 = ak[2 * a_row];
        const float a3 = ak[3 * a_row];
        for (int o = 0; o < kLanes; ++o) {
          const float bo = bk[o];
          acc[0][o] += a0 * bo;
          acc[1][o] += a1 * bo;
          acc[2][o] += a2 * bo;
          acc[3][o] += a3 * bo;
        }
      }
    } else {
      for (int k = 0; k < K; ++k) {
        const float* bk = b + k * b_k;
        for (int r = 0; r < rows; ++r) Axpy(acc[r], bk, a[r * a_row + k * a_k], w);
      }
    }
  }

  const int rows;
  const int w;
  alignas(64) float acc[kRows][kLanes];
};

// The row an attention task owns: tasks run over B * NH * T rows, and task
// (b * NH + h) * T + t is row t of head h in sequence b.
struct HeadRow {
  int b;
  int h;
  int t;
};
inline HeadRow HeadRowOf(int task, int T, int NH) {
  return {task / (T * NH), (task / T) % NH, task % T};
}

// Sequential dot product (a fixed-order sum).
inline float Dot(const float* a, const float* b, int n) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

class CpuKernels final : public Kernels {
 public:
  Status SetMatmul(MatmulMath math, size_t max_operand) override {
    math_ = math;
    max_operand_ = max_operand;
    return Status::Ok();
  }

  void ToFloat(float* out, const bf16* in, size_t n) override {
    ParallelElements(n, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) out[i] = Bf16ToFloat(in[i]);
    });
  }

  void ToBf16(bf16* out, const float* in, size_t n) override {
    ParallelElements(n, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) out[i] = FloatToBf16(in[i]);
    });
  }

  void Zero(float* out, size_t n) override {
    ParallelElements(n,
                     [&](size_t b, size_t e) { std::memset(out + b, 0, (e - b) * sizeof(float)); });
  }

  void Accumulate(float* dst, const float* src, size_t n) override {
    ParallelElements(n, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) dst[i] += src[i];
    });
  }

  void Residual(float* out, const float* a, const float* b, size_t n) override {
    ParallelElements(n, [&](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i) out[i] = a[i] + b[i];
    });
  }

  void Encoder(float* out, const int32_t* tokens, const float* wte, const float* wpe, int B, int T,
               int C) override {
    ParallelIndices(B * T, [&](int row) {
      const int t = row % T;
      const int32_t token = tokens[row];
      ZT_CHECK_MSG(token >= 0, "token ", token, " at position ", row);
      const float* e = wte + static_cast<size_t>(token) * C;
      const float* p = wpe + static_cast<size_t>(t) * C;
      float* o = out + static_cast<size_t>(row) * C;
      for (int c = 0; c < C; ++c) o[c] = e[c] + p[c];
    });
  }

  void EncoderBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B,
                       int T, int C) override {
    const int N = B * T;
    // dwpe: each position t owns its row and sums over b in order.
    ParallelIndices(T, [&](int t) {
      float* d = dwpe + static_cast<size_t>(t) * C;
      for (int b = 0; b < B; ++b) {
        const float* g = dout + (static_cast<size_t>(b) * T + t) * C;
        for (int c = 0; c < C; ++c) d[c] += g[c];
      }
    });
    // dwte: group the positions by token (stable, so each group is in
    // position order), then each group owns its vocabulary row.
    order_.resize(N);
    std::iota(order_.begin(), order_.end(), 0);
    std::stable_sort(order_.begin(), order_.end(),
                     [&](int a, int b) { return tokens[a] < tokens[b]; });
    group_starts_.clear();
    for (int i = 0; i < N; ++i) {
      if (i == 0 || tokens[order_[i]] != tokens[order_[i - 1]]) group_starts_.push_back(i);
    }
    group_starts_.push_back(N);
    const int groups = static_cast<int>(group_starts_.size()) - 1;
    ParallelIndices(groups, [&](int g) {
      const int32_t token = tokens[order_[group_starts_[g]]];
      ZT_CHECK_MSG(token >= 0, "token ", token);
      float* d = dwte + static_cast<size_t>(token) * C;
      for (int i = group_starts_[g]; i < group_starts_[g + 1]; ++i) {
        const float* src = dout + static_cast<size_t>(order_[i]) * C;
        for (int c = 0; c < C; ++c) d[c] += src[c];
      }
    });
  }

  void LayerNorm(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                 const float* bias, int N, int C) override {
    ParallelIndices(N, [&](int n) {
      const float* x = inp + static_cast<size_t>(n) * C;
      float sum = 0.0f;
      for (int c = 0; c < C; ++c) sum += x[c];
      const float m = sum / static_cast<float>(C);
      float var = 0.0f;
      for (int c = 0; c < C; ++c) {
        const float d = x[c] - m;
        var += d * d;
      }
      var /= static_cast<float>(C);
      const float s = 1.0f / std::sqrt(var + kLayerNormEps);
      float* o = out + static_cast<size_t>(n) * C;
      for (int c = 0; c < C; ++c) o[c] = ((x[c] - m) * s) * weight[c] + bias[c];
      mean[n] = m;
      rstd[n] = s;
    });
  }

  void LayerNormBackward(float* dinp, float* dweight, float* dbias, const float* dout,
                         const float* inp, const float* weight, const float* mean,
                         const float* rstd, int N, int C) override {
    // dinp, per row.
    ParallelIndices(N, [&](int n) {
      const size_t row = static_cast<size_t>(n) * C;
      const float* x = inp + row;
      const float* g = dout + row;
      const float m = mean[n];
      const float s = rstd[n];
      float dnorm_mean = 0.0f;
      float dnorm_norm_mean = 0.0f;
      for (int c = 0; c < C; ++c) {
        const float norm = (x[c] - m) * s;
        const float dnorm = weight[c] * g[c];
        dnorm_mean += dnorm;
        dnorm_norm_mean += dnorm * norm;
      }
      dnorm_mean /= static_cast<float>(C);
      dnorm_norm_mean /= static_cast<float>(C);
      float* d = dinp + row;
      for (int c = 0; c < C; ++c) {
        const float norm = (x[c] - m) * s;
        const float dnorm = weight[c] * g[c];
        d[c] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
      }
    });
    // dweight, dbias: each strip of channels owns its outputs and sums the
    // rows in order.
    const int strips = (C + kLanes - 1) / kLanes;
    ParallelIndices(strips, [&](int strip) {
      const int c0 = strip * kLanes;
      const int w = std::min(kLanes, C - c0);
      float* dw = dweight + c0;
      float* db = dbias + c0;
      for (int n = 0; n < N; ++n) {
        const size_t row = static_cast<size_t>(n) * C + c0;
        const float* x = inp + row;
        const float* g = dout + row;
        const float m = mean[n];
        const float s = rstd[n];
        for (int c = 0; c < w; ++c) {
          dw[c] += ((x[c] - m) * s) * g[c];
          db[c] += g[c];
        }
      }
    });
  }

  void Matmul(float* out, const float* inp, const float* weight, const float* bias, int N, int C,
              int OC) override {
    inp = MatmulOperand(inp, static_cast<size_t>(N) * C, &round_inp_);
    weight = MatmulOperand(weight, static_cast<size_t>(OC) * C, &round_weight_);
    // weight^T [C, OC], so that the inner loop runs over contiguous outputs.
    TransposeInto(&transposed_, weight, OC, C);
    const float* wt = transposed_.data();
    const int row_tiles = (N + kRows - 1) / kRows;
    const int strips = (OC + kLanes - 1) / kLanes;
    // Consecutive tasks share a strip of weight^T, which stays in cache.
    ParallelIndices(row_tiles * strips, [&](int task) {
      const int n0 = (task % row_tiles) * kRows;
      const int o0 = (task / row_tiles) * kLanes;
      Tile tile(N - n0, OC - o0);
      for (int r = 0; r < tile.rows; ++r) {
        for (int o = 0; o < tile.w; ++o) tile.acc[r][o] = bias != nullptr ? bias[o0 + o] : 0.0f;
      }
      // out[n, o] = bias[o] + sum over c of inp[n, c] * weight^T[c, o].
      tile.Accumulate(C, inp + static_cast<size_t>(n0) * C, C, 1, wt + o0, OC);
      tile.Store(out + static_cast<size_t>(n0) * OC + o0, OC);
    });
  }

  void MatmulBackward(float* dinp, float* dweight, float* dbias, const float* dout,
                      const float* inp, const float* weight, int N, int C, int OC) override {
    // The products take the operands as Matmul does; dbias sums dout as is.
    const float* dout_m = MatmulOperand(dout, static_cast<size_t>(N) * OC, &round_dout_);
    inp = MatmulOperand(inp, static_cast<size_t>(N) * C, &round_inp_);
    weight = MatmulOperand(weight, static_cast<size_t>(OC) * C, &round_weight_);
    // dinp[n, c] += sum over oc (in order) of dout[n, oc] * weight[oc, c]:
    // tasks own tiles of rows x a strip of channels.
    const int row_tiles = (N + kRows - 1) / kRows;
    const int c_strips = (C + kLanes - 1) / kLanes;
    ParallelIndices(row_tiles * c_strips, [&](int task) {
      const int n0 = (task / c_strips) * kRows;
      const int c0 = (task % c_strips) * kLanes;
      float* d = dinp + static_cast<size_t>(n0) * C + c0;
      Tile tile(N - n0, C - c0);
      tile.Load(d, C);
      tile.Accumulate(OC, dout_m + static_cast<size_t>(n0) * OC, OC, 1, weight + c0, C);
      tile.Store(d, C);
    });

    // dweight[oc, c] += sum over n (in order) of dout[n, oc] * inp[n, c], and
    // dbias[oc] += sum over n of dout[n, oc]: tasks own tiles of output
    // channels x a strip of input channels.
    const int oc_tiles = (OC + kRows - 1) / kRows;
    ParallelIndices(oc_tiles * c_strips, [&](int task) {
      const int o0 = (task / c_strips) * kRows;
      const int c0 = (task % c_strips) * kLanes;
      float* d = dweight + static_cast<size_t>(o0) * C + c0;
      Tile tile(OC - o0, C - c0);
      tile.Load(d, C);
      tile.Accumulate(N, dout_m + o0, 1, OC, inp + c0, C);
      tile.Store(d, C);
      // The first strip of channels also owns the tile's bias grads.
      if (dbias != nullptr && c0 == 0) {
        for (int r = 0; r < tile.rows; ++r) {
          float s = dbias[o0 + r];
          for (int n = 0; n < N; ++n) s += dout[static_cast<size_t>(n) * OC + o0 + r];
          dbias[o0 + r] = s;
        }
      }
    });
  }

  void Attention(float* out, float* att, const float* qkv, int B, int T, int C, int NH) override {
    const int hs = C / NH;
    const size_t C3 = 3 * static_cast<size_t>(C);
    const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
    // One task per (b, h, t): the query row t of head h.
    ParallelIndices(B * NH * T, [&](int task) {
      const auto [b, h, t] = HeadRowOf(task, T, NH);
      const float* base = qkv + static_cast<size_t>(b) * T * C3;
      const float* q = base + t * C3 + static_cast<size_t>(h) * hs;
      float* p = att + static_cast<size_t>(task) * T;
      float max_score = -INFINITY;
      for (int t2 = 0; t2 <= t; ++t2) {
        const float* k = base + t2 * C3 + C + static_cast<size_t>(h) * hs;
        const float score = Dot(q, k, hs) * scale;
        p[t2] = score;
        max_score = std::max(max_score, score);
      }
      float sum = 0.0f;
      for (int t2 = 0; t2 <= t; ++t2) {
        p[t2] = std::exp(p[t2] - max_score);
        sum += p[t2];
      }
      const float inv = 1.0f / sum;
      for (int t2 = 0; t2 <= t; ++t2) p[t2] *= inv;
      for (int t2 = t + 1; t2 < T; ++t2) p[t2] = 0.0f;
      float* o = out + (static_cast<size_t>(b) * T + t) * C + static_cast<size_t>(h) * hs;
      for (int i = 0; i < hs; ++i) o[i] = 0.0f;
      for (int t2 = 0; t2 <= t; ++t2) {
        const float* v = base + t2 * C3 + 2 * static_cast<size_t>(C) + static_cast<size_t>(h) * hs;
        Axpy(o, v, p[t2], hs);
      }
    });
  }

  void AttentionBackward(float* dqkv, float* scratch, const float* dout, const float* qkv,
                         const float* att, int B, int T, int C, int NH) override {
    const int hs = C / NH;
    const size_t C3 = 3 * static_cast<size_t>(C);
    const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
    // Pass 1, one task per query row (b, h, t): the grads of the scaled
    // scores (into scratch, the row's own [T] slice) and dq.
    ParallelIndices(B * NH * T, [&](int task) {
      const auto [b, h, t] = HeadRowOf(task, T, NH);
      const size_t head = static_cast<size_t>(h) * hs;
      const float* base = qkv + static_cast<size_t>(b) * T * C3;
      const float* p = att + static_cast<size_t>(task) * T;
      const float* g = dout + (static_cast<size_t>(b) * T + t) * C + head;
      float* ds = scratch + static_cast<size_t>(task) * T;
      // d(softmax prob t2) = dout . v[t2]
      float weighted = 0.0f;
      for (int t2 = 0; t2 <= t; ++t2) {
        const float* v = base + t2 * C3 + 2 * static_cast<size_t>(C) + head;
        ds[t2] = Dot(g, v, hs);
        weighted += p[t2] * ds[t2];
      }
      // Softmax backward: d(score t2) = p[t2] * (dp[t2] - sum_j p[j] dp[j]),
      // then through the 1/sqrt(hs) scale.
      for (int t2 = 0; t2 <= t; ++t2) ds[t2] = p[t2] * (ds[t2] - weighted) * scale;
      for (int t2 = t + 1; t2 < T; ++t2) ds[t2] = 0.0f;
      float* dq = dqkv + (static_cast<size_t>(b) * T + t) * C3 + head;
      for (int t2 = 0; t2 <= t; ++t2) {
        const float* k = base + t2 * C3 + C + head;
        Axpy(dq, k, ds[t2], hs);
      }
    });
    // Pass 2, one task per key row (b, h, t2): dk and dv gather over the
    // queries t >= t2 in order.
    ParallelIndices(B * NH * T, [&](int task) {
      const auto [b, h, t2] = HeadRowOf(task, T, NH);
      const size_t head = static_cast<size_t>(h) * hs;
      const float* base = qkv + static_cast<size_t>(b) * T * C3;
      const size_t bh = static_cast<size_t>(b) * NH + h;
      float* dk = dqkv + (static_cast<size_t>(b) * T + t2) * C3 + C + head;
      float* dv = dk + C;
      for (int t = t2; t < T; ++t) {
        const size_t score_row = (bh * T + t) * T;
        const float* q = base + t * C3 + head;
        const float* g = dout + (static_cast<size_t>(b) * T + t) * C + head;
        Axpy(dk, q, scratch[score_row + t2], hs);
        Axpy(dv, g, att[score_row + t2], hs);
      }
    });
  }

  void Gelu(float* out, const float* inp, size_t n) override {
    ParallelElements(n, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) {
        const float x = inp[i];
        const float u = kGeluScale * (x + kGeluCubic * x * x * x);
        out[i] = 0.5f * x * (1.0f + std::tanh(u));
      }
    });
  }

  void GeluBackward(float* dinp, const float* inp, const float* dout, size_t n) override {
    ParallelElements(n, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) {
        const float x = inp[i];
        const float u = kGeluScale * (x + kGeluCubic * x * x * x);
        const float th = std::tanh(u);
        const float sech2 = 1.0f - th * th;
        const float local =
            0.5f * (1.0f + th) + 0.5f * x * sech2 * kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
        dinp[i] += local * dout[i];
      }
    });
  }

  void CrossEntropy(float* losses, float* dlogits, const float* logits, const int32_t* targets,
                    int N, int V, float dloss) override {
    ParallelIndices(N, [&](int n) {
      const float* z = logits + static_cast<size_t>(n) * V;
      const int32_t target = targets[n];
      ZT_CHECK_MSG(target >= 0 && target < V, "target ", target, " at row ", n, ", vocab ", V);
      float max_z = -INFINITY;
      for (int v = 0; v < V; ++v) max_z = std::max(max_z, z[v]);
      float sum = 0.0f;
      for (int v = 0; v < V; ++v) sum += std::exp(z[v] - max_z);
      // -log softmax(z)[target] = log(sum exp(z - max)) + max - z[target].
      losses[n] = (std::log(sum) + max_z) - z[target];
      if (dlogits == nullptr) return;
      float* d = dlogits + static_cast<size_t>(n) * V;
      const float inv = 1.0f / sum;
      for (int v = 0; v < V; ++v) {
        const float p = std::exp(z[v] - max_z) * inv;
        d[v] = (p - (v == target ? 1.0f : 0.0f)) * dloss;
      }
    });
  }

 private:
  // dst = src^T for src [rows, cols] (dst [cols, rows]), in square blocks.
  // A matmul operand of n elements as the products take it: itself (kFp32)
  // or rounded to bf16 values in `scratch` (kBf16).
  const float* MatmulOperand(const float* x, size_t n, std::vector<float>* scratch) {
    if (math_ == MatmulMath::kFp32) return x;
    ZT_CHECK_MSG(n <= max_operand_, "matmul operand of ", n, " elements; SetMatmul reserved ",
                 max_operand_);
    scratch->resize(n);
    float* r = scratch->data();
    ParallelElements(n, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) r[i] = Bf16ToFloat(FloatToBf16(x[i]));
    });
    return r;
  }

  static void TransposeInto(std::vector<float>* dst, const float* src, int rows, int cols) {
    dst->resize(static_cast<size_t>(rows) * cols);
    float* d = dst->data();
    constexpr int kBlock = 32;
    const int col_blocks = (cols + kBlock - 1) / kBlock;
    ParallelIndices(col_blocks, [&](int cb) {
      const int c0 = cb * kBlock;
      const int c1 = std::min(cols, c0 + kBlock);
      for (int r0 = 0; r0 < rows; r0 += kBlock) {
        const int r1 = std::min(rows, r0 + kBlock);
        for (int c = c0; c < c1; ++c) {
          for (int r = r0; r < r1; ++r) {
            d[static_cast<size_t>(c) * rows + r] = src[static_cast<size_t>(r) * cols + c];
          }
        }
      }
    });
  }

  MatmulMath math_ = MatmulMath::kFp32;
  size_t max_operand_ = 0;
  std::vector<float> round_inp_, round_weight_, round_dout_;  // kBf16 operands
  std::vector<float> transposed_;
  std::vector<int> order_;
  std::vector<int> group_starts_;
};

}  // namespace

std::unique_ptr<Kernels> MakeCpuKernels() { return std::make_unique<CpuKernels>(); }

}  // namespace ztier::gpt
