#pragma once

// The server's Prometheus metrics (README.md, "Metrics"), behind one small interface so that
// nothing else includes prometheus-cpp. Handles are made once at start-up; recording a call is
// a few atomic operations and never allocates, except the first time a (kind, code) pair
// appears for a model.

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/layer_spec.h"
#include "server/observability/call_protocol.h"
#include "server/observability/metrics_http.h"
#include "server/observability/model_summary.h"

namespace prometheus {
class Collectable;
class Counter;
class Gauge;
class Histogram;
class Registry;
template <typename T>
class Family;
}  // namespace prometheus

namespace attnserve::server {

class Metrics;

// Why a call was answered without compute to protect the calls that can still be served
// (attnserve_shed_total's reason label, kShedReasonNames).
enum class ShedReason {
  kQueueFull,   // --max-queue calls already queued
  kDeadline,    // its deadline would pass before its run could end, given the work ahead
  kQueueDelay,  // the model is overloaded and the call would wait past the target delay
  kExpired,     // its deadline passed while it was queued
};
inline constexpr int kShedReasons = 4;
inline constexpr const char* kShedReasonNames[kShedReasons] = {"queue_full", "deadline",
                                                               "queue_delay", "expired"};

// Why a decode session or step was refused for a limit (attnserve_sessions_refused_total).
enum class SessionRefusal { kMaxSessions, kKvCache, kSessionTokens };
inline constexpr int kSessionRefusals = 3;
inline constexpr const char* kSessionRefusalNames[kSessionRefusals] = {"max_sessions", "kv_cache",
                                                                       "session_tokens"};

// One served model's series. A call for a model the server does not have is recorded on the
// handle whose model label is "" (Metrics::ForModel), so clients cannot create series.
class ModelMetrics {
 public:
  ModelMetrics(const ModelMetrics&) = delete;
  ModelMetrics& operator=(const ModelMetrics&) = delete;

  // The model's queue now holds `calls` calls (attnserve_queue_depth).
  void SetQueueDepth(int calls);
  // `requests` of its sessions wait for the one before them (attnserve_sequence_requests_waiting).
  void SetSequenceRequestsWaiting(int requests);

  // A call waited `seconds` from arrival to the start of its compute run.
  void QueueWait(double seconds);

  // One compute run held `calls` calls with `tokens` tokens (input + context) and took
  // `seconds`.
  void ComputeRun(int calls, int64_t tokens, double seconds);

  // A call was shed for `reason` (attnserve_shed_total).
  void Shed(ShedReason reason);

  // `seconds` of compute went to calls answered after their deadline
  // (attnserve_late_compute_seconds_total): work no caller waited for.
  void LateCompute(double seconds);

  // Decode sessions: one opened or closed (attnserve_sessions), one refused for `why`
  // (attnserve_sessions_refused_total), the bytes the model's caches hold now
  // (attnserve_kv_cache_bytes: `bytes` read under a lock, so that of two threads that changed
  // it, the later Set shows both changes), and one compute run of decode steps holding `tokens`
  // new tokens (attnserve_decode_tokens_total, attnserve_decode_step_tokens).
  void SessionOpened();
  void SessionClosed();
  void SessionRefused(SessionRefusal why);
  void SetKvCacheBytes(const std::atomic<int64_t>& bytes);
  void DecodeRun(int64_t tokens);

 private:
  friend class Metrics;
  static constexpr int kKinds = 5;   // core::AttentionKind's four, then "" (not known)
  static constexpr int kCodes = 17;  // gRPC's status codes, OK (0) to UNAUTHENTICATED (16)

  ModelMetrics(Metrics* metrics, std::string name);

  const std::string name_;  // the label value: a served model's name, or ""
  // Null when metrics are off, and for the "" handle: the methods above then do nothing.
  prometheus::Gauge* queue_depth_ = nullptr;
  prometheus::Gauge* sequence_requests_waiting_ = nullptr;
  prometheus::Histogram* queue_duration_ = nullptr;
  prometheus::Histogram* compute_duration_ = nullptr;
  prometheus::Histogram* batch_calls_ = nullptr;
  prometheus::Histogram* batch_tokens_ = nullptr;
  std::array<prometheus::Counter*, kShedReasons> shed_{};
  prometheus::Counter* late_compute_ = nullptr;
  prometheus::Gauge* sessions_ = nullptr;
  prometheus::Gauge* kv_cache_bytes_ = nullptr;
  std::mutex kv_cache_bytes_mu_;  // a load and its Set, one at a time
  prometheus::Counter* decode_tokens_ = nullptr;
  prometheus::Histogram* decode_step_tokens_ = nullptr;
  std::array<prometheus::Counter*, kSessionRefusals> sessions_refused_{};
  // Made on first use, so the exposition lists only the kinds and codes that happened.
  std::array<std::array<std::array<std::atomic<prometheus::Counter*>, kCodes>, kKinds>,
             kCallProtocols>
      requests_{};
  std::array<std::atomic<prometheus::Counter*>, kKinds> tokens_{};
  std::array<std::atomic<prometheus::Counter*>, kCodes> session_messages_{};
  std::array<std::atomic<prometheus::Histogram*>, kKinds> request_duration_{};
};

// Every metric of one server, and the HTTP endpoint Prometheus scrapes.
class Metrics {
 public:
  // Metrics that record nothing and serve nothing (--metrics-listen off): every call returns
  // at once, so the serving path can call them unconditionally.
  static std::unique_ptr<Metrics> Disabled();

