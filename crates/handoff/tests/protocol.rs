//! The hand-off protocol between two real pools, every message passing
//! through the wire codec: a clean transfer commits with exact KV; every
//! violation is refused, counted and leaves both pools at baseline.

#![allow(clippy::unwrap_used)]

use kvfence_handoff::{
    Epoch, Grant, HandoffError, HandoffId, Message, Outcome, PromptScore, Receiver, RejectReason,
    send_kv,
};
use kvfence_pool::{ElemType, Generation, KvShape, Lease, Pool, PoolSize, PoolSpec, RequestId};

const SHAPE: KvShape = KvShape {
    layers: 3,
    kv_heads: 2,
    head_dim: 4,
};
const PAGE: usize = 4;
const TOKENS: usize = 10;
const ID: HandoffId = HandoffId(7);

fn pool(pages: usize) -> Pool {
    Pool::new(&PoolSpec::new(
        SHAPE,
        PAGE,
        ElemType::F32,
        PoolSize::Pages(pages),
    ))
    .unwrap()
}

fn wire(message: &Message) -> Message {
    let frame = message.to_frame();
    let (decoded, used) = Message::decode(&frame).unwrap().unwrap();
    assert_eq!(used, frame.len());
    decoded
}

/// A prefill lease holding TOKENS written tokens.
fn written_source(prefill: &Pool, tokens: usize) -> Lease {
    let mut lease = prefill.lease(RequestId(1), TOKENS).unwrap();
    for layer in 0..SHAPE.layers {
        let k: Vec<f32> = (0..tokens * 8).map(|i| (layer * 1000 + i) as f32).collect();
        let v: Vec<f32> = k.iter().map(|x| -x).collect();
        lease.write_positions(layer, 0, &k, &v).unwrap();
    }
    lease
}

struct Setup {
    prefill: Pool,
    decode: Pool,
    receiver: Receiver,
    grant: Grant,
    source: Lease,
}

fn setup() -> Setup {
    let (prefill, decode) = (pool(8), pool(8));
    let mut receiver = Receiver::new();
    let reservation = decode.lease(RequestId(100), TOKENS + 6).unwrap();
    let grant_message = wire(&receiver.grant(ID, reservation, TOKENS).unwrap());
    let grant = Grant::from_message(&grant_message).unwrap();
    assert_eq!(grant.pages(), 3, "10 tokens in 4-slot pages");
    let source = written_source(&prefill, TOKENS);
    Setup {
        prefill,
        decode,
        receiver,
        grant,
        source,
    }
}

fn chunks(s: &Setup) -> (Vec<Message>, kvfence_handoff::AllSent) {
    let mut out = Vec::new();
    let proof = send_kv(&s.grant, &s.source, |m| out.push(wire(&m))).unwrap();
    (out, proof)
}

/// The committed lease holds exactly the source's KV for every granted
/// token: every page, layer and head, keys and values.
fn assert_same_kv(got: &Lease, want: &Lease) {
    let (got, want) = (
        got.read_view::<f32>(TOKENS).unwrap(),
        want.read_view::<f32>(TOKENS).unwrap(),
    );
    for page in 0..got.num_pages() {
        for layer in 0..SHAPE.layers {
            for head in 0..SHAPE.kv_heads {
                assert_eq!(
                    got.keys(page, layer, head).to_rows(),
                    want.keys(page, layer, head).to_rows()
                );
                assert_eq!(
                    got.values(page, layer, head),
                    want.values(page, layer, head)
                );
            }
        }
    }
}

fn assert_baseline(pool: &Pool) {
    let stats = pool.stats();
    assert_eq!(
        (stats.leased_pages, stats.quarantined_pages),
        (0, 0),
        "I8: pool not at baseline"
    );
}

#[test]
fn a_clean_transfer_commits_with_exactly_the_sent_kv() {
    let mut s = setup();
    let (messages, proof) = chunks(&s);
    for m in messages {
        assert!(matches!(s.receiver.handle(m), Outcome::Accepted));
    }
    let Outcome::Committed(committed) = s.receiver.handle(wire(&proof.done(42, 0))) else {
        panic!("no commit")
    };
    assert_eq!((committed.tokens(), committed.first_token()), (TOKENS, 42));
    let lease = committed.into_lease();
    assert_same_kv(&lease, &s.source);
    assert!(
        lease.read_view::<f32>(TOKENS + 1).is_err(),
        "nothing beyond the grant is readable"
    );
    assert_eq!(s.receiver.stats().committed, 1);
    drop((lease, s.source));
    assert_baseline(&s.decode);
    assert_baseline(&s.prefill);
}

