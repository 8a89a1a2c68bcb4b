//! What a local server holds at once, as it says itself, and the admission of
//! calls into the context its slots share.
//!
//! llama.cpp's server describes itself at `GET /props` (beside `/v1`):
//! `total_slots`, how many calls it works on at once, and
//! `default_generation_settings.n_ctx`, the context of a slot. Started on its
//! defaults (`llama-server -m model.gguf`) it has four slots sharing one KV
//! cache of that size, so four long answers at once fill it and it fails
//! every call it was working on ("Context size has been exceeded."). The
//! client reads `/props` once per backend; then it keeps at most
//! `total_slots` calls in flight, fits each call's completion limit to
//! n_ctx, and admits a call only while the prompts and completion limits of
//! the calls in flight fit in n_ctx together ([`SharedContext`]; a call that
//! alone needs more is sent alone).
//!
//! It also says how it samples by default (`default_generation_settings.params`).
//! Started on its defaults it applies no repetition penalty at all (its
//! `repeat_penalty` is 1.0, `frequency_penalty`, `presence_penalty` and DRY
//! off), and a small model then repeats a phrase until the completion limit:
//! every call takes its longest and its answer is refused. For such a server
//! the client asks for [`REPEAT_PENALTY`] in each request (llama.cpp's
//! extension of the chat request), what llama-cpp-python's server applies by
//! default; a server that sets any penalty itself is left as it is.
//!
//! `/props` does not say whether the slots share the cache. They do on
//! llama.cpp's defaults, which is what is assumed: a server started with an
//! explicit `-np` splits its context between the slots and reports a slot's
//! share, so there the budget is conservative (no call fails, fewer run at
//! once than could). Servers without `/props` (llama-cpp-python, Ollama, vLLM,
//! hosted APIs) answer it with an error and are left to the adaptive limit
//! ([`super::limit`]), which also learns from a full cache.

use std::sync::{
    Mutex,
    atomic::{AtomicU64, Ordering},
};

use serde::Deserialize;
use tokio::sync::Notify;

use super::config::DEFAULT_BASE_URL;

/// The repetition penalty asked of a llama.cpp server that applies none by
/// itself (llama-cpp-python's server's default).
pub const REPEAT_PENALTY: f32 = 1.1;

/// What a server says it holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerProps {
    /// Calls it works on at once.
    pub slots: Option<u32>,
    /// Tokens of context a slot has (all slots together, when they share it).
    pub context_tokens: Option<u32>,
    /// It said how it samples, and it penalises no repetition at all.
    pub no_repetition_penalty: bool,
    /// It is llama.cpp's server (it describes its default generation): it
    /// turns an answer's JSON schema into a grammar that holds `maxLength`
    /// and `maxItems`, so those are sent (OpenAI's strict mode refuses them;
    /// without them a small model on llama-server repeated one operation
    /// until its 2,048-token limit, three answers of three in a round).
    pub holds_schema_lengths: bool,
}

#[derive(Deserialize)]
struct WireProps {
    #[serde(default)]
    total_slots: Option<u32>,
    #[serde(default)]
    default_generation_settings: Option<WireGeneration>,
}

#[derive(Deserialize)]
struct WireGeneration {
    #[serde(default)]
    n_ctx: Option<u32>,
    #[serde(default)]
    params: Option<WireSampling>,
}

/// The default sampling a llama.cpp server reports; a setting it leaves out counts as set.
#[derive(Deserialize)]
struct WireSampling {
    #[serde(default = "set")]
    repeat_penalty: f64,
    #[serde(default = "set")]
    frequency_penalty: f64,
    #[serde(default = "set")]
    presence_penalty: f64,
    #[serde(default = "set")]
    dry_multiplier: f64,
}

fn set() -> f64 {
    f64::NAN
}

impl WireSampling {
    fn penalises_nothing(&self) -> bool {
        // NaN (left out) compares false: unknown counts as a penalty set.
        self.repeat_penalty <= 1.0
            && self.frequency_penalty == 0.0
            && self.presence_penalty == 0.0
            && self.dry_multiplier == 0.0
    }
}

/// Where a server at `base_url` (…/v1) describes itself; none for OpenAI's own
/// API, which has no such page.
pub fn props_url(base_url: &str) -> Option<String> {
    let base = base_url.trim_end_matches('/');
    if base.eq_ignore_ascii_case(DEFAULT_BASE_URL) {
        return None;
    }
    let root = base.strip_suffix("/v1").unwrap_or(base);
    Some(format!("{root}/props"))
}

