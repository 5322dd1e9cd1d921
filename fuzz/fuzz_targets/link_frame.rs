//! The TCP link's length-delimited reader never panics and never allocates
//! past its bound, whatever a peer sends.
#![no_main]

use kvfence_handoff::tcp::read_link_frame;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut input = data;
    while let Ok(Some(_)) = read_link_frame(&mut input) {}
});
