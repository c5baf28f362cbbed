// The C++ variant of benchmark/compile_cost.py's in-graph recording prototype (not the
// product): a TORCH_LIBRARY op acsc::record(token, x, site) that copies x into a list, called
// from the compiled graph without a Python frame. The token is declared mutated (Tensor(a!))
// so the compiler keeps every call, in order. take() / sites() hand the records back.
#include <torch/extension.h>
#include <torch/library.h>
#include <vector>
static std::vector<at::Tensor> g_records;
static std::vector<int64_t> g_sites;
void record(at::Tensor& token, const at::Tensor& x, int64_t site) {
  g_records.push_back(x.clone());
  g_sites.push_back(site);
}
TORCH_LIBRARY(acsc, m) { m.def("record(Tensor(a!) token, Tensor x, int site) -> ()"); }
TORCH_LIBRARY_IMPL(acsc, CPU, m) { m.impl("record", &record); }
std::vector<at::Tensor> take() { auto r = std::move(g_records); g_records.clear(); return r; }
std::vector<int64_t> sites() { auto r = std::move(g_sites); g_sites.clear(); return r; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("take", &take); m.def("sites", &sites); }
