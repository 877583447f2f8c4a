#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace attnserve::core {

// One tensor of a safetensors file, converted to float32.
struct StoredTensor {
  std::string dtype;  // as stored: "F32", "F16" or "BF16"
  std::vector<int64_t> shape;
  std::vector<float> values;  // row-major, converted to f32
};

// The contents of a safetensors file: an 8-byte little-endian header length, a JSON header
// ({name: {dtype, shape, data_offsets}, "__metadata__": {...}}), then the raw data.
struct SafetensorsFile {
  std::string path;
  std::map<std::string, std::string> metadata;
  std::map<std::string, StoredTensor> tensors;
};

// Reads and checks a whole file. Refuses (InvalidArgument, naming the file and the tensor) a
// short file, a header length past the end, bad JSON, offsets past the end of the file or
// overlapping, a dtype other than F32/F16/BF16, a shape that does not match its byte size.
// A file that cannot be reached or opened is refused with the system's reason ("permission
// denied", "too many levels of symbolic links"), NotFound when the path names nothing,
// PermissionDenied when we may not read it, InvalidArgument for a symlink loop. Bounds that hold
// any real file keep a header from costing more memory than its size: at most 16384 tensors, 8
// dimensions a shape, 1024 __metadata__ entries; messages quote names clipped (NameForMessage).
absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path);

// Says which tensors to read; an empty filter reads them all.
using TensorFilter = std::function<bool(std::string_view name)>;

// Given the file with the wanted tensors' dtypes and shapes and no values yet: an error refuses
// the file before any of its data is read.
using StructureCheck = std::function<absl::Status(const SafetensorsFile& header)>;

// Like the above, but converts only the tensors `wanted` accepts: the others (e.g. the rest of a
// bigger model, in any dtype) are still checked for layout but neither read nor refused. `check`,
// when given, sees the header first (one open, one parse): a loader refuses a file by its
// structure without reading a byte of its data.
absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path, const TensorFilter& wanted,
                                                const StructureCheck& check = {});

// `name` (of a tensor, a key, a dtype: read from a file) as a message quotes it: its first 100
// bytes, marked as cut with its length when longer, since a name in a header may be megabytes.
std::string NameForMessage(std::string_view name);

}  // namespace attnserve::core
