//! [`Tokenizer`]: text ⇄ token ids through the `tokenizers` crate, plus the
//! byte-level tokenizer of the built-in models.
//!
//! GGUF files carry two kinds: byte-level BPE (`tokenizer.ggml.model =
//! gpt2`: vocabulary, merges, a pre-tokenizer regex) and SentencePiece
//! (`llama`: vocabulary with scores, byte-fallback tokens, spaces as `▁`).
//! llama.cpp tokenizes the second by merging, again and again, the
//! adjacent pair whose merged piece scores highest (leftmost on a tie),
//! then spelling out in byte tokens any piece the vocabulary lacks. Here it
//! is the `tokenizers` BPE with byte fallback and merges derived from those
//! scores: every split of a piece into two pieces is a merge, ranked by the
//! merged piece's score — the construction Hugging Face's own converter
//! uses for such models. Token ids are checked against llama.cpp's
//! (`tests/gemma3.rs`).

use std::path::Path;

use tokenizers::decoders::DecoderWrapper;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::{NormalizerWrapper, Prepend, Replace};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer as HfTokenizer};

use crate::error::ModelError;
use crate::gguf::{GgufFile, Value};

/// llama.cpp's pre-tokenizer regex for Llama 3 style vocabularies
/// (`tokenizer.ggml.pre = llama-bpe`): digits in runs of up to three.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The same for Qwen 2 (`qwen2`): every digit alone.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// GGUF token types: normal pieces (1), control tokens (3), and
/// user-defined strings matched whole before anything else (4).
const GGUF_NORMAL: i64 = 1;
const GGUF_CONTROL: i64 = 3;
const GGUF_USER_DEFINED: i64 = 4;
/// SentencePiece's stand-in for a space.
const SPM_SPACE: char = '\u{2581}';

/// How a tokenizer's pieces spell text, which decides their bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pieces {
    /// GPT-2's byte-to-character map.
    ByteLevel,
    /// SentencePiece: `▁` for a space, `<0xNN>` for a byte.
    SentencePiece,
}

/// Special tokens of the built-in byte-level tokenizer, ids 256, 257, 258.
pub const BUILTIN_SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// Words a BPE tokenizer remembers the merges of. The library's default
/// (10,000) keyed by request text made a server's memory grow with every
/// distinct prompt (measured: ≈ 560 bytes a request, linear over 27,000
/// requests); the merges of a word are quick to recompute.
const WORD_CACHE: usize = 0;

fn bound_word_cache(tokenizer: &mut HfTokenizer) {
    if let tokenizers::ModelWrapper::BPE(bpe) = tokenizer.get_model() {
        let mut bpe = bpe.clone();
        bpe.resize_cache(WORD_CACHE);
        tokenizer.with_model(bpe);
    }
}

/// A loaded tokenizer.
#[derive(Clone)]
pub struct Tokenizer {
    inner: HfTokenizer,
    pieces: Pieces,
    /// The same tokenizer with special-token matching off: special-token
    /// strings in the text stay characters (I9: user text never becomes a
    /// control token).
    as_text: HfTokenizer,
}

fn tokenizer_error(e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer {
        reason: e.to_string(),
    }
}

/// GPT-2's reversible byte → printable character map: printable Latin-1
/// bytes map to themselves, the rest to code points from 256 up, so every
/// byte is one visible character and byte-level BPE can name it.
fn byte_char(byte: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(byte) {
        return char::from(byte);
    }
    let rank = (0..byte).filter(|&b| !printable(b)).count() as u32;
    char::from_u32(256 + rank).expect("256..=324 are valid code points")
}

/// Registers a GGUF vocabulary's control tokens as special and its
/// user-defined ones as added text tokens, both matched whole before the
/// model splits the rest; `normalized` overrides whether they are matched
/// after the normalizer (the library's default otherwise).
fn add_gguf_tokens(
    inner: &mut HfTokenizer,
    tokens: &[&str],
    types: &[i64],
    normalized: Option<bool>,
) {
    let added = |wanted: i64| -> Vec<AddedToken> {
        tokens
            .iter()
            .zip(types)
            .filter(|&(_, &t)| t == wanted)
            .map(|(token, _)| {
                let token = AddedToken::from(token.to_string(), wanted == GGUF_CONTROL);
                match normalized {
                    Some(normalized) => token.normalized(normalized),
                    None => token,
                }
            })
            .collect()
    };
    inner.add_special_tokens(&added(GGUF_CONTROL));
    inner.add_tokens(&added(GGUF_USER_DEFINED));
}

