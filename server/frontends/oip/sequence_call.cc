#include "server/frontends/oip/sequence_call.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "server/frontends/grpc_status.h"
#include "server/frontends/tensor_codec.h"
#include "server/observability/logging.h"

namespace attnserve::server {
namespace {

using inference::InferParameter;

constexpr char kSequenceId[] = "sequence_id";
constexpr char kSequenceStart[] = "sequence_start";
constexpr char kSequenceEnd[] = "sequence_end";

// A bool parameter, false when absent.
absl::StatusOr<bool> BoolParameter(const inference::ModelInferRequest& request, const char* name) {
  const auto it = request.parameters().find(name);
  if (it == request.parameters().end()) return false;
  if (it->second.parameter_choice_case() != InferParameter::kBoolParam) {
    return absl::InvalidArgumentError(absl::StrCat("parameter '", name, "' must be a bool_param"));
  }
  return it->second.bool_param();
}

}  // namespace

absl::StatusOr<std::optional<SequenceParams>> ReadSequenceParams(
    const inference::ModelInferRequest& request) {
  const auto it = request.parameters().find(kSequenceId);
  if (it == request.parameters().end()) return std::nullopt;
  SequenceParams params;
  switch (it->second.parameter_choice_case()) {
    case InferParameter::kUint64Param:
      params.id = absl::StrCat(it->second.uint64_param());
      break;
    case InferParameter::kInt64Param:
      params.id = absl::StrCat(it->second.int64_param());
      break;
    case InferParameter::kStringParam:
      params.id = absl::StrCat("'", it->second.string_param(), "'");
      break;
    default:
      return absl::InvalidArgumentError("parameter 'sequence_id' must be a uint64 or a string");
  }
  absl::StatusOr<bool> start = BoolParameter(request, kSequenceStart);
  if (!start.ok()) return start.status();
  absl::StatusOr<bool> end = BoolParameter(request, kSequenceEnd);
  if (!end.ok()) return end.status();
  params.start = *start;
  params.end = *end;
  return params;
}

SequenceStep::SequenceStep(Admission* admission, SequenceTable* table,
                           const inference::ModelInferRequest* request, SequenceParams params,
                           inference::ModelInferResponse* response)
    : admission_(admission),
      table_(table),
      request_(request),
      params_(std::move(params)),
      response_(response) {}

absl::StatusOr<std::shared_ptr<Session>> SequenceStep::SessionFor() {
  core::ForwardArgs& args = decoded_.args;
  if (!params_.start) {
    if (args.context) {
      return absl::InvalidArgumentError("a sequence's context comes with sequence_start only");
    }
    return table_->Find(params_.id);
  }
  // A sequence is causal unless it says causal_cross: Triton's clients send no kind.
  if (!request_->parameters().contains(kInferKindParameter)) {
    args.kind = args.context ? core::AttentionKind::kCausalCross : core::AttentionKind::kCausal;
  }
  absl::StatusOr<uint64_t> version = ParseModelVersion(request_->model_version());
  if (!version.ok()) return version.status();
  absl::StatusOr<std::unique_ptr<Session>> opened =
      admission_->OpenSession(request_->model_name(), *version, args.kind, args.input.batch(),
                              args.context ? &*args.context : nullptr);
  if (!opened.ok()) return opened.status();
  if (args.context) {
    absl::Status valid = (*opened)->layer()->ValidateBatch(*args.context, true, "context");
    if (!valid.ok()) return valid;
  }
  std::shared_ptr<Session> session = *std::move(opened);
  table_->Start(params_.id, session);
  return session;
}

void SequenceStep::Run(std::function<void(absl::Status)> done) {
  if (!admission_->accepting()) return done(absl::UnavailableError("the server is shutting down"));
  if (absl::Status s = DecodeInferRequest(*request_, &decoded_); !s.ok()) return done(s);
  absl::StatusOr<std::shared_ptr<Session>> session = SessionFor();
  if (!session.ok()) return done(session.status());
  session_ = *std::move(session);
  const core::Layer& layer = *session_->layer();
  if (absl::Status s = layer.ValidateBatch(decoded_.args.input, false, "input"); !s.ok()) {
    return done(s);
  }
  core::ForwardShapes shapes;
  shapes.output_rows = decoded_.args.input.rows();
  shapes.output_width = layer.spec().d_output();
  absl::StatusOr<ForwardBuffers> buffers =
      PrepareInferResponse(*request_, &decoded_, shapes, session_->version()->version, response_);
  if (!buffers.ok()) return done(buffers.status());
  StepArgs args = MakeStepArgs(decoded_.args.input, buffers->output, shapes.output_width);
  const bool end = params_.end;
  const std::string id = params_.id;
  SequenceTable* table = table_;
  absl::Status refused =
      session_->Step(std::move(args), [this, end, id, table, done](absl::Status status) {
        // The sequence ends once its last step is answered; its cache goes with it.
        session_.reset();
        if (end) table->End(id);
        done(status);
      });
  if (!refused.ok()) done(refused);
}

StreamInferCall::StreamInferCall(Admission* admission, SequenceTable* table)
    : admission_(admission), table_(table) {
  StartRead(&request_);
}

void StreamInferCall::OnReadDone(bool ok) {
  if (!ok) {
    Finish(grpc::Status::OK);
    return;
  }
  response_.Clear();
  absl::StatusOr<std::optional<SequenceParams>> params = ReadSequenceParams(request_);
  if (params.ok() && !params->has_value()) {
    params = absl::InvalidArgumentError(
        "ModelStreamInfer serves sequences: send the sequence_id parameter (or call ModelInfer)");
  }
  if (!params.ok()) {
    Answer(params.status());
    return;
  }
  step_ = std::make_unique<SequenceStep>(admission_, table_, &request_, **params,
                                         response_.mutable_infer_response());
  step_->Run([this](absl::Status status) { Answer(status); });
}

void StreamInferCall::Answer(const absl::Status& status) {
  if (!status.ok()) {
    response_.clear_infer_response();
    response_.set_error_message(
        absl::StrCat(absl::StatusCodeToString(status.code()), ": ", status.message()));
  }
  StartWrite(&response_);
}

void StreamInferCall::OnWriteDone(bool ok) {
  step_.reset();
  if (!ok) {
    Finish(grpc::Status::OK);
    return;
  }
  StartRead(&request_);
}

SequenceInferCall::SequenceInferCall(Admission* admission, SequenceTable* table,
                                     std::unique_ptr<inference::ModelInferRequest> request,
                                     SequenceParams params, grpc::ByteBuffer* response_bytes)
    : request_(std::move(request)),
      response_bytes_(response_bytes),
      step_(admission, table, request_.get(), std::move(params), &response_) {
  step_.Run([this](absl::Status status) {
    grpc::Status reply = ToGrpcStatus(status);
    if (status.ok()) {
      bool own_buffer = false;
      reply = grpc::SerializationTraits<inference::ModelInferResponse>::Serialize(
          response_, response_bytes_, &own_buffer);
    }
    Finish(reply);
  });
}

}  // namespace attnserve::server
