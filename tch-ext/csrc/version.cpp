// The libtorch version the shim is compiled against: its headers' `TORCH_VERSION` ("2.13.0"),
// for a program to compare between its processes.
#include <torch/headeronly/version.h>

extern "C" {

const char* tch_ext_torch_version() noexcept { return TORCH_VERSION; }

}  // extern "C"
