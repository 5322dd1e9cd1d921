//! Stored responses over HTTP: `store`, `previous_response_id` and
//! `conversation` on `POST /v1/responses`, and `GET`/`DELETE
//! /v1/responses/{id}` and `GET /v1/responses/{id}/input_items`. Every
//! lookup is the authenticated tenant's: another tenant's id gets the very
//! answer a made-up one gets — one 404, from the same one-row lookup (I9).

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, RawQuery};
use serde_json::Map;
use tracing::warn;

use super::*;
use crate::error::ServerError;
use crate::stored::{ResponseStore, STORE_DEADLINE, Stored};

/// What a Responses request will keep once it is answered.
pub(super) struct ToStore {
    /// Its own input items.
    input: Vec<Value>,
    /// The stored items it continued.
    earlier: Vec<Value>,
    /// Keep the response itself (`store`).
    response: bool,
    /// The conversation its input and output join.
    conversation: Option<String>,
}

/// The 404 for a `what` (`response`, `conversation`) this tenant does not
/// have — absent, expired, deleted or another tenant's alike. Quotes
/// nothing the client sent.
pub(super) fn not_found(what: &str, param: Option<&str>) -> ApiError {
    ApiError {
        param: param.map(str::to_string),
        ..ApiError::new(
            ErrorType::NotFoundError,
            "not_found",
            format!("no stored {what} with this id"),
        )
    }
}

pub(super) fn store_failed() -> ApiError {
    ApiError::new(
        ErrorType::ServerError,
        "store_failed",
        "the response store failed",
    )
}

/// A Responses request as its chat request, after the stored items it
/// continues — `earlier`, read from the store before its text work
/// ([`continued_items`]) — and what it will keep.
pub(super) fn translate(
    state: &AppState,
    object: &Map<String, Value>,
    earlier: Result<Vec<Value>, ApiError>,
) -> Result<(responses::Translated, Option<ToStore>), ApiError> {
    let asks = responses::Storing::of(object)?;
    let off = |field: &str| {
        ApiError::invalid(
            field,
            format!(
                "this server keeps no responses (started with --responses-store off): send {field} \
                 only to a server that stores them"
            ),
        )
    };
    let store = match (&state.responses, asks.store) {
        (None, Some(true)) => return Err(off("store")),
        (None, _) => None,
        (Some(_), Some(false)) => None,
        (Some(store), _) => Some(store),
    };
    let earlier = match (&state.responses, &asks.previous, &asks.conversation) {
        (_, None, None) => Vec::new(),
        (None, Some(_), _) => return Err(off("previous_response_id")),
        (None, _, Some(_)) => return Err(off("conversation")),
        (Some(_), _, _) => earlier?,
    };
    let mut translated = responses::to_chat(object, &earlier)?;
    translated.echo["store"] = store.is_some().into();
    translated.echo["conversation"] = match &asks.conversation {
        Some(id) => json!({ "id": id }),
        None => Value::Null,
    };
    let keep = (store.is_some() || asks.conversation.is_some()).then(|| ToStore {
        input: translated.input.clone(),
        earlier,
        response: store.is_some(),
        conversation: asks.conversation,
    });
    Ok((translated, keep))
}

/// The stored items a Responses request's body continues — its
/// `previous_response_id`'s conversation or its `conversation`'s items —
/// read before its text work, outside the text-work slot it will hold: a
/// store that does not answer then costs this request its
/// [`STORE_DEADLINE`] and nobody else anything. A body these fields cannot
/// be read from, or that continues nothing, reads nothing here; its text
/// work says what is wrong with it.
pub(super) async fn continued_items(
    state: &Arc<AppState>,
    tenant: &Arc<Tenant>,
    body: &Bytes,
) -> Result<Vec<Value>, ApiError> {
    if state.responses.is_none() {
        return Ok(Vec::new());
    }
    let body = body.clone();
    // The body is read on the blocking thread too: a large one must not
    // hold up the async runtime.
    on_store(
        state,
        Arc::clone(tenant),
        store_failed(),
        move |store, tenant| {
            let Some(asks) = continues(&body) else {
                return Ok(Vec::new());
            };
            match (asks.previous, asks.conversation) {
                (Some(id), _) => Ok(store
                    .get(tenant, &id, unix_now())
                    .map_err(store_error)?
                    .ok_or_else(|| not_found("response", Some("previous_response_id")))?
                    .conversation),
                (None, Some(id)) => Ok(store
                    .conversation(tenant, &id)
                    .map_err(store_error)?
                    .ok_or_else(|| not_found("conversation", Some("conversation")))?
                    .items),
                (None, None) => Ok(Vec::new()),
            }
        },
    )
    .await
}

