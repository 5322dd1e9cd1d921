//! The two databases a response store runs on — SQLite (one file, one
//! process) and PostgreSQL (shared by a fleet's routers) — behind one
//! small interface: a transaction that runs a statement with text and
//! integer parameters and reads at most one row. The store's statements are
//! written once, in the SQL both speak (`$1`… parameters, numbered in order
//! of first use, which SQLite reads as names; `ON CONFLICT … DO UPDATE`;
//! `CAST(… AS BIGINT)`); what differs — the schema's types, how a row is
//! locked for an edit — is asked of the backend.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::error::ServerError;

/// How long one operation on the store may take, its wait for the store
/// included. Past it the operation is given up — rolled back if it got
/// that far — and its request is answered without it (`store: false`, or a
/// 503), so a database that stops answering costs a request this long at
/// most; and once an operation has held the store longer than this, the
/// next ones fail at once instead of queueing behind it (their blocking
/// threads, and the text-work slots of the requests that wait on them,
/// are everyone's).
pub(crate) const STORE_DEADLINE: Duration = Duration::from_secs(5);

/// A value bound to a statement: the store binds text and integers only.
#[derive(Debug, Clone, Copy)]
pub(super) enum Param<'a> {
    Text(&'a str),
    Int(i64),
}

/// One column of a row read back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Text,
    Int,
}

/// A value read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Cell {
    Text(String),
    Int(i64),
}

impl Cell {
    pub(super) fn text(self) -> Result<String, ServerError> {
        match self {
            Cell::Text(text) => Ok(text),
            Cell::Int(_) => Err(ServerError::StoredDamaged),
        }
    }

    pub(super) fn int(self) -> Result<i64, ServerError> {
        match self {
            Cell::Int(value) => Ok(value),
            Cell::Text(_) => Err(ServerError::StoredDamaged),
        }
    }
}

