// The asynchronous meeting point of the CPU FFI handlers (normal and low-latency mode):
// every rank of an EP group publishes its buffers, the last to arrive runs the work, and
// each rank's future completes once all peers finished reading.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cpu/cpu_rendezvous.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/common/ffi_helpers.h"

namespace jax_ep {

namespace ffi = xla::ffi;

inline int32_t Scalar(ffi::Buffer<ffi::S32> b) { return b.typed_data()[0]; }

inline ffi::Future Failed(ffi::Error e) {
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetError(std::move(e));
  return future;
}

// Joins the peers of this call and returns at once; the returned future completes when
// `work` has run on the peers' buffers (and every peer has finished reading ours).
// Errors found on any rank before arrival (bad ids) fail every rank, so all ranks agree.
// `work` must capture plain data pointers: it runs after the handler has returned.
template <typename Work>
ffi::Future Exchange(ffi::RunId run_id, int64_t call_site, int rank, int group, int R,
                     PeerBuffers mine, Work work, const char* op = "jax_ep") {
  if (rank < 0 || rank >= R) {
    std::ostringstream s;
    s << "rank index " << rank << " is outside [0, " << R << ")";
    return Failed(Invalid(s.str()));
  }
  ffi::Promise promise;
  ffi::Future future(promise);
  Rendezvous::Global().Join(
      {run_id.run_id, call_site, group}, rank, R, std::move(mine), TimeoutSeconds(),
      [R, op, work = std::move(work)](const std::vector<PeerBuffers>& peers) -> std::string {
        for (int s = 0; s < R; ++s) {
          if (!peers[s].error.empty()) {
            std::ostringstream m;
            m << "jax_ep: on rank " << s << ": " << peers[s].error;
            return m.str();
          }
          for (int j = 0; j < 8; ++j) {
            if (peers[s].meta[j] != peers[0].meta[j]) {
              std::ostringstream m;
              m << op << ": ranks 0 and " << s << " of one EP group disagree on shapes "
                << "or dtype (field " << j << ": " << peers[0].meta[j] << " vs "
                << peers[s].meta[j] << ")";
              return m.str();
            }
          }
        }
        return work(peers);
      },
      [promise](const std::string& err) mutable {
        if (err.empty()) {
          promise.SetAvailable();
        } else {
          const bool timeout = err.find("timed out") != std::string::npos;
          promise.SetError(ffi::Error(
              timeout ? ffi::ErrorCode::kDeadlineExceeded : ffi::ErrorCode::kInvalidArgument,
              err));
        }
      });
  return future;
}

}  // namespace jax_ep
