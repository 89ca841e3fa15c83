//! Built kernel modules kept per kernel, driver and build inputs, so that a restart or a reboot
//! into a kernel seen before loads the modules it already has instead of rebuilding them.
//!
//! Layout, under `<state_dir>/driver/cache`:
//! - `<digest>/`: one entry, named by [`CacheKey::digest`]; the `.ko` files and `manifest.json`
//!   (the key, and each module's name, size, sha256, mtime and ctime).
//! - `<digest>.tmp-<pid>/`: an entry being stored. The manifest is written last, everything is
//!   fsynced, then the directory is renamed into place, so a crash leaves a temp directory (which
//!   [`ModuleCache::prune`] removes) and never a half entry under a final name.
//!
//! Lookup cost: the cache-hit path is on every driver check, so [`ModuleCache::lookup`] does not
//! hash the (multi-MB) modules each time. It compares each file's size, mtime and ctime with the
//! manifest's and re-hashes only a file whose stat differs; a re-hash that still matches rewrites
//! the manifest with the new stat, so the next lookup is fast again. ctime cannot be set from
//! user space, so an edit that restores the mtime (`touch -r`) is still caught. Not caught: a
//! change below the filesystem (bit rot on the disk); the kernel's module loader rejects most
//! such files anyway.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::Flavour;
use super::build::load_rank;
use crate::host::{WriteError, write_atomic};

/// The manifest's file name inside an entry.
pub const MANIFEST: &str = "manifest.json";

/// The layout version, part of every digest: a change of the entry format misses old entries
/// instead of misreading them.
const FORMAT: u32 = 1;

/// What a built set of modules depends on; entries are found by its [`digest`](CacheKey::digest).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheKey {
    pub kernel_release: String,
    pub driver_version: String,
    pub flavour: Flavour,
    /// Module parameters, all of them (order does not matter): which ones change the build is
    /// NVIDIA's business, and a spurious miss only costs a build.
    pub params: Vec<(String, String)>,
    /// Where the sources came from: `runfile:<sha256>` or `prebuilt:<sha256>`.
    pub source: String,
}

impl CacheKey {
    /// The key with its parameters sorted: equal keys have equal canonical forms.
    fn canonical(&self) -> CacheKey {
        let mut key = self.clone();
        key.params.sort();
        key
    }

    /// sha256 (hex) of the canonical serialisation, with the layout version.
    pub fn digest(&self) -> String {
        #[derive(Serialize)]
        struct Canonical<'a> {
            format: u32,
            key: &'a CacheKey,
        }
        let key = self.canonical();
        // Serialising plain strings and a unit enum cannot fail; the empty fallback would only
        // make every key miss.
        let bytes = serde_json::to_vec(&Canonical {
            format: FORMAT,
            key: &key,
        })
        .unwrap_or_default();
        hex(&Sha256::digest(&bytes))
    }
}

/// A complete cache entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedModules {
    /// The entry's directory (rooted).
    pub dir: PathBuf,
    /// Its modules (rooted paths), the driver's in load order, then the others by name.
    pub modules: Vec<PathBuf>,
}

/// Why the cache could not be read or written. A missing, partial or corrupt entry is not an
/// error: it is a miss.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error(transparent)]
    Write(#[from] WriteError),
    #[error("nothing to cache: no modules given")]
    Empty,
    #[error("cannot cache {}: not a module file name", path.display())]
    BadName { path: PathBuf },
    #[error("cannot cache two modules named {name}")]
    DuplicateModule { name: String },
}

