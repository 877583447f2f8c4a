#pragma once

// A model repository in Triton's layout, as files: DIR/NAME/VERSION/model.safetensors (VERSION a
// positive integer) and an optional DIR/NAME/config.json. Reading the layout and the config, and
// which versions a policy serves, are decided here; loading and serving them is the registry's.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/layer_spec.h"
#include "core/weights.h"

namespace attnserve::server {

// Triton's model control modes (--model-control-mode).
enum class ControlMode {
  kNone,      // load what the repository holds at start; nothing changes after
  kPoll,      // also pick up new and removed versions and changed configs every poll
  kExplicit,  // load only what --load-model or RepositoryModelLoad names
};

absl::StatusOr<ControlMode> ParseControlMode(absl::string_view name);
absl::string_view ControlModeName(ControlMode mode);

// Which versions of a model are served (config.json's version_policy, Triton's).
struct VersionPolicy {
  enum class Kind { kLatest, kAll, kSpecific };
  Kind kind = Kind::kLatest;
  int64_t num_versions = 1;       // kLatest
  std::vector<int64_t> versions;  // kSpecific
};

// A repository model's config.json (every key optional).
struct RepositoryModelConfig {
  core::LoadOptions load;  // num_heads, prefix
  core::Precision precision = core::Precision::kF32;
  VersionPolicy policy;
  std::optional<int> max_queue;  // the model's queue bound, instead of --max-queue

  // What a loaded layer depends on (num_heads, prefix, precision): a version is reloaded when
  // this changes.
  std::string LoadKey() const;
};

// Parses config.json text (`file` names it in messages). Unknown keys, wrong types and values
// out of range are InvalidArgument naming the key and the file.
absl::StatusOr<RepositoryModelConfig> ParseRepositoryModelConfig(absl::string_view json,
                                                                 absl::string_view file);

// InvalidArgument unless `name` can name a model directory of the repository: not empty, at
// most 255 bytes, no '/' or NUL, not starting with '.' (so never "..": a name stays inside DIR).
absl::Status CheckModelName(absl::string_view name);

// A file's identity (modification time, size, inode), "" when it cannot be stat'ed: a changed
// stamp means a changed (or replaced) file.
std::string FileStamp(const std::string& path);

// One version's weights file.
struct VersionFile {
  int64_t version = 0;
  std::string path;
  std::string stamp;
};

// What one model's directory holds now.
struct ModelDir {
  std::string name;
  std::string config_path;            // DIR/NAME/config.json, "" when there is none
  std::string config_stamp;           // FileStamp of config_path
  std::vector<VersionFile> versions;  // ascending; only VERSION dirs with model.safetensors
  std::vector<std::string> ignored;   // entries that are not a version: logged once by the caller
};

// The model names of `dir` (its subdirectories), sorted. NotFound when `dir` is not a directory.
absl::StatusOr<std::vector<std::string>> ListRepositoryModels(const std::string& dir);

// Reads DIR/NAME's layout (no file contents). NotFound when DIR/NAME is not a directory;
// Unavailable when it cannot be read now (out of descriptors, an I/O error).
absl::StatusOr<ModelDir> ScanModelDir(const std::string& dir, const std::string& name);

// The versions `policy` serves out of `available` (ascending), ascending.
std::vector<int64_t> WantedVersions(const VersionPolicy& policy,
                                    const std::vector<int64_t>& available);

}  // namespace attnserve::server
