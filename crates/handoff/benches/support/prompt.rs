//! The prompt every hand-off bench moves: `builtin:small`'s KV (30 layers,
//! 3 KV heads, head dim 64, f32) in 16-token pages, one 512-token prompt,
//! 23.6 MB. Shared by this crate's `handoff` bench and `kvfence-fleet`'s
//! `link` bench (which includes this file), so their figures compare.

use kvfence_pool::{ElemType, KvShape, Lease, Pool, PoolSize, PoolSpec, RequestId, Scrub};

pub const SHAPE: KvShape = KvShape {
    layers: 30,
    kv_heads: 3,
    head_dim: 64,
};
pub const TOKENS: usize = 512;
/// The prompt's KV bytes, every layer's K and V.
pub const BYTES: usize = TOKENS * SHAPE.layers * 2 * SHAPE.kv_heads * SHAPE.head_dim * 4;

/// A pool with room for the prompt twice (a source and a destination).
pub fn pool() -> Pool {
    Pool::new(
        &PoolSpec::new(SHAPE, 16, ElemType::F32, PoolSize::Tokens(2 * TOKENS))
            .with_scrub(Scrub::Off),
    )
    .expect("bench pool")
}

/// The prompt, every position of every layer written.
pub fn source(pool: &Pool) -> Lease {
    let mut lease = pool.lease(RequestId(1), TOKENS).expect("room");
    let values: Vec<f32> = (0..TOKENS * SHAPE.kv_heads * SHAPE.head_dim)
        .map(|i| i as f32)
        .collect();
    for layer in 0..SHAPE.layers {
        lease
            .write_positions(layer, 0, &values, &values)
            .expect("in range");
    }
    lease
}
