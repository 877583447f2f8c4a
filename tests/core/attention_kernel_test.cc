// RunAttention against an independent double-precision oracle written here: random ragged
// problems at the kernel's block boundaries (tile rows 16/48, key blocks 64, key tiles 8),
// causal with S != S_kv both ways, fused-QKV strides, odd head sizes, probabilities on and off,
// a long causal sequence, keys too many to pack; for every tile-kernel flavour (portable and,
// when the CPU has them, AVX-512 and AVX-512 with bf16 products).

#include "core/attention_kernel.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/attention_tiles.h"

namespace attnserve::core {
namespace {

constexpr double kTolerance = 1e-4;
// The bf16 flavour against an oracle that rounds Q (scaled), K and V as the kernel does: what
// remains is the rounding of the probabilities to bf16 (relative 2^-9) before P V.
constexpr double kBf16Tolerance = 5e-3;

// A problem description: lengths per sequence and the layout knobs the kernel must honour.
struct Case {
  std::vector<int64_t> q_lengths;
  std::vector<int64_t> kv_lengths;
  int64_t num_heads = 2;
  int64_t head_dim = 64;
  bool causal = false;
  bool fused = false;  // Q, K, V interleaved in one [T, 3 * inner] buffer, as B1 passes them
  bool probs = false;
  float value_scale = 1.0f;  // larger values give sharper softmaxes
  float scale = 0.0f;        // 0: 1 / sqrt(head_dim)
  uint32_t seed = 1;
};

// Inputs and outputs of one problem in the kernel's layout.
struct Problem {
  Case c;
  std::vector<int64_t> q_offsets, kv_offsets;
  std::vector<float> qkv, kv;  // qkv holds Q (and K, V when fused); kv holds K then V otherwise
  std::vector<float> out, probs;
  int64_t probs_q_len = 0, probs_kv_len = 0;
  bool bf16_operands = false;  // the oracle rounds the products' operands as the bf16 kernels
  AttentionProblem p;
};

// x rounded to the nearest bf16 (ties to even), as vcvtne2ps2bf16 rounds.
double Bf16(float x) {
  uint32_t bits = std::bit_cast<uint32_t>(x);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return std::bit_cast<float>(bits & 0xffff0000u);
}

std::vector<int64_t> Offsets(const std::vector<int64_t>& lengths) {
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (int64_t len : lengths) {
    offsets.push_back(total);
    total += len;
  }
  return offsets;
}

int64_t Sum(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (int64_t x : v) s += x;
  return s;
}

// Builds a problem with random inputs; outputs are pre-filled with NaN so that every entry the
// kernel must write is checked to be written.
void Build(const Case& c, Problem& pr) {
  pr.c = c;
  const int64_t inner = c.num_heads * c.head_dim;
  const int64_t q_rows = Sum(c.q_lengths), kv_rows = Sum(c.kv_lengths);
  pr.q_offsets = Offsets(c.q_lengths);
  pr.kv_offsets = Offsets(c.kv_lengths);
  std::mt19937 rng(c.seed);
  std::normal_distribution<float> dist(0.0f, c.value_scale);
  AttentionProblem& p = pr.p;
  if (c.fused) {
    pr.qkv.resize(q_rows * 3 * inner + 1);
    for (float& x : pr.qkv) x = dist(rng);
    p.q = pr.qkv.data();
    p.k = p.q + inner;
    p.v = p.k + inner;
    p.q_stride = p.k_stride = p.v_stride = 3 * inner;
  } else {
    // Strides wider than inner, with distinct padding, so a wrong stride shows.
    p.q_stride = inner + 3;
    p.k_stride = 2 * inner + 5;
    p.v_stride = 2 * inner + 5;
    pr.qkv.resize(std::max<int64_t>(q_rows * p.q_stride, 1));
    pr.kv.resize(std::max<int64_t>(kv_rows * p.k_stride, 1));
    for (float& x : pr.qkv) x = dist(rng);
    for (float& x : pr.kv) x = dist(rng);
    p.q = pr.qkv.data();
    p.k = pr.kv.data();
    p.v = pr.kv.data() + inner + 2;
  }
  p.out_stride = inner + 1;
  pr.out.assign(std::max<int64_t>(q_rows * p.out_stride, 1), std::nanf(""));
  p.out = pr.out.data();
  p.q_lengths = c.q_lengths;
  p.q_offsets = pr.q_offsets;
  p.kv_lengths = c.kv_lengths;
  p.kv_offsets = pr.kv_offsets;
  p.num_heads = c.num_heads;
  p.head_dim = c.head_dim;
  p.causal = c.causal;
  p.scale = c.scale != 0.0f ? c.scale : 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  if (c.probs) {
    // Padded a little past the longest sequences: those entries must come back 0.
    pr.probs_q_len = *std::max_element(c.q_lengths.begin(), c.q_lengths.end()) + 2;
    pr.probs_kv_len = *std::max_element(c.kv_lengths.begin(), c.kv_lengths.end()) + 3;
    pr.probs.assign(c.q_lengths.size() * c.num_heads * pr.probs_q_len * pr.probs_kv_len,
                    std::nanf(""));
    p.probs = pr.probs.data();
    p.probs_q_len = pr.probs_q_len;
    p.probs_kv_len = pr.probs_kv_len;
  }
}

// The oracle for one (sequence, head, query row): softmax in double over the visible keys;
// returns the probabilities of all keys (0 where masked) and writes the output row.
std::vector<double> ReferenceRow(const Problem& pr, int64_t b, int64_t h, int64_t i,
                                 std::vector<double>& out_row) {
  const AttentionProblem& p = pr.p;
  const int64_t d = p.head_dim, kv_len = p.kv_lengths[b];
  const int64_t visible = p.causal ? std::min(kv_len, i + 1) : kv_len;
  const float* q = p.q + (p.q_offsets[b] + i) * p.q_stride + h * d;
  std::vector<double> w(kv_len, 0.0);
  out_row.assign(d, 0.0);
  if (visible == 0) return w;
  // bf16: the kernel scales Q by scale * log2(e) in f32, rounds, and takes base-2 exponentials.
  const float log2_factor = p.scale * std::numbers::log2e_v<float>;
  double max_score = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < visible; ++j) {
    const float* k = p.k + (p.kv_offsets[b] + j) * p.k_stride + h * d;
    double dot = 0.0;
    for (int64_t c = 0; c < d; ++c) {
      dot += pr.bf16_operands ? Bf16(q[c] * log2_factor) * Bf16(k[c])
                              : static_cast<double>(q[c]) * k[c] * p.scale;
    }
    w[j] = dot;
    max_score = std::max(max_score, w[j]);
  }
  double sum = 0.0;
  for (int64_t j = 0; j < visible; ++j) {
    sum += (w[j] = pr.bf16_operands ? std::exp2(w[j] - max_score) : std::exp(w[j] - max_score));
  }
  for (int64_t j = 0; j < visible; ++j) {
    w[j] /= sum;
    const float* v = p.v + (p.kv_offsets[b] + j) * p.v_stride + h * d;
    for (int64_t c = 0; c < d; ++c) out_row[c] += w[j] * (pr.bf16_operands ? Bf16(v[c]) : v[c]);
  }
  return w;
}

// Checks every output entry and, when asked for, every probability entry against the oracle;
// reports the first few mismatches only.
void ExpectMatchesReference(const Problem& pr, const std::string& what,
                            double tolerance = kTolerance) {
  const AttentionProblem& p = pr.p;
  int failures = 0;
  std::vector<double> out_row;
  for (size_t b = 0; b < p.q_lengths.size(); ++b) {
    for (int64_t h = 0; h < p.num_heads; ++h) {
      for (int64_t i = 0; i < pr.probs_q_len || i < p.q_lengths[b]; ++i) {
        std::vector<double> w;
        if (i < p.q_lengths[b]) {
          w = ReferenceRow(pr, b, h, i, out_row);
          const float* got = p.out + (p.q_offsets[b] + i) * p.out_stride + h * p.head_dim;
          for (int64_t c = 0; c < p.head_dim && failures < 5; ++c) {
            if (!(std::abs(got[c] - out_row[c]) <= tolerance)) {
              ADD_FAILURE() << what << ": out b=" << b << " h=" << h << " i=" << i << " c=" << c
                            << " got " << got[c] << " want " << out_row[c];
              ++failures;
            }
          }
        }
        if (p.probs == nullptr) continue;
        const float* got = p.probs + ((b * p.num_heads + h) * p.probs_q_len + i) * p.probs_kv_len;
        for (int64_t j = 0; j < p.probs_kv_len && failures < 5; ++j) {
          const double want = j < static_cast<int64_t>(w.size()) ? w[j] : 0.0;
          if (!(std::abs(got[j] - want) <= tolerance)) {
            ADD_FAILURE() << what << ": probs b=" << b << " h=" << h << " i=" << i << " j=" << j
                          << " got " << got[j] << " want " << want;
            ++failures;
          }
        }
      }
    }
  }
}

// Runs one case through the flavour under test and checks it.
class AttentionKernelTest : public ::testing::TestWithParam<std::string> {
 protected:
  const internal::TileKernels* Kernels() const {
    if (GetParam() == "portable") return &internal::PortableTileKernels();
    if (GetParam() == "avx512_bf16") return internal::Avx512Bf16TileKernels();
    return internal::Avx512TileKernels();
  }

