#pragma once

// The standard benchmark shapes, their random weights and inputs, and the useful
// FLOPs they are credited with. pytorch_bench.py mirrors this file (same lengths, same counts).

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/layer_spec.h"
#include "core/weights.h"

namespace attnserve::bench {

// One benchmark shape: a layer and a padded batch (plus a context for the cross kinds).
struct Shape {
  std::string name;
  core::AttentionKind kind = core::AttentionKind::kBidirectional;
  int64_t d_model = 768;
  int64_t heads = 12;
  int64_t d_context = 768;
  std::vector<int64_t> lengths;     // query lengths
  int64_t padded = 0;               // padded query length
  std::vector<int64_t> kv_lengths;  // key lengths: the context's for cross kinds, else = lengths
  int64_t kv_padded = 0;
};

// The generator shared with pytorch_bench.py (splitmix64): simple enough to copy exactly.
uint64_t SplitMix64(uint64_t& state);

// The 16 lengths of the "ragged" shape: 32 + splitmix64(seed 7) % 481, uniform in [32, 512].
std::vector<int64_t> RaggedLengths();

// Every shape by name: bert, causal, ragged, cross, small, long (the defaults) and long32k.
std::vector<Shape> AllShapes();

// "a,b,c" -> those shapes, InvalidArgument naming an unknown one.
absl::StatusOr<std::vector<Shape>> ParseShapes(const std::string& names);

// The known names, comma-separated (for --help).
std::string ShapeNames();

// Useful FLOPs of one call (padding and masked halves not counted).
double UsefulFlops(const Shape& shape);

// The projections' share of UsefulFlops (Q, K, V and output matmuls).
double ProjectionFlops(const Shape& shape);

// `count` values uniform in [-1, 1) from splitmix64(seed).
std::vector<float> RandomValues(int64_t count, uint64_t seed);

// A fused-layout layer with biases and output projection for `shape`, weights ~ 1/sqrt(fan_in).
core::LayerWeights RandomWeights(const Shape& shape);

// Milliseconds `fn` took.
double MsOf(const std::function<void()>& fn);
// The middle value (the upper of the two middle ones for an even count); `v` not empty.
double Median(std::vector<double> v);

// Medians (ms) of `reps` timed rounds, each round calling every fn once in turn, after one
// untimed warm-up round (JIT, first touch). Alternating the calls makes a load change on the
// shared machine hit all of them alike, so their ratios hold even when absolute times do not.
std::vector<double> AlternatingMedianMs(const std::vector<std::function<void()>>& fns, int reps);

}  // namespace attnserve::bench
