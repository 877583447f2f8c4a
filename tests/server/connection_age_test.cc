// --max-connection-age: the server ends each client connection after its age (so clients
// re-resolve and reach new replicas), and never when the age is 0.

#include <chrono>
#include <memory>

#include "grpcpp/channel.h"
#include "gtest/gtest.h"
#include "server/options.h"
#include "server/server.h"
#include "tests/server/test_util.h"

namespace attnserve::server {
namespace {

using testing::Connect;
using testing::HealthCheck;
using testing::StartServer;

// Connects, then reports whether the connection left READY within `wait`.
bool ConnectionEndsWithin(const Server& server, std::chrono::milliseconds wait) {
  std::shared_ptr<grpc::Channel> channel = Connect(server.port());
  EXPECT_TRUE(HealthCheck(channel.get(), "").ok());
  EXPECT_EQ(channel->GetState(/*try_to_connect=*/false), GRPC_CHANNEL_READY);
  const auto deadline = std::chrono::system_clock::now() + wait;
  while (channel->GetState(/*try_to_connect=*/false) == GRPC_CHANNEL_READY) {
    if (!channel->WaitForStateChange(GRPC_CHANNEL_READY, deadline)) return false;
  }
  return true;
}

TEST(ConnectionAgeTest, ServerEndsConnectionsAfterTheirAge) {
  ServerOptions options;
  options.max_connection_age_s = 1;
  options.max_connection_age_grace_s = 1;
  std::unique_ptr<Server> server = StartServer(options);
  // 1 s + gRPC's 10 % jitter, with room for a loaded machine.
  EXPECT_TRUE(ConnectionEndsWithin(*server, std::chrono::seconds(4)));
}

TEST(ConnectionAgeTest, ZeroKeepsConnections) {
  ServerOptions options;
  options.max_connection_age_s = 0;
  std::unique_ptr<Server> server = StartServer(options);
  EXPECT_FALSE(ConnectionEndsWithin(*server, std::chrono::milliseconds(2500)));
}

TEST(ConnectionAgeTest, OutOfRangeIsRefused) {
  ServerOptions options;
  EXPECT_TRUE(CheckOptions(options).ok());
  options.max_connection_age_s = -1;
  EXPECT_EQ(CheckOptions(options).code(), absl::StatusCode::kInvalidArgument);
  options.max_connection_age_s = 3'000'000;  // more than gRPC's int milliseconds hold
  EXPECT_EQ(CheckOptions(options).code(), absl::StatusCode::kInvalidArgument);
  options.max_connection_age_s = 10;
  options.max_connection_age_grace_s = -5;
  EXPECT_EQ(CheckOptions(options).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace attnserve::server
