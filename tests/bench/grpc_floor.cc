// grpc_floor: gRPC's own server cost of a message on a stream and of a unary call, the floor
// under a Decode step and a Forward call (decode.py measures both beside attnserve's): a callback
// server, as attnserve's, that does no work of its own. It serves attnserve.v1's Forward and
// Decode as attnserve registers them (raw callback methods: a unary reactor gRPC may finish on
// the answering thread, a bidi reactor), answering every call and every message with a reply
// made once, of the size attnserve's has; and any other method as an echo of bytes
// ("/floor/Unary" answers its one message and ends, as a unary handler does; any other echoes
// every message of a stream). --drive is its C++ client (gRPC's generic stub, callback API):
// --in-flight callers at once, unary calls then streams of --per-stream messages each waiting
// for its answer, and prints the server's CPU (/proc/PID/stat) per unary call and per streamed
// message. With --attnserve MODEL the client makes 1x1 causal Forward calls and Decode streams of
// 1-token steps (each answer checked), to this server or to attnserve, so that attnserve's CPU
// differs from this floor's by attnserve's own work alone, whatever the client costs.
//
//   grpc_floor --listen 127.0.0.1:0 --port-file FILE [--width 256]
//   grpc_floor --drive 127.0.0.1:PORT --pid SERVER_PID [--messages 4128] [--per-stream 129]
//              [--in-flight 1] [--attnserve MODEL --width 256] [--phases unary|stream|both]

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "attnserve/v1/attention.grpc.pb.h"
#include "attnserve/v1/attention.pb.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "grpcpp/support/byte_buffer.h"
#include "tests/bench/proc_cpu.h"

namespace {

grpc::ByteBuffer Bytes(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

// A stream that answers each message it reads, then reads the next: with the message itself
// (an echo), or with `reply` when one is given. `unary`: answers its one message and ends, as a
// unary handler does.
class Answering final : public grpc::ServerGenericBidiReactor {
 public:
  Answering(bool unary, const std::string* reply) : unary_(unary), reply_(reply) {
    StartRead(&message_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::OK);
      return;
    }
    if (reply_ != nullptr) message_ = Bytes(*reply_);
    if (unary_) {
      StartWriteAndFinish(&message_, grpc::WriteOptions(), grpc::Status::OK);
    } else {
      StartWrite(&message_);
    }
  }
  void OnWriteDone(bool ok) override {
    if (ok) {
      StartRead(&message_);
    } else {
      Finish(grpc::Status::OK);
    }
  }
  void OnDone() override { delete this; }

 private:
  const bool unary_;
  const std::string* const reply_;
  grpc::ByteBuffer message_;  // read, then answered: one at a time
};

class EchoService final : public grpc::CallbackGenericService {
  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* context) override {
    return new Answering(context->method() == "/floor/Unary", /*reply=*/nullptr);
  }
};

// A [1, 1, width] tensor of zeros, raw.
attnserve::v1::Tensor Zeros(int width) {
  attnserve::v1::Tensor tensor;
  tensor.add_shape(1);
  tensor.add_shape(1);
  tensor.add_shape(width);
  tensor.set_raw(std::string(static_cast<size_t>(width) * sizeof(float), '\0'));
  return tensor;
}

// attnserve.v1's Forward and Decode, registered as attnserve registers them, answered with
// replies of the size a `width`-wide model's are (a 1x1 output; a step's output and position).
class CannedAttention final : public attnserve::v1::AttentionService::WithRawCallbackMethod_Forward<
                                  attnserve::v1::AttentionService::WithRawCallbackMethod_Decode<
                                      attnserve::v1::AttentionService::Service>> {
 public:
  explicit CannedAttention(int width) {
    attnserve::v1::ForwardResponse forward;
    *forward.mutable_output() = Zeros(width);
    forward_reply_ = forward.SerializeAsString();
    attnserve::v1::DecodeResponse step;
    *step.mutable_output() = Zeros(width);
    step.add_positions(1);
    step_reply_ = step.SerializeAsString();
  }

  // Finished at once on gRPC's default reactor, which gRPC may finish on the answering thread,
  // as attnserve's Forward reactor is.
  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* context,
                                    const grpc::ByteBuffer* /*request*/,
                                    grpc::ByteBuffer* response) override {
    *response = Bytes(forward_reply_);
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Decode(
      grpc::CallbackServerContext* /*context*/) override {
    return new Answering(/*unary=*/false, &step_reply_);
  }

 private:
  std::string forward_reply_, step_reply_;
};

