//! Batch invariance: a sequence's logits are bit-identical whether it runs
//! alone or batched with other sequences of other lengths, including batches
//! that mix prefill chunks with decode steps. This is what turns "did another
//! request's memory leak into mine?" into an exact comparison.

#![allow(clippy::unwrap_used)]

use crate::common::PAGE;
use crate::common::{generate, pool_for};
use kvfence_model::{Builtin, Logits, Model, Sequence};
use kvfence_pool::{ElemType, Pool, PoolSize, PoolSpec, RequestId, ReusePolicy, Scrub};

const LENGTHS: [usize; 8] = [3, 17, 1, 40, 9, 25, 5, 33];
const STEPS: usize = 12;

fn prompt(seed: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 31 + seed * 101 + 7) % 256) as u32)
        .collect()
}

#[test]
fn eight_sequences_batched_equal_each_run_alone_bit_for_bit() {
    let model = Model::from_tensors(Builtin::Tiny.config(), &Builtin::Tiny.tensors()).unwrap();
    let pool = pool_for(&model, 2048);
    let prompts: Vec<Vec<u32>> = LENGTHS
        .iter()
        .enumerate()
        .map(|(i, &n)| prompt(i, n))
        .collect();

    let alone: Vec<Vec<Vec<f32>>> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| generate(&model, &pool, 100 + i as u64, p, STEPS, usize::MAX).0)
        .collect();

    // Continuous batching: sequence i joins at step i, prefilling in chunks
    // of 8 while the others decode; every forward pass mixes both.
    let mut leases: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| pool.lease(RequestId(i as u64), p.len() + STEPS).unwrap())
        .collect();
    let mut past = [0usize; 8];
    let mut pending: Vec<Vec<u32>> = prompts.clone();
    let mut rows: Vec<Vec<Vec<f32>>> = vec![Vec::new(); 8];
    let mut tick = 0;
    while rows.iter().any(|r| r.len() < STEPS + 1) {
        let mut work: Vec<(usize, Vec<u32>, Logits)> = Vec::new();
        for i in 0..8 {
            if i > tick || rows[i].len() == STEPS + 1 {
                continue;
            }
            if !pending[i].is_empty() {
                let take = pending[i].len().min(8);
                let piece: Vec<u32> = pending[i].drain(..take).collect();
                let logits = if pending[i].is_empty() {
                    Logits::Last
                } else {
                    Logits::None
                };
                work.push((i, piece, logits));
            } else {
                let next = kvfence_model::sampling::argmax(rows[i].last().unwrap());
                work.push((i, vec![next], Logits::Last));
            }
        }
        let mut batch: Vec<Sequence<'_>> = Vec::new();
        // Borrow each lease once, in `work` order.
        let mut lease_refs: Vec<Option<&mut kvfence_pool::Lease>> =
            leases.iter_mut().map(Some).collect();
        for (i, piece, logits) in &work {
            batch.push(Sequence {
                lease: lease_refs[*i].take().unwrap(),
                past: past[*i],
                tokens: piece,
                logits: *logits,
            });
        }
        let out = model.forward(&mut batch).unwrap();
        drop(batch);
        for ((i, piece, logits), row) in work.iter().zip(out) {
            past[*i] += piece.len();
            if *logits == Logits::Last {
                rows[*i].push(row);
            }
        }
        tick += 1;
    }
    for i in 0..8 {
        assert_eq!(rows[i].len(), alone[i].len());
        for (step, (b, a)) in rows[i].iter().zip(&alone[i]).enumerate() {
            let same = b.iter().zip(a).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same,
                "sequence {i} (length {}) differs at step {step} when batched",
                LENGTHS[i]
            );
        }
    }
}

/// One bad sequence in a batch of eight fails alone: a token outside the
/// vocabulary, positions past its lease, and a read of KV never written
/// (I2) each get their own error, and the other sequences' logits are bit
/// for bit what they are when run alone.
#[test]
fn a_bad_sequence_fails_alone_and_the_rest_of_the_batch_is_untouched() {
    let model = Model::from_tensors(Builtin::Tiny.config(), &Builtin::Tiny.tensors()).unwrap();
    let pool = pool_for(&model, 4096);
    let vocab = model.config().vocab_size as u32;
    let prompts: Vec<Vec<u32>> = LENGTHS
        .iter()
        .enumerate()
        .map(|(i, &n)| prompt(i, n))
        .collect();
    let alone: Vec<Vec<f32>> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut lease = pool.lease(RequestId(200 + i as u64), p.len()).unwrap();
            let mut seq = [Sequence {
                lease: &mut lease,
                past: 0,
                tokens: p,
                logits: Logits::Last,
            }];
            model.forward(&mut seq).unwrap().remove(0)
        })
        .collect();
    for bad in [1usize, 4, 7] {
        let mut leases: Vec<_> = prompts
            .iter()
            .enumerate()
            // The I2 case gets room for its positions: only coverage refuses it.
            .map(|(i, p)| {
                let room = if i == bad && bad == 7 { 16 } else { 0 };
                pool.lease(RequestId(300 + i as u64), p.len() + room)
                    .unwrap()
            })
            .collect();
        let mut tokens = prompts.clone();
        let mut past = vec![0; tokens.len()];
        match bad {
            // A token id outside the vocabulary.
            1 => tokens[bad][0] = vocab + 5,
            // Positions past what the lease holds.
            4 => tokens[bad].extend(std::iter::repeat_n(1, 64)),
            // A read of positions never written in this lease (I2).
            _ => past[bad] = 3,
        }
        let mut batch: Vec<Sequence<'_>> = leases
            .iter_mut()
            .zip(&tokens)
            .zip(&past)
            .map(|((lease, t), &past)| Sequence {
                lease,
                past,
                tokens: t,
                logits: Logits::Last,
            })
            .collect();
        let rows = model.forward_each(&mut batch);
        for (i, row) in rows.iter().enumerate() {
            if i == bad {
                let error = row.as_ref().expect_err("the bad sequence fails");
                if bad == 7 {
                    assert!(
                        matches!(error, kvfence_model::ModelError::Pool(_)),
                        "refused by the pool's coverage check: {error}"
                    );
                }
            } else {
                let row = row.as_ref().unwrap_or_else(|e| panic!("sequence {i}: {e}"));
                assert!(
                    row.iter()
                        .zip(&alone[i])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "sequence {i} changed because sequence {bad} failed"
                );
            }
        }
    }
}

