#!/usr/bin/env python3
"""CTest: scripts/prepare_data.py round trip with tiny offline tokenizers (uint16 and uint32).

Exits 77 (CTest skip) when `tokenizers` is missing, unless CI=true (then it fails).
Usage: prepare_data_test.py <path of prepare_data.py>
"""

import os
import struct
import subprocess
import sys
import tempfile

try:
    from tokenizers import Tokenizer, models, pre_tokenizers
except ImportError:
    print("tokenizers is not installed: skipping")
    sys.exit(1 if os.environ.get("CI") == "true" else 77)

SCRIPT = sys.argv[1]


def read_token_file(path):
    """Independent reader of the documented format (struct, not numpy)."""
    with open(path, "rb") as f:
        data = f.read()
    header = struct.unpack("<256i", data[:1024])
    assert header[0] == 20240520, header[0]
    assert header[1] in (1, 2), header[1]
    assert all(v == 0 for v in header[3:]), "header[3:] must be zero"
    width = 2 if header[1] == 1 else 4
    count = header[2]
    assert len(data) == 1024 + width * count, (len(data), count)
    tokens = list(struct.unpack(f"<{count}{'H' if width == 2 else 'I'}", data[1024:]))
    return header[1], tokens


def word_level(words):
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def run(d, tok, texts, extra):
    tok.save(os.path.join(d, "tokenizer.json"))
    inputs = []
    for i, text in enumerate(texts):
        path = os.path.join(d, f"doc{i}.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        inputs.append(path)
    subprocess.run([sys.executable, SCRIPT, "--tokenizer", os.path.join(d, "tokenizer.json")] + extra + inputs,
                   check=True, capture_output=True)


def main():
    texts = ["the cat sat on the mat .\nthe end", "a dog sat ."]
    with tempfile.TemporaryDirectory() as d:
        # uint16, EOS between documents, train/valid split.
        words = ["[UNK]", "<eos>", "the", "cat", "sat", "on", "mat", ".", "end"]
        tok = word_level(words)
        run(d, tok, texts, ["--eos", "<eos>", "--out", f"{d}/train.bin",
                            "--valid-out", f"{d}/valid.bin", "--valid-fraction", "0.25"])
        expected = []
        for text in texts:
            expected += tok.encode(text, add_special_tokens=False).ids + [1]
        version, train = read_token_file(f"{d}/train.bin")
        _, valid = read_token_file(f"{d}/valid.bin")
        assert version == 1, version
        assert train + valid == expected, (train, valid, expected)
        assert len(valid) == round(len(expected) * 0.25), len(valid)
        assert 0 in expected, "unknown words map to [UNK]"

        # uint32 for a vocabulary of 65536 or more.
        big = ["[UNK]"] + [f"w{i}" for i in range(70000)]
        tok = word_level(big)
        run(d, tok, ["w1 w65535 w69999 w0"], ["--out", f"{d}/big.bin"])
        version, tokens = read_token_file(f"{d}/big.bin")
        assert version == 2, version
        assert tokens == [2, 65536, 70000, 1], tokens
    print("prepare_data round trip: ok")


if __name__ == "__main__":
    main()
