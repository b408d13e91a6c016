//! The LoRA adapters an engine's executor holds, as the engine thread
//! keeps them: names and stable ids, the prefix-cache key of each, the
//! limits on how many and of what rank, and loading and unloading while
//! the engine runs (between two steps, never under a request that uses
//! the adapter).

use std::collections::HashSet;
use std::sync::Arc;

use crate::api::{AdapterError, AdapterLoad};
use crate::executor::{AdapterFacts, Executor, ReadAdapter};
use crate::kv_manager::AdapterKey;

/// One adapter the executor holds.
#[derive(Debug, Clone)]
pub(crate) struct HeldAdapter {
    pub name: Arc<str>,
    /// Its id and the name its KV blocks are keyed on: the adapter's own,
    /// or, for a name loaded again after an unload, the name and the id,
    /// so no block computed with the earlier weights is ever adopted.
    pub key: AdapterKey,
    /// Requests submitted with it.
    requests: u64,
}

/// The held adapters and the limits on them.
#[derive(Debug)]
pub(crate) struct Adapters {
    held: Vec<HeldAdapter>,
    next_id: u32,
    /// Every name held so far.
    seen: HashSet<Arc<str>>,
    /// Adapters held at once, at most.
    max_loras: Option<usize>,
    /// The largest rank an adapter may have.
    max_rank: Option<usize>,
}

impl Adapters {
    /// The adapters the executor starts with, within the limits.
    pub fn new(
        facts: &[AdapterFacts],
        max_loras: Option<usize>,
        max_rank: Option<usize>,
    ) -> Result<Self, AdapterError> {
        let mut adapters = Self {
            held: Vec::new(),
            next_id: facts.iter().map(|f| f.id + 1).max().unwrap_or(1),
            seen: HashSet::new(),
            max_loras,
            max_rank,
        };
        for f in facts {
            adapters.check_room()?;
            adapters.admit(f)?;
        }
        Ok(adapters)
    }

    pub fn find(&self, name: &str) -> Option<&HeldAdapter> {
        self.held.iter().find(|a| &*a.name == name)
    }

    /// Counts a request submitted with adapter `id`.
    pub fn count_request(&mut self, id: u32) {
        if let Some(a) = self.held.iter_mut().find(|a| a.key.id == id) {
            a.requests += 1;
        }
    }

    /// Hands `adapter` (read by the executor's reader) to the executor
    /// under `name`.
    pub fn load(
        &mut self,
        executor: &mut dyn Executor,
        name: &str,
        adapter: ReadAdapter,
    ) -> Result<(), AdapterError> {
        if self.find(name).is_some() {
            return Err(AdapterError::Exists(name.to_string()));
        }
        self.check_room()?;
        let id = self.next_id;
        self.next_id += 1;
        let facts = executor
            .load_adapter(id, name, adapter)
            .map_err(|e| AdapterError::Load(e.0))?;
        if let Err(e) = self.admit(&facts) {
            // Over the rank limit: the executor lets it go again.
            let _ = executor.unload_adapter(id);
            return Err(e);
        }
        Ok(())
    }

    /// Drops adapter `name`, which `in_use` requests still run or wait with.
    pub fn unload(
        &mut self,
        executor: &mut dyn Executor,
        name: &str,
        in_use: impl Fn(u32) -> usize,
    ) -> Result<(), AdapterError> {
        let at = self
            .held
            .iter()
            .position(|a| &*a.name == name)
            .ok_or_else(|| AdapterError::NotFound(name.to_string()))?;
        let id = self.held[at].key.id;
        let requests = in_use(id);
        if requests > 0 {
            return Err(AdapterError::InUse {
                name: name.to_string(),
                requests,
            });
        }
        executor
            .unload_adapter(id)
            .map_err(|e| AdapterError::Load(e.0))?;
        self.held.remove(at);
        Ok(())
    }

    /// Each adapter's requests: `running` and `waiting` count, per id, the
    /// live requests of each kind.
    pub fn loads(&self, live: impl Iterator<Item = (u32, bool)> + Clone) -> Vec<AdapterLoad> {
        self.held
            .iter()
            .map(|a| {
                let mine = live.clone().filter(|&(id, _)| id == a.key.id);
                let running = mine.clone().filter(|&(_, admitted)| admitted).count();
                AdapterLoad {
                    name: a.name.to_string(),
                    running,
                    waiting: mine.count() - running,
                    requests: a.requests,
                }
            })
            .collect()
    }

    fn check_room(&self) -> Result<(), AdapterError> {
        match self.max_loras {
            Some(max) if self.held.len() >= max => Err(AdapterError::Full { held: max }),
            _ => Ok(()),
        }
    }

    fn admit(&mut self, f: &AdapterFacts) -> Result<(), AdapterError> {
        if let Some(max) = self.max_rank.filter(|&m| f.max_rank > m) {
            return Err(AdapterError::RankTooHigh {
                name: f.name.clone(),
                rank: f.max_rank,
                max,
            });
        }
        let name: Arc<str> = f.name.as_str().into();
        let key = if self.seen.insert(name.clone()) {
            name.clone()
        } else {
            format!("{}@{}", f.name, f.id).into()
        };
        self.held.push(HeldAdapter {
            name,
            key: AdapterKey {
                id: f.id,
                name: key,
            },
            requests: 0,
        });
        Ok(())
    }
}
