//! A round's record beyond its columns (the round's `detail` JSON): phase
//! timings, traces whose reflection failed, the level-1 group outputs and, once
//! the reduce finished, what it did. One type, so the worker that writes it and
//! the API, UI and worker that read it agree on one shape; rounds stored by
//! earlier versions (fewer keys, `group_outputs` as an object by group index)
//! still read.
//!
//! The outcome's own shape belongs to the learning engine, which sits above the
//! domain: [`RoundDetail`] is generic over it, and a reader that does not need it
//! keeps it as plain JSON (the default), passing it through unchanged.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;
use uuid::Uuid;

/// The round's record. `O` is the type of the finished reduce's outcome.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(bound(deserialize = "O: Deserialize<'de>"))]
pub struct RoundDetail<O = Value> {
    /// Each phase's timing, by phase name (`map`, `shuffle`, `reduce1`, `reduce2`, `validate`).
    #[serde(default)]
    pub phases: BTreeMap<String, PhaseSpan>,
    /// Traces whose reflection could not be obtained (so far), with the reason.
    #[serde(default, deserialize_with = "reasons_by_trace")]
    pub unreflected: BTreeMap<Uuid, String>,
    /// Level-1 aggregator outputs, one per group, in group order.
    #[serde(default, deserialize_with = "outputs_in_either_shape")]
    pub group_outputs: Vec<GroupOutput>,
    /// Set once the reduce finished (kept if publishing then failed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<O>,
    /// The version whose lessons the round's result repeated (a live arm or a
    /// recent version): the round succeeded without writing a version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repeats: Option<i64>,
}

impl<O> Default for RoundDetail<O> {
    fn default() -> Self {
        Self {
            phases: BTreeMap::new(),
            unreflected: BTreeMap::new(),
            group_outputs: Vec::new(),
            outcome: None,
            repeats: None,
        }
    }
}

/// When one phase started and finished.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PhaseSpan {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<DateTime<Utc>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<DateTime<Utc>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elapsed_ms: Option<u64>,
}

impl PhaseSpan {
    /// The phase's duration: as measured, or from its two timestamps.
    pub fn elapsed_ms(&self) -> Option<f64> {
        self.elapsed_ms
            .map(|ms| ms as f64)
            .or_else(|| Some((self.finished_at? - self.started_at?).num_milliseconds() as f64))
    }
}

/// One level-1 aggregator call: which traces it saw and what it proposed
/// (`{"operations": [...]}` or `{"instruction": "..."}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupOutput {
    pub group: usize,
    pub traces: Vec<Uuid>,
    pub output: Value,
    /// What the call's answer depends on (`learn::round::group_key`): a resumed
    /// round reuses a journaled output only under the same key.
    #[serde(default)]
    pub key: String,
}

