// In-place tensor operations with a scalar factor, which tch's generated bindings lack:
// `self.add_(other, alpha)`, `self.addcmul_(a, b, value)`, `self.addcdiv_(a, b, value)`.
// PyTorch's optimizers are written with them; the fused kernels round once and need no
// temporary tensor. And GradScaler's fused unscale over a list of gradients, which tch
// binds for one tensor at a time only, and Adam's and SGD's steps, clipping's norms and
// scaling over lists of tensors (the foreach kernels, which tch does not bind). And a
// storage's reference count, which tch does not expose.

#include <ATen/ATen.h>

#include <vector>

#include "tch_ext.h"

extern "C" {

char* tch_ext_add_(at::Tensor* self, const at::Tensor* other, double alpha) {
  return tch_ext::guarded([&] { self->add_(*other, alpha); });
}

char* tch_ext_addcmul_(at::Tensor* self, const at::Tensor* a, const at::Tensor* b, double value) {
  return tch_ext::guarded([&] { self->addcmul_(*a, *b, value); });
}

char* tch_ext_addcdiv_(at::Tensor* self, const at::Tensor* a, const at::Tensor* b, double value) {
  return tch_ext::guarded([&] { self->addcdiv_(*a, *b, value); });
}

char* tch_ext_amp_foreach_non_finite_check_and_unscale_(const at::Tensor* const* grads, size_t n,
                                                        at::Tensor* found_inf,
                                                        const at::Tensor* inv_scale) {
  return tch_ext::guarded([&] {
    // Handles sharing each gradient's storage: the kernel writes through them in place.
    std::vector<at::Tensor> list;
    list.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      list.push_back(*grads[i]);
    }
    at::_amp_foreach_non_finite_check_and_unscale_(list, *found_inf, *inv_scale);
  });
}

namespace {

// Handles sharing the storage of `n` tensors (the foreach kernels write through them).
std::vector<at::Tensor> tensor_list(const at::Tensor* const* tensors, size_t n) {
  std::vector<at::Tensor> list;
  list.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    list.push_back(*tensors[i]);
  }
  return list;
}

std::vector<at::Scalar> scalar_list(const double* values, size_t n) {
  return std::vector<at::Scalar>(values, values + n);
}

}  // namespace

char* tch_ext_foreach_adam_(const at::Tensor* const* params, const at::Tensor* const* grads,
                            const at::Tensor* const* exp_avgs,
                            const at::Tensor* const* exp_avg_sqs, size_t n,
                            const double* neg_step_sizes, const double* bias_correction2_sqrts,
                            double beta1, double beta2, double eps, double weight_decay,
                            double param_factor) {
  return tch_ext::guarded([&] {
    auto p = tensor_list(params, n);
    auto g = tensor_list(grads, n);
    auto m = tensor_list(exp_avgs, n);
    auto v = tensor_list(exp_avg_sqs, n);
    // Decoupled weight decay (AdamW) scales the parameters; L2 adds to new gradients.
    if (param_factor != 1.0) {
      at::_foreach_mul_(p, param_factor);
    }
    if (weight_decay != 0.0) {
      g = at::_foreach_add(g, p, weight_decay);
    }
    at::_foreach_lerp_(m, g, 1.0 - beta1);
    at::_foreach_mul_(v, beta2);
    at::_foreach_addcmul_(v, g, g, 1.0 - beta2);
    auto denom = at::_foreach_sqrt(v);
    at::_foreach_div_(denom, scalar_list(bias_correction2_sqrts, n));
    at::_foreach_add_(denom, eps);
    at::_foreach_addcdiv_(p, m, denom, scalar_list(neg_step_sizes, n));
  });
}

char* tch_ext_foreach_sgd_(const at::Tensor* const* params, const at::Tensor* const* grads,
                           const at::Tensor* const* momentum_buffers, size_t n, double lr,
                           double momentum, double weight_decay) {
  return tch_ext::guarded([&] {
    auto p = tensor_list(params, n);
    auto g = tensor_list(grads, n);
    if (weight_decay != 0.0) {
      g = at::_foreach_add(g, p, weight_decay);
    }
    if (momentum != 0.0) {
      auto b = tensor_list(momentum_buffers, n);
      at::_foreach_mul_(b, momentum);
      at::_foreach_add_(b, g, 1.0);
      g = b;
    }
    at::_foreach_add_(p, g, -lr);
  });
}

// The 2-norms (or `ord`-norms) of `n` tensors, stacked into one 1-D tensor in their order:
// `torch.stack(torch._foreach_norm(tensors, ord))`, one multi-tensor kernel on CUDA.
char* tch_ext_foreach_norm_stacked(const at::Tensor* const* tensors, size_t n, double ord,
                                   at::Tensor* out) {
  return tch_ext::guarded(
      [&] { *out = at::stack(at::_foreach_norm(tensor_list(tensors, n), ord)); });
}

// Each of `n` tensors times the one-element tensor `factor`, in place:
// `torch._foreach_mul_(tensors, factor)`.
char* tch_ext_foreach_mul_tensor_(const at::Tensor* const* tensors, size_t n,
                                  const at::Tensor* factor) {
  return tch_ext::guarded([&] {
    auto list = tensor_list(tensors, n);
    at::_foreach_mul_(list, *factor);
  });
}

// How many tensors share `t`'s storage (views included): the storage's reference count.
char* tch_ext_storage_use_count(const at::Tensor* t, size_t* out) {
  return tch_ext::guarded([&] { *out = t->defined() ? t->storage().use_count() : 0; });
}

}  // extern "C"
