// The client library's array helpers: packing and unpacking, wire tensors, kinds, statuses.
#include "client/packing.h"
#include "client/wire.h"
#include "gtest/gtest.h"

namespace attnserve::client {
namespace {

TEST(PackingTest, PackThenUnpackRestoresValidRowsAndZeroesPadding) {
  FloatArray padded{.shape = {2, 3, 2}, .values = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}};
  absl::StatusOr<FloatArray> packed = Pack(padded, {3, 1});
  ASSERT_TRUE(packed.ok()) << packed.status();
  EXPECT_EQ(packed->shape, (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(packed->values, (std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8}));
  absl::StatusOr<FloatArray> back = Unpack(*packed, {3, 1}, 3);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->values, (std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0}));
}

TEST(PackingTest, RefusesLengthsThatDoNotFit) {
  FloatArray padded{.shape = {2, 3, 1}, .values = std::vector<float>(6)};
  EXPECT_FALSE(Pack(padded, {4, 1}).ok());
  EXPECT_FALSE(Pack(padded, {1}).ok());
  EXPECT_FALSE(Unpack({.shape = {3, 1}, .values = std::vector<float>(3)}, {1, 1}, 3).ok());
}

TEST(PackingTest, ParsesIntLists) {
  EXPECT_EQ(*ParseIntList("3,5,0"), (std::vector<int32_t>{3, 5, 0}));
  EXPECT_TRUE(ParseIntList("")->empty());
  EXPECT_FALSE(ParseIntList("3,x").ok());
  EXPECT_FALSE(ParseIntList("3,,4").ok());
}

TEST(WireTest, BothEncodingsCarryTheSameArray) {
  FloatArray array{.shape = {1, 2, 2}, .values = {0.25f, -1, 3, 4}};
  for (Encoding encoding : {Encoding::kRaw, Encoding::kValues}) {
    v1::Tensor tensor;
    ASSERT_TRUE(EncodeTensor(array, encoding, &tensor).ok());
    EXPECT_EQ(tensor.raw().empty(), encoding == Encoding::kValues);
    absl::StatusOr<FloatArray> back = DecodeTensor(tensor);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->shape, array.shape);
    EXPECT_EQ(back->values, array.values);
  }
}

TEST(WireTest, RefusesTensorsWhoseDataDisagreesWithTheShape) {
  v1::Tensor tensor;
  tensor.add_shape(3);
  tensor.add_values(1);
  EXPECT_EQ(DecodeTensor(tensor).status().code(), absl::StatusCode::kInvalidArgument);
  tensor.clear_values();
  tensor.set_raw("abc");
  EXPECT_EQ(DecodeTensor(tensor).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(WireTest, KindNamesRoundTrip) {
  for (const char* name : {"bidirectional", "causal", "cross", "causal_cross"}) {
    absl::StatusOr<v1::AttentionKind> kind = ParseKind(name);
    ASSERT_TRUE(kind.ok());
    EXPECT_EQ(KindFlagName(*kind), name);
  }
  EXPECT_FALSE(ParseKind("encoder").ok());
}

TEST(WireTest, GrpcCodesKeepTheirNumbers) {
  absl::Status status = FromGrpcStatus(grpc::Status(grpc::StatusCode::NOT_FOUND, "no model"));
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(status.message(), "no model");
}

}  // namespace
}  // namespace attnserve::client
