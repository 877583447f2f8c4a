#include "client/load_decode.h"

#include <algorithm>
#include <barrier>
#include <chrono>
#include <map>
#include <mutex>
#include <thread>

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

// The shared state of a run: when the decode window opened.
struct RunClock {
  Clock::time_point start;
  Clock::time_point decode_start;
};

// The barrier's completion: every prompt is answered, the decode window opens.
struct OpenDecodeWindow {
  RunClock* clock;
  void operator()() noexcept { clock->decode_start = Clock::now(); }
};

// One session: opens, sends its prompt, waits for every prompt, then steps.
void RunSession(const AttentionClient& connection, const DecodeWork& work, int index,
                std::barrier<OpenDecodeWindow>& prompts_done, const RunClock& clock,
                SessionFigures& f) {
  const Clock::time_point start = Clock::now();
  v1::DecodeResponse response;
  auto send = [&](const v1::DecodeRequest& request, DecodeSession& session) {
    ++f.sent;
    absl::Status s = session.Send(request, &response);
    if (s.ok()) {
      ++f.ok;
      f.last_answer = Clock::now();
    } else {
      ++f.errors[s.code()];
    }
    return s.ok();
  };
  absl::StatusOr<std::unique_ptr<DecodeSession>> session =
      DecodeSession::Open(connection, work.session);
  if (!session.ok()) {
    ++f.sent;
    ++f.errors[session.status().code()];
    prompts_done.arrive_and_drop();
    return;
  }
  for (const v1::DecodeRequest& chunk : work.prompts[index % work.prompts.size()]) {
    if (!send(chunk, **session)) {
      prompts_done.arrive_and_drop();
      return;
    }
    f.prompt_tokens += MessageTokens(chunk);
  }
  f.prompt_done = Clock::now();
  f.first_output = true;
  f.first_output_us = MicrosBetween(start, f.prompt_done);
  prompts_done.arrive_and_wait();

  // The steps: each one's input is the last one's output when the shapes allow (generation).
  v1::DecodeRequest request = work.step;
  const int64_t tokens = MessageTokens(request);
  for (int i = 0; i < work.steps; ++i) {
    const Clock::time_point sent = Clock::now();
    const bool ok = send(request, **session);
    const int64_t us = MicrosBetween(sent, Clock::now());
    TimeSlice& slice = f.slices[MicrosBetween(clock.decode_start, sent) / 1000000];
    ++slice.sent;
    if (!ok) {
      ++slice.failed;
      return;  // the stream has ended (counted once, here): nothing to close
    }
    ++slice.ok;
    slice.latency.Record(us);
    f.step_latency.Record(us);
    f.inter_token.Record(us / std::max(work.tokens_per_step, 1));
    f.step_tokens += tokens;
    if (work.feed_output && SameShape(response.output(), request.input())) {
      request.mutable_input()->Swap(response.mutable_output());
    }
  }
  // Closing is a message of its own: the server's answer to the end of the stream.
  if (absl::Status s = (*session)->Close(); !s.ok()) {
    ++f.sent;
    ++f.errors[s.code()];
  }
}

}  // namespace

absl::StatusOr<StepReport> RunDecodeLoad(const std::vector<const AttentionClient*>& connections,
                                         const DecodeWork& work, int sessions) {
  if (connections.empty() || work.prompts.empty() || sessions < 1) {
    return absl::InvalidArgumentError("a decode run needs connections, a prompt and a session");
  }
  RunClock clock;
  std::barrier<OpenDecodeWindow> prompts_done(sessions, OpenDecodeWindow{&clock});
  std::vector<SessionFigures> figures(static_cast<size_t>(sessions));
  clock.start = Clock::now();
  clock.decode_start = clock.start;
  {
    std::vector<std::jthread> threads;
    threads.reserve(figures.size());
    for (int i = 0; i < sessions; ++i) {
      threads.emplace_back([&, i] {
        RunSession(*connections[static_cast<size_t>(i) % connections.size()], work, i, prompts_done,
                   clock, figures[static_cast<size_t>(i)]);
      });
    }
  }
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
  Clock::time_point last_answer = clock.start;
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
  report.window = absl::FromChrono(end - clock.start);
  report.elapsed = absl::FromChrono(std::max(last_answer, clock.start) - clock.start);
  report.send_span = report.window;
  d.prefill_elapsed = absl::FromChrono(clock.decode_start - clock.start);
  d.decode_elapsed =
      absl::FromChrono(std::max(last_answer, clock.decode_start) - clock.decode_start);
  const double offset = absl::ToDoubleSeconds(d.prefill_elapsed);
  for (auto& [second, s] : slices) {
    s.start_seconds = offset + static_cast<double>(second);
    report.timeline.push_back(std::move(s));
  }
  report.decode = std::move(d);
  return report;
}

}  // namespace attnserve::client
