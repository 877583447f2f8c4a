#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "client/cli.h"
#include "client/load_engine.h"

namespace attnserve::client {

// The requests a load test sends, from the `bench` flags: one request (--input, --random B,S), or
// a pool of mixed ones (--lengths-uniform, --lengths-list, --kinds, --workload FILE), each
// counted by its valid tokens.
absl::StatusOr<std::vector<WorkItem>> BuildWorkload(const ModelFinder& find_model,
                                                    const LoadFlags& flags);

}  // namespace attnserve::client
