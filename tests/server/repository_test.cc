// The model repository and versions over real channels to real servers at 127.0.0.1:0, each on
// a temporary repository the test writes: control modes, version policies, the repository API
// and its refusals, files that are half written or broken, unloads with calls queued, the admin
// token, versions in ListModels and ModelMetadata, and swaps under load with no call failed.
//
// Expected outputs come from the fixtures' layers themselves (core::Layer on the same files):
// the PyTorch golden cases have no 1x128 call, and the layers are held to PyTorch by the
// golden tests (core and service), so here only "which version answered" is in question.

#include "server/serving/repository.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/layer.h"
#include "core/weights.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/serving/call_reporter.h"
#include "server/serving/model_registry.h"
#include "server/transport/admin_auth.h"
#include "tests/common/all_near.h"
#include "tests/common/golden.h"
#include "tests/common/safetensors_writer.h"
#include "tests/common/temp_dir.h"
#include "tests/server/http_client.h"
#include "tests/server/scrape.h"
#include "tests/server/test_util.h"

namespace attnserve::server::testing {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr int64_t kWidth = 16;  // d_model of both fixtures below
// Two layers of the same shape whose outputs differ: version "a" and version "b".
const char kWeightsA[] = "w_fused_mh.safetensors";
const char kWeightsB[] = "w_torch_mha.safetensors";

std::string Fixture(const std::string& name) { return test::FixturesDir() + "/" + name; }

// A repository in a fresh temporary directory.
class Repo {
 public:
  Repo() : dir_(test::MakeTempDir("repository")) {}

  const std::string& dir() const { return dir_; }

  // DIR/NAME/VERSION/model.safetensors = `fixture`, written whole under another name first.
  void AddVersion(const std::string& name, int version, const std::string& fixture) {
    const fs::path dir = fs::path(dir_) / name / std::to_string(version);
    fs::create_directories(dir);
    fs::copy_file(Fixture(fixture), dir / "model.tmp", fs::copy_options::overwrite_existing);
    fs::rename(dir / "model.tmp", dir / "model.safetensors");
  }

  // Puts `bytes` as a version's file (a broken or half-written one), whole at once: a poll
  // between a write's start and end would see a third file, and count a second failure.
  void WriteVersion(const std::string& name, int version, const std::string& bytes) {
    const fs::path dir = fs::path(dir_) / name / std::to_string(version);
    fs::create_directories(dir);
    test::WriteBytes((dir / "model.tmp").string(), bytes);
    fs::rename(dir / "model.tmp", dir / "model.safetensors");
  }

  void RemoveVersion(const std::string& name, int version) {
    fs::remove_all(fs::path(dir_) / name / std::to_string(version));
  }

  void SetConfig(const std::string& name, const std::string& json) {
    fs::create_directories(fs::path(dir_) / name);
    const fs::path tmp = fs::path(dir_) / name / ".config.tmp";
    std::ofstream(tmp) << json;
    fs::rename(tmp, fs::path(dir_) / name / "config.json");
  }

 private:
  std::string dir_;
};

std::string FileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

ServerOptions RepoOptions(const Repo& repo, ControlMode mode) {
  ServerOptions options;
  options.model_repository = repo.dir();
  options.model_control_mode = mode;
  options.repository_poll_interval = milliseconds(50);
  return options;
}

// A [1, length, 16] bidirectional call's input (a smooth wave).
std::vector<float> Input(int64_t length, int seed = 0) {
  std::vector<float> values(length * kWidth);
  for (size_t i = 0; i < values.size(); ++i) values[i] = std::sin(0.05f * (i + 31 * seed));
  return values;
}

// What the fixture's layer answers for Input(length, seed), computed here by core::Layer.
std::vector<float> Expected(const std::string& fixture, int64_t length, int seed = 0,
                            core::AttentionKind kind = core::AttentionKind::kBidirectional) {
  absl::StatusOr<core::LayerWeights> weights = core::LoadLayerWeights(Fixture(fixture), {});
  EXPECT_TRUE(weights.ok()) << weights.status();
  absl::StatusOr<std::shared_ptr<const core::Layer>> layer =
      core::Layer::Create(*std::move(weights));
  EXPECT_TRUE(layer.ok()) << layer.status();
  const std::vector<float> input = Input(length, seed);
  core::ForwardArgs args;
  args.kind = kind;
  args.input.width = kWidth;
  args.input.data = input.data();
  args.input.lengths = {length};
  args.input.padded_length = length;
  std::vector<float> out((*layer)->Shapes(args).output_size());
  EXPECT_TRUE((*layer)->Forward(args, out).ok());
  return out;
}

bool Near(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return false;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::fabs(got[i] - want[i]) > 1e-5f + 1e-5f * std::fabs(want[i])) return false;
  }
  return true;
}

// A client of both services on one channel.
class Client {
 public:
  explicit Client(int port)
      : channel_(Connect(port)),
        v1_(v1::AttentionService::NewStub(channel_)),
        oip_(inference::GRPCInferenceService::NewStub(channel_)) {}

