//! `kvfence bench`: the load generator of `kvfence-audit` on the command line.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvfence_audit::bench::{BenchConfig, run as run_bench};

#[derive(Args, Debug)]
pub(crate) struct BenchArgs {
    /// Server root, e.g. http://127.0.0.1:8000 (any OpenAI-compatible server).
    #[arg(long)]
    base_url: String,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 8, value_parser = crate::positive::<usize>)]
    concurrency: usize,
    /// Requests in all.
    #[arg(long, default_value_t = 64, value_parser = crate::positive::<usize>)]
    requests: usize,
    /// Prompt tokens per request (sent as token ids, so exact on any server).
    #[arg(long, default_value_t = 128, value_parser = crate::positive::<usize>)]
    prompt_len: usize,
    /// Completion tokens per request (the server is asked to ignore EOS).
    #[arg(long, default_value_t = 64, value_parser = crate::positive::<usize>)]
    output_len: usize,
    /// API key; repeat for several tenants (requests go round-robin).
    #[arg(long = "api-key")]
    api_keys: Vec<String>,
    /// Model id to send (needed by servers that check it).
    #[arg(long)]
    model: Option<String>,
    /// Time-to-first-token objective for goodput, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    slo_ttft_ms: u64,
    /// Time-per-output-token objective for goodput, in milliseconds.
    #[arg(long, default_value_t = 200)]
    slo_tpot_ms: u64,
    /// Open a new connection for every request. Without it idle
    /// connections are reused, and a request whose connection the server
    /// had closed (no response at all) is sent once more on a new one.
    #[arg(long)]
    fresh_connections: bool,
    /// Which prompts to send. Request i sends the same prompt in every run
    /// with the same seed (a server's prompt cache may reuse it from an
    /// earlier run); under another seed no prompt shares more than a few
    /// first tokens with them.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// A request fails when the server sends nothing for this many seconds
    /// (before its response, or between two streamed pieces), instead of
    /// holding the run forever. Long prompts on slow servers need minutes.
    #[arg(long, default_value_t = 600, value_parser = crate::positive::<u64>)]
    idle_timeout_s: u64,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

pub(crate) fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let config = BenchConfig {
        base_url: args.base_url.clone(),
        api_keys: args.api_keys.clone(),
        model: args.model.clone(),
        concurrency: args.concurrency,
        requests: args.requests,
        prompt_len: args.prompt_len,
        output_len: args.output_len,
        slo_ttft: Duration::from_millis(args.slo_ttft_ms),
        slo_tpot: Duration::from_millis(args.slo_tpot_ms),
        fresh_connections: args.fresh_connections,
        seed: args.seed,
        idle_timeout: Duration::from_secs(args.idle_timeout_s),
    };
    eprintln!(
        "{} requests, {} at a time, {} prompt + {} output tokens each, against {}",
        args.requests, args.concurrency, args.prompt_len, args.output_len, args.base_url
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let report = runtime.block_on(run_bench(&config));
    print!("{report}");
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report).context("encoding the report")?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    anyhow::ensure!(
        report.succeeded == report.requests,
        "{} of {} requests failed",
        report.requests - report.succeeded,
        report.requests
    );
    Ok(())
}
