//! Agent frameworks as their users run them, unchanged: the OpenAI Agents
//! SDK (an Agent with tools and `output_type` on its Responses and Chat
//! Completions models, a run continued by `previous_response_id`, one kept
//! in a conversation) and LangChain's `with_structured_output` by JSON
//! schema and by function calling — `tests/agents/agents_suite.py`, in a
//! virtual environment of its own at the versions
//! `tests/agents/requirements.txt` pins, colocated and disaggregated.

use std::path::Path;

use crate::common::{Server, venv_python};
use crate::openai_client::python_checks;

#[test]
fn agent_frameworks_run_unchanged() {
    let python = venv_python(
        "agents-venv",
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/agents/requirements.txt"),
    );
    for mode in [
        &[][..],
        &["--mode", "disaggregated", "--handoff", "tcp"][..],
    ] {
        let server = Server::start(mode);
        let passed = python_checks(&python, "tests/agents/agents_suite.py", &server, &[]);
        assert_eq!(passed.len(), 10, "{passed:?}");
    }
}
