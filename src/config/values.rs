//! Value types of the config: closed sets as enums, durations, and the string checks that
//! validation uses. Deserialization errors here say only what is allowed; the caller adds the
//! file, line, key and value.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serialize, Serializer};

use crate::names::is_dns_subdomain;

/// The value given for a closed set was not one of its members.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{input:?} is not valid: expected one of {expected}")]
pub struct ParseEnumError {
    /// What was given.
    pub input: String,
    /// The allowed spellings, comma-separated.
    pub expected: String,
}

/// Declares a config enum spelled by fixed strings, with `as_str`, `ALL`, `Display`,
/// `FromStr` and serde impls whose error lists the allowed spellings.
macro_rules! closed_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $text:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $( $(#[$vmeta])* $variant, )+
        }

        impl $name {
            /// Every member, in documentation order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The spelling used in the config file.
            pub fn as_str(self) -> &'static str {
                match self {
                    $( $name::$variant => $text, )+
                }
            }

            /// The allowed spellings, comma-separated, for messages.
            pub fn expected() -> String {
                Self::ALL.iter().map(|v| v.as_str()).collect::<Vec<_>>().join(", ")
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = ParseEnumError;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::ALL.iter().copied().find(|v| v.as_str() == s).ok_or_else(|| {
                    ParseEnumError { input: s.to_owned(), expected: Self::expected() }
                })
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                d.deserialize_str(EnumVisitor::<$name>::new())
            }
        }

        impl ClosedEnum for $name {
            fn parse(s: &str) -> Result<Self, ParseEnumError> {
                s.parse()
            }
            fn expected() -> String {
                $name::expected()
            }
        }
    };
}

/// What the shared visitor needs from a [`closed_enum!`] type.
trait ClosedEnum: Sized {
    fn parse(s: &str) -> Result<Self, ParseEnumError>;
    fn expected() -> String;
}

struct EnumVisitor<T>(std::marker::PhantomData<T>);

impl<T> EnumVisitor<T> {
    fn new() -> Self {
        EnumVisitor(std::marker::PhantomData)
    }
}

impl<T: ClosedEnum> Visitor<'_> for EnumVisitor<T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "one of {}", T::expected())
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<T, E> {
        T::parse(v).map_err(|e| E::custom(format_args!("expected one of {}", e.expected)))
    }
}

/// `runtime.set_as_default`: whether the `nvidia` runtime becomes an engine's default runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetAsDefault {
    /// `"auto"`: in the engine the kubelet uses (an unmodified GPU pod gets its GPU, as under
    /// the GPU Operator); the other engines' defaults stay as they are, `nvidia` included.
    Auto,
    /// `true`: in every engine.
    Always,
    /// `false`: in none; a default that names the agent's runtime goes back to the engine's own.
    Never,
}

impl Serialize for SetAsDefault {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            SetAsDefault::Auto => s.serialize_str("auto"),
            SetAsDefault::Always => s.serialize_bool(true),
            SetAsDefault::Never => s.serialize_bool(false),
        }
    }
}

impl<'de> Deserialize<'de> for SetAsDefault {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = SetAsDefault;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("\"auto\", true or false")
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<SetAsDefault, E> {
                Ok(if v { SetAsDefault::Always } else { SetAsDefault::Never })
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<SetAsDefault, E> {
                match v {
                    "auto" => Ok(SetAsDefault::Auto),
                    _ => Err(E::custom("expected \"auto\", true or false")),
                }
            }
        }
        d.deserialize_any(V)
    }
}

closed_enum! {
    /// Log output format (`log.format`).
    pub enum LogFormat {
        /// `journald` when stderr is connected to the journal (`JOURNAL_STREAM` is set),
        /// `text` otherwise.
        Auto = "auto",
        /// Structured records sent to the journal.
        Journald = "journald",
        /// Human-readable lines on stderr.
        Text = "text",
    }
}

