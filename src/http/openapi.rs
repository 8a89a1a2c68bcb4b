//! The OpenAPI document as clients and fuzzers need it, and its route. utoipa
//! generates the operations from the handlers' annotations; this module then states what the
//! annotations cannot say once for all routes: every error answer is an RFC 9457
//! `application/problem+json` Problem (400/401/403/404/413/415/422/503 wherever
//! the extractors and handlers can produce them), integers carry the bounds of
//! their Rust types, free-form JSON fields are "any JSON" rather than `object`,
//! and the real input rules (name patterns, page-token grammar, non-empty
//! batches, `batch_size` = `"auto"` or a number) are in the schemas, so a
//! schema-driven fuzzer and the server agree on what is valid.

use std::sync::OnceLock;

use serde_json::{Map, Value, json};
use utoipa::OpenApi;

use crate::domain::prompt::{MAX_BULLETS, MAX_CHARS, MAX_WAIT_SECS};

/// A prompt or label name.
pub const NAME_PATTERN: &str = "^[a-z0-9][a-z0-9._-]{0,63}$";
/// A prompt as a caller writes it: its name within the key's project, or `project/name`.
pub const PROMPT_PATTERN: &str = "^([a-z0-9][a-z0-9._-]{0,63}/)?[a-z0-9][a-z0-9._-]{0,63}$";
/// A label name that can be stored (`latest` and `history` are reserved).
const STORED_LABEL_PATTERN: &str = "^(?!(latest|history)$)[a-z0-9][a-z0-9._-]{0,63}$";
const PROBLEM_REF: &str = "#/components/schemas/Problem";

/// The finished document, built once.
pub fn document() -> &'static Value {
    static DOC: OnceLock<Value> = OnceLock::new();
    DOC.get_or_init(|| {
        let mut doc = serde_json::to_value(ApiDoc::openapi()).unwrap_or_else(|_| json!({}));
        finish(&mut doc);
        doc
    })
}

fn problem(description: &str) -> Value {
    json!({"description": description, "content": {"application/problem+json": {"schema": {"$ref": PROBLEM_REF}}}})
}

fn default_description(code: &str) -> &'static str {
    match code {
        "400" => "malformed request: bad JSON, a query or path parameter of the wrong type, a bad header",
        "401" => "no API key, or an unknown or revoked one (inbound webhooks: a bad signature)",
        "403" => "the API key lacks the scope this operation needs",
        "404" => "no such resource",
        "409" => "conflicts with the current state",
        "412" => "the precondition (If-Match) failed",
        "413" => "the body or one of its fields is larger than the configured limits",
        "415" => "the body is not sent as JSON",
        "422" => "the body is well-formed JSON that breaks a rule; `detail` says which",
        "503" => "the store is unavailable or the request took too long; retry shortly",
        _ => "error",
    }
}

/// Applies every rule in the module doc to a generated document.
pub fn finish(doc: &mut Value) {
    // First, from the types utoipa saw (`minimum: 0` marks an unsigned type); the
    // rules below may then raise a minimum without changing the type's range.
    bound_integers(doc);
    if let Some(paths) = doc.get_mut("paths").and_then(Value::as_object_mut) {
        for (path, item) in paths.iter_mut() {
            let Some(item) = item.as_object_mut() else { continue };
            for (_, op) in item.iter_mut() {
                if let Some(op) = op.as_object_mut() {
                    finish_operation(path, op);
                }
            }
        }
    }
    if let Some(schemas) = doc.pointer_mut("/components/schemas").and_then(Value::as_object_mut) {
        finish_schemas(schemas);
    }
    // `POST /v1/traces` takes one trace or a batch.
    if let Some(schema) = doc.pointer_mut("/paths/~1v1~1traces/post/requestBody/content/application~1json/schema") {
        *schema =
            json!({"oneOf": [{"$ref": "#/components/schemas/TraceBatch"}, {"$ref": "#/components/schemas/NewTrace"}]});
    }
    // The OTLP JSON encoding of an export: an object (unknown members are ignored).
    for (path, member) in [
        ("/v1/otlp/v1/traces", "resourceSpans"),
        ("/v1/otlp/v1/logs", "resourceLogs"),
        ("/api/public/otel/v1/traces", "resourceSpans"),
    ] {
        let pointer = format!("/paths/{}/post/requestBody", path.replace('/', "~1"));
        if let Some(body) = doc.pointer_mut(&pointer) {
            body["required"] = json!(true);
            body["content"]["application/json"] = json!({"schema": {"type": "object",
                "properties": {member: {"type": "array", "items": {"type": "object"}}}}});
            body["content"]["application/x-protobuf"] = json!({"schema": {"type": "string", "format": "binary"}});
        }
    }
    // A round trigger's body is optional: an empty one means all defaults.
    for trigger in
        ["/paths/~1v1~1prompts~1{name}~1rounds/post/requestBody", "/paths/~1v1~1hooks~1rounds~1{name}/post/requestBody"]
    {
        if let Some(body) = doc.pointer_mut(trigger) {
            body["required"] = json!(false);
        }
    }
}

