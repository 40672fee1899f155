//! `/v1/chat/completions` and `/v1/completions`: one generation run shared by streaming and
//! non-streaming responses, so both give the same text for the same seed.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use ember_chat::{ParseEvent, ParsedOutput, ParserOptions, RenderRequest};
use ember_engine::{Event, EventSink, FinishReason, GenRequest, TokenLogprobs};
use futures_util::stream::{self, StreamExt};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::AppState;
use crate::error::ApiError;
use crate::output::TextPipeline;
use crate::request::{self, GenParams, Prompt};

/// Engine events into a tokio channel; closed when the response is dropped or a stop string
/// ended it, which frees the engine's sequence at its next step.
struct ChannelSink(mpsc::UnboundedSender<Event>);

impl EventSink for ChannelSink {
    fn send(&mut self, ev: Event) -> bool {
        self.0.send(ev).is_ok()
    }

    fn is_closed(&self) -> bool {
        self.0.is_closed()
    }
}

#[derive(Debug, Clone, Copy, Default)]
pub struct Usage {
    pub prompt: usize,
    pub completion: usize,
    pub cached: usize,
}

impl Usage {
    fn json(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt,
            "completion_tokens": self.completion,
            "total_tokens": self.prompt + self.completion,
            "prompt_tokens_details": { "cached_tokens": self.cached },
        })
    }
}

/// What one engine event turned into.
enum Step {
    Delta { events: Vec<ParseEvent>, logprobs: Vec<(u32, TokenLogprobs)> },
    Finish { events: Vec<ParseEvent>, reason: &'static str, usage: Usage },
}

/// Where chat messages end in a prompt: after each `<|im_end|>` and the newline that follows
/// it. A follow-up turn re-renders the same messages, so these are the places where its prompt
/// can diverge from this one (the prompt cache checkpoints them).
pub fn message_ends(tok: &ember_tokenizer::Tokenizer, ids: &[u32]) -> Vec<usize> {
    let Some(end) = tok.token_id("<|im_end|>") else { return Vec::new() };
    let newline = tok.encode("\n", false);
    let mut out = Vec::new();
    for (i, &t) in ids.iter().enumerate() {
        if t == end {
            let after = if newline.len() == 1 && ids.get(i + 1) == Some(&newline[0]) { i + 2 } else { i + 1 };
            out.push(after);
        }
    }
    out
}

/// One generation in flight.
struct Run {
    rx: mpsc::UnboundedReceiver<Event>,
    st: Arc<AppState>,
    text: TextPipeline,
    usage: Usage,
    t_start: Instant,
    t_last: Option<Instant>,
    done: bool,
    id: String,
}

/// A response dropped before its finish (the client left): a finish the engine had already
/// sent is counted here, so each request ends in the metrics once, as finished or as
/// cancelled (the engine counts a finish it could not deliver as cancelled).
impl Drop for Run {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        self.rx.close();
        while let Ok(ev) = self.rx.try_recv() {
            if let Event::Finished { reason, .. } = ev {
                self.st.metrics.count_finish(finish_name(reason));
            }
        }
    }
}

/// The API's finish reason of an engine finish (a stop string matched is "stop" too).
fn finish_name(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Eog => "stop",
        FinishReason::MaxTokens | FinishReason::ContextFull => "length",
    }
}

