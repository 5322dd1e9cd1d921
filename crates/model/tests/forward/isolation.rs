//! I2 at the model's level: attention can only read KV the request wrote in
//! this generation of its pages. A forward pass that claims context it never
//! wrote is refused by the read view — an error, never a computation.

#![allow(clippy::unwrap_used)]

use crate::common::{generate, pool_for};
use kvfence_model::{Builtin, Logits, Model, ModelError, Sequence};
use kvfence_pool::{PoolError, RequestId};

fn tiny() -> Model {
    Model::from_tensors(Builtin::Tiny.config(), &Builtin::Tiny.tensors()).unwrap()
}

#[test]
fn i2_decode_over_unwritten_context_is_refused() {
    let model = tiny();
    let pool = pool_for(&model, 64);
    let mut lease = pool.lease(RequestId(1), 16).unwrap();
    // Claims 5 tokens of context that were never written: the incident's
    // "placeholder prompt, then decode over reserved pages".
    let mut batch = [Sequence {
        lease: &mut lease,
        past: 5,
        tokens: &[42],
        logits: Logits::Last,
    }];
    let err = model.forward(&mut batch).unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::Pool(PoolError::NotCovered { position: 0, .. })
        ),
        "{err}"
    );
    assert!(pool.stats().reads_refused >= 1);
}

#[test]
fn i2_context_written_short_of_the_claim_is_refused() {
    let model = tiny();
    let pool = pool_for(&model, 64);
    let mut lease = pool.lease(RequestId(1), 16).unwrap();
    let mut prefill = [Sequence {
        lease: &mut lease,
        past: 0,
        tokens: &[1, 2, 3],
        logits: Logits::None,
    }];
    model.forward(&mut prefill).unwrap();
    let mut decode = [Sequence {
        lease: &mut lease,
        past: 6,
        tokens: &[9],
        logits: Logits::Last,
    }];
    let err = model.forward(&mut decode).unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::Pool(PoolError::NotCovered { position: 3, .. })
        ),
        "{err}"
    );
}

#[test]
fn i2_pages_of_a_finished_request_are_not_readable_by_the_next() {
    let model = tiny();
    let pool = pool_for(&model, 32);
    let secret: Vec<u32> = (0..30).map(|i| 200 + i % 50).collect();
    generate(&model, &pool, 1, &secret, 2, 64);
    // Same pages (newest-freed-first), new generation: claiming the old
    // context must fail rather than attend over the previous tenant's KV.
    let mut lease = pool.lease(RequestId(2), 32).unwrap();
    let mut batch = [Sequence {
        lease: &mut lease,
        past: 30,
        tokens: &[7],
        logits: Logits::Last,
    }];
    assert!(matches!(
        model.forward(&mut batch),
        Err(ModelError::Pool(PoolError::NotCovered { .. }))
    ));
}

#[test]
fn invalid_batches_are_refused_before_any_write() {
    let model = tiny();
    let pool = pool_for(&model, 64);
    let mut lease = pool.lease(RequestId(1), 8).unwrap();
    let mut empty = [Sequence {
        lease: &mut lease,
        past: 0,
        tokens: &[],
        logits: Logits::Last,
    }];
    assert!(matches!(
        model.forward(&mut empty),
        Err(ModelError::InvalidBatch { .. })
    ));
    let mut oov = [Sequence {
        lease: &mut lease,
        past: 0,
        tokens: &[9999],
        logits: Logits::Last,
    }];
    assert!(matches!(
        model.forward(&mut oov),
        Err(ModelError::TokenOutOfVocab { token: 9999, .. })
    ));
    let long = vec![1u32; 9];
    let mut over = [Sequence {
        lease: &mut lease,
        past: 0,
        tokens: &long,
        logits: Logits::Last,
    }];
    assert!(matches!(
        model.forward(&mut over),
        Err(ModelError::InvalidBatch { .. })
    ));
    assert!(
        lease.read_layer::<f32>(0, 1).is_err(),
        "nothing was written"
    );
}
