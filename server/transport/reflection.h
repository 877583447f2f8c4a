#pragma once

#include <memory>

#include "grpcpp/impl/server_builder_option.h"

namespace attnserve::server {

// Server reflection for the builder it is set on (and no other): grpc.reflection.v1alpha
// (gRPC's own plugin) and grpc.reflection.v1 (ours: gRPC 1.51 serves only v1alpha). Both list
// the services that builder registered.
std::unique_ptr<grpc::ServerBuilderOption> ReflectionOption();

// No reflection on the builder it is set on, although linking gRPC's reflection library adds
// v1alpha to every builder: the plaintext health port serves health and nothing else.
std::unique_ptr<grpc::ServerBuilderOption> WithoutReflectionOption();

}  // namespace attnserve::server
