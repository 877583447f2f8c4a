#include "server/serving/scheduler.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/observability/logging.h"
#include "server/serving/compute_executor.h"

namespace attnserve::server {
namespace {

// A call this small may run on the thread that queued it while the executor is idle: its
// compute costs little more than the hand-off to the compute thread and back that it saves, and
// holds that thread only briefly. Not one that returns its attention probabilities, whose reply
// (every padded row) may be far larger than its compute. Larger calls go to the compute thread,
// where calls arriving meanwhile can join their run.
bool SmallEnoughToRunInline(const Job& job) {
  return !job.args().return_attention && job.version().layer->Flops(job.args()) < kInlineCallFlops;
}

int64_t Tokens(const core::ForwardArgs& args) {
  return args.input.total_length() + (args.context ? args.context->total_length() : 0);
}

// Whether `job` may share a merged run with `head`: same version (one layer per run), same kind.
bool Mergeable(const Job& head_job, const Job& other) {
  const core::ForwardArgs& head = head_job.args();
  const core::ForwardArgs& job = other.args();
  return &head_job.version() == &other.version() && !job.return_attention &&
         job.kind == head.kind && job.context.has_value() == head.context.has_value();
}

// Appends each sequence of `batch` to `merged` (packed, segmented): the rows stay where they are.
void AppendSequences(const core::RaggedBatch& batch, core::RaggedBatch* merged) {
  const std::vector<int64_t> offsets = batch.row_offsets();
  for (int64_t b = 0; b < batch.batch(); ++b) {
    merged->sequence_data.push_back(batch.data + offsets[b] * batch.width);
    merged->lengths.push_back(batch.lengths[b]);
  }
}

// A call that compute could not even start for (out of memory making its buffers).
absl::Status ComputeFailed(const std::exception& e) {
  if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr) {
    return absl::ResourceExhaustedError("out of memory for the call's buffers");
  }
  return absl::InternalError(absl::StrCat("compute failed: ", e.what()));
}

// How long CoDel watches the calls starting runs before it judges the queue (its interval).
constexpr std::chrono::milliseconds kQueueDelayInterval(100);

// Whole milliseconds, for messages.
int64_t Ms(double seconds) { return static_cast<int64_t>(seconds * 1000 + 0.5); }

double SecondsBetween(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

}  // namespace

void Job::CallerGone() {
  gone_.store(true);
  if (Scheduler* queue = queue_.load()) queue->Cancel(this);
}

absl::Status Job::CheckAlive(Clock::time_point now) const {
  // The deadline first: once it passes gRPC also cancels the call, and the caller wants to hear
  // which of the two happened.
  if (deadline_ <= now) return absl::DeadlineExceededError("the deadline passed while queued");
  if (gone_.load()) return absl::CancelledError("the caller cancelled the call");
  return absl::OkStatus();
}

Scheduler::Scheduler(std::string model_name, SchedulerOptions options, ComputeExecutor* executor,
                     CallReporter* reporter)
    : model_name_(std::move(model_name)),
      options_(options),
      executor_(executor),
      reporter_(reporter),
      metrics_(reporter->metrics().AddModel(model_name_)) {
  executor_->Add(this);
}

Scheduler::~Scheduler() {
  Drain();
  executor_->Remove(this);
}

absl::Status Scheduler::Reserve(Clock::time_point deadline) {
  std::lock_guard lock(mu_);
  if (absl::Status s = PlaceLocked(); !s.ok()) return s;
  if (deadline != Clock::time_point::max()) {
    const Clock::time_point now = Clock::now();
    const double wait = WaitLocked(now);
    if (MissesLocked(now, deadline, 0)) {
      metrics_.Shed(ShedReason::kDeadline);
      return absl::DeadlineExceededError(
          absl::StrCat("refused at once: model '", model_name_, "' has about ", Ms(wait),
                       " ms of work ahead of the call, and its deadline is ",
                       Ms(std::max(0.0, SecondsBetween(now, deadline))), " ms away"));
    }
    if (overloaded_ && wait > std::chrono::duration<double>(options_.queue_delay_target).count()) {
      metrics_.Shed(ShedReason::kQueueDelay);
      return absl::ResourceExhaustedError(absl::StrCat(
          "model '", model_name_, "' is overloaded: about ", Ms(wait),
          " ms of work is queued, over its target delay of ", options_.queue_delay_target.count(),
          " ms (--queue-delay-target-ms); retry later or on another replica"));
    }
  }
  ++reserved_;
  return absl::OkStatus();
}

double Scheduler::WaitLocked(Clock::time_point now) const {
  double wait = computing_ ? std::max(0.0, SecondsBetween(now, run_end_)) : 0.0;
  if (!queue_.empty()) {
    const int64_t runs =
        options_.max_batch_tokens > 0
            ? (queued_tokens_ + options_.max_batch_tokens - 1) / options_.max_batch_tokens
            : static_cast<int64_t>(queue_.size());
    wait += cost_.Estimate(queued_tokens_, runs);
  }
  return wait;
}

bool Scheduler::MissesLocked(Clock::time_point now, Clock::time_point deadline,
                             int64_t tokens) const {
  if (deadline == Clock::time_point::max()) return false;
  if (deadline <= now) return true;
  if (!cost_.known()) return false;
  const double needed = WaitLocked(now) + (tokens > 0 ? cost_.Estimate(tokens) : 0.0);
  return needed > SecondsBetween(now, deadline);
}

void Scheduler::TrackQueueDelayLocked(Clock::time_point now, double waited_seconds) {
  if (options_.queue_delay_target.count() == 0) return;
  if (now >= interval_end_) {
    // The interval is over: overloaded when even its least-waiting call waited past the target
    // (a standing queue, not a burst that drains).
    overloaded_ =
        interval_end_ != Clock::time_point() &&
        min_wait_seconds_ > std::chrono::duration<double>(options_.queue_delay_target).count();
    interval_end_ = now + kQueueDelayInterval;
    min_wait_seconds_ = waited_seconds;
    return;
  }
  min_wait_seconds_ = std::min(min_wait_seconds_, waited_seconds);
}

absl::Status Scheduler::PlaceLocked() {
  if (closed_) return absl::UnavailableError("the server is shutting down");
  const int held = static_cast<int>(queue_.size()) + reserved_ + waiting_steps_;
  if (held >= options_.max_queue) {
    metrics_.Shed(ShedReason::kQueueFull);
    return absl::ResourceExhaustedError(
        absl::StrCat("model '", model_name_, "' has ", held, " calls queued (--max-queue)"));
  }
  return absl::OkStatus();
}

absl::Status Scheduler::ReserveWaitingStep() {
  std::lock_guard lock(mu_);
  if (absl::Status s = PlaceLocked(); !s.ok()) return s;
  metrics_.SetSequenceRequestsWaiting(++waiting_steps_);
  return absl::OkStatus();
}

void Scheduler::ReleaseWaitingStep() {
  std::lock_guard lock(mu_);
  metrics_.SetSequenceRequestsWaiting(--waiting_steps_);
}

void Scheduler::Release() {
  std::lock_guard lock(mu_);
  --reserved_;
  if (reserved_ == 0 && queue_.empty() && running_ == 0) idle_cv_.notify_all();
}

absl::Status Scheduler::Submit(Job* job) {
  // A small call, alone and due at once, runs on this thread when the executor is idle.
  // (Decided before it is queued: once queued, it may be answered, and gone, at any time.)
  const bool small = SmallEnoughToRunInline(*job);
  bool alone, gone;
  {
    std::lock_guard lock(mu_);
    const int64_t tokens = Tokens(job->args());
    const Clock::time_point now = Clock::now();
    if (MissesLocked(now, job->deadline(), tokens)) {
      metrics_.Shed(ShedReason::kDeadline);
      return absl::DeadlineExceededError(absl::StrCat(
          "refused at once: model '", model_name_, "' would end the call's run in about ",
          Ms(WaitLocked(now) + cost_.Estimate(tokens)), " ms, after its deadline (",
          Ms(std::max(0.0, SecondsBetween(now, job->deadline()))), " ms away)"));
    }
    queue_.push_back({job, tokens, small});
    --reserved_;
    queued_tokens_ += tokens;
    job->queue_.store(this);
    // The caller may have left between admission and now: CallerGone saw no queue then.
    gone = job->gone_.load();
    metrics_.SetQueueDepth(static_cast<int>(queue_.size()));
    alone = queue_.size() == 1 && running_ == 0 && RunStartLocked(now) <= now;
  }
  Dispatch(job, gone, alone && small);
  return absl::OkStatus();
}

void Scheduler::Dispatch(Job* job, bool gone, bool run_inline) noexcept {
  try {
    Log(LogLevel::kTrace, "forward queued", {{"model", model_name_}});
  } catch (const std::exception&) {
    // A trace line lost to memory running out: no reason to end the process.
  }
  if (gone) Cancel(job);
  if (!(run_inline && executor_->TryRunInline(this))) executor_->Notify();
}

void Scheduler::Cancel(Job* job) {
  {
    std::lock_guard lock(mu_);
    auto it = std::find_if(queue_.begin(), queue_.end(),
                           [job](const Queued& queued) { return queued.job == job; });
    if (it == queue_.end()) return;  // running or answered: nothing to take back
    queued_tokens_ -= it->tokens;
    queue_.erase(it);
    metrics_.SetQueueDepth(static_cast<int>(queue_.size()));
    ++running_;  // until answered, so Join cannot return before the answer is sent
  }
  absl::Status why = job->CheckAlive();
  if (why.ok()) why = absl::CancelledError("the caller cancelled the call");
  if (absl::IsDeadlineExceeded(why)) metrics_.Shed(ShedReason::kExpired);
  Answer(job, why);
  Finished(1);
}

void Scheduler::Close(Clock::time_point deadline) {
  {
    std::lock_guard lock(mu_);
    closed_ = true;
    drain_deadline_ = std::min(drain_deadline_, deadline);
  }
  executor_->Notify();
}

void Scheduler::SetMaxQueue(int max_queue) {
  std::lock_guard lock(mu_);
  options_.max_queue = max_queue;
}

void Scheduler::Join() {
  std::unique_lock lock(mu_);
  idle_cv_.wait(lock, [this] { return queue_.empty() && running_ == 0 && reserved_ == 0; });
}

int Scheduler::pending() const {
  std::lock_guard lock(mu_);
  return static_cast<int>(queue_.size()) + running_ + reserved_;
}

Clock::time_point Scheduler::ReadyAt(Clock::time_point now) const {
  std::lock_guard lock(mu_);
  if (queue_.empty()) return Clock::time_point::max();
  // A queued call must leave as soon as its run could no longer end before its deadline, even
  // inside a delay window: it is answered then, not when its turn comes.
  Clock::time_point latest_start = Clock::time_point::max();
  for (const Queued& queued : queue_) {
    const Clock::time_point deadline = queued.job->deadline();
    if (deadline == Clock::time_point::max()) continue;
    const auto run = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(cost_.Estimate(queued.tokens)));
    latest_start = std::min(latest_start, deadline - run);
  }
  return std::min(RunStartLocked(now), latest_start);
}

