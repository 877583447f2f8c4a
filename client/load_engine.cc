#include "client/load_engine.h"

#include <sys/prctl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <random>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace attnserve::client {
namespace {

using Clock = std::chrono::steady_clock;

// An open loop gets a sender thread per this many calls/s, up to kMaxSenders. One sender keeps
// 24k calls/s of 1x16 on time on one core of this project's machine (39 us of CPU per call);
// more senders than needed only contend for the lock and the cores (8 senders at 24k calls/s
// cost 2x the CPU per call and fell 12 % behind on 2 cores shared with the server).
constexpr double kCallsPerSender = 25000;
constexpr int kMaxSenders = 4;

Clock::duration FromSeconds(double seconds) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

double SecondsBetween(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

// One step's calls in flight and what they saw. Answers arrive on gRPC's threads; every figure
// is guarded by one mutex, held only to count.
class StepRun {
 public:
  StepRun(const std::vector<const LoadSender*>& connections, const std::vector<WorkItem>& work,
          const LoadOptions& options)
      : connections_(connections), work_(work), options_(options) {}

  // Runs the step: its warm-up and window, then waits for every call sent to end.
  StepReport Run();

 private:
  // A call; deleted when its answer has been counted.
  struct Call {
    Clock::time_point scheduled;
    const WorkItem* item = nullptr;
    bool counted = false;
  };

  // Sends one call scheduled at `scheduled`; its in-flight slot is already taken.
  void Launch(Clock::time_point scheduled, bool counted);
  // Counts an answer; in a closed loop, sends the next call in its place.
  void Finish(Call* call, const absl::Status& status);
  // Runs window_started once, before any counted call; a closed loop's window starts after it.
  // Callers racing to open it wait until it has.
  void OpenWindow();
  // Counts a call as sent (under mu_).
  void CountSent(Clock::time_point scheduled, Clock::time_point now);
  TimeSlice& SliceOf(Clock::time_point scheduled);
  // The open loop's sender: sends each call at its time, whatever the answers do.
  void SendOpenLoop(int sender, int senders);
  StepProgress Progress(Clock::time_point now);

  // Fills in what the report says of the load asked for, before any call.
  void DescribeLoad();
  // Sets the step's time points from now: the warm-up, then the window.
  void StartClock();
  // Places the window at `start`: its end, and the marks counted calls move on from there.
  void PlaceWindow(Clock::time_point start);
  // Open loop: starts the sender threads, returned to be joined.
  std::vector<std::thread> StartSenders();
  // Closed loop: fills the `concurrency` slots (fewer under a smaller count bound); from then
  // on each answer sends the next call.
  void LaunchFirstCalls();
  // Waits until no sender sends and no call is in flight, opening the window and reporting
  // progress on the way.
  void WaitForEnd();
  // Bounds the window and the elapsed time once every call has ended, and hands the report out.
  StepReport CloseReport();

  const std::vector<const LoadSender*>& connections_;
  const std::vector<WorkItem>& work_;
  const LoadOptions& options_;
  Clock::time_point start_, window_start_, window_end_;
  std::atomic<uint64_t> next_call_{0};
  std::once_flag window_once_;

  std::mutex mu_;
  std::condition_variable changed_;
  int64_t in_flight_ = 0;
  bool window_open_ = false;     // OpenWindow has run: calls from now on are counted
  int senders_running_ = 0;      // open loop: sender threads still sending
  int64_t counted_started_ = 0;  // closed loop: counted calls sent (the count bound)
  Clock::time_point last_counted_send_, last_counted_answer_, last_actual_send_;
  StepReport report_;
};

TimeSlice& StepRun::SliceOf(Clock::time_point scheduled) {
  const double at = std::max(0.0, SecondsBetween(window_start_, scheduled));
  const auto index = static_cast<size_t>(at / report_.slice_seconds);
  while (report_.timeline.size() <= index) {
    report_.timeline.emplace_back();
    report_.timeline.back().start_seconds =
        static_cast<double>(report_.timeline.size() - 1) * report_.slice_seconds;
  }
  return report_.timeline[index];
}

void StepRun::OpenWindow() {
  std::call_once(window_once_, [this] {
    if (options_.window_started) options_.window_started();
    std::lock_guard<std::mutex> lock(mu_);
    window_open_ = true;
    if (options_.mode == LoadMode::kClosed && options_.warmup > absl::ZeroDuration()) {
      PlaceWindow(Clock::now());  // the scrape took the window's first moments
    }
  });
}

void StepRun::CountSent(Clock::time_point scheduled, Clock::time_point now) {
  ++report_.scheduled;
  ++report_.sent;
  if (now - scheduled > absl::ToChronoNanoseconds(kLateAfter)) ++report_.late;
  report_.send_lag.Record(
      std::chrono::duration_cast<std::chrono::microseconds>(now - scheduled).count());
  ++SliceOf(scheduled).sent;
  last_counted_send_ = std::max(last_counted_send_, scheduled);
  last_actual_send_ = std::max(last_actual_send_, now);
}

void StepRun::Launch(Clock::time_point scheduled, bool counted) {
  const uint64_t n = next_call_.fetch_add(1, std::memory_order_relaxed);
  auto* call = new Call;
  call->scheduled = scheduled;
  call->counted = counted;
  call->item = &work_[n % work_.size()];
  const LoadSender* connection = connections_[n % connections_.size()];
  connection->SendAsync(*call->item, [this, call](absl::Status status) { Finish(call, status); });
}

void StepRun::Finish(Call* call, const absl::Status& status) {
  const Clock::time_point now = Clock::now();
  bool relaunch = false;
  bool relaunch_counted = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (call->counted) {
      TimeSlice& slice = SliceOf(call->scheduled);
      if (status.ok()) {
        const auto us =
            std::chrono::duration_cast<std::chrono::microseconds>(now - call->scheduled).count();
        report_.latency.Record(us);
        slice.latency.Record(us);
        ++report_.ok;
        ++slice.ok;
        report_.tokens += call->item->tokens;
      } else {
        if (++report_.errors[status.code()] == 1) {
          report_.first_error[status.code()] = std::string(status.message());
        }
        ++slice.failed;
      }
      last_counted_answer_ = std::max(last_counted_answer_, now);
    }
    // (A warm-up goes on until the window has opened, however late that is.)
    if (options_.mode == LoadMode::kClosed && (!window_open_ || now < window_end_)) {
      relaunch_counted = window_open_;
      relaunch = !relaunch_counted || options_.max_requests <= 0 ||
                 counted_started_ < options_.max_requests;
      if (relaunch && relaunch_counted) {
        ++counted_started_;
        CountSent(now, now);
      }
    }
  }
  // The call is gone before its slot is given back: once the last slot is, Run may return and
  // the process end, and nothing of a call may be left for gRPC's threads to free then.
  delete call;
  if (relaunch) {
    Launch(now, relaunch_counted);  // the slot passes to the next call
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  --in_flight_;
  // Only two events have waiters: the last call ended (the step's end), or room under the cap
  // (a sender). Waking on every answer would cost a context switch per call.
  if (in_flight_ == 0 || in_flight_ == options_.max_in_flight - 1) changed_.notify_all();
}

void StepRun::SendOpenLoop(int sender, int senders) {
  // The default 50 µs timer slack would make every sleep late at high rates.
  prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
  // Every sender walks the whole schedule (the same seed) and sends its share, call index
  // modulo senders, so the calls and the count bound are the same whatever the senders.
  std::mt19937_64 engine(options_.seed);
  std::exponential_distribution<double> gap(options_.rate);
  double at = 0;  // seconds from start_ of call `index`
  int64_t index = 0;
  int64_t counted = 0;  // calls before `index` due in the window
  auto due = [&] { return start_ + FromSeconds(at); };
  auto in_window = [&] { return due() >= window_start_; };
  auto advance = [&] {
    if (in_window()) ++counted;
    ++index;
    at = options_.arrival == Arrival::kPoisson ? at + gap(engine)
                                               : static_cast<double>(index) / options_.rate;
  };
  auto more = [&] {
    if (due() >= window_end_) return false;
    return !in_window() || options_.max_requests <= 0 || counted < options_.max_requests;
  };
  for (; more(); advance()) {
    if (index % senders != sender) continue;
    const Clock::time_point next = due();
    std::this_thread::sleep_until(next);
    if (in_window()) OpenWindow();
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto room = [&] { return in_flight_ < options_.max_in_flight; };
      if (window_end_ == Clock::time_point::max()) {
        changed_.wait(lock, room);
      } else if (!changed_.wait_until(lock, window_end_, room)) {
        break;  // the window closed while this call waited for room: unsent, counted below
      }
      ++in_flight_;
      if (in_window()) CountSent(next, Clock::now());
    }
    Launch(next, in_window());
  }
  // This sender's calls due in the window that the in-flight cap kept from being sent:
  // reported, not dropped.
  std::lock_guard<std::mutex> lock(mu_);
  for (; more(); advance()) {
    if (index % senders != sender || !in_window()) continue;
    ++report_.scheduled;
    ++report_.unsent;
  }
  last_counted_send_ = std::max(last_counted_send_, std::min(due(), window_end_));
  --senders_running_;
  changed_.notify_all();
}

StepProgress StepRun::Progress(Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  return {.seconds = SecondsBetween(window_start_, now),
          .sent = report_.sent,
          .ok = report_.ok,
          .failed = report_.failed(),
          .in_flight = in_flight_};
}

StepReport StepRun::Run() {
  DescribeLoad();
  if (options_.warmup <= absl::ZeroDuration()) OpenWindow();  // before the clock and any call
  StartClock();
  std::vector<std::thread> senders;
  if (options_.mode == LoadMode::kOpen) {
    senders = StartSenders();
  } else {
    LaunchFirstCalls();
  }
  WaitForEnd();
  for (std::thread& sender : senders) sender.join();
  return CloseReport();
}

void StepRun::DescribeLoad() {
  report_.mode = options_.mode;
  report_.arrival = options_.arrival;
  report_.concurrency = options_.mode == LoadMode::kClosed ? options_.concurrency : 0;
  report_.offered_rate = options_.mode == LoadMode::kOpen ? options_.rate : 0;
  report_.max_in_flight = options_.mode == LoadMode::kOpen ? options_.max_in_flight : 0;
  report_.connections = 0;
  for (const LoadSender* connection : connections_)
    report_.connections += connection->connections();
  const double window_seconds = absl::ToDoubleSeconds(options_.duration);
  report_.slice_seconds = window_seconds > 0 ? std::max(0.1, window_seconds / 60) : 1.0;
}

void StepRun::StartClock() {
  start_ = Clock::now();
  PlaceWindow(start_ + absl::ToChronoNanoseconds(options_.warmup));
}

void StepRun::PlaceWindow(Clock::time_point start) {
  window_start_ = start;
  window_end_ = options_.duration > absl::ZeroDuration()
                    ? window_start_ + absl::ToChronoNanoseconds(options_.duration)
                    : Clock::time_point::max();
  last_counted_send_ = last_counted_answer_ = last_actual_send_ = window_start_;
}

std::vector<std::thread> StepRun::StartSenders() {
  // A sender that wakes late sends every call already due at once (each timed from its own
  // due time), so a stall inside gRPC delays those calls but not the rate.
  const int count =
      std::clamp(static_cast<int>(options_.rate / kCallsPerSender) + 1, 1, kMaxSenders);
  senders_running_ = count;
  std::vector<std::thread> senders;
  for (int k = 0; k < count; ++k) senders.emplace_back(&StepRun::SendOpenLoop, this, k, count);
  return senders;
}

void StepRun::LaunchFirstCalls() {
  const bool counted = options_.warmup <= absl::ZeroDuration();
  const int64_t first = counted && options_.max_requests > 0
                            ? std::min<int64_t>(options_.concurrency, options_.max_requests)
                            : options_.concurrency;
  {
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_ = first;
    for (int64_t i = 0; counted && i < first; ++i) CountSent(start_, start_);
    counted_started_ = counted ? first : 0;
  }
  for (int64_t i = 0; i < first; ++i) Launch(start_, counted);
}

void StepRun::WaitForEnd() {
  bool window_open = options_.warmup <= absl::ZeroDuration();  // opened by Run
  while (true) {
    Clock::time_point wake = Clock::now() + std::chrono::milliseconds(500);
    if (!window_open) wake = std::min(wake, window_start_);
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (changed_.wait_until(lock, wake, [&] { return senders_running_ == 0 && in_flight_ == 0; }))
        break;
    }
    const Clock::time_point now = Clock::now();
    if (!window_open && now >= window_start_) {
      window_open = true;
      OpenWindow();  // an open loop's sender may have opened it already
    }
    if (options_.progress) options_.progress(Progress(now));
  }
}

