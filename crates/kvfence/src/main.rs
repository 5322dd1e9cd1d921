//! The `kvfence` binary: parse arguments, build the parts, run them.
//! Logic lives in the library crates.

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use kvfence_pool::{ElemType, KvShape, PoolSize, PoolSpec};

/// kvfence: multi-tenant LLM serving with fenced KV memory.
///
/// Every KV page has one owner and a generation; every write is fenced and
/// every read is checked against what was written, so a request can only
/// read KV memory it wrote itself.
#[derive(Parser, Debug)]
#[command(name = "kvfence", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Inspect KV pool sizing.
    #[command(subcommand)]
    Pool(PoolCommand),
}

#[derive(Subcommand, Debug)]
enum PoolCommand {
    /// Show what a KV pool of the given shape and budget really holds:
    /// pages, bytes and the token capacity admission will advertise.
    Plan(PlanArgs),
}

#[derive(Args, Debug)]
struct PlanArgs {
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
    /// Element type of stored K/V.
    #[arg(long, value_enum, default_value_t = Elem::F32)]
    dtype: Elem,
    /// Memory budget for the pool, in MiB.
    #[arg(long, conflicts_with = "tokens", required_unless_present = "tokens")]
    mib: Option<usize>,
    /// Tokens the pool must hold at least.
    #[arg(long)]
    tokens: Option<usize>,
}

#[derive(ValueEnum, Clone, Copy, Debug)]
enum Elem {
    F32,
    F16,
    Bf16,
}

impl From<Elem> for ElemType {
    fn from(e: Elem) -> Self {
        match e {
            Elem::F32 => ElemType::F32,
            Elem::F16 => ElemType::F16,
            Elem::Bf16 => ElemType::BF16,
        }
    }
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Pool(PoolCommand::Plan(args)) => plan(&args),
    }
}

fn plan(args: &PlanArgs) -> anyhow::Result<()> {
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
    let geometry = PoolSpec::new(shape, args.page_size, args.dtype.into(), size)
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
