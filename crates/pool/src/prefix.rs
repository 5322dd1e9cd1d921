//! The prefix cache's keys and ledger: sealed pages that later requests of
//! the same namespace read instead of recomputing (I1's `Shared` state, I9's
//! walls).
//!
//! A [`Namespace`] is what no key can be built without: the tenant the
//! gateway authenticated, an optional salt that subdivides it, the model and
//! the pool's KV layout, hashed into one [`NamespaceId`]. Each full page of
//! tokens is named by a [`BlockHash`] chained from the namespace through
//! every earlier page with SHA-256, so equal hashes mean one namespace and
//! one token prefix unless SHA-256 collides — and even then a hit is taken
//! only after the cached tokens are compared with the request's.
//!
//! The [`CacheLedger`] lives under the pool's ledger lock. It maps block
//! hashes to the shared pages holding them, counts each page's readers (the
//! leases that include it), keeps zero-reader pages in least-recently-used
//! order for eviction, and counts each tenant's shared pages against its
//! quota, so no tenant's flood can push out another's entries.

use std::collections::{BTreeSet, HashMap};

use sha2::{Digest, Sha256};

use crate::mutation::Mutation;
use crate::page::{NamespaceId, PageId, PageRef};
use crate::spec::Geometry;

/// The wall around a set of cached prefixes: one tenant (and salt) on one
/// model with one KV layout, or that model's public namespace. Built only
/// by [`crate::Pool::namespace`] and [`crate::Pool::public_namespace`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Namespace {
    id: NamespaceId,
    tenant: TenantTag,
    /// The public namespace of the same model and layout, which a tenant's
    /// lookups read first; `None` for the public namespace itself.
    public: Option<NamespaceId>,
}

/// Whose quota a shared page counts against (salts of one tenant share
/// its quota). Public pages have a quota of their own and are pinned: no
/// tenant's traffic can evict them, so whether they are resident never
/// depends on what anyone else sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum TenantTag {
    Tenant(u64),
    Public,
}

/// The name of one full page of tokens in one namespace, after every page
/// before it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct BlockHash([u8; 32]);

/// Length-prefixed, so no two different field lists hash the same bytes.
fn field(hasher: &mut Sha256, bytes: &[u8]) {
    hasher.update((bytes.len() as u64).to_le_bytes());
    hasher.update(bytes);
}

/// The model and KV layout every namespace's id ends with.
fn model_and_layout(hasher: &mut Sha256, model: &str, geometry: &Geometry) {
    field(hasher, model.as_bytes());
    let layout = format!(
        "{:?}/{}/{}x{}x{}",
        geometry.elem,
        geometry.page_size,
        geometry.shape.layers,
        geometry.shape.kv_heads,
        geometry.shape.head_dim
    );
    field(hasher, layout.as_bytes());
}

impl Namespace {
    pub(crate) fn new(
        tenant: &str,
        salt: Option<&str>,
        model: &str,
        geometry: &Geometry,
    ) -> Namespace {
        // Incident replay (h): the tenant and salt left out of the key.
        let (tenant, salt) = if Mutation::NamespaceDropped.active() {
            ("", None)
        } else {
            (tenant, salt)
        };
        let mut hasher = Sha256::new();
        field(&mut hasher, b"kvfence/prefix-namespace/v1");
        field(&mut hasher, tenant.as_bytes());
        match salt {
            None => field(&mut hasher, b"unsalted"),
            Some(salt) => {
                field(&mut hasher, b"salted");
                field(&mut hasher, salt.as_bytes());
            }
        }
        model_and_layout(&mut hasher, model, geometry);
        let tenant_digest = Sha256::digest(tenant.as_bytes());
        let tag = u64::from_le_bytes(
            tenant_digest[..8]
                .try_into()
                .expect("a digest has 32 bytes"),
        );
        Namespace {
            id: NamespaceId(hasher.finalize().into()),
            tenant: TenantTag::Tenant(tag),
            public: Some(Namespace::public(model, geometry).id),
        }
    }

