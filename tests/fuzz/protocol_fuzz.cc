// libFuzzer target: the daemon protocol's decoders (engine/protocol.h) on
// arbitrary bytes. The first byte picks the decoder (the message header, or
// one payload type); the rest is its input. Whatever decodes must encode
// back to exactly the same bytes (so no field is read loosely) and satisfy
// the limits the decoder promises; a violation aborts, which the fuzzer
// reports. Built and run by scripts/fuzz.sh (clang,
// -fsanitize=fuzzer,address,undefined).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "engine/protocol.h"

namespace {

namespace p = ztier::engine::protocol;

void Require(bool ok) {
  if (!ok) std::abort();
}

// Decode, then the encoding of what was decoded must be the input.
template <class Decode>
void RoundTrip(std::string_view in, Decode decode) {
  auto r = decode(in);
  if (!r.ok()) return;
  Require(p::Encode(*r) == in);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view in(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 16) {
    case 0: {
      ztier::Result<p::Header> h = p::DecodeHeader(in, data[0] / 16 % 4);
      if (!h.ok()) return 0;
      Require(h->payload_bytes == in.size() - p::kHeaderBytes);
      ztier::Result<std::string> again = p::EncodeMessage(*h, in.substr(p::kHeaderBytes));
      Require(again.ok() && *again == in);
      return 0;
    }
    case 1:
      RoundTrip(in, p::DecodeHello);
      return 0;
    case 2:
      RoundTrip(in, p::DecodeJobRef);
      RoundTrip(in, p::DecodeAbortStepRequest);
      return 0;
    case 3:
      RoundTrip(in, p::DecodeUnitRef);
      return 0;
    case 4:
      RoundTrip(in, p::DecodeStepWait);
      return 0;
    case 5:
      RoundTrip(in, p::DecodeStepValue);
      return 0;
    case 6:
      RoundTrip(in, p::DecodeAttachRequest);
      return 0;
    case 7:
      RoundTrip(in, p::DecodeJobHandle);
      return 0;
    case 8:
      RoundTrip(in, p::DecodeSharedBuffer);
      return 0;
    case 9: {
      ztier::Result<ztier::engine::JobSpec> spec = p::DecodeJobSpec(in);
      if (!spec.ok()) return 0;
      uint64_t total = 0;
      const size_t groups = spec->optimizer.group_weight_decay.size();
      Require(groups <= p::kMaxParamGroups);
      for (const auto& u : spec->units) {
        Require(!u.name.empty() && !u.tensors.empty());
        for (const auto& t : u.tensors) {
          Require(t.group < (groups == 0 ? 1 : groups));
          uint64_t n = 1;
          Require(t.shape.size() <= p::kMaxDims);
          for (int64_t d : t.shape) {
            Require(d >= 1);
            n *= static_cast<uint64_t>(d);  // bounded by the decoder's checks
          }
          total += n;
        }
      }
      Require(total <= ztier::engine::kMaxJobElements);
      Require(p::Encode(*spec) == in);
      return 0;
    }
    case 10:
      RoundTrip(in, p::DecodeUnitLayout);
      return 0;
    case 11: {
      RoundTrip(in, p::DecodeJobCounters);
      RoundTrip(in, p::DecodeDaemonStatus);
      ztier::Result<p::JobList> jobs = p::DecodeJobList(in);
      if (!jobs.ok()) return 0;
      Require(jobs->jobs.size() <= p::kMaxListed);
      Require(p::Encode(*jobs) == in);
      return 0;
    }
    case 12: {
      RoundTrip(in, p::DecodeDramPoolStats);
      RoundTrip(in, p::DecodeQuotaList);
      RoundTrip(in, p::DecodeQuotaUpdate);
      ztier::Result<std::string_view> s = p::DecodeReplyStatus(in);
      (void)s;
      return 0;
    }
    case 13: {
      ztier::Result<p::RegionList> list = p::DecodeRegionList(in);
      if (!list.ok()) return 0;
      Require(!list->regions.empty() && list->regions.size() <= p::kMaxFdsPerMessage);
      Require(p::Encode(*list) == in);
      return 0;
    }
    case 14:
      RoundTrip(in, p::DecodeStagedData);
      RoundTrip(in, p::DecodeListRequest);
      RoundTrip(in, p::DecodeQuotaQuery);
      RoundTrip(in, p::DecodeDrainRequest);
      RoundTrip(in, p::DecodeEvictRequest);
      return 0;
    case 15: {
      RoundTrip(in, p::DecodeJobSteps);
      RoundTrip(in, p::DecodeStateCommit);
      RoundTrip(in, p::DecodeCollectiveRegionRequest);
      ztier::Result<p::LearningRates> lrs = p::DecodeLearningRates(in);
      if (!lrs.ok()) return 0;
      Require(lrs->lrs.size() <= p::kMaxParamGroups);
      Require(p::Encode(*lrs) == in);
      return 0;
    }
  }
  return 0;
}
