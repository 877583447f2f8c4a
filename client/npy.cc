#include "client/npy.h"

#include <bit>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace attnserve::client {
namespace {

// The wire and the files are little-endian; so must the host be for the memcpy below.
static_assert(std::endian::native == std::endian::little, "attnserve assumes a little-endian host");

constexpr absl::string_view kMagic = "\x93NUMPY";
constexpr size_t kAlignment = 64;  // numpy pads the header so the data starts 64-aligned

// The three fields of a .npy header dictionary that matter to us.
struct NpyHeader {
  std::string descr;
  bool fortran_order = false;
  std::vector<int64_t> shape;
};

// Returns the text right after `'key':` in the header dict, or an error naming the key.
absl::StatusOr<absl::string_view> ValueAfterKey(absl::string_view dict, absl::string_view key) {
  const std::string quoted = absl::StrCat("'", key, "'");
  size_t at = dict.find(quoted);
  if (at == absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat("npy header has no '", key, "'"));
  }
  at = dict.find(':', at + quoted.size());
  if (at == absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat("npy header: no value for '", key, "'"));
  }
  return absl::StripLeadingAsciiWhitespace(dict.substr(at + 1));
}

// Parses a Python tuple of non-negative ints such as "(2, 5, 256)" or "(7,)" or "()".
absl::StatusOr<std::vector<int64_t>> ParseShape(absl::string_view text) {
  const size_t close = text.find(')');
  if (text.empty() || text[0] != '(' || close == absl::string_view::npos) {
    return absl::InvalidArgumentError("npy header: 'shape' is not a tuple");
  }
  std::vector<int64_t> shape;
  for (absl::string_view part : absl::StrSplit(text.substr(1, close - 1), ',')) {
    part = absl::StripAsciiWhitespace(part);
    if (part.empty()) continue;  // the trailing comma of "(7,)"
    int64_t dim = 0;
    if (!absl::SimpleAtoi(part, &dim) || dim < 0) {
      return absl::InvalidArgumentError(absl::StrCat("npy header: bad dimension '", part, "'"));
    }
    shape.push_back(dim);
  }
  return shape;
}

absl::StatusOr<NpyHeader> ParseHeader(absl::string_view dict) {
  NpyHeader header;
  absl::StatusOr<absl::string_view> descr = ValueAfterKey(dict, "descr");
  if (!descr.ok()) return descr.status();
  const size_t end = descr->size() > 1 ? descr->find_first_of("'\"", 1) : absl::string_view::npos;
  if (end == absl::string_view::npos) return absl::InvalidArgumentError("npy header: bad 'descr'");
  header.descr = std::string(descr->substr(1, end - 1));

  absl::StatusOr<absl::string_view> fortran = ValueAfterKey(dict, "fortran_order");
  if (!fortran.ok()) return fortran.status();
  header.fortran_order = absl::StartsWith(*fortran, "True");

  absl::StatusOr<absl::string_view> shape = ValueAfterKey(dict, "shape");
  if (!shape.ok()) return shape.status();
  absl::StatusOr<std::vector<int64_t>> dims = ParseShape(*shape);
  if (!dims.ok()) return dims.status();
  header.shape = *std::move(dims);
  return header;
}

