#pragma once

#include <sys/socket.h>

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "server/base/periodic_thread.h"

namespace attnserve::server {

// Notices a listening port that no longer accepts connections (gRPC 1.51 stops accepting for
// good after one "accept4: Too many open files"), so the server is never alive but deaf.
// Every `interval` it opens a TCP connection to its own port and watches the listening
// socket's accept queue (TCP_INFO): gRPC has accepted the probe once the queue is empty. When
// the probe cannot connect, or is still queued after `deadline`, `on_deaf` runs, once. A round
// in which no descriptor is free for the probe is skipped: that alone proves nothing.
// Linux only; works the same for TLS and plaintext, since it never speaks to the server.
class ListenerWatchdog {
 public:
  // Finds the process's listening sockets on `port` and starts watching them; null (after a
  // warning in the log) when none is found.
  static std::unique_ptr<ListenerWatchdog> Start(int port, std::chrono::milliseconds interval,
                                                 std::chrono::milliseconds deadline,
                                                 std::function<void()> on_deaf);

  // Stops the probing thread.
  ~ListenerWatchdog();

  ListenerWatchdog(const ListenerWatchdog&) = delete;
  ListenerWatchdog& operator=(const ListenerWatchdog&) = delete;

 private:
  ListenerWatchdog() = default;
  // One round: false (stop probing) once the listener was found deaf and on_deaf_ ran.
  bool Probe();
  // True when the listener accepted a fresh connection in time (or no probe could be made).
  bool ProbeAccepted() const;

  std::vector<int> listen_fds_;    // gRPC's own sockets: read with getsockopt only
  sockaddr_storage probe_addr_{};  // one listening address, loopback for a wildcard
  socklen_t probe_addr_len_ = 0;
  std::chrono::milliseconds deadline_{0};
  std::function<void()> on_deaf_;
  std::unique_ptr<PeriodicThread> thread_;
};

}  // namespace attnserve::server
