//! Stored responses over HTTP: `store` and `previous_response_id` on
//! `POST /v1/responses`, and `GET`/`DELETE /v1/responses/{id}` and
//! `GET /v1/responses/{id}/input_items`. Every lookup is the authenticated
//! tenant's: another tenant's id gets the very answer a made-up one gets —
//! one 404, from the same one-row lookup (I9).

use axum::extract::{Query, RawQuery};
use serde_json::Map;
use tracing::warn;

use super::*;
use crate::stored::Stored;

/// What a Responses request will keep once it is answered.
pub(super) struct ToStore {
    /// Its own input items.
    input: Vec<Value>,
    /// The stored conversation it continued.
    earlier: Vec<Value>,
}

/// The 404 for a response this tenant does not have — absent, expired,
/// deleted or another tenant's alike. Quotes nothing the client sent.
fn not_found(param: Option<&str>) -> ApiError {
    ApiError {
        param: param.map(str::to_string),
        ..ApiError::new(
            ErrorType::NotFoundError,
            "not_found",
            "no stored response with this id",
        )
    }
}

fn store_failed() -> ApiError {
    ApiError::new(
        ErrorType::ServerError,
        "store_failed",
        "the response store failed",
    )
}

/// A Responses request as its chat request, after the stored conversation
/// it continues; and what it will keep. Runs on a blocking thread (the
/// store is read here).
pub(super) fn translate(
    state: &AppState,
    tenant: &Tenant,
    object: &Map<String, Value>,
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
    let earlier = match (&state.responses, &asks.previous) {
        (_, None) => Vec::new(),
        (None, Some(_)) => return Err(off("previous_response_id")),
        (Some(store), Some(id)) => {
            store
                .get(&tenant.name, id, unix_now())
                .map_err(|error| {
                    warn!(%error, tenant = %tenant.name, "reading a stored response failed");
                    store_failed()
                })?
                .ok_or_else(|| not_found(Some("previous_response_id")))?
                .conversation
        }
    };
    let mut translated = responses::to_chat(object, &earlier)?;
    translated.echo["store"] = store.is_some().into();
    let keep = store.map(|_| ToStore {
        input: translated.input.clone(),
        earlier,
    });
    Ok((translated, keep))
}

impl Reply {
    /// Keeps the finished response `body` if its request asked to, before
    /// the client sees it (so a continuation sent the moment it arrives
    /// finds it). A response that could not be kept says `store: false`.
    pub(super) async fn keep(&mut self, body: &mut Value) {
        let Some(ToStore { input, earlier }) = self.to_store.take() else {
            return;
        };
        let mut conversation = earlier;
        conversation.extend(input.iter().cloned());
        conversation.extend(body["output"].as_array().into_iter().flatten().cloned());
        let stored = Stored {
            response: body.clone(),
            input,
            conversation,
        };
        let (state, tenant, id) = (
            Arc::clone(&self.state),
            self.tenant.name.clone(),
            self.id.clone(),
        );
        let kept = tokio::task::spawn_blocking(move || {
            let store = state
                .responses
                .as_ref()
                .expect("a reply keeps a response only when the server has a store");
            store.put(&tenant, &id, &stored, unix_now())
        })
        .await;
        match kept {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                warn!(request = %self.choices[0].handle.id(), tenant = %self.tenant.name, %error, "the response was not stored");
                body["store"] = false.into();
            }
            Err(_) => {
                warn!(request = %self.choices[0].handle.id(), tenant = %self.tenant.name, "the response was not stored");
                body["store"] = false.into();
            }
        }
    }
}

/// The tenant the headers name; its connection is no stranger from now on
/// (I11), as for a generating request.
fn tenant_of(
    state: &AppState,
    headers: &HeaderMap,
    ticket: Option<&Extension<Ticket>>,
) -> Result<Arc<Tenant>, ApiError> {
    let tenant = authenticate(state, headers)?;
    if let Some(Extension(ticket)) = ticket {
        ticket.authenticated()?;
    }
    Ok(tenant)
}

/// Reads `tenant`'s stored response `id` on a blocking thread.
async fn lookup(state: &Arc<AppState>, tenant: &Tenant, id: String) -> Result<Stored, ApiError> {
    let (state, name) = (Arc::clone(state), tenant.name.clone());
    tokio::task::spawn_blocking(move || match &state.responses {
        Some(store) => store.get(&name, &id, unix_now()),
        None => Ok(None),
    })
    .await
    .map_err(|_| store_failed())?
    .map_err(|error| {
        warn!(%error, tenant = %tenant.name, "reading a stored response failed");
        store_failed()
    })?
    .ok_or_else(|| not_found(None))
}

fn answer(state: &AppState, result: Result<Value, ApiError>) -> Response {
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
    let result = async {
        let tenant = tenant_of(&state, &headers, ticket.as_ref())?;
        // Streaming a stored response again, or `include`, are not done
        // here: refused rather than ignored.
        if query.is_some_and(|q| !q.is_empty()) {
            return Err(ApiError::invalid(
                "query",
                "GET /v1/responses/{id} takes no query parameters here",
            ));
        }
        lookup(&state, &tenant, id)
            .await
            .map(|stored| stored.response)
    }
    .await;
    answer(&state, result)
}

/// `DELETE /v1/responses/{id}`.
pub async fn delete(
    State(state): State<Arc<AppState>>,
    ticket: Option<Extension<Ticket>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let result = async {
        let tenant = tenant_of(&state, &headers, ticket.as_ref())?;
        let (store_state, name, key) = (Arc::clone(&state), tenant.name.clone(), id.clone());
        let removed = tokio::task::spawn_blocking(move || match &store_state.responses {
            Some(store) => store.delete(&name, &key, unix_now()),
            None => Ok(false),
        })
        .await
        .map_err(|_| store_failed())?
        .map_err(|error| {
            warn!(%error, tenant = %tenant.name, "deleting a stored response failed");
            store_failed()
        })?;
        if !removed {
            return Err(not_found(None));
        }
        Ok(json!({ "id": id, "object": "response.deleted", "deleted": true }))
    }
    .await;
    answer(&state, result)
}

/// `input_items`' query: OpenAI's paging.
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
    query: Result<Query<ItemsQuery>, axum::extract::rejection::QueryRejection>,
    headers: HeaderMap,
) -> Response {
    let result = async {
        let tenant = tenant_of(&state, &headers, ticket.as_ref())?;
        let Query(query) = query.map_err(|_| {
            ApiError::invalid(
                "query",
                "input_items takes limit (1 to 100), order (asc or desc) and after",
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
        let stored = lookup(&state, &tenant, id).await?;
        Ok(page(
            stored.input,
            newest_first,
            query.after.as_deref(),
            limit,
        ))
    }
    .await;
    answer(&state, result)
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
    json!({
        "object": "list",
        "first_id": data.first().map(|item| item["id"].clone()),
        "last_id": data.last().map(|item| item["id"].clone()),
        "has_more": rest.len() > limit,
        "data": data,
    })
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
