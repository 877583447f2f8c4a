// DecodeSession against a real attnserve on loopback: steps equal Forward over the whole prefix,
// refused steps leave the session usable, a stream that cannot open or that breaks ends it.
#include "client/decode_session.h"

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <vector>

#include "client/client.h"
#include "client/packing.h"
#include "gtest/gtest.h"
#include "tests/client/process.h"
#include "tests/client/shared_server.h"
#include "tests/common/all_near.h"

namespace attnserve::test {
namespace {

using client::AttentionClient;
using client::DecodeOptions;
using client::DecodeSession;
using client::DecodeStepResult;
using client::FloatArray;

constexpr int64_t kWidth = 256;  // the demo model's d_model

FloatArray Random(std::vector<int64_t> shape, uint32_t seed) {
  FloatArray a{.shape = std::move(shape), .values = {}};
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1, 1);
  a.values.resize(static_cast<size_t>(a.ElementCount()));
  for (float& v : a.values) v = u(rng);
  return a;
}

// Rows [from, to) of sequence b of a padded [B, S, d] array, as [1, to - from, d].
FloatArray Rows(const FloatArray& a, int64_t b, int64_t from, int64_t to) {
  const int64_t s = a.shape[1], d = a.shape[2];
  FloatArray out{.shape = {1, to - from, d}, .values = {}};
  out.values.assign(a.values.begin() + (b * s + from) * d, a.values.begin() + (b * s + to) * d);
  return out;
}

// The causal output of a whole sequence by one Forward: what every step must equal.
FloatArray ForwardWhole(const AttentionClient& c, const FloatArray& sequence) {
  client::ForwardRequestSpec spec;
  spec.kind = v1::ATTENTION_KIND_CAUSAL;
  spec.input = sequence;
  absl::StatusOr<client::ForwardResult> r = c.Forward(spec);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? r->output : FloatArray{};
}

void ExpectNear(const FloatArray& got, const FloatArray& want, const std::string& what) {
  ASSERT_EQ(got.shape, want.shape) << what;
  EXPECT_TRUE(AllNear(got.values, want.values, 1e-4, what));
}

// Options with one field changed (designated initializers would warn about the others).
DecodeOptions WithBatch(int batch) {
  DecodeOptions o;
  o.batch = batch;
  return o;
}
DecodeOptions WithModel(const std::string& model) {
  DecodeOptions o;
  o.model = model;
  return o;
}
DecodeOptions WithKind(v1::AttentionKind kind) {
  DecodeOptions o;
  o.kind = kind;
  return o;
}

class DecodeSessionTest : public SharedServerTest {
 protected:
  static void SetUpTestSuite() { StartServer({"--threads", "2", "--log-level", "warn"}); }
  void SetUp() override {
    SharedServerTest::SetUp();
    client_ = AttentionClient::Connect(server_->target());
  }
  std::unique_ptr<AttentionClient> client_;
};

TEST_F(DecodeSessionTest, PromptThenStepsEqualForwardOverThePrefix) {
  // Two sequences: a prompt of 5 and 3 tokens (padded), then packed steps of 2 and 1, 1 and 0.
  const FloatArray whole = Random({2, 8, kWidth}, 7);
  auto session = DecodeSession::Open(*client_, WithBatch(2));
  ASSERT_TRUE(session.ok()) << session.status();
  FloatArray prompt = Random({2, 5, kWidth}, 0);
  for (int64_t b = 0; b < 2; ++b) {
    FloatArray rows = Rows(whole, b, 0, 5);
    std::copy(rows.values.begin(), rows.values.end(), prompt.values.begin() + b * 5 * kWidth);
  }
  absl::StatusOr<DecodeStepResult> first = (*session)->Step(prompt, {5, 3});
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->positions, (std::vector<int64_t>{5, 3}));
  ASSERT_EQ(first->output.shape, (std::vector<int64_t>{2, 5, kWidth}));

