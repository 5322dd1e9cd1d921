//! A real `kvfence serve` process on a free loopback port, with its log
//! (stderr) captured, plus small HTTP helpers.

// In a test helper, a panic is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub struct Server {
    child: Child,
    /// What it was started with, for `restart`.
    args: Vec<String>,
    env: Vec<(String, String)>,
    /// The data directory made for it, removed with it (a restarted
    /// server keeps it).
    data: Option<tempfile::TempDir>,
    pub base: String,
    /// Where `/metrics` is served: a listener of its own, or the API's.
    pub metrics_base: String,
    log: Arc<Mutex<String>>,
    /// While set, nothing reads the server's stderr: its pipe fills.
    log_stalled: Arc<AtomicBool>,
}

impl Server {
    /// Starts `kvfence serve --port 0 ARGS...` and waits until it listens.
    /// The model is the offline `builtin:tiny` unless ARGS name one.
    pub fn start(args: &[&str]) -> Server {
        Server::start_with_env(args, &[])
    }

    /// [`Server::start`] with extra environment.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut full = vec!["serve", "--port", "0"];
        if !args.contains(&"--metrics-listen") {
            full.extend(["--metrics-listen", "127.0.0.1:0"]);
        }
        full.extend_from_slice(args);
        if !args.contains(&"--model") {
            full.extend(["--model", "builtin:tiny"]);
        }
        Server::start_process(&full, env)
    }

    /// Starts `kvfence ARGS...` with extra environment and waits for its
    /// "listening on ADDR" line; `base` is ADDR (with `http://` for HTTP).
    pub fn start_process(args: &[&str], env: &[(&str, &str)]) -> Server {
        // Its own data directory (stored responses), kept across
        // `restart`, unless the test names one.
        let mut env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let data = if env.iter().any(|(k, _)| k == "KVFENCE_DATA_DIR") {
            None
        } else {
            let dir = tempfile::tempdir().unwrap();
            env.push(("KVFENCE_DATA_DIR".into(), dir.path().display().to_string()));
            Some(dir)
        };
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvfence"))
            .args(args)
            .env_remove("RUST_LOG")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the kvfence binary starts");
        let log = Arc::new(Mutex::new(String::new()));
        let log_stalled = Arc::new(AtomicBool::new(false));
        let mut stderr = child.stderr.take().unwrap();
        let (sink, stalled) = (Arc::clone(&log), Arc::clone(&log_stalled));
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            loop {
                while stalled.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_millis(10));
                }
                let Ok(n) = stderr.read(&mut buf) else {
                    break;
                };
                if n == 0 {
                    break;
                }
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut metrics_base = None;
        let base = loop {
            let mut line = String::new();
            stdout.read_line(&mut line).unwrap();
            if let Some(address) = line.trim().strip_prefix("metrics on ") {
                metrics_base = Some(address.to_string());
                continue;
            }
            break line
                .trim()
                .strip_prefix("listening on ")
                .unwrap_or_else(|| {
                    panic!("server did not start: {line:?}\n{}", log.lock().unwrap())
                })
                .to_string();
        };
        let metrics_base = metrics_base.unwrap_or_else(|| base.clone());
        Server {
            child,
            args: args.iter().map(|a| a.to_string()).collect(),
            env,
            data,
            base,
            metrics_base,
            log,
            log_stalled,
        }
    }

    /// Stops reading the server's stderr (`true`), as a log reader that
    /// fell behind does — its pipe fills — or reads it again (`false`).
    pub fn stall_log(&self, stalled: bool) {
        self.log_stalled.store(stalled, Ordering::Release);
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// The `/metrics` URL, wherever the server serves it.
    pub fn metrics_url(&self) -> String {
        format!("{}/metrics", self.metrics_base)
    }

    /// Everything the server logged so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Waits (up to 10 s) until the log contains `needle`: the log is read
    /// from the process as it writes it, so a line may lag its event.
    pub fn wait_for_log(&self, needle: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.log().contains(needle) {
            assert!(
                Instant::now() < deadline,
                "the log never said {needle:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The whole `/metrics` text.
    pub async fn metrics_text(&self) -> String {
        reqwest::get(self.metrics_url())
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// The sum of the `/metrics` series whose line passes `keep`.
    pub async fn metric_sum(&self, keep: impl Fn(&str) -> bool) -> f64 {
        let text = reqwest::get(self.metrics_url())
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .filter(|l| !l.starts_with('#') && keep(l))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// One metric's value: the sum over the series named as in
    /// `name_and_labels` (`name` or `name{label="value",...}`) that carry
    /// at least those labels, whatever others they have (such as `worker`).
    pub async fn metric(&self, name_and_labels: &str) -> f64 {
        let (name, wanted) = series(name_and_labels);
        self.metric_sum(|line| {
            let (got_name, got) = series(line.split(' ').next().unwrap_or(""));
            got_name == name && wanted.iter().all(|label| got.contains(label))
        })
        .await
    }

    /// KV pages some request holds (leased, shared and read, quarantined),
    /// over every worker's pool: neither free nor cached for later (idle or
    /// public).
    pub async fn pages_held(&self) -> f64 {
        self.metric_sum(|l| {
            l.starts_with("kvfence_pool_pages{")
                && !l.contains("state=\"free\"")
                && !l.contains("state=\"cached\"")
                && !l.contains("state=\"public\"")
        })
        .await
    }

    /// GETs `path` and parses the JSON body.
    pub async fn get_json(&self, path: &str) -> serde_json::Value {
        reqwest::get(self.url(path))
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// Waits until no KV page is leased or quarantined in any pool (I8).
    pub async fn wait_for_baseline(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let leased = self.pages_held().await;
            let running = self.metric("kvfence_running_requests").await;
            if leased == 0.0 && running == 0.0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "I8: pool not back at baseline ({leased} pages leased)"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Starts the same command again on the same addresses (after `kill`,
    /// or killing it first): a process coming back after a crash.
    pub fn restart(&mut self) {
        self.kill();
        let address = |base: &str| base.trim_start_matches("http://").to_string();
        let mut args = self.args.clone();
        for i in 1..args.len() {
            match args[i - 1].as_str() {
                "--listen" => args[i] = address(&self.base),
                "--metrics-listen" => args[i] = address(&self.metrics_base),
                "--port" => args[i] = address(&self.base).rsplit(':').next().unwrap().to_string(),
                _ => {}
            }
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let env: Vec<(&str, &str)> = self
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let mut fresh = Server::start_process(&args, &env);
        assert_eq!(fresh.base, self.base, "restarted on the same address");
        fresh.data = self.data.take();
        *self = fresh;
    }

    /// Sends SIGTERM: the process should drain and exit by itself.
    pub fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Kills the process at once, as a crash would.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the process to exit by itself, checks it exited cleanly,
    /// and returns everything it logged.
    pub fn log_after_exit(mut self) -> String {
        let status = self.child.wait().unwrap();
        // The log is read from the process as it writes it: let the reader
        // catch up with its last lines.
        std::thread::sleep(Duration::from_millis(200));
        let log = self.log();
        assert!(status.success(), "exited with {status}:\n{log}");
        std::mem::forget(self);
        log
    }

    /// How the process exited, if it did within `limit`.
    pub fn exited_within(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits for the process to exit by itself.
    pub fn wait(mut self) -> std::process::ExitStatus {
        let status = self.child.wait().unwrap();
        std::mem::forget(self);
        status
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A series' name and its `label="value"` pairs.
fn series(text: &str) -> (&str, Vec<&str>) {
    match text.split_once('{') {
        Some((name, labels)) => (
            name,
            labels
                .trim_end_matches('}')
                .split(',')
                .filter(|l| !l.is_empty())
                .collect(),
        ),
        None => (text, Vec::new()),
    }
}

/// Waits until `server` answers `path` with `status`.
pub async fn wait_for_status(server: &Server, path: &str, status: u16) {
    let url = format!("{}{path}", server.metrics_base);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got = reqwest::get(&url).await.map(|r| r.status().as_u16());
        if got.as_ref().ok() == Some(&status) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{url} answered {got:?}, not {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// POSTs JSON; returns status and parsed body.
pub async fn post(
    url: &str,
    key: Option<&str>,
    body: serde_json::Value,
) -> (u16, serde_json::Value) {
    let mut request = reqwest::Client::new().post(url).json(&body);
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

/// Reads a whole SSE response; returns the `data:` payloads in order.
pub async fn sse(url: &str, key: Option<&str>, body: serde_json::Value) -> (u16, Vec<String>) {
    let mut request = reqwest::Client::new().post(url).json(&body);
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    let data = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(str::to_string)
        .collect();
    (status, data)
}

/// A streamed completion of `n` choices and `max_tokens` each, begun and
/// left running: it holds its slots until the response is dropped or its
/// tokens are done. On `builtin:tiny` the second comes within half a
/// second; a test whose hold must outlast its own waits serves
/// `builtin:small`, which takes minutes.
pub async fn hold_slots(
    url: &str,
    key: Option<&str>,
    n: usize,
    max_tokens: usize,
) -> reqwest::Response {
    let mut request = reqwest::Client::new().post(url).json(
        &serde_json::json!({"prompt": "go", "n": n, "max_tokens": max_tokens, "ignore_eos": true, "stream": true}),
    );
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await.unwrap();
    assert_eq!(response.status(), 200);
    response
}

/// Creates a tenant with `kvfence tenant add`; returns (key, config lines).
/// The key is told on standard error; standard output is the lines alone,
/// so `tenant add NAME >> tenants.toml` appends them (the tests write
/// them into tenants files as they come) and the key never lands there.
pub fn tenant(name: &str, extra: &[&str]) -> (String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvfence"))
        .args(["tenant", "add", name])
        .args(extra)
        .output()
        .unwrap();
    assert!(out.status.success());
    let told = String::from_utf8(out.stderr).unwrap();
    let key = told
        .split_whitespace()
        .find(|w| w.starts_with("kvf-"))
        .expect("the key is told on standard error")
        .to_string();
    let lines = String::from_utf8(out.stdout).unwrap();
    assert!(!lines.contains("kvf-"), "the key stays out of the lines");
    assert!(
        lines.trim_start().starts_with("[[tenants]]"),
        "standard output is the tenants file's lines alone"
    );
    (key, lines)
}

/// Cluster credentials written by `kvfence cluster init` into a fresh
/// directory; keep the returned guard alive while processes use it.
pub struct ClusterTls {
    dir: tempfile::TempDir,
}

impl ClusterTls {
    pub fn init() -> ClusterTls {
        let dir = tempfile::tempdir().unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_kvfence"))
            .args(["cluster", "init", "--out"])
            .arg(dir.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "cluster init: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        ClusterTls { dir }
    }

    /// The directory, for `--tls-dir`.
    pub fn dir(&self) -> &str {
        self.dir.path().to_str().unwrap()
    }

    pub fn path(&self) -> &std::path::Path {
        self.dir.path()
    }
}

/// Writes a tenants file holding `configs`; keep the returned guard alive.
pub fn tenants_file(configs: &[String]) -> tempfile::NamedTempFile {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), configs.concat()).unwrap();
    file
}

/// The Python of a virtual environment `name` (under the target's temp
/// directory) holding exactly the pinned `requirements`: made, or remade
/// when the pins change, with `python3 -m venv` and `pip install`.
pub fn venv_python(name: &str, requirements: &std::path::Path) -> std::path::PathBuf {
    // Tests run as threads of one process: one makes the environment
    // while the others wait for it.
    static MAKING: Mutex<()> = Mutex::new(());
    let _making = MAKING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let venv = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let stamp = venv.join("installed-requirements.txt");
    let python = venv.join("bin").join("python");
    let wanted =
        std::fs::read(requirements).expect("the pinned requirements are in the repository");
    if std::fs::read(&stamp).ok().as_ref() != Some(&wanted) {
        let made = Command::new("python3")
            .args(["-m", "venv", "--clear"])
            .arg(&venv)
            .status()
            .expect("python3 runs");
        assert!(made.success(), "python3 -m venv failed");
        let installed = Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "-r",
            ])
            .arg(requirements)
            .status()
            .expect("pip runs");
        assert!(
            installed.success(),
            "pip could not install {}",
            requirements.display()
        );
        std::fs::write(&stamp, &wanted).unwrap();
    }
    python
}

/// A PostgreSQL server of the test's own: a fresh cluster in a temporary
/// directory, on a free loopback port, trusting the local user `kvfence`;
/// stopped and removed when dropped. Run as the `postgres` user when the
/// tests run as root (PostgreSQL refuses root).
pub struct Postgres {
    dir: tempfile::TempDir,
    bin: std::path::PathBuf,
    as_postgres: bool,
    /// `postgres://kvfence@127.0.0.1:PORT/postgres`.
    pub url: String,
}

impl Postgres {
    fn command(bin: &std::path::Path, as_postgres: bool, program: &str) -> Command {
        if as_postgres {
            let mut command = Command::new("runuser");
            command
                .args(["-u", "postgres", "--"])
                .arg(bin.join(program));
            command
        } else {
            Command::new(bin.join(program))
        }
    }

    /// Starts one, or None (said) where PostgreSQL is not installed —
    /// unless `KVFENCE_REQUIRE_POSTGRES` is set (CI installs it and sets it).
    pub fn start() -> Option<Postgres> {
        Postgres::start_with(false)
    }

    /// One that takes TCP connections over TLS only, its certificate (for
    /// `127.0.0.1` and `localhost`) signed by a CA of its own, whose PEM is
    /// the returned path.
    pub fn start_tls() -> Option<(Postgres, std::path::PathBuf)> {
        let postgres = Postgres::start_with(true)?;
        let ca = postgres.dir.path().join("ca.crt");
        Some((postgres, ca))
    }

    fn start_with(tls: bool) -> Option<Postgres> {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .into_iter()
            .flatten()
            .flatten()
            .map(|version| version.path().join("bin"))
            .filter(|bin| bin.join("initdb").exists())
            .max();
        let Some(bin) = bin else {
            assert!(
                std::env::var_os("KVFENCE_REQUIRE_POSTGRES").is_none(),
                "PostgreSQL is required (KVFENCE_REQUIRE_POSTGRES) but /usr/lib/postgresql/*/bin/initdb is missing"
            );
            eprintln!("SKIPPED: PostgreSQL is not installed here");
            return None;
        };
        let as_postgres = Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|out| out.stdout.trim_ascii() == b"0");
        let dir = tempfile::tempdir().unwrap();
        if as_postgres {
            let owned = Command::new("chown")
                .args(["postgres:"])
                .arg(dir.path())
                .status()
                .unwrap();
            assert!(owned.success(), "chown of the cluster's directory");
        }
        let data = dir.path().join("data");
        let out = Postgres::command(&bin, as_postgres, "initdb")
            .arg("-D")
            .arg(&data)
            .args(["-U", "kvfence", "-A", "trust", "-E", "UTF8", "--no-sync"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut options = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off",
            dir.path().display()
        );
        if tls {
            Postgres::certificates(dir.path(), as_postgres);
            // TCP only over TLS: a client in the clear is turned away.
            std::fs::write(
                data.join("pg_hba.conf"),
                "local all all trust\nhostssl all all 127.0.0.1/32 trust\n",
            )
            .unwrap();
            options.push_str(&format!(
                " -c ssl=on -c ssl_cert_file={0}/server.crt -c ssl_key_file={0}/server.key",
                dir.path().display()
            ));
        }
        let out = Postgres::command(&bin, as_postgres, "pg_ctl")
            .arg("-D")
            .arg(&data)
            .arg("-l")
            .arg(dir.path().join("log"))
            .args(["-w", "-o", &options, "start"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "pg_ctl start: {}{}",
            String::from_utf8_lossy(&out.stdout),
            std::fs::read_to_string(dir.path().join("log")).unwrap_or_default()
        );
        Some(Postgres {
            url: format!("postgres://kvfence@127.0.0.1:{port}/postgres"),
            dir,
            bin,
            as_postgres,
        })
    }
}

impl Postgres {
    /// Writes `ca.crt`, and `server.crt` and `server.key` (for
    /// `127.0.0.1` and `localhost`, signed by that CA) into `dir`, the key
    /// readable by the server's user only.
    fn certificates(dir: &std::path::Path, as_postgres: bool) {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(rcgen::DnType::CommonName, "test PostgreSQL CA");
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let issuer = rcgen::Issuer::new(ca, ca_key);
        let key = rcgen::KeyPair::generate().unwrap();
        let server =
            rcgen::CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
                .unwrap()
                .signed_by(&key, &issuer)
                .unwrap();
        std::fs::write(dir.join("ca.crt"), ca_cert.pem()).unwrap();
        std::fs::write(dir.join("server.crt"), server.pem()).unwrap();
        let key_path = dir.join("server.key");
        std::fs::write(&key_path, key.serialize_pem()).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&key_path, std::fs::Permissions::from_mode(0o600)).unwrap();
        if as_postgres {
            let owned = Command::new("chown")
                .args(["postgres:"])
                .arg(dir.join("server.crt"))
                .arg(&key_path)
                .status()
                .unwrap();
            assert!(owned.success(), "chown of the server's certificate");
        }
    }
}

/// A PostgreSQL server stopped in its tracks (SIGSTOP): its sockets stay
/// open and the kernel acknowledges what is sent, but nothing answers — a
/// database stuck on its disk or a lock. It goes on when this is dropped.
pub struct Frozen {
    pids: Vec<String>,
}

impl Postgres {
    /// Stops every process of the server until the returned guard drops.
    pub fn freeze(&self) -> Frozen {
        let pid_file =
            std::fs::read_to_string(self.dir.path().join("data/postmaster.pid")).unwrap();
        let postmaster = pid_file.lines().next().unwrap().trim().to_string();
        let children = Command::new("pgrep")
            .args(["-P", &postmaster])
            .output()
            .unwrap();
        let mut pids = vec![postmaster];
        pids.extend(
            String::from_utf8_lossy(&children.stdout)
                .split_whitespace()
                .map(str::to_string),
        );
        let stopped = Command::new("kill")
            .arg("-STOP")
            .args(&pids)
            .status()
            .unwrap();
        assert!(stopped.success(), "SIGSTOP to the PostgreSQL server");
        Frozen { pids }
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        let _ = Command::new("kill").arg("-CONT").args(&self.pids).status();
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let _ = Postgres::command(&self.bin, self.as_postgres, "pg_ctl")
            .arg("-D")
            .arg(self.dir.path().join("data"))
            .args(["-m", "immediate", "stop"])
            .output();
    }
}
