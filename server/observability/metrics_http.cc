#include "server/observability/metrics_http.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/observability/logging.h"

namespace attnserve::server {
namespace {

using Clock = std::chrono::steady_clock;

// The limits that keep the port answering whatever its clients do. One thread polls every
// connection, so a client that holds one open (idle, or sending a byte every few seconds) costs
// a slot and its buffer, not the thread: measured, 100 such clients leave a scrape answering in
// about a millisecond (tests/server/metrics_port_test.cc), where civetweb's 2 threads answered
// none in 12 probes.
// Connections open at once. Past it, the oldest one not being answered (no request yet, or
// answered and lingering) is closed for the newcomer: a flood cannot keep Prometheus out for
// longer than it takes to retry.
constexpr size_t kMaxConnections = 256;
// From accept to the request's blank line, TLS handshake included. Prometheus sends its request
// at once; a client that has not by then is closed, however steadily it trickles bytes.
constexpr auto kRequestTimeout = std::chrono::seconds(5);
// To write the answer (a large exposition to a slow reader).
constexpr auto kResponseTimeout = std::chrono::seconds(10);
// After the answer, how long the client gets to close its side before the socket is closed
// (closing with unread input would reset the connection and could cut the answer short).
constexpr auto kLingerTimeout = std::chrono::seconds(2);
// A request head (request line and headers) longer than this is refused (431).
constexpr size_t kMaxRequestBytes = 8192;
// Connections accepted per wake-up, so a burst cannot starve those already open.
constexpr int kAcceptBurst = 64;
// When accept fails for lack of descriptors, how long the listener is left alone.
constexpr auto kAcceptPause = std::chrono::milliseconds(100);

// The reason of OpenSSL's most recent error on this thread, cleared.
std::string OpenSslError() {
  const unsigned long code = ERR_get_error();
  ERR_clear_error();
  if (code == 0) return "no detail from OpenSSL";
  char text[256];
  ERR_error_string_n(code, text, sizeof(text));
  return text;
}

struct SslCtxFree {
  void operator()(SSL_CTX* ctx) const { SSL_CTX_free(ctx); }
};
using SslCtxPtr = std::unique_ptr<SSL_CTX, SslCtxFree>;

// The server certificate and key, re-read when the files change (a Kubernetes Secret or
// cert-manager rotates them in place). A connection keeps the context it started with: OpenSSL
// counts references, so replacing the context frees nothing in use.
class TlsContext {
 public:
  static absl::StatusOr<std::unique_ptr<TlsContext>> Load(std::string cert, std::string key,
                                                          std::chrono::seconds refresh) {
    std::unique_ptr<TlsContext> tls(new TlsContext(std::move(cert), std::move(key), refresh));
    absl::StatusOr<SslCtxPtr> ctx = tls->Make();
    if (!ctx.ok()) return ctx.status();
    tls->ctx_ = *std::move(ctx);
    tls->stamp_ = tls->Stamp();
    tls->checked_ = Clock::now();
    return tls;
  }

  // The context for a new connection, after a look at the files once per refresh period.
  SSL_CTX* ForNewConnection() {
    const Clock::time_point now = Clock::now();
    if (now - checked_ < refresh_) return ctx_.get();
    checked_ = now;
    const std::string stamp = Stamp();
    if (stamp == stamp_) return ctx_.get();
    stamp_ = stamp;  // a bad pair is reported once, not at every check
    absl::StatusOr<SslCtxPtr> ctx = Make();
    if (!ctx.ok()) {
      Log(LogLevel::kWarn, "metrics TLS files not reloaded; the previous ones stay in force",
          {{"error", std::string(ctx.status().message())}});
      return ctx_.get();
    }
    ctx_ = *std::move(ctx);
    Log(LogLevel::kInfo, "metrics TLS certificate reloaded", {{"cert", cert_}});
    return ctx_.get();
  }

 private:
  TlsContext(std::string cert, std::string key, std::chrono::seconds refresh)
      : cert_(std::move(cert)), key_(std::move(key)), refresh_(refresh) {}

