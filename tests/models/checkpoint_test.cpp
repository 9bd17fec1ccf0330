// CheckpointReader / save_checkpoint: single-file and sharded checkpoint directories, checked
// against huggingface_hub's own split and writer (what transformers' save_pretrained uses).
#include "roundpipe/models/safetensors.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/common/python_oracle.h"
#include "tests/common/tensor_compare.h"
#include "tests/common/test_macros.h"
#include "tests/models/test_files.h"

namespace roundpipe::models {
namespace {

using roundpipe::testing::list_dir;
using roundpipe::testing::read_bytes;
using roundpipe::testing::run_python;
using roundpipe::testing::ScratchDir;
using roundpipe::testing::write_bytes;
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// float32 tensors of 40, 40, 200, 60, 28, 0 and 32 bytes: with a 100-byte limit the 200-byte one
// gets a shard of its own (appended at once, before the open shard) and the rest split wherever
// the running size would pass 100.
NamedTensors shard_test_tensors() {
  at::manual_seed(1);
  return {{"layers.0.w", at::randn({10})}, {"layers.0.b", at::randn({2, 5})}, {"embed", at::randn({5, 10})},
          {"layers.1.w", at::randn({15})}, {"layers.1.b", at::randn({7})},    {"empty", at::randn({0, 3})},
          {"norm", at::randn({8})}};
}

std::string python_name_list(const NamedTensors& tensors) {
  std::string list = "[";
  for (const auto& entry : tensors) list += "'" + entry.first + "',";
  return list + "]";
}

std::string replace_all(std::string text, const std::string& key, const std::string& value) {
  for (size_t at = text.find(key); at != std::string::npos; at = text.find(key, at + value.size())) {
    text.replace(at, key.size(), value);
  }
  return text;
}

void expect_reads_back(const CheckpointReader& reader, const NamedTensors& tensors) {
  ASSERT_EQ(reader.names().size(), tensors.size());
  for (const auto& [name, expected] : tensors) {
    ASSERT_TRUE(reader.contains(name)) << name;
    EXPECT_TENSOR_EQ(reader.get(name), expected);
    EXPECT_EQ(reader.info(name).shape, expected.sizes().vec()) << name;
  }
}

TEST(CheckpointTest, Save_FitsOneShard_WritesModelSafetensorsOnly) {
  ScratchDir scratch;
  const std::string dir = scratch.file("ckpt");  // created by save_checkpoint
  const NamedTensors tensors = shard_test_tensors();
  save_checkpoint(dir, tensors);
  EXPECT_EQ(list_dir(dir), std::vector<std::string>{"model.safetensors"});
  const auto file = SafetensorsFile::open(dir + "/model.safetensors");
  EXPECT_EQ(file->metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));

