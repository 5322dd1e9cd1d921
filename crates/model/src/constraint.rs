//! Constrained decoding: a request's [`Grammar`] (a JSON schema, any JSON
//! object, a regular expression or a Lark grammar) compiled by llguidance
//! into a [`Constraint`] that says, before every draw, which tokens may come
//! next, and follows the tokens drawn.
//!
//! A constraint's state is a function of its grammar and the tokens it
//! accepted, nothing else: a decode worker that takes a request over after
//! the prefill worker drew its first token compiles the same grammar,
//! accepts that token, and allows exactly what the prefill worker's would.
//!
//! Grammars are client content (I10): their `Debug` shows only their kind
//! and size, llguidance is built quiet (no log lines, and errors that do not
//! quote the grammar or the tokens), and errors name no part of them.

use std::sync::Arc;

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{self, SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};

use crate::error::ModelError;
use crate::tokenizer::Tokenizer;

/// What a request's output must match.
#[derive(Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Grammar {
    /// Any JSON object (`response_format: json_object`).
    JsonObject,
    /// JSON valid against this schema (`response_format: json_schema`).
    JsonSchema(serde_json::Value),
    /// Text matching this regular expression (extension).
    Regex(String),
    /// Text in this Lark grammar's language (extension).
    Lark(String),
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The kind and a size, never the content (I10).
        match self {
            Grammar::JsonObject => f.write_str("JsonObject"),
            Grammar::JsonSchema(schema) => {
                write!(f, "JsonSchema({} bytes)", schema.to_string().len())
            }
            Grammar::Regex(regex) => write!(f, "Regex({} bytes)", regex.len()),
            Grammar::Lark(lark) => write!(f, "Lark({} bytes)", lark.len()),
        }
    }
}

impl Grammar {
    /// The regular expressions in it: the regex itself, a JSON schema's
    /// `pattern`s and `patternProperties` keys, a Lark grammar's `/…/`
    /// terminals.
    fn regexes(&self) -> Vec<&str> {
        fn walk<'a>(value: &'a serde_json::Value, found: &mut Vec<&'a str>) {
            match value {
                serde_json::Value::Object(fields) => {
                    for (key, value) in fields {
                        match (key.as_str(), value) {
                            ("pattern", serde_json::Value::String(regex)) => found.push(regex),
                            ("patternProperties", serde_json::Value::Object(patterns)) => {
                                found.extend(patterns.keys().map(String::as_str));
                            }
                            _ => {}
                        }
                        walk(value, found);
                    }
                }
                serde_json::Value::Array(items) => {
                    for item in items {
                        walk(item, found);
                    }
                }
                _ => {}
            }
        }
        let mut found = Vec::new();
        match self {
            Grammar::Regex(regex) => found.push(regex.as_str()),
            Grammar::JsonSchema(schema) => walk(schema, &mut found),
            Grammar::Lark(lark) => found.extend(lark_regexes(lark)),
            Grammar::JsonObject => {}
        }
        found
    }

    fn top_level(&self) -> TopLevelGrammar {
        match self {
            Grammar::JsonObject => TopLevelGrammar::from_json_schema(compact_json(
                serde_json::json!({ "type": "object" }),
            )),
            Grammar::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(compact_json(schema.clone()))
            }
            Grammar::Regex(regex) => TopLevelGrammar::from_regex(regex),
            Grammar::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        }
    }
}

/// JSON on one line, `", "` between items and `": "` after keys, unless
/// the schema sets its own layout (llguidance's `x-guidance`). Free
/// whitespace lets a small model pad forever and never close the object;
/// fixed separators make every token count.
fn compact_json(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(object) = schema.as_object_mut()
        && !object.contains_key("x-guidance")
    {
        object.insert(
            "x-guidance".into(),
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            }),
        );
    }
    schema
}

/// Lexer states one constraint may build (llguidance's default is
/// 250,000 at 1–2 kB each: up to half a gigabyte for one request). Large
/// real schemas stay far below it; a grammar that needs more is refused
/// at the front door, whose first mask builds most of them.
pub const MAX_LEXER_STATES: usize = 50_000;

