#include "client/load_decode.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>

#include "absl/strings/str_cat.h"

namespace attnserve::client {
namespace {

using Clock = std::chrono::steady_clock;

int64_t MicrosBetween(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration_cast<std::chrono::microseconds>(to - from).count();
}

// Tokens a message appends: its lengths' sum, or every row of its input.
int64_t MessageTokens(const v1::DecodeRequest& request) {
  if (request.lengths_size() > 0) {
    int64_t n = 0;
    for (int32_t length : request.lengths()) n += length;
    return n;
  }
  const auto& shape = request.input().shape();
  if (shape.size() == 3) return shape[0] * shape[1];
  return shape.empty() ? 0 : shape[0];
}

bool SameShape(const v1::Tensor& a, const v1::Tensor& b) {
  return std::equal(a.shape().begin(), a.shape().end(), b.shape().begin(), b.shape().end());
}

// What one session saw; merged into the report when every session has ended.
struct SessionFigures {
  int64_t sent = 0;
  int64_t ok = 0;
  std::map<absl::StatusCode, int64_t> errors;
  int64_t prompt_tokens = 0;
  int64_t step_tokens = 0;
  bool first_output = false;
  int64_t first_output_us = 0;
  Clock::time_point prompt_done, last_answer;
  LatencyHistogram step_latency;
  LatencyHistogram inter_token;
  std::map<int64_t, TimeSlice> slices;  // by second of the decode window
};

// The shared state of a run: when the decode window opened, and who is still going. Sessions
// run on gRPC's threads (each answer sends the next message from its callback), so the run needs
// no thread a session; this thread waits, and cancels a step that outwaits the step timeout.
class Run {
 public:
  Run(int sessions, absl::Duration step_timeout)
      : step_timeout_(step_timeout), waiting_for_prompts_(sessions), running_(sessions) {}

  Clock::time_point start;
  Clock::time_point decode_start;

  // A session's prompt is answered (or it has failed, `stepping` false): the last one opens the
  // decode window and starts every session waiting at it.
  void PromptDone(class AsyncSession* session, bool stepping);
  // A session has ended (its last step answered, or failed).
  void SessionDone();
  // Waits until every session has ended, cancelling each step that takes over the step timeout.
  void Wait(const std::vector<std::unique_ptr<class AsyncSession>>& sessions);

 private:
  const absl::Duration step_timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  int waiting_for_prompts_;                   // guarded by mu_
  std::vector<class AsyncSession*> waiting_;  // guarded by mu_
  int running_;                               // guarded by mu_
};

// One session: opens, sends its prompt, waits for every prompt, then steps; each message's
// answer sends the next.
class AsyncSession {
 public:
  AsyncSession(std::unique_ptr<DecodeSession> session, const DecodeWork& work, int index, Run& run,
               SessionFigures& f)
      : session_(std::move(session)),
        work_(work),
        prompt_(work.prompts[static_cast<size_t>(index) % work.prompts.size()]),
        run_(run),
        f_(f),
        request_(work.step),
        tokens_(MessageTokens(request_)) {}

  void Start() {
    start_ = Clock::now();
    NextPromptChunk();
  }

  // The first step, once the decode window is open.
  void StartSteps() { SendStep(); }

  // Cancels the step in flight when it has waited past `timeout` (the run's waiting thread).
  void CancelIfLate(Clock::time_point now, absl::Duration timeout) {
    const int64_t since = sent_ns_.load();
    if (since == 0 || timeout == absl::InfiniteDuration()) return;
    if (now.time_since_epoch().count() - since > absl::ToInt64Nanoseconds(timeout)) {
      timed_out_ = true;
      session_->Cancel();
    }
  }

  // After every session has ended: closes the stream (the server's answer to the end of it).
  void Close() {
    if (failed_) return;  // the stream has ended (counted once, where it failed)
    if (absl::Status s = session_->Close(); !s.ok()) {
      ++f_.sent;
      ++f_.errors[s.code()];
    }
  }

 private:
  // Sends `request` timed; `then` gets whether it was answered, counted, and when it was sent.
  void Send(const v1::DecodeRequest& request, std::function<void(bool, Clock::time_point)> then) {
    ++f_.sent;
    sent_ns_.store(Clock::now().time_since_epoch().count());
    session_->SendAsync(request, &response_, [this, then = std::move(then)](absl::Status s) {
      const Clock::time_point sent{Clock::duration(sent_ns_.exchange(0))};
      if (!s.ok() && timed_out_) {
        s = absl::DeadlineExceededError("a decode step waited past the step timeout");
      }
      if (s.ok()) {
        ++f_.ok;
        f_.last_answer = Clock::now();
      } else {
        ++f_.errors[s.code()];
        failed_ = true;
      }
      then(s.ok(), sent);
    });
  }

  void NextPromptChunk() {
    if (chunk_ == prompt_.size()) {
      f_.prompt_done = Clock::now();
      f_.first_output = true;
      f_.first_output_us = MicrosBetween(start_, f_.prompt_done);
      run_.PromptDone(this, true);
      return;
    }
    const v1::DecodeRequest& chunk = prompt_[chunk_++];
    Send(chunk, [this, &chunk](bool ok, Clock::time_point /*sent*/) {
      if (!ok) {
        run_.PromptDone(this, false);
        return;
      }
      f_.prompt_tokens += MessageTokens(chunk);
      NextPromptChunk();
    });
  }

