// The error convention shared by every entry point of the shim.
//
// Each `extern "C"` function returns `char*`: null on success, otherwise a NUL-terminated
// message allocated with malloc that the caller releases with `tch_ext_free_error`. Every
// entry point is `noexcept` and catches everything, so no C++ exception crosses into Rust.
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <exception>

namespace tch_ext {

// Returned when the message itself cannot be allocated; never freed.
inline char kOutOfMemory[] = "out of memory while reporting a libtorch error";

inline char* copy_message(const char* message) noexcept {
  const size_t len = std::strlen(message);
  char* copy = static_cast<char*>(std::malloc(len + 1));
  if (copy == nullptr) {
    return kOutOfMemory;
  }
  std::memcpy(copy, message, len + 1);
  return copy;
}

// Runs `body`, turning any exception into an error message.
template <class F>
char* guarded(F&& body) noexcept {
  try {
    body();
    return nullptr;
  } catch (const c10::Error& e) {
    // what() would append a C++ stack trace in some builds; the message is what users need.
    return copy_message(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return copy_message(e.what());
  } catch (...) {
    return copy_message("unknown C++ exception");
  }
}

}  // namespace tch_ext
