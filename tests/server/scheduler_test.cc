// The scheduler and compute executor with fake jobs on the real demo layer: merging, the token
// target, the delay window, splitting back per call, dead calls leaving at once, the drain
// deadline and fair turns between models. No gRPC: jobs are plain objects the test owns.

#include "server/serving/scheduler.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/weights.h"
#include "gtest/gtest.h"
#include "server/serving/compute_executor.h"
#include "server/serving/decode_queue.h"
#include "server/serving/model_registry.h"
#include "server/serving/run_cost.h"
#include "server/serving/sequence_table.h"
#include "server/serving/session.h"
#include "tests/server/scrape.h"

namespace attnserve::server::testing {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr int64_t kWidth = 256;  // the demo layer's d_model

std::shared_ptr<const core::Layer> DemoLayer() {
  static const std::shared_ptr<const core::Layer> layer =
      *core::Layer::Create(core::MakeDemoWeights());
  return layer;
}

// The demo layer as a model version, as admission hands one to every call.
VersionHandle MakeDemoVersion(int64_t number) {
  return std::make_shared<ModelVersion>(ModelVersion{
      .name = "m", .version = number, .source = "built-in", .layer = DemoLayer(), .summary = {}});
}

VersionHandle DemoVersion() {
  static const VersionHandle version = MakeDemoVersion(1);
  return version;
}

// A smooth prompt of `tokens` demo tokens.
std::vector<float> SmoothPrompt(int64_t tokens) {
  std::vector<float> prompt(tokens * kWidth);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = std::sin(0.001f * i);
  return prompt;
}

// A causal cross session's context: the first 8 rows of `rows`, one sequence.
core::RaggedBatch EightTokenContext(const std::vector<float>& rows) {
  core::RaggedBatch context;
  context.data = rows.data();
  context.width = kWidth;
  context.lengths = {8};
  return context;
}

// A causal session of one sequence on the demo version (null, and a test failure, if refused).
std::unique_ptr<Session> OpenCausal(SessionManager& manager, DecodeQueue& queue) {
  absl::StatusOr<std::unique_ptr<Session>> opened =
      manager.Open(DemoVersion(), core::AttentionKind::kCausal, 1, nullptr, &queue, nullptr);
  EXPECT_TRUE(opened.ok()) << opened.status();
  return opened.ok() ? *std::move(opened) : nullptr;
}

// Version 2 of "m", the demo weights in a layer of its own: another group of decode runs than
// DemoVersion's.
VersionHandle OtherDemoVersion() {
  return std::make_shared<ModelVersion>(
      ModelVersion{.name = "m",
                   .version = 2,
                   .source = "built-in",
                   .layer = *core::Layer::Create(core::MakeDemoWeights()),
                   .summary = {}});
}

// A call that owns its input and its reply, and records its answer.
class FakeJob final : public Job {
 public:
  // A padded [lengths.size(), padded, kWidth] call (packed when padded is kPacked) whose values
  // depend on `seed`.
  FakeJob(std::vector<int64_t> lengths, int64_t padded, int seed,
          Clock::time_point deadline = Clock::time_point::max(),
          VersionHandle version = DemoVersion())
      : Job(Clock::now(), deadline) {
    set_version(std::move(version));
    args_.kind = core::AttentionKind::kCausal;
    args_.input.width = kWidth;
    args_.input.lengths = std::move(lengths);
    args_.input.padded_length = padded;
    input_.resize(args_.input.rows() * kWidth);
    for (size_t i = 0; i < input_.size(); ++i) input_[i] = std::sin(0.01f * (i + 97 * seed));
    args_.input.data = input_.data();
  }

  absl::StatusOr<absl::string_view> RequestedModel() override { return ""; }
  absl::Status Decode() override { return absl::OkStatus(); }
  const core::ForwardArgs& args() const override { return args_; }
  int64_t ReplyBytes(const core::ForwardShapes& shapes) const override {
    return shapes.output_size() * 4;
  }
  absl::StatusOr<ForwardBuffers> Buffers(const core::ForwardShapes& shapes) override {
    std::this_thread::sleep_for(slow_buffers_);   // a run that takes at least this long
    output_.assign(shapes.output_size(), -1.0f);  // Buffers promises zeros: check it writes them
    std::fill(output_.begin(), output_.end(), 0.0f);
    return ForwardBuffers{output_, {}};
  }
  void Finish(const absl::Status& status) override {
    std::lock_guard lock(mu_);
    status_ = status;
    finished_at_ = Clock::now();
    finished_on_ = std::this_thread::get_id();
    cv_.notify_all();
  }

  // The answer, waiting up to `timeout` for it.
  std::optional<absl::Status> Wait(Clock::duration timeout = seconds(30)) {
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, timeout, [this] { return status_.has_value(); });
    return status_;
  }
  Clock::time_point finished_at() {
    std::lock_guard lock(mu_);
    return finished_at_;
  }
  // The thread that answered the call (none before it is answered).
  std::thread::id finished_on() {
    std::lock_guard lock(mu_);
    return finished_on_;
  }
  const std::vector<float>& output() const { return output_; }
  // Makes the call's run take at least `duration` (its buffers are made inside the run).
  void set_slow_buffers(Clock::duration duration) { slow_buffers_ = duration; }

  // What the layer gives for this call alone (Layer::Forward, no scheduler).
  std::vector<float> Alone() const {
    std::vector<float> out(DemoLayer()->Shapes(args_).output_size());
    EXPECT_TRUE(DemoLayer()->Forward(args_, out).ok());
    return out;
  }

 private:
  core::ForwardArgs args_;
  std::vector<float> input_;
  std::vector<float> output_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<absl::Status> status_;
  Clock::time_point finished_at_;
  std::thread::id finished_on_;
  Clock::duration slow_buffers_{0};
};

// Records how each call ran.
class RecordingReporter final : public CallReporter {
 public:
  void Answer(Job& job, absl::string_view model, bool decoded, const absl::Status& status,
              const RunInfo& run, absl::string_view requested) override {
    {
      std::lock_guard lock(mu_);
      runs_.push_back({std::string(model), run});
    }
    CallReporter::Answer(job, model, decoded, status, run, requested);
  }
  struct Record {
    std::string model;
    RunInfo run;
  };
  std::vector<Record> runs() {
    std::lock_guard lock(mu_);
    return runs_;
  }

 private:
  std::mutex mu_;
  std::vector<Record> runs_;
};

// Admission's part, as the scheduler expects it: a queue place first, then Submit.
void Queue(Scheduler& scheduler, FakeJob& job) {
  ASSERT_TRUE(scheduler.Reserve().ok());
  const absl::Status submitted = scheduler.Submit(&job);
  if (!submitted.ok()) scheduler.Release();  // as admission does: a refused call holds no place
  ASSERT_TRUE(submitted.ok()) << submitted;
}

SchedulerOptions Options(int64_t tokens, milliseconds delay, int max_queue = 128) {
  return {.max_queue = max_queue,
          .max_batch_tokens = tokens,
          .max_queue_delay = std::chrono::duration_cast<std::chrono::microseconds>(delay)};
}

TEST(SchedulerTest, CallsQueuedInTheWindowAreMergedAndSplitBackPerCall) {
  ComputeExecutor executor(1);
  RecordingReporter reporter;
  Scheduler scheduler("m", Options(4096, milliseconds(300)), &executor, &reporter);
  // Padded with padding, padded full, packed: one run, each answer in its own layout.
  FakeJob a({5, 2}, 6, 1), b({4}, 4, 2), c({3, 7}, core::RaggedBatch::kPacked, 3);
  Queue(scheduler, a);
  Queue(scheduler, b);
  Queue(scheduler, c);
  for (FakeJob* job : {&a, &b, &c}) {
    const std::optional<absl::Status> status = job->Wait();
    ASSERT_TRUE(status.has_value() && status->ok());
    const std::vector<float> alone = job->Alone();
    ASSERT_EQ(job->output().size(), alone.size());
    for (size_t i = 0; i < alone.size(); ++i) {
      ASSERT_NEAR(job->output()[i], alone[i], 1e-5f) << "element " << i;
    }
  }
  // Padded rows of a's reply are zero (row 5 of sequence 0, rows 2..5 of sequence 1).
  for (int64_t c0 = 0; c0 < kWidth; ++c0) EXPECT_EQ(a.output()[5 * kWidth + c0], 0.0f);
  for (const auto& record : reporter.runs()) {
    EXPECT_EQ(record.run.batch_calls, 3);
    EXPECT_EQ(record.run.batch_tokens, 7 + 4 + 10);
  }
}

