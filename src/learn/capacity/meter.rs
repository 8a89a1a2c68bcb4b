//! Capacity control, measured after the level-1 reduce: the overload meter —
//! how much of what a level-1 aggregator call is given it keeps, as a function
//! of the call's group size — measured from the round's own answers, without knowing which reflections held an insight.
//!
//! With duplication p ≥ 2 every reflection sits in at least two groups, and each
//! copy is either *covered* by its group's answer (the answer kept its lesson)
//! or not. That is capture–recapture: if a reflection's other copy was covered,
//! the reflection certainly holds something worth keeping, and whether *this*
//! copy was covered too is a fair draw of the per-copy retention r of this
//! copy's group size. So, per size bucket, r̂ = recaptured / marked, where
//! *marked* counts copies whose reflection was covered by another of its copies,
//! and *recaptured* those of them covered by their own group as well. For p = 2
//! and one bucket this is the Lincoln–Petersen form r̂ = 2B / (2B + O) (B: both
//! copies covered, O: exactly one). Reflections neither copy covered carry no
//! information about r and are not counted; nor are reflections whose copies
//! landed in the same group, or copies in a group that was left out.
//!
//! # Two ways to tell "covered"
//! - **Citations** (the first choice): every operation cites the reflections of
//!   its group it came from (`sources`); a copy is covered when an operation of
//!   its group cites it.
//! - **Text** (when citations are missing or implausible — many small and local
//!   models ignore the instruction to cite, or cite at random): a copy is covered
//!   when its reflection's key insight *reappears* in an operation of its group
//!   ([`reappears`]: the insight's specifics — words with a digit: ids, numbers,
//!   codes — are in the operation, and so is at least half of its other words;
//!   the prompts ask the model to keep specifics verbatim).
//!
//! Each answer is judged on its own: an answer with operations but no citations
//! is read by text (`missing`); so is one whose citations mostly point at
//! reflections the operation does not resemble (`implausible`: fewer than half
//! of its cited pairs share a specific, or a quarter of the words, with the
//! cited reflection). Where an answer's citations are plausible, the round also
//! compares the two readings copy by copy: the text reading's sensitivity s
//! (covered by text when cited) and false-positive rate f (covered by text when
//! not cited). That *calibration* corrects the text-read counts of the same
//! round, r = (r̂_text − f) / (s − f), when both rates rest on enough copies and
//! the text reading is informative (s − f ≥ ½); otherwise they are used as read.
//! A round whose answers give neither reading marks nothing: the meter then has
//! no estimate, and the round record says why.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use crate::domain::GroupOutput;

/// Copies in a size bucket whose reflection another copy covered (`marked`),
/// and how many of them their own group covered too (`recaptured`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct BucketCounts {
    pub marked: u64,
    pub recaptured: u64,
}

impl BucketCounts {
    /// r̂ = recaptured / marked; `None` before anything was marked.
    pub fn estimate(&self) -> Option<f64> {
        (self.marked > 0).then(|| self.recaptured as f64 / self.marked as f64)
    }
}

/// The bucket of a group of `size` distinct reflections: sizes
/// `[2^j, 2^(j+1))` share one, named by its smallest size (1, 2, 4, 8, …).
pub fn bucket_of(size: usize) -> u32 {
    if size == 0 { 0 } else { 1u32 << size.ilog2() }
}

/// The largest size in the bucket that starts at `min`.
pub fn bucket_max(min: u32) -> u32 {
    if min == 0 { 0 } else { min.saturating_mul(2) - 1 }
}

/// Minimum copies on each side (cited, not cited) before a round's calibration
/// of the text reading is used.
pub const MIN_CALIBRATION_COPIES: u64 = 10;

/// How one group's answer was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Reading {
    /// By its operations' citations.
    Sources,
    /// By text: it has operations but cites nothing.
    TextMissingSources,
    /// By text: most of its citations point at reflections its operations do not resemble.
    TextImplausibleSources,
}

