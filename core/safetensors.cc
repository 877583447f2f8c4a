// A safetensors reader of our own: the format is small (8-byte length, JSON header, raw data)
// and owning it lets every malformed file become a Status instead of an exception or a crash.
#include "core/safetensors.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/float16.h"
#include "core/guarded.h"
#include "core/read_only_file.h"
#include "nlohmann/json.hpp"

namespace attnserve::core {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; a big-endian host would need byte swaps");

// The safetensors specification's own limit; it also stops a corrupt length from making us
// allocate gigabytes before we know the file is bad.
constexpr uint64_t kMaxHeaderBytes = 100 * 1024 * 1024;

// Within 100 MB of JSON, a header could still list 50 M dimensions or millions of tensors, which
// parsed cost gigabytes. These bounds hold every real file with room to spare (a layer has 2-8
// tensors, a whole model's file hundreds to a few thousand; PyTorch's weights have rank <= 4)
// and cap what a header can make us build at about 100 MB. Checked on the text, before parsing.
constexpr int64_t kMaxTensors = 16384;
constexpr int64_t kMaxRank = 8;       // items in any list of an entry (shape, offsets)
constexpr int64_t kMaxEntryKeys = 8;  // a tensor's entry has 3 (dtype, shape, offsets)
constexpr int64_t kMaxMetadataEntries = 1024;

using Json = nlohmann::json;

// What the header says about one tensor, before any data is read.
struct TensorEntry {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

absl::Status Invalid(const std::string& path, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": not a valid safetensors file: ", what));
}

absl::Status InvalidTensor(const std::string& path, std::string_view name,
                           const std::string& what) {
  return absl::InvalidArgumentError(
      absl::StrCat(path, ": tensor '", NameForMessage(name), "': ", what));
}

// Bytes per element of every dtype the format defines (0: not a safetensors dtype). Knowing the
// ones we do not convert still lets us check the layout of a file that holds them.
int64_t DtypeBytes(std::string_view dtype) {
  static constexpr std::pair<std::string_view, int64_t> kSizes[] = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
      {"U32", 4},  {"F32", 4}, {"I64", 8}, {"U64", 8},     {"F64", 8}};
  for (const auto& [name, bytes] : kSizes) {
    if (name == dtype) return bytes;
  }
  return 0;
}

bool IsConvertible(std::string_view dtype) {
  return dtype == "F32" || dtype == "F16" || dtype == "BF16";
}

// A JSON value that is a non-negative integer, as a uint64 (nullopt otherwise).
std::optional<uint64_t> AsUnsigned(const Json& value) {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_number_integer() && value.get<int64_t>() >= 0) {
    return static_cast<uint64_t>(value.get<int64_t>());
  }
  return std::nullopt;
}

absl::StatusOr<TensorEntry> ParseEntry(const std::string& path, const std::string& name,
                                       const Json& value) {
  TensorEntry entry;
  entry.name = name;
  if (!value.is_object()) return InvalidTensor(path, name, "header entry is not an object");
  auto dtype = value.find("dtype");
  auto shape = value.find("shape");
  auto offsets = value.find("data_offsets");
  if (dtype == value.end() || !dtype->is_string() || shape == value.end() || !shape->is_array() ||
      offsets == value.end() || !offsets->is_array()) {
    return InvalidTensor(path, name, "header entry needs dtype, shape and data_offsets");
  }
  entry.dtype = dtype->get<std::string>();
  for (const Json& dim : *shape) {
    std::optional<uint64_t> d = AsUnsigned(dim);
    if (!d || *d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return InvalidTensor(path, name, "shape has an entry that is not a non-negative integer");
    }
    entry.shape.push_back(static_cast<int64_t>(*d));
  }
  std::optional<uint64_t> begin, end;
  if (offsets->size() == 2) begin = AsUnsigned((*offsets)[0]), end = AsUnsigned((*offsets)[1]);
  if (!begin || !end || *begin > *end) {
    return InvalidTensor(path, name,
                         "data_offsets must be two integers [begin, end], begin <= end");
  }
  entry.begin = *begin;
  entry.end = *end;
  return entry;
}

