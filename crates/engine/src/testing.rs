//! What the crate's own tests share: the model they run, loaded once per
//! test process.

use std::sync::{Arc, OnceLock};

use kvfence_model::LoadedModel;

/// `builtin:tiny`, loaded once and shared by every test of the process.
pub(crate) fn tiny_model() -> Arc<LoadedModel> {
    static MODEL: OnceLock<Arc<LoadedModel>> = OnceLock::new();
    Arc::clone(MODEL.get_or_init(|| {
        Arc::new(LoadedModel::load("builtin:tiny").expect("the built-in model always loads"))
    }))
}

/// `builtin:tiny` reshaped as Gemma 3: every other layer attends through a
/// window of 40 positions. Loaded once per test process.
pub(crate) fn windowed_model() -> Arc<LoadedModel> {
    static MODEL: OnceLock<Arc<LoadedModel>> = OnceLock::new();
    Arc::clone(MODEL.get_or_init(|| {
        let tiny = tiny_model();
        let mut config = tiny.model.config().clone();
        config.architecture = kvfence_model::Architecture::Gemma3;
        config.tie_word_embeddings = true;
        config.sliding_window = Some(kvfence_model::SlidingWindow {
            window: 40,
            period: 2,
            local_rope_theta: 1_000.0,
        });
        let tensors = kvfence_model::builtin::weights_for(&config, 23);
        Arc::new(LoadedModel {
            name: "windowed-tiny".into(),
            model: kvfence_model::Model::from_tensors(config, &tensors)
                .expect("tiny weights fit their own config"),
            tokenizer: tiny.tokenizer.clone(),
            chat_template: tiny.chat_template.clone(),
        })
    }))
}
