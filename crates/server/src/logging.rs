//! The process's log: `RUST_LOG` (default `info`) to stderr, under a
//! filter no directive can lift — the third-party crates that see request
//! content or credentials log nothing more verbose than it allows, so no
//! prompt, completion or key reaches a log line at any level (I10).
//!
//! Lines are written by a thread of their own, from a bounded buffer: a
//! reader of stderr that stops reading (a paused pipe, a log shipper
//! behind) then costs lines, counted in `kvfence_log_lines_dropped_total`,
//! never a request. (Written in place, the first full pipe stopped every
//! thread that logs — each request logs — and the API with them, while
//! `/health`, which logs nothing, still answered.)

use std::sync::OnceLock;

use tracing_appender::non_blocking::{ErrorCounter, NonBlocking, NonBlockingBuilder, WorkerGuard};

/// Lines the log's buffer holds while stderr does not take them: about a
/// megabyte or two of the usual lines, and every line of a long burst.
const BUFFERED_LINES: usize = 8192;

/// The count of lines dropped because stderr did not take them.
static DROPPED: OnceLock<ErrorCounter> = OnceLock::new();

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

/// The log's writer thread: dropping it writes what is still buffered
/// (waiting a second at most) and ends the thread. Keep it until the
/// process is done.
#[must_use = "dropping it ends the log"]
pub struct LogGuard {
    writer: Option<(NonBlocking, WorkerGuard)>,
}

impl Drop for LogGuard {
    fn drop(&mut self) {
        let Some((mut probe, guard)) = self.writer.take() else {
            return;
        };
        // With the buffer full — stderr not read — tracing-appender's guard
        // reports so on stdout, which may be just as stuck (and a closed
        // stdout makes that a panic whose message goes to stderr): the
        // process would never exit. So it is dropped, flushing the buffer,
        // only if the buffer takes an empty line; otherwise the process
        // exits without its buffered lines, which nobody was reading.
        let before = probe.error_counter().dropped_lines();
        let _ = std::io::Write::write(&mut probe, &[]);
        if probe.error_counter().dropped_lines() > before {
            std::mem::forget(guard);
        }
    }
}

/// Logs to stderr, `info` unless `RUST_LOG` says otherwise, through a
/// buffer that drops lines rather than wait for stderr. Never request
/// text, at any level (I10).
pub fn init_logging() -> LogGuard {
    let rust_log = std::env::var("RUST_LOG").ok();
    let (writer, guard) = NonBlockingBuilder::default()
        .lossy(true)
        .buffered_lines_limit(BUFFERED_LINES)
        .thread_name("kvfence-log")
        .finish(std::io::stderr());
    let dropped = writer.error_counter();
    let probe = writer.clone();
    let subscriber = log_subscriber(rust_log.as_deref(), writer);
    // Also takes records of crates that log through `log` (the tokenizer
    // does), so they pass the same filter. A second call keeps the first,
    // and its writer.
    match tracing_subscriber::util::SubscriberInitExt::try_init(subscriber) {
        Ok(()) => {
            let _ = DROPPED.set(dropped);
            LogGuard {
                writer: Some((probe, guard)),
            }
        }
        Err(_) => LogGuard { writer: None },
    }
}

/// Log lines this process dropped because stderr did not take them.
pub fn log_lines_dropped() -> u64 {
    DROPPED
        .get()
        .map_or(0, |counter| counter.dropped_lines() as u64)
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
