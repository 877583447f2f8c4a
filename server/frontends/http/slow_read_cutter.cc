#include "server/frontends/http/slow_read_cutter.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstdlib>
#include <optional>
#include <set>
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

// A TCP connection as its addresses name it: the peer's address (without an IPv6 scope) and
// port, and the local port.
struct ConnectionKey {
  std::string peer_address;
  int peer_port = 0;
  int local_port = 0;
  auto operator<=>(const ConnectionKey&) const = default;
};

// A peer's address as both sides are compared: without an IPv6 scope ("%eth0", which civetweb
// may write) and an IPv4 peer of a dual-stack listener as a.b.c.d, not ::ffff:a.b.c.d.
std::string Normalized(std::string address) {
  if (const size_t scope = address.find('%'); scope != std::string::npos) address.resize(scope);
  if (address.starts_with("::ffff:") && address.find('.') != std::string::npos) {
    address.erase(0, 7);
  }
  return address;
}

// `fd`'s connection, if it is a TCP socket with a peer.
std::optional<ConnectionKey> KeyOf(int fd) {
  sockaddr_storage peer{}, local{};
  socklen_t peer_size = sizeof(peer), local_size = sizeof(local);
  ConnectionKey key;
  std::string unused;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_size) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_size) != 0 ||
      !AddressAndPort(peer, &key.peer_address, &key.peer_port) ||
      !AddressAndPort(local, &unused, &key.local_port)) {
    return std::nullopt;
  }
  key.peer_address = Normalized(std::move(key.peer_address));
  return key;
}

// This process's sockets whose connections are among `wanted`, by a pass over its descriptors.
std::map<ConnectionKey, int> FindSockets(const std::set<ConnectionKey>& wanted) {
  std::map<ConnectionKey, int> found;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return found;
  while (const dirent* entry = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0' || fd == dirfd(dir)) continue;
    const std::optional<ConnectionKey> key = KeyOf(static_cast<int>(fd));
    if (key.has_value() && wanted.contains(*key)) found[*key] = static_cast<int>(fd);
  }
  closedir(dir);
  return found;
}

}  // namespace

SlowReadCutter::SlowReadCutter(std::chrono::milliseconds period)
    : thread_(period, [this] { return Tick(); }) {}

SlowReadCutter::Watch::Watch(SlowReadCutter& cutter, std::string peer_address, int peer_port,
                             int local_port, Clock::time_point deadline)
    : cutter_(cutter), read_([&] {
        std::lock_guard lock(cutter.mu_);
        const uint64_t id = cutter.next_++;
        cutter.reads_[id] =
            Read{Normalized(std::move(peer_address)), peer_port, local_port, deadline};
        return id;
      }()) {}

SlowReadCutter::Watch::~Watch() {
  std::lock_guard lock(cutter_.mu_);
  cutter_.reads_.erase(read_);
}

bool SlowReadCutter::Tick() {
  const Clock::time_point now = Clock::now();
  std::set<ConnectionKey> wanted;
  {
    std::lock_guard lock(mu_);
    for (const auto& [id, read] : reads_) {
      if (!read.cut && now > read.deadline) {
        wanted.insert({read.peer_address, read.peer_port, read.local_port});
      }
    }
  }
  if (wanted.empty()) return true;
  // The pass over every descriptor runs without the lock (reads begin and end meanwhile); what
  // it found is checked again under the lock, where a read not yet Ended has not returned, so
  // its connection, and a descriptor that still names it, are still open.
  const std::map<ConnectionKey, int> sockets = FindSockets(wanted);
  std::lock_guard lock(mu_);
  for (auto& [id, read] : reads_) {
    if (read.cut || now <= read.deadline) continue;
    const ConnectionKey key{read.peer_address, read.peer_port, read.local_port};
    const auto it = sockets.find(key);
    if (it == sockets.end()) continue;       // not found (no descriptor to spare?): the next tick
    if (KeyOf(it->second) != key) continue;  // the descriptor was closed and reused meanwhile
    // The read returns; the answer saying why can still be written.
    if (shutdown(it->second, SHUT_RD) != 0) continue;
    read.cut = true;
  }
  return true;
}

}  // namespace attnserve::server
