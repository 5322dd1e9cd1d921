//! The two databases a response store runs on — SQLite (one file, one
//! process) and PostgreSQL (shared by a fleet's routers) — behind one
//! small interface: a transaction that runs a statement with text and
//! integer parameters and reads at most one row. The store's statements are
//! written once, in the SQL both speak (`$1`… parameters, numbered in order
//! of first use, which SQLite reads as names; `ON CONFLICT … DO UPDATE`;
//! `CAST(… AS BIGINT)`); what differs — the schema's types, how a row is
//! locked for an edit — is asked of the backend.

use std::path::Path;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use crate::error::ServerError;

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
    Sqlite(Mutex<rusqlite::Connection>),
    /// The server's URL, and a client connected to it — again after the
    /// connection broke (a database restart is not the router's).
    Postgres {
        url: String,
        /// TLS to the server, verified against the operator's CA; `None`
        /// connects in the clear.
        tls: Option<tokio_postgres_rustls::MakeRustlsConnect>,
        client: Mutex<Option<Box<postgres::Client>>>,
    },
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

/// Locks `mutex`: a panic while it was held left no half-done statement
/// behind (each transaction is all or nothing), so what it guards is sound.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
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
        Ok(Backend::Sqlite(Mutex::new(db)))
    }

    /// The PostgreSQL database at `url`, its tables made; over TLS
    /// verified against the certificates in `ca_pem` if given.
    pub(super) fn postgres(url: &str, ca_pem: Option<&[u8]>) -> Result<Backend, ServerError> {
        let tls = ca_pem.map(tls_to).transpose()?;
        let backend = Backend::Postgres {
            url: url.to_string(),
            tls,
            client: Mutex::new(None),
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

    fn run<T>(
        &self,
        writes: bool,
        work: impl FnOnce(&mut dyn Tx) -> Result<T, ServerError>,
    ) -> Result<T, ServerError> {
        match self {
            Backend::Sqlite(db) => {
                let mut db = lock(db);
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
                tx.commit()?;
                Ok(done)
            }
            Backend::Postgres { url, tls, client } => {
                let mut client = lock(client);
                if client.as_ref().is_none_or(|client| client.is_closed()) {
                    let mut fresh = match tls {
                        Some(tls) => postgres::Client::connect(url, tls.clone())?,
                        None => postgres::Client::connect(url, postgres::NoTls)?,
                    };
                    fresh.batch_execute(POSTGRES_SCHEMA)?;
                    *client = Some(Box::new(fresh));
                }
                let client = client
                    .as_mut()
                    .expect("a client was connected just above if there was none");
                let mut tx = client.transaction()?;
                let done = work(&mut tx)?;
                tx.commit()?;
                Ok(done)
            }
        }
    }
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
