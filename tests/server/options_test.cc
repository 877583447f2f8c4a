// Unit tests of the parts that need no server: --model parsing, option checks, status mapping.

#include "server/options.h"

#include <sys/resource.h>

#include <cstdint>

#include "gtest/gtest.h"
#include "server/frontends/grpc_status.h"
#include "tests/common/sanitizers.h"

namespace attnserve::server {
namespace {

TEST(ParseModelFlagTest, NameAndPath) {
  auto m = ParseModelFlag("enc=/models/layer.safetensors");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->name, "enc");
  EXPECT_EQ(m->path, "/models/layer.safetensors");
  EXPECT_FALSE(m->load.num_heads.has_value());
  EXPECT_EQ(m->precision, core::Precision::kF32);
}

TEST(ParseModelFlagTest, EveryOption) {
  auto m =
      ParseModelFlag("x=/m/a:b.safetensors:num_heads=12:prefix=encoder.layers.0.:precision=bf16");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->path, "/m/a:b.safetensors");  // a ':' inside PATH survives
  EXPECT_EQ(m->load.num_heads, 12);
  EXPECT_EQ(m->load.prefix, "encoder.layers.0.");
  EXPECT_EQ(m->precision, core::Precision::kBF16);
}

TEST(ParseModelFlagTest, Refusals) {
  for (const char* bad : {"noequals", "=path", "name=", "x=p:num_heads=0", "x=p:num_heads=abc",
                          "x=p:precision=f16", "x=:num_heads=2"}) {
    EXPECT_EQ(ParseModelFlag(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(CheckOptionsTest, RepositoryFlagsGoTogether) {
  ServerOptions o;
  o.model_control_mode = ControlMode::kPoll;
  EXPECT_EQ(CheckOptions(o).code(), absl::StatusCode::kInvalidArgument);  // no repository
  o.model_repository = "/models";
  EXPECT_TRUE(CheckOptions(o).ok());
  o.load_models = {"enc"};
  EXPECT_EQ(CheckOptions(o).code(), absl::StatusCode::kInvalidArgument);  // not explicit
  o.model_control_mode = ControlMode::kExplicit;
  EXPECT_TRUE(CheckOptions(o).ok());
  o.repository_poll_interval = std::chrono::milliseconds(0);
  EXPECT_EQ(CheckOptions(o).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseControlMode("poll").value(), ControlMode::kPoll);
  EXPECT_EQ(ParseControlMode("explicit").value(), ControlMode::kExplicit);
  EXPECT_EQ(ParseControlMode("none").value(), ControlMode::kNone);
  EXPECT_EQ(ParseControlMode("POLL").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CheckOptionsTest, HeapTrimIsNeverOrAtMostADay) {
  ServerOptions o;
  EXPECT_EQ(o.heap_trim_interval, std::chrono::seconds(10));
  for (int64_t ms : {0, 10, 86'400'000}) {
    o.heap_trim_interval = std::chrono::milliseconds(ms);
    EXPECT_TRUE(CheckOptions(o).ok()) << ms;
  }
  for (int64_t ms : {-1, 1, 86'400'001}) {
    o.heap_trim_interval = std::chrono::milliseconds(ms);
    EXPECT_EQ(CheckOptions(o).code(), absl::StatusCode::kInvalidArgument) << ms;
  }
}

TEST(CheckOptionsTest, RefusesBadListenAndDuplicates) {
  ServerOptions o;
  EXPECT_TRUE(CheckOptions(o).ok());
  o.listen = "no-port";
  EXPECT_FALSE(CheckOptions(o).ok());
  o.listen = "localhost:70000";
  EXPECT_FALSE(CheckOptions(o).ok());
  o.listen = "[::]:0";
  EXPECT_TRUE(CheckOptions(o).ok());
  o.models.resize(2);
  o.models[0].name = o.models[1].name = "same";
  EXPECT_FALSE(CheckOptions(o).ok());
}

TEST(CheckOptionsTest, MetricsListenIsHostPortOrOff) {
  ServerOptions o;
  EXPECT_EQ(o.metrics_listen, "0.0.0.0:8002");
  for (const char* good : {"127.0.0.1:9464", "[::1]:0", "off", ""}) {
    o.metrics_listen = good;
    EXPECT_TRUE(CheckOptions(o).ok()) << good;
  }
  for (const char* bad : {"8002", "localhost:99999", "on", ":8002"}) {
    o.metrics_listen = bad;
    const absl::Status status = CheckOptions(o);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(status.message().find("--metrics-listen"), std::string::npos) << status;
  }
}

// The KV cache's pool reserves twice its budget of address space: under ulimit -v, the default
// budget takes an eighth of the limit at most, and an explicit one is left as given.
TEST(MakeSessionOptionsTest, TheDefaultKvCacheFitsAnAddressSpaceLimit) {
  if (attnserve::test::kSanitized) GTEST_SKIP() << "a sanitizer's own mappings pass any limit";
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_AS, &old), 0);
  constexpr int64_t kLimit = int64_t{1} << 33;  // 8 GiB (far above what this process maps)
  if (old.rlim_cur != RLIM_INFINITY && old.rlim_cur < static_cast<rlim_t>(kLimit)) {
    GTEST_SKIP() << "this process's own address space limit is lower";
  }
  rlimit tight = old;
  tight.rlim_cur = kLimit;
  ASSERT_EQ(setrlimit(RLIMIT_AS, &tight), 0);
  ServerOptions options;
  const int64_t by_default = MakeSessionOptions(options).kv_cache_bytes;
  options.kv_cache_mib = 4096;
  const int64_t explicit_budget = MakeSessionOptions(options).kv_cache_bytes;
  ASSERT_EQ(setrlimit(RLIMIT_AS, &old), 0);
  EXPECT_GT(by_default, 0);
  EXPECT_LE(by_default, kLimit / 8);
  EXPECT_EQ(explicit_budget, int64_t{4096} << 20);
}

TEST(GrpcStatusTest, SameCodeAndMessage) {
  const grpc::Status s = ToGrpcStatus(absl::NotFoundError("no model 'x'"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(s.error_message(), "no model 'x'");
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_EQ(ToGrpcStatus(absl::ResourceExhaustedError("full")).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
}

}  // namespace
}  // namespace attnserve::server
