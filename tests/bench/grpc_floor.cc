// grpc_floor: gRPC's own server cost of a message on a stream and of a unary call, the floor
// under a Decode step and a Forward call (decode.py measures both beside attnserve's): a callback
// server, as attnserve's, that echoes bytes and does nothing else. "/floor/Unary" answers its one
// message and ends, as a unary handler does; any other method echoes every message of a stream.
// --drive is its C++ client (gRPC's generic stub, as cheap as attnserve-client): one call in
// flight, unary calls then streams of --per-stream messages each waiting for its echo, and
// prints the server's CPU (/proc/PID/stat) per unary call and per streamed message.
//
//   grpc_floor --listen 127.0.0.1:0 --port-file FILE
//   grpc_floor --drive 127.0.0.1:PORT --pid SERVER_PID [--messages 4128] [--per-stream 129]

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <future>
#include <memory>
#include <mutex>
#include <string>

#include "CLI/CLI.hpp"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/byte_buffer.h"
#include "tests/bench/proc_cpu.h"

namespace {

class Echo final : public grpc::ServerGenericBidiReactor {
 public:
  explicit Echo(bool unary) : unary_(unary) { StartRead(&message_); }

  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::OK);
    } else if (unary_) {
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
  grpc::ByteBuffer message_;
};

class EchoService final : public grpc::CallbackGenericService {
  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* context) override {
    return new Echo(context->method() == "/floor/Unary");
  }
};

// One stream: writes a message, waits for its echo, `count` times, then closes.
class PingPong final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  PingPong(grpc::GenericStub& stub, const grpc::ByteBuffer& message, int count)
      : message_(message), left_(count) {
    stub.PrepareBidiStreamingCall(&context_, "/floor/Stream", grpc::StubOptions(), this);
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
    halves_ = 0;
    if (ok_ && --left_ > 0) {
      StartRead(&echo_);
      StartWrite(&message_);
    } else {
      StartWritesDone();
    }
  }
  void OnDone(const grpc::Status& status) override { done_.set_value(status); }
  grpc::Status Wait() { return done_.get_future().get(); }

 private:
  grpc::ClientContext context_;
  grpc::ByteBuffer message_, echo_;
  std::mutex mu_;
  int left_;
  int halves_ = 0;  // of the exchange in flight: its write and its echo done
  bool ok_ = true;
  std::promise<grpc::Status> done_;
};

int Drive(const std::string& target, int pid, int messages, int per_stream) {
  grpc::GenericStub stub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::Slice bytes(std::string(1024, '\0'));  // a demo step's input, 1 x 256 f32
  const grpc::ByteBuffer message(&bytes, 1);
  auto unary = [&](int count) {
    for (int i = 0; i < count; ++i) {
      grpc::ClientContext context;
      grpc::ByteBuffer echo;
      std::promise<grpc::Status> done;
      stub.UnaryCall(&context, "/floor/Unary", grpc::StubOptions(), &message, &echo,
                     [&](grpc::Status status) { done.set_value(std::move(status)); });
      if (!done.get_future().get().ok()) return false;
    }
    return true;
  };
  auto streams = [&](int count) {
    for (int i = 0; i < count / per_stream; ++i) {
      if (!PingPong(stub, message, per_stream).Wait().ok()) return false;
    }
    return true;
  };
  if (!unary(200) || !streams(per_stream)) {  // connection and first calls out of the timing
    std::fprintf(stderr, "grpc_floor: calls to %s failed\n", target.c_str());
    return 1;
  }
  double before = attnserve::bench::CpuSeconds(pid, "grpc_floor");
  unary(messages);
  const double unary_cpu = (attnserve::bench::CpuSeconds(pid, "grpc_floor") - before) / messages;
  before = attnserve::bench::CpuSeconds(pid, "grpc_floor");
  streams(messages);
  const double stream_cpu = (attnserve::bench::CpuSeconds(pid, "grpc_floor") - before) /
                            (messages / per_stream * per_stream);
  std::printf("{\"unary_cpu_us\": %.2f, \"stream_message_cpu_us\": %.2f}\n", unary_cpu * 1e6,
              stream_cpu * 1e6);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("gRPC's floor: a callback server that echoes bytes");
  std::string listen = "127.0.0.1:0", port_file, drive;
  int pid = 0, messages = 4128, per_stream = 129;
  app.add_option("--listen", listen, "host:port (port 0: any free one)");
  app.add_option("--port-file", port_file, "where to write the bound port");
  app.add_option("--drive", drive, "be the client of the server at this host:port instead");
  app.add_option("--pid", pid, "--drive: the server's process id (its CPU is measured)");
  app.add_option("--messages", messages, "--drive: unary calls, and streamed messages");
  app.add_option("--per-stream", per_stream, "--drive: messages a stream");
  CLI11_PARSE(app, argc, argv);
  if (!drive.empty()) return Drive(drive, pid, messages, std::max(per_stream, 1));
  if (port_file.empty()) {
    std::fprintf(stderr, "grpc_floor: --port-file (serving) or --drive (the client)\n");
    return 2;
  }

  EchoService service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::fprintf(stderr, "grpc_floor: cannot listen on %s\n", listen.c_str());
    return 1;
  }
  std::ofstream(port_file) << port << "\n";
  server->Wait();
  return 0;
}
