//! `kvfence audit`: the isolation auditor of `kvfence-audit` on the command
//! line, for any OpenAI-compatible endpoint.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvfence_audit::audit::{AuditConfig, run as run_audit};

#[derive(Args, Debug)]
pub(crate) struct AuditArgs {
    /// Server root, e.g. http://127.0.0.1:8000 (any OpenAI-compatible server).
    #[arg(long)]
    base_url: String,
    /// API key; repeat for several tenants (canaries and load use each).
    #[arg(long = "api-key")]
    api_keys: Vec<String>,
    /// Model id to send and to look up in /v1/models.
    #[arg(long)]
    model: Option<String>,
    /// The context to hold the server to when /v1/models does not say.
    #[arg(long)]
    context: Option<usize>,
    /// Upper bound on the whole audit; checks that would overrun are skipped.
    #[arg(long, default_value_t = 300, value_parser = crate::positive::<u64>)]
    budget_seconds: u64,
    /// Requests in flight during the load phases.
    #[arg(long, default_value_t = 8, value_parser = crate::positive::<usize>)]
    concurrency: usize,
    /// The server does not promise batch-invariant greedy decoding (most
    /// engines do not): report the divergence rate of checks 3 and 5
    /// instead of failing on it.
    #[arg(long)]
    not_batch_invariant: bool,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Where the server's metrics are, if not at BASE_URL/metrics (kvfence
    /// with --config serves them on --metrics-listen); the canary check
    /// looks for markers there too.
    #[arg(long)]
    metrics_url: Option<String>,
}

pub(crate) fn run(args: &AuditArgs) -> anyhow::Result<()> {
    let config = AuditConfig {
        base_url: args.base_url.trim_end_matches('/').to_string(),
        api_keys: args.api_keys.clone(),
        model: args.model.clone(),
        context: args.context,
        budget: Duration::from_secs(args.budget_seconds),
        batch_invariant: !args.not_batch_invariant,
        concurrency: args.concurrency,
        metrics_url: args.metrics_url.clone(),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let report = runtime
        .block_on(run_audit(config, &|step: &str| eprintln!("{step}")))
        .with_context(|| format!("auditing {}", args.base_url))?;
    print!("{}", report.table());
    if let Some(path) = &args.report {
        let text = serde_json::to_string_pretty(&report).context("encoding the report")?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    let named = |verdict| -> Vec<&str> {
        report
            .checks
            .iter()
            .filter(|c| c.verdict == verdict)
            .map(|c| c.check)
            .collect()
    };
    let inconclusive = named(kvfence_audit::audit::Verdict::Inconclusive);
    if !inconclusive.is_empty() {
        eprintln!(
            "inconclusive (could not finish; see figures): {}",
            inconclusive.join(", ")
        );
    }
    let failed = named(kvfence_audit::audit::Verdict::Fail);
    anyhow::ensure!(failed.is_empty(), "failed: {}", failed.join(", "));
    Ok(())
}
