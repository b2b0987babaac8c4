// ForgeVerifier: checks every slot an ExpertStore fills against expert-forge's content function,
// byte for byte (the daemon's --verify mode, the storage benchmark and the cache tests).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cache/store.h"
#include "expertd/result.h"
#include "storage/gguf.h"
#include "storage/slice_map.h"
#include "storage/slot_layout.h"

namespace expertd {

// Checks every slot an ExpertStore fills against expert-forge's content function (verify mode).
// Counts failures; the first few are described for the log.
class ForgeVerifier final : public LoadChecker {
 public:
  // Errors when `model` is not a forged model.
  static Result<std::unique_ptr<ForgeVerifier>> create(const GgufModel& model, const SliceMap& map,
                                                       const SlotLayouts& layouts);
  void loaded(ExpertKey key, uint32_t slot, const uint8_t* slot_data, uint64_t latency_ns) override;
  void failed(ExpertKey key, int error) override;

  uint64_t verified() const override { return verified_; }
  uint64_t failures() const override { return failures_; }
  uint64_t load_errors() const { return load_errors_; }
  const std::vector<std::string>& messages() const override { return messages_; }
  // Latencies (read start → READY) of every load seen, in ns, in completion order (bounded).
  const std::vector<uint64_t>& latencies_ns() const { return latencies_; }
  // A load observer to forward to (e.g. a stats collector), or nullptr.
  void chain(LoadObserver* next) { next_ = next; }

 private:
  const GgufModel* model_ = nullptr;
  const SliceMap* map_ = nullptr;
  const SlotLayouts* layouts_ = nullptr;
  uint64_t seed_ = 0;
  std::vector<uint8_t> expected_;
  uint64_t verified_ = 0;
  uint64_t failures_ = 0;
  uint64_t load_errors_ = 0;
  std::vector<std::string> messages_;
  std::vector<uint64_t> latencies_;
  LoadObserver* next_ = nullptr;
};

}  // namespace expertd
