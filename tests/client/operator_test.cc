// ztierd's operator side, end to end:
//  - DaemonControl (client/ztier.h) against a daemon in the test process:
//    the status and the jobs with their counters (steps, step times, the
//    runners' device traffic), quotas set, enforced, reset and kept in the
//    quota file across a restart, a damaged quota file refused, drain and
//    evict (the evicted job's client is told why, its uid uncharged);
//  - the ztierctl program against the ztierd program: tables, --json,
//    exit codes for "not running" (3), "refused" (4, a non-operator run as
//    uid 65534) and bad arguments (2);
//  - the Prometheus endpoint over TCP and a Unix socket: HTTP answers, the
//    exposition checked by its own rules (every sample in a declared
//    family, counters named _total, cumulative buckets whose +Inf is the
//    count) and by `promtool check metrics` where installed
//    (ZTIER_REQUIRE_PROMTOOL=1 makes a missing promtool a failure).
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <pwd.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "client/transport.h"
#include "client/ztier.h"
#include "engine/daemon.h"
#include "engine/metrics.h"
#include "engine/protocol.h"
#include "nvme/io_backend.h"
#include "tests/testing/as_nobody.h"
#include "tests/testing/scratch_dir.h"
#include "tests/testing/test_daemon.h"
#include "tests/testing/ztierd_process.h"

namespace ztier::client {
namespace {

using engine::JobInfo;
using engine::JobState;
using engine::UnitLayout;
using testing::AsNobody;
using testing::ScratchDir;
using testing::SmallEngine;
using testing::TestDaemon;
using testing::ZtierdProcess;
using namespace std::chrono_literals;

Session::ModelSpec TwoUnits(const std::string& name) {
  Session::ModelSpec m;
  m.name = name;
  for (int u = 0; u < 2; ++u) {
    m.units.push_back(
        {.name = StrCat("u", u), .tensors = {{.name = StrCat("u", u, ".w"), .shape = {4096}}}});
  }
  return m;
}

Result<std::unique_ptr<Session>> OpenSession(const std::string& socket) {
  SessionOptions o;
  o.daemon_socket = socket;
  return Session::Open(o);
}

// An in-process ztierd with the operator's control and a user's session.
struct OperatedDaemon {
  std::unique_ptr<TestDaemon> daemon;
  std::unique_ptr<DaemonControl> control;
  std::unique_ptr<Session> session;
};

Result<OperatedDaemon> StartOperatedDaemon() {
  OperatedDaemon o;
  ZT_ASSIGN_OR_RETURN(o.daemon, TestDaemon::Start(SmallEngine()));
  ZT_ASSIGN_OR_RETURN(o.control, DaemonControl::Connect(o.daemon->socket()));
  ZT_ASSIGN_OR_RETURN(o.session, OpenSession(o.daemon->socket()));
  return o;
}

// Sets weights, then `steps` steps through a runner on the host device
// (`before` called before each, with its index); returns the runner's
// stats (no prefetch: no fetch is in flight after the last step, so they
// are the runner's whole traffic).
Result<RunnerStats> Train(Model& m, int steps, const std::function<void(int)>& before = {}) {
  std::vector<float> w(4096, 0.01f);
  for (int u = 0; u < m.units(); ++u) ZT_RETURN_IF_ERROR(m.SetWeights(u, w.data(), w.size()));
  ZT_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, MakeHostDevice());
  ZT_ASSIGN_OR_RETURN(std::unique_ptr<Stage3Runner> runner,
                      Stage3Runner::Create(m, 0, *device, nullptr, {.prefetch_depth = 0}));
  // The grads' host copies live until the last step is published.
  std::vector<std::vector<bf16>> host(m.units());
  for (int u = 0; u < m.units(); ++u) host[u].assign(m.layout(u).padded, FloatToBf16(0.5f));
  for (int step = 0; step < steps; ++step) {
    if (before) before(step);
    for (int u = 0; u < m.units(); ++u) {
      ZT_RETURN_IF_ERROR(runner->Acquire(u).status());
      ZT_RETURN_IF_ERROR(runner->Release(u));
    }
    for (int u = m.units() - 1; u >= 0; --u) {
      ZT_RETURN_IF_ERROR(runner->Acquire(u).status());
      ZT_ASSIGN_OR_RETURN(bf16 * g, runner->GradBuffer(u));
      ZT_RETURN_IF_ERROR(
          device->CopyToDevice(g, host[u].data(), host[u].size() * sizeof(bf16), Stream::kCompute));
      ZT_RETURN_IF_ERROR(runner->PushGrads(u));
      ZT_RETURN_IF_ERROR(runner->Release(u));
    }
    ZT_RETURN_IF_ERROR(runner->Step());
  }
  ZT_RETURN_IF_ERROR(m.WaitPublished(steps, 30s));
  return runner->stats();
}

engine::DaemonOptions WithQuotaFile(const std::string& file) {
  engine::DaemonOptions o;
  o.quota_file = file;
  return o;
}

// ------------------------------------------------------ DaemonControl

TEST(OperatorTest, StatusAndJobsShowTheEngineAndTheRunnersTraffic) {
  Result<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(SmallEngine());
  ASSERT_TRUE(d.ok()) << d.status();
  Result<std::unique_ptr<Session>> s = OpenSession((*d)->socket());
  ASSERT_TRUE(s.ok()) << s.status();
  Result<std::unique_ptr<Model>> m = (*s)->RegisterModel(TwoUnits("gpt"));
  ASSERT_TRUE(m.ok()) << m.status();
  Result<RunnerStats> stats = Train(**m, 3);
  ASSERT_TRUE(stats.ok()) << stats.status();

  Result<std::unique_ptr<DaemonControl>> c = DaemonControl::Connect((*d)->socket());
  ASSERT_TRUE(c.ok()) << c.status();
  Result<engine::DaemonStatus> st = (*c)->GetStatus();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->protocol, engine::protocol::kVersion);
  EXPECT_FALSE(st->version.empty());
  EXPECT_TRUE(st->caller_is_admin);  // the test runs as the daemon's uid
  EXPECT_FALSE(st->draining);
  EXPECT_EQ(st->jobs, 1);
  EXPECT_EQ(st->connections, 2);
  EXPECT_EQ(st->dram_budget_bytes, uint64_t{128} << 20);
  EXPECT_GT(st->dram_used_bytes, 0u);
  EXPECT_GE(st->optimizer_threads, 1u);
  EXPECT_TRUE(st->swap.empty());
  EXPECT_EQ(st->totals.steps, 3);
  EXPECT_EQ(st->totals.jobs_registered, 1);
  EXPECT_EQ(st->totals.bytes.host_to_device, stats->h2d_bytes);
  EXPECT_EQ(st->totals.bytes.device_to_host, stats->d2h_bytes);
  EXPECT_GT(stats->h2d_bytes, 0u);

  Result<std::vector<JobInfo>> jobs = (*c)->Jobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 1u);
  const JobInfo& j = (*jobs)[0];
  EXPECT_EQ(j.name, "gpt");
  EXPECT_EQ(j.uid, ::geteuid());
  EXPECT_EQ(j.state, JobState::kTraining);
  EXPECT_EQ(j.step, 3);
  EXPECT_EQ(j.attached, 1);
  EXPECT_EQ(j.world_size, 1);
  EXPECT_EQ(j.counters.steps, 3);
  EXPECT_GT(j.counters.last_step_seconds, 0.0);
  uint64_t bucketed = 0;
  for (uint64_t b : j.counters.step_seconds_buckets) bucketed += b;
  EXPECT_EQ(bucketed, 3u);
  EXPECT_EQ(j.counters.host_to_device_bytes, stats->h2d_bytes);
  EXPECT_EQ(j.counters.device_to_host_bytes, stats->d2h_bytes);
  EXPECT_GT(j.counters.last_grad_norm, 0.0);

  // A job that goes keeps its figures in the totals.
  m->reset();
  st = (*c)->GetStatus();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->totals.steps, 3);
  EXPECT_EQ(st->totals.bytes.host_to_device, stats->h2d_bytes);
  EXPECT_TRUE((*c)->Jobs()->empty());
}

// A step's write-back stuck on its drive (a frozen filesystem, a drive that
// stopped answering) held up `ztierctl jobs` and every metrics scrape as
// long: the listing waited for the write-backs of the step under way.
TEST(OperatorTest, AStuckWriteBackHoldsUpNeitherTheListingNorTheMetrics) {
  ScratchDir swap("operator-stuck-swap");
  engine::Settings settings = SmallEngine();
  settings.optimizer_tier = engine::Tier::kNvme;
  settings.nvme_paths = {swap.path()};
  auto fault = std::make_shared<nvme::FaultBackend>(nvme::MakeUringBackend());
  Result<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(settings, {}, fault);
  ASSERT_TRUE(d.ok()) << d.status();
  Result<std::unique_ptr<Session>> s = OpenSession((*d)->socket());
  ASSERT_TRUE(s.ok()) << s.status();
  Session::ModelSpec spec = TwoUnits("stuck");
  spec.optimizer_tier = engine::Tier::kNvme;  // the job's states on the drive
  Result<std::unique_ptr<Model>> m = (*s)->RegisterModel(spec);
  ASSERT_TRUE(m.ok()) << m.status();
  // Step 2's write-backs take 2.5 s an op; its units are published first.
  ASSERT_TRUE(Train(**m, 2, [&](int step) {
                if (step == 1) fault->SlowDown(nvme::IoKind::kWrite, 2500ms);
              }).ok());
  Result<std::unique_ptr<DaemonControl>> c = DaemonControl::Connect((*d)->socket());
  ASSERT_TRUE(c.ok()) << c.status();
  const auto start = std::chrono::steady_clock::now();
  Result<std::vector<JobInfo>> jobs = (*c)->Jobs();
  const std::string metrics = (*d)->daemon().MetricsText();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  fault->SlowDown(nvme::IoKind::kWrite, 0ms);
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 1u);
  EXPECT_GE((*jobs)[0].step, 1);
  EXPECT_NE(metrics.find("stuck"), std::string::npos);
  EXPECT_LT(seconds, 1.5) << "the listing waited for the write-back";
}

