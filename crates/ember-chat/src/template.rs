//! `ChatTemplate`: a GGUF `tokenizer.chat_template` compiled once, rendered per request with
//! the environment HF transformers uses (`_compile_jinja_template` / `apply_chat_template`).

use std::fmt;

use minijinja::value::{Kwargs, Serde, Value, ValueKind};
use minijinja::{Environment, ErrorKind, syntax::SyntaxConfig};
use serde_json::Value as Json;

use crate::Error;
use crate::python::{self, JsonOpts};

const NAME: &str = "chat_template";

/// Context names HF's `apply_chat_template` sets itself; `chat_template_kwargs` may not
/// replace them (Python would fail with "got multiple values for keyword argument").
const RESERVED: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

/// A compiled chat template. Cheap to share (`Send + Sync`); render from many threads.
pub struct ChatTemplate {
    env: Environment<'static>,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

/// One render: what `apply_chat_template(messages, tools=..., add_generation_prompt=...,
/// **chat_template_kwargs)` receives.
#[derive(Debug, Clone, Default)]
pub struct RenderRequest<'a> {
    /// OpenAI-style messages, passed to the template as they are, except that
    /// `tool_calls[].function.arguments` JSON strings are parsed to objects first.
    pub messages: &'a [Json],
    /// The request's `tools` array; `None` renders as Python `None` (HF passes `tools=None`).
    pub tools: Option<&'a Json>,
    pub add_generation_prompt: bool,
    /// `chat_template_kwargs` (`enable_thinking`, `preserve_thinking`, ...). A key that is absent
    /// is undefined in the template, which differs from `false` (`enable_thinking is defined`).
    pub kwargs: serde_json::Map<String, Json>,
    /// Special tokens as HF passes them; `None` leaves the name undefined (Qwen has no BOS).
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
}

impl<'a> RenderRequest<'a> {
    /// Messages only, with the generation prompt on: the common case.
    pub fn new(messages: &'a [Json]) -> Self {
        RenderRequest { messages, add_generation_prompt: true, ..Default::default() }
    }
}

impl ChatTemplate {
    /// Compiles `source`. Syntax errors name the cause and line.
    pub fn new(source: &str) -> Result<Self, Error> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false) // Jinja2 default: drop one trailing newline
            .build()
            .map_err(|e| Error::Syntax(e.to_string()))?;
        env.set_syntax(syntax);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(|out, _state, value| {
            // `{{ x }}` is Python `str(x)`: floats as `1e-07`, containers as repr.
            match value.as_str() {
                Some(s) => out.write_str(s)?,
                None => out.write_str(&python::py_str(value))?,
            }
            Ok(())
        });
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_filter("string", string);
        // minijinja's `none is iterable` is true; Jinja2's is false (STACK.md: Qwen3-Coder
        // depends on it).
        env.add_test("iterable", |v: Value| !v.is_none() && !v.is_undefined() && v.try_iter().is_ok());
        // Jinja2 `test_sequence`: has len() and __getitem__ -> str, list, dict.
        env.add_test("sequence", |v: Value| matches!(v.kind(), ValueKind::String | ValueKind::Seq | ValueKind::Map));
        env.add_template_owned(NAME, source.to_string()).map_err(|e| Error::Syntax(e.to_string()))?;
        Ok(ChatTemplate { env })
    }

    /// Renders the prompt. `raise_exception(msg)` in the template becomes
    /// [`Error::Template`] carrying `msg` verbatim.
    pub fn render(&self, req: &RenderRequest<'_>) -> Result<String, Error> {
        let mut ctx = serde_json::Map::new();
        ctx.insert("messages".into(), Json::Array(normalize_messages(req.messages)?));
        ctx.insert("tools".into(), req.tools.cloned().unwrap_or(Json::Null));
        ctx.insert("documents".into(), Json::Null);
        ctx.insert("add_generation_prompt".into(), Json::Bool(req.add_generation_prompt));
        if let Some(t) = &req.bos_token {
            ctx.insert("bos_token".into(), Json::String(t.clone()));
        }
        if let Some(t) = &req.eos_token {
            ctx.insert("eos_token".into(), Json::String(t.clone()));
        }
        for (key, value) in &req.kwargs {
            if RESERVED.contains(&key.as_str()) {
                return Err(Error::ReservedKwarg(key.clone()));
            }
            ctx.insert(key.clone(), value.clone());
        }
        let tmpl = self.env.get_template(NAME).map_err(|e| Error::Syntax(e.to_string()))?;
        tmpl.render(Value::from(Serde(&ctx))).map_err(render_error)
    }
}

