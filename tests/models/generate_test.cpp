// models::generate against transformers: greedy generation equals model.generate(do_sample=False)
// token for token on tiny random models of every preset (sliding windows shorter than the
// sequence, gpt-oss sinks and alternating layers, mixtures of experts); the KV-cached logits of
// every step equal a full forward without cache; the sampling filter equals transformers' own
// temperature / top-k / top-p warpers on the same logits; same seed, same tokens; bad options fail.
#include "roundpipe/models/generate.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <vector>

#include "roundpipe/models/pretrained.h"
#include "roundpipe/round_pipe.h"
#include "roundpipe/side_inputs.h"
#include "tests/common/python_oracle.h"
#include "tests/common/tensor_compare.h"
#include "tests/common/test_macros.h"
#include "tests/models/hf_oracle.h"

namespace roundpipe::testing {
namespace {

using models::CachedLogits;
using models::GenerateOptions;

struct GenerateSpec {
  std::string config_class;
  std::string kwargs;  ///< Python dict literal
  int64_t prompt = 8;
  int64_t new_tokens = 16;
};

// Builds the model in transformers with weights large enough that the logits are peaky (the seed
// is the first whose greedy steps all have a top-1 / top-2 margin >= 1e-3 and, for mixtures of
// experts, whose routing margins on the real tokens are >= 1e-4, so rounding cannot pick another
// token or expert), saves it, and generates greedily with no eos from inputs 'ids' [B, L] and
// 'mask' [B, L] (0 on left padding; transformers then takes the positions from the mask's cumsum
// and masks the padding keys); the margins are the smallest over every row and step.
std::string oracle_snippet(const GenerateSpec& spec, const std::string& dir) {
  return "from transformers import AutoModelForCausalLM, " + spec.config_class +
         "\n"
         "cfg = " +
         spec.config_class + "(**" + spec.kwargs +
         ")\n"
         "ids, mask = inputs['ids'], inputs['mask']\n"
         "for seed in range(30):\n"
         "    torch.manual_seed(seed)\n"
         "    model = AutoModelForCausalLM.from_config(cfg).eval()\n"
         "    with torch.no_grad():\n"
         "        for name, p in model.named_parameters():\n"
         "            p.uniform_(0.8, 1.2) if name.endswith('norm.weight') else p.normal_(0, 0.3)\n"
         "    model.generation_config.eos_token_id = None\n"
         "    model.generation_config.pad_token_id = 0\n"
         "    with torch.no_grad():\n"
         "        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=" +
         std::to_string(spec.new_tokens) + ", min_new_tokens=" + std::to_string(spec.new_tokens) +
         ",\n"
         "                             output_scores=True, return_dict_in_generate=True)\n"
         "        top2 = torch.stack([s.float().topk(2, dim=-1).values for s in out.scores])\n"
         "        margin = (top2[..., 0] - top2[..., 1]).min().item()\n"
         "        if getattr(cfg, 'num_experts_per_tok', None):\n"
         "            k = cfg.num_experts_per_tok\n"
         "            full = torch.cat([mask, torch.ones_like(out.sequences[:, ids.size(1):])], 1)\n"
         "            logits = model(out.sequences, attention_mask=full, output_router_logits=True).router_logits\n"
         "            real = full.reshape(-1).bool()\n"
         "            for l in logits:\n"
         "                v = l.float()[real].sort(-1, True)[0]\n"
         "                margin = min(margin, 10 * (v[:, k - 1] - v[:, k]).min().item())\n"
         "    if margin >= 1e-3:\n"
         "        break\n"
         "outputs['margin'] = margin\n"
         "outputs['seed'] = seed\n"
         "outputs['generated'] = out.sequences[:, ids.size(1):]\n"
         "model.save_pretrained('" +
         dir + "')\n";
}

std::vector<int64_t> to_vector(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

void expect_generation_matches_transformers(const GenerateSpec& spec) {
  ScratchDir scratch;
  const std::string dir = scratch.file("hf");
  torch::manual_seed(5);
  const at::Tensor prompt = torch::randint(1, 128, {1, spec.prompt}, torch::kLong);
  auto ref = run_python(oracle_snippet(spec, dir), {{"ids", prompt}, {"mask", torch::ones_like(prompt)}});
  ASSERT_GE(ref.at("margin").item<double>(), 1e-3) << "no seed gave tie-free greedy steps";
  const std::vector<int64_t> expected = to_vector(ref.at("generated"));
  ASSERT_EQ(static_cast<int64_t>(expected.size()), spec.new_tokens);

  models::Pretrained pre = models::load_pretrained(dir);
  const std::vector<int64_t> prompt_ids = to_vector(prompt[0]);
  std::vector<int64_t> streamed;
  const std::vector<int64_t> ours =
      models::generate(pre.model, pre.config, prompt_ids, GenerateOptions().max_new_tokens(spec.new_tokens),
                       [&](int64_t t) { streamed.push_back(t); });
  EXPECT_EQ(ours, expected) << "transformers' seed " << ref.at("seed").item<double>();
  EXPECT_EQ(streamed, ours);

  // The cached logits of every step (the prompt in one forward, then one token at a time, then
  // the same in chunks of three) equal a full forward over the whole sequence without cache.
  std::vector<int64_t> all = prompt_ids;
  all.insert(all.end(), ours.begin(), ours.end());
  const at::Tensor sequence = at::tensor(all).unsqueeze(0);
  torch::NoGradGuard no_grad;
  pre.model->eval();
  const at::Tensor full = models::forward(pre.model, sequence)[0];  // [T, vocab]
  models::KvCache cache(pre.config);
  at::Tensor prefill =
      models::forward_cached(pre.model, sequence.narrow(1, 0, spec.prompt), cache, CachedLogits::kEveryPosition);
  EXPECT_LE(max_abs_diff(prefill[0], full.narrow(0, 0, spec.prompt)), 1e-4);
  double worst = 0;
  for (int64_t t = spec.prompt; t < sequence.size(1); ++t) {
    const at::Tensor step = models::forward_cached(pre.model, sequence.narrow(1, t, 1), cache);
    worst = std::max(worst, max_abs_diff(step[0][0], full[t]));
  }
  EXPECT_LE(worst, 1e-4) << "one token per step";
  EXPECT_EQ(cache.length(), sequence.size(1));
  models::KvCache chunked(pre.config);
  worst = 0;
  for (int64_t t = 0; t < sequence.size(1); t += 3) {
    const int64_t n = std::min<int64_t>(3, sequence.size(1) - t);
    const at::Tensor logits =
        models::forward_cached(pre.model, sequence.narrow(1, t, n), chunked, CachedLogits::kEveryPosition);
    worst = std::max(worst, max_abs_diff(logits[0], full.narrow(0, t, n)));
  }
  EXPECT_LE(worst, 1e-4) << "chunks of three";
}

TEST(GenerateTest, GreedyMatchesTransformers_Llama) {
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  expect_generation_matches_transformers(
      {"LlamaConfig",
       "dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,"
       " num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)"});
}

TEST(GenerateTest, GreedyMatchesTransformers_Qwen3SlidingLayer) {
  // Layer 0 full, layer 1 slides over 4: 8 + 16 tokens cross the window many times.
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  expect_generation_matches_transformers(
      {"Qwen3Config",
       "dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,"
       " num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True,"
       " use_sliding_window=True, sliding_window=4, max_window_layers=1)"});
}

TEST(GenerateTest, GreedyMatchesTransformers_MistralWindowShorterThanSequence) {
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  expect_generation_matches_transformers(
      {"MistralConfig",
       "dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,"
       " num_key_value_heads=1, sliding_window=5, max_position_embeddings=64)"});
}

TEST(GenerateTest, GreedyMatchesTransformers_Qwen3Moe) {
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  expect_generation_matches_transformers(
      {"Qwen3MoeConfig",
       "dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=3,"
       " num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,"
       " norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=64,"
       " experts_implementation='eager')"});
}

TEST(GenerateTest, GreedyMatchesTransformers_MixtralWindow) {
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  expect_generation_matches_transformers(
      {"MixtralConfig",
       "dict(vocab_size=128, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,"
       " num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,"
       " max_position_embeddings=64, experts_implementation='eager')"});
}

TEST(GenerateTest, GreedyMatchesTransformers_GptOssSinksAlternatingWindow) {
  // Even layers slide over 5, odd ones are full; sinks; YaRN rope.
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  expect_generation_matches_transformers(
      {"GptOssConfig",
       "dict(vocab_size=128, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,"
       " num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,"
       " swiglu_limit=1.0, attn_implementation='eager', experts_implementation='eager')"});
}

// ---- batched generation --------------------------------------------------------------------------

// generate_batch on prompts of `lengths` tokens == transformers' batched generate, row by row, ==
// generate() on each prompt alone; the streamed (row, token) pairs are the returned tokens; and a
// stop token ends only the rows that produce it.
void expect_batched_generation_matches_transformers(const GenerateSpec& spec, const std::vector<int64_t>& lengths) {
  ScratchDir scratch;
  const std::string dir = scratch.file("hf");
  torch::manual_seed(11);
  const auto rows = static_cast<int64_t>(lengths.size());
  const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  at::Tensor ids = torch::zeros({rows, longest}, torch::kLong);
  at::Tensor mask = torch::zeros({rows, longest}, torch::kLong);
  std::vector<std::vector<int64_t>> prompts;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = lengths[static_cast<size_t>(r)];
    const at::Tensor prompt = torch::randint(1, 128, {n}, torch::kLong);
    ids[r].narrow(0, longest - n, n).copy_(prompt);
    mask[r].narrow(0, longest - n, n).fill_(1);
    prompts.push_back(to_vector(prompt));
  }
  auto ref = run_python(oracle_snippet(spec, dir), {{"ids", ids}, {"mask", mask}});
  ASSERT_GE(ref.at("margin").item<double>(), 1e-3) << "no seed gave tie-free greedy steps";
  const at::Tensor generated = ref.at("generated");
  ASSERT_EQ(generated.size(1), spec.new_tokens);

  models::Pretrained pre = models::load_pretrained(dir);
  std::vector<std::vector<int64_t>> streamed(static_cast<size_t>(rows));
  const auto options = GenerateOptions().max_new_tokens(spec.new_tokens);
  const std::vector<std::vector<int64_t>> ours =
      models::generate_batch(pre.model, pre.config, prompts, options,
                             [&](int64_t row, int64_t t) { streamed[static_cast<size_t>(row)].push_back(t); });
  ASSERT_EQ(static_cast<int64_t>(ours.size()), rows);
  EXPECT_EQ(streamed, ours);
  for (int64_t r = 0; r < rows; ++r) {
    const auto i = static_cast<size_t>(r);
    EXPECT_EQ(ours[i], to_vector(generated[r])) << "row " << r << " (" << lengths[i] << " prompt tokens), "
                                                << "transformers' seed " << ref.at("seed").item<double>();
    EXPECT_EQ(ours[i], models::generate(pre.model, pre.config, prompts[i], options)) << "row " << r << " alone";
  }

  // Row 0's third token as a stop token: each row ends after its first occurrence of it, if any.
  const int64_t stop = ours[0][2];
  const auto stop_options = GenerateOptions(options).stop_token_ids({stop});
  const std::vector<std::vector<int64_t>> stopped =
      models::generate_batch(pre.model, pre.config, prompts, stop_options);
  std::vector<std::vector<int64_t>> expected_stopped;
  for (size_t i = 0; i < ours.size(); ++i) {
    const auto first = std::find(ours[i].begin(), ours[i].end(), stop);
    expected_stopped.emplace_back(ours[i].begin(), first == ours[i].end() ? first : first + 1);
    EXPECT_EQ(stopped[i], expected_stopped[i]) << "row " << i;
  }

  // Through RoundPipe on 2 CPU devices (generate_batch_streamed: no cache, right padding, rows
  // leave the batch as they finish): the same tokens, with and without the stop token.
  models::Pretrained streamed_copy = models::load_pretrained(dir);
  RoundPipe pipe(streamed_copy.model, RoundPipeOptions().devices({torch::kCPU, torch::kCPU}));
  std::vector<std::vector<int64_t>> pipe_streamed(static_cast<size_t>(rows));
  EXPECT_EQ(models::generate_batch_streamed(
                pipe, streamed_copy.config, prompts, options,
                [&](int64_t row, int64_t t) { pipe_streamed[static_cast<size_t>(row)].push_back(t); }),
            ours);
  EXPECT_EQ(pipe_streamed, ours);
  EXPECT_EQ(models::generate_batch_streamed(pipe, streamed_copy.config, prompts, stop_options), expected_stopped);
  EXPECT_TRUE(pipe.module()->is_training()) << "the training flag is restored";
}

TEST(GenerateTest, BatchedGreedyMatchesTransformers_Llama) {
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  expect_batched_generation_matches_transformers(
      {"LlamaConfig",
       "dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,"
       " num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)",
       0, 12},
      {3, 9, 6});
}

TEST(GenerateTest, BatchedGreedyMatchesTransformers_Qwen3SlidingLayer) {
  // Row 0 has more padding (6) than the window (4): the window counts cache slots, padding included.
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  expect_batched_generation_matches_transformers(
      {"Qwen3Config",
       "dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,"
       " num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True,"
       " use_sliding_window=True, sliding_window=4, max_window_layers=1)",
       0, 12},
      {2, 8, 5});
}

TEST(GenerateTest, BatchedGreedyMatchesTransformers_Qwen3Moe) {
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  expect_batched_generation_matches_transformers(
      {"Qwen3MoeConfig",
       "dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=3,"
       " num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,"
       " norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=64,"
       " experts_implementation='eager')",
       0, 10},
      {7, 4});
}

TEST(GenerateTest, BatchedGreedyMatchesTransformers_GptOssSinksAlternatingWindow) {
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  expect_batched_generation_matches_transformers(
      {"GptOssConfig",
       "dict(vocab_size=128, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,"
       " num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,"
       " swiglu_limit=1.0, attn_implementation='eager', experts_implementation='eager')",
       0, 12},
      {9, 2, 5});
}

// ---- sampling ------------------------------------------------------------------------------------

TEST(GenerateTest, SamplingProbs_MatchTransformersWarpers) {
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  torch::manual_seed(3);
  at::Tensor logits = torch::randn({4, 200}) * 3;
  logits[3].narrow(0, 0, 40).fill_(1.5);  // ties at the top-k and top-p boundaries
  const std::vector<GenerateOptions> cases = {
      GenerateOptions().temperature(0.7).top_k(5),
      GenerateOptions().temperature(1.3).top_p(0.8),
      GenerateOptions().temperature(0.9).top_k(20).top_p(0.5),
      GenerateOptions().temperature(1.0).top_p(1e-4),  // keeps only the most probable token
      GenerateOptions().temperature(2.0),
      GenerateOptions().temperature(1.0).top_k(500),  // more than the vocabulary: off
  };
  std::string snippet =
      "from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper,"
      " TopPLogitsWarper\n"
      "def probs(x, t, k, p):\n"
      "    s = TemperatureLogitsWarper(t)(None, x.unsqueeze(0).float())\n"
      "    if k > 0:\n"
      "        s = TopKLogitsWarper(k)(None, s)\n"
      "    if p < 1.0:\n"
      "        s = TopPLogitsWarper(p)(None, s)\n"
      "    return s.softmax(-1)[0]\n"
      "cases = [";
  for (const GenerateOptions& o : cases) {
    snippet += "(" + std::to_string(o.temperature()) + ", " + std::to_string(o.top_k()) + ", " +
               std::to_string(o.top_p()) + "), ";
  }
  snippet +=
      "]\n"
      "for c, (t, k, p) in enumerate(cases):\n"
      "    for r in range(inputs['logits'].size(0)):\n"
      "        outputs[f'{c}.{r}'] = probs(inputs['logits'][r], t, k, p)\n";
  auto ref = run_python(snippet, {{"logits", logits}});
  for (size_t c = 0; c < cases.size(); ++c) {
    for (int64_t r = 0; r < logits.size(0); ++r) {
      const at::Tensor ours = models::sampling_probs(logits[r], cases[c]);
      const at::Tensor& expected = ref.at(std::to_string(c) + "." + std::to_string(r));
      EXPECT_LE(max_abs_diff(ours, expected), 1e-6) << "case " << c << " row " << r;
      EXPECT_TRUE(ours.eq(0).equal(expected.eq(0))) << "case " << c << " row " << r << ": other tokens filtered";
    }
  }
  EXPECT_EQ(models::sampling_probs(logits[0], cases[3]).gt(0).sum().item<int64_t>(), 1);
}

TEST(GenerateTest, NextToken_DrawsFromTheFilteredDistribution) {
  torch::manual_seed(4);
  const at::Tensor logits = torch::randn({12}) * 2;
  const auto options = GenerateOptions().temperature(0.8).top_k(6).top_p(0.9);
  const at::Tensor probs = models::sampling_probs(logits, options);
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(11);
  at::Tensor counts = torch::zeros({12}, torch::kDouble);
  constexpr int kDraws = 20000;
  for (int i = 0; i < kDraws; ++i) counts[models::next_token(logits, options, generator)] += 1;
  // Never a filtered token; frequencies within 5 standard deviations of the probabilities.
  EXPECT_EQ(counts.masked_select(probs.eq(0)).sum().item<double>(), 0);
  const at::Tensor p = probs.to(torch::kDouble);
  const at::Tensor sigma = (p * (1 - p) / kDraws).sqrt();
  EXPECT_TRUE((counts / kDraws - p).abs().le(5 * sigma + 1e-12).all().item<bool>()) << counts / kDraws << "\n" << p;
  EXPECT_EQ(models::next_token(logits, GenerateOptions(), generator), logits.argmax().item<int64_t>());
}

models::Pretrained tiny_llama(int64_t max_positions = 64) {
  torch::manual_seed(2);
  models::Pretrained pre = models::build(models::parse_model_config(
      R"({"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": )" +
      std::to_string(max_positions) + "}"));
  torch::NoGradGuard no_grad;
  for (auto& p : pre.model->parameters()) p.normal_(0, 0.3);
  return pre;
}

TEST(GenerateTest, LogitPositions_HeadComputesOnlyTheGivenPositions) {
  models::Pretrained pre = tiny_llama();
  torch::NoGradGuard no_grad;
  pre.model->eval();
  const at::Tensor ids = torch::randint(0, 64, {3, 7}, torch::kLong);
  const at::Tensor full = models::forward(pre.model, ids);  // [3, 7, vocab]
  const at::Tensor positions = at::tensor(std::vector<int64_t>{6, 0, 3});
  at::Tensor picked;
  {
    SideInputScope side({{models::kLogitPositions, positions}});
    picked = models::forward(pre.model, ids);
  }
  ASSERT_EQ(picked.sizes(), (at::IntArrayRef{3, 1, 64}));
  for (int64_t r = 0; r < 3; ++r) {
    EXPECT_LE(max_abs_diff(picked[r][0], full[r][positions[r].item<int64_t>()]), 1e-6) << "row " << r;
  }
  SideInputScope bad({{models::kLogitPositions, at::tensor(std::vector<int64_t>{7, 0, 0})}});
  EXPECT_THROW_WITH(models::forward(pre.model, ids), "outside [0, 7)");
}

TEST(GenerateTest, Streamed_RefusesAModelThatIsNotTheConfigs) {
  models::Pretrained pre = tiny_llama();
  models::ModelConfig other = pre.config;
  other.num_hidden_layers = 3;
  RoundPipe pipe(pre.model, RoundPipeOptions().devices({torch::kCPU}));
  const std::vector<std::vector<int64_t>> one = {{1, 2}};
  const std::vector<std::vector<int64_t>> second_empty = {{1, 2}, {}};
  EXPECT_THROW_WITH(models::generate_batch_streamed(pipe, other, one), "must be [Embedding, 3 decoder layers, LmHead]");
  EXPECT_THROW_WITH(models::generate_batch_streamed(pipe, pre.config, second_empty), "the prompt (prompt 1) is empty");
}

// On `device` (CPU, or GPU 0 for the _CUDA variant): the KV-cached batch with the model on the
// device, and the streamed batch through a RoundPipe of two workers on it, give the greedy tokens
// of the KV-cached batch on the CPU.
void batched_and_streamed_on(const c10::Device& device) {
  const std::vector<std::vector<int64_t>> prompts = {{3, 14, 15, 9, 2}, {6, 5}, {35, 8, 9, 7, 9, 3, 2}};
  const auto options = GenerateOptions().max_new_tokens(10);
  models::Pretrained reference = tiny_llama();
  const std::vector<std::vector<int64_t>> expected =
      models::generate_batch(reference.model, reference.config, prompts, options);
  models::Pretrained cached = tiny_llama();
  cached.model->to(device);
  EXPECT_EQ(models::generate_batch(cached.model, cached.config, prompts, options), expected);
  models::Pretrained streamed = tiny_llama();
  RoundPipe pipe(streamed.model, RoundPipeOptions().devices({device, device}));
  EXPECT_EQ(models::generate_batch_streamed(pipe, streamed.config, prompts, options), expected);
}

ROUNDPIPE_DEVICE_TEST(GenerateTest, BatchedAndStreamed_OnDevice, batched_and_streamed_on)

// A conversation's turns through one cache (generate continuing a KvCache, truncate to the common
// prefix): the greedy tokens of generate() on each whole prompt from scratch.
TEST(GenerateTest, ContinuedCache_EqualsTheWholeSequenceFromScratch) {
  models::Pretrained pre = tiny_llama();
  const auto options = GenerateOptions().max_new_tokens(6);
  const std::vector<int64_t> first = {3, 14, 15, 9, 2};
  models::KvCache cache(pre.config);
  const std::vector<int64_t> answer = models::generate(pre.model, pre.config, cache, first, options);
  EXPECT_EQ(answer, models::generate(pre.model, pre.config, first, options));
  EXPECT_EQ(cache.length(), static_cast<int64_t>(first.size() + answer.size() - 1)) << "all but the last token fed";

  // Turn 2 extends everything the cache holds: nothing to truncate, only the new tokens run.
  std::vector<int64_t> second = first;
  second.insert(second.end(), answer.begin(), answer.end());
  second.insert(second.end(), {7, 1, 8});
  ASSERT_TRUE(cache.truncate(cache.length(), pre.config));
  const std::vector<int64_t> rest(second.begin() + cache.length(), second.end());
  EXPECT_EQ(models::generate(pre.model, pre.config, cache, rest, options),
            models::generate(pre.model, pre.config, second, options));

  // A prompt that shares only 3 tokens with what the cache holds: truncated to them.
  const std::vector<int64_t> third = {3, 14, 15, 40, 41};
  ASSERT_TRUE(cache.truncate(3, pre.config));
  EXPECT_EQ(cache.length(), 3);
  EXPECT_EQ(
      models::generate(pre.model, pre.config, cache, std::vector<int64_t>(third.begin() + 3, third.end()), options),
      models::generate(pre.model, pre.config, third, options));
  EXPECT_THROW_WITH(cache.truncate(cache.length() + 1, pre.config), "is outside [0, ");
  const std::vector<int64_t> none;
  EXPECT_THROW_WITH(models::generate(pre.model, pre.config, cache, none, options), "no new tokens");
}

// A sliding layer keeps the last window - 1 keys only: it cannot go back once the window is full.
TEST(GenerateTest, Truncate_RefusedWhereASlidingLayerDroppedTheKeys) {
  torch::manual_seed(3);
  models::Pretrained pre = models::build(models::parse_model_config(
      R"({"model_type": "mistral", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 4,
          "max_position_embeddings": 64})"));
  {
    torch::NoGradGuard no_grad;
    for (auto& p : pre.model->parameters()) p.normal_(0, 0.3);
  }
  models::KvCache cache(pre.config);
  const std::vector<int64_t> prompt = {1, 2};
  const std::vector<int64_t> out =
      models::generate(pre.model, pre.config, cache, prompt, GenerateOptions().max_new_tokens(9));
  ASSERT_EQ(cache.length(), 10);
  EXPECT_FALSE(cache.truncate(9, pre.config));
  EXPECT_EQ(cache.length(), 10) << "a refused truncate changes nothing";
  EXPECT_TRUE(cache.truncate(10, pre.config));
  // Before the window fills, going back works and continues exactly.
  models::KvCache young(pre.config);
  models::generate(pre.model, pre.config, young, prompt, GenerateOptions().max_new_tokens(2));  // holds 3
  ASSERT_TRUE(young.truncate(1, pre.config));
  const std::vector<int64_t> again = {1, 9, 9};
  EXPECT_EQ(models::generate(pre.model, pre.config, young, std::vector<int64_t>(again.begin() + 1, again.end()),
                             GenerateOptions().max_new_tokens(8)),
            models::generate(pre.model, pre.config, again, GenerateOptions().max_new_tokens(8)));
}

TEST(GenerateTest, Sampling_SameSeedSameTokens) {
  models::Pretrained pre = tiny_llama();
  const std::vector<int64_t> prompt = {3, 14, 15, 9, 2};
  const auto options = GenerateOptions().max_new_tokens(24).temperature(1.5).top_k(40).top_p(0.95).seed(7);
  const std::vector<int64_t> a = models::generate(pre.model, pre.config, prompt, options);
  const std::vector<int64_t> b = models::generate(pre.model, pre.config, prompt, options);
  const std::vector<int64_t> c = models::generate(pre.model, pre.config, prompt, GenerateOptions(options).seed(8));
  EXPECT_EQ(a.size(), 24u);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_TRUE(pre.model->is_training()) << "the training flag is restored";
}

TEST(GenerateTest, Stops_AtStopTokenAndMaxPositions) {
  models::Pretrained pre = tiny_llama(/*max_positions=*/16);
  const std::vector<int64_t> prompt = {1, 2, 3, 4};
  const std::vector<int64_t> greedy =
      models::generate(pre.model, pre.config, prompt, GenerateOptions().max_new_tokens(8));
  ASSERT_EQ(greedy.size(), 8u);
  // Stops after the first occurrence of the stop token, which is returned.
  const int64_t stop = greedy[2];
  const auto first = std::find(greedy.begin(), greedy.end(), stop);
  const std::vector<int64_t> stopped =
      models::generate(pre.model, pre.config, prompt, GenerateOptions().max_new_tokens(8).stop_token_ids({stop}));
  EXPECT_EQ(stopped, std::vector<int64_t>(greedy.begin(), first + 1));
  // 4 prompt tokens + at most 12 new ones fill the 16 positions.
  const std::vector<int64_t> limited =
      models::generate(pre.model, pre.config, prompt, GenerateOptions().max_new_tokens(100));
  EXPECT_EQ(limited.size(), 12u);
  EXPECT_EQ(std::vector<int64_t>(limited.begin(), limited.begin() + 8), greedy);
}

TEST(GenerateTest, BadOptions_FailNamingTheOption) {
  models::Pretrained pre = tiny_llama(/*max_positions=*/16);
  const std::vector<int64_t> prompt = {1, 2, 3};
  auto message = [&](const GenerateOptions& options, const std::vector<int64_t>& ids = {1, 2, 3}) {
    try {
      models::generate(pre.model, pre.config, ids, options);
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(GenerateOptions().temperature(-0.5)).find("temperature = -0.5"), std::string::npos);
  EXPECT_NE(message(GenerateOptions().top_p(0)).find("top_p = 0"), std::string::npos);
  EXPECT_NE(message(GenerateOptions().top_p(1.5)).find("top_p = 1.5"), std::string::npos);
  EXPECT_NE(message(GenerateOptions().top_k(-1)).find("top_k = -1"), std::string::npos);
  EXPECT_NE(message(GenerateOptions().max_new_tokens(0)).find("max_new_tokens = 0"), std::string::npos);
  EXPECT_NE(message(GenerateOptions(), {}).find("prompt is empty"), std::string::npos);
  EXPECT_NE(message(GenerateOptions(), {1, 64}).find("token id 64"), std::string::npos);
  EXPECT_NE(message(GenerateOptions(), std::vector<int64_t>(16, 1)).find("max_position_embeddings is 16"),
            std::string::npos);
  EXPECT_EQ(models::generate(pre.model, pre.config, std::vector<int64_t>(15, 1), GenerateOptions()).size(), 1u);
  // A batch names the prompt at fault.
  auto batch_message = [&](const std::vector<std::vector<int64_t>>& prompts) {
    try {
      models::generate_batch(pre.model, pre.config, prompts, GenerateOptions());
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  EXPECT_NE(batch_message({}).find("no prompts"), std::string::npos);
  EXPECT_NE(batch_message({{1, 2}, {}}).find("the prompt (prompt 1) is empty"), std::string::npos);
  EXPECT_NE(batch_message({{1, 2}, {3, 99}}).find("prompt (prompt 1) token id 99"), std::string::npos);
}

}  // namespace
}  // namespace roundpipe::testing