  // Without room to pack keys, every task reads them in place, and kernels with a packed form
  // of their own (bf16) hand each task to their f32 fallback: all flavours give the f32 answer.
  void Check(const Case& c, const std::string& what, bool room_to_pack = true) {
    const internal::TileKernels* kernels = Kernels();
    if (kernels == nullptr) GTEST_SKIP() << "this CPU lacks " << GetParam();
    Problem pr;
    Build(c, pr);
    pr.bf16_operands = GetParam() == "avx512_bf16" && room_to_pack;
    internal::RunAttentionWith(pr.p, *kernels,
                               room_to_pack ? std::numeric_limits<int64_t>::max() : 0);
    ExpectMatchesReference(pr, what, pr.bf16_operands ? kBf16Tolerance : kTolerance);
  }
};

// Lengths around every block size the kernel has: 16-row vectors, 48-row tiles, 8-key tiles,
// 64-key softmax blocks.
const std::vector<int64_t> kBoundaryLengths = {0,  1,  7,  8,  9,  15, 16, 17,  31,  32, 33,
                                               47, 48, 49, 63, 64, 65, 96, 127, 128, 129};

TEST_P(AttentionKernelTest, SelfAttentionAtBlockBoundaries) {
  for (bool causal : {false, true}) {
    for (bool probs : {false, true}) {
      Case c;
      c.q_lengths = kBoundaryLengths;
      c.kv_lengths = kBoundaryLengths;
      c.causal = causal;
      c.fused = true;
      c.probs = probs;
      c.seed = 11 + causal * 2 + probs;
      Check(c, "self causal=" + std::to_string(causal) + " probs=" + std::to_string(probs));
    }
  }
}

TEST_P(AttentionKernelTest, CrossAttentionWithDifferentLengths) {
  for (bool causal : {false, true}) {
    Case c;
    // Queries longer than keys and the reverse; key length 0 gives rows with no visible key.
    c.q_lengths = {1, 17, 65, 100, 48, 30, 5, 49};
    c.kv_lengths = {64, 9, 129, 33, 0, 200, 1, 48};
    c.num_heads = 3;
    c.causal = causal;
    c.probs = true;
    c.seed = 21 + causal;
    Check(c, "cross causal=" + std::to_string(causal));
  }
}

TEST_P(AttentionKernelTest, OddHeadSizes) {
  for (int64_t head_dim : {1, 3, 8, 13, 24, 80, 128}) {
    for (bool causal : {false, true}) {
      Case c;
      c.q_lengths = {49, 3, 70};
      c.kv_lengths = {49, 3, 70};
      c.num_heads = 3;
      c.head_dim = head_dim;
      c.causal = causal;
      c.fused = true;
      c.probs = head_dim == 13;
      c.seed = static_cast<uint32_t>(31 + head_dim + causal);
      Check(c, "head_dim=" + std::to_string(head_dim) + " causal=" + std::to_string(causal));
    }
  }
}

TEST_P(AttentionKernelTest, SharpSoftmaxKeepsPrecision) {
  // Unscaled scores spanning about +-25 (weights from 1 down to 1e-20): exercises the running
  // max being replaced mid-sequence. Sharper still and float32 rounding of the scores alone
  // exceeds the tolerance, in PyTorch as here.
  Case c;
  c.q_lengths = {130, 64};
  c.kv_lengths = {200, 190};
  c.scale = 1.0f;
  c.probs = true;
  c.seed = 41;
  Check(c, "sharp");
  c.causal = true;
  Check(c, "sharp causal");
}

TEST_P(AttentionKernelTest, EmptyBatchAndEmptySequencesWriteNothingWrong) {
  Case c;
  c.q_lengths = {0, 0, 3};
  c.kv_lengths = {5, 0, 0};
  c.probs = true;
  Check(c, "empty");
}

// Scores that overflow float32 (queries and keys near 1e20) leave their row not finite (NaN or
// infinite), so that the layer's finiteness check refuses the call, rather than a finite answer
// without the keys whose scores overflowed: a score of +inf (sequence 0), a NaN from products of
// both signs (sequence 1; their exact sum overflows too), every score -inf (sequence 2). The keys
// that overflow lie in the second 64-key block; the rows of the other sequences stay finite.
TEST_P(AttentionKernelTest, ScoresThatOverflowFloat32LeaveTheirRowNotFinite) {
  const internal::TileKernels* kernels = Kernels();
  if (kernels == nullptr) GTEST_SKIP() << "this CPU lacks " << GetParam();
  Case c;
  c.q_lengths = {20, 20, 20, 20};
  c.kv_lengths = {70, 70, 70, 70};
  c.num_heads = 1;
  c.head_dim = 16;
  c.seed = 81;
  Problem pr;
  Build(c, pr);
  const AttentionProblem& p = pr.p;
  constexpr int64_t kRow = 5, kKey = 66;
  auto q_row = [&](int64_t b) { return pr.qkv.data() + (p.q_offsets[b] + kRow) * p.q_stride; };
  auto k_row = [&](int64_t b, int64_t j) {
    return pr.kv.data() + (p.kv_offsets[b] + j) * p.k_stride;
  };
  for (int64_t b = 0; b < 3; ++b) {
    for (int64_t d = 0; d < c.head_dim; ++d) q_row(b)[d] = b == 1 && d >= 12 ? -1e20f : 1e20f;
  }
  for (int64_t d = 0; d < c.head_dim; ++d) {
    k_row(0, kKey)[d] = 1e20f;
    k_row(1, kKey)[d] = 1e20f;
    for (int64_t j = 0; j < c.kv_lengths[2]; ++j) k_row(2, j)[d] = -1e20f;
  }
  internal::RunAttentionWith(p, *kernels, std::numeric_limits<int64_t>::max());
  auto row_finite = [&](int64_t b, int64_t i) {
    const float* out = pr.out.data() + (p.q_offsets[b] + i) * p.out_stride;
    return std::all_of(out, out + c.head_dim, [](float x) { return std::isfinite(x); });
  };
  for (int64_t b = 0; b < 4; ++b) {
    for (int64_t i = 0; i < c.q_lengths[b]; ++i) {
      EXPECT_EQ(row_finite(b, i), b == 3 || i != kRow) << "sequence " << b << " row " << i;
    }
  }
}

TEST_P(AttentionKernelTest, LongCausalSequence) {
  // 4096 tokens: the oracle works row by row, never holding [S, S].
  Case c;
  c.q_lengths = {4096};
  c.kv_lengths = {4096};
  c.num_heads = 1;
  c.causal = true;
  c.fused = true;
  c.seed = 51;
  Check(c, "long causal");
}

TEST_P(AttentionKernelTest, KeysThatDoNotFitTheScratchAreReadInPlace) {
  // Long sequences (a long one alone has no room in a many-threaded team's scratch): tasks of
  // several 48-row tiles, which would otherwise share a packed copy, and block-unaligned keys.
  for (bool causal : {false, true}) {
    Case c;
    c.q_lengths = {200, 65, 130};
    c.kv_lengths = {200, 300, 65};
    c.num_heads = 3;
    c.causal = causal;
    c.probs = true;
    c.seed = 71 + causal;
    Check(c, "in place causal=" + std::to_string(causal), /*room_to_pack=*/false);
  }
}

INSTANTIATE_TEST_SUITE_P(Flavours, AttentionKernelTest,
                         ::testing::Values("portable", "avx512", "avx512_bf16"),
                         [](const auto& info) { return info.param; });

TEST(AttentionKernelDispatchTest, RunAttentionMatchesTheOracle) {
  Case c;
  c.q_lengths = {100, 37};
  c.kv_lengths = {100, 37};
  c.causal = true;
  c.fused = true;
  c.probs = true;
  Problem pr;
  Build(c, pr);
  RunAttention(pr.p);
  ExpectMatchesReference(pr, "RunAttention");
}

TEST(AttentionKernelDispatchTest, ConcurrentCallersDoNotShareScratch) {
  // Several models' workers may call RunAttention at once, each with its own OpenMP team.
  Case a;
  a.q_lengths = {300, 77};
  a.kv_lengths = {300, 77};
  a.causal = true;
  a.fused = true;
  a.seed = 61;
  Case b;
  b.q_lengths = {129};
  b.kv_lengths = {450};
  b.num_heads = 4;
  b.head_dim = 24;
  b.seed = 62;
  Problem pa, pb;
  Build(a, pa);
  Build(b, pb);
  std::thread ta([&] {
    for (int i = 0; i < 3; ++i) RunAttention(pa.p);
  });
  std::thread tb([&] {
    for (int i = 0; i < 3; ++i) RunAttention(pb.p);
  });
  ta.join();
  tb.join();
  ExpectMatchesReference(pa, "concurrent a");
  ExpectMatchesReference(pb, "concurrent b");
}

TEST(AttentionKernelDispatchTest, ScratchGrowsLinearlyWithSequenceLength) {
  // 32768 causal tokens, 8 heads of 64: the per-thread scratch is a few tiles and one head's
  // keys and values (16 MiB), not [S, S] (4 GiB).
  std::vector<int64_t> lengths = {32768}, offsets = {0};
  AttentionProblem p;
  p.q_lengths = lengths;
  p.q_offsets = offsets;
  p.kv_lengths = lengths;
  p.kv_offsets = offsets;
  p.num_heads = 8;
  p.head_dim = 64;
  p.causal = true;
  EXPECT_LT(AttentionScratchBytes(p), int64_t{20} << 20);
}

}  // namespace
}  // namespace attnserve::core