/// The text reading against citations, over the copies of answers read by citations.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CitationCalibration {
    /// Cited copies, and of them those the text reading also covers.
    pub cited: u64,
    pub cited_and_text: u64,
    /// Copies not cited, and of them those the text reading covers anyway.
    pub uncited: u64,
    pub uncited_but_text: u64,
}

impl CitationCalibration {
    /// (sensitivity s, false-positive rate f) when both rest on enough copies.
    pub fn rates(&self) -> Option<(f64, f64)> {
        (self.cited >= MIN_CALIBRATION_COPIES && self.uncited >= MIN_CALIBRATION_COPIES).then(|| {
            (self.cited_and_text as f64 / self.cited as f64, self.uncited_but_text as f64 / self.uncited as f64)
        })
    }

    /// Whether the text reading is informative enough to be corrected by these rates.
    pub fn usable(&self) -> Option<(f64, f64)> {
        self.rates().filter(|(s, f)| s - f >= 0.5)
    }
}

/// What one round tells the meter: counts per size bucket (every bucket the
/// round's groups fell in, with zero counts where nothing was marked), how its
/// answers were read, and the calibration of the text reading.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(default)]
pub struct MeterReading {
    /// Per bucket (smallest size first): the counts the estimate uses.
    pub buckets: Vec<(u32, BucketCounts)>,
    /// Answers read by citations, by text for missing citations, by text for implausible ones.
    pub by_sources: usize,
    pub missing_sources: usize,
    pub implausible_sources: usize,
    /// The text reading against citations in this round.
    pub calibration: CitationCalibration,
    /// Whether the text-read counts were corrected by the calibration.
    pub corrected: bool,
}

impl MeterReading {
    /// Copies marked over all buckets: 0 means this round gave no estimate.
    pub fn marked(&self) -> u64 {
        self.buckets.iter().map(|(_, c)| c.marked).sum()
    }
}

/// Lower-cased words of a text (runs of letters, digits, `-`, `_`), split into
/// its *specifics* (words with a digit) and its other words of three or more
/// characters.
fn words(text: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut specifics = BTreeSet::new();
    let mut plain = BTreeSet::new();
    for w in text.split(|c: char| !(c.is_alphanumeric() || c == '-' || c == '_')) {
        let w = w.trim_matches(|c| c == '-' || c == '_').to_lowercase();
        if w.chars().any(|c| c.is_ascii_digit()) {
            specifics.insert(w);
        } else if w.chars().count() >= 3 {
            plain.insert(w);
        }
    }
    (specifics, plain)
}

/// A lesson as the text reading compares it.
#[derive(Debug, Clone, Default)]
struct Lesson {
    specifics: BTreeSet<String>,
    plain: BTreeSet<String>,
}

impl Lesson {
    fn of(text: &str) -> Self {
        let (specifics, plain) = words(text);
        Self { specifics, plain }
    }

    fn is_empty(&self) -> bool {
        self.specifics.is_empty() && self.plain.is_empty()
    }

    /// Shares of the lesson's specifics and plain words found in `other`.
    fn found_in(&self, other: &Lesson) -> (f64, f64) {
        let share = |mine: &BTreeSet<String>, theirs: &BTreeSet<String>| {
            if mine.is_empty() { 1.0 } else { mine.intersection(theirs).count() as f64 / mine.len() as f64 }
        };
        (share(&self.specifics, &other.specifics), share(&self.plain, &other.plain))
    }

    /// The text reading of "covered": the lesson's specifics all reappear and at
    /// least half of its other words do.
    fn reappears_in(&self, op: &Lesson) -> bool {
        let (specifics, plain) = self.found_in(op);
        !self.is_empty() && specifics >= 1.0 && plain >= 0.5
    }

    /// The looser test a citation must pass to be plausible: a specific in
    /// common, or (without specifics) a quarter of the words.
    fn resembles(&self, op: &Lesson) -> bool {
        if self.specifics.is_empty() {
            self.found_in(op).1 >= 0.25
        } else {
            self.specifics.intersection(&op.specifics).next().is_some()
        }
    }
}