/// Parses `tool_calls[].function.arguments` (and `tool_calls[].arguments`) given as JSON
/// strings, as llama.cpp and vLLM do before rendering: templates iterate `arguments|items`.
/// An empty string means no arguments (`{}`).
fn normalize_messages(messages: &[Json]) -> Result<Vec<Json>, Error> {
    let mut out = messages.to_vec();
    for (i_msg, msg) in out.iter_mut().enumerate() {
        let Some(calls) = msg.get_mut("tool_calls").and_then(Json::as_array_mut) else {
            continue;
        };
        for (i_call, call) in calls.iter_mut().enumerate() {
            let target = if call.get("function").is_some_and(Json::is_object) { &mut call["function"] } else { call };
            let Some(Json::String(text)) = target.get("arguments") else {
                continue;
            };
            let parsed = if text.trim().is_empty() {
                Json::Object(Default::default())
            } else {
                serde_json::from_str(text).map_err(|e| Error::ToolCallArguments { message: i_msg, call: i_call, reason: e.to_string() })?
            };
            target["arguments"] = parsed;
        }
    }
    Ok(out)
}

/// The message of a template's `raise_exception`, carried through minijinja as the source
/// of the error so it can be told apart from engine errors.
#[derive(Debug)]
struct Raised(String);

impl fmt::Display for Raised {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
}

fn render_error(err: minijinja::Error) -> Error {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = source {
        if let Some(raised) = e.downcast_ref::<Raised>() {
            return Error::Template { message: raised.0.clone() };
        }
        source = e.source();
    }
    Error::Render(err.to_string())
}

/// HF: `datetime.now().strftime(format)`. We use UTC (servers run in UTC; the local zone of
/// the machine is not part of the request).
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    python::strftime_utc(&format, secs)
}

/// HF's filter: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`; positional or keyword options.
fn tojson(
    value: &Value,
    ensure_ascii: Option<Value>,
    indent: Option<Value>,
    separators: Option<Value>,
    kwargs: Kwargs,
) -> Result<Value, minijinja::Error> {
    let ensure_ascii = kwargs.get::<Option<Value>>("ensure_ascii")?.or(ensure_ascii);
    let indent = kwargs.get::<Option<Value>>("indent")?.or(indent);
    let separators = kwargs.get::<Option<Value>>("separators")?.or(separators);
    let sort_keys = kwargs.get::<Option<Value>>("sort_keys")?;
    kwargs.assert_all_used()?;

    let mut opts = JsonOpts { ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()), ..Default::default() };
    match indent {
        Some(v) if v.is_none() || v.is_undefined() => {}
        None => {}
        Some(v) => {
            opts.indent = Some(match v.as_str() {
                Some(s) => s.to_string(),
                None => " ".repeat(i64::try_from(v)?.max(0) as usize),
            });
            // Python: separators default to (',', ': ') when indent is set.
            opts.item_sep = ",".into();
        }
    }
    if let Some(seps) = separators.filter(|v| !v.is_none() && !v.is_undefined()) {
        let parts: Vec<Value> = seps.try_iter()?.collect();
        match parts.as_slice() {
            [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                opts.item_sep = item.as_str().unwrap_or_default().to_string(); // checked in the guard
                opts.key_sep = key.as_str().unwrap_or_default().to_string();
            }
            _ => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be an (item_separator, key_separator) pair of strings",
                ));
            }
        }
    }
    opts.sort_keys = sort_keys.is_some_and(|v| v.is_true());
    let mut out = String::new();
    python::write_json(&mut out, value, &opts, 0)?;
    Ok(Value::from_safe_string(out))
}

/// Python `str(x)`; strings keep their safe flag.
fn string(value: &Value) -> Value {
    if value.kind() == ValueKind::String {
        return value.clone();
    }
    Value::from(python::py_str(value))
}
