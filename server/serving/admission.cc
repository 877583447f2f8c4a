#include "server/serving/admission.h"

#include <exception>
#include <new>

#include "absl/strings/str_cat.h"
#include "server/serving/too_large.h"

namespace attnserve::server {

Admission::Admission(ModelRegistry* registry, CallReporter* reporter, SessionManager* sessions,
                     int64_t max_reply_bytes)
    : registry_(registry),
      reporter_(reporter),
      sessions_(sessions),
      max_reply_bytes_(max_reply_bytes) {}

absl::StatusOr<std::unique_ptr<Session>> Admission::OpenSession(
    absl::string_view model, uint64_t version, core::AttentionKind kind, int64_t batch,
    const core::RaggedBatch* context, bool restart) {
  if (!accepting()) return ShuttingDown();
  absl::StatusOr<ModelRegistry::Found> found = registry_->Find(model, version);
  if (!found.ok()) return found.status();
  ServedModel& served = *found->model;
  return sessions_->Open(std::move(found->version), kind, batch, context, served.decode.get(),
                         &reporter_->metrics().ForModel(served.name), restart);
}

void Admission::Admit(Job* job) {
  reporter_->Arrived();
  if (!accepting()) {
    reporter_->Answer(*job, "", /*decoded=*/false, ShuttingDown(), {});
    return;
  }
  absl::StatusOr<absl::string_view> requested = job->RequestedModel();
  absl::StatusOr<ModelRegistry::Found> found =
      requested.ok() ? registry_->Find(*requested, job->RequestedVersion()) : requested.status();
  if (!found.ok()) {
    reporter_->Answer(*job, "", /*decoded=*/false, found.status(), {},
                      requested.ok() ? *requested : absl::string_view());
    return;
  }
  ServedModel* model = found->model;
  const std::string& name = model->name;
  // From here the call holds its version until it is answered, whatever swaps happen.
  job->set_version(std::move(found->version));
  absl::Status status = job->CheckAlive();
  if (status.ok()) status = model->scheduler->Reserve(job->deadline());
  if (!status.ok()) {
    reporter_->Answer(*job, name, /*decoded=*/false, status, {});
    return;
  }
  // From here the call holds a queue place: Queue either submits it or it is given back.
  bool decoded = false;
  try {
    status = job->Decode();
    decoded = status.ok();
    if (decoded) status = Queue(job, *model);
  } catch (const std::exception& e) {
    // Copying a huge misaligned tensor can run out of memory; nothing may escape to gRPC.
    status = dynamic_cast<const std::bad_alloc*>(&e) != nullptr
                 ? absl::ResourceExhaustedError("out of memory decoding the call")
                 : absl::InternalError(absl::StrCat("cannot take the call: ", e.what()));
  }
  if (!status.ok()) {
    model->scheduler->Release();
    reporter_->Answer(*job, name, decoded, status, {});
  }
}

absl::Status Admission::Queue(Job* job, ServedModel& model) {
  const core::Layer& layer = *job->version().layer;
  if (absl::Status status = layer.Validate(job->args()); !status.ok()) return status;
  if (absl::Status s = CheckReplyBytes(job->ReplyBytes(layer.Shapes(job->args()))); !s.ok()) {
    return s;
  }
  return model.scheduler->Submit(job);
}

absl::Status Admission::CheckReplyBytes(int64_t bytes) const {
  if (bytes <= max_reply_bytes_) return absl::OkStatus();
  return MessageTooLarge(absl::StrCat("the reply would take ", bytes, " bytes, over the limit of ",
                                      max_reply_bytes_, " (--max-message-mib)"));
}

}  // namespace attnserve::server
