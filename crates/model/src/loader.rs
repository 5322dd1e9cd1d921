//! [`LoadedModel`]: a model with its tokenizer and chat template, from a name
//! (`builtin:tiny`, `builtin:small`), a Hugging Face model directory or a
//! GGUF file.

use std::path::Path;

use crate::builtin::Builtin;
use crate::chat::ChatTemplate;
use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::fetch::{KnownModel, ModelCache};
use crate::forward::Model;
use crate::gguf::GgufFile;
use crate::tensors::TensorMap;
use crate::tokenizer::Tokenizer;

/// Everything needed to serve one model.
#[derive(Debug)]
pub struct LoadedModel {
    /// The name it was loaded by (shown in `/v1/models`).
    pub name: String,
    /// The runnable decoder.
    pub model: Model,
    /// Text ⇄ ids.
    pub tokenizer: Tokenizer,
    /// The chat template, if the model has one.
    pub chat_template: Option<ChatTemplate>,
}

/// What a front door needs of a model — its name, shape, tokenizer and
/// chat template — without its weights: a router applies the template and
/// tokenizes, and never runs a layer.
#[derive(Debug, Clone)]
pub struct TextModel {
    /// The name it was loaded by (shown in `/v1/models`).
    pub name: String,
    /// The model's shape: vocabulary, positions, special tokens.
    pub config: ModelConfig,
    /// Text ⇄ ids.
    pub tokenizer: Tokenizer,
    /// The chat template, if the model has one.
    pub chat_template: Option<ChatTemplate>,
}

impl TextModel {
    /// Loads what [`LoadedModel::load`] would, except the weights: a
    /// built-in model's tensors are never generated, a Hugging Face
    /// directory's safetensors never read, a GGUF file's tensors never
    /// decoded (its bytes are read for the metadata and dropped).
    pub fn load(name: &str) -> Result<TextModel, ModelError> {
        if let Some(builtin) = Builtin::parse(name) {
            return Ok(TextModel {
                name: builtin.name().to_string(),
                config: builtin.config(),
                tokenizer: builtin.tokenizer()?,
                chat_template: Some(builtin.chat_template()?),
            });
        }
        let path = Path::new(name);
        if path.is_dir() {
            let template_path = path.join("tokenizer_config.json");
            return Ok(TextModel {
                name: path.display().to_string(),
                config: ModelConfig::from_hf_file(&path.join("config.json"))?,
                tokenizer: Tokenizer::from_file(&path.join("tokenizer.json"))?,
                chat_template: if template_path.exists() {
                    ChatTemplate::from_tokenizer_config(&template_path)?
                } else {
                    None
                },
            });
        }
        if is_gguf(path) {
            let file = GgufFile::open(path)?;
            return Ok(TextModel {
                name: gguf_name(path),
                config: ModelConfig::from_gguf(&file)?,
                tokenizer: Tokenizer::from_gguf(&file)?,
                chat_template: gguf_chat_template(&file)?,
            });
        }
        Err(not_a_model(name))
    }

    /// Like [`TextModel::load`], and also takes the name of a
    /// [`KnownModel`], fetched into `cache` on first use and checked
    /// against its pinned digest.
    pub fn load_or_fetch(
        name: &str,
        cache: &ModelCache,
        progress: &mut dyn FnMut(&str),
    ) -> Result<TextModel, ModelError> {
        load_known(name, cache, progress, Self::load, |m, known| {
            m.name = known.into()
        })
    }
}

