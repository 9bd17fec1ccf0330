// comm::ProcessGroup over c10d. Keep spdlog (and base/logging.h's implementation) out of this
// translation unit: the c10d headers include LibTorch's bundled fmt.
#include "comm/process_group.h"

#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO
#endif

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <sstream>
#include <thread>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <vector>

#include "comm/detail/nccl_backend.h"

namespace roundpipe::comm {

// Note [Naming the missing rank]:
// c10d reports a dead peer as a closed connection or a timeout, without saying which rank. Each
// rank therefore beats a counter in the store (`hb/<rank>`, every heartbeat_seconds, on a store
// connection of its own so a long store wait cannot stall it). When a collective or the
// rendezvous fails, the rank reads every counter twice, 2.5 beats apart: ranks whose counter did
// not move are named as gone. If the store itself does not answer, the rank hosting it (rank 0,
// or torchrun's agent) is named instead. The check adds at most a few seconds to a failure that
// already took up to `timeout`.

namespace {

bool is_loopback(const std::string& addr) { return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1"; }

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return c10d::ReduceOp(c10d::ReduceOp::SUM);
    case ReduceOp::kMax:
      return c10d::ReduceOp(c10d::ReduceOp::MAX);
    case ReduceOp::kMin:
      return c10d::ReduceOp(c10d::ReduceOp::MIN);
  }
  TORCH_CHECK(false, "unknown ReduceOp");
}

std::string seconds(std::chrono::milliseconds ms) {
  std::ostringstream out;
  out << static_cast<double>(ms.count()) / 1000.0 << " s";
  return out.str();
}

std::string what(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) return c10->what_without_backtrace();
  return e.what();
}

}  // namespace

struct ProcessGroup::Impl {
  LaunchEnv env;
  ProcessGroupOptions options;
  std::optional<Backend> backend_kind;         // nullopt: one rank, no backend
  c10::intrusive_ptr<c10d::Store> store;       // prefixed; null for one rank
  c10::intrusive_ptr<c10d::Store> beat_store;  // a second connection, prefixed; heartbeat thread only
  c10::intrusive_ptr<c10d::Backend> backend;
  std::string store_host;  // "rank 0" or "torchrun's agent"
  // A group made by split(): the group it was split from (kept alive: its store, its beats).
  std::shared_ptr<ProcessGroup> parent;
  std::atomic<int64_t> splits{0};  // split() calls so far: names each child's store prefix

  std::mutex beat_mutex;
  std::condition_variable beat_cv;
  bool stopping = false;  // guarded by beat_mutex
  std::thread beat_thread;

  ~Impl() {
    {
      std::lock_guard<std::mutex> lock(beat_mutex);
      stopping = true;
    }
    beat_cv.notify_all();
    if (beat_thread.joinable()) beat_thread.join();
  }

  std::string where() const {
    return c10::str("rank ", env.rank, " of ", env.world_size, " (",
                    backend_kind ? backend_name(*backend_kind) : "no backend", ", store ", env.master_addr, ":",
                    env.master_port, ")");
  }

