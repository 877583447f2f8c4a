// The load test's arithmetic and formats: the histogram against exact sorted values, sweeps,
// the Prometheus parser and the server split, and the JSON/CSV shapes.
#include "client/load_report.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "client/histogram.h"
#include "client/http_connection.h"
#include "client/load_engine.h"
#include "client/metrics_scrape.h"
#include "gtest/gtest.h"

namespace attnserve::client {
namespace {

TEST(LatencyHistogramTest, QuantilesAreWithinOneBucketOfTheExactValues) {
  // Log-normal latencies spanning 5 decades: a linear histogram could not hold them.
  std::mt19937_64 engine(3);
  std::lognormal_distribution<double> latency(7.0, 2.0);
  std::vector<int64_t> values;
  LatencyHistogram h;
  for (int i = 0; i < 20000; ++i) {
    values.push_back(static_cast<int64_t>(latency(engine)));
    h.Record(values.back());
  }
  std::sort(values.begin(), values.end());
  for (double q : {0.0, 0.1, 0.5, 0.9, 0.99, 0.999, 1.0}) {
    const size_t rank = std::max<size_t>(1, static_cast<size_t>(std::ceil(q * values.size())));
    const auto exact = static_cast<double>(values[rank - 1]);
    EXPECT_NEAR(static_cast<double>(h.ValueAtQuantile(q)), exact, exact / 128 + 1) << "q " << q;
  }
  EXPECT_EQ(h.max(), values.back());
  EXPECT_EQ(h.min(), values.front());
  EXPECT_EQ(h.count(), 20000);
  double sum = 0;
  for (int64_t v : values) sum += static_cast<double>(v);
  EXPECT_DOUBLE_EQ(h.mean(), sum / 20000);
}

TEST(LatencyHistogramTest, BucketsCoverEveryValueAndMergeAdds) {
  LatencyHistogram a, b;
  for (int64_t v : {0, 5, 127, 128, 255, 256, 1000, 123456789}) a.Record(v);
  b.Record(7);
  b.Record(-3);  // a negative value counts as 0
  int64_t total = 0;
  for (const LatencyHistogram::Bucket& bucket : a.Buckets()) {
    EXPECT_LT(bucket.low_us, bucket.high_us);
    EXPECT_LE(bucket.high_us - bucket.low_us, std::max<int64_t>(1, bucket.low_us / 128));
    total += bucket.count;
  }
  EXPECT_EQ(total, 8);
  a.Merge(b);
  EXPECT_EQ(a.count(), 10);
  EXPECT_EQ(a.min(), 0);
  EXPECT_EQ(a.max(), 123456789);
  EXPECT_EQ(LatencyHistogram().ValueAtQuantile(0.5), 0);
}

TEST(ParseSweepTest, AddsOrMultipliesUpToTheEnd) {
  EXPECT_EQ(*ParseSweep("1:4", /*integer=*/true), (std::vector<double>{1, 2, 3, 4}));
  EXPECT_EQ(*ParseSweep("2:9:3", true), (std::vector<double>{2, 5, 8}));
  EXPECT_EQ(*ParseSweep("1:16:x2", true), (std::vector<double>{1, 2, 4, 8, 16}));
  EXPECT_EQ(*ParseSweep("100:800", /*integer=*/false), (std::vector<double>{100, 200, 400, 800}));
  EXPECT_EQ(*ParseSweep("50:200:+50", false), (std::vector<double>{50, 100, 150, 200}));
  for (const char* bad : {"", "4", "4:1", "0:4", "1:4:0", "1:4:x1", "a:b", "1:2:3:4", "1.5:3"}) {
    EXPECT_EQ(ParseSweep(bad, true).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(ParseSweep("1:1000000:1", true).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PrometheusTextTest, ParsesLabelsValuesAndSkipsComments) {
  absl::StatusOr<std::vector<MetricSample>> samples = ParsePrometheusText(
      "# HELP x a metric\n# TYPE x counter\n"
      "x{model=\"a\",code=\"OK\"} 12\n"
      "y_bucket{le=\"+Inf\",path=\"q\\\"uote\"} 3 1700000000\n"
      "z 1.5e-3\n\n");
  ASSERT_TRUE(samples.ok()) << samples.status();
  ASSERT_EQ(samples->size(), 3u);
  EXPECT_EQ((*samples)[0].name, "x");
  EXPECT_EQ((*samples)[0].labels.at("code"), "OK");
  EXPECT_EQ((*samples)[0].value, 12);
  EXPECT_EQ((*samples)[1].labels.at("path"), "q\"uote");
  EXPECT_EQ((*samples)[1].value, 3);
  EXPECT_DOUBLE_EQ((*samples)[2].value, 0.0015);
  EXPECT_FALSE(ParsePrometheusText("x{model=\"a\" 1\n").ok());
  EXPECT_FALSE(ParsePrometheusText("x notanumber\n").ok());
}

TEST(ServerSplitTest, DiffsTheHistogramsOfOneModel) {
  // 100 queue waits of 10 ms, then 100 more of 2 ms; model "other" must be ignored.
  auto scrape = [](double count, double sum, double le5, double batches, double calls) {
    return *ParsePrometheusText(absl::StrCat(
        "attnserve_queue_duration_seconds_bucket{model=\"m\",le=\"0.005\"} ", le5, "\n",
        "attnserve_queue_duration_seconds_bucket{model=\"m\",le=\"0.02\"} ", count, "\n",
        "attnserve_queue_duration_seconds_bucket{model=\"m\",le=\"+Inf\"} ", count, "\n",
        "attnserve_queue_duration_seconds_sum{model=\"m\"} ", sum, "\n",
        "attnserve_queue_duration_seconds_count{model=\"m\"} ", count, "\n",
        "attnserve_queue_duration_seconds_count{model=\"other\"} 999\n",
        "attnserve_batch_calls_sum{model=\"m\"} ", calls, "\n",
        "attnserve_batch_calls_count{model=\"m\"} ", batches, "\n",
        "attnserve_requests_total{model=\"m\",kind=\"causal\",code=\"OK\"} ", count, "\n"));
  };
  const ServerSplit split =
      DiffServerMetrics(scrape(100, 1.0, 0, 10, 100), scrape(200, 1.2, 100, 35, 200), "m");
  EXPECT_TRUE(split.found);
  EXPECT_DOUBLE_EQ(split.queue.count, 100);
  EXPECT_NEAR(split.queue.mean_ms, 2.0, 1e-9);
  EXPECT_NEAR(split.queue.p50_ms, 2.5, 1e-9);  // half-way through the [0, 5] ms bucket
  EXPECT_NEAR(split.queue.p99_ms, 4.95, 1e-9);
  EXPECT_DOUBLE_EQ(split.batches, 25);
  EXPECT_DOUBLE_EQ(split.mean_batch_calls, 4);
  EXPECT_DOUBLE_EQ(split.requests_by_code.at("OK"), 100);
  EXPECT_FALSE(DiffServerMetrics({}, {}, "").found);
}

TEST(HttpGetTest, RefusesWhatItCannotFetch) {
  EXPECT_EQ(HttpGet("https://127.0.0.1:1/metrics", absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(HttpGet("127.0.0.1:1/metrics", absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

StepReport SomeStep(LoadMode mode, int64_t ok) {
  StepReport r;
  r.mode = mode;
  r.concurrency = mode == LoadMode::kClosed ? 3 : 0;
  r.offered_rate = mode == LoadMode::kOpen ? 50 : 0;
  r.window = r.elapsed = absl::Seconds(2);
  r.scheduled = r.sent = ok + 1;
  r.ok = ok;
  r.errors[absl::StatusCode::kResourceExhausted] = 1;
  r.tokens = ok * 16;
  for (int64_t i = 1; i <= ok; ++i) r.latency.Record(i * 1000);
  return r;
}

TEST(LoadReportTest, JsonHasTheContractKeysAndOneEntryPerStep) {
  LoadRun run;
  run.sweep = "rate";
  run.steps.push_back({SomeStep(LoadMode::kOpen, 10), std::nullopt});
  run.steps.push_back({SomeStep(LoadMode::kOpen, 20), std::nullopt});
  const nlohmann::json json = nlohmann::json::parse(RunJson(run).dump());
  for (const char* key : {"mode", "offered_rate", "sent", "ok", "errors", "requests_per_second",
                          "tokens_per_second", "latency_ms", "histogram", "steps"}) {
    EXPECT_TRUE(json.contains(key)) << key;
  }
  ASSERT_EQ(json["steps"].size(), 2u);
  EXPECT_EQ(json["mode"], "open");
  EXPECT_EQ(json["sent"], 11 + 21);
  EXPECT_EQ(json["errors"]["RESOURCE_EXHAUSTED"], 2);
  EXPECT_EQ(json["steps"][1]["ok"], 20);
  EXPECT_EQ(json["steps"][1]["offered_rate"], 50);
  EXPECT_DOUBLE_EQ(json["steps"][1]["requests_per_second"].get<double>(), 10);
  EXPECT_DOUBLE_EQ(json["steps"][1]["tokens_per_second"].get<double>(), 160);
  for (const char* q : {"p50", "p90", "p99", "p999", "max", "mean"}) {
    EXPECT_TRUE(json["steps"][0]["latency_ms"].contains(q)) << q;
  }
  EXPECT_EQ(json["steps"][0]["latency_ms"]["max"], 10);
  EXPECT_NEAR(json["steps"][1]["latency_ms"]["p50"].get<double>(), 10, 10.0 / 128);
}

TEST(LoadReportTest, AFailedCodeShowsItsFirstMessage) {
  LoadRun run;
  StepReport first = SomeStep(LoadMode::kClosed, 10);
  first.first_error[absl::StatusCode::kResourceExhausted] = "the queue is full";
  StepReport second = SomeStep(LoadMode::kClosed, 20);
  second.first_error[absl::StatusCode::kResourceExhausted] = "a later message";
  run.steps.push_back({first, std::nullopt});
  const std::string text = RunSummary(run);
  EXPECT_NE(text.find("RESOURCE_EXHAUSTED: 1 (first: the queue is full)"), std::string::npos)
      << text;
  run.steps.push_back({second, std::nullopt});
  const nlohmann::json json = nlohmann::json::parse(RunJson(run).dump());
  EXPECT_EQ(json["first_error_messages"]["RESOURCE_EXHAUSTED"], "the queue is full");
  EXPECT_EQ(json["steps"][1]["first_error_messages"]["RESOURCE_EXHAUSTED"], "a later message");
}

TEST(LoadReportTest, CsvHasAHeaderAndARowPerStepOfEqualWidth) {
  LoadRun run;
  run.sweep = "concurrency";
  for (int ok : {5, 6, 7}) run.steps.push_back({SomeStep(LoadMode::kClosed, ok), std::nullopt});
  std::vector<std::string> lines = absl::StrSplit(RunCsv(run), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 4u);
  const size_t columns = std::count(lines[0].begin(), lines[0].end(), ',');
  for (const std::string& line : lines) {
    EXPECT_EQ(std::count(line.begin(), line.end(), ','), columns) << line;
  }
  EXPECT_NE(RunSummary(run).find("c=3"), std::string::npos);
}

TEST(LoadEngineTest, RefusesBadOptionsBeforeAnyCall) {
  // Nothing listens there: the options must be refused before a call is tried.
  std::unique_ptr<AttentionClient> client = AttentionClient::Connect("127.0.0.1:1");
  GrpcLoadSender sender(client.get());
  LoadEngine engine({&sender}, {WorkItem{}});
  LoadOptions unbounded;
  unbounded.duration = absl::ZeroDuration();
  EXPECT_EQ(engine.RunStep(unbounded).status().code(), absl::StatusCode::kInvalidArgument);
  LoadOptions no_callers;
  no_callers.concurrency = 0;
  EXPECT_EQ(engine.RunStep(no_callers).status().code(), absl::StatusCode::kInvalidArgument);
  LoadOptions no_rate;
  no_rate.mode = LoadMode::kOpen;
  EXPECT_EQ(engine.RunStep(no_rate).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LoadEngine({}, {}).RunStep({}).status().code(), absl::StatusCode::kInvalidArgument);
}

// A sender that answers every call at once, from a thread of its own (as gRPC's are), and
// counts the calls sent before and after the window's scrape has returned.
class InstantSender final : public LoadSender {
 public:
  InstantSender() : worker_([this] { Answer(); }) {}
  ~InstantSender() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    ready_.notify_one();
    worker_.join();
  }
  void SendAsync(const WorkItem&, std::function<void(absl::Status)> done) const override {
    (scraped_ ? after_ : before_).fetch_add(1);
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(done));
    }
    ready_.notify_one();
  }
  absl::Status Send(const WorkItem&) const override { return absl::OkStatus(); }

  // The scrape: a moment of its own, as an HTTP GET takes.
  void Scrape() {
    ++scrapes_;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    scraped_ = true;
  }
  int scrapes() const { return scrapes_; }
  int64_t before() const { return before_; }
  int64_t after() const { return after_; }

 private:
  void Answer() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      ready_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      std::function<void(absl::Status)> done = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      done(absl::OkStatus());
      lock.lock();
    }
  }

  mutable std::mutex mu_;
  mutable std::condition_variable ready_;
  mutable std::deque<std::function<void(absl::Status)>> queue_;
  bool stopping_ = false;
  std::atomic<bool> scraped_{false};
  std::atomic<int> scrapes_{0};
  mutable std::atomic<int64_t> before_{0}, after_{0};
  std::thread worker_;
};

// The window's scrape comes before every counted call, in both loops, with a warm-up or none:
// counted calls that all end before the waiting thread wakes at the window's time were once
// sent unscraped (and a run with none after the wake-up failed: a window without a scrape).
TEST(LoadEngineTest, TheWindowsScrapeComesBeforeEveryCountedCall) {
  for (LoadMode mode : {LoadMode::kClosed, LoadMode::kOpen}) {
    for (absl::Duration warmup : {absl::ZeroDuration(), absl::Milliseconds(30)}) {
      SCOPED_TRACE(absl::StrCat(mode == LoadMode::kClosed ? "closed" : "open", " loop, warm-up ",
                                absl::FormatDuration(warmup)));
      InstantSender sender;
      LoadEngine engine({&sender}, {WorkItem{.request = {}, .tokens = 1}});
      LoadOptions options;
      options.mode = mode;
      options.rate = 20000;
      options.warmup = warmup;
      options.duration = absl::Seconds(10);
      options.max_requests = 6;
      options.window_started = [&] { sender.Scrape(); };
      absl::StatusOr<StepReport> report = engine.RunStep(options);
      ASSERT_TRUE(report.ok()) << report.status();
      EXPECT_EQ(sender.scrapes(), 1);
      EXPECT_EQ(report->sent, 6);
      EXPECT_EQ(report->ok, 6);
      // Every counted call after the scrape (and a warm-up call or two that were on their way).
      EXPECT_GE(sender.after(), 6);
      if (warmup == absl::ZeroDuration()) {
        EXPECT_EQ(sender.before(), 0);
      } else {
        EXPECT_GT(sender.before(), 0);  // a real warm-up ran
      }
    }
  }
}

TEST(LoadReportTest, QueryTokensAreTheLengthsOrEveryRow) {
  v1::ForwardRequest request;
  for (int64_t dim : {3, 8, 16}) request.mutable_input()->add_shape(dim);
  EXPECT_EQ(QueryTokens(request), 24);
  for (int32_t len : {8, 2, 5}) request.add_lengths(len);
  EXPECT_EQ(QueryTokens(request), 15);
}

}  // namespace
}  // namespace attnserve::client
