// ztier cpu_adam: Executor (a oneTBB task arena bounded in threads and kept on
// one NUMA node) and topology detection through hwloc.
//
// Thread safety: DetectTopology() is safe from any thread. An Executor may be
// used by several threads at once (task_arena::execute is thread-safe); moving
// or destroying it while a call is in flight is a programmer error.
#include <hwloc.h>

#include <memory>
#include <utility>

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/info.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>

#include "common/log.h"
#include "common/tsan.h"
#include "cpu_adam/adamw.h"

namespace ztier::cpu_adam {
namespace {

struct TopologyDeleter {
  void operator()(hwloc_topology* t) const { hwloc_topology_destroy(t); }
};
using TopologyPtr = std::unique_ptr<hwloc_topology, TopologyDeleter>;

Result<TopologyPtr> LoadTopology() {
  hwloc_topology_t raw = nullptr;
  if (hwloc_topology_init(&raw) != 0) {
    return PosixError("hwloc_topology_init", errno);
  }
  TopologyPtr topo(raw);
  if (hwloc_topology_load(topo.get()) != 0) {
    return PosixError("hwloc_topology_load", errno);
  }
  return topo;
}

// NUMA node index (logical) of the CPU the calling thread last ran on, or 0.
int CurrentNode(hwloc_topology_t topo) {
  hwloc_bitmap_t set = hwloc_bitmap_alloc();
  int node = 0;
  if (set != nullptr && hwloc_get_last_cpu_location(topo, set, HWLOC_CPUBIND_THREAD) == 0) {
    const int n = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE);
    for (int i = 0; i < n; ++i) {
      hwloc_obj_t obj = hwloc_get_obj_by_type(topo, HWLOC_OBJ_NUMANODE, i);
      if (obj != nullptr && hwloc_bitmap_intersects(obj->cpuset, set)) {
        node = i;
        break;
      }
    }
  }
  hwloc_bitmap_free(set);
  return node;
}

}  // namespace

Result<Topology> DetectTopology() {
  ZT_ASSIGN_OR_RETURN(TopologyPtr topo, LoadTopology());
  Topology t;
  t.numa_nodes = std::max(1, hwloc_get_nbobjs_by_type(topo.get(), HWLOC_OBJ_NUMANODE));
  t.cores = std::max(1, hwloc_get_nbobjs_by_type(topo.get(), HWLOC_OBJ_CORE));
  for (int i = 0; i < t.numa_nodes; ++i) {
    hwloc_obj_t node = hwloc_get_obj_by_type(topo.get(), HWLOC_OBJ_NUMANODE, i);
    int cores = node == nullptr ? 0
                                : hwloc_get_nbobjs_inside_cpuset_by_type(topo.get(), node->cpuset,
                                                                         HWLOC_OBJ_CORE);
    t.cores_per_node.push_back(std::max(cores, 0));
  }
  if (t.numa_nodes == 1) t.cores_per_node.assign(1, t.cores);
  return t;
}

struct Executor::Impl {
  oneapi::tbb::task_arena arena;
  int threads;
  int numa_node;
  Impl(const oneapi::tbb::task_arena::constraints& c, int t, int node)
      : arena(c), threads(t), numa_node(node) {}
};

Result<Executor> Executor::Create(const Options& options) {
  if (options.threads < 0) {
    return Status::InvalidArgument(
        StrCat("optimizer threads must be >= 0 (0 = all cores), got ", options.threads));
  }
  ZT_ASSIGN_OR_RETURN(TopologyPtr topo, LoadTopology());
  const int nodes = std::max(1, hwloc_get_nbobjs_by_type(topo.get(), HWLOC_OBJ_NUMANODE));
  if (options.numa_node < -1 || options.numa_node >= nodes) {
    return Status::InvalidArgument(StrCat("NUMA node ", options.numa_node,
                                          " does not exist: this machine has ", nodes,
                                          " node(s), numbered 0..", nodes - 1));
  }

  int node = -1;
  int cores = std::max(1, hwloc_get_nbobjs_by_type(topo.get(), HWLOC_OBJ_CORE));
  oneapi::tbb::task_arena::constraints constraints;
  if (nodes > 1) {
    node = options.numa_node >= 0 ? options.numa_node : CurrentNode(topo.get());
    hwloc_obj_t obj = hwloc_get_obj_by_type(topo.get(), HWLOC_OBJ_NUMANODE, node);
    if (obj != nullptr) {
      cores = std::max(
          1, hwloc_get_nbobjs_inside_cpuset_by_type(topo.get(), obj->cpuset, HWLOC_OBJ_CORE));
    }
    // oneTBB numbers NUMA nodes through tbbbind (hwloc); if it could not load
    // tbbbind it reports a single id of -1 and the arena stays unconstrained.
    const std::vector<oneapi::tbb::numa_node_id> ids = oneapi::tbb::info::numa_nodes();
    if (static_cast<size_t>(node) < ids.size() && ids[node] >= 0) {
      constraints.set_numa_id(ids[node]);
    } else {
      ZT_LOG(kWarn, "cpu_adam") << "oneTBB cannot bind to NUMA node " << node
                                << " (tbbbind missing?): optimizer threads are not NUMA-local";
    }
  }
  // No more than oneTBB runs at once in this process (the machine's, or its
  // affinity mask's): asked for more, it would run fewer and say so only on
  // stderr, while threads() named the count asked for.
  const int most = std::max(1, oneapi::tbb::info::default_concurrency());
  int threads = options.threads > 0 ? options.threads : cores;
  if (threads > most) {
    ZT_LOG(kWarn, "cpu_adam") << "executor: " << threads << " threads asked for; this process "
                              << "runs " << most << " at once: " << most;
    threads = most;
  }
  constraints.set_max_concurrency(threads);
  auto impl = std::make_unique<Impl>(constraints, threads, node);
  impl->arena.initialize();
  ZT_LOG(kInfo, "cpu_adam") << "executor: " << threads << " thread(s)"
                            << (node >= 0 ? StrCat(" on NUMA node ", node) : std::string());
  return Executor(std::move(impl));
}

Executor::Executor(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Executor::Executor(Executor&&) noexcept = default;
Executor& Executor::operator=(Executor&&) noexcept = default;
Executor::~Executor() = default;

int Executor::threads() const { return impl_->threads; }
int Executor::numa_node() const { return impl_->numa_node; }

void Executor::ParallelFor(size_t n, const std::function<void(size_t, size_t)>& body) {
  if (n == 0) return;
  if (n == 1 || impl_->threads == 1) {
    body(0, n);
    return;
  }
  TsanEdge start, done;  // oneTBB's hand-off, as TSan cannot see it (common/tsan.h)
  start.Release();
  impl_->arena.execute([&] {
    oneapi::tbb::parallel_for(
        oneapi::tbb::blocked_range<size_t>(0, n),
        [&](const oneapi::tbb::blocked_range<size_t>& r) {
          start.Acquire();
          body(r.begin(), r.end());
          done.Release();
        },
        oneapi::tbb::static_partitioner());
  });
  done.Acquire();
}

}  // namespace ztier::cpu_adam