    /// The public namespace of `model` with this layout: what the operator
    /// declared common to every tenant, and nothing a request sent. Its own
    /// domain string keeps it apart from every tenant's, the empty name
    /// included.
    pub(crate) fn public(model: &str, geometry: &Geometry) -> Namespace {
        let mut hasher = Sha256::new();
        field(&mut hasher, b"kvfence/prefix-namespace/public/v1");
        model_and_layout(&mut hasher, model, geometry);
        Namespace {
            id: NamespaceId(hasher.finalize().into()),
            tenant: TenantTag::Public,
            public: None,
        }
    }

    /// The namespace's identity.
    pub fn id(&self) -> NamespaceId {
        self.id
    }

    /// Whether this is a public namespace.
    pub fn is_public(&self) -> bool {
        self.tenant == TenantTag::Public
    }

    /// Whether a page sealed in namespace `id` may be read through this
    /// one: its own pages, and for a tenant the public ones.
    pub(crate) fn reads(&self, id: NamespaceId) -> bool {
        id == self.id || self.public == Some(id)
    }

    /// The public namespace this one reads, as a namespace of its own.
    pub(crate) fn public_namespace(&self) -> Option<Namespace> {
        self.public.map(|id| Namespace {
            id,
            tenant: TenantTag::Public,
            public: None,
        })
    }

    pub(crate) fn tenant(&self) -> TenantTag {
        self.tenant
    }

    /// The namespace of layer group `group` inside this one: each group's
    /// pages hold other layers of the same prompt, so each has a wall and a
    /// chain of its own (group 0's is this namespace itself, so a pool of one
    /// group keys its pages as it always did). The public namespace it
    /// reads is its public namespace's group `group`.
    pub(crate) fn group(&self, group: usize) -> Namespace {
        if group == 0 {
            return self.clone();
        }
        let derive = |id: NamespaceId| {
            let mut hasher = Sha256::new();
            field(&mut hasher, b"kvfence/prefix-namespace/layer-group/v1");
            field(&mut hasher, &id.0);
            field(&mut hasher, &(group as u64).to_le_bytes());
            NamespaceId(hasher.finalize().into())
        };
        Namespace {
            id: derive(self.id),
            tenant: self.tenant,
            public: self.public.map(derive),
        }
    }

    /// The chain's root: the parent of a prompt's first page.
    pub(crate) fn root(&self) -> BlockHash {
        BlockHash(self.id.0)
    }
}

/// Hashes one full page of `tokens` after `parent`. With `weak` (a test
/// hook) the token values are left out, so every page of the same length
/// after the same parent collides: what shows that hits compare tokens.
pub(crate) fn block_hash(parent: BlockHash, tokens: &[u32], weak: bool) -> BlockHash {
    let mut hasher = Sha256::new();
    field(&mut hasher, b"kvfence/prefix-block/v1");
    field(&mut hasher, &parent.0);
    hasher.update((tokens.len() as u64).to_le_bytes());
    if !weak {
        for token in tokens {
            hasher.update(token.to_le_bytes());
        }
    }
    BlockHash(hasher.finalize().into())
}

/// One cached page of tokens.
struct Entry {
    page: PageRef,
    namespace: NamespaceId,
    tokens: Box<[u32]>,
}

/// A page in `Shared`, as the ledger tracks it.
struct SharedPage {
    hash: BlockHash,
    parent: BlockHash,
    tenant: TenantTag,
    readers: u32,
    last_used: u64,
}

/// What a lookup found for one prompt.
#[derive(Debug, Default)]
pub(crate) struct Found {
    /// Shared pages whose every token matches, in prompt order.
    pub(crate) full: Vec<PageRef>,
    /// A shared page whose first `n` tokens continue the match (copied, not
    /// shared: the request writes the rest).
    pub(crate) partial: Option<(PageRef, usize)>,
}

impl Found {
    /// Prompt positions the match covers.
    pub(crate) fn tokens(&self, page_size: usize) -> usize {
        self.full.len() * page_size + self.partial.map_or(0, |(_, slots)| slots)
    }

