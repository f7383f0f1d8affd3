// ztier-bench pcie: host <-> device copy bandwidth from the engine's own
// pinned regions, through the client's Device interface, against a limit
// measured in the same run.
//
// The engine holds a job of one unit (max-size / 2 bf16 params in DRAM);
// the unit's publish buffer (Engine::Published, what the stage-3 runner
// fetches) is the host->device source and its grad inbox
// (Engine::GradInbox, where grads land) the device->host destination, both
// registered with Device::RegisterHost as the runner does. For each copy
// size (64 KiB, then x4 up to --max-size) it times
//   h2d   CopyToDevice on the copy stream (kCopy, the runner's params in);
//   d2h   CopyToHost on the copy-out stream (kCopyOut, the runner's grads out);
//   both  both at once, each on its stream (bandwidth counts the bytes of
//         both directions);
// each as a batch of copies (enough to move >= 16 MiB) closed by a sync,
// one untimed round then --reps timed rounds, keeping the MEDIAN. The limit:
//   cuda  the plain pinned cudaMemcpyAsync peak of this GPU in this run
//         (a cudaMallocHost buffer, copies of min(max-size, 256 MiB), the
//         same three directions, median of --reps), the same for every size;
//   host  the host device's copies are memcpy calls on its copy thread, so
//         the limit is memcpy of the same size between the same buffers on
//         this thread (and, for both, two threads at once), alternated round
//         by round with the device's copies.
//
// Single-threaded driver (the host backend runs its copy thread; the "both"
// limit starts one helper thread per round).
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#if defined(ZTIER_BENCH_CUDA)
#include <cuda_runtime.h>
#endif

#include "benchmarks/bench_util.h"
#include "benchmarks/subcommands.h"
#include "client/ztier.h"
#include "engine/engine.h"

