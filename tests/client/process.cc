#include "tests/client/process.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tests/common/temp_dir.h"

extern char** environ;

namespace attnserve::test {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
}

// Starts argv with stdout and stderr sent to files; returns the pid or -1.
pid_t Spawn(const std::vector<std::string>& argv, const std::string& out, const std::string& err) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<char*> args;
  for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, args[0], &actions, nullptr, args.data(), environ) != 0) pid = -1;
  posix_spawn_file_actions_destroy(&actions);
  return pid;
}

// Waits for pid up to `timeout`, then kills it; returns its exit code or -1.
int WaitBounded(pid_t pid, absl::Duration timeout) {
  const absl::Time give_up = absl::Now() + timeout;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (absl::Now() > give_up) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace

std::string Describe(const ProgramResult& r) {
  return absl::StrCat("exit ", r.exit_code, "\nstdout:\n", r.out, "\nstderr:\n", r.err);
}

ProgramResult RunProgram(const std::vector<std::string>& argv, absl::Duration timeout) {
  const std::string dir = MakeTempDir("client");
  const std::string out = dir + "/stdout", err = dir + "/stderr";
  ProgramResult result;
  pid_t pid = Spawn(argv, out, err);
  if (pid < 0) {
    result.err = absl::StrCat("cannot start ", argv[0]);
    return result;
  }
  result.exit_code = WaitBounded(pid, timeout);
  result.out = ReadFile(out);
  result.err = ReadFile(err);
  return result;
}

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::Start(
    const std::string& server_binary, const std::vector<std::string>& extra_args) {
  const std::string dir = MakeTempDir("client");
  const std::string port_file = dir + "/port";
  // No metrics or REST port unless asked for: the default ones are machine-wide, and tests run
  // side by side.
  std::vector<std::string> argv = {server_binary, "--listen", "127.0.0.1:0",
                                   "--port-file", port_file,  "--metrics-listen=off"};
  if (std::none_of(extra_args.begin(), extra_args.end(),
                   [](const std::string& arg) { return arg.rfind("--http-listen", 0) == 0; })) {
    argv.push_back("--http-listen=off");
  }
  argv.insert(argv.end(), extra_args.begin(), extra_args.end());
  pid_t pid = Spawn(argv, dir + "/server.out", dir + "/server.err");
  if (pid < 0) return absl::InternalError(absl::StrCat("cannot start ", server_binary));
  std::unique_ptr<ServerProcess> server(new ServerProcess(pid, dir));
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (absl::Now() < give_up) {
    // The server writes "PORT\n": without the newline the file may still be half written.
    std::string port = ReadFile(port_file);
    if (!port.empty() && port.back() == '\n') {
      port.pop_back();
      server->target_ = absl::StrCat("127.0.0.1:", port);
      return server;
    }
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      server->pid_ = -1;
      return absl::InternalError(absl::StrCat("attnserve exited at start:\n", server->Log()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return absl::DeadlineExceededError(absl::StrCat("attnserve wrote no port:\n", server->Log()));
}

ServerProcess::~ServerProcess() { Stop(); }

int ServerProcess::Stop() {
  if (pid_ < 0) return -1;
  kill(pid_, SIGTERM);
  const int code = WaitBounded(pid_, absl::Seconds(30));
  pid_ = -1;
  return code;
}

std::string ServerProcess::Log() const {
  return ReadFile(dir_ + "/server.err") + ReadFile(dir_ + "/server.out");
}

int ClosedLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

}  // namespace attnserve::test
