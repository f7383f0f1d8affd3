// ztier._C: the Python binding of libztier (client/ztier.h) and of the CPU
// AdamW kernel (cpu_adam/adamw.h), written with nanobind. The user API
// (ztier.torch) is Python on top of it; this module only translates.
//
// Buffers cross to Python as DLPack tensors (nanobind ndarrays in PyTorch's
// framework, so torch is imported by nanobind at the first one; no torch
// header is needed here), zero-copy: a unit's params from Runner.acquire and
// its grad buffer from Runner.grad_buffer are views of the runner's device
// memory, kept owned by the runner object; they are valid until the unit is
// released (params) or pushed (grads), which the Python caller enforces.
//
// Thread safety: as client/ztier.h; every call that may block (opening,
// registering, acquiring, stepping, checkpoints, the AdamW kernel) releases
// the GIL. Failure: every Status error raises ztier.ZtierError's subclass for
// its code (InvalidArgumentError, NotFoundError, ...), carrying the message.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "client/ztier.h"
#include "common/log.h"
#include "common/status.h"
#include "cpu_adam/adamw.h"
#include "engine/daemon.h"
#include "engine/seqpacket.h"
#include "engine/settings.h"

extern char** environ;

namespace ztier::python {
namespace {

namespace nb = nanobind;
using namespace nb::literals;

// ------------------------------------------------------------------ errors --

// A Status error on its way to Python (translated by the translator below).
class StatusError : public std::runtime_error {
 public:
  explicit StatusError(const Status& s) : std::runtime_error(s.ToString()), code_(s.code()) {}
  StatusCode code() const { return code_; }

 private:
  StatusCode code_;
};

constexpr int kCodes = static_cast<int>(StatusCode::kLast) + 1;
std::array<PyObject*, kCodes> g_error_types{};  // by StatusCode; [0] is ZtierError

void Check(const Status& s) {
  if (!s.ok()) throw StatusError(s);
}
template <class T>
T Value(Result<T>&& r) {
  if (!r.ok()) throw StatusError(r.status());
  return std::move(r).value();
}

// "invalid_argument" -> "InvalidArgumentError", "io_error" -> "IoError".
std::string ErrorClassName(StatusCode code) {
  std::string out;
  bool upper = true;
  for (char c : StatusCodeName(code)) {
    if (c == '_') {
      upper = true;
      continue;
    }
    out += upper ? static_cast<char>(c - 'a' + 'A') : c;
    upper = false;
  }
  return out.ends_with("Error") ? out : out + "Error";  // io_error -> IoError
}

void DefineErrors(nb::module_& m) {
  PyObject* base = PyErr_NewExceptionWithDoc("ztier._C.ZtierError",
                                             "An error reported by ztier; `code` names its kind.",
                                             PyExc_RuntimeError, nullptr);
  PyObject_SetAttrString(base, "code", nb::str("unknown").ptr());
  m.attr("ZtierError") = nb::handle(base);
  g_error_types[0] = base;
  for (int c = 1; c < kCodes; ++c) {
    const auto code = static_cast<StatusCode>(c);
    const std::string name = ErrorClassName(code);
    // Python's own exception for the same kind of mistake is a base too, so
    // `except ValueError` / `except FileNotFoundError`-style code works.
    PyObject* builtin = nullptr;
    if (code == StatusCode::kInvalidArgument) builtin = PyExc_ValueError;
    if (code == StatusCode::kNotFound) builtin = PyExc_LookupError;
    if (code == StatusCode::kOutOfRange) builtin = PyExc_IndexError;
    if (code == StatusCode::kIoError) builtin = PyExc_OSError;
    if (code == StatusCode::kUnavailable) builtin = PyExc_TimeoutError;
    if (code == StatusCode::kPermissionDenied) builtin = PyExc_PermissionError;
    PyObject* bases = builtin ? PyTuple_Pack(2, base, builtin) : PyTuple_Pack(1, base);
    PyObject* type = PyErr_NewException(("ztier._C." + name).c_str(), bases, nullptr);
    Py_DECREF(bases);
    PyObject_SetAttrString(type, "code", nb::str(std::string(StatusCodeName(code)).c_str()).ptr());
    m.attr(name.c_str()) = nb::handle(type);
    g_error_types[c] = type;
  }
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const StatusError& e) {
      const int c = static_cast<int>(e.code());
      PyErr_SetString(g_error_types[c > 0 && c < kCodes ? c : 0], e.what());
    }
  });
}

// --------------------------------------------------------------- buffers --

