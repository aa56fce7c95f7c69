"""Compile the native CPU kernels (cpu_ops.cpp, quant_ops.cpp, sample_ops.cpp, kv_int8_ops.cpp, float_gemm.cpp,
bf16_gemm.cpp, extend_attention.cpp, decode_layers.cpp) with the system C++ compiler on first use and load it with ctypes.

A plain shared library (no torch headers, no Python C API) compiles in about a second,
so no build step is needed at install time and a machine without a compiler still runs
(torch ops take over, with one warning). The library is built for the CPU it runs on
(-march=native) and cached under ~/.cache/radixlm/kernels keyed by a hash of the source,
the flags and the CPU's flags, so a different machine or a changed source rebuilds.
Concurrent first uses (several test processes) each build to a private file and rename
it into place atomically.

RADIXLM_CPU_KERNELS=0 turns the library off (torch ops everywhere).

The kernels choose their instruction set at compile time (AVX-512 paths where the CPU has
them, AVX2 + FMA paths otherwise), and the cache key includes the CPU's flags, so the
library loaded is always the one for the processor it runs on. `load_variant("avx2")`
builds the AVX2 flavour on an AVX-512 machine too, so that the tests check both paths there.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import radixlm.envs as envs
from radixlm.kernels.cpu.cpuinfo import cpu_flags

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = [_HERE / "cpu_ops.cpp", _HERE / "quant_ops.cpp", _HERE / "sample_ops.cpp", _HERE / "kv_int8_ops.cpp",
           _HERE / "float_gemm.cpp", _HERE / "bf16_gemm.cpp", _HERE / "extend_attention.cpp", _HERE / "decode_layers.cpp",
           _HERE / "table_ops.cpp"]
HEADERS = [_HERE / "amx.h", _HERE / "avx2.h", _HERE / "bf16.h", _HERE / "bf16_gemm_amx.h", _HERE / "decode_tasks.h", _HERE / "gemm_tasks.h",
           _HERE / "rowwise_avx512.h", _HERE / "row_best.h", _HERE / "row_spans.h"]
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17"]
# Linked in a separate step without -ffast-math: linked with it, gcc adds crtfastmath.o, whose
# constructor turns on flush-to-zero / denormals-are-zero for the whole process that loads the
# library (every later float operation of the caller's own code would change).
LINK_FLAGS = ["-shared", "-fopenmp"]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False

_I64 = ctypes.c_int64
_INT = ctypes.c_int
_PTR = ctypes.c_void_p
_SIGNATURES = {
    "radixlm_decode_attention": [_INT, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR,
                                 _INT, _INT, _INT, _INT, ctypes.c_float, _INT],
    "radixlm_rope_inplace": [_INT, _PTR, _I64, _I64, _INT, _INT, _PTR, _PTR, _PTR, _INT],
    "radixlm_add_rmsnorm": [_INT, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _INT, ctypes.c_float, _INT],
    "radixlm_silu_mul": [_INT, _PTR, _PTR, _I64, _INT, _INT],
    "radixlm_store_kv": [_INT, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64],
    "radixlm_argmax_rows": [_PTR, _I64, _I64, _I64, _PTR, _INT],
    "radixlm_decode_rows": [_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _I64],
    "radixlm_common_prefix": [_PTR, _I64, _I64, _PTR, _I64, _I64],
    "radixlm_int8_group_size": [],
    "radixlm_quantize_groups": [_INT, _PTR, _I64, _I64, _INT, _INT, _PTR, _PTR, _INT],
    "radixlm_int8_linear_available": [],
    "radixlm_int8_linear": [_INT, _PTR, _I64, _I64, _INT, _PTR, _PTR, _PTR, _INT, _INT, _PTR, _PTR, _I64, _INT],
    "radixlm_int8_linear_silu": [_INT, _PTR, _I64, _I64, _INT, _PTR, _PTR, _PTR, _INT, _INT, _PTR, _PTR, _I64, _INT],
    "radixlm_int8_linear_argmax": [_INT, _PTR, _I64, _I64, _INT, _PTR, _PTR, _PTR, _INT, _PTR, _INT],
    "radixlm_int8_linear_norm": [_INT, _PTR, _I64, _PTR, _PTR, ctypes.c_float, _PTR, _I64, _INT, _PTR, _PTR, _PTR, _INT,
                                 _INT, _PTR, _PTR, _I64, _INT, _INT],
    "radixlm_store_kv_int8": [_INT, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _INT, _INT, _INT],
    "radixlm_decode_int8_supports": [_INT],
    "radixlm_gather_dequant_int8": [_INT, _PTR, _PTR, _PTR, _I64, _INT, _INT, _PTR, _INT],
    "radixlm_float_gemm_available": [],
    "radixlm_bf16_gemm_available": [],
    "radixlm_bf16_gemm_amx": [],
    "radixlm_bf16_linear": [_PTR, _I64, _I64, _INT, _PTR, _INT, _PTR, _INT, _PTR, _I64, _INT],
    "radixlm_bf16_linear_silu": [_PTR, _I64, _I64, _INT, _PTR, _INT, _PTR, _INT, _PTR, _I64, _INT],
    "radixlm_bf16_linear_argmax": [_PTR, _I64, _I64, _INT, _PTR, _INT, _PTR, _INT],
    "radixlm_float_linear": [_INT, _PTR, _I64, _I64, _INT, _INT, _PTR, _INT, _INT, _PTR, _PTR, _I64, _INT],
    "radixlm_extend_attention_available": [],
    "radixlm_extend_attention_bf16": [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _INT, _INT,
                                      _INT, _INT, ctypes.c_float, _I64, _INT],
    "radixlm_extend_attention_window_bf16": [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _INT,
                                             _INT, _INT, _INT, ctypes.c_float, _I64, _I64, _INT],
    "radixlm_decode_attention_int8": [_INT, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR,
                                      _INT, _INT, _INT, _INT, ctypes.c_float, _INT],
    "radixlm_decode_layers": [_PTR, _PTR, _I64, _PTR, _PTR, _PTR],
}


def cache_dir() -> Path:
    return Path(envs.cache_dir()) / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


# Extra flags of the narrower builds (load_variant): "avx2" drops every AVX-512 extension,
# "avx512" only AMX (an AMX CPU's bf16 GEMM on AVX512-BF16, as on CPUs without tiles).
VARIANT_FLAGS = {"avx2": ["-mno-avx512f"], "avx512": ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]}
_variants: dict[str, ctypes.CDLL | None] = {}


def _library_path(cxx: str, flags: list[str] = FLAGS) -> Path:
    h = hashlib.sha256()
    for f in (*SOURCES, *HEADERS):
        h.update(f.read_bytes())
    h.update(" ".join([cxx, *flags, "link:", *LINK_FLAGS, *sorted(cpu_flags())]).encode())
    return cache_dir() / f"cpu_ops-{h.hexdigest()[:16]}.so"


def _build(cxx: str, target: Path, flags: list[str] = FLAGS) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # The only wait of a first start the user cannot otherwise explain (tens of seconds)
    print(f"radixlm: compiling the native CPU kernels for this CPU (first use only; cached in {target.parent})",
          file=sys.stderr, flush=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    with tempfile.TemporaryDirectory(dir=target.parent) as objdir:
        try:
            objects = [os.path.join(objdir, f"{src.stem}.o") for src in SOURCES]
            for src, obj in zip(SOURCES, objects):
                _run(cxx, [*flags, "-c", str(src), "-o", obj])
            _run(cxx, [*LINK_FLAGS, *objects, "-o", tmp])
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def _run(cxx: str, args: list[str]) -> None:
    proc = subprocess.run([cxx, *args], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"{cxx} failed:\n{proc.stderr[-2000:]}")


def load() -> ctypes.CDLL | None:
    """The loaded library, or None when disabled or it cannot be built (logged once)."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            _lib = _load()
        except Exception as e:  # noqa: BLE001 - any build/load failure means "use torch ops"
            logger.warning("native CPU kernels unavailable, using torch ops: %s", e)
            _lib = None
        _tried = True
        return _lib