/// Reads a `/props` answer; `None` when it is not llama.cpp's shape (another
/// server's page, an error) or says nothing usable.
pub fn parse_props(body: &[u8]) -> Option<ServerProps> {
    let wire: WireProps = serde_json::from_slice(body).ok()?;
    let generation = wire.default_generation_settings;
    let props = ServerProps {
        slots: wire.total_slots.filter(|n| *n >= 1),
        context_tokens: generation.as_ref().and_then(|g| g.n_ctx).filter(|n| *n >= 256),
        no_repetition_penalty: generation
            .as_ref()
            .and_then(|g| g.params.as_ref())
            .is_some_and(WireSampling::penalises_nothing),
        holds_schema_lengths: generation.is_some(),
    };
    (props != ServerProps::default()).then_some(props)
}

/// The context a server's slots share, as a budget of tokens for the calls in
/// flight: each is admitted with its prompt and completion limit while they
/// fit together. Unknown (0), it admits every call.
#[derive(Debug, Default)]
pub struct SharedContext {
    state: Mutex<ContextLedger>,
    freed: Notify,
}

#[derive(Debug, Default)]
struct ContextLedger {
    /// The shared context's size; 0 while unknown.
    tokens: u64,
    /// Tokens held by the calls admitted and not yet answered.
    held: u64,
    calls: usize,
}

/// A call's share of the shared context; dropping it frees the share.
#[derive(Debug)]
pub struct Admission<'a> {
    owner: &'a SharedContext,
    tokens: u64,
}

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        if let Ok(mut b) = self.owner.state.lock() {
            b.held = b.held.saturating_sub(self.tokens);
            b.calls = b.calls.saturating_sub(1);
        }
        self.owner.freed.notify_waiters();
    }
}

impl SharedContext {
    /// The server said how large the shared context is.
    pub fn set_tokens(&self, tokens: u32) {
        if let Ok(mut b) = self.state.lock() {
            b.tokens = u64::from(tokens);
        }
        self.freed.notify_waiters();
    }

    pub fn tokens(&self) -> Option<u32> {
        self.state.lock().ok().and_then(|b| u32::try_from(b.tokens).ok()).filter(|t| *t > 0)
    }

    /// Waits until a call needing `tokens` (its prompt and completion limit)
    /// fits beside the calls admitted, or none is.
    pub async fn admit(&self, tokens: u64) -> Admission<'_> {
        loop {
            let notified = self.freed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match self.state.lock() {
                Ok(mut b) => {
                    if b.tokens == 0 || b.calls == 0 || b.held + tokens <= b.tokens {
                        b.held += tokens;
                        b.calls += 1;
                        return Admission { owner: self, tokens };
                    }
                }
                // A panic elsewhere poisoned the state: admit, as with no budget.
                Err(_) => return Admission { owner: self, tokens: 0 },
            }
            notified.await;
        }
    }
}

/// How many tokens a server makes of a prompt, learned from what it reports.
/// A prompt counts at least one token per three characters (small models'
/// tokenizers cut finer than four), and as finely as the finest cut the server
/// reported (JSON and numbers cut finer still), plus the chat template's, so
/// the prompt's share of a shared context and of a context window is not
/// under-counted.
#[derive(Debug, Default)]
pub struct PromptTokens {
    /// Tokens per thousand characters, the largest seen; 0 until one is.
    per_kilochar: AtomicU64,
}

/// What a chat template adds to a request's messages (roles, turn markers).
const TEMPLATE_TOKENS: u64 = 16;
/// Prompts shorter than this tell little of the rate: the template dominates them.
const MIN_OBSERVED_CHARS: usize = 400;
/// One token per character is as fine as any tokenizer cuts text.
const MAX_PER_KILOCHAR: u64 = 1_000;

impl PromptTokens {
    /// The tokens a prompt of `chars` characters is counted as.
    pub fn of(&self, chars: usize) -> u64 {
        let chars = u64::try_from(chars).unwrap_or(u64::MAX);
        let seen = chars.saturating_mul(self.per_kilochar.load(Ordering::Relaxed)).div_ceil(1000);
        chars.div_ceil(3).max(seen) + TEMPLATE_TOKENS
    }

