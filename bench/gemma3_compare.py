"""Time to first token and decode time per token of Gemma 3 270M (Q4_K_M),
kvfence next to llama.cpp, the same file, one stream, greedy, 128 tokens
that never stop early (kvfence: `ignore_eos`; llama.cpp's base model does
not end this text within them — checked by the token count).

    kvfence serve --model gemma3-270m --mode colocated --port 8313 &
    python3 bench/gemma3_compare.py kvfence http://127.0.0.1:8313
    /tmp/lv/bin/python bench/gemma3_compare.py llama.cpp MODEL.gguf

(the llama.cpp side is llama-cpp-python built as
`scripts/llama_cpp_fixtures.py` describes). Best of three runs each: the
first token's time alone, then 129 tokens; decode per token is the
difference over 128. Then the first token of prompts of about 512 and 2,048
tokens (prefill), each run's prompt different so no cache answers it.
"""

import json
import sys
import time
import urllib.request

PROMPT = "The history of the Roman Empire begins"
RUNS = 3


def kvfence(url):
    def run(max_tokens):
        body = json.dumps({"model": "gemma3-270m", "prompt": PROMPT, "max_tokens": max_tokens,
                           "temperature": 0, "ignore_eos": True}).encode()
        request = urllib.request.Request(url + "/v1/completions", body,
                                          {"content-type": "application/json"})
        started = time.time()
        answer = json.load(urllib.request.urlopen(request))
        assert answer["usage"]["completion_tokens"] == max_tokens, answer["usage"]
        return time.time() - started
    return run


def llama_cpp(path):
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=1024, n_threads=2, n_batch=512, verbose=False)

    def run(max_tokens):
        llm.reset()
        started = time.time()
        answer = llm.create_completion(PROMPT, max_tokens=max_tokens, temperature=0, stop=[])
        assert answer["usage"]["completion_tokens"] == max_tokens, answer["usage"]
        return time.time() - started
    return run


def long_prompt(tokens):
    """A prompt of about `tokens` tokens of plain English (one word, one
    token, give or take); the exact count is printed with the result."""
    words = ("the river runs past the old mill and under the stone bridge "
             "where children wait for the evening train ").split()
    return " ".join(words[i % len(words)] for i in range(tokens))


def prefill_kvfence(url, prompt):
    body = json.dumps({"model": "gemma3-270m", "prompt": prompt, "max_tokens": 1,
                       "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", body,
                                      {"content-type": "application/json"})
    started = time.time()
    answer = json.load(urllib.request.urlopen(request))
    return time.time() - started, answer["usage"]["prompt_tokens"]


def prefill_llama_cpp(llm, prompt):
    llm.reset()
    started = time.time()
    answer = llm.create_completion(prompt, max_tokens=1, temperature=0)
    return time.time() - started, answer["usage"]["prompt_tokens"]


def main():
    which, target = sys.argv[1], sys.argv[2]
    run = kvfence(target) if which == "kvfence" else llama_cpp(target)
    first = min(run(1) for _ in range(RUNS))
    whole = min(run(129) for _ in range(RUNS))
    print(f"{which}: first token {first * 1e3:.1f} ms, decode {(whole - first) / 128 * 1e3:.2f} ms/token")
    if which == "kvfence":
        prefill = lambda prompt: prefill_kvfence(target, prompt)  # noqa: E731
    else:
        from llama_cpp import Llama

        llm = Llama(model_path=target, n_ctx=4096, n_threads=2, n_batch=512, verbose=False)
        prefill = lambda prompt: prefill_llama_cpp(llm, prompt)  # noqa: E731
    for tokens in (512, 2048):
        # A different prompt each run, so no prefix cache can answer it.
        runs = [prefill(f"{i} " + long_prompt(tokens)) for i in range(RUNS)]
        seconds, count = min(runs)
        print(f"{which}: first token of a {count}-token prompt {seconds * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
