//! [`Redacted`]: request text that logs, metrics and error messages cannot
//! print. Its `Debug` and `Display` show only the length (I10); the text is
//! reachable only through [`Redacted::expose`], at the few places that must
//! hand it to the tokenizer. [`RedactedJson`] is the same for JSON the
//! client sent as content (schemas).

use serde::Deserialize;

/// Client-supplied text (prompts, messages).
#[derive(Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(transparent)]
pub struct Redacted(String);

impl Redacted {
    /// Wraps text.
    pub fn new(text: impl Into<String>) -> Self {
        Redacted(text.into())
    }

    /// The text itself, for tokenization and templating only.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the text is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Debug for Redacted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "<redacted {} bytes>", self.0.len())
    }
}

impl std::fmt::Display for Redacted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self, f)
    }
}

/// Client text named in an answer or a log (a key, a path, a model id):
/// at most 64 bytes of it, cut at a character boundary — never more than a
/// name's worth of what a client or a stranger sent.
pub fn clipped(text: &str) -> &str {
    let mut end = text.len().min(64);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// JSON the client sent as content — a schema — shown by `Debug` only as
/// its size (I10).
#[derive(Clone, PartialEq, Deserialize)]
#[serde(transparent)]
pub struct RedactedJson(pub serde_json::Value);

impl std::fmt::Debug for RedactedJson {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "<redacted JSON {} bytes>", self.0.to_string().len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn i10_debug_and_display_never_show_the_text() {
        let r = Redacted::new("secret prompt");
        assert_eq!(format!("{r:?}"), "<redacted 13 bytes>");
        assert_eq!(format!("{r}"), "<redacted 13 bytes>");
        assert_eq!(r.expose(), "secret prompt");
    }
}
