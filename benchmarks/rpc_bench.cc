// ztier-bench rpc: the daemon protocol's control round trip, a client
// thread and a server thread on a SOCK_SEQPACKET socket pair, through
// everything a call pays (encode, framing, send with its deadline, poll,
// receive, header and payload checks, the reply's status), against the
// limit measured in the same run: a bare ping-pong of datagrams of the same
// sizes with plain send/recv on the same kind of socket. Reports p50 and
// p99 of both and their ratio: what ztier's framing and checks add to the
// kernel's round trip (the figure that decides whether a doorbell beats a
// message per unit per step).
//
// Two threads, each pinned to nothing; timings are per round trip with a
// monotonic clock.
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "benchmarks/bench_util.h"
#include "benchmarks/subcommands.h"
#include "engine/protocol.h"
#include "engine/seqpacket.h"

namespace ztier::bench {
namespace {

namespace p = engine::protocol;
using Clock = std::chrono::steady_clock;

constexpr const char* kUsage = R"(usage: ztier-bench rpc [options]

The daemon protocol's control round trip (a published-step query and its
reply, framed, checked and decoded on both sides) between two threads on a
SOCK_SEQPACKET socket pair, against a bare ping-pong of datagrams of the
same sizes on the same kind of socket, measured in the same run.

options:
  --rounds N   round trips of each kind, in 2 alternating passes (default 20000)
  --json       also print one JSON object as the last line
)";

struct Options {
  uint64_t rounds = 20000;
  bool json = false;
};

Result<Options> Parse(int argc, char** argv) {
  Options o;
  ArgReader args(argc, argv);
  while (args.Next()) {
    if (args.Is("--rounds")) {
      ZT_RETURN_IF_ERROR(args.CountInto(&o.rounds, 100, uint64_t{1} << 26));
    } else if (args.Is("--json")) {
      o.json = true;
    } else {
      return args.Unrecognized();
    }
  }
  return o;
}

struct Percentiles {
  double p50_us = 0, p99_us = 0;
};

Percentiles Of(const std::vector<double>& us) { return {Median(us), Quantile(us, 0.99)}; }

// The protocol's round trip: the server decodes the request as ztierd
// will and answers with a status and a step.
Result<Percentiles> MeasureProtocol(uint64_t rounds) {
  ZT_ASSIGN_OR_RETURN(auto pair, engine::SeqPacketSocket::Pair());
  auto& [client, server] = pair;
  Status server_status;
  std::thread serve([&server_status, &server] {
    for (;;) {
      Result<engine::SeqPacketSocket::Received> in =
          server.Receive(std::chrono::seconds(30), p::kMaxMessageBytes, p::kMaxFdsPerMessage);
      if (!in.ok()) {
        if (in.status().code() != StatusCode::kUnavailable) server_status = in.status();
        return;  // the client closed: done
      }
      Result<p::Header> h = p::DecodeHeader(in->data, static_cast<uint32_t>(in->fds.size()));
      if (!h.ok()) {
        server_status = h.status();
        return;
      }
      Result<p::UnitRef> ref = p::DecodeUnitRef(std::string_view(in->data).substr(p::kHeaderBytes));
      if (!ref.ok()) {
        server_status = ref.status();
        return;
      }
      Result<std::string> reply = p::EncodeMessage(
          {.type = h->type, .flags = p::kFlagReply, .request_id = h->request_id},
          p::EncodeStatus(Status::Ok()) + p::Encode(p::StepValue{.step = ref->unit}));
      if (!reply.ok() || !server.Send(*reply).ok()) return;
    }
  });
  std::vector<double> us;
  us.reserve(rounds);
  Status s;
  for (uint64_t i = 0; i < rounds + rounds / 10 && s.ok(); ++i) {
    const auto t0 = Clock::now();
    Result<std::string> request =
        p::EncodeMessage({.type = p::MessageType::kPublishedStep, .request_id = i},
                         p::Encode(p::UnitRef{.job = 1, .unit = static_cast<int32_t>(i % 97)}));
    if (!request.ok()) {
      s = request.status();
      break;
    }
    s = client.Send(*request);
    if (!s.ok()) break;
    Result<engine::SeqPacketSocket::Received> in =
        client.Receive(std::chrono::seconds(30), p::kMaxMessageBytes, p::kMaxFdsPerMessage);
    if (!in.ok()) {
      s = in.status();
      break;
    }
    Result<p::Header> h = p::DecodeHeader(in->data, static_cast<uint32_t>(in->fds.size()));
    if (!h.ok() || h->request_id != i) {
      s = h.ok() ? Status::Internal("a reply to another request") : h.status();
      break;
    }
    Result<std::string_view> fields =
        p::DecodeReplyStatus(std::string_view(in->data).substr(p::kHeaderBytes));
    Result<p::StepValue> step = fields.ok() ? p::DecodeStepValue(*fields) : fields.status();
    if (!step.ok() || step->step != static_cast<int64_t>(i % 97)) {
      s = step.ok() ? Status::Internal("a wrong step in the reply") : step.status();
      break;
    }
    if (i >= rounds / 10) {  // the first tenth warms up
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
  }
  client.Shutdown();
  serve.join();
  ZT_RETURN_IF_ERROR(s);
  ZT_RETURN_IF_ERROR(server_status);
  return Of(us);
}

// The limit: the same datagram sizes bounced with plain blocking send/recv.
Result<Percentiles> MeasureBare(uint64_t rounds, size_t request_bytes, size_t reply_bytes) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) {
    return PosixError("socketpair", errno);
  }
  std::thread echo([fd = sv[1], reply_bytes] {
    std::vector<char> buf(64 << 10), out(reply_bytes, 'r');
    while (::recv(fd, buf.data(), buf.size(), 0) > 0) {
      if (::send(fd, out.data(), out.size(), MSG_NOSIGNAL) < 0) return;
    }
  });
  std::vector<char> req(request_bytes, 'q'), buf(64 << 10);
  std::vector<double> us;
  us.reserve(rounds);
  Status s;
  for (uint64_t i = 0; i < rounds + rounds / 10; ++i) {
    const auto t0 = Clock::now();
    if (::send(sv[0], req.data(), req.size(), MSG_NOSIGNAL) < 0 ||
        ::recv(sv[0], buf.data(), buf.size(), 0) <= 0) {
      s = PosixError("bare ping-pong", errno);
      break;
    }
    if (i >= rounds / 10) {
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
  }
  ::shutdown(sv[0], SHUT_RDWR);
  echo.join();
  ::close(sv[0]);
  ::close(sv[1]);
  ZT_RETURN_IF_ERROR(s);
  return Of(us);
}

}  // namespace