// Splits the file into its header dict and its data, by format version.
absl::Status SplitFile(absl::string_view bytes, absl::string_view* dict, absl::string_view* data) {
  if (bytes.size() < 10 || bytes.substr(0, kMagic.size()) != kMagic) {
    return absl::InvalidArgumentError("not a .npy file (bad magic)");
  }
  const auto major = static_cast<uint8_t>(bytes[6]);
  size_t header_len = 0;
  size_t prefix = 0;
  if (major == 1) {
    header_len = static_cast<uint8_t>(bytes[8]) | static_cast<uint8_t>(bytes[9]) << 8;
    prefix = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) return absl::InvalidArgumentError(".npy file truncated in its header");
    uint32_t len32 = 0;
    std::memcpy(&len32, bytes.data() + 8, sizeof(len32));
    header_len = len32;
    prefix = 12;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unsupported .npy format version ", major));
  }
  if (bytes.size() < prefix + header_len) {
    return absl::InvalidArgumentError(".npy file truncated in its header");
  }
  *dict = bytes.substr(prefix, header_len);
  *data = bytes.substr(prefix + header_len);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<FloatArray> ParseNpy(absl::string_view bytes) {
  absl::string_view dict, data;
  if (absl::Status split = SplitFile(bytes, &dict, &data); !split.ok()) return split;
  absl::StatusOr<NpyHeader> header = ParseHeader(dict);
  if (!header.ok()) return header.status();
  if (header->descr != "<f4") {
    return absl::InvalidArgumentError(absl::StrCat(
        "npy dtype '", header->descr, "' is not supported: save little-endian float32 ('<f4'), ",
        "e.g. numpy.save(path, a.astype('<f4'))"));
  }
  if (header->fortran_order) {
    return absl::InvalidArgumentError(
        "npy array is in Fortran order: save a C-order array (numpy.ascontiguousarray)");
  }
  FloatArray array{.shape = header->shape, .values = {}};
  // Count against the data actually present, so a lying shape cannot overflow the product.
  const int64_t count =
      BoundedElementCount(array.shape, static_cast<int64_t>(data.size() / sizeof(float)));
  if (count < 0 || data.size() != static_cast<size_t>(count) * sizeof(float)) {
    return absl::InvalidArgumentError(absl::StrCat("npy data holds ", data.size(),
                                                   " bytes, which shape ", array.ShapeString(),
                                                   " does not describe"));
  }
  array.values.resize(count);
  if (count > 0) std::memcpy(array.values.data(), data.data(), data.size());
  return array;
}

absl::StatusOr<std::string> SerializeNpy(const FloatArray& array) {
  if (array.ElementCount() != static_cast<int64_t>(array.values.size())) {
    return absl::InvalidArgumentError(absl::StrCat("shape ", array.ShapeString(), " does not hold ",
                                                   array.values.size(), " values"));
  }
  std::string shape = "(";
  for (int64_t dim : array.shape) absl::StrAppend(&shape, dim, ", ");
  if (array.shape.size() > 1) shape.resize(shape.size() - 2);  // keep the comma of "(7,)"
  if (array.shape.size() == 1) shape.pop_back();
  absl::StrAppend(&shape, ")");
  std::string dict =
      absl::StrCat("{'descr': '<f4', 'fortran_order': False, 'shape': ", shape, ", }");
  // Pad with spaces and end with a newline so that the data starts on a 64-byte boundary.
  const size_t unpadded = 10 + dict.size() + 1;
  dict.append((kAlignment - unpadded % kAlignment) % kAlignment, ' ');
  dict.push_back('\n');
  if (dict.size() > std::numeric_limits<uint16_t>::max()) {
    return absl::InvalidArgumentError("npy header too long");
  }
  std::string out(kMagic);
  out.push_back('\x01');
  out.push_back('\x00');
  out.push_back(static_cast<char>(dict.size() & 0xff));
  out.push_back(static_cast<char>(dict.size() >> 8));
  out += dict;
  out.append(reinterpret_cast<const char*>(array.values.data()),
             array.values.size() * sizeof(float));
  return out;
}

absl::StatusOr<FloatArray> ReadNpy(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  absl::StatusOr<FloatArray> array = ParseNpy(bytes);
  if (!array.ok()) {
    return absl::Status(array.status().code(), absl::StrCat(path, ": ", array.status().message()));
  }
  return array;
}

absl::Status WriteNpy(const std::string& path, const FloatArray& array) {
  absl::StatusOr<std::string> bytes = SerializeNpy(array);
  if (!bytes.ok()) return bytes.status();
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  if (!file) return absl::PermissionDeniedError(absl::StrCat("cannot write ", path));
  file.write(bytes->data(), static_cast<std::streamsize>(bytes->size()));
  file.close();
  if (!file) return absl::DataLossError(absl::StrCat("writing ", path, " failed"));
  return absl::OkStatus();
}

}  // namespace attnserve::client
