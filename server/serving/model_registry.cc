#include "server/serving/model_registry.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/read_only_file.h"
#include "core/runtime_info.h"
#include "core/weights.h"
#include "server/observability/logging.h"

namespace attnserve::server {
namespace {

// A config.json is a few hundred bytes; one far larger is no config (a sparse file declaring
// gigabytes would otherwise be allocated whole before its first byte is parsed).
constexpr uint64_t kMaxConfigBytes = 1 << 20;

absl::StatusOr<std::shared_ptr<const core::Layer>> LoadLayer(const ModelConfig& config) {
  core::LayerWeights weights;
  if (config.path == kBuiltInSource) {
    weights = core::MakeDemoWeights();
  } else {
    absl::StatusOr<core::LayerWeights> loaded = core::LoadLayerWeights(config.path, config.load);
    if (!loaded.ok()) return loaded.status();
    weights = *std::move(loaded);
  }
  return core::Layer::Create(std::move(weights), config.precision);
}

// The config a repository model loads with: `override` (RepositoryModelLoad's `config`), its
// config.json, or the defaults.
absl::StatusOr<RepositoryModelConfig> ReadConfig(const ModelDir& dir,
                                                 const std::optional<std::string>& override) {
  if (override.has_value()) {
    return ParseRepositoryModelConfig(*override, "the 'config' parameter");
  }
  if (dir.config_path.empty()) return RepositoryModelConfig{};
  absl::StatusOr<std::string> text =
      core::ReadWholeFile(dir.config_path, "not a valid config", kMaxConfigBytes);
  if (!text.ok()) return text.status();
  return ParseRepositoryModelConfig(*text, dir.config_path);
}

// The stamp of the config.json a load used, or none when a load request's `config` parameter
// stood in for it.
std::optional<std::string> FileStampUnlessOverridden(const ModelDir& dir,
                                                     const std::optional<std::string>& override) {
  if (override.has_value()) return std::nullopt;
  return dir.config_stamp;
}

// Runs `work` on a thread of its own at a low priority and waits for it. Loads run beside
// serving on the same cores, so the loading thread reads and converts on one OpenMP thread (two
// OpenMP teams on the same cores make every compute run wait for a descheduled thread) at nice
// kLoadNice: under full load a load gets about a tenth of a core and calls the rest, and it
// still ends (SCHED_IDLE starved a 200 MB load for more than 15 s under a steady load). Only
// reading, converting and freeing run there: the registry thread, which takes the registry's
// lock, keeps the normal priority, so an admission never waits for a slowed lock holder.
constexpr int kLoadNice = 10;

template <typename Work>
auto AtLowPriority(Work work) -> decltype(work()) {
  std::optional<decltype(work())> result;
  std::thread([&] {
    if (setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), kLoadNice) != 0) {
      Log(LogLevel::kWarn, "a model load runs at the normal priority (setpriority refused)");
    }
    core::SetComputeThreads(1);
    result.emplace(work());
  }).join();
  return *std::move(result);
}

std::string Versions(const std::vector<VersionHandle>& versions) {
  return absl::StrJoin(versions, ", ", [](std::string* out, const VersionHandle& v) {
    absl::StrAppend(out, v->version);
  });
}

}  // namespace

// The registry thread's inbox. A version's deleter hands the version here, so that its memory
// is freed on the registry thread (a large layer's pages are not given back on the compute
// thread) and its state turns UNAVAILABLE; once stopped, versions are freed where released.
struct ModelRegistry::Work {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void(bool run)>> tasks;  // run false: the registry stopped
  std::vector<ModelVersion*> released;
  bool stop = false;

  void Release(ModelVersion* version) {
    {
      std::lock_guard lock(mu);
      if (!stop) {
        released.push_back(version);
        cv.notify_one();
        return;
      }
    }
    delete version;
  }
};

// What one Reconcile loads: planned under the lock, loaded without it, published under it.
struct ModelRegistry::LoadPlan {
  struct Item {
    VersionFile file;
    absl::StatusOr<VersionHandle> result = absl::UnknownError("not loaded");
  };
  std::vector<int64_t> wanted;
  std::vector<Item> loads;
  std::vector<int64_t> failed_before;  // wanted, and failed before with the same file
  std::string load_key;
  bool no_versions = false;
};

