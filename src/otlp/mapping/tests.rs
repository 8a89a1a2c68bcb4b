//! The mapping's tests: one trace per trace id across conventions, exports
//! and signals.

use super::{values::string_kv as s, *};
use opentelemetry_proto::tonic::{
    common::v1::{AnyValue, ArrayValue, KeyValueList},
    logs::v1::{LogRecord, ResourceLogs, ScopeLogs},
    resource::v1::Resource,
    trace::v1::{ResourceSpans, ScopeSpans, Status, span::Event},
};

const LIMITS: TraceLimits = TraceLimits { max_field_bytes: 4096, max_trace_bytes: 64 * 1024 };

fn kv(key: &str, v: Any) -> KeyValue {
    KeyValue { key: key.into(), value: Some(AnyValue { value: Some(v) }), ..Default::default() }
}
fn i(key: &str, v: i64) -> KeyValue {
    kv(key, Any::IntValue(v))
}

fn span(trace: u8, id: u8, parent: Option<u8>, start: u64, attrs: Vec<KeyValue>) -> Span {
    Span {
        trace_id: vec![trace; 16],
        span_id: vec![id; 8],
        parent_span_id: parent.map(|p| vec![p; 8]).unwrap_or_default(),
        name: format!("span-{id}"),
        start_time_unix_nano: start,
        end_time_unix_nano: start + 2_000_000,
        attributes: attrs,
        ..Default::default()
    }
}

fn request(resource: Vec<KeyValue>, spans: Vec<Span>) -> ExportTraceServiceRequest {
    ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: Some(Resource { attributes: resource, ..Default::default() }),
            scope_spans: vec![ScopeSpans { spans, ..Default::default() }],
            ..Default::default()
        }],
    }
}

fn one(m: Mapping) -> MappedTrace {
    assert_eq!(m.rejected, vec![], "nothing rejected");
    assert_eq!(m.traces.len(), 1);
    m.traces.into_iter().next().unwrap()
}

