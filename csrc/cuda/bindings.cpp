// pybind11 module megamoe_train._cuda: the CUDA kernels of csrc/cuda, called with raw device
// addresses (tensors are checked and their addresses taken in megamoe_train/backends/cutlass_gemm.py,
// so this module needs no PyTorch headers and loads beside any CUDA build of torch).
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "expert_gemm.h"
#include "grouped_gemm.h"

namespace py = pybind11;

namespace {

megamoe::GroupedGemmArgs make_args(uintptr_t a, uintptr_t a_scales, uintptr_t b, uintptr_t b_scales, uintptr_t d,
                                   uintptr_t group_ends, int num_groups, int m, int n, int k, int b_layout, int variant,
                                   int swizzle, uintptr_t workspace, size_t workspace_bytes, uintptr_t stream,
                                   int device) {
  return {reinterpret_cast<const void*>(a), reinterpret_cast<const float*>(a_scales),
          reinterpret_cast<const void*>(b), reinterpret_cast<const float*>(b_scales),
          reinterpret_cast<void*>(d),       reinterpret_cast<const int32_t*>(group_ends),
          num_groups, m, n, k, static_cast<megamoe::BLayout>(b_layout), variant, swizzle,
          reinterpret_cast<void*>(workspace), workspace_bytes, reinterpret_cast<void*>(stream), device};
}

void check(const char* name, const char* error) {
  if (error[0] != '\0') throw std::runtime_error(std::string(name) + ": " + error);
}

void fp8_grouped_gemm(uintptr_t a, uintptr_t a_scales, uintptr_t b, uintptr_t b_scales, uintptr_t d,
                      uintptr_t group_ends, int num_groups, int n, int k, int variant, int swizzle,
                      uintptr_t workspace, size_t workspace_bytes, uintptr_t stream, int device) {
  check("fp8_grouped_gemm", megamoe::fp8_grouped_gemm(make_args(a, a_scales, b, b_scales, d, group_ends, num_groups, 0, n, k,
                                                               0, variant, swizzle, workspace, workspace_bytes,
                                                               stream, device)));
}

void bf16_grouped_gemm(uintptr_t a, uintptr_t b, uintptr_t d, uintptr_t group_ends, int num_groups, int n, int k,
                       int b_layout, int variant, int swizzle, uintptr_t workspace, size_t workspace_bytes,
                       uintptr_t stream, int device) {
  check("bf16_grouped_gemm", megamoe::bf16_grouped_gemm(make_args(a, 0, b, 0, d, group_ends, num_groups, 0, n, k, b_layout,
                                                                 variant, swizzle, workspace, workspace_bytes,
                                                                 stream, device)));
}

// a_t [m, p], b_t [n, p] and their scales, d [num_groups, m, n]: grouped_gemm.h's depth-grouped GEMM.
void fp8_wgrad_grouped_gemm(uintptr_t a_t, uintptr_t a_t_scales, uintptr_t b_t, uintptr_t b_t_scales, uintptr_t d,
                            uintptr_t group_ends, int num_groups, int m, int n, int p, int variant, int swizzle,
                            uintptr_t workspace, size_t workspace_bytes, uintptr_t stream, int device) {
  check("fp8_wgrad_grouped_gemm",
        megamoe::fp8_wgrad_grouped_gemm(make_args(a_t, a_t_scales, b_t, b_t_scales, d, group_ends, num_groups, m, n, p, 0,
                                                  variant, swizzle, workspace, workspace_bytes, stream, device)));
}

// a [p, m], b [p, n] (the pool operands), d [num_groups, m, n]: output is a Bf16WgradOutput
// (bf16 stored, fp32 stored, fp32 accumulated into).
void bf16_wgrad_grouped_gemm(uintptr_t a, uintptr_t b, uintptr_t d, uintptr_t group_ends, int num_groups, int m, int n,
                             int p, int output, int variant, int swizzle, uintptr_t workspace, size_t workspace_bytes,
                             uintptr_t stream, int device) {
  megamoe::GroupedGemmArgs args = make_args(a, 0, b, 0, d, group_ends, num_groups, m, n, p, 0, variant, swizzle, workspace,
                                            workspace_bytes, stream, device);
  check("bf16_wgrad_grouped_gemm", megamoe::bf16_wgrad_grouped_gemm(args, static_cast<megamoe::Bf16WgradOutput>(output)));
}

size_t bf16_wgrad_workspace_bytes(int num_groups, int variant, int output, int device) {
  return megamoe::bf16_wgrad_grouped_gemm_workspace_bytes(num_groups, variant, static_cast<megamoe::Bf16WgradOutput>(output),
                                                         device);
}

megamoe::ExpertGemmArgs expert_args(uintptr_t a, uintptr_t a_scales, uintptr_t b, uintptr_t b_scales,
                                     uintptr_t group_ends, uintptr_t out, uintptr_t row_weights, uintptr_t act,
                                     uintptr_t act_scales, int num_groups, int pool_rows, int n, int k, int chunk,
                                     double clamp, bool has_clamp, int variant, uintptr_t stream, int device,
                                     uintptr_t b_shifts = 0) {
  return {reinterpret_cast<const void*>(a), reinterpret_cast<const float*>(a_scales), reinterpret_cast<const void*>(b),
          reinterpret_cast<const float*>(b_scales), reinterpret_cast<const int32_t*>(group_ends),
          reinterpret_cast<const uint8_t*>(b_shifts), reinterpret_cast<void*>(out), reinterpret_cast<const float*>(row_weights), reinterpret_cast<void*>(act),
          reinterpret_cast<float*>(act_scales), num_groups, pool_rows, n, k, chunk, static_cast<float>(clamp),
          has_clamp, variant, reinterpret_cast<void*>(stream), device};
}

// expert_gemm.h: a e4m3 [pool_rows, k] + scales, b e4m3 [num_groups, n, k] + scales, out bf16 [pool_rows, n].
void expert_gemm(uintptr_t a, uintptr_t a_scales, uintptr_t b, uintptr_t b_scales, uintptr_t group_ends, uintptr_t out,
                 int num_groups, int pool_rows, int n, int k, int variant, uintptr_t stream, int device) {
  check("expert_gemm", megamoe::expert_gemm(expert_args(a, a_scales, b, b_scales, group_ends, out, 0, 0, 0, num_groups,
                                                        pool_rows, n, k, 0, 0.0, false, variant, stream, device)));
}

// expert_gemm.h's expert_gemm_mx: b packed E2M1 [num_groups, n, k/2] + b_shifts + b_scales (fp32 blocks).
void expert_gemm_mx(uintptr_t a, uintptr_t a_scales, uintptr_t b, uintptr_t b_shifts, uintptr_t b_scales,
                    uintptr_t group_ends, uintptr_t out, int num_groups, int pool_rows, int n, int k, int variant,
                    uintptr_t stream, int device) {
  check("expert_gemm_mx", megamoe::expert_gemm_mx(expert_args(a, a_scales, b, b_scales, group_ends, out, 0, 0, 0,
                                                              num_groups, pool_rows, n, k, 0, 0.0, false, variant,
                                                              stream, device, b_shifts)));
}

// expert_gemm.h's L1: out the pre-activations bf16 [pool_rows, n], act e4m3 [pool_rows, n/2] + act_scales.
void expert_gemm_swiglu(uintptr_t a, uintptr_t a_scales, uintptr_t b, uintptr_t b_scales, uintptr_t group_ends,
                        uintptr_t out, uintptr_t row_weights, uintptr_t act, uintptr_t act_scales, int num_groups,
                        int pool_rows, int n, int k, int chunk, double clamp, bool has_clamp, int variant,
                        uintptr_t stream, int device) {
  check("expert_gemm_swiglu",
        megamoe::expert_gemm_swiglu(expert_args(a, a_scales, b, b_scales, group_ends, out, row_weights, act, act_scales,
                                                num_groups, pool_rows, n, k, chunk, clamp, has_clamp, variant, stream,
                                                device)));
}

size_t bf16_workspace_bytes(int num_groups, int variant, int b_layout, int device) {
  return megamoe::bf16_grouped_gemm_workspace_bytes(num_groups, variant, static_cast<megamoe::BLayout>(b_layout), device);
}

}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "MegaMoE CUDA kernels (Hopper, sm_90a)";
  m.attr("FP8_VARIANTS") = megamoe::fp8_grouped_gemm_variants();
  m.attr("BF16_VARIANTS") = megamoe::bf16_grouped_gemm_variants();
  m.attr("FP8_WGRAD_VARIANTS") = megamoe::fp8_wgrad_grouped_gemm_variants();
  m.attr("BF16_WGRAD_VARIANTS") = megamoe::bf16_wgrad_grouped_gemm_variants();
  m.def("fp8_grouped_gemm_workspace_bytes", &megamoe::fp8_grouped_gemm_workspace_bytes, py::arg("num_groups"),
        py::arg("variant"), py::arg("device"));
  m.def("fp8_wgrad_grouped_gemm_workspace_bytes", &megamoe::fp8_wgrad_grouped_gemm_workspace_bytes,
        py::arg("num_groups"), py::arg("variant"), py::arg("device"));
  m.attr("BF16_WGRAD_STORE_BF16") = static_cast<int>(megamoe::Bf16WgradOutput::kStoreBf16);
  m.attr("BF16_WGRAD_STORE_FP32") = static_cast<int>(megamoe::Bf16WgradOutput::kStoreFp32);
  m.attr("BF16_WGRAD_ACCUMULATE_FP32") = static_cast<int>(megamoe::Bf16WgradOutput::kAccumulateFp32);
  m.def("bf16_wgrad_grouped_gemm_workspace_bytes", &bf16_wgrad_workspace_bytes, py::arg("num_groups"), py::arg("variant"),
        py::arg("output"), py::arg("device"));
  m.def("bf16_grouped_gemm_workspace_bytes", &bf16_workspace_bytes, py::arg("num_groups"), py::arg("variant"),
        py::arg("b_layout"), py::arg("device"));
  m.def("fp8_grouped_gemm", &fp8_grouped_gemm, py::arg("a"), py::arg("a_scales"), py::arg("b"), py::arg("b_scales"),
        py::arg("d"), py::arg("group_ends"), py::arg("num_groups"), py::arg("n"), py::arg("k"), py::arg("variant"),
        py::arg("swizzle"), py::arg("workspace"), py::arg("workspace_bytes"), py::arg("stream"), py::arg("device"));
  m.def("bf16_grouped_gemm", &bf16_grouped_gemm, py::arg("a"), py::arg("b"), py::arg("d"), py::arg("group_ends"),
        py::arg("num_groups"), py::arg("n"), py::arg("k"), py::arg("b_layout"), py::arg("variant"), py::arg("swizzle"),
        py::arg("workspace"), py::arg("workspace_bytes"), py::arg("stream"), py::arg("device"));
  m.def("fp8_wgrad_grouped_gemm", &fp8_wgrad_grouped_gemm, py::arg("a_t"), py::arg("a_t_scales"), py::arg("b_t"),
        py::arg("b_t_scales"), py::arg("d"), py::arg("group_ends"), py::arg("num_groups"), py::arg("m"), py::arg("n"),
        py::arg("p"), py::arg("variant"), py::arg("swizzle"), py::arg("workspace"), py::arg("workspace_bytes"),
        py::arg("stream"), py::arg("device"));
  m.def("expert_gemm", &expert_gemm, py::arg("a"), py::arg("a_scales"), py::arg("b"), py::arg("b_scales"),
        py::arg("group_ends"), py::arg("out"), py::arg("num_groups"), py::arg("pool_rows"), py::arg("n"), py::arg("k"),
        py::arg("variant"), py::arg("stream"), py::arg("device"));
  m.def("expert_gemm_mx", &expert_gemm_mx, py::arg("a"), py::arg("a_scales"), py::arg("b"), py::arg("b_shifts"),
        py::arg("b_scales"), py::arg("group_ends"), py::arg("out"), py::arg("num_groups"), py::arg("pool_rows"),
        py::arg("n"), py::arg("k"), py::arg("variant"), py::arg("stream"), py::arg("device"));
  m.def("expert_gemm_swiglu", &expert_gemm_swiglu, py::arg("a"), py::arg("a_scales"), py::arg("b"), py::arg("b_scales"),
        py::arg("group_ends"), py::arg("out"), py::arg("row_weights"), py::arg("act"), py::arg("act_scales"),
        py::arg("num_groups"), py::arg("pool_rows"), py::arg("n"), py::arg("k"), py::arg("chunk"), py::arg("clamp"),
        py::arg("has_clamp"), py::arg("variant"), py::arg("stream"), py::arg("device"));
  m.def("bf16_wgrad_grouped_gemm", &bf16_wgrad_grouped_gemm, py::arg("a"), py::arg("b"), py::arg("d"),
        py::arg("group_ends"), py::arg("num_groups"), py::arg("m"), py::arg("n"), py::arg("p"), py::arg("output"),
        py::arg("variant"), py::arg("swizzle"), py::arg("workspace"), py::arg("workspace_bytes"), py::arg("stream"),
        py::arg("device"));
}
