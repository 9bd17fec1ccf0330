#include "roundpipe/launcher/cli/generate.h"

#include <c10/util/Exception.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <utility>

#include "roundpipe/devices.h"
#include "roundpipe/launcher/atomic_file.h"
#include "roundpipe/launcher/cli/checkpoint.h"
#include "roundpipe/models/chat_template.h"
#include "roundpipe/models/generate.h"
#include "roundpipe/models/lora.h"
#include "roundpipe/models/pretrained.h"
#include "roundpipe/models/tokenizer.h"
#include "roundpipe/round_pipe.h"

namespace roundpipe::launcher {
namespace {

// The bytes a trailing incomplete UTF-8 character decodes to (Tokenizer::decode's U+FFFD).
constexpr const char* kReplacement = "\xEF\xBF\xBD";

std::string number(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

void check_options(const GenerateCommandOptions& o) {
  auto fail = [](const std::string& message) { throw ConfigError(message); };
  if (o.max_new_tokens < 1) fail("--max-new-tokens " + std::to_string(o.max_new_tokens) + ": must be at least 1");
  if (!std::isfinite(o.temperature) || o.temperature < 0) {
    fail("--temperature " + number(o.temperature) + ": must be finite and >= 0 (0 = greedy)");
  }
  if (!(o.top_p > 0 && o.top_p <= 1)) fail("--top-p " + number(o.top_p) + ": must be in (0, 1] (1 = off)");
  if (o.top_k < 0) fail("--top-k " + std::to_string(o.top_k) + ": must be >= 0 (0 = off)");
  if (o.batch_size < 1) fail("--batch-size " + std::to_string(o.batch_size) + ": must be at least 1");
}

// tokenizer_config.json's eos_token (a string or {"content": ...}); "" when none.
std::string eos_token_of(const std::string& dir) {
  const std::string path = join_path(dir, "tokenizer_config.json");
  if (!is_regular_file(path)) return "";
  std::ifstream in(path);
  const nlohmann::json json = nlohmann::json::parse(
      std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()), nullptr, false);
  if (!json.is_object() || !json.contains("eos_token")) return "";
  const nlohmann::json& eos = json["eos_token"];
  if (eos.is_string()) return eos.get<std::string>();
  if (eos.is_object() && eos.value("content", nlohmann::json()).is_string()) return eos["content"].get<std::string>();
  return "";
}

// The model, tokenizer, chat template and stop tokens of a generate or chat run.
struct Session {
  models::Pretrained pre;
  std::optional<models::Tokenizer> tokenizer;
  std::optional<models::ChatTemplate> chat_template;
  std::vector<int64_t> stop_ids;
  /// Set when generating through RoundPipe over run.devices (models::generate_batch_streamed);
  /// otherwise pre.model sits on the first device and generates with a KV cache.
  std::unique_ptr<RoundPipe> pipe;

