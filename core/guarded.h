#pragma once

// The one place where exceptions become statuses at core's public boundary: the standard
// library, nlohmann-json and oneDNN may throw, and nothing may escape core.

#include <exception>
#include <new>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace attnserve::core {

// Runs `body` (returning absl::Status or absl::StatusOr<T>). Out of memory becomes
// ResourceExhausted; any other exception gets `code`. Messages start with `subject`.
template <typename Body>
auto Guarded(const std::string& subject, absl::StatusCode code, Body&& body) -> decltype(body()) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(subject, ": out of memory"));
  } catch (const std::exception& e) {
    return absl::Status(code, absl::StrCat(subject, ": ", e.what()));
  }
}

}  // namespace attnserve::core
