#pragma once

// Decode sessions through the Open Inference Protocol, as Triton's sequence batcher keys them:
// a ModelInferRequest with the parameter `sequence_id` (uint64 or string) is a step of that
// sequence's session; `sequence_start` opens it (the first step, with its kind and, for
// causal_cross, its context), `sequence_end` ends it after the step. The same steps come on
// ModelInfer one call each, or on one ModelStreamInfer stream.

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/frontends/oip/infer_codec.h"
#include "server/serving/admission.h"
#include "server/serving/sequence_table.h"

namespace attnserve::server {

// A request's sequence parameters.
struct SequenceParams {
  std::string id;  // the sequence_id's value, as text
  bool start = false;
  bool end = false;
};

// The sequence parameters of `request`: none without `sequence_id`; InvalidArgument for a
// sequence_id that is not a uint64 or a string, or flags that are not bools.
absl::StatusOr<std::optional<SequenceParams>> ReadSequenceParams(
    const inference::ModelInferRequest& request);

// One step of a sequence from a ModelInferRequest: decoded, its session found (or opened),
// computed, and answered through `done` with `response` filled. `request` and `response`
// outlive the step.
class SequenceStep {
 public:
  SequenceStep(Admission* admission, SequenceTable* table,
               const inference::ModelInferRequest* request, SequenceParams params,
               inference::ModelInferResponse* response);

  // Runs the step; `done` runs once with its status, on this thread when the step is refused,
  // else on the compute thread.
  void Run(std::function<void(absl::Status)> done);

 private:
  absl::StatusOr<std::shared_ptr<Session>> SessionFor();

  Admission* const admission_;
  SequenceTable* const table_;
  const inference::ModelInferRequest* const request_;
  const SequenceParams params_;
  inference::ModelInferResponse* const response_;
  DecodedInfer decoded_;
  std::shared_ptr<Session> session_;  // held until the step is answered
};

// Triton's ModelStreamInfer: one stream of sequence steps, answered in order, each failure as
// the response's error_message with the stream open.
class StreamInferCall final : public grpc::ServerBidiReactor<inference::ModelInferRequest,
                                                             inference::ModelStreamInferResponse> {
 public:
  StreamInferCall(Admission* admission, SequenceTable* table);

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnDone() override { delete this; }

 private:
  void Answer(const absl::Status& status);

  Admission* const admission_;
  SequenceTable* const table_;
  inference::ModelInferRequest request_;
  inference::ModelStreamInferResponse response_;
  std::unique_ptr<SequenceStep> step_;
};

// ModelInfer for a sequence step: a unary call answered when the step has run.
class SequenceInferCall final : public grpc::ServerUnaryReactor {
 public:
  // Takes the parsed request; answers into `response_bytes` when the step has run.
  SequenceInferCall(Admission* admission, SequenceTable* table,
                    std::unique_ptr<inference::ModelInferRequest> request, SequenceParams params,
                    grpc::ByteBuffer* response_bytes);

  void OnDone() override { delete this; }

 private:
  std::unique_ptr<inference::ModelInferRequest> request_;
  inference::ModelInferResponse response_;
  grpc::ByteBuffer* const response_bytes_;
  SequenceStep step_;
};

}  // namespace attnserve::server
