//! The Kubernetes manifests (`deploy/kubernetes`) as a cluster reads them
//! and as its pods would run them. Every layout renders with
//! `kubectl kustomize` and validates, strictly, against the Kubernetes API
//! schemas; the small layout's containers then run exactly as written —
//! command, arguments, environment, init containers first — as local
//! processes, with only ports and paths remapped to loopback and temporary
//! directories: the probes answer, a request goes through the router, the
//! gauges the gateway's endpoint picker is configured to read are on every
//! role's `/metrics` and move under load, and SIGTERM drains each role. A
//! flag renamed in the code fails here, not in a deployment.
//!
//! kubectl is part of this machine kind; where it is missing the tests say
//! so and pass, unless `KVFENCE_REQUIRE_KUBECTL` is set (CI sets it).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common::{ClusterTls, Server, post, tenant, venv_python};

/// The Kubernetes version the manifests are validated for: kubectl's.
const KUBERNETES: &str = "1.32.0";

fn deploy(layout: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy/kubernetes")
        .join(layout)
}

/// `kubectl kustomize LAYOUT`, or None (said) where kubectl is missing.
fn kustomize(layout: &str) -> Option<String> {
    let out = match Command::new("kubectl")
        .arg("kustomize")
        .arg(deploy(layout))
        .output()
    {
        Ok(out) => out,
        Err(error) if std::env::var_os("KVFENCE_REQUIRE_KUBECTL").is_none() => {
            eprintln!("SKIPPED: kubectl is not installed here ({error})");
            return None;
        }
        Err(error) => panic!("kubectl is required (KVFENCE_REQUIRE_KUBECTL): {error}"),
    };
    assert!(
        out.status.success(),
        "kubectl kustomize {layout}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(String::from_utf8(out.stdout).unwrap())
}

/// A layout's objects, each built-in one validated against the API
/// schemas; and the custom resources, which have none bundled.
fn render(layout: &str) -> Option<(Vec<Value>, Vec<String>)> {
    let yaml = kustomize(layout)?;
    let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/kubernetes");
    let python = venv_python("kubernetes-venv", &here.join("requirements.txt"));
    let mut child = Command::new(python)
        .arg(here.join("manifests.py"))
        .arg(KUBERNETES)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), yaml.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{layout} does not validate: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rendered: Value = serde_json::from_slice(&out.stdout).unwrap();
    let objects = rendered["objects"].as_array().unwrap().clone();
    let unvalidated = rendered["unvalidated"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap().to_string())
        .collect();
    Some((objects, unvalidated))
}

fn of_kind<'a>(objects: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objects.iter().filter(|o| o["kind"] == kind).collect()
}

fn name(object: &Value) -> &str {
    object["metadata"]["name"].as_str().unwrap()
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .map(|a| a.iter().map(|s| s.as_str().unwrap().to_string()).collect())
        .unwrap_or_default()
}

/// The value of `--flag=VALUE` among a container's arguments.
fn flag(container: &Value, flag: &str) -> Option<String> {
    strings(&container["args"])
        .into_iter()
        .find_map(|a| a.strip_prefix(&format!("{flag}=")).map(str::to_string))
}

/// Bytes of a quantity such as `768Mi` or `2Gi`.
fn bytes(quantity: &str) -> u64 {
    let (number, unit) = quantity.split_at(quantity.trim_end_matches(char::is_alphabetic).len());
    let scale = match unit {
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        other => panic!("unexpected unit {other:?}"),
    };
    number.parse::<u64>().unwrap() * scale
}

