// PendingRead as Python sees it: wait() releases the GIL and checks for Ctrl-C
// between short slices; dropping an unfinished handle cancels what has not
// started and waits for what has (its memory may be the buffer being freed).
#pragma once

#include <pybind11/pybind11.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <vector>

#include "stoker/io/shard_reader.hpp"

namespace stoker::bindings {

inline constexpr int64_t kWaitSliceMs = 50;

class PyPendingRead {
 public:
  PyPendingRead(std::shared_ptr<io::PendingRead> pending, pybind11::object result,
                std::unique_ptr<pybind11::buffer_info> export_hold = nullptr)
      : pending_(std::move(pending)),
        result_(std::move(result)),
        export_hold_(std::move(export_hold)),
        pid_(getpid()) {}
  // Moved-from handles own nothing, so their destructor cancels nothing.
  PyPendingRead(PyPendingRead&&) = default;
  PyPendingRead(const PyPendingRead&) = delete;

  ~PyPendingRead() {
    // Nobody can see this batch any more: skip what has not started, and let
    // the chunks in flight finish before `result_` (their memory) is freed.
    if (pending_ && getpid() == pid_ && !pending_->done()) {
      pending_->cancel();
      pybind11::gil_scoped_release release;
      try {
        pending_->wait(-1);
      } catch (...) {  // the error belongs to a batch nobody wants any more
      }
    }
  }

  pybind11::object wait(std::optional<double> timeout) {
    using Clock = std::chrono::steady_clock;
    // Beyond a year (or not a number) means no timeout; it would overflow a
    // clock's integer duration.
    if (timeout && !(*timeout < 365.0 * 24 * 3600)) timeout.reset();
    auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double>(timeout.value_or(0.0)));
    for (;;) {
      int64_t slice = kWaitSliceMs;
      if (timeout) {
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
        slice = std::clamp<int64_t>(left.count(), 0, kWaitSliceMs);
      }
      bool finished;
      {
        pybind11::gil_scoped_release release;
        finished = pending_->wait(slice);
      }
      if (finished) {
        export_hold_.reset();
        return result_;
      }
      if (PyErr_CheckSignals() != 0) throw pybind11::error_already_set();
      if (timeout && Clock::now() >= deadline) {
        PyErr_SetString(PyExc_TimeoutError, "the batch is still being read");
        throw pybind11::error_already_set();
      }
    }
  }

  bool done() const { return pending_->done(); }
  void cancel() { pending_->cancel(); }
  double busy_seconds() const { return pending_->busy_seconds(); }
  uint64_t bytes_read() const { return pending_->bytes_read(); }
  std::vector<uint32_t> blanked() const { return pending_->blanked(); }
  std::vector<io::BorrowedValue> borrowed() const { return pending_->borrowed(); }
  uint64_t unsized_bytes() const { return pending_->unsized_bytes(); }

 private:
  std::shared_ptr<io::PendingRead> pending_;
  pybind11::object result_;  // what wait() returns: the batch buffer
  // For read_into: the caller's buffer stays exported (a bytearray cannot be
  // resized, an mmap not closed) while threads write into it.
  std::unique_ptr<pybind11::buffer_info> export_hold_;
  pid_t pid_;
};

}  // namespace stoker::bindings