    /// The server counted `prompt_tokens` for a prompt of `chars` characters.
    pub fn observe(&self, chars: usize, prompt_tokens: u64) {
        if chars < MIN_OBSERVED_CHARS {
            return;
        }
        let chars = u64::try_from(chars).unwrap_or(u64::MAX);
        let rate = (prompt_tokens.saturating_sub(TEMPLATE_TOKENS).saturating_mul(1000)).div_ceil(chars);
        self.per_kilochar.fetch_max(rate.min(MAX_PER_KILOCHAR), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn props_are_read_from_llama_cpps_answer() {
        assert_eq!(props_url("http://127.0.0.1:8080/v1"), Some("http://127.0.0.1:8080/props".into()));
        assert_eq!(props_url("http://127.0.0.1:8080/v1/"), Some("http://127.0.0.1:8080/props".into()));
        assert_eq!(props_url("http://gpu.lan/llm"), Some("http://gpu.lan/llm/props".into()));
        assert_eq!(props_url("https://api.openai.com/v1"), None);
        // The shape of llama-server's GET /props (llama-cpp-python 0.3.36's vendored llama.cpp), abridged.
        let llama = br#"{"default_generation_settings":{"params":{"n_predict":-1,"temperature":0.8},"n_ctx":8192},
            "total_slots":4,"model_alias":"SmolLM2","model_path":"/m.gguf","modalities":{"vision":false},
            "build_info":"b1-unknown","is_sleeping":false}"#;
        let said = ServerProps {
            slots: Some(4),
            context_tokens: Some(8192),
            no_repetition_penalty: false,
            holds_schema_lengths: true,
        };
        assert_eq!(parse_props(llama), Some(said), "penalties it does not state count as set");
        // Its defaults as it states them: no penalty of any kind.
        let plain = br#"{"default_generation_settings":{"params":{"temperature":0.8,"repeat_penalty":1.0,
            "presence_penalty":0.0,"frequency_penalty":0.0,"dry_multiplier":0.0},"n_ctx":8192},"total_slots":4}"#;
        assert_eq!(parse_props(plain), Some(ServerProps { no_repetition_penalty: true, ..said }));
        // Started with a penalty of its own (`--repeat-penalty 1.05`, or DRY): left as it is.
        let own_penalty = br#"{"default_generation_settings":{"params":{"repeat_penalty":1.05,"presence_penalty":0.0,
            "frequency_penalty":0.0,"dry_multiplier":0.0},"n_ctx":8192},"total_slots":4}"#;
        assert_eq!(parse_props(own_penalty), Some(said));
        let dry = br#"{"default_generation_settings":{"params":{"repeat_penalty":1.0,"presence_penalty":0.0,
            "frequency_penalty":0.0,"dry_multiplier":0.8},"n_ctx":8192},"total_slots":4}"#;
        assert_eq!(parse_props(dry), Some(said));
        assert_eq!(parse_props(br#"{"detail":"Not Found"}"#), None);
        assert_eq!(parse_props(b"<html>404</html>"), None);
        assert_eq!(parse_props(br#"{"total_slots":0}"#), None);
        // Slots alone, with no generation settings: not known to be llama.cpp's grammar.
        assert_eq!(
            parse_props(br#"{"total_slots":2}"#),
            Some(ServerProps { slots: Some(2), ..ServerProps::default() })
        );
    }

    #[tokio::test]
    async fn calls_are_admitted_while_they_fit_together() {
        let ctx = Arc::new(SharedContext::default());
        // Unknown size: everything is admitted.
        let a = ctx.admit(100_000).await;
        drop(a);
        ctx.set_tokens(8192);
        let first = ctx.admit(3000).await;
        let second = ctx.admit(3000).await;
        let waiter = {
            let ctx = ctx.clone();
            tokio::spawn(async move {
                let _third = ctx.admit(3000).await;
            })
        };
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "9000 tokens do not fit in 8192");
        drop(first);
        waiter.await.unwrap();
        drop(second);
        // A call larger than the whole context goes alone.
        let big = ctx.admit(20_000).await;
        drop(big);
    }

    #[test]
    fn a_prompt_counts_as_finely_as_the_server_cut_one() {
        let tokens = PromptTokens::default();
        assert_eq!(tokens.of(3000), 1000 + TEMPLATE_TOKENS, "a third of the characters before any answer");
        // A short prompt is mostly template: it teaches nothing.
        tokens.observe(100, 90);
        assert_eq!(tokens.of(3000), 1000 + TEMPLATE_TOKENS);
        // A coarser cut than a third changes nothing; a finer one counts from then on.
        tokens.observe(3000, 766);
        assert_eq!(tokens.of(3000), 1000 + TEMPLATE_TOKENS, "prose at four characters a token");
        tokens.observe(2000, 1016);
        assert_eq!(tokens.of(3000), 1500 + TEMPLATE_TOKENS, "JSON at two characters a token");
        // A report past one token a character is not believed beyond it.
        tokens.observe(1000, 50_000);
        assert_eq!(tokens.of(3000), 3000 + TEMPLATE_TOKENS);
    }
}
