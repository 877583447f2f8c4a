#include "tests/common/safetensors_writer.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>

#include "nlohmann/json.hpp"

namespace attnserve::test {
namespace {

void AppendU16(std::string& out, uint16_t bits) {
  out.push_back(static_cast<char>(bits & 0xff));
  out.push_back(static_cast<char>(bits >> 8));
}

std::string Encode(const TensorToWrite& t) {
  if (!t.raw.empty() || (t.dtype != "F32" && t.dtype != "F16" && t.dtype != "BF16")) return t.raw;
  std::string out;
  for (float v : t.values) {
    if (t.dtype == "F32") {
      const uint32_t bits = std::bit_cast<uint32_t>(v);
      for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
    } else {
      AppendU16(out, t.dtype == "F16" ? FloatToHalf(v) : FloatToBFloat16(v));
    }
  }
  return out;
}

}  // namespace

TensorToWrite PatternTensor(const std::string& name, const std::vector<int64_t>& shape, int seed,
                            const std::string& dtype) {
  TensorToWrite t;
  t.name = name;
  t.shape = shape;
  t.dtype = dtype;
  int64_t size = 1;
  for (int64_t d : shape) size *= d;
  for (int64_t i = 0; i < size; ++i) {
    t.values.push_back(static_cast<float>(std::sin(0.37 * static_cast<double>(i) + seed)) * 0.25f);
  }
  return t;
}

SafetensorsParts MakeSafetensors(const std::vector<TensorToWrite>& tensors,
                                 const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  SafetensorsParts parts;
  for (const TensorToWrite& t : tensors) {
    const std::string bytes = Encode(t);
    header[t.name] = {{"dtype", t.dtype},
                      {"shape", t.shape},
                      {"data_offsets", {parts.data.size(), parts.data.size() + bytes.size()}}};
    parts.data += bytes;
  }
  parts.header = header.dump();
  return parts;
}

void WriteSafetensorsFile(const std::string& path, const SafetensorsParts& parts,
                          int64_t header_length) {
  const uint64_t length =
      header_length < 0 ? parts.header.size() : static_cast<uint64_t>(header_length);
  std::string bytes;
  for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>((length >> (8 * i)) & 0xff));
  WriteBytes(path, bytes + parts.header + parts.data);
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

uint16_t FloatToBFloat16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  const uint32_t rounding = 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

uint16_t FloatToHalf(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  const float magnitude = std::fabs(value);
  if (std::isnan(value)) return sign | 0x7e00;
  if (magnitude >= 65520.0f) return sign | 0x7c00;  // rounds to infinity
  if (magnitude < 0x1.0p-14f) {
    // Subnormal: a multiple of 2^-24, rounded to nearest even by nearbyint.
    return sign | static_cast<uint16_t>(std::nearbyint(magnitude * 0x1.0p24f));
  }
  const uint32_t m = bits & 0x7fffffff;
  const uint32_t rounded = m + 0xfff + ((m >> 13) & 1);
  return sign | static_cast<uint16_t>((rounded - (112u << 23)) >> 13);
}

}  // namespace attnserve::test
