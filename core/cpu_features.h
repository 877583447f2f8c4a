#pragma once

// What the CPU runs, for the kernels compiled with per-function target attributes (no global
// flags): each kernel family is chosen at run time only where its instructions exist.

namespace attnserve::core {

// AVX-512 with bf16 dot products (vdpbf16ps), and the BW and VL subsets the bf16 kernels use
// beside them.
inline bool CpuHasAvx512Bf16() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

}  // namespace attnserve::core
