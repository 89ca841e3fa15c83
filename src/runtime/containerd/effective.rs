//! What containerd says it runs with: the runtimes and socket of `containerd config dump`, and
//! whether its CRI plugin is disabled.

use toml_edit::{DocumentMut, Item};

use super::{CRI_PLUGIN_V1, CRI_PLUGIN_V2, CRI_PLUGIN_V3, RUNC, cri_plugin};
use crate::runtime::{DefaultRuntime, NvidiaRuntime};

/// The plugin IDs that, listed in `disabled_plugins`, turn containerd's CRI off.
const CRI_PLUGIN_IDS: [&str; 3] = [CRI_PLUGIN_V1, CRI_PLUGIN_V2, CRI_PLUGIN_V3];

/// Whether containerd's CRI plugin is off: `disabled_plugins` of `text` (the effective config,
/// or the top-level file when containerd cannot be asked) names it. Docker's `containerd.io`
/// package ships `disabled_plugins = ["cri"]`: no kubelet can use such a containerd, so the agent
/// leaves it alone. A file that does not parse says nothing here (the edit reports it).
pub fn cri_disabled(text: &str) -> bool {
    let Ok(doc) = text.parse::<DocumentMut>() else {
        return false;
    };
    doc.get("disabled_plugins").and_then(Item::as_array).is_some_and(|a| {
        a.iter()
            .any(|v| v.as_str().is_some_and(|id| CRI_PLUGIN_IDS.contains(&id)))
    })
}

/// Checks that `dump`, the output of `containerd config dump` (the merged config, version 2 or
/// 3), has the runtimes of `rt`: `plugins.<cri>.containerd.runtimes.<name>.options.BinaryName`
/// is the runtime's binary, the runtime `default_runtime_name` names (`runc` when unset) is
/// defined (the CRI plugin does not load otherwise), and, when requested, `default_runtime_name`
/// is `rt.name` and `enable_cdi` is true.
///
/// The error lists everything that is missing, in words.
pub fn dump_has_runtime(dump: &str, rt: &NvidiaRuntime) -> Result<(), String> {
    let doc = dump
        .parse::<DocumentMut>()
        .map_err(|e| format!("config dump is not valid TOML: {}", e.message()))?;
    let version = match doc.get("version").map(|v| v.as_integer()) {
        None => 2,
        Some(Some(v)) => u32::try_from(v).map_err(|_| format!("config dump has version {v}"))?,
        Some(None) => return Err("config dump has a non-integer version".to_owned()),
    };
    let cri = cri_plugin(version.max(2));
    let cri_item = doc.get("plugins").and_then(|p| p.get(cri));
    let containerd = cri_item.and_then(|c| c.get("containerd"));
    let runtimes = containerd.and_then(|c| c.get("runtimes"));
    let mut problems = Vec::new();
    for (name, binary) in rt.all() {
        let binary = binary.to_string_lossy();
        match runtimes.and_then(|r| r.get(name)) {
            None => problems.push(format!(
                "no runtime `{name}` (plugins.\"{cri}\".containerd.runtimes.{name})"
            )),
            Some(runtime) => match runtime
                .get("options")
                .and_then(|o| o.get("BinaryName"))
                .and_then(Item::as_str)
            {
                Some(found) if found == binary => {}
                Some(found) => problems.push(format!(
                    "runtime `{name}` has BinaryName {found:?}, expected {binary:?}"
                )),
                None => problems.push(format!("runtime `{name}` has no options.BinaryName")),
            },
        }
    }
    let default = containerd
        .and_then(|c| c.get("default_runtime_name"))
        .and_then(Item::as_str);
    if rt.default == DefaultRuntime::Set && default != Some(rt.name.as_str()) {
        problems.push(format!(
            "default_runtime_name is {}, expected {:?}",
            default.map_or_else(|| "unset".to_owned(), |d| format!("{d:?}")),
            rt.name
        ));
    }
    let default = default.filter(|d| !d.is_empty()).unwrap_or(RUNC);
    if runtimes.and_then(|r| r.get(default)).is_none() {
        problems.push(format!(
            "default_runtime_name {default:?} names no runtime in plugins.\"{cri}\".containerd.runtimes, \
             so containerd's CRI plugin would not load"
        ));
    }
    if rt.enable_cdi && cri_item.and_then(|c| c.get("enable_cdi")).and_then(Item::as_bool) != Some(true) {
        problems.push(format!("plugins.\"{cri}\".enable_cdi is not true"));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("; "))
    }
}

/// The CRI socket of the effective configuration `dump`: `[grpc] address`, containerd's
/// default `/run/containerd/containerd.sock` when unset.
pub fn dump_address(dump: &str) -> String {
    dump.parse::<DocumentMut>()
        .ok()
        .and_then(|doc| doc.get("grpc")?.get("address")?.as_str().map(str::to_owned))
        .filter(|a| !a.is_empty())
        .unwrap_or_else(|| DEFAULT_ADDRESS.to_owned())
}

/// containerd's gRPC (and CRI) socket when `[grpc] address` is not set.
pub const DEFAULT_ADDRESS: &str = "/run/containerd/containerd.sock";

/// Whether the drop-in `drop_in` (its text) changes nothing containerd runs with, `dump` being
/// `containerd config dump` without it: its CRI table merged the way containerd loads an import
/// (containerd 2.x, a version 3 dump: key by key, a value replacing the one before; 1.x: the
/// whole plugin table replaced) gives the dump's CRI table as it is.
///
/// A drop-in with anything else than `version` and one CRI plugin table, or either text not
/// parsing, counts as a change.
pub fn drop_in_changes_nothing(dump: &str, drop_in: &str) -> bool {
    let (Ok(dump), Ok(drop_in)) = (dump.parse::<toml::Table>(), drop_in.parse::<toml::Table>()) else {
        return false;
    };
    let merging = dump
        .get("version")
        .and_then(toml::Value::as_integer)
        .is_some_and(|v| v >= 3);
    let dumped = if merging { CRI_PLUGIN_V3 } else { CRI_PLUGIN_V2 };
    let Some(current) = dump
        .get("plugins")
        .and_then(|p| p.get(dumped))
        .and_then(toml::Value::as_table)
    else {
        return false;
    };
    let mut ours = None;
    for (key, value) in &drop_in {
        match (key.as_str(), value) {
            ("version", toml::Value::Integer(_)) => {}
            ("plugins", toml::Value::Table(plugins)) => {
                for (id, table) in plugins {
                    match table.as_table() {
                        Some(table) if ours.is_none() && CRI_PLUGIN_IDS.contains(&id.as_str()) => ours = Some(table),
                        _ => return false,
                    }
                }
            }
            _ => return false,
        }
    }
    match ours {
        // No CRI table: nothing replaced or merged.
        None => true,
        Some(ours) if merging => {
            let mut merged = current.clone();
            merge(&mut merged, ours);
            merged == *current
        }
        Some(ours) => ours == current,
    }
}

/// `over` merged into `table` key by key: a table into a table, anything else replacing.
fn merge(table: &mut toml::Table, over: &toml::Table) {
    for (key, value) in over {
        match (table.get_mut(key), value) {
            (Some(toml::Value::Table(mine)), toml::Value::Table(theirs)) => merge(mine, theirs),
            _ => {
                table.insert(key.clone(), value.clone());
            }
        }
    }
}
