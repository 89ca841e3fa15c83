//! The module graph has no cycles and follows the layering in ARCHITECTURE.md.
//!
//! Every `.rs` file under `src/` is read and every path into the crate is collected: `use
//! crate::…` trees, inline `crate::x::y` paths, `super::…` and `self::…` paths, relative paths
//! into a module's own children (`pub use client::KubeClient;` in `kube/mod.rs`), and
//! `gpu_node_agent::…` in the binaries. Comments and string and char literals are skipped;
//! `#[cfg(test)]` code counts like any other code (a test that imports a module above its own is
//! a cycle too).
//!
//! A path is resolved to the module that *defines* its item: a name a module only re-exports
//! (`pub use`) counts as an import of the module it comes from. So the `kube` facade's
//! re-exports point at the submodules that define them, and the compatibility re-exports listed
//! in ARCHITECTURE.md (`mig::layout`, `plugin::preferred::Topology`, ...) count as imports of
//! the leaf that now holds the type, not of the upper module that re-exports it.
//!
//! The top-level modules are checked against [`LAYERS`] (with the [`EXCEPTIONS`]); the
//! submodules of every module against each other by [`SUBLAYERS`]: every module with children has
//! its table there, and a child missing from it fails.
//!
//! `cargo test --test architecture -- --ignored --nocapture module_graph` prints the whole graph.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The top-level modules, each with its layer. A module may import only modules in lower layers
/// (and its own submodules); modules in the same layer do not import each other. Layer 0 holds
/// the leaves, which import nothing in the crate.
const LAYERS: &[(&str, u32)] = &[
    // 0. Leaves: generated API, plain data and helpers that import nothing from the crate.
    ("api", 0),
    ("dra_api", 0),
    ("cli", 0),
    ("devices", 0),
    ("exit", 0),
    ("names", 0),
    ("net", 0),
    ("notify", 0),
    // 1. The host (paths under --root, files, commands) and the MIG layout schema, which the
    //    config embeds and the MIG stage applies.
    ("host", 1),
    ("mig_layout", 1),
    // 2. The configuration.
    ("config", 2),
    // 3. Services built from the config: logging, the NVML inventory, the Kubernetes client.
    ("logging", 3),
    ("nvml", 3),
    ("kube", 3),
    // 4. What the node should be (desired), and what is reported about it (labels, metrics),
    //    plus the CUDA checks, and the container-edits model the device plugin, the CDI specs
    //    and the DRA driver render.
    ("cuda", 4),
    ("desired", 4),
    ("edits", 4),
    ("labels", 4),
    ("metrics", 4),
    // 5. The stages' own modules: each owns one part of the node.
    ("driver", 5),
    ("mig", 5),
    ("plugin", 5),
    // 6. The runtime stage writes the CDI spec for the devices the device plugin advertises, so
    //    it reads the plugin's device rules.
    ("runtime", 6),
    // 7. The cluster side: the agent's Node, its labels and Events.
    ("cluster", 7),
    // 7. The DRA driver: the inventory, health and CDI spec served to the kubelet's DRA manager.
    ("dra", 7),
    // 8. The status file the agent writes and `status` reads.
    ("status", 8),
    // 9. The agent: the stage pipeline, in reconcile order.
    ("agent", 9),
    // 10. The commands: the command line and `plan`.
    ("plan", 10),
    // 11. The binaries.
    ("main", 11),
    ("gna-gen", 11),
];

/// Imports allowed although they point upwards, each with the reason it is still there.
const EXCEPTIONS: &[(&str, &str, &str)] = &[];

