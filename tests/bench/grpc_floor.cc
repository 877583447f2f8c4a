// grpc_floor: gRPC's own server cost of a message on a stream and of a unary call, the floor
// under a Decode step and a Forward call (decode.py measures both beside attnserve's): a callback
// server, as attnserve's, that echoes bytes and does nothing else. "/floor/Unary" answers its one
// message and ends, as a unary handler does; any other method echoes every message of a stream.
//
//   grpc_floor --listen 127.0.0.1:0 --port-file FILE

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

#include "CLI/CLI.hpp"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/byte_buffer.h"

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
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* context) override {
    return new Echo(context->method() == "/floor/Unary");
  }
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("gRPC's floor: a callback server that echoes bytes");
  std::string listen = "127.0.0.1:0", port_file;
  app.add_option("--listen", listen, "host:port (port 0: any free one)");
  app.add_option("--port-file", port_file, "where to write the bound port")->required();
  CLI11_PARSE(app, argc, argv);

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
