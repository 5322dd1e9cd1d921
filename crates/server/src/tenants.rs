//! Tenants (I9): who is calling, decided by the API key the gateway sees,
//! never by a field the client sets; and each tenant's limits.
//!
//! Keys are stored only as SHA-256 digests. A tenant's concurrency limit
//! counts sequences, not HTTP requests: a request holds one permit per
//! sequence it runs (`n` choices of each of its prompts) for its whole
//! life, so `n`, `best_of` and prompt batches cannot multiply a tenant's
//! share of the workers.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use rand::Rng;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use kvfence_engine::Share;

use crate::error::{ApiError, ErrorType, ServerError};

/// One tenant and its limits.
#[derive(Debug)]
pub struct Tenant {
    /// Name used in logs and metrics.
    pub name: String,
    /// Largest `max_tokens` a request may ask for, if limited.
    pub max_tokens: Option<usize>,
    /// Its share of every worker against other tenants with work (I11):
    /// compute is split in proportion to weights.
    pub weight: u32,
    max_concurrent: usize,
    permits: Arc<Semaphore>,
}

impl Tenant {
    fn new(name: String, max_concurrent: usize, max_tokens: Option<usize>, weight: u32) -> Self {
        Tenant {
            name,
            max_tokens,
            weight,
            max_concurrent,
            permits: Arc::new(Semaphore::new(max_concurrent)),
        }
    }

    /// A slot for one more sequence, taken before a request's body is
    /// read, or 429.
    pub fn admit(&self) -> Result<OwnedSemaphorePermit, ApiError> {
        Arc::clone(&self.permits)
            .try_acquire_owned()
            .map_err(|_| self.at_limit())
    }

    /// Grows a request's `permit` (one sequence, from
    /// [`Tenant::admit`]) to `sequences` slots: 400 if the tenant's limit
    /// can never hold that many, 429 if it cannot now.
    pub fn admit_sequences(
        &self,
        permit: &mut OwnedSemaphorePermit,
        sequences: usize,
    ) -> Result<(), ApiError> {
        debug_assert_eq!(permit.num_permits(), 1, "a request's first slot");
        if sequences > self.max_concurrent {
            return Err(ApiError::invalid(
                "n",
                format!(
                    "the request runs {sequences} sequences (n choices of each prompt); this tenant may run {} at once",
                    self.max_concurrent
                ),
            ));
        }
        let more = u32::try_from(sequences.saturating_sub(1)).map_err(|_| self.at_limit())?;
        if more > 0 {
            let extra = Arc::clone(&self.permits)
                .try_acquire_many_owned(more)
                .map_err(|_| self.at_limit())?;
            permit.merge(extra);
        }
        Ok(())
    }

    fn at_limit(&self) -> ApiError {
        ApiError::new(
            ErrorType::RateLimitError,
            "tenant_concurrency_limit",
            format!(
                "tenant {} already runs {} sequences, its limit",
                self.name, self.max_concurrent
            ),
        )
    }
}