/// A SentencePiece piece's bytes: `<0xNN>` is that byte, `▁` a space.
fn sentencepiece_bytes(piece: &str) -> Vec<u8> {
    let byte = piece
        .strip_prefix("<0x")
        .and_then(|rest| rest.strip_suffix('>'))
        .filter(|hex| hex.len() == 2)
        .and_then(|hex| u8::from_str_radix(hex, 16).ok());
    match byte {
        Some(byte) => vec![byte],
        None => piece.replace(SPM_SPACE, " ").into_bytes(),
    }
}

impl Tokenizer {
    /// Loads a `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Tokenizer, ModelError> {
        let inner = HfTokenizer::from_file(path)
            .map_err(|e| tokenizer_error(format!("{}: {e}", path.display())))?;
        let pieces = match inner.get_decoder() {
            Some(DecoderWrapper::ByteLevel(_)) | None => Pieces::ByteLevel,
            Some(_) => Pieces::SentencePiece,
        };
        Ok(Tokenizer::wrap(inner, pieces))
    }

    /// The built-in byte-level tokenizer: ids 0..=255 are bytes, then the
    /// [`BUILTIN_SPECIALS`], then reserved specials up to `vocab_size`.
    pub fn byte_level(vocab_size: usize) -> Result<Tokenizer, ModelError> {
        let vocab: Vocab = (0..=255u8)
            .map(|b| (byte_char(b).to_string(), u32::from(b)))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, Vec::new())
            .build()
            .map_err(tokenizer_error)?;
        let mut inner = HfTokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(ByteLevel::new(false, false, false)));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        let reserved = vocab_size.saturating_sub(256 + BUILTIN_SPECIALS.len());
        let specials: Vec<AddedToken> = BUILTIN_SPECIALS
            .iter()
            .map(|s| s.to_string())
            .chain((0..reserved).map(|i| format!("<|reserved_{i}|>")))
            .map(|s| AddedToken::from(s, true))
            .collect();
        inner.add_special_tokens(&specials);
        Ok(Tokenizer::wrap(inner, Pieces::ByteLevel))
    }

    /// The tokenizer described by a GGUF file's `tokenizer.ggml.*`
    /// metadata: byte-level BPE (`model = gpt2`: vocabulary, merges, token
    /// types and the pre-tokenizer named by `tokenizer.ggml.pre`) or
    /// SentencePiece (`model = llama`: vocabulary, scores, token types).
    pub fn from_gguf(file: &GgufFile) -> Result<Tokenizer, ModelError> {
        let fail = |reason: String| ModelError::Tokenizer {
            reason: format!("{}: {reason}", file.path().display()),
        };
        let model = file.str("tokenizer.ggml.model")?;
        let tokens = file.strings("tokenizer.ggml.tokens")?;
        let types = match file.get("tokenizer.ggml.token_type") {
            Some(_) => file.integers("tokenizer.ggml.token_type")?,
            None => vec![GGUF_NORMAL; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(fail(format!(
                "{} token types for {} tokens",
                types.len(),
                tokens.len()
            )));
        }
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(id, t)| (t.to_string(), id as u32))
            .collect();
        if vocab.len() != tokens.len() {
            return Err(fail("the vocabulary repeats a token".into()));
        }
        match model {
            "gpt2" => Self::byte_level_bpe(file, vocab, &tokens, &types, &fail),
            "llama" => Self::sentencepiece(file, vocab, &tokens, &types, &fail),
            _ => Err(fail(format!(
                "tokenizer model {model:?} is not supported (byte-level BPE, \"gpt2\", and \
                 SentencePiece, \"llama\", are)"
            ))),
        }
    }

    /// A SentencePiece vocabulary as llama.cpp tokenizes it (see the
    /// module's docs): merges derived from the scores, byte fallback,
    /// spaces as `▁`, a leading one when `add_space_prefix` says so.
    fn sentencepiece(
        file: &GgufFile,
        vocab: Vocab,
        tokens: &[&str],
        types: &[i64],
        fail: &dyn Fn(String) -> ModelError,
    ) -> Result<Tokenizer, ModelError> {
        let scores = file.floats("tokenizer.ggml.scores")?;
        if scores.len() != tokens.len() {
            return Err(fail(format!(
                "{} scores for {} tokens",
                scores.len(),
                tokens.len()
            )));
        }
        // Every split of a normal piece into two pieces of the vocabulary.
        // Control, user-defined and byte pieces are never merged into:
        // user text must not become one by merging (I9).
        let mut candidates: Vec<(f32, u32, usize)> = Vec::new();
        for (id, piece) in tokens.iter().enumerate() {
            if types[id] != GGUF_NORMAL {
                continue;
            }
            for (at, _) in piece.char_indices().skip(1) {
                if vocab.contains_key(&piece[..at]) && vocab.contains_key(&piece[at..]) {
                    candidates.push((scores[id], id as u32, at));
                }
            }
        }
        // Highest score first; splits of one piece in text order.
        candidates.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        let merges: Vec<(String, String)> = candidates
            .into_iter()
            .map(|(_, id, at)| {
                let piece = tokens[id as usize];
                (piece[..at].to_string(), piece[at..].to_string())
            })
            .collect();
        let unknown = file
            .get("tokenizer.ggml.unknown_token_id")
            .and_then(|v| v.as_u64())
            .and_then(|id| tokens.get(id as usize));
        let mut bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .byte_fallback(true);
        if let Some(unknown) = unknown {
            bpe = bpe.unk_token(unknown.to_string());
        }
        let bpe = bpe.build().map_err(|e| fail(e.to_string()))?;
        let space_prefix = matches!(
            file.get("tokenizer.ggml.add_space_prefix"),
            Some(Value::Bool(true))
        );
        let spaces = Replace::new(" ", SPM_SPACE.to_string()).map_err(|e| fail(e.to_string()))?;
        let unspaces = DecoderWrapper::Replace(
            Replace::new(SPM_SPACE.to_string(), " ").map_err(|e| fail(e.to_string()))?,
        );
        let mut normalizers = Vec::new();
        let mut decoders = vec![
            unspaces,
            DecoderWrapper::ByteFallback(ByteFallback::new()),
            DecoderWrapper::Fuse(Fuse::new()),
        ];
        if space_prefix {
            normalizers.push(NormalizerWrapper::Prepend(Prepend::new(
                SPM_SPACE.to_string(),
            )));
            decoders.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
        }
        normalizers.push(NormalizerWrapper::Replace(spaces));
        let mut inner = HfTokenizer::new(bpe);
        inner.with_normalizer(Some(tokenizers::normalizers::Sequence::new(normalizers)));
        inner.with_decoder(Some(DecoderSequence::new(decoders)));
        // Matched in the text as written, before spaces become `▁`.
        add_gguf_tokens(&mut inner, tokens, types, Some(false));
        Ok(Tokenizer::wrap(inner, Pieces::SentencePiece))
    }

    /// Byte-level BPE from a GGUF file's merges and pre-tokenizer name.
    fn byte_level_bpe(
        file: &GgufFile,
        vocab: Vocab,
        tokens: &[&str],
        types: &[i64],
        fail: &dyn Fn(String) -> ModelError,
    ) -> Result<Tokenizer, ModelError> {
        let merges = file
            .strings("tokenizer.ggml.merges")?
            .into_iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| fail(format!("merge {m:?} is not two tokens")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| fail(e.to_string()))?;
        let pre = match file.get("tokenizer.ggml.pre") {
            Some(_) => file.str("tokenizer.ggml.pre")?,
            None => "default",
        };
        let byte_level =
            |use_regex| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, use_regex));
        let split = |pattern: &str| -> Result<PreTokenizerWrapper, ModelError> {
            Split::new(
                SplitPattern::Regex(pattern.to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map(PreTokenizerWrapper::Split)
            .map_err(|e| fail(e.to_string()))
        };
        let steps = match pre {
            "default" | "gpt2" => vec![byte_level(true)],
            "smollm" => vec![
                PreTokenizerWrapper::Digits(Digits::new(true)),
                byte_level(true),
            ],
            "llama-bpe" | "llama3" => vec![split(LLAMA3_SPLIT)?, byte_level(false)],
            "qwen2" => vec![split(QWEN2_SPLIT)?, byte_level(false)],
            other => {
                return Err(fail(format!(
                    "pre-tokenizer {other:?} is not supported (gpt2, smollm, llama-bpe and qwen2 are)"
                )));
            }
        };
        let mut inner = HfTokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(Sequence::new(steps)));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        add_gguf_tokens(&mut inner, tokens, types, None);
        Ok(Tokenizer::wrap(inner, Pieces::ByteLevel))
    }

    fn wrap(mut inner: HfTokenizer, pieces: Pieces) -> Tokenizer {
        bound_word_cache(&mut inner);
        let mut as_text = inner.clone();
        as_text.set_encode_special_tokens(true);
        Tokenizer {
            inner,
            pieces,
            as_text,
        }
    }

    /// Token ids for text in which every character is a character:
    /// special-token strings (`<|im_start|>`, ...) in it are encoded as the
    /// text they are, never as control tokens. What message content goes
    /// through (I9).
    pub fn encode_as_text(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        let encoding = self.as_text.encode(text, false).map_err(tokenizer_error)?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Every special (control) token: its text and id, by id.
    pub fn special_tokens(&self) -> Vec<(String, u32)> {
        let mut specials: Vec<(String, u32)> = self
            .inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, token)| token.special)
            .map(|(id, token)| (token.content, id))
            .collect();
        specials.sort_unstable_by_key(|(_, id)| *id);
        specials
    }

    /// Token ids for `text`; special-token strings in `text` become their ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        let encoding = self.inner.encode(text, false).map_err(tokenizer_error)?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text for `ids`, special tokens left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String, ModelError> {
        self.inner.decode(ids, true).map_err(tokenizer_error)
    }

    /// The id of a token string, if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of an id, if the vocabulary has it.
    pub fn token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Every token's bytes, by id, as constrained decoding needs them.
    /// Special tokens are marked with a leading `0xFF` (a byte no UTF-8
    /// text holds), so no grammar over text can produce one; byte-level
    /// BPE tokens are mapped back through GPT-2's byte table, SentencePiece
    /// ones by `▁` → space and `<0xNN>` → that byte; anything else is
    /// decoded on its own.
    pub fn token_bytes(&self) -> Vec<Vec<u8>> {
        let unmap: std::collections::HashMap<char, u8> =
            (0..=255u8).map(|b| (byte_char(b), b)).collect();
        let specials: std::collections::HashMap<u32, String> = self
            .special_tokens()
            .into_iter()
            .map(|(t, id)| (id, t))
            .collect();
        (0..self.vocab_size() as u32)
            .map(|id| {
                if let Some(special) = specials.get(&id) {
                    return [&[0xFF], special.as_bytes()].concat();
                }
                let Some(piece) = self.inner.id_to_token(id) else {
                    return Vec::new();
                };
                let spelled = match self.pieces {
                    Pieces::ByteLevel => piece.chars().map(|c| unmap.get(&c).copied()).collect(),
                    Pieces::SentencePiece => Some(sentencepiece_bytes(&piece)),
                };
                spelled.unwrap_or_else(|| {
                    self.inner
                        .decode(&[id], false)
                        .map(String::into_bytes)
                        .unwrap_or_default()
                })
            })
            .collect()
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Writes `tokenizer.json`.
    pub fn save(&self, path: &Path) -> Result<(), ModelError> {
        self.inner.save(path, true).map_err(tokenizer_error)
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_round_trips_any_text_and_knows_its_specials() {
        let t = Tokenizer::byte_level(264).unwrap();
        assert_eq!(t.vocab_size(), 264);
        let text = "héllo, wörld — ✓ \n\t 日本";
        let ids = t.encode(text).unwrap();
        assert_eq!(ids.len(), text.len(), "one token per byte");
        assert_eq!(t.decode(&ids).unwrap(), text);
        let ids = t.encode("<|im_start|>user").unwrap();
        assert_eq!(ids[0], 257);
        assert_eq!(t.token_id("<|im_end|>"), Some(258));
        assert_eq!(
            t.decode(&ids).unwrap(),
            "user",
            "specials are skipped on decode"
        );
    }

    #[test]
    fn byte_map_is_a_bijection_onto_distinct_chars() {
        let chars: std::collections::HashSet<char> = (0..=255u8).map(byte_char).collect();
        assert_eq!(chars.len(), 256);
    }
}
