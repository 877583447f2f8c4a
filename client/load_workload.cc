#include "client/load_workload.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <random>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/packing.h"
#include "nlohmann/json.hpp"

namespace attnserve::client {
namespace {

// Default batch of a mixed workload when --random does not give one.
constexpr int32_t kDefaultMixBatch = 8;
// A bigger pool costs memory (every request is kept encoded) and buys nothing.
constexpr int kMaxPool = 4096;

// One request of a mix before its data is made: kind, model and lengths.
struct MixedShape {
  std::string model;
  v1::AttentionKind kind = v1::ATTENTION_KIND_BIDIRECTIONAL;
  std::vector<int32_t> lengths;
  int64_t padded_length = 0;  // >= every length
  std::vector<int32_t> context_lengths;
  int64_t context_padded_length = 0;
};

bool IsCross(v1::AttentionKind kind) {
  return kind == v1::ATTENTION_KIND_CROSS || kind == v1::ATTENTION_KIND_CAUSAL_CROSS;
}

// Draws sequence lengths: uniform in [MIN, MAX] ("MIN:MAX") or one of a list ("16,64,256").
class LengthDistribution {
 public:
  static absl::StatusOr<LengthDistribution> FromFlags(const LoadFlags& flags) {
    LengthDistribution d;
    if (!flags.lengths_uniform.empty() && !flags.lengths_list.empty()) {
      return absl::InvalidArgumentError("give --lengths-uniform or --lengths-list, not both");
    }
    if (!flags.lengths_uniform.empty()) {
      std::vector<std::string> parts = absl::StrSplit(flags.lengths_uniform, ':');
      int lo = 0, hi = 0;
      if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &lo) ||
          !absl::SimpleAtoi(parts[1], &hi) || lo < 0 || hi < lo || hi < 1) {
        return absl::InvalidArgumentError(absl::StrCat("--lengths-uniform '", flags.lengths_uniform,
                                                       "' is not MIN:MAX with 0 <= MIN <= MAX"));
      }
      d.low_ = lo;
      d.high_ = hi;
    } else if (!flags.lengths_list.empty()) {
      absl::StatusOr<std::vector<int32_t>> list = ParseIntList(flags.lengths_list);
      if (!list.ok() || list->empty() ||
          std::any_of(list->begin(), list->end(), [](int32_t n) { return n < 0; }) ||
          *std::max_element(list->begin(), list->end()) < 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--lengths-list '", flags.lengths_list, "' is not a list of lengths like 16,64,256"));
      }
      d.list_ = *std::move(list);
    }
    return d;
  }

  bool empty() const { return high_ == 0 && list_.empty(); }
  int32_t max() const {
    return list_.empty() ? high_ : *std::max_element(list_.begin(), list_.end());
  }
  int32_t Draw(std::mt19937_64& engine) const {
    if (!list_.empty()) {
      return list_[std::uniform_int_distribution<size_t>(0, list_.size() - 1)(engine)];
    }
    return std::uniform_int_distribution<int32_t>(low_, high_)(engine);
  }

 private:
  int32_t low_ = 0, high_ = 0;
  std::vector<int32_t> list_;
};

absl::StatusOr<std::vector<v1::AttentionKind>> ParseKinds(const std::string& text) {
  std::vector<v1::AttentionKind> kinds;
  for (absl::string_view name : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    absl::StatusOr<v1::AttentionKind> kind = ParseKind(name);
    if (!kind.ok())
      return absl::InvalidArgumentError(absl::StrCat("--kinds: ", kind.status().message()));
    kinds.push_back(*kind);
  }
  return kinds;
}

// "B,S" of --random / --context-random, or {0, 0} when not given.
absl::StatusOr<std::pair<int32_t, int32_t>> BatchAndLength(const std::string& text,
                                                           const std::string& flag) {
  if (text.empty()) return std::pair<int32_t, int32_t>{0, 0};
  absl::StatusOr<std::vector<int32_t>> dims = ParseIntList(text);
  if (!dims.ok() || dims->size() != 2 || (*dims)[0] < 1 || (*dims)[1] < 1) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " '", text, "' is not B,S (e.g. 8,128)"));
  }
  return std::pair<int32_t, int32_t>{(*dims)[0], (*dims)[1]};
}

