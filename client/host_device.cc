// The host device backend: "device" memory is host memory, kernels (the
// kCompute stream) run on the caller's thread as they are issued, and each
// copy stream (kCopy, kCopyOut) is a thread that runs its copies in order.
// Copies therefore overlap the caller's compute exactly as DMA overlaps
// kernels on a GPU, and the two copy directions overlap each other, which
// is what lets the stage-3 runner's prefetching be tested and timed without
// one. With the timeline on, every copy-stream operation records its span.
// Test mode (HostDeviceOptions): copies wait before they run, and check that
// their source did not change between the call that queued them and the
// moment they run, so ordering bugs between copies and the buffers they
// read show on CPU.
//
// Thread safety: every method may be called from any thread. Failure: an
// allocation past the machine's memory, or past the device memory the
// options give it, is ResourceExhausted; nothing else fails.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>

#include "client/transport.h"
#include "client/ztier.h"
#include "common/crc32c.h"
#include "common/file_util.h"
#include "common/thread.h"

namespace ztier::client {
namespace {

using Clock = std::chrono::steady_clock;

// Whether every page of [ptr, ptr + bytes) is mapped writable in this
// process, from /proc/self/maps; InvalidArgument where part of it is not
// mapped at all.
Result<bool> MappedWritable(const void* ptr, size_t bytes) {
  ZT_ASSIGN_OR_RETURN(std::string maps, ReadFileToString("/proc/self/maps"));
  uintptr_t at = reinterpret_cast<uintptr_t>(ptr);
  const uintptr_t end = at + bytes;
  std::string_view rest = maps;
  while (!rest.empty() && at < end) {
    const size_t eol = std::min(rest.find('\n'), rest.size());
    const std::string_view line = rest.substr(0, eol);
    rest.remove_prefix(std::min(eol + 1, rest.size()));
    // "start-end perms offset dev inode path", addresses in hex, sorted.
    uintptr_t lo = 0, hi = 0;
    const char* p = line.data();
    const char* stop = p + line.size();
    auto [dash, e1] = std::from_chars(p, stop, lo, 16);
    if (e1 != std::errc() || dash == stop || *dash != '-') continue;
    auto [space, e2] = std::from_chars(dash + 1, stop, hi, 16);
    if (e2 != std::errc() || stop - space < 3) continue;
    if (hi <= at) continue;
    if (lo > at) break;  // a hole
    if (space[2] != 'w') return false;
    at = hi;
  }
  if (at < end) {
    return Status::InvalidArgument(StrCat("host device: RegisterHost of ", bytes, " B at ", ptr,
                                          ": the range is not all mapped"));
  }
  return true;
}

// Completion flag shared by an event and the copy-thread task that sets it.
struct EventState {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
};

// The first checked copy whose source changed (test mode), shared by the
// device and its events.
struct Hazard {
  std::mutex mu;
  Status status;
  Status get() {
    std::lock_guard<std::mutex> lock(mu);
    return status;
  }
  void Set(Status s) {
    std::lock_guard<std::mutex> lock(mu);
    if (status.ok()) status = std::move(s);
  }
};

class HostEvent final : public Event {
 public:
  HostEvent(std::shared_ptr<EventState> state, std::shared_ptr<Hazard> hazard)
      : state_(std::move(state)), hazard_(std::move(hazard)) {}
  bool Done() const override {
    std::lock_guard<std::mutex> lock(state_->mu);
    return state_->done;
  }
  Status Synchronize() override {
    {
      std::unique_lock<std::mutex> lock(state_->mu);
      state_->cv.wait(lock, [&] { return state_->done; });
    }
    return hazard_->get();
  }
  const std::shared_ptr<EventState>& state() const { return state_; }

 private:
  std::shared_ptr<EventState> state_;
  std::shared_ptr<Hazard> hazard_;
};

void Complete(EventState& s) {
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.done = true;
  }
  s.cv.notify_all();
}

bool IsCopy(Stream s) { return s != Stream::kCompute; }

class HostDevice final : public Device {
 public:
  explicit HostDevice(const HostDeviceOptions& options) : options_(options) {}
  // The copy threads (one a copy stream); those started stop with the device.
  Status Start() {
    for (Stream s : {Stream::kCopy, Stream::kCopyOut}) {
      CopyQueue& q = Queue(s);
      q.stream = s;
      ZT_ASSIGN_OR_RETURN(q.thread,
                          StartThread("a host device copy thread", [this, &q] { CopyLoop(q); }));
    }
    return Status::Ok();
  }
  ~HostDevice() override {
    if (owner_.forked()) {
      // The copy threads, and the waiters on the queues' condition
      // variables, are the parent's (ProcessOwner): the queues are left.
      (void)queues_.release();
      return;
    }
    for (int i = 0; i < 2; ++i) {
      CopyQueue& q = queues_[i];
      {
        std::lock_guard<std::mutex> lock(q.mu);
        q.stop = true;
      }
      q.cv.notify_all();
      if (q.thread.joinable()) q.thread.join();
    }
    for (auto& [ptr, info] : allocations_) std::free(ptr);
  }

