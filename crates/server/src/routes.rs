//! HTTP handlers. Every request goes: authenticate (401) → parse and
//! validate (400) → template and tokenize → admission against the real
//! context (400 `context_length_exceeded`, before any page is leased, I6) →
//! tenant slot (429) → engine queue (429) → answer or stream. Validation
//! ends before a stream opens; a failure after that is an SSE error event,
//! never a normal finish (I5, I7).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream};
use kvfence_engine::{
    CacheScope, Event, FailureKind, FinishReason, GenerationRequest, RequestHandle, Usage,
};
use serde_json::{Value, json};
use tokio::sync::OwnedSemaphorePermit;
use tracing::{debug, info};

use crate::AppState;
use crate::error::{ApiError, ErrorType};
use crate::openai::{ChatRequest, CommonParams, CompletionRequest, PromptField, parse_body};
use crate::tenants::Tenant;

/// Which OpenAI endpoint a request came through; decides the body shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Completions,
}

impl Endpoint {
    fn label(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat_completions",
            Endpoint::Completions => "completions",
        }
    }

    fn id(self) -> String {
        let prefix = match self {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completions => "cmpl",
        };
        format!("{prefix}-{:024x}", rand::random::<u128>() >> 32)
    }

    fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completions, _) => "text_completion",
        }
    }

    fn choice(self, text: &str, finish: Option<FinishReason>) -> Value {
        match self {
            Endpoint::Chat => json!({
                "index": 0,
                "message": { "role": "assistant", "content": text },
                "logprobs": null,
                "finish_reason": finish.map(finish_name),
            }),
            Endpoint::Completions => {
                json!({ "index": 0, "text": text, "logprobs": null, "finish_reason": finish.map(finish_name) })
            }
        }
    }

    fn delta(self, text: Option<&str>, role: bool, finish: Option<FinishReason>) -> Value {
        match self {
            Endpoint::Chat => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), "assistant".into());
                }
                if let Some(text) = text {
                    delta.insert("content".into(), text.into());
                }
                json!({ "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish.map(finish_name) })
            }
            Endpoint::Completions => {
                json!({ "index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish.map(finish_name) })
            }
        }
    }
}

fn finish_name(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

fn usage_json(usage: Usage) -> Value {
    json!({
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": { "cached_tokens": usage.cached_tokens },
    })
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A validated request, ready for the engine.
struct Prepared {
    request: GenerationRequest,
    stream: bool,
    include_usage: bool,
}

/// `GET /health`.
pub async fn health() -> impl IntoResponse {
    Json(json!({ "status": "ok" }))
}

/// `GET /ready`: 200 while this process can take work — it admits, and
/// the workers it depends on are linked — else 503, so an orchestrator or
/// a load balancer sends traffic elsewhere. `/health` answers whether the
/// process is alive at all.
pub async fn ready(State(state): State<Arc<AppState>>) -> Response {
    if state.engine.is_ready() {
        Json(json!({ "status": "ready" })).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "status": "not ready" })),
        )
            .into_response()
    }
}

/// `GET /metrics`: Prometheus text. Holds counts, states and tenant names;
/// never request text (I10).
pub async fn metrics(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    // A remote engine answers over the network: keep it off the async workers.
    let snapshot = {
        let state = Arc::clone(&state);
        tokio::task::spawn_blocking(move || state.engine.snapshot()).await
    };
    let body = match snapshot {
        Ok(workers) => state.metrics.render(&workers),
        Err(_) => String::new(),
    };
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
}

/// Any other path: 404 in OpenAI's error envelope.
pub async fn not_found(uri: axum::http::Uri) -> Response {
    ApiError::new(
        ErrorType::NotFoundError,
        "not_found",
        format!("no route for {}", uri.path()),
    )
    .into_response()
}

/// The request's one `Authorization` header. Two or more are refused: a
/// proxy and a client that each add one must not leave it to chance which
/// tenant the request runs as.
fn authorization(headers: &HeaderMap) -> Result<Option<&str>, ApiError> {
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    let first = values.next();
    if values.next().is_some() {
        return Err(ApiError::new(
            ErrorType::AuthenticationError,
            "invalid_api_key",
            "more than one Authorization header: send exactly one",
        ));
    }
    Ok(first.and_then(|v| v.to_str().ok()))
}

