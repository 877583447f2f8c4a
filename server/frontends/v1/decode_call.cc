#include "server/frontends/v1/decode_call.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/guarded.h"
#include "server/frontends/grpc_status.h"
#include "server/frontends/raw_call.h"
#include "server/frontends/tensor_codec.h"
#include "server/frontends/v1/forward_codec.h"

namespace attnserve::server {
namespace {

// What a step taken back because its stream ended says (no one reads it: it is counted).
absl::Status StreamEnded() { return absl::CancelledError("the stream ended"); }

}  // namespace

DecodeCall::DecodeCall(Admission* admission, OpenStreams* streams)
    : admission_(admission), streams_(streams) {
  {
    std::lock_guard lock(mu_);  // the members' construction, before any reaction
    reading_ = true;
  }
  StartRead(&request_bytes_);
  streams_->Add(this);
  // A drain that began before it joined (its EndIdle passed it by) ends it too.
  if (!admission_->accepting()) EndIfIdle();
}

void DecodeCall::EndIfIdle() {
  {
    std::lock_guard lock(mu_);
    if (!reading_ || finished_) return;
    finished_ = true;
    session_.reset();  // the cache is freed now
  }
  // The read waiting ends (not ok) and finds the stream finished.
  Finish(ToGrpcStatus(ShuttingDown()));
}

void DecodeCall::OnReadDone(bool ok) {
  {
    std::lock_guard lock(mu_);  // the last answer's writes (any thread), before this read's
    reading_ = false;
    // Finished by a drain while this read was completing: the message is not taken.
    if (finished_) return;
  }
  if (!ok) {
    // The client closed its side (the session's normal end) or the stream broke.
    End(grpc::Status::OK);
    return;
  }
  // Nothing may escape to gRPC (out of memory decoding a message): the message would go
  // unanswered and the stream, with its session, would never finish.
  absl::Status parsed = core::Guarded("cannot read the message", absl::StatusCode::kInternal, [&] {
    return ParseStreamMessage(&request_bytes_, &request_);
  });
  if (!parsed.ok()) {
    Answer(parsed);
    return;
  }
  Take();
}

const std::string& DecodeCall::model() const {
  return session_model_.empty() ? request_.model() : session_model_;
}

void DecodeCall::Take() {
  if (!admission_->accepting()) {
    // Draining: the stream ends, so its client replays its sequence on another replica.
    admission_->SessionMessageAnswered(model(), ShuttingDown());
    End(ToGrpcStatus(ShuttingDown()));
    return;
  }
  const bool opening = session_ == nullptr;
  if (opening) {
    if (!OpenSession()) return;
  } else if (absl::Status s = DecodeNext(); !s.ok()) {
    Answer(s);
    return;
  }
  bool cancelled;
  {
    std::lock_guard lock(mu_);
    step_in_flight_ = true;
    first_step_ = opening;
    cancelled = cancelled_;
  }
  // Refused here or answered by its run, the message ends in StepDone; a stream cancelled
  // before its step waits (OnCancel found nothing to take back) does not run it.
  StepArgs args;
  absl::Status taken = cancelled
                           ? StreamEnded()
                           : core::Guarded("cannot take the message", absl::StatusCode::kInternal,
                                           [&] { return MakeStep(&args); });
  if (taken.ok()) {
    taken = session_->Step(std::move(args), [this](absl::Status status) { StepDone(status); });
  }
  if (!taken.ok()) {
    StepDone(taken);
    return;
  }
  // A cancel while the step was being queued found nothing to take back: it does now, if the
  // step still waits (its answer, on any thread, may have come already).
  std::shared_ptr<Session> session;
  {
    std::lock_guard lock(mu_);
    if (cancelled_ && step_in_flight_) session = session_;
  }
  if (session != nullptr) session->CancelStep(StreamEnded());
}

bool DecodeCall::OpenSession() {
  session_model_.clear();
  absl::StatusOr<core::AttentionKind> kind = KindFromProto(request_.kind());
  if (kind.ok() && !core::IsCausal(*kind)) {
    kind = absl::InvalidArgumentError(
        "a session's first message sets kind ATTENTION_KIND_CAUSAL or "
        "ATTENTION_KIND_CAUSAL_CROSS");
  }
  absl::Status s = kind.status();
  if (s.ok()) s = DecodeInput();
  const bool cross = kind.ok() && *kind == core::AttentionKind::kCausalCross;
  if (s.ok() && !cross && request_.context_lengths_size() > 0) {
    s = absl::InvalidArgumentError("a causal session takes no context (nor context_lengths)");
  }
  if (s.ok() && cross != HasTensor(request_.context())) {
    s = absl::InvalidArgumentError(cross ? "a causal_cross session's first message carries "
                                           "its context"
                                         : "a causal session takes no context");
  }
  core::RaggedBatch context;
  std::vector<float> context_copy;
  if (s.ok() && cross) {
    s = core::Guarded("cannot read the context", absl::StatusCode::kInternal, [&] {
      return DecodeTensorBatch(request_.context(), request_.context_lengths(), "context",
                               &context_copy, nullptr, &context);
    });
  }
  if (!s.ok()) {
    Answer(s);
    return false;
  }
  absl::StatusOr<std::unique_ptr<Session>> session = admission_->OpenSession(
      request_.model(), request_.version(), *kind, input_.batch(), cross ? &context : nullptr);
  if (!session.ok()) {
    // A message the client can correct is answered in the stream; a session that cannot be
    // had here (no such model, no room, shutting down) ends it.
    if (absl::IsInvalidArgument(session.status())) {
      Answer(session.status());
    } else {
      admission_->SessionMessageAnswered(request_.model(), session.status());
      End(ToGrpcStatus(session.status()));
    }
    return false;
  }
  session_ = *std::move(session);
  session_model_ = session_->model();
  return true;
}

absl::Status DecodeCall::DecodeNext() {
  if (!request_.model().empty() && request_.model() != session_->model()) {
    return absl::InvalidArgumentError(
        "model differs from the session's (set by its first message)");
  }
  if (request_.kind() != v1::ATTENTION_KIND_UNSPECIFIED &&
      KindFromProto(request_.kind()).value_or(core::AttentionKind::kBidirectional) !=
          session_->kind()) {
    return absl::InvalidArgumentError("kind differs from the session's (set by its first message)");
  }
  if (request_.version() != 0 &&
      static_cast<int64_t>(request_.version()) != session_->version()->version) {
    return absl::InvalidArgumentError(
        absl::StrCat("version ", request_.version(), " differs from the session's (",
                     session_->version()->version, ", set by its first message)"));
  }
  if (HasTensor(request_.context()) || !request_.context_lengths().empty()) {
    return absl::InvalidArgumentError("a session's context comes in its first message only");
  }
  return DecodeInput();
}

absl::Status DecodeCall::DecodeInput() {
  return core::Guarded("cannot read the input", absl::StatusCode::kInternal, [&] {
    return DecodeTensorBatch(request_.input(), request_.lengths(), "input", &input_copy_, &raw_,
                             &input_);
  });
}

absl::Status DecodeCall::MakeStep(StepArgs* args) {
  const core::Layer& layer = *session_->layer();
  if (absl::Status s = layer.ValidateBatch(input_, /*context=*/false, "input"); !s.ok()) return s;
  if (input_.batch() != session_->batch()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the session has ", session_->batch(), " sequences; this message has ", input_.batch()));
  }
  core::ForwardShapes shapes;
  shapes.output_rows = input_.rows();
  shapes.output_width = layer.spec().d_output();
  // The output, and a position (a varint of 10 bytes at most) for each sequence.
  const int64_t reply_bytes = ForwardReplyBytes(shapes) + 10 * input_.batch();
  if (absl::Status s = admission_->CheckReplyBytes(reply_bytes); !s.ok()) return s;
  absl::StatusOr<std::span<float>> output = SizeReplyTensor(
      OutputShape(input_, shapes), shapes.output_size(), raw_, response_.mutable_output());
  if (!output.ok()) return output.status();
  *args = MakeStepArgs(input_, *output, shapes.output_width);
  if (request_.has_truncate_to()) args->truncate_to = request_.truncate_to();
  return absl::OkStatus();
}

void DecodeCall::StepDone(const absl::Status& status) {
  bool cancelled;
  {
    std::lock_guard lock(mu_);
    step_in_flight_ = false;
    cancelled = cancelled_;
    // A refused or failed first message opens nothing: the session (and what it charged to the
    // budget) goes, so that the client's corrected first message opens it anew, with its own B.
    if (first_step_ && !status.ok()) session_.reset();
  }
  if (cancelled) {
    // Counted by what the server did, as every message: OK if it ran, CANCELLED if taken back.
    admission_->SessionMessageAnswered(model(), status);
    End(ToGrpcStatus(StreamEnded()));
    return;
  }
  Answer(status);
}

void DecodeCall::Answer(const absl::Status& status) {
  std::vector<int64_t> positions;
  if (session_ != nullptr) positions = session_->positions();
  grpc::Status serialized;
  {
    std::lock_guard lock(mu_);  // the answer (on any thread), before the next reaction's use
    admission_->SessionMessageAnswered(model(), status);
    if (!status.ok()) {
      response_.clear_output();
      response_.set_error_code(static_cast<int32_t>(status.code()));
      response_.set_error_message(std::string(status.message()));
    }
    for (int64_t position : positions) response_.add_positions(position);
    serialized = SerializeStreamMessage(response_, &response_bytes_);
  }
  if (!serialized.ok()) {
    End(serialized);
    return;
  }
  StartWrite(&response_bytes_);
}

void DecodeCall::OnWriteDone(bool ok) {
  {
    std::lock_guard lock(mu_);
    // Answered: a stream waiting for its next message holds its session's cache and nothing
    // else, not the last message's input and output (a prompt's can be hundreds of MB).
    response_bytes_.Clear();
    request_ = v1::DecodeRequest();
    response_ = v1::DecodeResponse();
    std::vector<float>().swap(input_copy_);
    input_ = core::RaggedBatch();
  }
  if (!ok) {
    End(grpc::Status::OK);
    return;
  }
  ReadNext();
}

void DecodeCall::ReadNext() {
  bool draining;
  {
    // One step with the flag: a drain stops accepting before its EndIfIdle takes the lock, so
    // either this sees the drain, or EndIfIdle sees reading_.
    std::lock_guard lock(mu_);
    if (finished_) return;
    draining = !admission_->accepting();
    reading_ = !draining;
  }
  if (draining) {
    End(ToGrpcStatus(ShuttingDown()));
    return;
  }
  // Within a reaction (OnWriteDone): a Finish by EndIfIdle meanwhile fails this read, and
  // OnDone waits for the reaction's end.
  StartRead(&request_bytes_);
}

void DecodeCall::OnCancel() {
  std::shared_ptr<Session> session;
  {
    std::lock_guard lock(mu_);
    cancelled_ = true;
    if (step_in_flight_) session = session_;
  }
  // A queued step comes back at once (StepDone then ends the stream); a running one when the
  // chunk it is computing ends.
  if (session != nullptr) session->CancelStep(StreamEnded());
}

void DecodeCall::End(const grpc::Status& status) {
  {
    std::lock_guard lock(mu_);
    if (finished_) return;
    if (step_in_flight_) {
      cancelled_ = true;  // StepDone ends the stream
      return;
    }
    finished_ = true;
    session_.reset();  // the cache is freed now, not when gRPC lets go of the call
  }
  Finish(status);
}

void DecodeCall::OnDone() {
  // Finish (perhaps on the compute thread) comes before OnDone inside gRPC, out of a thread
  // sanitizer's sight; the lock makes that order visible to it too.
  { std::lock_guard lock(mu_); }
  streams_->Remove(this);
  delete this;
}

}  // namespace attnserve::server