Clock::time_point Scheduler::RunStartLocked(Clock::time_point now) const {
  const Job& head = *queue_.front().job;
  if (closed_ || options_.max_queue_delay.count() == 0 || options_.max_batch_tokens <= 0 ||
      head.args().return_attention || queued_tokens_ >= options_.max_batch_tokens) {
    return now;
  }
  return head.arrival() + options_.max_queue_delay;
}

void Scheduler::RunNext(Clock::time_point now, bool on_caller) noexcept {
  std::vector<Dropped> dropped;
  std::vector<Job*> jobs;
  {
    std::lock_guard lock(mu_);
    jobs = TakeLocked(now, on_caller, &dropped);
    // Every call taken counts as running until answered, so Join waits for its answer.
    running_ += static_cast<int>(jobs.size() + dropped.size());
    metrics_.SetQueueDepth(static_cast<int>(queue_.size()));
    if (!jobs.empty()) TrackQueueDelayLocked(now, SecondsBetween(jobs.front()->arrival(), now));
    if (queue_.empty()) overloaded_ = false;  // nothing stands in the queue
  }
  for (Dropped& drop : dropped) Answer(drop.job, drop.status);
  if (!jobs.empty()) Run(jobs);
  Finished(static_cast<int>(jobs.size() + dropped.size()));
}

