//! Run-time choice of instruction set. Kernels are written once as
//! `#[inline(always)]` bodies; thin wrappers compile them for each target
//! feature set, and [`level`] picks the widest the CPU has.
//!
//! On aarch64 every level's float code is the portable code, which the
//! compiler vectorizes with NEON (part of every aarch64 CPU); the levels
//! there choose the integer kernels (`intdot_neon`): none (`portable`),
//! NEON's widening multiplies (`neon`), the `sdot` instruction (`dotprod`),
//! or `sdot` and, for two activation rows or more, `smmla` (`i8mm`).

/// Instruction sets a kernel may be compiled for, narrowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "aarch64")]
    Neon,
    #[cfg(target_arch = "aarch64")]
    Dotprod,
    #[cfg(target_arch = "aarch64")]
    I8mm,
}

impl Level {
    /// Every level this architecture has, narrowest first.
    pub const ALL: &'static [Level] = &[
        Level::Portable,
        #[cfg(target_arch = "x86_64")]
        Level::Avx2,
        #[cfg(target_arch = "x86_64")]
        Level::Avx512,
        #[cfg(target_arch = "aarch64")]
        Level::Neon,
        #[cfg(target_arch = "aarch64")]
        Level::Dotprod,
        #[cfg(target_arch = "aarch64")]
        Level::I8mm,
    ];

    /// The name `GEMMA4_KERNEL_LEVEL` and reports use.
    pub fn name(self) -> &'static str {
        match self {
            Level::Portable => "portable",
            #[cfg(target_arch = "x86_64")]
            Level::Avx2 => "avx2",
            #[cfg(target_arch = "x86_64")]
            Level::Avx512 => "avx512",
            #[cfg(target_arch = "aarch64")]
            Level::Neon => "neon",
            #[cfg(target_arch = "aarch64")]
            Level::Dotprod => "dotprod",
            #[cfg(target_arch = "aarch64")]
            Level::I8mm => "i8mm",
        }
    }
}

/// The widest level this CPU supports, at most the one `GEMMA4_KERNEL_LEVEL`
/// names (`portable`, `avx2`, `avx512`; on aarch64 `portable`, `neon`,
/// `dotprod`, `i8mm`): the narrower levels' kernels can then be run, and tested,
/// on a CPU that has a wider one. Decided once.
#[inline]
pub fn level() -> Level {
    static LEVEL: std::sync::OnceLock<Level> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| {
        let detected = detected();
        match std::env::var("GEMMA4_KERNEL_LEVEL") {
            Ok(name) => match capped(detected, &name) {
                Some(level) => level,
                None => {
                    let names: Vec<&str> = Level::ALL.iter().map(|l| l.name()).collect();
                    eprintln!(
                        "GEMMA4_KERNEL_LEVEL={name:?} names no kernel level of this CPU's architecture ({}); using {}",
                        names.join(", "),
                        detected.name()
                    );
                    detected
                }
            },
            Err(_) => detected,
        }
    })
}

/// The widest level this CPU supports.
#[cfg(not(target_arch = "aarch64"))]
fn detected() -> Level {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("fma")
        {
            return Level::Avx512;
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return Level::Avx2;
        }
    }
    Level::Portable
}

/// The widest level this CPU supports: NEON is part of every aarch64 CPU.
#[cfg(target_arch = "aarch64")]
fn detected() -> Level {
    use std::arch::is_aarch64_feature_detected;
    if is_aarch64_feature_detected!("dotprod") && is_aarch64_feature_detected!("i8mm") {
        Level::I8mm
    } else if is_aarch64_feature_detected!("dotprod") {
        Level::Dotprod
    } else {
        Level::Neon
    }
}

/// `detected`, capped at the level `name` names; `None` for no level's name.
fn capped(detected: Level, name: &str) -> Option<Level> {
    let wanted = name.trim().to_ascii_lowercase();
    let cap = Level::ALL.iter().find(|l| l.name() == wanted)?;
    Some(detected.min(*cap))
}

/// Defines `pub fn $name(args) -> ret` that calls `$body` compiled for the
/// best available level.
macro_rules! multiversion {
    ($(#[$m:meta])* pub fn $name:ident($($arg:ident: $ty:ty),*) => $body:ident) => {
        $crate::dispatch::multiversion!($(#[$m])* pub fn $name($($arg: $ty),*) -> () => $body);
    };
    ($(#[$m:meta])* pub fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty => $body:ident) => {
        $(#[$m])*
        pub fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma,f16c")]
                unsafe fn avx2($($arg: $ty),*) -> $ret {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
                unsafe fn avx512($($arg: $ty),*) -> $ret {
                    $body($($arg),*)
                }
                match $crate::dispatch::level() {
                    // SAFETY: `level` reported these features on this CPU.
                    $crate::dispatch::Level::Avx512 => return unsafe { avx512($($arg),*) },
                    $crate::dispatch::Level::Avx2 => return unsafe { avx2($($arg),*) },
                    $crate::dispatch::Level::Portable => {}
                }
            }
            $body($($arg),*)
        }
    };
}
pub(crate) use multiversion;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cap_only_narrows_the_level() {
        let widest = *Level::ALL.last().expect("levels");
        assert_eq!(
            capped(Level::Portable, widest.name()),
            Some(Level::Portable)
        );
        assert_eq!(capped(detected(), "portable"), Some(Level::Portable));
        assert_eq!(
            capped(detected(), &widest.name().to_uppercase()),
            Some(detected())
        );
        assert_eq!(capped(detected(), "sse9"), None);
        #[cfg(target_arch = "x86_64")]
        assert_eq!(capped(Level::Avx512, "avx2"), Some(Level::Avx2));
        #[cfg(target_arch = "x86_64")]
        assert_eq!(capped(Level::Avx2, "neon"), None);
        #[cfg(target_arch = "aarch64")]
        {
            assert_eq!(capped(Level::I8mm, "dotprod"), Some(Level::Dotprod));
            assert_eq!(capped(Level::Dotprod, "neon"), Some(Level::Neon));
            assert_eq!(capped(Level::Neon, "dotprod"), Some(Level::Neon));
            assert_eq!(capped(Level::Dotprod, "avx2"), None);
        }
    }
}
