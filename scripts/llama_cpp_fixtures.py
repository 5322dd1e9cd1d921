"""Golden fixtures from llama.cpp, the reference implementation, for a GGUF
model: token ids of fixed texts and greedy continuations of fixed prompts
(with llama.cpp's top two logits at every generated position, so a test
can tell a real difference from a near-tie).

llama.cpp comes from the llama-cpp-python sdist, built on this machine:

    python3 -m venv /tmp/lv
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
      -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
      /tmp/lv/bin/pip install llama-cpp-python==0.3.36 numpy
    /tmp/lv/bin/python scripts/llama_cpp_fixtures.py MODEL.gguf OUT.json
    /tmp/lv/bin/python scripts/llama_cpp_fixtures.py --seeded DIR OUT.json

(the second for the seeded files `scripts/seeded_gguf.py` writes into DIR).

CI never builds llama.cpp: the fixtures are committed and the tests
compare kvfence against them.
"""

import json
import sys

import numpy as np
from llama_cpp import Llama

TEXTS = [
    "Hello world",
    "The capital of France is Paris.",
    "  leading spaces and  double  spaces",
    "trailing whitespace \t\n",
    "Ünïcödé àccents: café, naïve, Straße, señor",
    "日本語のテキストと中文文本",
    "emoji 🦀🚀👩‍💻 and symbols ∑∫√",
    "def main():\n    for i in range(10):\n        print(i)  # comment\n",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null}}",
    "\n\n\nthree newlines then\ttabs\t\tand    four spaces",
    "<start_of_turn>user is text here<end_of_turn>",
    "1234567890 3.14159 -42 1e10",
]

PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a",
    "The quick brown fox",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at",
    "My favourite programming language is",
    "import numpy as np\n",
    "The largest planet in the solar system is",
    "In 1969, the first person to walk on the moon was",
    "A list of fruits: apple, banana,",
    "The meaning of life is",
    "To make a cup of tea, first",
    "Q: What is 2 + 2?\nA:",
    "Paris is the capital of France. Berlin is the capital of",
    "The sun rises in the",
    "SELECT * FROM users WHERE",
    "Roses are red, violets are",
    "The opposite of hot is",
    "Machine learning is a field of",
]

STEPS = 16


def seeded(directory, out_path):
    """Per-position top-5 logits of a fixed token sequence through each
    seeded file (`scripts/seeded_gguf.py`), F32 weights and F32 KV."""
    sequence = [(i * 37 + 11) % 256 for i in range(48)]
    files = {}
    for arch in ["qwen2", "qwen3", "llama", "phi3", "llama3"]:
        llm = Llama(
            model_path=f"{directory}/{arch}.gguf",
            n_ctx=256,
            n_threads=2,
            logits_all=True,
            type_k=0,
            type_v=0,
            verbose=False,
        )
        llm.eval(sequence)
        rows = []
        for position in range(len(sequence)):
            logits = np.array(llm.scores[position], dtype=np.float32)
            order = np.argsort(-logits, kind="stable")[:5]
            rows.append([[int(i), float(logits[i])] for i in order])
        files[arch] = rows
    json.dump(
        {"reference": "llama.cpp (llama-cpp-python 0.3.36 sdist), CPU, F32 KV",
         "tokens": sequence, "top5": files},
        open(out_path, "w"),
        indent=1,
    )


def main():
    if sys.argv[1] == "--seeded":
        return seeded(sys.argv[2], sys.argv[3])
    model_path, out_path = sys.argv[1], sys.argv[2]
    llm = Llama(
        model_path=model_path,
        n_ctx=2048,
        n_threads=2,
        n_batch=512,
        logits_all=True,
        verbose=False,
    )
    texts = [
        {"text": t, "ids": llm.tokenize(t.encode(), add_bos=False, special=False)}
        for t in TEXTS
    ]
    prompts = []
    for prompt in PROMPTS:
        ids = llm.tokenize(prompt.encode(), add_bos=True, special=False)
        llm.reset()
        llm.eval(ids)
        generated, top2 = [], []
        for _ in range(STEPS):
            logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            order = np.argsort(-logits, kind="stable")[:2]
            top2.append([[int(i), float(logits[i])] for i in order])
            token = int(order[0])
            generated.append(token)
            llm.eval([token])
        prompts.append({"prompt": prompt, "ids": ids, "greedy": generated, "top2": top2})
    json.dump(
        {
            "reference": "llama.cpp (llama-cpp-python 0.3.36 sdist), CPU, 2 threads",
            "texts": texts,
            "prompts": prompts,
        },
        open(out_path, "w"),
        indent=1,
        ensure_ascii=False,
    )


if __name__ == "__main__":
    main()
