#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/histogram.h"

// The load tester's engine: asynchronous calls (gRPC's callback API) over one or more
// connections, in a closed loop (a fixed number of calls in flight) or an open loop (calls sent
// at their scheduled times whatever the server does, each timed from that time).
namespace attnserve::client {

// One request the load test sends, and the valid (query) tokens it carries.
struct WorkItem {
  v1::ForwardRequest request;
  int64_t tokens = 0;
};

// One connection the load tester sends over, whatever its protocol.
class LoadSender {
 public:
  virtual ~LoadSender() = default;
  // Sends `item`'s call (`item` outlives it); `done` runs once with its status, on one of the
  // sender's threads.
  virtual void SendAsync(const WorkItem& item, std::function<void(absl::Status)> done) const = 0;
  // Sends `item`'s call and waits for its answer.
  virtual absl::Status Send(const WorkItem& item) const = 0;
  // The connections it sends over (the report's `connections`).
  virtual int connections() const { return 1; }
};

// attnserve.v1 Forward calls over one gRPC channel (any number in flight).
class GrpcLoadSender final : public LoadSender {
 public:
  explicit GrpcLoadSender(const AttentionClient* client) : client_(client) {}
  void SendAsync(const WorkItem& item, std::function<void(absl::Status)> done) const override;
  absl::Status Send(const WorkItem& item) const override;

 private:
  const AttentionClient* const client_;
};

// Closed loop: `concurrency` calls always in flight. Open loop: `rate` calls per second.
enum class LoadMode { kClosed, kOpen };

// When open-loop calls are due: evenly spaced, or a Poisson process (exponential gaps).
enum class Arrival { kConstant, kPoisson };

// The running figures of a step, for a progress line.
struct StepProgress {
  double seconds = 0;  // since the window opened (negative during the warm-up)
  int64_t sent = 0;
  int64_t ok = 0;
  int64_t failed = 0;
  int64_t in_flight = 0;
};

// How hard and how long one step loads the server.
struct LoadOptions {
  LoadMode mode = LoadMode::kClosed;
  int concurrency = 4;  // closed loop: calls in flight
  double rate = 0;      // open loop: calls per second
  Arrival arrival = Arrival::kConstant;
  int max_in_flight = 1000;  // open loop: calls due past this wait (and are late)
  absl::Duration warmup = absl::ZeroDuration();  // load first, not counted
  absl::Duration duration = absl::Seconds(10);   // the window; zero: bounded by max_requests
  int64_t max_requests = 0;                      // calls in the window; zero: no count bound
  uint64_t seed = 1;                             // of the Poisson gaps
  // Runs once as the window opens, before any counted call is sent: the server metrics' first
  // scrape. A closed loop's window starts when it returns (warm-up calls go on meanwhile); an
  // open loop's first counted calls wait for it (their latency counts from when they were due).
  std::function<void()> window_started;
  // Runs about twice a second with the step's figures so far: the terminal's progress line.
  std::function<void(const StepProgress&)> progress;
};

// What the calls sent in one slice of the window saw (latency over time).
struct TimeSlice {
  double start_seconds = 0;  // from the window's start
  int64_t sent = 0;
  int64_t ok = 0;
  int64_t failed = 0;
  LatencyHistogram latency;  // of the successful calls
};

// What a session run (bench --decode) measured beside the message counts.
struct DecodeFigures {
  int sessions = 0;
  int batch = 1;   // sequences per session
  int prompt = 0;  // tokens per sequence
  int steps = 0;
  int tokens_per_step = 1;
  int64_t prompt_tokens = 0;       // answered, every session and sequence
  int64_t step_tokens = 0;         // answered steps' tokens
  absl::Duration prefill_elapsed;  // from the start to the last prompt's answer
  absl::Duration decode_elapsed;   // from the last prompt's answer to the last step's
  LatencyHistogram first_output;   // per session: stream start to the prompt's answer
  LatencyHistogram inter_token;    // per step: its latency / tokens per step
  // Generated (step) tokens per second over the decode window.
  double tokens_per_second() const;
  // Prompt tokens per second over the prefill.
  double prompt_tokens_per_second() const;
};

// What one step (or several, merged) measured. Calls count when their scheduled send time falls
// in the window; every counted call is sent (sent), or was still waiting for room under the
// in-flight cap when the window closed (unsent): scheduled = sent + unsent, sent = ok + failed.
struct StepReport {
  LoadMode mode = LoadMode::kClosed;
  Arrival arrival = Arrival::kConstant;
  int concurrency = 0;      // closed loop
  double offered_rate = 0;  // open loop
  int connections = 1;
  int max_in_flight = 0;   // open loop
  int trials = 1;          // windows merged into this report
  int trials_run = 1;      // windows measured (more with a stability check)
  bool stable = true;      // false: the stability check ran out of trials
  absl::Duration window;   // time the counted calls were scheduled over
  absl::Duration elapsed;  // from the window's start to the last counted answer
  int64_t scheduled = 0;
  int64_t sent = 0;
  int64_t late = 0;  // sent more than kLateAfter after their scheduled time
  int64_t unsent = 0;
  int64_t ok = 0;
  std::map<absl::StatusCode, int64_t> errors;  // failed calls by status code
  // The first failure's message of each code (what a transport failure was: GOAWAY, reset, ...).
  std::map<absl::StatusCode, std::string> first_error;
  int64_t tokens = 0;         // valid query tokens of the successful calls
  LatencyHistogram latency;   // of the successful calls, from scheduled time
  LatencyHistogram send_lag;  // actual send time - scheduled, of every call sent
  absl::Duration send_span;   // window start to the last counted send
  std::vector<TimeSlice> timeline;
  double slice_seconds = 1;
  std::optional<DecodeFigures> decode;  // bench --decode: the sessions' figures

