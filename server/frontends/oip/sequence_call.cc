#include "server/frontends/oip/sequence_call.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/guarded.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "server/frontends/grpc_status.h"
#include "server/frontends/raw_call.h"

namespace attnserve::server {
namespace {

using inference::InferParameter;

// A bool parameter, false when absent.
absl::StatusOr<bool> BoolParameter(const inference::ModelInferRequest& request, const char* name) {
  const auto it = request.parameters().find(name);
  if (it == request.parameters().end()) return false;
  if (it->second.parameter_choice_case() != InferParameter::kBoolParam) {
    return absl::InvalidArgumentError(absl::StrCat("parameter '", name, "' must be a bool_param"));
  }
  return it->second.bool_param();
}

// What a caller that left is told of a step that waited for its turn.
absl::Status StepWithdrawn() {
  return absl::CancelledError(
      "the call ended while the step waited for its turn: the sequence is unchanged");
}

}  // namespace

absl::StatusOr<std::optional<SequenceParams>> ReadSequenceParams(
    const inference::ModelInferRequest& request) {
  const auto it = request.parameters().find(kSequenceIdParameter);
  if (it == request.parameters().end()) return std::nullopt;
  SequenceParams params;
  switch (it->second.parameter_choice_case()) {
    case InferParameter::kUint64Param:
      params.id = absl::StrCat(it->second.uint64_param());
      break;
    case InferParameter::kInt64Param:
      if (it->second.int64_param() < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("parameter 'sequence_id' must be a uint64 or a string, not ",
                         it->second.int64_param()));
      }
      params.id = absl::StrCat(it->second.int64_param());
      break;
    case InferParameter::kStringParam:
      params.id = absl::StrCat("'", it->second.string_param(), "'");
      break;
    default:
      return absl::InvalidArgumentError("parameter 'sequence_id' must be a uint64 or a string");
  }
  absl::StatusOr<bool> start = BoolParameter(request, kSequenceStartParameter);
  if (!start.ok()) return start.status();
  absl::StatusOr<bool> end = BoolParameter(request, kSequenceEndParameter);
  if (!end.ok()) return end.status();
  params.start = *start;
  params.end = *end;
  return params;
}

ProtoSequenceStep::ProtoSequenceStep(Admission* admission, SequenceTable* table,
                                     const inference::ModelInferRequest* request,
                                     SequenceParams params, inference::ModelInferResponse* response)
    : request_(request), response_(response), step_(admission, table) {
  step_request_.model = request->model_name();
  step_request_.version = request->model_version();
  step_request_.params = std::move(params);
  step_request_.kind_given = request->parameters().contains(kInferKindParameter);
  step_request_.args = &decoded_.args;
  step_request_.reply_bytes = [this](const core::ForwardShapes& shapes) {
    return InferReplyBytes(*request_, shapes);
  };
  step_request_.prepare = [this](const core::ForwardShapes& shapes, int64_t version) {
    return PrepareInferResponse(*request_, &decoded_, shapes, version, response_);
  };
}

void ProtoSequenceStep::Run(std::function<void(absl::Status)> done) {
  // Nothing may escape to gRPC: a stream's message would go unanswered (as Admission guards a
  // one-shot call's decoding).
  absl::Status s = core::Guarded("cannot take the step", absl::StatusCode::kInternal,
                                 [&] { return DecodeInferRequest(*request_, &decoded_); });
  if (!s.ok()) return done(s);
  step_.Run(step_request_, std::move(done));
}

StreamInferCall::StreamInferCall(Admission* admission, SequenceTable* table, OpenStreams* streams)
    : admission_(admission), table_(table), streams_(streams) {
  {
    std::lock_guard lock(mu_);  // the members' construction, before any reaction
    reading_ = true;
  }
  StartRead(&request_bytes_);
  streams_->Add(this);
  // A drain that began before it joined (its EndIdle passed it by) ends it too.
  if (!admission_->accepting()) EndIfIdle();
}

void StreamInferCall::EndIfIdle() {
  {
    std::lock_guard lock(mu_);
    if (!reading_ || finished_) return;
    finished_ = true;
  }
  // The read waiting ends (not ok) and finds the stream finished.
  Finish(ToGrpcStatus(ShuttingDown()));
}

void StreamInferCall::End(const grpc::Status& status) {
  {
    std::lock_guard lock(mu_);
    if (finished_) return;
    finished_ = true;
  }
  Finish(status);
}

