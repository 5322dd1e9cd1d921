//! HTTP handlers. Every request goes: authenticate (401) → parse and
//! validate (400) → template and tokenize → admission against the real
//! context (400 `context_length_exceeded`, before any page is leased, I6) →
//! tenant slot (429) → engine queue (429) → answer or stream. Validation
//! ends before a stream opens; a failure after that is an SSE error event,
//! never a normal finish (I5, I7).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use futures_util::stream::{self, Stream, StreamExt};
use kvfence_engine::{
    CacheScope, Constrained, Event, FailureKind, FinishReason, GenerationRequest, RequestHandle,
    Share, Usage,
};
use kvfence_model::TokenLogprobs;
use serde_json::{Value, json};
use tracing::{debug, info};

use crate::AppState;
use crate::connections::Ticket;
use crate::error::{ApiError, ErrorType};
use crate::openai::{
    CHAT_FIELDS, COMPLETION_FIELDS, ChatFields, CommonParams, CompletionFields, MAX_CHOICES,
    PromptField, parse_object, typed,
};
use crate::redact::{Redacted, clipped};
use crate::responses::{self, RESPONSES_FIELDS};
use crate::tenants::{Admission, Tenant};
use crate::tools::{Call, StreamSplit, Tools};

/// Which OpenAI endpoint a request came through; decides the body shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Completions,
    /// The Responses API: a chat request underneath, its own shapes out.
    Responses,
}

