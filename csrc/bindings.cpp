// Python bindings of the host-side planning code (module megamoe_train._C).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "layout.h"
#include "routing_plan.h"

namespace py = pybind11;
using megamoe::LayoutSpec;

namespace {

template <typename T>
py::array_t<T> to_array(const std::vector<T>& values, std::vector<py::ssize_t> shape) {
  py::array_t<T> out(shape);
  std::copy(values.begin(), values.end(), out.mutable_data());
  return out;
}

LayoutSpec spec_from_dict(const py::dict& d) {
  auto get_int = [&](const char* key) { return d[key].cast<int64_t>(); };
  auto get_str = [&](const char* key) { return d[key].cast<std::string>(); };
  return LayoutSpec{get_int("num_ranks"),     get_int("num_local_experts"), get_int("max_tokens"),
                    get_int("hidden"),        get_int("intermediate"),      get_int("topk"),
                    get_int("block_m"),       get_str("act_dtype"),         get_int("act_itemsize"),
                    get_int("act_block"),     get_str("scale_dtype"),       get_int("scale_itemsize"),
                    get_str("compute_dtype"), get_int("compute_itemsize"),  get_int("num_combine_slots")};
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "MegaMoE host planning: symmetric buffer layout and routing plans";

  m.def(
      "buffer_layout",
      [](const py::dict& spec) {
        py::list out;
        for (const auto& r : megamoe::buffer_layout(spec_from_dict(spec)))
          out.append(py::make_tuple(r.name, r.dtype, py::tuple(py::cast(r.shape)), r.offset, r.nbytes));
        return out;
      },
      py::arg("spec"),
      "List of (name, dtype, shape, byte offset, nbytes) for every region of one rank's buffer.");

  m.def(
      "pool_rows", [](const py::dict& spec) { return megamoe::pool_rows(spec_from_dict(spec)); }, py::arg("spec"));

  m.def(
      "build_send_plan",
      [](py::array_t<int64_t, py::array::c_style | py::array::forcecast> topk_idx, int64_t num_experts,
         int64_t num_ranks) {
        if (topk_idx.ndim() != 2) throw std::invalid_argument("build_send_plan: topk_idx must be 2-D [T, K]");
        const int64_t T = topk_idx.shape(0), K = topk_idx.shape(1);
        megamoe::SendPlan plan;
        {
          py::gil_scoped_release release;
          plan = megamoe::build_send_plan(topk_idx.data(), T, K, num_experts, num_ranks);
        }
        return py::make_tuple(to_array(plan.counts, {num_ranks, num_experts / num_ranks}),
                              to_array(plan.names, {num_ranks, T * K}));
      },
      py::arg("topk_idx"), py::arg("num_experts"), py::arg("num_ranks"),
      "(counts [R, E/R], names [R, T*K]) announced to every owner rank.");

  m.def(
      "build_pool_plan",
      [](py::array_t<int32_t, py::array::c_style | py::array::forcecast> recv_counts, int64_t block_m,
         int64_t owner_rank) {
        if (recv_counts.ndim() != 2) throw std::invalid_argument("build_pool_plan: recv_counts must be 2-D [R, E_local]");
        const int64_t R = recv_counts.shape(0), E = recv_counts.shape(1);
        megamoe::PoolPlan plan;
        {
          py::gil_scoped_release release;
          plan = megamoe::build_pool_plan(recv_counts.data(), R, E, block_m, owner_rank);
        }
        const py::ssize_t rows = plan.row_src.size();
        return py::make_tuple(to_array(plan.expert_offsets, {E + 1}), to_array(plan.expert_counts, {E}),
                              to_array(plan.row_src, {rows}), to_array(plan.row_pos, {rows}));
      },
      py::arg("recv_counts"), py::arg("block_m"), py::arg("owner_rank"),
      "(expert_offsets [E+1], expert_counts [E], row_src [P], row_pos [P]) of the expert-major pool.");
}
