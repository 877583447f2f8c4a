#include "server/serving/scheduler.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/serving/compute_executor.h"
#include "server/observability/logging.h"

namespace attnserve::server {
namespace {

int64_t Tokens(const core::ForwardArgs& args) {
  return args.input.total_length() + (args.context ? args.context->total_length() : 0);
}

// Whether `job` may share a merged run with `head`.
bool Mergeable(const core::ForwardArgs& head, const core::ForwardArgs& job) {
  return !job.return_attention && job.kind == head.kind &&
         job.context.has_value() == head.context.has_value();
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

Scheduler::Scheduler(std::string model_name, std::shared_ptr<const core::Layer> layer,
                     SchedulerOptions options, ComputeExecutor* executor, CallReporter* reporter)
    : model_name_(std::move(model_name)),
      layer_(std::move(layer)),
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

absl::Status Scheduler::Reserve() {
  std::lock_guard lock(mu_);
  if (closed_) return absl::UnavailableError("the server is shutting down");
  const int held = static_cast<int>(queue_.size()) + reserved_;
  if (held >= options_.max_queue) {
    return absl::ResourceExhaustedError(
        absl::StrCat("model '", model_name_, "' has ", held, " calls queued (--max-queue)"));
  }
  ++reserved_;
  return absl::OkStatus();
}

void Scheduler::Release() {
  std::lock_guard lock(mu_);
  --reserved_;
  if (reserved_ == 0 && queue_.empty() && running_ == 0) idle_cv_.notify_all();
}

void Scheduler::Submit(Job* job) {
  {
    std::lock_guard lock(mu_);
    const int64_t tokens = Tokens(job->args());
    queue_.push_back({job, tokens});
    --reserved_;
    queued_tokens_ += tokens;
    job->queue_.store(this);
    metrics_.SetQueueDepth(static_cast<int>(queue_.size()));
  }
  Log(LogLevel::kTrace, "forward queued", {{"model", model_name_}});
  // The caller may have left between admission and now: CallerGone saw no queue then.
  if (job->gone_.load()) Cancel(job);
  executor_->Notify();
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
  // A queued call whose deadline passes must leave then, even inside a delay window.
  Clock::time_point first_deadline = Clock::time_point::max();
  for (const Queued& queued : queue_) {
    first_deadline = std::min(first_deadline, queued.job->deadline());
  }
  return std::min(RunStartLocked(now), first_deadline);
}

Clock::time_point Scheduler::RunStartLocked(Clock::time_point now) const {
  const Job& head = *queue_.front().job;
  if (closed_ || options_.max_queue_delay.count() == 0 || options_.max_batch_tokens <= 0 ||
      head.args().return_attention || queued_tokens_ >= options_.max_batch_tokens) {
    return now;
  }
  return head.arrival() + options_.max_queue_delay;
}

void Scheduler::RunNext(Clock::time_point now) {
  std::vector<Job*> dead, expired, jobs;
  {
    std::lock_guard lock(mu_);
    jobs = TakeLocked(now, &dead, &expired);
    // Every call taken counts as running until answered, so Join waits for its answer.
    running_ += static_cast<int>(jobs.size() + dead.size() + expired.size());
    metrics_.SetQueueDepth(static_cast<int>(queue_.size()));
  }
  for (Job* job : dead) Answer(job, job->CheckAlive(now));
  for (Job* job : expired) {
    Answer(job, absl::UnavailableError("the server shut down before the call could run"));
  }
  if (!jobs.empty()) Run(jobs);
  Finished(static_cast<int>(jobs.size() + dead.size() + expired.size()));
}

std::vector<Job*> Scheduler::TakeLocked(Clock::time_point now, std::vector<Job*>* dead,
                                        std::vector<Job*>* expired) {
  // Calls whose caller left (or whose deadline passed, which OnCancel may not have said yet),
  // and after the drain's grace every call, leave without compute.
  const bool grace_over = closed_ && now > drain_deadline_;
  for (auto it = queue_.begin(); it != queue_.end();) {
    const bool alive = !grace_over && it->job->CheckAlive(now).ok();
    if (alive) {
      ++it;
      continue;
    }
    (grace_over ? expired : dead)->push_back(it->job);
    queued_tokens_ -= it->tokens;
    it = queue_.erase(it);
  }
  std::vector<Job*> jobs;
  if (queue_.empty() || RunStartLocked(now) > now) return jobs;  // only dead calls were due
  jobs.push_back(queue_.front().job);
  int64_t tokens = queue_.front().tokens;
  queued_tokens_ -= tokens;
  queue_.pop_front();
  const core::ForwardArgs& head = jobs.front()->args();
  if (options_.max_batch_tokens <= 0 || head.return_attention) return jobs;
  for (auto it = queue_.begin(); it != queue_.end();) {
    if (Mergeable(head, it->job->args()) && tokens + it->tokens <= options_.max_batch_tokens) {
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

void Scheduler::Run(const std::vector<Job*>& jobs) {
  RunInfo run;
  run.batch_calls = static_cast<int>(jobs.size());
  for (Job* job : jobs) run.batch_tokens += Tokens(job->args());
  if (jobs.size() == 1) {
    RunOne(jobs.front(), run);
  } else {
    RunMerged(jobs, run);
  }
}

void Scheduler::RunOne(Job* job, RunInfo run) {
  const Clock::time_point start = Clock::now();
  run.queue_seconds = std::chrono::duration<double>(start - job->arrival()).count();
  absl::Status status;
  try {
    absl::StatusOr<ForwardBuffers> buffers = job->Buffers(layer_->Shapes(job->args()));
    status = buffers.ok()
                 ? layer_->ForwardValidated(job->args(), buffers->output, buffers->attention)
                 : buffers.status();
  } catch (const std::exception& e) {
    status = ComputeFailed(e);
  }
  run.compute_seconds = SecondsSince(start);
  metrics_.ComputeRun(run.batch_calls, run.batch_tokens, run.compute_seconds);
  Answer(job, status, run);
}

void Scheduler::RunMerged(const std::vector<Job*>& jobs, RunInfo run) {
  const Clock::time_point start = Clock::now();
  // One packed batch whose sequences point into each call's own request, in call order.
  const core::ForwardArgs& head = jobs.front()->args();
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
    shapes = layer_->Shapes(merged);
    output.resize(shapes.output_size());
    status = layer_->ForwardValidated(merged, output);
  } catch (const std::exception& e) {
    status = ComputeFailed(e);
  }
  run.compute_seconds = SecondsSince(start);
  metrics_.ComputeRun(run.batch_calls, run.batch_tokens, run.compute_seconds);
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
    absl::StatusOr<ForwardBuffers> buffers = job->Buffers(layer_->Shapes(job->args()));
    if (!buffers.ok()) return buffers.status();
    if (input.packed()) {
      const int64_t count = input.total_length() * width;
      if (count > 0) std::memcpy(buffers->output.data(), rows, count * sizeof(float));
      return absl::OkStatus();
    }
    for (int64_t b = 0; b < input.batch(); ++b) {
      const int64_t count = input.lengths[b] * width;
      if (count == 0) continue;
      std::memcpy(buffers->output.data() + b * input.padded_length * width, rows,
                  count * sizeof(float));
      rows += count;
    }
    return absl::OkStatus();
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