/// One transaction: everything run through it commits together, or not at
/// all (dropped uncommitted, it rolls back).
pub(super) trait Tx {
    /// Runs a statement; the rows it changed.
    fn run(&mut self, sql: &str, params: &[Param<'_>]) -> Result<u64, ServerError>;
    /// The first row a query returns, its columns read as `kinds`.
    fn row(
        &mut self,
        sql: &str,
        params: &[Param<'_>],
        kinds: &[Kind],
    ) -> Result<Option<Vec<Cell>>, ServerError>;
    /// What a `SELECT` adds to lock the rows it reads until the
    /// transaction ends (nothing where the whole database is locked).
    fn for_update(&self) -> &'static str;
}

const SQLITE_SCHEMA: &str = "
    CREATE TABLE IF NOT EXISTS responses (
        tenant TEXT NOT NULL,
        id TEXT NOT NULL,
        created INTEGER NOT NULL,
        expires INTEGER NOT NULL,
        bytes INTEGER NOT NULL,
        response TEXT NOT NULL,
        input TEXT NOT NULL,
        conversation TEXT NOT NULL,
        PRIMARY KEY (tenant, id)
    ) WITHOUT ROWID;
    CREATE INDEX IF NOT EXISTS responses_by_age ON responses (tenant, created);
    CREATE INDEX IF NOT EXISTS responses_by_expiry ON responses (expires);
    CREATE TABLE IF NOT EXISTS conversations (
        tenant TEXT NOT NULL,
        id TEXT NOT NULL,
        created INTEGER NOT NULL,
        bytes INTEGER NOT NULL,
        metadata TEXT NOT NULL,
        items TEXT NOT NULL,
        PRIMARY KEY (tenant, id)
    ) WITHOUT ROWID;
";

const POSTGRES_SCHEMA: &str = "
    CREATE TABLE IF NOT EXISTS kvfence_responses (
        tenant TEXT NOT NULL,
        id TEXT NOT NULL,
        created BIGINT NOT NULL,
        expires BIGINT NOT NULL,
        bytes BIGINT NOT NULL,
        response TEXT NOT NULL,
        input TEXT NOT NULL,
        conversation TEXT NOT NULL,
        PRIMARY KEY (tenant, id)
    );
    CREATE INDEX IF NOT EXISTS kvfence_responses_by_age ON kvfence_responses (tenant, created);
    CREATE INDEX IF NOT EXISTS kvfence_responses_by_expiry ON kvfence_responses (expires);
    CREATE TABLE IF NOT EXISTS kvfence_conversations (
        tenant TEXT NOT NULL,
        id TEXT NOT NULL,
        created BIGINT NOT NULL,
        bytes BIGINT NOT NULL,
        metadata TEXT NOT NULL,
        items TEXT NOT NULL,
        PRIMARY KEY (tenant, id)
    );
";

/// A database the store runs on.
pub(super) enum Backend {
    Sqlite(Gate<rusqlite::Connection>),
    /// The server's URL, and a client connected to it — again after the
    /// connection broke (a database restart is not the router's).
    Postgres {
        url: String,
        /// TLS to the server, verified against the operator's CA; `None`
        /// connects in the clear.
        tls: Option<tokio_postgres_rustls::MakeRustlsConnect>,
        client: Gate<Option<Box<postgres::Client>>>,
    },
}

/// A connection one operation uses at a time, waited for until the
/// operation's deadline at most — and not at all once its holder has
/// overrun its own: that holder is stuck on a database that does not
/// answer, and waiting behind it only piles threads up.
pub(super) struct Gate<T> {
    connection: parking_lot::Mutex<T>,
    /// How long one operation may take: [`STORE_DEADLINE`].
    limit: Duration,
    /// When the holder took it, in nanoseconds after `epoch` plus one; 0
    /// while nobody holds it.
    taken: AtomicU64,
    epoch: Instant,
}

/// The connection, held until dropped.
struct Held<'g, T> {
    connection: parking_lot::MutexGuard<'g, T>,
    taken: &'g AtomicU64,
}

impl<T> Gate<T> {
    fn new(connection: T) -> Gate<T> {
        Gate::with_limit(connection, STORE_DEADLINE)
    }

    fn with_limit(connection: T, limit: Duration) -> Gate<T> {
        Gate {
            connection: parking_lot::Mutex::new(connection),
            limit,
            taken: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }

    fn stamp(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX - 1)
            + 1
    }

    /// The connection, for an operation starting now, and the deadline
    /// it must end by.
    fn take(&self) -> Result<(Held<'_, T>, Instant), ServerError> {
        let now = Instant::now();
        let deadline = now + self.limit;
        let taken = self.taken.load(Ordering::Acquire);
        let held_for = self.stamp(now).saturating_sub(taken);
        if taken != 0 && u128::from(held_for) > self.limit.as_nanos() {
            return Err(ServerError::StoreTimeout);
        }
        let connection = self
            .connection
            .try_lock_until(deadline)
            .ok_or(ServerError::StoreTimeout)?;
        self.taken
            .store(self.stamp(Instant::now()), Ordering::Release);
        let held = Held {
            connection,
            taken: &self.taken,
        };
        Ok((held, deadline))
    }
}

impl<T> Drop for Held<'_, T> {
    fn drop(&mut self) {
        self.taken.store(0, Ordering::Release);
    }
}

impl<T> std::ops::Deref for Held<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.connection
    }
}

impl<T> std::ops::DerefMut for Held<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.connection
    }
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The URL may hold a password.
        f.write_str(match self {
            Backend::Sqlite(_) => "Sqlite",
            Backend::Postgres { .. } => "Postgres",
        })
    }
}

impl Backend {
    /// The SQLite database at `path` (`None`: in memory), its tables made.
    pub(super) fn sqlite(path: Option<&Path>) -> Result<Backend, rusqlite::Error> {
        let db = match path {
            Some(path) => rusqlite::Connection::open(path)?,
            None => rusqlite::Connection::open_in_memory()?,
        };
        // Several processes (a restart overlapping the old one, tools
        // reading it) may open one file: wait for a lock instead of failing.
        db.busy_timeout(Duration::from_secs(5))?;
        db.pragma_update_and_check(None, "journal_mode", "WAL", |_| Ok(()))?;
        db.pragma_update(None, "synchronous", "NORMAL")?;
        db.execute_batch(SQLITE_SCHEMA)?;
        Ok(Backend::Sqlite(Gate::new(db)))
    }

    /// The PostgreSQL database at `url`, its tables made; over TLS
    /// verified against the certificates in `ca_pem` if given.
    pub(super) fn postgres(url: &str, ca_pem: Option<&[u8]>) -> Result<Backend, ServerError> {
        let tls = ca_pem.map(tls_to).transpose()?;
        let backend = Backend::Postgres {
            url: url.to_string(),
            tls,
            client: Gate::new(None),
        };
        backend.transaction(|_| Ok(()))?;
        Ok(backend)
    }

