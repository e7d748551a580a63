//! The two shapes every entry point takes.

/// The real NCCL's `$name`, as a function pointer of the given type, resolved once. Where
/// there is no real NCCL (or it lacks the symbol) the enclosing function records why (for
/// `ncclGetLastError`) and returns `$missing`.
macro_rules! real_fn {
    ($name:ident ( $($t:ty),* $(,)? ) -> $ret:ty, $missing:expr $(,)?) => {
        real_fn!($name as unsafe extern "C" fn($($t),*) -> $ret, $missing)
    };
    // With the function pointer type named (entry points that share one signature).
    ($name:ident as $fty:ty, $missing:expr $(,)?) => {{
        use std::sync::atomic::{AtomicPtr, Ordering};
        static PTR: AtomicPtr<std::ffi::c_void> = AtomicPtr::new(std::ptr::null_mut());
        let mut p = PTR.load(Ordering::Acquire);
        if p.is_null() {
            let name = concat!(stringify!($name), "\0");
            let name = std::ffi::CStr::from_bytes_with_nul(name.as_bytes()).expect("one NUL");
            match $crate::real::real().map_err(str::to_string).and_then(|r| r.sym(name)) {
                Ok(found) => {
                    PTR.store(found, Ordering::Release);
                    p = found;
                }
                Err(e) => {
                    $crate::errors::set_global(&e);
                    return $missing;
                }
            }
        }
        // SAFETY: the real NCCL's symbol of this name has this C signature (nccl.h).
        unsafe { std::mem::transmute::<*mut std::ffi::c_void, $fty>(p) }
    }};
}

/// Entry points forwarded as they are, each exported under NCCL's name and its `pnccl`
/// profiling alias.
macro_rules! forward {
    ($( fn $name:ident / $pname:ident ( $($a:ident : $t:ty),* $(,)? ) -> $ret:ty = $missing:expr; )*) => {$(
        #[no_mangle]
        pub unsafe extern "C" fn $name($($a: $t),*) -> $ret {
            $crate::log::forwarded(stringify!($name));
            $crate::group::before_other(stringify!($name));
            let f = real_fn!($name($($t),*) -> $ret, $missing);
            // SAFETY: the caller's arguments, handed on unchanged.
            unsafe { f($($a),*) }
        }

        #[no_mangle]
        pub unsafe extern "C" fn $pname($($a: $t),*) -> $ret {
            // SAFETY: as the function it aliases.
            unsafe { $name($($a),*) }
        }
    )*};
}

/// An entry point with a body of its own, exported under NCCL's name and its `pnccl` alias.
macro_rules! entry {
    ($( fn $name:ident / $pname:ident ( $($a:ident : $t:ty),* $(,)? ) -> $ret:ty $body:block )*) => {$(
        #[no_mangle]
        pub unsafe extern "C" fn $name($($a: $t),*) -> $ret $body

        #[no_mangle]
        pub unsafe extern "C" fn $pname($($a: $t),*) -> $ret {
            // SAFETY: as the function it aliases.
            unsafe { $name($($a),*) }
        }
    )*};
}
