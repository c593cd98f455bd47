#!/usr/bin/env python3
"""The machine's matmul peak, the denominator of every MFU in the check: TFLOP/s of one
n x n x n product, the median of 5 timed batches of 10 after 3 warm-ups (bf16, n 8192 on
a GPU; fp32, n 512 on the CPU). Writes a `python_env` figure line (the versions and the
device this Python's torch sees) and a `matmul_peak` one.

Usage: python3 matmul_peak.py --out OUTDIR"""
import argparse
import statistics
import time

import torch

from common import figures


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    fig = figures(a.out)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    try:
        import transformers
        tv = transformers.__version__
    except ImportError:
        tv = None
    fig.emit("python_env", torch=torch.__version__, transformers=tv, cuda=torch.version.cuda,
             device=torch.cuda.get_device_name(0) if cuda else "cpu", threads=torch.get_num_threads())
    n = 8192 if cuda else 512
    dt = torch.bfloat16 if cuda else torch.float32
    x = torch.randn(n, n, device=dev, dtype=dt)
    y = torch.randn(n, n, device=dev, dtype=dt)

    def batch(k):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(k):
            x @ y
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t

    batch(3)
    secs = statistics.median(batch(10) / 10 for _ in range(5))
    fig.emit("matmul_peak", device=dev.type, dtype=str(dt).removeprefix("torch."), n=n,
             tflops=round(2 * n**3 / secs / 1e12, 2))


if __name__ == "__main__":
    main()