  // Metrics that record, with no model yet and not yet served over HTTP.
  static std::unique_ptr<Metrics> Create();

  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // Serves GET /metrics (Prometheus text format) as `http` says: its address (HOST:PORT or
  // [V6HOST]:PORT; port 0 picks one), TLS and token check. Returns the bound port; Unavailable
  // when it cannot bind, InvalidArgument when the TLS files are unusable.
  absl::StatusOr<int> Serve(const MetricsHttpOptions& http);

  // Serves plain HTTP on `listen`, every request allowed (tests, loopback).
  absl::StatusOr<int> Serve(const std::string& listen);

  // Series for a served model, made once per name (at start-up, or when a repository model
  // first appears), the same handle for a name added again; its handle.
  ModelMetrics& AddModel(const std::string& name);

  // Sets attnserve_kv_cache_limit_bytes, the budget every session's cache shares.
  void SetKvCacheLimit(int64_t bytes);
  // Sets attnserve_kv_cache_resident_bytes, the bytes of the KV cache's slabs in memory.
  void SetKvCacheResident(int64_t bytes);

  // Sets attnserve_http_body_limit_bytes, the REST port's room for request bodies.
  void SetHttpBodyLimit(int64_t bytes);
  // The REST port holds `change` bytes more (fewer, when negative) of request bodies
  // (attnserve_http_body_bytes).
  void HttpBodyBytesChanged(int64_t change);

  // Sets attnserve_model_info for a model (its newest ready version's shapes), replacing the
  // model's previous series.
  void SetModelInfo(const ModelSummary& model);
  // `model` has no ready version: its attnserve_model_info series goes.
  void ClearModelInfo(const std::string& model);

  // attnserve_model_state{model,version,state}: 1 for `state` (READY, LOADING, UNLOADING,
  // UNAVAILABLE), 0 for the others.
  void SetModelState(const std::string& model, int64_t version, absl::string_view state);

  // A version of `model` failed to load (attnserve_model_load_failures_total).
  void ModelLoadFailed(const std::string& model);

  // The handle of the served model named `name`, or the one labelled "" for any other name.
  ModelMetrics& ForModel(absl::string_view name);

  // A Forward call arrived: attnserve_inflight_requests goes up until CallAnswered.
  void CallArrived();

  // A Forward call was answered with `code` after `seconds` from arrival. `kind` is empty when
  // the call was refused before its kind was known; `tokens` counts (for OK calls) the valid
  // query tokens.
  void CallAnswered(ModelMetrics& model, CallProtocol protocol,
                    std::optional<core::AttentionKind> kind, absl::StatusCode code, int64_t tokens,
                    double seconds);

  // A message of a decode session was answered with `code`
  // (attnserve_session_messages_total).
  void SessionMessageAnswered(ModelMetrics& model, absl::StatusCode code);

  // Bucket bounds (seconds) of the duration histograms: 50 µs to 60 s, 1-2.5-5 per decade.
  static const std::vector<double>& DurationBuckets();

 private:
  friend class ModelMetrics;
  struct Families;

  explicit Metrics(bool enabled);

  // The text exposition of every series, as a scrape reads it.
  std::string Exposition() const;

  const bool enabled_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<prometheus::Collectable> process_;  // process_* figures
  std::unique_ptr<Families> families_;
  mutable std::shared_mutex models_mu_;                // models are added while calls are answered
  std::vector<std::unique_ptr<ModelMetrics>> models_;  // guarded by models_mu_: served models
  std::map<std::string, prometheus::Gauge*> model_info_;  // guarded by models_mu_
  std::unique_ptr<ModelMetrics> unknown_;                 // the "" one
  std::unique_ptr<MetricsHttpServer> http_;
};

}  // namespace attnserve::server
