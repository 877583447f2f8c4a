// serving_load: drives one gRPC method of a server with N callers in a closed loop for a fixed
// time and prints one JSON line: calls/s, latency percentiles, status codes and the server's CPU
// per call (from /proc/PID/stat). The request is serialized once and sent as bytes through
// gRPC's generic stub on the callback API, so the client costs next to nothing per call and the
// same for every server and method: gRPC's health Check on the same server is the floor.
//
//   serving_load --target 127.0.0.1:50051 --pid PID --method forward|infer|health --batch 1
//                --seq 16 --callers 8 --seconds 5

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "attnserve/v1/attention.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"
#include "inference/grpc_service.pb.h"
#include "tests/bench/proc_cpu.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string target, method = "forward", kind = "bidirectional", model;
  int pid = 0, batch = 1, seq = 16, width = 256, callers = 8;
  double seconds = 5, warmup = 1;
};

// The call's input, [batch, seq, width] float32 from a fixed seed.
std::vector<float> Input(const Options& o) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> x(static_cast<size_t>(o.batch) * o.seq * o.width);
  for (float& v : x) v = normal(rng);
  return x;
}

// The same call as ForwardBytes over the Open Inference Protocol (raw FP32 input, `kind`).
std::string InferBytes(const Options& o) {
  inference::ModelInferRequest request;
  request.set_model_name(o.model);
  (*request.mutable_parameters())["kind"].set_string_param(o.kind);
  auto* input = request.add_inputs();
  input->set_name("input");
  input->set_datatype("FP32");
  input->add_shape(o.batch);
  input->add_shape(o.seq);
  input->add_shape(o.width);
  const std::vector<float> x = Input(o);
  request.add_raw_input_contents()->assign(reinterpret_cast<const char*>(x.data()),
                                           x.size() * sizeof(float));
  return request.SerializeAsString();
}

std::string ForwardBytes(const Options& o) {
  attnserve::v1::ForwardRequest request;
  request.set_model(o.model);
  attnserve::v1::AttentionKind kind;
  std::string upper = "ATTENTION_KIND_" + o.kind;
  std::transform(upper.begin(), upper.end(), upper.begin(), ::toupper);
  if (!attnserve::v1::AttentionKind_Parse(upper, &kind))
    kind = attnserve::v1::ATTENTION_KIND_UNSPECIFIED;
  request.set_kind(kind);
  const std::vector<float> x = Input(o);
  auto* input = request.mutable_input();
  input->add_shape(o.batch);
  input->add_shape(o.seq);
  input->add_shape(o.width);
  input->set_raw(reinterpret_cast<const char*>(x.data()), x.size() * sizeof(float));
  return request.SerializeAsString();
}

// The callers: each sends its next call from the previous one's completion.
class Load {
 public:
  Load(std::shared_ptr<grpc::Channel> channel, std::string method, const std::string& body)
      : stub_(std::move(channel)), method_(std::move(method)) {
    grpc::Slice slice(body);
    request_ = grpc::ByteBuffer(&slice, 1);
  }

  void Start(int callers) {
    for (int i = 0; i < callers; ++i) Send();
  }
  void Measure(bool on) { measuring_.store(on); }
  // Stops sending and waits for the calls in flight.
  void Stop() {
    stop_.store(true);
    std::unique_lock lock(mu_);
    cv_.wait(lock, [this] { return in_flight_ == 0; });
  }
  std::map<std::string, int64_t> codes() {
    std::lock_guard lock(mu_);
    return codes_;
  }
  std::vector<double> latencies_ms() {
    std::lock_guard lock(mu_);
    return latencies_;
  }

 private:
  struct Call {
    grpc::ClientContext context;
    grpc::ByteBuffer response;
    Clock::time_point start;
  };

  void Send() {
    {
      std::lock_guard lock(mu_);
      ++in_flight_;
    }
    auto* call = new Call;
    call->start = Clock::now();
    call->context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    stub_.UnaryCall(&call->context, method_, grpc::StubOptions(), &request_, &call->response,
                    [this, call](grpc::Status status) { Done(call, status); });
  }

