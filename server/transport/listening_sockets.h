#pragma once

#include <sys/socket.h>

#include <vector>

namespace attnserve::server {

// A listening TCP socket of this process, found among its descriptors: for sockets that a
// library (gRPC, civetweb) opened and keeps to itself.
struct ListeningSocket {
  int fd = -1;                 // the library's own: never closed here
  sockaddr_storage address{};  // as bound (a wildcard stays a wildcard)
  socklen_t address_len = 0;
};

// This process's listening TCP sockets bound to `port`, by a pass over /proc/self/fd (Linux);
// empty when there is none, or no /proc.
std::vector<ListeningSocket> ListeningSocketsOn(int port);

}  // namespace attnserve::server
