//! How a server's URL is shown in an error or the log: with its password and its secret query
//! values hidden, so that an engine that cannot reach its Redis, its broker or an
//! http-request's server says which one without writing the credentials into the log or a
//! dead letter's reason (docs/security.md).

use std::borrow::Cow;

/// `url` with the password of its `USER:PASSWORD@` (each one, for a list of nodes) shown as
/// `***`; a `TOKEN@` with no colon is hidden whole; and so is the value of each query
/// parameter whose name says it holds a secret (`?api_key=`, `&token=`, `&sig=`: see
/// `secret_name`). Everything else is kept.
pub fn url(url: &str) -> Cow<'_, str> {
    match query_hidden(url) {
        Cow::Borrowed(_) => userinfo_hidden(url),
        Cow::Owned(q) => Cow::Owned(userinfo_hidden(&q).into_owned()),
    }
}

/// Whether a query parameter named `name` holds a secret, by the words such names are made
/// of: `key` (`api_key`, `apikey`, `access_key`), `token`, `secret`, `password`, `passwd`,
/// `pwd`, `auth`, `sig` (`signature`), `credential`, `session`.
fn secret_name(name: &str) -> bool {
    const WORDS: [&str; 10] = [
        "key",
        "token",
        "secret",
        "password",
        "passwd",
        "pwd",
        "auth",
        "sig",
        "credential",
        "session",
    ];
    let name = name.to_ascii_lowercase();
    WORDS.iter().any(|w| name.contains(w))
}

/// `url` with the values of its secret query parameters shown as `***`.
fn query_hidden(url: &str) -> Cow<'_, str> {
    let Some(q) = url.find('?') else {
        return Cow::Borrowed(url);
    };
    let end = url[q..].find('#').map_or(url.len(), |i| q + i);
    let query = &url[q + 1..end];
    let hides = |pair: &str| {
        pair.split_once('=')
            .is_some_and(|(k, v)| !v.is_empty() && secret_name(k))
    };
    if !query.split('&').any(hides) {
        return Cow::Borrowed(url);
    }
    let pairs: Vec<Cow<'_, str>> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((k, _)) if hides(pair) => Cow::Owned(format!("{k}=***")),
            _ => Cow::Borrowed(pair),
        })
        .collect();
    Cow::Owned(format!("{}?{}{}", &url[..q], pairs.join("&"), &url[end..]))
}

/// `url` with the credentials before its hosts hidden.
fn userinfo_hidden(url: &str) -> Cow<'_, str> {
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
    fn passwords_and_secret_query_values_are_hidden_and_the_server_still_named() {
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
            (
                "https://api.example/v1/send?api_key=s3cr3t&to=kitchen",
                "https://api.example/v1/send?api_key=***&to=kitchen",
            ),
            (
                "https://u:pw@api.example/x?to=a@b&access_token=abc&Signature=zz#frag",
                "https://u:***@api.example/x?to=a@b&access_token=***&Signature=***#frag",
            ),
            (
                "https://hooks.example/x?apiKey=1&token=&page=2",
                "https://hooks.example/x?apiKey=***&token=&page=2",
            ),
            (
                "redis://127.0.0.1:6379/0?ns=a&shards=4&max_ready=10",
                "redis://127.0.0.1:6379/0?ns=a&shards=4&max_ready=10",
            ),
        ] {
            assert_eq!(url(given), shown, "{given}");
        }
    }
}

/// `text` with its control characters escaped (`\n`, `\u{1b}`…), so that what a script
/// prints or a stored value holds cannot forge a log line or drive a terminal.
pub fn controls(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

#[cfg(test)]
mod control_tests {
    #[test]
    fn control_characters_are_escaped_and_the_rest_kept() {
        assert_eq!(super::controls("plain é"), "plain é");
        assert_eq!(super::controls("a\nb\u{1b}[31mc\r"), "a\\nb\\u{1b}[31mc\\r");
    }
}
