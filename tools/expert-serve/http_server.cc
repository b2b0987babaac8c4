// Beast's string_view is std::string_view here.
#define BOOST_BEAST_USE_STD_STRING_VIEW
#include "http_server.h"

#include <fmt/format.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <condition_variable>
#include <deque>
#include <future>
#include <list>
#include <mutex>
#include <thread>

namespace expertd::serve::http {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = asio::ip::tcp;
using boost::system::error_code;

// Bytes of pipelined requests read ahead while one is answered; past it, reading waits.
constexpr size_t kPipelineLimit = 1 << 20;
// How long a refused connection is drained after its answer (so the client reads the answer
// rather than a reset).
constexpr auto kLinger = std::chrono::seconds(1);

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

// The status line and headers of an answer; `length` null: chunked (or, for HTTP/1.0, to the
// connection's end).
std::string head_of(int status, std::string_view content_type, const Headers& headers,
                    std::optional<size_t> length, bool keep_alive, bool http10) {
  std::string out = fmt::format("HTTP/1.1 {} {}\r\n", status, reason(status));
  if (!content_type.empty()) out += fmt::format("Content-Type: {}\r\n", content_type);
  for (const auto& [k, v] : headers) out += fmt::format("{}: {}\r\n", k, v);
  if (length) {
    out += fmt::format("Content-Length: {}\r\n", *length);
  } else if (!http10) {
    out += "Transfer-Encoding: chunked\r\n";
  }
  if (!keep_alive) out += "Connection: close\r\n";
  out += "\r\n";
  return out;
}

std::string error_json(std::string_view message) {
  // The same shape as the API's errors (api.h's error_body), without its dependencies.
  std::string escaped;
  for (const char c : message) {
    if (c == '"' || c == '\\') escaped += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    escaped += c;
  }
  return fmt::format(
      R"({{"error":{{"message":"{}","type":"invalid_request_error","param":null,"code":null}}}})",
      escaped);
}

class ServerImpl;
class Conn;

class ExchangeImpl final : public Exchange {
 public:
  ExchangeImpl(std::shared_ptr<Conn> conn, Request req, bool keep_alive, bool http10)
      : conn_(std::move(conn)), req_(std::move(req)), keep_alive_(keep_alive), http10_(http10) {}

  const Request& request() const override { return req_; }
  void reply(Response r) override;
  bool stream_begin(int status, std::string content_type, Headers headers) override;
  bool stream_write(std::string_view data) override;
  void stream_end() override;
  bool gone() const override { return gone_.load(); }
  void on_gone(std::function<void()> f) override {
    {
      std::lock_guard lock(mu_);
      if (!gone_.load()) {
        on_gone_ = std::move(f);
        return;
      }
    }
    f();
  }

  // Network thread: the client left.
  void mark_gone() {
    std::function<void()> f;
    {
      std::lock_guard lock(mu_);
      if (gone_.exchange(true)) return;
      f = std::move(on_gone_);
    }
    if (f) f();
  }
  bool answered() const { return replied_; }
  bool streaming() const { return streaming_; }
  void set_status(int status, std::string note) {
    status_ = status;
    logged_body_ = std::move(note);
  }
  void detach() { conn_.reset(); }
  // A handler failed mid-stream: the connection closes without the last chunk, so the client
  // sees a cut stream rather than a complete one.
  void abort();
  bool keep_alive() const { return keep_alive_ && !http10_stream_; }
  int status() const { return status_; }
  const std::string& logged_body() const { return logged_body_; }

 private:
  bool send(std::string data);

  std::shared_ptr<Conn> conn_;
  Request req_;
  bool keep_alive_;
  const bool http10_;
  bool replied_ = false;
  bool streaming_ = false;
  bool http10_stream_ = false;  // an HTTP/1.0 client's stream ends with the connection
  bool failed_ = false;
  int status_ = 0;
  std::string logged_body_;
  std::atomic<bool> gone_{false};
  std::mutex mu_;
  std::function<void()> on_gone_;
};

class ServerImpl final : public Server {
 public:
  explicit ServerImpl(Limits limits)
      : limits_(limits), body_limit_(limits.body_limit), acceptor_(io_) {}
  ~ServerImpl() override { stop(std::chrono::milliseconds(0)); }