void StreamInferCall::OnReadDone(bool ok) {
  {
    std::lock_guard lock(mu_);  // the last answer's writes (any thread), before this read's
    reading_ = false;
    // Finished by a drain while this read was completing: the message is not taken.
    if (finished_) return;
  }
  if (!ok) {
    End(grpc::Status::OK);
    return;
  }
  if (absl::Status s = ParseStreamMessage(&request_bytes_, &request_); !s.ok()) {
    Answer(s);
    return;
  }
  absl::StatusOr<std::optional<SequenceParams>> params = ReadSequenceParams(request_);
  if (params.ok() && !params->has_value()) {
    params = absl::InvalidArgumentError(
        "ModelStreamInfer serves sequences: send the sequence_id parameter (or call ModelInfer)");
  }
  if (!params.ok()) {
    Answer(params.status());
    return;
  }
  std::shared_ptr<ProtoSequenceStep> step;  // held: its answer may end step_'s hold at once
  {
    std::lock_guard lock(mu_);
    step_ = std::make_shared<ProtoSequenceStep>(admission_, table_, &request_, **params,
                                                response_.mutable_infer_response());
    step = step_;
  }
  step->Run([this](absl::Status status) { Answer(status); });
  // A cancel that came before the step waited (OnCancel found nothing to take back) takes it
  // back now, if it waits.
  bool cancelled;
  {
    std::lock_guard lock(mu_);
    cancelled = cancelled_;
  }
  if (cancelled) step->Cancel(StepWithdrawn());
}

void StreamInferCall::Answer(const absl::Status& status) {
  grpc::Status serialized;
  {
    std::lock_guard lock(mu_);  // the step's answer (any thread) before the next read's Clear
    admission_->SessionMessageAnswered(step_ != nullptr ? step_->model() : request_.model_name(),
                                       status);
    if (!status.ok()) {
      // The request's id, as on a success (and as Triton does), so that a client matching
      // answers by id knows which request failed; empty when the message did not parse.
      response_.clear_infer_response();
      response_.mutable_infer_response()->set_id(request_.id());
      response_.set_error_message(
          absl::StrCat(absl::StatusCodeToString(status.code()), ": ", status.message()));
    }
    serialized = SerializeStreamMessage(response_, &response_bytes_);
  }
  if (!serialized.ok()) {
    End(serialized);
    return;
  }
  StartWrite(&response_bytes_);
}

void StreamInferCall::OnWriteDone(bool ok) {
  {
    std::lock_guard lock(mu_);
    // Answered: a stream waiting for its next message holds its sessions' caches and nothing
    // else, not the last message's tensors.
    step_.reset();
    response_bytes_.Clear();
    request_ = inference::ModelInferRequest();
    response_ = inference::ModelStreamInferResponse();
  }
  if (!ok) {
    End(grpc::Status::OK);
    return;
  }
  bool draining;
  {
    // Draining: the stream ends after its answer. One step with the flag: a drain stops
    // accepting before its EndIfIdle takes the lock, so either this sees the drain, or
    // EndIfIdle sees reading_.
    std::lock_guard lock(mu_);
    if (finished_) return;
    draining = !admission_->accepting();
    reading_ = !draining;
  }
  if (draining) {
    End(ToGrpcStatus(ShuttingDown()));
    return;
  }
  // Within a reaction: a Finish by EndIfIdle meanwhile fails this read, and OnDone waits for
  // the reaction's end.
  StartRead(&request_bytes_);
}

void StreamInferCall::OnCancel() {
  std::shared_ptr<ProtoSequenceStep> step;
  {
    std::lock_guard lock(mu_);
    cancelled_ = true;
    step = step_;
  }
  if (step != nullptr) step->Cancel(StepWithdrawn());
}

void StreamInferCall::OnDone() {
  { std::lock_guard lock(mu_); }
  streams_->Remove(this);
  delete this;
}

SequenceInferCall::SequenceInferCall(Admission* admission, SequenceTable* table,
                                     std::unique_ptr<inference::ModelInferRequest> request,
                                     SequenceParams params, grpc::ByteBuffer* response_bytes)
    : request_(std::move(request)),
      response_bytes_(response_bytes),
      step_(admission, table, request_.get(), std::move(params), &response_) {
  { std::lock_guard lock(mu_); }  // the members' construction, before OnDone
  step_.Run([this, admission](absl::Status status) {
    admission->SessionMessageAnswered(step_.model(), status);
    grpc::Status reply = ToGrpcStatus(status);
    if (status.ok()) {
      bool own_buffer = false;
      reply = grpc::SerializationTraits<inference::ModelInferResponse>::Serialize(
          response_, response_bytes_, &own_buffer);
    }
    { std::lock_guard lock(mu_); }  // the reply's writes, before OnDone
    Finish(reply);
  });
}

void SequenceInferCall::OnCancel() { step_.Cancel(StepWithdrawn()); }

void SequenceInferCall::OnDone() {
  { std::lock_guard lock(mu_); }
  delete this;
}

}  // namespace attnserve::server
