// Which leaves a backward pass from a root tensor would reach: a walk over the autograd graph
// from the root's `grad_fn` to the leaves' gradient accumulators, as PyTorch's DDP reducer
// does before a backward with `find_unused_parameters` (`Reducer::search_unused_parameters`).
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <cstddef>
#include <unordered_set>
#include <vector>

#include "tch_ext.h"

extern "C" {

// Sets `reached[i]` to whether `leaves[i]`'s gradient accumulator is reachable from `root`'s
// `grad_fn` along `next_edges()`. A root without `grad_fn` that is a leaf requiring grad
// reaches only itself; any other root without `grad_fn` reaches nothing. `reached` holds `n`
// values; on error its contents are unspecified.
char* tch_ext_reachable_leaves(
    const at::Tensor* root, const at::Tensor* const* leaves, size_t n, bool* reached) noexcept {
  return tch_ext::guarded([&] {
    TORCH_CHECK(root->defined(), "the root of the graph walk is an undefined tensor");
    for (size_t i = 0; i < n; ++i) {
      TORCH_CHECK(leaves[i]->defined(), "leaf ", i, " of the graph walk is an undefined tensor");
      reached[i] = false;
    }
    // `auto`: the node pointer is a `std::shared_ptr` up to torch 2.11, an `intrusive_ptr`
    // since; both test as booleans and give `.get()`.
    const auto& start = root->grad_fn();
    if (!start) {
      if (root->requires_grad()) {
        // A leaf root: backward reaches its own accumulator only.
        for (size_t i = 0; i < n; ++i) {
          reached[i] = leaves[i]->unsafeGetTensorImpl() == root->unsafeGetTensorImpl();
        }
      }
      return;
    }
    std::unordered_set<const torch::autograd::Node*> seen{start.get()};
    std::vector<const torch::autograd::Node*> stack{start.get()};
    while (!stack.empty()) {
      const torch::autograd::Node* node = stack.back();
      stack.pop_back();
      for (const torch::autograd::Edge& edge : node->next_edges()) {
        const torch::autograd::Node* next = edge.function.get();
        if (next != nullptr && seen.insert(next).second) {
          stack.push_back(next);
        }
      }
    }
    for (size_t i = 0; i < n; ++i) {
      // A leaf no graph uses has no live accumulator: then nothing reaches it.
      const auto accumulator = torch::autograd::impl::try_get_grad_accumulator(*leaves[i]);
      reached[i] = accumulator && seen.count(accumulator.get()) != 0;
    }
  });
}

}  // extern "C"
