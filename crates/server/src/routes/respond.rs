//! The Responses API's answers: its object, and its stream of typed events.

use super::reply::Step;
use super::*;

/// The Responses API's answers.
impl Reply {
    /// Choice 0's answer as output items: its text as a message (unless it
    /// is only calls), then each call.
    pub(super) fn response_items(&self, text: &str, status: &str) -> Vec<Value> {
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
    pub(super) fn response_status(&self) -> &'static str {
        match self.choices[0].finish {
            Some((FinishReason::Length, _)) => "incomplete",
            _ => "completed",
        }
    }

    pub(super) fn response_body(
        &self,
        status: &str,
        output: Vec<Value>,
        usage: Option<Usage>,
    ) -> Value {
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
    pub(super) async fn response(mut self) -> Response {
        let usage = match self.finish_all().await {
            Ok(usage) => usage,
            Err(error) => return error.into_response(),
        };
        let status = self.response_status();
        let text = std::mem::take(&mut self.choices[0].text);
        let output = self.response_items(&text, status);
        let mut body = self.response_body(status, output, Some(usage));
        self.keep(&mut body).await;
        (StatusCode::OK, Json(body)).into_response()
    }

    /// One Responses streaming event.
    pub(super) fn event(&mut self, kind: &str, mut body: Value) -> SseEvent {
        body["type"] = kind.into();
        body["sequence_number"] = self.sequence.into();
        self.sequence += 1;
        SseEvent::default().event(kind).data(body.to_string())
    }

    /// The events that open the message item, the first time text comes.
    pub(super) fn open_message(&mut self, events: &mut Vec<SseEvent>) -> String {
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
    pub(super) fn response_text(&mut self) -> Vec<SseEvent> {
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
    pub(super) fn response_finish(&mut self) -> Vec<SseEvent> {
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

    pub(super) fn response_stream(self) -> Response {
        let start = (self, ResponsePhase::Opening);
        let events = stream::unfold(start, |(mut reply, phase)| async move {
            let events = match phase {
                ResponsePhase::Opening => {
                    let created = reply.response_body("in_progress", Vec::new(), None);
                    let events = vec![
                        reply.event("response.created", json!({"response": created.clone()})),
                        reply.event("response.in_progress", json!({"response": created})),
                    ];
                    return Some((events, (reply, ResponsePhase::Streaming)));
                }
                ResponsePhase::Streaming => match reply.step().await {
                    // The Responses API has no field that scores a prompt.
                    Step::Prompt(_) => Vec::new(),
                    Step::Token(_) => reply.response_text(),
                    Step::Finished(_) => reply.response_finish(),
                    Step::AllDone => {
                        let usage = reply.usage();
                        reply.log_end(200, Some(usage));
                        let status = reply.response_status();
                        let output = reply.output.clone();
                        let mut body = reply.response_body(status, output, Some(usage));
                        reply.keep(&mut body).await;
                        let kind = if status == "completed" {
                            "response.completed"
                        } else {
                            "response.incomplete"
                        };
                        let event = reply.event(kind, json!({"response": body}));
                        return Some((vec![event], (reply, ResponsePhase::Ended)));
                    }
                    Step::Failed(error) => {
                        reply.log_end(200, None);
                        // An error event and no completion (I5, I7).
                        let body = json!({"code": error.code, "message": error.message, "param": error.param});
                        let event = reply.event("error", body);
                        return Some((vec![event], (reply, ResponsePhase::Ended)));
                    }
                },
                ResponsePhase::Ended => return None,
            };
            Some((events, (reply, ResponsePhase::Streaming)))
        })
        .flat_map(|events| stream::iter(events.into_iter().map(Ok::<_, Infallible>)));
        Sse::new(events)
            .keep_alive(KeepAlive::default())
            .into_response()
    }
}

/// Where a Responses stream stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ResponsePhase {
    /// `response.created` and `response.in_progress` are next.
    Opening,
    /// Each choice's events as its tokens come.
    Streaming,
    /// `response.completed`, `response.incomplete` or `error` was sent.
    Ended,
}
