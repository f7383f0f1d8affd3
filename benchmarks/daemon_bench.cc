// ztier-bench daemon: what training through ztierd costs against the same
// training with the engine embedded, measured in the same run: a model's
// stage-3 step through the client API (every unit acquired and released,
// its grads pushed, the step waited for: the engine's optimizer included)
// with a Session over a ztierd served by this process versus an embedded
// Session, the two taking turns step by step so drift in the machine's load
// hits both alike; and the
// control round trip through the daemon (a counters query: request, the
// daemon's handler, reply), p50 and p99. The limit is the embedded
// step: the ratio is embedded / daemon (1.0: the daemon costs nothing).
//
// The step has no model compute, so the daemon's messages are as large a
// share of it as they can be; a real model's compute dilutes them further.
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "benchmarks/bench_util.h"
#include "benchmarks/subcommands.h"
#include "client/ztier.h"
#include "engine/daemon.h"
#include "engine/seqpacket.h"

namespace ztier::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kUsage = R"(usage: ztier-bench daemon [options]

A model's stage-3 step (acquire and release every unit, push its grads, the
engine's optimizer step) through ztierd (served by this process on a socket)
against the same step with the engine embedded, alternated in one run; and
the daemon's control round trip (a counters query), p50 and p99.

options:
  --units N         units of the model (default 16)
  --unit-params P   parameters per unit (default 1M; K/M suffixes)
  --steps S         timed steps of each (default 20)
  --rounds R        control round trips (default 5000)
  --json            also print one JSON object as the last line
)";

struct Options {
  uint64_t units = 16;
  uint64_t unit_params = uint64_t{1} << 20;
  uint64_t steps = 20;
  uint64_t rounds = 5000;
  bool json = false;
};

Result<Options> Parse(int argc, char** argv) {
  Options o;
  ArgReader args(argc, argv);
  while (args.Next()) {
    if (args.Is("--units")) {
      ZT_RETURN_IF_ERROR(args.CountInto(&o.units, 1, 4096));
    } else if (args.Is("--unit-params")) {
      ZT_RETURN_IF_ERROR(args.CountInto(&o.unit_params, 64, uint64_t{1} << 30));
    } else if (args.Is("--steps")) {
      ZT_RETURN_IF_ERROR(args.CountInto(&o.steps, 2, 1 << 20));
    } else if (args.Is("--rounds")) {
      ZT_RETURN_IF_ERROR(args.CountInto(&o.rounds, 100, uint64_t{1} << 26));
    } else if (args.Is("--json")) {
      o.json = true;
    } else {
      return args.Unrecognized();
    }
  }
  return o;
}

engine::Settings EngineSettings(const Options& o) {
  engine::Settings s;
  // States (12 B), params, inbox and grads (2 B each) per parameter, twice
  // over for the probe model and slack.
  s.dram_budget_bytes = 2 * o.units * o.unit_params * 20 + (uint64_t{256} << 20);
  s.huge_pages = engine::HugePages::kNone;
  return s;
}

client::Session::ModelSpec Spec(const std::string& name, uint64_t units, uint64_t params) {
  client::Session::ModelSpec m;
  m.name = name;
  for (uint64_t u = 0; u < units; ++u) {
    m.units.push_back(
        {.name = StrCat("unit", u),
         .tensors = {{.name = StrCat("unit", u, ".w"), .shape = {static_cast<int64_t>(params)}}}});
  }
  m.optimizer.hyper.lr = 1e-4f;
  return m;
}

// One training setup: a session, its model, a host device and a runner.
struct Rig {
  std::unique_ptr<client::Session> session;
  std::unique_ptr<client::Model> model;
  std::unique_ptr<client::Device> device;
  std::unique_ptr<client::Stage3Runner> runner;
  int64_t steps = 0;
  std::vector<double> step_seconds;

  static Result<std::unique_ptr<Rig>> Make(const client::SessionOptions& so, const Options& o) {
    auto r = std::make_unique<Rig>();
    ZT_ASSIGN_OR_RETURN(r->session, client::Session::Open(so));
    ZT_ASSIGN_OR_RETURN(r->model, r->session->RegisterModel(Spec("bench", o.units, o.unit_params)));
    std::vector<float> weights(o.unit_params, 0.01f);
    for (int u = 0; u < r->model->units(); ++u) {
      ZT_RETURN_IF_ERROR(r->model->SetWeights(u, weights.data(), weights.size()));
    }
    ZT_ASSIGN_OR_RETURN(r->device, client::MakeHostDevice());
    ZT_ASSIGN_OR_RETURN(r->runner,
                        client::Stage3Runner::Create(*r->model, 0, *r->device, nullptr, {}));
    return r;
  }

  // One stage-3 step, timed when `timed`.
  Status Step(bool timed) {
    const auto t0 = Clock::now();
    for (int u = 0; u < model->units(); ++u) {
      ZT_RETURN_IF_ERROR(runner->Acquire(u).status());
      ZT_RETURN_IF_ERROR(runner->Release(u));
    }
    for (int u = model->units() - 1; u >= 0; --u) {
      ZT_RETURN_IF_ERROR(runner->GradBuffer(u).status());
      ZT_RETURN_IF_ERROR(runner->PushGrads(u));
    }
    ZT_RETURN_IF_ERROR(runner->Step());
    ZT_RETURN_IF_ERROR(model->WaitPublished(++steps, std::chrono::seconds(60)));
    if (timed) step_seconds.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    return Status::Ok();
  }
};

