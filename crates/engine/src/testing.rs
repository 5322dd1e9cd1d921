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