impl Run {
    /// Validates the prompt against the context, then queues it.
    fn start(st: &Arc<AppState>, ids: Vec<u32>, params: &GenParams, parser: Option<ParserOptions>, id: String) -> Result<Run, ApiError> {
        let t_start = Instant::now();
        let n_ctx = st.engine.config().n_ctx;
        if ids.is_empty() {
            return Err(ApiError::param("prompt", "the prompt is empty (it tokenizes to no tokens)"));
        }
        if ids.len() >= n_ctx {
            return Err(ApiError::param(
                "messages",
                format!("This model's maximum context length is {n_ctx} tokens, but the prompt has {} tokens (at least one token must be left for the completion).", ids.len()),
            )
            .with_code("context_length_exceeded"));
        }
        let room = n_ctx - ids.len();
        let max_tokens = params.max_tokens.map_or(room, |m| m.min(room));
        let prompt_ids = ids;
        let req = GenRequest {
            prompt: prompt_ids.clone(),
            sampler: params.sampler.clone(),
            max_tokens,
            eog: st.tokenizer.eog_ids().to_vec(),
            ignore_eos: params.ignore_eos,
            n_logprobs: params.logprobs,
            checkpoints: message_ends(&st.tokenizer, &prompt_ids),
        };
        let (tx, rx) = mpsc::unbounded_channel();
        st.engine.submit(req, Box::new(ChannelSink(tx))).map_err(|e| match e {
            ember_engine::Error::QueueFull { .. } => ApiError::busy(format!("{e}; retry later")),
            ember_engine::Error::TokenOutOfRange { .. } => ApiError::param("prompt", e.to_string()),
            ember_engine::Error::PromptTooLong { .. } | ember_engine::Error::EmptyPrompt | ember_engine::Error::Config { .. } => {
                ApiError::invalid(e.to_string())
            }
            ember_engine::Error::Stopped | ember_engine::Error::Backend(_) | ember_engine::Error::Sequence { .. } => {
                tracing::error!("submitting to the engine: {e}");
                ApiError::internal("the engine is not running")
            }
        })?;
        Ok(Run {
            rx,
            st: st.clone(),
            text: TextPipeline::new(params.stop.clone(), parser),
            usage: Usage::default(),
            t_start,
            t_last: None,
            done: false,
            id,
        })
    }

    /// Warnings are counted and logged here, never sent.
    fn keep(&self, events: Vec<ParseEvent>) -> Vec<ParseEvent> {
        events
            .into_iter()
            .filter(|e| match e {
                ParseEvent::Warning(w) => {
                    self.st.metrics.parse_warnings.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tracing::warn!(id = %self.id, "model output: {w}");
                    false
                }
                _ => true,
            })
            .collect()
    }

    fn finish(&mut self, mut events: Vec<ParseEvent>, reason: &'static str) -> Step {
        self.done = true;
        // Frees the engine's slot now if it is still generating (stop string).
        self.rx.close();
        let reason = if reason == "stop" && self.text.n_tool_calls() > 0 { "tool_calls" } else { reason };
        events = self.keep(events);
        let m = &self.st.metrics;
        m.tokens_prompt.fetch_add(self.usage.prompt as u64, std::sync::atomic::Ordering::Relaxed);
        m.tokens_generated.fetch_add(self.usage.completion as u64, std::sync::atomic::Ordering::Relaxed);
        m.count_finish(reason);
        let secs = self.t_start.elapsed().as_secs_f64();
        tracing::info!(id = %self.id, prompt = self.usage.prompt, completion = self.usage.completion, finish = reason, secs = format_args!("{secs:.3}"), "done");
        Step::Finish { events, reason, usage: self.usage }
    }

    /// The next step of the response; `None` after the finish.
    async fn next(&mut self) -> Option<Result<Step, ApiError>> {
        if self.done {
            return None;
        }
        loop {
            let Some(ev) = self.rx.recv().await else {
                self.done = true;
                tracing::error!(id = %self.id, "the engine dropped a request without finishing it");
                return Some(Err(ApiError::internal("generation failed")));
            };
            match ev {
                Event::Started { n_prompt, n_cached } => {
                    tracing::debug!(id = %self.id, "prompt {n_prompt} tokens: {n_cached} reused from the prompt-cache checkpoint at token {n_cached}, {} computed", n_prompt - n_cached);
                    self.usage.prompt = n_prompt;
                    self.usage.cached = n_cached;
                }
                Event::Token { id, logprobs } => {
                    let now = Instant::now();
                    match self.t_last {
                        None => self.st.metrics.ttft.observe(now - self.t_start),
                        Some(t) => self.st.metrics.per_token.observe(now - t),
                    }
                    self.t_last = Some(now);
                    self.usage.completion += 1;
                    let events = self.text.push_token(&self.st.tokenizer, id);
                    let logprobs: Vec<_> = logprobs.map(|l| (id, l)).into_iter().collect();
                    if self.text.stopped() {
                        // The stop string's own logprobs are not reported either.
                        return Some(Ok(self.finish(events, "stop")));
                    }
                    return Some(Ok(Step::Delta { events: self.keep(events), logprobs }));
                }
                Event::Finished { reason, n_prompt, n_generated } => {
                    self.usage.prompt = n_prompt;
                    self.usage.completion = n_generated;
                    let events = self.text.finish();
                    let reason = if self.text.stopped() { "stop" } else { finish_name(reason) };
                    return Some(Ok(self.finish(events, reason)));
                }
                Event::Failed(msg) => {
                    self.done = true;
                    tracing::error!(id = %self.id, "generation failed: {msg}");
                    return Some(Err(ApiError::internal("generation failed")));
                }
            }
        }
    }
}

