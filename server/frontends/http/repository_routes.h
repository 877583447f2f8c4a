#pragma once

#include "server/frontends/http/http_router.h"
#include "server/frontends/http/oip_routes.h"
#include "server/serving/model_registry.h"
#include "server/transport/admin_auth.h"

namespace attnserve::server {

// The repository extension over REST, as Triton spells it and KServe's model agent calls it:
// POST /v2/repository/index, /v2/repository/models/{model}/load and .../unload, the gRPC
// repository API's calls with its rules (the index for anyone; load and unload as `admin`
// allows, explicit control mode only).
void AddRepositoryRoutes(ModelRegistry* registry, const AdminAuthorizer* admin,
                         HttpBodyLimits limits, HttpRouter* router);

}  // namespace attnserve::server