/// Whether the lesson `insight` reappears in the operation text `op` (the text
/// reading of "covered"; see the module doc).
pub fn reappears(insight: &str, op: &str) -> bool {
    Lesson::of(insight).reappears_in(&Lesson::of(op))
}

/// One group's answer as the meter sees it: its operations' texts with the
/// members each cites (positions in the group's `traces`).
fn operations(out: &GroupOutput) -> Vec<(Lesson, Vec<usize>)> {
    let Some(ops) = out.output.get("operations").and_then(|v| v.as_array()) else { return Vec::new() };
    ops.iter()
        .map(|op| {
            let text = op.get("content").and_then(|c| c.as_str()).unwrap_or_default();
            let cited = op
                .get("sources")
                .and_then(|s| s.as_array())
                .map(|s| s.iter().filter_map(|p| usize::try_from(p.as_u64()?).ok()).collect())
                .unwrap_or_default();
            (Lesson::of(text), cited)
        })
        .collect()
}

/// One group's coverage: per member position, (covered by the reading used,
/// covered by citations, covered by text), and how the answer was read.
fn read_group(out: &GroupOutput, lessons: &HashMap<Uuid, Lesson>) -> (Vec<(bool, bool, bool)>, Reading) {
    let ops = operations(out);
    let empty = Lesson::default();
    let lesson = |pos: usize| out.traces.get(pos).and_then(|t| lessons.get(t)).unwrap_or(&empty);
    let members = out.traces.len();
    let cited: HashSet<usize> = ops.iter().flat_map(|(_, c)| c.iter().copied()).filter(|&p| p < members).collect();
    let by_text: Vec<bool> = (0..members).map(|p| ops.iter().any(|(op, _)| lesson(p).reappears_in(op))).collect();
    let pairs: Vec<bool> = ops
        .iter()
        .flat_map(|(op, c)| c.iter().filter(|&&p| p < members).map(move |&p| (op, p)))
        .map(|(op, p)| lesson(p).resembles(op))
        .collect();
    let reading = if ops.is_empty() {
        // Nothing kept: both readings agree that nothing is covered.
        Reading::Sources
    } else if cited.is_empty() {
        Reading::TextMissingSources
    } else if 2 * pairs.iter().filter(|ok| **ok).count() < pairs.len() {
        Reading::TextImplausibleSources
    } else {
        Reading::Sources
    };
    let coverage = (0..members)
        .map(|p| {
            let c = cited.contains(&p);
            let used = if reading == Reading::Sources { c } else { by_text[p] };
            (used, c, by_text[p])
        })
        .collect();
    (coverage, reading)
}

