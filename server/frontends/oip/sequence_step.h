#pragma once

// One step of a sequence as the Open Inference Protocol keys them (Triton's sequence batcher
// conventions), whichever transport carried it: a request with the parameter `sequence_id`
// (uint64 or string) is a step of that sequence's session; `sequence_start` opens it (the first
// step, with its kind and, for causal_cross, its context), `sequence_end` ends it after the
// step. gRPC (ModelInfer, ModelStreamInfer) and REST decode their request, then hand it here.

#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/layer.h"
#include "server/serving/admission.h"
#include "server/serving/job.h"
#include "server/serving/sequence_table.h"

namespace attnserve::server {

inline constexpr char kSequenceIdParameter[] = "sequence_id";
// The longest string sequence_id: the table keeps each id for its session's life, charged to no
// budget.
inline constexpr size_t kMaxSequenceIdBytes = 256;
inline constexpr char kSequenceStartParameter[] = "sequence_start";
inline constexpr char kSequenceEndParameter[] = "sequence_end";

// A request that sets `flag` (sequence_start or sequence_end) without a sequence_id: refused,
// not served as a one-shot call with the flag dropped.
absl::Status SequenceFlagWithoutId(absl::string_view flag);

// A request's sequence parameters.
struct SequenceParams {
  std::string id;  // the sequence_id's value, as text (a string id quoted)
  bool start = false;
  bool end = false;
};

// A decoded request that is a sequence step.
struct SequenceRequest {
  std::string model, version;  // as the request names them ("": the only model, newest version)
  SequenceParams params;
  bool kind_given = false;    // the request named its kind (else: causal, or causal_cross with a
                              // context, as Triton's clients send no kind)
  core::ForwardArgs* args{};  // the decoded tensors; outlive the step
  // The bytes of the reply for `shapes`, at most (checked against the message limit first).
  std::function<int64_t(const core::ForwardShapes& shapes)> reply_bytes;
  // Sizes the reply for `shapes`, computed by model version `version`; where the outputs go.
  std::function<absl::StatusOr<ForwardBuffers>(const core::ForwardShapes& shapes, int64_t version)>
      prepare;
};

// Runs sequence steps, one at a time: its session found (or opened), validated, computed.
class SequenceStep {
 public:
  SequenceStep(Admission* admission, SequenceTable* table) : admission_(admission), table_(table) {}

  // Runs `request` (which outlives the step); `done` runs once with its status, on this thread
  // when the step is refused or ran inline (Session::Step), else on the compute thread.
  void Run(const SequenceRequest& request, std::function<void(absl::Status)> done);

  // The caller left (cancelled, or its deadline passed): a step still waiting for its turn
  // behind another step of its sequence is answered `why` at once and changes nothing; a step
  // taken runs on and is answered as usual. Safe from any thread while the step lives.
  void Cancel(const absl::Status& why);

  // The model the step's answer counts under: its session's once found or opened (a request
  // naming none goes to one), else as the request named it. Valid in `done`.
  const std::string& model() const { return model_; }

 private:
  // The session the step goes to: its sequence's, or (sequence_start) a new one, not yet
  // registered, and then `opened` is set.
  absl::StatusOr<std::shared_ptr<Session>> SessionFor(const SequenceRequest& request, bool* opened);

  Admission* const admission_;
  SequenceTable* const table_;
  std::mutex mu_;                     // Run and its answer (any thread) against Cancel
  std::shared_ptr<Session> session_;  // guarded by mu_: held until the step is answered
  uint64_t ticket_ = 0;               // guarded by mu_: the step's, for Session::Withdraw
  std::string model_;                 // written by Run before the step can be answered
};

}  // namespace attnserve::server
