#include "server/frontends/oip/sequence_step.h"

#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/frontends/oip/infer_codec.h"
#include "server/serving/admission.h"
#include "server/serving/model_registry.h"

namespace attnserve::server {

absl::Status SequenceFlagWithoutId(absl::string_view flag) {
  return absl::InvalidArgumentError(absl::StrCat("parameter '", flag, "' is set but '",
                                                 kSequenceIdParameter,
                                                 "' is missing: name the sequence"));
}

absl::StatusOr<std::shared_ptr<Session>> SequenceStep::SessionFor(const SequenceRequest& request,
                                                                  bool* opened) {
  core::ForwardArgs& args = *request.args;
  if (!request.params.start && args.context) {
    return absl::InvalidArgumentError("a sequence's context comes with sequence_start only");
  }
  // Each model has its own sequence ids; "" names the only model. A continuation naming none
  // goes to the model whose sequence has its id, when just one has: the only model may have
  // changed since the sequence began (another loaded, or its own unloaded: the session holds
  // its version).
  std::string model = request.model;
  if (model.empty() && !request.params.start) model = table_->OnlyModelHolding(request.params.id);
  if (model.empty()) {
    absl::StatusOr<ModelRegistry::Found> found = admission_->registry().Find(model);
    if (!found.ok()) return found.status();
    model = found->model->name;
  }
  if (!request.params.start) {
    absl::StatusOr<std::shared_ptr<Session>> found = table_->Find(model, request.params.id);
    if (!found.ok()) return found.status();
    // A later step repeats the sequence's kind and version or names neither, as a Decode
    // stream's later messages do.
    const Session& session = **found;
    if (request.kind_given && args.kind != session.kind()) {
      return absl::InvalidArgumentError(
          "kind differs from the sequence's (set by its sequence_start)");
    }
    absl::StatusOr<uint64_t> version = ParseModelVersion(request.version);
    if (!version.ok()) return version.status();
    if (*version != 0 && static_cast<int64_t>(*version) != session.version()->version) {
      return absl::InvalidArgumentError(
          absl::StrCat("version ", *version, " differs from the sequence's (",
                       session.version()->version, ", set by its sequence_start)"));
    }
    return found;
  }
  if (!request.kind_given) {
    args.kind = args.context ? core::AttentionKind::kCausalCross : core::AttentionKind::kCausal;
  }
  absl::StatusOr<uint64_t> version = ParseModelVersion(request.version);
  if (!version.ok()) return version.status();
  absl::StatusOr<std::unique_ptr<Session>> session_opened = admission_->OpenSession(
      model, *version, args.kind, args.input.batch(), args.context ? &*args.context : nullptr,
      /*restart=*/table_->Holds(model, request.params.id));
  if (!session_opened.ok()) return session_opened.status();
  *opened = true;
  return std::shared_ptr<Session>(*std::move(session_opened));
}

void SequenceStep::Run(const SequenceRequest& request, std::function<void(absl::Status)> done) {
  model_ = request.model;
  if (!admission_->accepting()) return done(ShuttingDown());
  if (request.params.id.size() > kMaxSequenceIdBytes + 2) {  // a string id is quoted
    return done(
        absl::InvalidArgumentError(absl::StrCat("a sequence_id of at most ", kMaxSequenceIdBytes,
                                                " bytes, not ", request.params.id.size() - 2)));
  }
  if (request.args->return_attention) {
    return done(absl::InvalidArgumentError(
        "a sequence step returns no attention: ask for the output alone (no return_attention, "
        "no 'attention' output)"));
  }
  // A refused step changes nothing: a sequence it would start is kept under its id only once
  // its step is answered.
  bool opened = false;
  absl::StatusOr<std::shared_ptr<Session>> found = SessionFor(request, &opened);
  if (!found.ok()) return done(found.status());
  std::shared_ptr<Session> session = *std::move(found);
  model_ = session->model();
  const core::Layer& layer = *session->layer();
  const core::RaggedBatch& input = request.args->input;
  if (absl::Status s = layer.ValidateBatch(input, false, "input"); !s.ok()) return done(s);
  core::ForwardShapes shapes;
  shapes.output_rows = input.rows();
  shapes.output_width = layer.spec().d_output();
  if (absl::Status s = admission_->CheckReplyBytes(request.reply_bytes(shapes)); !s.ok()) {
    return done(s);
  }
  absl::StatusOr<ForwardBuffers> buffers;
  try {
    buffers = request.prepare(shapes, session->version()->version);
  } catch (const std::bad_alloc&) {  // nothing may escape to the transport
    buffers = absl::ResourceExhaustedError("out of memory sizing the reply");
  }
  if (!buffers.ok()) return done(buffers.status());
  StepArgs args = MakeStepArgs(input, buffers->output, shapes.output_width);
  const bool end = request.params.end;
  args.ends_sequence = end;
  const std::string id = request.params.id, model = model_;
  const uint64_t ticket = Session::NewStepTicket();
  {
    std::lock_guard lock(mu_);
    session_ = session;
    ticket_ = ticket;
  }
  // Once Step has taken the step, its answer may come on another thread at any time, and with
  // it the end of this object (a stream's next message): what follows the answer is the
  // callback's alone. The callback holds the session (session_ is for Cancel), so that a
  // sequence_end's session ends before its answer is sent, not when this function returns.
  Session* const target = session.get();
  absl::Status refused = target->Step(
      std::move(args),
      [this, session = std::move(session), opened, end, id, model,
       done](absl::Status status) mutable {
        if (status.ok()) {
          // A sequence_start takes the id over (the session it had ends) with its first
          // answer, before the client can send the next step; the sequence ends with its last.
          if (opened) table_->Start(id, session);
          if (end) table_->End(model, id, session.get());
        }
        // The idle clock counts from the answer too: a step longer than
        // --session-idle-timeout does not leave its sequence to be reaped once answered.
        table_->Touch(model, id, session.get());
        {
          std::lock_guard lock(mu_);
          session_.reset();
        }
        session.reset();  // here, as the step's last hold: the session may end with it
        done(status);
      },
      ticket);
  if (!refused.ok()) {
    {
      std::lock_guard lock(mu_);
      session_.reset();
    }
    done(refused);
  }
}

void SequenceStep::Cancel(const absl::Status& why) {
  std::shared_ptr<Session> session;
  uint64_t ticket;
  {
    std::lock_guard lock(mu_);
    session = session_;
    ticket = ticket_;
  }
  // Withdraw answers the step here (its callback takes mu_): not under the lock.
  if (session != nullptr) session->Withdraw(ticket, why);
}

}  // namespace attnserve::server
