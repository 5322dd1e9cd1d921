//! HTTP handlers. Every request goes: authenticate (401) → parse and
//! validate (400) → template and tokenize → admission against the real
//! context (400 `context_length_exceeded`, before any page is leased, I6) →
//! tenant slot (429) → engine queue (429) → answer or stream. Validation
//! ends before a stream opens; a failure after that is an SSE error event,
//! never a normal finish (I5, I7).
//!
//! This module holds the handlers and admission; `prepare` turns a body
//! into engine requests (a pure function of the request and the server's
//! model and limits), `reply` renders chat and completions answers and
//! their streams, `respond` the Responses API's.

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
use kvfence_engine::trace::TraceContext;
use kvfence_engine::{
    CacheScope, Constrained, Event, FailureKind, FinishReason, GenerationRequest, RequestHandle,
    Share, Usage,
};
use kvfence_model::{PromptLogprob, TokenLogprobs};
use serde_json::{Value, json};
use tracing::{debug, info};

use crate::connections::Ticket;
use crate::error::{ApiError, ErrorType};
use crate::openai::{
    CHAT_FIELDS, COMPLETION_FIELDS, ChatFields, CommonParams, CompletionFields, MAX_CHOICES,
    PromptField, parse_object, typed,
};
use crate::redact::{Redacted, clipped};
use crate::responses::{self, RESPONSES_FIELDS};
use crate::telemetry::RequestSpan;
use crate::tenants::{Admission, Tenant};
use crate::tools::{Call, StreamSplit, Tools};
use crate::{AppState, Observed};

pub(crate) mod conversations;
mod prepare;
mod render;
mod reply;
mod respond;
pub(crate) mod stored;

use prepare::{objective_priority, prepare};
use reply::{Choice, Reply};

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

    /// The route, as spans name it.
    fn route(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
            Endpoint::Responses => "/v1/responses",
        }
    }

    fn id(self) -> String {
        let prefix = match self {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completions => "cmpl",
            Endpoint::Responses => return crate::stored::new_id("resp"),
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

    /// A whole answer's choice in this endpoint's shape.
    fn choice<'a>(
        self,
        index: usize,
        text: &'a str,
        logprobs: Option<render::Logprobs>,
        finish: Option<FinishReason>,
    ) -> render::Choice<'a> {
        let finish_reason = finish.map(render::finish_name);
        match self {
            Endpoint::Chat | Endpoint::Responses => render::Choice::Message {
                index,
                message: render::Message::text(text),
                logprobs,
                finish_reason,
            },
            Endpoint::Completions => render::Choice::Text {
                index,
                text,
                logprobs,
                finish_reason,
                prompt_logprobs: None,
            },
        }
    }

    /// A streamed chunk's choice in this endpoint's shape: `text` to add
    /// (with the role, on a chat's first chunk).
    fn delta<'a>(
        self,
        index: usize,
        text: Option<&'a str>,
        role: bool,
        logprobs: Option<render::Logprobs>,
        finish: Option<FinishReason>,
    ) -> render::Delta<'a> {
        let finish_reason = finish.map(render::finish_name);
        match self {
            Endpoint::Chat | Endpoint::Responses => render::Delta::Message {
                index,
                delta: render::MessageDelta {
                    role: role.then_some("assistant"),
                    content: text,
                    tool_calls: None,
                },
                logprobs,
                finish_reason,
            },
            Endpoint::Completions => render::Delta::Text {
                index,
                text: text.unwrap_or(""),
                logprobs,
                finish_reason,
            },
        }
    }

    /// Log-probabilities of `tokens` in this endpoint's shape; `offset` is
    /// where the first token's text begins in the choice's text.
    fn logprobs(
        self,
        state: &AppState,
        tokens: &[TokenLogprobs],
        offset: usize,
    ) -> render::Logprobs {
        match self {
            Endpoint::Chat | Endpoint::Responses => render::Logprobs::Chat {
                content: token_logprobs(state, tokens),
                refusal: None,
            },
            Endpoint::Completions => {
                let text = |id: u32| String::from_utf8_lossy(state.token_bytes(id)).into_owned();
                render::Logprobs::Legacy {
                    tokens: tokens.iter().map(|t| text(t.token)).collect(),
                    token_logprobs: tokens.iter().map(|t| Some(f64::from(t.logprob))).collect(),
                    top_logprobs: tokens
                        .iter()
                        .map(|t| Some(top_by_text(state, &t.top, (t.token, t.logprob))))
                        .collect(),
                    text_offset: text_offsets(
                        offset,
                        tokens.iter().map(|t| state.text_bytes(t.token)),
                    ),
                }
            }
        }
    }
}

