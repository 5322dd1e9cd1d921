//! The tenants file: TOML, checked whole before anything in it is used.
//!
//! ```toml
//! [objectives]              # x-gateway-inference-objective → priority
//! realtime = 10
//! batch = -1                # negative: sheddable
//!
//! [[tenants]]
//! name = "acme"
//! key_sha256 = ["<new key's digest>", "<old key's digest>"]   # or one string
//! max_concurrent = 16       # sequences at once
//! max_tokens = 4096         # per request
//! weight = 1                # share of every worker
//! requests_per_minute = 600
//! tokens_per_minute = 200000
//! max_priority = 0          # highest priority its requests may ask for
//! ```

use std::collections::{BTreeMap, HashSet};

use serde::Deserialize;

use super::spend::Limits;
use kvfence_engine::Share;

/// The highest and lowest priority an objective or a request may name.
pub(crate) const PRIORITY_RANGE: std::ops::RangeInclusive<i32> = -1_000_000..=1_000_000;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    #[serde(default)]
    tenants: Vec<RawTenant>,
    #[serde(default)]
    objectives: BTreeMap<String, i64>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawKeys {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTenant {
    name: String,
    key_sha256: RawKeys,
    #[serde(default = "default_concurrency")]
    max_concurrent: usize,
    max_tokens: Option<usize>,
    /// Share of the workers against other tenants; every tenant's is 1
    /// unless the file says otherwise.
    #[serde(default = "default_weight")]
    weight: u32,
    requests_per_minute: Option<u64>,
    tokens_per_minute: Option<u64>,
    #[serde(default)]
    max_priority: i64,
}

fn default_weight() -> u32 {
    1
}

fn default_concurrency() -> usize {
    16
}

/// One tenant, checked.
pub(crate) struct Entry {
    pub(crate) name: String,
    pub(crate) keys: Vec<[u8; 32]>,
    pub(crate) weight: u32,
    pub(crate) limits: Limits,
}

/// A whole tenants file, checked.
pub(crate) struct TenantsFile {
    pub(crate) tenants: Vec<Entry>,
    pub(crate) objectives: BTreeMap<String, i32>,
}

/// The longest tenant name, in characters.
const MAX_NAME_CHARS: usize = 64;

/// Whether `name` can name a tenant: not empty, not overlong, and nothing
/// that would break the line of a log or the label of a metric.
fn valid_name(name: &str) -> bool {
    (1..=MAX_NAME_CHARS).contains(&name.chars().count()) && !name.chars().any(char::is_control)
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

fn priority(value: i64, what: impl Fn() -> String) -> Result<i32, String> {
    i32::try_from(value)
        .ok()
        .filter(|p| PRIORITY_RANGE.contains(p))
        .ok_or_else(|| {
            format!(
                "{}: a priority must be between {} and {}",
                what(),
                PRIORITY_RANGE.start(),
                PRIORITY_RANGE.end()
            )
        })
}

impl TenantsFile {
    /// Parses and checks `text`; the error says what is wrong (never a
    /// key: the file holds digests only).
    pub(crate) fn parse(text: &str) -> Result<TenantsFile, String> {
        let raw: Raw = toml::from_str(text).map_err(|e| e.to_string())?;
        if raw.tenants.is_empty() {
            return Err("no [[tenants]] defined".into());
        }
        let mut names = HashSet::new();
        let mut digests = HashSet::new();
        let mut tenants = Vec::new();
        for entry in raw.tenants {
            let named = |what: &str| format!("tenant {:?}: {what}", entry.name);
            let listed = match entry.key_sha256 {
                RawKeys::One(key) => vec![key],
                RawKeys::Many(keys) => keys,
            };
            if listed.is_empty() {
                return Err(named("key_sha256 lists no key"));
            }
            let mut keys = Vec::new();
            for key in &listed {
                let digest = parse_hex(&key.to_ascii_lowercase())
                    .ok_or_else(|| named("key_sha256 must be 64 hex digits"))?;
                if !digests.insert(digest) {
                    return Err(named(
                        "a key is listed twice, or shared with another tenant",
                    ));
                }
                keys.push(digest);
            }
            if !valid_name(&entry.name) {
                return Err(named(&format!(
                    "a tenant name is 1 to {MAX_NAME_CHARS} characters, none of them a control \
                     character (it appears in logs, metrics and traces)"
                )));
            }
            if entry.max_concurrent == 0 {
                return Err(named("max_concurrent must be at least 1"));
            }
            if entry.max_tokens == Some(0) {
                return Err(named(
                    "max_tokens must be at least 1 (leave it out for no limit)",
                ));
            }
            if !(1..=Share::MAX_WEIGHT).contains(&entry.weight) {
                return Err(named(&format!(
                    "weight must be between 1 and {}",
                    Share::MAX_WEIGHT
                )));
            }
            for (field, rate) in [
                ("requests_per_minute", entry.requests_per_minute),
                ("tokens_per_minute", entry.tokens_per_minute),
            ] {
                if rate == Some(0) {
                    return Err(named(&format!(
                        "{field} must be at least 1 (leave it out for no limit)"
                    )));
                }
            }
            let max_priority = priority(entry.max_priority, || named("max_priority"))?;
            if !names.insert(entry.name.clone()) {
                return Err(named("defined twice"));
            }
            tenants.push(Entry {
                keys,
                weight: entry.weight,
                limits: Limits {
                    max_concurrent: entry.max_concurrent,
                    max_tokens: entry.max_tokens,
                    requests_per_minute: entry.requests_per_minute,
                    tokens_per_minute: entry.tokens_per_minute,
                    max_priority,
                },
                name: entry.name,
            });
        }
        let mut objectives = BTreeMap::new();
        for (name, value) in raw.objectives {
            let value = priority(value, || format!("objective {name:?}"))?;
            objectives.insert(name, value);
        }
        Ok(TenantsFile {
            tenants,
            objectives,
        })
    }
}
