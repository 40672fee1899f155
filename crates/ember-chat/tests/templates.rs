//! Chat templates rendered by ember-chat against renders by Python Jinja2 configured like HF
//! transformers (`tests/fixtures/gen_expected.py` -> `tests/fixtures/chat_cases.json`).
//! Tolerance: none; every prompt must be byte-identical, and every template exception must
//! surface with the template's own message.

use ember_chat::{ChatTemplate, Error, RenderRequest};
use serde_json::Value as Json;

fn cases() -> Json {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat_cases.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_str(&text).expect("chat_cases.json is JSON")
}

fn gguf_template(rel: &str) -> String {
    let gguf = ember_gguf::GgufFile::open(ember_testkit::fixture(rel)).expect("open fixture GGUF");
    gguf.get_str("tokenizer.chat_template").expect("tokenizer.chat_template").to_string()
}

/// First differing position with some context, for readable failures.
fn first_diff(got: &str, want: &str) -> String {
    let at = got.bytes().zip(want.bytes()).take_while(|(a, b)| a == b).count();
    let lo = at.saturating_sub(60);
    let ctx = |s: &str| s.get(lo..(at + 60).min(s.len())).unwrap_or("<non-char boundary>").to_string();
    format!("first difference at byte {at}\n  got:  {:?}\n  want: {:?}", ctx(got), ctx(want))
}

#[test]
fn renders_match_python_jinja2() {
    let doc = cases();
    let templates = doc["templates"].as_object().unwrap();
    let mut compiled = std::collections::HashMap::new();
    for (name, t) in templates {
        let source = t["source"].as_str().unwrap();
        if let Some(rel) = t["gguf"].as_str() {
            // The fixture was generated from the template the GGUF carries now.
            assert_eq!(gguf_template(rel), source, "template of {rel} changed; rerun gen_expected.py");
        }
        compiled.insert(name.clone(), ChatTemplate::new(source).unwrap_or_else(|e| panic!("{name}: {e}")));
    }

    let mut failures = Vec::new();
    let cases = doc["cases"].as_array().unwrap();
    for case in cases {
        let id = format!("{}/{}", case["template"].as_str().unwrap(), case["name"].as_str().unwrap());
        let tmpl = &compiled[case["template"].as_str().unwrap()];
        let req = RenderRequest {
            messages: case["messages"].as_array().unwrap(),
            tools: Some(&case["tools"]).filter(|t| !t.is_null()),
            add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
            kwargs: case["kwargs"].as_object().unwrap().clone(),
            bos_token: None,
            eos_token: case["eos_token"].as_str().map(String::from),
        };
        let got = tmpl.render(&req);
        match (&got, case.get("expected"), case["error_kind"].as_str()) {
            (Ok(got), Some(want), _) => {
                let want = want.as_str().unwrap();
                if got != want {
                    failures.push(format!("{id}: {}", first_diff(got, want)));
                }
            }
            (Err(Error::Template { message }), None, Some("raise")) => {
                let want = case["error"].as_str().unwrap();
                if message != want {
                    failures.push(format!("{id}: raised {message:?}, Jinja2 raised {want:?}"));
                }
            }
            // Python type errors (`str + None`): both engines must refuse; messages differ.
            (Err(Error::Render(_)), None, Some("other")) => {}
            (got, _, _) => failures.push(format!("{id}: got {got:?}, want {case}")),
        }
    }
    assert!(failures.is_empty(), "{} of {} cases differ:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

#[test]
fn tiny_model_prompt_example() {
    let text = std::fs::read_to_string(ember_testkit::fixture("tiny-a/cases.json")).unwrap();
    let doc: Json = serde_json::from_str(&text).unwrap();
    let want = doc["tokenizer"]["chat_prompt_example"]["text"].as_str().unwrap();
    let tmpl = ChatTemplate::new(&gguf_template("tiny-a/gguf/tiny-a-Q8_0.gguf")).unwrap();
    let messages = [serde_json::json!({"role": "user", "content": "Write one sentence about the sea."})];
    assert_eq!(tmpl.render(&RenderRequest::new(&messages)).unwrap(), want);
}

fn qwen() -> ChatTemplate {
    ChatTemplate::new(&gguf_template("qwen36-vocab/ggml-vocab-qwen36.gguf")).unwrap()
}

#[test]
fn invalid_arguments_string_names_the_message() {
    let messages = [
        serde_json::json!({"role": "user", "content": "hi"}),
        serde_json::json!({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"type": "function", "function": {"name": "g", "arguments": "{\"x\": 1,"}},
        ]}),
    ];
    match qwen().render(&RenderRequest::new(&messages)) {
        Err(e @ Error::ToolCallArguments { message: 1, call: 1, .. }) => {
            assert!(e.to_string().starts_with("messages[1].tool_calls[1].function.arguments is not valid JSON"), "{e}");
        }
        other => panic!("want ToolCallArguments for message 1 call 1, got {other:?}"),
    }
}

#[test]
fn reserved_kwargs_rejected() {
    let messages = [serde_json::json!({"role": "user", "content": "hi"})];
    let mut req = RenderRequest::new(&messages);
    req.kwargs.insert("messages".into(), Json::Array(vec![]));
    assert!(matches!(qwen().render(&req), Err(Error::ReservedKwarg(k)) if k == "messages"));
}

#[test]
fn syntax_error_names_the_cause() {
    let err = ChatTemplate::new("{% for m in messages %}{{ m.content }}").unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, Error::Syntax(_)), "{err:?}");
    assert!(text.contains("unexpected end of input") && text.contains("(in chat_template:1)"), "{text}");
}

#[test]
fn render_error_is_not_a_template_exception() {
    let tmpl = ChatTemplate::new("{{ messages[0].content + 1 }}").unwrap();
    let messages = [serde_json::json!({"role": "user", "content": "hi"})];
    assert!(matches!(tmpl.render(&RenderRequest::new(&messages)), Err(Error::Render(_))));
}

#[test]
fn raise_inside_macro_keeps_message() {
    let tmpl = ChatTemplate::new("{% macro f(x) %}{{ raise_exception('bad ' ~ x) }}{% endmacro %}{{ f(3) | trim }}").unwrap();
    match tmpl.render(&RenderRequest::new(&[])) {
        Err(Error::Template { message }) => assert_eq!(message, "bad 3"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn strftime_now_renders_a_date() {
    let tmpl = ChatTemplate::new("{{ strftime_now('%Y-%m-%d') }}").unwrap();
    let out = tmpl.render(&RenderRequest::new(&[])).unwrap();
    assert_eq!(out.len(), 10, "{out}");
    assert!(out.starts_with("20") && out.as_bytes()[4] == b'-' && out.as_bytes()[7] == b'-', "{out}");
}

#[test]
fn template_is_shareable() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<ChatTemplate>();
}
