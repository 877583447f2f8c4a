#pragma once

// The process's oneDNN state: one CPU engine, a stream per thread, and the matmul primitives,
// created once per shape and shared by every layer. Internal to core (includes oneDNN).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve::core {

// The one oneDNN CPU engine of the process, made at first use (thread-safe).
const dnnl::engine& CpuEngine();

// A stream on CpuEngine() owned by the calling thread: streams are not shared between threads.
dnnl::stream& ThreadStream();

// A linear map y[m, n] = x[m, k] * W^T (+ b) for nn.Linear's W [n, k]. W is read in one of two
// layouts: as nn.Linear stores it, row-major [n, k], read transposed through its memory
// descriptor (w_ld == 0), or already transposed, W^T row-major [k, n] with its rows w_ld >= n
// apart (a column block of a wider matrix when w_ld > n). x and W share `bf16`; b and y are f32.
struct MatmulKey {
  int64_t m = 0;  // rows, or DNNL_RUNTIME_DIM_VAL for one primitive that takes any row count
  int64_t k = 0;
  int64_t n = 0;
  bool bf16 = false;
  bool bias = false;
  int threads = 0;   // OpenMP team it was made for: oneDNN fixes its work split at creation
  int64_t w_ld = 0;  // 0: W row-major [n, k]; else the row stride of W^T [k, n]
};

// A created matmul primitive and what it needs at execution.
struct CachedMatmul {
  MatmulKey key;
  dnnl::matmul primitive;
  dnnl::memory::desc scratchpad_md;  // the caller provides it (scratchpad_mode::user)
  size_t scratchpad_bytes = 0;
};

// The primitive for `key`, created at first use and cached for the life of the process.
// Thread-safe. oneDNN refusals come back as Internal.
absl::StatusOr<std::shared_ptr<const CachedMatmul>> GetMatmul(const MatmulKey& key);

// Pointers of one matmul execution; x has `rows` rows of k elements, y `rows` rows of n floats.
struct MatmulArgs {
  int64_t rows = 0;  // must equal key.m unless the key is runtime
  const void* x = nullptr;
  const void* weights = nullptr;
  const float* bias = nullptr;
  float* y = nullptr;
  void* scratchpad = nullptr;  // at least scratchpad_bytes
};

// Whether oneDNN multiplies bf16 on this CPU (oneDNN 2.6: AVX-512 at least); tried once.
bool Bf16MatmulSupported();

// Runs `matmul` on the calling thread's stream and waits. Throws dnnl::error (callers catch it
// at the core boundary).
void ExecuteMatmul(const CachedMatmul& matmul, const MatmulArgs& args);

// Rounds IEEE f32 to bf16 (nearest even), the conversion the bf16 path applies to activations.
// Serial: callers parallelise over rows.
void ConvertToBf16(const float* src, uint16_t* dst, int64_t count);

// A 64-byte aligned buffer that only grows, so steady-state calls allocate nothing.
class ScratchBuffer {
 public:
  // At least `bytes` bytes; the contents are unspecified after growth.
  void* Get(size_t bytes);
  // Get() for `count` elements of T.
  template <typename T>
  T* As(int64_t count) {
    return static_cast<T*>(Get(static_cast<size_t>(count) * sizeof(T)));
  }
  // Bytes held now.
  size_t capacity() const { return capacity_; }
  // Frees the memory (the next Get allocates again).
  void Release() {
    data_.reset();
    capacity_ = 0;
  }

 private:
  struct Free {
    void operator()(void* p) const;
  };
  std::unique_ptr<void, Free> data_;
  size_t capacity_ = 0;
};

// The buffers of one thread's Layer::Forward calls, kept between calls (thread_local, so
// concurrent calls on one Layer never share scratch).
struct ThreadScratch {
  ScratchBuffer input;      // the packed input tokens (bf16 when asked), then the projected output
  ScratchBuffer context;    // the same for a cross context
  ScratchBuffer qkv;        // Q|K|V rows for self kinds, Q rows for cross kinds
  ScratchBuffer kv;         // K|V rows of the context
  ScratchBuffer attention;  // the attention result, [tokens, inner]
  ScratchBuffer attention16;  // its bf16 copy for the output projection
  ScratchBuffer scratchpad;   // oneDNN's (scratchpad_mode::user)

  // Bytes held by all of them (reported by the benchmark).
  int64_t bytes() const;
  // Frees them all, e.g. so a benchmark can measure one shape's needs.
  void Release();
};

// The calling thread's scratch.
ThreadScratch& GetThreadScratch();

}  // namespace attnserve::core