ModelSummary Summarize(absl::string_view name, absl::string_view source, const core::Layer& layer) {
  const core::LayerSpec& spec = layer.spec();
  ModelSummary summary{.name = std::string(name),
                       .layout = std::string(core::LayoutName(spec.layout)),
                       .precision = std::string(core::PrecisionName(layer.precision())),
                       .d_model = spec.d_model,
                       .d_context = spec.d_context,
                       .num_heads = spec.num_heads,
                       .head_dim = spec.head_dim,
                       .d_output = spec.d_output(),
                       .has_bias = spec.has_bias,
                       .has_output_projection = spec.has_output_projection,
                       .kinds = {},
                       .source = std::string(source)};
  for (core::AttentionKind kind : core::kAttentionKinds) {
    if (spec.Serves(kind)) summary.kinds.push_back(kind);
    if (spec.ServesSessions(kind)) summary.serves_sessions = true;
  }
  return summary;
}

ModelRegistry::ModelRegistry(const RegistryOptions& options, CallReporter* reporter)
    : options_(options),
      reporter_(reporter),
      executor_(std::make_unique<ComputeExecutor>(options.compute_threads)),
      work_(std::make_shared<Work>()) {}

absl::StatusOr<std::unique_ptr<ModelRegistry>> ModelRegistry::Load(const RegistryOptions& options,
                                                                   CallReporter* reporter) {
  std::unique_ptr<ModelRegistry> registry(new ModelRegistry(options, reporter));
  std::vector<ModelConfig> flags = options.models;
  if (flags.empty() && options.repository.empty()) flags.emplace_back().name = "demo";
  for (const ModelConfig& config : flags) {
    if (absl::Status status = registry->LoadFlagModel(config); !status.ok()) return status;
  }
  if (absl::Status status = registry->LoadAtStart(); !status.ok()) return status;
  registry->thread_ = std::thread([r = registry.get()] { r->Loop(); });
  return registry;
}

ModelRegistry::~ModelRegistry() { Drain(); }

absl::Status ModelRegistry::LoadFlagModel(const ModelConfig& config) {
  absl::StatusOr<VersionHandle> version = MakeVersion(config.name, 1, config.path, config);
  if (!version.ok()) {
    return absl::Status(version.status().code(),
                        absl::StrCat("model '", config.name, "': ", version.status().message()));
  }
  std::lock_guard lock(mu_);
  ServedModel& model = ModelLocked(config.name);
  model.from_flag = true;
  model.ready = {*version};
  model.records[1];
  reporter_->metrics().SetModelInfo((*version)->summary);
  PublishStateLocked(model);
  return absl::OkStatus();
}

absl::Status ModelRegistry::LoadAtStart() {
  if (options_.repository.empty()) return absl::OkStatus();
  absl::StatusOr<std::vector<std::string>> names = ListRepositoryModels(options_.repository);
  if (!names.ok()) return names.status();
  std::vector<std::string> load = *names;
  if (options_.control_mode == ControlMode::kExplicit) {
    load.clear();
    for (const std::string& wanted : options_.load_models) {
      if (wanted == "*") {
        load = *names;
        break;
      }
      if (std::find(names->begin(), names->end(), wanted) == names->end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--load-model '", wanted, "': no such model in the repository ", options_.repository));
      }
      load.push_back(wanted);
    }
  }
  for (const std::string& name : load) {
    {
      std::lock_guard lock(mu_);
      if (ServedModel* model = FindLocked(name); model != nullptr && model->from_flag) {
        return absl::InvalidArgumentError(absl::StrCat(
            "model '", name, "' is given by --model and is in the repository: rename one"));
      }
    }
    // A repository model that fails is reported (index, log, metric); the others serve.
    Reconcile(name, std::nullopt, /*polling=*/false).IgnoreError();
  }
  return absl::OkStatus();
}

