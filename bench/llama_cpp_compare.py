"""Prefill and decode throughput of llama.cpp (through llama-cpp-python) on
a GGUF file, measured the way `cargo bench -p kvfence-model --bench model`
measures kvfence: prefill of 128 and 512 tokens, decode at context 128 for
1, 8 and 32 sequences decoded together (one llama_decode per step).

Install (AVX2 build without AVX-512/AMX, as docs/performance.md explains):
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DGGML_AVX512=OFF -DGGML_AMX_INT8=OFF" pip install llama-cpp-python==0.3.36
Run:
  python bench/llama_cpp_compare.py PATH.gguf [--threads 2] [--reps 5]
"""
import argparse
import statistics
import time

import llama_cpp as L


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()

    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    model = L.llama_model_load_from_file(args.gguf.encode(), mparams)
    cparams = L.llama_context_default_params()
    # Each of the 32 sequences gets n_ctx / n_seq_max positions: room for 512.
    cparams.n_ctx = 32 * 640
    cparams.n_batch = 512
    cparams.n_ubatch = 512
    cparams.n_seq_max = 32
    cparams.n_threads = args.threads
    cparams.n_threads_batch = args.threads
    ctx = L.llama_init_from_model(model, cparams)
    mem = L.llama_get_memory(ctx)

    def decode(tokens_by_seq, positions):
        n = sum(len(t) for t in tokens_by_seq)
        batch = L.llama_batch_init(n, 0, 1)
        i = 0
        for seq, (toks, start) in enumerate(zip(tokens_by_seq, positions)):
            for j, tok in enumerate(toks):
                batch.token[i] = tok
                batch.pos[i] = start + j
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = j == len(toks) - 1
                i += 1
        batch.n_tokens = n
        rc = L.llama_decode(ctx, batch)
        L.llama_batch_free(batch)
        assert rc == 0, rc

    def prompt(seed, n):
        return [(i * 31 + seed * 17) % 256 + 300 for i in range(n)]

    def timed(fn):
        samples = []
        fn()  # warm-up
        for _ in range(args.reps):
            t = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t)
        return statistics.median(samples), min(samples), max(samples)

    for n in (128, 512):
        def run():
            L.llama_memory_clear(mem, True)
            decode([prompt(0, n)], [0])
        med, lo, hi = timed(run)
        print(f"prefill {n:4d} tokens: {n / med:7.1f} tok/s (spread {n / hi:.1f}-{n / lo:.1f})")

    for b in (1, 8, 32):
        # Prefill every sequence, then time steps at a constant context of 128.
        L.llama_memory_clear(mem, True)
        for s in range(b):
            toks = prompt(10 + s, 128)
            bt = L.llama_batch_init(128, 0, 1)
            for j, tok in enumerate(toks):
                bt.token[j] = tok
                bt.pos[j] = j
                bt.n_seq_id[j] = 1
                bt.seq_id[j][0] = s
                bt.logits[j] = False
            bt.n_tokens = 128
            assert L.llama_decode(ctx, bt) == 0
            L.llama_batch_free(bt)

        def step():
            # Rewrite position 128 of every sequence: constant context.
            for s in range(b):
                L.llama_memory_seq_rm(mem, s, 128, -1)
            decode([[65] for _ in range(b)], [128] * b)
        med, lo, hi = timed(step)
        print(f"decode batch {b:2d} at context 128: {b / med:7.1f} tok/s (spread {b / hi:.1f}-{b / lo:.1f})")


if __name__ == "__main__":
    main()
