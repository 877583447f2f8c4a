#include "server/serving/repository.h"

#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace attnserve::server {
namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;

constexpr char kWeightsFile[] = "model.safetensors";
constexpr char kConfigFile[] = "config.json";

absl::Status Bad(absl::string_view file, absl::string_view key, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(file, ": '", key, "' ", what));
}

// A positive integer no larger than `max`.
absl::StatusOr<int64_t> PositiveInt(const Json& value, absl::string_view file,
                                    absl::string_view key, int64_t max) {
  if (!value.is_number_integer() || value.get<int64_t>() <= 0 || value.get<int64_t>() > max) {
    return Bad(file, key, absl::StrCat("must be an integer in 1..", max));
  }
  return value.get<int64_t>();
}

// Keys of `object` other than `known` are an error naming the first.
absl::Status OnlyKeys(const Json& object, std::initializer_list<absl::string_view> known,
                      absl::string_view file, absl::string_view where) {
  for (const auto& [key, value] : object.items()) {
    if (std::find(known.begin(), known.end(), key) == known.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          file, ": unknown key '", where, key, "' (known: ", absl::StrJoin(known, ", "), ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<VersionPolicy> ParsePolicy(const Json& value, absl::string_view file) {
  constexpr absl::string_view kKey = "version_policy";
  if (!value.is_object() || value.size() != 1) {
    return Bad(file, kKey, "must hold exactly one of latest, all, specific");
  }
  if (absl::Status s = OnlyKeys(value, {"latest", "all", "specific"}, file, "version_policy.");
      !s.ok()) {
    return s;
  }
  // The object's one member (key() of an items() proxy refers into the proxy: keep neither).
  const std::string kind = value.begin().key();
  const nlohmann::json& body = value.begin().value();
  if (!body.is_object()) return Bad(file, absl::StrCat(kKey, ".", kind), "must be an object");
  VersionPolicy policy;
  if (kind == "latest") {
    if (absl::Status s = OnlyKeys(body, {"num_versions"}, file, "version_policy.latest.");
        !s.ok()) {
      return s;
    }
    if (body.contains("num_versions")) {
      absl::StatusOr<int64_t> n =
          PositiveInt(body["num_versions"], file, "version_policy.latest.num_versions", 1000);
      if (!n.ok()) return n.status();
      policy.num_versions = *n;
    }
  } else if (kind == "all") {
    if (absl::Status s = OnlyKeys(body, {}, file, "version_policy.all."); !s.ok()) return s;
    policy.kind = VersionPolicy::Kind::kAll;
  } else {
    if (absl::Status s = OnlyKeys(body, {"versions"}, file, "version_policy.specific."); !s.ok()) {
      return s;
    }
    policy.kind = VersionPolicy::Kind::kSpecific;
    const Json& versions = body.contains("versions") ? body["versions"] : Json();
    if (!versions.is_array() || versions.empty()) {
      return Bad(file, "version_policy.specific.versions", "must be a non-empty list of versions");
    }
    for (const Json& v : versions) {
      absl::StatusOr<int64_t> n =
          PositiveInt(v, file, "version_policy.specific.versions", int64_t{1} << 62);
      if (!n.ok()) return n.status();
      policy.versions.push_back(*n);
    }
    std::sort(policy.versions.begin(), policy.versions.end());
  }
  return policy;
}

// Applies one top-level key of config.json.
absl::Status ApplyKey(const std::string& key, const Json& value, absl::string_view file,
                      RepositoryModelConfig* config) {
  if (key == "num_heads") {
    absl::StatusOr<int64_t> n = PositiveInt(value, file, key, 1 << 20);
    if (!n.ok()) return n.status();
    config->load.num_heads = *n;
  } else if (key == "prefix") {
    if (!value.is_string()) return Bad(file, key, "must be a string");
    config->load.prefix = value.get<std::string>();
  } else if (key == "precision") {
    const std::string p = value.is_string() ? value.get<std::string>() : "";
    if (p != "f32" && p != "bf16") return Bad(file, key, "must be \"f32\" or \"bf16\"");
    config->precision = p == "bf16" ? core::Precision::kBF16 : core::Precision::kF32;
  } else if (key == "max_queue") {
    absl::StatusOr<int64_t> n = PositiveInt(value, file, key, 1 << 20);
    if (!n.ok()) return n.status();
    config->max_queue = static_cast<int>(*n);
  } else {
    absl::StatusOr<VersionPolicy> policy = ParsePolicy(value, file);
    if (!policy.ok()) return policy.status();
    config->policy = *std::move(policy);
  }
  return absl::OkStatus();
}

// VERSION: a positive decimal integer without sign or leading zeros.
bool ParseVersion(const std::string& name, int64_t* version) {
  if (name.empty() || name.size() > 18 || name[0] == '0') return false;
  if (!std::all_of(name.begin(), name.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return false;
  }
  return absl::SimpleAtoi(name, version) && *version > 0;
}

// Nesting deeper than any config needs ({"version_policy": {"specific": {"versions": [..]}}}) is
// refused before parsing: the JSON parser recurses once per level, and a string of a million
// '[' must be an error, not a stack overflow.
bool NestedTooDeep(absl::string_view json) {
  constexpr int kMaxDepth = 8;
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < json.size(); ++i) {
    const char c = json[i];
    if (in_string) {
      if (c == '\\') ++i;
      if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > kMaxDepth) return true;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return false;
}

}  // namespace

absl::Status CheckModelName(absl::string_view name) {
  if (name.empty() || name.size() > 255 || name.front() == '.' ||
      name.find_first_of(absl::string_view("/\0", 2)) != absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("model name '", name.substr(0, 100),
                     "' cannot name a repository model: it must be a directory name in it (not "
                     "empty, no '/', not starting with '.')"));
  }
  return absl::OkStatus();
}

absl::StatusOr<ControlMode> ParseControlMode(absl::string_view name) {
  if (name == "none") return ControlMode::kNone;
  if (name == "poll") return ControlMode::kPoll;
  if (name == "explicit") return ControlMode::kExplicit;
  return absl::InvalidArgumentError(
      absl::StrCat("--model-control-mode '", name, "': expected none, poll or explicit"));
}

absl::string_view ControlModeName(ControlMode mode) {
  switch (mode) {
    case ControlMode::kNone:
      return "none";
    case ControlMode::kPoll:
      return "poll";
    case ControlMode::kExplicit:
      return "explicit";
  }
  return "none";
}

std::string RepositoryModelConfig::LoadKey() const {
  return absl::StrCat(load.num_heads.value_or(0), "/", load.prefix, "/",
                      std::string(core::PrecisionName(precision)));
}

absl::StatusOr<RepositoryModelConfig> ParseRepositoryModelConfig(absl::string_view json,
                                                                 absl::string_view file) {
  if (NestedTooDeep(json)) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": nested deeper than a config can be"));
  }
  // A key given twice in one object is an error (JSON leaves it open; the last would win, and a
  // setting written twice, one of them forgotten, would be read silently as the other).
  std::vector<std::set<std::string>> open_objects;
  std::string twice;
  auto note_keys = [&](int /*depth*/, Json::parse_event_t event, Json& parsed) {
    if (event == Json::parse_event_t::object_start) open_objects.emplace_back();
    if (event == Json::parse_event_t::object_end && !open_objects.empty()) open_objects.pop_back();
    if (event == Json::parse_event_t::key && !open_objects.empty()) {
      const std::string& key = parsed.get_ref<const std::string&>();
      if (!open_objects.back().insert(key).second && twice.empty()) twice = key;
    }
    return true;
  };
  Json root = Json::parse(json.begin(), json.end(), note_keys, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": not a JSON object"));
  }
  if (!twice.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": key '", twice, "' given twice"));
  }
  if (absl::Status s = OnlyKeys(
          root, {"num_heads", "prefix", "precision", "version_policy", "max_queue"}, file, "");
      !s.ok()) {
    return s;
  }
  RepositoryModelConfig config;
  for (const auto& [key, value] : root.items()) {
    if (absl::Status s = ApplyKey(key, value, file, &config); !s.ok()) return s;
  }
  return config;
}

