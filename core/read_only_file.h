#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace attnserve::core {

// A regular file open for reading. Its type is checked on the open descriptor, not on the path:
// a path checked and then opened may name a FIFO by then (a rename is enough), and opening a
// FIFO blocks until a writer comes, which would hold a loader thread, and a drain, for good.
class ReadOnlyFile {
 public:
  // `path` opened, or why not in the system's words (the status code as the error says: NotFound,
  // PermissionDenied...); anything but a regular file is refused InvalidArgument, `what` naming
  // what the file was to be ("not a valid safetensors file: it is not a regular file").
  static absl::StatusOr<ReadOnlyFile> Open(const std::string& path, const std::string& what);

  ReadOnlyFile(ReadOnlyFile&& other) noexcept;
  ReadOnlyFile& operator=(ReadOnlyFile&& other) noexcept;
  ReadOnlyFile(const ReadOnlyFile&) = delete;
  ReadOnlyFile& operator=(const ReadOnlyFile&) = delete;
  ~ReadOnlyFile();

  // The size when it was opened.
  uint64_t size() const { return size_; }

  // Fills `out` from `offset` on; false when the file ended first or a read failed.
  bool ReadAt(uint64_t offset, std::span<char> out) const;

 private:
  ReadOnlyFile(int fd, uint64_t size) : fd_(fd), size_(size) {}

  int fd_ = -1;
  uint64_t size_ = 0;
};

// The whole of a small regular file (a config), read as ReadOnlyFile reads; refused
// InvalidArgument past `max_bytes`, before any of it is read.
absl::StatusOr<std::string> ReadWholeFile(const std::string& path, const std::string& what,
                                          uint64_t max_bytes);

}  // namespace attnserve::core
