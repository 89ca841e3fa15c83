//! `update-ldcache`: the driver's folders into the container's linker cache.
//!
//! The container's `ld.so.cache` is rebuilt by the **host's** `ldconfig`, never the image's: a
//! program from the image run as host root escapes a chroot. The host's is chosen and opened
//! before the container is looked at, checked (a regular file owned by root, writable by no one
//! else, a statically linked ELF program: a dynamic one would load the image's `ld.so` once it
//! runs inside the container's root), and executed from that descriptor in the [`sandbox`],
//! pivoted into the container's root. A statically linked `ldconfig` writes the cache format
//! every glibc since 2.3 reads, for Debian/Ubuntu (multiarch) and RHEL-family (`lib64`) images
//! alike, and images that ship no `ldconfig` get a cache too.
//!
//! [`sandbox`]: crate::sandbox

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::inroot::{InRoot, Kind, describe};
use crate::{CUDA_COMPAT_CONF, HookError, LDCACHE_CONF, LDCONFIG_TIMEOUT, MAX_TEXT};

/// Where the host's `ldconfig` is looked for, first usable one wins. Ubuntu's `/sbin/ldconfig`
/// is a shell wrapper around the static `ldconfig.real`, so that one comes first.
pub const HOST_LDCONFIG: [&str; 4] = [
    "/sbin/ldconfig.real",
    "/sbin/ldconfig",
    "/usr/sbin/ldconfig.real",
    "/usr/sbin/ldconfig",
];

/// The most folders taken from the CUDA compat file in the container.
const MAX_COMPAT_DIRS: usize = 16;

/// A host program opened for execution, with the path it was opened from (for messages).
#[derive(Debug)]
pub struct HostProgram {
    pub file: File,
    pub path: PathBuf,
}

/// The host's `ldconfig`: `path` when given, else the first usable of [`HOST_LDCONFIG`].
pub fn host_ldconfig(path: Option<&Path>) -> Result<HostProgram, HookError> {
    let candidates: Vec<PathBuf> = match path {
        Some(p) => vec![p.to_path_buf()],
        None => HOST_LDCONFIG.iter().map(PathBuf::from).collect(),
    };
    let mut why = Vec::new();
    for candidate in &candidates {
        match open_host_program(candidate) {
            Ok(program) => return Ok(program),
            Err(reason) => why.push(format!("{}: {reason}", candidate.display())),
        }
    }
    Err(HookError::Ldconfig {
        ldconfig: candidates.first().cloned().unwrap_or_default(),
        message: format!("no usable static ldconfig on the host ({})", why.join("; ")),
    })
}

/// Opens `path` on the host and checks that it may be run as the container's `ldconfig`.
pub fn open_host_program(path: &Path) -> Result<HostProgram, String> {
    if !path.is_absolute() {
        return Err("not an absolute path".to_string());
    }
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| e.to_string())?;
    let meta = file.metadata().map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("not a regular file".to_string());
    }
    if meta.uid() != 0 {
        return Err(format!("owned by uid {}, not root", meta.uid()));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(format!("writable by others (mode {:o})", meta.mode() & 0o7777));
    }
    if meta.mode() & 0o111 == 0 {
        return Err("not executable".to_string());
    }
    static_elf(&mut file)?;
    Ok(HostProgram {
        file,
        path: path.to_path_buf(),
    })
}

/// Whether `file` is a statically linked ELF program (no `PT_INTERP`: the kernel starts it
/// without a dynamic loader, so no `LD_*` variable and no library of a container can reach it).
/// An error says what it is instead.
pub fn static_elf(file: &mut File) -> Result<(), String> {
    let mut header = [0u8; 64];
    file.read_exact(&mut header)
        .map_err(|_| "not an ELF program (too short)".to_string())?;
    if &header[..4] != b"\x7fELF" {
        return Err("not an ELF program".to_string());
    }
    let wide = match header[4] {
        1 => false,
        2 => true,
        _ => return Err("not an ELF program (unknown class)".to_string()),
    };
    let little = match header[5] {
        1 => true,
        2 => false,
        _ => return Err("not an ELF program (unknown byte order)".to_string()),
    };
    let u16_at = |b: &[u8], at: usize| {
        let v = [b[at], b[at + 1]];
        if little {
            u16::from_le_bytes(v)
        } else {
            u16::from_be_bytes(v)
        }
    };
    let u32_at = |b: &[u8], at: usize| {
        let v = [b[at], b[at + 1], b[at + 2], b[at + 3]];
        if little {
            u32::from_le_bytes(v)
        } else {
            u32::from_be_bytes(v)
        }
    };
    let u64_at = |b: &[u8], at: usize| {
        let mut v = [0u8; 8];
        v.copy_from_slice(&b[at..at + 8]);
        if little {
            u64::from_le_bytes(v)
        } else {
            u64::from_be_bytes(v)
        }
    };
    let kind = u16_at(&header, 16);
    if kind != 2 && kind != 3 {
        return Err(format!("not an ELF program (type {kind})"));
    }
    let (phoff, phentsize, phnum) = if wide {
        (u64_at(&header, 32), u16_at(&header, 54), u16_at(&header, 56))
    } else {
        (u64::from(u32_at(&header, 28)), u16_at(&header, 42), u16_at(&header, 44))
    };
    let table = u64::from(phentsize) * u64::from(phnum);
    if phentsize < 4 || table > 64 * 1024 {
        return Err("not an ELF program (bad program headers)".to_string());
    }
    let mut headers = vec![0u8; table as usize];
    std::os::unix::fs::FileExt::read_exact_at(&*file, &mut headers, phoff)
        .map_err(|_| "not an ELF program (program headers past its end)".to_string())?;
    const PT_INTERP: u32 = 3;
    for entry in headers.chunks(usize::from(phentsize)) {
        if u32_at(entry, 0) == PT_INTERP {
            return Err("dynamically linked (it has a program interpreter)".to_string());
        }
    }
    Ok(())
}