  // Step 2 (packed): sequence 0 appends rows 5..6, sequence 1 its row 3.
  FloatArray packed{.shape = {3, kWidth}, .values = {}};
  for (const FloatArray& r : {Rows(whole, 0, 5, 7), Rows(whole, 1, 3, 4)}) {
    packed.values.insert(packed.values.end(), r.values.begin(), r.values.end());
  }
  absl::StatusOr<DecodeStepResult> second = (*session)->Step(packed, {2, 1});
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->positions, (std::vector<int64_t>{7, 4}));
  ASSERT_EQ(second->output.shape, (std::vector<int64_t>{3, kWidth}));

  // Each sequence's outputs are the rows of one Forward over it.
  const FloatArray want0 = ForwardWhole(*client_, Rows(whole, 0, 0, 7));
  const FloatArray want1 = ForwardWhole(*client_, Rows(whole, 1, 0, 4));
  ExpectNear(Rows(first->output, 0, 0, 5), Rows(want0, 0, 0, 5), "prompt 0");
  ExpectNear(Rows(first->output, 1, 0, 3), Rows(want1, 0, 0, 3), "prompt 1");
  FloatArray step0{.shape = {1, 2, kWidth}, .values = {}};
  step0.values.assign(second->output.values.begin(), second->output.values.begin() + 2 * kWidth);
  ExpectNear(step0, Rows(want0, 0, 5, 7), "step 0");
  FloatArray step1{.shape = {1, 1, kWidth}, .values = {}};
  step1.values.assign(second->output.values.begin() + 2 * kWidth, second->output.values.end());
  ExpectNear(step1, Rows(want1, 0, 3, 4), "step 1");
  EXPECT_TRUE((*session)->Close().ok());
  EXPECT_TRUE((*session)->ended());
}

TEST_F(DecodeSessionTest, TruncateRollsBackAndTheNextStepRecomputesTheSamePosition) {
  auto session = DecodeSession::Open(*client_, DecodeOptions{});
  ASSERT_TRUE(session.ok()) << session.status();
  const FloatArray prompt = Random({1, 4, kWidth}, 1), a = Random({1, 1, kWidth}, 2);
  ASSERT_TRUE((*session)->Step(prompt).ok());
  absl::StatusOr<DecodeStepResult> once = (*session)->Step(a);
  ASSERT_TRUE(once.ok()) << once.status();
  ASSERT_TRUE((*session)->Step(Random({1, 1, kWidth}, 3)).ok());
  absl::StatusOr<DecodeStepResult> again = (*session)->Step(a, {}, /*truncate_to=*/4);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->positions, (std::vector<int64_t>{5}));
  ExpectNear(again->output, once->output, "after truncate");
}

