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

// torch.autocast.__enter__: saves the previous state (enabled flag and dtype for `device`,
// and the thread's cache-enabled flag) in the out-parameters, enables autocast for `device`
// with `dtype`, and increments the nesting count.
char* tch_ext_autocast_enter(
    int device, int dtype, bool* prev_enabled, int* prev_dtype, bool* prev_cache_enabled) noexcept {
  return tch_ext::guarded([&] {
    const auto type = autocast_device(device);
    const auto fast_dtype = static_cast<at::ScalarType>(dtype);
    TORCH_CHECK(
        fast_dtype == at::kBFloat16 || fast_dtype == at::kHalf,
        "autocast dtype must be BFloat16 or Half, not ", fast_dtype);
    *prev_enabled = at::autocast::is_autocast_enabled(type);
    *prev_dtype = static_cast<int>(at::autocast::get_autocast_dtype(type));
    *prev_cache_enabled = at::autocast::is_autocast_cache_enabled();
    at::autocast::set_autocast_enabled(type, true);
    at::autocast::set_autocast_dtype(type, fast_dtype);
    at::autocast::increment_nesting();
  });
}

// torch.autocast.__exit__: decrements the nesting count, clears the cast cache when the
// outermost region ends (libtorch's count reaches 0, or `outermost`: the Rust side has no
// region of this thread left open, even if other code left libtorch's count above 0), and
// restores the saved state.
char* tch_ext_autocast_exit(
    int device,
    bool prev_enabled,
    int prev_dtype,
    bool prev_cache_enabled,
    bool outermost) noexcept {
  return tch_ext::guarded([&] {
    const auto type = autocast_device(device);
    if (at::autocast::decrement_nesting() == 0 || outermost) {
      at::autocast::clear_cache();
    }
    at::autocast::set_autocast_enabled(type, prev_enabled);
    at::autocast::set_autocast_dtype(type, static_cast<at::ScalarType>(prev_dtype));
    at::autocast::set_autocast_cache_enabled(prev_cache_enabled);
  });
}

// torch.is_autocast_cache_enabled(): whether this thread caches the casts of leaf tensors
// that require grad (weights) within an autocast region.
char* tch_ext_autocast_cache_enabled(bool* enabled) noexcept {
  return tch_ext::guarded([&] { *enabled = at::autocast::is_autocast_cache_enabled(); });
}

// torch.set_autocast_cache_enabled(enabled), for this thread.
char* tch_ext_set_autocast_cache_enabled(bool enabled) noexcept {
  return tch_ext::guarded([&] { at::autocast::set_autocast_cache_enabled(enabled); });
}

}  // extern "C"
