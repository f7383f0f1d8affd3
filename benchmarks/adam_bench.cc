// ztier-bench adam: throughput of the fused CPU AdamW kernel against the
// machine's memory limit for the same access pattern, measured in the same run.
//
// For every (params, threads, grad-check mode) case it alternates the AdamW
// step and the same-pattern memory kernel (benchmarks/memory_pattern.h) run by
// run, keeps the best time of each, and prints params/s, bytes/s and the
// ratio adam / limit. bytes/s counts the one-pass pattern: grads (2 or 4 B) +
// params, m, v read and written (24 B) + the bf16 copy (2 B) per param; the
// scan-first mode reads the grads a second time and is charged the same bytes,
// so its ratio shows that cost. With --state-dtype int8 the step is
// cpu_adam::StepInt8 and the limit the 8-bit pattern (Int8PatternRange):
// grads + params read and written (8 B) + m and v codes read and written
// (4 B) + the bf16 copy + 16 B of absmax per 256-element block.
//
// Single-threaded driver; the kernels run on a cpu_adam::Executor.
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "benchmarks/bench_util.h"
#include "benchmarks/memory_pattern.h"
#include "benchmarks/subcommands.h"
#include "common/bf16.h"
#include "cpu_adam/adamw.h"
#include "hwy/aligned_allocator.h"

namespace ztier::bench {
namespace {

struct AdamOptions {
  std::vector<uint64_t> params = {uint64_t{16} << 20, uint64_t{64} << 20, uint64_t{256} << 20};
  std::vector<uint64_t> threads;  // empty: 1 and all cores
  cpu_adam::GradType grad_type = cpu_adam::GradType::kBFloat16;
  bool with_out = true;
  std::vector<cpu_adam::OutputStore> stores = {cpu_adam::OutputStore::kStreaming};
  bool store_given = false;  // --store was on the command line
  std::vector<cpu_adam::GradCheck> checks = {cpu_adam::GradCheck::kPrechecked,
                                             cpu_adam::GradCheck::kScanFirst};
  int runs = 5;
  bool json = false;
  bool int8 = false;  // --state-dtype int8
};

constexpr const char* kUsage = R"(usage: ztier-bench adam [options]

Times the fused CPU AdamW step against a same-pattern memory kernel in the
same run, and prints the ratio to that limit.