// The byte size the shape and dtype imply must be the size the offsets give, computed without
// overflow (a shape like [2^62, 8] must be refused, not wrap around).
absl::Status CheckEntrySize(const std::string& path, const TensorEntry& entry) {
  const int64_t element_bytes = DtypeBytes(entry.dtype);
  if (element_bytes == 0) {
    return InvalidTensor(path, entry.name,
                         absl::StrCat("unknown dtype '", NameForMessage(entry.dtype), "'"));
  }
  uint64_t bytes = static_cast<uint64_t>(element_bytes);
  for (int64_t dim : entry.shape) {
    const uint64_t d = static_cast<uint64_t>(dim);
    if (d != 0 && bytes > std::numeric_limits<uint64_t>::max() / d) {
      return InvalidTensor(path, entry.name, "shape is too large (its byte size overflows)");
    }
    bytes *= d;
  }
  if (bytes != entry.end - entry.begin) {
    return InvalidTensor(path, entry.name,
                         absl::StrCat("shape and dtype need ", bytes, " bytes, data_offsets give ",
                                      entry.end - entry.begin));
  }
  return absl::OkStatus();
}

// Each tensor's data must lie within the file. Checked for every tensor before sizes and
// coverage: a tensor moved past the end (an offset of 1e12) leaves a gap where it should have
// been, and the gap, found first in offset order, was blamed on its innocent neighbour.
absl::Status CheckWithinFile(const std::string& path, const std::vector<TensorEntry>& entries,
                             uint64_t data_bytes, uint64_t file_bytes) {
  for (const TensorEntry& entry : entries) {
    if (entry.end > data_bytes) {
      return InvalidTensor(
          path, entry.name,
          absl::StrCat("its data lies past the end of the file: data_offsets [", entry.begin, ", ",
                       entry.end, "] reach byte ", entry.end,
                       " of the data section, but the file (", file_bytes, " bytes) holds only ",
                       data_bytes, " bytes of data after its header"));
    }
  }
  return absl::OkStatus();
}

// The tensors must tile the data section exactly: no byte shared, no byte unused. Gaps and
// overlaps are how a truncated or hand-edited file shows itself. Every tensor is within the
// data section already (CheckWithinFile).
absl::Status CheckCoverage(const std::string& path, std::vector<TensorEntry>& entries,
                           uint64_t data_bytes) {
  std::sort(entries.begin(), entries.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  uint64_t covered = 0;
  for (const TensorEntry& entry : entries) {
    if (entry.begin < covered) {
      return InvalidTensor(path, entry.name, "data overlaps the previous tensor's");
    }
    if (entry.begin > covered) {
      return InvalidTensor(
          path, entry.name,
          absl::StrCat("bytes ", covered, "..", entry.begin, " belong to no tensor"));
    }
    covered = entry.end;
  }
  if (covered != data_bytes) {
    return Invalid(path, absl::StrCat("the data section has ", data_bytes - covered,
                                      " trailing bytes that belong to no tensor"));
  }
  return absl::OkStatus();
}

std::vector<float> ConvertToFloat(std::string_view dtype, const std::vector<char>& raw) {
  std::vector<float> values;
  if (dtype == "F32") {
    values.resize(raw.size() / 4);
    // An empty vector's data() may be null, and memcpy with a null pointer is undefined even
    // for zero bytes.
    if (!values.empty()) std::memcpy(values.data(), raw.data(), values.size() * 4);
    return values;
  }
  values.resize(raw.size() / 2);
  for (size_t i = 0; i < values.size(); ++i) {
    uint16_t bits;
    std::memcpy(&bits, raw.data() + 2 * i, 2);
    values[i] = dtype == "F16" ? HalfToFloat(bits) : BFloat16ToFloat(bits);
  }
  return values;
}

absl::Status ParseMetadata(const std::string& path, const Json& value,
                           std::map<std::string, std::string>& metadata) {
  if (!value.is_object()) return Invalid(path, "__metadata__ is not an object");
  for (const auto& [key, item] : value.items()) {
    if (!item.is_string()) {
      return Invalid(path,
                     absl::StrCat("__metadata__ '", NameForMessage(key), "' is not a string"));
    }
    metadata[key] = item.get<std::string>();
  }
  return absl::OkStatus();
}

// nlohmann takes a NUL byte for the end of input (ignoring what follows) and builds every level
// of a deeply nested document, or every item of a long list (gigabytes for a 100 MB header): a
// safetensors header has neither. One pass over the text, allocating nothing, refuses them;
// a refusal names the tensor whose entry it is in.
// One nesting level of a header as CheckHeaderText scans it.
struct HeaderLevel {
  int64_t items = 0;
  std::string_view key;  // the last key at this level, as written (escapes not decoded)
};

// The limits on how many items the level at `depth` holds, checked at each ',' or ':' (`at_key`)
// of the scan: tensors at the top, entries of __metadata__ and of a tensor's entry, dimensions
// of a shape.
absl::Status CheckItemCounts(const std::string& path, const HeaderLevel* levels, int depth,
                             bool at_key, bool metadata_seen) {
  const HeaderLevel& level = levels[depth];
  const std::string_view tensor = levels[1].key;
  // At a key we know whether this item is __metadata__; at a comma (a top-level list has no
  // keys) allow for it.
  if (depth == 1 && level.items - (at_key ? metadata_seen : 1) > kMaxTensors) {
    return Invalid(path,
                   absl::StrCat("the header lists more than ", kMaxTensors, " tensors, the limit"));
  }
  if (depth == 2 && tensor == "__metadata__" && level.items > kMaxMetadataEntries) {
    return Invalid(path, absl::StrCat("__metadata__ has more than ", kMaxMetadataEntries,
                                      " entries, the limit"));
  }
  if (depth == 2 && tensor != "__metadata__" && level.items > kMaxEntryKeys) {
    return InvalidTensor(path, tensor,
                         absl::StrCat("header entry has more than ", kMaxEntryKeys, " items"));
  }
  if (depth == 3 && level.items > kMaxRank) {
    return InvalidTensor(
        path, tensor,
        absl::StrCat("'", NameForMessage(levels[2].key), "' has more than ", kMaxRank,
                     " items (a shape has at most ", kMaxRank, " dimensions)"));
  }
  return absl::OkStatus();
}

absl::Status CheckHeaderText(const std::string& path, const std::string& text) {
  constexpr int kMaxDepth = 3;  // {"name": {"shape": [dims]}}
  HeaderLevel levels[kMaxDepth + 1];
  int depth = 0;
  bool in_string = false, escaped = false;
  size_t string_start = 0;
  std::string_view last_string;
  bool metadata_seen = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '\0') return Invalid(path, absl::StrCat("the header has a NUL byte at offset ", i));
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
        last_string = std::string_view(text).substr(string_start, i - string_start);
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
      string_start = i + 1;
    } else if (c == '{' || c == '[') {
      if (++depth > kMaxDepth) {
        return Invalid(path, absl::StrCat("the header nests deeper than the ", kMaxDepth,
                                          " levels of a safetensors header"));
      }
      // An item is counted at its separator or key, so a container starts with one.
      levels[depth] = HeaderLevel{.items = 1, .key = {}};
    } else if (c == '}' || c == ']') {
      if (--depth < 0) return Invalid(path, "the header is not valid JSON (unbalanced brackets)");
    } else if (depth > 0 && (c == ',' || c == ':')) {
      if (c == ',') ++levels[depth].items;
      if (c == ':') levels[depth].key = last_string;
      if (depth == 1 && c == ':' && levels[1].key == "__metadata__") metadata_seen = true;
      absl::Status counts = CheckItemCounts(path, levels, depth, c == ':', metadata_seen);
      if (!counts.ok()) return counts;
    }
  }
  return absl::OkStatus();
}