  Status open(const std::string& host, int port) {
    error_code ec;
    const auto addr = asio::ip::make_address(host == "localhost" ? "127.0.0.1" : host, ec);
    if (ec) {
      return Error{EINVAL, fmt::format("cannot listen on {}:{}: '{}' is not an IP address", host,
                                       port, host)};
    }
    const tcp::endpoint ep(addr, static_cast<uint16_t>(port));
    auto fail = [&](const char* what) {
      return Error{ec.value() > 0 ? ec.value() : EINVAL,
                   fmt::format("cannot listen on {}:{}: {} ({})", host, port, ec.message(), what)};
    };
    if (acceptor_.open(ep.protocol(), ec)) return fail("socket");
    // Not SO_REUSEPORT: a second server on the same port must fail, not share it silently.
    if (acceptor_.set_option(asio::socket_base::reuse_address(true), ec)) return fail("option");
    if (acceptor_.bind(ep, ec)) return fail("bind");
    if (acceptor_.listen(asio::socket_base::max_listen_connections, ec)) return fail("listen");
    return Ok{};
  }

  void start(Fast fast, Handler handler, Logger logger) override {
    fast_ = std::move(fast);
    handler_ = std::move(handler);
    logger_ = std::move(logger);
    accept();
    io_thread_ = std::thread([this] {
      auto guard = asio::make_work_guard(io_);
      io_.run();
    });
    for (size_t i = 0; i < std::max<size_t>(1, limits_.workers); ++i) {
      workers_.emplace_back([this] { work(); });
    }
  }

  void stop(std::chrono::milliseconds grace) override;

  void set_body_limit(size_t bytes) override { body_limit_.store(bytes); }
  bool stopping() const { return stopping_.load(); }

  // Network thread.
  void accept();
  void enqueue(std::shared_ptr<ExchangeImpl> ex, std::shared_ptr<Conn> conn);
  void log(const Request* req, int status, std::string_view body) {
    if (logger_) logger_(req, status, body);
  }

  const Limits limits_;
  std::atomic<size_t> open_{0};  // before io_: the connections its destructor frees count down
  asio::io_context io_;
  Fast fast_;
  std::atomic<size_t> body_limit_;

 private:
  void work();

  tcp::acceptor acceptor_;
  asio::steady_timer accept_timer_{io_};
  uint64_t accept_errors_ = 0;  // network thread
  Handler handler_;
  Logger logger_;
  std::thread io_thread_;
  std::vector<std::thread> workers_;
  std::list<std::weak_ptr<Conn>> conns_;  // network thread
  std::atomic<bool> stopping_{false};

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<std::shared_ptr<ExchangeImpl>, std::shared_ptr<Conn>>> queue_;
  size_t active_ = 0;  // exchanges queued or being answered
  bool workers_stop_ = false;
  bool stopped_ = false;
};

class Conn : public std::enable_shared_from_this<Conn> {
 public:
  Conn(ServerImpl& s, tcp::socket sock)
      : s_(s),
        sock_(std::move(sock)),
        timer_(s.io_),
        buf_(s.limits_.header_limit + kPipelineLimit + (64 << 10)) {
    error_code ec;
    const auto ep = sock_.remote_endpoint(ec);
    if (!ec) peer_ = fmt::format("{}:{}", ep.address().to_string(), ep.port());
    sock_.set_option(tcp::no_delay(true), ec);
  }

  ~Conn() { s_.open_.fetch_sub(1); }

  void start() { wait_request(); }
  bool idle() const { return !ex_; }

  // Network thread: closes the socket (every operation on it ends).
  void close() {
    if (closed_) return;
    closed_ = true;
    disarm();
    error_code ec;
    sock_.shutdown(tcp::socket::shutdown_both, ec);
    sock_.close(ec);
    if (ex_) ex_->mark_gone();
  }

  // Any thread: writes `data` and calls done(ok) on the network thread.
  void write(std::shared_ptr<std::string> data, std::function<void(bool)> done) {
    asio::post(s_.io_, [self = shared_from_this(), data = std::move(data),
                        done = std::move(done)]() mutable {
      self->io_write(std::move(data), std::move(done));
    });
  }

  bool stopping() const { return s_.stopping(); }
  // Any thread: closes the connection (after what was written).
  void close_soon() {
    asio::post(s_.io_, [self = shared_from_this()] { self->close(); });
  }

