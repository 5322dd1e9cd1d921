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
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use kvfence_engine::{Drain, PrefillWorker};
use kvfence_fleet::tls::{Credentials, Role};
use kvfence_fleet::{
    Fleet, ModelFingerprint, PeerNames, serve_decode_workers, serve_routers, start_decode_worker,
};
use kvfence_model::LoadedModel;
use kvfence_pool::Pool;
use kvfence_server::{Traces, WorkerStatus};
use tracing::{info, warn};

use crate::serve::{
    EngineArgs, HttpArgs, TraceArgs, chat_template_file, load_model, load_text_model, serve_http,
    shutdown_signal, tenants,
};

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
        let credentials = Credentials::load(&self.tls_dir, role)
            .with_context(|| format!("loading the {role} role's TLS credentials"))?;
        if let Some(mode) = Credentials::key_open_to_others(&self.tls_dir, role) {
            warn!(
                dir = %self.tls_dir.display(),
                mode = format!("{mode:o}"),
                "the {role} role's private key is open to every user of this machine: make it 0600 (on Kubernetes, defaultMode: 0400 on the Secret volume)"
            );
        }
        Ok(credentials)
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
    /// Address for the operator's probes and scraper: GET /health (alive),
    /// /ready (can take work: 503 while draining, or, for a decode worker,
    /// while no prefill worker is linked) and /metrics (this worker's own
    /// pools and counters). Serves no API. Off unless given.
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
    /// Seconds in-flight work may take to finish after SIGINT/SIGTERM;
    /// meanwhile nothing new is admitted and /ready answers 503.
    #[arg(long, default_value_t = 30)]
    shutdown_timeout: u64,
    #[command(flatten)]
    tls: TlsArgs,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    traces: TraceArgs,
}

#[derive(Args, Debug)]
pub(crate) struct PrefillArgs {
    #[command(flatten)]
    worker: WorkerArgs,
}

#[derive(Args, Debug)]
pub(crate) struct DecodeArgs {
    /// The prefill workers to fill this worker's grants: HOST:PORT entries,
    /// comma-separated, each an address or a DNS name. Every address a
    /// name resolves to is a prefill worker, and names are resolved again
    /// every 5 s, so a Kubernetes headless Service's pods join and leave
    /// as they become ready or go. Each is dialled at start and again,
    /// with backoff, whenever its link drops; a certificate or model that
    /// can never match stops the start.
    #[arg(long, value_delimiter = ',', required = true, value_name = "HOST:PORT")]
    prefill: Vec<String>,
    #[command(flatten)]
    worker: WorkerArgs,
}

#[derive(Args, Debug)]
pub(crate) struct RouterArgs {
    /// The model whose tokenizer and chat template the router applies (the
    /// workers must run the same model). Its weights are never loaded.
    #[arg(long, default_value = "builtin:tiny")]
    model: String,
    /// The decode workers to send requests to: HOST:PORT entries,
    /// comma-separated, each an address or a DNS name (every address a
    /// name resolves to is a worker; names are resolved again every 5 s,
    /// and a worker whose address goes finishes what it carries first).
    /// Per request the router picks a decode worker and one of its
    /// prefill workers that can hold it, least loaded first; workers that
    /// drop are dialled again with backoff.
    #[arg(long, value_delimiter = ',', required = true, value_name = "HOST:PORT")]
    decode: Vec<String>,
    #[command(flatten)]
    tls: TlsArgs,
    #[command(flatten)]
    http: HttpArgs,
    #[command(flatten)]
    traces: TraceArgs,
}

/// The parts every worker starts from: credentials, model and pool (its
/// log started before).
fn start_worker(
    args: &WorkerArgs,
    role: Role,
) -> anyhow::Result<(Credentials, Arc<LoadedModel>, Pool, Option<Traces>)> {
    let traces = args.traces.export(match role {
        Role::Prefill => "prefill",
        _ => "decode",
    })?;
    let credentials = args.tls.credentials(role)?;
    let model = load_model(&args.model)?;
    // Workers of a fleet declare no public prefixes (only `serve` does).
    let pool = args.engine.pool(
        &model,
        args.kv_pool_tokens,
        kvfence_pool::DEFAULT_PUBLIC_MIN_TOKENS,
        args.engine.kv_keep(false)?,
    )?;
    Ok((credentials, model, pool, traces))
}

/// Serves a worker's `/health`, `/ready` and `/metrics` on
/// `--metrics-listen` (if given), says where the worker listens (`address`,
/// already bound), and waits for SIGINT/SIGTERM; then drains: stops
/// admitting, waits up to `--shutdown-timeout` for `in_flight` to reach
/// zero, and returns.
/// How long a drained worker waits for its links' writers to send frames
/// already handed to them: they are in this process's memory, a socket
/// write away.
const LINK_FLUSH: Duration = Duration::from_millis(100);

