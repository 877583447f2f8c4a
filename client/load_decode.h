#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/decode_session.h"
#include "client/histogram.h"
#include "client/load_engine.h"

// The load tester's session mode (bench --decode): concurrent Decode streams, each a prompt and
// then steps, timed as a generating client sees them.
namespace attnserve::client {

// What every session sends.
struct DecodeWork {
  DecodeOptions session;  // model, kind, B, context
  // A pool of prompts, each as the messages it is sent in (a long prompt in chunks, so no
  // message passes the size limits): session i sends prompts[i % size].
  std::vector<std::vector<v1::DecodeRequest>> prompts;
  int64_t prompt_tokens = 0;  // per session, all its sequences
  v1::DecodeRequest step;     // one step's message: k random tokens per sequence
  int steps = 0;
  int tokens_per_step = 1;
  // Each step's input is the previous step's output (generation); false: the same random step.
  bool feed_output = true;
};

// Runs `sessions` sessions at once, spread over the connections: every session sends its prompt,
// all wait until every prompt is answered (so the decode window holds only steps), then each
// sends its steps back to back. StepReport counts messages (latency: of the steps) and tokens;
// its `decode` has the session figures.
absl::StatusOr<StepReport> RunDecodeLoad(const std::vector<const AttentionClient*>& connections,
                                         const DecodeWork& work, int sessions);

}  // namespace attnserve::client
