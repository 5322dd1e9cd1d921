//! The paged forward (KV in fenced pool pages, chunked prefill, decode
//! through read views) computes the same logits as a plain dense forward, to
//! 1e-4, for a prompt and 32 decode steps — on `builtin:tiny` and on the same
//! model exported to a Hugging Face directory and loaded back.

#![allow(clippy::unwrap_used)]

use crate::common::{dense_logits, generate, max_abs_diff, pool_for};
use kvfence_model::{Builtin, DiskDtype, LoadedModel, Model, ModelConfig, TensorMap};

const STEPS: usize = 32;

fn check_against_dense(
    model: &Model,
    config: &ModelConfig,
    tensors: &TensorMap,
    prompt: &[u32],
    chunk: usize,
) {
    let pool = pool_for(model, 256);
    let (rows, tokens) = generate(model, &pool, 1, prompt, STEPS, chunk);
    let dense = dense_logits(config, tensors, &tokens);
    for (step, row) in rows.iter().enumerate() {
        let reference = &dense[prompt.len() - 1 + step];
        let diff = max_abs_diff(row, reference);
        assert!(
            diff <= 1e-4,
            "step {step}: paged and dense logits differ by {diff}"
        );
    }
    assert_eq!(pool.stats().leased_pages, 0, "I8: the lease went back");
}

fn prompt(len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 37 + 11) % 256).collect()
}

#[test]
fn paged_logits_equal_dense_reference_on_builtin_tiny() {
    let builtin = Builtin::Tiny;
    let (config, tensors) = (builtin.config(), builtin.tensors());
    let model = Model::from_tensors(config.clone(), &tensors).unwrap();
    // Prefill in one go, and in chunks that straddle page boundaries.
    check_against_dense(&model, &config, &tensors, &prompt(21), 64);
    check_against_dense(&model, &config, &tensors, &prompt(21), 5);
}

#[test]
fn paged_logits_equal_dense_reference_on_an_exported_hf_directory() {
    let dir = tempfile::tempdir().unwrap();
    Builtin::Tiny.export(dir.path(), 3, DiskDtype::F32).unwrap();
    let loaded = LoadedModel::load(dir.path().to_str().unwrap()).unwrap();
    let tensors = TensorMap::load_dir(dir.path()).unwrap();
    let config = loaded.model.config().clone();
    check_against_dense(&loaded.model, &config, &tensors, &prompt(13), 4);
}

#[test]
fn qwen2_biases_and_tied_embeddings_are_applied() {
    let mut config = Builtin::Tiny.config();
    config.architecture = kvfence_model::Architecture::Qwen2;
    config.qkv_bias = true;
    config.tie_word_embeddings = true;
    let tensors = kvfence_model::builtin::weights_for(&config, 99);
    let model = Model::from_tensors(config.clone(), &tensors).unwrap();
    check_against_dense(&model, &config, &tensors, &prompt(9), 3);
}

/// Gemma 3's shape on a tiny model: per-head Q/K norms, post-norms, GeGLU,
/// scaled embeddings, and sliding-window layers (window 40, every third
/// layer global, their own RoPE base) over prompts longer than the window
/// and than an attention chunk, prefilled whole and in pieces that cut
/// windows and chunks anywhere.
#[test]
fn gemma3_windows_norms_and_geglu_match_the_dense_reference() {
    let mut config = Builtin::Tiny.config();
    config.architecture = kvfence_model::Architecture::Gemma3;
    config.tie_word_embeddings = true;
    config.num_layers = 3;
    config.sliding_window = Some(kvfence_model::SlidingWindow {
        window: 40,
        period: 3,
        local_rope_theta: 500.0,
    });
    let tensors = kvfence_model::builtin::weights_for(&config, 7);
    let model = Model::from_tensors(config.clone(), &tensors).unwrap();
    check_against_dense(&model, &config, &tensors, &prompt(9), 4);
    check_against_dense(&model, &config, &tensors, &prompt(150), 150);
    check_against_dense(&model, &config, &tensors, &prompt(150), 37);
}

#[test]
fn qwen3_query_and_key_norms_are_applied() {
    let mut config = Builtin::Tiny.config();
    config.architecture = kvfence_model::Architecture::Qwen3;
    let tensors = kvfence_model::builtin::weights_for(&config, 17);
    let model = Model::from_tensors(config.clone(), &tensors).unwrap();
    check_against_dense(&model, &config, &tensors, &prompt(11), 4);
}
