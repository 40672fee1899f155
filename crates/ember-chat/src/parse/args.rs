//! Tool-call arguments: a `<parameter=P>` value (text) -> JSON, typed by the tool's schema.
//!
//! JSON text is written like Python's `json.dumps(x, ensure_ascii=False)` (separators `", "`
//! and `": "`, floats as `1.0`), the same form the chat template's `tojson` gives, so a call
//! rendered back into the prompt reads as the model wrote it.

use std::fmt::Write as _;

use serde_json::Value as Json;

use crate::Error;
use crate::python::write_float;

/// A tool the request offers: its name and its JSON schema (`function.parameters`), used to
/// decide whether a parameter value is a string or JSON.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub parameters: Json,
}

impl ToolSpec {
    /// Reads an OpenAI `tools` array: `[{"type": "function", "function": {"name", "description",
    /// "parameters"}}]`. `null` is no tools. A missing `type` is taken as `"function"`; a missing
    /// `parameters` leaves every parameter's type unknown.
    pub fn from_openai_tools(tools: &Json) -> Result<Vec<ToolSpec>, Error> {
        let bad = |field: String, reason: &str| Error::Tools { field, reason: reason.to_string() };
        let list = match tools {
            Json::Null => return Ok(Vec::new()),
            Json::Array(list) => list,
            _ => return Err(bad("tools".into(), "must be an array")),
        };
        let mut specs = Vec::with_capacity(list.len());
        for (i, tool) in list.iter().enumerate() {
            let Some(tool) = tool.as_object() else {
                return Err(bad(format!("tools[{i}]"), "must be an object"));
            };
            match tool.get("type") {
                None => {}
                Some(Json::String(t)) if t == "function" => {}
                Some(_) => return Err(bad(format!("tools[{i}].type"), "must be \"function\"")),
            }
            let Some(function) = tool.get("function").and_then(Json::as_object) else {
                return Err(bad(format!("tools[{i}].function"), "must be an object"));
            };
            let name = match function.get("name") {
                Some(Json::String(name)) if !name.is_empty() => name.clone(),
                _ => return Err(bad(format!("tools[{i}].function.name"), "must be a non-empty string")),
            };
            let parameters = function.get("parameters").cloned().unwrap_or(Json::Null);
            specs.push(ToolSpec { name, parameters });
        }
        Ok(specs)
    }
}

/// What the schema says about one parameter.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ParamType {
    /// No schema, no `type` we can read: JSON if the value parses, else a string.
    Unknown,
    /// `"type": "string"` only: the value is taken verbatim (and can be streamed).
    String,
    /// The JSON-schema type names (`type`, a `type` array, or the union over `anyOf`/`oneOf`).
    Types(Vec<String>),
}

impl ParamType {
    /// Looks up `properties.<param>` of the tool named `tool` in `tools`.
    pub(crate) fn lookup(tools: &[ToolSpec], tool: &str, param: &str) -> ParamType {
        let prop = tools.iter().find(|t| t.name == tool).and_then(|t| t.parameters.get("properties")).and_then(|p| p.get(param));
        let mut types = Vec::new();
        if let Some(prop) = prop {
            collect_types(prop, &mut types);
        }
        match types.as_slice() {
            [] => ParamType::Unknown,
            [t] if t == "string" => ParamType::String,
            _ => ParamType::Types(types),
        }
    }
}

fn collect_types(schema: &Json, out: &mut Vec<String>) {
    let mut add = |t: &str| {
        if !out.iter().any(|o| o == t) {
            out.push(t.to_string());
        }
    };
    match schema.get("type") {
        Some(Json::String(t)) => add(t),
        Some(Json::Array(ts)) => ts.iter().filter_map(Json::as_str).for_each(add),
        _ => {}
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(Json::Array(branches)) = schema.get(key) {
            for b in branches {
                collect_types(b, out);
            }
        }
    }
}

/// The JSON text of a parameter value. `raw` has already lost the format's one leading and
/// one trailing newline.
///
/// * `string` only: the text verbatim;
/// * `string` among other types: JSON if it parses to one of the other types (`null` for
///   `["string", "null"]`), else the text;
/// * other types or unknown: JSON if it parses; for a known non-string type also Python's
///   `True`/`False`/`None` (the Qwen3.5 template renders history arguments with `str()`);
///   else the text as a string.
pub(crate) fn value_json(ty: &ParamType, raw: &str) -> String {
    let mut out = String::new();
    let parsed = match ty {
        ParamType::String => None,
        ParamType::Unknown => serde_json::from_str::<Json>(raw).ok(),
        ParamType::Types(types) => {
            let has = |t: &str| types.iter().any(|x| x == t);
            let parsed = serde_json::from_str::<Json>(raw).ok().or_else(|| match raw.trim() {
                "True" => Some(Json::Bool(true)),
                "False" => Some(Json::Bool(false)),
                "None" => Some(Json::Null),
                _ => None,
            });
            match parsed {
                // A string-capable parameter keeps its text unless it parsed to another allowed type.
                Some(v) if has("string") => types.iter().any(|t| t != "string" && json_has_type(&v, t)).then_some(v),
                other => other,
            }
        }
    };
    match parsed {
        Some(v) => write_json(&mut out, &v),
        None => write_json_str(&mut out, raw),
    }
    out
}

fn json_has_type(v: &Json, t: &str) -> bool {
    match (v, t) {
        (Json::Null, "null") | (Json::Bool(_), "boolean") | (Json::Object(_), "object") | (Json::Array(_), "array") => true,
        (Json::Number(_), "number") => true,
        (Json::Number(n), "integer") => n.is_i64() || n.is_u64(),
        _ => false,
    }
}

/// `json.dumps(v, ensure_ascii=False)`.
pub(crate) fn write_json(out: &mut String, v: &Json) {
    match v {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Number(n) => {
            if let Some(i) = n.as_i64() {
                let _ = write!(out, "{i}");
            } else if let Some(u) = n.as_u64() {
                let _ = write!(out, "{u}");
            } else {
                // serde_json only yields finite floats.
                write_float(out, n.as_f64().unwrap_or(0.0));
            }
        }
        Json::String(s) => write_json_str(out, s),
        Json::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_json(out, item);
            }
            out.push(']');
        }
        Json::Object(map) => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_json_str(out, k);
                out.push_str(": ");
                write_json(out, item);
            }
            out.push('}');
        }
    }
}

/// A JSON string literal, Python-style (`ensure_ascii=False`).
pub(crate) fn write_json_str(out: &mut String, s: &str) {
    out.push('"');
    write_json_str_body(out, s);
    out.push('"');
}

/// The inside of a JSON string literal (`ensure_ascii=False`): see `python::write_json_str_body`.
pub(crate) fn write_json_str_body(out: &mut String, s: &str) {
    crate::python::write_json_str_body(out, s, false);
}
