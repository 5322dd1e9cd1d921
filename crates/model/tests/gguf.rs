//! Loading GGUF files the tests write themselves from `builtin:tiny`, the
//! way llama.cpp's converter lays them out (its names, its Q/K row order
//! for RoPE, input-first dimensions): the loaded model must compute what
//! the original computes, in every supported encoding.

#![allow(clippy::unwrap_used)]

use std::path::Path;

use kvfence_model::gguf::{GgufWriter, Value};
use kvfence_model::quant::{QuantFormat, quantize_row};
use kvfence_model::{Builtin, LoadedModel, Logits, Model, ModelError, Sequence, TensorMap};
use kvfence_pool::{ElemType, Pool, PoolSize, PoolSpec, RequestId};

/// llama.cpp's converter permutes each head's Q/K rows: Hugging Face row
/// `i * head_dim / 2 + j` becomes row `2j + i`.
fn permute_rope_rows(w: &[f32], heads: usize, head_dim: usize, k: usize) -> Vec<f32> {
    let mut out = vec![0.0; w.len()];
    let half = head_dim / 2;
    for h in 0..heads {
        for i in 0..2 {
            for j in 0..half {
                let hf = h * head_dim + i * half + j;
                let gg = h * head_dim + 2 * j + i;
                out[gg * k..(gg + 1) * k].copy_from_slice(&w[hf * k..(hf + 1) * k]);
            }
        }
    }
    out
}

/// Writes `builtin:tiny` as a GGUF file with matrices in `format` (F16
/// where a row is not whole blocks of it).
fn write_tiny(path: &Path, format: QuantFormat) {
    let b = Builtin::Tiny;
    let c = b.config();
    let tensors: TensorMap = b.tensors();
    let tokenizer = b.tokenizer().unwrap();
    let mut w = GgufWriter::new();
    let u32v = |v: usize| Value::U32(v as u32);
    w.metadata("general.architecture", Value::String("llama".into()))
        .metadata("llama.block_count", u32v(c.num_layers))
        .metadata("llama.context_length", u32v(c.max_position_embeddings))
        .metadata("llama.embedding_length", u32v(c.hidden_size))
        .metadata("llama.feed_forward_length", u32v(c.intermediate_size))
        .metadata("llama.attention.head_count", u32v(c.num_heads))
        .metadata("llama.attention.head_count_kv", u32v(c.num_kv_heads))
        .metadata("llama.rope.freq_base", Value::F32(c.rope_theta))
        .metadata("llama.rope.dimension_count", u32v(c.head_dim))
        .metadata(
            "llama.attention.layer_norm_rms_epsilon",
            Value::F32(c.rms_norm_eps),
        )
        .metadata("tokenizer.ggml.model", Value::String("gpt2".into()))
        .metadata("tokenizer.ggml.pre", Value::String("default".into()));
    let tokens: Vec<String> = (0..c.vocab_size as u32)
        .map(|id| tokenizer.token(id).unwrap())
        .collect();
    let types = (0..c.vocab_size).map(|id| Value::I32(if id < 256 { 1 } else { 3 }));
    w.metadata(
        "tokenizer.ggml.tokens",
        Value::Array(tokens.into_iter().map(Value::String).collect()),
    )
    .metadata("tokenizer.ggml.token_type", Value::Array(types.collect()))
    .metadata("tokenizer.ggml.merges", Value::Array(Vec::new()))
    .metadata(
        "tokenizer.ggml.eos_token_id",
        u32v(c.eos_token_ids[0] as usize),
    )
    .metadata(
        "tokenizer.chat_template",
        Value::String(kvfence_model::chat::CHATML.into()),
    );

    let mut add = |name: &str, data: &[f32], dims: &[usize]| {
        let k = dims[0];
        let chosen = if dims.len() == 1 {
            QuantFormat::F32
        } else if k.is_multiple_of(format.block_elements()) {
            format
        } else {
            QuantFormat::F16
        };
        let bytes: Vec<u8> = data
            .chunks(k)
            .flat_map(|row| quantize_row(chosen, row).unwrap())
            .collect();
        let dims: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        w.tensor(name, &dims, chosen, bytes);
    };
    let t = |name: &str| &tensors.tensor(name).unwrap().data;
    let h = c.hidden_size;
    add(
        "token_embd.weight",
        t("model.embed_tokens.weight"),
        &[h, c.vocab_size],
    );
    add("output.weight", t("lm_head.weight"), &[h, c.vocab_size]);
    add("output_norm.weight", t("model.norm.weight"), &[h]);
    for i in 0..c.num_layers {
        let hf = |s: &str| t(&format!("model.layers.{i}.{s}")).clone();
        let name = |s: &str| format!("blk.{i}.{s}");
        let q = permute_rope_rows(&hf("self_attn.q_proj.weight"), c.num_heads, c.head_dim, h);
        let k = permute_rope_rows(
            &hf("self_attn.k_proj.weight"),
            c.num_kv_heads,
            c.head_dim,
            h,
        );
        add(&name("attn_q.weight"), &q, &[h, c.q_dim()]);
        add(&name("attn_k.weight"), &k, &[h, c.kv_dim()]);
        add(
            &name("attn_v.weight"),
            &hf("self_attn.v_proj.weight"),
            &[h, c.kv_dim()],
        );
        add(
            &name("attn_output.weight"),
            &hf("self_attn.o_proj.weight"),
            &[c.q_dim(), h],
        );
        add(
            &name("ffn_gate.weight"),
            &hf("mlp.gate_proj.weight"),
            &[h, c.intermediate_size],
        );
        add(
            &name("ffn_up.weight"),
            &hf("mlp.up_proj.weight"),
            &[h, c.intermediate_size],
        );
        add(
            &name("ffn_down.weight"),
            &hf("mlp.down_proj.weight"),
            &[c.intermediate_size, h],
        );
        add(
            &name("attn_norm.weight"),
            &hf("input_layernorm.weight"),
            &[h],
        );
        add(
            &name("ffn_norm.weight"),
            &hf("post_attention_layernorm.weight"),
            &[h],
        );
    }
    w.write(path).unwrap();
}