    /// The table a statement written for `responses`/`conversations`
    /// names in this database.
    pub(super) fn table(&self, name: &'static str) -> &'static str {
        match (self, name) {
            (Backend::Sqlite(_), _) => name,
            (Backend::Postgres { .. }, "responses") => "kvfence_responses",
            (Backend::Postgres { .. }, "conversations") => "kvfence_conversations",
            (Backend::Postgres { .. }, other) => other,
        }
    }

    /// Runs `work` in one transaction and commits it if `work` succeeds.
    pub(super) fn transaction<T>(
        &self,
        work: impl FnOnce(&mut dyn Tx) -> Result<T, ServerError>,
    ) -> Result<T, ServerError> {
        self.run(true, work)
    }

    /// Runs `work`, which only reads, in one transaction.
    pub(super) fn read<T>(
        &self,
        work: impl FnOnce(&mut dyn Tx) -> Result<T, ServerError>,
    ) -> Result<T, ServerError> {
        self.run(false, work)
    }

    /// Runs `work` in one transaction, committed if it writes, within
    /// [`STORE_DEADLINE`]: a transaction that would commit past it is
    /// rolled back instead, since its caller has answered without it.
    fn run<T>(
        &self,
        writes: bool,
        work: impl FnOnce(&mut dyn Tx) -> Result<T, ServerError>,
    ) -> Result<T, ServerError> {
        let in_time = |deadline: Instant| {
            if Instant::now() > deadline {
                Err(ServerError::StoreTimeout)
            } else {
                Ok(())
            }
        };
        match self {
            Backend::Sqlite(db) => {
                let (mut db, deadline) = db.take()?;
                // A writer takes the lock at the start, so another
                // process's writer waits there, never between a read and
                // the write it decides.
                let behavior = if writes {
                    rusqlite::TransactionBehavior::Immediate
                } else {
                    rusqlite::TransactionBehavior::Deferred
                };
                let mut tx = db.transaction_with_behavior(behavior)?;
                let done = work(&mut tx)?;
                in_time(deadline)?;
                tx.commit()?;
                Ok(done)
            }
            Backend::Postgres { url, tls, client } => {
                let (mut client, deadline) = client.take()?;
                if client.as_ref().is_none_or(|client| client.is_closed()) {
                    let config = bounded_config(url)?;
                    let mut fresh = match tls {
                        Some(tls) => config.connect(tls.clone())?,
                        None => config.connect(postgres::NoTls)?,
                    };
                    fresh.batch_execute(POSTGRES_SCHEMA)?;
                    *client = Some(Box::new(fresh));
                }
                let client = client
                    .as_mut()
                    .expect("a client was connected just above if there was none");
                let mut tx = client.transaction()?;
                let done = work(&mut tx)?;
                in_time(deadline)?;
                tx.commit()?;
                Ok(done)
            }
        }
    }
}

/// The connection settings of `url`, with bounds in time where the URL
/// sets none: connecting, and data the server does not acknowledge (a
/// host gone from the network), each give up after [`STORE_DEADLINE`], so
/// the connection an operation overran on breaks and the next one
/// connects again. (A server that acknowledges but never answers is
/// bounded by the deadline of each operation instead.)
fn bounded_config(url: &str) -> Result<postgres::Config, ServerError> {
    let mut config: postgres::Config = url.parse()?;
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(STORE_DEADLINE);
    }
    if config.get_tcp_user_timeout().is_none() {
        config.tcp_user_timeout(STORE_DEADLINE);
    }
    Ok(config)
}

/// A TLS connector that trusts exactly the certificates in `ca_pem` (the
/// server's name is checked against the URL's host).
fn tls_to(ca_pem: &[u8]) -> Result<tokio_postgres_rustls::MakeRustlsConnect, ServerError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let failed = |reason: String| ServerError::StorePostgres(format!("TLS: {reason}"));
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(ca_pem) {
        let ca = ca.map_err(|e| failed(format!("reading the CA certificate: {e}")))?;
        roots
            .add(ca)
            .map_err(|e| failed(format!("the CA certificate: {e}")))?;
    }
    if roots.is_empty() {
        return Err(failed("no CA certificate found".into()));
    }
    let provider = std::sync::Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| failed(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
}

impl rusqlite::ToSql for Param<'_> {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        Ok(match *self {
            Param::Text(text) => rusqlite::types::ToSqlOutput::from(text),
            Param::Int(value) => rusqlite::types::ToSqlOutput::from(value),
        })
    }
}

