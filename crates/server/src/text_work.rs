//! Template, tokenizer and grammar work, off the async runtime and shared
//! between tenants (I11). A request's text work runs on a blocking thread,
//! at most one per core at once; one tenant holds at most half of those
//! slots (at least one), so its large JSON schemas — seconds to compile —
//! queue behind each other, never in front of another tenant's chat.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The slots for text work.
#[derive(Debug)]
pub(crate) struct TextWork {
    all: Arc<Semaphore>,
    per_tenant: usize,
    tenants: Mutex<HashMap<String, Arc<Semaphore>>>,
}

/// A slot held: dropping it frees it.
#[derive(Debug)]
pub(crate) struct Slot {
    _tenant: OwnedSemaphorePermit,
    _all: OwnedSemaphorePermit,
}

impl TextWork {
    /// `slots` at once in all.
    pub(crate) fn new(slots: usize) -> TextWork {
        let slots = slots.max(1);
        TextWork {
            all: Arc::new(Semaphore::new(slots)),
            per_tenant: (slots / 2).max(1),
            tenants: Mutex::default(),
        }
    }

    /// Waits for one of `tenant`'s own slots, then for one of all: a
    /// tenant's surplus waits in its own line, holding nothing shared.
    /// `None` only if the slots were closed (never, while the server runs).
    pub(crate) async fn slot(&self, tenant: &str) -> Option<Slot> {
        let own = {
            let mut tenants = self.tenants.lock().unwrap_or_else(|p| p.into_inner());
            Arc::clone(
                tenants
                    .entry(tenant.to_string())
                    .or_insert_with(|| Arc::new(Semaphore::new(self.per_tenant))),
            )
        };
        let tenant = own.acquire_owned().await.ok()?;
        let all = Arc::clone(&self.all).acquire_owned().await.ok()?;
        Some(Slot {
            _tenant: tenant,
            _all: all,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[tokio::test]
    async fn one_tenant_cannot_take_every_slot() {
        let work = TextWork::new(2);
        let first = work.slot("a").await.unwrap();
        // a's second request waits for its own first...
        let second = tokio::time::timeout(std::time::Duration::from_millis(50), work.slot("a"));
        assert!(second.await.is_err(), "a holds half the slots at most");
        // ...while b finds the other slot at once.
        let b = tokio::time::timeout(std::time::Duration::from_millis(50), work.slot("b"));
        let b = b.await.unwrap().unwrap();
        drop(first);
        assert!(work.slot("a").await.is_some());
        drop(b);
    }
}
