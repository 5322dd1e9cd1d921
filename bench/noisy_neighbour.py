"""One tenant's flood against another tenant's short chat, on any
OpenAI-compatible server with API keys (kvfence `serve --config`), with a
stdlib client, a fresh connection per request, streaming so time to first
token is the first content chunk's arrival.

1. alone: the victim (key B) sends R short chats one after another; its
   time to first token (TTFT) alone.
2. flood: the attacker (key A) keeps C long completions in flight (prompts
   of about P tokens, M completion tokens each, ignore_eos), and once they
   are under way the victim sends the same R chats again.

Prints the victim's TTFT p50/p90 alone and during the flood, their ratio
(I11's figure: during ÷ alone), and the attacker's output tokens/s over
its whole run (until its last request, started before the victim was
done, ends). `--n` makes each attacker request ask for `n` choices instead,
and `--schema-kib` adds a JSON schema of about that size (structured
output) to each.

Run:
  python3 bench/noisy_neighbour.py --base-url http://127.0.0.1:8000 \\
      --key-a KEY_A --key-b KEY_B --model smollm2
"""
import argparse
import http.client
import json
import random
import statistics
import threading
import time
import urllib.parse

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee "
         "zulu").split()


def words(seed, n):
    """`n` words drawn from a generator seeded with `seed`: prompts of
    different seeds share no prefix, so the prefix cache spares the flood
    nothing."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def schema(kib):
    """A JSON schema of about `kib` KiB: an object of many optional fields."""
    fields, size, i = {}, 0, 0
    while size < kib * 1024:
        name = f"field_{i}_{WORDS[i % len(WORDS)]}"
        fields[name] = {"type": "string", "enum": [words(i, 3), words(i + 1, 3)]}
        size += len(name) + 60
        i += 1
    return {"type": "object", "properties": fields, "additionalProperties": False}


def stream(base, key, body, path):
    """One streamed request; returns (ttft seconds, content chunks, status)."""
    url = urllib.parse.urlparse(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=900)
    body = dict(body, stream=True)
    start = time.perf_counter()
    conn.request("POST", path, json.dumps(body),
                 {"content-type": "application/json", "authorization": f"Bearer {key}"})
    response = conn.getresponse()
    if response.status != 200:
        detail = response.read()[:300]
        conn.close()
        return None, 0, (response.status, detail)
    ttft, chunks = None, 0
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for choice in chunk.get("choices") or []:
            piece = choice.get("delta", {}).get("content") or choice.get("text") or ""
            if piece:
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - start
    conn.close()
    return ttft or (time.perf_counter() - start), chunks, 200


def victim_round(args, label):
    """The victim's requests one after another: their TTFTs, and the
    failures (status, time taken) — a failure is reported, not retried."""
    ttfts, failed = [], []
    for i in range(args.rounds):
        body = {"model": args.model, "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": f"Say hello to {WORDS[i % 26]}."}]}
        start = time.perf_counter()
        ttft, _, status = stream(args.base_url, args.key_b, body, "/v1/chat/completions")
        if status != 200:
            failed.append((status[0], round(time.perf_counter() - start, 1)))
            print(f"victim request failed {label}: {status}")
            continue
        ttfts.append(ttft)
    return ttfts, failed


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--key-a", required=True, help="the attacker's API key")
    parser.add_argument("--key-b", required=True, help="the victim's API key")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--concurrency", type=int, default=16, help="attacker requests in flight")
    parser.add_argument("--prompt-words", type=int, default=1100,
                        help="attacker prompt length in words (~1,500 SmolLM2 tokens)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="victim requests per phase")
    parser.add_argument("--warm-up", type=float, default=2.0,
                        help="seconds the flood runs before the victim starts")
    parser.add_argument("--n", type=int, default=1, help="choices per attacker request")
    parser.add_argument("--schema-kib", type=int, default=0,
                        help="JSON schema size per attacker request (0: none)")
    args = parser.parse_args()

    alone, _ = victim_round(args, "alone")

    stop = threading.Event()
    produced, failures, lock = [0], [], threading.Lock()
    body = {"model": args.model, "max_tokens": args.max_tokens, "temperature": 0,
            "ignore_eos": True, "n": args.n}
    if args.schema_kib:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "flood", "schema": schema(args.schema_kib)}}

    def attacker(worker):
        i = 0
        while not stop.is_set():
            prompt = words(worker * 1000 + i, args.prompt_words)
            _, chunks, status = stream(args.base_url, args.key_a,
                                       dict(body, prompt=prompt), "/v1/completions")
            with lock:
                produced[0] += chunks
                if status != 200:
                    failures.append(status)
            i += 1

    threads = [threading.Thread(target=attacker, args=(w,), daemon=True)
               for w in range(args.concurrency)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    time.sleep(args.warm_up)
    during, victim_failed = victim_round(args, "during the flood")
    stop.set()
    for thread in threads:
        thread.join()
    # The attacker's requests in flight when the victim is done run to
    # their end and count: its output over its whole run.
    elapsed = time.perf_counter() - started

    def row(name, values):
        return f"{name:>18}: TTFT p50 {pct(values, 50) * 1000:8.1f} ms  p90 {pct(values, 90) * 1000:8.1f} ms"

    print(row("victim alone", alone))
    if during:
        print(row("victim in flood", during))
        print(f"{'ratio':>18}: p50 {statistics.median(during) / statistics.median(alone):.1f}x"
              f"  p90 {pct(during, 90) / pct(alone, 90):.1f}x")
    print(f"{'victim failures':>18}: {len(victim_failed)} of {args.rounds} {victim_failed}")
    print(f"{'attacker':>18}: {produced[0] / elapsed:.1f} output chunks/s, "
          f"{len(failures)} refused {sorted(set(str(f[0]) for f in failures))}")


if __name__ == "__main__":
    main()
