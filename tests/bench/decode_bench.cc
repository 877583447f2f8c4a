// attnserve_decode_bench: one decode step of many sequences through Layer::Decode (no server),
// beside the memory-bound ceiling measured in the same run. A step must read every cached key
// and value once, so its time can be no less than those bytes / the memory's bandwidth; the
// step's, and its attention's alone, are printed as a share of that bound. The calls alternate
// (step, attention alone, read stream, copy), so a load change on a shared machine hits all
// of them alike. One JSON line per cached length.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "core/kv_attention.h"
#include "core/kv_cache.h"
#include "core/layer.h"
#include "tests/bench/shapes.h"

namespace attnserve::bench {
namespace {

// A buffer far larger than the caches, read (a sum every thread keeps to itself) or copied
// half to half by the current OpenMP threads: the memory's bandwidth, as a step would see it.
class MemoryStream {
 public:
  explicit MemoryStream(int64_t bytes) : floats_(bytes / 4), data_(floats_, 1.0f) {}

  void Read() {
    typedef float Floats16 __attribute__((vector_size(64)));
    const int64_t lines = floats_ / 16;
    const float* p = data_.data();
    float total = 0;
#pragma omp parallel reduction(+ : total)
    {
      // Four independent sums a thread, so the adds keep up with the loads.
      Floats16 s0 = {}, s1 = {}, s2 = {}, s3 = {};
#pragma omp for schedule(static)
      for (int64_t i = 0; i < lines; i += 4) {
        Floats16 v0, v1, v2, v3;
        __builtin_memcpy(&v0, p + i * 16, sizeof(v0));
        __builtin_memcpy(&v1, p + i * 16 + 16, sizeof(v1));
        __builtin_memcpy(&v2, p + i * 16 + 32, sizeof(v2));
        __builtin_memcpy(&v3, p + i * 16 + 48, sizeof(v3));
        s0 += v0;
        s1 += v1;
        s2 += v2;
        s3 += v3;
      }
      const Floats16 sum = (s0 + s1) + (s2 + s3);
      for (int j = 0; j < 16; ++j) total += sum[j];
    }
    sink_ = total;
  }

  void Copy() {
    const int64_t half = floats_ / 2;
    float* p = data_.data();
#pragma omp parallel
    {
      const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
      const int64_t begin = half * t / threads, end = half * (t + 1) / threads;
      std::memcpy(p + half + begin, p + begin, (end - begin) * sizeof(float));
    }
  }

  int64_t bytes() const { return floats_ * 4; }

 private:
  int64_t floats_;
  std::vector<float> data_;
  volatile float sink_ = 0;
};

// `sequences` sequences with `cached` tokens each in their caches, stepping one token each; the
// step is rewound after it runs, so every step reads the same length.
struct DecodeState {
  std::shared_ptr<const core::Layer> layer;
  core::KvCacheBudget budget{int64_t{1} << 36};  // past what any case holds
  std::vector<std::unique_ptr<core::KvSequence>> caches;
  std::vector<float> input, output, q, attended;
  std::vector<core::DecodeSequence> steps;
  std::vector<core::KvQuery> queries;
  int64_t cached = 0;
  absl::Status status;