  c10::intrusive_ptr<c10d::Store> connect_store(bool server) const {
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<uint16_t>(env.master_port);
    opts.isServer = server;
    opts.numWorkers = static_cast<size_t>(env.world_size);
    opts.waitWorkers = false;  // our own join below names who is missing
    opts.timeout = options.timeout();
    c10::intrusive_ptr<c10d::Store> tcp;
    try {
      tcp = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "rank ", env.rank, ": cannot ", server ? "host" : "reach", " the rendezvous store at ",
                  env.master_addr, ":", env.master_port, " (hosted by ", store_host, ") within ",
                  seconds(options.timeout()), ": ", what(e),
                  server ? "; is the port in use? pick another MASTER_PORT"
                         : "; did it start, and are MASTER_ADDR/MASTER_PORT the same on every rank?");
    }
    // torchrun's agent store is shared by restarts: keys are per attempt, as torch.distributed does.
    const std::string prefix = env.use_agent_store ? c10::str("/worker/attempt_", env.restart_count, "/roundpipe/")
                                                   : std::string("roundpipe/");
    return c10::make_intrusive<c10d::PrefixStore>(prefix, tcp);
  }

  void heartbeat_loop() {
    const auto period = std::chrono::duration<double>(options.heartbeat_seconds());
    const std::string key = c10::str("hb/", env.rank);
    std::unique_lock<std::mutex> lock(beat_mutex);
    while (!stopping) {
      lock.unlock();
      try {
        beat_store->add(key, 1);
      } catch (const std::exception&) {
        // The store is gone (its host exited): failures are diagnosed by the collective's caller.
      }
      lock.lock();
      beat_cv.wait_for(lock, period, [&] { return stopping; });
    }
  }

  // Names the ranks that stopped beating (Note [Naming the missing rank]).
  std::string diagnose() const {
    if (parent) return parent->impl_->diagnose();
    if (!beat_thread.joinable()) return "";
    try {
      auto read = [&] {
        std::vector<int64_t> beats;
        for (int64_t r = 0; r < env.world_size; ++r) beats.push_back(store->add(c10::str("hb/", r), 0));
        return beats;
      };
      const auto before = read();
      std::this_thread::sleep_for(std::chrono::duration<double>(2.5 * options.heartbeat_seconds()));
      const auto after = read();
      std::vector<int64_t> gone;
      for (int64_t r = 0; r < env.world_size; ++r) {
        if (r != env.rank && after[r] == before[r]) gone.push_back(r);
      }
      if (gone.empty()) return "; every rank is still alive (a rank may be slow or stuck: raise the timeout?)";
      std::ostringstream out;
      out << "; rank" << (gone.size() > 1 ? "s " : " ");
      for (size_t k = 0; k < gone.size(); ++k) out << (k ? ", " : "") << gone[k];
      out << (gone.size() > 1 ? " have" : " has") << " stopped (no heartbeat): see that rank's log for its error";
      return out.str();
    } catch (const std::exception&) {
      return c10::str("; the rendezvous store does not answer either: ", store_host,
                      " (which hosts it) has exited: see its log for its error");
    }
  }

  [[noreturn]] void fail(const char* op, const std::exception& e) const {
    TORCH_CHECK(false, op, " failed on ", where(), ": ", what(e), diagnose());
  }

  // Joins the rendezvous: every rank sets join/<rank> and waits for the others' keys.
  void join() {
    store->set(c10::str("join/", env.rank), std::vector<uint8_t>{1});
    std::vector<std::string> keys;
    for (int64_t r = 0; r < env.world_size; ++r) keys.push_back(c10::str("join/", r));
    try {
      store->wait(keys, options.timeout());
    } catch (const std::exception& e) {
      std::ostringstream missing;
      try {
        for (int64_t r = 0; r < env.world_size; ++r) {
          if (!store->check({keys[r]})) missing << (missing.tellp() > 0 ? ", " : "") << r;
        }
      } catch (const std::exception&) {
        missing << "unknown (the store stopped answering)";
      }
      TORCH_CHECK(false, "rank ", env.rank, ": rendezvous at ", env.master_addr, ":", env.master_port,
                  " timed out after ", seconds(options.timeout()), ": rank(s) ", missing.str(),
                  " of WORLD_SIZE=", env.world_size,
                  " never arrived; start every rank (e.g. with roundpipe launch or torchrun) with the same ",
                  "MASTER_ADDR/MASTER_PORT, or raise the timeout");
    }
  }
};

ProcessGroup::ProcessGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ProcessGroup::~ProcessGroup() = default;

std::shared_ptr<ProcessGroup> ProcessGroup::from_env(const ProcessGroupOptions& options) {
  return create(LaunchEnv::from_env(), options);
}

// Connects `impl`'s backend (gloo or nccl) over `store`: every rank calls it with the same store
// prefix, which its keys are under.
static void connect_backend(ProcessGroup::Impl& impl, Backend backend, const c10::intrusive_ptr<c10d::Store>& store) {
  const LaunchEnv& env = impl.env;
  const ProcessGroupOptions& options = impl.options;
  try {
    if (backend == Backend::kGloo) {
      auto opts = c10d::ProcessGroupGloo::Options::create(options.timeout());
      const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
      if (ifname != nullptr && *ifname != '\0') {
        opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
      } else if (is_loopback(env.master_addr)) {
        opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      } else {
        opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
      }
      auto gloo_store = c10::make_intrusive<c10d::PrefixStore>("gloo/", store);
      impl.backend = c10::make_intrusive<c10d::ProcessGroupGloo>(gloo_store, static_cast<int>(env.rank),
                                                                 static_cast<int>(env.world_size), opts);
    } else {
      auto nccl_store = c10::make_intrusive<c10d::PrefixStore>("nccl/", store);
      impl.backend = detail::make_nccl_backend(nccl_store, env.rank, env.world_size, options.timeout());
    }
  } catch (const std::exception& e) {
    impl.fail("connecting the backend", e);
  }
}

std::shared_ptr<ProcessGroup> ProcessGroup::create(const LaunchEnv& env, const ProcessGroupOptions& options) {
  TORCH_CHECK(env.world_size >= 1 && env.rank >= 0 && env.rank < env.world_size, "ProcessGroup: rank ", env.rank,
              " must be in [0, world size ", env.world_size, ")");
  TORCH_CHECK(options.timeout().count() > 0, "ProcessGroupOptions::timeout must be > 0, got ",
              options.timeout().count(), " ms");
  TORCH_CHECK(options.heartbeat_seconds() >= 0, "ProcessGroupOptions::heartbeat_seconds must be >= 0, got ",
              options.heartbeat_seconds());
  Backend backend = options.backend();
  if (backend == Backend::kAuto) backend = options.device().is_cuda() ? Backend::kNccl : Backend::kGloo;
  TORCH_CHECK(backend != Backend::kNccl || options.device().is_cuda(),
              "ProcessGroupOptions: backend nccl needs a CUDA ", "device (ProcessGroupOptions::device), got ",
              options.device(), "; use Backend::kGloo for CPU");
  auto impl = std::make_unique<Impl>();
  impl->env = env;
  impl->options = options;
  impl->store_host = env.use_agent_store ? "torchrun's agent" : "rank 0";
  if (env.world_size == 1) return std::shared_ptr<ProcessGroup>(new ProcessGroup(std::move(impl)));

  impl->backend_kind = backend;
  const bool server = !env.use_agent_store && env.rank == 0;
  impl->store = impl->connect_store(server);
  impl->join();
  if (options.heartbeat_seconds() > 0) {
    impl->beat_store = impl->connect_store(false);
    impl->beat_thread = std::thread([raw = impl.get()] { raw->heartbeat_loop(); });
  }
  connect_backend(*impl, backend, impl->store);
  return std::shared_ptr<ProcessGroup>(new ProcessGroup(std::move(impl)));
}

