// NCCL collectives in a build without NCCL: creating them reports why.
#include "client/ztier.h"

namespace ztier::client {

Result<std::vector<std::unique_ptr<Collectives>>> MakeNcclCollectives(
    const std::vector<int>& ordinals) {
  return Status::Unavailable(StrCat("NCCL collectives for ", ordinals.size(),
                                    " devices: this build of ztier has no NCCL (it needs CUDA "
                                    "and nccl.h / libnccl at configure time)"));
}

Result<NcclId> MakeNcclId() {
  return Status::Unavailable("NCCL unique id: this build of ztier has no NCCL");
}

Result<std::unique_ptr<Collectives>> MakeNcclRankCollectives(int ordinal, int rank, int world_size,
                                                             const NcclId&, NcclPeers) {
  return Status::Unavailable(StrCat("NCCL rank ", rank, "/", world_size, " (cuda:", ordinal,
                                    "): this build of ztier has no NCCL"));
}

}  // namespace ztier::client
