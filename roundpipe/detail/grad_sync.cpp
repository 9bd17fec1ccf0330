#include "roundpipe/detail/grad_sync.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/hash.h>

#include <algorithm>
#include <chrono>

namespace roundpipe::detail {

GradSync::GradSync(std::shared_ptr<comm::ProcessGroup> group, const LayerSet& layers,
                   const std::vector<std::vector<at::Tensor>>& params, int64_t bucket_bytes)
    : group_(group->split()) {
  TORCH_CHECK(bucket_bytes > 0, "RoundPipeOptions::grad_bucket_bytes must be > 0, got ", bucket_bytes);
  const int64_t L = static_cast<int64_t>(layers.uses.size());
  bucket_of_layer_.assign(static_cast<size_t>(L), 0);
  int64_t bytes = 0;
  for (int64_t l = L - 1; l >= 0; --l) {
    if (buckets_.empty() || bytes >= bucket_bytes) {
      buckets_.emplace_back();
      bytes = 0;
    }
    Bucket& bucket = buckets_.back();
    ++bucket.layers;
    bucket_of_layer_[l] = static_cast<int64_t>(buckets_.size()) - 1;
    const auto& uses = layers.uses[l];
    for (size_t u = 0; u < uses.size(); ++u) {
      const at::Tensor& p = params[uses[u].layer][uses[u].index];
      if (!p.requires_grad()) continue;  // frozen: no gradient (Note [Frozen parameters])
      auto flat = std::find_if(bucket.flats.begin(), bucket.flats.end(),
                               [&](const Flat& f) { return f.dtype == p.scalar_type(); });
      if (flat == bucket.flats.end()) {
        bucket.flats.emplace_back();
        flat = bucket.flats.end() - 1;
        flat->dtype = p.scalar_type();
      }
      flat->entries.push_back(Entry{l, static_cast<int64_t>(u), flat->numel, p.sizes().vec()});
      flat->numel += p.numel();
      bytes += p.nbytes();
    }
  }
}

struct GradSync::Run {
  std::vector<std::vector<at::Tensor>>* grads = nullptr;
  std::vector<int64_t> remaining;                // per bucket: layers not yet ready (GradSync::mutex_)
  size_t next_launch = 0;                        // buckets launched (GradSync::mutex_)
  std::vector<std::vector<at::Tensor>> buffers;  // [bucket][flat], from its launch on
  std::vector<std::vector<comm::Work>> works;    // [bucket][flat]
  at::Tensor found;                              // set by finish (GradSync::mutex_)
  comm::Work found_work;
  bool found_launched = false;  // GradSync::mutex_
};

GradSync::~GradSync() = default;

void GradSync::check_usable() const {
  TORCH_CHECK(!broken_, "forward_backward: an earlier forward_backward failed on rank ", group_->rank(),
              " of this data-parallel job, so its gradient all-reduces are out of step with the other ranks'; ",
              "the job cannot continue: fix the error above and restart (resume from the last checkpoint)");
}

std::shared_ptr<GradSync::Run> GradSync::begin(std::vector<std::vector<at::Tensor>>* grads) {
  auto run = std::make_shared<Run>();
  run->grads = grads;
  for (const auto& bucket : buckets_) {
    run->remaining.push_back(bucket.layers);
    run->buffers.emplace_back(bucket.flats.size());
    run->works.emplace_back(bucket.flats.size());
  }
  std::lock_guard<std::mutex> lock(mutex_);
  check_usable();
  launching_.push_back(run);
  return run;
}

// Flattens the bucket's gradients (a gradient a rank did not compute, e.g. of a parameter unused
// in this forward, counts as zeros: every rank must send the same sizes) and starts the
// all-reduce. Caller holds mutex_.
void GradSync::launch(Run& run, size_t b) {
  const Bucket& bucket = buckets_[b];
  for (size_t f = 0; f < bucket.flats.size(); ++f) {
    const Flat& flat = bucket.flats[f];
    if (flat.numel == 0) continue;
    at::Tensor buffer = at::empty({flat.numel}, at::TensorOptions().dtype(flat.dtype));
    for (const auto& e : flat.entries) {
      auto slice = buffer.narrow(0, e.offset, c10::multiply_integers(e.shape));
      const auto& layer_grads = (*run.grads)[e.layer];
      const at::Tensor& g = layer_grads.empty() ? at::Tensor() : layer_grads[e.use];
      if (g.defined()) {
        slice.copy_(g.reshape(-1));
      } else {
        slice.zero_();
      }
    }
    run.works[b][f] = group_->all_reduce(buffer);
    run.buffers[b][f] = std::move(buffer);
    ++stats_.buckets;
    stats_.bytes += run.buffers[b][f].nbytes();
  }
}

// Launches every collective whose turn has come (Note [Gradient buckets]). Caller holds mutex_.
void GradSync::pump() {
  while (!broken_ && !launching_.empty()) {
    Run& run = *launching_.front();
    while (run.next_launch < buckets_.size() && run.remaining[run.next_launch] == 0) {
      launch(run, run.next_launch);
      ++run.next_launch;
    }
    if (run.next_launch < buckets_.size() || !run.found.defined()) return;
    run.found_work = group_->all_reduce(run.found, comm::ReduceOp::kMax);
    run.found_launched = true;
    launching_.pop_front();
  }
}

void GradSync::layers_ready(Run& run, int64_t begin, int64_t end) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (int64_t l = begin; l < end; ++l) --run.remaining[bucket_of_layer_[l]];
  pump();
}

