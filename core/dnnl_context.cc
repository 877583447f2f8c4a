#include "core/dnnl_context.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <tuple>
#include <unordered_map>

#include "absl/strings/str_cat.h"

namespace attnserve::core {
namespace {

using dt = dnnl::memory::data_type;
using Dims = dnnl::memory::dims;

// std::map key: the fields of MatmulKey in order.
using KeyTuple = std::tuple<int64_t, int64_t, int64_t, bool, bool, int, int64_t>;

KeyTuple AsTuple(const MatmulKey& key) {
  return {key.m, key.k, key.n, key.bf16, key.bias, key.threads, key.w_ld};
}

// W as the matmul's [k, n] operand, in the key's layout.
dnnl::memory::desc WeightsDesc(const MatmulKey& key) {
  const dt type = key.bf16 ? dt::bf16 : dt::f32;
  return key.w_ld == 0 ? dnnl::memory::desc(Dims{key.k, key.n}, type, Dims{1, key.k})
                       : dnnl::memory::desc(Dims{key.k, key.n}, type, Dims{key.w_ld, 1});
}

// Builds the primitive. Row strides are fixed (only M may be runtime): runtime strides make
// oneDNN 2.6 fall back to reference kernels.
CachedMatmul CreateMatmul(const MatmulKey& key) {
  const dt in_type = key.bf16 ? dt::bf16 : dt::f32;
  const dnnl::memory::desc x_md(Dims{key.m, key.k}, in_type, Dims{key.k, 1});
  const dnnl::memory::desc w_md = WeightsDesc(key);
  const dnnl::memory::desc b_md =
      key.bias ? dnnl::memory::desc(Dims{1, key.n}, dt::f32, Dims{key.n, 1}) : dnnl::memory::desc();
  const dnnl::memory::desc y_md(Dims{key.m, key.n}, dt::f32, Dims{key.n, 1});
  dnnl::primitive_attr attr;
  // Scratch comes from the caller's per-thread buffers, so one primitive can run on many
  // threads at once without sharing oneDNN's global scratchpad.
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(x_md, w_md, b_md, y_md), attr,
                                        CpuEngine());
  return CachedMatmul{key, dnnl::matmul(pd), pd.scratchpad_desc(), pd.scratchpad_desc().get_size()};
}

}  // namespace

const dnnl::engine& CpuEngine() {
  static const dnnl::engine* const engine = new dnnl::engine(dnnl::engine::kind::cpu, 0);
  return *engine;
}

dnnl::stream& ThreadStream() {
  thread_local dnnl::stream stream(CpuEngine());
  return stream;
}

absl::StatusOr<std::shared_ptr<const CachedMatmul>> GetMatmul(const MatmulKey& key) {
  static std::mutex mutex;
  static auto* cache = new std::map<KeyTuple, std::shared_ptr<const CachedMatmul>>();
  // Creation (JIT) happens under the lock: rare, and it keeps two threads from building the
  // same primitive twice.
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache->find(AsTuple(key));
  if (it != cache->end()) return it->second;
  try {
    auto made = std::make_shared<const CachedMatmul>(CreateMatmul(key));
    cache->emplace(AsTuple(key), made);
    return made;
  } catch (const dnnl::error& e) {
    return absl::InternalError(absl::StrCat("oneDNN matmul m=", key.m, " k=", key.k, " n=", key.n,
                                            key.bf16 ? " bf16" : " f32", ": ", e.what()));
  }
}

bool Bf16MatmulSupported() {
  static const bool supported =
      GetMatmul({.m = DNNL_RUNTIME_DIM_VAL, .k = 64, .n = 64, .bf16 = true}).ok();
  return supported;
}

void ExecuteMatmul(const CachedMatmul& matmul, const MatmulArgs& args) {
  const MatmulKey& key = matmul.key;
  const dt in_type = key.bf16 ? dt::bf16 : dt::f32;
  const dnnl::engine& engine = CpuEngine();
  // Memory objects only wrap the caller's pointers (no allocation of data).
  const dnnl::memory x(dnnl::memory::desc(Dims{args.rows, key.k}, in_type, Dims{key.k, 1}), engine,
                       const_cast<void*>(args.x));
  const dnnl::memory w(WeightsDesc(key), engine, const_cast<void*>(args.weights));
  const dnnl::memory y(dnnl::memory::desc(Dims{args.rows, key.n}, dt::f32, Dims{key.n, 1}), engine,
                       args.y);
  std::unordered_map<int, dnnl::memory> exec_args = {
      {DNNL_ARG_SRC, x}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_DST, y}};
  if (key.bias) {
    exec_args[DNNL_ARG_BIAS] =
        dnnl::memory(dnnl::memory::desc(Dims{1, key.n}, dt::f32, Dims{key.n, 1}), engine,
                     const_cast<float*>(args.bias));
  }
  if (matmul.scratchpad_bytes > 0) {
    exec_args[DNNL_ARG_SCRATCHPAD] = dnnl::memory(matmul.scratchpad_md, engine, args.scratchpad);
  }
  dnnl::stream& stream = ThreadStream();
  matmul.primitive.execute(stream, exec_args);
  stream.wait();
}

void ConvertToBf16(const float* src, uint16_t* dst, int64_t count) {
  // Round to nearest even on the bit pattern. A NaN (from scores that overflowed float32) stays
  // a quiet NaN: rounding could carry its payload into the sign or make it 0.
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &src[i], sizeof(bits));
    const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
    const uint32_t rounded = bits + 0x7fffu + ((bits >> 16) & 1u);
    dst[i] = static_cast<uint16_t>(nan ? (bits >> 16) | 0x40u : rounded >> 16);
  }
}

void* ScratchBuffer::Get(size_t bytes) {
  if (bytes > capacity_ || !data_) {
    // Round up so that slowly growing batches do not reallocate on every call.
    const size_t rounded = std::max<size_t>(64, (bytes + bytes / 4 + 4095) / 4096 * 4096);
    data_.reset();
    capacity_ = 0;
    void* p = std::aligned_alloc(64, rounded);
    if (p == nullptr) throw std::bad_alloc();
    data_.reset(p);
    capacity_ = rounded;
  }
  return data_.get();
}

void ScratchBuffer::Free::operator()(void* p) const { std::free(p); }

int64_t ThreadScratch::bytes() const {
  const ScratchBuffer* all[] = {&input, &context, &qkv, &kv, &attention, &attention16, &scratchpad};
  int64_t total = 0;
  for (const ScratchBuffer* b : all) total += static_cast<int64_t>(b->capacity());
  return total;
}

void ThreadScratch::Release() {
  for (ScratchBuffer* b : {&input, &context, &qkv, &kv, &attention, &attention16, &scratchpad}) {
    b->Release();
  }
}

ThreadScratch& GetThreadScratch() {
  thread_local ThreadScratch scratch;
  return scratch;
}

}  // namespace attnserve::core
