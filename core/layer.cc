// Layer: checks a call, then runs it on oneDNN without touching padding. The valid tokens are
// packed back to back, projected with one matmul per weight matrix (Q|K|V fused for the self
// kinds), handed to RunAttention with per-sequence offsets, projected out, and scattered back
// into the caller's layout with zero rows where the caller has padding.

#include "core/layer.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/attention_kernel.h"
#include "core/dnnl_context.h"
#include "core/float16.h"
#include "core/guarded.h"
#include "core/kv_attention.h"
#include "core/layer_limits.h"
#include "core/parallel_for.h"
#include "core/small_matmul.h"

namespace attnserve::core {
namespace {

// Copies (and for bf16 rounds) the valid rows of `batch` into `rows` packed rows of `buffer`,
// zeroing the rows past the valid ones. Returns the input itself when nothing needs doing.
const void* PackRows(const RaggedBatch& batch, std::span<const int64_t> offsets, int64_t rows,
                     bool bf16, ScratchBuffer& buffer) {
  const int64_t valid = batch.total_length();
  const int64_t width = batch.width;
  if (!bf16 && batch.packed() && !batch.segmented() && rows == valid) return batch.data;
  const int64_t element = bf16 ? 2 : 4;
  char* out = static_cast<char*>(buffer.Get(rows * width * element));
  if (batch.segmented()) {
    // Each sequence is contiguous in its own buffer: one block copy per sequence.
    ParallelFor(valid * width > kParallelFloats, batch.batch(), [&](int64_t b) {
      const float* src = batch.sequence_data[b];
      const int64_t count = batch.lengths[b] * width;
      if (bf16) {
        ConvertToBf16(src, reinterpret_cast<uint16_t*>(out + offsets[b] * width * 2), count);
      } else if (count > 0) {
        std::memcpy(out + offsets[b] * width * 4, src, count * 4);
      }
    });
    std::memset(out + valid * width * element, 0, (rows - valid) * width * element);
    return out;
  }
  const int64_t src_rows = batch.packed() ? valid : batch.rows();
  const int64_t padded = batch.padded_length;
  ParallelFor(src_rows * width > kParallelFloats, src_rows, [&](int64_t r) {
    int64_t dst = r;
    if (!batch.packed()) {
      const int64_t b = r / padded, i = r % padded;
      if (i >= batch.lengths[b]) return;
      dst = offsets[b] + i;
    }
    const float* src = batch.data + r * width;
    if (bf16) {
      ConvertToBf16(src, reinterpret_cast<uint16_t*>(out + dst * width * 2), width);
    } else {
      std::memcpy(out + dst * width * 4, src, width * 4);
    }
  });
  std::memset(out + valid * width * element, 0, (rows - valid) * width * element);
  return out;
}

// Writes the packed `rows` ([total_length, width]) into `output` in the layout of `batch`, with
// zero rows where `batch` has padding.
void ScatterRows(const RaggedBatch& batch, std::span<const int64_t> offsets, const float* rows,
                 int64_t width, std::span<float> output) {
  if (batch.packed()) {
    if (rows != output.data()) {
      std::memcpy(output.data(), rows, batch.total_length() * width * sizeof(float));
    }
    return;
  }
  const int64_t padded = batch.padded_length;
  const int64_t rows_out = batch.rows();
  ParallelFor(rows_out * width > kParallelFloats, rows_out, [&](int64_t r) {
    const int64_t b = r / padded, i = r % padded;
    float* dst = output.data() + r * width;
    if (i < batch.lengths[b]) {
      std::memcpy(dst, rows + (offsets[b] + i) * width, width * sizeof(float));
    } else {
      std::memset(dst, 0, width * sizeof(float));
    }
  });
}

// One call's batches in packed form, shared by the steps of Forward.
struct PackedCall {
  const RaggedBatch* input = nullptr;
  const RaggedBatch* kv = nullptr;  // the context for cross kinds, else the input
  std::vector<int64_t> q_offsets, kv_offsets;
  int64_t tokens = 0;  // valid query tokens
  int64_t rows = 0;    // the rows the query-side matmuls run on (MatmulRows(tokens))
};

// One projection as the matmul sees it: W (f32 or bf16) in MatmulKey's layouts (w_ld 0: [n, k]
// row-major; else W^T, [k, n] with rows w_ld apart), bias f32 [n] or null; and, when the layer
// keeps them, the same columns in SmallMatmul's panels: `small`'s columns from `small_first`.
struct Projection {
  const void* weights = nullptr;
  const float* bias = nullptr;
  int64_t k = 0;
  int64_t n = 0;
  bool bf16 = false;
  int64_t w_ld = 0;
  const SmallMatmulWeights* small = nullptr;
  int64_t small_first = 0;
};

// y[rows, n] = x[rows, k] W^T + b. `rows` must come from MatmulRows. A few f32 rows of a call
// or run that is serial anyway (small: ScopedOmpThreads) go through SmallMatmul on this thread;
// the rest through oneDNN, with the team (a wide layer's weights read by every core).
absl::Status Project(const Projection& p, int64_t rows, const void* x, float* y,
                     ThreadScratch& scratch) {
  if (p.small != nullptr && rows <= kSmallMatmulRows && omp_get_max_threads() == 1) {
    SmallMatmul(rows, *p.small, p.small_first, p.n, static_cast<const float*>(x), p.bias, y);
    return absl::OkStatus();
  }
  MatmulKey key{rows >= kRuntimeRowsFrom ? DNNL_RUNTIME_DIM_VAL : rows,
                p.k,
                p.n,
                p.bf16,
                p.bias != nullptr,
                omp_get_max_threads(),
                p.w_ld};
  absl::StatusOr<std::shared_ptr<const CachedMatmul>> matmul = GetMatmul(key);
  if (!matmul.ok()) return matmul.status();
  void* scratchpad = scratch.scratchpad.Get((*matmul)->scratchpad_bytes);
  ExecuteMatmul(**matmul, {rows, x, p.weights, p.bias, y, scratchpad});
  return absl::OkStatus();
}

// Rows [valid, rows) of a [rows, width] buffer set to 0, so bucket padding stays finite.
void ZeroTail(float* data, int64_t valid, int64_t rows, int64_t width) {
  std::memset(data + valid * width, 0, (rows - valid) * width * sizeof(float));
}

// Useful FLOPs of a valid call (no padding; causal attention counts its visible half).
double CallFlops(const LayerSpec& spec, const ForwardArgs& args) {
  const RaggedBatch& kv = args.context ? *args.context : args.input;
  const double inner = static_cast<double>(spec.inner());
  double pairs = 0;
  for (int64_t b = 0; b < args.input.batch(); ++b) {
    pairs += static_cast<double>(args.input.lengths[b]) * static_cast<double>(kv.lengths[b]);
  }
  const double q = static_cast<double>(args.input.total_length());
  const double k = static_cast<double>(kv.total_length());
  const double d = static_cast<double>(spec.d_model);
  return 2 * q * d * inner + 4 * k * static_cast<double>(spec.d_context) * inner +
         (IsCausal(args.kind) ? 2 : 4) * pairs * inner +
         (spec.has_output_projection ? 2 * q * inner * d : 0);
}

// Runs the calling thread's OpenMP regions with `threads` threads for a scope (0: unchanged).
class ScopedOmpThreads {
 public:
  explicit ScopedOmpThreads(int threads) : saved_(omp_get_max_threads()), set_(threads > 0) {
    if (set_) omp_set_num_threads(threads);
  }
  ~ScopedOmpThreads() {
    if (set_) omp_set_num_threads(saved_);
  }
  ScopedOmpThreads(const ScopedOmpThreads&) = delete;
  ScopedOmpThreads& operator=(const ScopedOmpThreads&) = delete;