absl::StatusOr<VersionHandle> ModelRegistry::MakeVersion(const std::string& name, int64_t version,
                                                         const std::string& path,
                                                         const ModelConfig& config) {
  absl::StatusOr<std::shared_ptr<const core::Layer>> layer = LoadLayer(config);
  if (!layer.ok()) return layer.status();
  ModelSummary summary = Summarize(name, path, **layer);
  auto* made = new ModelVersion{.name = name,
                                .version = version,
                                .source = path,
                                .layer = *std::move(layer),
                                .summary = std::move(summary)};
  return VersionHandle(made, [work = work_](ModelVersion* v) { work->Release(v); });
}

absl::Status ModelRegistry::Reconcile(const std::string& name,
                                      const std::optional<std::string>& override, bool polling) {
  {
    // Before the repository is read: a --model model is not the repository's to change, and
    // a broken config.json or override in its name must not mark its entries.
    std::lock_guard lock(mu_);
    if (const ServedModel* flagged = FindLocked(name); flagged != nullptr && flagged->from_flag) {
      return absl::FailedPreconditionError(absl::StrCat(
          "model '", name, "' is given by --model: it is always loaded and not managed here"));
    }
  }
  absl::StatusOr<ModelDir> dir = ScanModelDir(options_.repository, name);
  if (!dir.ok()) {
    // A directory that went away while polling: the model's versions retire.
    if (polling && absl::IsNotFound(dir.status())) Unload(name).IgnoreError();
    return dir.status();
  }
  for (const std::string& path : dir->ignored) {
    if (logged_ignored_.insert(path).second) {
      Log(LogLevel::kInfo, "repository entry ignored: not VERSION/model.safetensors or config.json",
          {{"path", path}});
    }
  }
  absl::StatusOr<RepositoryModelConfig> config = ReadConfig(*dir, override);
  if (!config.ok()) {
    ConfigFailed(name, FileStampUnlessOverridden(*dir, override), config.status());
    return config.status();
  }
  LoadPlan plan;
  ServedModel* model = nullptr;
  {
    std::lock_guard lock(mu_);
    model = &ModelLocked(name);
    // A policy that names no version there (a typo in a rollback) is a broken config: it
    // changes nothing, as Triton refuses it. And an asked-for load finds a version to load.
    std::vector<int64_t> available;
    for (const VersionFile& file : dir->versions) available.push_back(file.version);
    if (!available.empty() && WantedVersions(config->policy, available).empty()) {
      const absl::Status refused = absl::InvalidArgumentError(absl::StrCat(
          "model '", name, "': its version_policy names no version in ", options_.repository, "/",
          name, " (there: ", absl::StrJoin(available, ", "), ")"));
      ConfigFailedLocked(*model, FileStampUnlessOverridden(*dir, override), refused);
      return refused;
    }
    if (available.empty() && !polling) return NoVersions(name);
    model->config_error.clear();
    model->config_stamp = dir->config_stamp;
    if (absl::Status s = PlanLocked(*model, *dir, *config, !polling, &plan); !s.ok()) return s;
  }
  // Files are read here, on the registry thread, with no lock held: calls go on meanwhile.
  for (LoadPlan::Item& item : plan.loads) {
    if (Stopping()) {  // a shutdown waits for the load under way, not for the plan's others
      std::lock_guard lock(mu_);
      for (LoadPlan::Item& planned : plan.loads)
        model->records[planned.file.version].loading = false;
      PublishStateLocked(*model);
      return absl::UnavailableError("the server is shutting down");
    }
    const ModelConfig load{name, item.file.path, config->load, config->precision};
    item.result =
        AtLowPriority([&] { return MakeVersion(name, item.file.version, item.file.path, load); });
    if (item.result.ok() && FileStamp(item.file.path) != item.file.stamp) {
      item.result = absl::UnavailableError(
          absl::StrCat(item.file.path,
                       ": the file changed while it was read (still being written?); it is "
                       "tried again once it stops changing"));
    }
  }
  std::lock_guard lock(mu_);
  return Publish(*model, *config, plan);
}