/// Why a stored detail could not be read.
#[derive(Debug, thiserror::Error)]
#[error("the round's detail does not have the expected shape: {0}")]
pub struct DetailError(#[from] serde_json::Error);

impl<O: serde::de::DeserializeOwned> RoundDetail<O> {
    /// Reads a stored detail; `null` (a round nothing was written for) is empty.
    pub fn read(stored: &Value) -> Result<Self, DetailError> {
        if stored.is_null() {
            return Ok(Self::default());
        }
        Ok(Self::deserialize(stored)?)
    }
}

impl<O: Serialize> RoundDetail<O> {
    /// The JSON the store keeps.
    pub fn to_value(&self) -> Value {
        // Every part is a map with string keys or plain data: serialising cannot fail.
        serde_json::to_value(self).unwrap_or_else(|_| Value::Object(Default::default()))
    }
}

impl<O> RoundDetail<O> {
    /// The same record with the finished reduce's outcome set.
    pub fn with_outcome<P>(self, outcome: P) -> RoundDetail<P> {
        RoundDetail {
            phases: self.phases,
            unreflected: self.unreflected,
            group_outputs: self.group_outputs,
            outcome: Some(outcome),
            repeats: self.repeats,
        }
    }

    /// Records (or replaces) the output of its group, keeping group order.
    pub fn put_group_output(&mut self, output: GroupOutput) {
        match self.group_outputs.binary_search_by_key(&output.group, |o| o.group) {
            Ok(i) => self.group_outputs[i] = output,
            Err(i) => self.group_outputs.insert(i, output),
        }
    }
}

/// `unreflected`: trace id → reason. Entries an earlier version may have
/// written with a reason that is not a string keep a generic reason.
fn reasons_by_trace<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<Uuid, String>, D::Error> {
    let raw = BTreeMap::<Uuid, Value>::deserialize(d)?;
    Ok(raw
        .into_iter()
        .map(|(id, reason)| {
            let reason = reason.as_str().unwrap_or("the reflection could not be obtained").to_owned();
            (id, reason)
        })
        .collect())
}

/// `group_outputs`: a list (finished rounds, and everything written since
/// `RoundDetail`), or an object by group index (what earlier versions wrote
/// while the round ran).
fn outputs_in_either_shape<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<GroupOutput>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OutputsShape {
        List(Vec<GroupOutput>),
        ByGroup(BTreeMap<String, GroupOutput>),
    }
    let mut outputs = match OutputsShape::deserialize(d)? {
        OutputsShape::List(list) => list,
        OutputsShape::ByGroup(by_group) => by_group.into_values().collect(),
    };
    outputs.sort_by_key(|o| o.group);
    Ok(outputs)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const T1: &str = "0190b4d6-0000-7000-8000-000000000001";
    const T2: &str = "0190b4d6-0000-7000-8000-000000000002";

    fn output(group: usize, trace: &str) -> Value {
        json!({"group": group, "traces": [trace], "output": {"operations": []}, "key": format!("k{group}")})
    }

    #[test]
    fn a_running_round_stored_by_an_earlier_version_reads() {
        // Object by group index, no `key` on the first output (before keys existed), no outcome.
        let stored = json!({
            "phases": {"map": {"started_at": "2026-01-02T03:04:05Z", "finished_at": "2026-01-02T03:04:06.5Z"},
                       "reduce1": {"started_at": "2026-01-02T03:04:07Z"}},
            "unreflected": {T1: "timeout", T2: 42},
            "group_outputs": {"1": output(1, T2), "0": {"group": 0, "traces": [T1], "output": {"instruction": "x"}}},
        });
        let d = RoundDetail::<Value>::read(&stored).unwrap();
        assert_eq!(d.phases["map"].elapsed_ms(), Some(1500.0));
        assert_eq!(d.phases["reduce1"].elapsed_ms(), None, "not finished");
        assert_eq!(d.unreflected[&T1.parse().unwrap()], "timeout");
        assert_eq!(d.unreflected[&T2.parse().unwrap()], "the reflection could not be obtained");
        assert_eq!(d.group_outputs.iter().map(|o| o.group).collect::<Vec<_>>(), [0, 1], "in group order");
        assert_eq!(d.group_outputs[0].key, "", "an output from before keys");
        assert!(d.outcome.is_none());
    }

    #[test]
    fn a_finished_round_keeps_its_shape_through_a_round_trip() {
        let stored = json!({
            "phases": {"map": {"started_at": "2026-01-02T03:04:05Z", "finished_at": "2026-01-02T03:04:06Z", "elapsed_ms": 1000}},
            "unreflected": {},
            "group_outputs": [output(0, T1), output(1, T2)],
            "outcome": {"n": 2, "k": 2, "anything": ["the learning engine's"]},
        });
        let d = RoundDetail::<Value>::read(&stored).unwrap();
        assert_eq!(d.to_value(), stored);
    }

    #[test]
    fn an_empty_or_missing_detail_is_an_empty_record() {
        for stored in [json!({}), Value::Null] {
            let d = RoundDetail::<Value>::read(&stored).unwrap();
            assert_eq!(d, RoundDetail::default());
        }
        assert!(RoundDetail::<Value>::read(&json!({"group_outputs": "nonsense"})).is_err());
    }

    #[test]
    fn a_group_output_is_put_in_order_and_replaced_by_group() {
        let mut d = RoundDetail::<Value>::default();
        for (g, t) in [(2, T1), (0, T1), (1, T2), (0, T2)] {
            d.put_group_output(serde_json::from_value(output(g, t)).unwrap());
        }
        assert_eq!(
            d.group_outputs.iter().map(|o| (o.group, o.traces[0].to_string())).collect::<Vec<_>>(),
            [(0, T2.to_owned()), (1, T2.to_owned()), (2, T1.to_owned())]
        );
    }
}