// A job's state dtype is its own: set on the model, or by the client's
// ztier.state_dtype, it reaches a ztierd whose engine keeps fp32.
TEST(OperatorTest, AJobsStateDtypeTravelsToTheDaemon) {
  Result<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(SmallEngine());
  ASSERT_TRUE(d.ok()) << d.status();
  Result<std::unique_ptr<Session>> s = OpenSession((*d)->socket());
  ASSERT_TRUE(s.ok());
  Result<std::unique_ptr<Model>> fp32 = (*s)->RegisterModel(TwoUnits("fp32"));
  ASSERT_TRUE(fp32.ok()) << fp32.status();
  Session::ModelSpec spec = TwoUnits("int8");
  spec.state_dtype = engine::StateDtype::kInt8;
  Result<std::unique_ptr<Model>> int8 = (*s)->RegisterModel(spec);
  ASSERT_TRUE(int8.ok()) << int8.status();
  Result<engine::Settings> set =
      engine::ApplySetting(SmallEngine(), "ztier.state_dtype", "int8", "--state-dtype");
  ASSERT_TRUE(set.ok()) << set.status();
  SessionOptions o;
  o.settings = *set;
  o.daemon_socket = (*d)->socket();
  Result<std::unique_ptr<Session>> s8 = Session::Open(o);
  ASSERT_TRUE(s8.ok()) << s8.status();
  Result<std::unique_ptr<Model>> by_setting = (*s8)->RegisterModel(TwoUnits("by-setting"));
  ASSERT_TRUE(by_setting.ok()) << by_setting.status();
  ASSERT_TRUE(Train(**by_setting, 2).ok());

  Result<std::unique_ptr<DaemonControl>> c = DaemonControl::Connect((*d)->socket());
  ASSERT_TRUE(c.ok());
  Result<std::vector<JobInfo>> jobs = (*c)->Jobs();
  ASSERT_TRUE(jobs.ok());
  ASSERT_EQ(jobs->size(), 3u);
  std::map<std::string, JobInfo> by_name;
  for (const JobInfo& j : *jobs) by_name[j.name] = j;
  EXPECT_EQ(by_name["fp32"].state_dtype, engine::StateDtype::kFp32);
  EXPECT_EQ(by_name["int8"].state_dtype, engine::StateDtype::kInt8);
  EXPECT_EQ(by_name["by-setting"].state_dtype, engine::StateDtype::kInt8);
  // 8-bit m and v take less pinned DRAM: 6 bytes a parameter (plus scales)
  // instead of 12.
  EXPECT_LT(by_name["int8"].counters.dram_bytes, by_name["fp32"].counters.dram_bytes);
  EXPECT_EQ(by_name["by-setting"].counters.steps, 2);
}

TEST(OperatorTest, QuotasAreEnforcedResetAndKeptInTheQuotaFile) {
  ScratchDir dir("quotas");
  const std::string file = dir.path() + "/quotas.json";
  const uint32_t me = ::geteuid();
  {
    Result<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(SmallEngine(), WithQuotaFile(file));
    ASSERT_TRUE(d.ok()) << d.status();
    Result<std::unique_ptr<DaemonControl>> c = DaemonControl::Connect((*d)->socket());
    ASSERT_TRUE(c.ok()) << c.status();
    Result<engine::QuotaInfo> q = (*c)->GetQuota(me);
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_FALSE(q->custom);
    EXPECT_EQ(q->quota.max_jobs, 16);
    q = (*c)->SetQuota({.uid = me, .set = engine::kQuotaMaxJobs, .quota = {.max_jobs = 1}});
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_TRUE(q->custom);
    EXPECT_EQ(q->quota.max_jobs, 1);
    EXPECT_EQ(q->quota.max_connections, 64);  // the rest stays the default
    ASSERT_TRUE((*c)->SetQuota({.uid = 4242,
                                .set = engine::kQuotaMaxDram | engine::kQuotaMaxNvme,
                                .quota = {.max_dram_bytes = 1 << 20, .max_nvme_bytes = 2 << 20}})
                    .ok());
    // The job quota bites at once.
    Result<std::unique_ptr<Session>> s = OpenSession((*d)->socket());
    ASSERT_TRUE(s.ok());
    Result<std::unique_ptr<Model>> a = (*s)->RegisterModel(TwoUnits("a"));
    ASSERT_TRUE(a.ok()) << a.status();
    Result<std::unique_ptr<Model>> b = (*s)->RegisterModel(TwoUnits("b"));
    ASSERT_FALSE(b.ok());
    EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted) << b.status();
    EXPECT_NE(b.status().message().find("quota"), std::string::npos) << b.status();
    q = (*c)->GetQuota(me);
    ASSERT_TRUE(q.ok());
    EXPECT_EQ(q->jobs, 1);
    EXPECT_GT(q->dram_bytes, 0u);
    engine::Quota defaults;
    Result<std::vector<engine::QuotaInfo>> all = (*c)->AllQuotas(&defaults);
    ASSERT_TRUE(all.ok()) << all.status();
    EXPECT_EQ(defaults.max_jobs, 16);
    std::set<uint32_t> uids;
    for (const auto& info : *all) uids.insert(info.uid);
    EXPECT_TRUE(uids.count(me) && uids.count(4242)) << all->size();
    // Bad values are refused before anything changes.
    EXPECT_EQ((*c)->SetQuota({.uid = me, .set = engine::kQuotaMaxJobs, .quota = {.max_jobs = 0}})
                  .status()
                  .code(),
              StatusCode::kCorruption);
  }
  // A restarted daemon reads them back. The fields no one set follow the
  // defaults, changed since (they were written down as the old defaults,
  // and kept those for good).
  {
    engine::DaemonOptions tighter = WithQuotaFile(file);
    tighter.max_jobs_per_uid = 4;
    Result<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(SmallEngine(), tighter);
    ASSERT_TRUE(d.ok()) << d.status();
    Result<std::unique_ptr<DaemonControl>> c = DaemonControl::Connect((*d)->socket());
    ASSERT_TRUE(c.ok());
    Result<engine::QuotaInfo> q = (*c)->GetQuota(4242);
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_TRUE(q->custom);
    EXPECT_EQ(q->quota.max_dram_bytes, uint64_t{1} << 20);
    EXPECT_EQ(q->quota.max_nvme_bytes, uint64_t{2} << 20);
    EXPECT_EQ(q->quota.max_jobs, 4);
    EXPECT_EQ((*c)->GetQuota(me)->quota.max_jobs, 1);
    q = (*c)->SetQuota({.uid = me, .set = 0, .reset = true, .quota = {}});
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_FALSE(q->custom);
    EXPECT_EQ(q->quota.max_jobs, 4);
    // The file edited by hand while ztierd runs: the next quota set
    // refuses to overwrite the edit (it was lost without a word), and
    // changes nothing; put back, sets work again.
    std::string kept;
    {
      std::ifstream in(file);
      std::stringstream t;
      t << in.rdbuf();
      kept = t.str();
    }
    std::string by_hand = kept;
    by_hand.insert(by_hand.find("\"4242\""), "\"1234\": {\"max_jobs\": 2}, ");
    std::ofstream(file) << by_hand;
    q = (*c)->SetQuota({.uid = 4321, .set = engine::kQuotaMaxJobs, .quota = {.max_jobs = 5}});
    ASSERT_FALSE(q.ok());
    EXPECT_EQ(q.status().code(), StatusCode::kFailedPrecondition) << q.status();
    EXPECT_NE(q.status().message().find("was changed since ztierd read it"), std::string::npos)
        << q.status();
    EXPECT_FALSE((*c)->GetQuota(4321)->custom);
    {
      std::ifstream in(file);
      std::stringstream t;
      t << in.rdbuf();
      EXPECT_EQ(t.str(), by_hand) << "the edit was overwritten";
    }
    std::ofstream(file) << kept;
    EXPECT_TRUE(
        (*c)->SetQuota({.uid = 4321, .set = engine::kQuotaMaxJobs, .quota = {.max_jobs = 5}}).ok());
    EXPECT_TRUE((*c)->SetQuota({.uid = 4321, .set = 0, .reset = true, .quota = {}}).ok());
  }
  std::ifstream in(file);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(text.str().find("\"" + std::to_string(me) + "\""), std::string::npos) << text.str();
  EXPECT_NE(text.str().find("\"4242\""), std::string::npos) << text.str();
  EXPECT_EQ(text.str().find("max_jobs"), std::string::npos) << text.str();
  // A damaged quota file stops the daemon from starting, naming the file.
  for (const char* bad :
       {"{", "{\"format\": \"ztierd-quotas\", \"version\": 2, \"quotas\": {}}",
        "{\"format\": \"ztierd-quotas\", \"version\": 1, \"quotas\": {\"x\": {}}}",
        "{\"format\": \"ztierd-quotas\", \"version\": 1, \"quotas\": {\"7\": {\"max_jobs\": 0}}}",
        "{\"format\": \"ztierd-quotas\", \"version\": 1, \"quotas\": {\"7\": {\"jobz\": 1}}}",
        // A key twice: the last one won, silently.
        "{\"format\": \"ztierd-quotas\", \"version\": 1, \"quotas\": {\"7\": {\"max_jobs\": 2, "
        "\"max_jobs\": 3}}}",
        // A uid twice, written two ways: one won, by the file's order.
        "{\"format\": \"ztierd-quotas\", \"version\": 1, \"quotas\": {\"7\": {\"max_jobs\": 2}, "
        "\"07\": {\"max_jobs\": 3}}}",
        // A format that is no string: ztierd aborted (an uncaught exception).
        "{\"format\": 1, \"version\": 1, \"quotas\": {}}",
        "{\"format\": null, \"version\": 1, \"quotas\": {}}"}) {
    std::ofstream(file) << bad;
    Result<std::unique_ptr<engine::Daemon>> d =
        engine::Daemon::Create(SmallEngine(), WithQuotaFile(file));
    ASSERT_FALSE(d.ok()) << bad;
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument) << d.status();
    EXPECT_NE(d.status().message().find(file), std::string::npos) << d.status();
  }
}