namespace ztier::bench {
namespace {

using client::Device;
using client::Stream;

enum class Backend : uint8_t { kAuto, kHost, kCuda };

constexpr uint64_t kMinSize = uint64_t{64} << 10;
constexpr uint64_t kBatchBytes = uint64_t{16} << 20;
constexpr int kMaxCopiesPerBatch = 256;
constexpr uint64_t kCudaDefaultMax = uint64_t{1} << 30;
constexpr uint64_t kHostDefaultMax = uint64_t{256} << 20;
constexpr uint64_t kPeakMax = uint64_t{256} << 20;

struct PcieOptions {
  Backend backend = Backend::kAuto;
  int ordinal = 0;
  uint64_t max_size = 0;  // 0: by backend
  int reps = 5;
  bool json = false;
};

constexpr const char* kUsage = R"(usage: ztier-bench pcie [options]

Host <-> device copy bandwidth from the engine's pinned publish buffer and
grad inbox, through the client Device interface: h2d, d2h, and both at once
(h2d on the copy stream, d2h on the copy-out stream, as the stage-3 runner
copies), for copy sizes 64K, 256K,
... (x4) up to --max-size. Each result is the median of --reps rounds, printed
as GB/s (1e9 B/s) and as the ratio to a limit measured in the same run:
  cuda: the plain pinned cudaMemcpyAsync peak (cudaMallocHost buffer,
        copies of min(max-size, 256M), same directions);
  host: memcpy of the same size between the same buffers (the host
        device's copies are memcpy on its copy thread), two threads for both.
The engine holds the unit's optimizer state too: about 8 x max-size of
pinned DRAM.

  --device host|cuda  backend (default: cuda when a CUDA device is present,
                      else host)
  --ordinal N         CUDA device (default 0)
  --max-size N        largest copy (default 1G on cuda; 256M on host, to
                      stay within ~30 s on a small machine)
  --reps N            timed rounds per size and direction (default 5)
  --json              print one JSON object as the last line
)";

Status ParseArgs(int argc, char** argv, PcieOptions* o) {
  ArgReader args(argc, argv);
  while (args.Next()) {
    if (args.Is("--device")) {
      ZT_ASSIGN_OR_RETURN(
          o->backend, args.Choice<Backend>({{"host", Backend::kHost}, {"cuda", Backend::kCuda}}));
    } else if (args.Is("--ordinal")) {
      ZT_RETURN_IF_ERROR(args.CountInto(&o->ordinal, 0, 1023));
    } else if (args.Is("--max-size")) {
      ZT_RETURN_IF_ERROR(args.SizeInto(&o->max_size, 4096, uint64_t{16} << 30));
      if (o->max_size % 2 != 0) return Status::InvalidArgument("--max-size: not a multiple of 2");
    } else if (args.Is("--reps")) {
      ZT_RETURN_IF_ERROR(args.CountInto(&o->reps, 1, 1000));
    } else if (args.Is("--json")) {
      o->json = true;
    } else {
      return args.Unrecognized();
    }
  }
  return Status::Ok();
}

enum class Direction : uint8_t { kH2D, kD2H, kBoth };
constexpr Direction kDirections[] = {Direction::kH2D, Direction::kD2H, Direction::kBoth};
const char* DirectionName(Direction d) {
  switch (d) {
    case Direction::kH2D:
      return "h2d";
    case Direction::kD2H:
      return "d2h";
    case Direction::kBoth:
      return "both";
  }
  return "?";
}
uint64_t BytesMoved(Direction d, uint64_t size, int copies) {
  return (d == Direction::kBoth ? 2 : 1) * size * static_cast<uint64_t>(copies);
}

// The buffers one round copies between.
struct Buffers {
  const void* host_src;  // the engine's publish buffer
  void* host_dst;        // the engine's grad inbox
  void* dev_a;           // h2d destination
  void* dev_b;           // d2h source
};

// One batch of `copies` copies of `size` bytes through the Device, on the
// streams the stage-3 runner copies on (params in on kCopy, grads out on
// kCopyOut), closed by syncing them. Returns the seconds taken.
Result<double> TimeDevice(Device& device, Direction dir, const Buffers& b, uint64_t size,
                          int copies) {
  const double t0 = NowSeconds();
  for (int i = 0; i < copies; ++i) {
    if (dir != Direction::kD2H) {
      ZT_RETURN_IF_ERROR(device.CopyToDevice(b.dev_a, b.host_src, size, Stream::kCopy));
    }
    if (dir != Direction::kH2D) {
      ZT_RETURN_IF_ERROR(device.CopyToHost(b.host_dst, b.dev_b, size, Stream::kCopyOut));
    }
  }
  if (dir != Direction::kD2H) ZT_RETURN_IF_ERROR(device.Synchronize(Stream::kCopy));
  if (dir != Direction::kH2D) ZT_RETURN_IF_ERROR(device.Synchronize(Stream::kCopyOut));
  return NowSeconds() - t0;
}

// The host backend's limit: memcpy between the same buffers on this thread;
// for both, the h2d copies on a second thread at the same time (started
// before the clock, released by a flag, so thread creation is not timed).
double TimeMemcpy(Direction dir, const Buffers& b, uint64_t size, int copies) {
  std::thread h2d;
  std::atomic<bool> started{false}, go{false};
  if (dir == Direction::kBoth) {
    h2d = std::thread([&] {
      started.store(true, std::memory_order_release);
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      for (int i = 0; i < copies; ++i) std::memcpy(b.dev_a, b.host_src, size);
    });
    while (!started.load(std::memory_order_acquire)) std::this_thread::yield();
  }
  const double t0 = NowSeconds();
  go.store(true, std::memory_order_release);
  for (int i = 0; i < copies; ++i) {
    if (dir == Direction::kH2D) {
      std::memcpy(b.dev_a, b.host_src, size);
    } else {
      std::memcpy(b.host_dst, b.dev_b, size);
    }
  }
  if (h2d.joinable()) h2d.join();
  return NowSeconds() - t0;
}

struct Cell {
  double gbps = 0, limit_gbps = 0;
  double ratio() const { return limit_gbps > 0 ? gbps / limit_gbps : 0; }
};

struct Row {
  uint64_t size = 0;
  int copies = 0;
  Cell cells[3];  // by Direction
};

#if defined(ZTIER_BENCH_CUDA)
// The limit on CUDA: plain cudaMemcpyAsync between a cudaMallocHost buffer
// and device memory on two private streams; everything freed on exit.
class CudaPeak {
 public:
  CudaPeak() = default;
  CudaPeak(const CudaPeak&) = delete;
  CudaPeak& operator=(const CudaPeak&) = delete;
  ~CudaPeak() {
    if (host_ != nullptr) cudaFreeHost(host_);
    for (void* p : {dev_a_, dev_b_}) {
      if (p != nullptr) cudaFree(p);
    }
    for (cudaStream_t s : {up_, down_}) {
      if (s != nullptr) cudaStreamDestroy(s);
    }
  }