// What the driver calls: the echo server's two methods, or attnserve's Forward and Decode.
struct Methods {
  std::string unary = "/floor/Unary", stream = "/floor/Stream";
  grpc::ByteBuffer unary_message, stream_message;
  bool decode_answers = false;  // the stream's answers are DecodeResponses, to be checked
};

// Whether a Decode step's answer (consumed) says it was taken (error_code 0): an in-stream
// refusal would otherwise pass for a step.
bool StepTaken(grpc::ByteBuffer* answer) {
  attnserve::v1::DecodeResponse response;
  return grpc::SerializationTraits<attnserve::v1::DecodeResponse>::Deserialize(answer, &response)
             .ok() &&
         response.error_code() == 0;
}

// One stream: writes a message, waits for its echo (or answer), `count` times, then closes.
class PingPong final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  PingPong(grpc::GenericStub& stub, const Methods& methods, int count)
      : message_(methods.stream_message), decode_(methods.decode_answers), left_(count) {
    stub.PrepareBidiStreamingCall(&context_, methods.stream, grpc::StubOptions(), this);
    StartRead(&echo_);
    StartWrite(&message_);
    StartCall();
  }
  // The next message goes once the echo came back and the last write finished (one write at a
  // time), whichever is last.
  void OnWriteDone(bool ok) override { Next(ok); }
  void OnReadDone(bool ok) override { Next(ok); }
  void Next(bool ok) {
    std::lock_guard lock(mu_);
    ok_ = ok_ && ok;
    if (++halves_ < 2) return;
    ok_ = ok_ && (!decode_ || StepTaken(&echo_));
    halves_ = 0;
    if (ok_ && --left_ > 0) {
      StartRead(&echo_);
      StartWrite(&message_);
    } else {
      StartWritesDone();
    }
  }
  void OnDone(const grpc::Status& status) override {
    bool ok;
    {
      std::lock_guard lock(mu_);
      ok = ok_;
    }
    // The last thing done: Wait's caller may destroy this at once.
    done_.set_value(!status.ok() || ok ? status
                                       : grpc::Status(grpc::StatusCode::UNKNOWN,
                                                      "a message failed, or a step was refused"));
  }
  grpc::Status Wait() { return done_.get_future().get(); }

 private:
  grpc::ClientContext context_;
  grpc::ByteBuffer message_, echo_;
  const bool decode_;
  std::mutex mu_;
  int left_;
  int halves_ = 0;  // of the exchange in flight: its write and its echo done
  bool ok_ = true;
  std::promise<grpc::Status> done_;
};

// Echoes of 1 KiB, a demo step's input (1 x 256 f32).
Methods EchoMethods() {
  Methods methods;
  methods.unary_message = methods.stream_message = Bytes(std::string(1024, '\0'));
  return methods;
}

// A 1x1 causal Forward of `model` and the Decode steps of one token (each repeating the model
// and kind, as a session's messages may), `width` wide, zeros, raw.
Methods AttnserveMethods(const std::string& model, int width) {
  const attnserve::v1::Tensor input = Zeros(width);
  attnserve::v1::ForwardRequest forward;
  forward.set_model(model);
  forward.set_kind(attnserve::v1::ATTENTION_KIND_CAUSAL);
  *forward.mutable_input() = input;
  attnserve::v1::DecodeRequest step;
  step.set_model(model);
  step.set_kind(attnserve::v1::ATTENTION_KIND_CAUSAL);
  *step.mutable_input() = input;
  Methods methods;
  methods.unary = "/attnserve.v1.AttentionService/Forward";
  methods.stream = "/attnserve.v1.AttentionService/Decode";
  methods.unary_message = Bytes(forward.SerializeAsString());
  methods.stream_message = Bytes(step.SerializeAsString());
  methods.decode_answers = true;
  return methods;
}

