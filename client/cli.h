#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/client.h"
#include "client/load_report.h"

// The attnserve-client subcommands. Each Run* returns the status the process exits with:
// OK -> 0, otherwise the status code's number (NOT_FOUND -> 5), after printing it.
namespace attnserve::client {

// Flags every subcommand shares: where the server is and how long to wait.
struct ConnectionFlags {
  std::string target = "localhost:50051";
  bool target_given = false;    // bench --http's default is the REST port, localhost:8000
  double timeout_seconds = 30;  // per call; 0: no deadline
  int max_message_mib = 256;
  std::string lb_policy;  // e.g. round_robin; empty: gRPC's default
  std::string tls_ca;     // PEM file: TLS, trusting this CA; empty: plaintext
  std::string tls_cert;   // PEM files: this client's certificate and key, for mTLS
  std::string tls_key;
  std::string token;      // bearer token; empty: $ATTNSERVE_TOKEN, if set
  bool no_retry = false;  // turns off ClientOptions::retry
};

// The environment variable a token may come from instead of --token (so it is not in `ps`).
inline constexpr char kTokenEnvironmentVariable[] = "ATTNSERVE_TOKEN";

// Checks the TLS flags and that their files can be read, and takes the token from the
// environment when --token is not given.
absl::Status ResolveSecurityFlags(ConnectionFlags* flags);

// Flags that describe one Forward call (`infer` sends it once, `bench` many times).
struct CallFlags {
  std::string model;
  uint64_t model_version = 0;  // 0: the newest ready version
  std::string kind = "bidirectional";
  std::string input;           // .npy file, [B, S, d] padded or [T, d] packed
  std::string random;          // "B,S": random [B, S, d_model] input instead of a file
  std::string lengths;         // "3,5": one per sequence
  std::string context;         // .npy file for the cross kinds
  std::string context_random;  // "B,S": random [B, S, d_context] context instead of a file
  std::string context_lengths;
  bool packed = false;  // send [B, S, d] arrays without their padding
  std::string encoding = "raw";
  uint64_t seed = 1;  // of the random arrays
};

// A call ready to send, and how to give its output back the input file's shape.
struct PreparedCall {
  ForwardRequestSpec call;
  int64_t unpack_to = -1;  // packed by us from [B, S, d]: unpack the output to S rows; -1: no
};

// Flags of `infer`.
struct ForwardFlags {
  CallFlags call;
  bool return_attention = false;
  std::string output;            // .npy path for the output; empty: print a summary
  std::string attention_output;  // .npy path for the probabilities (implies return_attention)
};

// Flags of `bench` (README "Load test" describes them).
struct LoadFlags {
  CallFlags call;
  int connections = 1;
  bool connections_given = false;
  bool http = false;                   // REST infer calls instead of gRPC Forward
  std::string http_encoding = "json";  // --http: json or binary
  int concurrency = 4;                 // closed loop
  double rate = 0;                     // > 0: open loop at this many calls/s
  std::string arrival = "constant";
  // Which load flags were on the command line, so a value the run would ignore (or --rate 0)
  // is refused rather than silently dropped.
  bool rate_given = false, concurrency_given = false, arrival_given = false;
  int max_in_flight = 1000;
  std::string concurrency_range;  // START:END[:STEP]
  std::string rate_range;         // START:END[:STEP], STEP may be xF (multiply)
  double duration_seconds = 10;   // the window of each step
  double warmup_seconds = 0.5;    // load before each step's window, not counted
  int64_t requests = 0;
  int warmup = 2;  // calls checked one by one before the load
  double stability_percent = 0;
  int max_trials = 10;
  double latency_limit_ms = 0;
  std::string lengths_uniform;  // MIN:MAX
  std::string lengths_list;     // "16,64,256"
  std::string kinds;            // "causal,bidirectional"
  std::string workload;         // JSON-lines file of requests
  int pool = 32;                // distinct requests of a mixed workload
  bool json = false;
  bool csv = false;
  std::string html;
  std::string metrics_url;
  // Session mode (--decode): --sessions streams, each a --prompt of P tokens per sequence, then
  // --steps of --tokens-per-step tokens, B = --batch sequences per session.
  bool decode = false;
  int sessions = 1;
  int prompt = 128;
  int steps = 32;
  int tokens_per_step = 1;
  int batch = 1;
  std::string feed = "output";  // each step's input: the last output, or "random"
  int prompt_chunk = 0;         // prompt tokens per sequence per message; 0: what fits 32 MiB
  bool kind_given = false;      // --decode defaults to causal rather than bidirectional
};

// Finds a model by name ("" for the only one) and version (0: the newest): AttentionClient's
// FindModel over gRPC, or the REST metadata.
using ModelFinder =
    std::function<absl::StatusOr<v1::ModelInfo>(const std::string& name, uint64_t version)>;

// The gRPC model finder of `client` (which outlives it).
ModelFinder GrpcModelFinder(const AttentionClient& client);

// Reads or makes the arrays the flags name (random ones as wide as `find_model` says the model
// is) and assembles the call.
absl::StatusOr<PreparedCall> PrepareCall(const ModelFinder& find_model, const CallFlags& flags);

// Opens a client with the connection flags (after ResolveSecurityFlags); clients with different
// indexes use different connections (the load test's --connections).
std::unique_ptr<AttentionClient> ConnectFromFlags(const ConnectionFlags& flags,
                                                  int connection_index = 0);

// Uniform values in [-1, 1) from a fixed seed, so two runs send the same data.
FloatArray RandomArray(std::vector<int64_t> shape, uint64_t seed);

// `infer` (a v1 Forward call, not the Open Inference Protocol's): one call, output to a .npy
// file or printed.
absl::Status RunForwardCommand(const ConnectionFlags& connection, const ForwardFlags& flags);

// `models`: the loaded models as a table (or JSON).
absl::Status RunModels(const ConnectionFlags& connection, bool json);

// `health`: OK only when the server (or `service`) is SERVING.
absl::Status RunHealth(const ConnectionFlags& connection, const std::string& service);

// `bench`: the load test.
absl::Status RunLoadCommand(const ConnectionFlags& connection, const LoadFlags& flags);

// `bench --decode`: the session load test (RunLoadCommand sends --decode here).
absl::Status RunDecodeLoadCommand(const ConnectionFlags& connection, const LoadFlags& flags);

// Writes a report file, or PERMISSION_DENIED.
absl::Status WriteReportFile(const std::string& path, const std::string& text);

// Prints the run as --json, --csv or the summary, and writes --html.
absl::Status PrintLoadRun(const LoadFlags& flags, const LoadRun& run);

}  // namespace attnserve::client