#[test]
fn spans_of_one_trace_become_one_trace_in_start_order() {
    let input = r#"[{"role":"system","parts":[{"type":"text","content":"be nice"}]},{"role":"user","parts":[{"type":"text","content":"refund?"}]}]"#;
    let output = r#"[{"role":"assistant","parts":[{"type":"text","content":"sure"}]}]"#;
    // Given out of order: the tool span (started later) first.
    let tool = span(
        1,
        3,
        Some(1),
        3_000_000,
        vec![
            s(attr::TOOL_NAME, "lookup_order"),
            s(attr::TOOL_CALL_ARGUMENTS, r#"{"id": 7}"#),
            s(attr::TOOL_CALL_RESULT, "shipped"),
        ],
    );
    let chat = span(
        1,
        2,
        Some(1),
        1_000_000,
        vec![
            s(attr::OPERATION, "chat"),
            s(attr::REQUEST_MODEL, "gpt-x"),
            s(attr::INPUT_MESSAGES, input),
            s(attr::OUTPUT_MESSAGES, output),
            i(attr::INPUT_TOKENS, 120),
            i(attr::OUTPUT_TOKENS, 30),
        ],
    );
    let root = span(
        1,
        1,
        None,
        0,
        vec![
            s(attr::PROMPT_NAME, "support-agent"),
            i(attr::PROMPT_VERSION, 3),
            kv(attr::FEEDBACK_SCORE, Any::DoubleValue(0.25)),
            kv(attr::FEEDBACK_SUCCESS, Any::BoolValue(false)),
            s(attr::FEEDBACK_COMMENT, "too slow"),
            s(attr::CONVERSATION_ID, "conv-9"),
        ],
    );
    let t = one(map_request(&request(vec![s("service.name", "shop")], vec![tool, chat, root]), LIMITS, "default"));
    assert_eq!(t.trace_id, "01".repeat(16));
    assert_eq!(t.spans, 3);
    let v = &t.trace;
    assert_eq!((v.prompt.as_str(), v.prompt_version), ("support-agent", Some(3)));
    assert_eq!(v.external_id.as_deref(), Some("01".repeat(16).as_str()));
    // The task input leaves the system prompt out; the step keeps it.
    assert_eq!(v.input, json!([{"role":"user","parts":[{"type":"text","content":"refund?"}]}]));
    assert_eq!(v.output, serde_json::from_str::<Value>(output).unwrap());
    let steps = v.trajectory.as_array().unwrap();
    let names: Vec<_> = steps.iter().map(|s| s["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["span-1", "span-2", "span-3"]);
    assert_eq!(steps[1]["input"][0]["role"], "system");
    assert_eq!(steps[1]["model"], "gpt-x");
    assert_eq!(steps[1]["usage"], json!({"input_tokens": 120, "output_tokens": 30}));
    assert_eq!(steps[2]["tool_call"], json!({"arguments": {"id": 7}, "result": "shipped"}));
    assert_eq!(steps[2]["parent_span_id"], "01".repeat(8));
    assert_eq!(steps[2]["offset_ms"], 3.0);
    assert_eq!(steps[2]["duration_ms"], 2.0);
    assert_eq!(
        (v.feedback.score, v.feedback.success, v.feedback.comment.as_deref()),
        (Some(0.25), Some(false), Some("too slow"))
    );
    let otel = &v.metadata["otel"];
    assert_eq!(otel["service_name"], "shop");
    assert_eq!((otel["input_tokens"].as_i64(), otel["output_tokens"].as_i64()), (Some(120), Some(30)));
    assert_eq!(otel["duration_ms"], 5.0);
    assert_eq!(otel["spans"], 3);
    assert_eq!(otel["models"], json!(["gpt-x"]));
    assert_eq!(otel["start_time"], "1970-01-01T00:00:00.000000Z");
    assert_eq!(otel["conversation_id"], "conv-9");
}

#[test]
fn older_conventions_and_message_events_map_too() {
    // Indexed gen_ai.prompt.{i}.* attributes, a string version, the prompt on the resource.
    let legacy = span(
        2,
        1,
        None,
        10,
        vec![
            s("gen_ai.prompt.0.role", "system"),
            s("gen_ai.prompt.0.content", "sys"),
            s("gen_ai.prompt.1.role", "user"),
            s("gen_ai.prompt.1.content", "hello"),
            s("gen_ai.completion.0.role", "assistant"),
            s("gen_ai.completion.0.content", "hi"),
            i(attr::LEGACY_INPUT_TOKENS, 5),
        ],
    );
    let req = request(vec![s(attr::COMBEE_PROMPT, "legacy-bot"), s(attr::COMBEE_PROMPT_VERSION, "2")], vec![legacy]);
    let t = one(map_request(&req, LIMITS, "default")).trace;
    assert_eq!((t.prompt.as_str(), t.prompt_version), ("legacy-bot", Some(2)));
    assert_eq!(t.input, json!([{"role": "user", "content": "hello"}]));
    assert_eq!(t.output, json!([{"role": "assistant", "content": "hi"}]));
    assert_eq!(t.metadata["otel"]["input_tokens"], 5);

    // Message events and a choice event; a failed span becomes feedback.error.
    let mut ev = span(3, 1, None, 10, vec![s(attr::PROMPT_NAME, "events-bot")]);
    ev.events = vec![
        Event { name: "gen_ai.system.message".into(), attributes: vec![s("content", "sys")], ..Default::default() },
        Event {
            name: "gen_ai.user.message".into(),
            attributes: vec![s("content", "what time is it"), s("gen_ai.system", "openai")],
            ..Default::default()
        },
        Event {
            name: "gen_ai.choice".into(),
            attributes: vec![i("index", 0), s("message", r#"{"role":"assistant","content":"noon"}"#)],
            ..Default::default()
        },
    ];
    ev.status = Some(Status { code: StatusCode::Error as i32, message: "rate limited".into() });
    let t = one(map_request(&request(vec![], vec![ev]), LIMITS, "default")).trace;
    assert_eq!(t.prompt_version, None);
    assert_eq!(t.input, json!([{"role": "user", "content": "what time is it"}]));
    assert_eq!(t.output, json!([{"index": 0, "message": {"role": "assistant", "content": "noon"}}]));
    assert_eq!(t.feedback.error.as_deref(), Some("span \"span-1\": rate limited"));
}

#[test]
fn explicit_combee_attributes_win() {
    let root = span(
        4,
        1,
        None,
        0,
        vec![
            s(attr::PROMPT_NAME, "p"),
            s(attr::COMBEE_INPUT, r#"{"question": "2+2"}"#),
            s(attr::COMBEE_OUTPUT, "4"),
            s(attr::FEEDBACK_GROUND_TRUTH, "4"),
            s(attr::FEEDBACK_SCORE, "1"),
            s(attr::FEEDBACK_ERROR, "none really"),
        ],
    );
    let chat = span(4, 2, Some(1), 5, vec![s(attr::LEGACY_PROMPT, "what is 2+2"), s(attr::LEGACY_COMPLETION, "5")]);
    let t = one(map_request(&request(vec![], vec![root, chat]), LIMITS, "default")).trace;
    assert_eq!(t.input, json!({"question": "2+2"}));
    assert_eq!(t.output, json!("4"));
    assert_eq!(t.feedback.ground_truth, Some(json!("4")));
    assert_eq!(t.feedback.score, Some(1.0));
    assert_eq!(t.feedback.error.as_deref(), Some("none really"));
    assert_eq!(t.trajectory[1]["input"], "what is 2+2");
}

fn rejected_reason(spans: Vec<Span>) -> String {
    let m = map_request(&request(vec![], spans), LIMITS, "default");
    assert_eq!(m.traces, vec![]);
    assert_eq!(m.rejected.len(), 1);
    m.rejected[0].reason.clone()
}

#[test]
fn unmappable_traces_are_rejected_with_a_reason_and_counted() {
    let input = || s(attr::LEGACY_PROMPT, "q");
    assert!(rejected_reason(vec![span(5, 1, None, 0, vec![input()])]).contains("belongs to no prompt"));
    assert!(rejected_reason(vec![span(5, 1, None, 0, vec![s(attr::PROMPT_NAME, "p")])]).starts_with("no input"));
    let bad_version = rejected_reason(vec![span(
        5,
        1,
        None,
        0,
        vec![s(attr::PROMPT_NAME, "p"), s(attr::PROMPT_VERSION, "v2"), input()],
    )]);
    assert!(bad_version.contains("positive integer") && bad_version.contains("v2"), "{bad_version}");
    let zero = rejected_reason(vec![span(
        5,
        1,
        None,
        0,
        vec![s(attr::PROMPT_NAME, "p"), i(attr::PROMPT_VERSION, 0), input()],
    )]);
    assert!(zero.contains("positive integer"), "{zero}");
    let two = rejected_reason(vec![
        span(5, 1, None, 0, vec![s(attr::PROMPT_NAME, "a"), input()]),
        span(5, 2, None, 0, vec![s(attr::PROMPT_NAME, "b")]),
    ]);
    assert!(two.contains("several prompts (\"a\", \"b\")"), "{two}");
    let bad_name = rejected_reason(vec![span(5, 1, None, 0, vec![s(attr::PROMPT_NAME, "Not A Name!"), input()])]);
    assert!(!bad_name.is_empty());
    let bad_score = rejected_reason(vec![span(
        5,
        1,
        None,
        0,
        vec![s(attr::PROMPT_NAME, "p"), s(attr::FEEDBACK_SCORE, "great"), input()],
    )]);
    assert!(bad_score.contains("combee.feedback.score"), "{bad_score}");
    let non_string = rejected_reason(vec![span(5, 1, None, 0, vec![i(attr::PROMPT_NAME, 3), input()])]);
    assert!(non_string.contains("must be a string"), "{non_string}");
}

#[test]
fn size_limits_apply_to_mapped_traces() {
    let big = "x".repeat(LIMITS.max_field_bytes + 1);
    let reason =
        rejected_reason(vec![span(6, 1, None, 0, vec![s(attr::PROMPT_NAME, "p"), s(attr::LEGACY_PROMPT, &big)])]);
    assert!(reason.contains("limit"), "{reason}");
}

#[test]
fn a_batch_mixes_accepted_and_rejected_traces() {
    let ok = span(7, 1, None, 0, vec![s(attr::PROMPT_NAME, "p"), s(attr::LEGACY_PROMPT, "q")]);
    let orphan_a = span(8, 1, None, 0, vec![]);
    let orphan_b = span(8, 2, Some(1), 1, vec![]);
    let mut no_id = span(0, 1, None, 0, vec![]);
    no_id.trace_id = vec![1, 2, 3];
    let m = map_request(&request(vec![], vec![orphan_a, ok, no_id, orphan_b]), LIMITS, "default");
    assert_eq!(m.traces.len(), 1);
    assert_eq!(m.rejected_spans(), 3);
    let msg = m.error_message();
    assert!(msg.starts_with("rejected 3 span(s): "), "{msg}");
    assert!(msg.contains(&"08".repeat(16)) && msg.contains("no valid trace id"), "{msg}");
}

#[test]
fn exports_split_by_trace_id_and_parts_remap_from_their_union() {
    let root = span(9, 1, None, 0, vec![s(attr::PROMPT_NAME, "p")]);
    let chat = span(9, 2, Some(1), 5, vec![s(attr::LEGACY_PROMPT, "q"), s(attr::LEGACY_COMPLETION, "a")]);
    let other = span(10, 1, None, 0, vec![s(attr::PROMPT_NAME, "p"), s(attr::LEGACY_PROMPT, "q")]);
    let mut no_span_id = span(9, 3, None, 0, vec![]);
    no_span_id.span_id = vec![0; 8];
    let (groups, rejected) =
        split_request(&request(vec![s("service.name", "shop")], vec![chat, other, no_span_id, root]));
    assert_eq!(groups.iter().map(|g| g.trace_id.as_str()).collect::<Vec<_>>(), ["09".repeat(16), "0a".repeat(16)]);
    assert_eq!(
        groups[0].spans.iter().map(|s| s.span_id.as_str()).collect::<Vec<_>>(),
        ["02".repeat(8), "01".repeat(8)]
    );
    assert_eq!(rejected.len(), 1);
    assert!(rejected[0].reason.contains("no valid span id"), "{rejected:?}");

    let id = "09".repeat(16);
    let bodies: Vec<&[u8]> = groups[0].spans.iter().map(|s| s.body.as_slice()).collect();
    // Each part alone does not map yet; together they do, in start order, with the resource.
    assert!(
        matches!(remap(&id, &bodies[..1], LIMITS, "default"), OtlpRemap::Incomplete(r) if r.contains("belongs to no prompt"))
    );
    assert!(
        matches!(remap(&id, &bodies[1..], LIMITS, "default"), OtlpRemap::Incomplete(r) if r.starts_with("no input"))
    );
    let OtlpRemap::Mapped(t) = remap(&id, &[bodies[1], bodies[0]], LIMITS, "default") else { panic!("maps") };
    let names: Vec<_> = t.trajectory.as_array().unwrap().iter().map(|s| s["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["span-1", "span-2"]);
    assert_eq!((t.input.clone(), t.metadata["otel"]["service_name"].clone()), (json!("q"), json!("shop")));

    // Spans that speak no GenAI convention are not worth holding; broken ones never map.
    let (http, _) = split_request(&request(vec![], vec![span(11, 1, None, 0, vec![s("http.route", "/")])]));
    let http_body = [http[0].spans[0].body.as_slice()];
    assert!(
        matches!(remap(&"0b".repeat(16), &http_body, LIMITS, "default"), OtlpRemap::Invalid(r) if r.contains("belongs to no prompt"))
    );
    assert!(matches!(remap(&id, &[b"not protobuf"], LIMITS, "default"), OtlpRemap::Invalid(_)));
    let too_many = vec![bodies[0]; MAX_SPANS_PER_TRACE + 1];
    assert!(matches!(remap(&id, &too_many, LIMITS, "default"), OtlpRemap::Invalid(r) if r.contains("more than")));
}

fn log_body(trace: u8, span_id: u8, at: u64, event: &str, body: Option<Any>, resource: Vec<KeyValue>) -> Vec<u8> {
    records::encode_log(ResourceLogs {
        resource: Some(Resource { attributes: resource, ..Default::default() }),
        scope_logs: vec![ScopeLogs {
            log_records: vec![LogRecord {
                trace_id: vec![trace; 16],
                span_id: vec![span_id; 8],
                observed_time_unix_nano: at,
                event_name: event.into(),
                attributes: vec![s("gen_ai.system", "openai")],
                body: body.map(|v| AnyValue { value: Some(v) }),
                ..Default::default()
            }],
            ..Default::default()
        }],
        ..Default::default()
    })
}

fn kvlist(items: Vec<KeyValue>) -> Any {
    Any::KvlistValue(KeyValueList { values: items })
}

fn span_bodies(resource: Vec<KeyValue>, spans: Vec<Span>) -> Vec<Vec<u8>> {
    let (groups, _) = split_request(&request(resource, spans));
    groups.into_iter().flat_map(|g| g.spans).map(|s| s.body).collect()
}

fn mapped(trace: u8, bodies: &[Vec<u8>]) -> ValidTrace {
    let refs: Vec<&[u8]> = bodies.iter().map(Vec::as_slice).collect();
    match remap(&format!("{trace:02x}").repeat(16), &refs, LIMITS, "default") {
        OtlpRemap::Mapped(t) => *t,
        other => panic!("not mapped: {other:?}"),
    }
}

#[test]
fn log_events_join_their_span_in_the_order_they_happened() {
    // openai-v2 with content capture: the span has no content, the log
    // records do; the prompt is on the resource of both.
    let resource = || vec![s(attr::COMBEE_PROMPT, "events-bot"), s("service.name", "agent")];
    let chat = span(20, 7, None, 1_000, vec![s(attr::OPERATION, "chat"), s(attr::REQUEST_MODEL, "m")]);
    let spans = span_bodies(resource(), vec![chat]);
    let refs: Vec<&[u8]> = spans.iter().map(Vec::as_slice).collect();
    assert!(
        matches!(remap(&"14".repeat(16), &refs, LIMITS, "default"), OtlpRemap::Incomplete(r) if r.starts_with("no input"))
    );

    let user = log_body(
        20,
        7,
        2_000,
        "gen_ai.user.message",
        Some(kvlist(vec![s("content", "where is order 7?")])),
        resource(),
    );
    let system =
        log_body(20, 7, 1_500, "gen_ai.system.message", Some(kvlist(vec![s("content", "be brief")])), resource());
    let message = kvlist(vec![s("role", "assistant"), s("content", "it shipped")]);
    let choice = log_body(
        20,
        7,
        3_000,
        "gen_ai.choice",
        Some(kvlist(vec![i("index", 0), s("finish_reason", "stop"), kv("message", message)])),
        resource(),
    );
    // Stored in any order (the store keys log records by a hash).
    let mut bodies = vec![choice.clone(), user.clone()];
    bodies.extend(spans.clone());
    bodies.push(system.clone());
    let t = mapped(20, &bodies);
    assert_eq!(t.prompt.as_str(), "events-bot");
    assert_eq!(t.input, json!([{"role": "user", "content": "where is order 7?"}]));
    assert_eq!(
        t.output,
        json!([{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "it shipped"}}])
    );
    let steps = t.trajectory.as_array().unwrap();
    assert_eq!(steps.len(), 1, "the log records are events of their span, not steps: {steps:?}");
    assert_eq!(steps[0]["input"][0], json!({"role": "system", "content": "be brief"}));

    // Without their span, the log records make a step of their own.
    let t = mapped(20, &[user, choice]);
    let steps = t.trajectory.as_array().unwrap();
    assert_eq!(steps.len(), 1);
    assert_eq!(steps[0]["name"], "log records (gen_ai.user.message)");
    assert_eq!(steps[0]["span_id"], "07".repeat(8));
}

#[test]
fn the_operation_details_event_carries_structured_messages() {
    let part = |text: &str| kvlist(vec![s("type", "text"), s("content", text)]);
    let messages = |role: &str, text: &str| {
        Any::ArrayValue(ArrayValue {
            values: vec![AnyValue {
                value: Some(kvlist(vec![
                    s("role", role),
                    kv("parts", Any::ArrayValue(ArrayValue { values: vec![AnyValue { value: Some(part(text)) }] })),
                ])),
            }],
        })
    };
    let details = records::encode_log(ResourceLogs {
        scope_logs: vec![ScopeLogs {
            log_records: vec![LogRecord {
                trace_id: vec![21; 16],
                span_id: vec![1; 8],
                time_unix_nano: 5,
                event_name: "gen_ai.client.inference.operation.details".into(),
                attributes: vec![
                    kv(attr::INPUT_MESSAGES, messages("user", "hello")),
                    kv(attr::OUTPUT_MESSAGES, messages("assistant", "hi there")),
                ],
                ..Default::default()
            }],
            ..Default::default()
        }],
        ..Default::default()
    });
    let mut bodies = span_bodies(vec![], vec![span(21, 1, None, 0, vec![s(attr::PROMPT_NAME, "p")])]);
    bodies.push(details);
    let t = mapped(21, &bodies);
    assert_eq!(t.input, json!([{"role": "user", "parts": [{"type": "text", "content": "hello"}]}]));
    assert_eq!(t.output[0]["parts"][0]["content"], "hi there");
}

#[test]
fn evaluation_results_become_feedback_and_combee_attributes_still_win() {
    let eval = |score: f64, label: &str| Event {
        name: attr::EVALUATION_EVENT.into(),
        time_unix_nano: 10,
        attributes: vec![
            s("gen_ai.evaluation.name", "correctness"),
            kv("gen_ai.evaluation.score.value", Any::DoubleValue(score)),
            s("gen_ai.evaluation.score.label", label),
            s("gen_ai.evaluation.explanation", "cites the wrong order"),
        ],
        ..Default::default()
    };
    let mut root = span(22, 1, None, 0, vec![s(attr::PROMPT_NAME, "p"), s(attr::LEGACY_PROMPT, "q")]);
    root.events = vec![eval(0.2, "fail")];
    let t = one(map_request(&request(vec![], vec![root.clone()]), LIMITS, "default")).trace;
    assert_eq!(
        (t.feedback.score, t.feedback.success, t.feedback.comment.as_deref()),
        (Some(0.2), Some(false), Some("cites the wrong order"))
    );
    assert_eq!(
        t.metadata["otel"]["evaluations"],
        json!([{"name": "correctness", "score": 0.2, "label": "fail", "explanation": "cites the wrong order"}])
    );
    // An ambiguous label leaves success alone; combee's attribute overrides the score.
    root.events = vec![eval(0.9, "relevant")];
    root.attributes.push(kv(attr::FEEDBACK_SCORE, Any::DoubleValue(1.0)));
    let t = one(map_request(&request(vec![], vec![root]), LIMITS, "default")).trace;
    assert_eq!((t.feedback.score, t.feedback.success), (Some(1.0), None));
}

#[test]
fn openinference_spans_map_with_their_session_as_the_subject() {
    let mut chain = span(
        23,
        1,
        None,
        0,
        vec![
            s("openinference.span.kind", "CHAIN"),
            s("input.value", "where is order 7?"),
            s("output.value", "it shipped"),
            s("session.id", "conv-42"),
            s("user.id", "u-1"),
        ],
    );
    chain.end_time_unix_nano = 10_000_000; // the agent's span ends after its model call
    let llm = span(
        23,
        2,
        Some(1),
        1,
        vec![
            s("openinference.span.kind", "LLM"),
            s("llm.input_messages.0.message.role", "system"),
            s("llm.input_messages.0.message.content", "be brief"),
            s("llm.input_messages.1.message.role", "user"),
            s("llm.input_messages.1.message.content", "where is order 7?"),
            s("llm.output_messages.0.message.role", "assistant"),
            s("llm.output_messages.0.message.content", "it shipped"),
            s("llm.model_name", "sim"),
            i("llm.token_count.prompt", 9),
            i("llm.token_count.completion", 3),
            s("llm.prompt_template.template", "Answer {question}"),
            s("llm.prompt_template.variables", r#"{"question": "where is order 7?"}"#),
        ],
    );
    let t =
        one(map_request(&request(vec![s(attr::COMBEE_PROMPT, "oi-bot")], vec![llm, chain]), LIMITS, "default")).trace;
    assert_eq!(t.prompt.as_str(), "oi-bot");
    assert_eq!(t.input, json!("where is order 7?"), "the first span with an input");
    assert_eq!(t.output, json!("it shipped"));
    let steps = t.trajectory.as_array().unwrap();
    assert_eq!(steps[1]["operation"], "llm");
    assert_eq!(steps[1]["system_instructions"], json!([{"role": "system", "content": "be brief"}]));
    assert_eq!(steps[1]["prompt_template"]["variables"], json!({"question": "where is order 7?"}));
    assert_eq!(t.metadata["subject"], "conv-42");
    assert_eq!(
        (t.metadata["otel"]["session_id"].as_str(), t.metadata["otel"]["user_id"].as_str()),
        (Some("conv-42"), Some("u-1"))
    );
    assert_eq!(
        (t.metadata["otel"]["input_tokens"].as_i64(), t.metadata["otel"]["models"].clone()),
        (Some(9), json!(["sim"]))
    );
}

#[test]
fn langfuse_and_vercel_spans_name_their_prompt() {
    let generation = span(
        24,
        1,
        None,
        0,
        vec![
            s("langfuse.observation.type", "generation"),
            s("langfuse.observation.prompt.name", "lf-bot"),
            i("langfuse.observation.prompt.version", 2),
            s(
                "langfuse.observation.input",
                r#"[{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]"#,
            ),
            s("langfuse.observation.output", r#"{"role": "assistant", "content": "a"}"#),
            s("langfuse.observation.usage_details", r#"{"input": 4, "output": 2, "total": 6}"#),
        ],
    );
    let t = one(map_request(&request(vec![], vec![generation]), LIMITS, "default")).trace;
    assert_eq!((t.prompt.as_str(), t.prompt_version), ("lf-bot", Some(2)));
    assert_eq!(t.input, json!([{"role": "user", "content": "q"}]));
    assert_eq!(t.output, json!({"role": "assistant", "content": "a"}));
    assert_eq!(t.metadata["otel"]["output_tokens"], 2);

    let mut root = span(
        25,
        1,
        None,
        0,
        vec![
            s("ai.telemetry.metadata.combee.prompt", "vercel-bot"),
            s("ai.telemetry.metadata.combee.prompt.version", "3"),
            s("ai.prompt", r#"{"prompt": "hello"}"#),
            s("ai.response.text", "hi"),
        ],
    );
    root.name = "ai.generateText".into();
    let t = one(map_request(&request(vec![], vec![root]), LIMITS, "default")).trace;
    assert_eq!((t.prompt.as_str(), t.prompt_version), ("vercel-bot", Some(3)));
    assert_eq!((t.input, t.output), (json!([{"role": "user", "content": "hello"}]), json!("hi")));
}

#[test]
fn content_reads_the_same_as_json_text_or_structured_values() {
    let structured_input = Any::ArrayValue(ArrayValue {
        values: vec![AnyValue { value: Some(kvlist(vec![s("role", "user"), s("content", "q")])) }],
    });
    let as_value = span(26, 1, None, 0, vec![s(attr::PROMPT_NAME, "p"), kv(attr::INPUT_MESSAGES, structured_input)]);
    let as_text = span(
        27,
        1,
        None,
        0,
        vec![s(attr::PROMPT_NAME, "p"), s(attr::INPUT_MESSAGES, r#"[{"role":"user","content":"q"}]"#)],
    );
    let m = map_request(&request(vec![], vec![as_value, as_text]), LIMITS, "default");
    assert_eq!(m.traces.len(), 2);
    assert_eq!(m.traces[0].trace.input, m.traces[1].trace.input);
}

#[test]
fn usage_an_agent_span_repeats_from_its_calls_is_counted_once() {
    let usage = |n: i64| vec![i(attr::INPUT_TOKENS, n), i(attr::OUTPUT_TOKENS, 1)];
    let mut root_attrs = usage(10);
    root_attrs.extend([s(attr::PROMPT_NAME, "p"), s(attr::LEGACY_PROMPT, "q")]);
    let root = span(28, 1, None, 0, root_attrs); // the agent: the sum of its calls
    let step = span(28, 2, Some(1), 1, vec![]);
    let first = span(28, 3, Some(2), 2, usage(4));
    let second = span(28, 4, Some(1), 3, usage(6));
    let t = one(map_request(&request(vec![], vec![root, step, first, second]), LIMITS, "default")).trace;
    assert_eq!(
        (t.metadata["otel"]["input_tokens"].as_i64(), t.metadata["otel"]["output_tokens"].as_i64()),
        (Some(10), Some(2))
    );
}
