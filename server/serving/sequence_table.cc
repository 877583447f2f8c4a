#include "server/serving/sequence_table.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/observability/logging.h"

namespace attnserve::server {

SequenceTable::SequenceTable(std::chrono::milliseconds idle_timeout,
                             std::chrono::milliseconds reap_every)
    : idle_timeout_(idle_timeout),
      reaper_(reap_every.count() > 0 ? reap_every
                                     : std::clamp(idle_timeout / 4, std::chrono::milliseconds(10),
                                                  std::chrono::milliseconds(1000)),
              [this] {
                Reap();
                return true;
              }) {}

SequenceTable::~SequenceTable() { reaper_.Stop(); }

void SequenceTable::Start(const std::string& id, std::shared_ptr<Session> session) {
  const std::string model = session->version()->name;
  std::shared_ptr<Session> old;
  bool log = false;
  {
    std::lock_guard lock(mu_);
    const Clock::time_point now = Clock::now();
    Entry& entry = entries_[Key(model, id)];
    const bool in_use = entry.session != nullptr && !Expired(entry, now);
    old = std::move(entry.session);
    entry = {std::move(session), now};
    // Once a second at most: clients restarting ids in a loop must not flood the log.
    if (in_use && now - last_restart_log_ >= std::chrono::seconds(1)) {
      last_restart_log_ = now;
      log = true;
    }
  }
  // The old session's steps still waiting their turn are not run where no request reaches.
  if (old != nullptr) old->Replaced();
  if (log) {
    Log(LogLevel::kInfo, "sequence_start on a sequence id in use: its session ended",
        {{"model", model}, {"sequence_id", Clipped(id)}});
  }
}

absl::StatusOr<std::shared_ptr<Session>> SequenceTable::Find(const std::string& model,
                                                             const std::string& id) {
  std::shared_ptr<Session> expired;  // freed outside the lock
  std::lock_guard lock(mu_);
  const Clock::time_point now = Clock::now();
  const auto it = Live(Key(model, id), now, &expired);
  if (it == entries_.end()) {
    return absl::NotFoundError(absl::StrCat("sequence ", Clipped(id), " of model '", Clipped(model),
                                            "' has no session: never started, ended, or idle past "
                                            "--session-idle-timeout; send sequence_start"));
  }
  it->second.last_used = now;
  return it->second.session;
}

void SequenceTable::End(const std::string& model, const std::string& id, const Session* session) {
  std::shared_ptr<Session> ended;
  std::lock_guard lock(mu_);
  auto it = entries_.find(Key(model, id));
  if (it == entries_.end() || it->second.session.get() != session) return;
  ended = std::move(it->second.session);
  entries_.erase(it);
}

void SequenceTable::Touch(const std::string& model, const std::string& id, const Session* session) {
  std::lock_guard lock(mu_);
  auto it = entries_.find(Key(model, id));
  if (it != entries_.end() && it->second.session.get() == session) {
    it->second.last_used = Clock::now();
  }
}

bool SequenceTable::Holds(const std::string& model, const std::string& id) {
  std::shared_ptr<Session> expired;  // freed outside the lock
  std::lock_guard lock(mu_);
  return Live(Key(model, id), Clock::now(), &expired) != entries_.end();
}

std::map<SequenceTable::Key, SequenceTable::Entry>::iterator SequenceTable::Live(
    const Key& key, Clock::time_point now, std::shared_ptr<Session>* expired) {
  auto it = entries_.find(key);
  if (it == entries_.end() || !Expired(it->second, now)) return it;
  // Idle past the timeout, the reaper not yet come by: it ends now (its slot and cache freed
  // for the request that found it, when `expired` goes).
  *expired = std::move(it->second.session);
  entries_.erase(it);
  return entries_.end();
}

std::string SequenceTable::OnlyModelHolding(const std::string& id) const {
  std::lock_guard lock(mu_);
  const Clock::time_point now = Clock::now();
  std::string model;
  for (const auto& [key, entry] : entries_) {
    if (key.second != id || Expired(entry, now)) continue;
    if (!model.empty()) return "";
    model = key.first;
  }
  return model;
}

size_t SequenceTable::size() const {
  std::lock_guard lock(mu_);
  return entries_.size();
}

bool SequenceTable::Expired(const Entry& entry, Clock::time_point now) const {
  // A session a request is using (a step in flight holds it too) is not idle.
  return now - entry.last_used >= idle_timeout_ && entry.session.use_count() == 1;
}

void SequenceTable::Reap() {
  std::vector<std::shared_ptr<Session>> ended;  // freed outside the lock
  const Clock::time_point now = Clock::now();
  std::lock_guard lock(mu_);
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (!Expired(it->second, now)) {
      ++it;
      continue;
    }
    ended.push_back(std::move(it->second.session));
    it = entries_.erase(it);
  }
}

}  // namespace attnserve::server
