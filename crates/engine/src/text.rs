//! [`TextStream`]: turns generated token ids into text deltas that are safe
//! to stream — whole characters only, and nothing that might be the start of
//! a stop string until it is known not to be.

use kvfence_model::{ModelError, StopMatcher, StopStrings, Tokenizer};

/// Incremental detokenizer with stop-string handling for one request.
#[derive(Debug)]
pub struct TextStream {
    ids: Vec<u32>,
    /// Ids before `prefix` are fully rendered and never re-decoded.
    prefix: usize,
    /// Ids before `read` have been rendered into `text`.
    read: usize,
    text: String,
    emitted: usize,
    /// Matched incrementally: each new byte costs the same however long the
    /// stops and the completion are.
    stops: StopMatcher,
}

/// Result of pushing one token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pushed {
    /// Text that may be sent to the client now.
    pub delta: String,
    /// A stop string was found: the completion ends here.
    pub stopped: bool,
}

impl TextStream {
    /// A stream ending at any of `stops`.
    pub fn new(stops: StopStrings) -> Self {
        TextStream {
            ids: Vec::new(),
            prefix: 0,
            read: 0,
            text: String::new(),
            emitted: 0,
            stops: stops.matcher(),
        }
    }

    /// Adds one generated token.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<Pushed, ModelError> {
        self.ids.push(id);
        // Decoding a short window that starts a few tokens back renders
        // multi-token characters and word-boundary spaces correctly without
        // re-decoding the whole completion each step.
        let before = tokenizer.decode(&self.ids[self.prefix..self.read])?;
        let after = tokenizer.decode(&self.ids[self.prefix..])?;
        let mut found = None;
        if after.len() > before.len()
            && !after.ends_with('\u{FFFD}')
            && after.is_char_boundary(before.len())
        {
            let appended = &after[before.len()..];
            found = self.stops.push(appended);
            self.text.push_str(appended);
            self.prefix = self.read;
            self.read = self.ids.len();
        }
        if let Some(cut) = found {
            let delta = self
                .text
                .get(self.emitted..cut)
                .unwrap_or_default()
                .to_string();
            self.emitted = self.emitted.max(cut);
            self.text.truncate(cut);
            return Ok(Pushed {
                delta,
                stopped: true,
            });
        }
        let safe = self.text.len() - self.stops.holdback();
        let delta = self.text[self.emitted.min(safe)..safe].to_string();
        self.emitted = self.emitted.max(safe);
        Ok(Pushed {
            delta,
            stopped: false,
        })
    }

    /// Text still held back, released when the completion ends for another
    /// reason than a stop string: held-back stop prefixes and tokens that
    /// never completed a character (rendered as U+FFFD, as the tokenizer does).
    pub fn flush(&mut self, tokenizer: &Tokenizer) -> Result<String, ModelError> {
        if self.read < self.ids.len() {
            let before = tokenizer.decode(&self.ids[self.prefix..self.read])?;
            let after = tokenizer.decode(&self.ids[self.prefix..])?;
            if let Some(tail) = after.get(before.len()..) {
                self.text.push_str(tail);
            }
            self.prefix = self.read;
            self.read = self.ids.len();
        }
        let rest = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        Ok(rest)
    }

    /// The whole completion text so far (after any stop cut).
    pub fn text(&self) -> &str {
        &self.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(text: &str, stops: &[&str]) -> (Vec<String>, bool, String) {
        let stops = StopStrings::new(stops.iter().map(|s| s.to_string()).collect()).unwrap();
        run_with(text, stops)
    }

    fn run_with(text: &str, stops: StopStrings) -> (Vec<String>, bool, String) {
        let tok = Tokenizer::byte_level(288).unwrap();
        let mut stream = TextStream::new(stops);
        let mut deltas = Vec::new();
        let mut stopped = false;
        for id in tok.encode(text).unwrap() {
            let p = stream.push(&tok, id).unwrap();
            deltas.push(p.delta);
            if p.stopped {
                stopped = true;
                break;
            }
        }
        if !stopped {
            deltas.push(stream.flush(&tok).unwrap());
        }
        (deltas, stopped, stream.text().to_string())
    }

    #[test]
    fn multibyte_characters_are_only_sent_whole() {
        let (deltas, _, text) = run("añ✓", &[]);
        assert_eq!(deltas.concat(), "añ✓");
        assert!(deltas.iter().all(|d| !d.contains('\u{FFFD}')));
        assert_eq!(text, "añ✓");
    }

    #[test]
    fn an_unfinished_character_at_the_end_is_not_lost() {
        let tok = Tokenizer::byte_level(288).unwrap();
        let mut stream = TextStream::new(StopStrings::default());
        let mut out = String::new();
        for id in [b'a' as u32, 0xE2, 0x9C] {
            out.push_str(&stream.push(&tok, id).unwrap().delta);
        }
        assert_eq!(out, "a");
        out.push_str(&stream.flush(&tok).unwrap());
        assert_eq!(out, "a\u{FFFD}");
    }

    #[test]
    fn a_stop_string_ends_the_text_before_it_and_is_never_streamed() {
        let (deltas, stopped, text) = run("hello END world", &["END"]);
        assert!(stopped);
        assert_eq!(deltas.concat(), "hello ");
        assert_eq!(text, "hello ");
        assert!(deltas.iter().all(|d| !d.contains('E')), "{deltas:?}");
    }

    #[test]
    fn a_kept_stop_ends_the_text_after_it_and_streams_as_it_comes() {
        let stops = StopStrings::new(vec!["END".into()])
            .unwrap()
            .keeping(vec!["</call>".into()])
            .unwrap();
        let (deltas, stopped, text) = run_with("go <call>{}</call> <call>{}</call>", stops);
        assert!(stopped);
        assert_eq!(text, "go <call>{}</call>");
        assert_eq!(deltas.concat(), text);
        // Not held back: each byte of it went out as it came.
        assert_eq!(deltas.last().map(String::as_str), Some(">"), "{deltas:?}");
    }

    #[test]
    fn a_partial_stop_match_is_released_when_it_turns_out_not_to_stop() {
        let (deltas, stopped, _) = run("an ENd", &["END"]);
        assert!(!stopped);
        assert_eq!(deltas.concat(), "an ENd");
    }
}
