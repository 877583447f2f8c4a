// Decode sessions' exactness contract, against PyTorch: every row a step returns equals the same
// row of one forward pass over the whole sequence so far. The golden fixtures' causal and causal
// cross cases are full sequences; fed token by token (after a prefill, several tokens per step,
// after a truncate, sequences of different lengths stepped together), each step's rows must be
// the fixture's rows at those positions.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "core/kv_attention.h"
#include "core/kv_cache.h"
#include "core/layer.h"
#include "core/weights.h"
#include "gtest/gtest.h"
#include "tests/common/golden.h"

namespace attnserve::core {
namespace {

using test::GoldenCase;

// The causal and causal cross cases whose every output row is stored, by name (from the manifest
// alone: gtest asks at every start of the binary).
std::vector<std::string> DecodeCases() {
  absl::StatusOr<std::vector<test::GoldenCaseEntry>> entries = test::ListGoldenCases();
  EXPECT_TRUE(entries.ok()) << entries.status();
  std::vector<std::string> names;
  if (!entries.ok()) return names;
  for (const test::GoldenCaseEntry& entry : *entries) {
    if (IsCausal(entry.kind) && entry.every_row_stored) names.push_back(entry.name);
  }
  return names;
}

// One sequence of a case as a session holds it.
struct Sequence {
  std::unique_ptr<KvSequence> cache, context;
  int64_t position = 0;
};

// A golden case stepped through Layer::Decode.
class SessionSteps : public ::testing::Test {
 protected:
  void Load(absl::StatusOr<GoldenCase> loaded) {
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    case_ = *std::move(loaded);
    const GoldenCase& c = case_;
    absl::StatusOr<LayerWeights> weights = LoadLayerWeights(c.weights_path, c.load_options);
    ASSERT_TRUE(weights.ok()) << weights.status();
    absl::StatusOr<std::shared_ptr<const Layer>> layer = Layer::Create(*std::move(weights));
    ASSERT_TRUE(layer.ok()) << layer.status();
    layer_ = *layer;
  }

  // Opens every sequence of the case: caches, and the context's keys and values once, every
  // sequence's in one projection, each in two parts (its first two rows, then the rest) as a
  // session's context is projected as its positions reach it.
  std::vector<Sequence> Open(KvPrecision precision) {
    const GoldenCase& c = case_;
    std::vector<Sequence> sequences(c.input.batch);
    std::vector<ContextRows> parts;
    for (int64_t b = 0; b < c.input.batch; ++b) {
      Sequence& s = sequences[b];
      const LayerSpec& spec = layer_->spec();
      s.cache =
          std::make_unique<KvSequence>(spec.inner(), spec.head_dim, precision, &budget_, &bytes_);
      if (c.kind != AttentionKind::kCausalCross) continue;
      s.context =
          std::make_unique<KvSequence>(spec.inner(), spec.head_dim, precision, &budget_, &bytes_);
      const test::GoldenBatch& ctx = *c.context;
      const int64_t length = ctx.lengths[b];
      EXPECT_TRUE(s.context->Reserve(length).ok());
      const float* rows = ctx.values.data() + b * ctx.seq_len * ctx.width;
      const int64_t first = std::min<int64_t>(length, 2);
      parts.push_back({rows, first, s.context.get()});
      parts.push_back({rows + first * ctx.width, length - first, s.context.get()});
    }
    EXPECT_TRUE(layer_->ProjectContext(parts).ok());
    return sequences;
  }

