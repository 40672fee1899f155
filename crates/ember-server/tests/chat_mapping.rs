//! Issue 17: chat messages as OpenAI clients send them, mapped by `map_messages`, then rendered
//! by the real Qwen3.6 template (tests/fixtures/qwen36-vocab) and the tiny fixture's simple one
//! (tests/fixtures/tiny-a, which concatenates `content` with `+` and so fails on `null`).
//!
//! Exact checks: every accepted request renders on both templates; equivalent spellings
//! (`content` null / missing / "" / parts) render byte-identical prompts; and, over random
//! message lists, the mapping either refuses (a 400 naming a `messages[..]` field) or the
//! templates render, never failing on a value type (only the template's own
//! `raise_exception`, such as Qwen's "No user query found", may refuse).

use std::sync::LazyLock;

use ember_chat::{ChatTemplate, Error, RenderRequest};
use ember_server::map_messages;
use proptest::prelude::*;
use serde_json::{Value, json};

fn template(rel: &str) -> ChatTemplate {
    let gguf = ember_gguf::GgufFile::open(ember_testkit::fixture(rel)).expect("open fixture GGUF");
    ChatTemplate::new(gguf.get_str("tokenizer.chat_template").expect("tokenizer.chat_template")).expect("compiles")
}

/// Compiled once: opening the 11 MB vocabulary GGUF per proptest case would dominate.
static TEMPLATES: LazyLock<[(&str, ChatTemplate); 2]> =
    LazyLock::new(|| [("qwen36", template("qwen36-vocab/ggml-vocab-qwen36.gguf")), ("tiny-a", template("tiny-a/gguf/tiny-a-Q8_0.gguf"))]);

fn render(t: &ChatTemplate, messages: &[Value]) -> Result<String, Error> {
    t.render(&RenderRequest::new(messages))
}

/// One tool round as the OpenAI Python client sends it.
fn tool_round(content: Option<Value>, arguments: Value) -> Value {
    let mut assistant = json!({
        "role": "assistant",
        "tool_calls": [{ "id": "call_1", "type": "function", "function": { "name": "get_weather", "arguments": arguments } }],
    });
    if let Some(c) = content {
        assistant["content"] = c;
    }
    json!([
        { "role": "developer", "content": "Be brief." },
        { "role": "user", "content": [{ "type": "text", "text": "Weather in " }, { "type": "text", "text": "Paris?" }] },
        assistant,
        { "role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": [{ "type": "text", "text": "18 C" }] },
    ])
}

#[test]
fn r17_tool_round_with_null_content_renders_on_both_templates() {
    for (name, t) in TEMPLATES.iter() {
        let mut prompts = Vec::new();
        for content in [Some(json!(null)), None, Some(json!("")), Some(json!([]))] {
            for args in [json!("{\"city\": \"Paris\"}"), json!({ "city": "Paris" })] {
                let raw = tool_round(content.clone(), args);
                // The request as sent fails on the simple template: what the issue reported.
                if *name == "tiny-a" && content.is_none() {
                    assert!(matches!(render(t, raw.as_array().unwrap()), Err(Error::Render(_))));
                }
                let mapped = map_messages(raw.as_array().unwrap()).expect("accepted");
                prompts.push(render(t, &mapped).unwrap_or_else(|e| panic!("{name}: {e}")));
            }
        }
        assert!(prompts.iter().all(|p| *p == prompts[0]), "{name}: every spelling renders the same prompt");
        let p = &prompts[0];
        assert!(p.starts_with("<|im_start|>system\nBe brief.<|im_end|>\n"), "{name}: developer -> system: {p}");
        assert!(p.contains("Weather in Paris?"), "{name}: text parts joined: {p}");
        if *name == "qwen36" {
            assert!(p.contains("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>"), "{p}");
            assert!(p.contains("<tool_response>\n18 C\n</tool_response>"), "{p}");
        }
    }
}

