//! Compiling a component without keeping what the compiler used.
//!
//! Cranelift compiles a component's functions in parallel on rayon's threads, and rayon's global
//! pool never lets them go: after one cold start the agent would keep a thread per core, idle, for
//! the rest of its life. Compiles run in a pool of their own instead, dropped (its threads
//! ending) as soon as the component is ready. The compiler's heap is freed then too, but glibc
//! keeps freed memory mapped; it is handed back to the kernel, so the agent's resident memory
//! after a cold start is what it is after a warm one.

use wasmtime::Engine;
use wasmtime::component::Component;

pub fn compile(engine: &Engine, wasm: &[u8]) -> wasmtime::Result<Component> {
    let pool = rayon::ThreadPoolBuilder::new()
        .thread_name(|i| format!("compile-{i}"))
        .build();
    let component = match pool {
        Ok(pool) => pool.install(|| Component::from_binary(engine, wasm)),
        // No threads to be had: compile on this one.
        Err(_) => Component::from_binary(engine, wasm),
    };
    return_freed_memory();
    component
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn return_freed_memory() {
    // SAFETY: malloc_trim only walks glibc's own arenas; it takes no pointers of ours.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn return_freed_memory() {}
