#pragma once

// Clients of the REST port for the service tests: libcurl for well-formed calls (TLS, mTLS,
// tokens), and a raw socket for the bytes a broken or hostile client sends.

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace attnserve::server::testing {

// One HTTP reply.
struct HttpReply {
  int status = 0;  // 0: no reply (the transport failed; `error` says why)
  std::string body;
  std::map<std::string, std::string> headers;  // names lower-cased
  std::string error;
};

// TLS settings of an HttpCall (all empty: plain HTTP).
struct HttpTls {
  std::string ca_path;           // trust this CA (https://)
  std::string client_cert_path;  // present this certificate (mTLS)
  std::string client_key_path;
};

// A call with libcurl: `method` `url`, `body` sent as is, `headers` as "Name: value".
HttpReply HttpCall(const std::string& method, const std::string& url, const std::string& body = "",
                   const std::vector<std::string>& headers = {}, const HttpTls& tls = {});

// A TCP connection to 127.0.0.1:`port`, or -1.
int ConnectLoopback(int port);

// Sends all of `bytes` on `fd`; the bytes sent (fewer when the connection broke first).
size_t SendAll(int fd, const std::string& bytes);

// Sends `bytes` to 127.0.0.1:`port` over a fresh connection, then reads until the server
// closes it or `timeout` passes; everything it answered. `close_write` half-closes after
// sending (a client that sent all it ever will).
std::string RawExchange(int port, const std::string& bytes,
                        std::chrono::milliseconds timeout = std::chrono::seconds(5),
                        bool close_write = false);

// The status code of the first reply in `raw` (0 when there is none).
int RawStatus(const std::string& raw);

}  // namespace attnserve::server::testing