// Control round trips: a counters query of a one-unit model (published
// steps are read from the step page, without a round trip).
Result<std::vector<double>> RoundTrips(StopSignals& stops, client::Session& session,
                                       uint64_t rounds) {
  ZT_ASSIGN_OR_RETURN(std::unique_ptr<client::Model> probe,
                      session.RegisterModel(Spec("probe", 1, 64)));
  std::vector<double> us;
  for (uint64_t r = 0; r < rounds; ++r) {
    if (r % 256 == 0 && stops.Stopped() != 0) return stops.Error("the round trips");
    const auto t0 = Clock::now();
    ZT_ASSIGN_OR_RETURN(const engine::JobCounters counters, probe->counters());
    if (counters.steps != 0) return Status::Internal("a probe that stepped");
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  return us;
}

// Both rigs live at once and take turns step by step (the order swapped
// every step), so drift in the machine's load hits both alike.
Status Measure(StopSignals& stops, const Options& o, const engine::Settings& settings,
               const std::string& socket, std::vector<double>* embedded,
               std::vector<double>* daemon, std::vector<double>* rtt_us) {
  client::SessionOptions local;
  local.settings = settings;
  client::SessionOptions remote = local;
  remote.daemon_socket = socket;
  ZT_ASSIGN_OR_RETURN(std::unique_ptr<Rig> a, Rig::Make(local, o));
  ZT_ASSIGN_OR_RETURN(std::unique_ptr<Rig> b, Rig::Make(remote, o));
  for (uint64_t step = 0; step < o.steps + 2; ++step) {
    if (stops.Stopped() != 0) return stops.Error("the steps");
    Rig* first = step % 2 == 0 ? a.get() : b.get();
    Rig* second = first == a.get() ? b.get() : a.get();
    ZT_RETURN_IF_ERROR(first->Step(step >= 2));
    ZT_RETURN_IF_ERROR(second->Step(step >= 2));
  }
  *embedded = a->step_seconds;
  *daemon = b->step_seconds;
  ZT_ASSIGN_OR_RETURN(*rtt_us, RoundTrips(stops, *b->session, o.rounds));
  return Status::Ok();
}

}  // namespace

int RunDaemon(int argc, char** argv) {
  Result<Options> o = Parse(argc, argv);
  if (!o.ok()) return UsageExit(o.status(), "daemon", kUsage);
  const engine::Settings settings = EngineSettings(*o);
  // Two engines (the embedded one, ztierd's) each hold the model's states,
  // params, inbox and grads; the device side is host memory here too.
  if (Status s = CheckFitsInMemory(
          2.0 * 20 * static_cast<double>(o->units) * static_cast<double>(o->unit_params) +
              2.0 * (uint64_t{256} << 20),
          StrCat("--units ", o->units, " x --unit-params ", o->unit_params,
                 " (two engines of the model)"));
      !s.ok()) {
    return FailExit(s, "daemon");
  }
  // Before any thread starts: a stop ends the run at its next step, the
  // socket's directory removed, with 128 + the signal.
  StopSignals stops;

  std::string dir = "/tmp/ztier-bench-daemon-XXXXXX";
  if (::mkdtemp(dir.data()) == nullptr) return FailExit(PosixError("mkdtemp", errno), "daemon");
  // Goes however the run ends (after the daemon and its socket, made below).
  struct RemovedAtEnd {
    const std::string& path;
    ~RemovedAtEnd() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  } removed_at_end{dir};
  const std::string socket = dir + "/ztierd.sock";
  Result<std::unique_ptr<engine::Daemon>> daemon = engine::Daemon::Create(settings, {});
  if (!daemon.ok()) return FailExit(daemon.status(), "daemon");
  Result<engine::SeqPacketListener> listener = engine::SeqPacketListener::Listen(socket, 0600);
  if (!listener.ok()) return FailExit(listener.status(), "daemon");
  std::thread serve([&] { (void)(*daemon)->Serve(*listener); });

  std::vector<double> embedded_steps, daemon_steps, rtt_us;
  const Status failed =
      Measure(stops, *o, settings, socket, &embedded_steps, &daemon_steps, &rtt_us);
  (*daemon)->Stop("the benchmark is done");
  serve.join();
  (void)listener->Close();
  if (!failed.ok()) {
    const int code = FailExit(failed, "daemon");
    return stops.Stopped() != 0 ? stops.ExitCode() : code;
  }

  const double embedded = Median(embedded_steps);
  const double through = Median(daemon_steps);
  const double ratio = embedded / through;
  const double p50 = Median(rtt_us), p99 = Quantile(rtt_us, 0.99);
  std::printf("ztier-bench daemon: %llu units x %s params, %llu steps each, taking turns\n",
              static_cast<unsigned long long>(o->units), FormatCount(o->unit_params).c_str(),
              static_cast<unsigned long long>(o->steps));
  std::printf("limit: embedded engine step   median %8.3f ms\n", embedded * 1e3);
  std::printf("through ztierd step           median %8.3f ms   (%+.1f%%)\n", through * 1e3,
              (through / embedded - 1) * 100);
  std::printf("ztierd control round trip     p50 %.1f us   p99 %.1f us\n", p50, p99);
  std::printf("ratio to the limit (median step, embedded / daemon): %.3f\n", ratio);
  NoteRatioPastOne(ratio, "", "the embedded engine's steps ran slower than ztierd's here",
                   "they take turns, and others' work on the CPUs moves both: repeat the run");
  if (o->json) {
    JsonObject j;
    j.Add("bench", "daemon")
        .Add("units", o->units)
        .Add("unit_params", o->unit_params)
        .Add("steps", o->steps)
        .Add("embedded_step_ms", embedded * 1e3)
        .Add("daemon_step_ms", through * 1e3)
        .Add("rtt_p50_us", p50)
        .Add("rtt_p99_us", p99)
        .Add("ratio", ratio);
    std::printf("%s\n", j.str().c_str());
  }
  return 0;
}

}  // namespace ztier::bench