// The pool's shapes from the distribution flags: --random B,S sets the batch and the padded
// length (default 8 and the largest length), --kinds the kinds taken in turn.
absl::StatusOr<std::vector<MixedShape>> ShapesFromFlags(const LoadFlags& flags) {
  absl::StatusOr<LengthDistribution> lengths = LengthDistribution::FromFlags(flags);
  if (!lengths.ok()) return lengths.status();
  std::vector<v1::AttentionKind> kinds;
  if (!flags.kinds.empty()) {
    absl::StatusOr<std::vector<v1::AttentionKind>> parsed = ParseKinds(flags.kinds);
    if (!parsed.ok()) return parsed.status();
    kinds = *std::move(parsed);
  }
  if (kinds.empty()) {
    absl::StatusOr<v1::AttentionKind> kind = ParseKind(flags.call.kind);
    if (!kind.ok()) return kind.status();
    kinds.push_back(*kind);
  }
  absl::StatusOr<std::pair<int32_t, int32_t>> input = BatchAndLength(flags.call.random, "--random");
  if (!input.ok()) return input.status();
  absl::StatusOr<std::pair<int32_t, int32_t>> context =
      BatchAndLength(flags.call.context_random, "--context-random");
  if (!context.ok()) return context.status();
  const int32_t batch = input->first > 0 ? input->first : kDefaultMixBatch;
  const int32_t padded = input->second > 0 ? input->second : std::max(lengths->max(), 1);
  if (!lengths->empty() && lengths->max() > padded) {
    return absl::InvalidArgumentError(
        absl::StrCat("lengths up to ", lengths->max(), " do not fit --random's length ", padded));
  }
  const bool any_cross = std::any_of(kinds.begin(), kinds.end(), IsCross);
  if (any_cross && context->second == 0) {
    return absl::InvalidArgumentError("a mix with cross kinds needs --context-random B,S_ctx");
  }
  std::mt19937_64 engine(flags.call.seed);
  std::vector<MixedShape> shapes(flags.pool);
  for (size_t i = 0; i < shapes.size(); ++i) {
    MixedShape& shape = shapes[i];
    shape.model = flags.call.model;
    shape.kind = kinds[i % kinds.size()];
    shape.padded_length = padded;
    for (int32_t b = 0; b < batch; ++b) {
      shape.lengths.push_back(lengths->empty() ? padded : lengths->Draw(engine));
    }
    if (IsCross(shape.kind)) {
      shape.context_padded_length = context->second;
      shape.context_lengths.assign(batch, context->second);
    }
  }
  return shapes;
}

absl::StatusOr<std::vector<int32_t>> JsonLengths(const nlohmann::json& line, const char* key) {
  std::vector<int32_t> lengths;
  if (!line.contains(key)) return lengths;
  if (!line[key].is_array()) return absl::InvalidArgumentError(absl::StrCat(key, " is not a list"));
  for (const nlohmann::json& n : line[key]) {
    if (!n.is_number_integer() || n.get<int64_t>() < 0 || n.get<int64_t>() > (1 << 24)) {
      return absl::InvalidArgumentError(absl::StrCat(key, " holds ", n.dump(), ", not a length"));
    }
    lengths.push_back(n.get<int32_t>());
  }
  return lengths;
}

// One workload file line: {"kind": "causal", "lengths": [100, 37], "context_lengths": [64, 64],
// "model": "m", "weight": 2}; weight copies go in the pool.
absl::Status ParseWorkloadLine(const std::string& text, const LoadFlags& flags,
                               std::vector<MixedShape>& shapes) {
  const nlohmann::json line = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!line.is_object()) return absl::InvalidArgumentError("not a JSON object");
  MixedShape shape;
  shape.model = line.value("model", flags.call.model);
  absl::StatusOr<v1::AttentionKind> kind = ParseKind(line.value("kind", flags.call.kind));
  if (!kind.ok()) return kind.status();
  shape.kind = *kind;
  absl::StatusOr<std::vector<int32_t>> lengths = JsonLengths(line, "lengths");
  if (!lengths.ok()) return lengths.status();
  if (lengths->empty()) return absl::InvalidArgumentError("needs \"lengths\": [...]");
  shape.lengths = *std::move(lengths);
  shape.padded_length = *std::max_element(shape.lengths.begin(), shape.lengths.end());
  absl::StatusOr<std::vector<int32_t>> context = JsonLengths(line, "context_lengths");
  if (!context.ok()) return context.status();
  if (IsCross(shape.kind) != !context->empty()) {
    return absl::InvalidArgumentError(
        "\"context_lengths\" is for the cross kinds, and needed there");
  }
  shape.context_lengths = *std::move(context);
  if (!shape.context_lengths.empty()) {
    shape.context_padded_length =
        *std::max_element(shape.context_lengths.begin(), shape.context_lengths.end());
  }
  const int64_t weight = line.value("weight", int64_t{1});
  if (weight < 1 || weight > kMaxPool)
    return absl::InvalidArgumentError("weight must be in [1, 4096]");
  for (int64_t i = 0; i < weight; ++i) shapes.push_back(shape);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<MixedShape>> ShapesFromFile(const LoadFlags& flags) {
  std::ifstream in(flags.workload);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open workload file ", flags.workload));
  std::vector<MixedShape> shapes;
  std::string text;
  for (int number = 1; std::getline(in, text); ++number) {
    if (text.find_first_not_of(" \t\r") == std::string::npos || text[0] == '#') continue;
    absl::Status s;
    try {
      s = ParseWorkloadLine(text, flags, shapes);
    } catch (const nlohmann::json::exception& e) {  // a field of the wrong JSON type
      s = absl::InvalidArgumentError(e.what());
    }
    if (!s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(flags.workload, ":", number, ": ", s.message()));
    }
    if (shapes.size() > static_cast<size_t>(kMaxPool)) {
      return absl::InvalidArgumentError(
          absl::StrCat(flags.workload, ": more than ", kMaxPool, " requests (weights included)"));
    }
  }
  if (shapes.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(flags.workload, " holds no request"));
  }
  // Shuffled once (seeded), so the kinds are interleaved and two runs send the same sequence.
  std::shuffle(shapes.begin(), shapes.end(), std::mt19937_64(flags.call.seed));
  return shapes;
}

