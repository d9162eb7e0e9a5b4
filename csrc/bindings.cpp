// Python bindings of the host code (module megamoe_train._C): the symmetric buffer layout.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "layout.h"

namespace py = pybind11;
using megamoe::LayoutSpec;

namespace {

LayoutSpec spec_from_dict(const py::dict& d) {
  auto get_int = [&](const char* key) { return d[key].cast<int64_t>(); };
  auto get_str = [&](const char* key) { return d[key].cast<std::string>(); };
  return LayoutSpec{get_int("num_ranks"),      get_int("max_tokens"),    get_int("hidden"),
                    get_int("topk"),           get_str("act_dtype"),     get_int("act_itemsize"),
                    get_int("act_block"),      get_str("scale_dtype"),   get_int("scale_itemsize"),
                    get_str("compute_dtype"),  get_int("compute_itemsize"), get_int("shared_experts")};
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "MegaMoE host code: the symmetric buffer layout";

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
}
