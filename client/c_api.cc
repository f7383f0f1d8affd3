// libztier's C ABI (client/ztier_c.h) over the C++ API. Every entry point
// catches nothing (the C++ API throws nothing), turns a Status into its code
// and keeps the message in a thread-local for ztier_last_error().
//
// Thread safety: as the C++ objects behind the handles.
#include "client/ztier_c.h"

#include <pthread.h>
#include <unistd.h>

#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "client/ztier.h"
#include "common/utf8.h"
#include "common/version.h"

extern char** environ;

// Handles own their objects jointly where one needs another: a runner
// keeps its model and device alive, so closing them first (a garbage
// collector's order) frees them only once the runner is closed too.
struct ztier_session {
  std::unique_ptr<ztier::client::Session> session;
};
struct ztier_model {
  std::shared_ptr<ztier::client::Model> model;
  ztier::engine::Settings settings;  // its session's: the runner's defaults
};
struct ztier_device {
  std::shared_ptr<ztier::client::Device> device;
};
struct ztier_runner {
  std::shared_ptr<ztier::client::Model> model;
  std::shared_ptr<ztier::client::Device> device;
  std::unique_ptr<ztier::client::Stage3Runner> runner;  // last: goes first
};

namespace {

using ztier::Result;
using ztier::Status;
using ztier::StrCat;

thread_local std::string last_error;

static_assert(static_cast<int>(ztier::StatusCode::kInternal) == ZTIER_INTERNAL);
static_assert(static_cast<int>(ztier::StatusCode::kPermissionDenied) == ZTIER_PERMISSION_DENIED);
static_assert(ztier::StatusCode::kLast == ztier::StatusCode::kPermissionDenied);

ztier_status Report(const Status& s) {
  if (s.ok()) return ZTIER_OK;
  // Paths and names a caller gave may be any bytes: the message is UTF-8
  // (a binding decodes it as such).
  last_error = ztier::PrintableUtf8(s.ToString());
  return static_cast<ztier_status>(s.code());
}

ztier_status Null(const char* what) {
  return Report(Status::InvalidArgument(StrCat(what, " is NULL")));
}

// The handles open now, by kind, so that one closed twice, used after its
// close, or passed where another kind goes (a binding that types every
// handle as void*, two arguments swapped) is an error rather than a double
// free or a read of freed memory or of another type's.
template <typename T>
constexpr const char* kKind = nullptr;
template <>
constexpr const char* kKind<ztier_session> = "ztier_session";
template <>
constexpr const char* kKind<ztier_model> = "ztier_model";
template <>
constexpr const char* kKind<ztier_device> = "ztier_device";
template <>
constexpr const char* kKind<ztier_runner> = "ztier_runner";

// An open handle: its kind and the process that opened it (a forked child
// holds copies of its parent's, which are the parent's to use).
struct OpenHandle {
  const char* kind;
  pid_t pid;
};

std::mutex handles_mu;
std::unordered_map<const void*, OpenHandle>& Handles() {
  // Never destroyed (atexit order). A child forked while another thread
  // held the lock would wait for it forever: the lock is taken around
  // fork() and given back on both sides.
  static auto* open = [] {
    ::pthread_atfork([] { handles_mu.lock(); }, [] { handles_mu.unlock(); },
                     [] { handles_mu.unlock(); });
    return new std::unordered_map<const void*, OpenHandle>;
  }();
  return *open;
}
template <typename T>
T* Opened(T* h) {
  std::unordered_map<const void*, OpenHandle>& open = Handles();
  std::lock_guard<std::mutex> lock(handles_mu);
  open[h] = {kKind<T>, ::getpid()};
  return h;
}
// Null, or not an open handle of its kind: the error for `what`; Ok for an
// open one.
template <typename T>
Status CheckOpen(const T* h, const char* what) {
  if (h == nullptr) return Status::InvalidArgument(StrCat(what, " is NULL"));
  std::unordered_map<const void*, OpenHandle>& open = Handles();
  std::lock_guard<std::mutex> lock(handles_mu);
  auto it = open.find(h);
  if (it == open.end()) {
    return Status::FailedPrecondition(
        StrCat(what, " is not an open handle (used after its close?)"));
  }
  if (it->second.kind != kKind<T>) {
    return Status::FailedPrecondition(StrCat(what, " is an open ", it->second.kind, ", not a ",
                                             kKind<T>, " (arguments swapped?)"));
  }
  if (it->second.pid != ::getpid()) {
    return Status::FailedPrecondition(
        StrCat(what, " was opened by process ", it->second.pid, "; process ", ::getpid(),
               " is a child forked from it, which cannot use its parent's handles (open a "
               "session of its own)"));
  }
  return Status::Ok();
}
// Closes an open handle; a null one is nothing to close, and one that is
// not open (closed twice), or of another kind, is said on stderr and left
// alone.
template <typename T>
void Close(T* h, const char* what) {
  if (h == nullptr) return;
  {
    std::unordered_map<const void*, OpenHandle>& open = Handles();
    std::lock_guard<std::mutex> lock(handles_mu);
    auto it = open.find(h);
    if (it == open.end()) {
      std::fprintf(stderr,
                   "ztier: %s_close of a handle that is not open (closed twice?): ignored\n", what);
      return;
    }
    if (it->second.kind != kKind<T>) {
      std::fprintf(stderr, "ztier: %s_close of an open %s: ignored\n", what, it->second.kind);
      return;
    }
    open.erase(it);
  }
  delete h;
}

// A versioned struct: its struct_size is this library's sizeof(T) or one of
// the `older` sizes it had (each ending after a whole field), never a size
// that would cut a field in two.
template <typename T>
Status CheckStruct(const T* s, const char* what, std::initializer_list<size_t> older = {}) {
  if (s == nullptr) return Status::InvalidArgument(StrCat(what, " is NULL"));
  bool known = s->struct_size == sizeof(T);
  for (size_t size : older) known = known || s->struct_size == size;
  if (!known) {
    std::string sizes = StrCat(sizeof(T));
    for (size_t size : older) sizes = StrCat(size, ", ", sizes);
    return Status::InvalidArgument(StrCat(what, ".struct_size is ", s->struct_size,
                                          "; this libztier knows the sizes ", sizes,
                                          " (set it to sizeof the struct)"));
  }
  return Status::Ok();
}

// Whether a caller's struct of `struct_size` bytes holds `member` whole.
#define ZT_HAS_FIELD(ptr, type, member) \
  ((ptr)->struct_size >= offsetof(type, member) + sizeof((ptr)->member))

// A C float beta as the decimal its caller wrote: the shortest decimal that
// rounds to it, read in double (0.99999f gives 0.99999, not 0.99998999...),
// so 1 - beta comes out as from a double beta.
double ShortestDecimal(float f) {
  char text[32];
  const auto [end, ec] = std::to_chars(text, text + sizeof(text), f);
  double d = f;
  if (ec == std::errc()) std::from_chars(text, end, d);
  return d;
}

}  // namespace