StepReport StepRun::CloseReport() {
  std::lock_guard<std::mutex> lock(mu_);
  // The window ends at its time bound, or where the count bound stopped the sending.
  const bool count_bound_hit =
      options_.max_requests > 0 && report_.scheduled >= options_.max_requests;
  Clock::time_point closed = window_end_;
  if (count_bound_hit || window_end_ == Clock::time_point::max()) {
    closed = std::min(window_end_, std::max(last_counted_send_, window_start_));
  }
  report_.window = absl::FromChrono(closed - window_start_);
  report_.send_span = absl::FromChrono(last_actual_send_ - window_start_);
  report_.elapsed =
      std::max(report_.window, absl::FromChrono(last_counted_answer_ - window_start_));
  return std::move(report_);
}

// Whether the values all lie within `percent` % of their mean.
bool WithinPercent(const std::vector<double>& values, double percent) {
  double mean = 0;
  for (double v : values) mean += v / static_cast<double>(values.size());
  for (double v : values) {
    if (std::fabs(v - mean) > mean * percent / 100) return false;
  }
  return true;
}

// perf_analyzer's rule: a step is stable when its last three windows agree.
constexpr size_t kAgreeingTrials = 3;

// Whether the last three trials agree on throughput and p99 within `percent` %.
bool LastTrialsAgree(const std::vector<StepReport>& trials, double percent) {
  if (trials.size() < kAgreeingTrials) return false;
  std::vector<double> rates, p99s;
  for (size_t i = trials.size() - kAgreeingTrials; i < trials.size(); ++i) {
    rates.push_back(trials[i].requests_per_second());
    p99s.push_back(static_cast<double>(trials[i].latency.ValueAtQuantile(0.99)));
  }
  return WithinPercent(rates, percent) && WithinPercent(p99s, percent);
}

}  // namespace

