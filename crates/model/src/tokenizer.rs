//! [`Tokenizer`]: text ⇄ token ids through the `tokenizers` crate, plus the
//! byte-level tokenizer of the built-in models.

use std::path::Path;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer as HfTokenizer};

use crate::error::ModelError;

/// Special tokens of the built-in byte-level tokenizer, ids 256, 257, 258.
pub const BUILTIN_SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// A loaded tokenizer.
#[derive(Clone)]
pub struct Tokenizer {
    inner: HfTokenizer,
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

impl Tokenizer {
    /// Loads a `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Tokenizer, ModelError> {
        let inner = HfTokenizer::from_file(path)
            .map_err(|e| tokenizer_error(format!("{}: {e}", path.display())))?;
        Ok(Tokenizer { inner })
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
        Ok(Tokenizer { inner })
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
