// Python bindings of the host code (module megamoe_train._C): the symmetric buffer layout, and
// the ordered loads and stores of the CPU transport's barrier words.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>

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

// The CPU transport's barrier words live in memory shared with other processes (a /dev/shm
// mapping), and Python's own stores and loads to them are unordered on a weakly ordered CPU (ARM).
// A lock-free atomic is address-free, so the __atomic builtins order them across processes too.
static_assert(__atomic_always_lock_free(sizeof(int64_t), nullptr), "an int64 atomic must be lock-free");

int64_t* word_at(std::uintptr_t address) {
  if (address == 0) throw std::invalid_argument("barrier word address is null");
  if (address % alignof(int64_t) != 0) {
    char hex[32];
    std::snprintf(hex, sizeof(hex), "%#jx", static_cast<std::uintmax_t>(address));
    throw std::invalid_argument(std::string("barrier word address ") + hex + " is not 8-byte aligned");
  }
  return reinterpret_cast<int64_t*>(address);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "MegaMoE host code: the symmetric buffer layout, ordered barrier words";

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
      "store_release_i64",
      [](std::uintptr_t address, int64_t value) { __atomic_store_n(word_at(address), value, __ATOMIC_RELEASE); },
      py::arg("address"), py::arg("value"),
      "Store value into the int64 at address with release semantics: every store that happened "
      "before it (this thread's, and those of threads it waited for) is visible to a reader whose "
      "load_acquire_i64 returns this value. Raises ValueError if address is not 8-byte aligned.");

  m.def(
      "load_acquire_i64",
      [](std::uintptr_t address) { return __atomic_load_n(word_at(address), __ATOMIC_ACQUIRE); },
      py::arg("address"),
      "Load the int64 at address with acquire semantics: this thread's later loads see every store "
      "made before the store_release_i64 that wrote the value read. Raises ValueError if address "
      "is not 8-byte aligned.");
}
