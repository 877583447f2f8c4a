// The attnserve.v1 codec on its own: raw bytes read in place or through the copy when they are
// not aligned for float, encoding errors, and the reply writer's own size checks.

#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/frontends/tensor_codec.h"
#include "server/frontends/v1/forward_codec.h"

namespace attnserve::server::testing {
namespace {

std::string LittleEndianBytes(const std::vector<float>& values) {
  std::string bytes(values.size() * 4, '\0');
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

TEST(CodecTest, AlignedRawBytesAreReadInPlace) {
  const std::vector<float> values = {1.5f, -2.0f, 3.25f};
  const std::string bytes = LittleEndianBytes(values);
  std::vector<float> copy;
  absl::StatusOr<const float*> data = RawFloats(bytes, 3, &copy);
  ASSERT_TRUE(data.ok());
  EXPECT_EQ(static_cast<const void*>(*data), static_cast<const void*>(bytes.data()));
  EXPECT_TRUE(copy.empty());
}

TEST(CodecTest, MisalignedRawBytesAreCopiedExactly) {
  const std::vector<float> values = {1.5f, -2.0f, 3.25f, 1e-30f};
  // One byte in, so the floats start at an address that is not a multiple of 4.
  std::string storage(1, 'x');
  storage += LittleEndianBytes(values);
  const char* start = storage.data() + 1;
  ASSERT_NE(reinterpret_cast<uintptr_t>(start) % alignof(float), 0u);
  std::vector<float> copy;
  absl::StatusOr<const float*> data =
      RawFloats(absl::string_view(start, values.size() * 4), 4, &copy);
  ASSERT_TRUE(data.ok());
  EXPECT_EQ(*data, copy.data());
  for (size_t i = 0; i < values.size(); ++i) EXPECT_EQ((*data)[i], values[i]);
}

TEST(CodecTest, RawBytesThatAreNotTheShapesFloatsAreRefused) {
  std::vector<float> copy;
  EXPECT_EQ(RawFloats(std::string(10, '\0'), 3, &copy).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RawFloats(std::string(16, '\0'), 3, &copy).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CodecTest, DecodesAPaddedRawRequestInPlace) {
  v1::ForwardRequest request;
  request.set_kind(v1::ATTENTION_KIND_CAUSAL);
  request.mutable_input()->add_shape(2);
  request.mutable_input()->add_shape(3);
  request.mutable_input()->add_shape(4);
  request.mutable_input()->set_raw(LittleEndianBytes(std::vector<float>(24, 0.5f)));
  request.add_lengths(3);
  request.add_lengths(1);
  DecodedForward decoded;
  ASSERT_TRUE(DecodeForwardRequest(request, &decoded).ok());
  EXPECT_TRUE(decoded.raw_encoding);
  EXPECT_EQ(decoded.args.kind, core::AttentionKind::kCausal);
  EXPECT_EQ(decoded.args.input.padded_length, 3);
  EXPECT_EQ(decoded.args.input.lengths, (std::vector<int64_t>{3, 1}));
  EXPECT_EQ(decoded.args.input.width, 4);
  EXPECT_FALSE(decoded.args.context.has_value());
}

TEST(CodecTest, EncodingErrorsAreInvalidArgument) {
  v1::ForwardRequest request;
  request.set_kind(v1::ATTENTION_KIND_BIDIRECTIONAL);
  request.mutable_input()->add_shape(2);
  request.mutable_input()->add_shape(4);
  request.mutable_input()->add_values(1.0f);  // 1 value for 8 elements
  DecodedForward decoded;
  EXPECT_EQ(DecodeForwardRequest(request, &decoded).code(), absl::StatusCode::kInvalidArgument);
  request.clear_kind();
  EXPECT_EQ(DecodeForwardRequest(request, &decoded).code(), absl::StatusCode::kInvalidArgument);
}

TEST(CodecTest, TheReplyWriterRefusesSizesAReplyCannotHold) {
  DecodedForward decoded;
  decoded.args.input.lengths = {1};
  decoded.args.input.width = 4;
  core::ForwardShapes shapes;
  shapes.output_rows = int64_t{1} << 20;
  shapes.output_width = int64_t{1} << 12;  // 2^32 floats: past any int count and 2 GiB
  v1::ForwardResponse response;
  EXPECT_EQ(PrepareForwardResponse(decoded, shapes, &response).status().code(),
            absl::StatusCode::kResourceExhausted);
  shapes.output_rows = 2;
  shapes.output_width = 4;
  absl::StatusOr<ForwardBuffers> buffers = PrepareForwardResponse(decoded, shapes, &response);
  ASSERT_TRUE(buffers.ok());
  EXPECT_EQ(buffers->output.size(), 8u);
  EXPECT_EQ(response.output().values_size(), 8);
}

// A JSON or protobufjs client sends the enum's value names: a message that asks for a kind must
// name those, not another spelling the wire does not take.
TEST(CodecTest, KindMessagesNameTheKindsAsTheWireSpellsThem) {
  for (const int kind : {static_cast<int>(v1::ATTENTION_KIND_UNSPECIFIED), 99}) {
    v1::ForwardRequest request;
    request.set_kind(static_cast<v1::AttentionKind>(kind));
    DecodedForward decoded;
    const absl::Status status = DecodeForwardRequest(request, &decoded);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    const google::protobuf::EnumDescriptor* kinds = v1::AttentionKind_descriptor();
    for (int i = 0; i < kinds->value_count(); ++i) {
      const std::string& name = kinds->value(i)->name();
      if (kinds->value(i)->number() == v1::ATTENTION_KIND_UNSPECIFIED) continue;
      EXPECT_NE(status.message().find(name), absl::string_view::npos)
          << "'" << status.message() << "' does not name " << name;
    }
  }
}

}  // namespace
}  // namespace attnserve::server::testing
