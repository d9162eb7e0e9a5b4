// pybind11 module megamoe_train._cuda: the CUDA kernels of csrc/cuda, called with raw device
// addresses (tensors are checked and their addresses taken in megamoe_train/backends/cutlass_gemm.py,
// so this module needs no PyTorch headers and builds against any torch).
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "grouped_gemm.h"

namespace py = pybind11;

namespace {

void fp8_grouped_gemm(uintptr_t a, uintptr_t a_scales, uintptr_t b, uintptr_t b_scales, uintptr_t d,
                      uintptr_t group_ends, int num_groups, int n, int k, uintptr_t workspace,
                      size_t workspace_bytes, uintptr_t stream, int device) {
  megamoe::Fp8GroupedGemmArgs args{
      reinterpret_cast<const void*>(a),       reinterpret_cast<const float*>(a_scales),
      reinterpret_cast<const void*>(b),       reinterpret_cast<const float*>(b_scales),
      reinterpret_cast<void*>(d),             reinterpret_cast<const int32_t*>(group_ends),
      num_groups, n, k, reinterpret_cast<void*>(workspace), workspace_bytes,
      reinterpret_cast<void*>(stream), device};
  const char* error = megamoe::fp8_grouped_gemm(args);
  if (error[0] != '\0') throw std::runtime_error(std::string("fp8_grouped_gemm: ") + error);
}

}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "MegaMoE CUDA kernels (Hopper, sm_90a)";
  m.def("fp8_grouped_gemm_workspace_bytes", &megamoe::fp8_grouped_gemm_workspace_bytes, py::arg("num_groups"),
        py::arg("device"));
  m.def("fp8_grouped_gemm", &fp8_grouped_gemm, py::arg("a"), py::arg("a_scales"), py::arg("b"),
        py::arg("b_scales"), py::arg("d"), py::arg("group_ends"), py::arg("num_groups"), py::arg("n"),
        py::arg("k"), py::arg("workspace"), py::arg("workspace_bytes"), py::arg("stream"), py::arg("device"));
}
