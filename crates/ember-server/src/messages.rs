//! Chat `messages` as OpenAI clients send them -> the messages a chat template renders.
//!
//! The decision a reader would question: we rebuild every message from the fields we know
//! instead of passing the client's JSON through. Templates are written for HF's message shape
//! (`content` a string, `arguments` a mapping) and fail on anything else with errors like
//! "unsupported types string and none"; rebuilding means every value a template sees has been
//! checked here, and a bad one is a 400 naming its field rather than a template failure.
//!
//! What is accepted, per message (`messages[i]`):
//! - `role`: `system`, `developer` (rendered as `system`), `user`, `assistant`, `tool`, and the
//!   deprecated `function` (rendered as `tool`). Anything else is a 400.
//! - `content`: a string, `null` or missing (both render as `""`), or an array of content parts
//!   whose `text` (and, for the assistant, `refusal`) parts are joined into one string.
//!   Image, audio and file parts are refused: this server takes text only.
//! - `name`, `tool_call_id`: strings, kept.
//! - `reasoning_content` (assistant): a string, kept; `null` is dropped.
//! - `tool_calls` (assistant): `[{id, type: "function", function: {name, arguments}}]` where
//!   `arguments` is JSON text (parsed) or an object; empty text or `null` means `{}`.
//!
//! Other fields of a message are dropped (the templates we serve never read them).

use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::request::kind;

/// Roles a request may use, for the error message.
const ROLES: &str = "system, developer, user, assistant, tool or function";

/// Maps every message; the first bad field is the error.
pub fn map_messages(messages: &[Value]) -> Result<Vec<Value>, ApiError> {
    messages.iter().enumerate().map(|(i, m)| map_message(i, m)).collect()
}

fn type_err(field: &str, want: &str, got: &Value) -> ApiError {
    ApiError::param(field, format!("`{field}` must be {want}, got {}", kind(got))).with_code("invalid_type")
}

/// `obj[name]`, with `null` counted as absent.
fn field<'a>(obj: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    obj.get(name).filter(|v| !v.is_null())
}

/// An optional string field, copied into `out` when present.
fn copy_string(obj: &Map<String, Value>, name: &str, path: &str, out: &mut Map<String, Value>) -> Result<(), ApiError> {
    match field(obj, name) {
        None => Ok(()),
        Some(Value::String(s)) => {
            out.insert(name.into(), Value::String(s.clone()));
            Ok(())
        }
        Some(v) => Err(type_err(&format!("{path}.{name}"), "a string", v)),
    }
}

fn map_message(i: usize, m: &Value) -> Result<Value, ApiError> {
    let path = format!("messages[{i}]");
    let Value::Object(obj) = m else {
        return Err(type_err(&path, "an object", m));
    };
    let role = match obj.get("role") {
        None | Some(Value::Null) => {
            return Err(
                ApiError::param(&format!("{path}.role"), format!("`{path}.role` is required")).with_code("missing_required_parameter")
            );
        }
        Some(Value::String(r)) => match r.as_str() {
            "system" | "developer" => "system",
            "user" => "user",
            "assistant" => "assistant",
            "tool" | "function" => "tool",
            other => {
                return Err(ApiError::param(
                    &format!("{path}.role"),
                    format!("`{path}.role` must be one of {ROLES}, got {:?}", truncate(other)),
                )
                .with_code("invalid_value"));
            }
        },
        Some(v) => return Err(type_err(&format!("{path}.role"), "a string", v)),
    };
    let mut out = Map::new();
    out.insert("role".into(), Value::String(role.into()));
    out.insert("content".into(), Value::String(content_text(obj.get("content"), &path, role)?));
    copy_string(obj, "name", &path, &mut out)?;
    if role == "tool" {
        copy_string(obj, "tool_call_id", &path, &mut out)?;
    }
    if role == "assistant" {
        copy_string(obj, "reasoning_content", &path, &mut out)?;
        if let Some(calls) = tool_calls(obj, &path)? {
            out.insert("tool_calls".into(), calls);
        }
    }
    Ok(Value::Object(out))
}

/// Error messages quote client strings; keep them short.
fn truncate(s: &str) -> String {
    match s.char_indices().nth(40) {
        Some((at, _)) => format!("{}...", &s[..at]),
        None => s.to_string(),
    }
}

/// `content` as one string.
fn content_text(content: Option<&Value>, path: &str, role: &str) -> Result<String, ApiError> {
    let field = format!("{path}.content");
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                text.push_str(part_text(part, &format!("{field}[{j}]"), role)?);
            }
            Ok(text)
        }
        Some(v) => Err(type_err(&field, "a string, an array of content parts or null", v)),
    }
}

