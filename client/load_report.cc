#include "client/load_report.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace attnserve::client {
namespace {

double Ms(int64_t us) { return static_cast<double>(us) / 1e3; }

const char* ModeName(LoadMode mode) { return mode == LoadMode::kOpen ? "open" : "closed"; }
const char* ArrivalName(Arrival a) { return a == Arrival::kPoisson ? "poisson" : "constant"; }

nlohmann::json LatencyJson(const LatencyHistogram& h) {
  return {{"p50", Ms(h.ValueAtQuantile(0.5))},
          {"p90", Ms(h.ValueAtQuantile(0.9))},
          {"p99", Ms(h.ValueAtQuantile(0.99))},
          {"p999", Ms(h.ValueAtQuantile(0.999))},
          {"max", Ms(h.max())},
          {"mean", h.mean() / 1e3},
          {"min", Ms(h.min())}};
}

nlohmann::json HistogramJson(const LatencyHistogram& h) {
  nlohmann::json buckets = nlohmann::json::array();
  for (const LatencyHistogram::Bucket& b : h.Buckets()) {
    buckets.push_back({Ms(b.low_us), Ms(b.high_us), b.count});
  }
  return {{"unit", "ms"}, {"count", h.count()}, {"buckets", buckets}};
}

nlohmann::json DurationJson(const ServerDuration& d) {
  return {{"calls", d.count}, {"mean", d.mean_ms}, {"p50", d.p50_ms}, {"p99", d.p99_ms}};
}

nlohmann::json ServerJson(const ServerSplit& s) {
  return {{"found", s.found},
          {"queue_ms", DurationJson(s.queue)},
          {"compute_ms", DurationJson(s.compute)},
          {"batches", s.batches},
          {"mean_batch_calls", s.mean_batch_calls},
          {"mean_batch_tokens", s.mean_batch_tokens},
          {"requests_by_code", s.requests_by_code}};
}

// bench --decode's figures; null for the other modes.
nlohmann::json DecodeJson(const std::optional<DecodeFigures>& d) {
  if (!d.has_value()) return nullptr;
  return {{"sessions", d->sessions},
          {"batch", d->batch},
          {"prompt", d->prompt},
          {"steps", d->steps},
          {"tokens_per_step", d->tokens_per_step},
          {"prompt_tokens", d->prompt_tokens},
          {"step_tokens", d->step_tokens},
          {"prefill_seconds", absl::ToDoubleSeconds(d->prefill_elapsed)},
          {"decode_seconds", absl::ToDoubleSeconds(d->decode_elapsed)},
          {"tokens_per_second", d->tokens_per_second()},
          {"prompt_tokens_per_second", d->prompt_tokens_per_second()},
          {"time_to_first_output_ms", LatencyJson(d->first_output)},
          {"inter_token_latency_ms", LatencyJson(d->inter_token)}};
}

nlohmann::json StepJson(const StepReport& r) {
  nlohmann::json errors = nlohmann::json::object();
  for (const auto& [code, n] : r.errors) errors[absl::StatusCodeToString(code)] = n;
  nlohmann::json error_messages = nlohmann::json::object();
  for (const auto& [code, message] : r.first_error) {
    error_messages[absl::StatusCodeToString(code)] = message;
  }
  nlohmann::json slices = nlohmann::json::array();
  for (const TimeSlice& s : r.timeline) {
    slices.push_back({{"t", s.start_seconds},
                      {"sent", s.sent},
                      {"ok", s.ok},
                      {"failed", s.failed},
                      {"p50", Ms(s.latency.ValueAtQuantile(0.5))},
                      {"p99", Ms(s.latency.ValueAtQuantile(0.99))}});
  }
  const bool open = r.mode == LoadMode::kOpen;
  return {{"mode", ModeName(r.mode)},
          {"concurrency",
           open || r.concurrency == 0 ? nlohmann::json() : nlohmann::json(r.concurrency)},
          {"offered_rate", open && r.offered_rate > 0 ? nlohmann::json(r.offered_rate) : nullptr},
          {"arrival", open ? nlohmann::json(ArrivalName(r.arrival)) : nullptr},
          {"connections", r.connections},
          {"max_in_flight", open ? nlohmann::json(r.max_in_flight) : nullptr},
          {"window_seconds", absl::ToDoubleSeconds(r.window)},
          {"elapsed_seconds", absl::ToDoubleSeconds(r.elapsed)},
          {"trials", r.trials},
          {"trials_run", r.trials_run},
          {"stable", r.stable},
          {"scheduled", r.scheduled},
          {"sent", r.sent},
          {"late", r.late},
          {"unsent", r.unsent},
          {"ok", r.ok},
          {"errors", errors},
          {"first_error_messages", error_messages},
          {"achieved_rate", r.achieved_rate()},
          {"requests_per_second", r.requests_per_second()},
          {"tokens", r.tokens},
          {"tokens_per_second", r.tokens_per_second()},
          {"latency_ms", LatencyJson(r.latency)},
          {"histogram", HistogramJson(r.latency)},
          {"send_lag_ms",
           {{"p50", Ms(r.send_lag.ValueAtQuantile(0.5))},
            {"p99", Ms(r.send_lag.ValueAtQuantile(0.99))},
            {"max", Ms(r.send_lag.max())}}},
          {"timeline", {{"slice_seconds", r.slice_seconds}, {"slices", slices}}},
          {"decode", DecodeJson(r.decode)}};
}

// The decode lines of a step's summary.
std::string DecodeSummary(const DecodeFigures& d) {
  const LatencyHistogram& f = d.first_output;
  const LatencyHistogram& t = d.inter_token;
  return absl::StrFormat(
      "sessions     %d of B=%d: prompt %d, then %d steps of %d token%s\n"
      "decode       %.0f tokens/s generated (%d tokens in %.2f s); prompts %.0f tokens/s\n"
      "first output ms  p50 %.2f  p90 %.2f  p99 %.2f  max %.2f\n"
      "inter-token ms   p50 %.3f  p90 %.3f  p99 %.3f  max %.3f\n",
      d.sessions, d.batch, d.prompt, d.steps, d.tokens_per_step, d.tokens_per_step == 1 ? "" : "s",
      d.tokens_per_second(), d.step_tokens, absl::ToDoubleSeconds(d.decode_elapsed),
      d.prompt_tokens_per_second(), Ms(f.ValueAtQuantile(0.5)), Ms(f.ValueAtQuantile(0.9)),
      Ms(f.ValueAtQuantile(0.99)), Ms(f.max()), Ms(t.ValueAtQuantile(0.5)),
      Ms(t.ValueAtQuantile(0.9)), Ms(t.ValueAtQuantile(0.99)), Ms(t.max()));
}

// "c=4" or "100/s": the step's load in a table cell.
std::string LoadLabel(const StepReport& r) {
  return r.mode == LoadMode::kOpen ? absl::StrFormat("%g/s", r.offered_rate)
                                   : absl::StrCat("c=", r.concurrency);
}

std::string ServerLine(const ServerSplit& s) {
  if (!s.found) return "server       no attnserve metrics at --metrics-url\n";
  return absl::StrFormat(
      "server       queue mean %.2f ms (p99 %.2f), compute mean %.2f ms (p99 %.2f); "
      "%.1f calls, %.0f tokens per batch over %.0f batches\n",
      s.queue.mean_ms, s.queue.p99_ms, s.compute.mean_ms, s.compute.p99_ms, s.mean_batch_calls,
      s.mean_batch_tokens, s.batches);
}

// A step's failures by code, "RESOURCE_EXHAUSTED=12;UNAVAILABLE=1" ("" when none failed).
std::string ErrorCodes(const StepReport& r) {
  std::string text;
  for (const auto& [code, n] : r.errors) {
    absl::StrAppend(&text, text.empty() ? "" : ";", absl::StatusCodeToString(code), "=", n);
  }
  return text;
}

// The decode columns of a CSV row (empty cells for the other modes).
std::string DecodeCsv(const std::optional<DecodeFigures>& d) {
  if (!d.has_value()) return ",,,,,,,";
  const LatencyHistogram& f = d->first_output;
  const LatencyHistogram& t = d->inter_token;
  return absl::StrFormat("%d,%d,%.1f,%.3f,%.3f,%.4f,%.4f,%.4f", d->sessions, d->batch,
                         d->tokens_per_second(), Ms(f.ValueAtQuantile(0.5)),
                         Ms(f.ValueAtQuantile(0.99)), Ms(t.ValueAtQuantile(0.5)),
                         Ms(t.ValueAtQuantile(0.9)), Ms(t.ValueAtQuantile(0.99)));
}

std::string StepSummary(const LoadStep& step) {
  const StepReport& r = step.report;
  std::string load =
      r.decode.has_value() ? absl::StrFormat("%d decode sessions (streams)", r.concurrency)
      : r.mode == LoadMode::kOpen
          ? absl::StrFormat("open loop, %g calls/s offered (%s), at most %d in flight",
                            r.offered_rate, ArrivalName(r.arrival), r.max_in_flight)
          : absl::StrFormat("closed loop, %d calls in flight", r.concurrency);
  std::string text = absl::StrFormat(
      "load         %s over %d connection%s, %.2f s window%s\n"
      "calls        %d scheduled, %d sent (%d late, %d unsent): %d ok, %d failed\n"
      "throughput   %.1f req/s, %.0f tokens/s; sent %.1f calls/s (send lag p99 %.2f ms)\n"
      "latency ms   p50 %.2f  p90 %.2f  p99 %.2f  p99.9 %.2f  max %.2f  mean %.2f\n",
      load, r.connections, r.connections == 1 ? "" : "s", absl::ToDoubleSeconds(r.window),
      r.trials_run > 1 ? absl::StrFormat(" x %d (%d run, %s)", r.trials, r.trials_run,
                                         r.stable ? "stable" : "NOT stable")
                       : "",
      r.scheduled, r.sent, r.late, r.unsent, r.ok, r.failed(), r.requests_per_second(),
      r.tokens_per_second(), r.achieved_rate(), Ms(r.send_lag.ValueAtQuantile(0.99)),
      Ms(r.latency.ValueAtQuantile(0.5)), Ms(r.latency.ValueAtQuantile(0.9)),
      Ms(r.latency.ValueAtQuantile(0.99)), Ms(r.latency.ValueAtQuantile(0.999)),
      Ms(r.latency.max()), r.latency.mean() / 1e3);
  for (const auto& [code, n] : r.errors) {
    const auto first = r.first_error.find(code);
    absl::StrAppend(
        &text, "errors       ", absl::StatusCodeToString(code), ": ", n,
        first == r.first_error.end() ? "" : absl::StrCat(" (first: ", first->second, ")"), "\n");
  }
  if (r.decode.has_value()) absl::StrAppend(&text, DecodeSummary(*r.decode));
  if (step.server.has_value()) absl::StrAppend(&text, ServerLine(*step.server));
  return text;
}

}  // namespace