fn finish_operation(path: &str, op: &mut Map<String, Value>) {
    let v1 = path.starts_with("/v1/");
    let secured = op.get("security").is_some_and(|s| s.as_array().is_some_and(|a| !a.is_empty()));
    let params: Vec<Value> = op.get("parameters").and_then(Value::as_array).cloned().unwrap_or_default();
    let has_path = params.iter().any(|p| p["in"] == "path");
    let has_body = op.contains_key("requestBody");

    for p in op.get_mut("parameters").and_then(Value::as_array_mut).into_iter().flatten() {
        finish_parameter(path, p);
    }

    let responses = op.entry("responses").or_insert_with(|| json!({}));
    let Some(responses) = responses.as_object_mut() else { return };
    let mut codes: Vec<&str> = Vec::new();
    if v1 {
        codes.push("503");
        if secured || path.starts_with("/v1/hooks/") {
            codes.push("401");
        }
        if secured {
            codes.push("403");
        }
        if !params.is_empty() || has_body {
            codes.push("400");
        }
        if has_path || params.iter().any(|p| p["name"] == "prompt") {
            codes.push("404");
        }
        if has_body {
            codes.extend(["413", "415", "422"]);
        }
    }
    // A version named in the body that does not exist (yet) conflicts with the prompt's state.
    if matches!(
        path,
        "/v1/prompts/{name}/versions"
            | "/v1/prompts/{name}/rollback"
            | "/v1/prompts/{name}/labels/{label}"
            | "/v1/prompts/{name}/versions/{number}/evaluation"
    ) && has_body
    {
        codes.push("409");
    }
    for code in codes {
        responses.entry(code.to_owned()).or_insert_with(|| problem(default_description(code)));
    }
    // Every error answer is a problem document, whatever the annotation said.
    for (code, res) in responses.iter_mut() {
        if code.starts_with('4') || code.starts_with('5') {
            let description = res
                .get("description")
                .and_then(Value::as_str)
                .filter(|d| !d.is_empty())
                .map_or_else(|| default_description(code).to_owned(), str::to_owned);
            *res = problem(&description);
        } else if res.get("description").and_then(Value::as_str).is_none_or(str::is_empty) {
            res["description"] = json!("success");
        }
    }
}

/// The cursor grammar of each list's `page_token`: the token is opaque to a
/// client (pass `next_page_token` back unchanged), but every string of this
/// grammar is one the server accepts.
fn page_token_pattern(path: &str) -> &'static str {
    match path {
        // The last prompt of the page, `project/name`.
        "/v1/prompts" => "^[a-z0-9][a-z0-9._-]{0,63}/[a-z0-9][a-z0-9._-]{0,63}$",
        "/v1/prompts/{name}/versions"
        | "/v1/webhooks/{id}/deliveries"
        | "/v1/prompts/{name}/labels/history"
        | "/v1/prompts/{name}/population"
        | "/v1/audit" => "^[0-9]{1,18}$",
        _ => "^[0-9a-f]{32}$",
    }
}