  void Step() {
    if (status.ok()) status = layer->Decode(core::AttentionKind::kCausal, steps);
    for (auto& cache : caches) cache->Rewind(cached);
  }
};

absl::StatusOr<std::unique_ptr<DecodeState>> MakeDecode(const Shape& shape, int64_t sequences,
                                                        int64_t cached,
                                                        core::KvPrecision precision) {
  auto st = std::make_unique<DecodeState>();
  auto layer = core::Layer::Create(RandomWeights(shape), core::Precision::kF32);
  if (!layer.ok()) return layer.status();
  st->layer = *layer;
  st->cached = cached;
  const int64_t d = shape.d_model, inner = shape.d_model;
  st->input = RandomValues(sequences * d, 21);
  st->output.resize(sequences * d);
  const std::vector<float> rows = RandomValues(2 * inner * 64, 22);
  for (int64_t s = 0; s < sequences; ++s) {
    auto cache =
        std::make_unique<core::KvSequence>(inner, inner / shape.heads, precision, &st->budget);
    if (absl::Status r = cache->Reserve(cached + 1); !r.ok()) return r;
    for (int64_t p = 0; p < cached; ++p) {
      const float* row = rows.data() + (p + s) % 64 * 2 * inner;
      cache->Write(p, row, row + inner);
    }
    st->steps.push_back({.input = st->input.data() + s * d,
                         .tokens = 1,
                         .position = cached,
                         .cache = cache.get(),
                         .output = st->output.data() + s * d});
    st->caches.push_back(std::move(cache));
  }
  // The attention alone: the same queries over the same caches (the step's new key included).
  st->q = RandomValues(sequences * inner, 23);
  st->attended.resize(sequences * inner);
  for (int64_t s = 0; s < sequences; ++s) {
    st->caches[s]->Write(cached, rows.data(), rows.data() + inner);
    st->caches[s]->Rewind(cached);
    st->queries.push_back({st->q.data() + s * inner, st->attended.data() + s * inner,
                           st->caches[s].get(), cached + 1});
  }
  return st;
}

// Runs `fn` on `threads` OpenMP threads (the calling thread's setting, restored after).
void OnThreads(int threads, const std::function<void()>& fn) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(threads);
  fn();
  omp_set_num_threads(saved);
}

// --overlap: how much a step could gain if its projections (compute-bound) ran beside its
// attention (memory-bound) instead of before and after it. Timed apart on every thread, on one
// thread each, and both at once, one thread each (a copy between them, so that each starts from
// memory as in a step). The bound: both at once until the first is done, the rest of the other
// on every thread; it ignores that a step's attention needs its queries first, so no schedule
// does better.
int Overlap(DecodeState& s, DecodeState& projections_only, int64_t heads, int64_t d_model,
            MemoryStream& memory, int reps) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(d_model / heads));
  auto attention = [&] { core::KvAttention(s.queries, heads, d_model / heads, scale); };
  auto projections = [&] { projections_only.Step(); };
  std::vector<double> together_attention, together_projections;
  const std::vector<double> ms = AlternatingMedianMs(
      {[&] { s.Step(); }, [&] { memory.Copy(); }, attention, [&] { memory.Copy(); }, projections,
       [&] { memory.Copy(); }, [&] { OnThreads(1, attention); }, [&] { memory.Copy(); },
       [&] { OnThreads(1, projections); },
       // On one thread: the team's other thread, spinning after a region, would take a core.
       [&] { OnThreads(1, [&] { memory.Copy(); }); },
       [&] {
         double projections_ms = 0;
         std::thread other([&] { OnThreads(1, [&] { projections_ms = MsOf(projections); }); });
         OnThreads(1, [&] { together_attention.push_back(MsOf(attention)); });
         other.join();
         together_projections.push_back(projections_ms);
       },
       [&] { memory.Copy(); }},
      reps);
  if (!s.status.ok() || !projections_only.status.ok()) {
    std::fprintf(stderr, "%s\n",
                 (s.status.ok() ? projections_only.status : s.status).ToString().c_str());
    return 1;
  }
  const double step = ms[0], attention_ms = ms[2], projections_ms = ms[4];
  const double ta = Median(together_attention), tp = Median(together_projections);
  const double both = std::min(ta, tp);
  const double bound = both + (1 - both / ta) * attention_ms + (1 - both / tp) * projections_ms;
  std::printf(
      "{\"sequences\": %zu, \"cached\": %lld, \"step_ms\": %.3f, \"attention_ms\": %.3f, "
      "\"projections_ms\": %.3f, \"attention_one_thread_ms\": %.3f, "
      "\"projections_one_thread_ms\": %.3f, \"together_attention_ms\": %.3f, "
      "\"together_projections_ms\": %.3f, \"overlapped_step_bound_ms\": %.3f, "
      "\"step_over_bound\": %.3f}\n",
      s.steps.size(), static_cast<long long>(s.cached), step, attention_ms, projections_ms, ms[6],
      ms[8], ta, tp, bound, step / bound);
  std::fflush(stdout);
  return 0;
}