  absl::StatusOr<SslCtxPtr> Make() const {
    ERR_clear_error();
    SslCtxPtr ctx(SSL_CTX_new(TLS_server_method()));
    if (ctx == nullptr) return absl::InternalError("metrics TLS: " + OpenSslError());
    SSL_CTX_set_min_proto_version(ctx.get(), TLS1_2_VERSION);
    // Writes resume from where a partial one stopped, from a buffer that may have moved.
    SSL_CTX_set_mode(ctx.get(),
                     SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    if (SSL_CTX_use_certificate_chain_file(ctx.get(), cert_.c_str()) != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("metrics TLS: --tls-cert ", cert_, ": ", OpenSslError()));
    }
    if (SSL_CTX_use_PrivateKey_file(ctx.get(), key_.c_str(), SSL_FILETYPE_PEM) != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("metrics TLS: --tls-key ", key_, ": ", OpenSslError()));
    }
    if (SSL_CTX_check_private_key(ctx.get()) != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("metrics TLS: --tls-key ", key_, " does not match --tls-cert ", cert_));
    }
    return ctx;
  }

  // The files' identities (mtime, size, inode), to notice a change without reading them.
  std::string Stamp() const {
    std::string stamp;
    for (const std::string* path : {&cert_, &key_}) {
      struct stat st {};
      if (stat(path->c_str(), &st) != 0) continue;
      absl::StrAppend(&stamp, st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec, "/", st.st_size, "/",
                      st.st_ino, ";");
    }
    return stamp;
  }

  const std::string cert_;
  const std::string key_;
  const std::chrono::seconds refresh_;
  SslCtxPtr ctx_;
  std::string stamp_;
  Clock::time_point checked_;
};

// What the endpoint acts on in a request head.
struct RequestHead {
  bool valid = false;
  absl::string_view method;
  absl::string_view path;  // the target without its query
  absl::string_view authorization;
};

// Parses the request line and finds the Authorization header. Invalid: a malformed request
// line, a version other than HTTP/1.x, a header line without a colon, or two Authorization
// headers (which one would count is ambiguous).
RequestHead ParseHead(absl::string_view head) {
  RequestHead request;
  std::vector<absl::string_view> lines = absl::StrSplit(head, '\n');
  for (absl::string_view& line : lines) absl::ConsumeSuffix(&line, "\r");
  if (lines.empty()) return request;
  const std::vector<absl::string_view> parts = absl::StrSplit(lines[0], ' ');
  if (parts.size() != 3 || !absl::StartsWith(parts[2], "HTTP/1.")) return request;
  request.method = parts[0];
  request.path = parts[1].substr(0, parts[1].find('?'));
  bool seen_authorization = false;
  for (size_t i = 1; i < lines.size(); ++i) {
    if (lines[i].empty()) continue;
    const size_t colon = lines[i].find(':');
    if (colon == absl::string_view::npos) return request;
    if (!absl::EqualsIgnoreCase(lines[i].substr(0, colon), "authorization")) continue;
    if (seen_authorization) return request;
    seen_authorization = true;
    request.authorization = absl::StripAsciiWhitespace(lines[i].substr(colon + 1));
  }
  request.valid = true;
  return request;
}

// A whole answer; the connection closes after it, so it always says so.
std::string Response(absl::string_view status, absl::string_view content_type,
                     absl::string_view body, absl::string_view extra_headers = "") {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", content_type,
                      "\r\nContent-Length: ", body.size(), "\r\n", extra_headers,
                      "Connection: close\r\n\r\n", body);
}

std::string TextResponse(absl::string_view status, absl::string_view extra_headers = "") {
  return Response(status, "text/plain; charset=utf-8", absl::StrCat(status, "\n"), extra_headers);
}

// Where a request head ends (just past its blank line), or npos while it is incomplete.
size_t HeadEnd(const std::string& in) {
  const size_t crlf = in.find("\r\n\r\n");
  if (crlf != std::string::npos) return crlf + 4;
  const size_t lf = in.find("\n\n");
  return lf == std::string::npos ? std::string::npos : lf + 2;
}