fn io_err(action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> CacheError {
    let path = path.to_path_buf();
    move |source| CacheError::Io { action, path, source }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Manifest {
    format: u32,
    key: CacheKey,
    modules: Vec<ManifestModule>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct ManifestModule {
    name: String,
    size: u64,
    sha256: String,
    /// mtime and ctime in nanoseconds since the epoch, when stored or last verified.
    mtime_ns: i128,
    ctime_ns: i128,
}

impl ManifestModule {
    fn stat_matches(&self, meta: &fs::Metadata) -> bool {
        let (mtime, ctime) = stat_times(meta);
        self.size == meta.len() && self.mtime_ns == mtime && self.ctime_ns == ctime
    }
}

fn stat_times(meta: &fs::Metadata) -> (i128, i128) {
    let ns = |s: i64, n: i64| i128::from(s) * 1_000_000_000 + i128::from(n);
    (ns(meta.mtime(), meta.mtime_nsec()), ns(meta.ctime(), meta.ctime_nsec()))
}

/// The module cache in one directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModuleCache {
    dir: PathBuf,
}

impl ModuleCache {
    /// `dir` is rooted: `<root>/<state_dir>/driver/cache`. It is created on the first store.
    pub fn new(dir: impl Into<PathBuf>) -> ModuleCache {
        ModuleCache { dir: dir.into() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The complete entry for `key`, or `None` when there is none or it is partial or corrupt
    /// (logged). `Err` only when the cache cannot be read at all.
    pub fn lookup(&self, key: &CacheKey) -> Result<Option<CachedModules>, CacheError> {
        let dir = self.dir.join(key.digest());
        let manifest_path = dir.join(MANIFEST);
        let text = match fs::read_to_string(&manifest_path) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err("read", &manifest_path)(e)),
        };
        let mut manifest: Manifest = match serde_json::from_str(&text) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(entry = %dir.display(), "ignoring a cached module entry: unreadable manifest: {e}");
                return Ok(None);
            }
        };
        if manifest.format != FORMAT || manifest.key.canonical() != key.canonical() || manifest.modules.is_empty() {
            tracing::warn!(entry = %dir.display(), "ignoring a cached module entry: its manifest is for another key");
            return Ok(None);
        }
        let mut rehashed = false;
        let mut modules = Vec::with_capacity(manifest.modules.len());
        for m in &mut manifest.modules {
            let path = dir.join(&m.name);
            if !valid_name(&m.name) {
                tracing::warn!(entry = %dir.display(), "ignoring a cached module entry: bad module name {:?}", m.name);
                return Ok(None);
            }
            let meta = match fs::symlink_metadata(&path) {
                Ok(meta) if meta.is_file() => meta,
                Ok(_) => {
                    tracing::warn!(module = %path.display(), "ignoring a cached module entry: not a file");
                    return Ok(None);
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    tracing::warn!(module = %path.display(), "ignoring a cached module entry: module missing");
                    return Ok(None);
                }
                Err(e) => return Err(io_err("stat", &path)(e)),
            };
            if !m.stat_matches(&meta) {
                let (sha256, size) = hash_file(&path)?;
                if sha256 != m.sha256 || size != m.size {
                    tracing::warn!(module = %path.display(), "ignoring a cached module entry: module changed since stored");
                    return Ok(None);
                }
                let (mtime, ctime) = stat_times(&meta);
                (m.mtime_ns, m.ctime_ns) = (mtime, ctime);
                rehashed = true;
            }
            modules.push(path);
        }
        if rehashed {
            // Only a speed-up for the next lookup: the entry is good either way.
            if let Err(e) = write_manifest(&manifest_path, &manifest) {
                tracing::warn!("cannot refresh {}: {e}", manifest_path.display());
            }
        }
        modules.sort_by_key(|p| (load_rank(p), p.clone()));
        Ok(Some(CachedModules { dir, modules }))
    }

    /// Copies `modules` (rooted paths) into the entry for `key`, replacing any entry there, and
    /// returns it. The entry appears complete or not at all.
    pub fn store(&self, key: &CacheKey, modules: &[PathBuf]) -> Result<CachedModules, CacheError> {
        if modules.is_empty() {
            return Err(CacheError::Empty);
        }
        let digest = key.digest();
        let tmp = self.dir.join(format!("{digest}.tmp-{}", std::process::id()));
        remove_dir_if_present(&tmp)?;
        fs::create_dir_all(&tmp).map_err(io_err("create", &tmp))?;
        let result = self.fill_and_publish(key, &digest, &tmp, modules);
        if result.is_err() {
            let _ = fs::remove_dir_all(&tmp);
        }
        result
    }

    fn fill_and_publish(
        &self,
        key: &CacheKey,
        digest: &str,
        tmp: &Path,
        modules: &[PathBuf],
    ) -> Result<CachedModules, CacheError> {
        let mut entries: Vec<ManifestModule> = Vec::with_capacity(modules.len());
        for src in modules {
            let name = src
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .filter(|n| valid_name(n))
                .ok_or_else(|| CacheError::BadName { path: src.clone() })?;
            if entries.iter().any(|e| e.name == name) {
                return Err(CacheError::DuplicateModule { name });
            }
            let dst = tmp.join(&name);
            let (sha256, size) = copy_hashing(src, &dst)?;
            let meta = fs::metadata(&dst).map_err(io_err("stat", &dst))?;
            let (mtime_ns, ctime_ns) = stat_times(&meta);
            entries.push(ManifestModule {
                name,
                size,
                sha256,
                mtime_ns,
                ctime_ns,
            });
        }
        let manifest = Manifest {
            format: FORMAT,
            key: key.canonical(),
            modules: entries,
        };
        // write_atomic fsyncs the manifest and the directory.
        write_manifest(&tmp.join(MANIFEST), &manifest)?;

        let dir = self.dir.join(digest);
        if fs::symlink_metadata(&dir).is_ok() {
            // A corrupt or older entry: move it out of the way first (rename cannot replace a
            // non-empty directory), then delete it.
            let stale = self.dir.join(format!("{digest}.stale-{}", std::process::id()));
            remove_dir_if_present(&stale)?;
            fs::rename(&dir, &stale).map_err(io_err("move aside", &dir))?;
            remove_dir_if_present(&stale)?;
        }
        fs::rename(tmp, &dir).map_err(io_err("rename into place", &dir))?;
        sync_dir(&self.dir)?;
        let mut paths: Vec<PathBuf> = manifest.modules.iter().map(|m| dir.join(&m.name)).collect();
        paths.sort_by_key(|p| (load_rank(p), p.clone()));
        tracing::info!(entry = %dir.display(), kernel = %key.kernel_release, "cached built modules");
        Ok(CachedModules { dir, modules: paths })
    }

    /// Removes every entry but those of `keep` (the caller keeps the running kernel's and the
    /// previous one's), and what interrupted stores left behind. Only names this cache writes
    /// are touched. Returns what was removed.
    pub fn prune(&self, keep: &[CacheKey]) -> Result<Vec<PathBuf>, CacheError> {
        let keep: Vec<String> = keep.iter().map(CacheKey::digest).collect();
        let entries = match fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_err("list", &self.dir)(e)),
        };
        let mut removed = Vec::new();
        for entry in entries {
            let entry = entry.map_err(io_err("list", &self.dir))?;
            let Ok(name) = entry.file_name().into_string() else {
                continue;
            };
            let (digest, suffix) = name.split_at(name.find('.').unwrap_or(name.len()));
            let ours = digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase());
            if !ours || (suffix.is_empty() && keep.iter().any(|k| k == digest)) {
                continue;
            }
            // A temp directory of a store running in this process right now is not ours to take.
            if suffix == format!(".tmp-{}", std::process::id()) {
                continue;
            }
            let path = entry.path();
            remove_dir_if_present(&path)?;
            tracing::info!(entry = %path.display(), "pruned cached modules");
            removed.push(path);
        }
        removed.sort();
        Ok(removed)
    }
}

