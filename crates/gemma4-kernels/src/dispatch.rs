//! Run-time choice of instruction set. Kernels are written once as
//! `#[inline(always)]` bodies; thin wrappers compile them for each target
//! feature set, and [`level`] picks the widest the CPU has.

/// Instruction sets a kernel may be compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

/// The widest level this CPU supports, at most the one `GEMMA4_KERNEL_LEVEL`
/// names (`portable`, `avx2`, `avx512`): the narrower levels' kernels can
/// then be run, and tested, on a CPU that has a wider one. Decided once.
#[inline]
pub fn level() -> Level {
    static LEVEL: std::sync::OnceLock<Level> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| {
        let detected = detected();
        match std::env::var("GEMMA4_KERNEL_LEVEL") {
            Ok(name) => match capped(detected, &name) {
                Some(level) => level,
                None => {
                    eprintln!(
                        "GEMMA4_KERNEL_LEVEL={name:?} names no kernel level (portable, avx2, avx512); using {detected:?}"
                    );
                    detected
                }
            },
            Err(_) => detected,
        }
    })
}

/// The widest level this CPU supports.
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

/// `detected`, capped at the level `name` names; `None` for no level's name.
fn capped(detected: Level, name: &str) -> Option<Level> {
    let rank = |l: Level| match l {
        Level::Portable => 0,
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => 1,
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => 2,
    };
    let cap = match name.trim().to_ascii_lowercase().as_str() {
        "portable" => Level::Portable,
        #[cfg(target_arch = "x86_64")]
        "avx2" => Level::Avx2,
        #[cfg(target_arch = "x86_64")]
        "avx512" => Level::Avx512,
        _ => return None,
    };
    Some(if rank(cap) < rank(detected) {
        cap
    } else {
        detected
    })
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
        assert_eq!(capped(Level::Portable, "avx512"), Some(Level::Portable));
        assert_eq!(capped(detected(), "portable"), Some(Level::Portable));
        assert_eq!(capped(detected(), "AVX512"), Some(detected()));
        assert_eq!(capped(detected(), "sse9"), None);
        #[cfg(target_arch = "x86_64")]
        assert_eq!(capped(Level::Avx512, "avx2"), Some(Level::Avx2));
    }
}