// Makes the random arrays of one mixed request and encodes it.
absl::StatusOr<WorkItem> MakeItem(const MixedShape& shape, const v1::ModelInfo& model,
                                  const LoadFlags& flags, uint64_t seed) {
  ForwardRequestSpec call;
  call.model = shape.model;
  call.version = flags.call.model_version;  // --model-version: every call of the run
  call.kind = shape.kind;
  absl::StatusOr<Encoding> encoding = ParseEncoding(flags.call.encoding);
  if (!encoding.ok()) return encoding.status();
  call.encoding = *encoding;
  const auto batch = static_cast<int64_t>(shape.lengths.size());
  call.input = RandomArray({batch, shape.padded_length, model.d_model()}, seed);
  call.lengths = shape.lengths;
  if (IsCross(shape.kind)) {
    call.context = RandomArray({static_cast<int64_t>(shape.context_lengths.size()),
                                shape.context_padded_length, model.d_context()},
                               seed + 1);
    call.context_lengths = shape.context_lengths;
  }
  if (flags.call.packed) {
    absl::StatusOr<FloatArray> packed = Pack(call.input, call.lengths);
    if (!packed.ok()) return packed.status();
    call.input = *std::move(packed);
    if (call.context.has_value()) {
      absl::StatusOr<FloatArray> context = Pack(*call.context, call.context_lengths);
      if (!context.ok()) return context.status();
      call.context = *std::move(context);
    }
  }
  absl::StatusOr<v1::ForwardRequest> request = BuildRequest(call);
  if (!request.ok()) return request.status();
  WorkItem item{.request = *std::move(request), .tokens = 0};
  item.tokens = QueryTokens(item.request);
  return item;
}

bool IsMixed(const LoadFlags& flags) {
  return !flags.lengths_uniform.empty() || !flags.lengths_list.empty() || !flags.kinds.empty() ||
         !flags.workload.empty();
}

}  // namespace

absl::StatusOr<std::vector<WorkItem>> BuildWorkload(const ModelFinder& find_model,
                                                    const LoadFlags& flags) {
  if (!IsMixed(flags)) {
    CallFlags call_flags = flags.call;
    if (call_flags.input.empty() && call_flags.random.empty()) call_flags.random = "8,128";
    absl::StatusOr<PreparedCall> prepared = PrepareCall(find_model, call_flags);
    if (!prepared.ok()) return prepared.status();
    absl::StatusOr<v1::ForwardRequest> request = BuildRequest(prepared->call);
    if (!request.ok()) return request.status();
    WorkItem item{.request = *std::move(request), .tokens = 0};
    item.tokens = QueryTokens(item.request);
    return std::vector<WorkItem>{std::move(item)};
  }
  if (!flags.call.input.empty() || !flags.call.context.empty() || !flags.call.lengths.empty()) {
    return absl::InvalidArgumentError(
        "a mixed workload makes its own arrays: no --input, --context or --lengths with it");
  }
  if (!flags.workload.empty() &&
      (!flags.lengths_uniform.empty() || !flags.lengths_list.empty() || !flags.kinds.empty())) {
    return absl::InvalidArgumentError(
        "--workload describes every request: no --lengths-uniform, --lengths-list or --kinds");
  }
  if (flags.pool < 1 || flags.pool > kMaxPool) {
    return absl::InvalidArgumentError(absl::StrCat("--pool must be in [1, ", kMaxPool, "]"));
  }
  absl::StatusOr<std::vector<MixedShape>> shapes =
      flags.workload.empty() ? ShapesFromFlags(flags) : ShapesFromFile(flags);
  if (!shapes.ok()) return shapes.status();
  std::map<std::string, v1::ModelInfo> models;  // widths, asked once per model
  std::vector<WorkItem> work;
  for (size_t i = 0; i < shapes->size(); ++i) {
    const MixedShape& shape = (*shapes)[i];
    if (!models.contains(shape.model)) {
      absl::StatusOr<v1::ModelInfo> model = find_model(shape.model, flags.call.model_version);
      if (!model.ok()) return model.status();
      models[shape.model] = *std::move(model);
    }
    absl::StatusOr<WorkItem> item =
        MakeItem(shape, models[shape.model], flags, flags.call.seed + 2 * i);
    if (!item.ok()) return item.status();
    work.push_back(*std::move(item));
  }
  return work;
}

}  // namespace attnserve::client
