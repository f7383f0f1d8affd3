// libFuzzer target: the safetensors header parser on arbitrary bytes.
// Built and run by scripts/fuzz.sh (clang, -fsanitize=fuzzer,address,undefined).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "engine/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  (void)ztier::engine::ParseSafetensorsHeader(bytes, size);
  return 0;
}