std::vector<Job*> Scheduler::TakeLocked(Clock::time_point now, bool small_only,
                                        std::vector<Dropped>* dropped) {
  // Calls whose caller left, whose deadline passed (which OnCancel may not have said yet) or
  // would pass before their run could end, and after the drain's grace every call, leave
  // without compute. The grace is judged on the clock read here, under the lock: `now` was read
  // before, and may predate a Close whose deadline is already past.
  const bool grace_over = closed_ && Clock::now() >= drain_deadline_;
  for (auto it = queue_.begin(); it != queue_.end();) {
    Job* job = it->job;
    absl::Status why = job->CheckAlive(now);
    if (grace_over) {
      why = absl::UnavailableError("the server shut down before the call could run");
    } else if (absl::IsDeadlineExceeded(why)) {
      metrics_.Shed(ShedReason::kExpired);
    } else if (why.ok() && cost_.known() && job->deadline() != Clock::time_point::max() &&
               cost_.Estimate(it->tokens) > SecondsBetween(now, job->deadline())) {
      metrics_.Shed(ShedReason::kDeadline);
      why = absl::DeadlineExceededError(absl::StrCat(
          "answered without compute: its run would take about ", Ms(cost_.Estimate(it->tokens)),
          " ms and its deadline is ", Ms(SecondsBetween(now, job->deadline())), " ms away"));
    }
    if (why.ok()) {
      ++it;
      continue;
    }
    dropped->push_back({job, std::move(why)});
    queued_tokens_ -= it->tokens;
    it = queue_.erase(it);
  }
  std::vector<Job*> jobs;
  if (queue_.empty() || RunStartLocked(now) > now) return jobs;  // only dropped calls were due
  if (small_only && !queue_.front().small) return jobs;
  Job* head = queue_.front().job;
  jobs.push_back(head);
  int64_t tokens = queue_.front().tokens;
  queued_tokens_ -= tokens;
  queue_.pop_front();
  if (small_only || options_.max_batch_tokens <= 0 || head->args().return_attention) return jobs;
  for (auto it = queue_.begin(); it != queue_.end();) {
    // A call joins only if the larger run still ends before its deadline and the others'.
    const bool fits = Mergeable(*jobs.front(), *it->job) &&
                      tokens + it->tokens <= options_.max_batch_tokens &&
                      !RunMissesLocked(now, jobs, it->job, tokens + it->tokens);
    if (fits) {
      tokens += it->tokens;
      queued_tokens_ -= it->tokens;
      jobs.push_back(it->job);
      it = queue_.erase(it);
    } else {
      ++it;
    }
  }
  return jobs;
}

