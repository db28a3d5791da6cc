// The one place where oneDNN's exceptions become absl::Status.
#ifndef ATTNSERVE_CORE_INTERNAL_DNNL_STATUS_H_
#define ATTNSERVE_CORE_INTERNAL_DNNL_STATUS_H_

#include <exception>
#include <new>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve::internal {

// Maps a oneDNN error to a Status: out_of_memory becomes RESOURCE_EXHAUSTED,
// anything else INTERNAL (the engine validates its inputs first, so a oneDNN
// error is our bug).
absl::Status DnnlErrorToStatus(const dnnl::error& error,
                               absl::string_view what);

// Runs `body` (returning void), converting what it throws into a Status that
// names `what`.
template <typename Body>
absl::Status CallDnnl(absl::string_view what, Body&& body) {
  try {
    std::forward<Body>(body)();
    return absl::OkStatus();
  } catch (const dnnl::error& error) {
    return DnnlErrorToStatus(error, what);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(what, ": out of memory"));
  }
}

}  // namespace attnserve::internal

#endif  // ATTNSERVE_CORE_INTERNAL_DNNL_STATUS_H_
