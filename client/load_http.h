#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.pb.h"
#include "client/http_connection.h"
#include "client/load_engine.h"

// The load tester's REST mode (bench --http): each v1 Forward request of the workload sent as
// the Open Inference Protocol's REST infer call, over keep-alive HTTP/1.1 connections.
namespace attnserve::client {

// How a REST call carries its tensors: JSON text, or Triton's binary tensor data extension
// (the JSON header, then little-endian bytes; the outputs come back as bytes too).
enum class RestEncoding { kJson, kBinary };

// A REST call, ready to send.
struct RestCall {
  std::string path;     // /v2/models/{model}[/versions/{v}]/infer
  std::string headers;  // each "Name: value\r\n"
  std::string body;
};

// The REST infer call of `request` to `model` (the request's own when it names one): its tensors
// named as the protocol's contract (input, lengths, context, context_lengths), its kind and
// return_attention as parameters, `token` (when not empty) as a bearer token.
absl::StatusOr<RestCall> EncodeRestInfer(const v1::ForwardRequest& request,
                                         const std::string& model, RestEncoding encoding,
                                         const std::string& token);

// Model `name` ("": the only one the repository index lists) at `version` (0: the newest),
// from the REST metadata: its name, version and widths (d_model, d_context) as a v1::ModelInfo.
absl::StatusOr<v1::ModelInfo> FindModelOverRest(const HttpUrl& url, const std::string& token,
                                                const std::string& name, uint64_t version,
                                                absl::Duration timeout);

// REST calls over a pool of keep-alive connections, a thread each, taking the calls handed in
// from one queue as each becomes free (HTTP/1.1 carries one call at a time on a connection, so
// a closed loop wants as many connections as calls in flight). Each request is encoded once,
// on its first use, and shared by every connection.
class HttpLoadSender final : public LoadSender {
 public:
  // `model` names the model for requests that name none.
  HttpLoadSender(HttpUrl url, std::string model, RestEncoding encoding, std::string token,
                 absl::Duration timeout, int connections);
  ~HttpLoadSender() override;

  void SendAsync(const WorkItem& item, std::function<void(absl::Status)> done) const override;
  absl::Status Send(const WorkItem& item) const override;
  int connections() const override { return static_cast<int>(threads_.size()); }

 private:
  // A connection's thread: takes calls in turn until stopped.
  void Serve() const;
  // `item`'s REST call, encoded on first use.
  absl::StatusOr<std::shared_ptr<const RestCall>> Encoded(const WorkItem& item) const;
  // One call on `connection`.
  absl::Status Exchange(HttpConnection& connection, const WorkItem& item) const;

  const HttpUrl url_;
  const std::string model_;
  const RestEncoding encoding_;
  const std::string token_;
  const absl::Duration timeout_;

  mutable std::mutex encoded_mu_;
  mutable std::map<const WorkItem*, std::shared_ptr<const RestCall>> encoded_;

  mutable std::mutex check_mu_;
  mutable HttpConnection check_connection_;  // Send's, guarded by check_mu_

  mutable std::mutex mu_;
  mutable std::condition_variable changed_;
  mutable std::deque<std::pair<const WorkItem*, std::function<void(absl::Status)>>> queue_;
  bool stopping_ = false;  // guarded by mu_
  std::vector<std::thread> threads_;
};

}  // namespace attnserve::client
