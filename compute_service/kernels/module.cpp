// The kernels as one Python module (compute_service/kernels/__init__.py builds and loads it).
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <bit>

namespace {

// The number of threads at::parallel_for spreads a loop over now: torch's thread count where the build has
// OpenMP, 1 where it has not (what compute logs at start, and what the tests check).
int64_t parallel_threads() {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, 64, 1, [&](int64_t, int64_t) { seen |= uint64_t{1} << std::min<int>(at::get_thread_num(), 63); });
  return std::popcount(seen.load());
}

}  // namespace

// NOTE: the kernels run without the GIL, as torch's own ops do: a step of the decoder stack holds no Python state, and
// compute's other threads (the one sending the last step's reply) must not wait the whole step for it.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention reading K/V in place by block table",
        py::call_guard<py::gil_scoped_release>());
  m.def("sparse_tables", &sparse_tables, "the tables and context lengths of a step's block-sparse decodes",
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_layers", &decode_layers, "a float32 Llama-shaped decoder stack over one all-decode step",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm_rows", &rms_norm_rows, "x [rows, width] * rsqrt(mean(x^2) + eps) * weight",
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul_rows", &silu_mul_rows, "silu(gate) * up of gate_up [rows, 2 * inter]: [rows, inter]",
        py::call_guard<py::gil_scoped_release>());
  m.def("rotate_rows", &rotate_rows, "rotary embedding of x [rows, heads, head_dim] in place",
        py::call_guard<py::gil_scoped_release>());
  m.def("greedy", &greedy, "each row's first most likely token and its log-probability",
        py::call_guard<py::gil_scoped_release>());
  m.def("parallel_threads", &parallel_threads, "threads at::parallel_for uses now");
  m.def("panel_width", &panel_width, "output columns per panel of pack_panels");
  m.def("pack_panels", &pack_panels, "a float32 or int8 weight [out, in] packed for panel_linear");
  m.def("pack_int4_panels", &pack_int4_panels,
        "int4 levels [out, in] and their groups' scales and zeros [out, groups] packed for panel_linear");
  m.def("panel_linear", &panel_linear, "x [rows, in] times packed panels (* int8 scales) (+ bias): [rows, out]",
        py::call_guard<py::gil_scoped_release>());
  m.def("fma_gflops", &fma_gflops, "float32 FMA GFLOP/s on every thread, for about `seconds`",
        py::call_guard<py::gil_scoped_release>());
  m.def("read_gbps", &read_gbps, "GB/s every thread reads a buffer of `megabytes` at, for about `seconds`",
        py::call_guard<py::gil_scoped_release>());
}
