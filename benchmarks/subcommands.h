// ztier-bench subcommands. Each takes the arguments after its name and
// returns the process exit code (0 ok, 1 failure, 2 bad usage).
#ifndef ZTIER_BENCHMARKS_SUBCOMMANDS_H_
#define ZTIER_BENCHMARKS_SUBCOMMANDS_H_

namespace ztier::bench {

int RunAdam(int argc, char** argv);
int RunDaemon(int argc, char** argv);
int RunNvme(int argc, char** argv);
int RunPcie(int argc, char** argv);
int RunRpc(int argc, char** argv);
int RunStep(int argc, char** argv);
int RunTrain(int argc, char** argv);

}  // namespace ztier::bench

#endif  // ZTIER_BENCHMARKS_SUBCOMMANDS_H_
