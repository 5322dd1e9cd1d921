//! Any bytes fed to the hand-off frame decoder produce a message, a request
//! for more bytes, or an error; never a panic. A decoded message re-encodes
//! to exactly the bytes it came from.
#![no_main]

use kvfence_handoff::Message;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(Some((message, used))) = Message::decode(data) {
        assert_eq!(message.to_frame(), &data[..used]);
    }
});
