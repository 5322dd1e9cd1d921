//! Any bytes a router or worker sends as a control frame decode to a
//! control message of this build's protocol or an error that closes the
//! link; never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = kvfence_fleet::decode_control_frame(data);
});