fn authenticate(state: &AppState, headers: &HeaderMap) -> Result<Arc<Tenant>, ApiError> {
    state.tenants.authenticate(authorization(headers)?)
}

/// `GET /v1/models`: the served model and its honest context (I6).
pub async fn models(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(error) = authenticate(&state, &headers) {
        state.metrics.rejection(error.reason());
        return error.into_response();
    }
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.model_id,
            "object": "model",
            "created": state.created,
            "owned_by": "kvfence",
            "max_model_len": state.capacity.max_context,
            "context_length": state.capacity.max_context,
        }],
    }))
    .into_response()
}

/// `POST /v1/chat/completions`.
pub async fn chat(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    handle(state, headers, body, Endpoint::Chat).await
}

/// `POST /v1/completions`.
pub async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(state, headers, body, Endpoint::Completions).await
}

/// Reads a request's body, bounded in size and in time. Called only once
/// its headers were authenticated and its tenant admitted, so a stranger
/// never makes the server hold a body.
async fn read_body(state: &AppState, headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    let max = state.limits.max_body_bytes;
    let too_large = || {
        ApiError::new(
            ErrorType::TooLarge,
            "request_too_large",
            format!("the request body is larger than {max} bytes"),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > max as u64) {
        return Err(too_large());
    }
    match tokio::time::timeout(state.limits.body_timeout, axum::body::to_bytes(body, max)).await {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(error)) => {
            let inner = error.into_inner();
            if inner.is::<http_body_util::LengthLimitError>() {
                Err(too_large())
            } else {
                Err(ApiError::invalid(
                    "body",
                    "the request body could not be read",
                ))
            }
        }
        Err(_) => Err(ApiError::new(
            ErrorType::Timeout,
            "request_timeout",
            format!(
                "the request body did not arrive within {} s",
                state.limits.body_timeout.as_secs()
            ),
        )),
    }
}

/// Template and tokenizer work for one request, on a blocking thread and
/// at most `text_work` at once: a big prompt never stalls the async
/// runtime (and with it `/health` and every stream).
async fn prepare_off_runtime(
    state: &Arc<AppState>,
    tenant: &Arc<Tenant>,
    body: Bytes,
    endpoint: Endpoint,
) -> Result<Prepared, ApiError> {
    let internal = || {
        ApiError::new(
            ErrorType::ServerError,
            "internal_error",
            "the request could not be prepared",
        )
    };
    let _slot = Arc::clone(&state.text_work)
        .acquire_owned()
        .await
        .map_err(|_| internal())?;
    let (state, tenant) = (Arc::clone(state), Arc::clone(tenant));
    tokio::task::spawn_blocking(move || prepare(&state, &tenant, &body, endpoint))
        .await
        .map_err(|_| internal())?
}

async fn handle(
    state: Arc<AppState>,
    headers: HeaderMap,
    body: Body,
    endpoint: Endpoint,
) -> Response {
    let started = Instant::now();
    // Who is asking, from the headers alone: a stranger is refused before
    // a byte of the body is read.
    let tenant = match authenticate(&state, &headers) {
        Ok(tenant) => tenant,
        Err(error) => return refuse_unread(&state, "-", endpoint, error, body),
    };
    // The tenant's slot before any work: a tenant at its limit costs no
    // body, no template and no tokenizer.
    let permit = match tenant.admit() {
        Ok(permit) => permit,
        Err(error) => return refuse_unread(&state, &tenant.name, endpoint, error, body),
    };
    let body = match read_body(&state, &headers, body).await {
        Ok(body) => body,
        Err(error) => return refuse(&state, &tenant.name, endpoint, error),
    };
    let prepared = match prepare_off_runtime(&state, &tenant, body, endpoint).await {
        Ok(prepared) => prepared,
        Err(error) => return refuse(&state, &tenant.name, endpoint, error),
    };
    debug!(
        tenant = %tenant.name,
        endpoint = endpoint.label(),
        prompt_tokens = prepared.request.prompt.len(),
        "request prepared"
    );
    let prompt_tokens = prepared.request.prompt.len();
    let max_tokens = prepared.request.max_tokens;
    // Awaited, not blocked on: a remote engine's answer comes over the
    // network, and no thread waits for it.
    let handle = match state.engine.submit(prepared.request).await {
        Ok(handle) => handle,
        Err(error) => return refuse(&state, &tenant.name, endpoint, ApiError::from(error)),
    };
    info!(request = %handle.id(), tenant = %tenant.name, endpoint = endpoint.label(), prompt_tokens, max_tokens, stream = prepared.stream, "request admitted");
    let reply = Reply {
        state,
        tenant,
        endpoint,
        handle,
        _permit: permit,
        started,
        id: endpoint.id(),
        created: unix_now(),
        ended: std::cell::Cell::new(false),
    };
    if prepared.stream {
        reply.stream(prepared.include_usage)
    } else {
        reply.collect().await
    }
}