#[test]
fn chunk_frames_written_from_the_page_are_the_frames_of_the_chunk_messages() {
    let mut s = setup();
    let (messages, proof) = chunks(&s);
    // A shelf that already holds a buffer full of other bytes: what a
    // frame shows is only what was written into it.
    let shelf = kvfence_handoff::FrameShelf::new(16 << 20);
    drop(shelf.freeze(vec![0xAB; 1 << 16]));
    let mut frames = Vec::new();
    let framed_proof = kvfence_handoff::Streaming::new(s.grant.clone())
        .finish(
            &s.source,
            &mut kvfence_handoff::ChunkFrames::new(&s.grant, &shelf, |f| frames.push(f)),
        )
        .unwrap();
    let expected: Vec<Vec<u8>> = messages.iter().map(Message::to_frame).collect();
    assert_eq!(frames, expected);
    let done = framed_proof.done(7, 0);
    assert_eq!(done, proof.done(7, 0), "the same digest");
    // And they commit, decoded in place.
    for frame in frames {
        let (message, _) = Message::decode_shared(&frame).unwrap().unwrap();
        assert!(matches!(s.receiver.handle(message), Outcome::Accepted));
    }
    assert!(matches!(
        s.receiver.handle(wire(&done)),
        Outcome::Committed(_)
    ));
}

fn fails_with(s: &mut Setup, messages: Vec<Message>, check: impl Fn(&HandoffError) -> bool) {
    fails_with_others_holding(s, messages, check, 0);
}

/// As `fails_with`, while `others` decode pages are legitimately held elsewhere.
fn fails_with_others_holding(
    s: &mut Setup,
    messages: Vec<Message>,
    check: impl Fn(&HandoffError) -> bool,
    others: usize,
) {
    for m in messages {
        match s.receiver.handle(m) {
            Outcome::Accepted | Outcome::Ignored | Outcome::Released { .. } => {}
            Outcome::Failed { error, reply, .. } => {
                assert!(check(&error), "unexpected failure: {error}");
                assert!(matches!(
                    reply,
                    Some(Message::Reject {
                        reason: RejectReason::Failed,
                        ..
                    })
                ));
                assert_eq!(s.receiver.in_flight(), 0);
                assert_eq!(
                    s.decode.stats().leased_pages,
                    others,
                    "I8: the reservation was not freed"
                );
                return;
            }
            Outcome::Committed(_) => panic!("committed despite the fault"),
        }
    }
    panic!("the fault was not detected");
}

#[test]
fn i3_a_chunk_with_a_stale_generation_is_rejected_and_counted() {
    let mut s = setup();
    let (mut messages, _) = chunks(&s);
    if let Message::Chunk { page, .. } = &mut messages[1] {
        page.generation = Generation(page.generation.0 - 1);
    }
    fails_with(&mut s, messages, |e| {
        matches!(
            e,
            HandoffError::Pool(kvfence_pool::PoolError::StaleGeneration { .. })
        )
    });
    assert_eq!(s.decode.stats().stale_writes_rejected, 1);
}

#[test]
fn i3_a_chunk_for_a_page_outside_the_grant_is_rejected() {
    let mut s = setup();
    let other = s.decode.lease(RequestId(200), 4).unwrap();
    let (mut messages, _) = chunks(&s);
    if let Message::Chunk { page, .. } = &mut messages[0] {
        *page = other.pages()[0];
    }
    fails_with_others_holding(
        &mut s,
        messages,
        |e| matches!(e, HandoffError::ChunkOutsideGrant { .. }),
        1,
    );
    assert!(
        other.read_view::<f32>(1).is_err(),
        "nothing landed in the other request's page"
    );
}

#[test]
fn i7_a_chunk_with_a_bad_checksum_is_rejected_and_counted() {
    let mut s = setup();
    let (mut messages, _) = chunks(&s);
    if let Message::Chunk { bytes, .. } = &mut messages[2] {
        let mut flipped = bytes.to_vec();
        flipped[5] ^= 0x40;
        *bytes = flipped.into();
    }
    fails_with(&mut s, messages, |e| {
        matches!(e, HandoffError::ChecksumMismatch { page: 2, .. })
    });
    assert_eq!(s.receiver.stats().checksum_failures, 1);
}

