//! The model-output parser (reasoning, content, Qwen XML tool calls) on any text, streamed in
//! chunks cut where the input says: it never panics, its event sequence is well formed (deltas
//! non-empty, reasoning first, call indices from 0, every call closed, arguments a JSON
//! object), and the streamed result equals the one-shot parse (ids aside).
//!
//! Input: byte 0 = flags (bit 0 thinking on, bit 1 parse tool calls), byte 1 = number of cuts
//! (mod 16), then two bytes per cut (a byte offset), then the text (UTF-8, lossily).

#![no_main]

use std::sync::LazyLock;

use ember_chat::{OutputParser, ParseEvent, ParsedOutput, ParserOptions, ToolSpec, parse_complete};
use libfuzzer_sys::fuzz_target;
use serde_json::{Value, json};

static TOOLS: LazyLock<Vec<ToolSpec>> = LazyLock::new(|| {
    let tools = json!([
        { "type": "function", "function": { "name": "get_weather", "parameters": { "type": "object", "properties": {
            "city": { "type": "string" }, "days": { "type": "integer" }, "hot": { "type": "boolean" },
            "temp": { "type": "number" }, "tags": { "type": "array" }, "opts": { "type": "object" } } } } },
        { "type": "function", "function": { "name": "f" } },
    ]);
    ToolSpec::from_openai_tools(&tools).expect("valid tools")
});

fn summary(out: &ParsedOutput) -> (Option<String>, String, Vec<(String, String)>, Vec<String>) {
    let calls = out.tool_calls.iter().map(|c| (c.name.clone(), c.arguments.clone())).collect();
    (out.reasoning.clone(), out.content.clone(), calls, out.warnings.clone())
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let opts = ParserOptions { reasoning: data[0] & 1 != 0, tools: TOOLS.clone(), parse_tool_calls: data[0] & 2 != 0 };
    let n_cuts = (data[1] % 16) as usize;
    let head = 2 + 2 * n_cuts;
    if data.len() < head {
        return;
    }
    let text = String::from_utf8_lossy(&data[head..]);
    let mut cuts: Vec<usize> = data[2..head].chunks(2).map(|c| u16::from_le_bytes([c[0], c[1]]) as usize % (text.len() + 1)).collect();
    cuts.sort_unstable();
    let mut parser = OutputParser::new(opts.clone());
    let mut events = Vec::new();
    let mut last = 0;
    for c in cuts.into_iter().chain([text.len()]) {
        let mut c = c.max(last);
        while !text.is_char_boundary(c) {
            c += 1;
        }
        events.extend(parser.push(&text[last..c]));
        last = c;
    }
    events.extend(parser.finish());

    let mut out = ParsedOutput::default();
    let (mut open, mut past_reasoning) = (None, false);
    for ev in &events {
        match ev {
            ParseEvent::Reasoning(s) => assert!(!past_reasoning && !s.is_empty() && open.is_none(), "{events:?}"),
            ParseEvent::Content(s) => {
                past_reasoning = true;
                assert!(!s.is_empty() && open.is_none(), "{events:?}");
            }
            ParseEvent::ToolCallBegin { index, .. } => {
                past_reasoning = true;
                assert!(open.is_none() && *index == out.tool_calls.len(), "{events:?}");
                open = Some(*index);
            }
            ParseEvent::ToolCallArguments { index, delta } => assert!(open == Some(*index) && !delta.is_empty(), "{events:?}"),
            ParseEvent::ToolCallEnd { index } => {
                assert_eq!(open, Some(*index), "{events:?}");
                open = None;
            }
            ParseEvent::Warning(_) => {}
        }
        out.apply(ev.clone());
    }
    assert!(open.is_none(), "call left open: {events:?}");
    for call in &out.tool_calls {
        let v: Value = serde_json::from_str(&call.arguments).unwrap_or_else(|e| panic!("arguments {:?}: {e}", call.arguments));
        assert!(v.is_object(), "{}", call.arguments);
    }
    assert_eq!(summary(&out), summary(&parse_complete(opts, &text)), "streamed != one-shot");
});
