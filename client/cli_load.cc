#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/cli.h"
#include "client/load_engine.h"
#include "client/load_http.h"
#include "client/load_report.h"
#include "client/load_workload.h"
#include "client/metrics_scrape.h"

namespace attnserve::client {
namespace {

// Hard ceiling on a window, so a typo in --duration cannot load a server for days.
constexpr double kMaxDurationSeconds = 3600;
constexpr int kMaxConnections = 256;

// The load of each step: one, or a sweep's values.
struct Plan {
  std::string sweep;  // "", "concurrency" or "rate"
  std::vector<LoadOptions> steps;
};

// Whether the flags ask for an open loop (calls sent on a schedule) rather than a closed one.
bool OpenLoop(const LoadFlags& f) { return f.rate_given || !f.rate_range.empty(); }

absl::Status CheckFlags(const LoadFlags& f) {
  auto seconds_ok = [](double s) { return s >= 0 && s <= kMaxDurationSeconds; };
  if (!seconds_ok(f.duration_seconds) || !seconds_ok(f.warmup_seconds)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--duration and --warmup-seconds must be in [0, ", kMaxDurationSeconds, "] seconds"));
  }
  if (f.connections < 1 || f.connections > kMaxConnections) {
    return absl::InvalidArgumentError(
        absl::StrCat("--connections must be in [1, ", kMaxConnections, "]"));
  }
  if (f.rate_given && !(f.rate > 0 && f.rate <= kMaxRate)) {
    return absl::InvalidArgumentError(absl::StrCat("--rate must be in (0, ", kMaxRate, "]"));
  }
  if (!f.concurrency_range.empty() && !f.rate_range.empty()) {
    return absl::InvalidArgumentError("give --concurrency-range or --rate-range, not both");
  }
  const bool open = OpenLoop(f);
  if (open && (f.concurrency_given || !f.concurrency_range.empty())) {
    return absl::InvalidArgumentError(
        "--rate/--rate-range are open loop, --concurrency/--concurrency-range closed: pick one");
  }
  if (f.arrival_given && !open) {
    return absl::InvalidArgumentError("--arrival is for an open loop (--rate or --rate-range)");
  }
  if (f.latency_limit_ms > 0 && f.concurrency_range.empty() && f.rate_range.empty()) {
    return absl::InvalidArgumentError(
        "--latency-limit-ms stops a sweep: give --rate-range or --concurrency-range");
  }
  if (f.stability_percent < 0 || f.latency_limit_ms < 0) {
    return absl::InvalidArgumentError("--stability-percent and --latency-limit-ms must be >= 0");
  }
  if (f.json && f.csv) return absl::InvalidArgumentError("give --json or --csv, not both");
  if (!f.metrics_url.empty() && f.metrics_url.rfind("http://", 0) != 0) {
    return absl::InvalidArgumentError("--metrics-url must be http://HOST:PORT/PATH");
  }
  return absl::OkStatus();
}

absl::StatusOr<Plan> MakePlan(const LoadFlags& f) {
  LoadOptions base;
  base.mode = OpenLoop(f) ? LoadMode::kOpen : LoadMode::kClosed;
  base.concurrency = f.concurrency;
  base.rate = f.rate;
  base.arrival = f.arrival == "poisson" ? Arrival::kPoisson : Arrival::kConstant;
  base.max_in_flight = f.max_in_flight;
  base.warmup = absl::Seconds(f.warmup_seconds);
  base.duration = absl::Seconds(f.duration_seconds);
  base.max_requests = f.requests;
  base.seed = f.call.seed;
  Plan plan;
  const std::string& range = f.rate_range.empty() ? f.concurrency_range : f.rate_range;
  if (range.empty()) {
    plan.steps.push_back(base);
    return plan;
  }
  plan.sweep = f.rate_range.empty() ? "concurrency" : "rate";
  absl::StatusOr<std::vector<double>> values = ParseSweep(range, plan.sweep == "concurrency");
  if (!values.ok()) return values.status();
  for (double v : *values) {
    LoadOptions step = base;
    if (plan.sweep == "rate") {
      if (v > kMaxRate) {
        return absl::InvalidArgumentError(absl::StrCat("--rate-range goes past ", kMaxRate));
      }
      step.rate = v;
    } else if (v > 100000) {
      return absl::InvalidArgumentError("--concurrency-range goes past 100000");
    } else {
      step.concurrency = static_cast<int>(v);
    }
    plan.steps.push_back(step);
  }
  return plan;
}

// What was sent, in words, for the reports.
std::string DescribeWorkload(const LoadFlags& f, const std::vector<WorkItem>& work) {
  int64_t tokens = 0;
  for (const WorkItem& item : work) tokens += item.tokens;
  const double mean = static_cast<double>(tokens) / static_cast<double>(work.size());
  if (!f.workload.empty()) {
    return absl::StrFormat("workload %s, %d requests, %.1f valid tokens each on average",
                           f.workload, work.size(), mean);
  }
  if (work.size() > 1) {
    return absl::StrFormat("%d mixed requests (%s%s%s), %.1f valid tokens each on average",
                           work.size(), f.kinds.empty() ? f.call.kind : f.kinds,
                           f.lengths_uniform.empty() ? "" : ", lengths " + f.lengths_uniform,
                           f.lengths_list.empty() ? "" : ", lengths " + f.lengths_list, mean);
  }
  return absl::StrFormat("%s %s, %d valid tokens per request", f.call.kind,
                         f.call.input.empty()
                             ? "random " + (f.call.random.empty() ? "8,128" : f.call.random)
                             : f.call.input,
                         work[0].tokens);
}

// The progress line, on stderr when it is a terminal.
void ShowProgress(size_t step, size_t steps, const StepProgress& p) {
  std::cerr << absl::StrFormat("\r[step %d/%d] %6.1f s  sent %d  ok %d  failed %d  in flight %d   ",
                               step + 1, steps, p.seconds, p.sent, p.ok, p.failed, p.in_flight)
            << std::flush;
}

// The most frequent error, which the process exits with when any call failed.
absl::Status WorstError(const StepReport& report) {
  absl::StatusCode worst = absl::StatusCode::kOk;
  int64_t most = 0;
  for (const auto& [code, n] : report.errors) {
    if (n > most) worst = code, most = n;
  }
  if (worst == absl::StatusCode::kOk) return absl::OkStatus();
  return absl::Status(worst, absl::StrCat(report.failed(), " of ", report.sent, " calls failed"));
}

// Runs the plan's steps in order; a sweep stops after the first step whose p99 passes the limit.
absl::StatusOr<LoadRun> RunPlan(const LoadEngine& engine, const Plan& plan, const LoadFlags& f) {
  LoadRun run;
  run.sweep = plan.sweep;
  run.latency_limit_ms = f.latency_limit_ms;
  const bool progress = isatty(STDERR_FILENO) != 0;
  for (size_t i = 0; i < plan.steps.size(); ++i) {
    LoadOptions options = plan.steps[i];
    // One scrape as each window opens (kept per trial: a stable step reports its last windows).
    std::vector<std::vector<MetricSample>> scrapes;
    absl::Status scrape_status;
    if (!f.metrics_url.empty()) {
      options.window_started = [&] {
        absl::StatusOr<std::vector<MetricSample>> s = ScrapeMetrics(f.metrics_url);
        if (!s.ok()) scrape_status = s.status();
        scrapes.push_back(s.ok() ? *std::move(s) : std::vector<MetricSample>{});
      };
    }
    if (progress) {
      options.progress = [&, i](const StepProgress& p) { ShowProgress(i, plan.steps.size(), p); };
    }
    absl::StatusOr<StepReport> report =
        RunStableStep(engine, options, f.stability_percent, f.max_trials);
    if (progress) std::cerr << "\r\033[K" << std::flush;
    if (!report.ok()) return report.status();
    LoadStep step{.report = *std::move(report), .server = std::nullopt};
    if (!f.metrics_url.empty()) {
      absl::StatusOr<std::vector<MetricSample>> after = ScrapeMetrics(f.metrics_url);
      if (!after.ok()) scrape_status = after.status();
      if (!scrape_status.ok()) {
        return absl::Status(scrape_status.code(),
                            absl::StrCat("--metrics-url: ", scrape_status.message()));
      }
      if (scrapes.size() < static_cast<size_t>(step.report.trials)) {
        return absl::InternalError("--metrics-url: a window opened without a scrape");
      }
      const size_t first = scrapes.size() - static_cast<size_t>(step.report.trials);
      step.server = DiffServerMetrics(scrapes[first], *after, f.call.model);
    }
    const double p99_ms = static_cast<double>(step.report.latency.ValueAtQuantile(0.99)) / 1e3;
    run.steps.push_back(std::move(step));
    if (f.latency_limit_ms > 0 && p99_ms > f.latency_limit_ms) {
      run.stopped_by_latency_limit = i + 1 < plan.steps.size();
      break;
    }
  }
  return run;
}

// The connections a load test sends over, and how it finds a model's widths.
struct Senders {
  std::string target;
  std::vector<std::unique_ptr<AttentionClient>> clients;  // gRPC: the senders' channels
  std::vector<std::unique_ptr<LoadSender>> senders;
  ModelFinder find_model;
};

absl::Status ConnectGrpc(const ConnectionFlags& connection, const LoadFlags& flags,
                         Senders* senders) {
  // Every connection is made by the client library's one channel-making function.
  for (int i = 0; i < flags.connections; ++i) {
    senders->clients.push_back(ConnectFromFlags(connection, i));
    senders->senders.push_back(std::make_unique<GrpcLoadSender>(senders->clients.back().get()));
  }
  senders->target = connection.target;
  senders->find_model = GrpcModelFinder(*senders->clients[0]);
  return absl::OkStatus();
}

// REST: a connection a call in flight unless --connections says otherwise (HTTP/1.1 carries
// one call at a time), the model's widths from its REST metadata.
absl::Status ConnectHttp(const ConnectionFlags& connection, const LoadFlags& flags,
                         const Plan& plan, Senders* senders) {
  if (!connection.tls_ca.empty() || !connection.tls_cert.empty() || !connection.tls_key.empty()) {
    return absl::InvalidArgumentError(
        "bench --http speaks plain HTTP: no --tls-ca, --tls-cert or --tls-key with it");
  }
  senders->target = connection.target_given ? connection.target : "localhost:8000";
  absl::StatusOr<HttpUrl> url = ParseHttpUrl(senders->target, /*bare_ok=*/true);
  if (!url.ok()) return url.status();
  const absl::Duration timeout =
      connection.timeout_seconds > 0 ? absl::Seconds(connection.timeout_seconds) : absl::Hours(24);
  const std::string token = connection.token;
  senders->find_model = [url = *url, token, timeout](const std::string& name, uint64_t version) {
    return FindModelOverRest(url, token, name, version, timeout);
  };
  // Requests that name no model go to the only one, named in the REST path.
  absl::StatusOr<v1::ModelInfo> model =
      senders->find_model(flags.call.model, flags.call.model_version);
  if (!model.ok()) return model.status();
  int connections = flags.connections;
  if (!flags.connections_given) {
    connections = 1;
    for (const LoadOptions& step : plan.steps) {
      connections =
          std::max(connections, step.mode == LoadMode::kClosed ? step.concurrency
                                                               : std::min(step.max_in_flight, 64));
    }
    connections = std::min(connections, kMaxConnections);
  }
  const RestEncoding encoding =
      flags.http_encoding == "binary" ? RestEncoding::kBinary : RestEncoding::kJson;
  senders->senders.push_back(
      std::make_unique<HttpLoadSender>(*url, model->name(), encoding, token, timeout, connections));
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteReportFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

absl::Status PrintLoadRun(const LoadFlags& flags, const LoadRun& run) {
  if (flags.json) {
    std::cout << RunJson(run).dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  } else if (flags.csv) {
    std::cout << RunCsv(run);
  } else {
    std::cout << RunSummary(run);
  }
  if (!flags.html.empty()) return WriteReportFile(flags.html, RunHtml(run));
  return absl::OkStatus();
}

absl::Status RunLoadCommand(const ConnectionFlags& connection, const LoadFlags& flags) {
  if (flags.http && flags.decode) {
    return absl::InvalidArgumentError(
        "bench --decode streams sessions over gRPC: --http is for one-shot infer calls");
  }
  if (flags.decode) return RunDecodeLoadCommand(connection, flags);
  if (absl::Status s = CheckFlags(flags); !s.ok()) return s;
  absl::StatusOr<Plan> plan = MakePlan(flags);
  if (!plan.ok()) return plan.status();
  // A report that cannot be written is found now, not after the whole run (nothing is created).
  if (!flags.html.empty()) {
    const std::filesystem::path html(flags.html);
    const std::filesystem::path dir = html.has_parent_path() ? html.parent_path() : ".";
    const bool writable = std::filesystem::exists(html) ? access(html.c_str(), W_OK) == 0
                                                        : access(dir.c_str(), W_OK) == 0;
    if (!writable) return absl::PermissionDeniedError(absl::StrCat("cannot write ", flags.html));
  }
  Senders senders;
  absl::Status connected = flags.http ? ConnectHttp(connection, flags, *plan, &senders)
                                      : ConnectGrpc(connection, flags, &senders);
  if (!connected.ok()) return connected;
  absl::StatusOr<std::vector<WorkItem>> work = BuildWorkload(senders.find_model, flags);
  if (!work.ok()) return work.status();
  const std::string workload = DescribeWorkload(flags, *work);
  std::vector<const LoadSender*> connections;
  for (const auto& sender : senders.senders) connections.push_back(sender.get());
  LoadEngine engine(connections, *std::move(work));
  // A failure here (wrong model, bad shape) would fail every timed call too: stop at once.
  if (absl::Status s = engine.Check(std::max(flags.warmup, 0)); !s.ok()) return s;
  absl::StatusOr<LoadRun> run = RunPlan(engine, *plan, flags);
  if (!run.ok()) return run.status();
  run->target = senders.target;
  run->protocol = flags.http ? "http-" + flags.http_encoding : "grpc";
  run->workload = workload;

  if (absl::Status s = PrintLoadRun(flags, *run); !s.ok()) return s;
  return WorstError(MergedRun(*run));
}

}  // namespace attnserve::client
