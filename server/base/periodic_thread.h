#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

namespace attnserve::server {

// A thread that runs `tick` every `period` until it is stopped: the log summaries' flusher, the
// listener watchdog's probe, the token file's poll. It sleeps between ticks (no polling) and a
// Stop wakes it at once.
class PeriodicThread {
 public:
  // Starts the thread; the first tick comes one `period` from now. A tick that returns false
  // ends the thread (it has done its last work, e.g. raised an alarm once).
  PeriodicThread(std::chrono::milliseconds period, std::function<bool()> tick);

  // Stops.
  ~PeriodicThread() { Stop(); }

  PeriodicThread(const PeriodicThread&) = delete;
  PeriodicThread& operator=(const PeriodicThread&) = delete;

  // Wakes the thread and waits for it to end (a tick under way finishes first). Idempotent.
  void Stop();

  // True once Stop was called: a long tick checks it before acting on what it found.
  bool stopping() const;

 private:
  void Loop();

  const std::chrono::milliseconds period_;
  const std::function<bool()> tick_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;  // guarded by mu_
  std::thread thread_;
};

}  // namespace attnserve::server