  // The steps: each one's input is the last one's output when the shapes allow (generation).
  void SendStep() {
    if (step_ == work_.steps) {
      run_.SessionDone();
      return;
    }
    ++step_;
    Send(request_, [this](bool ok, Clock::time_point sent) {
      const int64_t us = MicrosBetween(sent, Clock::now());
      TimeSlice& slice = f_.slices[MicrosBetween(run_.decode_start, sent) / 1000000];
      ++slice.sent;
      if (!ok) {
        ++slice.failed;
        run_.SessionDone();
        return;
      }
      ++slice.ok;
      slice.latency.Record(us);
      f_.step_latency.Record(us);
      f_.inter_token.Record(us / std::max(work_.tokens_per_step, 1));
      f_.step_tokens += tokens_;
      if (work_.feed_output && SameShape(response_.output(), request_.input())) {
        request_.mutable_input()->Swap(response_.mutable_output());
      }
      SendStep();
    });
  }

  std::unique_ptr<DecodeSession> session_;
  const DecodeWork& work_;
  const std::vector<v1::DecodeRequest>& prompt_;
  Run& run_;
  SessionFigures& f_;
  v1::DecodeRequest request_;
  v1::DecodeResponse response_;
  const int64_t tokens_;
  Clock::time_point start_;
  size_t chunk_ = 0;
  int step_ = 0;
  bool failed_ = false;
  std::atomic<int64_t> sent_ns_{0};  // when the message in flight was sent; 0: none
  std::atomic<bool> timed_out_{false};
};

void Run::PromptDone(AsyncSession* session, bool stepping) {
  std::vector<AsyncSession*> start_now;
  {
    std::lock_guard lock(mu_);
    if (stepping) {
      waiting_.push_back(session);
    } else {
      --running_;
      cv_.notify_all();
    }
    if (--waiting_for_prompts_ > 0) return;
    decode_start = Clock::now();
    start_now.swap(waiting_);
  }
  for (AsyncSession* s : start_now) s->StartSteps();
}

void Run::SessionDone() {
  std::lock_guard lock(mu_);
  --running_;
  cv_.notify_all();
}

void Run::Wait(const std::vector<std::unique_ptr<AsyncSession>>& sessions) {
  std::unique_lock lock(mu_);
  while (!cv_.wait_for(lock, std::chrono::milliseconds(100), [this] { return running_ == 0; })) {
    lock.unlock();
    const Clock::time_point now = Clock::now();
    for (const auto& s : sessions) s->CancelIfLate(now, step_timeout_);
    lock.lock();
  }
}

}  // namespace

absl::StatusOr<StepReport> RunDecodeLoad(const std::vector<const AttentionClient*>& connections,
                                         const DecodeWork& work, int sessions) {
  if (connections.empty() || work.prompts.empty() || sessions < 1) {
    return absl::InvalidArgumentError("a decode run needs connections, a prompt and a session");
  }
  Run run(sessions, connections.front()->options().timeout);
  std::vector<SessionFigures> figures(static_cast<size_t>(sessions));
  std::vector<std::unique_ptr<AsyncSession>> driven;
  run.start = Clock::now();
  run.decode_start = run.start;
  for (int i = 0; i < sessions; ++i) {
    SessionFigures& f = figures[static_cast<size_t>(i)];
    absl::StatusOr<std::unique_ptr<DecodeSession>> session = DecodeSession::Open(
        *connections[static_cast<size_t>(i) % connections.size()], work.session);
    if (!session.ok()) {
      ++f.sent;
      ++f.errors[session.status().code()];
      run.PromptDone(nullptr, false);
      continue;
    }
    driven.push_back(std::make_unique<AsyncSession>(*std::move(session), work, i, run, f));
  }
  for (const auto& s : driven) s->Start();
  run.Wait(driven);
  for (const auto& s : driven) s->Close();
  const Clock::time_point end = Clock::now();

  StepReport report;
  report.mode = LoadMode::kClosed;
  report.concurrency = sessions;
  report.connections = static_cast<int>(std::min<size_t>(connections.size(), figures.size()));
  DecodeFigures d;
  d.sessions = sessions;
  d.batch = work.session.batch;
  d.prompt = static_cast<int>(work.prompt_tokens / std::max(work.session.batch, 1));
  d.steps = work.steps;
  d.tokens_per_step = work.tokens_per_step;
  Clock::time_point last_answer = run.start;
  std::map<int64_t, TimeSlice> slices;
  for (SessionFigures& f : figures) {
    report.sent += f.sent;
    report.ok += f.ok;
    for (const auto& [code, n] : f.errors) report.errors[code] += n;
    report.latency.Merge(f.step_latency);
    d.prompt_tokens += f.prompt_tokens;
    d.step_tokens += f.step_tokens;
    if (f.first_output) d.first_output.Record(f.first_output_us);
    d.inter_token.Merge(f.inter_token);
    last_answer = std::max(last_answer, f.last_answer);
    for (auto& [second, s] : f.slices) {
      TimeSlice& into = slices[second];
      into.sent += s.sent;
      into.ok += s.ok;
      into.failed += s.failed;
      into.latency.Merge(s.latency);
    }
  }
  report.scheduled = report.sent;
  report.tokens = d.prompt_tokens + d.step_tokens;
  report.window = absl::FromChrono(end - run.start);
  report.elapsed = absl::FromChrono(std::max(last_answer, run.start) - run.start);
  report.send_span = report.window;
  d.prefill_elapsed = absl::FromChrono(run.decode_start - run.start);
  d.decode_elapsed = absl::FromChrono(std::max(last_answer, run.decode_start) - run.decode_start);
  const double offset = absl::ToDoubleSeconds(d.prefill_elapsed);
  for (auto& [second, s] : slices) {
    s.start_seconds = offset + static_cast<double>(second);
    report.timeline.push_back(std::move(s));
  }
  report.decode = std::move(d);
  return report;
}

}  // namespace attnserve::client