 private:
  int saved_;
  bool set_;
};

// Useful FLOPs of a decode run: each new token's projections and its attention over the keys it
// sees (its sequence's up to its own position, or the context's).
double DecodeFlops(const LayerSpec& spec, AttentionKind kind,
                   std::span<const DecodeSequence> sequences) {
  const double inner = static_cast<double>(spec.inner());
  const double d = static_cast<double>(spec.d_model);
  const double per_token = 2 * d * inner * (kind == AttentionKind::kCausal ? 3 : 1) +
                           (spec.has_output_projection ? 2 * inner * d : 0);
  double flops = 0;
  for (const DecodeSequence& seq : sequences) {
    for (int64_t t = 0; t < seq.tokens; ++t) {
      const int64_t keys = kind == AttentionKind::kCausal || seq.context == nullptr
                               ? seq.position + t + 1
                               : std::min(seq.position + t + 1, seq.context->length());
      flops += per_token + 4 * inner * static_cast<double>(keys);
    }
  }
  return flops;
}

}  // namespace

int64_t ForwardShapes::attention_size() const {
  return attention_dims[0] * attention_dims[1] * attention_dims[2] * attention_dims[3];
}

// The weights in the form the matmuls read.
// - f32: transposed once here, W^T row-major [k, n], which oneDNN's brgemm reads in place; read
//   transposed from nn.Linear's [n, k], it copied the whole matrix on every call (at 16 rows the
//   demo layer's Q|K|V projection took 39 us instead of 28, its output projection 13 instead of
//   9; at 512 rows the two are within 3 %). With d_context == d_model, W_q, W_k and W_v sit side
//   by side in one [d_model, 3*inner] matrix: the fused Q|K|V of the self kinds, and its first
//   inner columns and the rest the Q and K|V of the cross kinds. Otherwise W_q^T [d_model, inner]
//   is followed by W_k|W_v^T [d_context, 2*inner].
// - bf16: nn.Linear's [n, k], W_q, W_k and W_v stacked row-wise (the same split: the first inner
//   rows are Q); oneDNN's bf16 brgemm reads that as fast as W^T, and faster than W^T's column
//   blocks.
// - f32 again, in SmallMatmul's panels, when a call or step can run serially: every call takes at
//   least one row through every matrix, so one row's pass over all the weights must cost less
//   than kSerialFlops (else null). The fused Q|K|V (unfused: W_q^T), W_k|W_v^T unfused, W_o^T.
//   Up to about 2200 wide, f32 weights are thus held twice.
struct Layer::Impl {
  LayerSpec spec;
  Precision precision = Precision::kF32;
  // bf16 operands in the matmuls: precision bf16 where oneDNN multiplies bf16 on this CPU. Else a
  // bf16 layer's weights are rounded to bf16 and kept, and multiplied, as f32.
  bool bf16_matmul = false;
  std::vector<float> w_qkv, w_o;         // f32 weights (W^T; empty with bf16 matmuls)
  std::vector<float> b_qkv, b_o;         // biases, f32 for both precisions
  std::vector<uint16_t> w_qkv16, w_o16;  // bf16 weights (with bf16 matmuls)
  std::unique_ptr<const SmallMatmulWeights> small_in, small_kv, small_o;

