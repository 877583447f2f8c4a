#include "tests/server/test_util.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "google/protobuf/unknown_field_set.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"
#include "gtest/gtest.h"
#include "server/observability/log_setup.h"
#include "tests/common/temp_dir.h"

extern char** environ;

namespace attnserve::server::testing {
namespace {

using google::protobuf::UnknownField;
using google::protobuf::UnknownFieldSet;

std::string ToString(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!buffer.Dump(&slices).ok()) return out;
  for (const grpc::Slice& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

grpc::ByteBuffer ToBuffer(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

// A length-delimited protobuf field `number` holding `bytes` (short enough for a 1-byte size).
std::string LengthDelimited(int number, const std::string& bytes) {
  std::string out;
  out.push_back(static_cast<char>(number << 3 | 2));
  out.push_back(static_cast<char>(bytes.size()));
  return out + bytes;
}

bool Near(float actual, float expected, float tolerance) {
  return std::fabs(actual - expected) <= tolerance + tolerance * std::fabs(expected);
}

std::vector<int64_t> Offsets(const std::vector<int64_t>& lengths) {
  std::vector<int64_t> offsets(lengths.size(), 0);
  for (size_t b = 1; b < lengths.size(); ++b) offsets[b] = offsets[b - 1] + lengths[b - 1];
  return offsets;
}

std::vector<int64_t> Shape(const v1::Tensor& t) { return {t.shape().begin(), t.shape().end()}; }

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) absl::StrAppend(&s, i ? ", " : "", shape[i]);
  return s + "]";
}

void AddBatch(const test::GoldenBatch& batch, Encoding encoding, v1::Tensor* tensor,
              google::protobuf::RepeatedField<int32_t>* lengths) {
  if (encoding.packed) {
    std::vector<float> rows = batch.Packed();
    const int64_t total = static_cast<int64_t>(rows.size()) / batch.width;
    *tensor = MakeTensor({total, batch.width}, rows, encoding.raw);
  } else {
    *tensor = MakeTensor({batch.batch, batch.seq_len, batch.width}, batch.values, encoding.raw);
  }
  for (int64_t l : batch.lengths) lengths->Add(static_cast<int32_t>(l));
}

std::string CompareOutput(const test::GoldenCase& c, Encoding encoding, const v1::Tensor& out,
                          float tolerance) {
  const test::GoldenBatch& in = c.input;
  const std::vector<float> values = TensorValues(out);
  const std::vector<int64_t> offsets = Offsets(in.lengths);
  const int64_t total = offsets.empty() ? 0 : offsets.back() + in.lengths.back();
  const std::vector<int64_t> want_shape =
      encoding.packed ? std::vector<int64_t>{total, c.d_output}
                      : std::vector<int64_t>{in.batch, in.seq_len, c.d_output};
  if (Shape(out) != want_shape ||
      values.size() != static_cast<size_t>(out.shape(0) * out.shape(1) *
                                           (out.shape_size() == 3 ? out.shape(2) : 1))) {
    return absl::StrCat("output shape ", ShapeString(Shape(out)), ", want ",
                        ShapeString(want_shape));
  }
  for (size_t i = 0; i < c.output_rows.size(); ++i) {
    const int64_t flat = c.output_rows[i];
    const int64_t b = flat / in.seq_len, t = flat % in.seq_len;
    int64_t row = flat;
    if (encoding.packed) {
      if (t >= in.lengths[b]) continue;  // padded rows are not on the wire when packed
      row = offsets[b] + t;
    }
    for (int64_t k = 0; k < c.d_output; ++k) {
      const float got = values[row * c.d_output + k];
      const float want = c.expected_output[i * c.d_output + k];
      if (!Near(got, want, tolerance)) {
        return absl::StrCat("output row ", flat, " (b ", b, ", t ", t, ") col ", k, ": got ", got,
                            ", want ", want);
      }
    }
  }
  return "";
}

std::string CompareAttention(const test::GoldenCase& c, const v1::Tensor& att, float tolerance) {
  const std::vector<float> values = TensorValues(att);
  const std::vector<int64_t> shape = Shape(att);
  if (shape.size() != 4 || shape[0] != c.input.batch || shape[1] != c.num_heads) {
    return absl::StrCat("attention shape ", ShapeString(shape));
  }
  const int64_t S = c.input.seq_len, K = c.kv_seq_len(), s = shape[2], k = shape[3];
  if (s > S || k > K || static_cast<int64_t>(values.size()) != shape[0] * shape[1] * s * k) {
    return absl::StrCat("attention shape ", ShapeString(shape), " for padded lengths ", S, ", ", K);
  }
  for (int64_t bh = 0; bh < shape[0] * shape[1]; ++bh) {
    for (int64_t i = 0; i < s; ++i) {
      for (int64_t j = 0; j < k; ++j) {
        const float got = values[(bh * s + i) * k + j];
        const float want = c.expected_probabilities[(bh * S + i) * K + j];
        if (!Near(got, want, tolerance)) {
          return absl::StrCat("attention [", bh, ", ", i, ", ", j, "]: got ", got, ", want ", want);
        }
      }
    }
  }
  return "";
}

}  // namespace

std::unique_ptr<Server> StartServer(ServerOptions options) {
  // Quiet by default; ATTNSERVE_TEST_LOG=debug (or warn...) shows the server's lines.
  const char* level_name = std::getenv("ATTNSERVE_TEST_LOG");
  auto level = ParseLogLevel(level_name ? level_name : "off");
  InitLogging(level.ok() ? *level : LogLevel::kOff, LogFormat::kText);
  options.listen = "127.0.0.1:0";
  // The default metrics port is machine-wide, and tests run side by side.
  if (options.metrics_listen == kDefaultMetricsListen) options.metrics_listen = "off";
  if (options.http_listen == kDefaultHttpListen) options.http_listen = "off";
  absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(options);
  if (!server.ok()) {
    ADD_FAILURE_AT(__FILE__, __LINE__);
    fprintf(stderr, "server did not start: %s\n", server.status().ToString().c_str());
    return nullptr;
  }
  return *std::move(server);
}

std::vector<grpc::StatusCode> FireTogether(int port, int n, const v1::ForwardRequest& request,
                                           std::chrono::milliseconds deadline) {
  std::vector<grpc::StatusCode> codes(n);
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      auto stub = v1::AttentionService::NewStub(Connect(port));
      v1::ForwardResponse response;
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + deadline);
      codes[i] = stub->Forward(&context, request, &response).error_code();
    });
  }
  for (auto& t : threads) t.join();
  return codes;
}