/// The meter's reading of one round's level-1 outputs (groups left out of the
/// round have no output and so do not count); `insights` maps each reflection
/// (trace id) to its key insight.
pub fn observe(outputs: &[GroupOutput], insights: &HashMap<Uuid, String>) -> MeterReading {
    let lessons: HashMap<Uuid, Lesson> = insights.iter().map(|(t, text)| (*t, Lesson::of(text))).collect();
    let mut reading = MeterReading::default();
    // Per reflection: for each group holding it, (bucket, covered, read by text).
    let mut copies: HashMap<Uuid, Vec<(u32, bool, bool)>> = HashMap::new();
    let mut seen_buckets: BTreeSet<u32> = BTreeSet::new();
    for out in outputs {
        let (coverage, how) = read_group(out, &lessons);
        match how {
            Reading::Sources => reading.by_sources += 1,
            Reading::TextMissingSources => reading.missing_sources += 1,
            Reading::TextImplausibleSources => reading.implausible_sources += 1,
        }
        let bucket = bucket_of(out.traces.len());
        seen_buckets.insert(bucket);
        let mut distinct = HashSet::new();
        for (pos, t) in out.traces.iter().enumerate() {
            if !distinct.insert(*t) {
                continue;
            }
            let (covered, cited, text) = coverage[pos];
            if how == Reading::Sources && !out.output["operations"].as_array().is_none_or(Vec::is_empty) {
                let c = &mut reading.calibration;
                if cited {
                    c.cited += 1;
                    c.cited_and_text += u64::from(text);
                } else {
                    c.uncited += 1;
                    c.uncited_but_text += u64::from(text);
                }
            }
            copies.entry(*t).or_default().push((bucket, covered, how != Reading::Sources));
        }
    }
    // (sources-read counts, text-read counts) per bucket.
    let mut counts: BTreeMap<u32, (BucketCounts, BucketCounts)> =
        seen_buckets.into_iter().map(|b| (b, Default::default())).collect();
    for held in copies.values().filter(|h| h.len() >= 2) {
        let total = held.iter().filter(|(_, c, _)| *c).count();
        for &(bucket, covered, text) in held {
            if total - usize::from(covered) > 0 {
                let entry = counts.entry(bucket).or_default();
                let c = if text { &mut entry.1 } else { &mut entry.0 };
                c.marked += 1;
                c.recaptured += u64::from(covered);
            }
        }
    }
    let correction = reading.calibration.usable();
    reading.corrected = correction.is_some() && counts.values().any(|(_, t)| t.marked > 0);
    reading.buckets = counts
        .into_iter()
        .map(|(bucket, (sources, text))| {
            let text_recaptured = match correction {
                Some((s, f)) => {
                    let r = (text.recaptured as f64 - f * text.marked as f64) / (s - f);
                    r.round().clamp(0.0, text.marked as f64) as u64
                }
                None => text.recaptured,
            };
            let c =
                BucketCounts { marked: sources.marked + text.marked, recaptured: sources.recaptured + text_recaptured };
            (bucket, c)
        })
        .collect();
    reading
}

/// One bucket of the meter as stored and shown.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MeterBucket {
    /// Smallest group size (distinct reflections) in the bucket.
    pub size_min: u32,
    /// Largest group size in the bucket.
    pub size_max: u32,
    /// Estimated per-group retention r̂ (0..=1): the share of a group's
    /// insights its answer keeps. `None` until a copy was marked.
    pub retention: Option<f64>,
    /// Copies the estimate rests on (marked copies).
    pub samples: u64,
    /// Of them, covered by their own group too.
    pub recaptured: u64,
    /// Rounds that contributed.
    pub rounds: u64,
}