/// Loads `name` with `load`; a [`KnownModel`]'s name is fetched into
/// `cache` first, loaded from the fetched file, and `rename`d after the
/// known model rather than the file.
fn load_known<T>(
    name: &str,
    cache: &ModelCache,
    progress: &mut dyn FnMut(&str),
    load: fn(&str) -> Result<T, ModelError>,
    rename: fn(&mut T, &'static str),
) -> Result<T, ModelError> {
    let Some(known) = KnownModel::find(name) else {
        return load(name);
    };
    let path = cache.fetch(known, progress)?;
    let target = path.to_str().ok_or_else(|| {
        ModelError::io(
            &path,
            std::io::Error::other("the model cache's path is not UTF-8"),
        )
    })?;
    let mut loaded = load(target)?;
    rename(&mut loaded, known.name);
    Ok(loaded)
}

/// Why `name`, neither a builtin, a directory nor a `.gguf` file, loads
/// nothing: a name written as a path (absolute, or from `.`) is a file
/// that is not there or is not a model; anything else is a name this
/// runtime does not know, and the error lists those it does.
fn not_a_model(name: &str) -> ModelError {
    let path = Path::new(name);
    if path.is_absolute() || name.starts_with('.') {
        return match std::fs::metadata(path) {
            Err(e) => ModelError::io(path, e),
            Ok(_) => ModelError::config(
                path,
                "not a model: give a Hugging Face model directory or a .gguf file",
            ),
        };
    }
    ModelError::UnknownModel {
        name: name.to_string(),
    }
}

/// Whether `path` names a GGUF file, by its extension: one that is not
/// there is then an error opening it (naming the path), not an unknown
/// model name.
fn is_gguf(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

fn gguf_name(path: &Path) -> String {
    path.file_stem().map_or_else(
        || path.display().to_string(),
        |s| s.to_string_lossy().into_owned(),
    )
}

/// The chat template in a GGUF file's metadata, with its BOS and EOS
/// token strings.
fn gguf_chat_template(file: &GgufFile) -> Result<Option<ChatTemplate>, ModelError> {
    if file.get("tokenizer.chat_template").is_none() {
        return Ok(None);
    }
    let token_text = |key: &str| -> String {
        file.get(key)
            .and_then(|v| v.as_u64())
            .and_then(|id| {
                file.strings("tokenizer.ggml.tokens")
                    .ok()?
                    .get(id as usize)
                    .map(|t| t.to_string())
            })
            .unwrap_or_default()
    };
    Ok(Some(ChatTemplate::new(
        file.str("tokenizer.chat_template")?,
        &token_text("tokenizer.ggml.bos_token_id"),
        &token_text("tokenizer.ggml.eos_token_id"),
    )?))
}

impl LoadedModel {
    /// Its name, shape, tokenizer and template, for a front door.
    pub fn text(&self) -> TextModel {
        TextModel {
            name: self.name.clone(),
            config: self.model.config().clone(),
            tokenizer: self.tokenizer.clone(),
            chat_template: self.chat_template.clone(),
        }
    }

    /// Loads `name`: a built-in model or a Hugging Face directory.
    pub fn load(name: &str) -> Result<LoadedModel, ModelError> {
        if let Some(builtin) = Builtin::parse(name) {
            return Ok(LoadedModel {
                name: builtin.name().to_string(),
                model: Model::from_tensors(builtin.config(), &builtin.tensors())?,
                tokenizer: builtin.tokenizer()?,
                chat_template: Some(builtin.chat_template()?),
            });
        }
        let path = Path::new(name);
        if path.is_dir() {
            return Self::load_hf_dir(path);
        }
        if is_gguf(path) {
            return Self::load_gguf(path);
        }
        Err(not_a_model(name))
    }

    /// Like [`LoadedModel::load`], and also takes the name of a
    /// [`KnownModel`] (`smollm2`): fetched into `cache` on first use, with
    /// `progress` told what happens, and checked against its pinned digest.
    pub fn load_or_fetch(
        name: &str,
        cache: &ModelCache,
        progress: &mut dyn FnMut(&str),
    ) -> Result<LoadedModel, ModelError> {
        load_known(name, cache, progress, Self::load, |m, known| {
            m.name = known.into()
        })
    }

    /// Loads a llama-architecture GGUF file: weights stay quantized, the
    /// tokenizer and chat template come from its metadata.
    pub fn load_gguf(path: &Path) -> Result<LoadedModel, ModelError> {
        let file = GgufFile::open(path)?;
        let config = ModelConfig::from_gguf(&file)?;
        let tokenizer = Tokenizer::from_gguf(&file)?;
        let chat_template = gguf_chat_template(&file)?;
        let model = Model::from_gguf(config, &file)?;
        Ok(LoadedModel {
            name: gguf_name(path),
            model,
            tokenizer,
            chat_template,
        })
    }

    /// Loads a Hugging Face model directory.
    pub fn load_hf_dir(dir: &Path) -> Result<LoadedModel, ModelError> {
        let config = ModelConfig::from_hf_file(&dir.join("config.json"))?;
        let tensors = TensorMap::load_dir(dir)?;
        let model = Model::from_tensors(config, &tensors)?;
        let tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json"))?;
        let template_path = dir.join("tokenizer_config.json");
        let chat_template = if template_path.exists() {
            ChatTemplate::from_tokenizer_config(&template_path)?
        } else {
            None
        };
        Ok(LoadedModel {
            name: dir.display().to_string(),
            model,
            tokenizer,
            chat_template,
        })
    }
}
