// In-place tensor operations with a scalar factor, which tch's generated bindings lack:
// `self.add_(other, alpha)`, `self.addcmul_(a, b, value)`, `self.addcdiv_(a, b, value)`.
// PyTorch's optimizers are written with them; the fused kernels round once and need no
// temporary tensor.
#include <ATen/ATen.h>

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

}  // extern "C"
