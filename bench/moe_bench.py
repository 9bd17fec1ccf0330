"""transformers' own Qwen3-MoE sparse block on CPU, forward + backward, for bench/moe_bench.cpp.

Usage: moe_bench.py TOKENS HIDDEN EXPERT_WIDTH EXPERTS TOP_K REPS THREADS
Prints one line per experts implementation: `<name> <median ms>`.
"""
import statistics
import sys
import time

import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock


def main():
    tokens, hidden, width, experts, top_k, reps, threads = (int(a) for a in sys.argv[1:8])
    torch.set_num_threads(threads)
    for impl in ("eager", "grouped_mm"):
        cfg = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=width, num_experts=experts,
                             num_experts_per_tok=top_k, norm_topk_prob=True, experts_implementation=impl)
        torch.manual_seed(0)
        block = Qwen3MoeSparseMoeBlock(cfg)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0, 0.05)
        x = torch.randn(1, tokens, hidden, requires_grad=True)
        times = []
        for rep in range(reps + 1):
            block.zero_grad()
            x.grad = None
            t0 = time.perf_counter()
            out = block(x)
            out.sum().backward()
            if rep > 0:  # the first is a warm-up
                times.append((time.perf_counter() - t0) * 1e3)
        print(f"{impl} {statistics.median(times):.3f}", flush=True)


if __name__ == "__main__":
    main()
