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

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace attnserve::client