/// The submodules of every module that has children, each with its layer, like [`LAYERS`]. The facade
/// (`kube/mod.rs`, named `kube`) is above its children: a child imports a sibling directly, never
/// an item the facade defines.
const SUBLAYERS: &[(&str, u32)] = &[
    // Leaves: time formats, the size limits on what is read, the test API server (tests only).
    ("kube/time", 0),
    ("kube/testserver", 0),
    ("kube/limit", 0),
    // Errors, and what a failed request means.
    ("kube/error", 1),
    // Credentials (the types, the in-cluster reader) and the Node object.
    ("kube/credentials", 2),
    ("kube/node", 2),
    // Kubeconfig files, exec plugins, watch streams.
    ("kube/kubeconfig", 3),
    ("kube/exec", 3),
    ("kube/watch", 3),
    // Which credentials to use.
    ("kube/discover", 4),
    // The client, and the Node watcher on top of it.
    ("kube/client", 5),
    ("kube/watcher", 6),
    // The facade: re-exports what the rest of the crate uses.
    ("kube", 7),
    // `agent`: the stages' statuses and backoff, the errors, the waits, device nodes; the health
    // path and NVML's lifecycle; metrics and the reporter; the Pass (read-only view, notes,
    // services); the stages beside each other; the device plugin stage (over MPS); setup; `plan`;
    // the driver stage (it reads the plan's GPU processes); and the loop (the facade) on top.
    ("agent/devnodes", 0),
    ("agent/error", 0),
    ("agent/stage", 0),
    ("agent/wait", 0),
    ("agent/health", 1),
    ("agent/nvml", 1),
    ("agent/metrics", 2),
    ("agent/report", 2),
    ("agent/pass", 3),
    ("agent/memlimit", 4),
    ("agent/mps", 4),
    ("agent/operator", 4),
    ("agent/validation", 4),
    ("agent/device_plugin", 5),
    ("agent/mig", 5),
    ("agent/runtime", 5),
    ("agent/setup", 6),
    ("agent/plan", 7),
    ("agent/driver", 8),
    ("agent", 9),
    // `cluster`: the Event aggregator below the link that posts what it lets through.
    ("cluster/events", 0),
    ("cluster", 1),
    // `config`: value types and error formatting, then the file merge, then the facade's own
    // items (the `Config` type, the checks every section uses), then the sections, the device
    // plugin's on top of the sharing section it embeds, and the tests.
    ("config/error", 0),
    ("config/values", 0),
    ("config/merge", 1),
    ("config", 2),
    ("config/agent", 3),
    ("config/dra", 3),
    ("config/driver", 3),
    ("config/kubernetes", 3),
    ("config/mig", 3),
    ("config/runtime", 3),
    ("config/sharing", 3),
    ("config/device_plugin", 4),
    ("config/tests", 5),
    // `driver`: the facade's shared types and the package fetcher, then what is loaded, the
    // plan, the build and the checks, the cache of built modules, and the stage on top.
    ("driver", 0),
    ("driver/fetch", 0),
    ("driver/observe", 1),
    ("driver/build", 2),
    ("driver/plan", 2),
    ("driver/validate", 2),
    ("driver/cache", 3),
    ("driver/stage", 4),
    // `dra`: the pure claims and device listings, the driver (prepare, publish) on them, the
    // sockets that serve the driver, and the facade that starts it all.
    ("dra/claims", 0),
    ("dra/devices", 0),
    ("dra/driver", 1),
    ("dra/server", 2),
    ("dra", 3),
    // `edits`: the container-edits model (facade) and the host's device nodes, then the opt-in
    // injections built on them, then the model's tests.
    ("edits", 0),
    ("edits/nodes", 0),
    ("edits/injections", 1),
    ("edits/tests", 2),
    // `host`: the facade's own items (`HostRoot`, atomic writes, bounded reads) and the
    // helpers that need nothing, then what works on the host through them.
    ("host", 0),
    ("host/backoff", 0),
    ("host/lock", 0),
    ("host/socket", 0),
    ("host/arch", 1),
    ("host/command", 1),
    ("host/devchar", 1),
    ("host/devnodes", 1),
    ("host/operator", 1),
    // `labels`: the facade, the GFD labels, the labels file and the vGPU check, each on its own.
    ("labels", 0),
    ("labels/gfd", 0),
    ("labels/report", 0),
    ("labels/vgpu", 0),
    // `metrics`: the registry (facade) and the GPM math, then what is read and who holds it,
    // the sampler that turns readings into series, and the HTTP endpoint.
    ("metrics", 0),
    ("metrics/gpm", 0),
    ("metrics/pods", 1),
    ("metrics/readings", 1),
    ("metrics/dcgm", 2),
    ("metrics/sampler", 2),
    ("metrics/http", 3),
    // `plugin`: the pure device rules (MIG strategy, preferred allocation), health and the
    // memory-limit enforcer, then sharing on top of the strategy, the MPS daemons, the Allocate
    // renderer, the gRPC server and the manager that runs the servers.
    ("plugin", 0),
    ("plugin/health", 0),
    ("plugin/memlimit", 0),
    ("plugin/preferred", 0),
    ("plugin/strategy", 0),
    ("plugin/sharing", 1),
    ("plugin/mps", 2),
    ("plugin/allocate", 3),
    ("plugin/server", 4),
    ("plugin/manager", 5),
    // `runtime`: the facade's own types (`NvidiaRuntime`) and the pure helpers (CDI spec model,
    // CRI, kubelet, facts cache), the engine seam, the engines behind it (containerd first: docker,
    // CRI-O and the toolkit config reuse its TOML helpers), the stage that iterates the engines,
    // and the node's CDI spec files.
    ("runtime", 0),
    ("runtime/cdi", 0),
    ("runtime/cri", 0),
    ("runtime/facts_cache", 0),
    ("runtime/kubelet", 0),
    ("runtime/engine", 1),
    ("runtime/containerd", 2),
    ("runtime/crio", 3),
    ("runtime/docker", 3),
    ("runtime/toolkit", 3),
    ("runtime/stage", 4),
    ("runtime/node_spec", 5),
    // `mig`: the facade, the observed MIG state, the host's GPU clients and the import of an
    // existing layout, then the pure planner and the applier on the observed state, and the
    // stage that reads, plans and converges (its layout tests use the planner's fixtures).
    ("mig", 0),
    ("mig/clients", 0),
    ("mig/import", 0),
    ("mig/state", 0),
    ("mig/apply", 1),
    ("mig/planner", 1),
    ("mig/stage", 2),
    // `mig_layout`: the schema (facade), then the built-in layouts written in it.
    ("mig_layout", 0),
    ("mig_layout/defaults", 1),
];