/// A refusal sent before the request's body was read. The body is read and
/// thrown away in the background — nothing kept, at most `max_body_bytes`,
/// for at most the header deadline — so a client still sending it gets to
/// read the answer instead of a broken pipe; then the connection closes.
fn refuse_unread(
    state: &Arc<AppState>,
    tenant: &str,
    endpoint: Endpoint,
    error: ApiError,
    body: Body,
) -> Response {
    let mut response = refuse(state, tenant, endpoint, error);
    response.headers_mut().insert(
        header::CONNECTION,
        axum::http::HeaderValue::from_static("close"),
    );
    let (limit, deadline) = (state.limits.max_body_bytes, state.limits.header_timeout);
    tokio::spawn(tokio::time::timeout(deadline, async move {
        use futures_util::StreamExt;
        let mut chunks = body.into_data_stream();
        let mut seen = 0;
        while let Some(Ok(chunk)) = chunks.next().await {
            seen += chunk.len();
            if seen > limit {
                break;
            }
        }
    }));
    response
}

fn refuse(state: &AppState, tenant: &str, endpoint: Endpoint, error: ApiError) -> Response {
    state.metrics.rejection(error.reason());
    state
        .metrics
        .request(tenant, endpoint.label(), error.status().as_str());
    info!(
        tenant,
        endpoint = endpoint.label(),
        status = error.status().as_u16(),
        code = error.reason(),
        "request refused"
    );
    error.into_response()
}

