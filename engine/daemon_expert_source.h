// ExpertSource over libexpertd-client: experts are the daemon's arena slots, read in place
// through the session's read-only mapping.
//
// create() checks the daemon's layout of the model against the engine's own GGUF once: the same
// layers, expert count and top-k, and for every MoE layer the same slices (kind, shard, offset,
// stride, bytes, type, shape) as the GGUF's slice map, so a daemon serving a different file under
// that name is refused before any expert is used. After that get() only converts slot views.
// create() borrows a Session, which must outlive the source; connect() and attach() own the Client
// and the Session.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "engine/expert_source.h"
#include "expertd/client.h"

namespace expertd::engine {

class DaemonExpertSource final : public ExpertSource {
 public:
  static Result<std::unique_ptr<DaemonExpertSource>> create(client::Session& session,
                                                            const DenseModel& model);
  // Connects to expertd at `socket`, attaches to `model_name` as `client_name`, then create().
  static Result<std::unique_ptr<DaemonExpertSource>> connect(const std::string& socket,
                                                             const std::string& model_name,
                                                             const DenseModel& model,
                                                             const std::string& client_name);
  // The same over a Client already connected (e.g. the one DenseModel::load_from_daemon read the
  // model's files through, so a model by name needs only the socket); the source owns it.
  static Result<std::unique_ptr<DaemonExpertSource>> attach(std::unique_ptr<client::Client> client,
                                                            const std::string& model_name,
                                                            const DenseModel& model,
                                                            const std::string& client_name);

  Status get(uint32_t layer, std::span<const uint32_t> experts, std::span<ExpertView> out) override;
  Status release(std::span<const ExpertView> views) override;
  // Releases with abi::kReleaseClientCopy: the daemon's cache makes those slots its first victims.
  Status release_kept(std::span<const ExpertView> views) override;
  Status unkeep(uint32_t layer, uint32_t expert) override;
  Status prefetch(std::span<const ExpertHint> hints) override;
  Status set_cursor(uint32_t token, uint32_t layer) override;
  std::span<const uint8_t> host_memory() const override;
  // Reads the daemon's slot table (shared memory): READY slots of `layer`.
  void host_ready(uint32_t layer, std::span<const uint32_t> experts,
                  std::span<uint8_t> out) const override;
  // READY slots of the slot table (cache and staging); returns its slot count.
  uint32_t host_resident(uint32_t n_expert, std::span<uint8_t> out) const override;

  client::Session& session() { return *session_; }
  // The Client connect() or attach() owns (nullptr after create()): stats and tuning calls.
  client::Client* client() { return owned_client_.get(); }

 private:
  // Where each projection sits among a layer's slot slices, and its shape.
  struct Part {
    uint32_t slice = 0;       // index into SlotView::slices
    uint64_t row_offset = 0;  // rows to skip (the up half of a fused gate_up)
    WeightView shape;         // type, rows, cols, row_bytes (data filled per hold)
  };
  struct LayerParts {
    Part gate;
    Part up;
    Part down;
  };

  explicit DaemonExpertSource(client::Session& session) : session_(&session) {}

  std::unique_ptr<client::Client> owned_client_;    // connect() and attach() only
  std::unique_ptr<client::Session> owned_session_;  // those only; destroyed before the client
  client::Session* session_;
  std::vector<LayerParts> layers_;       // per block layer
  std::vector<client::SlotView> slots_;  // get()'s buffer: room for every expert of a layer
  std::vector<client::PrefetchHint> hints_;
};

}  // namespace expertd::engine