/// Generated code: its submodules are not layered.
const GENERATED: &[&str] = &["api", "dra_api"];

/// One import: the file and line it is on, the importing module, and the module that defines
/// what it names.
#[derive(Debug, Clone)]
struct Import {
    file: String,
    line: usize,
    from: Vec<String>,
    to: Vec<String>,
    text: String,
    /// In a `pub use`: the module re-exports what it names.
    reexport: bool,
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    PathSep,
    Punct(char),
}

/// Splits Rust source into identifiers, `::` and punctuation, with line numbers, dropping
/// comments, string, char and number literals and lifetimes.
fn lex(src: &str) -> Vec<(Tok, usize)> {
    let chars: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let mut line = 1;
    let at = |i: usize| chars.get(i).copied().unwrap_or('\0');
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == '/' && at(i + 1) == '/' {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if chars[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
            }
        } else if (c == 'r' || (c == 'b' && at(i + 1) == 'r') || (c == 'c' && at(i + 1) == 'r'))
            && matches!(at(i + if c == 'r' { 1 } else { 2 }), '"' | '#')
            && raw_string_start(&chars, i + if c == 'r' { 1 } else { 2 })
        {
            // Raw string: r"…", r#"…"#, br"…", cr"…".
            i += if c == 'r' { 1 } else { 2 };
            let mut hashes = 0;
            while at(i) == '#' {
                hashes += 1;
                i += 1;
            }
            i += 1;
            loop {
                if i >= chars.len() {
                    break;
                }
                if chars[i] == '"' && (1..=hashes).all(|k| at(i + k) == '#') {
                    i += 1 + hashes;
                    break;
                }
                if chars[i] == '\n' {
                    line += 1;
                }
                i += 1;
            }
        } else if c == '"' || ((c == 'b' || c == 'c') && at(i + 1) == '"') {
            i += if c == '"' { 1 } else { 2 };
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    i += 1;
                }
                if at(i) == '\n' {
                    line += 1;
                }
                i += 1;
            }
            i += 1;
        } else if c == '\'' || (c == 'b' && at(i + 1) == '\'') {
            let start = if c == 'b' { i + 1 } else { i };
            if at(start + 1) == '\\' {
                // Escaped char literal: '\n', '\'', '\u{…}'.
                i = start + 2;
                while i < chars.len() && chars[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(start + 2) == '\'' {
                i = start + 3;
            } else {
                // A lifetime or label: skip the quote, the name lexes as an identifier.
                i = start + 1;
            }
        } else if c == '_' || c.is_alphabetic() {
            let start = i;
            while i < chars.len() && (chars[i] == '_' || chars[i].is_alphanumeric()) {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let word = word.strip_prefix("r#").map(str::to_string).unwrap_or(word);
            out.push((Tok::Ident(word), line));
        } else if c.is_ascii_digit() {
            while i < chars.len() && (chars[i] == '_' || chars[i] == '.' || chars[i].is_alphanumeric()) {
                if chars[i] == '.' && !at(i + 1).is_ascii_digit() {
                    break;
                }
                i += 1;
            }
        } else if c == ':' && at(i + 1) == ':' {
            out.push((Tok::PathSep, line));
            i += 2;
        } else {
            out.push((Tok::Punct(c), line));
            i += 1;
        }
    }
    out
}

/// Whether `chars[i..]` (just after the `r`) starts a raw string: `#`* then `"`.
fn raw_string_start(chars: &[char], mut i: usize) -> bool {
    while chars.get(i) == Some(&'#') {
        i += 1;
    }
    chars.get(i) == Some(&'"')
}

/// The crate's source files, each with the module path it defines (`src/kube/client.rs` is
/// `["kube", "client"]`; the binaries are `["main"]` and `["gna-gen"]`).
fn source_files(src: &Path) -> Vec<(PathBuf, Vec<String>)> {
    let mut files = Vec::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src dir") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path.strip_prefix(src).expect("under src");
                let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
                let last = parts.pop().expect("file name");
                let stem = last.trim_end_matches(".rs").to_string();
                let module = match (parts.first().map(String::as_str), stem.as_str()) {
                    (None, "lib") => vec![],
                    (None, "main") => vec!["main".to_string()],
                    (Some("bin"), _) => vec![stem],
                    (_, "mod") => parts,
                    _ => {
                        parts.push(stem);
                        parts
                    }
                };
                files.push((path, module));
            }
        }
    }
    files.sort();
    files
}