int RunRpc(int argc, char** argv) {
  Result<Options> o = Parse(argc, argv);
  if (!o.ok()) return UsageExit(o.status(), "rpc", kUsage);
  const size_t request_bytes = p::kHeaderBytes + p::Encode(p::UnitRef{}).size();
  const size_t reply_bytes =
      p::kHeaderBytes + p::EncodeStatus(Status::Ok()).size() + p::Encode(p::StepValue{}).size();
  // Alternate the two twice so drift in the machine's load hits both.
  Percentiles proto, bare;
  for (int pass = 0; pass < 2; ++pass) {
    Result<Percentiles> b = MeasureBare(o->rounds / 2, request_bytes, reply_bytes);
    if (!b.ok()) return FailExit(b.status(), "rpc");
    Result<Percentiles> r = MeasureProtocol(o->rounds / 2);
    if (!r.ok()) return FailExit(r.status(), "rpc");
    if (pass == 0 || r->p50_us < proto.p50_us) proto = *r;
    if (pass == 0 || b->p50_us < bare.p50_us) bare = *b;
  }
  const double ratio = bare.p50_us / proto.p50_us;
  std::printf(
      "ztier-bench rpc: %llu round trips each, in 2 alternating passes of %llu (the better "
      "pass kept), %zu-byte request, %zu-byte reply\n",
      static_cast<unsigned long long>(o->rounds / 2 * 2),
      static_cast<unsigned long long>(o->rounds / 2), request_bytes, reply_bytes);
  std::printf("limit: bare SOCK_SEQPACKET ping-pong   p50 %7.2f us   p99 %7.2f us\n", bare.p50_us,
              bare.p99_us);
  std::printf("ztier protocol round trip           p50 %7.2f us   p99 %7.2f us\n", proto.p50_us,
              proto.p99_us);
  std::printf("ratio to the limit (p50, bare / protocol): %.3f\n", ratio);
  if (o->json) {
    JsonObject j;
    j.Add("bench", "rpc")
        .Add("rounds", o->rounds / 2 * 2)  // as the text says: an odd --rounds loses one
        .Add("rounds_per_pass", o->rounds / 2)
        .Add("bare_p50_us", bare.p50_us)
        .Add("bare_p99_us", bare.p99_us)
        .Add("rpc_p50_us", proto.p50_us)
        .Add("rpc_p99_us", proto.p99_us)
        .Add("ratio", ratio);
    std::printf("%s\n", j.str().c_str());
  }
  return 0;
}

}  // namespace ztier::bench