  /// Whether `token` ends an answer (it is not printed).
  bool is_stop(int64_t token) const { return std::find(stop_ids.begin(), stop_ids.end(), token) != stop_ids.end(); }
};

// Streamed generation is chosen for a CUDA first device whose memory (run.device_memory_gib, else
// the GPU's) the parameters would fill past this share: the rest is for activations and the cache.
constexpr double kFitShare = 0.8;

int64_t parameter_bytes(const torch::nn::Module& model) {
  int64_t bytes = 0;
  for (const at::Tensor& p : model.parameters()) bytes += p.numel() * static_cast<int64_t>(p.element_size());
  return bytes;
}

// Why the model must be streamed over the devices ("" when it fits the first one).
std::string does_not_fit(const LauncherConfig& config, const torch::nn::Module& model, const c10::Device& device) {
  if (!device.is_cuda()) return "";
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  const int64_t memory = config.run.device_memory_gib
                             ? static_cast<int64_t>(*config.run.device_memory_gib * kGiB)
                             : cuda_device_memory_bytes(device.index() < 0 ? 0 : device.index());
  const int64_t bytes = parameter_bytes(model);
  if (memory <= 0 || static_cast<double>(bytes) <= kFitShare * static_cast<double>(memory)) return "";
  std::ostringstream why;
  why.precision(3);
  why << "the model's " << static_cast<double>(bytes) / kGiB << " GiB of parameters exceed " << kFitShare * 100
      << "% of " << device << "'s " << static_cast<double>(memory) / kGiB << " GiB";
  return why.str();
}

models::Pretrained load_weights(const LauncherConfig& config, const GenerateCommandOptions& options) {
  const auto load = models::LoadOptions().dtype(config.model.dtype);
  const std::string& ckpt = options.checkpoint;
  if (!ckpt.empty()) {
    if (is_lora_checkpoint_dir(ckpt)) {
      models::Pretrained pre = models::load_pretrained(config.model.pretrained, load);
      models::load_lora_adapter(pre.model, pre.config, ckpt);
      return pre;
    }
    if (!is_regular_file(join_path(ckpt, "config.json"))) {
      throw ConfigError("--checkpoint: '" + ckpt +
                        "' is not a checkpoint directory of `roundpipe train` (no "
                        "config.json, no adapter_config.json), e.g. runs/x/checkpoints/latest");
    }
    return models::load_pretrained(ckpt, load);
  }
  models::Pretrained pre = models::load_pretrained(config.model.pretrained, load);
  // As make_launcher_model: model.lora.adapter's weights over the base (a fresh adapter is a no-op).
  if (config.model.lora.has_value() && !config.model.lora->adapter.empty()) {
    models::load_lora_adapter(pre.model, pre.config, config.model.lora->adapter);
  }
  return pre;
}

Session open_session(const LauncherConfig& config, const GenerateCommandOptions& options, bool needs_template) {
  check_options(options);
  const std::string& dir = config.model.pretrained;
  if (dir.empty()) {
    throw ConfigError(
        "model.pretrained: generate and chat need a model directory (its tokenizer.json and chat "
        "template); a model.preset has none");
  }
  Session s;
  try {
    s.tokenizer = models::Tokenizer::from_file(join_path(dir, "tokenizer.json"));
    if (needs_template) s.chat_template = models::ChatTemplate::from_model_dir(dir);
  } catch (const std::exception& e) {  // a file of the model directory; the message names it
    throw ConfigError(std::string("model.pretrained: ") + e.what() +
                      (needs_template ? " (--raw tokenizes the prompt without a chat template)" : ""));
  }
  s.pre = load_weights(config, options);
  if (s.tokenizer->vocab_size() > s.pre.config.vocab_size) {
    throw ConfigError("model.pretrained: " + join_path(dir, "tokenizer.json") + " has " +
                      std::to_string(s.tokenizer->vocab_size()) + " token ids but the model's vocab_size is " +
                      std::to_string(s.pre.config.vocab_size) + ": the tokenizer does not belong to this model");
  }
  const std::vector<c10::Device> devices = config.run.devices.value_or(default_devices());
  const std::string reason = devices.empty() ? "" : does_not_fit(config, *s.pre.model, devices.front());
  if (options.streamed || !reason.empty()) {
    std::cerr << "generating through RoundPipe over " << devices.size() << " device(s), no KV cache ("
              << (options.streamed ? std::string("--streamed") : reason) << ")\n";
    s.pipe = std::make_unique<RoundPipe>(s.pre.model, RoundPipeOptions().devices(devices).name("generate"));
  } else if (!devices.empty()) {
    s.pre.model->to(devices.front());
  }
  s.stop_ids = s.pre.config.eos_token_id;
  const std::string eos = eos_token_of(dir);
  if (!eos.empty()) {
    if (std::optional<int64_t> id = s.tokenizer->token_to_id(eos)) s.stop_ids.push_back(*id);
  }
  return s;
}

// Prints decoded text as tokens come, whole UTF-8 characters only: a trailing incomplete character
// (decoded as U+FFFD) waits for the token that completes it.
class TextStream {
 public:
  TextStream(const models::Tokenizer& tokenizer, std::ostream& out) : tokenizer_(tokenizer), out_(out) {}

  void add(int64_t id) {
    ids_.push_back(id);
    emit(/*all=*/false);
  }
  void finish() { emit(/*all=*/true); }
  const std::vector<int64_t>& ids() const { return ids_; }

 private:
  void emit(bool all) {
    const std::string text = tokenizer_.decode(ids_);
    size_t end = text.size();
    if (!all) {
      while (end >= 3 && text.compare(end - 3, 3, kReplacement) == 0) end -= 3;
    }
    if (end > printed_) {
      out_ << text.substr(printed_, end - printed_) << std::flush;
      printed_ = end;
    }
  }

