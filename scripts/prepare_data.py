#!/usr/bin/env python3
"""Tokenise text files into a RoundPipe token file (data.format: tokens).

Each input file is one document; its tokens are followed by the --eos token when given. The
output is a 1024-byte header of 256 little-endian int32 (magic 20240520, 1 = uint16 tokens or
2 = uint32 tokens, the number of tokens, zeros) followed by the tokens: uint16 when the
tokenizer's vocabulary has fewer than 65536 entries, else uint32. Files are written atomically.

  .venv/bin/python scripts/prepare_data.py --tokenizer tokenizer.json --eos '<|endoftext|>' \\
      --out data/train.bin --valid-out data/valid.bin --valid-fraction 0.05 corpus/*.txt

Needs the Hugging Face `tokenizers` package (requirements.txt).
"""

import argparse
import os
import sys

import numpy as np

MAGIC = 20240520
HEADER_INTS = 256
MAX_TOKENS = 2**31 - 1
CHUNK_CHARS = 1 << 20  # documents are tokenised in chunks of about this many characters


def write_token_file(path, tokens, vocab_size):
    """Writes `tokens` (a 1-D integer array) to `path` atomically in the token file format."""
    if len(tokens) > MAX_TOKENS:
        raise SystemExit(f"{path}: {len(tokens)} tokens exceed the header's int32 count; split the data")
    dtype = np.uint16 if vocab_size < 65536 else np.uint32
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0] = MAGIC
    header[1] = 1 if dtype == np.uint16 else 2
    header[2] = len(tokens)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".tmp.{os.path.basename(path)}.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            f.write(np.asarray(tokens).astype(np.dtype(dtype).newbyteorder("<")).tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def chunks(text):
    """Splits text at line breaks into pieces of about CHUNK_CHARS (tokenisers rarely merge across
    a newline, so this changes the tokens only at the rare merge that would span one)."""
    start = 0
    while start < len(text):
        end = min(len(text), start + CHUNK_CHARS)
        if end < len(text):
            newline = text.rfind("\n", start, end)
            if newline > start:
                end = newline + 1
        yield text[start:end]
        start = end


def tokenize_files(tokenizer, paths, eos_id):
    pieces = []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        parts = list(chunks(text))
        for encoding in tokenizer.encode_batch(parts, add_special_tokens=False) if parts else []:
            pieces.append(np.asarray(encoding.ids, dtype=np.int64))
        if eos_id is not None:
            pieces.append(np.asarray([eos_id], dtype=np.int64))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help="text files (UTF-8), one document each")
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer.json")
    parser.add_argument("--out", required=True, help="the training token file to write")
    parser.add_argument("--eos", help="token appended after each document, e.g. '<|endoftext|>'")
    parser.add_argument("--valid-out", help="also write the last --valid-fraction of the tokens here")
    parser.add_argument("--valid-fraction", type=float, default=0.0,
                        help="share of the tokens for --valid-out (0 < f < 1)")
    args = parser.parse_args(argv)

    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise SystemExit("prepare_data.py needs the `tokenizers` package: "
                         ".venv/bin/pip install -r requirements.txt")

    if args.valid_out and not 0.0 < args.valid_fraction < 1.0:
        raise SystemExit(f"--valid-fraction {args.valid_fraction}: must be in (0, 1) with --valid-out")
    if args.valid_fraction and not args.valid_out:
        raise SystemExit("--valid-fraction needs --valid-out")
    tokenizer = Tokenizer.from_file(args.tokenizer)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    eos_id = None
    if args.eos is not None:
        eos_id = tokenizer.token_to_id(args.eos)
        if eos_id is None:
            raise SystemExit(f"--eos {args.eos!r} is not in the vocabulary of {args.tokenizer}")

    tokens = tokenize_files(tokenizer, args.inputs, eos_id)
    if len(tokens):
        # Added tokens may lie beyond get_vocab_size(); the width must hold the largest id.
        vocab_size = max(vocab_size, int(tokens.max()) + 1)
        if tokens.min() < 0 or vocab_size > 2**32:
            raise SystemExit(f"token ids outside [0, 2^32): min {tokens.min()}, max {tokens.max()}")
    if args.valid_out:
        split = len(tokens) - int(round(len(tokens) * args.valid_fraction))
        write_token_file(args.out, tokens[:split], vocab_size)
        write_token_file(args.valid_out, tokens[split:], vocab_size)
        print(f"{args.out}: {split} tokens; {args.valid_out}: {len(tokens) - split} tokens "
              f"(vocab {vocab_size})", file=sys.stderr)
    else:
        write_token_file(args.out, tokens, vocab_size)
        print(f"{args.out}: {len(tokens)} tokens (vocab {vocab_size})", file=sys.stderr)


if __name__ == "__main__":
    main()
