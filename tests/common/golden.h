#pragma once

// The PyTorch golden fixtures of tests/fixtures, loaded into plain structs. Shared by the core
// tests and the service tests (which send the same cases over gRPC), so nothing here depends on
// gtest: every failure is an absl::Status.
//
// tests/fixtures/manifest.json lists the cases; tests/fixtures/make_fixtures.py writes them
// (run by developers with /usr/bin/python3 and PyTorch; tests need no PyTorch). Each case names
// a weights file (loaded with core::LoadLayerWeights and the case's LoadOptions), a kind, a
// padded input with its lengths, for the cross kinds a padded context with its lengths, and the
// expected output (all rows, or selected rows for the long cases) and, where stored, the
// expected attention probabilities. Expectations were computed by PyTorch in float64 from the
// exact (for F16/BF16 files: rounded) weights, so they carry no float32 error of their own.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/layer_spec.h"
#include "core/weights.h"

namespace attnserve::test {

// A padded batch as the fixtures store it: [batch, seq_len, width] row-major plus lengths.
struct GoldenBatch {
  int64_t batch = 0;
  int64_t seq_len = 0;  // padded length
  int64_t width = 0;
  std::vector<int64_t> lengths;
  std::vector<float> values;  // padded rows are 0

  // The valid rows back to back ([sum(lengths), width]), as a packed request carries them.
  std::vector<float> Packed() const;
};

// One golden case: a layer, a call, and what PyTorch answered.
struct GoldenCase {
  std::string name;                // unique, e.g. "fused_mh_f16/causal"
  std::string weights_path;        // absolute path of the safetensors weights file
  core::LoadOptions load_options;  // prefix and, for files without metadata, num_heads
  core::AttentionKind kind = core::AttentionKind::kBidirectional;
  GoldenBatch input;                   // width d_model
  std::optional<GoldenBatch> context;  // width d_context; present exactly for the cross kinds
  int64_t num_heads = 0;
  int64_t d_output = 0;

  // Flat row indices (b * input.seq_len + t) of the padded output whose expectation is stored,
  // in increasing order. Every row (padded rows too, expected 0) for the small cases; a
  // selection (first, last, rows around block boundaries, all valid) for the long ones.
  std::vector<int64_t> output_rows;
  std::vector<float> expected_output;  // [output_rows.size(), d_output]

  // [batch, num_heads, input.seq_len, kv seq_len]; empty when the case stores none.
  std::vector<float> expected_probabilities;

  bool has_probabilities() const { return !expected_probabilities.empty(); }
  // Padded length of the keys: the context's for the cross kinds, else the input's.
  int64_t kv_seq_len() const { return context ? context->seq_len : input.seq_len; }
};

// Where the fixtures live (the source tree's tests/fixtures, compiled in).
std::string FixturesDir();

// Loads every case of `dir`/manifest.json (FixturesDir() by default). Fails with a message
// naming the case when a file is missing or a stored tensor has the wrong shape.
absl::StatusOr<std::vector<GoldenCase>> LoadGoldenCases(const std::string& dir = FixturesDir());

// A case as the manifest lists it, without reading its tensors: enough to choose and name the
// tests of a parameterized suite, which gtest does at every start of the binary (and ctest starts
// it once a test), before any test runs.
struct GoldenCaseEntry {
  std::string name;
  core::AttentionKind kind = core::AttentionKind::kBidirectional;
  bool every_row_stored = false;  // the expected output of every padded row (not a selection)
};

// The cases of `dir`/manifest.json, in its order.
absl::StatusOr<std::vector<GoldenCaseEntry>> ListGoldenCases(
    const std::string& dir = FixturesDir());

// Loads the one case `name` of `dir`/manifest.json, as LoadGoldenCases would.
absl::StatusOr<GoldenCase> LoadGoldenCase(const std::string& name,
                                          const std::string& dir = FixturesDir());

// Loads the case `name` of the manifest's "large_values" list: causal cases whose inputs reach
// 1e17 (scores near 1e34, outputs near 1e17), kept out of the cases every suite runs because their
// expectations hold relative to each row's magnitude, not within an absolute tolerance.
absl::StatusOr<GoldenCase> LoadLargeValuesCase(const std::string& name,
                                               const std::string& dir = FixturesDir());

// The largest expected magnitude of `c`'s stored output row `row`, at least 1: what a large
// values case's tolerance is relative to.
float ExpectedRowScale(const GoldenCase& c, int64_t row);

// The deterministic input of the long cases, which are too big to store:
//   x[b, t, c] = float32(sin(0.013 * (t + 1) * (c + 1) + 0.7 * b + 0.1 * c + phase))
// computed in double and rounded once; phase 0 for the input, 0.5 for the context.
float FormulaValue(int64_t b, int64_t t, int64_t c, double phase);

}  // namespace attnserve::test