  --params LIST    shard sizes in params, e.g. 64M or 16M,64M (default 16M,64M,256M)
  --threads LIST   optimizer threads, e.g. 2 or 1,2 (default 1 and all cores)
  --grad bf16|fp32 grad dtype (default bf16)
  --out bf16|none  write the bf16 publish copy (default bf16)
  --store stream|regular|both
                   stores for the bf16 copy (default stream)
  --check prechecked|scan|both
                   prechecked: one pass (grads already scanned, the engine's
                   path); scan: scan grads for inf/NaN first (default both)
  --state-dtype fp32|int8
                   m and v in fp32 (Step) or 8-bit block-wise quantized
                   (StepInt8; bf16 copy with regular stores) (default fp32)
  --runs N         timed runs of each kernel, best kept (default 5)
  --json           print one JSON object as the last line
)";

Status ParseArgs(int argc, char** argv, AdamOptions* o) {
  ArgReader args(argc, argv);
  while (args.Next()) {
    const std::string_view arg = args.arg();
    if (arg == "--params") {
      ZT_ASSIGN_OR_RETURN(std::string_view v, args.Value());
      Result<std::vector<uint64_t>> params = ParseCountList(v);
      if (!params.ok()) return params.status().Annotate("--params");
      o->params = *std::move(params);
    } else if (arg == "--threads") {
      ZT_ASSIGN_OR_RETURN(std::string_view v, args.Value());
      Result<std::vector<uint64_t>> threads = ParseCountList(v);
      if (!threads.ok()) return threads.status().Annotate("--threads");
      o->threads = *std::move(threads);
      for (uint64_t t : o->threads) {
        if (t < 1 || t > 1024)
          return Status::InvalidArgument(StrCat("--threads ", t, ": want 1..1024"));
      }
    } else if (arg == "--grad") {
      ZT_ASSIGN_OR_RETURN(std::string_view v, args.Value());
      if (v == "bf16")
        o->grad_type = cpu_adam::GradType::kBFloat16;
      else if (v == "fp32")
        o->grad_type = cpu_adam::GradType::kFloat32;
      else
        return Status::InvalidArgument(StrCat("--grad ", v, ": want bf16 or fp32"));
    } else if (arg == "--out") {
      ZT_ASSIGN_OR_RETURN(std::string_view v, args.Value());
      if (v == "bf16")
        o->with_out = true;
      else if (v == "none")
        o->with_out = false;
      else
        return Status::InvalidArgument(StrCat("--out ", v, ": want bf16 or none"));
    } else if (arg == "--store") {
      ZT_ASSIGN_OR_RETURN(std::string_view v, args.Value());
      o->store_given = true;
      if (v == "stream")
        o->stores = {cpu_adam::OutputStore::kStreaming};
      else if (v == "regular")
        o->stores = {cpu_adam::OutputStore::kRegular};
      else if (v == "both")
        o->stores = {cpu_adam::OutputStore::kStreaming, cpu_adam::OutputStore::kRegular};
      else
        return Status::InvalidArgument(StrCat("--store ", v, ": want stream, regular or both"));
    } else if (arg == "--check") {
      ZT_ASSIGN_OR_RETURN(std::string_view v, args.Value());
      if (v == "prechecked")
        o->checks = {cpu_adam::GradCheck::kPrechecked};
      else if (v == "scan")
        o->checks = {cpu_adam::GradCheck::kScanFirst};
      else if (v == "both")
        o->checks = {cpu_adam::GradCheck::kPrechecked, cpu_adam::GradCheck::kScanFirst};
      else
        return Status::InvalidArgument(StrCat("--check ", v, ": want prechecked, scan or both"));
    } else if (arg == "--state-dtype") {
      ZT_ASSIGN_OR_RETURN(std::string_view v, args.Value());
      if (v != "fp32" && v != "int8") {
        return Status::InvalidArgument(StrCat("--state-dtype ", v, ": want fp32 or int8"));
      }
      o->int8 = v == "int8";
    } else if (arg == "--runs") {
      ZT_ASSIGN_OR_RETURN(uint64_t runs, args.Count(1, 1000));
      o->runs = static_cast<int>(runs);
    } else if (arg == "--json") {
      o->json = true;
    } else if (arg == "-h" || arg == "--help") {
      return Status::Aborted("help");
    } else {
      return Status::InvalidArgument(StrCat("unknown option '", arg, "'"));
    }
  }
  for (uint64_t n : o->params) {
    if (n == 0) return Status::InvalidArgument("--params: sizes must be > 0");
  }
  // StepInt8 has one kind of store: another asked of it is an error, not
  // a run measured as the other.
  if (o->int8 && o->store_given &&
      (o->stores.size() != 1 || o->stores[0] != cpu_adam::OutputStore::kRegular)) {
    return Status::InvalidArgument(
        "--store: 8-bit states (--state-dtype int8) store the bf16 copy with regular stores only");
  }
  // Without the copy there is nothing to store: two rows timed the same
  // work under two stores' names.
  if (!o->with_out && o->store_given) {
    return Status::InvalidArgument("--store: --out none writes no bf16 copy to store");
  }
  return Status::Ok();
}

// The shard's buffers, 64-byte aligned, filled in parallel so that pages are
// placed by the threads that will use them.
// With 8-bit states m and v are codes (m8, v8) and absmax per block.
struct Buffers {
  uint64_t n;
  bool int8;
  hwy::AlignedFreeUniquePtr<float[]> p, m, v, g32, m_absmax, v_absmax;
  hwy::AlignedFreeUniquePtr<uint16_t[]> g16, out;
  hwy::AlignedFreeUniquePtr<uint8_t[]> m8, v8;

  Buffers(uint64_t count, bool bf16_grads, bool int8_states)
      : n(count),
        int8(int8_states),
        p(hwy::AllocateAligned<float>(count)),
        m(int8 ? nullptr : hwy::AllocateAligned<float>(count)),
        v(int8 ? nullptr : hwy::AllocateAligned<float>(count)),
        g32(bf16_grads ? nullptr : hwy::AllocateAligned<float>(count)),
        m_absmax(int8 ? hwy::AllocateAligned<float>(cpu_adam::QuantBlocks(count)) : nullptr),
        v_absmax(int8 ? hwy::AllocateAligned<float>(cpu_adam::QuantBlocks(count)) : nullptr),
        g16(bf16_grads ? hwy::AllocateAligned<uint16_t>(count) : nullptr),
        out(hwy::AllocateAligned<uint16_t>(count)),
        m8(int8 ? hwy::AllocateAligned<uint8_t>(count) : nullptr),
        v8(int8 ? hwy::AllocateAligned<uint8_t>(count) : nullptr) {}