std::string FileStamp(const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) return "";
  return absl::StrCat(st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec, "/", st.st_size, "/", st.st_ino);
}

absl::StatusOr<std::vector<std::string>> ListRepositoryModels(const std::string& dir) {
  std::error_code error;
  if (!fs::is_directory(dir, error)) {
    return absl::NotFoundError(
        absl::StrCat("--model-repository ", dir, ": not a directory we can read"));
  }
  std::vector<std::string> names;
  // (Stepped with an error code: the range-for's ++ throws on a read error.)
  for (fs::directory_iterator it(dir, error), end; !error && it != end; it.increment(error)) {
    std::error_code ignored;
    if (it->is_directory(ignored) && it->path().filename().string()[0] != '.') {
      names.push_back(it->path().filename().string());
    }
  }
  if (error) {
    return absl::UnavailableError(absl::StrCat("--model-repository ", dir, ": ", error.message()));
  }
  std::sort(names.begin(), names.end());
  return names;
}

absl::StatusOr<ModelDir> ScanModelDir(const std::string& dir, const std::string& name) {
  const fs::path root = fs::path(dir) / name;
  std::error_code error;
  const fs::file_status status = fs::status(root, error);
  // Only a directory that is not there is a model that is not there: a directory that cannot be
  // read now (out of descriptors, an I/O error) is an error, not a model without versions, which
  // a poll would unload.
  auto unreadable = [&] {
    return absl::UnavailableError(
        absl::StrCat("the repository's ", root.string(), " cannot be read: ", error.message()));
  };
  if (status.type() == fs::file_type::not_found ||
      (!error && status.type() != fs::file_type::directory)) {
    return absl::NotFoundError(absl::StrCat("no model '", name, "' in the repository ", dir));
  }
  if (error) return unreadable();
  ModelDir model;
  model.name = name;
  for (fs::directory_iterator it(root, error), end; !error && it != end; it.increment(error)) {
    const fs::directory_entry& entry = *it;
    const std::string entry_name = entry.path().filename().string();
    std::error_code ignored;
    int64_t version = 0;
    if (entry_name == kConfigFile && entry.is_regular_file(ignored)) {
      model.config_path = entry.path().string();
      model.config_stamp = FileStamp(model.config_path);
    } else if (entry.is_directory(ignored) && ParseVersion(entry_name, &version)) {
      // A version directory whose file has not arrived yet is not a version yet.
      const std::string path = (entry.path() / kWeightsFile).string();
      if (fs::is_regular_file(path, ignored))
        model.versions.push_back({version, path, FileStamp(path)});
    } else if (entry_name[0] != '.') {
      model.ignored.push_back(entry.path().string());
    }
  }
  if (error) return unreadable();
  std::sort(model.versions.begin(), model.versions.end(),
            [](const VersionFile& a, const VersionFile& b) { return a.version < b.version; });
  return model;
}

std::vector<int64_t> WantedVersions(const VersionPolicy& policy,
                                    const std::vector<int64_t>& available) {
  switch (policy.kind) {
    case VersionPolicy::Kind::kAll:
      return available;
    case VersionPolicy::Kind::kLatest: {
      const size_t keep = std::min<size_t>(available.size(), policy.num_versions);
      return {available.end() - keep, available.end()};
    }
    case VersionPolicy::Kind::kSpecific:
      break;
  }
  std::vector<int64_t> wanted;
  for (int64_t v : available) {
    if (std::binary_search(policy.versions.begin(), policy.versions.end(), v)) wanted.push_back(v);
  }
  return wanted;
}

}  // namespace attnserve::server