/// A plain file name of a module: no directories, no hidden or temp names.
fn valid_name(name: &str) -> bool {
    !name.is_empty() && !name.starts_with('.') && !name.contains('/') && name != MANIFEST
}

fn write_manifest(path: &Path, manifest: &Manifest) -> Result<(), CacheError> {
    let mut bytes = serde_json::to_vec_pretty(manifest).map_err(|e| CacheError::Io {
        action: "serialise",
        path: path.to_path_buf(),
        source: io::Error::other(e),
    })?;
    bytes.push(b'\n');
    write_atomic(path, &bytes, 0o644)?;
    Ok(())
}

/// Copies `src` to a new file `dst` (mode 0644), fsynced, returning its sha256 and size.
fn copy_hashing(src: &Path, dst: &Path) -> Result<(String, u64), CacheError> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut input = File::open(src).map_err(io_err("read", src))?;
    let mut output = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(dst)
        .map_err(io_err("create", dst))?;
    let mut hasher = Sha256::new();
    let mut size = 0u64;
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = input.read(&mut buf).map_err(io_err("read", src))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        output.write_all(&buf[..n]).map_err(io_err("write", dst))?;
        size += n as u64;
    }
    output.sync_all().map_err(io_err("sync", dst))?;
    Ok((hex(&hasher.finalize()), size))
}

