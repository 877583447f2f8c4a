#include "client/float_array.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attnserve::client {

int64_t FloatArray::ElementCount() const {
  int64_t count = 1;
  for (int64_t dim : shape) count *= dim;
  return count;
}

std::string FloatArray::ShapeString() const { return client::ShapeString(shape); }

int64_t BoundedElementCount(const std::vector<int64_t>& shape, int64_t limit) {
  int64_t count = 1;
  for (int64_t dim : shape) {
    if (dim < 0) return -1;
    if (dim > 0 && count > limit / dim) return -1;
    count *= dim;
  }
  return count > limit ? -1 : count;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace attnserve::client