#[test]
fn a_chunk_from_a_revoked_epoch_is_ignored_and_counted() {
    let mut s = setup();
    let (messages, proof) = chunks(&s);
    let mut stale = messages[0].clone();
    if let Message::Chunk { epoch, .. } = &mut stale {
        *epoch = Epoch(epoch.0 + 1);
    }
    assert!(matches!(s.receiver.handle(stale), Outcome::Ignored));
    assert_eq!(s.receiver.stats().stale_messages, 1);
    for m in messages {
        s.receiver.handle(m);
    }
    assert!(matches!(
        s.receiver.handle(proof.done(1, 0)),
        Outcome::Committed(_)
    ));
}

#[test]
fn i5_the_incident_placeholder_done_with_fewer_tokens_fails_the_request() {
    let mut s = setup();
    // A prefill worker that "rejected" the prompt, wrote one token and
    // claimed completion: the receiver must not commit.
    let done = Message::Done {
        id: ID,
        epoch: s.grant.epoch,
        tokens: 1,
        digest: 0,
        first_token: 9,
        cached: 0,
        first_logprobs: Vec::new(),
        prompt_logprobs: Vec::new(),
    };
    fails_with(&mut s, vec![done], |e| {
        matches!(
            e,
            HandoffError::TokenCountMismatch {
                claimed: 1,
                granted: TOKENS,
                ..
            }
        )
    });
}

#[test]
fn i7_done_before_every_page_arrived_fails() {
    let mut s = setup();
    let (mut messages, proof) = chunks(&s);
    messages.remove(1);
    messages.push(proof.done(3, 0));
    fails_with(&mut s, messages, |e| {
        matches!(
            e,
            HandoffError::Incomplete {
                missing: 1,
                pages: 3,
                ..
            }
        )
    });
}

#[test]
fn i7_a_wrong_digest_fails() {
    let mut s = setup();
    let (mut messages, proof) = chunks(&s);
    let mut done = proof.done(3, 0);
    if let Message::Done { digest, .. } = &mut done {
        *digest ^= 1;
    }
    messages.push(done);
    fails_with(&mut s, messages, |e| {
        matches!(e, HandoffError::DigestMismatch { .. })
    });
}

