"""The prefix cache under two workloads, against any OpenAI-compatible
server (kvfence with the cache on or off, llama.cpp's llama-server), with
one stdlib client, a fresh connection per request, streaming so time to
first token is measured as the first content chunk's arrival.

- multi-turn: C conversations of T turns run side by side; each turn's
  prompt is the conversation so far (every earlier question and answer)
  plus a new question of about Q words. Greedy, A completion tokens.
- system-prompt: N requests, K at a time, each a shared system prompt of
  about S words followed by its own question. With --chat they are chat
  requests, the system prompt a system message: what
  `kvfence serve --public-system-prompt FILE` shares (write FILE with
  --write-system-prompt FILE and exit).

Prints TTFT p50/p90 per turn (multi-turn) and overall, and output tokens/s.

Run:
  python3 bench/prefix_cache.py --base-url http://127.0.0.1:8000 --model smollm2
  python3 bench/prefix_cache.py --base-url http://127.0.0.1:8080 --model x --llama
  python3 bench/prefix_cache.py --write-system-prompt /tmp/system.txt
  python3 bench/prefix_cache.py --base-url URL --only system-prompt --chat
"""
import argparse
import http.client
import json
import statistics
import threading
import time
import urllib.parse

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee "
         "zulu").split()


def words(seed, n):
    return " ".join(WORDS[(seed * 7 + i * 11 + (i * i) % 5) % len(WORDS)] for i in range(n))


def stream(base, model, prompt, max_tokens, llama):
    """Sends one streamed completion (a chat completion when `prompt` is a
    list of messages); returns (ttft seconds, text, total seconds)."""
    url = urllib.parse.urlparse(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
    chat = isinstance(prompt, list)
    body = {"model": model, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    body["messages" if chat else "prompt"] = prompt
    if llama:
        body["cache_prompt"] = True
    start = time.perf_counter()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, (response.status, response.read()[:300])
    ttft, text = None, []
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        choice = chunk["choices"][0] if chunk.get("choices") else {}
        piece = choice.get("delta", {}).get("content") if chat else choice.get("text")
        piece = piece or ""
        if piece and ttft is None:
            ttft = time.perf_counter() - start
        text.append(piece)
    conn.close()
    return ttft or (time.perf_counter() - start), "".join(text), time.perf_counter() - start


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def multi_turn(args):
    ttfts = [[None] * args.conversations for _ in range(args.turns)]
    tokens = [0]
    lock = threading.Lock()

    def conversation(c):
        history = f"A conversation between a user and an assistant, number {c}.\n"
        for t in range(args.turns):
            history += f"User: {words(c * 100 + t, args.question_words)}\nAssistant:"
            ttft, text, _ = stream(args.base_url, args.model, history, args.answer_tokens, args.llama)
            history += text + "\n"
            ttfts[t][c] = ttft
            with lock:
                tokens[0] += args.answer_tokens

    start = time.perf_counter()
    threads = [threading.Thread(target=conversation, args=(c,)) for c in range(args.conversations)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - start
    for t in range(args.turns):
        row = [x * 1000 for x in ttfts[t]]
        print(f"multi-turn turn {t + 1}: TTFT p50 {pct(row, 50):.0f} ms, p90 {pct(row, 90):.0f} ms")
    every = [x * 1000 for row in ttfts for x in row]
    print(f"multi-turn all: TTFT p50 {pct(every, 50):.0f} ms, p90 {pct(every, 90):.0f} ms, "
          f"output {tokens[0] / elapsed:.1f} tok/s, {elapsed:.1f} s")


def system_text(args):
    return "System: " + words(999, args.system_words) + "\n"


def system_prompt(args):
    system = system_text(args)
    ttfts, tokens = [], [0]
    lock = threading.Lock()
    queue = list(range(args.requests))

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                i = queue.pop(0)
            question = words(i, 30)
            if args.chat:
                prompt = [{"role": "system", "content": system},
                          {"role": "user", "content": question}]
            else:
                prompt = system + f"User: {question}\nAssistant:"
            ttft, _, _ = stream(args.base_url, args.model, prompt, args.answer_tokens, args.llama)
            with lock:
                ttfts.append(ttft * 1000)
                tokens[0] += args.answer_tokens

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - start
    print(f"system-prompt: TTFT p50 {pct(ttfts, 50):.0f} ms, p90 {pct(ttfts, 90):.0f} ms, "
          f"output {tokens[0] / elapsed:.1f} tok/s, {elapsed:.1f} s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--llama", action="store_true", help="the server is llama-server")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--question-words", type=int, default=80)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--system-words", type=int, default=400)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--only", choices=["multi-turn", "system-prompt"])
    ap.add_argument("--chat", action="store_true",
                    help="system-prompt: chat requests, the system prompt a system message")
    ap.add_argument("--write-system-prompt", metavar="FILE",
                    help="write the system prompt to FILE and exit")
    args = ap.parse_args()
    if args.write_system_prompt:
        with open(args.write_system_prompt, "w") as f:
            f.write(system_text(args))
        return
    if not args.base_url:
        ap.error("--base-url is required")
    if args.only != "system-prompt":
        multi_turn(args)
    if args.only != "multi-turn":
        system_prompt(args)


if __name__ == "__main__":
    main()