  // GB/s per direction, median of `reps` rounds after one untimed round.
  Result<std::vector<double>> Measure(int ordinal, uint64_t bytes, int reps) {
    ZT_RETURN_IF_ERROR(Check(cudaSetDevice(ordinal), "cudaSetDevice"));
    ZT_RETURN_IF_ERROR(Check(cudaMallocHost(&host_, 2 * bytes), "cudaMallocHost"));
    ZT_RETURN_IF_ERROR(Check(cudaMalloc(&dev_a_, bytes), "cudaMalloc"));
    ZT_RETURN_IF_ERROR(Check(cudaMalloc(&dev_b_, bytes), "cudaMalloc"));
    ZT_RETURN_IF_ERROR(Check(cudaStreamCreateWithFlags(&up_, cudaStreamNonBlocking), "stream"));
    ZT_RETURN_IF_ERROR(Check(cudaStreamCreateWithFlags(&down_, cudaStreamNonBlocking), "stream"));
    std::memset(host_, 1, 2 * bytes);
    char* const host_up = static_cast<char*>(host_);
    char* const host_down = host_up + bytes;
    std::vector<double> gbps;
    for (Direction dir : kDirections) {
      std::vector<double> seconds;
      for (int r = -1; r < reps; ++r) {
        const double t0 = NowSeconds();
        if (dir != Direction::kD2H) {
          ZT_RETURN_IF_ERROR(
              Check(cudaMemcpyAsync(dev_a_, host_up, bytes, cudaMemcpyHostToDevice, up_), "h2d"));
        }
        if (dir != Direction::kH2D) {
          ZT_RETURN_IF_ERROR(Check(
              cudaMemcpyAsync(host_down, dev_b_, bytes, cudaMemcpyDeviceToHost, down_), "d2h"));
        }
        ZT_RETURN_IF_ERROR(Check(cudaStreamSynchronize(up_), "cudaStreamSynchronize"));
        ZT_RETURN_IF_ERROR(Check(cudaStreamSynchronize(down_), "cudaStreamSynchronize"));
        if (r >= 0) seconds.push_back(NowSeconds() - t0);
      }
      gbps.push_back(static_cast<double>(BytesMoved(dir, bytes, 1)) / Median(seconds) / 1e9);
    }
    return gbps;
  }

 private:
  static Status Check(cudaError_t err, const char* what) {
    if (err == cudaSuccess) return Status::Ok();
    cudaGetLastError();
    return Status(StatusCode::kIoError,
                  StrCat("cudaMemcpy peak: ", what, ": ", cudaGetErrorString(err)),
                  static_cast<int>(err));
  }