/// What a Responses body asks of the store, if its `previous_response_id`
/// and `conversation` can be read; the body's whole reading reports what
/// is wrong with one that cannot.
fn continues(body: &[u8]) -> Option<responses::Storing> {
    #[derive(serde::Deserialize)]
    struct Continues {
        previous_response_id: Option<Value>,
        conversation: Option<Value>,
    }
    let continues: Continues = serde_json::from_slice(body).ok()?;
    let named = [
        ("previous_response_id", continues.previous_response_id),
        ("conversation", continues.conversation),
    ];
    let fields: Map<String, Value> = named
        .into_iter()
        .filter_map(|(name, value)| Some((name.to_string(), value?)))
        .collect();
    responses::Storing::of(&fields).ok()
}

impl Reply {
    /// Keeps the finished response `body` if its request asked to, and
    /// adds its input and output to the conversation it named, before the
    /// client sees it (so a continuation sent the moment it arrives finds
    /// it). A response that could not be kept says `store: false`; one
    /// whose conversation could not take it, `conversation: null`.
    pub(super) async fn keep(&mut self, body: &mut Value) {
        let Some(to_store) = self.to_store.take() else {
            return;
        };
        // A task that panicked, or did not end in time, kept nothing of
        // what was asked.
        let lost = (
            to_store
                .response
                .then(|| Err("the store's task failed or overran".to_string())),
            to_store
                .conversation
                .is_some()
                .then(|| Err("the store's task failed or overran".to_string())),
        );
        let (state, tenant, id, response) = (
            Arc::clone(&self.state),
            self.tenant.name.clone(),
            self.id.clone(),
            body.clone(),
        );
        // Past the deadline the write is rolled back, not committed: the
        // answer says it was not kept, and it was not (unless the database
        // was already committing it when the time ran out).
        let kept = within_deadline(move || to_store.keep(&state, &tenant, &id, response)).await;
        let (stored, joined) = kept.unwrap_or(lost);
        let request = self.choices[0].handle.id();
        if let Some(Err(error)) = stored {
            warn!(%request, tenant = %self.tenant.name, %error, "the response was not stored");
            self.state.metrics.unkept();
            body["store"] = false.into();
        }
        if let Some(Err(error)) = joined {
            warn!(%request, tenant = %self.tenant.name, %error, "the response did not join its conversation");
            self.state.metrics.unkept();
            body["conversation"] = Value::Null;
        }
    }

    /// What a Responses stream that ends unfinished keeps: `response.created`
    /// gave its client the id, so the response is kept as far as it was
    /// streamed (the message `incomplete`), with `status`. Its conversation
    /// does not take the unfinished turn: a client that sends it again
    /// would find it twice. `None` when the request keeps no response.
    fn unfinished(&mut self, status: &str) -> Option<(ToStore, Value)> {
        let mut to_store = self.to_store.take()?;
        to_store.conversation = None;
        if !to_store.response {
            return None;
        }
        let mut output = self.output.clone();
        if let Some(message) = output.first_mut().filter(|item| item["type"] == "message") {
            *message = responses::message_item(
                message["id"].as_str().unwrap_or_default(),
                &self.streamed.text,
                "incomplete",
                &self.streamed.logprobs,
            );
        }
        let body = self.response_body(status, output, None);
        Some((to_store, body))
    }

