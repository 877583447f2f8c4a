#include <algorithm>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/cli.h"
#include "nlohmann/json.hpp"

namespace attnserve::client {
namespace {

// "bidirectional,causal,cross" for a model's kinds.
std::string KindList(const v1::ModelInfo& model) {
  std::vector<absl::string_view> names;
  for (int kind : model.kinds())
    names.push_back(KindFlagName(static_cast<v1::AttentionKind>(kind)));
  return absl::StrJoin(names, ",");
}

// Prints rows as columns as wide as their widest cell (layout names and paths vary a lot).
void PrintColumns(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> widths;
  for (const auto& row : rows) {
    widths.resize(std::max(widths.size(), row.size()));
    for (size_t i = 0; i < row.size(); ++i) widths[i] = std::max(widths[i], row[i].size());
  }
  for (const auto& row : rows) {
    std::string line;
    for (size_t i = 0; i < row.size(); ++i) {
      const size_t pad = i + 1 < row.size() ? widths[i] - row[i].size() + 2 : 0;
      absl::StrAppend(&line, row[i], std::string(pad, ' '));
    }
    std::cout << line << "\n";
  }
}

void PrintTable(const std::vector<v1::ModelInfo>& models) {
  std::vector<std::vector<std::string>> rows = {{"NAME", "D_MODEL", "D_CONTEXT", "HEADS",
                                                 "HEAD_DIM", "LAYOUT", "BIAS", "OUT_PROJ",
                                                 "PRECISION", "KINDS", "SOURCE"}};
  for (const v1::ModelInfo& m : models) {
    rows.push_back({m.name(), absl::StrCat(m.d_model()), absl::StrCat(m.d_context()),
                    absl::StrCat(m.num_heads()), absl::StrCat(m.head_dim()), m.layout(),
                    m.has_bias() ? "yes" : "no", m.has_output_projection() ? "yes" : "no",
                    m.precision(), KindList(m), m.source()});
  }
  PrintColumns(rows);
}

void PrintJson(const std::vector<v1::ModelInfo>& models) {
  nlohmann::json list = nlohmann::json::array();
  for (const v1::ModelInfo& m : models) {
    list.push_back({{"name", m.name()},
                    {"d_model", m.d_model()},
                    {"d_context", m.d_context()},
                    {"num_heads", m.num_heads()},
                    {"head_dim", m.head_dim()},
                    {"layout", m.layout()},
                    {"has_bias", m.has_bias()},
                    {"has_output_projection", m.has_output_projection()},
                    {"precision", m.precision()},
                    {"kinds", KindList(m)},
                    {"source", m.source()}});
  }
  std::cout << list.dump(2) << "\n";
}

}  // namespace

absl::Status RunModels(const ConnectionFlags& connection, bool json) {
  absl::StatusOr<std::vector<v1::ModelInfo>> models = ConnectFromFlags(connection)->ListModels();
  if (!models.ok()) return models.status();
  json ? PrintJson(*models) : PrintTable(*models);
  return absl::OkStatus();
}

absl::Status RunHealth(const ConnectionFlags& connection, const std::string& service) {
  absl::StatusOr<AttentionClient::ServingStatus> status =
      ConnectFromFlags(connection)->Health(service);
  if (!status.ok()) return status.status();
  const std::string& name = grpc::health::v1::HealthCheckResponse::ServingStatus_Name(*status);
  std::cout << name << "\n";
  if (*status != grpc::health::v1::HealthCheckResponse::SERVING) {
    return absl::UnavailableError(absl::StrCat("health of '", service, "' is ", name));
  }
  return absl::OkStatus();
}

}  // namespace attnserve::client
