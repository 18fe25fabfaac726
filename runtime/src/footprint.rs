//! The agent's own binary in memory: start-up touches code and read-only data that a running
//! agent never touches again (argument parsing, the registry's validation, loading and linking
//! modules), and the kernel maps each touched page's neighbours with it (fault-around, 64 KiB).
//! Measured on `devicelet-node` with one module: about 290 page faults in the binary's code left
//! 13 MB of it resident. Once the agent is first ready, [`release_start_up_pages`] unmaps the
//! binary's read-only pages; what the agent uses from then on faults back in from the page
//! cache while the file's pages stay cached there, and the rest stays out of its resident set.
//! Breakpoints placed in the code before the release (a debugger's, uprobes) are dropped with
//! the pages.

use std::ops::Range;

/// How many bytes of the binary's read-only segments were unmapped; 0 where nothing was (no
/// read-only segment found, or the binary relocates its code: DT_TEXTREL).
pub fn release_start_up_pages() -> usize {
    let mut released = 0;
    for range in read_only_segments() {
        let len = range.end - range.start;
        // SAFETY: `range` lies inside a PT_LOAD segment of this executable without PF_W,
        // rounded inwards to whole pages: a private, never-written file mapping (code,
        // read-only data). MADV_DONTNEED only drops its page-table entries; the next access
        // reads the same bytes back from the file, so no thread can see different memory.
        let rc =
            unsafe { libc::madvise(range.start as *mut libc::c_void, len, libc::MADV_DONTNEED) };
        if rc == 0 {
            released += len;
        }
    }
    released
}

/// The executable's read-only loadable segments (PT_LOAD without PF_W, their bytes from the
/// file: `p_filesz`), as page-aligned address ranges rounded inwards. The RELRO part of the
/// writable segment is excluded on purpose: the dynamic loader wrote relocations there before
/// making it read-only, so its pages differ from the file. None at all when the binary has text
/// relocations (the loader wrote into its code too).
fn read_only_segments() -> Vec<Range<usize>> {
    let mut found = Found::default();
    // SAFETY: the callback only reads the `dl_phdr_info` it is given, for the duration of the
    // call, and writes to the `Found` passed through `data`, which outlives the call.
    unsafe {
        libc::dl_iterate_phdr(Some(collect), (&mut found as *mut Found).cast());
    }
    if found.text_relocations {
        return Vec::new();
    }
    found.ranges
}

#[derive(Default)]
struct Found {
    ranges: Vec<Range<usize>>,
    text_relocations: bool,
}

/// An entry of the dynamic section (`Elf64_Dyn`; the libc crate has no Linux binding for it).
#[repr(C)]
struct Dyn {
    tag: i64,
    value: u64,
}

const DT_TEXTREL: i64 = 22;
const DT_FLAGS: i64 = 30;
const DF_TEXTREL: u64 = 0x4;

/// `dl_iterate_phdr`'s callback: the first object is the executable itself; stop after it.
unsafe extern "C" fn collect(
    info: *mut libc::dl_phdr_info,
    _size: libc::size_t,
    data: *mut libc::c_void,
) -> libc::c_int {
    // SAFETY: dl_iterate_phdr passes a valid info for the call and `data` as given above.
    let (info, found) = unsafe { (&*info, &mut *data.cast::<Found>()) };
    let page = page_size();
    let phdrs: &[libc::Elf64_Phdr] = if info.dlpi_phdr.is_null() {
        &[]
    } else {
        // SAFETY: dlpi_phdr points to dlpi_phnum program headers.
        unsafe { std::slice::from_raw_parts(info.dlpi_phdr, usize::from(info.dlpi_phnum)) }
    };
    for ph in phdrs {
        if ph.p_type == libc::PT_DYNAMIC {
            let dynamic = (info.dlpi_addr as usize + ph.p_vaddr as usize) as *const Dyn;
            // SAFETY: the loader mapped PT_DYNAMIC (it reads it itself); it ends at DT_NULL.
            found.text_relocations |= unsafe { relocates_text(dynamic) };
        }
        if ph.p_type != libc::PT_LOAD || ph.p_flags & libc::PF_W != 0 {
            continue;
        }
        let start = info.dlpi_addr as usize + ph.p_vaddr as usize;
        let end = start + ph.p_filesz as usize;
        let (start, end) = (start.div_ceil(page) * page, end / page * page);
        if start < end {
            found.ranges.push(start..end);
        }
    }
    1
}

