#include "server/frontends/open_streams.h"

#include <vector>

namespace attnserve::server {

void OpenStreams::Add(DrainableStream* stream) {
  std::lock_guard lock(mu_);
  streams_.insert(stream);
}

void OpenStreams::Remove(DrainableStream* stream) {
  std::lock_guard lock(mu_);
  streams_.erase(stream);
}

void OpenStreams::EndIdle() {
  // Held throughout: a stream ending on another thread waits in Remove, not yet destroyed.
  std::lock_guard lock(mu_);
  const std::vector<DrainableStream*> open(streams_.begin(), streams_.end());
  for (DrainableStream* stream : open) {
    if (streams_.contains(stream)) stream->EndIfIdle();
  }
}

}  // namespace attnserve::server
