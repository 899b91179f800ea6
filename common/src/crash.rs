//! Named crash points for crash tests (DESIGN §6), shared by the services.
//!
//! A service names the narrow windows where dying is dangerous as a [`CrashPoint`] enum; an
//! environment variable arms one of them: `EM_<SERVICE>_CRASH_AT=<point>` aborts the process the
//! first time execution reaches the point, `<point>:<n>` the n-th time (so a test can crash in
//! the middle of a stream, with work in flight). The abort is like `kill -9`: no cleanup, no
//! flush, so a test hits that window deterministically. Unset (the normal case) a point costs
//! one initialised `OnceLock` read.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// A service's set of crash points.
pub trait CrashPoint: Copy + Eq + Send + Sync + std::fmt::Debug + 'static {
    /// The environment variable that arms a point, e.g. `EM_PULLER_CRASH_AT`.
    const ENV: &'static str;
    /// The process name printed when a point fires.
    const SERVICE: &'static str;
    /// Every point, for parsing and for `--help` texts.
    const ALL: &'static [Self];
    /// The point's name as written in the environment variable (`after-checkpoint`).
    fn name(self) -> &'static str;
}

/// Declares a service's crash points: the enum, its [`CrashPoint`] impl and the
/// `crash_point(point)` function the service calls at each of them.
///
/// ```ignore
/// eventmesh_common::crash_points! {
///     /// A place the process can be told to die.
///     pub enum CrashPoint: "EM_DEMO_CRASH_AT", "demo-svc" {
///         /// After the write.
///         AfterWrite = "after-write",
///     }
/// }
/// ```
#[macro_export]
macro_rules! crash_points {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident : $env:literal, $service:literal {
            $( $(#[$variant_meta:meta])* $variant:ident = $text:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        $vis enum $name {
            $( $(#[$variant_meta])* $variant, )+
        }

        impl $crate::crash::CrashPoint for $name {
            const ENV: &'static str = $env;
            const SERVICE: &'static str = $service;
            const ALL: &'static [Self] = &[ $( $name::$variant, )+ ];
            fn name(self) -> &'static str {
                match self {
                    $( $name::$variant => $text, )+
                }
            }
        }

        /// Aborts the process if `point` is armed (and this is the armed visit).
        $vis fn crash_point(point: $name) {
            static ARMED: ::std::sync::OnceLock<Option<$crate::crash::Armed<$name>>> =
                ::std::sync::OnceLock::new();
            $crate::crash::reach(&ARMED, point);
        }
    };
}

/// Parses a point's name.
pub fn parse<P: CrashPoint>(text: &str) -> Option<P> {
    P::ALL.iter().copied().find(|point| point.name() == text)
}

/// An armed point: abort on the `at`-th time it is reached.
#[derive(Debug)]
pub struct Armed<P> {
    point: P,
    at: u64,
    reached: AtomicU64,
}

/// Parses `<point>` or `<point>:<n>` (n ≥ 1).
pub fn parse_armed<P: CrashPoint>(text: &str) -> Option<Armed<P>> {
    let (name, at) = match text.split_once(':') {
        Some((name, n)) => (name, n.parse::<u64>().ok().filter(|n| *n >= 1)?),
        None => (text, 1),
    };
    Some(Armed {
        point: parse::<P>(name)?,
        at,
        reached: AtomicU64::new(0),
    })
}

/// Reads the armed point from the environment once; an unknown value is logged and arms nothing.
pub fn armed<P: CrashPoint>(cell: &OnceLock<Option<Armed<P>>>) -> Option<&Armed<P>> {
    cell.get_or_init(|| {
        let value = std::env::var(P::ENV).ok()?;
        let armed = parse_armed::<P>(&value);
        if armed.is_none() {
            let known: Vec<&str> = P::ALL.iter().map(|p| p.name()).collect();
            tracing::error!(
                value,
                ?known,
                "unusable {} (want <point> or <point>:<n>); no crash point armed",
                P::ENV
            );
        }
        armed
    })
    .as_ref()
}

/// Aborts the process when `point` is the armed one and this is the armed visit.
pub fn reach<P: CrashPoint>(cell: &OnceLock<Option<Armed<P>>>, point: P) {
    let Some(armed) = armed(cell) else { return };
    if armed.point == point && armed.reached.fetch_add(1, Ordering::Relaxed) + 1 == armed.at {
        eprintln!(
            "{}: crash point {} reached (visit {}); aborting",
            P::SERVICE,
            point.name(),
            armed.at
        );
        std::process::abort();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    crate::crash_points! {
        enum Demo: "EM_COMMON_TEST_CRASH_AT", "demo" {
            Early = "early",
            Late = "late",
        }
    }

    #[test]
    fn every_name_parses_back_and_unknown_names_do_not() {
        for point in Demo::ALL {
            assert_eq!(parse::<Demo>(point.name()), Some(*point));
        }
        assert_eq!(parse::<Demo>("later"), None);
        assert_eq!(parse::<Demo>(""), None);
    }

    #[test]
    fn a_visit_count_can_follow_the_name() {
        let armed = parse_armed::<Demo>("late:40").unwrap();
        assert_eq!((armed.point, armed.at), (Demo::Late, 40));
        let armed = parse_armed::<Demo>("early").unwrap();
        assert_eq!((armed.point, armed.at), (Demo::Early, 1));
        for bad in ["late:0", "late:", "late:x", "later:3", ":3"] {
            assert!(parse_armed::<Demo>(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn only_the_armed_visit_aborts() {
        let cell = OnceLock::new();
        assert!(cell.set(parse_armed::<Demo>("late:3")).is_ok());
        // Visits 1 and 2 of `late`, and any visit of `early`, pass.
        reach(&cell, Demo::Late);
        reach(&cell, Demo::Early);
        reach(&cell, Demo::Late);
        assert_eq!(
            armed(&cell).map(|a| a.reached.load(Ordering::Relaxed)),
            Some(2)
        );
    }

    #[test]
    fn nothing_is_armed_without_the_variable() {
        let cell = OnceLock::new();
        assert!(armed::<Demo>(&cell).is_none());
        reach(&cell, Demo::Early);
        // The generated function reads the (unset) variable and returns.
        crash_point(Demo::Late);
    }
}
