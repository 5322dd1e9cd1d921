//! Requests' grammars, compiled for this worker's tokenizer. The `n`
//! choices of a request carry the same grammar and are admitted one after
//! another, so the last grammar compiled is kept (one, to bound memory: a
//! large JSON schema's automaton is big) and each choice starts from a
//! fresh copy of it instead of compiling it again on the scheduler's
//! thread, which every tenant's requests share.

use kvfence_model::{Constraint, Grammar, Grammars, LoadedModel, ModelError};

#[derive(Default)]
pub(super) struct GrammarCache {
    /// Built at the first grammar.
    grammars: Option<Grammars>,
    /// The last grammar compiled and its constraint, never advanced: only
    /// copies of it are handed out.
    last: Option<(Grammar, Constraint)>,
    /// Grammars compiled so far.
    compiled: u64,
}

impl GrammarCache {
    /// A constraint for `grammar` in its start state.
    pub(super) fn constraint(
        &mut self,
        model: &LoadedModel,
        grammar: &Grammar,
    ) -> Result<Constraint, ModelError> {
        if let Some((last, constraint)) = &self.last
            && last == grammar
        {
            return Ok(constraint.clone());
        }
        let grammars = match &self.grammars {
            Some(grammars) => grammars,
            None => {
                let config = model.model.config();
                let grammars =
                    Grammars::new(&model.tokenizer, config.vocab_size, &config.eos_token_ids)?;
                self.grammars.insert(grammars)
            }
        };
        let constraint = grammars.compile(grammar)?;
        self.compiled += 1;
        self.last = Some((grammar.clone(), constraint.clone()));
        Ok(constraint)
    }

    /// Grammars compiled so far (tests).
    #[cfg(test)]
    pub(super) fn compiled(&self) -> u64 {
        self.compiled
    }
}
