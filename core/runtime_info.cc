#include "core/runtime_info.h"

#include <omp.h>

#include <string>

#include "core/dnnl_context.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve::core {
namespace {

std::string IsaName(dnnl::cpu_isa isa) {
  switch (isa) {
    case dnnl::cpu_isa::sse41:
      return "sse41";
    case dnnl::cpu_isa::avx:
      return "avx";
    case dnnl::cpu_isa::avx2:
      return "avx2";
    case dnnl::cpu_isa::avx2_vnni:
      return "avx2_vnni";
    case dnnl::cpu_isa::avx512_mic:
      return "avx512_mic";
    case dnnl::cpu_isa::avx512_mic_4ops:
      return "avx512_mic_4ops";
    case dnnl::cpu_isa::avx512_core:
      return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_amx:
      return "avx512_core_amx";
    default:
      return "all";  // no ISA limit set: the best the CPU has
  }
}

}  // namespace

RuntimeInfo GetRuntimeInfo() {
  RuntimeInfo info;
  const dnnl_version_t* v = dnnl::version();
  info.dnnl_version = std::to_string(v->major) + "." + std::to_string(v->minor) + "." +
                      std::to_string(v->patch) + " (" + v->hash + ")";
  info.cpu_isa = IsaName(dnnl::get_effective_cpu_isa());
  info.compute_threads = omp_get_max_threads();
  info.bf16_matmul = Bf16MatmulSupported();
  return info;
}

void SetComputeThreads(int threads) {
  if (threads > 0) omp_set_num_threads(threads);
}

}  // namespace attnserve::core