int Main(int argc, char** argv) {
  CLI::App app{"attnserve_decode_bench: Layer::Decode steps vs the memory-bound ceiling"};
  int64_t sequences = 64, d_model = 768, heads = 12;
  std::string cached_arg = "512,4096", precision_arg = "f32";
  int threads = 0, reps = 15;
  int64_t stream_mib = 1024;
  app.add_option("--sequences", sequences, "sequences in the step, one token each")
      ->check(CLI::PositiveNumber);
  app.add_option("--cached", cached_arg, "comma-separated cached lengths");
  app.add_option("--d-model", d_model, "the layer's width")->check(CLI::PositiveNumber);
  app.add_option("--heads", heads, "its heads")->check(CLI::PositiveNumber);
  app.add_option("--kv-precision", precision_arg, "f32 or bf16")
      ->check(CLI::IsMember({"f32", "bf16"}));
  app.add_option("--threads", threads, "OpenMP threads (0: OpenMP's default)");
  app.add_option("--reps", reps, "timed rounds (after one warm-up)")->check(CLI::PositiveNumber);
  app.add_option("--stream-mib", stream_mib,
                 "the read stream's and the copy's buffer (far larger than the caches)")
      ->check(CLI::PositiveNumber);
  bool profile = false;
  app.add_flag("--profile", profile,
               "time the steps and the attention alone, without the memory stream between them "
               "(for a profiler, or caches kept warm); no ceiling is printed");
  bool overlap = false;
  app.add_flag("--overlap", overlap,
               "instead: the projections and the attention timed apart, on one thread each, and "
               "both at once, one thread each: the most a step could gain by running them side "
               "by side (overlapped_step_bound_ms)");
  CLI11_PARSE(app, argc, argv);
  if (threads > 0) omp_set_num_threads(threads);
  const bool bf16 = precision_arg == "bf16";
  const core::KvPrecision precision = bf16 ? core::KvPrecision::kBF16 : core::KvPrecision::kF32;
  Shape shape;
  shape.name = "decode";
  shape.kind = core::AttentionKind::kCausal;
  shape.d_model = shape.d_context = d_model;
  shape.heads = heads;
  MemoryStream memory(stream_mib << 20);
  for (absl::string_view part : absl::StrSplit(cached_arg, ',', absl::SkipEmpty())) {
    int64_t cached = 0;
    if (!absl::SimpleAtoi(part, &cached) || cached < 0) {
      std::fprintf(stderr, "--cached: '%s' is not a length\n", std::string(part).c_str());
      return 2;
    }
    auto st = MakeDecode(shape, sequences, cached, precision);
    if (!st.ok()) {
      std::fprintf(stderr, "%s\n", st.status().ToString().c_str());
      return 1;
    }
    DecodeState& s = **st;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d_model / heads));
    if (overlap) {
      // The same sequences with empty caches: their step is all projections.
      auto projections_only = MakeDecode(shape, sequences, 0, precision);
      if (!projections_only.ok()) {
        std::fprintf(stderr, "%s\n", projections_only.status().ToString().c_str());
        return 1;
      }
      if (int r = Overlap(s, **projections_only, heads, d_model, memory, reps); r != 0) return r;
      continue;
    }
    if (profile) {
      const std::vector<double> ms = AlternatingMedianMs(
          {[&] { s.Step(); }, [&] { core::KvAttention(s.queries, heads, d_model / heads, scale); }},
          reps);
      std::printf(
          "{\"sequences\": %lld, \"cached\": %lld, \"step_ms\": %.3f, \"attention_ms\": "
          "%.3f}\n",
          static_cast<long long>(sequences), static_cast<long long>(cached), ms[0], ms[1]);
      continue;
    }
    const std::vector<double> ms = AlternatingMedianMs(
        {[&] { s.Step(); }, [&] { core::KvAttention(s.queries, heads, d_model / heads, scale); },
         [&] { memory.Read(); }, [&] { memory.Copy(); }},
        reps);
    if (!s.status.ok()) {
      std::fprintf(stderr, "%s\n", s.status.ToString().c_str());
      return 1;
    }
    const double cache_bytes =
        static_cast<double>(sequences) * (cached + 1) * 2 * d_model * (bf16 ? 2 : 4);
    const double read_gbs = memory.bytes() / ms[2] / 1e6;
    const double copy_gbs = memory.bytes() / ms[3] / 1e6;  // read + write bytes
    const double bound_ms = cache_bytes / read_gbs / 1e6;
    std::printf(
        "{\"sequences\": %lld, \"cached\": %lld, \"d_model\": %lld, \"kv\": \"%s\", "
        "\"step_ms\": %.3f, \"attention_ms\": %.3f, \"cache_mb\": %.1f, \"read_gbs\": %.1f, "
        "\"copy_gbs\": %.1f, \"tokens_per_s\": %.0f, \"step_of_read_bound\": %.3f, "
        "\"attention_of_read_bound\": %.3f, \"step_of_copy_bound\": %.3f}\n",
        static_cast<long long>(sequences), static_cast<long long>(cached),
        static_cast<long long>(d_model), precision_arg.c_str(), ms[0], ms[1], cache_bytes / 1e6,
        read_gbs, copy_gbs, sequences / ms[0] * 1e3, bound_ms / ms[0], bound_ms / ms[1],
        cache_bytes / copy_gbs / 1e6 / ms[0]);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace attnserve::bench

int main(int argc, char** argv) { return attnserve::bench::Main(argc, argv); }
