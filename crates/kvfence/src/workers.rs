//! `kvfence prefill`, `kvfence decode` and `kvfence router`: the roles as
//! separate processes over authenticated TCP links.
//!
//! ```text
//! client ──HTTP──▶ router ──▶ decode worker ──hand-off──▶ prefill worker
//! ```
//!
//! Every link opens with the cluster-secret challenge-response; the secret
//! comes from `--cluster-secret-file` or `KVFENCE_CLUSTER_SECRET` and must be
//! the same for all three.

use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use kvfence_engine::{Engine, Fleet, RemoteEngine, serve_prefill, serve_routers};
use kvfence_model::LoadedModel;
use kvfence_pool::Pool;

use crate::serve::{
    EngineArgs, HttpArgs, configured_secret, init_logging, load_model, serve_http, tenants,
};

/// What every worker process takes.
#[derive(Args, Debug)]
pub(crate) struct WorkerArgs {
    /// smollm2 (fetched on first use), a .gguf file, a Hugging Face model
    /// directory, builtin:tiny or builtin:small (all workers and the router
    /// must run the same model).
    #[arg(long, default_value = "builtin:tiny")]
    model: String,
    /// Address to listen on: decode workers connect to a prefill worker,
    /// routers to a decode worker (port 0 picks a free one).
    #[arg(long)]
    listen: SocketAddr,
    /// Tokens of KV cache for this worker's pool.
    #[arg(long, default_value_t = 16384)]
    kv_pool_tokens: usize,
    /// File holding the cluster secret (else KVFENCE_CLUSTER_SECRET).
    #[arg(long)]
    cluster_secret_file: Option<PathBuf>,
    #[command(flatten)]
    engine: EngineArgs,
}

#[derive(Args, Debug)]
pub(crate) struct PrefillArgs {
    #[command(flatten)]
    worker: WorkerArgs,
}

#[derive(Args, Debug)]
pub(crate) struct DecodeArgs {
    /// The prefill worker to connect to.
    #[arg(long)]
    prefill: SocketAddr,
    #[command(flatten)]
    worker: WorkerArgs,
}

#[derive(Args, Debug)]
pub(crate) struct RouterArgs {
    /// The model whose tokenizer and chat template the router applies (the
    /// workers must run the same model).
    #[arg(long, default_value = "builtin:tiny")]
    model: String,
    /// The decode workers to send requests to (comma-separated); each
    /// request goes to the one with the fewest requests in flight.
    #[arg(long, value_delimiter = ',', required = true)]
    decode: Vec<SocketAddr>,
    /// File holding the cluster secret (else KVFENCE_CLUSTER_SECRET).
    #[arg(long)]
    cluster_secret_file: Option<PathBuf>,
    #[command(flatten)]
    http: HttpArgs,
}

fn secret(file: Option<&PathBuf>) -> anyhow::Result<Vec<u8>> {
    configured_secret(file)?.context(
        "separate worker processes need a shared cluster secret: set KVFENCE_CLUSTER_SECRET or pass --cluster-secret-file",
    )
}

fn listen(address: SocketAddr) -> anyhow::Result<TcpListener> {
    let listener = TcpListener::bind(address).with_context(|| format!("binding {address}"))?;
    println!("listening on {}", listener.local_addr()?);
    std::io::stdout().flush()?;
    Ok(listener)
}

/// The parts every worker starts from: secret, model and pool.
fn start_worker(args: &WorkerArgs) -> anyhow::Result<(Vec<u8>, Arc<LoadedModel>, Pool)> {
    init_logging();
    let secret = secret(args.cluster_secret_file.as_ref())?;
    let model = load_model(&args.model)?;
    let pool = args.engine.pool(&model, args.kv_pool_tokens)?;
    Ok((secret, model, pool))
}

pub(crate) fn prefill(args: PrefillArgs) -> anyhow::Result<()> {
    let (secret, model, pool) = start_worker(&args.worker)?;
    let listener = listen(args.worker.listen)?;
    serve_prefill(model, pool, args.worker.engine.config()?, listener, &secret)
        .context("serving decode workers")
}

pub(crate) fn decode(args: DecodeArgs) -> anyhow::Result<()> {
    let (secret, model, pool) = start_worker(&args.worker)?;
    let engine = Engine::start_decode_worker(
        model,
        pool,
        args.worker.engine.config()?,
        args.prefill,
        &secret,
    )
    .with_context(|| format!("connecting to the prefill worker at {}", args.prefill))?;
    let listener = listen(args.worker.listen)?;
    serve_routers(Arc::new(engine), listener, secret).context("serving routers")
}

pub(crate) fn router(args: RouterArgs) -> anyhow::Result<()> {
    init_logging();
    let secret = secret(args.cluster_secret_file.as_ref())?;
    let tenants = tenants(&args.http)?;
    let model = load_model(&args.model)?;
    let workers = args
        .decode
        .iter()
        .map(|address| {
            RemoteEngine::connect(*address, &secret)
                .with_context(|| format!("connecting to the decode worker at {address}"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    serve_http(&args.http, tenants, model, Box::new(Fleet::new(workers)?))
}
