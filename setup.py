"""Builds megamoe_train and its extensions.

- megamoe_train._C: the buffer layout (pybind11, plain C++17), always.
- megamoe_train._cuda: the Hopper kernels of csrc/cuda (CUTLASS, nvcc for sm_90a), when nvcc and
  the CUTLASS headers (the `nvidia-cutlass` package, requirements-cuda.txt) are found. Without
  them the build skips it and the GPU executor keeps its Triton GEMMs. MEGAMOE_BUILD_CUDA=1
  makes a missing toolchain an error, =0 skips the CUDA build.
"""

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

CUDA_SOURCES = [
    "csrc/cuda/fp8_grouped_gemm.cu",
    "csrc/cuda/fp8_wgrad_grouped_gemm.cu",
    "csrc/cuda/bf16_grouped_gemm.cu",
    "csrc/cuda/bf16_wgrad_grouped_gemm.cu",
    "csrc/cuda/expert_gemm.cu",
]
CUDA_HEADERS = [
    "csrc/cuda/grouped_gemm.h",
    "csrc/cuda/grouped_gemm_impl.cuh",
    "csrc/cuda/expert_gemm.h",
    "csrc/cuda/expert_gemm_sm90.cuh",
]
# wgmma and setmaxnreg exist only on the arch-specific Hopper target.
NVCC_FLAGS = [
    "-std=c++17",
    "-O3",
    "-DNDEBUG",
    "-Xcompiler",
    "-fPIC",
    "--expt-relaxed-constexpr",
    "-gencode=arch=compute_90a,code=sm_90a",
    "-lineinfo",  # source lines for Nsight Compute's per-line stalls; the code is the same without
]


def _local_headers(path, seen=None):
    """The csrc/cuda headers `path` includes, directly or through each other (what its object
    depends on: an edited header rebuilds only the sources that include it)."""
    seen = set() if seen is None else seen
    folder = os.path.dirname(path)
    with open(path) as f:
        for line in f:
            if line.startswith('#include "'):
                header = os.path.join(folder, line.split('"')[1])
                if header not in seen and os.path.exists(header):
                    seen.add(header)
                    _local_headers(header, seen)
    return sorted(seen)


def _cuda_lib_dir(home):
    """The toolkit's folder holding the static CUDA runtime, or None."""
    return next(
        (
            os.path.join(home, d)
            for d in ("lib64", "lib")
            if os.path.exists(os.path.join(home, d, "libcudart_static.a"))
        ),
        None,
    )