    /// Cuts the match to its first `tokens` positions (no more than it
    /// covers): what every layer group of a lease holds alike. A whole page
    /// past the cut becomes the page copied from.
    pub(crate) fn truncate(&mut self, tokens: usize, page_size: usize) {
        assert!(
            tokens <= self.tokens(page_size),
            "a match is cut, never lengthened"
        );
        let (full, rest) = (tokens / page_size, tokens % page_size);
        if self.full.len() > full {
            let source = self.full[full];
            self.full.truncate(full);
            self.partial = (rest > 0).then_some((source, rest));
        } else {
            self.partial = self
                .partial
                .filter(|_| rest > 0)
                .map(|(page, _)| (page, rest));
        }
        assert_eq!(self.tokens(page_size), tokens, "the cut is exact");
    }
}

/// The prefix cache's bookkeeping; see the module docs.
pub(crate) struct CacheLedger {
    /// Shared pages a tenant (or the public namespace) may hold at most.
    quota_pages: usize,
    /// Prompt tokens a match in the public namespace must cover before it
    /// is taken.
    public_min_tokens: usize,
    /// Test hook: block hashes ignore token values.
    weak_hashes: bool,
    entries: HashMap<BlockHash, Entry>,
    /// Cached blocks by their parent, for matches that end inside a page.
    children: HashMap<BlockHash, Vec<BlockHash>>,
    pages: HashMap<PageId, SharedPage>,
    /// Zero-reader shared pages, least recently used first.
    idle: BTreeSet<(u64, PageId)>,
    by_tenant: HashMap<TenantTag, usize>,
    tick: u64,
}

impl CacheLedger {
    /// Prompt tokens a match in the public namespace must cover.
    pub(crate) fn public_min_tokens(&self) -> usize {
        self.public_min_tokens
    }

    pub(crate) fn new(quota_pages: usize, public_min_tokens: usize, weak_hashes: bool) -> Self {
        CacheLedger {
            quota_pages,
            public_min_tokens,
            weak_hashes,
            entries: HashMap::new(),
            children: HashMap::new(),
            pages: HashMap::new(),
            idle: BTreeSet::new(),
            by_tenant: HashMap::new(),
            tick: 0,
        }
    }

    pub(crate) fn weak_hashes(&self) -> bool {
        self.weak_hashes
    }

    /// Pages in `Shared`.
    pub(crate) fn shared_pages(&self) -> usize {
        self.pages.len()
    }

    /// Shared pages no lease reads: evictable.
    pub(crate) fn idle_pages(&self) -> usize {
        self.idle.len()
    }

    /// Shared pages of the public namespace: pinned, never evicted.
    pub(crate) fn pinned_pages(&self) -> usize {
        self.by_tenant.get(&TenantTag::Public).copied().unwrap_or(0)
    }

    /// How many leases read `page`, if it is shared.
    pub(crate) fn readers(&self, page: PageId) -> Option<u32> {
        self.pages.get(&page).map(|p| p.readers)
    }

    /// Whether `hash` names a block some shared page holds.
    pub(crate) fn holds(&self, hash: &BlockHash) -> bool {
        self.entries.contains_key(hash)
    }

    /// Whether `tenant` may seal one more page.
    pub(crate) fn under_quota(&self, tenant: TenantTag) -> bool {
        self.by_tenant.get(&tenant).copied().unwrap_or(0) < self.quota_pages
    }

    /// Whether `entry` (found under `hash`) may be resolved in namespace
    /// `ns`: its page still holds it, in the generation the entry names.
    fn resolves(&self, hash: &BlockHash, entry: &Entry, ns: NamespaceId) -> bool {
        if ns != entry.namespace {
            return false;
        }
        let Some(page) = self.pages.get(&entry.page.id) else {
            return false;
        };
        // Incident replay (j): an entry that outlived its page resolves to
        // whatever the page holds now.
        Mutation::StaleIndex.active() || page.hash == *hash
    }

