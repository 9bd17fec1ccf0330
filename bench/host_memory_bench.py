#!/usr/bin/env python3
"""Host bytes per parameter of `roundpipe train`, measured from the process (issue 31).

    bench/host_memory_bench.py [--roundpipe build/roundpipe/launcher/roundpipe] [--steps 3]
                               [--only 'NAME;...'] [--allocators glibc,jemalloc,...]

Protocol (issue 31's): `roundpipe train configs/default.yaml` with a 194M-parameter Llama
(hidden 1024, 10 blocks, vocab 32000, untied, float32), AdamW, `--steps` steps, a final checkpoint,
on 2 CPU devices (and 1), sync and async steps; bf16 compute (its gradients read by AdamW as they
are; with amp.scaler cast into float32 buffers first), 8-bit moments, and bf16 masters
with Kahan compensation (the compute copies, sync steps), with and without 8-bit moments, and
without compensation (plain bf16 masters); LoRA
(rank 8 on every linear projection) over a frozen bf16 base: the same Llama with random weights,
saved by transformers as a pretrained directory (`model.pretrained`). Peak RSS is the process's
(getrusage in a parent of its own); the same command on the default tiny model (0.9M parameters)
is subtracted (for LoRA rows: the same LoRA command on a tiny bf16 base of the default model's
shape), so B/param counts what the model's size costs, not LibTorch's own ~0.5 GiB. B/param is per
parameter of the model (LoRA: the frozen base and the adapters). Reported per run:

  peak      peak RSS (ru_maxrss, as `roundpipe train` prints it after its final checkpoint) minus
            the tiny run's, per parameter
  steps     the highest RSS sampled (every 50 ms) until the last step's log line, per parameter
  ckpt      the highest RSS sampled after that line (the final evaluation, then the final
            checkpoint; column "checkpoint adds"), minus the RSS at that line, per parameter
  plan      what `roundpipe plan` predicts for the same overrides (its "estimated host memory"
            peak), per parameter
  cpu       user + system CPU seconds of the run (system in brackets): giving memory back to the
            OS costs page faults when it is touched again

Allocators: "glibc" (the launcher as shipped), "glibc-retain" (ROUNDPIPE_MALLOC=retain: glibc's
dynamic mmap threshold, which keeps freed blocks), "jemalloc" / "mimalloc" (LD_PRELOAD of
Debian's libjemalloc2 / libmimalloc2.0, when installed). Nothing here is timed against a limit.
"""
import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
BIG = ["model.config.hidden_size=1024", "model.config.intermediate_size=2816", "model.config.num_hidden_layers=10",
       "model.config.vocab_size=32000", "model.config.num_attention_heads=8", "model.config.num_key_value_heads=8"]
BIG_PARAMS = 194_008_064  # printed by `roundpipe train` ("trainable parameters: N of N"); checked below
PRELOADS = {"jemalloc": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
            "mimalloc": "/usr/lib/x86_64-linux-gnu/libmimalloc.so.2"}
LORA_BASE = "{lora_base}"  # replaced by the directory make_lora_base() writes
LORA = ["model.preset=null", "model.config={}", f"model.pretrained={LORA_BASE}", "model.dtype=bfloat16",
        "model.lora={rank: 8, alpha: 16.0, targets: [all-linear]}"]
BF16_MASTERS = ["model.dtype=bfloat16", "model.master_dtype=bfloat16", "optimizer.kahan_sum=true", "run.step_mode=sync"]
RUNS = {  # name -> overrides
    "sync, 2 devices": ["run.step_mode=sync"],
    "async, 2 devices": ["run.step_mode=async"],
    "sync, 1 device": ["run.step_mode=sync", "run.devices=1"],
    "bf16 compute, async, 2 devices": ["model.dtype=bfloat16", "run.step_mode=async"],
    "bf16 compute, sync, 2 devices": ["model.dtype=bfloat16", "run.step_mode=sync"],
    # amp.scaler keeps the float32 gradient buffers (Note [Gradients in the compute dtype])
    "bf16 compute, amp.scaler, async, 2 devices": ["model.dtype=bfloat16", "run.step_mode=async", "amp.scaler=true"],
    "int8 states, sync, 2 devices": ["run.step_mode=sync", "optimizer.state_dtype=int8"],
    "bf16 masters + Kahan, sync, 2 devices": BF16_MASTERS,
    "bf16 masters + Kahan + int8, sync, 2 devices": BF16_MASTERS + ["optimizer.state_dtype=int8"],
    # plain bf16 masters (no compensation; `train` warns): 2 B/param less than with Kahan
    "bf16 masters plain, sync, 2 devices": [o for o in BF16_MASTERS if o != "optimizer.kahan_sum=true"],
    "LoRA r8 all-linear, bf16 base, async, 2 devices": LORA + ["run.step_mode=async"],
    "LoRA r8 all-linear, bf16 base, sync, 2 devices": LORA + ["run.step_mode=sync"],
}