fn finish_parameter(path: &str, p: &mut Value) {
    let name = p["name"].as_str().unwrap_or_default().to_owned();
    let place = p["in"].as_str().unwrap_or_default().to_owned();
    let Some(schema) = p.get_mut("schema") else { return };
    // A query parameter or header is present or absent, never `null`.
    if let Some(types) = schema.get_mut("type").and_then(Value::as_array_mut) {
        types.retain(|t| t != "null");
        if types.len() == 1 {
            let only = types[0].clone();
            schema["type"] = only;
        }
    }
    match (place.as_str(), name.as_str()) {
        ("query", "page_token") => {
            schema["pattern"] = json!(page_token_pattern(path));
            p["description"] = json!("opaque: the `next_page_token` of the previous page, unchanged");
        }
        // The label history's filter names a stored label: never `latest` or `history`.
        ("path", "label") | ("query", "label") if place == "path" || path.ends_with("/labels/history") => {
            schema["pattern"] = json!(STORED_LABEL_PATTERN)
        }
        // A prompt's route names the prompt in the key's project, or `project/name`.
        ("path", "name") if !path.starts_with("/v1/projects/") => {
            schema["pattern"] = json!(PROMPT_PATTERN);
            p["description"] = json!(
                "the prompt's name within the key's project, or `project/name` with the `/` percent-encoded \
                 (`team-a%2Fsupport-agent`); a server-wide key's bare name is `default`'s prompt"
            );
        }
        ("query", "prompt") => schema["pattern"] = json!(PROMPT_PATTERN),
        ("path", "name") | ("query", "label") => schema["pattern"] = json!(NAME_PATTERN),
        ("query", "version") | ("path", "number") | ("query", "from") | ("query", "to") => schema["minimum"] = json!(1),
        ("header", "Idempotency-Key") => schema["pattern"] = json!("^[!-~]{1,255}$"),
        ("query", "actor" | "action" | "resource_type" | "resource_id") if path == "/v1/audit" => {
            schema["minLength"] = json!(1);
            schema["maxLength"] = json!(200);
        }
        _ => {}
    }
}

/// Any JSON value (`{}` in JSON Schema), keeping the description.
fn any_json(old: &Value) -> Value {
    match old.get("description") {
        Some(d) => json!({"description": d}),
        None => json!({}),
    }
}