closed_enum! {
    /// How MIG devices are advertised (`device_plugin.mig_strategy`), as in NVIDIA's plugin.
    pub enum MigStrategy {
        /// MIG devices are not advertised; every GPU, MIG-enabled or not, is a whole `nvidia.com/gpu`.
        None = "none",
        /// Every GPU has the same MIG layout; devices are advertised as `nvidia.com/gpu`.
        Single = "single",
        /// Each MIG profile is its own resource, `nvidia.com/mig-<profile>`.
        Mixed = "mixed",
    }
}

closed_enum! {
    /// What a MIG layout does with a MIG-capable GPU no entry covers (`mig.uncovered_gpus`).
    pub enum UncoveredGpus {
        /// Leave it as it is; the layout still succeeds (mig-manager's behaviour).
        Leave = "leave",
        /// Refuse the layout before anything changes, naming the GPU.
        Fail = "fail",
    }
}

closed_enum! {
    /// How allocated devices are passed to the container (`device_plugin.device_list_strategy`).
    pub enum DeviceListStrategy {
        /// `envvar` when the engines get the NVIDIA runtime, `cdi-cri` when they do not
        /// (`runtime.mode`, itself `auto`: no NVIDIA Container Toolkit on the node means CDI only).
        /// Resolved once when the agent starts; it stands alone in a list.
        Auto = "auto",
        /// `NVIDIA_VISIBLE_DEVICES` environment variable, read by the NVIDIA runtime hook.
        Envvar = "envvar",
        /// Mounts under `/var/run/nvidia-container-devices/`, read by the runtime hook.
        VolumeMounts = "volume-mounts",
        /// CDI device names in pod annotations.
        CdiAnnotations = "cdi-annotations",
        /// CDI device names in the CRI `CDIDevices` field.
        CdiCri = "cdi-cri",
        /// Device nodes plus a mount of the host's driver directory, no runtime hook (the GKE
        /// installer style).
        HostMounts = "host-mounts",
    }
}

impl DeviceListStrategy {
    /// Whether the strategy hands devices over as CDI names.
    pub fn is_cdi(self) -> bool {
        matches!(self, DeviceListStrategy::CdiAnnotations | DeviceListStrategy::CdiCri)
    }

    /// Whether the strategy needs the NVIDIA runtime in the engines to deliver a GPU (its hook
    /// reads the variable or the mounts).
    pub fn needs_runtime(self) -> bool {
        matches!(self, DeviceListStrategy::Envvar | DeviceListStrategy::VolumeMounts)
    }
}

closed_enum! {
    /// How devices are named in `Allocate` responses (`device_plugin.device_id_strategy`).
    pub enum DeviceIdStrategy {
        /// `GPU-...` / `MIG-...` UUIDs.
        Uuid = "uuid",
        /// NVML indexes, `0` or `0:1` for a MIG device.
        Index = "index",
    }
}

closed_enum! {
    /// How advertised devices are shared (`device_plugin.sharing.strategy`).
    pub enum SharingStrategy {
        /// Every device is advertised once.
        None = "none",
        /// CUDA time-slicing: each device is advertised as `replicas` devices `<id>::<n>`.
        TimeSlicing = "time-slicing",
        /// CUDA MPS: replicas as under time-slicing, served by an MPS control daemon per shared
        /// resource that the agent runs, with memory and thread limits per replica.
        Mps = "mps",
    }
}

closed_enum! {
    /// How `GetPreferredAllocation` picks shared devices (MIG devices and replicas)
    /// (`device_plugin.sharing.policy`, NVIDIA's `sharedDevicesAllocationPolicy`). Devices are
    /// grouped as NVIDIA v0.20 groups them: a replica with the other replicas of its device, a
    /// MIG device or whole GPU alone; "allocated" counts a group's devices that are not
    /// available or already chosen.
    pub enum SharedPolicy {
        /// NVIDIA's default: the group with the fewest allocated, then the one this request
        /// took the fewest from.
        Distributed = "distributed",
        /// The group with the most allocated, then the one this request took the fewest from.
        Packed = "packed",
        /// The group this request took the fewest from (must-include devices count), then the
        /// fewest allocated: a multi-replica request gets distinct GPUs while any have a
        /// replica free (NVIDIA's `spread`, on its main branch after v0.20).
        Spread = "spread",
    }
}

