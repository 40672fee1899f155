//! The model's streamed output -> reasoning, content and tool calls (spec
//! `tokenizer-and-chat.md` §7.7; llama.cpp `common/parsers/qwen3-coder.cpp`).
//!
//! Input is what a Qwen3.5/3.6 model writes after the generation prompt:
//! `{reasoning}\n</think>\n\n{content}` then optionally Qwen XML tool calls
//! (`<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>\n</tool_call>`).
//! Text arrives in chunks split anywhere; one state machine consumes it, holding back only
//! what could still be the start of a tag (plus trailing newlines that a following tag would
//! eat), so every decision is the same whatever the chunking. [`parse_complete`] is that
//! machine fed once.
//!
//! The decision a reader would question: a tool call is **committed** as soon as
//! `<tool_call>` + `<function=NAME>` is complete. From then on its events are out
//! (`ToolCallBegin`, then one arguments delta per `</parameter>`) and cannot be taken back,
//! so markup that goes wrong later does not turn the call into text: the call is closed with
//! the parameters read so far, the rest is content, and a `Warning` says so. Before the commit
//! point, malformed markup is re-emitted verbatim as text (in the channel it appeared in) with
//! a `Warning`. Committing early is what lets clients see the call's name and arguments while
//! the model is still writing a long value.
//!
//! Rules, in full:
//! * Reasoning: with `reasoning: true` output starts in reasoning; with `false` it starts in
//!   content unless the very first bytes are `<think>`. A `<think>` at offset 0 is consumed in
//!   both modes. Reasoning ends at `</think>`, or at a committed tool call (calls written
//!   inside reasoning are not lost). Newlines next to the markup are formatting: leading
//!   newlines of reasoning and of content, trailing newlines before `</think>` or
//!   `<tool_call>`, and newlines between/after tool calls are dropped (the chat template's
//!   history rendering strips them too). Other text, including trailing newlines at the end
//!   of the output, is kept. A `</think>` in content is text.
//! * Tool calls (only with `parse_tool_calls`): whitespace between elements is skipped;
//!   parameters come in any order; a value is everything up to the first `</parameter>`,
//!   minus one leading and one trailing newline; `</function>` may be omitted before
//!   `</tool_call>`, and `</function>` may be followed by another `<function=` (a second
//!   call). Names are 1..=256 bytes without `<`, `>` or newlines (function names also
//!   without whitespace). Unknown function names are calls too.
//! * Arguments are streamed as `{"p": v` / `, "q": w` / `}` (`{}` without parameters), in
//!   Python `json.dumps` style; see `parse/args.rs` for how a value is typed. A parameter whose
//!   schema type is exactly `string` is streamed as the value arrives; others are emitted at
//!   `</parameter>`.
//! * `finish`: held-back text is flushed as text; a tool call not yet committed is text plus a
//!   `Warning`; a committed call that is still open is closed (an unterminated value is kept,
//!   trimmed as usual), with a `Warning`.

mod args;

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

pub use args::ToolSpec;
use args::{ParamType, value_json, write_json_str, write_json_str_body};

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";
const FUNC_OPEN: &str = "<function=";
const FUNC_CLOSE: &str = "</function>";
const PARAM_OPEN: &str = "<parameter=";
const PARAM_CLOSE: &str = "</parameter>";
/// Longest function or parameter name accepted; beyond it the markup is malformed (and the
/// machine never holds an unbounded name back).
const MAX_NAME_BYTES: usize = 256;

/// How to read one response.
#[derive(Debug, Clone, Default)]
pub struct ParserOptions {
    /// The prompt opened `<think>` (thinking on): generation starts inside reasoning.
    pub reasoning: bool,
    /// The request's tools, for parameter types; calls to other names are still parsed.
    pub tools: Vec<ToolSpec>,
    /// Recognise `<tool_call>` markup; when false, all non-reasoning text is content.
    pub parse_tool_calls: bool,
}

