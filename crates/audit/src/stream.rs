//! One streaming completion request, timed token by token.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::Value;

use crate::AuditError;

/// When each piece of one streamed completion arrived.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    /// From sending the request to the first generated text.
    pub first_token: Duration,
    /// Arrival times of every chunk carrying text, from the request's start.
    pub chunks: Vec<Duration>,
    /// From sending the request to the end of the stream.
    pub total: Duration,
    /// Completion tokens as the server counted them (`usage`), or chunks seen.
    pub completion_tokens: usize,
    /// Prompt tokens as the server counted them, if it said.
    pub prompt_tokens: Option<usize>,
}

/// Sends `body` (a `/v1/completions` request; `stream` is forced on) and
/// times the answer. Response text is read, never kept or logged.
pub async fn timed_completion(
    client: &reqwest::Client,
    url: &str,
    key: Option<&str>,
    mut body: Value,
) -> Result<Timeline, AuditError> {
    body["stream"] = Value::Bool(true);
    body["stream_options"] = serde_json::json!({ "include_usage": true });
    let mut request = client.post(url).json(&body);
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let start = Instant::now();
    let response = request.send().await.map_err(AuditError::no_response)?;
    let status = response.status().as_u16();
    if status != 200 {
        let code = response
            .json::<Value>()
            .await
            .ok()
            .and_then(|v| v["error"]["code"].as_str().map(str::to_string))
            .unwrap_or_else(|| "no OpenAI error code".into());
        return Err(AuditError::Status { status, code });
    }
    let mut chunks = Vec::new();
    let mut finished = false;
    let mut usage = None;
    let mut pending = String::new();
    let mut bytes = response.bytes_stream();
    while let Some(piece) = bytes.next().await {
        let piece = piece.map_err(AuditError::http)?;
        pending.push_str(&String::from_utf8_lossy(&piece));
        // Server-sent events may end their lines with CRLF; a pair split
        // across two pieces joins here once the second arrives.
        if pending.contains("\r\n") {
            pending = pending.replace("\r\n", "\n");
        }
        while let Some(end) = pending.find("\n\n") {
            let event: String = pending.drain(..end + 2).collect();
            for line in event.lines() {
                let Some(data) = line.strip_prefix("data: ") else {
                    continue;
                };
                if data == "[DONE]" {
                    continue;
                }
                let value: Value = serde_json::from_str(data)
                    .map_err(|_| AuditError::Unfinished("unparseable event".into()))?;
                if let Some(error) = value.get("error") {
                    return Err(AuditError::Unfinished(
                        error["code"].as_str().unwrap_or("error event").to_string(),
                    ));
                }
                if let Some(u) = value.get("usage").filter(|u| !u.is_null()) {
                    usage = Some((u["prompt_tokens"].as_u64(), u["completion_tokens"].as_u64()));
                }
                if let Some(choice) = value["choices"].get(0) {
                    if choice["text"].as_str().is_some_and(|t| !t.is_empty()) {
                        chunks.push(start.elapsed());
                    }
                    if choice["finish_reason"].is_string() {
                        finished = true;
                    }
                }
            }
        }
    }
    if !finished {
        return Err(AuditError::Unfinished("no finish_reason".into()));
    }
    let total = start.elapsed();
    let (prompt_tokens, completion_tokens) = match usage {
        Some((p, Some(c))) => (p.map(|p| p as usize), c as usize),
        _ => (None, chunks.len()),
    };
    Ok(Timeline {
        first_token: chunks.first().copied().unwrap_or(total),
        chunks,
        total,
        completion_tokens,
        prompt_tokens,
    })
}
