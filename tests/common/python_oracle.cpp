#include "tests/common/python_oracle.h"

#include <torch/serialize.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <unistd.h>
#include <sstream>
#include <stdexcept>

#include "tests/common/test_config.h"

namespace roundpipe::testing {
namespace {

// Note [No std::filesystem here]: the PyPI libtorch.so exports its own copies of some
// std::filesystem symbols (built against another libstdc++); calling e.g. remove_all from a
// binary linked to it jumps to a null pointer. Plain POSIX calls avoid that.
std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::string make_temp_dir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/roundpipe_oracle_XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) {
    throw std::runtime_error("run_python: cannot create a temporary directory " + pattern);
  }
  return pattern;
}

constexpr const char* kFiles[] = {"inputs.pt", "outputs.pt", "snippet.py", "log.txt"};

constexpr const char* kPrologue = R"PY(
import sys, torch
inputs = torch.load(sys.argv[1], weights_only=False)  # our own file, written by torch::pickle_save
outputs = {}
)PY";

constexpr const char* kEpilogue = R"PY(
def _as_tensor(k, v):
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().contiguous()
    if isinstance(v, bool):
        return torch.tensor(v)
    if isinstance(v, (int, float)):
        return torch.tensor(float(v), dtype=torch.float64)
    raise TypeError(f"outputs[{k!r}] is a {type(v).__name__}; only tensors and numbers can be returned")
torch.save({k: _as_tensor(k, v) for k, v in outputs.items()}, sys.argv[2])
)PY";

}  // namespace

bool python_oracle_available() {
  static const bool available = [] {
    const std::string cmd = std::string("\"") + ROUNDPIPE_TEST_PYTHON + "\" -c 'import torch' >/dev/null 2>&1";
    return std::string(ROUNDPIPE_TEST_PYTHON).size() > 0 && std::system(cmd.c_str()) == 0;
  }();
  return available;
}

TensorMap run_python(const std::string& snippet, const TensorMap& inputs) {
  const std::string dir = make_temp_dir();
  auto file = [&](const char* name) { return dir + "/" + name; };
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      for (const char* name : kFiles) ::unlink((dir + "/" + name).c_str());
      ::rmdir(dir.c_str());
    }
  } cleanup{dir};

  c10::Dict<std::string, at::Tensor> in_dict;
  for (const auto& [name, tensor] : inputs) in_dict.insert(name, tensor.detach().cpu().contiguous());
  const std::vector<char> in_bytes = torch::pickle_save(in_dict);
  {
    std::ofstream out(file("inputs.pt"), std::ios::binary);
    out.write(in_bytes.data(), static_cast<std::streamsize>(in_bytes.size()));
  }
  {
    std::ofstream script(file("snippet.py"));
    script << kPrologue << snippet << "\n" << kEpilogue;
  }
  const std::string cmd = std::string("\"") + ROUNDPIPE_TEST_PYTHON + "\" \"" + file("snippet.py") +
                          "\" \"" + file("inputs.pt") + "\" \"" + file("outputs.pt") +
                          "\" > \"" + file("log.txt") + "\" 2>&1";
  const int rc = std::system(cmd.c_str());
  if (rc != 0) {
    throw std::runtime_error("run_python: the Python oracle failed (exit " + std::to_string(rc) +
                             "):\n" + read_file(file("log.txt")) + "\nsnippet:\n" + snippet);
  }
  const std::string out_bytes = read_file(file("outputs.pt"));
  const c10::IValue value = torch::pickle_load(std::vector<char>(out_bytes.begin(), out_bytes.end()));
  TensorMap result;
  for (const auto& entry : value.toGenericDict()) {
    result.emplace(entry.key().toStringRef(), entry.value().toTensor());
  }
  return result;
}

}  // namespace roundpipe::testing
