//! Incident replays: deliberate bugs, each a real-world way a serving engine
//! leaked KV between requests, that the test suite must catch. They exist
//! only in builds with the `mutations` feature, where `KVFENCE_MUTATION`
//! (a letter, `a` to `p`) switches one on for the whole process and its
//! children; in every other build [`Mutation::active`] is a constant
//! `false` and the bug cannot be reached. `scripts/mutation-check` runs
//! each one against the tests that should catch it and reports the result.

/// One planted bug.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutation {
    /// (a) Prefill replaces a prompt it must reject with a one-token
    /// placeholder and sends `Done` (engine).
    PlaceholderDone,
    /// (b) Reads skip the coverage check (pool, I2).
    SkipCoverage,
    /// (c) Writes ignore page generations (pool, I3).
    IgnoreGenerations,
    /// (d) An exposed lease's pages are freed at once instead of being
    /// quarantined until the window drains (pool, I4).
    FreeBeforeDrain,
    /// (e) The hand-off timeout frees quarantined pages without the
    /// writer's acknowledgement (engine, I4).
    ReleaseOnTimeout,
    /// (f) The advertised context uses the decode pool's capacity instead
    /// of the smallest pool's (server, I6).
    DecodeCapacity,
    /// (g) A prefill worker keys hand-offs by id alone, as if ids were
    /// unique across decode workers: two decode workers' hand-offs with the
    /// same id share a route, and one's KV goes to the other (engine, I1).
    SharedHandoffIds,
    /// (h) The prefix cache's key leaves out the tenant and salt, as the
    /// tiers that dropped the salt on the way to storage did: one tenant's
    /// cached pages serve another's prompts (pool, I9).
    NamespaceDropped,
    /// (i) A prefix-cache hit is taken on a hash match without comparing
    /// the cached tokens with the request's (pool, I9).
    SkipTokenCompare,
    /// (j) Eviction leaves the page's index entry behind, and resolving an
    /// entry does not check that its page still holds it: a later request
    /// reads whatever the page holds next (pool, I1/I2).
    StaleIndex,
    /// (k) A match that ends inside a shared page writes the rest of that
    /// page in place instead of copying it first (pool, I1).
    WriteShared,
    /// (l) `cached_tokens` reports the longest prefix cached in any
    /// namespace, so a tenant learns what another has sent (pool, I9).
    ForeignCachedCount,
    /// (m) A lease that began with public pages seals what follows them
    /// into the public namespace too, as if a conversation were as shared
    /// as its system prompt: every tenant that sends the public prompt
    /// reads the first tenant's question after it (pool, I9).
    SealIntoPublic,
    /// (n) A batch row's grammar outlives its request, as the stale
    /// token-allowlist rows of 2026 did: the next request admitted without
    /// a grammar of its own is constrained by the last ended request's
    /// (engine, I9).
    LeftoverConstraint,
    /// (o) A batch row's penalty history is carried over, as the per-slot
    /// token buffers left unreset were: a request's presence, frequency
    /// and repetition penalties count the tokens of the request that ended
    /// before it (engine, I9).
    LeftoverHistory,
    /// (p) A sliding-window lease gives the pages behind its window back to
    /// the pool but its page table keeps them, as a block table left
    /// unpruned would: once another request leases and writes such a
    /// page, a read of the old window position reads that request's KV
    /// (pool, I1/I2).
    KeepReleasedPages,
}

impl Mutation {
    /// Every mutation with its letter.
    pub const ALL: [(char, Mutation); 16] = [
        ('a', Mutation::PlaceholderDone),
        ('b', Mutation::SkipCoverage),
        ('c', Mutation::IgnoreGenerations),
        ('d', Mutation::FreeBeforeDrain),
        ('e', Mutation::ReleaseOnTimeout),
        ('f', Mutation::DecodeCapacity),
        ('g', Mutation::SharedHandoffIds),
        ('h', Mutation::NamespaceDropped),
        ('i', Mutation::SkipTokenCompare),
        ('j', Mutation::StaleIndex),
        ('k', Mutation::WriteShared),
        ('l', Mutation::ForeignCachedCount),
        ('m', Mutation::SealIntoPublic),
        ('n', Mutation::LeftoverConstraint),
        ('o', Mutation::LeftoverHistory),
        ('p', Mutation::KeepReleasedPages),
    ];

    /// Whether this bug is switched on (never, without the feature).
    #[cfg(not(feature = "mutations"))]
    #[inline(always)]
    pub fn active(self) -> bool {
        false
    }

    /// Whether this bug is switched on by `KVFENCE_MUTATION`.
    #[cfg(feature = "mutations")]
    pub fn active(self) -> bool {
        static ACTIVE: std::sync::OnceLock<Option<Mutation>> = std::sync::OnceLock::new();
        *ACTIVE.get_or_init(|| {
            let letter = std::env::var("KVFENCE_MUTATION").ok()?;
            let found = Mutation::ALL
                .iter()
                .find(|(l, _)| letter == l.to_string())
                .map(|&(_, m)| m);
            assert!(
                found.is_some(),
                "KVFENCE_MUTATION={letter:?} names no mutation (a to p)"
            );
            found
        }) == Some(self)
    }
}
