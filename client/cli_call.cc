#include <cstdlib>
#include <fstream>
#include <iterator>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/cli.h"
#include "client/npy.h"
#include "client/packing.h"

namespace attnserve::client {
namespace {

constexpr int64_t kMaxMessageFloats = (int64_t{1} << 31) / sizeof(float);

// One side of a call (the input, or the context) as its flags describe it.
struct SideFlags {
  absl::string_view name;  // "input" or "context", for messages
  const std::string& file;
  const std::string& random;
  const std::string& lengths;
};

// Reads the side's .npy file or makes a random [B, S, width] array from "B,S".
absl::StatusOr<FloatArray> LoadSide(const SideFlags& side, int64_t width, uint64_t seed) {
  if (!side.file.empty()) return ReadNpy(side.file);
  absl::StatusOr<std::vector<int32_t>> dims = ParseIntList(side.random);
  if (!dims.ok() || dims->size() != 2 || (*dims)[0] < 1 || (*dims)[1] < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("random ", side.name, " shape '", side.random, "' is not B,S (e.g. 2,16)"));
  }
  // A gRPC message holds at most 2 GiB: refuse bigger shapes instead of failing to allocate.
  const int64_t elements = int64_t{(*dims)[0]} * (*dims)[1] * width;
  if (elements > kMaxMessageFloats) {
    return absl::InvalidArgumentError(absl::StrCat("random ", side.name, " ", side.random, "x",
                                                   width, " is larger than one gRPC message"));
  }
  return RandomArray({(*dims)[0], (*dims)[1], width}, seed);
}

// Drops the padding of a [B, S, d] side for a packed call; returns S (-1 when already packed).
absl::StatusOr<int64_t> PackSide(FloatArray& array, std::vector<int32_t>& lengths) {
  if (array.shape.size() != 3) return -1;
  const int64_t padded_length = array.shape[1];
  absl::StatusOr<FloatArray> packed = Pack(array, lengths);
  if (!packed.ok()) return packed.status();
  if (lengths.empty()) lengths.assign(array.shape[0], static_cast<int32_t>(padded_length));
  array = *std::move(packed);
  return padded_length;
}

absl::Status CheckSources(const SideFlags& side, bool wanted) {
  const int given = !side.file.empty() + !side.random.empty();
  if (wanted && given != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("give exactly one of --", side.name, " FILE.npy or --",
                     side.name == "input" ? "" : "context-", "random B,S"));
  }
  if (!wanted && given > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", side.name, " is only for the cross kinds (--kind cross|causal_cross)"));
  }
  return absl::OkStatus();
}

// Reads or makes one side's array and parses its lengths.
absl::Status LoadSideInto(const SideFlags& side, int64_t width, uint64_t seed, FloatArray& array,
                          std::vector<int32_t>& lengths) {
  absl::StatusOr<std::vector<int32_t>> parsed = ParseIntList(side.lengths);
  if (!parsed.ok()) return parsed.status();
  lengths = *std::move(parsed);
  absl::StatusOr<FloatArray> loaded = LoadSide(side, width, seed);
  if (!loaded.ok()) return loaded.status();
  array = *std::move(loaded);
  return absl::OkStatus();
}

// Fills the call's input and, for the cross kinds, its context, from files or at random.
absl::Status LoadArrays(const ModelFinder& find_model, const CallFlags& flags, bool cross,
                        ForwardRequestSpec& call) {
  const SideFlags input{"input", flags.input, flags.random, flags.lengths};
  const SideFlags context{"context", flags.context, flags.context_random, flags.context_lengths};
  if (absl::Status s = CheckSources(input, true); !s.ok()) return s;
  if (absl::Status s = CheckSources(context, cross); !s.ok()) return s;
  // Random arrays take their widths from the model the call goes to.
  v1::ModelInfo model;
  if (!flags.random.empty() || !flags.context_random.empty()) {
    absl::StatusOr<v1::ModelInfo> found = find_model(flags.model, flags.model_version);
    if (!found.ok()) return found.status();
    model = *std::move(found);
  }
  absl::Status s = LoadSideInto(input, model.d_model(), flags.seed, call.input, call.lengths);
  if (!s.ok() || !cross) return s;
  call.context.emplace();
  return LoadSideInto(context, model.d_context(), flags.seed + 1, *call.context,
                      call.context_lengths);
}

}  // namespace

