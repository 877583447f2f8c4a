#include "client/decode_session.h"

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/support/client_callback.h"

namespace attnserve::client {

// The stream's callbacks, turned into waits: a step writes and reads, then waits for both.
// A hold keeps OnDone from running between steps, so a step can always start its operations.
class DecodeSession::Reactor final
    : public grpc::ClientBidiReactor<v1::DecodeRequest, v1::DecodeResponse> {
 public:
  void OnWriteDone(bool ok) override {
    std::unique_lock lock(mu_);
    write_pending_ = false;
    write_ok_ = ok;
    Exchanged(lock);
  }
  void OnReadDone(bool ok) override {
    std::unique_lock lock(mu_);
    read_pending_ = false;
    read_ok_ = ok;
    Exchanged(lock);
  }
  void OnWritesDoneDone(bool /*ok*/) override {}
  void OnDone(const grpc::Status& status) override {
    std::unique_lock lock(mu_);
    done_ = true;
    status_ = status;
    cv_.notify_all();
    std::function<void(const grpc::Status&)> ended = std::move(ended_);
    lock.unlock();
    // The last use of this object here: `ended` may let its owner destroy it.
    if (ended) ended(status);
  }

  // Writes `request`, reads into `response`; false when the stream broke or `timeout` passed
  // (then `timed_out`), after which the stream is cancelled.
  bool Exchange(const v1::DecodeRequest& request, v1::DecodeResponse* response,
                absl::Duration timeout, bool* timed_out) {
    StartExchange(request, response, nullptr);
    std::unique_lock lock(mu_);
    auto finished = [&] { return !write_pending_ && !read_pending_; };
    *timed_out = false;
    if (timeout == absl::InfiniteDuration()) {
      cv_.wait(lock, finished);
    } else if (!cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout), finished)) {
      *timed_out = true;
      lock.unlock();
      context_.TryCancel();
      lock.lock();
      cv_.wait(lock, finished);
    }
    return write_ok_ && read_ok_ && !*timed_out;
  }

  // Writes `request` and reads into `response`; `done(ok)` (when given) runs when both have, on
  // the thread that completes the second.
  void StartExchange(const v1::DecodeRequest& request, v1::DecodeResponse* response,
                     std::function<void(bool)> done) {
    {
      std::lock_guard lock(mu_);
      write_pending_ = read_pending_ = true;
      exchanged_ = std::move(done);
    }
    StartWrite(&request);
    StartRead(response);
  }

  // After a failed StartExchange (on its thread): lets OnDone run, which calls `ended` with the
  // stream's status.
  void FinishAsync(std::function<void(const grpc::Status&)> ended) {
    {
      std::lock_guard lock(mu_);
      ended_ = std::move(ended);
    }
    RemoveHold();
  }

  // Half-closes (when asked), lets OnDone run and waits for it: the stream's status.
  grpc::Status Finish(bool writes_done) {
    if (writes_done) StartWritesDone();
    RemoveHold();
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return done_; });
    return status_;
  }

  grpc::ClientContext context_;

 private:
  // Once the write and the read are both done: wakes Exchange, or runs StartExchange's `done`.
  void Exchanged(std::unique_lock<std::mutex>& lock) {
    if (write_pending_ || read_pending_) return;
    cv_.notify_all();
    if (!exchanged_) return;
    std::function<void(bool)> done = std::move(exchanged_);
    exchanged_ = nullptr;
    const bool ok = write_ok_ && read_ok_;
    lock.unlock();
    done(ok);
  }

  std::mutex mu_;
  std::condition_variable cv_;
  bool write_pending_ = false, read_pending_ = false;  // guarded by mu_
  bool write_ok_ = true, read_ok_ = true;              // guarded by mu_
  bool done_ = false;                                  // guarded by mu_
  std::function<void(bool)> exchanged_;                // guarded by mu_
  std::function<void(const grpc::Status&)> ended_;     // guarded by mu_
  grpc::Status status_;                                // guarded by mu_
};

absl::StatusOr<v1::DecodeRequest> BuildDecodeRequest(const FloatArray& input,
                                                     const std::vector<int32_t>& lengths,
                                                     std::optional<int64_t> truncate_to,
                                                     Encoding encoding) {
  v1::DecodeRequest request;
  if (absl::Status s = EncodeTensor(input, encoding, request.mutable_input()); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("input: ", s.message()));
  }
  request.mutable_lengths()->Add(lengths.begin(), lengths.end());
  if (truncate_to.has_value()) request.set_truncate_to(*truncate_to);
  return request;
}

absl::StatusOr<std::unique_ptr<DecodeSession>> DecodeSession::Open(const AttentionClient& client,
                                                                   DecodeOptions options) {
  if (options.kind != v1::ATTENTION_KIND_CAUSAL &&
      options.kind != v1::ATTENTION_KIND_CAUSAL_CROSS) {
    return absl::InvalidArgumentError("a decode session's kind is causal or causal_cross");
  }
  if (options.batch < 1) return absl::InvalidArgumentError("a decode session has B >= 1");
  if (options.context.has_value() != (options.kind == v1::ATTENTION_KIND_CAUSAL_CROSS)) {
    return absl::InvalidArgumentError("a context is given with causal_cross, and only then");
  }
  std::unique_ptr<DecodeSession> session(
      new DecodeSession(std::move(options), client.options().timeout));
  session->first_.set_model(session->options_.model);
  session->first_.set_kind(session->options_.kind);
  if (session->options_.context.has_value()) {
    absl::Status s = EncodeTensor(*session->options_.context, session->options_.encoding,
                                  session->first_.mutable_context());
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("context: ", s.message()));
    session->first_.mutable_context_lengths()->Add(session->options_.context_lengths.begin(),
                                                   session->options_.context_lengths.end());
  }
  Reactor* reactor = session->reactor_.get();
  client.StartDecode(&reactor->context_, reactor);
  reactor->AddHold();
  reactor->StartCall();
  return session;
}

