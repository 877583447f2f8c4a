// Golden tests: Layer::Forward against the PyTorch fixtures of tests/fixtures (every layout,
// every kind it serves, ragged lengths, block boundaries, a 4096-token causal sequence), plus the
// properties that must hold whatever the numbers: padded == packed, a batch == its sequences
// alone, several threads on one layer.
#include "tests/common/golden.h"

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/layer.h"
#include "gtest/gtest.h"
#include "tests/common/all_near.h"

namespace attnserve::core {
namespace {

using test::AllNear;
using test::GoldenBatch;
using test::GoldenCase;

constexpr float kTolerance = 1e-4f;

// Every case with its tensors.
std::vector<GoldenCase> Cases() {
  absl::StatusOr<std::vector<GoldenCase>> loaded = test::LoadGoldenCases();
  if (!loaded.ok()) {
    ADD_FAILURE() << loaded.status();
    return {};
  }
  return *std::move(loaded);
}

// A case by name, loaded on first use and kept for the binary's life: a test started alone (as
// ctest starts each) reads only its own case, and the long ones take a moment to build.
const GoldenCase& CaseNamed(const std::string& name) {
  static std::mutex mutex;
  static auto* loaded = new std::map<std::string, GoldenCase>();
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = loaded->find(name); it != loaded->end()) return it->second;
  absl::StatusOr<GoldenCase> c = test::LoadGoldenCase(name);
  if (!c.ok()) {
    ADD_FAILURE() << c.status();
    static const GoldenCase kNone;
    return kNone;
  }
  return loaded->emplace(name, *std::move(c)).first->second;
}

// One Layer per weights file and options, shared by every test that uses it, as a server would.
absl::StatusOr<std::shared_ptr<const Layer>> LayerFor(const GoldenCase& c) {
  static std::mutex mutex;
  static std::map<std::string, std::shared_ptr<const Layer>> layers;
  std::lock_guard<std::mutex> lock(mutex);
  const std::string key = c.weights_path + "|" + c.load_options.prefix;
  if (auto it = layers.find(key); it != layers.end()) return it->second;
  absl::StatusOr<LayerWeights> weights = LoadLayerWeights(c.weights_path, c.load_options);
  if (!weights.ok()) return weights.status();
  absl::StatusOr<std::shared_ptr<const Layer>> layer = Layer::Create(*std::move(weights));
  if (layer.ok()) layers[key] = *layer;
  return layer;
}

RaggedBatch PaddedView(const GoldenBatch& batch) {
  return RaggedBatch{batch.values.data(), batch.width, batch.lengths, batch.seq_len, {}};
}

RaggedBatch PackedView(const GoldenBatch& batch, const std::vector<float>& packed) {
  return RaggedBatch{packed.data(), batch.width, batch.lengths, RaggedBatch::kPacked, {}};
}

// What one Forward call produced.
struct Result {
  absl::Status status;
  std::vector<float> output;
  std::vector<float> attention;
};

Result RunForward(const Layer& layer, const ForwardArgs& args) {
  Result result;
  result.status = layer.Validate(args);
  if (!result.status.ok()) return result;
  const ForwardShapes shapes = layer.Shapes(args);
  // Filled with NaN so a row Forward forgets to write cannot pass as 0.
  result.output.assign(shapes.output_size(), std::nanf(""));
  result.attention.assign(shapes.attention_size(), std::nanf(""));
  result.status = layer.Forward(args, result.output, result.attention);
  return result;
}

ForwardArgs PaddedArgs(const GoldenCase& c, bool return_attention) {
  ForwardArgs args;
  args.kind = c.kind;
  args.input = PaddedView(c.input);
  if (c.context) args.context = PaddedView(*c.context);
  args.return_attention = return_attention;
  return args;
}

// Checks the stored output rows of `c` against a padded output.
testing::AssertionResult OutputMatches(const GoldenCase& c, const std::vector<float>& output) {
  std::vector<float> selected;
  for (int64_t row : c.output_rows) {
    const float* first = output.data() + row * c.d_output;
    selected.insert(selected.end(), first, first + c.d_output);
  }
  return AllNear(selected.data(), c.expected_output.data(), static_cast<int64_t>(selected.size()),
                 kTolerance, "output");
}

std::string TestName(const testing::TestParamInfo<std::string>& info) {
  std::string name = info.param;
  std::replace_if(
      name.begin(), name.end(), [](char ch) { return !std::isalnum(ch); }, '_');
  return name;
}

// The names of the cases, from the manifest alone (gtest asks at every start of the binary).
std::vector<std::string> CaseNames() {
  absl::StatusOr<std::vector<test::GoldenCaseEntry>> entries = test::ListGoldenCases();
  std::vector<std::string> names;
  if (!entries.ok()) {
    ADD_FAILURE() << entries.status();
    return names;
  }
  for (const test::GoldenCaseEntry& entry : *entries) names.push_back(entry.name);
  return names;
}

class GoldenTest : public testing::TestWithParam<std::string> {};

TEST(GoldenFixturesTest, LoadAndCoverEveryLayoutAndKind) {
  const std::vector<GoldenCase> cases = Cases();
  ASSERT_GE(cases.size(), 40u);
  std::map<std::string, int> per_kind;
  for (const GoldenCase& c : cases) ++per_kind[std::string(KindName(c.kind))];
  EXPECT_EQ(per_kind.size(), 4u);
}

TEST_P(GoldenTest, MatchesPyTorch) {
  const GoldenCase& c = CaseNamed(GetParam());
  absl::StatusOr<std::shared_ptr<const Layer>> layer = LayerFor(c);
  ASSERT_TRUE(layer.ok()) << layer.status();
  EXPECT_EQ((*layer)->spec().num_heads, c.num_heads);
  EXPECT_EQ((*layer)->spec().d_output(), c.d_output);
  const Result result = RunForward(**layer, PaddedArgs(c, c.has_probabilities()));
  ASSERT_TRUE(result.status.ok()) << result.status;
  EXPECT_TRUE(OutputMatches(c, result.output));
  if (!c.has_probabilities()) return;
  ASSERT_EQ(result.attention.size(), c.expected_probabilities.size());
  EXPECT_TRUE(AllNear(result.attention.data(), c.expected_probabilities.data(),
                      static_cast<int64_t>(result.attention.size()), kTolerance, "probabilities"));
}

TEST_P(GoldenTest, PaddedAndPackedGiveIdenticalResults) {
  const GoldenCase& c = CaseNamed(GetParam());
  absl::StatusOr<std::shared_ptr<const Layer>> layer = LayerFor(c);
  ASSERT_TRUE(layer.ok()) << layer.status();
  const Result padded = RunForward(**layer, PaddedArgs(c, c.has_probabilities()));
  ASSERT_TRUE(padded.status.ok()) << padded.status;

  const std::vector<float> input = c.input.Packed();
  const std::vector<float> context = c.context ? c.context->Packed() : std::vector<float>();
  ForwardArgs args = PaddedArgs(c, c.has_probabilities());
  args.input = PackedView(c.input, input);
  if (c.context) args.context = PackedView(*c.context, context);
  const Result packed = RunForward(**layer, args);
  ASSERT_TRUE(packed.status.ok()) << packed.status;

  // The packed output's rows are the padded output's valid rows, back to back.
  int64_t packed_row = 0;
  for (int64_t b = 0; b < c.input.batch; ++b) {
    for (int64_t t = 0; t < c.input.lengths[b]; ++t, ++packed_row) {
      const float* want = &padded.output[(b * c.input.seq_len + t) * c.d_output];
      const float* got = &packed.output[packed_row * c.d_output];
      ASSERT_TRUE(std::equal(got, got + c.d_output, want)) << "sequence " << b << " row " << t;
    }
  }
  // The small cases' padded length is the longest sequence, so both have the same shape.
  if (c.has_probabilities()) {
    EXPECT_EQ(packed.attention, padded.attention);
  }
}

// Each sequence of `batch` copied into a buffer of its own, with a poison row after it, and a
// segmented view over them: what the server hands the layer for calls merged in place.
RaggedBatch SegmentedView(const GoldenBatch& batch, std::vector<std::vector<float>>* buffers) {
  RaggedBatch view{nullptr, batch.width, batch.lengths, RaggedBatch::kPacked, {}};
  for (int64_t b = 0; b < batch.batch; ++b) {
    const float* first = &batch.values[b * batch.seq_len * batch.width];
    std::vector<float>& own = buffers->emplace_back(first, first + batch.lengths[b] * batch.width);
    own.insert(own.end(), batch.width, std::nanf(""));  // read past the sequence: NaN shows it
  }
  for (const std::vector<float>& own : *buffers) view.sequence_data.push_back(own.data());
  return view;
}

TEST_P(GoldenTest, SequencesInSeparateBuffersMatchPyTorch) {
  const GoldenCase& c = CaseNamed(GetParam());
  if (c.input.seq_len > 1024) GTEST_SKIP() << "the long case costs enough as it is";
  absl::StatusOr<std::shared_ptr<const Layer>> layer = LayerFor(c);
  ASSERT_TRUE(layer.ok()) << layer.status();
  std::vector<std::vector<float>> input_buffers, context_buffers;
  ForwardArgs args = PaddedArgs(c, /*return_attention=*/false);
  args.input = SegmentedView(c.input, &input_buffers);
  if (c.context) args.context = SegmentedView(*c.context, &context_buffers);
  const Result segmented = RunForward(**layer, args);
  ASSERT_TRUE(segmented.status.ok()) << segmented.status;
  // Packed output: scatter back to the padded layout the expectations index.
  std::vector<float> padded(c.input.batch * c.input.seq_len * c.d_output, 0.0f);
  int64_t packed_row = 0;
  for (int64_t b = 0; b < c.input.batch; ++b) {
    for (int64_t t = 0; t < c.input.lengths[b]; ++t, ++packed_row) {
      std::copy_n(&segmented.output[packed_row * c.d_output], c.d_output,
                  &padded[(b * c.input.seq_len + t) * c.d_output]);
    }
  }
  EXPECT_TRUE(OutputMatches(c, padded));
}

// `batch` re-padded to `seq_len` rows per sequence, every padded row full of a large value:
// masks come from lengths, so neither the padded length nor what padding holds may matter.
GoldenBatch RePadded(const GoldenBatch& batch, int64_t seq_len) {
  GoldenBatch out = batch;
  out.seq_len = seq_len;
  out.values.assign(batch.batch * seq_len * batch.width, 1e6f);
  for (int64_t b = 0; b < batch.batch; ++b) {
    std::copy_n(&batch.values[b * batch.seq_len * batch.width], batch.lengths[b] * batch.width,
                &out.values[b * seq_len * batch.width]);
  }
  return out;
}

TEST_P(GoldenTest, ExtraPaddingWithGarbageChangesNothing) {
  const GoldenCase& c = CaseNamed(GetParam());
  if (c.input.seq_len > 1024) GTEST_SKIP() << "the long case costs enough as it is";
  absl::StatusOr<std::shared_ptr<const Layer>> layer = LayerFor(c);
  ASSERT_TRUE(layer.ok()) << layer.status();
  constexpr int64_t kExtra = 3;
  const GoldenBatch input = RePadded(c.input, c.input.seq_len + kExtra);
  std::optional<GoldenBatch> context;
  if (c.context) context = RePadded(*c.context, c.context->seq_len + kExtra);
  ForwardArgs args = PaddedArgs(c, c.has_probabilities());
  args.input = PaddedView(input);
  if (context) args.context = PaddedView(*context);
  const Result result = RunForward(**layer, args);
  ASSERT_TRUE(result.status.ok()) << result.status;

  // Row b*S+t of the fixture is row b*(S+extra)+t here; the extra rows must be 0.
  std::vector<float> as_fixture;
  for (int64_t b = 0; b < c.input.batch; ++b) {
    const float* first = &result.output[b * input.seq_len * c.d_output];
    as_fixture.insert(as_fixture.end(), first, first + c.input.seq_len * c.d_output);
    for (const float* x = first + c.input.seq_len * c.d_output;
         x != first + input.seq_len * c.d_output; ++x) {
      ASSERT_EQ(*x, 0.0f) << "padded output row of sequence " << b;
    }
  }
  EXPECT_TRUE(OutputMatches(c, as_fixture));
  if (!c.has_probabilities()) return;
  const int64_t kv = c.kv_seq_len(), kv_padded = kv + kExtra;
  std::vector<float> probs;  // [B, H, S, S_kv] cut out of [B, H, S+extra, S_kv+extra]
  for (int64_t bh = 0; bh < c.input.batch * c.num_heads; ++bh) {
    for (int64_t i = 0; i < input.seq_len; ++i) {
      const float* row = &result.attention[(bh * input.seq_len + i) * kv_padded];
      if (i < c.input.seq_len) probs.insert(probs.end(), row, row + kv);
      const float* extra_first = i < c.input.seq_len ? row + kv : row;
      ASSERT_TRUE(std::all_of(extra_first, row + kv_padded, [](float x) { return x == 0.0f; }))
          << "a padded probability is not 0 (head-row " << bh << ", query " << i << ")";
    }
  }
  EXPECT_TRUE(AllNear(probs.data(), c.expected_probabilities.data(),
                      static_cast<int64_t>(probs.size()), kTolerance, "probabilities"));
}

// A row of the batch depends on its own sequence only: nothing leaks across sequences.
TEST_P(GoldenTest, BatchGivesTheSameRowsAsEachSequenceAlone) {
  const GoldenCase& c = CaseNamed(GetParam());
  if (c.input.seq_len > 1024) GTEST_SKIP() << "the long case has a single sequence";
  absl::StatusOr<std::shared_ptr<const Layer>> layer = LayerFor(c);
  ASSERT_TRUE(layer.ok()) << layer.status();
  const Result batch = RunForward(**layer, PaddedArgs(c, false));
  ASSERT_TRUE(batch.status.ok()) << batch.status;
  for (int64_t b = 0; b < c.input.batch; ++b) {
    GoldenBatch one = c.input;
    one.lengths = {c.input.lengths[b]};
    const int64_t row_size = c.input.seq_len * c.input.width;
    one.values.assign(c.input.values.begin() + b * row_size,
                      c.input.values.begin() + (b + 1) * row_size);
    std::optional<GoldenBatch> context_one = c.context;
    if (c.context) {
      const int64_t ctx_size = c.context->seq_len * c.context->width;
      context_one->lengths = {c.context->lengths[b]};
      context_one->values.assign(c.context->values.begin() + b * ctx_size,
                                 c.context->values.begin() + (b + 1) * ctx_size);
    }
    ForwardArgs args = PaddedArgs(c, false);
    args.input = PaddedView(one);
    if (context_one) args.context = PaddedView(*context_one);
    const Result alone = RunForward(**layer, args);
    ASSERT_TRUE(alone.status.ok()) << alone.status;
    const int64_t out_size = c.input.seq_len * c.d_output;
    EXPECT_TRUE(AllNear(alone.output.data(), batch.output.data() + b * out_size, out_size, 1e-5f,
                        "sequence " + std::to_string(b) + " alone vs in the batch"));
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GoldenTest, testing::ValuesIn(CaseNames()), TestName);

// Several threads call Forward on one shared Layer, each checking its own kind against PyTorch:
// the Layer is immutable, so concurrent calls must not disturb each other.
// Inputs that reach 1e17 (a token of each sequence): scores near 1e34, the softmax as sharp as it
// gets, outputs near 1e17. Forward gives PyTorch's rows within float32 rounding of each row's
// magnitude: large values within float32's range are computed, not refused.
TEST(GoldenLargeValuesTest, ForwardMatchesPyTorch) {
  absl::StatusOr<GoldenCase> loaded = test::LoadLargeValuesCase("torch_mha/causal/large_values");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const GoldenCase& c = *loaded;
  absl::StatusOr<std::shared_ptr<const Layer>> layer = LayerFor(c);
  ASSERT_TRUE(layer.ok()) << layer.status();
  const Result result = RunForward(**layer, PaddedArgs(c, false));
  ASSERT_TRUE(result.status.ok()) << result.status;
  for (int64_t b = 0; b < c.input.batch; ++b) {
    for (int64_t t = 0; t < c.input.lengths[b]; ++t) {
      const int64_t row = b * c.input.seq_len + t;
      EXPECT_TRUE(AllNear(result.output.data() + row * c.d_output,
                          c.expected_output.data() + row * c.d_output, c.d_output,
                          1e-4f * test::ExpectedRowScale(c, row),
                          absl::StrCat("sequence ", b, " position ", t)));
    }
  }
}

TEST(GoldenConcurrencyTest, ThreadsShareOneLayer) {
  const std::vector<std::string> names = {"torch_mha/bidirectional", "torch_mha/causal",
                                          "torch_mha/cross", "torch_mha/causal_cross"};
  absl::StatusOr<std::shared_ptr<const Layer>> layer = LayerFor(CaseNamed(names[0]));
  ASSERT_TRUE(layer.ok()) << layer.status();
  std::vector<int> failures(names.size() * 2, 0);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < failures.size(); ++i) {
    threads.emplace_back([&, i] {
      const GoldenCase& c = CaseNamed(names[i % names.size()]);
      for (int repeat = 0; repeat < 20; ++repeat) {
        const Result result = RunForward(**layer, PaddedArgs(c, true));
        if (!result.status.ok() || !OutputMatches(c, result.output) ||
            !AllNear(result.attention.data(), c.expected_probabilities.data(),
                     static_cast<int64_t>(c.expected_probabilities.size()), kTolerance, "")) {
          ++failures[i];
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (size_t i = 0; i < failures.size(); ++i) {
    EXPECT_EQ(failures[i], 0) << "thread " << i << " (" << names[i % names.size()] << ")";
  }
}

}  // namespace
}  // namespace attnserve::core
