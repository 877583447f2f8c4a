#include "server/observability/metrics.h"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <mutex>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

namespace attnserve::server {
namespace {

using prometheus::Counter;
using prometheus::Family;
using prometheus::Gauge;
using prometheus::Histogram;
using prometheus::Labels;

constexpr int kUnknownKind = 4;

// The kind label: core's name for each kind, "" when the call never said a valid one.
std::string KindLabel(int kind) {
  return kind == kUnknownKind ? std::string()
                              : std::string(core::KindName(static_cast<core::AttentionKind>(kind)));
}

int KindIndex(std::optional<core::AttentionKind> kind) {
  return kind.has_value() ? static_cast<int>(*kind) : kUnknownKind;
}

// The code as the wire carries it (grpc_status.cc): codes past UNAUTHENTICATED go out as
// INTERNAL.
int CodeIndex(absl::StatusCode code) {
  const int index = static_cast<int>(code);
  return index >= 0 && index <= 16 ? index : static_cast<int>(absl::StatusCode::kInternal);
}

// The series in `slot`, made from `family` the first time. Family::Add is thread safe and
// returns the existing series for labels it has seen, so two threads racing here agree.
template <typename T, typename... Args>
T& Lazy(std::atomic<T*>& slot, Family<T>& family, const Labels& labels, Args&&... args) {
  T* series = slot.load(std::memory_order_acquire);
  if (series == nullptr) {
    series = &family.Add(labels, std::forward<Args>(args)...);
    slot.store(series, std::memory_order_release);
  }
  return *series;
}

const std::vector<double>& BatchCallBuckets() {
  static const auto* buckets =
      new std::vector<double>{1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024};
  return *buckets;
}

const std::vector<double>& BatchTokenBuckets() {
  static const auto* buckets = [] {
    auto* b = new std::vector<double>;
    for (double v = 1; v <= 65536; v *= 2) b->push_back(v);
    return b;
  }();
  return *buckets;
}

// process_* figures, read from /proc at each scrape (as the Go and Python clients do).
class ProcessCollector : public prometheus::Collectable {
 public:
  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> out;
    const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
    const double page = static_cast<double>(sysconf(_SC_PAGESIZE));
    std::vector<std::string> stat = SelfStat();
    // Fields after the command: stat[0] is field 3 (state) of proc(5).
    if (stat.size() > 21) {
      const double cpu = (std::stod(stat[11]) + std::stod(stat[12])) / ticks;  // utime + stime
      Add(&out, "process_cpu_seconds_total", "User and system CPU time spent, in seconds.",
          prometheus::MetricType::Counter, cpu);
      Add(&out, "process_start_time_seconds",
          "Start time of the process since the Unix epoch, in seconds.",
          prometheus::MetricType::Gauge, BootTime() + std::stod(stat[19]) / ticks);
      Add(&out, "process_virtual_memory_bytes", "Virtual memory size, in bytes.",
          prometheus::MetricType::Gauge, std::stod(stat[20]));
      Add(&out, "process_resident_memory_bytes", "Resident memory size, in bytes.",
          prometheus::MetricType::Gauge, std::stod(stat[21]) * page);
    }
    Add(&out, "process_open_fds", "Number of open file descriptors.", prometheus::MetricType::Gauge,
        OpenFds());
    rlimit limit{};
    if (getrlimit(RLIMIT_NOFILE, &limit) == 0) {
      Add(&out, "process_max_fds", "Maximum number of open file descriptors.",
          prometheus::MetricType::Gauge, static_cast<double>(limit.rlim_cur));
    }
    return out;
  }

 private:
  static void Add(std::vector<prometheus::MetricFamily>* out, const std::string& name,
                  const std::string& help, prometheus::MetricType type, double value) {
    prometheus::MetricFamily family{name, help, type, {}};
    prometheus::ClientMetric metric;
    if (type == prometheus::MetricType::Counter) {
      metric.counter.value = value;
    } else {
      metric.gauge.value = value;
    }
    family.metric.push_back(metric);
    out->push_back(std::move(family));
  }

  // /proc/self/stat from field 3 on; the command (field 2) may hold spaces, so it is skipped
  // up to its closing parenthesis.
  static std::vector<std::string> SelfStat() {
    std::ifstream in("/proc/self/stat");
    std::string line;
    std::getline(in, line);
    const size_t close = line.rfind(')');
    std::vector<std::string> fields;
    if (close == std::string::npos) return fields;
    std::istringstream rest(line.substr(close + 1));
    for (std::string field; rest >> field;) fields.push_back(field);
    return fields;
  }

