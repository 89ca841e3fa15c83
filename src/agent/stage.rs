//! What every stage has: its reported status, its retry policy, and the rule of which failed
//! stage holds back which later one. One mechanism for all stages: a failed stage runs again on
//! an exponential backoff with jitter, capped, restarting from the shortest delay when the
//! failure's cause changes; passes in between (a resync, an event) leave it as it is.

use std::time::{Duration, Instant};

use crate::exit::Exit;
use crate::host::backoff::Backoff;
use crate::status::{StageId, StageState, StageStatus, now_unix};

/// `run --once` exit code when a stage waits (GPU work holds a MIG or driver change):
/// EX_TEMPFAIL, try again later.
pub const EXIT_PENDING: i32 = Exit::TryLater as i32;

/// Whether a stage that `needs` those stages (its row of the agent's `PIPELINE`, the gating
/// rules) may run, given the stages that passed so far in this pass. A stage "passes" when its
/// step says the stages after it can work.
pub(super) fn may_run(needs: &[StageId], passed: &[StageId]) -> bool {
    needs.iter().all(|n| passed.contains(n))
}

/// Every stage, indexed by its id, in pass order.
pub(super) struct Stages([Stage; StageId::ALL.len()]);

impl Stages {
    pub(super) fn new(policy: (Duration, Duration)) -> Stages {
        Stages(StageId::ALL.map(|id| Stage::new(id, policy)))
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &Stage> {
        self.0.iter()
    }

    pub(super) fn iter_mut(&mut self) -> impl Iterator<Item = &mut Stage> {
        self.0.iter_mut()
    }

    /// The soonest time a failed stage waits for (past ones are left to the next pass: a stage
    /// held back by an earlier failed one must not wake the loop).
    pub(super) fn next_retry(&self) -> Option<Instant> {
        let now = Instant::now();
        self.iter().filter_map(|s| s.retry_at()).filter(|at| *at > now).min()
    }

    /// Every stage runs at the next pass, whatever its backoff says.
    pub(super) fn all_now(&mut self) {
        for stage in self.iter_mut() {
            stage.now();
        }
    }

    /// `run --once`'s exit code after its pass: 1 when a stage failed; pending counts as not
    /// done (the bootstrap should not go on as if MIG were applied): [`EXIT_PENDING`].
    pub(super) fn once_exit_code(&self) -> i32 {
        let states: Vec<StageState> = self.iter().map(|s| s.status.state).collect();
        if states.contains(&StageState::Failed) {
            1
        } else if states.contains(&StageState::Pending) {
            EXIT_PENDING
        } else {
            0
        }
    }
}

impl std::ops::Index<StageId> for Stages {
    type Output = Stage;
    fn index(&self, id: StageId) -> &Stage {
        // `ALL` lists every id once, in declaration order: the id is its own index.
        &self.0[id as usize]
    }
}

impl std::ops::IndexMut<StageId> for Stages {
    fn index_mut(&mut self, id: StageId) -> &mut Stage {
        &mut self.0[id as usize]
    }
}

/// One stage's status and retry state.
pub(super) struct Stage {
    pub(super) id: StageId,
    pub(super) status: StageStatus,
    retry: Retry,
    /// What the step said last: whether the stages after it could run. A stage held back by its
    /// backoff answers the same until it runs again.
    passed: bool,
}

impl Stage {
    pub(super) fn new(id: StageId, policy: (Duration, Duration)) -> Stage {
        Stage {
            id,
            status: StageStatus {
                name: id.as_str().into(),
                state: StageState::Pending,
                since: now_unix(),
                error: None,
                detail: None,
            },
            retry: Retry::new(policy.0, policy.1),
            passed: true,
        }
    }

    pub(super) fn set(&mut self, state: StageState, error: Option<String>, detail: Option<String>) {
        if self.status.state != state {
            self.status.since = now_unix();
            tracing::info!(stage = %self.status.name, "stage {} is now {:?}", self.status.name, state);
        }
        self.status.state = state;
        self.status.error = error;
        self.status.detail = detail;
    }

