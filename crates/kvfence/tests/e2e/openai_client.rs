//! The official `openai` Python package, as agent frameworks and chat UIs
//! use it, against real servers: tools (`auto`, `required`, named,
//! streamed, a round trip), `chat.completions.parse` with a Pydantic model,
//! `json_object`, logprobs, `n`, penalties, `models.retrieve`, the error
//! envelope and the Responses API (plain, streamed, a tool round trip,
//! stored: continued, retrieved, its input items listed, deleted),
//! colocated and disaggregated. The client is installed into a virtual
//! environment of its own, at the versions `tests/openai/requirements.txt`
//! pins, the first time this runs.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::{Server, venv_python};

/// The virtual environment's Python, with the pinned client installed.
fn python() -> PathBuf {
    venv_python(
        "openai-venv",
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai/requirements.txt"),
    )
}

/// Runs `tests/openai/SCRIPT` with the official client against `server`
/// (and `env`); returns the names of the checks it printed as passed.
pub fn client_checks(script: &str, server: &Server, env: &[(&str, &str)]) -> Vec<String> {
    python_checks(&python(), &format!("tests/openai/{script}"), server, env)
}

/// Runs the crate's `SCRIPT` with `python` against `server` (and `env`),
/// which it finds in `KVFENCE_BASE_URL`, serving `builtin:tiny`; returns
/// the names of the checks it printed (as a JSON list) as passed.
pub fn python_checks(
    python: &Path,
    script: &str,
    server: &Server,
    env: &[(&str, &str)],
) -> Vec<String> {
    let out = Command::new(python)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join(script))
        .env("KVFENCE_BASE_URL", &server.base)
        .env("KVFENCE_MODEL", "builtin:tiny")
        .envs(env.iter().copied())
        .output()
        .expect("the script runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{script}: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim()).unwrap()
}

#[test]
fn the_official_python_client_works() {
    for mode in [
        &[][..],
        &["--mode", "disaggregated", "--handoff", "tcp"][..],
    ] {
        let server = Server::start(mode);
        let passed = client_checks("client_suite.py", &server, &[]);
        assert_eq!(passed.len(), 15, "{passed:?}");
    }
}