def make_lora_base(out_dir: str, big: bool) -> None:
    """The 194M Llama of BIG (else the tiny default one) with random weights, in bfloat16, as a
    transformers pretrained directory."""
    shape = ("vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=10, "
             "num_attention_heads=8, num_key_value_heads=8" if big else
             "vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=4, "
             "num_attention_heads=4, num_key_value_heads=4")
    script = f"""
import torch, transformers
torch.manual_seed(0)
config = transformers.LlamaConfig({shape}, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                                  tie_word_embeddings=False)
transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained({out_dir!r}, safe_serialization=True)
"""
    python = ROOT / ".venv" / "bin" / "python"
    subprocess.run([str(python) if python.exists() else sys.executable, "-c", script], check=True)


def resolve(overrides: list, lora_base: str) -> list:
    return [o.replace(LORA_BASE, lora_base) for o in overrides]


def run(roundpipe: str, out_dir: str, overrides: list, allocator: str, steps: int):
    env = dict(os.environ)
    if allocator == "glibc-retain":
        env["ROUNDPIPE_MALLOC"] = "retain"
    elif allocator in PRELOADS:
        env["LD_PRELOAD"] = PRELOADS[allocator]
    cmd = [roundpipe, "train", str(ROOT / "configs" / "default.yaml"), f"out_dir={out_dir}", f"train.steps={steps}",
           "eval.every=0", "checkpoint.every=0", "train.batch_size=2", "data.seq_len=32", *overrides]
    # A parent of its own per run: getrusage(RUSAGE_CHILDREN) is a maximum over every child waited
    # for, so only a fresh parent gives this run's peak (and CPU time).
    rusage_file = pathlib.Path(out_dir + ".rusage")
    wrapper = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[2:]); "
               "r = resource.getrusage(resource.RUSAGE_CHILDREN); "
               "open(sys.argv[1], 'w').write(f'{r.ru_maxrss} {r.ru_utime} {r.ru_stime}'); sys.exit(rc)")
    cmd = [sys.executable, "-c", wrapper, str(rusage_file), *cmd]
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    samples = []  # (seconds, RSS KiB)

    def sample():  # the RSS of roundpipe, the wrapper's child
        child = None
        while proc.poll() is None:
            try:
                if child is None:
                    with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                        child = int(f.read().split()[0])
                with open(f"/proc/{child}/status") as f:
                    for line in f:
                        if line.startswith("VmRSS"):
                            samples.append((time.time() - start, int(line.split()[1])))
            except (OSError, IndexError, ValueError):
                pass
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    lines = [(time.time() - start, line.rstrip()) for line in proc.stdout]
    proc.wait()
    sampler.join()
    if proc.returncode != 0:
        sys.exit("roundpipe train failed:\n" + "\n".join(l for _, l in lines[-20:]))
    shutil.rmtree(out_dir, ignore_errors=True)  # a 194M-parameter checkpoint is 2.3 GB
    _, user_s, sys_s = rusage_file.read_text().split()  # the parent's view: CPU time only
    user_s, sys_s = float(user_s), float(sys_s)
    # The peak roundpipe reports itself after its final checkpoint: the parent's ru_maxrss also
    # covers the process's teardown, which pages in ~0.1 GiB (static destructors) after the model
    # is freed, raising the tiny run's peak but not a large one's (a bias of -0.5 B/param before).
    reported = [re.search(r"peak host memory: .* \((\d+) KiB\)", l) for _, l in lines]
    peak_kib = next((int(m.group(1)) for m in reported if m), None)
    if peak_kib is None:
        sys.exit("roundpipe train printed no 'peak host memory' line:\n" + "\n".join(l for _, l in lines[-20:]))
    # The progress line ends in '\r' while it is redrawn: look for the text anywhere.
    ckpt_start = next((t for t, l in lines if f"step {steps}/{steps} " in l), lines[-1][0])
    steps_kib = max([s for t, s in samples if t <= ckpt_start] or [0])
    during = [s for t, s in samples if t > ckpt_start]
    at_start = ([s for t, s in samples if t <= ckpt_start] or [0])[-1]
    ckpt_kib = max(during or [at_start]) - at_start
    # "[LoRA rank 8 on ...; ]trainable parameters: 1,234 of 5,678 (21.7%)": B/param is over all of them.
    counts = [re.search(r"trainable parameters: [\d,]+ of ([\d,]+)", l) for _, l in lines]
    params = next((int(m.group(1).replace(",", "")) for m in counts if m), 0)
    return {"peak_kib": peak_kib, "steps_kib": steps_kib, "ckpt_kib": ckpt_kib, "params": params,
            "cpu": user_s + sys_s, "sys": sys_s}


