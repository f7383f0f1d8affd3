// ztier-bench nvme: sequential write then read of striped swap objects, and
// the same transfers done by fio (ioengine=io_uring, direct=1, same block
// size, queue depth, total size and directories) in the same run, with the
// ratios ours / fio. Also the cost of checksums and a queue-depth sweep.
//
// Single-threaded driver; the swap space runs its own I/O threads.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "benchmarks/bench_util.h"
#include "benchmarks/subcommands.h"
#include "common/file_util.h"
#include "nvme/io_backend.h"
#include "nvme/swap_space.h"

namespace ztier::bench {
namespace {

namespace fs = std::filesystem;

enum class BackendArg { kAuto, kUring, kThreads, kBoth };

constexpr char kDefaultPath[] = "ztier-bench-swap";

struct NvmeOptions {
  std::vector<std::string> paths;
  BackendArg backend = BackendArg::kAuto;
  uint64_t size = uint64_t{2} << 30;
  uint64_t stripe = uint64_t{1} << 20;
  uint32_t qd = 16;
  bool fio = true;
  bool sweep = true;
  bool json = false;
  int runs = 3;
};

// A run's data goes as swap objects of up to 256 MiB (whole stripes over
// the paths), written from and read back into buffers of a window of up to
// 1 GiB of them: memory stays bounded however large --size is.
uint64_t ObjectBytes(const NvmeOptions& o, uint64_t total) {
  const uint64_t unit = o.stripe * o.paths.size();
  return std::max<uint64_t>(std::min<uint64_t>(total, uint64_t{256} << 20) / unit, 1) * unit;
}
uint64_t WindowBytes(const NvmeOptions& o, uint64_t total) {
  const uint64_t object = ObjectBytes(o, total);
  const uint64_t window = std::max<uint64_t>((uint64_t{1} << 30) / object, 1) * object;
  return std::min(window, (total + object - 1) / object * object);
}

constexpr const char* kUsage = R"(usage: ztier-bench nvme [options]

Sequential write then read of striped swap objects through the swap space,
against fio (ioengine=io_uring, direct=1) on the same directories with the
same block size, queue depth and total size.

  --path DIR     an existing swap directory, one per drive; repeat for several
                 drives (default: ./ztier-bench-swap, created)
  --backend B    the swap space's I/O: auto (io_uring where the kernel allows
                 it, else threads), io_uring, threads, or both (default auto)
  --size N       total bytes, e.g. 2G (default 2G); memory: two buffers of
                 up to 1G, whatever the size
  --stripe N     stripe unit = fio block size (default 1M)
  --qd N         queue depth per path (default 16)
  --no-fio       skip the fio comparison
  --no-sweep     skip the queue-depth sweep
  --runs N       rounds of (ztier, ztier with checksums, fio), best kept (default 3)
  --json         print one JSON object as the last line
)";