absl::Status ModelRegistry::PlanLocked(ServedModel& model, const ModelDir& dir,
                                       const RepositoryModelConfig& config, bool retry_failed,
                                       LoadPlan* plan) {
  std::vector<int64_t> available;
  for (const VersionFile& file : dir.versions) available.push_back(file.version);
  plan->wanted = WantedVersions(config.policy, available);
  plan->load_key = config.LoadKey();
  plan->no_versions = available.empty();
  for (const VersionFile& file : dir.versions) {
    if (!std::binary_search(plan->wanted.begin(), plan->wanted.end(), file.version)) continue;
    ServedModel::Record& record = model.records[file.version];
    const bool same = record.stamp == file.stamp && record.load_key == plan->load_key;
    const bool is_ready =
        std::any_of(model.ready.begin(), model.ready.end(),
                    [&](const VersionHandle& v) { return v->version == file.version; });
    if (is_ready && same && !record.failed) continue;
    if (!retry_failed && record.failed && same) {
      plan->failed_before.push_back(file.version);
      continue;
    }
    record.loading = true;
    plan->loads.push_back({file});
  }
  PublishStateLocked(model);
  return absl::OkStatus();
}

absl::Status ModelRegistry::Publish(ServedModel& model, const RepositoryModelConfig& config,
                                    LoadPlan& plan) {
  std::vector<std::string> errors;
  for (int64_t v : plan.failed_before) {
    errors.push_back(absl::StrCat("version ", v, ": ", model.records[v].reason));
  }
  std::map<int64_t, VersionHandle> loaded;
  for (LoadPlan::Item& item : plan.loads) {
    ServedModel::Record& record = model.records[item.file.version];
    record.loading = false;
    record.stamp = item.file.stamp;
    record.load_key = plan.load_key;
    record.failed = !item.result.ok();
    record.reason = item.result.ok() ? "" : std::string(item.result.status().message());
    if (item.result.ok()) {
      loaded[item.file.version] = *item.result;
      continue;
    }
    errors.push_back(absl::StrCat("version ", item.file.version, ": ", record.reason));
    reporter_->metrics().ModelLoadFailed(model.name);
    Log(LogLevel::kWarn, "model version failed to load; the serving versions are untouched",
        {{"model", model.name}, {"version", item.file.version}, {"error", record.reason}});
  }
  // Load before unload: while a wanted version failed, every serving version stays.
  std::map<int64_t, VersionHandle> next;
  if (errors.empty()) {
    for (const VersionHandle& v : model.ready) {
      if (std::binary_search(plan.wanted.begin(), plan.wanted.end(), v->version))
        next[v->version] = v;
    }
  } else {
    for (const VersionHandle& v : model.ready) next[v->version] = v;
  }
  for (auto& [version, handle] : loaded) next[version] = handle;
  for (const VersionHandle& v : model.ready) {
    auto it = next.find(v->version);
    if (it == next.end() || it->second != v) {
      RetireLocked(model, v, it == next.end() ? "unloaded (version policy)" : "replaced");
    }
  }
  const VersionHandle newest_before = model.ready.empty() ? nullptr : model.ready.back();
  model.ready.clear();
  for (auto& [version, handle] : next) model.ready.push_back(handle);
  if (!model.ready.empty()) model.unloaded = false;
  for (auto& [version, handle] : loaded) {
    Log(LogLevel::kInfo, "model version ready", SummaryFields(handle->summary));
  }
  if (errors.empty()) {  // a load that failed changes nothing, its queue bound included
    model.scheduler->SetMaxQueue(config.max_queue.value_or(options_.scheduler.max_queue));
  }
  // attnserve_model_info describes the newest ready version; a poll that changes nothing leaves
  // the series alone.
  if (model.ready.empty()) {
    reporter_->metrics().ClearModelInfo(model.name);
  } else if (model.ready.back() != newest_before) {
    reporter_->metrics().SetModelInfo(model.ready.back()->summary);
  }
  PublishStateLocked(model);
  if (!errors.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model '", model.name, "': ", absl::StrJoin(errors, "; ")));
  }
  if (plan.no_versions) return NoVersions(model.name);
  return absl::OkStatus();
}

absl::Status ModelRegistry::NoVersions(const std::string& name) const {
  return absl::NotFoundError(absl::StrCat("model '", name, "' has no version in ",
                                          options_.repository, "/", name,
                                          " (VERSION/model.safetensors)"));
}

