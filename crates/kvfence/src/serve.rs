//! `kvfence serve`: load a model, size the KV pool, start the engine and the
//! HTTP API, stop cleanly on SIGINT/SIGTERM.

use std::io::Write;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, ValueEnum};
use kvfence_engine::{Engine, EngineConfig, Transport};
use kvfence_model::LoadedModel;
use kvfence_pool::{ElemType, Pool, PoolSize, PoolSpec};
use kvfence_server::{ApiOptions, AppState, Capacity, ServerError, Tenants};
use tracing::{info, warn};

#[derive(Args, Debug)]
pub(crate) struct ServeArgs {
    /// builtin:tiny (no download), builtin:small, or a Hugging Face model directory.
    #[arg(long, default_value = "builtin:tiny")]
    model: String,
    /// Address to listen on. Without --config only loopback is allowed.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Tenants file (TOML; see `kvfence tenant add`). Without it, local mode:
    /// one unauthenticated tenant, loopback only.
    #[arg(long)]
    config: Option<PathBuf>,
    /// How prefill and decode run: on separate workers joined by the fenced
    /// KV hand-off (in one process), or on one worker.
    #[arg(long, value_enum, default_value_t = Mode::Disaggregated)]
    mode: Mode,
    /// Transport between the prefill and decode workers: channels, one-sided
    /// shared-memory windows, or a loopback TCP connection authenticated
    /// with the cluster secret.
    #[arg(long, value_enum, default_value_t = Handoff::Inproc)]
    handoff: Handoff,
    /// File holding the cluster secret for --handoff tcp (else the
    /// KVFENCE_CLUSTER_SECRET variable; else a random one, since both ends
    /// live in this process).
    #[arg(long)]
    cluster_secret_file: Option<PathBuf>,
    /// Tokens of KV cache for the decode (or colocated) worker, rounded up
    /// to whole pages.
    #[arg(long, default_value_t = 16384)]
    kv_pool_tokens: usize,
    /// Tokens of KV cache for the prefill worker (disaggregated mode);
    /// defaults to --kv-pool-tokens. The advertised context is the smallest pool's.
    #[arg(long)]
    prefill_pool_tokens: Option<usize>,
    /// Token slots per KV page.
    #[arg(long, default_value_t = 16)]
    page_size: usize,
    /// Largest prompt + completion to accept. Defaults to what the model and
    /// the pool can really hold; larger values are refused unless --clamp-context.
    #[arg(long)]
    max_context: Option<usize>,
    /// Lower a --max-context that exceeds the real capacity instead of refusing to start.
    #[arg(long)]
    clamp_context: bool,
    /// max_tokens for requests that give none.
    #[arg(long, default_value_t = 256)]
    default_max_tokens: usize,
    /// Requests running at once.
    #[arg(long, default_value_t = 64)]
    max_running: usize,
    /// Requests waiting for KV pages at most; beyond it requests get 429.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Tokens per forward pass (decode steps plus prefill chunks).
    #[arg(long, default_value_t = 256)]
    step_tokens: usize,
    /// Model id clients send; defaults to the model's name.
    #[arg(long)]
    served_model_name: Option<String>,
    /// Seconds in-flight requests may take to finish after SIGINT/SIGTERM.
    #[arg(long, default_value_t = 30)]
    shutdown_timeout: u64,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Prefill and decode workers with a fenced KV hand-off between them.
    Disaggregated,
    /// One worker does both phases.
    Colocated,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Handoff {
    /// In-process channels.
    Inproc,
    /// One-sided writes into the decode worker's pages through revocable
    /// windows (the RDMA model); aborted pages are quarantined until drained.
    Shm,
    /// Loopback TCP with an HMAC challenge-response on the cluster secret.
    Tcp,
}

fn cluster_secret(file: Option<&PathBuf>) -> anyhow::Result<Vec<u8>> {
    if let Some(path) = file {
        let text = std::fs::read(path)
            .with_context(|| format!("reading the cluster secret from {}", path.display()))?;
        return Ok(text.trim_ascii().to_vec());
    }
    if let Ok(secret) = std::env::var("KVFENCE_CLUSTER_SECRET") {
        return Ok(secret.into_bytes());
    }
    let random: [u8; 32] = rand::random();
    Ok(random.to_vec())
}

pub(crate) fn run(args: ServeArgs) -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    anyhow::ensure!(
        args.max_running > 0 && args.step_tokens > 0,
        "--max-running and --step-tokens must be positive"
    );

