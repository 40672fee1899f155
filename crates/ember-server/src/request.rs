//! JSON bodies -> typed requests. Every check names the field and the limit; fields we know
//! but do not implement are refused with a 400 that says so; unknown fields are ignored, as
//! OpenAI does.

use ember_chat::ToolSpec;
use ember_engine::SamplerConfig;
use serde_json::{Map, Value};

use crate::error::ApiError;

/// Most entries in `stop`.
pub const MAX_STOP: usize = 16;
/// Most `top_logprobs` (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Generation parameters shared by chat and completions.
#[derive(Debug, Clone)]
pub struct GenParams {
    pub sampler: SamplerConfig,
    /// `None`: until the context is full.
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// `Some(k)`: report logprobs with `k` alternatives per token.
    pub logprobs: Option<usize>,
    /// `ignore_eos` (llama-server, vLLM): end-of-generation tokens are never sampled.
    pub ignore_eos: bool,
}

#[derive(Debug, Clone)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<Value>,
    /// The `tools` array as sent (rendered by the template), `None` when absent or empty.
    pub tools: Option<Value>,
    pub tool_specs: Vec<ToolSpec>,
    /// False with `tool_choice: "none"`.
    pub parse_tool_calls: bool,
    pub kwargs: Map<String, Value>,
    pub params: GenParams,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Debug, Clone)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Prompt,
    pub params: GenParams,
}

/// Parses a request body into a JSON object.
pub fn parse_body(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("We could not parse the JSON body of your request: {e}")).with_code("invalid_json"))?;
    match v {
        Value::Object(m) => Ok(m),
        other => Err(ApiError::invalid(format!("The request body must be a JSON object, got {}", kind(&other))).with_code("invalid_json")),
    }
}

pub(crate) fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Typed access to the fields of one request object; `null` counts as absent.
struct Fields<'a>(&'a Map<String, Value>);

impl<'a> Fields<'a> {
    fn get(&self, name: &str) -> Option<&'a Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    fn type_err(name: &str, want: &str, got: &Value) -> ApiError {
        ApiError::param(name, format!("`{name}` must be {want}, got {}", kind(got))).with_code("invalid_type")
    }

    fn range_err(name: &str, limit: &str, got: impl std::fmt::Display) -> ApiError {
        ApiError::param(name, format!("`{name}` must be {limit}, got {got}")).with_code("invalid_value")
    }

    fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(Self::type_err(name, "a boolean", v)),
        }
    }

    fn string(&self, name: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(Self::type_err(name, "a string", v)),
        }
    }

    /// A number in `[lo, hi]`.
    fn number(&self, name: &str, lo: f64, hi: f64) -> Result<Option<f32>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Number(n)) => {
                // unwrap_or: serde_json numbers always convert to f64 (maybe lossily).
                let x = n.as_f64().unwrap_or(f64::NAN);
                if !(lo..=hi).contains(&x) {
                    return Err(Self::range_err(name, &format!("between {lo} and {hi}"), n));
                }
                Ok(Some(x as f32))
            }
            Some(v) => Err(Self::type_err(name, "a number", v)),
        }
    }

    /// An integer in `[lo, hi]`.
    fn int(&self, name: &str, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Number(n)) => {
                let Some(x) = n.as_i64().or_else(|| n.as_u64().map(|_| i64::MAX)) else {
                    return Err(Self::type_err(name, "an integer", &Value::Number(n.clone())));
                };
                if !(lo..=hi).contains(&x) {
                    return Err(Self::range_err(name, &format!("between {lo} and {hi}"), n));
                }
                Ok(Some(x))
            }
            Some(v) => Err(Self::type_err(name, "an integer", v)),
        }
    }
}