    /// The client of a Responses stream left: keeps the response as far as
    /// it went, `cancelled`, so its id reads back and may be continued.
    /// Runs as the reply is dropped, so the write goes on without it.
    pub(super) fn keep_cancelled(&mut self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let Some((to_store, response)) = self.unfinished("cancelled") else {
            return;
        };
        let (state, tenant, id) = (
            Arc::clone(&self.state),
            self.tenant.name.clone(),
            self.id.clone(),
        );
        let request = self.choices[0].handle.id();
        runtime.spawn_blocking(move || {
            if let (Some(Err(error)), _) = to_store.keep(&state, &tenant, &id, response) {
                warn!(%request, %tenant, %error, "the cancelled response was not stored");
                state.metrics.unkept();
            }
        });
    }

    /// A Responses stream failed after it opened: keeps the response as far
    /// as it went, `failed` with `error` (OpenAI's `code` and `message`;
    /// messages never quote a request), before the client sees the error.
    pub(super) async fn keep_failed(&mut self, error: &ApiError) {
        let Some((to_store, mut body)) = self.unfinished("failed") else {
            return;
        };
        body["error"] = json!({
            "code": error.code.as_deref().unwrap_or("server_error"),
            "message": error.message,
        });
        self.to_store = Some(to_store);
        self.keep(&mut body).await;
    }
}

/// What came of one write of a reply's keeping, if it was asked for: done,
/// or why not (logged; never with stored text).
type Written = Option<Result<(), String>>;

impl ToStore {
    /// Writes what it keeps of `response`, the answer to its request, on a
    /// blocking thread: the response with its conversation so far, and its
    /// input and output added to the conversation it joins. What each
    /// write came to, if asked for.
    fn keep(self, state: &AppState, tenant: &str, id: &str, response: Value) -> (Written, Written) {
        let ToStore {
            input,
            earlier,
            response: keep_response,
            conversation,
        } = self;
        let store = state
            .responses
            .as_ref()
            .expect("a reply keeps something only when the server has a store");
        let output: Vec<Value> = response["output"].as_array().cloned().unwrap_or_default();
        let joined = conversation.map(|conversation| {
            let added = input.iter().chain(&output).cloned();
            match store.edit_conversation(tenant, &conversation, |c| c.items.extend(added)) {
                Ok(Some(_)) => Ok(()),
                Ok(None) => Err("the conversation was deleted first".to_string()),
                Err(error) => Err(error.to_string()),
            }
        });
        let stored = keep_response.then(|| {
            let mut items = earlier;
            items.extend(input.iter().cloned());
            items.extend(output);
            let stored = Stored {
                response,
                input,
                conversation: items,
            };
            store
                .put(tenant, id, &stored, unix_now())
                .map_err(|error| error.to_string())
        });
        (stored, joined)
    }
}

/// The tenant the headers name, admitted as for any request: a
/// concurrency slot and a request of its rate, held while the returned
/// admission lives — reading and writing the store is no free ride beside
/// other tenants (I11). Its connection is no stranger from now on.
pub(super) fn tenant_of(
    state: &AppState,
    headers: &HeaderMap,
    ticket: Option<&Extension<Ticket>>,
) -> Result<(Arc<Tenant>, Admission), ApiError> {
    let tenant = authenticate(state, headers)?;
    if let Some(Extension(ticket)) = ticket {
        ticket.authenticated()?;
    }
    let admission = tenant.admit()?;
    Ok((tenant, admission))
}

/// The store failed: logged (never with stored text), answered as a 500 —
/// or, when it did not answer in time, as a 503 to retry.
pub(super) fn store_error(error: ServerError) -> ApiError {
    warn!(%error, "the response store failed");
    match error {
        ServerError::StoreTimeout => store_unavailable(),
        _ => store_failed(),
    }
}