def variants() -> list[str]:
    """Builds worth testing on this machine: "native", plus "avx2" where the native build
    takes AVX-512 paths (on an AVX2-only CPU the native build is the AVX2 one)."""
    flags = cpu_flags()
    return ["native", "avx2"] if {"avx2", "fma", "avx512f"} <= flags else ["native"]


def load_variant(name: str) -> ctypes.CDLL | None:
    """The library built with VARIANT_FLAGS[name] added (cached like the native one); "native"
    is load(). None when it cannot be built."""
    if name == "native":
        return load()
    with _lock:
        if name not in _variants:
            try:
                _variants[name] = _load([*FLAGS, *VARIANT_FLAGS[name]])
            except Exception as e:  # noqa: BLE001 - same contract as load()
                logger.warning("native CPU kernels (%s build) unavailable: %s", name, e)
                _variants[name] = None
        return _variants[name]


def _load(flags: list[str] = FLAGS) -> ctypes.CDLL | None:
    if not envs.cpu_kernels_enabled():
        return None
    import torch  # noqa: F401 - torch's libgomp must be loaded first so the library shares it

    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (g++, c++ or clang++)")
    path = _library_path(cxx, flags)
    if not path.exists():
        _build(cxx, path, flags)
    lib = ctypes.CDLL(str(path))  # CDLL releases the GIL during each call
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = _INT
    return lib