// An evicted job's memory lives on in its client's mapping: the client's
// uid stays charged for it until the client unregisters the job (the
// library unmaps first) or exits; then the room is there again.
TEST(OperatorTest, AnEvictedJobsClientIsChargedForItsMappingUntilItLetsGo) {
  if (!testing::HavePeerPidfd()) GTEST_SKIP() << "this kernel has no SO_PEERPIDFD";
  Result<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(SmallEngine());
  ASSERT_TRUE(d.ok()) << d.status();
  Result<std::unique_ptr<Session>> s = OpenSession((*d)->socket());
  ASSERT_TRUE(s.ok()) << s.status();
  Result<std::unique_ptr<Model>> a = (*s)->RegisterModel(TwoUnits("a"));
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(Train(**a, 1).ok());
  const uint64_t job_bytes = (*a)->counters()->dram_bytes;
  Result<std::unique_ptr<DaemonControl>> c = DaemonControl::Connect((*d)->socket());
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE((*c)->SetQuota({.uid = ::geteuid(),
                              .set = engine::kQuotaMaxDram,
                              .quota = {.max_dram_bytes = job_bytes + 4096}})
                  .ok());
  Result<std::vector<JobInfo>> jobs = (*c)->Jobs();
  ASSERT_TRUE(jobs.ok() && jobs->size() == 1);
  ASSERT_TRUE((*c)->Evict((*jobs)[0].id, "room").ok());
  Result<std::unique_ptr<Model>> b = (*s)->RegisterModel(TwoUnits("b"));
  ASSERT_FALSE(b.ok()) << "registered beside the evicted job's mapped regions";
  EXPECT_NE(b.status().ToString().find("live on"), std::string::npos) << b.status();
  // The operator is told how much and who holds it (no job shows it).
  Result<engine::QuotaInfo> q = (*c)->GetQuota(::geteuid());
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->lingering_bytes, q->dram_bytes);
  EXPECT_GT(q->lingering_bytes, 0u);
  EXPECT_EQ(q->lingering_pids, std::vector<int32_t>{::getpid()});
  a->reset();  // unregisters: the library unmapped the regions
  q = (*c)->GetQuota(::geteuid());
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->lingering_bytes, 0u);
  EXPECT_TRUE(q->lingering_pids.empty());
  b = (*s)->RegisterModel(TwoUnits("b"));
  EXPECT_TRUE(b.ok()) << b.status();
}

// Two ranks map one job's regions: its memory lives once, and is charged
// once, until the last of them lets go (each was charged the whole regions).
TEST(OperatorTest, AnEvictedJobMappedByTwoRanksIsChargedOnceUntilBothLetGo) {
  if (!testing::HavePeerPidfd()) GTEST_SKIP() << "this kernel has no SO_PEERPIDFD";
  Result<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(SmallEngine());
  ASSERT_TRUE(d.ok()) << d.status();
  Result<std::unique_ptr<Session>> s0 = OpenSession((*d)->socket());
  Result<std::unique_ptr<Session>> s1 = OpenSession((*d)->socket());
  ASSERT_TRUE(s0.ok() && s1.ok());
  Session::ModelSpec spec = TwoUnits("two");
  spec.world_size = 2;
  Result<std::unique_ptr<Model>> r0 = (*s0)->RegisterModel(spec);
  ASSERT_TRUE(r0.ok()) << r0.status();
  Result<std::unique_ptr<Model>> r1 = (*s1)->AttachModel(spec, 1, 10s);
  ASSERT_TRUE(r1.ok()) << r1.status();
  Result<std::unique_ptr<DaemonControl>> c = DaemonControl::Connect((*d)->socket());
  ASSERT_TRUE(c.ok()) << c.status();
  Result<std::vector<JobInfo>> jobs = (*c)->Jobs();
  ASSERT_TRUE(jobs.ok() && jobs->size() == 1);
  const uint64_t job_bytes = (*jobs)[0].counters.dram_bytes;
  ASSERT_TRUE((*c)->Evict((*jobs)[0].id, "room").ok());
  const uint64_t lingering = (*c)->GetQuota(::geteuid())->dram_bytes;
  EXPECT_GT(lingering, 0u);
  EXPECT_LT(lingering, job_bytes) << "the regions were charged once a rank";
  r0->reset();  // rank 0 unregisters (unmapped); rank 1 maps them still
  EXPECT_EQ((*c)->GetQuota(::geteuid())->dram_bytes, lingering);
  r1->reset();
  EXPECT_EQ((*c)->GetQuota(::geteuid())->dram_bytes, 0u);
}

// A quota file that cannot be replaced (a directory in its place) is the
// daemon's trouble, not a bad request: FailedPrecondition (ztierctl's exit
// 1), never InvalidArgument (its usage error, exit 2); the quota is unchanged.
TEST(OperatorTest, AQuotaFileThatCannotBeWrittenIsNotABadRequest) {
  ScratchDir dir("quota-dir");
  const std::string file = dir.path() + "/quotas.json";
  Result<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(SmallEngine(), WithQuotaFile(file));
  ASSERT_TRUE(d.ok()) << d.status();
  std::filesystem::create_directory(file);
  Result<std::unique_ptr<DaemonControl>> c = DaemonControl::Connect((*d)->socket());
  ASSERT_TRUE(c.ok()) << c.status();
  Result<engine::QuotaInfo> q =
      (*c)->SetQuota({.uid = 7, .set = engine::kQuotaMaxJobs, .quota = {.max_jobs = 2}});
  ASSERT_FALSE(q.ok());
  EXPECT_EQ(q.status().code(), StatusCode::kFailedPrecondition) << q.status();
  EXPECT_NE(q.status().message().find("the quota is unchanged"), std::string::npos) << q.status();
  q = (*c)->GetQuota(7);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_FALSE(q->custom);
}

TEST(OperatorTest, DrainRefusesNewJobsAndEvictFreesAJobAndTellsItsClient) {
  Result<OperatedDaemon> node = StartOperatedDaemon();
  ASSERT_TRUE(node.ok()) << node.status();
  std::unique_ptr<DaemonControl>* c = &node->control;
  std::unique_ptr<Session>* s = &node->session;
  Result<std::unique_ptr<Model>> running = (*s)->RegisterModel(TwoUnits("running"));
  ASSERT_TRUE(running.ok()) << running.status();

  ASSERT_TRUE((*c)->Drain(true).ok());
  EXPECT_TRUE((*c)->GetStatus()->draining);
  Result<std::unique_ptr<Model>> refused = (*s)->RegisterModel(TwoUnits("new"));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable) << refused.status();
  EXPECT_NE(refused.status().message().find("draining"), std::string::npos) << refused.status();
  // The running job goes on.
  ASSERT_TRUE(Train(**running, 2).ok());
  ASSERT_TRUE((*c)->Drain(false).ok());
  Result<std::unique_ptr<Model>> victim = (*s)->RegisterModel(TwoUnits("victim"));
  ASSERT_TRUE(victim.ok()) << victim.status();

  Result<std::vector<JobInfo>> jobs = (*c)->Jobs();
  ASSERT_TRUE(jobs.ok());
  ASSERT_EQ(jobs->size(), 2u);
  int victim_id = -1;
  for (const JobInfo& j : *jobs) {
    if (j.name == "victim") victim_id = j.id;
  }
  ASSERT_GE(victim_id, 0);
  const uint64_t held = (*c)->GetQuota(::geteuid())->dram_bytes;
  // A wait in progress is told why too (it heard the engine's "job N was
  // unregistered").
  Status waited;
  std::thread waiter([&] { waited = (*victim)->WaitPublished(1, 30s); });
  std::this_thread::sleep_for(300ms);
  // A reason with a control character (a forged log line, a terminal's
  // escape sequence on the user's screen) is refused, the job untouched.
  Status forged = (*c)->Evict(victim_id, "x\nztier warn ztierd: forged\x1b[31m");
  EXPECT_EQ(forged.code(), StatusCode::kInvalidArgument) << forged;
  EXPECT_NE(forged.message().find("control character"), std::string::npos) << forged;
  ASSERT_TRUE((*c)->Evict(victim_id, "the node goes down for maintenance").ok());
  waiter.join();
  EXPECT_EQ(waited.code(), StatusCode::kAborted) << waited;
  EXPECT_NE(waited.message().find("maintenance"), std::string::npos) << waited;
  // Its client is told why, on its next call.
  std::vector<float> w(4096, 0.0f);
  Status after = (*victim)->SetWeights(0, w.data(), w.size());
  EXPECT_EQ(after.code(), StatusCode::kAborted) << after;
  EXPECT_NE(after.message().find("maintenance"), std::string::npos) << after;
  // It is gone and its uid no longer pays for it; the other job is whole.
  jobs = (*c)->Jobs();
  ASSERT_TRUE(jobs.ok());
  ASSERT_EQ(jobs->size(), 1u);
  EXPECT_EQ((*jobs)[0].name, "running");
  EXPECT_EQ((*jobs)[0].step, 2);
  EXPECT_LT((*c)->GetQuota(::geteuid())->dram_bytes, held);
  // Its client lives and maps its regions: the freed job counts as the job
  // quota counts it until the client lets go (where ztierd can tell the
  // client's process lives on: SO_PEERPIDFD, Linux 6.5).
  EXPECT_EQ((*c)->GetQuota(::geteuid())->jobs, testing::HavePeerPidfd() ? 2 : 1);
  EXPECT_EQ((*c)->Evict(victim_id, "").code(), StatusCode::kNotFound);
  victim->reset();
  int jobs_now = -1;
  for (int k = 0; k < 500 && jobs_now != 1; ++k) {
    jobs_now = (*c)->GetQuota(::geteuid())->jobs;
    if (jobs_now != 1) std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(jobs_now, 1);
}