  bool bf16() const { return bf16_matmul; }
  bool fused() const { return spec.serves_self_attention(); }
  // An f32 projection: W^T at `w`, rows `ld` apart, and its columns in SmallMatmul's `small`.
  static Projection F32(const float* w, const float* b, int64_t k, int64_t n, int64_t ld,
                        const SmallMatmulWeights* small, int64_t small_first = 0) {
    return {w, b, k, n, false, ld, small, small_first};
  }
  const float* bias(const std::vector<float>& b, int64_t offset) const {
    return spec.has_bias ? b.data() + offset : nullptr;
  }
  Projection QKV() const {
    const int64_t n = 3 * spec.inner();
    if (bf16()) return {w_qkv16.data(), bias(b_qkv, 0), spec.d_model, n, true};
    return F32(w_qkv.data(), bias(b_qkv, 0), spec.d_model, n, n, small_in.get());
  }
  Projection Q() const {
    const int64_t n = spec.inner();
    if (bf16()) return {w_qkv16.data(), bias(b_qkv, 0), spec.d_model, n, true};
    return F32(w_qkv.data(), bias(b_qkv, 0), spec.d_model, n, fused() ? 3 * n : n, small_in.get());
  }
  Projection KV() const {
    const int64_t inner = spec.inner();
    const float* b = bias(b_qkv, inner);
    if (bf16()) {
      return {w_qkv16.data() + inner * spec.d_model, b, spec.d_context, 2 * inner, true};
    }
    if (fused()) {
      return F32(w_qkv.data() + inner, b, spec.d_context, 2 * inner, 3 * inner, small_in.get(),
                 inner);
    }
    return F32(w_qkv.data() + spec.d_model * inner, b, spec.d_context, 2 * inner, 2 * inner,
               small_kv.get());
  }
  Projection Out() const {
    if (bf16()) return {w_o16.data(), bias(b_o, 0), spec.inner(), spec.d_model, true};
    return F32(w_o.data(), bias(b_o, 0), spec.inner(), spec.d_model, spec.d_model, small_o.get());
  }

