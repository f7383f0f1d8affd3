// The daemon protocol's codec: every message and payload round-trips, and
// every damaged input is refused with a message naming what is wrong (every
// truncation, trailing bytes, bad enums, counts that cannot fit, sizes that
// overflow, a version mismatch naming both versions).
#include "engine/protocol.h"

#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <string>

namespace ztier::engine::protocol {
namespace {

JobSpec SampleSpec() {
  JobSpec j;
  j.name = "gpt";
  j.ranks = 2;
  j.optimizer.hyper = {.lr = 3e-4f,
                       .beta1 = 0.8,
                       .beta2 = 0.99999,
                       .eps = 1e-6f,
                       .weight_decay = 0.1f,
                       .mode = cpu_adam::Mode::kAdam};
  j.optimizer.clip_norm = 1.0f;
  j.optimizer.grad_accumulation = 4;
  j.optimizer_tier = Tier::kNvme;
  j.launch = 0x8000000000000001;
  j.units.push_back({"embed", {{"wte", {50257, 768}}, {"wpe", {1024, 768}}}});
  j.units.push_back({"head", {{"w", {768}}}});
  return j;
}

// Every proper prefix of `bytes` is refused.
template <class Decode>
void EveryPrefixIsRefused(const std::string& bytes, Decode decode) {
  for (size_t n = 0; n < bytes.size(); ++n) {
    auto r = decode(std::string_view(bytes).substr(0, n));
    ASSERT_FALSE(r.ok()) << "a prefix of " << n << " of " << bytes.size() << " bytes decoded";
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption);
  }
  auto longer = decode(bytes + '\0');
  ASSERT_FALSE(longer.ok());
  EXPECT_NE(longer.status().message().find("after the last field"), std::string::npos)
      << longer.status();
}

TEST(ProtocolTest, JobSpecRoundTripsAndEveryPrefixIsRefused) {
  const JobSpec j = SampleSpec();
  const std::string bytes = Encode(j);
  Result<JobSpec> back = DecodeJobSpec(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(Encode(*back), bytes);
  EXPECT_EQ(back->name, "gpt");
  EXPECT_EQ(back->ranks, 2);
  EXPECT_EQ(back->optimizer.hyper.mode, cpu_adam::Mode::kAdam);
  EXPECT_EQ(back->optimizer.hyper.beta2, 0.99999);  // double, not its float
  EXPECT_EQ(back->optimizer.grad_accumulation, 4);
  EXPECT_EQ(back->optimizer_tier, Tier::kNvme);
  EXPECT_EQ(back->launch, 0x8000000000000001u);
  ASSERT_EQ(back->units.size(), 2u);
  EXPECT_EQ(back->units[0].tensors[1].name, "wpe");
  EXPECT_EQ(back->units[0].tensors[0].shape, (std::vector<int64_t>{50257, 768}));
  EveryPrefixIsRefused(bytes, DecodeJobSpec);
}

// Param groups (weight decay each) and frozen tensors.
JobSpec GroupedSpec() {
  JobSpec j = SampleSpec();
  j.optimizer.group_weight_decay = {0.1f, 0.0f, 0.05f};
  j.units[0].tensors[0].group = 2;
  j.units[0].tensors[1].frozen = true;
  j.units[1].tensors[0].group = 1;
  j.units[1].tensors[0].frozen = true;
  return j;
}

TEST(ProtocolTest, ParamGroupsAndFrozenTensorsRoundTrip) {
  const JobSpec j = GroupedSpec();
  const std::string bytes = Encode(j);
  Result<JobSpec> back = DecodeJobSpec(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(Encode(*back), bytes);
  EXPECT_EQ(back->optimizer.group_weight_decay, j.optimizer.group_weight_decay);
  EXPECT_EQ(back->units[0].tensors[0].group, 2u);
  EXPECT_FALSE(back->units[0].tensors[0].frozen);
  EXPECT_EQ(back->units[0].tensors[1].group, 0u);
  EXPECT_TRUE(back->units[0].tensors[1].frozen);
  EXPECT_EQ(back->units[1].tensors[0].group, 1u);
  EXPECT_TRUE(back->units[1].tensors[0].frozen);
  EveryPrefixIsRefused(bytes, DecodeJobSpec);
  // As an attached rank's spec too.
  const AttachRequest a{.rank = 1, .timeout = std::chrono::seconds(1), .spec = j};
  Result<AttachRequest> ab = DecodeAttachRequest(Encode(a));
  ASSERT_TRUE(ab.ok()) << ab.status();
  EXPECT_EQ(Encode(*ab), Encode(a));
}

TEST(ProtocolTest, ParamGroupFaultsAreRefusedWithTheFieldNamed) {
  auto refused = [](const std::string& bytes, std::string_view what) {
    Result<JobSpec> r = DecodeJobSpec(bytes);
    ASSERT_FALSE(r.ok()) << what;
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption);
    EXPECT_NE(r.status().message().find(what), std::string::npos) << r.status();
  };
  JobSpec j = GroupedSpec();
  j.units[1].tensors[0].group = 3;  // the job has 3 groups: 0..2
  refused(Encode(j), "param group 3");
  j = SampleSpec();
  j.units[1].tensors[0].group = 1;  // no group weight decays: group 0 only
  refused(Encode(j), "param group 1");
  j = GroupedSpec();
  j.optimizer.group_weight_decay[1] = std::numeric_limits<float>::infinity();
  refused(Encode(j), "param group 1 is not finite");
  j = GroupedSpec();
  j.optimizer.group_weight_decay.assign(kMaxParamGroups + 1, 0.0f);
  refused(Encode(j), "over the limit");
  // The group weight decays sit after the fixed fields: a count past the
  // bytes left is refused before anything is allocated.
  // float lr, eps, wd; double betas; the u64 launch.
  const size_t at = 4 + 3 + 4 + 1 + 1 + 3 * 4 + 2 * 8 + 2 + 4 + 4 + 1 + 8;
  std::string bytes = Encode(GroupedSpec());
  const uint32_t many = kMaxParamGroups;
  std::memcpy(bytes.data() + at, &many, 4);
  refused(bytes, "cannot fit");
  // A frozen flag is 0 or 1.
  bytes = Encode(GroupedSpec());
  ASSERT_EQ(bytes.back(), 1);  // the last tensor's frozen flag
  bytes.back() = 2;
  refused(bytes, "frozen 2");
}

TEST(ProtocolTest, LearningRatesRoundTripAndTheirCountIsBounded) {
  const LearningRates l{.job = 4, .lrs = {3e-4f, 0.0f, 1e-5f}};
  Result<LearningRates> back = DecodeLearningRates(Encode(l));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->job, 4);
  EXPECT_EQ(back->lrs, l.lrs);
  EveryPrefixIsRefused(Encode(l), DecodeLearningRates);
  // The values are the engine's to judge (both transports refuse alike);
  // the codec carries them bit for bit.
  const LearningRates nan{.job = 0, .lrs = {std::numeric_limits<float>::quiet_NaN(), -1.0f}};
  EXPECT_EQ(Encode(*DecodeLearningRates(Encode(nan))), Encode(nan));
  EXPECT_FALSE(DecodeLearningRates(Encode(LearningRates{.job = -1, .lrs = {1.0f}})).ok());
  LearningRates many;
  many.job = 0;
  many.lrs.assign(kMaxParamGroups + 1, 1e-3f);
  Result<LearningRates> over = DecodeLearningRates(Encode(many));
  ASSERT_FALSE(over.ok());
  EXPECT_NE(over.status().message().find("over the limit"), std::string::npos) << over.status();
  // A count the bytes cannot hold (a truncated list).
  std::string cut = Encode(l);
  cut.resize(cut.size() - 4);
  Result<LearningRates> short_list = DecodeLearningRates(cut);
  ASSERT_FALSE(short_list.ok());
  EXPECT_NE(short_list.status().message().find("cannot fit"), std::string::npos)
      << short_list.status();
  EXPECT_EQ(MessageTypeName(MessageType::kSetLearningRates), "set_learning_rates");
  EXPECT_EQ(MessageTypeName(MessageType::kAbortStep), "abort_step");
  Result<std::string> m = EncodeMessage({.type = MessageType::kSetLearningRates}, Encode(l));
  ASSERT_TRUE(m.ok());
  Result<Header> h = DecodeHeader(*m, 0);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->type, MessageType::kSetLearningRates);
}