closed_enum! {
    /// What the memory-limit enforcer does with a process over its replica's memory budget
    /// (`device_plugin.memory_limits.action`).
    pub enum MemoryAction {
        /// Log it (and report it in status).
        Log = "log",
        /// SIGTERM the process, then SIGKILL after `grace_period`.
        Kill = "kill",
        /// Log what `kill` would do, and do nothing.
        DryRun = "dry-run",
    }
}

/// `device_plugin.device_list_strategy`: one strategy or a list of them. A single string in
/// the file is read as a one-element list; it is always written back as a list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct DeviceListStrategies(pub Vec<DeviceListStrategy>);

impl DeviceListStrategies {
    /// The strategies in the order given.
    pub fn as_slice(&self) -> &[DeviceListStrategy] {
        &self.0
    }

    /// Whether `strategy` is one of them.
    pub fn contains(&self, strategy: DeviceListStrategy) -> bool {
        self.0.contains(&strategy)
    }
}

impl<'de> Deserialize<'de> for DeviceListStrategies {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct OneOrMany;

        impl<'de> Visitor<'de> for OneOrMany {
            type Value = DeviceListStrategies;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(
                    f,
                    "a strategy or an array of strategies, each one of {}",
                    DeviceListStrategy::expected()
                )
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                EnumVisitor::<DeviceListStrategy>::new()
                    .visit_str(v)
                    .map(|s| DeviceListStrategies(vec![s]))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some(s) = seq.next_element()? {
                    out.push(s);
                }
                Ok(DeviceListStrategies(out))
            }
        }

        d.deserialize_any(OneOrMany)
    }
}

// === durations ===

/// A duration string was not `<number><unit>` (repeated), unit one of ms, s, m, h.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{input:?} is not valid: {DURATION_EXPECTED}")]
pub struct ParseDurationError {
    /// What was given.
    pub input: String,
}

const DURATION_EXPECTED: &str = "expected a duration such as \"500ms\", \"5s\", \"2m\", \"1h\" or \"1h30m\"";

/// Parses a duration written as one or more `<integer><unit>` parts, unit one of `ms`, `s`,
/// `m`, `h`: `"500ms"`, `"5s"`, `"2m"`, `"1h30m"`, `"0s"`.
pub fn parse_duration(input: &str) -> Result<Duration, ParseDurationError> {
    let err = || ParseDurationError {
        input: input.to_owned(),
    };
    let mut rest = input;
    let mut total_ms: u64 = 0;
    if rest.is_empty() {
        return Err(err());
    }
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(err());
        }
        let n: u64 = rest[..digits].parse().map_err(|_| err())?;
        rest = &rest[digits..];
        let unit_len = rest.bytes().take_while(u8::is_ascii_alphabetic).count();
        let per_ms: u64 = match &rest[..unit_len] {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            _ => return Err(err()),
        };
        rest = &rest[unit_len..];
        total_ms = n
            .checked_mul(per_ms)
            .and_then(|ms| total_ms.checked_add(ms))
            .ok_or_else(err)?;
    }
    Ok(Duration::from_millis(total_ms))
}

/// Writes a duration the way [`parse_duration`] reads it, in the largest unit that divides it
/// exactly: `"1h"`, `"90s"`, `"500ms"`, `"0s"`. Sub-millisecond parts are dropped.
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    match ms {
        0 => "0s".to_owned(),
        ms if ms % 3_600_000 == 0 => format!("{}h", ms / 3_600_000),
        ms if ms % 60_000 == 0 => format!("{}m", ms / 60_000),
        ms if ms % 1_000 == 0 => format!("{}s", ms / 1_000),
        ms => format!("{ms}ms"),
    }
}

/// `#[serde(with = "values::duration")]` for `std::time::Duration` fields.
pub(crate) mod duration {
    use super::*;

    pub(crate) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format_duration(*d))
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        struct DurationVisitor;

        impl Visitor<'_> for DurationVisitor {
            type Value = Duration;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(DURATION_EXPECTED.trim_start_matches("expected "))
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Duration, E> {
                parse_duration(v).map_err(|_| E::custom(DURATION_EXPECTED))
            }
        }

        d.deserialize_str(DurationVisitor)
    }
}