  absl::Status Run(const ForwardArgs& args, std::span<float> output,
                   std::span<float> attention) const;
  absl::Status Decode(AttentionKind kind, std::span<const DecodeSequence> sequences) const;
  // The new tokens of a decode step, packed back to back into `rows` rows (bf16 when asked).
  const void* PackSteps(std::span<const DecodeSequence> sequences, int64_t rows,
                        ScratchBuffer& buffer) const;
  absl::Status RunProjectedAttention(const ForwardArgs& args, std::span<float> output,
                                     std::span<float> attention) const;
  // Q, K, V of the self kinds: one matmul over the packed input; fills problem's q, k, v.
  absl::Status ProjectSelf(const PackedCall& call, ThreadScratch& scratch,
                           AttentionProblem& problem) const;
  // Q from the input, K|V from the context.
  absl::Status ProjectCross(const PackedCall& call, ThreadScratch& scratch,
                            AttentionProblem& problem) const;
  // y = attended W_o^T + b_o over the packed rows; y is the caller's buffer or (null) scratch.
  absl::Status ProjectOutput(const PackedCall& call, float* attended, ThreadScratch& scratch,
                             float*& y) const;
};

namespace {

// Row-wise concatenation of the given matrices.
std::vector<float> Stack(std::initializer_list<const std::vector<float>*> parts) {
  std::vector<float> out;
  for (const std::vector<float>* p : parts) out.insert(out.end(), p->begin(), p->end());
  return out;
}

// Writes W^T of a row-major [rows, columns] matrix into `out`, row-major [columns, rows] with its
// rows `ld` apart (a column block of a wider matrix when ld > rows). In square tiles, so a large
// layer's matrices (a 4096-wide one is 200 MB) are not read or written a stride apart.
void TransposeInto(const std::vector<float>& w, int64_t rows, int64_t columns, float* out,
                   int64_t ld) {
  constexpr int64_t kTile = 64;
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    for (int64_t c0 = 0; c0 < columns; c0 += kTile) {
      const int64_t r_end = std::min(rows, r0 + kTile), c_end = std::min(columns, c0 + kTile);
      for (int64_t r = r0; r < r_end; ++r) {
        for (int64_t c = c0; c < c_end; ++c) out[c * ld + r] = w[r * columns + c];
      }
    }
  }
}

// Where Create writes a projection's W^T: the f32 buffers the Impl owns, at the place and with
// the row stride its Projection reads them from, so the layout is decided in one place.
float* Destination(const Projection& p) {
  return const_cast<float*>(static_cast<const float*>(p.weights));
}

// Each value rounded to the nearest bf16 (as ConvertToBf16), kept as f32.
void RoundToBf16Values(std::vector<float>& values) {
  constexpr int64_t kChunk = 4096;
  uint16_t rounded[kChunk];
  for (size_t i = 0; i < values.size(); i += kChunk) {
    const int64_t n = std::min<int64_t>(kChunk, static_cast<int64_t>(values.size() - i));
    ConvertToBf16(values.data() + i, rounded, n);
    for (int64_t j = 0; j < n; ++j) values[i + j] = BFloat16ToFloat(rounded[j]);
  }
}

std::vector<uint16_t> ToBf16(const std::vector<float>& values) {
  std::vector<uint16_t> out(values.size());
  ConvertToBf16(values.data(), out.data(), static_cast<int64_t>(values.size()));
  return out;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Layer>> Layer::Create(LayerWeights weights,
                                                           Precision precision) {
  if (absl::Status s = CheckWeights(weights); !s.ok()) return s;
  using Made = absl::StatusOr<std::shared_ptr<const Layer>>;
  return Guarded("preparing the layer", absl::StatusCode::kInternal, [&]() -> Made {
    auto impl = std::make_unique<Impl>();
    impl->spec = weights.spec;
    impl->precision = precision;
    const LayerSpec& spec = weights.spec;
    const int64_t inner = spec.inner();
    impl->b_qkv = Stack({&weights.b_q, &weights.b_k, &weights.b_v});
    impl->b_o = std::move(weights.b_o);
    impl->bf16_matmul = precision == Precision::kBF16 && Bf16MatmulSupported();
    if (precision == Precision::kBF16 && !impl->bf16_matmul) {
      // The same weights as a bf16 matmul would read, multiplied in f32 (activations unrounded).
      for (std::vector<float>* w : {&weights.w_q, &weights.w_k, &weights.w_v, &weights.w_o}) {
        RoundToBf16Values(*w);
      }
    }
    if (impl->bf16_matmul) {
      // Rounded once here; activations are rounded per call, accumulation stays f32.
      impl->w_qkv16 = ToBf16(Stack({&weights.w_q, &weights.w_k, &weights.w_v}));
      impl->w_o16 = ToBf16(weights.w_o);
    } else {
      // Each matrix transposed straight into its place (Q(), KV(), Out() say where): no stacked
      // copy on the way, so a large layer's weights exist at most twice while loading.
      impl->w_qkv.resize(weights.w_q.size() + weights.w_k.size() + weights.w_v.size());
      const Projection q = impl->Q(), kv = impl->KV();
      TransposeInto(weights.w_q, inner, spec.d_model, Destination(q), q.w_ld);
      TransposeInto(weights.w_k, inner, spec.d_context, Destination(kv), kv.w_ld);
      TransposeInto(weights.w_v, inner, spec.d_context, Destination(kv) + inner, kv.w_ld);
      impl->w_o.resize(weights.w_o.size());  // empty without W_o
      const Projection out = impl->Out();
      if (!impl->w_o.empty())
        TransposeInto(weights.w_o, spec.d_model, inner, Destination(out), out.w_ld);
      if (2.0 * static_cast<double>(impl->w_qkv.size() + impl->w_o.size()) < kSerialFlops) {
        auto small = [](const Projection& p) {
          return std::make_unique<const SmallMatmulWeights>(
              p.k, p.n, static_cast<const float*>(p.weights), p.w_ld);
        };
        impl->small_in = small(impl->fused() ? impl->QKV() : impl->Q());
        if (!impl->fused()) impl->small_kv = small(impl->KV());
        if (!impl->w_o.empty()) impl->small_o = small(out);
      }
    }
    CpuEngine();  // fail here, not in the first call, if oneDNN cannot make an engine
    return std::shared_ptr<const Layer>(new Layer(std::move(impl)));
  });
}

Layer::Layer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Layer::~Layer() = default;

const LayerSpec& Layer::spec() const { return impl_->spec; }
Precision Layer::precision() const { return impl_->precision; }

ForwardShapes Layer::Shapes(const ForwardArgs& args) const {
  const LayerSpec& spec = impl_->spec;
  ForwardShapes shapes;
  shapes.output_rows = args.input.rows();
  shapes.output_width = spec.d_output();
  if (args.return_attention) {
    const RaggedBatch& kv = IsCross(args.kind) && args.context ? *args.context : args.input;
    shapes.attention_dims[0] = args.input.batch();
    shapes.attention_dims[1] = spec.num_heads;
    shapes.attention_dims[2] = args.input.view_length();
    shapes.attention_dims[3] = kv.view_length();
  }
  return shapes;
}

absl::Status Layer::Forward(const ForwardArgs& args, std::span<float> output,
                            std::span<float> attention) const {
  if (absl::Status s = Validate(args); !s.ok()) return s;
  const ForwardShapes shapes = Shapes(args);
  if (static_cast<int64_t>(output.size()) != shapes.output_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "output buffer has ", output.size(), " floats, the call needs ", shapes.output_size()));
  }
  if (static_cast<int64_t>(attention.size()) != shapes.attention_size()) {
    return absl::InvalidArgumentError(absl::StrCat("attention buffer has ", attention.size(),
                                                   " floats, the call needs ",
                                                   shapes.attention_size()));
  }
  return ForwardValidated(args, output, attention);
}