at::Tensor GradSync::finish(Run& run, at::Tensor found_inf) {
  const auto start = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_INTERNAL_ASSERT(found_inf.defined() && found_inf.numel() == 1, "GradSync::finish: found_inf must be [1]");
    run.found = std::move(found_inf);
    pump();
    if (!run.found_launched) {
      check_usable();  // a later run failed after launching (so nothing launches any more)
      TORCH_INTERNAL_ASSERT(false, "GradSync::finish: ", buckets_.size() - run.next_launch,
                            " gradient buckets were never ready, or an earlier run is still launching");
    }
  }
  // This run's collectives are all launched: its buffers and works are only touched here now.
  const double world = static_cast<double>(group_->world_size());
  try {
    for (size_t b = 0; b < buckets_.size(); ++b) {
      for (size_t f = 0; f < buckets_[b].flats.size(); ++f) {
        at::Tensor& buffer = run.buffers[b][f];
        if (!buffer.defined()) continue;
        run.works[b][f].wait();
        buffer.div_(world);
        for (const auto& e : buckets_[b].flats[f].entries) {
          // Copied back into the run's gradient tensors, not handed over as views of the bucket:
          // an optimizer's zero_grad() detaches gradients in place, which views refuse (the same
          // reason DDP's gradient_as_bucket_view is off by default).
          auto& grads = (*run.grads)[e.layer];
          if (grads.empty()) continue;  // a layer whose stage sent no gradients (cannot happen after a backward)
          auto slice = buffer.narrow(0, e.offset, c10::multiply_integers(e.shape)).view(e.shape);
          at::Tensor& g = grads[e.use];
          if (g.defined()) {
            g.copy_(slice);
          } else {
            g = slice.clone();
          }
        }
        buffer = at::Tensor();
      }
    }
    run.found_work.wait();
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    broken_ = true;
    throw;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  ++stats_.runs;
  stats_.wait_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  return run.found;
}

void GradSync::abandon(Run& run) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Launched collectives keep their tensors alive (c10d's Work holds them). The ranks are out of
  // step from here on, even when this run launched nothing: the other ranks may have launched
  // theirs, which this rank's next run would pair with, averaging gradients of different
  // iterations without an error.
  broken_ = true;
  launching_.erase(std::remove_if(launching_.begin(), launching_.end(),
                                  [&](const std::shared_ptr<Run>& r) { return r.get() == &run; }),
                   launching_.end());
  for (auto& works : run.works) {
    for (auto& w : works) w = comm::Work();
  }
  for (auto& buffers : run.buffers) {
    for (auto& t : buffers) t = at::Tensor();
  }
  run.found_work = comm::Work();
}

GradSyncStats GradSync::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

namespace {

// A hash of the model's structure: layer count, and every parameter's and buffer's name, shape,
// dtype and requires_grad, in order.
int64_t model_fingerprint(const LayerSet& layers) {
  size_t h = c10::hash_combine(0, layers.layers.size());
  auto add = [&](const std::string& name, const at::Tensor& t) {
    h = c10::hash_combine(h, std::hash<std::string>{}(name));
    for (auto s : t.sizes()) h = c10::hash_combine(h, static_cast<size_t>(s));
    h = c10::hash_combine(h, static_cast<size_t>(t.scalar_type()));
    h = c10::hash_combine(h, static_cast<size_t>(t.requires_grad()));
  };
  for (const auto& layer : layers.layers) {
    for (const auto& p : layer.ptr()->named_parameters()) add(p.key(), p.value());
    for (const auto& b : layer.ptr()->named_buffers()) add(b.key(), b.value());
  }
  return static_cast<int64_t>(h & 0x3fffffffffffffffULL);
}

}  // namespace

void broadcast_model(comm::ProcessGroup& group, const std::string& model_name, const LayerSet& layers) {
  if (group.world_size() == 1) return;
  const int64_t mine = model_fingerprint(layers);
  auto lo = at::full({1}, mine, at::kLong);
  auto hi = at::full({1}, mine, at::kLong);
  auto lo_work = group.all_reduce(lo, comm::ReduceOp::kMin);
  auto hi_work = group.all_reduce(hi, comm::ReduceOp::kMax);
  lo_work.wait();
  hi_work.wait();
  TORCH_CHECK(lo.item<int64_t>() == hi.item<int64_t>(), "RoundPipe '", model_name, "': rank ", group.rank(),
              " built a different model than another rank of the data-parallel job (its parameter and buffer ",
              "names, shapes, dtypes or requires_grad differ): every rank must build the same model, with the same ",
              "configuration and the same frozen parameters");
  at::NoGradGuard no_grad;
  std::vector<std::pair<at::Tensor, at::Tensor>> pending;  // (target, contiguous stand-in)
  std::vector<comm::Work> works;
  for (const auto& layer : layers.layers) {
    std::vector<at::Tensor> tensors;
    for (const auto& p : layer.ptr()->parameters()) tensors.push_back(p);
    for (const auto& b : layer.ptr()->buffers()) tensors.push_back(b);
    for (const auto& t : tensors) {
      if (!t.defined() || t.numel() == 0) continue;
      TORCH_CHECK(t.device().is_cpu(), "RoundPipe '", model_name, "': parameters and buffers must be in host memory ",
                  "(they are the compute copies), got one on ", t.device());
      at::Tensor target = t.detach();
      at::Tensor wire = target.is_contiguous() ? target : target.contiguous();
      works.push_back(group.broadcast(wire, 0));
      if (!wire.is_same(target)) pending.emplace_back(target, wire);
    }
  }
  for (auto& w : works) w.wait();
  for (auto& [target, wire] : pending) target.copy_(wire);
}

}  // namespace roundpipe::detail