impl Endpoint {
    fn label(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat_completions",
            Endpoint::Completions => "completions",
            Endpoint::Responses => "responses",
        }
    }

    fn id(self) -> String {
        let prefix = match self {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completions => "cmpl",
            Endpoint::Responses => return responses::item_id("resp"),
        };
        format!("{prefix}-{:024x}", rand::random::<u128>() >> 32)
    }

    fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Responses, _) => "response",
        }
    }

    fn choice(
        self,
        index: usize,
        text: &str,
        logprobs: Option<Value>,
        finish: Option<FinishReason>,
    ) -> Value {
        match self {
            Endpoint::Chat | Endpoint::Responses => json!({
                "index": index,
                "message": { "role": "assistant", "content": text, "refusal": null },
                "logprobs": logprobs,
                "finish_reason": finish.map(finish_name),
            }),
            Endpoint::Completions => json!({
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish.map(finish_name),
            }),
        }
    }

    fn delta(
        self,
        index: usize,
        text: Option<&str>,
        role: bool,
        logprobs: Option<Value>,
        finish: Option<FinishReason>,
    ) -> Value {
        match self {
            Endpoint::Chat | Endpoint::Responses => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), "assistant".into());
                }
                if let Some(text) = text {
                    delta.insert("content".into(), text.into());
                }
                json!({ "index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish.map(finish_name) })
            }
            Endpoint::Completions => {
                json!({ "index": index, "text": text.unwrap_or(""), "logprobs": logprobs, "finish_reason": finish.map(finish_name) })
            }
        }
    }

    /// Log-probabilities of `tokens` in this endpoint's shape; `offset` is
    /// where the first token's text begins in the choice's text.
    fn logprobs(self, state: &AppState, tokens: &[TokenLogprobs], offset: usize) -> Value {
        match self {
            Endpoint::Chat | Endpoint::Responses => {
                let entry = |token: u32, logprob: f32| {
                    let bytes = state.token_bytes(token);
                    json!({
                        "token": String::from_utf8_lossy(bytes),
                        "logprob": logprob,
                        "bytes": bytes,
                    })
                };
                let content: Vec<Value> = tokens
                    .iter()
                    .map(|t| {
                        let mut item = entry(t.token, t.logprob);
                        item["top_logprobs"] =
                            t.top.iter().map(|&(id, lp)| entry(id, lp)).collect();
                        item
                    })
                    .collect();
                json!({ "content": content, "refusal": null })
            }
            Endpoint::Completions => {
                let text = |id: u32| String::from_utf8_lossy(state.token_bytes(id)).into_owned();
                let mut offsets = Vec::with_capacity(tokens.len());
                let mut at = offset;
                for t in tokens {
                    offsets.push(at);
                    at += text(t.token).chars().count();
                }
                json!({
                    "tokens": tokens.iter().map(|t| text(t.token)).collect::<Vec<_>>(),
                    "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
                    "top_logprobs": tokens
                        .iter()
                        .map(|t| t.top.iter().map(|&(id, lp)| (text(id), json!(lp))).collect::<serde_json::Map<_, _>>())
                        .collect::<Vec<_>>(),
                    "text_offset": offsets,
                })
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

/// A prompt's tokens, and its text if `echo` puts it before the completion.
type Prompt = (Vec<u32>, Option<String>);

/// One choice of a request, ready for the engine.
struct ChoiceRequest {
    request: GenerationRequest,
    /// The prompt's text, put before the completion (`echo`).
    echo: Option<String>,
}

/// A validated request, ready for the engine: `n` choices per prompt, in
/// choice order (prompt by prompt).
struct Prepared {
    choices: Vec<ChoiceRequest>,
    /// The functions the model may call (chat).
    tools: Option<Arc<Tools>>,
    /// The request fields a response object repeats (Responses).
    echo: Value,
    n: usize,
    stream: bool,
    include_usage: bool,
    logprobs: bool,
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
        format!("no route for {}", clipped(uri.path())),
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

/// The served model as `/v1/models` lists it: its honest context (I6).
fn model_object(state: &AppState) -> Value {
    json!({
        "id": state.model_id,
        "object": "model",
        "created": state.created,
        "owned_by": "kvfence",
        "max_model_len": state.capacity.max_context,
        "context_length": state.capacity.max_context,
    })
}

/// `GET /v1/models`: the served model and its honest context (I6).
pub async fn models(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(error) = authenticate(&state, &headers) {
        state.metrics.rejection(error.reason());
        return error.into_response();
    }
    Json(json!({ "object": "list", "data": [model_object(&state)] })).into_response()
}

/// `GET /v1/models/{id}`: the served model, or 404 for any other id.
pub async fn model(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Err(error) = authenticate(&state, &headers) {
        state.metrics.rejection(error.reason());
        return error.into_response();
    }
    if id != state.model_id {
        return ApiError::new(
            ErrorType::NotFoundError,
            "model_not_found",
            format!("the model {:?} is not served here", clipped(&id)),
        )
        .into_response();
    }
    Json(model_object(&state)).into_response()
}

/// A known path with the wrong method: 405 in OpenAI's error envelope.
pub async fn method_not_allowed(method: Method, uri: axum::http::Uri) -> Response {
    ApiError::new(
        ErrorType::MethodNotAllowed,
        "method_not_allowed",
        format!("{method} is not allowed on {}", clipped(uri.path())),
    )
    .into_response()
}

/// `POST /v1/chat/completions`.
pub async fn chat(
    State(state): State<Arc<AppState>>,
    ticket: Option<Extension<Ticket>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(state, ticket, headers, body, Endpoint::Chat).await
}

/// `POST /v1/responses`.
pub async fn responses(
    State(state): State<Arc<AppState>>,
    ticket: Option<Extension<Ticket>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(state, ticket, headers, body, Endpoint::Responses).await
}

/// `POST /v1/completions`.
pub async fn completions(
    State(state): State<Arc<AppState>>,
    ticket: Option<Extension<Ticket>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(state, ticket, headers, body, Endpoint::Completions).await
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

/// Template, tokenizer and grammar work for one request, on a blocking
/// thread in one of the tenant's text-work slots: a big prompt or schema
/// never stalls the async runtime (and with it `/health` and every
/// stream), nor another tenant's requests.
async fn prepare_off_runtime(
    state: &Arc<AppState>,
    tenant: &Arc<Tenant>,
    body: Bytes,
    endpoint: Endpoint,
    objective: Option<i32>,
) -> Result<Prepared, ApiError> {
    let internal = || {
        ApiError::new(
            ErrorType::ServerError,
            "internal_error",
            "the request could not be prepared",
        )
    };
    let _slot = state
        .text_work
        .slot(&tenant.name)
        .await
        .ok_or_else(internal)?;
    let (state, tenant) = (Arc::clone(state), Arc::clone(tenant));
    let prepared =
        tokio::task::spawn_blocking(move || prepare(&state, &tenant, &body, endpoint, objective))
            .await
            .map_err(|_| internal())?;
    match endpoint {
        // Errors about the chat request it became name the Responses field.
        Endpoint::Responses => prepared.map_err(responses::rename_param),
        _ => prepared,
    }
}

async fn handle(
    state: Arc<AppState>,
    ticket: Option<Extension<Ticket>>,
    headers: HeaderMap,
    body: Body,
    endpoint: Endpoint,
) -> Response {
    let started = Instant::now();
    // This server's name for the request, on every answer and log line
    // about it. A client's own `x-request-id` is logged beside it, never
    // used as a key: one client cannot name, and so reach, another's
    // request.
    let request_id = format!("req_{:024x}", rand::random::<u128>() >> 32);
    if let Some(theirs) = headers.get("x-request-id") {
        info!(request_id, client_request_id = %client_label(theirs.as_bytes()), "request received");
    }
    // Who is asking, from the headers alone: a stranger is refused before
    // a byte of the body is read.
    let mut response = match authenticate(&state, &headers) {
        Ok(tenant) => {
            let call = Admitting {
                state,
                tenant: &tenant,
                ticket,
                headers,
                endpoint,
                started,
                request_id: &request_id,
            };
            let mut response = call.handle(body).await;
            // Every answer to a tenant with rates says where it stands
            // (OpenAI's `x-ratelimit-*`), refusals included.
            tenant.rate_headers(response.headers_mut());
            response
        }
        Err(error) => refuse_unread(&state, "-", endpoint, error, body),
    };
    if let Ok(value) = axum::http::HeaderValue::from_str(&request_id) {
        response.headers_mut().insert("x-request-id", value);
    }
    response
}

/// A client's label for its request, as a log may show it: up to 64
/// characters of `[A-Za-z0-9._:-]`, anything else as `?`.
fn client_label(bytes: &[u8]) -> String {
    bytes
        .iter()
        .take(64)
        .map(|&b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'.' | b'_' | b':' | b'-' => b as char,
            _ => '?',
        })
        .collect()
}

/// An authenticated tenant's request, on its way through admission.
struct Admitting<'a> {
    state: Arc<AppState>,
    tenant: &'a Arc<Tenant>,
    ticket: Option<Extension<Ticket>>,
    headers: HeaderMap,
    endpoint: Endpoint,
    started: Instant,
    request_id: &'a str,
}

impl Admitting<'_> {
    async fn handle(self, body: Body) -> Response {
        let Admitting {
            state,
            tenant,
            ticket,
            headers,
            endpoint,
            started,
            request_id,
        } = self;
        // The connection is known from now on: no stranger's socket can close
        // it to make room (I11). (Routers built without `serve` carry none.)
        if let Some(Extension(ticket)) = &ticket
            && let Err(error) = ticket.authenticated()
        {
            return refuse_unread(&state, &tenant.name, endpoint, error, body);
        }
        // The gateway's inference objective names a priority (I11); a name
        // the tenants file does not define is refused before the body.
        let objective = match objective_priority(&state, &headers) {
            Ok(objective) => objective,
            Err(error) => return refuse_unread(&state, &tenant.name, endpoint, error, body),
        };
        // The tenant's slot and request before any work: a tenant at its limit
        // costs no body, no template and no tokenizer.
        let mut admission = match tenant.admit() {
            Ok(admission) => admission,
            Err(error) => return refuse_unread(&state, &tenant.name, endpoint, error, body),
        };
        let body = match read_body(&state, &headers, body).await {
            Ok(body) => body,
            Err(error) => return refuse(&state, &tenant.name, endpoint, error),
        };
        let prepared = match prepare_off_runtime(&state, tenant, body, endpoint, objective).await {
            Ok(prepared) => prepared,
            Err(error) => return refuse(&state, &tenant.name, endpoint, error),
        };
        let prompt_tokens: usize = prepared
            .choices
            .iter()
            .step_by(prepared.n)
            .map(|c| c.request.prompt.len())
            .sum();
        let max_tokens = prepared.choices[0].request.max_tokens;
        // The limit counts sequences: `n` choices of every prompt; the rate
        // counts every prompt and the most each choice may generate (I11).
        let most_tokens = prompt_tokens + max_tokens * prepared.choices.len();
        if let Err(error) = tenant
            .admit_sequences(&mut admission, prepared.choices.len())
            .and_then(|()| tenant.charge(&mut admission, most_tokens as u64))
        {
            return refuse(&state, &tenant.name, endpoint, error);
        }
        debug!(
            tenant = %tenant.name,
            endpoint = endpoint.label(),
            prompt_tokens,
            choices = prepared.choices.len(),
            "request prepared"
        );
        let choices = match submit_choices(&state, prepared.choices, prepared.n).await {
            Ok(choices) => choices,
            Err(error) => return refuse(&state, &tenant.name, endpoint, error),
        };
        info!(request_id, request = %choices[0].handle.id(), tenant = %tenant.name, endpoint = endpoint.label(), prompt_tokens, max_tokens, choices = choices.len(), stream = prepared.stream, "request admitted");
        let reply = Reply {
            state,
            tenant: Arc::clone(tenant),
            endpoint,
            choices,
            tools: prepared.tools,
            echo: prepared.echo,
            output: Vec::new(),
            sequence: 0,
            streamed: String::new(),
            n: prepared.n,
            logprobs: prepared.logprobs,
            admission,
            started,
            id: endpoint.id(),
            created: unix_now(),
            ended: std::cell::Cell::new(false),
            first_token_seen: false,
        };
        match (endpoint, prepared.stream) {
            (Endpoint::Responses, true) => reply.response_stream(),
            (Endpoint::Responses, false) => reply.response().await,
            (_, true) => reply.stream(prepared.include_usage),
            (_, false) => reply.collect().await,
        }
    }
}

/// Submits every choice. With `n` > 1 the first choice of each prompt goes
/// first, and the others once it has its first event: by then its prompt
/// is sealed in the tenant's prefix cache, so the other choices read it
/// instead of computing it again. If any submission is refused, the ones
/// made are cancelled (their handles dropped) and the refusal answers.
async fn submit_choices(
    state: &AppState,
    requests: Vec<ChoiceRequest>,
    n: usize,
) -> Result<Vec<Choice>, ApiError> {
    let mut choices: Vec<Option<Choice>> = (0..requests.len()).map(|_| None).collect();
    let mut later = Vec::new();
    for (index, ChoiceRequest { request, echo }) in requests.into_iter().enumerate() {
        if index % n != 0 {
            later.push((index, request, echo));
            continue;
        }
        let mut handle = state.engine.submit(request).await.map_err(ApiError::from)?;
        let first = if n > 1 { handle.next().await } else { None };
        choices[index] = Some(Choice::new(index, handle, echo, first));
    }
    for (index, request, echo) in later {
        let handle = state.engine.submit(request).await.map_err(ApiError::from)?;
        choices[index] = Some(Choice::new(index, handle, echo, None));
    }
    Ok(choices
        .into_iter()
        .map(|c| c.expect("every choice was submitted"))
        .collect())
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

/// The header a Gateway API inference gateway names a request's
/// InferenceObjective in.
const OBJECTIVE_HEADER: &str = "x-gateway-inference-objective";

/// The priority of the objective the request's headers name, if any.
fn objective_priority(state: &AppState, headers: &HeaderMap) -> Result<Option<i32>, ApiError> {
    let Some(value) = headers.get(OBJECTIVE_HEADER) else {
        return Ok(None);
    };
    let name = value.to_str().map_err(|_| {
        ApiError::invalid(
            OBJECTIVE_HEADER,
            "the inference objective is not visible ASCII",
        )
    })?;
    state.tenants.objective(name).map(Some)
}

fn prepare(
    state: &AppState,
    tenant: &Tenant,
    body: &[u8],
    endpoint: Endpoint,
    objective: Option<i32>,
) -> Result<Prepared, ApiError> {
    let mut echo = Value::Null;
    let object = match endpoint {
        Endpoint::Chat => parse_object(body, CHAT_FIELDS)?,
        Endpoint::Completions => parse_object(body, COMPLETION_FIELDS)?,
        Endpoint::Responses => {
            let (chat, repeated) = responses::to_chat(&parse_object(body, RESPONSES_FIELDS)?)?;
            echo = repeated;
            chat
        }
    };
    let params: CommonParams = typed(&object)?;
    let n = params.n()?;
    // Prompts, with the text `echo` puts before each completion.
    let mut tools = None;
    let (prompts, logprobs): (Vec<Prompt>, Option<usize>) = match endpoint {
        Endpoint::Chat | Endpoint::Responses => {
            let chat: ChatFields = typed(&object)?;
            tools = chat.tools()?;
            let template = state.model.chat_template.as_ref().ok_or_else(|| {
                ApiError::invalid(
                    "messages",
                    "this model has no chat template; use /v1/completions",
                )
            })?;
            // The template's markers become control tokens; what the
            // messages say never does (I9).
            let ids = template
                .encode(
                    &state.model.tokenizer,
                    &chat.messages(tools.as_ref())?,
                    true,
                )
                .map_err(|e| match e {
                    kvfence_model::ModelError::Tokenizer { .. } => {
                        ApiError::new(ErrorType::ServerError, "tokenizer_error", e.to_string())
                    }
                    _ => ApiError::invalid("messages", e.to_string()),
                })?;
            (vec![(ids, None)], chat.logprobs()?)
        }
        Endpoint::Completions => {
            let completion: CompletionFields = typed(&object)?;
            completion.check(n)?;
            let echo = completion.echo.unwrap_or(false);
            let texts: Vec<&str>;
            let prompts: Vec<Prompt> = match &completion.prompt {
                PromptField::Text(text) => vec![(encode_prompt(state, text.expose())?, None)],
                PromptField::Texts(list) => {
                    texts = list.iter().map(Redacted::expose).collect();
                    texts
                        .iter()
                        .map(|t| Ok((encode_prompt(state, t)?, None)))
                        .collect::<Result<_, ApiError>>()?
                }
                PromptField::Tokens(ids) => vec![(ids.clone(), None)],
                PromptField::TokenBatches(batch) => {
                    batch.iter().map(|ids| (ids.clone(), None)).collect()
                }
            };
            if prompts.is_empty() {
                return Err(ApiError::invalid(
                    "prompt",
                    "prompt must not be an empty list",
                ));
            }
            let prompts = if echo {
                prompts
                    .into_iter()
                    .map(|(ids, _)| {
                        let text = state.model.tokenizer.decode(&ids).map_err(|e| {
                            ApiError::new(ErrorType::ServerError, "tokenizer_error", e.to_string())
                        })?;
                        Ok((ids, Some(text)))
                    })
                    .collect::<Result<_, ApiError>>()?
            } else {
                prompts
            };
            (prompts, completion.logprobs()?)
        }
    };
    if prompts.len() * n > MAX_CHOICES {
        return Err(ApiError::invalid(
            "n",
            format!(
                "{} prompts with n = {n} ask for {} choices; at most {MAX_CHOICES} are served per request",
                prompts.len(),
                prompts.len() * n
            ),
        ));
    }
    if let Some(model) = &params.model
        && model != &state.model_id
    {
        return Err(ApiError::new(
            ErrorType::NotFoundError,
            "model_not_found",
            format!(
                "model {:?} is not served here; this server serves {:?}",
                clipped(model),
                state.model_id
            ),
        ));
    }
    let constraint = match &tools {
        Some(tools) => tools.grammar(params.grammar()?)?,
        None => params.grammar()?,
    };
    // Compiled here, once per request, on this blocking thread: a bad
    // grammar — or one past the compiler's limits at its first mask — is a
    // 400 before any work, and the workers in this process start every
    // choice from a copy of this start state instead of compiling it again
    // on the scheduler thread all tenants share.
    let constraint = match constraint {
        Some(grammar) => {
            let cannot = |e: kvfence_model::ModelError| {
                ApiError::invalid(
                    "response_format",
                    format!("the grammar cannot be used: {e}"),
                )
            };
            let mut start = state.grammars()?.compile(&grammar).map_err(cannot)?;
            start.mask().map_err(cannot)?;
            Some(Constrained::compiled(grammar, start))
        }
        None => None,
    };
    let stop = params.stop_strings()?;
    // The namespace is the tenant the key named (I9); the body may only
    // subdivide it.
    let cache = Some(CacheScope::tenant(
        tenant.name.clone(),
        params.cache_salt()?,
    ));
    // Its share of the workers is the same tenant's, at the weight the
    // operator gave it (I11).
    let mut asked = params.priorities(tenant.limits().max_priority)?;
    asked.extend(objective.map(|p| (p, OBJECTIVE_HEADER)));
    let share =
        Share::new(tenant.name.clone(), tenant.weight).with_priority(tenant.priority(&asked)?);
    let vocab = state.model.config.vocab_size;
    let max_context = state.capacity.max_context;
    let first_seed = params.seed.map_or_else(rand::random, |s| s as u64);
    let mut choices = Vec::with_capacity(prompts.len() * n);
    for (prompt, echo) in prompts {
        let param = if endpoint == Endpoint::Completions {
            "prompt"
        } else {
            "messages"
        };
        if prompt.is_empty() {
            return Err(ApiError::invalid(param, "the prompt encodes to no tokens"));
        }
        if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::invalid(
                "prompt",
                format!("token id {bad} is outside the vocabulary of {vocab}"),
            ));
        }
        let max_tokens = match params.max_tokens()? {
            Some(n) => n,
            // No max_tokens (what most chat UIs send): the default, lowered
            // to what this tenant and the context allow, never a refusal.
            None => state
                .default_max_tokens
                .min(tenant.limits().max_tokens.unwrap_or(usize::MAX))
                .min(max_context.saturating_sub(prompt.len()).max(1)),
        };
        if let Some(limit) = tenant.limits().max_tokens
            && max_tokens > limit
        {
            let field = params.max_tokens_field();
            return Err(ApiError::invalid(
                field,
                format!("{field} {max_tokens} exceeds this tenant's limit of {limit}"),
            ));
        }
        if prompt.len() + max_tokens > max_context {
            return Err(ApiError::context_length(
                param,
                max_context,
                prompt.len(),
                max_tokens,
            ));
        }
        for j in 0..n {
            // Choice j draws from its own seed: n choices are n samples.
            let seed = first_seed.wrapping_add(j as u64);
            choices.push(ChoiceRequest {
                request: GenerationRequest {
                    prompt: prompt.clone(),
                    max_tokens,
                    sampling: params.sampling(seed, logprobs, vocab)?,
                    stop: stop.clone(),
                    ignore_eos: params.ignore_eos.unwrap_or(false),
                    cache: cache.clone(),
                    constraint: constraint.clone(),
                    share: share.clone(),
                },
                echo: echo.clone(),
            });
        }
    }
    Ok(Prepared {
        choices,
        tools: tools.map(Arc::new),
        echo,
        n,
        stream: params.stream(),
        include_usage: params.include_usage(),
        logprobs: logprobs.is_some(),
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

/// One choice of an admitted request: its engine handle and what it has
/// produced so far.
struct Choice {
    index: usize,
    handle: RequestHandle,
    /// An event read ahead (the first, while the other choices waited).
    first: Option<Event>,
    echo: Option<String>,
    text: String,
    /// Log-probabilities not yet sent (streaming) or all of them.
    logprobs: Vec<TokenLogprobs>,
    /// Characters of text already sent, where the next logprobs' text
    /// begins (completions' `text_offset`).
    sent_chars: usize,
    finish: Option<(FinishReason, Usage)>,
    /// With tools: text streams until a call begins.
    split: StreamSplit,
}

impl Choice {
    fn new(
        index: usize,
        handle: RequestHandle,
        echo: Option<String>,
        first: Option<Event>,
    ) -> Self {
        Choice {
            index,
            handle,
            first,
            echo,
            text: String::new(),
            logprobs: Vec::new(),
            sent_chars: 0,
            finish: None,
            split: StreamSplit::default(),
        }
    }
}

/// An admitted request on its way back to the client. Dropping it — the
/// client went away — drops the engine handles, which cancels them.
struct Reply {
    state: Arc<AppState>,
    tenant: Arc<Tenant>,
    endpoint: Endpoint,
    choices: Vec<Choice>,
    /// The functions the model may call: answers are parsed for calls.
    tools: Option<Arc<Tools>>,
    /// Responses: the request fields the response object repeats, the
    /// output items so far, and the stream's next event number.
    echo: Value,
    output: Vec<Value>,
    sequence: u64,
    /// The message text streamed so far.
    streamed: String,
    /// Choices per prompt.
    n: usize,
    logprobs: bool,
    /// The tenant's sequences and the tokens charged, until the reply
    /// ends (unused tokens go back then).
    admission: Admission,
    started: Instant,
    id: String,
    created: u64,
    /// Set when the request's end was counted; a reply dropped before that
    /// is a client that left.
    ended: std::cell::Cell<bool>,
    first_token_seen: bool,
}

impl Drop for Reply {
    fn drop(&mut self) {
        if !self.ended.get() {
            self.state
                .metrics
                .request(&self.tenant.name, self.endpoint.label(), "cancelled");
            info!(
                request = %self.choices[0].handle.id(),
                tenant = %self.tenant.name,
                elapsed_ms = self.started.elapsed().as_millis() as u64,
                "request cancelled by the client"
            );
        }
    }
}

/// What the next event of a reply's choices says.
enum Step {
    /// Choice `.0` has new text and log-probabilities.
    Token(usize),
    /// Choice `.0` finished.
    Finished(usize),
    /// A choice failed: the whole request fails (I5, I7).
    Failed(ApiError),
    /// Every choice has finished.
    AllDone,
}

impl Reply {
    /// Waits for the next event of any unfinished choice and records it.
    async fn step(&mut self) -> Step {
        let event = match self.choices.iter().position(|c| c.first.is_some()) {
            Some(i) => (i, self.choices[i].first.take()),
            None => {
                let live: Vec<_> = self
                    .choices
                    .iter_mut()
                    .enumerate()
                    .filter(|(_, c)| c.finish.is_none())
                    .map(|(i, c)| Box::pin(async move { (i, c.handle.next().await) }))
                    .collect();
                if live.is_empty() {
                    return Step::AllDone;
                }
                // Receiving is cancel-safe: the other choices' events wait.
                futures_util::future::select_all(live).await.0
            }
        };
        match event {
            (i, Some(Event::Token { text, logprobs })) => {
                if !self.first_token_seen {
                    self.first_token_seen = true;
                    self.state
                        .metrics
                        .first_token(self.started.elapsed().as_secs_f64());
                }
                let choice = &mut self.choices[i];
                choice.text.push_str(&text);
                choice.logprobs.extend(logprobs);
                Step::Token(i)
            }
            (i, Some(Event::Finished { reason, usage })) => {
                self.choices[i].finish = Some((reason, usage));
                Step::Finished(i)
            }
            (_, Some(Event::Failed { kind, message })) => {
                let error = ApiError::from_failure(kind, message);
                self.state.metrics.rejection(error.reason());
                Step::Failed(error)
            }
            (_, None) => Step::Failed(ApiError::from_failure(
                FailureKind::Internal,
                "the engine dropped the request".into(),
            )),
        }
    }

    /// Usage of the whole request: each prompt counted once (its first
    /// choice's), every choice's completion.
    fn usage(&self) -> Usage {
        let mut total = Usage::default();
        for (i, choice) in self.choices.iter().enumerate() {
            let Some((_, usage)) = choice.finish else {
                continue;
            };
            if i % self.n == 0 {
                total.prompt_tokens += usage.prompt_tokens;
                total.cached_tokens += usage.cached_tokens;
            }
            total.completion_tokens += usage.completion_tokens;
        }
        total
    }

    fn log_end(&self, status: u16, usage: Option<Usage>) {
        self.ended.set(true);
        // A failed request's partial usage is unknown here: it keeps its
        // whole charge, as a client that leaves does.
        if let Some(usage) = usage {
            self.admission
                .settle((usage.prompt_tokens + usage.completion_tokens) as u64);
        }
        self.state.metrics.request(
            &self.tenant.name,
            self.endpoint.label(),
            &status.to_string(),
        );
        self.state
            .metrics
            .finished(self.started.elapsed().as_secs_f64());
        info!(
            request = %self.choices[0].handle.id(),
            tenant = %self.tenant.name,
            status,
            completion_tokens = usage.map(|u| u.completion_tokens),
            elapsed_ms = self.started.elapsed().as_millis() as u64,
            "request finished"
        );
    }

    /// The log-probabilities choice `i` has not sent, rendered, if the
    /// request asked for them.
    fn take_logprobs(&mut self, i: usize) -> Option<Value> {
        if !self.logprobs {
            return None;
        }
        let choice = &mut self.choices[i];
        let tokens = std::mem::take(&mut choice.logprobs);
        let offset = choice.sent_chars;
        Some(self.endpoint.logprobs(&self.state, &tokens, offset))
    }

    /// Waits until every choice has finished and counts the request's end:
    /// the whole usage, or the first failure (which fails the request).
    async fn finish_all(&mut self) -> Result<Usage, ApiError> {
        loop {
            match self.step().await {
                Step::Token(_) | Step::Finished(_) => {}
                Step::Failed(error) => {
                    self.log_end(error.status().as_u16(), None);
                    return Err(error);
                }
                Step::AllDone => break,
            }
        }
        let usage = self.usage();
        self.log_end(200, Some(usage));
        Ok(usage)
    }

    async fn collect(mut self) -> Response {
        let usage = match self.finish_all().await {
            Ok(usage) => usage,
            Err(error) => return error.into_response(),
        };
        let choices: Vec<Value> = (0..self.choices.len())
            .map(|i| {
                let prefix = self.choices[i].echo.clone().unwrap_or_default();
                self.choices[i].sent_chars = prefix.chars().count();
                let logprobs = self.take_logprobs(i);
                let choice = &self.choices[i];
                let text = format!("{prefix}{}", choice.text);
                let finish = choice.finish.map(|(reason, _)| reason);
                match &self.tools {
                    Some(tools) => {
                        let (content, calls) = tools.parse(&text);
                        tool_choice_json(choice.index, &content, &calls, logprobs, finish)
                    }
                    None => self.endpoint.choice(choice.index, &text, logprobs, finish),
                }
            })
            .collect();
        let body = json!({
            "id": self.id,
            "object": self.endpoint.object(false),
            "created": self.created,
            "model": self.state.model_id,
            "system_fingerprint": self.state.system_fingerprint,
            "choices": choices,
            "usage": usage_json(usage),
        });
        (StatusCode::OK, Json(body)).into_response()
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
            "system_fingerprint": self.state.system_fingerprint,
            "choices": choices,
        });
        if let Some(usage) = usage {
            body["usage"] = usage_json(usage);
        }
        SseEvent::default().data(body.to_string())
    }

    /// The chunk that streams choice `i`'s new text (and log-probabilities),
    /// if it has any to show yet.
    fn text_chunk(&mut self, i: usize) -> Vec<SseEvent> {
        let choice = &mut self.choices[i];
        let mut text = std::mem::take(&mut choice.text);
        if self.tools.is_some() {
            text = choice.split.push(&text);
        }
        if text.is_empty() {
            // Held back (an incomplete character, a possible stop string or
            // tool call): its log-probabilities go with the text when it comes.
            return Vec::new();
        }
        let logprobs = self.take_logprobs(i);
        let choice = &mut self.choices[i];
        choice.sent_chars += text.chars().count();
        let delta = self
            .endpoint
            .delta(choice.index, Some(&text), false, logprobs, None);
        vec![self.chunk(json!([delta]), None)]
    }

    /// The chunks that end choice `i`: any text and log-probabilities left,
    /// the calls it made (a header with each call's id and name, then its
    /// arguments), and its finish reason.
    fn finish_chunk(&mut self, i: usize) -> Vec<SseEvent> {
        let mut text = std::mem::take(&mut self.choices[i].text);
        let mut calls = Vec::new();
        if let Some(tools) = &self.tools {
            let choice = &mut self.choices[i];
            let mut held = choice.split.push(&text);
            held.push_str(&choice.split.finish());
            (text, calls) = tools.parse(&held);
        }
        let logprobs = self.take_logprobs(i);
        let choice = &self.choices[i];
        let index = choice.index;
        let reason = choice.finish.map(|(reason, _)| reason);
        let mut events = Vec::new();
        if calls.is_empty() {
            let text = (!text.is_empty()).then_some(text);
            let delta = self
                .endpoint
                .delta(index, text.as_deref(), false, logprobs, reason);
            events.push(self.chunk(json!([delta]), None));
            return events;
        }
        if !text.is_empty() {
            let delta = self.endpoint.delta(index, Some(&text), false, None, None);
            events.push(self.chunk(json!([delta]), None));
        }
        let header: Vec<Value> = calls
            .iter()
            .enumerate()
            .map(|(k, call)| {
                json!({"index": k, "id": call.id, "type": "function",
                       "function": {"name": call.name, "arguments": ""}})
            })
            .collect();
        let arguments: Vec<Value> = calls
            .iter()
            .enumerate()
            .map(|(k, call)| json!({"index": k, "function": {"arguments": call.arguments}}))
            .collect();
        for (tool_calls, logprobs) in [(header, None), (arguments, logprobs)] {
            let delta = json!({"index": index, "delta": {"tool_calls": tool_calls},
                               "logprobs": logprobs, "finish_reason": null});
            events.push(self.chunk(json!([delta]), None));
        }
        let end = json!({"index": index, "delta": {}, "logprobs": null,
                         "finish_reason": tool_finish(reason)});
        events.push(self.chunk(json!([end]), None));
        events
    }
}

/// A chat choice whose answer may hold tool calls: `content` is the text
/// before them (null if none), and a call makes the finish `tool_calls`.
fn tool_choice_json(
    index: usize,
    content: &str,
    calls: &[Call],
    logprobs: Option<Value>,
    finish: Option<FinishReason>,
) -> Value {
    if calls.is_empty() {
        return Endpoint::Chat.choice(index, content, logprobs, finish);
    }
    json!({
        "index": index,
        "message": {
            "role": "assistant",
            "content": (!content.is_empty()).then_some(content),
            "refusal": null,
            "tool_calls": calls.iter().map(Call::json).collect::<Vec<_>>(),
        },
        "logprobs": logprobs,
        "finish_reason": tool_finish(finish),
    })
}

/// The finish of an answer that made calls: `tool_calls`, or `length` if
/// `max_tokens` cut it (its last call's arguments cut with it), as OpenAI
/// reports it.
fn tool_finish(finish: Option<FinishReason>) -> &'static str {
    match finish {
        Some(FinishReason::Length) => "length",
        _ => "tool_calls",
    }
}

/// The Responses API's answers.
impl Reply {
    /// Choice 0's answer as output items: its text as a message (unless it
    /// is only calls), then each call.
    fn response_items(&self, text: &str, status: &str) -> Vec<Value> {
        let (content, calls) = match &self.tools {
            Some(tools) => tools.parse(text),
            None => (text.to_string(), Vec::new()),
        };
        let mut items = Vec::new();
        if calls.is_empty() || !content.is_empty() {
            items.push(responses::message_item(
                &responses::item_id("msg"),
                &content,
                status,
            ));
        }
        for call in &calls {
            items.push(responses::call_item(
                &responses::item_id("fc"),
                call,
                &call.arguments,
                "completed",
            ));
        }
        items
    }

    /// `completed`, or `incomplete` when `max_output_tokens` ran out.
    fn response_status(&self) -> &'static str {
        match self.choices[0].finish {
            Some((FinishReason::Length, _)) => "incomplete",
            _ => "completed",
        }
    }

    fn response_body(&self, status: &str, output: Vec<Value>, usage: Option<Usage>) -> Value {
        responses::response_object(
            &self.id,
            self.created,
            &self.state.model_id,
            status,
            output,
            usage,
            &self.echo,
        )
    }

    /// `POST /v1/responses` without streaming.
    async fn response(mut self) -> Response {
        let usage = match self.finish_all().await {
            Ok(usage) => usage,
            Err(error) => return error.into_response(),
        };
        let status = self.response_status();
        let text = std::mem::take(&mut self.choices[0].text);
        let output = self.response_items(&text, status);
        (
            StatusCode::OK,
            Json(self.response_body(status, output, Some(usage))),
        )
            .into_response()
    }

    /// One Responses streaming event.
    fn event(&mut self, kind: &str, mut body: Value) -> SseEvent {
        body["type"] = kind.into();
        body["sequence_number"] = self.sequence.into();
        self.sequence += 1;
        SseEvent::default().event(kind).data(body.to_string())
    }

    /// The events that open the message item, the first time text comes.
    fn open_message(&mut self, events: &mut Vec<SseEvent>) -> String {
        if let Some(id) = self.output.last().and_then(|item| item["id"].as_str()) {
            return id.to_string();
        }
        let id = responses::item_id("msg");
        let mut item = responses::message_item(&id, "", "in_progress");
        item["content"] = json!([]);
        self.output.push(item.clone());
        let added = self.event(
            "response.output_item.added",
            json!({"output_index": 0, "item": item}),
        );
        let part = self.event(
            "response.content_part.added",
            json!({"item_id": id, "output_index": 0, "content_index": 0,
                   "part": {"type": "output_text", "text": "", "annotations": []}}),
        );
        events.extend([added, part]);
        id
    }

    /// Streams choice 0's new text as `response.output_text.delta`.
    fn response_text(&mut self) -> Vec<SseEvent> {
        let choice = &mut self.choices[0];
        let mut text = std::mem::take(&mut choice.text);
        if self.tools.is_some() {
            text = choice.split.push(&text);
        }
        if text.is_empty() {
            return Vec::new();
        }
        let mut events = Vec::new();
        let id = self.open_message(&mut events);
        self.streamed.push_str(&text);
        let delta = self.event(
            "response.output_text.delta",
            json!({"item_id": id, "output_index": 0, "content_index": 0, "delta": text}),
        );
        events.push(delta);
        events
    }

    /// The events that close the answer: the message's text, part and item
    /// done, then each call as an item with its arguments.
    fn response_finish(&mut self) -> Vec<SseEvent> {
        let mut rest = std::mem::take(&mut self.choices[0].text);
        let mut calls = Vec::new();
        if let Some(tools) = &self.tools {
            let choice = &mut self.choices[0];
            let mut held = choice.split.push(&rest);
            held.push_str(&choice.split.finish());
            (rest, calls) = tools.parse(&held);
        }
        let status = self.response_status();
        let mut events = Vec::new();
        if !self.output.is_empty() || calls.is_empty() || !rest.is_empty() {
            let id = self.open_message(&mut events);
            if !rest.is_empty() {
                let delta = self.event(
                    "response.output_text.delta",
                    json!({"item_id": id, "output_index": 0, "content_index": 0, "delta": rest}),
                );
                events.push(delta);
            }
            self.streamed.push_str(&rest);
            let text = std::mem::take(&mut self.streamed);
            let item = responses::message_item(&id, &text, status);
            self.output[0] = item.clone();
            let part = item["content"][0].clone();
            let done = [
                (
                    "response.output_text.done",
                    json!({"item_id": id, "output_index": 0, "content_index": 0, "text": text}),
                ),
                (
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": 0, "content_index": 0, "part": part}),
                ),
                (
                    "response.output_item.done",
                    json!({"output_index": 0, "item": item}),
                ),
            ];
            for (kind, body) in done {
                events.push(self.event(kind, body));
            }
        }
        for call in &calls {
            let index = self.output.len();
            let id = responses::item_id("fc");
            let open = responses::call_item(&id, call, "", "in_progress");
            let item = responses::call_item(&id, call, &call.arguments, "completed");
            self.output.push(item.clone());
            let steps = [
                (
                    "response.output_item.added",
                    json!({"output_index": index, "item": open}),
                ),
                (
                    "response.function_call_arguments.delta",
                    json!({"item_id": id, "output_index": index, "delta": call.arguments}),
                ),
                (
                    "response.function_call_arguments.done",
                    json!({"item_id": id, "output_index": index, "arguments": call.arguments}),
                ),
                (
                    "response.output_item.done",
                    json!({"output_index": index, "item": item}),
                ),
            ];
            for (kind, body) in steps {
                events.push(self.event(kind, body));
            }
        }
        events
    }

    fn response_stream(self) -> Response {
        let events = stream::unfold((self, 0u8), |(mut reply, phase)| async move {
            let events = match phase {
                0 => {
                    let created = reply.response_body("in_progress", Vec::new(), None);
                    let events = vec![
                        reply.event("response.created", json!({"response": created.clone()})),
                        reply.event("response.in_progress", json!({"response": created})),
                    ];
                    return Some((events, (reply, 1)));
                }
                1 => match reply.step().await {
                    Step::Token(_) => reply.response_text(),
                    Step::Finished(_) => reply.response_finish(),
                    Step::AllDone => {
                        let usage = reply.usage();
                        reply.log_end(200, Some(usage));
                        let status = reply.response_status();
                        let output = reply.output.clone();
                        let body = reply.response_body(status, output, Some(usage));
                        let kind = if status == "completed" {
                            "response.completed"
                        } else {
                            "response.incomplete"
                        };
                        let event = reply.event(kind, json!({"response": body}));
                        return Some((vec![event], (reply, 2)));
                    }
                    Step::Failed(error) => {
                        reply.log_end(200, None);
                        // An error event and no completion (I5, I7).
                        let body = json!({"code": error.code, "message": error.message, "param": error.param});
                        let event = reply.event("error", body);
                        return Some((vec![event], (reply, 2)));
                    }
                },
                _ => return None,
            };
            Some((events, (reply, 1)))
        })
        .flat_map(|events| stream::iter(events.into_iter().map(Ok::<_, Infallible>)));
        Sse::new(events)
            .keep_alive(KeepAlive::default())
            .into_response()
    }
}

