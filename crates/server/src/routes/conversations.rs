//! The Conversations API: `POST /v1/conversations`, `GET`/`POST`/`DELETE
//! /v1/conversations/{id}`, and its items (`GET`/`POST …/items`, `GET`/
//! `DELETE …/items/{item_id}`). A conversation is a tenant's list of input
//! items; a response that names it (`conversation`) reads them before its
//! input and adds its input and output to them. Every lookup is the
//! calling tenant's: another tenant's id is answered as a made-up one (I9).

use axum::extract::Query;
use axum::extract::rejection::QueryRejection;
use serde_json::Map;

use super::stored::{
    ItemsQuery, Paging, answer, from_store, not_found, on_store, store_error, tenant_of,
};
use super::*;
use crate::openai::body_object;
use crate::stored::Conversation;

/// The answer when the server keeps nothing.
fn off() -> ApiError {
    ApiError::new(
        ErrorType::InvalidRequestError,
        "conversations_unavailable",
        "this server keeps no conversations (started with --responses-store off)",
    )
}

fn missing() -> ApiError {
    not_found("conversation", None)
}

/// A conversation as the API shows it.
fn object(id: &str, conversation: &Conversation) -> Value {
    json!({
        "id": id,
        "object": "conversation",
        "created_at": conversation.created,
        "metadata": conversation.metadata,
    })
}

/// A request body's fields, each one of `allowed`.
async fn fields(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
    allowed: &[&str],
) -> Result<Map<String, Value>, ApiError> {
    let bytes = read_body(state, headers, body).await?;
    let fields = body_object(&bytes)?;
    if let Some(unknown) = fields.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(ApiError::invalid(
            clipped(unknown),
            format!("unknown field (allowed here: {})", allowed.join(", ")),
        ));
    }
    Ok(fields)
}

/// `metadata` as OpenAI bounds it: at most 16 string pairs, keys up to 64
/// characters, values up to 512.
fn metadata(value: Option<&Value>) -> Result<Value, ApiError> {
    let invalid = || {
        ApiError::invalid(
            "metadata",
            "metadata is an object of at most 16 strings, keys up to 64 characters and values up to 512",
        )
    };
    match value {
        None | Some(Value::Null) => Ok(json!({})),
        Some(Value::Object(pairs))
            if pairs.len() <= 16
                && pairs.iter().all(|(k, v)| {
                    k.chars().count() <= 64 && v.as_str().is_some_and(|v| v.chars().count() <= 512)
                }) =>
        {
            Ok(Value::Object(pairs.clone()))
        }
        Some(_) => Err(invalid()),
    }
}

/// `POST /v1/conversations`: a new conversation, with `items` and
/// `metadata` if given.
pub async fn create(
    State(state): State<Arc<AppState>>,
    ticket: Option<Extension<Ticket>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let result = async {
        // Who asks, before a byte of the body is read.
        let (tenant, _admission) = tenant_of(&state, &headers, ticket.as_ref())?;
        let fields = fields(&state, &headers, body, &["items", "metadata"]).await?;
        let items = match fields.get("items") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(list)) if list.is_empty() => Vec::new(),
            Some(items) => responses::conversation_items(items)?,
        };
        let conversation = Conversation {
            created: unix_now(),
            metadata: metadata(fields.get("metadata"))?,
            items,
        };
        on_store(&state, tenant, off(), move |store, tenant| {
            let id = crate::stored::new_id("conv");
            store
                .create_conversation(tenant, &id, &conversation)
                .map_err(too_large_or_failed)?;
            Ok(object(&id, &conversation))
        })
        .await
    }
    .await;
    answer(&state, result)
}

/// A refusal for what the tenant's bytes cannot hold; else the store failed.
fn too_large_or_failed(error: crate::error::ServerError) -> ApiError {
    match error {
        crate::error::ServerError::StoredRowTooLarge { limit, .. } => ApiError::invalid(
            "items",
            format!("a conversation may take at most {limit} bytes"),
        ),
        crate::error::ServerError::StoredTooLarge { limit, .. } => ApiError::invalid(
            "items",
            format!("this tenant's stored responses and conversations would exceed {limit} bytes"),
        ),
        other => store_error(other),
    }
}

/// `GET /v1/conversations/{id}`.
pub async fn retrieve(
    State(state): State<Arc<AppState>>,
    ticket: Option<Extension<Ticket>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    from_store(
        &state,
        &headers,
        ticket.as_ref(),
        off(),
        move |store, tenant| {
            let conversation = store.conversation(tenant, &id).map_err(store_error)?;
            Ok(object(&id, &conversation.ok_or_else(missing)?))
        },
    )
    .await
}