/// The legacy format's alternatives of one position: log-probability by
/// token text, the most likely and then the position's own token, which
/// OpenAI's format always shows (so up to `logprobs` + 1 entries). Two
/// tokens of one text keep the later's, so the own token's text always
/// maps to its own log-probability.
fn top_by_text(
    state: &AppState,
    top: &[(u32, f32)],
    own: (u32, f32),
) -> serde_json::Map<String, Value> {
    top.iter()
        .chain(std::iter::once(&own))
        .map(|&(id, lp)| {
            let text = String::from_utf8_lossy(state.token_bytes(id)).into_owned();
            (text, json!(lp))
        })
        .collect()
}

/// A prompt's scores in OpenAI's legacy completions format (`echo` with
/// `logprobs`): every prompt token, the first with `null` (nothing comes
/// before it), offsets counted from the start of the echoed text.
fn legacy_prompt_logprobs(
    state: &AppState,
    first: u32,
    scores: &[PromptLogprob],
) -> render::Logprobs {
    let text = |id: u32| String::from_utf8_lossy(state.token_bytes(id)).into_owned();
    let ids = std::iter::once(first).chain(scores.iter().map(|s| s.logprobs.token));
    render::Logprobs::Legacy {
        tokens: ids.clone().map(text).collect(),
        token_logprobs: std::iter::once(None)
            .chain(scores.iter().map(|s| Some(f64::from(s.logprobs.logprob))))
            .collect(),
        top_logprobs: std::iter::once(None)
            .chain(scores.iter().map(|s| {
                let own = (s.logprobs.token, s.logprobs.logprob);
                Some(top_by_text(state, &s.logprobs.top, own))
            }))
            .collect(),
        text_offset: text_offsets(0, ids.map(|id| state.text_bytes(id))),
    }
}

/// Where each token's text begins in the text the tokens decode to, in
/// characters after `start` (completions' `text_offset`): a special token
/// puts nothing in the text, and a token that begins inside a character
/// (one byte of a multi-byte one) begins where that character does. Bytes
/// that are no character count as one each run, as lossy decoding shows
/// them (U+FFFD).
fn text_offsets<'t>(start: usize, tokens: impl Iterator<Item = &'t [u8]>) -> Vec<usize> {
    let mut bytes: Vec<u8> = Vec::new();
    // `bytes[..counted]` is whole characters, `chars` of them.
    let (mut counted, mut chars) = (0, start);
    tokens
        .map(|token| {
            loop {
                let (valid, invalid) = match std::str::from_utf8(&bytes[counted..]) {
                    Ok(text) => (text.len(), None),
                    Err(error) => (error.valid_up_to(), error.error_len()),
                };
                let whole = std::str::from_utf8(&bytes[counted..counted + valid])
                    .expect("bytes up to valid_up_to are UTF-8");
                chars += whole.chars().count();
                counted += valid;
                match invalid {
                    Some(len) => {
                        chars += 1;
                        counted += len;
                    }
                    // Complete, or a character still incomplete.
                    None => break,
                }
            }
            let offset = chars;
            bytes.extend_from_slice(token);
            offset
        })
        .collect()
}

