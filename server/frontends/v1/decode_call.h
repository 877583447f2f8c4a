#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "attnserve/v1/attention.grpc.pb.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"
#include "server/frontends/open_streams.h"
#include "server/serving/admission.h"
#include "server/serving/session.h"

namespace attnserve::server {

// One attnserve.v1 Decode stream: one session. Each message is converted into a step of the
// session (the first opens it through admission) and answered in the stream when the step has
// run; a refused message (a message that is not a DecodeRequest too) is answered with its
// error_code and changes nothing. The session, and its cache, ends with the stream: the client's
// end, a cancel, a deadline, a broken connection, a drain (at once while the stream waits for a
// message, else after the message's answer).
class DecodeCall final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                         public DrainableStream {
 public:
  // `admission` and `streams` outlive the call. Starts reading, and joins `streams`.
  DecodeCall(Admission* admission, OpenStreams* streams);

  void EndIfIdle() override;
  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  // The message just read: a step, or an answer with an error.
  void Take();
  // Opens the session on the first message (decoding its input); false, after answering or
  // ending, when it cannot.
  bool OpenSession();
  // Decodes a later message's input, after checking it does not try to change the session.
  absl::Status DecodeNext();
  // Decodes request_'s input into input_.
  absl::Status DecodeInput();
  // The model its messages count under: the session's (a first message that fails once its
  // session opened too), or as the message names it before one opens.
  const std::string& model() const;
  // Converts request_ into the step's arguments and sizes response_'s output.
  absl::Status MakeStep(StepArgs* args);
  // The step has run (any thread): answer it, or end if the stream was cancelled meanwhile.
  void StepDone(const absl::Status& status);
  // Writes response_ with `status` (and the positions), then reads the next message.
  void Answer(const absl::Status& status);
  // Finishes the stream once, freeing the session first; waits for a step in flight.
  void End(const grpc::Status& status);
  // Reads the next message; or, the server draining, ends the stream.
  void ReadNext();

  Admission* const admission_;
  OpenStreams* const streams_;
  grpc::ByteBuffer request_bytes_;
  grpc::ByteBuffer response_bytes_;
  v1::DecodeRequest request_;
  v1::DecodeResponse response_;
  // Shared only so that OnCancel can take a queued step back while the session may end.
  std::shared_ptr<Session> session_;
  std::string session_model_;  // the model of the session the latest first message opened
  core::RaggedBatch input_;
  std::vector<float> input_copy_;
  bool raw_ = false;

  // Guards the flags below. gRPC orders the reactions (the constructor, each read and write,
  // OnDone) inside itself, and a step is answered on the compute thread, out of a thread
  // sanitizer's sight; each reaction and each answer also takes this lock, so that the order in
  // which they use the messages is visible to it too.
  std::mutex mu_;
  bool step_in_flight_ = false;  // guarded by mu_
  bool first_step_ = false;      // guarded by mu_: the step in flight is the session's first
  bool cancelled_ = false;       // guarded by mu_
  bool finished_ = false;        // guarded by mu_
  bool reading_ = false;         // guarded by mu_: waiting for the client's next message
};

}  // namespace attnserve::server