fn prepare(
    state: &AppState,
    tenant: &Tenant,
    body: &[u8],
    endpoint: Endpoint,
) -> Result<Prepared, ApiError> {
    let (prompt, params): (Vec<u32>, CommonParams) = match endpoint {
        Endpoint::Chat => {
            let request: ChatRequest = parse_body(body)?;
            request.params.check_supported()?;
            let template = state.model.chat_template.as_ref().ok_or_else(|| {
                ApiError::invalid(
                    "messages",
                    "this model has no chat template; use /v1/completions",
                )
            })?;
            // The template's markers become control tokens; what the
            // messages say never does (I9).
            let ids = template
                .encode(&state.model.tokenizer, &request.messages()?, true)
                .map_err(|e| match e {
                    kvfence_model::ModelError::Tokenizer { .. } => {
                        ApiError::new(ErrorType::ServerError, "tokenizer_error", e.to_string())
                    }
                    _ => ApiError::invalid("messages", e.to_string()),
                })?;
            (ids, request.params)
        }
        Endpoint::Completions => {
            let request: CompletionRequest = parse_body(body)?;
            request.params.check_supported()?;
            let ids = match &request.prompt {
                PromptField::Tokens(ids) => ids.clone(),
                PromptField::Text(text) => encode_prompt(state, text.expose())?,
                PromptField::Texts(list) if list.len() == 1 => {
                    encode_prompt(state, list[0].expose())?
                }
                PromptField::Texts(_) => {
                    return Err(ApiError::invalid(
                        "prompt",
                        "only one prompt per request is supported",
                    ));
                }
            };
            (ids, request.params)
        }
    };
    if let Some(model) = &params.model
        && model != &state.model_id
    {
        return Err(ApiError::new(
            ErrorType::NotFoundError,
            "model_not_found",
            format!(
                "model {model:?} is not served here; this server serves {:?}",
                state.model_id
            ),
        ));
    }
    if prompt.is_empty() {
        return Err(ApiError::invalid(
            "prompt",
            "the prompt encodes to no tokens",
        ));
    }
    let vocab = state.model.config.vocab_size;
    if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid(
            "prompt",
            format!("token id {bad} is outside the vocabulary of {vocab}"),
        ));
    }
    let max_context = state.capacity.max_context;
    let max_tokens = match params.max_tokens()? {
        Some(n) => n,
        // No max_tokens (what most chat UIs send): the default, lowered to
        // what this tenant and the context allow, never a refusal.
        None => state
            .default_max_tokens
            .min(tenant.max_tokens.unwrap_or(usize::MAX))
            .min(max_context.saturating_sub(prompt.len()).max(1)),
    };
    if let Some(limit) = tenant.max_tokens
        && max_tokens > limit
    {
        return Err(ApiError::invalid(
            "max_tokens",
            format!("max_tokens {max_tokens} exceeds this tenant's limit of {limit}"),
        ));
    }
    if prompt.len() + max_tokens > max_context {
        let param = if endpoint == Endpoint::Chat {
            "messages"
        } else {
            "prompt"
        };
        return Err(ApiError::context_length(
            param,
            max_context,
            prompt.len(),
            max_tokens,
        ));
    }
    let request = GenerationRequest {
        prompt,
        max_tokens,
        sampling: params.sampling(rand::random())?,
        stop: params.stop_strings()?,
        ignore_eos: params.ignore_eos,
        // The namespace is the tenant the key named (I9); the body may only
        // subdivide it.
        cache: Some(CacheScope {
            tenant: tenant.name.clone(),
            salt: params.cache_salt()?,
        }),
        constraint: None,
    };
    Ok(Prepared {
        request,
        stream: params.stream,
        include_usage: params.include_usage(),
    })
}

fn encode_prompt(state: &AppState, text: &str) -> Result<Vec<u32>, ApiError> {
    let mut ids = state
        .model
        .tokenizer
        .encode(text)
        .map_err(|e| ApiError::new(ErrorType::ServerError, "tokenizer_error", e.to_string()))?;
    if let Some(bos) = state.model.config.bos_token_id
        && ids.first() != Some(&bos)
    {
        ids.insert(0, bos);
    }
    Ok(ids)
}

/// An admitted request on its way back to the client. Dropping it — the
/// client went away — drops the engine handle, which cancels the request.
struct Reply {
    state: Arc<AppState>,
    tenant: Arc<Tenant>,
    endpoint: Endpoint,
    handle: RequestHandle,
    _permit: OwnedSemaphorePermit,
    started: Instant,
    id: String,
    created: u64,
    /// Set when the request's end was counted; a reply dropped before that
    /// is a client that left.
    ended: std::cell::Cell<bool>,
}

impl Drop for Reply {
    fn drop(&mut self) {
        if !self.ended.get() {
            self.state
                .metrics
                .request(&self.tenant.name, self.endpoint.label(), "cancelled");
            info!(
                request = %self.handle.id(),
                tenant = %self.tenant.name,
                elapsed_ms = self.started.elapsed().as_millis() as u64,
                "request cancelled by the client"
            );
        }
    }
}

impl Reply {
    fn first_token(&self, seen: &mut bool) {
        if !*seen {
            *seen = true;
            self.state
                .metrics
                .first_token(self.started.elapsed().as_secs_f64());
        }
    }

    fn log_end(&self, status: u16, usage: Option<Usage>) {
        self.ended.set(true);
        self.state.metrics.request(
            &self.tenant.name,
            self.endpoint.label(),
            &status.to_string(),
        );
        self.state
            .metrics
            .finished(self.started.elapsed().as_secs_f64());
        info!(
            request = %self.handle.id(),
            tenant = %self.tenant.name,
            status,
            completion_tokens = usage.map(|u| u.completion_tokens),
            elapsed_ms = self.started.elapsed().as_millis() as u64,
            "request finished"
        );
    }

