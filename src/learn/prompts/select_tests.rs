use super::*;
use crate::domain::playbook::{Section, format_bullet_id};
use crate::domain::{BulletTag, BulletTagKind, Feedback, PromptName};
use crate::learn::prompts::decode::{decode_operations, decode_reflection};

/// A playbook of `n` bullets in two sections, each with a rare number and shared words.
fn big(n: usize) -> VersionContent {
    let bullet = |i: usize| Bullet {
        id: format_bullet_id(i as u64 + 1),
        content: format!("INSIGHT-t{i:04}: check field {i} before answering"),
        helpful: 0,
        harmful: 0,
    };
    let half = n / 2;
    VersionContent {
        base: "You answer {task}.".into(),
        playbook: Some(Playbook {
            sections: vec![
                Section { name: "insights".into(), bullets: (0..half).map(bullet).collect() },
                Section { name: "formatting".into(), bullets: (half..n).map(bullet).collect() },
            ],
            next_id: n as u64 + 1,
        }),
    }
}

fn shown_ids(v: &View) -> Vec<String> {
    v.content.playbook.as_ref().map(|p| p.bullets().map(|(_, b)| b.id.clone()).collect()).unwrap_or_default()
}

fn reflection(insight: &str, tags: &[&str]) -> Reflection {
    Reflection {
        error: String::new(),
        root_cause: String::new(),
        correct_approach: String::new(),
        key_insight: insight.into(),
        bullet_tags: tags.iter().map(|id| BulletTag { id: (*id).into(), tag: BulletTagKind::Helpful }).collect(),
    }
}

#[test]
fn a_playbook_within_the_limit_is_shown_whole() {
    let current = big(REFLECT.bullets);
    let v = View::of(&current, &["anything".into()], &[], REFLECT);
    assert_eq!(v, View::whole(&current));
    assert!(v.outline.is_none());
}

#[test]
fn a_large_playbook_shows_the_named_and_the_related_bullets_in_their_order() {
    let current = big(400);
    // Bullet 311 (b-0312) shares the rare number 311 and its marker; b-0007 is named.
    let v = View::of(&current, &["the lesson INSIGHT-t0311: check field 311".into()], &["b-0007".into()], REFLECT);
    assert_eq!(shown_ids(&v), vec!["b-0007", "b-0312"], "named first, then related, in playbook order");
    let outline = v.outline.as_deref().unwrap();
    assert!(outline.contains("2 of the playbook's 400 bullets"), "{outline}");
    assert!(
        outline.contains("insights (199 not shown)") && outline.contains("formatting (199 not shown)"),
        "{outline}"
    );
    assert_eq!(v.content.base, current.base, "the base is always shown");
}

#[test]
fn words_most_bullets_share_make_nothing_relevant() {
    let current = big(400);
    let v = View::of(&current, &["check field before answering".into()], &[], REFLECT);
    assert!(shown_ids(&v).is_empty(), "{:?}", shown_ids(&v));
}

#[test]
fn what_a_call_is_shown_stays_within_its_limit_however_large_the_playbook() {
    for n in [100, 1_000, 5_000] {
        let current = big(n);
        // Every query names a different rare bullet: more than the limit asks to be shown.
        let queries: Vec<String> = (0..60).map(|i| format!("INSIGHT-t{i:04}: field {i}")).collect();
        let limit = Limit::aggregate(4);
        let v = View::of(&current, &queries, &[], limit);
        let shown = v.content.playbook.as_ref().unwrap();
        assert!(shown.bullet_count() <= limit.bullets, "n {n}: {}", shown.bullet_count());
        let chars: usize = shown.bullets().map(|(_, b)| b.content.chars().count()).sum();
        assert!(chars <= limit.chars, "n {n}: {chars}");
        assert_eq!(shown.bullet_count(), limit.bullets, "n {n}: the limit is used");
    }
    assert_eq!(Limit::aggregate(1).bullets, AGGREGATE_PER_REFLECTION.bullets);
    assert_eq!(Limit::aggregate(100), Limit { per_query: AGGREGATE_PER_REFLECTION.per_query, ..AGGREGATE_MAX });
}

#[test]
fn each_reflection_of_a_group_brings_its_own_related_bullets_and_its_tags() {
    let current = big(400);
    let group =
        [reflection("INSIGHT-t0010: check field 10", &[]), reflection("INSIGHT-t0390: check field 390", &["b-0100"])];
    let v = View::for_reflections(&current, &group);
    assert_eq!(shown_ids(&v), vec!["b-0011", "b-0100", "b-0391"]);
    // A consolidation's UPDATE names its bullet.
    let ops = [DeltaOp::Update { id: "b-0250".into(), content: "check field 3 twice".into(), reason: String::new() }];
    assert!(shown_ids(&View::for_ops(&current, &ops)).contains(&"b-0250".to_owned()));
}

#[test]
fn a_reflector_sees_the_bullets_its_trace_names() {
    let current = big(400);
    let trace = Trace::pending(
        PromptName::new("default", "p").unwrap(),
        serde_json::json!({"task": "t"}),
        serde_json::json!([{"role": "assistant", "content": "I used [b-0042] and b-0300."}]),
        serde_json::json!("done"),
        Feedback::default(),
    );
    let ids = shown_ids(&View::for_trace(&current, &trace));
    assert!(ids.contains(&"b-0042".to_owned()) && ids.contains(&"b-0300".to_owned()), "{ids:?}");
}

#[test]
fn answers_are_checked_against_what_the_call_was_shown() {
    let current = big(400);
    let group = [reflection("INSIGHT-t0010: check field 10", &[])];
    let v = View::for_reflections(&current, &group);
    assert_eq!(shown_ids(&v), vec!["b-0011"]);
    let update =
        |id: &str| format!(r#"{{"operations": [{{"op": "UPDATE", "id": "{id}", "content": "x", "reason": "r"}}]}}"#);
    // The whole playbook would take an update of b-0200; the call did not see it.
    assert!(decode_operations(&update("b-0200"), &current, 1).is_ok_and(|a| a.value.len() == 1));
    let unseen = decode_operations(&update("b-0200"), &v.content, 1).unwrap();
    assert!(unseen.value.is_empty(), "an update of an unseen bullet is not taken");
    assert_eq!(decode_operations(&update("b-0011"), &v.content, 1).unwrap().value.len(), 1);
    // A reflection may tag only a shown bullet.
    let tag = |id: &str| {
        format!(
            r#"{{"error": "", "root_cause": "", "correct_approach": "", "key_insight": "k", "bullet_tags": [{{"id": "{id}", "tag": "helpful"}}]}}"#
        )
    };
    assert!(decode_reflection(&tag("b-0011"), &v.content).is_ok_and(|r| r.value.bullet_tags.len() == 1));
    assert!(decode_reflection(&tag("b-0200"), &v.content).is_ok_and(|r| r.value.bullet_tags.is_empty()));
}

#[test]
fn bullet_ids_are_read_from_text_once_each_in_canonical_form() {
    assert_eq!(ids_in("used [b-7], b-0012, b-7 again; xb-9 and b-x are not ids"), vec!["b-0007", "b-0012"]);
}