fn finish_schemas(schemas: &mut Map<String, Value>) {
    let mut set = |schema: &str, prop: &str, f: &dyn Fn(&Value) -> Value| {
        if let Some(p) = schemas.get_mut(schema).and_then(|s| s.pointer_mut(&format!("/properties/{prop}"))) {
            *p = f(p);
        }
    };
    let merge = |extra: Value| {
        move |old: &Value| {
            let mut v = old.clone();
            if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
                for (k, x) in e {
                    o.insert(k.clone(), x.clone());
                }
            }
            v
        }
    };
    let replace = |new: Value| {
        move |old: &Value| {
            let mut v = new.clone();
            if let Some(d) = old.get("description") {
                v["description"] = d.clone();
            }
            v
        }
    };

    // Free-form JSON: any value (input must not be null).
    for (schema, prop) in [
        ("NewTrace", "trajectory"),
        ("NewTrace", "output"),
        ("NewTrace", "reflection"),
        ("Trace", "input"),
        ("Trace", "trajectory"),
        ("Trace", "output"),
        ("Trace", "reflection"),
        ("Feedback", "ground_truth"),
        ("ControllerView", "choice"),
        ("ControllerView", "last_choice"),
        ("ControllerView", "config"),
        ("RegressionCase", "input"),
        ("Gate", "harness"),
        ("EvaluationResult", "details"),
    ] {
        set(schema, prop, &any_json);
    }
    set("NewTrace", "input", &replace(json!({"not": {"type": "null"}})));
    // Regression cases: the input is any JSON but null; one to 20 checks; a name of 1–200 characters.
    set("CaseRequest", "input", &replace(json!({"not": {"type": "null"}})));
    set(
        "CaseRequest",
        "checks",
        &merge(json!({"minItems": 1, "maxItems": crate::domain::regression::MAX_CHECKS_PER_CASE})),
    );
    set("CaseRequest", "name", &merge(json!({"minLength": 1, "maxLength": 200, "pattern": "\\S"})));
    set("PinRequest", "name", &merge(json!({"minLength": 1, "maxLength": 200, "pattern": "\\S"})));
    set(
        "PinRequest",
        "checks",
        &merge(json!({"minItems": 1, "maxItems": crate::domain::regression::MAX_CHECKS_PER_CASE})),
    );
    set("GateSettingsView", "harness_timeout_secs", &merge(json!({"minimum": 1, "maximum": 2_592_000})));
    set("EvaluationResult", "score", &merge(json!({"minimum": 0, "maximum": 1})));
    set("EvaluationResult", "production_score", &merge(json!({"minimum": 0, "maximum": 1})));
    set("EvaluationResult", "reason", &merge(json!({"maxLength": crate::service::gate::MAX_HARNESS_REASON_CHARS})));
    set("NewTrace", "prompt", &merge(json!({"pattern": PROMPT_PATTERN})));
    set("NewTrace", "prompt_version", &merge(json!({"minimum": 1})));
    set("NewTrace", "external_id", &merge(json!({"minLength": 1, "maxLength": 200})));
    set("TraceBatch", "traces", &merge(json!({"minItems": 1})));
    set("CreatePrompt", "name", &merge(json!({"pattern": NAME_PATTERN})));
    set("CreatePrompt", "base", &merge(json!({"minLength": 1, "pattern": "\\S"})));
    set("CreateKey", "name", &merge(json!({"minLength": 1, "maxLength": 100, "pattern": "\\S"})));
    set("CreateKey", "scopes", &merge(json!({"minItems": 1})));
    set(
        "CreateWebhook",
        "events",
        &merge(
            json!({"minItems": 1, "items": {"type": "string", "enum": crate::domain::event::EventType::ALL.map(|e| e.as_str())}}),
        ),
    );
    set("CreateWebhook", "url", &merge(json!({"format": "uri", "pattern": "^https?://", "maxLength": 2048})));
    set("TriggerRound", "batch_size", &merge(json!({"minimum": 1, "maximum": 10000})));
    set("TriggerRound", "method", &merge(json!({"enum": ["combee", "naive", "sequential", null]})));
    set("CreateVersion", "labels", &merge(json!({"items": {"type": "string", "pattern": NAME_PATTERN}})));
    set("CreateVersion", "parent", &merge(json!({"minimum": 1})));
    set("CreateVersion", "base", &merge(json!({"minLength": 1, "pattern": "\\S"})));
    set("MoveLabel", "version", &merge(json!({"minimum": 1})));
    set("MoveLabel", "reason", &merge(json!({"maxLength": 2000})));
    set("Rollback", "to", &merge(json!({"minimum": 1})));
    set(
        "PromptSettings",
        "batch_size",
        &replace(
            json!({"oneOf": [{"type": "string", "enum": ["auto"]}, {"type": "integer", "minimum": 1, "maximum": 10000}]}),
        ),
    );
    set("PromptSettings", "duplication", &merge(json!({"minimum": 1, "maximum": 8})));
    set("PromptSettings", "max_wait_secs", &merge(json!({"minimum": 0, "maximum": MAX_WAIT_SECS})));
    set("PromptSettings", "max_bullets", &merge(json!({"minimum": 0, "maximum": MAX_BULLETS})));
    set("PromptSettings", "max_chars", &merge(json!({"minimum": 0, "maximum": MAX_CHARS})));
    set("PromptSettings", "max_removal_share", &merge(json!({"minimum": 0, "maximum": 1})));
    set("PromptSettings", "pinned_bullets", &merge(json!({"maxItems": 1000})));
    set("EvaluatorList", "evaluators", &merge(json!({"maxItems": crate::evaluate::evaluators::MAX_EVALUATORS})));
    // Playbook::normalized's rules.
    set("Playbook", "sections", &merge(json!({"uniqueItems": true})));
    set("Section", "name", &merge(json!({"maxLength": 64, "pattern": "^[^\\n]*\\S[^\\n]*$"})));
    set("Bullet", "id", &merge(json!({"pattern": "^(b-[0-9]{1,12})?$"})));
    set("Playbook", "next_id", &merge(json!({"maximum": crate::domain::playbook::MAX_BULLET_NUMBER + 1})));
    set("Bullet", "content", &merge(json!({"pattern": "\\S"})));
    set("PromptSettings", "reduce", &merge(json!({"enum": ["union", "llm"]})));
    set("PromptSettings", "pinned_bullets", &merge(json!({"items": {"type": "string", "pattern": "^b-[0-9]{1,12}$"}})));
    // Requeue: `ids` (1-1000) or `all: true`, either narrowed by `since`.
    if let Some(requeue) = schemas.get_mut("RequeueRequest") {
        let since = requeue.pointer("/properties/since").cloned().unwrap_or_else(|| json!({}));
        let ids =
            json!({"type": "array", "minItems": 1, "maxItems": 1000, "items": {"type": "string", "format": "uuid"}});
        *requeue = json!({"oneOf": [
            {"type": "object", "required": ["ids"], "additionalProperties": false,
             "properties": {"ids": ids, "all": {"const": false}, "since": since}},
            {"type": "object", "required": ["all"], "additionalProperties": false,
             "properties": {"all": {"const": true}, "since": since}},
        ]});
    }
    // A rewrite prompt has no playbook.
    if let Some(create) = schemas.get_mut("CreatePrompt").and_then(Value::as_object_mut) {
        create.insert(
            "not".into(),
            json!({"required": ["strategy", "playbook"],
                   "properties": {"strategy": {"const": "rewrite"}, "playbook": {"type": "object"}}}),
        );
    }
}

