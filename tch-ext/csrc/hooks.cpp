// Post-accumulate-grad hooks (PyTorch's `Tensor.register_post_accumulate_grad_hook`) and
// `param.grad = ...` assignment.
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

#include "tch_ext.h"

extern "C" {
// Calls the Rust closure `ctx` with a new `at::Tensor` handle to the parameter, which the
// callee owns (tch frees it). Returns false when the closure failed, after storing its
// message with `tch_ext_message_set(error, ...)`, or when it panicked (no message).
typedef bool (*tch_ext_hook_call_fn)(void* ctx, at::Tensor* param, void* error);
// Drops the Rust closure `ctx`; called exactly once.
typedef void (*tch_ext_hook_drop_fn)(void* ctx);
}

namespace {

// Owns the Rust closure: dropping the last reference drops the closure.
struct RustCallback {
  tch_ext_hook_call_fn call;
  void* ctx;
  tch_ext_hook_drop_fn drop;

  RustCallback(tch_ext_hook_call_fn call, void* ctx, tch_ext_hook_drop_fn drop)
      : call(call), ctx(ctx), drop(drop) {}
  RustCallback(const RustCallback&) = delete;
  RustCallback& operator=(const RustCallback&) = delete;
  ~RustCallback() { drop(ctx); }
};

// The one post-accumulate-grad hook object a tensor's autograd metadata holds.
class RustPostAccumulateGradHook final : public torch::autograd::PostAccumulateGradHook {
 public:
  explicit RustPostAccumulateGradHook(std::shared_ptr<RustCallback> callback)
      : callback_(std::move(callback)) {}

  void operator()(const torch::autograd::Variable& param) override {
    // A local reference keeps the closure alive even if it replaces or clears its own hook
    // (which destroys `this`); nothing below touches `this`.
    std::shared_ptr<RustCallback> callback = callback_;
    std::string error;
    if (!callback->call(callback->ctx, new at::Tensor(param), &error)) {
      throw std::runtime_error(
          error.empty()
              ? "a Rust post-accumulate-grad hook panicked (its message was printed above)"
              : error);
    }
  }

 private:
  std::shared_ptr<RustCallback> callback_;
};

}  // namespace

extern "C" {

// Sets `param`'s post-accumulate-grad hook, replacing (and so dropping) any previous one.
// Takes ownership of `ctx` on every path: on error, `drop(ctx)` has run before it returns.
char* tch_ext_set_post_acc_grad_hook(
    const at::Tensor* param,
    tch_ext_hook_call_fn call,
    void* ctx,
    tch_ext_hook_drop_fn drop) noexcept {
  std::shared_ptr<RustCallback> callback;
  try {
    callback = std::make_shared<RustCallback>(call, ctx, drop);
  } catch (...) {
    drop(ctx);
    return tch_ext::copy_message("out of memory while registering a hook");
  }
  return tch_ext::guarded([&] {
    TORCH_CHECK(param->defined(), "cannot register a hook on an undefined tensor");
    TORCH_CHECK(
        param->requires_grad() && param->is_leaf(),
        "post-accumulate-grad hooks can only be registered on leaf tensors that require grad");
    torch::autograd::impl::set_post_acc_grad_hooks(
        *param, std::make_unique<RustPostAccumulateGradHook>(std::move(callback)));
  });
}

// Removes `param`'s post-accumulate-grad hook, if any.
char* tch_ext_clear_post_acc_grad_hook(const at::Tensor* param) noexcept {
  return tch_ext::guarded([&] {
    TORCH_CHECK(param->defined(), "cannot clear a hook on an undefined tensor");
    if (param->unsafeGetTensorImpl()->autograd_meta() != nullptr) {
      torch::autograd::impl::set_post_acc_grad_hooks(*param, nullptr);
    }
  });
}

// Whether `param` has a post-accumulate-grad hook.
char* tch_ext_has_post_acc_grad_hook(const at::Tensor* param, bool* out) noexcept {
  return tch_ext::guarded([&] {
    TORCH_CHECK(param->defined(), "cannot query the hook of an undefined tensor");
    *out = param->unsafeGetTensorImpl()->autograd_meta() != nullptr &&
        torch::autograd::impl::post_acc_grad_hooks(*param) != nullptr;
  });
}

// `param.grad = grad` (the checks of PyTorch's `THPVariable_set_grad` included), or
// `param.grad = None` when `grad` is null. The gradient aliases `grad`, as in PyTorch.
char* tch_ext_set_grad(const at::Tensor* param, const at::Tensor* grad) noexcept {
  return tch_ext::guarded([&] {
    TORCH_CHECK(param->defined(), "cannot set the gradient of an undefined tensor");
    if (grad == nullptr || !grad->defined()) {
      param->mutable_grad().reset();
      return;
    }
    // One `TensorImpl` is one Python tensor object: PyTorch's `self != py_grad`.
    TORCH_CHECK(
        grad->unsafeGetTensorImpl() != param->unsafeGetTensorImpl(),
        "can't assign Variable as its own grad");
    TORCH_CHECK(
        grad->scalar_type() == param->scalar_type(),
        "assigned grad has data of a different type (",
        grad->scalar_type(), " for a ", param->scalar_type(), " tensor)");
    TORCH_CHECK(
        grad->device() == param->device(),
        "assigned grad has data located on a different device (",
        grad->device(), " for a tensor on ", param->device(), ")");
    // Same backend (dense CPU, sparse, MKL-DNN, ...); a sparse gradient of a dense
    // parameter is allowed, as for embeddings.
    TORCH_CHECK(
        grad->layout() == at::kSparse || grad->options().type_equal(param->options()),
        "assigned grad has data of a different layout or backend (",
        grad->layout(), " for a ", param->layout(), " tensor)");
    TORCH_CHECK(
        grad->sizes() == param->sizes(),
        "assigned grad has data of a different size (",
        grad->sizes(), " for a tensor of size ", param->sizes(), ")");
    param->mutable_grad() = *grad;
  });
}

// The address of `t`'s `TensorImpl`, the tensor object that every handle of it shares (one
// Python tensor object: `id(t)`), or 0 when `t` is undefined.
char* tch_ext_tensor_id(const at::Tensor* t, size_t* out) noexcept {
  return tch_ext::guarded([&] {
    *out = t->defined() ? reinterpret_cast<size_t>(t->unsafeGetTensorImpl()) : 0;
  });
}

// Releases an error message returned by any entry point.
void tch_ext_free_error(char* message) noexcept {
  if (message != tch_ext::kOutOfMemory) {
    std::free(message);
  }
}

}  // extern "C"
