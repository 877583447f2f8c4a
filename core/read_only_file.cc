#include "core/read_only_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace attnserve::core {
namespace {

// The status code of a failed open. A path that names nothing is NotFound, one that cannot be
// resolved as written (a symlink loop, too long) InvalidArgument, where absl says
// FailedPrecondition and Unknown; the rest (PermissionDenied, ResourceExhausted...) are absl's.
absl::StatusCode OpenErrorCode(int error_number) {
  switch (error_number) {
    case ENOENT:
    case ENOTDIR:
      return absl::StatusCode::kNotFound;
    case ELOOP:
    case ENAMETOOLONG:
      return absl::StatusCode::kInvalidArgument;
    default:
      return absl::ErrnoToStatusCode(error_number);
  }
}

// Why `path` could not be reached or opened, in the system's words: a symlink loop, a directory
// we may not enter and a path through a regular file once all read "no such file", which sent
// users looking for a typo.
absl::Status OpenError(const std::string& path, int error_number) {
  if (error_number == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
  std::string reason = std::generic_category().message(error_number);
  // strerror capitalises ("Permission denied"); here it is the end of a sentence.
  if (!reason.empty()) reason[0] = absl::ascii_tolower(static_cast<unsigned char>(reason[0]));
  return absl::Status(OpenErrorCode(error_number),
                      absl::StrCat(path, ": cannot open the file: ", reason));
}

}  // namespace

absl::StatusOr<ReadOnlyFile> ReadOnlyFile::Open(const std::string& path, const std::string& what) {
  // O_NONBLOCK: a FIFO's open returns at once (and is then refused); a regular file's reads
  // ignore it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return OpenError(path, errno);
  struct stat info;
  if (::fstat(fd, &info) != 0) {
    const int error_number = errno;
    ::close(fd);
    return OpenError(path, error_number);
  }
  if (!S_ISREG(info.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", what, ": it is not a regular file"));
  }
  return ReadOnlyFile(fd, static_cast<uint64_t>(info.st_size));
}

ReadOnlyFile::ReadOnlyFile(ReadOnlyFile&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), size_(other.size_) {}

ReadOnlyFile& ReadOnlyFile::operator=(ReadOnlyFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    size_ = other.size_;
  }
  return *this;
}

ReadOnlyFile::~ReadOnlyFile() {
  if (fd_ >= 0) ::close(fd_);
}

bool ReadOnlyFile::ReadAt(uint64_t offset, std::span<char> out) const {
  while (!out.empty()) {
    const ssize_t n = ::pread(fd_, out.data(), out.size(), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;  // an error, or the file ended (it shrank since it was opened)
    out = out.subspan(static_cast<size_t>(n));
    offset += static_cast<uint64_t>(n);
  }
  return true;
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path, const std::string& what,
                                          uint64_t max_bytes) {
  absl::StatusOr<ReadOnlyFile> file = ReadOnlyFile::Open(path, what);
  if (!file.ok()) return file.status();
  if (file->size() > max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", what, ": it has ", file->size(),
                                                   " bytes, more than the ", max_bytes,
                                                   " it may have"));
  }
  std::string text(file->size(), '\0');
  if (!file->ReadAt(0, text)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", what, ": could not read it whole"));
  }
  return text;
}

}  // namespace attnserve::core