def predicted_bytes(roundpipe: str, overrides: list) -> int:
    """`roundpipe plan`'s predicted peak host bytes for the run ("estimated host memory: peak ... (N B)")."""
    cmd = [roundpipe, "plan", str(ROOT / "configs" / "default.yaml"), "train.batch_size=2", "data.seq_len=32",
           *overrides]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        sys.exit("roundpipe plan failed:\n" + out.stderr[-2000:])
    for line in out.stdout.splitlines():
        if line.startswith("estimated host memory: peak"):
            return int(line.split("(")[1].split(" B)")[0])
    sys.exit("roundpipe plan printed no host memory estimate:\n" + out.stdout[-2000:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--roundpipe", default=str(ROOT / "build" / "roundpipe" / "launcher" / "roundpipe"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", default="", help="run names separated by ';' (they contain commas; default: all)")
    parser.add_argument("--allocators", default="glibc,glibc-retain,jemalloc")
    args = parser.parse_args()
    allocators = [a for a in args.allocators.split(",") if a]
    for a in allocators:
        if a in PRELOADS and not os.path.exists(PRELOADS[a]):
            sys.exit(f"{a}: {PRELOADS[a]} not found (apt-get install lib{a}2 / libmimalloc2.0), or drop it from --allocators")
    names = [n for n in RUNS if not args.only or n in [o.strip() for o in args.only.split(";")]]
    B = 2**10
    print(f"host memory per parameter, roundpipe train, 194M-parameter Llama (float32, AdamW), {args.steps} steps "
          f"+ final checkpoint; B/param above the tiny model's run")
    print(f"| run | allocator | peak B/param | steps B/param | checkpoint adds | plan predicts | peak GiB | cpu s (sys) |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        lora_base, tiny_lora_base = f"{tmp}/lora-base", f"{tmp}/tiny-lora-base"
        if any(LORA_BASE in o for n in names for o in RUNS[n]):
            make_lora_base(lora_base, big=True)
            make_lora_base(tiny_lora_base, big=False)
        for allocator in allocators:
            tiny_runs = {}  # LoRA rows subtract the same LoRA command on the tiny base (the same
            # code paths: bf16, LoRA, a pretrained directory)
            for name in names:
                lora = any(o.startswith("model.lora=") for o in RUNS[name])  # its shape is the base's
                if lora not in tiny_runs:
                    tiny_overrides = resolve(RUNS[name], tiny_lora_base) if lora else []
                    tiny_runs[lora] = run(args.roundpipe, f"{tmp}/tiny-{allocator}-{lora}", tiny_overrides, allocator,
                                          args.steps)
                tiny = tiny_runs[lora]
                overrides = resolve(([] if lora else BIG) + RUNS[name], lora_base)
                r = run(args.roundpipe, f"{tmp}/{allocator}-{len(name)}", overrides, allocator, args.steps)
                if (r["params"] > BIG_PARAMS) != lora or (not lora and r["params"] != BIG_PARAMS):
                    sys.exit(f"expected {BIG_PARAMS} parameters (more with LoRA's adapters), roundpipe train "
                             f"reported {r['params']}")
                per = lambda kib: (kib - tiny["peak_kib"]) * B / r["params"]
                predicted = predicted_bytes(args.roundpipe, overrides) / r["params"]
                print(f"| {name} | {allocator} | {per(r['peak_kib']):.1f} | {per(r['steps_kib']):.1f} | "
                      f"{r['ckpt_kib'] * B / r['params']:.1f} | {predicted:.1f} | {r['peak_kib'] / 2**20:.2f} | "
                      f"{r['cpu']:.1f} ({r['sys']:.1f}) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
