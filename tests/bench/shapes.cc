#include "tests/bench/shapes.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace attnserve::bench {
namespace {

using core::AttentionKind;

// A shape of `batch` sequences of `length` tokens each (self kinds: keys = queries).
Shape Uniform(std::string name, AttentionKind kind, int64_t batch, int64_t length, int64_t d_model,
              int64_t heads) {
  Shape s;
  s.name = std::move(name);
  s.kind = kind;
  s.d_model = s.d_context = d_model;
  s.heads = heads;
  s.lengths.assign(batch, length);
  s.padded = length;
  s.kv_lengths = s.lengths;
  s.kv_padded = length;
  return s;
}

}  // namespace

uint64_t SplitMix64(uint64_t& state) {
  state += 0x9e3779b97f4a7c15ULL;
  uint64_t z = state;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

std::vector<int64_t> RaggedLengths() {
  uint64_t state = 7;
  std::vector<int64_t> lengths(16);
  for (int64_t& l : lengths) l = 32 + static_cast<int64_t>(SplitMix64(state) % 481);
  return lengths;
}

std::vector<Shape> AllShapes() {
  std::vector<Shape> shapes = {
      Uniform("bert", AttentionKind::kBidirectional, 8, 512, 768, 12),
      Uniform("causal", AttentionKind::kCausal, 4, 1024, 768, 12),
      Uniform("ragged", AttentionKind::kBidirectional, 16, 512, 768, 12),
      Uniform("cross", AttentionKind::kCross, 8, 128, 768, 12),
      Uniform("small", AttentionKind::kBidirectional, 1, 16, 256, 4),
      Uniform("long", AttentionKind::kCausal, 1, 4096, 512, 8),
      Uniform("long32k", AttentionKind::kCausal, 1, 32768, 512, 8),
  };
  // ragged: padded to 512, as a client batching them would send them.
  shapes[2].lengths = shapes[2].kv_lengths = RaggedLengths();
  // cross: 128 queries over 512 context tokens.
  shapes[3].kv_lengths.assign(8, 512);
  shapes[3].kv_padded = 512;
  return shapes;
}

absl::StatusOr<std::vector<Shape>> ParseShapes(const std::string& names) {
  const std::vector<Shape> all = AllShapes();
  std::vector<Shape> chosen;
  for (absl::string_view name : absl::StrSplit(names, ',', absl::SkipEmpty())) {
    auto it = std::find_if(all.begin(), all.end(), [&](const Shape& s) { return s.name == name; });
    if (it == all.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown shape '", name, "' (known: ", ShapeNames(), ")"));
    }
    chosen.push_back(*it);
  }
  return chosen;
}

std::string ShapeNames() {
  std::vector<std::string> names;
  for (const Shape& s : AllShapes()) names.push_back(s.name);
  return absl::StrJoin(names, ",");
}

double UsefulFlops(const Shape& s) {
  const double d = static_cast<double>(s.d_model), inner = d,
               ctx = static_cast<double>(s.d_context);
  const double attention_share = core::IsCausal(s.kind) ? 0.5 : 1.0;
  double flops = 0;
  for (size_t b = 0; b < s.lengths.size(); ++b) {
    const double l = static_cast<double>(s.lengths[b]), k = static_cast<double>(s.kv_lengths[b]);
    flops += 2 * l * d * inner + 4 * k * ctx * inner + attention_share * 4 * l * k * inner +
             2 * l * inner * d;
  }
  return flops;
}

double ProjectionFlops(const Shape& s) {
  const double d = static_cast<double>(s.d_model), ctx = static_cast<double>(s.d_context);
  const double q = std::accumulate(s.lengths.begin(), s.lengths.end(), 0.0);
  const double k = std::accumulate(s.kv_lengths.begin(), s.kv_lengths.end(), 0.0);
  return 2 * q * d * d + 4 * k * ctx * d + 2 * q * d * d;
}

std::vector<float> RandomValues(int64_t count, uint64_t seed) {
  std::vector<float> values(count);
  uint64_t state = seed;
  for (float& v : values) {
    v = static_cast<float>(static_cast<double>(SplitMix64(state) >> 11) * 0x1.0p-52 - 1.0);
  }
  return values;
}

core::LayerWeights RandomWeights(const Shape& shape) {
  core::LayerWeights w;
  core::LayerSpec& spec = w.spec;
  spec.d_model = shape.d_model;
  spec.d_context = shape.d_context;
  spec.num_heads = shape.heads;
  spec.head_dim = shape.d_model / shape.heads;
  spec.has_bias = true;
  spec.has_output_projection = true;
  spec.layout = core::WeightLayout::kFusedQkv;
  const int64_t inner = spec.inner();
  auto scaled = [](int64_t count, uint64_t seed, int64_t fan_in) {
    std::vector<float> v = RandomValues(count, seed);
    const float scale = 1.0f / std::sqrt(static_cast<float>(fan_in));
    for (float& x : v) x *= scale;
    return v;
  };
  w.w_q = scaled(inner * spec.d_model, 21, spec.d_model);
  w.w_k = scaled(inner * spec.d_context, 22, spec.d_context);
  w.w_v = scaled(inner * spec.d_context, 23, spec.d_context);
  w.w_o = scaled(spec.d_model * inner, 24, inner);
  w.b_q = scaled(inner, 25, spec.d_model);
  w.b_k = scaled(inner, 26, spec.d_context);
  w.b_v = scaled(inner, 27, spec.d_context);
  w.b_o = scaled(spec.d_model, 28, inner);
  return w;
}

double MsOf(const std::function<void()>& fn) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::vector<double> AlternatingMedianMs(const std::vector<std::function<void()>>& fns, int reps) {
  for (const auto& fn : fns) fn();
  std::vector<std::vector<double>> ms(fns.size());
  for (int r = 0; r < reps; ++r) {
    for (size_t i = 0; i < fns.size(); ++i) ms[i].push_back(MsOf(fns[i]));
  }
  std::vector<double> medians;
  for (const std::vector<double>& m : ms) medians.push_back(Median(m));
  return medians;
}

}  // namespace attnserve::bench