int64_t StepReport::failed() const {
  int64_t count = 0;
  for (const auto& [code, n] : errors) count += n;
  return count;
}

double StepReport::requests_per_second() const {
  const double seconds = absl::ToDoubleSeconds(elapsed);
  return seconds > 0 ? static_cast<double>(ok) / seconds : 0.0;
}

double StepReport::tokens_per_second() const {
  const double seconds = absl::ToDoubleSeconds(elapsed);
  return seconds > 0 ? static_cast<double>(tokens) / seconds : 0.0;
}

double StepReport::achieved_rate() const {
  const double seconds = absl::ToDoubleSeconds(std::max(window, send_span));
  return seconds > 0 ? static_cast<double>(sent) / seconds : 0.0;
}

void GrpcLoadSender::SendAsync(const WorkItem& item, std::function<void(absl::Status)> done) const {
  // What gRPC fills in, freed once the answer is handed on.
  struct Call {
    grpc::ClientContext context;
    v1::ForwardResponse response;
  };
  auto* call = new Call;
  client_->SendAsync(&call->context, &item.request, &call->response,
                     [call, done = std::move(done)](grpc::Status status) {
                       delete call;
                       done(FromGrpcStatus(status));
                     });
}

absl::Status GrpcLoadSender::Send(const WorkItem& item) const {
  return client_->Send(item.request).status();
}