/// sha256 and size of a file.
fn hash_file(path: &Path) -> Result<(String, u64), CacheError> {
    let mut file = File::open(path).map_err(io_err("read", path))?;
    let mut hasher = Sha256::new();
    let size = io::copy(&mut file, &mut hasher).map_err(io_err("read", path))?;
    Ok((hex(&hasher.finalize()), size))
}

fn remove_dir_if_present(dir: &Path) -> Result<(), CacheError> {
    match fs::remove_dir_all(dir) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err("remove", dir)(e)),
        _ => Ok(()),
    }
}

fn sync_dir(dir: &Path) -> Result<(), CacheError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err("sync", dir))
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> CacheKey {
        CacheKey {
            kernel_release: "6.1.0-18-amd64".into(),
            driver_version: "580.95.05".into(),
            flavour: Flavour::Open,
            params: vec![
                ("NVreg_EnableGpuFirmware".into(), "1".into()),
                ("NVreg_CoherentGPUMemoryMode".into(), "driver".into()),
            ],
            source: "runfile:ab12".into(),
        }
    }

    /// Built modules in a scratch dir, in the wrong order on purpose.
    fn built(dir: &Path) -> Vec<PathBuf> {
        ["nvidia-modeset.ko", "nvidia-drm.ko", "nvidia.ko", "nvidia-uvm.ko"]
            .iter()
            .map(|n| {
                let p = dir.join("build").join(n);
                fs::create_dir_all(p.parent().unwrap()).unwrap();
                fs::write(&p, format!("ELF {n}").repeat(1000)).unwrap();
                p
            })
            .collect()
    }

    fn names(c: &CachedModules) -> Vec<String> {
        c.modules
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn the_digest_ignores_parameter_order_and_sees_every_field() {
        let k = key();
        let mut reordered = k.clone();
        reordered.params.reverse();
        assert_eq!(k.digest(), reordered.digest());
        assert_eq!(k.digest().len(), 64);
        let variants = [
            CacheKey {
                kernel_release: "6.1.0-19-amd64".into(),
                ..k.clone()
            },
            CacheKey {
                driver_version: "580.95.06".into(),
                ..k.clone()
            },
            CacheKey {
                flavour: Flavour::Proprietary,
                ..k.clone()
            },
            CacheKey {
                params: vec![("NVreg_EnableGpuFirmware".into(), "0".into())],
                ..k.clone()
            },
            CacheKey {
                source: "prebuilt:ab12".into(),
                ..k.clone()
            },
        ];
        for v in variants {
            assert_ne!(v.digest(), k.digest(), "{v:?}");
        }
    }

    #[test]
    fn a_stored_entry_is_found_in_load_order() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ModuleCache::new(dir.path().join("cache"));
        assert_eq!(cache.lookup(&key()).unwrap(), None, "empty cache");
        let stored = cache.store(&key(), &built(dir.path())).unwrap();
        assert_eq!(
            names(&stored),
            ["nvidia.ko", "nvidia-uvm.ko", "nvidia-modeset.ko", "nvidia-drm.ko"]
        );
        let mut reordered = key();
        reordered.params.reverse();
        let found = cache.lookup(&reordered).unwrap().expect("hit");
        assert_eq!(found, stored);
        assert_eq!(
            fs::read(&found.modules[0]).unwrap(),
            fs::read(dir.path().join("build/nvidia.ko")).unwrap()
        );
        let left: Vec<_> = fs::read_dir(cache.dir())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            left,
            vec![std::ffi::OsString::from(key().digest())],
            "no temp dirs left"
        );
    }

    #[test]
    fn partial_changed_or_foreign_entries_miss_and_can_be_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ModuleCache::new(dir.path().join("cache"));
        let modules = built(dir.path());
        let stored = cache.store(&key(), &modules).unwrap();

        // Same size, mtime put back: ctime still tells.
        let uvm = &stored.modules[1];
        let meta = fs::metadata(uvm).unwrap();
        let mut bytes = fs::read(uvm).unwrap();
        bytes[0] ^= 0xff;
        fs::write(uvm, &bytes).unwrap();
        let f = File::options().write(true).open(uvm).unwrap();
        f.set_modified(meta.modified().unwrap()).unwrap();
        assert_eq!(cache.lookup(&key()).unwrap(), None, "a changed module misses");

        // Storing again replaces the bad entry.
        cache.store(&key(), &modules).unwrap();
        assert!(cache.lookup(&key()).unwrap().is_some());

        // A touched but unchanged module still hits (re-hashed once, then fast again).
        let f = File::options().write(true).open(&stored.modules[0]).unwrap();
        f.set_modified(std::time::SystemTime::now()).unwrap();
        assert!(cache.lookup(&key()).unwrap().is_some());
        let manifest: Manifest = serde_json::from_str(&fs::read_to_string(stored.dir.join(MANIFEST)).unwrap()).unwrap();
        let meta = fs::metadata(&stored.modules[0]).unwrap();
        assert!(
            manifest
                .modules
                .iter()
                .any(|m| m.name == "nvidia.ko" && m.stat_matches(&meta))
        );

        // A missing module, a corrupt manifest, a manifest for another key: misses.
        fs::remove_file(&stored.modules[3]).unwrap();
        assert_eq!(cache.lookup(&key()).unwrap(), None);
        cache.store(&key(), &modules).unwrap();
        fs::write(stored.dir.join(MANIFEST), "{\"format\":1,").unwrap();
        assert_eq!(cache.lookup(&key()).unwrap(), None);
        cache.store(&key(), &modules).unwrap();
        let other = CacheKey {
            driver_version: "1".into(),
            ..key()
        };
        let text = fs::read_to_string(stored.dir.join(MANIFEST)).unwrap();
        fs::write(stored.dir.join(MANIFEST), text.replace("580.95.05", "1")).unwrap();
        assert_eq!(cache.lookup(&key()).unwrap(), None);
        assert_eq!(cache.lookup(&other).unwrap(), None, "not under its own digest either");

        // A directory without a manifest (a crash before the rename would not even leave this).
        fs::remove_file(stored.dir.join(MANIFEST)).unwrap();
        assert_eq!(cache.lookup(&key()).unwrap(), None);
    }

    #[test]
    fn bad_inputs_to_store_are_errors_and_leave_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ModuleCache::new(dir.path().join("cache"));
        assert!(matches!(cache.store(&key(), &[]), Err(CacheError::Empty)));
        let mut modules = built(dir.path());
        modules.push(modules[0].clone());
        assert!(matches!(
            cache.store(&key(), &modules),
            Err(CacheError::DuplicateModule { .. })
        ));
        let e = cache.store(&key(), &[dir.path().join("missing.ko")]).unwrap_err();
        assert!(e.to_string().contains("missing.ko"), "{e}");
        assert_eq!(fs::read_dir(cache.dir()).unwrap().count(), 0, "no temp dirs left");
    }

    #[test]
    fn prune_keeps_the_given_keys_and_removes_leftovers() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ModuleCache::new(dir.path().join("cache"));
        let modules = built(dir.path());
        let keys: Vec<CacheKey> = ["6.1.0-17-amd64", "6.1.0-18-amd64", "6.1.0-19-amd64"]
            .iter()
            .map(|r| CacheKey {
                kernel_release: r.to_string(),
                ..key()
            })
            .collect();
        for k in &keys {
            cache.store(k, &modules).unwrap();
        }
        let crashed = cache.dir().join(format!("{}.tmp-1", keys[0].digest()));
        fs::create_dir_all(&crashed).unwrap();
        fs::write(cache.dir().join("README"), "not ours").unwrap();
        let removed = cache.prune(&keys[1..]).unwrap();
        let mut expected = vec![cache.dir().join(keys[0].digest()), crashed];
        expected.sort();
        assert_eq!(removed, expected);
        assert!(cache.lookup(&keys[0]).unwrap().is_none());
        assert!(cache.lookup(&keys[1]).unwrap().is_some());
        assert!(cache.lookup(&keys[2]).unwrap().is_some());
        assert!(cache.dir().join("README").exists(), "unknown files are left alone");
        assert_eq!(
            ModuleCache::new(dir.path().join("none")).prune(&[]).unwrap(),
            Vec::<PathBuf>::new()
        );
    }
}