  void* host_ = nullptr;
  void* dev_a_ = nullptr;
  void* dev_b_ = nullptr;
  cudaStream_t up_ = nullptr;
  cudaStream_t down_ = nullptr;
};
#endif

Result<std::vector<double>> MeasureCudaPeak([[maybe_unused]] int ordinal,
                                            [[maybe_unused]] uint64_t bytes,
                                            [[maybe_unused]] int reps) {
#if defined(ZTIER_BENCH_CUDA)
  CudaPeak peak;
  return peak.Measure(ordinal, bytes, reps);
#else
  return Status::Unavailable("this ztier-bench was built without CUDA");
#endif
}

// Frees a device allocation on scope exit.
struct DeviceBuffer {
  Device* device = nullptr;
  void* ptr = nullptr;
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (device != nullptr) device->Free(ptr);
  }
};

std::string RowJson(const Row& r) {
  JsonObject j;
  j.Add("bytes", r.size).Add("copies_per_round", r.copies);
  for (Direction d : kDirections) {
    const Cell& c = r.cells[static_cast<int>(d)];
    const std::string name = DirectionName(d);
    j.Add(name + "_gbps", c.gbps)
        .Add(name + "_limit_gbps", c.limit_gbps)
        .Add(name + "_ratio", c.ratio());
  }
  return j.str();
}

// Runs the sweep on an opened device with the engine's buffers registered.
Status Sweep(Device& device, bool host_backend, const Buffers& b, const PcieOptions& o,
             const std::vector<uint64_t>& sizes, const std::vector<double>& peak,
             std::vector<Row>* rows) {
  std::printf("%8s %7s | %8s %8s %6s | %8s %8s %6s | %8s %8s %6s\n", "size", "copies", "h2d",
              "limit", "ratio", "d2h", "limit", "ratio", "both", "limit", "ratio");
  for (uint64_t size : sizes) {
    Row row;
    row.size = size;
    row.copies = static_cast<int>(
        std::clamp<uint64_t>(kBatchBytes / size, 1, static_cast<uint64_t>(kMaxCopiesPerBatch)));
    for (Direction dir : kDirections) {
      std::vector<double> dev_seconds, limit_seconds;
      for (int r = -1; r < o.reps; ++r) {
        ZT_ASSIGN_OR_RETURN(double t, TimeDevice(device, dir, b, size, row.copies));
        if (r >= 0) dev_seconds.push_back(t);
        if (host_backend) {
          const double lt = TimeMemcpy(dir, b, size, row.copies);
          if (r >= 0) limit_seconds.push_back(lt);
        }
      }
      const double bytes = static_cast<double>(BytesMoved(dir, size, row.copies));
      Cell& cell = row.cells[static_cast<int>(dir)];
      cell.gbps = bytes / Median(dev_seconds) / 1e9;
      cell.limit_gbps =
          host_backend ? bytes / Median(limit_seconds) / 1e9 : peak[static_cast<int>(dir)];
    }
    const Cell* c = row.cells;
    std::printf("%8s %7d | %8.2f %8.2f %6.3f | %8.2f %8.2f %6.3f | %8.2f %8.2f %6.3f\n",
                FormatCount(size).c_str(), row.copies, c[0].gbps, c[0].limit_gbps, c[0].ratio(),
                c[1].gbps, c[1].limit_gbps, c[1].ratio(), c[2].gbps, c[2].limit_gbps, c[2].ratio());
    std::fflush(stdout);
    rows->push_back(row);
  }
  // The largest ratio, said where it passes 1.
  const Row* top = nullptr;
  int top_dir = 0;
  for (const Row& row : *rows) {
    for (int d = 0; d < 3; ++d) {
      if (top == nullptr || row.cells[d].ratio() > top->cells[top_dir].ratio()) {
        top = &row;
        top_dir = d;
      }
    }
  }
  if (top != nullptr) {
    NoteRatioPastOne(
        top->cells[top_dir].ratio(),
        StrCat("at ", FormatCount(top->size), ", ", DirectionName(kDirections[top_dir])),
        host_backend ? "the same-pattern memcpy ran slower than the copies here"
                     : "the copies beat the cudaMemcpy peak measured before them",
        "repeat the run (others' work on the CPUs or the memory moves both)");
  }
  return Status::Ok();
}

}  // namespace

