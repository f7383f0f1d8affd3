/* A C program built against an installed ztier (tests/install): the C ABI
 * through <ztier/ztier_c.h> and libztier.so. An embedded session, a
 * one-unit model, two steps through a runner on the host device with a
 * constant grad, then the master weights checked against AdamW (each step
 * moves a weight by lr when the grad is constant). Prints one line:
 *   c_consumer: ok (libztier <version>, abi <n>, master <value>)
 * Build lines:
 *   gcc c_consumer.c $(pkg-config --cflags --libs ztier_c)
 *   CMake: target_link_libraries(app PRIVATE ztier::ztier_c)  */
#include <math.h>
#include <stdio.h>

#include <ztier/ztier_c.h>

#define CHECK(call)                                                                    \
  do {                                                                                 \
    ztier_status s_ = (call);                                                          \
    if (s_ != ZTIER_OK) {                                                              \
      fprintf(stderr, "c_consumer: %s failed (%d): %s\n", #call, (int)s_, ztier_last_error()); \
      return 1;                                                                        \
    }                                                                                  \
  } while (0)

int main(void) {
  if (ztier_abi_version() != ZTIER_ABI_VERSION) {
    fprintf(stderr, "c_consumer: libztier's ABI %d, the header's %d\n", ztier_abi_version(),
            ZTIER_ABI_VERSION);
    return 1;
  }
  ztier_session* session = NULL;
  CHECK(ztier_session_open(NULL, &session));

  const int64_t shape[1] = {64};
  const ztier_tensor_desc tensors[1] = {{"l0.weight", 1, shape}};
  const ztier_unit_desc units[1] = {{"l0", 1, tensors}};
  ztier_model_desc desc;
  ztier_model_desc_init(&desc);
  desc.name = "c-consumer";
  desc.num_units = 1;
  desc.units = units;
  desc.lr = 0.01f;
  ztier_model* model = NULL;
  CHECK(ztier_model_register(session, &desc, &model));
  uint64_t numel = 0, padded = 0;
  CHECK(ztier_model_unit_layout(model, 0, &numel, &padded));
  float weights[64];
  for (int i = 0; i < 64; ++i) weights[i] = 0.5f;
  CHECK(ztier_model_set_weights(model, 0, weights, numel));

  ztier_device* device = NULL;
  CHECK(ztier_device_open_host(&device));
  ztier_runner* runner = NULL;
  CHECK(ztier_runner_create(model, device, NULL, &runner));
  const int steps = 2;
  for (int step = 0; step < steps; ++step) {
    const uint16_t* params = NULL;
    CHECK(ztier_runner_acquire(runner, 0, &params));
    CHECK(ztier_runner_release(runner, 0));
    uint16_t* grads = NULL;
    CHECK(ztier_runner_grad_buffer(runner, 0, &grads));
    for (uint64_t i = 0; i < numel; ++i) grads[i] = 0x3f80; /* bf16 1.0 */
    CHECK(ztier_runner_push_grads(runner, 0));
    CHECK(ztier_runner_step(runner));
  }
  ztier_runner_close(runner);
  CHECK(ztier_model_wait_published(model, steps, 10000));

  float master[256];
  if (padded > 256) {
    fprintf(stderr, "c_consumer: unit padded to %llu\n", (unsigned long long)padded);
    return 1;
  }
  CHECK(ztier_model_read_master(model, 0, master, padded));
  const float want = 0.5f - steps * 0.01f;
  if (fabsf(master[0] - want) > 1e-4f || fabsf(master[numel - 1] - want) > 1e-4f) {
    fprintf(stderr, "c_consumer: master %g, %g; want %g\n", master[0], master[numel - 1], want);
    return 1;
  }
  ztier_model_close(model);
  ztier_device_close(device);
  ztier_session_close(session);
  printf("c_consumer: ok (libztier %s, abi %d, master %.4f)\n", ztier_version(),
         ztier_abi_version(), master[0]);
  return 0;
}
