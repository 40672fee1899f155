//! The streaming output parser (`src/parse.rs`) against hand-written expectations, and the
//! streamed parse against the one-shot parse under every chunking we can afford: all split
//! points (one and two cuts, char by char, every partition of short texts) and seeded random
//! multi-cuts. Tolerance: none; the concatenated reasoning, content, per-call (name,
//! arguments) and warnings must be identical, and events must be well ordered.

use std::time::{Duration, Instant};

use ember_chat::{OutputParser, ParseEvent, ParsedOutput, ParserOptions, ToolSpec, parse_complete};
use proptest::prelude::*;
use serde_json::{Value as Json, json};

fn tools() -> Vec<ToolSpec> {
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string"},
                "days": {"type": "integer"},
                "temp": {"type": "number"},
                "metric": {"type": "boolean"},
                "nothing": {"type": "null"},
                "opts": {"type": "object"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "note": {"type": ["string", "null"]},
                "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]}
            },
            "required": ["location"]
        }}},
        {"type": "function", "function": {"name": "write_file", "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}}
        }}}
    ]);
    ToolSpec::from_openai_tools(&tools).expect("valid tools")
}

fn opts(reasoning: bool) -> ParserOptions {
    ParserOptions { reasoning, tools: tools(), parse_tool_calls: true }
}

/// What chunking must not change: everything but the random ids.
#[derive(Debug, PartialEq)]
struct Summary {
    reasoning: Option<String>,
    content: String,
    calls: Vec<(String, String)>,
    warnings: Vec<String>,
}

fn summary(out: &ParsedOutput) -> Summary {
    Summary {
        reasoning: out.reasoning.clone(),
        content: out.content.clone(),
        calls: out.tool_calls.iter().map(|c| (c.name.clone(), c.arguments.clone())).collect(),
        warnings: out.warnings.clone(),
    }
}

/// Feeds `chunks`, checks that the event sequence is well formed, and folds it.
fn stream(opts: &ParserOptions, chunks: &[&str]) -> ParsedOutput {
    let mut parser = OutputParser::with_id_seed(opts.clone(), 7);
    let mut events = Vec::new();
    for chunk in chunks {
        events.extend(parser.push(chunk));
    }
    events.extend(parser.finish());
    let out = fold_checked(&events);
    assert_eq!(parser.n_tool_calls(), out.tool_calls.len());
    out
}

fn fold_checked(events: &[ParseEvent]) -> ParsedOutput {
    let mut out = ParsedOutput::default();
    let mut open: Option<usize> = None;
    let mut past_reasoning = false;
    for ev in events {
        match ev {
            ParseEvent::Reasoning(s) => {
                assert!(!past_reasoning, "reasoning after content or a tool call: {events:?}");
                assert!(!s.is_empty(), "empty delta");
                assert!(open.is_none(), "text inside an open call");
            }
            ParseEvent::Content(s) => {
                past_reasoning = true;
                assert!(!s.is_empty(), "empty delta");
                assert!(open.is_none(), "text inside an open call");
            }
            ParseEvent::ToolCallBegin { index, id, .. } => {
                past_reasoning = true;
                assert!(open.is_none(), "call begins inside a call");
                assert_eq!(*index, out.tool_calls.len(), "call indices count from 0");
                assert!(id.starts_with("call_") && id.len() == 29 && id[5..].chars().all(|c| c.is_ascii_alphanumeric()), "id {id}");
                open = Some(*index);
            }
            ParseEvent::ToolCallArguments { index, delta } => {
                assert_eq!(open, Some(*index), "arguments outside their call");
                assert!(!delta.is_empty(), "empty delta");
            }
            ParseEvent::ToolCallEnd { index } => {
                assert_eq!(open, Some(*index), "end of a call that is not open");
                open = None;
            }
            ParseEvent::Warning(_) => {}
        }
        out.apply(ev.clone());
    }
    assert!(open.is_none(), "call left open after finish");
    for call in &out.tool_calls {
        let v: Json = serde_json::from_str(&call.arguments).unwrap_or_else(|e| panic!("arguments {:?}: {e}", call.arguments));
        assert!(v.is_object(), "arguments are an object: {}", call.arguments);
    }
    out
}

