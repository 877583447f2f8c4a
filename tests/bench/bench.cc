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
#include <numeric>
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

// The projections of `shape` alone: its matmuls over the valid tokens, as Layer runs them.
double ProjectionMs(const Shape& shape, int reps) {
  const int64_t d = shape.d_model, inner = shape.d_model, ctx = shape.d_context;
  const int64_t q = std::accumulate(shape.lengths.begin(), shape.lengths.end(), int64_t{0});
  const int64_t k = std::accumulate(shape.kv_lengths.begin(), shape.kv_lengths.end(), int64_t{0});
  struct Mm {
    int64_t m, k, n;
  };
  std::vector<Mm> mms = {{q, inner, d}};  // output projection
  if (core::IsCross(shape.kind)) {
    mms.push_back({q, d, inner});
    mms.push_back({k, ctx, 2 * inner});
  } else {
    mms.push_back({q, d, 3 * inner});
  }
  std::vector<std::shared_ptr<const core::CachedMatmul>> prims;
  size_t scratch_bytes = 0;
  for (const Mm& mm : mms) {
    prims.push_back(*core::GetMatmul({mm.m, mm.k, mm.n, false, true, omp_get_max_threads()}));
    scratch_bytes = std::max(scratch_bytes, prims.back()->scratchpad_bytes);
  }
  const std::vector<float> x = RandomValues(std::max(q, k) * std::max(d, ctx), 5);
  const std::vector<float> w = RandomValues(3 * inner * std::max(d, ctx), 6);
  std::vector<float> y(std::max(q, k) * 3 * inner);
  std::vector<char> scratchpad(scratch_bytes + 64);
  return MedianMs(
      [&] {
        for (size_t i = 0; i < mms.size(); ++i) {
          core::ExecuteMatmul(
              *prims[i], {mms[i].m, x.data(), w.data(), w.data(), y.data(), scratchpad.data()});
        }
      },
      reps);
}

// RunAttention alone on random packed Q, K, V of `shape` (B2's kernel).
double AttentionMs(const Shape& shape, int reps) {
  const int64_t inner = shape.d_model;
  std::vector<int64_t> q_offsets(shape.lengths.size()), kv_offsets(shape.lengths.size());
  std::exclusive_scan(shape.lengths.begin(), shape.lengths.end(), q_offsets.begin(), 0);
  std::exclusive_scan(shape.kv_lengths.begin(), shape.kv_lengths.end(), kv_offsets.begin(), 0);
  const int64_t q = q_offsets.back() + shape.lengths.back();
  const int64_t k = kv_offsets.back() + shape.kv_lengths.back();
  const std::vector<float> qs = RandomValues(q * inner, 7), ks = RandomValues(k * 2 * inner, 8);
  std::vector<float> out(q * inner);
  core::AttentionProblem p;
  p.q = qs.data();
  p.q_stride = inner;
  p.k = ks.data();
  p.v = ks.data() + inner;
  p.k_stride = p.v_stride = 2 * inner;
  p.out = out.data();
  p.out_stride = inner;
  p.q_lengths = shape.lengths;
  p.q_offsets = q_offsets;
  p.kv_lengths = shape.kv_lengths;
  p.kv_offsets = kv_offsets;
  p.num_heads = shape.heads;
  p.head_dim = inner / shape.heads;
  p.causal = core::IsCausal(shape.kind);
  p.scale = 1.0f / std::sqrt(static_cast<float>(p.head_dim));
  return MedianMs([&] { core::RunAttention(p); }, reps);
}

// One JSON line splitting `shape` into projections (ours) and attention (the kernel).
void PrintBreakdown(const Shape& shape, int reps, double peak) {
  const double proj_ms = ProjectionMs(shape, reps), attn_ms = AttentionMs(shape, reps);
  const double total = UsefulFlops(shape);
  const double proj_flops = ProjectionFlops(shape), attn_flops = total - proj_flops;
  std::printf(
      "{\"shape\": \"%s\", \"proj_ms\": %.3f, \"proj_efficiency\": %.4f, \"attn_ms\": %.3f, "
      "\"attn_efficiency\": %.4f, \"attn_share_of_flops\": %.3f, \"peak_gflops\": %.2f}\n",
      shape.name.c_str(), proj_ms, proj_flops / proj_ms / 1e6 / peak, attn_ms,
      attn_flops / attn_ms / 1e6 / peak, attn_flops / total, peak);
  std::fflush(stdout);
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
  bool compare_bf16 = false, breakdown = false;
  app.add_flag("--breakdown", breakdown,
               "instead: projections and attention kernel timed apart, one JSON line per shape");
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
  if (breakdown) {
    const double peak = PeakGflops(peak_reps);
    for (const Shape& shape : *shapes) PrintBreakdown(shape, reps, peak);
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
