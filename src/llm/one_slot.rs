//! A test server with one slot, as llama.cpp's server runs by default: a
//! request waits behind the one being served (40 ms each). The client's
//! tests use it to show that its concurrency limit, new or resumed, settles
//! where such a server keeps up and that no call times out on the way.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::{Router, extract::State, response::IntoResponse, routing::post};
use serde_json::json;

/// A running one-slot server; clones share its counts.
#[derive(Clone, Default)]
pub(crate) struct OneSlotServer {
    slot: Arc<tokio::sync::Mutex<()>>,
    waiting: Arc<AtomicUsize>,
    most_waiting: Arc<AtomicUsize>,
}

impl OneSlotServer {
    /// Starts one on a free port; returns its base URL (`…/v1`) and itself.
    pub(crate) async fn spawn() -> (String, Self) {
        let state = Self::default();
        let app = Router::new().route("/v1/chat/completions", post(serve)).with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        (format!("http://{addr}/v1"), state)
    }

    /// The most requests that were ever waiting or being served at once.
    pub(crate) fn most_waiting(&self) -> usize {
        self.most_waiting.load(Ordering::SeqCst)
    }
}

async fn serve(State(s): State<OneSlotServer>) -> axum::response::Response {
    let now = s.waiting.fetch_add(1, Ordering::SeqCst) + 1;
    s.most_waiting.fetch_max(now, Ordering::SeqCst);
    let _served = s.slot.lock().await;
    tokio::time::sleep(Duration::from_millis(40)).await;
    s.waiting.fetch_sub(1, Ordering::SeqCst);
    let body = json!({"model": "m", "choices": [{"message": {"content": "{}"}}],
                      "usage": {"prompt_tokens": 100, "completion_tokens": 20}});
    axum::Json(body).into_response()
}