  // Any thread: the worker ended the exchange.
  void finished(std::shared_ptr<ExchangeImpl> ex) {
    asio::post(s_.io_, [self = shared_from_this(), ex = std::move(ex)] { self->io_finished(*ex); });
  }

 private:
  // --- deadlines: one timer, armed for the phase at hand ---
  template <typename F>
  void arm(std::chrono::milliseconds d, F on_expire) {
    timer_.expires_after(d);
    timer_.async_wait([self = shared_from_this(), gen = ++timer_gen_,
                       on_expire = std::move(on_expire)](error_code ec) mutable {
      if (ec || gen != self->timer_gen_ || self->closed_) return;
      on_expire();
    });
  }
  void disarm() {
    ++timer_gen_;
    timer_.cancel();
  }

  // --- reading requests ---
  void wait_request() {
    if (closed_) return;
    if (buf_.size() > 0) return read_head();
    arm(s_.limits_.idle_timeout, [this] { close(); });
    sock_.async_wait(tcp::socket::wait_read, [self = shared_from_this()](error_code ec) {
      if (ec) return self->close();
      self->read_head();
    });
  }

  void read_head() {
    if (closed_) return;
    parser_.emplace();
    parser_->header_limit(static_cast<uint32_t>(s_.limits_.header_limit));
    parser_->body_limit(s_.body_limit_.load());
    cut_ = false;
    arm(s_.limits_.header_timeout, [this] { cut(); });
    bhttp::async_read_header(
        sock_, buf_, *parser_,
        [self = shared_from_this()](error_code ec, size_t) { self->on_head(ec); });
  }

  // A deadline passed while reading: the read is cancelled and the request answered 408.
  void cut() {
    cut_ = true;
    error_code ec;
    sock_.cancel(ec);
  }

  // Classifies a read's failure; true when the request goes no further.
  bool failed(error_code ec, const char* phase) {
    if (!ec) return false;
    if (cut_) {
      const auto limit = phase[0] == 'h' ? s_.limits_.header_timeout : s_.limits_.body_timeout;
      refuse(408, fmt::format("the request's {} did not arrive within {} s", phase,
                              std::chrono::duration<double>(limit).count()));
    } else if (ec == bhttp::error::end_of_stream || ec == asio::error::eof ||
               ec == asio::error::connection_reset || ec == asio::error::operation_aborted ||
               ec == bhttp::error::partial_message) {
      close();  // the client left (or closed an idle keep-alive connection)
    } else if (ec == bhttp::error::header_limit) {
      refuse(431,
             fmt::format("the request's head is larger than {} bytes", s_.limits_.header_limit));
    } else if (ec == bhttp::error::body_limit) {
      refuse(413, fmt::format("the body is larger than {} bytes, more than any request that "
                              "fits the context can take",
                              s_.body_limit_.load()));
    } else if (ec == bhttp::error::bad_content_length) {
      refuse(400, "malformed HTTP request: Content-Length is not a valid length");
    } else {
      refuse(400, "malformed HTTP request: " + ec.message());
    }
    return true;
  }

  void on_head(error_code ec) {
    if (failed(ec, "head")) return;
    const auto& h = parser_->get();
    if (const auto it = h.find(bhttp::field::expect); it != h.end()) {
      if (!beast::iequals(it->value(), "100-continue")) {
        return refuse(417, fmt::format("Expect: {} is not supported", std::string(it->value())));
      }
      if (!parser_->is_done()) {
        auto cont = std::make_shared<std::string>("HTTP/1.1 100 Continue\r\n\r\n");
        return io_write(cont, [self = shared_from_this()](bool ok) {
          if (ok) self->read_body();
        });
      }
    }
    read_body();
  }

  void read_body() {
    if (closed_) return;
    cut_ = false;
    arm(s_.limits_.body_timeout, [this] { cut(); });
    bhttp::async_read(sock_, buf_, *parser_,
                      [self = shared_from_this()](error_code ec, size_t) { self->on_body(ec); });
  }

