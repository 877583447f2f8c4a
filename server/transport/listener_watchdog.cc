#include "server/transport/listener_watchdog.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "server/observability/logging.h"
#include "server/transport/listening_sockets.h"

namespace attnserve::server {
namespace {

// Where a probe reaches an address: a wildcard turned into loopback.
void WildcardToLoopback(sockaddr_storage* addr) {
  if (addr->ss_family == AF_INET) {
    auto* a4 = reinterpret_cast<sockaddr_in*>(addr);
    if (a4->sin_addr.s_addr == htonl(INADDR_ANY)) a4->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  } else if (addr->ss_family == AF_INET6) {
    auto* a6 = reinterpret_cast<sockaddr_in6*>(addr);
    if (IN6_IS_ADDR_UNSPECIFIED(&a6->sin6_addr)) a6->sin6_addr = in6addr_loopback;
  }
}

// Connections waiting in `fd`'s accept queue (for a listening socket, tcpi_unacked).
int AcceptQueueLength(int fd) {
  tcp_info info{};
  socklen_t len = sizeof(info);
  if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0) return 0;
  return static_cast<int>(info.tcpi_unacked);
}

}  // namespace

std::unique_ptr<ListenerWatchdog> ListenerWatchdog::Start(int port,
                                                          std::chrono::milliseconds interval,
                                                          std::chrono::milliseconds deadline,
                                                          std::function<void()> on_deaf) {
  std::unique_ptr<ListenerWatchdog> watchdog(new ListenerWatchdog);
  for (const ListeningSocket& socket : ListeningSocketsOn(port)) {
    watchdog->listen_fds_.push_back(socket.fd);
    watchdog->probe_addr_ = socket.address;
    watchdog->probe_addr_len_ = socket.address_len;
  }
  WildcardToLoopback(&watchdog->probe_addr_);
  if (watchdog->listen_fds_.empty()) {
    Log(LogLevel::kWarn, "listener watchdog off: no listening socket found", {{"port", port}});
    return nullptr;
  }
  watchdog->deadline_ = deadline;
  watchdog->on_deaf_ = std::move(on_deaf);
  watchdog->thread_ =
      std::make_unique<PeriodicThread>(interval, [w = watchdog.get()] { return w->Probe(); });
  return watchdog;
}

ListenerWatchdog::~ListenerWatchdog() {
  if (thread_ != nullptr) thread_->Stop();
}

bool ListenerWatchdog::Probe() {
  if (ProbeAccepted() || thread_->stopping()) return true;
  on_deaf_();
  return false;
}

bool ListenerWatchdog::ProbeAccepted() const {
  const int probe = socket(probe_addr_.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (probe < 0) return true;  // no descriptor free right now: nothing learned
  const auto until = std::chrono::steady_clock::now() + deadline_;
  bool accepted = false;
  if (connect(probe, reinterpret_cast<const sockaddr*>(&probe_addr_), probe_addr_len_) == 0 ||
      errno == EINPROGRESS) {
    pollfd p{probe, POLLOUT, 0};
    const int ms = static_cast<int>(deadline_.count());
    int error = 0;
    socklen_t error_len = sizeof(error);
    if (poll(&p, 1, ms) == 1 && getsockopt(probe, SOL_SOCKET, SO_ERROR, &error, &error_len) == 0 &&
        error == 0) {
      // Connected: the probe sits in an accept queue until gRPC accepts it (FIFO, so an empty
      // queue means it was taken).
      while (!accepted && std::chrono::steady_clock::now() < until) {
        int queued = 0;
        for (int fd : listen_fds_) queued += AcceptQueueLength(fd);
        accepted = queued == 0;
        if (!accepted) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
  }
  close(probe);
  return accepted;
}

}  // namespace attnserve::server
