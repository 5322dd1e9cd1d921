//! Loading Hugging Face directories written by the tests themselves:
//! round trips, shards, half-precision weights, and errors that name the
//! file and the tensor.

#![allow(clippy::unwrap_used)]

use std::path::Path;

use kvfence_model::{Builtin, ChatMessage, DiskDtype, LoadedModel, ModelError, Tensor, TensorMap};

fn export(shards: usize, dtype: DiskDtype) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    Builtin::Tiny.export(dir.path(), shards, dtype).unwrap();
    dir
}

fn load(dir: &Path) -> Result<LoadedModel, ModelError> {
    LoadedModel::load(dir.to_str().unwrap())
}

#[test]
fn export_then_load_round_trips_weights_config_tokenizer_and_template() {
    let dir = export(1, DiskDtype::F32);
    assert!(dir.path().join("model.safetensors").exists());
    let loaded = load(dir.path()).unwrap();
    assert_eq!(loaded.model.config(), &Builtin::Tiny.config());
    let original = Builtin::Tiny.tensors();
    let reloaded = TensorMap::load_dir(dir.path()).unwrap();
    assert_eq!(reloaded.len(), original.len());
    for name in original.names() {
        assert_eq!(reloaded.tensor(name), original.tensor(name), "{name}");
    }
    let builtin_tok = Builtin::Tiny.tokenizer().unwrap();
    let text = "Hello <|im_start|> wörld";
    assert_eq!(
        loaded.tokenizer.encode(text).unwrap(),
        builtin_tok.encode(text).unwrap()
    );
    let messages = [ChatMessage {
        role: "user".into(),
        content: "hi".into(),
    }];
    let template = loaded.chat_template.as_ref().unwrap();
    assert_eq!(
        template.render(&messages, true).unwrap(),
        Builtin::Tiny
            .chat_template()
            .unwrap()
            .render(&messages, true)
            .unwrap()
    );
}

#[test]
fn sharded_safetensors_with_an_index_load() {
    let dir = export(3, DiskDtype::F32);
    assert!(dir.path().join("model.safetensors.index.json").exists());
    assert!(dir.path().join("model-00003-of-00003.safetensors").exists());
    assert!(!dir.path().join("model.safetensors").exists());
    let loaded = load(dir.path()).unwrap();
    assert_eq!(loaded.model.config().num_layers, 4);
}

#[test]
fn half_precision_weights_load_as_f32() {
    for dtype in [DiskDtype::F16, DiskDtype::BF16] {
        let dir = export(1, dtype);
        let reloaded = TensorMap::load_dir(dir.path()).unwrap();
        let name = "model.layers.0.mlp.up_proj.weight";
        let original = Builtin::Tiny.tensors();
        let (a, b) = (
            &reloaded.tensor(name).unwrap().data,
            &original.tensor(name).unwrap().data,
        );
        let worst = a
            .iter()
            .zip(b.iter())
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max);
        assert!(
            worst > 0.0 && worst < 5e-3,
            "{dtype:?}: rounding error {worst}"
        );
        load(dir.path()).unwrap();
    }
}

fn rewrite_tensors(dir: &Path, edit: impl FnOnce(&mut TensorMap)) {
    let mut map = TensorMap::load_dir(dir).unwrap();
    edit(&mut map);
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    map.save_dir(dir, 1, DiskDtype::F32).unwrap();
}

#[test]
fn a_missing_tensor_is_named_with_its_file() {
    let dir = export(1, DiskDtype::F32);
    rewrite_tensors(dir.path(), |m| {
        m.remove("model.layers.2.self_attn.k_proj.weight");
    });
    let err = load(dir.path()).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, ModelError::MissingTensor { .. }), "{msg}");
    assert!(
        msg.contains("model.layers.2.self_attn.k_proj.weight") && msg.contains("model.safetensors"),
        "{msg}"
    );
}

#[test]
fn a_wrong_shape_is_named_with_file_tensor_and_both_shapes() {
    let dir = export(1, DiskDtype::F32);
    rewrite_tensors(dir.path(), |m| {
        m.insert(
            "model.norm.weight",
            Tensor {
                shape: vec![63],
                data: vec![1.0; 63],
            },
        );
    });
    let msg = load(dir.path()).unwrap_err().to_string();
    assert!(
        msg.contains("model.norm.weight")
            && msg.contains("[63]")
            && msg.contains("[64]")
            && msg.contains("model.safetensors"),
        "{msg}"
    );
}

