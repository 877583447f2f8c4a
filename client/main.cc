// attnserve-client: calls, checks and load-tests an attnserve server.
// Exit status: 0 on success, the gRPC status code's number on a failed call or bad input
// (NOT_FOUND -> 5, UNAVAILABLE -> 14, ...), CLI11's codes (>= 100) on a malformed command line.
#include <iostream>

#include "CLI/CLI.hpp"
#include "client/cli.h"

namespace {

using attnserve::client::CallFlags;
using attnserve::client::ConnectionFlags;
using attnserve::client::ForwardFlags;
using attnserve::client::LoadFlags;
using attnserve::client::ResolveSecurityFlags;
using attnserve::client::RunForwardCommand;
using attnserve::client::RunHealth;
using attnserve::client::RunLoadCommand;
using attnserve::client::RunModels;

// The flags that describe one Forward call, shared by `infer` and `bench`.
void AddCallFlags(CLI::App* command, CallFlags& f) {
  command->add_option("--model", f.model, "Model name (default: the server's only model)");
  command
      ->add_option("--model-version", f.model_version,
                   "Model version (default 0: the newest ready one)")
      ->capture_default_str();
  command->add_option("--kind", f.kind, "Attention kind")
      ->check(CLI::IsMember(attnserve::client::KindNameList()))
      ->capture_default_str();
  command->add_option("--input", f.input, "Input .npy: [B,S,d_model] padded or [T,d_model] packed");
  command->add_option("--random", f.random, "Random input of shape B,S (width from the model)");
  command->add_option("--lengths", f.lengths, "Sequence lengths, e.g. 3,5 (default: all full)");
  command->add_option("--context", f.context, "Context .npy for cross kinds");
  command->add_option("--context-random", f.context_random, "Random context of shape B,S_ctx");
  command->add_option("--context-lengths", f.context_lengths, "Context lengths, e.g. 7,2");
  command->add_flag("--packed", f.packed, "Send [B,S,d] arrays packed (no padding on the wire)");
  command->add_option("--encoding", f.encoding, "Float encoding on the wire")
      ->check(CLI::IsMember({"raw", "values"}))
      ->capture_default_str();
  command->add_option("--seed", f.seed, "Seed of the random arrays")->capture_default_str();
}

// `infer`, the user-facing name of one v1 Forward call (a contract: scripts and docs use it).
void AddForwardCommand(CLI::App& app, ForwardFlags& f) {
  CLI::App* forward = app.add_subcommand("infer", "Run one Forward call");
  AddCallFlags(forward, f.call);
  forward->add_flag("--return-attention", f.return_attention, "Also return the probabilities");
  forward->add_option("--output", f.output, "Write the output to this .npy (default: print it)");
  forward->add_option("--attention-output", f.attention_output,
                      "Write the probabilities [B,H,S,S_kv] to this .npy");
}

// `bench`, the user-facing name of the load test (a contract: scripts and docs use it).
void AddLoadCommand(CLI::App& app, LoadFlags& f) {
  CLI::App* load = app.add_subcommand(
      "bench", "Load-test: closed or open loop, sweeps, mixed workloads, JSON/CSV/HTML reports");
  AddCallFlags(load, f.call);
  load->add_option("--connections", f.connections,
                   "Connections (channels) calls are spread over, 1 to 256 (--http: default, the "
                   "calls in flight)")
      ->capture_default_str()
      ->each([&f](const std::string&) { f.connections_given = true; });
  load->add_flag("--http", f.http,
                 "Send the Open Inference Protocol's REST infer calls to --target, the REST port "
                 "(default localhost:8000), over keep-alive HTTP/1.1, instead of gRPC Forward");
  load->add_option("--http-encoding", f.http_encoding,
                   "--http: tensors as JSON text, or binary (Triton's binary tensor extension)")
      ->check(CLI::IsMember({"json", "binary"}))
      ->capture_default_str();
  load->add_option("--concurrency,-c", f.concurrency, "Closed loop: calls in flight")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str()
      ->each([&f](const std::string&) { f.concurrency_given = true; });
  load->add_option("--rate", f.rate, "Open loop: calls per second, sent on schedule")
      ->each([&f](const std::string&) { f.rate_given = true; });
  load->add_option("--arrival", f.arrival, "Open loop: gaps between calls")
      ->check(CLI::IsMember({"constant", "poisson"}))
      ->capture_default_str()
      ->each([&f](const std::string&) { f.arrival_given = true; });
  load->add_option("--max-in-flight", f.max_in_flight,
                   "Open loop: calls in flight at most; calls due past it are late or unsent")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  load->add_option("--concurrency-range", f.concurrency_range,
                   "Sweep: START:END[:STEP], STEP +N (default 1) or xF");
  load->add_option("--rate-range", f.rate_range,
                   "Sweep: START:END[:STEP] calls/s, STEP +N or xF (default x2)");
  load->add_option("--duration", f.duration_seconds,
                   "Seconds of each step's window (0: until --requests)")
      ->capture_default_str();
  load->add_option("--warmup-seconds", f.warmup_seconds, "Load before each window, not counted")
      ->capture_default_str();
  load->add_option("--requests,-n", f.requests, "Calls per window at most (0: no limit)")
      ->check(CLI::NonNegativeNumber);
  load->add_option("--warmup", f.warmup, "Calls sent one by one first, which must succeed")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  load->add_option("--stability-percent", f.stability_percent,
                   "Repeat each window until 3 agree within this % (0: one window)");
  load->add_option("--max-trials", f.max_trials, "Windows per step at most with a stability check")
      ->check(CLI::Range(3, 1000))
      ->capture_default_str();
  load->add_option("--latency-limit-ms", f.latency_limit_ms,
                   "Sweep: stop after the first step whose p99 passes this");
  load->add_option("--lengths-uniform", f.lengths_uniform,
                   "Mix: each sequence's valid length uniform in MIN:MAX");
  load->add_option("--lengths-list", f.lengths_list,
                   "Mix: lengths drawn from a list, e.g. 16,64,256");
  load->add_option("--kinds", f.kinds, "Mix: kinds taken in turn, e.g. bidirectional,causal");
  load->add_option("--workload", f.workload,
                   "Mix: JSON-lines file, one request a line: {\"kind\",\"lengths\",...}");
  load->add_option("--pool", f.pool, "Mix: distinct requests made up front")->capture_default_str();
  load->add_flag("--json", f.json, "Print the report as JSON");
  load->add_flag("--csv", f.csv, "Print the report as CSV, a row per step");
  load->add_option("--html", f.html, "Also write a self-contained HTML report with charts");
  load->add_option("--metrics-url", f.metrics_url,
                   "attnserve's http://HOST:PORT/metrics: the server's queue/compute split");
  load->get_option("--kind")->each([&f](const std::string&) { f.kind_given = true; });
  load->add_flag("--decode", f.decode,
                 "Session mode: --sessions Decode streams, each a prompt then steps (causal)");
  load->add_option("--sessions", f.sessions,
                   "--decode: sessions (streams) at once; at most 100 a connection, so more "
                   "sessions open more connections than --connections")
      ->capture_default_str();
  load->add_option("--prompt", f.prompt, "--decode: prompt tokens per sequence")
      ->capture_default_str();
  load->add_option("--steps", f.steps, "--decode: steps after the prompt")->capture_default_str();
  load->add_option("--tokens-per-step", f.tokens_per_step, "--decode: tokens per sequence a step")
      ->capture_default_str();
  load->add_option("--batch", f.batch, "--decode: sequences per session (B)")
      ->capture_default_str();
  load->add_option("--feed", f.feed, "--decode: each step's input: the last output, or random")
      ->check(CLI::IsMember({"output", "random"}))
      ->capture_default_str();
  load->add_option("--prompt-chunk", f.prompt_chunk,
                   "--decode: prompt tokens per sequence a message (0: what fits 32 MiB)");
}

// The flags every subcommand shares, before the subcommand's name: where the server is, how
// long to wait, TLS and the token.
void AddConnectionFlags(CLI::App& app, ConnectionFlags& c) {
  app.add_option("--target", c.target, "Server address host:port")
      ->capture_default_str()
      ->each([&c](const std::string&) { c.target_given = true; });
  app.add_option("--timeout", c.timeout_seconds, "Deadline per call, seconds (0: none)")
      ->capture_default_str();
  app.add_option("--max-message-mib", c.max_message_mib, "Largest message accepted")
      ->check(CLI::Range(1, 2047))
      ->capture_default_str();
  app.add_option("--lb-policy", c.lb_policy,
                 "round_robin: spread calls over every address of the target (dns:///...)")
      ->check(CLI::IsMember({"pick_first", "round_robin"}));
  app.add_option("--tls-ca", c.tls_ca,
                 "PEM CA bundle: connect with TLS, trusting servers it signed");
  app.add_option("--tls-cert", c.tls_cert, "PEM client certificate chain, for mTLS");
  app.add_option("--tls-key", c.tls_key, "PEM private key of --tls-cert");
  app.add_option("--token", c.token,
                 "Bearer token sent on every call (better: the ATTNSERVE_TOKEN environment "
                 "variable, which `ps` does not show)");
  app.add_flag("--no-retry", c.no_retry,
               "Do not retry Forward and ListModels on UNAVAILABLE (by default: up to 5 attempts, "
               "backoff 0.1 s doubling to 1 s, e.g. on another replica when one dies)");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"attnserve-client: call, check and load-test an attnserve server"};
  app.require_subcommand(1);
  app.footer(
      "Exit status: 0 on success, else the gRPC status code's number (INVALID_ARGUMENT 3,\n"
      "NOT_FOUND 5, UNAVAILABLE 14, ...); `health` exits 0 only when the server is SERVING.");
  ConnectionFlags connection;
  AddConnectionFlags(app, connection);
  ForwardFlags forward;
  AddForwardCommand(app, forward);
  LoadFlags load;
  AddLoadCommand(app, load);
  bool models_json = false;
  app.add_subcommand("models", "List the loaded models")
      ->add_flag("--json", models_json, "Print JSON instead of a table");
  std::string service;
  app.add_subcommand("health", "grpc.health.v1 check: exit 0 only when SERVING")
      ->add_option("--service", service, "Service to check (default: the whole server)");
  CLI11_PARSE(app, argc, argv);

  absl::Status status = ResolveSecurityFlags(&connection);
  if (status.ok()) {
    if (app.got_subcommand("infer")) status = RunForwardCommand(connection, forward);
    if (app.got_subcommand("bench")) status = RunLoadCommand(connection, load);
    if (app.got_subcommand("models")) status = RunModels(connection, models_json);
    if (app.got_subcommand("health")) status = RunHealth(connection, service);
  }
  if (status.ok()) return 0;
  std::cerr << "attnserve-client: " << absl::StatusCodeToString(status.code()) << ": "
            << status.message() << "\n";
  return static_cast<int>(status.code());
}
