//! `kvfence pool plan`: what a KV pool of a given shape and budget holds.

use anyhow::Context;
use clap::Args;
use kvfence_pool::{ElemType, KvShape, PoolSize, PoolSpec};

use crate::Dtype;

#[derive(Args, Debug)]
pub(crate) struct PlanArgs {
    /// Decoder layers of the model.
    #[arg(long)]
    layers: usize,
    /// Key/value heads per layer.
    #[arg(long)]
    kv_heads: usize,
    /// Elements per head.
    #[arg(long)]
    head_dim: usize,
    /// Token slots per page.
    #[arg(long, default_value_t = 16)]
    page_size: usize,
    /// Element type of stored K/V (`serve`'s default is f16).
    #[arg(long, value_enum, default_value_t = Dtype::F16)]
    dtype: Dtype,
    /// Memory budget for the pool, in MiB.
    #[arg(long, conflicts_with = "tokens", required_unless_present = "tokens")]
    mib: Option<usize>,
    /// Tokens the pool must hold at least.
    #[arg(long)]
    tokens: Option<usize>,
}

pub(crate) fn run(args: &PlanArgs) -> anyhow::Result<()> {
    let size = match (args.mib, args.tokens) {
        (Some(mib), _) => PoolSize::Bytes(mib.saturating_mul(1 << 20)),
        (None, Some(tokens)) => PoolSize::Tokens(tokens),
        (None, None) => unreachable!("clap requires --mib or --tokens"),
    };
    let shape = KvShape {
        layers: args.layers,
        kv_heads: args.kv_heads,
        head_dim: args.head_dim,
    };
    let elem = ElemType::from(args.dtype);
    let geometry = PoolSpec::new(shape, args.page_size, elem, size)
        .geometry()
        .context("this pool cannot be built")?;
    println!("pages           {}", geometry.num_pages);
    println!(
        "page size       {} tokens, {} bytes",
        geometry.page_size, geometry.page_bytes
    );
    println!("capacity        {} tokens", geometry.capacity_tokens());
    println!("memory          {} bytes", geometry.capacity_bytes());
    Ok(())
}