void ModelRegistry::RetireLocked(ServedModel& model, const VersionHandle& version,
                                 const std::string& why) {
  ServedModel::Record& record = model.records[version->version];
  record.draining.push_back(version);
  if (record.reason.empty() || why != "replaced") record.reason = why;
  Log(LogLevel::kInfo, "model version retired: freed once the calls holding it are answered",
      {{"model", model.name}, {"version", version->version}, {"why", why}});
}

void ModelRegistry::ConfigFailed(const std::string& name, const std::optional<std::string>& stamp,
                                 const absl::Status& why) {
  std::lock_guard lock(mu_);
  ConfigFailedLocked(ModelLocked(name), stamp, why);
}

void ModelRegistry::ConfigFailedLocked(ServedModel& model, const std::optional<std::string>& stamp,
                                       const absl::Status& why) {
  const std::string& name = model.name;
  if (stamp.has_value()) {
    const bool again = model.config_stamp == *stamp && !model.config_error.empty();
    model.config_stamp = *stamp;
    model.config_error = std::string(why.message());
    if (again) return;  // the same refused file: reported once
  }
  reporter_->metrics().ModelLoadFailed(name);
  Log(LogLevel::kWarn, "model config refused; the serving versions are untouched",
      {{"model", name}, {"error", std::string(why.message())}});
}

absl::Status ModelRegistry::Unload(const std::string& name) {
  std::lock_guard lock(mu_);
  ServedModel* model = FindLocked(name);
  if (model == nullptr) {
    return absl::NotFoundError(absl::StrCat("no model '", Clipped(name), "' in the repository"));
  }
  if (model->from_flag) {
    return absl::FailedPreconditionError(absl::StrCat(
        "model '", name, "' is given by --model: it is always loaded and not managed here"));
  }
  // New calls find no ready version (NotFound); calls admitted already hold theirs and finish.
  for (const VersionHandle& v : model->ready) RetireLocked(*model, v, "unloaded");
  model->ready.clear();
  model->unloaded = true;
  reporter_->metrics().ClearModelInfo(name);
  PublishStateLocked(*model);
  return absl::OkStatus();
}

void ModelRegistry::RequestLoad(std::string name, std::optional<std::string> config,
                                std::function<void(absl::Status)> done) {
  if (options_.control_mode != ControlMode::kExplicit || options_.repository.empty()) {
    done(absl::FailedPreconditionError(absl::StrCat(
        "models are loaded and unloaded on request only with --model-repository and "
        "--model-control-mode explicit (this server: ",
        options_.repository.empty() ? "no repository" : ControlModeName(options_.control_mode),
        ")")));
    return;
  }
  if (absl::Status status = CheckModelName(name); !status.ok()) {
    done(status);
    return;
  }
  Post(
      [this, name = std::move(name), config = std::move(config), done = std::move(done)](bool run) {
        done(run ? Reconcile(name, config, /*polling=*/false)
                 : absl::UnavailableError("the server is shutting down"));
      });
}

void ModelRegistry::RequestUnload(std::string name, std::function<void(absl::Status)> done) {
  if (options_.control_mode != ControlMode::kExplicit || options_.repository.empty()) {
    RequestLoad(std::move(name), std::nullopt, std::move(done));  // the same refusal
    return;
  }
  if (absl::Status status = CheckModelName(name); !status.ok()) {
    done(status);
    return;
  }
  Post([this, name = std::move(name), done = std::move(done)](bool run) {
    done(run ? Unload(name) : absl::UnavailableError("the server is shutting down"));
  });
}

void ModelRegistry::Post(std::function<void(bool)> task) {
  {
    std::lock_guard lock(work_->mu);
    if (!work_->stop) {
      work_->tasks.push_back(std::move(task));
      work_->cv.notify_one();
      return;
    }
  }
  task(false);
}

void ModelRegistry::Poll() {
  absl::StatusOr<std::vector<std::string>> names = ListRepositoryModels(options_.repository);
  if (!names.ok()) return;  // a volume being remounted: nothing changes until it is back
  std::set<std::string> all(names->begin(), names->end());
  {
    std::lock_guard lock(mu_);
    for (const auto& model : models_) {
      if (!model->from_flag) all.insert(model->name);
    }
    for (const auto& model : models_) {
      if (model->from_flag) all.erase(model->name);
    }
  }
  for (const std::string& name : all) {
    if (Stopping()) return;  // a shutdown waits for the load under way, not for the others
    Reconcile(name, std::nullopt, /*polling=*/true).IgnoreError();
  }
}