/// Cuts `text` at the char boundaries nearest (at or after) `cuts` (byte offsets).
fn cut<'a>(text: &'a str, cuts: &[usize]) -> Vec<&'a str> {
    let mut points: Vec<usize> = cuts
        .iter()
        .map(|&c| {
            let mut c = c.min(text.len());
            while !text.is_char_boundary(c) {
                c += 1;
            }
            c
        })
        .collect();
    points.sort_unstable();
    let mut chunks = Vec::new();
    let mut last = 0;
    for p in points {
        chunks.push(&text[last..p]);
        last = p;
    }
    chunks.push(&text[last..]);
    chunks
}

/// The streamed parse equals the one-shot parse for: one cut anywhere, two cuts anywhere
/// (texts up to 160 chars), char by char, and every partition (texts up to 12 chars).
fn check_chunkings(opts: &ParserOptions, text: &str) -> ParsedOutput {
    let whole = parse_complete(opts.clone(), text);
    let want = summary(&whole);
    assert_eq!(summary(&stream(opts, &[text])), want, "single push differs from parse_complete");
    let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).skip(1).collect();
    for &a in &bounds {
        assert_eq!(summary(&stream(opts, &cut(text, &[a]))), want, "cut at {a}: {text:?}");
    }
    if bounds.len() <= 160 {
        for (i, &a) in bounds.iter().enumerate() {
            for &b in &bounds[i + 1..] {
                assert_eq!(summary(&stream(opts, &cut(text, &[a, b]))), want, "cuts at {a},{b}: {text:?}");
            }
        }
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let chars: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(summary(&stream(opts, &chars)), want, "char by char: {text:?}");
    if bounds.len() <= 12 {
        for mask in 0u32..(1 << bounds.len()) {
            let cuts: Vec<usize> = bounds.iter().enumerate().filter(|(i, _)| mask >> i & 1 == 1).map(|(_, &b)| b).collect();
            assert_eq!(summary(&stream(opts, &cut(text, &cuts))), want, "partition {mask:b}: {text:?}");
        }
    }
    whole
}

fn calls(out: &ParsedOutput) -> Vec<(&str, Json)> {
    out.tool_calls.iter().map(|c| (c.name.as_str(), serde_json::from_str(&c.arguments).expect("JSON arguments"))).collect()
}

const TWO_CALLS: &str = "I'll check both.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=location>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=tz>\nEurope/Paris\n</parameter>\n</function>\n</tool_call>";

#[test]
fn plain_content() {
    let text = "Hello, world!\nHow are you? a<b and c>d <tool x";
    let out = check_chunkings(&opts(false), text);
    assert_eq!(out.content, text);
    assert_eq!(out.reasoning, None);
    assert!(out.tool_calls.is_empty() && out.warnings.is_empty());
}

#[test]
fn reasoning_then_content() {
    let out = check_chunkings(&opts(true), "Let me think.\nOK.\n</think>\n\nThe answer is 4.\n");
    assert_eq!(out.reasoning.as_deref(), Some("Let me think.\nOK."));
    assert_eq!(out.content, "The answer is 4.\n");
    assert!(out.warnings.is_empty());
}

#[test]
fn thinking_off() {
    let out = check_chunkings(&opts(false), "The answer is 4. </think> stays text");
    assert_eq!(out.reasoning, None);
    assert_eq!(out.content, "The answer is 4. </think> stays text");
    // A template that does not pre-open the block: `<think>` at offset 0 opens it.
    let out = check_chunkings(&opts(false), "<think>\nhmm\n</think>\n\nHi");
    assert_eq!(out.reasoning.as_deref(), Some("hmm"));
    assert_eq!(out.content, "Hi");
    // ...but only at offset 0.
    let out = check_chunkings(&opts(false), "x<think>y</think>z");
    assert_eq!(out.content, "x<think>y</think>z");
    // Thinking on and the model writes the (already open) tag again.
    let out = check_chunkings(&opts(true), "<think>\nr\n</think>\n\nc");
    assert_eq!((out.reasoning.as_deref(), out.content.as_str()), (Some("r"), "c"));
    // Empty reasoning block.
    let out = check_chunkings(&opts(true), "\n</think>\n\nc");
    assert_eq!((out.reasoning.as_deref(), out.content.as_str()), (None, "c"));
}

