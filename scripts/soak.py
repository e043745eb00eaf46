#!/usr/bin/env python3
"""Soak test: one `kestrel chat` session generating until --tokens have come out, its
conversation rolling over the context many times, while host RSS, device memory and the
reply speed are watched. Fails (exit 1) when memory grows or the speed drops.

  python3 scripts/soak.py --kestrel build/kestrel -m MODEL_DIR --tokens 100000 -c 2048

It feeds chat one user line at a time on stdin (chat then prints only the replies on stdout)
and reads each reply's statistics line from stderr ("[prompt N tokens, X tok/s | reply M
tokens, Y tok/s | context a/b]"). Host RSS comes from /proc; device memory from nvidia-smi
(the process's own use) when there is one. The speed compared is the median reply tok/s of
the first --window replies after the first rollover (before it the context is shorter) against
the last --window; memory is compared after the first --window replies (warm-up: graphs
captured, caches sized) against the end.
"""
import argparse
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time

STATS = re.compile(r"\[prompt (\d+) tokens, ([\d.]+) tok/s \| reply (\d+) tokens, ([\d.]+) tok/s"
                   r" \| context (\d+)/(\d+)\]")
WORDS = ("the model reads every weight once per token so the decode step is bound by memory "
         "bandwidth and a quantized weight moves fewer bytes which is why four bit kernels "
         "decode faster than half precision ones on the same device").split()


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def device_mib(pid):
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        p, _, mib = line.partition(",")
        if p.strip() == str(pid):
            return int(mib)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kestrel", default="build/kestrel")
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--tokens", type=int, default=100000)
    ap.add_argument("-c", "--ctx", type=int, default=2048)
    ap.add_argument("-n", "--reply-tokens", type=int, default=256)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--window", type=int, default=20, help="replies at each end compared")
    ap.add_argument("--max-rss-growth-mib", type=float, default=16)
    ap.add_argument("--max-slowdown", type=float, default=0.02)
    a = ap.parse_args()

    cmd = [a.kestrel, "chat", "-m", a.model, "-c", str(a.ctx), "-n", str(a.reply_tokens),
           "--device", a.device, "--template", "raw", "--temp", "0.8", "-s", "1"]
    # CUDA loads a kernel's module when it first runs (lazy loading), which takes device
    # memory the first time a rare path runs (a prompt length's attention kernel, say): not a
    # leak, but indistinguishable from one in nvidia-smi. Loading every module at start keeps
    # the device figure to what the engine allocates.
    env = dict(os.environ)
    env.setdefault("CUDA_MODULE_LOADING", "EAGER")
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, bufsize=1, env=env)
    rng = random.Random(1)
    replies, samples = [], []  # (reply tokens, tok/s, context), (replies so far, rss, device)
    total, rollovers, first_roll, t0 = 0, 0, None, time.time()
    try:
        while total < a.tokens:
            p.stdin.write(" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))) + "\n")
            p.stdin.flush()
            while True:
                line = p.stderr.readline()
                if not line:
                    raise SystemExit(f"soak: kestrel chat ended early (exit {p.wait()})")
                if "outgrew the context" in line:
                    rollovers += 1
                    if first_roll is None:
                        first_roll = len(replies)
                m = STATS.search(line)
                if m:
                    break
            n, tps, ctx = int(m.group(3)), float(m.group(4)), int(m.group(5))
            replies.append((n, tps, ctx))
            total += n
            if len(replies) % 10 == 0 or len(replies) == a.window:
                samples.append((len(replies), rss_kib(p.pid), device_mib(p.pid)))
        samples.append((len(replies), rss_kib(p.pid), device_mib(p.pid)))
    finally:
        p.stdin.close()
        p.wait(timeout=60)

    # From the first rollover on, the context cycles between what the drop leaves and full:
    # before it, replies run over a shorter context, so they are not the reference.
    start = first_roll or 0
    w = min(a.window, (len(replies) - start) // 2)
    if w < 1:
        raise SystemExit("soak: too few replies after the first rollover; raise --tokens")
    first = statistics.median(r[1] for r in replies[start:start + w] if r[0] > 1)
    last = statistics.median(r[1] for r in replies[-w:] if r[0] > 1)
    warm = next(s for s in samples if s[0] >= w)
    end = samples[-1]
    print(f"soak: {total} tokens in {len(replies)} replies over {time.time() - t0:.0f} s, "
          f"{rollovers} context rollovers (context {a.ctx})")
    print(f"reply speed, median of {w} (from reply {start}): first {first:.1f} tok/s, last {last:.1f} tok/s "
          f"({(last / first - 1) * 100:+.2f}%)")
    print(f"host RSS: {warm[1] / 1024:.1f} MiB after {warm[0]} replies, {end[1] / 1024:.1f} MiB "
          f"at the end")
    if warm[2] is not None:
        print(f"device memory: {warm[2]} MiB after {warm[0]} replies, {end[2]} MiB at the end")
    # Where the memory moved: each sample whose device memory differs from the one before, and
    # the host RSS every quarter of the run, so that a step (a one-time allocation) can be told
    # from a steady climb.
    steps = [f"reply {s[0]}: {p[2]} -> {s[2]} MiB" for p, s in zip(samples, samples[1:])
             if s[2] != p[2]]
    if steps:
        print("device memory steps: " + "; ".join(steps[:12]))
    quarters = [samples[min(len(samples) - 1, i * len(samples) // 4)] for i in range(5)]
    print("host RSS by quarter: " + ", ".join(f"{s[1] / 1024:.1f}" for s in quarters) + " MiB")
    ok = True
    if (end[1] - warm[1]) / 1024 > a.max_rss_growth_mib:
        print("soak: host RSS grew", file=sys.stderr)
        ok = False
    if warm[2] is not None and end[2] != warm[2]:
        print("soak: device memory changed", file=sys.stderr)
        ok = False
    if last < first * (1 - a.max_slowdown):
        print("soak: replies slowed down", file=sys.stderr)
        ok = False
    if rollovers == 0:
        print("soak: the conversation never outgrew the context", file=sys.stderr)
        ok = False
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
