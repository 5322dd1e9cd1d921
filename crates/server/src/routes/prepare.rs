//! A request's body, parsed, checked and tokenized into engine requests:
//! everything that can refuse it with a 400 happens here, before any work.

use super::*;

/// The header a Gateway API inference gateway names a request's
/// InferenceObjective in.
pub(super) const OBJECTIVE_HEADER: &str = "x-gateway-inference-objective";

/// The priority of the objective the request's headers name, if any.
pub(super) fn objective_priority(
    state: &AppState,
    headers: &HeaderMap,
) -> Result<Option<i32>, ApiError> {
    let mut values = headers.get_all(OBJECTIVE_HEADER).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    // Readers take the first of two, or join them: refuse rather than guess.
    if values.next().is_some() {
        return Err(ApiError::invalid(
            OBJECTIVE_HEADER,
            "more than one inference objective: send at most one",
        ));
    }
    let name = value.to_str().map_err(|_| {
        ApiError::invalid(
            OBJECTIVE_HEADER,
            "the inference objective is not visible ASCII",
        )
    })?;
    state.tenants.objective(name).map(Some)
}

/// `continued`: the stored items a Responses request continues, read
/// before ([`super::stored::continued_items`]).
pub(super) fn prepare(
    state: &AppState,
    tenant: &Tenant,
    body: &[u8],
    endpoint: Endpoint,
    objective: Option<i32>,
    continued: Result<Vec<Value>, ApiError>,
) -> Result<Prepared, ApiError> {
    let mut echo = Value::Null;
    let mut to_store = None;
    let mut truncate = false;
    let object = match endpoint {
        Endpoint::Chat => parse_object(body, CHAT_FIELDS)?,
        Endpoint::Completions => parse_object(body, COMPLETION_FIELDS)?,
        Endpoint::Responses => {
            let object = parse_object(body, RESPONSES_FIELDS)?;
            let (translated, keep) = super::stored::translate(state, &object, continued)?;
            echo = translated.echo;
            to_store = keep;
            truncate = translated.truncate;
            translated.chat
        }
    };
    let params: CommonParams = typed(&object)?;
    let n = params.n()?;
    // Completions' `echo` with `logprobs` scores the prompt too: its
    // tokens lead the choice's log-probabilities.
    let mut echo_logprobs = None;
    // Prompts, with the text `echo` puts before each completion.
    let mut tools = None;
    let (prompts, logprobs): (Vec<Prompt>, Option<usize>) = match endpoint {
        Endpoint::Chat | Endpoint::Responses => {
            let chat: ChatFields = typed(&object)?;
            tools = chat.tools()?;
            let template = state.model.chat_template.as_ref().ok_or_else(|| {
                ApiError::invalid(
                    "messages",
                    "this model has no chat template; use /v1/completions (or start the server \
                     with --chat-template FILE)",
                )
            })?;
            // The template's markers become control tokens; what the
            // messages say never does (I9).
            let encode = |messages: &[kvfence_model::ChatMessage]| {
                template
                    .encode(&state.model.tokenizer, messages, true)
                    .map_err(|e| match e {
                        kvfence_model::ModelError::Tokenizer { .. } => {
                            ApiError::new(ErrorType::ServerError, "tokenizer_error", e.to_string())
                        }
                        _ => ApiError::invalid("messages", e.to_string()),
                    })
            };
            let messages = chat.messages(tools.as_ref())?;
            let mut ids = encode(&messages)?;
            // Room for the answer: what it asks for, or what a request
            // that asks for nothing gets.
            let room = params.max_tokens()?.unwrap_or_else(|| {
                state
                    .default_max_tokens
                    .min(tenant.limits().max_tokens.unwrap_or(usize::MAX))
            });
            let fits = |ids: &[u32]| ids.len() + room <= state.capacity.max_context;
            if truncate
                && !fits(&ids)
                && let Some(latest) = latest_turns_that_fit(&messages, fits, encode)?
            {
                ids = latest;
            }
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
            let logprobs = completion.logprobs()?;
            if echo {
                echo_logprobs = logprobs;
            }
            (prompts, logprobs)
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
    let format = params.grammar()?;
    if let Some(tools) = &tools {
        tools.check_schemas(state.grammars()?, tools.constrains_calls(format.is_some()))?;
    }
    // What a grammar that cannot be used is blamed on: each tool's schema
    // passed above, so a call-only grammar fails on the tools as a whole
    // (past the limits), any other on the format.
    let constraint_param = match &tools {
        Some(tools) if tools.calls_only() => "tools",
        _ => "response_format",
    };
    let constraint = match &tools {
        Some(tools) => tools.grammar(format)?,
        None => format,
    };
    // Compiled here, once per request, on this blocking thread: a bad
    // grammar — or one past the compiler's limits at its first mask — is a
    // 400 before any work, and the workers in this process start every
    // choice from a copy of this start state instead of compiling it again
    // on the scheduler thread all tenants share.
    let constraint = match constraint {
        Some(grammar) => {
            let cannot = |e: kvfence_model::ModelError| {
                ApiError::invalid(constraint_param, format!("the grammar cannot be used: {e}"))
            };
            let mut start = state.grammars()?.compile(&grammar).map_err(cannot)?;
            start.mask().map_err(cannot)?;
            Some(Constrained::compiled(grammar, start))
        }
        None => None,
    };
    let asked_prompt_logprobs = params.prompt_logprobs()?;
    let prompt_logprobs = asked_prompt_logprobs.max(echo_logprobs);
    let mut stop = params.stop_strings()?;
    if let Some(tools) = &tools {
        stop = stop.keeping(tools.kept_stops()).map_err(|_| {
            ApiError::invalid(
                "stop",
                "stop strings and the tool-call end together exceed the bound on stop bytes",
            )
        })?;
    }
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
    // Every worker it reaches learns that this front door serves several
    // tenants from its first request, not from a second tenant's (I11).
    let share = Share::new(tenant.name.clone(), tenant.weight)
        .with_priority(tenant.priority(&asked)?)
        .on_shared_workers(state.tenants.count() > 1);
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
                params.max_tokens_field(),
                max_context,
                prompt.len(),
                max_tokens,
            ));
        }
        for j in 0..n {
            // Choice j draws from its own seed: n choices are n samples.
            let seed = first_seed.wrapping_add(j as u64);
            // A prompt is scored once, by its first choice: the others read
            // it from the prefix cache, and show the first one's scores.
            let scored = prompt_logprobs.filter(|_| j == 0);
            choices.push(ChoiceRequest {
                request: GenerationRequest {
                    prompt: prompt.clone(),
                    max_tokens,
                    sampling: params.sampling(seed, logprobs, scored, vocab)?,
                    stop: stop.clone(),
                    ignore_eos: params.ignore_eos.unwrap_or(false),
                    cache: cache.clone(),
                    constraint: constraint.clone(),
                    share: share.clone(),
                    trace: None,
                },
                echo: echo.clone(),
            });
        }
    }
    Ok(Prepared {
        choices,
        tools: tools.map(Arc::new),
        echo,
        to_store,
        n,
        stream: params.stream(),
        include_usage: params.include_usage()?,
        logprobs: logprobs.is_some(),
        prompt_logprobs: PromptLogprobsWanted {
            echoed: echo_logprobs.is_some(),
            listed: asked_prompt_logprobs.is_some(),
        },
    })
}