// === string checks used by validation ===

/// Checks a `tracing` filter directive list: comma-separated items, each `level` or
/// `target=level`, target made of `[A-Za-z0-9_:]`, level one of off, error, warn, info, debug,
/// trace (any case). Returns what is wrong.
pub(crate) fn check_log_filter(filter: &str) -> Result<(), String> {
    const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];
    const EXPECTED: &str = "expected a level (off, error, warn, info, debug, trace) or a \
         comma-separated list of `level` and `target=level` items, e.g. \"info,gpu_node_agent=debug\"";
    let is_level = |s: &str| LEVELS.iter().any(|l| l.eq_ignore_ascii_case(s));
    let is_target = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':');
    let items: Vec<&str> = filter.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
    if items.is_empty() {
        return Err(EXPECTED.to_owned());
    }
    for item in items {
        let ok = match item.split_once('=') {
            Some((target, level)) => is_target(target) && is_level(level),
            None => is_level(item),
        };
        if !ok {
            return Err(format!("{item:?}: {EXPECTED}"));
        }
    }
    Ok(())
}

/// Checks a CDI device kind `<vendor>/<class>`: vendor a DNS subdomain, class as the CDI spec
/// allows (a letter first, then letters, digits, '_', '-' and '.', ending in a letter or
/// digit).
pub(crate) fn check_cdi_kind(kind: &str) -> Result<(), String> {
    const EXPECTED: &str =
        "expected <vendor>/<class> with vendor a DNS name, e.g. \"k8s.device-plugin.nvidia.com/gpu\"";
    let Some((vendor, class)) = kind.split_once('/') else {
        return Err(EXPECTED.to_owned());
    };
    let class_ok = class.as_bytes().first().is_some_and(u8::is_ascii_alphabetic)
        && class.as_bytes().last().is_some_and(u8::is_ascii_alphanumeric)
        && class
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if is_dns_subdomain(vendor) && class_ok {
        Ok(())
    } else {
        Err(EXPECTED.to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        for bad in ["", "5", "s", "5x", "5 s", "-5s", "1.5s", "5S", "99999999999999999999h"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn durations_format_round_trip() {
        for s in ["0s", "500ms", "1500ms", "5s", "90s", "2m", "1h", "25h"] {
            assert_eq!(format_duration(parse_duration(s).unwrap()), s);
        }
        assert_eq!(format_duration(Duration::from_secs(60)), "1m");
    }

    #[test]
    fn log_filters() {
        for ok in [
            "info",
            "DEBUG",
            "off",
            "info,gpu_node_agent=debug",
            "warn, tonic::transport=trace,",
        ] {
            assert_eq!(check_log_filter(ok), Ok(()), "{ok:?}");
        }
        for bad in ["", ",", "loud", "info,=debug", "a-b=info", "x=loud", "info;debug"] {
            assert!(check_log_filter(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn cdi_kinds() {
        assert_eq!(check_cdi_kind("k8s.device-plugin.nvidia.com/gpu"), Ok(()));
        assert_eq!(check_cdi_kind("nvidia.com/gpu"), Ok(()));
        for bad in [
            "gpu",
            "nvidia.com/",
            "/gpu",
            "Nvidia.com/gpu",
            "nvidia.com/gpu/x",
            "-a.com/gpu",
            "nvidia.com/1gpu",
        ] {
            assert!(check_cdi_kind(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn enums_parse_and_list() {
        assert_eq!("mixed".parse(), Ok(MigStrategy::Mixed));
        let err = "mixd".parse::<MigStrategy>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "\"mixd\" is not valid: expected one of none, single, mixed"
        );
        assert_eq!(DeviceListStrategy::VolumeMounts.to_string(), "volume-mounts");
        assert_eq!("spread".parse(), Ok(SharedPolicy::Spread));
        let err = "tight".parse::<SharedPolicy>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "\"tight\" is not valid: expected one of distributed, packed, spread"
        );
    }
}
