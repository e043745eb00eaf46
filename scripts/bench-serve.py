#!/usr/bin/env python3
"""Load a running `kestrel serve` with concurrent streaming completions and report what a client
sees: time to first token and inter-token latency (p50, p99), each stream's decode rate, and the
aggregate tokens/s.

  python3 scripts/bench-serve.py --url http://127.0.0.1:8080 --clients 4 --requests 4 \
      --prompt-tokens 512 --max-tokens 128 --vocab 32000

Every request is `POST /v1/completions` with a prompt of random token ids (a different one per
request, so that no session's cache holds it), greedy, `ignore_eos`, streamed with
`include_usage`. With `--shared-prefix N` every prompt begins with the same N ids (a system
prompt, a few-shot header) before its own: what a server that reuses cached prefixes saves
shows in the time to first token and in the cached prompt tokens reported. Python's standard library only, so that it runs wherever the server does.
Time to first token (TTFT) is from sending a request to its first text; inter-token latency (ITL)
is every gap between two consecutive text events of a stream, pooled over all streams; both as
p50 and p99 (nearest rank). Per-stream rates are medians with the spread as min..max; the
aggregate is all completion tokens over the wall time from the first request sent to the last
stream closed.
"""
import argparse
import http.client
import json
import random
import statistics
import threading
import time
import urllib.parse


def one_request(url, ids, max_tokens):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = json.dumps({"prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
    first = None
    usage = None
    arrivals = []  # the time of each event that carried text
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("choices") and chunk["choices"][0].get("text"):
            arrivals.append(time.perf_counter())
            if first is None:
                first = arrivals[-1]
        if chunk.get("usage"):
            usage = chunk["usage"]
    end = time.perf_counter()
    conn.close()
    if usage is None or first is None:
        raise RuntimeError("the stream ended without text or usage")
    n = usage["completion_tokens"]
    return {"ttft": first - t0, "decode_tps": (n - 1) / (end - first) if n > 1 else 0.0,
            "tokens": n, "prompt": usage["prompt_tokens"], "t0": t0, "end": end,
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "gaps": [b - a for a, b in zip(arrivals, arrivals[1:])]}


def percentile(values, q):
    """The nearest-rank q-th percentile (0 < q <= 100) of a non-empty list."""
    v = sorted(values)
    return v[max(0, min(len(v) - 1, -(-len(v) * q // 100) - 1))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--requests", type=int, default=4, help="per client, one after another")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--vocab", type=int, required=True, help="prompt ids are drawn below this")
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="ids every prompt begins with (counted in --prompt-tokens)")
    ap.add_argument("--warmup", type=int, default=1, help="requests before timing")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rng = random.Random(1)

    shared = [rng.randrange(3, a.vocab) for _ in range(min(a.shared_prefix, a.prompt_tokens))]

    def prompt():
        return shared + [rng.randrange(3, a.vocab) for _ in range(a.prompt_tokens - len(shared))]

    for _ in range(a.warmup):
        one_request(a.url, prompt(), a.max_tokens)
    prompts = [[prompt() for _ in range(a.requests)] for _ in range(a.clients)]
    results, errors = [], []
    lock = threading.Lock()

    def client(i):
        for ids in prompts[i]:
            try:
                r = one_request(a.url, ids, a.max_tokens)
                with lock:
                    results.append(r)
            except Exception as e:  # reported below; the run goes on
                with lock:
                    errors.append(str(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
    t_start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t_start
    if not results:
        raise SystemExit(f"no request completed: {errors[:3]}")

    def spread(key, scale=1.0):
        v = [r[key] * scale for r in results]
        return statistics.median(v), min(v), max(v)

    ttfts = [r["ttft"] * 1000.0 for r in results]
    gaps = [g * 1000.0 for r in results for g in r["gaps"]] or [0.0]
    out = {
        "clients": a.clients, "requests": len(results), "errors": len(errors),
        "prompt_tokens": results[0]["prompt"], "completion_tokens": sum(r["tokens"] for r in results),
        "cached_prompt_tokens": sum(r["cached"] for r in results),
        "ttft_ms": spread("ttft", 1000.0), "stream_decode_tps": spread("decode_tps"),
        "ttft_ms_p50": percentile(ttfts, 50), "ttft_ms_p99": percentile(ttfts, 99),
        "itl_ms_p50": percentile(gaps, 50), "itl_ms_p99": percentile(gaps, 99),
        "aggregate_tps": sum(r["tokens"] for r in results) / wall, "wall_s": wall,
    }
    if a.json:
        print(json.dumps(out))
        return
    m, lo, hi = out["ttft_ms"]
    dm, dlo, dhi = out["stream_decode_tps"]
    print(f"clients {a.clients}: {len(results)} requests ({len(errors)} failed), prompt "
          f"{out['prompt_tokens']} tokens ({out['cached_prompt_tokens']} cached in all); time to first token p50 {out['ttft_ms_p50']:.1f} ms, "
          f"p99 {out['ttft_ms_p99']:.1f} ms ({lo:.1f}..{hi:.1f}); inter-token p50 "
          f"{out['itl_ms_p50']:.2f} ms, p99 {out['itl_ms_p99']:.2f} ms; "
          f"per stream {dm:.1f} tok/s ({dlo:.1f}..{dhi:.1f}); aggregate {out['aggregate_tps']:.1f} "
          f"tok/s over {wall:.1f} s")
    if errors:
        print("first errors:", errors[:3])


if __name__ == "__main__":
    main()