double Layer::Flops(const ForwardArgs& args) const { return CallFlops(impl_->spec, args); }

absl::Status Layer::ForwardValidated(const ForwardArgs& args, std::span<float> output,
                                     std::span<float> attention) const {
  // Tiny calls: one thread (the team's start-up and barriers would cost more than they save).
  ScopedOmpThreads threads(CallFlops(impl_->spec, args) < kSerialFlops ? 1 : 0);
  return Guarded("layer forward", absl::StatusCode::kInternal,
                 [&] { return impl_->Run(args, output, attention); });
}

absl::Status Layer::Impl::Run(const ForwardArgs& args, std::span<float> output,
                              std::span<float> attention) const {
  if (args.input.total_length() == 0) {
    // Nothing valid to compute: every output row is padding, every probability masked.
    std::fill(output.begin(), output.end(), 0.0f);
    std::fill(attention.begin(), attention.end(), 0.0f);
    return absl::OkStatus();
  }
  return RunProjectedAttention(args, output, attention);
}

absl::Status Layer::Impl::RunProjectedAttention(const ForwardArgs& args, std::span<float> output,
                                                std::span<float> attention) const {
  PackedCall call;
  call.input = &args.input;
  call.kv = IsCross(args.kind) ? &*args.context : &args.input;
  call.q_offsets = PackedOffsets(args.input.lengths);
  call.kv_offsets = IsCross(args.kind) ? PackedOffsets(call.kv->lengths) : call.q_offsets;
  call.tokens = args.input.total_length();
  call.rows = MatmulRows(call.tokens);
  ThreadScratch& scratch = GetThreadScratch();

  // 1. Projections of the valid tokens only.
  AttentionProblem problem;
  absl::Status s = IsCross(args.kind) ? ProjectCross(call, scratch, problem)
                                      : ProjectSelf(call, scratch, problem);
  if (!s.ok()) return s;

  // 2. Attention into packed rows; straight into the caller's buffer when nothing follows.
  const int64_t inner = spec.inner();
  const bool direct_out = call.input->packed() && call.rows == call.tokens;
  float* attended = !spec.has_output_projection && direct_out
                        ? output.data()
                        : scratch.attention.As<float>(call.rows * inner);
  problem.out = attended;
  problem.out_stride = inner;
  problem.q_lengths = call.input->lengths;
  problem.q_offsets = call.q_offsets;
  problem.kv_lengths = call.kv->lengths;
  problem.kv_offsets = call.kv_offsets;
  problem.num_heads = spec.num_heads;
  problem.head_dim = spec.head_dim;
  problem.causal = IsCausal(args.kind);
  problem.scale = 1.0f / std::sqrt(static_cast<float>(spec.head_dim));
  problem.bf16 = bf16();
  if (!attention.empty()) {
    problem.probs = attention.data();
    problem.probs_q_len = call.input->view_length();
    problem.probs_kv_len = call.kv->view_length();
  }
  RunAttention(problem);
  if (!spec.has_output_projection) {
    ScatterRows(*call.input, call.q_offsets, attended, inner, output);
    return absl::OkStatus();
  }

  // 3. Output projection (bias in the primitive), then back to the caller's layout.
  float* y = direct_out ? output.data() : nullptr;
  s = ProjectOutput(call, attended, scratch, y);
  if (!s.ok()) return s;
  ScatterRows(*call.input, call.q_offsets, y, spec.d_model, output);
  return absl::OkStatus();
}