TEST(SchedulerTest, CallsOfDifferentVersionsAreNeverMerged) {
  ComputeExecutor executor(1);
  RecordingReporter reporter;
  Scheduler scheduler("m", Options(4096, milliseconds(300)), &executor, &reporter);
  // Two versions (the same weights, so only the runs tell them apart), interleaved in a window.
  const VersionHandle second = MakeDemoVersion(2);
  FakeJob a({4}, 4, 1), b({4}, 4, 2, Clock::time_point::max(), second), c({4}, 4, 3),
      d({4}, 4, 4, Clock::time_point::max(), second);
  for (FakeJob* job : {&a, &b, &c, &d}) Queue(scheduler, *job);
  for (FakeJob* job : {&a, &b, &c, &d}) {
    ASSERT_TRUE(job->Wait().value_or(absl::UnknownError("")).ok());
  }
  const auto runs = reporter.runs();
  ASSERT_EQ(runs.size(), 4u);
  for (const auto& record : runs) EXPECT_EQ(record.run.batch_calls, 2);
  // The calls let go of their versions once answered (right after Finish returns): soon only
  // `second` holds version 2.
  const Clock::time_point end = Clock::now() + seconds(5);
  while (second.use_count() > 1 && Clock::now() < end) std::this_thread::sleep_for(milliseconds(1));
  EXPECT_EQ(second.use_count(), 1);
}

TEST(SchedulerTest, TheTokenTargetBoundsARun) {
  ComputeExecutor executor(1);
  RecordingReporter reporter;
  // 16-token calls, a 32-token target: runs of two calls.
  Scheduler scheduler("m", Options(32, milliseconds(300)), &executor, &reporter);
  std::vector<std::unique_ptr<FakeJob>> jobs;
  for (int i = 0; i < 4; ++i) {
    jobs.push_back(std::make_unique<FakeJob>(std::vector<int64_t>{16}, 16, i));
    Queue(scheduler, *jobs.back());
  }
  for (auto& job : jobs) ASSERT_TRUE(job->Wait().value_or(absl::UnknownError("")).ok());
  for (const auto& record : reporter.runs()) {
    EXPECT_EQ(record.run.batch_calls, 2);
    EXPECT_EQ(record.run.batch_tokens, 32);
  }
}

// Even a call small enough to run on its caller's thread: the window is for calls to join it.
TEST(SchedulerTest, TheDelayWindowHoldsALoneCallThenRunsIt) {
  ComputeExecutor executor(1);
  CallReporter reporter;
  Scheduler scheduler("m", Options(4096, milliseconds(200)), &executor, &reporter);
  FakeJob job({1}, 1, 1);
  Queue(scheduler, job);
  ASSERT_TRUE(job.Wait().value_or(absl::UnknownError("")).ok());
  EXPECT_GE(job.finished_at() - job.arrival(), milliseconds(200));
  EXPECT_NE(job.finished_on(), std::this_thread::get_id());
}

TEST(SchedulerTest, WithoutADelayWindowACallRunsAtOnce) {
  ComputeExecutor executor(1);
  RecordingReporter reporter;
  Scheduler scheduler("m", Options(4096, milliseconds(0)), &executor, &reporter);
  FakeJob job({8}, 8, 1);
  Queue(scheduler, job);
  ASSERT_TRUE(job.Wait().value_or(absl::UnknownError("")).ok());
  ASSERT_EQ(reporter.runs().size(), 1u);
  EXPECT_EQ(reporter.runs()[0].run.batch_calls, 1);
}

TEST(SchedulerTest, ACallWhoseCallerLeftIsAnsweredAtOnceAndFreesItsPlace) {
  ComputeExecutor executor(1);
  CallReporter reporter;
  // A 10 s window keeps the calls queued; two places only.
  Scheduler scheduler("m", Options(4096, seconds(10), /*max_queue=*/2), &executor, &reporter);
  FakeJob a({8}, 8, 1), b({8}, 8, 2);
  Queue(scheduler, a);
  Queue(scheduler, b);
  EXPECT_EQ(scheduler.Reserve().code(), absl::StatusCode::kResourceExhausted);
  a.CallerGone();
  const std::optional<absl::Status> status = a.Wait(seconds(2));
  ASSERT_TRUE(status.has_value()) << "a cancelled call waited in the queue";
  EXPECT_EQ(status->code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(scheduler.Reserve().ok()) << "the cancelled call kept its place";
  scheduler.Release();
  scheduler.Close(Clock::now());  // b: answered Unavailable, not after 10 s
  scheduler.Join();
}

// A sequence's request waiting for its turn holds one of the model's --max-queue places, as a
// queued call does, until it is given back; a drain does not wait for it.
TEST(SchedulerTest, SequenceRequestsWaitingTheirTurnShareTheQueuesPlacesWithCalls) {
  ComputeExecutor executor(1);
  CallReporter reporter;
  Scheduler scheduler("m", Options(4096, seconds(10), /*max_queue=*/2), &executor, &reporter);
  ASSERT_TRUE(scheduler.ReserveWaitingStep().ok());
  FakeJob a({8}, 8, 1);
  Queue(scheduler, a);
  EXPECT_EQ(scheduler.Reserve().code(), absl::StatusCode::kResourceExhausted);
  const absl::Status full = scheduler.ReserveWaitingStep();
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.message().find("model 'm' has 2 calls queued (--max-queue)"), std::string::npos)
      << full;
  scheduler.ReleaseWaitingStep();
  ASSERT_TRUE(scheduler.Reserve().ok()) << "the request given back kept its place";
  scheduler.Release();
  ASSERT_TRUE(scheduler.ReserveWaitingStep().ok());
  scheduler.Close(Clock::now());
  EXPECT_EQ(scheduler.ReserveWaitingStep().code(), absl::StatusCode::kUnavailable);
  // The join ends with the queued call's answer, though a request still holds its place.
  auto joined = std::async(std::launch::async, [&] { scheduler.Join(); });
  EXPECT_EQ(joined.wait_for(seconds(5)), std::future_status::ready);
  const std::optional<absl::Status> status = a.Wait(seconds(1));
  ASSERT_TRUE(status.has_value());
  EXPECT_EQ(status->code(), absl::StatusCode::kUnavailable);
  scheduler.ReleaseWaitingStep();
}

TEST(SchedulerTest, ACallWhoseDeadlinePassesLeavesTheQueueThen) {
  ComputeExecutor executor(1);
  CallReporter reporter;
  Scheduler scheduler("m", Options(4096, seconds(10)), &executor, &reporter);
  // (A deadline far enough that a loaded machine, TSan's included, still queues the call: at
  // 100 ms, Submit once came after it and refused the call at once.)
  FakeJob job({8}, 8, 1, Clock::now() + seconds(1));
  Queue(scheduler, job);
  const std::optional<absl::Status> status = job.Wait(seconds(5));
  ASSERT_TRUE(status.has_value()) << "the call stayed queued past its deadline";
  EXPECT_EQ(status->code(), absl::StatusCode::kDeadlineExceeded);
  scheduler.Join();  // returns once the answer is out and nothing is queued or running
  EXPECT_EQ(scheduler.pending(), 0);
}

TEST(SchedulerTest, CallsStillQueuedWhenTheDrainDeadlinePassesAreUnavailable) {
  ComputeExecutor executor(1);
  CallReporter reporter;
  Scheduler scheduler("m", Options(4096, seconds(10)), &executor, &reporter);
  FakeJob job({8}, 8, 1);
  Queue(scheduler, job);
  scheduler.Close(Clock::now() - milliseconds(1));
  EXPECT_EQ(scheduler.Reserve().code(), absl::StatusCode::kUnavailable);
  scheduler.Join();
  EXPECT_EQ(job.Wait(seconds(0)).value_or(absl::OkStatus()).code(), absl::StatusCode::kUnavailable);
}

TEST(SchedulerTest, ADrainWithoutDeadlineComputesEveryQueuedCall) {
  ComputeExecutor executor(1);
  CallReporter reporter;
  Scheduler scheduler("m", Options(4096, seconds(10)), &executor, &reporter);
  FakeJob job({8}, 8, 1);
  Queue(scheduler, job);
  scheduler.Drain();  // closing ends the window: the call runs now
  EXPECT_TRUE(job.Wait(seconds(0)).value_or(absl::UnknownError("")).ok());
}

