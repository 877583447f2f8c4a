#include "server/frontends/http/http_infer_call.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "server/frontends/oip/infer_codec.h"
#include "server/observability/logging.h"

namespace attnserve::server {
namespace {

constexpr char kHeaderLength[] = "Inference-Header-Content-Length";

// The JSON part's length of a binary request, -1 for an all-JSON one.
absl::StatusOr<int64_t> JsonLength(const HttpExchange& exchange) {
  const std::optional<absl::string_view> header = exchange.Header(kHeaderLength);
  if (!header.has_value()) return -1;
  int64_t length = 0;
  if (!absl::SimpleAtoi(*header, &length) || length < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kHeaderLength, " must be a byte count, got '", Clipped(*header), "'"));
  }
  return length;
}

}  // namespace

absl::StatusOr<HttpInferBody> ReadInferBody(HttpExchange& exchange, const HttpBodyLimits& limits) {
  absl::StatusOr<int64_t> json_length = JsonLength(exchange);
  if (!json_length.ok()) return json_length.status();
  HttpInferBody body;
  body.json_length = *json_length;
  absl::Status read = exchange.ReadBody(limits, kJsonPadding, &body.body);
  if (!read.ok()) return read;
  return body;
}

absl::StatusOr<absl::string_view> HttpInferCall::RequestedModel() {
  absl::StatusOr<uint64_t> version = ParseModelVersion(version_);
  if (!version.ok()) return version.status();
  version_number_ = *version;
  return absl::string_view(model_);
}

absl::Status HttpInferCall::DecodeBody() {
  if (!read_.ok()) return read_;
  if (!decode_status_.has_value()) {
    const std::string& bytes = body_.body.bytes;
    decode_status_ = DecodeHttpInfer(bytes, bytes.capacity(), body_.json_length, &decoded_);
  }
  return *decode_status_;
}

absl::Status HttpInferCall::Decode() {
  if (absl::Status s = DecodeBody(); !s.ok()) return s;
  if (decoded_.sequence.has_value()) {
    // A sequence step is told by its raw text (IsSequenceStep): a name written with escapes
    // would be served as a one-shot call, its sequence dropped.
    return absl::InvalidArgumentError(
        "write the sequence parameters' names without escapes (sequence_id, sequence_start, "
        "sequence_end)");
  }
  return absl::OkStatus();
}

bool HttpInferCall::IsSequenceStep() {
  const absl::string_view bytes = body_.body.bytes;
  const absl::string_view json =
      body_.json_length >= 0 ? bytes.substr(0, body_.json_length) : bytes;
  if (!read_.ok() || json.find(kSequenceIdParameter) == absl::string_view::npos) return false;
  return !DecodeBody().ok() || decoded_.sequence.has_value();
}

int64_t HttpInferCall::ReplyBytes(const core::ForwardShapes& shapes) const {
  return HttpReplyBytes(decoded_, shapes) + static_cast<int64_t>(model_.size());
}

absl::StatusOr<ForwardBuffers> HttpInferCall::Buffers(const core::ForwardShapes& shapes) {
  computed_by_ = version().version;  // the reply names it; the call lets go of it when answered
  return PrepareHttpOutputs(shapes, &decoded_);
}

void HttpInferCall::Finish(const absl::Status& status) {
  std::lock_guard lock(mu_);
  status_ = status;
  done_ = true;
  late_ = Clock::now() >= deadline();
  done_cv_.notify_one();
}

absl::Status HttpInferCall::Wait() {
  // The queue answers a call whose caller is gone at once; a running one finishes.
  return Wait([this] { CallerGone(); }, "the deadline passed while the call computed");
}

absl::Status HttpInferCall::Wait(const std::function<void()>& at_deadline, absl::string_view late) {
  std::unique_lock lock(mu_);
  if (!done_cv_.wait_until(lock, deadline(), [this] { return done_; })) {
    lock.unlock();
    at_deadline();
    lock.lock();
    done_cv_.wait(lock, [this] { return done_; });
  }
  // Finished after its deadline (however soon this thread came to wait; always so when it
  // outlived the wait): answered as too late all the same, as gRPC's deadline is.
  if (status_.ok() && late_) return absl::DeadlineExceededError(late);
  return status_;
}

}  // namespace attnserve::server
