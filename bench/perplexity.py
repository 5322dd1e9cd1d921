"""Perplexity of a text through a server's OpenAI API, and through
llama.cpp on the same model file and the same text, so the two can be set
side by side.

    kvfence serve --model gemma3-270m --mode colocated --port 8313 &
    python3 bench/perplexity.py kvfence http://127.0.0.1:8313 /usr/share/common-licenses/GPL-3
    /tmp/lv/bin/python bench/perplexity.py llama.cpp MODEL.gguf /usr/share/common-licenses/GPL-3

(the llama.cpp side is llama-cpp-python built as
`scripts/llama_cpp_fixtures.py` describes: the library `llama-perplexity`
is built on.) Any OpenAI-compatible server that scores prompts with `echo`
and `logprobs` on `/v1/completions` can stand in for kvfence.

Method: the text is cut into windows of whole paragraphs (blank-line
separated) of at most WINDOW characters; each window is one prompt,
tokenized by the engine itself with its beginning-of-sequence token, and
every token after the first is scored given the ones before it in its
window. Perplexity is exp of the mean negative log-likelihood over every
scored token of every window. Both sides print the token count per window,
so a tokenizer difference shows as a different count.
"""

import json
import math
import sys
import urllib.request

WINDOW = 1500


def windows(path):
    """The text's paragraphs, grouped in order into windows of at most
    WINDOW characters (a longer paragraph is a window of its own)."""
    with open(path, encoding="utf-8") as f:
        paragraphs = [p.strip() for p in f.read().split("\n\n") if p.strip()]
    out, current = [], ""
    for paragraph in paragraphs:
        joined = current + "\n\n" + paragraph if current else paragraph
        if current and len(joined) > WINDOW:
            out.append(current)
            current = paragraph
        else:
            current = joined
    if current:
        out.append(current)
    return out


def kvfence(url):
    """Scores one window: its token count and the negative log-likelihood
    of every token after the first."""
    def score(text):
        body = json.dumps({"prompt": text, "max_tokens": 1, "temperature": 0, "echo": True,
                           "logprobs": 0}).encode()
        request = urllib.request.Request(url + "/v1/completions", body,
                                         {"content-type": "application/json"})
        answer = json.load(urllib.request.urlopen(request, timeout=600))
        prompt = answer["usage"]["prompt_tokens"]
        scores = answer["choices"][0]["logprobs"]["token_logprobs"][:prompt]
        assert scores[0] is None, "the first prompt token has no score"
        return prompt, -sum(scores[1:])
    return score


def llama_cpp(path):
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=2048, n_threads=2, n_batch=512, logits_all=True,
                verbose=False)

    def score(text):
        tokens = llm.tokenize(text.encode(), add_bos=True)
        llm.reset()
        llm.eval(tokens)
        logits = np.asarray(llm.scores[:len(tokens) - 1], dtype=np.float64)
        top = logits.max(axis=1, keepdims=True)
        log_total = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
        picked = logits[np.arange(len(tokens) - 1), tokens[1:]]
        return len(tokens), float((log_total - picked).sum())
    return score


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in ("kvfence", "llama.cpp"):
        sys.exit(__doc__)
    score = (kvfence if sys.argv[1] == "kvfence" else llama_cpp)(sys.argv[2])
    total_nll, total_scored, counts = 0.0, 0, []
    for text in windows(sys.argv[3]):
        tokens, nll = score(text)
        counts.append(tokens)
        total_nll += nll
        total_scored += tokens - 1
    print(json.dumps({
        "engine": sys.argv[1],
        "windows": len(counts),
        "tokens_per_window": counts,
        "scored_tokens": total_scored,
        "perplexity": round(math.exp(total_nll / total_scored), 4),
    }))


if __name__ == "__main__":
    main()