/// One piece of parsed output, in output order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParseEvent {
    /// A `reasoning_content` delta.
    Reasoning(String),
    /// A `content` delta.
    Content(String),
    /// A tool call starts; `index` counts calls in this response from 0.
    ToolCallBegin {
        index: usize,
        id: String,
        name: String,
    },
    /// JSON text; the deltas of one call concatenate to its `arguments` object.
    ToolCallArguments {
        index: usize,
        delta: String,
    },
    ToolCallEnd {
        index: usize,
    },
    /// Malformed markup was kept as text (or a call was closed early); count it.
    Warning(String),
}

/// A whole response, parsed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParsedOutput {
    /// `None` when no reasoning text was produced.
    pub reasoning: Option<String>,
    pub content: String,
    pub tool_calls: Vec<ParsedToolCall>,
    pub warnings: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedToolCall {
    pub id: String,
    pub name: String,
    /// A JSON object, as text.
    pub arguments: String,
}

impl ParsedOutput {
    /// Folds one event in (what a non-streaming response is built from).
    pub fn apply(&mut self, event: ParseEvent) {
        match event {
            ParseEvent::Reasoning(s) => self.reasoning.get_or_insert_with(String::new).push_str(&s),
            ParseEvent::Content(s) => self.content.push_str(&s),
            ParseEvent::ToolCallBegin { id, name, .. } => self.tool_calls.push(ParsedToolCall { id, name, arguments: String::new() }),
            ParseEvent::ToolCallArguments { index, delta } => {
                if let Some(call) = self.tool_calls.get_mut(index) {
                    call.arguments.push_str(&delta);
                }
            }
            ParseEvent::ToolCallEnd { .. } => {}
            ParseEvent::Warning(w) => self.warnings.push(w),
        }
    }
}

