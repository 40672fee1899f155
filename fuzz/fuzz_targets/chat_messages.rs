//! Chat `messages` as a client could send them (any JSON) through the server's mapping, then
//! the chat template: the mapping either refuses with a 400 naming a `messages[..]` field, or
//! both templates (the real Qwen3.6 one and the tiny fixture's, which concatenates `content`
//! with `+`) render. A render may fail only by the template's own `raise_exception` (e.g.
//! Qwen's "No user query found in messages."), never on a value it cannot handle.

#![no_main]

use std::sync::LazyLock;

use ember_chat::{ChatTemplate, Error, RenderRequest};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fn template(rel: &str) -> ChatTemplate {
    let path = format!("{}/../tests/fixtures/{rel}", env!("CARGO_MANIFEST_DIR"));
    let gguf = ember_gguf::GgufFile::open(&path).expect("fixture GGUF");
    ChatTemplate::new(gguf.get_str("tokenizer.chat_template").expect("chat template")).expect("compiles")
}

static TEMPLATES: LazyLock<[ChatTemplate; 2]> =
    LazyLock::new(|| [template("qwen36-vocab/ggml-vocab-qwen36.gguf"), template("tiny-a/gguf/tiny-a-Q8_0.gguf")]);

fuzz_target!(|data: &[u8]| {
    let Ok(v) = serde_json::from_slice::<Value>(data) else { return };
    let messages = match &v {
        Value::Array(m) => m,
        Value::Object(o) => match o.get("messages") {
            Some(Value::Array(m)) => m,
            _ => return,
        },
        _ => return,
    };
    match ember_server::map_messages(messages) {
        Err(e) => {
            assert_eq!(e.status.as_u16(), 400);
            assert!(e.param.as_deref().is_some_and(|p| p.starts_with("messages[")), "{e:?}");
        }
        Ok(mapped) => {
            for t in TEMPLATES.iter() {
                for thinking in [true, false] {
                    let mut req = RenderRequest::new(&mapped);
                    if !thinking {
                        req.kwargs.insert("enable_thinking".into(), false.into());
                    }
                    match t.render(&req) {
                        Ok(_) | Err(Error::Template { .. }) => {}
                        Err(e) => panic!("{e} on {}", Value::Array(mapped.clone())),
                    }
                }
            }
        }
    }
});