  void on_body(error_code ec) {
    if (failed(ec, "body")) return;
    disarm();
    auto& m = parser_->get();
    Request req;
    req.method = std::string(m.method_string());
    req.target = std::string(m.target());
    const size_t q = req.target.find('?');
    req.path = req.target.substr(0, q);
    if (q != std::string::npos) req.query = req.target.substr(q + 1);
    for (const auto& f : m)
      req.headers.emplace_back(lower(f.name_string()), std::string(f.value()));
    req.body = std::move(m.body());
    req.peer = peer_;
    const bool http10 = m.version() < 11;
    const bool keep_alive = m.keep_alive();
    if (m.find(bhttp::field::content_encoding) != m.end() &&
        !beast::iequals(m[bhttp::field::content_encoding], "identity")) {
      return refuse(415, fmt::format("Content-Encoding: {} is not supported: send the body as is",
                                     std::string(m[bhttp::field::content_encoding])));
    }
    parser_.reset();
    if (req.method == "HEAD") {
      req.method = "GET";
      req.head = true;
    }
    dispatch(std::move(req), keep_alive, http10);
  }

  void dispatch(Request req, bool keep_alive, bool http10) {
    keep_alive = keep_alive && !s_.stopping();  // a stopping server answers and closes
    std::optional<Response> fast;
    try {
      if (s_.fast_) fast = s_.fast_(req);
    } catch (const std::exception& e) {
      fast = Response{
          500, "application/json", {}, error_json(fmt::format("internal error: {}", e.what()))};
    }
    if (fast) {
      s_.log(&req, fast->status, fast->body);
      auto data = std::make_shared<std::string>(head_of(
          fast->status, fast->content_type, fast->headers, fast->body.size(), keep_alive, http10));
      if (!req.head) *data += fast->body;
      return io_write(data, [self = shared_from_this(), keep_alive](bool ok) {
        if (!ok) return;
        if (keep_alive) {
          self->wait_request();
        } else {
          self->linger_close();
        }
      });
    }
    ex_ = std::make_shared<ExchangeImpl>(shared_from_this(), std::move(req), keep_alive, http10);
    watch();
    s_.enqueue(ex_, shared_from_this());
  }

  // While a worker answers: reads on, so that the client leaving is seen at once (and requests
  // pipelined behind this one are kept for later).
  void watch() {
    if (closed_ || watching_ || buf_.size() >= kPipelineLimit) return;
    watching_ = true;
    const size_t room = std::min<size_t>(64 << 10, buf_.max_size() - buf_.size());
    sock_.async_read_some(buf_.prepare(room), [self = shared_from_this()](error_code ec, size_t n) {
      self->on_watch(ec, n);
    });
  }

  void on_watch(error_code ec, size_t n) {
    watching_ = false;
    buf_.commit(n);
    if (closed_) return;
    if (ec && ec != asio::error::operation_aborted) {
      // EOF or a reset: the client is gone; the exchange (if still running) stops.
      peer_gone_ = true;
      if (ex_) ex_->mark_gone();
      if (resume_ || close_after_ || !ex_) close();
      return;
    }
    if (close_after_) return linger_close();
    if (resume_) {
      resume_ = false;
      return wait_request();
    }
    if (!ec) watch();
  }

  void io_finished(ExchangeImpl& ex) {
    ex_.reset();
    ex.detach();  // breaks the exchange's hold on this connection
    if (closed_) return;
    if (!ex.keep_alive() || peer_gone_ || s_.stopping()) {
      if (!watching_) return linger_close();
      close_after_ = true;  // the watch's completion closes: one read at a time
      error_code ec;
      sock_.cancel(ec);
      return;
    }
    if (watching_) {
      resume_ = true;  // the watch's completion goes on to the next request
      error_code ec;
      sock_.cancel(ec);
      return;
    }
    wait_request();
  }

  void io_write(std::shared_ptr<std::string> data, std::function<void(bool)> done) {
    if (closed_) return done(false);
    arm(s_.limits_.write_timeout, [this] { close(); });
    asio::async_write(
        sock_, asio::buffer(*data),
        [self = shared_from_this(), data, done = std::move(done)](error_code ec, size_t) {
          if (!self->closed_) self->disarm();
          done(!ec);  // the writer learns first; then the exchange's on_gone runs
          if (ec) {
            self->peer_gone_ = true;
            if (self->ex_) self->ex_->mark_gone();
            self->close();
          }
        });
  }

