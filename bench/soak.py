#!/usr/bin/env python3
"""Soak a running kvfence (or any OpenAI-compatible) server; not run in CI.

Mixed traffic for N minutes from several tenants: plain completions,
streamed chats, streams cut off part-way (aborts), every prompt distinct.
Greedy canary prompts are answered alone first and again under load; any
difference is a divergence. The server's resident memory is sampled from
/proc every few seconds (pass its --pid), and at the end the script waits
for the pools to drain and reads them from /metrics.

It reports the RSS slope after warm-up (KiB per minute, least squares),
answers by status (5xx counted apart), canary divergences and the pages
still held. Exit status 1 if anything but a whole answer or a deliberate
abort came back (5xx counted apart), a canary diverged or a page was held.

    python3 bench/soak.py --base-url http://127.0.0.1:8000 --pid PID \\
        --metrics-url http://127.0.0.1:9464/metrics --key KEY_A --key KEY_B \\
        --minutes 30

Standard library only.
"""

import argparse
import http.client
import json
import random
import threading
import time
import urllib.parse
import urllib.request

CANARIES = [
    "Name three colours of the rainbow.",
    "What is two plus two?",
    "Write one sentence about the sea.",
]


def request(base, path, body, key, stream=False, cut_after=None, timeout=120):
    """POSTs JSON on a fresh connection; returns (status, text)."""
    url = urllib.parse.urlparse(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    try:
        conn.request("POST", path, json.dumps(body), headers)
        response = conn.getresponse()
        if not stream:
            data = json.loads(response.read() or b"null")
            if response.status != 200:
                return response.status, None
            choice = data["choices"][0]
            return 200, choice.get("text", choice.get("message", {}).get("content"))
        text, chunks = [], 0
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunks += 1
            if cut_after is not None and chunks >= cut_after:
                return "aborted", None
            event = json.loads(line[6:])
            if "error" in event:
                return "stream-error", None
            delta = event["choices"][0] if event.get("choices") else {}
            text.append(delta.get("delta", {}).get("content") or delta.get("text") or "")
        return response.status, "".join(text)
    except (OSError, http.client.HTTPException, ValueError) as error:
        return f"client-error:{type(error).__name__}", None
    finally:
        conn.close()


def canary(base, key, prompt):
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 24,
            "temperature": 0}
    return request(base, "/v1/chat/completions", body, key)


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def slope_per_minute(samples):
    """Least-squares slope of (seconds, KiB) samples, in KiB per minute."""
    if len(samples) < 2:
        return 0.0
    n = len(samples)
    mx = sum(t for t, _ in samples) / n
    my = sum(v for _, v in samples) / n
    var = sum((t - mx) ** 2 for t, _ in samples)
    cov = sum((t - mx) * (v - my) for t, v in samples)
    return 60.0 * cov / var if var else 0.0


# Pages a request or a fault still holds. Free pages are nobody's; cached
# and public ones belong to the prefix cache, which gives them up to the
# next lease that needs room, so a drained server keeps them by design.
HELD_STATES = ('state="leased"', 'state="shared"', 'state="quarantined"')


def pages_held(metrics_url):
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    held = 0.0
    for line in text.splitlines():
        if line.startswith("kvfence_pool_pages{") and any(s in line for s in HELD_STATES):
            held += float(line.rsplit(" ", 1)[1])
    return held


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--metrics-url", help="default: BASE/metrics")
    parser.add_argument("--pid", type=int, help="the server's process, for RSS")
    parser.add_argument("--key", action="append", default=[], help="a tenant's API key (repeat)")
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--warm-up-minutes", type=float, default=2)
    parser.add_argument("--report", help="also write the results as JSON here")
    args = parser.parse_args()
    keys = args.key or [None]
    metrics_url = args.metrics_url or args.base_url.rstrip("/") + "/metrics"

    solo = {prompt: canary(args.base_url, keys[0], prompt) for prompt in CANARIES}
    started = time.time()
    stop_at = started + args.minutes * 60
    counts, divergences, lock = {}, [], threading.Lock()
    serial = [0]

    def count(status):
        with lock:
            counts[str(status)] = counts.get(str(status), 0) + 1

    def worker(seed):
        rng = random.Random(seed)
        while time.time() < stop_at:
            with lock:
                serial[0] += 1
                n = serial[0]
            key = rng.choice(keys)
            words = " ".join(rng.choice(["river", "stone", "cloud", "lamp", "field"]) for _ in range(rng.randint(3, 40)))
            kind = rng.random()
            if kind < 0.1:
                prompt = rng.choice(CANARIES)
                status, text = canary(args.base_url, keys[0], prompt)
                count(status)
                if status == 200 and solo[prompt][0] == 200 and text != solo[prompt][1]:
                    with lock:
                        divergences.append(prompt)
            elif kind < 0.45:
                body = {"prompt": f"{n}: {words}", "max_tokens": rng.randint(1, 32)}
                count(request(args.base_url, "/v1/completions", body, key)[0])
            elif kind < 0.8:
                body = {"messages": [{"role": "user", "content": f"{n}: {words}"}],
                        "max_tokens": rng.randint(1, 32), "stream": True}
                count(request(args.base_url, "/v1/chat/completions", body, key, stream=True)[0])
            else:
                body = {"prompt": f"{n}: {words}", "max_tokens": 64, "stream": True,
                        "ignore_eos": True}
                cut = rng.randint(1, 8)
                count(request(args.base_url, "/v1/completions", body, key, stream=True, cut_after=cut)[0])

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.concurrency)]
    for t in threads:
        t.start()
    samples = []
    while time.time() < stop_at:
        if args.pid:
            samples.append((time.time() - started, rss_kib(args.pid)))
        time.sleep(5)
    for t in threads:
        t.join(timeout=180)
    deadline = time.time() + 60
    held = pages_held(metrics_url)
    while held and time.time() < deadline:
        time.sleep(0.5)
        held = pages_held(metrics_url)
    warm = [(t, v) for t, v in samples if t >= args.warm_up_minutes * 60]
    server_errors = sum(v for k, v in counts.items() if k.startswith("5"))
    # Anything but a whole answer or a deliberate abort: a refusal (a wrong
    # key, a full queue), a stream that ended in an error, a client error.
    other_failures = sum(v for k, v in counts.items() if k not in ("200", "aborted"))
    result = {
        "minutes": args.minutes,
        "requests": sum(counts.values()),
        "by_status": counts,
        "server_errors": server_errors,
        "other_failures": other_failures,
        "canary_divergences": len(divergences),
        "pages_held_at_end": held,
        "rss_kib_first_last": [samples[0][1], samples[-1][1]] if samples else None,
        "rss_slope_kib_per_minute_after_warm_up": round(slope_per_minute(warm), 1),
    }
    print(json.dumps(result, indent=2))
    if args.report:
        with open(args.report, "w") as out:
            json.dump(result, out, indent=2)
    bad = server_errors or other_failures or divergences or held or not samples
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