// Parses the JSON header: metadata into `file`, one entry per tensor into `entries`.
absl::Status ParseHeader(const std::string& path, const std::string& text, SafetensorsFile& file,
                         std::vector<TensorEntry>& entries) {
  if (absl::Status s = CheckHeaderText(path, text); !s.ok()) return s;
  const Json header = Json::parse(text, /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded()) return Invalid(path, "the header is not valid JSON");
  if (!header.is_object()) return Invalid(path, "the header is not a JSON object");
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (absl::Status s = ParseMetadata(path, value, file.metadata); !s.ok()) return s;
      continue;
    }
    absl::StatusOr<TensorEntry> entry = ParseEntry(path, name, value);
    if (!entry.ok()) return entry.status();
    entries.push_back(*std::move(entry));
  }
  return absl::OkStatus();
}

// Checks where the header puts the tensors against the file: within it first (an offset past the
// end is the clearest sign of a truncated or corrupt file, and would otherwise surface as a size
// or a gap), then each size against its shape and dtype, then that they tile the data exactly.
absl::Status CheckLayout(const std::string& path, std::vector<TensorEntry>& entries,
                         uint64_t data_bytes, uint64_t file_bytes) {
  if (absl::Status s = CheckWithinFile(path, entries, data_bytes, file_bytes); !s.ok()) return s;
  for (const TensorEntry& entry : entries) {
    if (absl::Status s = CheckEntrySize(path, entry); !s.ok()) return s;
  }
  return CheckCoverage(path, entries, data_bytes);
}

