//! ember-server: the OpenAI-compatible HTTP API (axum). Validates requests into typed ones,
//! renders chat prompts, hands token ids to the engine, and turns the ids that come back into
//! SSE chunks or JSON responses (detokenizing, stop strings, reasoning/tool-call parsing).
//! Never touches tensors.
//!
//! The decision a reader would question: the server talks to the engine through an
//! [`ember_engine::EventSink`] that pushes into an unbounded tokio channel per request, not a
//! bounded one. The engine thread must never block on a slow client (that would stall every
//! other sequence in the batch); a request's backlog is bounded anyway by its `max_tokens`, and
//! a client that leaves closes the channel, which frees its sequence at the next step.
#![forbid(unsafe_code)]

mod error;
mod generate;
mod messages;
mod metrics;
mod output;
mod request;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderValue, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use ember_chat::ChatTemplate;
use ember_engine::EngineHandle;
use ember_tokenizer::Tokenizer;
use serde_json::{Value, json};

pub use error::ApiError;
pub use generate::message_ends;
pub use messages::map_messages;
pub use metrics::Metrics;
pub use output::{StopMatcher, TextPipeline};

/// Largest request body accepted (long prompts are large).
const MAX_BODY_BYTES: usize = 64 << 20;

/// Everything the handlers share.
pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Option<ChatTemplate>,
    /// Why the GGUF's template did not compile, if it did not.
    pub template_error: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// The name `/v1/models` lists; requests naming another model get a 404.
    pub model_name: String,
    pub api_key: Option<String>,
    pub metrics: Metrics,
    pub created: u64,
    /// Extra facts for `/v1/models` (`meta`).
    pub model_meta: Value,
}

impl AppState {
    /// `template_src`: the GGUF's `tokenizer.chat_template`, if any.
    pub fn new(
        engine: EngineHandle,
        tokenizer: Tokenizer,
        template_src: Option<&str>,
        model_name: String,
        api_key: Option<String>,
        model_meta: Value,
    ) -> Self {
        let (template, template_error) = match template_src.map(ChatTemplate::new) {
            None => (None, None),
            Some(Ok(t)) => (Some(t), None),
            Some(Err(e)) => {
                tracing::warn!("the model's chat template does not compile ({e}); /v1/chat/completions will fail");
                (None, Some(e.to_string()))
            }
        };
        let text = |id: Option<u32>| id.map(|i| String::from_utf8_lossy(tokenizer.piece(i, true)).into_owned());
        let (bos_token, eos_token) = (text(tokenizer.bos_id()), text(tokenizer.eos_id()));
        AppState {
            engine,
            tokenizer: Arc::new(tokenizer),
            template,
            template_error,
            bos_token,
            eos_token,
            model_name,
            api_key,
            metrics: Metrics::default(),
            created: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
            model_meta,
        }
    }

    /// A request may omit `model` (llama-server does not need it); a wrong one is a 404.
    fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if m != self.model_name => Err(ApiError::model_not_found(m)),
            _ => Ok(()),
        }
    }
}

/// The routes, with auth and request counting.
pub fn router(state: Arc<AppState>) -> Router {
    let [chat, chat2, cmpl, cmpl2, models_, models2, health_, metrics_, tok, detok, tpl] = ROUTES;
    Router::new()
        .route(chat, post(generate::chat_completions))
        .route(chat2, post(generate::chat_completions))
        .route(cmpl, post(generate::completions))
        .route(cmpl2, post(generate::completions))
        .route(models_, get(models))
        .route(models2, get(models))
        .route(health_, get(health))
        .route(metrics_, get(metrics))
        .route(tok, post(tokenize))
        .route(detok, post(detokenize))
        .route(tpl, post(apply_template))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .layer(middleware::from_fn_with_state(state.clone(), count))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// Serves until `shutdown` resolves, then stops accepting and lets running requests finish
/// for at most `grace`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> std::io::Result<()> {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = axum::serve(listener, router(state)).with_graceful_shutdown(async move {
        shutdown.await;
        tracing::info!("shutting down: no new connections; waiting up to {} s for running requests", grace.as_secs());
        let _ = tx.send(());
    });
    let deadline = async move {
        if rx.await.is_ok() {
            tokio::time::sleep(grace).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        r = server => r,
        () = deadline => {
            tracing::warn!("requests still running after {} s; exiting anyway", grace.as_secs());
            Ok(())
        }
    }
}