namespace {

absl::StatusOr<std::string> ReadPem(const char* flag, const std::string& path) {
  if (path.empty()) return std::string();
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": cannot read it"));
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace

absl::Status ResolveSecurityFlags(ConnectionFlags* flags) {
  if (flags->tls_cert.empty() != flags->tls_key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  if (!flags->tls_cert.empty() && flags->tls_ca.empty()) {
    return absl::InvalidArgumentError("--tls-cert needs --tls-ca (the server's CA)");
  }
  for (const auto& [flag, path] :
       {std::pair{"--tls-ca", &flags->tls_ca}, std::pair{"--tls-cert", &flags->tls_cert},
        std::pair{"--tls-key", &flags->tls_key}}) {
    if (absl::StatusOr<std::string> pem = ReadPem(flag, *path); !pem.ok()) return pem.status();
  }
  if (flags->token.empty()) {
    if (const char* token = std::getenv(kTokenEnvironmentVariable)) flags->token = token;
  }
  return absl::OkStatus();
}

std::unique_ptr<AttentionClient> ConnectFromFlags(const ConnectionFlags& flags,
                                                  int connection_index) {
  ClientOptions options;
  options.connection_index = connection_index;
  options.tls_ca_pem = ReadPem("--tls-ca", flags.tls_ca).value_or("");
  options.tls_cert_pem = ReadPem("--tls-cert", flags.tls_cert).value_or("");
  options.tls_key_pem = ReadPem("--tls-key", flags.tls_key).value_or("");
  options.token = flags.token;
  options.timeout =
      flags.timeout_seconds > 0 ? absl::Seconds(flags.timeout_seconds) : absl::InfiniteDuration();
  options.max_message_bytes = flags.max_message_mib << 20;
  options.load_balancing_policy = flags.lb_policy;
  options.retry = !flags.no_retry;
  return AttentionClient::Connect(flags.target, options);
}

ModelFinder GrpcModelFinder(const AttentionClient& client) {
  return [&client](const std::string& name, uint64_t version) {
    return client.FindModel(name, version);
  };
}

absl::StatusOr<PreparedCall> PrepareCall(const ModelFinder& find_model, const CallFlags& flags) {
  PreparedCall prepared;
  ForwardRequestSpec& call = prepared.call;
  absl::StatusOr<v1::AttentionKind> kind = ParseKind(flags.kind);
  if (!kind.ok()) return kind.status();
  absl::StatusOr<Encoding> encoding = ParseEncoding(flags.encoding);
  if (!encoding.ok()) return encoding.status();
  call.model = flags.model;
  call.version = flags.model_version;
  call.kind = *kind;
  call.encoding = *encoding;
  const bool cross = *kind == v1::ATTENTION_KIND_CROSS || *kind == v1::ATTENTION_KIND_CAUSAL_CROSS;
  if (absl::Status s = LoadArrays(find_model, flags, cross, call); !s.ok()) return s;
  if (!flags.packed) return prepared;

  absl::StatusOr<int64_t> unpack_to = PackSide(call.input, call.lengths);
  if (!unpack_to.ok()) return unpack_to.status();
  prepared.unpack_to = *unpack_to;
  if (call.context.has_value()) {
    absl::StatusOr<int64_t> packed = PackSide(*call.context, call.context_lengths);
    if (!packed.ok()) return packed.status();
  }
  return prepared;
}

FloatArray RandomArray(std::vector<int64_t> shape, uint64_t seed) {
  FloatArray array{.shape = std::move(shape), .values = {}};
  std::mt19937_64 engine(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  array.values.resize(array.ElementCount());
  for (float& value : array.values) value = uniform(engine);
  return array;
}

}  // namespace attnserve::client
