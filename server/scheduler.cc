#include "server/scheduler.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/runtime_info.h"
#include "server/logging.h"

namespace attnserve::server {
namespace {

double MillisSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

int64_t Tokens(const core::ForwardArgs& args) {
  return args.input.total_length() + (args.context ? args.context->total_length() : 0);
}

// Whether `job` may share a merged run with `head`.
bool Mergeable(const core::ForwardArgs& head, const core::ForwardArgs& job) {
  return !job.return_attention && job.kind == head.kind &&
         job.context.has_value() == head.context.has_value();
}

// Appends the valid rows of `batch` to `rows` (packed) and its lengths to `lengths`.
void AppendValidRows(const core::RaggedBatch& batch, std::vector<float>* rows,
                     std::vector<int64_t>* lengths) {
  const std::vector<int64_t> offsets = batch.row_offsets();
  for (int64_t b = 0; b < batch.batch(); ++b) {
    const float* src = batch.data + offsets[b] * batch.width;
    rows->insert(rows->end(), src, src + batch.lengths[b] * batch.width);
    lengths->push_back(batch.lengths[b]);
  }
}

// A packed batch over `rows`.
core::RaggedBatch PackedBatch(const std::vector<float>& rows, std::vector<int64_t> lengths,
                              int64_t width) {
  core::RaggedBatch batch;
  batch.data = rows.data();
  batch.width = width;
  batch.lengths = std::move(lengths);
  batch.padded_length = core::RaggedBatch::kPacked;
  return batch;
}

}  // namespace

Scheduler::Scheduler(std::string model_name, std::shared_ptr<const core::Layer> layer,
                     SchedulerOptions options, std::mutex* compute_mutex)
    : model_name_(std::move(model_name)),
      layer_(std::move(layer)),
      options_(options),
      compute_mutex_(compute_mutex),
      worker_([this] { WorkerLoop(); }) {}

Scheduler::~Scheduler() { Drain(); }

void Scheduler::Submit(std::unique_ptr<Job> job) {
  absl::Status refused;
  {
    std::lock_guard lock(mu_);
    if (closed_) {
      refused = absl::UnavailableError("the server is shutting down");
    } else if (static_cast<int>(queue_.size()) >= options_.max_queue) {
      refused = absl::ResourceExhaustedError(absl::StrCat(
          "model '", model_name_, "' has ", queue_.size(), " calls queued (--max-queue)"));
    } else {
      queue_.push_back(std::move(job));
      pending_.fetch_add(1);
    }
  }
  if (!refused.ok()) {
    job->Finish(refused, RunInfo{});
    return;
  }
  Log(LogLevel::kTrace, "forward queued", {{"model", model_name_}, {"pending", pending()}});
  cv_.notify_one();
}

void Scheduler::Close(std::chrono::steady_clock::time_point deadline) {
  {
    std::lock_guard lock(mu_);
    closed_ = true;
    drain_deadline_ = std::min(drain_deadline_, deadline);
  }
  cv_.notify_all();
}

void Scheduler::Join() {
  if (worker_.joinable()) worker_.join();
}

void Scheduler::WorkerLoop() {
  // OpenMP keeps the thread count per thread: set it on the thread that computes.
  core::SetComputeThreads(options_.compute_threads);
  while (true) {
    std::vector<std::unique_ptr<Job>> jobs;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [this] { return !queue_.empty() || closed_; });
      if (queue_.empty()) return;  // closed and everything answered
      jobs = TakeBatchLocked();
    }
    const int taken = static_cast<int>(jobs.size());
    RunBatch(std::move(jobs));
    pending_.fetch_sub(taken);
  }
}

std::vector<std::unique_ptr<Job>> Scheduler::TakeBatchLocked() {
  std::vector<std::unique_ptr<Job>> jobs;
  jobs.push_back(std::move(queue_.front()));
  queue_.pop_front();
  const core::ForwardArgs& head = jobs.front()->args();
  if (options_.max_batch_tokens <= 0 || head.return_attention) return jobs;
  int64_t tokens = Tokens(head);
  for (auto it = queue_.begin(); it != queue_.end();) {
    const core::ForwardArgs& args = (*it)->args();
    if (Mergeable(head, args) && tokens + Tokens(args) <= options_.max_batch_tokens) {
      tokens += Tokens(args);
      jobs.push_back(std::move(*it));
      it = queue_.erase(it);
    } else {
      ++it;
    }
  }
  return jobs;
}