// A release is sent without waiting for its answer, and its error went to
// the next call on the connection whatever its job: an evicted job's failed
// release failed another job's next call, or its unregister, which then
// was never sent (the daemon kept that job, its memory and its name).
TEST(OperatorTest, AnEvictedJobsFailedReleaseIsNoOtherJobsError) {
  Result<OperatedDaemon> node = StartOperatedDaemon();
  ASSERT_TRUE(node.ok()) << node.status();
  std::unique_ptr<DaemonControl>* c = &node->control;
  std::unique_ptr<Session>* s = &node->session;
  Result<std::unique_ptr<Model>> a = (*s)->RegisterModel(TwoUnits("evicted"));
  Result<std::unique_ptr<Model>> b = (*s)->RegisterModel(TwoUnits("bystander"));
  ASSERT_TRUE(a.ok() && b.ok());
  for (int u = 0; u < (*a)->units(); ++u) {  // no runner: its acquire goes to the daemon
    std::vector<float> w((*a)->layout(u).numel, 0.5f);
    ASSERT_TRUE((*a)->SetWeights(u, w.data(), w.size()).ok());
  }
  client::Transport& t = (*a)->transport();
  ASSERT_TRUE(t.AcquireParams((*a)->job(), 0, 0, 10s).ok());
  Result<std::vector<JobInfo>> jobs = (*c)->Jobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  for (const JobInfo& j : *jobs) {
    if (j.name == "evicted") {
      ASSERT_TRUE((*c)->Evict(j.id, "a test").ok());
    }
  }
  ASSERT_TRUE(t.ReleaseParams((*a)->job(), 0).ok());  // its refusal comes later
  std::this_thread::sleep_for(300ms);
  Status other = (*b)->transport().SetLearningRates((*b)->job(), {1e-3f});
  EXPECT_TRUE(other.ok()) << other;
  b->reset();  // its unregister goes
  Result<std::unique_ptr<Model>> again = (*s)->RegisterModel(TwoUnits("bystander"));
  EXPECT_TRUE(again.ok()) << again.status();
  // The evicted job's own next call says why.
  EXPECT_EQ((*a)->transport().SetLearningRates((*a)->job(), {1e-3f}).code(), StatusCode::kAborted);
}

// A job of one unit with its weights set, through `t` (the lease tests).
Result<int> OneUnitWithWeights(client::Transport& t, const std::string& name) {
  engine::JobSpec spec;
  spec.name = name;
  spec.units.push_back({.name = "u0", .tensors = {{.name = "u0.w", .shape = {4096}}}});
  ZT_ASSIGN_OR_RETURN(int job, t.RegisterJob(spec));
  std::vector<float> w(4096, 0.5f);
  ZT_RETURN_IF_ERROR(t.WriteWeights(job, 0, w.data(), w.size()));
  return job;
}

// The first error of `job`'s calls over two seconds (ztierd answers a
// posted release later: its refusal comes with a later call), or Ok.
Status NextRefusal(client::Transport& t, int job) {
  Status next = Status::Ok();
  for (int i = 0; i < 100 && next.ok(); ++i) {
    std::this_thread::sleep_for(20ms);
    next = t.SetLearningRates(job, {1e-3f});
  }
  return next;
}

// Calls until ztierd answers again (within two seconds).
Status AnsweredAgain(client::Transport& t, int job) {
  Status answered = Status::Unavailable("not yet");
  for (int i = 0; i < 100 && !answered.ok(); ++i) {
    std::this_thread::sleep_for(20ms);
    answered = t.SetLearningRates(job, {1e-3f});
  }
  return answered;
}

// An acquire whose caller gave up (ztierd did not answer in time) left the
// lease its late answer brought held in ztierd for the connection's life
// (with params on NVMe, a cache slot). The late lease is given back: a
// release of the caller's own then finds none to release.
TEST(OperatorTest, ALeaseALateAcquireBringsIsGivenBack) {
  ZtierdProcess d(ZTIERD_BINARY, {});
  Result<std::shared_ptr<client::Transport>> t = client::MakeDaemonTransport(d.socket(), 300ms);
  ASSERT_TRUE(t.ok()) << t.status() << d.log();
  Result<int> job = OneUnitWithWeights(**t, "late");
  ASSERT_TRUE(job.ok()) << job.status();
  d.Pause();
  Result<const bf16*> p = (*t)->AcquireParams(*job, 0, 0, 0ms);
  EXPECT_EQ(p.status().code(), StatusCode::kUnavailable) << p.status();
  ASSERT_EQ(::kill(d.pid(), SIGCONT), 0);
  const Status answered = AnsweredAgain(**t, *job);  // its late answer clears the refusal
  ASSERT_TRUE(answered.ok()) << answered;
  ASSERT_TRUE((*t)->ReleaseParams(*job, 0).ok());  // posted; ztierd's answer comes later
  const Status next = NextRefusal(**t, *job);
  EXPECT_NE(next.message().find("released without an acquire"), std::string::npos) << next;
  EXPECT_TRUE((*t)->UnregisterJob(*job).ok());
}

// A release made while ztierd had left a call unanswered was refused with
// the calls, and the runner went on: the lease stayed held in ztierd for the
// connection's life (with params on NVMe, a cache slot). It is sent.
TEST(OperatorTest, AReleaseWhileZtierdIsSilentIsSentAnyway) {
  ZtierdProcess d(ZTIERD_BINARY, {});
  Result<std::shared_ptr<client::Transport>> t = client::MakeDaemonTransport(d.socket(), 300ms);
  ASSERT_TRUE(t.ok()) << t.status() << d.log();
  Result<int> job = OneUnitWithWeights(**t, "silent");
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE((*t)->AcquireParams(*job, 0, 0, 10s).ok());
  d.Pause();
  EXPECT_EQ((*t)->SetLearningRates(*job, {1e-3f}).code(), StatusCode::kUnavailable);
  EXPECT_TRUE((*t)->ReleaseParams(*job, 0).ok()) << "refused while ztierd was silent";
  ASSERT_EQ(::kill(d.pid(), SIGCONT), 0);
  const Status answered = AnsweredAgain(**t, *job);
  ASSERT_TRUE(answered.ok()) << answered;
  // The lease went: a second release is one without an acquire.
  ASSERT_TRUE((*t)->ReleaseParams(*job, 0).ok());
  const Status next = NextRefusal(**t, *job);
  EXPECT_NE(next.message().find("released without an acquire"), std::string::npos) << next;
  EXPECT_TRUE((*t)->UnregisterJob(*job).ok());
}

// A call that moves a unit's state (a save's read, a load's write) had a
// fixed two minutes, whatever the transport's call timeout or the unit's
// size: a unit of gigabytes on a busy or slow drive failed a save as if
// ztierd were stuck. It gets the call timeout and time for its bytes at a
// slow drive's rate: a silent ztierd is said after about the call timeout
// (it took two minutes), and a slow drive's read of 12 MB succeeds past it.
TEST(OperatorTest, AStateCallGetsTheCallTimeoutAndTimeForItsBytes) {
  {
    ZtierdProcess d(ZTIERD_BINARY, {});
    Result<std::shared_ptr<client::Transport>> t = client::MakeDaemonTransport(d.socket(), 300ms);
    ASSERT_TRUE(t.ok()) << t.status() << d.log();
    Result<int> job = OneUnitWithWeights(**t, "silent");
    ASSERT_TRUE(job.ok()) << job.status();
    const UnitLayout l = *(*t)->Layout(*job, 0);
    std::vector<float> p(l.padded), m(l.padded), v(l.padded);
    d.Pause();
    const auto start = std::chrono::steady_clock::now();
    const Status read = (*t)->ReadState(*job, 0, p.data(), m.data(), v.data());
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ASSERT_EQ(::kill(d.pid(), SIGCONT), 0);
    EXPECT_EQ(read.code(), StatusCode::kUnavailable) << read;
    EXPECT_LT(seconds, 10.0) << read;
  }
  ScratchDir swap("operator-slow-swap");
  engine::Settings settings = SmallEngine();
  settings.dram_budget_bytes = uint64_t{256} << 20;
  settings.nvme_paths = {swap.path()};
  settings.stripe_bytes = uint64_t{16} << 20;  // the unit's state in one read
  settings.queue_depth = 2;
  auto fault = std::make_shared<nvme::FaultBackend>(nvme::MakeUringBackend());
  Result<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(settings, {}, fault);
  ASSERT_TRUE(d.ok()) << d.status();
  Result<std::shared_ptr<client::Transport>> t = client::MakeDaemonTransport((*d)->socket(), 300ms);
  ASSERT_TRUE(t.ok()) << t.status();
  engine::JobSpec spec;
  spec.name = "slow";
  spec.optimizer_tier = engine::Tier::kNvme;
  spec.units.push_back({.name = "u0", .tensors = {{.name = "u0.w", .shape = {1 << 20}}}});
  Result<int> job = (*t)->RegisterJob(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  std::vector<float> w(1 << 20, 0.5f);
  ASSERT_TRUE((*t)->WriteWeights(*job, 0, w.data(), w.size()).ok());
  const UnitLayout l = *(*t)->Layout(*job, 0);
  std::vector<float> p(l.padded), m(l.padded), v(l.padded);
  fault->SlowDown(nvme::IoKind::kRead, 800ms);
  const Status read = (*t)->ReadState(*job, 0, p.data(), m.data(), v.data());
  fault->SlowDown(nvme::IoKind::kRead, 0ms);
  EXPECT_TRUE(read.ok()) << read;
  EXPECT_EQ(p[12345], 0.5f);
  EXPECT_TRUE((*t)->UnregisterJob(*job).ok());
}

// The step queries said -1 for any error, so a runner made while ztierd
// was silent said the job "has no weights yet; set them".
TEST(OperatorTest, AStepQueryZtierdLeavesUnansweredSaysSo) {
  ZtierdProcess d(ZTIERD_BINARY, {});
  Result<std::shared_ptr<client::Transport>> t = client::MakeDaemonTransport(d.socket(), 300ms);
  ASSERT_TRUE(t.ok()) << t.status() << d.log();
  engine::JobSpec spec;
  spec.name = "asked";
  spec.units.push_back({.name = "u0", .tensors = {{.name = "u0.w", .shape = {4096}}}});
  Result<int> job = (*t)->RegisterJob(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  Result<int64_t> none = (*t)->TargetStep(*job);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(*none, -1);  // no weights yet: a value, not an error
  std::vector<float> w(4096, 0.5f);
  ASSERT_TRUE((*t)->WriteWeights(*job, 0, w.data(), w.size()).ok());
  d.Pause();
  Result<int64_t> target = (*t)->TargetStep(*job);
  EXPECT_EQ(target.status().code(), StatusCode::kUnavailable) << target.status();
  EXPECT_NE(target.status().message().find("did not answer"), std::string::npos) << target.status();
  ASSERT_EQ(::kill(d.pid(), SIGCONT), 0);
  Result<int64_t> again = Status::Unavailable("not yet");
  for (int i = 0; i < 100 && !again.ok(); ++i) {
    std::this_thread::sleep_for(20ms);
    again = (*t)->TargetStep(*job);
  }
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, 0);
  EXPECT_TRUE((*t)->UnregisterJob(*job).ok());
}

// A wait "for ever" (milliseconds::max(): the C ABI's INT64_MAX) worked
// embedded and failed through ztierd: the daemon refuses waits over a week
// (Corruption), and timeout + the call's margin overflowed.
TEST(OperatorTest, AWaitForEverThroughTheDaemonIsAWait) {
  Result<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(SmallEngine());
  ASSERT_TRUE(d.ok()) << d.status();
  Result<std::unique_ptr<Session>> s = OpenSession((*d)->socket());
  ASSERT_TRUE(s.ok());
  Result<std::unique_ptr<Model>> m = (*s)->RegisterModel(TwoUnits("patient"));
  ASSERT_TRUE(m.ok());
  for (int u = 0; u < (*m)->units(); ++u) {
    std::vector<float> w((*m)->layout(u).numel, 0.5f);
    ASSERT_TRUE((*m)->SetWeights(u, w.data(), w.size()).ok());
  }
  client::Transport& t = (*m)->transport();
  const auto forever = std::chrono::milliseconds::max();
  Result<const bf16*> p = t.AcquireParams((*m)->job(), 1, 0, forever);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(t.ReleaseParams((*m)->job(), 1).ok());
  EXPECT_TRUE(t.WaitPublished((*m)->job(), 1, 0, forever).ok());
}

// ------------------------------------------------------ ztierctl

struct CtlRun {
  int code = -1;
  std::string out;  // stdout then stderr
};

// The words of the first line of `text` that has `word` as a word, from
// that word on (empty when none has).
std::vector<std::string> Words(const std::string& text, const std::string& word) {
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream in(line);
    std::vector<std::string> words;
    for (std::string w; in >> w;) {
      if (!words.empty() || w == word) words.push_back(w);
    }
    if (!words.empty()) return words;
  }
  return {};
}