  // Answers `status` with `message` and closes the connection (the request is not read further).
  void refuse(int status, const std::string& message) {
    if (closed_) return;
    parser_.reset();
    const std::string body = error_json(message);
    s_.log(nullptr, status, body);
    auto data = std::make_shared<std::string>(
        head_of(status, "application/json", {}, body.size(), false, false) + body);
    io_write(data, [self = shared_from_this()](bool ok) {
      if (ok) self->linger_close();
    });
  }

  // Ends the sending side and drains what the client still sends (briefly) before closing, so
  // that it reads the answer rather than a reset.
  void linger_close() {
    if (closed_) return;
    error_code ec;
    sock_.shutdown(tcp::socket::shutdown_send, ec);
    arm(kLinger, [this] { close(); });
    drain();
  }
  void drain() {
    auto scratch = std::make_shared<std::array<char, 4096>>();
    sock_.async_read_some(asio::buffer(*scratch),
                          [self = shared_from_this(), scratch](error_code ec, size_t) {
                            if (ec) return self->close();
                            self->drain();
                          });
  }

  ServerImpl& s_;
  tcp::socket sock_;
  asio::steady_timer timer_;
  uint64_t timer_gen_ = 0;
  beast::flat_buffer buf_;
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  std::shared_ptr<ExchangeImpl> ex_;
  std::string peer_;
  bool closed_ = false;
  bool cut_ = false;
  bool watching_ = false;
  bool resume_ = false;
  bool close_after_ = false;
  bool peer_gone_ = false;
  friend class ServerImpl;
};

// --- the exchange, on a worker ---
bool ExchangeImpl::send(std::string data) {
  if (failed_) return false;
  auto done = std::make_shared<std::promise<bool>>();
  auto f = done->get_future();
  conn_->write(std::make_shared<std::string>(std::move(data)),
               [done](bool ok) { done->set_value(ok); });
  if (!f.get()) failed_ = true;
  return !failed_;
}

void ExchangeImpl::reply(Response r) {
  if (replied_) return;
  replied_ = true;
  status_ = r.status;
  logged_body_ = r.body.substr(0, 300);
  if (conn_->stopping()) keep_alive_ = false;  // a stopping server says it closes
  std::string data =
      head_of(r.status, r.content_type, r.headers, r.body.size(), keep_alive_, http10_);
  if (!req_.head) data += r.body;
  send(std::move(data));
}

bool ExchangeImpl::stream_begin(int status, std::string content_type, Headers headers) {
  if (replied_) return false;
  replied_ = true;
  streaming_ = true;
  status_ = status;
  http10_stream_ = http10_;
  if (conn_->stopping()) keep_alive_ = false;
  return send(
      head_of(status, content_type, headers, std::nullopt, keep_alive_ && !http10_, http10_));
}

bool ExchangeImpl::stream_write(std::string_view data) {
  if (!streaming_ || data.empty()) return streaming_ && !failed_;
  if (http10_) return send(std::string(data));
  return send(fmt::format("{:x}\r\n{}\r\n", data.size(), data));
}

void ExchangeImpl::abort() {
  streaming_ = false;
  failed_ = true;
  conn_->close_soon();
}

void ExchangeImpl::stream_end() {
  if (!streaming_) return;
  streaming_ = false;
  if (!http10_) send("0\r\n\r\n");
}

// --- the server ---
void ServerImpl::accept() {
  acceptor_.async_accept([this](error_code ec, tcp::socket sock) {
    if (ec == asio::error::operation_aborted || stopping_) return;
    if (!ec) {
      if (open_.load() >= limits_.max_connections) {
        // Refused cheaply: a canned answer written without waiting, then closed.
        const std::string body = error_json(
            fmt::format("the server has {} connections open (--max-connections); retry later",
                        limits_.max_connections));
        const std::string data =
            head_of(503, "application/json", {{"Retry-After", "1"}}, body.size(), false, false) +
            body;
        error_code ignored;
        sock.non_blocking(true, ignored);
        (void)::send(sock.native_handle(), data.data(), data.size(), MSG_NOSIGNAL);
        sock.shutdown(tcp::socket::shutdown_both, ignored);
        sock.close(ignored);
        log(nullptr, 503, body);
      } else {
        auto c = std::make_shared<Conn>(*this, std::move(sock));
        conns_.push_back(c);
        open_.fetch_add(1);
        c->start();
      }
    }
    // Prune the closed ones now and then.
    if (conns_.size() > 2 * open_.load() + 64)
      conns_.remove_if([](auto& w) { return w.expired(); });
    if (!ec) return accept();
    // No descriptor left (EMFILE) or the like: try again in a while rather than spin.
    if (accept_errors_++ == 0) log(nullptr, 503, "accept failed: " + ec.message());
    accept_timer_.expires_after(std::chrono::milliseconds(100));
    accept_timer_.async_wait([this](error_code tec) {
      if (!tec && !stopping_) accept();
    });
  });
}

void ServerImpl::enqueue(std::shared_ptr<ExchangeImpl> ex, std::shared_ptr<Conn> conn) {
  {
    std::lock_guard lock(mu_);
    queue_.emplace_back(std::move(ex), std::move(conn));
    ++active_;
  }
  cv_.notify_one();
}

void ServerImpl::work() {
  for (;;) {
    std::shared_ptr<ExchangeImpl> ex;
    std::shared_ptr<Conn> conn;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return workers_stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      ex = std::move(queue_.front().first);
      conn = std::move(queue_.front().second);
      queue_.pop_front();
    }
    std::string failure = "the handler gave no answer";
    bool threw = false;
    try {
      handler_(*ex);
    } catch (const std::exception& e) {
      failure = e.what();
      threw = true;
    } catch (...) {
      failure = "unknown exception";
      threw = true;
    }
    if (!ex->answered() && ex->gone() && !threw) {
      // The client left before its answer: nobody to answer (nginx's 499 in the log).
      ex->set_status(499, "the client closed the connection before the answer");
    } else if (!ex->answered()) {
      ex->reply(Response{
          500, "application/json", {}, error_json(fmt::format("internal error: {}", failure))});
    } else if (threw && ex->streaming()) {
      ex->abort();
    }
    ex->stream_end();
    log(&ex->request(), ex->status(), ex->logged_body());
    conn->finished(ex);
    {
      std::lock_guard lock(mu_);
      --active_;
    }
    cv_.notify_all();
  }
}

