// Exact-size host blocks for the compute copies (Note [Exact-size pinned host memory]): packing
// keeps every tensor's identity, values, layout and aliasing, blocks are as small as the tensors
// allow, pinned once and unpinned when their last tensor goes, and a packed model trains bitwise
// as an unpacked one through the engine. The pinner here records calls instead of calling CUDA;
// the CUDA twin in cuda_engine_test.cpp uses cudaHostRegister.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <atomic>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "roundpipe/detail/host_blocks.h"
#include "roundpipe/round_pipe.h"
#include "tests/common/tensor_compare.h"
#include "tests/roundpipe/test_models.h"

namespace roundpipe {
namespace {

using detail::HostPinner;

// Pinned blocks: start -> bytes; and the blocks unpinned so far.
struct RecordingPinner {
  std::map<uintptr_t, size_t> pinned;
  std::vector<uintptr_t> unpinned;
  int refuse_calls = 0;  // refuse the first n blocks

  HostPinner pinner() {
    HostPinner p;
    p.pin = [this](void* ptr, size_t bytes) {
      if (refuse_calls > 0) {
        --refuse_calls;
        return false;
      }
      pinned.emplace(reinterpret_cast<uintptr_t>(ptr), bytes);
      return true;
    };
    p.unpin = [this](void* ptr) { unpinned.push_back(reinterpret_cast<uintptr_t>(ptr)); };
    return p;
  }
  // The pinned block holding `t`'s bytes, or pinned.end().
  std::map<uintptr_t, size_t>::const_iterator block_of(const torch::Tensor& t) const {
    const auto begin = reinterpret_cast<uintptr_t>(t.storage().data());
    auto it = pinned.upper_bound(begin);
    if (it == pinned.begin()) return pinned.end();
    --it;
    return begin + t.storage().nbytes() <= it->first + it->second ? it : pinned.end();
  }
};

size_t page_bytes() { return static_cast<size_t>(::sysconf(_SC_PAGESIZE)); }

TEST(HostBlocksTest, Pack_KeepsIdentityValuesLayoutAndAliasing) {
  RecordingPinner rec;
  {
    torch::manual_seed(1);
    auto weight = torch::randn({3, 5}).requires_grad_(true);            // a parameter
    auto count = torch::arange(7, torch::kLong);                         // a buffer
    auto base = torch::randn({6, 4});
    auto transposed = base.t();                                          // a non-contiguous view of base
    auto row = base.narrow(0, 2, 3);                                     // a view with a storage offset
    auto empty = torch::empty({0, 4});                                   // no bytes: left alone
    auto big = torch::randn({100, 90}).to(torch::kBFloat16);             // 18,000 bytes
    auto alias = weight.detach();                                        // another TensorImpl, same storage
    std::vector<torch::Tensor> all{weight, count, base, transposed, row, empty, big, alias};
    std::vector<torch::Tensor> expected;
    std::vector<const c10::TensorImpl*> impls;
    for (const auto& t : all) {
      expected.push_back(t.detach().clone());
      impls.push_back(t.unsafeGetTensorImpl());
    }
    const void* empty_data = empty.data_ptr();

    // Layer 0 holds weight, count, base and its views; layer 1 holds weight again (tied), big and alias.
    const auto stats =
        detail::pack_host_tensors({{weight, count, base, transposed, row, empty, torch::Tensor()}, {weight, big, alias}},
                                  rec.pinner());

    EXPECT_EQ(stats.blocks, 2);
    EXPECT_EQ(stats.refused_groups, 0);
    EXPECT_EQ(stats.tensors, 7);  // all but `empty`; weight counted once (the second time it was already moved)
    const int64_t weight_bytes = 15 * 4, count_bytes = 7 * 8, base_bytes = 24 * 4, big_bytes = 9000 * 2;
    EXPECT_EQ(stats.storage_bytes, weight_bytes + count_bytes + base_bytes + big_bytes);
    EXPECT_EQ(stats.power_of_two_bytes, 64 + 64 + 128 + 32768);
    ASSERT_EQ(rec.pinned.size(), 2u);
    // Layer 0: three storages at 256-byte offsets in one page; layer 1: big alone (weight is layer 0's).
    const size_t page = page_bytes();
    std::vector<size_t> sizes;
    for (const auto& [start, bytes] : rec.pinned) {
      EXPECT_EQ(start % page, 0u);
      sizes.push_back(bytes);
    }
    std::sort(sizes.begin(), sizes.end());
    EXPECT_EQ(sizes[0], page);
    EXPECT_EQ(sizes[1], (18000 + page - 1) / page * page);
    EXPECT_EQ(static_cast<size_t>(stats.block_bytes), sizes[0] + sizes[1]);

    for (size_t i = 0; i < all.size(); ++i) {
      SCOPED_TRACE("tensor " + std::to_string(i));
      const auto& t = all[i];
      EXPECT_EQ(t.unsafeGetTensorImpl(), impls[i]);
      EXPECT_EQ(t.sizes(), expected[i].sizes());
      EXPECT_EQ(t.scalar_type(), expected[i].scalar_type());
      EXPECT_TRUE(torch::equal(t, expected[i]));
      if (i == 5) continue;
      const auto block = rec.block_of(t);
      ASSERT_NE(block, rec.pinned.end()) << "not in a pinned block";
      EXPECT_EQ((reinterpret_cast<uintptr_t>(t.storage().data()) - block->first) % 256, 0u);
    }
    EXPECT_TRUE(weight.requires_grad());
    EXPECT_TRUE(weight.is_leaf());
    EXPECT_FALSE(count.requires_grad());
    EXPECT_EQ(transposed.strides(), (std::vector<int64_t>{1, 4}));
    EXPECT_EQ(row.storage_offset(), 8);
    EXPECT_EQ(empty.data_ptr(), empty_data);
    EXPECT_EQ(rec.block_of(weight), rec.block_of(count));
    EXPECT_NE(rec.block_of(weight), rec.block_of(big));

    // Aliases still alias: a write through one is seen through the others.
    {
      torch::NoGradGuard no_grad;
      base.fill_(3.0);
      weight.fill_(-2.0);
    }
    EXPECT_TRUE(torch::equal(transposed, torch::full({4, 6}, 3.0)));
    EXPECT_TRUE(torch::equal(row, torch::full({3, 4}, 3.0)));
    EXPECT_TRUE(torch::equal(alias, torch::full({3, 5}, -2.0)));

    // Autograd and serialization work on the packed tensors.
    (weight * 2).sum().backward();
    EXPECT_TRUE(torch::equal(weight.grad(), torch::full({3, 5}, 2.0)));
    std::stringstream saved;
    torch::save(big, saved);
    torch::Tensor loaded;
    torch::load(loaded, saved);
    EXPECT_TRUE(torch::equal(loaded, expected[6]));
    EXPECT_TRUE(rec.unpinned.empty()) << "a block was unpinned while its tensors live";
    const uintptr_t big_block = rec.block_of(big)->first;
    all.clear();
    weight = count = base = transposed = row = big = torch::Tensor();
    EXPECT_EQ(rec.unpinned, std::vector<uintptr_t>{big_block}) << "layer 0's block must stay while `alias` views it";
    alias = torch::Tensor();
  }
  // Every block was unpinned exactly once, when its last tensor went.
  std::vector<uintptr_t> starts;
  for (const auto& block : rec.pinned) starts.push_back(block.first);
  std::sort(rec.unpinned.begin(), rec.unpinned.end());
  EXPECT_EQ(rec.unpinned, starts);
}

TEST(HostBlocksTest, Pack_RefusedBlockLeavesItsTensorsUnchanged) {
  RecordingPinner rec;
  rec.refuse_calls = 1;
  auto a = torch::randn({64}), b = torch::randn({32});
  const void* a_data = a.data_ptr();
  const auto stats = detail::pack_host_tensors({{a}, {b}}, rec.pinner());
  EXPECT_EQ(stats.refused_groups, 1);
  EXPECT_EQ(stats.blocks, 1);
  EXPECT_EQ(a.data_ptr(), a_data);
  EXPECT_EQ(rec.block_of(a), rec.pinned.end());
  EXPECT_NE(rec.block_of(b), rec.pinned.end());
  b = torch::Tensor();
  EXPECT_EQ(rec.unpinned.size(), 1u);  // the refused block was never pinned, so never unpinned
}

// A model packed as RoundPipe's constructor packs it (pack_layers) trains through the engine
// (async step, overlapping iterations) bitwise as the same model unpacked, and the compute copies
// are still in their blocks at the end: the step writes them in place, it never swaps their
// storage (which would lose the pinning).
TEST(HostBlocksTest, PackedModel_TrainsBitwiseAsUnpacked_StaysInItsBlocks) {
  RecordingPinner rec;
  std::vector<std::vector<torch::Tensor>> finals;
  for (bool pack : {false, true}) {
    auto model = testing::make_transformer(5, 0.0);
    if (pack) {
      const auto stats = detail::pack_layers({model->begin(), model->end()}, rec.pinner());
      ASSERT_EQ(stats.blocks, 4);
    }
    RoundPipe rp(model, RoundPipeOptions().devices({c10::kCPU, c10::kCPU}).seed(7));
    auto opt = [&] {
      OptimizerCtx ctx;
      return torch::optim::Adam(rp.parameters(), torch::optim::AdamOptions(1e-2));
    }();
    RunConfig cfg;
    cfg.num_microbatch = 3;
    for (int it = 0; it < 4; ++it) {
      torch::manual_seed(300 + it);
      auto x = torch::randn({6, 5, 16}), y = torch::randn({6, 5, 4});
      rp.forward_backward({x}, y,
                          [n = y.numel()](const torch::Tensor& out, const torch::Tensor& target) {
                            return torch::mse_loss(out, target, torch::Reduction::Sum) / static_cast<double>(n);
                          },
                          cfg);
      rp.step([&] {
        opt.step();
        opt.zero_grad();
      });
    }
    rp.synchronize();
    finals.emplace_back();
    for (const auto& p : rp.module()->parameters()) {
      finals.back().push_back(p.detach().clone());
      if (pack) {
        EXPECT_NE(rec.block_of(p), rec.pinned.end()) << "a compute copy left its block";
      }
    }
  }
  ASSERT_EQ(finals[0].size(), finals[1].size());
  for (size_t i = 0; i < finals[0].size(); ++i) EXPECT_TENSOR_EQ(finals[1][i], finals[0][i]) << "param " << i;
  EXPECT_FALSE(torch::equal(finals[0][0], testing::make_transformer(5, 0.0)->parameters()[0])) << "nothing trained";
}

TEST(HostBlocksTest, BufferPool_ExactSizeBuffersReusedAfterFree) {
  RecordingPinner rec;
  const size_t page = page_bytes();
  const size_t bf16_bytes = (600000 + page - 1) / page * page;
  std::vector<uintptr_t> early_unpins;
  torch::Tensor b;
  {
    detail::HostBufferPool pool(rec.pinner());
    auto a = pool.empty({1000, 300}, torch::kBFloat16);
    ASSERT_TRUE(a.defined());
    EXPECT_EQ(a.sizes(), (std::vector<int64_t>{1000, 300}));
    EXPECT_EQ(a.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(a.is_contiguous());
    ASSERT_EQ(rec.pinned.size(), 1u);
    EXPECT_EQ(rec.pinned.begin()->second, bf16_bytes);  // exact, page-rounded (not 1 MiB)
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data_ptr()), rec.pinned.begin()->first);
    a.fill_(1.5);
    EXPECT_TRUE(torch::equal(a, torch::full({1000, 300}, 1.5, torch::kBFloat16)));
    EXPECT_FALSE(pool.empty({1000}, torch::kFloat).defined()) << "below kMinBytes: the caching allocator's";

    const void* first = a.data_ptr();
    a = torch::Tensor();
    auto stats = pool.stats();
    EXPECT_EQ(stats.buffers, 1);
    EXPECT_EQ(stats.mapped_bytes, static_cast<int64_t>(bf16_bytes));
    EXPECT_EQ(stats.cached_bytes, static_cast<int64_t>(bf16_bytes));
    // The same byte size comes back from the cache (other shape, other dtype of the same bytes).
    b = pool.empty({300, 500}, torch::kFloat);
    EXPECT_EQ(b.data_ptr(), first);
    EXPECT_EQ(rec.pinned.size(), 1u);
    auto c = pool.empty({300, 1000}, torch::kBFloat16);  // b still in use: a second buffer
    auto d = pool.empty({512, 512}, torch::kFloat);       // another size
    EXPECT_NE(c.data_ptr(), b.data_ptr());
    EXPECT_EQ(rec.pinned.size(), 3u);
    stats = pool.stats();
    EXPECT_EQ(stats.buffers, 3);
    EXPECT_EQ(stats.cached_bytes, 0);
    c = d = torch::Tensor();
    EXPECT_TRUE(rec.unpinned.empty()) << "a freed buffer is cached, not unmapped";
  }
  // The pool went: its cached buffers with it; `b` is still in use.
  EXPECT_EQ(rec.unpinned.size(), 2u);
  EXPECT_TRUE(std::find(rec.unpinned.begin(), rec.unpinned.end(), reinterpret_cast<uintptr_t>(b.data_ptr())) ==
              rec.unpinned.end());
  b.fill_(2.0);  // still mapped
  const auto b_start = reinterpret_cast<uintptr_t>(b.data_ptr());
  b = torch::Tensor();
  ASSERT_EQ(rec.unpinned.size(), 3u);
  EXPECT_EQ(rec.unpinned.back(), b_start);
}

TEST(HostBlocksTest, BufferPool_RefusedPinFallsBackFromThenOn) {
  RecordingPinner rec;
  rec.refuse_calls = 1;
  detail::HostBufferPool pool(rec.pinner());
  EXPECT_FALSE(pool.empty({1 << 20}, torch::kFloat).defined());
  EXPECT_FALSE(pool.empty({1 << 20}, torch::kFloat).defined()) << "the pool tried to pin again after a refusal";
  EXPECT_TRUE(rec.pinned.empty());
  EXPECT_EQ(pool.stats().buffers, 0);
}

// Worker threads take buffers and the optimizer thread frees them (as with gradients): every
// tensor keeps its own contents, and all buffers end up cached.
TEST(HostBlocksTest, BufferPool_ConcurrentTakeAndFree) {
  RecordingPinner rec;
  std::mutex pinner_mutex;  // RecordingPinner itself is not thread-safe
  HostPinner locked;
  auto inner = rec.pinner();
  locked.pin = [&](void* p, size_t n) {
    std::lock_guard<std::mutex> lock(pinner_mutex);
    return inner.pin(p, n);
  };
  locked.unpin = [&](void* p) {
    std::lock_guard<std::mutex> lock(pinner_mutex);
    inner.unpin(p);
  };
  detail::HostBufferPool pool(locked);
  std::mutex handed_mutex;
  std::vector<std::pair<torch::Tensor, float>> handed;  // guarded by handed_mutex
  std::atomic<int> wrong{0}, workers_left{3};
  std::vector<std::thread> threads;
  for (int w = 0; w < 3; ++w) {
    threads.emplace_back([&, w] {
      for (int i = 0; i < 100; ++i) {
        const int64_t rows = 256 * (1 + (i + w) % 3);  // three sizes: 256, 512, 768 KiB
        auto t = pool.empty({rows, 256}, torch::kFloat);
        if (!t.defined()) {
          ++wrong;
          continue;
        }
        const float value = static_cast<float>(w * 1000 + i);
        t.fill_(value);
        std::lock_guard<std::mutex> lock(handed_mutex);
        handed.emplace_back(std::move(t), value);
      }
      --workers_left;
    });
  }
  std::thread optimizer([&] {
    while (true) {
      const bool last = workers_left.load() == 0;  // nothing is handed over after this
      std::vector<std::pair<torch::Tensor, float>> batch;
      {
        std::lock_guard<std::mutex> lock(handed_mutex);
        batch.swap(handed);
      }
      for (auto& [t, value] : batch) {
        if (t.min().item<float>() != value || t.max().item<float>() != value) ++wrong;
      }
      if (last && batch.empty()) break;
      std::this_thread::yield();
    }
  });
  for (auto& t : threads) t.join();
  optimizer.join();
  EXPECT_EQ(wrong.load(), 0);
  const auto stats = pool.stats();
  EXPECT_EQ(stats.cached_bytes, stats.mapped_bytes);
  EXPECT_LE(stats.buffers, 300);
  EXPECT_GE(stats.buffers, 3);
}

}  // namespace
}  // namespace roundpipe
