#pragma once

// Decode sessions through the Open Inference Protocol's gRPC form (sequence_step.h says how a
// sequence is keyed): the same steps come on ModelInfer one call each, or on one
// ModelStreamInfer stream.

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/frontends/oip/infer_codec.h"
#include "server/frontends/oip/sequence_step.h"
#include "server/frontends/open_streams.h"
#include "server/serving/admission.h"
#include "server/serving/sequence_table.h"

namespace attnserve::server {

// The sequence parameters of `request`: none without `sequence_id`; InvalidArgument for a
// sequence_id that is not a uint64 or a string, or flags that are not bools.
absl::StatusOr<std::optional<SequenceParams>> ReadSequenceParams(
    const inference::ModelInferRequest& request);

// A sequence step from a ModelInferRequest: decoded, then run by SequenceStep, answered
// through `done` with `response` filled. `request` and `response` outlive the step.
class ProtoSequenceStep {
 public:
  ProtoSequenceStep(Admission* admission, SequenceTable* table,
                    const inference::ModelInferRequest* request, SequenceParams params,
                    inference::ModelInferResponse* response);

  // Runs the step; `done` runs once with its status, on this thread when the step is refused
  // or ran inline (Session::Step), else on the compute thread.
  void Run(std::function<void(absl::Status)> done);

  // The caller left: SequenceStep::Cancel.
  void Cancel(const absl::Status& why) { step_.Cancel(why); }

  // SequenceStep::model; the request's model if it was refused before SequenceStep saw it.
  const std::string& model() const {
    return step_.model().empty() ? request_->model_name() : step_.model();
  }

 private:
  const inference::ModelInferRequest* const request_;
  inference::ModelInferResponse* const response_;
  DecodedInfer decoded_;
  SequenceRequest step_request_;
  SequenceStep step_;
};

// Triton's ModelStreamInfer: one stream of sequence steps, answered in order, each failure (a
// message that is not a ModelInferRequest too) as the response's error_message with the stream
// open.
class StreamInferCall final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                              public DrainableStream {
 public:
  // Starts reading, and joins `streams` (which outlives the call).
  StreamInferCall(Admission* admission, SequenceTable* table, OpenStreams* streams);

  // Draining: ends the stream UNAVAILABLE while it waits for a message (its sequences stay,
  // until their idle timeout or the server's end); one serving a message ends after its answer.
  void EndIfIdle() override;
  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  // The stream ended (cancel, deadline, disconnect): a step waiting its turn is taken back.
  void OnCancel() override;
  void OnDone() override;

 private:
  void Answer(const absl::Status& status);
  // Finishes the stream, once.
  void End(const grpc::Status& status);

  Admission* const admission_;
  SequenceTable* const table_;
  OpenStreams* const streams_;
  grpc::ByteBuffer request_bytes_;
  grpc::ByteBuffer response_bytes_;
  inference::ModelInferRequest request_;
  inference::ModelStreamInferResponse response_;
  // gRPC orders the reactions (the constructor, each read and write, OnDone) inside itself, out
  // of a thread sanitizer's sight; each takes this lock so that the order is visible to it too.
  std::mutex mu_;
  // Guarded by mu_; shared with OnCancel, which cancels it outside the lock (its answer takes
  // the lock) while the answer may end it.
  std::shared_ptr<ProtoSequenceStep> step_;
  bool cancelled_ = false;  // guarded by mu_: OnCancel came (it may come before a step waits)
  bool reading_ = false;    // guarded by mu_: waiting for the client's next message
  bool finished_ = false;   // guarded by mu_
};

// ModelInfer for a sequence step: a unary call answered when the step has run.
class SequenceInferCall final : public grpc::ServerUnaryReactor {
 public:
  // Takes the parsed request; answers into `response_bytes` when the step has run.
  SequenceInferCall(Admission* admission, SequenceTable* table,
                    std::unique_ptr<inference::ModelInferRequest> request, SequenceParams params,
                    grpc::ByteBuffer* response_bytes);

  // The call was cancelled or its deadline passed: a step waiting its turn is taken back.
  void OnCancel() override;
  void OnDone() override;

 private:
  // As StreamInferCall's: the constructor (which may answer the step inline) and OnDone run on
  // threads gRPC orders out of a thread sanitizer's sight; both take this lock.
  std::mutex mu_;
  std::unique_ptr<inference::ModelInferRequest> request_;
  inference::ModelInferResponse response_;
  grpc::ByteBuffer* const response_bytes_;
  ProtoSequenceStep step_;
};

}  // namespace attnserve::server