  static double BootTime() {
    std::ifstream in("/proc/stat");
    for (std::string key; in >> key;) {
      if (key == "btime") {
        double seconds = 0;
        in >> seconds;
        return seconds;
      }
    }
    return 0;
  }

  static double OpenFds() {
    DIR* dir = opendir("/proc/self/fd");
    if (dir == nullptr) return 0;
    int count = 0;
    while (const dirent* entry = readdir(dir)) {
      if (entry->d_name[0] != '.') ++count;
    }
    closedir(dir);
    return count - 1;  // not the descriptor opendir itself holds
  }
};

}  // namespace

// Every family, registered once.
struct Metrics::Families {
  explicit Families(prometheus::Registry& r)
      : requests(prometheus::BuildCounter()
                     .Name("attnserve_requests_total")
                     .Help("Forward calls answered, by model, kind, gRPC status code and "
                           "protocol (grpc, http).")
                     .Register(r)),
        tokens(prometheus::BuildCounter()
                   .Name("attnserve_tokens_total")
                   .Help("Valid query tokens of successful Forward calls.")
                   .Register(r)),
        request_duration(prometheus::BuildHistogram()
                             .Name("attnserve_request_duration_seconds")
                             .Help("Forward calls, from arrival to answer, in seconds.")
                             .Register(r)),
        queue_duration(prometheus::BuildHistogram()
                           .Name("attnserve_queue_duration_seconds")
                           .Help("Time calls waited in their model's queue, in seconds.")
                           .Register(r)),
        compute_duration(prometheus::BuildHistogram()
                             .Name("attnserve_compute_duration_seconds")
                             .Help("Compute runs (one Layer::Forward), in seconds.")
                             .Register(r)),
        batch_calls(prometheus::BuildHistogram()
                        .Name("attnserve_batch_calls")
                        .Help("Calls one compute run held (dynamic batching).")
                        .Register(r)),
        batch_tokens(prometheus::BuildHistogram()
                         .Name("attnserve_batch_tokens")
                         .Help("Tokens (input plus context) one compute run held, the unit of "
                               "--max-batch-tokens.")
                         .Register(r)),
        shed(prometheus::BuildCounter()
                 .Name("attnserve_shed_total")
                 .Help("Calls answered without compute so that calls that can still be served "
                       "are, by model and reason (queue_full, deadline, queue_delay, expired).")
                 .Register(r)),
        late_compute(prometheus::BuildCounter()
                         .Name("attnserve_late_compute_seconds_total")
                         .Help("Compute time spent on calls answered after their deadline, "
                               "in seconds (a share of each run, by the call's tokens).")
                         .Register(r)),
        sessions(prometheus::BuildGauge()
                     .Name("attnserve_sessions")
                     .Help("Decode sessions open now, by model.")
                     .Register(r)),
        sessions_refused(prometheus::BuildCounter()
                             .Name("attnserve_sessions_refused_total")
                             .Help("Decode sessions or steps refused for a limit, by reason "
                                   "(max_sessions, kv_cache, session_tokens).")
                             .Register(r)),
        kv_cache_bytes(prometheus::BuildGauge()
                           .Name("attnserve_kv_cache_bytes")
                           .Help("Bytes the decode sessions' KV caches hold, by model.")
                           .Register(r)),
        kv_cache_limit(prometheus::BuildGauge()
                           .Name("attnserve_kv_cache_limit_bytes")
                           .Help("The KV cache budget every session shares (--kv-cache-mib).")
                           .Register(r)
                           .Add({})),
        kv_cache_resident(prometheus::BuildGauge()
                              .Name("attnserve_kv_cache_resident_bytes")
                              .Help("Bytes of the KV cache's slabs, what its caches can hold in "
                                    "memory: those holding sessions' blocks, and those emptied "
                                    "and kept for the next sessions until a --heap-trim-secs "
                                    "period passes idle.")
                              .Register(r)
                              .Add({})),
        http_body_bytes(prometheus::BuildGauge()
                            .Name("attnserve_http_body_bytes")
                            .Help("Bytes of request bodies the REST port holds now, counted as "
                                  "they arrive and until their answer.")
                            .Register(r)
                            .Add({})),
        http_body_limit(prometheus::BuildGauge()
                            .Name("attnserve_http_body_limit_bytes")
                            .Help("The request bodies the REST port holds at once, at most "
                                  "(--http-bodies-mib); a body past the room left gets 503.")
                            .Register(r)
                            .Add({})),
        session_messages(prometheus::BuildCounter()
                             .Name("attnserve_session_messages_total")
                             .Help("Messages of decode sessions answered (Decode and "
                                   "ModelStreamInfer messages, ModelInfer and REST requests "
                                   "with sequence_id), by model and gRPC status code: refused "
                                   "and malformed ones too.")
                             .Register(r)),
        decode_tokens(
            prometheus::BuildCounter()
                .Name("attnserve_decode_tokens_total")
                .Help("Tokens decode steps computed, by model (those of a step refused or "
                      "taken back after it ran included).")
                .Register(r)),
        decode_step_tokens(prometheus::BuildHistogram()
                               .Name("attnserve_decode_step_tokens")
                               .Help("New tokens one compute run of decode steps held "
                                     "(continuous batching across sessions).")
                               .Register(r)),
        queue_depth(prometheus::BuildGauge()
                        .Name("attnserve_queue_depth")
                        .Help("Calls queued for compute now, by model.")
                        .Register(r)),
        sequence_requests_waiting(
            prometheus::BuildGauge()
                .Name("attnserve_sequence_requests_waiting")
                .Help("Requests of decode sessions waiting for the one before them to be "
                      "answered, by model; each holds one of the model's --max-queue places.")
                .Register(r)),
        inflight(prometheus::BuildGauge()
                     .Name("attnserve_inflight_requests")
                     .Help("Forward calls received and not yet answered.")
                     .Register(r)
                     .Add({})),
        model_info(prometheus::BuildGauge()
                       .Name("attnserve_model_info")
                       .Help("The models served, 1 each; their shapes are labels.")
                       .Register(r)),
        model_state(prometheus::BuildGauge()
                        .Name("attnserve_model_state")
                        .Help("1 for the state each model version is in (READY, LOADING, "
                              "UNLOADING, UNAVAILABLE), 0 for the others.")
                        .Register(r)),
        load_failures(prometheus::BuildCounter()
                          .Name("attnserve_model_load_failures_total")
                          .Help("Model versions (or configs) that failed to load, by model.")
                          .Register(r)) {}

