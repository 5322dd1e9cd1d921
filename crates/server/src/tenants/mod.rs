//! Tenants (I9): who is calling, decided by the API key the gateway sees,
//! never by a field the client sets; and what each tenant may spend (I11).
//!
//! Keys are stored only as SHA-256 digests; a tenant may have several, so a
//! key rotates without downtime (add the new one, move clients, remove the
//! old). The tenants file is read again on SIGHUP and when it changes
//! ([`Tenants::watch`]): a removed key stops at once, requests in flight
//! finish, what each tenant holds carries over by name, and a file that
//! does not parse leaves the one in force and says why.

mod file;
mod spend;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use rand::Rng;
use sha2::{Digest, Sha256};
use tracing::{info, warn};

use crate::error::{ApiError, ErrorType, ServerError};
pub(crate) use file::PRIORITY_RANGE;
use file::TenantsFile;
pub use spend::{Admission, Limits};
use spend::{Gate, Spent};

/// One tenant and its limits.
#[derive(Debug)]
pub struct Tenant {
    /// Name used in logs and metrics.
    pub name: String,
    /// Its share of every worker against other tenants with work (I11):
    /// compute is split in proportion to weights.
    pub weight: u32,
    limits: Limits,
    spent: Arc<Spent>,
}

impl Tenant {
    fn gate(&self) -> Gate<'_> {
        Gate {
            name: &self.name,
            limits: &self.limits,
            spent: &self.spent,
        }
    }

    /// The tenant's limits.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// One sequence and one request, taken before a request's body is
    /// read, or 429 (concurrency, requests or tokens per minute).
    pub fn admit(&self) -> Result<Admission, ApiError> {
        self.gate().admit(Instant::now())
    }

    /// Grows a request's `admission` (one sequence, from
    /// [`Tenant::admit`]) to `sequences`: 400 if the tenant's limit can
    /// never hold that many, 429 if it cannot now.
    pub fn admit_sequences(
        &self,
        admission: &mut Admission,
        sequences: usize,
    ) -> Result<(), ApiError> {
        self.gate().admit_sequences(admission, sequences)
    }

    /// Charges a request's most tokens (prompts, and `max_tokens` for each
    /// choice) to the tenant's tokens per minute, before any engine work.
    pub fn charge(&self, admission: &mut Admission, tokens: u64) -> Result<(), ApiError> {
        self.gate().charge(admission, tokens, Instant::now())
    }

    /// Adds the `x-ratelimit-*` headers of the tenant's rates, if it has any.
    pub fn rate_headers(&self, headers: &mut HeaderMap) {
        self.gate().rate_headers(headers, Instant::now());
    }

    /// The priority a request runs at: the lowest of what was `asked`
    /// (each with the field or header that asked) — so work the gateway
    /// marks sheddable stays sheddable whatever the body says —, or if
    /// nothing was, 0 (the tenant's `max_priority` where that is lower: a
    /// tenant kept to sheddable work sends it by default); 400 naming what
    /// asked if above what the tenant may use.
    pub fn priority(&self, asked: &[(i32, &str)]) -> Result<i32, ApiError> {
        let Some(&(priority, param)) = asked.iter().min_by_key(|(p, _)| *p) else {
            return Ok(self.limits.max_priority.min(0));
        };
        if priority > self.limits.max_priority {
            return Err(ApiError::invalid(
                param,
                format!(
                    "priority {priority} is above what tenant {} may use ({})",
                    self.name, self.limits.max_priority
                ),
            ));
        }
        Ok(priority)
    }

    /// Sequences the tenant runs now.
    pub fn sequences(&self) -> usize {
        self.spent.sequences()
    }
}

/// Everyone the server serves, as the tenants file says now.
#[derive(Debug)]
enum Directory {
    /// No tenants file: one unauthenticated `local` tenant (loopback only).
    Local(Arc<Tenant>),
    /// Tenants by SHA-256 of each of their keys, and the named objectives
    /// (`x-gateway-inference-objective`) with their priorities.
    Keyed {
        keys: HashMap<[u8; 32], Arc<Tenant>>,
        objectives: BTreeMap<String, i32>,
    },
}

