// Per-stage-job timeline of the RoundPipe engine: when each job's parameter upload and compute
// began and ended, on which device, and how many parameter bytes it uploaded. For benchmarks and
// for checking that uploads overlap compute; off by default (no cost when off).
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <string>
#include <vector>

namespace roundpipe::trace {

/// One stage job. Times in milliseconds since `enable(true)`. On CPU devices they are host
/// timestamps; on CUDA devices they come from CUDA events on the job's streams (parameter-upload
/// stream for the upload, compute stream for the compute), i.e. GPU time.
struct StageSpan {
  c10::Device device = c10::kCPU;
  uint64_t worker = 0;       // identifies the device worker thread that ran the job
  std::string job;           // e.g. "forward stage [0, 3)"
  double upload_begin_ms = 0;
  double upload_end_ms = 0;  // all of the job's parameter copies done
  double compute_begin_ms = 0;
  double compute_end_ms = 0;  // the job's last kernel (CUDA) or last host operation (CPU)
  int64_t upload_bytes = 0;   // parameter and buffer bytes copied to the device
};

/// Starts (true: clears earlier spans, resets the time origin) or stops recording. Call between
/// training calls, not while one runs; a job is recorded if it starts while recording is on, and
/// a forward_backward's backward jobs may start after it returns (RoundPipeOptions::
/// overlap_backward): call RoundPipe::synchronize() before enable(false).
void enable(bool on);
bool enabled();

/// The spans recorded since `enable(true)`, in job start order; waits for the CUDA events they
/// need. Thread-safe.
std::vector<StageSpan> collect();

/// Fraction of the total upload time of `spans` during which the same worker was computing
/// (another job, or earlier layers of the same job): 1 = every upload hidden under compute. On
/// CPU devices uploads and compute run on the same thread, so it is 0 there.
double upload_overlap_fraction(const std::vector<StageSpan>& spans);

}  // namespace roundpipe::trace
