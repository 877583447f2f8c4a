#pragma once

#include <mutex>
#include <set>

namespace attnserve::server {

// A stream that a drain can end while it waits for its client's next message.
class DrainableStream {
 public:
  virtual ~DrainableStream() = default;
  // Ends the stream UNAVAILABLE if it is waiting for its client's next message; else does
  // nothing (a message it is serving is answered, and the stream then ends, as the server no
  // longer accepts work).
  virtual void EndIfIdle() = 0;
};

// The streams a service has open (Decode, ModelStreamInfer), so that a drain ends those idle
// between messages at once: their clients go on elsewhere now, not when the transport stops at
// the drain's end.
class OpenStreams {
 public:
  // A stream joins once it waits for its first message, and leaves before it is destroyed.
  void Add(DrainableStream* stream);
  void Remove(DrainableStream* stream);

  // EndIfIdle on every stream open. (A stream may be destroyed inside its EndIfIdle, on this
  // thread: its Remove then takes the lock again.)
  void EndIdle();

 private:
  std::recursive_mutex mu_;
  std::set<DrainableStream*> streams_;  // guarded by mu_
};

}  // namespace attnserve::server
