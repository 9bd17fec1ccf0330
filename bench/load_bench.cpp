// Checkpoint load speed and memory at ~1B parameters: roundpipe::models::load_pretrained into
// bf16 and into fp32, against reading the same files with `cat` and against transformers'
// from_pretrained (docs/models.md, "Loading speed and memory").
//
//   build/bench/load_bench [--dir DIR] [--keep] [--python PY] [--layers N]
//
// Writes a Llama-3.2-1B-shaped checkpoint (1.24B parameters, bf16, tied embeddings, 1 GiB shards
// + model.safetensors.index.json; 2.47 GB) into DIR (default /tmp/roundpipe_load_bench, deleted
// at the end unless --keep; an existing checkpoint there is reused), then runs every measurement
// in a fresh child process: wall time of the load alone (inside the child, after its libraries are
// loaded), GB/s = checkpoint bytes / that time (1 GB = 1e9 B), and the child's peak RSS
// (getrusage ru_maxrss via wait4), which counts the checkpoint's mapped pages too.
//
// "cold": the checkpoint's pages are first evicted from the page cache with
// posix_fadvise(POSIX_FADV_DONTNEED) on each file (no global drop_caches), so the read comes from
// the disk; "warm": right after a read of the same files. --python PY (default the configured
// ROUNDPIPE_PYTHON) runs transformers' from_pretrained; --python "" skips it.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "roundpipe/models/model_config.h"
#include "roundpipe/models/pretrained.h"

#ifndef ROUNDPIPE_PYTHON_DEFAULT
#define ROUNDPIPE_PYTHON_DEFAULT ""
#endif

namespace {

namespace rm = roundpipe::models;

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Llama-3.2-1B's shape (meta-llama/Llama-3.2-1B config.json); `layers` may shrink it.
std::string llama_1b_config(int64_t layers) {
  return R"({"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
             "num_hidden_layers": )" + std::to_string(layers) + R"(, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
             "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": true,
             "dtype": "bfloat16"})";
}

std::vector<std::string> checkpoint_files(const std::string& dir) {
  std::vector<std::string> files;
  DIR* handle = ::opendir(dir.c_str());
  TORCH_CHECK(handle != nullptr, "cannot list ", dir);
  while (dirent* e = ::readdir(handle)) {
    const std::string name = e->d_name;
    if (name.size() > 12 && name.compare(name.size() - 12, 12, ".safetensors") == 0) files.push_back(dir + "/" + name);
  }
  ::closedir(handle);
  return files;
}

int64_t file_bytes(const std::vector<std::string>& files) {
  int64_t total = 0;
  for (const auto& f : files) {
    struct stat st {};
    if (::stat(f.c_str(), &st) == 0) total += st.st_size;
  }
  return total;
}