DecodeSession::DecodeSession(DecodeOptions options, absl::Duration step_timeout)
    : options_(std::move(options)),
      step_timeout_(step_timeout),
      reactor_(std::make_unique<Reactor>()) {}

DecodeSession::~DecodeSession() {
  if (ended_status_.has_value()) return;
  reactor_->context_.TryCancel();
  reactor_->Finish(/*writes_done=*/false);
}

absl::StatusOr<DecodeStepResult> DecodeSession::Step(const FloatArray& input,
                                                     const std::vector<int32_t>& lengths,
                                                     std::optional<int64_t> truncate_to) {
  // B is the session's: the padded input's first dimension, or one length per sequence.
  const int64_t batch =
      input.shape.size() == 3 ? input.shape[0] : static_cast<int64_t>(lengths.size());
  if (batch != options_.batch) {
    return absl::InvalidArgumentError(
        absl::StrCat("the session has B = ", options_.batch, " sequences; input ",
                     input.ShapeString(), " with ", lengths.size(), " lengths has ", batch));
  }
  absl::StatusOr<v1::DecodeRequest> request =
      BuildDecodeRequest(input, lengths, truncate_to, options_.encoding);
  if (!request.ok()) return request.status();
  v1::DecodeResponse response;
  if (absl::Status s = Send(*request, &response); !s.ok()) return s;
  absl::StatusOr<FloatArray> output = DecodeTensor(response.output());
  if (!output.ok()) {
    return absl::InternalError(absl::StrCat("response output: ", output.status().message()));
  }
  return DecodeStepResult{.output = *std::move(output),
                          .positions = {response.positions().begin(), response.positions().end()}};
}

absl::Status DecodeSession::Send(const v1::DecodeRequest& request, v1::DecodeResponse* response) {
  if (ended_status_.has_value()) return AfterEnd();
  if (absl::Status s = Exchange(Outgoing(request), response); !s.ok()) return s;
  return Answered(*response);
}

absl::Status DecodeSession::AfterEnd() const {
  return ended_status_->ok() ? absl::FailedPreconditionError("the session is closed")
                             : *ended_status_;
}

const v1::DecodeRequest& DecodeSession::Outgoing(const v1::DecodeRequest& request) {
  if (opened_) return request;
  // Until a step is taken the session is not open: every message must be able to open it.
  first_sent_ = first_;
  first_sent_.MergeFrom(request);
  return first_sent_;
}

absl::Status DecodeSession::Answered(const v1::DecodeResponse& response) {
  if (response.error_code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(response.error_code()),
                        response.error_message());
  }
  opened_ = true;
  return absl::OkStatus();
}

void DecodeSession::SendAsync(const v1::DecodeRequest& request, v1::DecodeResponse* response,
                              std::function<void(absl::Status)> done) {
  if (ended_status_.has_value()) {
    done(AfterEnd());
    return;
  }
  auto answered = [this, response, done = std::move(done)](bool ok) {
    if (ok) {
      done(Answered(*response));
      return;
    }
    // The stream broke: its status (the server's, or CANCELLED) comes with OnDone, as EndBroken
    // reads it for Send, without waiting on this gRPC thread.
    reactor_->FinishAsync([this, done](const grpc::Status& end) {
      done(EndWith(end, absl::UnavailableError("the decode stream ended")));
    });
  };
  reactor_->StartExchange(Outgoing(request), response, std::move(answered));
}

void DecodeSession::Cancel() { reactor_->context_.TryCancel(); }

absl::Status DecodeSession::Exchange(const v1::DecodeRequest& request,
                                     v1::DecodeResponse* response) {
  bool timed_out = false;
  if (reactor_->Exchange(request, response, step_timeout_, &timed_out)) return absl::OkStatus();
  return EndBroken(timed_out
                       ? absl::DeadlineExceededError(absl::StrCat(
                             "a decode step waited past ", absl::FormatDuration(step_timeout_)))
                       : absl::UnavailableError("the decode stream ended"));
}

absl::Status DecodeSession::EndBroken(absl::Status fallback) {
  return EndWith(reactor_->Finish(/*writes_done=*/false), std::move(fallback));
}

absl::Status DecodeSession::EndWith(const grpc::Status& end, absl::Status fallback) {
  absl::Status status = FromGrpcStatus(end);
  // A stream the server ended cleanly mid-session (drain) still lost the session.
  if (status.ok() || fallback.code() == absl::StatusCode::kDeadlineExceeded) status = fallback;
  ended_status_ = status;
  return status;
}

absl::Status DecodeSession::Close() {
  if (ended_status_.has_value()) return ended_status_->ok() ? absl::OkStatus() : *ended_status_;
  absl::Status status = FromGrpcStatus(reactor_->Finish(/*writes_done=*/true));
  ended_status_ = status;
  return status;
}

}  // namespace attnserve::client
