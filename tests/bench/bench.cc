// attnserve_bench: the standard shapes (shapes.cc) through Layer::Forward, beside a 4096^3
// oneDNN f32 matmul measured in the same run as the peak. One JSON line per shape, then a
// table. tests/bench/pytorch_bench.py prints the same lines for PyTorch; compare.sh runs both.

#include <omp.h>

#include <algorithm>
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

// The peak: a 4096^3 f32 oneDNN matmul with plain row-major operands, on the current threads.
class PeakMatmul {
 public:
  static constexpr int64_t kN = 4096;
  static constexpr double kFlops = 2.0 * kN * kN * kN;

  PeakMatmul()
      : md_({kN, kN}, dnnl::memory::data_type::f32, dnnl::memory::format_tag::ab),
        matmul_(dnnl::matmul::primitive_desc(dnnl::matmul::desc(md_, md_, md_), core::CpuEngine())),
        a_(RandomValues(kN * kN, 1)),
        b_(RandomValues(kN * kN, 2)),
        c_(kN * kN) {}

  void Run() {
    const dnnl::engine& engine = core::CpuEngine();
    dnnl::memory a(md_, engine, a_.data()), b(md_, engine, b_.data()), c(md_, engine, c_.data());
    dnnl::stream& stream = core::ThreadStream();
    matmul_.execute(stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
    stream.wait();
  }

 private:
  dnnl::memory::desc md_;
  dnnl::matmul matmul_;
  std::vector<float> a_, b_, c_;
};

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

// One shape's layer and padded input (and context), as a client would send them.
struct ShapeCall {
  std::shared_ptr<const core::Layer> layer;
  std::vector<float> input, context, output;
  core::ForwardArgs args;
  absl::Status status;  // of the first failing call

