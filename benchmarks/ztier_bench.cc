// ztier-bench: the project's benchmark program. Each subcommand times one hot
// path and prints its ratio to a limit measured in the same run.
//
//   ztier-bench adam [options]   CPU AdamW vs a same-pattern memory kernel
//   ztier-bench daemon [options] a training step through ztierd vs embedded
//   ztier-bench nvme [options]   swap-space I/O vs fio on the same directories
//   ztier-bench pcie [options]   host <-> device copies vs the pinned cudaMemcpy peak
//   ztier-bench step [options]   the engine's optimizer step vs I/O and compute alone
//   ztier-bench train [options]  a GPT run with params streamed vs resident on the device
#include <signal.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string_view>

#include "benchmarks/subcommands.h"
#include "common/file_util.h"

namespace {

constexpr const char* kUsage = R"(usage: ztier-bench <subcommand> [options]

subcommands:
  adam    fused CPU AdamW step vs the same-pattern memory limit
  daemon  a model's stage-3 step through ztierd vs the embedded engine,
          alternated; the daemon's control round trip
  nvme    striped swap-space write/read vs fio on the same drives
  pcie    host <-> device copies from the engine's pinned buffers vs the
          pinned cudaMemcpyAsync peak (CUDA) or same-size memcpy (host)
  rpc     the daemon protocol's control round trip vs a bare SOCK_SEQPACKET
          ping-pong of the same sizes
  step    the engine's optimizer step (states on NVMe or in DRAM) vs its
          I/O alone and compute alone: overlap efficiency
  train   the GPT example (ztier-train) with its params streamed to the
          device vs resident there, states in DRAM and on NVMe: tokens/s,
          the ratio, the step split into compute and waits

'ztier-bench <subcommand> --help' lists a subcommand's options.
)";

}  // namespace

int main(int argc, char** argv) {
  ::signal(SIGXFSZ, SIG_IGN);  // past ulimit -f: EFBIG, said, not a silent death
  ztier::OpenClosedStandardFds();
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string_view sub = argv[1];
  int (*run)(int, char**) = nullptr;
  if (sub == "adam") run = ztier::bench::RunAdam;
  if (sub == "daemon") run = ztier::bench::RunDaemon;
  if (sub == "nvme") run = ztier::bench::RunNvme;
  if (sub == "pcie") run = ztier::bench::RunPcie;
  if (sub == "rpc") run = ztier::bench::RunRpc;
  if (sub == "step") run = ztier::bench::RunStep;
  if (sub == "train") run = ztier::bench::RunTrain;
  if (run == nullptr) {
    std::fprintf(stderr, "ztier-bench: unknown subcommand '%s'\n%s", argv[1], kUsage);
    return 2;
  }
  const int code = run(argc - 2, argv + 2);
  // Output that did not all reach its file (a full disk, /dev/full) is a
  // failure: `ztier-bench adam --json > out.json && plot` went on with a
  // JSON cut mid-object.
  errno = 0;
  const bool flushed = std::fflush(stdout) == 0;
  if (code == 0 && (!flushed || std::ferror(stdout) != 0)) {
    std::fprintf(
        stderr,
        "ztier-bench %s: its output could not all be written%s%s: what reached it is cut short\n",
        argv[1], flushed || errno == 0 ? "" : ": ",
        flushed || errno == 0 ? "" : std::strerror(errno));
    return 1;
  }
  return code;
}
