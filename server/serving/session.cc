#include "server/serving/session.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/observability/metrics.h"
#include "server/serving/decode_queue.h"

namespace attnserve::server {
namespace {

// What one sequence of a session holds beside its cache's blocks (twice that for a causal cross
// sequence, which has two caches), rounded up from the ~117 bytes measured.
constexpr int64_t kSequenceBookkeepingBytes = 128;
// Steps of one session that may wait for their turn (each holds its request's buffers).
constexpr size_t kMaxWaitingSteps = 64;

}  // namespace

StepArgs MakeStepArgs(const core::RaggedBatch& input, std::span<float> output,
                      int64_t output_width) {
  StepArgs args;
  const std::vector<int64_t> offsets = input.row_offsets();
  for (int64_t b = 0; b < input.batch(); ++b) {
    args.inputs.push_back(input.data + offsets[b] * input.width);
    args.tokens.push_back(input.lengths[b]);
    args.outputs.push_back(output.data() + offsets[b] * output_width);
  }
  return args;
}

SessionManager::SessionManager(SessionOptions options)
    : options_(options), budget_(options.kv_cache_bytes) {}

absl::StatusOr<std::unique_ptr<Session>> SessionManager::Open(
    VersionHandle version, core::AttentionKind kind, int64_t batch,
    const core::RaggedBatch* context, DecodeQueue* queue, ModelMetrics* metrics, bool restart) {
  const core::Layer* layer = version->layer.get();
  const std::string& model = version->name;
  if (kind != core::AttentionKind::kCausal && kind != core::AttentionKind::kCausalCross) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a decode session is causal or causal_cross, not ", std::string(core::KindName(kind))));
  }
  if (!layer->spec().Serves(kind)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model '", model, "' does not serve ", std::string(core::KindName(kind)), " (d_context ",
        layer->spec().d_context, " != d_model ", layer->spec().d_model, ")"));
  }
  if (!layer->spec().ServesSessions(kind)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model '", model, "' serves no decode sessions: its heads of ", layer->spec().head_dim,
        " dimensions are over the ", core::kMaxDecodeHeadDim, " sessions serve"));
  }
  if (batch <= 0) {
    return absl::InvalidArgumentError("a session's first message has no sequences");
  }
  if ((kind == core::AttentionKind::kCausalCross) != (context != nullptr)) {
    return absl::InvalidArgumentError(
        kind == core::AttentionKind::kCausalCross
            ? "a causal_cross session's first message carries its context"
            : "a causal session takes no context");
  }
  if (context != nullptr && context->batch() != batch) {
    return absl::InvalidArgumentError(
        absl::StrCat("context batch ", context->batch(), " != input batch ", batch));
  }
  // Before any of it is used: its lengths size the cache the session reserves.
  if (context != nullptr) {
    if (absl::Status s = layer->ValidateBatch(*context, /*context=*/true, "context"); !s.ok()) {
      return s;
    }
  }
  const int limit = options_.max_sessions + (restart ? 1 : 0);
  int open = open_.load();
  do {
    if (open >= limit) {
      if (metrics != nullptr) metrics->SessionRefused(SessionRefusal::kMaxSessions);
      // (A restart may open one more while the session it ends finishes: another is doing so.)
      return absl::ResourceExhaustedError(
          absl::StrCat("all ", options_.max_sessions, " sessions --max-sessions allows are open",
                       restart ? ", and another restart holds the one more a restart may open" : "",
                       "; end one or go elsewhere"));
    }
  } while (!open_.compare_exchange_weak(open, open + 1));
  std::unique_ptr<Session> session(new Session(this, std::move(version), kind, queue, metrics));
  // Counted as open from here: the session's end (below, if its context is refused) counts it
  // closed.
  if (metrics != nullptr) metrics->SessionOpened();
  const core::KvPrecision precision = options_.precision.value_or(
      layer->precision() == core::Precision::kBF16 ? core::KvPrecision::kBF16
                                                   : core::KvPrecision::kF32);
  // Each sequence's bookkeeping beside its blocks (its caches' objects, its position, a causal
  // cross sequence's context length and rows' vector, and the frontend's per-sequence copies:
  // lengths, positions, output pointers) is charged with them, so the budget bounds a session of
  // many empty sequences too: 65,536 of them come in a message of a few KiB and held about 117
  // bytes each, malloc's overhead included.
  const int64_t per_sequence = kSequenceBookkeepingBytes * (context != nullptr ? 2 : 1);
  const int64_t bookkeeping = batch > std::numeric_limits<int64_t>::max() / per_sequence
                                  ? std::numeric_limits<int64_t>::max()
                                  : batch * per_sequence;
  // What the session charges beside its caches' blocks (released when it ends); a refusal says
  // what did not fit.
  auto charge = [&](int64_t bytes, const std::string& what) -> absl::Status {
    if (!budget_.TryCharge(bytes)) {
      if (metrics != nullptr) metrics->SessionRefused(SessionRefusal::kKvCache);
      return core::KvCacheFull(budget_, bytes, what);
    }
    session->charged_bytes_ += bytes;
    queue->kv_bytes().fetch_add(bytes);
    if (metrics != nullptr) metrics->SetKvCacheBytes(queue->kv_bytes());
    return absl::OkStatus();
  };
  if (absl::Status s = charge(bookkeeping, absl::StrCat("the bookkeeping of this session's ", batch,
                                                        batch == 1 ? " sequence" : " sequences"));
      !s.ok()) {
    return s;
  }
  const int64_t width = layer->spec().inner(), head_dim = layer->spec().head_dim;
  session->positions_.assign(batch, 0);
  for (int64_t b = 0; b < batch; ++b) {
    session->caches_.push_back(std::make_unique<core::KvSequence>(width, head_dim, precision,
                                                                  &budget_, &queue->kv_bytes()));
  }
  if (context != nullptr) {
    // Its rows wait, copied, until the runs whose queries see them project them: a long
    // context is not projected whole ahead of other sessions' steps, nor past what the session
    // reaches. (The message holds them already, so their size is no overflow.)
    if (absl::Status s =
            charge(context->total_length() * context->width * static_cast<int64_t>(sizeof(float)),
                   "this session's context, kept as rows until it is projected,");
        !s.ok()) {
      return s;
    }
    const std::vector<int64_t> offsets = context->row_offsets();
    for (int64_t b = 0; b < batch; ++b) {
      auto kv = std::make_unique<core::KvSequence>(width, head_dim, precision, &budget_,
                                                   &queue->kv_bytes());
      if (absl::Status s = kv->Reserve(context->lengths[b]); !s.ok()) {
        if (metrics != nullptr) metrics->SessionRefused(SessionRefusal::kKvCache);
        return s;
      }
      session->contexts_.push_back(std::move(kv));
      const float* rows = context->segmented() ? context->sequence_data[b]
                                               : context->data + offsets[b] * context->width;
      session->context_rows_.emplace_back(rows, rows + context->lengths[b] * context->width);
      session->context_lengths_.push_back(context->lengths[b]);
    }
  }
  return session;
}