/// Logits of every position of `tokens`, as one sequence (`chunks` > 1:
/// prefill in that many pieces, the paged path).
fn logits(model: &Model, tokens: &[u32]) -> Vec<f32> {
    let spec = PoolSpec::new(model.kv_shape(), 8, ElemType::F32, PoolSize::Tokens(64));
    let pool = Pool::new(&spec).unwrap();
    let mut lease = pool.lease(RequestId(1), tokens.len()).unwrap();
    let mut batch = [Sequence {
        lease: &mut lease,
        past: 0,
        tokens,
        logits: Logits::All,
    }];
    model.forward(&mut batch).unwrap().remove(0)
}

const PROMPT: [u32; 12] = [72, 101, 108, 108, 111, 257, 32, 119, 246, 114, 108, 100];

fn dense_reference() -> Vec<f32> {
    let b = Builtin::Tiny;
    logits(
        &Model::from_tensors(b.config(), &b.tensors()).unwrap(),
        &PROMPT,
    )
}

fn load(format: QuantFormat) -> (tempfile::TempDir, LoadedModel) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    write_tiny(&path, format);
    let loaded = LoadedModel::load(path.to_str().unwrap()).unwrap();
    (dir, loaded)
}

#[test]
fn an_f32_gguf_computes_exactly_what_the_original_computes() {
    let (_dir, loaded) = load(QuantFormat::F32);
    let expected = Builtin::Tiny.config();
    let config = loaded.model.config();
    assert_eq!(
        (
            config.hidden_size,
            config.num_layers,
            config.num_kv_heads,
            config.head_dim,
            config.vocab_size
        ),
        (
            expected.hidden_size,
            expected.num_layers,
            expected.num_kv_heads,
            expected.head_dim,
            expected.vocab_size
        )
    );
    assert_eq!(loaded.name, "tiny");
    let got = logits(&loaded.model, &PROMPT);
    for (a, b) in got.iter().zip(dense_reference()) {
        assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{a} vs {b}");
    }
}