    /// The longest cached prefix of `prompt` that `namespace` may read,
    /// leaving at least one token to compute. A tenant's prompt is looked
    /// up in the public namespace first, and the public match is taken only
    /// when it covers at least the public minimum; the tenant's own chain
    /// then goes on from the pages it took (its hashes run through their
    /// tokens, so what the tenant seals after them is keyed by the whole
    /// prefix). Tokens are compared on every hit; a hash alone is never
    /// trusted (I9).
    pub(crate) fn find(&self, namespace: &Namespace, prompt: &[u32], page_size: usize) -> Found {
        let limit = prompt.len().saturating_sub(1);
        let mut found = Found::default();
        let mut parent = namespace.root();
        if let Some(public) = namespace.public {
            let shared = self.walk(public, BlockHash(public.0), prompt, 0, limit, page_size);
            if shared.tokens(page_size) >= self.public_min_tokens.max(1) {
                for block in prompt.chunks_exact(page_size).take(shared.full.len()) {
                    parent = block_hash(parent, block, self.weak_hashes);
                }
                found = shared;
            }
        }
        let own = self.walk(
            namespace.id,
            parent,
            prompt,
            found.full.len(),
            limit,
            page_size,
        );
        if !own.full.is_empty() {
            found.full.extend(own.full);
            found.partial = own.partial;
        } else if own.partial.map(|(_, n)| n) > found.partial.map(|(_, n)| n) {
            found.partial = own.partial;
        }
        found
    }

    /// Leading tokens of `prompt` the public namespace `public` holds in
    /// whole pages, with no minimum and no token kept back: what an
    /// operator's start-up checks it sealed.
    pub(crate) fn public_tokens(
        &self,
        public: &Namespace,
        prompt: &[u32],
        page_size: usize,
    ) -> usize {
        let found = self.walk(public.id, public.root(), prompt, 0, prompt.len(), page_size);
        found.full.len() * page_size
    }

    /// The cached pages of namespace `ns` that continue `prompt` from page
    /// `first` on, whose chain there has reached `parent`: whole pages, then
    /// the best partial page, all within `limit` positions.
    /// A windowed layer group's cached pages for prefixes of `prompt`: for
    /// each whole block `k` below `limit` positions, the shared page
    /// `namespace`'s own chain holds for it (tokens compared, I9), or
    /// `None`. Unlike a lookup from the root, gaps are allowed: a window
    /// needs only the pages behind its end, which [`Found`]-style walks
    /// would not reach once earlier pages are evicted.
    pub(crate) fn window_pages(
        &self,
        namespace: &Namespace,
        prompt: &[u32],
        limit: usize,
        page_size: usize,
    ) -> Vec<Option<PageRef>> {
        let mut parent = namespace.root();
        prompt[..limit.min(prompt.len())]
            .chunks_exact(page_size)
            .map(|block| {
                let hash = block_hash(parent, block, self.weak_hashes);
                parent = hash;
                self.entries
                    .get(&hash)
                    .filter(|entry| {
                        self.resolves(&hash, entry, namespace.id)
                            && (Mutation::SkipTokenCompare.active() || *entry.tokens == *block)
                    })
                    .map(|entry| entry.page)
            })
            .collect()
    }

    fn walk(
        &self,
        ns: NamespaceId,
        mut parent: BlockHash,
        prompt: &[u32],
        first: usize,
        limit: usize,
        page_size: usize,
    ) -> Found {
        let mut found = Found::default();
        let mut next = first;
        for block in prompt.chunks_exact(page_size).skip(first) {
            if (next + 1) * page_size > limit {
                break;
            }
            let hash = block_hash(parent, block, self.weak_hashes);
            match self.entries.get(&hash) {
                Some(entry)
                    if self.resolves(&hash, entry, ns)
                        // Incident replay (i): a hash match taken as a hit.
                        && (Mutation::SkipTokenCompare.active() || *entry.tokens == *block) =>
                {
                    found.full.push(entry.page);
                    parent = hash;
                    next += 1;
                }
                _ => break,
            }
        }
        let start = next * page_size;
        let room = limit.saturating_sub(start);
        let rest = &prompt[start.min(prompt.len())..];
        found.partial = self
            .children
            .get(&parent)
            .into_iter()
            .flatten()
            .filter_map(|hash| {
                let entry = self.entries.get(hash)?;
                if !self.resolves(hash, entry, ns) {
                    return None;
                }
                let same = entry
                    .tokens
                    .iter()
                    .zip(rest)
                    .take_while(|(a, b)| a == b)
                    .count()
                    .min(room);
                (same > 0).then_some((entry.page, same))
            })
            .max_by_key(|&(page, same)| (same, std::cmp::Reverse(page.id)));
        found
    }

