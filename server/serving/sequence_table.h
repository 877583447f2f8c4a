#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "server/base/periodic_thread.h"
#include "server/serving/clock.h"
#include "server/serving/session.h"

namespace attnserve::server {

// Decode sessions keyed by a model's name and a client's sequence id (the Open Inference
// Protocol's sequence_id; each model has its own ids, as each of Triton's sequence batchers
// does): started by a request with sequence_start, ended by one with sequence_end or after
// `idle_timeout` without a request.
class SequenceTable {
 public:
  // Starts the idle reaper, which looks every `reap_every` (by default a quarter of the
  // timeout, within 10 ms and 1 s). A request never reaches a session idle past the timeout,
  // whether or not the reaper has ended it yet.
  explicit SequenceTable(std::chrono::milliseconds idle_timeout,
                         std::chrono::milliseconds reap_every = std::chrono::milliseconds(0));
  ~SequenceTable();

  SequenceTable(const SequenceTable&) = delete;
  SequenceTable& operator=(const SequenceTable&) = delete;

  // Keeps `session` under its model's name and `id`; a session they had ends (and the log says
  // so, at most once a second).
  void Start(const std::string& id, std::shared_ptr<Session> session);

  // The session of `model`'s `id`, its idle clock restarted (and again by Touch when the
  // request is answered); NotFound naming the id when it has
  // none (never started, ended, or idle past the timeout).
  absl::StatusOr<std::shared_ptr<Session>> Find(const std::string& model, const std::string& id);

  // Ends `session`, if it is still the one under `model`'s `id` (a sequence_start may have
  // given the id another since).
  void End(const std::string& model, const std::string& id, const Session* session);

  // Restarts the idle clock of `session` if it is still the one under `model`'s `id` (its
  // step was just answered).
  void Touch(const std::string& model, const std::string& id, const Session* session);

  // Whether `model`'s `id` has a session now (one idle past the timeout ends here).
  bool Holds(const std::string& model, const std::string& id);

  // The model whose sequence `id` has a session, when exactly one model's has; else "".
  std::string OnlyModelHolding(const std::string& id) const;

  // Sessions held now.
  size_t size() const;

 private:
  struct Entry {
    std::shared_ptr<Session> session;
    Clock::time_point last_used;
  };
  using Key = std::pair<std::string, std::string>;  // model name, sequence id
  // Whether `entry` is idle past the timeout at `now`, no request using it.
  bool Expired(const Entry& entry, Clock::time_point now) const;
  // The entry of `key`, or end() when it has none or (ending it: its session moves to
  // `expired`, to be freed outside the lock) it is idle past the timeout. mu_ held.
  std::map<Key, Entry>::iterator Live(const Key& key, Clock::time_point now,
                                      std::shared_ptr<Session>* expired);
  // Ends the sessions idle past the timeout that no request is using.
  void Reap();

  const std::chrono::milliseconds idle_timeout_;
  mutable std::mutex mu_;
  std::map<Key, Entry> entries_;          // guarded by mu_
  Clock::time_point last_restart_log_{};  // guarded by mu_
  PeriodicThread reaper_;                 // last: stopped before the entries go
};

}  // namespace attnserve::server
