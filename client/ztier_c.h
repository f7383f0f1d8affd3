/* libztier's C ABI: the client library for other languages (Python ctypes,
 * Rust, ...). Opaque handles, plain status codes, versioned structs; the
 * same engine and runner as the C++ API of client/ztier.h. Only ztier_*
 * symbols are exported (libztier.map).
 *
 * Errors: every function returns a ztier_status; on failure,
 * ztier_last_error() gives the message of the calling thread's last failed
 * call (valid until its next call into the library), in UTF-8: bytes of a
 * path or name that are not UTF-8, and control characters, show as '?'.
 * Versioning: structs passed in start with `struct_size` (set it to
 * sizeof the struct); fields are only ever appended.
 * Thread safety: as the C++ API: a runner is driven by one thread; sessions
 * and models may be used from any thread.
 * Handles: a handle closed twice, or used after its close, is an error
 * (ZTIER_FAILED_PRECONDITION; a second close is said on stderr), never a
 * double free, as long as no new handle took its place (a new one may get
 * the same address; the library cannot tell them apart). Closing a handle
 * while another thread uses it is undefined, as freeing any object is.
 * fork(): handles belong to the process that opened them. In a forked child
 * every call on them fails with ZTIER_FAILED_PRECONDITION (one that returns
 * no status, ztier_runner_version, gives -1), and closing them
 * there frees nothing of the parent's (its job, its ztierd connection). */
#ifndef ZTIER_CLIENT_ZTIER_C_H_
#define ZTIER_CLIENT_ZTIER_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ZTIER_ABI_VERSION 1

/* Same values as ztier::StatusCode. */
typedef enum ztier_status {
  ZTIER_OK = 0,
  ZTIER_INVALID_ARGUMENT = 1,
  ZTIER_NOT_FOUND = 2,
  ZTIER_ALREADY_EXISTS = 3,
  ZTIER_OUT_OF_RANGE = 4,
  ZTIER_RESOURCE_EXHAUSTED = 5,
  ZTIER_FAILED_PRECONDITION = 6,
  ZTIER_CORRUPTION = 7,
  ZTIER_IO_ERROR = 8,
  ZTIER_UNAVAILABLE = 9,
  ZTIER_ABORTED = 10,
  ZTIER_UNIMPLEMENTED = 11,
  ZTIER_INTERNAL = 12,
  ZTIER_PERMISSION_DENIED = 13
} ztier_status;

typedef struct ztier_session ztier_session;
typedef struct ztier_model ztier_model;
typedef struct ztier_device ztier_device;
typedef struct ztier_runner ztier_runner;

int ztier_abi_version(void);
const char* ztier_version(void);
const char* ztier_last_error(void);

/* Opens the embedded engine. `config_path` (a JSON config) may be NULL for
 * the defaults; ZTIER_* environment variables apply on top. */
ztier_status ztier_session_open(const char* config_path, ztier_session** out);

typedef struct ztier_session_options {
  uint32_t struct_size;      /* sizeof(ztier_session_options) */
  const char* config_path;   /* a JSON config, or NULL: the defaults */
  const char* daemon_socket; /* ztierd's socket, or NULL: the config's
                                ztier.daemon_socket / ZTIER_DAEMON_SOCKET,
                                else the engine embedded in this process */
} ztier_session_options;

void ztier_session_options_init(ztier_session_options* options);
/* Opens a session as `options` say (NULL: as ztier_session_open(NULL)).
 * Through a daemon: ZTIER_UNAVAILABLE when none answers at the socket. */
ztier_status ztier_session_open_with(const ztier_session_options* options, ztier_session** out);
void ztier_session_close(ztier_session* session);

typedef struct ztier_tensor_desc {
  const char* name;
  int32_t ndim;
  const int64_t* shape;
} ztier_tensor_desc;

typedef struct ztier_unit_desc {
  const char* name;
  int32_t num_tensors;
  const ztier_tensor_desc* tensors;
} ztier_unit_desc;

typedef struct ztier_model_desc {
  uint32_t struct_size; /* sizeof(ztier_model_desc) */
  const char* name;
  int32_t num_units; /* in forward order */
  const ztier_unit_desc* units;
  float lr, beta1, beta2, eps, weight_decay; /* a beta is taken as the shortest
                                               decimal that rounds to it */
  float clip_norm;                           /* 0: off */
  int32_t grad_accumulation;                 /* >= 1 */
  int32_t optimizer_on_nvme; /* 1: NVMe, 0: DRAM, -1: the session's (config, ZTIER_*) */
  int32_t params_on_nvme;    /* 1: NVMe, 0: DRAM, -1: the session's */
  int32_t world_size;        /* 1 through the C ABI */
} ztier_model_desc;

/* Fills `desc` with the defaults (AdamW lr 1e-3, betas 0.9/0.999, eps 1e-8,
 * no decay, no clipping, accumulation 1, the session's tiers, world size 1). */
void ztier_model_desc_init(ztier_model_desc* desc);
ztier_status ztier_model_register(ztier_session* session, const ztier_model_desc* desc,
                                  ztier_model** out);
void ztier_model_close(ztier_model* model);
ztier_status ztier_model_unit_layout(const ztier_model* model, int32_t unit, uint64_t* numel,
                                     uint64_t* padded);
ztier_status ztier_model_set_weights(ztier_model* model, int32_t unit, const float* flat,
                                     uint64_t numel);
ztier_status ztier_model_read_master(const ztier_model* model, int32_t unit, float* out,
                                     uint64_t padded);