// Runs ztierctl with `args` (at most 30 s).
CtlRun Ztierctl(const std::string& args, const std::string& dir) {
  const std::string out = dir + "/ztierctl.out";
  const int st = std::system(
      StrCat("timeout -s KILL 30 ", ZTIERCTL_BINARY, " ", args, " >", out, " 2>&1").c_str());
  CtlRun r;
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  std::ifstream in(out);
  std::stringstream ss;
  ss << in.rdbuf();
  r.out = ss.str();
  return r;
}

TEST(ZtierctlProgramTest, TablesJsonAndExitCodes) {
  ScratchDir dir("ztierctl");
  ZtierdProcess d(ZTIERD_BINARY, {});
  Result<std::unique_ptr<Session>> s = OpenSession(d.socket());
  ASSERT_TRUE(s.ok()) << s.status() << d.log();
  Result<std::unique_ptr<Model>> m = (*s)->RegisterModel(TwoUnits("table-job"));
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_TRUE(Train(**m, 2).ok());
  const std::string sock = "--socket " + d.socket();

  CtlRun r = Ztierctl(sock + " status", dir.path());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("pinned DRAM"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("host->device"), std::string::npos) << r.out;
  r = Ztierctl(sock + " jobs", dir.path());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(Words(r.out, "ID"),
            (std::vector<std::string>{"ID", "UID", "NAME", "STATE", "RANKS", "STEP", "DRAM", "NVME",
                                      "LAST", "STEP", "STALLS", "GRAD", "NORM"}))
      << r.out;
  const std::vector<std::string> row = Words(r.out, "table-job");
  ASSERT_GE(row.size(), 4u) << r.out;
  EXPECT_EQ(row[1], "training");
  EXPECT_EQ(row[2], "1/1");
  EXPECT_EQ(row[3], "2");
  // --json is one JSON object with the documented fields.
  r = Ztierctl(sock + " --json jobs", dir.path());
  ASSERT_EQ(r.code, 0) << r.out;
  nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  ASSERT_EQ(j["jobs"].size(), 1u);
  EXPECT_EQ(j["jobs"][0]["name"], "table-job");
  EXPECT_EQ(j["jobs"][0]["state"], "training");
  EXPECT_EQ(j["jobs"][0]["step"], 2);
  EXPECT_GT(j["jobs"][0]["host_to_device_bytes"].get<uint64_t>(), 0u);
  r = Ztierctl(sock + " --json status", dir.path());
  ASSERT_EQ(r.code, 0) << r.out;
  j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_EQ(j["protocol"], engine::protocol::kVersion);
  EXPECT_EQ(j["since_start"]["steps"], 2);
  EXPECT_TRUE(j["dram"].contains("budget_bytes"));
  r = Ztierctl(sock + " quota set 4242 --jobs 2 --dram 1G", dir.path());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("1.0 GiB"), std::string::npos) << r.out;
  r = Ztierctl(sock + " --json quota get 4242", dir.path());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("\"max_jobs\": 2"), std::string::npos) << r.out;

  // A user's name stands for its uid ('alice' was "not a uid").
  if (const struct passwd* nobody = ::getpwnam("nobody"); nobody != nullptr) {
    r = Ztierctl(sock + " --json quota get nobody", dir.path());
    EXPECT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find(StrCat("\"uid\": ", nobody->pw_uid)), std::string::npos) << r.out;
  }
  r = Ztierctl(sock + " quota get no-such-user-here", dir.path());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("is not a uid, nor a user's name here"), std::string::npos) << r.out;

  // Bad arguments: 2, before any connection.
  for (const char* bad :
       {"frobnicate", "quota set 4242", "quota set x --jobs 1", "quota set 1 --jobs 0",
        "quota set 1 --dram lots", "evict", "jobs extra", "--bogus status", ""}) {
    r = Ztierctl(StrCat(sock, " ", bad), dir.path());
    EXPECT_EQ(r.code, 2) << bad << ": " << r.out;
  }
  // --json with bytes that are not UTF-8 in what it prints: an error object
  // (nlohmann's dump threw on them and ztierctl aborted, exit 134).
  r = Ztierctl(StrCat(sock, " --json quota set 5 --dram \"$(printf '\\377')\""), dir.path());
  EXPECT_EQ(r.code, 2) << r.out;
  {  // stdout's object, among the usage lines on stderr
    const size_t at = r.out.find("{\n  \"error\"");
    ASSERT_NE(at, std::string::npos) << r.out;
    j = nlohmann::json::parse(r.out.substr(at, r.out.find("\n}\n", at) + 3 - at), nullptr, false);
  }
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_TRUE(j.contains("error")) << r.out;
  // Arguments the daemon would refuse are said here, as usage errors (they
  // went to ztierd, and came back as a corrupt request or an error, 1).
  r = Ztierctl(StrCat(sock, " evict 1 --reason ", std::string(1025, 'x')), dir.path());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("1025 bytes, more than 1024"), std::string::npos) << r.out;
  r = Ztierctl(StrCat(sock, " evict 1 --reason \"$(printf 'a\\033[31mb')\""), dir.path());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("control character"), std::string::npos) << r.out;
  r = Ztierctl(StrCat("--socket ", dir.path(), "/", std::string(200, 'a'), " status"), dir.path());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("a file name longer than"), std::string::npos) << r.out;
  // A --socket that names a file or a directory says so (it said that no
  // ztierd listens there, "is ztierd running?").
  std::ofstream(dir.path() + "/plain") << "x";
  for (const std::string& what : {std::string("/plain"), std::string("")}) {
    r = Ztierctl(StrCat("--socket ", dir.path(), what, " status"), dir.path());
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.out.find(what.empty() ? "is a directory" : "is not a socket"), std::string::npos)
        << r.out;
  }
  // A ztierd that takes connections but does not answer (stopped) is said
  // after --timeout, not after two minutes.
  d.Pause();
  const auto t0 = std::chrono::steady_clock::now();
  r = Ztierctl(sock + " --timeout 1 status", dir.path());
  const auto waited = std::chrono::steady_clock::now() - t0;
  ASSERT_EQ(::kill(d.pid(), SIGCONT), 0);
  EXPECT_EQ(r.code, 3) << r.out;
  // (Not "ztierctl status tells": that is what just failed.)
  EXPECT_NE(r.out.find("did not answer a request (hello) within 1 s (stopped or stuck? systemctl "
                       "status ztierd, or ps -o stat= -p its pid, tells) (or what listens there "
                       "is no ztierd)"),
            std::string::npos)
      << r.out;
  EXPECT_LT(waited, 10s);
  r = Ztierctl(sock + " --timeout 0 status", dir.path());
  EXPECT_EQ(r.code, 2) << r.out;
  // An unknown job: ztierd answers with an error, 1.
  r = Ztierctl(sock + " evict 999", dir.path());
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("no job 999"), std::string::npos) << r.out;
  // After "--" an option's word is the command's: a reason "--json" (it
  // was taken as the option wherever it stood, and the reason was "--").
  r = Ztierctl(sock + " evict 999 --reason -- --json", dir.path());
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("no job 999"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find('{'), std::string::npos) << "printed as JSON: " << r.out;
  // An id out of range says what an id is, as any other bad one does.
  for (const char* bad : {"-1", "2147483648"}) {
    r = Ztierctl(sock + " evict " + bad, dir.path());
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.out.find("the id column of `ztierctl jobs`"), std::string::npos) << bad << r.out;
  }
  // Not running: 3, with a hint.
  r = Ztierctl("--socket " + dir.path() + "/none.sock status", dir.path());
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_NE(r.out.find("is ztierd running"), std::string::npos) << r.out;
  // With --json a failure is a JSON object on stdout too (it printed
  // nothing there: a script reading stdout learned nothing).
  const std::string json_out = dir.path() + "/json.out";
  for (const auto& [args, code, kind] :
       {std::tuple<std::string, int, std::string>{
            "--socket " + dir.path() + "/none.sock --json status", 3, "unavailable"},
        {sock + " --json evict 999", 1, "not_found"},
        {sock + " --json frobnicate", 2, "usage"}}) {
    const int st = std::system(
        StrCat("timeout -s KILL 30 ", ZTIERCTL_BINARY, " ", args, " >", json_out, " 2>/dev/null")
            .c_str());
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == code) << args;
    std::ifstream in(json_out);
    const auto e = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    ASSERT_TRUE(e.is_object() && e.contains("error")) << args;
    EXPECT_EQ(e["error"]["code"], kind) << args;
    EXPECT_EQ(e["error"]["exit"], code) << args;
    EXPECT_FALSE(e["error"]["message"].get<std::string>().empty()) << args;
  }
  // --help and --version need no daemon.
  EXPECT_EQ(Ztierctl("--help", dir.path()).code, 0);
  EXPECT_NE(Ztierctl("--version", dir.path()).out.find("ztierctl"), std::string::npos);
}