/// `POST /v1/conversations/{id}`: new `metadata`.
pub async fn update(
    State(state): State<Arc<AppState>>,
    ticket: Option<Extension<Ticket>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let result = async {
        // Who asks, before a byte of the body is read.
        let (tenant, _admission) = tenant_of(&state, &headers, ticket.as_ref())?;
        let fields = fields(&state, &headers, body, &["metadata"]).await?;
        if !fields.contains_key("metadata") {
            return Err(ApiError::invalid("metadata", "metadata is required"));
        }
        let metadata = metadata(fields.get("metadata"))?;
        on_store(&state, tenant, off(), move |store, tenant| {
            let edited = store
                .edit_conversation(tenant, &id, |c| c.metadata = metadata)
                .map_err(too_large_or_failed)?;
            Ok(object(&id, &edited.ok_or_else(missing)?))
        })
        .await
    }
    .await;
    answer(&state, result)
}

/// `DELETE /v1/conversations/{id}`.
pub async fn delete(
    State(state): State<Arc<AppState>>,
    ticket: Option<Extension<Ticket>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    from_store(
        &state,
        &headers,
        ticket.as_ref(),
        off(),
        move |store, tenant| {
            if !store
                .delete_conversation(tenant, &id)
                .map_err(store_error)?
            {
                return Err(missing());
            }
            Ok(render::to_value(render::Deleted {
                id: &id,
                object: "conversation.deleted",
                deleted: true,
            }))
        },
    )
    .await
}

/// `GET /v1/conversations/{id}/items`: its items, a page at a time.
pub async fn list_items(
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
    from_store(
        &state,
        &headers,
        ticket.as_ref(),
        off(),
        move |store, tenant| {
            let conversation = store.conversation(tenant, &id).map_err(store_error)?;
            Ok(paging.page(conversation.ok_or_else(missing)?.items))
        },
    )
    .await
}

/// `POST /v1/conversations/{id}/items`: adds `items` (at most 20); the
/// list of what was added.
pub async fn add_items(
    State(state): State<Arc<AppState>>,
    ticket: Option<Extension<Ticket>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let result = async {
        // Who asks, before a byte of the body is read.
        let (tenant, _admission) = tenant_of(&state, &headers, ticket.as_ref())?;
        let fields = fields(&state, &headers, body, &["items"]).await?;
        let items = responses::conversation_items(fields.get("items").unwrap_or(&Value::Null))?;
        on_store(&state, tenant, off(), move |store, tenant| {
            let added = items.clone();
            store
                .edit_conversation(tenant, &id, |c| c.items.extend(added))
                .map_err(too_large_or_failed)?
                .ok_or_else(missing)?;
            Ok(render::to_value(render::ItemPage::of(items, false)))
        })
        .await
    }
    .await;
    answer(&state, result)
}

/// `GET /v1/conversations/{id}/items/{item_id}`: one item.
pub async fn item(
    State(state): State<Arc<AppState>>,
    ticket: Option<Extension<Ticket>>,
    Path((id, item_id)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    from_store(
        &state,
        &headers,
        ticket.as_ref(),
        off(),
        move |store, tenant| {
            let conversation = store.conversation(tenant, &id).map_err(store_error)?;
            conversation
                .ok_or_else(missing)?
                .items
                .into_iter()
                .find(|item| item["id"] == item_id.as_str())
                .ok_or_else(|| not_found("item", None))
        },
    )
    .await
}

/// `DELETE /v1/conversations/{id}/items/{item_id}`: the conversation,
/// without that item.
pub async fn delete_item(
    State(state): State<Arc<AppState>>,
    ticket: Option<Extension<Ticket>>,
    Path((id, item_id)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    from_store(
        &state,
        &headers,
        ticket.as_ref(),
        off(),
        move |store, tenant| {
            let mut found = false;
            let edited = store
                .edit_conversation(tenant, &id, |c| {
                    let before = c.items.len();
                    c.items.retain(|item| item["id"] != item_id.as_str());
                    found = c.items.len() < before;
                })
                .map_err(store_error)?
                .ok_or_else(missing)?;
            if !found {
                return Err(not_found("item", None));
            }
            Ok(object(&id, &edited))
        },
    )
    .await
}