/// Response metadata shared by every chunk.
struct Meta {
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
}

fn random_id(prefix: &str) -> String {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    format!("{prefix}{:016x}", h.finish())
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn token_text(st: &AppState, id: u32) -> (String, Vec<u8>) {
    let bytes = st.tokenizer.piece(id, true).to_vec();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// Chat `logprobs.content` entries.
fn chat_logprobs(st: &AppState, lps: &[(u32, TokenLogprobs)]) -> Value {
    let entry = |id: u32, lp: f32| {
        let (text, bytes) = token_text(st, id);
        json!({ "token": text, "logprob": finite(lp), "bytes": bytes })
    };
    let content: Vec<Value> = lps
        .iter()
        .map(|(id, l)| {
            let mut e = entry(*id, l.logprob);
            e["top_logprobs"] = Value::Array(l.top.iter().map(|&(t, lp)| entry(t, lp)).collect());
            e
        })
        .collect();
    json!({ "content": content })
}

/// Legacy completions `logprobs`.
fn completion_logprobs(st: &AppState, lps: &[(u32, TokenLogprobs)], offset: &mut usize) -> Value {
    let mut tokens = Vec::new();
    let mut token_logprobs = Vec::new();
    let mut top = Vec::new();
    let mut text_offset = Vec::new();
    for (id, l) in lps {
        let (text, _) = token_text(st, *id);
        text_offset.push(*offset);
        *offset += text.chars().count();
        tokens.push(text);
        token_logprobs.push(finite(l.logprob));
        let mut m = serde_json::Map::new();
        for &(t, lp) in &l.top {
            m.insert(token_text(st, t).0, finite(lp).into());
        }
        top.push(Value::Object(m));
    }
    json!({ "tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": text_offset })
}

/// JSON has no -inf: clamp like OpenAI's -9999.
fn finite(x: f32) -> f32 {
    if x.is_finite() { x } else { -9999.0 }
}

fn delta_of(ev: &ParseEvent) -> Option<Value> {
    Some(match ev {
        ParseEvent::Reasoning(s) => json!({ "reasoning_content": s }),
        ParseEvent::Content(s) => json!({ "content": s }),
        ParseEvent::ToolCallBegin { index, id, name } => {
            json!({ "tool_calls": [{ "index": index, "id": id, "type": "function", "function": { "name": name, "arguments": "" } }] })
        }
        ParseEvent::ToolCallArguments { index, delta } => json!({ "tool_calls": [{ "index": index, "function": { "arguments": delta } }] }),
        ParseEvent::ToolCallEnd { .. } | ParseEvent::Warning(_) => return None,
    })
}

fn sse_json(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

fn sse_error(e: &ApiError) -> SseEvent {
    sse_json(&e.body())
}

/// Renders the chat template; failures are the client's (400, naming the cause).
pub fn render_chat(
    st: &AppState,
    messages: &[Value],
    tools: Option<&Value>,
    kwargs: serde_json::Map<String, Value>,
) -> Result<String, ApiError> {
    let tpl = match (&st.template, &st.template_error) {
        (Some(t), _) => t,
        (None, Some(e)) => return Err(ApiError::internal(format!("the model's chat template does not compile: {e}"))),
        (None, None) => return Err(ApiError::invalid("the model has no chat template; use /v1/completions").with_code("no_chat_template")),
    };
    let req = RenderRequest {
        messages,
        tools,
        add_generation_prompt: true,
        kwargs,
        bos_token: st.bos_token.clone(),
        eos_token: st.eos_token.clone(),
    };
    tpl.render(&req).map_err(|e| {
        let msg = match e {
            ember_chat::Error::Template { message } => format!("chat template: {message}"),
            other => other.to_string(),
        };
        ApiError::invalid(msg).with_code("template_error")
    })
}

pub async fn chat_completions(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    match chat_inner(st, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn chat_inner(st: Arc<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let body = request::parse_body(&body)?;
    let req = request::chat(&body)?;
    st.check_model(req.model.as_deref())?;
    let prompt = render_chat(&st, &req.messages, req.tools.as_ref(), req.kwargs.clone())?;
    // Thinking on: the generation prompt ends by opening the think block.
    let reasoning = prompt.trim_end().ends_with("<think>");
    let ids = st.tokenizer.encode(&prompt, true);
    let opts = ParserOptions { reasoning, tools: req.tool_specs.clone(), parse_tool_calls: req.parse_tool_calls };
    let meta =
        Meta { id: random_id("chatcmpl-"), created: unix_now(), model: st.model_name.clone(), include_usage: req.params.include_usage };
    let mut run = Run::start(&st, ids, &req.params, Some(opts), meta.id.clone())?;
    if req.params.stream {
        return Ok(stream_chat(run, meta, req.params.logprobs.is_some()).into_response());
    }
    let mut out = ParsedOutput::default();
    let mut lps = Vec::new();
    loop {
        match run.next().await {
            None => return Err(ApiError::internal("generation ended without a finish")),
            Some(Err(e)) => return Err(e),
            Some(Ok(Step::Delta { events, logprobs })) => {
                events.into_iter().for_each(|e| out.apply(e));
                lps.extend(logprobs);
            }
            Some(Ok(Step::Finish { events, reason, usage })) => {
                events.into_iter().for_each(|e| out.apply(e));
                let mut message = json!({ "role": "assistant", "content": out.content });
                if out.content.is_empty() && !out.tool_calls.is_empty() {
                    message["content"] = Value::Null;
                }
                if let Some(r) = &out.reasoning {
                    message["reasoning_content"] = json!(r);
                }
                if !out.tool_calls.is_empty() {
                    message["tool_calls"] = out
                        .tool_calls
                        .iter()
                        .map(|c| json!({ "id": c.id, "type": "function", "function": { "name": c.name, "arguments": c.arguments } }))
                        .collect();
                }
                let logprobs = if req.params.logprobs.is_some() { chat_logprobs(&st, &lps) } else { Value::Null };
                let body = json!({
                    "id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
                    "choices": [{ "index": 0, "message": message, "logprobs": logprobs, "finish_reason": reason }],
                    "usage": usage.json(),
                });
                return Ok(Json(body).into_response());
            }
        }
    }
}

fn chat_chunk(meta: &Meta, delta: Value, finish: Option<&str>, logprobs: Option<Value>) -> Value {
    let mut c = json!({
        "id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
        "choices": [{ "index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish }],
    });
    if meta.include_usage {
        c["usage"] = Value::Null;
    }
    c
}

fn stream_chat(run: Run, meta: Meta, want_logprobs: bool) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let first = sse_json(&chat_chunk(&meta, json!({ "role": "assistant", "content": "" }), None, None));
    let st = run.st.clone();
    let rest = stream::unfold(Some((run, meta)), move |state| {
        let st = st.clone();
        async move {
            let (mut run, meta) = state?;
            let mut out = Vec::new();
            let mut finished = false;
            match run.next().await? {
                Err(e) => {
                    out.push(sse_error(&e));
                    finished = true;
                }
                Ok(Step::Delta { events, logprobs }) => {
                    let mut lp = (want_logprobs && !logprobs.is_empty()).then(|| chat_logprobs(&st, &logprobs));
                    for ev in &events {
                        if let Some(d) = delta_of(ev) {
                            out.push(sse_json(&chat_chunk(&meta, d, None, lp.take())));
                        }
                    }
                    if let Some(lp) = lp {
                        out.push(sse_json(&chat_chunk(&meta, json!({}), None, Some(lp))));
                    }
                }
                Ok(Step::Finish { events, reason, usage }) => {
                    for ev in &events {
                        if let Some(d) = delta_of(ev) {
                            out.push(sse_json(&chat_chunk(&meta, d, None, None)));
                        }
                    }
                    out.push(sse_json(&chat_chunk(&meta, json!({}), Some(reason), None)));
                    if meta.include_usage {
                        let c = json!({
                            "id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
                            "choices": [], "usage": usage.json(),
                        });
                        out.push(sse_json(&c));
                    }
                    out.push(SseEvent::default().data("[DONE]"));
                    finished = true;
                }
            }
            Some((out, (!finished).then_some((run, meta))))
        }
    });
    let s = stream::once(async move { vec![first] }).chain(rest).flat_map(|evs| stream::iter(evs.into_iter().map(Ok)));
    Sse::new(s)
}

pub async fn completions(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    match completions_inner(st, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn completions_inner(st: Arc<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let body = request::parse_body(&body)?;
    let req = request::completion(&body)?;
    st.check_model(req.model.as_deref())?;
    let ids = match &req.prompt {
        Prompt::Text(s) => st.tokenizer.encode(s, true),
        Prompt::Tokens(t) => t.clone(),
    };
    let meta = Meta { id: random_id("cmpl-"), created: unix_now(), model: st.model_name.clone(), include_usage: req.params.include_usage };
    let mut run = Run::start(&st, ids, &req.params, None, meta.id.clone())?;
    let want_logprobs = req.params.logprobs.is_some();
    if req.params.stream {
        return Ok(stream_completion(run, meta, want_logprobs).into_response());
    }
    let mut text = String::new();
    let mut lps = Vec::new();
    loop {
        match run.next().await {
            None => return Err(ApiError::internal("generation ended without a finish")),
            Some(Err(e)) => return Err(e),
            Some(Ok(Step::Delta { events, logprobs })) => {
                push_content(&mut text, events);
                lps.extend(logprobs);
            }
            Some(Ok(Step::Finish { events, reason, usage })) => {
                push_content(&mut text, events);
                let logprobs = if want_logprobs { completion_logprobs(&st, &lps, &mut 0) } else { Value::Null };
                let body = json!({
                    "id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
                    "choices": [{ "index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason }],
                    "usage": usage.json(),
                });
                return Ok(Json(body).into_response());
            }
        }
    }
}

fn push_content(text: &mut String, events: Vec<ParseEvent>) {
    for e in events {
        if let ParseEvent::Content(s) = e {
            text.push_str(&s);
        }
    }
}

fn completion_chunk(meta: &Meta, text: &str, finish: Option<&str>, logprobs: Option<Value>) -> Value {
    let mut c = json!({
        "id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
        "choices": [{ "index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish }],
    });
    if meta.include_usage {
        c["usage"] = Value::Null;
    }
    c
}

fn stream_completion(run: Run, meta: Meta, want_logprobs: bool) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let st = run.st.clone();
    let s = stream::unfold(Some((run, meta, 0usize)), move |state| {
        let st = st.clone();
        async move {
            let (mut run, meta, mut offset) = state?;
            let mut out = Vec::new();
            let mut finished = false;
            match run.next().await? {
                Err(e) => {
                    out.push(sse_error(&e));
                    finished = true;
                }
                Ok(Step::Delta { events, logprobs }) => {
                    let mut text = String::new();
                    push_content(&mut text, events);
                    let lp = (want_logprobs && !logprobs.is_empty()).then(|| completion_logprobs(&st, &logprobs, &mut offset));
                    if !text.is_empty() || lp.is_some() {
                        out.push(sse_json(&completion_chunk(&meta, &text, None, lp)));
                    }
                }
                Ok(Step::Finish { events, reason, usage }) => {
                    let mut text = String::new();
                    push_content(&mut text, events);
                    out.push(sse_json(&completion_chunk(&meta, &text, Some(reason), None)));
                    if meta.include_usage {
                        let c = json!({
                            "id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
                            "choices": [], "usage": usage.json(),
                        });
                        out.push(sse_json(&c));
                    }
                    out.push(SseEvent::default().data("[DONE]"));
                    finished = true;
                }
            }
            Some((out, (!finished).then_some((run, meta, offset))))
        }
    })
    .flat_map(|evs| stream::iter(evs.into_iter().map(Ok)));
    Sse::new(s)
}
