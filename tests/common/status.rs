//! The agent's status.json read as the typed [`Status`] the agent writes, so that a test says
//! which stage is in which state instead of probing JSON by key. The file's exact spelling is a
//! contract of its own, checked by the tests that read it as JSON on purpose.

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use gpu_node_agent::status::{DesiredStatus, StageId, StageState, StageStatus, Status};

use super::Node;

/// Parses the status file at `path` (panics when it is missing or does not parse).
pub fn read_status(path: &Path) -> Status {
    let text = fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Status::parse(&text).unwrap_or_else(|e| panic!("{} parses: {e}\n{text}", path.display()))
}

/// The stage `id` (panics, showing the stages, when the status has none of that name).
pub fn stage(status: &Status, id: StageId) -> &StageStatus {
    find_stage(status, id).unwrap_or_else(|| panic!("no stage {} in {:?}", id.as_str(), status.stages))
}

/// The stage `id`, `None` when the status does not list it (yet).
pub fn find_stage(status: &Status, id: StageId) -> Option<&StageStatus> {
    status.stages.iter().find(|s| s.name == id.as_str())
}

/// Whether the stage `id` is listed and in `state` (for the predicates of [`Node::wait_status`]).
pub fn stage_is(status: &Status, id: StageId, state: StageState) -> bool {
    find_stage(status, id).is_some_and(|s| s.state == state)
}

/// The stage's error (`None` when it has none, or is not listed).
pub fn stage_error(status: &Status, id: StageId) -> Option<&str> {
    find_stage(status, id).and_then(|s| s.error.as_deref())
}

/// The stage's detail line (`None` when it has none, or is not listed).
pub fn stage_detail(status: &Status, id: StageId) -> Option<&str> {
    find_stage(status, id).and_then(|s| s.detail.as_deref())
}

/// The label `key` the agent reports on its Node.
pub fn label<'a>(status: &'a Status, key: &str) -> Option<&'a str> {
    status.labels.get(key).map(String::as_str)
}

/// Where the desired state comes from (panics when the status has no `desired`).
pub fn desired(status: &Status) -> &DesiredStatus {
    status
        .desired
        .as_ref()
        .unwrap_or_else(|| panic!("no desired state in the status: {status:?}"))
}

/// Whether the status has a desired state and `pred` holds for it.
pub fn desired_is(status: &Status, pred: impl Fn(&DesiredStatus) -> bool) -> bool {
    status.desired.as_ref().is_some_and(pred)
}

/// The last failure to read the desired state (`None` when there is none, or no desired state).
pub fn desired_error(status: &Status) -> Option<&str> {
    status.desired.as_ref().and_then(|d| d.error.as_deref())
}

impl Node {
    /// status.json, typed.
    pub fn status(&self) -> Status {
        read_status(&self.status_path())
    }

    /// status.json as JSON, for the tests that check the file's spelling itself.
    pub fn status_json(&self) -> serde_json::Value {
        let text = fs::read_to_string(self.status_path()).expect("status.json");
        serde_json::from_str(&text).expect("status.json parses")
    }

    /// Polls status.json until `pred` holds (the file is written atomically; one that does not
    /// parse yet counts as not there).
    pub fn wait_status(&self, timeout: Duration, pred: impl Fn(&Status) -> bool) -> Status {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(text) = fs::read_to_string(self.status_path())
                && let Ok(status) = Status::parse(&text)
                && pred(&status)
            {
                return status;
            }
            if Instant::now() > deadline {
                let text = fs::read_to_string(self.status_path()).unwrap_or_default();
                panic!("status.json did not reach the expected state in {timeout:?}; last:\n{text}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