/// Sampling, limits, stop strings and streaming options common to both endpoints.
/// `chat` selects the chat form of `logprobs` (bool + `top_logprobs`) over the legacy integer.
fn gen_params(f: &Fields, chat: bool) -> Result<GenParams, ApiError> {
    if let Some(n) = f.int("n", i64::MIN, i64::MAX)?
        && n != 1
    {
        return Err(ApiError::unsupported("n", format!("only `n` = 1 is supported, got {n}")));
    }
    if let Some(rf) = f.get("response_format") {
        let ty = rf.get("type").and_then(Value::as_str);
        if ty != Some("text") {
            return Err(ApiError::unsupported("response_format", "`response_format` is not supported yet (only {\"type\": \"text\"})"));
        }
    }
    if let Some(lb) = f.get("logit_bias")
        && lb.as_object().is_none_or(|m| !m.is_empty())
    {
        return Err(ApiError::unsupported("logit_bias", "`logit_bias` is not supported yet"));
    }

    let d = SamplerConfig::default();
    let top_k = f.int("top_k", -1, i64::from(u32::MAX))?;
    let seed = match f.get("seed") {
        None => None,
        Some(Value::Number(n)) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => Some(u),
            // Negative seeds are accepted (some clients send -1); reinterpret the bits.
            (None, Some(i)) => Some(i as u64),
            _ => return Err(Fields::type_err("seed", "an integer", &Value::Number(n.clone()))),
        },
        Some(v) => return Err(Fields::type_err("seed", "an integer", v)),
    };
    let repeat = match f.number("repetition_penalty", 0.0, 10.0)? {
        Some(x) => Some(x),
        None => f.number("repeat_penalty", 0.0, 10.0)?,
    };
    if repeat == Some(0.0) {
        return Err(Fields::range_err("repetition_penalty", "greater than 0", 0));
    }
    let top_p = f.number("top_p", 0.0, 1.0)?;
    if top_p == Some(0.0) {
        return Err(Fields::range_err("top_p", "greater than 0 and at most 1", 0));
    }
    let sampler = SamplerConfig {
        temperature: f.number("temperature", 0.0, 2.0)?.unwrap_or(d.temperature),
        top_k: top_k.map_or(d.top_k, |k| k.max(0) as usize),
        top_p: top_p.unwrap_or(d.top_p),
        min_p: f.number("min_p", 0.0, 1.0)?.unwrap_or(d.min_p),
        repeat_penalty: repeat.unwrap_or(d.repeat_penalty),
        presence_penalty: f.number("presence_penalty", -2.0, 2.0)?.unwrap_or(d.presence_penalty),
        frequency_penalty: f.number("frequency_penalty", -2.0, 2.0)?.unwrap_or(d.frequency_penalty),
        penalty_last_n: d.penalty_last_n,
        seed,
    };
    // `max_completion_tokens` is the current name; `max_tokens` the deprecated one.
    let max_tokens = match f.int("max_completion_tokens", 1, i64::MAX)? {
        Some(n) => Some(n),
        None => f.int("max_tokens", 1, i64::MAX)?,
    }
    .map(|n| usize::try_from(n).unwrap_or(usize::MAX));

    let stop = match f.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            if items.len() > MAX_STOP {
                return Err(Fields::range_err("stop", &format!("at most {MAX_STOP} strings"), format!("{} strings", items.len())));
            }
            let mut out = Vec::with_capacity(items.len());
            for (i, it) in items.iter().enumerate() {
                match it {
                    Value::String(s) => out.push(s.clone()),
                    v => return Err(Fields::type_err(&format!("stop[{i}]"), "a string", v)),
                }
            }
            out
        }
        Some(v) => return Err(Fields::type_err("stop", "a string or an array of strings", v)),
    };
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::param("stop", "`stop` strings must not be empty").with_code("invalid_value"));
    }

    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.get("stream_options") {
        None => false,
        Some(Value::Object(o)) => Fields(o)
            .bool("include_usage")
            .map_err(|e| ApiError { param: Some("stream_options.include_usage".into()), ..e })?
            .unwrap_or(false),
        Some(v) => return Err(Fields::type_err("stream_options", "an object", v)),
    };

    let logprobs = if chat {
        let on = f.bool("logprobs")?.unwrap_or(false);
        let top = f.int("top_logprobs", 0, MAX_TOP_LOGPROBS as i64)?;
        match (on, top) {
            (false, Some(_)) => return Err(ApiError::param("top_logprobs", "`top_logprobs` requires `logprobs` to be true")),
            (false, None) => None,
            (true, top) => Some(top.unwrap_or(0) as usize),
        }
    } else {
        f.int("logprobs", 0, MAX_TOP_LOGPROBS as i64)?.map(|k| k as usize)
    };

    let ignore_eos = f.bool("ignore_eos")?.unwrap_or(false);
    Ok(GenParams { sampler, max_tokens, stop, stream, include_usage, logprobs, ignore_eos })
}

fn model(f: &Fields) -> Result<Option<String>, ApiError> {
    Ok(f.string("model")?.map(str::to_string))
}

/// The template inputs of a chat request (also what `/apply-template` takes).
pub struct TemplateInput {
    pub messages: Vec<Value>,
    pub tools: Option<Value>,
    pub kwargs: Map<String, Value>,
}

