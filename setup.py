"""Builds megamoe_train and its host extension megamoe_train._C (pybind11, plain C++17)."""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

ext_modules = [
    Pybind11Extension(
        "megamoe_train._C",
        sources=["csrc/bindings.cpp", "csrc/layout.cpp"],
        include_dirs=["csrc"],
        cxx_std=17,
        extra_compile_args=["-O2"],
    )
]

setup(
    packages=find_packages(include=["megamoe_train*", "megatron_patch*", "megamoe_trainer*"]),
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext},
)