#[test]
fn i5_a_source_missing_tokens_cannot_produce_a_done() {
    let s = setup();
    let partial = written_source(&s.prefill, TOKENS - 1);
    drop(s.source);
    let err = send_kv(&s.grant, &partial, |_| {}).unwrap_err();
    assert!(
        matches!(
            err,
            HandoffError::SourceIncomplete {
                need: TOKENS,
                have: 9,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn abort_frees_the_pages_at_once_and_late_chunks_are_ignored() {
    let mut s = setup();
    let (messages, proof) = chunks(&s);
    s.receiver.handle(messages[0].clone());
    let abort = s.receiver.abort(ID).unwrap();
    assert!(matches!(abort, Message::Abort { id: ID, .. }));
    assert_baseline(&s.decode);
    for m in messages {
        assert!(matches!(s.receiver.handle(m), Outcome::Ignored));
    }
    assert!(matches!(
        s.receiver.handle(proof.done(1, 0)),
        Outcome::Ignored
    ));
    assert!(s.receiver.abort(ID).is_none());
}

#[test]
fn a_reject_from_the_sender_fails_the_hand_off_and_frees_the_reservation() {
    let mut s = setup();
    let outcome = s.receiver.handle(wire(&Message::Reject {
        id: ID,
        reason: RejectReason::TooLong,
    }));
    assert!(matches!(
        outcome,
        Outcome::Failed {
            error: HandoffError::Rejected {
                reason: RejectReason::TooLong,
                ..
            },
            reply: None,
            ..
        }
    ));
    assert_baseline(&s.decode);
}

#[test]
fn pages_ship_as_they_fill_and_the_transfer_still_commits_exactly() {
    let (prefill, decode) = (pool(8), pool(8));
    let mut receiver = Receiver::new();
    let grant = Grant::from_message(
        &receiver
            .grant(ID, decode.lease(RequestId(9), TOKENS).unwrap(), TOKENS)
            .unwrap(),
    )
    .unwrap();
    let mut source = prefill.lease(RequestId(1), TOKENS).unwrap();
    let mut streaming = kvfence_handoff::Streaming::new(grant.clone());
    let mut sent = Vec::new();
    // Prefill in chunks of 3 tokens; after each, ship what is complete.
    for start in (0..TOKENS).step_by(3) {
        let end = (start + 3).min(TOKENS);
        for layer in 0..SHAPE.layers {
            let k: Vec<f32> = (start * 8..end * 8)
                .map(|i| (layer * 1000 + i) as f32)
                .collect();
            source.write_positions(layer, start, &k, &k).unwrap();
        }
        let mut out = kvfence_handoff::Chunks::new(&grant, |m| sent.push(wire(&m)));
        streaming.send_ready(&source, end, &mut out).unwrap();
        // A page leaves once every granted slot of it is written: after 3
        // tokens none, after 6 one, after 9 two, after 10 all three (the last
        // page's grant ends at token 10).
        let complete = (0..grant.pages())
            .filter(|i| ((i + 1) * PAGE).min(TOKENS) <= end)
            .count();
        assert_eq!(sent.len(), complete, "after {end} tokens");
    }
    let proof = streaming
        .finish(
            &source,
            &mut kvfence_handoff::Chunks::new(&grant, |m| sent.push(wire(&m))),
        )
        .unwrap();
    assert_eq!(sent.len(), 3, "every page exactly once");
    for m in sent {
        assert!(matches!(receiver.handle(m), Outcome::Accepted));
    }
    let Outcome::Committed(committed) = receiver.handle(wire(&proof.done(1, 0))) else {
        panic!("no commit")
    };
    let lease = committed.into_lease();
    assert_eq!(
        lease
            .read_view::<f32>(TOKENS)
            .unwrap()
            .keys(2, 2, 1)
            .to_rows(),
        source
            .read_view::<f32>(TOKENS)
            .unwrap()
            .keys(2, 2, 1)
            .to_rows()
    );
}

/// A decode pool with a prefix cache that already holds the first page of
/// the prompt, sealed from an earlier transfer, and a grant into a lease
/// that starts with it.
fn setup_with_present_page() -> Setup {
    let prefill = pool(8);
    let decode = Pool::new(
        &PoolSpec::new(SHAPE, PAGE, ElemType::F32, PoolSize::Pages(8)).with_prefix_cache(8),
    )
    .unwrap();
    let namespace = decode.namespace("tenant", None, "model");
    let prompt: Vec<u32> = (0..TOKENS as u32).collect();
    let source = written_source(&prefill, TOKENS);
    // An earlier request of the tenant: its KV arrives and is sealed.
    let mut earlier = decode
        .lease_with_prefix(RequestId(99), TOKENS, &namespace, &prompt)
        .unwrap();
    let view = source.read_view_raw(TOKENS).unwrap();
    for page in 0..3 {
        let slots = 0..view.slots_in_page(page);
        let bytes = view.export_slots(page, slots.clone());
        earlier
            .write_slots_raw(earlier.pages()[page], slots, &bytes)
            .unwrap();
    }
    drop(view);
    assert_eq!(earlier.seal(&prompt), 2);
    drop(earlier);
    let mut receiver = Receiver::new();
    let reservation = decode
        .lease_with_prefix(RequestId(100), TOKENS + 6, &namespace, &prompt)
        .unwrap();
    assert_eq!(reservation.leading_shared_pages(), 2);
    let grant =
        Grant::from_message(&wire(&receiver.grant(ID, reservation, TOKENS).unwrap())).unwrap();
    Setup {
        prefill,
        decode,
        receiver,
        grant,
        source,
    }
}

#[test]
fn i2_pages_the_receiver_holds_are_not_shipped_and_the_commit_still_proves_every_slot() {
    let mut s = setup_with_present_page();
    assert_eq!(s.grant.groups[0].present, 2, "two full pages are present");
    let (messages, proof) = chunks(&s);
    assert_eq!(messages.len(), 1, "only the last page crosses the link");
    for m in messages {
        assert!(matches!(s.receiver.handle(m), Outcome::Accepted));
    }
    let Outcome::Committed(committed) = s.receiver.handle(wire(&proof.done(5, 0))) else {
        panic!("no commit")
    };
    let lease = committed.into_lease();
    assert_same_kv(&lease, &s.source);
    drop(lease);
    assert!(s.decode.stats().at_baseline());
}

#[test]
fn i1_a_chunk_for_a_present_page_fails_the_hand_off() {
    let mut s = setup_with_present_page();
    // A sender that ignores `present` and ships page 0 anyway.
    let mut everything = s.grant.clone();
    everything.groups[0].present = 0;
    let mut out = Vec::new();
    let _ = send_kv(&everything, &s.source, |m| out.push(wire(&m))).unwrap();
    fails_with(
        &mut s,
        vec![out.remove(0)],
        |e| matches!(e, HandoffError::ChunkOutsideGrant { reason, .. } if reason.contains("present")),
    );
}

#[test]
fn progress_keeps_a_hand_off_alive_and_commits_nothing() {
    let mut s = setup();
    let streaming = kvfence_handoff::Streaming::new(s.grant.clone());
    for computed in [0, 4, TOKENS] {
        assert!(matches!(
            s.receiver.handle(wire(&streaming.progress(computed))),
            Outcome::Accepted
        ));
    }
    assert_eq!(s.receiver.in_flight(), 1, "progress is no commit");
    // A `Done` still needs every page: progress proved nothing.
    let (_, proof) = chunks(&s);
    assert!(matches!(
        s.receiver.handle(wire(&proof.done(1, 0))),
        Outcome::Failed {
            error: HandoffError::Incomplete { .. },
            ..
        }
    ));
    assert_baseline(&s.decode);
}

#[test]
fn progress_of_a_revoked_epoch_is_ignored_and_progress_beyond_the_grant_fails() {
    let mut s = setup();
    let streaming = kvfence_handoff::Streaming::new(s.grant.clone());
    let mut stale = streaming.progress(3);
    if let Message::Progress { epoch, .. } = &mut stale {
        *epoch = Epoch(epoch.0 + 1);
    }
    assert!(matches!(s.receiver.handle(stale), Outcome::Ignored));
    assert_eq!(s.receiver.stats().stale_messages, 1);
    let beyond = Message::Progress {
        id: ID,
        epoch: s.grant.epoch,
        computed: TOKENS as u32 + 1,
    };
    fails_with(&mut s, vec![beyond], |e| {
        matches!(
            e,
            HandoffError::ProgressBeyondGrant {
                claimed: 11,
                granted: 10,
                ..
            }
        )
    });
}

/// Scores for a grant of `TOKENS`: one per prompt token after the first,
/// each its token and `alternatives` others.
fn scores(count: usize, alternatives: usize) -> Vec<PromptScore> {
    (0..count)
        .map(|i| PromptScore {
            rank: 1 + i as u32,
            logprobs: (0..=alternatives)
                .map(|j| ((i + j) as u32, -(j as f32)))
                .collect(),
        })
        .collect()
}

#[test]
fn a_grant_that_asks_for_the_prompts_scores_commits_only_with_all_of_them() {
    // Each case: what Done carries, and whether it commits. The grant
    // asks for two alternatives per token.
    let cases: Vec<(&str, Vec<PromptScore>, bool)> = vec![
        ("every score", scores(TOKENS - 1, 2), true),
        ("fewer alternatives", scores(TOKENS - 1, 0), true),
        ("none", Vec::new(), false),
        ("one short", scores(TOKENS - 2, 2), false),
        ("one too many", scores(TOKENS, 2), false),
        ("too many alternatives", scores(TOKENS - 1, 3), false),
        (
            "a rank of 0",
            {
                let mut s = scores(TOKENS - 1, 2);
                s[3].rank = 0;
                s
            },
            false,
        ),
        (
            "not a number",
            {
                let mut s = scores(TOKENS - 1, 2);
                s[5].logprobs[0].1 = f32::NAN;
                s
            },
            false,
        ),
    ];
    for (case, carried, commits) in cases {
        let mut s = setup();
        s.receiver.expect_prompt_logprobs(ID, 2);
        let (messages, proof) = chunks(&s);
        for m in messages {
            assert!(matches!(s.receiver.handle(m), Outcome::Accepted), "{case}");
        }
        // Built by hand: an honest sender cannot make the bad ones.
        let mut done = proof.done(42, 0);
        if let Message::Done {
            prompt_logprobs, ..
        } = &mut done
        {
            *prompt_logprobs = carried.clone();
        }
        match s.receiver.handle(wire(&done)) {
            Outcome::Committed(mut committed) if commits => {
                let got = committed.take_prompt_logprobs();
                assert_eq!(got.len(), TOKENS - 1, "{case}");
                assert_eq!(got[..4], carried[..4], "{case}: NaN never compares equal");
            }
            Outcome::Failed {
                error: HandoffError::PromptLogprobsMismatch { .. },
                ..
            } if !commits => {}
            other => panic!("{case}: {other:?}"),
        }
        drop(s.source);
        assert_baseline(&s.prefill);
        assert_baseline(&s.decode);
    }
}

#[test]
fn scores_a_grant_did_not_ask_for_fail_the_hand_off() {
    let mut s = setup();
    let (messages, proof) = chunks(&s);
    for m in messages {
        assert!(matches!(s.receiver.handle(m), Outcome::Accepted));
    }
    let done = wire(&proof.done_with_logprobs(42, 0, Vec::new(), scores(TOKENS - 1, 0)));
    assert!(matches!(
        s.receiver.handle(done),
        Outcome::Failed {
            error: HandoffError::PromptLogprobsMismatch { .. },
            reply: Some(Message::Reject { .. }),
            ..
        }
    ));
    drop(s.source);
    assert_baseline(&s.decode);
}
