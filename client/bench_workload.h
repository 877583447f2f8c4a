#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "client/bench.h"
#include "client/cli.h"

namespace attnserve::client {

// The requests a load test sends, from the bench flags: one request (--input, --random B,S), or
// a pool of mixed ones (--lengths-uniform, --lengths-list, --kinds, --workload FILE), each
// counted by its valid tokens.
absl::StatusOr<std::vector<WorkItem>> BuildWorkload(const AttentionClient& client,
                                                    const BenchFlags& flags);

}  // namespace attnserve::client
