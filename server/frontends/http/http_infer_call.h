#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "server/frontends/http/http_exchange.h"
#include "server/frontends/http/infer_json.h"
#include "server/serving/job.h"

namespace attnserve::server {

// A REST inference request's body: JSON, or (json_length >= 0) JSON then binary tensors.
struct HttpInferBody {
  HttpBody body;
  int64_t json_length = -1;  // Inference-Header-Content-Length
};

// Reads an inference request's body under `limits`, with kJsonPadding spare bytes for the
// parser: InvalidArgument for a bad Inference-Header-Content-Length, else the read's status.
absl::StatusOr<HttpInferBody> ReadInferBody(HttpExchange& exchange, const HttpBodyLimits& limits);

// One REST inference call as admission sees it. The model comes from the path, the body has
// been read (or failed to be: Decode then refuses the call with that error, so that admission
// counts it); it is parsed only in Decode, so a call refused before it (shutting down, no such
// model, full queue, deadline) costs no parse. The connection's thread waits (Wait) for Finish,
// then writes the reply itself: the compute thread only signals.
class HttpInferCall final : public Job {
 public:
  HttpInferCall(std::string model, std::string version, absl::StatusOr<HttpInferBody> body,
                Clock::time_point arrival, Clock::time_point deadline)
      : Job(arrival, deadline),
        model_(std::move(model)),
        version_(std::move(version)),
        read_(body.status()),
        body_(body.ok() ? *std::move(body) : HttpInferBody{}) {}

  absl::StatusOr<absl::string_view> RequestedModel() override;
  // Decodes the body as a one-shot call.
  absl::Status Decode() override;
  const core::ForwardArgs& args() const override { return decoded_.args; }
  int64_t ReplyBytes(const core::ForwardShapes& shapes) const override;
  absl::StatusOr<ForwardBuffers> Buffers(const core::ForwardShapes& shapes) override;
  uint64_t RequestedVersion() const override { return version_number_; }
  CallProtocol protocol() const override { return CallProtocol::kHttp; }
  // The version that computed the reply (valid once answered OK).
  int64_t computed_by() const { return computed_by_; }
  void Finish(const absl::Status& status) override;

  // Blocks until Finish; tells the queue the caller is gone once its deadline passes. The
  // call's status; DeadlineExceeded for a call that finished after its deadline.
  absl::Status Wait();
  // The same for work other than admission's queue (a sequence step that Finishes the call):
  // `at_deadline` takes it back if it can; finished OK after the deadline, DeadlineExceeded
  // saying `late`.
  absl::Status Wait(const std::function<void()>& at_deadline, absl::string_view late);

  // Decodes the body now if it may be a sequence step (its JSON names sequence_id, as
  // HasSequenceId looks in a gRPC request): true when it is one, to be run as a step instead of
  // admitted. A body that names sequence_id and does not decode is one too, refused as a step
  // (DecodeBody) with the body's error, not queued behind calls to be refused later.
  bool IsSequenceStep();
  // Parses the body once (the read's error, if it failed); later calls return the same status.
  absl::Status DecodeBody();

  // A sequence step's reply is computed by `version`.
  void set_computed_by(int64_t version) { computed_by_ = version; }

  DecodedHttpInfer& decoded() { return decoded_; }

 private:
  const std::string model_, version_;
  uint64_t version_number_ = 0;  // version_ read by RequestedModel; 0: the newest ready one
  int64_t computed_by_ = 0;      // the version whose weights computed the reply
  const absl::Status read_;      // reading the body
  HttpInferBody body_;
  std::optional<absl::Status> decode_status_;  // set once the body is decoded
  DecodedHttpInfer decoded_;
  std::mutex mu_;
  std::condition_variable done_cv_;
  bool done_ = false;    // guarded by mu_
  bool late_ = false;    // guarded by mu_: Finish came after the deadline
  absl::Status status_;  // guarded by mu_
};

}  // namespace attnserve::server
