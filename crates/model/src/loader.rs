//! [`LoadedModel`]: a model with its tokenizer and chat template, from a name
//! (`builtin:tiny`, `builtin:small`) or a Hugging Face model directory.

use std::path::Path;

use crate::builtin::Builtin;
use crate::chat::ChatTemplate;
use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::forward::Model;
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

impl LoadedModel {
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
        let dir = Path::new(name);
        if dir.is_dir() {
            return Self::load_hf_dir(dir);
        }
        Err(ModelError::UnknownModel {
            name: name.to_string(),
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