/// A Gemma-3-shaped tiny model: every other layer attends through a
/// window of 40 positions.
fn windowed_model() -> Model {
    let mut config = Builtin::Tiny.config();
    config.architecture = kvfence_model::Architecture::Gemma3;
    config.tie_word_embeddings = true;
    config.sliding_window = Some(kvfence_model::SlidingWindow {
        window: 40,
        period: 2,
        local_rope_theta: 1_000.0,
    });
    let tensors = kvfence_model::builtin::weights_for(&config, 23);
    Model::from_tensors(config, &tensors).unwrap()
}

/// A lease that keeps only the windows of its sliding-window layers —
/// their pages given back as the request moves on and stamped anew for its
/// end (newest freed first, poisoned) — reads exactly what a lease that
/// keeps everything reads: the logits are the same bit for bit, however
/// prefill is cut, and short chunks hold a window, not the context.
#[test]
fn a_lease_that_keeps_only_the_windows_answers_bit_for_bit_as_one_that_keeps_everything() {
    let model = windowed_model();
    let whole_pool = pool_for(&model, 2048);
    let long = prompt(3, 300);
    let (whole, tokens) = generate(&model, &whole_pool, 1, &long, 6, usize::MAX);
    for chunk in [1, 7, 37, 64, 128, 300] {
        let groups = model.layer_groups(chunk).unwrap();
        assert_eq!(groups.len(), 2, "a global group and a windowed one");
        let spec = PoolSpec::new(
            model.kv_shape(),
            PAGE,
            ElemType::F32,
            PoolSize::Tokens(2048),
        )
        .with_layer_groups(groups)
        .with_scrub(Scrub::Poison)
        .with_reuse(ReusePolicy::NewestFreedFirst);
        let pool = Pool::new(&spec).unwrap();
        let (rows, generated) = generate(&model, &pool, 2, &long, 6, chunk);
        assert_eq!(rows, whole, "prefill in chunks of {chunk}");
        assert_eq!(generated, tokens);
        assert!(pool.stats().at_baseline());
        if chunk <= 64 {
            let held = pool.pages_for(306);
            assert!(
                held < 2 * 306usize.div_ceil(PAGE),
                "{held} pages: the windowed group holds a window, not the context"
            );
        }
    }
}

/// On sliding-window layers too, a sequence's logits do not depend on
/// where its prefill was cut — what a prefix-cache hit (prefill resumed at
/// a page boundary) and chunked prefill rely on — nor on what shares its
/// batch: prompts longer than the window (40) and than an attention chunk
/// (128), cut at 1, 7, 37, 64 and 128 tokens, equal the whole prefill bit
/// for bit, alone and beside another sequence.
#[test]
fn sliding_window_rows_equal_bit_for_bit_however_prefill_is_cut() {
    let model = windowed_model();
    let pool = pool_for(&model, 2048);
    let long = prompt(3, 300);
    let (whole, _) = generate(&model, &pool, 1, &long, 4, usize::MAX);
    for chunk in [1, 7, 37, 64, 128] {
        let (cut, _) = generate(&model, &pool, 2, &long, 4, chunk);
        assert_eq!(cut, whole, "prefill in chunks of {chunk}");
    }
    // Beside another sequence's prefill in every pass.
    let other = prompt(9, 200);
    let mut mine = pool.lease(RequestId(10), long.len()).unwrap();
    let mut theirs = pool.lease(RequestId(11), other.len()).unwrap();
    let mut past = 0;
    let mut last = Vec::new();
    for (piece, their_piece) in long.chunks(50).zip(other.chunks(34)) {
        let logits = if past + piece.len() == long.len() {
            Logits::Last
        } else {
            Logits::None
        };
        let rows = model
            .forward(&mut [
                Sequence {
                    lease: &mut theirs,
                    past: past / 50 * 34,
                    tokens: their_piece,
                    logits: Logits::Last,
                },
                Sequence {
                    lease: &mut mine,
                    past,
                    tokens: piece,
                    logits,
                },
            ])
            .unwrap();
        last = rows[1].clone();
        past += piece.len();
    }
    assert_eq!(
        last, whole[0],
        "the prompt's last row beside another sequence"
    );
}
