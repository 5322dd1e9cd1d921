//! Stored responses and conversations: what `store` keeps of a Responses
//! API answer, so that `previous_response_id` can continue it and
//! `GET`/`DELETE /v1/responses/{id}` and `…/input_items` can read or remove
//! it; and the Conversations API's item lists.
//!
//! Every row belongs to one tenant, and every statement names the tenant
//! beside the id: a tenant cannot read, continue or delete another's
//! response, and asking for another tenant's id runs the same one-row
//! primary-key lookup as asking for a made-up one — the same miss, the
//! same 404 (I9). Ids are 128 random bits from the operating system's
//! generator. The store is bounded: a response lives `ttl`, and a tenant's
//! rows together at most `tenant_bytes` (its oldest responses go first,
//! never another tenant's). What it holds is customer text: a file is
//! created readable by its owner only, and nothing here logs it (I10).
//!
//! On SQLite (a file, or memory) for one server, or PostgreSQL for a fleet
//! whose routers share it (`backend.rs`); one connection behind a mutex,
//! used from blocking threads.

mod backend;

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use crate::error::ServerError;
pub(crate) use backend::STORE_DEADLINE;
use backend::{Backend, Cell, Kind, Param, Tx};

/// How much the store keeps, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreLimits {
    /// How long a stored response can be read or continued.
    pub ttl: Duration,
    /// The most one tenant's stored responses and conversations may take
    /// together, in bytes of their JSON; past it the tenant's oldest
    /// responses are removed.
    pub tenant_bytes: u64,
}

impl Default for StoreLimits {
    /// OpenAI's thirty days, and 100 MiB a tenant.
    fn default() -> Self {
        StoreLimits {
            ttl: Duration::from_secs(30 * 24 * 3600),
            tenant_bytes: 100 << 20,
        }
    }
}

/// Expired responses one write removes at most, so that its transaction
/// stays within the store's deadline however many expired at once (reads
/// never see them: every read asks for `expires` after now).
const PURGE_BATCH: usize = 256;

/// One stored response.
#[derive(Debug, Clone, PartialEq)]
pub struct Stored {
    /// The response object, as `GET /v1/responses/{id}` returns it.
    pub response: Value,
    /// The input items of its request, each with an id.
    pub input: Vec<Value>,
    /// What a continuation starts from: the conversation before it, its
    /// input and its output, as input items.
    pub conversation: Vec<Value>,
}

/// One stored conversation (the Conversations API): items that responses
/// naming it read before their input and add their input and output to.
/// Conversations do not expire (as OpenAI's do not); they count against
/// their tenant's bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Conversation {
    /// When it was made (Unix seconds).
    pub created: u64,
    /// The client's metadata object.
    pub metadata: Value,
    /// Its items, oldest first, each with an id.
    pub items: Vec<Value>,
}

/// The most one stored response or conversation may take, in bytes of its
/// JSON. Every change rewrites a row whole while the store is locked for
/// every tenant; bounding a row bounds what one tenant's write can make the
/// others wait (I11). Far above what a context can hold: a conversation
/// this long could not be continued anyway.
pub const MAX_ROW_BYTES: u64 = 4 << 20;

/// The responses and conversations of every tenant, in one database.
#[derive(Debug)]
pub struct ResponseStore {
    db: Backend,
    limits: StoreLimits,
}

