//! `oato serve`: an OpenAI-compatible HTTP server (axum on tokio). The model is loaded once on an
//! engine thread ([`worker`]), which decodes up to `--parallel` requests together in one batch;
//! the others wait for it in a bounded queue (a full queue is a 503 with `Retry-After`). Each is
//! streamed over server-sent events or answered whole, and a client that disconnects cancels its
//! generation. `/health` says loading or ready, `/metrics` gives Prometheus text, `/v1/models`
//! the one model.

pub mod api;
pub mod metrics;
pub mod stop;
pub mod worker;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use crate::error::{Error, Result};

use api::{ApiError, Endpoint};
use metrics::Metrics;
use worker::{EngineSpec, Event, Job};

/// What `oato serve` was asked for.
pub struct ServeConfig {
    pub engine: EngineSpec,
    /// The model's name in responses and `/v1/models`.
    pub model_name: String,
    pub host: String,
    pub port: u16,
    /// Requests that may wait while `--parallel` run; more get 503.
    pub queue: usize,
    /// Seconds a client told 503 should wait (`Retry-After`).
    pub retry_after_s: u64,
}

struct AppState {
    jobs: Mutex<Option<SyncSender<Job>>>,
    metrics: Arc<Metrics>,
    model_name: String,
    n_ctx: usize,
    retry_after_s: u64,
    next_id: AtomicU64,
    started: u64,
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Binds, prints `listening on http://ADDR` on stdout, loads the model on the engine thread and
/// serves until Ctrl-C (or SIGTERM); an error when the address cannot be bound or the model
/// cannot be loaded.
pub fn serve(cfg: ServeConfig) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::Msg(format!("cannot start the async runtime: {e}")))?;
    rt.block_on(serve_async(cfg))
}

