//! A headless Chromium driven through chromedriver's WebDriver protocol (plain HTTP + JSON,
//! so nothing beyond reqwest): Debian's `chromium` and `chromium-driver` packages, started on
//! a free loopback port and stopped by PID.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

pub struct Browser {
    base: String,
    session: String,
    http: reqwest::Client,
    driver: Child,
    _profile: tempfile::TempDir,
}

impl Browser {
    /// Start chromedriver and a headless Chromium window of `width` × `height`.
    pub async fn start(width: u32, height: u32) -> Browser {
        for bin in ["/usr/bin/chromedriver", "/usr/bin/chromium"] {
            assert!(
                std::path::Path::new(bin).exists(),
                "{bin} is missing: install Debian's browser for the dashboard test \
                 (apt-get install chromium chromium-driver; .ci/run does)"
            );
        }
        let port = weir_queue::testing::free_port();
        let driver = Command::new("/usr/bin/chromedriver")
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver starts");
        let base = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(r) = http.get(format!("{base}/status")).send().await {
                if r.json::<Value>()
                    .await
                    .ok()
                    .is_some_and(|v| v["value"]["ready"] == true)
                {
                    break;
                }
            }
            assert!(Instant::now() < deadline, "chromedriver did not come up");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let profile = tempfile::tempdir().expect("a profile directory");
        let caps = json!({ "capabilities": { "alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": "/usr/bin/chromium",
                "args": [
                    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--no-first-run", "--disable-extensions",
                    format!("--window-size={width},{height}"),
                    format!("--user-data-dir={}", profile.path().display()),
                ]
            }
        }}});
        let r: Value = http
            .post(format!("{base}/session"))
            .json(&caps)
            .send()
            .await
            .expect("chromedriver answers")
            .json()
            .await
            .expect("JSON");
        let session = r["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no browser session: {r}"))
            .to_string();
        Browser {
            base,
            session,
            http,
            driver,
            _profile: profile,
        }
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let url = format!("{}/session/{}{path}", self.base, self.session);
        let mut req = self.http.request(method, url);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let v: Value = req
            .send()
            .await
            .expect("chromedriver answers")
            .json()
            .await
            .expect("JSON");
        v["value"].clone()
    }

    pub async fn goto(&self, url: &str) {
        self.call(reqwest::Method::POST, "/url", Some(json!({ "url": url })))
            .await;
    }

    /// The first element `css` selects, if any.
    pub async fn find(&self, css: &str) -> Option<String> {
        let v = self
            .call(
                reqwest::Method::POST,
                "/element",
                Some(json!({ "using": "css selector", "value": css })),
            )
            .await;
        v[ELEMENT].as_str().map(str::to_string)
    }

    /// Wait up to `within` for an element `css` selects.
    pub async fn wait_for(&self, css: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            if let Some(e) = self.find(css).await {
                return e;
            }
            assert!(
                Instant::now() < deadline,
                "nothing matched `{css}` within {within:?}; the page:\n{}",
                self.text("body").await
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn count(&self, css: &str) -> usize {
        self.call(
            reqwest::Method::POST,
            "/elements",
            Some(json!({ "using": "css selector", "value": css })),
        )
        .await
        .as_array()
        .map(Vec::len)
        .unwrap_or(0)
    }

    /// Click the first element `css` selects. A click chromedriver refuses fails the test
    /// with its reason, rather than being lost without a word.
    pub async fn click(&self, css: &str) {
        let e = self.wait_for(css, Duration::from_secs(10)).await;
        let v = self
            .call(
                reqwest::Method::POST,
                &format!("/element/{e}/click"),
                Some(json!({})),
            )
            .await;
        if let Some(error) = v["error"].as_str() {
            panic!(
                "clicking `{css}` failed: {error}: {}",
                v["message"].as_str().unwrap_or("")
            );
        }
    }

    pub async fn type_into(&self, css: &str, text: &str) {
        let e = self.wait_for(css, Duration::from_secs(10)).await;
        self.call(
            reqwest::Method::POST,
            &format!("/element/{e}/value"),
            Some(json!({ "text": text })),
        )
        .await;
    }

    /// The visible text of the first element `css` selects ("" when there is none).
    pub async fn text(&self, css: &str) -> String {
        let v = self
            .call(
                reqwest::Method::POST,
                "/element",
                Some(json!({ "using": "css selector", "value": css })),
            )
            .await;
        let Some(e) = v[ELEMENT].as_str() else {
            return String::new();
        };
        self.call(reqwest::Method::GET, &format!("/element/{e}/text"), None)
            .await
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// Attribute `name` of the first element `css` selects.
    pub async fn attr(&self, css: &str, name: &str) -> Option<String> {
        let e = self.find(css).await?;
        self.call(
            reqwest::Method::GET,
            &format!("/element/{e}/attribute/{name}"),
            None,
        )
        .await
        .as_str()
        .map(str::to_string)
    }

    /// Run `script` in the page (its last argument is the callback to call with the answer).
    pub async fn eval_async(&self, script: &str) -> Value {
        self.call(
            reqwest::Method::POST,
            "/execute/async",
            Some(json!({ "script": script, "args": [] })),
        )
        .await
    }

    /// A PNG of the window.
    pub async fn screenshot(&self) -> Vec<u8> {
        use base64::Engine;
        let v = self.call(reqwest::Method::GET, "/screenshot", None).await;
        base64::engine::general_purpose::STANDARD
            .decode(v.as_str().expect("a screenshot"))
            .expect("base64 PNG")
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Close the browser through its driver, then stop the driver by PID.
        let url = format!("{}/session/{}", self.base, self.session);
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            if let Ok(rt) = rt {
                rt.block_on(async {
                    let _ = tokio::time::timeout(
                        Duration::from_secs(5),
                        reqwest::Client::new().delete(url).send(),
                    )
                    .await;
                });
            }
        })
        .join();
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}