  DeviceKind kind() const override { return DeviceKind::kHost; }
  std::string name() const override { return "host"; }
  int ordinal() const override { return 0; }

  Result<void*> Allocate(size_t bytes, MemoryPurpose purpose) override {
    // More than the machine's memory is refused before the allocator sees it
    // (rounded up, a size within 255 of SIZE_MAX wrapped to 0: 256 bytes).
    static const uint64_t physical = static_cast<uint64_t>(::sysconf(_SC_PHYS_PAGES)) *
                                     static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    const size_t rounded = bytes > physical ? 0 : std::max<size_t>(256, (bytes + 255) / 256 * 256);
    ZT_RETURN_IF_ERROR(owner_.Check("a host device allocation"));
    std::lock_guard<std::mutex> lock(mem_mu_);
    const uint64_t limit = options_.memory_bytes;
    if (limit > 0 && (bytes > limit || allocated_ > limit - bytes)) {
      return Status::ResourceExhausted(StrCat("host device: cannot allocate ", bytes,
                                              " bytes of device memory: ", allocated_, " of its ",
                                              limit, " are allocated"));
    }
    void* p = rounded == 0 ? nullptr : std::aligned_alloc(256, rounded);
    if (p == nullptr) {
      return Status::ResourceExhausted(
          StrCat("host device: cannot allocate ", bytes, " bytes of device memory"));
    }
    allocations_[p] = {bytes, purpose};
    allocated_ += bytes;
    MemoryStats& s = stats_[static_cast<int>(purpose)];
    s.bytes += bytes;
    s.high_water = std::max(s.high_water, s.bytes);
    return p;
  }

  void Free(void* ptr) override {
    // (In a forked child the memory and the copy queues are the parent's:
    // nothing of them is freed there.)
    if (ptr == nullptr || owner_.forked()) return;
    {
      // Accounted as freed now (the caller gave it up); released once the
      // copies queued before it are done.
      std::lock_guard<std::mutex> lock(mem_mu_);
      auto it = allocations_.find(ptr);
      ZT_CHECK_MSG(it != allocations_.end(), "host device: Free of ", ptr,
                   ", which this device did not allocate (or freed already)");
      stats_[static_cast<int>(it->second.purpose)].bytes -= it->second.bytes;
      allocated_ -= it->second.bytes;
      allocations_.erase(it);
    }
    // Freed when both copy queues have reached this point.
    auto pending = std::make_shared<std::atomic<int>>(2);
    for (Stream q : {Stream::kCopy, Stream::kCopyOut}) {
      Enqueue(q, {}, [ptr, pending] {
        if (pending->fetch_sub(1) == 1) std::free(ptr);
      });
    }
  }

  MemoryStats memory(MemoryPurpose purpose) const override {
    std::lock_guard<std::mutex> lock(mem_mu_);
    return stats_[static_cast<int>(purpose)];
  }
  void ResetHighWater() override {
    std::lock_guard<std::mutex> lock(mem_mu_);
    for (MemoryStats& s : stats_) s.high_water = s.bytes;
  }

  Status CopyToDevice(void* dst, const void* src, size_t bytes, Stream stream) override {
    return RunCopy(stream, "h2d", dst, src, bytes);
  }
  Status CopyToHost(void* dst, const void* src, size_t bytes, Stream stream) override {
    return RunCopy(stream, "d2h", dst, src, bytes);
  }
  Status CopyOnDevice(void* dst, const void* src, size_t bytes, Stream stream) override {
    return RunCopy(stream, "d2d", dst, src, bytes);
  }
  Status Memset(void* dst, int value, size_t bytes, Stream stream) override {
    return Run(
        stream, "memset", [=] { std::memset(dst, value, bytes); }, static_cast<uint8_t*>(dst),
        bytes);
  }

  Result<std::unique_ptr<Event>> Record(Stream stream) override {
    ZT_RETURN_IF_ERROR(owner_.Check("a host device event"));
    auto state = std::make_shared<EventState>();
    if (stream == Stream::kCompute) {
      state->done = true;  // compute work is done when it is issued
    } else {
      Enqueue(stream, {}, [state] { Complete(*state); });
    }
    return std::unique_ptr<Event>(std::make_unique<HostEvent>(std::move(state), hazard_));
  }

