//! An admitted request on its way back: its choices' events, rendered as
//! chat or completions objects, whole or streamed.

use super::*;

/// One choice of an admitted request: its engine handle and what it has
/// produced so far.
pub(super) struct Choice {
    pub(super) index: usize,
    pub(super) handle: RequestHandle,
    /// An event read ahead (the first, while the other choices waited).
    pub(super) first: Option<Event>,
    pub(super) echo: Option<String>,
    /// The prompt's first token, which has no score.
    pub(super) prompt_first: u32,
    /// The prompt's scores, once they came (if the request asked).
    pub(super) prompt_scores: Option<Vec<PromptLogprob>>,
    pub(super) text: String,
    /// Log-probabilities not yet sent (streaming) or all of them.
    pub(super) logprobs: Vec<TokenLogprobs>,
    /// Characters of text already sent, where the next logprobs' text
    /// begins (completions' `text_offset`).
    pub(super) sent_chars: usize,
    pub(super) finish: Option<(FinishReason, Usage)>,
    /// With tools: text streams until a call begins.
    pub(super) split: StreamSplit,
}

impl Choice {
    pub(super) fn new(
        index: usize,
        handle: RequestHandle,
        echo: Option<String>,
        prompt_first: u32,
        first: Option<Event>,
    ) -> Self {
        Choice {
            index,
            handle,
            first,
            echo,
            prompt_first,
            prompt_scores: None,
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
pub(super) struct Reply {
    pub(super) state: Arc<AppState>,
    pub(super) tenant: Arc<Tenant>,
    pub(super) endpoint: Endpoint,
    pub(super) choices: Vec<Choice>,
    /// The functions the model may call: answers are parsed for calls.
    pub(super) tools: Option<Arc<Tools>>,
    /// Responses: the request fields the response object repeats, the
    /// output items so far, and the stream's next event number.
    pub(super) echo: Value,
    /// Responses: what the answer keeps in the store once it is done.
    pub(super) to_store: Option<super::stored::ToStore>,
    pub(super) output: Vec<Value>,
    pub(super) sequence: u64,
    /// Responses: the message streamed so far.
    pub(super) streamed: StreamedMessage,
    /// Choices per prompt.
    pub(super) n: usize,
    pub(super) logprobs: bool,
    pub(super) prompt_logprobs: PromptLogprobsWanted,
    /// The tenant's sequences and the tokens charged, until the reply
    /// ends (unused tokens go back then).
    pub(super) admission: Admission,
    pub(super) started: Instant,
    pub(super) id: String,
    pub(super) created: u64,
    /// Set when the request's end was counted; a reply dropped before that
    /// is a client that left.
    pub(super) ended: std::cell::Cell<bool>,
    pub(super) first_token_seen: bool,
}

impl Drop for Reply {
    fn drop(&mut self) {
        if !self.ended.get() {
            // A stream's client has the response's id from its first event.
            if self.endpoint == Endpoint::Responses && self.sequence > 0 {
                self.keep_cancelled();
            }
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

/// Responses: the message text streamed so far, and its tokens'
/// log-probabilities as listed (when the request included them).
#[derive(Debug, Default)]
pub(super) struct StreamedMessage {
    pub(super) text: String,
    pub(super) logprobs: Vec<Value>,
    /// Bytes of text shown that no listed token spells yet: the part of a
    /// token shown ahead of the rest of it.
    pub(super) unspelled: usize,
}

/// What the next event of a reply's choices says.
pub(super) enum Step {
    /// Choice `.0`'s prompt was scored.
    Prompt(usize),
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
    pub(super) async fn step(&mut self) -> Step {
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
            (i, Some(Event::Prompt { logprobs })) => {
                self.choices[i].prompt_scores = Some(logprobs);
                Step::Prompt(i)
            }
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
    pub(super) fn usage(&self) -> Usage {
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

    pub(super) fn log_end(&self, status: u16, usage: Option<Usage>) {
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
    pub(super) fn take_logprobs(&mut self, i: usize) -> Option<render::Logprobs> {
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
    pub(super) async fn finish_all(&mut self) -> Result<Usage, ApiError> {
        loop {
            match self.step().await {
                Step::Prompt(_) | Step::Token(_) | Step::Finished(_) => {}
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

    pub(super) async fn collect(mut self) -> Response {
        let usage = match self.finish_all().await {
            Ok(usage) => usage,
            Err(error) => return error.into_response(),
        };
        // Each choice's text and parts first: the rendered objects borrow
        // them.
        let mut wholes: Vec<Whole> = (0..self.choices.len())
            .map(|i| {
                let prefix = self.choices[i].echo.clone().unwrap_or_default();
                self.choices[i].sent_chars = prefix.chars().count();
                let echoed = self.echoed_prompt_logprobs(i);
                let logprobs = self.take_logprobs(i);
                let logprobs = match (echoed, logprobs) {
                    (Some(prompt), Some(completion)) => Some(prompt.then(completion)),
                    (_, logprobs) => logprobs,
                };
                let listed = self.prompt_logprobs.listed && self.endpoint == Endpoint::Completions;
                let choice = &self.choices[i];
                let text = format!("{prefix}{}", choice.text);
                let (text, calls) = match &self.tools {
                    Some(tools) => tools.parse(&text, choice.finish.map(|(reason, _)| reason)),
                    None => (text, Vec::new()),
                };
                Whole {
                    index: choice.index,
                    text,
                    calls,
                    logprobs,
                    finish: choice.finish.map(|(reason, _)| reason),
                    prompt_logprobs: listed.then(|| self.listed_prompt_logprobs(i)),
                }
            })
            .collect();
        let choices: Vec<render::Choice<'_>> = wholes
            .iter_mut()
            .map(|whole| {
                let logprobs = whole.logprobs.take();
                if !whole.calls.is_empty() {
                    return render::Choice::Message {
                        index: whole.index,
                        message: render::Message::calls(&whole.text, &whole.calls),
                        logprobs,
                        finish_reason: Some(render::tool_finish(whole.finish)),
                    };
                }
                let mut choice =
                    self.endpoint
                        .choice(whole.index, &whole.text, logprobs, whole.finish);
                if let render::Choice::Text {
                    prompt_logprobs, ..
                } = &mut choice
                {
                    *prompt_logprobs = whole.prompt_logprobs.take();
                }
                choice
            })
            .collect();
        let mut body = self.body(false, choices, Some(usage));
        // vLLM's place for chat: once, the prompt being every choice's.
        body.prompt_logprobs = (self.prompt_logprobs.listed && self.endpoint == Endpoint::Chat)
            .then(|| self.listed_prompt_logprobs(0));
        (StatusCode::OK, Json(body)).into_response()
    }

    pub(super) fn stream(self, include_usage: bool) -> Response {
        let events = stream_events(self, include_usage);
        Sse::new(events)
            .keep_alive(KeepAlive::default())
            .into_response()
    }

    /// This request's answer (`chunk`: one chunk of its stream) around
    /// `choices`.
    fn body<C>(&self, chunk: bool, choices: Vec<C>, usage: Option<Usage>) -> render::Body<'_, C> {
        render::Body {
            id: &self.id,
            object: self.endpoint.object(chunk),
            created: self.created,
            model: &self.state.model_id,
            system_fingerprint: &self.state.system_fingerprint,
            choices,
            usage: usage.map(Into::into),
            prompt_logprobs: None,
        }
    }

    /// One chunk of the stream: `choices`, and `usage` on the last.
    pub(super) fn chunk(&self, choices: Vec<render::Delta<'_>>, usage: Option<Usage>) -> SseEvent {
        let body = self.body(true, choices, usage);
        let data = serde_json::to_string(&body).expect("a chunk always serialises");
        SseEvent::default().data(data)
    }

    /// The chunks that stream the echoed prompt of choice `i` — the first
    /// of its prompt's `n`, which scored it — and of its siblings, each with
    /// the scores, once they came (completions' `echo` with `logprobs`).
    /// The siblings start after the first choice's first event, so their
    /// echo still leads their text.
    pub(super) fn prompt_chunk(&mut self, i: usize) -> Vec<SseEvent> {
        let mut events = Vec::new();
        for sibling in i..(i + self.n).min(self.choices.len()) {
            let Some(echo) = self.choices[sibling].echo.take() else {
                continue;
            };
            let logprobs = self.echoed_prompt_logprobs(sibling);
            let choice = &mut self.choices[sibling];
            choice.sent_chars = echo.chars().count();
            let delta = self
                .endpoint
                .delta(choice.index, Some(&echo), false, logprobs, None);
            events.push(self.chunk(vec![delta], None));
        }
        events
    }

    /// The choice that scored choice `i`'s prompt: the first of its `n`.
    fn scorer(&self, i: usize) -> &Choice {
        &self.choices[i - i % self.n]
    }

    /// Choice `i`'s prompt scores in OpenAI's legacy completions format,
    /// its first token's `null`, if they lead its log-probabilities.
    pub(super) fn echoed_prompt_logprobs(&self, i: usize) -> Option<render::Logprobs> {
        let scorer = self.scorer(i);
        match (self.prompt_logprobs.echoed, &scorer.prompt_scores) {
            (true, Some(scores)) => Some(legacy_prompt_logprobs(
                &self.state,
                scorer.prompt_first,
                scores,
            )),
            _ => None,
        }
    }

    /// Choice `i`'s prompt scores as vLLM's `prompt_logprobs`.
    pub(super) fn listed_prompt_logprobs(&self, i: usize) -> Value {
        let scores = self.scorer(i).prompt_scores.as_deref().unwrap_or_default();
        listed_prompt_logprobs(&self.state, scores)
    }

    /// The chunk that streams choice `i`'s new text (and log-probabilities),
    /// if it has any to show yet.
    pub(super) fn text_chunk(&mut self, i: usize) -> Vec<SseEvent> {
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
        vec![self.chunk(vec![delta], None)]
    }

    /// The chunks that end choice `i`: any text and log-probabilities left,
    /// the calls it made (a header with each call's id and name, then its
    /// arguments), and its finish reason.
    pub(super) fn finish_chunk(&mut self, i: usize) -> Vec<SseEvent> {
        let mut text = std::mem::take(&mut self.choices[i].text);
        let mut calls = Vec::new();
        if let Some(tools) = &self.tools {
            let choice = &mut self.choices[i];
            let mut held = choice.split.push(&text);
            held.push_str(&choice.split.finish());
            (text, calls) = tools.parse(&held, choice.finish.map(|(reason, _)| reason));
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
            events.push(self.chunk(vec![delta], None));
            return events;
        }
        if !text.is_empty() {
            let delta = self.endpoint.delta(index, Some(&text), false, None, None);
            events.push(self.chunk(vec![delta], None));
        }
        let header = calls
            .iter()
            .enumerate()
            .map(|(k, call)| render::ToolCallDelta::header(k, call));
        let arguments = calls
            .iter()
            .enumerate()
            .map(|(k, call)| render::ToolCallDelta::arguments(k, call));
        for (tool_calls, logprobs) in [(header.collect(), None), (arguments.collect(), logprobs)] {
            let delta = render::Delta::Message {
                index,
                delta: render::MessageDelta {
                    tool_calls: Some(tool_calls),
                    ..render::MessageDelta::default()
                },
                logprobs,
                finish_reason: None,
            };
            events.push(self.chunk(vec![delta], None));
        }
        let end = render::Delta::Message {
            index,
            delta: render::MessageDelta::default(),
            logprobs: None,
            finish_reason: Some(render::tool_finish(reason)),
        };
        events.push(self.chunk(vec![end], None));
        events
    }
}

pub(super) enum Phase {
    /// The role chunk (chat) or the echoed prompt (completions) of choice `.0`.
    Start(usize),
    Running,
    Usage(Usage),
    Done,
    End,
}

pub(super) fn stream_events(
    reply: Reply,
    include_usage: bool,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    stream::unfold(
        (reply, Phase::Start(0)),
        move |(mut reply, phase)| async move {
            let next = match phase {
                Phase::Start(i) if i < reply.choices.len() => {
                    let index = reply.choices[i].index;
                    // An echo with its scores waits for them (`prompt_chunk`).
                    let echo = match reply.prompt_logprobs.echoed {
                        true => None,
                        false => reply.choices[i].echo.take(),
                    };
                    let delta = match (reply.endpoint, &echo) {
                        // Responses streams its own events (`response_stream`).
                        (Endpoint::Chat | Endpoint::Responses, _) => {
                            Some(reply.endpoint.delta(index, Some(""), true, None, None))
                        }
                        (Endpoint::Completions, Some(echo)) => {
                            reply.choices[i].sent_chars = echo.chars().count();
                            Some(reply.endpoint.delta(index, Some(echo), false, None, None))
                        }
                        (Endpoint::Completions, None) => None,
                    };
                    let events = match delta {
                        Some(delta) => vec![reply.chunk(vec![delta], None)],
                        None => Vec::new(),
                    };
                    (events, Phase::Start(i + 1))
                }
                Phase::Start(_) | Phase::Running => match reply.step().await {
                    Step::Prompt(i) => (reply.prompt_chunk(i), Phase::Running),
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
                Phase::Usage(usage) => (vec![reply.chunk(Vec::new(), Some(usage))], Phase::Done),
                Phase::Done => (vec![SseEvent::default().data("[DONE]")], Phase::End),
                Phase::End => return None,
            };
            Some((next.0, (reply, next.1)))
        },
    )
    .flat_map(|events| stream::iter(events.into_iter().map(Ok)))
}

/// One choice of a whole answer, its parts computed: what its rendered
/// object borrows.
struct Whole {
    index: usize,
    /// The text (with tools: the text before any call).
    text: String,
    calls: Vec<Call>,
    logprobs: Option<render::Logprobs>,
    finish: Option<FinishReason>,
    /// vLLM's `prompt_logprobs` of a completions choice, if asked.
    prompt_logprobs: Option<Value>,
}
