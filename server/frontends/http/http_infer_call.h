#pragma once

#include <condition_variable>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "server/frontends/http/http_exchange.h"
#include "server/frontends/http/infer_json.h"
#include "server/serving/job.h"

namespace attnserve::server {

// The limits a REST inference call is read under.
struct HttpBodyLimits {
  int64_t max_bytes = 64 << 20;                          // --max-message-mib
  Clock::duration read_time = std::chrono::seconds(10);  // the whole body, from its start
};

// One REST inference call as admission sees it. The model comes from the path; the body is
// read from the connection only in Decode, so a call refused before it (shutting down, no such
// model, full queue, deadline) costs no body read and no parse. The connection's thread waits
// (Wait) for Finish, then writes the reply itself: the compute thread only signals.
class HttpInferCall final : public Job {
 public:
  HttpInferCall(HttpExchange* exchange, std::string model, std::string version,
                Clock::time_point arrival, Clock::time_point deadline, HttpBodyLimits limits)
      : Job(arrival, deadline),
        exchange_(exchange),
        model_(std::move(model)),
        version_(std::move(version)),
        limits_(limits) {}

  absl::StatusOr<absl::string_view> RequestedModel() override;
  absl::Status Decode() override;
  const core::ForwardArgs& args() const override { return decoded_.args; }
  int64_t ReplyBytes(const core::ForwardShapes& shapes) const override;
  absl::StatusOr<ForwardBuffers> Buffers(const core::ForwardShapes& shapes) override;
  uint64_t RequestedVersion() const override { return version_number_; }
  // The version that computed the reply (valid once answered OK).
  int64_t computed_by() const { return computed_by_; }
  void Finish(const absl::Status& status) override;

  // Blocks until Finish; tells the queue the caller is gone once its deadline passes. The
  // call's status.
  absl::Status Wait();

  // True when Decode read the body (the connection may stay open after the reply).
  bool body_read() const { return body_read_; }

  const DecodedHttpInfer& decoded() const { return decoded_; }

 private:
  HttpExchange* const exchange_;
  const std::string model_, version_;
  uint64_t version_number_ = 0;  // version_ read by RequestedModel; 0: the newest ready one
  int64_t computed_by_ = 0;      // the version whose weights computed the reply
  const HttpBodyLimits limits_;
  HttpBody body_;
  bool body_read_ = false;
  DecodedHttpInfer decoded_;
  std::mutex mu_;
  std::condition_variable done_cv_;
  bool done_ = false;    // guarded by mu_
  absl::Status status_;  // guarded by mu_
};

}  // namespace attnserve::server
