#include "core/weights.h"

#include <cmath>
#include <map>
#include <set>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/guarded.h"
#include "core/safetensors.h"

namespace attnserve::core {
namespace {

// Large enough for any real attention layer, small enough that products of two dimensions
// never overflow int64 and a corrupt spec is refused before anything is allocated.
constexpr int64_t kMaxDimension = int64_t{1} << 20;

absl::Status CheckDimension(const char* name, int64_t value) {
  if (value <= 0 || value > kMaxDimension) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer spec: ", name, " is ", value, ", expected 1..", kMaxDimension));
  }
  return absl::OkStatus();
}

absl::Status CheckSpec(const LayerSpec& spec) {
  for (const auto& [name, value] :
       {std::pair{"d_model", spec.d_model}, std::pair{"d_context", spec.d_context},
        std::pair{"num_heads", spec.num_heads}, std::pair{"head_dim", spec.head_dim}}) {
    if (absl::Status s = CheckDimension(name, value); !s.ok()) return s;
  }
  return CheckDimension("inner width (num_heads * head_dim)", spec.inner());
}

// A matrix or bias must have exactly `expected` finite values; a NaN or infinity in a weight
// would silently poison every output, so it is refused at load rather than served.
absl::Status CheckBuffer(const char* name, const std::vector<float>& values, int64_t expected) {
  if (static_cast<int64_t>(values.size()) != expected) {
    return absl::InvalidArgumentError(absl::StrCat("layer weights: ", name, " has ", values.size(),
                                                   " values, expected ", expected));
  }
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer weights: ", name, " has a non-finite value at index ", i));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckWeights(const LayerWeights& weights) {
  const LayerSpec& spec = weights.spec;
  if (absl::Status s = CheckSpec(spec); !s.ok()) return s;
  const int64_t inner = spec.inner();
  const int64_t bias_inner = spec.has_bias ? inner : 0;
  const bool out = spec.has_output_projection;
  const int64_t bias_out = out && spec.has_bias ? spec.d_model : 0;
  const struct {
    const char* name;
    const std::vector<float>& values;
    int64_t expected;
  } buffers[] = {
      {"w_q", weights.w_q, inner * spec.d_model},           {"b_q", weights.b_q, bias_inner},
      {"w_k", weights.w_k, inner * spec.d_context},         {"b_k", weights.b_k, bias_inner},
      {"w_v", weights.w_v, inner * spec.d_context},         {"b_v", weights.b_v, bias_inner},
      {"w_o", weights.w_o, out ? spec.d_model * inner : 0}, {"b_o", weights.b_o, bias_out},
  };
  for (const auto& buffer : buffers) {
    if (absl::Status s = CheckBuffer(buffer.name, buffer.values, buffer.expected); !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// The layout loader. Tensors under the prefix are the layer's: each layout takes the ones it
// knows and any left over is refused, because a stray tensor usually means the wrong prefix or
// a layout we would misread. Tensors outside the prefix belong to the rest of a bigger model
// and are ignored (not even read).

namespace {

// The file's tensors under the prefix, by their names with the prefix stripped; records which
// ones a layout took so the rest can be refused.
class TensorSet {
 public:
  TensorSet(std::string path, std::string prefix, std::map<std::string, StoredTensor> tensors)
      : path_(std::move(path)), prefix_(std::move(prefix)), tensors_(std::move(tensors)) {}

  bool Has(const std::string& name) const { return tensors_.count(name) > 0; }

  // The rank-`rank` tensor `name`, marked as used; refused if it holds a NaN or an infinity.
  absl::StatusOr<const StoredTensor*> Take(const std::string& name, size_t rank) {
    auto it = tensors_.find(name);
    if (it == tensors_.end()) return Error(name, "is missing");
    used_.insert(name);
    if (it->second.shape.size() != rank) {
      return Error(name, absl::StrCat("has shape ", ShapeText(it->second.shape), ", expected ",
                                      rank == 1 ? "a vector" : "a matrix"));
    }
    const std::vector<float>& values = it->second.values;
    for (size_t i = 0; i < values.size(); ++i) {
      if (!std::isfinite(values[i])) {
        return Error(name, absl::StrCat("has a non-finite value at index ", i));
      }
    }
    return &it->second;
  }

  // A refusal naming the file and the tensor as the file spells it.
  absl::Status Error(const std::string& name, const std::string& what) const {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": tensor '", NameForMessage(prefix_ + name), "' ", what));
  }

  absl::Status FileError(const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": ", what));
  }

  absl::Status CheckAllUsed(WeightLayout layout) const {
    for (const auto& [name, tensor] : tensors_) {
      if (used_.count(name) == 0) {
        return Error(name, absl::StrCat("is unexpected in the ", std::string(LayoutName(layout)),
                                        " layout"));
      }
    }
    return absl::OkStatus();
  }

  // The first few names (clipped) and how many there are: a file may hold thousands.
  std::string NamesText() const {
    constexpr size_t kMaxListed = 8;
    std::vector<std::string> names;
    for (const auto& [name, tensor] : tensors_) {
      if (names.size() == kMaxListed) break;
      names.push_back(NameForMessage(prefix_ + name));
    }
    if (tensors_.size() > kMaxListed) {
      names.push_back(absl::StrCat("... ", tensors_.size() - kMaxListed, " more"));
    }
    return absl::StrCat("[", absl::StrJoin(names, ", "), "]");
  }

  static std::string ShapeText(const std::vector<int64_t>& shape) {
    return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
  }

 private:
  std::string path_;
  std::string prefix_;
  std::map<std::string, StoredTensor> tensors_;
  std::set<std::string> used_;
};

// One nn.Linear of the file, maybe fused: `parts` equal row blocks stacked (q, k, v order).
struct Linear {
  const StoredTensor* weight = nullptr;
  const StoredTensor* bias = nullptr;  // null when the file has none
  int64_t parts = 1;