std::shared_ptr<ProcessGroup> ProcessGroup::split() {
  auto impl = std::make_unique<Impl>();
  impl->env = impl_->env;
  impl->options = impl_->options;
  impl->store_host = impl_->store_host;
  impl->parent = shared_from_this();
  if (impl_->env.world_size == 1) return std::shared_ptr<ProcessGroup>(new ProcessGroup(std::move(impl)));
  impl->backend_kind = impl_->backend_kind;
  impl->store =
      c10::make_intrusive<c10d::PrefixStore>(c10::str("split/", impl_->splits.fetch_add(1), "/"), impl_->store);
  connect_backend(*impl, *impl->backend_kind, impl->store);
  return std::shared_ptr<ProcessGroup>(new ProcessGroup(std::move(impl)));
}

int64_t ProcessGroup::rank() const { return impl_->env.rank; }
int64_t ProcessGroup::world_size() const { return impl_->env.world_size; }
std::optional<Backend> ProcessGroup::backend() const { return impl_->backend_kind; }

const char* backend_name(Backend backend) {
  switch (backend) {
    case Backend::kAuto:
      return "auto";
    case Backend::kGloo:
      return "gloo";
    case Backend::kNccl:
      return "nccl";
  }
  return "?";
}
std::chrono::milliseconds ProcessGroup::timeout() const { return impl_->options.timeout(); }

namespace {

void check_host_tensor(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.defined() && t.device().is_cpu() && t.is_contiguous(), "ProcessGroup::", op,
              " takes a defined, contiguous CPU tensor, got ",
              t.defined() ? c10::str(t.device(), t.is_contiguous() ? "" : " non-contiguous") : "an undefined one");
}

}  // namespace

// Runs `launch` on the tensor as the backend needs it (CPU as is; staged through the CUDA device
// for nccl) and returns the Work that waits and copies the result back.
static Work run_collective(ProcessGroup::Impl& impl, const at::Tensor& tensor, const char* op,
                           const std::function<c10::intrusive_ptr<c10d::Work>(std::vector<at::Tensor>&)>& launch) {
  const bool staged = impl.options.device().is_cuda();
  std::vector<at::Tensor> buffers{tensor};
  c10::intrusive_ptr<c10d::Work> work;
  try {
    if (staged) {
      c10::DeviceGuard guard(impl.options.device());
      buffers[0] = tensor.to(impl.options.device());
    }
    work = launch(buffers);
  } catch (const std::exception& e) {
    impl.fail(op, e);
  }
  return Work([&impl, work, staged, tensor, buffers, op] {
    try {
      work->wait(impl.options.timeout());
      if (staged) {
        c10::DeviceGuard guard(impl.options.device());
        tensor.copy_(buffers[0]);
      }
    } catch (const std::exception& e) {
      impl.fail(op, e);
    }
  });
}

Work ProcessGroup::all_reduce(const at::Tensor& tensor, ReduceOp op) {
  check_host_tensor(tensor, "all_reduce");
  if (impl_->env.world_size == 1) return Work();
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(op);
  opts.timeout = impl_->options.timeout();
  auto& backend = impl_->backend;
  return run_collective(*impl_, tensor, "all_reduce",
                        [&](std::vector<at::Tensor>& t) { return backend->allreduce(t, opts); });
}

Work ProcessGroup::broadcast(const at::Tensor& tensor, int64_t root) {
  check_host_tensor(tensor, "broadcast");
  TORCH_CHECK(root >= 0 && root < impl_->env.world_size, "ProcessGroup::broadcast: root ", root,
              " is not a rank in [0, ", impl_->env.world_size, ")");
  if (impl_->env.world_size == 1) return Work();
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  opts.timeout = impl_->options.timeout();
  auto& backend = impl_->backend;
  return run_collective(*impl_, tensor, "broadcast",
                        [&](std::vector<at::Tensor>& t) { return backend->broadcast(t, opts); });
}

void ProcessGroup::barrier() {
  if (impl_->env.world_size == 1) return;
  // An all-reduce of one element: the same bound and diagnosis as every other collective.
  all_reduce(at::zeros({1}, at::kInt)).wait();
}

}  // namespace roundpipe::comm