int Drive(const std::string& target, int pid, const Methods& methods, int messages, int per_stream,
          int in_flight, const std::string& phases) {
  grpc::GenericStub stub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  auto unary = [&](int count) {
    for (int i = 0; i < count; ++i) {
      grpc::ClientContext context;
      grpc::ByteBuffer echo;
      std::promise<grpc::Status> done;
      stub.UnaryCall(&context, methods.unary, grpc::StubOptions(), &methods.unary_message, &echo,
                     [&](grpc::Status status) { done.set_value(std::move(status)); });
      if (!done.get_future().get().ok()) return false;
    }
    return true;
  };
  auto streams = [&](int count) {
    for (int i = 0; i < count; ++i) {
      const grpc::Status status = PingPong(stub, methods, per_stream).Wait();
      if (!status.ok()) {
        std::fprintf(stderr, "grpc_floor: a stream failed: %s\n", status.error_message().c_str());
        return false;
      }
    }
    return true;
  };
  if (!unary(200) || !streams(1)) {  // connection and first calls out of the timing
    std::fprintf(stderr, "grpc_floor: calls to %s failed\n", target.c_str());
    return 1;
  }
  // Each of the `in_flight` callers makes its share of the calls, and of the messages in whole
  // streams (one at least).
  const int calls_each = std::max(1, messages / in_flight);
  const int streams_each = std::max(1, calls_each / per_stream);
  // `run(count)` on every caller at once; false if any failed (its figure would then count calls
  // that were not made).
  auto concurrently = [&](auto&& run, int count) {
    std::vector<std::thread> callers;
    std::atomic<bool> ok = true;
    for (int i = 0; i < in_flight; ++i) {
      callers.emplace_back([&] {
        if (!run(count)) ok = false;
      });
    }
    for (std::thread& caller : callers) caller.join();
    if (!ok) std::fprintf(stderr, "grpc_floor: calls to %s failed\n", target.c_str());
    return ok.load();
  };
  double unary_cpu = 0, stream_cpu = 0;
  if (phases != "stream") {
    const double before = attnserve::bench::CpuSeconds(pid, "grpc_floor");
    if (!concurrently(unary, calls_each)) return 1;
    unary_cpu =
        (attnserve::bench::CpuSeconds(pid, "grpc_floor") - before) / (calls_each * in_flight);
  }
  if (phases != "unary") {
    const double before = attnserve::bench::CpuSeconds(pid, "grpc_floor");
    if (!concurrently(streams, streams_each)) return 1;
    stream_cpu = (attnserve::bench::CpuSeconds(pid, "grpc_floor") - before) /
                 (streams_each * per_stream * in_flight);
  }
  std::printf("{\"unary_cpu_us\": %.2f, \"stream_message_cpu_us\": %.2f}\n", unary_cpu * 1e6,
              stream_cpu * 1e6);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("gRPC's floor: a callback server that echoes bytes");
  std::string listen = "127.0.0.1:0", port_file, drive;
  std::string attnserve_model, phases = "both";
  int pid = 0, messages = 4128, per_stream = 129, in_flight = 1, width = 256;
  app.add_option("--listen", listen, "host:port (port 0: any free one)");
  app.add_option("--port-file", port_file, "where to write the bound port");
  app.add_option("--drive", drive, "be the client of the server at this host:port instead");
  app.add_option("--pid", pid, "--drive: the server's process id (its CPU is measured)");
  app.add_option("--messages", messages,
                 "--drive: unary calls, and streamed messages (whole streams, one a caller at "
                 "least)");
  app.add_option("--per-stream", per_stream, "--drive: messages a stream");
  app.add_option("--in-flight", in_flight, "--drive: calls or streams at once");
  app.add_option("--attnserve", attnserve_model,
                 "--drive: call this model of an attnserve server (1x1 causal Forward calls, "
                 "Decode streams of 1-token steps) instead of the echo server");
  app.add_option("--width", width,
                 "--attnserve: the model's d_model; serving: the width of the canned replies");
  app.add_option("--phases", phases,
                 "--drive: unary, stream or both (one phase alone, to profile it; the other "
                 "prints 0)")
      ->check(CLI::IsMember({"unary", "stream", "both"}));
  CLI11_PARSE(app, argc, argv);
  if (!drive.empty()) {
    const Methods methods =
        attnserve_model.empty() ? EchoMethods() : AttnserveMethods(attnserve_model, width);
    return Drive(drive, pid, methods, messages, std::max(per_stream, 1), std::max(in_flight, 1),
                 phases);
  }
  if (port_file.empty()) {
    std::fprintf(stderr, "grpc_floor: --port-file (serving) or --drive (the client)\n");
    return 2;
  }

  EchoService echo;
  CannedAttention attention(width);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&attention);
  builder.RegisterCallbackGenericService(&echo);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::fprintf(stderr, "grpc_floor: cannot listen on %s\n", listen.c_str());
    return 1;
  }
  std::ofstream(port_file) << port << "\n";
  server->Wait();
  return 0;
}