#[test]
fn r_think_tag_split() {
    let mut p = OutputParser::new(opts(true));
    assert_eq!(p.push("abc</thi"), vec![ParseEvent::Reasoning("abc".into())]);
    assert_eq!(p.push("nk>\n"), vec![]);
    assert_eq!(p.push("\nxyz"), vec![ParseEvent::Content("xyz".into())]);
    assert_eq!(p.finish(), vec![]);
}

#[test]
fn streams_promptly() {
    // A `<` that can no longer be a tag is emitted at once.
    let mut p = OutputParser::new(opts(false));
    assert_eq!(p.push("a <"), vec![ParseEvent::Content("a ".into())]);
    assert_eq!(p.push("b"), vec![ParseEvent::Content("<b".into())]);
    assert_eq!(p.push("<tool_c"), vec![]);
    assert_eq!(p.push("x"), vec![ParseEvent::Content("<tool_cx".into())]);
    // Trailing newlines wait for the next non-newline (a tag would eat them)...
    assert_eq!(p.push("\n\n"), vec![]);
    assert_eq!(p.push("y"), vec![ParseEvent::Content("\n\ny".into())]);
    // ...and are kept at the end of the output.
    assert_eq!(p.push("\n"), vec![]);
    assert_eq!(p.finish(), vec![ParseEvent::Content("\n".into())]);
    // Without tool parsing, content newlines are not held.
    let mut p = OutputParser::new(ParserOptions { parse_tool_calls: false, ..opts(false) });
    assert_eq!(p.push("a\n"), vec![ParseEvent::Content("a\n".into())]);
}