pub fn template_input(body: &Map<String, Value>) -> Result<TemplateInput, ApiError> {
    let f = Fields(body);
    let messages = match f.get("messages") {
        None => return Err(ApiError::param("messages", "`messages` is required").with_code("missing_required_parameter")),
        Some(Value::Array(m)) => m,
        Some(v) => return Err(Fields::type_err("messages", "an array", v)),
    };
    if messages.is_empty() {
        return Err(ApiError::param("messages", "`messages` must not be empty").with_code("invalid_value"));
    }
    let messages = crate::messages::map_messages(messages)?;
    let tools = match f.get("tools") {
        None => None,
        Some(Value::Array(t)) if t.is_empty() => None,
        Some(t @ Value::Array(_)) => Some(t.clone()),
        Some(v) => return Err(Fields::type_err("tools", "an array", v)),
    };
    let kwargs = match f.get("chat_template_kwargs") {
        None => Map::new(),
        Some(Value::Object(o)) => o.clone(),
        Some(v) => return Err(Fields::type_err("chat_template_kwargs", "an object", v)),
    };
    Ok(TemplateInput { messages, tools, kwargs })
}

pub fn chat(body: &Map<String, Value>) -> Result<ChatRequest, ApiError> {
    let f = Fields(body);
    let model = model(&f)?;
    let TemplateInput { messages, tools, kwargs } = template_input(body)?;
    let tool_specs = match &tools {
        None => Vec::new(),
        Some(t) => ToolSpec::from_openai_tools(t).map_err(|e| ApiError::param("tools", e.to_string()))?,
    };
    let parse_tool_calls = match f.get("tool_choice") {
        None => true,
        Some(Value::String(s)) if s == "auto" => true,
        Some(Value::String(s)) if s == "none" => false,
        Some(Value::String(s)) if s == "required" => {
            return Err(ApiError::unsupported("tool_choice", "`tool_choice` \"required\" is not supported yet (use \"auto\" or \"none\")"));
        }
        Some(Value::Object(_)) => {
            return Err(ApiError::unsupported(
                "tool_choice",
                "forcing a named function with `tool_choice` is not supported yet (use \"auto\" or \"none\")",
            ));
        }
        Some(v) => return Err(Fields::type_err("tool_choice", "\"auto\", \"none\" or an object", v)),
    };
    let params = gen_params(&f, true)?;
    Ok(ChatRequest { model, messages, tools, tool_specs, parse_tool_calls, kwargs, params })
}

pub fn completion(body: &Map<String, Value>) -> Result<CompletionRequest, ApiError> {
    let f = Fields(body);
    let model = model(&f)?;
    if f.bool("echo")? == Some(true) {
        return Err(ApiError::unsupported("echo", "`echo` is not supported"));
    }
    if let Some(s) = f.string("suffix")?
        && !s.is_empty()
    {
        return Err(ApiError::unsupported("suffix", "`suffix` is not supported"));
    }
    if let Some(n) = f.int("best_of", i64::MIN, i64::MAX)?
        && n != 1
    {
        return Err(ApiError::unsupported("best_of", format!("only `best_of` = 1 is supported, got {n}")));
    }
    let ids = |items: &[Value]| -> Result<Vec<u32>, ApiError> {
        items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_u64()
                    .and_then(|x| u32::try_from(x).ok())
                    .ok_or_else(|| Fields::type_err(&format!("prompt[{i}]"), "a token id (an integer >= 0)", v))
            })
            .collect()
    };
    let prompt = match f.get("prompt") {
        None => return Err(ApiError::param("prompt", "`prompt` is required").with_code("missing_required_parameter")),
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Array(items)) => match items.as_slice() {
            [] => return Err(ApiError::param("prompt", "`prompt` must not be empty").with_code("invalid_value")),
            [Value::String(s)] => Prompt::Text(s.clone()),
            [Value::Array(inner)] => Prompt::Tokens(ids(inner)?),
            [Value::Number(_), ..] => Prompt::Tokens(ids(items)?),
            [_, _, ..] if items.iter().all(|v| v.is_string() || v.is_array()) => {
                return Err(ApiError::unsupported("prompt", "only one prompt per request is supported"));
            }
            _ => {
                return Err(Fields::type_err(
                    "prompt",
                    "a string, an array of token ids or an array of one string",
                    &Value::Array(items.clone()),
                ));
            }
        },
        Some(v) => return Err(Fields::type_err("prompt", "a string or an array of token ids", v)),
    };
    let params = gen_params(&f, false)?;
    Ok(CompletionRequest { model, prompt, params })
}