void ServerImpl::stop(std::chrono::milliseconds grace) {
  {
    std::lock_guard lock(mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  stopping_ = true;
  auto on_io = [this](auto f) {
    if (!io_thread_.joinable()) return f();
    std::promise<void> done;
    asio::post(io_, [&] {
      f();
      done.set_value();
    });
    done.get_future().wait();
  };
  // Stop accepting; close the idle connections.
  on_io([this] {
    error_code ec;
    acceptor_.close(ec);
    accept_timer_.cancel();
    for (auto& w : conns_) {
      if (auto c = w.lock(); c && c->idle()) c->close();
    }
  });
  // The exchanges in progress end by themselves (the generator answers them when it stops).
  {
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, grace, [&] { return active_ == 0; });
  }
  on_io([this] {
    for (auto& w : conns_) {
      if (auto c = w.lock()) c->close();
    }
  });
  {
    std::lock_guard lock(mu_);
    workers_stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
  // After the handlers the workers posted last (their exchanges' ends), so no connection leaks.
  if (io_thread_.joinable()) {
    asio::post(io_, [this] { io_.stop(); });
  } else {
    io_.stop();
  }
  if (io_thread_.joinable()) io_thread_.join();
}

}  // namespace

std::optional<std::string_view> Request::header(std::string_view name) const {
  for (const auto& [k, v] : headers) {
    if (k == name) return std::string_view(v);
  }
  return std::nullopt;
}

std::optional<std::string_view> Request::query_value(std::string_view key) const {
  std::string_view q = query;
  while (!q.empty()) {
    const size_t amp = q.find('&');
    const std::string_view part = q.substr(0, amp);
    const size_t eq = part.find('=');
    if (part.substr(0, eq) == key) {
      return eq == std::string_view::npos ? std::string_view() : part.substr(eq + 1);
    }
    if (amp == std::string_view::npos) break;
    q.remove_prefix(amp + 1);
  }
  return std::nullopt;
}

Result<std::unique_ptr<Server>> Server::bind(const std::string& host, int port, Limits limits) {
  auto s = std::make_unique<ServerImpl>(limits);
  if (auto st = s->open(host, port); !st) return st.take_error();
  return std::unique_ptr<Server>(std::move(s));
}

std::string_view reason(int status) {
  return bhttp::obsolete_reason(static_cast<bhttp::status>(status));
}

}  // namespace expertd::serve::http