/// A prompt's scores as vLLM's `prompt_logprobs`: `null` for the first
/// token, then per token an object keyed by token id — the prompt's own
/// token with its rank, and the most likely alternatives ranked in order.
fn listed_prompt_logprobs(state: &AppState, scores: &[PromptLogprob]) -> Value {
    let entry = |id: u32, logprob: f32, rank: u32| {
        json!({
            "logprob": logprob,
            "rank": rank,
            "decoded_token": String::from_utf8_lossy(state.token_bytes(id)),
        })
    };
    let listed = scores.iter().map(|s| {
        let mut position = serde_json::Map::new();
        for (rank, &(id, logprob)) in (1..).zip(&s.logprobs.top) {
            position.insert(id.to_string(), entry(id, logprob, rank));
        }
        // The prompt's own token last: its true rank wins a tie with a
        // listed alternative's place.
        position.insert(
            s.logprobs.token.to_string(),
            entry(s.logprobs.token, s.logprobs.logprob, s.rank),
        );
        Value::Object(position)
    });
    Value::Array(std::iter::once(Value::Null).chain(listed).collect())
}

/// Tokens' log-probabilities as chat lists them (and the Responses API
/// in a message's text): each token's text, bytes and log-probability,
/// with its alternatives.
fn token_logprobs(state: &AppState, tokens: &[TokenLogprobs]) -> Vec<render::TokenLogprob> {
    let entry = |token: u32, logprob: f32| {
        let bytes = state.token_bytes(token);
        render::Alternative {
            token: String::from_utf8_lossy(bytes).into_owned(),
            logprob: f64::from(logprob),
            bytes: bytes.to_vec(),
        }
    };
    tokens
        .iter()
        .map(|t| render::TokenLogprob {
            token: entry(t.token, t.logprob),
            top_logprobs: t.top.iter().map(|&(id, lp)| entry(id, lp)).collect(),
        })
        .collect()
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
    /// What the answer keeps in the response store (Responses, `store`).
    to_store: Option<stored::ToStore>,
    n: usize,
    stream: bool,
    include_usage: bool,
    logprobs: bool,
    prompt_logprobs: PromptLogprobsWanted,
}

/// Where the prompt's scores go in the answer, if it asked for them.
#[derive(Debug, Clone, Copy, Default)]
struct PromptLogprobsWanted {
    /// Leading the choice's `logprobs` (completions' `echo` with
    /// `logprobs`, OpenAI's legacy format).
    echoed: bool,
    /// As `prompt_logprobs` (vLLM's field): per choice for completions,
    /// once for chat.
    listed: bool,
}

/// `GET /health`.
pub async fn health() -> impl IntoResponse {
    Json(render::Probe { status: "ok" })
}

/// `GET /ready`: 200 while this process can take work — it admits, and
/// the workers it depends on are linked — else 503, so an orchestrator or
/// a load balancer sends traffic elsewhere. `/health` answers whether the
/// process is alive at all.
pub(crate) async fn ready<S: Observed>(State(state): State<Arc<S>>) -> Response {
    if state.status().is_ready() {
        Json(render::Probe { status: "ready" }).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(render::Probe {
                status: "not ready",
            }),
        )
            .into_response()
    }
}