/// Integer bounds from the Rust types utoipa names in `format` (and `minimum: 0` for unsigned).
fn bound_integers(v: &mut Value) {
    match v {
        Value::Object(o) => {
            let is_int = match o.get("type") {
                Some(Value::String(t)) => t == "integer",
                Some(Value::Array(ts)) => ts.iter().any(|t| t == "integer"),
                _ => false,
            };
            if is_int {
                let unsigned = o.get("minimum").and_then(Value::as_f64).is_some_and(|m| m >= 0.0);
                let (lo, hi): (Value, Value) = match (o.get("format").and_then(Value::as_str), unsigned) {
                    (Some("int32"), false) => (json!(i32::MIN), json!(i32::MAX)),
                    (Some("int32"), true) => (json!(0), json!(u32::MAX)),
                    (Some("int64"), false) => (json!(i64::MIN), json!(i64::MAX)),
                    (_, true) => (json!(0), json!(u64::MAX)),
                    _ => (json!(i64::MIN), json!(i64::MAX)),
                };
                o.entry("minimum").or_insert(lo);
                o.entry("maximum").or_insert(hi);
                // A `u32` is wider than `int32`: say `int64`, which holds it, so a
                // client or fuzzer does not stop at 2^31 − 1.
                if unsigned && o.get("format").and_then(Value::as_str) == Some("int32") {
                    o.insert("format".into(), json!("int64"));
                }
            }
            for (_, x) in o.iter_mut() {
                bound_integers(x);
            }
        }
        Value::Array(a) => a.iter_mut().for_each(bound_integers),
        _ => {}
    }
}

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).bearer_format("cmb_…").build()),
        );
        // The Langfuse-compatible routes: the key's prefix and the key as a Basic pair.
        components.add_security_scheme(
            "basic",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Basic).build()),
        );
    }
}

#[derive(OpenApi)]
#[openapi(
    info(title = "combee", description = "Continuous agent self-improvement: versioned system prompts learned from agent traces."),
    paths(
        super::ops::healthz, super::ops::readyz, super::ops::metrics,
        super::prompts::create_prompt, super::prompts::list_prompts, super::prompts::get_prompt,
        super::settings::update_settings,
        super::evaluators::get_evaluators, super::evaluators::put_evaluators, super::evaluators::get_calibration,
        super::versions::create_version, super::versions::list_versions, super::versions::get_version,
        super::versions::diff_versions, super::labels::list_labels, super::labels::move_label,
        super::labels::delete_label, super::labels::rollback, super::label_history::label_history, super::prompts::get_population,
        super::traces::post_traces, super::traces::list_traces, super::traces::get_trace, super::traces::add_feedback,
        super::otlp::export_traces, super::otlp::export_logs,
        super::traces::requeue_failed,
        super::traces::quarantine_trace, super::traces::release_trace, super::traces::delete_trace, super::traces::quarantine_traces,
        super::keys::create_key, super::keys::list_keys, super::keys::revoke_key,
        super::members::list_members, super::members::set_member, super::members::remove_member,
        super::rounds::trigger_round, super::rounds::webhook_round, super::rounds::get_round, super::rounds::list_rounds,
        super::rounds::get_learning, super::rounds::clear_backoff,
        super::controller::get_controller, super::outcomes::prompt_metrics, super::budget::get_spend,
        super::webhooks::create_webhook, super::webhooks::list_webhooks, super::webhooks::get_webhook,
        super::webhooks::delete_webhook, super::webhooks::list_deliveries,
        super::langfuse::get_prompt, super::langfuse::export_traces, super::export::export_traces,
        super::audit::audit_log,
        super::projects::list_projects, super::projects::create_project, super::projects::get_project,
        super::projects::update_project,
        super::regression::add_case, super::regression::list_cases, super::regression::delete_case,
        super::regression::import_cases, super::regression::pin_trace, super::regression::get_gate_settings,
        super::regression::put_gate_settings, super::regression::get_version_gate, super::regression::post_evaluation,
    ),
    modifiers(&BearerAuth)
)]
pub struct ApiDoc;