/// The crate: which modules exist, and which names each facade re-exports from where.
struct Crate {
    modules: BTreeSet<Vec<String>>,
    reexports: BTreeMap<Vec<String>, BTreeMap<String, Vec<String>>>,
}

impl Crate {
    fn is_module(&self, path: &[String]) -> bool {
        self.modules.contains(path)
    }

    /// The module that defines the item `path` names: the longest prefix that is a module,
    /// following a facade's re-exports into the child that defines the name.
    fn home(&self, path: &[String]) -> Vec<String> {
        let mut module: Vec<String> = Vec::new();
        for (k, seg) in path.iter().enumerate() {
            let mut next = module.clone();
            next.push(seg.clone());
            if self.is_module(&next) {
                module = next;
                continue;
            }
            if let Some(target) = self.reexports.get(&module).and_then(|m| m.get(seg))
                && target.as_slice() != path
            {
                let mut rest = target.clone();
                rest.extend(path[k + 1..].iter().cloned());
                return self.home(&rest);
            }
            break;
        }
        module
    }
}

/// One path a `use` tree (or an inline path) names: the segments, its line, and the name it is
/// brought in as when renamed (`use a::B as C`).
/// The last field says whether the path is in a `pub use` (a re-export).
type Named = (Vec<String>, usize, Option<String>, bool);

/// Parses one `use` tree (or plain path) after `prefix`, starting at `toks[*i]`, pushing every
/// full path it names.
fn use_tree(toks: &[(Tok, usize)], i: &mut usize, prefix: Vec<String>, out: &mut Vec<Named>) {
    let Some((tok, line)) = toks.get(*i) else {
        return;
    };
    match tok {
        Tok::Punct('{') => {
            *i += 1;
            loop {
                match toks.get(*i).map(|t| &t.0) {
                    None => return,
                    Some(Tok::Punct('}')) => {
                        *i += 1;
                        return;
                    }
                    Some(Tok::Punct(',')) => *i += 1,
                    Some(_) => {
                        let before = *i;
                        use_tree(toks, i, prefix.clone(), out);
                        if *i == before {
                            *i += 1;
                        }
                    }
                }
            }
        }
        Tok::Punct('*') => {
            *i += 1;
            out.push((prefix, *line, None, false));
        }
        Tok::Ident(name) if name == "self" => {
            *i += 1;
            let alias = rename(toks, i);
            out.push((prefix, *line, alias, false));
        }
        Tok::Ident(name) => {
            *i += 1;
            let mut path = prefix;
            path.push(name.clone());
            if toks.get(*i).map(|t| &t.0) == Some(&Tok::PathSep)
                && matches!(
                    toks.get(*i + 1).map(|t| &t.0),
                    Some(Tok::Ident(_) | Tok::Punct('{' | '*'))
                )
            {
                *i += 1;
                use_tree(toks, i, path, out);
            } else {
                let alias = rename(toks, i);
                out.push((path, *line, alias, false));
            }
        }
        _ => {}
    }
}

/// Skips `as NAME` at `toks[*i]`, returning NAME.
fn rename(toks: &[(Tok, usize)], i: &mut usize) -> Option<String> {
    if toks.get(*i).map(|t| &t.0) != Some(&Tok::Ident("as".into())) {
        return None;
    }
    match toks.get(*i + 1) {
        Some((Tok::Ident(alias), _)) => {
            *i += 2;
            Some(alias.clone())
        }
        _ => None,
    }
}

