// attnserve_bench: the standard shapes of DESIGN.md through Layer::Forward, beside a 4096^3
// oneDNN f32 matmul measured in the same run as the peak. One JSON line per shape, then a
// table. tests/bench/pytorch_bench.py prints the same lines for PyTorch; compare.sh runs both.

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "core/attention_kernel.h"
#include "core/dnnl_context.h"
#include "core/layer.h"
#include "tests/bench/shapes.h"

namespace attnserve::bench {
namespace {

using core::AttentionKind;

// What one shape measured.
struct Result {
  std::string shape;
  int64_t tokens = 0;
  double ms = 0;
  double useful_gflops = 0;
  double peak_gflops = 0;
  double scratch_mib = 0;
};

// Median of `reps` timed calls of `fn` after one untimed warm-up call (JIT, first touch).
double MedianMs(const std::function<void()>& fn, int reps) {
  fn();
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                     .count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// GFLOP/s of a 4096^3 f32 oneDNN matmul on the current threads, plain row-major operands (the
// layout oneDNN is fastest with): the peak that efficiency divides by.
double PeakGflops(int reps) {
  constexpr int64_t n = 4096;
  using tag = dnnl::memory::format_tag;
  const dnnl::memory::desc md({n, n}, dnnl::memory::data_type::f32, tag::ab);
  try {
    const dnnl::matmul matmul(
        dnnl::matmul::primitive_desc(dnnl::matmul::desc(md, md, md), core::CpuEngine()));
    std::vector<float> a = RandomValues(n * n, 1), b = RandomValues(n * n, 2), c(n * n);
    const dnnl::engine& engine = core::CpuEngine();
    dnnl::memory a_mem(md, engine, a.data()), b_mem(md, engine, b.data()),
        c_mem(md, engine, c.data());
    dnnl::stream& stream = core::ThreadStream();
    const double ms = MedianMs(
        [&] {
          matmul.execute(stream,
                         {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_DST, c_mem}});
          stream.wait();
        },
        reps);
    return 2.0 * n * n * n / ms / 1e6;
  } catch (const dnnl::error& e) {
    std::fprintf(stderr, "peak matmul: %s\n", e.what());
    return 0;
  }
}

// The attention problem of a shape, only to ask the kernel how much scratch it takes.
int64_t AttentionScratch(const Shape& shape) {
  core::AttentionProblem problem;
  problem.q_lengths = shape.lengths;
  problem.kv_lengths = shape.kv_lengths;
  problem.num_heads = shape.heads;
  problem.head_dim = shape.d_model / shape.heads;
  problem.causal = core::IsCausal(shape.kind);
  return core::AttentionScratchBytes(problem);
}

// Runs one shape: padded input (and context) as a client would send them.
absl::StatusOr<Result> RunShape(const Shape& shape, core::Precision precision, int reps,
                                double peak) {
  auto layer = core::Layer::Create(RandomWeights(shape), precision);
  core::GetThreadScratch().Release();  // so scratch_mib is this shape's alone
  if (!layer.ok()) return layer.status();
  const int64_t batch = static_cast<int64_t>(shape.lengths.size());
  const std::vector<float> input = RandomValues(batch * shape.padded * shape.d_model, 11);
  std::vector<float> context;
  core::ForwardArgs args;
  args.kind = shape.kind;
  args.input = {input.data(), shape.d_model, shape.lengths, shape.padded};
  if (core::IsCross(shape.kind)) {
    context = RandomValues(batch * shape.kv_padded * shape.d_context, 12);
    args.context =
        core::RaggedBatch{context.data(), shape.d_context, shape.kv_lengths, shape.kv_padded};
  }
  std::vector<float> output((*layer)->Shapes(args).output_size());
  absl::Status status;
  const double ms = MedianMs(
      [&] {
        if (status.ok()) status = (*layer)->Forward(args, output);
      },
      reps);
  if (!status.ok()) return status;
  Result r;
  r.shape = shape.name;
  r.tokens = args.input.total_length();
  r.ms = ms;
  r.useful_gflops = UsefulFlops(shape) / ms / 1e6;
  r.peak_gflops = peak;
  r.scratch_mib = static_cast<double>(AttentionScratch(shape) * omp_get_max_threads() +
                                      core::GetThreadScratch().bytes()) /
                  (1 << 20);
  return r;
}

// Times f32 and bf16 layers of `shape` call by call, alternating, so that a load change on the
// shared machine hits both alike; prints one JSON line with the two medians and their ratio.
absl::Status CompareBf16(const Shape& shape, int reps) {
  auto f32 = core::Layer::Create(RandomWeights(shape), core::Precision::kF32);
  auto bf16 = core::Layer::Create(RandomWeights(shape), core::Precision::kBF16);
  if (!f32.ok()) return f32.status();
  if (!bf16.ok()) return bf16.status();
  const int64_t batch = static_cast<int64_t>(shape.lengths.size());
  const std::vector<float> input = RandomValues(batch * shape.padded * shape.d_model, 11);
  const std::vector<float> context = RandomValues(batch * shape.kv_padded * shape.d_context, 12);
  core::ForwardArgs args;
  args.kind = shape.kind;
  args.input = {input.data(), shape.d_model, shape.lengths, shape.padded};
  if (core::IsCross(shape.kind)) {
    args.context =
        core::RaggedBatch{context.data(), shape.d_context, shape.kv_lengths, shape.kv_padded};
  }
  std::vector<float> output((*f32)->Shapes(args).output_size());
  std::vector<double> ms[2];
  for (int r = 0; r <= reps; ++r) {
    for (int p = 0; p < 2; ++p) {
      const auto start = std::chrono::steady_clock::now();
      absl::Status s = (p == 0 ? *f32 : *bf16)->Forward(args, output);
      if (!s.ok()) return s;
      const std::chrono::duration<double, std::milli> took =
          std::chrono::steady_clock::now() - start;
      if (r > 0) ms[p].push_back(took.count());  // rep 0 is the warm-up
    }
  }
  for (auto& m : ms) std::sort(m.begin(), m.end());
  const double f32_ms = ms[0][ms[0].size() / 2], bf16_ms = ms[1][ms[1].size() / 2];
  std::printf("{\"shape\": \"%s\", \"f32_ms\": %.3f, \"bf16_ms\": %.3f, \"bf16_speedup\": %.3f}\n",
              shape.name.c_str(), f32_ms, bf16_ms, f32_ms / bf16_ms);
  return absl::OkStatus();
}

void PrintJson(const Result& r) {
  std::printf(
      "{\"shape\": \"%s\", \"tokens\": %lld, \"ms\": %.3f, \"useful_gflops\": %.2f, "
      "\"peak_gflops\": %.2f, \"efficiency\": %.4f, \"scratch_mib\": %.2f}\n",
      r.shape.c_str(), static_cast<long long>(r.tokens), r.ms, r.useful_gflops, r.peak_gflops,
      r.peak_gflops > 0 ? r.useful_gflops / r.peak_gflops : 0.0, r.scratch_mib);
  std::fflush(stdout);
}

void PrintTable(const std::vector<Result>& results, const std::string& precision, int threads) {
  std::printf("\n%-8s %8s %10s %10s %8s %8s %11s   (%s, %d threads)\n", "shape", "tokens", "ms",
              "GFLOP/s", "peak", "eff", "scratch MiB", precision.c_str(), threads);
  for (const Result& r : results) {
    std::printf("%-8s %8lld %10.3f %10.1f %8.1f %8.3f %11.2f\n", r.shape.c_str(),
                static_cast<long long>(r.tokens), r.ms, r.useful_gflops, r.peak_gflops,
                r.peak_gflops > 0 ? r.useful_gflops / r.peak_gflops : 0.0, r.scratch_mib);
  }
}

int Main(int argc, char** argv) {
  CLI::App app{"attnserve_bench: Layer::Forward on the standard shapes vs a oneDNN matmul peak"};
  std::string shapes_arg = "bert,causal,ragged,cross,small,long";
  int threads = 0, reps = 5, peak_reps = 3;
  std::string precision_arg = "f32";
  app.add_option("--shapes", shapes_arg, "comma-separated: " + ShapeNames());
  app.add_option("--threads", threads, "OpenMP threads (0: OpenMP's default)");
  app.add_option("--reps", reps, "timed repetitions per shape (after one warm-up)")
      ->check(CLI::PositiveNumber);
  app.add_option("--peak-reps", peak_reps, "timed repetitions of the peak matmul")
      ->check(CLI::PositiveNumber);
  app.add_option("--precision", precision_arg, "f32 or bf16")
      ->check(CLI::IsMember({"f32", "bf16"}));
  bool compare_bf16 = false;
  app.add_flag("--compare-bf16", compare_bf16,
               "instead: f32 vs bf16 per shape, calls alternating, one JSON line each");
  CLI11_PARSE(app, argc, argv);
  if (threads > 0) omp_set_num_threads(threads);
  absl::StatusOr<std::vector<Shape>> shapes = ParseShapes(shapes_arg);
  if (!shapes.ok()) {
    std::fprintf(stderr, "%s\n", shapes.status().ToString().c_str());
    return 2;
  }
  if (compare_bf16) {
    for (const Shape& shape : *shapes) {
      if (absl::Status s = CompareBf16(shape, reps); !s.ok()) {
        std::fprintf(stderr, "%s: %s\n", shape.name.c_str(), s.ToString().c_str());
        return 1;
      }
    }
    return 0;
  }
  const core::Precision precision =
      precision_arg == "bf16" ? core::Precision::kBF16 : core::Precision::kF32;
  const double peak = PeakGflops(peak_reps);
  std::vector<Result> results;
  for (const Shape& shape : *shapes) {
    absl::StatusOr<Result> r = RunShape(shape, precision, reps, peak);
    if (!r.ok()) {
      std::fprintf(stderr, "%s: %s\n", shape.name.c_str(), r.status().ToString().c_str());
      return 1;
    }
    PrintJson(*r);
    results.push_back(*r);
  }
  PrintTable(results, precision_arg, omp_get_max_threads());
  return 0;
}

}  // namespace
}  // namespace attnserve::bench

int main(int argc, char** argv) { return attnserve::bench::Main(argc, argv); }