// Binds and listens on HOST:PORT (HOST may be a [bracketed] IPv6 address); the socket.
absl::StatusOr<int> Listen(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("'", listen, "': expected HOST:PORT"));
  }
  std::string host = listen.substr(0, colon);
  const std::string port = listen.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (const int error = getaddrinfo(host.c_str(), port.c_str(), &hints, &found); error != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", listen, ": ", gai_strerror(error)));
  }
  std::string last_error = "no address";
  int fd = -1;
  for (const addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    // A restart may bind while the previous process' connections linger in TIME_WAIT; a port
    // another socket listens on still fails (no SO_REUSEPORT).
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, SOMAXCONN) != 0) {
      last_error = std::strerror(errno);
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", listen, ": ", last_error));
  }
  return fd;
}

int BoundPort(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) return 0;
  if (address.ss_family == AF_INET6) {
    return ntohs(reinterpret_cast<const sockaddr_in6*>(&address)->sin6_port);
  }
  return ntohs(reinterpret_cast<const sockaddr_in*>(&address)->sin_port);
}

// One client connection, from accept to close.
struct Connection {
  enum class State { kHandshake, kReading, kWriting, kLingering, kClosed };

  int fd = -1;
  SSL* ssl = nullptr;  // null: plain HTTP
  State state = State::kReading;
  Clock::time_point accepted;
  Clock::time_point deadline;  // of the current state; passed: the connection is closed
  short events = POLLIN;       // what the next poll waits for
  std::string in;              // the request head read so far
  std::string out;             // the answer
  size_t written = 0;
};

// How one read or write attempt ended.
enum class Io { kProgress, kWantRead, kWantWrite, kClosed };

Io SslIo(SSL* ssl, int result) {
  if (result > 0) return Io::kProgress;
  switch (SSL_get_error(ssl, result)) {
    case SSL_ERROR_WANT_READ:
      return Io::kWantRead;
    case SSL_ERROR_WANT_WRITE:
      return Io::kWantWrite;
    default:
      ERR_clear_error();
      return Io::kClosed;
  }
}

Io SocketIo(ssize_t result) {
  if (result > 0) return Io::kProgress;
  if (result < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
    return Io::kWantRead;  // the caller knows which direction it waits for
  }
  return Io::kClosed;
}

// Reads what the peer sent into `c.in`, up to a whole head or the size limit.
Io ReadSome(Connection& c) {
  char buffer[4096];
  while (c.in.size() <= kMaxRequestBytes && HeadEnd(c.in) == std::string::npos) {
    Io io;
    if (c.ssl != nullptr) {
      ERR_clear_error();
      const int n = SSL_read(c.ssl, buffer, sizeof(buffer));
      io = SslIo(c.ssl, n);
      if (io == Io::kProgress) c.in.append(buffer, n);
    } else {
      const ssize_t n = recv(c.fd, buffer, sizeof(buffer), 0);
      io = SocketIo(n);
      if (io == Io::kProgress) c.in.append(buffer, n);
    }
    if (io != Io::kProgress) return io;
  }
  return Io::kProgress;
}

// Writes what is left of `c.out`.
Io WriteSome(Connection& c) {
  while (c.written < c.out.size()) {
    const char* data = c.out.data() + c.written;
    const size_t size = c.out.size() - c.written;
    Io io;
    if (c.ssl != nullptr) {
      ERR_clear_error();
      const int n = SSL_write(c.ssl, data, static_cast<int>(std::min<size_t>(size, 1 << 20)));
      io = SslIo(c.ssl, n);
      if (io == Io::kProgress) c.written += n;
    } else {
      const ssize_t n = send(c.fd, data, size, MSG_NOSIGNAL);
      io = SocketIo(n);
      if (io == Io::kWantRead) io = Io::kWantWrite;
      if (io == Io::kProgress) c.written += n;
    }
    if (io != Io::kProgress) return io;
  }
  return Io::kProgress;
}

short EventsFor(Io io) { return io == Io::kWantWrite ? POLLOUT : POLLIN; }

}  // namespace

// The endpoint's thread and every connection it holds; only that thread touches them.
class MetricsHttpServer::Loop {
 public:
  Loop(int listen_fd, int wake_fd, std::unique_ptr<TlsContext> tls, MetricsHttpOptions options,
       Render render)
      : listen_fd_(listen_fd),
        wake_fd_(wake_fd),
        port_(BoundPort(listen_fd)),
        tls_(std::move(tls)),
        options_(std::move(options)),
        render_(std::move(render)) {
    thread_ = std::thread([this] { Run(); });
  }