    /// Skipped because the node has nothing for any stage to do (no NVIDIA GPU): the agent says
    /// that once for all stages, so no line per stage.
    pub(super) fn idle(&mut self, detail: &str) {
        if self.status.state != StageState::Skipped {
            self.status.since = now_unix();
        }
        self.status.state = StageState::Skipped;
        self.status.error = None;
        self.status.detail = Some(detail.to_string());
    }

    /// Whether the stage's step runs in a pass at `now`: not while a failure's backoff lasts.
    pub(super) fn due(&self, now: Instant) -> bool {
        self.retry.at.is_none_or(|at| now >= at)
    }

    /// What the stage answered last (see [`Stage::passed`]), for a pass that leaves it be.
    pub(super) fn held(&self) -> bool {
        tracing::debug!(
            stage = self.id.as_str(),
            "stage {} waits for its next attempt",
            self.id.as_str()
        );
        self.passed
    }

    /// After the step ran: a failure schedules the next attempt, anything else ends the backoff.
    pub(super) fn ran(&mut self, passed: bool) -> bool {
        self.passed = passed;
        match (self.status.state, &self.status.error) {
            (StageState::Failed, Some(error)) => {
                let wait = self.retry.failed(error, Instant::now());
                tracing::warn!(
                    stage = self.id.as_str(),
                    "stage {} failed: trying again in {wait:?} (attempt {})",
                    self.id.as_str(),
                    self.retry.attempts + 1
                );
            }
            _ => self.retry.succeeded(),
        }
        passed
    }

    /// When the stage wants to run again, while it waits.
    pub(super) fn retry_at(&self) -> Option<Instant> {
        self.retry.at
    }

    /// Run at the next pass, whatever the backoff says (SIGHUP, a new desired state, NVML back):
    /// the backoff's step is kept for the next failure of the same cause.
    pub(super) fn now(&mut self) {
        self.retry.at = None;
    }
}

/// The backoff of a failing stage.
struct Retry {
    backoff: Backoff,
    /// The failure the backoff counts (a different one starts again from the shortest delay).
    cause: Option<String>,
    /// When to run again.
    at: Option<Instant>,
    /// Failed attempts of this cause in a row.
    attempts: u32,
}

impl Retry {
    fn new(min: Duration, max: Duration) -> Retry {
        Retry {
            backoff: Backoff::new(min, max),
            cause: None,
            at: None,
            attempts: 0,
        }
    }

    fn failed(&mut self, cause: &str, now: Instant) -> Duration {
        if self.cause.as_deref() != Some(cause) {
            self.backoff.reset();
            self.cause = Some(cause.to_string());
            self.attempts = 0;
        }
        self.attempts += 1;
        let wait = self.backoff.next();
        self.at = Some(now + wait);
        wait
    }

    fn succeeded(&mut self) {
        self.backoff.reset();
        self.cause = None;
        self.at = None;
        self.attempts = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_failing_cause_backs_off_doubling_to_the_cap_and_a_new_cause_starts_over() {
        let mut r = Retry::new(100 * MS, 800 * MS);
        let now = Instant::now();
        let waits: Vec<Duration> = (0..6).map(|_| r.failed("a", now)).collect();
        for (wait, base) in waits.iter().zip([100, 200, 400, 800, 800, 800]) {
            // Equal jitter: between half the step and the step.
            assert!(*wait >= base * MS / 2 && *wait <= base * MS, "{waits:?}");
        }
        assert_eq!(r.attempts, 6);
        let wait = r.failed("b", now);
        assert!(wait <= 100 * MS, "a new cause starts over: {wait:?}");
        assert_eq!(r.attempts, 1);
        r.succeeded();
        assert_eq!(r.at, None);
    }
}