/// `truncation: "auto"` (Responses): the prompt of the most recent turns
/// of `messages` that `fits` — the system message kept, the oldest turns
/// dropped whole, a tool's result never kept without the call before it —
/// or `None` when even the last turn alone does not. A binary search over
/// where the kept turns begin: each try renders and tokenizes them, a
/// dozen or so tries for the longest conversation a body can hold.
fn latest_turns_that_fit(
    messages: &[kvfence_model::ChatMessage],
    fits: impl Fn(&[u32]) -> bool,
    encode: impl Fn(&[kvfence_model::ChatMessage]) -> Result<Vec<u32>, ApiError>,
) -> Result<Option<Vec<u32>>, ApiError> {
    let head = usize::from(messages.first().is_some_and(|m| m.role == "system"));
    let starts: Vec<usize> = (head..messages.len())
        .filter(|&i| messages[i].role != "tool")
        .collect();
    let keeping = |start: usize| {
        let kept: Vec<kvfence_model::ChatMessage> = messages[..head]
            .iter()
            .chain(&messages[start..])
            .cloned()
            .collect();
        encode(&kept)
    };
    let Some(&last) = starts.last() else {
        return Ok(None);
    };
    let mut fitting = keeping(last)?;
    if !fits(&fitting) {
        return Ok(None);
    }
    // `fitting` is always the prompt from starts[hi], which fits; the
    // first start that fits is sought (earlier starts keep more turns).
    let (mut lo, mut hi) = (0, starts.len() - 1);
    while lo < hi {
        let mid = (lo + hi) / 2;
        let ids = keeping(starts[mid])?;
        if fits(&ids) {
            hi = mid;
            fitting = ids;
        } else {
            lo = mid + 1;
        }
    }
    Ok(Some(fitting))
}

pub(super) fn encode_prompt(state: &AppState, text: &str) -> Result<Vec<u32>, ApiError> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use kvfence_model::ChatMessage;

    fn message(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    /// A token per byte of the roles and contents kept, and which roles.
    fn encode(messages: &[ChatMessage]) -> Result<Vec<u32>, ApiError> {
        Ok(messages
            .iter()
            .flat_map(|m| m.role.bytes().chain(m.content.bytes()))
            .map(u32::from)
            .collect())
    }

    #[test]
    fn truncation_keeps_the_system_message_the_latest_turns_and_calls_with_their_results() {
        let conversation = [
            message("system", "S"),
            message("user", "aaaa"),
            message("assistant", "<call>"),
            message("tool", "r1"),
            message("tool", "r2"),
            message("user", "bbbb"),
            message("assistant", "<call>"),
            message("tool", "r3"),
        ];
        let kept = |limit: usize| {
            latest_turns_that_fit(&conversation, |ids| ids.len() <= limit, encode)
                .unwrap()
                .map(|ids| String::from_utf8(ids.iter().map(|&b| b as u8).collect()).unwrap())
        };
        let whole = encode(&conversation).unwrap().len();
        assert_eq!(
            kept(whole).unwrap().len(),
            whole,
            "nothing dropped when all fit"
        );
        // The last call and its result, never the result alone.
        let last = "systemSassistant<call>toolr3";
        assert_eq!(kept(last.len()).as_deref(), Some(last));
        assert_eq!(kept(last.len() - 1), None);
        // One byte short of keeping the call before: it goes with both its
        // results, and the next turn that may lead is the user's.
        let from_user = "systemSuserbbbbassistant<call>toolr3";
        let from_call = "systemSassistant<call>toolr1toolr2userbbbbassistant<call>toolr3";
        assert_eq!(kept(from_call.len() - 1).as_deref(), Some(from_user));
        assert_eq!(kept(from_call.len()).as_deref(), Some(from_call));
        // No system message: every turn may go.
        let plain = [message("user", "aaaa"), message("user", "b")];
        let one = latest_turns_that_fit(&plain, |ids| ids.len() <= 5, encode).unwrap();
        assert_eq!(one.map(|ids| ids.len()), Some(5));
    }
}