absl::Status Layer::Impl::ProjectSelf(const PackedCall& call, ThreadScratch& scratch,
                                      AttentionProblem& problem) const {
  const int64_t inner = spec.inner();
  const void* x = PackRows(*call.input, call.q_offsets, call.rows, bf16(), scratch.input);
  float* qkv = scratch.qkv.As<float>(call.rows * 3 * inner);
  if (absl::Status s = Project(QKV(), call.rows, x, qkv, scratch); !s.ok()) return s;
  problem.q = qkv;
  problem.k = qkv + inner;
  problem.v = qkv + 2 * inner;
  problem.q_stride = problem.k_stride = problem.v_stride = 3 * inner;
  return absl::OkStatus();
}

absl::Status Layer::Impl::ProjectCross(const PackedCall& call, ThreadScratch& scratch,
                                       AttentionProblem& problem) const {
  const int64_t inner = spec.inner();
  const void* x = PackRows(*call.input, call.q_offsets, call.rows, bf16(), scratch.input);
  float* q = scratch.qkv.As<float>(call.rows * inner);
  if (absl::Status s = Project(Q(), call.rows, x, q, scratch); !s.ok()) return s;
  const int64_t kv_tokens = call.kv->total_length();
  const int64_t kv_rows = MatmulRows(kv_tokens);
  // At least one row, so that K and V point somewhere even for an empty context.
  float* kv = scratch.kv.As<float>(std::max<int64_t>(kv_rows, 1) * 2 * inner);
  if (kv_tokens > 0) {
    const void* c = PackRows(*call.kv, call.kv_offsets, kv_rows, bf16(), scratch.context);
    if (absl::Status s = Project(KV(), kv_rows, c, kv, scratch); !s.ok()) return s;
  }
  problem.q = q;
  problem.q_stride = inner;
  problem.k = kv;
  problem.v = kv + inner;
  problem.k_stride = problem.v_stride = 2 * inner;
  return absl::OkStatus();
}