// A stopped ztierd cost every call its whole timeout (two minutes each: a
// model's close, the session's). After one call goes unanswered the next
// are refused at once, until ztierd says anything again.
// Out of fds (a flood of connections from one uid; any uid's, since even
// refused ones took a socket each), accept failed with EMFILE and ztierd
// exited: every user's jobs went with it.
TEST(OperatorTest, ZtierdOutOfFdsWaitsForThemAndServesOn) {
  ZtierdProcess d(ZTIERD_BINARY, {});
  const rlimit few{.rlim_cur = 40, .rlim_max = 40};
  ASSERT_EQ(::prlimit(d.pid(), RLIMIT_NOFILE, &few, nullptr), 0) << std::strerror(errno);
  std::vector<std::unique_ptr<DaemonControl>> flood;
  for (int k = 0; k < 40; ++k) {
    Result<std::unique_ptr<DaemonControl>> c = DaemonControl::Connect(d.socket(), 1s);
    if (!c.ok()) break;  // ztierd has no fd left for it: it waits in the backlog
    flood.push_back(*std::move(c));
  }
  EXPECT_LT(flood.size(), 40u) << "the fd limit was never reached";
  EXPECT_EQ(::kill(d.pid(), 0), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(d.pid(), &status, WNOHANG), 0) << "ztierd exited: " << d.log();
  flood.clear();  // their fds come back
  Result<std::unique_ptr<DaemonControl>> again = Status::Unavailable("not yet");
  for (int k = 0; k < 50 && !again.ok(); ++k) {
    again = DaemonControl::Connect(d.socket(), 1s);
    if (!again.ok()) std::this_thread::sleep_for(100ms);
  }
  ASSERT_TRUE(again.ok()) << again.status() << d.log();
  EXPECT_TRUE((*again)->GetStatus().ok());
  EXPECT_NE(d.log().find("new connections wait until fds are free"), std::string::npos) << d.log();
}

// A refused connection is kept for up to 2 s to tell its client why, with a
// thread of its own: a flood of them (a uid past its connection quota)
// took a thread and fds each, unbounded.
TEST(OperatorTest, AFloodOfRefusedConnectionsCostsZtierdABoundedNumberOfThreads) {
  ZtierdProcess d(ZTIERD_BINARY, {"--max-connections-per-uid", "1"});
  Result<std::unique_ptr<DaemonControl>> held = DaemonControl::Connect(d.socket(), 5s);
  ASSERT_TRUE(held.ok()) << held.status() << d.log();
  const auto threads = [&] {
    std::ifstream in(StrCat("/proc/", d.pid(), "/status"));
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind("Threads:", 0) == 0) return std::atoi(line.c_str() + 8);
    }
    return -1;
  };
  const int before = threads();
  std::vector<engine::SeqPacketSocket> flood;
  for (int k = 0; k < 150; ++k) {
    Result<engine::SeqPacketSocket> s = engine::SeqPacketSocket::Connect(d.socket());
    if (s.ok()) flood.push_back(*std::move(s));
  }
  int most = 0;
  for (int k = 0; k < 10; ++k) {
    std::this_thread::sleep_for(50ms);
    most = std::max(most, threads());
  }
  EXPECT_LE(most - before, 40) << "threads " << before << " -> " << most;
  // The quota's holder is served throughout.
  EXPECT_TRUE((*held)->GetStatus().ok());
}

TEST(OperatorTest, AfterACallGoesUnansweredTheNextAreRefusedAtOnceUntilItAnswers) {
  ZtierdProcess d(ZTIERD_BINARY, {});
  Result<std::unique_ptr<DaemonControl>> c = DaemonControl::Connect(d.socket(), 500ms);
  ASSERT_TRUE(c.ok()) << c.status() << d.log();
  ASSERT_TRUE((*c)->GetStatus().ok());
  d.Pause();
  Result<engine::DaemonStatus> first = (*c)->GetStatus();
  EXPECT_EQ(first.status().code(), StatusCode::kUnavailable) << first.status();
  EXPECT_NE(first.status().message().find("did not answer"), std::string::npos) << first.status();
  const auto t0 = std::chrono::steady_clock::now();
  Result<std::vector<engine::JobInfo>> next = (*c)->Jobs();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 250ms);
  EXPECT_EQ(next.status().code(), StatusCode::kUnavailable) << next.status();
  EXPECT_NE(next.status().message().find("has said nothing since"), std::string::npos)
      << next.status();
  ASSERT_EQ(::kill(d.pid(), SIGCONT), 0);
  // Its late answer to the first call clears the refusal.
  Result<engine::DaemonStatus> again = Status::Unavailable("not yet");
  for (int i = 0; i < 100 && !again.ok(); ++i) {
    std::this_thread::sleep_for(20ms);
    again = (*c)->GetStatus();
  }
  EXPECT_TRUE(again.ok()) << again.status();
  // Gone: the operator's tool is not told of jobs' DRAM state it had none of.
  EXPECT_EQ(d.SignalAndWait(SIGKILL), 128 + SIGKILL);
  Result<engine::DaemonStatus> gone = (*c)->GetStatus();
  EXPECT_EQ(gone.status().code(), StatusCode::kUnavailable) << gone.status();
  EXPECT_EQ(gone.status().message().find("DRAM state"), std::string::npos) << gone.status();
}

TEST(ZtierctlProgramTest, ANonOperatorIsRefusedWithExitCode4) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run ztierctl as another uid";
  ScratchDir dir("ztierctl-nobody");
  ::chmod(dir.path().c_str(), 0777);
  ZtierdProcess d(ZTIERD_BINARY, {});
  Result<std::unique_ptr<Session>> s = OpenSession(d.socket());
  ASSERT_TRUE(s.ok()) << s.status() << d.log();
  Result<std::unique_ptr<Model>> m = (*s)->RegisterModel(TwoUnits("roots-job"));
  ASSERT_TRUE(m.ok()) << m.status();
  const std::string sock = "--socket " + d.socket();
  const int rc = AsNobody([&] {
    // What anyone may do: the status, their own (no) jobs, their own quota.
    CtlRun r = Ztierctl(sock + " status", dir.path());
    if (r.code != 0) return 10;
    r = Ztierctl(sock + " jobs", dir.path());
    if (r.code != 0 || r.out.find("roots-job") != std::string::npos) return 11;
    r = Ztierctl(sock + " quota get", dir.path());
    if (r.code != 0 || r.out.find("65534") == std::string::npos) return 12;
    // What operators may do: refused, 4, saying who may.
    for (const char* op : {"drain", "drain --off", "quota set 65534 --jobs 100",
                           "quota reset 65534", "quota get 0", "quota get all", "evict 1"}) {
      r = Ztierctl(StrCat(sock, " ", op), dir.path());
      if (r.code != 4 || r.out.find("not an operator") == std::string::npos) return 20;
    }
    return 0;
  });
  EXPECT_EQ(rc, 0) << d.log() << Ztierctl(sock + " status", dir.path()).out;
  // Nothing changed, and root may.
  EXPECT_FALSE(DaemonControl::Connect(d.socket()).value()->GetStatus()->draining);
  EXPECT_EQ(Ztierctl(sock + " drain", dir.path()).code, 0);
  EXPECT_EQ(Ztierctl(sock + " jobs", dir.path()).out.find("roots-job") != std::string::npos, true);
}

// ------------------------------------------------------ metrics

// An HTTP request's whole answer (the server closes the connection).
// A connection to a metrics address ("unix:PATH" or "HOST:PORT").
Result<UniqueFd> ConnectTo(const std::string& address) {
  UniqueFd fd;
  if (address.starts_with("unix:")) {
    fd = UniqueFd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    const std::string path = address.substr(5);
    std::memcpy(sa.sun_path, path.data(), path.size());
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
      return PosixError("connect " + address, errno);
    }
  } else {
    const size_t colon = address.rfind(':');
    fd = UniqueFd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
    ::inet_pton(AF_INET, address.substr(0, colon).c_str(), &sa.sin_addr);
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
      return PosixError("connect " + address, errno);
    }
  }
  return fd;
}

