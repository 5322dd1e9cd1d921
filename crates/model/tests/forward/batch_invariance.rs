//! Batch invariance: a sequence's logits are bit-identical whether it runs
//! alone or batched with other sequences of other lengths, including batches
//! that mix prefill chunks with decode steps. This is what turns "did another
//! request's memory leak into mine?" into an exact comparison.

#![allow(clippy::unwrap_used)]

use crate::common::{generate, pool_for};
use kvfence_model::{Builtin, Logits, Model, Sequence};
use kvfence_pool::RequestId;

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