/// Earley items one row of a constraint's parse may hold: as many as one
/// mask may create (llguidance's `step_max_items`).
pub const MAX_ITEMS_IN_ROW: usize = 50_000;

/// The `/…/` regex literals of a Lark grammar, outside its `"…"` strings
/// and `//` comments (a regex is never empty, so `//` starts a comment).
fn lark_regexes(lark: &str) -> Vec<&str> {
    let bytes = lark.as_bytes();
    let mut found = Vec::new();
    let mut at = 0;
    // Past the closing `quote` of a literal that opened before `from`,
    // escapes skipped; `None` if it never closes.
    let close = |quote: u8, mut from: usize| {
        while from < bytes.len() {
            match bytes[from] {
                b'\\' => from += 2,
                b if b == quote => return Some(from + 1),
                _ => from += 1,
            }
        }
        None
    };
    while at < bytes.len() {
        match bytes[at] {
            b'"' => match close(b'"', at + 1) {
                Some(end) => at = end,
                None => break,
            },
            b'/' if bytes.get(at + 1) == Some(&b'/') => {
                at = lark[at..].find('\n').map_or(bytes.len(), |n| at + n);
            }
            b'/' => match close(b'/', at + 1) {
                Some(end) => {
                    found.push(&lark[at + 1..end - 1]);
                    at = end;
                }
                None => break,
            },
            _ => at += 1,
        }
    }
    found
}

/// The refusal of a grammar past the limits, in our words.
fn past_limits() -> ModelError {
    ModelError::Constraint {
        reason: format!(
            "the grammar is past this server's limits (at most {MAX_LEXER_STATES} lexer states \
             and {MAX_ITEMS_IN_ROW} parser items at one point, and a bounded grammar size)"
        ),
    }
}

/// How many positions `regex` has once its counted repetitions are
/// unrolled — `(a{1,20}){1,20}` has 400 — which bounds the lexer states
/// its matching can build, one state per position reached. A regex that
/// parses here but not in llguidance counts nothing (llguidance refuses it
/// itself). Saturates instead of overflowing.
fn regex_positions(regex: &str) -> u64 {
    use regex_syntax::hir::{Hir, HirKind};
    fn positions(hir: &Hir) -> u64 {
        match hir.kind() {
            HirKind::Empty | HirKind::Look(_) => 0,
            HirKind::Literal(literal) => literal.0.len() as u64,
            HirKind::Class(_) => 1,
            HirKind::Repetition(repetition) => {
                // An unbounded repetition loops over one more copy than its
                // minimum.
                let copies = repetition
                    .max
                    .unwrap_or(repetition.min.saturating_add(1))
                    .max(1);
                positions(&repetition.sub).saturating_mul(u64::from(copies))
            }
            HirKind::Capture(capture) => positions(&capture.sub),
            HirKind::Concat(parts) | HirKind::Alternation(parts) => {
                parts.iter().map(positions).fold(0, u64::saturating_add)
            }
        }
    }
    regex_syntax::ParserBuilder::new()
        // Counting is the point: no size limit of the parser's own.
        .nest_limit(1_000)
        .build()
        .parse(regex)
        .map_or(0, |hir| positions(&hir))
}

/// Why llguidance refused a grammar (or, with none, a constraint's step),
/// in words of our own: its messages quote the client's schema keys,
/// types, references and regexes even without verbose errors, and a
/// grammar is client content (I10). Positions are numbers, kept.
fn refusal(grammar: Option<&Grammar>, message: &str) -> ModelError {
    let limits = [
        "max is",
        "limit",
        "too large",
        "fuel",
        "too many",
        "exceeded",
    ];
    if limits.iter().any(|l| message.contains(l)) {
        return past_limits();
    }
    let reason = match grammar {
        None => "the grammar allows no way to go on".to_string(),
        Some(Grammar::Regex(_)) => {
            "the regular expression does not parse, or uses a feature that is not supported (such as look-around or back-references)".to_string()
        }
        Some(Grammar::Lark(_)) => match lark_position(message) {
            Some((line, column)) => {
                format!("the Lark grammar does not parse (line {line}, column {column})")
            }
            None => "the Lark grammar does not parse, or uses a feature that is not supported".to_string(),
        },
        Some(Grammar::JsonSchema(_) | Grammar::JsonObject) => {
            if message.contains("regex") {
                "a pattern in the JSON schema does not parse, or uses a feature that is not supported".to_string()
            } else {
                "the JSON schema uses a type, format, keyword or reference that is not supported, or one that does not resolve".to_string()
            }
        }
    };
    ModelError::Constraint { reason }
}

