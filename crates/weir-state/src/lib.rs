//! Node state: a small key-value memory per (flow, node) — guard values, timer deadlines,
//! script state, held messages.
//!
//! State lives in the same backend as the queue, so that a wave's state writes commit together
//! with its ack. A wave never writes to the backend directly: it reads through an [`Overlay`]
//! (which remembers the version of everything it read and shows the wave its own writes) and
//! hands the overlay's writes to the queue's commit, which refuses them if any version moved.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Where a value lives: a key inside one node's memory.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct StateKey {
    pub flow: String,
    pub node: String,
    pub key: String,
}

impl StateKey {
    pub fn new(flow: impl Into<String>, node: impl Into<String>, key: impl Into<String>) -> Self {
        StateKey {
            flow: flow.into(),
            node: node.into(),
            key: key.into(),
        }
    }
}

/// A stored value with its version. Version 0 means "never written"; every write bumps it.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Versioned {
    pub value: Option<Value>,
    pub version: u64,
}

/// One write of a wave: the new value (`None` deletes) and the version the wave read.
/// The commit MUST refuse the whole wave when the stored version is no longer `read_version`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StateWrite {
    pub key: StateKey,
    pub value: Option<Value>,
    pub read_version: u64,
}

#[derive(Debug, thiserror::Error)]
#[error("state backend unavailable: {0}")]
pub struct StateError(pub String);

/// Reading committed state. Implemented by every queue backend.
#[async_trait::async_trait]
pub trait StateRead: Send + Sync {
    async fn read(&self, key: &StateKey) -> Result<Versioned, StateError>;
    /// Every key of one node's memory.
    async fn read_node(
        &self,
        flow: &str,
        node: &str,
    ) -> Result<Vec<(String, Versioned)>, StateError>;

    /// How many keys of one node's memory start with `prefix`: counted where the backend
    /// can, without reading their values; by default from [`read_node`](Self::read_node).
    async fn count_node_keys(
        &self,
        flow: &str,
        node: &str,
        prefix: &str,
    ) -> Result<usize, StateError> {
        Ok(self
            .read_node(flow, node)
            .await?
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .count())
    }
}

/// Quotas every engine on one backend shares (Redis): a rate limit with `scope: cluster`
/// holds across engines. A backend one engine holds has none: a quota kept in that engine's
/// memory is already the only one.
#[async_trait::async_trait]
pub trait SharedQuotas: Send + Sync {
    /// Take up to `want` passes from the quota `key` (one pass every `every`, bursts of
    /// `burst`), shared by every engine on this backend, measured by the backend's clock.
    /// Returns how many were granted and, when fewer than `want`, how long until the next.
    /// A pass once taken is spent, whatever becomes of the wave that took it.
    async fn take_quota(
        &self,
        key: &StateKey,
        every: std::time::Duration,
        burst: u32,
        want: u32,
    ) -> Result<Quota, StateError>;
}

/// What [`SharedQuotas::take_quota`] granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    pub granted: u32,
    /// Until the next pass (zero when `granted` is all that was asked for).
    pub next_in: std::time::Duration,
}

/// One wave's view of state: committed values as first read, plus its own writes.
#[derive(Debug, Default)]
pub struct Overlay {
    read: HashMap<StateKey, Versioned>,
    writes: BTreeMap<StateKey, Option<Value>>,
}

impl Overlay {
    pub fn new() -> Self {
        Self::default()
    }

    /// The value as this wave sees it: its own write if any, else the committed value
    /// (read once and remembered, with its version, for the commit's check).
    pub async fn get(
        &mut self,
        store: &dyn StateRead,
        key: &StateKey,
    ) -> Result<Option<Value>, StateError> {
        if let Some(w) = self.writes.get(key) {
            return Ok(w.clone());
        }
        if let Some(v) = self.read.get(key) {
            return Ok(v.value.clone());
        }
        let v = store.read(key).await?;
        let value = v.value.clone();
        self.read.insert(key.clone(), v);
        Ok(value)
    }

    /// All keys of one node as this wave sees them.
    pub async fn get_node(
        &mut self,
        store: &dyn StateRead,
        flow: &str,
        node: &str,
    ) -> Result<BTreeMap<String, Value>, StateError> {
        let committed = store.read_node(flow, node).await?;
        let mut out = BTreeMap::new();
        for (k, v) in committed {
            let key = StateKey::new(flow, node, k.clone());
            self.read.entry(key).or_insert_with(|| v.clone());
            if let Some(value) = v.value {
                out.insert(k, value);
            }
        }
        for (key, w) in &self.writes {
            if key.flow == flow && key.node == node {
                match w {
                    Some(v) => out.insert(key.key.clone(), v.clone()),
                    None => out.remove(&key.key),
                };
            }
        }
        Ok(out)
    }

    /// Write (or with `None` delete) a value. Reads the version first if this wave has not,
    /// so that the commit can check nothing else wrote the key in between.
    pub async fn set(
        &mut self,
        store: &dyn StateRead,
        key: StateKey,
        value: Option<Value>,
    ) -> Result<(), StateError> {
        if !self.read.contains_key(&key) {
            let v = store.read(&key).await?;
            self.read.insert(key.clone(), v);
        }
        self.writes.insert(key, value);
        Ok(())
    }

    pub fn is_empty(&self) -> bool {
        self.writes.is_empty()
    }

    /// The writes to commit, each with the version this wave read.
    pub fn into_writes(self) -> Vec<StateWrite> {
        let read = self.read;
        self.writes
            .into_iter()
            .map(|(key, value)| {
                let read_version = read.get(&key).map(|v| v.version).unwrap_or(0);
                StateWrite {
                    key,
                    value,
                    read_version,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    struct Fixed(Mutex<HashMap<StateKey, Versioned>>);

    #[async_trait::async_trait]
    impl StateRead for Fixed {
        async fn read(&self, key: &StateKey) -> Result<Versioned, StateError> {
            Ok(self.0.lock().unwrap().get(key).cloned().unwrap_or_default())
        }
        async fn read_node(
            &self,
            flow: &str,
            node: &str,
        ) -> Result<Vec<(String, Versioned)>, StateError> {
            Ok(self
                .0
                .lock()
                .unwrap()
                .iter()
                .filter(|(k, _)| k.flow == flow && k.node == node)
                .map(|(k, v)| (k.key.clone(), v.clone()))
                .collect())
        }
    }

    #[tokio::test]
    async fn reads_own_writes_and_carries_read_versions() {
        let k = StateKey::new("f", "n", "timer");
        let store = Fixed(Mutex::new(HashMap::from([(
            k.clone(),
            Versioned {
                value: Some(Value::from("old")),
                version: 7,
            },
        )])));
        let mut o = Overlay::new();
        assert_eq!(o.get(&store, &k).await.unwrap(), Some(Value::from("old")));
        o.set(&store, k.clone(), Some(Value::from("new")))
            .await
            .unwrap();
        assert_eq!(o.get(&store, &k).await.unwrap(), Some(Value::from("new")));
        let fresh = StateKey::new("f", "n", "other");
        o.set(&store, fresh.clone(), None).await.unwrap();
        let w = o.into_writes();
        assert_eq!(w.len(), 2);
        assert_eq!(w.iter().find(|w| w.key == k).unwrap().read_version, 7);
        assert_eq!(w.iter().find(|w| w.key == fresh).unwrap().read_version, 0);
    }
}