impl ResponseStore {
    /// Where the store lives unless `--responses-store` says otherwise:
    /// `$KVFENCE_DATA_DIR/responses.sqlite`, else under
    /// `$XDG_DATA_HOME/kvfence`, else `~/.local/share/kvfence`.
    pub fn default_path() -> Option<PathBuf> {
        let var = |name| std::env::var_os(name).filter(|v| !v.is_empty());
        let dir = var("KVFENCE_DATA_DIR")
            .map(PathBuf::from)
            .or_else(|| var("XDG_DATA_HOME").map(|d| PathBuf::from(d).join("kvfence")))
            .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".local/share/kvfence")))?;
        Some(dir.join("responses.sqlite"))
    }

    /// Opens (or creates, readable by its owner only) the SQLite store at
    /// `path`.
    pub fn open(path: &Path, limits: StoreLimits) -> Result<ResponseStore, ServerError> {
        let failed = |reason: String| ServerError::ResponseStore {
            path: path.display().to_string(),
            reason,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| failed(e.to_string()))?;
        }
        create_private(path).map_err(|e| failed(e.to_string()))?;
        let db = Backend::sqlite(Some(path)).map_err(|e| failed(e.to_string()))?;
        Ok(ResponseStore { db, limits })
    }

    /// A store in memory, gone with the process.
    pub fn in_memory(limits: StoreLimits) -> Result<ResponseStore, ServerError> {
        let db = Backend::sqlite(None).map_err(|e| ServerError::ResponseStore {
            path: ":memory:".into(),
            reason: e.to_string(),
        })?;
        Ok(ResponseStore { db, limits })
    }

    /// The store in the PostgreSQL database at `url`
    /// (`postgres://user:password@host:port/database`), its tables
    /// (`kvfence_responses`, `kvfence_conversations`) made if missing; over
    /// TLS verified against the CA certificates in `ca_pem` if given (then
    /// `?sslmode=require` in the URL refuses a server without TLS).
    pub fn postgres(
        url: &str,
        ca_pem: Option<&[u8]>,
        limits: StoreLimits,
    ) -> Result<ResponseStore, ServerError> {
        let db = Backend::postgres(url, ca_pem).map_err(|e| ServerError::ResponseStore {
            // Never the URL: it may hold a password.
            path: "the PostgreSQL database".into(),
            reason: e.to_string(),
        })?;
        Ok(ResponseStore { db, limits })
    }

    /// The limits it keeps.
    pub fn limits(&self) -> StoreLimits {
        self.limits
    }

    /// A statement with this database's names for the `{responses}` and
    /// `{conversations}` tables.
    fn sql(&self, statement: &str) -> String {
        statement
            .replace("{responses}", self.db.table("responses"))
            .replace("{conversations}", self.db.table("conversations"))
    }

    /// Stores `stored` as `tenant`'s response `id` at `now` (Unix
    /// seconds), then removes the tenant's oldest responses until it is
    /// within its bytes, and every tenant's expired ones.
    pub fn put(
        &self,
        tenant: &str,
        id: &str,
        stored: &Stored,
        now: u64,
    ) -> Result<(), ServerError> {
        let parts = [
            stored.response.to_string(),
            Value::Array(stored.input.clone()).to_string(),
            Value::Array(stored.conversation.clone()).to_string(),
        ];
        let bytes: u64 = parts.iter().map(|p| p.len() as u64).sum();
        let limit = self.limits.tenant_bytes;
        if bytes > MAX_ROW_BYTES {
            return Err(ServerError::StoredRowTooLarge {
                bytes,
                limit: MAX_ROW_BYTES,
            });
        }
        if bytes > limit {
            return Err(ServerError::StoredTooLarge { bytes, limit });
        }
        let expires = now.saturating_add(self.limits.ttl.as_secs());
        // A batch of what expired, oldest first; each write takes the next.
        let purge = self.sql(&format!(
            "DELETE FROM {{responses}} WHERE (tenant, id) IN (
                SELECT tenant, id FROM {{responses}} WHERE expires <= $1
                ORDER BY expires LIMIT {PURGE_BATCH})"
        ));
        let insert = self.sql(
            "INSERT INTO {responses}
                (tenant, id, created, expires, bytes, response, input, conversation)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
             ON CONFLICT (tenant, id) DO UPDATE SET
                created = excluded.created, expires = excluded.expires,
                bytes = excluded.bytes, response = excluded.response,
                input = excluded.input, conversation = excluded.conversation",
        );
        self.db.transaction(|tx| {
            tx.run(&purge, &[Param::Int(sql_time(now))])?;
            tx.run(
                &insert,
                &[
                    Param::Text(tenant),
                    Param::Text(id),
                    Param::Int(sql_time(now)),
                    Param::Int(sql_time(expires)),
                    Param::Int(sql_time(bytes)),
                    Param::Text(&parts[0]),
                    Param::Text(&parts[1]),
                    Param::Text(&parts[2]),
                ],
            )?;
            self.make_room(tx, tenant, Some(id))
        })
    }

    /// `tenant`'s response `id`, if it has one that has not expired.
    pub fn get(&self, tenant: &str, id: &str, now: u64) -> Result<Option<Stored>, ServerError> {
        let query = self.sql(
            "SELECT response, input, conversation FROM {responses}
             WHERE tenant = $1 AND id = $2 AND expires > $3",
        );
        let row = self.db.read(|tx| {
            tx.row(
                &query,
                &[
                    Param::Text(tenant),
                    Param::Text(id),
                    Param::Int(sql_time(now)),
                ],
                &[Kind::Text, Kind::Text, Kind::Text],
            )
        })?;
        let Some([response, input, conversation]) = three(row)? else {
            return Ok(None);
        };
        Ok(Some(Stored {
            response: json(&response.text()?)?,
            input: items(&input.text()?)?,
            conversation: items(&conversation.text()?)?,
        }))
    }

    /// Removes `tenant`'s response `id`; whether it had one to remove.
    pub fn delete(&self, tenant: &str, id: &str, now: u64) -> Result<bool, ServerError> {
        let statement =
            self.sql("DELETE FROM {responses} WHERE tenant = $1 AND id = $2 AND expires > $3");
        let removed = self.db.transaction(|tx| {
            tx.run(
                &statement,
                &[
                    Param::Text(tenant),
                    Param::Text(id),
                    Param::Int(sql_time(now)),
                ],
            )
        })?;
        Ok(removed == 1)
    }

    /// Stores a new conversation `id` of `tenant`.
    pub fn create_conversation(
        &self,
        tenant: &str,
        id: &str,
        conversation: &Conversation,
    ) -> Result<(), ServerError> {
        self.db.transaction(|tx| {
            self.write_conversation(tx, tenant, id, conversation)?;
            self.make_room(tx, tenant, None)
        })
    }

    /// `tenant`'s conversation `id`, if it has one.
    pub fn conversation(
        &self,
        tenant: &str,
        id: &str,
    ) -> Result<Option<Conversation>, ServerError> {
        self.db
            .read(|tx| self.read_conversation(tx, tenant, id, false))
    }

    /// Changes `tenant`'s conversation `id` with `edit`, all or nothing
    /// (its row locked meanwhile, so two routers' edits never lose one);
    /// the conversation as changed, or `None` if the tenant has no such
    /// conversation. Refused if the tenant's bytes cannot hold it.
    pub fn edit_conversation(
        &self,
        tenant: &str,
        id: &str,
        edit: impl FnOnce(&mut Conversation),
    ) -> Result<Option<Conversation>, ServerError> {
        self.db.transaction(|tx| {
            let Some(mut conversation) = self.read_conversation(tx, tenant, id, true)? else {
                return Ok(None);
            };
            edit(&mut conversation);
            self.write_conversation(tx, tenant, id, &conversation)?;
            self.make_room(tx, tenant, None)?;
            Ok(Some(conversation))
        })
    }

    /// Removes `tenant`'s conversation `id`; whether it had one.
    pub fn delete_conversation(&self, tenant: &str, id: &str) -> Result<bool, ServerError> {
        let statement = self.sql("DELETE FROM {conversations} WHERE tenant = $1 AND id = $2");
        let removed = self
            .db
            .transaction(|tx| tx.run(&statement, &[Param::Text(tenant), Param::Text(id)]))?;
        Ok(removed == 1)
    }

    fn read_conversation(
        &self,
        tx: &mut dyn Tx,
        tenant: &str,
        id: &str,
        lock: bool,
    ) -> Result<Option<Conversation>, ServerError> {
        let mut query = self.sql(
            "SELECT created, metadata, items FROM {conversations} WHERE tenant = $1 AND id = $2",
        );
        if lock {
            query.push_str(tx.for_update());
        }
        let row = tx.row(
            &query,
            &[Param::Text(tenant), Param::Text(id)],
            &[Kind::Int, Kind::Text, Kind::Text],
        )?;
        let Some([created, metadata, list]) = three(row)? else {
            return Ok(None);
        };
        Ok(Some(Conversation {
            created: u64::try_from(created.int()?).unwrap_or(0),
            metadata: json(&metadata.text()?)?,
            items: items(&list.text()?)?,
        }))
    }

    /// Writes `tenant`'s conversation `id`, new or changed.
    fn write_conversation(
        &self,
        tx: &mut dyn Tx,
        tenant: &str,
        id: &str,
        conversation: &Conversation,
    ) -> Result<(), ServerError> {
        let metadata = conversation.metadata.to_string();
        let list = Value::Array(conversation.items.clone()).to_string();
        let bytes = (metadata.len() + list.len()) as u64;
        if bytes > MAX_ROW_BYTES {
            return Err(ServerError::StoredRowTooLarge {
                bytes,
                limit: MAX_ROW_BYTES,
            });
        }
        let statement = self.sql(
            "INSERT INTO {conversations} (tenant, id, created, bytes, metadata, items)
             VALUES ($1, $2, $3, $4, $5, $6)
             ON CONFLICT (tenant, id) DO UPDATE SET
                bytes = excluded.bytes, metadata = excluded.metadata, items = excluded.items",
        );
        tx.run(
            &statement,
            &[
                Param::Text(tenant),
                Param::Text(id),
                Param::Int(sql_time(conversation.created)),
                Param::Int(sql_time(bytes)),
                Param::Text(&metadata),
                Param::Text(&list),
            ],
        )?;
        Ok(())
    }

    /// Removes `tenant`'s oldest stored responses (never `keep`, never
    /// another tenant's, never a conversation) until its responses and
    /// conversations together are within its bytes; refuses if they
    /// cannot be.
    fn make_room(
        &self,
        tx: &mut dyn Tx,
        tenant: &str,
        keep: Option<&str>,
    ) -> Result<(), ServerError> {
        let limit = self.limits.tenant_bytes;
        let total = self.sql(
            "SELECT CAST((SELECT COALESCE(SUM(bytes), 0) FROM {responses} WHERE tenant = $1)
                  + (SELECT COALESCE(SUM(bytes), 0) FROM {conversations} WHERE tenant = $1) AS BIGINT)",
        );
        let oldest = self.sql(
            "DELETE FROM {responses} WHERE tenant = $1 AND id = (
                SELECT id FROM {responses} WHERE tenant = $1 AND id != $2
                ORDER BY created, id LIMIT 1)
             RETURNING bytes",
        );
        let first_cell = |row: Option<Vec<Cell>>| -> Result<u64, ServerError> {
            match row.and_then(|cells| cells.into_iter().next()) {
                Some(cell) => Ok(u64::try_from(cell.int()?).unwrap_or(0)),
                None => Ok(0),
            }
        };
        // Summed once, then less what each removal frees: a tenant of many
        // small rows makes room in as many steps as rows it loses, never a
        // sum over all it holds per step (which held the store for every
        // tenant for as long).
        let mut total = first_cell(tx.row(&total, &[Param::Text(tenant)], &[Kind::Int])?)?;
        while total > limit {
            let removed = tx.row(
                &oldest,
                &[Param::Text(tenant), Param::Text(keep.unwrap_or(""))],
                &[Kind::Int],
            )?;
            if removed.is_none() {
                return Err(ServerError::StoredTooLarge {
                    bytes: total,
                    limit,
                });
            }
            total = total.saturating_sub(first_cell(removed)?);
        }
        Ok(())
    }
}

