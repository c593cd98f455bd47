#!/usr/bin/env python3
"""How often this machine's disk stalls a synchronous write: the floor under sync durability.

Paces 1.7 KB record writes at a fixed rate for a while, each made durable before the next, in
a 64 MiB file zero-filled and synced beforehand (as graft's WAL is), and prints the latency
distribution with the count of writes over 5 ms. Modes:
  buffered  pwrite + fdatasync (what graft's writer does)
  direct    O_DIRECT | O_DSYNC pwrite of the 4 KiB pages the record touches (no page cache,
            no journal commit for the data)
  none      the same pacing loop without any I/O (the machine's own scheduling noise)

Usage: python3 scripts/fsync-stalls.py MODE [--secs 15] [--rate 2000] [--dir target]
"""
import argparse
import mmap
import os
import time

ap = argparse.ArgumentParser()
ap.add_argument("mode", choices=["buffered", "direct", "none"])
ap.add_argument("--secs", type=float, default=15)
ap.add_argument("--rate", type=float, default=2000)
ap.add_argument("--dir", default="target")
a = ap.parse_args()

path = os.path.join(a.dir, "fsync-stalls.tmp")
fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
for _ in range(8):
    os.write(fd, b"\0" * (8 << 20))
os.fsync(fd)
os.close(fd)
flags = os.O_WRONLY | (os.O_DIRECT | os.O_DSYNC if a.mode == "direct" else 0)
fd = os.open(path, flags)
page_buf = mmap.mmap(-1, 8192)  # page-aligned, as O_DIRECT needs
rec = b"x" * 1700
pos, lat, i = 0, [], 0
t0 = time.perf_counter()
while True:
    due = t0 + i / a.rate
    now = time.perf_counter()
    if now - t0 > a.secs:
        break
    if due > now:
        time.sleep(due - now)
    s = time.perf_counter()
    if a.mode == "direct":
        page = pos // 4096 * 4096
        off = pos - page
        page_buf[off : off + len(rec)] = rec
        end = pos + len(rec)
        n = (end - page + 4095) // 4096 * 4096
        os.pwrite(fd, memoryview(page_buf)[:n], page)
        pos = end
        if pos // 4096 * 4096 != page:
            moved = pos // 4096 * 4096 - page
            page_buf[0:4096] = page_buf[moved : moved + 4096]
    elif a.mode == "buffered":
        os.pwrite(fd, rec, pos)
        pos += len(rec)
        os.fdatasync(fd)
    lat.append(time.perf_counter() - s)
    i += 1
os.close(fd)
os.unlink(path)
lat.sort()
n = len(lat)


def q(p):
    return lat[min(n - 1, int(p * n))] * 1e3


print(
    f"{a.mode}: {n} writes at {a.rate:.0f}/s: p50 {q(.5):.3f} ms, p99 {q(.99):.3f} ms, "
    f"p99.9 {q(.999):.3f} ms, max {lat[-1] * 1e3:.2f} ms, over 5 ms: {sum(x > 0.005 for x in lat)}"
)
