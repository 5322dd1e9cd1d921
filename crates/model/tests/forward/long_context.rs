//! Contexts longer than attention's key chunk and query tile, in f32, f16
//! and bf16 KV: a prompt gives the same bits however it is cut into prefill
//! pieces and whatever it is batched with, agrees with the dense reference,
//! and half-precision KV stays close to f32.

#![allow(clippy::unwrap_used)]

use crate::common::{dense_logits, generate, max_abs_diff};
use kvfence_model::attention::{CHUNK, TILE_ROWS};
use kvfence_model::{Builtin, Logits, Model, Sequence};
use kvfence_pool::{ElemType, RequestId};

const STEPS: usize = 8;

fn tiny() -> Model {
    Model::from_tensors(Builtin::Tiny.config(), &Builtin::Tiny.tensors()).unwrap()
}

/// Longer than two key chunks, not a multiple of a chunk, a tile or a page.
fn long_prompt() -> Vec<u32> {
    (0..(2 * CHUNK + TILE_ROWS + 5) as u32)
        .map(|i| (i * 53 + 3) % 256)
        .collect()
}

/// A pool roomy enough for a few leases of `prompt` and its decode steps.
fn pool_of(model: &Model, prompt: &[u32], elem: ElemType) -> kvfence_pool::Pool {
    crate::common::pool_of(model, 4 * (prompt.len() + STEPS), elem)
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

#[test]
fn a_long_prompt_gives_the_same_bits_in_pieces_of_any_size_in_every_kv_type() {
    let model = tiny();
    let prompt = long_prompt();
    for elem in [ElemType::F32, ElemType::F16, ElemType::BF16] {
        let pool = pool_of(&model, &prompt, elem);
        let (whole, tokens) = generate(&model, &pool, 1, &prompt, STEPS, usize::MAX);
        for chunk in [1, 7, TILE_ROWS, CHUNK - 1, CHUNK, CHUNK + 1, 200] {
            let (pieces, pieces_tokens) = generate(&model, &pool, 2, &prompt, STEPS, chunk);
            assert_eq!(pieces_tokens, tokens, "{elem:?}, pieces of {chunk}");
            for (step, (a, b)) in whole.iter().zip(&pieces).enumerate() {
                assert!(
                    same_bits(a, b),
                    "{elem:?}: step {step} differs when prefilled in pieces of {chunk}"
                );
            }
        }
        assert_eq!(pool.stats().leased_pages, 0, "I8: every lease went back");
    }
}

#[test]
fn a_long_context_row_is_the_same_alone_or_batched_with_decodes_and_prefills() {
    let model = tiny();
    let prompt = long_prompt();
    for elem in [ElemType::F32, ElemType::F16] {
        let pool = pool_of(&model, &prompt, elem);
        let (alone, _) = generate(&model, &pool, 1, &prompt, 0, usize::MAX);
        // The same prompt prefilled next to a long decode and a short prompt.
        let mut other = pool.lease(RequestId(2), prompt.len() + 1).unwrap();
        let (_, other_tokens) = generate(&model, &pool, 3, &prompt, 0, usize::MAX);
        let mut warm = [Sequence {
            lease: &mut other,
            past: 0,
            tokens: &other_tokens,
            logits: Logits::None,
        }];
        model.forward(&mut warm).unwrap();
        let mut mine = pool.lease(RequestId(4), prompt.len()).unwrap();
        let mut short = pool.lease(RequestId(5), 5).unwrap();
        let mut batch = [
            Sequence {
                lease: &mut other,
                past: prompt.len(),
                tokens: &[9],
                logits: Logits::Last,
            },
            Sequence {
                lease: &mut mine,
                past: 0,
                tokens: &prompt,
                logits: Logits::Last,
            },
            Sequence {
                lease: &mut short,
                past: 0,
                tokens: &prompt[..5],
                logits: Logits::Last,
            },
        ];
        let rows = model.forward(&mut batch).unwrap();
        assert!(
            same_bits(&rows[1], &alone[0]),
            "{elem:?}: a long prefill changed when batched"
        );
    }
}

#[test]
fn a_long_context_agrees_with_the_dense_reference_in_f32_kv() {
    let builtin = Builtin::Tiny;
    let (config, tensors) = (builtin.config(), builtin.tensors());
    let model = Model::from_tensors(config.clone(), &tensors).unwrap();
    let prompt = long_prompt();
    let pool = pool_of(&model, &prompt, ElemType::F32);
    let (rows, tokens) = generate(&model, &pool, 1, &prompt, STEPS, 100);
    let dense = dense_logits(&config, &tensors, &tokens);
    for (step, row) in rows.iter().enumerate() {
        let diff = max_abs_diff(row, &dense[prompt.len() - 1 + step]);
        assert!(
            diff <= 1e-4,
            "step {step}: paged and dense differ by {diff}"
        );
    }
}

#[test]
fn half_precision_kv_stays_close_to_f32_kv() {
    let model = tiny();
    let prompt = long_prompt();
    let reference = {
        let pool = pool_of(&model, &prompt, ElemType::F32);
        generate(&model, &pool, 1, &prompt, 0, usize::MAX).0
    };
    let scale = reference[0].iter().fold(0.0f32, |m, x| m.max(x.abs()));
    for (elem, tolerance) in [(ElemType::F16, 1e-2), (ElemType::BF16, 5e-2)] {
        let pool = pool_of(&model, &prompt, elem);
        let (rows, _) = generate(&model, &pool, 1, &prompt, 0, usize::MAX);
        let diff = max_abs_diff(&rows[0], &reference[0]);
        assert!(
            diff <= tolerance * scale,
            "{elem:?} KV moved logits by {diff} (largest logit {scale})"
        );
        assert!(diff > 0.0, "{elem:?} KV must actually be stored narrower");
    }
}

/// Set in the child runs of the next test: print the digest and stop.
const DIGEST_CHILD: &str = "KVFENCE_TEST_DIGEST_CHILD";

/// Every logit bit of a long prompt in f16 KV and its decode steps, as one
/// number.
fn long_context_digest() -> u64 {
    use std::hash::{Hash, Hasher};
    let model = tiny();
    let prompt = long_prompt();
    let pool = pool_of(&model, &prompt, ElemType::F16);
    let (rows, tokens) = generate(&model, &pool, 1, &prompt, STEPS, 100);
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    tokens.hash(&mut hasher);
    for row in &rows {
        row.iter()
            .map(|x| x.to_bits())
            .for_each(|b| b.hash(&mut hasher));
    }
    hasher.finish()
}

/// The instruction set is chosen once per process, so the capped runs are
/// this test binary run again with `KVFENCE_MAX_ISA` set: the AVX-512, AVX2
/// and portable attention kernels (keys read in place from whole pages,
/// and staged from the partial last one) give a long context the same
/// bits, on whichever of them this CPU has.
#[test]
fn a_long_context_gives_the_same_bits_under_every_instruction_set_cap() {
    let name = "long_context::a_long_context_gives_the_same_bits_under_every_instruction_set_cap";
    if std::env::var_os(DIGEST_CHILD).is_some() {
        println!("digest={:016x}", long_context_digest());
        return;
    }
    let own = format!("digest={:016x}", long_context_digest());
    for cap in ["avx2", "portable"] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([name, "--exact", "--nocapture", "--test-threads", "1"])
            .env(DIGEST_CHILD, "1")
            .env("KVFENCE_MAX_ISA", cap)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "KVFENCE_MAX_ISA={cap}: {stdout}");
        // The harness prints the test's name on the same line.
        let digest = stdout
            .split_whitespace()
            .find(|word| word.starts_with("digest="))
            .unwrap_or_else(|| panic!("KVFENCE_MAX_ISA={cap} printed no digest: {stdout}"));
        assert_eq!(digest, own, "KVFENCE_MAX_ISA={cap}");
    }
}