#[test]
fn quantized_ggufs_stay_close_to_the_original() {
    let reference = dense_reference();
    let scale = reference.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    for (format, tolerance) in [
        (QuantFormat::F16, 0.01),
        (QuantFormat::BF16, 0.05),
        (QuantFormat::Q8_0, 0.05),
        (QuantFormat::Q5_1, 0.2),
        (QuantFormat::Q5_0, 0.2),
        (QuantFormat::Q4_1, 0.3),
        (QuantFormat::Q4_0, 0.3),
    ] {
        let (_dir, loaded) = load(format);
        let got = logits(&loaded.model, &PROMPT);
        let worst = got
            .iter()
            .zip(&reference)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            worst <= tolerance * scale,
            "{format:?}: worst error {worst} of {scale}"
        );
        assert!(
            worst > 0.0 || format == QuantFormat::F16,
            "{format:?} cannot be exact"
        );
    }
}

#[test]
fn quantized_rows_are_batch_invariant() {
    let (_dir, loaded) = load(QuantFormat::Q4_1);
    let model = &loaded.model;
    let alone = logits(model, &PROMPT);
    let spec = PoolSpec::new(model.kv_shape(), 8, ElemType::F32, PoolSize::Tokens(128));
    let pool = Pool::new(&spec).unwrap();
    let mut a = pool.lease(RequestId(1), 16).unwrap();
    let mut b = pool.lease(RequestId(2), 16).unwrap();
    let other = [1u32, 2, 3, 4, 5, 6, 7];
    let mut batch = [
        Sequence {
            lease: &mut b,
            past: 0,
            tokens: &other,
            logits: Logits::All,
        },
        Sequence {
            lease: &mut a,
            past: 0,
            tokens: &PROMPT,
            logits: Logits::All,
        },
    ];
    let together = model.forward(&mut batch).unwrap().remove(1);
    assert_eq!(alone, together, "a row's logits depend on its batch");
}

#[test]
fn tokenizer_and_template_come_from_the_metadata() {
    let (_dir, loaded) = load(QuantFormat::Q8_0);
    let builtin = Builtin::Tiny.tokenizer().unwrap();
    let text = "Hello <|im_start|> wörld 2024";
    assert_eq!(
        loaded.tokenizer.encode(text).unwrap(),
        builtin.encode(text).unwrap()
    );
    assert_eq!(
        loaded.model.config().eos_token_ids,
        vec![Builtin::Tiny.config().eos_token_ids[0]]
    );
    assert!(loaded.chat_template.is_some());
}

#[test]
fn damaged_or_foreign_files_are_errors_that_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    write_tiny(&path, QuantFormat::Q8_0);
    let bytes = std::fs::read(&path).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() - 100]).unwrap();
    let err = LoadedModel::load(cut.to_str().unwrap()).unwrap_err();
    assert!(matches!(err, ModelError::Gguf { .. }), "{err}");
    assert!(err.to_string().contains("cut.gguf"), "{err}");

    let mut foreign = GgufWriter::new();
    foreign.metadata("general.architecture", Value::String("mamba".into()));
    let other = dir.path().join("other.gguf");
    foreign.write(&other).unwrap();
    let err = LoadedModel::load(other.to_str().unwrap()).unwrap_err();
    // The file's own name for it, and the names GGUF files use for those
    // that load — not config.json's class names.
    let message = err.to_string();
    assert!(message.contains("\"mamba\""), "{message}");
    assert!(
        message.contains("llama, qwen2, qwen3, phi3, gemma3") && !message.contains("ForCausalLM"),
        "{message}"
    );
}