StepReport MergedRun(const LoadRun& run) {
  if (run.steps.empty()) return {};
  StepReport merged = run.steps[0].report;
  for (size_t i = 1; i < run.steps.size(); ++i) MergeStep(merged, run.steps[i].report);
  return merged;
}

nlohmann::json RunJson(const LoadRun& run) {
  nlohmann::json top = StepJson(MergedRun(run));
  nlohmann::json steps = nlohmann::json::array();
  for (const LoadStep& step : run.steps) {
    nlohmann::json s = StepJson(step.report);
    if (step.server.has_value()) s["server"] = ServerJson(*step.server);
    steps.push_back(std::move(s));
  }
  if (run.sweep.empty() && run.steps.size() == 1 && run.steps[0].server.has_value()) {
    top["server"] = steps[0]["server"];
  }
  if (!run.sweep.empty()) {  // a sweep's load differs per step: see "steps"
    top["concurrency"] = nullptr;
    top["offered_rate"] = nullptr;
  }
  top["sweep"] = run.sweep.empty() ? nlohmann::json() : nlohmann::json(run.sweep);
  top["latency_limit_ms"] =
      run.latency_limit_ms > 0 ? nlohmann::json(run.latency_limit_ms) : nullptr;
  top["stopped_by_latency_limit"] = run.stopped_by_latency_limit;
  top["target"] = run.target;
  top["protocol"] = run.protocol;
  top["workload"] = run.workload;
  top["steps"] = std::move(steps);
  return top;
}