  bool ok() const {
    return p && (int8 ? m8 && v8 && m_absmax && v_absmax : m && v) && (g32 || g16) && out;
  }

  // The 8-bit m and v of the fp32 values Fill() makes, block by block on
  // the threads that will use them.
  void FillInt8(cpu_adam::Executor& executor) {
    executor.ParallelFor(cpu_adam::QuantBlocks(n), [&](size_t first, size_t last) {
      std::vector<float> mf(cpu_adam::kQuantBlock), vf(cpu_adam::kQuantBlock);
      for (size_t b = first; b < last; ++b) {
        const size_t begin = b * cpu_adam::kQuantBlock;
        const size_t count = std::min<size_t>(n - begin, cpu_adam::kQuantBlock);
        for (size_t i = 0; i < count; ++i) {
          const float u = p[begin + i];
          mf[i] = 0.01f * u;
          vf[i] = 1e-4f * u * u;
        }
        cpu_adam::Quantize(cpu_adam::QuantMap::kSigned, mf.data(), count, m8.get() + begin,
                           m_absmax.get() + b);
        cpu_adam::Quantize(cpu_adam::QuantMap::kUnsigned, vf.data(), count, v8.get() + begin,
                           v_absmax.get() + b);
      }
    });
  }

  void Fill(cpu_adam::Executor& executor) {
    executor.ParallelFor(n, [&](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i) {
        // splitmix64 of the index: deterministic, cheap, well spread.
        uint64_t z = (i + 1) * 0x9e3779b97f4a7c15ull;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f) - 0.5f;  // [-0.5, 0.5)
        p[i] = u;
        if (m) m[i] = 0.01f * u;
        if (v) v[i] = 1e-4f * u * u;
        const float grad = 0.02f * u;
        if (g32) g32[i] = grad;
        if (g16) g16[i] = FloatToBf16(grad).bits;
        out[i] = 0;
      }
    });
  }
};

struct CaseResult {
  uint64_t params;
  int threads;
  cpu_adam::GradCheck check;
  cpu_adam::OutputStore store;
  double adam_seconds;
  double limit_seconds;
  double bytes_per_param;
};

const char* CheckName(cpu_adam::GradCheck c) {
  return c == cpu_adam::GradCheck::kPrechecked ? "prechecked" : "scan";
}
const char* StoreName(cpu_adam::OutputStore s) {
  return s == cpu_adam::OutputStore::kStreaming ? "stream" : "regular";
}

std::string CaseJson(const CaseResult& r, const AdamOptions& o) {
  const double bytes = r.bytes_per_param * static_cast<double>(r.params);
  JsonObject j;
  j.Add("params", r.params)
      .Add("threads", r.threads)
      .Add("grad", o.grad_type == cpu_adam::GradType::kBFloat16 ? "bf16" : "fp32")
      .Add("out", o.with_out ? "bf16" : "none")
      .Add("state_dtype", o.int8 ? "int8" : "fp32")
      .Add("store", StoreName(r.store))
      .Add("check", CheckName(r.check))
      .Add("seconds", r.adam_seconds)
      .Add("params_per_s", static_cast<double>(r.params) / r.adam_seconds)
      .Add("bytes_per_param", r.bytes_per_param)
      .Add("bytes_per_s", bytes / r.adam_seconds)
      .Add("limit_seconds", r.limit_seconds)
      .Add("limit_bytes_per_s", bytes / r.limit_seconds)
      .Add("ratio_to_limit", r.limit_seconds / r.adam_seconds);
  return j.str();
}

}  // namespace