  const CheckpointReader reader = CheckpointReader::open(dir);
  EXPECT_EQ(reader.files().size(), 1u);
  EXPECT_EQ(reader.names(), file->names());
  expect_reads_back(reader, tensors);
  EXPECT_TENSOR_EQ(reader.get("embed", at::kDouble), tensors[2].second.to(at::kDouble));
}

TEST(CheckpointTest, Save_SmallShardLimit_ShardsAndIndexLikeHuggingFaceHub) {
  ROUNDPIPE_REQUIRE_PYTHON("safetensors huggingface_hub");
  ScratchDir scratch;
  const std::string dir = scratch.file("ckpt");
  const NamedTensors tensors = shard_test_tensors();
  save_checkpoint(dir, tensors, ShardOptions{100, "model"});
  // 200 (alone, closed at once) | 40+40 | 60+28+0 | 32  ->  4 shards.
  EXPECT_EQ(list_dir(dir), (std::vector<std::string>{"model-00001-of-00004.safetensors",
                                                      "model-00002-of-00004.safetensors",
                                                      "model-00003-of-00004.safetensors",
                                                      "model-00004-of-00004.safetensors",
                                                      "model.safetensors.index.json"}));

  roundpipe::testing::TensorMap inputs(tensors.begin(), tensors.end());
  const auto out = run_python(replace_all(replace_all(R"PY(
import json, os
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import load_file
state_dict = {name: inputs[name] for name in NAMES}  # the C++ order
split = split_torch_state_dict_into_shards(state_dict, max_shard_size=100, filename_pattern='model{suffix}.safetensors')
text = open('DIR/model.safetensors.index.json').read()
index = json.loads(text)
outputs['weight_map_matches'] = index['weight_map'] == split.tensor_to_filename
outputs['total_size_matches'] = index['metadata'] == {'total_size': split.metadata['total_size']}
outputs['text_matches'] = text == json.dumps(index, indent=2, sort_keys=True) + '\n'
outputs['files_match'] = set(os.listdir('DIR')) == set(split.filename_to_tensors) | {'model.safetensors.index.json'}
ok = True
for file, names in split.filename_to_tensors.items():
    loaded = load_file('DIR/' + file)
    ok = ok and sorted(loaded) == sorted(names) and all(torch.equal(loaded[n], inputs[n]) for n in names)
    with safe_open('DIR/' + file, framework='pt') as f:
        ok = ok and f.metadata() == {'format': 'pt'}
outputs['shards_load'] = ok
outputs['num_shards'] = len(split.filename_to_tensors)
)PY",
                                                      "NAMES", python_name_list(tensors)),
                                          "DIR", dir),
                              inputs);
  EXPECT_TRUE(out.at("weight_map_matches").item<bool>());
  EXPECT_TRUE(out.at("total_size_matches").item<bool>());
  EXPECT_TRUE(out.at("text_matches").item<bool>());
  EXPECT_TRUE(out.at("files_match").item<bool>());
  EXPECT_TRUE(out.at("shards_load").item<bool>());
  EXPECT_EQ(out.at("num_shards").item<double>(), 4.0);
}

TEST(CheckpointTest, Reader_Sharded_ReadsEveryTensorInStorageOrder) {
  ScratchDir scratch;
  const std::string dir = scratch.file("ckpt");
  const NamedTensors tensors = shard_test_tensors();
  save_checkpoint(dir, tensors, ShardOptions{100, "model"});
  const std::string index = read_bytes(dir + "/model.safetensors.index.json");
  EXPECT_NE(index.find("\"total_size\": 400"), std::string::npos) << index;
  EXPECT_NE(index.find("\"embed\": \"model-00001-of-00004.safetensors\""), std::string::npos) << index;

  const CheckpointReader reader = CheckpointReader::open(dir);
  EXPECT_EQ(reader.files().size(), 4u);
  // Shard by shard; inside a shard, safetensors' order (all float32 here: by name).
  EXPECT_EQ(reader.names(), (std::vector<std::string>{"embed", "layers.0.b", "layers.0.w", "empty", "layers.1.b",
                                                      "layers.1.w", "norm"}));
  expect_reads_back(reader, tensors);
  EXPECT_THROW_WITH(reader.get("missing"), "checkpoint '" + dir + "' has no tensor 'missing'");
}

TEST(CheckpointTest, Reader_CheckpointWrittenByHuggingFaceHub) {
  ROUNDPIPE_REQUIRE_PYTHON("safetensors huggingface_hub");
  ScratchDir scratch;
  const auto out = run_python(replace_all(R"PY(
from huggingface_hub import save_torch_state_dict
g = torch.Generator().manual_seed(5)
sd = {f'model.layers.{i}.{p}': torch.randn(8, 8 + i, generator=g).to(torch.bfloat16)
      for i in range(6) for p in ('q', 'k')}
sd['lm_head.weight'] = torch.randn(32, 8, generator=g)
save_torch_state_dict(sd, 'DIR', max_shard_size=700)
outputs.update(sd)
)PY",
                                          "DIR", scratch.path()));
  const std::vector<std::string> files = list_dir(scratch.path());
  ASSERT_GT(files.size(), 2u) << "expected a sharded checkpoint";
  EXPECT_EQ(files.back(), "model.safetensors.index.json");
  const CheckpointReader reader = CheckpointReader::open(scratch.path());
  EXPECT_EQ(reader.files().size(), files.size() - 1);
  expect_reads_back(reader, NamedTensors(out.begin(), out.end()));
}