Session::Session(SessionManager* manager, VersionHandle version, core::AttentionKind kind,
                 DecodeQueue* queue, ModelMetrics* metrics)
    : manager_(manager),
      version_(std::move(version)),
      kind_(kind),
      queue_(queue),
      metrics_(metrics) {
  queue_->sessions().fetch_add(1);
}

Session::~Session() {
  queue_->sessions().fetch_sub(1);
  for (size_t i = 0; i < waiting_.size(); ++i) queue_->ReleaseWaitingStep();
  caches_.clear();
  contexts_.clear();
  manager_->budget_.Release(charged_bytes_);
  queue_->kv_bytes().fetch_sub(charged_bytes_);
  manager_->open_.fetch_sub(1);
  if (metrics_ != nullptr) {
    metrics_->SessionClosed();
    metrics_->SetKvCacheBytes(queue_->kv_bytes());
  }
}

void Session::DropProjectedContext() {
  int64_t freed = 0;
  for (size_t b = 0; b < contexts_.size(); ++b) {
    if (context_rows_[b].empty() || contexts_[b]->length() < context_lengths_[b]) continue;
    freed += static_cast<int64_t>(context_rows_[b].size() * sizeof(float));
    std::vector<float>().swap(context_rows_[b]);
  }
  if (freed == 0) return;
  manager_->budget_.Release(freed);
  queue_->kv_bytes().fetch_sub(freed);
  charged_bytes_ -= freed;
}

void Session::Rewind(const std::vector<int64_t>& done_tokens) {
  for (size_t b = 0; b < positions_.size(); ++b) {
    positions_[b] -= done_tokens[b];
    if (kind_ == core::AttentionKind::kCausal) caches_[b]->Rewind(positions_[b]);
  }
  for (auto& cache : caches_) cache->Shrink();
}

absl::Status Session::ReserveAll(const std::vector<int64_t>& lengths) {
  if (kind_ != core::AttentionKind::kCausal) return absl::OkStatus();
  int64_t more = 0;  // what the whole step takes, for the refusal to say
  for (size_t b = 0; b < caches_.size(); ++b) more += caches_[b]->BytesToReserve(lengths[b]);
  for (size_t b = 0; b < caches_.size(); ++b) {
    absl::Status s = caches_[b]->Reserve(lengths[b]);
    if (s.ok()) continue;
    // Nothing kept: the blocks this step took go back (Shrink keeps what the length needs).
    for (size_t k = 0; k <= b; ++k) caches_[k]->Shrink();
    if (metrics_ != nullptr) metrics_->SessionRefused(SessionRefusal::kKvCache);
    // Said of the whole step and of what sessions held before it, not of the sequence that
    // found the budget spent by the step's own earlier ones (unless memory itself ran out).
    const core::KvCacheBudget& budget = manager_->budget();
    return budget.used() + more > budget.limit() ? core::KvCacheFull(budget, more) : s;
  }
  return absl::OkStatus();
}

