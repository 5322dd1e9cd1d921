//! The Responses API's answers: its object, and its stream of typed events.

use serde::Serialize;

use super::reply::Step;
use super::*;

/// The Responses API's answers.
impl Reply {
    /// Choice 0's answer as output items: its text as a message (unless it
    /// is only calls), then each call.
    pub(super) fn response_items(&mut self, text: &str, status: &str) -> Vec<Value> {
        let (content, calls) = match &self.tools {
            Some(tools) => tools.parse(text, self.choices[0].finish.map(|(reason, _)| reason)),
            None => (text.to_string(), Vec::new()),
        };
        // A call's tokens are not the message's, nor are those of a call
        // that could not be made (the parse keeps the text before either).
        let logprobs = self.shown_logprobs((content.len() < text.len()).then_some(content.len()));
        let mut items = Vec::new();
        if calls.is_empty() || !content.is_empty() {
            items.push(responses::message_item(
                &responses::item_id("msg"),
                &content,
                status,
                &logprobs,
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

    /// The log-probabilities of the tokens that spell the next `shown`
    /// bytes of choice 0's message text (every token left with `None`), as
    /// a message part lists them; empty unless the request included them.
    /// A token not all shown yet (the start of a character or of a call
    /// held back) waits for the rest; tokens left when the message ends
    /// with a call are the call's, and are not listed.
    pub(super) fn shown_logprobs(&mut self, shown: Option<usize>) -> Vec<Value> {
        if !self.logprobs {
            return Vec::new();
        }
        let pending = &self.choices[0].logprobs;
        let count = match shown {
            None => {
                self.streamed.unspelled = 0;
                pending.len()
            }
            Some(bytes) => {
                let lengths = pending.iter().map(|t| self.state.text_bytes(t.token).len());
                let (count, unspelled) = spelling(lengths, self.streamed.unspelled + bytes);
                self.streamed.unspelled = unspelled;
                count
            }
        };
        let tokens: Vec<TokenLogprobs> = self.choices[0].logprobs.drain(..count).collect();
        token_logprobs(&self.state, &tokens)
            .into_iter()
            .map(render::to_value)
            .collect()
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

    /// One Responses streaming event: its `type` is `kind`, and it is
    /// numbered in the stream's order.
    pub(super) fn event(&mut self, kind: &'static str, body: EventBody<'_>) -> SseEvent {
        let event = Sequenced {
            r#type: kind,
            body,
            sequence_number: self.sequence,
        };
        self.sequence += 1;
        let data = serde_json::to_string(&event).expect("an event always serialises");
        SseEvent::default().event(kind).data(data)
    }

    /// The events that open the message item, the first time text comes.
    pub(super) fn open_message(&mut self, events: &mut Vec<SseEvent>) -> String {
        if let Some(id) = self.output.last().and_then(|item| item["id"].as_str()) {
            return id.to_string();
        }
        let id = responses::item_id("msg");
        let mut item = responses::message_item(&id, "", "in_progress", &[]);
        item["content"] = json!([]);
        self.output.push(item.clone());
        let added = self.event(
            "response.output_item.added",
            EventBody::Item {
                output_index: 0,
                item: &item,
            },
        );
        let empty = responses::empty_output_text();
        let part = self.event(
            "response.content_part.added",
            EventBody::Part {
                item_id: &id,
                output_index: 0,
                content_index: 0,
                part: &empty,
            },
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
        let logprobs = self.shown_logprobs(Some(text.len()));
        self.streamed.text.push_str(&text);
        self.streamed.logprobs.extend_from_slice(&logprobs);
        let delta = self.event(
            "response.output_text.delta",
            EventBody::TextDelta {
                item_id: &id,
                output_index: 0,
                content_index: 0,
                delta: &text,
                logprobs: &logprobs,
            },
        );
        events.push(delta);
        events
    }

    /// The events that close the answer: the message's text, part and item
    /// done, then each call as an item with its arguments.
    pub(super) fn response_finish(&mut self) -> Vec<SseEvent> {
        let mut rest = std::mem::take(&mut self.choices[0].text);
        let mut calls = Vec::new();
        // Whether the parse left out the end of the text (a call, or one
        // that could not be made): its tokens are not the message's.
        let mut cut = false;
        if let Some(tools) = &self.tools {
            let choice = &mut self.choices[0];
            let mut held = choice.split.push(&rest);
            held.push_str(&choice.split.finish());
            (rest, calls) = tools.parse(&held, choice.finish.map(|(reason, _)| reason));
            cut = rest.len() < held.len();
        }
        let status = self.response_status();
        let mut events = Vec::new();
        if !self.output.is_empty() || calls.is_empty() || !rest.is_empty() {
            let id = self.open_message(&mut events);
            // A call's tokens are not the message's.
            let logprobs = self.shown_logprobs(cut.then_some(rest.len()));
            if !rest.is_empty() {
                let delta = self.event(
                    "response.output_text.delta",
                    EventBody::TextDelta {
                        item_id: &id,
                        output_index: 0,
                        content_index: 0,
                        delta: &rest,
                        logprobs: &logprobs,
                    },
                );
                events.push(delta);
            }
            self.streamed.text.push_str(&rest);
            self.streamed.logprobs.extend(logprobs);
            let streamed = std::mem::take(&mut self.streamed);
            let (text, logprobs) = (streamed.text, streamed.logprobs);
            let item = responses::message_item(&id, &text, status, &logprobs);
            self.output[0] = item.clone();
            let part = item["content"][0].clone();
            let done = [
                (
                    "response.output_text.done",
                    EventBody::TextDone {
                        item_id: &id,
                        output_index: 0,
                        content_index: 0,
                        text: &text,
                        logprobs: &logprobs,
                    },
                ),
                (
                    "response.content_part.done",
                    EventBody::Part {
                        item_id: &id,
                        output_index: 0,
                        content_index: 0,
                        part: &part,
                    },
                ),
                (
                    "response.output_item.done",
                    EventBody::Item {
                        output_index: 0,
                        item: &item,
                    },
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
                    EventBody::Item {
                        output_index: index,
                        item: &open,
                    },
                ),
                (
                    "response.function_call_arguments.delta",
                    EventBody::ArgumentsDelta {
                        item_id: &id,
                        output_index: index,
                        delta: &call.arguments,
                    },
                ),
                (
                    "response.function_call_arguments.done",
                    EventBody::ArgumentsDone {
                        item_id: &id,
                        output_index: index,
                        arguments: &call.arguments,
                    },
                ),
                (
                    "response.output_item.done",
                    EventBody::Item {
                        output_index: index,
                        item: &item,
                    },
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
                        reply.event(
                            "response.created",
                            EventBody::Response { response: &created },
                        ),
                        reply.event(
                            "response.in_progress",
                            EventBody::Response { response: &created },
                        ),
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
                        let event = reply.event(kind, EventBody::Response { response: &body });
                        return Some((vec![event], (reply, ResponsePhase::Ended)));
                    }
                    Step::Failed(error) => {
                        reply.log_end(200, None);
                        reply.keep_failed(&error).await;
                        // An error event and no completion (I5, I7).
                        let body = EventBody::Error {
                            code: error.code.as_deref(),
                            message: &error.message,
                            param: error.param.as_deref(),
                        };
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

/// How many of the tokens of these text `lengths` (in bytes) the next
/// `shown` bytes of text spell whole, and the bytes shown past them.
fn spelling(lengths: impl Iterator<Item = usize>, mut shown: usize) -> (usize, usize) {
    let count = lengths
        .take_while(|&len| {
            let whole = len <= shown;
            if whole {
                shown -= len;
            }
            whole
        })
        .count();
    (count, shown)
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

/// A Responses stream event as sent: its `type`, its fields, its place in
/// the stream.
#[derive(Serialize)]
struct Sequenced<'a> {
    r#type: &'static str,
    #[serde(flatten)]
    body: EventBody<'a>,
    sequence_number: u64,
}

/// The fields of each kind of Responses stream event.
#[derive(Serialize)]
#[serde(untagged)]
pub(super) enum EventBody<'a> {
    /// `response.created`, `.in_progress`, `.completed`, `.incomplete`.
    Response { response: &'a Value },
    /// `response.output_item.added` and `.done`.
    Item {
        output_index: usize,
        item: &'a Value,
    },
    /// `response.content_part.added` and `.done`.
    Part {
        item_id: &'a str,
        output_index: usize,
        content_index: usize,
        part: &'a Value,
    },
    /// `response.output_text.delta`: the text, and the log-probabilities
    /// of the tokens that spell it (empty unless included).
    TextDelta {
        item_id: &'a str,
        output_index: usize,
        content_index: usize,
        delta: &'a str,
        logprobs: &'a [Value],
    },
    /// `response.output_text.done`: the whole text and its tokens'
    /// log-probabilities.
    TextDone {
        item_id: &'a str,
        output_index: usize,
        content_index: usize,
        text: &'a str,
        logprobs: &'a [Value],
    },
    /// `response.function_call_arguments.delta`.
    ArgumentsDelta {
        item_id: &'a str,
        output_index: usize,
        delta: &'a str,
    },
    /// `response.function_call_arguments.done`.
    ArgumentsDone {
        item_id: &'a str,
        output_index: usize,
        arguments: &'a str,
    },
    /// `error`: the request failed after the stream began.
    Error {
        code: Option<&'a str>,
        message: &'a str,
        param: Option<&'a str>,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sent(kind: &'static str, body: EventBody<'_>) -> Value {
        serde_json::to_value(Sequenced {
            r#type: kind,
            body,
            sequence_number: 4,
        })
        .unwrap()
    }

    #[test]
    fn stream_events_carry_their_type_number_and_fields() {
        let response = json!({"id": "resp_1", "object": "response"});
        assert_eq!(
            sent(
                "response.created",
                EventBody::Response {
                    response: &response
                }
            ),
            json!({"type": "response.created", "sequence_number": 4, "response": response})
        );
        assert_eq!(
            sent(
                "response.output_text.delta",
                EventBody::TextDelta {
                    item_id: "msg_1",
                    output_index: 0,
                    content_index: 0,
                    delta: "Hel",
                    logprobs: &[]
                }
            ),
            json!({"type": "response.output_text.delta", "sequence_number": 4,
                   "item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": "Hel",
                   "logprobs": []})
        );
        assert_eq!(
            sent(
                "error",
                EventBody::Error {
                    code: None,
                    message: "the worker is gone",
                    param: None
                }
            ),
            json!({"type": "error", "sequence_number": 4,
                   "code": null, "message": "the worker is gone", "param": null})
        );
    }

    #[test]
    fn a_delta_lists_the_tokens_it_shows_whole() {
        // Tokens of 3, 2 and 4 bytes (a special token spells nothing: 0).
        let lengths = [3, 2, 0, 4];
        assert_eq!(spelling(lengths.into_iter(), 3), (1, 0));
        // Part of a token shown (a character's first bytes): it waits.
        assert_eq!(spelling(lengths[1..].iter().copied(), 1), (0, 1));
        // The rest of it comes; a token of no text goes with the one before.
        assert_eq!(spelling(lengths[1..].iter().copied(), 1 + 1), (2, 0));
        assert_eq!(spelling(lengths[3..].iter().copied(), 5), (1, 1));
        assert_eq!(spelling(std::iter::empty(), 2), (0, 2));
    }

    #[test]
    fn output_items_are_openais() {
        assert_eq!(
            responses::message_item("msg_1", "hi", "completed", &[json!({"token": "hi"})]),
            json!({"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                   "content": [{"type": "output_text", "text": "hi", "annotations": [],
                                "logprobs": [{"token": "hi"}]}]})
        );
        let call = Call {
            id: "call_1".into(),
            name: "f".into(),
            arguments: "{}".into(),
        };
        assert_eq!(
            responses::call_item("fc_1", &call, "", "in_progress"),
            json!({"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f",
                   "arguments": "", "status": "in_progress"})
        );
    }
}