Result<std::string> Http(const std::string& address, const std::string& request) {
  ZT_ASSIGN_OR_RETURN(UniqueFd fd, ConnectTo(address));
  if (::send(fd.get(), request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    return PosixError("send", errno);
  }
  std::string out;
  char buf[8192];
  for (ssize_t n; (n = ::recv(fd.get(), buf, sizeof(buf), 0)) > 0;) out.append(buf, n);
  return out;
}

// The exposition's own rules; empty when it keeps them, else the first
// broken one.
std::string CheckExposition(const std::string& text) {
  std::map<std::string, std::string> type;  // family -> type
  std::set<std::string> seen;               // name{labels}
  // Histogram series: labels without le -> (cumulative so far, +Inf, count).
  std::map<std::string, std::vector<double>> buckets;
  std::map<std::string, double> counts;
  std::istringstream in(text);
  const auto name_char = [](char c, bool first) {
    return std::isalpha(static_cast<unsigned char>(c)) || c == '_' || c == ':' ||
           (!first && std::isdigit(static_cast<unsigned char>(c)));
  };
  for (std::string line; std::getline(in, line);) {
    if (line.starts_with("# TYPE ")) {
      std::istringstream t(line.substr(7));
      std::string name, kind;
      t >> name >> kind;
      if (type.count(name)) return "family declared twice: " + name;
      if (kind == "counter" && !name.ends_with("_total")) return "counter without _total: " + name;
      type[name] = kind;
      continue;
    }
    if (line.starts_with("#")) continue;
    // name{labels} value, or name value
    size_t n = 0;
    while (n < line.size() && name_char(line[n], n == 0)) ++n;
    if (n == 0) return "not a sample line: " + line;
    const std::string name = line.substr(0, n);
    std::string labels;
    size_t rest = n;
    if (rest < line.size() && line[rest] == '{') {
      const size_t close = line.rfind('}');
      if (close == std::string::npos || close < rest) return "unclosed labels: " + line;
      labels = line.substr(rest + 1, close - rest - 1);
      rest = close + 1;
    }
    if (rest >= line.size() || line[rest] != ' ' || line.find(' ', rest + 1) != std::string::npos) {
      return "not a sample line: " + line;
    }
    const std::string value = line.substr(rest + 1);
    if (!seen.insert(name + "{" + labels + "}").second) return "duplicate series: " + line;
    std::string family = name;
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      const std::string base = name.substr(0, name.size() - std::strlen(suffix));
      if (name.ends_with(suffix) && type.count(base) && type[base] == "histogram") family = base;
    }
    if (!type.count(family)) return "sample of an undeclared family: " + line;
    const double v = value == "+Inf" ? INFINITY : std::stod(value);
    if (type[family] == "counter" && v < 0) return "negative counter: " + line;
    if (type[family] == "histogram") {
      std::string key = labels;
      const size_t le = key.find("le=\"");
      if (le != std::string::npos) {
        const size_t end = key.find('"', le + 4) + 1;
        const size_t begin = le > 0 && key[le - 1] == ',' ? le - 1 : le;
        key.erase(begin, end - begin);
      }
      if (name.ends_with("_bucket")) {
        auto& b = buckets[family + "{" + key + "}"];
        if (!b.empty() && v < b.back()) return "buckets not cumulative: " + line;
        b.push_back(v);
      } else if (name.ends_with("_count")) {
        counts[family + "{" + key + "}"] = v;
      }
    }
  }
  for (const auto& [series, b] : buckets) {
    if (!counts.count(series) || counts[series] != b.back()) {
      return "the +Inf bucket of " + series + " is not its count";
    }
  }
  return "";
}

// Where ztierd says it serves its metrics (its log line), within 5 s.
std::string MetricsAddress(const ZtierdProcess& d) {
  const std::string at = "metrics at http://";
  for (int k = 0; k < 500; ++k) {
    const std::string log = d.log();
    const size_t p = log.find(at);
    const size_t end = p == std::string::npos ? p : log.find("/metrics", p + at.size());
    if (end != std::string::npos) return log.substr(p + at.size(), end - p - at.size());
    std::this_thread::sleep_for(10ms);
  }
  return "";
}

TEST(MetricsTest, AScrapeOfARunningDaemonIsValidExposition) {
  ScratchDir dir("metrics");
  // A Unix socket's path is short (108 bytes): in a directory of /tmp.
  std::string sock_dir = "/tmp/ztier-metrics-XXXXXX";
  ASSERT_NE(::mkdtemp(sock_dir.data()), nullptr);
  // Jobs by name where asked for (the name here needs escaping), else by id.
  for (const auto& [where, names] : {std::pair<std::string, bool>{"127.0.0.1:0", true},
                                     {"unix:" + sock_dir + "/m.sock", false}}) {
    SCOPED_TRACE(where);
    ZtierdProcess d(ZTIERD_BINARY,
                    {"--metrics", where, "--metrics-job-names", names ? "yes" : "no"});
    const std::string address = MetricsAddress(d);
    ASSERT_FALSE(address.empty()) << d.log();
    // An oversized request gets its 431 (it got a reset: closed unread).
    Result<std::string> big =
        Http(address, "GET /" + std::string(20000, 'a') + " HTTP/1.1\r\n\r\n");
    ASSERT_TRUE(big.ok()) << big.status();
    EXPECT_TRUE(big->starts_with("HTTP/1.1 431")) << *big;
    Result<std::unique_ptr<Session>> s = OpenSession(d.socket());
    ASSERT_TRUE(s.ok()) << s.status() << d.log();
    Result<std::unique_ptr<Model>> m = (*s)->RegisterModel(TwoUnits("scraped \"job\" \\"));
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_TRUE(Train(**m, 3).ok());

    Result<std::string> answer = Http(address, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    ASSERT_TRUE(answer.ok()) << answer.status();
    ASSERT_TRUE(answer->starts_with("HTTP/1.1 200 OK\r\n")) << *answer;
    EXPECT_NE(answer->find("Content-Type: text/plain; version=0.0.4"), std::string::npos);
    const std::string body = answer->substr(answer->find("\r\n\r\n") + 4);
    EXPECT_EQ(CheckExposition(body), "") << body;
    for (const char* series :
         {"ztier_build_info{version=", "ztier_pinned_bytes{state=\"used\"}",
          "ztier_nvme_read_bytes_total ",
          "ztier_host_device_bytes_total{direction=\"host_to_device\"}", "ztier_steps_total 3",
          "ztier_jobs{state=\"training\"} 1",
          names ? "ztier_optimizer_step_seconds_count{uid=\"0\",job=\"scraped \\\"job\\\" \\\\\"} 3"
                : "ztier_optimizer_step_seconds_count{uid=\"0\",job=\"1\"} 3",
          "ztier_quota_used_bytes{uid=\"0\",tier=\"dram\"}", "ztier_stall_seconds_total"}) {
      if (::geteuid() != 0 && std::string(series).find("uid=\"0\"") != std::string::npos) continue;
      EXPECT_NE(body.find(series), std::string::npos) << series << "\n" << body;
    }
    if (!names) {
      EXPECT_EQ(body.find("scraped"), std::string::npos) << "a job's name is served\n" << body;
    }
    // promtool, the format's own checker.
    const bool required = std::getenv("ZTIER_REQUIRE_PROMTOOL") != nullptr &&
                          std::string(std::getenv("ZTIER_REQUIRE_PROMTOOL")) == "1";
    if (std::system("command -v promtool >/dev/null 2>&1") == 0) {
      const std::string file = dir.path() + "/scrape.txt";
      std::ofstream(file) << body;
      const std::string out = dir.path() + "/promtool.txt";
      const int st =
          std::system(StrCat("promtool check metrics <", file, " >", out, " 2>&1").c_str());
      std::ifstream pin(out);
      std::stringstream ps;
      ps << pin.rdbuf();
      EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << ps.str();
    } else {
      EXPECT_FALSE(required) << "ZTIER_REQUIRE_PROMTOOL=1 but promtool is not installed "
                                "(Debian: apt-get install prometheus)";
    }
    // Other paths and methods; a HEAD; a request that never ends.
    Result<std::string> r = Http(address, "GET /other HTTP/1.1\r\n\r\n");
    ASSERT_TRUE(r.ok());
    EXPECT_TRUE(r->starts_with("HTTP/1.1 404")) << *r;
    r = Http(address, "POST /metrics HTTP/1.1\r\n\r\n");
    ASSERT_TRUE(r.ok());
    EXPECT_TRUE(r->starts_with("HTTP/1.1 405")) << *r;
    r = Http(address, "HEAD /metrics HTTP/1.0\r\n\r\n");
    ASSERT_TRUE(r.ok());
    EXPECT_TRUE(r->starts_with("HTTP/1.1 200")) << *r;
    EXPECT_TRUE(r->ends_with("\r\n\r\n")) << *r;  // no body
    const auto t0 = std::chrono::steady_clock::now();
    r = Http(address, "GET /metrics HTTP/1.1\r\n");  // no end of head: cut after 2 s
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
    r = Http(address, "garbage\r\n\r\n");
    ASSERT_TRUE(r.ok());
    EXPECT_TRUE(r->starts_with("HTTP/1.1 400")) << *r;
    // ... and the server serves on.
    r = Http(address, "GET /metrics HTTP/1.1\r\n\r\n");
    ASSERT_TRUE(r.ok());
    EXPECT_TRUE(r->starts_with("HTTP/1.1 200")) << *r;
  }
  std::filesystem::remove_all(sock_dir);
}

// The format is UTF-8: a label value that is not (a swap path's bytes)
// made every scrape unparseable.
TEST(MetricsTest, LabelValuesAreEscapedAndUtf8) {
  EXPECT_EQ(engine::EscapeLabelValue("a\\b\"c"), "a\\\\b\\\"c");
  EXPECT_EQ(engine::EscapeLabelValue("/x/sw\xff\"x"), "/x/sw?\\\"x");
  EXPECT_EQ(engine::EscapeLabelValue("caf\xc3\xa9\n"), "caf\xc3\xa9?");
}

// Clients that connect to the metrics listener and say nothing hold up
// nobody's scrape (it answered one connection at a time, each given 2 s for
// its request: five idle clients outlasted Prometheus' 10 s scrape
// timeout). A second ztierd does not take over a live metrics socket (it
// deleted the first one's), nor leave its control socket behind when it
// fails to listen.
TEST(MetricsTest, IdleClientsHoldUpNoScrapeAndALiveSocketIsNotTakenOver) {
  std::string sock_dir = "/tmp/ztier-metrics-XXXXXX";
  ASSERT_NE(::mkdtemp(sock_dir.data()), nullptr);
  const std::string metrics = sock_dir + "/m.sock";
  ZtierdProcess d(ZTIERD_BINARY, {"--metrics", "unix:" + metrics});
  const std::string address = MetricsAddress(d);
  ASSERT_FALSE(address.empty()) << d.log();
  std::vector<UniqueFd> idle;
  for (int k = 0; k < 10; ++k) {
    UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    std::memcpy(sa.sun_path, metrics.data(), metrics.size());
    ASSERT_EQ(::connect(fd.get(), reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
    idle.push_back(std::move(fd));
  }
  const auto t0 = std::chrono::steady_clock::now();
  Result<std::string> r = Http(address, "GET /metrics HTTP/1.1\r\n\r\n");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->starts_with("HTTP/1.1 200")) << *r;
  // One at a time, 10 idle clients held it up 20 s.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);

  ScratchDir dir("metrics-second");
  const std::string second = dir.path() + "/d2.sock";
  const std::string out = dir.path() + "/out.txt";
  // A second ztierd whose metrics go to `taken`: it fails, saying so.
  const auto refused_at = [&](const std::string& taken) {
    const int st = std::system(StrCat("timeout -s KILL 30 ", ZTIERD_BINARY, " --socket ", second,
                                      " --metrics unix:", taken, " >", out, " 2>&1")
                                   .c_str());
    std::ifstream in(out);
    std::stringstream ss;
    ss << in.rdbuf();
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 1) << ss.str();
    EXPECT_NE(ss.str().find("is in use"), std::string::npos) << ss.str();
    EXPECT_FALSE(std::filesystem::exists(second)) << "the control socket was left behind";
  };
  refused_at(metrics);
  r = Http(address, "GET /metrics HTTP/1.1\r\n\r\n");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->starts_with("HTTP/1.1 200")) << *r;
  // Nor a live ztierd's control socket (a socket of another kind: it was
  // deleted, and that ztierd could be reached no more).
  refused_at(d.socket());
  const CtlRun status = Ztierctl("--socket " + d.socket() + " status", dir.path());
  EXPECT_EQ(status.code, 0) << status.out << d.log();
  std::filesystem::remove_all(sock_dir);
}