TEST(SchedulerTest, ModelsTakeTurnsOnOneExecutor) {
  ComputeExecutor executor(1);
  RecordingReporter reporter;
  // No merging: one call a run.
  const SchedulerOptions options = Options(0, milliseconds(0));
  Scheduler first("first", options, &executor, &reporter);
  Scheduler second("second", options, &executor, &reporter);
  std::vector<std::unique_ptr<FakeJob>> jobs;
  // A long call (made to last 200 ms on any machine) occupies the executor while three calls of
  // each model queue up.
  jobs.push_back(std::make_unique<FakeJob>(std::vector<int64_t>{512, 512, 512, 512}, 512, 0));
  jobs.back()->set_slow_buffers(milliseconds(200));
  Queue(first, *jobs.back());
  for (int i = 0; i < 3; ++i) {
    jobs.push_back(std::make_unique<FakeJob>(std::vector<int64_t>{8}, 8, i));
    Queue(first, *jobs.back());
  }
  for (int i = 0; i < 3; ++i) {
    jobs.push_back(std::make_unique<FakeJob>(std::vector<int64_t>{8}, 8, i));
    Queue(second, *jobs.back());
  }
  for (auto& job : jobs) ASSERT_TRUE(job->Wait().value_or(absl::UnknownError("")).ok());
  std::vector<std::string> order;
  for (const auto& record : reporter.runs()) order.push_back(record.model);
  // After the long call, the models alternate while both have calls queued.
  const std::vector<std::string> expected = {"first", "second", "first", "second",
                                             "first", "second", "first"};
  EXPECT_EQ(order, expected);
}

// --- Overload: deadlines against the measured cost of runs ---------------------------------

// Runs `count` calls of `lengths` (no deadline) to the end, so the scheduler has measured runs.
void Warm(Scheduler& scheduler, const std::vector<int64_t>& lengths, int64_t padded, int count) {
  for (int i = 0; i < count; ++i) {
    FakeJob job(lengths, padded, i);
    Queue(scheduler, job);
    ASSERT_TRUE(job.Wait().value_or(absl::UnknownError("no answer")).ok());
  }
}

// Queues `count` 4x512 calls (no deadline), each run made to last at least `each`: a backlog
// still there when the test looks, however fast the machine (one computed 40 real runs of these
// in under 250 ms).
std::vector<std::unique_ptr<FakeJob>> Backlog(Scheduler& scheduler, int count,
                                              Clock::duration each) {
  std::vector<std::unique_ptr<FakeJob>> backlog;
  for (int i = 0; i < count; ++i) {
    backlog.push_back(std::make_unique<FakeJob>(std::vector<int64_t>{512, 512, 512, 512}, 512, i));
    backlog.back()->set_slow_buffers(each);
    Queue(scheduler, *backlog.back());
  }
  return backlog;
}

TEST(SchedulerOverloadTest, ADeadlineTheQueuedWorkCannotMeetIsRefusedAtOnceBeforeDecode) {
  ComputeExecutor executor(1);
  std::unique_ptr<Metrics> metrics = Metrics::Create();
  absl::StatusOr<int> port = metrics->Serve("127.0.0.1:0");
  ASSERT_TRUE(port.ok()) << port.status();
  CallReporter reporter(metrics.get());
  Scheduler scheduler("m", Options(0, milliseconds(0)), &executor, &reporter);
  Warm(scheduler, {512, 512, 512, 512}, 512, 3);
  // Many runs' worth of work queued, no deadline: far more than 5 ms.
  const std::vector<std::unique_ptr<FakeJob>> backlog = Backlog(scheduler, 16, milliseconds(10));
  // Reserve is what admission asks before the call's tensors are decoded.
  const absl::Status refused = scheduler.Reserve(Clock::now() + milliseconds(5));
  EXPECT_EQ(refused.code(), absl::StatusCode::kDeadlineExceeded) << refused;
  EXPECT_NE(refused.message().find("refused at once"), absl::string_view::npos) << refused;
  // A refusal waits for nothing: the queued work is still there (a wall-clock bound would also
  // count the moments a loaded machine takes this thread off its core).
  EXPECT_FALSE(backlog.back()->Wait(Clock::duration::zero()).has_value())
      << "the refusal came after the queued work had run";
  // With its size known (after decode), a call whose own run outlasts its deadline is refused
  // too, and gives its place back.
  const absl::Status reserved = scheduler.Reserve();
  ASSERT_TRUE(reserved.ok()) << reserved;
  FakeJob late({512, 512, 512, 512}, 512, 99, Clock::now() + milliseconds(5));
  EXPECT_EQ(scheduler.Submit(&late).code(), absl::StatusCode::kDeadlineExceeded);
  scheduler.Release();
  // A call without a deadline is queued as before.
  FakeJob patient({16}, 16, 100);
  Queue(scheduler, patient);
  for (auto& job : backlog) EXPECT_TRUE(job->Wait().value_or(absl::UnknownError("")).ok());
  EXPECT_TRUE(patient.Wait().value_or(absl::UnknownError("")).ok());
  absl::StatusOr<std::map<std::string, double>> samples = Scrape(*port);
  ASSERT_TRUE(samples.ok()) << samples.status();
  EXPECT_EQ((*samples)[SeriesKey("attnserve_shed_total", {{"model", "m"}, {"reason", "deadline"}})],
            2);
}

TEST(SchedulerOverloadTest, ComputeForACallAnsweredAfterItsDeadlineIsCountedLate) {
  ComputeExecutor executor(1);
  std::unique_ptr<Metrics> metrics = Metrics::Create();
  absl::StatusOr<int> port = metrics->Serve("127.0.0.1:0");
  ASSERT_TRUE(port.ok()) << port.status();
  CallReporter reporter(metrics.get());
  const std::string late_key = SeriesKey("attnserve_late_compute_seconds_total", {{"model", "m"}});
  double late = 0;
  // Before any run is measured nothing is refused on a guess, so a call whose deadline is
  // shorter than its run (made to last 200 ms) runs and ends late. A fresh scheduler each try:
  // a loaded machine may let the deadline pass before the run starts, and then the call leaves
  // without compute (or is refused before it queues).
  for (int attempt = 0; attempt < 5 && late == 0; ++attempt) {
    Scheduler scheduler("m", Options(0, milliseconds(0)), &executor, &reporter);
    FakeJob job({16}, 16, attempt, Clock::now() + milliseconds(100));
    job.set_slow_buffers(milliseconds(200));
    ASSERT_TRUE(scheduler.Reserve().ok());
    if (!scheduler.Submit(&job).ok()) {
      scheduler.Release();
      continue;
    }
    ASSERT_TRUE(job.Wait().has_value());
    absl::StatusOr<std::map<std::string, double>> samples = Scrape(*port);
    ASSERT_TRUE(samples.ok()) << samples.status();
    late = (*samples)[late_key];
  }
  EXPECT_GT(late, 0.0);
}

TEST(SchedulerOverloadTest, AStandingQueuePastTheTargetRefusesCallsWithADeadline) {
  ComputeExecutor executor(1);
  CallReporter reporter;
  SchedulerOptions options = Options(0, milliseconds(0));
  options.queue_delay_target = milliseconds(1);
  Scheduler scheduler("m", options, &executor, &reporter);
  Warm(scheduler, {512, 512, 512, 512}, 512, 2);
  const std::vector<std::unique_ptr<FakeJob>> backlog = Backlog(scheduler, 40, milliseconds(25));
  // Every call starting a run has waited past 1 ms for over 100 ms: overloaded. A call with a
  // generous deadline is refused for the delay it would wait, not for its deadline.
  std::this_thread::sleep_for(milliseconds(250));
  ASSERT_GT(scheduler.pending(), 1) << "the backlog ran out before the test could look";
  const absl::Status refused = scheduler.Reserve(Clock::now() + seconds(60));
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("overloaded"), absl::string_view::npos) << refused;
  // Without a deadline a call is bounded by --max-queue alone.
  EXPECT_TRUE(scheduler.Reserve().ok());
  scheduler.Release();
  for (auto& job : backlog) EXPECT_TRUE(job->Wait().value_or(absl::UnknownError("")).ok());
}