  Status Wait(Stream stream, Event& event) override {
    ZT_RETURN_IF_ERROR(owner_.Check("a host device wait"));
    auto* e = dynamic_cast<HostEvent*>(&event);
    if (e == nullptr) return Status::InvalidArgument("host device: an event of another device");
    if (stream == Stream::kCompute) return e->Synchronize();
    std::shared_ptr<EventState> state = e->state();
    Enqueue(stream, {}, [state] {
      std::unique_lock<std::mutex> lock(state->mu);
      state->cv.wait(lock, [&] { return state->done; });
    });
    return Status::Ok();
  }

  Status Synchronize(Stream stream) override {
    if (stream == Stream::kCompute) return Status::Ok();
    ZT_ASSIGN_OR_RETURN(std::unique_ptr<Event> e, Record(stream));
    return e->Synchronize();
  }

  void* native_stream(Stream) const override { return nullptr; }
  Status RegisterHost(void* ptr, size_t bytes, HostAccess access) override {
    if (bytes == 0) return Status::Ok();
    if (ptr == nullptr) {
      return Status::InvalidArgument(
          StrCat("host device: RegisterHost of a null pointer (", bytes, " B)"));
    }
    ZT_RETURN_IF_ERROR(CheckAccess(ptr, bytes, access));
    std::lock_guard<std::mutex> lock(mem_mu_);
    ++registered_[{reinterpret_cast<uintptr_t>(ptr), bytes}];
    return Status::Ok();
  }
  // Counted as CUDA counts them: a range never registered (or unregistered
  // as many times as it was registered) is refused.
  Status UnregisterHost(void* ptr, size_t bytes) override {
    if (bytes == 0) return Status::Ok();
    std::lock_guard<std::mutex> lock(mem_mu_);
    auto it = registered_.find({reinterpret_cast<uintptr_t>(ptr), bytes});
    if (it == registered_.end()) {
      return Status::InvalidArgument(StrCat("host device: UnregisterHost of ", bytes, " B at ", ptr,
                                            ", a range this device never registered"));
    }
    if (--it->second == 0) registered_.erase(it);
    return Status::Ok();
  }

  void EnableTimeline(bool on) override {
    std::lock_guard<std::mutex> lock(timeline_mu_);
    timeline_on_ = on;
  }
  void AddSpan(TimelineSpan span) override {
    std::lock_guard<std::mutex> lock(timeline_mu_);
    if (timeline_on_) timeline_.push_back(std::move(span));
  }
  std::vector<TimelineSpan> timeline() const override {
    std::lock_guard<std::mutex> lock(timeline_mu_);
    return timeline_;
  }

 private:
  Status CheckAccess(void* ptr, size_t bytes, HostAccess access) const {
    if (access == HostAccess::kReadOnly) return Status::Ok();
    // As CUDA: a read-only mapping pinned without cudaHostRegisterReadOnly
    // is refused, so the runner's registrations are checked on CPU too.
    ZT_ASSIGN_OR_RETURN(bool writable, MappedWritable(ptr, bytes));
    if (!writable) {
      return Status::InvalidArgument(
          StrCat("host device: RegisterHost of ", bytes, " B at ", ptr,
                 " for read-write access, but the range is mapped read-only (register it "
                 "with HostAccess::kReadOnly)"));
    }
    return Status::Ok();
  }

  struct Allocation {
    size_t bytes;
    MemoryPurpose purpose;
  };
  struct Task {
    std::string label;  // empty: not a span of the timeline
    std::function<void()> fn;
    // The bytes a copy or fill writes (checked copies: a later copy on the
    // stream may read them before this task has run).
    const uint8_t* write = nullptr;
    size_t write_bytes = 0;
  };

  // Whether work queued on `stream` and not yet finished writes into
  // [src, src + bytes): a copy reading it then reads what that work leaves,
  // in stream order, and its source may change before it runs.
  bool WrittenAhead(Stream stream, const void* src, size_t bytes) {
    CopyQueue& q = Queue(stream);
    const auto* a = static_cast<const uint8_t*>(src);
    const auto overlaps = [&](const uint8_t* w, size_t n) {
      return w != nullptr && w < a + bytes && a < w + n;
    };
    std::lock_guard<std::mutex> lock(q.mu);
    if (overlaps(q.running_write, q.running_write_bytes)) return true;
    return std::any_of(q.tasks.begin(), q.tasks.end(),
                       [&](const Task& t) { return overlaps(t.write, t.write_bytes); });
  }

