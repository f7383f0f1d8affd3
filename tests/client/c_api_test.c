/* libztier's C ABI from C: a two-unit model trained for a few steps through
 * a runner on the host device, checked against the AdamW update by hand,
 * and the errors a C caller sees for bad use. Exit code 0 on success. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client/ztier_c.h"

static int failures = 0;

#define EXPECT(cond)                                                                      \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      fprintf(stderr, "%s:%d: expected %s (last error: %s)\n", __FILE__, __LINE__, #cond, \
              ztier_last_error());                                                        \
      ++failures;                                                                         \
    }                                                                                     \
  } while (0)

#define ASSERT_OK(call)                                                                         \
  do {                                                                                          \
    ztier_status s_ = (call);                                                                   \
    if (s_ != ZTIER_OK) {                                                                       \
      fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, ztier_last_error()); \
      return 1;                                                                                 \
    }                                                                                           \
  } while (0)

/* A thread that calls into the library until told to stop. */
struct hammer {
  ztier_model* model;
  atomic_int stop;
};
static void* Hammer(void* arg) {
  struct hammer* h = (struct hammer*)arg;
  uint64_t n = 0;
  while (!atomic_load(&h->stop)) (void)ztier_model_unit_layout(h->model, 0, &n, NULL);
  return NULL;
}