TEST(ProtocolTest, JobSpecLimitsAreCheckedWithTheFieldNamed) {
  auto refused = [](const JobSpec& j, std::string_view what) {
    Result<JobSpec> r = DecodeJobSpec(Encode(j));
    ASSERT_FALSE(r.ok()) << what;
    EXPECT_NE(r.status().message().find(what), std::string::npos) << r.status();
  };
  JobSpec j = SampleSpec();
  j.units[0].tensors[0].shape = {int64_t{1} << 21, int64_t{1} << 21};  // 2^42 elements
  refused(j, "elements");
  j = SampleSpec();
  j.units[0].tensors[0].shape = {INT64_MAX, INT64_MAX};  // the product overflows 64 bits
  refused(j, "elements");
  j = SampleSpec();
  j.units[0].tensors[0].shape = {768, 0};
  refused(j, "dim 0");
  j = SampleSpec();
  j.units[0].tensors[0].shape = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  refused(j, "dims");
  j = SampleSpec();
  j.ranks = 0;
  refused(j, "ranks");
  j = SampleSpec();
  j.name.clear();
  refused(j, "name is empty");
  j = SampleSpec();
  j.name.assign(kMaxNameBytes + 1, 'x');
  refused(j, "over the limit");
  j = SampleSpec();
  j.optimizer.hyper.lr = std::numeric_limits<float>::quiet_NaN();
  refused(j, "not finite");
  j = SampleSpec();
  j.optimizer.grad_accumulation = 0;
  refused(j, "grad_accumulation");
  j = SampleSpec();
  j.units.clear();
  refused(j, "no units");
  j = SampleSpec();
  j.units[1].tensors.clear();
  refused(j, "no tensors");
  // 300 units of 2^40 elements each: each within the unit limit, the job
  // over its own.
  j = SampleSpec();
  j.units.assign(300, UnitSpec{"u", {{"w", {int64_t{1} << 40}}}});
  refused(j, "the job has more than");
}