/// Updates the container's cache: the folders into [`LDCACHE_CONF`] (the CUDA compat folder of
/// [`CUDA_COMPAT_CONF`] first), an `/etc/ld.so.conf` that includes `ld.so.conf.d` when the image
/// has none, the files the host's `ldconfig` will read checked, then `ldconfig` in the sandbox
/// with the folders on its command line (so the cache has them whether or not the image's
/// `ld.so.conf` includes `ld.so.conf.d`).
pub fn update(root: &InRoot, rootfs: &Path, folders: &[PathBuf], ldconfig: &HostProgram) -> Result<(), HookError> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(text) = root.read_regular(Path::new(CUDA_COMPAT_CONF), MAX_TEXT)? {
        dirs.extend(
            String::from_utf8_lossy(&text)
                .lines()
                .map(str::trim)
                .filter(|l| l.starts_with('/') && !l.contains('\0'))
                .take(MAX_COMPAT_DIRS)
                .map(PathBuf::from),
        );
    }
    for folder in folders {
        if !dirs.contains(folder) {
            dirs.push(folder.clone());
        }
    }
    if !folders.is_empty() {
        let mut text =
            String::from("# The NVIDIA driver's libraries, added by gpu-node-agent's update-ldcache hook.\n");
        for folder in folders {
            text.push_str(&folder.to_string_lossy());
            text.push('\n');
        }
        root.write(Path::new(LDCACHE_CONF), text.as_bytes(), 0o644)?;
        // An image without /etc/ld.so.conf (busybox, some minimal ones) gets the usual one, so a
        // later ldconfig in the container keeps the folders.
        root.create_if_missing(Path::new("/etc/ld.so.conf"), b"include /etc/ld.so.conf.d/*.conf\n")?;
    }
    check_conf_files(root)?;
    // ldconfig writes the cache to `<cache>~` (O_CREAT|O_TRUNC) and renames it: a FIFO or a link
    // there would hang it or send it elsewhere in the root.
    root.remove_unless_file(Path::new("/etc/ld.so.cache~"))?;
    root.remove_unless_file(Path::new("/var/cache/ldconfig/aux-cache~"))?;
    // ldconfig also makes the soname links in the folders it scans (a driver root may lack
    // them): all of them inside the container, read-only mounts staying read-only. -i: no
    // auxiliary cache (/var/cache/ldconfig/aux-cache is the image's, read without checks).
    let mut args: Vec<std::ffi::OsString> = vec!["ldconfig".into(), "-i".into()];
    args.extend(dirs.iter().map(|d| d.as_os_str().to_os_string()));
    crate::sandbox::run(&ldconfig.file, &args, rootfs, LDCONFIG_TIMEOUT).map_err(|message| HookError::Ldconfig {
        ldconfig: ldconfig.path.clone(),
        message,
    })
}

/// The files `ldconfig` reads by default — `/etc/ld.so.conf` and `/etc/ld.so.conf.d/*.conf` —
/// must be regular files: a FIFO would hang it and a device feed it without end. (Other files an
/// image's `include` names are bounded by the sandbox's time and memory limits.)
fn check_conf_files(root: &InRoot) -> Result<(), HookError> {
    let conf = Path::new("/etc/ld.so.conf");
    let mut paths = vec![conf.to_path_buf()];
    if let Some(names) = root.list(Path::new("/etc/ld.so.conf.d"))? {
        paths.extend(
            names
                .iter()
                .filter(|n| n.to_string_lossy().ends_with(".conf"))
                .map(|n| Path::new("/etc/ld.so.conf.d").join(n)),
        );
    }
    for path in paths {
        match root.kind(&path)? {
            Kind::Missing | Kind::File => {}
            other => {
                return Err(HookError::at(
                    &path,
                    format!(
                        "expected a regular file for ldconfig to read, found {}",
                        describe(other)
                    ),
                ));
            }
        }
    }
    Ok(())
}