async fn serve_async(cfg: ServeConfig) -> Result<()> {
    let addr = format!("{}:{}", cfg.host, cfg.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|e| Error::Usage(format!("cannot listen on {addr}: {e}")))?;
    let bound: SocketAddr = listener
        .local_addr()
        .map_err(|e| Error::Msg(format!("the bound address of {addr}: {e}")))?;
    {
        use std::io::Write;
        let mut out = std::io::stdout();
        let _ = writeln!(out, "listening on http://{bound}");
        let _ = out.flush();
    }
    eprintln!("oato: loading {} ...", cfg.engine.path.display());

    let metrics = Arc::new(Metrics::default());
    metrics.queue_capacity.store(cfg.queue, Ordering::Relaxed);
    let (tx, rx) = std::sync::mpsc::sync_channel::<Job>(cfg.queue);
    let n_ctx = cfg.engine.place.ctx;
    let (failed_tx, failed_rx) = tokio::sync::oneshot::channel::<Error>();
    let shutdown = Arc::new(AtomicBool::new(false));
    {
        let metrics = metrics.clone();
        let spec = cfg.engine;
        let shutdown = shutdown.clone();
        std::thread::Builder::new()
            .name("oato-engine".into())
            .spawn(move || {
                if let Err(e) = worker::run(spec, rx, metrics, shutdown) {
                    let _ = failed_tx.send(e);
                }
            })
            .map_err(|e| Error::Msg(format!("cannot start the engine thread: {e}")))?;
    }
    let state = Arc::new(AppState {
        jobs: Mutex::new(Some(tx)),
        metrics,
        model_name: cfg.model_name,
        n_ctx,
        retry_after_s: cfg.retry_after_s,
        next_id: AtomicU64::new(1),
        started: unix_now(),
    });
    let app = router(state.clone());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = axum::serve(listener, app).with_graceful_shutdown(async move {
        let _ = stop_rx.await;
    });
    let server = tokio::spawn(async move { server.await });
    let result = tokio::select! {
        e = failed_rx => match e {
            Ok(e) => Err(e),
            Err(_) => Ok(()),
        },
        _ = shutdown_signal() => {
            eprintln!("oato: shutting down");
            Ok(())
        }
    };
    // The running generation stops, the waiting requests fail, and closing the queue ends the
    // engine thread.
    shutdown.store(true, Ordering::Relaxed);
    if let Ok(mut j) = state.jobs.lock() {
        j.take();
    }
    let _ = stop_tx.send(());
    let _ = server.await;
    result
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {},
                    _ = term.recv() => {},
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// A JSON response, counted in the metrics by status.
fn reply(state: &AppState, status: u16, body: Value) -> Response {
    state.metrics.response(status);
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (code, axum::Json(body)).into_response()
}

fn error_reply(state: &AppState, e: &ApiError) -> Response {
    let mut r = reply(state, e.status, e.body());
    if e.status == 503
        && let Ok(v) = HeaderValue::from_str(&state.retry_after_s.to_string())
    {
        r.headers_mut().insert(header::RETRY_AFTER, v);
    }
    r
}

async fn not_found(State(state): State<Arc<AppState>>) -> Response {
    let e = ApiError {
        status: 404,
        message: "Unknown endpoint: this server has /v1/chat/completions, /v1/completions, \
                  /v1/models, /health and /metrics"
            .into(),
        kind: "invalid_request_error",
        param: None,
        code: Some("unknown_url".into()),
    };
    error_reply(&state, &e)
}

async fn method_not_allowed(State(state): State<Arc<AppState>>) -> Response {
    let e = ApiError {
        status: 405,
        message: "Method not allowed: the /v1 completion endpoints take POST, the others GET"
            .into(),
        kind: "invalid_request_error",
        param: None,
        code: Some("method_not_allowed".into()),
    };
    error_reply(&state, &e)
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    if state.metrics.is_ready() {
        reply(&state, 200, json!({"status": "ready"}))
    } else {
        let mut r = reply(&state, 503, json!({"status": "loading"}));
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        r
    }
}

async fn metrics_text(State(state): State<Arc<AppState>>) -> Response {
    state.metrics.response(200);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    let body = json!({
        "object": "list",
        "data": [{
            "id": state.model_name,
            "object": "model",
            "created": state.started,
            "owned_by": "oato",
        }],
    });
    reply(&state, 200, body)
}

type Body = std::result::Result<Bytes, BytesRejection>;

async fn chat_completions(State(state): State<Arc<AppState>>, body: Body) -> Response {
    generation(state, Endpoint::Chat, body).await
}

async fn completions(State(state): State<Arc<AppState>>, body: Body) -> Response {
    generation(state, Endpoint::Completion, body).await
}

/// Sets the flag when dropped: the handler's future or the event stream is gone, so the client
/// is.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

fn unavailable(message: &str, code: &str) -> ApiError {
    ApiError {
        status: 503,
        message: message.into(),
        kind: "server_error",
        param: None,
        code: Some(code.into()),
    }
}

fn engine_error(message: String) -> ApiError {
    ApiError {
        status: 500,
        message,
        kind: "server_error",
        param: None,
        code: None,
    }
}

async fn generation(state: Arc<AppState>, endpoint: Endpoint, body: Body) -> Response {
    let body = match body {
        Ok(b) => b,
        // Too large (over 2 MiB), or not readable.
        Err(e) => {
            let mut err = ApiError::invalid(e.body_text(), None);
            err.status = e.status().as_u16();
            return error_reply(&state, &err);
        }
    };
    let req = match api::parse(&body, endpoint, state.n_ctx) {
        Ok(r) => r,
        Err(e) => return error_reply(&state, &e),
    };
    if !state.metrics.is_ready() {
        return error_reply(
            &state,
            &unavailable("The model is still loading; retry shortly", "loading"),
        );
    }
    let cancel = Arc::new(AtomicBool::new(false));
    let guard = CancelOnDrop(cancel.clone());
    let (events_tx, mut events) = unbounded_channel();
    let job = Job {
        prompt: req.prompt,
        sampling: req.sampling,
        max_tokens: req.max_tokens,
        stop: req.stop,
        ignore_eos: req.ignore_eos,
        cancel,
        events: events_tx,
        enqueued: Instant::now(),
    };
    let sent = match state.jobs.lock() {
        Ok(j) => match j.as_ref() {
            Some(tx) => {
                // Counted before it can be taken off, so the depth never goes below zero.
                state.metrics.queued();
                let r = tx.try_send(job);
                if r.is_err() {
                    state.metrics.dequeued();
                }
                r
            }
            None => Err(TrySendError::Disconnected(job)),
        },
        Err(_) => Err(TrySendError::Disconnected(job)),
    };
    match sent {
        Ok(()) => {}
        Err(TrySendError::Full(_)) => {
            return error_reply(
                &state,
                &unavailable(
                    "The server is busy: too many requests are waiting; retry after the \
                     Retry-After seconds",
                    "queue_full",
                ),
            );
        }
        Err(TrySendError::Disconnected(_)) => {
            return error_reply(
                &state,
                &unavailable("The server is shutting down", "shutting_down"),
            );
        }
    }
    // The first event says whether it runs.
    match events.recv().await {
        Some(Event::Started { .. }) => {}
        Some(Event::Rejected {
            message,
            param,
            code,
        }) => {
            let mut e = ApiError::invalid(message, param);
            e.code = code.map(str::to_string);
            return error_reply(&state, &e);
        }
        Some(Event::Failed(m)) => return error_reply(&state, &engine_error(m)),
        _ => {
            return error_reply(
                &state,
                &engine_error("the engine stopped before the request ran".into()),
            );
        }
    }
    let n = state.next_id.fetch_add(1, Ordering::Relaxed);
    let id = match endpoint {
        Endpoint::Chat => format!("chatcmpl-{n}"),
        Endpoint::Completion => format!("cmpl-{n}"),
    };
    let created = unix_now();
    if req.stream {
        state.metrics.response(200);
        let mut stream = SseStream {
            events,
            _guard: guard,
            endpoint,
            id,
            created,
            model: state.model_name.clone(),
            include_usage: req.include_usage,
            pending: VecDeque::new(),
            over: false,
        };
        if endpoint == Endpoint::Chat {
            let role = stream.chunk(None, None);
            stream.pending.push_back(role);
        }
        let s = futures_util::stream::unfold(stream, |mut s| async move {
            let ev = s.next().await?;
            Some((Ok::<_, Infallible>(ev), s))
        });
        return Sse::new(s).keep_alive(KeepAlive::default()).into_response();
    }
    let mut text = String::new();
    loop {
        match events.recv().await {
            Some(Event::Text(t)) => text.push_str(&t),
            Some(Event::Done(o)) => {
                drop(guard);
                let body = api::response(endpoint, &id, created, &state.model_name, &text, &o);
                return reply(&state, 200, body);
            }
            Some(Event::Failed(m)) => return error_reply(&state, &engine_error(m)),
            _ => {
                return error_reply(
                    &state,
                    &engine_error("the engine stopped during the request".into()),
                );
            }
        }
    }
}

/// The server-sent events of one streamed response.
struct SseStream {
    events: UnboundedReceiver<Event>,
    _guard: CancelOnDrop,
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    /// Events to send before reading the engine's next one.
    pending: VecDeque<SseEvent>,
    /// The engine's events are over (`pending` holds the last ones).
    over: bool,
}

impl SseStream {
    fn data(v: &Value) -> SseEvent {
        SseEvent::default().data(v.to_string())
    }

    fn chunk(&self, text: Option<&str>, finish: Option<&str>) -> SseEvent {
        Self::data(&api::chunk(
            self.endpoint,
            &self.id,
            self.created,
            &self.model,
            text,
            finish,
        ))
    }

    /// The next event to send, `None` at the end.
    async fn next(&mut self) -> Option<SseEvent> {
        if let Some(e) = self.pending.pop_front() {
            return Some(e);
        }
        if self.over {
            return None;
        }
        let ev = match self.events.recv().await {
            Some(Event::Text(t)) => return Some(self.chunk(Some(&t), None)),
            Some(Event::Done(o)) => {
                let finish = self.chunk(None, Some(o.finish_reason()));
                if self.include_usage {
                    // As OpenAI: a last chunk with no choices and the usage.
                    let mut u = api::chunk(
                        self.endpoint,
                        &self.id,
                        self.created,
                        &self.model,
                        None,
                        None,
                    );
                    u["choices"] = json!([]);
                    u["usage"] = api::usage(&o);
                    self.pending.push_back(Self::data(&u));
                }
                finish
            }
            Some(Event::Failed(m)) => Self::data(&engine_error(m).body()),
            _ => Self::data(&engine_error("the engine stopped during the request".into()).body()),
        };
        self.over = true;
        self.pending.push_back(SseEvent::default().data("[DONE]"));
        Some(ev)
    }
}
