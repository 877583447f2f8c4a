#pragma once

// Helpers of the service tests: real servers at 127.0.0.1:0, real channels, request builders,
// health and reflection calls through gRPC's generic stub, and child processes of the real
// attnserve binary.

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "grpcpp/channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "inference/grpc_service.pb.h"
#include "server/options.h"
#include "server/server.h"
#include "tests/common/golden.h"

namespace attnserve::server::testing {

// Starts a quiet server at localhost:0 with `options` (listen address overridden).
std::unique_ptr<Server> StartServer(ServerOptions options);

// A channel to `port` on localhost without client-side message limits.
std::shared_ptr<grpc::Channel> Connect(int port);

// Fires `n` Forward calls of `request` at once, each from its own thread and channel; their
// status codes.
std::vector<grpc::StatusCode> FireTogether(int port, int n, const v1::ForwardRequest& request,
                                           std::chrono::milliseconds deadline);

// A tensor of `shape` holding `values`, as raw bytes or as repeated floats.
v1::Tensor MakeTensor(const std::vector<int64_t>& shape, const std::vector<float>& values,
                      bool raw);

// A raw, padded [batch, seq, 256] call of the demo model (`kind`), its values a smooth wave.
v1::ForwardRequest DemoRequest(int64_t batch, int64_t seq,
                               v1::AttentionKind kind = v1::ATTENTION_KIND_BIDIRECTIONAL);

// The floats of `tensor`, whichever encoding it uses.
std::vector<float> TensorValues(const v1::Tensor& tensor);

// Adds an FP32 input `name` of `shape` to `request`, its values from `values` as the request's
// next raw_input_contents (every input of such a request raw).
void AddRawInput(inference::ModelInferRequest* request, const std::string& name,
                 const std::vector<int64_t>& shape, const float* values);

// A ModelInfer request appending `n` rows of `width` floats from `rows` ([1, n, width], raw) to
// sequence `id` of `model` ("" for the only model), with Triton's sequence parameters.
inference::ModelInferRequest SequenceStepRequest(const std::string& model, const float* rows,
                                                 int64_t n, int64_t width, uint64_t id, bool start,
                                                 bool end);

// A ModelInfer response's first raw output as floats (empty without one).
std::vector<float> RawOutput(const inference::ModelInferResponse& response);

// The server-side model name used for the golden cases' weights file `weights_path`.
std::string GoldenModelName(const test::GoldenCase& c);

// Model configs serving every distinct weights file of `cases`, named by GoldenModelName.
std::vector<ModelConfig> GoldenModels(const std::vector<test::GoldenCase>& cases);

// Options serving every golden case's weights (GoldenModels) and the demo layer beside them,
// the server both frontends' golden suites call; `cases` is kept by the caller.
ServerOptions GoldenServerOptions(const std::vector<test::GoldenCase>& cases);

// Sends each of a few bodies that are not a `type_name` message (garbage, `valid` cut in half, a
// length past the end) to `method`, expecting INVALID_ARGUMENT saying so: every raw method's
// answer to bytes that are not its request.
void ExpectMalformedBodiesRefused(grpc::Channel* channel, const std::string& method,
                                  const std::string& valid, const std::string& type_name);

// How a golden case goes on the wire.
struct Encoding {
  bool packed = false;
  bool raw = false;
};

// The request for golden case `c` in `encoding`.
v1::ForwardRequest GoldenRequest(const test::GoldenCase& c, Encoding encoding,
                                 bool return_attention);

// Empty when `response` matches the case's PyTorch expectations, as allclose(atol = rtol =
// tolerance), else what differs (first mismatch).
std::string CompareToGolden(const test::GoldenCase& c, Encoding encoding,
                            const v1::ForwardResponse& response, float tolerance = 1e-4f);

// grpc.health.v1.Health/Check for `service`: the serving status number (1 SERVING,
// 2 NOT_SERVING), or the call's failure.
absl::StatusOr<int> HealthCheck(grpc::Channel* channel, const std::string& service);

// A unary call of `method` ("/package.Service/Method") with `bytes` as its body, whatever they
// are: what a broken or hostile client can send. The reply's bytes go to `reply`.
grpc::Status CallRaw(grpc::Channel* channel, const std::string& method, const std::string& bytes,
                     std::string* reply);

// A bidirectional stream of `method` whose messages are whatever bytes the test sends: what a
// broken or hostile client can send on a stream.
class RawStream {
 public:
  RawStream(grpc::Channel* channel, const std::string& method);
  ~RawStream();

  // Sends `bytes`, then waits for the next reply: false when the stream ended instead.
  bool Exchange(const std::string& bytes, std::string* reply);

  // Closes the client's side and returns the stream's status.
  grpc::Status Finish();

 private:
  // Waits for the operation tagged `tag`: whether it succeeded.
  bool Await(int tag);

  grpc::ClientContext context_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> stream_;
  bool finished_ = false;
};

// The services server reflection lists.
absl::StatusOr<std::vector<std::string>> ReflectionServices(grpc::Channel* channel);

// A child process of the real attnserve binary, its stdout and stderr in one file.
class ChildServer {
 public:
  // Starts attnserve with `args`; `port_file` is added when not empty. With `max_open_files`
  // > 0 the child runs under that RLIMIT_NOFILE (soft and hard), set between fork and exec.
  ChildServer(const std::vector<std::string>& args, const std::string& output_path,
              int max_open_files = 0);
  ~ChildServer();

  // Waits for the port file to appear; 0 when it did not within `timeout`.
  int WaitForPort(const std::string& port_file, std::chrono::milliseconds timeout);

  // Sends `signal` to the child.
  void Signal(int signal);

  // Waits for the child to exit; its exit code, or -1 if killed by a signal or not exited
  // within `timeout` (then it is killed).
  int Wait(std::chrono::milliseconds timeout);

  // True (with its exit code, or -1 if killed by a signal) once the child has exited.
  bool Exited(int* exit_code);

  // Everything the child wrote so far.
  std::string Output() const;

  // The child's process id (its /proc entry).
  pid_t pid() const { return pid_; }

  // Polls (as WaitFor) until the child's output holds `text`; whether it did within `timeout`.
  bool WaitForOutput(std::string_view text,
                     std::chrono::milliseconds timeout = std::chrono::milliseconds(10000)) const;

 private:
  pid_t pid_ = -1;
  std::string output_path_;
};

// A fresh path in the test's temporary directory.
std::string TempPath(const std::string& name);

// Polls `done` every 20 ms for up to `timeout`; its last answer.
bool WaitFor(const std::function<bool()>& done,
             std::chrono::milliseconds timeout = std::chrono::milliseconds(10000));

}  // namespace attnserve::server::testing
