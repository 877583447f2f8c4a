#include "tests/common/golden.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <fstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/safetensors.h"
#include "nlohmann/json.hpp"

namespace attnserve::test {
namespace {

using Json = nlohmann::json;

absl::StatusOr<core::AttentionKind> ParseKind(const std::string& name) {
  for (core::AttentionKind kind :
       {core::AttentionKind::kBidirectional, core::AttentionKind::kCausal,
        core::AttentionKind::kCross, core::AttentionKind::kCausalCross}) {
    if (core::KindName(kind) == name) return kind;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown kind '", name, "'"));
}

// The stored tensor `name` of `data`, checked to hold `size` values.
absl::StatusOr<std::vector<float>> TakeTensor(core::SafetensorsFile& data, const std::string& name,
                                              int64_t size) {
  auto it = data.tensors.find(name);
  if (it == data.tensors.end()) {
    return absl::NotFoundError(absl::StrCat(data.path, ": no tensor '", name, "'"));
  }
  if (static_cast<int64_t>(it->second.values.size()) != size) {
    return absl::InvalidArgumentError(absl::StrCat(data.path, ": tensor '", name, "' has ",
                                                   it->second.values.size(), " values, expected ",
                                                   size));
  }
  return std::move(it->second.values);
}

// The manifest stores the sum PyTorch saw: a formula that drifted from make_fixtures.py's shows
// up here rather than as a puzzling golden mismatch.
absl::StatusOr<GoldenBatch> CheckFormulaSum(const Json& desc, GoldenBatch batch) {
  if (!desc.contains("sum")) return batch;
  double sum = 0.0;
  for (float v : batch.values) sum += v;
  const double expected = desc.at("sum").get<double>();
  if (std::fabs(sum - expected) > 1e-6 * (1.0 + std::fabs(expected))) {
    return absl::InternalError(absl::StrCat("formula input sums to ", sum, ", PyTorch's to ",
                                            expected,
                                            ": FormulaValue and make_fixtures.py differ"));
  }
  return batch;
}

// A padded batch from its manifest description; values from the data file or the formula.
absl::StatusOr<GoldenBatch> MakeBatch(const Json& desc, core::SafetensorsFile& data,
                                      const std::string& tensor, bool formula, double phase) {
  GoldenBatch batch;
  batch.lengths = desc.at("lengths").get<std::vector<int64_t>>();
  batch.batch = static_cast<int64_t>(batch.lengths.size());
  batch.seq_len = desc.at("seq_len").get<int64_t>();
  batch.width = desc.at("width").get<int64_t>();
  const int64_t size = batch.batch * batch.seq_len * batch.width;
  if (!formula) {
    absl::StatusOr<std::vector<float>> values = TakeTensor(data, tensor, size);
    if (!values.ok()) return values.status();
    batch.values = *std::move(values);
    return batch;
  }
  batch.values.assign(size, 0.0f);
  for (int64_t b = 0; b < batch.batch; ++b) {
    for (int64_t t = 0; t < batch.lengths[b]; ++t) {
      float* row = &batch.values[(b * batch.seq_len + t) * batch.width];
      for (int64_t c = 0; c < batch.width; ++c) row[c] = FormulaValue(b, t, c, phase);
    }
  }
  return CheckFormulaSum(desc, batch);
}

absl::Status FillExpectations(const Json& desc, core::SafetensorsFile& data, GoldenCase& c) {
  if (desc.contains("output_rows")) {
    c.output_rows = desc.at("output_rows").get<std::vector<int64_t>>();
  } else {
    for (int64_t r = 0; r < c.input.batch * c.input.seq_len; ++r) c.output_rows.push_back(r);
  }
  absl::StatusOr<std::vector<float>> output =
      TakeTensor(data, "output", static_cast<int64_t>(c.output_rows.size()) * c.d_output);
  if (!output.ok()) return output.status();
  c.expected_output = *std::move(output);
  if (!desc.at("has_probabilities").get<bool>()) return absl::OkStatus();
  absl::StatusOr<std::vector<float>> probs = TakeTensor(
      data, "probabilities", c.input.batch * c.num_heads * c.input.seq_len * c.kv_seq_len());
  if (!probs.ok()) return probs.status();
  c.expected_probabilities = *std::move(probs);
  return absl::OkStatus();
}

absl::StatusOr<GoldenCase> ParseCase(const std::string& dir, const Json& desc) {
  GoldenCase c;
  c.name = desc.at("name").get<std::string>();
  c.weights_path = absl::StrCat(dir, "/", desc.at("weights").get<std::string>());
  c.load_options.prefix = desc.value("prefix", "");
  if (desc.contains("load_num_heads"))
    c.load_options.num_heads = desc.at("load_num_heads").get<int64_t>();
  absl::StatusOr<core::AttentionKind> kind = ParseKind(desc.at("kind").get<std::string>());
  if (!kind.ok()) return kind.status();
  c.kind = *kind;
  c.num_heads = desc.at("num_heads").get<int64_t>();
  c.d_output = desc.at("d_output").get<int64_t>();

  absl::StatusOr<core::SafetensorsFile> data =
      core::ReadSafetensors(absl::StrCat(dir, "/", desc.at("data").get<std::string>()));
  if (!data.ok()) return data.status();
  const bool formula = desc.at("input_source").get<std::string>() == "formula";
  absl::StatusOr<GoldenBatch> input = MakeBatch(desc.at("input"), *data, "input", formula, 0.0);
  if (!input.ok()) return input.status();
  c.input = *std::move(input);
  if (desc.contains("context")) {
    absl::StatusOr<GoldenBatch> context =
        MakeBatch(desc.at("context"), *data, "context", formula, 0.5);
    if (!context.ok()) return context.status();
    c.context = *std::move(context);
  }
  if (absl::Status s = FillExpectations(desc, *data, c); !s.ok()) return s;
  return c;
}

absl::StatusOr<Json> ReadManifest(const std::string& dir) {
  const std::string path = absl::StrCat(dir, "/manifest.json");
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open the manifest"));
  return Json::parse(in);
}

// The case `desc` with its tensors; a failure names the case.
absl::StatusOr<GoldenCase> ParseNamedCase(const std::string& dir, const Json& desc) {
  absl::StatusOr<GoldenCase> c = ParseCase(dir, desc);
  if (!c.ok()) {
    return absl::Status(c.status().code(), absl::StrCat("golden case '", desc.value("name", "?"),
                                                        "': ", c.status().message()));
  }
  return c;
}

absl::StatusOr<std::vector<GoldenCase>> ParseManifest(const std::string& dir) {
  absl::StatusOr<Json> manifest = ReadManifest(dir);
  if (!manifest.ok()) return manifest.status();
  std::vector<GoldenCase> cases;
  for (const Json& desc : manifest->at("cases")) {
    absl::StatusOr<GoldenCase> c = ParseNamedCase(dir, desc);
    if (!c.ok()) return c.status();
    cases.push_back(*std::move(c));
  }
  return cases;
}

absl::StatusOr<std::vector<GoldenCaseEntry>> ParseEntries(const std::string& dir) {
  absl::StatusOr<Json> manifest = ReadManifest(dir);
  if (!manifest.ok()) return manifest.status();
  std::vector<GoldenCaseEntry> entries;
  for (const Json& desc : manifest->at("cases")) {
    GoldenCaseEntry entry;
    entry.name = desc.at("name").get<std::string>();
    absl::StatusOr<core::AttentionKind> kind = ParseKind(desc.at("kind").get<std::string>());
    if (!kind.ok()) return kind.status();
    entry.kind = *kind;
    const Json& input = desc.at("input");
    const auto rows =
        static_cast<int64_t>(input.at("lengths").size()) * input.at("seq_len").get<int64_t>();
    entry.every_row_stored = !desc.contains("output_rows") ||
                             static_cast<int64_t>(desc.at("output_rows").size()) == rows;
    entries.push_back(std::move(entry));
  }
  return entries;
}

// The case `name` of the manifest's list `list` ("cases" or "large_values").
absl::StatusOr<GoldenCase> ParseOneCase(const std::string& dir, const std::string& name,
                                        const std::string& list) {
  absl::StatusOr<Json> manifest = ReadManifest(dir);
  if (!manifest.ok()) return manifest.status();
  for (const Json& desc : manifest->at(list)) {
    if (desc.at("name").get<std::string>() == name) return ParseNamedCase(dir, desc);
  }
  return absl::NotFoundError(
      absl::StrCat(dir, "/manifest.json: no golden case '", name, "' in \"", list, "\""));
}

// `parse`(args...), a manifest that does not match what this code expects (nlohmann throws)
// returned as a Status like every other failure.
template <typename Parse, typename... Args>
auto Guarded(const std::string& dir, Parse parse, const Args&... args)
    -> decltype(parse(dir, args...)) {
  try {
    return parse(dir, args...);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(dir, "/manifest.json: ", e.what()));
  }
}

}  // namespace

std::vector<float> GoldenBatch::Packed() const {
  std::vector<float> packed;
  for (int64_t b = 0; b < batch; ++b) {
    const float* first = &values[b * seq_len * width];
    packed.insert(packed.end(), first, first + lengths[b] * width);
  }
  return packed;
}

std::string FixturesDir() { return ATTNSERVE_FIXTURES_DIR; }

absl::StatusOr<std::vector<GoldenCase>> LoadGoldenCases(const std::string& dir) {
  return Guarded(dir, ParseManifest);
}

absl::StatusOr<std::vector<GoldenCaseEntry>> ListGoldenCases(const std::string& dir) {
  return Guarded(dir, ParseEntries);
}

absl::StatusOr<GoldenCase> LoadGoldenCase(const std::string& name, const std::string& dir) {
  return Guarded(dir, ParseOneCase, name, std::string("cases"));
}

absl::StatusOr<GoldenCase> LoadLargeValuesCase(const std::string& name, const std::string& dir) {
  return Guarded(dir, ParseOneCase, name, std::string("large_values"));
}

float ExpectedRowScale(const GoldenCase& c, int64_t row) {
  float scale = 1.0f;
  for (int64_t k = 0; k < c.d_output; ++k) {
    scale = std::max(scale, std::abs(c.expected_output[row * c.d_output + k]));
  }
  return scale;
}

float FormulaValue(int64_t b, int64_t t, int64_t c, double phase) {
  const double x = 0.013 * static_cast<double>(t + 1) * static_cast<double>(c + 1) +
                   0.7 * static_cast<double>(b) + 0.1 * static_cast<double>(c) + phase;
  return static_cast<float>(std::sin(x));
}

}  // namespace attnserve::test