bool Scheduler::RunMissesLocked(Clock::time_point now, const std::vector<Job*>& jobs,
                                const Job* joining, int64_t tokens) const {
  if (!cost_.known()) return false;
  const Clock::time_point end = now + std::chrono::duration_cast<Clock::duration>(
                                          std::chrono::duration<double>(cost_.Estimate(tokens)));
  if (joining->deadline() < end) return true;
  return std::any_of(jobs.begin(), jobs.end(),
                     [end](const Job* job) { return job->deadline() < end; });
}

void Scheduler::Run(const std::vector<Job*>& jobs) {
  RunInfo run;
  run.batch_calls = static_cast<int>(jobs.size());
  for (Job* job : jobs) run.batch_tokens += Tokens(job->args());
  {
    std::lock_guard lock(mu_);
    computing_ = true;
    run_end_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                  std::chrono::duration<double>(cost_.Estimate(run.batch_tokens)));
  }
  if (jobs.size() == 1) {
    RunOne(jobs.front(), run);
  } else {
    RunMerged(jobs, run);
  }
}

void Scheduler::RunDone(const std::vector<Job*>& jobs, const RunInfo& run) {
  metrics_.ComputeRun(run.batch_calls, run.batch_tokens, run.compute_seconds);
  const Clock::time_point now = Clock::now();
  double late_tokens = 0;
  for (const Job* job : jobs) {
    if (job->deadline() < now) late_tokens += static_cast<double>(Tokens(job->args()));
  }
  if (late_tokens > 0 && run.batch_tokens > 0) {
    metrics_.LateCompute(run.compute_seconds * late_tokens / static_cast<double>(run.batch_tokens));
  }
  std::lock_guard lock(mu_);
  cost_.Observe(run.batch_tokens, run.compute_seconds);
  computing_ = false;
}

