#include "server/transport/listening_sockets.h"

#include <dirent.h>
#include <netinet/in.h>

#include <cstdlib>

namespace attnserve::server {
namespace {

// The port `fd` listens on; -1 when it is not a listening TCP socket.
int ListeningPort(int fd, ListeningSocket* socket) {
  int listening = 0;
  socklen_t len = sizeof(listening);
  if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 || !listening) return -1;
  socket->address_len = sizeof(socket->address);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&socket->address), &socket->address_len) != 0) {
    return -1;
  }
  if (socket->address.ss_family == AF_INET) {
    return ntohs(reinterpret_cast<const sockaddr_in*>(&socket->address)->sin_port);
  }
  if (socket->address.ss_family == AF_INET6) {
    return ntohs(reinterpret_cast<const sockaddr_in6*>(&socket->address)->sin6_port);
  }
  return -1;
}

}  // namespace

std::vector<ListeningSocket> ListeningSocketsOn(int port) {
  std::vector<ListeningSocket> found;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return found;
  while (const dirent* entry = readdir(dir)) {
    ListeningSocket socket;
    socket.fd = std::atoi(entry->d_name);
    if (socket.fd > 2 && socket.fd != dirfd(dir) && ListeningPort(socket.fd, &socket) == port) {
      found.push_back(socket);
    }
  }
  closedir(dir);
  return found;
}

}  // namespace attnserve::server
