// .npy reading and writing: numpy's own bytes, every rank, and clear refusals.
#include "client/npy.h"

#include <cstring>
#include <fstream>

#include "gtest/gtest.h"
#include "tests/client/process.h"
#include "tests/common/temp_dir.h"

namespace attnserve::client {
namespace {

// A .npy file byte for byte as numpy 1.24 writes np.arange(6, dtype='<f4').reshape(2, 3).
std::string NumpyWritten(const std::string& descr = "<f4", const std::string& fortran = "False",
                         const std::string& shape = "(2, 3)") {
  std::string dict =
      "{'descr': '" + descr + "', 'fortran_order': " + fortran + ", 'shape': " + shape + ", }";
  dict.append(64 - (10 + dict.size() + 1) % 64, ' ');
  dict.push_back('\n');
  std::string bytes = "\x93NUMPY";
  bytes += '\x01';
  bytes += '\x00';
  bytes += static_cast<char>(dict.size() & 0xff);
  bytes += static_cast<char>(dict.size() >> 8);
  bytes += dict;
  for (int i = 0; i < 6; ++i) {
    const float value = static_cast<float>(i);
    bytes.append(reinterpret_cast<const char*>(&value), sizeof(value));
  }
  return bytes;
}

TEST(NpyTest, ReadsWhatNumpyWrites) {
  absl::StatusOr<FloatArray> array = ParseNpy(NumpyWritten());
  ASSERT_TRUE(array.ok()) << array.status();
  EXPECT_EQ(array->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(array->values, (std::vector<float>{0, 1, 2, 3, 4, 5}));
}

TEST(NpyTest, RoundTripsEveryRank) {
  const std::vector<std::vector<int64_t>> shapes = {{},        {7},          {2, 3},
                                                    {2, 5, 4}, {1, 2, 3, 4}, {0, 4}};
  for (const std::vector<int64_t>& shape : shapes) {
    FloatArray array{.shape = shape, .values = {}};
    for (int64_t i = 0; i < array.ElementCount(); ++i) array.values.push_back(0.5f * i - 3);
    absl::StatusOr<std::string> bytes = SerializeNpy(array);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    // numpy aligns the data on 64 bytes; so do we, so that memory-mapping readers are happy.
    const size_t header_len = static_cast<uint8_t>((*bytes)[8]) | static_cast<uint8_t>((*bytes)[9])
                                                                      << 8;
    EXPECT_EQ((10 + header_len) % 64, 0u);
    absl::StatusOr<FloatArray> back = ParseNpy(*bytes);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->shape, shape);
    EXPECT_EQ(back->values, array.values);
  }
}

TEST(NpyTest, WritesNumpysHeaderForOneDimension) {
  absl::StatusOr<std::string> bytes = SerializeNpy({.shape = {7}, .values = std::vector<float>(7)});
  ASSERT_TRUE(bytes.ok());
  EXPECT_NE(bytes->find("'shape': (7,), }"), std::string::npos) << *bytes;
}

TEST(NpyTest, ReadsFormatVersionTwo) {
  std::string v1 = NumpyWritten();
  const uint16_t header_len = static_cast<uint8_t>(v1[8]) | static_cast<uint8_t>(v1[9]) << 8;
  std::string v2 = v1.substr(0, 6) + std::string("\x02\x00", 2);
  const uint32_t len32 = header_len;
  v2.append(reinterpret_cast<const char*>(&len32), 4);
  v2 += v1.substr(10);
  absl::StatusOr<FloatArray> array = ParseNpy(v2);
  ASSERT_TRUE(array.ok()) << array.status();
  EXPECT_EQ(array->values[5], 5.0f);
}

TEST(NpyTest, RefusesOtherDtypesNamingThem) {
  for (const std::string descr : {"<f8", ">f4", "<i4", "<f2"}) {
    absl::StatusOr<FloatArray> array = ParseNpy(NumpyWritten(descr));
    ASSERT_EQ(array.status().code(), absl::StatusCode::kInvalidArgument) << descr;
    EXPECT_NE(array.status().message().find(descr), absl::string_view::npos);
  }
}

TEST(NpyTest, RefusesFortranOrder) {
  EXPECT_EQ(ParseNpy(NumpyWritten("<f4", "True")).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(NpyTest, RefusesBrokenFiles) {
  const std::string good = NumpyWritten();
  EXPECT_FALSE(ParseNpy("").ok());
  EXPECT_FALSE(ParseNpy("PK\x03\x04 not an npy file").ok());
  EXPECT_FALSE(ParseNpy(good.substr(0, good.size() - 1)).ok());  // truncated data
  EXPECT_FALSE(ParseNpy(good + "xxxx").ok());                    // trailing data
  EXPECT_FALSE(ParseNpy(good.substr(0, 40)).ok());               // truncated header
  EXPECT_FALSE(ParseNpy(NumpyWritten("<f4", "False", "(2, -3)")).ok());
  // A product that wraps around to the real size must not pass for it.
  EXPECT_FALSE(ParseNpy(NumpyWritten("<f4", "False", "(4611686018427387904, 4, 6)")).ok());
  EXPECT_FALSE(ParseNpy(NumpyWritten("<f4", "False", "(0, 6)")).ok());
  EXPECT_FALSE(ParseNpy(NumpyWritten("<f4", "False", "[2, 3]")).ok());
}

TEST(NpyTest, FileErrorsAreStatuses) {
  EXPECT_EQ(ReadNpy("/nonexistent/x.npy").status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(WriteNpy("/nonexistent/dir/x.npy", {.shape = {1}, .values = {1}}).ok());
  EXPECT_EQ(WriteNpy(test::MakeTempDir("client") + "/x.npy", {.shape = {2}, .values = {1}}).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(NpyTest, FileRoundTrip) {
  const std::string path = test::MakeTempDir("client") + "/a.npy";
  FloatArray array{.shape = {2, 2}, .values = {1.5f, -2, 1e-30f, 3e30f}};
  ASSERT_TRUE(WriteNpy(path, array).ok());
  absl::StatusOr<FloatArray> back = ReadNpy(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->values, array.values);
}

}  // namespace
}  // namespace attnserve::client