int main(void) {
  EXPECT(ztier_abi_version() == ZTIER_ABI_VERSION);
  ztier_session* session = NULL;
  {
    /* A daemon socket where nothing listens: unavailable, naming it. */
    ztier_session_options o;
    ztier_session_options_init(&o);
    EXPECT(o.struct_size == sizeof(o));
    o.daemon_socket = "/nonexistent-dir/ztierd.sock";
    EXPECT(ztier_session_open_with(&o, &session) == ZTIER_UNAVAILABLE);
    EXPECT(strstr(ztier_last_error(), "/nonexistent-dir/ztierd.sock") != NULL);
    EXPECT(session == NULL);
    /* Bytes that are not UTF-8 in a path come back as '?': the message is
     * UTF-8 whatever the caller passed. */
    o.daemon_socket = "/nonexistent-dir/\xff\xfe.sock";
    EXPECT(ztier_session_open_with(&o, &session) == ZTIER_UNAVAILABLE);
    EXPECT(strstr(ztier_last_error(), "/nonexistent-dir/??.sock") != NULL);
    /* An older caller's struct without daemon_socket: the embedded engine. */
    o.struct_size = (uint32_t)offsetof(ztier_session_options, daemon_socket);
    ASSERT_OK(ztier_session_open_with(&o, &session));
    ztier_session_close(session);
    session = NULL;
    /* A size that cuts a field in two is refused, never half-read. */
    o.struct_size = 12;
    EXPECT(ztier_session_open_with(&o, &session) == ZTIER_INVALID_ARGUMENT);
    EXPECT(strstr(ztier_last_error(), "struct_size is 12") != NULL);
  }
  ASSERT_OK(ztier_session_open(NULL, &session));

  const int64_t w_shape[2] = {16, 8};
  const int64_t b_shape[1] = {8};
  const ztier_tensor_desc t0[2] = {{"l0.weight", 2, w_shape}, {"l0.bias", 1, b_shape}};
  const ztier_tensor_desc t1[1] = {{"l1.bias", 1, b_shape}};
  const ztier_unit_desc units[2] = {{"l0", 2, t0}, {"l1", 1, t1}};
  ztier_model_desc desc;
  ztier_model_desc_init(&desc);
  desc.name = "c-model";
  desc.num_units = 2;
  desc.units = units;
  desc.lr = 0.01f;

  /* A struct from a newer library version than this one is refused. */
  ztier_model_desc bad = desc;
  bad.struct_size = sizeof(desc) + 64;
  ztier_model* model = NULL;
  EXPECT(ztier_model_register(session, &bad, &model) == ZTIER_INVALID_ARGUMENT);
  EXPECT(strstr(ztier_last_error(), "struct_size") != NULL);
  bad = desc;
  bad.optimizer_on_nvme = 5; /* 1, 0 or -1 */
  EXPECT(ztier_model_register(session, &bad, &model) == ZTIER_INVALID_ARGUMENT);
  EXPECT(strstr(ztier_last_error(), "optimizer_on_nvme is 5") != NULL);
  /* A dims count past the most a tensor has, refused before its shape is
   * copied (an ndim near INT32_MAX ended the process with bad_alloc). */
  const ztier_tensor_desc huge[1] = {{"h.weight", 0x7fffff00, w_shape}};
  const ztier_unit_desc huge_unit[1] = {{"h", 1, huge}};
  bad = desc;
  bad.num_units = 1;
  bad.units = huge_unit;
  EXPECT(ztier_model_register(session, &bad, &model) == ZTIER_INVALID_ARGUMENT);
  EXPECT(strstr(ztier_last_error(), "dims; at most") != NULL);
  ASSERT_OK(ztier_model_register(session, &desc, &model));
  /* A negative step is no step (it was OK before any weights were set). */
  EXPECT(ztier_model_wait_published(model, -5, 0) == ZTIER_INVALID_ARGUMENT);
  /* No weights yet: -1, and why. */
  EXPECT(ztier_model_published_step(model) == -1);
  EXPECT(strstr(ztier_last_error(), "has no weights yet") != NULL);

  uint64_t numel[2], padded[2];
  float weights[136];
  for (int u = 0; u < 2; ++u) {
    ASSERT_OK(ztier_model_unit_layout(model, u, &numel[u], &padded[u]));
    for (uint64_t i = 0; i < numel[u]; ++i) weights[i] = 0.5f;
    ASSERT_OK(ztier_model_set_weights(model, u, weights, numel[u]));
  }
  EXPECT(numel[0] == 136 && numel[1] == 8);

  /* fork() while another thread is inside the library: the child's first
   * call answers (a child forked while that thread held the handles' lock
   * waited for it forever). */
  {
    struct hammer h;
    h.model = model;
    atomic_init(&h.stop, 0);
    pthread_t thread;
    EXPECT(pthread_create(&thread, NULL, Hammer, &h) == 0);
    int hung = 0;
    for (int i = 0; i < 100; ++i) {
      const pid_t pid = fork();
      if (pid == 0) {
        alarm(2);
        uint64_t n = 0;
        const ztier_status rc = ztier_model_unit_layout(model, 0, &n, NULL);
        _exit(rc == ZTIER_OK || rc == ZTIER_FAILED_PRECONDITION ? 0 : 3);
      }
      int st = 0;
      EXPECT(waitpid(pid, &st, 0) == pid);
      if (WIFSIGNALED(st)) {
        ++hung;
      } else {
        EXPECT(WEXITSTATUS(st) == 0);
      }
    }
    atomic_store(&h.stop, 1);
    EXPECT(pthread_join(thread, NULL) == 0);
    EXPECT(hung == 0);
  }
  EXPECT(ztier_model_set_weights(model, 0, weights, 3) == ZTIER_INVALID_ARGUMENT);

  ztier_device* device = NULL;
  ASSERT_OK(ztier_device_open_host(&device));
  /* The host device has no native stream; a CUDA device's is tested on a GPU. */
  void* stream = &stream;
  ASSERT_OK(ztier_device_compute_stream(device, &stream));
  EXPECT(stream == NULL);
  EXPECT(ztier_device_compute_stream(device, NULL) == ZTIER_INVALID_ARGUMENT);
  EXPECT(ztier_device_compute_stream((const ztier_device*)model, &stream) ==
         ZTIER_FAILED_PRECONDITION);
  ztier_runner_options options;
  ztier_runner_options_init(&options);
  options.prefetch_depth = 1;
  ztier_runner* runner = NULL;
  ztier_runner_options cut = options;
  cut.struct_size = 4;
  EXPECT(ztier_runner_create(model, device, &cut, &runner) == ZTIER_INVALID_ARGUMENT);
  ASSERT_OK(ztier_runner_create(model, device, &options, &runner));

  const int steps = 3;
  for (int step = 0; step < steps; ++step) {
    for (int u = 0; u < 2; ++u) {
      const uint16_t* p = NULL;
      ASSERT_OK(ztier_runner_acquire(runner, u, &p));
      /* bf16 of the published weights: 0.5 - step * lr (approximately). */
      EXPECT(p[0] != 0);
      ASSERT_OK(ztier_runner_release(runner, u));
    }
    /* Unit 1 from the caller's own buffer (the host device's memory is host
     * memory), unit 0 through the runner's grad buffer. */
    uint16_t mine[8];
    if (step == 1) {
      /* A backward that fails after its first push: the step is undone, and
       * its grads (-1.0) reach no weight. */
      for (int i = 0; i < 8; ++i) mine[i] = 0xbf80; /* -1.0 */
      ASSERT_OK(ztier_runner_push_grads_from(runner, 1, mine, numel[1]));
      int32_t discarded = -1;
      ASSERT_OK(ztier_runner_abort_step(runner, &discarded));
      EXPECT(discarded == 0);
      EXPECT(ztier_runner_version(runner) == 1);
      EXPECT(ztier_runner_abort_step(NULL, NULL) == ZTIER_INVALID_ARGUMENT);
    }
    for (int i = 0; i < 8; ++i) mine[i] = 0x3f80; /* 1.0 */
    EXPECT(ztier_runner_push_grads_from(runner, 1, mine, 5) == ZTIER_INVALID_ARGUMENT);
    EXPECT(strstr(ztier_last_error(), "takes 8 grads") != NULL);
    ASSERT_OK(ztier_runner_push_grads_from(runner, 1, mine, numel[1]));
    uint16_t* g = NULL;
    ASSERT_OK(ztier_runner_grad_buffer(runner, 0, &g));
    for (uint64_t i = 0; i < numel[0]; ++i) g[i] = 0x3f80;
    ASSERT_OK(ztier_runner_push_grads(runner, 0));
    ASSERT_OK(ztier_runner_step(runner));
  }
  EXPECT(ztier_runner_version(runner) == steps);
  /* A forked child's calls on its parent's handles fail, also those that
   * need no engine (a layout, the runner's version). */
  {
    const pid_t pid = fork();
    if (pid == 0) {
      uint64_t n = 0;
      int bad = 0;
      if (ztier_model_unit_layout(model, 0, &n, NULL) != ZTIER_FAILED_PRECONDITION) bad |= 1;
      if (strstr(ztier_last_error(), "forked") == NULL) bad |= 2;
      if (ztier_runner_version(runner) != -1) bad |= 4;
      (void)ztier_model_save_checkpoint(NULL, "x");
      if (ztier_model_published_step(model) != -1 || strstr(ztier_last_error(), "forked") == NULL)
        bad |= 8;
      _exit(bad);
    }
    int st = 0;
    EXPECT(waitpid(pid, &st, 0) == pid);
    EXPECT(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  }
  /* Initial weights only: after a step they would be published as step 0. */
  EXPECT(ztier_model_set_weights(model, 0, weights, numel[0]) == ZTIER_FAILED_PRECONDITION);
  EXPECT(strstr(ztier_last_error(), "before the first step") != NULL);

  /* Bad use: an unknown unit, a second step with no grads. */
  const uint16_t* p = NULL;
  EXPECT(ztier_runner_acquire(runner, 5, &p) == ZTIER_OUT_OF_RANGE);
  EXPECT(strstr(ztier_last_error(), "no unit 5") != NULL);
  EXPECT(ztier_runner_step(runner) == ZTIER_FAILED_PRECONDITION);
  EXPECT(ztier_runner_acquire(NULL, 0, &p) == ZTIER_INVALID_ARGUMENT);
  ztier_runner_close(runner);

  /* The last step's optimizer may still be running (the runner's step ends
   * the micro-step, not the engine's update): wait until every unit holds it. */
  /* INT64_MAX ms ("forever") waits, instead of overflowing into a timeout. */
  ASSERT_OK(ztier_model_wait_published(model, steps, INT64_MAX));
  EXPECT(ztier_model_wait_published(model, steps, -1) == ZTIER_INVALID_ARGUMENT);
  EXPECT(ztier_model_wait_published(NULL, steps, 0) == ZTIER_INVALID_ARGUMENT);

  /* With a constant grad, each AdamW step moves a weight by lr (bias-corrected
   * m / sqrt(v) is 1): 0.5 - 3 * 0.01. */
  float master[192];
  EXPECT(padded[0] <= 192);
  ASSERT_OK(ztier_model_read_master(model, 0, master, padded[0]));
  EXPECT(fabsf(master[0] - (0.5f - steps * 0.01f)) < 1e-4f);
  EXPECT(fabsf(master[numel[0] - 1] - (0.5f - steps * 0.01f)) < 1e-4f);
  EXPECT(master[padded[0] - 1] == 0.0f || numel[0] == padded[0]);
  EXPECT(ztier_model_read_master(model, 0, master, 3) == ZTIER_INVALID_ARGUMENT);
  EXPECT(ztier_model_published_step(model) == steps);

  ztier_device_close(device);
  /* A checkpoint directory belongs to one model at a time; a second model
   * is refused with ZTIER_UNAVAILABLE until the first one is closed. */
  char dir[64];
  snprintf(dir, sizeof(dir), "c-api-test-ckpt-%d", (int)getpid());
  ASSERT_OK(ztier_model_claim_checkpoint_dir(model, dir));
  ASSERT_OK(ztier_model_save_checkpoint(model, dir));
  EXPECT(ztier_model_save_checkpoint(model, "") == ZTIER_INVALID_ARGUMENT);
  EXPECT(strstr(ztier_last_error(), "an empty path") != NULL);
  desc.name = "c-model-2";
  ztier_model* second = NULL;
  ASSERT_OK(ztier_model_register(session, &desc, &second));
  EXPECT(ztier_model_claim_checkpoint_dir(second, dir) == ZTIER_UNAVAILABLE);
  EXPECT(strstr(ztier_last_error(), "c-model") != NULL);
  EXPECT(ztier_model_load_checkpoint(second, dir) == ZTIER_OK);
  ztier_model_close(model);
  EXPECT(ztier_model_claim_checkpoint_dir(second, dir) == ZTIER_OK);

  /* Handles closed in any order (a garbage collector's): a runner keeps its
   * model and device until it is closed, and trains on meanwhile. */
  ztier_device* dev2 = NULL;
  ASSERT_OK(ztier_device_open_host(&dev2));
  ztier_runner* r2 = NULL;
  ASSERT_OK(ztier_runner_create(second, dev2, &options, &r2));
  ztier_model_close(second);
  ztier_device_close(dev2);
  for (int u = 1; u >= 0; --u) {
    uint16_t* g = NULL;
    ASSERT_OK(ztier_runner_grad_buffer(r2, u, &g));
    ASSERT_OK(ztier_runner_push_grads(r2, u));
  }
  ASSERT_OK(ztier_runner_step(r2));
  ztier_runner_close(r2);
  /* A handle closed twice, or used after its close, is an error, not a
   * double free. */
  ztier_runner_close(r2);
  EXPECT(ztier_runner_step(r2) == ZTIER_FAILED_PRECONDITION);
  EXPECT(strstr(ztier_last_error(), "not an open handle") != NULL);
  EXPECT(ztier_model_published_step(second) == -1);
  /* A handle of one kind where another goes (a binding passing every
   * handle as void*, arguments swapped) is refused by its kind, not read
   * as the other type (a runner's call on a model crashed). */
  EXPECT(ztier_runner_step((ztier_runner*)session) == ZTIER_FAILED_PRECONDITION);
  EXPECT(strstr(ztier_last_error(), "is an open ztier_session, not a ztier_runner") != NULL);
  /* The getters without a status say why they gave -1. */
  EXPECT(ztier_model_save_checkpoint(NULL, "x") != ZTIER_OK);
  EXPECT(ztier_runner_version((ztier_runner*)session) == -1);
  EXPECT(strstr(ztier_last_error(), "is an open ztier_session, not a ztier_runner") != NULL);
  EXPECT(ztier_model_published_step((ztier_model*)session) == -1);
  EXPECT(strstr(ztier_last_error(), "not a ztier_model") != NULL);
  uint64_t count = 0;
  EXPECT(ztier_model_unit_layout((const ztier_model*)session, 0, &count, NULL) ==
         ZTIER_FAILED_PRECONDITION);
  ztier_model_close((ztier_model*)session); /* said on stderr; the session stays open */
  ztier_model_close(second);
  char rm[96];
  snprintf(rm, sizeof(rm), "rm -rf %s", dir);
  EXPECT(system(rm) == 0);

  /* The stop request starts unset. */
  EXPECT(ztier_install_stop_handlers() == ZTIER_OK);
  EXPECT(ztier_stop_requested() == 0);

  ztier_session_close(session);
  if (failures == 0) printf("c_api_test: ok\n");
  return failures == 0 ? 0 : 1;
}