/// A row read as three columns, if there was one.
fn three(row: Option<Vec<Cell>>) -> Result<Option<[Cell; 3]>, ServerError> {
    row.map(<[Cell; 3]>::try_from)
        .transpose()
        .map_err(|_| ServerError::StoredDamaged)
}

fn json(text: &str) -> Result<Value, ServerError> {
    serde_json::from_str(text).map_err(|_| ServerError::StoredDamaged)
}

fn items(text: &str) -> Result<Vec<Value>, ServerError> {
    match json(text)? {
        Value::Array(items) => Ok(items),
        _ => Err(ServerError::StoredDamaged),
    }
}

/// Unix seconds and byte counts as the databases' 64-bit integer (past
/// 2^63 is beyond any clock or disk).
fn sql_time(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// Creates `path` empty and readable by its owner only, if it is not
/// there; an existing file keeps its permissions.
fn create_private(path: &Path) -> std::io::Result<()> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    match options.open(path) {
        Ok(_) => Ok(()),
        Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(error) => Err(error),
    }
}

/// A new id: `prefix`, `_` and 128 random bits (`resp`, `conv`).
pub fn new_id(prefix: &str) -> String {
    format!("{prefix}_{:032x}", rand::random::<u128>())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use serde_json::json;

    use super::*;

    fn stored(text: &str) -> Stored {
        Stored {
            response: json!({"id": "r", "output": [{"type": "message", "content": text}]}),
            input: vec![json!({"type": "message", "role": "user", "content": text})],
            conversation: vec![json!({"type": "message", "role": "user", "content": text})],
        }
    }

    fn store(limits: StoreLimits) -> ResponseStore {
        ResponseStore::in_memory(limits).unwrap()
    }

    #[test]
    fn i9_a_tenant_reads_and_deletes_only_its_own_responses() {
        let store = store(StoreLimits::default());
        let id = new_id("resp");
        store
            .put("alpha", &id, &stored("alpha's secret"), 100)
            .unwrap();
        assert_eq!(
            store.get("alpha", &id, 101).unwrap(),
            Some(stored("alpha's secret"))
        );
        // Another tenant's id is as absent as one never made.
        assert_eq!(store.get("beta", &id, 101).unwrap(), None);
        assert_eq!(store.get("beta", &new_id("resp"), 101).unwrap(), None);
        assert!(!store.delete("beta", &id, 101).unwrap());
        assert!(store.get("alpha", &id, 101).unwrap().is_some());
        assert!(store.delete("alpha", &id, 101).unwrap());
        assert_eq!(store.get("alpha", &id, 101).unwrap(), None);
        assert!(!store.delete("alpha", &id, 101).unwrap());
    }

    #[test]
    fn a_response_lives_its_ttl_and_no_longer() {
        let store = store(StoreLimits {
            ttl: Duration::from_secs(60),
            ..StoreLimits::default()
        });
        store.put("alpha", "resp_a", &stored("a"), 1_000).unwrap();
        assert!(store.get("alpha", "resp_a", 1_059).unwrap().is_some());
        assert_eq!(store.get("alpha", "resp_a", 1_060).unwrap(), None);
        assert!(!store.delete("alpha", "resp_a", 1_060).unwrap());
        // The next write removes what expired.
        store.put("beta", "resp_b", &stored("b"), 1_061).unwrap();
        let rows = store
            .db
            .transaction(|tx| tx.row("SELECT COUNT(*) FROM responses", &[], &[Kind::Int]))
            .unwrap();
        assert_eq!(rows, Some(vec![Cell::Int(1)]));
    }

    #[test]
    fn a_write_removes_a_bounded_number_of_expired_responses() {
        // A write's transaction must end within the store's deadline, so
        // it removes what expired a batch at a time: a burst of answers
        // that expires at once would otherwise make every write remove all
        // of them, overrun, roll back — and no write would ever land.
        let store = store(StoreLimits {
            ttl: Duration::from_secs(60),
            ..StoreLimits::default()
        });
        let burst = 2 * PURGE_BATCH + 10;
        for i in 0..burst {
            store
                .put("alpha", &format!("resp_{i}"), &stored("a"), 1_000)
                .unwrap();
        }
        let count = || {
            let row = store
                .db
                .read(|tx| tx.row("SELECT COUNT(*) FROM responses", &[], &[Kind::Int]))
                .unwrap();
            row.unwrap()[0].clone().int().unwrap()
        };
        store.put("beta", "resp_b", &stored("b"), 2_000).unwrap();
        assert_eq!(count(), (burst - PURGE_BATCH + 1) as i64);
        store.put("beta", "resp_c", &stored("c"), 2_001).unwrap();
        store.put("beta", "resp_d", &stored("d"), 2_002).unwrap();
        assert_eq!(count(), 3, "every expired response is gone in the end");
    }

    #[test]
    fn a_tenant_over_its_bytes_loses_its_own_oldest_and_never_another_s() {
        let one = {
            let s = stored("x");
            [
                s.response.to_string(),
                Value::Array(s.input).to_string(),
                Value::Array(s.conversation).to_string(),
            ]
            .iter()
            .map(|p| p.len() as u64)
            .sum::<u64>()
        };
        let store = store(StoreLimits {
            tenant_bytes: 3 * one,
            ..StoreLimits::default()
        });
        store.put("beta", "resp_b", &stored("y"), 1).unwrap();
        for (i, id) in ["resp_1", "resp_2", "resp_3", "resp_4"].iter().enumerate() {
            store.put("alpha", id, &stored("x"), 10 + i as u64).unwrap();
        }
        assert_eq!(store.get("alpha", "resp_1", 20).unwrap(), None);
        for id in ["resp_2", "resp_3", "resp_4"] {
            assert!(store.get("alpha", id, 20).unwrap().is_some(), "{id}");
        }
        assert!(store.get("beta", "resp_b", 20).unwrap().is_some());
        // One response larger than a tenant may keep is refused, not
        // stored by emptying the tenant.
        let big = stored(&"z".repeat(4 * one as usize));
        assert!(matches!(
            store.put("alpha", "resp_big", &big, 30),
            Err(ServerError::StoredTooLarge { .. })
        ));
        assert!(store.get("alpha", "resp_4", 30).unwrap().is_some());
    }

    #[test]
    fn responses_survive_a_restart_in_a_file_only_its_owner_reads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data/responses.sqlite");
        {
            let store = ResponseStore::open(&path, StoreLimits::default()).unwrap();
            store.put("alpha", "resp_1", &stored("kept"), 5).unwrap();
        }
        let store = ResponseStore::open(&path, StoreLimits::default()).unwrap();
        assert_eq!(
            store.get("alpha", "resp_1", 6).unwrap(),
            Some(stored("kept"))
        );
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o077, 0, "{mode:o}");
        }
    }

    #[test]
    fn i9_conversations_are_their_tenant_s_and_share_its_bytes() {
        let one = |text: &str| Conversation {
            created: 1,
            metadata: json!({"topic": "t"}),
            items: vec![json!({"id": "msg_1", "type": "message", "role": "user", "content": text})],
        };
        let store = store(StoreLimits {
            tenant_bytes: 1_000,
            ..StoreLimits::default()
        });
        store
            .create_conversation("alpha", "conv_a", &one("hello"))
            .unwrap();
        assert_eq!(
            store.conversation("alpha", "conv_a").unwrap(),
            Some(one("hello"))
        );
        assert_eq!(store.conversation("beta", "conv_a").unwrap(), None);
        assert_eq!(
            store.edit_conversation("beta", "conv_a", |_| {}).unwrap(),
            None
        );
        assert!(!store.delete_conversation("beta", "conv_a").unwrap());
        let edited = store
            .edit_conversation("alpha", "conv_a", |c| c.items.push(json!({"id": "msg_2"})))
            .unwrap()
            .unwrap();
        assert_eq!(edited.items.len(), 2);
        assert_eq!(store.conversation("alpha", "conv_a").unwrap(), Some(edited));
        // A stored response makes room for a conversation that grows; a
        // conversation that cannot fit is refused and left as it was.
        store.put("alpha", "resp_old", &stored("x"), 2).unwrap();
        let big = json!({"id": "msg_3", "text": "y".repeat(850)});
        store
            .edit_conversation("alpha", "conv_a", |c| c.items.push(big.clone()))
            .unwrap();
        assert_eq!(
            store.get("alpha", "resp_old", 3).unwrap(),
            None,
            "evicted for it"
        );
        let huge = json!({"id": "msg_4", "text": "z".repeat(1_000)});
        assert!(matches!(
            store.edit_conversation("alpha", "conv_a", |c| c.items.push(huge)),
            Err(ServerError::StoredTooLarge { .. })
        ));
        assert_eq!(
            store
                .conversation("alpha", "conv_a")
                .unwrap()
                .unwrap()
                .items
                .len(),
            3
        );
        assert!(store.delete_conversation("alpha", "conv_a").unwrap());
        assert_eq!(store.conversation("alpha", "conv_a").unwrap(), None);
    }

    #[test]
    fn i11_no_row_grows_past_its_bound_however_much_the_tenant_may_store() {
        let store = store(StoreLimits {
            tenant_bytes: 64 << 20,
            ..StoreLimits::default()
        });
        let conversation = Conversation {
            created: 1,
            metadata: json!({}),
            items: Vec::new(),
        };
        store
            .create_conversation("alpha", "conv_a", &conversation)
            .unwrap();
        let item = json!({"id": "msg", "text": "w".repeat(1 << 20)});
        for _ in 0..3 {
            store
                .edit_conversation("alpha", "conv_a", |c| c.items.push(item.clone()))
                .unwrap();
        }
        let refused = store.edit_conversation("alpha", "conv_a", |c| c.items.push(item.clone()));
        assert!(
            matches!(refused, Err(ServerError::StoredRowTooLarge { .. })),
            "{refused:?}"
        );
        assert_eq!(
            store
                .conversation("alpha", "conv_a")
                .unwrap()
                .unwrap()
                .items
                .len(),
            3
        );
        let big = Stored {
            response: json!({}),
            input: vec![item.clone(); 5],
            conversation: Vec::new(),
        };
        assert!(matches!(
            store.put("alpha", "resp_big", &big, 1),
            Err(ServerError::StoredRowTooLarge { .. })
        ));
    }

    #[test]
    fn ids_are_unguessable() {
        let a = new_id("resp");
        assert_eq!(a.len(), "resp_".len() + 32);
        assert_ne!(a, new_id("resp"));
    }
}
