//! Honest capacity (I6): the context the server advertises and enforces is
//! computed from the real pool, never taken from a flag alone.

use crate::error::ServerError;
use kvfence_pool::mutation::Mutation;

/// The server's context limits and where they come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    /// The model's own limit (`max_position_embeddings`).
    pub model_limit: usize,
    /// Tokens the smallest worker pool really holds.
    pub pool_tokens: usize,
    /// Which worker's pool that is.
    pub pool_role: &'static str,
    /// `--max-context`, if given.
    pub configured: Option<usize>,
    /// What is advertised and enforced: the minimum of the above.
    pub max_context: usize,
    /// Whether `--max-context` was lowered to fit (`--clamp-context`).
    pub clamped: bool,
}

impl Capacity {
    /// `min(model limit, --max-context, every worker's pool)`: a request
    /// must fit prefill's pool *and* decode's. A `--max-context` above the
    /// real limit is an error unless `clamp` allows lowering it.
    pub fn compute(
        model_limit: usize,
        pools: &[(&'static str, usize)],
        configured: Option<usize>,
        clamp: bool,
    ) -> Result<Capacity, ServerError> {
        let smallest = pools.iter().copied().min_by_key(|(_, tokens)| *tokens);
        let (pool_role, pool_tokens) = if Mutation::DecodeCapacity.active() {
            // Incident replay (f): trust the decode pool alone.
            pools
                .iter()
                .copied()
                .find(|(role, _)| *role == "decode")
                .or(smallest)
        } else {
            smallest
        }
        .unwrap_or(("none", 0));
        let real = model_limit.min(pool_tokens);
        let (max_context, clamped) = match configured {
            Some(asked) if asked > real => {
                if !clamp {
                    let why = if pool_tokens < model_limit {
                        format!("the {pool_role} KV pool holds {pool_tokens} tokens")
                    } else {
                        format!("the model supports {model_limit} positions")
                    };
                    return Err(ServerError::ContextTooLarge {
                        configured: asked,
                        limit: real,
                        why,
                    });
                }
                (real, true)
            }
            Some(asked) => (asked, false),
            None => (real, false),
        };
        Ok(Capacity {
            model_limit,
            pool_tokens,
            pool_role,
            configured,
            max_context,
            clamped,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn i6_effective_context_is_the_minimum_of_model_flag_and_pool() {
        let max = |model, pool, flag| {
            Capacity::compute(model, &[("colocated", pool)], flag, false)
                .unwrap()
                .max_context
        };
        assert_eq!(max(4096, 1000, None), 1000);
        assert_eq!(max(4096, 9000, None), 4096);
        assert_eq!(max(4096, 9000, Some(2000)), 2000);
    }

    #[test]
    fn i6_the_smallest_worker_pool_bounds_the_context() {
        // The incident's numbers: the model advertised 1,048,576 tokens and
        // the prefill pool held 681,280.
        let pools = [("decode", 1_048_576), ("prefill", 681_280)];
        let capacity = Capacity::compute(1_048_576, &pools, None, false).unwrap();
        assert_eq!(
            (capacity.max_context, capacity.pool_role),
            (681_280, "prefill")
        );
    }

    #[test]
    fn i6_a_flag_beyond_the_pools_stops_start_up_unless_clamped() {
        let pools = [("decode", 2_000_000), ("prefill", 681_280)];
        let err = Capacity::compute(1_048_576, &pools, Some(1_048_576), false).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("1048576")
                && msg.contains("681280")
                && msg.contains("prefill")
                && msg.contains("--clamp-context"),
            "{msg}"
        );
        let clamped = Capacity::compute(1_048_576, &pools, Some(1_048_576), true).unwrap();
        assert_eq!((clamped.max_context, clamped.clamped), (681_280, true));
    }
}
