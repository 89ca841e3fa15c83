//! Exponential backoff with jitter: the API client's retries and the stages' (one policy).

use std::time::Duration;

/// How a delay is randomised, so that many nodes that failed together do not retry together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Jitter {
    /// Exactly the computed delay.
    None,
    /// Uniform in `[0, delay]`.
    Full,
    /// Uniform in `[delay/2, delay]`: never shorter than half the computed delay.
    Equal,
}

/// Doubling delays from `min` to `max`, jittered.
#[derive(Debug, Clone)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    jitter: Jitter,
    next_base: Duration,
}

impl Backoff {
    /// Delays from `min` doubling up to `max`, with equal jitter. A `max` below `min` is raised
    /// to `min`.
    pub fn new(min: Duration, max: Duration) -> Backoff {
        Backoff::with_jitter(min, max, Jitter::Equal)
    }

    /// Like [`Backoff::new`] with the given jitter.
    pub fn with_jitter(min: Duration, max: Duration, jitter: Jitter) -> Backoff {
        let max = max.max(min);
        Backoff {
            min,
            max,
            jitter,
            next_base: min,
        }
    }

    /// The next delay: the current step, jittered, and the step doubles (up to `max`).
    #[allow(clippy::should_implement_trait)] // infinite and infallible: not an Iterator
    pub fn next(&mut self) -> Duration {
        let base = self.next_base;
        self.next_base = base.saturating_mul(2).min(self.max);
        jittered(base, self.jitter)
    }

    /// The next delay, or the server's `Retry-After` when that is longer (capped at `max`, so
    /// one answer cannot park the agent for hours).
    pub fn next_with(&mut self, retry_after: Option<Duration>) -> Duration {
        let delay = self.next();
        match retry_after {
            Some(after) if after > delay => after.min(self.max),
            _ => delay,
        }
    }

    /// Back to `min`, after a success.
    pub fn reset(&mut self) {
        self.next_base = self.min;
    }

    /// The shortest and longest steps.
    pub fn bounds(&self) -> (Duration, Duration) {
        (self.min, self.max)
    }
}

fn jittered(base: Duration, jitter: Jitter) -> Duration {
    let nanos = u64::try_from(base.as_nanos()).unwrap_or(u64::MAX);
    match jitter {
        Jitter::None => base,
        Jitter::Full => Duration::from_nanos(fastrand::u64(..=nanos)),
        Jitter::Equal => {
            let half = nanos / 2;
            Duration::from_nanos(nanos - half + fastrand::u64(..=half))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn doubles_up_to_max_without_jitter() {
        let mut b = Backoff::with_jitter(S, 10 * S, Jitter::None);
        let steps: Vec<u64> = (0..7).map(|_| b.next().as_secs()).collect();
        assert_eq!(steps, [1, 2, 4, 8, 10, 10, 10]);
        b.reset();
        assert_eq!(b.next(), S);
    }

    #[test]
    fn jitter_stays_in_bounds() {
        for jitter in [Jitter::Full, Jitter::Equal] {
            let mut b = Backoff::with_jitter(S, 8 * S, jitter);
            for step in 0..200 {
                let base = S * 2u32.pow(step.min(3));
                let d = b.next();
                let low = if jitter == Jitter::Equal {
                    base / 2
                } else {
                    Duration::ZERO
                };
                assert!(
                    d >= low && d <= base,
                    "{jitter:?} step {step}: {d:?} not in [{low:?}, {base:?}]"
                );
            }
        }
        // Not all the same: it is random.
        let mut b = Backoff::new(S, S);
        let first = b.next();
        assert!((0..50).any(|_| b.next() != first));
    }

    #[test]
    fn retry_after_wins_when_longer_but_is_capped() {
        let mut b = Backoff::with_jitter(S, 60 * S, Jitter::None);
        assert_eq!(b.next_with(Some(5 * S)), 5 * S);
        assert_eq!(b.next_with(Some(S)), 2 * S);
        assert_eq!(b.next_with(None), 4 * S);
        assert_eq!(b.next_with(Some(3600 * S)), 60 * S);
    }

    #[test]
    fn max_below_min_is_raised() {
        let mut b = Backoff::with_jitter(5 * S, S, Jitter::None);
        assert_eq!(b.bounds(), (5 * S, 5 * S));
        assert_eq!(b.next(), 5 * S);
        assert_eq!(b.next(), 5 * S);
    }
}