// Reads the 8-byte length and the header text, refusing lengths the file cannot hold before
// allocating anything for them.
absl::StatusOr<std::string> ReadHeaderText(const std::string& path, const ReadOnlyFile& in,
                                           uint64_t file_bytes) {
  if (file_bytes < 8) {
    return Invalid(path, absl::StrCat("the file has ", file_bytes,
                                      " bytes, fewer than the 8 of the header length"));
  }
  char length_bytes[8];
  if (!in.ReadAt(0, length_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": could not read the header length"));
  }
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) {
    header_bytes = (header_bytes << 8) | static_cast<unsigned char>(length_bytes[i]);
  }
  if (header_bytes > file_bytes - 8) {
    return Invalid(path, absl::StrCat("the header length ", header_bytes,
                                      " is past the end of the file (", file_bytes, " bytes)"));
  }
  if (header_bytes > kMaxHeaderBytes) {
    return Invalid(path, absl::StrCat("the header length ", header_bytes, " exceeds the limit of ",
                                      kMaxHeaderBytes));
  }
  std::string text(header_bytes, '\0');
  if (!in.ReadAt(8, text)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": could not read the header"));
  }
  return text;
}

// `entry` in `file`, with its dtype and shape (no values yet).
absl::Status AddTensor(const std::string& path, const TensorEntry& entry, SafetensorsFile& file) {
  if (!IsConvertible(entry.dtype)) {
    return InvalidTensor(path, entry.name,
                         absl::StrCat("unsupported dtype '", NameForMessage(entry.dtype),
                                      "' (attnserve reads F32, F16 and BF16)"));
  }
  StoredTensor& tensor = file.tensors[entry.name];
  tensor.dtype = entry.dtype;
  tensor.shape = entry.shape;
  return absl::OkStatus();
}

// `entry`'s data, read and converted into its tensor in `file`.
absl::Status ReadTensorData(const std::string& path, const ReadOnlyFile& in, uint64_t data_start,
                            const TensorEntry& entry, SafetensorsFile& file) {
  std::vector<char> raw(entry.end - entry.begin);
  if (!in.ReadAt(data_start + entry.begin, raw)) {
    return InvalidTensor(path, entry.name, "read failed");
  }
  file.tensors[entry.name].values = ConvertToFloat(entry.dtype, raw);
  return absl::OkStatus();
}

absl::StatusOr<SafetensorsFile> ReadChecked(const std::string& path, const TensorFilter& wanted,
                                            const StructureCheck& check) {
  absl::StatusOr<ReadOnlyFile> in = ReadOnlyFile::Open(path, "not a valid safetensors file");
  if (!in.ok()) return in.status();
  const uint64_t file_bytes = in->size();

  absl::StatusOr<std::string> text = ReadHeaderText(path, *in, file_bytes);
  if (!text.ok()) return text.status();
  SafetensorsFile file;
  file.path = path;
  std::vector<TensorEntry> entries;
  if (absl::Status s = ParseHeader(path, *text, file, entries); !s.ok()) return s;
  const uint64_t data_start = 8 + text->size();
  if (absl::Status s = CheckLayout(path, entries, file_bytes - data_start, file_bytes); !s.ok()) {
    return s;
  }
  std::erase_if(entries, [&](const TensorEntry& entry) { return wanted && !wanted(entry.name); });
  for (const TensorEntry& entry : entries) {
    if (absl::Status s = AddTensor(path, entry, file); !s.ok()) return s;
  }
  if (check) {
    if (absl::Status s = check(file); !s.ok()) return s;
  }
  for (const TensorEntry& entry : entries) {
    if (absl::Status s = ReadTensorData(path, *in, data_start, entry, file); !s.ok()) return s;
  }
  return file;
}

}  // namespace

std::string NameForMessage(std::string_view name) {
  constexpr size_t kMaxBytes = 100;
  if (name.size() <= kMaxBytes) return std::string(name);
  size_t cut = kMaxBytes;
  // Back up to a UTF-8 character boundary, so the clipped name is still text.
  while (cut > 0 && (static_cast<unsigned char>(name[cut]) & 0xc0) == 0x80) --cut;
  return absl::StrCat(absl::string_view(name.data(), cut), "... (", name.size(), " bytes)");
}

absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path) {
  return ReadSafetensors(path, TensorFilter(), StructureCheck());
}

// nlohmann may still throw on a file we failed to foresee: the file is at fault.
absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path, const TensorFilter& wanted,
                                                const StructureCheck& check) {
  return Guarded(path, absl::StatusCode::kInvalidArgument,
                 [&] { return ReadChecked(path, wanted, check); });
}

}  // namespace attnserve::core
