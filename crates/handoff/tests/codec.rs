//! The wire codec: every message round-trips; any byte string decodes to a
//! message, a request for more bytes, or an error — never a panic.

#![allow(clippy::unwrap_used)]

use kvfence_handoff::{
    Epoch, GrantedGroup, HandoffId, MAX_FRAME, Message, PromptScore, RejectReason,
};
use kvfence_pool::{Generation, PageId, PageRef};
use proptest::prelude::*;

fn page_ref() -> impl Strategy<Value = PageRef> {
    (any::<u32>(), any::<u64>()).prop_map(|(id, g)| PageRef {
        id: PageId(id),
        generation: Generation(g),
    })
}

fn granted_group() -> impl Strategy<Value = GrantedGroup> {
    (
        proptest::collection::vec(any::<u32>(), 0..20),
        any::<u32>(),
        proptest::collection::vec(page_ref(), 0..20),
        any::<prop::sample::Index>(),
    )
        .prop_map(|(layers, first_page, pages, present)| GrantedGroup {
            layers,
            first_page,
            present: present.index(pages.len() + 1) as u32,
            pages,
        })
}

fn message() -> impl Strategy<Value = Message> {
    let id = any::<u64>().prop_map(HandoffId);
    let epoch = any::<u32>().prop_map(Epoch);
    prop_oneof![
        (
            id.clone(),
            epoch.clone(),
            any::<u32>(),
            any::<u32>(),
            proptest::collection::vec(granted_group(), 0..4),
        )
            .prop_map(|(id, epoch, page_size, tokens, groups)| Message::Grant {
                id,
                epoch,
                page_size,
                tokens,
                groups
            }),
        (
            id.clone(),
            epoch.clone(),
            page_ref(),
            any::<u16>(),
            any::<u16>(),
            any::<u64>(),
            proptest::collection::vec(any::<u8>(), 0..300)
        )
            .prop_map(|(id, epoch, page, slot_start, slot_end, checksum, bytes)| {
                Message::Chunk {
                    id,
                    epoch,
                    page,
                    slot_start,
                    slot_end,
                    checksum,
                    bytes: bytes.into(),
                }
            }),
        (
            id.clone(),
            epoch.clone(),
            any::<u32>(),
            any::<u64>(),
            any::<u32>(),
            any::<u32>(),
            proptest::collection::vec((any::<u32>(), -30.0f32..=0.0), 0..=21),
            proptest::collection::vec(
                (
                    any::<u32>(),
                    proptest::collection::vec((any::<u32>(), -30.0f32..=0.0), 1..=21)
                )
                    .prop_map(|(rank, logprobs)| PromptScore { rank, logprobs }),
                0..8
            )
        )
            .prop_map(
                |(
                    id,
                    epoch,
                    tokens,
                    digest,
                    first_token,
                    cached,
                    first_logprobs,
                    prompt_logprobs,
                )| {
                    Message::Done {
                        id,
                        epoch,
                        tokens,
                        digest,
                        first_token,
                        cached,
                        first_logprobs,
                        prompt_logprobs,
                    }
                }
            ),
        (
            id.clone(),
            prop_oneof![
                Just(RejectReason::TooLong),
                Just(RejectReason::Busy),
                Just(RejectReason::Failed),
                Just(RejectReason::Aborted)
            ]
        )
            .prop_map(|(id, reason)| Message::Reject { id, reason }),
        (id.clone(), epoch.clone()).prop_map(|(id, epoch)| Message::Abort { id, epoch }),
        (id.clone(), epoch.clone()).prop_map(|(id, epoch)| Message::AbortAck { id, epoch }),
        (id, epoch, any::<u32>()).prop_map(|(id, epoch, computed)| Message::Progress {
            id,
            epoch,
            computed
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn every_message_round_trips_and_truncations_ask_for_more(m in message(), cut in any::<prop::sample::Index>()) {
        let frame = m.to_frame();
        let (decoded, used) = Message::decode(&frame).unwrap().unwrap();
        prop_assert_eq!(&decoded, &m);
        prop_assert_eq!(used, frame.len());
        let short = cut.index(frame.len());
        prop_assert_eq!(Message::decode(&frame[..short]).unwrap(), None);

        // Decoding in place gives the same message, and a chunk's payload
        // is a view of the frame, not a copy.
        let frame = bytes::Bytes::from(frame);
        let (shared, used) = Message::decode_shared(&frame).unwrap().unwrap();
        prop_assert_eq!(&shared, &m);
        prop_assert_eq!(used, frame.len());
        if let Message::Chunk { bytes, .. } = &shared && !bytes.is_empty() {
            let within = frame.as_ptr_range();
            prop_assert!(within.contains(&bytes.as_ptr()));
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = Message::decode(&bytes);
    }

    #[test]
    fn corrupting_a_frame_never_panics(m in message(), at in any::<prop::sample::Index>(), bit in 0u8..8) {
        let mut frame = m.to_frame();
        let i = at.index(frame.len());
        frame[i] ^= 1 << bit;
        let _ = Message::decode(&frame);
    }
}

#[test]
fn malformed_frames_are_errors() {
    let mut grant = Message::Grant {
        id: HandoffId(1),
        epoch: Epoch(1),
        page_size: 16,
        tokens: 3,
        groups: vec![GrantedGroup {
            layers: vec![],
            first_page: 0,
            present: 0,
            pages: vec![],
        }],
    }
    .to_frame();
    assert!(Message::decode(&grant).is_ok());
    // After the length, type, id, epoch, page size, tokens and group count:
    // the group's layer count, first page, present count and page count.
    let at = 4 + 1 + 8 + 4 + 4 + 4 + 4;
    grant[at + 12] = 5; // claims 5 pages, carries none
    assert!(Message::decode(&grant).is_err());
    grant[at + 12] = 0;
    grant[at + 8] = 1; // one page present of none granted
    assert!(Message::decode(&grant).is_err());
    grant[at + 8] = 0;
    grant[at] = 200; // claims 200 layers, carries none
    assert!(Message::decode(&grant).is_err());
    grant[at] = 0;
    grant[at - 4] = 2; // claims two groups, carries one
    assert!(Message::decode(&grant).is_err());
    let mut trailing = Message::Abort {
        id: HandoffId(1),
        epoch: Epoch(2),
    }
    .to_frame();
    trailing.push(0);
    trailing[0] += 1;
    assert!(Message::decode(&trailing).is_err());
    let mut unknown = Message::Abort {
        id: HandoffId(1),
        epoch: Epoch(2),
    }
    .to_frame();
    unknown[4] = 99;
    assert!(Message::decode(&unknown).is_err());
    let huge = ((MAX_FRAME + 1) as u32).to_le_bytes();
    assert!(
        Message::decode(&huge).is_err(),
        "an oversized length is refused before any read"
    );
    let mut bad_reason = Message::Reject {
        id: HandoffId(1),
        reason: RejectReason::Busy,
    }
    .to_frame();
    *bad_reason.last_mut().unwrap() = 0;
    assert!(Message::decode(&bad_reason).is_err());
    // A Done whose prompt-score count is more than its frame can hold is
    // refused before anything is allocated for it; a score with no entry
    // or more than 21 is refused too.
    let done = |entries: usize| Message::Done {
        id: HandoffId(1),
        epoch: Epoch(1),
        tokens: 2,
        digest: 0,
        first_token: 0,
        cached: 0,
        first_logprobs: vec![],
        prompt_logprobs: vec![PromptScore {
            rank: 1,
            logprobs: vec![(0, -1.0); entries],
        }],
    };
    let mut count = done(1).to_frame();
    let at = 4 + 1 + 8 + 4 + 4 + 8 + 4 + 4 + 1;
    assert_eq!(count[at..at + 4], 1u32.to_le_bytes());
    count[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(Message::decode(&count).is_err());
    let mut entries = done(1).to_frame();
    entries[at + 4 + 4] = 0;
    assert!(Message::decode(&entries).is_err());
    let mut entries = done(21).to_frame();
    entries[at + 4 + 4] = 22;
    assert!(Message::decode(&entries).is_err());
}
