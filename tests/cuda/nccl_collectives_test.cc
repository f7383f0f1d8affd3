// NCCL collectives (client/nccl_collectives.cc): with every CUDA device of
// the machine (up to 8; one runs NCCL's calls on a world of one), an
// in-place all-gather and a reduce-scatter across one thread per rank give
// the expected values (small integers, exact in bf16 whatever the
// summation order). Without enough devices, creating them is Unavailable and
// says why; the device tests skip with that reason.
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "client/ztier.h"
#include "common/bf16.h"

namespace ztier::client {
namespace {

TEST(NcclCollectivesTest, TooFewDevicesIsUnavailable) {
  const int have = CudaDeviceCount();
  std::vector<int> ordinals;
  for (int i = 0; i <= have; ++i) ordinals.push_back(i);  // one more than the machine has
  Result<std::vector<std::unique_ptr<Collectives>>> c = MakeNcclCollectives(ordinals);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable) << c.status();
  EXPECT_NE(std::string(c.status().message()).find("CUDA device"), std::string::npos) << c.status();
}

TEST(NcclCollectivesTest, EmptyOrdinalsIsInvalidArgument) {
  Result<std::vector<std::unique_ptr<Collectives>>> c = MakeNcclCollectives({});
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << c.status();
}

// Rank r's value for element i of shard s of the reduce-scatter input; the
// sum over ranks is an integer below 256, exact in bf16.
float ReduceInput(int r, int s, size_t i) { return static_cast<float>(r + 1 + s + i % 4); }
// Rank r's own shard for the all-gather.
float GatherValue(int r, size_t i) { return static_cast<float>(r * 16 + i % 16); }

// `host` (world_size x shard elements) must outlive `device`: the device
// keeps it registered until it is destroyed.
Status RunRank(Device& device, Collectives& coll, size_t shard, std::vector<bf16>& host,
               std::string* failure) {
  const int R = coll.world_size(), r = coll.rank();
  const size_t total = shard * R;
  ZT_RETURN_IF_ERROR(
      device.RegisterHost(host.data(), total * sizeof(bf16), client::HostAccess::kReadWrite));

  // All-gather in place: only this rank's shard is filled in.
  ZT_ASSIGN_OR_RETURN(void* gathered,
                      device.Allocate(total * sizeof(bf16), MemoryPurpose::kParams));
  for (size_t i = 0; i < total; ++i) host[i] = FloatToBf16(-1.0f);
  for (size_t i = 0; i < shard; ++i) host[r * shard + i] = FloatToBf16(GatherValue(r, i));
  ZT_RETURN_IF_ERROR(
      device.CopyToDevice(gathered, host.data(), total * sizeof(bf16), Stream::kCopy));
  ZT_ASSIGN_OR_RETURN(std::unique_ptr<Event> copied, device.Record(Stream::kCopy));
  ZT_RETURN_IF_ERROR(device.Wait(Stream::kCompute, *copied));
  ZT_RETURN_IF_ERROR(coll.AllGather(static_cast<bf16*>(gathered), shard, device, Stream::kCompute));
  ZT_RETURN_IF_ERROR(
      device.CopyToHost(host.data(), gathered, total * sizeof(bf16), Stream::kCompute));
  ZT_RETURN_IF_ERROR(device.Synchronize(Stream::kCompute));
  for (int s = 0; s < R && failure->empty(); ++s) {
    for (size_t i = 0; i < shard; ++i) {
      if (Bf16ToFloat(host[s * shard + i]) != GatherValue(s, i)) {
        *failure = StrCat("rank ", r, ": all-gather shard ", s, " element ", i, " is ",
                          Bf16ToFloat(host[s * shard + i]), ", want ", GatherValue(s, i));
        break;
      }
    }
  }
  device.Free(gathered);

  // Reduce-scatter: shard r of the output is the sum over ranks of shard r.
  ZT_ASSIGN_OR_RETURN(void* input, device.Allocate(total * sizeof(bf16), MemoryPurpose::kGrads));
  ZT_ASSIGN_OR_RETURN(void* output, device.Allocate(shard * sizeof(bf16), MemoryPurpose::kGrads));
  for (int s = 0; s < R; ++s) {
    for (size_t i = 0; i < shard; ++i) host[s * shard + i] = FloatToBf16(ReduceInput(r, s, i));
  }
  ZT_RETURN_IF_ERROR(
      device.CopyToDevice(input, host.data(), total * sizeof(bf16), Stream::kCompute));
  ZT_RETURN_IF_ERROR(coll.ReduceScatter(static_cast<const bf16*>(input), static_cast<bf16*>(output),
                                        shard, device, Stream::kCompute));
  ZT_RETURN_IF_ERROR(
      device.CopyToHost(host.data(), output, shard * sizeof(bf16), Stream::kCompute));
  ZT_RETURN_IF_ERROR(device.Synchronize(Stream::kCompute));
  for (size_t i = 0; i < shard && failure->empty(); ++i) {
    float want = 0;
    for (int q = 0; q < R; ++q) want += ReduceInput(q, r, i);
    if (Bf16ToFloat(host[i]) != want) {
      *failure = StrCat("rank ", r, ": reduce-scatter element ", i, " is ", Bf16ToFloat(host[i]),
                        ", want ", want);
    }
  }
  device.Free(input);
  device.Free(output);
  return Status::Ok();
}

// With one device (R = 1) NCCL's calls, bf16 types, streams and pool
// memory are still exercised; with more, the values cross devices.
TEST(NcclCollectivesTest, AllGatherAndReduceScatterAcrossDevices) {
  const int have = CudaDeviceCount();
  if (have < 1) GTEST_SKIP() << "no CUDA device";
  const int R = have < 8 ? have : 8;
  const std::vector<size_t> shards = {1, 4099, size_t{1} << 20};
  // Host staging buffers, one per (shard size, rank); declared before the
  // devices so that they are freed after the devices unregister them.
  std::vector<std::vector<bf16>> host(shards.size() * R);
  std::vector<int> ordinals;
  std::vector<std::unique_ptr<Device>> devices;
  for (int r = 0; r < R; ++r) {
    ordinals.push_back(r);
    Result<std::unique_ptr<Device>> d = MakeCudaDevice(r);
    ASSERT_TRUE(d.ok()) << d.status();
    devices.push_back(std::move(*d));
  }
  Result<std::vector<std::unique_ptr<Collectives>>> colls = MakeNcclCollectives(ordinals);
  if (!colls.ok() && colls.status().code() == StatusCode::kUnavailable) {
    GTEST_SKIP() << colls.status().message();
  }
  ASSERT_TRUE(colls.ok()) << colls.status();
  ASSERT_EQ(colls->size(), static_cast<size_t>(R));

  for (size_t k = 0; k < shards.size(); ++k) {
    const size_t shard = shards[k];
    std::vector<Status> statuses(R);
    std::vector<std::string> failures(R);
    std::vector<std::thread> threads;
    for (int r = 0; r < R; ++r) {
      EXPECT_EQ((*colls)[r]->rank(), r);
      EXPECT_EQ((*colls)[r]->world_size(), R);
      std::vector<bf16>* staging = &host[k * R + r];
      staging->resize(shard * R);
      threads.emplace_back([&, r, staging] {
        statuses[r] = RunRank(*devices[r], *(*colls)[r], shard, *staging, &failures[r]);
      });
    }
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < R; ++r) {
      EXPECT_TRUE(statuses[r].ok()) << "shard " << shard << ": " << statuses[r];
      EXPECT_TRUE(failures[r].empty()) << "shard " << shard << ": " << failures[r];
    }
  }
  colls->clear();
}

}  // namespace
}  // namespace ztier::client