  Family<Counter>& requests;
  Family<Counter>& tokens;
  Family<Histogram>& request_duration;
  Family<Histogram>& queue_duration;
  Family<Histogram>& compute_duration;
  Family<Histogram>& batch_calls;
  Family<Histogram>& batch_tokens;
  Family<Counter>& shed;
  Family<Counter>& late_compute;
  Family<Gauge>& sessions;
  Family<Counter>& sessions_refused;
  Family<Gauge>& kv_cache_bytes;
  Gauge& kv_cache_limit;
  Gauge& kv_cache_resident;
  Gauge& http_body_bytes;
  Gauge& http_body_limit;
  Family<Counter>& session_messages;
  Family<Counter>& decode_tokens;
  Family<Histogram>& decode_step_tokens;
  Family<Gauge>& queue_depth;
  Family<Gauge>& sequence_requests_waiting;
  Gauge& inflight;
  Family<Gauge>& model_info;
  Family<Gauge>& model_state;
  Family<Counter>& load_failures;
};

ModelMetrics::ModelMetrics(Metrics* metrics, std::string name) : name_(std::move(name)) {
  // Calls for a model not served never queue: the "" handle has no queue or compute series.
  if (metrics == nullptr || name_.empty()) return;
  Metrics::Families& f = *metrics->families_;
  const Labels model{{"model", name_}};
  queue_depth_ = &f.queue_depth.Add(model);
  sequence_requests_waiting_ = &f.sequence_requests_waiting.Add(model);
  queue_duration_ = &f.queue_duration.Add(model, Metrics::DurationBuckets());
  compute_duration_ = &f.compute_duration.Add(model, Metrics::DurationBuckets());
  batch_calls_ = &f.batch_calls.Add(model, BatchCallBuckets());
  batch_tokens_ = &f.batch_tokens.Add(model, BatchTokenBuckets());
  for (int reason = 0; reason < kShedReasons; ++reason) {
    shed_[reason] = &f.shed.Add({{"model", name_}, {"reason", kShedReasonNames[reason]}});
  }
  late_compute_ = &f.late_compute.Add(model);
  sessions_ = &f.sessions.Add(model);
  kv_cache_bytes_ = &f.kv_cache_bytes.Add(model);
  decode_tokens_ = &f.decode_tokens.Add(model);
  decode_step_tokens_ = &f.decode_step_tokens.Add(model, BatchTokenBuckets());
  for (int reason = 0; reason < kSessionRefusals; ++reason) {
    sessions_refused_[reason] = &f.sessions_refused.Add({{"reason", kSessionRefusalNames[reason]}});
  }
}

