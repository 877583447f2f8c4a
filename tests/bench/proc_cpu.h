#pragma once
// The CPU time (utime + stime, /proc/PID/stat) a benchmark's server has spent: what the serving
// benchmarks divide by calls. Shared by serving_load and grpc_floor.

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>

namespace attnserve::bench {

// utime + stime of `pid`, in seconds. Exits with a message naming `tool` when there is no such
// process (the server died or --pid is wrong): a figure without it would be meaningless.
inline double CpuSeconds(int pid, const char* tool) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t name_end = text.rfind(')');
  if (name_end == std::string::npos || name_end + 2 > text.size()) {
    std::fprintf(stderr, "%s: no process %d (--pid) to read the CPU time of\n", tool, pid);
    std::exit(2);
  }
  std::istringstream fields(text.substr(name_end + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && fields >> field; ++i) {
    if (i == 14 || i == 15) ticks += std::stod(field);
  }
  return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
}

}  // namespace attnserve::bench
