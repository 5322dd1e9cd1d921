"""What keeping responses costs, and what continuing one saves (stdlib only).

1. store: R short Responses requests, alternately with `store: false` and
   `store: true` (the default), one after another; time to the whole answer.
2. turns: a conversation of T turns, continued with `previous_response_id`,
   against the same turns sent whole each time (`store: false`, the earlier
   turns as input items): each turn's time and `cached_tokens`.

Prints the medians and their ratio. Run against `kvfence serve` with the
store under test (`--responses-store FILE`, `memory`, or `postgres://...`).

  python3 bench/stored.py --base-url http://127.0.0.1:8000 --model smollm2
"""
import argparse
import http.client
import json
import random
import statistics
import time
import urllib.parse


def post(url, body, key):
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=300)
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    start = time.perf_counter()
    conn.request("POST", "/v1/responses", json.dumps(body), headers)
    response = conn.getresponse()
    answer = json.loads(response.read())
    conn.close()
    if response.status != 200:
        raise SystemExit(f"request failed: {response.status} {answer}")
    return time.perf_counter() - start, answer


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--key", default=None)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--turns", type=int, default=8)
    args = parser.parse_args()
    url = urllib.parse.urlparse(args.base_url)

    def ask(text, **extra):
        return {"model": args.model, "input": text, "max_output_tokens": 16,
                "temperature": 0, "ignore_eos": True, **extra}

    times = {False: [], True: []}
    for i in range(args.requests):
        keep = i % 2 == 1
        took, _ = post(url, ask(f"Say hello to number {i}.", store=keep), args.key)
        times[keep].append(took)
    plain, kept = statistics.median(times[False]), statistics.median(times[True])
    print(f"store false: median {plain * 1e3:.1f} ms; store true: {kept * 1e3:.1f} ms "
          f"({kept / plain:.3f}x)")

    # Fresh words every run: a conversation an earlier run sent is cached.
    nonce = f"{random.getrandbits(32):08x}"

    def conversation(continued):
        previous, items, rows = None, [], []
        for turn in range(args.turns):
            # Each conversation its own words from the start, so neither
            # reads the other's pages from the prefix cache.
            topic = "rivers and lakes" if continued else "mountains and valleys"
            text = f"Turn {turn} of {nonce}: tell me one more fact about {topic}."
            if continued:
                extra = {"previous_response_id": previous} if previous else {}
                took, answer = post(url, ask(text, **extra), args.key)
                previous = answer["id"]
            else:
                items.append({"role": "user", "content": text})
                took, answer = post(url, ask(None, store=False) | {"input": list(items)},
                                    args.key)
                items.extend(answer["output"])
            usage = answer["usage"]
            rows.append((took, usage["input_tokens"],
                         usage["input_tokens_details"]["cached_tokens"]))
        return rows

    whole, continued = conversation(False), conversation(True)
    print("turn  whole: ms  input  cached   continued: ms  input  cached")
    for turn, (w, c) in enumerate(zip(whole, continued)):
        print(f"{turn:>4}  {w[0] * 1e3:>9.1f}  {w[1]:>5}  {w[2]:>6}   "
              f"{c[0] * 1e3:>13.1f}  {c[1]:>5}  {c[2]:>6}")
    total = lambda rows: sum(r[0] for r in rows)
    print(f"all turns: whole {total(whole):.2f} s, continued {total(continued):.2f} s "
          f"({total(continued) / total(whole):.3f}x)")


if __name__ == "__main__":
    main()
