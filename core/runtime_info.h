#pragma once

#include <string>

namespace attnserve::core {

// What the compute runs on, for start-up logs; keeps oneDNN and OpenMP out of callers' includes.
struct RuntimeInfo {
  std::string dnnl_version;  // e.g. "2.6.3 (commit ...)"
  std::string cpu_isa;       // the ISA oneDNN dispatches to on this machine, e.g. "avx2"
  int compute_threads = 0;   // OpenMP threads a Forward call on the calling thread uses
  // oneDNN multiplies bf16 here (AVX-512): else a bf16 model's projections run in f32, on its
  // weights rounded to bf16.
  bool bf16_matmul = false;
};

// Describes the oneDNN build and CPU the process computes on.
RuntimeInfo GetRuntimeInfo();

// Sets the OpenMP threads used by compute started from the calling thread. OpenMP keeps this per
// thread, so each thread that runs Layer::Forward calls it once; threads <= 0 keeps the default.
void SetComputeThreads(int threads);

}  // namespace attnserve::core