/// Every crate path in one file, resolved to absolute module paths (not yet to their homes),
/// with the module each appears in and its line.
fn paths_in(src: &str, module: &[String], krate: &Crate) -> Vec<Named> {
    let toks = lex(src);
    let mut out = Vec::new();
    // Inline modules (`mod tests { … }`): the module path at each brace depth.
    let mut scopes: Vec<(usize, Vec<String>)> = Vec::new();
    let mut current: Vec<String> = module.to_vec();
    let mut depth = 0usize;
    let mut in_use = false;
    // In a `pub use` (`pub(crate) use` …): what it names is re-exported.
    let mut pub_use = false;
    let mut i = 0;
    while i < toks.len() {
        let (tok, _) = &toks[i];
        let pushed = out.len();
        let prev_is_sep = i > 0 && toks[i - 1].0 == Tok::PathSep;
        match tok {
            Tok::Punct('{') => {
                depth += 1;
                i += 1;
            }
            Tok::Punct('}') => {
                if scopes.last().is_some_and(|(d, _)| *d == depth) {
                    let (_, outer) = scopes.pop().expect("scope");
                    current = outer;
                }
                depth = depth.saturating_sub(1);
                i += 1;
            }
            Tok::Punct(';') => {
                in_use = false;
                pub_use = false;
                i += 1;
            }
            Tok::Ident(word) if word == "mod" => {
                if let (Some((Tok::Ident(name), _)), Some((Tok::Punct('{'), _))) = (toks.get(i + 1), toks.get(i + 2)) {
                    scopes.push((depth + 1, current.clone()));
                    current.push(name.clone());
                    depth += 1;
                    i += 3;
                } else {
                    i += 1;
                }
            }
            Tok::Ident(word) if word == "use" => {
                in_use = true;
                pub_use = match i.checked_sub(1).map(|p| &toks[p].0) {
                    Some(Tok::Ident(p)) => p == "pub",
                    // `pub(crate) use`, `pub(in path) use`.
                    Some(Tok::Punct(')')) => toks[..i]
                        .iter()
                        .rposition(|t| t.0 == Tok::Punct('('))
                        .is_some_and(|open| open > 0 && toks[open - 1].0 == Tok::Ident("pub".into())),
                    _ => false,
                };
                i += 1;
                // `use child::…` in a module with that child is relative to the module.
                if let (Some((Tok::Ident(first), _)), Some((Tok::PathSep, _))) = (toks.get(i), toks.get(i + 1)) {
                    let mut child = current.clone();
                    child.push(first.clone());
                    if first != "crate" && first != "super" && first != "self" && krate.is_module(&child) {
                        use_tree(&toks, &mut i, current.clone(), &mut out);
                    }
                }
            }
            Tok::Ident(word) if !prev_is_sep && toks.get(i + 1).map(|t| &t.0) == Some(&Tok::PathSep) => {
                let prefix: Option<Vec<String>> = match word.as_str() {
                    "crate" | "gpu_node_agent" => Some(vec![]),
                    "self" => Some(current.clone()),
                    "super" => {
                        let mut base = current.clone();
                        base.pop();
                        let mut j = i + 2;
                        while let (Some((Tok::Ident(w), _)), Some((Tok::PathSep, _))) = (toks.get(j), toks.get(j + 1)) {
                            if w != "super" {
                                break;
                            }
                            base.pop();
                            j += 2;
                        }
                        i = j - 2;
                        Some(base)
                    }
                    _ => {
                        // A path that starts at a child module: `client::error_chain(…)`.
                        let mut child = current.clone();
                        child.push(word.clone());
                        (!in_use && krate.is_module(&child)).then(|| current.clone())
                    }
                };
                match prefix {
                    Some(prefix) if matches!(word.as_str(), "crate" | "gpu_node_agent" | "self" | "super") => {
                        i += 2;
                        use_tree(&toks, &mut i, prefix, &mut out);
                    }
                    Some(prefix) => use_tree(&toks, &mut i, prefix, &mut out),
                    None => i += 1,
                }
            }
            _ => i += 1,
        }
        for named in &mut out[pushed..] {
            named.3 = in_use && pub_use;
        }
    }
    out
}

/// One source file: its path relative to the manifest dir, its module and its text.
type Source = (String, Vec<String>, String);

/// Reads `src/`: every file with its module and text.
fn read_sources() -> Vec<Source> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    source_files(&src)
        .iter()
        .map(|(path, module)| {
            let rel = path
                .strip_prefix(Path::new(env!("CARGO_MANIFEST_DIR")))
                .expect("under the manifest dir")
                .display()
                .to_string();
            (rel, module.clone(), std::fs::read_to_string(path).expect("read source"))
        })
        .collect()
}

/// Reads `src/`: every module, the facades' re-exports, and every import with its home.
fn read_crate() -> (Crate, Vec<Import>) {
    analyze(&read_sources())
}

/// The crate the `texts` make: every module, the facades' re-exports, and every import with its
/// home.
fn analyze(texts: &[Source]) -> (Crate, Vec<Import>) {
    let mut krate = Crate {
        modules: texts.iter().map(|(_, m, _)| m.clone()).collect(),
        reexports: BTreeMap::new(),
    };
    krate.modules.insert(vec!["api".to_string()]);
    for module in ["registration", "v1", "v1beta1"] {
        krate.modules.insert(vec!["dra_api".to_string(), module.to_string()]);
    }
    krate.modules.insert(vec!["dra_api".to_string()]);
    // Facades: `pub use child::{A, B};` maps A and B to `module::child::A`, `…::B`.
    for (_, module, text) in texts {
        let toks = lex(text);
        let mut i = 0;
        while i < toks.len() {
            if toks[i].0 != Tok::Ident("pub".into()) {
                i += 1;
                continue;
            }
            i += 1;
            // `pub(crate)`, `pub(super)`, `pub(in …)`.
            if toks.get(i).map(|t| &t.0) == Some(&Tok::Punct('(')) {
                while i < toks.len() && toks[i].0 != Tok::Punct(')') {
                    i += 1;
                }
                i += 1;
            }
            if toks.get(i).map(|t| &t.0) != Some(&Tok::Ident("use".into())) {
                continue;
            }
            i += 1;
            let mut paths = Vec::new();
            let mut prefix = module.clone();
            while let (Some((Tok::Ident(w), _)), Some((Tok::PathSep, _))) = (toks.get(i), toks.get(i + 1)) {
                match w.as_str() {
                    "crate" => prefix.clear(),
                    "super" => {
                        prefix.pop();
                    }
                    "self" => {}
                    _ => break,
                }
                i += 2;
            }
            use_tree(&toks, &mut i, prefix, &mut paths);
            for (path, _, alias, _) in paths {
                if let Some(name) = alias.as_ref().or(path.last()) {
                    krate
                        .reexports
                        .entry(module.clone())
                        .or_default()
                        .insert(name.clone(), path.clone());
                }
            }
        }
    }
    let mut imports = Vec::new();
    for (rel, module, text) in texts {
        let lines: Vec<&str> = text.lines().collect();
        let mut seen = BTreeSet::new();
        for (path, line, _, reexport) in paths_in(text, module, &krate) {
            let to = krate.home(&path);
            if to.is_empty() || !seen.insert((line, to.clone())) {
                continue;
            }
            imports.push(Import {
                file: rel.clone(),
                line,
                from: module.clone(),
                to,
                text: lines.get(line - 1).map(|l| l.trim().to_string()).unwrap_or_default(),
                reexport,
            });
        }
    }
    (krate, imports)
}