/// One-shot parse of a whole text, built on the same machine as [`OutputParser`].
pub fn parse_complete(opts: ParserOptions, text: &str) -> ParsedOutput {
    let mut parser = OutputParser::new(opts);
    let mut out = ParsedOutput::default();
    for ev in parser.push(text).into_iter().chain(parser.finish()) {
        out.apply(ev);
    }
    out
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Channel {
    Reasoning,
    Content,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing consumed yet: a `<think>` here opens reasoning.
    Start,
    /// Plain text of a channel.
    Text(Channel),
    /// After `<tool_call>` (not committed): whitespace, then `<function=`.
    CallOpen(Channel),
    /// Reading the function name (not committed); `>` commits.
    FuncName(Channel),
    /// Inside a committed call, between elements.
    Body,
    /// Reading `<parameter=NAME`.
    ParamName,
    /// Reading a parameter value up to `</parameter>`.
    ParamValue,
    /// After `</function>`: `</tool_call>` (or another `<function=`).
    AfterFunction,
}

enum Match {
    Tag(&'static str),
    /// The rest of the buffer is a proper prefix of a tag: wait for more text.
    Partial,
    No,
}

/// Which of `tags` starts `rest`. At end of input a prefix is no longer a candidate.
fn match_tags(rest: &str, tags: &[&'static str], eof: bool) -> Match {
    let mut partial = false;
    for &tag in tags {
        if rest.starts_with(tag) {
            return Match::Tag(tag);
        }
        partial |= !eof && tag.starts_with(rest);
    }
    if partial { Match::Partial } else { Match::No }
}

/// The open call.
#[derive(Debug, Default)]
struct Call {
    index: usize,
    name: String,
    n_params: usize,
}

/// The parameter being read.
#[derive(Debug, Default)]
struct Param {
    key: String,
    ty: Option<ParamType>,
    /// Buffered value (non-streamed parameters).
    value: String,
    /// Streamed parameters: no value char seen yet (the format's leading newline is pending).
    at_start: bool,
    /// Streamed parameters: a trailing newline held back (the format's, if `</parameter>` follows).
    nl_held: bool,
}

impl Param {
    fn streamed(&self) -> bool {
        self.ty == Some(ParamType::String)
    }
}

/// Incremental parser of one response. Feed chunks with [`push`](Self::push), then call
/// [`finish`](Self::finish) once.
#[derive(Debug)]
pub struct OutputParser {
    opts: ParserOptions,
    state: State,
    /// Unconsumed input starts at `pos`; what remains after a push is a tag prefix at most.
    buf: String,
    pos: usize,
    /// Drop the newlines at the start of the current text run.
    skip_nl: bool,
    /// Newlines at the end of the text so far, not yet emitted.
    pending_nl: usize,
    /// Markup consumed but not yet committed; re-emitted as text if it proves malformed.
    raw: String,
    /// Function or parameter name being read.
    name: String,
    call: Option<Call>,
    param: Param,
    n_calls: usize,
    id_seed: u64,
    events: Vec<ParseEvent>,
}

impl OutputParser {
    /// A parser whose tool-call ids are random (unique across parsers in practice).
    pub fn new(opts: ParserOptions) -> Self {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let mut h = RandomState::new().build_hasher();
        h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        h.write_u128(nanos);
        Self::with_id_seed(opts, h.finish())
    }

    /// A parser whose tool-call ids are a function of `seed` (tests, reproducible runs).
    pub fn with_id_seed(opts: ParserOptions, seed: u64) -> Self {
        OutputParser {
            opts,
            state: State::Start,
            buf: String::new(),
            pos: 0,
            skip_nl: false,
            pending_nl: 0,
            raw: String::new(),
            name: String::new(),
            call: None,
            param: Param::default(),
            n_calls: 0,
            id_seed: seed,
            events: Vec::new(),
        }
    }

    /// Tool calls begun so far.
    pub fn n_tool_calls(&self) -> usize {
        self.n_calls
    }

    /// Consumes a chunk; returns the events it completes (consecutive text deltas merged).
    pub fn push(&mut self, text: &str) -> Vec<ParseEvent> {
        self.buf.push_str(text);
        self.run(false);
        std::mem::take(&mut self.events)
    }

    /// End of generation: decides everything still held back (see the module doc).
    pub fn finish(&mut self) -> Vec<ParseEvent> {
        self.run(true);
        match self.state {
            State::Start => {}
            State::Text(ch) => self.flush_pending(ch),
            State::CallOpen(back) | State::FuncName(back) => {
                self.fail_open(back, "tool call unterminated at end of output");
                self.flush_pending(back);
            }
            State::Body | State::AfterFunction => {
                self.warn("tool call not closed by </tool_call> at end of output; closed");
                self.close_call();
            }
            State::ParamName => {
                self.fail_call("parameter name unterminated at end of output");
                self.flush_pending(Channel::Content);
            }
            State::ParamValue => {
                self.warn("parameter value unterminated at end of output; call closed with it");
                self.close_param();
                self.close_call();
            }
        }
        self.state = State::Text(Channel::Content);
        self.skip_nl = false;
        std::mem::take(&mut self.events)
    }

    fn run(&mut self, eof: bool) {
        let buf = std::mem::take(&mut self.buf);
        while self.pos < buf.len() && self.step(&buf, eof) {}
        // Only a tag prefix is left: draining is O(1) amortised.
        self.buf = buf;
        self.buf.drain(..self.pos);
        self.pos = 0;
    }

    /// One move of the machine on `buf[pos..]` (non-empty). False: it needs more input.
    fn step(&mut self, buf: &str, eof: bool) -> bool {
        let rest = &buf[self.pos..];
        match self.state {
            State::Start => {
                match match_tags(rest, &[THINK_OPEN], eof) {
                    Match::Tag(tag) => {
                        self.pos += tag.len();
                        self.state = State::Text(Channel::Reasoning);
                    }
                    Match::Partial => return false,
                    Match::No => {
                        let ch = if self.opts.reasoning { Channel::Reasoning } else { Channel::Content };
                        self.state = State::Text(ch);
                    }
                }
                self.skip_nl = true;
                true
            }
            State::Text(ch) => self.step_text(ch, rest, eof),
            State::CallOpen(back) => {
                let n_ws = leading_ws(rest);
                if n_ws > 0 {
                    self.raw.push_str(&rest[..n_ws]);
                    self.pos += n_ws;
                    return true;
                }
                match match_tags(rest, &[FUNC_OPEN], eof) {
                    Match::Tag(tag) => {
                        self.raw.push_str(tag);
                        self.pos += tag.len();
                        self.name.clear();
                        self.state = State::FuncName(back);
                    }
                    Match::Partial => return false,
                    Match::No => self.fail_open(back, "expected <function= after <tool_call>"),
                }
                true
            }
            State::FuncName(back) => {
                let n = rest.find(|c: char| c == '>' || c == '<' || c.is_whitespace()).unwrap_or(rest.len());
                if self.name.len() + n > MAX_NAME_BYTES {
                    self.fail_open(back, "function name too long");
                    return true;
                }
                self.name.push_str(&rest[..n]);
                self.raw.push_str(&rest[..n]);
                self.pos += n;
                if n == rest.len() {
                    return false;
                }
                if rest[n..].starts_with('>') && !self.name.is_empty() {
                    self.pos += 1;
                    self.commit();
                } else {
                    self.fail_open(back, "bad <function=NAME>");
                }
                true
            }
            State::Body | State::AfterFunction => {
                let n_ws = leading_ws(rest);
                if n_ws > 0 {
                    self.pos += n_ws;
                    return true;
                }
                let tags: &[&'static str] =
                    if self.state == State::Body { &[PARAM_OPEN, FUNC_CLOSE, CALL_CLOSE] } else { &[CALL_CLOSE, FUNC_OPEN] };
                match match_tags(rest, tags, eof) {
                    Match::Tag(tag) => {
                        self.pos += tag.len();
                        match tag {
                            PARAM_OPEN => {
                                self.raw.push_str(tag);
                                self.name.clear();
                                self.state = State::ParamName;
                            }
                            FUNC_CLOSE => self.state = State::AfterFunction,
                            FUNC_OPEN => {
                                self.close_call();
                                self.raw.push_str(tag);
                                self.name.clear();
                                self.state = State::FuncName(Channel::Content);
                            }
                            _ => {
                                self.close_call();
                                self.state = State::Text(Channel::Content);
                                self.skip_nl = true;
                            }
                        }
                    }
                    Match::Partial => return false,
                    Match::No if self.state == State::Body => self.fail_call("expected <parameter=, </function> or </tool_call>"),
                    Match::No => self.fail_call("expected </tool_call> after </function>"),
                }
                true
            }
            State::ParamName => {
                let n = rest.find(['>', '<', '\n', '\r']).unwrap_or(rest.len());
                if self.name.len() + n > MAX_NAME_BYTES {
                    self.fail_call("parameter name too long");
                    return true;
                }
                self.name.push_str(&rest[..n]);
                self.raw.push_str(&rest[..n]);
                self.pos += n;
                if n == rest.len() {
                    return false;
                }
                if rest[n..].starts_with('>') && !self.name.is_empty() {
                    self.pos += 1;
                    self.open_param();
                } else {
                    self.fail_call("bad <parameter=NAME>");
                }
                true
            }
            State::ParamValue => match rest.find('<') {
                None => {
                    self.value_text(rest);
                    self.pos += rest.len();
                    false
                }
                Some(i @ 1..) => {
                    self.value_text(&rest[..i]);
                    self.pos += i;
                    true
                }
                Some(_) => match match_tags(rest, &[PARAM_CLOSE], eof) {
                    Match::Tag(tag) => {
                        self.pos += tag.len();
                        self.close_param();
                        self.state = State::Body;
                        true
                    }
                    Match::Partial => false,
                    Match::No => {
                        self.value_text("<");
                        self.pos += 1;
                        true
                    }
                },
            },
        }
    }

    fn step_text(&mut self, ch: Channel, rest: &str, eof: bool) -> bool {
        if self.skip_nl {
            let n = rest.len() - rest.trim_start_matches('\n').len();
            self.pos += n;
            if n == rest.len() {
                return false;
            }
            self.skip_nl = false;
            return true;
        }
        match rest.find('<') {
            None => {
                self.text(ch, rest);
                self.pos += rest.len();
                false
            }
            Some(i @ 1..) => {
                self.text(ch, &rest[..i]);
                self.pos += i;
                true
            }
            Some(_) => {
                let tags: &[&'static str] = match (ch, self.opts.parse_tool_calls) {
                    (Channel::Reasoning, true) => &[THINK_CLOSE, CALL_OPEN],
                    (Channel::Reasoning, false) => &[THINK_CLOSE],
                    (Channel::Content, true) => &[CALL_OPEN],
                    (Channel::Content, false) => &[],
                };
                match match_tags(rest, tags, eof) {
                    Match::Tag(tag) => {
                        self.pos += tag.len();
                        if tag == THINK_CLOSE {
                            self.pending_nl = 0;
                            self.state = State::Text(Channel::Content);
                            self.skip_nl = true;
                        } else {
                            self.raw.clear();
                            self.raw.extend(std::iter::repeat_n('\n', self.pending_nl));
                            self.raw.push_str(tag);
                            self.pending_nl = 0;
                            self.state = State::CallOpen(ch);
                        }
                        true
                    }
                    Match::Partial => false,
                    Match::No => {
                        self.text(ch, "<");
                        self.pos += 1;
                        true
                    }
                }
            }
        }
    }

    /// Emits channel text, holding back trailing newlines where a tag could eat them.
    fn text(&mut self, ch: Channel, s: &str) {
        if s.is_empty() {
            return;
        }
        let hold = ch == Channel::Reasoning || self.opts.parse_tool_calls;
        let body = if hold { s.trim_end_matches('\n') } else { s };
        if !body.is_empty() {
            self.flush_pending(ch);
            self.emit_text(ch, body);
        }
        self.pending_nl += s.len() - body.len();
    }

    fn flush_pending(&mut self, ch: Channel) {
        if self.pending_nl > 0 {
            let nl = "\n".repeat(self.pending_nl);
            self.pending_nl = 0;
            self.emit_text(ch, &nl);
        }
    }

    fn emit_text(&mut self, ch: Channel, s: &str) {
        match (ch, self.events.last_mut()) {
            (Channel::Reasoning, Some(ParseEvent::Reasoning(t))) | (Channel::Content, Some(ParseEvent::Content(t))) => t.push_str(s),
            (Channel::Reasoning, _) => self.events.push(ParseEvent::Reasoning(s.to_string())),
            (Channel::Content, _) => self.events.push(ParseEvent::Content(s.to_string())),
        }
    }

    fn emit_args(&mut self, s: &str) {
        let Some(index) = self.call.as_ref().map(|c| c.index) else { return };
        match self.events.last_mut() {
            Some(ParseEvent::ToolCallArguments { index: i, delta }) if *i == index => delta.push_str(s),
            _ => self.events.push(ParseEvent::ToolCallArguments { index, delta: s.to_string() }),
        }
    }

    fn warn(&mut self, why: &str) {
        self.events.push(ParseEvent::Warning(why.to_string()));
    }

    /// Uncommitted markup proved malformed: it is text again, in the channel it came from.
    fn fail_open(&mut self, back: Channel, why: &str) {
        self.warn(&format!("malformed tool call markup ({why}); kept as text"));
        let raw = std::mem::take(&mut self.raw);
        self.state = State::Text(back);
        self.skip_nl = false;
        self.text(back, &raw);
    }

    /// A committed call went wrong: close it with what it has; the rest is content.
    fn fail_call(&mut self, why: &str) {
        self.warn(&format!("malformed tool call markup ({why}); call closed, rest kept as content"));
        self.close_call();
        let raw = std::mem::take(&mut self.raw);
        self.state = State::Text(Channel::Content);
        self.skip_nl = false;
        self.text(Channel::Content, &raw);
    }

    fn commit(&mut self) {
        let index = self.n_calls;
        self.n_calls += 1;
        let name = std::mem::take(&mut self.name);
        self.raw.clear();
        let id = self.call_id(index);
        self.events.push(ParseEvent::ToolCallBegin { index, id, name: name.clone() });
        self.call = Some(Call { index, name, n_params: 0 });
        self.state = State::Body;
    }

    fn close_call(&mut self) {
        let Some(n_params) = self.call.as_ref().map(|c| c.n_params) else { return };
        self.emit_args(if n_params == 0 { "{}" } else { "}" });
        if let Some(call) = self.call.take() {
            self.events.push(ParseEvent::ToolCallEnd { index: call.index });
        }
    }

    /// `"key": ` preceded by `{` or `, `.
    fn param_prefix(&mut self) -> String {
        let Some(call) = self.call.as_mut() else { return String::new() };
        let mut s = String::from(if call.n_params == 0 { "{" } else { ", " });
        call.n_params += 1;
        write_json_str(&mut s, &self.param.key);
        s.push_str(": ");
        s
    }

    fn open_param(&mut self) {
        let tool = self.call.as_ref().map(|c| c.name.as_str()).unwrap_or_default();
        let ty = ParamType::lookup(&self.opts.tools, tool, &self.name);
        self.param = Param { key: std::mem::take(&mut self.name), ty: Some(ty), value: String::new(), at_start: true, nl_held: false };
        self.raw.clear();
        self.state = State::ParamValue;
        if self.param.streamed() {
            let mut s = self.param_prefix();
            s.push('"');
            self.emit_args(&s);
        }
    }

    fn value_text(&mut self, s: &str) {
        if !self.param.streamed() {
            self.param.value.push_str(s);
            return;
        }
        let mut s = s;
        if self.param.at_start && !s.is_empty() {
            self.param.at_start = false;
            s = s.strip_prefix('\n').unwrap_or(s);
        }
        if s.is_empty() {
            return;
        }
        let mut out = String::new();
        if self.param.nl_held {
            out.push_str("\\n");
        }
        let body = s.strip_suffix('\n');
        self.param.nl_held = body.is_some();
        write_json_str_body(&mut out, body.unwrap_or(s));
        if !out.is_empty() {
            self.emit_args(&out);
        }
    }

    fn close_param(&mut self) {
        if self.param.streamed() {
            self.emit_args("\"");
            return;
        }
        let value = std::mem::take(&mut self.param.value);
        let v = value.strip_prefix('\n').unwrap_or(&value);
        let v = v.strip_suffix('\n').unwrap_or(v);
        let ty = self.param.ty.take().unwrap_or(ParamType::Unknown);
        let mut s = self.param_prefix();
        s.push_str(&value_json(&ty, v));
        self.emit_args(&s);
    }

    /// `call_` + 24 base-62 chars from a bijective mix of (seed, index): unique per parser.
    fn call_id(&self, index: usize) -> String {
        const DIGITS: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
        let a = splitmix64(self.id_seed.wrapping_add((index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)));
        let b = splitmix64(a ^ self.id_seed.rotate_left(32));
        let mut x = (u128::from(a) << 64) | u128::from(b);
        let mut id = String::from("call_");
        for _ in 0..24 {
            id.push(DIGITS[(x % 62) as usize] as char);
            x /= 62;
        }
        id
    }
}

fn leading_ws(s: &str) -> usize {
    s.len() - s.trim_start().len()
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
