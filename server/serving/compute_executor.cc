#include "server/serving/compute_executor.h"

#include <algorithm>

#include "core/runtime_info.h"

namespace attnserve::server {

ComputeExecutor::ComputeExecutor(int compute_threads)
    : compute_threads_(compute_threads), thread_([this] { Loop(); }) {}

ComputeExecutor::~ComputeExecutor() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void ComputeExecutor::Add(RunQueue* queue) {
  std::lock_guard lock(mu_);
  queues_.push_back(queue);
}

void ComputeExecutor::Remove(RunQueue* queue) {
  std::unique_lock lock(mu_);
  idle_cv_.wait(lock, [&] { return running_ != queue; });
  queues_.erase(std::remove(queues_.begin(), queues_.end(), queue), queues_.end());
  next_ = 0;
}

void ComputeExecutor::Notify() {
  {
    std::lock_guard lock(mu_);
    changed_ = true;
    // During an inline run the thread could take nothing: it is woken when that run ends.
    if (inline_) {
      notified_inline_ = true;
      return;
    }
  }
  cv_.notify_one();
}

bool ComputeExecutor::TryRunInline(RunQueue* queue) {
  const Clock::time_point now = Clock::now();
  {
    std::lock_guard lock(mu_);
    if (stop_ || running_ != nullptr) return false;
    for (RunQueue* other : queues_) {
      if (other != queue && other->ReadyAt(now) <= now) return false;
    }
    running_ = queue;
    inline_ = true;
    notified_inline_ = false;
    // Its turn: after it, the other models with a run ready go first.
    const auto it = std::find(queues_.begin(), queues_.end(), queue);
    if (it != queues_.end()) next_ = (it - queues_.begin() + 1) % queues_.size();
  }
  // On this thread alone, even when a larger step queued meanwhile joins the run: OpenMP would
  // give every transport thread that ran one a team of threads of its own, living as long as it.
  // (OpenMP keeps the setting per thread: once a thread is enough.)
  thread_local const bool single_threaded = (core::SetComputeThreads(1), true);
  (void)single_threaded;
  queue->RunNext(now, /*on_caller=*/true);
  bool changed;
  {
    std::lock_guard lock(mu_);
    running_ = nullptr;
    inline_ = false;
    // A Notify, or this thread waiting to look again; or the run did only part of its work (a
    // prompt's first chunk), and nothing else would wake the thread for the rest.
    changed = notified_inline_ || queue->ReadyAt(Clock::now()) != Clock::time_point::max();
    changed_ = changed_ || changed;
  }
  idle_cv_.notify_all();
  // What is left or was queued meanwhile goes to the compute thread; else it sleeps on.
  if (changed) cv_.notify_one();
  return true;
}

void ComputeExecutor::Loop() {
  // OpenMP keeps its thread count per thread: set it on the thread that computes.
  core::SetComputeThreads(compute_threads_);
  std::unique_lock lock(mu_);
  while (!stop_) {
    changed_ = false;
    // Whose turn: the first model, from next_ on, with a run ready; else when one will be.
    const Clock::time_point now = Clock::now();
    Clock::time_point wake = Clock::time_point::max();
    const size_t count = queues_.size();
    RunQueue* chosen = nullptr;
    // While a run goes on inline (TryRunInline), this thread waits for its end to look again.
    if (inline_) notified_inline_ = true;
    for (size_t i = 0; i < count && running_ == nullptr && chosen == nullptr; ++i) {
      RunQueue* queue = queues_[(next_ + i) % count];
      const Clock::time_point ready = queue->ReadyAt(now);
      if (ready <= now) {
        chosen = running_ = queue;
        next_ = (next_ + i + 1) % count;
      } else {
        wake = std::min(wake, ready);
      }
    }
    if (chosen != nullptr) {
      lock.unlock();
      chosen->RunNext(now, /*on_caller=*/false);
      lock.lock();
      running_ = nullptr;
      idle_cv_.notify_all();
      continue;
    }
    if (wake == Clock::time_point::max()) {
      cv_.wait(lock, [this] { return changed_ || stop_; });
    } else {
      cv_.wait_until(lock, wake, [this] { return changed_ || stop_; });
    }
  }
}

}  // namespace attnserve::server
