#include <chrono>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/cli.h"
#include "client/npy.h"
#include "client/packing.h"

namespace attnserve::client {
namespace {

constexpr int kPreviewValues = 6;

// Prints the shape and the first values of an array.
void PrintSummary(absl::string_view name, const FloatArray& array) {
  std::cout << name << " " << array.ShapeString() << "\n  first values:";
  for (size_t i = 0; i < array.values.size() && i < kPreviewValues; ++i) {
    std::cout << absl::StrFormat(" %.6f", array.values[i]);
  }
  std::cout << "\n";
}

// Writes the array to `path` when one was given, and says so.
absl::Status MaybeWrite(const std::string& path, absl::string_view name, const FloatArray& array) {
  if (path.empty()) return absl::OkStatus();
  if (absl::Status s = WriteNpy(path, array); !s.ok()) return s;
  std::cout << "wrote " << name << " " << array.ShapeString() << " to " << path << "\n";
  return absl::OkStatus();
}

}  // namespace

absl::Status RunForwardCommand(const ConnectionFlags& connection, const ForwardFlags& flags) {
  std::unique_ptr<AttentionClient> client = ConnectFromFlags(connection);
  absl::StatusOr<PreparedCall> prepared = PrepareCall(GrpcModelFinder(*client), flags.call);
  if (!prepared.ok()) return prepared.status();
  prepared->call.return_attention = flags.return_attention || !flags.attention_output.empty();

  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<ForwardResult> result = client->Forward(prepared->call);
  const std::chrono::duration<double, std::milli> took = std::chrono::steady_clock::now() - start;
  if (!result.ok()) return result.status();
  if (prepared->unpack_to >= 0) {
    // Packed on the wire at our initiative: hand the output back in the input file's shape.
    absl::StatusOr<FloatArray> padded =
        Unpack(result->output, prepared->call.lengths, prepared->unpack_to);
    if (!padded.ok()) return padded.status();
    result->output = *std::move(padded);
  }
  std::cout << absl::StrFormat("%s call: %.2f ms\n", KindFlagName(prepared->call.kind),
                               took.count());
  if (flags.output.empty()) PrintSummary("output", result->output);
  if (result->attention.has_value() && flags.attention_output.empty()) {
    PrintSummary("attention", *result->attention);
  }
  if (absl::Status s = MaybeWrite(flags.output, "output", result->output); !s.ok()) return s;
  if (result->attention.has_value()) {
    return MaybeWrite(flags.attention_output, "attention", *result->attention);
  }
  return absl::OkStatus();
}

}  // namespace attnserve::client