/// `GET /v1/openapi.json`: the document with the rules utoipa cannot state.
pub async fn openapi() -> axum::Json<Value> {
    axum::Json(document().clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_answer_is_a_documented_problem() {
        let doc = document();
        let mut operations = 0;
        for (path, item) in doc["paths"].as_object().unwrap() {
            if !path.starts_with("/v1/") {
                continue;
            }
            for (method, op) in item.as_object().unwrap() {
                operations += 1;
                let responses = op["responses"].as_object().unwrap();
                let errors: Vec<&String> =
                    responses.keys().filter(|c| c.starts_with('4') || c.starts_with('5')).collect();
                assert!(errors.iter().any(|c| *c == "503"), "{method} {path}");
                if op.get("security").is_some() {
                    assert!(responses.contains_key("401") && responses.contains_key("403"), "{method} {path}");
                }
                if op.get("requestBody").is_some() {
                    for code in ["400", "413", "415", "422"] {
                        assert!(responses.contains_key(code), "{method} {path} {code}");
                    }
                }
                for code in errors {
                    let content = &responses[code]["content"];
                    assert_eq!(
                        content["application/problem+json"]["schema"]["$ref"], PROBLEM_REF,
                        "{method} {path} {code}"
                    );
                    assert!(content.get("application/json").is_none(), "{method} {path} {code}");
                }
            }
        }
        assert!(operations > 30, "{operations}");
    }

    #[test]
    fn the_real_input_rules_are_stated() {
        let doc = document();
        let schemas = &doc["components"]["schemas"];
        assert_eq!(schemas["TraceBatch"]["properties"]["traces"]["minItems"], 1);
        assert_eq!(schemas["CreatePrompt"]["properties"]["name"]["pattern"], NAME_PATTERN);
        let batch = &schemas["PromptSettings"]["properties"]["batch_size"]["oneOf"];
        assert_eq!(batch[0]["enum"], json!(["auto"]));
        assert_eq!((batch[1]["type"].as_str(), batch[1]["maximum"].as_i64()), (Some("integer"), Some(10_000)));
        // Free-form JSON is any JSON, not an object.
        assert_eq!(schemas["Trace"]["properties"]["output"].get("type"), None);
        assert_eq!(schemas["NewTrace"]["properties"]["input"]["not"], json!({"type": "null"}));
        // Page parameters are query parameters with the list's token grammar.
        let params = doc["paths"]["/v1/traces"]["get"]["parameters"].as_array().unwrap();
        let token = params.iter().find(|p| p["name"] == "page_token").unwrap();
        assert_eq!(
            (token["in"].as_str(), token["schema"]["pattern"].as_str()),
            (Some("query"), Some("^[0-9a-f]{32}$"))
        );
        let size = params.iter().find(|p| p["name"] == "page_size").unwrap();
        assert_eq!(
            (size["in"].as_str(), size["schema"]["maximum"].as_u64()),
            (Some("query"), Some(u64::from(u32::MAX)))
        );
        // The merge patch of settings is typed member by member.
        let patch = &doc["paths"]["/v1/prompts/{name}/settings"]["patch"]["requestBody"]["content"];
        assert!(patch["application/merge-patch+json"]["schema"].is_object());
    }
}
