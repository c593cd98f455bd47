#!/usr/bin/env python3
"""The training step a user would write with transformers instead of graft's trainer, on
the same shape in the same run: Qwen3ForCausalLM from the config alone (random weights),
bf16 on a GPU (fp32 on the CPU), sdpa attention, forward + backward (the library's own
shifted cross-entropy) + AdamW (fused on a GPU) over a batch of B x T random tokens. One
warm-up step, then --steps timed. FLOPs per token are counted as graft's trainer bench
counts them (common.flops_per_token), so the TFLOP/s and MFU columns compare directly.

Writes one `hf_train` figure line per shape: step seconds, tokens/s, TFLOP/s, MFU (against
--peak when given), and peak memory: torch's max allocated on a GPU (peak_mem_gib), the
process's max RSS on the CPU (peak_rss_gib). Out of memory is a figure too (error "oom").

Usage: python3 hf_train.py --shape NAME --batch B --seq T --steps N [--peak TFLOPS] --out OUTDIR"""
import argparse
import resource
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from common import COMMON, figures, flops_per_token, shape


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--peak", type=float)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    fig = figures(a.out)
    s = shape(a.shape)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dt = torch.bfloat16 if cuda else torch.float32
    base = dict(shape=a.shape, batch=a.batch, seq=a.seq, steps=a.steps, dtype=str(dt).removeprefix("torch."))
    torch.manual_seed(0)
    cfg = Qwen3Config(**s, **COMMON, attn_implementation="sdpa")
    try:
        with torch.device(dev):  # initialized where it trains: a 4B init on the host takes a minute
            m = Qwen3ForCausalLM(cfg)
        m = m.to(dt).train()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-6, fused=cuda)
        params = sum(p.numel() for p in m.parameters())
        x = torch.randint(0, s["vocab_size"], (a.batch, a.seq), device=dev)

        def step():
            out = m(input_ids=x, labels=x)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(a.steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        secs = (time.perf_counter() - t) / a.steps
    except torch.OutOfMemoryError as e:
        fig.emit("hf_train", **base, error="oom", message=str(e).splitlines()[0],
                 peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
        raise SystemExit(3)
    tps = a.batch * a.seq / secs
    tflops = tps * flops_per_token(s, a.seq) / 1e12
    rec = dict(**base, params=params, step_s=round(secs, 4), tokens_s=round(tps, 1), tflops=round(tflops, 3))
    if a.peak:
        rec["mfu_pct"] = round(100 * tflops / a.peak, 2)
    if cuda:
        rec["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    else:
        rec["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)
    fig.emit("hf_train", **rec)


if __name__ == "__main__":
    main()