    async fn collect(mut self) -> Response {
        let mut text = String::new();
        let mut seen = false;
        loop {
            match self.handle.next().await {
                Some(Event::Token { text: piece, .. }) => {
                    self.first_token(&mut seen);
                    text.push_str(&piece);
                }
                Some(Event::Finished { reason, usage }) => {
                    self.log_end(200, Some(usage));
                    let body = json!({
                        "id": self.id,
                        "object": self.endpoint.object(false),
                        "created": self.created,
                        "model": self.state.model_id,
                        "choices": [self.endpoint.choice(&text, Some(reason))],
                        "usage": usage_json(usage),
                    });
                    return (StatusCode::OK, Json(body)).into_response();
                }
                Some(Event::Failed { kind, message }) => {
                    let error = ApiError::from_failure(kind, message);
                    self.state.metrics.rejection(error.reason());
                    self.log_end(error.status().as_u16(), None);
                    return error.into_response();
                }
                None => {
                    let error = ApiError::from_failure(
                        FailureKind::Internal,
                        "the engine dropped the request".into(),
                    );
                    self.log_end(error.status().as_u16(), None);
                    return error.into_response();
                }
            }
        }
    }

    fn stream(self, include_usage: bool) -> Response {
        let events = stream_events(self, include_usage);
        Sse::new(events)
            .keep_alive(KeepAlive::default())
            .into_response()
    }

    fn chunk(&self, choices: Value, usage: Option<Usage>) -> SseEvent {
        let mut body = json!({
            "id": self.id,
            "object": self.endpoint.object(true),
            "created": self.created,
            "model": self.state.model_id,
            "choices": choices,
        });
        if let Some(usage) = usage {
            body["usage"] = usage_json(usage);
        }
        SseEvent::default().data(body.to_string())
    }
}

enum Phase {
    Start,
    Running,
    Usage(Usage),
    Done,
    End,
}

fn stream_events(
    reply: Reply,
    include_usage: bool,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    stream::unfold(
        (reply, Phase::Start, false),
        move |(mut reply, phase, mut seen)| async move {
            let next = match phase {
                Phase::Start if reply.endpoint == Endpoint::Chat => {
                    let event =
                        reply.chunk(json!([reply.endpoint.delta(Some(""), true, None)]), None);
                    (event, Phase::Running)
                }
                Phase::Start | Phase::Running => loop {
                    match reply.handle.next().await {
                        Some(Event::Token { text, .. }) => {
                            reply.first_token(&mut seen);
                            if !text.is_empty() {
                                break (
                                    reply.chunk(
                                        json!([reply.endpoint.delta(Some(&text), false, None)]),
                                        None,
                                    ),
                                    Phase::Running,
                                );
                            }
                        }
                        Some(Event::Finished { reason, usage }) => {
                            reply.log_end(200, Some(usage));
                            let event = reply.chunk(
                                json!([reply.endpoint.delta(None, false, Some(reason))]),
                                None,
                            );
                            break (
                                event,
                                if include_usage {
                                    Phase::Usage(usage)
                                } else {
                                    Phase::Done
                                },
                            );
                        }
                        Some(Event::Failed { kind, message }) => {
                            let error = ApiError::from_failure(kind, message);
                            reply.state.metrics.rejection(error.reason());
                            reply.log_end(200, None);
                            // An error event, and no normal finish (I5, I7).
                            break (
                                SseEvent::default().data(error.body().to_string()),
                                Phase::End,
                            );
                        }
                        None => {
                            let error = ApiError::from_failure(
                                FailureKind::Internal,
                                "the engine dropped the request".into(),
                            );
                            reply.log_end(200, None);
                            break (
                                SseEvent::default().data(error.body().to_string()),
                                Phase::End,
                            );
                        }
                    }
                },
                Phase::Usage(usage) => (reply.chunk(json!([]), Some(usage)), Phase::Done),
                Phase::Done => (SseEvent::default().data("[DONE]"), Phase::End),
                Phase::End => return None,
            };
            Some((Ok(next.0), (reply, next.1, seen)))
        },
    )
}