/// Whether the dynamic section starting at `entry` asks the loader to write into the code.
///
/// # Safety
/// `entry` points to a mapped dynamic section ending with DT_NULL.
unsafe fn relocates_text(mut entry: *const Dyn) -> bool {
    loop {
        // SAFETY: within the section, per the caller; DT_NULL ends the loop.
        let dynamic = unsafe { &*entry };
        match dynamic.tag {
            0 => return false,
            DT_TEXTREL => return true,
            DT_FLAGS if dynamic.value & DF_TEXTREL != 0 => return true,
            _ => {}
        }
        // SAFETY: not past DT_NULL yet.
        entry = unsafe { entry.add(1) };
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size)
        .ok()
        .filter(|s| *s > 0)
        .unwrap_or(4096)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    static WRITTEN: AtomicUsize = AtomicUsize::new(1);
    /// Pointers in a position-independent executable: relocated at start, in the RELRO part.
    static RELOCATED: &[&str] = &["relocated", "at start"];
    /// Read-only data (a `static` without interior mutability lives in `.rodata`). Large enough
    /// that its middle page shares no 64 KiB fault-around window with anything else, so only
    /// reading it maps that page.
    static CONSTANT: [u8; 256 * 1024] = [0x5a; 256 * 1024];

    fn sum(bytes: &[u8]) -> u64 {
        bytes.iter().map(|b| u64::from(*b)).sum()
    }

    #[test]
    fn the_released_segments_hold_code_and_constants_and_nothing_the_loader_wrote() {
        let ranges = read_only_segments();
        let inside = |address: usize| ranges.iter().any(|r| r.contains(&address));
        let code = sum as fn(&[u8]) -> u64 as usize;
        assert!(inside(code), "code at {code:#x} not in {ranges:x?}");
        let constant = std::hint::black_box(&CONSTANT).as_ptr() as usize;
        assert!(
            inside(constant),
            "constant at {constant:#x} not in {ranges:x?}"
        );
        WRITTEN.fetch_add(1, Ordering::Relaxed);
        assert!(!inside(&WRITTEN as *const AtomicUsize as usize));
        assert!(!inside(RELOCATED.as_ptr() as usize));
    }

    /// Whether the page holding `address` is mapped in this process (`/proc/self/pagemap`).
    fn resident(address: usize) -> bool {
        use std::io::{Read, Seek, SeekFrom};
        let mut pagemap = std::fs::File::open("/proc/self/pagemap").expect("pagemap");
        let offset = (address / page_size() * 8) as u64;
        pagemap.seek(SeekFrom::Start(offset)).expect("seek");
        let mut entry = [0u8; 8];
        pagemap.read_exact(&mut entry).expect("read");
        u64::from_le_bytes(entry) >> 63 == 1
    }

    #[test]
    fn released_pages_leave_the_resident_set_and_read_back_the_same() {
        let before = sum(std::hint::black_box(&CONSTANT));
        let middle = CONSTANT.as_ptr() as usize + CONSTANT.len() / 2;
        assert!(resident(middle), "just read, yet not resident");
        assert!(release_start_up_pages() > 0);
        assert!(!resident(middle), "still resident after the release");
        assert_eq!(sum(std::hint::black_box(&CONSTANT)), before);
        assert!(resident(middle));
        assert_eq!(RELOCATED, ["relocated", "at start"]);
    }
}
