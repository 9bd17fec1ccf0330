// trace::StageSpan recording (roundpipe/stage_trace.h) on CPU devices, and the overlap measure.
#include "roundpipe/stage_trace.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <set>

#include "roundpipe/detail/stage_jobs.h"
#include "roundpipe/round_pipe.h"
#include "tests/roundpipe/test_models.h"

namespace roundpipe {
namespace {

int64_t layer_bytes(torch::nn::Sequential& model, int64_t begin, int64_t end) {
  int64_t bytes = 0;
  for (int64_t l = begin; l < end; ++l) {
    for (const auto& p : model[l]->parameters()) bytes += p.nbytes();
    for (const auto& b : model[l]->buffers()) bytes += b.nbytes();
  }
  return bytes;
}

TEST(StageTraceTest, RecordsEveryJobWithBytesAndOrderedTimes) {
  auto model = testing::make_mlp(3);  // 5 layers
  RoundPipe rp(model, RoundPipeOptions().devices({c10::kCPU, c10::kCPU}));
  RunConfig cfg;
  cfg.num_microbatch = 3;
  cfg.execute_plan = scheduler::ExecutePlan({{0, 2}}, {{2, 5}, {0, 2}});
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& y) { return torch::mse_loss(out, y); };
  rp.forward_backward({torch::randn({6, 8})}, torch::randn({6, 4}), loss_fn, cfg);  // not traced
  rp.synchronize();  // its backward job may still run: it must finish before tracing starts

  trace::enable(true);
  rp.forward_backward({torch::randn({6, 8})}, torch::randn({6, 4}), loss_fn, cfg);
  rp.synchronize();  // the backward job may start after forward_backward returns
  trace::enable(false);
  rp.forward_backward({torch::randn({6, 8})}, torch::randn({6, 4}), loss_fn, cfg);  // not traced

  const auto spans = trace::collect();
  ASSERT_EQ(spans.size(), 3u);
  std::map<std::string, int64_t> bytes;
  std::set<uint64_t> workers;
  for (const auto& s : spans) {
    bytes[s.job] = s.upload_bytes;
    workers.insert(s.worker);
    EXPECT_TRUE(s.device.is_cpu());
    EXPECT_LE(0.0, s.upload_begin_ms) << s.job;
    EXPECT_LE(s.upload_begin_ms, s.upload_end_ms) << s.job;
    EXPECT_LE(s.upload_end_ms, s.compute_begin_ms) << s.job;
    EXPECT_LE(s.compute_begin_ms, s.compute_end_ms) << s.job;
  }
  EXPECT_EQ(bytes["forward stage [0, 2)"], layer_bytes(model, 0, 2));
  EXPECT_EQ(bytes["fused stage [2, 5)"], layer_bytes(model, 2, 5));
  EXPECT_EQ(bytes["backward stage [0, 2)"], layer_bytes(model, 0, 2));
  EXPECT_EQ(workers.size(), 2u);  // round-robin over both workers
  // CPU workers upload and compute on one thread: nothing is hidden.
  EXPECT_EQ(trace::upload_overlap_fraction(spans), 0.0);
}

// Note [Lazy leases]: a job run as on CUDA copies each layer when its first microbatch first needs
// it, so its compute starts before its last layer's copy (eager CPU jobs copy every layer first).
TEST(StageTraceTest, LazyLeases_ComputeStartsBeforeTheLastLayerIsCopied) {
  auto model = testing::make_mlp(3);  // 5 layers
  RoundPipe rp(model, RoundPipeOptions().devices({c10::kCPU}));
  RunConfig cfg;
  cfg.num_microbatch = 2;
  cfg.execute_plan = scheduler::ExecutePlan({}, {{0, 5}});
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& y) { return torch::mse_loss(out, y); };
  for (bool lazy : {false, true}) {
    detail::set_cuda_flow_on_cpu_for_testing(lazy);
    trace::enable(true);
    rp.forward_backward({torch::randn({6, 8})}, torch::randn({6, 4}), loss_fn, cfg);
    rp.synchronize();
    trace::enable(false);
    detail::set_cuda_flow_on_cpu_for_testing(false);
    const auto spans = trace::collect();
    ASSERT_EQ(spans.size(), 1u);
    EXPECT_EQ(spans[0].upload_bytes, layer_bytes(model, 0, 5));
    if (lazy) {
      EXPECT_LT(spans[0].compute_begin_ms, spans[0].upload_end_ms);
    } else {
      EXPECT_LE(spans[0].upload_end_ms, spans[0].compute_begin_ms);
    }
  }
}

TEST(StageTraceTest, OverlapFraction_CountsUploadTimeUnderSameWorkerCompute) {
  trace::StageSpan a, b, other;
  a.worker = b.worker = 1;
  other.worker = 2;
  a.upload_begin_ms = 0, a.upload_end_ms = 10, a.compute_begin_ms = 5, a.compute_end_ms = 20;
  b.upload_begin_ms = 12, b.upload_end_ms = 16, b.compute_begin_ms = 20, b.compute_end_ms = 30;
  other.upload_begin_ms = 0, other.upload_end_ms = 6, other.compute_begin_ms = 0, other.compute_end_ms = 0;
  // a: [5, 10] of [0, 10] hidden under its own compute; b: all 4 under a's; other: none (its
  // worker never computes while it uploads, and the other worker's compute does not count).
  EXPECT_DOUBLE_EQ(trace::upload_overlap_fraction({a, b, other}), (5.0 + 4.0) / (10.0 + 4.0 + 6.0));
  EXPECT_EQ(trace::upload_overlap_fraction({}), 0.0);
}

}  // namespace
}  // namespace roundpipe
