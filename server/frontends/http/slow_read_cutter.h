#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "server/base/periodic_thread.h"
#include "server/serving/clock.h"

namespace attnserve::server {

// Cuts the connections of body reads still blocked past their deadline. civetweb's mg_read
// returns only once it has every byte it asked for, and its timeout bounds each wait for a
// byte, not the read: a client sending a byte just under that timeout holds a read, and its
// connection's thread, for as long as it likes. The cutter finds such a read's socket by its
// addresses and shuts its reading side down: the read returns, and the request is answered
// that its body took too long.
class SlowReadCutter {
 public:
  // Starts the thread that looks every `period`.
  explicit SlowReadCutter(std::chrono::milliseconds period = std::chrono::milliseconds(100));
  ~SlowReadCutter() { Stop(); }
  SlowReadCutter(const SlowReadCutter&) = delete;
  SlowReadCutter& operator=(const SlowReadCutter&) = delete;

  // While it lives, a read on the connection from `peer_address` (as civetweb writes it) port
  // `peer_port` to this process's port `local_port`, which must end by `deadline`. It must go
  // once the read has returned, before the connection can close. (The local address is not
  // compared: a client would need the same port to two of the server's addresses on one port.)
  class Watch {
   public:
    Watch(SlowReadCutter& cutter, std::string peer_address, int peer_port, int local_port,
          Clock::time_point deadline);
    ~Watch();
    Watch(const Watch&) = delete;
    Watch& operator=(const Watch&) = delete;

   private:
    SlowReadCutter& cutter_;
    const uint64_t read_;
  };

  // Stops looking. Idempotent.
  void Stop() { thread_.Stop(); }

 private:
  struct Read {
    std::string peer_address;  // normalized: as the descriptors' addresses are compared
    int peer_port = 0;
    int local_port = 0;
    Clock::time_point deadline;
    bool cut = false;
  };
  bool Tick();

  std::mutex mu_;  // held while a read's socket is found and shut: End waits for it
  std::map<uint64_t, Read> reads_;
  uint64_t next_ = 1;
  PeriodicThread thread_;  // last: stopped before the rest goes
};

}  // namespace attnserve::server