void Scheduler::RunOne(Job* job, RunInfo run) {
  const Clock::time_point start = Clock::now();
  run.queue_seconds = std::chrono::duration<double>(start - job->arrival()).count();
  absl::Status status;
  const core::Layer& layer = *job->version().layer;
  try {
    const core::ForwardShapes shapes = layer.Shapes(job->args());
    absl::StatusOr<ForwardBuffers> buffers = job->Buffers(shapes);
    status = buffers.ok() ? layer.ForwardValidated(job->args(), buffers->output, buffers->attention)
                          : buffers.status();
    if (status.ok()) {
      status = core::CheckOutputFinite(job->args().input, buffers->output, shapes.output_width);
    }
  } catch (const std::exception& e) {
    status = ComputeFailed(e);
  }
  run.compute_seconds = SecondsSince(start);
  RunDone({job}, run);
  Answer(job, status, run);
}

void Scheduler::RunMerged(const std::vector<Job*>& jobs, RunInfo run) {
  const Clock::time_point start = Clock::now();
  // One packed batch whose sequences point into each call's own request, in call order.
  const core::ForwardArgs& head = jobs.front()->args();
  const core::Layer& layer = *jobs.front()->version().layer;  // one version per run (Mergeable)
  core::ForwardArgs merged;
  merged.kind = head.kind;
  absl::Status status;
  std::vector<float> output;
  core::ForwardShapes shapes;
  try {
    merged.input.width = head.input.width;
    if (head.context) merged.context.emplace().width = head.context->width;
    for (Job* job : jobs) {
      AppendSequences(job->args().input, &merged.input);
      if (head.context) AppendSequences(*job->args().context, &*merged.context);
    }
    shapes = layer.Shapes(merged);
    output.resize(shapes.output_size());
    status = layer.ForwardValidated(merged, output);
  } catch (const std::exception& e) {
    status = ComputeFailed(e);
  }
  run.compute_seconds = SecondsSince(start);
  RunDone(jobs, run);
  // Each call's rows back into its own reply, in its own layout (padded rows stay 0).
  const int64_t width = shapes.output_width;
  const float* src = output.data();
  for (Job* job : jobs) {
    RunInfo own = run;
    own.queue_seconds = std::chrono::duration<double>(start - job->arrival()).count();
    if (!status.ok()) {
      Answer(job, status, own);
      continue;
    }
    const absl::Status copied = CopyRowsBack(job, src, width);
    src += job->args().input.total_length() * width;  // before Answer: the job may go with it
    Answer(job, copied, own);
  }
}

absl::Status Scheduler::CopyRowsBack(Job* job, const float* rows, int64_t width) {
  const core::RaggedBatch& input = job->args().input;
  try {
    absl::StatusOr<ForwardBuffers> buffers =
        job->Buffers(job->version().layer->Shapes(job->args()));
    if (!buffers.ok()) return buffers.status();
    if (input.packed()) {
      const int64_t count = input.total_length() * width;
      if (count > 0) std::memcpy(buffers->output.data(), rows, count * sizeof(float));
    } else {
      for (int64_t b = 0; b < input.batch(); ++b) {
        const int64_t count = input.lengths[b] * width;
        if (count == 0) continue;
        std::memcpy(buffers->output.data() + b * input.padded_length * width, rows,
                    count * sizeof(float));
        rows += count;
      }
    }
    return core::CheckOutputFinite(input, buffers->output, width);
  } catch (const std::exception& e) {
    return ComputeFailed(e);
  }
}

void Scheduler::Answer(Job* job, const absl::Status& status, const RunInfo& run) {
  reporter_->Answer(*job, model_name_, /*decoded=*/true, status, run);
}

void Scheduler::Finished(int count) {
  std::lock_guard lock(mu_);
  running_ -= count;
  if (queue_.empty() && running_ == 0 && reserved_ == 0) idle_cv_.notify_all();
}

}  // namespace attnserve::server