TEST_F(DecodeSessionTest, RefusedStepsLeaveTheSessionUnchanged) {
  auto session = DecodeSession::Open(*client_, DecodeOptions{});
  ASSERT_TRUE(session.ok()) << session.status();
  // A first message with the wrong width is refused in the stream; the session still opens.
  absl::StatusOr<DecodeStepResult> wide = (*session)->Step(Random({1, 2, kWidth + 1}, 0));
  EXPECT_EQ(wide.status().code(), absl::StatusCode::kInvalidArgument) << wide.status();
  ASSERT_TRUE((*session)->Step(Random({1, 3, kWidth}, 0)).ok());
  absl::StatusOr<DecodeStepResult> past = (*session)->Step(Random({1, 1, kWidth}, 0), {}, 9);
  EXPECT_EQ(past.status().code(), absl::StatusCode::kInvalidArgument) << past.status();
  absl::StatusOr<DecodeStepResult> next = (*session)->Step(Random({1, 1, kWidth}, 0));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->positions, (std::vector<int64_t>{4}));
  // B is checked before anything is sent.
  EXPECT_EQ((*session)->Step(Random({2, 1, kWidth}, 0)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE((*session)->ended());
}

TEST_F(DecodeSessionTest, AnUnknownModelEndsTheStreamWithNotFound) {
  auto session = DecodeSession::Open(*client_, WithModel("nope"));
  ASSERT_TRUE(session.ok()) << session.status();
  absl::StatusOr<DecodeStepResult> step = (*session)->Step(Random({1, 1, kWidth}, 0));
  EXPECT_EQ(step.status().code(), absl::StatusCode::kNotFound) << step.status();
  EXPECT_TRUE((*session)->ended());
  EXPECT_EQ((*session)->Step(Random({1, 1, kWidth}, 0)).status().code(),
            absl::StatusCode::kNotFound);
  // A kind that is not causal is refused before a stream is made.
  EXPECT_EQ(
      DecodeSession::Open(*client_, WithKind(v1::ATTENTION_KIND_BIDIRECTIONAL)).status().code(),
      absl::StatusCode::kInvalidArgument);
}

TEST_F(DecodeSessionTest, CrossSessionKeepsItsContext) {
  const FloatArray context = Random({1, 6, kWidth}, 4);
  DecodeOptions cross = WithKind(v1::ATTENTION_KIND_CAUSAL_CROSS);
  cross.context = context;
  auto session = DecodeSession::Open(*client_, cross);
  ASSERT_TRUE(session.ok()) << session.status();
  const FloatArray whole = Random({1, 3, kWidth}, 5);
  absl::StatusOr<DecodeStepResult> a = (*session)->Step(Rows(whole, 0, 0, 2));
  absl::StatusOr<DecodeStepResult> b = (*session)->Step(Rows(whole, 0, 2, 3));
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  client::ForwardRequestSpec spec;
  spec.kind = v1::ATTENTION_KIND_CAUSAL_CROSS;
  spec.input = whole;
  spec.context = context;
  absl::StatusOr<client::ForwardResult> want = client_->Forward(spec);
  ASSERT_TRUE(want.ok()) << want.status();
  ExpectNear(b->output, Rows(want->output, 0, 2, 3), "cross step");
}

// SendAsync's answers, in order, as a caller on gRPC's threads sees them.
struct AsyncAnswers {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<absl::Status> statuses;

  std::function<void(absl::Status)> Record() {
    return [this](absl::Status s) {
      std::lock_guard lock(mu);
      statuses.push_back(std::move(s));
      cv.notify_all();
    };
  }
  // Waits for `n` answers in all (up to 30 s).
  bool WaitFor(size_t n) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(30), [&] { return statuses.size() >= n; });
  }
};

TEST_F(DecodeSessionTest, SendAsyncStepsFromTheAnswersCallbackEqualForwardOverThePrefix) {
  // A prompt of 3 tokens, then 4 one-token steps, each sent from the previous answer's callback
  // (on gRPC's thread, as the load tester does); then the same rows by one Forward.
  const FloatArray whole = Random({1, 7, kWidth}, 11);
  auto session = DecodeSession::Open(*client_, DecodeOptions{});
  ASSERT_TRUE(session.ok()) << session.status();
  std::vector<v1::DecodeRequest> requests;
  std::vector<std::pair<int64_t, int64_t>> spans = {{0, 3}, {3, 4}, {4, 5}, {5, 6}, {6, 7}};
  for (auto [from, to] : spans) {
    absl::StatusOr<v1::DecodeRequest> r = client::BuildDecodeRequest(
        Rows(whole, 0, from, to), {}, std::nullopt, client::Encoding::kRaw);
    ASSERT_TRUE(r.ok()) << r.status();
    requests.push_back(*std::move(r));
  }
  std::vector<v1::DecodeResponse> responses(requests.size());
  AsyncAnswers answers;
  std::function<void(size_t)> send = [&](size_t i) {
    (*session)->SendAsync(requests[i], &responses[i],
                          [&, i, record = answers.Record()](absl::Status s) {
                            const bool next = s.ok() && i + 1 < requests.size();
                            record(std::move(s));
                            if (next) send(i + 1);
                          });
  };
  send(0);
  ASSERT_TRUE(answers.WaitFor(requests.size()));
  const FloatArray want = ForwardWhole(*client_, whole);
  for (size_t i = 0; i < spans.size(); ++i) {
    ASSERT_TRUE(answers.statuses[i].ok()) << i << ": " << answers.statuses[i];
    EXPECT_EQ(responses[i].positions(0), spans[i].second);
    absl::StatusOr<FloatArray> out = client::DecodeTensor(responses[i].output());
    ASSERT_TRUE(out.ok()) << out.status();
    out->shape = {1, spans[i].second - spans[i].first, kWidth};
    ExpectNear(*out, Rows(want, 0, spans[i].first, spans[i].second), "async step");
  }
  EXPECT_TRUE((*session)->Close().ok());
}