/// The store did not answer within [`STORE_DEADLINE`].
pub(super) fn store_unavailable() -> ApiError {
    ApiError::new(
        ErrorType::ServiceUnavailable,
        "store_unavailable",
        format!(
            "the response store did not answer within {} s; retry later",
            STORE_DEADLINE.as_secs()
        ),
    )
}

/// Runs `work` on a blocking thread and waits for it until a little after
/// [`STORE_DEADLINE`], by which every store operation has ended or given
/// up — except one stuck inside the database's answer, which is left to
/// end on its own. `None`: it panicked or overran.
async fn within_deadline<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let task = tokio::task::spawn_blocking(work);
    match tokio::time::timeout(STORE_DEADLINE + std::time::Duration::from_secs(1), task).await {
        Ok(Ok(done)) => Some(done),
        Ok(Err(_)) => None,
        Err(_) => {
            warn!("a response store operation overran its deadline; answered without it");
            None
        }
    }
}

/// Runs `work` on the response store, on a blocking thread, for `tenant`,
/// within the store's deadline; `off` answers when the server keeps
/// nothing.
pub(super) async fn on_store<T: Send + 'static>(
    state: &Arc<AppState>,
    tenant: Arc<Tenant>,
    off: ApiError,
    work: impl FnOnce(&ResponseStore, &str) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let state = Arc::clone(state);
    within_deadline(move || match &state.responses {
        Some(store) => work(store, &tenant.name),
        None => Err(off),
    })
    .await
    .unwrap_or_else(|| Err(store_unavailable()))
}

/// [`on_store`] for the tenant the headers name.
pub(super) async fn for_tenant<T: Send + 'static>(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    ticket: Option<&Extension<Ticket>>,
    off: ApiError,
    work: impl FnOnce(&ResponseStore, &str) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let (tenant, _admission) = tenant_of(state, headers, ticket)?;
    on_store(state, tenant, off, work).await
}

/// The answer of what `work` makes of the store for the headers' tenant.
pub(super) async fn from_store(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    ticket: Option<&Extension<Ticket>>,
    off: ApiError,
    work: impl FnOnce(&ResponseStore, &str) -> Result<Value, ApiError> + Send + 'static,
) -> Response {
    let result = for_tenant(state, headers, ticket, off, work).await;
    answer(state, result)
}

pub(super) fn answer(state: &AppState, result: Result<Value, ApiError>) -> Response {
    match result {
        Ok(body) => Json(body).into_response(),
        Err(error) => {
            state.metrics.rejection(error.reason());
            error.into_response()
        }
    }
}

/// `GET /v1/responses/{id}`: the stored response object.
pub async fn retrieve(
    State(state): State<Arc<AppState>>,
    ticket: Option<Extension<Ticket>>,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
) -> Response {
    // Streaming a stored response again, or `include`, are not done here:
    // refused rather than ignored.
    if query.is_some_and(|q| !q.is_empty()) {
        let error = ApiError::invalid(
            "query",
            "GET /v1/responses/{id} takes no query parameters here",
        );
        return answer(&state, Err(error));
    }
    let missing = not_found("response", None);
    from_store(
        &state,
        &headers,
        ticket.as_ref(),
        missing.clone(),
        move |store, tenant| {
            let stored = store.get(tenant, &id, unix_now()).map_err(store_error)?;
            stored.map(|s| s.response).ok_or(missing)
        },
    )
    .await
}

/// `DELETE /v1/responses/{id}`.
pub async fn delete(
    State(state): State<Arc<AppState>>,
    ticket: Option<Extension<Ticket>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let missing = not_found("response", None);
    from_store(
        &state,
        &headers,
        ticket.as_ref(),
        missing.clone(),
        move |store, tenant| {
            if !store.delete(tenant, &id, unix_now()).map_err(store_error)? {
                return Err(missing);
            }
            Ok(render::to_value(render::Deleted {
                id: &id,
                object: "response.deleted",
                deleted: true,
            }))
        },
    )
    .await
}

