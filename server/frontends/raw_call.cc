#include "server/frontends/raw_call.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/support/proto_buffer_reader.h"

namespace attnserve::server {

using google::protobuf::internal::WireFormatLite;

absl::Status MalformedBody(absl::string_view type_name) {
  return absl::InvalidArgumentError(
      absl::StrCat("the request body is not a valid ", type_name, " (malformed protobuf)"));
}

Clock::time_point SteadyDeadline(const grpc::CallbackServerContext& context) {
  const auto deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return Clock::time_point::max();
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(deadline - std::chrono::system_clock::now());
}

bool ScanStringFields(grpc::ByteBuffer* bytes,
                      std::initializer_list<std::pair<int, std::string*>> fields,
                      std::initializer_list<std::pair<int, uint64_t*>> varints) {
  for (const auto& [number, value] : fields) value->clear();
  for (const auto& [number, value] : varints) *value = 0;
  grpc::ProtoBufferReader reader(bytes);
  google::protobuf::io::CodedInputStream input(&reader);
  while (const uint32_t tag = input.ReadTag()) {
    uint64_t* varint = nullptr;
    for (const auto& [number, value] : varints) {
      if (tag == WireFormatLite::MakeTag(number, WireFormatLite::WIRETYPE_VARINT)) varint = value;
    }
    if (varint != nullptr) {
      if (!input.ReadVarint64(varint)) return false;
      continue;
    }
    std::string* destination = nullptr;
    for (const auto& [number, value] : fields) {
      if (tag == WireFormatLite::MakeTag(number, WireFormatLite::WIRETYPE_LENGTH_DELIMITED)) {
        destination = value;
      }
    }
    const bool read = destination != nullptr ? WireFormatLite::ReadString(&input, destination)
                                             : WireFormatLite::SkipField(&input, tag);
    if (!read) return false;
  }
  return input.ConsumedEntireMessage();
}

}  // namespace attnserve::server