  // Calls that failed.
  int64_t failed() const;
  // Successful calls per second, over `elapsed`.
  double requests_per_second() const;
  // Valid query tokens of successful calls per second, over `elapsed`.
  double tokens_per_second() const;
  // Calls sent per second from the window's start to the last send, or over the whole window
  // when the sender kept up (the achieved rate, beside offered_rate).
  double achieved_rate() const;
};

// The highest open-loop rate, calls/s: past it the schedule itself (which every sender thread
// walks) would be the load, and no server answers that many from one client process.
inline constexpr double kMaxRate = 1e6;

// A call sent this long after its scheduled time counts as late.
inline constexpr absl::Duration kLateAfter = absl::Milliseconds(1);

// Sends calls over a set of connections, the requests taken in turn from a pool.
class LoadEngine {
 public:
  // `connections` and `work` must not be empty; the senders must outlive the engine.
  LoadEngine(std::vector<const LoadSender*> connections, std::vector<WorkItem> work);

  // Loads the server for one warm-up and window, then waits for every call sent to end.
  absl::StatusOr<StepReport> RunStep(const LoadOptions& options) const;

  // Sends each work item once, in turn, `calls` times in all and waits: the first failure
  // (wrong model, bad shape) is returned, since it would fail every timed call too.
  absl::Status Check(int calls) const;

 private:
  std::vector<const LoadSender*> connections_;
  std::vector<WorkItem> work_;
};

// Runs a step's window `max_trials` times at most, until the last three agree on throughput and
// p99 within `percent` %, and reports those three merged; percent <= 0: one window.
absl::StatusOr<StepReport> RunStableStep(const LoadEngine& engine, LoadOptions options,
                                         double percent, int max_trials);

// Adds `next` (measured after `into`) to `into`: counts, histograms, windows, timeline.
void MergeStep(StepReport& into, const StepReport& next);

// Parses a sweep, START:END[:STEP]: STEP adds (default 1 for an integer sweep), xF multiplies
// (default x2 otherwise); END is included when a step lands on it. At most 100 values.
absl::StatusOr<std::vector<double>> ParseSweep(const std::string& text, bool integer);

// Query tokens one request carries: its lengths' sum, or every row when lengths are empty.
int64_t QueryTokens(const v1::ForwardRequest& request);

}  // namespace attnserve::client
