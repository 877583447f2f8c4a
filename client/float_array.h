#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace attnserve::client {

// A dense float32 array in C (row-major) order: what .npy files and the wire's Tensor hold.
struct FloatArray {
  std::vector<int64_t> shape;
  std::vector<float> values;

  // Number of elements the shape describes (1 for a scalar's empty shape).
  int64_t ElementCount() const;
  // The shape as "[2, 5, 256]", for messages and printing.
  std::string ShapeString() const;
};

// Elements `shape` describes, or -1 when more than `limit` (or a dimension is negative): checks
// a shape against the data that came with it without overflowing the product.
int64_t BoundedElementCount(const std::vector<int64_t>& shape, int64_t limit);

// Formats any shape as "[2, 5, 256]".
std::string ShapeString(const std::vector<int64_t>& shape);

}  // namespace attnserve::client