/// The `LINE(COLUMN)` llguidance's Lark errors begin with.
fn lark_position(message: &str) -> Option<(u32, u32)> {
    let text = message.strip_prefix("at ").unwrap_or(message);
    let (line, rest) = text.split_once('(')?;
    let (column, _) = rest.split_once(')')?;
    Some((line.trim().parse().ok()?, column.trim().parse().ok()?))
}

/// Compiles grammars for one tokenizer: its token trie is built once and
/// shared by every request's constraint.
#[derive(Clone)]
pub struct Grammars {
    factory: Arc<ParserFactory>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars").finish_non_exhaustive()
    }
}

/// The model's tokenizer as llguidance sees it: every token's bytes.
struct TokenBytes {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for TokenBytes {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<toktrie::TokenId> {
        // Lexemes the grammar forces are text, never control tokens (I9).
        match std::str::from_utf8(s) {
            Ok(text) => self
                .tokenizer
                .encode_as_text(text)
                .unwrap_or_else(|_| self.trie.greedy_tokenize(s)),
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

impl Grammars {
    /// Grammars over `tokenizer`'s vocabulary of `vocab_size` ids (the
    /// model's, which may exceed the tokenizer's); `eos` ends a completion.
    pub fn new(tokenizer: &Tokenizer, vocab_size: usize, eos: &[u32]) -> Result<Self, ModelError> {
        let fail = |reason: String| ModelError::Constraint { reason };
        let mut words = tokenizer.token_bytes();
        words.resize(vocab_size.max(words.len()), Vec::new());
        let first_eos = *eos
            .first()
            .ok_or_else(|| fail("the model names no end-of-sequence token".into()))?;
        let info = TokRxInfo::new(words.len() as u32, first_eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
        let env: TokEnv = Arc::new(TokenBytes {
            trie,
            tokenizer: tokenizer.clone(),
        });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| fail(e.to_string()))?;
        factory.quiet();
        *factory.limits_mut() = ParserLimits {
            // Errors that quote neither the grammar nor the tokens (I10).
            verbose_errors: false,
            max_lexer_states: MAX_LEXER_STATES,
            // A row's items grow with an object's properties (a schema of
            // 5,800 optional fields has 22,819 after `{"`); llguidance's
            // 2,000 refused such schemas at their second token, after the
            // prefill. Each mask's work stays bounded by `step_max_items`.
            max_items_in_row: MAX_ITEMS_IN_ROW,
            ..ParserLimits::default()
        };
        Ok(Grammars {
            factory: Arc::new(factory),
        })
    }

    /// A fresh constraint for `grammar`; an error says why the grammar is
    /// not one llguidance accepts (an unsupported schema keyword, a regex
    /// that does not parse, ...).
    pub fn compile(&self, grammar: &Grammar) -> Result<Constraint, ModelError> {
        if grammar
            .regexes()
            .iter()
            .any(|regex| regex_positions(regex) > MAX_LEXER_STATES as u64)
        {
            return Err(past_limits());
        }
        let parser = self
            .factory
            .create_parser(grammar.top_level())
            .map_err(|e| refusal(Some(grammar), &e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(reason) = matcher.get_error() {
            return Err(refusal(Some(grammar), &reason));
        }
        Ok(Constraint {
            matcher,
            mask: None,
        })
    }
}

/// The tokens a constraint allows next.
#[derive(Debug, Clone)]
pub struct TokenMask(SimpleVob);

impl TokenMask {
    /// Whether `token` may come next.
    pub fn allows(&self, token: u32) -> bool {
        self.0.is_allowed(token)
    }
}

/// One request's constraint: which tokens may come next, given the tokens
/// it accepted.
pub struct Constraint {
    matcher: Matcher,
    /// The mask for the next token, computed once per step.
    mask: Option<TokenMask>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("finished", &self.is_finished())
            .finish_non_exhaustive()
    }
}

impl Clone for Constraint {
    fn clone(&self) -> Self {
        Constraint {
            matcher: self.matcher.deep_clone(),
            mask: self.mask.clone(),
        }
    }
}

impl Constraint {
    /// The tokens that may come next. Computed once per step, on first
    /// use; an error means the constraint cannot go on (its grammar's
    /// limits were reached).
    pub fn mask(&mut self) -> Result<&TokenMask, ModelError> {
        if self.mask.is_none() {
            let mask = self
                .matcher
                .compute_mask_or_eos()
                .map_err(|e| refusal(None, &e.to_string()))?;
            self.mask = Some(TokenMask(mask));
        }
        Ok(self.mask.as_ref().expect("computed just above"))
    }

    /// Follows a drawn token. A token the mask did not allow is an error:
    /// the sampler drew outside the grammar.
    pub fn accept(&mut self, token: u32) -> Result<(), ModelError> {
        self.mask = None;
        self.matcher
            .consume_token(token)
            .map_err(|e| refusal(None, &e.to_string()))
    }

    /// Whether the grammar is complete and allows nothing more but the end.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grammars() -> (Tokenizer, Grammars) {
        let tokenizer = Tokenizer::byte_level(260).unwrap();
        let grammars = Grammars::new(&tokenizer, 260, &[256]).unwrap();
        (tokenizer, grammars)
    }

    /// Greedy-free walk: always the lowest allowed token that is not the end.
    fn walk(constraint: &mut Constraint, steps: usize) -> Vec<u32> {
        let mut out = Vec::new();
        for _ in 0..steps {
            if constraint.is_finished() {
                break;
            }
            let mask = constraint.mask().unwrap();
            let token = (0..256u32).find(|&t| mask.allows(t)).unwrap_or(256);
            constraint.accept(token).unwrap();
            if token == 256 {
                break;
            }
            out.push(token);
        }
        out
    }

    #[test]
    fn a_regex_allows_only_what_it_matches() {
        let (tokenizer, grammars) = grammars();
        let mut constraint = grammars
            .compile(&Grammar::Regex("ab[0-9]{3}".into()))
            .unwrap();
        let mask = constraint.mask().unwrap();
        assert!(mask.allows(u32::from(b'a')));
        assert!(!mask.allows(u32::from(b'b')));
        let text = tokenizer.decode(&walk(&mut constraint, 20)).unwrap();
        assert_eq!(text, "ab000");
        assert!(constraint.is_finished());
    }

    #[test]
    fn a_schema_gives_json_that_validates() {
        let (tokenizer, grammars) = grammars();
        let schema = serde_json::json!({
            "type": "object",
            "properties": { "n": { "type": "integer" } },
            "required": ["n"],
            "additionalProperties": false,
        });
        let mut constraint = grammars.compile(&Grammar::JsonSchema(schema)).unwrap();
        let text = tokenizer.decode(&walk(&mut constraint, 40)).unwrap();
        let value: serde_json::Value = serde_json::from_str(&text).unwrap();
        // The walk takes the lowest byte: `-` before any digit, so `-0`.
        assert!(
            value["n"].as_f64().is_some_and(|n| n.fract() == 0.0),
            "{text}"
        );
        assert_eq!(value.as_object().map(|o| o.len()), Some(1), "{text}");
    }

    #[test]
    fn an_object_of_thousands_of_optional_fields_can_be_generated_into() {
        let (tokenizer, grammars) = grammars();
        let properties: serde_json::Map<String, serde_json::Value> = (0..3000)
            .map(|i| {
                (
                    format!("field_{i}"),
                    serde_json::json!({ "type": "integer" }),
                )
            })
            .collect();
        let schema = serde_json::json!({
            "type": "object",
            "properties": properties,
            "additionalProperties": false,
        });
        let mut constraint = grammars.compile(&Grammar::JsonSchema(schema)).unwrap();
        // The lowest byte after `{` opens a key: every field is a choice.
        let text = tokenizer.decode(&walk(&mut constraint, 40)).unwrap();
        assert!(text.starts_with("{\"field_"), "{text}");
    }

    #[test]
    fn a_regex_whose_counts_unroll_past_the_lexer_s_states_is_refused_before_any_work() {
        assert_eq!(regex_positions("[a-z]{3,8}"), 8);
        assert_eq!(regex_positions("(ab|c){1,20}"), 60);
        assert_eq!(regex_positions("((a{1,20}){1,20}){1,20}"), 8_000);
        assert_eq!(regex_positions("x+"), 2);
        let nested = format!("{}[a-z]{{1,30}}{}", "(".repeat(10), "){2,9}".repeat(10));
        assert_eq!(regex_positions(&nested), 30 * 9u64.pow(10));
        let (_, grammars) = grammars();
        // This one compiled and passed its first mask, then failed at a
        // later token, after the whole prefill (a 500).
        for grammar in [
            Grammar::Regex(nested.clone()),
            Grammar::JsonSchema(serde_json::json!({
                "type": "object",
                "properties": { "id": { "type": "string", "pattern": nested } },
            })),
            Grammar::JsonSchema(serde_json::json!({
                "type": "object",
                "patternProperties": { nested.as_str(): { "type": "string" } },
            })),
            Grammar::Lark(format!("start: \"id=\" ID\nID: /{nested}/\n")),
        ] {
            let error = grammars.compile(&grammar).unwrap_err().to_string();
            assert!(error.contains("past this server's limits"), "{error}");
        }
        // Real patterns pass.
        for regex in [
            r"\d{4}-\d{2}-\d{2}",
            "[A-Za-z0-9._%+-]{1,64}@[a-z]{1,63}",
            "(yes|no)",
        ] {
            grammars.compile(&Grammar::Regex(regex.into())).unwrap();
        }
    }

    #[test]
    fn lark_regex_terminals_are_found_outside_strings_and_comments() {
        let lark = "// a comment with /slashes/\nstart: A \"/not/\" B /x{2}/i\nA: /[a-z]\\/+/\nB: \"q\\\"/\"";
        assert_eq!(lark_regexes(lark), ["x{2}", "[a-z]\\/+"]);
    }

    #[test]
    fn a_token_outside_the_grammar_is_refused() {
        let (_, grammars) = grammars();
        let mut constraint = grammars.compile(&Grammar::Regex("[0-9]+".into())).unwrap();
        assert!(constraint.accept(u32::from(b'x')).is_err());
    }

    #[test]
    fn a_bad_grammar_is_an_error_that_quotes_none_of_it() {
        let (_, grammars) = grammars();
        let secret = "secret_keyword_zq";
        let error = grammars
            .compile(&Grammar::JsonSchema(
                serde_json::json!({ "type": secret, "title": secret }),
            ))
            .unwrap_err();
        assert!(matches!(error, ModelError::Constraint { .. }));
        assert!(!error.to_string().contains(secret), "{error}");
        for bad in [
            Grammar::Regex(format!("({secret}")),
            Grammar::Lark(format!("start: {secret} ::= ")),
            Grammar::JsonSchema(serde_json::json!({
                "type": "object",
                "properties": { secret: { "type": secret } },
            })),
            Grammar::JsonSchema(serde_json::json!({ "$ref": format!("#/defs/{secret}") })),
            Grammar::JsonSchema(
                serde_json::json!({ "type": "string", "pattern": format!("({secret}") }),
            ),
            Grammar::JsonSchema(serde_json::json!({ "type": "string", "format": secret })),
        ] {
            let error = grammars.compile(&bad).unwrap_err().to_string();
            assert!(!error.contains(secret), "{error}");
        }
        let lark = grammars
            .compile(&Grammar::Lark(format!("start: {secret} ::= ")))
            .unwrap_err();
        assert!(lark.to_string().contains("line 1, column 27"), "{lark}");
        let debug = format!("{:?}", Grammar::Regex(secret.into()));
        assert!(!debug.contains(secret), "{debug}");
    }
}
