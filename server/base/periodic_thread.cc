#include "server/base/periodic_thread.h"

#include <utility>

namespace attnserve::server {

PeriodicThread::PeriodicThread(std::chrono::milliseconds period, std::function<bool()> tick)
    : period_(period), tick_(std::move(tick)), thread_([this] { Loop(); }) {}

void PeriodicThread::Stop() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

bool PeriodicThread::stopping() const {
  std::lock_guard lock(mu_);
  return stop_;
}

void PeriodicThread::Loop() {
  std::unique_lock lock(mu_);
  while (!wake_.wait_for(lock, period_, [this] { return stop_; })) {
    lock.unlock();
    const bool again = tick_();
    lock.lock();
    if (!again) return;
  }
}

}  // namespace attnserve::server