/// The node a module path belongs to at the top level (`kube`) or inside a top-level module
/// (`kube/client`; the facade is `kube`).
fn top(module: &[String]) -> String {
    module.first().cloned().unwrap_or_else(|| "lib".to_string())
}

fn sub(module: &[String]) -> Option<String> {
    let first = module.first()?;
    if GENERATED.contains(&first.as_str()) {
        return None;
    }
    Some(match module.get(1) {
        Some(child) => format!("{first}/{child}"),
        None => first.clone(),
    })
}

/// The edges between nodes, each with the imports that make it; `inside`: only the edges between
/// two parts of one top-level module.
fn edges(
    imports: &[Import],
    inside: bool,
    node: impl Fn(&[String]) -> Option<String>,
) -> BTreeMap<(String, String), Vec<Import>> {
    let mut edges: BTreeMap<(String, String), Vec<Import>> = BTreeMap::new();
    for import in imports {
        let (Some(from), Some(to)) = (node(&import.from), node(&import.to)) else {
            continue;
        };
        // A facade's `pub use` of its own children is its public surface, not a dependency: the
        // children sit below the items the facade defines itself, which they may import.
        let surface = inside && import.reexport && import.from.len() == 1;
        if from != to && !surface && (!inside || top(&import.from) == top(&import.to)) {
            edges.entry((from, to)).or_default().push(import.clone());
        }
    }
    edges
}

