// Releasing the GIL around native work, safely in threads that Python ends at exit.
//
// pybind11's gil_scoped_release takes the GIL back in its destructor, and destructors are
// noexcept. During interpreter finalization CPython (3.8-3.13) ends a daemon thread that asks
// for the GIL with pthread_exit(), whose forced unwinding (abi::__forced_unwind) must not
// cross a noexcept frame: the process died in std::terminate ("terminate called without an
// active exception") whenever a daemon thread (the store's encoder, a user's thread running
// a tracked model) was inside a binding when the main thread exited. ReleaseGil's destructor
// lets that unwinding through; pybind11's dispatcher and forward_wrapper_tp_call rethrow it,
// and the thread ends the way a pure-Python daemon thread does.
#pragma once

#include <Python.h>

namespace acs {

class ReleaseGil {
 public:
  ReleaseGil() : state_(PyEval_SaveThread()) {}
  // May end the thread (pthread_exit at interpreter exit): not noexcept.
  ~ReleaseGil() noexcept(false) { PyEval_RestoreThread(state_); }
  ReleaseGil(const ReleaseGil&) = delete;
  ReleaseGil& operator=(const ReleaseGil&) = delete;

 private:
  PyThreadState* state_;
};

}  // namespace acs