/// The text of one content part: `{"type": "text", "text": ...}` (the `type` may be left out),
/// or `{"type": "refusal", "refusal": ...}` in an assistant message.
fn part_text<'a>(part: &'a Value, path: &str, role: &str) -> Result<&'a str, ApiError> {
    let Value::Object(p) = part else {
        return Err(type_err(path, "a content part object ({\"type\": \"text\", \"text\": ...})", part));
    };
    let ty = match p.get("type") {
        None => "text",
        Some(Value::String(t)) => t.as_str(),
        Some(v) => return Err(type_err(&format!("{path}.type"), "a string", v)),
    };
    let key = match ty {
        "text" => "text",
        "refusal" if role == "assistant" => "refusal",
        "image_url" | "input_image" | "input_audio" | "file" | "image" | "video" => {
            return Err(ApiError::unsupported(
                &format!("{path}.type"),
                format!("`{path}.type` {ty:?} is not supported: this server takes text only"),
            ));
        }
        other => {
            return Err(ApiError::param(
                &format!("{path}.type"),
                format!(
                    "`{path}.type` must be \"text\"{}, got {:?}",
                    if role == "assistant" { " or \"refusal\"" } else { "" },
                    truncate(other)
                ),
            )
            .with_code("invalid_value"));
        }
    };
    match p.get(key) {
        Some(Value::String(s)) => Ok(s),
        None => {
            Err(ApiError::param(&format!("{path}.{key}"), format!("`{path}.{key}` is required")).with_code("missing_required_parameter"))
        }
        Some(v) => Err(type_err(&format!("{path}.{key}"), "a string", v)),
    }
}