enum Phase {
    /// The role chunk (chat) or the echoed prompt (completions) of choice `.0`.
    Start(usize),
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
        (reply, Phase::Start(0)),
        move |(mut reply, phase)| async move {
            let next = match phase {
                Phase::Start(i) if i < reply.choices.len() => {
                    let index = reply.choices[i].index;
                    let delta = match (reply.endpoint, reply.choices[i].echo.take()) {
                        // Responses streams its own events (`response_stream`).
                        (Endpoint::Chat | Endpoint::Responses, _) => {
                            Some(reply.endpoint.delta(index, Some(""), true, None, None))
                        }
                        (Endpoint::Completions, Some(echo)) => {
                            reply.choices[i].sent_chars = echo.chars().count();
                            Some(reply.endpoint.delta(index, Some(&echo), false, None, None))
                        }
                        (Endpoint::Completions, None) => None,
                    };
                    match delta {
                        Some(delta) => {
                            (vec![reply.chunk(json!([delta]), None)], Phase::Start(i + 1))
                        }
                        None => (Vec::new(), Phase::Start(i + 1)),
                    }
                }
                Phase::Start(_) | Phase::Running => match reply.step().await {
                    Step::Token(i) => (reply.text_chunk(i), Phase::Running),
                    Step::Finished(i) => (reply.finish_chunk(i), Phase::Running),
                    Step::AllDone => {
                        let usage = reply.usage();
                        reply.log_end(200, Some(usage));
                        let next = if include_usage {
                            Phase::Usage(usage)
                        } else {
                            Phase::Done
                        };
                        (Vec::new(), next)
                    }
                    Step::Failed(error) => {
                        reply.log_end(200, None);
                        // An error event, and no normal finish (I5, I7).
                        (
                            vec![SseEvent::default().data(error.body().to_string())],
                            Phase::End,
                        )
                    }
                },
                Phase::Usage(usage) => (vec![reply.chunk(json!([]), Some(usage))], Phase::Done),
                Phase::Done => (vec![SseEvent::default().data("[DONE]")], Phase::End),
                Phase::End => return None,
            };
            Some((next.0, (reply, next.1)))
        },
    )
    .flat_map(|events| stream::iter(events.into_iter().map(Ok)))
}