/// `GET /metrics`: Prometheus text. Holds counts, states and tenant names;
/// never request text (I10).
pub(crate) async fn metrics<S: Observed>(State(state): State<Arc<S>>) -> impl IntoResponse {
    // A remote engine answers over the network: keep it off the async workers.
    let snapshot = {
        let state = Arc::clone(&state);
        tokio::task::spawn_blocking(move || state.status().snapshot()).await
    };
    let body = match snapshot {
        Ok(workers) => state.metrics().render(&workers),
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
fn model_object(state: &AppState) -> render::Model<'_> {
    render::Model {
        id: &state.model_id,
        object: "model",
        created: state.created,
        owned_by: "kvfence",
        max_model_len: state.capacity.max_context,
        context_length: state.capacity.max_context,
    }
}

/// `GET /v1/models`: the served model and its honest context (I6).
pub async fn models(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(error) = authenticate(&state, &headers) {
        state.metrics.rejection(error.reason());
        return error.into_response();
    }
    Json(render::List::of(vec![model_object(&state)])).into_response()
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
    id: Extension<RequestId>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(state, ticket, id, headers, body, Endpoint::Chat).await
}

/// `POST /v1/responses`.
pub async fn responses(
    State(state): State<Arc<AppState>>,
    ticket: Option<Extension<Ticket>>,
    id: Extension<RequestId>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(state, ticket, id, headers, body, Endpoint::Responses).await
}

/// `POST /v1/completions`.
pub async fn completions(
    State(state): State<Arc<AppState>>,
    ticket: Option<Extension<Ticket>>,
    id: Extension<RequestId>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(state, ticket, id, headers, body, Endpoint::Completions).await
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
    // A compressed body would read as malformed JSON; say what it is. The
    // header's value is not quoted back.
    let encoded = headers
        .get_all(header::CONTENT_ENCODING)
        .iter()
        .any(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"));
    if encoded {
        return Err(ApiError::new(
            ErrorType::UnsupportedEncoding,
            "unsupported_content_encoding",
            "a request body with a Content-Encoding is not read here: send it uncompressed",
        ));
    }
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
    let continued = match endpoint {
        Endpoint::Responses => stored::continued_items(state, tenant, &body).await,
        Endpoint::Chat | Endpoint::Completions => Ok(Vec::new()),
    };
    let _slot = state
        .text_work
        .slot(&tenant.name)
        .await
        .ok_or_else(internal)?;
    let (state, tenant) = (Arc::clone(state), Arc::clone(tenant));
    let prepared = tokio::task::spawn_blocking(move || {
        prepare(&state, &tenant, &body, endpoint, objective, continued)
    })
    .await
    .map_err(|_| internal())?;
    match endpoint {
        // Errors about the chat request it became name the Responses field.
        Endpoint::Responses => prepared.map_err(responses::rename_param),
        _ => prepared,
    }
}

/// This server's name for one request: `req_` and 96 random bits, made by
/// [`request_ids`] for every request whatever its route.
#[derive(Debug, Clone)]
pub(crate) struct RequestId(String);

/// Middleware on every API route: names the request ([`RequestId`], in the
/// request's extensions for the handler and its log lines) and puts the
/// name on the answer as `x-request-id` — refusals, 404s and stored
/// responses included. A client's own `x-request-id` is logged beside it,
/// never used as a key: one client cannot name, and so reach, another's
/// request.
pub(crate) async fn request_ids(
    mut request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let id = format!("req_{:024x}", rand::random::<u128>() >> 32);
    if let Some(theirs) = request.headers().get("x-request-id") {
        info!(request_id = id, client_request_id = %client_label(theirs.as_bytes()), "request received");
    }
    let value = axum::http::HeaderValue::from_str(&id)
        .expect("a request id is `req_` and hexadecimal digits, a valid header value");
    request.extensions_mut().insert(RequestId(id));
    let mut response = next.run(request).await;
    response.headers_mut().insert("x-request-id", value);
    response
}

async fn handle(
    state: Arc<AppState>,
    ticket: Option<Extension<Ticket>>,
    Extension(RequestId(request_id)): Extension<RequestId>,
    headers: HeaderMap,
    body: Body,
    endpoint: Endpoint,
) -> Response {
    let started = Instant::now();
    // A trace of its own, whatever `traceparent` the client sent.
    let mut span = RequestSpan::start(endpoint.route(), &request_id);
    // Who is asking, from the headers alone: a stranger is refused before
    // a byte of the body is read.
    let response = match authenticate(&state, &headers) {
        Ok(tenant) => {
            if state.trace_tenant_names {
                span.tenant(&tenant.name);
            }
            let call = Admitting {
                state,
                tenant: &tenant,
                ticket,
                headers,
                endpoint,
                started,
                request_id: &request_id,
                trace: span.context(),
            };
            let mut response = call.handle(body).await;
            // Every answer to a tenant with rates says where it stands
            // (OpenAI's `x-ratelimit-*`), refusals included.
            tenant.rate_headers(response.headers_mut());
            response
        }
        Err(error) => refuse_unread(&state, "-", endpoint, error, body),
    };
    span.answered(response.status());
    // The span ends when the answer's last byte has gone (a stream's too).
    response.map(|body| Body::new(span.around(body)))
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
    /// The request's span, if it is traced: the workers' spans hang under it.
    trace: Option<TraceContext>,
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
            trace,
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
        let mut prepared =
            match prepare_off_runtime(&state, tenant, body, endpoint, objective).await {
                Ok(prepared) => prepared,
                Err(error) => return refuse(&state, &tenant.name, endpoint, error),
            };
        for choice in &mut prepared.choices {
            choice.request.trace = trace;
        }
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
            to_store: prepared.to_store,
            output: Vec::new(),
            sequence: 0,
            streamed: reply::StreamedMessage::default(),
            n: prepared.n,
            logprobs: prepared.logprobs,
            prompt_logprobs: prepared.prompt_logprobs,
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
        let first_token = *request
            .prompt
            .first()
            .expect("prepare refuses an empty prompt");
        let mut handle = state.engine.submit(request).await.map_err(ApiError::from)?;
        let first = if n > 1 { handle.next().await } else { None };
        choices[index] = Some(Choice::new(index, handle, echo, first_token, first));
    }
    for (index, request, echo) in later {
        let first_token = *request
            .prompt
            .first()
            .expect("prepare refuses an empty prompt");
        let handle = state.engine.submit(request).await.map_err(ApiError::from)?;
        choices[index] = Some(Choice::new(index, handle, echo, first_token, None));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_offsets_are_where_each_token_begins_in_the_decoded_text() {
        // A special token (nothing in the text), "Hi", the two bytes of
        // "é", " x", a stray byte that is no character, "!".
        let tokens: [&[u8]; 6] = [b"", b"Hi", &[0xC3], &[0xA9], b" x", &[0xFF]];
        let with_end: Vec<&[u8]> = tokens.iter().copied().chain([&b"!"[..]]).collect();
        let offsets = text_offsets(3, with_end.into_iter());
        // "Hi" at 0, "é" at 2 (both of its bytes), " x" at 3, the stray
        // byte at 5 (one U+FFFD), "!" at 6; all after the 3 already sent.
        assert_eq!(offsets, [3, 3, 5, 5, 6, 8, 9]);
        let text = String::from_utf8_lossy(&tokens.concat()).into_owned() + "!";
        assert_eq!(text.chars().count(), 7);
    }

    #[test]
    fn a_prompts_legacy_logprobs_lead_its_completions() {
        let top =
            |text: &str, lp: f64| Some(serde_json::Map::from_iter([(text.into(), json!(lp))]));
        let prompt = render::Logprobs::Legacy {
            tokens: vec!["a".into(), "b".into()],
            token_logprobs: vec![None, Some(-1.0)],
            top_logprobs: vec![None, top("b", -1.0)],
            text_offset: vec![0, 1],
        };
        let completion = render::Logprobs::Legacy {
            tokens: vec!["c".into()],
            token_logprobs: vec![Some(-0.5)],
            top_logprobs: vec![top("c", -0.5)],
            text_offset: vec![2],
        };
        assert_eq!(
            serde_json::to_value(prompt.then(completion)).unwrap(),
            json!({"tokens": ["a", "b", "c"], "token_logprobs": [null, -1.0, -0.5],
                   "top_logprobs": [null, {"b": -1.0}, {"c": -0.5}], "text_offset": [0, 1, 2]})
        );
    }
}