/// `tool_calls` in the shape templates read: `function.arguments` an object. `None` when
/// absent or empty.
fn tool_calls(obj: &Map<String, Value>, path: &str) -> Result<Option<Value>, ApiError> {
    let calls = match field(obj, "tool_calls") {
        None => return Ok(None),
        Some(Value::Array(c)) if c.is_empty() => return Ok(None),
        Some(Value::Array(c)) => c,
        Some(v) => return Err(type_err(&format!("{path}.tool_calls"), "an array", v)),
    };
    let mut out = Vec::with_capacity(calls.len());
    for (j, call) in calls.iter().enumerate() {
        let cpath = format!("{path}.tool_calls[{j}]");
        let Value::Object(c) = call else {
            return Err(type_err(&cpath, "an object", call));
        };
        match field(c, "type") {
            None => {}
            Some(Value::String(t)) if t == "function" => {}
            Some(v) => {
                return Err(ApiError::param(&format!("{cpath}.type"), format!("`{cpath}.type` must be \"function\", got {v}"))
                    .with_code("invalid_value"));
            }
        }
        let fpath = format!("{cpath}.function");
        let f = match field(c, "function") {
            Some(Value::Object(f)) => f,
            None => {
                return Err(ApiError::param(&fpath, format!("`{fpath}` is required")).with_code("missing_required_parameter"));
            }
            Some(v) => return Err(type_err(&fpath, "an object", v)),
        };
        let name = match field(f, "name") {
            Some(Value::String(n)) if !n.is_empty() => n.clone(),
            Some(Value::String(_)) => {
                return Err(
                    ApiError::param(&format!("{fpath}.name"), format!("`{fpath}.name` must not be empty")).with_code("invalid_value")
                );
            }
            None => {
                return Err(ApiError::param(&format!("{fpath}.name"), format!("`{fpath}.name` is required"))
                    .with_code("missing_required_parameter"));
            }
            Some(v) => return Err(type_err(&format!("{fpath}.name"), "a string", v)),
        };
        let apath = format!("{fpath}.arguments");
        let arguments = match field(f, "arguments") {
            None => Value::Object(Map::new()),
            Some(Value::String(s)) if s.trim().is_empty() => Value::Object(Map::new()),
            Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
                Ok(v @ Value::Object(_)) => v,
                Ok(v) => return Err(type_err(&apath, "a JSON object (as text or as an object)", &v)),
                Err(e) => {
                    return Err(ApiError::param(&apath, format!("`{apath}` is not valid JSON: {e}")).with_code("invalid_value"));
                }
            },
            Some(v @ Value::Object(_)) => v.clone(),
            Some(v) => return Err(type_err(&apath, "a JSON object (as text or as an object)", v)),
        };
        let mut function = Map::new();
        function.insert("name".into(), Value::String(name));
        function.insert("arguments".into(), arguments);
        let mut mapped = Map::new();
        copy_string(c, "id", &cpath, &mut mapped)?;
        mapped.insert("type".into(), Value::String("function".into()));
        mapped.insert("function".into(), Value::Object(function));
        out.push(Value::Object(mapped));
    }
    Ok(Some(Value::Array(out)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn one(m: Value) -> Result<Value, ApiError> {
        map_messages(&[m]).map(|mut v| v.remove(0))
    }

    fn param_of(m: Value) -> String {
        one(m).unwrap_err().param.unwrap_or_default()
    }

    #[test]
    fn content_forms_become_one_string() {
        for c in [json!(null), json!("")] {
            assert_eq!(one(json!({"role": "assistant", "content": c})).unwrap()["content"], "");
        }
        assert_eq!(one(json!({"role": "assistant"})).unwrap()["content"], "");
        let parts = json!([{"type": "text", "text": "a"}, {"text": "b"}]);
        assert_eq!(one(json!({"role": "user", "content": parts})).unwrap()["content"], "ab");
        let refusal = json!([{"type": "refusal", "refusal": "no"}]);
        assert_eq!(one(json!({"role": "assistant", "content": refusal})).unwrap()["content"], "no");
    }

    #[test]
    fn roles_map_and_unknown_ones_name_the_field() {
        assert_eq!(one(json!({"role": "developer", "content": "x"})).unwrap()["role"], "system");
        assert_eq!(one(json!({"role": "function", "name": "f", "content": "x"})).unwrap()["role"], "tool");
        let e = one(json!({"role": "wizard", "content": "x"})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        assert!(e.message.contains("wizard") && e.message.contains("assistant"), "{}", e.message);
        assert_eq!(param_of(json!({"content": "x"})), "messages[0].role");
        assert_eq!(param_of(json!({"role": 3})), "messages[0].role");
        assert_eq!(param_of(json!("hi")), "messages[0]");
    }

    #[test]
    fn malformed_parts_name_the_field() {
        let p = |parts: Value| param_of(json!({"role": "user", "content": parts}));
        assert_eq!(p(json!(["x"])), "messages[0].content[0]");
        assert_eq!(p(json!([{"type": "text"}])), "messages[0].content[0].text");
        assert_eq!(p(json!([{"type": "text", "text": 1}])), "messages[0].content[0].text");
        assert_eq!(p(json!([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}])), "messages[0].content[1].type");
        assert_eq!(p(json!([{"type": "refusal", "refusal": "no"}])), "messages[0].content[0].type", "refusal: assistant only");
        assert_eq!(p(json!([{"type": 7}])), "messages[0].content[0].type");
        assert_eq!(param_of(json!({"role": "user", "content": {"text": "a"}})), "messages[0].content");
        assert_eq!(param_of(json!({"role": "user", "content": 5})), "messages[0].content");
        assert_eq!(param_of(json!({"role": "user", "content": "a", "name": 5})), "messages[0].name");
        assert_eq!(param_of(json!({"role": "tool", "content": "a", "tool_call_id": 5})), "messages[0].tool_call_id");
    }

    #[test]
    fn tool_call_arguments_as_text_or_object() {
        let call = |args: Value| json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}]});
        let want = json!({"a": 1});
        for args in [json!("{\"a\": 1}"), json!({"a": 1})] {
            let m = one(call(args)).unwrap();
            assert_eq!(m["tool_calls"][0]["function"]["arguments"], want);
            assert_eq!(m["tool_calls"][0]["id"], "c1");
        }
        for args in [json!(""), json!(null)] {
            assert_eq!(one(call(args)).unwrap()["tool_calls"][0]["function"]["arguments"], json!({}));
        }
        let args_field = "messages[0].tool_calls[0].function.arguments";
        assert_eq!(param_of(call(json!("{not json"))), args_field);
        assert_eq!(param_of(call(json!("[1, 2]"))), args_field);
        assert_eq!(param_of(call(json!(3))), args_field);
        let no_name = json!({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]});
        assert_eq!(param_of(no_name), "messages[0].tool_calls[0].function.name");
        assert_eq!(param_of(json!({"role": "assistant", "tool_calls": [{"type": "code"}]})), "messages[0].tool_calls[0].type");
        assert_eq!(param_of(json!({"role": "assistant", "tool_calls": {}})), "messages[0].tool_calls");
        assert!(one(json!({"role": "assistant", "tool_calls": []})).unwrap().get("tool_calls").is_none());
    }
}
