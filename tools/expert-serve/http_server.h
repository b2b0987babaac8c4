// expert-serve's HTTP/1.1 layer, on Boost.Beast and Asio (Debian's libboost1.74-dev). It bounds
// every client, so that slow, idle or departed ones cannot take the server down (issue 26):
//
// - One network thread reads every connection asynchronously: a request is handed to the workers
//   only once its head and body have arrived whole, so a client sending a byte a second holds a
//   few hundred bytes of buffer, not a thread. The head must arrive within `header_timeout` of
//   its first byte and the body within `body_timeout` of the head (else 408 and close); a
//   keep-alive connection with no request for `idle_timeout` is closed; a write that does not
//   finish within `write_timeout` closes its connection.
// - At most `max_connections` connections; one more gets a canned 503 (Retry-After) and is closed
//   at once, without a parser or a thread.
// - While a worker answers a request, the network thread keeps reading its connection: the
//   client closing it (or resetting it) calls the exchange's on_gone callback at once, so a
//   non-streaming generation whose client left stops within a token. Requests pipelined behind
//   it are buffered (up to 1 MiB) and answered in order.
// - Head and body limits (431, 413), malformed requests (400), `Expect: 100-continue`, HEAD (the
//   GET answer without its body) and `Connection: close` are handled here; a handler that throws
//   or returns without answering gets a 500.
//
// Why not cpp-httplib 0.11.4 (Debian 12's, which served before): it gives each connection a pool
// thread from its first byte to its last, with a per-recv timeout but no deadline for a request,
// so 30 clients sending a byte a second took every thread (and /health with them); it cannot tell
// a handler that the client left; and it answered only the first of pipelined requests. Newer
// cpp-httplib keeps the thread-per-connection design. docs/SERVE.md, "HTTP".
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "expertd/result.h"

namespace expertd::serve::http {

using Headers = std::vector<std::pair<std::string, std::string>>;

struct Limits {
  std::chrono::milliseconds header_timeout{10'000};
  std::chrono::milliseconds body_timeout{60'000};
  std::chrono::milliseconds idle_timeout{30'000};
  std::chrono::milliseconds write_timeout{30'000};
  size_t max_connections = 128;
  size_t header_limit = 16 << 10;
  size_t body_limit = size_t{64} << 20;
  size_t workers = 16;
};

struct Request {
  std::string method;  // as sent; HEAD is routed as GET (head true)
  bool head = false;
  std::string target;  // path and query
  std::string path;
  std::string query;  // after '?', undecoded
  Headers headers;    // names lower-case
  std::string body;
  std::string peer;  // address:port

  // The value of header `name` (lower-case), or nullopt.
  std::optional<std::string_view> header(std::string_view name) const;
  // The value of `key` in the query ("" for a bare "key"), undecoded; nullopt when absent.
  std::optional<std::string_view> query_value(std::string_view key) const;
  bool has_query_key(std::string_view key) const { return query_value(key).has_value(); }
};

struct Response {
  int status = 200;
  std::string content_type = "application/json";
  Headers headers;
  std::string body;
};

// One request being answered by a worker. Every call blocks the worker until the bytes are
// written (or the write failed); they may be called from the worker thread only.
class Exchange {
 public:
  virtual ~Exchange() = default;
  virtual const Request& request() const = 0;
  // A whole answer. Once per exchange, or after stream_begin() never.
  virtual void reply(Response r) = 0;
  // Starts a chunked answer (server-sent events). False: the client is gone.
  virtual bool stream_begin(int status, std::string content_type, Headers headers) = 0;
  // One chunk; false when the client is gone or the write timed out (the rest is then dropped).
  virtual bool stream_write(std::string_view data) = 0;
  virtual void stream_end() = 0;
  // Whether the client closed or reset its connection.
  virtual bool gone() const = 0;
  // `f` runs once when the client leaves (on the network thread: keep it short, and take no lock
  // that a worker holds across a call of this Exchange, whose writes wait for that thread), at
  // once if it already has; replaces an earlier one. A client that closes its sending side
  // (shutdown(SHUT_WR)) counts as gone: its request is cancelled and nothing more is read.
  virtual void on_gone(std::function<void()> f) = 0;
};

class Server {
 public:
  // Runs on the network thread for every complete request: an answer there (cheap ones: health,
  // refusals), or nullopt to hand the request to a worker.
  using Fast = std::function<std::optional<Response>(const Request&)>;
  // Runs on a worker.
  using Handler = std::function<void(Exchange&)>;
  // Every answer (the log, the counters): the request (null for a refusal before one was read)
  // and the status.
  using Logger = std::function<void(const Request*, int status, std::string_view body)>;

  // Binds and listens on host:port (SO_REUSEADDR), so a port in use is found at once.
  static Result<std::unique_ptr<Server>> bind(const std::string& host, int port, Limits limits);
  virtual ~Server() = default;

  // Starts the network thread and the workers; requests go to `fast`, then `handler`.
  virtual void start(Fast fast, Handler handler, Logger logger) = 0;
  // Stops accepting, closes idle connections, waits (at most `grace`) for the exchanges in
  // progress to end, then closes the rest and joins the threads.
  virtual void stop(std::chrono::milliseconds grace) = 0;
  // The largest body read from now on (413 past it, from Content-Length before the body).
  virtual void set_body_limit(size_t bytes) = 0;
};

// The status line's reason phrase of `status`.
std::string_view reason(int status);

}  // namespace expertd::serve::http