constexpr nb::dlpack::dtype kBf16{static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
using Tensor = nb::ndarray<nb::pytorch>;
// Any C-contiguous CPU array (dtype checked at run time).
using HostArray = nb::ndarray<nb::c_contig, nb::device::cpu>;
using FloatArray = nb::ndarray<float, nb::c_contig, nb::device::cpu>;

bool IsBf16(const HostArray& a) { return a.dtype() == kBf16; }

// A one-dimensional torch tensor over `count` bf16 values at `ptr` on the
// device, owned by `owner` (the Python object that keeps it valid).
Tensor DeviceTensor(const void* ptr, uint64_t count, const client::Device& device,
                    nb::handle owner) {
  const size_t shape[1] = {static_cast<size_t>(count)};
  const bool cuda = device.kind() == client::DeviceKind::kCuda;
  return Tensor(const_cast<void*>(ptr), 1, shape, owner, nullptr, kBf16,
                cuda ? nb::device::cuda::value : nb::device::cpu::value,
                cuda ? device.ordinal() : 0);
}

// ---------------------------------------------------------------- specs --

engine::Tier ParseTier(const std::string& s, const char* what) {
  if (s == "dram" || s == "cpu") return engine::Tier::kDram;
  if (s == "nvme") return engine::Tier::kNvme;
  throw StatusError(
      Status::InvalidArgument(StrCat(what, " must be 'dram' (or 'cpu') or 'nvme', got '", s, "'")));
}

// A unit as Python gives it: (name, [(tensor name, shape, group, frozen)]).
using TensorTuple = std::tuple<std::string, std::vector<int64_t>, uint32_t, bool>;
using UnitTuple = std::pair<std::string, std::vector<TensorTuple>>;

struct OptimizerArgs {
  float lr = 1e-3f;
  double beta1 = 0.9, beta2 = 0.999;  // Python's floats, as PyTorch takes them
  float eps = 1e-8f, weight_decay = 0.0f;
  std::string mode = "adamw";
  bool bias_correction = true;
  std::vector<float> group_weight_decay;
  float clip_norm = 0.0f;
  int grad_accumulation = 1;
  bool eager = false;
};

cpu_adam::Hyper MakeHyper(float lr, double beta1, double beta2, float eps, float weight_decay,
                          const std::string& mode, bool bias_correction) {
  cpu_adam::Hyper h;
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  h.weight_decay = weight_decay;
  if (mode == "adamw") {
    h.mode = cpu_adam::Mode::kAdamW;
  } else if (mode == "adam") {
    h.mode = cpu_adam::Mode::kAdam;
  } else {
    throw StatusError(
        Status::InvalidArgument(StrCat("mode must be 'adamw' or 'adam', got '", mode, "'")));
  }
  h.bias_correction =
      bias_correction ? cpu_adam::BiasCorrection::kOn : cpu_adam::BiasCorrection::kOff;
  return h;
}

client::Session::ModelSpec MakeSpec(const std::string& name, const std::vector<UnitTuple>& units,
                                    const OptimizerArgs& o, const std::string& states,
                                    const std::string& params, int world_size, uint64_t launch) {
  client::Session::ModelSpec spec;
  spec.name = name;
  for (const auto& [unit_name, tensors] : units) {
    engine::UnitSpec u{.name = unit_name, .tensors = {}};
    for (const auto& [tensor_name, shape, group, frozen] : tensors) {
      u.tensors.push_back(engine::TensorSpec{
          .name = tensor_name, .shape = shape, .group = group, .frozen = frozen});
    }
    spec.units.push_back(std::move(u));
  }
  spec.optimizer.hyper =
      MakeHyper(o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.mode, o.bias_correction);
  spec.optimizer.group_weight_decay = o.group_weight_decay;
  spec.optimizer.clip_norm = o.clip_norm;
  spec.optimizer.grad_accumulation = o.grad_accumulation;
  spec.optimizer.mode = o.eager ? engine::StepMode::kEager : engine::StepMode::kExact;
  spec.optimizer_tier = ParseTier(states, "states");
  spec.param_tier = ParseTier(params, "params");
  spec.world_size = world_size;
  spec.launch = launch;
  return spec;
}

std::chrono::milliseconds Millis(double seconds) {
  if (!(seconds >= 0)) {
    throw StatusError(Status::InvalidArgument(StrCat("timeout ", seconds, " s is not >= 0")));
  }
  // Past what milliseconds hold (inf included): a wait for ever (the
  // client cuts it to the longest wait ztierd takes).
  if (seconds * 1000.0 >= 0x1p63) return engine::kForeverWait;
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

// ------------------------------------------------------------- wrappers --

// The cpu_adam Executor the binding's direct kernel calls share (made on
// first use with all physical cores).
cpu_adam::Executor& SharedExecutor() {
  static cpu_adam::Executor* executor = [] {
    return new cpu_adam::Executor(Value(cpu_adam::Executor::Create({})));
  }();
  return *executor;
}

// Throws OutOfRangeError unless `unit` is one of the model's.
void CheckUnit(const client::Model& model, int unit) {
  if (unit < 0 || unit >= model.units()) {
    throw StatusError(Status::OutOfRange(StrCat("model '", model.spec().name, "' has no unit ",
                                                unit, " (it has ", model.units(), ")")));
  }
}

// ztierd's service hosted by this process: the engine and a thread serving
// the socket, for ranks in other processes of one node (torchrun) when no
// shared ztierd is running. Stopped (clients told) and joined when closed.
class HostedDaemon {
 public:
  HostedDaemon(const engine::Settings& settings, const std::string& socket, mode_t mode) {
    daemon_ = Value(engine::Daemon::Create(settings, engine::DaemonOptions{}));
    listener_ = std::make_unique<engine::SeqPacketListener>(
        Value(engine::SeqPacketListener::Listen(socket, mode)));
    thread_ = std::thread([this] {
      const Status s = daemon_->Serve(*listener_);
      if (!s.ok()) {
        ZT_LOG(kError, "ztierd") << "serving stopped: " << s;
      }
    });
  }
  ~HostedDaemon() { Close(); }
  // Idempotent, and safe from two threads at once (the GIL is released):
  // the second waits for the first and finds it done.
  void Close() {
    std::lock_guard<std::mutex> lock(close_mu_);
    if (!thread_.joinable()) return;
    daemon_->Stop("the process hosting ztierd closed it");
    thread_.join();
    (void)listener_->Close();
  }
  nb::dict Stats() const {
    const engine::DaemonStats st = daemon_->stats();
    nb::dict d;
    d["connections"] = st.connections;
    d["jobs"] = st.jobs;
    d["requests"] = st.requests;
    d["refused"] = st.refused;
    return d;
  }

 private:
  std::unique_ptr<engine::Daemon> daemon_;
  std::unique_ptr<engine::SeqPacketListener> listener_;
  std::mutex close_mu_;
  std::thread thread_;
};

engine::Settings SettingsFrom(const std::optional<std::string>& config,
                              const std::map<std::string, std::string>& set) {
  engine::Settings settings;
  if (config) settings = Value(engine::LoadSettings(*config));
  settings = Value(engine::ApplyEnvironment(settings, environ));
  for (const auto& [key, text] : set) {
    settings = Value(engine::ApplySetting(settings, key, text, StrCat("settings['", key, "']")));
  }
  Check(engine::Validate(settings));
  return settings;
}

struct PyDevice {
  std::unique_ptr<client::Device> device;
};
struct PyCollectives {
  std::unique_ptr<client::Collectives> collectives;
};
struct PyRunner {
  std::unique_ptr<client::Stage3Runner> runner;
  client::Device* device = nullptr;
  const client::Model* model = nullptr;

  uint64_t Padded(int unit) const {
    CheckUnit(*model, unit);
    return model->layout(unit).padded;
  }
};

nb::dict CountersDict(const engine::JobCounters& c) {
  nb::dict d;
  d["steps"] = c.steps;
  d["skipped_steps"] = c.skipped_steps;
  d["optimizer_seconds"] = c.optimizer_seconds;
  d["stall_seconds"] = c.stall_seconds;
  d["last_grad_norm"] = c.last_grad_norm;
  d["compute_seconds"] = c.compute_seconds;
  d["io_wait_seconds"] = c.io_wait_seconds;
  d["dram_bytes"] = c.dram_bytes;
  d["nvme_bytes"] = c.nvme_bytes;
  d["grad_bytes_in"] = c.grad_bytes_in;
  d["nvme_read_bytes"] = c.nvme_read_bytes;
  d["nvme_write_bytes"] = c.nvme_write_bytes;
  d["nvme_param_read_bytes"] = c.nvme_param_read_bytes;
  return d;
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "ztier's C++ client (Session, Model, Stage3Runner) and CPU AdamW kernel";
  nb::set_leak_warnings(false);  // objects in cycles may outlive the interpreter's last GC
  DefineErrors(m);
  using client::Model;
  using client::Session;

  // ---- devices and collectives
  nb::class_<PyDevice>(m, "Device", "A device backend: the host ('cpu') or a CUDA device.")
      .def_prop_ro("kind",
                   [](const PyDevice& d) {
                     return d.device->kind() == client::DeviceKind::kCuda ? "cuda" : "cpu";
                   })
      .def_prop_ro("name", [](const PyDevice& d) { return d.device->name(); })
      .def_prop_ro("ordinal", [](const PyDevice& d) { return d.device->ordinal(); })
      .def(
          "memory",
          [](const PyDevice& d, const std::string& purpose) {
            client::MemoryPurpose p = client::MemoryPurpose::kOther;
            if (purpose == "params") {
              p = client::MemoryPurpose::kParams;
            } else if (purpose == "grads") {
              p = client::MemoryPurpose::kGrads;
            } else if (purpose != "other") {
              throw StatusError(Status::InvalidArgument(
                  StrCat("purpose must be params, grads or other, got '", purpose, "'")));
            }
            const client::MemoryStats s = d.device->memory(p);
            return std::make_pair(s.bytes, s.high_water);
          },
          "purpose"_a, "(bytes, high_water) the runner holds on the device for a purpose.")
      .def(
          "synchronize",
          [](PyDevice& d) {
            Check(d.device->Synchronize(client::Stream::kCompute));
            Check(d.device->Synchronize(client::Stream::kCopy));
          },
          nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("compute_stream", [](const PyDevice& d) {
        return reinterpret_cast<uintptr_t>(d.device->native_stream(client::Stream::kCompute));
      });
  m.def(
      "host_device", [] { return PyDevice{Value(client::MakeHostDevice())}; },
      "The host backend: device memory is host memory; copies run on a thread of their own.");
  m.def(
      "cuda_device", [](int ordinal) { return PyDevice{Value(client::MakeCudaDevice(ordinal))}; },
      "ordinal"_a, nb::call_guard<nb::gil_scoped_release>(),
      "The CUDA backend on device `ordinal` (UnavailableError without CUDA or a device).");
  m.def("cuda_device_count", &client::CudaDeviceCount);

  nb::class_<PyCollectives>(m, "Collectives", "One rank's collectives among a job's ranks.")
      .def_prop_ro("rank", [](const PyCollectives& c) { return c.collectives->rank(); })
      .def_prop_ro("world_size",
                   [](const PyCollectives& c) { return c.collectives->world_size(); });

  // ---- sessions and models
  nb::class_<Model>(m, "Model", "A registered (or attached) model: an engine job.")
      .def_prop_ro("name", [](const Model& model) { return model.spec().name; })
      .def_prop_ro("units", &Model::units)
      .def_prop_ro("world_size", [](const Model& model) { return model.spec().world_size; })
      .def_prop_ro("attached_rank", &Model::attached_rank)
      .def(
          "unit_name",
          [](const Model& model, int unit) {
            CheckUnit(model, unit);
            return model.spec().units[unit].name;
          },
          "unit"_a)
      .def(
          "layout",
          [](const Model& model, int unit) {
            CheckUnit(model, unit);
            const engine::UnitLayout& l = model.layout(unit);
            return std::make_tuple(l.numel, l.padded, l.shard, l.offsets);
          },
          "unit"_a, "(numel, padded, shard, offsets of each tensor) of a unit's flat buffer.")
      .def(
          "set_weights",
          [](Model& model, int unit, FloatArray flat) {
            const float* data = flat.data();
            const uint64_t n = flat.size();
            nb::gil_scoped_release release;
            Check(model.SetWeights(unit, data, n));
          },
          "unit"_a, "flat"_a, "Initial fp32 weights of a unit (its numel), published as step 0.")
      .def(
          "read_master",
          [](const Model& model, int unit, FloatArray out) {
            CheckUnit(model, unit);
            if (out.size() != model.layout(unit).padded) {
              throw StatusError(Status::InvalidArgument(
                  StrCat("read_master: unit ", unit, " has ", model.layout(unit).padded,
                         " padded elements, the array ", out.size())));
            }
            std::vector<float> master;
            {
              nb::gil_scoped_release release;
              Check(model.ReadMaster(unit, &master));
            }
            std::memcpy(out.data(), master.data(), master.size() * sizeof(float));
          },
          // noconvert: `out` is written, so a float64 or strided tensor must be
          // refused, not silently converted into a temporary copy.
          "unit"_a, "out"_a.noconvert(),
          "Copies a unit's fp32 master weights (padded) into `out` (float32, contiguous).")
      .def(
          "set_learning_rates",
          [](Model& model, const std::vector<float>& lrs) { Check(model.SetLearningRates(lrs)); },
          "lrs"_a, nb::call_guard<nb::gil_scoped_release>(),
          "One lr per param group, for the next step that starts.")
      .def(
          "import_safetensors",
          [](Model& model, const std::string& path) { Check(model.ImportSafetensors(path)); },
          "path"_a, nb::call_guard<nb::gil_scoped_release>())
      .def(
          "export_safetensors",
          [](Model& model, const std::string& path, const std::string& dtype) {
            engine::ExportType type = engine::ExportType::kBFloat16;
            if (dtype == "float32" || dtype == "fp32") {
              type = engine::ExportType::kFloat32;
            } else if (dtype != "bfloat16" && dtype != "bf16") {
              throw StatusError(Status::InvalidArgument(
                  StrCat("dtype must be 'bfloat16' or 'float32', got '", dtype, "'")));
            }
            nb::gil_scoped_release release;
            Check(model.ExportSafetensors(path, type));
          },
          "path"_a, "dtype"_a = "bfloat16")
      .def(
          "claim_checkpoint_dir",
          [](Model& model, const std::string& dir, bool until_closed) {
            Check(model.ClaimCheckpointDir(dir, until_closed));
          },
          "dir"_a, "until_closed"_a = true, nb::call_guard<nb::gil_scoped_release>())
      .def(
          "save_checkpoint",
          [](Model& model, const std::string& dir) { Check(model.SaveCheckpoint(dir)); }, "dir"_a,
          nb::call_guard<nb::gil_scoped_release>())
      .def(
          "load_checkpoint",
          [](Model& model, const std::string& dir) { Check(model.LoadCheckpoint(dir)); }, "dir"_a,
          nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("published_step",
                   [](const Model& model) {
                     nb::gil_scoped_release unlocked;  // a round trip to ztierd per unit
                     return model.published_step();
                   })
      .def(
          "wait_published",
          [](const Model& model, int64_t step, double timeout) {
            Check(model.WaitPublished(step, Millis(timeout)));
          },
          "step"_a, "timeout"_a = 600.0, nb::call_guard<nb::gil_scoped_release>())
      .def("counters", [](const Model& model) {
        Result<engine::JobCounters> counters = [&] {
          nb::gil_scoped_release unlocked;  // a round trip to ztierd
          return model.counters();
        }();
        return CountersDict(Value(std::move(counters)));
      });

  nb::class_<OptimizerArgs>(m, "OptimizerConfig", "The engine's optimizer for a model.")
      .def(
          "__init__",
          [](OptimizerArgs* o, float lr, double beta1, double beta2, float eps, float weight_decay,
             const std::string& mode, bool bias_correction,
             const std::vector<float>& group_weight_decay, float clip_norm, int grad_accumulation,
             bool eager) {
            new (o) OptimizerArgs{.lr = lr,
                                  .beta1 = beta1,
                                  .beta2 = beta2,
                                  .eps = eps,
                                  .weight_decay = weight_decay,
                                  .mode = mode,
                                  .bias_correction = bias_correction,
                                  .group_weight_decay = group_weight_decay,
                                  .clip_norm = clip_norm,
                                  .grad_accumulation = grad_accumulation,
                                  .eager = eager};
          },
          nb::kw_only(), "lr"_a = 1e-3f, "beta1"_a = 0.9, "beta2"_a = 0.999, "eps"_a = 1e-8f,
          "weight_decay"_a = 0.0f, "mode"_a = "adamw", "bias_correction"_a = true,
          "group_weight_decay"_a = std::vector<float>{}, "clip_norm"_a = 0.0f,
          "grad_accumulation"_a = 1, "eager"_a = false)
      .def_ro("lr", &OptimizerArgs::lr)
      .def_ro("clip_norm", &OptimizerArgs::clip_norm)
      .def_ro("grad_accumulation", &OptimizerArgs::grad_accumulation)
      .def_ro("group_weight_decay", &OptimizerArgs::group_weight_decay);

  nb::class_<Session>(m, "Session",
                      "The engine: embedded in this process, or ztierd through its socket.",
                      nb::is_weak_referenceable())
      .def_static(
          "open",
          [](const std::optional<std::string>& config,
             const std::map<std::string, std::string>& set, const std::string& daemon_socket,
             bool daemon_has_these_settings) {
            const engine::Settings settings = SettingsFrom(config, set);
            client::SessionOptions options{.settings = settings,
                                           .daemon_socket = daemon_socket,
                                           .io_backend = nullptr,
                                           .daemon_has_these_settings = daemon_has_these_settings};
            nb::gil_scoped_release release;
            return Value(Session::Open(options));
          },
          "config"_a = nb::none(), "settings"_a = std::map<std::string, std::string>{},
          "daemon_socket"_a = "", "daemon_has_these_settings"_a = false,
          "Opens the engine. `config`: a ds_config JSON file; `settings`: {key: value} of the "
          "config's dotted keys, as text; ZTIER_* variables apply in between. "
          "`daemon_has_these_settings`: the ztierd at `daemon_socket` was made with them (no "
          "warning that its own apply).")
      .def_prop_ro("transport", &Session::transport_name)
      .def_prop_ro(
          "health",
          [](const Session& s) {
            const Status st = s.Health();
            return st.ok() ? std::string() : st.ToString();
          },
          "'' while the session serves; else why not (its ztierd gone, a forked child).")
      .def_prop_ro("default_optimizer_tier",
                   [](const Session& s) {
                     return s.settings().optimizer_tier == engine::Tier::kNvme ? "nvme" : "dram";
                   })
      .def_prop_ro("default_param_tier",
                   [](const Session& s) {
                     return s.settings().param_tier == engine::Tier::kNvme ? "nvme" : "dram";
                   })
      .def_prop_ro("prefetch_depth", [](const Session& s) { return s.settings().prefetch_depth; })
      .def_prop_ro("wait_timeout",
                   [](const Session& s) { return double(s.settings().wait_timeout_seconds); })
      .def_prop_ro("coalesce_bytes", [](const Session& s) { return s.settings().coalesce_bytes; })
      .def_prop_ro(
          "max_live_bytes",
          [](const Session& s) { return client::RunnerOptionsFrom(s.settings()).max_live_bytes; },
          "The cap on the bf16 params a rank keeps on its device, in bytes "
          "(zero_optimization.stage3_max_live_parameters x 2; 0: none).")
      .def_prop_ro(
          "persistence_threshold",
          [](const Session& s) {
            return client::RunnerOptionsFrom(s.settings()).persistence_threshold;
          },
          "Units of at most this many bytes of bf16 params stay on the device once fetched "
          "(zero_optimization.stage3_param_persistence_threshold x 2).")
      .def_prop_ro(
          "training",
          [](const Session& s) {
            // What the config and the variables set of the training settings
            // (DeepSpeed's optimizer, clipping, accumulation): unset ones are
            // left out, for the program's own defaults.
            const engine::TrainingSettings& t = s.settings().training;
            nb::dict d;
            if (t.optimizer_type) d["optimizer_type"] = *t.optimizer_type;
            if (t.adam_w_mode) d["adam_w_mode"] = *t.adam_w_mode;
            if (t.lr) d["lr"] = *t.lr;
            if (t.beta1) d["beta1"] = *t.beta1;
            if (t.beta2) d["beta2"] = *t.beta2;
            if (t.eps) d["eps"] = *t.eps;
            if (t.weight_decay) d["weight_decay"] = *t.weight_decay;
            if (t.bias_correction) d["bias_correction"] = *t.bias_correction;
            if (t.clip_norm) d["clip_norm"] = *t.clip_norm;
            if (t.grad_accumulation) d["grad_accumulation"] = *t.grad_accumulation;
            if (t.micro_batch) d["micro_batch"] = *t.micro_batch;
            if (t.train_batch) d["train_batch"] = *t.train_batch;
            if (t.activation_checkpointing) {
              d["activation_checkpointing"] = *t.activation_checkpointing;
            }
            return d;
          },
          "The training settings the config file and ZTIER_* variables set (optimizer type and "
          "params, gradient_clipping, gradient_accumulation_steps, the batch sizes, "
          "activation_checkpointing); unset ones are absent.")
      .def(
          "register_model",
          [](Session& s, const std::string& name, const std::vector<UnitTuple>& units,
             const OptimizerArgs& optimizer, const std::string& states, const std::string& params,
             int world_size, uint64_t launch) {
            const Session::ModelSpec spec =
                MakeSpec(name, units, optimizer, states, params, world_size, launch);
            nb::gil_scoped_release release;
            return Value(s.RegisterModel(spec));
          },
          "name"_a, "units"_a, "optimizer"_a, "states"_a = "dram", "params"_a = "dram",
          "world_size"_a = 1, "launch"_a = 0, nb::keep_alive<0, 1>(),
          "Registers a model: units in forward order, each (name, [(tensor name, shape, group, "
          "frozen)]). `launch`: a nonzero value the other ranks attach with (0: not checked).")
      .def(
          "attach_model",
          [](Session& s, const std::string& name, const std::vector<UnitTuple>& units,
             const OptimizerArgs& optimizer, const std::string& states, const std::string& params,
             int world_size, int rank, double timeout, uint64_t launch) {
            const Session::ModelSpec spec =
                MakeSpec(name, units, optimizer, states, params, world_size, launch);
            const auto wait = Millis(timeout);
            nb::gil_scoped_release release;
            return Value(s.AttachModel(spec, rank, wait));
          },
          "name"_a, "units"_a, "optimizer"_a, "states"_a = "dram", "params"_a = "dram",
          "world_size"_a = 1, "rank"_a = 1, "timeout"_a = 600.0, "launch"_a = 0,
          nb::keep_alive<0, 1>(),
          "Joins, as `rank`, the model rank 0 registers under `name` through the same ztierd; a "
          "nonzero `launch` must be the one rank 0 registered with.");

  nb::class_<HostedDaemon>(m, "HostedDaemon",
                           "ztierd's service hosted by this process (engine and socket).")
      .def(
          "__init__",
          [](HostedDaemon* d, const std::string& socket, const std::optional<std::string>& config,
             const std::map<std::string, std::string>& set, int mode) {
            const engine::Settings settings = SettingsFrom(config, set);
            nb::gil_scoped_release release;
            new (d) HostedDaemon(settings, socket, static_cast<mode_t>(mode));
          },
          "socket"_a, "config"_a = nb::none(), "settings"_a = std::map<std::string, std::string>{},
          "mode"_a = 0600,
          "Starts serving `socket` (created; mode 0600: this uid only) with an engine of these "
          "settings.")
      .def("close", &HostedDaemon::Close, nb::call_guard<nb::gil_scoped_release>(),
           "Tells the clients and stops serving (idempotent).")
      .def("stats", &HostedDaemon::Stats);

  m.def(
      "job_collectives",
      [](Model& model, int rank, PyDevice& device, double timeout) {
        const auto wait = Millis(timeout);
        nb::gil_scoped_release release;
        return PyCollectives{Value(client::MakeJobCollectives(model, rank, *device.device, wait))};
      },
      "model"_a, "rank"_a, "device"_a, "timeout"_a = 600.0, nb::keep_alive<0, 3>(),
      "Rank `rank`'s collectives among the ranks of the model's job (shared memory on the host, "
      "NCCL on CUDA); a rank that waits for its peers over `timeout` seconds gives up, and its "
      "peers stop too.");

  // ---- the stage-3 runner
  nb::class_<PyRunner>(m, "Runner", "One rank's stage-3 driver (client::Stage3Runner).")
      .def(
          "__init__",
          [](PyRunner* r, Model& model, int rank, PyDevice& device, PyCollectives* collectives,
             int prefetch_depth, uint64_t max_live_bytes, uint64_t persistence_threshold,
             uint64_t coalesce_bytes, double timeout) {
            client::RunnerOptions options{
                .prefetch_depth = prefetch_depth,
                .max_live_bytes = max_live_bytes,
                .persistence_threshold = persistence_threshold,
                .coalesce_bytes = coalesce_bytes,
                .timeout = Millis(timeout),
                .record_compute_spans = false,
            };
            std::unique_ptr<client::Stage3Runner> runner;
            {
              nb::gil_scoped_release release;
              runner = Value(client::Stage3Runner::Create(
                  model, rank, *device.device,
                  collectives ? collectives->collectives.get() : nullptr, options));
            }
            new (r) PyRunner{std::move(runner), device.device.get(), &model};
          },
          "model"_a, "rank"_a, "device"_a, "collectives"_a = nb::none(), "prefetch_depth"_a = 2,
          "max_live_bytes"_a = 0, "persistence_threshold"_a = 0,
          "coalesce_bytes"_a = client::RunnerOptions{}.coalesce_bytes, "timeout"_a = 600.0,
          nb::keep_alive<1, 2>(), nb::keep_alive<1, 4>(), nb::keep_alive<1, 5>())
      .def(
          "acquire",
          [](nb::handle self, int unit) {
            PyRunner& r = nb::cast<PyRunner&>(self);
            const uint64_t padded = r.Padded(unit);
            const bf16* p;
            {
              nb::gil_scoped_release release;
              p = Value(r.runner->Acquire(unit));
            }
            return DeviceTensor(p, padded, *r.device, self);
          },
          "unit"_a,
          "The unit's full bf16 params (padded, flat) on the device, at the version this "
          "micro-step reads: a tensor valid until release(unit) (read-only).")
      .def(
          "release",
          [](PyRunner& r, int unit) {
            nb::gil_scoped_release release;
            Check(r.runner->Release(unit));
          },
          "unit"_a)
      .def(
          "grad_buffer",
          [](nb::handle self, int unit) {
            PyRunner& r = nb::cast<PyRunner&>(self);
            const uint64_t padded = r.Padded(unit);
            bf16* p = Value(r.runner->GradBuffer(unit));
            return DeviceTensor(p, padded, *r.device, self);
          },
          "unit"_a,
          "A zeroed bf16 device buffer for the unit's grads (padded, flat), to fill before "
          "push_grads(unit); not to be touched after it.")
      .def(
          "push_grads",
          [](PyRunner& r, int unit) {
            nb::gil_scoped_release release;
            Check(r.runner->PushGrads(unit));
          },
          "unit"_a, "Sends the unit's grad buffer (filled by grad_buffer's tensor) to the engine.")
      .def(
          "step",
          [](PyRunner& r) {
            nb::gil_scoped_release release;
            Check(r.runner->Step());
          },
          "Ends the micro-step (every grad of it pushed).")
      .def(
          "release_all",
          [](PyRunner& r) {
            nb::gil_scoped_release release;
            return Value(r.runner->ReleaseAll());
          },
          "Releases every unit held (the cleanup of a pass interrupted between an acquire and "
          "its release). Returns the releases made.")
      .def(
          "abort_step",
          [](PyRunner& r) {
            nb::gil_scoped_release release;
            return Value(r.runner->AbortStep());
          },
          "After a backward pass that failed once some grads were pushed: the engine drops every "
          "grad delivered since the last optimizer step, and the next micro-step starts that "
          "step afresh at the same version. Returns the micro-steps discarded whole.")
      .def(
          "set_order",
          [](PyRunner& r, int key) {
            nb::gil_scoped_release release;
            Check(r.runner->SetOrder(key));
          },
          "key"_a,
          "The kind of pass the next acquires belong to (0: training, ended by step(); others: "
          "a new pass of that kind), each with a learned order of its own.")
      .def_prop_ro("order_key", [](const PyRunner& r) { return r.runner->order_key(); })
      .def_prop_ro("version", [](const PyRunner& r) { return r.runner->version(); })
      .def_prop_ro("learned_order", [](const PyRunner& r) { return r.runner->learned_order(); })
      .def("stats", [](const PyRunner& r) {
        const client::RunnerStats s = r.runner->stats();
        nb::dict d;
        d["micro_steps"] = s.micro_steps;
        d["fetches"] = s.fetches;
        d["prefetch_hits"] = s.prefetch_hits;
        d["order_changes"] = s.order_changes;
        d["prefetches_refused"] = s.prefetches_refused;
        d["h2d_bytes"] = s.h2d_bytes;
        d["d2h_bytes"] = s.d2h_bytes;
        d["h2d_copies"] = s.h2d_copies;
        d["d2h_copies"] = s.d2h_copies;
        d["acquire_wait_seconds"] = s.acquire_wait_seconds;
        d["step_wait_seconds"] = s.step_wait_seconds;
        d["wait_optimizer_seconds"] = s.wait_optimizer_seconds;
        d["wait_h2d_seconds"] = s.wait_h2d_seconds;
        d["wait_d2h_seconds"] = s.wait_d2h_seconds;
        d["wait_collective_seconds"] = s.wait_collective_seconds;
        return d;
      });

  // ---- the CPU AdamW kernel, for exact references
  m.def(
      "adamw_step",
      [](FloatArray params, HostArray grads, FloatArray exp_avg, FloatArray exp_avg_sq,
         int64_t step, float lr, double beta1, double beta2, float eps, float weight_decay,
         const std::string& mode, bool bias_correction, float grad_scale,
         std::optional<HostArray> params_out) {
        const size_t n = params.size();
        const bool bf16_grads = IsBf16(grads);
        if (!bf16_grads && grads.dtype() != nb::dtype<float>()) {
          throw StatusError(Status::InvalidArgument("grads must be float32 or bfloat16"));
        }
        if (grads.size() != n || exp_avg.size() != n || exp_avg_sq.size() != n ||
            (params_out && params_out->size() != n)) {
          throw StatusError(
              Status::InvalidArgument(StrCat("adamw_step: params has ", n,
                                             " elements; grads, exp_avg, exp_avg_sq and "
                                             "params_out must too")));
        }
        if (params_out && !IsBf16(*params_out)) {
          throw StatusError(Status::InvalidArgument("params_out must be bfloat16"));
        }
        const cpu_adam::Hyper hyper =
            MakeHyper(lr, beta1, beta2, eps, weight_decay, mode, bias_correction);
        const cpu_adam::StepOptions options{.step = step,
                                            .grad_scale = grad_scale,
                                            .grad_check = cpu_adam::GradCheck::kScanFirst,
                                            .want_grad_sq_sum = true,
                                            .output_store = cpu_adam::OutputStore::kStreaming};
        const cpu_adam::Shard shard{
            .count = n,
            .grads = grads.data(),
            .grad_type = bf16_grads ? cpu_adam::GradType::kBFloat16 : cpu_adam::GradType::kFloat32,
            .params = params.data(),
            .exp_avg = exp_avg.data(),
            .exp_avg_sq = exp_avg_sq.data(),
            .params_out = params_out ? static_cast<bf16*>(params_out->data()) : nullptr};
        cpu_adam::StepResult result;
        {
          nb::gil_scoped_release release;
          result = Value(cpu_adam::Step(hyper, options, shard, SharedExecutor()));
        }
        return std::make_pair(result.skipped, result.grad_sq_sum);
      },
      // noconvert: the arrays updated in place must be the caller's own.
      "params"_a.noconvert(), "grads"_a, "exp_avg"_a.noconvert(), "exp_avg_sq"_a.noconvert(),
      nb::kw_only(), "step"_a, "lr"_a, "beta1"_a = 0.9, "beta2"_a = 0.999, "eps"_a = 1e-8f,
      "weight_decay"_a = 0.0f, "mode"_a = "adamw", "bias_correction"_a = true,
      "grad_scale"_a = 1.0f, "params_out"_a.noconvert() = nb::none(),
      "ztier's fused AdamW on one shard, in place (the engine's kernel). Returns (skipped, "
      "sum of squares of the grads).");
  m.def(
      "squared_norm",
      [](HostArray grads) {
        const bool bf16_grads = IsBf16(grads);
        if (!bf16_grads && grads.dtype() != nb::dtype<float>()) {
          throw StatusError(Status::InvalidArgument("grads must be float32 or bfloat16"));
        }
        const void* data = grads.data();
        const size_t n = grads.size();
        nb::gil_scoped_release release;
        return Value(cpu_adam::SquaredNorm(
            data, bf16_grads ? cpu_adam::GradType::kBFloat16 : cpu_adam::GradType::kFloat32, n,
            SharedExecutor()));
      },
      "grads"_a, "The fp64 sum of squares of float32 or bfloat16 grads (the engine's).");
  m.def("active_target", &cpu_adam::ActiveTarget, "The SIMD target the AdamW kernel runs.");
}

}  // namespace ztier::python