/// The strongly connected components with more than one node (Tarjan).
fn cycles(edges: &BTreeMap<(String, String), Vec<Import>>) -> Vec<Vec<String>> {
    let mut graph: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (from, to) in edges.keys() {
        graph.entry(from).or_default().push(to);
        graph.entry(to).or_default();
    }
    struct State<'a> {
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(v: &'a str, graph: &BTreeMap<&'a str, Vec<&'a str>>, s: &mut State<'a>) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        for &w in &graph[v] {
            if !s.index.contains_key(w) {
                visit(w, graph, s);
                let low = s.low[v].min(s.low[w]);
                s.low.insert(v, low);
            } else if s.on_stack.contains(w) {
                let low = s.low[v].min(s.index[w]);
                s.low.insert(v, low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            loop {
                let w = s.stack.pop().expect("on the stack");
                s.on_stack.remove(w);
                component.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.out.push(component);
            }
        }
    }
    let mut state = State {
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for &v in graph.keys() {
        if !state.index.contains_key(v) {
            visit(v, &graph, &mut state);
        }
    }
    state.out
}

fn describe(import: &Import) -> String {
    format!(
        "{}:{}: `{}` (imports {})",
        import.file,
        import.line,
        import.text,
        import.to.join("::")
    )
}

/// Checks one level's edges against its layer table and exceptions; returns the violations.
fn check(
    edges: &BTreeMap<(String, String), Vec<Import>>,
    layers: &[(&str, u32)],
    exceptions: &[(&str, &str, &str)],
) -> Vec<String> {
    let layer: BTreeMap<&str, u32> = layers.iter().copied().collect();
    let mut problems = Vec::new();
    for ((from, to), imports) in edges {
        if exceptions.iter().any(|(f, t, _)| f == from && t == to) {
            continue;
        }
        let (Some(lf), Some(lt)) = (layer.get(from.as_str()), layer.get(to.as_str())) else {
            let missing = if layer.contains_key(from.as_str()) { to } else { from };
            problems.push(format!(
                "module `{missing}` is not in the layer table (tests/architecture.rs); add it and to ARCHITECTURE.md: {}",
                describe(&imports[0])
            ));
            continue;
        };
        if lt >= lf {
            for import in imports {
                problems.push(format!(
                    "`{from}` (layer {lf}) imports `{to}` (layer {lt}), which is not below it: {}",
                    describe(import)
                ));
            }
        }
    }
    problems
}

#[test]
fn modules_import_only_lower_layers() {
    let (_, imports) = read_crate();
    assert!(
        imports.len() > 100,
        "the import scanner found only {} imports; is it broken?",
        imports.len()
    );
    let mut problems = check(&edges(&imports, false, |m| Some(top(m))), LAYERS, EXCEPTIONS);
    problems.extend(check(&edges(&imports, true, sub), SUBLAYERS, &[]));
    assert!(
        problems.is_empty(),
        "imports against the layering (see ARCHITECTURE.md):\n{}",
        problems.join("\n")
    );
}

#[test]
fn module_graph_has_no_cycles_but_the_listed_exceptions() {
    let (_, imports) = read_crate();
    let mut top_edges = edges(&imports, false, |m| Some(top(m)));
    top_edges.retain(|(from, to), _| !EXCEPTIONS.iter().any(|(f, t, _)| f == from && t == to));
    let mut problems = Vec::new();
    for edges in [top_edges, edges(&imports, true, sub)] {
        for cycle in cycles(&edges) {
            problems.push(format!("cycle among {}:", cycle.join(", ")));
            for ((from, to), imports) in &edges {
                if cycle.contains(from) && cycle.contains(to) {
                    problems.push(format!("  {from} -> {to}: {}", describe(&imports[0])));
                }
            }
        }
    }
    assert!(problems.is_empty(), "module cycles:\n{}", problems.join("\n"));
}

/// The scanner itself: paths in `use` trees, inline paths, `super`, renames and relative child
/// paths count; comments, strings and char literals do not.
#[test]
fn scanner_finds_paths_and_skips_literals() {
    let module = |p: &str| p.split('/').map(str::to_string).collect::<Vec<String>>();
    let krate = Crate {
        modules: ["a", "a/b", "a/c", "d"].iter().map(|p| module(p)).collect(),
        reexports: BTreeMap::from([(module("a"), BTreeMap::from([("X".to_string(), module("a/c/X"))]))]),
    };
    let src = r##"
        use crate::{d::{self, Y}, a::X as Z};
        use super::c::Q;
        pub use c::W;
        // crate::d::NotThis
        /* crate::d::NorThis /* nested */ crate::d::NorThat */
        const S: &str = "crate::d::InAString";
        const R: &str = r#"crate::d::"InARawString"#;
        const C: char = '"';
        fn f<'a>(x: &'a str) -> u32 { crate::d::g(x); c::h(); 0 }
        mod tests { use super::*; use super::super::c::T; }
    "##;
    let found: Vec<String> = paths_in(src, &module("a/b"), &krate)
        .into_iter()
        .map(|(p, _, _, _)| krate.home(&p).join("/"))
        .collect();
    // `pub use c::W` is not relative here: `c` is not a child of `a/b` (it is a sibling).
    assert_eq!(found, ["d", "d", "a/c", "a/c", "d", "a/b", "a/c"], "{found:?}");
}

#[test]
fn every_layered_module_exists() {
    let (krate, _) = read_crate();
    for (name, _) in LAYERS {
        let path = vec![name.to_string()];
        assert!(
            krate.is_module(&path),
            "{name} is in LAYERS but not a module under src/"
        );
    }
    for (name, _) in SUBLAYERS {
        let path: Vec<String> = name.split('/').map(str::to_string).collect();
        assert!(
            krate.is_module(&path),
            "{name} is in SUBLAYERS but not a module under src/"
        );
    }
}

/// Every module with children has its table in [`SUBLAYERS`], its facade and each child: a new
/// child cannot go unchecked.
#[test]
fn every_module_with_children_has_a_sublayer_table() {
    let (krate, _) = read_crate();
    let layered: BTreeSet<&str> = SUBLAYERS.iter().map(|(name, _)| *name).collect();
    let mut missing = Vec::new();
    for module in krate.modules.iter().filter(|m| m.len() == 2) {
        let parent = module[0].as_str();
        if GENERATED.contains(&parent) {
            continue;
        }
        for name in [parent.to_string(), module.join("/")] {
            if !layered.contains(name.as_str()) && !missing.contains(&name) {
                missing.push(name);
            }
        }
    }
    assert!(
        missing.is_empty(),
        "not in SUBLAYERS (tests/architecture.rs; add them and to ARCHITECTURE.md): {missing:?}"
    );
}

/// The tables are applied to every module: an import planted in the lowest part of a table,
/// naming its highest part, is reported, at the top level and inside each module with children.
#[test]
fn a_planted_upward_import_is_reported_in_every_module() {
    let sources = read_sources();
    let binaries = ["main", "gna-gen"];
    let has_file = |node: &str, top_level: bool| {
        sources.iter().any(|(_, module, _)| {
            let of = if top_level {
                module.first().cloned()
            } else {
                sub(module)
            };
            of.as_deref() == Some(node)
        })
    };
    let mut tables: Vec<(String, Vec<(&str, u32)>)> = vec![("top level".to_string(), LAYERS.to_vec())];
    for (name, layer) in SUBLAYERS {
        let parent = name.split('/').next().expect("a name").to_string();
        match tables.iter_mut().find(|(p, _)| *p == parent) {
            Some((_, table)) => table.push((name, *layer)),
            None => tables.push((parent, vec![(name, *layer)])),
        }
    }
    let parents: BTreeSet<&str> = sources
        .iter()
        .filter(|(_, module, _)| module.len() > 1)
        .map(|(_, module, _)| module[0].as_str())
        .filter(|p| !GENERATED.contains(p))
        .collect();
    assert_eq!(
        tables.len(),
        parents.len() + 1,
        "a table for the top level and each of {parents:?}"
    );
    for (label, table) in tables {
        let top_level = label == "top level";
        let usable: Vec<(&str, u32)> = table
            .iter()
            .copied()
            .filter(|(n, _)| !binaries.contains(n) && has_file(n, top_level))
            .collect();
        let low = *usable.iter().min_by_key(|(_, l)| *l).expect("a module with a file");
        let high = *usable
            .iter()
            .filter(|(n, _)| *n != low.0)
            .max_by_key(|(_, l)| *l)
            .expect("two modules");
        let mut planted = sources.clone();
        let file = planted
            .iter_mut()
            .find(|(_, module, _)| {
                let of = if top_level {
                    module.first().cloned()
                } else {
                    sub(module)
                };
                of.as_deref() == Some(low.0)
            })
            .expect("a file of the low module");
        let file_name = file.0.clone();
        file.2.push_str(&format!(
            "\nfn planted() {{ crate::{}::Planted(); }}\n",
            high.0.replace('/', "::")
        ));
        let (_, imports) = analyze(&planted);
        let problems = if top_level {
            check(&edges(&imports, false, |m| Some(top(m))), LAYERS, EXCEPTIONS)
        } else {
            check(&edges(&imports, true, sub), SUBLAYERS, &[])
        };
        assert!(
            problems.iter().any(|p| p.contains("planted")),
            "{label}: an import from {} (layer {}) of {} (layer {}) planted in {} was not reported: {problems:?}",
            low.0,
            low.1,
            high.0,
            high.1,
            file_name
        );
    }
}

/// No module re-exports what another module defines (`pub use crate::…`, `pub use super::…`):
/// a type lives in the lowest module that needs it and everyone imports it from there
/// (ARCHITECTURE.md, "Rules that keep the graph acyclic"). A facade's `pub use` of its own
/// children is its public surface and stays.
#[test]
fn no_module_re_exports_what_another_module_defines() {
    let (_, imports) = read_crate();
    let problems: Vec<String> = imports
        .iter()
        .filter(|i| i.reexport && !i.to.starts_with(&i.from))
        .map(describe)
        .collect();
    assert!(
        problems.is_empty(),
        "compatibility re-exports (import from the defining module instead):\n{}",
        problems.join("\n")
    );
}

/// Prints every edge with the imports that make it, and the cycles.
#[test]
#[ignore = "a tool: prints the module graph"]
fn module_graph() {
    let (_, imports) = read_crate();
    let mut report = String::new();
    for (label, edges) in [
        ("top level", edges(&imports, false, |m| Some(top(m)))),
        ("inside split modules", edges(&imports, true, sub)),
    ] {
        writeln!(report, "== {label}").expect("write");
        for ((from, to), imports) in &edges {
            writeln!(report, "{from} -> {to}").expect("write");
            for import in imports {
                writeln!(report, "    {}", describe(import)).expect("write");
            }
        }
        writeln!(report, "cycles: {:?}", cycles(&edges)).expect("write");
    }
    // A layering that fits the submodules' edges as they are (the longest chain below each), to
    // start a module's SUBLAYERS table from.
    let (krate, _) = read_crate();
    let inner = edges(&imports, true, sub);
    writeln!(report, "== submodule layers that fit (where acyclic)").expect("write");
    let tops: BTreeSet<String> = krate
        .modules
        .iter()
        .filter(|m| m.len() > 1)
        .map(|m| m[0].clone())
        .collect();
    for parent in tops {
        let mut nodes: BTreeSet<String> = krate
            .modules
            .iter()
            .filter(|m| m.len() == 2 && m[0] == parent)
            .map(|m| format!("{}/{}", m[0], m[1]))
            .collect();
        nodes.insert(parent.clone());
        let mut level: BTreeMap<String, u32> = nodes.iter().map(|n| (n.clone(), 0)).collect();
        for _ in 0..nodes.len() {
            for (from, to) in inner.keys() {
                if let (Some(&lt), true) = (level.get(to), level.contains_key(from)) {
                    let lf = level.get_mut(from).expect("node");
                    *lf = (*lf).max(lt + 1);
                }
            }
        }
        for (node, l) in level {
            writeln!(report, "    (\"{node}\", {l}),").expect("write");
        }
    }
    println!("{report}");
}
