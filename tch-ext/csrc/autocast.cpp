// Autocast with a chosen dtype, entered and left the way Python's `torch.autocast` does.
#include <ATen/autocast_mode.h>

#include "tch_ext.h"

namespace {

// 0 = CPU, 1 = CUDA (the Rust `AutocastDevice` discriminants).
c10::DeviceType autocast_device(int device) {
  switch (device) {
    case 0:
      return c10::DeviceType::CPU;
    case 1:
      return c10::DeviceType::CUDA;
    default:
      TORCH_CHECK(false, "unknown autocast device ", device);
  }
  return c10::DeviceType::CPU;  // unreachable: TORCH_CHECK(false) throws
}

}  // namespace

extern "C" {

// This thread's autocast state for `device`: enabled, and the dtype as a c10::ScalarType.
char* tch_ext_autocast_state(int device, bool* enabled, int* dtype) noexcept {
  return tch_ext::guarded([&] {
    const auto type = autocast_device(device);
    *enabled = at::autocast::is_autocast_enabled(type);
    *dtype = static_cast<int>(at::autocast::get_autocast_dtype(type));
  });
}

// torch.autocast.__enter__: saves the previous state in the out-parameters, enables autocast
// for `device` with `dtype`, and increments the nesting count.
char* tch_ext_autocast_enter(int device, int dtype, bool* prev_enabled, int* prev_dtype) noexcept {
  return tch_ext::guarded([&] {
    const auto type = autocast_device(device);
    const auto fast_dtype = static_cast<at::ScalarType>(dtype);
    TORCH_CHECK(
        fast_dtype == at::kBFloat16 || fast_dtype == at::kHalf,
        "autocast dtype must be BFloat16 or Half, not ", fast_dtype);
    *prev_enabled = at::autocast::is_autocast_enabled(type);
    *prev_dtype = static_cast<int>(at::autocast::get_autocast_dtype(type));
    at::autocast::set_autocast_enabled(type, true);
    at::autocast::set_autocast_dtype(type, fast_dtype);
    at::autocast::increment_nesting();
  });
}

// torch.autocast.__exit__: decrements the nesting count (clearing the cast cache when the
// outermost region ends) and restores the saved state.
char* tch_ext_autocast_exit(int device, bool prev_enabled, int prev_dtype) noexcept {
  return tch_ext::guarded([&] {
    const auto type = autocast_device(device);
    if (at::autocast::decrement_nesting() == 0) {
      at::autocast::clear_cache();
    }
    at::autocast::set_autocast_enabled(type, prev_enabled);
    at::autocast::set_autocast_dtype(type, static_cast<at::ScalarType>(prev_dtype));
  });
}

}  // extern "C"
