// http_load: drives the REST port of a server with N keep-alive connections in a closed loop
// (one thread each, raw sockets: the client costs little and the same per call) and prints one
// JSON line like serving_load's: calls/s, latency percentiles, statuses, the server's CPU per
// call (/proc/PID/stat) and its resident memory. With --idle N it first opens N more
// connections that stay silent and --slow N that send a header byte a second, held open (and
// reopened when the server closes them) for the whole run: the load's p99 beside them.
//
//   http_load --port 8000 --pid PID --method json|binary|health --batch 1 --seq 16
//             --callers 8 --seconds 5 [--idle 500 --slow 500]

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"

namespace {

using Clock = std::chrono::steady_clock;

double CpuSeconds(int pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t name_end = text.rfind(')');
  if (name_end == std::string::npos) {
    std::fprintf(stderr, "http_load: no process %d (--pid)\n", pid);
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

// VmRSS of `pid` in MiB.
double RssMib(int pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  }
  return 0;
}

struct Options {
  int port = 8000, pid = 0, batch = 1, seq = 16, width = 256, callers = 8, idle = 0, slow = 0;
  std::string method = "json", model = "demo";
  double seconds = 5, warmup = 1;
};

int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return -1;
  }
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

// The request bytes of one call, serialised once.
std::string Request(const Options& o) {
  if (o.method == "health") return "GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n";
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> x(static_cast<size_t>(o.batch) * o.seq * o.width);
  for (float& v : x) v = normal(rng);
  const std::string shape = "[" + std::to_string(o.batch) + "," + std::to_string(o.seq) + "," +
                            std::to_string(o.width) + "]";
  std::string body, extra;
  if (o.method == "json") {
    body =
        "{\"inputs\":[{\"name\":\"input\",\"datatype\":\"FP32\",\"shape\":" + shape + ",\"data\":[";
    char number[32];
    for (size_t i = 0; i < x.size(); ++i) {
      std::snprintf(number, sizeof(number), i ? ",%.9g" : "%.9g", x[i]);
      body += number;
    }
    body += "]}]}";
  } else {
    const std::string json =
        "{\"inputs\":[{\"name\":\"input\",\"datatype\":\"FP32\",\"shape\":" + shape +
        ",\"parameters\":{\"binary_data_size\":" + std::to_string(x.size() * 4) +
        "}}],\"parameters\":{\"binary_data_output\":true}}";
    body = json + std::string(reinterpret_cast<const char*>(x.data()), x.size() * 4);
    extra = "Inference-Header-Content-Length: " + std::to_string(json.size()) + "\r\n";
  }
  return "POST /v2/models/" + o.model +
         "/infer HTTP/1.1\r\nHost: x\r\nContent-Type: " + "application/json\r\n" + extra +
         "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

// Reads one reply from `fd` into `buffer`; its status, or 0 when the connection failed.
int ReadReply(int fd, std::string& buffer) {
  buffer.clear();
  char chunk[65536];
  size_t header_end = std::string::npos, length = 0;
  while (true) {
    if (header_end == std::string::npos) {
      header_end = buffer.find("\r\n\r\n");
      if (header_end != std::string::npos) {
        const size_t at = buffer.find("Content-Length: ");
        length = at == std::string::npos ? 0 : std::stoul(buffer.substr(at + 16));
      }
    }
    if (header_end != std::string::npos && buffer.size() >= header_end + 4 + length) break;
    const ssize_t n = recv(fd, chunk, sizeof(chunk), 0);
    if (n <= 0) return 0;
    buffer.append(chunk, n);
  }
  int status = 0;
  std::sscanf(buffer.c_str(), "HTTP/1.%*d %d", &status);
  return status;
}

double Percentile(std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  return sorted[std::min(sorted.size() - 1, static_cast<size_t>(p / 100 * sorted.size()))];
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"http_load: closed-loop load on the REST port"};
  app.add_option("--port", o.port);
  app.add_option("--pid", o.pid, "the server's pid, for its CPU per call");
  app.add_option("--method", o.method, "json, binary or health");
  app.add_option("--model", o.model);
  app.add_option("--batch", o.batch);
  app.add_option("--seq", o.seq);
  app.add_option("--width", o.width);
  app.add_option("--callers", o.callers);
  app.add_option("--seconds", o.seconds);
  app.add_option("--idle", o.idle, "connections held open without a byte");
  app.add_option("--slow", o.slow, "connections sending a header byte a second");
  CLI11_PARSE(app, argc, argv);

  std::atomic<bool> stop{false}, measuring{false};
  // The idle and slow connections, each reopened when the server closes it.
  std::vector<std::thread> holders;
  const int holder_threads = (o.idle + o.slow) > 0 ? 4 : 0;
  for (int t = 0; t < holder_threads; ++t) {
    holders.emplace_back([&, t] {
      std::vector<int> fds;
      for (int i = t; i < o.idle + o.slow; i += holder_threads) fds.push_back(Connect(o.port));
      while (!stop.load()) {
        for (size_t i = 0; i < fds.size(); ++i) {
          const bool slow = static_cast<int>(i * holder_threads + t) >= o.idle;
          pollfd p{fds[i], POLLIN, 0};
          if (fds[i] < 0 || (poll(&p, 1, 0) > 0)) {  // closed by the server: reopen
            if (fds[i] >= 0) close(fds[i]);
            fds[i] = Connect(o.port);
            if (slow && fds[i] >= 0) send(fds[i], "GET /v2 HTTP/1.1\r\n", 18, MSG_NOSIGNAL);
          } else if (slow) {
            send(fds[i], "X", 1, MSG_NOSIGNAL);
          }
        }
        std::this_thread::sleep_for(std::chrono::seconds(1));
      }
      for (int fd : fds) close(fd);
    });
  }
  if (holder_threads > 0) std::this_thread::sleep_for(std::chrono::seconds(2));

  const std::string request = Request(o);
  std::mutex mu;
  std::map<int, int64_t> statuses;
  std::vector<double> latencies;
  std::vector<std::thread> callers;
  for (int c = 0; c < o.callers; ++c) {
    callers.emplace_back([&] {
      int fd = Connect(o.port);
      std::string reply;
      std::map<int, int64_t> my_statuses;
      std::vector<double> my_latencies;
      while (!stop.load()) {
        const auto start = Clock::now();
        int status = 0;
        if (fd >= 0 && send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
                           static_cast<ssize_t>(request.size())) {
          status = ReadReply(fd, reply);
        }
        if (status == 0 || reply.find("Connection: close") != std::string::npos) {
          if (fd >= 0) close(fd);
          fd = Connect(o.port);
        }
        if (measuring.load()) {
          ++my_statuses[status];
          my_latencies.push_back(
              std::chrono::duration<double, std::milli>(Clock::now() - start).count());
        }
      }
      if (fd >= 0) close(fd);
      std::lock_guard lock(mu);
      for (const auto& [s, n] : my_statuses) statuses[s] += n;
      latencies.insert(latencies.end(), my_latencies.begin(), my_latencies.end());
    });
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(o.warmup));
  const double cpu0 = o.pid ? CpuSeconds(o.pid) : 0;
  const auto t0 = Clock::now();
  measuring.store(true);
  std::this_thread::sleep_for(std::chrono::duration<double>(o.seconds));
  measuring.store(false);
  const double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
  const double cpu1 = o.pid ? CpuSeconds(o.pid) : 0;
  const double rss = o.pid ? RssMib(o.pid) : 0;
  stop.store(true);
  for (auto& t : callers) t.join();
  for (auto& t : holders) t.join();

  int64_t calls = 0, ok = 0;
  std::string statuses_json;
  for (const auto& [status, count] : statuses) {
    calls += count;
    if (status == 200) ok = count;
    statuses_json += (statuses_json.empty() ? "\"" : ", \"") + std::to_string(status) +
                     "\": " + std::to_string(count);
  }
  std::sort(latencies.begin(), latencies.end());
  std::printf(
      "{\"method\": \"http-%s\", \"batch\": %d, \"seq\": %d, \"callers\": %d, \"idle\": %d, "
      "\"slow\": %d, \"calls\": %lld, \"ok\": %lld, \"statuses\": {%s}, \"calls_per_s\": %.1f, "
      "\"ok_per_s\": %.1f, \"server_cpu_us_per_call\": %.1f, \"p50_ms\": %.3f, \"p99_ms\": %.3f, "
      "\"server_rss_mib\": %.1f}\n",
      o.method.c_str(), o.batch, o.seq, o.callers, o.idle, o.slow, static_cast<long long>(calls),
      static_cast<long long>(ok), statuses_json.c_str(), calls / elapsed, ok / elapsed,
      (cpu1 - cpu0) / std::max<int64_t>(calls, 1) * 1e6, Percentile(latencies, 50),
      Percentile(latencies, 99), rss);
  return 0;
}