bool ModelRegistry::Stopping() const {
  std::lock_guard lock(work_->mu);
  return work_->stop;
}

void ModelRegistry::Loop() {
  const bool polling = options_.control_mode == ControlMode::kPoll && !options_.repository.empty();
  Clock::time_point next_poll = Clock::now() + options_.poll_interval;
  while (true) {
    std::deque<std::function<void(bool)>> tasks;
    std::vector<ModelVersion*> released;
    {
      std::unique_lock lock(work_->mu);
      auto woken = [&] { return work_->stop || !work_->tasks.empty() || !work_->released.empty(); };
      if (polling) {
        work_->cv.wait_until(lock, next_poll, woken);
      } else {
        work_->cv.wait(lock, woken);
      }
      if (work_->stop) return;
      tasks.swap(work_->tasks);
      released.swap(work_->released);
    }
    if (!released.empty()) {
      // A large layer's pages go back to the system at the low priority too.
      AtLowPriority([&] {
        for (ModelVersion* version : released) delete version;
        return true;
      });
      SweepReleased();
    }
    for (auto& task : tasks) task(!Stopping());
    if (polling && Clock::now() >= next_poll) {
      Poll();
      next_poll = Clock::now() + options_.poll_interval;
    }
  }
}

void ModelRegistry::SweepReleased() {
  std::lock_guard lock(mu_);
  for (const auto& model : models_) {
    for (auto& [version, record] : model->records) {
      std::erase_if(record.draining, [](const auto& weak) { return weak.expired(); });
    }
    PublishStateLocked(*model);
  }
}

ServedModel& ModelRegistry::ModelLocked(const std::string& name) {
  if (ServedModel* model = FindLocked(name)) return *model;
  auto model = std::make_unique<ServedModel>();
  model->name = name;
  model->scheduler =
      std::make_unique<Scheduler>(name, options_.scheduler, executor_.get(), reporter_);
  model->decode =
      std::make_unique<DecodeQueue>(name, options_.decode_chunk_tokens, executor_.get(),
                                    &reporter_->metrics().ForModel(name), model->scheduler.get());
  models_.push_back(std::move(model));
  return *models_.back();
}

ServedModel* ModelRegistry::FindLocked(absl::string_view name) const {
  for (const auto& model : models_) {
    if (model->name == name) return model.get();
  }
  return nullptr;
}

VersionState ModelRegistry::StateLocked(const ServedModel& model, int64_t version,
                                        const ServedModel::Record& record) const {
  for (const VersionHandle& v : model.ready) {
    if (v->version == version) return VersionState::kReady;
  }
  if (record.loading) return VersionState::kLoading;
  for (const auto& weak : record.draining) {
    if (!weak.expired()) return VersionState::kUnloading;
  }
  return VersionState::kUnavailable;
}

void ModelRegistry::PublishStateLocked(const ServedModel& model) const {
  for (const auto& [version, record] : model.records) {
    reporter_->metrics().SetModelState(model.name, version,
                                       VersionStateName(StateLocked(model, version, record)));
  }
}

absl::StatusOr<ModelRegistry::Found> ModelRegistry::Find(absl::string_view name,
                                                         uint64_t version) const {
  std::lock_guard lock(mu_);
  const ServedModel* model = nullptr;
  if (name.empty()) {
    for (const auto& m : models_) {
      if (m->ready.empty()) continue;
      if (model != nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("model is empty but several models are loaded: ", ReadyNamesLocked()));
      }
      model = m.get();
    }
    if (model == nullptr) return absl::NotFoundError("no model is ready");
  } else {
    model = FindLocked(name);
    if (model == nullptr) {
      return absl::NotFoundError(
          absl::StrCat("no model '", Clipped(name), "'; loaded: ", ReadyNamesLocked()));
    }
    if (model->ready.empty()) {
      return absl::NotFoundError(absl::StrCat("model '", model->name, "' has no ready version (",
                                              model->unloaded ? "unloaded" : "not loaded",
                                              "); loaded: ", ReadyNamesLocked()));
    }
  }
  if (version == 0) return Found{const_cast<ServedModel*>(model), model->ready.back()};
  for (const VersionHandle& v : model->ready) {
    if (static_cast<uint64_t>(v->version) == version) {
      return Found{const_cast<ServedModel*>(model), v};
    }
  }
  return absl::NotFoundError(absl::StrCat("model '", model->name, "' has no ready version ",
                                          version, "; ready: ", Versions(model->ready)));
}

