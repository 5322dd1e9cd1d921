//! Any bytes fed to the hand-off frame decoder produce a message, a request
//! for more bytes, or an error; never a panic. A decoded message re-encodes
//! to exactly the bytes it came from, and decoding in place
//! (`decode_shared`) gives the same message.
#![no_main]

use kvfence_handoff::Message;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let copied = Message::decode(data);
    if let Ok(Some((message, used))) = &copied {
        assert_eq!(message.to_frame(), &data[..*used]);
    }
    let shared = Message::decode_shared(&bytes::Bytes::copy_from_slice(data));
    assert_eq!(format!("{copied:?}"), format!("{shared:?}"));
});
