#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/float_array.h"

namespace attnserve::client {

// Parses the bytes of a .npy file (format 1.0, 2.0 or 3.0). Only little-endian float32 in C
// order ('<f4', fortran_order False) is accepted: anything else is INVALID_ARGUMENT naming
// what was found, so a float64 array is converted by its owner instead of silently here.
absl::StatusOr<FloatArray> ParseNpy(absl::string_view bytes);

// Serialises an array as a .npy file (format 1.0, '<f4', C order) that numpy.load reads.
absl::StatusOr<std::string> SerializeNpy(const FloatArray& array);

// Reads a .npy file; NOT_FOUND when it cannot be opened, otherwise as ParseNpy.
absl::StatusOr<FloatArray> ReadNpy(const std::string& path);

// Writes a .npy file, replacing it; the array's shape must match its number of values.
absl::Status WriteNpy(const std::string& path, const FloatArray& array);

}  // namespace attnserve::client