#[test]
fn r17_unknown_role_is_refused_before_the_template() {
    let e = map_messages(&[json!({ "role": "wizard", "content": "hi" })]).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("messages[0].role"));
    assert_eq!(e.status.as_u16(), 400);
}

/// Random message lists from the pieces clients send, valid and not.
fn message() -> impl Strategy<Value = Value> {
    let text =
        prop_oneof![Just(json!("hi")), Just(json!("")), Just(json!("<think>a</think>b")), Just(json!("<tool_response>x</tool_response>"))];
    let part = prop_oneof![
        text.clone().prop_map(|t| json!({ "type": "text", "text": t })),
        text.clone().prop_map(|t| json!({ "text": t })),
        Just(json!({ "type": "refusal", "refusal": "no" })),
        Just(json!({ "type": "image_url", "image_url": { "url": "x" } })),
        Just(json!({ "type": "text" })),
        Just(json!("bare")),
    ];
    let content = prop_oneof![
        Just(None),
        Just(Some(json!(null))),
        text.clone().prop_map(Some),
        prop::collection::vec(part, 0..3).prop_map(|p| Some(Value::Array(p))),
        Just(Some(json!(5))),
        Just(Some(json!({ "a": 1 }))),
    ];
    let args = prop_oneof![
        Just(json!("{\"a\": 1, \"b\": [1, 2], \"c\": {\"d\": null}}")),
        Just(json!({ "q": "x y" })),
        Just(json!("")),
        Just(json!(null)),
        Just(json!("[1]")),
        Just(json!("{bad")),
        Just(json!(7)),
    ];
    let call = prop_oneof![
        args.prop_map(|a| json!({ "id": "c", "type": "function", "function": { "name": "f", "arguments": a } })),
        Just(json!({ "function": { "name": "g" } })),
        Just(json!({ "type": "function", "function": { "arguments": "{}" } })),
        Just(json!({ "function": "f" })),
    ];
    let role = prop_oneof![
        Just(json!("system")),
        Just(json!("developer")),
        Just(json!("user")),
        Just(json!("user")),
        Just(json!("assistant")),
        Just(json!("tool")),
        Just(json!("function")),
        Just(json!("wizard")),
        Just(json!(null)),
        Just(json!(1)),
    ];
    let extra = prop_oneof![
        Just(None),
        Just(Some(("name", json!("n")))),
        Just(Some(("name", json!(3)))),
        Just(Some(("tool_call_id", json!("c")))),
        Just(Some(("reasoning_content", json!("why")))),
        Just(Some(("reasoning_content", json!(null)))),
        Just(Some(("reasoning_content", json!(["x"])))),
        Just(Some(("tool_calls", json!(null)))),
        Just(Some(("tool_calls", json!("x")))),
    ];
    (role, content, prop::collection::vec(call, 0..3), extra).prop_map(|(role, content, calls, extra)| {
        let mut m = json!({ "role": role });
        if let Some(c) = content {
            m["content"] = c;
        }
        if !calls.is_empty() {
            m["tool_calls"] = Value::Array(calls);
        }
        if let Some((k, v)) = extra {
            m[k] = v;
        }
        m
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn r17_mapped_messages_always_render(messages in prop::collection::vec(message(), 1..6)) {
        match map_messages(&messages) {
            Err(e) => {
                prop_assert_eq!(e.status.as_u16(), 400);
                let param = e.param.clone().unwrap_or_default();
                prop_assert!(param.starts_with("messages["), "error names a message field: {:?}", e);
            }
            Ok(mapped) => {
                for (name, t) in TEMPLATES.iter() {
                    match render(t, &mapped) {
                        Ok(_) | Err(Error::Template { .. }) => {}
                        Err(e) => prop_assert!(false, "{}: {} on {}", name, e, Value::Array(mapped.clone())),
                    }
                }
            }
        }
    }
}
