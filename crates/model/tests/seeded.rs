//! Architectures no reachable real model covers, checked against llama.cpp
//! on seeded random-weight GGUF files written as llama.cpp defines them
//! (`scripts/seeded_gguf.py`: `qwen2` with Q/K/V biases, `qwen3` with
//! per-head Q/K norms, `phi3` with fused QKV and gate/up matrices, `llama`
//! with its converter's Q/K row order) and
//! llama.cpp's own logits for them (`scripts/llama_cpp_fixtures.py
//! --seeded`, F32 weights and KV): at every position of a 48-token
//! sequence, kvfence's five best logits are llama.cpp's to 0.01 and the
//! best token is the same.

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use kvfence_model::{Architecture, LoadedModel, Logits, Sequence};
use kvfence_pool::{ElemType, Pool, PoolSize, PoolSpec, RequestId};
use serde_json::Value;

/// Logits here are about 20 in size; both sides compute in f32 with
/// different summation orders, which moves them by a few thousandths.
const TOLERANCE: f32 = 0.01;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/seeded")
}

fn check(arch: &str, expected_architecture: Architecture) {
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("llama_cpp.json")).unwrap())
            .unwrap();
    let tokens: Vec<u32> = reference["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let loaded = LoadedModel::load_gguf(&fixtures().join(format!("{arch}.gguf"))).unwrap();
    assert_eq!(loaded.model.config().architecture, expected_architecture);
    let pool = Pool::new(&PoolSpec::new(
        loaded.model.kv_shape(),
        16,
        ElemType::F32,
        PoolSize::Tokens(64),
    ))
    .unwrap();
    let mut lease = pool.lease(RequestId(1), tokens.len()).unwrap();
    let rows = loaded
        .model
        .forward(&mut [Sequence {
            lease: &mut lease,
            past: 0,
            tokens: &tokens,
            logits: Logits::All,
        }])
        .unwrap()
        .remove(0);
    let vocab = loaded.model.config().vocab_size;
    for (position, top5) in reference["top5"][arch]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
    {
        let row = &rows[position * vocab..(position + 1) * vocab];
        let best = kvfence_model::sampling::argmax(row);
        assert_eq!(
            best as u64,
            top5[0][0].as_u64().unwrap(),
            "{arch}, position {position}: best token"
        );
        for pair in top5.as_array().unwrap() {
            let (id, logit) = (
                pair[0].as_u64().unwrap() as usize,
                pair[1].as_f64().unwrap() as f32,
            );
            assert!(
                (row[id] - logit).abs() <= TOLERANCE,
                "{arch}, position {position}, token {id}: {} vs llama.cpp's {logit}",
                row[id]
            );
        }
    }
}

#[test]
fn qwen2_matches_llama_cpp() {
    check("qwen2", Architecture::Qwen2);
}

#[test]
fn qwen3_matches_llama_cpp() {
    check("qwen3", Architecture::Qwen3);
}

#[test]
fn llama_matches_llama_cpp() {
    check("llama", Architecture::Llama);
}

#[test]
fn phi3_fused_matrices_match_llama_cpp() {
    check("phi3", Architecture::Phi3);
}

#[test]
fn llama3_frequency_factors_match_llama_cpp() {
    check("llama3", Architecture::Llama);
}
