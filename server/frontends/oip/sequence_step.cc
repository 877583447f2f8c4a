#include "server/frontends/oip/sequence_step.h"

#include <utility>

#include "server/frontends/oip/infer_codec.h"

namespace attnserve::server {

absl::StatusOr<std::shared_ptr<Session>> SequenceStep::SessionFor(const SequenceRequest& request) {
  core::ForwardArgs& args = *request.args;
  if (!request.params.start) {
    if (args.context) {
      return absl::InvalidArgumentError("a sequence's context comes with sequence_start only");
    }
    return table_->Find(request.params.id);
  }
  if (!request.kind_given) {
    args.kind = args.context ? core::AttentionKind::kCausalCross : core::AttentionKind::kCausal;
  }
  absl::StatusOr<uint64_t> version = ParseModelVersion(request.version);
  if (!version.ok()) return version.status();
  absl::StatusOr<std::unique_ptr<Session>> opened =
      admission_->OpenSession(request.model, *version, args.kind, args.input.batch(),
                              args.context ? &*args.context : nullptr);
  if (!opened.ok()) return opened.status();
  if (args.context) {
    absl::Status valid = (*opened)->layer()->ValidateBatch(*args.context, true, "context");
    if (!valid.ok()) return valid;
  }
  std::shared_ptr<Session> session = *std::move(opened);
  table_->Start(request.params.id, session);
  return session;
}

void SequenceStep::Run(const SequenceRequest& request, std::function<void(absl::Status)> done) {
  if (!admission_->accepting()) return done(absl::UnavailableError("the server is shutting down"));
  absl::StatusOr<std::shared_ptr<Session>> session = SessionFor(request);
  if (!session.ok()) return done(session.status());
  session_ = *std::move(session);
  const core::Layer& layer = *session_->layer();
  const core::RaggedBatch& input = request.args->input;
  if (absl::Status s = layer.ValidateBatch(input, false, "input"); !s.ok()) return done(s);
  core::ForwardShapes shapes;
  shapes.output_rows = input.rows();
  shapes.output_width = layer.spec().d_output();
  absl::StatusOr<ForwardBuffers> buffers = request.prepare(shapes, session_->version()->version);
  if (!buffers.ok()) return done(buffers.status());
  StepArgs args = MakeStepArgs(input, buffers->output, shapes.output_width);
  const bool end = request.params.end;
  const std::string id = request.params.id;
  SequenceTable* table = table_;
  absl::Status refused =
      session_->Step(std::move(args), [this, end, id, table, done](absl::Status status) {
        // The sequence ends once its last step is answered; its cache goes with it.
        session_.reset();
        if (end) table->End(id);
        done(status);
      });
  if (!refused.ok()) done(refused);
}

}  // namespace attnserve::server