  const models::Tokenizer& tokenizer_;
  std::ostream& out_;
  std::vector<int64_t> ids_;
  size_t printed_ = 0;
};

struct Answer {
  std::vector<int64_t> ids;  // as generated, the stop token included
  std::string text;          // without the stop token
};

void check_prompt(const Session& s, const std::vector<int64_t>& prompt) {
  if (prompt.empty()) throw ConfigError("--prompt: the prompt is empty (no tokens to start from)");
  const int64_t limit = s.pre.config.max_position_embeddings;
  if (static_cast<int64_t>(prompt.size()) >= limit) {
    throw ConfigError("--prompt: the prompt is " + std::to_string(prompt.size()) +
                      " tokens, but the model's max_position_embeddings is " + std::to_string(limit) +
                      ": shorten it (or /reset the conversation)");
  }
}

models::GenerateOptions generate_options(const Session& s, const GenerateCommandOptions& options, uint64_t seed) {
  return models::GenerateOptions()
      .max_new_tokens(options.max_new_tokens)
      .temperature(options.temperature)
      .top_p(options.top_p)
      .top_k(options.top_k)
      .seed(seed)
      .stop_token_ids(s.stop_ids);
}

// Answers `prompts` (checked by the caller: check_prompt) in one batch: prompt 0's answer streams
// to `out`; the others are returned for the caller to print. Each answer's text is without its
// stop token.
std::vector<Answer> answer_batch(Session& s, const std::vector<std::vector<int64_t>>& prompts,
                                 const GenerateCommandOptions& options, uint64_t seed, std::ostream& out) {
  TextStream stream(*s.tokenizer, out);
  std::vector<std::vector<int64_t>> texts(prompts.size());
  auto on_token = [&](int64_t row, int64_t token) {
    if (s.is_stop(token)) return;
    if (row == 0) {
      stream.add(token);
    } else {
      texts[static_cast<size_t>(row)].push_back(token);
    }
  };
  const models::GenerateOptions generate = generate_options(s, options, seed);
  std::vector<std::vector<int64_t>> ids =
      s.pipe ? models::generate_batch_streamed(*s.pipe, s.pre.config, prompts, generate, on_token)
             : models::generate_batch(s.pre.model, s.pre.config, prompts, generate, on_token);
  stream.finish();
  texts[0] = stream.ids();
  std::vector<Answer> answers(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    answers[i].ids = std::move(ids[i]);
    answers[i].text = s.tokenizer->decode(texts[i]);
  }
  return answers;
}

Answer answer(Session& s, const std::vector<int64_t>& prompt, const GenerateCommandOptions& options, uint64_t seed,
              std::ostream& out) {
  return std::move(answer_batch(s, {prompt}, options, seed, out).front());
}

// Note [Chat cache]: chat keeps the KV cache of the conversation between turns. Each turn's
// prompt (the whole conversation rendered again) usually starts with the ids the cache holds; the
// cache is truncated to the common prefix (at most the prompt minus one token, which must be fed)
// and only the rest runs, so a turn costs its new tokens, not the whole conversation. Where the
// template renders earlier turns differently (e.g. Qwen3 drops old reasoning) the common prefix is
// shorter; where a sliding-window layer no longer holds what the prefix needs, it starts over.
struct Conversation {
  explicit Conversation(const models::ModelConfig& config) : cache(config) {}
  void forget() {
    cache.clear();
    held.clear();
  }
  models::KvCache cache;
  std::vector<int64_t> held;  // the ids whose keys and values the cache holds
};

Answer answer_cached(Session& s, Conversation& c, const std::vector<int64_t>& prompt,
                     const GenerateCommandOptions& options, uint64_t seed, std::ostream& out) {
  const auto mismatch = std::mismatch(c.held.begin(), c.held.end(), prompt.begin(), prompt.end());
  const auto common = std::min<int64_t>(mismatch.first - c.held.begin(), static_cast<int64_t>(prompt.size()) - 1);
  if (!c.cache.truncate(common, s.pre.config)) c.forget();
  const int64_t kept = c.cache.length();
  c.held.resize(static_cast<size_t>(kept));
  const std::vector<int64_t> rest(prompt.begin() + kept, prompt.end());
  TextStream stream(*s.tokenizer, out);
  Answer a;
  a.ids = models::generate(s.pre.model, s.pre.config, c.cache, rest, generate_options(s, options, seed),
                           [&](int64_t token) {
                             if (!s.is_stop(token)) stream.add(token);
                           });
  stream.finish();
  a.text = s.tokenizer->decode(stream.ids());
  c.held.insert(c.held.end(), rest.begin(), rest.end());
  c.held.insert(c.held.end(), a.ids.begin(), a.ids.end() - 1);  // the last one was never fed
  return a;
}

void print_ids(const std::vector<int64_t>& ids, std::ostream& out) {
  out << "ids:";
  for (int64_t id : ids) out << " " << id;
  out << "\n";
}

}  // namespace

void run_generate(const LauncherConfig& config, const std::vector<std::string>& prompts,
                  const GenerateCommandOptions& options, std::ostream& out) {
  if (prompts.empty()) throw ConfigError("--prompt: give at least one prompt");
  Session s = open_session(config, options, /*needs_template=*/!options.raw);
  std::vector<std::vector<int64_t>> tokenized;
  for (const std::string& prompt : prompts) {
    if (options.raw) {
      tokenized.push_back(s.tokenizer->encode(prompt, /*add_special_tokens=*/true));
    } else {
      nlohmann::ordered_json messages = nlohmann::ordered_json::array();
      messages.push_back({{"role", "user"}, {"content", prompt}});
      models::ChatRenderOptions render;
      render.add_generation_prompt = true;
      tokenized.push_back(s.tokenizer->encode(s.chat_template->render(messages, render).text));
    }
    check_prompt(s, tokenized.back());  // before any answer: a bad prompt costs no generation
  }
  const auto batch = static_cast<size_t>(options.batch_size);
  for (size_t first = 0; first < tokenized.size(); first += batch) {
    const size_t end = std::min(tokenized.size(), first + batch);
    if (first > 0) out << "\n";
    const std::vector<Answer> answers =
        answer_batch(s,
                     std::vector<std::vector<int64_t>>(tokenized.begin() + static_cast<std::ptrdiff_t>(first),
                                                       tokenized.begin() + static_cast<std::ptrdiff_t>(end)),
                     options, options.seed, out);
    for (size_t i = 0; i < answers.size(); ++i) {
      if (i > 0) out << "\n" << answers[i].text;
      out << "\n";
      if (options.print_ids) print_ids(answers[i].ids, out);
    }
  }
}

void run_chat(const LauncherConfig& config, const GenerateCommandOptions& options, std::istream& in,
              std::ostream& out) {
  if (options.raw) throw ConfigError("--raw: chat always renders the conversation with the chat template");
  Session s = open_session(config, options, /*needs_template=*/true);
  const bool interactive = ::isatty(STDIN_FILENO) != 0;
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  Conversation conversation(s.pre.config);
  uint64_t turn = 0;
  std::string line;
  for (;;) {
    if (interactive) out << "> " << std::flush;
    if (!std::getline(in, line)) break;
    if (line == "/exit") break;
    if (line == "/reset") {
      messages = nlohmann::ordered_json::array();
      conversation.forget();
      out << "(conversation reset)\n";
      continue;
    }
    if (line.empty()) continue;
    messages.push_back({{"role", "user"}, {"content", line}});
    models::ChatRenderOptions render;
    render.add_generation_prompt = true;
    const std::vector<int64_t> ids = s.tokenizer->encode(s.chat_template->render(messages, render).text);
    if (static_cast<int64_t>(ids.size()) >= s.pre.config.max_position_embeddings) {
      // The conversation outgrew the model: say so and let the user /reset, without ending the chat.
      messages.erase(messages.size() - 1);
      out << "(the conversation is " << ids.size() << " tokens, the model's max_position_embeddings is "
          << s.pre.config.max_position_embeddings << ": /reset to start a new one)\n";
      continue;
    }
    const Answer a = s.pipe ? answer(s, ids, options, options.seed + turn, out)
                            : answer_cached(s, conversation, ids, options, options.seed + turn, out);
    ++turn;
    out << "\n";
    if (options.print_ids) print_ids(a.ids, out);
    messages.push_back({{"role", "assistant"}, {"content", a.text}});
  }
}

}  // namespace roundpipe::launcher