#[test]
fn two_tool_calls() {
    let out = check_chunkings(&opts(true), TWO_CALLS);
    assert_eq!(out.reasoning.as_deref(), Some("I'll check both."));
    assert_eq!(out.content, "");
    assert_eq!(out.tool_calls[0].arguments, r#"{"location": "Paris", "days": 3}"#);
    assert_eq!(calls(&out), vec![("get_weather", json!({"location": "Paris", "days": 3})), ("get_time", json!({"tz": "Europe/Paris"}))]);
    assert!(out.warnings.is_empty());
    assert_ne!(out.tool_calls[0].id, out.tool_calls[1].id);
}

#[test]
fn streamed_events() {
    let mut p = OutputParser::with_id_seed(opts(false), 1);
    let mut ev = p.push("Checking.\n\n<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n");
    let ParseEvent::ToolCallBegin { id, .. } = &ev[1] else { panic!("{ev:?}") };
    let id = id.clone();
    assert_eq!(
        ev,
        vec![
            ParseEvent::Content("Checking.".into()),
            ParseEvent::ToolCallBegin { index: 0, id, name: "get_weather".into() },
            ParseEvent::ToolCallArguments { index: 0, delta: r#"{"days": 3"#.into() },
        ]
    );
    // A string parameter streams as it arrives (the trailing newline is held: it may be the format's).
    ev = p.push("<parameter=location>\nPar");
    assert_eq!(ev, vec![ParseEvent::ToolCallArguments { index: 0, delta: r#", "location": "Par"#.into() }]);
    ev = p.push("is\n");
    assert_eq!(ev, vec![ParseEvent::ToolCallArguments { index: 0, delta: "is".into() }]);
    ev = p.push("</parameter>\n</function>\n</tool_call>");
    assert_eq!(ev, vec![ParseEvent::ToolCallArguments { index: 0, delta: "\"}".into() }, ParseEvent::ToolCallEnd { index: 0 }]);
    assert_eq!(p.finish(), vec![]);
    assert_eq!(p.n_tool_calls(), 1);
}

#[test]
fn call_inside_reasoning() {
    let text = "Need weather.\n<tool_call>\n<function=get_weather>\n<parameter=location>\nParis\n</parameter>\n</function>\n</tool_call>";
    let out = check_chunkings(&opts(true), text);
    assert_eq!(out.reasoning.as_deref(), Some("Need weather."));
    assert_eq!(out.content, "");
    assert_eq!(calls(&out), vec![("get_weather", json!({"location": "Paris"}))]);
    // `<tool_call>` merely mentioned in reasoning stays reasoning (with a warning).
    let out = check_chunkings(&opts(true), "Use <tool_call> tags.\n</think>\n\nOK");
    assert_eq!(out.reasoning.as_deref(), Some("Use <tool_call> tags."));
    assert_eq!(out.content, "OK");
    assert_eq!(out.warnings.len(), 1);
}

#[test]
fn multiline_values() {
    let text = "<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.txt\n</parameter>\n<parameter=content>\n\nline1\nline2\n\nline4\n\n</parameter>\n</function>\n</tool_call>";
    let out = check_chunkings(&opts(false), text);
    assert_eq!(calls(&out), vec![("write_file", json!({"path": "/tmp/a.txt", "content": "\nline1\nline2\n\nline4\n"}))]);
    // Unknown tool: the same value, buffered rather than streamed, trimmed the same way.
    let out = check_chunkings(&opts(false), &text.replace("write_file", "other"));
    assert_eq!(calls(&out), vec![("other", json!({"path": "/tmp/a.txt", "content": "\nline1\nline2\n\nline4\n"}))]);
}

#[test]
fn look_alikes_in_values() {
    let value = "if a < b && c </parameter x: <parameter=y> </parameters </param\n\"q\" \\ \t</function></tool_call><";
    let text = format!("<tool_call>\n<function=write_file>\n<parameter=content>\n{value}\n</parameter>\n</function>\n</tool_call>");
    let out = check_chunkings(&opts(false), &text);
    assert_eq!(calls(&out), vec![("write_file", json!({ "content": value }))]);
    assert!(out.warnings.is_empty() && out.content.is_empty());
}

#[test]
fn typed_parameters() {
    let p = |name: &str, v: &str| format!("<parameter={name}>\n{v}\n</parameter>\n");
    let text = [
        "<tool_call>\n<function=get_weather>\n".to_string(),
        p("location", "42"),
        p("days", "3"),
        p("temp", "21.50"),
        p("metric", "True"),
        p("nothing", "null"),
        p("opts", "{\"a\":1,\n \"b\":[true,null,1e-7,\"é\"]}"),
        p("tags", "[\"x\", \"y\"]"),
        p("note", "null"),
        p("either", "7"),
        p("unknown_int", "12"),
        p("unknown_text", "hello there"),
        "</function>\n</tool_call>".to_string(),
    ]
    .concat();
    let out = check_chunkings(&opts(false), &text);
    assert_eq!(
        out.tool_calls[0].arguments,
        r#"{"location": "42", "days": 3, "temp": 21.5, "metric": true, "nothing": null, "opts": {"a": 1, "b": [true, null, 1e-07, "é"]}, "tags": ["x", "y"], "note": null, "either": 7, "unknown_int": 12, "unknown_text": "hello there"}"#
    );
    // Values that do not parse as their type fall back to strings.
    let text = format!(
        "<tool_call>\n<function=get_weather>\n{}{}{}</function>\n</tool_call>",
        p("days", "three"),
        p("opts", "{bad"),
        p("either", "soon")
    );
    let out = check_chunkings(&opts(false), &text);
    assert_eq!(calls(&out), vec![("get_weather", json!({"days": "three", "opts": "{bad", "either": "soon"}))]);
    // No parameters at all.
    let out = check_chunkings(&opts(false), "<tool_call>\n<function=ping>\n</function>\n</tool_call>");
    assert_eq!(out.tool_calls[0].arguments, "{}");
}

#[test]
fn unicode_text() {
    let out = check_chunkings(&opts(true), "Думаю… 🌍\n</think>\n\n世界 <é> 🎉");
    assert_eq!(out.reasoning.as_deref(), Some("Думаю… 🌍"));
    assert_eq!(out.content, "世界 <é> 🎉");
    let out = check_chunkings(
        &opts(false),
        "<tool_call>\n<function=get_weather>\n<parameter=location>\nZürich 🏔\n</parameter>\n</function>\n</tool_call>",
    );
    assert_eq!(out.tool_calls[0].arguments, r#"{"location": "Zürich 🏔"}"#);
}

#[test]
fn malformed_markup_is_content() {
    // Garbage after `<tool_call>`: the raw text, untouched, plus a warning.
    for text in [
        "Sure.\n<tool_call>\nhello world\n</tool_call>",
        "<tool_call>\n<function=get weather>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=>\n</tool_call>",
        "<tool_call>\n<function=get_weather\n",
        "<tool_call>\n<function=get_wea",
        "a\n\n<tool_call>",
        "<tool_call><tool_call>",
        &format!("<tool_call>\n<function={}>\n</function>\n</tool_call>", "n".repeat(300)),
        &format!("<tool_call>\n<function={}", "n".repeat(256)),
    ] {
        let out = check_chunkings(&opts(false), text);
        assert_eq!(out.content, text, "{text:?}");
        assert!(out.tool_calls.is_empty());
        assert!(!out.warnings.is_empty(), "{text:?}");
    }
    // A second `<tool_call>` right after a broken one is still a call.
    let out = check_chunkings(&opts(false), "<tool_call>\n<tool_call>\n<function=f>\n</function>\n</tool_call>");
    assert_eq!(out.content, "<tool_call>"); // the newline before a tag is formatting
    assert_eq!(calls(&out), vec![("f", json!({}))]);
    assert_eq!(out.warnings.len(), 1);
}

#[test]
fn committed_call_goes_wrong() {
    // Garbage inside a committed call: closed with what it has; the rest is content.
    let out = check_chunkings(&opts(false), "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\nxyz</tool_call>");
    assert_eq!(calls(&out), vec![("f", json!({"a": 1}))]);
    assert_eq!(out.content, "xyz</tool_call>");
    assert_eq!(out.warnings.len(), 1);
    let out = check_chunkings(&opts(false), "<tool_call>\n<function=f>\n<parameter=a b\n1</parameter>");
    assert_eq!(calls(&out), vec![("f", json!({}))]);
    assert_eq!(out.content, "<parameter=a b\n1</parameter>");
    // Truncated inside a value: the value so far is kept, the call closed, one warning.
    let out = check_chunkings(&opts(false), "<tool_call>\n<function=get_weather>\n<parameter=location>\nPar");
    assert_eq!(calls(&out), vec![("get_weather", json!({"location": "Par"}))]);
    assert_eq!(out.warnings.len(), 1);
    let out = check_chunkings(&opts(false), "<tool_call>\n<function=get_weather>\n<parameter=days>\n12\n</param");
    assert_eq!(calls(&out), vec![("get_weather", json!({"days": "12\n</param"}))]);
    // Truncated before `</tool_call>`: closed, warned.
    let out = check_chunkings(&opts(false), "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n");
    assert_eq!(calls(&out), vec![("f", json!({"a": 1}))]);
    assert_eq!(out.warnings.len(), 1);
    // Truncated in a parameter name: the fragment is content.
    let out = check_chunkings(&opts(false), "<tool_call>\n<function=f>\n<parameter=lo");
    assert_eq!(calls(&out), vec![("f", json!({}))]);
    assert_eq!(out.content, "<parameter=lo");
}

#[test]
fn lenient_forms() {
    // No `</function>`; no newlines; `</function>` followed by another `<function=`.
    let out = check_chunkings(&opts(false), "<tool_call><function=f><parameter=a>1</parameter></tool_call>");
    assert_eq!(calls(&out), vec![("f", json!({"a": 1}))]);
    assert!(out.warnings.is_empty());
    let out = check_chunkings(&opts(false), "<tool_call>\n<function=f>\n</function>\n<function=g>\n</function>\n</tool_call>");
    assert_eq!(calls(&out), vec![("f", json!({})), ("g", json!({}))]);
}

#[test]
fn text_after_last_call() {
    let text = "Let me look.\n\n<tool_call>\n<function=f>\n</function>\n</tool_call>\n\nDone.\n<tool_call>\n<function=g>\n</function>\n</tool_call>\n";
    let out = check_chunkings(&opts(false), text);
    assert_eq!(out.content, "Let me look.Done.");
    assert_eq!(calls(&out), vec![("f", json!({})), ("g", json!({}))]);
}

#[test]
fn empty_output() {
    for o in [opts(true), opts(false)] {
        let out = check_chunkings(&o, "");
        assert_eq!(out, ParsedOutput::default());
    }
}

#[test]
fn tool_parsing_off() {
    let o = ParserOptions { parse_tool_calls: false, ..opts(true) };
    let out = check_chunkings(&o, TWO_CALLS);
    assert_eq!(out.reasoning.as_deref(), Some("I'll check both."));
    assert_eq!(out.content, TWO_CALLS.split_once("</think>\n\n").unwrap().1);
    assert!(out.tool_calls.is_empty() && out.warnings.is_empty());
}

#[test]
fn short_texts_every_partition() {
    for text in ["a</think>\nb", "<think>x</think>y", "<<tool_call>", "\n\n<\n", "</thi", "<think", "r\n\n</think>"] {
        for o in [opts(true), opts(false)] {
            check_chunkings(&o, text);
        }
    }
}

#[test]
fn tool_specs() {
    assert_eq!(ToolSpec::from_openai_tools(&Json::Null).unwrap(), vec![]);
    let t = ToolSpec::from_openai_tools(&json!([{"function": {"name": "f"}}])).unwrap();
    assert_eq!(t, vec![ToolSpec { name: "f".into(), parameters: Json::Null }]);
    for (bad, msg) in [
        (json!({}), "tools must be an array"),
        (json!([1]), "tools[0] must be an object"),
        (json!([{"type": "custom", "function": {"name": "f"}}]), "tools[0].type must be \"function\""),
        (json!([{"type": "function"}]), "tools[0].function must be an object"),
        (json!([{"type": "function", "function": {"name": ""}}]), "tools[0].function.name must be a non-empty string"),
    ] {
        assert_eq!(ToolSpec::from_openai_tools(&bad).unwrap_err().to_string(), msg);
    }
}

#[test]
fn ids_unique_and_seeded() {
    let text = "<tool_call><function=f></function></tool_call>".repeat(50);
    let a = stream(&opts(false), &[&text]);
    let ids: std::collections::HashSet<_> = a.tool_calls.iter().map(|c| c.id.clone()).collect();
    assert_eq!(ids.len(), 50);
    assert_eq!(a.tool_calls, stream(&opts(false), &cut(&text, &[5, 99, 1000])).tool_calls, "same seed, same ids");
    let x = parse_complete(opts(false), &text);
    let y = parse_complete(opts(false), &text);
    assert_ne!(x.tool_calls[0].id, y.tool_calls[0].id, "unseeded parsers draw different ids");
}

/// 1 MB of output fed in 1..=7-byte chunks: linear time (a rescan per push would take minutes).
#[test]
fn one_megabyte_streams_linearly() {
    let mut text = String::from("Think < about </thin it\n\n");
    while text.len() < 250_000 {
        text.push_str("reasoning <tool_ca\n\n</thin é ");
    }
    text.push_str("\n</think>\n\n");
    while text.len() < 500_000 {
        text.push_str("content <tool_c a<b\n");
    }
    text.push_str("<tool_call>\n<function=write_file>\n<parameter=content>\n");
    while text.len() < 800_000 {
        text.push_str("line </paramete <x> é\n");
    }
    text.push_str("\n</parameter>\n<parameter=unknown>\n");
    while text.len() < 1_000_000 {
        text.push_str("line </paramete <x> é\n");
    }
    text.push_str("\n</parameter>\n</function>\n</tool_call>");
    let sizes = [1usize, 7, 3, 5, 2, 6, 4];
    let mut chunks = Vec::new();
    let mut at = 0;
    for i in 0.. {
        if at >= text.len() {
            break;
        }
        let mut end = (at + sizes[i % sizes.len()]).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        chunks.push(&text[at..end]);
        at = end;
    }
    let t0 = Instant::now();
    let out = stream(&opts(true), &chunks);
    let elapsed = t0.elapsed();
    assert_eq!(summary(&out), summary(&parse_complete(opts(true), &text)));
    assert_eq!(out.tool_calls.len(), 1);
    assert!(out.reasoning.as_ref().unwrap().len() > 240_000 && out.content.len() > 240_000);
    // Generous bound for a shared, loaded machine: the linear parse takes well under a second.
    assert!(elapsed < Duration::from_secs(5), "1 MB took {elapsed:?}");
}

/// Fragments that make up random outputs: every tag, look-alikes, newlines, text, unicode.
const FRAGMENTS: &[&str] = &[
    "<tool_call>",
    "</tool_call>",
    "<function=get_weather>",
    "<function=write_file>",
    "<function=",
    "x>",
    "</function>",
    "<parameter=location>",
    "<parameter=days>",
    "<parameter=content>",
    "<parameter=",
    "</parameter>",
    "</parameter",
    "<think>",
    "</think>",
    "</thi",
    "<",
    ">",
    "\n",
    "\n\n",
    " ",
    "Paris",
    "42",
    "{\"a\": [1, 2]}",
    "héllo 🌍",
    "null",
];

fn random_output() -> impl Strategy<Value = String> {
    prop::collection::vec(0..FRAGMENTS.len(), 0..40).prop_map(|ix| ix.into_iter().map(|i| FRAGMENTS[i]).collect())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Random fragment soups, random options, random cuts: streamed == one-shot, events well formed.
    #[test]
    fn random_outputs_any_chunking(
        text in random_output(),
        reasoning in any::<bool>(),
        parse_tool_calls in any::<bool>(),
        cuts in prop::collection::vec(0usize..400, 0..12),
    ) {
        let o = ParserOptions { reasoning, tools: tools(), parse_tool_calls };
        let want = summary(&parse_complete(o.clone(), &text));
        prop_assert_eq!(summary(&stream(&o, &cut(&text, &cuts))), want);
    }

    /// The fixed cases under random multi-cuts.
    #[test]
    fn fixed_cases_random_cuts(case in 0usize..3, cuts in prop::collection::vec(0usize..600, 0..20)) {
        let text = [TWO_CALLS, "Need weather.\n<tool_call>\n<function=get_weather>\n<parameter=location>\nParis\n</parameter>\n</function>\n</tool_call>\nok", "r\n</think>\n\nc <tool_call>\n<function=f>\n<parameter=a>\n{\"k\": [1, 2.5, \"é\"]}\n</parameter>\n</function>\n</tool_call>"][case];
        let o = opts(true);
        prop_assert_eq!(summary(&stream(&o, &cut(text, &cuts))), summary(&parse_complete(o.clone(), text)));
    }

    /// With nothing to parse, no text is lost: content is the input minus its leading newlines.
    #[test]
    fn no_markup_no_loss(text in random_output(), cuts in prop::collection::vec(0usize..400, 0..12)) {
        prop_assume!(!text.starts_with("<think>"));
        let o = ParserOptions { reasoning: false, tools: vec![], parse_tool_calls: false };
        let out = stream(&o, &cut(&text, &cuts));
        prop_assert_eq!(out.content, text.trim_start_matches('\n'));
    }
}