/// Who may call, kept current with the tenants file.
#[derive(Debug)]
pub struct Tenants {
    directory: RwLock<Arc<Directory>>,
    source: Option<Source>,
}

/// The file tenants come from, and the digest of its text last read (good
/// or bad), so an unchanged file is not parsed again nor its fault logged
/// twice.
#[derive(Debug)]
struct Source {
    path: PathBuf,
    read: Mutex<[u8; 32]>,
}

/// What reading the tenants file again did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reload {
    /// The file is as it was last read.
    Unchanged,
    /// The new file is in force.
    Applied {
        /// Tenants defined.
        tenants: usize,
        /// Keys that authenticate.
        keys: usize,
    },
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Tenants {
    /// Local mode.
    pub fn local() -> Tenants {
        let tenant = Tenant {
            name: "local".into(),
            weight: 1,
            limits: Limits::local(),
            spent: Arc::default(),
        };
        Tenants {
            directory: RwLock::new(Arc::new(Directory::Local(Arc::new(tenant)))),
            source: None,
        }
    }

    /// Reads a tenants file (TOML, `[[tenants]]` tables), and keeps
    /// reading it when [`Tenants::watch`] runs.
    pub fn from_file(path: &Path) -> Result<Tenants, ServerError> {
        let text = read(path)?;
        let directory = Self::parse(&text, &path.display().to_string(), &|_| None)?;
        Ok(Tenants {
            directory: RwLock::new(Arc::new(directory)),
            source: Some(Source {
                path: path.to_path_buf(),
                read: Mutex::new(Sha256::digest(text.as_bytes()).into()),
            }),
        })
    }

    /// Parses tenants TOML; `origin` is named in errors. Never reloaded.
    pub fn from_toml(text: &str, origin: &str) -> Result<Tenants, ServerError> {
        Ok(Tenants {
            directory: RwLock::new(Arc::new(Self::parse(text, origin, &|_| None)?)),
            source: None,
        })
    }

    /// The directory `text` defines; a tenant `held` knows by name keeps
    /// what it spent.
    fn parse(
        text: &str,
        origin: &str,
        held: &dyn Fn(&str) -> Option<Arc<Spent>>,
    ) -> Result<Directory, ServerError> {
        let file = TenantsFile::parse(text).map_err(|reason| ServerError::TenantsConfig {
            path: origin.to_string(),
            reason,
        })?;
        let mut keys = HashMap::new();
        for entry in file.tenants {
            let tenant = Arc::new(Tenant {
                spent: held(&entry.name).unwrap_or_default(),
                name: entry.name,
                weight: entry.weight,
                limits: entry.limits,
            });
            for key in entry.keys {
                keys.insert(key, Arc::clone(&tenant));
            }
        }
        Ok(Directory::Keyed {
            keys,
            objectives: file.objectives,
        })
    }

    fn current(&self) -> Arc<Directory> {
        // Replaced whole under the lock, so never seen half written.
        Arc::clone(&self.directory.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// Tenants defined (local mode is one).
    pub fn count(&self) -> usize {
        match &*self.current() {
            Directory::Local(_) => 1,
            Directory::Keyed { keys, .. } => keys
                .values()
                .map(|tenant| tenant.name.as_str())
                .collect::<std::collections::BTreeSet<_>>()
                .len(),
        }
    }

    /// Whether this is local mode.
    pub fn is_local(&self) -> bool {
        matches!(*self.current(), Directory::Local(_))
    }

    /// The tenant an `Authorization` header value names, or 401. The
    /// scheme is case-insensitive (RFC 9110).
    pub fn authenticate(&self, authorization: Option<&str>) -> Result<Arc<Tenant>, ApiError> {
        let directory = self.current();
        let keys = match &*directory {
            Directory::Local(tenant) => return Ok(Arc::clone(tenant)),
            Directory::Keyed { keys, .. } => keys,
        };
        let unauthorized = |message: &str| {
            ApiError::new(ErrorType::AuthenticationError, "invalid_api_key", message)
        };
        let key = authorization
            .and_then(|h| h.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, key)| key.trim())
            .filter(|k| !k.is_empty())
            .ok_or_else(|| unauthorized("missing API key: send 'Authorization: Bearer <key>'"))?;
        keys.get(&digest(key))
            .cloned()
            .ok_or_else(|| unauthorized("invalid API key"))
    }

    /// The priority of the objective the gateway named, or 400 for a name
    /// the tenants file does not define.
    pub fn objective(&self, name: &str) -> Result<i32, ApiError> {
        let unknown = || {
            ApiError::invalid(
                "x-gateway-inference-objective",
                "the inference objective is not defined in the tenants file's [objectives]",
            )
        };
        match &*self.current() {
            Directory::Local(_) => Err(unknown()),
            Directory::Keyed { objectives, .. } => {
                objectives.get(name).copied().ok_or_else(unknown)
            }
        }
    }

    /// Reads the tenants file again: a new one is in force for every
    /// request from now on (keys it no longer has stop at once; requests
    /// in flight finish); tenants keep what they hold by name. `force`
    /// parses even a file whose text was read before. A file that cannot
    /// be read or parsed leaves the one in force.
    pub fn reload(&self, force: bool) -> Result<Reload, ServerError> {
        let Some(source) = &self.source else {
            return Ok(Reload::Unchanged);
        };
        let text = read(&source.path)?;
        let fingerprint: [u8; 32] = Sha256::digest(text.as_bytes()).into();
        {
            let mut read = source.read.lock().unwrap_or_else(|p| p.into_inner());
            if *read == fingerprint && !force {
                return Ok(Reload::Unchanged);
            }
            *read = fingerprint;
        }
        let old = self.current();
        let held = |name: &str| match &*old {
            Directory::Local(_) => None,
            Directory::Keyed { keys, .. } => keys
                .values()
                .find(|t| t.name == name)
                .map(|t| Arc::clone(&t.spent)),
        };
        let directory = Self::parse(&text, &source.path.display().to_string(), &held)?;
        let Directory::Keyed { keys, .. } = &directory else {
            unreachable!("a tenants file defines keyed tenants")
        };
        let mut names: Vec<&str> = keys.values().map(|t| t.name.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        let applied = Reload::Applied {
            tenants: names.len(),
            keys: keys.len(),
        };
        *self.directory.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(directory);
        Ok(applied)
    }

    /// Keeps the tenants file in force: reads it again on SIGHUP and when
    /// its text changes (looked at every `every`), on a blocking thread —
    /// a file system that stalls (a network mount) holds up the reload,
    /// never the async runtime's threads. Runs until dropped; returns at
    /// once in local mode.
    pub async fn watch(self: Arc<Self>, every: Duration) {
        let Some(source) = &self.source else { return };
        #[cfg(unix)]
        let mut hangup =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            #[cfg(unix)]
            let hangup_received = async {
                match hangup.as_mut() {
                    Some(signal) => signal.recv().await,
                    None => std::future::pending().await,
                }
            };
            #[cfg(not(unix))]
            let hangup_received = std::future::pending::<Option<()>>();
            let force = tokio::select! {
                _ = hangup_received => true,
                _ = tick.tick() => false,
            };
            let reloaded = tokio::task::spawn_blocking({
                let tenants = Arc::clone(&self);
                move || tenants.reload(force)
            })
            .await;
            let Ok(reloaded) = reloaded else {
                warn!("reading the tenants file failed; the previous one stays in force");
                continue;
            };
            match reloaded {
                Ok(Reload::Unchanged) if force => {
                    info!(file = %source.path.display(), "SIGHUP: tenants file unchanged");
                }
                Ok(Reload::Unchanged) => {}
                Ok(Reload::Applied { tenants, keys }) => {
                    info!(file = %source.path.display(), tenants, keys, "tenants file reloaded");
                }
                Err(error) => {
                    warn!(%error, "tenants file not reloaded; the previous one stays in force");
                }
            }
        }
    }
}

fn read(path: &Path) -> Result<String, ServerError> {
    std::fs::read_to_string(path).map_err(|error| ServerError::Io {
        path: path.display().to_string(),
        error,
    })
}

/// A new random API key and its SHA-256, as the tenants file writes it.
pub fn new_key() -> (String, String) {
    let secret: [u8; 24] = rand::rng().random();
    let key = format!("kvf-{}", hex(&secret));
    let hash = hex(&digest(&key));
    (key, hash)
}

/// A new random API key and the tenants-file lines that admit it with
/// `limits` and `weight` (limits left at their defaults are not written);
/// an error, saying why, where a server would refuse those lines.
pub fn new_tenant(
    name: &str,
    limits: &Limits,
    weight: u32,
) -> Result<(String, String), ServerError> {
    let (key, hash) = new_key();
    let mut lines = format!(
        "[[tenants]]\nname = {}\nkey_sha256 = \"{hash}\"\nmax_concurrent = {}\n",
        toml_string(name),
        limits.max_concurrent,
    );
    let optional = [
        ("max_tokens", limits.max_tokens.map(|n| n as u64)),
        ("requests_per_minute", limits.requests_per_minute),
        ("tokens_per_minute", limits.tokens_per_minute),
    ];
    for (field, value) in optional {
        if let Some(value) = value {
            lines.push_str(&format!("{field} = {value}\n"));
        }
    }
    if weight != 1 {
        lines.push_str(&format!("weight = {weight}\n"));
    }
    if limits.max_priority != 0 {
        lines.push_str(&format!("max_priority = {}\n", limits.max_priority));
    }
    // Checked as the server will read them.
    TenantsFile::parse(&lines).map_err(|reason| ServerError::TenantRefused {
        name: name.to_string(),
        reason,
    })?;
    Ok((key, lines))
}

fn toml_string(s: &str) -> String {
    serde_json::to_string(s).expect("a string always serialises")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_concurrent: usize, max_tokens: Option<usize>) -> Limits {
        Limits {
            max_concurrent,
            max_tokens,
            ..Limits::local()
        }
    }

    #[test]
    fn a_generated_key_authenticates_against_its_printed_config() {
        let written = Limits {
            requests_per_minute: Some(60),
            tokens_per_minute: Some(9000),
            max_priority: 3,
            ..limits(2, Some(100))
        };
        let (key, lines) = new_tenant("acme \"corp\"", &written, 3).unwrap();
        let tenants = Tenants::from_toml(&lines, "t.toml").unwrap();
        let tenant = tenants
            .authenticate(Some(&format!("Bearer {key}")))
            .unwrap();
        assert_eq!(tenant.name, "acme \"corp\"");
        assert_eq!(tenant.limits(), &written);
        assert_eq!(tenant.weight, 3);
        let a = tenant.admit().unwrap();
        let _b = tenant.admit().unwrap();
        assert_eq!(tenant.admit().unwrap_err().status(), 429);
        drop(a);
        assert!(tenant.admit().is_ok(), "a finished request frees its slot");
    }

    #[test]
    fn the_concurrency_limit_counts_sequences_not_requests() {
        let (key, lines) = new_tenant("a", &limits(4, None), 1).unwrap();
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
        let (key, lines) = new_tenant("a", &limits(1, None), 1).unwrap();
        assert!(!lines.contains("weight"), "the default is not written");
        let tenants = Tenants::from_toml(&lines, "t").unwrap();
        let tenant = tenants
            .authenticate(Some(&format!("Bearer {key}")))
            .unwrap();
        assert_eq!(tenant.weight, 1);
        let zero = format!("{lines}weight = 0\n");
        let err = Tenants::from_toml(&zero, "t.toml").unwrap_err();
        assert!(err.to_string().contains("weight"), "{err}");
    }

    fn bearer(key: &str) -> String {
        format!("Bearer {key}")
    }

    #[test]
    fn a_tenant_with_two_keys_answers_to_both_as_one_tenant() {
        let ((old, old_hash), (new, new_hash)) = (new_key(), new_key());
        let text = format!(
            "[[tenants]]\nname = 'a'\nkey_sha256 = ['{old_hash}', '{new_hash}']\nmax_concurrent = 2\n"
        );
        let tenants = Tenants::from_toml(&text, "t").unwrap();
        let by_old = tenants.authenticate(Some(&bearer(&old))).unwrap();
        let by_new = tenants.authenticate(Some(&bearer(&new))).unwrap();
        assert!(
            Arc::ptr_eq(&by_old, &by_new),
            "one tenant, one set of limits"
        );
        let _a = by_old.admit().unwrap();
        let _b = by_new.admit().unwrap();
        assert_eq!(by_old.admit().unwrap_err().status(), 429);
        let twice = format!("[[tenants]]\nname = 'a'\nkey_sha256 = ['{old_hash}', '{old_hash}']\n");
        assert!(Tenants::from_toml(&twice, "t").is_err());
        let none = "[[tenants]]\nname = 'a'\nkey_sha256 = []\n";
        assert!(Tenants::from_toml(none, "t").is_err());
    }

    #[cfg(unix)]
    #[test]
    fn a_tenants_file_that_stalls_holds_up_no_other_task() {
        // A network mount that stops answering, as a FIFO nobody writes
        // to: opening it blocks. The watcher reads on a blocking thread,
        // so the runtime's own thread (here the only one) goes on.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tenants.toml");
        let (_, hash) = new_key();
        std::fs::write(
            &path,
            format!("[[tenants]]\nname = 'a'\nkey_sha256 = ['{hash}']\n"),
        )
        .unwrap();
        let tenants = Arc::new(Tenants::from_file(&path).unwrap());
        std::fs::remove_file(&path).unwrap();
        let made = std::process::Command::new("mkfifo")
            .arg(&path)
            .status()
            .unwrap();
        assert!(made.success(), "mkfifo");
        let (went_on, did) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                tokio::spawn(tenants.watch(Duration::from_millis(5)));
                // Long enough for the watcher to have tried the file.
                tokio::time::sleep(Duration::from_millis(100)).await;
                let _ = went_on.send(());
            });
            runtime.shutdown_background();
        });
        let outcome = did.recv_timeout(Duration::from_secs(10));
        // Let the stalled open return: a writer comes and goes.
        drop(std::fs::OpenOptions::new().write(true).open(&path));
        outcome.expect("the runtime went on while the tenants file stalled");
    }

    #[test]
    fn a_reload_rotates_keys_keeps_what_tenants_hold_and_survives_a_bad_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tenants.toml");
        let ((old, old_hash), (new, new_hash)) = (new_key(), new_key());
        let file = |keys: &str, concurrent: usize| {
            format!(
                "[[tenants]]\nname = 'a'\nkey_sha256 = [{keys}]\nmax_concurrent = {concurrent}\n"
            )
        };
        std::fs::write(&path, file(&format!("'{old_hash}'"), 2)).unwrap();
        let tenants = Tenants::from_file(&path).unwrap();
        let before = tenants.authenticate(Some(&bearer(&old))).unwrap();
        let in_flight = before.admit().unwrap();
        assert_eq!(tenants.reload(false).unwrap(), Reload::Unchanged);

        // The new key is added, the old one removed, the limit lowered to 1.
        std::fs::write(&path, file(&format!("'{new_hash}'"), 1)).unwrap();
        assert_eq!(
            tenants.reload(false).unwrap(),
            Reload::Applied {
                tenants: 1,
                keys: 1
            }
        );
        assert_eq!(
            tenants
                .authenticate(Some(&bearer(&old)))
                .unwrap_err()
                .status(),
            401,
            "a removed key stops at once"
        );
        let after = tenants.authenticate(Some(&bearer(&new))).unwrap();
        assert_eq!(after.sequences(), 1, "the request in flight still counts");
        assert_eq!(after.admit().unwrap_err().status(), 429);
        drop(in_flight);
        let _next = after.admit().unwrap();

        // A broken file leaves the one in force, and is not parsed again
        // until it changes.
        std::fs::write(&path, "[[tenants]]\nname = ").unwrap();
        let err = tenants.reload(false).unwrap_err();
        assert!(err.to_string().contains("tenants.toml"), "{err}");
        assert_eq!(tenants.reload(false).unwrap(), Reload::Unchanged);
        assert!(tenants.authenticate(Some(&bearer(&new))).is_ok());
        std::fs::remove_file(&path).unwrap();
        assert!(tenants.reload(true).is_err(), "a missing file is an error");
        assert!(tenants.authenticate(Some(&bearer(&new))).is_ok());
    }

    #[test]
    fn objectives_name_priorities_and_tenants_are_capped() {
        let (key, lines) = new_tenant("a", &limits(1, None), 1).unwrap();
        let text = format!("[objectives]\nrealtime = 10\nbatch = -1\n\n{lines}max_priority = 5\n");
        let tenants = Tenants::from_toml(&text, "t").unwrap();
        assert_eq!(tenants.objective("batch").unwrap(), -1);
        assert_eq!(tenants.objective("other").unwrap_err().status(), 400);
        let tenant = tenants.authenticate(Some(&bearer(&key))).unwrap();
        assert_eq!(tenant.priority(&[]).unwrap(), 0);
        assert_eq!(tenant.priority(&[(-7, "priority")]).unwrap(), -7);
        assert_eq!(tenant.priority(&[(5, "priority")]).unwrap(), 5);
        // The gateway marked it sheddable: the body cannot raise it.
        assert_eq!(tenant.priority(&[(5, "priority"), (-1, "x")]).unwrap(), -1);
        let over = tenant.priority(&[(10, "priority")]).unwrap_err();
        assert_eq!(
            (over.status().as_u16(), over.param.as_deref()),
            (400, Some("priority"))
        );
        // A tenant kept to sheddable work sends it by default.
        let batch = format!("{lines}max_priority = -1\n");
        let tenants = Tenants::from_toml(&batch, "t").unwrap();
        let tenant = tenants.authenticate(Some(&bearer(&key))).unwrap();
        assert_eq!(tenant.priority(&[]).unwrap(), -1);
        assert_eq!(
            tenant.priority(&[(0, "priority")]).unwrap_err().status(),
            400
        );
        let huge = format!("[objectives]\nx = 9999999999\n\n{lines}");
        assert!(Tenants::from_toml(&huge, "t").is_err());
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        let (key, lines) = new_tenant("a", &limits(1, None), 1).unwrap();
        let tenants = Tenants::from_toml(&lines, "t").unwrap();
        for scheme in ["Bearer", "bearer", "BEARER"] {
            assert!(
                tenants
                    .authenticate(Some(&format!("{scheme} {key}")))
                    .is_ok()
            );
        }
    }

    #[test]
    fn i9_missing_or_wrong_keys_are_refused() {
        let (_, lines) = new_tenant("a", &limits(1, None), 1).unwrap();
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
        // A file that is not there: named, and the OS's reason said once in
        // the error's chain (as `Error: ... Caused by: ...` prints it).
        let err = Tenants::from_file(Path::new("/no/such/tenants.toml")).unwrap_err();
        assert!(
            err.to_string().starts_with("/no/such/tenants.toml: "),
            "{err}"
        );
        assert!(std::error::Error::source(&err).is_none(), "{err:?}");
        let (_, one) = new_tenant("a", &limits(1, None), 1).unwrap();
        let twice = format!("{one}{one}");
        assert!(Tenants::from_toml(&twice, "t").is_err());
        // Limits that would refuse every request, and a name no log line or
        // metric could show, are errors of the file, not of each request.
        let key = "0".repeat(64);
        for (text, says) in [
            (
                format!("[[tenants]]\nname='a'\nkey_sha256='{key}'\nmax_tokens=0\n"),
                "max_tokens must be at least 1",
            ),
            (
                format!("[[tenants]]\nname=''\nkey_sha256='{key}'\n"),
                "a tenant name is 1 to 64",
            ),
            (
                format!("[[tenants]]\nname=\"a\\nb\"\nkey_sha256='{key}'\n"),
                "tenant \"a\\nb\": a tenant name is 1 to 64",
            ),
        ] {
            let err = Tenants::from_toml(&text, "t").unwrap_err().to_string();
            assert!(err.contains(says), "{text}: {err}");
        }
        // `tenant add` never prints lines the server would refuse.
        for (name, limits, weight) in [
            ("", limits(1, None), 1),
            ("a", limits(0, None), 1),
            ("a", limits(1, Some(0)), 1),
            ("a", limits(1, None), 0),
        ] {
            let err = new_tenant(name, &limits, weight).unwrap_err().to_string();
            // The tenant is named once, as the file's check names it.
            let named = format!("tenant {name:?}: ");
            assert_eq!(err.matches(&named).count(), 1, "{err}");
        }
    }
}