/* Locks `dir` for this model's checkpoints until the model is closed; a
 * second user of it is refused (ZTIER_UNAVAILABLE, naming the holder). */
ztier_status ztier_model_claim_checkpoint_dir(ztier_model* model, const char* dir);
/* Save and export: between steps. Called from another thread while a
 * runner trains, they are refused (ZTIER_FAILED_PRECONDITION) while grads
 * of a step are pending or, through ztierd, when a step is taken meanwhile;
 * training goes on (embedded, the runner's grads wait while the state is
 * read). Retry at a step boundary. A load or import of the same job
 * meanwhile refuses them too; of two loads at once, one is refused
 * (ZTIER_FAILED_PRECONDITION) and the job holds the other's state whole. */
ztier_status ztier_model_save_checkpoint(ztier_model* model, const char* dir);
ztier_status ztier_model_load_checkpoint(ztier_model* model, const char* dir);
/* dtype: 0 bf16, 1 fp32 */
ztier_status ztier_model_export_safetensors(ztier_model* model, const char* path, int32_t dtype);
ztier_status ztier_model_import_safetensors(ztier_model* model, const char* path);
/* -1 while a unit has no weights, when the engine cannot be asked, or for a
 * handle that is not an open model of this process; ztier_last_error() says
 * which. */
int64_t ztier_model_published_step(const ztier_model* model);
/* Blocks until every unit holds step >= `step` (the optimizer has finished
 * it: after a runner's last step, before reading or saving the state).
 * ZTIER_UNAVAILABLE after `timeout_ms`, ZTIER_ABORTED if the job failed,
 * ZTIER_FAILED_PRECONDITION at once for a step past the one whose grads
 * the job takes next (it would wait on grads not yet pushed: wait for each
 * step after its runner's step). */
ztier_status ztier_model_wait_published(const ztier_model* model, int64_t step, int64_t timeout_ms);

/* A clean stop: after ztier_install_stop_handlers(), the first SIGINT or
 * SIGTERM is only recorded and ztier_stop_requested() returns its number
 * (0 before); check it at a step boundary, save a checkpoint and exit with
 * 128 + the signal. A second signal ends the process at once. */
ztier_status ztier_install_stop_handlers(void);
int ztier_stop_requested(void);

/* The host device (host memory, a copy thread) or CUDA device `ordinal`. */
ztier_status ztier_device_open_host(ztier_device** out);
ztier_status ztier_device_open_cuda(int32_t ordinal, ztier_device** out);
void ztier_device_close(ztier_device* device);
/* The stream a runner's acquired params are ready on and its grad buffers
 * are read from after a push (a cudaStream_t for CUDA, NULL for the host
 * device): launch the unit's kernels there, or make the caller's stream
 * wait for it (an event) before them and it wait for the caller's before a
 * push. Valid until the device is closed. */
ztier_status ztier_device_compute_stream(const ztier_device* device, void** stream);

typedef struct ztier_runner_options {
  uint32_t struct_size; /* sizeof(ztier_runner_options) */
  int32_t prefetch_depth;
  uint64_t max_live_bytes;        /* 0: no cap */
  uint64_t persistence_threshold; /* bytes */
  uint64_t coalesce_bytes;        /* copies smaller than this are coalesced; 0: off */
} ztier_runner_options;

/* ztier's built-in defaults (not the session's: pass NULL options for those). */
void ztier_runner_options_init(ztier_runner_options* options);
/* Rank 0 of a world-size-1 model. It keeps its model and device: they may be
 * closed before it (in any order), and go when it is closed. `options`
 * NULL: the session's settings (its config and ZTIER_* variables: prefetch
 * depth, live-bytes cap, persistence threshold, coalescing); given: its values.
 * The wait timeout is the session's ztier.wait_timeout either way. */
ztier_status ztier_runner_create(ztier_model* model, ztier_device* device,
                                 const ztier_runner_options* options, ztier_runner** out);
void ztier_runner_close(ztier_runner* runner);
/* bf16 values are passed as uint16_t bit patterns, on the device. */
ztier_status ztier_runner_acquire(ztier_runner* runner, int32_t unit, const uint16_t** params);
ztier_status ztier_runner_release(ztier_runner* runner, int32_t unit);
ztier_status ztier_runner_grad_buffer(ztier_runner* runner, int32_t unit, uint16_t** grads);
ztier_status ztier_runner_push_grads(ztier_runner* runner, int32_t unit);
/* Pushes `count` bf16 grads (the unit's numel or padded size) from the
 * caller's own device buffer. */
ztier_status ztier_runner_push_grads_from(ztier_runner* runner, int32_t unit, const uint16_t* grads,
                                          uint64_t count);
ztier_status ztier_runner_step(ztier_runner* runner);
/* After a backward pass that failed once some grads were pushed: drops every
 * grad delivered since the last optimizer step, so the next micro-step starts
 * it afresh (Stage3Runner::AbortStep). `discarded` (may be NULL) gets the
 * micro-steps discarded whole. ZTIER_FAILED_PRECONDITION once the engine has
 * begun the step, or run it (its grads applied: ztier_runner_step goes on). */
ztier_status ztier_runner_abort_step(ztier_runner* runner, int32_t* discarded);
/* The version the runner's next forward pass reads; -1 for a handle that
 * is not an open runner of this process (ztier_last_error() says why). */
int64_t ztier_runner_version(const ztier_runner* runner);

#ifdef __cplusplus
}
#endif

#endif /* ZTIER_CLIENT_ZTIER_C_H_ */
