//! A pass that stops between layers ([`Model::begin`], [`Model::resume`])
//! — so a scheduler can answer a request that just arrived before the step
//! in flight ends — computes exactly what an uninterrupted pass computes,
//! even when another pass over other leases runs in every pause.

#![allow(clippy::unwrap_used)]

use crate::common::{generate, pool_of};
use kvfence_model::{Builtin, Logits, Model, Sequence};
use kvfence_pool::{ElemType, Lease, Pool, RequestId};

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 37 + seed * 11 + 5) % 256)
        .collect()
}

/// Two prompts prefilled in one pass that pauses after every layer; in
/// each pause, a third prompt runs a whole pass of its own. Returns the
/// two prompts' rows and the third's (from its last pause).
fn paused_run(
    model: &Model,
    pool: &Pool,
    prompts: &[Vec<u32>; 2],
    express: &[u32],
) -> (Vec<Vec<f32>>, Vec<f32>) {
    let mut leases: Vec<Lease> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| pool.lease(RequestId(10 + i as u64), p.len()).unwrap())
        .collect();
    let mut pass = model.begin(&sequences(&mut leases, prompts));
    let mut express_rows = Vec::new();
    let mut pauses = 0;
    let rows = loop {
        let mut batch = sequences(&mut leases, prompts);
        if let Some(rows) = model.resume(&mut pass, &mut batch, &mut || true) {
            break rows;
        }
        pauses += 1;
        assert_eq!(pass.layers_done(), pauses, "one layer per go");
        // Another request's whole pass, on its own pages, in the pause.
        let mut lease = pool.lease(RequestId(99), express.len()).unwrap();
        let mut batch = [Sequence {
            lease: &mut lease,
            past: 0,
            tokens: express,
            logits: Logits::Last,
        }];
        express_rows = model.forward(&mut batch).unwrap().remove(0);
    };
    assert_eq!(pauses, model.config().num_layers - 1);
    (rows.into_iter().map(Result::unwrap).collect(), express_rows)
}

/// The two prompts as one batch: the first wants its last row, the
/// second every row.
fn sequences<'a>(leases: &'a mut [Lease], prompts: &'a [Vec<u32>; 2]) -> Vec<Sequence<'a>> {
    leases
        .iter_mut()
        .zip(prompts)
        .zip([Logits::Last, Logits::All])
        .map(|((lease, tokens), logits)| Sequence {
            lease,
            past: 0,
            tokens,
            logits,
        })
        .collect()
}

#[test]
fn a_pass_paused_after_every_layer_equals_one_that_was_not_bit_for_bit() {
    let model = Model::from_tensors(Builtin::Tiny.config(), &Builtin::Tiny.tensors()).unwrap();
    for elem in [ElemType::F32, ElemType::F16] {
        let pool = pool_of(&model, 512, elem);
        let prompts = [prompt(1, 21), prompt(2, 9)];
        let express = prompt(3, 13);
        let (paused, express_paused) = paused_run(&model, &pool, &prompts, &express);

        let mut leases: Vec<Lease> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| pool.lease(RequestId(20 + i as u64), p.len()).unwrap())
            .collect();
        let mut batch = sequences(&mut leases, &prompts);
        let whole = model.forward(&mut batch).unwrap();
        assert_eq!(paused.len(), 2);
        for (a, b) in paused.iter().zip(&whole) {
            assert_eq!(a.len(), b.len());
            assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{elem:?}: pausing changed a row"
            );
        }
        let (alone, _) = generate(&model, &pool, 7, &express, 0, usize::MAX);
        assert!(
            express_paused
                .iter()
                .zip(&alone[0])
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "{elem:?}: the pass run in a pause equals the same prompt alone"
        );
    }
}

#[test]
#[should_panic(expected = "a pass resumes over the batch it began with")]
fn a_pass_resumes_only_over_the_batch_it_began_with() {
    let model = Model::from_tensors(Builtin::Tiny.config(), &Builtin::Tiny.tensors()).unwrap();
    let pool = pool_of(&model, 512, ElemType::F32);
    let tokens = prompt(4, 12);
    let mut lease = pool.lease(RequestId(1), tokens.len()).unwrap();
    let mut batch = [Sequence {
        lease: &mut lease,
        past: 0,
        tokens: &tokens,
        logits: Logits::Last,
    }];
    let mut pass = model.begin(&batch);
    assert!(model.resume(&mut pass, &mut batch, &mut || true).is_none());
    let mut shorter = [Sequence {
        lease: &mut lease,
        past: 0,
        tokens: &tokens[..6],
        logits: Logits::Last,
    }];
    let _ = model.resume(&mut pass, &mut shorter, &mut || true);
}