TEST(RunCostTest, LearnsTheFixedAndPerTokenPartsOfARun) {
  RunCost cost;
  EXPECT_FALSE(cost.known());
  EXPECT_EQ(cost.Estimate(1000), 0.0) << "nothing is refused on a guess";
  // Runs cost 1 ms + 2 us a token.
  for (int i = 0; i < 200; ++i) {
    const int64_t tokens = 16 + (i * 37) % 2000;
    cost.Observe(tokens, 1e-3 + 2e-6 * tokens);
  }
  EXPECT_NEAR(cost.Estimate(1000), 3e-3, 1e-5);
  EXPECT_NEAR(cost.Estimate(1000, /*runs=*/3), 5e-3, 1e-5);
  // Runs of one size only: the whole cost is per token.
  RunCost same;
  for (int i = 0; i < 10; ++i) same.Observe(100, 1e-3);
  EXPECT_NEAR(same.Estimate(100), 1e-3, 1e-9);
  EXPECT_NEAR(same.Estimate(200), 2e-3, 1e-9);
}

// A queue the test drives by hand: ready when told, its runs recording their thread and, when
// `hold` is set, waiting in RunNext until released.
class HandQueue final : public RunQueue {
 public:
  Clock::time_point ReadyAt(Clock::time_point now) const override {
    std::lock_guard lock(mu_);
    return ready_ ? now : Clock::time_point::max();
  }
  void RunNext(Clock::time_point /*now*/, bool /*on_caller*/) noexcept override {
    std::unique_lock lock(mu_);
    ready_ = false;
    threads_.push_back(std::this_thread::get_id());
    cv_.notify_all();
    cv_.wait(lock, [this] { return !hold_; });
    std::function<void()> during = during_;
    lock.unlock();  // `during` takes the executor's lock, which is taken before ours
    if (during) during();
  }
  void SetReady() {
    std::lock_guard lock(mu_);
    ready_ = true;
  }
  void Hold(bool hold) {
    std::lock_guard lock(mu_);
    hold_ = hold;
    cv_.notify_all();
  }
  void AtRun(std::function<void()> f) {
    std::lock_guard lock(mu_);
    during_ = std::move(f);
  }
  bool WaitRuns(size_t n) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, seconds(10), [&] { return threads_.size() >= n; });
  }
  std::vector<std::thread::id> threads() const {
    std::lock_guard lock(mu_);
    return threads_;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool ready_ = false, hold_ = false;
  std::vector<std::thread::id> threads_;
  std::function<void()> during_;
};

// Returns once `executor`'s compute thread waits for a Notify: a queue's run is made on it, and
// the queue's removal waits for that thread to leave the run and look at the queues again. (A
// queue made ready without a Notify is then not taken behind the test's back.)
void WaitUntilParked(ComputeExecutor& executor) {
  HandQueue warm;
  executor.Add(&warm);
  warm.SetReady();
  executor.Notify();
  ASSERT_TRUE(warm.WaitRuns(1));
  executor.Remove(&warm);
}

// Returns once `other` (added to `executor` here) holds the compute thread in its run, until
// other.Hold(false): work queued meanwhile waits, and nothing runs inline.
void HoldComputeThread(ComputeExecutor& executor, HandQueue& other) {
  executor.Add(&other);
  other.Hold(true);
  other.SetReady();
  executor.Notify();
  ASSERT_TRUE(other.WaitRuns(1));
}

TEST(ComputeExecutorTest, ARunGoesInlineOnlyWhileTheExecutorIsIdleAndNoOtherQueueIsReady) {
  ComputeExecutor executor(1);
  HandQueue mine, other;
  executor.Add(&mine);
  executor.Add(&other);
  WaitUntilParked(executor);  // its first look at the queues, as it starts, is over
  const std::thread::id here = std::this_thread::get_id();

  // Idle: the run happens here, before TryRunInline returns.
  mine.SetReady();
  ASSERT_TRUE(executor.TryRunInline(&mine));
  ASSERT_EQ(mine.threads().size(), 1u);
  EXPECT_EQ(mine.threads()[0], here);

  // Another model has a run ready: it goes first, on the compute thread. (That thread may still
  // be looking after the inline run and take it at once: held, it is then running, and nothing
  // goes inline beside it either.)
  other.Hold(true);
  other.SetReady();
  mine.SetReady();
  EXPECT_FALSE(executor.TryRunInline(&mine));
  other.Hold(false);
  executor.Notify();
  ASSERT_TRUE(other.WaitRuns(1));
  ASSERT_TRUE(mine.WaitRuns(2));
  EXPECT_NE(other.threads()[0], here);
  EXPECT_NE(mine.threads()[1], here);

  // While the compute thread runs, nothing runs inline beside it.
  other.Hold(true);
  other.SetReady();
  executor.Notify();
  ASSERT_TRUE(other.WaitRuns(2));
  EXPECT_FALSE(executor.TryRunInline(&mine));
  other.Hold(false);
  // (Until the compute thread is done with it: a queue of no model's, run inline once idle.)
  HandQueue probe;
  const auto until = std::chrono::steady_clock::now() + seconds(10);
  while (!executor.TryRunInline(&probe) && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(milliseconds(1));
  }
  ASSERT_EQ(probe.threads().size(), 1u);

  // What is queued during an inline run goes to the compute thread once it ends.
  mine.AtRun([&] {
    other.SetReady();
    executor.Notify();
  });
  mine.SetReady();
  ASSERT_TRUE(executor.TryRunInline(&mine));
  mine.AtRun(nullptr);
  ASSERT_TRUE(other.WaitRuns(3));
  EXPECT_NE(other.threads()[2], here);
  executor.Remove(&mine);
  executor.Remove(&other);
}

// A small call, alone on an idle executor, is computed and answered on the thread that submits
// it, before Submit returns; a larger call, or a small one while another run holds the compute
// thread, goes to the compute thread.
TEST(SchedulerTest, OnlyASmallCallOnAnIdleExecutorRunsOnItsCallersThread) {
  ComputeExecutor executor(1);
  CallReporter reporter;
  Scheduler scheduler("m", Options(4096, milliseconds(0)), &executor, &reporter);
  WaitUntilParked(executor);  // the compute thread's first look at the queues is over
  const std::thread::id caller = std::this_thread::get_id();

  FakeJob small({1}, 1, 1);
  Queue(scheduler, small);
  ASSERT_TRUE(small.Wait(milliseconds(0)).has_value()) << "a 1-token call was queued";
  EXPECT_TRUE(small.Wait()->ok());
  EXPECT_EQ(small.finished_on(), caller);
  EXPECT_EQ(small.output(), small.Alone());

  // 16 causal tokens of the demo layer, about 8e6 flops: computed on the compute thread (on
  // one thread too), where calls arriving meanwhile could join its run.
  FakeJob larger({16}, 16, 2);
  Queue(scheduler, larger);
  ASSERT_TRUE(larger.Wait().value_or(absl::UnknownError("")).ok());
  const std::thread::id compute = larger.finished_on();
  EXPECT_NE(compute, caller) << "a 16-token call ran on its caller's thread";

  // A small call while another model's run holds the compute thread waits for it there.
  HandQueue other;
  ASSERT_NO_FATAL_FAILURE(HoldComputeThread(executor, other));
  FakeJob beside({1}, 1, 3);
  Queue(scheduler, beside);
  EXPECT_FALSE(beside.Wait(milliseconds(100)).has_value()) << "it ran beside the other run";
  other.Hold(false);
  ASSERT_TRUE(beside.Wait().value_or(absl::UnknownError("")).ok());
  EXPECT_EQ(beside.finished_on(), compute);
  EXPECT_EQ(beside.output(), beside.Alone());
  executor.Remove(&other);
}