std::string ModelRegistry::ReadyNamesLocked() const {
  std::vector<std::string> names;
  for (const auto& model : models_) {
    if (!model->ready.empty()) names.push_back(model->name);
  }
  return names.empty() ? "none" : absl::StrJoin(names, ", ");
}

std::vector<VersionStatus> ModelRegistry::Statuses(bool whole_repository) const {
  // The directory is listed before the lock is taken: no file system call under it.
  std::vector<std::string> in_repository;
  if (whole_repository && !options_.repository.empty()) {
    in_repository = ListRepositoryModels(options_.repository).value_or(std::vector<std::string>{});
  }
  std::lock_guard lock(mu_);
  std::vector<const ServedModel*> sorted;
  for (const auto& model : models_) sorted.push_back(model.get());
  std::sort(sorted.begin(), sorted.end(),
            [](const ServedModel* a, const ServedModel* b) { return a->name < b->name; });
  std::vector<VersionStatus> statuses;
  for (const std::string& name : in_repository) {
    if (FindLocked(name) == nullptr) {
      statuses.push_back({name, 0, VersionState::kUnavailable, "not loaded", {}});
    }
  }
  for (const ServedModel* model : sorted) {
    if (model->records.empty()) {
      statuses.push_back({model->name,
                          0,
                          VersionState::kUnavailable,
                          model->config_error.empty() ? "not loaded" : model->config_error,
                          {}});
    }
    for (const auto& [version, record] : model->records) {
      VersionStatus status{
          model->name, version, StateLocked(*model, version, record), record.reason, {}};
      for (const VersionHandle& v : model->ready) {
        if (v->version == version) status.handle = v;
      }
      for (const auto& weak : record.draining) {
        if (status.handle == nullptr) status.handle = weak.lock();
      }
      if (status.state == VersionState::kReady) status.reason.clear();
      if (!model->config_error.empty()) {
        status.reason =
            absl::StrCat(status.reason, status.reason.empty() ? "" : "; ", model->config_error);
      }
      statuses.push_back(std::move(status));
    }
  }
  return statuses;
}

std::vector<VersionHandle> ModelRegistry::ReadyVersions() const {
  std::lock_guard lock(mu_);
  std::vector<VersionHandle> ready;
  for (const auto& model : models_)
    ready.insert(ready.end(), model->ready.begin(), model->ready.end());
  return ready;
}

int ModelRegistry::pending() const {
  std::lock_guard lock(mu_);
  int total = 0;
  for (const auto& model : models_) total += model->scheduler->pending();
  return total;
}

void ModelRegistry::Drain(Clock::time_point deadline) {
  std::deque<std::function<void(bool)>> tasks;
  std::vector<ModelVersion*> released;
  {
    std::lock_guard lock(work_->mu);
    work_->stop = true;
    tasks.swap(work_->tasks);
    released.swap(work_->released);
  }
  work_->cv.notify_all();
  if (thread_.joinable()) thread_.join();
  for (auto& task : tasks) task(false);
  for (ModelVersion* version : released) delete version;
  std::vector<ServedModel*> models;
  {
    std::lock_guard lock(mu_);
    for (const auto& model : models_) models.push_back(model.get());
  }
  // Every queue closes first, so all models drain at once rather than one after another.
  for (ServedModel* model : models) {
    model->scheduler->Close(deadline);
    model->decode->Close(deadline);
  }
  for (ServedModel* model : models) {
    model->scheduler->Join();
    model->decode->Join();
  }
}

}  // namespace attnserve::server