    let tenants = match &args.config {
        Some(path) => Tenants::from_file(path)?,
        None => {
            if !args.host.is_loopback() {
                return Err(ServerError::PublicWithoutTenants {
                    host: args.host.to_string(),
                }
                .into());
            }
            Tenants::local()
        }
    };

    eprintln!("loading {} ...", args.model);
    let started = Instant::now();
    let model = Arc::new(
        LoadedModel::load(&args.model).with_context(|| format!("loading model {}", args.model))?,
    );
    eprintln!(
        "loaded {} in {:.1} s",
        model.name,
        started.elapsed().as_secs_f64()
    );

    let pool_of = |tokens: usize| {
        let kv = model.model.kv_shape();
        let spec = PoolSpec::new(kv, args.page_size, ElemType::F32, PoolSize::Tokens(tokens));
        Pool::new(&spec).context("allocating a KV pool")
    };
    let config = EngineConfig {
        max_running: args.max_running,
        max_queue: args.max_queue,
        step_tokens: args.step_tokens,
    };
    let engine = match args.mode {
        Mode::Colocated => Engine::start(Arc::clone(&model), pool_of(args.kv_pool_tokens)?, config),
        Mode::Disaggregated => {
            let prefill = pool_of(args.prefill_pool_tokens.unwrap_or(args.kv_pool_tokens))?;
            let decode = pool_of(args.kv_pool_tokens)?;
            let transport = match args.handoff {
                Handoff::Inproc => Transport::InProcess,
                Handoff::Shm => Transport::SharedMemory,
                Handoff::Tcp => Transport::Tcp {
                    secret: cluster_secret(args.cluster_secret_file.as_ref())?,
                },
            };
            Engine::start_disaggregated(Arc::clone(&model), prefill, decode, config, &transport)
                .context("connecting the prefill and decode workers")?
        }
    };
    let pools: Vec<(&'static str, usize)> = engine
        .pools()
        .iter()
        .map(|(role, pool)| (role.label(), pool.capacity_tokens()))
        .collect();
    let capacity = Capacity::compute(
        model.model.config().max_position_embeddings,
        &pools,
        args.max_context,
        args.clamp_context,
    )?;
    if capacity.clamped {
        warn!(
            configured = capacity.configured,
            max_context = capacity.max_context,
            "--max-context exceeds the real capacity; CLAMPED to what the pools and model hold"
        );
    }
    for (role, pool) in engine.pools() {
        info!(
            role = role.label(),
            tokens = pool.capacity_tokens(),
            bytes = pool.geometry().capacity_bytes(),
            "KV pool allocated"
        );
    }
    info!(
        mode = ?args.mode,
        model_limit = capacity.model_limit,
        max_context = capacity.max_context,
        bound_by = capacity.pool_role,
        "context limit computed from the real pools"
    );
    if tenants.is_local() {
        info!("local mode: no --config, one unauthenticated tenant, loopback only");
    }

    let model_id = args
        .served_model_name
        .clone()
        .unwrap_or_else(|| default_model_id(&model.name));
    let state = AppState::new(
        engine,
        model,
        ApiOptions {
            tenants,
            model_id,
            capacity,
            default_max_tokens: args.default_max_tokens,
        },
    );

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind((args.host, args.port))
            .await
            .with_context(|| format!("binding {}:{}", args.host, args.port))?;
        let address = listener.local_addr()?;
        println!("listening on http://{address}");
        std::io::stdout().flush()?;
        kvfence_server::serve(
            listener,
            state,
            shutdown_signal(),
            Duration::from_secs(args.shutdown_timeout),
        )
        .await?;
        info!("server stopped");
        Ok(())
    })
}

fn default_model_id(name: &str) -> String {
    if name.starts_with("builtin:") {
        return name.to_string();
    }
    std::path::Path::new(name)
        .file_name()
        .map_or_else(|| name.to_string(), |n| n.to_string_lossy().into_owned())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
    info!("shutdown signal received; finishing in-flight requests");
}