TEST_F(DecodeSessionTest, SendAsyncReportsTheStatusAStreamEndedWith) {
  // A refusal in the stream leaves the session usable; a stream the server ends (no such model)
  // comes back with the server's status, and the session has ended by then.
  auto session = DecodeSession::Open(*client_, DecodeOptions{});
  ASSERT_TRUE(session.ok()) << session.status();
  absl::StatusOr<v1::DecodeRequest> too_wide = client::BuildDecodeRequest(
      Random({1, 1, kWidth + 1}, 0), {}, std::nullopt, client::Encoding::kRaw);
  ASSERT_TRUE(too_wide.ok());
  v1::DecodeResponse response;
  AsyncAnswers answers;
  (*session)->SendAsync(*too_wide, &response, answers.Record());
  ASSERT_TRUE(answers.WaitFor(1));
  EXPECT_EQ(answers.statuses[0].code(), absl::StatusCode::kInvalidArgument) << answers.statuses[0];
  EXPECT_FALSE((*session)->ended());

  auto lost = DecodeSession::Open(*client_, WithModel("nope"));
  ASSERT_TRUE(lost.ok()) << lost.status();
  absl::StatusOr<v1::DecodeRequest> step = client::BuildDecodeRequest(
      Random({1, 1, kWidth}, 0), {}, std::nullopt, client::Encoding::kRaw);
  ASSERT_TRUE(step.ok());
  (*lost)->SendAsync(*step, &response, answers.Record());
  ASSERT_TRUE(answers.WaitFor(2));
  EXPECT_EQ(answers.statuses[1].code(), absl::StatusCode::kNotFound) << answers.statuses[1];
  EXPECT_TRUE((*lost)->ended());
  // Later sends and Close report the same end at once.
  (*lost)->SendAsync(*step, &response, answers.Record());
  ASSERT_TRUE(answers.WaitFor(3));
  EXPECT_EQ(answers.statuses[2].code(), absl::StatusCode::kNotFound);
  EXPECT_EQ((*lost)->Close().code(), absl::StatusCode::kNotFound);
}

// Its own server: stopping it breaks the stream, which the session reports as UNAVAILABLE.
TEST(DecodeSessionBrokenTest, AServerThatDiesEndsTheSessionWithUnavailable) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> server =
      ServerProcess::Start(ATTNSERVE_SERVER_BIN, {"--log-level", "warn"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto c = AttentionClient::Connect((*server)->target());
  auto session = DecodeSession::Open(*c, DecodeOptions{});
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE((*session)->Step(Random({1, 2, kWidth}, 0)).ok());
  (*server)->Stop();
  absl::StatusOr<DecodeStepResult> step = (*session)->Step(Random({1, 1, kWidth}, 0));
  EXPECT_EQ(step.status().code(), absl::StatusCode::kUnavailable) << step.status();
  EXPECT_TRUE((*session)->ended());
}

}  // namespace
}  // namespace attnserve::test