#[test]
fn an_index_naming_a_tensor_its_shard_lacks_is_refused() {
    let dir = export(2, DiskDtype::F32);
    let index_path = dir.path().join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    index["weight_map"]["model.extra.weight"] = "model-00001-of-00002.safetensors".into();
    std::fs::write(&index_path, index.to_string()).unwrap();
    let msg = load(dir.path()).unwrap_err().to_string();
    assert!(
        msg.contains("model.extra.weight") && msg.contains("model-00001-of-00002.safetensors"),
        "{msg}"
    );
}

#[test]
fn an_unsupported_architecture_is_named_with_the_config_file() {
    let dir = export(1, DiskDtype::F32);
    let path = dir.path().join("config.json");
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("LlamaForCausalLM", "FalconForCausalLM");
    std::fs::write(&path, text).unwrap();
    let msg = load(dir.path()).unwrap_err().to_string();
    assert!(
        msg.contains("FalconForCausalLM") && msg.contains("config.json"),
        "{msg}"
    );
}

/// A config's sizes are the file's word, not the runtime's: one that no
/// memory could hold is refused by name before anything is sized by it,
/// where trusting it made the loader abort on an allocation of terabytes.
#[test]
fn sizes_no_memory_could_hold_are_refused_by_name() {
    for (field, value) in [
        ("num_hidden_layers", 1u64 << 40),
        ("num_attention_heads", 1 << 40),
        ("num_key_value_heads", 1 << 40),
        ("hidden_size", 1 << 40),
        ("intermediate_size", 1 << 40),
        ("head_dim", 1 << 40),
    ] {
        let dir = export(1, DiskDtype::F32);
        let path = dir.path().join("config.json");
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        config[field] = value.into();
        std::fs::write(&path, config.to_string()).unwrap();
        let msg = load(dir.path()).unwrap_err().to_string();
        assert!(
            msg.contains(field) && msg.contains("config.json"),
            "{field}: {msg}"
        );
    }
}

#[test]
fn a_corrupt_weights_file_and_an_unknown_model_name_are_clear_errors() {
    let dir = export(1, DiskDtype::F32);
    std::fs::write(dir.path().join("model.safetensors"), b"not safetensors").unwrap();
    assert!(matches!(
        load(dir.path()),
        Err(ModelError::Safetensors { .. })
    ));
    assert!(matches!(
        LoadedModel::load("builtin:huge"),
        Err(ModelError::UnknownModel { .. })
    ));
    // The names it suggests are every name it takes.
    let msg = LoadedModel::load("builtin:huge").unwrap_err().to_string();
    assert!(
        msg.contains("gemma3-270m") && msg.contains("smollm2"),
        "{msg}"
    );
    // A .gguf path that is not there is a missing file, not an unknown name.
    let missing = dir.path().join("gone.gguf");
    let msg = LoadedModel::load(missing.to_str().unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("gone.gguf") && !msg.contains("unknown model"),
        "{msg}"
    );
    // So is any path that is not there, written as a path (a directory of
    // weights mistyped, say), for the weights and for a router's text model.
    for missing in [
        dir.path().join("weights").to_str().unwrap().to_string(),
        "./no-such-model-dir".to_string(),
    ] {
        let load = LoadedModel::load(&missing).unwrap_err();
        let text = kvfence_model::TextModel::load(&missing).unwrap_err();
        for err in [load, text] {
            assert!(matches!(err, ModelError::Io { .. }), "{missing}: {err}");
            assert!(err.to_string().starts_with(&missing), "{err}");
            // The OS's reason is in the message, so not again as its cause.
            assert!(std::error::Error::source(&err).is_none(), "{err:?}");
        }
    }
}

/// What a router loads: name, shape, tokenizer and template, never the
/// weights. A directory whose weights are gone still gives the router all
/// it needs, and the same prompt ids as the full model.
#[test]
fn a_text_model_reads_no_weights_and_tokenizes_like_the_full_model() {
    let dir = export(2, DiskDtype::F32);
    let full = load(dir.path()).unwrap();
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            std::fs::remove_file(path).unwrap();
        }
    }
    assert!(load(dir.path()).is_err(), "the weights are really gone");
    let text = kvfence_model::TextModel::load(dir.path().to_str().unwrap()).unwrap();
    assert_eq!(&text.config, full.model.config());
    let sample = "Hello <|im_start|> wörld";
    assert_eq!(
        text.tokenizer.encode(sample).unwrap(),
        full.tokenizer.encode(sample).unwrap()
    );
    let messages = [ChatMessage {
        role: "user".into(),
        content: "hi".into(),
    }];
    let render = |t: &kvfence_model::ChatTemplate| t.render(&messages, true).unwrap();
    assert_eq!(
        render(text.chat_template.as_ref().unwrap()),
        render(full.chat_template.as_ref().unwrap())
    );
}