  int64_t out() const { return weight->shape[0] / parts; }
  int64_t in() const { return weight->shape[1]; }

  // Rows [part*out, (part+1)*out) of the weight and the matching bias entries.
  void CopyPart(int64_t part, std::vector<float>& w, std::vector<float>& b) const {
    const auto first = weight->values.begin() + part * out() * in();
    w.assign(first, first + out() * in());
    if (bias == nullptr) return b.clear();
    const auto bias_first = bias->values.begin() + part * out();
    b.assign(bias_first, bias_first + out());
  }
};

// Takes `weight_name` (a matrix whose rows split into `parts`) and, if present, `bias_name`.
absl::StatusOr<Linear> TakeLinear(TensorSet& set, const std::string& weight_name,
                                  const std::string& bias_name, int64_t parts) {
  Linear linear;
  linear.parts = parts;
  absl::StatusOr<const StoredTensor*> weight = set.Take(weight_name, 2);
  if (!weight.ok()) return weight.status();
  linear.weight = *weight;
  if ((*weight)->shape[0] % parts != 0 || (*weight)->shape[0] == 0) {
    return set.Error(weight_name, absl::StrCat("has ", (*weight)->shape[0], " rows, expected a ",
                                               "positive multiple of ", parts, " (fused parts)"));
  }
  if ((*weight)->shape[1] == 0) return set.Error(weight_name, "has no columns");
  if (!set.Has(bias_name)) return linear;
  absl::StatusOr<const StoredTensor*> bias = set.Take(bias_name, 1);
  if (!bias.ok()) return bias.status();
  if ((*bias)->shape[0] != (*weight)->shape[0]) {
    return set.Error(
        bias_name, absl::StrCat("has shape ", TensorSet::ShapeText((*bias)->shape), ", expected [",
                                (*weight)->shape[0], "] to match '", weight_name, "'"));
  }
  linear.bias = *bias;
  return linear;
}

// What a layout found: the projections in q, k, v order (a fused one listed once per part) and
// the output projection, with their names for messages.
struct Projections {
  Linear q, k, v;
  int64_t q_part = 0, k_part = 0, v_part = 0;
  std::string q_name, k_name, v_name;
  std::optional<Linear> o;
  std::string o_name;
};

struct LayoutNames {
  WeightLayout layout;
  std::string q, k, v;  // the same name for a fused projection
  std::string o;        // empty: no output projection
  std::string weight_suffix, bias_suffix;
};

// Recognises the layout by any of its input projections' names, so a file that lacks one of
// them is refused as missing that tensor rather than as an unknown layout.
std::optional<LayoutNames> DetectLayout(const TensorSet& set) {
  static const LayoutNames kLayouts[] = {
      {WeightLayout::kSeparate, "W_q", "W_k", "W_v", "", ".weight", ".bias"},
      {WeightLayout::kQueryKeyValue, "w_query", "w_key", "w_value", "", ".weight", ".bias"},
      {WeightLayout::kFusedQkv, "Wqkv", "Wqkv", "Wqkv", "Wo", ".weight", ".bias"},
      {WeightLayout::kQueryKv, "Wq", "Wkv", "Wkv", "Wo", ".weight", ".bias"},
      {WeightLayout::kTorchMha, "in_proj", "in_proj", "in_proj", "out_proj", "_weight", "_bias"},
  };
  for (const LayoutNames& names : kLayouts) {
    for (const std::string& base : {names.q, names.k, names.v}) {
      if (set.Has(base + names.weight_suffix) || set.Has(base + names.bias_suffix)) return names;
    }
  }
  return std::nullopt;
}

// Takes the projections of `names`: q, k and v share a tensor when their names are equal.
absl::StatusOr<Projections> TakeProjections(TensorSet& set, const LayoutNames& names) {
  Projections p;
  const int64_t kv_parts = names.k == names.q ? 3 : (names.k == names.v ? 2 : 1);
  const int64_t q_parts = names.k == names.q ? 3 : 1;
  auto take = [&](const std::string& base, int64_t parts) {
    return TakeLinear(set, base + names.weight_suffix, base + names.bias_suffix, parts);
  };
  absl::StatusOr<Linear> q = take(names.q, q_parts);
  if (!q.ok()) return q.status();
  p.q = *q;
  p.q_name = names.q + names.weight_suffix;
  if (names.k == names.q) {
    p.k = p.v = p.q;
    p.k_part = 1, p.v_part = 2;
  } else {
    absl::StatusOr<Linear> k = take(names.k, kv_parts);
    if (!k.ok()) return k.status();
    p.k = *k;
    p.v_part = kv_parts == 2 ? 1 : 0;
    if (kv_parts == 2) {
      p.v = p.k;
    } else {
      absl::StatusOr<Linear> v = take(names.v, 1);
      if (!v.ok()) return v.status();
      p.v = *v;
    }
  }
  p.k_name = names.k + names.weight_suffix;
  p.v_name = names.v + names.weight_suffix;
  if (names.o.empty()) return p;
  // torch names its output projection "out_proj.weight", not "out_proj_weight".
  const bool torch = names.layout == WeightLayout::kTorchMha;
  absl::StatusOr<Linear> o =
      torch ? TakeLinear(set, "out_proj.weight", "out_proj.bias", 1) : take(names.o, 1);
  if (!o.ok()) return o.status();
  p.o = *o;
  p.o_name = torch ? "out_proj.weight" : names.o + names.weight_suffix;
  return p;
}

// Every projection must agree on the widths, and biases come all or none.
absl::Status CheckAgreement(const TensorSet& set, const Projections& p) {
  const int64_t inner = p.q.out();
  for (const auto& [linear, name] : {std::pair{&p.k, &p.k_name}, std::pair{&p.v, &p.v_name}}) {
    if (linear->out() != inner) {
      return set.Error(*name, absl::StrCat("projects to ", linear->out(), " features, but '",
                                           p.q_name, "' to ", inner));
    }
  }
  if (p.k.in() != p.v.in()) {
    return set.Error(p.v_name, absl::StrCat("reads ", p.v.in(), " features, but '", p.k_name,
                                            "' reads ", p.k.in()));
  }
  if (p.o && (p.o->out() != p.q.in() || p.o->in() != inner)) {
    return set.Error(p.o_name, absl::StrCat("has shape ", TensorSet::ShapeText(p.o->weight->shape),
                                            ", expected [", p.q.in(), ", ", inner, "]"));
  }
  const bool has_bias = p.q.bias != nullptr;
  for (const auto& [linear, name] : {std::pair{&p.k, &p.k_name}, std::pair{&p.v, &p.v_name},
                                     std::pair{p.o ? &*p.o : &p.q, &p.o_name}}) {
    if ((linear->bias != nullptr) != has_bias) {
      return set.Error(*name, has_bias ? "has no bias while the query projection has one"
                                       : "has a bias while the query projection has none");
    }
  }
  return absl::OkStatus();
}

// num_heads from the options (which win) or the file's metadata.
absl::StatusOr<int64_t> ResolveNumHeads(const SafetensorsFile& file, const LoadOptions& options) {
  if (options.num_heads) return *options.num_heads;
  auto it = file.metadata.find("num_heads");
  if (it == file.metadata.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        file.path, ": no num_heads: the file's __metadata__ has none and none was given"));
  }
  int64_t num_heads = 0;
  if (!absl::SimpleAtoi(it->second, &num_heads)) {
    return absl::InvalidArgumentError(absl::StrCat(file.path, ": __metadata__ num_heads '",
                                                   NameForMessage(it->second),
                                                   "' is not an integer"));
  }
  return num_heads;
}