void ModelMetrics::SetQueueDepth(int calls) {
  if (queue_depth_ == nullptr) return;
  queue_depth_->Set(calls);
}

void ModelMetrics::SetSequenceRequestsWaiting(int requests) {
  if (sequence_requests_waiting_ == nullptr) return;
  sequence_requests_waiting_->Set(requests);
}

void ModelMetrics::QueueWait(double seconds) {
  if (queue_depth_ == nullptr) return;
  queue_duration_->Observe(seconds);
}

void ModelMetrics::ComputeRun(int calls, int64_t tokens, double seconds) {
  if (queue_depth_ == nullptr) return;
  compute_duration_->Observe(seconds);
  batch_calls_->Observe(calls);
  batch_tokens_->Observe(static_cast<double>(tokens));
}

void ModelMetrics::Shed(ShedReason reason) {
  if (queue_depth_ == nullptr) return;
  shed_[static_cast<int>(reason)]->Increment();
}

void ModelMetrics::LateCompute(double seconds) {
  if (queue_depth_ == nullptr) return;
  late_compute_->Increment(seconds);
}

void ModelMetrics::SessionOpened() {
  if (sessions_ != nullptr) sessions_->Increment();
}

void ModelMetrics::SessionClosed() {
  if (sessions_ != nullptr) sessions_->Decrement();
}

void ModelMetrics::SessionRefused(SessionRefusal why) {
  if (sessions_ != nullptr) sessions_refused_[static_cast<int>(why)]->Increment();
}

void ModelMetrics::SetKvCacheBytes(const std::atomic<int64_t>& bytes) {
  if (kv_cache_bytes_ == nullptr) return;
  // A load then a Set by each of two threads could end with the earlier load's value shown
  // for good; under the lock the last Set reads what both threads did.
  std::lock_guard lock(kv_cache_bytes_mu_);
  kv_cache_bytes_->Set(static_cast<double>(bytes.load()));
}

void ModelMetrics::DecodeRun(int64_t tokens) {
  if (decode_tokens_ == nullptr) return;
  decode_tokens_->Increment(static_cast<double>(tokens));
  decode_step_tokens_->Observe(static_cast<double>(tokens));
}

void Metrics::SetKvCacheLimit(int64_t bytes) {
  if (enabled_) families_->kv_cache_limit.Set(static_cast<double>(bytes));
}

void Metrics::SetKvCacheResident(int64_t bytes) {
  if (enabled_) families_->kv_cache_resident.Set(static_cast<double>(bytes));
}

void Metrics::SetHttpBodyLimit(int64_t bytes) {
  if (enabled_) families_->http_body_limit.Set(static_cast<double>(bytes));
}

void Metrics::HttpBodyBytesChanged(int64_t change) {
  if (enabled_) families_->http_body_bytes.Increment(static_cast<double>(change));
}

Metrics::Metrics(bool enabled) : enabled_(enabled) {
  if (!enabled_) return;
  registry_ = std::make_shared<prometheus::Registry>();
  process_ = std::make_shared<ProcessCollector>();
  families_ = std::make_unique<Families>(*registry_);
}

Metrics::~Metrics() {
  // The endpoint reads the registry: it stops first.
  http_.reset();
}

std::unique_ptr<Metrics> Metrics::Disabled() {
  std::unique_ptr<Metrics> metrics(new Metrics(false));
  metrics->unknown_.reset(new ModelMetrics(nullptr, ""));
  return metrics;
}

std::unique_ptr<Metrics> Metrics::Create() {
  std::unique_ptr<Metrics> metrics(new Metrics(true));
  metrics->unknown_.reset(new ModelMetrics(metrics.get(), ""));
  return metrics;
}

ModelMetrics& Metrics::AddModel(const std::string& name) {
  std::unique_lock lock(models_mu_);
  for (const auto& model : models_) {
    if (model->name_ == name) return *model;
  }
  // Its load failures count from 0, shown before the first: an alert on their increase (or on
  // the series' absence) sees a model that has never failed.
  if (enabled_) families_->load_failures.Add({{"model", name}});
  models_.push_back(
      std::unique_ptr<ModelMetrics>(new ModelMetrics(enabled_ ? this : nullptr, name)));
  return *models_.back();
}

