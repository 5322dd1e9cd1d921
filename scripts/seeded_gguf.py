"""Seeded random-weight GGUF files of the architectures kvfence loads, the
way llama.cpp defines them (tensor names, metadata keys, Q/K row order), for
tests that compare kvfence against llama.cpp on files no one trained:

    python3 -m venv /tmp/gv && /tmp/gv/bin/pip install gguf numpy
    /tmp/gv/bin/python scripts/seeded_gguf.py OUT_DIR

writes `qwen2.gguf`, `qwen3.gguf`, `phi3.gguf` (fused QKV and gate/up
matrices), `llama.gguf` and `llama3.gguf` (Llama 3.1's RoPE scaling as
`rope_freqs.weight`) (tiny: 2 layers, hidden
64, 4 query heads, 2 KV heads, F32 weights) with a byte-level BPE
vocabulary. `scripts/llama_cpp_fixtures.py --seeded` then records
llama.cpp's logits for them. The files are small and committed with the
fixtures (`crates/model/tests/fixtures/`), so CI needs neither script.
"""

import sys
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, CONTEXT = 64, 128, 2, 4, 2, 16, 512


def byte_vocab():
    """GPT-2's 256 byte characters, a few merges of them, and two specials."""
    printable = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    tokens = [mapping[b] for b in range(256)]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "a n"]
    tokens += ["Ġt", "he", "Ġthe", "in", "an"]
    tokens += ["<|endoftext|>", "<|im_start|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    return tokens, merges, types


def llama3_factors():
    """Llama 3.1's RoPE scaling as its converter bakes it into
    `rope_freqs.weight` (factor 8, low 1, high 4), for a 64-token original
    context so the tiny model's frequencies take every branch."""
    factor, low, high, original = 8.0, 1.0, 4.0, 64
    factors = []
    for i in range(HEAD_DIM // 2):
        freq = 1.0 / 10000.0 ** (2 * i / HEAD_DIM)
        wavelen = 2 * np.pi / freq
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write(path, arch, seed):
    rng = np.random.default_rng(seed)
    rope_freqs = arch == "llama3"
    arch = "llama" if rope_freqs else arch
    tokens, merges, types = byte_vocab()
    vocab = len(tokens)
    w = GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.context_length", CONTEXT)
    w.add_uint32(f"{arch}.embedding_length", HIDDEN)
    w.add_uint32(f"{arch}.block_count", LAYERS)
    w.add_uint32(f"{arch}.feed_forward_length", FFN)
    w.add_uint32(f"{arch}.attention.head_count", HEADS)
    w.add_uint32(f"{arch}.attention.head_count_kv", KV_HEADS)
    w.add_uint32(f"{arch}.attention.key_length", HEAD_DIM)
    w.add_uint32(f"{arch}.attention.value_length", HEAD_DIM)
    w.add_uint32(f"{arch}.rope.dimension_count", HEAD_DIM)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "qwen2" if arch.startswith("qwen") else "llama-bpe")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_uint32("tokenizer.ggml.eos_token_id", vocab - 2)
    w.add_uint32("tokenizer.ggml.bos_token_id", vocab - 2)
    w.add_bool("tokenizer.ggml.add_bos_token", False)

    def matrix(out_dim, in_dim, scale=1.0):
        return (rng.standard_normal((out_dim, in_dim)) * scale / np.sqrt(in_dim)).astype(np.float32)

    def norm(dim):
        return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)

    # Large embeddings and output weights: logits far apart, so llama.cpp's
    # f16 KV cache and summation order cannot swap the best two.
    w.add_tensor("token_embd.weight", (rng.standard_normal((vocab, HIDDEN)) * 2.0).astype(np.float32))
    w.add_tensor("output_norm.weight", norm(HIDDEN))
    w.add_tensor("output.weight", matrix(vocab, HIDDEN, 8.0))
    if rope_freqs:
        w.add_tensor("rope_freqs.weight", llama3_factors())
    q_dim, kv_dim = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm(HIDDEN))
        q, k, v = matrix(q_dim, HIDDEN, 2.0), matrix(kv_dim, HIDDEN, 2.0), matrix(kv_dim, HIDDEN)
        if arch == "phi3":
            w.add_tensor(p + "attn_qkv.weight", np.concatenate([q, k, v]))
        else:
            w.add_tensor(p + "attn_q.weight", q)
            w.add_tensor(p + "attn_k.weight", k)
            w.add_tensor(p + "attn_v.weight", v)
        if arch == "qwen2":
            for name, dim in (("attn_q.bias", q_dim), ("attn_k.bias", kv_dim), ("attn_v.bias", kv_dim)):
                w.add_tensor(p + name, (0.3 * rng.standard_normal(dim)).astype(np.float32))
        if arch == "qwen3":
            w.add_tensor(p + "attn_q_norm.weight", norm(HEAD_DIM))
            w.add_tensor(p + "attn_k_norm.weight", norm(HEAD_DIM))
        w.add_tensor(p + "attn_output.weight", matrix(HIDDEN, q_dim))
        w.add_tensor(p + "ffn_norm.weight", norm(HIDDEN))
        gate, up = matrix(FFN, HIDDEN), matrix(FFN, HIDDEN)
        if arch == "phi3":
            # One matrix, gate rows first: llama.cpp's SwiGLU splits it in two.
            w.add_tensor(p + "ffn_up.weight", np.concatenate([gate, up]))
        else:
            w.add_tensor(p + "ffn_gate.weight", gate)
            w.add_tensor(p + "ffn_up.weight", up)
        w.add_tensor(p + "ffn_down.weight", matrix(HIDDEN, FFN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for seed, arch in enumerate(["qwen2", "qwen3", "llama", "phi3", "llama3"], start=1):
        write(out / f"{arch}.gguf", arch, seed)


if __name__ == "__main__":
    main()
