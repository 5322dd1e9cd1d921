//! Stored responses and conversations behind tenant walls: `store`,
//! `previous_response_id`, `conversation`, `GET`/`DELETE
//! /v1/responses/{id}`, `input_items` and the Conversations API, over HTTP
//! against a real server — kept across a restart, a continuation reading the prefix
//! cache, another tenant's id answered exactly as a made-up one (I9), and
//! nothing of the stored text in the log (I10).

#![allow(clippy::unwrap_used)]

use serde_json::{Value, json};

use crate::common::{Server, post, sse, tenant, tenants_file};

/// A request with `method` on `path`, as `key`'s tenant: status and body.
async fn call(server: &Server, method: &str, path: &str, key: &str) -> (u16, Value) {
    let client = reqwest::Client::new();
    let url = server.url(path);
    let request = match method {
        "GET" => client.get(url),
        "DELETE" => client.delete(url),
        _ => unreachable!("the tests use GET and DELETE"),
    };
    let response = request.bearer_auth(key).send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

/// A response stored by `server` (local mode) reads back.
async fn stores_and_reads_back(server: &Server) {
    let (status, answer) = post(&server.url("/v1/responses"), None, ask("hi", json!({}))).await;
    assert_eq!((status, &answer["store"]), (200, &json!(true)), "{answer}");
    let id = answer["id"].as_str().unwrap();
    let kept = reqwest::get(server.url(&format!("/v1/responses/{id}")))
        .await
        .unwrap();
    assert_eq!(kept.status().as_u16(), 200);
}

fn ask(input: &str, extra: Value) -> Value {
    let mut body = json!({"model": "builtin:tiny", "input": input, "max_output_tokens": 6,
                          "temperature": 0, "ignore_eos": true});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

#[tokio::test(flavor = "multi_thread")]
async fn stored_responses_continue_list_and_delete_within_their_tenant_only() {
    let (alpha, alpha_lines) = tenant("alpha", &[]);
    let (beta, beta_lines) = tenant("beta", &[]);
    let file = tenants_file(&[alpha_lines, beta_lines]);
    let mut server = Server::start(&["--config", file.path().to_str().unwrap()]);
    let url = server.url("/v1/responses");
    let marker = "zebra-crossing-7351";

    // Stored by default, as OpenAI's; read back exactly as answered.
    let (status, first) = post(
        &url,
        Some(&alpha),
        ask(&format!("remember {marker}"), json!({})),
    )
    .await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["store"], true);
    let id = first["id"].as_str().unwrap().to_string();
    assert_eq!(id.len(), "resp_".len() + 32, "128 random bits: {id}");
    let (status, read) = call(&server, "GET", &format!("/v1/responses/{id}"), &alpha).await;
    assert_eq!((status, &read), (200, &first));
    let (status, items) = call(
        &server,
        "GET",
        &format!("/v1/responses/{id}/input_items"),
        &alpha,
    )
    .await;
    assert_eq!(status, 200, "{items}");
    assert_eq!(items["object"], "list");
    let data = items["data"].as_array().unwrap();
    assert_eq!(data.len(), 1, "{items}");
    assert_eq!(data[0]["content"][0]["text"], format!("remember {marker}"));
    assert_eq!(items["first_id"], data[0]["id"]);

    // A continuation: the first turn and its answer come first, and their
    // pages come from the tenant's prefix cache.
    let (status, second) = post(
        &url,
        Some(&alpha),
        ask("and now?", json!({"previous_response_id": id})),
    )
    .await;
    assert_eq!(status, 200, "{second}");
    assert_eq!(second["previous_response_id"], id.as_str());
    let tokens = |r: &Value, k: &str| r["usage"][k].as_u64().unwrap();
    assert!(
        tokens(&second, "input_tokens")
            > tokens(&first, "input_tokens") + tokens(&first, "output_tokens"),
        "the earlier turn is in the prompt: {first} then {second}"
    );
    assert!(
        second["usage"]["input_tokens_details"]["cached_tokens"].as_u64() > Some(0),
        "the earlier turn's pages are reused: {second}"
    );
    // The continuation's own input items are its own.
    let second_id = second["id"].as_str().unwrap();
    let (_, items) = call(
        &server,
        "GET",
        &format!("/v1/responses/{second_id}/input_items?order=asc&limit=5"),
        &alpha,
    )
    .await;
    assert_eq!(
        items["data"][0]["content"][0]["text"], "and now?",
        "{items}"
    );

    // Another tenant: its id is exactly as absent as a made-up one.
    let made_up = format!("resp_{:032x}", 7u128);
    for (method, path) in [
        ("GET", "/v1/responses/{}"),
        ("GET", "/v1/responses/{}/input_items"),
        ("DELETE", "/v1/responses/{}"),
    ] {
        let theirs = call(&server, method, &path.replace("{}", &id), &beta).await;
        let nobody = call(&server, method, &path.replace("{}", &made_up), &beta).await;
        assert_eq!(theirs.0, 404, "{method} {path}: {}", theirs.1);
        assert_eq!(theirs, nobody, "{method} {path}");
    }
    let (status, theirs) = post(
        &url,
        Some(&beta),
        ask("hi", json!({"previous_response_id": id})),
    )
    .await;
    let (_, nobody) = post(
        &url,
        Some(&beta),
        ask("hi", json!({"previous_response_id": made_up})),
    )
    .await;
    assert_eq!(status, 404, "{theirs}");
    assert_eq!(theirs, nobody);
    assert_eq!(theirs["error"]["param"], "previous_response_id");
    assert!(
        !theirs.to_string().contains(&id),
        "the id is not echoed: {theirs}"
    );

    // Kept across a restart.
    server.restart();
    let (status, read) = call(&server, "GET", &format!("/v1/responses/{id}"), &alpha).await;
    assert_eq!((status, &read), (200, &first));

    // Deleted: gone for reading and for continuing.
    let (status, deleted) = call(&server, "DELETE", &format!("/v1/responses/{id}"), &alpha).await;
    assert_eq!(status, 200, "{deleted}");
    assert_eq!(
        deleted,
        json!({"id": id, "object": "response.deleted", "deleted": true})
    );
    let (status, _) = call(&server, "GET", &format!("/v1/responses/{id}"), &alpha).await;
    assert_eq!(status, 404);
    let (status, _) = post(
        &url,
        Some(&alpha),
        ask("again", json!({"previous_response_id": id})),
    )
    .await;
    assert_eq!(status, 404);

    // `store: false` keeps nothing; a stream keeps its completed response.
    let (_, unkept) = post(&url, Some(&alpha), ask("x", json!({"store": false}))).await;
    assert_eq!(unkept["store"], false);
    let unkept_id = unkept["id"].as_str().unwrap();
    let (status, _) = call(
        &server,
        "GET",
        &format!("/v1/responses/{unkept_id}"),
        &alpha,
    )
    .await;
    assert_eq!(status, 404);
    let (_, events) = sse(&url, Some(&alpha), ask("y", json!({"stream": true}))).await;
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    let streamed = &last["response"];
    let streamed_id = streamed["id"].as_str().unwrap();
    let (status, read) = call(
        &server,
        "GET",
        &format!("/v1/responses/{streamed_id}"),
        &alpha,
    )
    .await;
    assert_eq!((status, &read), (200, streamed));

    // Fields and paging it does not serve are refused by name.
    for (query, param) in [
        ("limit=0", "limit"),
        ("order=up", "order"),
        ("include=x", "query"),
    ] {
        let (status, answer) = call(
            &server,
            "GET",
            &format!("/v1/responses/{second_id}/input_items?{query}"),
            &alpha,
        )
        .await;
        assert_eq!(
            (status, &answer["error"]["param"]),
            (400, &json!(param)),
            "{query}"
        );
    }

    let log = server.log();
    assert!(log.contains("stored responses kept in this file"), "{log}");
    assert!(!log.contains(marker), "stored text in the log:\n{log}");
}

#[tokio::test(flavor = "multi_thread")]
async fn with_the_store_off_asking_to_store_is_refused_and_nothing_is_kept() {
    let server = Server::start(&["--responses-store", "off"]);
    let url = server.url("/v1/responses");
    let (status, answer) = post(&url, None, ask("hi", json!({"store": true}))).await;
    assert_eq!(
        (status, &answer["error"]["param"]),
        (400, &json!("store")),
        "{answer}"
    );
    let (status, answer) = post(
        &url,
        None,
        ask("hi", json!({"previous_response_id": "resp_1"})),
    )
    .await;
    assert_eq!(
        (status, &answer["error"]["param"]),
        (400, &json!("previous_response_id")),
        "{answer}"
    );
    let (status, answer) = post(&url, None, ask("hi", json!({}))).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["store"], false);
    let id = answer["id"].as_str().unwrap();
    let response = reqwest::get(server.url(&format!("/v1/responses/{id}")))
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 404);
    let (status, answer) = post(&server.url("/v1/conversations"), None, json!({})).await;
    assert_eq!(
        (status, &answer["error"]["code"]),
        (400, &json!("conversations_unavailable"))
    );
    let (status, answer) = post(&url, None, ask("hi", json!({"conversation": "conv_1"}))).await;
    assert_eq!(
        (status, &answer["error"]["param"]),
        (400, &json!("conversation")),
        "{answer}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn conversations_hold_items_responses_join_and_other_tenants_never_see() {
    let (alpha, alpha_lines) = tenant("alpha", &[]);
    let (beta, beta_lines) = tenant("beta", &[]);
    let file = tenants_file(&[alpha_lines, beta_lines]);
    let server = Server::start(&["--config", file.path().to_str().unwrap()]);
    let conversations = server.url("/v1/conversations");

    let (status, made) = post(
        &conversations,
        Some(&alpha),
        json!({"items": [{"type": "message", "role": "user", "content": "my name is Zed"}],
               "metadata": {"topic": "names"}}),
    )
    .await;
    assert_eq!(status, 200, "{made}");
    assert_eq!(made["object"], "conversation");
    assert_eq!(made["metadata"], json!({"topic": "names"}));
    let id = made["id"].as_str().unwrap().to_string();
    assert!(
        id.starts_with("conv_") && id.len() == "conv_".len() + 32,
        "{id}"
    );
    let path = format!("/v1/conversations/{id}");
    assert_eq!(
        call(&server, "GET", &path, &alpha).await,
        (200, made.clone())
    );

    // A response in the conversation reads its items and joins it.
    let alone = post(
        &server.url("/v1/responses"),
        Some(&alpha),
        ask("what is my name?", json!({})),
    )
    .await
    .1;
    let (status, answer) = post(
        &server.url("/v1/responses"),
        Some(&alpha),
        ask("what is my name?", json!({"conversation": id})),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["conversation"], json!({"id": id}));
    assert!(
        answer["usage"]["input_tokens"].as_u64() > alone["usage"]["input_tokens"].as_u64(),
        "the conversation's items are in the prompt: {answer}"
    );
    let (status, items) = call(&server, "GET", &format!("{path}/items?order=asc"), &alpha).await;
    assert_eq!(status, 200, "{items}");
    let data = items["data"].as_array().unwrap();
    assert_eq!(data.len(), 3, "its item, the question, the answer: {items}");
    // Text content comes back in parts, as OpenAI lists it.
    assert_eq!(data[0]["content"][0]["text"], "my name is Zed");
    assert_eq!(data[0]["content"][0]["type"], "input_text");
    assert_eq!(data[1]["content"][0]["text"], "what is my name?");
    assert_eq!(data[2]["id"], answer["output"][0]["id"]);

    // Items added, read one by one, deleted.
    let (status, added) = post(
        &format!("{}/items", server.url(&path)),
        Some(&alpha),
        json!({"items": [{"role": "user", "content": "one more"}]}),
    )
    .await;
    assert_eq!(status, 200, "{added}");
    let item_id = added["data"][0]["id"].as_str().unwrap().to_string();
    let (status, item) = call(&server, "GET", &format!("{path}/items/{item_id}"), &alpha).await;
    assert_eq!(
        (status, &item["content"][0]["text"]),
        (200, &json!("one more"))
    );

    // Another tenant: every path answers as for a conversation never made.
    let made_up = format!("conv_{:032x}", 9u128);
    for (method, template) in [
        ("GET", "/v1/conversations/{}"),
        ("GET", "/v1/conversations/{}/items"),
        ("DELETE", "/v1/conversations/{}"),
    ] {
        let theirs = call(&server, method, &template.replace("{}", &id), &beta).await;
        let nobody = call(&server, method, &template.replace("{}", &made_up), &beta).await;
        assert_eq!(theirs.0, 404, "{method} {template}: {}", theirs.1);
        assert_eq!(theirs, nobody, "{method} {template}");
    }
    let theirs = call(&server, "DELETE", &format!("{path}/items/{item_id}"), &beta).await;
    let nobody = call(
        &server,
        "DELETE",
        &format!("/v1/conversations/{made_up}/items/{item_id}"),
        &beta,
    )
    .await;
    assert_eq!((theirs.0, &theirs), (404, &nobody));
    let (status, _) = post(
        &format!("{}/items", server.url(&path)),
        Some(&beta),
        json!({"items": [{"role": "user", "content": "planted"}]}),
    )
    .await;
    assert_eq!(status, 404);
    let (status, theirs) = post(
        &server.url("/v1/responses"),
        Some(&beta),
        ask("hi", json!({"conversation": {"id": id}})),
    )
    .await;
    assert_eq!(
        (status, &theirs["error"]["param"]),
        (404, &json!("conversation")),
        "{theirs}"
    );
    let (_, items) = call(&server, "GET", &format!("{path}/items"), &alpha).await;
    assert_eq!(
        items["data"].as_array().unwrap().len(),
        4,
        "untouched: {items}"
    );

    // Metadata replaced; an item deleted; the conversation deleted.
    let (status, updated) = post(
        &server.url(&path),
        Some(&alpha),
        json!({"metadata": {"topic": "z"}}),
    )
    .await;
    assert_eq!(
        (status, &updated["metadata"]),
        (200, &json!({"topic": "z"}))
    );
    let (status, after) = call(
        &server,
        "DELETE",
        &format!("{path}/items/{item_id}"),
        &alpha,
    )
    .await;
    assert_eq!((status, &after["id"]), (200, &json!(id)));
    let (status, _) = call(&server, "GET", &format!("{path}/items/{item_id}"), &alpha).await;
    assert_eq!(status, 404);
    let (status, deleted) = call(&server, "DELETE", &path, &alpha).await;
    assert_eq!(
        (status, deleted),
        (
            200,
            json!({"id": id, "object": "conversation.deleted", "deleted": true})
        )
    );
    assert_eq!(call(&server, "GET", &path, &alpha).await.0, 404);

    // Bad bodies are refused by name.
    for (body, param) in [
        (json!({"items": "text"}), "items"),
        (json!({"items": [{"type": "input_image"}]}), "items[0].type"),
        (json!({"metadata": {"k": 3}}), "metadata"),
        (json!({"colour": "red"}), "colour"),
    ] {
        let (status, answer) = post(&conversations, Some(&alpha), body.clone()).await;
        assert_eq!(
            (status, &answer["error"]["param"]),
            (400, &json!(param)),
            "{body}: {answer}"
        );
    }
    // So is metadata that names a key twice: which value would be kept?
    let repeated = reqwest::Client::new()
        .post(&conversations)
        .bearer_auth(&alpha)
        .header("content-type", "application/json")
        .body(r#"{"metadata": {"topic": "a", "topic": "b"}}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(repeated.status(), 400);
    let answer: Value = repeated.json().await.unwrap();
    assert_eq!(answer["error"]["param"], "body", "{answer}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fleet_s_routers_share_responses_and_conversations_through_postgresql() {
    let Some(postgres) = crate::common::Postgres::start() else {
        return;
    };
    let (alpha, alpha_lines) = tenant("alpha", &[]);
    let (beta, beta_lines) = tenant("beta", &[]);
    let file = tenants_file(&[alpha_lines, beta_lines]);
    let args = [
        "--config",
        file.path().to_str().unwrap(),
        "--responses-store",
        &postgres.url,
    ];
    let one = Server::start(&args);
    let two = Server::start(&args);
    let marker = "heron-lantern-2209";

    // Kept through one router, read and continued through the other.
    let (status, first) = post(
        &one.url("/v1/responses"),
        Some(&alpha),
        ask(&format!("remember {marker}"), json!({})),
    )
    .await;
    assert_eq!(status, 200, "{first}");
    let id = first["id"].as_str().unwrap().to_string();
    let path = format!("/v1/responses/{id}");
    assert_eq!(call(&two, "GET", &path, &alpha).await, (200, first.clone()));
    let (status, second) = post(
        &two.url("/v1/responses"),
        Some(&alpha),
        ask("and now?", json!({"previous_response_id": id})),
    )
    .await;
    assert_eq!(status, 200, "{second}");
    assert!(
        second["usage"]["input_tokens"].as_u64()
            > Some(first["usage"]["input_tokens"].as_u64().unwrap() + 6),
        "{second}"
    );
    // Behind the tenant wall on either router.
    let made_up = format!("resp_{:032x}", 11u128);
    for server in [&one, &two] {
        let theirs = call(server, "GET", &path, &beta).await;
        let nobody = call(server, "GET", &format!("/v1/responses/{made_up}"), &beta).await;
        assert_eq!((theirs.0, &theirs), (404, &nobody));
    }

    // A conversation made on one router, answered in on the other, read on
    // the first.
    let (status, made) = post(
        &one.url("/v1/conversations"),
        Some(&alpha),
        json!({"items": [{"role": "user", "content": "my name is Zed"}]}),
    )
    .await;
    assert_eq!(status, 200, "{made}");
    let conversation = made["id"].as_str().unwrap().to_string();
    let (status, answer) = post(
        &two.url("/v1/responses"),
        Some(&alpha),
        ask("my name?", json!({"conversation": conversation})),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    let (_, items) = call(
        &one,
        "GET",
        &format!("/v1/conversations/{conversation}/items?order=asc"),
        &alpha,
    )
    .await;
    assert_eq!(items["data"].as_array().unwrap().len(), 3, "{items}");
    assert_eq!(items["data"][2]["id"], answer["output"][0]["id"]);

    // Deleted on one, gone on both.
    assert_eq!(call(&two, "DELETE", &path, &alpha).await.0, 200);
    assert_eq!(call(&one, "GET", &path, &alpha).await.0, 404);
    for server in [&one, &two] {
        let log = server.log();
        assert!(log.contains("stored responses kept in PostgreSQL"), "{log}");
        assert!(!log.contains(marker), "stored text in the log:\n{log}");
        assert!(
            !log.contains(&postgres.url),
            "the database URL in the log:\n{log}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn reading_and_writing_the_store_counts_against_the_tenant_s_rate() {
    let (key, lines) = tenant("metered", &["--requests-per-minute", "3"]);
    let file = tenants_file(&[lines]);
    let server = Server::start(&["--config", file.path().to_str().unwrap()]);
    let made_up = format!("/v1/responses/resp_{:032x}", 3u128);
    for _ in 0..2 {
        assert_eq!(call(&server, "GET", &made_up, &key).await.0, 404);
    }
    let (status, _) = post(&server.url("/v1/conversations"), Some(&key), json!({})).await;
    assert_eq!(status, 200);
    // The fourth request in the minute, whatever it asks of the store.
    let (status, answer) = call(&server, "GET", &made_up, &key).await;
    assert_eq!(status, 429, "{answer}");
    let (status, _) = post(&server.url("/v1/conversations"), Some(&key), json!({})).await;
    assert_eq!(status, 429);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unwritable_default_store_falls_back_to_memory_and_a_named_one_stops_start_up() {
    // /proc takes no new directories, even from root.
    let server = Server::start_with_env(&[], &[("KVFENCE_DATA_DIR", "/proc/kvfence-data")]);
    server.wait_for_log("kept in memory");
    stores_and_reads_back(&server).await;

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvfence"))
        .args(["serve", "--model", "builtin:tiny", "--port", "0"])
        .args(["--responses-store", "/proc/kvfence-data/responses.sqlite"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("--responses-store"), "{said}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_store_that_stops_answering_costs_its_requests_seconds_and_nobody_anything() {
    let Some(postgres) = crate::common::Postgres::start() else {
        return;
    };
    let server = Server::start(&["--responses-store", &postgres.url]);
    let (status, first) = post(&server.url("/v1/responses"), None, ask("hi", json!({}))).await;
    assert_eq!(status, 200, "{first}");
    let id = first["id"].as_str().unwrap().to_string();
    let frozen = postgres.freeze();

    // A continuation, which reads the store before its text work: it
    // waits the store's deadline, then is told to retry.
    let continuation = tokio::spawn({
        let url = server.url("/v1/responses");
        let body = ask("more", json!({"previous_response_id": id, "store": false}));
        async move { post(&url, None, body).await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    // Meanwhile the same tenant's chat is served at once: the stuck read
    // holds no text-work slot. (It held the tenant's only one, and every
    // request of the tenant waited for the database.)
    let started = std::time::Instant::now();
    let chat_url = server.url("/v1/chat/completions");
    let chat = post(
        &chat_url,
        None,
        json!({"model": "builtin:tiny", "messages": [{"role": "user", "content": "hi"}],
               "max_tokens": 2}),
    );
    let (status, chat) = tokio::time::timeout(std::time::Duration::from_secs(20), chat)
        .await
        .expect("the chat is not held up by another request's store read");
    assert_eq!(status, 200, "{chat}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(4),
        "the chat waited {:?} on another request's store read",
        started.elapsed()
    );
    let (status, refused) = tokio::time::timeout(std::time::Duration::from_secs(30), continuation)
        .await
        .expect("a continuation is answered within the store's deadline")
        .unwrap();
    assert_eq!(status, 503, "{refused}");
    assert_eq!(refused["error"]["code"], "store_unavailable", "{refused}");

    // An answer to keep is answered, said not to be kept.
    let (status, unkept) = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        post(&server.url("/v1/responses"), None, ask("again", json!({}))),
    )
    .await
    .expect("an answer is not held up by the store for long");
    assert_eq!(status, 200, "{unkept}");
    assert_eq!(unkept["store"], false, "{unkept}");
    let unkept_id = unkept["id"].as_str().unwrap().to_string();

    // The database answers again: so does the store, and what was said
    // not to be kept was not.
    drop(frozen);
    let mut read = None;
    for _ in 0..100 {
        let answer = reqwest::get(server.url(&format!("/v1/responses/{id}")))
            .await
            .unwrap();
        if answer.status() == 200 {
            read = Some(answer);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert!(
        read.is_some(),
        "the first response reads back once the database answers"
    );
    let gone = reqwest::get(server.url(&format!("/v1/responses/{unkept_id}")))
        .await
        .unwrap();
    assert_eq!(gone.status().as_u16(), 404, "store: false was the truth");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_postgresql_store_speaks_tls_verified_against_the_operator_s_ca() {
    let Some((postgres, ca)) = crate::common::Postgres::start_tls() else {
        return;
    };
    let url = format!("{}?sslmode=require", postgres.url);
    let ca = ca.to_str().unwrap();
    let server = Server::start(&["--responses-store", &url, "--responses-store-ca", ca]);
    stores_and_reads_back(&server).await;

    // In the clear the server turns it away; a CA that did not sign its
    // certificate does not trust it: either way the router does not start.
    let other_ca = tempfile::NamedTempFile::new().unwrap();
    let stranger = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])
        .unwrap()
        .self_signed(&rcgen::KeyPair::generate().unwrap())
        .unwrap();
    std::fs::write(other_ca.path(), stranger.pem()).unwrap();
    for extra in [
        vec![],
        vec!["--responses-store-ca", other_ca.path().to_str().unwrap()],
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvfence"))
            .args(["serve", "--model", "builtin:tiny", "--port", "0"])
            .args(["--responses-store", &url])
            .args(&extra)
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?}: started");
        assert!(said.contains("response store"), "{extra:?}: {said}");
        assert!(!said.contains("kvfence@"), "the URL is not printed: {said}");
    }
}

/// A Responses stream's events as they are read: the response's id, the
/// text so far, and the last event's type.
#[derive(Default)]
struct Events {
    pending: String,
    id: Option<String>,
    text: String,
    last: String,
}

impl Events {
    /// Reads one chunk of `stream` and takes in every whole event in it;
    /// false at the stream's end.
    async fn read(&mut self, stream: &mut reqwest::Response) -> bool {
        let Some(chunk) = stream.chunk().await.unwrap() else {
            return false;
        };
        self.pending.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = self.pending.find("\n\n") {
            let event: String = self.pending.drain(..end + 2).collect();
            let Some(data) = event.lines().find_map(|l| l.strip_prefix("data: ")) else {
                continue;
            };
            let data: Value = serde_json::from_str(data).unwrap();
            self.last = data["type"].as_str().unwrap().to_string();
            match self.last.as_str() {
                "response.created" => self.id = data["response"]["id"].as_str().map(str::to_string),
                "response.output_text.delta" => self.text.push_str(data["delta"].as_str().unwrap()),
                _ => {}
            }
        }
        true
    }
}

/// A streamed response whose client goes away has already given it its id
/// (`response.created`): that id reads back as what was streamed, status
/// `cancelled`, and a later request may continue it. Generation stops at
/// once, and the conversation it named does not take the unfinished turn
/// (a client that retries it would find it twice).
#[tokio::test(flavor = "multi_thread")]
async fn a_streamed_response_whose_client_left_is_kept_as_far_as_it_went() {
    // builtin:small decodes slowly enough to leave mid-answer.
    let server = Server::start(&["--model", "builtin:small"]);
    let (status, made) = post(&server.url("/v1/conversations"), None, json!({})).await;
    assert_eq!(status, 200, "{made}");
    let conversation = made["id"].as_str().unwrap().to_string();
    let mut stream = reqwest::Client::new()
        .post(server.url("/v1/responses"))
        .json(
            &json!({"model": "builtin:small", "input": "tell me a long story",
                      "max_output_tokens": 3000, "ignore_eos": true, "stream": true,
                      "conversation": conversation}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    // Read whole events until some text has come, then hang up.
    let mut events = Events::default();
    while events.text.is_empty() {
        events.read(&mut stream).await;
    }
    drop(stream);
    let (id, received) = (events.id.expect("response.created came first"), events.text);
    let path = format!("/v1/responses/{id}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let kept = loop {
        let (status, kept) = call(&server, "GET", &path, "unused").await;
        if status == 200 {
            break kept;
        }
        assert_eq!(status, 404, "{kept}");
        assert!(std::time::Instant::now() < deadline, "never kept");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert_eq!(kept["status"], "cancelled", "{kept}");
    assert_eq!(kept["output"][0]["status"], "incomplete", "{kept}");
    let streamed = kept["output"][0]["content"][0]["text"].as_str().unwrap();
    assert!(streamed.starts_with(&received), "{kept}");
    assert!(
        streamed.chars().count() < 3000,
        "generation went on after the client left: {kept}"
    );
    let (status, items) = call(&server, "GET", &format!("{path}/input_items"), "unused").await;
    assert_eq!(
        (status, &items["data"][0]["content"][0]["text"]),
        (200, &json!("tell me a long story")),
        "{items}"
    );
    // A later request continues it.
    let (status, next) = post(
        &server.url("/v1/responses"),
        None,
        json!({"model": "builtin:small", "input": "go on", "max_output_tokens": 2,
               "previous_response_id": id}),
    )
    .await;
    assert_eq!(status, 200, "{next}");
    // The conversation holds only answered turns.
    let (status, items) = call(
        &server,
        "GET",
        &format!("/v1/conversations/{conversation}/items"),
        "unused",
    )
    .await;
    assert_eq!((status, &items["data"]), (200, &json!([])), "{items}");
}

/// A streamed response that fails after `response.created` — here the
/// server stops and its grace period runs out — reads back as `failed`,
/// with the error its stream ended with, after a restart too.
#[tokio::test(flavor = "multi_thread")]
async fn a_streamed_response_that_failed_reads_back_as_failed() {
    let mut server = Server::start(&["--model", "builtin:small", "--shutdown-timeout", "0"]);
    let mut stream = reqwest::Client::new()
        .post(server.url("/v1/responses"))
        .json(
            &json!({"model": "builtin:small", "input": "tell me a long story",
                      "max_output_tokens": 3000, "ignore_eos": true, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    let mut events = Events::default();
    while events.text.is_empty() {
        events.read(&mut stream).await;
    }
    server.terminate();
    while events.read(&mut stream).await {}
    assert_eq!(events.last, "error");
    let id = events.id.expect("response.created came first");
    server.restart();
    let (status, kept) = call(&server, "GET", &format!("/v1/responses/{id}"), "unused").await;
    assert_eq!(status, 200, "{kept}");
    assert_eq!(kept["status"], "failed", "{kept}");
    assert!(kept["error"]["code"].is_string(), "{kept}");
    assert!(kept["error"]["message"].is_string(), "{kept}");
    assert_eq!(kept["output"][0]["status"], "incomplete", "{kept}");
    let streamed = kept["output"][0]["content"][0]["text"].as_str().unwrap();
    assert!(streamed.starts_with(&events.text), "{kept}");
}