def _find_cuda_home():
    """CUDA_HOME / CUDA_PATH if set; else the toolkit of the nvcc on PATH, found through its real path
    (a wrapper script, e.g. /usr/local/bin/nvcc exec'ing the toolkit's, resolves to /usr/local, which
    has no static runtime: then /usr/local/cuda)."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        candidates = [home]
    else:
        nvcc = shutil.which("nvcc")
        candidates = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "/usr/local/cuda"] if nvcc else []
    found = [h for h in candidates if os.path.exists(os.path.join(h, "bin", "nvcc"))]
    return next((h for h in found if _cuda_lib_dir(h)), found[0] if found else None)


def _find_cutlass_include():
    try:
        import cutlass_library
    except ImportError:
        return None
    include = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
    return include if os.path.exists(os.path.join(include, "cutlass", "cutlass.h")) else None


def _cuda_extension():
    mode = os.environ.get("MEGAMOE_BUILD_CUDA", "auto")
    if mode == "0":
        return None
    cuda_home, cutlass_include = _find_cuda_home(), _find_cutlass_include()
    missing = [
        name
        for name, found in (
            ("nvcc (CUDA_HOME)", cuda_home),
            ("CUTLASS headers (pip install nvidia-cutlass)", cutlass_include),
        )
        if not found
    ]
    if missing:
        if mode == "1":
            sys.exit(f"MEGAMOE_BUILD_CUDA=1 but not found: {', '.join(missing)}")
        print(f"megamoe_train._cuda skipped (not found: {', '.join(missing)})", file=sys.stderr)
        return None
    lib_dir = _cuda_lib_dir(cuda_home)
    if lib_dir is None:  # e.g. a pip/conda nvcc without the static runtime: like a missing toolchain
        if mode == "1":
            sys.exit(f"MEGAMOE_BUILD_CUDA=1 but libcudart_static.a not found under {cuda_home}")
        print(f"megamoe_train._cuda skipped (libcudart_static.a not found under {cuda_home})", file=sys.stderr)
        return None
    ext = Pybind11Extension(
        "megamoe_train._cuda",
        sources=["csrc/cuda/bindings.cpp"],
        depends=CUDA_SOURCES + CUDA_HEADERS,  # so an edited kernel relinks the module
        include_dirs=["csrc/cuda"],
        cxx_std=17,
        extra_compile_args=["-O2"],
        # The CUDA runtime is linked statically: the module loads whatever CUDA build of torch is
        # installed; it sets the tensor's device itself (see fp8_grouped_gemm.cu, DeviceGuard).
        extra_link_args=[os.path.join(lib_dir, "libcudart_static.a"), "-lrt", "-ldl", "-lpthread"],
    )
    ext.cuda_required = mode == "1"
    ext.cuda_sources = CUDA_SOURCES
    ext.nvcc = os.path.join(cuda_home, "bin", "nvcc")
    ext.nvcc_includes = ["csrc/cuda", cutlass_include]
    return ext


class BuildExt(build_ext):
    """build_ext that first compiles an extension's .cu sources with nvcc into objects, and drops an
    optional CUDA extension whose nvcc step fails (so the rest of the package still installs)."""

    def build_extensions(self):
        self.extensions = [ext for ext in self.extensions if self._compile_cuda(ext)]
        super().build_extensions()

    def _compile_cuda(self, ext) -> bool:
        objects, commands = [], []
        for source in getattr(ext, "cuda_sources", []):
            obj = os.path.join(self.build_temp, source + ".o")
            os.makedirs(os.path.dirname(obj), exist_ok=True)
            inputs = [source, *_local_headers(source)]
            if (
                self.force
                or not os.path.exists(obj)
                or any(os.path.getmtime(f) > os.path.getmtime(obj) for f in inputs)
            ):
                commands.append(
                    [ext.nvcc, "-c", source, "-o", obj, *NVCC_FLAGS, *(f"-I{d}" for d in ext.nvcc_includes)]
                )
            objects.append(obj)
        if not objects:
            return True
        # each CUTLASS translation unit takes ~30-60 s: compile them side by side
        with ThreadPoolExecutor(max_workers=max(1, min(len(commands), os.cpu_count() or 1))) as pool:
            for cmd in commands:
                print(" ".join(cmd))
            codes = list(pool.map(subprocess.call, commands))
        if any(codes):
            if ext.cuda_required:
                sys.exit(f"{ext.name}: nvcc failed (exit codes {codes})")
            print(
                f"{ext.name} skipped: nvcc failed (exit codes {codes}); the fp8 GEMMs use the Triton kernel "
                "(MEGAMOE_BUILD_CUDA=1 makes this an error)",
                file=sys.stderr,
            )
            return False
        ext.extra_objects = list(ext.extra_objects or []) + objects
        return True


ext_modules = [
    Pybind11Extension(
        "megamoe_train._C",
        sources=["csrc/bindings.cpp", "csrc/layout.cpp"],
        include_dirs=["csrc"],
        cxx_std=17,
        extra_compile_args=["-O2"],
    )
]
cuda_ext = _cuda_extension()
if cuda_ext is not None:
    ext_modules.append(cuda_ext)

setup(
    packages=find_packages(include=["megamoe_train*", "megatron_patch*", "megamoe_trainer*"]),
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildExt},
)