Status ParseArgs(int argc, char** argv, NvmeOptions* o) {
  ArgReader args(argc, argv);
  while (args.Next()) {
    const std::string_view arg = args.arg();
    if (arg == "--path") {
      ZT_ASSIGN_OR_RETURN(std::string_view v, args.Value());
      o->paths.emplace_back(v);
    } else if (arg == "--backend") {
      ZT_ASSIGN_OR_RETURN(o->backend, args.Choice<BackendArg>({{"auto", BackendArg::kAuto},
                                                               {"io_uring", BackendArg::kUring},
                                                               {"uring", BackendArg::kUring},
                                                               {"threads", BackendArg::kThreads},
                                                               {"both", BackendArg::kBoth}}));
    } else if (arg == "--size") {  // (named by the option in errors)
      // (Past 2^62 the sizes derived from it wrapped: a window of 0 bytes
      // divided by, SIGFPE, and files left.)
      ZT_ASSIGN_OR_RETURN(o->size, args.Size(1, uint64_t{1} << 62));
    } else if (arg == "--stripe") {
      ZT_ASSIGN_OR_RETURN(o->stripe, args.Size(1, UINT64_MAX));
    } else if (arg == "--qd") {
      ZT_ASSIGN_OR_RETURN(uint64_t qd, args.Count(1, 4096));
      o->qd = static_cast<uint32_t>(qd);
    } else if (arg == "--no-fio") {
      o->fio = false;
    } else if (arg == "--no-sweep") {
      o->sweep = false;
    } else if (arg == "--runs") {
      ZT_ASSIGN_OR_RETURN(uint64_t runs, args.Count(1, 100));
      o->runs = static_cast<int>(runs);
    } else if (arg == "--json") {
      o->json = true;
    } else if (arg == "-h" || arg == "--help") {
      return Status::Aborted("help");
    } else {
      return Status::InvalidArgument(StrCat("unknown option '", arg, "'"));
    }
  }
  if (o->paths.empty()) o->paths.push_back(kDefaultPath);
  if (o->stripe < 4096 || o->stripe % 4096 != 0 || o->stripe > (uint64_t{1} << 30)) {
    return Status::InvalidArgument("--stripe must be a multiple of 4096, at most 1G");
  }
  if (o->paths.size() > 64) return Status::InvalidArgument("--path: at most 64 of them");
  const uint64_t unit = o->stripe * o->paths.size();
  if (o->size < unit) return Status::InvalidArgument("--size must hold one stripe per path");
  if (o->size % unit != 0) {
    const uint64_t whole = o->size / unit * unit;
    std::fprintf(stderr,
                 "ztier-bench nvme: --size %s is measured as %s (whole stripes of %s on each of "
                 "%zu path(s))\n",
                 FormatCount(o->size).c_str(), FormatCount(whole).c_str(),
                 FormatCount(o->stripe).c_str(), o->paths.size());
    o->size = whole;
  }
  // Its data is written from one buffer and read back into another, each
  // at most a window of 1 GiB; the swap space stages a stripe for each I/O
  // in flight on each path (the sweep goes up to 64).
  const uint64_t staging = uint64_t{std::max(o->qd, o->sweep ? 64u : 0u)} * unit;
  return CheckFitsInMemory(
      2 * WindowBytes(*o, o->size) + staging,
      StrCat("--size ", o->size, " with --stripe ", o->stripe, " (two buffers of up to 1 GiB, and ",
             "the swap space's staging: a stripe for each I/O in flight on each path)"));
}

struct Throughput {
  double write_bytes_per_s = 0;
  double read_bytes_per_s = 0;
};

// Page-aligned buffer of `n` bytes.
struct Pages {
  uint8_t* p;
  explicit Pages(size_t n) : p(static_cast<uint8_t*>(std::aligned_alloc(4096, n))) {}
  ~Pages() { std::free(p); }
};

// Writes `total` bytes as objects (ObjectBytes), all in flight at once,
// each from its place in the window of `src` (object i from slot i mod the
// window's objects), then reads them back a window at a time into `dst`
// (WindowBytes each) and checks each window against `src`; times each
// phase, the checks left out. A stop signal ends it between phases (the
// swap files go with the space).
Result<Throughput> RunSwap(StopSignals& stops, const NvmeOptions& o,
                           std::shared_ptr<nvme::IoBackend> backend, uint64_t total, uint32_t qd,
                           bool checksums, const uint8_t* src, uint8_t* dst) {
  if (stops.Stopped() != 0) return stops.Error("before a run");
  nvme::SwapOptions so;
  so.paths = o.paths;
  so.stripe_bytes = o.stripe;
  so.queue_depth = qd;
  so.checksums = checksums;
  so.growth_bytes = total / o.paths.size() + o.stripe;  // one fallocate, before the clock starts
  so.file_name = "ztier-bench.swap";
  ZT_ASSIGN_OR_RETURN(std::unique_ptr<nvme::SwapSpace> space,
                      nvme::SwapSpace::Create(so, std::move(backend)));
  const uint64_t object_bytes = ObjectBytes(o, total);
  const uint64_t slots = WindowBytes(o, total) / object_bytes;
  std::vector<nvme::IoRange> writes, reads;
  for (uint64_t off = 0; off < total; off += object_bytes) {
    const uint64_t n = std::min(object_bytes, total - off);
    const uint64_t slot = (off / object_bytes) % slots * object_bytes;
    ZT_ASSIGN_OR_RETURN(uint64_t id, space->Allocate(StrCat("obj", off), n));
    writes.push_back({id, 0, n, const_cast<uint8_t*>(src + slot)});
    reads.push_back({id, 0, n, dst + slot});
  }
  Throughput t;
  double t0 = NowSeconds();
  ZT_RETURN_IF_ERROR(space->Submit(nvme::IoDirection::kWrite, writes).Wait());
  t.write_bytes_per_s = static_cast<double>(total) / (NowSeconds() - t0);
  double reading = 0;
  for (size_t first = 0; first < reads.size(); first += slots) {
    if (stops.Stopped() != 0) return stops.Error("the swap files are removed");
    const size_t last = std::min(reads.size(), first + slots);
    const std::vector<nvme::IoRange> wave(reads.begin() + first, reads.begin() + last);
    t0 = NowSeconds();
    ZT_RETURN_IF_ERROR(space->Submit(nvme::IoDirection::kRead, wave).Wait());
    reading += NowSeconds() - t0;
    for (const nvme::IoRange& r : wave) {
      const uint64_t slot = static_cast<uint64_t>(static_cast<uint8_t*>(r.buffer) - dst);
      if (std::memcmp(src + slot, r.buffer, r.length) != 0) {
        return Status::Corruption("data read back differs");
      }
    }
  }
  t.read_bytes_per_s = static_cast<double>(total) / reading;
  ZT_RETURN_IF_ERROR(space->Close());  // removes the swap files
  return t;
}