/// A list's query: OpenAI's paging.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ItemsQuery {
    /// Items per page, 1 to 100 (20).
    limit: Option<usize>,
    /// `asc` or `desc` (the default: newest first).
    order: Option<String>,
    /// The item id the page starts after.
    after: Option<String>,
}

/// `GET /v1/responses/{id}/input_items`: the input items of a stored
/// response's request, a page at a time.
pub async fn input_items(
    State(state): State<Arc<AppState>>,
    ticket: Option<Extension<Ticket>>,
    Path(id): Path<String>,
    query: Result<Query<ItemsQuery>, QueryRejection>,
    headers: HeaderMap,
) -> Response {
    let paging = match Paging::of(query) {
        Ok(paging) => paging,
        Err(error) => return answer(&state, Err(error)),
    };
    let missing = not_found("response", None);
    from_store(
        &state,
        &headers,
        ticket.as_ref(),
        missing.clone(),
        move |store, tenant| {
            let stored = store.get(tenant, &id, unix_now()).map_err(store_error)?;
            Ok(paging.page(stored.ok_or(missing)?.input))
        },
    )
    .await
}

/// A page's size, order and start, checked.
pub(super) struct Paging {
    limit: usize,
    newest_first: bool,
    after: Option<String>,
}

impl Paging {
    pub(super) fn of(query: Result<Query<ItemsQuery>, QueryRejection>) -> Result<Paging, ApiError> {
        let Query(query) = query.map_err(|_| {
            ApiError::invalid(
                "query",
                "a list takes limit (1 to 100), order (asc or desc) and after",
            )
        })?;
        let limit = query.limit.unwrap_or(20);
        if !(1..=100).contains(&limit) {
            return Err(ApiError::invalid(
                "limit",
                "limit must be between 1 and 100",
            ));
        }
        let newest_first = match query.order.as_deref() {
            None | Some("desc") => true,
            Some("asc") => false,
            Some(_) => return Err(ApiError::invalid("order", "order must be asc or desc")),
        };
        Ok(Paging {
            limit,
            newest_first,
            after: query.after,
        })
    }

    pub(super) fn page(&self, items: Vec<Value>) -> Value {
        page(items, self.newest_first, self.after.as_deref(), self.limit)
    }
}

/// One page of `items` in the asked order, after the item `after` (an
/// `after` that names none of them gives an empty page).
fn page(mut items: Vec<Value>, newest_first: bool, after: Option<&str>, limit: usize) -> Value {
    if newest_first {
        items.reverse();
    }
    let start = match after {
        None => 0,
        Some(after) => items
            .iter()
            .position(|item| item["id"] == after)
            .map_or(items.len(), |i| i + 1),
    };
    let rest = &items[start.min(items.len())..];
    let data: Vec<Value> = rest.iter().take(limit).cloned().collect();
    render::to_value(render::ItemPage::of(data, rest.len() > limit))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_items_page_in_either_order_after_an_id() {
        let items: Vec<Value> = (1..=5).map(|i| json!({ "id": format!("m{i}") })).collect();
        let ids = |page: &Value| -> Vec<String> {
            page["data"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i["id"].as_str().unwrap().to_string())
                .collect()
        };
        let newest = page(items.clone(), true, None, 2);
        assert_eq!(ids(&newest), ["m5", "m4"]);
        assert_eq!(newest["has_more"], true);
        assert_eq!(newest["last_id"], "m4");
        let next = page(items.clone(), true, Some("m4"), 2);
        assert_eq!(ids(&next), ["m3", "m2"]);
        let last = page(items.clone(), true, Some("m2"), 2);
        assert_eq!(ids(&last), ["m1"]);
        assert_eq!(last["has_more"], false);
        assert_eq!(
            ids(&page(items.clone(), false, None, 20)),
            ["m1", "m2", "m3", "m4", "m5"]
        );
        let unknown = page(items, false, Some("elsewhere"), 20);
        assert_eq!(ids(&unknown), Vec::<String>::new());
        assert_eq!(unknown["first_id"], Value::Null);
    }
}
