// The built-in demo layer: a model that exists without any file, so a fresh server can answer
// calls and a client can be tried end to end. Its weights come from a PRNG written here, not
// from <random>, whose distributions differ between standard libraries.
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/weights.h"

namespace attnserve::core {
namespace {

constexpr uint64_t kDemoSeed = 0x5eed'a77e'2026'0001ULL;

// splitmix64: tiny, well mixed, and fully specified, so every machine draws the same numbers.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}

  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }

  // Uniform in [-bound, bound): 53 random bits in double, rounded once to float.
  float Uniform(double bound) {
    const double unit = static_cast<double>(Next() >> 11) * 0x1.0p-53;
    return static_cast<float>((2.0 * unit - 1.0) * bound);
  }

 private:
  uint64_t state_;
};

// Like nn.Linear's default init: weight and bias uniform in ±1/sqrt(fan_in).
void FillLinear(SplitMix64& rng, int64_t out, int64_t in, std::vector<float>& w,
                std::vector<float>& b) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  w.resize(out * in);
  for (float& x : w) x = rng.Uniform(bound);
  b.resize(out);
  for (float& x : b) x = rng.Uniform(bound);
}

}  // namespace

LayerWeights MakeDemoWeights() {
  LayerWeights weights;
  LayerSpec& spec = weights.spec;
  spec.d_model = 256;
  spec.d_context = 256;
  spec.num_heads = 4;
  spec.head_dim = 64;
  spec.has_bias = true;
  spec.has_output_projection = true;
  spec.layout = WeightLayout::kBuiltIn;

  // The drawing order is part of the demo's definition: reordering these changes the model
  // that clients and tests see.
  SplitMix64 rng(kDemoSeed);
  FillLinear(rng, spec.inner(), spec.d_model, weights.w_q, weights.b_q);
  FillLinear(rng, spec.inner(), spec.d_context, weights.w_k, weights.b_k);
  FillLinear(rng, spec.inner(), spec.d_context, weights.w_v, weights.b_v);
  FillLinear(rng, spec.d_model, spec.inner(), weights.w_o, weights.b_o);
  return weights;
}

}  // namespace attnserve::core
