#include "server/transport/reflection.h"

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "grpc/health/v1/health.pb.h"
#include "grpc/reflection/v1/reflection.grpc.pb.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/impl/server_builder_plugin.h"
#include "grpcpp/impl/server_initializer.h"

namespace attnserve::server {
namespace {

namespace rv1 = grpc::reflection::v1;

// What gRPC's ProtoServerReflectionPlugin::name() answers.
constexpr char kV1alphaPluginName[] = "proto_server_reflection";
using google::protobuf::DescriptorPool;
using google::protobuf::FileDescriptor;

// grpc.reflection.v1 over the generated descriptor pool: the same answers gRPC's v1alpha
// service gives (files with their dependencies, each file once per stream), under the v1 name.
class ReflectionV1Service final : public rv1::ServerReflection::Service {
 public:
  // `services` is the server's list of registered service names, filled in as the server
  // builds; it lives as long as the server.
  void SetServiceList(const std::vector<std::string>* services) { services_ = services; }

  grpc::Status ServerReflectionInfo(
      grpc::ServerContext* /*context*/,
      grpc::ServerReaderWriter<rv1::ServerReflectionResponse, rv1::ServerReflectionRequest>* stream)
      override {
    std::set<std::string> sent;  // files already sent on this stream
    rv1::ServerReflectionRequest request;
    while (stream->Read(&request)) {
      rv1::ServerReflectionResponse response;
      response.set_valid_host(request.host());
      *response.mutable_original_request() = request;
      Answer(request, &sent, &response);
      if (!stream->Write(response)) break;
    }
    return grpc::Status::OK;
  }

 private:
  void Answer(const rv1::ServerReflectionRequest& request, std::set<std::string>* sent,
              rv1::ServerReflectionResponse* response) const {
    const DescriptorPool* pool = DescriptorPool::generated_pool();
    switch (request.message_request_case()) {
      case rv1::ServerReflectionRequest::kListServices:
        if (services_ != nullptr) {
          for (const std::string& name : *services_) {
            response->mutable_list_services_response()->add_service()->set_name(name);
          }
        }
        return;
      case rv1::ServerReflectionRequest::kFileByFilename:
        return SendFile(pool->FindFileByName(request.file_by_filename()), sent, response);
      case rv1::ServerReflectionRequest::kFileContainingSymbol:
        return SendFile(pool->FindFileContainingSymbol(request.file_containing_symbol()), sent,
                        response);
      case rv1::ServerReflectionRequest::kFileContainingExtension: {
        const auto* type =
            pool->FindMessageTypeByName(request.file_containing_extension().containing_type());
        const auto* extension =
            type == nullptr ? nullptr
                            : pool->FindExtensionByNumber(
                                  type, request.file_containing_extension().extension_number());
        return SendFile(extension == nullptr ? nullptr : extension->file(), sent, response);
      }
      case rv1::ServerReflectionRequest::kAllExtensionNumbersOfType: {
        const auto* type = pool->FindMessageTypeByName(request.all_extension_numbers_of_type());
        if (type == nullptr) return Error(grpc::StatusCode::NOT_FOUND, "type not found", response);
        std::vector<const google::protobuf::FieldDescriptor*> extensions;
        pool->FindAllExtensions(type, &extensions);
        auto* numbers = response->mutable_all_extension_numbers_response();
        numbers->set_base_type_name(type->full_name());
        for (const auto* extension : extensions) numbers->add_extension_number(extension->number());
        return;
      }
      default:
        return Error(grpc::StatusCode::UNIMPLEMENTED, "request type not supported", response);
    }
  }

  // The file and those it imports that this stream has not had yet.
  static void SendFile(const FileDescriptor* file, std::set<std::string>* sent,
                       rv1::ServerReflectionResponse* response) {
    if (file == nullptr) return Error(grpc::StatusCode::NOT_FOUND, "not found", response);
    std::vector<const FileDescriptor*> pending{file};
    auto* files = response->mutable_file_descriptor_response();
    while (!pending.empty()) {
      const FileDescriptor* next = pending.back();
      pending.pop_back();
      if (!sent->insert(next->name()).second) continue;
      google::protobuf::FileDescriptorProto proto;
      next->CopyTo(&proto);
      files->add_file_descriptor_proto(proto.SerializeAsString());
      for (int i = 0; i < next->dependency_count(); ++i) pending.push_back(next->dependency(i));
    }
  }

  static void Error(grpc::StatusCode code, const char* message,
                    rv1::ServerReflectionResponse* response) {
    response->mutable_error_response()->set_error_code(code);
    response->mutable_error_response()->set_error_message(message);
  }

  const std::vector<std::string>* services_ = nullptr;
};

// Registers the v1 service as the v1alpha plugin does its own, so it sees the final list.
class ReflectionV1Plugin final : public grpc::ServerBuilderPlugin {
 public:
  std::string name() override { return "attnserve_reflection_v1"; }
  void InitServer(grpc::ServerInitializer* si) override { si->RegisterService(service_); }
  void Finish(grpc::ServerInitializer* si) override {
    service_->SetServiceList(si->GetServiceList());
  }
  void ChangeArguments(const std::string& /*name*/, void* /*value*/) override {}
  bool has_sync_methods() const override { return true; }

 private:
  std::shared_ptr<ReflectionV1Service> service_ = std::make_shared<ReflectionV1Service>();
};

// Linking gRPC's reflection library adds its v1alpha plugin to every builder (a static
// initializer); this option makes sure it is there and adds v1 beside it.
class ReflectionBuilderOption final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments* /*args*/) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    const bool has_v1alpha = std::any_of(plugins->begin(), plugins->end(), [](const auto& p) {
      return p->name() == kV1alphaPluginName;
    });
    if (!has_v1alpha) {
      plugins->push_back(std::make_unique<grpc::reflection::ProtoServerReflectionPlugin>());
    }
    plugins->push_back(std::make_unique<ReflectionV1Plugin>());
  }
};

class WithoutReflectionBuilderOption final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments* /*args*/) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    std::erase_if(*plugins, [](const auto& p) { return p->name() == kV1alphaPluginName; });
  }
};

}  // namespace

std::unique_ptr<grpc::ServerBuilderOption> ReflectionOption() {
  // gRPC serves grpc.health.v1.Health from code of its own, not from generated messages, so
  // nothing else links health.proto's descriptors into the pool reflection reads; asking for
  // one does (a static library's object is linked only when something refers to it).
  grpc::health::v1::HealthCheckRequest::descriptor();
  return std::make_unique<ReflectionBuilderOption>();
}

std::unique_ptr<grpc::ServerBuilderOption> WithoutReflectionOption() {
  return std::make_unique<WithoutReflectionBuilderOption>();
}

}  // namespace attnserve::server