void evict(const std::vector<std::string>& files) {
  for (const auto& f : files) {
    int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

struct Measurement {
  double seconds = -1;  // reported by the child (its own timer); < 0: the child's wall time
  double peak_rss_gb = 0;
  bool ok = false;
};

// Runs argv in a child; its stdout's last number is the measured seconds (when `timed`).
Measurement run_child(const std::vector<std::string>& argv, bool timed) {
  int pipe_fd[2];
  TORCH_CHECK(::pipe(pipe_fd) == 0, "pipe failed");
  const double start = now_s();
  pid_t pid = ::fork();
  TORCH_CHECK(pid >= 0, "fork failed");
  if (pid == 0) {
    ::dup2(pipe_fd[1], 1);
    ::close(pipe_fd[0]);
    ::close(pipe_fd[1]);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execvp(args[0], args.data());
    std::perror("execvp");
    ::_exit(127);
  }
  ::close(pipe_fd[1]);
  std::string out;
  char buffer[4096];
  for (ssize_t n; (n = ::read(pipe_fd[0], buffer, sizeof(buffer))) > 0;) out.append(buffer, static_cast<size_t>(n));
  ::close(pipe_fd[0]);
  int status = 0;
  struct rusage usage {};
  ::wait4(pid, &status, 0, &usage);
  Measurement m;
  m.ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  m.peak_rss_gb = static_cast<double>(usage.ru_maxrss) * 1024.0 / 1e9;  // ru_maxrss is in KiB
  m.seconds = now_s() - start;
  if (timed) {
    const size_t pos = out.find("seconds=");
    m.ok = m.ok && pos != std::string::npos;
    if (pos != std::string::npos) m.seconds = std::atof(out.c_str() + pos + 8);
  }
  if (!m.ok) std::fprintf(stderr, "child %s failed (status %d): %s\n", argv[0].c_str(), status, out.c_str());
  return m;
}

int child_load(const std::string& dir, const std::string& dtype) {
  const double start = now_s();
  rm::Pretrained pre = rm::load_pretrained(dir, rm::LoadOptions().dtype(dtype == "fp32" ? at::kFloat : at::kBFloat16));
  const double seconds = now_s() - start;
  int64_t numel = 0;
  for (const auto& p : rm::unique_parameters(*pre.model)) numel += p.numel();
  std::printf("params=%lld seconds=%.6f\n", static_cast<long long>(numel), seconds);
  return 0;
}

void write_checkpoint(const std::string& dir, int64_t layers) {
  rm::ModelConfig config = rm::parse_model_config(llama_1b_config(layers));
  torch::nn::Sequential model = rm::make_model(config, at::TensorOptions().dtype(at::kBFloat16));
  {
    at::NoGradGuard no_grad;
    at::manual_seed(0);
    for (auto& p : rm::unique_parameters(*model)) p.uniform_(-0.02, 0.02);
  }
  ::mkdir(dir.c_str(), 0755);
  rm::save_pretrained(model, config, dir, rm::SaveOptions().max_shard_bytes(int64_t{1} << 30));
}

void remove_dir(const std::string& dir) {
  DIR* handle = ::opendir(dir.c_str());
  if (handle == nullptr) return;
  while (dirent* e = ::readdir(handle)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") ::unlink((dir + "/" + name).c_str());
  }
  ::closedir(handle);
  ::rmdir(dir.c_str());
}

// `gb`: bytes read (0: not a load, no GB/s); `model_gb`: the loaded model's size in its dtype (0:
// none); `baseline_gb`: the peak RSS of the same kind of process doing nothing.
void print_row(const char* what, const Measurement& m, double gb, double model_gb, double baseline_gb) {
  if (!m.ok) {
    std::printf("| %-36s | failed | | | |\n", what);
    return;
  }
  char rate[32] = "-", ratio[64] = "-";
  if (gb > 0) std::snprintf(rate, sizeof(rate), "%.2f", gb / m.seconds);
  if (model_gb > 0) {
    std::snprintf(ratio, sizeof(ratio), "%.2f GB = %.2f x", m.peak_rss_gb - baseline_gb,
                  (m.peak_rss_gb - baseline_gb) / model_gb);
  }
  std::printf("| %-36s | %7.2f | %6s | %6.2f | %s |\n", what, m.seconds, rate, m.peak_rss_gb, ratio);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = "/tmp/roundpipe_load_bench";
  std::string python = ROUNDPIPE_PYTHON_DEFAULT;
  bool keep = false;
  int64_t layers = 16;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--child-load" && i + 2 < argc) return child_load(argv[i + 1], argv[i + 2]);
    if (a == "--child-noop") {
      std::printf("seconds=0\n");
      return 0;
    }
    if (a == "--dir" && i + 1 < argc) {
      dir = argv[++i];
    } else if (a == "--python" && i + 1 < argc) {
      python = argv[++i];
    } else if (a == "--layers" && i + 1 < argc) {
      layers = std::atoll(argv[++i]);
    } else if (a == "--keep") {
      keep = true;
    } else {
      std::fprintf(stderr, "usage: load_bench [--dir DIR] [--keep] [--python PY] [--layers N]\n");
      return 2;
    }
  }
  const std::string self = "/proc/self/exe";
  char self_path[4096];
  const ssize_t len = ::readlink(self.c_str(), self_path, sizeof(self_path) - 1);
  TORCH_CHECK(len > 0, "cannot read /proc/self/exe");
  self_path[len] = '\0';

  struct stat st {};
  if (::stat((dir + "/config.json").c_str(), &st) != 0) {
    const double start = now_s();
    write_checkpoint(dir, layers);
    std::printf("wrote %s in %.1f s\n", dir.c_str(), now_s() - start);
  }
  const std::vector<std::string> files = checkpoint_files(dir);
  const double gb = static_cast<double>(file_bytes(files)) / 1e9;
  std::printf("checkpoint: %s, %zu safetensors files, %.3f GB (bf16)\n\n", dir.c_str(), files.size(), gb);
  std::printf("| %-36s | wall s | GB/s | peak RSS GB | peak RSS over the baseline = x model size |\n",
              "step (each in a fresh process)");
  std::printf("|---|---|---|---|---|\n");
  const double bf16_gb = gb, fp32_gb = 2 * gb;  // the model's size in the target dtype

  auto cat_to_null = [&] {
    // cat FILES > /dev/null through sh, timed by the child's wall time.
    std::string cmd = "exec cat";
    for (const auto& f : files) cmd += " '" + f + "'";
    cmd += " > /dev/null";
    return run_child({"sh", "-c", cmd}, false);
  };
  evict(files);
  print_row("cat > /dev/null, cold", cat_to_null(), gb, 0, 0);
  print_row("cat > /dev/null, warm", cat_to_null(), gb, 0, 0);
  const Measurement baseline = run_child({self_path, "--child-noop"}, false);
  print_row("baseline: this process, no load", baseline, 0, 0, 0);
  const std::vector<std::string> load_bf16 = {self_path, "--child-load", dir, "bf16"};
  const std::vector<std::string> load_fp32 = {self_path, "--child-load", dir, "fp32"};
  evict(files);
  print_row("load_pretrained -> bf16, cold", run_child(load_bf16, true), gb, bf16_gb, baseline.peak_rss_gb);
  print_row("load_pretrained -> bf16, warm", run_child(load_bf16, true), gb, bf16_gb, baseline.peak_rss_gb);
  evict(files);
  print_row("load_pretrained -> fp32, cold", run_child(load_fp32, true), gb, fp32_gb, baseline.peak_rss_gb);
  print_row("load_pretrained -> fp32, warm", run_child(load_fp32, true), gb, fp32_gb, baseline.peak_rss_gb);
  if (!python.empty()) {
    const std::string script =
        "import sys, time, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "from transformers.utils import logging\n"
        "logging.disable_progress_bar()\n"
        "if sys.argv[1] == 'none':\n"
        "    print('seconds=0'); sys.exit(0)\n"
        "dtype = torch.bfloat16 if sys.argv[1] == 'bf16' else torch.float32\n"
        "t = time.perf_counter()\n"
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=dtype)\n"
        "print('seconds=%.6f' % (time.perf_counter() - t))\n"
        "# Weights still backed by the file mapping count in RSS only once read: read them all.\n"
        "with torch.no_grad():\n"
        "    for p in m.parameters(): p.sum()\n";
    const Measurement py = run_child({python, "-c", script, "none", dir}, false);
    print_row("baseline: python, import transformers", py, 0, 0, 0);
    print_row("transformers from_pretrained -> bf16", run_child({python, "-c", script, "bf16", dir}, true), gb,
              bf16_gb, py.peak_rss_gb);
    print_row("transformers from_pretrained -> fp32", run_child({python, "-c", script, "fp32", dir}, true), gb,
              fp32_gb, py.peak_rss_gb);
  }
  if (!keep) remove_dir(dir);
  return 0;
}