absl::StatusOr<LayerSpec> MakeSpec(const TensorSet& set, const Projections& p, int64_t num_heads,
                                   WeightLayout layout) {
  const int64_t inner = p.q.out();
  if (num_heads <= 0 || inner % num_heads != 0) {
    return set.Error(p.q_name, absl::StrCat("projects to ", inner, " features, which num_heads ",
                                            num_heads, " does not divide"));
  }
  LayerSpec spec;
  spec.d_model = p.q.in();
  spec.d_context = p.k.in();
  spec.num_heads = num_heads;
  spec.head_dim = inner / num_heads;
  spec.has_bias = p.q.bias != nullptr;
  spec.has_output_projection = p.o.has_value();
  spec.layout = layout;
  return spec;
}

// The layer of `set`. With `structure_only` (a set of shapes without values) it stops once the
// layout, the names, the shapes and num_heads are checked, and answers the spec alone.
absl::StatusOr<LayerWeights> BuildWeights(TensorSet& set, const SafetensorsFile& file,
                                          const LoadOptions& options, bool structure_only) {
  std::optional<LayoutNames> names = DetectLayout(set);
  if (!names) {
    return set.FileError(absl::StrCat(
        "unknown layout: expected W_q/W_k/W_v, w_query/w_key/w_value, Wqkv+Wo, Wq+Wkv+Wo or "
        "in_proj_weight+out_proj; found tensors ",
        set.NamesText()));
  }
  absl::StatusOr<Projections> p = TakeProjections(set, *names);
  if (!p.ok()) return p.status();
  if (absl::Status s = set.CheckAllUsed(names->layout); !s.ok()) return s;
  if (absl::Status s = CheckAgreement(set, *p); !s.ok()) return s;
  absl::StatusOr<int64_t> num_heads = ResolveNumHeads(file, options);
  if (!num_heads.ok()) return num_heads.status();
  absl::StatusOr<LayerSpec> spec = MakeSpec(set, *p, *num_heads, names->layout);
  if (!spec.ok()) return spec.status();

  LayerWeights weights;
  weights.spec = *spec;
  if (structure_only) {
    if (absl::Status s = CheckSpec(weights.spec); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(file.path, ": ", s.message()));
    }
    return weights;
  }
  p->q.CopyPart(p->q_part, weights.w_q, weights.b_q);
  p->k.CopyPart(p->k_part, weights.w_k, weights.b_k);
  p->v.CopyPart(p->v_part, weights.w_v, weights.b_v);
  if (p->o) p->o->CopyPart(0, weights.w_o, weights.b_o);
  if (absl::Status s = CheckWeights(weights); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(file.path, ": ", s.message()));
  }
  return weights;
}