absl::Status Layer::Impl::ProjectOutput(const PackedCall& call, float* attended,
                                        ThreadScratch& scratch, float*& y) const {
  const int64_t inner = spec.inner();
  ZeroTail(attended, call.tokens, call.rows, inner);
  const void* a = attended;
  if (bf16()) {
    uint16_t* a16 = scratch.attention16.As<uint16_t>(call.rows * inner);
    const int64_t rows = call.rows;
    ParallelFor(rows * inner > kParallelFloats, rows,
                [&](int64_t r) { ConvertToBf16(attended + r * inner, a16 + r * inner, inner); });
    a = a16;
  }
  // The packed input is no longer needed: its buffer holds the projected rows.
  if (y == nullptr) y = scratch.input.As<float>(call.rows * spec.d_model);
  return Project(Out(), call.rows, a, y, scratch);
}

absl::Status Layer::ProjectContext(std::span<const ContextRows> parts) const {
  const Impl& impl = *impl_;
  const int64_t inner = impl.spec.inner(), width = impl.spec.d_context;
  int64_t tokens = 0;
  for (const ContextRows& part : parts) tokens += part.tokens;
  if (tokens == 0) return absl::OkStatus();
  // A part of a few rows, as generation reaches them, is far below kSerialFlops.
  ScopedOmpThreads threads(4.0 * static_cast<double>(tokens) * static_cast<double>(width) *
                                       static_cast<double>(inner) <
                                   kSerialFlops
                               ? 1
                               : 0);
  return Guarded("context projection", absl::StatusCode::kInternal, [&]() -> absl::Status {
    const int64_t rows = MatmulRows(tokens);
    ThreadScratch& scratch = GetThreadScratch();
    const size_t element = impl.bf16() ? 2 : 4;
    auto* c = static_cast<unsigned char*>(scratch.context.Get(rows * width * element));
    int64_t row = 0;
    for (const ContextRows& part : parts) {
      for (int64_t t = 0; t < part.tokens; ++t, ++row) {
        if (impl.bf16()) {
          ConvertToBf16(part.rows + t * width, reinterpret_cast<uint16_t*>(c) + row * width, width);
        } else {
          std::memcpy(c + row * width * 4, part.rows + t * width, width * 4);
        }
      }
    }
    std::memset(c + tokens * width * element, 0, (rows - tokens) * width * element);
    float* projected = scratch.kv.As<float>(rows * 2 * inner);
    if (absl::Status s = Project(impl.KV(), rows, c, projected, scratch); !s.ok()) return s;
    row = 0;
    for (const ContextRows& part : parts) {
      const int64_t from = part.kv->length();
      for (int64_t t = 0; t < part.tokens; ++t, ++row) {
        part.kv->Write(from + t, projected + row * 2 * inner, projected + row * 2 * inner + inner);
      }
    }
    return absl::OkStatus();
  });
}

absl::Status Layer::Decode(AttentionKind kind, std::span<const DecodeSequence> sequences) const {
  // A generation step of a few sessions is far below kSerialFlops: waking the team for its
  // matmuls cost more CPU than the step itself.
  ScopedOmpThreads threads(DecodeFlops(impl_->spec, kind, sequences) < kSerialFlops ? 1 : 0);
  return Guarded("decode step", absl::StatusCode::kInternal,
                 [&] { return impl_->Decode(kind, sequences); });
}

