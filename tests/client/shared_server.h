#pragma once

// The fixture of the command-line suites that run attnserve-client against one real attnserve:
// the server is started once per suite (starting it per test would dominate the run time), and
// each test gets a fresh directory for its files. Needs ATTNSERVE_SERVER_BIN, which
// tests/client/CMakeLists.txt defines.

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "tests/client/process.h"
#include "tests/common/temp_dir.h"

namespace attnserve::test {

// A suite derives from this and calls StartServer from its own SetUpTestSuite.
class SharedServerTest : public ::testing::Test {
 protected:
  // Starts attnserve with `args` after its --listen and --port-file; when it cannot start,
  // server_ stays null and every test of the suite fails in SetUp.
  static void StartServer(const std::vector<std::string>& args) {
    absl::StatusOr<std::unique_ptr<ServerProcess>> started =
        ServerProcess::Start(ATTNSERVE_SERVER_BIN, args);
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = started->release();
  }

  // Stops the suite's server.
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }

  // Checks the server started, and makes the test's directory.
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    dir_ = MakeTempDir("client");
  }

  // The running suite's server. One pointer serves every derived suite: gtest runs a suite's
  // set-up, tests and tear-down before the next suite's.
  inline static ServerProcess* server_ = nullptr;
  // This test's own directory.
  std::string dir_;
};

}  // namespace attnserve::test