// A run on a caller's thread takes one small call, never more (they would merge on the compute
// thread), and never a larger one at the head of the queue.
TEST(SchedulerTest, ARunOnACallersThreadTakesOneSmallCallAtMost) {
  ComputeExecutor executor(1);
  CallReporter reporter;
  Scheduler scheduler("m", Options(4096, milliseconds(0)), &executor, &reporter);
  // Another model's run holds the compute thread: the calls stay queued for the test to run.
  HandQueue other;
  ASSERT_NO_FATAL_FAILURE(HoldComputeThread(executor, other));
  const std::thread::id caller = std::this_thread::get_id();
  FakeJob first({1}, 1, 1), second({1}, 1, 2), larger({16}, 16, 3);
  Queue(scheduler, first);
  Queue(scheduler, second);
  Queue(scheduler, larger);
  scheduler.RunNext(Clock::now(), /*on_caller=*/true);
  ASSERT_TRUE(first.Wait(milliseconds(0)).has_value()) << "the small call at the head stayed";
  EXPECT_EQ(first.finished_on(), caller);
  EXPECT_EQ(first.output(), first.Alone());
  EXPECT_FALSE(second.Wait(milliseconds(0)).has_value()) << "a second call joined the run";
  scheduler.RunNext(Clock::now(), /*on_caller=*/true);
  ASSERT_TRUE(second.Wait(milliseconds(0)).has_value());
  EXPECT_EQ(second.finished_on(), caller);
  scheduler.RunNext(Clock::now(), /*on_caller=*/true);
  EXPECT_FALSE(larger.Wait(milliseconds(0)).has_value()) << "a 16-token call ran on the caller";
  other.Hold(false);
  ASSERT_TRUE(larger.Wait().value_or(absl::UnknownError("")).ok());
  EXPECT_NE(larger.finished_on(), caller);
  executor.Remove(&other);
}