std::vector<int64_t> Session::positions() const {
  std::lock_guard lock(mu_);
  return positions_;
}

absl::Status Session::Step(StepArgs args, std::function<void(absl::Status)> done, uint64_t ticket) {
  std::unique_lock lock(mu_);
  if (busy_) {
    if (waiting_.size() >= kMaxWaitingSteps) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the session has ", kMaxWaitingSteps,
          " steps waiting for their turn: send a sequence's steps after their answers"));
    }
    waiting_.push_back({std::move(args), std::move(done), ticket});
    if (absl::Status s = queue_->ReserveWaitingStep(); !s.ok()) {
      waiting_.pop_back();
      return s;
    }
    return absl::OkStatus();
  }
  busy_ = true;
  absl::Status s = Take(args);
  lock.unlock();
  if (!s.ok()) {
    NextTurn();  // to a step handed over meanwhile, if any
    return s;
  }
  Run(std::move(args), std::move(done));
  return absl::OkStatus();
}

void Session::NextTurn() {
  std::unique_lock lock(mu_);
  while (!waiting_.empty()) {
    Waiting next = std::move(waiting_.front());
    waiting_.pop_front();
    queue_->ReleaseWaitingStep();
    absl::Status s = Take(next.args);
    lock.unlock();
    if (s.ok()) return Run(std::move(next.args), std::move(next.done));
    next.done(s);  // refused (nothing changed): answered so, and the next one's turn
    lock.lock();
  }
  busy_ = false;
}

void Session::Run(StepArgs args, std::function<void(absl::Status)> done) {
  const bool ends = args.ends_sequence;
  // The run may start (and answer) before Submit returns.
  queue_->Submit(this, std::move(args), [this, ends, done = std::move(done)](absl::Status status) {
    if (ends && !status.ok()) {  // a failed last step leaves the sequence open
      std::lock_guard lock(mu_);
      ending_ = false;
    }
    // First: the answer may end the session (a waiting step holds it alive).
    NextTurn();
    done(status);
  });
}

absl::Status Session::Take(const StepArgs& args) {
  if (replaced_) {
    return absl::NotFoundError(
        "the sequence started over (a sequence_start was answered) before this step's turn: it "
        "was not run; send it again to go on from that start");
  }
  if (ending_) {
    return absl::NotFoundError(
        "the sequence has ended: a step with sequence_end came before this one; send "
        "sequence_start");
  }
  const int64_t batch = this->batch();
  if (static_cast<int64_t>(args.tokens.size()) != batch) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the session has ", batch, " sequences; this message has ", args.tokens.size()));
  }
  const int64_t longest = *std::max_element(positions_.begin(), positions_.end());
  if (args.truncate_to && *args.truncate_to < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("truncate_to ", *args.truncate_to, " is negative: positions start at 0"));
  }
  if (args.truncate_to && *args.truncate_to > longest) {
    return absl::InvalidArgumentError(absl::StrCat("truncate_to ", *args.truncate_to,
                                                   " is past the end: the longest sequence "
                                                   "holds ",
                                                   longest, " tokens"));
  }
  std::vector<int64_t> kept(batch), lengths(batch);
  const int64_t limit = manager_->options().max_session_tokens;
  for (int64_t b = 0; b < batch; ++b) {
    kept[b] = std::min(positions_[b], args.truncate_to.value_or(positions_[b]));
    lengths[b] = kept[b] + args.tokens[b];
    if (lengths[b] > limit) {
      if (metrics_ != nullptr) metrics_->SessionRefused(SessionRefusal::kSessionTokens);
      return absl::ResourceExhaustedError(
          absl::StrCat("sequence ", b, " would hold ", lengths[b], " tokens, over the limit of ",
                       limit, " (--max-session-tokens); truncate it or end the session"));
    }
  }
  if (queue_->closed()) return absl::UnavailableError("the server is shutting down");
  if (absl::Status s = ReserveAll(lengths); !s.ok()) return s;
  for (int64_t b = 0; b < batch; ++b) {
    positions_[b] = kept[b];
    if (kind_ == core::AttentionKind::kCausal) caches_[b]->Rewind(kept[b]);
  }
  if (args.ends_sequence) ending_ = true;
  return absl::OkStatus();
}

void Session::CancelStep(const absl::Status& why) { queue_->Cancel(this, why); }

void Session::Replaced() {
  std::lock_guard lock(mu_);
  replaced_ = true;
}

void Session::Withdraw(uint64_t ticket, const absl::Status& why) {
  std::function<void(absl::Status)> done;
  {
    std::lock_guard lock(mu_);
    auto it = std::find_if(waiting_.begin(), waiting_.end(),
                           [ticket](const Waiting& w) { return w.ticket == ticket; });
    if (ticket == 0 || it == waiting_.end()) return;
    done = std::move(it->done);
    waiting_.erase(it);
    queue_->ReleaseWaitingStep();
  }
  done(why);
}

uint64_t Session::NewStepTicket() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1);
}

}  // namespace attnserve::server