  // Steps every sequence from its position to its length, `first` tokens in the first step and
  // `step` after, all sequences in one Decode call per step; checks each returned row (within
  // `tolerance`, times test::ExpectedRowScale if relative_).
  void Run(std::vector<Sequence>& sequences, int64_t first, int64_t step, float tolerance) {
    const GoldenCase& c = case_;
    const int64_t width = c.d_output;
    bool more = true;
    for (int round = 0; more; ++round) {
      more = false;
      std::vector<DecodeSequence> batch;
      std::vector<std::vector<float>> outputs(sequences.size());
      for (size_t b = 0; b < sequences.size(); ++b) {
        Sequence& s = sequences[b];
        const int64_t length = c.input.lengths[b];
        const int64_t n = std::min(round == 0 ? first : step, length - s.position);
        if (n <= 0) continue;
        more = true;
        outputs[b].assign(n * width, -1.0f);
        DecodeSequence seq;
        seq.input = c.input.values.data() + (b * c.input.seq_len + s.position) * c.input.width;
        seq.tokens = n;
        seq.position = s.position;
        if (c.kind == AttentionKind::kCausal) {
          EXPECT_TRUE(s.cache->Reserve(s.position + n).ok());
          seq.cache = s.cache.get();
        } else {
          seq.context = s.context.get();
          seq.context_length = c.context->lengths[b];
        }
        seq.output = outputs[b].data();
        batch.push_back(seq);
      }
      if (!more) break;
      ASSERT_TRUE(layer_->Decode(c.kind, batch).ok());
      for (size_t b = 0; b < sequences.size(); ++b) {
        Sequence& s = sequences[b];
        const int64_t n = static_cast<int64_t>(outputs[b].size()) / width;
        for (int64_t t = 0; t < n; ++t) {
          const int64_t row = static_cast<int64_t>(b) * c.input.seq_len + s.position + t;
          const float row_tolerance =
              relative_ ? tolerance * test::ExpectedRowScale(c, row) : tolerance;
          for (int64_t k = 0; k < width; ++k) {
            const float want = c.expected_output[row * width + k];
            ASSERT_NEAR(outputs[b][t * width + k], want, row_tolerance)
                << "sequence " << b << " position " << s.position + t << " column " << k;
          }
        }
        s.position += n;
      }
    }
  }