  void Run() {
    if (status.ok()) status = layer->Forward(args, output);
  }
};

absl::StatusOr<std::unique_ptr<ShapeCall>> MakeShapeCall(const Shape& shape,
                                                         core::Precision precision) {
  auto layer = core::Layer::Create(RandomWeights(shape), precision);
  if (!layer.ok()) return layer.status();
  auto call = std::make_unique<ShapeCall>();
  call->layer = *layer;
  const int64_t batch = static_cast<int64_t>(shape.lengths.size());
  call->input = RandomValues(batch * shape.padded * shape.d_model, 11);
  call->args.kind = shape.kind;
  call->args.input = {call->input.data(), shape.d_model, shape.lengths, shape.padded, {}};
  if (core::IsCross(shape.kind)) {
    call->context = RandomValues(batch * shape.kv_padded * shape.d_context, 12);
    call->args.context = core::RaggedBatch{
        call->context.data(), shape.d_context, shape.kv_lengths, shape.kv_padded, {}};
  }
  call->output.resize(call->layer->Shapes(call->args).output_size());
  return call;
}

// Runs one shape, its calls alternating with peak-matmul calls (each call then starts with
// caches the matmul evicted: "cold"), or when `warm`, back to back with the peak timed after.
absl::StatusOr<Result> RunShape(const Shape& shape, core::Precision precision, int reps,
                                PeakMatmul& peak, bool warm) {
  core::GetThreadScratch().Release();  // so scratch_mib is this shape's alone
  absl::StatusOr<std::unique_ptr<ShapeCall>> call = MakeShapeCall(shape, precision);
  if (!call.ok()) return call.status();
  ShapeCall& c = **call;
  const std::vector<double> ms =
      warm ? std::vector<double>{AlternatingMedianMs({[&] { c.Run(); }}, reps)[0],
                                 AlternatingMedianMs({[&] { peak.Run(); }}, reps)[0]}
           : AlternatingMedianMs({[&] { c.Run(); }, [&] { peak.Run(); }}, reps);
  if (!c.status.ok()) return c.status;
  Result r;
  r.shape = shape.name;
  r.tokens = c.args.input.total_length();
  r.ms = ms[0];
  r.useful_gflops = UsefulFlops(shape) / ms[0] / 1e6;
  r.peak_gflops = PeakMatmul::kFlops / ms[1] / 1e6;
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
  args.input = {input.data(), shape.d_model, shape.lengths, shape.padded, {}};
  if (core::IsCross(shape.kind)) {
    args.context =
        core::RaggedBatch{context.data(), shape.d_context, shape.kv_lengths, shape.kv_padded, {}};
  }
  std::vector<float> output((*f32)->Shapes(args).output_size());
  absl::Status status;
  const std::vector<double> ms = AlternatingMedianMs({[&] {
                                                        if (status.ok())
                                                          status = (*f32)->Forward(args, output);
                                                      },
                                                      [&] {
                                                        if (status.ok())
                                                          status = (*bf16)->Forward(args, output);
                                                      }},
                                                     reps);
  if (!status.ok()) return status;
  const double f32_ms = ms[0], bf16_ms = ms[1];
  std::printf("{\"shape\": \"%s\", \"f32_ms\": %.3f, \"bf16_ms\": %.3f, \"bf16_speedup\": %.3f}\n",
              shape.name.c_str(), f32_ms, bf16_ms, f32_ms / bf16_ms);
  return absl::OkStatus();
}

// The projections of `shape` alone: its matmuls over the valid tokens, as Layer runs them.
std::function<void()> ProjectionCall(const Shape& shape) {
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
  struct State {
    std::vector<Mm> mms;
    std::vector<std::shared_ptr<const core::CachedMatmul>> prims;
    std::vector<float> x, w, y;
    std::vector<char> scratchpad;
  };
  auto st = std::make_shared<State>();
  st->mms = mms;
  size_t scratch_bytes = 0;
  for (const Mm& mm : mms) {
    st->prims.push_back(*core::GetMatmul({mm.m, mm.k, mm.n, false, true, omp_get_max_threads()}));
    scratch_bytes = std::max(scratch_bytes, st->prims.back()->scratchpad_bytes);
  }
  st->x = RandomValues(std::max(q, k) * std::max(d, ctx), 5);
  st->w = RandomValues(3 * inner * std::max(d, ctx), 6);
  st->y.resize(std::max(q, k) * 3 * inner);
  st->scratchpad.resize(scratch_bytes + 64);
  return [st] {
    for (size_t i = 0; i < st->mms.size(); ++i) {
      core::ExecuteMatmul(*st->prims[i], {st->mms[i].m, st->x.data(), st->w.data(), st->w.data(),
                                          st->y.data(), st->scratchpad.data()});
    }
  };
}

// RunAttention alone on random packed Q, K, V of `shape` (B2's kernel).
std::function<void()> AttentionCall(const Shape& shape) {
  const int64_t inner = shape.d_model;
  struct State {
    std::vector<int64_t> q_lengths, kv_lengths, q_offsets, kv_offsets;
    std::vector<float> qs, ks, out;
    core::AttentionProblem p;
  };
  auto st = std::make_shared<State>();
  st->q_lengths = shape.lengths;
  st->kv_lengths = shape.kv_lengths;
  st->q_offsets.resize(shape.lengths.size());
  st->kv_offsets.resize(shape.lengths.size());
  std::exclusive_scan(shape.lengths.begin(), shape.lengths.end(), st->q_offsets.begin(), 0);
  std::exclusive_scan(shape.kv_lengths.begin(), shape.kv_lengths.end(), st->kv_offsets.begin(), 0);
  const int64_t q = st->q_offsets.back() + shape.lengths.back();
  const int64_t k = st->kv_offsets.back() + shape.kv_lengths.back();
  st->qs = RandomValues(q * inner, 7);
  st->ks = RandomValues(k * 2 * inner, 8);
  st->out.resize(q * inner);
  core::AttentionProblem& p = st->p;
  p.q = st->qs.data();
  p.q_stride = inner;
  p.k = st->ks.data();
  p.v = st->ks.data() + inner;
  p.k_stride = p.v_stride = 2 * inner;
  p.out = st->out.data();
  p.out_stride = inner;
  p.q_lengths = st->q_lengths;
  p.q_offsets = st->q_offsets;
  p.kv_lengths = st->kv_lengths;
  p.kv_offsets = st->kv_offsets;
  p.num_heads = shape.heads;
  p.head_dim = inner / shape.heads;
  p.causal = core::IsCausal(shape.kind);
  p.scale = 1.0f / std::sqrt(static_cast<float>(p.head_dim));
  return [st] { core::RunAttention(st->p); };
}

// One JSON line splitting `shape` into projections (ours) and attention (the kernel).
void PrintBreakdown(const Shape& shape, int reps, PeakMatmul& peak_matmul) {
  absl::StatusOr<std::unique_ptr<ShapeCall>> call = MakeShapeCall(shape, core::Precision::kF32);
  if (!call.ok()) {
    std::fprintf(stderr, "%s: %s\n", shape.name.c_str(), call.status().ToString().c_str());
    return;
  }
  const std::vector<double> ms =
      AlternatingMedianMs({ProjectionCall(shape), AttentionCall(shape), [&] { (*call)->Run(); },
                           [&] { peak_matmul.Run(); }},
                          reps);
  const double proj_ms = ms[0], attn_ms = ms[1], layer_ms = ms[2];
  const double peak = PeakMatmul::kFlops / ms[3] / 1e6;
  const double total = UsefulFlops(shape);
  const double proj_flops = ProjectionFlops(shape), attn_flops = total - proj_flops;
  // "other": what Layer::Forward spends beyond the two (validation, packing, scattering).
  std::printf(
      "{\"shape\": \"%s\", \"proj_ms\": %.3f, \"proj_efficiency\": %.4f, \"attn_ms\": %.3f, "
      "\"attn_efficiency\": %.4f, \"layer_ms\": %.3f, \"other_ms\": %.3f, "
      "\"attn_share_of_flops\": %.3f, \"peak_gflops\": %.2f}\n",
      shape.name.c_str(), proj_ms, proj_flops / proj_ms / 1e6 / peak, attn_ms,
      attn_flops / attn_ms / 1e6 / peak, layer_ms, layer_ms - proj_ms - attn_ms, attn_flops / total,
      peak);
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
  int threads = 0, reps = 5;
  std::string precision_arg = "f32";
  app.add_option("--shapes", shapes_arg, "comma-separated: " + ShapeNames());
  app.add_option("--threads", threads, "OpenMP threads (0: OpenMP's default)");
  app.add_option("--reps", reps, "timed repetitions per shape (after one warm-up)")
      ->check(CLI::PositiveNumber);
  app.add_option("--precision", precision_arg, "f32 or bf16")
      ->check(CLI::IsMember({"f32", "bf16"}));
  bool compare_bf16 = false, breakdown = false, warm = false;
  app.add_flag("--warm", warm,
               "time each shape's calls back to back (caches warm, as a server's steady state) "
               "instead of alternating them with the peak matmul");
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
  // Made once; each shape's reps alternate with peak reps, so its efficiency divides by the
  // peak of the same moments.
  PeakMatmul peak;
  if (breakdown) {
    for (const Shape& shape : *shapes) PrintBreakdown(shape, reps, peak);
    return 0;
  }
  const core::Precision precision =
      precision_arg == "bf16" ? core::Precision::kBF16 : core::Precision::kF32;
  std::vector<Result> results;
  for (const Shape& shape : *shapes) {
    absl::StatusOr<Result> r = RunShape(shape, precision, reps, peak, warm);
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

int main(int argc, char** argv) {
  try {
    return attnserve::bench::Main(argc, argv);
  } catch (const dnnl::error& e) {  // the peak matmul is oneDNN's own, outside Layer's guard
    std::fprintf(stderr, "oneDNN: %s\n", e.what());
    return 1;
  }
}
