//! `kvfence pool plan`: what a KV pool of a given shape and budget holds.

use anyhow::Context;
use clap::Args;
use clap::builder::RangedU64ValueParser;
use kvfence_engine::EngineConfig;
use kvfence_pool::{ElemType, KvShape, LayerGroups, MAX_LAYERS, PoolSize, PoolSpec};

use crate::Dtype;

#[derive(Args, Debug)]
pub(crate) struct PlanArgs {
    /// Decoder layers of the model (at most 1024).
    #[arg(long, value_parser = RangedU64ValueParser::<usize>::new().range(1..=MAX_LAYERS as u64))]
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
    /// Tokens the pool must hold at least (one request of this length).
    #[arg(long)]
    tokens: Option<usize>,
    /// Positions a sliding-window layer sees (Gemma 3 270M: 512): those
    /// layers keep only their window, as every worker's pool does unless
    /// `--kv-windows off` (or the shared-memory hand-off).
    #[arg(long)]
    sliding_window: Option<usize>,
    /// With --sliding-window: layer `i` attends to everything when
    /// `i % N == N − 1` (Gemma 3: 6), the others through the window.
    #[arg(long, default_value_t = 6, requires = "sliding_window", value_parser = crate::positive::<usize>)]
    global_every: usize,
    /// With --sliding-window: the worker's --step-tokens, the most
    /// positions one step writes for a request (a window's pages hold it).
    #[arg(long, default_value_t = 256, requires = "sliding_window", value_parser = crate::positive::<usize>)]
    step_tokens: usize,
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
    let mut spec = PoolSpec::new(shape, args.page_size, elem, size);
    if let Some(window) = args.sliding_window {
        let windows: Vec<Option<usize>> = (0..args.layers)
            .map(|i| (i % args.global_every != args.global_every - 1).then_some(window))
            .collect();
        let config = EngineConfig {
            step_tokens: args.step_tokens,
            ..EngineConfig::default()
        };
        let groups = LayerGroups::of_windows(
            &windows,
            kvfence_model::attention::CHUNK,
            config.longest_write(),
        )
        .context("these layers cannot share pages")?;
        spec = spec.with_layer_groups(groups);
    }
    let geometry = spec.geometry().context("this pool cannot be built")?;
    let groups = spec.layer_groups();
    let capacity = groups.capacity_tokens(geometry.num_pages, geometry.page_size);
    println!("pages           {}", geometry.num_pages);
    println!(
        "page size       {} tokens, {} bytes",
        geometry.page_size, geometry.page_bytes
    );
    println!("capacity        {} tokens", capacity);
    println!("memory          {} bytes", geometry.capacity_bytes());
    if groups.is_windowed() {
        // What the longest request would cost if every layer kept every
        // position: one page of every group per page of positions.
        let full = capacity / geometry.page_size * groups.len() * geometry.page_bytes;
        println!(
            "layer groups    {} of {} layers; {} keep a window",
            groups.len(),
            groups.group_size(),
            (0..groups.len())
                .filter(|&g| groups.keep(g) != kvfence_pool::Keep::All)
                .count()
        );
        println!("full KV         {full} bytes for {capacity} tokens");
    }
    Ok(())
}