std::shared_ptr<grpc::Channel> Connect(int port) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  return grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port),
                                   grpc::InsecureChannelCredentials(), args);
}

void AddRawInput(inference::ModelInferRequest* request, const std::string& name,
                 const std::vector<int64_t>& shape, const float* values) {
  auto* input = request->add_inputs();
  input->set_name(name);
  input->set_datatype("FP32");
  int64_t count = 1;
  for (int64_t d : shape) {
    input->add_shape(d);
    count *= d;
  }
  request->add_raw_input_contents(
      std::string(reinterpret_cast<const char*>(values), count * sizeof(float)));
}

inference::ModelInferRequest SequenceStepRequest(const std::string& model, const float* rows,
                                                 int64_t n, int64_t width, uint64_t id, bool start,
                                                 bool end) {
  inference::ModelInferRequest request;
  request.set_model_name(model);
  AddRawInput(&request, "input", {1, n, width}, rows);
  (*request.mutable_parameters())["sequence_id"].set_uint64_param(id);
  if (start) (*request.mutable_parameters())["sequence_start"].set_bool_param(true);
  if (end) (*request.mutable_parameters())["sequence_end"].set_bool_param(true);
  return request;
}

std::vector<float> RawOutput(const inference::ModelInferResponse& response) {
  if (response.raw_output_contents_size() == 0) return {};
  const std::string& raw = response.raw_output_contents(0);
  std::vector<float> out(raw.size() / sizeof(float));
  std::memcpy(out.data(), raw.data(), raw.size());
  return out;
}

