#include "server/serving/admission.h"

#include <exception>
#include <new>

#include "absl/strings/str_cat.h"
#include "server/serving/too_large.h"

namespace attnserve::server {

Admission::Admission(ModelRegistry* registry, CallReporter* reporter, int64_t max_reply_bytes)
    : registry_(registry), reporter_(reporter), max_reply_bytes_(max_reply_bytes) {}

void Admission::Admit(Job* job) {
  reporter_->Arrived();
  if (!accepting()) {
    reporter_->Answer(*job, "", /*decoded=*/false,
                      absl::UnavailableError("the server is shutting down"), {});
    return;
  }
  absl::StatusOr<absl::string_view> requested = job->RequestedModel();
  absl::StatusOr<ServedModel*> model =
      requested.ok() ? registry_->Find(*requested) : requested.status();
  if (!model.ok()) {
    reporter_->Answer(*job, "", /*decoded=*/false, model.status(), {});
    return;
  }
  const std::string& name = (*model)->name;
  absl::Status status = job->CheckAlive();
  if (status.ok()) status = (*model)->scheduler->Reserve(job->deadline());
  if (!status.ok()) {
    reporter_->Answer(*job, name, /*decoded=*/false, status, {});
    return;
  }
  // From here the call holds a queue place: Queue either submits it or it is given back.
  bool decoded = false;
  try {
    status = job->Decode();
    decoded = status.ok();
    if (decoded) status = Queue(job, **model);
  } catch (const std::exception& e) {
    // Copying a huge misaligned tensor can run out of memory; nothing may escape to gRPC.
    status = dynamic_cast<const std::bad_alloc*>(&e) != nullptr
                 ? absl::ResourceExhaustedError("out of memory decoding the call")
                 : absl::InternalError(absl::StrCat("cannot take the call: ", e.what()));
  }
  if (!status.ok()) {
    (*model)->scheduler->Release();
    reporter_->Answer(*job, name, decoded, status, {});
  }
}

absl::Status Admission::Queue(Job* job, ServedModel& model) {
  if (absl::Status status = model.layer->Validate(job->args()); !status.ok()) return status;
  const int64_t bytes = job->ReplyBytes(model.layer->Shapes(job->args()));
  if (bytes > max_reply_bytes_) {
    return MessageTooLarge(absl::StrCat("the reply would take ", bytes,
                                        " bytes, over the limit of ", max_reply_bytes_,
                                        " (--max-message-mib)"));
  }
  return model.scheduler->Submit(job);
}

}  // namespace attnserve::server
