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

/// The widest level this CPU supports (detected once, then cached by std).
#[inline]
pub fn level() -> Level {
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
