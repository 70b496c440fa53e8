// A backward function written in Rust: the autograd node of an operation that libtorch does
// not know (PyTorch's `torch.autograd.Function`, e.g. a differentiable all-reduce).
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/variable.h>

#include <c10/util/intrusive_ptr.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "tch_ext.h"

extern "C" {
// Calls the Rust closure `ctx` with a new `at::Tensor` handle to the incoming gradient, which
// the callee owns. On success the closure stores its result with `tch_ext_slot_set(result,
// ...)` and returns true; on failure it stores a message with `tch_ext_message_set(error,
// ...)` (or nothing, when it panicked) and returns false.
typedef bool (*tch_ext_backward_call_fn)(
    void* ctx, at::Tensor* grad, void* result, void* error);
// Drops the Rust closure `ctx`; called exactly once.
typedef void (*tch_ext_backward_drop_fn)(void* ctx);
}

namespace {

// Owns the Rust closure: dropping the node drops the closure.
struct RustBackwardCallback {
  tch_ext_backward_call_fn call;
  void* ctx;
  tch_ext_backward_drop_fn drop;

  RustBackwardCallback(tch_ext_backward_call_fn call, void* ctx, tch_ext_backward_drop_fn drop)
      : call(call), ctx(ctx), drop(drop) {}
  RustBackwardCallback(const RustBackwardCallback&) = delete;
  RustBackwardCallback& operator=(const RustBackwardCallback&) = delete;
  ~RustBackwardCallback() { drop(ctx); }
};

// One input, one output: the gradient of the input is the closure applied to the output's.
class RustBackward final : public torch::autograd::Node {
 public:
  explicit RustBackward(std::unique_ptr<RustBackwardCallback> callback)
      : callback_(std::move(callback)) {}

  std::string name() const override { return "RustBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (grads.empty() || !grads[0].defined()) {
      return {at::Tensor()};
    }
    at::Tensor result;
    std::string error;
    if (!callback_->call(callback_->ctx, new at::Tensor(grads[0]), &result, &error)) {
      throw std::runtime_error(
          error.empty() ? "a Rust backward function panicked (its message was printed above)"
                        : error);
    }
    return {result};
  }

 private:
  std::unique_ptr<RustBackwardCallback> callback_;
};

// How libtorch owns autograd nodes: `std::shared_ptr<Node>` up to 2.11 (the GPU machine's),
// `c10::intrusive_ptr<Node>` in 2.13. An edge holds that pointer type.
using NodePtr = std::remove_cv_t<
    std::remove_reference_t<decltype(std::declval<torch::autograd::Edge>().function)>>;

// A new node of type `N` owned the way this libtorch owns nodes. `N` is a template parameter
// so that the branch this libtorch does not use is never instantiated.
template <typename N, typename Ptr = NodePtr>
Ptr make_node(std::unique_ptr<RustBackwardCallback> callback) {
  if constexpr (std::is_same_v<Ptr, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<N>(std::move(callback));
  } else {
    return c10::make_intrusive<N>(std::move(callback));
  }
}

}  // namespace

extern "C" {

// Makes `output` (computed from `input` outside autograd) the result of a differentiable
// operation whose backward is the Rust closure `ctx`, when grad mode is on and `input`
// requires grad; otherwise drops the closure and leaves `output` as it is. Takes ownership
// of `ctx` on every path.
char* tch_ext_set_backward(
    const at::Tensor* input,
    const at::Tensor* output,
    tch_ext_backward_call_fn call,
    void* ctx,
    tch_ext_backward_drop_fn drop) noexcept {
  std::unique_ptr<RustBackwardCallback> callback;
  try {
    callback = std::make_unique<RustBackwardCallback>(call, ctx, drop);
  } catch (...) {
    drop(ctx);
    return tch_ext::copy_message("out of memory while creating a backward function");
  }
  return tch_ext::guarded([&] {
    TORCH_CHECK(input->defined() && output->defined(), "undefined tensor");
    if (!torch::autograd::GradMode::is_enabled() || !input->requires_grad()) {
      return;
    }
    TORCH_CHECK(
        !output->requires_grad(),
        "the output of a custom backward must be computed without autograd");
    TORCH_CHECK(
        torch::autograd::isDifferentiableType(output->scalar_type()),
        "the output of a custom backward must have a floating-point dtype");
    NodePtr node = make_node<RustBackward>(std::move(callback));
    node->set_next_edges(torch::autograd::collect_next_edges(*input));
    torch::autograd::set_history(*output, node);
  });
}

// `*slot = *tensor`, for a backward closure's result.
void tch_ext_slot_set(void* slot, const at::Tensor* tensor) noexcept {
  *static_cast<at::Tensor*>(slot) = *tensor;
}

// Stores a backward closure's error message.
void tch_ext_message_set(void* sink, const char* text, size_t len) noexcept {
  try {
    static_cast<std::string*>(sink)->assign(text, len);
  } catch (...) {
  }
}

}  // extern "C"
