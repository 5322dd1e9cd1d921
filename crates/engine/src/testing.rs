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

/// A pair's two ports joined by threads that put every frame through the
/// link framing — written as a length-prefixed frame, read back — and the
/// port codec at both ends, with no socket: the fleet's TLS link less the
/// TLS.
#[derive(Debug)]
pub(crate) struct Pipe;

impl crate::Connector for Pipe {
    fn connect(&self, prefill: crate::Port, decode: crate::Port) -> Result<(), crate::EngineError> {
        fn carry(outbound: crate::Outbound, mut inbound: crate::Inbound) {
            std::thread::spawn(move || {
                for parts in outbound {
                    let parts: Vec<&[u8]> = parts.iter().map(|part| &part[..]).collect();
                    let mut wire = Vec::new();
                    kvfence_handoff::tcp::write_link_frame_parts(&mut wire, &parts)
                        .expect("a worker's frames fit the link's frame limit");
                    let frame = kvfence_handoff::tcp::read_link_frame(&mut &wire[..])
                        .expect("a frame just written reads back")
                        .expect("one whole frame");
                    if inbound.deliver(frame.into()).is_err() {
                        return;
                    }
                }
            });
        }
        carry(prefill.outbound, decode.inbound);
        carry(decode.outbound, prefill.inbound);
        Ok(())
    }
}
