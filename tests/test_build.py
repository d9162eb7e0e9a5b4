"""setup.py's optional CUDA extension, on a machine without a usable toolchain: a stub nvcc that
fails and stub CUTLASS headers. The install must still build the host extension and say why the
CUDA one was skipped; MEGAMOE_BUILD_CUDA=1 must turn that into an error (GPU machines that need
the kernels)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def stub_toolchain(tmp_path_factory):
    base = tmp_path_factory.mktemp("toolchain")
    cuda = base / "cuda"
    (cuda / "bin").mkdir(parents=True)
    (cuda / "lib64").mkdir()
    nvcc = cuda / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'nvcc stub: unsupported gpu architecture' >&2\nexit 1\n")
    nvcc.chmod(0o755)
    (cuda / "lib64" / "libcudart_static.a").write_bytes(b"")
    headers = base / "site" / "cutlass_library" / "source" / "include" / "cutlass"
    headers.mkdir(parents=True)
    (headers / "cutlass.h").write_text("// stub\n")
    (base / "site" / "cutlass_library" / "__init__.py").write_text("")
    tree = base / "tree"
    shutil.copytree(
        ROOT,
        tree,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "runs", "*.so", "__pycache__", ".dev", ".whl", "results"
        ),
    )
    return cuda, base / "site", tree


def _build(stub_toolchain, mode):
    cuda, site, tree = stub_toolchain
    shutil.rmtree(tree / "build", ignore_errors=True)
    env = dict(
        os.environ,
        CUDA_HOME=str(cuda),
        MEGAMOE_BUILD_CUDA=mode,
        PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
    )
    return subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_failing_nvcc_skips_the_cuda_extension(stub_toolchain):
    result = _build(stub_toolchain, "auto")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "megamoe_train._cuda skipped: nvcc failed" in result.stderr
    built = sorted(p.name for p in (stub_toolchain[2] / "megamoe_train").glob("*.so"))
    assert len(built) == 1 and built[0].startswith("_C."), built


def test_required_cuda_build_fails_loudly(stub_toolchain):
    result = _build(stub_toolchain, "1")
    assert result.returncode != 0
    assert "megamoe_train._cuda: nvcc failed" in result.stdout + result.stderr


def _build_with(stub_toolchain, mode, cuda_home):
    _, site, tree = stub_toolchain
    shutil.rmtree(tree / "build", ignore_errors=True)
    for so in (tree / "megamoe_train").glob("*.so"):
        so.unlink()
    env = dict(
        os.environ,
        CUDA_HOME=str(cuda_home),
        MEGAMOE_BUILD_CUDA=mode,
        PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
    )
    return subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def toolkit_without_static_runtime(tmp_path_factory):
    """An nvcc without libcudart_static.a beside it (a pip or conda nvcc package)."""
    cuda = tmp_path_factory.mktemp("nvcc_only") / "cuda"
    (cuda / "bin").mkdir(parents=True)
    nvcc = cuda / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\nexit 1\n")
    nvcc.chmod(0o755)
    return cuda


def test_missing_static_runtime_skips_the_cuda_extension(stub_toolchain, toolkit_without_static_runtime):
    # used to sys.exit in the default mode, so not even the host extension was built
    result = _build_with(stub_toolchain, "auto", toolkit_without_static_runtime)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "megamoe_train._cuda skipped (libcudart_static.a not found" in result.stderr
    built = sorted(p.name for p in (stub_toolchain[2] / "megamoe_train").glob("*.so"))
    assert len(built) == 1 and built[0].startswith("_C."), built


def test_missing_static_runtime_is_an_error_when_required(stub_toolchain, toolkit_without_static_runtime):
    result = _build_with(stub_toolchain, "1", toolkit_without_static_runtime)
    assert result.returncode != 0
    assert "MEGAMOE_BUILD_CUDA=1 but libcudart_static.a not found" in result.stdout + result.stderr