std::string RunCsv(const LoadRun& run) {
  std::string csv =
      "step,mode,concurrency,offered_rate,arrival,connections,window_seconds,scheduled,sent,"
      "late,unsent,ok,failed,achieved_rate,requests_per_second,tokens_per_second,p50_ms,p90_ms,"
      "p99_ms,p999_ms,max_ms,mean_ms,server_queue_mean_ms,server_compute_mean_ms,"
      "server_mean_batch_calls,server_mean_batch_tokens,trials_run,stable,errors,"
      "decode_sessions,decode_batch,decode_tokens_per_second,first_output_p50_ms,"
      "first_output_p99_ms,inter_token_p50_ms,inter_token_p90_ms,inter_token_p99_ms\n";
  for (size_t i = 0; i < run.steps.size(); ++i) {
    const StepReport& r = run.steps[i].report;
    const bool open = r.mode == LoadMode::kOpen;
    const LatencyHistogram& h = r.latency;
    std::string server = ",,,";
    if (const auto& s = run.steps[i].server; s.has_value() && s->found) {
      server = absl::StrFormat("%.4f,%.4f,%.3f,%.1f", s->queue.mean_ms, s->compute.mean_ms,
                               s->mean_batch_calls, s->mean_batch_tokens);
    }
    absl::StrAppend(
        &csv,
        absl::StrFormat(
            "%d,%s,%s,%s,%s,%d,%.3f,%d,%d,%d,%d,%d,%d,%.3f,%.3f,%.1f,%.3f,%.3f,%.3f,"
            "%.3f,%.3f,%.3f,",
            i, ModeName(r.mode), open ? "" : absl::StrCat(r.concurrency),
            open ? absl::StrFormat("%g", r.offered_rate) : "", open ? ArrivalName(r.arrival) : "",
            r.connections, absl::ToDoubleSeconds(r.window), r.scheduled, r.sent, r.late, r.unsent,
            r.ok, r.failed(), r.achieved_rate(), r.requests_per_second(), r.tokens_per_second(),
            Ms(h.ValueAtQuantile(0.5)), Ms(h.ValueAtQuantile(0.9)), Ms(h.ValueAtQuantile(0.99)),
            Ms(h.ValueAtQuantile(0.999)), Ms(h.max()), h.mean() / 1e3),
        server, ",", r.trials_run, ",", r.stable ? "true" : "false", ",", ErrorCodes(r), ",",
        DecodeCsv(r.decode), "\n");
  }
  return csv;
}

