#include "server/serving/decode_queue.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <limits>
#include <set>
#include <span>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/layer.h"
#include "core/layer_limits.h"
#include "server/observability/metrics.h"

namespace attnserve::server {
namespace {

// Groups (kinds times versions) whose latest run RunNext keeps before it forgets those with no
// step waiting.
constexpr size_t kGroupsKept = 64;
// A run that projects rows of causal cross contexts (those its queries see and are not projected
// yet) projects at least this many in all, when so many are left: the rows after those. One
// token a step would otherwise project its context a row a step, each time reading the layer's
// whole K and V weights for it.
constexpr int64_t kContextRows = 64;
// A step with at most this many new tokens a sequence is a generation step, not a prefill.
constexpr int64_t kShortStepTokens = 16;
// What the prompts' chunks may cost in a run beside short steps, at least (in cached keys read,
// as Reads counts), so that prompts move on beside a few short steps.
constexpr int64_t kMinPrefillReads = 16 * 1024;
// Sessions whose short steps ran this recently are generating: a run of prompts alone costs no
// more than their steps.
constexpr std::chrono::milliseconds kGeneratingWindow{100};
// Other sessions count as about to step, and a prompt's chunk is held to a chunk's cost at
// position 0, while short steps ran this recently. Sessions idle for longer (a chat waiting on
// its user) wait for one larger chunk when they step again, rather than every long prompt
// running in chunks of a few tokens (near position 16k, 12 demo tokens: the whole cache read
// again for each).
constexpr std::chrono::seconds kSteppingWindow{1};

}  // namespace

DecodeQueue::DecodeQueue(std::string model_name, int64_t chunk_tokens, ComputeExecutor* executor,
                         ModelMetrics* metrics, Scheduler* calls)
    : model_name_(std::move(model_name)),
      chunk_tokens_(std::max<int64_t>(chunk_tokens, 1)),
      executor_(executor),
      metrics_(metrics),
      calls_(calls) {
  executor_->Add(this);
}

DecodeQueue::~DecodeQueue() {
  Close();
  Join();
  executor_->Remove(this);
}

void DecodeQueue::Submit(Session* session, StepArgs args, std::function<void(absl::Status)> done) {
  const size_t sequences = args.tokens.size();
  Pending step{session,
               std::move(args),
               std::move(done),
               std::vector<int64_t>(sequences, 0),
               /*flops=*/0,
               /*running=*/false,
               /*answered=*/false,
               /*stop=*/absl::OkStatus()};
  // A step alone and small enough for one thread (Layer::Decode runs it serially) runs here
  // when the compute thread is idle: two thread hand-offs cost more than such a step. (Decided
  // before it is queued: once queued, it may be answered, and its session gone, at any time.)
  {
    std::lock_guard session_lock(session->mu_);
    step.flops = static_cast<double>(Reads(step)) * 4 * session->layer()->spec().inner();
  }
  const bool serial = step.flops < core::kSerialFlops;
  bool queued = false, alone = false;
  {
    std::lock_guard lock(mu_);
    if (!closed_) {
      alone = pending_.empty() && !running_;
      pending_.push_back(std::move(step));
      queued = true;
    }
  }
  if (!queued) {  // closed since the session checked: the step is answered as not run
    GiveBack(*session, step.done_tokens);
    step.done(absl::UnavailableError("the server is shutting down"));
    return;
  }
  if (alone && serial && executor_->TryRunInline(this)) return;
  executor_->Notify();
}

absl::Status DecodeQueue::ReserveWaitingStep() {
  return calls_ == nullptr ? absl::OkStatus() : calls_->ReserveWaitingStep();
}

void DecodeQueue::ReleaseWaitingStep() {
  if (calls_ != nullptr) calls_->ReleaseWaitingStep();
}

void DecodeQueue::Cancel(Session* session, const absl::Status& why) {
  std::function<void(absl::Status)> done;
  std::vector<int64_t> done_tokens;
  {
    std::lock_guard lock(mu_);
    for (auto it = pending_.begin(); it != pending_.end(); ++it) {
      if (it->session != session) continue;
      if (it->running) {  // RunNext answers it when its chunk ends
        if (it->stop.ok()) it->stop = why;
        return;
      }
      done = std::move(it->done);
      done_tokens = std::move(it->done_tokens);
      pending_.erase(it);
      break;
    }
    if (pending_.empty() && !running_) idle_cv_.notify_all();
  }
  if (!done) return;
  GiveBack(*session, done_tokens);
  done(why);
}

void DecodeQueue::GiveBack(Session& session, const std::vector<int64_t>& done_tokens) {
  {
    // The step is not answered yet: no other step of the session can have run or reserved room
    // since.
    std::lock_guard session_lock(session.mu_);
    session.Rewind(done_tokens);
  }
  if (metrics_ != nullptr) metrics_->SetKvCacheBytes(kv_bytes_);
}

void DecodeQueue::Close(Clock::time_point deadline) {
  {
    std::lock_guard lock(mu_);
    closed_ = true;
    drain_deadline_ = std::min(drain_deadline_, deadline);
  }
  executor_->Notify();
}

bool DecodeQueue::closed() const {
  std::lock_guard lock(mu_);
  return closed_;
}

void DecodeQueue::Join() {
  std::unique_lock lock(mu_);
  idle_cv_.wait(lock, [this] { return pending_.empty() && !running_; });
}

Clock::time_point DecodeQueue::ReadyAt(Clock::time_point now) const {
  std::lock_guard lock(mu_);
  return pending_.empty() ? Clock::time_point::max() : now;
}

bool DecodeQueue::Finished(const Pending& step) {
  for (size_t b = 0; b < step.args.tokens.size(); ++b) {
    if (step.done_tokens[b] < step.args.tokens[b]) return false;
  }
  return true;
}

bool DecodeQueue::Short(const Pending& step) {
  for (size_t b = 0; b < step.args.tokens.size(); ++b) {
    if (step.args.tokens[b] - step.done_tokens[b] > kShortStepTokens) return false;
  }
  return true;
}

int64_t DecodeQueue::ContextRowsToProject(const Session& session, size_t b, int64_t n) {
  if (session.kind() != core::AttentionKind::kCausalCross) return 0;
  const int64_t seen = std::min(session.positions_[b] + n, session.context_lengths_[b]);
  return std::max<int64_t>(seen - session.contexts_[b]->length(), 0);
}

int64_t DecodeQueue::Reads(const Session& session, size_t b, int64_t n) {
  // Each query sees the keys up to its own position: its sequence's, or (causal cross) the
  // context's, however long the sequence. Its projections (Q, K, V and the output, about
  // 4 d_model^2 multiply-adds) cost as much as reading 2 d_model keys (2 x inner each), and a
  // context row's (K and V) as reading d_context keys: those the queries see first, and the
  // rows a run adds after them (kContextRows at most).
  const int64_t seen = session.positions_[b] + n;
  if (session.kind() == core::AttentionKind::kCausal) {
    return n * (seen + 2 * session.layer()->spec().d_model);
  }
  int64_t context_rows = ContextRowsToProject(session, b, n);
  if (context_rows > 0) {
    const int64_t left = session.context_lengths_[b] - session.contexts_[b]->length();
    context_rows = std::max(context_rows, std::min(kContextRows, left));
  }
  return n * (std::min(seen, session.context_lengths_[b]) + 2 * session.layer()->spec().d_model) +
         context_rows * session.layer()->spec().d_context;
}

int64_t DecodeQueue::Reads(const Pending& step) {
  int64_t reads = 0;
  for (size_t b = 0; b < step.args.tokens.size(); ++b) {
    reads += Reads(*step.session, b, step.args.tokens[b] - step.done_tokens[b]);
  }
  return reads;
}

void DecodeQueue::AddChunk(Pending& step, int64_t* budget, int64_t* reads,
                           std::vector<core::DecodeSequence>* run,
                           std::vector<size_t>* sequence_of) const {
  Session& session = *step.session;
  const int64_t width = session.layer()->spec().d_model;
  const int64_t out_width = session.layer()->spec().d_output();
  for (size_t b = 0; b < step.args.tokens.size() && *budget > 0; ++b) {
    const int64_t offset = step.done_tokens[b];
    int64_t n = std::min(step.args.tokens[b] - offset, *budget);
    if (n <= 0) continue;
    const int64_t position = session.positions_[b];
    if (reads != nullptr) {
      if (*reads <= 0) return;
      while (n > 1 && Reads(session, b, n) > *reads) n /= 2;  // one token at least
      *reads -= Reads(session, b, n);
    }
    core::DecodeSequence seq;
    seq.input = step.args.inputs[b] + offset * width;
    seq.tokens = n;
    seq.position = position;
    if (session.kind() == core::AttentionKind::kCausal) {
      seq.cache = session.caches_[b].get();
    } else {
      seq.context = session.contexts_[b].get();
      seq.context_length = session.context_lengths_[b];
    }
    seq.output = step.args.outputs[b] + offset * out_width;
    run->push_back(seq);
    sequence_of->push_back(b);
    *budget -= n;
  }
}

void DecodeQueue::RunNext(Clock::time_point now, bool on_caller) noexcept {
  std::vector<Pending*> steps;
  std::vector<Pending> dropped;  // past the drain's grace: answered without (more) compute
  {
    std::lock_guard lock(mu_);
    // The clock is read here, under the lock: `now` may predate a Close whose deadline passed.
    if (closed_ && Clock::now() >= drain_deadline_ && !pending_.empty()) {
      dropped.assign(std::make_move_iterator(pending_.begin()),
                     std::make_move_iterator(pending_.end()));
      pending_.clear();
      running_ = true;  // until they are answered: Join waits for their answers
    }
  }
  if (!dropped.empty()) {
    for (Pending& step : dropped) {
      GiveBack(*step.session, step.done_tokens);
      step.done(absl::UnavailableError(
          "the server shut down before this step could run to its end (--shutdown-grace)"));
    }
    EndRun();
    return;
  }
  {
    std::lock_guard lock(mu_);
    if (pending_.empty()) return;
    // One kind and one version a run (one Layer::Decode). They take turns: of the groups with
    // steps waiting, the one whose latest run is the oldest goes (a new group first; then the
    // first to arrive), so a long prompt's chunks alternate with the other groups' steps instead
    // of holding them to its end. A group keeps its latest run while no step of it waits:
    // forgotten, it would come back first every time, and two groups whose steps come between
    // runs would hold a third's waiting step for good.
    std::set<Group> waiting;
    Group lead{};
    uint64_t lead_run = std::numeric_limits<uint64_t>::max();
    for (const Pending& step : pending_) {
      const Group group{step.session->kind(), step.session->layer().get()};
      if (!waiting.insert(group).second) continue;
      const auto it = group_runs_.find(group);
      const uint64_t latest = it == group_runs_.end() ? 0 : it->second;
      if (latest < lead_run) {
        lead = group;
        lead_run = latest;
      }
    }
    const auto [kind, layer] = lead;
    double inline_flops = 0;
    for (Pending& step : pending_) {
      if (step.session->kind() != kind || step.session->layer().get() != layer) continue;
      // On a caller's thread, steps queued meanwhile join as long as the run stays one thread's
      // work; a prompt's chunks, and what does not fit, are the compute thread's.
      if (on_caller) {
        if (inline_flops + step.flops >= core::kSerialFlops) continue;
        inline_flops += step.flops;
      }
      step.running = true;
      steps.push_back(&step);
    }
    if (steps.empty()) return;  // on a caller's thread: the lead group's turn is the executor's
    group_runs_[lead] = ++runs_;
    // Kinds times versions served at once are few; past that many, the groups no step waits
    // for go (a version unloaded, its layer's address free for another).
    if (group_runs_.size() > kGroupsKept) {
      std::erase_if(group_runs_, [&](const auto& entry) { return !waiting.contains(entry.first); });
    }
    running_ = true;
  }
  const std::shared_ptr<const core::Layer>& layer = steps.front()->session->layer();
  absl::Status status;
  std::vector<core::DecodeSequence> run;
  std::vector<size_t> step_of, sequence_of;  // each run entry's step and sequence
  // The causal cross context rows the run's queries see and are not projected yet, and how
  // many rows each part's context has after them.
  std::vector<core::ContextRows> context_parts;
  std::vector<int64_t> context_left;
  try {
    // While short steps share the run, the prompts' chunks together read no more cached keys
    // than those steps do (and at least kMinPrefillReads, so that prompts move on).
    int64_t short_reads = 0;
    int64_t long_steps = 0;
    bool any_short = false;
    for (Pending* step : steps) {
      std::lock_guard session_lock(step->session->mu_);
      if (!Short(*step)) {
        ++long_steps;
        continue;
      }
      any_short = true;
      short_reads += Reads(*step);
    }
    // And, when other sessions are open and stepping (kSteppingWindow), never more than a chunk
    // of chunk_tokens at position 0: with many sessions, a moment with no step waiting comes
    // often, and a 256-token chunk at position 4000 then held their next steps for 15 times as
    // long.
    const bool others =
        sessions_.load() > long_steps && (any_short || now - recent_short_at_ < kSteppingWindow);
    const int64_t max_prefill = others ? chunk_tokens_ * (chunk_tokens_ + 2 * layer->spec().d_model)
                                       : std::numeric_limits<int64_t>::max();
    // A run of prompts alone, in a moment between the steps of sessions that are generating
    // (short steps within kGeneratingWindow), is held to those steps' last run the same way:
    // the steps that arrive meanwhile wait for it.
    if (any_short) {
      recent_short_reads_ = short_reads;
      recent_short_at_ = now;
    }
    const bool generating = any_short || (others && now - recent_short_at_ < kGeneratingWindow);
    int64_t prefill_reads =
        generating ? std::min(max_prefill, std::max(recent_short_reads_, kMinPrefillReads))
                   : max_prefill;
    for (size_t i = 0; i < steps.size(); ++i) {
      Session& session = *steps[i]->session;
      // Each session's state is read and written under its lock: its frontend's next Step
      // (on another thread, after this step's answer) sees what this run did.
      std::lock_guard session_lock(session.mu_);
      int64_t budget = chunk_tokens_;
      const size_t first = run.size();
      AddChunk(*steps[i], &budget, Short(*steps[i]) ? nullptr : &prefill_reads, &run, &sequence_of);
      step_of.resize(run.size(), i);
      for (size_t k = first; k < run.size(); ++k) {
        const size_t b = sequence_of[k];
        const int64_t rows = ContextRowsToProject(session, b, run[k].tokens);
        if (rows == 0) continue;
        const int64_t from = session.contexts_[b]->length();
        context_parts.push_back({session.context_rows_[b].data() + from * layer->spec().d_context,
                                 rows, session.contexts_[b].get()});
        context_left.push_back(session.context_lengths_[b] - from - rows);
      }
    }
    // Topped up with the rows after them, all in one matmul: to kContextRows, or to what the
    // prompts' share of the run left allows (up to chunk_tokens rows; on a caller's thread not
    // past kContextRows, which its steps' cost counted), so that a context is soon projected
    // whole and its rows freed. (A failure fails the whole run, as Decode's would: it
    // is the engine's, not a step's.)
    const int64_t top_up = on_caller
                               ? kContextRows
                               : std::clamp(prefill_reads / layer->spec().d_context, kContextRows,
                                            std::max(kContextRows, chunk_tokens_));
    int64_t context_rows = 0;
    for (const core::ContextRows& part : context_parts) context_rows += part.tokens;
    for (size_t p = 0; p < context_parts.size() && context_rows < top_up; ++p) {
      const int64_t more = std::min(top_up - context_rows, context_left[p]);
      context_parts[p].tokens += more;
      context_rows += more;
    }
    status = layer->ProjectContext(context_parts);
    if (status.ok()) status = layer->Decode(steps.front()->session->kind(), run);
  } catch (const std::exception& e) {
    status = absl::InternalError(absl::StrCat("decode step failed: ", e.what()));
  }
  int64_t tokens = 0;
  for (const core::DecodeSequence& seq : run) tokens += seq.tokens;
  if (metrics_ != nullptr && status.ok()) metrics_->DecodeRun(tokens);
  // Each step's answer: the run's, or (as Forward's) a refusal of an output that overflowed
  // float32, for that step alone.
  std::vector<absl::Status> outcome(steps.size(), status);
  const int64_t out_width = layer->spec().d_output();
  for (size_t k = 0; status.ok() && k < run.size(); ++k) {
    absl::Status& step_outcome = outcome[step_of[k]];
    const std::span<const float> rows(run[k].output, run[k].tokens * out_width);
    if (step_outcome.ok() && !core::AllFinite(rows)) {
      step_outcome = core::OutputNotFinite(static_cast<int64_t>(sequence_of[k]));
    }
  }
  // Each step's sequences move on by what this run computed; a step done frees the blocks it
  // reserved and did not use, and a context projected to its end its rows. A step that failed
  // goes back to where it began, its earlier chunks included: its message is answered with an
  // error, and the session is as it was before it (but for a truncate_to it asked for).
  std::vector<bool> finished(steps.size());
  size_t k = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    Pending& step = *steps[i];
    std::lock_guard session_lock(step.session->mu_);
    for (; k < run.size() && step_of[k] == i; ++k) {
      if (!status.ok()) continue;
      step.done_tokens[sequence_of[k]] += run[k].tokens;
      step.session->positions_[sequence_of[k]] += run[k].tokens;
    }
    step.session->DropProjectedContext();
    finished[i] = !outcome[i].ok() || Finished(step);
    if (!outcome[i].ok()) {
      step.session->Rewind(step.done_tokens);
    } else if (finished[i]) {
      for (auto& cache : step.session->caches_) cache->Shrink();
    }
  }
  std::vector<std::pair<std::function<void(absl::Status)>, absl::Status>> answers;
  // Answered before their end, with what each had run: they go back first.
  std::vector<std::pair<Session*, std::vector<int64_t>>> stopped;
  {
    std::lock_guard lock(mu_);
    for (size_t i = 0; i < steps.size(); ++i) {
      steps[i]->running = false;
      if (!finished[i] && steps[i]->stop.ok()) continue;
      answers.emplace_back(std::move(steps[i]->done), finished[i] ? outcome[i] : steps[i]->stop);
      steps[i]->answered = true;
      if (!finished[i]) stopped.emplace_back(steps[i]->session, std::move(steps[i]->done_tokens));
    }
    pending_.remove_if([](const Pending& step) { return step.answered; });
  }
  if (metrics_ != nullptr) metrics_->SetKvCacheBytes(kv_bytes_);
  for (auto& [session, done_tokens] : stopped) GiveBack(*session, done_tokens);
  for (auto& [done, answer] : answers) done(answer);
  EndRun();
}

void DecodeQueue::EndRun() {
  // A run ends once its steps are answered: a drain's Join returns after the last answer, so a
  // transport shutting down next cannot cut one.
  std::lock_guard lock(mu_);
  running_ = false;
  if (pending_.empty()) idle_cv_.notify_all();
}

}  // namespace attnserve::server
