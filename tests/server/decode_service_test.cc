// Decode sessions over a real Decode stream: the exactness contract against PyTorch (every
// causal and causal cross golden case, prefill then single tokens, ragged sequences stepped
// together) and against one Forward over the whole sequence, each error answered in the stream
// with the session unchanged, the limits, and the cache freed when a stream ends.

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <initializer_list>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/kv_block_pool.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/base/heap_trimmer.h"
#include "tests/common/all_near.h"
#include "tests/common/golden.h"
#include "tests/common/sanitizers.h"
#include "tests/server/scrape.h"
#include "tests/server/test_util.h"

namespace attnserve::server::testing {
namespace {

using attnserve::test::kSanitized;

using Stream = grpc::ClientReaderWriter<v1::DecodeRequest, v1::DecodeResponse>;
constexpr int64_t kWidth = 256;  // the demo layer's d_model

// A message of B sequences taking `tokens[b]` rows each from `rows[b]` (row-major, `width`),
// starting at row `from[b]`, padded to the longest, as raw bytes.
v1::DecodeRequest StepOf(const std::vector<const float*>& rows, const std::vector<int64_t>& from,
                         const std::vector<int64_t>& tokens, int64_t width) {
  const int64_t batch = static_cast<int64_t>(tokens.size());
  const int64_t n = std::max<int64_t>(1, *std::max_element(tokens.begin(), tokens.end()));
  std::vector<float> values(batch * n * width, 0.0f);
  for (int64_t b = 0; b < batch; ++b) {
    std::copy(rows[b] + from[b] * width, rows[b] + (from[b] + tokens[b]) * width,
              values.begin() + b * n * width);
  }
  v1::DecodeRequest request;
  *request.mutable_input() = MakeTensor({batch, n, width}, values, /*raw=*/true);
  for (int64_t t : tokens) request.add_lengths(static_cast<int32_t>(t));
  return request;
}

// Ends each stream from the client's side, as a session ends normally; each must end OK.
void EndStreams(std::initializer_list<Stream*> streams) {
  for (Stream* stream : streams) {
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
  }
}

// Sends `request` and reads its answer.
v1::DecodeResponse Exchange(Stream& stream, const v1::DecodeRequest& request) {
  v1::DecodeResponse response;
  EXPECT_TRUE(stream.Write(request));
  EXPECT_TRUE(stream.Read(&response));
  return response;
}

class GoldenDecodeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto cases = test::LoadGoldenCases();
    ASSERT_TRUE(cases.ok()) << cases.status();
    cases_ = new std::vector<test::GoldenCase>(*std::move(cases));
    server_ = StartServer(GoldenServerOptions(*cases_)).release();
  }
  static void TearDownTestSuite() {
    delete server_;
    delete cases_;
  }
  static std::vector<test::GoldenCase>* cases_;
  static Server* server_;
};
std::vector<test::GoldenCase>* GoldenDecodeTest::cases_ = nullptr;
Server* GoldenDecodeTest::server_ = nullptr;

TEST_F(GoldenDecodeTest, EveryStepEqualsPyTorchsRowsOfTheWholeSequence) {
  auto stub = v1::AttentionService::NewStub(Connect(server_->port()));
  int checked = 0;
  for (const test::GoldenCase& c : *cases_) {
    const bool all_rows =
        static_cast<int64_t>(c.output_rows.size()) == c.input.batch * c.input.seq_len;
    if (!core::IsCausal(c.kind) || !all_rows) continue;
    SCOPED_TRACE(c.name);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    std::unique_ptr<Stream> stream = stub->Decode(&context);
    const int64_t batch = c.input.batch, width = c.input.width;
    std::vector<const float*> rows(batch);
    for (int64_t b = 0; b < batch; ++b)
      rows[b] = c.input.values.data() + b * c.input.seq_len * width;
    std::vector<int64_t> position(batch, 0);
    for (int step = 0;; ++step) {
      std::vector<int64_t> tokens(batch);
      bool more = false;
      for (int64_t b = 0; b < batch; ++b) {
        tokens[b] = std::min<int64_t>(step == 0 ? 3 : 1, c.input.lengths[b] - position[b]);
        more |= tokens[b] > 0;
      }
      if (!more) break;
      v1::DecodeRequest request = StepOf(rows, position, tokens, width);
      if (step == 0) {
        request.set_model(GoldenModelName(c));
        request.set_kind(c.kind == core::AttentionKind::kCausal ? v1::ATTENTION_KIND_CAUSAL
                                                                : v1::ATTENTION_KIND_CAUSAL_CROSS);
        if (c.context) {
          *request.mutable_context() = MakeTensor({batch, c.context->seq_len, c.context->width},
                                                  c.context->values, /*raw=*/false);
          for (int64_t l : c.context->lengths) request.add_context_lengths(static_cast<int32_t>(l));
        }
      }
      const v1::DecodeResponse response = Exchange(*stream, request);
      ASSERT_EQ(response.error_code(), 0) << response.error_message();
      const std::vector<float> output = TensorValues(response.output());
      const int64_t n = response.output().shape(1);
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t t = 0; t < tokens[b]; ++t) {
          const int64_t row = b * c.input.seq_len + position[b] + t;
          ASSERT_TRUE(test::AllNear(output.data() + (b * n + t) * c.d_output,
                                    c.expected_output.data() + row * c.d_output, c.d_output, 1e-4f,
                                    absl::StrCat("sequence ", b, " position ", position[b] + t)));
        }
        position[b] += tokens[b];
        EXPECT_EQ(response.positions(b), position[b]);
      }
    }
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
    ++checked;
  }
  EXPECT_GE(checked, 10);
}

class DecodeServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions options;
    options.max_sessions = 2;
    options.max_session_tokens = 64;
    Restart(options);
    // A smooth sequence of 128 demo tokens (a refused step may ask for more than the limit).
    sequence_.resize(128 * kWidth);
    for (size_t i = 0; i < sequence_.size(); ++i) sequence_[i] = std::sin(0.003f * i + 0.2f);
  }

  // A message appending tokens [from, from + n) of the sequence, B = 1.
  v1::DecodeRequest Tokens(int64_t from, int64_t n) {
    return StepOf({sequence_.data()}, {from}, {n}, kWidth);
  }

  // The test's own server (metrics on a free port), and a stub for it.
  void Restart(ServerOptions options) {
    options.metrics_listen = "127.0.0.1:0";
    // The old server goes first, and with it gRPC's callback threads (no other server holds
    // them): the new server's are then made after its services, so that a thread sanitizer sees
    // the services built before gRPC's threads call them. A thread left over from the old server
    // learns of the new one inside libgrpc, out of its sight, and each first call looked like a
    // race with the service's construction.
    server_.reset();
    server_ = StartServer(options);
    ASSERT_NE(server_, nullptr);
    stub_ = v1::AttentionService::NewStub(Connect(server_->port()));
    infer_ = inference::GRPCInferenceService::NewStub(Connect(server_->port()));
  }

  // A ModelInfer call (a sequence step) on the test's server.
  grpc::Status Infer(const inference::ModelInferRequest& request,
                     inference::ModelInferResponse* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return infer_->ModelInfer(&context, request, response);
  }

  // Waits (finely: a step of a few runs lasts milliseconds) until a decode run has appended
  // tokens since attnserve_decode_tokens_total read `tokens_before`.
  // A stream whose first message, a causal prompt of `tokens` tokens (on a server restarted with
  // room for 16384 a sequence), has begun to compute; the tokens decoded before it in `before`.
  std::unique_ptr<Stream> PromptComputing(grpc::ClientContext* context, int64_t tokens,
                                          double* before) {
    ServerOptions options;
    options.max_session_tokens = 16384;
    Restart(options);
    const std::vector<float> prompt = LongPrompt(tokens);
    *before = Counter("attnserve_decode_tokens_total");
    std::unique_ptr<Stream> stream = Open(context);
    v1::DecodeRequest first = StepOf({prompt.data()}, {0}, {tokens}, kWidth);
    first.set_kind(v1::ATTENTION_KIND_CAUSAL);
    EXPECT_TRUE(stream->Write(first));
    WaitForADecodeRun(*before);
    return stream;
  }

  void WaitForADecodeRun(double tokens_before) {
    for (int i = 0; i < 5000 && Counter("attnserve_decode_tokens_total") == tokens_before; ++i) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  // A step of a sequence (a ModelInfer `request`) sent from a thread. Made once it has begun to
  // run (kRunning: a long step, so that the sequence's next requests wait for their turn behind
  // it), or once it waits for its turn (kWaiting: attnserve_sequence_requests_waiting counts it).
  enum class Until { kRunning, kWaiting };
  class SentStep {
   public:
    SentStep(DecodeServiceTest& test, inference::ModelInferRequest request, Until until) {
      const double tokens_before = test.Counter("attnserve_decode_tokens_total");
      const double waiting_before = test.Gauge("attnserve_sequence_requests_waiting");
      context_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
      thread_ = std::thread([this, &test, request = std::move(request)] {
        inference::ModelInferResponse response;
        status_ = test.infer_->ModelInfer(&context_, request, &response);
        answered_ = true;
      });
      if (until == Until::kRunning) {
        test.WaitForADecodeRun(tokens_before);
        return;
      }
      for (int i = 0; i < 5000 && !answered_.load() &&
                      test.Gauge("attnserve_sequence_requests_waiting") <= waiting_before;
           ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      EXPECT_FALSE(answered_.load()) << "the step was answered without waiting for its turn";
      EXPECT_GT(test.Gauge("attnserve_sequence_requests_waiting"), waiting_before)
          << "the step was never seen waiting for its turn";
    }
    ~SentStep() { Join(); }
    // Its caller leaves: the call is cancelled.
    void Cancel() { context_.TryCancel(); }
    // Whether its answer has come.
    bool answered() const { return answered_.load(); }
    // Its answer, once it comes.
    grpc::Status Join() {
      if (thread_.joinable()) thread_.join();
      return status_;
    }

   private:
    grpc::ClientContext context_;
    std::thread thread_;
    grpc::Status status_;
    std::atomic<bool> answered_{false};
  };

  // A smooth prompt of `tokens` demo tokens.
  static std::vector<float> LongPrompt(int64_t tokens) {
    std::vector<float> prompt(tokens * kWidth);
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = std::sin(0.001f * i);
    return prompt;
  }

  std::unique_ptr<Stream> Open(grpc::ClientContext* context) {
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return stub_->Decode(context);
  }

  // A causal session opened with the sequence's first 4 tokens.
  std::unique_ptr<Stream> OpenWithFirstTokens(grpc::ClientContext* context) {
    std::unique_ptr<Stream> stream = Open(context);
    v1::DecodeRequest first = Tokens(0, 4);
    first.set_kind(v1::ATTENTION_KIND_CAUSAL);
    EXPECT_EQ(Exchange(*stream, first).error_code(), 0);
    return stream;
  }

  // The output row of the sequence's token at `position` (after the tokens before it), from a
  // Decode stream of its first position + 1 tokens.
  std::vector<float> RowOfTheSequence(int64_t position) { return RowOf(sequence_, position); }

  // The same for the tokens of `tokens`.
  std::vector<float> RowOf(const std::vector<float>& tokens, int64_t position) {
    grpc::ClientContext context;
    std::unique_ptr<Stream> stream = Open(&context);
    v1::DecodeRequest first = StepOf({tokens.data()}, {0}, {position + 1}, kWidth);
    first.set_kind(v1::ATTENTION_KIND_CAUSAL);
    const std::vector<float> all = TensorValues(Exchange(*stream, first).output());
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
    if (all.size() != static_cast<size_t>((position + 1) * kWidth)) return {};
    return {all.end() - kWidth, all.end()};
  }

  double Counter(const std::string& name) { return Gauge(name); }

  double Gauge(const std::string& name) { return Sample(name, {{"model", "demo"}}); }

  // One series' sample, scraped now.
  double Sample(const std::string& name, SeriesLabels labels) {
    absl::StatusOr<std::map<std::string, double>> samples = Scrape(server_->metrics_port());
    EXPECT_TRUE(samples.ok()) << samples.status();
    return (*samples)[SeriesKey(name, std::move(labels))];
  }

  // attnserve_session_messages_total of `model`'s messages answered with `code`.
  double SessionMessages(const std::string& model, const std::string& code) {
    return Sample("attnserve_session_messages_total", {{"code", code}, {"model", model}});
  }

  std::unique_ptr<Server> server_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
  std::unique_ptr<inference::GRPCInferenceService::Stub> infer_;
  std::vector<float> sequence_;
};

TEST_F(DecodeServiceTest, StepsEqualOneForwardOverTheWholeSequence) {
  grpc::ClientContext context;
  std::unique_ptr<Stream> stream = Open(&context);
  v1::DecodeRequest first = Tokens(0, 10);
  first.set_kind(v1::ATTENTION_KIND_CAUSAL);
  std::vector<float> got = TensorValues(Exchange(*stream, first).output());
  for (int64_t p = 10; p < 20; ++p) {
    const std::vector<float> row = TensorValues(Exchange(*stream, Tokens(p, 1)).output());
    got.insert(got.end(), row.begin(), row.end());
  }
  v1::ForwardRequest whole;
  whole.set_kind(v1::ATTENTION_KIND_CAUSAL);
  *whole.mutable_input() =
      MakeTensor({1, 20, kWidth}, {sequence_.begin(), sequence_.begin() + 20 * kWidth}, true);
  v1::ForwardResponse forward;
  grpc::ClientContext forward_context;
  ASSERT_TRUE(stub_->Forward(&forward_context, whole, &forward).ok());
  const std::vector<float> want = TensorValues(forward.output());
  ASSERT_TRUE(test::AllNear(got, want, 1e-4f));
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(DecodeServiceTest, ARefusedMessageIsAnsweredInTheStreamAndChangesNothing) {
  grpc::ClientContext context;
  std::unique_ptr<Stream> stream = Open(&context);
  v1::DecodeRequest bidirectional = Tokens(0, 4);
  bidirectional.set_kind(v1::ATTENTION_KIND_BIDIRECTIONAL);
  EXPECT_EQ(Exchange(*stream, bidirectional).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  v1::DecodeRequest first = Tokens(0, 4);
  first.set_kind(v1::ATTENTION_KIND_CAUSAL);
  v1::DecodeResponse opened = Exchange(*stream, first);
  ASSERT_EQ(opened.error_code(), 0) << opened.error_message();
  const std::vector<float> after_four = TensorValues(Exchange(*stream, Tokens(4, 1)).output());

  v1::DecodeRequest narrow;
  *narrow.mutable_input() = MakeTensor({1, 1, 8}, std::vector<float>(8, 1.0f), true);
  v1::DecodeResponse refused = Exchange(*stream, narrow);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << refused.error_message();
  EXPECT_EQ(refused.positions(0), 5);
  v1::DecodeRequest past = Tokens(5, 1);
  past.set_truncate_to(6);
  refused = Exchange(*stream, past);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << refused.error_message();
  refused = Exchange(*stream, Tokens(5, 60));  // 65 tokens: over --max-session-tokens 64
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(refused.error_message().find("--max-session-tokens"), std::string::npos);
  EXPECT_EQ(refused.positions(0), 5);

  // Rolled back to 4 tokens, the same fifth token gives the same row: nothing was changed.
  v1::DecodeRequest again = Tokens(4, 1);
  again.set_truncate_to(4);
  v1::DecodeResponse redo = Exchange(*stream, again);
  ASSERT_EQ(redo.error_code(), 0) << redo.error_message();
  EXPECT_EQ(TensorValues(redo.output()), after_four);
  EXPECT_EQ(redo.positions(0), 5);
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

// A refused first message opens nothing: no session is counted or charged, and the next
// message opens the session with its own number of sequences.
TEST_F(DecodeServiceTest, ARefusedFirstMessageOpensNoSession) {
  grpc::ClientContext context;
  std::unique_ptr<Stream> stream = Open(&context);
  v1::DecodeRequest narrow;  // three sequences of a width that is not d_model
  narrow.set_kind(v1::ATTENTION_KIND_CAUSAL);
  *narrow.mutable_input() = MakeTensor({3, 1, 8}, std::vector<float>(24, 1.0f), true);
  v1::DecodeResponse refused = Exchange(*stream, narrow);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << refused.error_message();
  EXPECT_EQ(refused.positions_size(), 0);
  EXPECT_EQ(Gauge("attnserve_sessions"), 0);
  EXPECT_EQ(Gauge("attnserve_kv_cache_bytes"), 0);
  v1::DecodeRequest too_long = Tokens(0, 65);  // over --max-session-tokens 64
  too_long.set_kind(v1::ATTENTION_KIND_CAUSAL);
  refused = Exchange(*stream, too_long);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_EQ(refused.positions_size(), 0);
  EXPECT_EQ(Gauge("attnserve_sessions"), 0);
  EXPECT_EQ(Gauge("attnserve_kv_cache_bytes"), 0);

  v1::DecodeRequest first = Tokens(0, 4);  // B = 1, though the refused messages said 3
  first.set_kind(v1::ATTENTION_KIND_CAUSAL);
  const v1::DecodeResponse opened = Exchange(*stream, first);
  ASSERT_EQ(opened.error_code(), 0) << opened.error_message();
  ASSERT_EQ(opened.positions_size(), 1);
  EXPECT_EQ(opened.positions(0), 4);
  EXPECT_EQ(Gauge("attnserve_sessions"), 1);
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

// The bytes glibc's malloc has handed out and not had back, over every arena and its mmapped
// chunks: mallinfo2 counts the main arena only, so a buffer another thread allocated below the
// mmap threshold (which glibc raises as large buffers are freed) would go unseen.
double HeapInUse() {
  char* text = nullptr;
  size_t size = 0;
  FILE* out = open_memstream(&text, &size);
  malloc_info(0, out);
  std::fclose(out);
  const std::string xml(text, size);
  std::free(text);
  // The totals over all arenas follow the last </heap>.
  const std::string totals = xml.substr(xml.rfind("</heap>") + 1);
  auto size_of = [&](const std::string& tag) {
    const size_t at = totals.find(tag);
    if (at == std::string::npos) return 0.0;
    const size_t value = totals.find("size=\"", at) + 6;
    return std::strtod(totals.c_str() + value, nullptr);
  };
  return size_of("<system type=\"current\"") - size_of("<total type=\"fast\"") -
         size_of("<total type=\"rest\"") + size_of("<total type=\"mmap\"");
}

// A budget past what the address space can reserve stops the start, naming the flag, and one
// whose bytes would not fit an int64_t is refused as an option.
TEST(DecodeOptionsTest, AKvCacheBudgetThatCannotBeReservedStopsTheStart) {
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.metrics_listen = "off";
  options.http_listen = "off";
  options.kv_cache_mib = int64_t{1} << 40;  // 1 EiB
  absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(server.status().message().find("--kv-cache-mib"), std::string::npos) << server.status();
  options.kv_cache_mib = (int64_t{1} << 40) + 1;
  server = Server::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(server.status().message().find("--kv-cache-mib"), std::string::npos) << server.status();
}

// Whether HeapInUse sees this process's allocations (a sanitizer's allocator is not glibc's).
bool HeapInUseCounts() {
  const double before = HeapInUse();
  void* volatile probe = std::malloc(1 << 20);
  const bool counted = HeapInUse() - before >= (1 << 20);
  std::free(probe);
  return counted;
}

// A stream waiting for its next message holds its session's cache, not a copy of the last
// message's input or output: after a prompt of 8 MiB in and 8 MiB out, the heap (both ends are
// in this process) holds little more than once the stream has ended (the cache is in the KV
// pool's slabs, whose pages go back to the system at the second look that finds them idle).
// (Measured against the end, not the start: the first long prompt of a process leaves 0.5 to
// 1.5 messages of gRPC's and the engine's buffers behind for good, whichever stream it came
// on.)
TEST_F(DecodeServiceTest, AnIdleStreamHoldsItsCacheAndNotItsLastMessage) {
  ServerOptions options;
  options.max_session_tokens = 1 << 20;
  options.heap_trim_interval = std::chrono::milliseconds(50);
  Restart(options);
  if (!HeapInUseCounts()) GTEST_SKIP() << "this allocator is not glibc's (a sanitizer's)";
  constexpr int64_t kTokens = 8192;
  constexpr double kMessageBytes = kTokens * kWidth * 4;  // the prompt's input, and its output
  const std::vector<float> prompt = LongPrompt(kTokens);
  grpc::ClientContext context;
  std::unique_ptr<Stream> stream = Open(&context);
  {
    v1::DecodeRequest first = StepOf({prompt.data()}, {0}, {kTokens}, kWidth);
    first.set_kind(v1::ATTENTION_KIND_CAUSAL);
    const v1::DecodeResponse opened = Exchange(*stream, first);
    ASSERT_EQ(opened.error_code(), 0) << opened.error_message();
    ASSERT_EQ(opened.positions(0), kTokens);
  }
  // The stream lets go of a message when its answer's write ends, a moment after the client has
  // read it, and reads the next one only then: once a 1-token step is answered, the prompt's
  // write has ended.
  const v1::DecodeResponse step =
      Exchange(*stream, StepOf({prompt.data()}, {0}, {1}, kWidth));  // any row will do
  ASSERT_EQ(step.error_code(), 0) << step.error_message();
  const double idle = HeapInUse();
  const int64_t idle_resident = ResidentBytes();
  const double cache = Gauge("attnserve_kv_cache_bytes");
  EXPECT_GE(cache, 2.0 * kMessageBytes);
  EXPECT_GE(Sample("attnserve_kv_cache_resident_bytes", {}), cache);
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  WaitFor([&] { return Gauge("attnserve_sessions") == 0; }, std::chrono::milliseconds(5000));
  ASSERT_EQ(Gauge("attnserve_kv_cache_bytes"), 0);
  // Keeping the messages for reuse held 1 to 2 messages here (a smaller message parsed into the
  // same buffers leaves their capacity as the prompt made it).
  const double held = idle - HeapInUse();
  EXPECT_LT(held, kMessageBytes / 2) << "one message is " << kMessageBytes << " bytes";
  // The cache's slabs went back to the system, but for one the pool keeps for the next block
  // (the heap trimmer, looking every 50 ms, also gives back freed heap: the gauge tells them
  // apart).
  WaitFor([&] { return Sample("attnserve_kv_cache_resident_bytes", {}) <= core::kKvSlabBytes; },
          std::chrono::milliseconds(5000));
  EXPECT_LE(Sample("attnserve_kv_cache_resident_bytes", {}), core::kKvSlabBytes);
  EXPECT_GT(static_cast<double>(idle_resident - ResidentBytes()),
            cache - static_cast<double>(core::kKvSlabBytes) - kMessageBytes / 2)
      << "the cache was " << cache << " bytes";
}

TEST_F(DecodeServiceTest, SessionsPastTheLimitOrOnAnUnknownModelEndTheirStream) {
  grpc::ClientContext unknown_context;
  std::unique_ptr<Stream> unknown = Open(&unknown_context);
  v1::DecodeRequest request = Tokens(0, 2);
  request.set_kind(v1::ATTENTION_KIND_CAUSAL);
  request.set_model("no-such-model");
  ASSERT_TRUE(unknown->Write(request));
  v1::DecodeResponse response;
  EXPECT_FALSE(unknown->Read(&response));
  EXPECT_EQ(unknown->Finish().error_code(), grpc::StatusCode::NOT_FOUND);

  request.clear_model();
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<Stream>> open;
  for (int i = 0; i < 2; ++i) {  // --max-sessions 2
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    open.push_back(Open(contexts.back().get()));
    ASSERT_EQ(Exchange(*open.back(), request).error_code(), 0);
  }
  EXPECT_EQ(Gauge("attnserve_sessions"), 2);
  EXPECT_GT(Gauge("attnserve_kv_cache_bytes"), 0);
  grpc::ClientContext third_context;
  std::unique_ptr<Stream> third = Open(&third_context);
  ASSERT_TRUE(third->Write(request));
  EXPECT_FALSE(third->Read(&response));
  EXPECT_EQ(third->Finish().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);

  // One ends as a client ends it, one is cancelled: both caches are freed at once.
  open[0]->WritesDone();
  EXPECT_TRUE(open[0]->Finish().ok());
  contexts[1]->TryCancel();
  open[1]->Finish();
  for (int i = 0; i < 100 && Gauge("attnserve_sessions") > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(Gauge("attnserve_sessions"), 0);
  EXPECT_EQ(Gauge("attnserve_kv_cache_bytes"), 0);
}

// Steps of many sessions waiting together run as one compute run, and a long prompt runs in
// chunks, so a step that arrives after it is answered before it: it runs with one of its
// chunks, in a run smaller than a chunk alone.
TEST_F(DecodeServiceTest, StepsOfSessionsMergeAndALongPromptDoesNotStallThem) {
  ServerOptions options;
  options.max_session_tokens = 8192;
  Restart(options);
  // Long enough that the step, sent after the prompt's first chunk, comes while it runs.
  constexpr int64_t kPrompt = 4096;
  const std::vector<float> long_prompt = LongPrompt(kPrompt);
  grpc::ClientContext long_context, short_context;
  std::unique_ptr<Stream> long_stream = Open(&long_context);
  std::unique_ptr<Stream> short_stream = OpenWithFirstTokens(&short_context);
  v1::DecodeRequest prompt = StepOf({long_prompt.data()}, {0}, {kPrompt}, kWidth);
  prompt.set_kind(v1::ATTENTION_KIND_CAUSAL);
  ASSERT_TRUE(long_stream->Write(prompt));
  // Once the prompt's first chunk has run, the step arrives in the middle of the prompt.
  for (int i = 0; i < 1000 && Counter("attnserve_decode_tokens_total") <= 4; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(Exchange(*short_stream, Tokens(4, 1)).error_code(), 0);
  v1::DecodeResponse prompt_answer;
  ASSERT_TRUE(long_stream->Read(&prompt_answer));
  EXPECT_EQ(prompt_answer.error_code(), 0) << prompt_answer.error_message();
  absl::StatusOr<std::map<std::string, double>> samples = Scrape(server_->metrics_port());
  ASSERT_TRUE(samples.ok()) << samples.status();
  // The step ran in a run with a chunk of the prompt, a smaller one than the prompt's runs
  // alone take (256 tokens): beside a step, a chunk reads no more keys than the step does, or
  // 16 tokens' worth at position 1024. So some run held between 5 and 128 tokens (the first
  // message's 4 ran alone), and none more than 256.
  const double runs =
      (*samples)[SeriesKey("attnserve_decode_step_tokens_count", {{"model", "demo"}})];
  auto runs_up_to = [&](const char* tokens) {
    return (*samples)[SeriesKey("attnserve_decode_step_tokens_bucket",
                                {{"le", tokens}, {"model", "demo"}})];
  };
  EXPECT_GE(runs, 2 + kPrompt / 256 - 1);
  EXPECT_EQ(runs_up_to("256"), runs) << "a run held the step and a whole chunk of the prompt";
  EXPECT_GT(runs_up_to("128") - runs_up_to("4"), 0) << "no run merged the step with a chunk";
  EndStreams({long_stream.get(), short_stream.get()});
}

// A step small enough to run on its caller's thread may still take two runs: beside a session
// that is generating, a prompt's run reads no more keys than the steps do (16 tokens' worth of
// 16384 at least). The rest of it must still run: the compute thread is told, though the first
// run did not go through it.
TEST_F(DecodeServiceTest, AStepThatRunsInlineInPartsIsFinished) {
  grpc::ClientContext generating_context, prompt_context;
  std::unique_ptr<Stream> generating = OpenWithFirstTokens(&generating_context);
  ASSERT_EQ(Exchange(*generating, Tokens(4, 1)).error_code(), 0);  // a short step, just now
  // 40 demo tokens at position 0 read 40 x (40 + 512) = 22080 keys' worth: serial, and past
  // the 16384 a run gives a prompt beside a generating session, so it runs as 20 + 20.
  prompt_context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  std::unique_ptr<Stream> prompt = stub_->Decode(&prompt_context);
  v1::DecodeRequest first = Tokens(0, 40);
  first.set_kind(v1::ATTENTION_KIND_CAUSAL);
  const v1::DecodeResponse answer = Exchange(*prompt, first);
  EXPECT_EQ(answer.error_code(), 0) << answer.error_message();
  ASSERT_EQ(answer.positions_size(), 1);
  EXPECT_EQ(answer.positions(0), 40);
  EndStreams({generating.get(), prompt.get()});
}

TEST_F(DecodeServiceTest, APromptBetweenAGeneratingSessionsStepsRunsNoCostlierThanTheSteps) {
  ServerOptions options;
  options.max_session_tokens = 8192;
  Restart(options);
  grpc::ClientContext long_context, short_context;
  std::unique_ptr<Stream> long_stream = Open(&long_context);
  std::unique_ptr<Stream> short_stream = OpenWithFirstTokens(&short_context);
  // One session generating all the while: 1-token steps back to back (each rolls back to
  // position 4, so its cache stays short).
  std::atomic<bool> stop{false};
  std::atomic<int> steps{0};
  std::thread stepper([&] {
    v1::DecodeRequest step = Tokens(4, 1);
    step.set_truncate_to(4);
    while (!stop.load() && Exchange(*short_stream, step).error_code() == 0) ++steps;
  });
  for (int i = 0; i < 1000 && steps.load() < 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  constexpr int64_t kPrompt = 4096;
  const std::vector<float> long_prompt = LongPrompt(kPrompt);
  v1::DecodeRequest prompt = StepOf({long_prompt.data()}, {0}, {kPrompt}, kWidth);
  prompt.set_kind(v1::ATTENTION_KIND_CAUSAL);
  const v1::DecodeResponse prompt_answer = Exchange(*long_stream, prompt);
  stop = true;
  stepper.join();
  EXPECT_EQ(prompt_answer.error_code(), 0) << prompt_answer.error_message();
  EXPECT_GT(steps.load(), 3);
  // Beside the step, or alone in a moment between two of them, a run's chunk of the prompt
  // reads no more keys than the step did, or the floor's 16k (under 32 tokens at position 0): no
  // run of 64 tokens or more (a 256-token chunk, were the prompt to run as if alone). Two are
  // allowed (four with sanitizers), for moments the stepping thread is off its core for 100 ms;
  // running as if alone would make 16.
  absl::StatusOr<std::map<std::string, double>> samples = Scrape(server_->metrics_port());
  ASSERT_TRUE(samples.ok()) << samples.status();
  const double runs =
      (*samples)[SeriesKey("attnserve_decode_step_tokens_count", {{"model", "demo"}})];
  const double small = (*samples)[SeriesKey("attnserve_decode_step_tokens_bucket",
                                            {{"le", "32"}, {"model", "demo"}})];
  EXPECT_GE(runs, kPrompt / 32);
  EXPECT_LE(runs - small, kSanitized ? 4 : 2)
      << "runs of the prompt cost more than the steps beside them";
  EndStreams({long_stream.get(), short_stream.get()});
}

// Beside a session open but idle (its last step over a second ago), a long prompt runs in whole
// chunks: the idle session waits for one chunk when it steps again, rather than the prompt
// running in chunks that shrink as it grows (42 demo tokens at position 4096), each reading the
// whole cache again.
TEST_F(DecodeServiceTest, APromptBesideAnIdleSessionRunsInWholeChunks) {
  ServerOptions options;
  options.max_session_tokens = 8192;
  Restart(options);
  grpc::ClientContext idle_context, long_context;
  std::unique_ptr<Stream> idle = OpenWithFirstTokens(&idle_context);  // a run of 4 tokens
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  constexpr int64_t kPrompt = 4096;
  const std::vector<float> long_prompt = LongPrompt(kPrompt);
  std::unique_ptr<Stream> long_stream = Open(&long_context);
  v1::DecodeRequest prompt = StepOf({long_prompt.data()}, {0}, {kPrompt}, kWidth);
  prompt.set_kind(v1::ATTENTION_KIND_CAUSAL);
  const v1::DecodeResponse answer = Exchange(*long_stream, prompt);
  EXPECT_EQ(answer.error_code(), 0) << answer.error_message();
  absl::StatusOr<std::map<std::string, double>> samples = Scrape(server_->metrics_port());
  ASSERT_TRUE(samples.ok()) << samples.status();
  auto runs_up_to = [&](const char* tokens) {
    return (*samples)[SeriesKey("attnserve_decode_step_tokens_bucket",
                                {{"le", tokens}, {"model", "demo"}})];
  };
  EXPECT_EQ(runs_up_to("+Inf"), 1 + kPrompt / 256);
  EXPECT_EQ(runs_up_to("128"), 1) << "the prompt ran in chunks shorter than 256 tokens";
  EndStreams({idle.get(), long_stream.get()});
}

// Runs are of one kind and one version; the kinds take turns, so a step of another kind waits
// for one chunk of a long prompt, not for the whole of it.
TEST_F(DecodeServiceTest, AStepOfAnotherKindDoesNotWaitForALongPromptToEnd) {
  ServerOptions options;
  options.max_session_tokens = 8192;
  Restart(options);
  constexpr int64_t kPrompt = 8000;
  const std::vector<float> long_prompt = LongPrompt(kPrompt);
  grpc::ClientContext long_context, cross_context;
  std::unique_ptr<Stream> long_stream = Open(&long_context);
  v1::DecodeRequest prompt = StepOf({long_prompt.data()}, {0}, {kPrompt}, kWidth);
  prompt.set_kind(v1::ATTENTION_KIND_CAUSAL);
  ASSERT_TRUE(long_stream->Write(prompt));
  std::atomic<bool> prompt_answered{false};
  v1::DecodeResponse prompt_answer;
  std::thread reader([&] {
    EXPECT_TRUE(long_stream->Read(&prompt_answer));
    prompt_answered = true;
  });
  // Once the prompt's first chunk has run, a causal cross session's first step arrives.
  for (int i = 0; i < 1000 && Counter("attnserve_decode_tokens_total") == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::unique_ptr<Stream> cross = Open(&cross_context);
  v1::DecodeRequest first = Tokens(0, 1);
  first.set_kind(v1::ATTENTION_KIND_CAUSAL_CROSS);
  const std::vector<float> context = LongPrompt(8);
  *first.mutable_context() = MakeTensor({1, 8, kWidth}, context, /*raw=*/true);
  const v1::DecodeResponse cross_answer = Exchange(*cross, first);
  const bool prompt_done_first = prompt_answered.load();
  reader.join();
  EXPECT_EQ(cross_answer.error_code(), 0) << cross_answer.error_message();
  EXPECT_EQ(prompt_answer.error_code(), 0) << prompt_answer.error_message();
  EXPECT_FALSE(prompt_done_first) << "the causal cross step waited for the whole prompt";
  EndStreams({long_stream.get(), cross.get()});
}

// A step whose reply would pass --max-message-mib is refused before it runs, as a call is, and
// changes nothing: over ModelInfer (FP16 in, FP32 out: the reply twice the request) the sequence
// is not started; in a Decode stream (positions make the reply longer than the request) the
// stream stays open and its next first message opens the session.
TEST_F(DecodeServiceTest, AStepWhoseReplyIsOverTheMessageLimitIsRefusedAndChangesNothing) {
  ServerOptions options;
  options.max_message_mib = 1;
  options.max_session_tokens = 4096;
  Restart(options);
  constexpr int64_t kTokens = 1500;  // 750 KB of FP16 in, 1.5 MB of FP32 out
  const std::vector<float> rows(kTokens * kWidth, 0.0f);
  inference::ModelInferRequest fp16 =
      SequenceStepRequest("demo", rows.data(), kTokens, kWidth, 31, true, false);
  fp16.mutable_inputs(0)->set_datatype("FP16");
  fp16.set_raw_input_contents(0, std::string(kTokens * kWidth * 2, '\0'));
  inference::ModelInferResponse response;
  const grpc::Status refused = Infer(fp16, &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(refused.error_message().find("--max-message-mib"), std::string::npos)
      << refused.error_message();
  EXPECT_EQ(Infer(SequenceStepRequest("demo", rows.data(), 1, kWidth, 31, false, false), &response)
                .error_code(),
            grpc::StatusCode::NOT_FOUND)
      << "the refused sequence_start started the sequence";

  // 1023 sequences of one token: 1,047,552 bytes of input, under 1 MiB; with a position each,
  // the reply is over it.
  constexpr int64_t kBatch = 1023;
  const std::vector<float> one_each(kBatch * kWidth, 0.5f);
  grpc::ClientContext context;
  std::unique_ptr<Stream> stream = Open(&context);
  v1::DecodeRequest wide;
  *wide.mutable_input() = MakeTensor({kBatch, 1, kWidth}, one_each, /*raw=*/true);
  wide.set_kind(v1::ATTENTION_KIND_CAUSAL);
  const v1::DecodeResponse too_large = Exchange(*stream, wide);
  EXPECT_EQ(too_large.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(too_large.error_message().find("--max-message-mib"), std::string::npos)
      << too_large.error_message();
  EXPECT_EQ(Gauge("attnserve_sessions"), 0);
  v1::DecodeRequest first = Tokens(0, 4);
  first.set_kind(v1::ATTENTION_KIND_CAUSAL);
  const v1::DecodeResponse opened = Exchange(*stream, first);
  EXPECT_EQ(opened.error_code(), 0) << opened.error_message();
  ASSERT_EQ(opened.positions_size(), 1);
  EXPECT_EQ(opened.positions(0), 4);
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

// A sequence step computes no attention matrix: asking for one (return_attention, or the
// `attention` output) is refused, not answered with an empty tensor, and starts nothing.
TEST_F(DecodeServiceTest, ASequenceStepAskingForAttentionIsRefused) {
  inference::ModelInferRequest asks =
      SequenceStepRequest("demo", sequence_.data(), 2, kWidth, 41, true, false);
  (*asks.mutable_parameters())["return_attention"].set_bool_param(true);
  inference::ModelInferResponse response;
  const grpc::Status refused = Infer(asks, &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("attention"), std::string::npos)
      << refused.error_message();
  asks.mutable_parameters()->erase("return_attention");
  asks.add_outputs()->set_name("attention");
  EXPECT_EQ(Infer(asks, &response).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(
      Infer(SequenceStepRequest("demo", sequence_.data(), 1, kWidth, 41, false, false), &response)
          .error_code(),
      grpc::StatusCode::NOT_FOUND);
}

// A drain whose grace ends while a prompt computes stops it at the chunk running: the step is
// answered UNAVAILABLE and the server does not wait for the rest of the prompt.
TEST_F(DecodeServiceTest, ADrainPastItsGraceStopsAPromptAtItsChunk) {
  grpc::ClientContext context;
  double tokens_before = 0;
  std::unique_ptr<Stream> stream = PromptComputing(&context, 12000, &tokens_before);
  server_->Drain(std::chrono::milliseconds(0), std::chrono::milliseconds(0));
  EXPECT_LT(Counter("attnserve_decode_tokens_total") - tokens_before, 12000)
      << "the drain waited for the whole prompt";
  v1::DecodeResponse response;
  if (stream->Read(&response)) {
    EXPECT_EQ(response.error_code(), grpc::StatusCode::UNAVAILABLE) << response.error_message();
    EXPECT_NE(response.error_message().find("--shutdown-grace"), std::string::npos)
        << response.error_message();
  }
  context.TryCancel();
  stream->Finish();
  double sessions = 1;
  for (int i = 0; i < 500 && sessions != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    sessions = Gauge("attnserve_sessions");
  }
  EXPECT_EQ(sessions, 0);
  EXPECT_EQ(Gauge("attnserve_kv_cache_bytes"), 0);
}

// --- The same sessions through the Open Inference Protocol (Triton's sequence parameters) ---

// A ModelInferRequest appending tokens [from, from + n) of `sequence` to sequence `id`; a range
// past the end of `sequence` fails the test (and sends what there is).
inference::ModelInferRequest SequenceRequest(const std::vector<float>& sequence, int64_t from,
                                             int64_t n, uint64_t id, bool start, bool end) {
  const int64_t tokens = static_cast<int64_t>(sequence.size()) / kWidth;
  if (from < 0 || n < 0 || from + n > tokens) {
    ADD_FAILURE() << "tokens [" << from << ", " << from + n << ") of a sequence of " << tokens;
    from = std::clamp<int64_t>(from, 0, tokens);
    n = std::clamp<int64_t>(n, 0, tokens - from);
  }
  return SequenceStepRequest("demo", sequence.data() + from * kWidth, n, kWidth, id, start, end);
}

TEST_F(DecodeServiceTest, ASequenceThroughModelInferEqualsTheDecodeStream) {
  inference::ModelInferResponse response;
  ASSERT_TRUE(Infer(SequenceRequest(sequence_, 0, 10, 7, true, false), &response).ok());
  std::vector<float> got = RawOutput(response);
  for (int64_t p = 10; p < 14; ++p) {
    const grpc::Status status =
        Infer(SequenceRequest(sequence_, p, 1, 7, false, p == 13), &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    const std::vector<float> row = RawOutput(response);
    got.insert(got.end(), row.begin(), row.end());
  }
  // The same 14 tokens through a Decode stream.
  grpc::ClientContext context;
  std::unique_ptr<Stream> stream = Open(&context);
  v1::DecodeRequest first = Tokens(0, 14);
  first.set_kind(v1::ATTENTION_KIND_CAUSAL);
  const std::vector<float> want = TensorValues(Exchange(*stream, first).output());
  ASSERT_TRUE(test::AllNear(got, want, 1e-4f));
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  // sequence_end ended it: the id is unknown now, and the error names it.
  const grpc::Status ended = Infer(SequenceRequest(sequence_, 14, 1, 7, false, false), &response);
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(ended.error_message().find("sequence 7"), std::string::npos) << ended.error_message();
  // Each step is a session's message, counted as the stream's are: 5 + 1 taken, 1 not found.
  EXPECT_EQ(SessionMessages("demo", "OK"), 6);
  EXPECT_EQ(SessionMessages("demo", "NOT_FOUND"), 1);
}

// A step whose output overflows float32 (finite tokens near 1e30 make the scores overflow) is
// refused as Forward refuses the same tokens, and changes nothing: neither the chunks of its
// prompt that ran before the overflow nor the cache. Through ModelInfer as well.
TEST_F(DecodeServiceTest, AStepWhoseOutputOverflowsFloat32IsRefusedAndChangesNothing) {
  ServerOptions options;
  options.max_session_tokens = 16384;
  Restart(options);
  const std::string overflow = "the output is not finite";
  grpc::ClientContext context;
  std::unique_ptr<Stream> stream = OpenWithFirstTokens(&context);
  // 3000 tokens (runs of 256 a sequence), the last one huge: refused after 11 chunks ran.
  std::vector<float> prompt = LongPrompt(3000);
  std::fill(prompt.end() - kWidth, prompt.end(), 1e30f);
  const double tokens_before = Counter("attnserve_decode_tokens_total");
  v1::DecodeResponse refused = Exchange(*stream, StepOf({prompt.data()}, {0}, {3000}, kWidth));
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << refused.error_message();
  EXPECT_NE(refused.error_message().find(overflow), std::string::npos) << refused.error_message();
  EXPECT_FALSE(refused.has_output());
  ASSERT_EQ(refused.positions_size(), 1);
  EXPECT_EQ(refused.positions(0), 4);
  EXPECT_GE(Counter("attnserve_decode_tokens_total") - tokens_before, 2816)
      << "the prompt's chunks before the last did not run";
  // One huge token alone: the same.
  v1::DecodeRequest huge;
  *huge.mutable_input() = MakeTensor({1, 1, kWidth}, std::vector<float>(kWidth, 1e20f), true);
  refused = Exchange(*stream, huge);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << refused.error_message();
  EXPECT_EQ(refused.positions(0), 4);

  // Forward over the sequence's first 4 tokens and the huge one is refused the same way.
  std::vector<float> five(sequence_.begin(), sequence_.begin() + 4 * kWidth);
  five.insert(five.end(), kWidth, 1e20f);
  v1::ForwardRequest whole;
  whole.set_kind(v1::ATTENTION_KIND_CAUSAL);
  *whole.mutable_input() = MakeTensor({1, 5, kWidth}, five, true);
  v1::ForwardResponse forward;
  grpc::ClientContext forward_context;
  const grpc::Status forward_status = stub_->Forward(&forward_context, whole, &forward);
  EXPECT_EQ(forward_status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(forward_status.error_message().find(overflow), std::string::npos);

  // The session holds the first 4 tokens and nothing else: its next step is the sequence's row.
  const v1::DecodeResponse next = Exchange(*stream, Tokens(4, 1));
  ASSERT_EQ(next.error_code(), 0) << next.error_message();
  EXPECT_EQ(next.positions(0), 5);
  const std::vector<float> got = TensorValues(next.output());
  const std::vector<float> want = RowOfTheSequence(4);
  ASSERT_TRUE(test::AllNear(got, want, 1e-4f));
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(SessionMessages("demo", "INVALID_ARGUMENT"), 2);

  // A sequence through ModelInfer: refused, then goes on from where it was.
  inference::ModelInferResponse response;
  ASSERT_TRUE(Infer(SequenceRequest(sequence_, 0, 4, 9, true, false), &response).ok());
  const grpc::Status infer_refused = Infer(
      SequenceStepRequest("demo", five.data() + 4 * kWidth, 1, kWidth, 9, false, false), &response);
  EXPECT_EQ(infer_refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(infer_refused.error_message().find(overflow), std::string::npos);
  const grpc::Status status = Infer(SequenceRequest(sequence_, 4, 1, 9, false, true), &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  const std::vector<float> row = RawOutput(response);
  ASSERT_TRUE(test::AllNear(row, want, 1e-4f));
  double bytes = 1;
  for (int i = 0; i < 500 && bytes != 0; ++i) {
    bytes = Gauge("attnserve_kv_cache_bytes");
    if (bytes != 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(bytes, 0);
}

// A later step of a sequence that names another kind or version than its sequence_start's is
// refused, as a Decode stream's later message is, and the sequence goes on unchanged.
TEST_F(DecodeServiceTest, ALaterSequenceStepNamingAnotherKindOrVersionIsRefused) {
  inference::ModelInferResponse response;
  ASSERT_TRUE(Infer(SequenceRequest(sequence_, 0, 4, 61, true, false), &response).ok());
  inference::ModelInferRequest other_kind = SequenceRequest(sequence_, 4, 1, 61, false, false);
  (*other_kind.mutable_parameters())["kind"].set_string_param("causal_cross");
  const grpc::Status kind = Infer(other_kind, &response);
  EXPECT_EQ(kind.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(kind.error_message().find("kind differs"), std::string::npos) << kind.error_message();
  inference::ModelInferRequest other_version = SequenceRequest(sequence_, 4, 1, 61, false, false);
  other_version.set_model_version("7");
  const grpc::Status version = Infer(other_version, &response);
  EXPECT_EQ(version.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(version.error_message().find("version 7"), std::string::npos)
      << version.error_message();
  // Repeating them is fine, and the sequence is where it was.
  inference::ModelInferRequest same = SequenceRequest(sequence_, 4, 1, 61, false, true);
  (*same.mutable_parameters())["kind"].set_string_param("causal");
  same.set_model_version("1");
  const grpc::Status repeated = Infer(same, &response);
  ASSERT_TRUE(repeated.ok()) << repeated.error_message();
  grpc::ClientContext context;
  std::unique_ptr<Stream> stream = Open(&context);
  v1::DecodeRequest whole = Tokens(0, 5);
  whole.set_kind(v1::ATTENTION_KIND_CAUSAL);
  const std::vector<float> want = TensorValues(Exchange(*stream, whole).output());
  const std::vector<float> got = RawOutput(response);
  ASSERT_EQ(got.size(), static_cast<size_t>(kWidth));
  ASSERT_TRUE(test::AllNear(got.data(), want.data() + 4 * kWidth, kWidth, 1e-4f));
  EndStreams({stream.get()});
}

// A sequence_start without a kind is causal_cross when it has a context tensor (else causal):
// its rows are the causal cross session's, and a later step that names causal is refused.
TEST_F(DecodeServiceTest, ASequenceStartWithAContextAndNoKindIsCausalCross) {
  const std::vector<float> context = LongPrompt(6);
  inference::ModelInferRequest start = SequenceRequest(sequence_, 0, 4, 62, true, false);
  AddRawInput(&start, "context", {1, 6, kWidth}, context.data());
  inference::ModelInferResponse response;
  const grpc::Status started = Infer(start, &response);
  ASSERT_TRUE(started.ok()) << started.error_message();
  const std::vector<float> got = RawOutput(response);
  grpc::ClientContext stream_context;
  std::unique_ptr<Stream> stream = Open(&stream_context);
  v1::DecodeRequest first = Tokens(0, 4);
  first.set_kind(v1::ATTENTION_KIND_CAUSAL_CROSS);
  *first.mutable_context() = MakeTensor({1, 6, kWidth}, context, /*raw=*/true);
  const std::vector<float> want = TensorValues(Exchange(*stream, first).output());
  ASSERT_TRUE(test::AllNear(got, want, 1e-4f));
  inference::ModelInferRequest causal = SequenceRequest(sequence_, 4, 1, 62, false, true);
  (*causal.mutable_parameters())["kind"].set_string_param("causal");
  const grpc::Status refused = Infer(causal, &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("kind differs"), std::string::npos)
      << refused.error_message();
  (*causal.mutable_parameters())["kind"].set_string_param("causal_cross");
  const grpc::Status ended = Infer(causal, &response);
  EXPECT_TRUE(ended.ok()) << ended.error_message();
  EndStreams({stream.get()});
}

// Requests of one sequence sent without waiting for each other's answers run one at a time, in
// the order they came (as Triton's sequence batcher takes them): a step that arrives while
// another of its sequence runs waits for it, and the sequence then holds both.
TEST_F(DecodeServiceTest, StepsOfASequenceSentAtOnceRunOneAtATime) {
  ServerOptions options;
  options.max_session_tokens = 8192;
  Restart(options);
  constexpr int64_t kLong = 2000;  // 8 runs of 256 tokens: the short step comes while they run
  const std::vector<float> prompt = LongPrompt(kLong + 6);
  // The last row of the sequence in either order the two steps could take, from Decode streams.
  std::vector<float> short_first;
  auto append = [&](int64_t from, int64_t to) {  // tokens [from, to) of the prompt
    for (int64_t i = from * kWidth; i < to * kWidth; ++i) short_first.push_back(prompt[i]);
  };
  append(0, 4);
  append(kLong + 4, kLong + 5);
  append(4, kLong + 4);
  append(kLong + 5, kLong + 6);
  std::vector<std::vector<float>> last_rows;
  for (const std::vector<float>& order : {std::cref(prompt), std::cref(short_first)}) {
    last_rows.push_back(RowOf(order, kLong + 5));
    ASSERT_EQ(last_rows.back().size(), static_cast<size_t>(kWidth));
  }
  for (uint64_t id = 1; id <= 3; ++id) {
    inference::ModelInferResponse response;
    ASSERT_TRUE(Infer(SequenceRequest(prompt, 0, 4, id, true, false), &response).ok());
    // Once the long step has begun to run, the short one is sent.
    SentStep long_step(*this, SequenceRequest(prompt, 4, kLong, id, false, false), Until::kRunning);
    inference::ModelInferResponse short_response;
    const grpc::Status short_status =
        Infer(SequenceRequest(prompt, kLong + 4, 1, id, false, false), &short_response);
    const grpc::Status long_status = long_step.Join();
    ASSERT_TRUE(long_status.ok()) << long_status.error_message();
    ASSERT_TRUE(short_status.ok()) << short_status.error_message();
    ASSERT_TRUE(Infer(SequenceRequest(prompt, kLong + 5, 1, id, false, true), &response).ok());
    const std::vector<float> last = RawOutput(response);
    ASSERT_EQ(last.size(), static_cast<size_t>(kWidth));
    bool matches_an_order = false;
    for (const std::vector<float>& want : last_rows) {
      bool same = true;
      for (int64_t k = 0; k < kWidth; ++k) same = same && std::abs(last[k] - want[k]) < 1e-4f;
      matches_an_order = matches_an_order || same;
    }
    EXPECT_TRUE(matches_an_order) << "sequence " << id << " holds neither order of its steps";
  }
  EXPECT_EQ(Gauge("attnserve_sessions"), 0);
  EXPECT_EQ(Gauge("attnserve_kv_cache_bytes"), 0);
}

// A step that waits for its turn behind another step of its sequence, and whose caller leaves
// (cancels; a deadline that passes ends a call the same way) before that turn comes, is taken
// back: the sequence does not hold it, nor the model its queue place.
TEST_F(DecodeServiceTest, AStepWhoseCallerLeavesWhileItWaitsIsTakenBack) {
  ServerOptions options;
  options.max_session_tokens = 16384;
  options.max_queue = 1;  // the one place the waiting step holds, given back with it
  Restart(options);
  constexpr int64_t kLong = 10000;  // far longer to compute than the waiting step's cancel takes
  const std::vector<float> prompt = LongPrompt(kLong + 5);
  // The row of the sequence's last token without the step taken back, from a Decode stream.
  const std::vector<float> want = RowOf(prompt, kLong + 4);
  ASSERT_EQ(want.size(), static_cast<size_t>(kWidth));
  inference::ModelInferResponse response;
  ASSERT_TRUE(Infer(SequenceRequest(prompt, 0, 4, 11, true, false), &response).ok());
  SentStep long_step(*this, SequenceRequest(prompt, 4, kLong, 11, false, false), Until::kRunning);
  // A token the sequence must not hold, whose caller leaves once the server has it waiting.
  SentStep left(*this, SequenceRequest(sequence_, 0, 1, 11, false, false), Until::kWaiting);
  left.Cancel();
  const grpc::Status waited = left.Join();
  // The model's queue place it held goes back with it, while the long step still runs: a call
  // is served beside that step.
  for (int i = 0; i < 5000 && Gauge("attnserve_sequence_requests_waiting") > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(Gauge("attnserve_sequence_requests_waiting"), 0) << "the cancelled step still waits";
  v1::ForwardResponse forward_response;
  grpc::ClientContext forward_context;
  const grpc::Status call = stub_->Forward(&forward_context, DemoRequest(1, 1), &forward_response);
  const bool long_still_computing = !long_step.answered();
  const grpc::Status long_status = long_step.Join();
  EXPECT_TRUE(call.ok()) << call.error_message();
  ASSERT_TRUE(long_still_computing) << "the long step ended first: nothing waited";
  EXPECT_EQ(waited.error_code(), grpc::StatusCode::CANCELLED) << waited.error_message();
  ASSERT_TRUE(long_status.ok()) << long_status.error_message();
  ASSERT_TRUE(Infer(SequenceRequest(prompt, kLong + 4, 1, 11, false, true), &response).ok());
  const std::vector<float> got = RawOutput(response);
  // One more token among 10,000 moves this row by about 1e-5; f32 rounding, by 1e-8.
  ASSERT_TRUE(test::AllNear(got, want, 1e-6f));
  EXPECT_EQ(Gauge("attnserve_sessions"), 0);
}

// A sequence's requests waiting for their turn hold places among the model's queued calls: past
// --max-queue a request is refused, a sequence's or a call, and the waiting ones still run.
TEST_F(DecodeServiceTest, StepsWaitingForTheirTurnHoldPlacesInTheModelsQueue) {
  ServerOptions options;
  options.max_session_tokens = 16384;
  options.max_queue = 1;
  Restart(options);
  constexpr int64_t kLong = 10000;  // far longer to compute than the requests below take
  const std::vector<float> prompt = LongPrompt(kLong + 6);
  inference::ModelInferResponse response;
  ASSERT_TRUE(Infer(SequenceRequest(prompt, 0, 4, 12, true, false), &response).ok());
  SentStep long_step(*this, SequenceRequest(prompt, 4, kLong, 12, false, false), Until::kRunning);
  SentStep waiting_step(*this, SequenceRequest(prompt, kLong + 4, 1, 12, false, false),
                        Until::kWaiting);
  const grpc::Status refused_step =
      Infer(SequenceRequest(prompt, kLong + 5, 1, 12, false, false), &response);
  v1::ForwardResponse forward_response;
  grpc::ClientContext forward_context;
  const grpc::Status refused_call =
      stub_->Forward(&forward_context, DemoRequest(1, 1), &forward_response);
  const bool long_still_computing = !long_step.answered();
  const grpc::Status long_status = long_step.Join();
  const grpc::Status waiting_status = waiting_step.Join();
  ASSERT_TRUE(long_still_computing) << "the long step ended first: nothing waited";
  for (const grpc::Status& refused : {refused_step, refused_call}) {
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << refused.error_message();
    EXPECT_NE(refused.error_message().find("--max-queue"), std::string::npos)
        << refused.error_message();
  }
  EXPECT_TRUE(long_status.ok()) << long_status.error_message();
  EXPECT_TRUE(waiting_status.ok()) << waiting_status.error_message();
  EXPECT_EQ(Gauge("attnserve_sequence_requests_waiting"), 0);
  // Its place is back once its turn came: the sequence goes on, and calls are served.
  ASSERT_TRUE(Infer(SequenceRequest(prompt, kLong + 5, 1, 12, false, true), &response).ok());
  grpc::ClientContext later_context;
  EXPECT_TRUE(stub_->Forward(&later_context, DemoRequest(1, 1), &forward_response).ok());
  EXPECT_EQ(Gauge("attnserve_sessions"), 0);
}

// A step sent behind the sequence's sequence_end step, before its answer, finds the sequence
// ended (NOT_FOUND), as any step after it does: it is not run on a session nobody can reach.
TEST_F(DecodeServiceTest, AStepSentBehindTheSequenceEndIsNotFound) {
  ServerOptions options;
  options.max_session_tokens = 16384;
  Restart(options);
  constexpr int64_t kLong = 10000;
  const std::vector<float> prompt = LongPrompt(kLong + 5);
  inference::ModelInferResponse response;
  ASSERT_TRUE(Infer(SequenceRequest(prompt, 0, 4, 12, true, false), &response).ok());
  const double tokens_before = Counter("attnserve_decode_tokens_total");
  grpc::Status last_status;
  std::atomic<bool> last_answered{false};
  std::thread last_step([&] {
    inference::ModelInferResponse last_response;
    last_status = Infer(SequenceRequest(prompt, 4, kLong, 12, false, true), &last_response);
    last_answered = true;
  });
  WaitForADecodeRun(tokens_before);
  // (Read before the step is sent: its answer comes with the last step's.)
  const bool last_still_computing = !last_answered.load();
  const grpc::Status behind =
      Infer(SequenceRequest(prompt, kLong + 4, 1, 12, false, false), &response);
  last_step.join();
  ASSERT_TRUE(last_still_computing) << "the last step ended first: nothing was behind it";
  EXPECT_TRUE(last_status.ok()) << last_status.error_message();
  EXPECT_EQ(behind.error_code(), grpc::StatusCode::NOT_FOUND) << behind.error_message();
  EXPECT_EQ(Gauge("attnserve_sessions"), 0);
}

// A sequence_start on an id in use gives the id a new session: the old session's last step,
// answered later, ends only the old one. And a sequence_start whose step is refused changes
// nothing: the session the id had goes on.
TEST_F(DecodeServiceTest, ASequenceStartTakesTheIdOverOnlyOnceItsStepIsTaken) {
  ServerOptions options;
  options.max_session_tokens = 4096;
  Restart(options);
  const std::vector<float> prompt = LongPrompt(4097);
  inference::ModelInferResponse response;
  ASSERT_TRUE(Infer(SequenceRequest(prompt, 0, 4, 5, true, false), &response).ok());
  const double tokens_before = Counter("attnserve_decode_tokens_total");
  grpc::Status last_status;
  std::thread last_step([&] {
    inference::ModelInferResponse last_response;
    last_status = Infer(SequenceRequest(prompt, 4, 2000, 5, false, true), &last_response);
  });
  WaitForADecodeRun(tokens_before);
  // While the old session's last step runs, the id starts over.
  ASSERT_TRUE(Infer(SequenceRequest(sequence_, 0, 4, 5, true, false), &response).ok());
  last_step.join();
  ASSERT_TRUE(last_status.ok()) << last_status.error_message();
  grpc::Status next = Infer(SequenceRequest(sequence_, 4, 1, 5, false, false), &response);
  ASSERT_TRUE(next.ok()) << next.error_message();

  // A refused sequence_start (past --max-session-tokens) leaves the id's session as it was.
  const grpc::Status refused = Infer(SequenceRequest(prompt, 0, 4097, 5, true, false), &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  next = Infer(SequenceRequest(sequence_, 5, 1, 5, false, true), &response);
  ASSERT_TRUE(next.ok()) << next.error_message();
  // Its output is the row of the new session's sixth token: it held 5 before.
  const std::vector<float> want = RowOfTheSequence(5);
  const std::vector<float> got = RawOutput(response);
  ASSERT_TRUE(test::AllNear(got, want, 1e-4f));
  EXPECT_EQ(Gauge("attnserve_sessions"), 0);
}

// A step sent to a sequence before a sequence_start on its id, still waiting for its turn behind
// a long step of the old session when that start is answered, is not run on the old session
// (where no request reaches): NOT_FOUND, as a step behind sequence_end is.
TEST_F(DecodeServiceTest, AStepWaitingOnASessionThatARestartReplacedIsNotFound) {
  ServerOptions options;
  options.max_session_tokens = 16384;
  Restart(options);
  constexpr int64_t kLong = 10000;  // far longer to compute than the restart takes
  const std::vector<float> prompt = LongPrompt(kLong + 5);
  inference::ModelInferResponse response;
  ASSERT_TRUE(Infer(SequenceRequest(prompt, 0, 4, 9, true, false), &response).ok());
  SentStep long_step(*this, SequenceRequest(prompt, 4, kLong, 9, false, false), Until::kRunning);
  SentStep waiting_step(*this, SequenceRequest(prompt, kLong + 4, 1, 9, false, false),
                        Until::kWaiting);
  ASSERT_TRUE(Infer(SequenceRequest(sequence_, 0, 4, 9, true, false), &response).ok());
  const bool long_still_computing = !long_step.answered();
  const grpc::Status long_status = long_step.Join();
  const grpc::Status waiting_status = waiting_step.Join();
  ASSERT_TRUE(long_still_computing) << "the long step ended first: nothing waited";
  EXPECT_TRUE(long_status.ok()) << long_status.error_message();
  EXPECT_EQ(waiting_status.error_code(), grpc::StatusCode::NOT_FOUND)
      << waiting_status.error_message();
  // The new session holds its 4 tokens and nothing else: its next row is the sequence's fifth.
  ASSERT_TRUE(Infer(SequenceRequest(sequence_, 4, 1, 9, false, true), &response).ok());
  const std::vector<float> want = RowOfTheSequence(4);
  const std::vector<float> got = RawOutput(response);
  ASSERT_TRUE(test::AllNear(got, want, 1e-4f));
  EXPECT_EQ(Gauge("attnserve_sessions"), 0);
}

// Restarting a sequence (sequence_start on its id) is not refused when --max-sessions are open:
// the restart ends the id's session. A new id still is.
TEST_F(DecodeServiceTest, ARestartIsNotRefusedWhenEverySessionIsOpen) {
  inference::ModelInferResponse response;
  ASSERT_TRUE(Infer(SequenceRequest(sequence_, 10, 6, 1, true, false), &response).ok());
  ASSERT_TRUE(Infer(SequenceRequest(sequence_, 0, 2, 2, true, false), &response).ok());
  EXPECT_EQ(Gauge("attnserve_sessions"), 2);  // the fixture's --max-sessions
  const grpc::Status restart = Infer(SequenceRequest(sequence_, 0, 4, 1, true, false), &response);
  ASSERT_TRUE(restart.ok()) << restart.error_message();
  EXPECT_EQ(Gauge("attnserve_sessions"), 2);
  const grpc::Status other = Infer(SequenceRequest(sequence_, 0, 4, 3, true, false), &response);
  EXPECT_EQ(other.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << other.error_message();
  // Sequence 1 goes on from its restart: its next row is the sequence's fifth.
  ASSERT_TRUE(Infer(SequenceRequest(sequence_, 4, 1, 1, false, true), &response).ok());
  const std::vector<float> got = RawOutput(response);
  ASSERT_TRUE(Infer(SequenceRequest(sequence_, 2, 1, 2, false, true), &response).ok());
  const std::vector<float> want = RowOfTheSequence(4);
  ASSERT_TRUE(test::AllNear(got, want, 1e-4f));
  EXPECT_EQ(Gauge("attnserve_sessions"), 0);
}

// Each Open Inference Protocol request of a sequence counts under its session's model, also when
// it names none (the only model); one that names sequence_id but does not parse is a session's
// message too, refused as such, not a call; sequence_start or sequence_end without a
// sequence_id is refused, not served as a one-shot call with its flags dropped.
TEST_F(DecodeServiceTest, SequenceRequestsAreCountedAsTheirSessionsMessages) {
  inference::ModelInferResponse response;
  inference::ModelInferRequest unnamed = SequenceRequest(sequence_, 0, 4, 21, true, false);
  unnamed.clear_model_name();
  ASSERT_TRUE(Infer(unnamed, &response).ok());
  unnamed = SequenceRequest(sequence_, 4, 1, 21, false, true);
  unnamed.clear_model_name();
  ASSERT_TRUE(Infer(unnamed, &response).ok());
  EXPECT_EQ(SessionMessages("demo", "OK"), 2);
  EXPECT_EQ(SessionMessages("", "OK"), 0);

  // A request cut short after its sequence parameters (its last field's bytes are missing).
  const std::string cut =
      SequenceRequest(sequence_, 0, 1, 22, true, false).SerializeAsString() + "\x1a\x7f" + "abc";
  std::string reply;
  const grpc::Status malformed = CallRaw(Connect(server_->port()).get(),
                                         "/inference.GRPCInferenceService/ModelInfer", cut, &reply);
  EXPECT_EQ(malformed.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << malformed.error_message();
  EXPECT_EQ(SessionMessages("demo", "INVALID_ARGUMENT"), 1);
  EXPECT_EQ(
      Sample("attnserve_requests_total",
             {{"code", "INVALID_ARGUMENT"}, {"kind", ""}, {"model", "demo"}, {"protocol", "grpc"}}),
      0);

  for (const char* flag : {"sequence_start", "sequence_end"}) {
    inference::ModelInferRequest alone = SequenceRequest(sequence_, 0, 2, 23, false, false);
    alone.mutable_parameters()->erase("sequence_id");
    (*alone.mutable_parameters())[flag].set_bool_param(true);
    const grpc::Status refused = Infer(alone, &response);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << flag;
    EXPECT_NE(refused.error_message().find("sequence_id"), std::string::npos)
        << refused.error_message();
    (*alone.mutable_parameters())[flag].set_bool_param(false);  // as Triton's clients send
    EXPECT_TRUE(Infer(alone, &response).ok()) << flag;
  }
  EXPECT_EQ(Gauge("attnserve_sessions"), 0);
}

// A later Decode message may repeat the session's version or leave it 0, not name another: it
// would be served by the session's version all the same.
TEST_F(DecodeServiceTest, ALaterMessageNamingAnotherVersionIsRefused) {
  grpc::ClientContext context;
  std::unique_ptr<Stream> stream = OpenWithFirstTokens(&context);
  v1::DecodeRequest other = Tokens(4, 1);
  other.set_version(7);
  const v1::DecodeResponse refused = Exchange(*stream, other);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("version 7"), std::string::npos)
      << refused.error_message();
  ASSERT_EQ(refused.positions_size(), 1);
  EXPECT_EQ(refused.positions(0), 4);
  EXPECT_EQ(Exchange(*stream, Tokens(4, 1)).error_code(), 0);
  EndStreams({stream.get()});
}

// A Decode stream cancelled while its prompt computes ends once the chunk running ends, the rest
// of the prompt not computed, and the step is counted as every message is.
TEST_F(DecodeServiceTest, AStepWhoseStreamIsCancelledIsCounted) {
  grpc::ClientContext context;
  double tokens_before = 0;
  std::unique_ptr<Stream> stream = PromptComputing(&context, 12000, &tokens_before);
  context.TryCancel();
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // The server counts the message when the step's run ends, then ends the session.
  double counted = 0, sessions = 1;
  for (int i = 0; i < 3000 && (counted == 0 || sessions != 0); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    counted = SessionMessages("demo", "OK") + SessionMessages("demo", "CANCELLED");
    sessions = Gauge("attnserve_sessions");
  }
  EXPECT_EQ(counted, 1);
  EXPECT_EQ(sessions, 0);
  // The prompt stopped at the chunk that was running: the rest of it was not computed.
  EXPECT_LT(Counter("attnserve_decode_tokens_total") - tokens_before, 12000)
      << "the prompt ran to its end after its stream was cancelled";
  EXPECT_EQ(Gauge("attnserve_kv_cache_bytes"), 0);
}

// A drain with sessions open: a Decode stream, and a ModelStreamInfer stream, waiting for their
// clients' next message end UNAVAILABLE as the drain begins, not when it ends (the clients go on
// elsewhere at once), and the session's cache goes.
TEST_F(DecodeServiceTest, ADrainEndsStreamsWaitingForAMessageAtOnce) {
  grpc::ClientContext context;
  std::unique_ptr<Stream> stream = Open(&context);
  v1::DecodeRequest first = Tokens(0, 4);
  first.set_kind(v1::ATTENTION_KIND_CAUSAL);
  ASSERT_EQ(Exchange(*stream, first).error_code(), 0);
  auto infer = inference::GRPCInferenceService::NewStub(Connect(server_->port()));
  grpc::ClientContext infer_context;
  infer_context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  auto infer_stream = infer->ModelStreamInfer(&infer_context);
  inference::ModelStreamInferResponse infer_response;
  // One whole sequence (start and end): the stream then holds none.
  ASSERT_TRUE(infer_stream->Write(SequenceRequest(sequence_, 0, 3, 5, true, true)));
  ASSERT_TRUE(infer_stream->Read(&infer_response));
  ASSERT_EQ(infer_response.error_message(), "");

  // A drain whose lame duck (after the drain proper) lasts 3 s: the streams end before it does.
  std::atomic<bool> drained{false};
  std::thread drain([&] {
    server_->Drain(std::chrono::seconds(5), std::chrono::seconds(3));
    drained.store(true);
  });
  v1::DecodeResponse response;
  EXPECT_FALSE(stream->Read(&response));
  const grpc::Status ended = stream->Finish();
  EXPECT_FALSE(infer_stream->Read(&infer_response));
  const grpc::Status infer_ended = infer_stream->Finish();
  EXPECT_FALSE(drained.load()) << "the streams ended only with the drain";
  drain.join();
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::UNAVAILABLE) << ended.error_message();
  EXPECT_NE(ended.error_message().find("shutting down"), std::string::npos)
      << ended.error_message();
  EXPECT_EQ(infer_ended.error_code(), grpc::StatusCode::UNAVAILABLE) << infer_ended.error_message();
  EXPECT_EQ(Gauge("attnserve_sessions"), 0);
  EXPECT_EQ(Gauge("attnserve_kv_cache_bytes"), 0);
}

TEST_F(DecodeServiceTest, ModelStreamInferCarriesSequencesAndAnswersErrorsInTheStream) {
  auto infer = inference::GRPCInferenceService::NewStub(Connect(server_->port()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto stream = infer->ModelStreamInfer(&context);
  inference::ModelStreamInferResponse response;
  // No sequence_id: refused in the stream, which stays open; each answer, refused or not,
  // carries its request's id.
  inference::ModelInferRequest plain = SequenceRequest(sequence_, 0, 2, 1, true, false);
  plain.mutable_parameters()->erase("sequence_id");
  plain.set_id("no-sequence");
  ASSERT_TRUE(stream->Write(plain));
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_NE(response.error_message().find("sequence_id"), std::string::npos);
  EXPECT_EQ(response.infer_response().id(), "no-sequence");
  // Unknown sequence without sequence_start: NOT_FOUND in the stream.
  inference::ModelInferRequest unknown = SequenceRequest(sequence_, 0, 2, 99, false, false);
  unknown.set_id("unknown");
  ASSERT_TRUE(stream->Write(unknown));
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_NE(response.error_message().find("NOT_FOUND"), std::string::npos)
      << response.error_message();
  EXPECT_EQ(response.infer_response().id(), "unknown");
  inference::ModelInferRequest start = SequenceRequest(sequence_, 0, 3, 5, true, false);
  start.set_id("start");
  ASSERT_TRUE(stream->Write(start));
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.error_message(), "");
  EXPECT_EQ(response.infer_response().id(), "start");
  EXPECT_EQ(RawOutput(response.infer_response()).size(), static_cast<size_t>(3 * kWidth));
  ASSERT_TRUE(stream->Write(SequenceRequest(sequence_, 3, 1, 5, false, true)));
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.error_message(), "");
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(Gauge("attnserve_sessions"), 0);
}

// Bytes that are not a message of the stream's method, first and between steps: each is answered
// in the stream with INVALID_ARGUMENT saying so, the session goes on unchanged, and the stream
// ends OK when the client closes it (gRPC's typed streams report a message that does not parse
// as the client's end, which ended the stream OK and dropped the messages after it).
TEST_F(DecodeServiceTest, AMessageThatDoesNotParseIsAnsweredInTheStreamAndChangesNothing) {
  // The last: a ModelInferRequest's id (field 3), then a tag that never ends.
  const std::vector<std::string> garbage = {"\xff\xff\xff\xff not a protobuf at all",
                                            "\x0a\x7f"
                                            "abc",
                                            "\x1a\x03"
                                            "abc\xff\xff\xff\xff"};
  std::shared_ptr<grpc::Channel> channel = Connect(server_->port());
  {
    RawStream stream(channel.get(), "/attnserve.v1.AttentionService/Decode");
    std::string reply;
    v1::DecodeResponse response;
    ASSERT_TRUE(stream.Exchange(garbage[0], &reply));
    ASSERT_TRUE(response.ParseFromString(reply));
    EXPECT_EQ(response.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(response.error_message().find("not a valid attnserve.v1.DecodeRequest"),
              std::string::npos)
        << response.error_message();
    EXPECT_EQ(response.positions_size(), 0);
    v1::DecodeRequest first = Tokens(0, 4);
    first.set_kind(v1::ATTENTION_KIND_CAUSAL);
    ASSERT_TRUE(stream.Exchange(first.SerializeAsString(), &reply));
    ASSERT_TRUE(response.ParseFromString(reply));
    ASSERT_EQ(response.error_code(), 0) << response.error_message();
    for (const std::string& bytes : garbage) {
      ASSERT_TRUE(stream.Exchange(bytes, &reply));
      ASSERT_TRUE(response.ParseFromString(reply));
      EXPECT_EQ(response.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
      ASSERT_EQ(response.positions_size(), 1);
      EXPECT_EQ(response.positions(0), 4);
    }
    ASSERT_TRUE(stream.Exchange(Tokens(4, 1).SerializeAsString(), &reply));
    ASSERT_TRUE(response.ParseFromString(reply));
    EXPECT_EQ(response.error_code(), 0) << response.error_message();
    EXPECT_EQ(response.positions(0), 5);
    EXPECT_TRUE(stream.Finish().ok());
  }
  {
    RawStream stream(channel.get(), "/inference.GRPCInferenceService/ModelStreamInfer");
    std::string reply;
    inference::ModelStreamInferResponse response;
    ASSERT_TRUE(stream.Exchange(
        SequenceRequest(sequence_, 0, 3, 5, true, false).SerializeAsString(), &reply));
    ASSERT_TRUE(response.ParseFromString(reply));
    EXPECT_EQ(response.error_message(), "");
    for (const std::string& bytes : garbage) {
      ASSERT_TRUE(stream.Exchange(bytes, &reply));
      ASSERT_TRUE(response.ParseFromString(reply));
      EXPECT_NE(
          response.error_message().find(
              "INVALID_ARGUMENT: the request body is not a valid inference.ModelInferRequest"),
          std::string::npos)
          << response.error_message();
      EXPECT_EQ(response.infer_response().id(), "") << "an id from a message that did not parse";
    }
    ASSERT_TRUE(stream.Exchange(
        SequenceRequest(sequence_, 3, 1, 5, false, true).SerializeAsString(), &reply));
    ASSERT_TRUE(response.ParseFromString(reply));
    EXPECT_EQ(response.error_message(), "");
    EXPECT_EQ(RawOutput(response.infer_response()).size(), static_cast<size_t>(kWidth));
    EXPECT_TRUE(stream.Finish().ok());
  }
  EXPECT_EQ(Gauge("attnserve_sessions"), 0);
  // Every message is counted, by the model of its session (a message before any session, that
  // names no model: ""): 2 + 2 taken, 3 malformed in demo's Decode session, 1 before it and 3
  // on ModelStreamInfer (whose model is in the message).
  EXPECT_EQ(SessionMessages("demo", "OK"), 4);
  EXPECT_EQ(SessionMessages("demo", "INVALID_ARGUMENT"), 3);
  EXPECT_EQ(SessionMessages("", "INVALID_ARGUMENT"), 4);
}

// A causal cross first message whose context is refused, for a negative length or for more than
// the cache budget holds, opens nothing: it is answered, counts no session, charges no cache, and
// the budget still holds after it.
TEST_F(DecodeServiceTest, ARefusedContextOpensNothingAndLeavesTheBudgetWhole) {
  ServerOptions options;
  options.kv_cache_mib = 1;  // 512 demo tokens of keys and values
  Restart(options);
  auto cross_first = [&](int64_t context_tokens, int32_t length) {
    v1::DecodeRequest first = Tokens(0, 1);
    first.set_kind(v1::ATTENTION_KIND_CAUSAL_CROSS);
    const std::vector<float> context = LongPrompt(context_tokens);
    *first.mutable_context() = MakeTensor({1, context_tokens, kWidth}, context, /*raw=*/true);
    first.add_context_lengths(length);
    return first;
  };
  for (int32_t negative : {-3, -17, std::numeric_limits<int32_t>::min()}) {
    grpc::ClientContext context;
    std::unique_ptr<Stream> stream = Open(&context);
    const v1::DecodeResponse refused = Exchange(*stream, cross_first(3, negative));
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << negative;
    // The stream is still open: a session starts on it.
    v1::DecodeRequest first = Tokens(0, 4);
    first.set_kind(v1::ATTENTION_KIND_CAUSAL);
    EXPECT_EQ(Exchange(*stream, first).error_code(), 0);
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
  }
  // A context past the budget ends its stream, and the session it would have been is not
  // counted (open or closed).
  grpc::ClientContext too_long_context;
  std::unique_ptr<Stream> too_long = Open(&too_long_context);
  ASSERT_TRUE(too_long->Write(cross_first(1024, 1024)));
  v1::DecodeResponse response;
  EXPECT_FALSE(too_long->Read(&response));
  EXPECT_EQ(too_long->Finish().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(Gauge("attnserve_sessions"), 0);
  EXPECT_EQ(Gauge("attnserve_kv_cache_bytes"), 0);
  // The budget still refuses what it cannot hold: 600 tokens do not fit in 512.
  grpc::ClientContext over_context;
  std::unique_ptr<Stream> over = Open(&over_context);
  v1::DecodeRequest long_first = StepOf({LongPrompt(600).data()}, {0}, {600}, kWidth);
  long_first.set_kind(v1::ATTENTION_KIND_CAUSAL);
  EXPECT_EQ(Exchange(*over, long_first).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  // Two sequences of 300 tokens: the refusal speaks of the whole step (2 x 19 blocks of
  // 16 x 256 keys and values, f32) and of what sessions held before it (nothing).
  grpc::ClientContext two_context;
  std::unique_ptr<Stream> two_stream = Open(&two_context);
  const std::vector<float> rows = LongPrompt(300);
  v1::DecodeRequest two = StepOf({rows.data(), rows.data()}, {0, 0}, {300, 300}, kWidth);
  two.set_kind(v1::ATTENTION_KIND_CAUSAL);
  const v1::DecodeResponse refused = Exchange(*two_stream, two);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  // Held: only the two sequences' bookkeeping (about a hundred bytes each), none of the step's
  // blocks.
  const std::string& message = refused.error_message();
  const size_t held_at = message.find("full: ") + 6;
  ASSERT_NE(message.find(" of 1048576 bytes are in use"), std::string::npos) << message;
  EXPECT_LT(std::stoll(message.substr(held_at)), 1024) << message;
  EXPECT_NE(refused.error_message().find("needs 1245184 more"), std::string::npos)
      << refused.error_message();
  for (Stream* stream : {over.get(), two_stream.get()}) {
    stream->WritesDone();
    stream->Finish();
  }
}

// A session of many empty sequences (one token in all, 65 KiB on the wire) is charged for each
// sequence's bookkeeping: past the budget it is refused, saying so, and the bytes come back when
// it ends.
TEST_F(DecodeServiceTest, ManyEmptySequencesAreChargedToTheBudget) {
  ServerOptions options;
  options.kv_cache_mib = 1;
  Restart(options);
  auto empty_first = [](int sequences) {  // packed: one token, then empty sequences
    v1::DecodeRequest first;
    first.set_kind(v1::ATTENTION_KIND_CAUSAL);
    *first.mutable_input() =
        MakeTensor({1, kWidth}, std::vector<float>(kWidth, 0.5f), /*raw=*/true);  // packed
    first.add_lengths(1);
    for (int b = 1; b < sequences; ++b) first.add_lengths(0);
    return first;
  };
  grpc::ClientContext huge_context;
  std::unique_ptr<Stream> huge = Open(&huge_context);
  ASSERT_TRUE(huge->Write(empty_first(65536)));
  v1::DecodeResponse response;
  EXPECT_FALSE(huge->Read(&response));
  const grpc::Status refused = huge->Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(refused.error_message().find("the bookkeeping of this session's 65536 sequences"),
            std::string::npos)
      << refused.error_message();
  EXPECT_EQ(Gauge("attnserve_sessions"), 0);
  EXPECT_EQ(Gauge("attnserve_kv_cache_bytes"), 0);

  grpc::ClientContext context;
  std::unique_ptr<Stream> stream = Open(&context);
  const v1::DecodeResponse opened = Exchange(*stream, empty_first(1000));
  ASSERT_EQ(opened.error_code(), 0) << opened.error_message();
  EXPECT_EQ(opened.positions_size(), 1000);
  const double held = Gauge("attnserve_kv_cache_bytes");
  EXPECT_GE(held, 1000 * 64);
  EXPECT_LE(held, 1000 * 512);
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(Gauge("attnserve_kv_cache_bytes"), 0);
}

// However long the fields before them (a request id of 5000 bytes), a request's sequence
// parameters are read: it continues its sequence, not runs as a call of its own.
TEST_F(DecodeServiceTest, ALongRequestIdDoesNotHideTheSequenceParameters) {
  auto infer = inference::GRPCInferenceService::NewStub(Connect(server_->port()));
  auto call = [&](inference::ModelInferRequest request, inference::ModelInferResponse* response) {
    request.set_id(std::string(5000, 'x'));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return infer->ModelInfer(&context, request, response);
  };
  inference::ModelInferResponse response;
  ASSERT_TRUE(call(SequenceRequest(sequence_, 0, 10, 8, true, false), &response).ok());
  EXPECT_EQ(Gauge("attnserve_sessions"), 1);
  const grpc::Status next = call(SequenceRequest(sequence_, 10, 1, 8, false, true), &response);
  ASSERT_TRUE(next.ok()) << next.error_message();
  // The step's row is the 11th of the sequence, not the first of a call of its own.
  const std::vector<float> want = RowOfTheSequence(10);
  const std::vector<float> got = RawOutput(response);
  ASSERT_TRUE(test::AllNear(got, want, 1e-4f));
}

// Each model has its own sequence ids: sequence 7 of one model is not sequence 7 of another.
TEST_F(DecodeServiceTest, EachModelHasItsOwnSequenceIds) {
  ServerOptions options;
  options.models.resize(2);
  options.models[0].name = "demo";
  options.models[1].name = "demo2";
  Restart(options);
  auto infer = inference::GRPCInferenceService::NewStub(Connect(server_->port()));
  auto call = [&](inference::ModelInferRequest request, const std::string& model) {
    request.set_model_name(model);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    inference::ModelInferResponse response;
    return infer->ModelInfer(&context, request, &response);
  };
  ASSERT_TRUE(call(SequenceRequest(sequence_, 0, 4, 7, true, false), "demo").ok());
  ASSERT_TRUE(call(SequenceRequest(sequence_, 0, 2, 7, true, false), "demo2").ok());
  EXPECT_EQ(Gauge("attnserve_sessions"), 1);  // demo's, still open beside demo2's
  EXPECT_TRUE(call(SequenceRequest(sequence_, 4, 1, 7, false, true), "demo").ok());
  EXPECT_TRUE(call(SequenceRequest(sequence_, 2, 1, 7, false, true), "demo2").ok());
  EXPECT_EQ(call(SequenceRequest(sequence_, 5, 1, 7, false, false), "demo").error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(call(SequenceRequest(sequence_, 0, 1, 9, false, false), "no-such-model").error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST_F(DecodeServiceTest, ASequenceIdleLongerThanTheTimeoutEnds) {
  ServerOptions options;
  options.session_idle_timeout_s = 1;
  Restart(options);
  auto infer = inference::GRPCInferenceService::NewStub(Connect(server_->port()));
  inference::ModelInferResponse response;
  grpc::ClientContext start_context;
  ASSERT_TRUE(
      infer->ModelInfer(&start_context, SequenceRequest(sequence_, 0, 4, 3, true, false), &response)
          .ok());
  const auto started = std::chrono::steady_clock::now();
  EXPECT_EQ(Gauge("attnserve_sessions"), 1);
  // The reaper looks every 250 ms; a loaded machine may wake it late.
  WaitFor([&] { return Gauge("attnserve_sessions") == 0; }, std::chrono::milliseconds(5000));
  EXPECT_EQ(Gauge("attnserve_sessions"), 0);
  EXPECT_GE(std::chrono::steady_clock::now() - started, std::chrono::milliseconds(900))
      << "ended before its idle timeout";
  grpc::ClientContext late_context;
  EXPECT_EQ(
      infer->ModelInfer(&late_context, SequenceRequest(sequence_, 4, 1, 3, false, false), &response)
          .error_code(),
      grpc::StatusCode::NOT_FOUND);
}

// Sessions opened, stepped, truncated, cancelled and abandoned at random by 16 callers for a
// bounded time: every cache comes back (the gauges return to 0) and memory stays flat.
TEST_F(DecodeServiceTest, ASoakOfSessionsEndingEveryWayLeavesNothingBehind) {
  ServerOptions options;
  options.max_sessions = 64;
  Restart(options);
  auto round = [this](std::chrono::seconds length) {
    const auto end = std::chrono::steady_clock::now() + length;
    std::vector<std::thread> callers;
    for (int caller = 0; caller < 16; ++caller) {
      callers.emplace_back([this, end, caller] {
        std::mt19937 random(caller);
        while (std::chrono::steady_clock::now() < end) {
          auto context = std::make_unique<grpc::ClientContext>();
          std::unique_ptr<Stream> stream = Open(context.get());
          v1::DecodeRequest first = Tokens(0, 1 + random() % 40);
          first.set_kind(v1::ATTENTION_KIND_CAUSAL);
          v1::DecodeResponse response;
          if (!stream->Write(first) || !stream->Read(&response)) break;
          int64_t position = response.positions(0);
          for (int step = random() % 20; step > 0 && position < 60; --step) {
            v1::DecodeRequest next = Tokens(position, 1 + random() % 3);
            if (random() % 4 == 0) next.set_truncate_to(random() % (position + 1));
            if (!stream->Write(next) || !stream->Read(&response)) break;
            position = response.positions(0);
          }
          switch (random() % 3) {
            case 0:  // the client ends it
              stream->WritesDone();
              stream->Finish();
              break;
            case 1:  // cancelled, possibly with a step in flight
              stream->Write(Tokens(0, 2));
              context->TryCancel();
              stream->Finish();
              break;
            default:  // abandoned: the stub and context go, the stream with them
              context->TryCancel();
              stream->Finish();
          }
        }
      });
    }
    for (auto& t : callers) t.join();
  };
  round(std::chrono::seconds(3));  // warm: allocator arenas, gRPC's pools
  const int64_t before = ResidentBytes();
  round(std::chrono::seconds(10));
  for (int i = 0; i < 200 && Gauge("attnserve_sessions") > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(Gauge("attnserve_sessions"), 0);
  EXPECT_EQ(Gauge("attnserve_kv_cache_bytes"), 0);
  if (kSanitized) {
    // ASan's quarantine and TSan's allocator keep freed memory resident: no measure of leaks
    // here (LeakSanitizer's run is the leak check there).
    (void)before;
  } else {
    EXPECT_LT(ResidentBytes() - before, int64_t{32} << 20) << "resident memory grew";
  }
}

}  // namespace
}  // namespace attnserve::server::testing
