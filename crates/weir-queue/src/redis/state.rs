//! Node state and shared quotas, read from and taken through Redis.

use std::collections::HashMap;
use std::time::Duration;

use super::keys;
use super::RedisQueue;
use crate::{StateError, StateKey, StateRead, Versioned};

#[async_trait::async_trait]
impl StateRead for RedisQueue {
    async fn read(&self, key: &StateKey) -> Result<Versioned, StateError> {
        let p = self.prefix_of(&key.flow);
        let mut c = self.conn.clone();
        let (value, version): (Option<String>, Option<u64>) = redis::pipe()
            .hget(keys::state(p, &key.flow, &key.node), &key.key)
            .hget(keys::versions(p, &key.flow, &key.node), &key.key)
            .query_async(&mut c)
            .await
            .map_err(|e| StateError(e.to_string()))?;
        Ok(Versioned {
            value: value
                .map(|v| serde_json::from_str(&v))
                .transpose()
                .map_err(|e| StateError(e.to_string()))?,
            version: version.unwrap_or(0),
        })
    }

    async fn read_node(
        &self,
        flow: &str,
        node: &str,
    ) -> Result<Vec<(String, Versioned)>, StateError> {
        let p = self.prefix_of(flow);
        let mut c = self.conn.clone();
        let (values, versions): (HashMap<String, String>, HashMap<String, u64>) = redis::pipe()
            .hgetall(keys::state(p, flow, node))
            .hgetall(keys::versions(p, flow, node))
            .query_async(&mut c)
            .await
            .map_err(|e| StateError(e.to_string()))?;
        values
            .into_iter()
            .map(|(k, v)| {
                let version = versions.get(&k).copied().unwrap_or(0);
                let value = serde_json::from_str(&v).map_err(|e| StateError(e.to_string()))?;
                Ok((
                    k,
                    Versioned {
                        value: Some(value),
                        version,
                    },
                ))
            })
            .collect()
    }
}

#[async_trait::async_trait]
impl crate::SharedQuotas for RedisQueue {
    async fn take_quota(
        &self,
        key: &StateKey,
        every: Duration,
        burst: u32,
        want: u32,
    ) -> Result<weir_state::Quota, StateError> {
        let p = self.prefix_of(&key.flow);
        let k = keys::quota(p, &key.flow, &key.node, &key.key);
        let mut c = self.conn.clone();
        let (granted, next_us): (u32, u64) = self
            .scripts
            .quota
            .key(k)
            .arg(every.as_micros().max(1) as u64)
            .arg(burst.max(1))
            .arg(want)
            .invoke_async(&mut c)
            .await
            .map_err(|e| StateError(e.to_string()))?;
        Ok(weir_state::Quota {
            granted,
            next_in: Duration::from_micros(next_us),
        })
    }
}