TEST(CheckpointTest, Open_NeitherFileExists_ErrorNamesBoth) {
  ScratchDir scratch;
  EXPECT_THROW_WITH(CheckpointReader::open(scratch.path()),
                    "checkpoint directory '" + scratch.path() + "' has neither '" + scratch.path() +
                        "/model.safetensors' nor '" + scratch.path() + "/model.safetensors.index.json'");
}

TEST(CheckpointTest, Open_BadIndex_Errors) {
  ScratchDir scratch;
  save_safetensors(scratch.file("shard.safetensors"), {{"a", at::ones({2})}});
  const std::string index = scratch.file("model.safetensors.index.json");
  write_bytes(index, R"({"weight_map": {"a": "shard.safetensors", "b": "shard.safetensors"}})");
  EXPECT_THROW_WITH(CheckpointReader::open(scratch.path()),
                    "maps tensor 'b' to 'shard.safetensors', but that file has no such tensor");
  write_bytes(index, R"({"weight_map": {"a": "../shard.safetensors"}})");
  EXPECT_THROW_WITH(CheckpointReader::open(scratch.path()), "is not a relative path inside the checkpoint directory");
  write_bytes(index, R"({"weight_map": {"a": "missing.safetensors"}})");
  EXPECT_THROW_WITH(CheckpointReader::open(scratch.path()), "missing.safetensors': cannot open");
  write_bytes(index, R"({"weight_map": ["a"]})");
  EXPECT_THROW_WITH(CheckpointReader::open(scratch.path()), "must be a JSON object with an object \"weight_map\"");
  write_bytes(index, R"({"weight_map": )");
  EXPECT_THROW_WITH(CheckpointReader::open(scratch.path()), "is not valid JSON");
  write_bytes(index, R"({"metadata": {}, "weight_map": {"a": "shard.safetensors"}})");
  EXPECT_TENSOR_EQ(CheckpointReader::open(scratch.path()).get("a"), at::ones({2}));
}

TEST(CheckpointTest, Save_OverEarlierSave_RemovesStaleFiles) {
  ScratchDir scratch;
  const std::string dir = scratch.path();
  const NamedTensors tensors = shard_test_tensors();
  save_checkpoint(dir, tensors, ShardOptions{100, "model"});  // 4 shards
  write_bytes(dir + "/config.json", "{}");                     // not ours: stays
  save_checkpoint(dir, tensors, ShardOptions{300, "model"});  // 2 shards: 3-of-4 etc. go
  EXPECT_EQ(list_dir(dir), (std::vector<std::string>{"config.json", "model-00001-of-00002.safetensors",
                                                      "model-00002-of-00002.safetensors",
                                                      "model.safetensors.index.json"}));
  expect_reads_back(CheckpointReader::open(dir), tensors);
  save_checkpoint(dir, tensors);  // one file: the index and the shards go
  EXPECT_EQ(list_dir(dir), (std::vector<std::string>{"config.json", "model.safetensors"}));
  save_checkpoint(dir, tensors, ShardOptions{300, "model"});  // and back: the single file goes
  EXPECT_EQ(list_dir(dir).size(), 4u);
  EXPECT_EQ(list_dir(dir)[1], "model-00001-of-00002.safetensors");
  expect_reads_back(CheckpointReader::open(dir), tensors);
}

TEST(CheckpointTest, Save_InvalidOptionsOrTensors_ErrorBeforeWriting) {
  ScratchDir scratch;
  const NamedTensors tensors = shard_test_tensors();
  EXPECT_THROW_WITH(save_checkpoint(scratch.path(), tensors, ShardOptions{0, "model"}),
                    "ShardOptions::max_shard_bytes must be > 0, got 0");
  EXPECT_THROW_WITH(save_checkpoint(scratch.path(), tensors, ShardOptions{100, "a/b"}),
                    "ShardOptions::prefix must be a non-empty file name without '/'");
  EXPECT_THROW_WITH(save_checkpoint(scratch.path(), {{"a", at::ones({1})}, {"a", at::ones({1})}}, ShardOptions{1}),
                    "'a' appears twice");
  EXPECT_TRUE(list_dir(scratch.path()).empty());
}

}  // namespace
}  // namespace roundpipe::models