/// Everyone the server will serve.
#[derive(Debug)]
pub enum Tenants {
    /// No tenants file: one unauthenticated `local` tenant (loopback only).
    Local(Arc<Tenant>),
    /// Tenants by SHA-256 of their key.
    Keyed(HashMap<[u8; 32], Arc<Tenant>>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantsFile {
    #[serde(default)]
    tenants: Vec<TenantEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantEntry {
    name: String,
    key_sha256: String,
    #[serde(default = "default_concurrency")]
    max_concurrent: usize,
    max_tokens: Option<usize>,
    /// Share of the workers against other tenants; every tenant's is 1
    /// unless the file says otherwise.
    #[serde(default = "default_weight")]
    weight: u32,
}

fn default_weight() -> u32 {
    1
}

fn default_concurrency() -> usize {
    16
}

/// Requests in flight at once in local mode.
const LOCAL_CONCURRENCY: usize = 1024;

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn parse_hex(text: &str) -> Option<[u8; 32]> {
    if text.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

impl Tenants {
    /// Local mode.
    pub fn local() -> Tenants {
        Tenants::Local(Arc::new(Tenant::new(
            "local".into(),
            LOCAL_CONCURRENCY,
            None,
            1,
        )))
    }

    /// Reads a tenants file (TOML, `[[tenants]]` tables).
    pub fn from_file(path: &Path) -> Result<Tenants, ServerError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ServerError::Io {
            path: shown.clone(),
            source,
        })?;
        Self::from_toml(&text, &shown)
    }

    /// Parses tenants TOML; `origin` is named in errors.
    pub fn from_toml(text: &str, origin: &str) -> Result<Tenants, ServerError> {
        let bad = |reason: String| ServerError::TenantsConfig {
            path: origin.to_string(),
            reason,
        };
        let file: TenantsFile = toml::from_str(text).map_err(|e| bad(e.to_string()))?;
        if file.tenants.is_empty() {
            return Err(bad("no [[tenants]] defined".into()));
        }
        let mut keyed = HashMap::new();
        let mut names = std::collections::HashSet::new();
        for entry in file.tenants {
            let hash = parse_hex(&entry.key_sha256.to_ascii_lowercase()).ok_or_else(|| {
                bad(format!(
                    "tenant {:?}: key_sha256 must be 64 hex digits",
                    entry.name
                ))
            })?;
            if entry.max_concurrent == 0 {
                return Err(bad(format!(
                    "tenant {:?}: max_concurrent must be at least 1",
                    entry.name
                )));
            }
            if !(1..=Share::MAX_WEIGHT).contains(&entry.weight) {
                return Err(bad(format!(
                    "tenant {:?}: weight must be between 1 and {}",
                    entry.name,
                    Share::MAX_WEIGHT
                )));
            }
            if !names.insert(entry.name.clone()) {
                return Err(bad(format!("tenant {:?} is defined twice", entry.name)));
            }
            let tenant = Arc::new(Tenant::new(
                entry.name.clone(),
                entry.max_concurrent,
                entry.max_tokens,
                entry.weight,
            ));
            if keyed.insert(hash, tenant).is_some() {
                return Err(bad(format!(
                    "tenant {:?} shares its key with another tenant",
                    entry.name
                )));
            }
        }
        Ok(Tenants::Keyed(keyed))
    }

    /// Whether this is local mode.
    pub fn is_local(&self) -> bool {
        matches!(self, Tenants::Local(_))
    }

    /// The tenant an `Authorization` header value names, or 401.
    pub fn authenticate(&self, authorization: Option<&str>) -> Result<Arc<Tenant>, ApiError> {
        let keyed = match self {
            Tenants::Local(tenant) => return Ok(Arc::clone(tenant)),
            Tenants::Keyed(keyed) => keyed,
        };
        let unauthorized = |message: &str| {
            ApiError::new(ErrorType::AuthenticationError, "invalid_api_key", message)
        };
        let key = authorization
            .and_then(|h| h.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .ok_or_else(|| unauthorized("missing API key: send 'Authorization: Bearer <key>'"))?;
        keyed
            .get(&digest(key))
            .cloned()
            .ok_or_else(|| unauthorized("invalid API key"))
    }
}

/// A new random API key and the tenants-file lines that admit it.
pub fn new_tenant(
    name: &str,
    max_concurrent: usize,
    max_tokens: Option<usize>,
    weight: u32,
) -> (String, String) {
    let secret: [u8; 24] = rand::rng().random();
    let key = format!("kvf-{}", hex(&secret));
    let mut lines = format!(
        "[[tenants]]\nname = {}\nkey_sha256 = \"{}\"\nmax_concurrent = {max_concurrent}\n",
        toml_string(name),
        hex(&digest(&key))
    );
    if let Some(limit) = max_tokens {
        lines.push_str(&format!("max_tokens = {limit}\n"));
    }
    if weight != 1 {
        lines.push_str(&format!("weight = {weight}\n"));
    }
    (key, lines)
}

fn toml_string(s: &str) -> String {
    serde_json::to_string(s).expect("a string always serialises")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generated_key_authenticates_against_its_printed_config() {
        let (key, lines) = new_tenant("acme \"corp\"", 2, Some(100), 3);
        let tenants = Tenants::from_toml(&lines, "t.toml").unwrap();
        let tenant = tenants
            .authenticate(Some(&format!("Bearer {key}")))
            .unwrap();
        assert_eq!(tenant.name, "acme \"corp\"");
        assert_eq!(tenant.max_tokens, Some(100));
        assert_eq!(tenant.weight, 3);
        let a = tenant.admit().unwrap();
        let _b = tenant.admit().unwrap();
        assert_eq!(tenant.admit().unwrap_err().status(), 429);
        drop(a);
        assert!(tenant.admit().is_ok(), "a finished request frees its slot");
    }

    #[test]
    fn the_concurrency_limit_counts_sequences_not_requests() {
        let (key, lines) = new_tenant("a", 4, None, 1);
        let tenants = Tenants::from_toml(&lines, "t.toml").unwrap();
        let tenant = tenants
            .authenticate(Some(&format!("Bearer {key}")))
            .unwrap();
        // n = 3: three of the four slots.
        let mut three = tenant.admit().unwrap();
        tenant.admit_sequences(&mut three, 3).unwrap();
        // Another request of n = 2 does not fit beside it now: 429, and the
        // slot it took first is its to give back.
        let mut two = tenant.admit().unwrap();
        assert_eq!(
            tenant.admit_sequences(&mut two, 2).unwrap_err().status(),
            429
        );
        drop(two);
        // n = 5 can never fit a limit of 4: 400 naming the field.
        let mut five = tenant.admit().unwrap();
        let never = tenant.admit_sequences(&mut five, 5).unwrap_err();
        assert_eq!(never.status(), 400);
        assert_eq!(never.param.as_deref(), Some("n"));
        drop((three, five));
        let mut four = tenant.admit().unwrap();
        tenant.admit_sequences(&mut four, 4).unwrap();
        assert_eq!(tenant.admit().unwrap_err().status(), 429);
    }

    #[test]
    fn weights_default_to_one_and_must_be_positive() {
        let (_, lines) = new_tenant("a", 1, None, 1);
        assert!(!lines.contains("weight"), "the default is not written");
        let Tenants::Keyed(keyed) = Tenants::from_toml(&lines, "t").unwrap() else {
            panic!("keyed tenants")
        };
        assert_eq!(keyed.values().next().unwrap().weight, 1);
        let zero = format!("{lines}weight = 0\n");
        let err = Tenants::from_toml(&zero, "t.toml").unwrap_err();
        assert!(err.to_string().contains("weight"), "{err}");
    }

    #[test]
    fn i9_missing_or_wrong_keys_are_refused() {
        let (_, lines) = new_tenant("a", 1, None, 1);
        let tenants = Tenants::from_toml(&lines, "t.toml").unwrap();
        assert_eq!(tenants.authenticate(None).unwrap_err().status(), 401);
        assert_eq!(
            tenants
                .authenticate(Some("Bearer nope"))
                .unwrap_err()
                .status(),
            401
        );
        assert_eq!(
            tenants
                .authenticate(Some("Basic abc"))
                .unwrap_err()
                .status(),
            401
        );
    }

    #[test]
    fn malformed_tenant_files_are_rejected_with_the_file_name() {
        for text in [
            "",
            "[[tenants]]\nname='a'\nkey_sha256='xyz'\n",
            "[[tenants]]\nname='a'\nkey_sha256='00'\nextra=1\n",
        ] {
            let err = Tenants::from_toml(text, "conf/t.toml").unwrap_err();
            assert!(err.to_string().contains("conf/t.toml"), "{err}");
        }
        let (_, one) = new_tenant("a", 1, None, 1);
        let twice = format!("{one}{one}");
        assert!(Tenants::from_toml(&twice, "t").is_err());
    }
}
