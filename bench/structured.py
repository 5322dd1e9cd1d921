#!/usr/bin/env python3
"""Decode speed with a JSON schema on vs off, against a running server.

Each round sends the same chat request twice: once with a JSON schema that
forces a long answer (a list of records), once without a schema and with
`ignore_eos`, asked for exactly as many tokens as the constrained answer
had. Output tokens per second of the two, measured in the same run,
alternating, give the cost of constrained decoding (the per-step token mask
and the sampler's masking). Standard library only.

    cargo run --release -- serve --model smollm2 --port 8000 &
    python3 bench/structured.py --base-url http://127.0.0.1:8000 --rounds 6
"""

import argparse
import concurrent.futures
import json
import statistics
import time
import urllib.request

SCHEMA = {
    "type": "array",
    "minItems": 12,
    "maxItems": 12,
    "items": {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "maxLength": 16},
        },
        "required": ["name", "age", "city"],
    },
}

QUESTION = "List twelve people with their name, age and city, as JSON."


def post(base_url, body):
    request = urllib.request.Request(
        base_url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.load(response)
    return answer, time.perf_counter() - started


TEMPERATURE = 0.7


def body(model, schema, max_tokens, seed):
    payload = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": max_tokens,
        "temperature": TEMPERATURE,
        "seed": seed,
    }
    if schema:
        payload["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "people", "schema": SCHEMA},
        }
    else:
        payload["ignore_eos"] = True
    return payload


def round_trip(base_url, model, concurrency, seed):
    """One constrained batch, then the unconstrained batch of the same size."""
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        started = time.perf_counter()
        constrained = list(
            pool.map(
                lambda i: post(base_url, body(model, True, 600, seed + i)),
                range(concurrency),
            )
        )
        constrained_wall = time.perf_counter() - started
        tokens = [a["usage"]["completion_tokens"] for a, _ in constrained]
        for answer, _ in constrained:
            json.loads(answer["choices"][0]["message"]["content"])
        started = time.perf_counter()
        free = list(
            pool.map(
                lambda i: post(base_url, body(model, False, tokens[i], seed + i)),
                range(concurrency),
            )
        )
        free_wall = time.perf_counter() - started
    free_tokens = sum(a["usage"]["completion_tokens"] for a, _ in free)
    return sum(tokens) / constrained_wall, free_tokens / free_wall, sum(tokens)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args()
    global TEMPERATURE
    TEMPERATURE = args.temperature
    results = {}
    for concurrency in args.concurrency:
        on, off, counts = [], [], []
        for r in range(args.rounds):
            with_schema, without, tokens = round_trip(
                args.base_url, args.model, concurrency, 100 * r
            )
            on.append(with_schema)
            off.append(without)
            counts.append(tokens)
        ratio = statistics.median(a / b for a, b in zip(on, off))
        results[concurrency] = {
            "schema_tok_s": statistics.median(on),
            "free_tok_s": statistics.median(off),
            "ratio": ratio,
            "tokens_per_batch": statistics.median(counts),
        }
        print(
            f"concurrency {concurrency}: schema on {statistics.median(on):.1f} tok/s, "
            f"off {statistics.median(off):.1f} tok/s, on/off {ratio:.2f} "
            f"(median of {args.rounds} rounds, {statistics.median(counts):.0f} tokens a batch)"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