  ~Loop() {
    const uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = write(wake_fd_, &one, sizeof(one));
    thread_.join();
    for (Connection& c : connections_) Close(c);
    close(listen_fd_);
    close(wake_fd_);
  }

  int port() const { return port_; }

 private:
  void Run() {
    // OpenSSL writes to the socket with write(), which raises SIGPIPE when the peer is gone;
    // blocked on this thread, it only makes the write fail (EPIPE).
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
    std::vector<pollfd> fds;
    while (true) {
      const bool accepting = CanAccept();
      fds.clear();
      fds.push_back({wake_fd_, POLLIN, 0});
      fds.push_back({accepting ? listen_fd_ : -1, POLLIN, 0});
      for (const Connection& c : connections_) fds.push_back({c.fd, c.events, 0});
      if (poll(fds.data(), fds.size(), PollTimeoutMs()) < 0 && errno != EINTR) {
        Log(LogLevel::kError, "metrics endpoint stopped: poll failed",
            {{"error", std::string(std::strerror(errno))}});
        return;
      }
      if (fds[0].revents != 0) return;
      const Clock::time_point now = Clock::now();
      for (size_t i = 0; i < connections_.size(); ++i) {
        Connection& c = connections_[i];
        if (fds[i + 2].revents != 0) Advance(c);
        if (c.state != Connection::State::kClosed && now >= c.deadline) Close(c);
      }
      std::erase_if(connections_,
                    [](const Connection& c) { return c.state == Connection::State::kClosed; });
      if (fds[1].revents != 0) Accept();
    }
  }

  // Until the nearest deadline (or the end of an accept pause), at least 1 ms.
  int PollTimeoutMs() const {
    Clock::time_point next = Clock::now() + std::chrono::seconds(60);
    for (const Connection& c : connections_) next = std::min(next, c.deadline);
    if (accept_paused_until_ > Clock::now()) next = std::min(next, accept_paused_until_);
    const auto wait = std::chrono::ceil<std::chrono::milliseconds>(next - Clock::now()).count();
    return static_cast<int>(std::max<int64_t>(wait, 1));
  }

  bool CanAccept() const {
    if (accept_paused_until_ > Clock::now()) return false;
    return connections_.size() < kMaxConnections ||
           std::any_of(connections_.begin(), connections_.end(), Evictable);
  }

  // Not in the middle of writing an answer.
  static bool Evictable(const Connection& c) { return c.state != Connection::State::kWriting; }