impl MeterBucket {
    pub fn new(size_min: u32, counts: BucketCounts, rounds: u64) -> Self {
        Self {
            size_min,
            size_max: bucket_max(size_min),
            retention: counts.estimate(),
            samples: counts.marked,
            recaptured: counts.recaptured,
            rounds,
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn id(i: u128) -> Uuid {
        Uuid::from_u128(i)
    }

    /// A group of traces `members` whose answer cites the members at `cited` positions.
    fn group(g: usize, members: &[u128], cited: &[usize]) -> GroupOutput {
        let ops: Vec<_> = cited
            .iter()
            .map(|p| json!({"op": "ADD", "section": "s", "content": format!("lesson {p}"), "reason": "", "sources": [p]}))
            .collect();
        GroupOutput {
            group: g,
            traces: members.iter().map(|&i| id(i)).collect(),
            output: json!({ "operations": ops }),
            key: String::new(),
        }
    }

    /// The counts of the buckets where something was marked, read with no key insights known.
    fn observe_cited(outputs: &[GroupOutput]) -> BTreeMap<u32, BucketCounts> {
        observe(outputs, &HashMap::new()).buckets.into_iter().filter(|(_, c)| c.marked > 0).collect()
    }

    #[test]
    fn buckets_are_powers_of_two() {
        assert_eq!([1, 2, 3, 4, 7, 8, 15, 16, 100].map(bucket_of), [1, 2, 2, 4, 4, 8, 8, 16, 64]);
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_max(8), 15);
    }

    #[test]
    fn two_copies_of_four_reflections_give_the_lincoln_petersen_estimate() {
        // Reflections 1..=4 in group A and again in group B (size 4 each).
        // 1: both cover (B), 2: only A, 3: only B (O = 2), 4: neither.
        let a = group(0, &[1, 2, 3, 4], &[0, 1]);
        let b = group(1, &[3, 1, 4, 2], &[0, 1]);
        let counts = observe_cited(&[a, b]);

        assert_eq!(counts[&4], BucketCounts { marked: 4, recaptured: 2 });
        // 2B / (2B + O) = 2 / (2 + 2).
        assert_eq!(counts[&4].estimate(), Some(0.5));
    }

    #[test]
    fn copies_in_groups_of_different_sizes_count_in_their_own_bucket() {
        // Small group (2) keeps everything; large group (8) keeps a quarter.
        let small1 = group(0, &[1, 2], &[0, 1]);
        let small2 = group(1, &[3, 4], &[0, 1]);
        let small3 = group(2, &[5, 6], &[0, 1]);
        let small4 = group(3, &[7, 8], &[0, 1]);
        let large = group(4, &[1, 2, 3, 4, 5, 6, 7, 8], &[0, 1]);
        let counts = observe_cited(&[small1, small2, small3, small4, large]);
        // Only the small copies of 1 and 2 are marked (the large group covered just those).
        assert_eq!(counts[&2], BucketCounts { marked: 2, recaptured: 2 });
        assert_eq!(counts[&8], BucketCounts { marked: 8, recaptured: 2 });
        assert_eq!(counts[&8].estimate(), Some(0.25));
        assert_eq!(counts[&2].estimate(), Some(1.0));
    }

    #[test]
    fn a_reflection_in_one_group_only_or_never_covered_tells_nothing() {
        // 1 and 2 are only in group 0 (both copies landed there); 3 is never covered.
        let a = group(0, &[1, 2, 3], &[0, 1]);
        let b = group(1, &[3, 4], &[1]);
        let counts = observe_cited(&[a, b]);
        assert!(counts.is_empty(), "{counts:?}");
        assert_eq!(BucketCounts::default().estimate(), None);
    }

    #[test]
    fn three_copies_mark_each_other() {
        // p = 3: reflection 1 in three groups of size 1; two cover it.
        let outs = [group(0, &[1], &[0]), group(1, &[1], &[0]), group(2, &[1], &[])];
        // Each copy has another covered copy: 3 marked, 2 recaptured.
        assert_eq!(observe_cited(&outs)[&1], BucketCounts { marked: 3, recaptured: 2 });
    }

    #[test]
    fn a_group_citing_past_its_members_is_not_miscounted() {
        let a = group(0, &[1, 2], &[0, 5]);
        let b = group(1, &[1, 2], &[0]);
        assert_eq!(observe_cited(&[a, b])[&2], BucketCounts { marked: 2, recaptured: 2 });
    }

    /// A group whose answer keeps the insights of the members at `kept`, in the
    /// simulator-free form a real model might write: a sentence holding the
    /// insight's specifics; `cite` says whether (and how) it cites.
    fn answer(g: usize, members: &[u128], kept: &[usize], cite: Cite) -> GroupOutput {
        let ops: Vec<_> = kept
            .iter()
            .map(|&p| {
                let content =
                    format!("Before answering, always check field F{} of order {}", members[p], members[p] * 7);
                match cite {
                    Cite::Right => json!({"op": "ADD", "section": "s", "content": content, "sources": [p]}),
                    Cite::Wrong => {
                        json!({"op": "ADD", "section": "s", "content": content, "sources": [(p + 1) % members.len()]})
                    }
                    Cite::Not => json!({"op": "ADD", "section": "s", "content": content}),
                }
            })
            .collect();
        GroupOutput {
            group: g,
            traces: members.iter().map(|&i| id(i)).collect(),
            output: json!({ "operations": ops }),
            key: String::new(),
        }
    }

    #[derive(Clone, Copy)]
    enum Cite {
        Right,
        Wrong,
        Not,
    }

    fn lessons(members: impl Iterator<Item = u128>) -> HashMap<Uuid, String> {
        members.map(|i| (id(i), format!("Check field F{i} of order {} before answering", i * 7))).collect()
    }

    #[test]
    fn a_lesson_reappears_when_its_specifics_and_half_its_words_do() {
        let insight = "Check field F12 of order 84 before answering";
        assert!(reappears(insight, "Always check field F12 of order 84 first, before answering."));
        assert!(!reappears(insight, "Always check field F13 of order 84 before answering"), "a specific differs");
        assert!(!reappears(insight, "F12 84"), "too few of its words");
        assert!(reappears("Greet the customer by name", "Always greet every customer by their name"));
        assert!(!reappears("", "anything"));
    }

    #[test]
    fn answers_without_sources_are_read_by_text_and_give_the_same_counts() {
        // Groups A and B hold reflections 1..=4 each; A keeps 1, 2; B keeps 1, 3.
        let members = [1, 2, 3, 4];
        let insights = lessons(1..=4);
        let cited =
            observe(&[answer(0, &members, &[0, 1], Cite::Right), answer(1, &members, &[0, 2], Cite::Right)], &insights);
        let uncited =
            observe(&[answer(0, &members, &[0, 1], Cite::Not), answer(1, &members, &[0, 2], Cite::Not)], &insights);
        assert_eq!((cited.by_sources, cited.missing_sources), (2, 0));
        assert_eq!((uncited.by_sources, uncited.missing_sources), (0, 2));
        assert_eq!(cited.buckets, uncited.buckets);
        assert_eq!(cited.buckets, vec![(4, BucketCounts { marked: 4, recaptured: 2 })]);
    }

    #[test]
    fn implausible_citations_are_ignored_for_the_text() {
        let members = [1, 2, 3, 4];
        let insights = lessons(1..=4);
        let wrong =
            observe(&[answer(0, &members, &[0, 1], Cite::Wrong), answer(1, &members, &[0, 2], Cite::Wrong)], &insights);
        assert_eq!(wrong.implausible_sources, 2, "{wrong:?}");
        assert_eq!(wrong.buckets, vec![(4, BucketCounts { marked: 4, recaptured: 2 })]);
    }

    #[test]
    fn a_mixed_round_calibrates_the_text_reading_against_citations() {
        // 24 reflections in groups of 4, twice (p = 2); every answer keeps the
        // first two members of its group; the first six cite, the others do not.
        let ids: Vec<u128> = (1..=24).collect();
        let insights = lessons(ids.iter().copied());
        let mut outs = Vec::new();
        for (g, chunk) in ids.chunks(4).enumerate() {
            outs.push(answer(g, chunk, &[0, 1], Cite::Right));
        }
        for (g, chunk) in ids.chunks(4).enumerate() {
            let rotated: Vec<u128> = chunk.iter().cycle().skip(1).take(4).copied().collect();
            outs.push(answer(6 + g, &rotated, &[0, 1], Cite::Not));
        }
        let r = observe(&outs, &insights);
        assert_eq!((r.by_sources, r.missing_sources), (6, 6));
        // The text reading agrees with every citation here: s = 1, f = 0.
        assert_eq!(
            r.calibration,
            CitationCalibration { cited: 12, cited_and_text: 12, uncited: 12, uncited_but_text: 0 }
        );
        assert_eq!(r.calibration.usable(), Some((1.0, 0.0)));
        assert!(r.corrected);
        assert!(r.marked() > 0);
        // Too few copies on one side: no calibration is used.
        assert_eq!(
            CitationCalibration { cited: 50, cited_and_text: 50, uncited: 3, uncited_but_text: 0 }.usable(),
            None
        );
    }
}