fn run_until_drained(
    address: SocketAddr,
    args: &WorkerArgs,
    model: Arc<LoadedModel>,
    worker: Arc<dyn Drain>,
) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    if let Some(status) = args.metrics_listen {
        let state =
            WorkerStatus::new(worker.clone(), model.model.config().max_position_embeddings)?;
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind(status))
            .with_context(|| format!("binding the status listener {status} (--metrics-listen)"))?;
        println!("metrics on http://{}", listener.local_addr()?);
        runtime.spawn(kvfence_server::serve_worker_status(listener, state));
    }
    println!("listening on {address}");
    std::io::stdout().flush()?;
    runtime.block_on(shutdown_signal());
    worker.stop_admitting();
    let deadline = Instant::now() + Duration::from_secs(args.shutdown_timeout);
    while worker.in_flight() > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    match worker.in_flight() {
        0 => {
            // Every answer's last event is with its link's writer (a decode
            // worker counts answers in flight until then): a moment for the
            // writers to put those frames on their sockets before exit.
            std::thread::sleep(LINK_FLUSH);
            info!("drained; exiting")
        }
        left => warn!(
            left,
            "shutdown grace period over; exiting with work in flight"
        ),
    }
    Ok(())
}

pub(crate) fn prefill(args: PrefillArgs) -> anyhow::Result<()> {
    let _log = kvfence_server::init_logging();
    let (credentials, model, pool, _traces) = start_worker(&args.worker, Role::Prefill)?;
    let listener = TcpListener::bind(args.worker.listen)
        .with_context(|| format!("binding {}", args.worker.listen))?;
    let address = listener.local_addr()?;
    let worker = PrefillWorker::start(Arc::clone(&model), pool, args.worker.engine.config()?)
        .context("starting the prefill worker")?;
    let worker = Arc::new(worker);
    serve_decode_workers(&worker, listener, &credentials).context("accepting decode workers")?;
    run_until_drained(address, &args.worker, model, worker)
}

pub(crate) fn decode(args: DecodeArgs) -> anyhow::Result<()> {
    let _log = kvfence_server::init_logging();
    let prefills = PeerNames::parse(&args.prefill, "prefill worker")?;
    let (credentials, model, pool, _traces) = start_worker(&args.worker, Role::Decode)?;
    let engine = start_decode_worker(
        Arc::clone(&model),
        pool,
        args.worker.engine.config()?,
        prefills,
        &credentials,
    )
    .context("linking to the prefill workers")?;
    let engine = Arc::new(engine);
    let listener = TcpListener::bind(args.worker.listen)
        .with_context(|| format!("binding {}", args.worker.listen))?;
    let address = listener.local_addr()?;
    let serving = Arc::clone(&engine);
    std::thread::spawn(move || {
        if let Err(error) = serve_routers(serving, listener, &credentials) {
            warn!(%error, "stopped serving routers");
        }
    });
    run_until_drained(address, &args.worker, model, engine)
}

pub(crate) fn router(args: RouterArgs) -> anyhow::Result<()> {
    let _log = kvfence_server::init_logging();
    let _traces = args.traces.export("router")?;
    let names = PeerNames::parse(&args.decode, "decode worker")?;
    let credentials = args.tls.credentials(Role::Router)?;
    let tenants = tenants(&args.http)?;
    let mut model = load_text_model(&args.model)?;
    if let Some(path) = &args.http.chat_template {
        let text = Arc::get_mut(&mut model).expect("a model just loaded has one owner");
        text.chat_template = Some(chat_template_file(path, &text.config, &text.tokenizer)?);
    }
    let fingerprint = ModelFingerprint::of_config(&model.config);
    let fleet = Fleet::start(names, &credentials, fingerprint)
        .context("connecting to the decode workers")?;
    wait_for_workers(&fleet, &args.decode);
    serve_http(&args.http, tenants, model, Box::new(fleet))
}

/// The advertised context is computed once, from the pools the workers
/// report: wait until some worker has answered and every one has, or, once
/// one has, at most [`FIRST_CONTACT_WAIT`] for the rest (they join when
/// they come up, and are only given requests their pools can hold).
fn wait_for_workers(fleet: &Fleet, names: &[String]) {
    const FIRST_CONTACT_WAIT: Duration = Duration::from_secs(10);
    let started = Instant::now();
    let mut first_contact: Option<Instant> = None;
    let mut said = Instant::now();
    while !fleet.has_heard_from_every_worker() {
        if first_contact.is_none() && fleet.has_heard_from_any_worker() {
            first_contact = Some(Instant::now());
        }
        if first_contact.is_some_and(|t| t.elapsed() >= FIRST_CONTACT_WAIT) {
            warn!("starting without every decode worker; the others join when reachable");
            return;
        }
        if said.elapsed() >= Duration::from_secs(5) {
            info!(
                waited_s = started.elapsed().as_secs(),
                names = ?names,
                members = ?fleet.member_addresses(),
                "waiting for the decode workers to answer"
            );
            said = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `kvfence cluster init`: a new cluster CA and a certificate per role.
pub(crate) fn cluster_init(out: &std::path::Path) -> anyhow::Result<()> {
    let ca = kvfence_fleet::tls::ClusterCa::generate()?;
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