  void Accept() {
    for (int i = 0; i < kAcceptBurst; ++i) {
      if (connections_.size() >= kMaxConnections) {
        // The oldest connection not being answered makes room (connections_ is in accept order).
        auto oldest = std::find_if(connections_.begin(), connections_.end(), Evictable);
        if (oldest == connections_.end()) return;
        Close(*oldest);
        connections_.erase(oldest);
      }
      const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          accept_paused_until_ = Clock::now() + kAcceptPause;
        }
        return;
      }
      const int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      Connection c;
      c.fd = fd;
      c.accepted = Clock::now();
      c.deadline = c.accepted + kRequestTimeout;
      if (tls_ != nullptr) {
        c.ssl = SSL_new(tls_->ForNewConnection());
        if (c.ssl == nullptr || SSL_set_fd(c.ssl, fd) != 1) {
          ERR_clear_error();
          Close(c);
          continue;
        }
        SSL_set_accept_state(c.ssl);
        c.state = Connection::State::kHandshake;
      }
      connections_.push_back(std::move(c));
    }
  }

  // Takes the connection as far as it can go without waiting.
  void Advance(Connection& c) {
    if (c.state == Connection::State::kHandshake) {
      ERR_clear_error();
      const Io io = SslIo(c.ssl, SSL_do_handshake(c.ssl));
      if (io == Io::kClosed) return Close(c);
      if (io != Io::kProgress) {
        c.events = EventsFor(io);
        return;
      }
      c.state = Connection::State::kReading;
    }
    if (c.state == Connection::State::kReading) {
      const Io io = ReadSome(c);
      if (io != Io::kProgress) {
        if (io == Io::kClosed) return Close(c);
        c.events = EventsFor(io);
        return;
      }
      c.out = Answer(c.in);
      c.state = Connection::State::kWriting;
      c.deadline = Clock::now() + kResponseTimeout;
    }
    if (c.state == Connection::State::kWriting) {
      const Io io = WriteSome(c);
      if (io != Io::kProgress) {
        if (io == Io::kClosed) return Close(c);
        c.events = EventsFor(io);
        return;
      }
      // Done: tell the peer (TLS close_notify, then FIN) and wait for it to close its side.
      if (c.ssl != nullptr) SSL_shutdown(c.ssl);
      ERR_clear_error();
      shutdown(c.fd, SHUT_WR);
      c.state = Connection::State::kLingering;
      c.deadline = Clock::now() + kLingerTimeout;
      c.events = POLLIN;
    }
    if (c.state == Connection::State::kLingering) {
      char discard[4096];
      ssize_t n;
      while ((n = recv(c.fd, discard, sizeof(discard), 0)) > 0) {
      }
      if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) Close(c);
    }
  }

  // The answer to a request head (`in` holds it, and perhaps more).
  std::string Answer(const std::string& in) {
    const size_t end = HeadEnd(in);
    if (end == std::string::npos || end > kMaxRequestBytes) {
      return TextResponse("431 Request Header Fields Too Large");
    }
    const RequestHead request = ParseHead(absl::string_view(in).substr(0, end));
    if (!request.valid) return TextResponse("400 Bad Request");
    // Checked first, so that a client without a token learns nothing, not even which paths exist.
    if (options_.authorize && !options_.authorize(request.authorization)) {
      return TextResponse("401 Unauthorized", "WWW-Authenticate: Bearer realm=\"metrics\"\r\n");
    }
    if (request.path != "/metrics") return TextResponse("404 Not Found");
    if (request.method != "GET") return TextResponse("405 Method Not Allowed", "Allow: GET\r\n");
    return Response("200 OK", "text/plain; version=0.0.4; charset=utf-8", render_());
  }

  void Close(Connection& c) {
    if (c.state == Connection::State::kClosed) return;
    if (c.ssl != nullptr) SSL_free(c.ssl);
    if (c.fd >= 0) close(c.fd);
    c.ssl = nullptr;
    c.fd = -1;
    c.state = Connection::State::kClosed;
  }

  const int listen_fd_;
  const int wake_fd_;
  const int port_;
  const std::unique_ptr<TlsContext> tls_;  // null: plain HTTP
  const MetricsHttpOptions options_;
  const Render render_;
  std::vector<Connection> connections_;  // in accept order
  Clock::time_point accept_paused_until_;
  std::thread thread_;
};

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    MetricsHttpOptions options, Render render) {
  if (options.tls_cert.empty() != options.tls_key.empty()) {
    return absl::InvalidArgumentError("metrics TLS needs both a certificate and a key");
  }
  std::unique_ptr<TlsContext> tls;
  if (!options.tls_cert.empty()) {
    absl::StatusOr<std::unique_ptr<TlsContext>> loaded = TlsContext::Load(
        options.tls_cert, options.tls_key, std::chrono::seconds(options.tls_refresh_seconds));
    if (!loaded.ok()) return loaded.status();
    tls = *std::move(loaded);
  }
  absl::StatusOr<int> listen_fd = Listen(options.listen);
  if (!listen_fd.ok()) return listen_fd.status();
  const int wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd < 0) {
    close(*listen_fd);
    return absl::InternalError(absl::StrCat("metrics: eventfd: ", std::strerror(errno)));
  }
  return std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer(std::make_unique<Loop>(
      *listen_fd, wake_fd, std::move(tls), std::move(options), std::move(render))));
}

MetricsHttpServer::MetricsHttpServer(std::unique_ptr<Loop> loop) : loop_(std::move(loop)) {}

MetricsHttpServer::~MetricsHttpServer() = default;

int MetricsHttpServer::port() const { return loop_->port(); }

}  // namespace attnserve::server