/// `Authorization: Bearer KEY` on everything but `/health` when a key is set.
async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.api_key
        && req.uri().path() != "/health"
    {
        let got = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        match got.and_then(|v| v.strip_prefix("Bearer ")) {
            None => return ApiError::unauthorized("Missing API key: send it as `Authorization: Bearer KEY`.").into_response(),
            Some(k) if !same(k.trim().as_bytes(), key.as_bytes()) => {
                return ApiError::unauthorized("Incorrect API key provided.").into_response();
            }
            Some(_) => {}
        }
    }
    next.run(req).await
}

/// Comparison in time independent of where the first difference is.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The routes, for `/metrics` labels (any other path counts as "other").
const ROUTES: [&str; 11] = [
    "/v1/chat/completions",
    "/chat/completions",
    "/v1/completions",
    "/completions",
    "/v1/models",
    "/models",
    "/health",
    "/metrics",
    "/tokenize",
    "/detokenize",
    "/apply-template",
];

/// Counts requests by route and status for `/metrics`.
async fn count(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let endpoint = ROUTES.iter().find(|r| **r == path).copied().unwrap_or("other");
    let resp = next.run(req).await;
    st.metrics.count_request(endpoint, resp.status().as_u16());
    resp
}

async fn not_found(req: Request) -> ApiError {
    ApiError::not_found(format!("no route for {} {}", req.method(), req.uri().path()))
}

async fn health() -> Json<Value> {
    Json(json!({ "status": "ok" }))
}

async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{ "id": st.model_name, "object": "model", "created": st.created, "owned_by": "ember", "meta": st.model_meta }],
    }))
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let text = st.metrics.render(st.engine.stats(), st.engine.config().n_parallel);
    let mut resp = text.into_response();
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"));
    resp
}

async fn tokenize(State(st): State<Arc<AppState>>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let req = request::tokenize(&request::parse_body(&body)?)?;
    let ids = st.tokenizer.encode(&req.content, req.parse_special);
    if !req.with_pieces {
        return Ok(Json(json!({ "tokens": ids })));
    }
    let tokens: Vec<Value> = ids
        .iter()
        .map(|&id| {
            let bytes = st.tokenizer.piece(id, true);
            // llama-server: the piece as a string when it is valid UTF-8, else its bytes.
            let piece = match std::str::from_utf8(bytes) {
                Ok(s) => json!(s),
                Err(_) => json!(bytes),
            };
            json!({ "id": id, "piece": piece })
        })
        .collect();
    Ok(Json(json!({ "tokens": tokens })))
}

async fn detokenize(State(st): State<Arc<AppState>>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let ids = request::detokenize(&request::parse_body(&body)?)?;
    let n_vocab = st.tokenizer.n_vocab();
    if let Some((i, id)) = ids.iter().enumerate().find(|&(_, &id)| id as usize >= n_vocab) {
        return Err(ApiError::param(
            &format!("tokens[{i}]"),
            format!("token id {id} is out of range (the vocabulary has {n_vocab} tokens)"),
        ));
    }
    let text = String::from_utf8_lossy(&st.tokenizer.decode(&ids, true)).into_owned();
    Ok(Json(json!({ "content": text })))
}

async fn apply_template(State(st): State<Arc<AppState>>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let body = request::parse_body(&body)?;
    let t = request::template_input(&body)?;
    let prompt = generate::render_chat(&st, &t.messages, t.tools.as_ref(), t.kwargs)?;
    Ok(Json(json!({ "prompt": prompt })))
}
