// In-place tensor operations with a scalar factor, which tch's generated bindings lack:
// `self.add_(other, alpha)`, `self.addcmul_(a, b, value)`, `self.addcdiv_(a, b, value)`.
// PyTorch's optimizers are written with them; the fused kernels round once and need no
// temporary tensor. And GradScaler's fused unscale over a list of gradients, which tch
// binds for one tensor at a time only.
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

}  // extern "C"
