// CUDA streams and events through c10's device-generic interfaces (c10::Stream, c10::Event
// and the device-guard registry), so this file needs no CUDA headers and nothing from
// libc10_cuda at link time: the CUDA backend is whatever `libc10_cuda` registered when it was
// loaded. Without it every function reports that CUDA is missing. (ATen's tensor header is for
// record_stream: a tensor's storage, handed to the same backend.)
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <cstdint>

#include "tch_ext.h"

namespace {

constexpr auto kCuda = c10::DeviceType::CUDA;

// The registered CUDA backend, or null when libc10_cuda is not loaded.
const c10::impl::DeviceGuardImplInterface* cuda_backend() noexcept {
  return c10::impl::hasDeviceGuardImpl(kCuda) ? c10::impl::getDeviceGuardImpl(kCuda) : nullptr;
}

// Checks `device` before any call into the backend: several of its functions are noexcept
// and would terminate the process on an invalid device index.
c10::Device checked_device(int device) {
  const auto* backend = cuda_backend();
  TORCH_CHECK(backend != nullptr, "libtorch's CUDA backend (libc10_cuda) is not loaded");
  const int count = backend->deviceCount();
  TORCH_CHECK(
      device >= 0 && device < count, "CUDA device ", device, " does not exist (",
      count, " visible)");
  return c10::Device(kCuda, static_cast<c10::DeviceIndex>(device));
}

c10::Stream stream_of(int64_t id, int device) {
  const auto dev = checked_device(device);
  return c10::Stream::unpack3(id, dev.index(), kCuda);
}

void write_stream(const c10::Stream& stream, int64_t* id, void** raw) {
  *id = stream.id();
  *raw = stream.native_handle();
}

}  // namespace

extern "C" {

// Number of CUDA devices libtorch's CUDA backend sees; 0 when it is not loaded.
int tch_ext_cuda_device_count() noexcept {
  const auto* backend = cuda_backend();
  return backend == nullptr ? 0 : static_cast<int>(backend->deviceCount());
}

// The current stream of `device` on this thread: its c10 id and its cudaStream_t.
char* tch_ext_cuda_current_stream(int device, int64_t* id, void** raw) noexcept {
  return tch_ext::guarded([&] {
    const auto dev = checked_device(device);
    write_stream(cuda_backend()->getStream(dev), id, raw);
  });
}

// A stream from libtorch's pool for `device` (round-robin, never destroyed).
char* tch_ext_cuda_pool_stream(int device, bool high_priority, int64_t* id, void** raw) noexcept {
  return tch_ext::guarded([&] {
    const auto dev = checked_device(device);
    write_stream(cuda_backend()->getStreamFromGlobalPool(dev, high_priority), id, raw);
  });
}

// Makes stream `id` current for `device` on this thread; writes the previous current stream's
// id. Does not change the current device.
char* tch_ext_cuda_exchange_stream(int64_t id, int device, int64_t* previous) noexcept {
  return tch_ext::guarded([&] {
    const auto stream = stream_of(id, device);
    *previous = cuda_backend()->exchangeStream(stream).id();
  });
}

// Blocks until all work queued on the stream has finished.
char* tch_ext_cuda_stream_synchronize(int64_t id, int device) noexcept {
  return tch_ext::guarded([&] { stream_of(id, device).synchronize(); });
}

// Whether all work queued on the stream has finished.
char* tch_ext_cuda_stream_query(int64_t id, int device, bool* done) noexcept {
  return tch_ext::guarded([&] { *done = stream_of(id, device).query(); });
}

// A new event (timing disabled); the CUDA event is created on its first record.
char* tch_ext_cuda_event_new(int device, void** out) noexcept {
  return tch_ext::guarded([&] {
    checked_device(device);
    *out = new c10::Event(kCuda, c10::EventFlag::PYTORCH_DEFAULT);
  });
}

// Destroys an event made by tch_ext_cuda_event_new.
void tch_ext_cuda_event_free(void* event) noexcept {
  try {
    delete static_cast<c10::Event*>(event);
  } catch (...) {
    // c10::Event's destructor is noexcept; nothing can be reported from a drop anyway.
  }
}

// Records the event on the stream (cudaEventRecord).
char* tch_ext_cuda_event_record(void* event, int64_t id, int device) noexcept {
  return tch_ext::guarded([&] { static_cast<c10::Event*>(event)->record(stream_of(id, device)); });
}

// Makes the stream wait for the event's last record (cudaStreamWaitEvent); a no-op for an
// event never recorded.
char* tch_ext_cuda_stream_wait_event(int64_t id, int device, void* event) noexcept {
  return tch_ext::guarded([&] { static_cast<c10::Event*>(event)->block(stream_of(id, device)); });
}

// Whether the work before the event's last record has finished (true if never recorded).
char* tch_ext_cuda_event_query(void* event, bool* done) noexcept {
  return tch_ext::guarded([&] { *done = static_cast<c10::Event*>(event)->query(); });
}

// Blocks until the work before the event's last record has finished.
char* tch_ext_cuda_event_synchronize(void* event) noexcept {
  return tch_ext::guarded([&] { static_cast<c10::Event*>(event)->synchronize(); });
}

// Tells the caching allocator that the CUDA tensor's memory is used on stream `id` of
// `device` (PyTorch's `Tensor.record_stream`): when the memory is freed, the allocator hands
// it out again only after the work queued so far on that stream has finished. A tensor
// without storage, or memory the caching allocator did not allocate, is left alone.
char* tch_ext_cuda_record_stream(const at::Tensor* t, int64_t id, int device) noexcept {
  return tch_ext::guarded([&] {
    TORCH_CHECK(t->defined() && t->is_cuda(), "record_stream takes a CUDA tensor");
    const auto stream = stream_of(id, device);
    TORCH_CHECK(
        t->device() == stream.device(), "a tensor on ", t->device(), " used on a stream of ",
        stream.device());
    if (t->has_storage()) {
      cuda_backend()->recordDataPtrOnStream(t->storage().data_ptr(), stream);
    }
  });
}

}  // extern "C"