std::string RunSummary(const LoadRun& run) {
  if (run.sweep.empty() && run.steps.size() == 1) return StepSummary(run.steps[0]);
  std::string text =
      absl::StrFormat("%-9s %7s %7s %6s %6s %6s %9s %10s %8s %8s %8s %8s %8s\n",
                      run.sweep + " sweep", "sent", "ok", "failed", "late", "unsent", "req/s",
                      "tokens/s", "p50 ms", "p90 ms", "p99 ms", "p99.9 ms", "max ms");
  bool any_server = false;
  for (const LoadStep& step : run.steps) {
    const StepReport& r = step.report;
    const LatencyHistogram& h = r.latency;
    absl::StrAppend(
        &text,
        absl::StrFormat("%-9s %7d %7d %6d %6d %6d %9.1f %10.0f %8.2f %8.2f %8.2f %8.2f %8.2f\n",
                        LoadLabel(r), r.sent, r.ok, r.failed(), r.late, r.unsent,
                        r.requests_per_second(), r.tokens_per_second(), Ms(h.ValueAtQuantile(0.5)),
                        Ms(h.ValueAtQuantile(0.9)), Ms(h.ValueAtQuantile(0.99)),
                        Ms(h.ValueAtQuantile(0.999)), Ms(h.max())));
    any_server |= step.server.has_value();
  }
  if (any_server) {
    absl::StrAppend(&text, absl::StrFormat("%-9s %16s %16s %12s %12s\n", "server", "queue ms mean",
                                           "compute ms mean", "calls/batch", "tokens/batch"));
    for (const LoadStep& step : run.steps) {
      if (!step.server.has_value()) continue;
      const ServerSplit& s = *step.server;
      absl::StrAppend(&text,
                      absl::StrFormat("%-9s %16.2f %16.2f %12.2f %12.0f\n", LoadLabel(step.report),
                                      s.queue.mean_ms, s.compute.mean_ms, s.mean_batch_calls,
                                      s.mean_batch_tokens));
    }
  }
  for (const LoadStep& step : run.steps) {
    const StepReport& r = step.report;
    if (r.trials_run > 1) {
      absl::StrAppend(&text, absl::StrFormat("%-9s %d windows run, %s\n", LoadLabel(r),
                                             r.trials_run, r.stable ? "stable" : "NOT stable"));
    }
    if (!r.errors.empty()) {
      absl::StrAppend(&text, absl::StrFormat("%-9s errors %s\n", LoadLabel(r), ErrorCodes(r)));
    }
  }
  if (run.stopped_by_latency_limit) {
    absl::StrAppend(
        &text, absl::StrFormat("stopped: p99 above the %.1f ms limit\n", run.latency_limit_ms));
  }
  return text;
}

}  // namespace attnserve::client