extern "C" {

int ztier_abi_version(void) { return ZTIER_ABI_VERSION; }
const char* ztier_version(void) { return ZTIER_VERSION_STRING; }
const char* ztier_last_error(void) { return last_error.c_str(); }

ztier_status ztier_session_open(const char* config_path, ztier_session** out) {
  ztier_session_options o;
  ztier_session_options_init(&o);
  o.config_path = config_path;
  return ztier_session_open_with(&o, out);
}

void ztier_session_options_init(ztier_session_options* options) {
  if (options == nullptr) return;
  std::memset(options, 0, sizeof(*options));
  options->struct_size = sizeof(*options);
}

ztier_status ztier_session_open_with(const ztier_session_options* options, ztier_session** out) {
  if (out == nullptr) return Null("out");
  ztier_session_options o;
  ztier_session_options_init(&o);
  if (options != nullptr) {
    // Older: before daemon_socket.
    if (Status s = CheckStruct(options, "session options",
                               {offsetof(ztier_session_options, daemon_socket)});
        !s.ok()) {
      return Report(s);
    }
    // An older caller's smaller struct: the fields it lacks keep their defaults.
    std::memcpy(&o, options, options->struct_size);
  }
  const char* config_path = o.config_path;
  ztier::engine::Settings settings;
  if (config_path != nullptr) {
    Result<ztier::engine::Settings> loaded = ztier::engine::LoadSettings(config_path);
    if (!loaded.ok()) return Report(loaded.status());
    settings = *loaded;
  }
  Result<ztier::engine::Settings> env = ztier::engine::ApplyEnvironment(settings, environ);
  if (!env.ok()) return Report(env.status());
  Result<std::unique_ptr<ztier::client::Session>> s = ztier::client::Session::Open(
      {.settings = *env,
       .daemon_socket = o.daemon_socket != nullptr ? o.daemon_socket : "",
       .io_backend = nullptr});
  if (!s.ok()) return Report(s.status());
  *out = Opened(new ztier_session{*std::move(s)});
  return ZTIER_OK;
}

void ztier_session_close(ztier_session* session) { Close(session, "ztier_session"); }

void ztier_model_desc_init(ztier_model_desc* desc) {
  if (desc == nullptr) return;
  std::memset(desc, 0, sizeof(*desc));
  const ztier::cpu_adam::Hyper h;
  desc->struct_size = sizeof(*desc);
  desc->lr = h.lr;
  desc->beta1 = static_cast<float>(h.beta1);
  desc->beta2 = static_cast<float>(h.beta2);
  desc->eps = h.eps;
  desc->weight_decay = h.weight_decay;
  desc->grad_accumulation = 1;
  desc->optimizer_on_nvme = -1;  // the session's (config, ZTIER_* variables)
  desc->params_on_nvme = -1;
  desc->world_size = 1;
}

ztier_status ztier_model_register(ztier_session* session, const ztier_model_desc* desc,
                                  ztier_model** out) {
  if (Status s = CheckOpen(session, "session"); !s.ok()) return Report(s);
  if (out == nullptr) return Null("out");
  if (Status s = CheckStruct(desc, "model desc"); !s.ok()) return Report(s);
  if (desc->struct_size != sizeof(ztier_model_desc)) {
    return Report(
        Status::InvalidArgument("model desc: set struct_size = sizeof(ztier_model_desc)"));
  }
  if (desc->name == nullptr || desc->units == nullptr || desc->num_units <= 0) {
    return Report(Status::InvalidArgument("model desc: name and at least one unit are required"));
  }
  if (desc->world_size != 1) {
    return Report(Status::InvalidArgument(
        StrCat("model '", desc->name, "': world size ", desc->world_size,
               " through the C ABI; it drives one rank (use the C++ API for local ranks)")));
  }
  ztier::client::Session::ModelSpec spec;
  spec.name = desc->name;
  for (int32_t u = 0; u < desc->num_units; ++u) {
    const ztier_unit_desc& ud = desc->units[u];
    if (ud.name == nullptr || (ud.num_tensors > 0 && ud.tensors == nullptr) || ud.num_tensors < 0) {
      return Report(Status::InvalidArgument(
          StrCat("model desc: unit ", u, " has no name or a ", "NULL tensor list")));
    }
    ztier::engine::UnitSpec unit{.name = ud.name, .tensors = {}};
    for (int32_t t = 0; t < ud.num_tensors; ++t) {
      const ztier_tensor_desc& td = ud.tensors[t];
      if (td.name == nullptr || td.ndim < 0 || (td.ndim > 0 && td.shape == nullptr)) {
        return Report(Status::InvalidArgument(
            StrCat("model desc: unit '", ud.name, "' tensor ", t, " has no name or shape")));
      }
      // Before its shape is copied (an ndim near INT32_MAX was a vector of
      // gigabytes, whose bad_alloc ended the process through the C ABI).
      if (static_cast<uint32_t>(td.ndim) > ztier::engine::kMaxDims) {
        return Report(Status::InvalidArgument(StrCat("model desc: unit '", ud.name, "' tensor '",
                                                     td.name, "' has ", td.ndim, " dims; at most ",
                                                     ztier::engine::kMaxDims)));
      }
      unit.tensors.push_back({.name = td.name, .shape = {td.shape, td.shape + td.ndim}});
    }
    spec.units.push_back(std::move(unit));
  }
  spec.optimizer.hyper.lr = desc->lr;
  spec.optimizer.hyper.beta1 = ShortestDecimal(desc->beta1);
  spec.optimizer.hyper.beta2 = ShortestDecimal(desc->beta2);
  spec.optimizer.hyper.eps = desc->eps;
  spec.optimizer.hyper.weight_decay = desc->weight_decay;
  spec.optimizer.clip_norm = desc->clip_norm;
  spec.optimizer.grad_accumulation = desc->grad_accumulation;
  for (const auto& [field, value] : {std::pair{"optimizer_on_nvme", desc->optimizer_on_nvme},
                                     std::pair{"params_on_nvme", desc->params_on_nvme}}) {
    if (value < -1 || value > 1) {
      return Report(Status::InvalidArgument(StrCat("model desc: ", field, " is ", value,
                                                   "; 1 (NVMe), 0 (DRAM) or -1 (the session's)")));
    }
  }
  const ztier::engine::Settings& settings = session->session->settings();
  const auto tier = [](int32_t on_nvme, ztier::engine::Tier session_tier) {
    return on_nvme < 0 ? session_tier
                       : (on_nvme != 0 ? ztier::engine::Tier::kNvme : ztier::engine::Tier::kDram);
  };
  spec.optimizer_tier = tier(desc->optimizer_on_nvme, settings.optimizer_tier);
  spec.param_tier = tier(desc->params_on_nvme, settings.param_tier);
  spec.world_size = 1;
  Result<std::unique_ptr<ztier::client::Model>> m = session->session->RegisterModel(spec);
  if (!m.ok()) return Report(m.status());
  *out = Opened(new ztier_model{*std::move(m), settings});
  return ZTIER_OK;
}

void ztier_model_close(ztier_model* model) { Close(model, "ztier_model"); }

ztier_status ztier_model_unit_layout(const ztier_model* model, int32_t unit, uint64_t* numel,
                                     uint64_t* padded) {
  if (Status s = CheckOpen(model, "model"); !s.ok()) return Report(s);
  if (unit < 0 || unit >= model->model->units()) {
    return Report(Status::OutOfRange(StrCat("model has no unit ", unit)));
  }
  const ztier::engine::UnitLayout& l = model->model->layout(unit);
  if (numel != nullptr) *numel = l.numel;
  if (padded != nullptr) *padded = l.padded;
  return ZTIER_OK;
}

ztier_status ztier_model_set_weights(ztier_model* model, int32_t unit, const float* flat,
                                     uint64_t numel) {
  if (Status s = CheckOpen(model, "model"); !s.ok()) return Report(s);
  if (flat == nullptr) return Null("weights");
  return Report(model->model->SetWeights(unit, flat, numel));
}

ztier_status ztier_model_read_master(const ztier_model* model, int32_t unit, float* out,
                                     uint64_t padded) {
  if (Status s = CheckOpen(model, "model"); !s.ok()) return Report(s);
  if (out == nullptr) return Null("out");
  std::vector<float> master;
  if (Status s = model->model->ReadMaster(unit, &master); !s.ok()) return Report(s);
  if (padded != master.size()) {
    return Report(
        Status::InvalidArgument(StrCat("read master of unit ", unit, ": buffer of ", padded,
                                       " floats, the unit has ", master.size(), " (padded)")));
  }
  std::memcpy(out, master.data(), padded * sizeof(float));
  return ZTIER_OK;
}

ztier_status ztier_model_claim_checkpoint_dir(ztier_model* model, const char* dir) {
  if (Status s = CheckOpen(model, "model"); !s.ok()) return Report(s);
  if (dir == nullptr) return Null("dir");
  return Report(model->model->ClaimCheckpointDir(dir));
}

ztier_status ztier_install_stop_handlers(void) {
  return Report(ztier::client::InstallStopHandlers());
}

int ztier_stop_requested(void) { return ztier::client::StopRequested(); }

ztier_status ztier_model_save_checkpoint(ztier_model* model, const char* dir) {
  if (Status s = CheckOpen(model, "model"); !s.ok()) return Report(s);
  if (dir == nullptr) return Null("dir");
  return Report(model->model->SaveCheckpoint(dir));
}

ztier_status ztier_model_load_checkpoint(ztier_model* model, const char* dir) {
  if (Status s = CheckOpen(model, "model"); !s.ok()) return Report(s);
  if (dir == nullptr) return Null("dir");
  return Report(model->model->LoadCheckpoint(dir));
}

ztier_status ztier_model_export_safetensors(ztier_model* model, const char* path, int32_t dtype) {
  if (Status s = CheckOpen(model, "model"); !s.ok()) return Report(s);
  if (path == nullptr) return Null("path");
  if (dtype != 0 && dtype != 1) {
    return Report(
        Status::InvalidArgument(StrCat("export dtype ", dtype, ": 0 (bf16) or 1 (fp32)")));
  }
  return Report(model->model->ExportSafetensors(
      path, dtype == 0 ? ztier::engine::Engine::ExportType::kBFloat16
                       : ztier::engine::Engine::ExportType::kFloat32));
}

ztier_status ztier_model_import_safetensors(ztier_model* model, const char* path) {
  if (Status s = CheckOpen(model, "model"); !s.ok()) return Report(s);
  if (path == nullptr) return Null("path");
  return Report(model->model->ImportSafetensors(path));
}

int64_t ztier_model_published_step(const ztier_model* model) {
  const Status open = CheckOpen(model, "model");
  if (!open.ok()) return (void)Report(open), -1;
  Result<int64_t> step = model->model->PublishedStep();
  if (!step.ok()) return (void)Report(step.status()), -1;
  return *step;
}

ztier_status ztier_model_wait_published(const ztier_model* model, int64_t step,
                                        int64_t timeout_ms) {
  if (Status s = CheckOpen(model, "model"); !s.ok()) return Report(s);
  if (timeout_ms < 0) {
    return Report(
        Status::InvalidArgument(StrCat("wait_published: timeout ", timeout_ms, " ms < 0")));
  }
  if (step < 0) {  // (it returned OK before any weights were set)
    return Report(Status::InvalidArgument(StrCat("wait_published: step ", step, " < 0")));
  }
  return Report(model->model->WaitPublished(step, std::chrono::milliseconds(timeout_ms)));
}

ztier_status ztier_device_open_host(ztier_device** out) {
  if (out == nullptr) return Null("out");
  Result<std::unique_ptr<ztier::client::Device>> d = ztier::client::MakeHostDevice();
  if (!d.ok()) return Report(d.status());
  *out = Opened(new ztier_device{*std::move(d)});
  return ZTIER_OK;
}

ztier_status ztier_device_open_cuda(int32_t ordinal, ztier_device** out) {
  if (out == nullptr) return Null("out");
  Result<std::unique_ptr<ztier::client::Device>> d = ztier::client::MakeCudaDevice(ordinal);
  if (!d.ok()) return Report(d.status());
  *out = Opened(new ztier_device{*std::move(d)});
  return ZTIER_OK;
}

void ztier_device_close(ztier_device* device) { Close(device, "ztier_device"); }

ztier_status ztier_device_compute_stream(const ztier_device* device, void** stream) {
  if (Status s = CheckOpen(device, "device"); !s.ok()) return Report(s);
  if (stream == nullptr) return Null("stream");
  *stream = device->device->native_stream(ztier::client::Stream::kCompute);
  return ZTIER_OK;
}

void ztier_runner_options_init(ztier_runner_options* options) {
  if (options == nullptr) return;
  const ztier::client::RunnerOptions d;
  std::memset(options, 0, sizeof(*options));
  options->struct_size = sizeof(*options);
  options->prefetch_depth = d.prefetch_depth;
  options->max_live_bytes = d.max_live_bytes;
  options->persistence_threshold = d.persistence_threshold;
  options->coalesce_bytes = d.coalesce_bytes;
}

ztier_status ztier_runner_create(ztier_model* model, ztier_device* device,
                                 const ztier_runner_options* options, ztier_runner** out) {
  if (Status s = CheckOpen(model, "model"); !s.ok()) return Report(s);
  if (Status s = CheckOpen(device, "device"); !s.ok()) return Report(s);
  if (out == nullptr) return Null("out");
  // The session's settings (its config, the ZTIER_* variables), the wait
  // timeout among them; the caller's options, where given, over them.
  ztier::client::RunnerOptions o = ztier::client::RunnerOptionsFrom(model->settings);
  if (options != nullptr) {
    // Older: before coalesce_bytes.
    if (Status s = CheckStruct(options, "runner options",
                               {offsetof(ztier_runner_options, coalesce_bytes)});
        !s.ok()) {
      return Report(s);
    }
    o.prefetch_depth = options->prefetch_depth;
    o.max_live_bytes = options->max_live_bytes;
    o.persistence_threshold = options->persistence_threshold;
    // An older caller's smaller struct: the fields it lacks keep the session's.
    if (ZT_HAS_FIELD(options, ztier_runner_options, coalesce_bytes)) {
      o.coalesce_bytes = options->coalesce_bytes;
    }
  }
  Result<std::unique_ptr<ztier::client::Stage3Runner>> r =
      ztier::client::Stage3Runner::Create(*model->model, 0, *device->device, nullptr, o);
  if (!r.ok()) return Report(r.status());
  *out = Opened(new ztier_runner{model->model, device->device, *std::move(r)});
  return ZTIER_OK;
}

void ztier_runner_close(ztier_runner* runner) { Close(runner, "ztier_runner"); }

ztier_status ztier_runner_acquire(ztier_runner* runner, int32_t unit, const uint16_t** params) {
  if (Status s = CheckOpen(runner, "runner"); !s.ok()) return Report(s);
  if (params == nullptr) return Null("params");
  Result<const ztier::bf16*> p = runner->runner->Acquire(unit);
  if (!p.ok()) return Report(p.status());
  *params = reinterpret_cast<const uint16_t*>(*p);
  return ZTIER_OK;
}

ztier_status ztier_runner_release(ztier_runner* runner, int32_t unit) {
  if (Status s = CheckOpen(runner, "runner"); !s.ok()) return Report(s);
  return Report(runner->runner->Release(unit));
}

ztier_status ztier_runner_grad_buffer(ztier_runner* runner, int32_t unit, uint16_t** grads) {
  if (Status s = CheckOpen(runner, "runner"); !s.ok()) return Report(s);
  if (grads == nullptr) return Null("grads");
  Result<ztier::bf16*> g = runner->runner->GradBuffer(unit);
  if (!g.ok()) return Report(g.status());
  *grads = reinterpret_cast<uint16_t*>(*g);
  return ZTIER_OK;
}

ztier_status ztier_runner_push_grads(ztier_runner* runner, int32_t unit) {
  if (Status s = CheckOpen(runner, "runner"); !s.ok()) return Report(s);
  return Report(runner->runner->PushGrads(unit));
}

ztier_status ztier_runner_push_grads_from(ztier_runner* runner, int32_t unit, const uint16_t* grads,
                                          uint64_t count) {
  if (Status s = CheckOpen(runner, "runner"); !s.ok()) return Report(s);
  return Report(
      runner->runner->PushGrads(unit, reinterpret_cast<const ztier::bf16*>(grads), count));
}

ztier_status ztier_runner_step(ztier_runner* runner) {
  if (Status s = CheckOpen(runner, "runner"); !s.ok()) return Report(s);
  return Report(runner->runner->Step());
}

ztier_status ztier_runner_abort_step(ztier_runner* runner, int32_t* discarded) {
  if (Status s = CheckOpen(runner, "runner"); !s.ok()) return Report(s);
  Result<int> r = runner->runner->AbortStep();
  if (r.ok() && discarded != nullptr) *discarded = *r;
  return Report(r.status());
}

int64_t ztier_runner_version(const ztier_runner* runner) {
  const Status open = CheckOpen(runner, "runner");
  if (!open.ok()) return (void)Report(open), -1;
  return runner->runner->version();
}

}  // extern "C"
