// RpcServer: expertd's control plane — Cap'n Proto RPC (client/expertd.capnp) on a Unix socket,
// served by a kj event loop on a thread of its own.
//
// Threads. The RPC thread never touches the stores: every method posts a command to the
// DaemonCore's reactor (DaemonCore::post) and answers when the reactor fulfils a kj cross-thread
// fulfiller. ping() alone answers on the RPC thread (it measures the control plane's round trip).
//
// Peers. Each connection's SO_PEERCRED is checked once: uid 0, the daemon's own uid, a uid in
// allowed_uids or a primary gid in allowed_gids may talk; anyone else gets a bootstrap capability
// on which every call fails with "permission denied: ...", and the connection is closed a few
// seconds later. In the expertd-test binary only (built with EXPERTD_TEST_HOOKS=1, for tests),
// the environment variable EXPERTD_TEST_PEER_UID=N makes every peer uid N.
//
// Roles. Any allowed peer is a reader (info, openModel, attach, stats, ping, modelFiles, its
// sessions' calls); every other call needs an admin (root, the daemon's uid, admin_gids), and a
// reader's is refused naming the call and the rule.
//
// Bounds. Per non-admin uid: max_connections_per_uid connections, max_sessions_per_uid sessions
// (DaemonCore::attach); kMaxConnections for all non-admins, kAdminReservedConnections more for
// admins. A connection runs at most 8 calls at once (the rest wait; past the flow limit its socket
// is not read), a message over max_frame is refused from its header, and a connection without a
// session idle for idle_timeout_s is closed.
//
// Sessions. attach() returns a Session capability and the session's file descriptors, each in an
// Fd capability that owns it (passed with SCM_RIGHTS). The Session's server object detaches the
// session when it is destroyed: when the client drops it, calls detach(), or the connection goes
// away (a client that dies loses its holds as soon as the kernel closes its socket).
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "daemon/config.h"
#include "daemon/core.h"
#include "expertd/result.h"

namespace expertd {

class RpcServer {
 public:
  // Creates the socket (its parent directory if missing; a stale socket file nobody listens on
  // is replaced; mode 0660) and starts serving on a new thread. Errors name the path. `passed`: a
  // listening socket handed over (systemd's socket activation, or the previous daemon's on a warm
  // restart), served instead of binding the path.
  static Result<std::unique_ptr<RpcServer>> start(DaemonCore& core, const DaemonConfig& config,
                                                  UniqueFd passed = {});
  // For an exec hand-over: a duplicate of the listening socket, which stays open (connections
  // wait in its backlog for the successor); stop() then leaves the socket file in place.
  UniqueFd take_listen_fd();
  // Stops accepting, closes every connection (detaching their sessions), joins the thread and
  // removes the socket file. Idempotent.
  void stop();
  ~RpcServer();

  RpcServer(const RpcServer&) = delete;
  RpcServer& operator=(const RpcServer&) = delete;

  struct Loop;  // the RPC thread's state (rpc.cc)

 private:
  RpcServer() = default;

  std::string socket_path_;
  dev_t socket_dev_ = 0;
  ino_t socket_ino_ = 0;
  UniqueFd listen_dup_;  // kept for take_listen_fd() until stop()
  std::thread thread_;
  std::shared_ptr<Loop> loop_;
  std::atomic<bool> stopped_{false};
};

}  // namespace expertd