    /// How many of `pages` — shared pages one lease reads — become idle
    /// (evictable) once that lease stops reading them.
    pub(crate) fn idle_once_unread(&self, pages: &[PageRef]) -> usize {
        pages
            .iter()
            .filter(|page| {
                self.pages
                    .get(&page.id)
                    .is_some_and(|p| p.readers == 1 && p.tenant != TenantTag::Public)
            })
            .count()
    }

    /// One more lease reads `page`.
    pub(crate) fn add_reader(&mut self, page: PageId) {
        let shared = self
            .pages
            .get_mut(&page)
            .expect("I1: a page found in the index is shared");
        if shared.readers == 0 && shared.tenant != TenantTag::Public {
            let removed = self.idle.remove(&(shared.last_used, page));
            assert!(removed, "an unread shared page is idle");
        }
        shared.readers += 1;
    }

    /// A lease that read `page` is gone; at zero readers the page becomes
    /// evictable, most recently used last — unless it is public (pinned).
    pub(crate) fn remove_reader(&mut self, page: PageId) {
        self.tick += 1;
        let tick = self.tick;
        let shared = self
            .pages
            .get_mut(&page)
            .expect("I1: a lease's shared page stays shared while read");
        assert!(shared.readers > 0, "I1: reader count of {page} underflows");
        shared.readers -= 1;
        if shared.readers == 0 && shared.tenant != TenantTag::Public {
            shared.last_used = tick;
            self.idle.insert((tick, page));
        }
    }

    /// Records `page` as holding `tokens` (the block `hash`, after
    /// `parent`) for `namespace`, read by the one lease that sealed it.
    pub(crate) fn insert(
        &mut self,
        namespace: &Namespace,
        page: PageRef,
        hash: BlockHash,
        parent: BlockHash,
        tokens: &[u32],
    ) {
        let previous = self.entries.insert(
            hash,
            Entry {
                page,
                namespace: namespace.id(),
                tokens: tokens.into(),
            },
        );
        assert!(
            previous.is_none(),
            "a block is sealed into one page at a time"
        );
        self.children.entry(parent).or_default().push(hash);
        let previous = self.pages.insert(
            page.id,
            SharedPage {
                hash,
                parent,
                tenant: namespace.tenant(),
                readers: 1,
                last_used: self.tick,
            },
        );
        assert!(previous.is_none(), "I1: page {page} was sealed twice");
        *self.by_tenant.entry(namespace.tenant()).or_default() += 1;
    }

    /// Chooses an idle page to evict: `tenant`'s least recently used one,
    /// or, with `None`, the least recently used one of the tenant that holds
    /// the most shared pages — so a tenant that floods the cache evicts
    /// its own entries before anyone else's. Public pages are never idle,
    /// so never chosen.
    pub(crate) fn victim(&self, tenant: Option<TenantTag>) -> Option<PageId> {
        let tenant = match tenant {
            Some(tenant) => tenant,
            None => self
                .idle
                .iter()
                .map(|(_, id)| self.pages[id].tenant)
                .max_by_key(|t| (self.by_tenant.get(t).copied().unwrap_or(0), *t))?,
        };
        self.idle
            .iter()
            .map(|&(_, id)| id)
            .find(|id| self.pages[id].tenant == tenant)
    }

    /// Forgets idle `page` and its index entry; the caller frees the page.
    pub(crate) fn evict(&mut self, page: PageId) {
        let shared = self.pages.remove(&page).expect("a victim is shared");
        assert_eq!(shared.readers, 0, "I1: evicting {page} while it is read");
        assert_ne!(
            shared.tenant,
            TenantTag::Public,
            "public page {page} is pinned"
        );
        let removed = self.idle.remove(&(shared.last_used, page));
        assert!(removed, "an unread shared page is idle");
        let count = self
            .by_tenant
            .get_mut(&shared.tenant)
            .expect("a shared page's tenant is counted");
        *count -= 1;
        if *count == 0 {
            self.by_tenant.remove(&shared.tenant);
        }
        // Incident replay (j): the entry stays, naming a page that is no
        // longer what it says.
        if Mutation::StaleIndex.active() {
            return;
        }
        self.entries.remove(&shared.hash);
        if let Some(siblings) = self.children.get_mut(&shared.parent) {
            siblings.retain(|h| *h != shared.hash);
            if siblings.is_empty() {
                self.children.remove(&shared.parent);
            }
        }
    }
}
