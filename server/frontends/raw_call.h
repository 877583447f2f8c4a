#pragma once

// What the frontends' raw methods (attnserve.v1 Forward, the Open Inference Protocol's
// ModelInfer) share: the call's bytes, arena, reply and reactor (RawCall), the caller's
// deadline, and reading the few fields admission needs before the call is parsed; and how the
// raw streams (Decode, ModelStreamInfer) parse and serialize their messages.

#include <initializer_list>
#include <string>
#include <utility>

#include "google/protobuf/arena.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/server_callback.h"
#include "server/frontends/grpc_status.h"
#include "server/serving/admission.h"
#include "server/serving/job.h"

namespace attnserve::server {

// The caller's deadline on the steady clock (max() for none).
Clock::time_point SteadyDeadline(const grpc::CallbackServerContext& context);

// Reads the top-level string fields `fields` (number, destination) and varint fields `varints`
// of the serialized message in `bytes`, skipping every other field without copying or parsing
// it, so a call refused for its model, a full queue or shutdown costs next to nothing. False
// when the bytes are not a protobuf message.
bool ScanStringFields(grpc::ByteBuffer* bytes,
                      std::initializer_list<std::pair<int, std::string*>> fields,
                      std::initializer_list<std::pair<int, uint64_t*>> varints = {});

// INVALID_ARGUMENT for a body that is not a `type_name` message (a full protobuf name): every
// raw method's one answer to it.
absl::Status MalformedBody(absl::string_view type_name);

// Parses a raw stream's message `bytes` into `message`, releasing the bytes: MalformedBody (and
// `message` empty, not half parsed) when they are not a `Message`. A typed stream cannot tell that
// apart from the client's end (gRPC reports both as a failed read), so the streams read raw and
// answer a bad message in the stream.
template <typename Message>
absl::Status ParseStreamMessage(grpc::ByteBuffer* bytes, Message* message) {
  grpc::ProtoBufferReader reader(bytes);
  const bool parsed = message->ParseFromZeroCopyStream(&reader);
  bytes->Clear();
  if (parsed) return absl::OkStatus();
  message->Clear();
  return MalformedBody(Message::descriptor()->full_name());
}

// Serializes `message` into `bytes` (replacing the last message written) for a raw stream's
// write.
template <typename Message>
grpc::Status SerializeStreamMessage(const Message& message, grpc::ByteBuffer* bytes) {
  bytes->Clear();
  bool own_buffer = false;
  return grpc::SerializationTraits<Message>::Serialize(message, bytes, &own_buffer);
}

// A unary method answered at once on gRPC's thread (metadata, liveness, readiness), served raw
// so that a body that is not a `Request` gets MalformedBody; gRPC's typed handlers answer it
// UNIMPLEMENTED with no message. `answer(request, &response)` fills the reply and returns the
// call's status.
template <typename Request, typename Response, typename Answer>
grpc::ServerUnaryReactor* AnswerRawUnary(grpc::CallbackServerContext* context,
                                         const grpc::ByteBuffer* request_bytes,
                                         grpc::ByteBuffer* response_bytes, Answer answer) {
  grpc::ByteBuffer bytes(*request_bytes);  // shares gRPC's slices; the reader needs it mutable
  grpc::ProtoBufferReader reader(&bytes);
  Request request;
  Response response;
  const absl::Status status = request.ParseFromZeroCopyStream(&reader)
                                  ? answer(request, &response)
                                  : MalformedBody(Request::descriptor()->full_name());
  grpc::Status reply = ToGrpcStatus(status);
  if (status.ok()) {
    bool own_buffer = false;
    reply = grpc::SerializationTraits<Response>::Serialize(response, response_bytes, &own_buffer);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(reply);
  return reactor;
}

// One call of a raw unary method whose body is a `Request` and whose reply a `Response`: the
// request's bytes as gRPC received them (so a body that is not a `Request` gets a clear
// INVALID_ARGUMENT from the frontend's codec, not gRPC's bare UNIMPLEMENTED), parsed onto an
// arena only once admission asks, the reply serialized from the same arena, and a reactor that
// takes the call out of its queue the moment the caller leaves. Made with `new`; deletes itself
// when gRPC is done with the call. Frontends add what their protocol decides (RequestedModel,
// Decode, args, ReplyBytes, Buffers).
template <typename Request, typename Response>
class RawCall : public Job {
 public:
  // What gRPC's handler returns.
  grpc::ServerUnaryReactor* reactor() { return &reactor_; }

  void Finish(const absl::Status& status) final {
    grpc::Status answer = ToGrpcStatus(status);
    if (status.ok() && response_ != nullptr) {
      bool own_buffer = false;
      answer =
          grpc::SerializationTraits<Response>::Serialize(*response_, response_bytes_, &own_buffer);
    }
    // After this gRPC may call OnDone at any time, even before Finish returns (the reactor is
    // inlineable), which deletes this call: touch nothing.
    reactor_.Finish(answer);
  }

 protected:
  RawCall(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
          grpc::ByteBuffer* response)
      : Job(Clock::now(), SteadyDeadline(*context)),
        request_bytes_(*request),
        response_bytes_(response) {}

  // Parses the request onto the arena (request_): false when the bytes are not a `Request`.
  bool Parse() {
    request_ = google::protobuf::Arena::CreateMessage<Request>(&arena_);
    grpc::ProtoBufferReader reader(&request_bytes_);
    return request_->ParseFromZeroCopyStream(&reader);
  }

  // The answer to bytes that are not a `Request`.
  static absl::Status Malformed() { return MalformedBody(Request::descriptor()->full_name()); }

  // The reply, made on the arena when compute starts; Finish sends it.
  Response* NewResponse() {
    response_ = google::protobuf::Arena::CreateMessage<Response>(&arena_);
    return response_;
  }

  grpc::ByteBuffer request_bytes_;  // shares gRPC's slices, no copy
  Request* request_ = nullptr;      // after Parse

 private:
  class Reactor final : public grpc::ServerUnaryReactor {
   public:
    explicit Reactor(RawCall* call) : call_(call) {}
    void OnCancel() override { call_->CallerGone(); }
    void OnDone() override { delete call_; }
    // Both reactions are short and never block (a delete; a queue removal and an answer), so
    // gRPC may run them on the thread that completes the call's last operation, typically the
    // compute thread inside Finish, instead of waking its executor thread for each call (a
    // thread hand-off per call: 1x16 calls at 64 callers used 17 % more server CPU per call
    // that way). gRPC 1.51 marks this "not API"; its own trivial reactors do the same.
    bool InternalInlineable() override { return true; }

   private:
    RawCall* const call_;
  };

  grpc::ByteBuffer* const response_bytes_;
  Reactor reactor_{this};
  google::protobuf::Arena arena_;
  Response* response_ = nullptr;
};

// A raw method's whole handler: makes the frontend's call and hands it to admission, which
// answers it now or from the scheduler. The reactor is taken first: the call may be answered
// (and deleted) before Admit returns.
template <typename Call>
grpc::ServerUnaryReactor* AdmitRawCall(Admission* admission, grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) {
  auto* call = new Call(context, request, response);
  grpc::ServerUnaryReactor* reactor = call->reactor();
  admission->Admit(call);
  return reactor;
}

}  // namespace attnserve::server