// fio's figures are of whole milliseconds: a run shorter than this is
// said to be too short for them.
constexpr double kFioShortestMs = 200;

// A ratio to fio above this is fio's miss, not ours: said so.
constexpr double kAboveTheLimit = 1.1;

// What fio measured of `rw` (write or read), over every job.
struct FioResult {
  double bytes_per_s = 0;
  double runtime_ms = 0;
};

// The number after "`key`" : in fio's JSON from `from`; NaN if none.
double FioNumber(const std::string& text, size_t from, std::string_view key) {
  const size_t at = text.find(StrCat("\"", key, "\""), from);
  if (at == std::string::npos) return std::numeric_limits<double>::quiet_NaN();
  const size_t colon = text.find(':', at);
  if (colon == std::string::npos) return std::numeric_limits<double>::quiet_NaN();
  return std::strtod(text.c_str() + colon + 1, nullptr);
}

// Runs fio with one job per path (the same layout the swap space uses) and
// returns the aggregate bandwidth of `rw` (write or read). Its job file and
// output go beside its data in the first path (not TMPDIR, which may be
// unset, missing or a small tmpfs).
Result<FioResult> RunFio(StopSignals& stops, const NvmeOptions& o, const std::string& rw,
                         const char* engine) {
  const fs::path tmp = o.paths[0];
  const std::string stem = StrCat("ztier-bench-fio-", getpid());
  const fs::path job = tmp / (stem + ".fio"), out = tmp / (stem + ".json"),
                 err = tmp / (stem + ".err");
  {
    std::ofstream f(job);
    f << "[global]\nioengine=" << engine << "\ndirect=1\nbs=" << o.stripe << "\niodepth=" << o.qd
      << "\nrw=" << rw << "\nsize=" << o.size / o.paths.size()
      << "\ngroup_reporting=1\nfallocate=native\n";
    for (size_t i = 0; i < o.paths.size(); ++i) {
      // fio splits filename= on ':' (several files): a colon in the path
      // is escaped, or fio wrote to the part before it.
      const std::string path = (fs::path(o.paths[i]) / "ztier-bench.fio").string();
      if (path.find('\n') != std::string::npos) {
        return Status::InvalidArgument(StrCat("--path ", o.paths[i], " holds a newline"));
      }
      std::string name;
      for (const char c : path) {
        if (c == ':') name.push_back('\\');
        name.push_back(c);
      }
      f << "[path" << i << "]\nfilename=" << name << "\n";
    }
  }
  // No shell between (a path with a space or a quote is one argument);
  // fio's own complaint is kept for the message.
  const std::string output_arg = StrCat("--output=", out.string());
  const std::string job_arg = job.string();
  const Result<int> ran =
      stops.Run({"fio", "--output-format=json", output_arg, job_arg}, "", err.string());
  std::ifstream in(out);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::ifstream err_in(err);
  std::string why((std::istreambuf_iterator<char>(err_in)), std::istreambuf_iterator<char>());
  std::error_code ec;
  for (const fs::path& f : {job, out, err}) fs::remove(f, ec);
  if (!ran.ok()) return ran.status();
  if (stops.Stopped() != 0) return stops.Error("fio too");
  const int status = *ran;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    while (!why.empty() && std::isspace(static_cast<unsigned char>(why.back()))) why.pop_back();
    if (why.size() > 400) why = StrCat("...", std::string_view(why).substr(why.size() - 400));
    return Status::Unavailable(StrCat("fio --rw=", rw, " failed (",
                                      WIFEXITED(status) ? StrCat("exit code ", WEXITSTATUS(status))
                                                        : StrCat("signal ", WTERMSIG(status)),
                                      "): ", why.empty() ? "it said nothing" : why));
  }
  // group_reporting: the first job holds the aggregate; find "<rw>": {...
  // "bw_bytes" : N, ... "runtime" : ms
  const size_t section = text.find(StrCat("\"", rw, "\" : {"));
  if (section == std::string::npos) return Status::Internal(StrCat("no ", rw, " in fio's output"));
  FioResult r{FioNumber(text, section, "bw_bytes"), FioNumber(text, section, "runtime")};
  if (!(r.bytes_per_s > 0)) return Status::Internal("no bw_bytes in fio's output");
  return r;
}