impl Tx for rusqlite::Transaction<'_> {
    fn run(&mut self, sql: &str, params: &[Param<'_>]) -> Result<u64, ServerError> {
        Ok(self.execute(sql, rusqlite::params_from_iter(params))? as u64)
    }

    fn row(
        &mut self,
        sql: &str,
        params: &[Param<'_>],
        kinds: &[Kind],
    ) -> Result<Option<Vec<Cell>>, ServerError> {
        use rusqlite::OptionalExtension;
        let row = self
            .query_row(sql, rusqlite::params_from_iter(params), |row| {
                kinds
                    .iter()
                    .enumerate()
                    .map(|(i, kind)| match kind {
                        Kind::Text => row.get(i).map(Cell::Text),
                        Kind::Int => row.get(i).map(Cell::Int),
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .optional()?;
        Ok(row)
    }

    fn for_update(&self) -> &'static str {
        ""
    }
}

/// `params` as the `postgres` crate binds them.
fn postgres_params<'a>(params: &'a [Param<'a>]) -> Vec<&'a (dyn postgres::types::ToSql + Sync)> {
    params
        .iter()
        .map(|param| match param {
            Param::Text(text) => text as &(dyn postgres::types::ToSql + Sync),
            Param::Int(value) => value as &(dyn postgres::types::ToSql + Sync),
        })
        .collect()
}

impl Tx for postgres::Transaction<'_> {
    fn run(&mut self, sql: &str, params: &[Param<'_>]) -> Result<u64, ServerError> {
        Ok(self.execute(sql, &postgres_params(params))?)
    }

    fn row(
        &mut self,
        sql: &str,
        params: &[Param<'_>],
        kinds: &[Kind],
    ) -> Result<Option<Vec<Cell>>, ServerError> {
        let Some(row) = self.query_opt(sql, &postgres_params(params))? else {
            return Ok(None);
        };
        kinds
            .iter()
            .enumerate()
            .map(|(i, kind)| {
                Ok(match kind {
                    Kind::Text => Cell::Text(row.try_get(i)?),
                    Kind::Int => Cell::Int(row.try_get(i)?),
                })
            })
            .collect::<Result<Vec<_>, ServerError>>()
            .map(Some)
    }

    fn for_update(&self) -> &'static str {
        " FOR UPDATE"
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::mpsc;

    use super::*;

    /// A gate whose holder is stuck — on a database that does not answer —
    /// until `release` is sent.
    fn stuck(gate: &'static Gate<()>) -> mpsc::Sender<()> {
        let (release, wait) = mpsc::channel::<()>();
        let (taken, is_taken) = mpsc::channel();
        std::thread::spawn(move || {
            let held = gate.take().unwrap();
            taken.send(()).unwrap();
            let _ = wait.recv();
            drop(held);
        });
        is_taken.recv().unwrap();
        release
    }

    #[test]
    fn an_operation_waits_for_a_stuck_one_until_its_deadline_then_not_at_all() {
        let limit = Duration::from_millis(200);
        let gate: &'static Gate<()> = Box::leak(Box::new(Gate::with_limit((), limit)));
        let release = stuck(gate);
        // Behind a holder within its time: waits, up to its own deadline.
        let started = Instant::now();
        assert!(matches!(gate.take(), Err(ServerError::StoreTimeout)));
        assert!(started.elapsed() >= limit, "it waited for its turn");
        // The holder has now overrun its own deadline: the next ones do
        // not queue behind it.
        std::thread::sleep(limit);
        let started = Instant::now();
        assert!(matches!(gate.take(), Err(ServerError::StoreTimeout)));
        assert!(started.elapsed() < limit, "{:?}", started.elapsed());
        // Once it ends, the store is whole again.
        release.send(()).unwrap();
        let started = Instant::now();
        while gate.take().is_err() {
            assert!(started.elapsed() < Duration::from_secs(10), "freed");
            std::thread::yield_now();
        }
    }

    #[test]
    fn a_transaction_that_overran_is_rolled_back_not_committed() {
        let db = rusqlite::Connection::open_in_memory().unwrap();
        db.execute_batch("CREATE TABLE t (v INTEGER)").unwrap();
        let backend = Backend::Sqlite(Gate::with_limit(db, Duration::from_millis(50)));
        let slow = backend.transaction(|tx| {
            tx.run("INSERT INTO t (v) VALUES ($1)", &[Param::Int(1)])?;
            std::thread::sleep(Duration::from_millis(100));
            Ok(())
        });
        assert!(matches!(slow, Err(ServerError::StoreTimeout)));
        let count = backend
            .read(|tx| tx.row("SELECT COUNT(*) FROM t", &[], &[Kind::Int]))
            .unwrap();
        assert_eq!(count.unwrap()[0], Cell::Int(0), "nothing of it was kept");
    }
}
