//! Any bytes a peer worker sends as a link frame — an order, a hand-off
//! frame, a drain notice, or anything else — decode to a command or an
//! error that closes the link; never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = kvfence_engine::decode_frame(bytes::Bytes::copy_from_slice(data));
});
