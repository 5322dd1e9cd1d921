//! [`Affinity`]: where the router last sent each of a tenant's prefixes, so
//! the next request sharing one goes to the pair whose caches hold it.
//!
//! Keys are SHA-256 chained over blocks of [`BLOCK`] tokens from a root
//! made of the tenant and its salt, so a request can only ever follow its
//! own tenant's earlier requests: no tenant's prompts change where another
//! tenant's requests go (I9: no scheduling signal crosses a wall). The map
//! is bounded; the least recently used keys go first.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use sha2::{Digest, Sha256};

use kvfence_engine::{CacheScope, GenerationRequest};

/// Tokens per routing block: the workers' default page size. A worker with
/// another page size still gains, only less exactly.
pub(crate) const BLOCK: usize = 16;

/// Keys kept at most (32 bytes each, plus the pair's name).
const CAPACITY: usize = 16_384;

/// A (decode worker, prefill worker) pair, as the router names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pair {
    /// The decode worker's address: stable while it is a member, where an
    /// index would shift as workers join and leave.
    pub(crate) decode: std::net::SocketAddr,
    /// The prefill worker's name.
    pub(crate) prefill: String,
}

type Key = [u8; 32];

#[derive(Debug, Default)]
struct Inner {
    pairs: HashMap<Key, (Pair, u64)>,
    by_use: BTreeMap<u64, Key>,
    tick: u64,
}

/// The router's memory of where prefixes went; see the module docs.
#[derive(Debug, Default)]
pub(crate) struct Affinity {
    inner: Mutex<Inner>,
}

/// The chain of block keys of a request's prompt (full blocks only), or
/// none for a request that caches nothing.
fn keys(request: &GenerationRequest) -> Vec<Key> {
    let Some(scope) = request.cache.as_ref().and_then(CacheScope::as_tenant) else {
        return Vec::new();
    };
    let mut root = Sha256::new();
    root.update(b"kvfence/route-affinity/v1");
    for field in [Some(scope.tenant.as_str()), scope.salt.as_deref()] {
        match field {
            None => root.update([0]),
            Some(text) => {
                root.update([1]);
                root.update((text.len() as u64).to_le_bytes());
                root.update(text.as_bytes());
            }
        }
    }
    let mut parent: Key = root.finalize().into();
    request
        .prompt
        .chunks_exact(BLOCK)
        .map(|block| {
            let mut h = Sha256::new();
            h.update(parent);
            for token in block {
                h.update(token.to_le_bytes());
            }
            parent = h.finalize().into();
            parent
        })
        .collect()
}

impl Affinity {
    /// The pair that last took the longest prefix of `request` its tenant
    /// sent before, and how many tokens of it.
    pub(crate) fn find(&self, request: &GenerationRequest) -> Option<(Pair, usize)> {
        let keys = keys(request);
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        keys.iter().enumerate().rev().find_map(|(i, key)| {
            inner
                .pairs
                .get(key)
                .map(|(pair, _)| (pair.clone(), (i + 1) * BLOCK))
        })
    }

    /// Remembers that `pair` took `request`'s prefixes.
    pub(crate) fn record(&self, request: &GenerationRequest, pair: &Pair) {
        let keys = keys(request);
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        for key in keys {
            inner.tick += 1;
            let tick = inner.tick;
            if let Some((_, used)) = inner.pairs.insert(key, (pair.clone(), tick)) {
                inner.by_use.remove(&used);
            }
            inner.by_use.insert(tick, key);
        }
        while inner.pairs.len() > CAPACITY {
            let (_, oldest) = inner
                .by_use
                .pop_first()
                .expect("every key is in the use order");
            inner.pairs.remove(&oldest);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner.lock().unwrap().pairs.len()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use kvfence_engine::Share;

    fn request(tenant: &str, salt: Option<&str>, prompt: Vec<u32>) -> GenerationRequest {
        GenerationRequest {
            cache: Some(CacheScope::tenant(tenant, salt.map(Into::into))),
            share: Share::new(tenant, 1),
            ..GenerationRequest::greedy(prompt, 1)
        }
    }

    fn pair(decode: u16) -> Pair {
        Pair {
            decode: std::net::SocketAddr::from(([127, 0, 0, 1], 9000 + decode)),
            prefill: format!("p{decode}"),
        }
    }

    #[test]
    fn i9_a_request_follows_only_its_own_tenants_prefixes() {
        let affinity = Affinity::default();
        let prompt: Vec<u32> = (0..40).collect();
        affinity.record(&request("a", None, prompt.clone()), &pair(1));
        let longer = [prompt.clone(), vec![7; 20]].concat();
        assert_eq!(
            affinity.find(&request("a", None, longer)),
            Some((pair(1), 32))
        );
        assert_eq!(affinity.find(&request("b", None, prompt.clone())), None);
        assert_eq!(
            affinity.find(&request("a", Some("s"), prompt.clone())),
            None
        );
        let mut uncached = request("a", None, prompt.clone());
        uncached.cache = None;
        assert_eq!(affinity.find(&uncached), None);
        // A diverging prompt follows the pair of the blocks it shares.
        let diverging = [&prompt[..16], &[99; 30][..]].concat();
        assert_eq!(
            affinity.find(&request("a", None, diverging)),
            Some((pair(1), 16))
        );
        // The latest pair wins.
        affinity.record(&request("a", None, prompt.clone()), &pair(0));
        assert_eq!(
            affinity.find(&request("a", None, prompt)),
            Some((pair(0), 32))
        );
    }

    #[test]
    fn the_map_is_bounded_and_forgets_the_least_recently_used() {
        let affinity = Affinity::default();
        let first = request("a", None, (0..16).collect());
        affinity.record(&first, &pair(0));
        for i in 0..CAPACITY as u32 {
            affinity.record(&request("a", None, vec![i + 1000; 16]), &pair(1));
        }
        assert_eq!(affinity.len(), CAPACITY);
        assert_eq!(affinity.find(&first), None);
    }
}