  // Forward of Input(length, seed) on `model` at `version`; the output when OK.
  grpc::Status Forward(const std::string& model, uint64_t version, std::vector<float>* output,
                       int64_t length = 8, int seed = 0) {
    v1::ForwardRequest request;
    request.set_model(model);
    request.set_version(version);
    request.set_kind(v1::ATTENTION_KIND_BIDIRECTIONAL);
    *request.mutable_input() = MakeTensor({1, length, kWidth}, Input(length, seed), true);
    v1::ForwardResponse response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + seconds(30));
    const grpc::Status status = v1_->Forward(&context, request, &response);
    if (status.ok() && output != nullptr) *output = TensorValues(response.output());
    return status;
  }

  // The READY versions ListModels shows for `model`: version -> state. (A retired version is
  // listed UNLOADING while a call holds it, which includes the moment after a call's reply is
  // sent and before its hold ends: the tests that look for it use the index.)
  std::map<uint64_t, v1::ModelState> Versions(const std::string& model) {
    v1::ListModelsResponse response;
    grpc::ClientContext context;
    EXPECT_TRUE(v1_->ListModels(&context, {}, &response).ok());
    std::map<uint64_t, v1::ModelState> versions;
    for (const v1::ModelInfo& info : response.models()) {
      if (info.name() == model && info.state() == v1::MODEL_STATE_READY) {
        versions[info.version()] = info.state();
      }
    }
    return versions;
  }

  grpc::Status Load(const std::string& model, const std::string& config = "",
                    const std::string& token = "") {
    inference::RepositoryModelLoadRequest request;
    request.set_model_name(model);
    if (!config.empty()) (*request.mutable_parameters())["config"].set_string_param(config);
    inference::RepositoryModelLoadResponse response;
    grpc::ClientContext context;
    if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
    return oip_->RepositoryModelLoad(&context, request, &response);
  }

  grpc::Status Unload(const std::string& model, const std::string& token = "") {
    inference::RepositoryModelUnloadRequest request;
    request.set_model_name(model);
    inference::RepositoryModelUnloadResponse response;
    grpc::ClientContext context;
    if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
    return oip_->RepositoryModelUnload(&context, request, &response);
  }

  // The index entry of `model` at `version` ("" for a model without one); state "" if absent.
  inference::RepositoryIndexResponse::ModelIndex Index(const std::string& model,
                                                       const std::string& version) {
    inference::RepositoryIndexResponse response;
    grpc::ClientContext context;
    EXPECT_TRUE(oip_->RepositoryIndex(&context, {}, &response).ok());
    for (const auto& entry : response.models()) {
      if (entry.name() == model && entry.version() == version) return entry;
    }
    return {};
  }

  inference::GRPCInferenceService::Stub& oip() { return *oip_; }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AttentionService::Stub> v1_;
  std::unique_ptr<inference::GRPCInferenceService::Stub> oip_;
};

using States = std::map<uint64_t, v1::ModelState>;
constexpr v1::ModelState kReady = v1::MODEL_STATE_READY;

TEST(RepositoryConfigTest, TheSchemaAndItsErrors) {
  absl::StatusOr<RepositoryModelConfig> config = ParseRepositoryModelConfig(
      R"({"num_heads": 4, "prefix": "enc.", "precision": "bf16", "max_queue": 7,
          "version_policy": {"specific": {"versions": [3, 1]}}})",
      "c.json");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->load.num_heads, 4);
  EXPECT_EQ(config->load.prefix, "enc.");
  EXPECT_EQ(config->precision, core::Precision::kBF16);
  EXPECT_EQ(config->max_queue, 7);
  EXPECT_EQ(WantedVersions(config->policy, {1, 2, 3, 4}), (std::vector<int64_t>{1, 3}));
  config = ParseRepositoryModelConfig(R"({"version_policy": {"latest": {"num_versions": 2}}})",
                                      "c.json");
  ASSERT_TRUE(config.ok());
  EXPECT_EQ(WantedVersions(config->policy, {1, 2, 3}), (std::vector<int64_t>{2, 3}));
  config = ParseRepositoryModelConfig(R"({"version_policy": {"all": {}}})", "c.json");
  ASSERT_TRUE(config.ok());
  EXPECT_EQ(WantedVersions(config->policy, {1, 2, 3}), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(WantedVersions(RepositoryModelConfig{}.policy, {1, 5}), (std::vector<int64_t>{5}));
  // Unknown keys, at any level, name the key and the file.
  for (const char* bad : {R"({"num_head": 4})", R"({"version_policy": {"latest": {"n": 1}}})"}) {
    const absl::Status status = ParseRepositoryModelConfig(bad, "/r/m/config.json").status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(status.message(), "/r/m/config.json")) << status;
    EXPECT_TRUE(absl::StrContains(status.message(), "unknown key")) << status;
  }
  for (const char* bad : {"[1]", "{", R"({"num_heads": 0})", R"({"precision": "f16"})",
                          R"({"version_policy": {"specific": {"versions": []}}})",
                          R"({"version_policy": {"all": {}, "latest": {}}})"}) {
    EXPECT_EQ(ParseRepositoryModelConfig(bad, "c.json").status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  // A key given twice, at any level, is refused, naming it (the last one would win silently).
  for (const char* bad :
       {R"({"num_heads": 4, "num_heads": 2})",
        R"({"version_policy": {"latest": {"num_versions": 1, "num_versions": 2}}})"}) {
    const absl::Status status = ParseRepositoryModelConfig(bad, "c.json").status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(absl::StrContains(status.message(), "given twice")) << status;
  }
  // The same key in two objects is two keys: this one fails on the schema, not as a key twice.
  const absl::Status two_objects =
      ParseRepositoryModelConfig(R"({"a": {"x": 1}, "b": {"x": 2}})", "c.json").status();
  EXPECT_TRUE(absl::StrContains(two_objects.message(), "unknown key 'a'")) << two_objects;
}

// A model directory that cannot be read now is an error, not a model without versions (which a
// poll would unload): here every file descriptor the process may have is in use.
TEST(RepositoryScanTest, AModelDirThatCannotBeReadIsAnErrorNotAnEmptyModel) {
  Repo repo;
  repo.AddVersion("m", 1, kWeightsA);
  ASSERT_TRUE(ScanModelDir(repo.dir(), "m").ok());
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &old), 0);
  int highest = 0;
  for (const auto& entry : fs::directory_iterator("/proc/self/fd")) {
    highest = std::max(highest, std::stoi(entry.path().filename().string()));
  }
  rlimit tight = old;
  tight.rlim_cur = highest + 1;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &tight), 0);
  std::vector<int> filled;  // the free numbers below the limit
  for (int fd; (fd = open("/dev/null", O_RDONLY)) >= 0;) filled.push_back(fd);
  const absl::StatusOr<ModelDir> scanned = ScanModelDir(repo.dir(), "m");
  const absl::StatusOr<std::vector<std::string>> listed = ListRepositoryModels(repo.dir());
  for (int fd : filled) close(fd);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &old), 0);
  EXPECT_EQ(scanned.status().code(), absl::StatusCode::kUnavailable) << scanned.status();
  EXPECT_EQ(listed.status().code(), absl::StatusCode::kUnavailable) << listed.status();
  ASSERT_TRUE(ScanModelDir(repo.dir(), "m").ok());
  EXPECT_EQ(ScanModelDir(repo.dir(), "m")->versions.size(), 1u);
  EXPECT_EQ(ScanModelDir(repo.dir(), "absent").status().code(), absl::StatusCode::kNotFound);
}

