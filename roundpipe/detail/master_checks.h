// Checks on the master copies RoundPipe's optimizer side keeps (internal): the master dtype, and
// a watch on step functions that never update the masters (docs/errors.md).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace roundpipe::detail {

/// Refuses float16 master weights: `dtype` is the master dtype, `what` says where it came from
/// (an option name, or the parameter whose own dtype it is).
void check_master_dtype(c10::ScalarType dtype, const std::string& what);

/// check_master_dtype for masters in their parameters' own dtype (RoundPipeOptions::optim_dtype
/// unset): every parameter that requires grad, `params[layer][index]`.
void check_parameter_master_dtypes(const std::vector<std::vector<at::Tensor>>& params);

/// Number of consecutive steps whose step function left every master and master gradient
/// untouched, with gradients pending, before MasterWatch fails.
constexpr int64_t kUntouchedStepsLimit = 8;

/// Detects a step function that never updates the master copies although gradients are pending
/// (typically an optimizer built on the compute copies: they never hold gradients at step time,
/// so it silently does nothing). Note [Untouched masters] in master_checks.cpp.
///
/// Thread-safety: `wrap`'s result runs where the step runs (optimizer thread or caller), one at a
/// time (steps run in order), and is the only user of the counter.
class MasterWatch {
 public:
  /// `masters`: the master copies [layer][param] (undefined entries are skipped), alive as long as
  /// this object; read only while a wrapped step function runs.
  explicit MasterWatch(const std::vector<std::vector<at::Tensor>>* masters) : masters_(masters) {}

  /// `step_fn` with the check around it (an empty `step_fn` stays empty: it is not checked).
  std::function<void()> wrap(std::function<void()> step_fn);

 private:
  struct Snapshot {
    const void* data = nullptr;
    uint32_t version = 0;
    const void* grad = nullptr;  // TensorImpl of .grad, null if undefined
    uint32_t grad_version = 0;
  };
  std::vector<Snapshot> snapshot() const;

  const std::vector<std::vector<at::Tensor>>* masters_;
  int64_t untouched_steps_ = 0;
};

}  // namespace roundpipe::detail