  void Done(Call* call, const grpc::Status& status) {
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - call->start).count();
    delete call;
    static const char* kNames[] = {"OK",
                                   "CANCELLED",
                                   "UNKNOWN",
                                   "INVALID_ARGUMENT",
                                   "DEADLINE_EXCEEDED",
                                   "NOT_FOUND",
                                   "ALREADY_EXISTS",
                                   "PERMISSION_DENIED",
                                   "RESOURCE_EXHAUSTED",
                                   "FAILED_PRECONDITION",
                                   "ABORTED",
                                   "OUT_OF_RANGE",
                                   "UNIMPLEMENTED",
                                   "INTERNAL",
                                   "UNAVAILABLE",
                                   "DATA_LOSS",
                                   "UNAUTHENTICATED"};
    const int code = status.error_code();
    bool again = !stop_.load();
    {
      std::lock_guard lock(mu_);
      if (measuring_.load()) {
        latencies_.push_back(ms);
        ++codes_[code >= 0 && code <= 16 ? kNames[code] : "OTHER"];
      }
      --in_flight_;
      if (!again && in_flight_ == 0) cv_.notify_all();
    }
    if (again) Send();
  }

  grpc::GenericStub stub_;
  const std::string method_;
  grpc::ByteBuffer request_;
  std::atomic<bool> measuring_{false}, stop_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  int in_flight_ = 0;
  std::map<std::string, int64_t> codes_;
  std::vector<double> latencies_;
};

double Percentile(std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  return sorted[std::min(sorted.size() - 1, static_cast<size_t>(p / 100 * sorted.size()))];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"serving_load: closed-loop load on one gRPC method, one JSON line of figures"};
  Options o;
  app.add_option("--target", o.target)->required();
  app.add_option("--pid", o.pid, "server process, for its CPU per call");
  app.add_option("--method", o.method)->check(CLI::IsMember({"health", "forward", "infer"}));
  app.add_option("--batch", o.batch);
  app.add_option("--seq", o.seq);
  app.add_option("--width", o.width, "the model's d_model");
  app.add_option("--kind", o.kind);
  app.add_option("--model", o.model);
  app.add_option("--callers", o.callers);
  app.add_option("--seconds", o.seconds);
  app.add_option("--warmup", o.warmup);
  CLI11_PARSE(app, argc, argv);

  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  auto channel = grpc::CreateCustomChannel(o.target, grpc::InsecureChannelCredentials(), args);
  std::string method = "/attnserve.v1.AttentionService/Forward", body;
  if (o.method == "health") {
    method = "/grpc.health.v1.Health/Check";
  } else if (o.method == "infer") {
    method = "/inference.GRPCInferenceService/ModelInfer";
    body = InferBytes(o);
  } else {
    body = ForwardBytes(o);
  }
  Load load(channel, method, body);
  load.Start(o.callers);
  std::this_thread::sleep_for(std::chrono::duration<double>(o.warmup));
  const double cpu0 = o.pid ? attnserve::bench::CpuSeconds(o.pid, "serving_load") : 0;
  const auto t0 = Clock::now();
  load.Measure(true);
  std::this_thread::sleep_for(std::chrono::duration<double>(o.seconds));
  load.Measure(false);
  const double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
  const double cpu1 = o.pid ? attnserve::bench::CpuSeconds(o.pid, "serving_load") : 0;
  load.Stop();

  const std::map<std::string, int64_t> codes = load.codes();
  int64_t calls = 0;
  std::string codes_json;
  for (const auto& [name, count] : codes) {
    calls += count;
    codes_json += (codes_json.empty() ? "" : ", ") + ("\"" + name + "\": " + std::to_string(count));
  }
  const int64_t ok = codes.count("OK") ? codes.at("OK") : 0;
  std::vector<double> latencies = load.latencies_ms();
  std::sort(latencies.begin(), latencies.end());
  std::printf(
      "{\"method\": \"%s\", \"batch\": %d, \"seq\": %d, \"callers\": %d, \"calls\": %lld, "
      "\"ok\": %lld, \"codes\": {%s}, \"calls_per_s\": %.1f, \"ok_per_s\": %.1f, "
      "\"server_cpu_us_per_call\": %.1f, \"p50_ms\": %.3f, \"p99_ms\": %.3f}\n",
      o.method.c_str(), o.batch, o.seq, o.callers, static_cast<long long>(calls),
      static_cast<long long>(ok), codes_json.c_str(), calls / elapsed, ok / elapsed,
      (cpu1 - cpu0) / std::max<int64_t>(calls, 1) * 1e6, Percentile(latencies, 50),
      Percentile(latencies, 99));
  return 0;
}
