//! What the loop and the long-lived tasks wait on: a step raced against SIGTERM, the next change
//! of a channel that may not exist, a time that may not be set.

use std::time::Instant;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::cluster::LabelsView;

/// Runs `work` until it ends or `stop` is cancelled, whichever comes first. A cancelled step is
/// dropped at its await point; what it runs off the loop (NVML calls, commands) looks at the same
/// token and ends at its next safe point.
pub(super) async fn or_stop<T>(stop: &CancellationToken, work: impl std::future::Future<Output = T>) -> Option<T> {
    tokio::select! {
        biased;
        () = stop.cancelled() => None,
        done = work => Some(done),
    }
}

/// The next change of a watch channel, or never when there is none.
pub(super) async fn changed<T>(rx: &mut Option<watch::Receiver<T>>) -> Result<(), watch::error::RecvError> {
    match rx {
        Some(rx) => rx.changed().await,
        None => std::future::pending().await,
    }
}

/// The DRA driver's status changed; pending forever without a driver.
pub(super) async fn dra_status_changed(dra: &mut Option<crate::dra::DraHandle>) -> Result<(), watch::error::RecvError> {
    match dra {
        Some(d) => d.status.changed().await,
        None => std::future::pending().await,
    }
}

/// The next labels view, or never when there is no link.
pub(super) async fn next_view(
    rx: &mut Option<watch::Receiver<LabelsView>>,
) -> Result<LabelsView, watch::error::RecvError> {
    match rx {
        Some(rx) => {
            rx.changed().await?;
            Ok(rx.borrow_and_update().clone())
        }
        None => std::future::pending().await,
    }
}

/// Sleeps until `at`, or forever when it is not set.
pub(super) async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}
