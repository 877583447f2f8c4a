#include <algorithm>
#include <iostream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/cli.h"
#include "nlohmann/json.hpp"

namespace attnserve::client {
namespace {

// A model's fields in the order and under the names of the proto's ModelInfo, walked by
// reflection: the table and the JSON print what the server describes without listing the
// fields again. Kinds come as one comma-separated string of their command-line names.
std::vector<std::pair<std::string, nlohmann::json>> Fields(const v1::ModelInfo& model) {
  const google::protobuf::Descriptor* descriptor = model.GetDescriptor();
  const google::protobuf::Reflection* reflection = model.GetReflection();
  std::vector<std::pair<std::string, nlohmann::json>> fields;
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* field = descriptor->field(i);
    nlohmann::json value;
    if (field->number() == v1::ModelInfo::kKindsFieldNumber) {
      std::vector<absl::string_view> names;
      for (int kind : model.kinds()) {
        names.push_back(KindFlagName(static_cast<v1::AttentionKind>(kind)));
      }
      value = absl::StrJoin(names, ",");
    } else if (field->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_INT32) {
      value = reflection->GetInt32(model, field);
    } else if (field->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_BOOL) {
      value = reflection->GetBool(model, field);
    } else if (field->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_UINT64) {
      value = reflection->GetUInt64(model, field);
    } else if (field->number() == v1::ModelInfo::kStateFieldNumber) {
      // READY, UNLOADING: the enum's name without its MODEL_STATE_ prefix.
      value = v1::ModelState_Name(model.state()).substr(std::string("MODEL_STATE_").size());
    } else {
      value = reflection->GetString(model, field);
    }
    fields.emplace_back(field->name(), std::move(value));
  }
  return fields;
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
  std::vector<std::vector<std::string>> rows(1);
  for (const auto& [name, value] : Fields(v1::ModelInfo())) {
    rows[0].push_back(absl::AsciiStrToUpper(name));
  }
  for (const v1::ModelInfo& m : models) {
    std::vector<std::string>& row = rows.emplace_back();
    for (const auto& [name, value] : Fields(m)) {
      row.push_back(value.is_string()    ? value.get<std::string>()
                    : value.is_boolean() ? (value.get<bool>() ? "yes" : "no")
                                         : value.dump());
    }
  }
  PrintColumns(rows);
}

void PrintJson(const std::vector<v1::ModelInfo>& models) {
  nlohmann::json list = nlohmann::json::array();
  for (const v1::ModelInfo& m : models) {
    nlohmann::json object = nlohmann::json::object();
    for (auto& [name, value] : Fields(m)) object[name] = std::move(value);
    list.push_back(std::move(object));
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
