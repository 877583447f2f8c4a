#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "client/client.h"
#include "client/float_array.h"
#include "client/wire.h"
#include "grpcpp/client_context.h"

namespace attnserve::client {

// What a decode session is opened with: the first message carries all of it.
struct DecodeOptions {
  std::string model;                                   // empty: the server's only model
  v1::AttentionKind kind = v1::ATTENTION_KIND_CAUSAL;  // CAUSAL or CAUSAL_CROSS
  int batch = 1;                                       // B, sequences in the session
  std::optional<FloatArray> context;                   // CAUSAL_CROSS: [B, S_ctx, d_context]
  std::vector<int32_t> context_lengths;
  Encoding encoding = Encoding::kRaw;
};

// What one step answers: the appended tokens' outputs in the input's layout, and each
// sequence's cached length after the step.
struct DecodeStepResult {
  FloatArray output;
  std::vector<int64_t> positions;
};

// One attnserve.v1 Decode stream: a session whose keys and values the server keeps for as long
// as the stream lives. Steps run one at a time (the server answers each before reading the
// next), so a session is used from one thread at a time. A refused step (error_code in the
// stream) comes back as its status with the session unchanged and still usable; a stream that
// ends (UNAVAILABLE when the replica died, the server's status when the first message could not
// open a session, DEADLINE_EXCEEDED when a step outwaited ClientOptions::timeout) ends the
// session: every later step returns that status, and the caller replays its prefix on a new one.
class DecodeSession {
 public:
  // Starts the stream on the client's channel (its TLS and token); the session itself opens
  // with the first step, which carries the model, kind and context.
  static absl::StatusOr<std::unique_ptr<DecodeSession>> Open(const AttentionClient& client,
                                                             DecodeOptions options);

  // Cancels the stream if it was not closed (the server frees the session at once).
  ~DecodeSession();
  DecodeSession(const DecodeSession&) = delete;
  DecodeSession& operator=(const DecodeSession&) = delete;

  // Appends tokens to every sequence: `input` [B, n, d_model] padded or [T, d_model] packed,
  // `lengths` the tokens each sequence appends (empty: all n; packed needs them). With
  // `truncate_to`, every sequence first drops its cached positions >= it.
  absl::StatusOr<DecodeStepResult> Step(const FloatArray& input,
                                        const std::vector<int32_t>& lengths = {},
                                        std::optional<int64_t> truncate_to = std::nullopt);

  // Sends a prepared message as is (the load tester's hot path): the model, kind and context
  // are added until the session has opened. An in-stream refusal is returned as its status.
  absl::Status Send(const v1::DecodeRequest& request, v1::DecodeResponse* response);

  // Send without waiting, for a client that drives many sessions from gRPC's own threads (no
  // thread a session): `done` runs once, with what Send would return, on one of gRPC's threads
  // (or here, when the session has already ended); `request` and `response` live until then,
  // and the session takes nothing else until then. There is no step timeout: Cancel() ends a
  // step that waits too long. A broken stream has ended by the time `done` runs.
  void SendAsync(const v1::DecodeRequest& request, v1::DecodeResponse* response,
                 std::function<void(absl::Status)> done);

  // Cancels the stream (any thread): a step in flight fails, and the server frees the session.
  void Cancel();

  // Ends the stream (the server frees the session) and returns how it ended: OK, or the status
  // that broke it earlier.
  absl::Status Close();

  // Whether the stream has ended (closed, or broken: every step now fails).
  bool ended() const { return ended_status_.has_value(); }

  // The options the session was opened with.
  const DecodeOptions& options() const { return options_; }

 private:
  class Reactor;

  DecodeSession(DecodeOptions options, absl::Duration step_timeout);

  // Writes one message and waits for its answer (at most step_timeout_).
  absl::Status Exchange(const v1::DecodeRequest& request, v1::DecodeResponse* response);
  // Ends the stream after a failed read or write, and returns the status it ended with.
  absl::Status EndBroken(absl::Status fallback);
  // The session's end, from the stream's status (`fallback` when the stream ended OK or the
  // step timed out).
  absl::Status EndWith(const grpc::Status& end, absl::Status fallback);
  // What a step returns once the session has ended.
  absl::Status AfterEnd() const;
  // The message to send: `request`, or until the session opens, first_ with it.
  const v1::DecodeRequest& Outgoing(const v1::DecodeRequest& request);
  // What a step that was written and read returns (its in-stream refusal, if any); opens the
  // session when the server took it.
  absl::Status Answered(const v1::DecodeResponse& response);

  DecodeOptions options_;
  absl::Duration step_timeout_;
  v1::DecodeRequest first_;       // model, kind and context: sent until a step is taken
  bool opened_ = false;           // a step was taken: the server has the session
  v1::DecodeRequest first_sent_;  // Outgoing's first_ + request, while it is in flight
  std::optional<absl::Status> ended_status_;
  std::unique_ptr<Reactor> reactor_;
};

// The wire message of a step (also used by the load tester, which sends many).
absl::StatusOr<v1::DecodeRequest> BuildDecodeRequest(const FloatArray& input,
                                                     const std::vector<int32_t>& lengths,
                                                     std::optional<int64_t> truncate_to,
                                                     Encoding encoding);

}  // namespace attnserve::client