v1::Tensor MakeTensor(const std::vector<int64_t>& shape, const std::vector<float>& values,
                      bool raw) {
  v1::Tensor tensor;
  for (int64_t d : shape) tensor.add_shape(d);
  if (raw) {
    tensor.set_raw(
        std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float)));
  } else {
    tensor.mutable_values()->Assign(values.begin(), values.end());
  }
  return tensor;
}

std::vector<float> TensorValues(const v1::Tensor& tensor) {
  if (!tensor.raw().empty()) {
    std::vector<float> values(tensor.raw().size() / sizeof(float));
    std::memcpy(values.data(), tensor.raw().data(), values.size() * sizeof(float));
    return values;
  }
  return {tensor.values().begin(), tensor.values().end()};
}

std::string GoldenModelName(const test::GoldenCase& c) {
  std::string stem = std::filesystem::path(c.weights_path).stem().string();
  return stem.rfind("w_", 0) == 0 ? stem.substr(2) : stem;
}

std::vector<ModelConfig> GoldenModels(const std::vector<test::GoldenCase>& cases) {
  std::map<std::string, ModelConfig> models;
  for (const test::GoldenCase& c : cases) {
    ModelConfig config;
    config.name = GoldenModelName(c);
    config.path = c.weights_path;
    config.load = c.load_options;
    models.emplace(config.name, config);
  }
  std::vector<ModelConfig> out;
  for (auto& [name, config] : models) out.push_back(config);
  return out;
}

ServerOptions GoldenServerOptions(const std::vector<test::GoldenCase>& cases) {
  ServerOptions options;
  options.models = GoldenModels(cases);
  ModelConfig demo;
  demo.name = "demo";
  options.models.push_back(demo);
  return options;
}

void ExpectMalformedBodiesRefused(grpc::Channel* channel, const std::string& method,
                                  const std::string& valid, const std::string& type_name) {
  const std::vector<std::pair<std::string, std::string>> bodies = {
      {"garbage", "\xff\xff\xff\xff not a protobuf at all"},
      {"truncated", valid.substr(0, valid.size() / 2)},
      {"a model name longer than the body",
       "\x0a\x7f"
       "abc"},
  };
  for (const auto& [name, body] : bodies) {
    std::string reply;
    const grpc::Status status = CallRaw(channel, method, body, &reply);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << name;
    EXPECT_NE(status.error_message().find("not a valid " + type_name), std::string::npos)
        << name << ": " << status.error_message();
  }
}

v1::ForwardRequest GoldenRequest(const test::GoldenCase& c, Encoding encoding,
                                 bool return_attention) {
  v1::ForwardRequest request;
  request.set_model(GoldenModelName(c));
  switch (c.kind) {
    case core::AttentionKind::kBidirectional:
      request.set_kind(v1::ATTENTION_KIND_BIDIRECTIONAL);
      break;
    case core::AttentionKind::kCausal:
      request.set_kind(v1::ATTENTION_KIND_CAUSAL);
      break;
    case core::AttentionKind::kCross:
      request.set_kind(v1::ATTENTION_KIND_CROSS);
      break;
    case core::AttentionKind::kCausalCross:
      request.set_kind(v1::ATTENTION_KIND_CAUSAL_CROSS);
      break;
  }
  AddBatch(c.input, encoding, request.mutable_input(), request.mutable_lengths());
  if (c.context) {
    AddBatch(*c.context, encoding, request.mutable_context(), request.mutable_context_lengths());
  }
  request.set_return_attention(return_attention);
  return request;
}

std::string CompareToGolden(const test::GoldenCase& c, Encoding encoding,
                            const v1::ForwardResponse& response, float tolerance) {
  if (c.output_rows.empty() || c.expected_output.empty()) return "the case has no expectations";
  const bool raw_out = !response.output().raw().empty();
  if (raw_out != encoding.raw) return "the reply is not in the request's encoding";
  std::string diff = CompareOutput(c, encoding, response.output(), tolerance);
  if (diff.empty() && c.has_probabilities() && response.has_attention()) {
    diff = CompareAttention(c, response.attention(), tolerance);
  }
  return diff;
}