TEST(ProtocolTest, CountsThatCannotFitAreRefusedBeforeAllocating) {
  std::string bytes = Encode(SampleSpec());
  // The unit count sits right after the fixed fields and the (empty) group
  // weight decays; claim the most units a spec may hold.
  const size_t at = 4 + 3 + 4 + 1 + 1 + 3 * 4 + 2 * 8 + 2 + 4 + 4 + 1 + 8 + 4;
  const uint32_t units = kMaxUnits;
  std::memcpy(bytes.data() + at, &units, 4);
  Result<JobSpec> r = DecodeJobSpec(bytes);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("cannot fit"), std::string::npos) << r.status();
}

TEST(ProtocolTest, SmallPayloadsRoundTripAndRefuseEveryPrefix) {
  const Hello hello{.min_version = 1, .max_version = 1, .name = "libztier test"};
  EXPECT_EQ(Encode(*DecodeHello(Encode(hello))), Encode(hello));
  EveryPrefixIsRefused(Encode(hello), DecodeHello);
  const UnitRef u{.job = 3, .unit = 7, .rank = 1};
  EXPECT_EQ(DecodeUnitRef(Encode(u))->unit, 7);
  EveryPrefixIsRefused(Encode(u), DecodeUnitRef);
  const StepWait w{.job = 1, .unit = 2, .step = 40, .timeout = std::chrono::seconds(30)};
  EXPECT_EQ(DecodeStepWait(Encode(w))->timeout, std::chrono::seconds(30));
  EveryPrefixIsRefused(Encode(w), DecodeStepWait);
  const AbortStepRequest abort{.job = 3, .step = 41};
  EXPECT_EQ(DecodeAbortStepRequest(Encode(abort))->step, 41);
  EveryPrefixIsRefused(Encode(abort), DecodeAbortStepRequest);
  AttachRequest a{.rank = 1, .timeout = std::chrono::seconds(5), .spec = SampleSpec()};
  a.spec.ranks = 2;
  EXPECT_EQ(Encode(*DecodeAttachRequest(Encode(a))), Encode(a));
  EveryPrefixIsRefused(Encode(a), DecodeAttachRequest);
  a.rank = 2;  // a rank the job does not have
  EXPECT_FALSE(DecodeAttachRequest(Encode(a)).ok());
  a.rank = 1;
  a.timeout = std::chrono::milliseconds(-1);
  EXPECT_FALSE(DecodeAttachRequest(Encode(a)).ok());
  const CollectiveRegionRequest cr{.job = 2, .bytes = 1 << 20};
  EXPECT_EQ(DecodeCollectiveRegionRequest(Encode(cr))->bytes, uint64_t{1} << 20);
  EveryPrefixIsRefused(Encode(cr), DecodeCollectiveRegionRequest);
  EXPECT_FALSE(
      DecodeCollectiveRegionRequest(Encode(CollectiveRegionRequest{.job = 2, .bytes = 5000})).ok());
  const JobHandle h{.job = 0, .units = 14, .ranks = 2, .state_dtype = StateDtype::kInt8};
  EXPECT_EQ(DecodeJobHandle(Encode(h))->units, 14);
  EXPECT_EQ(DecodeJobHandle(Encode(h))->state_dtype, StateDtype::kInt8);
  EveryPrefixIsRefused(Encode(h), DecodeJobHandle);
  const SharedBuffer rr{.region = 2,
                        .region_bytes = 1 << 20,
                        .offset = 4096,
                        .bytes = 8192,
                        .access = RegionAccess::kReadWrite};
  EXPECT_EQ(DecodeSharedBuffer(Encode(rr))->offset, 4096u);
  EveryPrefixIsRefused(Encode(rr), DecodeSharedBuffer);
  UnitLayout l{.numel = 1000, .padded = 1024, .shard = 512, .offsets = {0, 600}};
  EXPECT_EQ(DecodeUnitLayout(Encode(l))->offsets, l.offsets);
  EveryPrefixIsRefused(Encode(l), DecodeUnitLayout);
  JobCounters c;
  c.steps = 10;
  c.skipped_steps = 1;
  c.last_grad_norm = 2.5;
  c.nvme_write_bytes = 123456789;
  EXPECT_EQ(DecodeJobCounters(Encode(c))->nvme_write_bytes, 123456789u);
  EveryPrefixIsRefused(Encode(c), DecodeJobCounters);
  DramPoolStats p;
  p.budget_bytes = 1 << 30;
  p.reserved_bytes = 1 << 28;
  p.used_bytes = 1 << 20;
  p.regions = 1;
  EXPECT_EQ(DecodeDramPoolStats(Encode(p))->reserved_bytes, uint64_t{1} << 28);
  EveryPrefixIsRefused(Encode(p), DecodeDramPoolStats);
  const RegionList regions{
      .regions = {{.region = 4, .bytes = 1 << 20},
                  {.region = 5, .bytes = 8192, .access = RegionAccess::kReadWrite}}};
  ASSERT_TRUE(DecodeRegionList(Encode(regions)).ok());
  EXPECT_EQ(DecodeRegionList(Encode(regions))->regions[1].access, RegionAccess::kReadWrite);
  EveryPrefixIsRefused(Encode(regions), DecodeRegionList);
  const StagedData staged{.job = 1, .unit = 2, .bytes = 4096, .generation = 7};
  EXPECT_EQ(DecodeStagedData(Encode(staged))->bytes, 4096u);
  EXPECT_EQ(DecodeStagedData(Encode(staged))->generation, 7);
  EveryPrefixIsRefused(Encode(staged), DecodeStagedData);
  const StateCommit commit{.job = 2, .step = 9, .adam_step = 8, .generation = 3};
  EXPECT_EQ(DecodeStateCommit(Encode(commit))->generation, 3);
  EveryPrefixIsRefused(Encode(commit), DecodeStateCommit);
  const StateCommit keep{.job = 2, .step = kKeepSteps, .adam_step = kKeepSteps};
  EXPECT_EQ(DecodeStateCommit(Encode(keep))->step, kKeepSteps);
  const JobSteps steps{.job = 2, .step = 9, .adam_step = 8};
  EXPECT_EQ(DecodeJobSteps(Encode(steps))->adam_step, 8);
  EveryPrefixIsRefused(Encode(steps), DecodeJobSteps);
}