/// What `kvfence pool plan` says a SmolLM2 pool of `tokens` f16 tokens
/// takes, in bytes.
fn planned_pool_bytes(tokens: &str) -> u64 {
    let out = Command::new(env!("CARGO_BIN_EXE_kvfence"))
        .args([
            "pool",
            "plan",
            "--layers",
            "30",
            "--kv-heads",
            "3",
            "--head-dim",
            "64",
        ])
        .args(["--dtype", "f16", "--tokens", tokens])
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("memory"))
        .and_then(|l| l.split_whitespace().next())
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn every_layout_renders_and_validates_against_the_kubernetes_api_schemas() {
    for layout in ["overlays/small", "overlays/large"] {
        let Some((objects, unvalidated)) = render(layout) else {
            return;
        };
        assert!(unvalidated.is_empty(), "{layout}: {unvalidated:?}");
        let deployments = of_kind(&objects, "Deployment");
        let names: Vec<&str> = deployments.iter().map(|d| name(d)).collect();
        assert_eq!(
            names,
            ["kvfence-decode", "kvfence-prefill", "kvfence-router"]
        );
        for kind in ["Service", "PodDisruptionBudget"] {
            assert_eq!(of_kind(&objects, kind).len(), 3, "{layout}: {kind}");
        }
        let autoscaled: Vec<&str> = of_kind(&objects, "HorizontalPodAutoscaler")
            .iter()
            .map(|h| h["spec"]["scaleTargetRef"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(autoscaled, ["kvfence-decode", "kvfence-prefill"]);
        for deployment in deployments {
            let pod = &deployment["spec"]["template"]["spec"];
            let who = format!("{layout}: {}", name(deployment));
            assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "{who}");
            let containers = pod["containers"].as_array().unwrap();
            let main = &containers[0];
            for container in containers
                .iter()
                .chain(pod["initContainers"].as_array().unwrap())
            {
                assert_eq!(
                    container["securityContext"]["readOnlyRootFilesystem"], true,
                    "{who}"
                );
            }
            for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
                assert!(main[probe].is_object(), "{who}: no {probe}");
            }
            // Every container's command line parses — flag names and values
            // — in this layout too, not only the one that runs below:
            // clap reads each argument before it reaches `--help`.
            for container in containers
                .iter()
                .chain(pod["initContainers"].as_array().unwrap())
            {
                let argv = kvfence_argv(&who, container);
                let out = Command::new(env!("CARGO_BIN_EXE_kvfence"))
                    .args(&argv)
                    .arg("--help")
                    .output()
                    .unwrap();
                assert!(
                    out.status.success(),
                    "{who}: {argv:?} does not parse: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            // The kubelet must not kill a pod that is still draining.
            let drain: u64 = flag(main, "--shutdown-timeout").unwrap().parse().unwrap();
            let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
            assert!(grace > drain, "{who}: grace {grace} s ≤ drain {drain} s");
            // Workers ask for at least the memory their pool takes.
            if let Some(tokens) = flag(main, "--kv-pool-tokens") {
                let requested = bytes(main["resources"]["requests"]["memory"].as_str().unwrap());
                let pool = planned_pool_bytes(&tokens);
                assert!(
                    requested > pool,
                    "{who}: {requested} B asked, pool {pool} B"
                );
            }
        }
    }
    let Some((_, unvalidated)) = render("gateway") else {
        return;
    };
    assert_eq!(unvalidated, ["HTTPRoute/kvfence", "InferencePool/kvfence"]);
    let Some((certificates, unvalidated)) = render("cert-manager") else {
        return;
    };
    assert_eq!(
        certificates.len(),
        unvalidated.len(),
        "only custom resources"
    );
    let issued: Vec<&String> = unvalidated
        .iter()
        .filter(|n| n.starts_with("Certificate/") && n.ends_with("-tls"))
        .collect();
    assert_eq!(issued.len(), 3, "{unvalidated:?}");
}

/// The gauge names the endpoint picker is configured to read.
fn picker_metrics() -> Option<Vec<String>> {
    let yaml = kustomize("gateway")?;
    let metrics: Vec<String> = yaml
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- --"))
        .filter_map(|a| a.split_once("-metric="))
        .map(|(_, name)| name.to_string())
        .filter(|name| !name.is_empty())
        .collect();
    assert_eq!(metrics.len(), 4, "{metrics:?}");
    Some(metrics)
}

/// Where the small layout's pods run here: loopback ports for the ports
/// the manifests name, directories for the paths they mount.
struct Remap {
    /// `HOST:PORT` as written (Services, listen addresses) → loopback.
    addresses: BTreeMap<String, String>,
    /// Container port → local port, per Deployment.
    ports: BTreeMap<(String, u64), u16>,
    /// Mount path → local directory.
    paths: Vec<(String, PathBuf)>,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Remap {
    fn text(&self, deployment: &str, text: &str) -> String {
        let mut text = text.to_string();
        for (written, local) in &self.addresses {
            text = text.replace(written, local);
        }
        for ((owner, port), local) in &self.ports {
            if owner == deployment {
                text = text.replace(&format!("0.0.0.0:{port}"), &format!("127.0.0.1:{local}"));
                if text == format!("--port={port}") {
                    text = format!("--port={local}");
                }
            }
        }
        text = text.replace("--host=0.0.0.0", "--host=127.0.0.1");
        for (mount, dir) in &self.paths {
            if let Some(rest) = text.strip_prefix(mount.as_str()) {
                text = format!("{}{rest}", dir.display());
            } else if let Some((head, tail)) = text.split_once(&format!("={mount}")) {
                text = format!("{head}={}{tail}", dir.display());
            }
        }
        text
    }

    /// The local port of a container port given by name or number.
    fn port(&self, deployment: &Value, container: &Value, port: &Value) -> u16 {
        let number = match port {
            Value::String(named) => container["ports"]
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p["name"] == *named)
                .unwrap()["containerPort"]
                .as_u64()
                .unwrap(),
            number => number.as_u64().unwrap(),
        };
        self.ports[&(name(deployment).to_string(), number)]
    }
}

/// The model cache `kvfence` uses here, which the other SmolLM2 tests
/// fill: the manifests' `/models` volume maps onto it.
fn model_cache() -> PathBuf {
    if let Some(dir) = std::env::var_os("KVFENCE_CACHE_DIR") {
        return dir.into();
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return Path::new(&dir).join("kvfence");
    }
    Path::new(&std::env::var_os("HOME").unwrap()).join(".cache/kvfence")
}

/// Runs a container's command and arguments, remapped, with its
/// environment: the binary stands for the image's `kvfence`.
/// A container's command and arguments after the image's entry point,
/// which must be `kvfence` (the test binary stands for it).
fn kvfence_argv(who: &str, container: &Value) -> Vec<String> {
    let mut argv = strings(&container["command"]);
    assert_eq!(argv.remove(0), "kvfence", "{who}: the image's entry point");
    argv.extend(strings(&container["args"]));
    argv
}

fn command(
    remap: &Remap,
    deployment: &Value,
    container: &Value,
) -> (Vec<String>, Vec<(String, String)>) {
    let owner = name(deployment);
    let argv = kvfence_argv(owner, container)
        .iter()
        .map(|a| remap.text(owner, a))
        .collect();
    let env = container["env"]
        .as_array()
        .map(|vars| {
            vars.iter()
                .map(|v| {
                    let value = v["value"].as_str().expect("plain env values only");
                    (
                        v["name"].as_str().unwrap().to_string(),
                        remap.text(owner, value),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    (argv, env)
}

async fn get(url: &str) -> Option<(u16, String)> {
    let response = reqwest::get(url).await.ok()?;
    let status = response.status().as_u16();
    Some((status, response.text().await.ok()?))
}

async fn until_ok(url: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while get(url).await.map(|(s, _)| s) != Some(200) {
        assert!(Instant::now() < deadline, "{url} never answered 200");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The unlabelled value of `metric`, or of its only series.
fn gauge(text: &str, metric: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.starts_with(&format!("{metric} ")) || l.starts_with(&format!("{metric}{{")))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_small_layout_runs_as_written_on_loopback() {
    let Some(picker) = picker_metrics() else {
        return;
    };
    let Some((objects, _)) = render("overlays/small") else {
        return;
    };
    let deployments = of_kind(&objects, "Deployment");
    let by_name = |n: &str| *deployments.iter().find(|d| name(d) == n).unwrap();

    // Ports: every container port of every Deployment gets a loopback
    // port; every Service's HOST:PORT names its pods' local port.
    let mut remap = Remap {
        addresses: BTreeMap::new(),
        ports: BTreeMap::new(),
        paths: Vec::new(),
    };
    for deployment in &deployments {
        for port in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]
            .as_array()
            .unwrap()
        {
            let number = port["containerPort"].as_u64().unwrap();
            remap
                .ports
                .insert((name(deployment).to_string(), number), free_port());
        }
    }
    for service in of_kind(&objects, "Service") {
        let target = service["spec"]["selector"]["app.kubernetes.io/name"]
            .as_str()
            .unwrap();
        let deployment = by_name(target);
        let container = &deployment["spec"]["template"]["spec"]["containers"][0];
        for port in service["spec"]["ports"].as_array().unwrap() {
            let local = remap.port(deployment, container, &port["targetPort"]);
            remap.addresses.insert(
                format!("{}:{}", name(service), port["port"]),
                format!("127.0.0.1:{local}"),
            );
        }
    }

    // Paths: the model volume is this machine's model cache; each role's
    // TLS Secret is a directory laid out as Kubernetes mounts one.
    let scratch = tempfile::tempdir().unwrap();
    let tls = ClusterTls::init();
    let (key, tenant_lines) = tenant("acme", &[]);
    let tenants_dir = scratch.path().join("tenants");
    std::fs::create_dir_all(&tenants_dir).unwrap();
    std::fs::write(tenants_dir.join("tenants.toml"), tenant_lines).unwrap();
    let mut processes: BTreeMap<String, Server> = BTreeMap::new();
    for role in ["prefill", "decode", "router"] {
        let deployment = by_name(&format!("kvfence-{role}"));
        let pod = &deployment["spec"]["template"]["spec"];
        let secret_dir = scratch.path().join(format!("{role}-tls"));
        std::fs::create_dir_all(&secret_dir).unwrap();
        std::fs::copy(tls.path().join("ca.crt"), secret_dir.join("ca.crt")).unwrap();
        std::fs::copy(
            tls.path().join(format!("{role}.crt")),
            secret_dir.join("tls.crt"),
        )
        .unwrap();
        std::fs::copy(
            tls.path().join(format!("{role}.key")),
            secret_dir.join("tls.key"),
        )
        .unwrap();
        remap.paths.clear();
        for volume in pod["volumes"].as_array().unwrap() {
            let local = match volume["name"].as_str().unwrap() {
                "models" => model_cache(),
                "tls" => secret_dir.clone(),
                "tenants" => tenants_dir.clone(),
                other => {
                    let dir = scratch.path().join(format!("{role}-{other}"));
                    std::fs::create_dir_all(&dir).unwrap();
                    dir
                }
            };
            for container in pod["containers"]
                .as_array()
                .unwrap()
                .iter()
                .chain(pod["initContainers"].as_array().unwrap())
            {
                for mount in container["volumeMounts"].as_array().unwrap() {
                    if mount["name"] == volume["name"] {
                        let path = mount["mountPath"].as_str().unwrap().to_string();
                        if !remap.paths.iter().any(|(p, _)| *p == path) {
                            remap.paths.push((path, local.clone()));
                        }
                    }
                }
            }
        }
        for init in pod["initContainers"].as_array().unwrap() {
            let (argv, env) = command(&remap, deployment, init);
            let out = Command::new(env!("CARGO_BIN_EXE_kvfence"))
                .args(&argv)
                .envs(env)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{role}'s init container {argv:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let container = &pod["containers"][0];
        let (argv, env) = command(&remap, deployment, container);
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let server = Server::start_process(&argv, &env);
        for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
            let http = &container[probe]["httpGet"];
            let port = remap.port(deployment, container, &http["port"]);
            until_ok(&format!(
                "http://127.0.0.1:{port}{}",
                http["path"].as_str().unwrap()
            ))
            .await;
        }
        processes.insert(role.to_string(), server);
    }

    let router = by_name("kvfence-router");
    let router_container = &router["spec"]["template"]["spec"]["containers"][0];
    let api = remap.port(router, router_container, &json!("http"));
    let chat = format!("http://127.0.0.1:{api}/v1/chat/completions");
    // Prompts of a few hundred tokens, each different from its first
    // words on, so every one is prefilled (no prefix cache hit) and the
    // prefill worker's gauges have time to show it.
    let ask = |max_tokens: u32, n: usize| {
        let chat = chat.clone();
        let key = key.clone();
        let content = format!(
            "Request {n}. {} Name three rivers in Europe, with a sentence on each.",
            "Rivers shape the land they cross, carry silt to the sea and water to cities. "
                .repeat(20)
        );
        async move {
            post(
                &chat,
                Some(&key),
                json!({"model": "smollm2", "max_tokens": max_tokens, "temperature": 0,
                       "messages": [{"role": "user", "content": content}]}),
            )
            .await
        }
    };
    let (status, body) = ask(8, 0).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 8, "{body}");

    // Every role's metrics port carries the picker's gauges; under load
    // they move, and afterwards they return to baseline.
    let metrics: Vec<(String, String)> = ["prefill", "decode", "router"]
        .iter()
        .map(|role| {
            let deployment = by_name(&format!("kvfence-{role}"));
            let container = &deployment["spec"]["template"]["spec"]["containers"][0];
            let port = remap.port(deployment, container, &json!("metrics"));
            (role.to_string(), format!("http://127.0.0.1:{port}/metrics"))
        })
        .collect();
    let load: Vec<_> = (1..=6).map(|n| tokio::spawn(ask(48, n))).collect();
    let mut moved: BTreeMap<String, bool> = BTreeMap::new();
    while !load.iter().all(|h| h.is_finished()) {
        for (role, url) in &metrics {
            let (_, text) = get(url).await.unwrap();
            for metric in &picker {
                let value = gauge(&text, metric)
                    .unwrap_or_else(|| panic!("{role}'s /metrics lacks {metric}:\n{text}"));
                if !metric.ends_with("_info") && value > 0.0 {
                    moved.insert(role.clone(), true);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for handle in load {
        let (status, body) = handle.await.unwrap();
        assert_eq!(status, 200, "{body}");
    }
    for (role, _) in &metrics {
        assert!(
            moved.contains_key(role),
            "{role}'s gauges never moved under load"
        );
    }
    for (role, url) in &metrics {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let (_, text) = get(url).await.unwrap();
            let at_rest = picker
                .iter()
                .filter(|m| !m.ends_with("_info"))
                .all(|m| gauge(&text, m) == Some(0.0));
            if at_rest {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{role} never returned to baseline:\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    // SIGTERM drains: the router finishes a request in flight first, then
    // every role exits cleanly.
    let in_flight = tokio::spawn(ask(32, 7));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let router = processes.remove("router").unwrap();
    router.terminate();
    let (status, body) = in_flight.await.unwrap();
    assert_eq!(
        status, 200,
        "the request in flight was drained, not cut: {body}"
    );
    let mut logs = vec![("router", router)];
    for role in ["decode", "prefill"] {
        let server = processes.remove(role).unwrap();
        server.terminate();
        logs.push((role, server));
    }
    for (role, server) in logs {
        let log = tokio::task::spawn_blocking(move || server.log_after_exit())
            .await
            .unwrap();
        assert!(
            !log.contains("Rivers shape"),
            "I10: prompt text in the {role}'s log"
        );
    }
}

/// A container engine that answers here (podman or docker), if any.
fn container_engine() -> Option<&'static str> {
    ["podman", "docker"].into_iter().find(|engine| {
        Command::new(engine)
            .arg("info")
            .output()
            .is_ok_and(|out| out.status.success())
    })
}

#[test]
fn the_container_image_builds_and_serves() {
    let Some(engine) = container_engine() else {
        eprintln!("SKIPPED: no container engine answers here (podman info, docker info)");
        return;
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let tag = "localhost/kvfence:test";
    let built = Command::new(engine)
        .args([
            "build",
            "-f",
            "deploy/container/Containerfile",
            "-t",
            tag,
            ".",
        ])
        .current_dir(&root)
        .status()
        .unwrap();
    assert!(built.success(), "{engine} build failed");
    let port = free_port();
    let container = format!("kvfence-test-{port}");
    let started = Command::new(engine)
        // The host's network, so local mode's loopback-only listener is
        // reachable from here.
        .args([
            "run",
            "-d",
            "--rm",
            "--read-only",
            "--network=host",
            "--name",
            &container,
        ])
        .args([
            tag,
            "serve",
            "--model",
            "builtin:tiny",
            "--port",
            &port.to_string(),
        ])
        .status()
        .unwrap();
    assert!(started.success(), "{engine} run failed");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let answered = runtime.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some((200, body)) = get(&format!("http://127.0.0.1:{port}/v1/models")).await {
                return Some(body);
            }
            if Instant::now() > deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    let _ = Command::new(engine).args(["rm", "-f", &container]).status();
    let body = answered.expect("kvfence serve answered in the container");
    assert!(body.contains("builtin:tiny"), "{body}");
}
