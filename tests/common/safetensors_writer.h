#pragma once

// Writes safetensors files from code, so tests can build good and bad weight files in a temp
// dir instead of committing them. No gtest in it.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace attnserve::test {

// One tensor to write: values are given in f32 and stored as `dtype` ("F32", "F16", "BF16",
// rounded to nearest even); when `raw` is not empty (always, for other dtypes) its bytes are
// stored as they are.
struct TensorToWrite {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;
  std::string dtype = "F32";
  std::string raw;
};

// An F32 tensor of `shape` whose values are a simple deterministic pattern (distinct per `seed`).
TensorToWrite PatternTensor(const std::string& name, const std::vector<int64_t>& shape,
                            int seed = 0, const std::string& dtype = "F32");

// The pieces of a file, so a test can corrupt exactly one of them.
struct SafetensorsParts {
  std::string header;  // the JSON text
  std::string data;    // the data section
};

// Lays out `tensors` back to back with `metadata` as __metadata__ (omitted when empty).
SafetensorsParts MakeSafetensors(const std::vector<TensorToWrite>& tensors,
                                 const std::map<std::string, std::string>& metadata = {});

// Writes length + header + data to `path`; the length is the header's unless `header_length`
// overrides it (to write a lying length).
void WriteSafetensorsFile(const std::string& path, const SafetensorsParts& parts,
                          int64_t header_length = -1);

// Writes `bytes` to `path` as they are.
void WriteBytes(const std::string& path, const std::string& bytes);

// f32 -> f16 / bf16 bits, round to nearest even (the reader's conversions are tested against
// these and against values torch produced).
uint16_t FloatToHalf(float value);
uint16_t FloatToBFloat16(float value);

}  // namespace attnserve::test