  GoldenCase case_;
  bool relative_ = false;
  std::shared_ptr<const Layer> layer_;
  KvCacheBudget budget_{int64_t{1} << 30};
  std::atomic<int64_t> bytes_{0};
};

// The manifest's cases, each its own test.
class DecodeTest : public SessionSteps, public ::testing::WithParamInterface<std::string> {
 protected:
  void SetUp() override { Load(test::LoadGoldenCase(GetParam())); }
};

TEST_P(DecodeTest, PrefillThenOneTokenAStepMatchesPyTorch) {
  std::vector<Sequence> sequences = Open(KvPrecision::kF32);
  Run(sequences, /*first=*/3, /*step=*/1, 1e-4f);
}

TEST_P(DecodeTest, SeveralTokensAStepMatchPyTorch) {
  std::vector<Sequence> sequences = Open(KvPrecision::kF32);
  Run(sequences, /*first=*/1, /*step=*/3, 1e-4f);
}

TEST_P(DecodeTest, ATruncatedSequenceGoesOnAsIfItHadNeverGoneFurther) {
  std::vector<Sequence> sequences = Open(KvPrecision::kF32);
  Run(sequences, /*first=*/2, /*step=*/2, 1e-4f);
  for (Sequence& s : sequences) {
    const int64_t keep = s.position / 2;
    if (s.cache->length() > 0) s.cache->Truncate(keep);
    s.position = keep;
  }
  Run(sequences, /*first=*/1, /*step=*/1, 1e-4f);
}

TEST_P(DecodeTest, ABf16CacheStaysWithinBf16Rounding) {
  std::vector<Sequence> sequences = Open(KvPrecision::kBF16);
  Run(sequences, /*first=*/3, /*step=*/1, 3e-2f);
}

TEST_P(DecodeTest, EveryBlockIsFreedWithItsSequence) {
  {
    std::vector<Sequence> sequences = Open(KvPrecision::kF32);
    Run(sequences, /*first=*/4, /*step=*/1, 1e-4f);
    EXPECT_GT(bytes_.load(), 0);
  }
  EXPECT_EQ(bytes_.load(), 0);
  EXPECT_EQ(budget_.used(), 0);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, DecodeTest, ::testing::ValuesIn(DecodeCases()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string name = info.param;
                           std::replace_if(
                               name.begin(), name.end(),
                               [](char ch) {
                                 return !std::isalnum(static_cast<unsigned char>(ch));
                               },
                               '_');
                           return name;
                         });

// Inputs that reach 1e17 (a token of each sequence): scores near 1e34, the softmax as sharp as it
// gets, outputs near 1e17. A session's steps give PyTorch's rows, within float32 rounding of each
// row's magnitude (as Forward does: golden_test.cc): large values within float32's range are
// computed, not refused.
class LargeValuesTest : public SessionSteps {
 protected:
  void SetUp() override {
    relative_ = true;
    Load(test::LoadLargeValuesCase("torch_mha/causal/large_values"));
  }
};

TEST_F(LargeValuesTest, SessionStepsMatchPyTorch) {
  std::vector<Sequence> one_a_step = Open(KvPrecision::kF32);
  Run(one_a_step, /*first=*/2, /*step=*/1, 1e-4f);
  std::vector<Sequence> several_a_step = Open(KvPrecision::kF32);
  Run(several_a_step, /*first=*/1, /*step=*/4, 1e-4f);
}

// A causal cross step whose queries see context rows not projected yet (or that names no
// context length) is refused, not answered from what happens to be there.
TEST(DecodeContextTest, QueriesPastTheProjectedContextAreRefused) {
  absl::StatusOr<std::shared_ptr<const Layer>> layer = Layer::Create(MakeDemoWeights());
  ASSERT_TRUE(layer.ok()) << layer.status();
  const LayerSpec& spec = (*layer)->spec();
  KvCacheBudget budget(int64_t{1} << 30);
  KvSequence context(spec.inner(), spec.head_dim, KvPrecision::kF32, &budget, nullptr);
  constexpr int64_t kContext = 100, kProjected = 10;
  ASSERT_TRUE(context.Reserve(kContext).ok());
  std::vector<float> rows(kContext * spec.d_context);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = std::sin(0.01f * i);
  const ContextRows part{rows.data(), kProjected, &context};
  ASSERT_TRUE((*layer)->ProjectContext({&part, 1}).ok());
  std::vector<float> input(4 * spec.d_model, 0.5f), output(4 * spec.d_output());
  DecodeSequence seq;
  seq.input = input.data();
  seq.context = &context;
  seq.context_length = kContext;
  seq.output = output.data();
  // Positions 6..9 see rows 0..9: all projected.
  seq.position = 6;
  seq.tokens = 4;
  EXPECT_TRUE((*layer)->Decode(AttentionKind::kCausalCross, {&seq, 1}).ok());
  // Positions 7..10 see row 10 too.
  seq.position = 7;
  absl::Status short_context = (*layer)->Decode(AttentionKind::kCausalCross, {&seq, 1});
  EXPECT_EQ(short_context.code(), absl::StatusCode::kInternal) << short_context;
  EXPECT_NE(short_context.message().find("10 of its 100 rows projected; its queries see 11"),
            std::string::npos)
      << short_context;
  // A step that names no context length.
  seq.position = 0;
  seq.tokens = 1;
  seq.context_length = 0;
  EXPECT_EQ((*layer)->Decode(AttentionKind::kCausalCross, {&seq, 1}).code(),
            absl::StatusCode::kInternal);
}

TEST(KvCacheTest, ABudgetThatCannotTakeAStepRefusesItAndChangesNothing) {
  KvCacheBudget budget(2 * 2 * kKvBlockTokens * 8 * 4);  // two blocks of width 8, f32
  std::atomic<int64_t> bytes{0};
  KvSequence a(8, 8, KvPrecision::kF32, &budget, &bytes);
  ASSERT_TRUE(a.Reserve(kKvBlockTokens + 1).ok());  // two blocks
  KvSequence b(8, 8, KvPrecision::kF32, &budget, &bytes);
  const absl::Status refused = b.Reserve(1);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("--kv-cache-mib"), absl::string_view::npos);
  EXPECT_EQ(b.bytes(), 0);
  EXPECT_EQ(a.bytes(), 2 * a.block_bytes());
  // A truncate frees the blocks past the new length, and the budget can take them again.
  std::vector<float> row(8, 1.0f);
  for (int64_t p = 0; p <= kKvBlockTokens; ++p) a.Write(p, row.data(), row.data());
  a.Truncate(kKvBlockTokens);
  EXPECT_EQ(a.length(), kKvBlockTokens);
  EXPECT_EQ(a.bytes(), a.block_bytes());
  EXPECT_TRUE(b.Reserve(1).ok());
  EXPECT_EQ(bytes.load(), budget.used());
}

// A negative length (from a caller's bad lengths) is refused, and no charge, however computed,
// gives the budget room it does not have.
TEST(KvCacheTest, ANegativeLengthIsRefusedAndTheBudgetStaysWhole) {
  KvCacheBudget budget(2 * 2 * kKvBlockTokens * 8 * 4);  // two blocks of width 8, f32
  KvSequence a(8, 8, KvPrecision::kF32, &budget, nullptr);
  for (int64_t length : {int64_t{-1}, int64_t{-17}, int64_t{-2147483648}}) {
    EXPECT_EQ(a.Reserve(length).code(), absl::StatusCode::kInvalidArgument) << length;
  }
  EXPECT_EQ(budget.used(), 0);
  EXPECT_FALSE(budget.TryCharge(-a.block_bytes()));
  EXPECT_EQ(budget.used(), 0);
  ASSERT_TRUE(budget.TryCharge(1));
  // A charge so large that adding it to what is used overflows is refused too.
  EXPECT_FALSE(budget.TryCharge(std::numeric_limits<int64_t>::max()));
  budget.Release(1);
  EXPECT_EQ(budget.used(), 0);
  ASSERT_TRUE(a.Reserve(2 * kKvBlockTokens).ok());
  KvSequence b(8, 8, KvPrecision::kF32, &budget, nullptr);
  EXPECT_EQ(b.Reserve(1).code(), absl::StatusCode::kResourceExhausted);
}

// Every KV attention kernel this CPU runs (AVX512-BF16, AVX-512, AVX2, portable), f32 and bf16
// caches, head widths that are and are not multiples of 16 and 64 (and an odd one: bf16 pairs
// dimensions), lengths that end inside a block (after an odd row: bf16 pairs rows): each
// output equals softmax(q K^T / sqrt(d)) V computed in double from the same cached values
// (bf16: the values as rounded into the cache), within f32 rounding. The AVX512-BF16 kernel of
// a bf16 cache multiplies bf16s: its query is rounded to bf16 (so is the definition's), and so
// is each softmax weight (each off by at most 2^-8 of itself, bf16's unit roundoff: the output by
// 2^-8 of the weighted sum of |v|).
TEST(KvAttentionTest, EveryKernelFlavourMatchesTheDefinition) {
  const std::vector<std::string> flavours = KvAttentionFlavours();
  ASSERT_FALSE(flavours.empty());
  EXPECT_EQ(flavours.back(), "portable");
  for (const std::string& flavour : flavours) {
    // 768 and 4096: a head whose tile holds fewer queries, and the widest sessions serve; 20
    // heads: more than a kernel takes a step at a time.
    const std::vector<std::pair<int64_t, int64_t>> shapes = {{3, 8},  {3, 21},  {3, 24},  {3, 64},
                                                             {3, 80}, {3, 128}, {3, 768}, {3, 4096},
                                                             {20, 8}, {20, 21}, {20, 64}};
    for (const std::pair<int64_t, int64_t>& shape : shapes) {
      const int64_t heads = shape.first;
      const int64_t head_dim = shape.second;
      for (const KvPrecision precision : {KvPrecision::kF32, KvPrecision::kBF16}) {
        const int64_t width = heads * head_dim;
        KvCacheBudget budget(int64_t{1} << 30);
        KvSequence cache(width, head_dim, precision, &budget);
        constexpr int64_t kLength = 3 * kKvBlockTokens + 5;
        ASSERT_TRUE(cache.Reserve(kLength).ok());
        auto value_at = [](int64_t i, int64_t seed) {
          return static_cast<float>(std::sin(0.731 * static_cast<double>(i) + seed));
        };
        std::vector<float> keys(kLength * width), values(kLength * width);
        for (int64_t i = 0; i < kLength * width; ++i) {
          keys[i] = 2.0f * value_at(i, 1);
          values[i] = value_at(i, 2);
        }
        // What the cache holds: bf16 rounds to nearest even.
        auto stored = [&](float x) {
          if (precision == KvPrecision::kF32) return static_cast<double>(x);
          uint32_t bits;
          std::memcpy(&bits, &x, 4);
          bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
          float y;
          std::memcpy(&y, &bits, 4);
          return static_cast<double>(y);
        };
        // What is never written (the rows after the last, to the end of its block; the second
        // half of a bf16 key's last pair of dimensions when they are odd) holds NaN, as memory
        // never written may: no answer may read it.
        const int64_t blocks = (kLength + kKvBlockTokens - 1) / kKvBlockTokens;
        for (int64_t b = 0; b < blocks; ++b) {
          std::memset(const_cast<void*>(cache.head(b, 0)), 0xff, cache.block_bytes());
        }
        for (int64_t t = 0; t < kLength; ++t) {
          cache.Write(t, keys.data() + t * width, values.data() + t * width);
        }
        const bool bf16_products = flavour == "avx512bf16" && precision == KvPrecision::kBF16;
        std::vector<float> q(width), out(width, -1.0f);
        for (int64_t c = 0; c < width; ++c) q[c] = value_at(c, 3);
        // The kernels multiply the query by the scale first; bf16 products round that.
        const double exact_scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
        const auto kernel_scale = static_cast<float>(exact_scale);
        auto query_element = [&](float x) {
          return bf16_products ? stored(x * kernel_scale) / exact_scale : static_cast<double>(x);
        };
        for (const int64_t visible : {int64_t{1}, kKvBlockTokens, kLength}) {
          const KvQuery query{q.data(), out.data(), &cache, visible};
          KvAttentionWith(flavour, {&query, 1}, heads, head_dim, kernel_scale);
          for (int64_t h = 0; h < heads; ++h) {
            std::vector<double> weights(visible);
            double top = -1e300, sum = 0;
            for (int64_t t = 0; t < visible; ++t) {
              double dot = 0;
              for (int64_t d = 0; d < head_dim; ++d) {
                dot +=
                    query_element(q[h * head_dim + d]) * stored(keys[t * width + h * head_dim + d]);
              }
              weights[t] = dot * exact_scale;
              top = std::max(top, weights[t]);
            }
            for (double& w : weights) sum += (w = std::exp(w - top));
            for (int64_t d = 0; d < head_dim; ++d) {
              double want = 0, weighted_magnitude = 0;
              for (int64_t t = 0; t < visible; ++t) {
                const double v = stored(values[t * width + h * head_dim + d]);
                want += weights[t] / sum * v;
                weighted_magnitude += weights[t] / sum * std::abs(v);
              }
              const double tolerance =
                  2e-6 + (bf16_products ? std::ldexp(weighted_magnitude, -8) : 0.0);
              ASSERT_NEAR(out[h * head_dim + d], want, tolerance)
                  << flavour << " heads " << heads << " head_dim " << head_dim << " bf16 "
                  << (precision == KvPrecision::kBF16) << " visible " << visible << " head " << h
                  << " dim " << d;
            }
          }
        }
        // Many queries of the sequence at once, each its own q: tiles (a prompt chunk's tokens
        // share each block read), heads taken together, one query that sees nothing; each
        // answer as when alone.
        const std::vector<int64_t> visibles = {kLength, 0, 1, kKvBlockTokens + 3, kLength - 1};
        constexpr int64_t kQueries = 32;  // four tiles of eight (every head in one task, or two)
        std::vector<float> qs(kQueries * width), alone(kQueries * width);
        std::vector<float> tiled(kQueries * width, -1.0f);
        std::vector<KvQuery> tile;
        const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
        for (int64_t i = 0; i < kQueries; ++i) {
          for (int64_t c = 0; c < width; ++c) qs[i * width + c] = value_at(i * width + c, 4);
          const int64_t visible = visibles[i % visibles.size()];
          const KvQuery one{qs.data() + i * width, alone.data() + i * width, &cache, visible};
          KvAttentionWith(flavour, {&one, 1}, heads, head_dim, scale);
          tile.push_back({qs.data() + i * width, tiled.data() + i * width, &cache, visible});
        }
        KvAttentionWith(flavour, tile, heads, head_dim, scale);
        for (size_t i = 0; i < alone.size(); ++i) {
          ASSERT_EQ(tiled[i], alone[i]) << flavour << " heads " << heads << " head_dim " << head_dim
                                        << " query " << i / width << " element " << i % width;
        }
        EXPECT_EQ(tiled[width], 0.0f);  // the query that sees nothing
      }
    }
  }
}

// Scores that overflow float32 (finite keys and queries near 1e20) make the head's output NaN
// or infinite in every flavour, never a finite answer without the keys they belong to: the
// caller's finiteness check then refuses the step, as Forward's refuses its call. A score of
// +inf, a NaN (products of both signs overflowing, their exact sum too), and every score -inf.
TEST(KvAttentionTest, ScoresThatOverflowFloat32LeaveTheOutputNotFinite) {
  constexpr int64_t kHeads = 2, kHeadDim = 16, kWidth = kHeads * kHeadDim;
  constexpr int64_t kLength = 2 * kKvBlockTokens + 3;  // the overflow in the second block
  const float scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  for (const std::string& flavour : KvAttentionFlavours()) {
    for (const KvPrecision precision : {KvPrecision::kF32, KvPrecision::kBF16}) {
      struct Overflow {
        const char* what;
        float key_sign;  // keys 0 .. kLength - 1 of head 0: small, but key 20 (or all) huge
        bool every_key;  // every key of head 0 huge (else key 20 alone)
        bool mixed;      // the query's last 4 dimensions negative (products of both signs)
      };
      for (const Overflow& o :
           {Overflow{"+inf", 1.0f, false, false}, Overflow{"NaN", 1.0f, false, true},
            Overflow{"every score -inf", -1.0f, true, false}}) {
        KvCacheBudget budget(int64_t{1} << 30);
        KvSequence cache(kWidth, kHeadDim, precision, &budget);
        ASSERT_TRUE(cache.Reserve(kLength).ok());
        for (int64_t t = 0; t < kLength; ++t) {
          std::vector<float> key(kWidth), value(kWidth);
          for (int64_t c = 0; c < kWidth; ++c) {
            key[c] = static_cast<float>(std::sin(0.37 * static_cast<double>(t * kWidth + c)));
            value[c] = static_cast<float>(std::cos(0.53 * static_cast<double>(t * kWidth + c)));
            if (c < kHeadDim && (o.every_key || t == 20)) key[c] = o.key_sign * 1e20f;
          }
          cache.Write(t, key.data(), value.data());
        }
        std::vector<float> q(kWidth, 0.5f), out(kWidth, 0.0f);
        for (int64_t c = 0; c < kHeadDim; ++c) q[c] = o.mixed && c >= 12 ? -1e20f : 1e20f;
        const KvQuery query{q.data(), out.data(), &cache, kLength};
        KvAttentionWith(flavour, {&query, 1}, kHeads, kHeadDim, scale);
        EXPECT_FALSE(std::all_of(out.begin(), out.begin() + kHeadDim,
                                 [](float x) { return std::isfinite(x); }))
            << flavour << " bf16 " << (precision == KvPrecision::kBF16) << ": " << o.what;
        EXPECT_TRUE(std::all_of(out.begin() + kHeadDim, out.end(),
                                [](float x) { return std::isfinite(x); }))
            << flavour << ": the other head";
      }
    }
  }
}

}  // namespace
}  // namespace attnserve::core