absl::StatusOr<int> HealthCheck(grpc::Channel* channel, const std::string& service) {
  grpc::GenericStub stub(channel->shared_from_this());
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  const grpc::ByteBuffer request = ToBuffer(service.empty() ? "" : LengthDelimited(1, service));
  grpc::ByteBuffer response;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&done](grpc::Status s) { done.set_value(s); });
  const grpc::Status status = done.get_future().get();
  if (!status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  }
  UnknownFieldSet fields;
  if (!fields.ParseFromString(ToString(response))) return absl::InternalError("bad health reply");
  for (int i = 0; i < fields.field_count(); ++i) {
    if (fields.field(i).number() == 1) return static_cast<int>(fields.field(i).varint());
  }
  return 0;  // proto3 default: UNKNOWN
}

v1::ForwardRequest DemoRequest(int64_t batch, int64_t seq, v1::AttentionKind kind) {
  std::vector<float> values(batch * seq * 256);
  for (size_t i = 0; i < values.size(); ++i) values[i] = std::cos(0.001f * static_cast<float>(i));
  v1::ForwardRequest r;
  r.set_model("demo");
  r.set_kind(kind);
  *r.mutable_input() = MakeTensor({batch, seq, 256}, values, true);
  return r;
}

grpc::Status CallRaw(grpc::Channel* channel, const std::string& method, const std::string& bytes,
                     std::string* reply) {
  grpc::GenericStub stub(channel->shared_from_this());
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::CompletionQueue cq;
  auto call = stub.PrepareUnaryCall(&context, method, ToBuffer(bytes), &cq);
  call->StartCall();
  grpc::ByteBuffer response;
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  cq.Next(&tag, &ok);
  *reply = ToString(response);
  return status;
}

RawStream::RawStream(grpc::Channel* channel, const std::string& method) {
  context_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  grpc::GenericStub stub(channel->shared_from_this());
  stream_ = stub.PrepareCall(&context_, method, &cq_);
  stream_->StartCall(reinterpret_cast<void*>(1));
  Await(1);
}

RawStream::~RawStream() {
  if (!finished_) {
    context_.TryCancel();
    Finish();
  }
  cq_.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq_.Next(&tag, &ok)) {
  }
}

bool RawStream::Await(int tag) {
  void* got = nullptr;
  bool ok = false;
  return cq_.Next(&got, &ok) && got == reinterpret_cast<void*>(tag) && ok;
}

bool RawStream::Exchange(const std::string& bytes, std::string* reply) {
  stream_->Write(ToBuffer(bytes), reinterpret_cast<void*>(2));
  if (!Await(2)) return false;
  grpc::ByteBuffer response;
  stream_->Read(&response, reinterpret_cast<void*>(3));
  if (!Await(3)) return false;
  *reply = ToString(response);
  return true;
}

grpc::Status RawStream::Finish() {
  finished_ = true;
  stream_->WritesDone(reinterpret_cast<void*>(4));
  Await(4);
  grpc::Status status;
  stream_->Finish(&status, reinterpret_cast<void*>(5));
  Await(5);
  return status;
}

