#include "server/frontends/http/slow_read_cutter.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstdlib>
#include <utility>

namespace attnserve::server {
namespace {

// An address and port as `address` holds them; false when it is neither IPv4 nor IPv6.
bool AddressAndPort(const sockaddr_storage& address, std::string* text, int* port) {
  char buffer[INET6_ADDRSTRLEN] = {};
  if (address.ss_family == AF_INET) {
    const auto& v4 = reinterpret_cast<const sockaddr_in&>(address);
    inet_ntop(AF_INET, &v4.sin_addr, buffer, sizeof(buffer));
    *port = ntohs(v4.sin_port);
  } else if (address.ss_family == AF_INET6) {
    const auto& v6 = reinterpret_cast<const sockaddr_in6&>(address);
    inet_ntop(AF_INET6, &v6.sin6_addr, buffer, sizeof(buffer));
    *port = ntohs(v6.sin6_port);
  } else {
    return false;
  }
  *text = buffer;
  return true;
}

// The descriptor of this process's TCP socket from `peer_address`:`peer_port` to local port
// `local_port`, or -1. (An IPv4 peer of a dual-stack listener reads as ::ffff:a.b.c.d.)
int FindSocket(const std::string& peer_address, int peer_port, int local_port) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int found = -1;
  while (const dirent* entry = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0' || fd == dirfd(dir)) continue;
    sockaddr_storage peer{}, local{};
    socklen_t peer_size = sizeof(peer), local_size = sizeof(local);
    std::string address, unused;
    int port = 0, local_port_found = 0;
    if (getpeername(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&peer), &peer_size) != 0 ||
        getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&local), &local_size) != 0 ||
        !AddressAndPort(peer, &address, &port) ||
        !AddressAndPort(local, &unused, &local_port_found)) {
      continue;
    }
    if (port == peer_port && local_port_found == local_port &&
        (address == peer_address || address == "::ffff:" + peer_address)) {
      found = static_cast<int>(fd);
      break;
    }
  }
  closedir(dir);
  return found;
}

}  // namespace

SlowReadCutter::SlowReadCutter(std::chrono::milliseconds period)
    : thread_(period, [this] { return Tick(); }) {}

uint64_t SlowReadCutter::Begin(std::string peer_address, int peer_port, int local_port,
                               Clock::time_point deadline) {
  std::lock_guard lock(mu_);
  const uint64_t id = next_++;
  reads_[id] = Read{std::move(peer_address), peer_port, local_port, deadline};
  return id;
}

void SlowReadCutter::End(uint64_t read) {
  std::lock_guard lock(mu_);
  reads_.erase(read);
}

int64_t SlowReadCutter::cut() const {
  std::lock_guard lock(mu_);
  return cut_;
}

bool SlowReadCutter::Tick() {
  const Clock::time_point now = Clock::now();
  // Under the lock: a read not yet Ended has not returned, so its connection, and the socket
  // found for it, are still open.
  std::lock_guard lock(mu_);
  for (auto& [id, read] : reads_) {
    if (read.cut || now <= read.deadline) continue;
    read.cut = true;
    const int fd = FindSocket(read.peer_address, read.peer_port, read.local_port);
    if (fd < 0) continue;
    shutdown(fd, SHUT_RD);  // the read returns; the answer saying why can still be written
    ++cut_;
  }
  return true;
}

}  // namespace attnserve::server