void Scheduler::RunBatch(std::vector<std::unique_ptr<Job>> jobs) {
  // Calls whose caller left or whose deadline passed while queued are answered, not computed.
  bool grace_over = false;
  {
    std::lock_guard lock(mu_);
    grace_over = closed_ && std::chrono::steady_clock::now() > drain_deadline_;
  }
  std::vector<std::unique_ptr<Job>> live;
  for (auto& job : jobs) {
    absl::Status alive =
        grace_over ? absl::UnavailableError("the server shut down before the call could run")
                   : job->CheckAlive();
    if (alive.ok()) {
      live.push_back(std::move(job));
    } else {
      job->Finish(alive, RunInfo{});
    }
  }
  if (live.empty()) return;
  std::lock_guard compute(*compute_mutex_);
  // Core reports errors as values, but allocating a reply can still throw (bad_alloc): the
  // calls not yet answered are answered Internal, and the worker lives on.
  try {
    if (live.size() == 1) {
      RunOne(live.front());
    } else {
      RunMerged(live);
    }
  } catch (const std::exception& e) {
    for (auto& job : live) {
      if (job)
        job->Finish(absl::InternalError(absl::StrCat("compute failed: ", e.what())), RunInfo{});
    }
  }
}

void Scheduler::RunOne(std::unique_ptr<Job>& job) {
  const core::ForwardShapes shapes = layer_->Shapes(job->args());
  const ForwardBuffers buffers = job->Buffers(shapes);
  const auto start = std::chrono::steady_clock::now();
  const absl::Status status = layer_->Forward(job->args(), buffers.output, buffers.attention);
  job->Finish(status, RunInfo{.batch_size = 1, .compute_ms = MillisSince(start)});
  job.reset();
}

void Scheduler::RunMerged(std::vector<std::unique_ptr<Job>>& jobs) {
  // One packed batch holding every job's valid rows, sequences in job order.
  const core::ForwardArgs& head = jobs.front()->args();
  std::vector<float> input_rows, context_rows;
  std::vector<int64_t> input_lengths, context_lengths;
  for (const auto& job : jobs) {
    AppendValidRows(job->args().input, &input_rows, &input_lengths);
    if (head.context) AppendValidRows(*job->args().context, &context_rows, &context_lengths);
  }
  core::ForwardArgs merged;
  merged.kind = head.kind;
  merged.input = PackedBatch(input_rows, std::move(input_lengths), head.input.width);
  if (head.context) {
    merged.context = PackedBatch(context_rows, std::move(context_lengths), head.context->width);
  }
  const core::ForwardShapes merged_shapes = layer_->Shapes(merged);
  std::vector<float> output(merged_shapes.output_size());
  const auto start = std::chrono::steady_clock::now();
  const absl::Status status = layer_->Forward(merged, output);
  const RunInfo run{.batch_size = static_cast<int>(jobs.size()), .compute_ms = MillisSince(start)};
  if (!status.ok()) {
    for (auto& job : jobs) {
      job->Finish(status, run);
      job.reset();
    }
    return;
  }
  // Splits the packed output back into each call's own layout; padded rows stay 0.
  const int64_t width = merged_shapes.output_width;
  const float* src = output.data();
  for (auto& job : jobs) {
    const core::RaggedBatch& input = job->args().input;
    const ForwardBuffers buffers = job->Buffers(layer_->Shapes(job->args()));
    const std::vector<int64_t> offsets = input.row_offsets();
    for (int64_t b = 0; b < input.batch(); ++b) {
      const int64_t count = input.lengths[b] * width;
      std::memcpy(buffers.output.data() + offsets[b] * width, src, count * sizeof(float));
      src += count;
    }
    job->Finish(absl::OkStatus(), run);
    job.reset();
  }
}

}  // namespace attnserve::server