absl::StatusOr<std::vector<std::string>> ReflectionServices(grpc::Channel* channel) {
  grpc::GenericStub stub(channel->shared_from_this());
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::CompletionQueue cq;
  auto stream = stub.PrepareCall(
      &context, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  void* tag = nullptr;
  bool ok = false;
  auto step = [&](int id) {
    return cq.Next(&tag, &ok) && ok && tag == reinterpret_cast<void*>(id);
  };
  stream->StartCall(reinterpret_cast<void*>(1));
  if (!step(1)) return absl::UnavailableError("reflection: call did not start");
  stream->Write(ToBuffer(LengthDelimited(7, "*")), reinterpret_cast<void*>(2));
  if (!step(2)) return absl::UnavailableError("reflection: write failed");
  grpc::ByteBuffer reply;
  stream->Read(&reply, reinterpret_cast<void*>(3));
  if (!step(3)) return absl::UnavailableError("reflection: no reply");
  stream->WritesDone(reinterpret_cast<void*>(4));
  step(4);
  grpc::Status status;
  stream->Finish(&status, reinterpret_cast<void*>(5));
  step(5);
  UnknownFieldSet fields;
  if (!fields.ParseFromString(ToString(reply))) return absl::InternalError("bad reflection reply");
  std::vector<std::string> names;
  for (int i = 0; i < fields.field_count(); ++i) {
    if (fields.field(i).number() != 6) continue;  // list_services_response
    UnknownFieldSet list;
    list.ParseFromString(fields.field(i).length_delimited());
    for (int j = 0; j < list.field_count(); ++j) {
      UnknownFieldSet service;
      service.ParseFromString(list.field(j).length_delimited());
      for (int k = 0; k < service.field_count(); ++k) {
        if (service.field(k).number() == 1) names.push_back(service.field(k).length_delimited());
      }
    }
  }
  return names;
}

ChildServer::ChildServer(const std::vector<std::string>& args, const std::string& output_path,
                         int max_open_files)
    : output_path_(output_path) {
  std::vector<std::string> argv_storage = {ATTNSERVE_BINARY};
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  // The default metrics port is machine-wide, and tests run side by side.
  if (std::none_of(args.begin(), args.end(),
                   [](const std::string& a) { return a.starts_with("--metrics-listen"); })) {
    argv_storage.push_back("--metrics-listen=off");
  }
  if (std::none_of(args.begin(), args.end(),
                   [](const std::string& a) { return a.starts_with("--http-listen"); })) {
    argv_storage.push_back("--http-listen=off");
  }
  std::vector<char*> argv;
  for (std::string& a : argv_storage) argv.push_back(a.data());
  argv.push_back(nullptr);
  if (max_open_files > 0) {
    // posix_spawn cannot set a limit; only async-signal-safe calls between fork and exec.
    const int out = open(output_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    pid_ = fork();
    if (pid_ == 0) {
      dup2(out, 1);
      dup2(out, 2);
      const rlimit limit{static_cast<rlim_t>(max_open_files), static_cast<rlim_t>(max_open_files)};
      setrlimit(RLIMIT_NOFILE, &limit);
      execve(argv[0], argv.data(), environ);
      _exit(127);
    }
    close(out);
    return;
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, output_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  if (posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), environ) != 0) pid_ = -1;
  posix_spawn_file_actions_destroy(&actions);
}

ChildServer::~ChildServer() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
}

int ChildServer::WaitForPort(const std::string& port_file, std::chrono::milliseconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    std::ifstream in(port_file);
    int port = 0;
    if (in >> port && port > 0) return port;
    if (pid_ > 0 && waitpid(pid_, nullptr, WNOHANG) == pid_) {
      pid_ = -1;  // exited early
      return 0;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return 0;
}

void ChildServer::Signal(int signal) {
  if (pid_ > 0) kill(pid_, signal);
}

int ChildServer::Wait(std::chrono::milliseconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (pid_ > 0) {
    int status = 0;
    const pid_t done = waitpid(pid_, &status, WNOHANG);
    if (done == pid_) {
      pid_ = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    }
    if (std::chrono::steady_clock::now() > end) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
      pid_ = -1;
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return -1;
}

bool ChildServer::Exited(int* exit_code) {
  if (pid_ <= 0) return false;
  int status = 0;
  if (waitpid(pid_, &status, WNOHANG) != pid_) return false;
  pid_ = -1;
  *exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return true;
}

std::string ChildServer::Output() const {
  std::ifstream in(output_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool ChildServer::WaitForOutput(std::string_view text, std::chrono::milliseconds timeout) const {
  return WaitFor([&] { return Output().find(text) != std::string::npos; }, timeout);
}

bool WaitFor(const std::function<bool()>& done, std::chrono::milliseconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return done();
}

std::string TempPath(const std::string& name) {
  static const std::string dir = test::MakeTempDir("test");
  return dir + "/" + name;
}

}  // namespace attnserve::server::testing
