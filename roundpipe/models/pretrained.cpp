// load_pretrained / save_pretrained: transformers checkpoint directories through the safetensors
// reader and writer (safetensors.h).
#include "roundpipe/models/pretrained.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <map>
#include <set>
#include <sys/stat.h>
#include <unistd.h>

#include "roundpipe/models/detail/expert_layout.h"
#include "roundpipe/models/detail/files.h"
#include "roundpipe/models/detail/mxfp4.h"
#include "roundpipe/models/safetensors.h"
#include "roundpipe/round_pipe.h"

namespace roundpipe::models {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

namespace detail {

// Writes `text` to `path` atomically (temporary file, fsync, rename).
void write_text_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "cannot create ", tmp, ": ", std::strerror(errno));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      TORCH_CHECK(false, "cannot write ", tmp, ": ", std::strerror(err));
    }
    done += static_cast<size_t>(n);
  }
  const bool synced = ::fsync(fd) == 0;
  const int err = errno;
  ::close(fd);
  if (!synced || ::rename(tmp.c_str(), path.c_str()) != 0) {
    const int rename_err = synced ? errno : err;
    ::unlink(tmp.c_str());
    TORCH_CHECK(false, "cannot write ", path, ": ", std::strerror(rename_err));
  }
}

void make_directory(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0755) == 0) return;
  const int err = errno;
  struct stat st {};
  TORCH_CHECK(err == EEXIST && ::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode), "cannot create directory ",
              dir, ": ", std::strerror(err), " (its parent must exist)");
}


}  // namespace detail

using detail::make_directory;
using detail::write_text_atomically;

Pretrained load_pretrained(const std::string& hf_dir, const LoadOptions& options) {
  ModelConfig config = load_model_config(hf_dir + "/config.json");
  const c10::ScalarType dtype = options.dtype().value_or(config.dtype.value_or(at::kFloat));
  TORCH_CHECK(at::isFloatingType(dtype), "LoadOptions::dtype = ", dtype, " is not a floating-point dtype");
  const CheckpointReader reader = CheckpointReader::open(hf_dir);
  torch::nn::Sequential model = make_model(config, at::TensorOptions().dtype(dtype).device(options.device()));

  // Every tensor of the checkpoint must be used: a leftover means the config and the weights
  // disagree (e.g. a Qwen3 checkpoint read as Llama leaves q_norm/k_norm unused). Expert weights
  // may be stored fused or per expert (detail/expert_layout.h).
  std::set<std::string> expected;
  for (const auto& [name, tensor] : hf_state_dict(model, config)) {
    expected.insert(name);
    for (const std::string& part : detail::per_expert_names(name, config)) expected.insert(part);
    for (const std::string& part : detail::mxfp4_names(name, config)) expected.insert(part);
  }
  std::vector<std::string> unexpected;
  for (const auto& name : reader.names()) {
    if (expected.count(name) != 0 || ends_with(name, ".rotary_emb.inv_freq")) continue;
    if (config.tie_word_embeddings && name == "lm_head.weight") continue;  // some tied checkpoints store it
    unexpected.push_back(name);
  }
  if (!unexpected.empty()) {
    std::string list;
    for (size_t i = 0; i < unexpected.size() && i < 8; ++i) list += (i ? ", \"" : "\"") + unexpected[i] + "\"";
    if (unexpected.size() > 8) list += ", ... (" + std::to_string(unexpected.size()) + " in all)";
    TORCH_CHECK(false, hf_dir, ": the checkpoint has tensors that the ", model_type_name(config.architecture),
                " model of its config.json does not use: ", list,
                " (is model_type right? Supported: ", model_type_list(), ")");
  }
  // Note [Releasing mapped pages]: each tensor's mapped pages are dropped once it has been copied
  // (when the next one is asked for, and after the last), so the peak resident set is the model
  // plus about one tensor, not the model plus the whole checkpoint.
  std::vector<std::string> copied;
  auto release = [&] {
    for (const std::string& name : copied) reader.release_pages(name);
    copied.clear();
  };
  load_hf_state_dict(model, config, [&](const std::string& name) {
    release();
    if (reader.contains(name)) {
      copied = {name};
      return reader.get(name);
    }
    const std::vector<std::string> packed = detail::mxfp4_names(name, config);
    if (!packed.empty() && reader.contains(packed[0]) && reader.contains(packed[1])) {
      // gpt-oss's released MXFP4 experts, dequantized as transformers' Mxfp4Config(dequantize=True).
      copied = packed;
      return detail::dequantize_mxfp4(reader.get(packed[0]), reader.get(packed[1]), dtype);
    }
    const std::vector<std::string> parts = detail::per_expert_names(name, config);
    if (parts.empty()) return at::Tensor();
    std::vector<at::Tensor> tensors;
    for (const std::string& part : parts) {
      TORCH_CHECK(reader.contains(part), hf_dir, ": the checkpoint has neither \"", name, "\" (fused experts) nor \"",
                  part, "\" (one tensor per expert)");
      tensors.push_back(reader.get(part));
    }
    copied = parts;
    return detail::assemble_experts(name, tensors, config);
  });
  release();
  return {model, config};
}