/// `/tokenize` (llama-server): `{"content", "add_special", "parse_special", "with_pieces"}`.
pub struct TokenizeRequest {
    pub content: String,
    pub parse_special: bool,
    pub with_pieces: bool,
}

pub fn tokenize(body: &Map<String, Value>) -> Result<TokenizeRequest, ApiError> {
    let f = Fields(body);
    let content =
        f.string("content")?.ok_or_else(|| ApiError::param("content", "`content` is required").with_code("missing_required_parameter"))?;
    // `add_special` would add BOS; Qwen has none to add, so it is accepted and has no effect.
    f.bool("add_special")?;
    Ok(TokenizeRequest {
        content: content.to_string(),
        parse_special: f.bool("parse_special")?.unwrap_or(true),
        with_pieces: f.bool("with_pieces")?.unwrap_or(false),
    })
}

/// `/detokenize`: `{"tokens": [ids]}`.
pub fn detokenize(body: &Map<String, Value>) -> Result<Vec<u32>, ApiError> {
    let f = Fields(body);
    match f.get("tokens") {
        None => Ok(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_u64()
                    .and_then(|x| u32::try_from(x).ok())
                    .ok_or_else(|| Fields::type_err(&format!("tokens[{i}]"), "a token id (an integer >= 0)", v))
            })
            .collect(),
        Some(v) => Err(Fields::type_err("tokens", "an array of token ids", v)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn errors_name_the_field_and_limit() {
        let e = chat(&obj(json!({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}))).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"));
        assert!(e.message.contains("between 0 and 2") && e.message.contains('3'), "{}", e.message);
        let e = chat(&obj(json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "x"}))).unwrap_err();
        assert_eq!(e.message, "`max_tokens` must be an integer, got a string");
        let e = chat(&obj(json!({"messages": "hi"}))).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = chat(&obj(json!({"messages": [{"role": "user", "content": "hi"}], "n": 2}))).unwrap_err();
        assert!(e.message.contains("n") && e.code == Some("unsupported_parameter"));
        let e = chat(&obj(json!({"messages": [{"role": "user"}], "top_logprobs": 3}))).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("top_logprobs"));
        let e = chat(&obj(json!({"messages": [{"role": "user"}], "logprobs": true, "top_logprobs": 21}))).unwrap_err();
        assert!(e.message.contains("between 0 and 20"));
        let e = chat(&obj(json!({"messages": [{"role": "user"}], "ignore_eos": "yes"}))).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("ignore_eos"));
    }

    #[test]
    fn ignore_eos_is_taken() {
        let m = json!([{"role": "user", "content": "hi"}]);
        assert!(chat(&obj(json!({"messages": m, "ignore_eos": true}))).unwrap().params.ignore_eos);
        assert!(!chat(&obj(json!({"messages": m}))).unwrap().params.ignore_eos);
        assert!(completion(&obj(json!({"prompt": "x", "ignore_eos": true}))).unwrap().params.ignore_eos);
    }

    #[test]
    fn unknown_fields_and_nulls_are_ignored() {
        let r = chat(&obj(
            json!({"messages": [{"role": "user", "content": "hi"}], "frobnicate": 1, "temperature": null, "stop": ["a", "b"], "seed": -1}),
        ))
        .unwrap();
        assert_eq!(r.params.stop, ["a", "b"]);
        assert_eq!(r.params.sampler.seed, Some(u64::MAX));
        assert_eq!(r.params.sampler.temperature, SamplerConfig::default().temperature);
    }

    #[test]
    fn completion_prompt_forms() {
        let p = |v: Value| completion(&obj(json!({ "prompt": v }))).map(|r| r.prompt);
        assert_eq!(p(json!("ab")).unwrap(), Prompt::Text("ab".into()));
        assert_eq!(p(json!([1, 2])).unwrap(), Prompt::Tokens(vec![1, 2]));
        assert_eq!(p(json!(["ab"])).unwrap(), Prompt::Text("ab".into()));
        assert!(p(json!(["a", "b"])).unwrap_err().message.contains("one prompt"));
        assert!(p(json!([1, -2])).is_err());
        let e = completion(&obj(json!({"prompt": "x", "echo": true}))).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("echo"));
    }
}