bool HaveFio() { return std::system("fio --version >/dev/null 2>&1") == 0; }

}  // namespace

struct BackendResult {
  std::string name;
  Throughput plain, crc;
};

int RunNvme(int argc, char** argv) {
  NvmeOptions o;
  if (Status s = ParseArgs(argc, argv, &o); !s.ok()) return UsageExit(s, "nvme", kUsage);
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "ztier-bench nvme: %s\n", s.ToString().c_str());
    return 1;
  };
  // Asked before the stop signals are held: std::system ignores SIGINT
  // while fio --version runs, which threw away a Ctrl-C held by then (the
  // whole run went on and exited 0).
  const bool have_fio = o.fio && HaveFio();
  // Before any thread starts: a stop ends the run at its next phase, its
  // files removed, with 128 + the signal.
  StopSignals stops;
  auto stopped_or_fail = [&](const Status& s) {
    const int code = fail(s);
    return stops.Stopped() != 0 ? stops.ExitCode() : code;
  };
  // Paths are the user's drives: a missing one is a mistake, not something
  // to create (the default scratch directory is ours, and goes at the end
  // if empty, however the run ends).
  std::optional<DefaultDir> default_dir;
  for (const std::string& p : o.paths) {
    std::error_code ec;
    if (p == kDefaultPath && !default_dir) default_dir.emplace(p);
    if (Status dir = CheckBenchDirectory(p, "--path", p == kDefaultPath,
                                         " (create it on the drive to test)");
        !dir.ok()) {
      return fail(dir);
    }
    if (Status drive = CheckOnADrive(p, p == kDefaultPath ? "the default --path" : "--path");
        !drive.ok())
      return fail(drive);
  }
  // Each path holds its share of the data, then fio's file of the same size.
  if (Status s =
          CheckFitsOnDisk(o.paths, o.size / o.paths.size() + o.stripe, StrCat("--size ", o.size));
      !s.ok()) {
    return fail(s);
  }
  const bool uring_ok = nvme::ProbeUringSetup().ok();
  std::vector<std::pair<std::string, std::shared_ptr<nvme::IoBackend>>> backends;
  auto add = [&](nvme::BackendChoice c) -> Status {
    ZT_ASSIGN_OR_RETURN(std::shared_ptr<nvme::IoBackend> b, nvme::MakeBackend(c));
    backends.emplace_back(std::string(b->name()), b);
    return Status::Ok();
  };
  Status chosen = Status::Ok();
  switch (o.backend) {
    case BackendArg::kAuto:
      chosen = add(nvme::BackendChoice::kAuto);
      break;
    case BackendArg::kUring:
      chosen = add(nvme::BackendChoice::kUring);
      break;
    case BackendArg::kThreads:
      chosen = add(nvme::BackendChoice::kThreads);
      break;
    case BackendArg::kBoth:
      chosen = add(nvme::BackendChoice::kUring);
      if (chosen.ok()) chosen = add(nvme::BackendChoice::kThreads);
      break;
  }
  if (!chosen.ok()) return fail(chosen);
  const uint64_t window = WindowBytes(o, o.size);
  Pages src(window), dst(window);
  if (src.p == nullptr || dst.p == nullptr) {
    std::fprintf(stderr, "ztier-bench nvme: cannot allocate 2 x %llu bytes\n",
                 static_cast<unsigned long long>(window));
    return 1;
  }
  std::mt19937_64 rng(42);
  for (uint64_t i = 0; i < window; i += 8) {
    const uint64_t x = rng();
    std::memcpy(src.p + i, &x, 8);
  }
  // fio with io_uring where the kernel allows it, else libaio.
  const char* fio_engine = uring_ok ? "io_uring" : "libaio";
  std::printf("ztier-bench nvme: %zu path(s), %s total, stripe %s, queue depth %u per path\n",
              o.paths.size(), FormatCount(o.size).c_str(), FormatCount(o.stripe).c_str(), o.qd);

  // Fault the destination in before timing: O_DIRECT into untouched pages
  // would time the page faults, not the drive.
  std::memset(dst.p, 0, window);

  auto keep_best = [](Throughput* best, const Throughput& t) {
    best->write_bytes_per_s = std::max(best->write_bytes_per_s, t.write_bytes_per_s);
    best->read_bytes_per_s = std::max(best->read_bytes_per_s, t.read_bytes_per_s);
  };
  // Rounds alternate the contenders so that drift in the drive (or a
  // virtual disk's neighbours) hits all of them alike; best of each is kept.
  std::vector<BackendResult> results;
  for (const auto& [name, b] : backends) results.push_back({name, {}, {}});
  Throughput fio_best;
  double fio_shortest_ms = std::numeric_limits<double>::infinity();
  bool fio = have_fio;
  std::string fio_error;  // fio ran and failed: ztier's figures stand, without the ratio
  for (int run = 0; run < o.runs; ++run) {
    for (size_t i = 0; i < backends.size(); ++i) {
      // Swap the order of the two swap-space runs every round: on a virtual
      // disk the second run of a pair is measurably slower.
      for (int k = 0; k < 2; ++k) {
        const bool checksums = (k + run) % 2 == 1;
        Result<Throughput> t =
            RunSwap(stops, o, backends[i].second, o.size, o.qd, checksums, src.p, dst.p);
        if (!t.ok()) return stopped_or_fail(t.status());
        keep_best(checksums ? &results[i].crc : &results[i].plain, *t);
      }
    }
    if (fio) {
      Result<FioResult> w = RunFio(stops, o, "write", fio_engine);
      Result<FioResult> r = w.ok() ? RunFio(stops, o, "read", fio_engine) : w;
      for (const std::string& p : o.paths) {
        std::error_code ec;
        fs::remove(fs::path(p) / "ztier-bench.fio", ec);
      }
      if (stops.Stopped() != 0) return stopped_or_fail(w.ok() ? r.status() : w.status());
      if (!w.ok() || !r.ok()) {
        fio_error = std::string((w.ok() ? r.status() : w.status()).message());
        std::fprintf(stderr, "ztier-bench nvme: %s\n", fio_error.c_str());
        fio = false;
      } else {
        keep_best(&fio_best, Throughput{w->bytes_per_s, r->bytes_per_s});
        fio_shortest_ms = std::min({fio_shortest_ms, w->runtime_ms, r->runtime_ms});
      }
    }
  }
  const double fio_w = fio_best.write_bytes_per_s, fio_r = fio_best.read_bytes_per_s;
  std::printf("%-34s %10s %10s\n", "", "write GB/s", "read GB/s");
  for (const BackendResult& r : results) {
    std::printf("%-34s %10.3f %10.3f\n", StrCat("ztier ", r.name, ", checksums off").c_str(),
                r.plain.write_bytes_per_s / 1e9, r.plain.read_bytes_per_s / 1e9);
    std::printf("%-34s %10.3f %10.3f   (cost %+.1f%% / %+.1f%%)\n",
                StrCat("ztier ", r.name, ", checksums on").c_str(), r.crc.write_bytes_per_s / 1e9,
                r.crc.read_bytes_per_s / 1e9,
                100.0 * (1.0 - r.crc.write_bytes_per_s / r.plain.write_bytes_per_s),
                100.0 * (1.0 - r.crc.read_bytes_per_s / r.plain.read_bytes_per_s));
  }
  if (fio) {
    std::printf("%-34s %10.3f %10.3f\n", StrCat("fio (", fio_engine, ", direct=1)").c_str(),
                fio_w / 1e9, fio_r / 1e9);
    for (const BackendResult& r : results) {
      std::printf("%-34s %10.3f %10.3f\n", StrCat("ratio ztier ", r.name, "/fio (crc off)").c_str(),
                  r.plain.write_bytes_per_s / fio_w, r.plain.read_bytes_per_s / fio_r);
    }
    // The limit measured below the swap space: said, not left as a ratio
    // that reads as a bound. (On a virtual disk fio's runs and ours vary
    // by 2x from run to run: the host's cache serves some reads.)
    double highest = 0;
    for (const BackendResult& r : results) {
      highest =
          std::max({highest, r.plain.write_bytes_per_s / fio_w, r.plain.read_bytes_per_s / fio_r});
    }
    if (highest > kAboveTheLimit) {
      std::printf(
          "note: ztier measured %.2fx fio's figure: fio did not reach this device's limit in "
          "its runs, so these ratios bound nothing; the device's speed varies from run to run (a "
          "virtual disk's host cache does that): more --runs (the best of each is kept) steady "
          "both\n",
          highest);
    }
    if (fio_shortest_ms < kFioShortestMs) {
      std::printf(
          "note: a fio run took %.0f ms, and fio times in whole milliseconds: its figures and the "
          "ratios are rough; a larger --size makes them exact\n",
          fio_shortest_ms);
    }
  } else {
    std::printf("fio comparison skipped (%s)\n", !fio_error.empty() ? "fio failed, said above"
                                                 : o.fio            ? "fio not installed"
                                                                    : "--no-fio");
  }

  std::vector<std::string> sweep_json;
  if (o.sweep) {
    const uint64_t sweep_size =
        std::max<uint64_t>(o.size / 4 / (o.stripe * o.paths.size()), 1) * o.stripe * o.paths.size();
    std::printf("queue-depth sweep (%s, %s, checksums off):\n", FormatCount(sweep_size).c_str(),
                results[0].name.c_str());
    for (uint32_t qd : {1u, 4u, 16u, 64u}) {
      Result<Throughput> t =
          RunSwap(stops, o, backends[0].second, sweep_size, qd, false, src.p, dst.p);
      if (!t.ok()) return stopped_or_fail(t.status());
      std::printf("  qd %3u  write %7.3f GB/s  read %7.3f GB/s\n", qd, t->write_bytes_per_s / 1e9,
                  t->read_bytes_per_s / 1e9);
      JsonObject j;
      j.Add("queue_depth", static_cast<int>(qd))
          .Add("write_bytes_per_s", t->write_bytes_per_s)
          .Add("read_bytes_per_s", t->read_bytes_per_s);
      sweep_json.push_back(j.str());
    }
  }

  if (o.json) {
    // Without fio (--no-fio, or none installed) its figures are null (NaN is
    // written as null), not 0.
    constexpr double kNone = std::numeric_limits<double>::quiet_NaN();
    std::vector<std::string> paths, per_backend;
    for (const std::string& p : o.paths) paths.push_back(JsonQuote(p));
    for (const BackendResult& r : results) {
      JsonObject b;
      b.Add("backend", r.name)
          .Add("read_bytes_per_s", r.plain.read_bytes_per_s)
          .Add("write_bytes_per_s", r.plain.write_bytes_per_s)
          .Add("read_bytes_per_s_checksums", r.crc.read_bytes_per_s)
          .Add("write_bytes_per_s_checksums", r.crc.write_bytes_per_s)
          .Add("read_ratio_to_fio", fio ? r.plain.read_bytes_per_s / fio_r : kNone)
          .Add("write_ratio_to_fio", fio ? r.plain.write_bytes_per_s / fio_w : kNone);
      per_backend.push_back(b.str());
    }
    const BackendResult& head = results[0];
    JsonObject j;
    j.Add("bench", "nvme")
        .Add("backend", head.name)
        .Add("read_bytes_per_s", head.plain.read_bytes_per_s)
        .Add("write_bytes_per_s", head.plain.write_bytes_per_s)
        .Add("read_bytes_per_s_checksums", head.crc.read_bytes_per_s)
        .Add("write_bytes_per_s_checksums", head.crc.write_bytes_per_s)
        .AddRaw("fio_engine", fio ? JsonQuote(fio_engine) : "null")
        .AddRaw("fio_error", fio_error.empty() ? "null" : JsonQuote(fio_error))
        .Add("fio_read_bytes_per_s", fio ? fio_r : kNone)
        .Add("fio_write_bytes_per_s", fio ? fio_w : kNone)
        .Add("fio_shortest_run_ms", fio ? fio_shortest_ms : kNone)
        .Add("read_ratio_to_fio", fio ? head.plain.read_bytes_per_s / fio_r : kNone)
        .Add("write_ratio_to_fio", fio ? head.plain.write_bytes_per_s / fio_w : kNone)
        .AddRaw("backends", JsonArray(per_backend))
        .AddRaw("paths", JsonArray(paths))
        .Add("stripe_bytes", o.stripe)
        .Add("queue_depth", static_cast<int>(o.qd))
        .Add("total_bytes", o.size)
        .Add("checksums", "off (headline); on in *_checksums")
        .AddRaw("qd_sweep", JsonArray(sweep_json));
    std::printf("%s\n", j.str().c_str());
  }
  return 0;
}

}  // namespace ztier::bench