// The layer in `file` (read with or without its data), its tensors under the prefix.
absl::StatusOr<LayerWeights> BuildFromFile(SafetensorsFile& file, const LoadOptions& options,
                                           bool structure_only) {
  const std::string& prefix = options.prefix;
  std::map<std::string, StoredTensor> mine;
  for (auto& [name, tensor] : file.tensors) {
    mine.emplace(name.substr(prefix.size()), std::move(tensor));
  }
  if (mine.empty()) {
    // The prefix clipped as names are: a config's may be of any length.
    return absl::InvalidArgumentError(
        absl::StrCat(file.path, ": no tensor", prefix.empty() ? "" : " under the prefix '",
                     NameForMessage(prefix), prefix.empty() ? "" : "'"));
  }
  TensorSet set(file.path, prefix, std::move(mine));
  return BuildWeights(set, file, options, structure_only);
}

absl::StatusOr<LayerWeights> LoadChecked(const std::string& path, const LoadOptions& options) {
  const std::string& prefix = options.prefix;
  auto mine = [&prefix](std::string_view name) { return name.starts_with(prefix); };
  // The structure first, from the header alone: a file refused for a stray, missing or misshapen
  // tensor costs no memory for its data (a sparse file may declare gigabytes it never holds).
  auto structure = [&options](const SafetensorsFile& header) {
    SafetensorsFile shapes = header;  // names and shapes: BuildFromFile takes them
    return BuildFromFile(shapes, options, /*structure_only=*/true).status();
  };
  absl::StatusOr<SafetensorsFile> file = ReadSafetensors(path, mine, structure);
  if (!file.ok()) return file.status();
  return BuildFromFile(*file, options, /*structure_only=*/false);
}

}  // namespace

absl::StatusOr<LayerWeights> LoadLayerWeights(const std::string& path, const LoadOptions& options) {
  return Guarded(path, absl::StatusCode::kInternal, [&] { return LoadChecked(path, options); });
}

}  // namespace attnserve::core
