//! How a server's URL is shown in an error or the log: with its password hidden, so that an
//! engine that cannot reach its Redis or its broker says which one without writing the
//! credentials into the log (docs/security.md).

use std::borrow::Cow;

/// `url` with the password of its `USER:PASSWORD@` (each one, for a list of nodes) shown as
/// `***`; a `TOKEN@` with no colon is hidden whole. Everything else is kept.
pub fn url(url: &str) -> Cow<'_, str> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Cow::Borrowed(url);
    };
    // The credentials end at the last `@` before the query; the hosts after it end at the
    // first `/`. (A password may hold a `/` or an `@` a client would take as it is.)
    let query = rest.find(['?', '#']).unwrap_or(rest.len());
    let Some(at) = rest[..query].rfind('@') else {
        return Cow::Borrowed(url);
    };
    let end = rest[at..query].find('/').map_or(query, |i| at + i);
    let hosts: Vec<String> = rest[..end]
        .split(',')
        .map(|part| match part.rsplit_once('@') {
            Some((creds, host)) => match creds.split_once(':') {
                Some((user, _)) => format!("{user}:***@{host}"),
                None => format!("***@{host}"),
            },
            None => part.to_string(),
        })
        .collect();
    Cow::Owned(format!("{scheme}://{}{}", hosts.join(","), &rest[end..]))
}

#[cfg(test)]
mod tests {
    use super::url;

    #[test]
    fn a_password_is_hidden_and_the_server_still_named() {
        for (given, shown) in [
            (
                "redis://127.0.0.1:6379/2?ns=a",
                "redis://127.0.0.1:6379/2?ns=a",
            ),
            (
                "redis://:hunter2@10.0.0.1:6379",
                "redis://:***@10.0.0.1:6379",
            ),
            (
                "rediss://weir:hunter2@cache:6380/1?ns=a",
                "rediss://weir:***@cache:6380/1?ns=a",
            ),
            ("mqtt://hunter2@broker:1883", "mqtt://***@broker:1883"),
            (
                "mqtt://u:p@ss:w/rd@broker:1883?inflight=5",
                "mqtt://u:***@broker:1883?inflight=5",
            ),
            (
                "redis-cluster://:hunter2@a:1,:hunter2@b:2?shards=4",
                "redis-cluster://:***@a:1,:***@b:2?shards=4",
            ),
            (
                "https://api.example/x?to=a@b",
                "https://api.example/x?to=a@b",
            ),
            ("sqlite:weir-data/queue.db", "sqlite:weir-data/queue.db"),
        ] {
            assert_eq!(url(given), shown, "{given}");
        }
    }
}
