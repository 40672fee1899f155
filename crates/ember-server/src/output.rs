//! Token ids -> what the client sees: streaming detokenizer (partial UTF-8 held back), stop
//! strings (text that could still become a stop string held back; the stop string itself never
//! emitted), then, for chat, the output parser (reasoning, content, tool calls).
//!
//! Streaming and non-streaming responses run the same pipeline, so the deltas of a stream
//! concatenate to the non-streamed response.

use ember_chat::{OutputParser, ParseEvent, ParserOptions};
use ember_tokenizer::{StreamDecoder, Tokenizer};

/// Holds back text that could be the start of a stop string.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher { stops, held: String::new() }
    }

    /// Adds text; returns what is safe to emit and whether a stop string was found (then
    /// everything from it on is dropped and the matcher must not be fed again).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        if self.stops.is_empty() {
            return (text.to_string(), false);
        }
        self.held.push_str(text);
        // The earliest stop string occurrence wins.
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        // Keep the longest suffix that is a proper prefix of some stop string.
        let keep = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.held.len());
        let out = self.held[..keep].to_string();
        self.held.drain(..keep);
        (out, false)
    }

    /// End of output: what was held back was not a stop string after all.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// The text side of one response.
pub struct TextPipeline {
    decoder: StreamDecoder,
    stop: StopMatcher,
    /// `None` for `/v1/completions`: all text is content.
    parser: Option<OutputParser>,
    stopped: bool,
}

impl TextPipeline {
    pub fn new(stops: Vec<String>, parser: Option<ParserOptions>) -> Self {
        TextPipeline {
            decoder: StreamDecoder::new(false),
            stop: StopMatcher::new(stops),
            parser: parser.map(OutputParser::new),
            stopped: false,
        }
    }

    /// A stop string was found; the caller ends the request.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    pub fn n_tool_calls(&self) -> usize {
        self.parser.as_ref().map_or(0, OutputParser::n_tool_calls)
    }

    /// One generated token. After a stop string was found, tokens are ignored.
    pub fn push_token(&mut self, tok: &Tokenizer, id: u32) -> Vec<ParseEvent> {
        if self.stopped {
            return Vec::new();
        }
        let text = self.decoder.push(tok, id);
        self.push_text(&text)
    }

    fn push_text(&mut self, text: &str) -> Vec<ParseEvent> {
        let (safe, hit) = self.stop.push(text);
        let mut out = self.parse(&safe);
        if hit {
            self.stopped = true;
            out.extend(self.finish_parser());
        }
        out
    }

    fn parse(&mut self, text: &str) -> Vec<ParseEvent> {
        if text.is_empty() {
            return Vec::new();
        }
        match &mut self.parser {
            Some(p) => p.push(text),
            None => vec![ParseEvent::Content(text.to_string())],
        }
    }

    fn finish_parser(&mut self) -> Vec<ParseEvent> {
        self.parser.as_mut().map(OutputParser::finish).unwrap_or_default()
    }

    /// End of generation: flushes everything held back.
    pub fn finish(&mut self) -> Vec<ParseEvent> {
        if self.stopped {
            return Vec::new();
        }
        let rest = self.decoder.finish();
        let mut out = self.push_text(&rest);
        if self.stopped {
            return out;
        }
        let held = self.stop.finish();
        out.extend(self.parse(&held));
        out.extend(self.finish_parser());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], chunks: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for c in chunks {
            let (s, hit) = m.push(c);
            out.push_str(&s);
            if hit {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stop_split_across_chunks_is_never_emitted() {
        assert_eq!(run(&["END"], &["abc E", "N", "D tail"]), ("abc ".into(), true));
        assert_eq!(run(&["END"], &["abc E", "N", "x"]), ("abc ENx".into(), false));
        assert_eq!(run(&["END"], &["abc EN"]), ("abc EN".into(), false));
        // The earliest of several stop strings wins.
        assert_eq!(run(&["yz", "b"], &["xyzab"]), ("x".into(), true));
        assert_eq!(run(&["ü!"], &["aü", "!"]), ("a".into(), true));
    }

    #[test]
    fn held_back_text_is_released_as_soon_as_it_cannot_match() {
        let mut m = StopMatcher::new(vec!["STOP".into()]);
        assert_eq!(m.push("aS"), ("a".into(), false));
        assert_eq!(m.push("T"), ("".into(), false));
        assert_eq!(m.push("x"), ("STx".into(), false));
    }
}
