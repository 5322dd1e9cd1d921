//! `kvfence prefill`, `kvfence decode` and `kvfence router`: the roles as
//! separate processes over authenticated TCP links.
//!
//! ```text
//! client ──HTTP──▶ router ──▶ decode worker ──hand-off──▶ prefill worker
//! ```
//!
//! Every link is TLS 1.3 with mutual, role-bound certificates: each process
//! reads its role's certificate, its key and the cluster CA from
//! `--tls-dir` (written by `kvfence cluster init`).

use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use kvfence_engine::tls::{Credentials, Role};
use kvfence_engine::{Engine, Fleet, RemoteEngine, serve_prefill, serve_routers};
use kvfence_model::LoadedModel;
use kvfence_pool::Pool;
use tracing::warn;

use crate::serve::{EngineArgs, HttpArgs, init_logging, load_model, serve_http, tenants};

/// Where a process finds its TLS credentials.
#[derive(Args, Debug)]
pub(crate) struct TlsArgs {
    /// Directory holding ca.crt and this role's certificate and key
    /// (ROLE.crt and ROLE.key, as `kvfence cluster init` writes them, or
    /// tls.crt and tls.key, as a Kubernetes TLS Secret mounts them).
    #[arg(long, env = "KVFENCE_TLS_DIR")]
    tls_dir: PathBuf,
}

impl TlsArgs {
    fn credentials(&self, role: Role) -> anyhow::Result<Credentials> {
        if std::env::var_os("KVFENCE_CLUSTER_SECRET").is_some() {
            warn!(
                "KVFENCE_CLUSTER_SECRET is no longer used: links authenticate with the certificates in --tls-dir"
            );
        }
        Credentials::load(&self.tls_dir, role)
            .with_context(|| format!("loading the {role} role's TLS credentials"))
    }
}

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
    #[command(flatten)]
    tls: TlsArgs,
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
    #[command(flatten)]
    tls: TlsArgs,
    #[command(flatten)]
    http: HttpArgs,
}

fn listen(address: SocketAddr) -> anyhow::Result<TcpListener> {
    let listener = TcpListener::bind(address).with_context(|| format!("binding {address}"))?;
    println!("listening on {}", listener.local_addr()?);
    std::io::stdout().flush()?;
    Ok(listener)
}

/// The parts every worker starts from: credentials, model and pool.
fn start_worker(
    args: &WorkerArgs,
    role: Role,
) -> anyhow::Result<(Credentials, Arc<LoadedModel>, Pool)> {
    init_logging();
    let credentials = args.tls.credentials(role)?;
    let model = load_model(&args.model)?;
    let pool = args.engine.pool(&model, args.kv_pool_tokens)?;
    Ok((credentials, model, pool))
}

pub(crate) fn prefill(args: PrefillArgs) -> anyhow::Result<()> {
    let (credentials, model, pool) = start_worker(&args.worker, Role::Prefill)?;
    let listener = listen(args.worker.listen)?;
    serve_prefill(
        model,
        pool,
        args.worker.engine.config()?,
        listener,
        &credentials,
    )
    .context("serving decode workers")
}

pub(crate) fn decode(args: DecodeArgs) -> anyhow::Result<()> {
    let (credentials, model, pool) = start_worker(&args.worker, Role::Decode)?;
    let engine = Engine::start_decode_worker(
        model,
        pool,
        args.worker.engine.config()?,
        args.prefill,
        &credentials,
    )
    .with_context(|| format!("connecting to the prefill worker at {}", args.prefill))?;
    let listener = listen(args.worker.listen)?;
    serve_routers(Arc::new(engine), listener, &credentials).context("serving routers")
}

pub(crate) fn router(args: RouterArgs) -> anyhow::Result<()> {
    init_logging();
    let credentials = args.tls.credentials(Role::Router)?;
    let tenants = tenants(&args.http)?;
    let model = load_model(&args.model)?;
    let workers = args
        .decode
        .iter()
        .map(|address| {
            RemoteEngine::connect(*address, &credentials)
                .with_context(|| format!("connecting to the decode worker at {address}"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    serve_http(&args.http, tenants, model, Box::new(Fleet::new(workers)?))
}

/// `kvfence cluster init`: a new cluster CA and a certificate per role.
pub(crate) fn cluster_init(out: &std::path::Path) -> anyhow::Result<()> {
    let ca = kvfence_engine::tls::ClusterCa::generate()?;
    let files = ca
        .write_dir(out)
        .with_context(|| format!("writing cluster credentials to {}", out.display()))?;
    for file in &files {
        println!("wrote {}", file.display());
    }
    println!(
        "\nGive each process its role's files (ca.crt, ROLE.crt, ROLE.key) and pass --tls-dir {}.\nThe CA's private key was not kept: to add a role or rotate, run this again into a new directory.",
        out.display()
    );
    Ok(())
}