namespace {

// config.json + safetensors of `tensors` (HF names) into `hf_dir`.
void write_hf_dir(std::vector<std::pair<std::string, at::Tensor>> tensors, const ModelConfig& config,
                  const std::string& hf_dir, const SaveOptions& options) {
  TORCH_CHECK(options.max_shard_bytes() > 0, "SaveOptions::max_shard_bytes = ", options.max_shard_bytes(),
              " must be positive");
  TORCH_CHECK(!tensors.empty(), "save_pretrained: the model has no parameters to save");
  ModelConfig saved = config;
  saved.dtype = options.dtype() ? options.dtype() : std::optional<c10::ScalarType>(tensors.front().second.scalar_type());
  dtype_name(*saved.dtype);  // fails for a dtype HF cannot name
  if (options.dtype()) {
    for (auto& [name, tensor] : tensors) tensor = tensor.to(*options.dtype());
  }
  make_directory(hf_dir);
  ShardOptions shard;
  shard.max_shard_bytes = options.max_shard_bytes();
  save_checkpoint(hf_dir, detail::to_per_expert_layout(std::move(tensors), config), shard);
  write_text_atomically(hf_dir + "/config.json", to_json(saved));
}

}  // namespace

void save_pretrained(const torch::nn::Sequential& model, const ModelConfig& config, const std::string& hf_dir,
                     const SaveOptions& options) {
  write_hf_dir(hf_state_dict(model, config), config, hf_dir, options);
}

void save_pretrained(RoundPipe& model, const ModelConfig& config, const std::string& hf_dir,
                     const SaveOptions& options) {
  model.synchronize();
  // The compute copies give the layout (and the values of frozen parameters, which have no
  // master); every parameter with a master is saved from it. A tied lm_head.weight is the
  // embedding's parameter, listed once as model.embed_tokens.weight.
  auto tensors = hf_state_dict(model.module(), config);
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < tensors.size(); ++i) index[tensors[i].first] = i;
  for (const auto& [name, master] : model.optim_named_parameters()) {
    const std::string hf = hf_parameter_name(name, config.num_hidden_layers);
    auto it = index.find(hf);
    TORCH_CHECK(it != index.end(), "save_pretrained: RoundPipe's master weight '", name, "' (", hf,
                ") is not in the model's HF state dict");
    TORCH_CHECK(tensors[it->second].second.sizes() == master.sizes(), "save_pretrained: master weight '", hf,
                "' has shape ", master.sizes(), " but the model's parameter has ", tensors[it->second].second.sizes());
    tensors[it->second].second = master.detach();
  }
  write_hf_dir(std::move(tensors), config, hf_dir, options);
}

}  // namespace roundpipe::models
