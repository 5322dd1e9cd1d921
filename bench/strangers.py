"""Idle strangers against a tenant: how much a tenant's request slows while
an unauthenticated peer holds many idle connections to the API, reopening
each one the server closes (stdlib only).

1. alone: the tenant sends R short chats one after another (fresh
   connection each, streamed; time to the last byte).
2. strangers: S sockets are opened and kept open, sending nothing; a
   closed one is reopened at once. Then the tenant sends the same chats.

Prints the tenant's time p50/p90 alone and with the strangers, and their
ratio. Run against `kvfence serve --config TENANTS` with
`--max-unauthenticated-connections-per-address` at least S if the strangers
come from one address (as here, loopback), so the test is of the total cap.

  python3 bench/strangers.py --base-url http://127.0.0.1:8000 --key KEY
"""
import argparse
import http.client
import json
import socket
import statistics
import threading
import time
import urllib.parse


def chat(url, key, model, i):
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    body = {"model": model, "max_tokens": 8, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": f"Say hello to number {i}."}]}
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"content-type": "application/json", "authorization": f"Bearer {key}"})
    response = conn.getresponse()
    response.read()
    conn.close()
    if response.status != 200:
        raise SystemExit(f"tenant request failed: {response.status}")
    return time.perf_counter() - start


def rounds(args, url):
    return [chat(url, args.key, args.model, i) for i in range(args.rounds)]


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--strangers", type=int, default=1100)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    url = urllib.parse.urlparse(args.base_url)

    alone = rounds(args, url)

    stop = threading.Event()
    reopened = [0]

    def stranger():
        while not stop.is_set():
            try:
                sock = socket.create_connection((url.hostname, url.port), timeout=5)
            except OSError:
                time.sleep(0.01)
                continue
            sock.settimeout(0.5)
            while not stop.is_set():
                try:
                    if sock.recv(1) == b"":
                        break  # closed by the server: reopen
                except socket.timeout:
                    continue
                except OSError:
                    break
            sock.close()
            reopened[0] += 1

    threads = [threading.Thread(target=stranger, daemon=True) for _ in range(args.strangers)]
    for thread in threads:
        thread.start()
    time.sleep(3)
    during = rounds(args, url)
    stop.set()

    def row(name, values):
        return f"{name:>16}: p50 {pct(values, 50) * 1000:7.1f} ms  p90 {pct(values, 90) * 1000:7.1f} ms"

    print(row("tenant alone", alone))
    print(row("with strangers", during))
    print(f"{'ratio':>16}: p50 {statistics.median(during) / statistics.median(alone):.2f}x"
          f"  p90 {pct(during, 90) / pct(alone, 90):.2f}x")
    print(f"{'strangers':>16}: {args.strangers} sockets, {reopened[0]} closed by the server and reopened")


if __name__ == "__main__":
    main()