void Metrics::SetModelState(const std::string& model, int64_t version, absl::string_view state) {
  if (!enabled_) return;
  static constexpr const char* kStates[] = {"READY", "LOADING", "UNLOADING", "UNAVAILABLE"};
  for (const char* name : kStates) {
    families_->model_state
        .Add({{"model", model}, {"version", absl::StrCat(version)}, {"state", name}})
        .Set(state == name ? 1 : 0);
  }
}

void Metrics::ModelLoadFailed(const std::string& model) {
  if (!enabled_) return;
  families_->load_failures.Add({{"model", model}}).Increment();
}

void Metrics::SetModelInfo(const ModelSummary& model) {
  if (!enabled_) return;
  std::unique_lock lock(models_mu_);
  if (auto it = model_info_.find(model.name); it != model_info_.end()) {
    families_->model_info.Remove(it->second);
  }
  Gauge& info = families_->model_info.Add({{"model", model.name},
                                           {"layout", model.layout},
                                           {"precision", model.precision},
                                           {"d_model", absl::StrCat(model.d_model)},
                                           {"d_context", absl::StrCat(model.d_context)},
                                           {"num_heads", absl::StrCat(model.num_heads)},
                                           {"head_dim", absl::StrCat(model.head_dim)}});
  info.Set(1);
  model_info_[model.name] = &info;
}

void Metrics::ClearModelInfo(const std::string& model) {
  if (!enabled_) return;
  std::unique_lock lock(models_mu_);
  if (auto it = model_info_.find(model); it != model_info_.end()) {
    families_->model_info.Remove(it->second);
    model_info_.erase(it);
  }
}

absl::StatusOr<int> Metrics::Serve(const MetricsHttpOptions& http) {
  if (!enabled_) return absl::FailedPreconditionError("metrics are off");
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> server =
      MetricsHttpServer::Start(http, [this] { return Exposition(); });
  if (!server.ok()) {
    return absl::Status(server.status().code(),
                        absl::StrCat(server.status().message(), " (--metrics-listen)"));
  }
  http_ = *std::move(server);
  return http_->port();
}

absl::StatusOr<int> Metrics::Serve(const std::string& listen) {
  MetricsHttpOptions http;
  http.listen = listen;
  return Serve(http);
}

std::string Metrics::Exposition() const {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  std::vector<prometheus::MetricFamily> process = process_->Collect();
  families.insert(families.end(), std::make_move_iterator(process.begin()),
                  std::make_move_iterator(process.end()));
  return prometheus::TextSerializer().Serialize(families);
}

ModelMetrics& Metrics::ForModel(absl::string_view name) {
  std::shared_lock lock(models_mu_);
  for (const auto& model : models_) {
    if (model->name_ == name) return *model;
  }
  return *unknown_;
}

void Metrics::CallArrived() {
  if (!enabled_) return;
  families_->inflight.Increment();
}

void Metrics::CallAnswered(ModelMetrics& model, CallProtocol protocol,
                           std::optional<core::AttentionKind> kind, absl::StatusCode code,
                           int64_t tokens, double seconds) {
  if (!enabled_) return;
  families_->inflight.Decrement();
  const int k = KindIndex(kind);
  const int c = CodeIndex(code);
  Lazy(model.requests_[static_cast<int>(protocol)][k][c], families_->requests,
       {{"model", model.name_},
        {"kind", KindLabel(k)},
        {"code", absl::StatusCodeToString(static_cast<absl::StatusCode>(c))},
        {"protocol", std::string(ProtocolLabel(protocol))}})
      .Increment();
  const Labels model_kind{{"model", model.name_}, {"kind", KindLabel(k)}};
  Lazy(model.request_duration_[k], families_->request_duration, model_kind, DurationBuckets())
      .Observe(seconds);
  if (c == 0) Lazy(model.tokens_[k], families_->tokens, model_kind).Increment(tokens);
}

void Metrics::SessionMessageAnswered(ModelMetrics& model, absl::StatusCode code) {
  if (!enabled_) return;
  const int c = CodeIndex(code);
  Lazy(model.session_messages_[c], families_->session_messages,
       {{"model", model.name_},
        {"code", absl::StatusCodeToString(static_cast<absl::StatusCode>(c))}})
      .Increment();
}

const std::vector<double>& Metrics::DurationBuckets() {
  static const auto* buckets = new std::vector<double>{
      50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
      0.1,   0.25,   0.5,    1,      2.5,  5,      10,   25,    60};
  return *buckets;
}

}  // namespace attnserve::server