int RunAdam(int argc, char** argv) {
  AdamOptions o;
  if (Status s = ParseArgs(argc, argv, &o); !s.ok()) return UsageExit(s, "adam", kUsage);
  Result<cpu_adam::Topology> topo = cpu_adam::DetectTopology();
  const int cores = topo.ok() ? topo->cores : 1;
  if (o.threads.empty()) {
    o.threads = {1};
    if (cores > 1) o.threads.push_back(static_cast<uint64_t>(cores));
  }
  const bool bf16_grads = o.grad_type == cpu_adam::GradType::kBFloat16;
  const double state_bytes = o.int8 ? 8.0 + 4.0 + 16.0 / cpu_adam::kQuantBlock : 24.0;
  const double bytes_per_param = (bf16_grads ? 2.0 : 4.0) + state_bytes + (o.with_out ? 2.0 : 0.0);
  if (o.int8) o.stores = {cpu_adam::OutputStore::kRegular};  // StepInt8's only kind

  for (uint64_t n : o.params) {
    // Params, moments, grads and the bf16 out (always allocated).
    const double held =
        (o.int8 ? 4.0 + 2.0 + 8.0 / cpu_adam::kQuantBlock : 12.0) + (bf16_grads ? 2.0 : 4.0) + 2.0;
    if (Status s =
            CheckFitsInMemory(held * static_cast<double>(n), StrCat("--params ", FormatCount(n)));
        !s.ok()) {
      return FailExit(s, "adam");
    }
  }
  std::printf(
      "ztier-bench adam: SIMD target %s, %d core(s), grads %s, out %s, states %s, best of %d "
      "runs\n",
      cpu_adam::ActiveTarget().c_str(), cores, bf16_grads ? "bf16" : "fp32",
      o.with_out ? "bf16" : "none", o.int8 ? "int8" : "fp32", o.runs);
  std::printf("%8s %7s %-10s %-7s %10s %13s %10s %13s %7s\n", "params", "threads", "check", "store",
              "seconds", "Mparams/s", "GB/s", "limit GB/s", "ratio");

  std::vector<CaseResult> results;
  const cpu_adam::Hyper hyper{.lr = 1e-4f, .weight_decay = 0.01f};
  for (uint64_t n : o.params) {
    Buffers buf(n, bf16_grads, o.int8);
    if (!buf.ok()) {
      std::fprintf(stderr, "ztier-bench adam: cannot allocate %.2f GiB for %s params\n",
                   bytes_per_param * static_cast<double>(n) / (1 << 30), FormatCount(n).c_str());
      return 1;
    }
    std::set<int> measured;  // thread counts, as the executor took them (it caps at the cores)
    for (uint64_t t : o.threads) {
      Result<cpu_adam::Executor> exec =
          cpu_adam::Executor::Create({.threads = static_cast<int>(t)});
      if (!exec.ok()) {
        std::fprintf(stderr, "ztier-bench adam: %s\n", exec.status().ToString().c_str());
        return 1;
      }
      if (!measured.insert(exec->threads()).second) continue;  // the same row again
      buf.Fill(*exec);
      if (o.int8) buf.FillInt8(*exec);
      const cpu_adam::Shard shard{
          .count = n,
          .grads = bf16_grads ? static_cast<const void*>(buf.g16.get()) : buf.g32.get(),
          .grad_type = o.grad_type,
          .params = buf.p.get(),
          .exp_avg = buf.m.get(),
          .exp_avg_sq = buf.v.get(),
          .params_out = o.with_out ? reinterpret_cast<bf16*>(buf.out.get()) : nullptr};
      // (fp32 only: StepInt8 takes shard8 below.)
      int64_t step = 0;
      for (cpu_adam::OutputStore store : o.stores) {
        const AdamPatternArgs pattern{.grads = shard.grads,
                                      .grads_bf16 = bf16_grads,
                                      .params = buf.p.get(),
                                      .exp_avg = buf.m.get(),
                                      .exp_avg_sq = buf.v.get(),
                                      .out = o.with_out ? buf.out.get() : nullptr,
                                      .stream_out = store == cpu_adam::OutputStore::kStreaming};
        const Int8PatternArgs pattern8{.grads = shard.grads,
                                       .grads_bf16 = bf16_grads,
                                       .params = buf.p.get(),
                                       .m = buf.m8.get(),
                                       .v = buf.v8.get(),
                                       .m_absmax = buf.m_absmax.get(),
                                       .v_absmax = buf.v_absmax.get(),
                                       .out = o.with_out ? buf.out.get() : nullptr};
        const cpu_adam::Int8Shard shard8{.count = n,
                                         .grads = shard.grads,
                                         .grad_type = o.grad_type,
                                         .params = buf.p.get(),
                                         .moments = {.m = buf.m8.get(),
                                                     .v = buf.v8.get(),
                                                     .m_absmax = buf.m_absmax.get(),
                                                     .v_absmax = buf.v_absmax.get(),
                                                     .cuts = {}},
                                         .params_out = shard.params_out};
        for (cpu_adam::GradCheck check : o.checks) {
          // (The executor's count: oneTBB runs no more than the machine does.)
          CaseResult r{n, exec->threads(), check, store, 1e30, 1e30, bytes_per_param};
          // One untimed round of each first, then alternate timed rounds.
          for (int run = -1; run < o.runs; ++run) {
            double t0 = NowSeconds();
            exec->ParallelFor((n + cpu_adam::kTileElements - 1) / cpu_adam::kTileElements,
                              [&](size_t first, size_t last) {
                                const size_t begin = first * cpu_adam::kTileElements;
                                const size_t end =
                                    std::min<uint64_t>(n, last * cpu_adam::kTileElements);
                                if (o.int8) {
                                  Int8PatternRange(pattern8, begin, end);
                                } else {
                                  AdamPatternRange(pattern, begin, end);
                                }
                              });
            const double limit = NowSeconds() - t0;
            // The pattern moved the 8-bit state: back to plausible moments.
            if (o.int8) buf.FillInt8(*exec);
            t0 = NowSeconds();
            const cpu_adam::StepOptions options{
                .step = ++step, .grad_check = check, .output_store = store};
            Result<cpu_adam::StepResult> sr =
                o.int8 ? cpu_adam::StepInt8(hyper, options, shard8, {}, *exec)
                       : cpu_adam::Step(hyper, options, shard, *exec);
            const double adam = NowSeconds() - t0;
            if (!sr.ok() || sr->skipped) {
              std::fprintf(stderr, "ztier-bench adam: step failed: %s\n",
                           sr.ok() ? "skipped (non-finite grads)" : sr.status().ToString().c_str());
              return 1;
            }
            if (run >= 0) {
              r.limit_seconds = std::min(r.limit_seconds, limit);
              r.adam_seconds = std::min(r.adam_seconds, adam);
            }
          }
          const double bytes = bytes_per_param * static_cast<double>(n);
          std::printf("%8s %7d %-10s %-7s %10.4f %13.1f %10.2f %13.2f %7.3f\n",
                      FormatCount(n).c_str(), r.threads, CheckName(check), StoreName(store),
                      r.adam_seconds, static_cast<double>(n) / r.adam_seconds / 1e6,
                      bytes / r.adam_seconds / 1e9, bytes / r.limit_seconds / 1e9,
                      r.limit_seconds / r.adam_seconds);
          std::fflush(stdout);
          results.push_back(r);
        }
      }
    }
  }

  // A ratio past 1: the optimizer beat the limit measured beside it, which
  // is then no limit (it was printed as one without a word).
  const auto beaten =
      std::max_element(results.begin(), results.end(), [](const auto& a, const auto& b) {
        return a.limit_seconds / a.adam_seconds < b.limit_seconds / b.adam_seconds;
      });
  if (beaten != results.end()) {
    NoteRatioPastOne(beaten->limit_seconds / beaten->adam_seconds,
                     StrCat("at ", FormatCount(beaten->params), " params, ", beaten->threads,
                            " thread(s), ", StoreName(beaten->store), " stores"),
                     "the same-pattern kernel ran slower than the optimizer here",
                     beaten->store == cpu_adam::OutputStore::kStreaming
                         ? "repeat the run (others' work on the CPUs or the memory moves both)"
                         : "the stream-store rows' limit is the tighter one");
  }
  if (o.json) {
    // Headline: the largest shard at the most threads, first mode listed.
    const CaseResult* head = &results.front();
    for (const CaseResult& r : results) {
      if (r.params > head->params || (r.params == head->params && r.threads > head->threads)) {
        head = &r;
      }
    }
    std::vector<std::string> cases;
    for (const CaseResult& r : results) cases.push_back(CaseJson(r, o));
    std::string headline = CaseJson(*head, o);
    headline.pop_back();  // reopen the object to append the rest
    JsonObject rest;
    rest.Add("bench", "adam")
        .Add("target", cpu_adam::ActiveTarget())
        .AddRaw("cases", JsonArray(cases));
    std::printf("%s,%s\n", headline.c_str(), rest.str().substr(1).c_str());
  }
  return 0;
}

}  // namespace ztier::bench
