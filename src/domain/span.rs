//! OpenTelemetry spans on their way to becoming traces: a span as it is kept,
//! what the OTLP mapping makes of a trace id's spans, and how a merge of new
//! spans into their trace ended.

use uuid::Uuid;

use super::trace::ValidTrace;

/// One OTLP span as the store keeps it (see [`OtlpStore::merge_otlp_spans`](crate::store::OtlpStore::merge_otlp_spans)).
#[derive(Debug, Clone, PartialEq)]
pub struct OtlpSpan {
    /// 16 lowercase hex digits, unique within its OpenTelemetry trace.
    pub span_id: String,
    /// Opaque to the store: the OTLP module's encoding of the span with its resource.
    pub body: Vec<u8>,
}

/// What the OTLP mapping makes of every span a trace id has so far; the store
/// asks it inside the merge transaction, with the stored spans first.
#[derive(Debug, Clone, PartialEq)]
pub enum OtlpRemap {
    /// The spans map to this trace.
    Mapped(Box<ValidTrace>),
    /// Not yet (no prompt or no input so far): hold the spans for the rest of the trace.
    Incomplete(String),
    /// They cannot map: the new spans are rejected for this reason.
    Invalid(String),
}

/// The outcome of [`OtlpStore::merge_otlp_spans`](crate::store::OtlpStore::merge_otlp_spans). `added` counts spans stored by this call.
#[derive(Debug, Clone, PartialEq)]
pub enum OtlpMerge {
    /// A new pending trace was made (with any spans held before).
    Created { trace: Uuid, added: usize },
    /// The pending trace of this trace id was re-mapped with the new spans.
    Extended { trace: Uuid, added: usize },
    /// Stored, but not a trace yet.
    Held { added: usize, reason: String },
    /// Every span was stored before: nothing changed.
    Duplicate,
    /// The trace was already taken by a round; the `spans` new ones were not stored.
    Closed { trace: Uuid, spans: usize },
    /// The `spans` new ones were not stored, for this reason.
    Rejected { spans: usize, reason: String },
}

/// The mapping callback of [`OtlpStore::merge_otlp_spans`](crate::store::OtlpStore::merge_otlp_spans): stored bodies first, then the new ones.
pub type OtlpRemapFn<'a> = dyn Fn(&[&[u8]]) -> OtlpRemap + Send + Sync + 'a;
