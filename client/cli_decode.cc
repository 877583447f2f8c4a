// bench --decode: the session load test's flags, its messages, and its run.
#include <algorithm>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/cli.h"
#include "client/load_decode.h"
#include "client/metrics_scrape.h"
#include "client/packing.h"

namespace attnserve::client {
namespace {

// The most sessions (streams) the load tester puts on one connection.
constexpr int kSessionsPerConnection = 100;

// Prompt messages stay below this many bytes of input (the default size limits are larger).
constexpr int64_t kPromptChunkBytes = 32 << 20;
// Distinct prompts made up front, taken in turn by the sessions.
constexpr int kPromptPool = 4;
constexpr int kMaxSessions = 4096;

absl::Status CheckDecodeFlags(const LoadFlags& f) {
  if (f.rate_given || f.concurrency_given || !f.rate_range.empty() ||
      !f.concurrency_range.empty() || f.arrival_given) {
    return absl::InvalidArgumentError(
        "--decode runs --sessions streams: --rate, --concurrency and sweeps do not apply");
  }
  if (!f.workload.empty() || !f.lengths_uniform.empty() || !f.lengths_list.empty() ||
      !f.kinds.empty() || !f.call.input.empty() || !f.call.random.empty() ||
      !f.call.lengths.empty() || f.call.packed || !f.call.context.empty()) {
    return absl::InvalidArgumentError(
        "--decode makes its own inputs from --prompt, --steps, --tokens-per-step and --batch");
  }
  if (f.stability_percent > 0 || f.latency_limit_ms > 0) {
    return absl::InvalidArgumentError(
        "--stability-percent and --latency-limit-ms are not for --decode");
  }
  if (f.sessions < 1 || f.sessions > kMaxSessions) {
    return absl::InvalidArgumentError(
        absl::StrCat("--sessions must be in [1, ", kMaxSessions, "]"));
  }
  if (f.prompt < 1 || f.steps < 0 || f.tokens_per_step < 1 || f.batch < 1 || f.prompt_chunk < 0) {
    return absl::InvalidArgumentError(
        "--prompt, --tokens-per-step and --batch must be >= 1, --steps and --prompt-chunk >= 0");
  }
  if (f.feed != "output" && f.feed != "random") {
    return absl::InvalidArgumentError("--feed is output or random");
  }
  if (f.json && f.csv) return absl::InvalidArgumentError("give --json or --csv, not both");
  if (!f.metrics_url.empty() && f.metrics_url.rfind("http://", 0) != 0) {
    return absl::InvalidArgumentError("--metrics-url must be http://HOST:PORT/PATH");
  }
  return absl::OkStatus();
}

// Random tokens [B, n, width] as one message.
absl::StatusOr<v1::DecodeRequest> RandomMessage(int64_t batch, int64_t n, int64_t width,
                                                Encoding encoding, uint64_t seed) {
  return BuildDecodeRequest(RandomArray({batch, n, width}, seed), {}, std::nullopt, encoding);
}

// The sessions' work: the prompt pool in chunks, the step message, the session's options.
absl::StatusOr<DecodeWork> BuildDecodeWork(const AttentionClient& client, const LoadFlags& f) {
  absl::StatusOr<v1::ModelInfo> model = client.FindModel(f.call.model);
  if (!model.ok()) return model.status();
  absl::StatusOr<Encoding> encoding = ParseEncoding(f.call.encoding);
  if (!encoding.ok()) return encoding.status();
  absl::StatusOr<v1::AttentionKind> kind =
      f.kind_given ? ParseKind(f.call.kind) : v1::ATTENTION_KIND_CAUSAL;
  if (!kind.ok()) return kind.status();
  if (*kind != v1::ATTENTION_KIND_CAUSAL && *kind != v1::ATTENTION_KIND_CAUSAL_CROSS) {
    return absl::InvalidArgumentError("--decode sessions are causal or causal_cross (--kind)");
  }
  const int64_t width = model->d_model();
  DecodeWork work;
  work.session.model = f.call.model;
  work.session.kind = *kind;
  work.session.batch = f.batch;
  work.session.encoding = *encoding;
  if (*kind == v1::ATTENTION_KIND_CAUSAL_CROSS) {
    absl::StatusOr<std::vector<int32_t>> dims = ParseIntList(f.call.context_random);
    if (!dims.ok() || dims->size() != 2 || (*dims)[0] != f.batch || (*dims)[1] < 1) {
      return absl::InvalidArgumentError(
          "--decode --kind causal_cross needs --context-random B,S_ctx with B = --batch");
    }
    work.session.context = RandomArray({f.batch, (*dims)[1], model->d_context()}, f.call.seed + 99);
  }
  const int64_t row_bytes = int64_t{f.batch} * width * 4;
  const int64_t chunk =
      f.prompt_chunk > 0 ? f.prompt_chunk : std::max<int64_t>(1, kPromptChunkBytes / row_bytes);
  const int pool = std::min(kPromptPool, f.sessions);
  for (int p = 0; p < pool; ++p) {
    std::vector<v1::DecodeRequest> chunks;
    for (int64_t at = 0; at < f.prompt; at += chunk) {
      const int64_t n = std::min<int64_t>(chunk, f.prompt - at);
      absl::StatusOr<v1::DecodeRequest> m =
          RandomMessage(f.batch, n, width, *encoding, f.call.seed + 1000 * p + at);
      if (!m.ok()) return m.status();
      chunks.push_back(*std::move(m));
    }
    work.prompts.push_back(std::move(chunks));
  }
  work.prompt_tokens = int64_t{f.prompt} * f.batch;
  absl::StatusOr<v1::DecodeRequest> step =
      RandomMessage(f.batch, f.tokens_per_step, width, *encoding, f.call.seed + 7);
  if (!step.ok()) return step.status();
  work.step = *std::move(step);
  work.steps = f.steps;
  work.tokens_per_step = f.tokens_per_step;
  work.feed_output = f.feed == "output";
  return work;
}

}  // namespace

absl::Status RunDecodeLoadCommand(const ConnectionFlags& connection, const LoadFlags& flags) {
  if (absl::Status s = CheckDecodeFlags(flags); !s.ok()) return s;
  // Streams need no per-call deadline: a step waits at most --timeout (DecodeSession's).
  // A connection carries at most kSessionsPerConnection sessions: a server takes only so many
  // streams on one connection (attnserve --max-streams-per-connection, 128 by default; gRPC's
  // servers 100 unless set), and sessions whose streams wait for a place would hold every other
  // session at the prompts' barrier until the step timeout.
  const int connection_count =
      std::max(std::clamp(flags.connections, 1, 256),
               (flags.sessions + kSessionsPerConnection - 1) / kSessionsPerConnection);
  std::vector<std::unique_ptr<AttentionClient>> clients;
  std::vector<const AttentionClient*> connections;
  for (int i = 0; i < connection_count; ++i) {
    clients.push_back(ConnectFromFlags(connection, i));
    connections.push_back(clients.back().get());
  }
  absl::StatusOr<DecodeWork> work = BuildDecodeWork(*clients[0], flags);
  if (!work.ok()) return work.status();
  std::vector<MetricSample> before;
  if (!flags.metrics_url.empty()) {
    absl::StatusOr<std::vector<MetricSample>> s = ScrapeMetrics(flags.metrics_url);
    if (!s.ok()) return s.status();
    before = *std::move(s);
  }
  absl::StatusOr<StepReport> report = RunDecodeLoad(connections, *work, flags.sessions);
  if (!report.ok()) return report.status();
  LoadStep step{.report = *std::move(report), .server = std::nullopt};
  if (!flags.metrics_url.empty()) {
    absl::StatusOr<std::vector<MetricSample>> after = ScrapeMetrics(flags.metrics_url);
    if (!after.ok()) return after.status();
    step.server = DiffServerMetrics(before, *after, flags.call.model);
  }
  LoadRun run;
  run.target = connection.target;
  run.workload = absl::StrFormat(
      "decode: %d session%s of B=%d, %s, prompt %d then %d steps of %d token%s (%s input)",
      flags.sessions, flags.sessions == 1 ? "" : "s", flags.batch, KindFlagName(work->session.kind),
      flags.prompt, flags.steps, flags.tokens_per_step, flags.tokens_per_step == 1 ? "" : "s",
      flags.feed == "output" ? "fed back" : "random");
  run.steps.push_back(std::move(step));
  if (absl::Status s = PrintLoadRun(flags, run); !s.ok()) return s;
  const StepReport& r = run.steps[0].report;
  if (r.errors.empty()) return absl::OkStatus();
  auto worst = std::max_element(r.errors.begin(), r.errors.end(),
                                [](const auto& a, const auto& b) { return a.second < b.second; });
  return absl::Status(worst->first, absl::StrCat(r.failed(), " of ", r.sent, " messages failed"));
}

}  // namespace attnserve::client