int RunPcie(int argc, char** argv) {
  PcieOptions o;
  if (Status s = ParseArgs(argc, argv, &o); !s.ok()) return UsageExit(s, "pcie", kUsage);
  const auto fail = [](const Status& s) { return FailExit(s, "pcie"); };
  if (o.backend == Backend::kAuto) {
    o.backend = client::CudaDeviceCount() > 0 ? Backend::kCuda : Backend::kHost;
  }
  const bool host_backend = o.backend == Backend::kHost;
  if (o.max_size == 0) o.max_size = host_backend ? kHostDefaultMax : kCudaDefaultMax;
  std::vector<uint64_t> sizes;
  for (uint64_t s = kMinSize; s <= o.max_size; s *= 4) sizes.push_back(s);
  if (sizes.empty() || sizes.back() != o.max_size) sizes.push_back(o.max_size);

  // The device first: without one the run ends here, before the engine
  // pins its states (8 GiB for the default 1 GiB unit).
  Result<std::unique_ptr<Device>> opened =
      host_backend ? client::MakeHostDevice() : client::MakeCudaDevice(o.ordinal);
  if (!opened.ok()) return fail(opened.status());
  std::unique_ptr<Device> device = std::move(*opened);

  // The engine: one unit of max-size bytes of bf16 params, states in DRAM.
  const uint64_t elems = o.max_size / 2;
  engine::Settings settings;
  settings.optimizer_threads = 1;
  // master, m, v (12 B), publish and inbox (2 B each) a param, plus slack for
  // padding and the pool's 256 MiB regions.
  settings.dram_budget_bytes = elems * 16 + (uint64_t{320} << 20);
  // Said up front, as the other subcommands do: the pool, the device's two
  // buffers (host memory on the host backend) and the peak's pair.
  if (Status s = CheckFitsInMemory(settings.dram_budget_bytes + 4 * o.max_size,
                                   StrCat("--max-size ", FormatCount(o.max_size)));
      !s.ok()) {
    return fail(s);
  }
  Result<std::unique_ptr<engine::Engine>> created = engine::Engine::Create(settings);
  if (!created.ok()) return fail(created.status());
  engine::Engine& e = **created;
  engine::JobSpec spec;
  spec.name = "pcie-bench";
  spec.units.push_back({"unit0", {{"w", {static_cast<int64_t>(elems)}}}});
  Result<int> job = e.RegisterJob(spec);
  if (!job.ok()) return fail(job.status());
  Result<const bf16*> published = e.Published(*job, 0);
  Result<bf16*> inbox = e.GradInbox(*job, 0, 0);
  if (!published.ok()) return fail(published.status());
  if (!inbox.ok()) return fail(inbox.status());

  Status status;
  std::vector<Row> rows;
  std::vector<double> peak(3, 0.0);
  std::string device_name;
  const uint64_t peak_bytes = std::min(o.max_size, kPeakMax);
  {
    device_name = device->name();
    const auto run = [&]() -> Status {
      void* src = const_cast<bf16*>(*published);
      ZT_RETURN_IF_ERROR(device->RegisterHost(src, o.max_size, client::HostAccess::kReadWrite));
      ZT_RETURN_IF_ERROR(device->RegisterHost(*inbox, o.max_size, client::HostAccess::kReadWrite));
      DeviceBuffer a, b;
      ZT_ASSIGN_OR_RETURN(a.ptr, device->Allocate(o.max_size, client::MemoryPurpose::kParams));
      a.device = device.get();
      ZT_ASSIGN_OR_RETURN(b.ptr, device->Allocate(o.max_size, client::MemoryPurpose::kGrads));
      b.device = device.get();
      // Touch the device buffers once (the host backend's pages fault in).
      ZT_RETURN_IF_ERROR(device->Memset(a.ptr, 0, o.max_size, Stream::kCompute));
      ZT_RETURN_IF_ERROR(device->Memset(b.ptr, 0, o.max_size, Stream::kCompute));
      ZT_RETURN_IF_ERROR(device->Synchronize(Stream::kCompute));

      std::printf(
          "ztier-bench pcie: %s, engine publish buffer -> device -> grad inbox (%s pinned "
          "each), median of %d rounds\n",
          device_name.c_str(), FormatCount(o.max_size).c_str(), o.reps);
      if (host_backend) {
        std::printf(
            "limit: memcpy of the same size between the same buffers, this thread (two "
            "threads for both)\n");
      } else {
        ZT_ASSIGN_OR_RETURN(peak, MeasureCudaPeak(o.ordinal, peak_bytes, o.reps));
        std::printf(
            "limit: pinned cudaMemcpyAsync peak, %s copies: h2d %.2f GB/s, d2h %.2f GB/s, "
            "both %.2f GB/s\n",
            FormatCount(peak_bytes).c_str(), peak[0], peak[1], peak[2]);
      }
      const Buffers bufs{*published, *inbox, a.ptr, b.ptr};
      return Sweep(*device, host_backend, bufs, o, sizes, peak, &rows);
    };
    status = run();
    // Destroyed (unregistering the engine's buffers) before the job goes.
    device.reset();
  }
  if (Status s = e.UnregisterJob(*job); status.ok()) status = s;
  if (!status.ok()) return fail(status);

  if (o.json) {
    const Row& head = rows.back();
    std::vector<std::string> per_size;
    for (const Row& r : rows) per_size.push_back(RowJson(r));
    JsonObject j;
    j.Add("bench", "pcie")
        .Add("backend", host_backend ? "host" : "cuda")
        .Add("device", device_name)
        .Add("statistic", "median")
        .Add("reps", o.reps)
        .Add("max_size", o.max_size)
        .Add("limit",
             host_backend ? "memcpy same size, same buffers" : "pinned cudaMemcpyAsync peak");
    if (!host_backend) {
      j.Add("peak_bytes", peak_bytes)
          .Add("peak_h2d_gbps", peak[0])
          .Add("peak_d2h_gbps", peak[1])
          .Add("peak_both_gbps", peak[2]);
    }
    for (Direction d : kDirections) {
      const std::string name = DirectionName(d);
      j.Add(name + "_gbps", head.cells[static_cast<int>(d)].gbps)
          .Add(name + "_ratio", head.cells[static_cast<int>(d)].ratio());
    }
    j.AddRaw("sizes", JsonArray(per_size));
    std::printf("%s\n", j.str().c_str());
  }
  return 0;
}

}  // namespace ztier::bench