// Clients that sent a head past the limit and then trickled a byte every
// 20 ms, reconnecting when closed: each 431 was followed by up to 200 ms
// of reading the rest on the metrics thread, one client after another, and
// every scrape waited behind them (20 clients: 3.7 s a scrape; 60: half of
// them past Prometheus's 10 s). The rest is now read beside the others.
TEST(MetricsTest, TricklingClientsPastTheHeadLimitHoldUpNoScrape) {
  ZtierdProcess d(ZTIERD_BINARY, {"--metrics", "127.0.0.1:0"});
  const std::string address = MetricsAddress(d);
  ASSERT_FALSE(address.empty()) << d.log();
  std::atomic<bool> stop{false};
  std::atomic<int> reconnects{0};
  std::thread trickler([&] {
    std::vector<UniqueFd> fds(40);
    const std::string head = "GET /" + std::string(8200, 'a');
    while (!stop.load()) {
      for (UniqueFd& fd : fds) {
        if (fd.valid() && ::send(fd.get(), "a", 1, MSG_NOSIGNAL | MSG_DONTWAIT) == 1) continue;
        Result<UniqueFd> c = ConnectTo(address);
        if (!c.ok()) continue;
        fd = *std::move(c);
        (void)::send(fd.get(), head.data(), head.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        reconnects.fetch_add(1);
      }
      std::this_thread::sleep_for(20ms);
    }
  });
  std::this_thread::sleep_for(500ms);
  std::chrono::duration<double> slowest{0};
  for (int k = 0; k < 5; ++k) {
    const auto t0 = std::chrono::steady_clock::now();
    Result<std::string> r = Http(address, "GET /metrics HTTP/1.1\r\n\r\n");
    slowest =
        std::max<std::chrono::duration<double>>(slowest, std::chrono::steady_clock::now() - t0);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->starts_with("HTTP/1.1 200")) << *r;
    std::this_thread::sleep_for(200ms);
  }
  stop.store(true);
  trickler.join();
  EXPECT_GT(reconnects.load(), 80) << "the trickling clients were never answered and closed";
  // (40 such clients held each scrape up about 7 s.)
  EXPECT_LT(slowest.count(), 3.0) << "a scrape waited behind the trickling clients";
}

// ztierd started as systemd starts a socket-activated service: `fds` as
// fds 3.. (LISTEN_FDS), named `names` (LISTEN_FDNAMES), its stderr in
// `log`. Returns its pid (or -1).
pid_t StartActivated(const std::vector<int>& fds, const std::string& names,
                     const std::string& log) {
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  const int out = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (out < 0 || ::dup2(out, 2) < 0) _exit(91);
  for (size_t k = 0; k < fds.size(); ++k) {
    if (::dup2(fds[k], static_cast<int>(3 + k)) < 0) _exit(91);
  }
  for (int fd = static_cast<int>(3 + fds.size()); fd < 1024; ++fd) ::close(fd);
  const std::string pid_env = StrCat("LISTEN_PID=", ::getpid());
  const std::string fds_env = StrCat("LISTEN_FDS=", fds.size());
  const std::string names_env = StrCat("LISTEN_FDNAMES=", names);
  char* env[] = {
      const_cast<char*>(pid_env.c_str()),         const_cast<char*>(fds_env.c_str()),
      const_cast<char*>(names_env.c_str()),       const_cast<char*>("ZTIER_DRAM_BUDGET=128M"),
      const_cast<char*>("ZTIER_HUGE_PAGES=none"), nullptr};
  ::execle(ZTIERD_BINARY, ZTIERD_BINARY, static_cast<char*>(nullptr), env);
  _exit(92);
}

// ztierd under socket activation with both of ztierd.service's sockets
// (LISTEN_FDS=2, LISTEN_FDNAMES=control:metrics), as systemd starts it.
TEST(MetricsTest, ZtierdServesTheMetricsSocketSystemdPasses) {
  std::string dir = "/tmp/ztier-activate-XXXXXX";
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  const std::string control = dir + "/ztierd.sock";
  UniqueFd c(::socket(AF_UNIX, SOCK_SEQPACKET, 0));
  sockaddr_un su{};
  su.sun_family = AF_UNIX;
  std::memcpy(su.sun_path, control.data(), control.size());
  ASSERT_EQ(::bind(c.get(), reinterpret_cast<sockaddr*>(&su), sizeof(su)), 0);
  ASSERT_EQ(::listen(c.get(), 16), 0);
  UniqueFd m(::socket(AF_INET, SOCK_STREAM, 0));
  sockaddr_in si{};
  si.sin_family = AF_INET;
  si.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(m.get(), reinterpret_cast<sockaddr*>(&si), sizeof(si)), 0);
  ASSERT_EQ(::listen(m.get(), 16), 0);
  socklen_t len = sizeof(si);
  ASSERT_EQ(::getsockname(m.get(), reinterpret_cast<sockaddr*>(&si), &len), 0);
  const std::string address = StrCat("127.0.0.1:", ntohs(si.sin_port));
  const std::string log = dir + "/ztierd.log";
  const pid_t pid = StartActivated({c.get(), m.get()}, "control:metrics", log);
  ASSERT_GT(pid, 0);
  c.reset();
  m.reset();
  Result<std::string> r = Status::Unavailable("not tried");
  for (int k = 0; k < 500; ++k) {
    r = Http(address, "GET /metrics HTTP/1.1\r\n\r\n");
    if (r.ok() && r->starts_with("HTTP/1.1 200")) break;
    std::this_thread::sleep_for(10ms);
  }
  std::ifstream in(log);
  std::stringstream text;
  text << in.rdbuf();
  ASSERT_TRUE(r.ok()) << r.status() << text.str();
  EXPECT_TRUE(r->starts_with("HTTP/1.1 200")) << *r << text.str();
  EXPECT_NE(r->find("ztier_build_info{"), std::string::npos) << *r;
  EXPECT_EQ(CheckExposition(r->substr(r->find("\r\n\r\n") + 4)), "");
  Result<std::unique_ptr<DaemonControl>> ctl = DaemonControl::Connect(control);
  ASSERT_TRUE(ctl.ok()) << ctl.status() << text.str();
  EXPECT_TRUE((*ctl)->GetStatus().ok());
  ::kill(pid, SIGTERM);
  int st = 0;
  ::waitpid(pid, &st, 0);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << text.str();
  std::filesystem::remove_all(dir);
}

// Two sockets named "metrics" (a drop-in that adds a ListenStream= without
// clearing the unit's): one was served, the other's scrapes hung, with no
// word. ztierd now refuses to start, naming the fix.
TEST(MetricsTest, TwoMetricsSocketsFromSystemdAreAClearError) {
  std::string dir = "/tmp/ztier-activate-XXXXXX";
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  std::vector<UniqueFd> fds;
  fds.emplace_back(::socket(AF_UNIX, SOCK_SEQPACKET, 0));
  sockaddr_un su{};
  su.sun_family = AF_UNIX;
  const std::string control = dir + "/ztierd.sock";
  std::memcpy(su.sun_path, control.data(), control.size());
  ASSERT_EQ(::bind(fds[0].get(), reinterpret_cast<sockaddr*>(&su), sizeof(su)), 0);
  ASSERT_EQ(::listen(fds[0].get(), 16), 0);
  for (int k = 0; k < 2; ++k) {
    fds.emplace_back(::socket(AF_INET, SOCK_STREAM, 0));
    sockaddr_in si{};
    si.sin_family = AF_INET;
    si.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::bind(fds.back().get(), reinterpret_cast<sockaddr*>(&si), sizeof(si)), 0);
    ASSERT_EQ(::listen(fds.back().get(), 16), 0);
  }
  const std::string log = dir + "/ztierd.log";
  const pid_t pid =
      StartActivated({fds[0].get(), fds[1].get(), fds[2].get()}, "control:metrics:metrics", log);
  ASSERT_GT(pid, 0);
  fds.clear();
  int st = 0;
  ::waitpid(pid, &st, 0);
  std::ifstream in(log);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 2) << st << text.str();
  EXPECT_NE(text.str().find("2 sockets named 'metrics'"), std::string::npos) << text.str();
  std::filesystem::remove_all(dir);
}

TEST(MetricsTest, ABadMetricsAddressIsAClearUsageError) {
  ScratchDir dir("metrics-bad");
  for (const char* bad : {"nowhere", "127.0.0.1:99999", "300.1.1.1:9", "[zz]:9", "unix:"}) {
    const std::string out = dir.path() + "/out.txt";
    const int st = std::system(StrCat("timeout -s KILL 30 ", ZTIERD_BINARY, " --socket ",
                                      dir.path(), "/d.sock --metrics '", bad, "' >", out, " 2>&1")
                                   .c_str());
    std::ifstream in(out);
    std::stringstream ss;
    ss << in.rdbuf();
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 2) << bad << ": " << ss.str();
    EXPECT_NE(ss.str().find("metrics address"), std::string::npos) << ss.str();
  }
}

}  // namespace
}  // namespace ztier::client