TEST(AdminAuthTest, LoopbackPeers) {
  EXPECT_TRUE(IsLoopbackPeer("ipv4:127.0.0.1:4000"));
  EXPECT_TRUE(IsLoopbackPeer("ipv6:[::1]:4000"));
  EXPECT_TRUE(IsLoopbackPeer("ipv6:%5B::1%5D:4000"));
  EXPECT_FALSE(IsLoopbackPeer("ipv4:10.0.0.7:4000"));
  EXPECT_FALSE(IsLoopbackPeer("ipv6:[fe80::1]:4000"));
}

TEST(RepositoryTest, NoneModeLoadsAtStartAndChangesNothingAfter) {
  Repo repo;
  repo.AddVersion("m", 1, kWeightsA);
  std::unique_ptr<Server> server = StartServer(RepoOptions(repo, ControlMode::kNone));
  ASSERT_NE(server, nullptr);
  Client client(server->port());
  std::vector<float> out;
  ASSERT_TRUE(client.Forward("m", 0, &out).ok());
  EXPECT_TRUE(Near(out, Expected(kWeightsA, 8)));
  ASSERT_TRUE(client.Forward("", 1, &out).ok());  // the only model, by an empty name
  repo.AddVersion("m", 2, kWeightsB);
  std::this_thread::sleep_for(milliseconds(300));
  EXPECT_EQ(client.Versions("m"), (States{{1, kReady}}));
  EXPECT_EQ(client.Load("m").error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(client.Unload("m").error_code(), grpc::StatusCode::FAILED_PRECONDITION);
}

TEST(RepositoryTest, PollModeMovesToANewVersionAndRefusesTheRetiredOne) {
  Repo repo;
  repo.AddVersion("m", 1, kWeightsA);
  std::unique_ptr<Server> server = StartServer(RepoOptions(repo, ControlMode::kPoll));
  ASSERT_NE(server, nullptr);
  Client client(server->port());
  repo.AddVersion("m", 2, kWeightsB);
  ASSERT_TRUE(WaitFor([&] { return client.Versions("m") == States{{2, kReady}}; }));
  std::vector<float> out;
  ASSERT_TRUE(client.Forward("m", 0, &out).ok());
  EXPECT_TRUE(Near(out, Expected(kWeightsB, 8)));
  const grpc::Status old = client.Forward("m", 1, nullptr);
  EXPECT_EQ(old.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(absl::StrContains(old.error_message(), "ready: 2")) << old.error_message();
  // The retired version is UNLOADING until the calls that held it are answered, then
  // UNAVAILABLE (on a slow machine the last of them may still be on its way out).
  EXPECT_TRUE(WaitFor([&] { return client.Index("m", "1").state() == "UNAVAILABLE"; }))
      << "version 1 is " << client.Index("m", "1").state();
  EXPECT_EQ(client.Index("m", "2").state(), "READY");
  // Load and unload are explicit mode's (Triton refuses them while polling too).
  EXPECT_EQ(client.Load("m").error_code(), grpc::StatusCode::FAILED_PRECONDITION);
}

TEST(RepositoryTest, PollModeNeverLoadsAHalfWrittenFileAndTakesItOnceWhole) {
  Repo repo;
  repo.AddVersion("m", 1, kWeightsA);
  ServerOptions options = RepoOptions(repo, ControlMode::kPoll);
  options.metrics_listen = "127.0.0.1:0";
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  Client client(server->port());
  // The model's failures count from 0, the series there before the first.
  absl::StatusOr<std::map<std::string, double>> before = Scrape(server->metrics_port());
  ASSERT_TRUE(before.ok()) << before.status();
  const std::string failures = SeriesKey("attnserve_model_load_failures_total", {{"model", "m"}});
  ASSERT_TRUE(before->contains(failures));
  EXPECT_EQ(before->at(failures), 0);
  const std::string whole = FileBytes(Fixture(kWeightsB));
  repo.WriteVersion("m", 2, whole.substr(0, whole.size() / 2));
  ASSERT_TRUE(WaitFor([&] { return !client.Index("m", "2").reason().empty(); }));
  std::this_thread::sleep_for(milliseconds(200));  // a few more polls: still refused, once
  EXPECT_EQ(client.Index("m", "2").state(), "UNAVAILABLE");
  EXPECT_TRUE(absl::StrContains(client.Index("m", "2").reason(), "past the end"))
      << client.Index("m", "2").reason();
  EXPECT_EQ(client.Versions("m"), (States{{1, kReady}}));
  std::vector<float> out;
  ASSERT_TRUE(client.Forward("m", 0, &out).ok());
  EXPECT_TRUE(Near(out, Expected(kWeightsA, 8)));
  absl::StatusOr<std::map<std::string, double>> metrics = Scrape(server->metrics_port());
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_EQ((*metrics)[failures], 1);
  EXPECT_EQ((*metrics)[SeriesKey("attnserve_model_state",
                                 {{"model", "m"}, {"state", "READY"}, {"version", "1"}})],
            1);
  // The rest of the file arrives: the next poll takes it.
  repo.WriteVersion("m", 2, whole);
  ASSERT_TRUE(WaitFor([&] { return client.Versions("m") == States{{2, kReady}}; }));
  ASSERT_TRUE(client.Forward("m", 0, &out).ok());
  EXPECT_TRUE(Near(out, Expected(kWeightsB, 8)));
}

TEST(RepositoryTest, PollModeFollowsConfigChangesAndRemovedVersionsAndModels) {
  Repo repo;
  repo.AddVersion("m", 1, kWeightsA);
  repo.AddVersion("m", 2, kWeightsB);
  repo.SetConfig("m", R"({"version_policy": {"all": {}}})");
  std::unique_ptr<Server> server = StartServer(RepoOptions(repo, ControlMode::kPoll));
  ASSERT_NE(server, nullptr);
  Client client(server->port());
  EXPECT_EQ(client.Versions("m"), (States{{1, kReady}, {2, kReady}}));
  repo.SetConfig("m", R"({"version_policy": {"specific": {"versions": [1]}}})");
  ASSERT_TRUE(WaitFor([&] { return client.Versions("m") == States{{1, kReady}}; }));
  repo.SetConfig("m", R"({"version_policy": {"all": {}}})");
  ASSERT_TRUE(WaitFor([&] { return client.Versions("m").size() == 2; }));
  repo.RemoveVersion("m", 1);
  ASSERT_TRUE(WaitFor([&] { return client.Versions("m") == States{{2, kReady}}; }));
  // A config with an unknown key is refused (named in the index); the versions keep serving.
  repo.SetConfig("m", R"({"version_polcy": {"all": {}}})");
  ASSERT_TRUE(
      WaitFor([&] { return absl::StrContains(client.Index("m", "2").reason(), "version_polcy"); }));
  EXPECT_EQ(client.Versions("m"), (States{{2, kReady}}));
  // So is one far larger than a config, before it is read (a sparse file may declare terabytes).
  repo.SetConfig("m", "{" + std::string(2 << 20, ' ') + "}");
  ASSERT_TRUE(WaitFor([&] {
    return absl::StrContains(client.Index("m", "2").reason(), "more than the 1048576");
  })) << client.Index("m", "2").reason();
  EXPECT_EQ(client.Versions("m"), (States{{2, kReady}}));
  fs::remove_all(fs::path(repo.dir()) / "m");
  ASSERT_TRUE(WaitFor([&] { return client.Versions("m").empty(); }));
  EXPECT_EQ(client.Forward("m", 0, nullptr).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST(RepositoryTest, ExplicitModeLoadsOnlyWhatIsAskedAndRollsBack) {
  Repo repo;
  repo.AddVersion("m", 1, kWeightsA);
  repo.AddVersion("m", 2, kWeightsB);
  repo.AddVersion("other", 1, kWeightsA);
  ServerOptions options = RepoOptions(repo, ControlMode::kExplicit);
  options.load_models = {"other"};
  options.metrics_listen = "127.0.0.1:0";
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  Client client(server->port());
  EXPECT_TRUE(client.Versions("m").empty());
  EXPECT_EQ(client.Index("m", "").state(), "UNAVAILABLE");
  EXPECT_EQ(client.Forward("m", 0, nullptr).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(client.Versions("other"), (States{{1, kReady}}));
  ASSERT_TRUE(client.Load("m").ok());
  EXPECT_EQ(client.Versions("m"), (States{{2, kReady}}));
  // Rollback: load the previous version (the `config` parameter overrides config.json).
  ASSERT_TRUE(client.Load("m", R"({"version_policy": {"specific": {"versions": [1]}}})").ok());
  EXPECT_EQ(client.Versions("m"), (States{{1, kReady}}));
  std::vector<float> out;
  ASSERT_TRUE(client.Forward("m", 0, &out).ok());
  EXPECT_TRUE(Near(out, Expected(kWeightsA, 8)));
  ASSERT_TRUE(client.Load("m", R"({"version_policy": {"latest": {"num_versions": 2}}})").ok());
  EXPECT_EQ(client.Versions("m"), (States{{1, kReady}, {2, kReady}}));
  // attnserve_model_info describes a model while it has a ready version, and only then.
  auto info_series = [&] {
    absl::StatusOr<std::map<std::string, double>> metrics = Scrape(server->metrics_port());
    EXPECT_TRUE(metrics.ok()) << metrics.status();
    int series = 0;
    for (const auto& [key, value] : *metrics) {
      series +=
          absl::StartsWith(key, "attnserve_model_info{") && absl::StrContains(key, "model=\"m\"");
    }
    return series;
  };
  EXPECT_EQ(info_series(), 1);
  ASSERT_TRUE(client.Unload("m").ok());
  EXPECT_EQ(info_series(), 0);
  EXPECT_TRUE(client.Versions("m").empty());
  const grpc::Status gone = client.Forward("m", 0, nullptr);
  EXPECT_EQ(gone.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(absl::StrContains(gone.error_message(), "unloaded")) << gone.error_message();
  EXPECT_EQ(client.Index("m", "2").state(), "UNAVAILABLE");
  EXPECT_EQ(client.Load("nope").error_code(), grpc::StatusCode::NOT_FOUND);
  // A name is a directory of the repository, never a path out of it.
  for (const char* bad : {"", "..", "../m", "m/1", ".hidden"}) {
    EXPECT_EQ(client.Load(bad).error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad;
    EXPECT_EQ(client.Unload(bad).error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad;
  }
  EXPECT_EQ(client.Load("m", std::string(1 << 20, '[')).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(client.Unload("nope").error_code(), grpc::StatusCode::NOT_FOUND);
  const grpc::Status bad_config = client.Load("m", R"({"num_heads": 4, "colour": 1})");
  EXPECT_EQ(bad_config.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(bad_config.error_message(), "'colour'"));
  EXPECT_TRUE(absl::StrContains(bad_config.error_message(), "the 'config' parameter"));
  // Answered to its caller, the refused load changed nothing: the index does not carry it.
  EXPECT_FALSE(absl::StrContains(client.Index("m", "2").reason(), "colour"))
      << client.Index("m", "2").reason();
  ASSERT_TRUE(client.Load("m").ok());
  EXPECT_EQ(client.Index("m", "2").reason(), "");
}

// KServe's model agent drives the same API over REST: load (with the config override),
// unload, and the index, in explicit mode.
TEST(RepositoryTest, TheRestRepositoryEndpointsLoadAndUnload) {
  Repo repo;
  repo.AddVersion("m", 1, kWeightsA);
  repo.AddVersion("m", 2, kWeightsB);
  ServerOptions options = RepoOptions(repo, ControlMode::kExplicit);
  options.http_listen = "127.0.0.1:0";
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  const std::string base = absl::StrCat("http://127.0.0.1:", server->http_port());
  Client client(server->port());
  EXPECT_TRUE(client.Versions("m").empty());
  HttpReply load = HttpCall(
      "POST", base + "/v2/repository/models/m/load",
      R"({"parameters": {"config": "{\"version_policy\": {\"specific\": {\"versions\": [1]}}}"}})",
      {"Content-Type: application/json"});
  EXPECT_EQ(load.status, 200) << load.body;
  EXPECT_EQ(client.Versions("m"), (States{{1, kReady}}));
  const HttpReply index = HttpCall("POST", base + "/v2/repository/index", "", {});
  EXPECT_EQ(index.status, 200);
  EXPECT_TRUE(absl::StrContains(index.body, R"("name":"m","version":"1","state":"READY")"))
      << index.body;
  EXPECT_EQ(HttpCall("POST", base + "/v2/repository/models/m/unload", "", {}).status, 200);
  EXPECT_TRUE(client.Versions("m").empty());
  EXPECT_EQ(HttpCall("POST", base + "/v2/repository/models/nope/load", "", {}).status, 404);
}

// A decode session holds the version it was opened on across a swap: its cached keys were made by
// those weights, so it finishes on them (rows equal to that version's own causal forward), while
// a session opened after the swap gets the new version, and the old one is freed when the last
// session holding it ends.
TEST(RepositoryTest, ADecodeSessionFinishesOnItsVersionAcrossASwap) {
  Repo repo;
  repo.AddVersion("m", 1, kWeightsA);
  repo.AddVersion("m", 2, kWeightsB);
  ServerOptions options = RepoOptions(repo, ControlMode::kExplicit);
  options.load_models = {"m"};
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  Client client(server->port());
  ASSERT_TRUE(client.Load("m", R"({"version_policy": {"specific": {"versions": [1]}}})").ok());
  auto stub = v1::AttentionService::NewStub(Connect(server->port()));
  const std::vector<float> input = Input(14);
  auto step = [&](grpc::ClientReaderWriter<v1::DecodeRequest, v1::DecodeResponse>& stream,
                  int64_t from, int64_t n, bool first) {
    v1::DecodeRequest request;
    if (first) {
      request.set_model("m");
      request.set_kind(v1::ATTENTION_KIND_CAUSAL);
    }
    *request.mutable_input() = MakeTensor(
        {1, n, kWidth}, {input.begin() + from * kWidth, input.begin() + (from + n) * kWidth}, true);
    v1::DecodeResponse response;
    EXPECT_TRUE(stream.Write(request));
    EXPECT_TRUE(stream.Read(&response));
    EXPECT_EQ(response.error_code(), 0) << response.error_message();
    return TensorValues(response.output());
  };
  grpc::ClientContext old_context;
  auto old_session = stub->Decode(&old_context);
  std::vector<float> got = step(*old_session, 0, 10, true);
  // The swap: version 2 only. Version 1 stays UNLOADING while the session holds it.
  ASSERT_TRUE(client.Load("m", R"({"version_policy": {"specific": {"versions": [2]}}})").ok());
  EXPECT_EQ(client.Index("m", "1").state(), "UNLOADING");
  const std::vector<float> rest = step(*old_session, 10, 4, false);
  got.insert(got.end(), rest.begin(), rest.end());
  // Version 1's own causal forward over the 14 tokens, computed here.
  const std::vector<float> want = Expected(kWeightsA, 14, 0, core::AttentionKind::kCausal);
  ASSERT_TRUE(test::AllNear(got, want, 1e-4f));
  // A session opened now is on version 2: its first rows differ.
  grpc::ClientContext new_context;
  auto new_session = stub->Decode(&new_context);
  const std::vector<float> other = step(*new_session, 0, 10, true);
  EXPECT_GT(std::abs(other[0] - got[0]) + std::abs(other[1] - got[1]), 1e-3f);
  for (auto* stream : {old_session.get(), new_session.get()}) {
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
  }
  for (int i = 0; i < 200 && client.Index("m", "1").state() != "UNAVAILABLE"; ++i) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_EQ(client.Index("m", "1").state(), "UNAVAILABLE");
}

// A sequence step that names no model goes to the only model; a continuation goes on with its
// sequence when that changes: another model loaded beside it, or its own unloaded (the session
// holds its version).
TEST(RepositoryTest, ASequenceThatNamesNoModelGoesOnWhenTheModelsChange) {
  Repo repo;
  repo.AddVersion("a", 1, kWeightsA);
  repo.AddVersion("b", 1, kWeightsB);
  ServerOptions options = RepoOptions(repo, ControlMode::kExplicit);
  options.load_models = {"a"};
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  Client client(server->port());
  auto infer = inference::GRPCInferenceService::NewStub(Connect(server->port()));
  const std::vector<float> input = Input(6);
  std::vector<float> got;
  auto step = [&](int64_t from, int64_t n, bool start, bool end) {
    // No model name.
    const inference::ModelInferRequest request =
        SequenceStepRequest("", input.data() + from * kWidth, n, kWidth, 3, start, end);
    inference::ModelInferResponse response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + seconds(30));
    const grpc::Status status = infer->ModelInfer(&context, request, &response);
    if (status.ok()) {
      const std::vector<float> rows = RawOutput(response);
      got.insert(got.end(), rows.begin(), rows.end());
    }
    return status;
  };
  ASSERT_TRUE(step(0, 4, true, false).ok());
  ASSERT_TRUE(client.Load("b").ok());
  grpc::Status status = step(4, 1, false, false);
  ASSERT_TRUE(status.ok()) << "with a second model loaded: " << status.error_message();
  ASSERT_TRUE(client.Unload("a").ok());
  status = step(5, 1, false, true);
  ASSERT_TRUE(status.ok()) << "with its model unloaded: " << status.error_message();
  // The six rows are model a's causal forward over the six tokens, computed here.
  const std::vector<float> want = Expected(kWeightsA, 6, 0, core::AttentionKind::kCausal);
  ASSERT_TRUE(test::AllNear(got, want, 1e-4f));
  // Its sequence ended, a step naming no model goes to the only model, b: id 3 is unknown there.
  EXPECT_EQ(step(0, 1, false, false).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST(RepositoryTest, ExplicitModeLoadsEveryModelForAStar) {
  Repo repo;
  repo.AddVersion("a", 1, kWeightsA);
  repo.AddVersion("b", 3, kWeightsB);
  ServerOptions options = RepoOptions(repo, ControlMode::kExplicit);
  options.load_models = {"*"};
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  Client client(server->port());
  EXPECT_EQ(client.Versions("a"), (States{{1, kReady}}));
  EXPECT_EQ(client.Versions("b"), (States{{3, kReady}}));
  options.load_models = {"missing"};
  EXPECT_EQ(Server::Start(options).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RepositoryTest, ABrokenNewVersionLeavesTheServingOneUntouched) {
  Repo repo;
  repo.AddVersion("m", 1, kWeightsA);
  ServerOptions options = RepoOptions(repo, ControlMode::kExplicit);
  options.load_models = {"m"};
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  Client client(server->port());
  repo.WriteVersion("m", 2, "this is not a safetensors file at all");
  const grpc::Status load = client.Load("m");
  EXPECT_EQ(load.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(load.error_message(), "version 2")) << load.error_message();
  EXPECT_EQ(client.Versions("m"), (States{{1, kReady}}));
  EXPECT_EQ(client.Index("m", "2").state(), "UNAVAILABLE");
  EXPECT_FALSE(client.Index("m", "2").reason().empty());
  std::vector<float> out;
  ASSERT_TRUE(client.Forward("m", 0, &out).ok());
  EXPECT_TRUE(Near(out, Expected(kWeightsA, 8)));
  // A valid safetensors file whose tensors are no layer is refused the same way.
  const fs::path path = fs::path(repo.dir()) / "m" / "2" / "model.safetensors";
  test::WriteSafetensorsFile(
      path.string(), test::MakeSafetensors({test::PatternTensor("encoder.weight", {4, 4})}));
  EXPECT_EQ(client.Load("m").error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(client.Versions("m"), (States{{1, kReady}}));
  // Fixed: the next load takes it, then retires version 1.
  repo.AddVersion("m", 2, kWeightsB);
  ASSERT_TRUE(client.Load("m").ok());
  EXPECT_EQ(client.Versions("m"), (States{{2, kReady}}));
}

// A load that would leave the model no version changes nothing: a version policy that names no
// version there (a typo in a rollback) is a refused config, and a model whose version files are
// gone has nothing to load. The serving version goes on.
TEST(RepositoryTest, ALoadThatWouldLeaveNoVersionChangesNothing) {
  Repo repo;
  repo.AddVersion("m", 1, kWeightsA);
  repo.AddVersion("m", 2, kWeightsB);
  ServerOptions options = RepoOptions(repo, ControlMode::kExplicit);
  options.load_models = {"m"};
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  Client client(server->port());
  ASSERT_EQ(client.Versions("m"), (States{{2, kReady}}));
  const grpc::Status typo =
      client.Load("m", R"({"version_policy": {"specific": {"versions": [3]}}})");
  EXPECT_EQ(typo.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(typo.error_message(), "names no version")) << typo.error_message();
  EXPECT_TRUE(absl::StrContains(typo.error_message(), "(there: 1, 2)")) << typo.error_message();
  EXPECT_EQ(client.Versions("m"), (States{{2, kReady}}));
  std::vector<float> out;
  ASSERT_TRUE(client.Forward("m", 0, &out).ok());
  EXPECT_TRUE(Near(out, Expected(kWeightsB, 8)));
  fs::remove_all(fs::path(repo.dir()) / "m" / "1");
  fs::remove_all(fs::path(repo.dir()) / "m" / "2");
  EXPECT_EQ(client.Load("m").error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(client.Versions("m"), (States{{2, kReady}}));
  ASSERT_TRUE(client.Forward("m", 0, &out).ok());
  EXPECT_TRUE(Near(out, Expected(kWeightsB, 8)));
}

TEST(RepositoryTest, ModelFlagsAreVersionOneAndStayLoaded) {
  Repo repo;
  repo.AddVersion("m", 4, kWeightsB);
  ServerOptions options = RepoOptions(repo, ControlMode::kExplicit);
  options.load_models = {"m"};
  ModelConfig flag;
  flag.name = "flag";
  flag.path = Fixture(kWeightsA);
  options.models.push_back(flag);
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  Client client(server->port());
  EXPECT_EQ(client.Versions("flag"), (States{{1, kReady}}));
  EXPECT_EQ(client.Versions("m"), (States{{4, kReady}}));
  EXPECT_EQ(client.Unload("flag").error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(client.Load("flag").error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  // Its name in the repository later, or with a broken config, changes nothing of it.
  repo.AddVersion("flag", 2, kWeightsB);
  EXPECT_EQ(client.Load("flag", "{").error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(client.Load("flag").error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(client.Index("flag", "1").state(), "READY");
  EXPECT_EQ(client.Index("flag", "1").reason(), "");
  EXPECT_EQ(client.Versions("flag"), (States{{1, kReady}}));
  EXPECT_TRUE(client.Forward("flag", 1, nullptr).ok());
  // Two models: an empty name is ambiguous.
  EXPECT_EQ(client.Forward("", 0, nullptr).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // The same name in both places is a start-up error.
  options.models.back().name = "m";
  EXPECT_EQ(Server::Start(options).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RepositoryTest, VersionsInModelMetadataModelReadyAndModelInfer) {
  Repo repo;
  repo.AddVersion("m", 1, kWeightsA);
  repo.AddVersion("m", 2, kWeightsB);
  repo.SetConfig("m", R"({"version_policy": {"all": {}}})");
  std::unique_ptr<Server> server = StartServer(RepoOptions(repo, ControlMode::kNone));
  ASSERT_NE(server, nullptr);
  Client client(server->port());
  inference::ModelMetadataRequest asked;
  asked.set_name("m");
  inference::ModelMetadataResponse metadata;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(client.oip().ModelMetadata(&context, asked, &metadata).ok());
  }
  EXPECT_EQ(std::vector<std::string>(metadata.versions().begin(), metadata.versions().end()),
            (std::vector<std::string>{"1", "2"}));
  inference::ModelReadyRequest ready_asked;
  ready_asked.set_name("m");
  ready_asked.set_version("3");
  inference::ModelReadyResponse ready;
  {
    grpc::ClientContext context;
    EXPECT_EQ(client.oip().ModelReady(&context, ready_asked, &ready).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  for (const char* version : {"1", "2", ""}) {
    SCOPED_TRACE(version);
    inference::ModelInferRequest request;
    request.set_model_name("m");
    request.set_model_version(version);
    auto* input = request.add_inputs();
    input->set_name("input");
    input->set_datatype("FP32");
    for (int64_t d : {int64_t{1}, int64_t{8}, kWidth}) input->add_shape(d);
    const std::vector<float> values = Input(8);
    input->mutable_contents()->mutable_fp32_contents()->Assign(values.begin(), values.end());
    inference::ModelInferResponse response;
    grpc::ClientContext context;
    ASSERT_TRUE(client.oip().ModelInfer(&context, request, &response).ok());
    const std::string want = *version == '1' ? "1" : "2";
    EXPECT_EQ(response.model_version(), want);
    const auto& got = response.outputs(0).contents().fp32_contents();
    EXPECT_TRUE(Near({got.begin(), got.end()}, Expected(want == "1" ? kWeightsA : kWeightsB, 8)));
  }
  inference::ModelInferRequest unknown;
  unknown.set_model_name("m");
  unknown.set_model_version("7");
  inference::ModelInferResponse response;
  grpc::ClientContext context;
  const grpc::Status status = client.oip().ModelInfer(&context, unknown, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(absl::StrContains(status.error_message(), "ready: 1, 2")) << status.error_message();
}

TEST(RepositoryTest, TheAdminTokenGuardsLoadAndUnload) {
  Repo repo;
  repo.AddVersion("m", 1, kWeightsA);
  const std::string admin = TempPath("admin-tokens");
  std::ofstream(admin) << "admin-secret\n";
  const std::string callers = TempPath("caller-tokens");
  std::ofstream(callers) << "caller-secret\n";
  ServerOptions options = RepoOptions(repo, ControlMode::kExplicit);
  options.admin_token_file = admin;
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  Client client(server->port());
  for (const std::string& token : {std::string(), std::string("wrong")}) {
    const grpc::Status denied = client.Load("m", "", token);
    EXPECT_EQ(denied.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_TRUE(absl::StrContains(denied.error_message(), "--admin-token-file"));
    EXPECT_EQ(client.Unload("m", token).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }
  EXPECT_TRUE(client.Load("m", "", "admin-secret").ok());
  EXPECT_TRUE(client.Unload("m", "admin-secret").ok());
  server.reset();
  // With callers' tokens too: the admin token is let through for the repository API, and a
  // caller's token is not an admin one.
  options.auth_token_file = callers;
  server = StartServer(options);
  ASSERT_NE(server, nullptr);
  Client both(server->port());
  EXPECT_TRUE(both.Load("m", "", "admin-secret").ok());
  EXPECT_EQ(both.Load("m", "", "caller-secret").error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(both.Load("m", "", "").error_code(), grpc::StatusCode::UNAUTHENTICATED);
}

// An IPv4 address of this machine other than loopback, or "" when it has none.
std::string NonLoopbackAddress() {
  ifaddrs* addresses = nullptr;
  if (getifaddrs(&addresses) != 0) return "";
  std::string found;
  for (ifaddrs* a = addresses; a != nullptr && found.empty(); a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN] = {};
    const auto* in = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
    inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text));
    if (std::string(text).rfind("127.", 0) != 0) found = text;
  }
  freeifaddrs(addresses);
  return found;
}

// Without --admin-token-file, load and unload are served to loopback callers only.
TEST(RepositoryTest, WithoutAdminTokensOnlyLoopbackCallersMayLoad) {
  const std::string address = NonLoopbackAddress();
  if (address.empty()) GTEST_SKIP() << "this machine has no address but loopback";
  Repo repo;
  repo.AddVersion("m", 1, kWeightsA);
  ServerOptions options = RepoOptions(repo, ControlMode::kExplicit);
  options.listen = "0.0.0.0:0";
  options.metrics_listen = "off";
  absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  Client local((*server)->port());
  EXPECT_TRUE(local.Load("m").ok());
  inference::GRPCInferenceService::Stub remote(grpc::CreateChannel(
      address + ":" + std::to_string((*server)->port()), grpc::InsecureChannelCredentials()));
  inference::RepositoryModelUnloadRequest request;
  request.set_model_name("m");
  inference::RepositoryModelUnloadResponse response;
  grpc::ClientContext context;
  const grpc::Status denied = remote.RepositoryModelUnload(&context, request, &response);
  EXPECT_EQ(denied.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(absl::StrContains(denied.error_message(), "loopback")) << denied.error_message();
  EXPECT_EQ(local.Versions("m"), (States{{1, kReady}}));
}

// Queued calls of a model being unloaded finish on their version; later ones are NOT_FOUND.
// A shutdown while a poll loads many models waits for the load under way, not for the poll's
// other models: Drain stops the loading.
TEST(RepositoryTest, ADrainDuringAPollDoesNotWaitForTheOtherModelsLoads) {
  Repo repo;
  // A 768-wide layer (9 MB, as a real layer takes a moment to read and pack), one file hard
  // linked as every model's version 1.
  constexpr int64_t kWide = 768;
  const std::string layer = (fs::path(repo.dir()) / "wide.safetensors").string();
  test::WriteSafetensorsFile(
      layer, test::MakeSafetensors({test::PatternTensor("in_proj_weight", {3 * kWide, kWide}, 1),
                                    test::PatternTensor("in_proj_bias", {3 * kWide}, 2),
                                    test::PatternTensor("out_proj.weight", {kWide, kWide}, 3),
                                    test::PatternTensor("out_proj.bias", {kWide}, 4)},
                                   {{"num_heads", "12"}}));
  CallReporter reporter;
  RegistryOptions options;
  options.repository = repo.dir();
  options.control_mode = ControlMode::kPoll;
  options.poll_interval = milliseconds(20);
  absl::StatusOr<std::unique_ptr<ModelRegistry>> registry = ModelRegistry::Load(options, &reporter);
  ASSERT_TRUE(registry.ok()) << registry.status();
  constexpr int kModels = 40;
  for (int i = 0; i < kModels; ++i) {
    const fs::path dir = fs::path(repo.dir()) / absl::StrCat("m", i) / "1";
    fs::create_directories(dir);
    fs::create_hard_link(layer, dir / "model.safetensors");
  }
  auto ready = [&] {
    int n = 0;
    for (const VersionStatus& status : (*registry)->Statuses()) {
      n += status.state == VersionState::kReady ? 1 : 0;
    }
    return n;
  };
  const auto deadline = std::chrono::steady_clock::now() + seconds(30);
  while (ready() == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(1));
  }
  ASSERT_GT(ready(), 0) << "the poll loaded nothing";
  (*registry)->Drain();
  EXPECT_LT(ready(), kModels / 2) << "the drain waited for the poll's loads";
}

TEST(RepositoryTest, UnloadAnswersTheQueuedCallsAndRefusesNewOnes) {
  Repo repo;
  repo.AddVersion("m", 1, kWeightsA);
  ServerOptions options = RepoOptions(repo, ControlMode::kExplicit);
  options.load_models = {"m"};
  // Calls wait in the queue for others to merge with, past all the test does before they run
  // (six callers queued, then three more calls), however slow the machine.
  options.max_queue_delay_us = 3'000'000;
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  Client client(server->port());
  constexpr int kCalls = 6;
  std::vector<grpc::Status> statuses(kCalls);
  std::vector<std::vector<float>> outputs(kCalls);
  std::vector<std::thread> callers;
  for (int i = 0; i < kCalls; ++i) {
    callers.emplace_back([&, i] { statuses[i] = client.Forward("m", 0, &outputs[i], 8, i); });
  }
  ASSERT_TRUE(WaitFor([&] { return server->pending_calls() == kCalls; }, milliseconds(5000)));
  ASSERT_TRUE(client.Unload("m").ok());
  EXPECT_EQ(client.Forward("m", 0, nullptr).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(client.Index("m", "1").state(), "UNLOADING");
  for (std::thread& caller : callers) caller.join();
  for (int i = 0; i < kCalls; ++i) {
    EXPECT_TRUE(statuses[i].ok()) << i << ": " << statuses[i].error_message();
    EXPECT_TRUE(Near(outputs[i], Expected(kWeightsA, 8, i))) << i;
  }
  // The last holder let go: the version is freed and UNAVAILABLE.
  EXPECT_TRUE(WaitFor([&] { return client.Index("m", "1").state() == "UNAVAILABLE"; }));
}

// 8 callers send 1x128 calls without pause while the server moves between two versions 20
// times: every call is answered OK with exactly one version's output, and none is lost.
TEST(RepositorySwapTest, TwentySwapsUnderLoadFailNoCall) {
  Repo repo;
  repo.AddVersion("m", 1, kWeightsA);
  repo.AddVersion("m", 2, kWeightsB);
  ServerOptions options = RepoOptions(repo, ControlMode::kExplicit);
  options.load_models = {"m"};
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  constexpr int64_t kLength = 128;
  const std::vector<float> want_a = Expected(kWeightsA, kLength);
  const std::vector<float> want_b = Expected(kWeightsB, kLength);
  ASSERT_FALSE(Near(want_a, want_b));
  std::atomic<bool> stop{false};
  std::atomic<int> sent{0}, ok{0}, from_a{0}, from_b{0}, wrong{0};
  std::vector<std::string> failures;
  std::mutex failures_mu;
  std::vector<std::thread> callers;
  for (int c = 0; c < 8; ++c) {
    callers.emplace_back([&] {
      Client client(server->port());
      while (!stop.load()) {
        std::vector<float> out;
        ++sent;
        const grpc::Status status = client.Forward("m", 0, &out, kLength);
        if (!status.ok()) {
          std::lock_guard lock(failures_mu);
          failures.push_back(status.error_message());
          continue;
        }
        ++ok;
        const bool a = Near(out, want_a), b = Near(out, want_b);
        if (a == b) ++wrong;
        (a ? from_a : from_b)++;
      }
    });
  }
  Client control(server->port());
  const auto start = std::chrono::steady_clock::now();
  for (int swap = 0; swap < 20; ++swap) {
    const int version = swap % 2 == 0 ? 1 : 2;
    const std::string config =
        "{\"version_policy\": {\"specific\": {\"versions\": [" + std::to_string(version) + "]}}}";
    ASSERT_TRUE(control.Load("m", config).ok());
    ASSERT_EQ(control.Versions("m")[version], kReady);
    std::this_thread::sleep_for(milliseconds(50));
  }
  stop.store(true);
  for (std::thread& caller : callers) caller.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(30));
  EXPECT_TRUE(failures.empty()) << failures.size() << " failed, first: " << failures.front();
  EXPECT_EQ(ok.load(), sent.load());
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_GT(from_a.load(), 0);
  EXPECT_GT(from_b.load(), 0);
  // A run counts its calls until it has answered them all: the last may just be on its way.
  EXPECT_TRUE(WaitFor([&] { return server->pending_calls() == 0; }));
  std::printf("swaps under load: %d calls, %d answered by version 1, %d by version 2\n", ok.load(),
              from_a.load(), from_b.load());
}

}  // namespace
}  // namespace attnserve::server::testing