  // A copy; in test mode, delayed and checked (see HostDeviceOptions).
  Status RunCopy(Stream stream, const char* label, void* dst, const void* src, size_t bytes) {
    ZT_RETURN_IF_ERROR(owner_.Check("a host device copy"));  // no copy thread in a child
    const auto* written = static_cast<const uint8_t*>(dst);
    if (!IsCopy(stream) || !options_.check_copy_sources || WrittenAhead(stream, src, bytes)) {
      return Run(
          stream, label, [=] { std::memcpy(dst, src, bytes); }, written, bytes);
    }
    const uint32_t queued = Crc32c(src, bytes);
    std::shared_ptr<Hazard> hazard = hazard_;
    return Run(
        stream, label,
        [=] {
          if (Crc32c(src, bytes) != queued) {
            hazard->Set(Status::Internal(
                StrCat("host device (checked copies): the source of a ", label, " copy of ", bytes,
                       " bytes changed between the call that queued it and its run: a buffer was "
                       "released or reused before its copy finished")));
          }
          std::memcpy(dst, src, bytes);
        },
        written, bytes);
  }

  Status Run(Stream stream, const char* label, std::function<void()> fn,
             const uint8_t* write = nullptr, size_t write_bytes = 0) {
    ZT_RETURN_IF_ERROR(owner_.Check("a host device call"));
    if (IsCopy(stream)) {
      Enqueue(stream, label, std::move(fn), write, write_bytes);
      return Status::Ok();
    }
    fn();
    return Status::Ok();
  }

  // One copy stream: its tasks, run in order by its thread.
  struct CopyQueue {
    Stream stream = Stream::kCopy;
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Task> tasks;
    const uint8_t* running_write = nullptr;  // of the task running now
    size_t running_write_bytes = 0;
    bool stop = false;
    std::thread thread;
  };
  CopyQueue& Queue(Stream s) { return queues_[s == Stream::kCopyOut ? 1 : 0]; }

  void Enqueue(Stream stream, std::string label, std::function<void()> fn,
               const uint8_t* write = nullptr, size_t write_bytes = 0) {
    CopyQueue& q = Queue(stream);
    {
      std::lock_guard<std::mutex> lock(q.mu);
      q.tasks.push_back({std::move(label), std::move(fn), write, write_bytes});
    }
    q.cv.notify_one();
  }

  void CopyLoop(CopyQueue& q) {
    for (;;) {
      Task task;
      {
        std::unique_lock<std::mutex> lock(q.mu);
        q.cv.wait(lock, [&] { return q.stop || !q.tasks.empty(); });
        if (q.tasks.empty()) return;  // stopping, and everything queued is done
        task = std::move(q.tasks.front());
        q.tasks.pop_front();
        q.running_write = task.write;
        q.running_write_bytes = task.write_bytes;
      }
      if (options_.copy_delay.count() > 0 && !task.label.empty()) {
        std::this_thread::sleep_for(options_.copy_delay);
      }
      const Clock::time_point t0 = Clock::now();
      task.fn();
      {
        std::lock_guard<std::mutex> lock(q.mu);
        q.running_write = nullptr;
      }
      if (!task.label.empty()) {
        AddSpan({.stream = q.stream, .label = task.label, .start = t0, .end = Clock::now()});
      }
    }
  }

  mutable std::mutex mem_mu_;
  std::unordered_map<void*, Allocation> allocations_;
  std::map<std::pair<uintptr_t, size_t>, int> registered_;  // RegisterHost's counts
  uint64_t allocated_ = 0;  // the bytes of allocations_, every purpose
  MemoryStats stats_[kMemoryPurposes];

  mutable std::mutex timeline_mu_;
  bool timeline_on_ = false;
  std::vector<TimelineSpan> timeline_;

  const HostDeviceOptions options_;
  ProcessOwner owner_;
  const std::shared_ptr<Hazard> hazard_ = std::make_shared<Hazard>();

  // kCopy, kCopyOut; last: their threads use the rest.
  std::unique_ptr<CopyQueue[]> queues_ = std::make_unique<CopyQueue[]>(2);
};

}  // namespace

Result<std::unique_ptr<Device>> MakeHostDevice(const HostDeviceOptions& options) {
  auto device = std::make_unique<HostDevice>(options);
  ZT_RETURN_IF_ERROR(device->Start());
  return std::unique_ptr<Device>(std::move(device));
}

}  // namespace ztier::client