LoadEngine::LoadEngine(std::vector<const LoadSender*> connections, std::vector<WorkItem> work)
    : connections_(std::move(connections)), work_(std::move(work)) {}

absl::StatusOr<StepReport> LoadEngine::RunStep(const LoadOptions& options) const {
  if (connections_.empty() || work_.empty()) {
    return absl::InvalidArgumentError("a load test needs a connection and a request");
  }
  if (options.duration <= absl::ZeroDuration() && options.max_requests <= 0) {
    return absl::InvalidArgumentError("a load test needs a duration or a request count");
  }
  if (options.mode == LoadMode::kClosed && options.concurrency < 1) {
    return absl::InvalidArgumentError("concurrency must be >= 1");
  }
  if (options.mode == LoadMode::kOpen && !(options.rate > 0 && options.rate <= kMaxRate)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rate must be in (0, ", kMaxRate, "] calls per second"));
  }
  if (options.mode == LoadMode::kOpen && options.max_in_flight < 1) {
    return absl::InvalidArgumentError("max-in-flight must be >= 1");
  }
  StepRun run(connections_, work_, options);
  return run.Run();
}

absl::Status LoadEngine::Check(int calls) const {
  for (int i = 0; i < calls; ++i) {
    const LoadSender* connection = connections_[i % connections_.size()];
    if (absl::Status s = connection->Send(work_[i % work_.size()]); !s.ok()) return s;
  }
  return absl::OkStatus();
}