TEST(ProtocolTest, AJobsOwnStateDtypeRoundTrips) {
  for (std::optional<StateDtype> dtype :
       {std::optional<StateDtype>(), std::optional(StateDtype::kFp32),
        std::optional(StateDtype::kInt8)}) {
    JobSpec j;
    j.name = "q";
    j.units = {{"u", {{"w", {8}}}}};
    j.state_dtype = dtype;
    Result<JobSpec> back = DecodeJobSpec(Encode(j));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->state_dtype, dtype);
    EveryPrefixIsRefused(Encode(j), DecodeJobSpec);
  }
}

TEST(ProtocolTest, OperatorMessagesRoundTripAndRefuseEveryPrefix) {
  JobInfo j;
  j.id = 7;
  j.uid = 1000;
  j.name = "gpt";
  j.state = JobState::kFailed;
  j.failure = "step 3: io_error: pwrite /nvme0: Input/output error";
  j.world_size = 2;
  j.attached = 2;
  j.step = 41;
  j.state_dtype = StateDtype::kInt8;
  j.optimizer_tier = Tier::kNvme;
  j.counters.steps = 41;
  j.counters.last_step_seconds = 0.25;
  j.counters.step_seconds_buckets[5] = 41;
  j.counters.host_to_device_bytes = 1 << 30;
  const JobList list{.jobs = {j, j}, .more = true};
  Result<JobList> back = DecodeJobList(Encode(list));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(Encode(*back), Encode(list));
  EXPECT_EQ(back->jobs[1].failure, j.failure);
  EXPECT_EQ(back->jobs[1].counters.step_seconds_buckets[5], 41u);
  EXPECT_EQ(back->jobs[0].state, JobState::kFailed);
  EXPECT_TRUE(back->more);
  EXPECT_EQ(EncodedBytes(j) * 2 + 5, Encode(list).size());
  EveryPrefixIsRefused(Encode(list), DecodeJobList);
  // More bucketed steps than steps, an unknown state: refused by name.
  JobInfo bad = j;
  bad.counters.step_seconds_buckets[0] = 1;
  EXPECT_NE(DecodeJobList(Encode(JobList{.jobs = {bad}}))
                .status()
                .ToString()
                .find("step_seconds_buckets"),
            std::string::npos);
  bad = j;
  bad.state = static_cast<JobState>(9);
  EXPECT_FALSE(DecodeJobList(Encode(JobList{.jobs = {bad}})).ok());

  DaemonStatus s;
  s.version = "0.1.0";
  s.protocol = kVersion;
  s.uptime_seconds = 12.5;
  s.draining = true;
  s.dram_budget_bytes = 1 << 30;
  s.dram_reserved_bytes = 1 << 21;
  s.dram_used_bytes = 1 << 20;
  s.swap = {{.path = "/nvme0/ztier",
             .used_bytes = 1,
             .file_bytes = 2,
             .capacity_bytes = 3,
             .waiting_ops = 7,
             .quiet_seconds = 42.5,
             .problem = "its filesystem is read-only"}};
  s.totals.bytes.nvme_read = 99;
  s.totals.steps = 3;
  s.window.device_to_host = 5;
  s.window_seconds = 60;
  Result<DaemonStatus> sb = DecodeDaemonStatus(Encode(s));
  ASSERT_TRUE(sb.ok()) << sb.status();
  EXPECT_EQ(Encode(*sb), Encode(s));
  EXPECT_EQ(sb->swap[0].path, "/nvme0/ztier");
  EXPECT_EQ(sb->swap[0].problem, "its filesystem is read-only");
  EXPECT_TRUE(sb->draining);
  EveryPrefixIsRefused(Encode(s), DecodeDaemonStatus);
  for (double quiet :
       {-1.0, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    DaemonStatus odd = s;
    odd.swap[0].quiet_seconds = quiet;
    EXPECT_FALSE(DecodeDaemonStatus(Encode(odd)).ok()) << quiet;
  }
  DaemonStatus wordy = s;  // a long problem is cut to fit
  wordy.swap[0].problem.assign(1000, 'x');
  ASSERT_TRUE(DecodeDaemonStatus(Encode(wordy)).ok());
  EXPECT_EQ(DecodeDaemonStatus(Encode(wordy))->swap[0].problem.size(), kMaxSwapProblemBytes);
  s.dram_used_bytes = s.dram_reserved_bytes + 1;
  EXPECT_FALSE(DecodeDaemonStatus(Encode(s)).ok());

  const QuotaList quotas{
      .defaults = {.max_jobs = 16, .max_connections = 64},
      .quotas = {{.uid = 1000,
                  .quota = {.max_jobs = 2, .max_connections = 8, .max_dram_bytes = 1 << 30},
                  .custom = true,
                  .jobs = 1,
                  .dram_bytes = 4096,
                  .lingering_bytes = 1024,
                  .lingering_pids = {1234, 5678}}},
      .more = false};
  Result<QuotaList> qb = DecodeQuotaList(Encode(quotas));
  ASSERT_TRUE(qb.ok()) << qb.status();
  EXPECT_EQ(Encode(*qb), Encode(quotas));
  EXPECT_EQ(qb->quotas[0].lingering_pids, (std::vector<int32_t>{1234, 5678}));
  EveryPrefixIsRefused(Encode(quotas), DecodeQuotaList);
  QuotaList bad_quotas = quotas;
  bad_quotas.quotas[0].lingering_bytes =
      bad_quotas.quotas[0].dram_bytes + 1;  // more than the uid holds
  EXPECT_FALSE(DecodeQuotaList(Encode(bad_quotas)).ok());
  bad_quotas = quotas;
  bad_quotas.quotas[0].lingering_pids.assign(kMaxLingeringPids + 1, 1);
  EXPECT_FALSE(DecodeQuotaList(Encode(bad_quotas)).ok());

  const QuotaUpdate up{.uid = 1000,
                       .set = kQuotaMaxJobs | kQuotaMaxNvme,
                       .quota = {.max_jobs = 3, .max_nvme_bytes = 1 << 20}};
  ASSERT_TRUE(DecodeQuotaUpdate(Encode(up)).ok());
  EXPECT_EQ(DecodeQuotaUpdate(Encode(up))->quota.max_jobs, 3);
  EveryPrefixIsRefused(Encode(up), DecodeQuotaUpdate);
  EXPECT_FALSE(DecodeQuotaUpdate(Encode(QuotaUpdate{.uid = 1, .quota = {}})).ok());  // sets nothing
  EXPECT_FALSE(DecodeQuotaUpdate(Encode(QuotaUpdate{.uid = 1, .set = 1u << 7, .quota = {}})).ok());
  EXPECT_FALSE(
      DecodeQuotaUpdate(Encode(QuotaUpdate{.uid = 1, .set = kQuotaMaxJobs, .quota = {}})).ok());
  EXPECT_FALSE(DecodeQuotaUpdate(
                   Encode(QuotaUpdate{
                       .uid = 1, .set = kQuotaMaxJobs, .reset = true, .quota = {.max_jobs = 1}}))
                   .ok());

  for (const QuotaQuery& q : {QuotaQuery{.uid = 5}, QuotaQuery{.all = true, .after = 1000}}) {
    ASSERT_TRUE(DecodeQuotaQuery(Encode(q)).ok());
    EXPECT_EQ(Encode(*DecodeQuotaQuery(Encode(q))), Encode(q));
    EveryPrefixIsRefused(Encode(q), DecodeQuotaQuery);
  }
  EXPECT_EQ(DecodeListRequest(Encode(ListRequest{.after = 9}))->after, 9);
  EXPECT_FALSE(DecodeListRequest(Encode(ListRequest{.after = -2})).ok());
  EXPECT_TRUE(DecodeDrainRequest(Encode(DrainRequest{.on = true}))->on);
  EXPECT_FALSE(DecodeDrainRequest("\x02").ok());
  const EvictRequest ev{.job = 4, .reason = "maintenance"};
  EXPECT_EQ(DecodeEvictRequest(Encode(ev))->reason, "maintenance");
  EveryPrefixIsRefused(Encode(ev), DecodeEvictRequest);
  EXPECT_FALSE(DecodeEvictRequest(Encode(EvictRequest{.job = -1, .reason = ""})).ok());
}

TEST(ProtocolTest, InconsistentValuesAreRefused) {
  EXPECT_FALSE(DecodeRegionList(Encode(RegionList{})).ok());  // no regions
  EXPECT_FALSE(DecodeRegionList(Encode(RegionList{.regions = {{.region = 1, .bytes = 100}}})).ok());
  RegionList five;
  five.regions.assign(kMaxFdsPerMessage + 1, RegionInfo{.region = 1, .bytes = 4096});
  EXPECT_FALSE(DecodeRegionList(Encode(five)).ok());
  EXPECT_FALSE(DecodeStagedData(Encode(StagedData{.job = 0, .unit = 0, .bytes = 0})).ok());
  EXPECT_FALSE(DecodeJobSteps(Encode(JobSteps{.job = 0, .step = 3, .adam_step = 4})).ok());
  EXPECT_FALSE(
      DecodeStagedData(Encode(StagedData{.job = 0, .unit = 0, .bytes = 8, .generation = -2})).ok());
  // A step past 2^62 (one that overflows as ztierd counts on from it).
  constexpr int64_t kPast = kMaxStep + 1;
  EXPECT_FALSE(DecodeJobSteps(Encode(JobSteps{.job = 0, .step = kPast, .adam_step = 0})).ok());
  EXPECT_TRUE(DecodeJobSteps(Encode(JobSteps{.job = 0, .step = kMaxStep, .adam_step = 1})).ok());
  for (const auto& [step, adam] : {std::pair<int64_t, int64_t>{3, 4},
                                   {-1, 0},
                                   {0, -1},
                                   {-2, -2},
                                   {kPast, 0},
                                   {INT64_MAX, INT64_MAX}}) {
    EXPECT_FALSE(
        DecodeStateCommit(Encode(StateCommit{.job = 0, .step = step, .adam_step = adam})).ok())
        << step << " " << adam;
  }
  EXPECT_FALSE(DecodeStateCommit(Encode(StateCommit{.job = 0, .generation = -3})).ok());
  EXPECT_FALSE(
      DecodeSharedBuffer(
          Encode(SharedBuffer{.region = 0, .region_bytes = 4096, .offset = 4096, .bytes = 1}))
          .ok());  // past the region
  EXPECT_FALSE(DecodeSharedBuffer(
                   Encode(SharedBuffer{
                       .region = 0, .region_bytes = UINT64_MAX, .offset = UINT64_MAX, .bytes = 2}))
                   .ok());  // offset + bytes overflows
  EXPECT_FALSE(DecodeUnitRef(Encode(UnitRef{.job = -1, .unit = 0})).ok());
  EXPECT_FALSE(DecodeStepWait(Encode(StepWait{.job = 0, .unit = 0, .step = -5})).ok());
  EXPECT_FALSE(DecodeAbortStepRequest(Encode(AbortStepRequest{.job = 0, .step = 0})).ok());
  EXPECT_FALSE(
      DecodeUnitLayout(Encode(UnitLayout{.numel = 10, .padded = 5, .shard = 5, .offsets = {0}}))
          .ok());
  EXPECT_FALSE(DecodeUnitLayout(
                   Encode(UnitLayout{.numel = 10, .padded = 64, .shard = 64, .offsets = {0, 20}}))
                   .ok());  // an offset past numel
  JobCounters c;
  c.steps = 1;
  c.skipped_steps = 2;
  EXPECT_FALSE(DecodeJobCounters(Encode(c)).ok());
  std::string bad_access = Encode(SharedBuffer{.region = 0, .region_bytes = 8192, .bytes = 4096});
  bad_access.back() = 7;
  EXPECT_FALSE(DecodeSharedBuffer(bad_access).ok());
}

TEST(ProtocolTest, MessagesFrameAndEveryHeaderFaultIsNamed) {
  const std::string payload = Encode(UnitRef{.job = 1, .unit = 2, .rank = 0});
  Result<std::string> m = EncodeMessage(
      {.type = MessageType::kGradsReady, .flags = kFlagReply, .request_id = 99}, payload);
  ASSERT_TRUE(m.ok());
  ASSERT_EQ(m->size(), kHeaderBytes + payload.size());
  Result<Header> h = DecodeHeader(*m, 0);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->type, MessageType::kGradsReady);
  EXPECT_EQ(h->request_id, 99u);
  EXPECT_EQ(h->flags, kFlagReply);
  EXPECT_EQ(h->payload_bytes, payload.size());

  auto refused = [&](std::string bytes, uint32_t fds, std::string_view what) {
    Result<Header> r = DecodeHeader(bytes, fds);
    ASSERT_FALSE(r.ok()) << what;
    EXPECT_NE(r.status().message().find(what), std::string::npos) << r.status();
  };
  refused(m->substr(0, kHeaderBytes - 1), 0, "shorter than");
  std::string bad = *m;
  bad[0] = 'X';
  refused(bad, 0, "not a ztier message");
  bad = *m;
  bad[4] = static_cast<char>(kVersion + 1);  // another release's
  Result<Header> v = DecodeHeader(bad, 0);
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(v.status().message().find(StrCat("version ", kVersion + 1)), std::string::npos)
      << v.status();
  EXPECT_NE(v.status().message().find(StrCat("version ", kVersion)), std::string::npos)
      << v.status();
  bad = *m;
  bad[6] = 77;
  refused(bad, 0, "unknown message type 77");
  bad = *m;
  bad[8] = 0x40;
  refused(bad, 0, "unknown flags");
  bad = *m;
  bad[28] = 1;
  refused(bad, 0, "reserved");
  refused(*m + "x", 0, "payload bytes");
  refused(*m, 1, "fds");
  // A memfd payload has no inline bytes and its fd attached.
  Result<std::string> memfd =
      EncodeMessage({.type = MessageType::kRegisterJob, .flags = kFlagMemfd, .fds = 1}, "");
  ASSERT_TRUE(memfd.ok());
  EXPECT_TRUE(DecodeHeader(*memfd, 1).ok());
  Result<std::string> memfd_inline =
      EncodeMessage({.type = MessageType::kRegisterJob, .flags = kFlagMemfd, .fds = 1}, "x");
  refused(*memfd_inline, 1, "memfd");
  // Too large to frame: the encoder says to use a memfd.
  Result<std::string> big =
      EncodeMessage({.type = MessageType::kRegisterJob}, std::string(kMaxMessageBytes, 'x'));
  ASSERT_FALSE(big.ok());
  EXPECT_NE(big.status().message().find("memfd"), std::string::npos);
}

TEST(ProtocolTest, ReplyStatusCarriesTheErrorOrTheFields) {
  const std::string ok = EncodeStatus(Status::Ok()) + Encode(StepValue{.step = 12});
  Result<std::string_view> rest = DecodeReplyStatus(ok);
  ASSERT_TRUE(rest.ok()) << rest.status();
  EXPECT_EQ(DecodeStepValue(*rest)->step, 12);
  const Status err(StatusCode::kResourceExhausted, "uid 1000: pinned DRAM quota 8 GiB", 12);
  Result<std::string_view> e = DecodeReplyStatus(EncodeStatus(err));
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status(), err);
  std::string bad = EncodeStatus(err);
  bad[0] = 99;
  EXPECT_EQ(DecodeReplyStatus(bad).status().code(), StatusCode::kCorruption);
  EXPECT_EQ(DecodeReplyStatus(EncodeStatus(err) + "x").status().code(), StatusCode::kCorruption);
}

}  // namespace
}  // namespace ztier::engine::protocol