const void* Layer::Impl::PackSteps(std::span<const DecodeSequence> sequences, int64_t rows,
                                   ScratchBuffer& buffer) const {
  const int64_t width = spec.d_model;
  const size_t element = bf16() ? 2 : 4;
  auto* x = static_cast<unsigned char*>(buffer.Get(rows * width * element));
  int64_t row = 0;
  for (const DecodeSequence& seq : sequences) {
    for (int64_t t = 0; t < seq.tokens; ++t, ++row) {
      const float* src = seq.input + t * width;
      if (bf16()) {
        ConvertToBf16(src, reinterpret_cast<uint16_t*>(x) + row * width, width);
      } else {
        std::memcpy(x + row * width * 4, src, width * 4);
      }
    }
  }
  std::memset(x + row * width * element, 0, (rows - row) * width * element);
  return x;
}

absl::Status Layer::Impl::Decode(AttentionKind kind,
                                 std::span<const DecodeSequence> sequences) const {
  int64_t tokens = 0;
  for (const DecodeSequence& seq : sequences) tokens += seq.tokens;
  if (tokens == 0) return absl::OkStatus();
  if (!spec.ServesSessions(kind)) {
    return absl::UnimplementedError(
        absl::StrCat("decode sessions serve causal kinds with heads of at most ", kMaxDecodeHeadDim,
                     " dimensions"));
  }
  const bool causal_self = kind == AttentionKind::kCausal;
  // A context projected short of what a query sees would give wrong rows without a word.
  for (size_t i = 0; i < sequences.size() && !causal_self; ++i) {
    const DecodeSequence& seq = sequences[i];
    const int64_t projected = seq.context->length();
    const int64_t seen = std::min(seq.position + seq.tokens, seq.context_length);
    if (projected < seen || projected > seq.context_length) {
      return absl::InternalError(absl::StrCat("decode step: sequence ", i, "'s context has ",
                                              projected, " of its ", seq.context_length,
                                              " rows projected; its queries see ", seen));
    }
  }
  const int64_t inner = spec.inner(), rows = MatmulRows(tokens);
  ThreadScratch& scratch = GetThreadScratch();

  // 1. Q (and K, V of the self kind) of every new token, one matmul.
  const void* x = PackSteps(sequences, rows, scratch.input);
  const int64_t q_stride = causal_self ? 3 * inner : inner;
  float* q = scratch.qkv.As<float>(rows * q_stride);
  absl::Status s = Project(causal_self ? QKV() : Q(), rows, x, q, scratch);
  if (!s.ok()) return s;

  // 2. The new keys and values join their caches; each new token's query sees its keys.
  float* attended = scratch.attention.As<float>(rows * inner);
  ZeroTail(attended, tokens, rows, inner);
  std::vector<KvQuery> queries;
  queries.reserve(tokens);
  int64_t row = 0;
  for (const DecodeSequence& seq : sequences) {
    for (int64_t t = 0; t < seq.tokens; ++t, ++row) {
      const float* projected = q + row * q_stride;
      const int64_t position = seq.position + t;
      KvQuery query{projected, attended + row * inner, nullptr, 0};
      if (causal_self) {
        seq.cache->Write(position, projected + inner, projected + 2 * inner);
        query.kv = seq.cache;
        query.visible = position + 1;
      } else {
        query.kv = seq.context;
        query.visible = std::min(position + 1, seq.context_length);
      }
      queries.push_back(query);
    }
  }
  KvAttention(queries, spec.num_heads, spec.head_dim,
              1.0f / std::sqrt(static_cast<float>(spec.head_dim)));

  // 3. The output projection, one matmul, then each sequence's rows to its output.
  const float* y = attended;
  if (spec.has_output_projection) {
    const void* a = attended;
    if (bf16()) {
      uint16_t* a16 = scratch.attention16.As<uint16_t>(rows * inner);
      for (int64_t r = 0; r < rows; ++r)
        ConvertToBf16(attended + r * inner, a16 + r * inner, inner);
      a = a16;
    }
    float* out = scratch.input.As<float>(rows * spec.d_model);  // the packed input is done with
    if (absl::Status p = Project(Out(), rows, a, out, scratch); !p.ok()) return p;
    y = out;
  }
  const int64_t width = spec.d_output();
  row = 0;
  for (const DecodeSequence& seq : sequences) {
    std::memcpy(seq.output, y + row * width, seq.tokens * width * sizeof(float));
    row += seq.tokens;
  }
  return absl::OkStatus();
}

}  // namespace attnserve::core
