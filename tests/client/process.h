#pragma once

// Real processes for the command-line tests: run attnserve-client to completion, and keep a
// real attnserve server running on a free loopback port for the length of a test suite.

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace attnserve::test {

// What a finished program left behind.
struct ProgramResult {
  int exit_code = -1;  // -1: killed (timed out or by a signal)
  std::string out;
  std::string err;
};

// The exit code and both outputs, for a failed expectation's message.
std::string Describe(const ProgramResult& r);

// Runs argv[0] with its arguments, killing it after `timeout`.
ProgramResult RunProgram(const std::vector<std::string>& argv,
                         absl::Duration timeout = absl::Seconds(120));

// An attnserve process listening on 127.0.0.1 at a port the kernel picked.
class ServerProcess {
 public:
  // Starts `server_binary --listen 127.0.0.1:0 --port-file ...` plus `extra_args` (no metrics
  // port, no REST port unless they give --http-listen), and waits (bounded) until it wrote its
  // port.
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start(
      const std::string& server_binary, const std::vector<std::string>& extra_args);

  ~ServerProcess();

  // "127.0.0.1:PORT".
  const std::string& target() const { return target_; }

  // Sends SIGTERM and waits (bounded); returns the exit code, -1 when it had to be killed.
  int Stop();

  // The server's log so far (stderr and stdout), for failure messages.
  std::string Log() const;

 private:
  ServerProcess(pid_t pid, std::string dir) : pid_(pid), dir_(std::move(dir)) {}

  pid_t pid_;
  std::string dir_;
  std::string target_;
};

// A loopback port on which nothing listens (bound, then closed), for "unreachable" tests.
int ClosedLoopbackPort();

}  // namespace attnserve::test
