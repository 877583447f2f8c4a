"""Imported before torch by the PyTorch benchmarks: OpenBLAS 0.3.21 (Debian 12) does not know
CPUs newer than Cooper Lake and falls back to its generic SSE3 ("Prescott") kernels, 10x slower.
This names the closest core it knows in OPENBLAS_CORETYPE, which OpenBLAS reads when loaded."""
import os


def _closest_core():
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return None
    if "avx512_bf16" in flags:
        return "Cooperlake"
    if "avx512f" in flags:
        return "SkylakeX"
    return None


if _closest_core():
    os.environ.setdefault("OPENBLAS_CORETYPE", _closest_core())
