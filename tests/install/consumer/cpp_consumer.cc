// A C++ program built against an installed ztier (tests/install): the C++
// API through <ztier/ztier.h> and the static client libraries. An embedded
// session, a two-unit model, three steps through a Stage3Runner on the host
// device with a constant grad, then the master weights checked against
// AdamW (each step moves a weight by lr when the grad is constant). Prints
// one line:
//   cpp_consumer: ok (embedded, 3 steps, master <value>)
// Build lines:
//   g++ -std=c++20 cpp_consumer.cc $(pkg-config --cflags --libs ztier)
//   CMake: target_link_libraries(app PRIVATE ztier::ztier)
#include <cmath>
#include <cstdio>
#include <memory>
#include <vector>

#include <ztier/ztier.h>

namespace zc = ztier::client;

namespace {

int Fail(const char* what, const ztier::Status& status) {
  std::fprintf(stderr, "cpp_consumer: %s: %s\n", what, status.ToString().c_str());
  return 1;
}

}  // namespace

int main() {
  zc::SessionOptions options;
  options.settings.dram_budget_bytes = uint64_t{64} << 20;
  options.settings.huge_pages = ztier::engine::HugePages::kNone;
  auto session = zc::Session::Open(options);
  if (!session.ok()) return Fail("Session::Open", session.status());

  zc::Session::ModelSpec spec;
  spec.name = "cpp-consumer";
  spec.units = {{.name = "embed", .tensors = {{.name = "wte", .shape = {32, 8}}}},
                {.name = "head", .tensors = {{.name = "w", .shape = {8, 4}}, {.name = "b", .shape = {4}}}}};
  spec.optimizer.hyper.lr = 0.01f;
  auto model = (*session)->RegisterModel(spec);
  if (!model.ok()) return Fail("RegisterModel", model.status());
  zc::Model& m = **model;
  for (int u = 0; u < m.units(); ++u) {
    const std::vector<float> w(m.layout(u).numel, 0.5f);
    if (auto s = m.SetWeights(u, w.data(), w.size()); !s.ok()) return Fail("SetWeights", s);
  }

  auto device = zc::MakeHostDevice();
  if (!device.ok()) return Fail("MakeHostDevice", device.status());
  auto runner = zc::Stage3Runner::Create(m, 0, **device, nullptr, zc::RunnerOptions{});
  if (!runner.ok()) return Fail("Stage3Runner::Create", runner.status());
  const int steps = 3;
  for (int step = 0; step < steps; ++step) {
    for (int u = 0; u < m.units(); ++u) {  // forward
      auto params = (*runner)->Acquire(u);
      if (!params.ok()) return Fail("Acquire", params.status());
      if (auto s = (*runner)->Release(u); !s.ok()) return Fail("Release", s);
    }
    for (int u = m.units() - 1; u >= 0; --u) {  // backward
      auto grads = (*runner)->GradBuffer(u);
      if (!grads.ok()) return Fail("GradBuffer", grads.status());
      for (uint64_t i = 0; i < m.layout(u).numel; ++i) (*grads)[i] = ztier::FloatToBf16(1.0f);
      if (auto s = (*runner)->PushGrads(u); !s.ok()) return Fail("PushGrads", s);
    }
    if (auto s = (*runner)->Step(); !s.ok()) return Fail("Step", s);
  }
  runner->reset();
  if (auto s = m.WaitPublished(steps, std::chrono::seconds(10)); !s.ok()) {
    return Fail("WaitPublished", s);
  }

  const float want = 0.5f - steps * 0.01f;
  std::vector<float> master;
  for (int u = 0; u < m.units(); ++u) {
    if (auto s = m.ReadMaster(u, &master); !s.ok()) return Fail("ReadMaster", s);
    for (uint64_t i = 0; i < m.layout(u).numel; ++i) {
      if (std::fabs(master[i] - want) > 1e-4f) {
        std::fprintf(stderr, "cpp_consumer: unit %d master[%llu] = %g, want %g\n", u,
                     static_cast<unsigned long long>(i), master[i], want);
        return 1;
      }
    }
  }
  std::printf("cpp_consumer: ok (%s, %d steps, master %.4f)\n",
              (*session)->transport_name().c_str(), steps, master[0]);
  return 0;
}
