//! The process's log: `RUST_LOG` (default `info`) to stderr, under a
//! filter no directive can lift — the third-party crates that see request
//! content or credentials log nothing more verbose than it allows, so no
//! prompt, completion or key reaches a log line at any level (I10).

/// Third-party targets that see request content or credentials, and the
/// most verbose level each may log at: the tokenizer logs every character
/// it normalises at `trace`, the template engine sees messages, the HTTP and
/// TLS stacks see headers (API keys) and bodies. Whatever `RUST_LOG` asks —
/// even a more specific target such as `hyper::proto=trace` — they log
/// nothing more verbose than this (I10).
const QUIET_TARGETS: &[(&str, Option<tracing::Level>)] = &[
    ("tokenizers", None),
    ("minijinja", None),
    ("hyper", Some(tracing::Level::WARN)),
    ("hyper_util", Some(tracing::Level::WARN)),
    ("h2", Some(tracing::Level::WARN)),
    ("axum", Some(tracing::Level::WARN)),
    ("tower", Some(tracing::Level::WARN)),
    ("tower_http", Some(tracing::Level::WARN)),
    ("reqwest", Some(tracing::Level::WARN)),
    ("rustls", Some(tracing::Level::WARN)),
    ("tokio_rustls", Some(tracing::Level::WARN)),
];

/// Whether an event or span may be logged at all, before `RUST_LOG` is asked.
fn loggable(metadata: &tracing::Metadata<'_>) -> bool {
    let target = metadata.target();
    for (quiet, most_verbose) in QUIET_TARGETS {
        let within = target
            .strip_prefix(quiet)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with("::"));
        if within {
            // Levels order from ERROR (most severe) to TRACE (most verbose).
            return most_verbose.is_some_and(|level| *metadata.level() <= level);
        }
    }
    true
}

/// The log subscriber: `RUST_LOG` (default `info`) under [`loggable`].
fn log_subscriber<W>(rust_log: Option<&str>, writer: W) -> impl tracing::Subscriber + Send + Sync
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    use tracing_subscriber::layer::SubscriberExt;
    let filter = rust_log
        .and_then(|directives| tracing_subscriber::EnvFilter::try_new(directives).ok())
        .unwrap_or_else(|| "info".into());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .finish()
        .with(tracing_subscriber::filter::filter_fn(loggable))
}

/// Logs to stderr, `info` unless `RUST_LOG` says otherwise. Never request
/// text, at any level (I10).
pub fn init_logging() {
    let rust_log = std::env::var("RUST_LOG").ok();
    let subscriber = log_subscriber(rust_log.as_deref(), std::io::stderr);
    // Also takes records of crates that log through `log` (the tokenizer
    // does), so they pass the same filter. A second call keeps the first.
    let _ = tracing_subscriber::util::SubscriberInitExt::try_init(subscriber);
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::log_subscriber;

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .expect("the test's log buffer")
                .extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn i10_content_seeing_targets_stay_quiet_whatever_rust_log_asks() {
        for asked in [
            "trace",
            "trace,tokenizers=trace,minijinja=trace,hyper=trace",
            "kvfence_server=trace,hyper::proto=trace",
        ] {
            let captured = Captured::default();
            let writer = captured.clone();
            let subscriber = log_subscriber(Some(asked), move || writer.clone());
            tracing::subscriber::with_default(subscriber, || {
                tracing::trace!(target: "tokenizers::normalizer", "normalised CANARY");
                tracing::trace!(target: "minijinja", "rendered CANARY");
                tracing::trace!(target: "hyper::proto::h1", "authorization: CANARY");
                tracing::trace!(target: "kvfence_server", "kept at trace");
            });
            let log = String::from_utf8(captured.0.lock().expect("log").clone()).expect("utf-8");
            assert!(!log.contains("CANARY"), "{asked}: {log}");
            assert!(log.contains("kept at trace"), "{asked}: {log}");
        }
    }
}