// A sequence's idle clock restarts when its request is answered (Touch), not only when it
// arrives (Find): a step that took longer than the idle timeout does not leave its sequence to
// be reaped as soon as it is answered. Two sequences held (a step in flight) past the timeout,
// one touched when answered: the other is reaped, the touched one lives on.
TEST(SequenceTableTest, TheIdleClockRestartsWhenARequestIsAnswered) {
  ComputeExecutor executor(1);
  DecodeQueue queue("m", 256, &executor, nullptr);
  SessionManager manager(SessionOptions{});
  SequenceTable table(std::chrono::seconds(1));
  for (const char* id : {"answered", "untouched"}) {
    absl::StatusOr<std::unique_ptr<Session>> opened =
        manager.Open(DemoVersion(), core::AttentionKind::kCausal, 1, nullptr, &queue, nullptr);
    ASSERT_TRUE(opened.ok()) << opened.status();
    table.Start(id, std::shared_ptr<Session>(*std::move(opened)));
  }
  absl::StatusOr<std::shared_ptr<Session>> answered = table.Find("m", "answered");
  absl::StatusOr<std::shared_ptr<Session>> untouched = table.Find("m", "untouched");
  ASSERT_TRUE(answered.ok() && untouched.ok());
  // Two steps that take longer than the timeout: their sessions are in use, never reaped.
  std::this_thread::sleep_for(std::chrono::milliseconds(1300));
  EXPECT_EQ(table.size(), 2u);
  table.Touch("m", "answered", answered->get());
  answered->reset();
  untouched->reset();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (table.size() > 1 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(table.Find("m", "untouched").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(table.Find("m", "answered").ok()) << "reaped although answered just now";
}

// A session idle past the timeout is gone for requests at once, not when the reaper next
// comes by (here never).
TEST(SequenceTableTest, ASequenceIdlePastTheTimeoutIsNotFoundBeforeTheReaperComes) {
  ComputeExecutor executor(1);
  DecodeQueue queue("m", 256, &executor, nullptr);
  SessionManager manager(SessionOptions{});
  SequenceTable table(std::chrono::milliseconds(100), /*reap_every=*/std::chrono::hours(1));
  for (const char* id : {"idle", "used"}) {
    absl::StatusOr<std::unique_ptr<Session>> opened =
        manager.Open(DemoVersion(), core::AttentionKind::kCausal, 1, nullptr, &queue, nullptr);
    ASSERT_TRUE(opened.ok()) << opened.status();
    table.Start(id, std::shared_ptr<Session>(*std::move(opened)));
  }
  absl::StatusOr<std::shared_ptr<Session>> used = table.Find("m", "used");  // a step in flight
  ASSERT_TRUE(used.ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  EXPECT_EQ(table.OnlyModelHolding("idle"), "");
  // A sequence_start asks whether the id is in use: it is not, and the idle session ends there,
  // its place under --max-sessions free for the new one.
  EXPECT_FALSE(table.Holds("m", "idle"));
  EXPECT_EQ(manager.open(), 1);
  EXPECT_EQ(table.Find("m", "idle").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(table.size(), 1u) << "the idle session was not ended when found idle";
  EXPECT_EQ(manager.open(), 1);
  // One a request holds is not idle, however long it has been.
  EXPECT_TRUE(table.Holds("m", "used"));
  EXPECT_TRUE(table.Find("m", "used").ok());
}

// Steps of three groups (two versions, two kinds) waiting at once take turns run by run: the
// third's one-token step waits for a chunk of each long prompt, not for either prompt to end.
TEST(DecodeQueueTest, EveryKindAndVersionWithStepsWaitingTakesItsTurn) {
  ComputeExecutor executor(1);
  DecodeQueue queue("m", 256, &executor, nullptr);
  SessionManager manager(SessionOptions{});
  const VersionHandle other = OtherDemoVersion();
  constexpr int64_t kPrompt = 4096;
  const std::vector<float> prompt = SmoothPrompt(kPrompt);
  const core::RaggedBatch context = EightTokenContext(prompt);
  struct Opened {
    char name;
    VersionHandle version;
    core::AttentionKind kind;
    int64_t tokens;
  };
  const Opened specs[] = {{'A', DemoVersion(), core::AttentionKind::kCausal, kPrompt},
                          {'B', other, core::AttentionKind::kCausal, kPrompt},
                          {'C', DemoVersion(), core::AttentionKind::kCausalCross, 1}};
  std::vector<std::unique_ptr<Session>> sessions;
  std::vector<std::vector<float>> outputs;
  for (const Opened& spec : specs) {
    absl::StatusOr<std::unique_ptr<Session>> opened = manager.Open(
        spec.version, spec.kind, 1,
        spec.kind == core::AttentionKind::kCausalCross ? &context : nullptr, &queue, nullptr);
    ASSERT_TRUE(opened.ok()) << opened.status();
    sessions.push_back(*std::move(opened));
    outputs.emplace_back(spec.tokens * kWidth);
  }
  std::mutex mu;
  std::condition_variable answered_cv;
  std::string answered;  // the sessions' names, in the order their steps were answered
  for (size_t i = 0; i < sessions.size(); ++i) {
    StepArgs args;
    args.inputs = {prompt.data()};
    args.tokens = {specs[i].tokens};
    args.outputs = {outputs[i].data()};
    const absl::Status taken =
        sessions[i]->Step(std::move(args), [&, name = specs[i].name](absl::Status status) {
          EXPECT_TRUE(status.ok()) << name << ": " << status;
          std::lock_guard lock(mu);
          answered += name;
          answered_cv.notify_all();
        });
    ASSERT_TRUE(taken.ok()) << taken;
  }
  std::unique_lock lock(mu);
  ASSERT_TRUE(answered_cv.wait_for(lock, seconds(120), [&] { return answered.size() == 3; }));
  EXPECT_EQ(answered[0], 'C') << "the steps were answered in the order " << answered;
}

// Two groups whose steps each come while the other's runs (a client's answer-to-next-step time
// shorter than a run) do not hold a third group's waiting prompt to the end of their steps: a
// group keeps its latest run while it has no step waiting, and the prompt's chunks go between
// theirs.
TEST(DecodeQueueTest, GroupsWhoseStepsComeBetweenRunsDoNotHoldAWaitingPrompt) {
  ComputeExecutor executor(1);
  DecodeQueue queue("m", 256, &executor, nullptr);
  SessionManager manager(SessionOptions{});
  const VersionHandle other = OtherDemoVersion();
  // Beside generating sessions a prompt runs in chunks of a few dozen tokens: about ten here.
  constexpr int64_t kPrompt = 256;
  constexpr int kChainSteps = 400;
  const std::vector<float> prompt = SmoothPrompt(kPrompt);
  const core::RaggedBatch context = EightTokenContext(prompt);
  auto open = [&](VersionHandle version, core::AttentionKind kind) {
    absl::StatusOr<std::unique_ptr<Session>> opened = manager.Open(
        std::move(version), kind, 1, kind == core::AttentionKind::kCausalCross ? &context : nullptr,
        &queue, nullptr);
    EXPECT_TRUE(opened.ok()) << opened.status();
    return opened.ok() ? *std::move(opened) : nullptr;
  };
  std::unique_ptr<Session> a = open(DemoVersion(), core::AttentionKind::kCausal);
  std::unique_ptr<Session> b = open(other, core::AttentionKind::kCausal);
  std::unique_ptr<Session> c = open(DemoVersion(), core::AttentionKind::kCausalCross);
  ASSERT_TRUE(a && b && c);
  std::vector<float> a_output(kPrompt * kWidth), chain_output(kWidth);
  std::mutex mu;
  std::condition_variable done_cv;
  int chain_steps = 0;            // guarded by mu
  int chain_steps_before_a = -1;  // guarded by mu: when the prompt was answered
  bool prompt_sent = false;       // guarded by mu
  // B's answer sends C's next step and C's answer B's, from the compute thread: at each choice
  // of a run, the group that just ran has no step waiting.
  std::function<void(Session*)> chain = [&](Session* next) {
    StepArgs args;
    args.inputs = {prompt.data()};
    args.tokens = {1};
    args.outputs = {chain_output.data()};
    const absl::Status taken = next->Step(std::move(args), [&, next](absl::Status status) {
      EXPECT_TRUE(status.ok()) << status;
      bool more;
      {
        std::unique_lock lock(mu);
        more = ++chain_steps < kChainSteps;
        done_cv.notify_all();
        // The prompt comes once the two groups are generating (alone, it would run whole at
        // once), and before their next step.
        if (chain_steps == 10) done_cv.wait(lock, [&] { return prompt_sent; });
      }
      if (more) chain(next == b.get() ? c.get() : b.get());
    });
    EXPECT_TRUE(taken.ok()) << taken;
  };
  chain(b.get());
  {
    std::unique_lock lock(mu);
    ASSERT_TRUE(done_cv.wait_for(lock, seconds(60), [&] { return chain_steps >= 10; }));
  }
  StepArgs args;
  args.inputs = {prompt.data()};
  args.tokens = {kPrompt};
  args.outputs = {a_output.data()};
  const absl::Status taken = a->Step(std::move(args), [&](absl::Status status) {
    EXPECT_TRUE(status.ok()) << status;
    std::lock_guard lock(mu);
    chain_steps_before_a = chain_steps;
    done_cv.notify_all();
  });
  std::unique_lock lock(mu);
  prompt_sent = true;  // the chain goes on, whatever the prompt's fate
  done_cv.notify_all();
  ASSERT_TRUE(taken.ok()) << taken;
  ASSERT_TRUE(done_cv.wait_for(
      lock, seconds(120), [&] { return chain_steps == kChainSteps && chain_steps_before_a >= 0; }));
  // A prompt that came more than a moment (kGeneratingWindow) after the chain's run ran whole,
  // in one run: nothing was tested.
  if (chain_steps_before_a == 10) GTEST_SKIP() << "the prompt ran whole: it came too late";
  EXPECT_LT(chain_steps_before_a, kChainSteps)
      << "the prompt waited for all " << kChainSteps << " steps of the other two groups";
}

// A causal cross session's context is projected run by run as far as its queries see it (and a
// few dozen rows past), not whole in its first run ahead of the other sessions' steps. Each
// sequence's rows are charged to the cache until the last of them is projected, then freed; every
// output still equals the same row of one Forward over the whole sequences.
TEST(DecodeQueueTest, ACausalCrossContextIsProjectedAsItsQueriesReachIt) {
  ComputeExecutor executor(1);
  DecodeQueue queue("m", 256, &executor, nullptr);
  SessionManager manager(SessionOptions{});
  // Two sequences: 700 tokens on a 600-token context, 150 on a 100-token one.
  const std::vector<int64_t> tokens = {700, 150}, context_tokens = {600, 100};
  const std::vector<float> prompt = SmoothPrompt(tokens[0]);
  std::vector<float> context_rows((context_tokens[0] + context_tokens[1]) * kWidth);
  for (size_t i = 0; i < context_rows.size(); ++i) context_rows[i] = std::cos(0.0007f * i);
  core::RaggedBatch context;
  context.data = context_rows.data();
  context.width = kWidth;
  context.lengths = context_tokens;
  absl::StatusOr<std::unique_ptr<Session>> session =
      manager.Open(DemoVersion(), core::AttentionKind::kCausalCross, 2, &context, &queue, nullptr);
  ASSERT_TRUE(session.ok()) << session.status();
  const int64_t opened_bytes = queue.kv_bytes().load();
  const auto rows_bytes = [](int64_t rows) {
    return rows * kWidth * static_cast<int64_t>(sizeof(float));
  };
  std::vector<std::vector<float>> output = {std::vector<float>(tokens[0] * kWidth),
                                            std::vector<float>(tokens[1] * kWidth)};
  std::vector<int64_t> position = {0, 0};
  auto step = [&](std::vector<int64_t> n) {
    std::promise<absl::Status> answer;
    StepArgs args;
    for (size_t b = 0; b < 2; ++b) {
      args.inputs.push_back(prompt.data() + position[b] * kWidth);
      args.outputs.push_back(output[b].data() + position[b] * kWidth);
      position[b] += n[b];
    }
    args.tokens = std::move(n);
    const absl::Status taken =
        (*session)->Step(std::move(args), [&](absl::Status status) { answer.set_value(status); });
    if (!taken.ok()) return taken;
    return answer.get_future().get();
  };
  // A token a sequence sees a context row each: the rest of both contexts is still rows.
  ASSERT_TRUE(step({1, 1}).ok());
  EXPECT_EQ(queue.kv_bytes().load(), opened_bytes);
  // The second sequence's queries reach past its context's end: its rows are freed, not the
  // first's.
  ASSERT_TRUE(step({0, tokens[1] - 1}).ok());
  EXPECT_EQ(queue.kv_bytes().load(), opened_bytes - rows_bytes(context_tokens[1]));
  // Then the first's.
  ASSERT_TRUE(step({tokens[0] - 1, 0}).ok());
  EXPECT_EQ(queue.kv_bytes().load(),
            opened_bytes - rows_bytes(context_tokens[0] + context_tokens[1]));
  core::ForwardArgs whole;
  whole.kind = core::AttentionKind::kCausalCross;
  std::vector<float> inputs(prompt);
  inputs.insert(inputs.end(), prompt.begin(), prompt.begin() + tokens[1] * kWidth);
  whole.input.data = inputs.data();
  whole.input.width = kWidth;
  whole.input.lengths = tokens;
  whole.context = context;
  std::vector<float> expected(DemoLayer()->Shapes(whole).output_size());
  ASSERT_TRUE(DemoLayer()->Forward(whole, expected).ok());
  for (size_t b = 0, row = 0; b < 2; ++b) {
    for (int64_t t = 0; t < tokens[b]; ++t, ++row) {
      for (int64_t k = 0; k < kWidth; ++k) {
        ASSERT_NEAR(output[b][t * kWidth + k], expected[row * kWidth + k], 1e-4f)
            << "sequence " << b << " position " << t;
      }
    }
  }
  session->reset();
  EXPECT_EQ(queue.kv_bytes().load(), 0);
}

// Two causal sessions, A and B, on one queue, each step a whole prompt too long to run inline on
// the caller's thread; A's step can hold the compute thread in its answer, so that what B
// submits meanwhile stays queued.
struct TwoPromptSessions {
  static constexpr int64_t kPrompt = 600;

  StepArgs Args(std::vector<float>& output) const {
    StepArgs step;
    step.inputs = {prompt.data()};
    step.tokens = {kPrompt};
    step.outputs = {output.data()};
    return step;
  }
  // Steps A; returns once A's answer holds the compute thread, which it does until `release`.
  void StepAHeld(std::shared_future<void> release) {
    auto answering = std::make_shared<std::promise<void>>();
    std::future<void> answering_now = answering->get_future();
    ASSERT_TRUE(a->Step(Args(a_output), [answering, release](absl::Status status) {
                   EXPECT_TRUE(status.ok()) << status;
                   answering->set_value();
                   release.wait();
                 }).ok());
    answering_now.wait();
  }

  ComputeExecutor executor{1};
  DecodeQueue queue{"m", 256, &executor, nullptr};
  SessionManager manager{SessionOptions{}};
  const std::vector<float> prompt = SmoothPrompt(kPrompt);
  std::vector<float> a_output = std::vector<float>(kPrompt * kWidth);
  std::vector<float> b_output = std::vector<float>(kPrompt * kWidth);
  std::unique_ptr<Session> a = OpenCausal(manager, queue);
  std::unique_ptr<Session> b = OpenCausal(manager, queue);
};

// A step taken back before it runs (its stream ended) gives back the cache room it reserved, and
// leaves the session as it was.
TEST(DecodeQueueTest, AStepTakenBackBeforeItRunsGivesBackItsCacheRoom) {
  TwoPromptSessions t;
  ASSERT_TRUE(t.a && t.b);
  std::promise<void> release;
  t.StepAHeld(release.get_future().share());
  const int64_t before = t.queue.kv_bytes().load();
  std::promise<absl::Status> b_answer;
  ASSERT_TRUE(
      t.b->Step(t.Args(t.b_output), [&](absl::Status status) { b_answer.set_value(status); }).ok());
  EXPECT_GT(t.queue.kv_bytes().load(), before) << "the step reserved no cache room";
  t.b->CancelStep(absl::CancelledError("the stream ended"));
  std::future<absl::Status> answered = b_answer.get_future();
  ASSERT_EQ(answered.wait_for(seconds(5)), std::future_status::ready);
  EXPECT_EQ(answered.get().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(t.queue.kv_bytes().load(), before) << "the step taken back kept its cache room";
  EXPECT_EQ(t.b->positions(), std::vector<int64_t>{0});
  release.set_value();
  // The session goes on as if the step had never come.
  std::promise<absl::Status> again;
  ASSERT_TRUE(
      t.b->Step(t.Args(t.b_output), [&](absl::Status status) { again.set_value(status); }).ok());
  EXPECT_TRUE(again.get_future().get().ok());
  EXPECT_EQ(t.b->positions(), std::vector<int64_t>{TwoPromptSessions::kPrompt});
}

// One step of `tokens` tokens of a one-sequence session, its answer set in `answer`.
absl::Status Submit(Session& session, const float* input, int64_t tokens, float* output,
                    std::promise<absl::Status>& answer) {
  StepArgs args;
  args.inputs = {input};
  args.tokens = {tokens};
  args.outputs = {output};
  return session.Step(std::move(args),
                      [&answer](absl::Status status) { answer.set_value(status); });
}

// One step of a session, answered before this returns (waits up to 10 s).
absl::Status StepAndWait(Session& session, const float* input, int64_t tokens, float* output) {
  std::promise<absl::Status> answer;
  std::future<absl::Status> answered = answer.get_future();
  if (absl::Status s = Submit(session, input, tokens, output, answer); !s.ok()) return s;
  if (answered.wait_for(seconds(10)) != std::future_status::ready) {
    return absl::DeadlineExceededError("the step was not answered in 10 s");
  }
  return answered.get();
}

// Steps queued together run as one: one whose output overflows float32 is refused alone, and its
// session goes back to where the step began; the other step is answered and kept, and the
// refused session goes on as if the step had never come.
TEST(DecodeQueueTest, AStepRefusedInAMergedRunLeavesTheOtherStepsAnswered) {
  TwoPromptSessions t;
  std::unique_ptr<Session> c = OpenCausal(t.manager, t.queue);
  ASSERT_TRUE(t.a && t.b && c);
  const std::vector<float> tokens = SmoothPrompt(3);
  std::vector<float> b_rows(3 * kWidth), c_rows(3 * kWidth);
  ASSERT_TRUE(StepAndWait(*t.b, tokens.data(), 2, b_rows.data()).ok());

  // B's huge token and C's first one queue behind A's answer, which holds the compute thread.
  std::promise<void> release;
  t.StepAHeld(release.get_future().share());
  const std::vector<float> huge(kWidth, 1e20f);
  std::vector<float> huge_out(kWidth);
  std::promise<absl::Status> b_answer, c_answer;
  ASSERT_TRUE(Submit(*t.b, huge.data(), 1, huge_out.data(), b_answer).ok());
  ASSERT_TRUE(Submit(*c, tokens.data(), 1, c_rows.data(), c_answer).ok());
  release.set_value();
  const absl::Status b_status = b_answer.get_future().get();
  EXPECT_EQ(b_status.code(), absl::StatusCode::kInvalidArgument) << b_status;
  EXPECT_NE(b_status.message().find("not finite"), std::string::npos) << b_status;
  EXPECT_EQ(t.b->positions(), std::vector<int64_t>{2});
  const absl::Status c_status = c_answer.get_future().get();
  EXPECT_TRUE(c_status.ok()) << c_status;
  EXPECT_EQ(c->positions(), std::vector<int64_t>{1});

  // B's next token sees B's first two and not the refused one: its row is C's third row when C
  // has stepped the same three tokens.
  ASSERT_TRUE(StepAndWait(*t.b, tokens.data() + 2 * kWidth, 1, b_rows.data() + 2 * kWidth).ok());
  ASSERT_TRUE(StepAndWait(*c, tokens.data() + kWidth, 2, c_rows.data() + kWidth).ok());
  EXPECT_EQ(t.b->positions(), std::vector<int64_t>{3});
  for (int64_t k = 0; k < kWidth; ++k) {
    ASSERT_NEAR(b_rows[2 * kWidth + k], c_rows[2 * kWidth + k], 1e-5f) << "element " << k;
  }
}

// A long prompt's step taken back while its chunks run (its stream ended) leaves the session as
// it was: the chunks it ran are taken back too, with their cache room. Taken back at several
// moments, to catch it between chunks.
TEST(DecodeQueueTest, AStepTakenBackWhileItRunsLeavesTheSessionAsItWas) {
  ComputeExecutor executor(1);
  DecodeQueue queue("m", 256, &executor, nullptr);
  SessionManager manager(SessionOptions{});
  constexpr int64_t kPrompt = 4096;  // 16 chunks of 256
  const std::vector<float> prompt = SmoothPrompt(kPrompt);
  std::vector<float> output(kPrompt * kWidth);
  std::unique_ptr<Session> session = OpenCausal(manager, queue);
  ASSERT_TRUE(session);
  ASSERT_TRUE(StepAndWait(*session, prompt.data(), 8, output.data()).ok());
  const int64_t before = queue.kv_bytes().load();
  int taken_back = 0;
  for (const int delay_ms : {0, 1, 3, 10, 30}) {
    std::promise<absl::Status> answer;
    ASSERT_TRUE(Submit(*session, prompt.data(), kPrompt, output.data(), answer).ok());
    std::this_thread::sleep_for(milliseconds(delay_ms));
    session->CancelStep(absl::CancelledError("the stream ended"));
    const absl::Status status = answer.get_future().get();
    if (status.ok()) break;  // it ran to its end first (so would it with a longer delay)
    ++taken_back;
    EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
    EXPECT_EQ(session->positions(), std::vector<int64_t>{8})
        << "taken back after " << delay_ms << " ms";
    EXPECT_EQ(queue.kv_bytes().load(), before) << "taken back after " << delay_ms << " ms";
  }
}
// A drain's Join returns only once every step is answered: the run's (an answer still being
// written) and those dropped past the grace. (The transport shuts down next: an answer not
// written by then would be cut.)
TEST(DecodeQueueTest, JoinWaitsForEveryAnswerItsRunsAndItsDrainGive) {
  TwoPromptSessions t;
  ASSERT_TRUE(t.a && t.b);
  auto join = [&] { return std::async(std::launch::async, [&] { t.queue.Join(); }); };

  // Nothing else queued: the join still waits for A's answer.
  std::promise<void> release_first;
  t.StepAHeld(release_first.get_future().share());
  std::future<void> first = join();
  EXPECT_EQ(first.wait_for(milliseconds(200)), std::future_status::timeout)
      << "the join returned while a step's answer was still being given";
  release_first.set_value();
  ASSERT_EQ(first.wait_for(seconds(10)), std::future_status::ready);

  // B's step, queued behind A's answer, is dropped by a drain without grace: the join waits for
  // its (slow) answer too.
  std::promise<void> release_second;
  t.StepAHeld(release_second.get_future().share());
  std::atomic<bool> b_answered = false;
  ASSERT_TRUE(t.b->Step(t.Args(t.b_output),
                        [&](absl::Status status) {
                          EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
                          std::this_thread::sleep_for(milliseconds(300));  // a slow write
                          b_answered = true;
                        })
                  .ok());
  t.queue.Close(Clock::now());
  std::future<void> second = join();
  release_second.set_value();
  ASSERT_EQ(second.wait_for(seconds(10)), std::future_status::ready);
  EXPECT_TRUE(b_answered) << "the join returned before the dropped step's answer";
}

// A step small enough for one thread runs on its caller's thread when the executor is idle (two
// thread hand-offs would cost more than it); a larger one, or one while the executor is busy,
// runs on the compute thread.
TEST(DecodeQueueTest, OnlyASmallStepOnAnIdleExecutorRunsOnItsCallersThread) {
  ComputeExecutor executor(1);
  DecodeQueue queue("m", 256, &executor, nullptr);
  SessionManager manager(SessionOptions{});
  const std::vector<float> prompt = SmoothPrompt(100);
  std::vector<float> output(100 * kWidth);
  std::unique_ptr<Session> a = OpenCausal(manager, queue), b = OpenCausal(manager, queue);
  ASSERT_TRUE(a && b);
  // The thread that answered a step of `tokens` tokens of `session`; `hold`: the answer waits
  // for it (holding that thread).
  auto step = [&](Session& session, int64_t tokens, std::promise<std::thread::id>& answered,
                  std::shared_future<void> hold = {}) {
    StepArgs args;
    args.inputs = {prompt.data()};
    args.tokens = {tokens};
    args.outputs = {output.data()};
    ASSERT_TRUE(session
                    .Step(std::move(args),
                          [&answered, hold](absl::Status status) {
                            EXPECT_TRUE(status.ok()) << status;
                            answered.set_value(std::this_thread::get_id());
                            if (hold.valid()) hold.wait();
                          })
                    .ok());
  };
  const std::thread::id caller = std::this_thread::get_id();
  WaitUntilParked(executor);  // the compute thread's first look at the queues is over
  std::promise<std::thread::id> small, large, beside_busy;
  step(*a, 1, small);
  EXPECT_EQ(small.get_future().get(), caller) << "a one-token step on an idle executor was queued";
  // 100 tokens at once: about 6e7 flops, past what one thread runs.
  step(*a, 100, large);
  const std::thread::id compute = large.get_future().get();
  EXPECT_NE(compute, caller) << "a 100-token step ran on its caller's thread";
  // A one-token step of B while A's answer holds the compute thread waits for it there.
  std::promise<void> release_busy;
  std::promise<std::thread::id> busy;
  step(*a, 100, busy, release_busy.get_future().share());
  EXPECT_EQ(busy.get_future().get(), compute);
  step(*b, 1, beside_busy);
  std::future<std::thread::id> beside = beside_busy.get_future();
  EXPECT_EQ(beside.wait_for(milliseconds(200)), std::future_status::timeout)
      << "a step ran inline while the compute thread was busy";
  release_busy.set_value();
  EXPECT_EQ(beside.get(), compute);
}

// A run on a caller's thread takes only the steps one thread computes: a prompt queued beside a
// one-token step is left to the compute thread, not chunked on the caller's.
TEST(DecodeQueueTest, ARunOnACallersThreadLeavesAPromptToTheComputeThread) {
  ComputeExecutor executor(1);
  DecodeQueue queue("m", 256, &executor, nullptr);
  SessionManager manager(SessionOptions{});
  const std::vector<float> prompt = SmoothPrompt(100);
  std::vector<float> prompt_output(100 * kWidth), step_output(kWidth);
  std::unique_ptr<Session> a = OpenCausal(manager, queue), b = OpenCausal(manager, queue);
  ASSERT_TRUE(a && b);
  // Another model's run holds the compute thread: the steps stay queued for the test to run.
  HandQueue other;
  ASSERT_NO_FATAL_FAILURE(HoldComputeThread(executor, other));
  auto step = [&](Session& session, int64_t tokens, float* output,
                  std::promise<std::thread::id>& answered) {
    StepArgs args;
    args.inputs = {prompt.data()};
    args.tokens = {tokens};
    args.outputs = {output};
    ASSERT_TRUE(session
                    .Step(std::move(args),
                          [&answered](absl::Status status) {
                            EXPECT_TRUE(status.ok()) << status;
                            answered.set_value(std::this_thread::get_id());
                          })
                    .ok());
  };
  std::promise<std::thread::id> prompt_answered, step_answered;
  step(*a, 100, prompt_output.data(), prompt_answered);  // about 6e7 flops
  step(*b, 1, step_output.data(), step_answered);
  queue.RunNext(Clock::now(), /*on_caller=*/true);
  std::future<std::thread::id> stepped = step_answered.get_future();
  ASSERT_EQ(stepped.wait_for(milliseconds(0)), std::future_status::ready);
  EXPECT_EQ(stepped.get(), std::this_thread::get_id());
  EXPECT_EQ(a->positions(), std::vector<int64_t>{0}) << "a chunk of the prompt ran on the caller";
  other.Hold(false);
  EXPECT_NE(prompt_answered.get_future().get(), std::this_thread::get_id());
  EXPECT_EQ(a->positions(), std::vector<int64_t>{100});
  executor.Remove(&other);
}

// At --max-sessions, a restart (sequence_start on an id in use) may open one session more while
// the session it ends finishes; a second restart meanwhile is refused, and the refusal names the
// flag's value, not the count with the restart's.
TEST(SessionManagerTest, OneRestartMayGoOneSessionPastTheLimit) {
  ComputeExecutor executor(1);
  DecodeQueue queue("m", 256, &executor, nullptr);
  SessionOptions options;
  options.max_sessions = 1;
  SessionManager manager(options);
  auto open = [&](bool restart) {
    return manager.Open(DemoVersion(), core::AttentionKind::kCausal, 1, nullptr, &queue, nullptr,
                        restart);
  };
  absl::StatusOr<std::unique_ptr<Session>> first = open(false);
  ASSERT_TRUE(first.ok()) << first.status();
  const absl::Status full = open(false).status();
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.message().find("all 1 sessions --max-sessions allows are open;"),
            std::string::npos)
      << full;
  absl::StatusOr<std::unique_ptr<Session>> restarted = open(true);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  const absl::Status again = open(true).status();
  EXPECT_EQ(again.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(again.message().find("all 1 sessions --max-sessions allows are open, and another "
                                 "restart holds the one more"),
            std::string::npos)
      << again;
}

// A causal model whose heads are too wide for the cache's attention serves calls but no
// sessions: ListModels says so (its summary), and a session is refused when it opens, not at
// every step after.
TEST(SessionManagerTest, HeadsWiderThanSessionsServeAreRefusedWhenTheSessionOpens) {
  ComputeExecutor executor(1);
  DecodeQueue queue("m", 256, &executor, nullptr);
  SessionManager manager(SessionOptions{});
  for (const int64_t head_dim : {core::kMaxDecodeHeadDim, core::kMaxDecodeHeadDim + 1}) {
    core::LayerWeights weights;
    weights.spec = {.d_model = 4,
                    .d_context = 4,
                    .num_heads = 1,
                    .head_dim = head_dim,
                    .has_bias = false,
                    .has_output_projection = true,
                    .layout = core::WeightLayout::kBuiltIn};
    weights.w_q.assign(head_dim * 4, 0.01f);
    weights.w_k = weights.w_v = weights.w_q;
    weights.w_o.assign(4 * head_dim, 0.01f);
    absl::StatusOr<std::shared_ptr<const core::Layer>> layer =
        core::Layer::Create(std::move(weights));
    ASSERT_TRUE(layer.ok()) << layer.status();
    const bool serves = head_dim <= core::kMaxDecodeHeadDim;
    EXPECT_EQ(Summarize("m", "test", **layer).serves_sessions, serves) << head_dim;
    VersionHandle version = std::make_shared<ModelVersion>(
        ModelVersion{.name = "m", .version = 1, .source = "test", .layer = *layer, .summary = {}});
    absl::StatusOr<std::unique_ptr<Session>> opened =
        manager.Open(version, core::AttentionKind::kCausal, 1, nullptr, &queue, nullptr);
    if (serves) {
      EXPECT_TRUE(opened.ok()) << opened.status();
    } else {
      EXPECT_EQ(opened.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(opened.status().message().find("4096"), std::string::npos) << opened.status();
    }
  }
}

}  // namespace
}  // namespace attnserve::server::testing