void MergeStep(StepReport& into, const StepReport& next) {
  const double offset = absl::ToDoubleSeconds(into.window);
  into.trials += next.trials;
  into.trials_run += next.trials_run;
  into.window += next.window;
  into.elapsed += next.elapsed;
  into.scheduled += next.scheduled;
  into.sent += next.sent;
  into.late += next.late;
  into.unsent += next.unsent;
  into.ok += next.ok;
  for (const auto& [code, n] : next.errors) into.errors[code] += n;
  into.first_error.insert(next.first_error.begin(), next.first_error.end());  // keeps the earlier
  into.tokens += next.tokens;
  into.latency.Merge(next.latency);
  into.send_lag.Merge(next.send_lag);
  into.send_span = into.window - next.window + next.send_span;
  for (TimeSlice slice : next.timeline) {
    slice.start_seconds += offset;
    into.timeline.push_back(std::move(slice));
  }
  if (next.decode.has_value()) {
    if (!into.decode.has_value()) {
      into.decode = next.decode;
    } else {
      DecodeFigures& d = *into.decode;
      d.sessions += next.decode->sessions;
      d.prompt_tokens += next.decode->prompt_tokens;
      d.step_tokens += next.decode->step_tokens;
      d.prefill_elapsed += next.decode->prefill_elapsed;
      d.decode_elapsed += next.decode->decode_elapsed;
      d.first_output.Merge(next.decode->first_output);
      d.inter_token.Merge(next.decode->inter_token);
    }
  }
}

double DecodeFigures::tokens_per_second() const {
  const double seconds = absl::ToDoubleSeconds(decode_elapsed);
  return seconds > 0 ? static_cast<double>(step_tokens) / seconds : 0;
}

double DecodeFigures::prompt_tokens_per_second() const {
  const double seconds = absl::ToDoubleSeconds(prefill_elapsed);
  return seconds > 0 ? static_cast<double>(prompt_tokens) / seconds : 0;
}

absl::StatusOr<StepReport> RunStableStep(const LoadEngine& engine, LoadOptions options,
                                         double percent, int max_trials) {
  if (percent <= 0) return engine.RunStep(options);
  const int limit = std::max<int>(max_trials, kAgreeingTrials);
  std::vector<StepReport> trials;
  bool stable = false;
  while (!stable && static_cast<int>(trials.size()) < limit) {
    absl::StatusOr<StepReport> trial = engine.RunStep(options);
    if (!trial.ok()) return trial.status();
    options.warmup = absl::ZeroDuration();  // the load of the last window warmed the next
    trials.push_back(*std::move(trial));
    stable = LastTrialsAgree(trials, percent);
  }
  StepReport merged = trials[trials.size() - kAgreeingTrials];
  for (size_t i = trials.size() - kAgreeingTrials + 1; i < trials.size(); ++i) {
    MergeStep(merged, trials[i]);
  }
  merged.trials_run = static_cast<int>(trials.size());
  merged.stable = stable;
  return merged;
}

absl::StatusOr<std::vector<double>> ParseSweep(const std::string& text, bool integer) {
  constexpr size_t kMaxSteps = 100;
  const absl::Status bad = absl::InvalidArgumentError(absl::StrCat(
      "sweep '", text, "' is not START:END[:STEP] with 0 < START <= END (STEP: +N or xF, F > 1)"));
  std::vector<std::string> parts = absl::StrSplit(text, ':');
  double start = 0, end = 0, step = integer ? 1 : 2;
  bool multiply = !integer;
  if (parts.size() < 2 || parts.size() > 3 || !absl::SimpleAtod(parts[0], &start) ||
      !absl::SimpleAtod(parts[1], &end) || !(start > 0) || !(end >= start) || !std::isfinite(end)) {
    return bad;
  }
  if (parts.size() == 3) {
    absl::string_view s = parts[2];
    multiply = absl::ConsumePrefix(&s, "x") || absl::ConsumePrefix(&s, "*");
    absl::ConsumePrefix(&s, "+");
    if (!absl::SimpleAtod(s, &step) || !std::isfinite(step) || (multiply ? step <= 1 : step <= 0)) {
      return bad;
    }
  }
  if (integer && (start != std::floor(start) || end != std::floor(end))) return bad;
  std::vector<double> values;
  for (double v = start; v <= end * (1 + 1e-9); v = multiply ? v * step : v + step) {
    values.push_back(integer ? std::round(v) : v);
    if (values.size() > kMaxSteps) {
      return absl::InvalidArgumentError(
          absl::StrCat("sweep '", text, "' has more than ", kMaxSteps, " steps"));
    }
  }
  if (integer) values.erase(std::unique(values.begin(), values.end()), values.end());
  return values;
}

int64_t QueryTokens(const v1::ForwardRequest& request) {
  if (request.lengths_size() > 0) {
    int64_t sum = 0;
    for (int32_t len : request.lengths()) sum += len;
    return sum;
  }
  const auto& shape = request.input().shape();
  int64_t rows = 1;
  for (int i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
  return rows;
}

}  // namespace attnserve::client
